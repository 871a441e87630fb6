"""Command line: ``python -m jax_moe_a2a {demo,report,bench} ...``.

  demo     a small MoE layer on every device (8 simulated CPU devices without an accelerator), forward and
           backward under jit, checked against the dense oracle (``demo --help`` lists its options)
  report   the wire formats' payload and workspace bytes for a model shape, and a quantization check through
           the custom call and its pure-JAX reference
  bench    run a benchmark script of the repository's bench/ folder (e.g. ``bench quant``; needs a checkout)
  plan     expert parallelism over nodes on paper: bytes per link and predicted dispatch/combine times, flat
           against two-level (``plan --help``)
"""

from __future__ import annotations

import argparse
import os
import re
import runpy
import sys
from typing import Optional


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
          f"{'bit-exact' if same else 'DIFFERS'} against the pure-JAX reference")
    return 0 if same else 1
  print("\nCustom call not run: the extension has no handlers for this backend.")
  return 0


def _bench_dir() -> str:
  return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def _bench(args: argparse.Namespace) -> int:
  script = os.path.join(_bench_dir(), f"bench_{args.name}.py")
  sys.argv = [script] + args.rest
  runpy.run_path(script, run_name="__main__")
  return 0


def _plan(args: argparse.Namespace) -> int:
  from jax_moe_a2a import plan  # pylint: disable=import-outside-toplevel  (imports no jax)
  return plan.run(args)


def _demo(args: argparse.Namespace) -> int:
  from jax_moe_a2a import demo  # pylint: disable=import-outside-toplevel
  demo.simulate_cpu_devices()  # before anything imports jax
  return demo.run(args)


# ----------------------------------------------------------------------------------------------------------------
# Checks of the options against each other and against what the layer and the model accept, run after parsing and
# before any heavy work: a value they would refuse is a usage error naming its option (exit status 2), not a
# traceback from deep inside.
# ----------------------------------------------------------------------------------------------------------------


class _OptionError(Exception):
  """A refused option value: `option` (None where no option is to blame) and why."""

  def __init__(self, option: Optional[str], message: str):
    super().__init__(message)
    self.option = option


# The names the library's errors give the options' values ("op: name must be X, got Y"), per subcommand.
_PLAN_NAMES = {"nodes": "--nodes", "gpus_per_node": "--gpus-per-node", "hidden": "--hidden", "top_k": "--top-k",
               "num_experts": "--experts", "tokens": "--tokens", "wire_format": "--wire", "nic_gbps": "--nic-gbps",
               "nic_efficiency": "--nic-efficiency", "nic_latency_us": "--nic-latency-us"}
_DEMO_NAMES = {"num_experts": "--experts", "top_k": "--top-k", "hidden": "--hidden", "ffn": "--ffn",
               "wire_format": "--wire", "n_group": "--n-group", "topk_group": "--topk-group",
               "router_kind": "--router", "num_shared_experts": "--shared-experts", "fp8_weights": "--fp8-weights",
               "dtype": "--dtype", "expert_precision": "--expert-precision", "tp_axis": "--tp",
               "sequence_parallel": "--sequence-parallel", "expert_backward": "--expert-backward"}


def _refused(error: ValueError, names: dict[str, str]) -> _OptionError:
  """The library's `error` as a usage error of the option whose value it names first (after an ``op: ``)."""
  message = str(error)
  for m in re.finditer(r"(?<=: )\w+", message):
    if m.group(0) in names:
      return _OptionError(names[m.group(0)], message)
  return _OptionError(None, message)


def _check_hidden_fits(hidden: int, wire: str) -> None:
  from jax_moe_a2a import layout  # pylint: disable=import-outside-toplevel  (imports nothing)
  try:
    layout.dispatch_layout(hidden, wire)
  except ValueError as e:
    block = layout.format_spec(wire).block
    raise _OptionError("--hidden", f"must be a multiple of {block} for --wire {wire}, got {hidden}"
                       if block else f"must fit --wire {wire}, got {hidden} ({e})") from None


