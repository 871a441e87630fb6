"""The expert stage on the receive layout of dispatch: permute by local expert, grouped SwiGLU MLP, weighted
un-permute.

Pure JAX. The stage returns, per received row, the sum over that row's local experts of weight * expert(x),
accumulated in float32 in top-k order: the combine payload. The MLPs themselves, and the weights' layout, are
`expert_mlp`'s; on the grouped GEMMs the three steps are one custom VJP (`_expert_pass`), elsewhere three.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jax.ad_checkpoint import checkpoint_name

from jax_moe_a2a import _ffi, expert_mlp, grouped_gemm, ordering, quant, routing, rows
from jax_moe_a2a.expert_mlp import ExpertWeights

# The routed experts' precision: "dtype" computes in the layer's compute dtype (bf16 grouped GEMMs, or XLA's
# matmuls), "fp8" on the FP8 block-scaled grouped GEMMs. Which implementation runs (custom call or reference) is
# `impl`'s choice, for every op alike.
PRECISIONS = ("dtype", "fp8")


def precision_from_gemm_impl(op: str, precision: str, gemm_impl: Optional[str], name: str) -> str:
  """The experts' precision, given the new setting `name` (= `precision`) and the deprecated `gemm_impl`.

  ``gemm_impl`` chose both the FP8 experts (any value but None) and their implementation; the implementation is
  now `impl`'s alone, so a gemm_impl means ``{name}="fp8"`` with a DeprecationWarning. Removed in the next release.
  """
  if precision not in PRECISIONS:
    raise ValueError(f"{op}: {name} must be one of {', '.join(repr(p) for p in PRECISIONS)}, got {precision!r}")
  if gemm_impl is None:
    return precision
  if gemm_impl not in _ffi.IMPLS:
    raise ValueError(f"{op}: gemm_impl (deprecated: use {name}='fp8') must be None or one of "
                     f"{', '.join(_ffi.IMPLS)}, got {gemm_impl!r}")
  warnings.warn(f"{op}: gemm_impl is deprecated: use {name}='fp8' for FP8 experts (impl chooses the custom call or "
                f"the reference for every op, the experts' GEMMs too); gemm_impl={gemm_impl!r} is read as "
                f"{name}='fp8'", DeprecationWarning, stacklevel=3)
  return "fp8"


# ----------------------------------------------------------------------------------------------------------------
# The stage's expert pass in one VJP: expand -> grouped MLP -> weighted sum, saving neither copy of top_k rows
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _PassStatic:
  fp8: Optional[expert_mlp.Fp8MlpStatic]  # FP8 experts (their settings), or None for the bf16 grouped GEMMs
  impl: str  # the bf16 experts' GEMMs and row moves; with FP8 experts, the weighted sum's gather and sum
  rows_dtype: Any  # the received rows' dtype: their cotangent's
  w_dtypes: Optional[tuple[Any, Any]]  # float weights' dtypes (their cotangents'); None for FP8 weights
  out_dtype: Any


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _expert_pass(st: _PassStatic, x_rows, codes, topk_weights, perm, w_gate_up, w_gate_up_sf, w_down, w_down_sf,
                 quantized):
  """Per row, ``sum_k topk_weights[row, k] * mlp_k(x_rows[row])`` over its valid assignments (float32, ascending k):
  the rows expanded to one per assignment (`_expand_rows`), the grouped MLP (bf16: `swiglu_mlp_bf16`; FP8: the
  rows quantized 1x128 before they are expanded, or ``codes`` used as they are), the weighted sum (`_reduce_rows`).

  Saved for the backward pass: the rows once (bfloat16, or their FP8 codes and scales: not their top_k expanded
  copies, which the backward expands again) and the gate/up rows (bfloat16, or FP8 codes and scales for the FP8
  backward); not the expert outputs. The routing weights' gradient ``<ct[row], y_k>`` is taken as
  ``<act_k, ct[row] @ w_down>`` from the data gradient's own product, so the backward runs the same four grouped
  GEMMs as `expert_mlp.swiglu_mlp_bf16`'s, on the unweighted cotangent rows with the weight applied to act (for
  dw_down) and to d_act (for the rest). Gradients of the FP8 experts are those of `expert_mlp.swiglu_mlp_fp8` with
  its `backward`; float weights' FP8 forms are read from ``quantized`` where given (`expert_mlp.QuantizedWeights`)."""
  return _expert_pass_fwd(st, x_rows, codes, topk_weights, perm, w_gate_up, w_gate_up_sf, w_down, w_down_sf,
                          quantized)[0]


