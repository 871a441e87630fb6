"""The whole MoE layer as users call it (`moe.moe_apply`, jitted), forward and forward+backward, beside baselines.

For each tokens-per-device count and variant: the median step time in steady state (`--chain` calls issued back to
back, each on the next of `--input-sets` activation sets, as a training or serving loop runs; `common.time_pipelined`)
and the median time of one call issued and waited for alone (`sync_ms`, which adds the host's dispatch and
synchronization), TFLOP/s of the routed experts (2 * T * k * H * 3F per forward, 3x that per forward+backward,
T tokens per device), the compiled temp bytes (`compile().memory_analysis()`), the device's peak memory so far,
on GPUs the SM clock and power draw sampled while the steps ran (`common.GpuClocks`: at the power cap, the clock
sets the step time), and the time per named stage (router, wire encode, dispatch, wire decode, permute, experts,
unpermute, combine, ...) from a profiler trace: each kernel is attributed to the innermost stage scope in its HLO
instruction's op_name; each stage's largest kernels are listed with their HLO shape and the GB/s of their operands'
and results' bytes over their time (`stage_top`: what a memory-bound kernel gets of the HBM's bandwidth), and so are
the kernels no stage claims (`unattributed_top`).

Variants (all with bfloat16 compute and bfloat16 parameters):
  einsum         baseline: an equal-capacity batched einsum of the same FLOPs (T*k/E rows per local expert, no
                 routing, no exchange), gate/up -> SwiGLU -> down
  reference      the layer with every op on its pure-JAX reference (impl="reference"; bf16 experts); "twin",
                 its old name, is still accepted
  bf16           bf16 experts (the default path: the bf16 grouped GEMMs on GPUs), bf16 wire
  fp8            FP8 experts from the bf16 master weights (expert_precision="fp8"), fp8_blockwise wire
  fp8_dgrad      the same with FP8 data gradients (MoEConfig.expert_backward="fp8_dgrad": the gate/up rows kept
                 in FP8, the weight gradients on bf16 GEMMs)
  fp8_fp8bwd     the same with DeepSeek-V3's whole FP8 backward (expert_backward="fp8": FP8 weight gradients too)
  fp8_bf16wire   the same on a bf16 wire
  fp8_stored     stored FP8 weights (inference; forward only), fp8_blockwise wire
  <variant>_ws   the same with a one-sided workspace (moe.make_workspace(training=True))
  <variant>_2l   the same dispatched in two levels (MoEConfig.two_level) over ("data", "expert"): the exchange
                 between nodes (here the data axis, of size 1 on one host) on XLA's collectives, then the one inside
                 the node; what two levels cost over the flat path where no token leaves the node

--wire-formats F ... runs each layer variant above (not einsum, not the Flax ones) once per wire format F (bf16,
fp8_blockwise, mxfp8, nvfp4) in place of its own; a row on another wire than the variant's own is labelled
``<variant>@<F>`` (e.g. ``bf16@nvfp4``: bf16 experts on an NVFP4 wire). Every layer row records its wire_format and
wire_bytes_per_token (activation, scales, top-k ids and weights: `layout.dispatch_layout`).

The Flax layers (flax_moe), each on bf16's configuration and program (``_ws``: given the same workspace), so their
rows differ from bf16's (bf16_ws's) by how the layer is called alone:
  nnx_call       the NNX layer called outside jit, ``layer(x)`` (forward only)
  nnx_jit        ``nnx.jit`` of a function of the layer, Flax's default (graph) mode: the program also returns every
                 parameter, a copy per call
  nnx_jit_tree   ``nnx.jit(..., graph=False)``, Flax's tree mode (where the installed Flax has it)
  nnx_jit_apply  ``flax_moe.jit_apply(layer)``: jax.jit over the layer's state
  linen_jit      ``jax.jit`` of ``LinenMoE.apply``

Forward+backward is the value and the gradient of sum(y * ct) + load_balance_loss for every trainable parameter and
x, as a training step takes them (with the gradient alone, XLA would prune the forward's last GEMMs, whose output
no gradient reads). With --micro-batches N (N >= 2), mode fwd_bwd_mb times a step of N such forward+backward passes
accumulating the parameters' gradients in a `lax.scan` (einsum and the layer variants), and `ms_per_micro_batch`
its time over N. FP8 experts' float weights are quantized once per step there, before the loop
(`moe.quantize_experts`); mode fwd_bwd_mb_requant times the same step with the layer quantizing them in every
micro-batch instead.

With --check, each layer variant's output and gradients (one input set) are also compared with a float32 oracle
of the same parameters (the layer's routing in float32, every expert run densely on every token at HIGHEST
precision and gated by its routing weight, FP8 weights dequantized): calc_diff = 1 - 2 sum(a b) / sum(a^2 + b^2)
per tensor, as `accuracy` in the result rows.

  python bench/bench_layer.py [--tokens 4096 16384] [--local-experts 32] [--variants ...] [--wire-formats ...]
                              [--check] [--out DIR]
  python bench/bench_layer.py --plot bench/results/layer_<date>.json     (plot a result file)
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import re
import signal
import sys
import tempfile
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (GpuClocks, plot_if_possible, positive_int, save_plot, time_per_call,  # noqa: E402
                    time_pipelined, write_result)

from jax_moe_a2a import layout, moe  # noqa: E402
from jax_moe_a2a.testing import calc_diff  # noqa: E402

BASE_VARIANTS = ("einsum", "reference", "bf16", "fp8", "fp8_dgrad", "fp8_fp8bwd", "fp8_bf16wire", "fp8_stored")
VARIANTS = BASE_VARIANTS + tuple(v + "_ws" for v in BASE_VARIANTS[2:])
VARIANTS += tuple(v + "_2l" for v in VARIANTS[1:])
FLAX_VARIANTS = ("nnx_call", "nnx_jit", "nnx_jit_tree", "nnx_jit_apply", "linen_jit")
FLAX_VARIANTS += tuple(v + "_ws" for v in FLAX_VARIANTS)
VARIANTS += FLAX_VARIANTS
DEFAULT_VARIANTS = ("einsum", "reference", "bf16", "bf16_ws", "fp8", "fp8_ws", "fp8_stored", "fp8_stored_ws")
# Stage scopes, innermost first wins: an op is attributed to the last of these names in its op_name path.
STAGES = ("router", "aux", "wire_encode", "moe_dispatch", "wire_decode", "permute", "experts", "unpermute",
          "moe_combine", "shared_experts")


# ----------------------------------------------------------------------------------------------------------------
# The variants
# ----------------------------------------------------------------------------------------------------------------


def _base(variant: str) -> str:
  """A layer variant without its _2l and _ws suffixes."""
  base = variant[:-3] if variant.endswith("_2l") else variant
  return base[:-3] if base.endswith("_ws") else base


def variant_name(name: str) -> str:
  """A --variants value, with "twin" (and "twin_2l"), the reference variant's old name in older command lines, read
  as "reference" ("reference_2l")."""
  if name == "twin" or name.startswith("twin_"):
    new = "reference" + name[len("twin"):]
    print(f"--variants {name}: twin is now called reference, running {new}")
    return new
  return name


def own_wire(variant: str) -> str:
  """The wire format a layer variant runs on unless --wire-formats says otherwise."""
  return layout.BF16 if _base(variant) in ("bf16", "reference", "fp8_bf16wire") else layout.FP8_BLOCKWISE


def _config(variant: str, args, wire_format: Optional[str] = None) -> moe.MoEConfig:
  two_level = variant.endswith("_2l")
  base = _base(variant)
  return moe.MoEConfig(
      expert_axis=("data", "expert") if two_level else "expert", two_level=two_level or None,
      num_experts=args.local_experts * jax.device_count(), top_k=args.top_k, hidden=args.hidden, ffn=args.ffn,
      wire_format=wire_format or own_wire(variant), fp8_weights=base == "fp8_stored", dtype=jnp.bfloat16,
      param_dtype=jnp.bfloat16, impl="reference" if base == "reference" else "auto",
      expert_precision="fp8" if base.startswith("fp8") else "dtype",
      expert_backward={"fp8_fp8bwd": "fp8", "fp8_dgrad": "fp8_dgrad"}.get(base, "bf16"))


def runs_of(variants, wire_formats) -> list[tuple[str, str, Optional[str]]]:
  """(label, variant, wire format or None for the variant's own) of each run: every layer variant once per wire
  format of `wire_formats` (None or empty: once, on its own), labelled ``<variant>@<format>`` off its own wire."""
  out = []
  for v in variants:
    if v == "einsum" or v in FLAX_VARIANTS or not wire_formats:
      out.append((v, v, None))
    else:
      out.extend((v if f == own_wire(v) else f"{v}@{f}", v, f) for f in wire_formats)
  return out


def _layer_fns(variant: str, args, mesh, tokens: int, wire_format: Optional[str] = None):
  """(forward, forward+backward or None, make inputs, workspace or None) of one layer variant."""
  config = _config(variant, args, wire_format)
  num_tokens = tokens * jax.device_count()
  ws = moe.make_workspace(config, mesh, num_tokens, training=True) if "_ws" in variant else None
  params = moe.init_params(jax.random.key(0), config, mesh)
  x_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(config.token_axes, None))
  trainable = {k: v for k, v in params.items() if jnp.issubdtype(v.dtype, jnp.floating) and v.dtype.itemsize >= 2
               and not k.endswith("_sf")}
  frozen = {k: v for k, v in params.items() if k not in trainable}

  def forward(trainable, frozen, x, quantized_experts=None):  # frozen (FP8 weights) are arguments, not constants
    y, aux = moe.moe_apply({**trainable, **frozen}, x, config, mesh, workspace=ws,
                           quantized_experts=quantized_experts)
    return y, aux["load_balance_loss"]

  def loss(trainable, frozen, x, ct, quantized_experts=None):
    y, lb = forward(trainable, frozen, x, quantized_experts)
    return jnp.sum(y.astype(jnp.float32) * ct) + lb

  # A step of micro-batches quantizes FP8 experts' float weights once, before its loop (moe.quantize_experts).
  once = config.expert_precision == "fp8" and not config.fp8_weights
  prepare = (lambda trainable, frozen: {"quantized_experts": moe.quantize_experts(
      {**trainable, **frozen}, config, mesh)}) if once else None

  fwd = jax.jit(forward)
  fwd_bwd = None if config.fp8_weights else jax.jit(jax.value_and_grad(loss, argnums=(0, 2)))
  accuracy = lambda x, ct: _accuracy(config, fwd, fwd_bwd, trainable, frozen, x, ct)

  def inputs(i):
    k = jax.random.fold_in(jax.random.key(1), i)
    x = jax.device_put(jax.random.normal(k, (num_tokens, args.hidden), jnp.bfloat16), x_sharding)
    ct = jax.device_put(jax.random.normal(jax.random.fold_in(k, 1), (num_tokens, args.hidden), jnp.float32),
                        x_sharding)
    return x, ct

  return (lambda x, ct: fwd(trainable, frozen, x)), \
      (None if fwd_bwd is None else (lambda x, ct: fwd_bwd(trainable, frozen, x, ct))), inputs, ws, \
      (fwd, fwd_bwd, (trainable, frozen)), accuracy, (None if fwd_bwd is None else (loss, (0, 2), prepare))


def _oracle_loss(config: moe.MoEConfig):
  """sum(y * ct) + load_balance_loss of the float32 oracle (module docstring), and y."""
  f32 = jnp.float32

  def forward(params, x):
    with jax.default_matmul_precision("highest"):
      xs = x.astype(f32)
      topk_weights, topk_ids, aux = moe._run_router(params, xs, config, None)  # pylint: disable=protected-access
      w_gu, w_dn = moe._expert_weights(params).dequantized(f32)  # pylint: disable=protected-access
      gates = jnp.zeros((xs.shape[0], config.num_experts), f32).at[
          jnp.arange(xs.shape[0])[:, None], topk_ids].add(topk_weights)

      def expert(y, e):  # one expert on every token, gated; a scan keeps one [T, 2F] at a time
        wg, wd, g = e
        h = xs @ wg.T
        act = jax.nn.silu(h[:, :config.ffn]) * h[:, config.ffn:]
        return y + (act @ wd.T) * g[:, None], None

      y, _ = jax.lax.scan(expert, jnp.zeros_like(xs), (w_gu, w_dn, gates.T))
    return y, aux["load_balance_loss"]

  def loss(params, x, ct):
    y, lb = forward(params, x)
    return jnp.sum(y * ct) + lb

  return jax.jit(forward), jax.jit(jax.grad(loss, argnums=(0, 1)))


def _accuracy(config, fwd, fwd_bwd, trainable, frozen, x, ct) -> dict:
  """calc_diff of the output and of each gradient against the float32 oracle on the same parameters."""
  oracle_fwd, oracle_grad = _oracle_loss(config)
  params = {**trainable, **frozen}
  out = {"output": calc_diff(fwd(trainable, frozen, x)[0], oracle_fwd(params, x)[0])}
  if fwd_bwd is not None:
    (_, (d_p, d_x)), (o_p, o_x) = fwd_bwd(trainable, frozen, x, ct), oracle_grad(params, x, ct)
    out.update({f"grad_{k}": calc_diff(v, o_p[k]) for k, v in d_p.items()})
    out["grad_x"] = calc_diff(d_x, o_x)
  return {k: float(f"{v:.3g}") for k, v in out.items()}


def _einsum_fns(args, mesh, tokens: int):
  """The equal-capacity batched einsum baseline, per device, under shard_map over every device."""
  devices = jax.device_count()
  e, h, f = args.local_experts, args.hidden, args.ffn
  cap = tokens * args.top_k // e
  spec = jax.sharding.PartitionSpec(("data", "expert"))
  sharding = jax.sharding.NamedSharding(mesh, spec)
  kw = jax.random.key(2)
  w_gu = jax.device_put((jax.random.normal(kw, (devices * e, 2 * f, h), jnp.float32) / np.sqrt(h)).astype(
      jnp.bfloat16), sharding)
  w_dn = jax.device_put((jax.random.normal(jax.random.fold_in(kw, 1), (devices * e, h, f), jnp.float32)
                         / np.sqrt(f)).astype(jnp.bfloat16), sharding)

  def mlp(w_gu, w_dn, x):
    hh = jnp.einsum("ech,efh->ecf", x, w_gu, preferred_element_type=jnp.float32)
    act = (jax.nn.silu(hh[..., :f]) * hh[..., f:]).astype(jnp.bfloat16)
    return jnp.einsum("ecf,ehf->ech", act, w_dn, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

  body = jax.shard_map(mlp, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)
  fwd = jax.jit(body)

  def loss(w_gu, w_dn, x, ct):
    return jnp.sum(body(w_gu, w_dn, x).astype(jnp.float32) * ct)

  fwd_bwd = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

  def inputs(i):
    k = jax.random.fold_in(jax.random.key(3), i)
    x = jax.device_put(jax.random.normal(k, (devices * e, cap, h), jnp.bfloat16), sharding)
    ct = jax.device_put(jax.random.normal(jax.random.fold_in(k, 1), (devices * e, cap, h), jnp.float32), sharding)
    return x, ct

  return (lambda x, ct: fwd(w_gu, w_dn, x)), (lambda x, ct: fwd_bwd(w_gu, w_dn, x, ct)), inputs, None, \
      (fwd, fwd_bwd, (w_gu, w_dn)), None, (loss, (0, 1, 2), None)


def _flax_fns(variant: str, args, mesh, tokens: int):
  """(forward, forward+backward or None, make inputs, workspace or None, jitted, accuracy) of one Flax variant."""
  from flax import nnx  # pylint: disable=import-outside-toplevel  (only these variants need Flax)
  from jax_moe_a2a import flax_moe  # pylint: disable=import-outside-toplevel
  base = variant[:-3] if variant.endswith("_ws") else variant
  config = _config("bf16", args)
  num_tokens = tokens * jax.device_count()
  ws = moe.make_workspace(config, mesh, num_tokens, training=True) if variant.endswith("_ws") else None
  workspace = "off" if ws is None else ws
  x_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(config.token_axes, None))

  def loss(out, ct):
    y, aux = out
    return jnp.sum(y.astype(jnp.float32) * ct) + aux["load_balance_loss"]

  def nnx_grads(g) -> dict:  # graph mode gives a State, tree mode a Module of gradients
    return {k: v[...] for k, v in nnx.state(g).items()}

  if base == "linen_jit":
    linen = flax_moe.LinenMoE(config=config, mesh=mesh, workspace=workspace)
    variables = linen.init(jax.random.key(0), jax.device_put(jnp.zeros((num_tokens, args.hidden), jnp.bfloat16),
                                                             x_sharding))
    params = {k: v.value for k, v in variables["params"].items()}
    jf = jax.jit(linen.apply)
    jfb = jax.jit(jax.value_and_grad(lambda v, x, ct: loss(linen.apply(v, x), ct), argnums=(0, 1)))
    p = (variables,)
    grads = lambda g: {k: v.value for k, v in g["params"].items()}
  else:
    layer = flax_moe.MoE(config=config, mesh=mesh, rngs=nnx.Rngs(params=0), workspace=workspace)
    params = layer.params()
    step = lambda layer, x, ct: nnx.value_and_grad(lambda layer, x: loss(layer(x), ct), argnums=(0, 1))(layer, x)
    grads = nnx_grads
    if base == "nnx_call":  # compiled alone for its statistics: the program layer(x) runs
      jf, jfb, p = jax.jit(lambda p, x: moe.moe_apply(p, x, config, mesh, workspace=ws)), None, (params,)
    elif base == "nnx_jit":
      jf, jfb, p = nnx.jit(lambda layer, x: layer(x)), nnx.jit(step), (layer,)
    elif base == "nnx_jit_tree":
      jf, jfb, p = nnx.jit(lambda layer, x: layer(x), graph=False), nnx.jit(step, graph=False), (layer,)
    else:
      apply, state = flax_moe.jit_apply(layer)
      jf = apply
      jfb = jax.jit(jax.value_and_grad(lambda s, x, ct: loss(apply(s, x), ct), argnums=(0, 1)))
      p = (state,)

  def inputs(i):
    k = jax.random.fold_in(jax.random.key(1), i)
    x = jax.device_put(jax.random.normal(k, (num_tokens, args.hidden), jnp.bfloat16), x_sharding)
    ct = jax.device_put(jax.random.normal(jax.random.fold_in(k, 1), (num_tokens, args.hidden), jnp.float32),
                        x_sharding)
    return x, ct

  fwd = (lambda x, ct: layer(x)) if base == "nnx_call" else (lambda x, ct: jf(*p, x))
  fwd_bwd = None if jfb is None else (lambda x, ct: jfb(*p, x, ct))
  if base == "nnx_call":  # its program is jitted inside the layer: compiled here, so that _measure's first call
    jax.block_until_ready(fwd(*inputs(0)))  # (which sets the number of runs) is a call, as the others' are

  def accuracy(x, ct):
    """calc_diff against the float32 oracle, as `_accuracy`'s, of what the layer computes on its parameters."""
    oracle_fwd, oracle_grad = _oracle_loss(config)
    out = {"output": calc_diff(fwd(x, ct)[0], oracle_fwd(params, x)[0])}
    if fwd_bwd is not None:
      (_, (d_p, d_x)), (o_p, o_x) = fwd_bwd(x, ct), oracle_grad(params, x, ct)
      out.update({f"grad_{k}": calc_diff(v, o_p[k]) for k, v in grads(d_p).items()})
      out["grad_x"] = calc_diff(d_x, o_x)
    return {k: float(f"{v:.3g}") for k, v in out.items()}

  return fwd, fwd_bwd, inputs, ws, (jf, jfb, p), accuracy, None


# ----------------------------------------------------------------------------------------------------------------
# Measurements
# ----------------------------------------------------------------------------------------------------------------


def _micro_batched(loss, argnums: tuple[int, ...], prepare, params: tuple, n: int, inputs):
  """A training step over n micro-batches, as gradient accumulation runs: a `lax.scan` over x and ct stacked on a
  leading axis, each micro-batch's value and gradients (of `loss(*params, x, ct, **prepare(*params))` at `argnums`,
  x's last) taken with the parameters closed over, the parameters' gradients summed and x's kept per micro-batch;
  `prepare` (or None) runs once per step, before the loop. Returns the jitted step and the make-inputs function of its
  stacked (xs, cts)."""
  value_and_grad = jax.value_and_grad(loss, argnums=argnums)

  def step(*args):
    *p, xs, cts = args
    kwargs = {} if prepare is None else prepare(*p)

    def body(acc, xc):
      value, grads = value_and_grad(*p, *xc, **kwargs)
      return (acc[0] + value, jax.tree.map(jnp.add, acc[1], grads[:-1])), grads[-1]

    init = (jnp.zeros((), jnp.float32), tuple(jax.tree.map(jnp.zeros_like, p[i]) for i in argnums[:-1]))
    return jax.lax.scan(body, init, (xs, cts))

  def stacked_inputs(i):
    sets = [inputs(i * n + j) for j in range(n)]
    out = []
    for a in zip(*sets):
      sharding = jax.sharding.NamedSharding(a[0].sharding.mesh, jax.sharding.PartitionSpec(None, *a[0].sharding.spec))
      out.append(jax.device_put(jnp.stack(a), sharding))
    return tuple(out)

  return jax.jit(step), stacked_inputs


def _op_names(hlo_text: str) -> dict[str, str]:
  """HLO instruction name -> its op_name metadata, from a compiled module's text."""
  out = {}
  for m in re.finditer(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{[^}]*op_name=\"([^\"]*)\"", hlo_text, re.M):
    out[m.group(1)] = m.group(2)
  return out


def _stage_of(op_name: str) -> str:
  parts = op_name.split("/")
  for part in reversed(parts):
    for stage in STAGES:
      if part == stage or part.endswith("(" + stage + ")") or part.startswith(stage + "("):
        return stage
  return "other"


def _stage_times(fn, call_args: tuple, hlo_text: str, runs: int = 2) -> tuple[dict[str, float], list, dict]:
  """Per stage, milliseconds of GPU kernel time per call (the slowest device), from a profiler trace; the largest
  kernels no stage scope claims; and per stage, its largest kernels (averaged over devices)."""
  names = _op_names(hlo_text)
  jax.block_until_ready(fn(*call_args))
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      for _ in range(runs):
        jax.block_until_ready(fn(*call_args))
    paths = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
    data = jax.profiler.ProfileData.from_file(paths[0]) if paths else None
  per_device, per_kernel = [], {}
  for plane in (data.planes if data else []):
    if not plane.name.startswith("/device:GPU"):
      continue
    stages: dict[str, float] = {}
    for line in plane.lines:
      if not line.name.startswith("Stream"):
        continue
      for e in line.events:
        stats = {}
        try:
          stats = dict(e.stats)
        except (TypeError, ValueError, AttributeError):
          pass
        hlo_op = str(stats.get("hlo_op", ""))
        op_name = names.get(hlo_op) or str(stats.get("tf_op", "")) or names.get(e.name, "")
        stage = _stage_of(op_name) if op_name else "other"
        stages[stage] = stages.get(stage, 0.0) + e.duration_ns / 1e6 / runs
        kernel = (stage, (hlo_op or e.name)[:80])
        per_kernel[kernel] = per_kernel.get(kernel, 0.0) + e.duration_ns / 1e6 / runs
    per_device.append(stages)
  if not per_device:
    return {}, [], {}
  slowest = max(per_device, key=lambda s: sum(s.values()))
  top: dict[str, list] = {}  # per stage ("other" too), its largest kernels, in ms averaged over devices
  for (stage, k), v in sorted(per_kernel.items(), key=lambda kv: -kv[1]):
    if len(top.setdefault(stage, [])) < 12:
      ms = v / len(per_device)
      top[stage].append((k, round(ms, 4), _hlo_shape(hlo_text, k), round(_hlo_bytes(hlo_text, k) / ms / 1e6, 1)))
  return slowest, top.pop("other", []), top


def _result_shape(hlo_text: str, name: str) -> str:
  """The result shape (a tuple's whole) of HLO instruction `name` in a compiled module's text ('' if not found)."""
  m = re.search(r"^\s*(?:ROOT\s+)?%?" + re.escape(name) + r"\s*=\s*(\([^)]*\)|\S+)", hlo_text, re.M)
  return m.group(1) if m else ""


def _hlo_shape(hlo_text: str, name: str) -> str:
  """`_result_shape`, cut to 80 characters for a report."""
  return _result_shape(hlo_text, name)[:80]


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8, "f16": 2,
                "bf16": 2, "f32": 4, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1, "f8e8m0fnu": 1, "f4e2m1fn": 0.5}
