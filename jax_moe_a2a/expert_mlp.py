"""The routed experts' grouped SwiGLU MLPs over rows sorted by expert, and their gradients.

Pure JAX over the grouped GEMM ops. Expert weights use the "NT" layout of the grouped GEMM kernels (DeepGEMM's and
CUTLASS's): each expert's matrix is [N, K] with K (the contraction) contiguous, so an FP8 weight's 128x128 block
scales are [N/128, K/128]:

- ``w_gate_up`` [num_local_experts, 2 * ffn, hidden]: rows [0, ffn) are the gate projection, rows
  [ffn, 2 * ffn) the up projection;
- ``w_down``    [num_local_experts, hidden, ffn].

An expert computes ``down(silu(gate(x)) * up(x))``. Three MLPs share these semantics: `swiglu_mlp_xla` (XLA's own
matmuls in any compute dtype; a row-tiled loop on CPU), `swiglu_mlp_bf16` (the bf16 grouped GEMMs) and
`swiglu_mlp_fp8` (the FP8 block-scaled grouped GEMMs). The names without a leading underscore below the MLPs
(`mlp_bf16_forward`, `mlp_fp8_forward`, `swiglu_backward`, ...) are their forward and backward steps, which the
expert stage's fused pass (`experts`) reuses.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jax.ad_checkpoint import checkpoint_name

from jax_moe_a2a import grouped_gemm, quant
from jax_moe_a2a.quant_base import F32_NAN_BITS, pow2, where_bits


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExpertWeights:
  """SwiGLU weights of the local experts, BF16/FP32, or FP8 E4M3 with FP32 128x128 block scales.

  Attributes:
    w_gate_up: [num_local_experts, 2 * ffn, hidden] (bfloat16, float32 or float8_e4m3fn).
    w_down: [num_local_experts, hidden, ffn], same dtype family.
    w_gate_up_sf: for FP8 weights, [num_local_experts, ceil(2 * ffn / 128), ceil(hidden / 128)] float32.
    w_down_sf: for FP8 weights, [num_local_experts, ceil(hidden / 128), ceil(ffn / 128)] float32.
  """

  w_gate_up: jax.Array
  w_down: jax.Array
  w_gate_up_sf: Optional[jax.Array] = None
  w_down_sf: Optional[jax.Array] = None

  @property
  def is_fp8(self) -> bool:
    return self.w_gate_up_sf is not None

  @classmethod
  def quantize(cls, w_gate_up: jax.Array, w_down: jax.Array) -> "ExpertWeights":
    """FP8 E4M3 weights with one FP32 scale per 128x128 block, from BF16/FP32 ones."""
    gu, gu_sf = quant.quantize_fp8_weight(w_gate_up)
    dn, dn_sf = quant.quantize_fp8_weight(w_down)
    return cls(gu, dn, gu_sf, dn_sf)

  def dequantized(self, dtype=jnp.bfloat16) -> tuple[jax.Array, jax.Array]:
    """(w_gate_up, w_down) as `dtype`."""
    if not self.is_fp8:
      return self.w_gate_up.astype(dtype), self.w_down.astype(dtype)
    return (quant.dequantize_fp8_weight(self.w_gate_up, self.w_gate_up_sf, dtype=dtype),
            quant.dequantize_fp8_weight(self.w_down, self.w_down_sf, dtype=dtype))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeights:
  """The FP8 forms of float expert weights that the FP8 MLP would make from them in every call, made once
  (`quantize_weights`) and read in place of quantizing the weights again: a training step that accumulates
  gradients over micro-batches quantizes its master weights once, not once per micro-batch.

  The float weights stay the MLP's inputs and take the weight gradients; these forms take none. They must be made
  from those same weights (in the same step): they are not compared with them.

  Attributes:
    w_gate_up, w_gate_up_sf, w_down, w_down_sf: E4M3 codes and FP32 128x128 block scales of the weights, as
      `quant.quantize_fp8_weight` makes them.
    w_gate_up_t, w_gate_up_t_sf, w_down_t, w_down_t_sf: the codes transposed ([G, hidden, 2 ffn], [G, ffn, hidden])
      and their scales, the FP8 backward's data-gradient operands (`quant.quantize_fp8_weight_with_transpose`);
      None for the bf16 backward, which reads the float weights.
  """

  w_gate_up: jax.Array
  w_gate_up_sf: jax.Array
  w_down: jax.Array
  w_down_sf: jax.Array
  w_gate_up_t: Optional[jax.Array] = None
  w_gate_up_t_sf: Optional[jax.Array] = None
  w_down_t: Optional[jax.Array] = None
  w_down_t_sf: Optional[jax.Array] = None

  @property
  def has_transposed(self) -> bool:
    return self.w_gate_up_t is not None

  def forward_operands(self) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    return self.w_gate_up, self.w_gate_up_sf, self.w_down, self.w_down_sf

  def transposed_operands(self) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    return self.w_gate_up_t, self.w_gate_up_t_sf, self.w_down_t, self.w_down_t_sf


def quantize_weights(weights: ExpertWeights, *, backward: str = "bf16", impl: str = "auto") -> QuantizedWeights:
  """The `QuantizedWeights` of float `weights` for the FP8 MLP with `backward` (`BACKWARDS`): the codes and scales
  its forward reads, and for the FP8 backwards their transposes, from the quantizer calls the MLP itself makes (the
  same bits). No gradient flows through them (the weights are read under `jax.lax.stop_gradient`)."""
  op = "quantize_weights"
  if weights.is_fp8:
    raise ValueError(f"{op}: weights are FP8 already (the MLP reads them as they are); quantize float weights")
  if backward not in BACKWARDS:
    raise ValueError(f"{op}: backward must be one of {', '.join(BACKWARDS)}, got {backward!r}")
  gu, dn = jax.lax.stop_gradient(weights.w_gate_up), jax.lax.stop_gradient(weights.w_down)
  if backward == "bf16":
    return QuantizedWeights(*quant.quantize_fp8_weight(gu, impl=impl), *quant.quantize_fp8_weight(dn, impl=impl))
  gu_q, gu_sf, gu_t, gu_sf_t = quant.quantize_fp8_weight_with_transpose(gu, impl=impl)
  dn_q, dn_sf, dn_t, dn_sf_t = quant.quantize_fp8_weight_with_transpose(dn, impl=impl)
  return QuantizedWeights(gu_q, gu_sf, dn_q, dn_sf, gu_t, gu_sf_t, dn_t, dn_sf_t)


def check_quantized(op: str, quantized: Optional[QuantizedWeights], weights: ExpertWeights, backward: str) -> None:
  """Checks that `quantized` can stand for `weights`' FP8 forms in the FP8 MLP with `backward`."""
  if quantized is None:
    return
  if not isinstance(quantized, QuantizedWeights):
    raise TypeError(f"{op}: quantized weights must be a QuantizedWeights (quantize_weights), got "
                    f"{type(quantized).__name__}")
  if weights.is_fp8:
    raise ValueError(f"{op}: quantized weights are for float expert weights; these are FP8 already")
  if backward != "bf16" and not quantized.has_transposed:
    raise ValueError(f"{op}: backward {backward!r} reads the weights' transposed FP8 codes: make the quantized "
                     f"weights with quantize_weights(..., backward={backward!r}), got ones without them")
  e4m3, f32 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float32)
  want = {}
  for name, w in (("w_gate_up", weights.w_gate_up), ("w_down", weights.w_down)):
    g, n, k = w.shape
    want[name], want[name + "_sf"] = (e4m3, (g, n, k)), (f32, quant.fp8_weight_scale_shape((g, n, k)))
    if quantized.has_transposed:
      want[name + "_t"], want[name + "_t_sf"] = (e4m3, (g, k, n)), (f32, quant.fp8_weight_scale_shape((g, k, n)))
  for name, (dtype, shape) in want.items():
    v = getattr(quantized, name)
    if v is None or jnp.dtype(v.dtype) != dtype or tuple(v.shape) != shape:
      got = "None" if v is None else f"{jnp.dtype(v.dtype).name} {tuple(v.shape)}"
      raise ValueError(f"{op}: quantized weights' {name} must be {dtype.name} {shape} (the weights' FP8 form), "
                       f"got {got}")