def _expert_pass_fwd(st: _PassStatic, x_rows, codes, topk_weights, perm, w_gate_up, w_gate_up_sf, w_down, w_down_sf,
                     quantized):
  pos = perm.pos.reshape(perm.valid.shape)
  if st.fp8 is not None:
    mlp_impl = st.fp8.impl
    with jax.named_scope("permute"):
      q, q_sf = expert_mlp.quantize_rows(x_rows, mlp_impl) if codes is None else codes
      a, a_sf = rows.scatter_rows(q, pos, impl=mlp_impl), rows.scatter_rows(q_sf, pos, impl=mlp_impl)
    with jax.named_scope("experts"):
      y, (_, _, h, _, w_bwd) = expert_mlp.mlp_fp8_forward(dataclasses.replace(st.fp8, x_dtype=None), a, a_sf,
                                                          perm.group_sizes, w_gate_up, w_gate_up_sf, w_down, w_down_sf,
                                                          quantized)
    saved_rows = (q, q_sf)
  else:
    with jax.named_scope("permute"):
      xb = x_rows.astype(jnp.bfloat16)
      x_sorted = rows.scatter_rows(xb, pos, impl=st.impl)
    with jax.named_scope("experts"):
      mlp_st = expert_mlp.Bf16MlpStatic(impl=st.impl, dtypes=(jnp.dtype(jnp.bfloat16),) * 3)
      y, (_, h, _, gu, dn) = expert_mlp.mlp_bf16_forward(mlp_st, x_sorted, perm.group_sizes, w_gate_up, w_down)
    saved_rows, w_bwd = xb, ((gu, dn), None)
  with jax.named_scope("unpermute"):
    out = rows.sum_rows(y, perm.masked_pos(), topk_weights.astype(jnp.float32), out_dtype=st.out_dtype,
                           impl=st.impl)
  return out, (saved_rows, h, topk_weights, perm, w_bwd, out.reshape(-1)[:1])


