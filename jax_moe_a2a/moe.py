"""The expert-parallel MoE layer: `moe_apply(params, x, config, mesh)` under `jax.shard_map`, and its oracle.

Per shard, in order (each stage under its own `jax.named_scope`):

1. ``sequence_parallel_slice`` (sequence parallelism only): tokens arrive replicated over `tp_axis` (as after
   tensor-parallel attention); tp rank i keeps rows ``[i * T / tp, (i + 1) * T / tp)`` of its T local tokens, so
   no rank routes or computes a replicated token twice (docs/DESIGN.md §1.4).
2. ``router``: float32 logits ``x @ router`` and `routing.route` (softmax top-k or DeepSeek-V3 grouped sigmoid).
3. ``aux``: the load-balance loss and the per-expert load, summed over every axis that holds distinct tokens.
4. ``wire`` (`wire.wire_dispatch`): the activations are encoded in the wire format (bf16; E4M3 with one FP32 scale
   per 1x128 group; MXFP8; NVFP4 with the exchange's global scale), dispatched over `expert_axis` with
   `a2a.dispatch`, and decoded to the compute dtype at the receiver (FP8 experts on the fp8_blockwise wire compute
   from the received codes themselves; the decoded rows carry the gradient).
5. ``experts``: `experts.expert_stage` with this rank's experts (permute, grouped SwiGLU, weighted un-permute).
6. ``moe_combine``: `a2a.combine` sums each token's weighted expert outputs in float32 (rounded once, to x's
   dtype when no shared experts follow).
7. ``shared_experts``: the shared experts, run on the same (sliced) tokens and added.
8. ``sequence_parallel_gather``: the slices are all-gathered over `tp_axis`.

Tensors the backward pass reads carry `jax.ad_checkpoint.checkpoint_name`s, so a remat policy (e.g.
``jax.checkpoint_policies.save_only_these_names``) can keep or recompute them: ``router_logits`` (float32
[T, num_experts]), ``dispatched_rows`` (the decoded received rows), ``expert_gate_up`` (the gate/up GEMM output,
bf16 and FP8 experts) and ``expert_rows`` (the rows sorted by expert, float32 and float16 experts on XLA's
matmuls; the grouped-GEMM experts keep the received rows once and expand them again in the backward pass).

The mesh is an argument of `init_params`, `make_workspace` and `moe_apply`, or, when left out, the one set with
``jax.set_mesh``; `init_params` and `moe_apply` take it from there also while tracing (inside `jax.jit`, `jax.grad`),
as its `AbstractMesh` (`resolve_mesh`).

Without sequence parallelism every tp rank routes and dispatches its full replicated copy of the tokens: the
baseline that sequence parallelism must equal up to float rounding.

Experts live contiguously on the ranks of `expert_axis` (one mesh axis or a tuple of them, linearized row-major
in the order given): expert e is local expert ``e % L`` of rank ``e // L``, ``L = num_experts / num_ranks``.

The wire's gradient is straight-through: the backward pass sends the float32 cotangent of the received rows
back with `a2a.combine` over the dispatch's own slots (the VJP of a dispatch is a combine), so no quantization
error enters the gradient and no dispatch is recomputed.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, Optional, Sequence, Union

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax._src import dispatch as jax_dispatch
from jax._src import mesh as jax_mesh
from jax.ad_checkpoint import checkpoint_name
from jax.interpreters import ad, batching, mlir
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec as P

from jax_moe_a2a import _ffi, a2a, expert_mlp, experts, layout, ordering, quant, routing, wire
from jax_moe_a2a.two_level import combine_two_level
from jax_moe_a2a.workspace import COMBINE_DTYPES, Workspace, groups_span_domains

# Mesh axis names of the default layout: tokens over (data, expert), experts over expert.
DATA_AXIS = "data"
EXPERT_AXIS = "expert"
TP_AXIS = "tp"

WIRE_FORMATS = wire.WIRE_FORMATS
_COMPUTE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))

AxisNames = Union[str, tuple[str, ...]]
# A concrete mesh, or while tracing the abstract one of jax.set_mesh (axis names, sizes and types, no devices).
AnyMesh = Union[Mesh, AbstractMesh]

# ----------------------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------------------


def _is_int(v: Any) -> bool:
  return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _axes_tuple(op: str, name: str, v: Any, *, allow_empty: bool) -> tuple[str, ...]:
  axes = (v,) if isinstance(v, str) else v
  if not isinstance(axes, tuple) or not all(isinstance(a, str) and a for a in axes) \
      or (not axes and not allow_empty):
    what = "a mesh axis name or a tuple of them" + ("" if allow_empty else " (at least one)")
    raise ValueError(f"{op}: {name} must be {what}, got {v!r}")
  if len(set(axes)) != len(axes):
    raise ValueError(f"{op}: {name} must not repeat an axis, got {axes}")
  return axes


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """A MoE layer; frozen and hashable, so it is a static argument.

  Attributes:
    num_experts: routed experts in the layer.
    top_k: experts per token, ``1 <= top_k <= num_experts``.
    hidden: model width H (a multiple of the wire format's block: 128 for fp8_blockwise, 32 for mxfp8, 16 for
      nvfp4).
    ffn: intermediate width of one routed expert.
    router_kind: ``"softmax"`` (softmax top-k) or ``"deepseek_v3"`` (sigmoid, correction bias, grouped top-k).
    n_group, topk_group, renormalize, routed_scaling_factor: the router's settings, see `routing.RouterConfig`.
    wire_format: how activations travel to the experts (`wire.WIRE_FORMATS`; payload bytes from
      `layout.dispatch_layout`): ``"bf16"``; ``"fp8_blockwise"`` (E4M3, one FP32 scale per 1x128 group; hidden a
      multiple of 128); ``"mxfp8"`` (E4M3, one E8M0 scale per 1x32 block; hidden a multiple of 32); ``"nvfp4"``
      (E2M1, one E4M3 scale per 1x16 block and one FP32 global scale per exchange, the pmax of the ranks'
      `quant_mx.nvfp4_global_scale`; hidden a multiple of 16). The gradient is straight-through for every format
      (docs/DESIGN.md §1.5).
    token_axes: mesh axes the token dimension of x is sharded over (in this order); x is replicated over the
      others. Empty: tokens replicated everywhere.
    expert_axis: mesh axis, or tuple of axes, that the experts and the dispatch are sharded over.
    two_level: with an expert_axis of two axes ``(node, local)``: True dispatches in two levels
      (`two_level.dispatch_two_level`: across nodes on XLA's collectives, then inside each node, one-sided with a
      workspace over ``local``), False over the flat axis; None (default) picks two levels exactly when an expert
      group spans devices that cannot map each other's memory (GPUs of several hosts: `uses_two_level`).
    tp_axis: optional mesh axis along which tokens arrive replicated (tensor parallelism); not in token_axes.
    sequence_parallel: each tp rank routes, dispatches and computes only its 1/tp slice of the tokens, and the
      slices are all-gathered at the end; needs tp_axis.
    num_shared_experts: shared experts every token goes through (weight 1), 0 for none.
    shared_ffn: intermediate width of one shared expert (default: ffn).
    shared_expert_gate: scale the shared experts' sum per token by ``sigmoid(x . shared_gate)`` (Qwen2-MoE's
      ``shared_expert_gate``; a ``shared_gate`` [hidden] parameter); needs num_shared_experts > 0.
    fp8_weights: routed expert weights stored as E4M3 with one FP32 scale per 128x128 block.
    dtype: compute dtype: matmul operands, the decoded wire and the combine payload (bfloat16, float16 or
      float32; matmuls accumulate in float32; router logits are always float32).
    param_dtype: storage dtype of the non-FP8 parameters made by `init_params`.
    impl: ``"auto" | "ffi" | "reference"``, passed to every op that takes an ``impl`` argument.
    expert_precision: the routed experts' precision: ``"dtype"`` (default) computes them in `dtype`;
      ``"fp8"`` runs them in FP8 with `expert_mlp.swiglu_mlp_fp8` (the FP8 block-scaled grouped GEMMs; hidden and
      ffn must then be multiples of 128). Custom call or reference is `impl`'s choice, as for every op.
    expert_backward: how the FP8 experts are differentiated (`expert_mlp.swiglu_mlp_fp8`): ``"bf16"``
      (default), straight-through on the bf16 grouped GEMMs; ``"fp8_dgrad"``, the data gradients on the FP8 grouped
      GEMM (the output cotangent and the SwiGLU backward's rows quantized 1x128, the forward's FP8 weights
      transposed) with the gate/up rows kept for the backward in FP8, the weight gradients on bf16 GEMMs;
      ``"fp8"``, DeepSeek-V3's recipe: the weight gradients too, on the FP8 weight-gradient GEMM (operands
      quantized along the tokens, 128x1).
    gemm_impl: deprecated, kept for one release: any value but None is read as ``expert_precision="fp8"`` with a
      DeprecationWarning (and the field is then None).
  """

  num_experts: int
  top_k: int
  hidden: int
  ffn: int
  router_kind: str = routing.SOFTMAX
  n_group: int = 1
  topk_group: int = 1
  renormalize: bool = True
  routed_scaling_factor: float = 1.0
  wire_format: str = layout.BF16
  token_axes: AxisNames = (DATA_AXIS, EXPERT_AXIS)
  expert_axis: AxisNames = EXPERT_AXIS
  two_level: Optional[bool] = None
  tp_axis: Optional[str] = None
  sequence_parallel: bool = False
  num_shared_experts: int = 0
  shared_ffn: Optional[int] = None
  shared_expert_gate: bool = False
  fp8_weights: bool = False
  dtype: Any = jnp.bfloat16
  param_dtype: Any = jnp.float32
  impl: str = "auto"
  expert_precision: str = "dtype"
  expert_backward: str = "bf16"
  gemm_impl: Optional[str] = None

  def __post_init__(self):
    op = "MoEConfig"
    # NumPy scalars (np.int64(128), np.float32(2.5), np.True_) become Python ones, so that the fields, the hash and
    # every static argument made from them are plain Python values; a bool is never taken for an int.
    for name in ("num_experts", "top_k", "hidden", "ffn", "n_group", "topk_group", "num_shared_experts",
                 "shared_ffn"):
      if _is_int(getattr(self, name)):
        object.__setattr__(self, name, int(getattr(self, name)))
    if isinstance(self.routed_scaling_factor, np.floating):
      object.__setattr__(self, "routed_scaling_factor", float(self.routed_scaling_factor))
    for name in ("renormalize", "sequence_parallel", "fp8_weights", "shared_expert_gate", "two_level"):
      if isinstance(getattr(self, name), np.bool_):
        object.__setattr__(self, name, bool(getattr(self, name)))
    for name in ("num_experts", "top_k", "hidden", "ffn", "n_group", "topk_group"):
      v = getattr(self, name)
      if not _is_int(v) or v <= 0:
        raise ValueError(f"{op}: {name} must be a positive int, got {v!r}")
    if self.top_k > self.num_experts:
      raise ValueError(f"{op}: top_k must be <= num_experts={self.num_experts}, got {self.top_k}")
    if self.wire_format not in WIRE_FORMATS:
      raise ValueError(f"{op}: wire_format must be one of {', '.join(WIRE_FORMATS)}, got {self.wire_format!r}")
    try:
      layout.dispatch_layout(self.hidden, self.wire_format, top_k=self.top_k)
    except ValueError as e:
      raise ValueError(f"{op}: hidden={self.hidden} does not fit wire_format {self.wire_format!r}: {e}") from None
    object.__setattr__(self, "token_axes", _axes_tuple(op, "token_axes", self.token_axes, allow_empty=True))
    expert_axes = _axes_tuple(op, "expert_axis", self.expert_axis, allow_empty=False)
    object.__setattr__(self, "expert_axis", expert_axes[0] if len(expert_axes) == 1 else expert_axes)
    if self.two_level is not None and not isinstance(self.two_level, bool):
      raise ValueError(f"{op}: two_level must be None, True or False, got {self.two_level!r}")
    if self.two_level and len(expert_axes) != 2:
      raise ValueError(f"{op}: two_level=True needs expert_axis of two mesh axes (node, local), got "
                       f"{self.expert_axis!r}")
    if self.tp_axis is not None:
      if not isinstance(self.tp_axis, str) or not self.tp_axis:
        raise ValueError(f"{op}: tp_axis must be None or a mesh axis name, got {self.tp_axis!r}")
      if self.tp_axis in self.token_axes:
        raise ValueError(f"{op}: tp_axis must not be one of token_axes {self.token_axes} (tokens are replicated "
                         f"over it), got {self.tp_axis!r}")
    if not isinstance(self.sequence_parallel, bool):
      raise ValueError(f"{op}: sequence_parallel must be a bool, got {self.sequence_parallel!r}")
    if self.sequence_parallel and self.tp_axis is None:
      raise ValueError(f"{op}: sequence_parallel=True needs tp_axis (the axis tokens are replicated over), got None")
    if not _is_int(self.num_shared_experts) or self.num_shared_experts < 0:
      raise ValueError(f"{op}: num_shared_experts must be an int >= 0, got {self.num_shared_experts!r}")
    if self.shared_ffn is not None and (not _is_int(self.shared_ffn) or self.shared_ffn <= 0):
      raise ValueError(f"{op}: shared_ffn must be None or a positive int, got {self.shared_ffn!r}")
    if not isinstance(self.shared_expert_gate, bool):
      raise ValueError(f"{op}: shared_expert_gate must be a bool, got {self.shared_expert_gate!r}")
    if self.shared_expert_gate and not self.num_shared_experts:
      raise ValueError(f"{op}: shared_expert_gate=True needs num_shared_experts > 0, got {self.num_shared_experts}")
    if not isinstance(self.fp8_weights, bool):
      raise ValueError(f"{op}: fp8_weights must be a bool, got {self.fp8_weights!r}")
    for name in ("dtype", "param_dtype"):
      try:
        dt = jnp.dtype(getattr(self, name))
      except TypeError:
        dt = None
      if dt not in _COMPUTE_DTYPES:
        raise ValueError(f"{op}: {name} must be bfloat16, float16 or float32, got {getattr(self, name)!r}")
      object.__setattr__(self, name, dt)
    if self.impl not in _ffi.IMPLS:
      raise ValueError(f"{op}: impl must be one of {', '.join(_ffi.IMPLS)}, got {self.impl!r}")
    if self.expert_backward not in expert_mlp.BACKWARDS:
      raise ValueError(f"{op}: expert_backward must be one of {', '.join(expert_mlp.BACKWARDS)}, got "
                       f"{self.expert_backward!r}")
    # The deprecated spelling becomes the new one, so that both make equal (and equally hashed) configs.
    object.__setattr__(self, "expert_precision", experts.precision_from_gemm_impl(
        op, self.expert_precision, self.gemm_impl, "expert_precision"))
    object.__setattr__(self, "gemm_impl", None)
    if self.expert_backward != "bf16" and self.expert_precision != "fp8":
      raise ValueError(f"{op}: expert_backward={self.expert_backward!r} is a backward of FP8 experts, so it needs "
                       f"expert_precision='fp8', got expert_precision={self.expert_precision!r}")
    if self.expert_precision == "fp8":
      for name in ("hidden", "ffn"):
        if getattr(self, name) % quant.FP8_BLOCK:
          raise ValueError(f"{op}: {name} must be a multiple of {quant.FP8_BLOCK} with expert_precision='fp8' (FP8 "
                           f"experts), got {name}={getattr(self, name)}")
    try:
      self.router_config  # pylint: disable=pointless-statement
    except (ValueError, TypeError) as e:
      raise ValueError(f"{op}: invalid router settings: {e}") from None

  @property
  def router_config(self) -> routing.RouterConfig:
    """The `routing.RouterConfig` of this layer."""
    return routing.RouterConfig(kind=self.router_kind, num_experts=self.num_experts, top_k=self.top_k,
                                n_group=self.n_group, topk_group=self.topk_group, renormalize=self.renormalize,
                                routed_scaling_factor=self.routed_scaling_factor)

  @property
  def expert_axes(self) -> tuple[str, ...]:
    """`expert_axis` as a tuple."""
    return (self.expert_axis,) if isinstance(self.expert_axis, str) else self.expert_axis

  @property
  def shared_width(self) -> int:
    """Intermediate width of one shared expert."""
    return self.ffn if self.shared_ffn is None else self.shared_ffn

  @property
  def stat_axes(self) -> tuple[str, ...]:
    """Axes holding distinct routed tokens: the token axes, plus tp_axis under sequence parallelism."""
    return self.token_axes + ((self.tp_axis,) if self.sequence_parallel else ())


def _context_mesh() -> Optional[Mesh]:
  """The mesh set with ``jax.set_mesh`` (empty when none is), or None while tracing: JAX keeps devices out of
  traced code, so ``jax.sharding.get_mesh`` refuses to run inside `jax.jit`, `jax.grad` and the like."""
  try:
    return jax.sharding.get_mesh()
  except ValueError:
    return None


def resolve_mesh(op: str, mesh: Optional[AnyMesh]) -> AnyMesh:
  """The mesh a call runs on: `mesh`, or when None the mesh set with ``jax.set_mesh``.

  Outside tracing that is the `Mesh` itself; while tracing (inside `jax.jit`, `jax.grad`, `nnx.jit`, ...) it is its
  `AbstractMesh` (``jax.sharding.get_abstract_mesh``), which shard_map and shardings take in place of the mesh. An
  `AbstractMesh` given outside tracing is replaced by the mesh set with ``jax.set_mesh`` that it describes.

  Raises:
    ValueError: neither a mesh given nor one set; an AbstractMesh outside tracing that the mesh set does not match.
  """
  context = _context_mesh()
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh() if context is None else context
    if not isinstance(mesh, (Mesh, AbstractMesh)) or mesh.empty:
      raise ValueError(f"{op}: mesh must be given, or set with jax.set_mesh(mesh), got neither")
  elif isinstance(mesh, AbstractMesh) and context is not None:
    if context.empty or context.abstract_mesh != mesh:
      raise ValueError(f"{op}: mesh must be a jax.sharding.Mesh outside jit (an AbstractMesh only while tracing, or "
                       f"under jax.set_mesh of a mesh it describes), got {mesh}")
    mesh = context
  return mesh


def mesh_with_devices(mesh: AnyMesh) -> Optional[Mesh]:
  """`mesh` if it is a `Mesh`; for an `AbstractMesh`, the mesh set with ``jax.set_mesh`` that it describes (also
  while tracing), or None.

  For what needs devices while tracing: a workspace, or which devices can map each other's memory. JAX keys a
  traced function by the abstract mesh alone, so what is built from these devices is checked against the devices
  the function is lowered for (the one-sided calls do: `Workspace.check_mesh`).
  """
  if isinstance(mesh, Mesh):
    return mesh
  context = jax_mesh.get_concrete_mesh()  # what jax.sharding.get_mesh returns, and refuses to while tracing
  if isinstance(context, Mesh) and not context.empty and context.abstract_mesh == mesh:
    return context
  return None


def _mesh_text(mesh: Any) -> str:
  """A mesh's axis names and sizes, e.g. ``{'data': 1, 'expert': 8}``."""
  return str(dict(mesh.shape))