def check_weights(op: str, weights: ExpertWeights, hidden: int) -> tuple[int, int]:
  gu, dn = weights.w_gate_up, weights.w_down
  if gu.ndim != 3 or gu.shape[1] % 2 or gu.shape[2] != hidden:
    raise ValueError(f"{op}: w_gate_up must be [num_local_experts, 2 * ffn, hidden={hidden}], got {gu.shape}")
  num_local_experts, ffn = gu.shape[0], gu.shape[1] // 2
  if dn.shape != (num_local_experts, hidden, ffn):
    raise ValueError(f"{op}: w_down must be [num_local_experts, hidden, ffn] = {(num_local_experts, hidden, ffn)}, "
                     f"got {dn.shape}")
  if (weights.w_gate_up_sf is None) != (weights.w_down_sf is None):
    raise ValueError(f"{op}: FP8 weights need both w_gate_up_sf and w_down_sf, got only one")
  return num_local_experts, ffn


# ----------------------------------------------------------------------------------------------------------------
# Grouped matmul in row tiles (the CPU path)
# ----------------------------------------------------------------------------------------------------------------

# Rows per tile of the tiled grouped MLP.
GROUP_TILE = 128
METHODS = ("auto", "ragged_dot", "tiled")


def _tiles(group_sizes: jax.Array, tile: int):
  """First row and tile count of each group: group g covers rows [start[g], start[g] + group_sizes[g])."""
  sizes = group_sizes.astype(jnp.int32)
  start = jnp.cumsum(sizes) - sizes
  return sizes, start, (sizes + tile - 1) // tile


def _for_each_tile(group_sizes, tile, group_fn, tile_fn, carry):
  """Visits, group by group in ascending order, the tiles ``[start[g] + j * tile, ... + tile)`` of each group.

  Trip counts are run-time values, so only tiles that hold rows are visited. ``group_fn(g)`` is evaluated once
  per group (it slices the group's weights); ``tile_fn(g, ctx, row0, valid, carry)`` gets its result, the
  tile's first row and a [tile] mask of the rows that belong to group g.
  """
  num_groups = group_sizes.shape[0]
  sizes, start, count = _tiles(group_sizes, tile)

  def group(g, carry):
    ctx = group_fn(g)
    end = start[g] + sizes[g]

    def one(j, carry):
      row0 = start[g] + j * tile
      valid = row0 + jnp.arange(tile, dtype=jnp.int32) < end
      return tile_fn(g, ctx, row0, valid, carry)

    return jax.lax.fori_loop(0, count[g], one, carry)

  return jax.lax.fori_loop(0, num_groups, group, carry)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _swiglu_tiled(x, group_sizes, w_gate_up, w_down, compute_dtype, tile):
  """The grouped SwiGLU MLP, one tile of rows at a time (see `swiglu_mlp_xla`, method "tiled").

  A group's last tile runs past its rows into the next group's; since groups go in ascending order, the next
  group rewrites those rows, and rows past sum(group_sizes) are zeroed at the end. x is padded by one tile so
  that no slice is ever clamped.
  """
  return _swiglu_tiled_fwd(x, group_sizes, w_gate_up, w_down, compute_dtype, tile)[0]


def _swiglu_tile(xt, w_gu_t):
  """Gate and up projections of one tile, [tile, ffn] float32 each."""
  h = jnp.dot(xt, w_gu_t, preferred_element_type=jnp.float32)  # [tile, 2 ffn]
  ffn = h.shape[1] // 2
  return h[:, :ffn], h[:, ffn:]


