"""Tests of ``python -m jax_moe_a2a``'s option checks: a value the layer, the model or the device count would refuse
is a usage error naming its option (exit status 2, no traceback), found before any heavy work."""

import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

from conftest import devices
from jax_moe_a2a import __main__ as cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(name="no_run")
def _no_run(monkeypatch):
  """The subcommands' work replaced by a failure: a refused value must stop before it."""
  def ran(args):
    raise AssertionError(f"{args.command} ran")
  for fn in ("_demo", "_report", "_plan", "_bench"):
    monkeypatch.setattr(cli, fn, ran)


def _usage_error(argv, capsys) -> str:
  with pytest.raises(SystemExit) as exit_info:
    cli.main(argv)
  assert exit_info.value.code == 2
  return capsys.readouterr().err


@pytest.mark.parametrize("argv,option,message", [
    (["--top-k", "100"], "--top-k", "must be <= --experts (64), got 100"),
    (["--wire", "fp8_blockwise", "--hidden", "200"], "--hidden",
     "must be a multiple of 128 for --wire fp8_blockwise, got 200"),
    (["--expert-precision", "fp8", "--ffn", "100"], "--ffn",
     "must be a multiple of 128 with --expert-precision fp8 (FP8 experts), got 100"),
    (["--gemm", "reference", "--hidden", "200"], "--hidden", "must be a multiple of 128 with --expert-precision fp8"),
    (["--gemm", "ffi", "--expert-precision", "dtype"], "--expert-precision",
     "must be fp8 with --gemm ffi (deprecated, read as --expert-precision fp8), got dtype"),
    (["--router", "deepseek_v3", "--n-group", "3"], "--n-group", "must divide --experts (64), got 3"),
    (["--router", "deepseek_v3", "--topk-group", "9"], "--topk-group", "must be <= --n-group (8), got 9"),
    (["--router", "deepseek_v3", "--experts", "16", "--n-group", "16", "--topk-group", "1", "--top-k", "4"],
     "--top-k", "must be <= the experts of --topk-group groups, 1 * 1 = 1, got 4"),
    (["--expert-backward", "fp8"], "--expert-backward",
     "fp8 is a backward of FP8 experts: it needs --expert-precision fp8, got --expert-precision dtype"),
    (["--sequence-parallel"], "--sequence-parallel", "needs --tp > 1"),
    (["--tp", "3"], "--tp", "must divide the device count (8), got 3"),
    (["--data", "3"], "--data", "must divide the device count (8), got 3"),
    (["--tp", "2", "--data", "2"], "--data", "must be 1 or 4 with --tp 2 (the mesh is (data, tp) = (4, 2)), got 2"),
    (["--experts", "12"], "--experts", "must be divisible by the 8 ranks of the expert axis, got 12"),
    (["--data", "2", "--experts", "6", "--top-k", "2"], "--experts",
     "must be divisible by the 4 ranks of the expert axis, got 6"),
    (["--tp", "2", "--sequence-parallel", "--tokens", "3"], "--tokens",
     "must be divisible by --tp (2) with --sequence-parallel, got 3"),
])
def test_demo_refuses_values_the_layer_refuses_naming_the_option(argv, option, message, capsys, no_run):
  devices(8)  # the messages are those of eight devices
  err = _usage_error(["demo", *argv], capsys)
  assert err.startswith("usage: python -m jax_moe_a2a demo"), err
  assert f"python -m jax_moe_a2a demo: error: argument {option}: {message}" in err, err


@pytest.mark.parametrize("argv", [
    [],
    ["--wire", "fp8_blockwise", "--gemm", "ffi", "--fp8-weights", "--shared-experts", "1"],
    ["--gemm", "reference", "--expert-backward", "fp8"],
    ["--expert-precision", "fp8", "--expert-backward", "fp8_dgrad"],
    ["--router", "deepseek_v3", "--experts", "16", "--top-k", "8"],
    ["--tp", "2", "--sequence-parallel", "--tokens", "4"],
    ["--tp", "2", "--data", "4"],
    ["--data", "2", "--experts", "8", "--top-k", "8"],
    ["--ffn", "100", "--fp8-weights", "--dtype", "float32"],
])
def test_demo_takes_the_values_the_layer_takes(argv, monkeypatch):
  devices(8)
  monkeypatch.setattr(cli, "_demo", lambda args: 0)
  assert cli.main(["demo", *argv]) == 0


def test_bench_refuses_a_benchmark_that_is_not_there(capsys, no_run):
  err = _usage_error(["bench", "nosuch", "--runs", "1"], capsys)
  assert "python -m jax_moe_a2a bench: error: argument name: must name a benchmark of " in err
  assert "(a2a, gemm, layer, notebook, quant), got 'nosuch'" in err


