"""The benchmark scripts run end to end on the simulated CPU devices (tiny sizes), so CI keeps them working."""

import json
import os
import sys

import pytest

from jax_moe_a2a import _ffi

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


@pytest.mark.skipif(not _ffi.available(), reason="compiled extension not built")
def test_bench_a2a_writes_every_implementation_and_a_plot(tmp_path):
  sys.path.insert(0, BENCH)
  try:
    import bench_a2a  # pylint: disable=import-outside-toplevel
  finally:
    sys.path.remove(BENCH)
  assert bench_a2a.main(["--tokens", "3", "--formats", "bf16", "fp8_blockwise", "--hidden", "256", "--experts", "16",
                         "--top-k", "2", "--chain", "2", "--runs", "2", "--out", str(tmp_path)]) == 0
  (path,) = [p for p in tmp_path.iterdir() if p.suffix == ".json"]
  rec = json.loads(path.read_text())
  assert rec["processes"] == 1 and rec["hidden"] == 256
  got = {(r["fmt"], r["op"], r["impl"]) for r in rec["rows"]}
  for fmt in ("bf16", "fp8_blockwise"):
    for impl in ("ffi", "twin", "all_to_all"):
      assert {(fmt, "dispatch", impl), (fmt, "combine", impl)} <= got
  assert all(r["chain_us"] is not None and r["gpu_us"] is None for r in rec["rows"])  # no GPU trace on CPU
  assert path.with_suffix(".png").exists()
