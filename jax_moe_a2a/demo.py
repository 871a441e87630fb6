"""``python -m jax_moe_a2a demo``: a small MoE layer on every device, checked against the dense oracle.

Builds the layer of `jax_moe_a2a.moe` on all available devices (8 simulated CPU devices when there is no
accelerator), runs its forward and backward passes under `jit`, compares the output and the gradients with
`moe.moe_dense_reference` on one device, and prints a compact report: mesh, wire format, payload and workspace
bytes (from `layout`), errors against the oracle and the median step time. Exits with 1 when a check fails.

Errors are measured as ``calc_diff(x, y) = 1 - 2 sum(x y) / sum(x^2 + y^2)`` (0 for equal tensors, DeepGEMM's
accuracy measure) and as ``max |x - y| / max |y|``.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import time
from typing import Callable, Optional, Sequence

from jax_moe_a2a import layout  # imports nothing: jax is imported later, after the flags
from jax_moe_a2a.testing import calc_diff, max_rel  # NumPy only

_HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"
SIMULATED_CPU_DEVICES = 8
_ACCELERATOR_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin", "jax_rocm7_plugin", "jax_rocm60_plugin", "libtpu")


def _platform_will_be_cpu() -> bool:
  """Whether JAX, once imported, will run on CPU: JAX_PLATFORMS says so, or no accelerator plugin is installed."""
  platforms = os.environ.get("JAX_PLATFORMS", "")
  if platforms:
    return platforms.split(",")[0].strip() == "cpu"
  return not any(importlib.util.find_spec(name) is not None for name in _ACCELERATOR_PLUGINS)


def simulate_cpu_devices(count: int = SIMULATED_CPU_DEVICES) -> bool:
  """Asks XLA for `count` host devices when JAX is not imported yet, will run on CPU, and no count is set.

  Returns whether the flag was added.
  """
  flags = os.environ.get("XLA_FLAGS", "")
  if "jax" in sys.modules or _HOST_DEVICES_FLAG in flags or not _platform_will_be_cpu():
    return False
  os.environ["XLA_FLAGS"] = f"{flags} {_HOST_DEVICES_FLAG}={count}".strip()
  return True


# Argument types of the command line (also the bench scripts'): a bad value is a usage error (exit status 2) that
# names the option, what it accepts and what it got, instead of a traceback or a nan further on.


def int_in(low: int, high: Optional[int] = None, *, multiple_of: int = 1) -> Callable[[str], int]:
  """An argparse ``type=`` for ints in ``[low, high]`` (no upper bound for None) that are multiples of
  `multiple_of`."""
  what = f"an int >= {low}" if high is None else f"an int in [{low}, {high}]"
  if multiple_of != 1:
    what += f", a multiple of {multiple_of}"

  def parse(text: str) -> int:
    try:
      v = int(text)
    except ValueError:
      v = None
    if v is None or v < low or (high is not None and v > high) or v % multiple_of:
      raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return v

  parse.__name__ = what
  return parse


def float_in(low: float, high: Optional[float] = None) -> Callable[[str], float]:
  """An argparse ``type=`` for finite floats in ``[low, high]`` (no upper bound for None)."""
  what = f"a finite float >= {low}" if high is None else f"a finite float in [{low}, {high}]"

  def parse(text: str) -> float:
    try:
      v = float(text)
    except ValueError:
      v = math.nan
    if not math.isfinite(v) or v < low or (high is not None and v > high):
      raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return v

  parse.__name__ = what
  return parse


positive_int = int_in(1)
nonnegative_int = int_in(0)
seed_int = int_in(-2**63, 2**63 - 1)  # what jax.random.key takes


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m jax_moe_a2a demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--wire", choices=layout.FORMATS, default="bf16",
                 help="wire format of the dispatched activations (default: bf16)")
  p.add_argument("--experts", type=positive_int, default=64, help="routed experts (default: 64)")
  p.add_argument("--top-k", type=positive_int, default=6, help="experts per token (default: 6)")
  p.add_argument("--hidden", type=positive_int, default=1024, help="model width (default: 1024)")
  p.add_argument("--ffn", type=positive_int, default=512, help="intermediate width of one expert (default: 512)")
  p.add_argument("--tokens", type=positive_int, default=256,
                 help="tokens per device (per tp group under --tp; default: 256)")
  p.add_argument("--data", type=positive_int, default=1,
                 help="size of the data axis; the rest of the devices form the expert axis (default: 1)")
  p.add_argument("--tp", type=positive_int, default=1,
                 help="size of a tensor-parallel axis over which tokens arrive replicated; >1 gives the mesh "
                      "(data, tp) with the experts over both axes (default: 1, no tp axis)")
  p.add_argument("--sequence-parallel", action="store_true",
                 help="MoE sequence parallelism: each tp rank routes and computes 1/tp of the tokens (needs --tp)")
  p.add_argument("--router", choices=("softmax", "deepseek_v3"), default="softmax",
                 help="softmax top-k, or DeepSeek-V3 grouped sigmoid routing (default: softmax)")
  p.add_argument("--n-group", type=positive_int, default=8, help="deepseek_v3: expert groups (default: 8)")
  p.add_argument("--topk-group", type=positive_int, default=4,
                 help="deepseek_v3: groups kept per token (default: 4)")
  p.add_argument("--shared-experts", type=nonnegative_int, default=0, help="shared experts (default: 0)")
  p.add_argument("--fp8-weights", action="store_true", help="routed expert weights in FP8 with 128x128 block scales")
  p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                 help="compute dtype of the layer (default: bfloat16)")
  p.add_argument("--a2a", choices=("auto", "ffi", "reference"), default="auto",
                 help="dispatch/combine: the one-sided custom calls (ffi), the pure-JAX reference on all_to_all "
                      "(reference), or ffi when the extension is built for this backend (auto, the default)")
  p.add_argument("--expert-precision", choices=("dtype", "fp8"), default=None,
                 help="routed experts: in the compute dtype (default), or in FP8 on the block-scaled grouped GEMMs")
  p.add_argument("--gemm", choices=("dtype", "ffi", "reference"), default="dtype",
                 help="deprecated, use --expert-precision: ffi or reference means --expert-precision fp8")
  p.add_argument("--expert-backward", choices=("bf16", "fp8_dgrad", "fp8"), default="bf16",
                 help="with --expert-precision fp8: the FP8 experts' backward, straight-through on bf16 GEMMs "
                      "(default), "
                      "FP8 data gradients (fp8_dgrad), or FP8 data and weight gradients (fp8)")
  p.add_argument("--steps", type=positive_int, default=5, help="timed steps after one warm-up step (default: 5)")
  p.add_argument("--seed", type=seed_int, default=0, help="PRNG seed (default: 0)")
  p.add_argument("--max-calc-diff", type=float_in(0.0), default=None,
                 help="pass limit on calc_diff of the output and of every gradient (default: 3e-2 with the nvfp4 "
                      "wire, 4e-3 with FP8 experts, 2e-3 with an FP8 wire (fp8_blockwise, mxfp8) or FP8 weights, "
                      "1e-4 otherwise)")
  return p


def expert_precision(args: argparse.Namespace) -> str:
  """The routed experts' precision the options ask for: --expert-precision, else the deprecated --gemm (ffi or
  reference mean "fp8"), else "dtype". Raises ValueError when the two disagree."""
  old = None if args.gemm == "dtype" else "fp8"
  if args.expert_precision is not None and old is not None and args.expert_precision != old:
    raise ValueError(f"--expert-precision must be fp8 with --gemm {args.gemm} (deprecated, read as "
                     f"--expert-precision fp8), got {args.expert_precision}")
  return args.expert_precision or old or "dtype"


def passed(calc_diffs: Sequence[float], *, limit: float, load_equal: bool, loss_diff: float,
           loss_ref: float) -> bool:
  """The demo's verdict: every calc_diff finite and <= limit, the same expert load as the oracle, and the
  load-balance loss within 1e-4 (relative, or absolute below 1) of the oracle's."""
  import math  # pylint: disable=import-outside-toplevel
  return (load_equal and loss_diff <= 1e-4 * max(1.0, abs(loss_ref))
          and all(math.isfinite(c) and c <= limit for c in calc_diffs))