@pytest.mark.parametrize("message,option", [
    ("MoEConfig: top_k must be <= num_experts=16, got 20", "--top-k"),
    ("MoEConfig: invalid router settings: RouterConfig: n_group must divide num_experts=16, got 3", "--n-group"),
    ("MoEConfig: hidden=100 does not fit wire_format 'fp8_blockwise': dispatch_layout: ...", "--hidden"),
    ("MoEConfig: something new about nothing it names", None),
])
def test_the_layer_s_errors_name_the_option_of_the_value_they_name_first(message, option):
  assert cli._refused(ValueError(message), cli._DEMO_NAMES).option == option  # pylint: disable=protected-access


def test_an_error_naming_no_option_is_still_a_usage_error(capsys, monkeypatch, no_run):
  def refuse(args):
    raise cli._refused(ValueError("plans: a rule of no option"), cli._PLAN_NAMES)  # pylint: disable=protected-access
  monkeypatch.setattr(cli, "_check_plan", refuse)
  err = _usage_error(["plan"], capsys)
  assert "python -m jax_moe_a2a plan: error: plans: a rule of no option" in err


@pytest.mark.parametrize("argv,expected", [
    (["plan", "--top-k", "300"], "plan: error: argument --top-k: must be <= --experts (256), got 300"),
    (["plan", "--hidden", "100"], "plan: error: argument --hidden: must be a multiple of 128 for --wire fp8_blockwise"),
    (["demo", "--top-k", "100"], "demo: error: argument --top-k: must be <= --experts (64), got 100"),
    (["demo", "--tp", "3"], "demo: error: argument --tp: must divide the device count (8), got 3"),
    (["bench", "nosuch"], "bench: error: argument name: must name a benchmark"),
])
def test_the_command_ends_in_a_usage_error_without_a_traceback(argv, expected):
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # the demo asks for its 8 simulated devices itself
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run([sys.executable, "-m", "jax_moe_a2a", *argv], capture_output=True, text=True, env=env,
                        cwd=ROOT, timeout=120, check=False)
  assert proc.returncode == 2, proc.stdout + proc.stderr
  assert "Traceback" not in proc.stderr and expected in proc.stderr, proc.stderr


def test_bench_without_a_checkout_says_it_needs_one(capsys, monkeypatch, tmp_path, no_run):
  monkeypatch.setattr(cli, "_bench_dir", lambda: str(tmp_path / "bench"))
  err = _usage_error(["bench", "quant"], capsys)
  assert ("python -m jax_moe_a2a bench: error: bench needs a checkout of the repository: it runs the scripts of its "
          f"bench/ folder, which the installed package does not have (no {tmp_path / 'bench'})") in err


def _run_installed(tmp_path, *argv):
  """`python -m jax_moe_a2a *argv` from a copy of the package laid out as a wheel installs it (its modules alone, no
  bench/ beside them, no extension), run outside the checkout. -S leaves the .pth files out, so the checkout's
  editable install does not shadow the copy; this environment's site-packages (jax) come after it."""
  site = tmp_path / "site"
  if not site.exists():
    shutil.copytree(os.path.join(ROOT, "jax_moe_a2a"), site / "jax_moe_a2a",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
  code = ("import runpy, sys; sys.path[:0] = [sys.argv.pop(1), sys.argv.pop(1)]; "
          "runpy.run_module('jax_moe_a2a', run_name='__main__', alter_sys=True)")
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
  env["JAX_PLATFORMS"] = "cpu"
  return subprocess.run([sys.executable, "-S", "-c", code, str(site), sysconfig.get_paths()["purelib"], *argv],
                        cwd=tmp_path, env=env,
                        capture_output=True, text=True, check=False, timeout=300)


def test_plan_report_and_bench_from_an_installed_package(tmp_path):
  r = _run_installed(tmp_path, "plan", "--nodes", "2")
  assert r.returncode == 0, r.stderr
  assert "| 2 × 8 | two-level |" in r.stdout
  assert "dispatch  4096 tokens per rank: measured   105.9 us" in r.stdout  # the packaged calibration
  r = _run_installed(tmp_path, "report", "--tokens", "8")
  assert r.returncode == 0, r.stderr
  assert "extension: missing" in r.stdout and "fp8_blockwise" in r.stdout
  r = _run_installed(tmp_path, "bench", "quant")
  assert r.returncode == 2 and "error: bench needs a checkout of the repository" in r.stderr, r.stderr
  assert "Traceback" not in r.stderr
