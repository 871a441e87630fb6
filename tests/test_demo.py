"""Tests of ``python -m jax_moe_a2a demo`` (jax_moe_a2a.demo), on small shapes."""

import os
import subprocess
import sys

import pytest

from conftest import devices
from jax_moe_a2a import demo

SMALL = ["--experts", "16", "--top-k", "4", "--hidden", "256", "--ffn", "128", "--tokens", "16", "--steps", "1"]


def _env():
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # the demo must ask for the 8 simulated devices itself
  env["JAX_PLATFORMS"] = "cpu"
  return env


def test_help_documents_the_options():
  out = subprocess.run([sys.executable, "-m", "jax_moe_a2a", "demo", "--help"], capture_output=True, text=True,
                       env=_env(), check=True, timeout=60).stdout
  for option in ("--wire", "--experts", "--top-k", "--hidden", "--ffn", "--tokens", "--sequence-parallel", "--tp",
                 "--fp8-weights", "--dtype", "--steps"):
    assert option in out, option


@pytest.mark.parametrize("wire,bytes_line,limit", [
    ("fp8_blockwise", "fp8_blockwise: 256 B x + 8 B scales + 16 B ids + 16 B weights = 296 B per token", "2e-03"),
    ("mxfp8", "mxfp8: 256 B x + 8 B scales + 16 B ids + 16 B weights = 296 B per token", "2e-03"),
    ("nvfp4", "nvfp4: 128 B x + 16 B scales + 16 B ids + 16 B weights = 176 B per token", "3e-02"),
])
def test_demo_runs_on_eight_simulated_devices_and_passes(wire, bytes_line, limit):
  proc = subprocess.run([sys.executable, "-m", "jax_moe_a2a", "demo", *SMALL, "--wire", wire],
                        capture_output=True, text=True, env=_env(), timeout=600)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  out = proc.stdout
  assert "8 x cpu" in out and "data=1 x expert=8" in out
  assert bytes_line in out
  assert f"(limit calc_diff {limit})" in out
  for line in ("workspace", "output", "grad x", "grad router", "grad w_gate_up", "grad w_down", "step time"):
    assert line in out, line
  assert out.rstrip().endswith("PASS")


@pytest.mark.parametrize("calc_diffs,load_equal,loss_diff,ok", [
    ([1e-6, 2e-5], True, 0.0, True),
    ([1e-6, 2e-3], True, 0.0, False),  # one gradient over the limit
    ([1e-6, float("nan")], True, 0.0, False),
    ([1e-6, 2e-5], False, 0.0, False),  # different routing
    ([1e-6, 2e-5], True, 1e-3, False),  # a different load-balance loss
])
def test_verdict(calc_diffs, load_equal, loss_diff, ok):
  assert demo.passed(calc_diffs, limit=1e-4, load_equal=load_equal, loss_diff=loss_diff, loss_ref=1.0) is ok


@pytest.mark.parametrize("argv,message", [
    (["--tp", "3"], "--data and --tp must divide the device count 8"),
    (["--sequence-parallel"], "--sequence-parallel needs --tp > 1"),
    (["--experts", "12"], "--experts must be divisible by the 8 ranks of the expert axis, got 12"),
    (["--wire", "fp8_blockwise", "--hidden", "200"], "does not fit wire_format 'fp8_blockwise'"),
    (["--gemm", "ffi", "--expert-precision", "dtype"],
     "--expert-precision must be fp8 with --gemm ffi (deprecated, read as --expert-precision fp8), got dtype"),
])
def test_bad_arguments_exit_2(argv, message, capsys):
  devices(8)  # the messages are those of eight devices
  assert demo.run(demo.parser().parse_args(SMALL + argv)) == 2
  assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv,precision", [
    ([], "dtype"), (["--expert-precision", "fp8"], "fp8"), (["--expert-precision", "dtype"], "dtype"),
    (["--gemm", "ffi"], "fp8"), (["--gemm", "reference"], "fp8"),
    (["--gemm", "ffi", "--expert-precision", "fp8"], "fp8"),
])
def test_expert_precision_from_the_options_and_the_deprecated_gemm(argv, precision):
  assert demo.expert_precision(demo.parser().parse_args(SMALL + argv)) == precision


def test_simulated_devices_are_requested_only_before_jax_is_imported(monkeypatch):
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  assert not demo.simulate_cpu_devices()  # jax is already imported here
  assert "XLA_FLAGS" not in os.environ
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  assert demo._platform_will_be_cpu()  # pylint: disable=protected-access
  monkeypatch.setenv("JAX_PLATFORMS", "cuda")
  assert not demo._platform_will_be_cpu()  # pylint: disable=protected-access
