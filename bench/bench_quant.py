"""Activation quantizers: each custom call against its pure-JAX reference under jit, in GB/s.

Bytes moved = what the op reads + what it writes, at the sizes of its arrays (bf16 input, 2 bytes/value):

  fp8 [M,K/128], [K/128,M]  x read; E4M3 codes (1 byte/value) and a float32 scale per 128 values written
  kmajor G<g>               `quant.quantize_fp8_grouped_kmajor` of --groups equal groups (the weight gradient's
                            operands): x read once, q_t [K, P] and sf_t [P/128, K] written, P = round_up(M, 128)
                            + 128 G (padding included)
  kmajor_fp8 G<g>           the same from E4M3 codes and their 1x128 scales read through a row gather (the layer's
                            form: the forward's kept codes in the sorted order of the backward): codes, scales and
                            row ids read, the same written
  weight, weight_t          `quant.quantize_fp8_weight` of x as one [M, K] weight (128x128 blocks): x read, codes and
                            a float32 scale per block written; weight_t `quantize_fp8_weight_with_transpose`, the
                            transposed codes [K, M] written too
  mxfp8                     x read; E4M3 codes and an E8M0 byte per 32 values written
  mxfp8->bf16               codes and scales read, bf16 values written
  nvfp4 gs                  given global scale: x read; E2M1 codes (half a byte/value) and an E4M3 byte per 16
                            values written
  nvfp4                     derived global scale: x read twice (its amax, then the codes), the same written
  nvfp4 amax                `quant_mx.nvfp4_global_scale`: x read
  nvfp4->bf16               codes and scales read, bf16 values written

Ceilings, XLA's own fusions in the same harness (one row each, impl "xla"), for what the memory system gives to
these access patterns on the machine at hand:

  xla_copy                  x + 1 in bf16: x read, the same bytes written
  xla_read                  the largest |x|: x read, nothing but the result written
  xla_e4m3                  x cast to E4M3 (no scale): x read, one byte per value written

On a GPU each row also gives the op's device time per call (its kernels' durations in a profiler trace of one run),
the bytes over it, and the device span per call (first kernel start to last kernel end: the durations plus the gaps
between kernels). The wall time per call also carries the host's dispatch of each run and the wait for its end,
spread over the run's calls.

  python bench/bench_quant.py [--m 16384] [--k 7168] [--ops mxfp8 nvfp4 ...] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import device_time_per_call, int_in, positive_int, time_per_call, write_result  # noqa: E402

from jax_moe_a2a import quant, quant_mx  # noqa: E402

OPS = ("fp8", "fp8_bmk", "kmajor", "kmajor_fp8", "weight", "weight_t", "mxfp8", "mxfp8_dequant", "nvfp4_gs", "nvfp4",
       "nvfp4_amax", "nvfp4_dequant", "xla_copy", "xla_read", "xla_e4m3")
# The ceilings: XLA's fusion of x and the bytes it writes per value of x.
_CEILING_OPS = {"xla_copy": (lambda x: x + jnp.bfloat16(1), 2), "xla_read": (lambda x: jnp.max(jnp.abs(x)), 0),
                "xla_e4m3": (lambda x: x.astype(jnp.float8_e4m3fn), 1)}
CEILINGS = tuple(_CEILING_OPS)
_LABELS = {"fp8": "fp8 [M,K/128]", "fp8_bmk": "fp8 [K/128,M]", "mxfp8": "mxfp8", "mxfp8_dequant": "mxfp8->bf16",
           "nvfp4_gs": "nvfp4 gs", "nvfp4": "nvfp4", "nvfp4_amax": "nvfp4 amax", "nvfp4_dequant": "nvfp4->bf16",
           "weight": "weight", "weight_t": "weight+T", "xla_copy": "xla copy", "xla_read": "xla read",
           "xla_e4m3": "xla e4m3"}


def _op(name: str, m: int, k: int, groups: int):
  """(fn(x, impl), bytes, prepare): `prepare` turns a bf16 input into the op's input (a dequantizer's codes)."""
  mk = m * k
  same = lambda x: (x,)
  if name in ("fp8", "fp8_bmk"):
    bmk = name == "fp8_bmk"
    return (lambda x, impl: quant.quantize_fp8_blockwise(x, block_major_k=bmk, impl=impl),
            2 * mk + mk + (mk // 128) * 4, same)
  if name in ("kmajor", "kmajor_fp8"):
    sizes = jnp.full((groups,), m // groups, jnp.int32).at[-1].add(m % groups)
    p_len = quant.grouped_kmajor_length(m, groups)
    written = k * p_len + (p_len // 128) * k * 4
    if name == "kmajor":
      return lambda x, impl: quant.quantize_fp8_grouped_kmajor(x, sizes, impl=impl), 2 * mk + written, same
    rows = jax.random.permutation(jax.random.key(0), m).astype(jnp.int32)
    return (lambda q, sf, impl: quant.quantize_fp8_grouped_kmajor(q, sizes, sf, rows=rows, impl=impl),
            mk + (mk // 128) * 4 + m * 4 + written, lambda x: quant.quantize_fp8_blockwise(x, impl="reference"))
  if name in ("weight", "weight_t"):
    transposed = name == "weight_t"
    fn = quant.quantize_fp8_weight_with_transpose if transposed else quant.quantize_fp8_weight
    scales = -(-m // 128) * (k // 128) * 4
    return lambda x, impl: fn(x, impl=impl), 2 * mk + (2 if transposed else 1) * mk + scales, same
  if name == "mxfp8":
    return lambda x, impl: quant_mx.quantize_mxfp8(x, impl=impl), 2 * mk + mk + mk // 32, same
  if name == "mxfp8_dequant":
    return (lambda q, sf, impl: quant_mx.dequantize_mxfp8(q, sf, dtype=jnp.bfloat16, impl=impl),
            mk + mk // 32 + 2 * mk, lambda x: quant_mx.quantize_mxfp8(x, impl="reference"))
  if name in CEILINGS:
    fn, written_per_value = _CEILING_OPS[name]
    return lambda x, impl: fn(x), 2 * mk + written_per_value * mk, same
  nv_out = mk // 2 + mk // 16
  if name == "nvfp4_gs":
    return (lambda x, gs, impl: quant_mx.quantize_nvfp4(x, global_scale=gs, impl=impl), 2 * mk + nv_out,
            lambda x: (x, quant_mx.nvfp4_global_scale(x, impl="reference")))
  if name == "nvfp4":
    return lambda x, impl: quant_mx.quantize_nvfp4(x, impl=impl), 2 * 2 * mk + nv_out, same
  if name == "nvfp4_amax":
    return lambda x, impl: quant_mx.nvfp4_global_scale(x, impl=impl), 2 * mk, same
  assert name == "nvfp4_dequant", name
  return (lambda q, sf, gs, impl: quant_mx.dequantize_nvfp4(q, sf, gs, dtype=jnp.bfloat16, impl=impl),
          nv_out + 2 * mk, lambda x: quant_mx.quantize_nvfp4(x, impl="reference"))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--m", type=positive_int, nargs="+", default=[1024, 4096, 16384], help="rows (tokens)")
  p.add_argument("--k", type=int_in(128, multiple_of=128), default=7168, help="hidden size, a multiple of 128")
  p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS), help="the ops to time (table above)")
  p.add_argument("--groups", type=positive_int, default=32, help="groups of the K-major layout (M split evenly)")
  p.add_argument("--calls", type=positive_int, default=16, help="calls per jitted run (distinct inputs)")
  p.add_argument("--runs", type=positive_int, default=40, help="timed runs; the median is reported")
  p.add_argument("--repeats", type=positive_int, default=2,
                 help="time each variant this many times, interleaved, to show the spread between identical "
                      "measurements")
  p.add_argument("--out", default=None, help="directory for the JSON result (default bench/results)")
  args = p.parse_args(argv)

  rows = []
  print(f"{'M':>6} {'K':>6} {'op':>13} {'impl':>9} {'us/call':>9} {'GB/s':>8}   (median per call, wall)"
        + ("  device us, GB/s, span us (profiler trace)" if jax.default_backend() == "gpu" else ""))
  for m in args.m:
    k = args.k
    key = jax.random.key(m)
    # Two sets of `calls` distinct inputs, rotated between runs.
    sets = [tuple(jax.random.normal(jax.random.fold_in(key, 100 * s + i), (m, k), jnp.bfloat16)
                  for i in range(args.calls)) for s in range(2)]
    for name in args.ops:
      fn, nbytes, prepare = _op(name, m, k, args.groups)
      op_sets = [tuple(prepare(x) for x in xs) for xs in sets]
      flat = [tuple(a for operands in xs for a in operands) for xs in op_sets]
      arity = len(op_sets[0][0])
      fns = {impl: jax.jit(lambda *a, impl=impl: [fn(*a[i:i + arity], impl=impl) for i in range(0, len(a), arity)])
             for impl in (("xla",) if name in CEILINGS else ("ffi", "reference"))}
      for repeat in range(args.repeats):
        for impl, f in fns.items():
          t = time_per_call(f, flat, calls_per_run=args.calls, runs=args.runs, warmup=10)
          gbps = nbytes / t["median_s"] / 1e9
          row = {"m": m, "k": k, "op": name, "impl": impl, "repeat": repeat, "bytes": nbytes, "gb_per_s": gbps, **t}
          device_us, span = device_time_per_call(f, flat[repeat % len(flat)], args.calls)
          if device_us is not None:
            row.update(device_us=device_us, device_span_us=span, device_gb_per_s=nbytes / device_us / 1e3)
          if name in ("fp8", "fp8_bmk"):
            row["block_major_k"] = name == "fp8_bmk"
          if name in ("kmajor", "kmajor_fp8"):
            row["grouped_kmajor_groups"] = args.groups
          rows.append(row)
          label = _LABELS.get(name, f"{name} G{args.groups}")
          device = "" if device_us is None else f" {device_us:>9.1f} {row['device_gb_per_s']:>8.0f} {span:>9.1f}"
          print(f"{m:>6} {k:>6} {label:>13} {impl:>9} {t['median_s'] * 1e6:>9.1f} {gbps:>8.0f}{device}", flush=True)
      del op_sets, flat
    del sets
  path = write_result("quant", {"unit": "GB/s (bytes read + written / median time)", "device_unit":
                                 "device_gb_per_s: the same bytes / device_us, the op's kernel time per call from a "
                                 "profiler trace; device_span_us: first kernel start to last kernel end per call "
                                 "(GPU only)", "rows": rows}, args.out)
  print("wrote", path)
  return 0


if __name__ == "__main__":
  sys.exit(main())
