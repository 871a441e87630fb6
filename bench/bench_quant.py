"""FP8 1x128 quantization: the custom call against its pure-JAX twin under jit, in GB/s.

Bytes moved = x read (2 bytes/value for bf16) + x_q written (1 byte/value) + scales written (4 bytes per 128
values). The copy ceiling of an H200 is about 4.3 TB/s (read + write).

Layout "kmajor G<g>": `quant.quantize_fp8_grouped_kmajor` of --groups equal groups (the weight gradient's
operands): x read once, q_t [K, P] and sf_t [P/128, K] written, P = round_up(M, 128) + 128 G (padding included).

  python bench/bench_quant.py [--m 16384] [--k 7168] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import int_in, positive_int, time_per_call, write_result  # noqa: E402

from jax_moe_a2a import quant  # noqa: E402


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--m", type=positive_int, nargs="+", default=[1024, 4096, 16384], help="rows (tokens)")
  p.add_argument("--k", type=int_in(128, multiple_of=128), default=7168, help="hidden size, a multiple of 128")
  p.add_argument("--groups", type=positive_int, default=32, help="groups of the K-major layout (M split evenly)")
  p.add_argument("--calls", type=positive_int, default=16, help="calls per jitted run (distinct inputs)")
  p.add_argument("--runs", type=positive_int, default=40, help="timed runs; the median is reported")
  p.add_argument("--repeats", type=positive_int, default=2,
                 help="time each variant this many times, interleaved, to show the spread between identical "
                      "measurements")
  p.add_argument("--out", default=None, help="directory for the JSON result (default bench/results)")
  args = p.parse_args(argv)

  rows = []
  print(f"{'M':>6} {'K':>6} {'layout':>11} {'impl':>9} {'us/call':>9} {'GB/s':>8}   (median per call)")
  for m in args.m:
    k = args.k
    nbytes = m * k * 2 + m * k + (m * k // 128) * 4
    key = jax.random.key(m)
    # Two sets of `calls` distinct inputs, rotated between runs.
    sets = [tuple(jax.random.normal(jax.random.fold_in(key, 100 * s + i), (m, k), jnp.bfloat16)
                  for i in range(args.calls)) for s in range(2)]
    for block_major_k in (False, True):
      fns = {impl: jax.jit(lambda *xs, impl=impl, bmk=block_major_k: [
          quant.quantize_fp8_blockwise(x, block_major_k=bmk, impl=impl) for x in xs]) for impl in ("ffi", "reference")}
      for repeat in range(args.repeats):
        for impl, fn in fns.items():
          t = time_per_call(fn, sets, calls_per_run=args.calls, runs=args.runs, warmup=10)
          gbps = nbytes / t["median_s"] / 1e9
          layout = "[K/128,M]" if block_major_k else "[M,K/128]"
          rows.append({"m": m, "k": k, "block_major_k": block_major_k, "impl": impl, "repeat": repeat,
                       "bytes": nbytes, "gb_per_s": gbps, **t})
          print(f"{m:>6} {k:>6} {layout:>11} {impl:>9} {t['median_s'] * 1e6:>9.1f} {gbps:>8.0f}", flush=True)
    g = args.groups
    sizes = jnp.full((g,), m // g, jnp.int32).at[-1].add(m % g)
    p_len = quant.grouped_kmajor_length(m, g)
    kbytes = m * k * 2 + k * p_len + (p_len // 128) * k * 4
    fns = {impl: jax.jit(lambda *xs, impl=impl: [quant.quantize_fp8_grouped_kmajor(x, sizes, impl=impl) for x in xs])
           for impl in ("ffi", "reference")}
    for repeat in range(args.repeats):
      for impl, fn in fns.items():
        t = time_per_call(fn, sets, calls_per_run=args.calls, runs=args.runs, warmup=10)
        gbps = kbytes / t["median_s"] / 1e9
        rows.append({"m": m, "k": k, "grouped_kmajor_groups": g, "impl": impl, "repeat": repeat, "bytes": kbytes,
                     "gb_per_s": gbps, **t})
        print(f"{m:>6} {k:>6} {'kmajor G' + str(g):>11} {impl:>9} {t['median_s'] * 1e6:>9.1f} {gbps:>8.0f}",
              flush=True)
    del sets
  path = write_result("quant_fp8_blockwise", {"unit": "GB/s (bytes read + written / median time)",
                                              "rows": rows}, args.out)
  print("wrote", path)
  return 0


if __name__ == "__main__":
  sys.exit(main())