def uses_two_level(config: MoEConfig, mesh: AnyMesh) -> bool:
  """Whether the layer dispatches in two levels on `mesh` (`MoEConfig.two_level`; None: when the expert axis is
  two axes and one of its groups spans devices that cannot map each other's memory,
  `workspace.groups_span_domains`).

  That needs the mesh's devices only when they belong to several processes (the devices of one process can always
  map each other's memory); an `AbstractMesh` takes those of the mesh set with ``jax.set_mesh`` (`mesh_with_devices`),
  and without one a ValueError asks for `MoEConfig.two_level` or the mesh.
  """
  if config.two_level is not None:
    return config.two_level
  if len(config.expert_axes) != 2:
    return False
  if isinstance(mesh, AbstractMesh):
    if jax.process_count() == 1:
      return False
    with_devices = mesh_with_devices(mesh)
    if with_devices is not None:
      return groups_span_domains(with_devices, config.expert_axis)
    raise ValueError(f"uses_two_level: mesh must be a jax.sharding.Mesh to tell whether an expert group over "
                     f"{config.expert_axis!r} spans hosts ({jax.process_count()} processes), got the AbstractMesh "
                     f"{_mesh_text(mesh)}; set MoEConfig(two_level=True or False), or pass the mesh (or a "
                     f"workspace) to moe_apply")
  return groups_span_domains(mesh, config.expert_axis)


