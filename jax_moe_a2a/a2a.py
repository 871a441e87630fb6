"""Expert-parallel dispatch and combine: their contract, the pure-JAX reference exchange, and their VJPs.

`dispatch` sends each token to every rank that holds at least one of its top-k experts; `combine` brings the
expert ranks' results back and sums them per token. Both run per shard inside `jax.shard_map`, over one mesh
axis (the expert axis) of size ``num_ranks``; ``me`` is this shard's index on it. With a `Workspace` they run as
the one-sided NVLink custom calls (`one_sided`), else as the reference on `jax.lax.all_to_all`. How the
cotangents of a dispatch travel back (one-sided or the reference exchange) is decided in one place,
`rows_back_one_sided`, for both VJPs (`dispatch`'s and the wire's). The layer's dispatch with its wire format is
`wire.wire_dispatch`; the exchange over nodes x GPUs is `two_level`.

The reference below is exact: the custom call must reproduce every output bit for bit. The contract
(docs/DESIGN.md §3), per shard, with ``T = num_tokens`` (static), ``R = num_ranks``,
``L = num_local_experts = num_experts // R`` and global expert ``e`` living on rank ``e // L``:

- **Validity.** ``topk_ids[t, k]`` is a valid expert iff ``0 <= topk_ids[t, k] < num_experts``; any other id
  (``INVALID_EXPERT`` = -1 in particular) means "no expert" and routes nowhere.
- **Destinations.** ``dest[t, r]`` is true iff token t has at least one valid expert on rank r. Experts of one
  token that share a rank are deduplicated: the token travels to that rank once.
- **Slots.** ``send_slot[t, r]`` is the number of tokens ``t' < t`` with ``dest[t', r]`` (an exclusive prefix
  count in token order) when ``dest[t, r]``, and -1 otherwise. The capacity of every (source, destination)
  pair is T, so slots never overflow.
- **Receive side.** Rank r receives, from each source s, arrays indexed ``[s, j]`` with j the slot: the
  token's activation row and scale row moved as opaque bits, its top-k ids as *local* ids (``id - r * L``)
  for the k whose expert is on r and -1 for every other k, its top-k weights for those k and 0.0 for every
  other k, and the count of tokens s sent. Padding slots (``j >= recv_counts[s]``) hold all-zero bits in the
  activation and scale rows, -1 in the ids and 0.0 in the weights, so the expert stage skips them.
- **Combine.** Each expert rank returns one row per received slot: the weighted sum over its local experts
  (the expert stage applies the weights; combine does not). Token t gets
  ``out[t] = ((-0.0 + back[r0]) + back[r1]) + ...`` over the ranks ``r0 < r1 < ...`` with ``dest[t, r]`` in
  ascending order, where ``back[r] = float32(expert_out_r[me, send_slot[t, r]])``; the sum is accumulated in
  float32 in exactly that order and then cast to ``out_dtype``. It starts at -0.0, the exact additive identity
  (-0.0 + x is x for every x, a single -0.0 included), so no compiler rewrite of ``0 + x`` can change a bit. A
  token sent nowhere gets +0.0.
- **Autodiff.** The VJP of dispatch is a combine of the cotangents to the same slots; the VJP of combine is a
  dispatch of the output cotangent. Routing is computed once in the forward pass, kept in the
  `DispatchHandle`, and reused by combine and both VJPs.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any, Hashable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe_a2a import one_sided, ordering, routing
from jax_moe_a2a.layout import INVALID_EXPERT
# Workspace: public here too (a2a.Workspace)
from jax_moe_a2a.workspace import COMBINE_DTYPES, Workspace, check_one_sided_backward, describe_array

# ----------------------------------------------------------------------------------------------------------------
# Results and handle
# ----------------------------------------------------------------------------------------------------------------


class DispatchResult(NamedTuple):
  """What one rank receives from `dispatch`; every array is per shard of the expert axis.

  Attributes:
    recv_x: ``[num_ranks, capacity, *row]`` x's dtype: ``recv_x[s, j]`` is the row of source s's token in slot
      j, bit for bit; padding slots are all-zero bits. ``capacity`` is the sources' ``num_tokens``.
    recv_x_sf: ``[num_ranks, capacity, *sf_row]`` x_sf's dtype, moved like recv_x; None without x_sf.
    recv_topk_ids: ``[num_ranks, capacity, top_k] int32``: local expert ids (``global - me * L``) for the
      token's experts on this rank, `INVALID_EXPERT` for its other experts and for padding slots.
    recv_topk_weights: ``[num_ranks, capacity, top_k] float32``: the token's weights where recv_topk_ids is
      valid, 0.0 elsewhere and in padding slots.
    recv_counts: ``[num_ranks] int32``: tokens received from each source; slots ``[s, :recv_counts[s]]`` are
      filled.
  """

  recv_x: jax.Array
  recv_x_sf: Optional[jax.Array]
  recv_topk_ids: jax.Array
  recv_topk_weights: jax.Array
  recv_counts: jax.Array


@dataclasses.dataclass(frozen=True)
class DispatchHandle:
  """The routing of one `dispatch`, consumed by `combine` and by both VJPs; a pytree.

  Attributes:
    send_slot: ``[num_tokens, num_ranks] int32``, per shard: the slot of each token on each destination rank,
      -1 where the token was not sent there.
    recv_counts: ``[num_ranks] int32``, per shard: tokens this rank received from each source (what combine
      sends back).
    axis_name: the expert mesh axis (static).
    num_ranks: its size (static).
    num_experts: global expert count (static).
    workspace: the `Workspace` of the one-sided custom calls, or None for the reference path (static).
    topk_ids: ``[num_tokens, top_k] int32``, per shard: the dispatch's ids, from which the one-sided VJP of
      `combine` numbers the same slots again; None on the reference path.
  """

  send_slot: jax.Array
  recv_counts: jax.Array
  axis_name: Hashable
  num_ranks: int
  num_experts: int
  workspace: Optional["Workspace"] = None
  topk_ids: Optional[jax.Array] = None

  @property
  def num_tokens(self) -> int:
    return self.send_slot.shape[0]

  @property
  def num_local_experts(self) -> int:
    return self.num_experts // self.num_ranks


jax.tree_util.register_dataclass(DispatchHandle, data_fields=["send_slot", "recv_counts", "topk_ids"],
                                 meta_fields=["axis_name", "num_ranks", "num_experts", "workspace"])

# ----------------------------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------------------------

_UINT_OF_BITS = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint64}


def _as_bits(a: jax.Array) -> jax.Array:
  """Floating payloads travel as unsigned ints of their width, so no backend may touch their bits."""
  if jnp.issubdtype(a.dtype, jnp.floating):
    bits = jnp.finfo(a.dtype).bits
    if bits in _UINT_OF_BITS:
      return jax.lax.bitcast_convert_type(a, _UINT_OF_BITS[bits])
  return a


def _from_bits(a: jax.Array, dtype: Any) -> jax.Array:
  return a if a.dtype == dtype else jax.lax.bitcast_convert_type(a, dtype)


def bound_axis_size(op: str, axis_name: Hashable) -> int:
  """The size of `axis_name`, which an enclosing shard_map must bind (else a ValueError naming `op`)."""
  try:
    return jax.lax.axis_size(axis_name)
  except NameError as e:
    raise ValueError(f"{op}: axis_name must be a mesh axis bound by an enclosing shard_map, "
                     f"got {axis_name!r}") from e


def _exchange(a: jax.Array, axis_name: Hashable) -> jax.Array:
  """``[R, ...]`` per shard: row r goes to rank r; row s of the result came from rank s. Its own inverse.

  The collective moves unsigned ints: a backend may otherwise run it in a wider float type (XLA:CPU does for
  bf16), which canonicalizes NaN payloads.
  """
  bits = jax.lax.all_to_all(_as_bits(a), axis_name, split_axis=0, concat_axis=0, tiled=True)
  return _from_bits(bits, a.dtype)


def _number_slots(topk_ids: jax.Array, num_experts: int, num_ranks: int) -> tuple[jax.Array, jax.Array]:
  """Rank of each top-k expert and the slot of each token on each rank.

  Returns:
    topk_rank: ``[T, top_k] int32``, the rank holding expert ``topk_ids[t, k]``, -1 for invalid ids.
    send_slot: ``[T, R] int32``, exclusive prefix count of ``dest[:, r]`` where ``dest[t, r]``, else -1.
  """
  topk_rank = routing.expert_to_rank(topk_ids, num_experts, num_ranks)
  dest = jnp.any(topk_rank[:, None, :] == jnp.arange(num_ranks, dtype=jnp.int32)[None, :, None], axis=-1)
  dest_i = dest.astype(jnp.int32)
  before = jnp.cumsum(dest_i, axis=0, dtype=jnp.int32) - dest_i
  # Written out once: fused into combine's gather, XLA:GPU recomputed the prefix sum's upper level for every
  # element of every row (4x that gather's time on an H200).
  send_slot = jax.lax.optimization_barrier(jnp.where(dest, before, -1).astype(jnp.int32))
  return topk_rank, send_slot


def _scatter_to_slots(rows: jax.Array, send_slot: jax.Array, *, per_rank: bool, int_fill: int = 0) -> jax.Array:
  """Send buffers: ``buf[r, send_slot[t, r]] = rows[t]`` (or ``rows[t, r]`` if per_rank); the rest is padding.

  Args:
    rows: ``[T, *row]``, or ``[T, R, *row]`` with per_rank.
    send_slot: ``[T, R] int32``.
    per_rank: whether rows already differ per destination.
    int_fill: padding of integer rows. Floating rows are padded with all-zero bits (+0.0; for E8M0, which has
      no zero, the bit pattern 0x00).

  Returns:
    ``[R, T, *row]`` of rows' dtype.
  """
  num_tokens, num_ranks = send_slot.shape
  dtype = rows.dtype
  bits = _as_bits(rows)
  row_shape = bits.shape[2:] if per_rank else bits.shape[1:]
  fill = jnp.asarray(0 if jnp.issubdtype(dtype, jnp.floating) else int_fill, bits.dtype)
  if num_tokens == 0:
    return _from_bits(jnp.full((num_ranks, 0) + row_shape, fill), dtype)
  # The inverse of send_slot, src[r, j]: the token in slot j of rank r, or T for padding. Only these indices are
  # scattered (tokens not sent to r get slot T, out of bounds and dropped); the rows themselves move by a gather,
  # which has no write conflicts to serialize.
  slot = jnp.where(send_slot >= 0, send_slot, num_tokens)
  rank = jnp.broadcast_to(jnp.arange(num_ranks, dtype=jnp.int32)[None, :], send_slot.shape)
  token = jnp.broadcast_to(jnp.arange(num_tokens, dtype=jnp.int32)[:, None], send_slot.shape)
  src = jnp.full((num_ranks, num_tokens), num_tokens, jnp.int32).at[rank, slot].set(token, mode="drop")
  safe = jnp.minimum(src, num_tokens - 1)
  if per_rank:
    moved = bits[safe, jnp.arange(num_ranks, dtype=jnp.int32)[:, None]]  # [R, T, *row]
  else:
    moved = jnp.take(bits, safe, axis=0)  # [R, T, *row]
  padding = (src == num_tokens).reshape(src.shape + (1,) * len(row_shape))
  return _from_bits(jnp.where(padding, fill, moved), dtype)


def _sum_from_slots(back: jax.Array, send_slot: jax.Array) -> jax.Array:
  """``out[t] = sum over r = 0, 1, ..., R-1 (in that order) of float32(back[r, send_slot[t, r]])``.

  Ranks with ``send_slot[t, r] < 0`` are skipped; the sum starts at -0.0 (the exact additive identity: XLA may
  rewrite ``+0.0 + x`` to ``x``, which differs for x = -0.0), and a token sent nowhere gets +0.0. The loop over the
  static R fixes the float32 addition order (a reduction over the rank axis could be reassociated).

  Args:
    back: ``[R, T, *row]``, the rows returned by each rank for this rank's slots.
    send_slot: ``[T, R] int32``.

  Returns:
    ``[T, *row] float32``.
  """
  num_ranks = back.shape[0]
  num_tokens = send_slot.shape[0]
  sent_anywhere = jnp.any(send_slot >= 0, axis=1).reshape((num_tokens,) + (1,) * (back.ndim - 2))
  acc = jnp.broadcast_to(jnp.where(sent_anywhere, jnp.float32(-0.0), jnp.float32(0.0)),
                         (num_tokens,) + back.shape[2:])
  for r in range(num_ranks):
    slot = send_slot[:, r]
    row = jnp.take(back[r], jnp.maximum(slot, 0), axis=0).astype(jnp.float32)
    sent = (slot >= 0).reshape((num_tokens,) + (1,) * (back.ndim - 2))
    acc = jnp.where(sent, acc + row, acc)
  return acc


# ----------------------------------------------------------------------------------------------------------------
# Dispatch
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _DispatchStatic:
  axis_name: Hashable
  num_ranks: int
  num_experts: int
  x_dtype: Any
  x_sf_dtype: Any
  workspace: Optional["Workspace"] = None


def _dispatch_forward(st: _DispatchStatic, x, x_sf, topk_ids, topk_weights):
  if st.workspace is not None:
    return _one_sided_dispatch_forward(st, x, x_sf, topk_ids, topk_weights)
  num_ranks = st.num_ranks
  topk_rank, send_slot = _number_slots(topk_ids, st.num_experts, num_ranks)
  on_rank = topk_rank[:, None, :] == jnp.arange(num_ranks, dtype=jnp.int32)[None, :, None]  # [T, R, top_k]
  # [T, R, top_k]: the ids as rank r's local ids, INVALID_EXPERT where the expert lives elsewhere.
  local_ids = jax.vmap(lambda r: routing.local_expert_ids(topk_ids, r, st.num_experts, num_ranks), out_axes=1)(
      jnp.arange(num_ranks, dtype=jnp.int32))
  local_w = jnp.where(on_rank, topk_weights[:, None, :], jnp.float32(0.0))

  send_x = _scatter_to_slots(x, send_slot, per_rank=False)
  send_sf = None if x_sf is None else _scatter_to_slots(x_sf, send_slot, per_rank=False)
  send_ids = _scatter_to_slots(local_ids, send_slot, per_rank=True, int_fill=INVALID_EXPERT)
  send_w = _scatter_to_slots(local_w, send_slot, per_rank=True)
  send_counts = jnp.sum((send_slot >= 0).astype(jnp.int32), axis=0, dtype=jnp.int32)

  ax = st.axis_name
  result = DispatchResult(
      recv_x=_exchange(send_x, ax),
      recv_x_sf=None if send_sf is None else _exchange(send_sf, ax),
      recv_topk_ids=_exchange(send_ids, ax),
      recv_topk_weights=_exchange(send_w, ax),
      recv_counts=_exchange(send_counts, ax),
  )
  handle = DispatchHandle(send_slot=send_slot, recv_counts=result.recv_counts, axis_name=ax, num_ranks=num_ranks,
                          num_experts=st.num_experts)
  return (result, handle), (send_slot, topk_rank, result.recv_counts)


def _one_sided_dispatch_forward(st: _DispatchStatic, x, x_sf, topk_ids, topk_weights, after=None):
  """`_dispatch_forward` on the custom call (`one_sided.dispatch_call`); it starts after `after` is computed."""
  num_ranks = st.num_ranks
  recv_x, recv_sf, recv_ids, recv_w, recv_counts, send_slot = one_sided.dispatch_call(
      x, x_sf, topk_ids, topk_weights, axis_name=st.axis_name, num_ranks=num_ranks, num_experts=st.num_experts,
      workspace=st.workspace, after=after)
  valid = (topk_ids >= 0) & (topk_ids < st.num_experts)
  topk_rank = jnp.where(valid, topk_ids // (st.num_experts // num_ranks), INVALID_EXPERT).astype(jnp.int32)
  result = DispatchResult(recv_x=recv_x, recv_x_sf=None if x_sf is None else recv_sf, recv_topk_ids=recv_ids,
                          recv_topk_weights=recv_w, recv_counts=recv_counts)
  handle = DispatchHandle(send_slot=send_slot, recv_counts=recv_counts, axis_name=st.axis_name, num_ranks=num_ranks,
                          num_experts=st.num_experts, workspace=st.workspace, topk_ids=topk_ids)
  return (result, handle), (send_slot, topk_rank, result.recv_counts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dispatch(st, x, x_sf, topk_ids, topk_weights):
  return _dispatch_forward(st, x, x_sf, topk_ids, topk_weights)[0]


def rows_back_one_sided(ct_rows, send_slot, recv_counts, *, axis_name, workspace, out_dtype):
  """The received rows' cotangents summed back at their source tokens, one-sided: a combine over the dispatch's
  slots, summed in float32 and written in `out_dtype` (bfloat16 or float32; float32 for any other), the same sums
  and the same rounding as the reference exchange followed by a cast. Returns None where they take the reference
  exchange instead: no workspace, or rows the workspace's combine rows do not hold exactly
  (`Workspace.fits_combine_rows`). The one rule for both VJPs of a dispatch (`dispatch`'s and the wire's)."""
  if workspace is None or ct_rows is None or not workspace.fits_combine_rows(ct_rows):
    return None
  out_dtype = jnp.dtype(out_dtype) if jnp.dtype(out_dtype) in COMBINE_DTYPES else jnp.dtype(jnp.float32)
  with jax.named_scope("moe_dispatch"):  # the dispatch's backward (a VJP's own ops carry no caller scope)
    return one_sided.combine_call(ct_rows.astype(workspace.combine_dtype), send_slot, recv_counts,
                                  axis_name=axis_name, out_dtype=out_dtype, workspace=workspace)


def _dispatch_bwd(st: _DispatchStatic, res, cts):
  send_slot, topk_rank, recv_counts = res
  if st.workspace is not None:
    check_one_sided_backward("dispatch")
  ct_result, _ = cts  # the handle's arrays are integers: no cotangents
  ax = st.axis_name

  def back_to_source(ct, dtype):
    if ct is None or not jnp.issubdtype(dtype, jnp.floating):
      return None
    return _sum_from_slots(_exchange(ct, ax), send_slot).astype(dtype)

  dx = None
  if jnp.issubdtype(st.x_dtype, jnp.floating):
    dx = rows_back_one_sided(ct_result.recv_x, send_slot, recv_counts, axis_name=ax, workspace=st.workspace,
                             out_dtype=st.x_dtype)
  if dx is not None:
    dx = dx.astype(st.x_dtype)
    # The exchanges below follow the one-sided call by data: XLA:CPU would otherwise run them in any order, and a
    # device inside one waiting for a peer inside the other deadlocks.
    sf = ct_result.recv_x_sf
    ct_result = ct_result._replace(recv_x_sf=None if sf is None else ordering.after(sf, dx),
                                   recv_topk_weights=ordering.after(ct_result.recv_topk_weights, dx))
  else:
    dx = back_to_source(ct_result.recv_x, st.x_dtype)
  dx_sf = None if st.x_sf_dtype is None else back_to_source(ct_result.recv_x_sf, st.x_sf_dtype)

  # Weight k of token t landed at (rank of its expert, that rank's slot, k) and nowhere else.
  back_w = _exchange(ct_result.recv_topk_weights, ax).astype(jnp.float32)  # [R, T, top_k]
  rank = jnp.maximum(topk_rank, 0)
  slot = jnp.maximum(jnp.take_along_axis(send_slot, rank, axis=1), 0)
  k = jnp.broadcast_to(jnp.arange(topk_rank.shape[1], dtype=jnp.int32)[None, :], topk_rank.shape)
  dw = jnp.where(topk_rank >= 0, back_w[rank, slot, k], jnp.float32(0.0))
  return dx, dx_sf, None, dw


_dispatch.defvjp(_dispatch_forward, _dispatch_bwd)


def dispatch(x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, *, num_experts: int,
             axis_name: Hashable, x_sf: Optional[jax.Array] = None, workspace: Optional["Workspace"] = None,
             impl: str = "auto") -> tuple[DispatchResult, DispatchHandle]:
  """Sends each token once to every rank holding one of its valid top-k experts (per shard, in shard_map).

  Runs inside `jax.shard_map` over the expert axis `axis_name` of size ``num_ranks = R``; ``me`` is this
  shard's index. Expert e lives on rank ``e // L``, ``L = num_local_experts = num_experts // R``. Arrays below
  are this shard's blocks; ``T = num_tokens`` is static and is also the capacity of every receive buffer.

  Contract (bit for bit; the one-sided custom call must match it):

  - ``topk_ids[t, k]`` is valid iff ``0 <= topk_ids[t, k] < num_experts``; other ids route nowhere.
  - ``dest[t, r]``: t has at least one valid expert on rank r. The token is sent to r once, however many of
    its experts r holds.
  - ``send_slot[t, r]`` = number of ``t' < t`` with ``dest[t', r]`` if ``dest[t, r]``, else -1.
  - Rank r receives ``recv_x[s, send_slot_s[t, r]] = x_s[t]`` and likewise for x_sf, bits unchanged (floating
    rows travel as unsigned ints of their width, so NaN payloads and signed zeros survive);
    ``recv_topk_ids[s, j, k] = topk_ids_s[t, k] - r * L`` if expert ``topk_ids_s[t, k]`` is valid and on r,
    else `INVALID_EXPERT`; ``recv_topk_weights[s, j, k] = topk_weights_s[t, k]`` for those same k, else 0.0;
    ``recv_counts[s]`` = number of t with ``dest_s[t, r]``. Padding slots ``j >= recv_counts[s]`` hold all-zero
    bits in recv_x / recv_x_sf, -1 in recv_topk_ids and 0.0 in recv_topk_weights.

  Differentiable in x, x_sf (if floating) and topk_weights: the VJP returns each received cotangent row to its
  source slot and sums over ranks ``r = 0 .. R-1`` in order in float32 (as `combine` does), then casts to x's
  dtype; the weight cotangent of a valid k is the cotangent at (its expert's rank, slot, k), 0 for invalid k.
  topk_ids and non-floating payloads (e.g. packed NVFP4 uint8) get no gradient.

  Args:
    x: ``[num_tokens, *row]`` any dtype, sharded over `axis_name` on tokens: bf16 ``[T, hidden]``, E4M3
      ``[T, hidden]``, packed NVFP4 ``[T, hidden / 2] uint8``, ... The row is opaque data.
    topk_ids: ``[num_tokens, top_k] int32``, same sharding: global expert ids; invalid ids mean "no expert".
    topk_weights: ``[num_tokens, top_k] float32``, same sharding.
    num_experts: global expert count, a multiple of R.
    axis_name: the expert mesh axis.
    x_sf: optional ``[num_tokens, *sf_row]`` scales of x (float32 for blockwise FP8, one per 1x128 group;
      float8_e8m0fnu for MXFP8, one per 32; float8_e4m3fn for NVFP4, one per 16), same sharding; opaque data.
    workspace: the `Workspace` of the one-sided custom call (created once, outside jit, for this mesh axis).
    impl: "ffi" (the one-sided custom call jax_moe_a2a_dispatch; needs `workspace`), "reference" (the pure-JAX
      reference on `jax.lax.all_to_all`) or "auto" (ffi when a workspace is given and the extension has handlers for
      the backend). The handle remembers the choice for `combine`. A call of no tokens needs no exchange and
      takes the reference. With a workspace, the VJP returns x's row cotangents by the one-sided combine when the
      workspace's combine rows hold them exactly (``Workspace.fits_combine_rows``: same hidden, a multiple of 8, a
      dtype that casts into combine_dtype exactly, e.g. bf16 rows into float32 ones), else by the reference exchange;
      the cotangents of x_sf and of the weights always take the reference's.

  Returns:
    ``(result, handle)``: the `DispatchResult` this rank received (``[num_ranks, num_tokens, ...]`` per shard)
    and the `DispatchHandle` that `combine` needs.

  Raises:
    ValueError: at trace time, for wrong shapes or dtypes, num_experts not a positive multiple of R, or an
      unbound axis_name.
  """
  # Type and shape checks
  num_ranks = bound_axis_size("dispatch", axis_name)
  if getattr(topk_ids, "ndim", None) != 2 or topk_ids.dtype != jnp.int32:
    raise ValueError(f"dispatch: topk_ids must be a 2-D int32 array [num_tokens, top_k], got "
                     f"{describe_array(topk_ids)}")
  num_tokens, top_k = topk_ids.shape
  if getattr(topk_weights, "shape", None) != (num_tokens, top_k) or topk_weights.dtype != jnp.float32:
    raise ValueError(f"dispatch: topk_weights must be a float32 array of shape {(num_tokens, top_k)} (as "
                     f"topk_ids), got {describe_array(topk_weights)}")
  if getattr(x, "ndim", 0) < 1 or x.shape[0] != num_tokens:
    raise ValueError(f"dispatch: x must be an array [num_tokens={num_tokens}, ...] (num_tokens from topk_ids), "
                     f"got {describe_array(x)}")
  if x_sf is not None and (getattr(x_sf, "ndim", 0) < 1 or x_sf.shape[0] != num_tokens):
    raise ValueError(f"dispatch: x_sf must be None or an array [num_tokens={num_tokens}, ...] (num_tokens from "
                     f"topk_ids), got {describe_array(x_sf)}")
  if isinstance(num_experts, bool) or not isinstance(num_experts, (int, np.integer)) or num_experts <= 0 \
      or num_experts % num_ranks:
    raise ValueError(f"dispatch: num_experts must be a positive multiple of num_ranks={num_ranks} (the size of "
                     f"axis {axis_name!r}), got {num_experts!r}")

  use_ffi = one_sided.takes_one_sided("dispatch", impl, workspace)
  if use_ffi:
    workspace.check_dispatch(x, x_sf, top_k, num_ranks)
    # No tokens (on every rank alike: shapes are static): nothing to move; the reference gives the empty results and
    # zero counts without a custom call (XLA does not lower one whose operands are all empty inside shard_map).
    use_ffi = num_tokens > 0
  st = _DispatchStatic(axis_name=axis_name, num_ranks=num_ranks, num_experts=int(num_experts),
                       x_dtype=x.dtype, x_sf_dtype=None if x_sf is None else x_sf.dtype,
                       workspace=workspace if use_ffi else None)
  with jax.named_scope("moe_dispatch"):
    return _dispatch(st, x, x_sf, topk_ids, topk_weights)


# ----------------------------------------------------------------------------------------------------------------
# Combine
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _CombineStatic:
  axis_name: Hashable
  expert_dtype: Any
  out_dtype: Any
  num_experts: int
  workspace: Optional["Workspace"] = None


def _combine_forward(st: _CombineStatic, expert_out, send_slot, recv_counts, topk_ids):
  if st.workspace is not None:
    out = one_sided.combine_call(expert_out, send_slot, recv_counts, axis_name=st.axis_name, out_dtype=st.out_dtype,
                                 workspace=st.workspace)
    # One element of the result: the VJP waits for it (the one-sided call as its `after` operand, the reference exchange
    # by `after`), so it starts after this call on every device rather than as soon as its cotangent is known.
    return out, (send_slot, topk_ids, out.reshape(-1)[:1])
  back = _exchange(expert_out, st.axis_name)
  return _sum_from_slots(back, send_slot).astype(st.out_dtype), (send_slot, topk_ids, None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _combine(st, expert_out, send_slot, recv_counts, topk_ids):
  return _combine_forward(st, expert_out, send_slot, recv_counts, topk_ids)[0]


def _combine_bwd(st: _CombineStatic, res, ct_out):
  send_slot, topk_ids, forward_out = res
  if forward_out is not None:  # the forward was one-sided
    check_one_sided_backward("combine")
  ct = ct_out.astype(st.expert_dtype)
  ws = st.workspace
  if ws is not None and topk_ids is not None and ws.fits_dispatch_rows(ct):
    # A dispatch of the cotangent rows, one-sided: the kernels number the slots again from the same ids, so each
    # row lands where the exchange below puts it, and padding rows are zero.
    dispatch_st = _DispatchStatic(axis_name=st.axis_name, num_ranks=send_slot.shape[1], num_experts=st.num_experts,
                                  x_dtype=ct.dtype, x_sf_dtype=None, workspace=ws)
    (result, _), _ = _one_sided_dispatch_forward(dispatch_st, ct, None, topk_ids,
                                                 jnp.zeros_like(topk_ids, jnp.float32), after=forward_out)
    return result.recv_x, None, None, None
  if forward_out is not None:  # the forward was one-sided: the exchange follows it by data, as the call above does
    ct = ordering.after(ct, forward_out)
  return _exchange(_scatter_to_slots(ct, send_slot, per_rank=False), st.axis_name), None, None, None


_combine.defvjp(_combine_forward, _combine_bwd)


def combine(expert_out: jax.Array, handle: DispatchHandle, *, out_dtype: Any = None) -> jax.Array:
  """Returns the expert ranks' rows to their source tokens and sums them (per shard, in shard_map).

  The inverse movement of `dispatch`, with the routing of its `handle`. On the expert rank, row ``[s, j]`` of
  expert_out is that rank's whole contribution for source s's slot j: the weighted sum over its local experts
  (the expert stage applies the weights; combine does not). Padding rows are never read.

  Contract (bit for bit): with ``back[r]`` = float32 of the row rank r returns for ``send_slot[t, r]``,
  ``out[t] = (((-0.0 + back[r0]) + back[r1]) + ...)`` over the ranks ``r0 < r1 < ...`` with
  ``send_slot[t, r] >= 0``, accumulated in float32 in ascending rank order, then cast to out_dtype. A token
  sent nowhere gets +0.0.

  Differentiable in expert_out: the VJP dispatches ``ct_out[t]``, cast to expert_out's dtype, to every slot
  token t was sent to; padding rows get 0. With a workspace, that dispatch is the one-sided custom call (on the
  handle's ids) when a cotangent row fits the workspace's dispatch rows (``Workspace.fits_dispatch_rows``: e.g.
  bf16 expert rows on a bf16 wire, or any rows on a workspace created with ``training=True``), else the reference's
  exchange.

  Args:
    expert_out: ``[num_ranks, num_tokens, hidden]`` floating (bf16 or float32), per shard of `handle`'s axis,
      indexed like `DispatchResult.recv_x`.
    handle: the `DispatchHandle` of the matching `dispatch`.
    out_dtype: dtype of the result, floating; default expert_out's dtype.

  Returns:
    ``[num_tokens, hidden]`` out_dtype, sharded over the axis on tokens like dispatch's x.

  Raises:
    ValueError: at trace time, for a wrong handle, shape or dtype.
  """
  # Type and shape checks
  if not isinstance(handle, DispatchHandle):
    raise ValueError(f"combine: handle must be the DispatchHandle returned by dispatch, got {type(handle).__name__}")
  num_ranks = bound_axis_size("combine", handle.axis_name)
  if num_ranks != handle.num_ranks:
    raise ValueError(f"combine: axis {handle.axis_name!r} must have the size it had at dispatch, "
                     f"{handle.num_ranks}, got {num_ranks}")
  expected = (num_ranks, handle.num_tokens)
  if getattr(expert_out, "ndim", None) != 3 or expert_out.shape[:2] != expected \
      or not jnp.issubdtype(expert_out.dtype, jnp.floating):
    raise ValueError(f"combine: expert_out must be a floating array [num_ranks={expected[0]}, "
                     f"num_tokens={expected[1]}, hidden], got {describe_array(expert_out)}")
  out_dtype = expert_out.dtype if out_dtype is None else jnp.dtype(out_dtype)
  if not jnp.issubdtype(out_dtype, jnp.floating):
    raise ValueError(f"combine: out_dtype must be a floating dtype, got {out_dtype}")

  st = _CombineStatic(axis_name=handle.axis_name, expert_dtype=expert_out.dtype, out_dtype=out_dtype,
                      num_experts=handle.num_experts, workspace=handle.workspace)
  if handle.workspace is not None:
    handle.workspace.check_combine(expert_out, out_dtype, num_ranks)
  with jax.named_scope("moe_combine"):
    return _combine(st, expert_out, handle.send_slot, handle.recv_counts, handle.topk_ids)



# The two-level exchange lives in `two_level`; these names stay importable from here, where users found them.
_MOVED = {"dispatch_two_level": "two_level", "combine_two_level": "two_level", "TwoLevelHandle": "two_level"}


def __getattr__(name: str):
  if name in _MOVED:
    return getattr(importlib.import_module(f"jax_moe_a2a.{_MOVED[name]}"), name)
  raise AttributeError(f"module 'jax_moe_a2a.a2a' has no attribute {name!r}")
