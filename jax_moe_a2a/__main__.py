"""Command line: ``python -m jax_moe_a2a {demo,report,bench} ...``.

  demo     a small MoE layer on every device (8 simulated CPU devices without an accelerator), forward and
           backward under jit, checked against the dense oracle (``demo --help`` lists its options)
  report   the wire formats' payload and workspace bytes for a model shape, and a quantization check through
           the custom call and its pure-JAX twin
  bench    run a benchmark script of the repository's bench/ folder (e.g. ``bench quant``)
  plan     expert parallelism over nodes on paper: bytes per link and predicted dispatch/combine times, flat
           against two-level (``plan --help``)
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys


def _size(num_bytes: int) -> str:
  return f"{num_bytes / 2**20:.1f} MiB" if num_bytes >= 2**20 else f"{num_bytes / 2**10:.1f} KiB"


def _report(args: argparse.Namespace) -> int:
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  from jax_moe_a2a import _ffi, layout, quant  # pylint: disable=import-outside-toplevel

  print(f"jax {jax.__version__}, backend {jax.default_backend()}, {len(jax.devices())} device(s); extension: "
        f"{'built' + (' with CUDA' if _ffi.with_cuda() else ' (CPU only)') if _ffi.available() else 'missing'}")
  print(f"\nPayload per token, hidden={args.hidden}, top_k={args.top_k}:")
  print(f"  {'format':<14} {'x':>7} {'x_sf':>6} {'ids':>5} {'weights':>8} {'total':>7}   ws/rank ({args.ranks} ranks, "
        f"capacity {args.capacity}; for training: room for bf16 rows)")
  for fmt in layout.FORMATS:
    try:
      d = layout.dispatch_layout(args.hidden, fmt, top_k=args.top_k, mx_alignment=args.mx_alignment
                                 if fmt == layout.MXFP8 else None)
      sizes = dict(num_ranks=args.ranks, capacity=args.capacity, hidden=args.hidden, top_k=args.top_k, fmt=fmt,
                   mx_alignment=args.mx_alignment if fmt == layout.MXFP8 else None)
      ws = layout.workspace_layout(**sizes)
      ws_training = layout.workspace_layout(**sizes, training=True)
    except ValueError as e:
      print(f"  {fmt:<14} not available: {e}")
      continue
    print(f"  {fmt:<14} {d.x_bytes_per_token:>7} {d.x_sf_bytes_per_token:>6} {d.topk_ids_bytes_per_token:>5} "
          f"{d.topk_weights_bytes_per_token:>8} {d.bytes_per_token:>7}   {_size(ws.total_bytes):>9}; "
          f"{_size(ws_training.total_bytes)} for training")

  if args.hidden % 128:
    return 0
  x = jax.random.normal(jax.random.key(0), (args.tokens, args.hidden), jnp.bfloat16)
  ref = np.asarray(x, np.float32)
  print(f"\nRound trip of {args.tokens} x {args.hidden} bf16 values:")
  for fmt in layout.FORMATS:
    x_q, x_sf, global_scale = quant.quantize(x, fmt)
    deq = np.asarray(quant.dequantize(x_q, x_sf, fmt, global_scale=global_scale), np.float32)
    rel = np.linalg.norm(deq - ref) / np.linalg.norm(ref)
    print(f"  {fmt:<14} relative error {rel:.2e}")
  q_ref, sf_ref = quant.quantize_fp8_blockwise(x, impl="reference")
  if _ffi.available() and jax.default_backend() in _ffi.register():
    q, sf = quant.quantize_fp8_blockwise(x, impl="ffi")
    same = bool(np.array_equal(np.asarray(q).view(np.uint8), np.asarray(q_ref).view(np.uint8))
                and np.array_equal(np.asarray(sf).view(np.uint32), np.asarray(sf_ref).view(np.uint32)))
    print(f"\nCustom call jax_moe_a2a_quantize_fp8_blockwise on {jax.default_backend()}: "
          f"{'bit-exact' if same else 'DIFFERS'} against the pure-JAX twin")
    return 0 if same else 1
  print("\nCustom call not run: the extension has no handlers for this backend.")
  return 0


def _bench(args: argparse.Namespace) -> int:
  bench_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
  script = os.path.join(bench_dir, f"bench_{args.name}.py")
  if not os.path.exists(script):
    available = sorted(f[6:-3] for f in os.listdir(bench_dir) if f.startswith("bench_")) if os.path.isdir(
        bench_dir) else []
    print(f"bench: no benchmark {args.name!r} in {bench_dir} (available: {available or 'none; run from a checkout'})",
          file=sys.stderr)
    return 2
  sys.argv = [script] + args.rest
  runpy.run_path(script, run_name="__main__")
  return 0


def _plan(args: argparse.Namespace) -> int:
  from jax_moe_a2a import plan  # pylint: disable=import-outside-toplevel  (imports no jax)
  ranks = [n * args.gpus_per_node for n in args.nodes]
  bad = [r for r in ranks if args.experts % r]
  if bad:
    print(f"plan: --experts ({args.experts}) must be divisible by every nodes * gpus-per-node, got {bad}",
          file=sys.stderr)
    return 2
  return plan.run(args)


def _demo(args: argparse.Namespace) -> int:
  from jax_moe_a2a import demo  # pylint: disable=import-outside-toplevel
  demo.simulate_cpu_devices()  # before anything imports jax
  return demo.run(args)


def main(argv=None) -> int:
  from jax_moe_a2a import demo  # pylint: disable=import-outside-toplevel  (imports no jax)

  parser = argparse.ArgumentParser(prog="python -m jax_moe_a2a", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest="command", required=True)
  dem = sub.add_parser("demo", parents=[demo.parser()], add_help=False, description=demo.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       help="a small MoE layer on every device, checked against the dense oracle")
  dem.set_defaults(fn=_demo)
  rep = sub.add_parser("report", help="payload/workspace bytes per format and a quantization check")
  rep.add_argument("--hidden", type=demo.positive_int, default=7168,
                   help="activation width (default: DeepSeek-V3's 7168)")
  rep.add_argument("--top-k", type=demo.positive_int, default=8, help="experts per token")
  rep.add_argument("--ranks", type=demo.positive_int, default=8, help="ranks on the expert axis")
  rep.add_argument("--capacity", type=demo.positive_int, default=4096, help="tokens per rank")
  rep.add_argument("--tokens", type=demo.positive_int, default=256, help="rows for the quantization check")
  rep.add_argument("--mx-alignment", type=demo.int_in(32, multiple_of=32), default=None,
                   help="mxfp8 scale padding (multiple of 32)")
  rep.set_defaults(fn=_report)
  pla = sub.add_parser("plan", help="bytes per link and predicted times over nodes: flat vs two-level")
  pla.add_argument("--nodes", type=demo.positive_int, nargs="+", default=[2, 4, 8, 16], help="node counts")
  pla.add_argument("--gpus-per-node", type=demo.positive_int, default=8)
  pla.add_argument("--hidden", type=demo.positive_int, default=7168)
  pla.add_argument("--top-k", type=demo.positive_int, default=8)
  pla.add_argument("--experts", type=demo.positive_int, default=256)
  pla.add_argument("--tokens", type=demo.positive_int, default=4096, help="tokens per GPU")
  pla.add_argument("--wire", choices=["bf16", "fp8_blockwise"], default="fp8_blockwise")
  pla.add_argument("--nic-gbps", type=demo.float_in(0.001), default=400.0,
                   help="NIC line rate per GPU, Gb/s (assumed)")
  pla.add_argument("--nic-efficiency", type=demo.float_in(0.01, 1.0), default=0.8,
                   help="share of the line rate an exchange gets (assumed)")
  pla.add_argument("--nic-latency-us", type=demo.float_in(0.0), default=20.0,
                   help="fixed cost of one inter-node exchange, us (assumed)")
  pla.set_defaults(fn=_plan)
  ben = sub.add_parser("bench", help="run bench/bench_<name>.py with the remaining arguments")
  ben.add_argument("name", help="benchmark name, e.g. quant")
  ben.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the benchmark")
  ben.set_defaults(fn=_bench)
  args = parser.parse_args(argv)
  return args.fn(args)


if __name__ == "__main__":
  sys.exit(main())