def _workspace_axis(config: MoEConfig, two_level: bool):
  """The axis the layer's workspace spans: the local axis of a two-level layer, else the expert axis."""
  return config.expert_axes[1] if two_level else config.expert_axis


def _axes_size(axes: Sequence[str], sizes: Mapping[str, int]) -> int:
  """How many devices `axes` of a mesh with axis `sizes` span: the product of their sizes (1 for no axis)."""
  return int(np.prod([sizes[a] for a in axes]))


def mesh_axis_sizes(op: str, config: MoEConfig, mesh: AnyMesh) -> dict[str, int]:
  """Checks that every axis the config names exists; returns the mesh's axis sizes."""
  if not isinstance(mesh, (Mesh, AbstractMesh)):
    raise TypeError(f"{op}: mesh must be a jax.sharding.Mesh or AbstractMesh, got {type(mesh).__name__}")
  sizes = dict(mesh.shape)
  named = [("token_axes", a) for a in config.token_axes] + [("expert_axis", a) for a in config.expert_axes]
  if config.tp_axis is not None:
    named.append(("tp_axis", config.tp_axis))
  for field, a in named:
    if a not in sizes:
      raise ValueError(f"{op}: {field} must name axes of the mesh {tuple(sizes)}, got {a!r}")
  num_ranks = _axes_size(config.expert_axes, sizes)
  if config.num_experts % num_ranks:
    raise ValueError(f"{op}: num_experts must be divisible by the size of expert_axis {config.expert_axis!r} "
                     f"({num_ranks}), got {config.num_experts}")
  return sizes


