"""The layer's dispatch: encode to the wire format, `a2a.dispatch` (or `two_level.dispatch_two_level`), decode at
the receiver, with a straight-through gradient that comes back by `a2a.combine` over the dispatch's slots."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jax_moe_a2a import layout, ordering, quant
from jax_moe_a2a.a2a import DispatchHandle, combine, dispatch, rows_back_one_sided
from jax_moe_a2a.two_level import dispatch_two_level
from jax_moe_a2a.workspace import Workspace

WIRE_FORMATS: tuple[str, ...] = (layout.BF16, layout.FP8_BLOCKWISE)


@dataclasses.dataclass(frozen=True)
class _WireStatic:
  wire_format: str
  axis_name: Any
  num_experts: int
  dtype: Any  # of the decoded rows
  x_dtype: Any  # of the tokens, and of their gradient
  impl: str
  workspace: Optional[Workspace] = None
  two_level: bool = False  # axis_name is (node axis, local axis): dispatch_two_level


def _wire_forward(st: _WireStatic, x, topk_ids, topk_weights):
  with jax.named_scope("wire_encode"):
    if st.wire_format == layout.FP8_BLOCKWISE:
      x_q, x_sf = quant.quantize_fp8_blockwise(x, impl=st.impl)
    else:
      x_q, x_sf = x.astype(jnp.bfloat16), None
  if st.two_level:
    node_axis, local_axis = st.axis_name
    res, handle = dispatch_two_level(x_q, topk_ids, topk_weights, num_experts=st.num_experts, node_axis=node_axis,
                                     local_axis=local_axis, x_sf=x_sf, workspace=st.workspace, impl=st.impl)
  else:
    res, handle = dispatch(x_q, topk_ids, topk_weights, num_experts=st.num_experts, axis_name=st.axis_name,
                           x_sf=x_sf, workspace=st.workspace, impl=st.impl)
  with jax.named_scope("wire_decode"):
    num_ranks, capacity, hidden = res.recv_x.shape
    if x_sf is not None:
      rows = quant.dequantize_fp8_blockwise(res.recv_x.reshape(num_ranks * capacity, hidden),  # one XLA fusion
                                            res.recv_x_sf.reshape(num_ranks * capacity, -1), dtype=st.dtype)
      rows = rows.reshape(num_ranks, capacity, hidden)
    else:
      rows = res.recv_x.astype(st.dtype)
  # The FP8 codes and scales the rows were decoded from (no gradient): FP8 experts compute from them directly.
  codes = None if x_sf is None else (res.recv_x, res.recv_x_sf)
  out = (rows, res.recv_topk_ids, res.recv_topk_weights, res.recv_counts, handle, codes)
  return out, (handle, res.recv_topk_ids)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _wire(st, x, topk_ids, topk_weights):
  return _wire_forward(st, x, topk_ids, topk_weights)[0]


def _back_to_sources(ct_rows, ct_w, handle: DispatchHandle, rows_dtype):
  """The received rows' and weights' float32 cotangents summed back at their source tokens over `handle`'s slots:
  ``([T, hidden], [T, top_k])``, the rows rounded once to `rows_dtype` where the one-sided call writes it (else
  float32: the caller casts), the weights float32."""
  hidden = ct_rows.shape[-1]
  reference = dataclasses.replace(handle, workspace=None)
  rows = rows_back_one_sided(ct_rows, handle.send_slot, handle.recv_counts, axis_name=handle.axis_name,
                             workspace=handle.workspace, out_dtype=rows_dtype)
  if rows is not None:
    # The weights' cotangents (top_k floats per row) take the reference path, after the rows by data (XLA:CPU
    # would otherwise run the two in any order, and a device inside the all_to_all waiting for a peer inside the
    # one-sided call deadlocks). Column for column the same float32 sums as the single payload below.
    return rows, combine(ordering.after(ct_w, rows), reference, out_dtype=jnp.float32)
  # One exchange for rows and weights, on the reference path.
  back = combine(jnp.concatenate([ct_rows.astype(jnp.float32), ct_w], axis=-1), reference, out_dtype=jnp.float32)
  return back[:, :hidden], back[:, hidden:]


def _wire_bwd(st, res, cts):
  handle, recv_ids = res
  ct_rows, _, ct_w, _, _, _ = cts
  # A weight's cotangent only counts where the weight was really delivered (valid local id): elsewhere the
  # forward value was the constant 0.0. With that mask, summing over ranks gives each (token, k) exactly the
  # cotangent of the one rank holding its expert, as the VJP of dispatch does.
  ct_w = jnp.where(recv_ids >= 0, ct_w.astype(jnp.float32), 0.0)
  if not st.two_level:
    rows, w = _back_to_sources(ct_rows, ct_w, handle, st.x_dtype)
    return rows.astype(st.x_dtype), None, w
  # Two levels: back to the node-received rows inside the node, then across nodes in one float32 exchange.
  rows, w = _back_to_sources(ct_rows, ct_w, handle.local, jnp.float32)  # partial sums stay float32
  hidden, num_nodes, num_tokens = rows.shape[-1], handle.node.num_ranks, handle.node.num_tokens
  both = jnp.concatenate([rows, w], axis=-1).reshape(num_nodes, num_tokens, -1)
  back = combine(both, dataclasses.replace(handle.node, workspace=None), out_dtype=jnp.float32)
  return back[:, :hidden].astype(st.x_dtype), None, back[:, hidden:]


_wire.defvjp(_wire_forward, _wire_bwd)


def wire_dispatch(x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, *, wire_format: str,
                  num_experts: int, axis_name: Any, dtype: Any = jnp.bfloat16, impl: str = "auto",
                  workspace: Optional[Workspace] = None, two_level: bool = False):
  """Encodes x in the wire format, dispatches it, and decodes the received rows (per shard, in shard_map).

  The forward pass is quantize (fp8_blockwise: E4M3, FP32 scale per 1x128 group; bf16: a cast) ->
  `a2a.dispatch` -> dequantize at the receiver. The gradient is straight-through: the float32 cotangents of the
  received rows and weights go back by `a2a.combine` over the dispatch's slots (the rows one-sided when the
  workspace's combine rows hold them exactly, `Workspace.fits_combine_rows`; else rows and weights in one
  reference exchange), so no quantization error enters the gradient and no dispatch is recomputed.

  Args:
    x: [num_tokens, hidden] floating, this shard's tokens (sharded over axis_name's ranks on tokens).
    topk_ids: [num_tokens, top_k] int32 global expert ids.
    topk_weights: [num_tokens, top_k] float32.
    wire_format: one of `WIRE_FORMATS`.
    num_experts: global expert count, a multiple of the axis size.
    axis_name: the expert mesh axis (or tuple of axes); with two_level, the pair (node axis, local axis).
    dtype: dtype of the decoded rows.
    impl: passed to the quantization ops and to `a2a.dispatch`.
    workspace: the `Workspace` of the one-sided custom calls (None: the all_to_all reference); with two_level, one
      over the local axis.
    two_level: dispatch with `dispatch_two_level` (across nodes, then inside each); the gradient then comes back
      inside the node first and crosses nodes once, in float32.

  Returns:
    rows: [num_ranks, num_tokens, hidden] dtype, the decoded `DispatchResult.recv_x` (padding rows are 0).
    recv_topk_ids: [num_ranks, num_tokens, top_k] int32 local ids, -1 for none.
    recv_topk_weights: [num_ranks, num_tokens, top_k] float32.
    recv_counts: [num_ranks] int32.
    handle: the `a2a.DispatchHandle` for `a2a.combine` (with two_level, the `TwoLevelHandle` for
      `combine_two_level`).
  """
  return wire_dispatch_with_codes(x, topk_ids, topk_weights, wire_format=wire_format, num_experts=num_experts,
                                  axis_name=axis_name, dtype=dtype, impl=impl, workspace=workspace,
                                  two_level=two_level)[:5]


def wire_dispatch_with_codes(x, topk_ids, topk_weights, *, wire_format, num_experts, axis_name, dtype, impl,
                             workspace, two_level=False):
  """`wire_dispatch`'s five results and, on an FP8 wire, the received (codes, scales) the rows were decoded from
  (else None)."""
  if wire_format not in WIRE_FORMATS:
    raise ValueError(f"wire_dispatch: wire_format must be one of {', '.join(WIRE_FORMATS)}, got {wire_format!r}")
  if two_level and not (isinstance(axis_name, tuple) and len(axis_name) == 2):
    raise ValueError(f"wire_dispatch: with two_level, axis_name must be the pair (node axis, local axis), got "
                     f"{axis_name!r}")
  st = _WireStatic(wire_format=wire_format, axis_name=axis_name, num_experts=int(num_experts),
                   dtype=jnp.dtype(dtype), impl=impl, x_dtype=jnp.dtype(x.dtype), workspace=workspace,
                   two_level=bool(two_level))
  with jax.named_scope("wire"):
    return _wire(st, x, topk_ids, topk_weights)
