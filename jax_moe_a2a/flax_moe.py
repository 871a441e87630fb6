"""Flax layers around `moe.moe_apply`: an NNX `MoE` and a Linen `LinenMoE`.

Both hold the parameters of `moe.init_params` (same names, shapes and shardings, see `moe.param_shapes` and
`moe.param_specs`) and delegate the computation to the functional core, so ``layer(x)`` is exactly
``moe.moe_apply(params, x, config, mesh)`` and returns ``(y, aux)``.

FP8 expert weights (``config.fp8_weights``) and their scales are inference weights: the NNX module stores them
as `FP8Weight` variables, not `nnx.Param`, so ``nnx.grad`` and optimizers over ``nnx.Param`` leave them alone.

Custom calls. The expert GEMMs follow ``config.impl`` (``"auto"``: the grouped-GEMM custom calls wherever the
extension has handlers). The exchange follows the layer's ``workspace`` argument:

- ``"auto"`` (default): the one-sided dispatch/combine custom calls on GPUs (when ``config.impl`` resolves to
  ``"ffi"``, the extension has its CUDA handlers and ``config.dtype`` is one they combine: bfloat16 or float32),
  the reference's collectives elsewhere; ``config.impl="ffi"`` takes the one-sided calls on any platform.
- ``"on"``: the one-sided calls on any platform that has handlers (CPU included); ``"off"`` (or None): the
  reference's collectives always.
- a `Workspace`: that one (it must fit every call: `moe.make_workspace`).

With ``"auto"``/``"on"`` the layer makes one workspace per (config, mesh, global token count) it is called with,
sized for training (`moe.make_workspace(..., training=True)`), when the call is traced, and keeps it for later
calls; `close_workspaces` frees them (also done at interpreter exit), and functions jitted before make new ones
when called again. Traced under the abstract mesh of ``jax.set_mesh`` (inside `jax.jit`), the layer makes its
workspace on the devices of that mesh (`moe.mesh_with_devices`).

Calling the NNX layer in a loop. ``layer(x)`` outside any jit is as fast as the function: `moe.moe_apply` is jitted
inside, and only its checks run in Python. A plain ``nnx.jit`` (Flax's graph mode with graph updates) returns the
new value of every Variable of its Module arguments, so its program writes a fresh copy of every parameter on every
call (bf16 experts, 32 per device at DeepSeek-V3's shape: 2.8 GB per device per call), and Python splits and merges
the graph around it. The calls that skip both:

- ``jax.jit`` over the layer's state: ``apply, state = jit_apply(layer)``, then ``y, aux = apply(state, x)``
  (the same bits as ``layer(x)``; differentiable in ``state``);
- Flax's tree mode, ``nnx.jit(f, graph=False)``, which returns only the Variables ``f`` changes.

``nnx.jit(f, graph_updates=False)`` or donating the layer (``donate_argnums``) avoids the copies but not the
Python work.
"""

from __future__ import annotations

import atexit
import functools
import math
from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx
from jax.sharding import Mesh

from jax_moe_a2a import _ffi, expert_mlp, moe
from jax_moe_a2a.workspace import COMBINE_DTYPES, Workspace

WORKSPACE_MODES = ("auto", "on", "off")
WorkspaceArg = Union[str, Workspace]

_workspaces: dict[tuple, Workspace] = {}


def _close_all() -> bool:
  """Closes the layers' workspaces; whether one was open."""
  was_open = any(not ws.closed for ws in _workspaces.values())
  for ws in _workspaces.values():
    ws.close()
  _workspaces.clear()
  return was_open


def close_workspaces() -> None:
  """Closes the workspaces the layers made (module docstring); later calls make new ones, functions jitted before
  included.

  A compiled function holds its workspace's id, which the custom calls look up when they run; so that one jitted
  before does not run on a closed workspace, this also clears JAX's caches of traced and compiled functions
  (`jax.clear_caches`): each function is traced again on its next call, its layers making a new workspace then.
  Every jitted function, of this library or not, is compiled again on its next call.
  """
  if _close_all():
    jax.clear_caches()


atexit.register(_close_all)  # at exit nothing is called again: no cache to clear


def _check_workspace_arg(op: str, workspace: Any) -> None:
  if not isinstance(workspace, Workspace) and workspace is not None and workspace not in WORKSPACE_MODES:
    raise ValueError(f"{op}: workspace must be one of {', '.join(map(repr, WORKSPACE_MODES))}, None (as 'off') or "
                     f"an a2a.Workspace, got {workspace!r}")


def _on_gpus(mesh: moe.AnyMesh) -> bool:
  """Whether the mesh's devices are GPUs."""
  if isinstance(mesh, Mesh):
    return all(d.platform == "gpu" for d in mesh.devices.flat)
  device = getattr(mesh, "abstract_device", None)  # an AbstractMesh made from a Mesh knows its devices' kind
  return (device.platform if device is not None else jax.default_backend()) == "gpu"