# ----------------------------------------------------------------------------------------------------------------
# Parameters
# ----------------------------------------------------------------------------------------------------------------


def param_specs(config: MoEConfig) -> dict[str, P]:
  """The `PartitionSpec` of every parameter of `config`'s layer (the keys of `init_params`' result).

  Routed expert weights (and their FP8 scales) are sharded over `expert_axis` on dim 0; everything else is
  replicated.
  """
  ex = config.expert_axis
  specs = {"router": P(None, None)}
  if config.router_kind == routing.DEEPSEEK_V3:
    specs["router_bias"] = P(None)
  specs["w_gate_up"] = P(ex, None, None)
  specs["w_down"] = P(ex, None, None)
  if config.fp8_weights:
    specs["w_gate_up_sf"] = P(ex, None, None)
    specs["w_down_sf"] = P(ex, None, None)
  if config.num_shared_experts:
    specs["shared_w_gate_up"] = P(None, None, None)
    specs["shared_w_down"] = P(None, None, None)
  if config.shared_expert_gate:
    specs["shared_gate"] = P(None)
  return specs


def param_shapes(config: MoEConfig) -> dict[str, jax.ShapeDtypeStruct]:
  """Global shape and dtype of every parameter (the keys of `init_params`' result).

  - ``router``: [hidden, num_experts] param_dtype;
  - ``router_bias`` (deepseek_v3 only): [num_experts] float32, the score correction bias;
  - ``w_gate_up``: [num_experts, 2 * ffn, hidden] (gate rows first), ``w_down``: [num_experts, hidden, ffn];
    param_dtype, or float8_e4m3fn with ``w_gate_up_sf`` [num_experts, ceil(2 ffn / 128), ceil(hidden / 128)]
    and ``w_down_sf`` [num_experts, ceil(hidden / 128), ceil(ffn / 128)] float32 (one scale per 128x128 block)
    when fp8_weights;
  - ``shared_w_gate_up``: [num_shared_experts, 2 * shared_ffn, hidden], ``shared_w_down``:
    [num_shared_experts, hidden, shared_ffn], param_dtype (when num_shared_experts > 0);
  - ``shared_gate``: [hidden] param_dtype (when shared_expert_gate).
  """
  e, h, f, pd = config.num_experts, config.hidden, config.ffn, config.param_dtype
  sds = jax.ShapeDtypeStruct
  wd = jnp.dtype(jnp.float8_e4m3fn) if config.fp8_weights else pd
  shapes = {"router": sds((h, e), pd)}
  if config.router_kind == routing.DEEPSEEK_V3:
    shapes["router_bias"] = sds((e,), jnp.dtype(jnp.float32))
  shapes["w_gate_up"] = sds((e, 2 * f, h), wd)
  shapes["w_down"] = sds((e, h, f), wd)
  if config.fp8_weights:
    for name in ("w_gate_up", "w_down"):
      shapes[name + "_sf"] = sds(quant.fp8_weight_scale_shape(shapes[name].shape), jnp.dtype(jnp.float32))
  if config.num_shared_experts:
    s, fs = config.num_shared_experts, config.shared_width
    shapes["shared_w_gate_up"] = sds((s, 2 * fs, h), pd)
    shapes["shared_w_down"] = sds((s, h, fs), pd)
  if config.shared_expert_gate:
    shapes["shared_gate"] = sds((h,), pd)
  return shapes


def _init_values(key: jax.Array, config: MoEConfig) -> dict[str, jax.Array]:
  e, h, f, pd = config.num_experts, config.hidden, config.ffn, config.param_dtype
  k_router, k_gu, k_dn, k_sgu, k_sdn = jax.random.split(key, 5)
  normal = lambda k, shape, fan_in: (jax.random.normal(k, shape, jnp.float32) / np.sqrt(fan_in))
  out = {"router": normal(k_router, (h, e), h).astype(pd)}
  if config.router_kind == routing.DEEPSEEK_V3:
    out["router_bias"] = jnp.zeros((e,), jnp.float32)
  w_gate_up = normal(k_gu, (e, 2 * f, h), h).astype(pd)
  w_down = normal(k_dn, (e, h, f), f).astype(pd)
  if config.fp8_weights:
    w = expert_mlp.ExpertWeights.quantize(w_gate_up, w_down)
    out.update(w_gate_up=w.w_gate_up, w_down=w.w_down, w_gate_up_sf=w.w_gate_up_sf, w_down_sf=w.w_down_sf)
  else:
    out.update(w_gate_up=w_gate_up, w_down=w_down)
  if config.num_shared_experts:
    s, fs = config.num_shared_experts, config.shared_width
    out["shared_w_gate_up"] = normal(k_sgu, (s, 2 * fs, h), h).astype(pd)
    out["shared_w_down"] = normal(k_sdn, (s, h, fs), fs).astype(pd)
  if config.shared_expert_gate:
    out["shared_gate"] = normal(jax.random.fold_in(k_sgu, 1), (h,), h).astype(pd)
  return out


def init_params(key: jax.Array, config: MoEConfig, mesh: Optional[AnyMesh] = None) -> dict[str, jax.Array]:
  """Random parameters of `config`'s layer, created in place with their shardings (`param_specs`) on `mesh`.

  Weights are normal with standard deviation 1/sqrt(fan_in); the DeepSeek correction bias starts at 0. With
  fp8_weights the expert weights are drawn in param_dtype and quantized (E4M3, FP32 scale per 128x128 block).

  Args:
    key: a PRNG key.
    config: the layer.
    mesh: the mesh `moe_apply` will run on; None: the mesh set with ``jax.set_mesh``, also inside `jax.jit` (there
      its `AbstractMesh`).

  Returns:
    A dict of arrays, shapes and dtypes as `param_shapes`, each with ``NamedSharding(mesh, param_specs[name])``
    (inside jit, that sharding as the arrays' constraint).

  Raises:
    ValueError: an axis of the config is not in the mesh, or num_experts is not divisible by the expert axis.
  """
  op = "init_params"
  if not isinstance(config, MoEConfig):
    raise TypeError(f"{op}: config must be a MoEConfig, got {type(config).__name__}")
  _check_key(op, key)
  mesh = resolve_mesh(op, mesh)
  mesh_axis_sizes(op, config, mesh)
  shardings = {name: NamedSharding(mesh, spec) for name, spec in param_specs(config).items()}
  values = jax.jit(_init_values, static_argnums=1, out_shardings=shardings)(key, config)
  # Inside an outer jit the inner jit's out_shardings constrain the values but do not enter their types, where the
  # sharding over Explicit axes lives: reshard puts it there (outside jit the arrays have it already).
  return {name: _on_explicit_axes(v, shardings[name]) for name, v in values.items()}


def _check_key(op: str, key: Any) -> None:
  """A PRNG key: a typed key array (``jax.random.key``) or a raw ``uint32[2]`` one (``jax.random.PRNGKey``)."""
  dtype, shape = getattr(key, "dtype", None), tuple(getattr(key, "shape", ()))
  if dtype is None:
    got = type(key).__name__
  elif jnp.issubdtype(dtype, jax.dtypes.prng_key):
    if not shape:
      return
    got = f"{dtype}{list(shape)}"
  else:
    if jnp.dtype(dtype) == jnp.dtype(jnp.uint32) and shape == (2,):
      return
    got = f"{jnp.dtype(dtype).name}{list(shape)}"
  raise TypeError(f"{op}: key must be one PRNG key (jax.random.key(seed), or uint32[2] from jax.random.PRNGKey), "
                  f"got {got}")


