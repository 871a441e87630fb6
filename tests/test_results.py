"""bench/results/ kept honest: one name style, every file records the commit it measured, every file is cited by the
docs or is the latest of its bench, every file the docs cite exists, and results measured on code that was never
committed are labelled (in the file and in docs/PERFORMANCE.md) and cited by no code.

`problems` does the checking on any folder and texts, so the tests below can show it catching each kind of fault."""

import json
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")

# <bench>_<YYYYMMDD-HHMMSS>.json, or the plot of such a file beside it as .png.
NAME = re.compile(r"^(?P<bench>[a-z0-9]+(?:_[a-z0-9]+)*)_(?P<stamp>\d{8}-\d{6})\.(?P<ext>json|png)$")
# What a citation looks like in prose: a result name with any timestamp style or extension, or a pattern.
CITED = re.compile(r"\b[a-z0-9]+(?:_[a-z0-9]+)*_(?:\d{8}(?:-\d{4,6})?|\*)\.(?:json|png|csv)\b")
HASH = re.compile(r"\b[0-9a-f]{7,40}\b")
UNCOMMITTED_SECTION = "## Measured on code that was never committed"
# A commit record that says the measured code differed from every commit: it must carry the "uncommitted" label.
UNCOMMITTED_HINT = re.compile(r"not committed|working[- ]tree variants|working tree of|temporary|\+(?!dirty\b)\w")


def _section(text, heading):
  start = text.find(heading)
  if start < 0:
    return ""
  end = text.find("\n## ", start + len(heading))
  return text[start:end if end >= 0 else len(text)]


def _commit_exists(commit):
  r = subprocess.run(["git", "-C", ROOT, "cat-file", "-e", commit + "^{commit}"], capture_output=True, check=False)
  return r.returncode == 0


def _full_history():
  """Whether the checkout has its history (not a copy without .git, not a shallow clone)."""
  try:
    r = subprocess.run(["git", "-C", ROOT, "rev-parse", "--is-shallow-repository"], capture_output=True, text=True,
                       check=False)
  except OSError:
    return False
  return r.returncode == 0 and r.stdout.strip() == "false"


def problems(results_dir, docs, performance, code, commit_exists=None):
  """What is wrong with `results_dir` given the docs' text (`docs`, README and docs/*.md together), the text of
  docs/PERFORMANCE.md (`performance`) and the code's text per path (`code`); `commit_exists(hash)` (None: not
  checked) says whether a commit is in the repository."""
  out = []
  files = sorted(os.listdir(results_dir))
  parsed = {f: NAME.match(f) for f in files}
  for f, m in parsed.items():
    if m is None:
      out.append(f"{f}: name must be <bench>_<YYYYMMDD-HHMMSS>.json or .png")
  jsons = {f for f, m in parsed.items() if m and m["ext"] == "json"}
  for f, m in parsed.items():
    if m and m["ext"] == "png" and f[:-4] + ".json" not in jsons:
      out.append(f"{f}: a plot must sit beside its result file {f[:-4]}.json")

  latest = {}
  for f in jsons:
    m = parsed[f]
    latest[m["bench"]] = max(latest.get(m["bench"], ""), m["stamp"])
  cited = set(CITED.findall(docs))
  for f in sorted(jsons):
    m = parsed[f]
    if f not in cited and m["stamp"] != latest[m["bench"]]:
      out.append(f"{f}: cited by no doc and not the latest {m['bench']} result")
  for c in sorted(cited):
    if c not in files:
      out.append(f"{c}: cited by the docs but not in bench/results")

  listed = set(CITED.findall(_section(performance, UNCOMMITTED_SECTION)))
  labelled = set()
  for f in sorted(jsons):
    with open(os.path.join(results_dir, f), encoding="utf-8") as fh:
      record = json.load(fh)
    commit = record.get("commit") if isinstance(record, dict) else None
    if not isinstance(commit, str) or not HASH.search(commit):
      out.append(f"{f}: must record the commit it measured (a 'commit' field naming a hash), got {commit!r}")
      continue
    if commit_exists is not None:
      for h in HASH.findall(commit):
        if not commit_exists(h):
          out.append(f"{f}: records commit {h}, which the repository does not have")
    note = str(record.get("commit_note", ""))
    if "uncommitted" in record:
      labelled.add(f)
    elif UNCOMMITTED_HINT.search(commit) or (commit.endswith("+dirty") and "Measured tree:" not in note):
      out.append(f"{f}: its commit record ({commit!r}) says the code differed from every commit: label it "
                 f"('uncommitted': what differed) and list it under {UNCOMMITTED_SECTION!r}")
  for f in sorted(labelled - listed):
    out.append(f"{f}: measured on uncommitted code but not listed under {UNCOMMITTED_SECTION!r} in PERFORMANCE.md")
  for f in sorted(listed - labelled):
    out.append(f"{f}: listed under {UNCOMMITTED_SECTION!r} but its file carries no 'uncommitted' label")
  for path, text in sorted(code.items()):
    for f in sorted(labelled & set(CITED.findall(text))):
      out.append(f"{path}: cites {f}, measured on code that was never committed")
  return out


def _read(path):
  with open(path, encoding="utf-8") as f:
    return f.read()


def _repository_texts():
  docs_dir = os.path.join(ROOT, "docs")
  docs = _read(os.path.join(ROOT, "README.md")) + "".join(
      _read(os.path.join(docs_dir, f)) for f in sorted(os.listdir(docs_dir)) if f.endswith(".md"))
  code = {}
  for folder in ("jax_moe_a2a", "ffi", "bench", "tests", "notebooks"):
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, folder)):
      dirnames[:] = [d for d in dirnames if d != "results" and not d.startswith((".", "__"))]
      for f in filenames:
        if f.endswith((".py", ".cu", ".cuh", ".cc", ".h", ".sh", ".ipynb", ".txt")) and f != "test_results.py":
          code[os.path.relpath(os.path.join(dirpath, f), ROOT)] = _read(os.path.join(dirpath, f))
  return docs, _read(os.path.join(docs_dir, "PERFORMANCE.md")), code


