"""Expert-parallel dispatch and combine: the pure-JAX reference.

`dispatch` sends each token to every rank that holds at least one of its top-k experts; `combine` brings the
expert ranks' results back and sums them per token. Both run per shard inside `jax.shard_map`, over one mesh
axis (the expert axis) of size ``num_ranks``; ``me`` is this shard's index on it. `wire_dispatch` is the layer's
dispatch: encode to the wire format, dispatch, decode, with a straight-through gradient. How the cotangents of a
dispatch travel back (one-sided or the twin's exchange) is decided in one place, `_rows_back_one_sided`, for both
VJPs. `dispatch_two_level` and `combine_two_level` run over an expert axis of nodes x GPUs: a `dispatch` between
nodes on XLA's collectives, then one inside each node (one-sided with a workspace); combine in reverse.

These functions are the exact twin of the one-sided NVLink custom call: the custom call must reproduce every
output below bit for bit. The contract (docs/DESIGN.md §3), per shard, with ``T = num_tokens`` (static), ``R =
num_ranks``, ``L = num_local_experts = num_experts // R`` and global expert ``e`` living on rank ``e // L``:

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
import itertools
from typing import Any, Hashable, NamedTuple, Optional

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax.interpreters import mlir

from jax_moe_a2a import _ffi, layout, quant, routing
from jax_moe_a2a.layout import INVALID_EXPERT
from jax_moe_a2a.ordering import after  # noqa: F401  (public here too: a2a.after)
# Workspace: public here too (a2a.Workspace)
from jax_moe_a2a.workspace import COMBINE_DTYPES, Workspace, _describe, _row_bytes, check_one_sided_backward

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


def _axis_size(op: str, axis_name: Hashable) -> int:
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


def _route(topk_ids: jax.Array, num_experts: int, num_ranks: int) -> tuple[jax.Array, jax.Array]:
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
    return _ffi_dispatch_forward(st, x, x_sf, topk_ids, topk_weights)
  num_ranks = st.num_ranks
  topk_rank, send_slot = _route(topk_ids, st.num_experts, num_ranks)
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dispatch(st, x, x_sf, topk_ids, topk_weights):
  return _dispatch_forward(st, x, x_sf, topk_ids, topk_weights)[0]


def _rows_back_one_sided(ct_rows, send_slot, recv_counts, *, axis_name, num_experts, workspace, out_dtype):
  """The received rows' cotangents summed back at their source tokens, one-sided: a combine over the dispatch's
  slots, summed in float32 and written in `out_dtype` (bfloat16 or float32; float32 for any other), the same sums
  and the same rounding as the twin's exchange followed by a cast. Returns None where they take the twin's
  exchange instead: no workspace, or rows the workspace's combine rows do not hold exactly
  (`Workspace.fits_combine_rows`). The one rule for both VJPs of a dispatch (`dispatch`'s and the wire's)."""
  if workspace is None or ct_rows is None or not workspace.fits_combine_rows(ct_rows):
    return None
  out_dtype = jnp.dtype(out_dtype) if jnp.dtype(out_dtype) in COMBINE_DTYPES else jnp.dtype(jnp.float32)
  st = _CombineStatic(axis_name=axis_name, expert_dtype=workspace.combine_dtype,
                      out_dtype=out_dtype, num_experts=num_experts, workspace=workspace)
  with jax.named_scope("moe_dispatch"):  # the dispatch's backward (a VJP's own ops carry no caller scope)
    return _ffi_combine(st, ct_rows.astype(workspace.combine_dtype), send_slot, recv_counts)


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
    dx = _rows_back_one_sided(ct_result.recv_x, send_slot, recv_counts, axis_name=ax, num_experts=st.num_experts,
                              workspace=st.workspace, out_dtype=st.x_dtype)
  if dx is not None:
    dx = dx.astype(st.x_dtype)
    # The exchanges below follow the one-sided call by data: XLA:CPU would otherwise run them in any order, and a
    # device inside one waiting for a peer inside the other deadlocks.
    ct_result = ct_result._replace(recv_x_sf=None if ct_result.recv_x_sf is None else after(ct_result.recv_x_sf, dx),
                                   recv_topk_weights=after(ct_result.recv_topk_weights, dx))
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
      twin on `jax.lax.all_to_all`) or "auto" (ffi when a workspace is given and the extension has handlers for
      the backend). The handle remembers the choice for `combine`. A call of no tokens needs no exchange and
      takes the twin. With a workspace, the VJP returns x's row cotangents by the one-sided combine when the
      workspace's combine rows hold them exactly (``Workspace.fits_combine_rows``: same hidden, a multiple of 8, a
      dtype that casts into combine_dtype exactly, e.g. bf16 rows into float32 ones), else by the twin's exchange;
      the cotangents of x_sf and of the weights always take the twin's.

  Returns:
    ``(result, handle)``: the `DispatchResult` this rank received (``[num_ranks, num_tokens, ...]`` per shard)
    and the `DispatchHandle` that `combine` needs.

  Raises:
    ValueError: at trace time, for wrong shapes or dtypes, num_experts not a positive multiple of R, or an
      unbound axis_name.
  """
  # Type and shape checks
  num_ranks = _axis_size("dispatch", axis_name)
  if getattr(topk_ids, "ndim", None) != 2 or topk_ids.dtype != jnp.int32:
    raise ValueError(f"dispatch: topk_ids must be a 2-D int32 array [num_tokens, top_k], got "
                     f"{_describe(topk_ids)}")
  num_tokens, top_k = topk_ids.shape
  if getattr(topk_weights, "shape", None) != (num_tokens, top_k) or topk_weights.dtype != jnp.float32:
    raise ValueError(f"dispatch: topk_weights must be a float32 array of shape {(num_tokens, top_k)} (as "
                     f"topk_ids), got {_describe(topk_weights)}")
  if getattr(x, "ndim", 0) < 1 or x.shape[0] != num_tokens:
    raise ValueError(f"dispatch: x must be an array [num_tokens={num_tokens}, ...] (num_tokens from topk_ids), "
                     f"got {_describe(x)}")
  if x_sf is not None and (getattr(x_sf, "ndim", 0) < 1 or x_sf.shape[0] != num_tokens):
    raise ValueError(f"dispatch: x_sf must be None or an array [num_tokens={num_tokens}, ...] (num_tokens from "
                     f"topk_ids), got {_describe(x_sf)}")
  if isinstance(num_experts, bool) or not isinstance(num_experts, (int, np.integer)) or num_experts <= 0 \
      or num_experts % num_ranks:
    raise ValueError(f"dispatch: num_experts must be a positive multiple of num_ranks={num_ranks} (the size of "
                     f"axis {axis_name!r}), got {num_experts!r}")

  use_ffi = _resolve_a2a_impl("dispatch", impl, workspace)
  if use_ffi:
    workspace.check_dispatch(x, x_sf, top_k, num_ranks)
    # No tokens (on every rank alike: shapes are static): nothing to move; the twin gives the empty results and
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
    out = _ffi_combine(st, expert_out, send_slot, recv_counts)
    # One element of the result: the VJP waits for it (the one-sided call as its `after` operand, the twin's exchange
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
    (result, _), _ = _ffi_dispatch_forward(dispatch_st, ct, None, topk_ids, jnp.zeros_like(topk_ids, jnp.float32),
                                           after=forward_out)
    return result.recv_x, None, None, None
  if forward_out is not None:  # the forward was one-sided: the exchange follows it by data, as the call above does
    ct = after(ct, forward_out)
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
  bf16 expert rows on a bf16 wire, or any rows on a workspace created with ``training=True``), else the twin's
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
  num_ranks = _axis_size("combine", handle.axis_name)
  if num_ranks != handle.num_ranks:
    raise ValueError(f"combine: axis {handle.axis_name!r} must have the size it had at dispatch, "
                     f"{handle.num_ranks}, got {num_ranks}")
  expected = (num_ranks, handle.num_tokens)
  if getattr(expert_out, "ndim", None) != 3 or expert_out.shape[:2] != expected \
      or not jnp.issubdtype(expert_out.dtype, jnp.floating):
    raise ValueError(f"combine: expert_out must be a floating array [num_ranks={expected[0]}, "
                     f"num_tokens={expected[1]}, hidden], got {_describe(expert_out)}")
  out_dtype = expert_out.dtype if out_dtype is None else jnp.dtype(out_dtype)
  if not jnp.issubdtype(out_dtype, jnp.floating):
    raise ValueError(f"combine: out_dtype must be a floating dtype, got {out_dtype}")

  st = _CombineStatic(axis_name=handle.axis_name, expert_dtype=expert_out.dtype, out_dtype=out_dtype,
                      num_experts=handle.num_experts, workspace=handle.workspace)
  if handle.workspace is not None:
    handle.workspace.check_combine(expert_out, out_dtype, num_ranks)
  with jax.named_scope("moe_combine"):
    return _combine(st, expert_out, handle.send_slot, handle.recv_counts, handle.topk_ids)