def _check_plan(args: argparse.Namespace) -> None:
  from jax_moe_a2a import plan  # pylint: disable=import-outside-toplevel  (imports no jax)
  bad = [n * args.gpus_per_node for n in args.nodes if args.experts % (n * args.gpus_per_node)]
  if bad:
    raise _OptionError("--experts", f"must be divisible by --gpus-per-node times every --nodes value "
                                    f"({', '.join(map(str, bad))} here), got {args.experts}")
  if args.top_k > args.experts:
    raise _OptionError("--top-k", f"must be <= --experts ({args.experts}), got {args.top_k}")
  _check_hidden_fits(args.hidden, args.wire)
  for n in args.nodes:  # the model's own checks: arithmetic only
    try:
      plan.plans(nodes=n, gpus_per_node=args.gpus_per_node, hidden=args.hidden, top_k=args.top_k,
                 num_experts=args.experts, tokens=args.tokens, wire_format=args.wire, nic_gbps=args.nic_gbps,
                 nic_efficiency=args.nic_efficiency, nic_latency_us=args.nic_latency_us)
    except ValueError as e:
      raise _refused(e, _PLAN_NAMES) from None


def _check_demo(args: argparse.Namespace) -> None:
  from jax_moe_a2a import demo  # pylint: disable=import-outside-toplevel  (imports no jax)
  demo.simulate_cpu_devices()  # before anything imports jax
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jax_moe_a2a import moe, quant  # pylint: disable=import-outside-toplevel

  # The rules of moe.MoEConfig and routing.RouterConfig in the options' words, then those of the device count.
  if args.top_k > args.experts:
    raise _OptionError("--top-k", f"must be <= --experts ({args.experts}), got {args.top_k}")
  _check_hidden_fits(args.hidden, args.wire)
  try:
    precision = demo.expert_precision(args)
  except ValueError as e:
    raise _OptionError("--expert-precision", str(e).split(" ", 1)[1]) from None
  if args.expert_backward != "bf16" and precision != "fp8":
    raise _OptionError("--expert-backward", f"{args.expert_backward} is a backward of FP8 experts: it needs "
                                            f"--expert-precision fp8, got --expert-precision {precision}")
  if precision == "fp8":
    for option, v in (("--hidden", args.hidden), ("--ffn", args.ffn)):
      if v % quant.FP8_BLOCK:
        raise _OptionError(option, f"must be a multiple of {quant.FP8_BLOCK} with --expert-precision fp8 (FP8 "
                                   f"experts), got {v}")
  if args.router == "deepseek_v3":
    if args.experts % args.n_group:
      raise _OptionError("--n-group", f"must divide --experts ({args.experts}), got {args.n_group}")
    if args.topk_group > args.n_group:
      raise _OptionError("--topk-group", f"must be <= --n-group ({args.n_group}), got {args.topk_group}")
    reachable = args.topk_group * (args.experts // args.n_group)
    if args.top_k > reachable:
      raise _OptionError("--top-k", f"must be <= the experts of --topk-group groups, {args.topk_group} * "
                                    f"{args.experts // args.n_group} = {reachable}, got {args.top_k}")
  if args.sequence_parallel and args.tp == 1:
    raise _OptionError("--sequence-parallel", "needs --tp > 1 (the axis tokens are replicated over)")
  n = jax.device_count()
  for option, v in (("--tp", args.tp), ("--data", args.data)):
    if n % v:
      raise _OptionError(option, f"must divide the device count ({n}), got {v}")
  if args.tp > 1 and args.data not in (1, n // args.tp):
    raise _OptionError("--data", f"must be 1 or {n // args.tp} with --tp {args.tp} (the mesh is (data, tp) = "
                                 f"({n // args.tp}, {args.tp})), got {args.data}")
  ranks = n if args.tp > 1 else n // args.data
  if args.experts % ranks:
    raise _OptionError("--experts", f"must be divisible by the {ranks} ranks of the expert axis, got {args.experts}")
  if args.sequence_parallel and args.tokens % args.tp:
    raise _OptionError("--tokens", f"must be divisible by --tp ({args.tp}) with --sequence-parallel, got "
                                   f"{args.tokens}")
  router = dict(router_kind=args.router)
  if args.router == "deepseek_v3":
    router.update(n_group=args.n_group, topk_group=args.topk_group)
  try:
    moe.MoEConfig(num_experts=args.experts, top_k=args.top_k, hidden=args.hidden, ffn=args.ffn,
                  wire_format=args.wire, num_shared_experts=args.shared_experts, fp8_weights=args.fp8_weights,
                  dtype=jnp.dtype(args.dtype), expert_precision=precision,
                  expert_backward=args.expert_backward, **router)
  except ValueError as e:
    raise _refused(e, _DEMO_NAMES) from None


def _check_bench(args: argparse.Namespace) -> None:
  bench_dir = _bench_dir()
  if not os.path.isdir(bench_dir):  # an installed package: the benchmarks live in the repository only
    raise _OptionError(None, f"bench needs a checkout of the repository: it runs the scripts of its bench/ folder, "
                             f"which the installed package does not have (no {bench_dir}); clone the repository, "
                             f"`pip install -e .` there and run it from the checkout")
  if not os.path.exists(os.path.join(bench_dir, f"bench_{args.name}.py")):
    available = sorted(f[6:-3] for f in os.listdir(bench_dir) if f.startswith("bench_") and f.endswith(".py"))
    raise _OptionError("name", f"must name a benchmark of {bench_dir} ({', '.join(available)}), got {args.name!r}")


def main(argv=None) -> int:
  from jax_moe_a2a import demo, layout  # pylint: disable=import-outside-toplevel  (they import no jax)

  parser = argparse.ArgumentParser(prog="python -m jax_moe_a2a", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest="command", required=True)
  dem = sub.add_parser("demo", parents=[demo.parser()], add_help=False, description=demo.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       help="a small MoE layer on every device, checked against the dense oracle")
  dem.set_defaults(fn=_demo, check=_check_demo, parser=dem)
  rep = sub.add_parser("report", help="payload/workspace bytes per format and a quantization check")
  rep.add_argument("--hidden", type=demo.positive_int, default=7168,
                   help="activation width (default: DeepSeek-V3's 7168)")
  rep.add_argument("--top-k", type=demo.positive_int, default=8, help="experts per token")
  rep.add_argument("--ranks", type=demo.positive_int, default=8, help="ranks on the expert axis")
  rep.add_argument("--capacity", type=demo.positive_int, default=4096, help="tokens per rank")
  rep.add_argument("--tokens", type=demo.positive_int, default=256, help="rows for the quantization check")
  rep.add_argument("--mx-alignment", type=demo.int_in(32, multiple_of=32), default=None,
                   help="mxfp8 scale padding (multiple of 32)")
  rep.set_defaults(fn=_report, parser=rep)
  pla = sub.add_parser("plan", help="bytes per link and predicted times over nodes: flat vs two-level")
  # The model's arithmetic is on floats and Python ints: the bounds keep it finite and quick (expert ids are int32,
  # byte counts int64).
  count, experts = demo.int_in(1, 2**63 - 1), demo.int_in(1, 2**31 - 1)
  pla.add_argument("--nodes", type=count, nargs="+", default=[2, 4, 8, 16], help="node counts")
  pla.add_argument("--gpus-per-node", type=count, default=8)
  pla.add_argument("--hidden", type=count, default=7168)
  pla.add_argument("--top-k", type=experts, default=8)
  pla.add_argument("--experts", type=experts, default=256)
  pla.add_argument("--tokens", type=count, default=4096, help="tokens per GPU")
  pla.add_argument("--wire", choices=layout.FORMATS, default="fp8_blockwise",
                   help="wire format of the first table (the second shows every format)")
  pla.add_argument("--nic-gbps", type=demo.float_in(0.001), default=400.0,
                   help="NIC line rate per GPU, Gb/s (assumed)")
  pla.add_argument("--nic-efficiency", type=demo.float_in(0.01, 1.0), default=0.8,
                   help="share of the line rate an exchange gets (assumed)")
  pla.add_argument("--nic-latency-us", type=demo.float_in(0.0), default=20.0,
                   help="fixed cost of one inter-node exchange, us (assumed)")
  pla.set_defaults(fn=_plan, check=_check_plan, parser=pla)
  ben = sub.add_parser("bench", help="run bench/bench_<name>.py with the remaining arguments")
  ben.add_argument("name", help="benchmark name, e.g. quant")
  ben.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the benchmark")
  ben.set_defaults(fn=_bench, check=_check_bench, parser=ben)
  args = parser.parse_args(argv)
  try:
    getattr(args, "check", lambda _: None)(args)
  except _OptionError as e:
    args.parser.error(str(e) if e.option is None else f"argument {e.option}: {e}")
  return args.fn(args)


if __name__ == "__main__":
  sys.exit(main())
