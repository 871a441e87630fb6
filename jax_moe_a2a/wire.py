"""The layer's dispatch: encode to the wire format, `a2a.dispatch` (or `two_level.dispatch_two_level`), decode at
the receiver, with a straight-through gradient that comes back by `a2a.combine` over the dispatch's slots.

Every format of `layout.FORMATS` travels (docs/DESIGN.md §1.5):

- ``bf16``: a cast; the receiver casts to the compute dtype.
- ``fp8_blockwise``: E4M3 with one FP32 scale per 1x128 group (`quant.quantize_fp8_blockwise`); the receiver
  decodes the rows, and FP8 experts compute from the received codes and scales themselves.
- ``mxfp8``: E4M3 with one E8M0 scale per 1x32 block (`quant_mx.quantize_mxfp8`); the receiver decodes.
- ``nvfp4``: E2M1 two per byte, one E4M3 scale per 1x16 block and one FP32 global scale
  (`quant_mx.quantize_nvfp4`); the receiver decodes. The global scale is one per exchange: `nvfp4_global_scale`
  of each rank's tokens, reduced with `jax.lax.pmax` over the expert axis (both levels of a two-level one), so
  every sender encodes and every receiver decodes with the same scalar and nothing travels beside the rows.

FP8 experts on an mxfp8 or nvfp4 wire get the decoded rows and quantize them 1x128 themselves (`experts`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jax_moe_a2a import layout, ordering, quant, quant_mx
from jax_moe_a2a.a2a import DispatchHandle, combine, dispatch, rows_back_one_sided
from jax_moe_a2a.two_level import dispatch_two_level
from jax_moe_a2a.workspace import Workspace, describe_array

WIRE_FORMATS: tuple[str, ...] = layout.FORMATS
_FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


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


def exchange_global_scale(x: jax.Array, axis_name: Any, *, impl: str = "auto") -> jax.Array:
  """The NVFP4 global scale of one exchange (per shard, in shard_map): `quant_mx.nvfp4_global_scale` of the tokens
  of every rank of `axis_name` (a mesh axis or a tuple of them), the same float32 scalar on each.

  `nvfp4_global_scale` is ``max(amax, 1e-12) / 2688`` with amax over the finite values only, non-decreasing in
  amax, so the largest of the ranks' own scales is exactly the scale of all their tokens together: one scalar
  `pmax` is the whole exchange. It is positive and finite whatever the tokens hold (all zeros give the floor's
  scale, NaNs and infinities are left out of amax), so `quantize_nvfp4` never meets a scale it would refuse.
  """
  return jax.lax.pmax(quant_mx.nvfp4_global_scale(x, impl=impl), axis_name)


def _encode(st: _WireStatic, x):
  """x in the wire format: (codes, scales or None, global scale or None)."""
  if st.wire_format == layout.FP8_BLOCKWISE:
    return (*quant.quantize_fp8_blockwise(x, impl=st.impl), None)
  if st.wire_format == layout.MXFP8:
    return (*quant_mx.quantize_mxfp8(x, impl=st.impl), None)
  if st.wire_format == layout.NVFP4:
    global_scale = exchange_global_scale(x, st.axis_name, impl=st.impl)
    return quant_mx.quantize_nvfp4(x, global_scale=global_scale, impl=st.impl)
  return x.astype(jnp.bfloat16), None, None


def _decode(st: _WireStatic, recv_x, recv_x_sf, global_scale):
  """The received [num_ranks, capacity, ...] rows decoded to [num_ranks, capacity, hidden] st.dtype; padding rows
  (all-zero bits: zero codes, and zero scales or E8M0's 2^-127) decode to zeros. One pass over the rows."""
  if st.wire_format == layout.BF16:
    return recv_x.astype(st.dtype)
  num_ranks, capacity = recv_x.shape[:2]
  flat = lambda a: a.reshape((num_ranks * capacity,) + a.shape[2:])
  if st.wire_format == layout.FP8_BLOCKWISE:
    rows = quant.dequantize_fp8_blockwise(flat(recv_x), flat(recv_x_sf), dtype=st.dtype)
  elif st.wire_format == layout.MXFP8:
    rows = quant_mx.dequantize_mxfp8(flat(recv_x), flat(recv_x_sf), dtype=st.dtype, impl=st.impl)
  else:
    rows = quant_mx.dequantize_nvfp4(flat(recv_x), flat(recv_x_sf), global_scale, dtype=st.dtype, impl=st.impl)
  return rows.reshape(num_ranks, capacity, rows.shape[-1])


def _wire_forward(st: _WireStatic, x, topk_ids, topk_weights):
  with jax.named_scope("wire_encode"):
    x_q, x_sf, global_scale = _encode(st, x)
  if st.two_level:
    node_axis, local_axis = st.axis_name
    res, handle = dispatch_two_level(x_q, topk_ids, topk_weights, num_experts=st.num_experts, node_axis=node_axis,
                                     local_axis=local_axis, x_sf=x_sf, workspace=st.workspace, impl=st.impl)
  else:
    res, handle = dispatch(x_q, topk_ids, topk_weights, num_experts=st.num_experts, axis_name=st.axis_name,
                           x_sf=x_sf, workspace=st.workspace, impl=st.impl)
  with jax.named_scope("wire_decode"):
    rows = _decode(st, res.recv_x, res.recv_x_sf, global_scale)
  # The FP8 codes and scales the rows were decoded from (no gradient): FP8 experts compute from them directly. Only
  # the 1x128 wire's are the experts' own tiling; MXFP8 and NVFP4 rows reach them decoded.
  codes = (res.recv_x, res.recv_x_sf) if st.wire_format == layout.FP8_BLOCKWISE else None
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

  The forward pass is encode (bf16: a cast; fp8_blockwise: E4M3, FP32 scale per 1x128 group; mxfp8: E4M3, E8M0
  scale per 1x32 block; nvfp4: E2M1, E4M3 scale per 1x16 block and the exchange's FP32 global scale,
  `exchange_global_scale`) -> `a2a.dispatch` -> decode at the receiver; the codes and scales move bit for bit. The
  gradient is straight-through whatever the format: the float32 cotangents of the received rows and weights go
  back by `a2a.combine` over the dispatch's slots (the rows one-sided when the workspace's combine rows hold them
  exactly, `Workspace.fits_combine_rows`; else rows and weights in one reference exchange), so no quantization
  error enters the gradient and no dispatch is recomputed.

  Args:
    x: [num_tokens, hidden] bfloat16, float16 or float32, this shard's tokens (sharded over axis_name's ranks on
      tokens); hidden a multiple of the format's block (fp8_blockwise 128, mxfp8 32, nvfp4 16).
    topk_ids: [num_tokens, top_k] int32 global expert ids.
    topk_weights: [num_tokens, top_k] float32.
    wire_format: one of `WIRE_FORMATS` (`layout.FORMATS`: bf16, fp8_blockwise, mxfp8, nvfp4).
    num_experts: global expert count, a multiple of the axis size.
    axis_name: the expert mesh axis (or tuple of axes); with two_level, the pair (node axis, local axis).
    dtype: dtype of the decoded rows (bfloat16, float16 or float32).
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

  Raises:
    ValueError: at trace time, for an unknown wire_format, x not [num_tokens, hidden] of a float dtype, a hidden
      the format cannot carry, a dtype that is not bfloat16, float16 or float32, or with two_level an axis_name that
      is not a pair; and as `a2a.dispatch` does.
  """
  return wire_dispatch_with_codes(x, topk_ids, topk_weights, wire_format=wire_format, num_experts=num_experts,
                                  axis_name=axis_name, dtype=dtype, impl=impl, workspace=workspace,
                                  two_level=two_level)[:5]


def wire_dispatch_with_codes(x, topk_ids, topk_weights, *, wire_format, num_experts, axis_name, dtype, impl,
                             workspace, two_level=False):
  """`wire_dispatch`'s five results and, on the fp8_blockwise wire, the received (codes, scales) the rows were
  decoded from (else None)."""
  op = "wire_dispatch"
  if not isinstance(wire_format, str) or wire_format not in WIRE_FORMATS:
    raise ValueError(f"{op}: wire_format must be one of {', '.join(WIRE_FORMATS)}, got {wire_format!r}")
  if getattr(x, "ndim", None) != 2 or jnp.dtype(x.dtype) not in _FLOAT_DTYPES:
    raise ValueError(f"{op}: x must be a 2-D bfloat16, float16 or float32 array [num_tokens, hidden], got "
                     f"{describe_array(x)}")
  try:
    layout.dispatch_layout(x.shape[1], wire_format)
  except ValueError as e:
    block = layout.format_spec(wire_format).block
    raise ValueError(f"{op}: x's hidden must be a positive multiple of {block} for wire_format {wire_format!r}, got "
                     f"shape {tuple(x.shape)}" if block else f"{op}: x's hidden does not fit wire_format "
                     f"{wire_format!r}: {e}") from None
  try:
    out_dtype = jnp.dtype(dtype)
  except TypeError:
    out_dtype = None
  if out_dtype not in _FLOAT_DTYPES:
    raise ValueError(f"{op}: dtype (of the decoded rows) must be bfloat16, float16 or float32, got {dtype!r}")
  if two_level and not (isinstance(axis_name, tuple) and len(axis_name) == 2):
    raise ValueError(f"wire_dispatch: with two_level, axis_name must be the pair (node axis, local axis), got "
                     f"{axis_name!r}")
  st = _WireStatic(wire_format=wire_format, axis_name=axis_name, num_experts=int(num_experts),
                   dtype=out_dtype, impl=impl, x_dtype=jnp.dtype(x.dtype), workspace=workspace,
                   two_level=bool(two_level))
  with jax.named_scope("wire"):
    return _wire(st, x, topk_ids, topk_weights)