# ----------------------------------------------------------------------------------------------------------------
# Two levels: across nodes, then inside a node
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TwoLevelHandle:
  """The routing of one `dispatch_two_level`, consumed by `combine_two_level`; a pytree.

  Attributes:
    node: the `DispatchHandle` of the exchange between nodes (over the node axis, the twin's `all_to_all`).
    local: the `DispatchHandle` of the dispatch inside the node (over the local axis; one-sided with a workspace).
  """

  node: DispatchHandle
  local: DispatchHandle

  @property
  def num_tokens(self) -> int:
    return self.node.num_tokens


jax.tree_util.register_dataclass(TwoLevelHandle, data_fields=["node", "local"], meta_fields=[])


def dispatch_two_level(x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, *, num_experts: int,
                       node_axis: Hashable, local_axis: Hashable, x_sf: Optional[jax.Array] = None,
                       workspace: Optional[Workspace] = None,
                       impl: str = "auto") -> tuple[DispatchResult, TwoLevelHandle]:
  """`dispatch` over an expert axis of two levels: ``N`` nodes (``node_axis``) of ``G`` GPUs (``local_axis``).

  Rank ``(n, g)`` (flat rank ``n * G + g``, as `dispatch` over ``(node_axis, local_axis)`` numbers them) holds
  experts ``[(n * G + g) * L, (n * G + g + 1) * L)``, ``L = num_experts / (N * G)``; node n holds ``G * L``
  of them. Two dispatches, each with the contract of `dispatch`:

  1. **Between nodes**: `dispatch` over node_axis with ``num_experts`` (node n as the "rank" of experts
     ``[n * G * L, (n + 1) * G * L)``), on the twin (`jax.lax.all_to_all`: NCCL on GPUs). A token crosses to
     node n at most once, to the GPU with its own local index, with its ids as node-local ids (``id - n * G * L``,
     `INVALID_EXPERT` for experts on other nodes) and its weights for those experts. Capacity: T per node pair.
  2. **Inside the node**: the ``N * T`` rows received (``[N, T]`` flattened, padding rows routing nowhere) are
     the tokens of `dispatch` over local_axis with ``G * L`` experts: one-sided with a workspace (created over
     local_axis for ``capacity >= N * T``), else the twin. A row goes to each GPU of the node once.

  Each (token, expert) assignment therefore arrives at the rank `dispatch` over the flat axis sends it to, with
  the same row bits, local id and weight, in a different slot: received ``[s, j]`` is local source GPU s's slot
  j of its ``N * T`` node-received rows. The node level's collectives all finish before the local call starts
  (ordered by data, see `Workspace`).

  Differentiable as `dispatch` is (the VJPs of the two levels, composed).

  Args:
    x, topk_ids, topk_weights, x_sf: as for `dispatch`, sharded over both axes on tokens.
    num_experts: global expert count, a multiple of ``N * G``.
    node_axis: the outer (node) mesh axis.
    local_axis: the inner mesh axis, the GPUs of one node.
    workspace: a `Workspace` over local_axis (one expert group per node) for the inner dispatch, or None.
    impl: for the inner dispatch, as in `dispatch`.

  Returns:
    ``(result, handle)``: the `DispatchResult` of the inner dispatch (``[G, N * T, ...]`` per shard) and the
    `TwoLevelHandle` that `combine_two_level` needs.

  Raises:
    ValueError: at trace time, as `dispatch`, and for num_experts not a multiple of ``N * G`` or a workspace over
      another axis than local_axis.
  """
  op = "dispatch_two_level"
  num_nodes = _axis_size(op, node_axis)
  num_local = _axis_size(op, local_axis)
  if node_axis == local_axis:
    raise ValueError(f"{op}: node_axis and local_axis must be two mesh axes, got {node_axis!r} for both")
  if isinstance(num_experts, bool) or not isinstance(num_experts, (int, np.integer)) or num_experts <= 0 \
      or num_experts % (num_nodes * num_local):
    raise ValueError(f"{op}: num_experts must be a positive multiple of {num_nodes * num_local} (the sizes of "
                     f"{node_axis!r} x {local_axis!r}), got {num_experts!r}")
  if isinstance(workspace, Workspace) and workspace.expert_axis != local_axis:
    raise ValueError(f"{op}: workspace must be created over local_axis {local_axis!r} (one expert group per node), "
                     f"got a workspace over {workspace.expert_axis!r}")
  node, node_handle = dispatch(x, topk_ids, topk_weights, num_experts=num_experts, axis_name=node_axis, x_sf=x_sf,
                               impl="reference")
  rows = lambda a: None if a is None else a.reshape((-1,) + a.shape[2:])  # [N, T, ...] -> [N * T, ...]
  x_in = rows(node.recv_x)
  if workspace is not None:
    x_in = after(x_in, node)
  local, local_handle = dispatch(x_in, rows(node.recv_topk_ids), rows(node.recv_topk_weights),
                                 num_experts=int(num_experts) // num_nodes, axis_name=local_axis,
                                 x_sf=rows(node.recv_x_sf), workspace=workspace, impl=impl)
  return local, TwoLevelHandle(node=node_handle, local=local_handle)