def _swiglu_tiled_fwd(x, group_sizes, w_gate_up, w_down, compute_dtype, tile):
  num_rows, hidden = x.shape
  x_pad = jnp.concatenate([x.astype(compute_dtype), jnp.zeros((tile, hidden), compute_dtype)])

  def group_fn(g):  # per group: weights as [K, N] operands, sliced and transposed once
    return w_gate_up[g].T, w_down[g].T

  def tile_fn(g, ctx, row0, valid, y):
    del g, valid
    w_gu_t, w_dn_t = ctx
    gate, up = _swiglu_tile(jax.lax.dynamic_slice_in_dim(x_pad, row0, tile), w_gu_t)
    act = (jax.nn.silu(gate) * up).astype(compute_dtype)
    yt = jnp.dot(act, w_dn_t, preferred_element_type=jnp.float32)
    return jax.lax.dynamic_update_slice_in_dim(y, yt, row0, axis=0)

  y = _for_each_tile(group_sizes, tile, group_fn, tile_fn, jnp.zeros((num_rows + tile, hidden), jnp.float32))
  live = jnp.arange(num_rows) < jnp.sum(group_sizes)
  return jnp.where(live[:, None], y[:num_rows], 0.0), (x, group_sizes, w_gate_up, w_down)


def _swiglu_tiled_bwd(compute_dtype, tile, res, ct):
  x, group_sizes, w_gate_up, w_down = res
  num_rows, hidden = x.shape
  f32 = jnp.float32
  x_pad = jnp.concatenate([x.astype(compute_dtype), jnp.zeros((tile, hidden), compute_dtype)])
  ct_pad = jnp.concatenate([ct.astype(f32), jnp.zeros((tile, hidden), f32)])

  def group_fn(g):
    return w_gate_up[g].astype(compute_dtype), w_down[g].astype(compute_dtype)

  def tile_fn(g, ctx, row0, valid, carry):
    dx, dw_gu, dw_dn = carry
    w_gu, w_dn = ctx  # [2 ffn, hidden], [hidden, ffn]
    # Rows of the next group (or past the end) must not reach this group's weight gradients: their values, not only
    # their cotangents, are zeroed, and so are the products made from them (0 * NaN is NaN), so a NaN or an
    # infinity in one group's rows or weights stays in that group's gradients.
    mine = valid[:, None]
    xt = jnp.where(mine, jax.lax.dynamic_slice_in_dim(x_pad, row0, tile), 0)
    ct_t = jnp.where(mine, jax.lax.dynamic_slice_in_dim(ct_pad, row0, tile), 0.0)
    gate, up = _swiglu_tile(xt, w_gu.T)  # recomputed rather than stored
    sig = jax.nn.sigmoid(gate)
    silu = gate * sig
    act = jnp.where(mine, silu * up, 0.0).astype(compute_dtype)
    d_act = jnp.dot(ct_t, w_dn.astype(f32))  # [tile, ffn]
    dw_dn = dw_dn.at[g].add(jax.lax.dot_general(ct_t, act.astype(f32), (((0,), (0,)), ((), ()))))
    dh = jnp.concatenate([d_act * up * (sig + silu * (1.0 - sig)), d_act * silu], axis=1)  # [tile, 2 ffn]
    dh = jnp.where(mine, dh, 0.0)
    dw_gu = dw_gu.at[g].add(jax.lax.dot_general(dh, xt.astype(f32), (((0,), (0,)), ((), ()))))
    dxt = jnp.where(mine, jnp.dot(dh, w_gu.astype(f32)), 0.0)
    return jax.lax.dynamic_update_slice_in_dim(dx, dxt, row0, axis=0), dw_gu, dw_dn

  init = (jnp.zeros((num_rows + tile, hidden), f32), jnp.zeros(w_gate_up.shape, f32), jnp.zeros(w_down.shape, f32))
  dx, dw_gu, dw_dn = _for_each_tile(group_sizes, tile, group_fn, tile_fn, init)
  return dx[:num_rows].astype(x.dtype), None, dw_gu.astype(w_gate_up.dtype), dw_dn.astype(w_down.dtype)


_swiglu_tiled.defvjp(_swiglu_tiled_fwd, _swiglu_tiled_bwd)


def _swiglu_ragged_dot(x, group_sizes, w_gate_up, w_down, compute_dtype):
  # grouped_matmul_reference rather than jax.lax.ragged_dot itself: XLA's expansion of ragged_dot spreads a NaN in
  # one group's weights to every row.
  ffn = w_down.shape[-1]
  h = grouped_gemm.grouped_matmul_reference(x.astype(compute_dtype), jnp.swapaxes(w_gate_up, 1, 2), group_sizes,
                                            preferred_element_type=jnp.float32)
  act = jax.nn.silu(h[:, :ffn]) * h[:, ffn:]
  return grouped_gemm.grouped_matmul_reference(act.astype(compute_dtype), jnp.swapaxes(w_down, 1, 2), group_sizes,
                                               preferred_element_type=jnp.float32)