def _check_params(op: str, params: Any, config: MoEConfig) -> None:
  if not isinstance(params, Mapping):
    raise TypeError(f"{op}: params must be a dict of arrays (as init_params returns), got {type(params).__name__}")
  want = param_shapes(config)
  missing, extra = sorted(set(want) - set(params)), sorted(set(params) - set(want))
  if missing or extra:
    raise ValueError(f"{op}: params must have the keys {sorted(want)} for this config, got {sorted(params)} "
                     f"(missing {missing}, unexpected {extra})")
  for name, sds in want.items():
    p = params[name]
    shape, dtype = tuple(getattr(p, "shape", ())), getattr(p, "dtype", None)
    if shape != sds.shape:
      raise ValueError(f"{op}: params[{name!r}] must have shape {sds.shape}, got {shape}")
    fp8 = sds.dtype == jnp.float8_e4m3fn
    ok = dtype == sds.dtype if (fp8 or name.endswith("_sf") or name == "router_bias") \
        else dtype is not None and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize >= 2
    if not ok:
      expected = sds.dtype.name if (fp8 or name.endswith("_sf") or name == "router_bias") \
          else "a floating dtype of 16 or 32 bits"
      raise ValueError(f"{op}: params[{name!r}] must be {expected}, got {dtype}")


# ----------------------------------------------------------------------------------------------------------------
# The layer
# ----------------------------------------------------------------------------------------------------------------


def _router_probs(logits: jax.Array, config: MoEConfig) -> jax.Array:
  """What the load-balance loss averages: softmax probabilities, or per-token normalized sigmoid scores."""
  if config.router_kind == routing.SOFTMAX:
    return jax.nn.softmax(logits, axis=-1)
  scores = jax.nn.sigmoid(logits)
  return scores / jnp.sum(scores, axis=-1, keepdims=True)


def _router_logits(x: jax.Array, router: jax.Array) -> jax.Array:
  """float32 ``x @ router``. bfloat16 operands are multiplied as they are (each product is exact in float32, and
  the sums accumulate in float32: the float32 product up to summation order, in one tensor-core pass); other dtypes
  in float32 at HIGHEST precision."""
  if x.dtype == jnp.bfloat16 and router.dtype == jnp.bfloat16:
    return jnp.dot(x, router, preferred_element_type=jnp.float32)
  return jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


def _run_router(params, x, config: MoEConfig, axis_name):
  with jax.named_scope("router"):
    logits = checkpoint_name(_router_logits(x, params["router"]), "router_logits")
    topk_weights, topk_ids = routing.route(logits, config.router_config, params.get("router_bias"))
  with jax.named_scope("aux"):
    aux = {
        "load_balance_loss": routing.load_balance_loss(_router_probs(logits, config), topk_ids,
                                                       config.num_experts, axis_name=axis_name),
        "expert_load": routing.expert_load(topk_ids, config.num_experts, axis_name=axis_name),
    }
  return topk_weights, topk_ids, aux


