"""FP8 block-scaled grouped GEMM (custom call) against JAX's grouped and dense matmul paths, in TFLOP/s.

For each (groups G, rows per group, N, K) -- DeepSeek-V3 expert shapes by default -- and every method, the median
time of one call (inside a jit of --calls calls over distinct activations, two weight sets rotated between
runs). TFLOP/s = 2 * real rows * N * K / time; every group has exactly `rows` real rows here. On a GPU each row
also gives the device time per call (the method's kernels' durations in a profiler trace of one run, setup
kernels included) and the TFLOP/s over it: the wall time per call also carries the host's dispatch of each run
and the wait for its end, shared by only --calls calls.

Methods:
  fp8_contiguous   jax_moe_a2a_grouped_gemm_fp8, rows sorted by group [G*rows, K]
  fp8_masked       the same custom call on [G, rows, K] with per-group counts
  fp8_wgmma        fp8_contiguous with JAX_MOE_A2A_FP8_GEMM_KERNEL=wgmma (the kernel written on wgmma instead of
                   the CUTLASS one; the two fp8_contiguous rows of one run compare them)
  fp8_wgmma_masked fp8_masked with the same kernel
  bf16_grouped     jax_moe_a2a_grouped_gemm_bf16, rows sorted by group, weights [G, N, K] (the forward's layout)
  bf16_grouped_kn  the same custom call with weights read as [G, K, N] (the data gradient's layout)
  bf16_ragged_dot  jax.lax.ragged_dot, bfloat16
  bf16_mgpu        Pallas Mosaic-GPU ragged_dot_mgpu, bfloat16, best of three tile configurations
  bf16_einsum      batched einsum [G, rows, K] x [G, N, K], bfloat16 (equal capacity, no padding here)
  fp8_dequant_bf16 dequantize the FP8 operands to bfloat16, then the batched einsum
  fp8_batched_pt   batched FP8 dot_general with per-tensor scales (cuBLASLt), bfloat16 output
  fp8_dense_pt     one dense FP8 dot_general [G*rows, K] x [K, N] with per-tensor scales: same FLOPs, no groups
  fp8_wgrad        jax_moe_a2a_grouped_gemm_fp8_wgrad: the weight gradient dW[g] = dy_g^T x_g [G, N, K] float32
                   from dy [G*rows, N] and x [G*rows, K] in K-major 128x1 FP8 (quant.quantize_fp8_grouped_kmajor,
                   outside the timed region); the same 2 * rows * N * K FLOPs per group
  fp8_wgrad_bf16   the same with a bfloat16 dW (what bfloat16 parameters take)
  fp8_wgrad_wgmma, fp8_wgrad_bf16_wgmma   the same two with JAX_MOE_A2A_FP8_GEMM_KERNEL=wgmma

  python bench/bench_gemm.py [--groups 32 8] [--rows 128 512 1024 4096] [--methods ...] [--out DIR]
  python bench/bench_gemm.py --plot bench/results/gemm_<date>.json     (plot a result file)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (device_time_per_call, plot_if_possible, positive_int, save_plot, time_per_call,  # noqa: E402
                    write_result)

from jax_moe_a2a import grouped_gemm, quant  # noqa: E402

METHODS = ("fp8_contiguous", "fp8_masked", "fp8_wgmma", "fp8_wgmma_masked", "bf16_grouped", "bf16_grouped_kn",
           "bf16_ragged_dot", "bf16_mgpu", "bf16_einsum", "fp8_dequant_bf16", "fp8_batched_pt", "fp8_dense_pt",
           "fp8_wgrad", "fp8_wgrad_bf16", "fp8_wgrad_wgmma", "fp8_wgrad_bf16_wgmma")
# Methods that are another method's call with the FP8 GEMM kernel named (the handler reads the variable at every call).
KERNEL_ENV = "JAX_MOE_A2A_FP8_GEMM_KERNEL"
KERNEL_METHODS = {"fp8_wgmma": ("fp8_contiguous", "wgmma"), "fp8_wgmma_masked": ("fp8_masked", "wgmma"),
                  "fp8_wgrad_wgmma": ("fp8_wgrad", "wgmma"), "fp8_wgrad_bf16_wgmma": ("fp8_wgrad_bf16", "wgmma")}
SHAPES = ((4096, 7168), (7168, 2048))  # (N, K): gate/up-like and down-like projections of DeepSeek-V3
MGPU_CONFIGS = (dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1),
                dict(block_m=128, block_n=256, block_k=64, max_concurrent_steps=3, grid_block_n=1),
                dict(block_m=64, block_n=256, block_k=64, max_concurrent_steps=4, grid_block_n=2))


def _fp8_per_tensor(x):
  """E4M3 with one float32 scale for the whole tensor (amax / 448)."""
  scale = jnp.maximum(jnp.max(jnp.abs(x.astype(jnp.float32))), 1e-12) / 448.0
  return (x.astype(jnp.float32) / scale).astype(jnp.float8_e4m3fn), scale


def _inputs(key, g, rows, n, k, calls, wgrad=False):
  """Activations (calls distinct sets) and weights for every method, prepared outside the timed region; with
  `wgrad`, also the K-major operands of fp8_wgrad (dy [G*rows, N] and x)."""
  kw, kx = jax.random.split(key)
  w = jax.random.normal(kw, (g, n, k), jnp.float32) * 0.02
  b, b_sf = quant.quantize_fp8_weight(w)
  wb = w.astype(jnp.bfloat16)
  wb_kn = jnp.swapaxes(wb, 1, 2)  # [G, K, N] for ragged_dot
  wq, ws = _fp8_per_tensor(w)
  wq_dense, ws_dense = _fp8_per_tensor(w[0].T)  # [K, N]
  acts = []
  for i in range(calls):
    x = jax.random.normal(jax.random.fold_in(kx, i), (g * rows, k), jnp.bfloat16)
    a, a_sf = quant.quantize_fp8_blockwise(x)
    xq, xs = _fp8_per_tensor(x)
    acts.append(dict(x=x, a=a, a_sf=a_sf, xq=xq, xs=xs))
    if wgrad:
      sizes = jnp.full((g,), rows, jnp.int32)
      dy = jax.random.normal(jax.random.fold_in(kx, calls + i), (g * rows, n), jnp.bfloat16)
      acts[-1]["wgrad"] = (*quant.quantize_fp8_grouped_kmajor(dy, sizes), *quant.quantize_fp8_grouped_kmajor(x, sizes))
  del w
  return dict(b=b, b_sf=b_sf, wb=wb, wb_kn=wb_kn, wq=wq, ws=ws, wq_dense=wq_dense, ws_dense=ws_dense), acts


@contextlib.contextmanager
def _kernel_of(method):
  """Names the FP8 GEMM kernel of `method` (if it is one of KERNEL_METHODS) while the block runs."""
  if method not in KERNEL_METHODS:
    yield
    return
  before = os.environ.get(KERNEL_ENV)
  os.environ[KERNEL_ENV] = KERNEL_METHODS[method][1]
  try:
    yield
  finally:
    if before is None:
      del os.environ[KERNEL_ENV]
    else:
      os.environ[KERNEL_ENV] = before


def _one(method, g, rows, n, k, wts, act, sizes, mgpu_config=None):
  """One call of `method` on one activation set."""
  method = KERNEL_METHODS.get(method, (method,))[0]
  if method == "fp8_contiguous":
    return grouped_gemm.grouped_gemm_fp8(act["a"], act["a_sf"], wts["b"], wts["b_sf"], sizes, impl="ffi")
  if method == "fp8_masked":
    return grouped_gemm.grouped_gemm_fp8(act["a"].reshape(g, rows, k), act["a_sf"].reshape(g, rows, k // 128),
                                         wts["b"], wts["b_sf"], sizes, impl="ffi")
  if method == "bf16_grouped":
    return grouped_gemm.grouped_gemm_bf16(act["x"], wts["wb"], sizes, b_layout="nk", impl="ffi")
  if method == "bf16_grouped_kn":
    return grouped_gemm.grouped_gemm_bf16(act["x"], wts["wb_kn"], sizes, b_layout="kn", impl="ffi")
  if method == "bf16_ragged_dot":
    return jax.lax.ragged_dot(act["x"], wts["wb_kn"], sizes)
  if method == "bf16_mgpu":
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu  # pylint: disable=import-outside-toplevel
    return ragged_dot_mgpu.ragged_dot(act["x"], wts["wb_kn"], group_sizes=sizes, **mgpu_config)
  if method == "bf16_einsum":
    return jnp.einsum("grk,gnk->grn", act["x"].reshape(g, rows, k), wts["wb"], preferred_element_type=jnp.bfloat16)
  if method == "fp8_dequant_bf16":
    x = quant.dequantize_fp8_blockwise(act["a"], act["a_sf"], dtype=jnp.bfloat16).reshape(g, rows, k)
    w = quant.dequantize_fp8_weight(wts["b"], wts["b_sf"], dtype=jnp.bfloat16)
    return jnp.einsum("grk,gnk->grn", x, w, preferred_element_type=jnp.bfloat16)
  if method == "fp8_batched_pt":
    y = jax.lax.dot_general(act["xq"].reshape(g, rows, k), wts["wq"], (((2,), (2,)), ((0,), (0,))),
                            preferred_element_type=jnp.float32)
    return (y * (act["xs"] * wts["ws"])).astype(jnp.bfloat16)
  if method == "fp8_dense_pt":
    y = jax.lax.dot_general(act["xq"], wts["wq_dense"], (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * (act["xs"] * wts["ws_dense"])).astype(jnp.bfloat16)
  if method == "fp8_wgrad":
    return grouped_gemm.grouped_gemm_fp8_wgrad(*act["wgrad"], sizes, impl="ffi")
  if method == "fp8_wgrad_bf16":
    return grouped_gemm.grouped_gemm_fp8_wgrad(*act["wgrad"], sizes, out_dtype=jnp.bfloat16, impl="ffi")
  raise ValueError(method)


def _time(method, g, rows, n, k, sets, sizes, calls, max_runs, mgpu_config=None):
  with _kernel_of(method):
    return _time_calls(method, g, rows, n, k, sets, sizes, calls, max_runs, mgpu_config)


def _time_calls(method, g, rows, n, k, sets, sizes, calls, max_runs, mgpu_config=None):
  fn = jax.jit(lambda wts, acts: [_one(method, g, rows, n, k, wts, a, sizes, mgpu_config) for a in acts])
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*sets[0]))  # compile + first call
  first = time.perf_counter() - t0
  jax.block_until_ready(fn(*sets[1]))
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*sets[0]))
  once = time.perf_counter() - t0
  runs = int(min(max_runs, max(5, 1.0 / max(once, 1e-6))))  # about a second of timed runs, at least 5
  t = time_per_call(fn, sets, calls_per_run=calls, warmup=2, runs=runs)
  t["first_call_s"] = first
  device_us, span = device_time_per_call(fn, sets[0], calls)
  if device_us is not None:
    t.update(device_us=device_us, device_span_us=span)
  return t


def _check(g, rows, n, k, wts, act, sizes, methods):
  """calc_diff of both FP8 layouts (and of fp8_wgmma / fp8_wgmma_masked if among `methods`) against an FP32 GEMM of the
  dequantized operands, on three groups (the first, middle and last): only those groups' operands are dequantized
  and copied to the host."""
  from jax_moe_a2a.testing import calc_diff  # pylint: disable=import-outside-toplevel
  picks = jnp.array(sorted({0, g // 2, g - 1}))
  a = act["a"].reshape(g, rows, k)[picks].reshape(-1, k)
  a_sf = act["a_sf"].reshape(g, rows, k // 128)[picks].reshape(-1, k // 128)
  x = np.asarray(quant.dequantize_fp8_blockwise(a, a_sf)).reshape(len(picks), rows, k)
  w = np.asarray(quant.dequantize_fp8_weight(wts["b"][picks], wts["b_sf"][picks]))
  out = {}
  for method in ("fp8_contiguous", "fp8_masked", *(m for m in ("fp8_wgmma", "fp8_wgmma_masked") if m in methods)):
    with _kernel_of(method):
      y = np.asarray(_one(method, g, rows, n, k, wts, act, sizes).reshape(g, rows, n)[picks].astype(jnp.float32))
    out[method] = max(calc_diff(y[i], x[i] @ w[i].T) for i in range(len(picks)))
  return out


def _plot(path):
  """TFLOP/s per method, grouped by shape; writes <path>.png."""
  return save_plot(path, _draw)


def _draw(plt, rec):
  rows = rec["rows"]
  configs = sorted({(r["n"], r["k"], r["groups"], r["rows_per_group"]) for r in rows})
  methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
  fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(configs)), 5))
  width = 0.8 / len(methods)
  for i, m in enumerate(methods):
    vals = [next((r["tflops"] for r in rows if r["method"] == m and (r["n"], r["k"], r["groups"],
                                                                     r["rows_per_group"]) == c), 0) for c in configs]
    ax.bar(np.arange(len(configs)) + i * width, vals, width, label=m)
  ax.set_xticks(np.arange(len(configs)) + 0.4 - width / 2)
  ax.set_xticklabels([f"N{n}\nK{k}\n{g}x{r}" for n, k, g, r in configs], fontsize=7)
  ax.set_ylabel("TFLOP/s (real rows)")
  ax.set_title(f"Grouped GEMM, {rec['device']}")
  ax.legend(fontsize=7, ncol=2)
  return fig


def _shape(text: str) -> str:
  """argparse type of --shapes: "NxK" with positive N and K (kept as text: the run parses it)."""
  parts = text.split("x")
  if len(parts) != 2 or not all(v.isdigit() and int(v) > 0 for v in parts):
    raise argparse.ArgumentTypeError(f"must be NxK with positive ints N and K (e.g. 4096x7168), got {text!r}")
  return text


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--groups", type=positive_int, nargs="+", default=[32, 8], help="local experts")
  p.add_argument("--rows", type=positive_int, nargs="+", default=[128, 512, 1024, 4096], help="rows per expert")
  p.add_argument("--shapes", type=_shape, nargs="+", default=[f"{n}x{k}" for n, k in SHAPES], help="NxK")
  p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
  p.add_argument("--calls", type=positive_int, default=2, help="calls per jitted run (distinct activations)")
  p.add_argument("--max-runs", type=positive_int, default=30, help="timed runs at most (median reported)")
  p.add_argument("--out", default=None, help="directory for the JSON result (default bench/results)")
  p.add_argument("--plot", default=None, help="only plot this result file")
  args = p.parse_args(argv)
  if args.plot:
    print("wrote", _plot(args.plot))
    return 0

  results, checks, failed = [], [], []
  # A timeout (SIGTERM) still writes what was measured.
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
  try:
    _run(args, results, checks, failed)
  finally:
    path = write_result("gemm", {"unit": "TFLOP/s = 2 * real rows * N * K / median time per call", "rows": results,
                                 "failed": failed, "calc_diff_vs_fp32_dequantized": checks}, args.out)
    print("wrote", path)
  if results:  # nothing to draw where every method failed
    plot_if_possible(path, _plot)
  return 0


def _run(args, results, checks, failed):
  print(f"{'N':>5} {'K':>5} {'G':>3} {'rows':>5} {'method':>17} {'us':>9} {'TFLOP/s':>8} {'first s':>8}"
        + (f" {'device us':>9} {'TFLOP/s':>8}" if jax.default_backend() == "gpu" else ""))
  for shape in args.shapes:
    n, k = (int(v) for v in shape.split("x"))
    for g in args.groups:
      for rows in args.rows:
        flops = 2.0 * g * rows * n * k
        sizes = jnp.full((g,), rows, jnp.int32)
        sets = [_inputs(jax.random.key(1000 * s + g + rows), g, rows, n, k, args.calls,
                        any(m.startswith("fp8_wgrad") for m in args.methods))
                for s in range(2)]
        diffs = _check(g, rows, n, k, sets[0][0], sets[0][1][0], sizes, args.methods)
        checks.append({"n": n, "k": k, "groups": g, "rows_per_group": rows, "calc_diff": diffs})
        for method in args.methods:
          variants = MGPU_CONFIGS if method == "bf16_mgpu" else (None,)
          best = None
          for cfg in variants:
            try:
              t = _time(method, g, rows, n, k, sets, sizes, args.calls, args.max_runs, cfg)
            except Exception as e:  # pylint: disable=broad-except  (a baseline that does not run here)
              print(f"{n:>5} {k:>5} {g:>3} {rows:>5} {method:>17} failed: {type(e).__name__}: {str(e)[:120]}")
              failed.append({"n": n, "k": k, "groups": g, "rows_per_group": rows, "method": method,
                             "error": f"{type(e).__name__}: {str(e)[:300]}"})
              continue
            if best is None or t["median_s"] < best[0]["median_s"]:
              best = (t, cfg)
          if best is None:
            continue
          t, cfg = best
          tflops = flops / t["median_s"] / 1e12
          device = {} if "device_us" not in t else {"device_tflops": flops / t["device_us"] / 1e6}
          results.append({"n": n, "k": k, "groups": g, "rows_per_group": rows, "method": method, "tflops": tflops,
                          "flops": flops, **({"mgpu_config": cfg} if cfg else {}), **t, **device})
          print(f"{n:>5} {k:>5} {g:>3} {rows:>5} {method:>17} {t['median_s'] * 1e6:>9.1f} {tflops:>8.1f} "
                f"{t['first_call_s']:>8.1f}" + (f" {t['device_us']:>9.1f} {device['device_tflops']:>8.1f}"
                                                 if device else ""), flush=True)
        del sets


if __name__ == "__main__":
  sys.exit(main())