def _expert_pass_bwd(st: _PassStatic, res, ct):
  saved_rows, h, topk_weights, perm, w_bwd, out_first = res
  h = expert_mlp.gate_up_rows(h)
  bf16, f32 = jnp.bfloat16, jnp.float32
  mlp_impl = st.impl if st.fp8 is None else st.fp8.impl
  fp8_backward = st.fp8 is not None and st.fp8.backward != "bf16"  # FP8 data gradients
  fp8_wgrad = st.fp8 is not None and st.fp8.backward == "fp8"
  gs = perm.group_sizes
  pos = perm.pos.reshape(perm.valid.shape)
  with jax.named_scope("unpermute"):
    # The cotangent rows, unweighted, one per sorted assignment (0 for those of no local expert).
    valid_sorted = perm.valid.reshape(-1)[perm.order]
    w_sorted = jnp.where(valid_sorted, topk_weights.reshape(-1).astype(f32)[perm.order], 0.0)[:, None]
    # The backward after the forward's output: XLA:GPU otherwise ran the forward's down GEMM late, its SwiGLU fused
    # with the backward's, and held both [rows * top_k, ffn] copies at once with the backward's buffers (its temp
    # memory grew 4.5x from 4096 to 16384 tokens). Ordering the small scale orders it all.
    scale = ordering.after(valid_sorted.astype(f32), out_first)
    if fp8_backward:
      # Each row quantized once and its codes expanded, as the forward does with x. Assignments of no local
      # expert sort past every group, where the FP8 GEMM writes 0.
      ct_q, ct_sf = expert_mlp.quantize_rows(ordering.after(ct, scale), mlp_impl)
      ct_q, ct_sf = rows.scatter_rows(ct_q, pos, impl=mlp_impl), rows.scatter_rows(ct_sf, pos, impl=mlp_impl)
    if not fp8_backward or (st.w_dtypes is not None and not fp8_wgrad):
      ct_sorted = rows.gather_rows(ct, perm.src_row, scale=scale, out_dtype=bf16, impl=st.impl)
  with jax.named_scope("experts"):
    act = expert_mlp.swiglu(h)
    if fp8_backward:
      g, dh, dx_sorted = expert_mlp.data_gradients_fp8(mlp_impl, ct_q, ct_sf, h, gs,
                                                       expert_mlp.transposed_fp8_weights(st.fp8, w_bwd),
                                                       weight=w_sorted)
    else:
      w_gate_up, w_down = expert_mlp.bf16_weights(w_bwd)
      g = grouped_gemm.grouped_gemm_bf16(ct_sorted, w_down, gs, b_layout="kn", impl=mlp_impl)  # ct @ w_down
      dh = expert_mlp.swiglu_backward(h, w_sorted * g.astype(f32)).astype(bf16)
      dx_sorted = grouped_gemm.grouped_gemm_bf16(dh, w_gate_up, gs, b_layout="kn", impl=mlp_impl)
    d_w = jnp.sum(act * g.astype(f32), axis=-1)  # <act, ct @ w_down> = <y, ct> per sorted assignment
    dw_gu = dw_dn = None
    if st.w_dtypes is not None and fp8_wgrad:
      # The FP8 weight gradients: the cotangent rows and the forward's FP8 codes, kept once per token, re-tiled
      # along the tokens where they are read at each sorted assignment (no expanded copy of either).
      wgrad_dtype = f32 if f32 in st.w_dtypes else jnp.dtype(bf16)
      dw_dn = expert_mlp.wgrad_fp8(mlp_impl, ordering.after(ct, scale), (w_sorted * act).astype(bf16), gs,
                                   wgrad_dtype, dy_rows=perm.src_row).astype(st.w_dtypes[1])
      dw_gu = expert_mlp.wgrad_fp8(mlp_impl, dh, saved_rows[0], gs, wgrad_dtype, x_sf=saved_rows[1],
                                   x_rows=perm.src_row).astype(st.w_dtypes[0])
    elif st.w_dtypes is not None:
      wgrad_dtype = f32 if f32 in st.w_dtypes else jnp.dtype(bf16)
      dw_dn = grouped_gemm.grouped_gemm_bf16_wgrad(ct_sorted, (w_sorted * act).astype(bf16), gs,
                                                   out_dtype=wgrad_dtype, impl=mlp_impl).astype(st.w_dtypes[1])
      with jax.named_scope("permute"):  # the rows expanded again, as the forward did
        if st.fp8 is None:
          x = saved_rows
        else:
          x = quant.dequantize_fp8_blockwise(saved_rows[0], saved_rows[1], dtype=bf16)
        x_sorted = rows.scatter_rows(x, pos, impl=mlp_impl)
      dw_gu = grouped_gemm.grouped_gemm_bf16_wgrad(dh, x_sorted, gs, out_dtype=wgrad_dtype,
                                                   impl=mlp_impl).astype(st.w_dtypes[0])
  with jax.named_scope("permute"):
    d_rows = rows.sum_rows(dx_sorted, perm.masked_pos(), out_dtype=st.rows_dtype, impl=mlp_impl)
  d_weights = jnp.where(perm.valid, d_w[perm.pos].reshape(perm.valid.shape), 0.0).astype(topk_weights.dtype)
  return d_rows, None, d_weights, None, dw_gu, None, dw_dn, None, None


