"""The one-sided NVLink custom calls of dispatch and combine: their FFI binding.

`a2a` decides when a call runs one-sided (`takes_one_sided`) and builds its results; this module makes the calls:
their operands and attributes (the workspace's, `workspace.Workspace.attrs`), a call-site id that every device's
program shares, the check of the calling mesh when a call is lowered, and the shard_map axes the results vary over.
"""

from __future__ import annotations

import itertools
from typing import Any, Hashable, Optional

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax.interpreters import mlir

from jax_moe_a2a import _ffi
from jax_moe_a2a.workspace import Workspace, row_bytes


def takes_one_sided(op: str, impl: str, workspace: Optional[Workspace]) -> bool:
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


def _varying(outs, inputs: tuple[jax.Array, ...], axis_name: Hashable):
  """Custom-call results inside shard_map vary over the axes their inputs vary over, and the expert axis."""
  axes = set().union(*(_ffi.varying_axes(a) for a in inputs))
  axes.update(axis_name if isinstance(axis_name, tuple) else (axis_name,))
  return _ffi.vary_over(outs, axes)


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


def _mesh_check_lowering(ctx, after, *, workspace: Workspace, axis_name: Hashable, op: str):
  workspace.check_mesh(op, getattr(ctx.module_context.axis_context, "mesh", None), axis_name)
  return [after]


mlir.register_lowering(_mesh_check_p, _mesh_check_lowering)


def _checked_after(op: str, workspace: Workspace, axis_name: Hashable, after: Optional[jax.Array]) -> jax.Array:
  """The `after` operand of a call on `workspace`, with the check of the calling mesh attached."""
  after = _nothing_before() if after is None else after
  return _mesh_check_p.bind(after, workspace=workspace, axis_name=axis_name, op=op)


def dispatch_call(x, x_sf, topk_ids, topk_weights, *, axis_name: Hashable, num_ranks: int, num_experts: int,
                  workspace: Workspace, after: Optional[jax.Array] = None):
  """The dispatch custom call; it starts after `after` (an array it does not read) is computed.

  Returns (recv_x, recv_x_sf, recv_topk_ids, recv_topk_weights, recv_counts, send_slot); recv_x_sf is
  [num_ranks, T, 0] uint8 without x_sf.
  """
  num_tokens = x.shape[0]
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
  outs = _ffi.ffi_call("dispatch", out, x, sf, topk_ids, topk_weights,
                       _checked_after("dispatch", workspace, axis_name, after),
                       num_experts=np.int64(num_experts), site=_site(),
                       **workspace.attrs("dispatch", x_row_bytes=row_bytes(x), x_sf_row_bytes=row_bytes(sf)))
  return _varying(outs, (x, topk_ids), axis_name)


def combine_call(expert_out, send_slot, recv_counts, *, axis_name: Hashable, out_dtype: Any, workspace: Workspace):
  """The combine custom call: [T, hidden] out_dtype."""
  out = jax.ShapeDtypeStruct((send_slot.shape[0], expert_out.shape[-1]), out_dtype)
  # Not side-effecting: see dispatch_call.
  y = _ffi.ffi_call("combine", out, expert_out, recv_counts, send_slot,
                    _checked_after("combine", workspace, axis_name, None), site=_site(), **workspace.attrs("combine"))
  return _varying(y, (expert_out, send_slot), axis_name)