def test_the_repository_results_are_honest():
  docs, performance, code = _repository_texts()
  found = problems(RESULTS, docs, performance, code, _commit_exists if _full_history() else None)
  assert not found, "\n".join(found)


# ---------------------------------------------------------------------------------------------------------------
# The checker on made-up folders: each fault is reported.
# ---------------------------------------------------------------------------------------------------------------

GOOD = {"commit": "0123abc", "rows": []}


def _folder(tmp_path, files):
  for name, record in files.items():
    with open(tmp_path / name, "w", encoding="utf-8") as f:
      f.write(record if isinstance(record, str) else json.dumps(record))
  return str(tmp_path)


def test_a_clean_folder_has_no_problems(tmp_path):
  d = _folder(tmp_path, {"layer_20260101-000000.json": GOOD, "layer_20260101-000000.png": "",
                         "layer_20260102-000000.json": GOOD})
  assert problems(d, "see layer_20260101-000000.json", "", {}) == []


@pytest.mark.parametrize("name", ["layer_20260101.json", "layer_20260101-0000.json", "layer_20260101-000000.csv",
                                  "layer.json"])
def test_other_name_styles_are_reported(tmp_path, name):
  d = _folder(tmp_path, {name: GOOD})
  assert f"{name}: name must be <bench>_<YYYYMMDD-HHMMSS>.json or .png" in problems(d, name, "", {})


def test_a_plot_without_its_result_is_reported(tmp_path):
  d = _folder(tmp_path, {"gemm_20260101-000000.png": ""})
  assert problems(d, "", "", {}) == ["gemm_20260101-000000.png: a plot must sit beside its result file "
                                     "gemm_20260101-000000.json"]


def test_an_uncited_old_result_is_reported_and_the_latest_is_not(tmp_path):
  d = _folder(tmp_path, {"gemm_20260101-000000.json": GOOD, "gemm_20260102-000000.json": GOOD,
                         "layer_20260101-000000.json": GOOD})
  assert problems(d, "", "", {}) == ["gemm_20260101-000000.json: cited by no doc and not the latest gemm result"]


def test_a_cited_file_that_is_missing_is_reported(tmp_path):
  d = _folder(tmp_path, {"gemm_20260101-000000.json": GOOD})
  found = problems(d, "gemm_20260101-000000.json and layer_20260101-000000.json, a2a_sweep_*.json", "", {})
  assert found == ["a2a_sweep_*.json: cited by the docs but not in bench/results",
                   "layer_20260101-000000.json: cited by the docs but not in bench/results"]


@pytest.mark.parametrize("record", [{"rows": []}, {"commit": "", "rows": []}, {"commit": "unknown"}, [1, 2]])
def test_a_result_without_its_commit_is_reported(tmp_path, record):
  d = _folder(tmp_path, {"gemm_20260101-000000.json": record})
  assert problems(d, "", "", {})[0].startswith("gemm_20260101-000000.json: must record the commit it measured")


def test_a_commit_the_repository_lacks_is_reported(tmp_path):
  d = _folder(tmp_path, {"gemm_20260101-000000.json": {"commit": "0123abc, 4567def"}})
  assert problems(d, "", "", {}, commit_exists=lambda h: h == "0123abc") == [
      "gemm_20260101-000000.json: records commit 4567def, which the repository does not have"]


@pytest.mark.parametrize("commit,note", [("0123abc+dirty", ""), ("0123abc+my-patch", ""),
                                         ("0123abc plus a temporary patch (not committed)", ""),
                                         ("0123abc against working-tree variants", "")])
def test_a_result_of_uncommitted_code_must_be_labelled(tmp_path, commit, note):
  d = _folder(tmp_path, {"gemm_20260101-000000.json": {"commit": commit, "commit_note": note}})
  assert "its commit record" in problems(d, "", "", {})[0]


def test_a_dirty_copy_whose_measured_tree_is_named_needs_no_label(tmp_path):
  d = _folder(tmp_path, {"gemm_20260101-000000.json": {"commit": "0123abc+dirty",
                                                       "commit_note": "Measured tree: 4567def."}})
  assert problems(d, "", "", {}) == []


def test_labelled_results_must_be_listed_in_performance_md_and_cited_by_no_code(tmp_path):
  f = "gemm_20260101-000000.json"
  d = _folder(tmp_path, {f: {"commit": "0123abc+patch", "uncommitted": "a patch"}})
  assert problems(d, "", "", {}) == [f"{f}: measured on uncommitted code but not listed under "
                                     f"{UNCOMMITTED_SECTION!r} in PERFORMANCE.md"]
  listed = f"{UNCOMMITTED_SECTION}\n\n- {f}: a patch\n\n## Next\n"
  assert problems(d, "", listed, {}) == []
  assert problems(d, "", listed, {"ffi/src/x.cu": f"// faster ({f})"}) == [
      f"ffi/src/x.cu: cites {f}, measured on code that was never committed"]
  outside = f"## Other\n\n{f}\n\n{UNCOMMITTED_SECTION}\n\nnone\n"
  assert problems(d, "", outside, {})[0].startswith(f"{f}: measured on uncommitted code but not listed")
  d2 = _folder(tmp_path, {f: GOOD})
  assert problems(d2, "", listed, {}) == [f"{f}: listed under {UNCOMMITTED_SECTION!r} but its file carries no "
                                          f"'uncommitted' label"]