_expert_pass.defvjp(_expert_pass_fwd, _expert_pass_bwd)


def expert_stage(recv_x: jax.Array, recv_topk_ids: jax.Array, recv_topk_weights: jax.Array,
                 weights: ExpertWeights, *, recv_x_sf: Optional[jax.Array] = None,
                 wire_codes: Optional[tuple[jax.Array, jax.Array]] = None, out_dtype=jnp.bfloat16,
                 compute_dtype=jnp.bfloat16, method: str = "auto", precision: str = "dtype", impl: str = "auto",
                 backward: str = "bf16", quantized_weights: Optional[expert_mlp.QuantizedWeights] = None,
                 gemm_impl: Optional[str] = None) -> jax.Array:
  """Runs the local experts on what dispatch received and returns the combine payload.

  Each (row, k) with a valid local expert id is one assignment. Assignments are sorted by expert (stable, so
  by row and then k within an expert), run through the grouped MLP, weighted, and summed back per row over k in
  ascending order, in float32. Padding rows (every id `layout.INVALID_EXPERT`) give zero.

  Args:
    recv_x: [num_ranks, capacity, hidden] bfloat16/float32, or float8_e4m3fn with `recv_x_sf`.
    recv_topk_ids: [num_ranks, capacity, top_k] int32 local expert ids, -1 for none.
    recv_topk_weights: [num_ranks, capacity, top_k] float32.
    weights: the local experts' `ExpertWeights`.
    recv_x_sf: for FP8 rows, their [num_ranks, capacity, hidden / 128] float32 1x128 scales.
    wire_codes: for float recv_x decoded from an fp8_blockwise wire, the (E4M3 [num_ranks, capacity, hidden],
      float32 [num_ranks, capacity, hidden / 128]) codes and scales it was decoded from. The FP8 experts then
      compute from these, the values that arrived, rather than from recv_x quantized again (which can differ where
      decoding rounded); recv_x still gets the gradient (straight-through) and its values are not read. Ignored
      with precision "dtype".
    out_dtype: dtype of the returned payload.
    compute_dtype: matmul operand dtype of precision "dtype".
    method: grouped matmul implementation of precision "dtype": "auto" runs bfloat16 compute on the bf16
      grouped GEMMs (`expert_mlp.swiglu_mlp_bf16`) and other dtypes on `expert_mlp.swiglu_mlp_xla`; "ragged_dot"
      and "tiled" choose `swiglu_mlp_xla`'s method.
    precision: the experts' precision (`PRECISIONS`): "dtype" computes in `compute_dtype`; "fp8" runs
      them in FP8 with `expert_mlp.swiglu_mlp_fp8`: FP8 rows (with `recv_x_sf`) are used as they arrived, float
      rows are quantized 1x128 (lossless for rows that arrived in fp8_blockwise and were decoded exactly, so both
      give the same result); float weights are quantized 128x128.
    impl: "auto", "ffi" or "reference", for every op of the stage (grouped GEMMs, quantizations, row moves).
    backward: with precision "fp8", how the FP8 experts' gradients are computed (`expert_mlp.BACKWARDS`, see
      `swiglu_mlp_fp8`: "bf16" straight-through, "fp8_dgrad" FP8 data gradients, "fp8" FP8 data and weight
      gradients).
    quantized_weights: with precision "fp8" and float weights, their FP8 forms made once
      (`expert_mlp.quantize_weights` with this backward), read instead of quantizing the weights here; the
      weights still take the gradients.
    gemm_impl: deprecated: any value but None means precision="fp8" (`impl` chooses the implementation).

  Rows are permuted in their own dtype (decoded to compute_dtype, or FP8 codes with their scales), the expert
  outputs stay bfloat16 until the weighted sum, and both directions are gathers (the gradients too), so no
  [rows * top_k, hidden] float32 tensor is made.

  Returns:
    [num_ranks, capacity, hidden] `out_dtype`: per row, sum_k weight_k * expert_k(x).
  """
  op = "expert_stage"
  precision = precision_from_gemm_impl(op, precision, gemm_impl, "precision")
  num_ranks, capacity, hidden = _check_stage_inputs(op, recv_x, recv_topk_ids, recv_topk_weights, weights)
  fp8 = precision == "fp8"
  if quantized_weights is not None and not fp8:
    raise ValueError(f"{op}: quantized_weights are the FP8 experts' (precision 'fp8'), got precision {precision!r}")
  expert_mlp.check_quantized(op, quantized_weights, weights, backward)
  flat = lambda v: v.reshape(num_ranks * capacity, v.shape[-1])
  x_rows = flat(recv_x)
  sf_rows = None if recv_x_sf is None else flat(recv_x_sf)
  codes = _wire_code_rows(op, recv_x, recv_x_sf, wire_codes) if fp8 and wire_codes is not None else None
  if recv_x_sf is not None and not fp8:  # FP8 rows go to the FP8 experts as they are, else they are decoded
    x_rows = quant.dequantize_fp8_blockwise(x_rows, sf_rows, dtype=compute_dtype)
  elif recv_x.dtype == jnp.float8_e4m3fn and recv_x_sf is None:
    raise ValueError(f"{op}: float8_e4m3fn recv_x needs recv_x_sf (its 1x128 scales), got None")

  topk_weights = jnp.asarray(recv_topk_weights).reshape(-1, recv_topk_ids.shape[-1])
  with jax.named_scope("permute"):
    perm = _permutation(flat(recv_topk_ids), weights.w_gate_up.shape[0])
  out_dtype = jnp.dtype(out_dtype)
  if fp8 and recv_x_sf is not None:
    out = _fp8_rows_as_they_arrived(x_rows, sf_rows, topk_weights, perm, weights, out_dtype, impl, backward,
                                    quantized_weights)
  elif fp8:
    out = _fp8_experts_pass(op, x_rows, codes, topk_weights, perm, weights, out_dtype, impl, backward,
                            quantized_weights)
  elif _takes_bf16_gemms(x_rows, weights, compute_dtype, method):
    out = _bf16_experts_pass(op, x_rows, topk_weights, perm, weights, out_dtype, impl)
  else:
    out = _xla_experts(x_rows, topk_weights, perm, weights, out_dtype, compute_dtype, method, impl)
  return out.reshape(num_ranks, capacity, hidden)  # already out_dtype (un-permute writes it)