def _layer_workspace(op: str, workspace: WorkspaceArg, config: moe.MoEConfig, mesh: moe.AnyMesh,
                     x: jax.Array) -> Optional[Workspace]:
  """The workspace one call of a layer takes (module docstring), made and kept on first use."""
  if isinstance(workspace, Workspace):
    return workspace
  if workspace in (None, "off") or _ffi.resolve_impl("MoE", config.impl) != "ffi":
    return None
  if workspace == "auto" and config.impl != "ffi" and not (
      _ffi.with_cuda() and _on_gpus(mesh) and jnp.dtype(config.dtype) in COMBINE_DTYPES):
    return None
  abstract = mesh
  mesh = moe.mesh_with_devices(abstract)
  if mesh is None:
    raise ValueError(f"{op}: mesh must have devices to make the layer's workspace (workspace={workspace!r}), got the "
                     f"AbstractMesh {dict(abstract.shape)} with no jax.set_mesh of it; give the layer mesh=, a "
                     f"Workspace made outside jit (moe.make_workspace) or workspace='off'")
  num_tokens = math.prod(x.shape[:-1])
  key = (config, mesh, num_tokens)
  if key not in _workspaces or _workspaces[key].closed:
    _workspaces[key] = moe.make_workspace(config, mesh, num_tokens, training=True)
  return _workspaces[key]


def _apply(op: str, workspace: WorkspaceArg, config: moe.MoEConfig, mesh: moe.AnyMesh, params: dict[str, jax.Array],
           x: jax.Array, quantized_experts=None) -> tuple[jax.Array, dict[str, jax.Array]]:
  return moe.moe_apply(params, x, config, mesh, workspace=_layer_workspace(op, workspace, config, mesh, x),
                       quantized_experts=quantized_experts)


@functools.lru_cache(maxsize=64)
def _eager_apply(config: moe.MoEConfig, mesh: Mesh, workspace: WorkspaceArg):
  """`_apply` jitted, for an NNX layer called outside jit: `moe.moe_apply`'s checks and the workspace lookup then
  run when it is traced, not on every call."""
  return jax.jit(functools.partial(_apply, "MoE", workspace, config, mesh))


class FP8Weight(nnx.Variable):
  """An FP8 E4M3 expert weight or its FP32 128x128 block scales (not trained)."""


def _is_fp8_leaf(name: str, config: moe.MoEConfig) -> bool:
  return config.fp8_weights and name in ("w_gate_up", "w_down", "w_gate_up_sf", "w_down_sf")