def _shared_experts(params, x, config: MoEConfig, dtype) -> jax.Array:
  """Sum over the shared experts of down(silu(gate(x)) * up(x)), times sigmoid(x . shared_gate) per token with
  shared_expert_gate; [num_tokens, hidden] float32."""
  fs = config.shared_width
  w_gate_up = params["shared_w_gate_up"].astype(dtype)
  w_down = params["shared_w_down"].astype(dtype)
  h = jnp.einsum("th,sfh->tsf", x.astype(dtype), w_gate_up, preferred_element_type=jnp.float32)
  act = (jax.nn.silu(h[..., :fs]) * h[..., fs:]).astype(dtype)
  y = jnp.einsum("tsf,shf->th", act, w_down, preferred_element_type=jnp.float32)
  if config.shared_expert_gate:
    gate = jnp.dot(x.astype(jnp.float32), params["shared_gate"].astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
    y = y * jax.nn.sigmoid(gate)[:, None]
  return y


def _expert_weights(params) -> expert_mlp.ExpertWeights:
  return expert_mlp.ExpertWeights(params["w_gate_up"], params["w_down"], params.get("w_gate_up_sf"),
                               params.get("w_down_sf"))


# With a workspace, every collective of the layer is ordered by data with respect to every one-sided call (see
# Workspace: XLA:CPU runs a device's independent ops in any order, and a device inside a one-sided call waiting
# for a peer inside a collective deadlocks). On every device the forward runs the routing statistics' psums, then
# dispatch, combine and the sequence-parallel all_gather; the backward the psum_scatter over tp, combine's VJP, the
# wire's VJP (its rows one-sided, then the weights' all_to_all), the statistics' psums, and last the psums that
# shard_map's transpose adds for the inputs' cotangents (replicated parameters over data, x over tp).


def _body(params, x, quantized, *, config: MoEConfig, workspace: Optional[Workspace], two_level: bool):
  """One shard: x [tokens_local, hidden] (or [batch_local, seq, hidden]); quantized: the local experts' FP8 forms
  made once (`quantize_experts`), or None."""
  if workspace is not None:
    params, x = ordering.joined((params, x))  # the inputs' psums in the backward come last
  x_shape, x_dtype = x.shape, x.dtype
  x = x.reshape(-1, config.hidden)
  dtype = config.dtype
  if config.sequence_parallel:
    with jax.named_scope("sequence_parallel_slice"):
      tp = jax.lax.axis_size(config.tp_axis)
      part = x.shape[0] // tp
      x = jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(config.tp_axis) * part, part, axis=0)
  stat_axes = config.stat_axes or None
  topk_weights, topk_ids, aux = _run_router(params, x, config, stat_axes)
  if workspace is not None:
    # The statistics' psums before the dispatch; in the backward, theirs after the weights' cotangents came back.
    aux, topk_weights = ordering.ordered(aux, topk_weights)
  rows, recv_ids, recv_w, _, handle, codes = wire.wire_dispatch_with_codes(
      x, topk_ids, topk_weights, wire_format=config.wire_format, num_experts=config.num_experts,
      axis_name=config.expert_axis, dtype=dtype, impl=config.impl, workspace=workspace, two_level=two_level)
  rows = checkpoint_name(rows, "dispatched_rows")
  with jax.named_scope("experts"):
    expert_out = experts.expert_stage(rows, recv_ids, recv_w, _expert_weights(params), wire_codes=codes,
                                      out_dtype=dtype, compute_dtype=dtype,
                                      precision=config.expert_precision, impl=config.impl,
                                      backward=config.expert_backward, quantized_weights=quantized)
  # Combine sums in float32 and rounds once to its out_dtype: straight to x's dtype where nothing is added after.
  direct = not config.num_shared_experts and jnp.dtype(x_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
  combine = combine_two_level if two_level else a2a.combine
  y = combine(expert_out, handle, out_dtype=x_dtype if direct else jnp.float32)
  if config.num_shared_experts:
    with jax.named_scope("shared_experts"):
      y = y + _shared_experts(params, x, config, dtype)
  y = y.astype(x_dtype)
  if config.sequence_parallel:
    with jax.named_scope("sequence_parallel_gather"):
      y_local = y
      y = jax.lax.all_gather(y, config.tp_axis, axis=0, tiled=True)
      if workspace is not None:  # its transpose, a psum_scatter of the incoming cotangent, after the combine
        y = ordering.after_in_backward(y, jax.lax.stop_gradient(y_local.reshape(-1)[:1]))
  return y.reshape(x_shape), aux["load_balance_loss"], aux["expert_load"]


def _check_x(op: str, x: Any, config: MoEConfig, sizes: dict[str, int]) -> None:
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{op}: x must be an array [num_tokens, hidden] or [batch, seq, hidden], got {type(x).__name__}")
  if x.ndim not in (2, 3) or x.shape[-1] != config.hidden:
    raise ValueError(f"{op}: x must be [num_tokens, hidden={config.hidden}] or [batch, seq, hidden={config.hidden}], "
                     f"got shape {tuple(x.shape)}")
  if jnp.dtype(x.dtype) not in _COMPUTE_DTYPES:
    raise ValueError(f"{op}: x must be bfloat16, float16 or float32, got {x.dtype}")
  shards = _axes_size(config.token_axes, sizes)
  lead = "num_tokens" if x.ndim == 2 else "batch"
  if x.shape[0] % shards:
    raise ValueError(f"{op}: x's {lead} must be divisible by the token sharding {config.token_axes} ({shards} "
                     f"shards), got {x.shape[0]}")
  if config.sequence_parallel:
    local = x.shape[0] // shards * (x.shape[1] if x.ndim == 3 else 1)
    tp = sizes[config.tp_axis]
    if local % tp:
      raise ValueError(f"{op}: the tokens of one shard must be divisible by the size of tp_axis {config.tp_axis!r} "
                       f"({tp}) under sequence parallelism, got {local}")


# Under the abstract mesh of jax.set_mesh the layer's program names no devices, and JAX lowers it once for every mesh
# of the same axis names and sizes, whatever its devices: the one-sided calls' check of their mesh, when lowered,
# would see the first mesh's devices only. This identity on x is registered as needing devices when lowered, so JAX
# keys the lowering by the program's devices, and checks them against the workspace's: the mesh the layer runs on
# is the program's devices in their order, laid out as the abstract mesh (as JAX lays out an AbstractMesh).
_devices_check_p = jax.extend.core.Primitive("jax_moe_a2a_workspace_devices_check")
_devices_check_p.def_impl(lambda x, **_: x)
_devices_check_p.def_abstract_eval(lambda x, **_: x)
ad.primitive_jvps[_devices_check_p] = lambda primals, tangents, **kw: (_devices_check_p.bind(*primals, **kw),
                                                                       tangents[0])
batching.primitive_batchers[_devices_check_p] = lambda args, dims, **kw: (_devices_check_p.bind(*args, **kw), dims[0])
jax_dispatch.prim_requires_devices_during_lowering.add(_devices_check_p)


def _devices_check_lowering(ctx, x, *, workspace: Workspace, mesh: AbstractMesh, axis_name):
  devices = getattr(ctx.module_context.axis_context, "device_assignment", None)
  if devices is None:
    raise ValueError(f"moe_apply: the program must be lowered for devices (to check them against the workspace's), "
                     f"got only the AbstractMesh {_mesh_text(mesh)}")
  grid = np.empty(len(devices), dtype=object)
  grid[:] = devices
  concrete = Mesh(grid.reshape(mesh.axis_sizes), mesh.axis_names, axis_types=mesh.axis_types)
  workspace.check_mesh("moe_apply", concrete, axis_name)
  return [x]


mlir.register_lowering(_devices_check_p, _devices_check_lowering)


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _moe_apply(params, x, config: MoEConfig, mesh: AnyMesh, workspace: Optional[Workspace], quantized):
  devices_mesh = mesh
  if isinstance(workspace, Workspace) and isinstance(mesh, AbstractMesh):
    # The abstract mesh of jax.set_mesh while tracing has no devices; a workspace of the same axes has, and the
    # program's devices are checked against its own when lowered (_devices_check_p).
    workspace.check_mesh_shape("moe_apply", mesh)
    devices_mesh = workspace.mesh
  two_level = uses_two_level(config, devices_mesh)
  if isinstance(workspace, Workspace):
    axis = _workspace_axis(config, two_level)
    if two_level and workspace.expert_axis != axis:
      raise ValueError(f"moe_apply: a two-level layer needs a workspace over its local axis {axis!r} "
                       f"(make_workspace), got one over {workspace.expert_axis!r}")
    if isinstance(mesh, Mesh):
      workspace.check_mesh("moe_apply", mesh, axis)  # the calls check it too, when lowered
    else:
      x = _devices_check_p.bind(x, workspace=workspace, mesh=mesh, axis_name=axis)
  tok = config.token_axes or None
  x_spec = P(tok, *([None] * (x.ndim - 1)))
  specs = param_specs(config)
  # check_vma=False: without sequence parallelism the output is equal on every tp rank but, having come
  # through an all_to_all, is typed as varying over tp; there is no cast from varying to replicated. With
  # check_vma off, shard_map's transpose divides replicated outputs' cotangents by the replica count and sums
  # replicated inputs' cotangents over the replicas, which is exact for a layer whose replicas agree.
  fn = jax.shard_map(functools.partial(_body, config=config, workspace=workspace, two_level=two_level), mesh=mesh,
                     in_specs=({name: specs[name] for name in params}, x_spec, specs["w_gate_up"]),
                     out_specs=(x_spec, P(), P(None)), check_vma=False)
  y, loss, load = fn(dict(params), x, quantized)
  return y, {"load_balance_loss": loss, "expert_load": load}


def _on_explicit_axes(x: Any, sharding: NamedSharding) -> Any:
  """x resharded to `sharding` on the Explicit axes of its mesh (none: x as it is).

  shard_map takes an input whose sharding over Auto axes differs from its in_specs (it reshards), but over
  Explicit axes (`jax.make_mesh`'s default) it requires the input's to be the in_specs'. `jax.sharding.reshard`
  (a device_put for a concrete array, a sharding cast under jit) gives x that sharding: the spec restricted to
  the Explicit axes, as x's type records it.
  """
  mesh = sharding.mesh
  explicit = {a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Explicit}
  if not explicit:
    return x

  def on_explicit(spec) -> tuple:
    entries = tuple(spec) + (None,) * (x.ndim - len(spec))
    axes = [tuple(a for a in ((e,) if isinstance(e, str) else (e or ())) if a in explicit) for e in entries]
    return tuple(None if not e else e[0] if len(e) == 1 else e for e in axes)

  want = on_explicit(sharding.spec)
  have = jax.typeof(x).sharding
  if have.mesh == mesh.abstract_mesh and on_explicit(have.spec) == want:
    return x
  return jax.sharding.reshard(x, NamedSharding(mesh, P(*want)))


def _params_in_layer_sharding(params: Mapping[str, Any], config: MoEConfig, mesh: AnyMesh) -> dict[str, Any]:
  """params resharded to `param_specs` on the Explicit axes of `mesh` (`_on_explicit_axes`): arrays from a
  checkpoint or the host, or replicated ones, are laid out as the layer takes them."""
  specs = param_specs(config)
  return {name: _on_explicit_axes(v, NamedSharding(mesh, specs[name])) for name, v in params.items()}


def _replicated_on_explicit_axes(x: Any) -> Any:
  """x with none of its dimensions sharded over Explicit mesh axes (a single-device computation's gathers and
  scatters need whole dimensions); x as it is when its mesh has no Explicit axes."""
  mesh = jax.typeof(x).sharding.mesh
  if jax.sharding.AxisType.Explicit not in getattr(mesh, "axis_types", ()):
    return x
  return _on_explicit_axes(x, NamedSharding(mesh, P()))


def _x_in_layer_sharding(x: Any, config: MoEConfig, mesh: AnyMesh) -> Any:
  """x resharded to the layer's ``P(token_axes, None, ...)`` on the Explicit axes of `mesh` (`_on_explicit_axes`)."""
  return _on_explicit_axes(x, NamedSharding(mesh, P(config.token_axes or None, *([None] * (x.ndim - 1)))))


def moe_apply(params: Mapping[str, jax.Array], x: jax.Array, config: MoEConfig, mesh: Optional[AnyMesh] = None, *,
              workspace: Optional[Workspace] = None, expert_precision: Optional[str] = None,
              quantized_experts: Optional[expert_mlp.QuantizedWeights] = None,
              gemm_impl: Optional[str] = None) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The MoE layer, expert-parallel over `config.expert_axis` of `mesh` (see the module docstring).

  Jitted inside (config and mesh are static); call it from inside `jax.jit` or eagerly. All checks run at trace
  time.

  Args:
    params: the parameters, as `init_params` returns them (shapes in `param_shapes`; shardings
      `param_specs`: routed experts sharded over expert_axis on dim 0, the rest replicated).
    x: [num_tokens, hidden] or [batch, seq, hidden] bfloat16/float16/float32, dim 0 sharded over
      `config.token_axes` (``P(token_axes, None)``), replicated over the other axes (tp_axis in particular).
      An x sharded otherwise (or not committed to the mesh) is resharded to that, also over Explicit mesh axes.
    config: the layer.
    mesh: a mesh holding every axis the config names; None: the mesh set with ``jax.set_mesh``, also inside
      `jax.jit` and `jax.grad` (there its `AbstractMesh`: `resolve_mesh`).
    workspace: a `Workspace` for this mesh's expert axis (see `make_workspace`; a mesh of other devices, or
      of the same devices in another order, is refused: `Workspace.check_mesh`): dispatch and combine then run
      as one-sided custom calls. None: the reference throughout. Under an `AbstractMesh` (the mesh of ``jax.set_mesh``
      while tracing) the workspace's mesh must have its axis names and sizes, and gives the devices where the layer
      needs them (`uses_two_level`); its devices are checked against the mesh's when the calls are lowered.
    expert_precision: when given, replaces `config.expert_precision` (e.g. "fp8": the routed experts on the FP8
      grouped GEMMs).
    quantized_experts: with FP8 experts on float weights, the experts' FP8 forms made from these params by
      `quantize_experts`, read instead of quantizing the weights in this call (the weights still take the
      gradients): pass the same ones to every call of a training step, e.g. each micro-batch of a gradient
      accumulation loop.
    gemm_impl: deprecated, kept for one release: any value but None is read as ``expert_precision="fp8"`` with a
      DeprecationWarning.

  Returns:
    y: x's shape and dtype and sharding: routed experts (sum of top-k weight * expert) plus shared experts.
    aux: ``{"load_balance_loss": [] float32, "expert_load": [num_experts] int32}``, replicated, computed over all
      tokens of the layer (`routing.load_balance_loss`, `routing.expert_load`).

  Raises:
    TypeError, ValueError: at trace time, for a config that is not a MoEConfig, axes missing from the mesh,
      num_experts not divisible by the expert axis size, a token count not divisible by the token sharding (or,
      under sequence parallelism, a shard's tokens by the tp size), params or x of the wrong shape or dtype, and a
      workspace whose expert groups (or, while tracing, axis names and sizes) are not this mesh's.
  """
  op = "moe_apply"
  if not isinstance(config, MoEConfig):
    raise TypeError(f"{op}: config must be a MoEConfig, got {type(config).__name__}")
  if expert_precision is not None or gemm_impl is not None:
    precision = experts.precision_from_gemm_impl(op, expert_precision or config.expert_precision, gemm_impl,
                                                 "expert_precision")
    config = dataclasses.replace(config, expert_precision=precision)
  mesh = resolve_mesh(op, mesh)
  sizes = mesh_axis_sizes(op, config, mesh)
  _check_params(op, params, config)
  _check_x(op, x, config, sizes)
  if quantized_experts is not None:
    _check_quantized_experts(op, quantized_experts, params, config)
    spec = NamedSharding(mesh, param_specs(config)["w_gate_up"])  # every form has the experts first
    quantized_experts = jax.tree.map(lambda v: _on_explicit_axes(v, spec), quantized_experts)
  return _moe_apply(_params_in_layer_sharding(params, config, mesh), _x_in_layer_sharding(x, config, mesh), config,
                    mesh, workspace, quantized_experts)


def _check_float_fp8_experts(op: str, config: MoEConfig) -> None:
  if config.expert_precision != "fp8" or config.fp8_weights:
    raise ValueError(f"{op}: quantized experts are the FP8 forms of float expert weights, for expert_precision='fp8' "
                     f"and fp8_weights=False; got expert_precision={config.expert_precision!r}, "
                     f"fp8_weights={config.fp8_weights}")


def _check_quantized_experts(op: str, quantized: Any, params: Mapping[str, jax.Array], config: MoEConfig) -> None:
  _check_float_fp8_experts(op, config)
  expert_mlp.check_quantized(op, quantized, _expert_weights(params), config.expert_backward)


def quantize_experts(params: Mapping[str, jax.Array], config: MoEConfig,
                     mesh: Optional[AnyMesh] = None) -> expert_mlp.QuantizedWeights:
  """The FP8 forms of the routed experts' weights that `moe_apply` with FP8 experts makes from `params` in every
  call, made once, for ``moe_apply(..., quantized_experts=...)``.

  A training step that accumulates gradients over micro-batches calls the layer once per micro-batch with the same
  weights; with FP8 experts each call quantizes all of them again unless the compiler hoists that out of the loop,
  which XLA:GPU does not (docs/PERFORMANCE.md, "Micro-batches"). Made here once per step, outside
  the loop, and passed to every call, they are quantized once; the layer's output and gradients are the same bits
  (the same quantizer calls on the same weights), and the gradients still reach the float weights in `params`.
  Make them from the params of the same step: the layer does not compare them with the weights.

  Args:
    params: as for `moe_apply`, with float routed experts.
    config: the layer, with ``expert_precision="fp8"`` and ``fp8_weights=False``; its ``expert_backward`` decides
      what is made (the FP8 backwards also read the codes transposed).
    mesh: as for `moe_apply`.

  Returns:
    An `expert_mlp.QuantizedWeights` of global arrays sharded as the experts are (over ``config.expert_axis``).
    No gradient flows through it.
  """
  op = "quantize_experts"
  if not isinstance(config, MoEConfig):
    raise TypeError(f"{op}: config must be a MoEConfig, got {type(config).__name__}")
  _check_float_fp8_experts(op, config)
  mesh = resolve_mesh(op, mesh)
  mesh_axis_sizes(op, config, mesh)
  _check_params(op, params, config)
  params = _params_in_layer_sharding({name: params[name] for name in ("w_gate_up", "w_down")}, config, mesh)
  return _quantize_experts(params["w_gate_up"], params["w_down"], config, mesh)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _quantize_experts(w_gate_up, w_down, config: MoEConfig, mesh: AnyMesh) -> expert_mlp.QuantizedWeights:
  spec = param_specs(config)["w_gate_up"]
  quantize = lambda gu, dn: expert_mlp.quantize_weights(expert_mlp.ExpertWeights(gu, dn),
                                                        backward=config.expert_backward, impl=config.impl)
  # Each expert's blocks are its own: quantized shard by shard, the codes are those of the whole array.
  return jax.shard_map(quantize, mesh=mesh, in_specs=(spec, spec), out_specs=spec, check_vma=False)(w_gate_up, w_down)


def make_workspace(config: MoEConfig, mesh: Optional[Mesh], num_tokens: int, *, timeout_s: float = 10.0,
                   training: bool = False) -> Workspace:
  """The `Workspace` that `moe_apply(..., workspace=...)` needs for `num_tokens` global tokens.

  Sized for one shard's dispatch: num_tokens over the token sharding (and over tp under sequence parallelism),
  the wire format and top_k of the config, and expert outputs in the compute dtype; with ``training``, room for
  the rows of combine's VJP too, so that it is one-sided whatever the wire format (`Workspace`). A two-level
  layer (`uses_two_level`) gets one over its local axis, one expert group per node, holding the rows of every node.
  mesh None: the mesh set with ``jax.set_mesh``. Create it outside `jax.jit` (it is memory on the mesh's devices;
  while tracing the mesh of ``jax.set_mesh`` is abstract and refused) and close it when done.
  """
  op = "make_workspace"
  if not isinstance(config, MoEConfig):
    raise TypeError(f"{op}: config must be a MoEConfig, got {type(config).__name__}")
  if jnp.dtype(config.dtype) not in COMBINE_DTYPES:
    raise ValueError(f"{op}: the one-sided exchange combines bfloat16 or float32 rows, got config.dtype "
                     f"{jnp.dtype(config.dtype).name}; run the layer without a workspace (XLA's all_to_all) or "
                     f"with dtype bfloat16 or float32")
  if isinstance(num_tokens, (bool, np.bool_)) or not isinstance(num_tokens, (int, np.integer)) or num_tokens < 1:
    raise ValueError(f"{op}: num_tokens must be a positive int (the layer's global token count), got {num_tokens!r}")
  mesh = resolve_mesh(op, mesh)
  if not isinstance(mesh, Mesh):
    raise ValueError(f"make_workspace: mesh must be a jax.sharding.Mesh (the workspace is memory on its devices), got "
                     f"the AbstractMesh {_mesh_text(mesh)} (inside jax.jit, jax.grad and the like, the mesh of "
                     f"jax.set_mesh has no devices); make the workspace outside jit and pass it in")
  sizes = mesh_axis_sizes(op, config, mesh)
  shards = _axes_size(config.stat_axes, sizes)  # under sequence parallelism tp splits the tokens too
  if num_tokens % shards:
    raise ValueError(f"{op}: num_tokens must be divisible by the {shards} shards the layer splits tokens into "
                     f"(token axes {config.token_axes}{' and tp' if config.sequence_parallel else ''}), "
                     f"got {num_tokens}")
  capacity = int(num_tokens) // shards
  two_level = uses_two_level(config, mesh)
  if two_level:  # the local dispatch takes the rows of every node
    capacity *= sizes[config.expert_axes[0]]
  return Workspace(mesh, expert_axis=_workspace_axis(config, two_level), capacity=capacity, hidden=config.hidden,
                   top_k=config.top_k, fmt=config.wire_format, combine_dtype=config.dtype, timeout_s=timeout_s,
                   training=training)


# ----------------------------------------------------------------------------------------------------------------
# Dense oracle
# ----------------------------------------------------------------------------------------------------------------


def moe_dense_reference(params: Mapping[str, jax.Array], x: jax.Array,
                        config: MoEConfig) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Single-device float32 oracle of `moe_apply`: every token through its top-k experts, no dispatch, no wire.

  Routing is the same (`routing.route` on float32 logits); each (token, k) assignment runs expert
  ``topk_ids[t, k]`` in float32 (FP8 weights dequantized, matmuls at HIGHEST precision), the results are
  weighted and summed over k, and the shared experts are added. Mesh, wire format, sequence parallelism and the
  compute dtype play no part. Differentiable.

  Args:
    params: as for `moe_apply`, in any sharding (over Explicit mesh axes they are gathered first).
    x: [num_tokens, hidden] or [batch, seq, hidden] floating, in any sharding.
    config: the layer.

  Returns:
    y: x's shape, float32.
    aux: as `moe_apply`'s, over all tokens.
  """
  op = "moe_dense_reference"
  if not isinstance(config, MoEConfig):
    raise TypeError(f"{op}: config must be a MoEConfig, got {type(config).__name__}")
  _check_params(op, params, config)
  if getattr(x, "ndim", 0) not in (2, 3) or x.shape[-1] != config.hidden:
    raise ValueError(f"{op}: x must be [num_tokens, hidden={config.hidden}] or [batch, seq, hidden], "
                     f"got shape {tuple(getattr(x, 'shape', ()))}")
  mesh = _explicit_mesh(list(params.values()) + [x])
  if mesh is None or not jax.sharding.get_abstract_mesh().empty:
    return _dense_reference(params, x, config)
  return _dense_reference_on(dict(params), x, config, mesh.abstract_mesh)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _dense_reference_on(params, x, config: MoEConfig, mesh: AbstractMesh):
  """`_dense_reference` with `mesh` as the context mesh, so that the arrays it makes (zeros, iotas) live on the
  inputs' mesh, as operations between them need; jitted, so that this holds eagerly and under jax.grad too, where
  `jax.set_mesh` cannot be entered."""
  with jax.sharding.use_abstract_mesh(mesh):
    return _dense_reference(params, x, config)


def _explicit_mesh(values: list[Any]) -> Optional[AbstractMesh]:
  """The mesh with Explicit axes that one of `values` is typed on, or None."""
  for v in values:
    mesh = jax.typeof(v).sharding.mesh
    if jax.sharding.AxisType.Explicit in getattr(mesh, "axis_types", ()):
      return mesh
  return None


def _dense_reference(params: Mapping[str, jax.Array], x: jax.Array,
                     config: MoEConfig) -> tuple[jax.Array, dict[str, jax.Array]]:
  params = {name: _replicated_on_explicit_axes(v) for name, v in params.items()}
  x = _replicated_on_explicit_axes(x)
  f32 = jnp.float32
  with jax.default_matmul_precision("highest"):
    xs = x.reshape(-1, config.hidden).astype(f32)
    topk_weights, topk_ids, aux = _run_router(params, xs, config, None)
    num_tokens, top_k = topk_ids.shape
    w_gate_up, w_down = _expert_weights(params).dequantized(f32)
    flat = topk_ids.reshape(-1)  # route only returns valid ids
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.zeros((config.num_experts,), jnp.int32).at[flat].add(1)
    y_sorted = expert_mlp.swiglu_mlp_xla(xs[order // top_k], group_sizes,
                                      expert_mlp.ExpertWeights(w_gate_up, w_down), compute_dtype=f32)
    y_assign = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(num_tokens, top_k, config.hidden)
    y = jnp.einsum("tk,tkh->th", topk_weights, y_assign)
    if config.num_shared_experts:
      y = y + _shared_experts(params, xs, config, f32)
  return y.reshape(x.shape), aux