def _check_stage_inputs(op: str, recv_x, recv_topk_ids, recv_topk_weights, weights: ExpertWeights):
  """Checks the shapes and dtypes of the stage's inputs; returns (num_ranks, capacity, hidden)."""
  if recv_x.ndim != 3:
    raise ValueError(f"{op}: recv_x must be [num_ranks, capacity, hidden], got shape {recv_x.shape}")
  num_ranks, capacity, hidden = recv_x.shape
  if recv_topk_ids.ndim != 3 or recv_topk_ids.shape[:2] != (num_ranks, capacity):
    raise ValueError(f"{op}: recv_topk_ids must be [num_ranks, capacity, top_k] = [{num_ranks}, {capacity}, top_k], "
                     f"got {recv_topk_ids.shape}")
  if recv_topk_ids.dtype != jnp.int32:
    raise TypeError(f"{op}: recv_topk_ids must be int32, got {recv_topk_ids.dtype}")
  if recv_topk_weights.shape != recv_topk_ids.shape:
    raise ValueError(f"{op}: recv_topk_weights must have the shape of recv_topk_ids {recv_topk_ids.shape}, "
                     f"got {recv_topk_weights.shape}")
  expert_mlp.check_weights(op, weights, hidden)
  return num_ranks, capacity, hidden


