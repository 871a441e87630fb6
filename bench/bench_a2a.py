"""One-sided dispatch/combine against jax.lax.all_to_all and ragged_all_to_all: one process driving every GPU, or
one process per GPU under jax.distributed (``--processes N``: the workspace is then mapped through CUDA IPC).

DeepSeek-V3 shapes by default: hidden 7168, top-8 of 256 experts, random routing. For each tokens-per-rank
size and wire format it times, per call (median of many runs after warm-up, fresh inputs):

- ``ffi``: the one-sided custom calls (dispatch, and combine of a bf16 expert output);
- ``reference``: the pure-JAX reference (scatter into slots + ``jax.lax.all_to_all`` + gather; ``twin``, its old
  name, is still accepted);
- ``all_to_all``: the bare ``jax.lax.all_to_all`` of the lossless send buffer ``[R, T, row]`` (what any
  all_to_all-based dispatch has to move: every slot, routed or not);
- ``ragged``: the bare ``jax.lax.ragged_all_to_all`` of the routed rows only (dispatch direction).

"chain" times a jit of `--chain` calls on distinct inputs (launch cost amortized; two such input sets, used in
turn); "single" a jit of one call; "gpu" is the device time per call in one chain: from a profiler trace, the
slowest local GPU's span from its first kernel's start to its last kernel's end (waits included, host launch cost
not), divided by the calls. Combine needs a dispatch's handle: its chain is one dispatch followed by `--chain`
combines of distinct expert outputs, and its per-call figures are that chain's less one dispatch (the dispatch
chain's per-call figure), over the combines; it has no "single" figure. "kernel" (ffi and all_to_all) is the
slowest GPU's time per call inside the op's own kernel (the custom call's, or NCCL's), read from the same trace. "steady" repeats "gpu" and "kernel" over the calls of
the chain after its first (fields steady_gpu_us, steady_kernel_us): the first call of a chain is where a device
started earlier by the host waits for its peer, in any implementation that synchronizes devices.
GB/s counts the payload bytes that cross NVLink per GPU, over the chain time (gb_per_s) and over the gpu time
(gpu_gb_per_s): for dispatch, (token, other rank) pairs the routing sends times the wire bytes per token
(x + scales + top-k ids + weights, from `layout.dispatch_layout`); for combine, the same pairs times 2 * hidden.
With ``--vjp``, "combine_vjp" (ffi, reference) is combine's VJP of a bf16 cotangent: (dispatch + combine + the VJP)
minus (dispatch + combine), each way; on the ffi path it is a one-sided dispatch of the bf16 rows (the workspace is
then made with ``training=True``, which gives an FP8 wire's received rows room for them).

  python bench/bench_a2a.py [--tokens 1 8 128 512 4096] [--formats bf16 fp8_blockwise] [--impls ...] [--kernels]
                            [--processes N] [--out DIR]
  python bench/bench_a2a.py --plot bench/results/a2a_<ranks>ranks_<date>.json     (plot a result file)
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (device_kernels, int_in, kernel_busy_us, nonnegative_int, plot_if_possible,  # noqa: E402
                    positive_int, print_kernel_table, save_plot, span_us, steady_us, time_per_call, write_result)

from jax_moe_a2a import a2a, layout, quant  # noqa: E402

AXIS = "ep"


def _global(mesh, a):
  """A global array sharded over the expert axis, from a host array every process holds in full."""
  a = np.asarray(a)
  return jax.make_array_from_callback(a.shape, NamedSharding(mesh, P(AXIS)), lambda index: a[index])


def _inputs(key, mesh, num_ranks, tokens, hidden, top_k, num_experts, fmt):
  """(x, x_sf, ids, weights) as global arrays, and the ids on the host. The same in every process."""
  k1, k2, k3 = jax.random.split(key, 3)
  x = jax.random.normal(k1, (num_ranks * tokens, hidden), jnp.bfloat16)
  # Random routing: top_k distinct experts per token.
  scores = jax.random.uniform(k2, (num_ranks * tokens, num_experts))
  ids = jax.lax.top_k(scores, top_k)[1].astype(jnp.int32)
  weights = jax.random.uniform(k3, ids.shape, jnp.float32)
  x_sf = None
  if fmt == layout.FP8_BLOCKWISE:
    x, x_sf = quant.quantize_fp8_blockwise(x, impl="reference")
  put = lambda a: None if a is None else _global(mesh, a)
  return (put(x), put(x_sf), put(ids), put(weights)), np.asarray(ids)


def _nvlink_pairs(ids, num_ranks, num_experts):
  """(token, destination != source) pairs of the routing, summed over all ranks, divided by ranks (per GPU)."""
  tokens = ids.shape[0] // num_ranks
  local = num_experts // num_ranks
  src = np.repeat(np.arange(num_ranks), tokens)
  pairs = 0
  for r in range(num_ranks):
    dest = np.any(ids // local == r, axis=1)
    pairs += int(np.sum(dest & (src != r)))
  return pairs / num_ranks


def _plot(path):
  """Per-call time against tokens per rank: wall time in a jitted chain (top) and GPU time (bottom), one column per
  wire format; writes <path>.png."""
  return save_plot(path, _draw)


def _draw(plt, rec):
  rows = rec["rows"]
  fmts = sorted({r["fmt"] for r in rows})
  panels = [("chain_us", "us per call, wall (jitted chain)"), ("gpu_us", "us per call, GPU (profiler)")]
  fig, axes = plt.subplots(len(panels), len(fmts), figsize=(6 * len(fmts), 4.5 * len(panels)), squeeze=False)
  for row, (key, label) in enumerate(panels):
    for ax, fmt in zip(axes[row], fmts):
      for op, impl in sorted({(r["op"], r["impl"]) for r in rows if r["fmt"] == fmt}):
        pts = sorted((r["tokens_per_rank"], r[key]) for r in rows if r["fmt"] == fmt and r["op"] == op and
                     r["impl"] == impl and r.get(key) is not None and r[key] > 0)
        if pts:
          ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{op} {impl}",
                  linestyle="-" if op == "dispatch" else "--")
      ax.set_xscale("log", base=2)
      ax.set_yscale("log")
      ax.set_xlabel("tokens per rank")
      ax.set_ylabel(label)
      ax.set_title(f"{fmt}, hidden {rec['hidden']}, top-{rec['top_k']} of {rec['num_experts']}")
      ax.grid(True, which="both", alpha=0.3)
      if ax.get_lines():
        ax.legend(fontsize=7)
  fig.suptitle(f"{rec['device']}, {rec.get('processes', 1)} process(es)", fontsize=9)
  return fig


def impl_name(name: str) -> str:
  """An --impls value, with "twin", the reference's old name in older command lines, read as "reference"."""
  if name == "twin":
    print("--impls twin: twin is now called reference")
    return "reference"
  return name


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--tokens", type=positive_int, nargs="+", default=[1, 8, 128, 512, 4096], help="tokens per rank")
  p.add_argument("--formats", nargs="+", default=[layout.BF16, layout.FP8_BLOCKWISE])
  p.add_argument("--hidden", type=positive_int, default=7168)
  p.add_argument("--top-k", type=positive_int, default=8)
  p.add_argument("--experts", type=positive_int, default=256)
  p.add_argument("--chain", type=positive_int, default=10, help="calls per jitted chain")
  p.add_argument("--runs", type=positive_int, default=30)
  p.add_argument("--out", default=None)
  p.add_argument("--plot", default=None, help="only plot this result file")
  p.add_argument("--impls", nargs="+", type=impl_name, default=["ffi", "reference", "all_to_all", "ragged"],
                 choices=["ffi", "reference", "all_to_all", "ragged"])
  p.add_argument("--kernels", action="store_true", help="also print each chain's GPU kernels (profiler trace)")
  p.add_argument("--vjp", action="store_true", help="also time combine's VJP (combine_vjp rows)")
  p.add_argument("--processes", type=positive_int, default=1,
                 help="one process per GPU under jax.distributed (this many, each on its own GPU)")
  p.add_argument("--process-id", type=nonnegative_int, default=None, help=argparse.SUPPRESS)  # set for the workers
  p.add_argument("--port", type=int_in(1, 65535), default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.plot:
    print("wrote", _plot(args.plot))
    return 0
  if args.processes > 1 and args.process_id is None:
    return _spawn(args.processes, sys.argv[1:] if argv is None else list(argv))
  if args.process_id is not None:
    jax.distributed.initialize(coordinator_address=f"localhost:{args.port}", num_processes=args.processes,
                               process_id=args.process_id, local_device_ids=[args.process_id])
  lead = jax.process_index() == 0  # prints and writes the result; every process runs the same calls

  devices = jax.devices()
  num_ranks = len(devices)
  mesh = jax.sharding.Mesh(np.array(devices), (AXIS,))
  spec = P(AXIS)
  rows = []
  say = print if lead else (lambda *a, **k: None)
  say(f"{num_ranks} ranks in {jax.process_count()} process(es), hidden {args.hidden}, top-{args.top_k} of "
      f"{args.experts}")
  say(f"{'T/rank':>6} {'fmt':>13} {'op':>8} {'impl':>10} {'chain us':>9} {'single us':>9} {'gpu us':>8} "
      f"{'kernel us':>9} {'GB/s':>7} {'steady':>8} {'kernel':>9}")
  for fmt in args.formats:
    d = layout.dispatch_layout(args.hidden, fmt, top_k=args.top_k)
    for tokens in args.tokens:
      made = [_inputs(jax.random.key(1000 * tokens + i), mesh, num_ranks, tokens, args.hidden, args.top_k,
                      args.experts, fmt) for i in range(2 * args.chain)]  # two chains' worth
      sets, ids0 = [m[0] for m in made], made[0][1]
      pairs = _nvlink_pairs(ids0, num_ranks, args.experts)
      ws = a2a.Workspace(mesh, expert_axis=AXIS, capacity=tokens, hidden=args.hidden, top_k=args.top_k, fmt=fmt,
                         timeout_s=30, training=args.vjp)
      has_sf = sets[0][1] is not None

      def dispatch_fn(impl, n):
        def body(*flat):
          outs = []
          for i in range(n):
            x, x_sf, ids, w = flat[4 * i:4 * i + 4]
            res, h = a2a.dispatch(x, ids, w, num_experts=args.experts, axis_name=AXIS, x_sf=x_sf if has_sf else None,
                                  workspace=ws if impl == "ffi" else None, impl=impl)
            outs.append(res.recv_x[None])
          return outs
        f = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * (4 * n), out_specs=[spec] * n, check_vma=False)
        return jax.jit(f)

      # The expert outputs that combine sends back: bf16 inputs of their own, so that nothing but the custom calls
      # runs between them; a distinct one for each combine of a chain, two chains' worth.
      eo_shape = (num_ranks * num_ranks, tokens, args.hidden)
      expert_outs = [_global(mesh, jax.random.normal(jax.random.key(tokens + 7919 * i), eo_shape, jnp.bfloat16))
                     for i in range(2 * args.chain)]
      expert_out = expert_outs[0]

      def combines_fn(impl, n):
        """One dispatch, then n combines of distinct bf16 expert outputs on its handle."""
        def body(x, x_sf, ids, w, *eos):
          _, h = a2a.dispatch(x, ids, w, num_experts=args.experts, axis_name=AXIS, x_sf=x_sf if has_sf else None,
                              workspace=ws if impl == "ffi" else None, impl=impl)
          return [a2a.combine(eo, h) for eo in eos]
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * (4 + n), out_specs=[spec] * n,
                                     check_vma=False))

      def pair_fn(impl, n):
        """n x (dispatch + combine of a bf16 expert output)."""
        def body(eo, *flat):
          outs = []
          for i in range(n):
            x, x_sf, ids, w = flat[4 * i:4 * i + 4]
            _, h = a2a.dispatch(x, ids, w, num_experts=args.experts, axis_name=AXIS, x_sf=x_sf if has_sf else None,
                                workspace=ws if impl == "ffi" else None, impl=impl)
            outs.append(a2a.combine(eo, h))
          return outs
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * (4 * n + 1), out_specs=[spec] * n,
                                     check_vma=False))

      ct_out = _global(mesh, jax.random.normal(jax.random.key(tokens + 1), (num_ranks * tokens, args.hidden),
                                               jnp.bfloat16))

      def vjp_fn(impl, n):
        """n x (dispatch, combine of a bf16 expert output, and combine's VJP of a bf16 cotangent)."""
        def body(eo, ct, *flat):
          outs = []
          for i in range(n):
            x, x_sf, ids, w = flat[4 * i:4 * i + 4]
            _, h = a2a.dispatch(x, ids, w, num_experts=args.experts, axis_name=AXIS, x_sf=x_sf if has_sf else None,
                                workspace=ws if impl == "ffi" else None, impl=impl)
            y, vjp = jax.vjp(lambda e, h=h: a2a.combine(e, h), eo)
            outs += [y, vjp(ct)[0][None]]
          return outs
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * (4 * n + 2), out_specs=[spec] * (2 * n),
                                     check_vma=False))

      def flat_inputs(sets_):
        out = []
        for s in sets_:
          x, x_sf, ids, w = s
          out += [x, x_sf if has_sf else jnp.zeros((x.shape[0], 1), jnp.float32), ids, w]
        return out

      def record(op, impl, chain_s, single_s, nbytes, gpu_us=None, kernel_us=None, steady_gpu_us=None,
                 steady_kernel_us=None):
        gbps = nbytes / chain_s / 1e9 if chain_s else float("nan")
        rows.append({"tokens_per_rank": tokens, "fmt": fmt, "op": op, "impl": impl, "chain_us": chain_s * 1e6,
                     "single_us": None if single_s is None else single_s * 1e6, "gpu_us": gpu_us,
                     "kernel_us": kernel_us,
                     "steady_gpu_us": steady_gpu_us, "steady_kernel_us": steady_kernel_us,
                     "nvlink_bytes_per_gpu": nbytes, "gb_per_s": gbps,
                     "gpu_gb_per_s": nbytes / gpu_us / 1e3 if gpu_us else None})
        single, gpu, kern, s_gpu, s_kern = ("-" if v is None else f"{v:.1f}" for v in (
            None if single_s is None else single_s * 1e6, gpu_us, kernel_us, steady_gpu_us, steady_kernel_us))
        say(f"{tokens:>6} {fmt:>13} {op:>8} {impl:>10} {chain_s * 1e6:>9.1f} {single:>9} {gpu:>8} "
            f"{kern:>9} {gbps:>7.1f} {s_gpu:>8} {s_kern:>9}", flush=True)

      def gpu_span_us(fn, fn_args, label, own_kernel=None):
        """Per call, in one chain: the slowest device's span from its first kernel start to its last kernel end, and
        (own_kernel: a part of the op's kernel name) the slowest device's time in that kernel alone; then both over
        the calls after the first (`steady_us`)."""
        kernels = device_kernels(fn, fn_args)
        if args.kernels and lead:
          print(f"  kernels of {label} ({args.chain} calls):")
          print_kernel_table(kernels, args.chain)
        spans = [span_us(ev) / args.chain for ev in kernels.values() if ev]
        own = kernel_busy_us(kernels, own_kernel, args.chain) if own_kernel else None
        steady = steady_us(kernels, own_kernel, args.chain) if own_kernel else (None, None)
        return (max(spans) if spans else None), own, *steady

      chain_in = [tuple(flat_inputs(sets[:args.chain])), tuple(flat_inputs(sets[args.chain:]))]
      single_in = [tuple(flat_inputs([s])) for s in sets]
      combines_in = [(*single_in[0], *expert_outs[:args.chain]), (*single_in[1], *expert_outs[args.chain:])]
      pair_chain_in = [(expert_out, *c) for c in chain_in]
      pair_single_in = [(expert_out, *s) for s in single_in]
      disp_bytes = pairs * d.bytes_per_token
      comb_bytes = pairs * 2 * args.hidden
      for impl in [i for i in ("ffi", "reference") if i in args.impls]:
        d_fn, p_fn = dispatch_fn(impl, args.chain), pair_fn(impl, args.chain)
        t_chain = time_per_call(d_fn, chain_in, calls_per_run=args.chain, runs=args.runs)
        t_single = time_per_call(dispatch_fn(impl, 1), single_in, calls_per_run=1, runs=args.runs)
        d_gpu, d_kernel, d_steady, d_steady_kernel = gpu_span_us(d_fn, chain_in[0], f"dispatch {impl}",
                                                                 "DispatchKernel" if impl == "ffi" else None)
        record("dispatch", impl, t_chain["median_s"], t_single["median_s"], disp_bytes, d_gpu, d_kernel, d_steady,
               d_steady_kernel)
        # Combine: one dispatch then args.chain combines, less one dispatch, per combine.
        c_fn = combines_fn(impl, args.chain)
        c_chain = time_per_call(c_fn, combines_in, calls_per_run=args.chain, runs=args.runs)
        c_gpu, c_kernel, c_steady, c_steady_kernel = gpu_span_us(c_fn, combines_in[0], f"dispatch+combines {impl}",
                                                                 "CombineKernel" if impl == "ffi" else None)
        diff = lambda a, b: None if a is None or b is None else a - b
        record("combine", impl, c_chain["median_s"] - t_chain["median_s"] / args.chain, None, comb_bytes,
               diff(c_gpu, None if d_gpu is None else d_gpu / args.chain), c_kernel, c_steady, c_steady_kernel)
        if args.vjp:  # combine's VJP = (dispatch + combine + VJP) - (dispatch + combine)
          p_chain = time_per_call(p_fn, pair_chain_in, calls_per_run=args.chain, runs=args.runs)
          p_single = time_per_call(pair_fn(impl, 1), pair_single_in, calls_per_run=1, runs=args.runs)
          p_gpu, _, p_steady, _ = gpu_span_us(p_fn, pair_chain_in[0], f"dispatch+combine {impl}")
          v_fn = vjp_fn(impl, args.chain)
          v_in = [(expert_out, ct_out, *c) for c in chain_in]
          v_chain = time_per_call(v_fn, v_in, calls_per_run=args.chain, runs=args.runs)
          v_single = time_per_call(vjp_fn(impl, 1), [(expert_out, ct_out, *s) for s in single_in], calls_per_run=1,
                                   runs=args.runs)
          v_gpu, _, v_steady, _ = gpu_span_us(v_fn, v_in[0], f"dispatch+combine+vjp {impl}",
                                              "CombineKernel" if impl == "ffi" else None)
          record("combine_vjp", impl, v_chain["median_s"] - p_chain["median_s"],
                 v_single["median_s"] - p_single["median_s"], comb_bytes, diff(v_gpu, p_gpu), None,
                 diff(v_steady, p_steady))

      # Bare collectives carrying the same wire bytes.
      row_bytes = d.bytes_per_token
      lossless = [_global(mesh, np.zeros((num_ranks * num_ranks, tokens, row_bytes), np.uint8))
                  for _ in range(args.chain)]

      if "all_to_all" in args.impls:
        def a2a_fn(n):
          body = lambda *bs: [jax.lax.all_to_all(b, AXIS, 0, 0, tiled=True) for b in bs]
          return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * n, out_specs=[spec] * n))
        t_chain = time_per_call(a2a_fn(args.chain), [tuple(lossless)], calls_per_run=args.chain, runs=args.runs)
        t_single = time_per_call(a2a_fn(1), [(b,) for b in lossless], calls_per_run=1, runs=args.runs)
        record("dispatch", "all_to_all", t_chain["median_s"], t_single["median_s"], disp_bytes,
               *gpu_span_us(a2a_fn(args.chain), tuple(lossless), "all_to_all (dispatch bytes)", "nccl"))
        combine_buf = [_global(mesh, np.zeros((num_ranks * num_ranks, tokens, args.hidden), jnp.bfloat16))
                       for _ in range(args.chain)]
        t_chain = time_per_call(a2a_fn(args.chain), [tuple(combine_buf)], calls_per_run=args.chain, runs=args.runs)
        t_single = time_per_call(a2a_fn(1), [(b,) for b in combine_buf], calls_per_run=1, runs=args.runs)
        record("combine", "all_to_all", t_chain["median_s"], t_single["median_s"], comb_bytes,
               *gpu_span_us(a2a_fn(args.chain), tuple(combine_buf), "all_to_all (combine bytes)", "nccl"))
        del combine_buf

      if "ragged" in args.impls and jax.default_backend() == "gpu":
        counts = np.array([[int(np.sum(np.any(ids0[s * tokens:(s + 1) * tokens] //
                                              (args.experts // num_ranks) == r, axis=1)))
                            for r in range(num_ranks)] for s in range(num_ranks)], np.int32)  # [src, dst]

        def ragged_fn(n):
          def body(*bs):
            me = jax.lax.axis_index(AXIS)
            send = jnp.asarray(counts)[me]
            recv = jnp.asarray(counts)[:, me]
            in_off = jnp.arange(num_ranks, dtype=jnp.int32) * tokens
            out_off = jnp.full((num_ranks,), me * tokens, jnp.int32)
            outs = []
            for b in bs:
              b = b.reshape(num_ranks * tokens, row_bytes)
              outs.append(jax.lax.ragged_all_to_all(b, jnp.zeros_like(b), in_off, send, out_off, recv,
                                                    axis_name=AXIS)[None])
            return outs
          return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * n, out_specs=[spec] * n,
                                       check_vma=False))
        try:
          t_chain = time_per_call(ragged_fn(args.chain), [tuple(lossless)], calls_per_run=args.chain,
                                  runs=max(3, args.runs // 5))
          t_single = time_per_call(ragged_fn(1), [(b,) for b in lossless], calls_per_run=1,
                                   runs=max(3, args.runs // 5))
          record("dispatch", "ragged", t_chain["median_s"], t_single["median_s"], disp_bytes)
        except Exception as e:  # pylint: disable=broad-except
          say(f"ragged_all_to_all failed: {type(e).__name__}: {str(e)[:200]}")
      ws.close()
      del sets, lossless, expert_out, expert_outs, ct_out
  if not lead:
    return 0
  name = f"a2a_{num_ranks}ranks" + (f"_{jax.process_count()}processes" if jax.process_count() > 1 else "")
  path = write_result(name, {"unit": "GB/s = NVLink payload bytes per GPU / time", "processes": jax.process_count(),
                             "hidden": args.hidden, "top_k": args.top_k, "num_experts": args.experts, "rows": rows},
                      args.out)
  print("wrote", path)
  plot_if_possible(path, _plot)
  return 0


def _spawn(num_processes: int, argv: list[str]) -> int:
  """Runs this script once per GPU under jax.distributed; the output is process 0's."""
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  env = dict(os.environ, NCCL_NVLS_ENABLE="0")
  procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv, "--process-id", str(i), "--port",
                             str(port)], env=env, stdout=None if i == 0 else subprocess.DEVNULL)
           for i in range(num_processes)]
  codes = [p.wait() for p in procs]
  if any(codes):
    print(f"worker exit codes: {codes}")
  return max(codes, key=abs)


if __name__ == "__main__":
  sys.exit(main())
