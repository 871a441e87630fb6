"""Executes notebooks/quickstart.ipynb from top to bottom, as CI does; any cell that raises fails the test."""

import os
import pathlib

import pytest

NOTEBOOK = pathlib.Path(__file__).resolve().parent.parent / "notebooks" / "quickstart.ipynb"


def test_quickstart_notebook_runs():
  nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed (pip install -e '.[test]')")
  nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (pip install -e '.[test]')")
  nb = nbformat.read(NOTEBOOK, as_version=4)
  # The kernel runs JAX on 8 simulated CPU devices whatever this process uses.
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": str(NOTEBOOK.parent)}})
  client.execute(env=env)
  outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
  assert not [o for o in outputs if o.get("output_type") == "error"]
  assert any("image/png" in o.get("data", {}) for o in outputs), "the routing histogram was not drawn"
  text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
  assert "calc_diff vs oracle" in text and "same routing: True" in text