class MoE(nnx.Module):
  """Expert-parallel MoE layer (NNX).

  Parameters are attributes named as the keys of `moe.param_shapes` (``router``, ``w_gate_up``, ``w_down``, ...),
  each an `nnx.Param` (or `FP8Weight`) carrying its sharding as ``out_sharding`` metadata with the mesh.

  Example::

    layer = MoE(config=config, mesh=mesh, rngs=nnx.Rngs(0))
    y, aux = layer(x)   # x [num_tokens, hidden], sharded P(config.token_axes, None)
    apply, state = jit_apply(layer)   # under jit in a loop (module docstring): y, aux = apply(state, x)
  """

  def __init__(self, *, config: moe.MoEConfig, rngs: nnx.Rngs, mesh: Optional[Mesh] = None,
               workspace: WorkspaceArg = "auto"):
    """Creates the parameters with `moe.init_params` on `mesh`.

    Args:
      config: the layer (a `moe.MoEConfig`).
      rngs: an `nnx.Rngs` with a ``params`` stream.
      mesh: the mesh the layer runs on; must hold every axis the config names. None: the mesh set with
        ``jax.set_mesh`` when the layer is created, also inside `nnx.jit`; there it is that mesh's `AbstractMesh`
        (`moe.resolve_mesh`), and the layer runs inside jit, or outside under ``jax.set_mesh`` of that mesh.
      workspace: ``"auto"``, ``"on"``, ``"off"``/None or a `Workspace`: how the exchange runs (module
        docstring).
    """
    if not isinstance(config, moe.MoEConfig):
      raise TypeError(f"MoE: config must be a moe.MoEConfig, got {type(config).__name__}")
    _check_workspace_arg("MoE", workspace)
    mesh = moe.resolve_mesh("MoE", mesh)
    self.config = config
    self.mesh = mesh
    self.workspace = workspace
    specs = moe.param_specs(config)
    values = moe.init_params(rngs.params(), config, mesh)
    self.param_names = tuple(values)
    for name, value in values.items():
      kind = FP8Weight if _is_fp8_leaf(name, config) else nnx.Param
      setattr(self, name, kind(value, out_sharding=tuple(specs[name]), mesh=mesh))

  def params(self) -> dict[str, jax.Array]:
    """The parameters as the dict `moe.moe_apply` takes."""
    return {name: getattr(self, name)[...] for name in self.param_names}

  def __call__(self, x: jax.Array, *, quantized_experts: Optional[expert_mlp.QuantizedWeights] = None
               ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`moe.moe_apply` on this layer's parameters.

    Args:
      x: [num_tokens, hidden] or [batch, seq, hidden] floating, sharded over ``config.token_axes`` on dim 0.
      quantized_experts: FP8 experts' weights quantized once per training step,
        ``moe.quantize_experts(layer.params(), layer.config, mesh)`` (see `moe.moe_apply`).

    Returns:
      y: x's shape and dtype; aux: ``{"load_balance_loss": [] float32, "expert_load": [num_experts] int32}``.
    """
    mesh = moe.resolve_mesh("MoE", self.mesh)
    params = self.params()
    if not any(isinstance(v, jax.core.Tracer) for v in (x, *params.values())):  # outside jit, grad, ...
      return _eager_apply(self.config, mesh, self.workspace)(params, x, quantized_experts)
    return _apply("MoE", self.workspace, self.config, mesh, params, x, quantized_experts)


def jit_apply(layer: MoE) -> tuple[Callable[[nnx.State, jax.Array], tuple[jax.Array, dict[str, jax.Array]]],
                                    nnx.State]:
  """The NNX layer as a jitted pure function of its state, for calling it in a loop (module docstring).

  ``apply, state = jit_apply(layer)``; then ``apply(state, x)`` returns ``layer(x)``'s ``(y, aux)``, bit for bit,
  at the cost of one `jax.jit` call: the layer's structure is split off once here, and ``apply`` rebuilds the layer
  from ``state`` only while it is traced. ``state`` is a snapshot (``nnx.state(layer)``): take it again after the
  layer's parameters change (``nnx.update``, an optimizer step). ``apply`` may be differentiated in ``state``
  (``jax.grad``) and called inside other jitted functions.

  Raises:
    TypeError: layer is not a `MoE`.
  """
  if not isinstance(layer, MoE):
    raise TypeError(f"jit_apply: layer must be a flax_moe.MoE, got {type(layer).__name__}")
  graphdef, state = nnx.split(layer)

  # The graphdef is closed over, not a static argument: as one it would be hashed on every call (the config, the
  # mesh and every Variable's metadata), Python work that this function exists to leave out.
  @jax.jit
  def apply(state: nnx.State, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    return nnx.merge(graphdef, state)(x)

  return apply, state


class LinenMoE(nn.Module):
  """Expert-parallel MoE layer (Linen).

  Parameters live in the ``params`` collection under the keys of `moe.param_shapes`, boxed in `nn.Partitioned`
  with their `moe.param_specs` and the mesh; they are drawn by `moe.init_params` from one ``params`` key, so an
  FP8 weight and its scales always belong together.

  Attributes:
    config: the layer (a `moe.MoEConfig`).
    mesh: the mesh the layer runs on; None: the mesh set with ``jax.set_mesh`` when the layer is called, also
      inside `jax.jit` (there its `AbstractMesh`, which the parameters' boxes then hold).
    workspace: ``"auto"``, ``"on"``, ``"off"``/None or a `Workspace`: how the exchange runs (module
      docstring).
  """

  config: moe.MoEConfig
  mesh: Optional[Mesh] = None
  workspace: Any = "auto"

  @nn.compact
  def __call__(self, x: jax.Array, *, quantized_experts: Optional[expert_mlp.QuantizedWeights] = None
               ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`moe.moe_apply` on this layer's parameters; x, quantized_experts and the results as for the NNX `MoE`."""
    if not isinstance(self.config, moe.MoEConfig):
      raise TypeError(f"LinenMoE: config must be a moe.MoEConfig, got {type(self.config).__name__}")
    _check_workspace_arg("LinenMoE", self.workspace)
    mesh = moe.resolve_mesh("LinenMoE", self.mesh)
    specs = moe.param_specs(self.config)
    shapes = moe.param_shapes(self.config)
    values: Optional[dict[str, Any]] = None
    if self.is_initializing():
      values = moe.init_params(self.make_rng("params"), self.config, mesh)

    def init(_, name):
      # Outside init, Linen still evaluates the initializer abstractly to check the stored shape.
      return values[name] if values is not None else jnp.zeros(shapes[name].shape, shapes[name].dtype)

    params = {}
    for name, spec in specs.items():
      params[name] = self.param(name, nn.with_partitioning(init, tuple(spec), mesh=mesh), name)
    return moe.moe_apply(params, x, self.config, mesh,
                         workspace=_layer_workspace("LinenMoE", self.workspace, self.config, mesh, x),
                         quantized_experts=quantized_experts)