_SHAPE = re.compile(r"\b(" + "|".join(sorted(_DTYPE_BYTES, key=len, reverse=True)) + r")\[([\d,]*)\]")


def _shape_bytes(text: str) -> float:
  """Bytes of every array shape written in `text` (a tuple's elements summed)."""
  return sum(_DTYPE_BYTES[d] * math.prod(int(n) for n in dims.split(",") if n) for d, dims in _SHAPE.findall(text))


def _hlo_bytes(hlo_text: str, name: str) -> float:
  """Bytes HLO instruction `name` reads and writes if it touches each operand and result once: its result shape's
  bytes plus those of its operands' (looked up by name in the module's text); 0 if not found. An estimate of the
  memory traffic of a kernel, to set against its time (an upper bound where a kernel reads part of an operand)."""
  line = re.search(r"^\s*(?:ROOT\s+)?%?" + re.escape(name) + r"\s*=\s*(.*)$", hlo_text, re.M)
  if not line:
    return 0.0
  m = re.match(r"(\([^)]*\)|\S+)\s+[\w\-]+\(([^)]*)\)", line.group(1))
  if not m:
    return 0.0
  operands = re.findall(r"%([\w.\-]+)", m.group(2))
  return _shape_bytes(m.group(1)) + sum(_shape_bytes(_result_shape(hlo_text, o)) for o in operands)


