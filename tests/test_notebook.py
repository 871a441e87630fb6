"""Executes notebooks/quickstart.ipynb from top to bottom, as CI does, through `bench notebook`'s runner: any cell
that raises fails the test, and the figures the runner keeps must be there."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import bench_notebook  # noqa: E402


def test_quickstart_notebook_runs(tmp_path):
  pytest.importorskip("nbclient", reason="nbclient is not installed (pip install -e '.[test]')")
  nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (pip install -e '.[test]')")
  # The kernel inherits this process's environment: 8 simulated CPU devices (conftest), or the GPUs of a GPU run.
  record, png = bench_notebook.run(str(tmp_path / "executed.ipynb"))
  nb = nbformat.read(tmp_path / "executed.ipynb", as_version=4)
  outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
  assert not [o for o in outputs if o.get("output_type") == "error"]
  assert sum("image/png" in o.get("data", {}) for o in outputs) == 2, "the routing and wire-format figures"
  assert png.startswith(b"\x89PNG")
  text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
  assert "calc_diff vs oracle" in text and "same routing: True" in text
  from jax_moe_a2a import moe  # pylint: disable=import-outside-toplevel
  assert set(record["wire"]) == set(moe.WIRE_FORMATS)
  assert set(record["fwd_bwd_ms"]) == {"einsum (bf16)", "layer, bf16 experts", "layer, FP8 experts"}
  assert all(ms > 0 for ms in record["fwd_bwd_ms"].values())
  assert record["calc_diff"]["fp8_wire"] < 2e-3 and record["calc_diff"]["fp8_experts"] < 5e-3