def combine_two_level(expert_out: jax.Array, handle: TwoLevelHandle, *, out_dtype: Any = None) -> jax.Array:
  """`combine` of a `dispatch_two_level`: inside the node first, then across nodes.

  Contract: the inner `combine` (one-sided with the handle's workspace) gives each node-received row its float32
  partial sum ``p[n]`` over the node's GPUs in ascending order; the partials cross back between nodes (the twin,
  float32 rows) and token t gets ``out[t] = ((-0.0 + p[n0]) + p[n1]) + ...`` over the nodes ``n0 < n1 < ...`` it
  was sent to, in float32, cast to out_dtype. Against `combine` over the flat axis this only regroups the same
  float32 additions by node: bit for bit the same where a token's experts of each node sit on one GPU (a single
  node, or one GPU per node, in particular), else within float32 rounding.

  Differentiable in expert_out (the VJPs of the two levels, composed).

  Args:
    expert_out: ``[G, N * T, hidden]`` floating, indexed like `dispatch_two_level`'s received rows.
    handle: the `TwoLevelHandle` of the matching `dispatch_two_level`.
    out_dtype: dtype of the result, floating; default expert_out's dtype.

  Returns:
    ``[T, hidden]`` out_dtype.
  """
  if not isinstance(handle, TwoLevelHandle):
    raise ValueError(f"combine_two_level: handle must be the TwoLevelHandle returned by dispatch_two_level, got "
                     f"{type(handle).__name__}")
  out_dtype = getattr(expert_out, "dtype", None) if out_dtype is None else out_dtype
  partial = combine(expert_out, handle.local, out_dtype=jnp.float32)  # [N * T, hidden]
  num_nodes, num_tokens = handle.node.num_ranks, handle.node.num_tokens
  return combine(partial.reshape((num_nodes, num_tokens) + partial.shape[1:]), handle.node, out_dtype=out_dtype)


