"""The benchmark scripts run end to end on the simulated CPU devices (tiny sizes), so CI keeps them working."""

import argparse
import importlib
import json
import os
import sys

import jax
import numpy as np
import pytest

import test_flax
from conftest import skip_without_one_sided_backward
from jax_moe_a2a import _ffi, workspace

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def _import_bench(name):
  """bench/<name>.py as a module (bench/ is a folder of scripts, not a package)."""
  sys.path.insert(0, BENCH)
  try:
    return importlib.import_module(name)
  finally:
    sys.path.remove(BENCH)


@pytest.mark.skipif(not _ffi.available(), reason="compiled extension not built")
def test_bench_a2a_writes_every_implementation_and_a_plot(tmp_path):
  skip_without_one_sided_backward()
  bench_a2a = _import_bench("bench_a2a")
  assert bench_a2a.main(["--tokens", "3", "--formats", "bf16", "fp8_blockwise", "--hidden", "256", "--experts", "16",
                         "--top-k", "2", "--chain", "2", "--runs", "2", "--vjp", "--out", str(tmp_path)]) == 0
  (path,) = [p for p in tmp_path.iterdir() if p.suffix == ".json"]
  rec = json.loads(path.read_text())
  assert rec["processes"] == 1 and rec["hidden"] == 256
  got = {(r["fmt"], r["op"], r["impl"]) for r in rec["rows"]}
  for fmt in ("bf16", "fp8_blockwise"):
    for impl in ("ffi", "reference", "all_to_all"):
      assert {(fmt, "dispatch", impl), (fmt, "combine", impl)} <= got
    assert {(fmt, "combine_vjp", "ffi"), (fmt, "combine_vjp", "reference")} <= got
  assert all(r["chain_us"] is not None for r in rec["rows"])
  if jax.default_backend() == "cpu":  # no GPU trace
    assert all(r["gpu_us"] is None and r["steady_gpu_us"] is None and r["steady_kernel_us"] is None
               for r in rec["rows"])
  assert path.with_suffix(".png").exists()


def test_steady_us_leaves_out_the_first_call_of_the_chain():
  common = _import_bench("common")
  # Three calls of "Op" per device, in ns. Device 0 waits 40 us in its first call for a peer started later.
  kernels = {
      "gpu0": [("Op", 0, 50_000), ("Other", 50_000, 1_000), ("Op", 51_000, 10_000), ("Op", 61_000, 10_000)],
      "gpu1": [("Op", 40_000, 10_000), ("Op", 51_000, 12_000), ("Op", 63_000, 9_000)],
  }
  # Device 0: from 50 us to 71 us over 2 calls, 10 us in Op per call; device 1: 50 -> 72 us, (12 + 9) / 2 us.
  assert common.steady_us(kernels, "Op", 3) == pytest.approx((11.0, 10.5))
  assert common.kernel_busy_us(kernels, "Op", 3) == pytest.approx(70 / 3)  # the whole chain, first call included
  assert common.steady_us(kernels, "Op", 1) == (None, None)
  assert common.steady_us({"gpu0": [("Op", 0, 5)]}, "Op", 3) == (None, None)
  assert common.steady_us(kernels, "Missing", 3) == (None, None)


@pytest.mark.skipif(not _ffi.available(), reason="compiled extension not built")
def test_bench_gemm_writes_every_method_its_accuracy_check_and_a_plot(tmp_path, monkeypatch):
  bench_gemm = _import_bench("bench_gemm")
  monkeypatch.delenv(bench_gemm.KERNEL_ENV, raising=False)
  methods = ["fp8_contiguous", "fp8_masked", "fp8_wgmma", "bf16_grouped", "bf16_grouped_kn", "bf16_ragged_dot",
             "bf16_einsum", "fp8_dequant_bf16"]
  assert bench_gemm.main(["--groups", "3", "--rows", "130", "--shapes", "256x384", "--methods", *methods,
                          "--calls", "1", "--max-runs", "2", "--out", str(tmp_path)]) == 0
  (path,) = [p for p in tmp_path.iterdir() if p.suffix == ".json"]
  rec = json.loads(path.read_text())
  assert {r["method"] for r in rec["rows"]} == set(methods)
  assert rec["failed"] == []
  assert all(r["tflops"] > 0 and (r["groups"], r["rows_per_group"], r["n"], r["k"]) == (3, 130, 256, 384)
             for r in rec["rows"])
  (check,) = rec["calc_diff_vs_fp32_dequantized"]
  assert set(check["calc_diff"]) == {"fp8_contiguous", "fp8_masked", "fp8_wgmma"}
  assert all(0 <= d < 1e-3 for d in check["calc_diff"].values())
  assert path.with_suffix(".png").exists()
  assert bench_gemm.KERNEL_ENV not in os.environ  # named only while its method ran


