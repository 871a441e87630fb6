"""The compiled extension: loading it, registering its FFI targets once, and choosing an implementation.

`import jax_moe_a2a` works without the extension; only asking for the FFI path needs it. Every op takes
``impl="auto" | "ffi" | "reference"``; the environment variable ``JAX_MOE_A2A_IMPL`` overrides ``"auto"``
(set it to ``reference`` to switch every custom call off, or to ``ffi`` to require them).
"""

from __future__ import annotations

import os
import threading
from types import ModuleType
from typing import Any, Optional

import jax

IMPLS = ("auto", "ffi", "reference")
ENV_IMPL = "JAX_MOE_A2A_IMPL"
TARGET_PREFIX = "jax_moe_a2a_"

# Platform names as the extension reports them -> JAX backend names.
_BACKEND_OF_PLATFORM = {"cpu": "cpu", "CUDA": "gpu"}

_lock = threading.Lock()
_module: Optional[ModuleType] = None
_import_error: Optional[BaseException] = None
_registered: Optional[frozenset[str]] = None


def _load() -> Optional[ModuleType]:
  global _module, _import_error
  if _module is None and _import_error is None:
    try:
      from jax_moe_a2a import _jax_moe_a2a  # pylint: disable=import-outside-toplevel
      _module = _jax_moe_a2a
    except ImportError as e:  # built without the extension, or it does not load here
      _import_error = e
  return _module


def available() -> bool:
  """Whether the compiled extension is importable."""
  return _load() is not None


def extension() -> ModuleType:
  """The compiled extension module, or a RuntimeError saying how to build it."""
  module = _load()
  if module is None:
    raise RuntimeError(
        "jax_moe_a2a: the FFI path needs the compiled extension jax_moe_a2a._jax_moe_a2a, which could not be "
        f"imported ({_import_error}). Build it with `pip install .` in the repository (JAX_MOE_A2A_CUDA=ON to "
        "require the CUDA handlers), or use impl='reference'.")
  return module


def register() -> frozenset[str]:
  """Registers every FFI target of the extension with JAX, once; returns the backends that have handlers."""
  global _registered
  with _lock:
    if _registered is None:
      module = extension()
      backends = set()
      for platform, targets in module.registrations().items():
        for name, capsule in targets.items():
          jax.ffi.register_ffi_target(name, capsule, platform=platform)
        backends.add(_BACKEND_OF_PLATFORM[platform])
      _registered = frozenset(backends)
    return _registered


def with_cuda() -> bool:
  """Whether the extension exists and was built with its CUDA handlers."""
  return available() and bool(extension().with_cuda())


def resolve_impl(op: str, impl: str) -> str:
  """Returns "ffi" or "reference" for `op` called with `impl` on the default backend.

  "auto" becomes ``$JAX_MOE_A2A_IMPL`` when set, else "ffi" when the extension has handlers for the default
  backend, else "reference". "ffi" raises when the extension is missing or lacks handlers for the backend.
  """
  if impl not in IMPLS:
    raise ValueError(f"{op}: impl must be one of {', '.join(IMPLS)}, got {impl!r}")
  if impl == "auto":
    impl = os.environ.get(ENV_IMPL) or "auto"  # set but empty: as if unset
    if impl not in IMPLS:
      raise ValueError(f"{op}: ${ENV_IMPL} must be one of {', '.join(IMPLS)}, got {impl!r}")
  backend = jax.default_backend()
  if impl == "auto":
    return "ffi" if available() and backend in register() else "reference"
  if impl == "ffi":
    backends = register()
    if backend not in backends:
      raise RuntimeError(f"{op}: impl='ffi' needs handlers for the {backend!r} backend, but the extension was built "
                         f"for {sorted(backends)}. Rebuild with JAX_MOE_A2A_CUDA=ON for GPUs, or use "
                         "impl='reference'.")
  return impl


def varying_axes(a: Any) -> set:
  """The shard_map axes `a` is typed as varying over (empty outside shard_map and for non-arrays)."""
  manual = getattr(jax.typeof(a), "manual_axis_type", None) if isinstance(a, jax.Array) else None
  return set(manual.varying) if manual is not None else set()


def vary_over(tree: Any, axes: set) -> Any:
  """Every array of `tree` typed as varying over `axes` too (a no-op for those it already varies over)."""
  def cast(y):
    missing = axes - varying_axes(y)
    return jax.lax.pcast(y, tuple(sorted(missing, key=str)), to="varying") if missing else y
  return jax.tree.map(cast, tree) if axes else tree


def ffi_call(target: str, result_shape_dtypes: Any, *args: Any, **attrs: Any):
  """Calls FFI target ``jax_moe_a2a_<target>`` (registering the extension first) with `args` and `attrs`.

  Under `jax.vmap` the call runs once per batch element, in order (``vmap_method="sequential"``): every handler
  takes unbatched operands, and the one-sided calls then make one exchange per element on every rank alike.
  Inside `shard_map` the results are typed as varying over every axis an operand varies over: `jax.ffi.ffi_call`
  types them as varying over none although each shard computes its own, and a collective would then take them for
  equal on every shard (a `pmax` for an identity) and a VJP would refuse their cotangents' types.
  """
  register()
  call = jax.ffi.ffi_call(TARGET_PREFIX + target, result_shape_dtypes, vmap_method="sequential")
  return vary_over(call(*args, **attrs), set().union(*(varying_axes(a) for a in args)))