def _measure(name: str, mode: str, fn, jitted, jit_args, input_sets, flops: float, args) -> dict:
  row = {"variant": name, "mode": mode}
  t0 = time.perf_counter()
  compiled = jitted.lower(*jit_args).compile()
  row["compile_s"] = round(time.perf_counter() - t0, 2)
  mem = compiled.memory_analysis()
  if mem is not None:
    row["temp_bytes"] = int(mem.temp_size_in_bytes)
    row["argument_bytes"] = int(mem.argument_size_in_bytes)
    row["output_bytes"] = int(mem.output_size_in_bytes)
  probe = time.perf_counter()
  jax.block_until_ready(fn(*input_sets[0]))
  first = time.perf_counter() - probe
  runs = args.runs if first < 0.5 / args.chain else max(3, min(args.runs, int(10 / args.chain / max(first, 1e-3))))
  with GpuClocks() as clocks:
    t = time_pipelined(fn, input_sets, calls=args.chain, warmup=2, runs=runs)
  row.update(clocks.summary())
  row.update(ms=t["median_s"] * 1e3, min_ms=t["min_s"] * 1e3, p90_ms=t["p90_s"] * 1e3, runs=runs,
             chain=args.chain, tflops=flops / t["median_s"] / 1e12)
  t = time_per_call(fn, input_sets, calls_per_run=1, warmup=1, runs=runs)
  row.update(sync_ms=t["median_s"] * 1e3, sync_tflops=flops / t["median_s"] / 1e12)
  stats = jax.devices()[0].memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    row["peak_bytes_so_far"] = int(stats["peak_bytes_in_use"])
  if jax.default_backend() == "gpu" and not args.no_stages:
    # Kernels inside a CUDA graph are not seen one by one in a trace: the breakdown is taken from a build of the
    # same program without command buffers (its total is in stages_ms too; the timed step above uses the default).
    traced = jitted.lower(*jit_args).compile(compiler_options={"xla_gpu_enable_command_buffer": ""})
    row["stages_ms"], row["unattributed_top"], row["stage_top"] = _stage_times(traced, jit_args, traced.as_text())
  print(f"  {name:>16} {mode:>8}: {row['ms']:9.3f} ms  {row['tflops']:7.1f} TFLOP/s  (one call synced "
        f"{row['sync_ms']:.3f} ms)" + (f"  SM {row['sm_mhz_median']:.0f} MHz {row['power_w_median']:.0f} W"
                                      if "sm_mhz_median" in row else "") + "  temp "
        f"{row.get('temp_bytes', 0) / 2**30:6.2f} GiB  (compile {row['compile_s']} s, {runs} runs)"
        + ("" if not row.get("stages_ms") else "  " + ", ".join(
            f"{k} {v:.2f}" for k, v in sorted(row["stages_ms"].items(), key=lambda kv: -kv[1]))), flush=True)
  return row