# ----------------------------------------------------------------------------------------------------------------
# The wire: encode, dispatch, decode (straight-through gradient)
# ----------------------------------------------------------------------------------------------------------------

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
  rows = _rows_back_one_sided(ct_rows, handle.send_slot, handle.recv_counts, axis_name=handle.axis_name,
                              num_experts=handle.num_experts, workspace=handle.workspace, out_dtype=rows_dtype)
  if rows is not None:
    # The weights' cotangents (top_k floats per row) take the reference path, after the rows by data (XLA:CPU
    # would otherwise run the two in any order, and a device inside the all_to_all waiting for a peer inside the
    # one-sided call deadlocks). Column for column the same float32 sums as the single payload below.
    return rows, combine(after(ct_w, rows), reference, out_dtype=jnp.float32)
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
    workspace: the `Workspace` of the one-sided custom calls (None: the all_to_all twin); with two_level, one
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


# ----------------------------------------------------------------------------------------------------------------
# One-sided custom calls: the FFI path (the memory they use is `workspace.Workspace`)
# ----------------------------------------------------------------------------------------------------------------


def _resolve_a2a_impl(op: str, impl: str, workspace: Optional[Workspace]) -> bool:
  """Whether `op` takes the one-sided custom call."""
  if impl == "reference":
    return False
  if workspace is None:
    if impl == "ffi":
      raise ValueError(f"{op}: impl='ffi' needs a workspace (a2a.Workspace(mesh, expert_axis=..., ...)), got None")
    _ffi.resolve_impl(op, impl)  # validates impl and the environment override
    return False
  if not isinstance(workspace, Workspace):
    raise ValueError(f"{op}: workspace must be an a2a.Workspace, got {type(workspace).__name__}")
  return _ffi.resolve_impl(op, impl) == "ffi"


