"""Dispatch and combine over an expert axis of two levels, nodes x GPUs: a `dispatch` between nodes on XLA's
collectives, then one inside each node (one-sided with a workspace over the node's GPUs); combine in reverse."""

from __future__ import annotations

import dataclasses
from typing import Any, Hashable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe_a2a import ordering
from jax_moe_a2a.a2a import DispatchHandle, DispatchResult, bound_axis_size, combine, dispatch
from jax_moe_a2a.workspace import Workspace


@dataclasses.dataclass(frozen=True)
class TwoLevelHandle:
  """The routing of one `dispatch_two_level`, consumed by `combine_two_level`; a pytree.

  Attributes:
    node: the `DispatchHandle` of the exchange between nodes (over the node axis, the reference `all_to_all`).
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
     ``[n * G * L, (n + 1) * G * L)``), on the reference (`jax.lax.all_to_all`: NCCL on GPUs). A token crosses to
     node n at most once, to the GPU with its own local index, with its ids as node-local ids (``id - n * G * L``,
     `INVALID_EXPERT` for experts on other nodes) and its weights for those experts. Capacity: T per node pair.
  2. **Inside the node**: the ``N * T`` rows received (``[N, T]`` flattened, padding rows routing nowhere) are
     the tokens of `dispatch` over local_axis with ``G * L`` experts: one-sided with a workspace (created over
     local_axis for ``capacity >= N * T``), else the reference. A row goes to each GPU of the node once.

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
  num_nodes = bound_axis_size(op, node_axis)
  num_local = bound_axis_size(op, local_axis)
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
    x_in = ordering.after(x_in, node)
  local, local_handle = dispatch(x_in, rows(node.recv_topk_ids), rows(node.recv_topk_weights),
                                 num_experts=int(num_experts) // num_nodes, axis_name=local_axis,
                                 x_sf=rows(node.recv_x_sf), workspace=workspace, impl=impl)
  return local, TwoLevelHandle(node=node_handle, local=local_handle)


def combine_two_level(expert_out: jax.Array, handle: TwoLevelHandle, *, out_dtype: Any = None) -> jax.Array:
  """`combine` of a `dispatch_two_level`: inside the node first, then across nodes.

  Contract: the inner `combine` (one-sided with the handle's workspace) gives each node-received row its float32
  partial sum ``p[n]`` over the node's GPUs in ascending order; the partials cross back between nodes (the reference,
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