def run(args) -> list[dict]:
  devices = jax.device_count()
  mesh = jax.make_mesh((1, devices), ("data", "expert"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  rows = []
  for tokens in args.tokens:
    fwd_flops = 2.0 * tokens * args.top_k * args.hidden * 3 * args.ffn
    print(f"tokens per device {tokens}: {fwd_flops / 1e12:.3f} TFLOP per forward per device", flush=True)
    for label, variant, wire_format in runs_of(args.variants, args.wire_formats):
      if variant.startswith("reference") and tokens > args.reference_max_tokens:
        print(f"  {label:>16}: skipped at {tokens} tokens (--reference-max-tokens {args.reference_max_tokens})")
        continue
      layer = variant != "einsum" and variant not in FLAX_VARIANTS
      wire = (wire_format or own_wire(variant)) if layer else ("bf16" if variant in FLAX_VARIANTS else None)
      try:
        if variant == "einsum":
          fwd, fwd_bwd, inputs, ws, (jf, jfb, p), accuracy, train = _einsum_fns(args, mesh, tokens)
          jit_fwd = (jf, (*p, inputs(0)[0]))
          jit_bwd = (jfb, (*p, *inputs(0)))
        elif variant in FLAX_VARIANTS:
          fwd, fwd_bwd, inputs, ws, (jf, jfb, p), accuracy, train = _flax_fns(variant, args, mesh, tokens)
          jit_fwd = (jf, (*p, inputs(0)[0]))
          jit_bwd = None if jfb is None else (jfb, (*p, *inputs(0)))
        else:
          fwd, fwd_bwd, inputs, ws, (jf, jfb, p), accuracy, train = _layer_fns(variant, args, mesh, tokens,
                                                                               wire_format)
          jit_fwd = (jf, (*p, inputs(0)[0]))
          jit_bwd = None if jfb is None else (jfb, (*p, *inputs(0)))
        input_sets = [inputs(i) for i in range(args.input_sets)]
        # What every row of this variant records besides its timing: the tokens, and for the layer its wire.
        wire_fields = {"tokens_per_device": tokens}
        if wire is not None:
          wire_fields.update(wire_format=wire, wire_bytes_per_token=layout.dispatch_layout(
              args.hidden, wire, top_k=args.top_k).bytes_per_token)
        for mode, fn, jitted, flops in (("fwd", fwd, jit_fwd, fwd_flops), ("fwd_bwd", fwd_bwd, jit_bwd, 3 * fwd_flops)):
          if fn is None or mode not in args.modes:
            continue
          row = _measure(label, mode, fn, jitted[0], jitted[1], input_sets, flops, args)
          rows.append(row | wire_fields)
        if args.micro_batches > 1 and train is not None:
          n = args.micro_batches
          loss, argnums, prepare = train
          # fwd_bwd_mb: as the step should be written (FP8 weights quantized once, before the loop); where that
          # differs, fwd_bwd_mb_requant: the layer quantizing them in every micro-batch.
          steps = [("fwd_bwd_mb", prepare)] + ([("fwd_bwd_mb_requant", None)] if prepare is not None else [])
          for mode, prep in steps:
            step, stacked_inputs = _micro_batched(loss, argnums, prep, p, n, inputs)
            mb_sets = [stacked_inputs(i) for i in range(args.input_sets)]
            row = _measure(label, mode, lambda xs, cts, step=step: step(*p, xs, cts), step, (*p, *mb_sets[0]),
                           mb_sets, n * 3 * fwd_flops, args)
            row.update(micro_batches=n, ms_per_micro_batch=row["ms"] / n)
            print(f"  {label:>16} {mode}: {row['ms_per_micro_batch']:9.3f} ms per micro-batch of {n}", flush=True)
            rows.append(row | wire_fields)
            del mb_sets
        if args.check and accuracy is not None:
          acc = accuracy(*input_sets[0])
          print(f"  {label:>16} calc_diff vs float32 oracle: " + ", ".join(f"{k} {v:.2e}" for k, v in acc.items()),
                flush=True)
          for row in rows:
            if row.get("variant") == label and row.get("tokens_per_device") == tokens:
              row["accuracy"] = acc
        del input_sets
        if ws is not None:
          ws.close()
      except Exception as e:  # pylint: disable=broad-except  (one variant's failure is recorded, the rest run)
        msg = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        print(f"  {label:>16}: FAILED {msg}", flush=True)
        rows.append({"variant": label, "tokens_per_device": tokens, "error": msg})
  return rows


# ----------------------------------------------------------------------------------------------------------------
# Plot and command line
# ----------------------------------------------------------------------------------------------------------------


def _draw(plt, record):
  rows = [r for r in record["rows"] if "ms" in r]
  fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(rows)), 5.5))
  labels = [f"{r['variant']}\n{r['mode']}\n{r['tokens_per_device']}" for r in rows]
  bottom = np.zeros(len(rows))
  stages = list(STAGES) + ["other"]
  for stage in stages:
    vals = np.array([r.get("stages_ms", {}).get(stage, 0.0) for r in rows])
    if vals.any():
      ax.bar(labels, vals, bottom=bottom, label=stage)
      bottom += vals
  ax.scatter(labels, [r["ms"] for r in rows], color="black", marker="_", s=400, zorder=3, label="step (wall)")
  ax.set_ylabel("ms per step")
  ax.set_yscale("log" if max(r["ms"] for r in rows) > 50 * min(r["ms"] for r in rows) else "linear")
  ax.set_title(f"moe_apply at H {record['hidden']}, F {record['ffn']}, top-{record['top_k']}, "
               f"{record['local_experts']} experts/device; {record['device']}", fontsize=9)
  ax.legend(fontsize=7, ncol=2)
  plt.setp(ax.get_xticklabels(), fontsize=7)
  return fig