def swiglu_mlp_xla(x: jax.Array, group_sizes: jax.Array, weights: ExpertWeights, *,
                   compute_dtype=jnp.bfloat16, method: str = "auto") -> jax.Array:
  """Grouped SwiGLU MLP over rows sorted by expert, on XLA's own matmuls in any compute dtype: the expert path of
  float32 and float16 compute (bfloat16 takes `swiglu_mlp_bf16`'s grouped GEMMs), and their oracle.

  Two implementations with the same semantics (float32 accumulation, the activation rounded to
  `compute_dtype` before the down projection):

  - ``"ragged_dot"``: the product of `jax.lax.ragged_dot`, as `grouped_gemm.grouped_matmul_reference` computes it:
    a dense matmul per group (num_groups times the work, as XLA's own expansion of ragged_dot on CPU and GPU),
    each group's rows selected, so a non-finite value in one group's weights reaches no other group's rows.
  - ``"tiled"``: a loop over the groups and, within each, over tiles of `GROUP_TILE` rows runs the whole MLP
    per tile with the group's weights; its trip counts are run-time values, so the work is that of the real
    rows plus at most one tile per group. The backward pass (a custom VJP) is tiled the same way; the rows a
    tile holds of the next group are zeroed (values and products), so they reach no weight gradient but their own.
  - ``"auto"``: ``"tiled"`` on CPU, ``"ragged_dot"`` elsewhere (chosen when lowering, per platform).

  Args:
    x: [num_rows, hidden] rows sorted by local expert (bfloat16 or float32; FP8 inputs are dequantized by the
      caller). Rows past sum(group_sizes) give zero.
    group_sizes: [num_local_experts] int32, rows of each expert, in order.
    weights: the local experts' weights (BF16 or FP8; FP8 is dequantized to `compute_dtype` first).
    compute_dtype: operand dtype of the matmuls; they accumulate in float32.
    method: ``"auto"``, ``"ragged_dot"`` or ``"tiled"``.

  Returns:
    [num_rows, hidden] float32.
  """
  op = "swiglu_mlp_xla"
  check_weights(op, weights, x.shape[-1])
  if method not in METHODS:
    raise ValueError(f"{op}: method must be one of {', '.join(METHODS)}, got {method!r}")
  w_gate_up, w_down = weights.dequantized(compute_dtype)
  args = (x, group_sizes, w_gate_up, w_down, compute_dtype)
  tile = min(GROUP_TILE, -(-max(x.shape[0], 1) // 8) * 8)
  tiled = lambda *a: _swiglu_tiled(*a, compute_dtype, tile)
  ragged = lambda *a: _swiglu_ragged_dot(*a, compute_dtype)
  if method == "tiled":
    return tiled(*args[:4])
  if method == "ragged_dot":
    return ragged(*args[:4])
  return jax.lax.platform_dependent(*args[:4], cpu=tiled, default=ragged)


# ----------------------------------------------------------------------------------------------------------------
# The bf16 expert MLP on the grouped GEMM
# ----------------------------------------------------------------------------------------------------------------


def swiglu(h: jax.Array) -> jax.Array:
  """silu(gate) * up of gate/up rows h [..., 2 ffn], in float32."""
  ffn = h.shape[-1] // 2
  gate, up = h[..., :ffn].astype(jnp.float32), h[..., ffn:].astype(jnp.float32)
  return jax.nn.silu(gate) * up


def swiglu_backward(h: jax.Array, d_act: jax.Array) -> jax.Array:
  """The cotangent of h [..., 2 ffn] from that of silu(gate) * up, float32."""
  ffn = h.shape[-1] // 2
  gate, up = h[..., :ffn].astype(jnp.float32), h[..., ffn:].astype(jnp.float32)
  d_act = d_act.astype(jnp.float32)
  sig = jax.nn.sigmoid(gate)
  silu = gate * sig
  return jnp.concatenate([d_act * up * (sig + silu * (1.0 - sig)), d_act * silu], axis=-1)


def _mlp_backward_bf16(impl, ct, x, h, group_sizes, w_gate_up, w_down, wgrad_dtype):
  """Cotangents (dx, dw_gate_up, dw_down) of the grouped SwiGLU MLP on bfloat16 operands.

  Four grouped GEMMs: d_act = ct @ w_down and dx = dh @ w_gate_up (data gradients, weights read in place), and
  dw_down = ct^T act, dw_gate_up = dh^T x (weight gradients contracted over each expert's rows in float32, written
  as `wgrad_dtype`; None: no weight gradients, (dx, None, None)).
  """
  bf16 = jnp.bfloat16
  ct = ct.astype(bf16)
  d_act = grouped_gemm.grouped_gemm_bf16(ct, w_down, group_sizes, b_layout="kn", impl=impl)
  dh = swiglu_backward(h, d_act).astype(bf16)
  dx = grouped_gemm.grouped_gemm_bf16(dh, w_gate_up, group_sizes, b_layout="kn", impl=impl)
  if wgrad_dtype is None:
    return dx, None, None
  act = swiglu(h).astype(bf16)  # recomputed from the saved gate/up rows
  dw_down = grouped_gemm.grouped_gemm_bf16_wgrad(ct, act, group_sizes, out_dtype=wgrad_dtype, impl=impl)
  dw_gate_up = grouped_gemm.grouped_gemm_bf16_wgrad(dh, x, group_sizes, out_dtype=wgrad_dtype, impl=impl)
  return dx, dw_gate_up, dw_down


@dataclasses.dataclass(frozen=True)
class Bf16MlpStatic:
  impl: str
  dtypes: tuple[Any, Any, Any]  # of x, w_gate_up and w_down: the dtypes of their cotangents


def mlp_bf16_forward(st: Bf16MlpStatic, x, group_sizes, w_gate_up, w_down):
  impl, bf16 = st.impl, jnp.bfloat16
  xb, gu, dn = x.astype(bf16), w_gate_up.astype(bf16), w_down.astype(bf16)
  h = grouped_gemm.grouped_gemm_bf16(xb, gu, group_sizes, b_layout="nk", impl=impl)  # [M, 2 ffn]
  h = checkpoint_name(h, "expert_gate_up")
  y = grouped_gemm.grouped_gemm_bf16(swiglu(h).astype(bf16), dn, group_sizes, b_layout="nk", impl=impl)
  return y, (xb, h, group_sizes, gu, dn)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _mlp_bf16(st, x, group_sizes, w_gate_up, w_down):
  return mlp_bf16_forward(st, x, group_sizes, w_gate_up, w_down)[0]


def _mlp_bf16_bwd(st: Bf16MlpStatic, res, ct):
  xb, h, group_sizes, gu, dn = res
  # Weight gradients are written in float32 for float32 weights, else in bfloat16 (no float32 pass to cast).
  f32 = jnp.dtype(jnp.float32)
  wgrad_dtype = f32 if f32 in st.dtypes[1:] else jnp.dtype(jnp.bfloat16)
  grads = _mlp_backward_bf16(st.impl, ct, xb, h, group_sizes, gu, dn, wgrad_dtype)
  dx, dw_gu, dw_dn = (g.astype(dt) for g, dt in zip(grads, st.dtypes))
  return dx, None, dw_gu, dw_dn


_mlp_bf16.defvjp(mlp_bf16_forward, _mlp_bf16_bwd)


def swiglu_mlp_bf16(x: jax.Array, group_sizes: jax.Array, weights: ExpertWeights, *,
                    impl: str = "auto") -> jax.Array:
  """The grouped SwiGLU MLP in bfloat16 on `grouped_gemm.grouped_gemm_bf16`: gate/up -> SwiGLU -> down.

  Operands are rounded to bfloat16 (float32 weights are cast, FP8 weights dequantized), products accumulate in
  float32, the gate/up output and the activation are rounded to bfloat16 (as `swiglu_mlp_xla` with
  compute_dtype bfloat16). The gradient (a custom VJP) runs on four more grouped GEMMs: the data gradients read
  the weights in place, the weight gradients contract over each expert's rows in float32 and come back in the
  weights' dtype. Saved for the backward pass: x and the gate/up rows, bfloat16 (``2 * (hidden + 2 * ffn)`` bytes
  per row).

  Args:
    x: [M, hidden] rows sorted by expert (any float dtype; its cotangent has its dtype).
    group_sizes: int32 [G] rows per expert (clamped as in `grouped_gemm`); rows no expert owns give 0.
    weights: the G experts' `ExpertWeights`; hidden and ffn multiples of 8.
    impl: "auto", "ffi" or "reference", for the grouped GEMMs.

  Returns:
    bfloat16 [M, hidden].
  """
  op = "swiglu_mlp_bf16"
  hidden = x.shape[-1]
  _, ffn = check_weights(op, weights, hidden)
  if x.ndim != 2:
    raise ValueError(f"{op}: x must be [M, hidden], got shape {tuple(x.shape)}")
  check_bf16_sizes(op, hidden, ffn)
  if weights.is_fp8:
    w_gate_up, w_down = weights.dequantized(jnp.bfloat16)
  else:
    w_gate_up, w_down = weights.w_gate_up, weights.w_down
  st = Bf16MlpStatic(impl=impl, dtypes=tuple(jnp.dtype(v.dtype) for v in (x, w_gate_up, w_down)))
  return _mlp_bf16(st, x, group_sizes.astype(jnp.int32), w_gate_up, w_down)


def check_bf16_sizes(op: str, hidden: int, ffn: int) -> None:
  for name, v in (("hidden", hidden), ("ffn", ffn)):
    if v % 8 or v == 0:
      raise ValueError(f"{op}: {name} must be a positive multiple of 8, got {v}")


# ----------------------------------------------------------------------------------------------------------------
# The FP8 expert MLP on the grouped GEMM
# ----------------------------------------------------------------------------------------------------------------


# How the FP8 experts' backward computes: "bf16" is straight-through on the bf16 grouped GEMMs; "fp8_dgrad" runs
# the data gradients on the FP8 grouped GEMM (cotangent rows quantized 1x128, the forward's FP8 weights transposed);
# "fp8" the weight gradients too, on the FP8 weight-gradient GEMM (DeepSeek-V3's recipe: all three GEMMs in FP8).
BACKWARDS = ("bf16", "fp8_dgrad", "fp8")


@dataclasses.dataclass(frozen=True)
class Fp8MlpStatic:
  impl: str
  x_dtype: Any  # dtype of a float x (its cotangent's dtype), or None for an FP8 x
  w_dtype: Any  # dtype of float weights, or None for FP8 weights
  backward: str = "bf16"  # one of BACKWARDS


def _masked_mlp_reference(x, group_sizes, w_gate_up, w_down):
  """The bfloat16 SwiGLU MLP on masked groups x [G, R, H] (float32 accumulation, rows past a count give 0).

  Rows past a count are zeroed on the way in too, so that whatever they hold (NaN) reaches no weight gradient, and
  their own gradient is 0 (not 0 * NaN of a weight)."""
  ffn = w_down.shape[-1]
  _, size = grouped_gemm.owned_rows(group_sizes, x.shape[1], masked=True)
  live = (jnp.arange(x.shape[1])[None, :] < size[:, None])[..., None]
  h = jnp.einsum("grh,gfh->grf", jnp.where(live, x, 0), w_gate_up, preferred_element_type=jnp.float32)
  act = (jax.nn.silu(h[..., :ffn]) * h[..., ffn:]).astype(jnp.bfloat16)
  y = jnp.einsum("grf,ghf->grh", act, w_down, preferred_element_type=jnp.float32)
  return jnp.where(live, y, 0.0)


def quantize_rows(x, impl):
  """`quant.quantize_fp8_blockwise` of x [..., K]: E4M3 [..., K] and float32 scales [..., K/128]."""
  k = x.shape[-1]
  q, sf = quant.quantize_fp8_blockwise(x.reshape(-1, k), impl=impl)
  return q.reshape(x.shape), sf.reshape(*x.shape[:-1], k // quant.FP8_BLOCK)


def _swiglu_quantize_rows(h, impl):
  """`quant.swiglu_quantize_fp8_blockwise` of gate/up rows h [..., 2F]: E4M3 [..., F] and scales [..., F/128]."""
  f = h.shape[-1] // 2
  q, sf = quant.swiglu_quantize_fp8_blockwise(h.reshape(-1, 2 * f), impl=impl)
  return q.reshape(*h.shape[:-1], f), sf.reshape(*h.shape[:-1], f // quant.FP8_BLOCK)


def _fp8_operands(st: Fp8MlpStatic, x, x_sf, w_gate_up, w_gate_up_sf, w_down, w_down_sf, quantized=None):
  """FP8 activations and weights (each quantized here when float, or float weights' `quantized` forms read), and,
  for the FP8 backward of float weights, the weights' transposed codes and scales (the data gradients' operands)
  from the same quantizer call, else None."""
  if st.x_dtype is not None:
    x, x_sf = quantize_rows(x, st.impl)
  w_t = None
  if quantized is not None:
    w_gate_up, w_gate_up_sf, w_down, w_down_sf = quantized.forward_operands()
    w_t = None if st.backward == "bf16" else quantized.transposed_operands()
  elif st.w_dtype is not None and st.backward == "bf16":
    w_gate_up, w_gate_up_sf = quant.quantize_fp8_weight(w_gate_up, impl=st.impl)
    w_down, w_down_sf = quant.quantize_fp8_weight(w_down, impl=st.impl)
  elif st.w_dtype is not None:
    w_gate_up, w_gate_up_sf, gu_t, gu_sf_t = quant.quantize_fp8_weight_with_transpose(w_gate_up, impl=st.impl)
    w_down, w_down_sf, dn_t, dn_sf_t = quant.quantize_fp8_weight_with_transpose(w_down, impl=st.impl)
    w_t = (gu_t, gu_sf_t, dn_t, dn_sf_t)
  return (x, x_sf, w_gate_up, w_gate_up_sf, w_down, w_down_sf), w_t


def mlp_fp8_forward(st: Fp8MlpStatic, x, x_sf, group_sizes, w_gate_up, w_gate_up_sf, w_down, w_down_sf,
                    quantized=None):
  (a, a_sf, gu, gu_sf, dn, dn_sf), w_t = _fp8_operands(st, x, x_sf, w_gate_up, w_gate_up_sf, w_down, w_down_sf,
                                                       quantized)
  ffn = dn.shape[-1]
  h = grouped_gemm.grouped_gemm_fp8(a, a_sf, gu, gu_sf, group_sizes, impl=st.impl)  # [..., 2 ffn] bf16
  h = checkpoint_name(h, "expert_gate_up")
  del ffn
  q, q_sf = _swiglu_quantize_rows(h, st.impl)
  y = grouped_gemm.grouped_gemm_fp8(q, q_sf, dn, dn_sf, group_sizes, impl=st.impl)
  return y, (a, a_sf, _kept_gate_up(st, h), group_sizes,
             _weights_for_backward(st, w_gate_up, w_down, (gu, gu_sf, dn, dn_sf), w_t))


def _kept_gate_up(st: Fp8MlpStatic, h: jax.Array):
  """What the backward keeps of the gate/up rows h [..., 2F]: h itself (bfloat16), or for the FP8 backward its
  1x128 FP8 codes and the scales' exponents (`scale_exponents`): 2F + 2F/128 bytes a row against 4F, and the
  backward's SwiGLU derivative then starts from these values."""
  if st.backward == "bf16":
    return h
  q, sf = quantize_rows(h, st.impl)
  return q, scale_exponents(sf)


def gate_up_rows(kept) -> jax.Array:
  """The gate/up rows the backward computes from (bfloat16): `_kept_gate_up`'s h, or its FP8 codes decoded (exact
  in bfloat16, whose exponent range is float32's)."""
  if not isinstance(kept, tuple):
    return kept
  q, exponents = kept
  f = q.shape[-1]
  sf = scales_from_exponents(exponents)
  return quant.dequantize_fp8_blockwise(q.reshape(-1, f), sf.reshape(-1, f // quant.FP8_BLOCK),
                                        dtype=jnp.bfloat16).reshape(q.shape)


def scale_exponents(sf: jax.Array) -> jax.Array:
  """1x128 FP8 scales as made by `quant.quantize_fp8_blockwise` (powers of two 2^(b - 127) with b in [1, 253], or
  the NaN marker) in one byte each: b, or 255 for NaN. `scales_from_exponents` gives back the same float32 bits; no
  other value survives the round trip, so this is only for scales that quantizer made."""
  bits = jax.lax.bitcast_convert_type(sf.astype(jnp.float32), jnp.uint32)
  return jnp.where(jnp.isnan(sf), jnp.uint8(255), (bits >> 23).astype(jnp.uint8))


def scales_from_exponents(exponents: jax.Array) -> jax.Array:
  """The float32 scales of `scale_exponents`' bytes, bit for bit (255: the quantizer's NaN marker)."""
  return where_bits(exponents == 255, F32_NAN_BITS, pow2(exponents.astype(jnp.uint32)))


def _weights_for_backward(st: Fp8MlpStatic, w_gate_up, w_down, fp8, fp8_t):
  """What the backward reads of the weights: (float weights or None, FP8 weights or None).

  Float weights are read as they are (their gradient's dtype, and the bf16 backward's operands). FP8 weights: for
  the bf16 backward, FP8 parameters (dequantized there); for the FP8 backward, the float weights' transposed codes
  `fp8_t` (written by the forward's quantizer), or FP8 parameters as they are (transposed there, so that no
  transposed copy lives from the forward to the backward)."""
  float_w = (w_gate_up, w_down) if st.w_dtype is not None else None
  if st.w_dtype is None:
    return float_w, fp8
  return float_w, (None if st.backward == "bf16" else fp8_t)


def transposed_fp8_weights(st: Fp8MlpStatic, w_bwd):
  """The FP8 backward's weight operands (w_gate_up_t [G, H, 2F], its scales, w_down_t [G, F, H], its scales)."""
  if st.w_dtype is not None:
    return w_bwd[1]
  gu, gu_sf, dn, dn_sf = w_bwd[1]
  return (*_transposed(gu, gu_sf), *_transposed(dn, dn_sf))


def bf16_weights(w_bwd):
  """(w_gate_up, w_down) in bfloat16 for the bf16 backward: float weights cast, FP8 weights dequantized."""
  float_w, fp8 = w_bwd
  if float_w is not None:
    return float_w[0].astype(jnp.bfloat16), float_w[1].astype(jnp.bfloat16)
  gu, gu_sf, dn, dn_sf = fp8
  return (quant.dequantize_fp8_weight(gu, gu_sf, dtype=jnp.bfloat16),
          quant.dequantize_fp8_weight(dn, dn_sf, dtype=jnp.bfloat16))


def _transposed(w: jax.Array, w_sf: jax.Array) -> tuple[jax.Array, jax.Array]:
  """FP8 weights [G, N, K] with 128x128 block scales as [G, K, N]: each block's scale moves with its block, so
  this is exactly what quantizing the transposed weights gives (the amax of a block is that of its transpose)."""
  return jnp.swapaxes(w, -1, -2), jnp.swapaxes(w_sf, -1, -2)


def wgrad_fp8(impl, dy, x, group_sizes, out_dtype, x_sf=None, dy_rows=None, x_rows=None):
  """Per group, dy_g^T x_g on the FP8 grouped GEMM: both operands quantized along the tokens (128x1 tiles, each
  group padded to 128 tokens; an FP8 x with 1x128 scales x_sf is decoded and quantized again that way). dy_rows /
  x_rows (int32 [A]): the operand's sorted rows are read at these rows of dy / x (kept once per token) rather than
  expanded first."""
  kmajor = lambda v, sf, r: quant.quantize_fp8_grouped_kmajor(v, group_sizes, sf, rows=r, impl=impl)
  return grouped_gemm.grouped_gemm_fp8_wgrad(*kmajor(dy, None, dy_rows), *kmajor(x, x_sf, x_rows), group_sizes,
                                             out_dtype=out_dtype, impl=impl)


def data_gradients_fp8(impl, ct_q, ct_sf, h, group_sizes, fp8_t, weight=None):
  """The FP8 backward's data gradients: g = ct @ w_down and dx = dh @ w_gate_up on the FP8 grouped GEMM.

  fp8_t: `transposed_fp8_weights`. ct arrives quantized 1x128 (codes and scales); dh is quantized 1x128 here. `weight` (per row, float32 [..., 1])
  scales d_act before the SwiGLU backward (the expert pass's routing weight). Returns (g, dh, dx), all bfloat16."""
  gu_t, gu_sf_t, dn_t, dn_sf_t = fp8_t
  g = grouped_gemm.grouped_gemm_fp8(ct_q, ct_sf, dn_t, dn_sf_t, group_sizes, impl=impl)
  d_act = g.astype(jnp.float32) if weight is None else weight * g.astype(jnp.float32)
  # dh rounded to bfloat16 before the 1x128 quantization (8 significant bits before 4: no further error) halves
  # what the quantizer reads, and is the weight gradient's operand as it is.
  dh = swiglu_backward(h, d_act).astype(jnp.bfloat16)
  dh_q, dh_sf = quantize_rows(dh, impl)
  dx = grouped_gemm.grouped_gemm_fp8(dh_q, dh_sf, gu_t, gu_sf_t, group_sizes, impl=impl)
  return g, dh, dx


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _mlp_fp8(st, x, x_sf, group_sizes, w_gate_up, w_gate_up_sf, w_down, w_down_sf, quantized):
  return mlp_fp8_forward(st, x, x_sf, group_sizes, w_gate_up, w_gate_up_sf, w_down, w_down_sf, quantized)[0]


def _mlp_fp8_bwd(st: Fp8MlpStatic, res, ct):
  a, a_sf, h, group_sizes, w_bwd = res
  h = gate_up_rows(h)
  bf16 = jnp.bfloat16
  hidden = a.shape[-1]
  wgrad_dtype = None if st.w_dtype is None else (
      jnp.dtype(jnp.float32) if st.w_dtype == jnp.dtype(jnp.float32) else jnp.dtype(bf16))
  # The bf16 backward is straight-through: the bfloat16 MLP's gradient at the quantized activations, the forward's
  # gate/up rows and the weights (float weights rounded to bfloat16, FP8 weights dequantized). The masked layout's
  # weight gradients take that way with every backward; "fp8_dgrad"'s weight gradients are the bf16 GEMMs'.
  masked = a.ndim == 3
  if st.backward != "fp8" or (masked and wgrad_dtype is not None):
    x = quant.dequantize_fp8_blockwise(a.reshape(-1, hidden), a_sf.reshape(-1, hidden // quant.FP8_BLOCK),
                                       dtype=bf16).reshape(a.shape)
  if st.backward == "bf16" or (masked and wgrad_dtype is not None):
    w_gate_up, w_down = bf16_weights(w_bwd)
  if st.backward == "bf16" and masked:
    _, vjp = jax.vjp(lambda x, wg, wd: _masked_mlp_reference(x, group_sizes, wg, wd), x, w_gate_up, w_down)
    dx, dw_gu, dw_dn = vjp(ct.astype(jnp.float32))
  elif st.backward == "bf16":
    dx, dw_gu, dw_dn = _mlp_backward_bf16(st.impl, ct, x, h, group_sizes, w_gate_up, w_down, wgrad_dtype)
  else:
    ct_q, ct_sf = quantize_rows(ct, st.impl)
    _, dh, dx = data_gradients_fp8(st.impl, ct_q, ct_sf, h, group_sizes, transposed_fp8_weights(st, w_bwd))
    dw_gu = dw_dn = None
    if wgrad_dtype is not None and masked:
      _, vjp = jax.vjp(lambda wg, wd: _masked_mlp_reference(x, group_sizes, wg, wd), w_gate_up, w_down)
      dw_gu, dw_dn = vjp(ct.astype(jnp.float32))
    elif wgrad_dtype is not None and st.backward == "fp8":
      dw_dn = wgrad_fp8(st.impl, ct.astype(bf16), swiglu(h).astype(bf16), group_sizes, wgrad_dtype)
      dw_gu = wgrad_fp8(st.impl, dh, a, group_sizes, wgrad_dtype, x_sf=a_sf)
    elif wgrad_dtype is not None:
      act = swiglu(h).astype(bf16)
      dw_dn = grouped_gemm.grouped_gemm_bf16_wgrad(ct.astype(bf16), act, group_sizes, out_dtype=wgrad_dtype,
                                                   impl=st.impl)
      dw_gu = grouped_gemm.grouped_gemm_bf16_wgrad(dh, x, group_sizes, out_dtype=wgrad_dtype, impl=st.impl)
  dx = None if st.x_dtype is None else dx.astype(st.x_dtype)
  if st.w_dtype is None:
    dw_gu = dw_dn = None
  else:
    dw_gu, dw_dn = dw_gu.astype(st.w_dtype), dw_dn.astype(st.w_dtype)
  return dx, None, None, dw_gu, None, dw_dn, None, None


_mlp_fp8.defvjp(mlp_fp8_forward, _mlp_fp8_bwd)


def fp8_mlp_static(op: str, x, x_sf, weights: ExpertWeights, impl: str, backward: str = "bf16") -> Fp8MlpStatic:
  """Checks the operands of the FP8 MLP; returns its static settings."""
  hidden = x.shape[-1]
  num_groups, ffn = check_weights(op, weights, hidden)
  for name, v in (("hidden", hidden), ("ffn", ffn)):
    if v % quant.FP8_BLOCK or v == 0:
      raise ValueError(f"{op}: {name} must be a positive multiple of {quant.FP8_BLOCK}, got {v}")
  if x.ndim not in (2, 3) or (x.ndim == 3 and x.shape[0] != num_groups):
    raise ValueError(f"{op}: x must be [M, hidden] or [G={num_groups}, R, hidden], got shape {tuple(x.shape)}")
  fp8_x = jnp.dtype(x.dtype) == jnp.dtype(jnp.float8_e4m3fn)
  if fp8_x:
    quant.check_fp8_blockwise(op, x.reshape(-1, hidden), None if x_sf is None else x_sf.reshape(-1, x_sf.shape[-1]))
    if tuple(x_sf.shape) != (*x.shape[:-1], hidden // quant.FP8_BLOCK):
      raise ValueError(f"{op}: x_sf must be {(*x.shape[:-1], hidden // quant.FP8_BLOCK)}, got {tuple(x_sf.shape)}")
  elif x_sf is not None:
    raise ValueError(f"{op}: x_sf is only for float8_e4m3fn x, got x of dtype {jnp.dtype(x.dtype).name}")
  if weights.is_fp8 and jnp.dtype(weights.w_gate_up.dtype) != jnp.dtype(jnp.float8_e4m3fn):
    raise TypeError(f"{op}: FP8 weights must be float8_e4m3fn, got {jnp.dtype(weights.w_gate_up.dtype).name}")
  if backward not in BACKWARDS:
    raise ValueError(f"{op}: backward must be one of {', '.join(BACKWARDS)}, got {backward!r}")
  st = Fp8MlpStatic(impl=impl, x_dtype=None if fp8_x else jnp.dtype(x.dtype),
                     w_dtype=None if weights.is_fp8 else jnp.dtype(weights.w_gate_up.dtype), backward=backward)
  return st


def swiglu_mlp_fp8(x: jax.Array, group_sizes: jax.Array, weights: ExpertWeights, *,
                   x_sf: Optional[jax.Array] = None, impl: str = "auto", backward: str = "bf16",
                   quantized: Optional[QuantizedWeights] = None) -> jax.Array:
  """The grouped SwiGLU MLP in FP8: gate/up grouped GEMM -> SwiGLU -> 1x128 requantization -> down grouped GEMM.

  Both matmuls are `grouped_gemm.grouped_gemm_fp8` (E4M3 operands, float32 accumulation, bfloat16 output);
  the SwiGLU runs in float32 on the bfloat16 gate/up output and is requantized with
  `quant.quantize_fp8_blockwise`. Float activations and float weights are quantized here (1x128 and 128x128
  blocks); FP8 ones are used as they are.

  Gradients (a custom VJP), `backward="bf16"`: bfloat16 and straight-through: the backward pass is that of the
  bfloat16 MLP evaluated at the dequantized FP8 activations, the forward's gate/up rows and the weights (float
  weights rounded to bfloat16 -- not their FP8 forms --, FP8 weights dequantized), on the bf16 grouped GEMMs of
  `swiglu_mlp_bf16` (the masked layout: on einsums), so quantization error enters the gradient only through where
  it is evaluated. `backward="fp8_dgrad"`: the data gradient runs on the FP8 grouped GEMM as DeepSeek-V3 trains:
  the output cotangent rows and the SwiGLU backward's rows quantized 1x128, times the forward's FP8 weights
  transposed (codes and 128x128 block scales, exact), and the gate/up rows are kept for the backward as 1x128 FP8
  codes and scales (the SwiGLU derivative starts from their decoded values); the weight gradients are the bf16
  GEMMs'. `backward="fp8"`, DeepSeek-V3's whole recipe: the weight gradients too (contiguous layout), per expert
  dw_down = ct^T act and dw_gate_up = dh^T x on `grouped_gemm.grouped_gemm_fp8_wgrad`, every operand quantized
  along the tokens in 128x1 tiles (`quant.quantize_fp8_grouped_kmajor`; x from its FP8 codes, a second rounding).
  The masked layout's weight gradients stay bf16. Float x and float weights get cotangents
  in their own dtypes; FP8 inputs, scales and group_sizes get none.

  Args:
    x: contiguous [M, hidden] rows sorted by expert, or masked [G, R, hidden]; bfloat16/float16/float32, or
      float8_e4m3fn with `x_sf`. hidden % 128 == 0.
    group_sizes: int32 [G] rows per expert (see `grouped_gemm` for the clamping of each layout).
    weights: the G experts' `ExpertWeights` (float, or FP8 with 128x128 block scales); 2 * ffn, ffn and hidden
      must be multiples of 128.
    x_sf: float32 1x128 scales of an FP8 x: [M, hidden/128] or [G, R, hidden/128].
    impl: "auto", "ffi" or "reference", for the grouped GEMMs and the quantizations.
    backward: "bf16", "fp8_dgrad" or "fp8" (`BACKWARDS`): how the gradients are computed, see above.
    quantized: float weights' FP8 forms made once (`quantize_weights` with this backward), read instead of
      quantizing the weights here; the weights still take the gradients.

  Returns:
    bfloat16 [M, hidden] or [G, R, hidden]; rows no expert owns are 0.
  """
  op = "swiglu_mlp_fp8"
  st = fp8_mlp_static(op, x, x_sf, weights, impl, backward)
  check_quantized(op, quantized, weights, backward)
  return _mlp_fp8(st, x, x_sf, group_sizes.astype(jnp.int32), weights.w_gate_up, weights.w_gate_up_sf,
                  weights.w_down, weights.w_down_sf, quantized)