def _varying_axes(a: jax.Array) -> set:
  """The shard_map axes `a` varies over (empty outside shard_map)."""
  manual = getattr(jax.typeof(a), "manual_axis_type", None)
  return set(manual.varying) if manual is not None else set()


def _varying(outs, inputs: tuple[jax.Array, ...], axis_name: Hashable):
  """Custom-call results inside shard_map vary over the axes their inputs vary over, and the expert axis."""
  axes = set().union(*(_varying_axes(a) for a in inputs))
  axes.update(axis_name if isinstance(axis_name, tuple) else (axis_name,))
  axes = tuple(sorted(axes, key=str))
  return jax.tree.map(lambda y: jax.lax.pcast(y, axes, to="varying") if set(axes) - _varying_axes(y) else y, outs)


_sites = itertools.count(1)


def _site() -> np.int64:
  """A new call-site id (the `site` attribute): every device's program holds the same one, so the simulated CPU
  devices meet per call, whatever order XLA:CPU runs a device's independent calls in."""
  return np.int64(next(_sites))


def _nothing_before() -> jax.Array:
  """The `after` operand of a call that need not follow another one."""
  return jnp.zeros((1,), jnp.uint8)


# Workspace.check_mesh of a call's mesh, run when the call is lowered: inside shard_map, tracing sees the mesh's axis
# names and sizes but not its devices; the lowering context holds the mesh itself. An identity on the call's `after`
# operand, so it lives exactly as long as the call does.
_mesh_check_p = jax.extend.core.Primitive("jax_moe_a2a_mesh_check")
_mesh_check_p.def_impl(lambda after, **_: after)
_mesh_check_p.def_abstract_eval(lambda after, **_: after)


