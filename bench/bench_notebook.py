"""Executes notebooks/quickstart.ipynb on this machine's devices (the GPUs where there are any, else 8 simulated CPU
devices) and keeps its figures: notebook_<date>.json (the notebook's RESULTS line: timings beside the einsum layer,
bytes and time per wire format, calc_diff against the oracle) and, beside it, the per-format figure as .png.

  python bench/bench_notebook.py [--executed PATH] [--out DIR]

--executed also writes the executed notebook (outputs included) to PATH.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write_result  # noqa: E402

NOTEBOOK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks", "quickstart.ipynb")
RESULTS_PREFIX = "RESULTS "


def run(executed: str | None) -> tuple[dict, bytes]:
  """Executes the notebook; returns its RESULTS record and the last figure it drew (PNG bytes)."""
  import nbclient  # pylint: disable=import-outside-toplevel
  import nbformat  # pylint: disable=import-outside-toplevel
  from jupyter_client.manager import KernelManager  # pylint: disable=import-outside-toplevel
  nb = nbformat.read(NOTEBOOK, as_version=4)
  # The kernel runs this interpreter: a kernel spec's "python" is whichever the PATH finds first, which is not this
  # environment's when it was not activated.
  km = KernelManager(kernel_name="python3")
  km.kernel_spec.argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
  resources = {"metadata": {"path": os.path.dirname(NOTEBOOK)}}
  nbclient.NotebookClient(nb, km=km, timeout=1200, resources=resources).execute()
  if executed:
    nbformat.write(nb, executed)
  outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
  text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
  lines = [line[len(RESULTS_PREFIX):] for line in text.splitlines() if line.startswith(RESULTS_PREFIX)]
  pngs = [o["data"]["image/png"] for o in outputs if "image/png" in o.get("data", {})]
  if not lines or not pngs:
    raise RuntimeError(f"bench notebook: {NOTEBOOK} printed no {RESULTS_PREFIX!r} line or drew no figure")
  return json.loads(lines[-1]), base64.b64decode(pngs[-1])


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--executed", default=None, help="also write the executed notebook here")
  p.add_argument("--out", default=None, help="directory for the JSON result (default bench/results)")
  args = p.parse_args()
  record, png = run(args.executed)
  path = write_result("notebook", {"notebook": os.path.relpath(NOTEBOOK, os.path.dirname(os.path.dirname(NOTEBOOK))),
                                   **record}, args.out)
  with open(os.path.splitext(path)[0] + ".png", "wb") as f:
    f.write(png)
  print("wrote", path)
  for name, ms in record["fwd_bwd_ms"].items():
    print(f"  {name:22s} {ms:8.2f} ms forward+backward")


if __name__ == "__main__":
  main()