@pytest.mark.skipif(not _ffi.available(), reason="compiled extension not built")
def test_bench_gemm_records_a_method_that_fails_and_draws_no_empty_plot(tmp_path, monkeypatch):
  bench_gemm = _import_bench("bench_gemm")

  def fail(method, *args, **kwargs):
    raise RuntimeError(f"{method}: out of memory")

  monkeypatch.setattr(bench_gemm, "_time", fail)
  assert bench_gemm.main(["--groups", "2", "--rows", "130", "--shapes", "256x384", "--methods", "bf16_einsum",
                          "--calls", "1", "--max-runs", "2", "--out", str(tmp_path)]) == 0
  (path,) = [p for p in tmp_path.iterdir() if p.suffix == ".json"]
  rec = json.loads(path.read_text())
  assert rec["rows"] == []
  assert rec["failed"] == [{"n": 256, "k": 384, "groups": 2, "rows_per_group": 130, "method": "bf16_einsum",
                            "error": "RuntimeError: bf16_einsum: out of memory"}]
  assert not path.with_suffix(".png").exists()


def test_kernel_busy_us_is_the_slowest_devices_time_in_the_named_kernels_per_call():
  common = _import_bench("common")
  kernels = {
      "/device:GPU:0": [("DispatchKernel(a)", 0, 10_000), ("CombineKernel<bf16>", 10_000, 30_000),
                        ("DispatchKernel(a)", 40_000, 12_000), ("CombineKernel<bf16>", 52_000, 34_000)],
      "/device:GPU:1": [("DispatchKernel(a)", 0, 9_000), ("CombineKernel<bf16>", 9_000, 40_000),
                        ("DispatchKernel(a)", 49_000, 9_000), ("CombineKernel<bf16>", 58_000, 40_000)],
      "/device:GPU:2": [],
  }
  assert common.kernel_busy_us(kernels, "CombineKernel", calls=2) == 40.0  # GPU 1: 80 us over 2 calls
  assert common.kernel_busy_us(kernels, "DispatchKernel", calls=2) == 11.0  # GPU 0: 22 us over 2 calls
  assert common.kernel_busy_us(kernels, "nccl", calls=2) is None


@pytest.mark.skipif(not _ffi.available(), reason="compiled extension not built")
def test_bench_layer_writes_every_variant_and_a_plot(tmp_path):
  skip_without_one_sided_backward()
  bench_layer = _import_bench("bench_layer")
  variants = ["einsum", "reference", "bf16", "fp8_ws", "fp8_fp8bwd", "fp8_stored", "fp8_ws_2l"]
  assert bench_layer.main(["--tokens", "16", "--local-experts", "2", "--hidden", "128", "--ffn", "128", "--top-k",
                           "2", "--runs", "2", "--input-sets", "2", "--chain", "3", "--variants", *variants, "--check",
                           "--out", str(tmp_path)]) == 0
  (path,) = [p for p in tmp_path.iterdir() if p.suffix == ".json"]
  rec = json.loads(path.read_text())
  got = {(r["variant"], r["mode"]) for r in rec["rows"]}
  want = {(v, m) for v in variants for m in ("fwd", "fwd_bwd")} - {("fp8_stored", "fwd_bwd")}  # inference only
  assert got == want
  assert all(r["ms"] > 0 and r["tflops"] > 0 and r["sync_ms"] > 0 and r["chain"] == 3 and r["temp_bytes"] >= 0
             for r in rec["rows"])
  assert path.with_suffix(".png").exists()
  # --check: calc_diff of the output and every gradient against the float32 oracle (einsum has none).
  for r in rec["rows"]:
    acc = r.get("accuracy")
    assert (acc is None) == (r["variant"] == "einsum")
    if acc is not None:
      want_keys = {"output"} | ({"grad_router", "grad_w_gate_up", "grad_w_down", "grad_x"}
                                if r["variant"] != "fp8_stored" else set())
      assert set(acc) == want_keys
      out_tol, grad_tol = (1e-4, 5e-4) if r["variant"] in ("reference", "bf16") else (5e-3, 2e-2)
      assert acc["output"] < out_tol and all(v < grad_tol for k, v in acc.items() if k != "output"), (r["variant"], acc)