def run(args: argparse.Namespace) -> int:
  """Runs the demo for parsed `args`; returns the exit status (0: every check passed)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel

  from jax_moe_a2a import _ffi, moe  # pylint: disable=import-outside-toplevel
  from jax_moe_a2a.workspace import cpu_compiles_one_sided_backward  # pylint: disable=import-outside-toplevel

  devices = jax.devices()
  n = len(devices)
  if args.tp < 1 or n % args.tp or args.data < 1 or n % args.data:
    print(f"demo: --data and --tp must divide the device count {n}, got --data {args.data} --tp {args.tp}",
          file=sys.stderr)
    return 2
  if args.sequence_parallel and args.tp == 1:
    print("demo: --sequence-parallel needs --tp > 1 (the axis tokens are replicated over)", file=sys.stderr)
    return 2
  if args.tp > 1:
    if args.data != 1 and args.data * args.tp != n:
      print(f"demo: with --tp the mesh is (data, tp) = ({n // args.tp}, {args.tp}); leave --data out", file=sys.stderr)
      return 2
    axes, shape = (moe.DATA_AXIS, moe.TP_AXIS), (n // args.tp, args.tp)
    kw = dict(token_axes=(moe.DATA_AXIS,), expert_axis=axes, tp_axis=moe.TP_AXIS,
              sequence_parallel=args.sequence_parallel)
    token_shards = shape[0]
  else:
    axes, shape = (moe.DATA_AXIS, moe.EXPERT_AXIS), (args.data, n // args.data)
    kw = dict(token_axes=axes, expert_axis=moe.EXPERT_AXIS)
    token_shards = n
  router = dict(router_kind=args.router)
  if args.router == "deepseek_v3":
    router.update(n_group=args.n_group, topk_group=args.topk_group, routed_scaling_factor=2.5)
  if args.gemm != "dtype":
    print(f"demo: --gemm is deprecated: use --expert-precision fp8 (--gemm {args.gemm} is read as that)",
          file=sys.stderr)
  try:
    precision = expert_precision(args)
    config = moe.MoEConfig(num_experts=args.experts, top_k=args.top_k, hidden=args.hidden, ffn=args.ffn,
                           wire_format=args.wire, num_shared_experts=args.shared_experts,
                           fp8_weights=args.fp8_weights, dtype=jnp.dtype(args.dtype),
                           expert_precision=precision,
                           expert_backward=args.expert_backward, **router, **kw)
    mesh = Mesh(np.asarray(devices).reshape(shape), axes)
    num_ranks = int(np.prod([dict(zip(axes, shape))[a] for a in config.expert_axes]))
    if config.num_experts % num_ranks:
      raise ValueError(f"--experts must be divisible by the {num_ranks} ranks of the expert axis, "
                       f"got {config.num_experts}")
  except ValueError as e:
    print(f"demo: {e}", file=sys.stderr)
    return 2

  num_tokens = args.tokens * token_shards
  routed_per_rank = args.tokens // args.tp if args.sequence_parallel else args.tokens
  limit = args.max_calc_diff
  if limit is None:
    # NVFP4's four bits: ~4.5e-3 for the rows' round trip, about twice that through SwiGLU (tests/test_moe.py).
    limit = 3e-2 if args.wire == layout.NVFP4 else 4e-3 if precision == "fp8" \
        else 2e-3 if (args.wire in (layout.FP8_BLOCKWISE, layout.MXFP8) or args.fp8_weights) else 1e-4

  # Inputs: bf16 activations (as after attention) sharded over the token axes, a fixed random output cotangent.
  k_params, k_x, k_ct = jax.random.split(jax.random.key(args.seed), 3)
  params = moe.init_params(k_params, config, mesh)
  x_sharding = NamedSharding(mesh, P(config.token_axes, None))
  x = jax.device_put(jax.random.normal(k_x, (num_tokens, args.hidden), jnp.float32).astype(jnp.bfloat16),
                     x_sharding)
  ct = jax.device_put(jax.random.normal(k_ct, (num_tokens, args.hidden), jnp.float32), x_sharding)
  trained = [name for name in ("router", "w_gate_up", "w_down", "shared_w_gate_up", "shared_w_down")
             if name in params and not (config.fp8_weights and name.startswith("w_"))]

  def loss_fn(apply):
    def loss(p_trained, x, p_rest, ct):
      y, aux = apply({**p_rest, **p_trained}, x)
      return jnp.sum(y.astype(jnp.float32) * ct), aux
    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)

  split = lambda p: ({k: p[k] for k in trained}, {k: v for k, v in p.items() if k not in trained})
  use_ffi = args.a2a == "ffi" or (args.a2a == "auto" and _ffi.available() and
                                  jax.default_backend() in _ffi.register())
  if use_ffi and jax.default_backend() == "cpu" and not cpu_compiles_one_sided_backward():
    if args.a2a == "ffi":
      print(f"demo: --a2a ffi: the one-sided calls' backward does not compile on XLA:CPU of jax {jax.__version__} "
            f"(use jax >= 0.12, or --a2a reference)", file=sys.stderr)
      return 2
    print(f"  (jax {jax.__version__} on CPU: dispatch/combine on the reference exchange; the one-sided calls' backward "
          f"needs jax >= 0.12 there)")
    use_ffi = False
  workspace = moe.make_workspace(config, mesh, num_tokens, training=True) if use_ffi else None
  step = jax.jit(loss_fn(lambda p, x: moe.moe_apply(p, x, config, mesh, workspace=workspace)))
  oracle = jax.jit(loss_fn(lambda p, x: moe.moe_dense_reference(p, x, config)))

  p_trained, p_rest = split(params)
  t0 = time.perf_counter()
  (_, aux), (g_params, g_x) = jax.block_until_ready(step(p_trained, x, p_rest, ct))
  compile_s = time.perf_counter() - t0
  times = []
  for _ in range(max(args.steps, 1)):
    t = time.perf_counter()
    jax.block_until_ready(step(p_trained, x, p_rest, ct))
    times.append(time.perf_counter() - t)
  y = jax.jit(lambda p, x: moe.moe_apply(p, x, config, mesh, workspace=workspace)[0])(params, x)
  if workspace is not None:
    workspace.check()
    workspace.close()

  # The oracle runs on one device.
  params1, x1, ct1 = jax.device_put((params, x, ct), devices[0])
  (_, aux_ref), (g_params_ref, g_x_ref) = oracle(split(params1)[0], x1, split(params1)[1], ct1)
  y_ref = jax.jit(lambda p, x: moe.moe_dense_reference(p, x, config)[0])(params1, x1)

  checks = [("output", y, y_ref), ("grad x", g_x, g_x_ref)]
  checks += [(f"grad {name}", g_params[name], g_params_ref[name]) for name in trained]
  results = [(name, calc_diff(a, b), max_rel(a, b)) for name, a, b in checks]
  load_ok = bool(np.array_equal(np.asarray(aux["expert_load"]), np.asarray(aux_ref["expert_load"])))
  loss_diff = abs(float(aux["load_balance_loss"]) - float(aux_ref["load_balance_loss"]))
  ok = passed([c for _, c, _ in results], limit=limit, load_equal=load_ok, loss_diff=loss_diff,
              loss_ref=float(aux_ref["load_balance_loss"]))

  d = layout.dispatch_layout(args.hidden, args.wire, top_k=args.top_k)
  ws = layout.workspace_layout(num_ranks=num_ranks, capacity=routed_per_rank, hidden=args.hidden, top_k=args.top_k,
                               fmt=args.wire, combine_dtype_bytes=jnp.dtype(config.dtype).itemsize)
  mesh_text = " x ".join(f"{a}={s}" for a, s in zip(axes, shape))
  weights = "fp8 e4m3 (128x128 block scales)" if args.fp8_weights else str(config.param_dtype)
  print("jax_moe_a2a demo: MoE forward + backward under jit, checked against the dense FP32 oracle")
  print(f"  devices      {n} x {devices[0].platform} ({devices[0].device_kind}), jax {jax.__version__}")
  print(f"  mesh         {mesh_text}; tokens over {config.token_axes}, experts over {config.expert_axis!r}"
        + (f", tokens replicated over 'tp' (sequence parallel: {'on' if args.sequence_parallel else 'off'})"
           if args.tp > 1 else ""))
  print(f"  layer        {args.experts} experts ({args.experts // num_ranks} per rank on {num_ranks} ranks), "
        f"top-{args.top_k} {args.router}, hidden {args.hidden}, ffn {args.ffn}"
        + (f", {args.shared_experts} shared" if args.shared_experts else "")
        + f"; compute {config.dtype}, weights {weights}"
        + (", experts in FP8 (block-scaled grouped GEMMs)" if precision == "fp8" else ""))
  print(f"  tokens       {num_tokens} in all, {args.tokens} per token shard, {routed_per_rank} routed per rank")
  print(f"  wire         {args.wire}: {d.x_bytes_per_token} B x + {d.x_sf_bytes_per_token} B scales + "
        f"{d.topk_ids_bytes_per_token} B ids + {d.topk_weights_bytes_per_token} B weights = "
        f"{d.bytes_per_token} B per token")
  exchange = "one-sided custom calls (jax_moe_a2a_dispatch/combine)" if use_ffi else "pure-JAX reference on all_to_all"
  print(f"  a2a          {exchange}")
  print(f"  workspace    {ws.total_bytes / 2**20:.2f} MiB per rank ({ws.total_bytes} B: {num_ranks} sources x "
        f"capacity {routed_per_rank}, {ws.num_buffers} buffers)")
  print(f"  vs oracle    {'':<18} {'calc_diff':>10} {'max|err|/max|ref|':>18}   (limit calc_diff {limit:.0e})")
  for name, c, r in results:
    print(f"               {name:<18} {c:>10.2e} {r:>18.2e}")
  print(f"               expert load {'equal' if load_ok else 'DIFFERS'}, load-balance loss "
        f"{float(aux['load_balance_loss']):.6f} (|diff| {loss_diff:.1e})")
  print(f"  step time    {1e3 * float(np.median(times)):.1f} ms (median of {len(times)} jitted forward+backward steps; "
        f"first call with compilation {compile_s:.1f} s)")
  print(f"  result       {'PASS' if ok else 'FAIL'}")
  return 0 if ok else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = parser().parse_args(argv)
  simulate_cpu_devices()
  return run(args)


if __name__ == "__main__":
  sys.exit(main())
