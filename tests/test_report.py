"""Tests of ``python -m jax_moe_a2a report``: payload sizes per wire format and workspace sizes."""

import subprocess
import sys

from jax_moe_a2a import layout


def test_report_gives_the_workspace_size_for_inference_and_for_training():
  out = subprocess.run([sys.executable, "-m", "jax_moe_a2a", "report", "--hidden", "256", "--ranks", "2",
                        "--capacity", "16", "--tokens", "8"], capture_output=True, text=True, check=True,
                       timeout=300).stdout
  line = next(l for l in out.splitlines() if l.split()[:1] == ["fp8_blockwise"])
  assert line.split()[1:6] == ["256", "8", "32", "32", "328"], line
  sizes = dict(num_ranks=2, capacity=16, hidden=256, top_k=8, fmt="fp8_blockwise")
  inference = layout.workspace_layout(**sizes).total_bytes
  training = layout.workspace_layout(**sizes, training=True).total_bytes  # room for bf16 rows
  assert training > inference
  assert f"{inference / 1024:.1f} KiB; {training / 1024:.1f} KiB for training" in line, line