@pytest.mark.skipif(not _ffi.available(), reason="compiled extension not built")
def test_bench_layer_times_a_step_of_micro_batches(tmp_path):
  """--micro-batches N: a fwd_bwd_mb row per training variant (einsum, the layer; not stored FP8, which has no
  backward), and for FP8 experts on float weights a fwd_bwd_mb_requant row beside it (the weights quantized in every
  micro-batch rather than once before the loop); FLOPs of N forward+backward passes, the time per micro-batch
  beside the step's; the step's gradients are the sums of the micro-batches' (checked on the layer's program itself,
  both ways)."""
  bench_layer = _import_bench("bench_layer")
  variants = ["einsum", "fp8_fp8bwd", "fp8_stored"]
  assert bench_layer.main(["--tokens", "16", "--local-experts", "2", "--hidden", "128", "--ffn", "128", "--top-k",
                           "2", "--runs", "2", "--input-sets", "2", "--chain", "2", "--variants", *variants,
                           "--modes", "fwd_bwd", "--micro-batches", "3", "--no-stages", "--out", str(tmp_path)]) == 0
  (path,) = [p for p in tmp_path.iterdir() if p.suffix == ".json"]
  rows = {(r["variant"], r["mode"]): r for r in json.loads(path.read_text())["rows"]}
  assert set(rows) == {("einsum", "fwd_bwd"), ("einsum", "fwd_bwd_mb"), ("fp8_fp8bwd", "fwd_bwd"),
                       ("fp8_fp8bwd", "fwd_bwd_mb"), ("fp8_fp8bwd", "fwd_bwd_mb_requant")}
  for v, mode in (("einsum", "fwd_bwd_mb"), ("fp8_fp8bwd", "fwd_bwd_mb"), ("fp8_fp8bwd", "fwd_bwd_mb_requant")):
    one, mb = rows[(v, "fwd_bwd")], rows[(v, mode)]
    assert mb["micro_batches"] == 3 and mb["ms_per_micro_batch"] == pytest.approx(mb["ms"] / 3)
    assert mb["tflops"] * mb["ms"] == pytest.approx(3 * one["tflops"] * one["ms"])  # 3x the FLOPs

  mesh = jax.make_mesh((1, jax.device_count()), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  args = argparse.Namespace(hidden=128, ffn=128, top_k=2, local_experts=2)
  _, one_step, inputs, _, (_, _, p), _, (loss, argnums, prepare) = bench_layer._layer_fns("fp8_fp8bwd", args, mesh, 16)
  assert prepare is not None
  (v0, (g0, _)), (v1, (g1, dx1)) = one_step(*inputs(0)), one_step(*inputs(1))
  for prep in (prepare, None):
    step, stacked = bench_layer._micro_batched(loss, argnums, prep, p, 2, inputs)
    (value, grads), dxs = step(*p, *stacked(0))
    assert float(value) == pytest.approx(float(v0) + float(v1), rel=1e-5)
    for name in g0:
      want = np.asarray(g0[name], np.float32) + np.asarray(g1[name], np.float32)
      np.testing.assert_allclose(np.asarray(grads[0][name], np.float32), want, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(dxs[1], np.float32), np.asarray(dx1, np.float32), rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not _ffi.available(), reason="compiled extension not built")
def test_bench_layer_writes_a_row_per_wire_format(tmp_path):
  """--wire-formats: each layer variant once per format, labelled <variant>@<format> off its own wire, with the
  wire's bytes per token, forward and forward+backward times, and calc_diff within the format's limit (tests/
  test_moe.py's docstring: 2e-3 for an FP8 wire, 3e-2 for NVFP4; 4e-3 and 3e-2 with FP8 experts)."""
  bench_layer = _import_bench("bench_layer")
  # FP8 experts through the one-sided calls, or, where XLA:CPU cannot compile their backward, the reference exchange.
  fp8 = "fp8_ws" if jax.default_backend() != "cpu" or workspace.cpu_compiles_one_sided_backward() else "fp8"
  assert bench_layer.main(["--tokens", "16", "--local-experts", "2", "--hidden", "256", "--ffn", "128", "--top-k",
                           "2", "--runs", "2", "--input-sets", "2", "--chain", "2", "--variants", "bf16", fp8,
                           "--wire-formats", "mxfp8", "nvfp4", "--check", "--no-stages", "--out",
                           str(tmp_path)]) == 0
  (path,) = [p for p in tmp_path.iterdir() if p.suffix == ".json"]
  rows = json.loads(path.read_text())["rows"]
  labels = ["bf16@mxfp8", "bf16@nvfp4", f"{fp8}@mxfp8", f"{fp8}@nvfp4"]
  assert sorted((r["variant"], r["mode"]) for r in rows) == sorted((v, m) for v in labels for m in ("fwd", "fwd_bwd"))
  want_bytes = {"mxfp8": 256 + 8 + 16, "nvfp4": 128 + 16 + 16}  # x, scales, ids and weights
  limits = {"mxfp8": (2e-3, 4e-3), "nvfp4": (3e-2, 3e-2)}
  for r in rows:
    fmt = r["variant"].split("@")[1]
    assert r["wire_format"] == fmt and r["wire_bytes_per_token"] == want_bytes[fmt] and r["ms"] > 0
    limit = limits[fmt][r["variant"].startswith("fp8")]
    assert set(r["accuracy"]) == {"output", "grad_router", "grad_w_gate_up", "grad_w_down", "grad_x"}
    assert all(v < limit for v in r["accuracy"].values()), (r["variant"], r["accuracy"])
  nvfp4 = [r["accuracy"]["output"] for r in rows if r["variant"] == "bf16@nvfp4"]
  assert nvfp4[0] > 2e-3  # four bits: the row really went over NVFP4


def test_bench_layer_runs_every_flax_variant(tmp_path):
  skip_without_one_sided_backward()
  bench_layer = _import_bench("bench_layer")
  variants = ["nnx_call", "nnx_jit", "nnx_jit_apply", "linen_jit"]
  variants += ["nnx_jit_tree"] if test_flax._has_tree_mode() else []  # pylint: disable=protected-access
  variants += ["nnx_jit_apply_ws"] if _ffi.available() else []
  assert bench_layer.main(["--tokens", "16", "--local-experts", "2", "--hidden", "128", "--ffn", "128", "--top-k",
                           "2", "--runs", "2", "--input-sets", "2", "--chain", "2", "--variants", *variants, "--check",
                           "--out", str(tmp_path)]) == 0
  (path,) = [p for p in tmp_path.iterdir() if p.suffix == ".json"]
  rows = json.loads(path.read_text())["rows"]
  want = {(v, m) for v in variants for m in ("fwd", "fwd_bwd")} - {("nnx_call", "fwd_bwd")}  # forward only
  assert {(r["variant"], r["mode"]) for r in rows} == want
  for r in rows:
    assert r["ms"] > 0 and r["sync_ms"] > 0, r
    grads = {"grad_router", "grad_w_gate_up", "grad_w_down", "grad_x"} if r["variant"] != "nnx_call" else set()
    assert set(r["accuracy"]) == {"output"} | grads, r
    assert all(v < 1e-4 for v in r["accuracy"].values()), r  # bf16 experts: the bf16 variant's tolerance


def test_bench_layer_labels_and_refuses_a_hidden_a_format_cannot_carry(capsys):
  bench_layer = _import_bench("bench_layer")
  assert bench_layer.runs_of(["einsum", "reference", "fp8_2l", "nnx_jit"], ["bf16", "nvfp4"]) == [
      ("einsum", "einsum", None), ("reference", "reference", "bf16"), ("reference@nvfp4", "reference", "nvfp4"),
      ("fp8_2l@bf16", "fp8_2l", "bf16"), ("fp8_2l@nvfp4", "fp8_2l", "nvfp4"), ("nnx_jit", "nnx_jit", None)]
  assert bench_layer.runs_of(["bf16"], None) == [("bf16", "bf16", None)]
  with pytest.raises(SystemExit):
    bench_layer.main(["--hidden", "48", "--wire-formats", "bf16", "mxfp8"])
  assert "--hidden must be a multiple of 32 for --wire-formats mxfp8, got 48" in capsys.readouterr().err


def test_bench_scripts_still_take_twin_the_old_name_of_reference(tmp_path, capsys):
  """Older command lines (docs/PERFORMANCE.md) say "twin" and --twin-max-tokens: read as "reference" and
  --reference-max-tokens, with a note; the results use the new name."""
  bench_layer, bench_a2a = _import_bench("bench_layer"), _import_bench("bench_a2a")
  assert [bench_layer.variant_name(v) for v in ("twin", "twin_2l", "bf16")] == ["reference", "reference_2l", "bf16"]
  assert [bench_a2a.impl_name(i) for i in ("twin", "ffi")] == ["reference", "ffi"]
  assert bench_layer.main(["--tokens", "16", "--variants", "twin", "--twin-max-tokens", "8", "--out",
                           str(tmp_path)]) == 0
  out = capsys.readouterr().out
  assert "twin is now called reference" in out
  assert "reference: skipped at 16 tokens (--reference-max-tokens 8)" in out
  with pytest.raises(SystemExit):
    bench_layer.main(["--help"])
  usage = capsys.readouterr().out
  assert "--reference-max-tokens" in usage and "--twin-max-tokens" not in usage  # the old spelling is hidden


def test_bench_layer_attributes_ops_to_their_innermost_stage():
  bench_layer = _import_bench("bench_layer")
  assert bench_layer._stage_of("jit(f)/shard_map/experts/permute/gather") == "permute"  # pylint: disable=protected-access
  assert bench_layer._stage_of("jit(f)/transpose(jvp(shard_map))/router/dot_general") == "router"  # pylint: disable=protected-access
  assert bench_layer._stage_of("jit(f)/einsum") == "other"  # pylint: disable=protected-access
  names = bench_layer._op_names(  # pylint: disable=protected-access
      '  %fusion.3 = bf16[4]{0} fusion(%p), kind=kLoop, metadata={op_name="jit(f)/experts/mul" stack_frame_id=1}\n'
      '  ROOT %custom-call.1 = f32[2]{0} custom-call(%a), metadata={op_name="jit(f)/moe_combine/x"}\n')
  assert names == {"fusion.3": "jit(f)/experts/mul", "custom-call.1": "jit(f)/moe_combine/x"}
  hlo = '  %fusion.3 = bf16[4,8]{1,0} fusion(%p), kind=kLoop\n  ROOT %custom-call.1 = f32[2]{0} custom-call(%a)\n'
  assert bench_layer._hlo_shape(hlo, "fusion.3") == "bf16[4,8]{1,0}"  # pylint: disable=protected-access
  assert bench_layer._hlo_shape(hlo, "custom-call.1") == "f32[2]{0}"  # pylint: disable=protected-access
  assert bench_layer._hlo_shape(hlo, "fusion.4") == ""  # pylint: disable=protected-access
  # A kernel's bytes: its result's and its operands' (by name, a tuple's elements summed), for GB/s in stage_top.
  hlo = ('  %p = bf16[4,8]{1,0} parameter(0)\n  %q = (f8e4m3fn[16]{0}, f32[2]{0}) custom-call(%p)\n'
         '  %g = f32[2]{0} get-tuple-element(%q), index=1\n'
         '  ROOT %fusion.9 = f32[4,8]{1,0} fusion(%p, %q, %g), kind=kLoop, calls=%fused, metadata={op_name="a/b"}\n')
  hlo_bytes = bench_layer._hlo_bytes  # pylint: disable=protected-access
  assert hlo_bytes(hlo, "fusion.9") == 4 * 8 * 4 + 4 * 8 * 2 + (16 + 8) + 8
  assert hlo_bytes(hlo, "q") == 16 + 8 + 64
  assert hlo_bytes(hlo, "nothing") == 0


def test_fp8_error_budget_adds_up_and_refuses_sizes_off_the_blocks(capsys):
  budget = _import_bench("fp8_error_budget")
  b = budget.budget(rows=256, hidden=256, ffn=128, seed=1)
  singles = [b[k] for k in ("x (1x128)", "w_gate_up (128x128)", "act (1x128)", "w_down (128x128)")]
  # Each E4M3 rounding costs a few 1e-4 (3 mantissa bits); independent errors add up, so all four is about the sum.
  assert all(1e-4 < v < 2e-3 for v in singles), b
  assert 0.8 * sum(singles) < b["all four"] < 1.2 * sum(singles), b
  with pytest.raises(SystemExit):
    budget.main(["--hidden", "200"])
  assert "--hidden must be a multiple of 128, got 200" in capsys.readouterr().err


@pytest.mark.parametrize("commit,labelled", [("0123abc", False), ("0123abc+dirty", True)])
def test_a_result_of_a_dirty_checkout_is_labelled_uncommitted(tmp_path, monkeypatch, commit, labelled):
  common = _import_bench("common")
  monkeypatch.setenv("JAX_MOE_A2A_COMMIT", commit)
  rec = json.loads(open(common.write_result("x", {"rows": []}, str(tmp_path)), encoding="utf-8").read())
  assert rec["commit"] == commit and ("uncommitted" in rec) == labelled
  assert os.path.basename(common.write_result("x", {}, str(tmp_path))).startswith("x_")


@pytest.mark.parametrize("kernel", [None, "wgmma"])
def test_a_result_names_the_fp8_gemm_kernel_it_ran_when_one_was_chosen(tmp_path, monkeypatch, kernel):
  common = _import_bench("common")
  if kernel is None:
    monkeypatch.delenv("JAX_MOE_A2A_FP8_GEMM_KERNEL", raising=False)
  else:
    monkeypatch.setenv("JAX_MOE_A2A_FP8_GEMM_KERNEL", kernel)
  rec = json.loads(open(common.write_result("x", {"rows": []}, str(tmp_path)), encoding="utf-8").read())
  assert rec.get("fp8_gemm_kernel") == kernel


@pytest.mark.skipif(not _ffi.available(), reason="compiled extension not built")
def test_bench_quant_times_every_op_on_both_implementations_and_the_xla_ceilings(tmp_path):
  bench_quant = _import_bench("bench_quant")
  assert bench_quant.main(["--m", "256", "--k", "256", "--groups", "4", "--calls", "2", "--runs", "2", "--repeats", "1",
                           "--out", str(tmp_path)]) == 0
  (path,) = [p for p in tmp_path.iterdir() if p.suffix == ".json"]
  rows = json.loads(path.read_text())["rows"]
  ops = [op for op in bench_quant.OPS if op not in bench_quant.CEILINGS]
  assert {(r["op"], r["impl"]) for r in rows} == ({(op, impl) for op in ops for impl in ("ffi", "reference")}
                                                  | {(op, "xla") for op in bench_quant.CEILINGS})
  assert all(r["gb_per_s"] > 0 and r["bytes"] > 256 * 256 for r in rows)