def _plot(path):
  return save_plot(path, _draw)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--tokens", type=positive_int, nargs="+", default=[4096, 16384], help="tokens per device")
  p.add_argument("--local-experts", type=positive_int, default=32, help="routed experts per device (default 32)")
  p.add_argument("--hidden", type=positive_int, default=7168)
  p.add_argument("--ffn", type=positive_int, default=2048)
  p.add_argument("--top-k", type=positive_int, default=8)
  p.add_argument("--variants", nargs="+", type=variant_name, default=list(DEFAULT_VARIANTS), choices=VARIANTS)
  p.add_argument("--wire-formats", nargs="+", default=None, choices=layout.FORMATS,
                 help="run each layer variant once per wire format (default: each on its own wire)")
  p.add_argument("--modes", nargs="+", default=["fwd", "fwd_bwd"], choices=["fwd", "fwd_bwd"])
  p.add_argument("--micro-batches", type=int, default=0,
                 help="also time a training step over this many micro-batches (mode fwd_bwd_mb, and for FP8 experts "
                      "on float weights fwd_bwd_mb_requant; >= 2)")
  p.add_argument("--reference-max-tokens", type=positive_int, default=4096,
                 help="largest token count the reference variant runs at")
  p.add_argument("--twin-max-tokens", dest="reference_max_tokens", type=positive_int, default=argparse.SUPPRESS,
                 help=argparse.SUPPRESS)  # its old name, in older command lines
  p.add_argument("--runs", type=positive_int, default=20, help="timed runs (median reported; fewer for slow steps)")
  p.add_argument("--input-sets", type=positive_int, default=3, help="distinct activation sets rotated between calls")
  p.add_argument("--chain", type=positive_int, default=10,
                 help="calls issued back to back per timed run (the step time is the chain's time per call)")
  p.add_argument("--no-stages", action="store_true", help="skip the per-stage profiler trace")
  p.add_argument("--check", action="store_true", help="compare output and gradients with a float32 oracle")
  p.add_argument("--out", default=None, help="directory for the JSON result (default bench/results)")
  p.add_argument("--plot", default=None, help="only plot this result file")
  args = p.parse_args(argv)
  if args.plot:
    print("wrote", _plot(args.plot))
    return 0
  for name in ("local_experts", "hidden", "ffn", "top_k", "runs", "input_sets", "chain"):
    if getattr(args, name) <= 0:
      p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
  if args.micro_batches == 1 or args.micro_batches < 0:
    p.error(f"--micro-batches must be 0 (off) or >= 2, got {args.micro_batches}")
  if any(t <= 0 for t in args.tokens):
    p.error(f"--tokens must be positive, got {args.tokens}")
  for fmt in args.wire_formats or ():
    block = layout.format_spec(fmt).block
    if block and args.hidden % block:
      p.error(f"--hidden must be a multiple of {block} for --wire-formats {fmt}, got {args.hidden}")
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
  rows = run(args)
  timed = any("ms" in r for r in rows)
  path = write_result("layer", {"hidden": args.hidden, "ffn": args.ffn, "top_k": args.top_k,
                                "local_experts": args.local_experts, "devices": jax.device_count(),
                                "flops_definition": "2*T*k*H*3F per forward per device, 3x per forward+backward",
                                "rows": rows}, args.out)
  print("wrote", path)
  if timed:  # nothing to draw when every variant failed
    plot_if_possible(path, _plot)
  return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