def _wire_code_rows(op: str, recv_x, recv_x_sf, wire_codes) -> tuple[jax.Array, jax.Array]:
  """The wire's FP8 codes and scales of the decoded rows recv_x, checked and flattened to one per row."""
  num_ranks, capacity, hidden = recv_x.shape
  if recv_x_sf is not None or not jnp.issubdtype(recv_x.dtype, jnp.floating) or \
      jnp.dtype(recv_x.dtype) == jnp.dtype(jnp.float8_e4m3fn):
    raise ValueError(f"{op}: wire_codes go with float recv_x (the decoded rows) and no recv_x_sf, got recv_x "
                     f"{jnp.dtype(recv_x.dtype).name} and recv_x_sf {'given' if recv_x_sf is not None else 'None'}")
  q, q_sf = wire_codes
  want = ((num_ranks, capacity, hidden), (num_ranks, capacity, hidden // quant.FP8_BLOCK))
  if (tuple(q.shape), tuple(q_sf.shape)) != want or jnp.dtype(q.dtype) != jnp.dtype(jnp.float8_e4m3fn) \
      or jnp.dtype(q_sf.dtype) != jnp.dtype(jnp.float32):
    raise ValueError(f"{op}: wire_codes must be (float8_e4m3fn {want[0]}, float32 {want[1]}), got "
                     f"({jnp.dtype(q.dtype).name} {tuple(q.shape)}, {jnp.dtype(q_sf.dtype).name} "
                     f"{tuple(q_sf.shape)})")
  return q.reshape(num_ranks * capacity, hidden), q_sf.reshape(num_ranks * capacity, -1)


def _weight_dtypes(w_gate_up, w_down) -> tuple[Any, Any]:
  return jnp.dtype(w_gate_up.dtype), jnp.dtype(w_down.dtype)


def _fp8_experts_pass(op, x_rows, codes, topk_weights, perm, weights: ExpertWeights, out_dtype, impl, backward,
                      quantized):
  """FP8 experts on float rows, in the fused pass: the rows (or the wire's codes) quantized, then expanded."""
  st = expert_mlp.fp8_mlp_static(op, x_rows, None, weights, impl, backward)
  pass_st = _PassStatic(fp8=st, impl=impl, rows_dtype=jnp.dtype(x_rows.dtype), out_dtype=out_dtype,
                        w_dtypes=None if weights.is_fp8 else _weight_dtypes(weights.w_gate_up, weights.w_down))
  return _expert_pass(pass_st, x_rows, codes, topk_weights, perm, weights.w_gate_up, weights.w_gate_up_sf,
                      weights.w_down, weights.w_down_sf, quantized)


def _bf16_experts_pass(op, x_rows, topk_weights, perm, weights: ExpertWeights, out_dtype, impl):
  """bfloat16 experts on the bf16 grouped GEMMs, in the fused pass (FP8 weights dequantized first)."""
  expert_mlp.check_bf16_sizes(op, x_rows.shape[-1], weights.w_down.shape[-1])
  w_gate_up, w_down = weights.dequantized(jnp.bfloat16) if weights.is_fp8 else (weights.w_gate_up, weights.w_down)
  pass_st = _PassStatic(fp8=None, impl=impl, rows_dtype=jnp.dtype(x_rows.dtype), out_dtype=out_dtype,
                        w_dtypes=_weight_dtypes(w_gate_up, w_down))
  return _expert_pass(pass_st, x_rows, None, topk_weights, perm, w_gate_up, None, w_down, None, None)


def _fp8_rows_as_they_arrived(x_rows, sf_rows, topk_weights, perm, weights: ExpertWeights, out_dtype, impl,
                              backward, quantized):
  """FP8 experts on FP8 rows (no gradient to them): codes and scales gathered, run, summed in three steps."""
  with jax.named_scope("permute"):
    x_sorted, sf_sorted = x_rows[perm.src_row], sf_rows[perm.src_row]
  with jax.named_scope("experts"):
    y_sorted = expert_mlp.swiglu_mlp_fp8(x_sorted, perm.group_sizes, weights, x_sf=sf_sorted, impl=impl,
                                         backward=backward, quantized=quantized)
  with jax.named_scope("unpermute"):
    return _reduce_rows(y_sorted, topk_weights, perm, out_dtype, impl)


def _xla_experts(x_rows, topk_weights, perm, weights: ExpertWeights, out_dtype, compute_dtype, method, impl):
  """The XLA MLP in compute_dtype: rows expanded, run, summed in three steps."""
  with jax.named_scope("permute"):
    x_sorted = checkpoint_name(_expand_rows(x_rows, perm, impl), "expert_rows")
  with jax.named_scope("experts"):
    y_sorted = expert_mlp.swiglu_mlp_xla(x_sorted, perm.group_sizes, weights, compute_dtype=compute_dtype,
                                         method=method)
  with jax.named_scope("unpermute"):
    return _reduce_rows(y_sorted, topk_weights, perm, out_dtype, impl)


def _takes_bf16_gemms(x_rows, weights: ExpertWeights, compute_dtype, method: str) -> bool:
  """Whether the bf16 experts run on the bf16 grouped GEMMs (`swiglu_mlp_bf16`) rather than `swiglu_mlp_xla`."""
  return (jnp.dtype(compute_dtype) == jnp.dtype(jnp.bfloat16) and method == "auto" and x_rows.shape[-1] % 8 == 0
          and weights.w_down.shape[-1] % 8 == 0)


# ----------------------------------------------------------------------------------------------------------------
# Permute and un-permute: gathers both ways (no scatter-add in either pass)
# ----------------------------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Permutation:
  """Assignments (row, k) of valid local experts, sorted by expert (stably: by row, then k, within one).

  Attributes:
    order: [A] int32, A = rows * top_k: flat assignment index (row * top_k + k) of each sorted position; the
      assignments of no local expert come last.
    pos: [A] int32, the inverse of order: sorted position of each flat assignment.
    src_row: [A] int32, ``order // top_k``: the row each sorted position reads.
    valid: [rows, top_k] bool, whether the assignment has a local expert.
    group_sizes: [num_local_experts] int32, assignments per expert.
  """

  order: jax.Array
  pos: jax.Array
  src_row: jax.Array
  valid: jax.Array
  group_sizes: jax.Array

  def masked_pos(self) -> jax.Array:
    """[rows, top_k] int32: each assignment's sorted position, -1 for those of no local expert."""
    return jnp.where(self.valid, self.pos.reshape(self.valid.shape), -1).astype(jnp.int32)


# Up to this many assignments, sorted positions are counted by comparing every pair (one fused reduction over
# [A, A]) rather than by a sort: in a decode step on an H200 the radix sort left the GPU idle for 29 us after it
# (docs/PERFORMANCE.md), about as long as the rest of the permutation.
_RANK_BY_COMPARISON_MAX = 4096


def _sorted_positions(key: jax.Array, num_keys: int) -> tuple[jax.Array, jax.Array]:
  """(order, pos) of a stable sort of key [A] (values in [0, num_keys)): ``order[i]`` is the index at sorted
  position i, ``pos`` its inverse."""
  num = key.shape[0]
  iota = jnp.arange(num, dtype=jnp.int32)
  inverse = lambda p: jnp.zeros((num,), jnp.int32).at[p].set(iota, unique_indices=True)
  if num <= _RANK_BY_COMPARISON_MAX:
    # The sorted position of a is how many b come before it: a smaller key, or the same key and b < a.
    kb, ka = key[None, :], key[:, None]
    pos = jnp.sum((kb < ka) | ((kb == ka) & (iota[None, :] < iota[:, None])), axis=1, dtype=jnp.int32)
    return inverse(pos), pos
  # The narrowest key that holds every value: a radix sort takes one pass per key byte.
  narrow = jnp.uint8 if num_keys <= 2**8 else jnp.uint16 if num_keys <= 2**16 else jnp.int32
  order = jnp.argsort(key.astype(narrow), stable=True).astype(jnp.int32)
  return order, inverse(order)


def _permutation(ids: jax.Array, num_local_experts: int) -> _Permutation:
  top_k = ids.shape[-1]
  valid = routing.valid_mask(ids, num_local_experts)
  key = jnp.where(valid, ids, num_local_experts).reshape(-1)
  order, pos = _sorted_positions(key, num_local_experts + 1)
  group_sizes = jnp.zeros((num_local_experts + 1,), jnp.int32).at[key].add(1)[:num_local_experts]
  return _Permutation(order=order, pos=pos, src_row=order // top_k, valid=valid, group_sizes=group_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _expand_rows(x_rows: jax.Array, perm: _Permutation, impl: str) -> jax.Array:
  """``x_rows[perm.src_row]``: each row once per sorted assignment, [A, hidden], written as a scatter of each row to
  its top_k sorted positions (every row read once)."""
  return rows.scatter_rows(x_rows, perm.pos.reshape(perm.valid.shape), impl=impl)


def _expand_rows_fwd(x_rows, perm, impl):
  return _expand_rows(x_rows, perm, impl), perm


def _expand_rows_bwd(impl, perm, ct):
  # Each row's cotangent is the sum over its valid assignments, gathered by position, in ascending k (float32).
  return rows.sum_rows(ct, perm.masked_pos(), out_dtype=ct.dtype, impl=impl), None


_expand_rows.defvjp(_expand_rows_fwd, _expand_rows_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _reduce_rows(y_sorted: jax.Array, weights: jax.Array, perm: _Permutation, out_dtype, impl: str) -> jax.Array:
  """Per row, sum_k weight_k * y_sorted[pos[row, k]] in float32 (ascending k), then in out_dtype: [rows, hidden];
  assignments of no local expert add 0."""
  with jax.named_scope("unpermute"):  # the caller's scope is not on a custom_vjp's primal when not differentiated
    return rows.sum_rows(y_sorted, perm.masked_pos(), weights.astype(jnp.float32), out_dtype=out_dtype,
                            impl=impl)


def _reduce_rows_fwd(y_sorted, weights, perm, out_dtype, impl):
  return _reduce_rows(y_sorted, weights, perm, out_dtype, impl), (y_sorted, weights, perm)


def _reduce_rows_bwd(out_dtype, impl, res, ct):
  del out_dtype
  y_sorted, weights, perm = res
  top_k = perm.valid.shape[-1]
  valid_flat = perm.valid.reshape(-1)
  # d y_sorted[i] = weight * ct[row] of the assignment at sorted position i (a gather by order).
  w_sorted = jnp.where(valid_flat, weights.reshape(-1), 0.0).astype(jnp.float32)[perm.order]
  d_y = rows.gather_rows(ct, perm.src_row, scale=w_sorted, out_dtype=y_sorted.dtype, impl=impl)
  # d weight[row, k] = <y of the assignment, ct[row]>: a product and a sum over hidden (one reduction fused with
  # the gather, no float32 copy of the gathered rows as a batched dot would take).
  y_k = y_sorted[perm.pos].reshape(-1, top_k, y_sorted.shape[-1])
  d_w = jnp.where(perm.valid, jnp.sum(y_k.astype(jnp.float32) * ct.astype(jnp.float32)[:, None, :], axis=-1), 0.0)
  return d_y, d_w.astype(weights.dtype), None


_reduce_rows.defvjp(_reduce_rows_fwd, _reduce_rows_bwd)