def _mesh_check_lowering(ctx, after, *, workspace: "Workspace", axis_name: Hashable, op: str):
  workspace.check_mesh(op, getattr(ctx.module_context.axis_context, "mesh", None), axis_name)
  return [after]


mlir.register_lowering(_mesh_check_p, _mesh_check_lowering)


def _checked_after(op: str, st: Any, after: Optional[jax.Array]) -> jax.Array:
  """The `after` operand of a call on ``st.workspace``, with the check of the calling mesh attached."""
  after = _nothing_before() if after is None else after
  return _mesh_check_p.bind(after, workspace=st.workspace, axis_name=st.axis_name, op=op)


def _ffi_dispatch_forward(st: _DispatchStatic, x, x_sf, topk_ids, topk_weights, after=None):
  """The custom call; it starts after `after` (an array it does not read) is computed."""
  num_ranks, num_tokens = st.num_ranks, x.shape[0]
  top_k = topk_ids.shape[1]
  sf = jnp.zeros((num_tokens, 0), jnp.uint8) if x_sf is None else x_sf
  out = (jax.ShapeDtypeStruct((num_ranks,) + x.shape, x.dtype),
         jax.ShapeDtypeStruct((num_ranks,) + sf.shape, sf.dtype),
         jax.ShapeDtypeStruct((num_ranks, num_tokens, top_k), jnp.int32),
         jax.ShapeDtypeStruct((num_ranks, num_tokens, top_k), jnp.float32),
         jax.ShapeDtypeStruct((num_ranks,), jnp.int32),
         jax.ShapeDtypeStruct((num_tokens, num_ranks), jnp.int32))
  # Not declared side-effecting: every rank runs the same compiled program, so dead-code elimination and CSE treat
  # all ranks alike and their calls stay matched; an effect would also take every jitted call off JAX's C++
  # dispatch path (measured: ~80 us of host time per call, more than the whole call takes on the GPUs).
  outs = _ffi.ffi_call("dispatch", out, x, sf, topk_ids, topk_weights, _checked_after("dispatch", st, after),
                       num_experts=np.int64(st.num_experts), site=_site(),
                       **st.workspace.attrs("dispatch", x_row_bytes=_row_bytes(x), x_sf_row_bytes=_row_bytes(sf)))
  recv_x, recv_sf, recv_ids, recv_w, recv_counts, send_slot = _varying(outs, (x, topk_ids), st.axis_name)
  valid = (topk_ids >= 0) & (topk_ids < st.num_experts)
  topk_rank = jnp.where(valid, topk_ids // (st.num_experts // num_ranks), INVALID_EXPERT).astype(jnp.int32)
  result = DispatchResult(recv_x=recv_x, recv_x_sf=None if x_sf is None else recv_sf, recv_topk_ids=recv_ids,
                          recv_topk_weights=recv_w, recv_counts=recv_counts)
  handle = DispatchHandle(send_slot=send_slot, recv_counts=recv_counts, axis_name=st.axis_name, num_ranks=num_ranks,
                          num_experts=st.num_experts, workspace=st.workspace, topk_ids=topk_ids)
  return (result, handle), (send_slot, topk_rank, result.recv_counts)


def _ffi_combine(st: _CombineStatic, expert_out, send_slot, recv_counts):
  out = jax.ShapeDtypeStruct((send_slot.shape[0], expert_out.shape[-1]), st.out_dtype)
  # Not side-effecting: see _ffi_dispatch_forward.
  y = _ffi.ffi_call("combine", out, expert_out, recv_counts, send_slot, _checked_after("combine", st, None),
                    site=_site(),
                    **st.workspace.attrs("combine"))
  return _varying(y, (expert_out, send_slot), st.axis_name)
