"""Ordering by data: `after` makes an array wait for others, where XLA could otherwise run it earlier.

A one-sided call must not start before the collective that frees its buffers, nor a backward pass before the
forward output whose buffers it should not overlap; XLA orders ops by their data only, so the order is made data.
`ordered`, `after_in_backward` and `joined` are identities whose custom VJPs order the backward pass too (the MoE
layer orders its collectives with its one-sided calls with them).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import numpy as np

import jax
import jax.numpy as jnp


# Widths of the unsigned ints XLA computes with (it has 1-bit ints as a storage type only).
_UINT_WIDTHS = (2, 4, 8, 16, 32, 64)

# The dtypes XLA holds and computes with, by name. JAX may name more than XLA holds (jax 0.12.1 names complex32
# and float8_e5m3fnu, which no device accepts, and XLA:CPU aborts the process compiling a program with one): a
# dtype not listed is refused by name rather than passed on.
_HELD_NAMES = (
    "bool_", "int2", "int4", "int8", "int16", "int32", "int64", "uint2", "uint4", "uint8", "uint16", "uint32",
    "uint64", "float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn", "float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "bfloat16", "float16",
    "float32", "float64", "complex64", "complex128")
_HELD = frozenset(jnp.dtype(getattr(jnp, n)) for n in _HELD_NAMES if hasattr(jnp, n))


def _bits_type(dtype) -> Optional[np.dtype]:
  """The unsigned int type of dtype's width, or None: bool, complex, and widths without one XLA computes with
  (the 6-bit floats, the 1-bit ints)."""
  dtype = jnp.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.floating):
    bits = jnp.finfo(dtype).bits
  elif jnp.issubdtype(dtype, jnp.integer):
    bits = jnp.iinfo(dtype).bits
  else:
    return None
  return jnp.dtype(f"uint{bits}") if bits in _UINT_WIDTHS else None


def _readable(dtype) -> bool:
  """Whether XLA can read the bits of dtype's values: a dep must be of such a dtype, to order anything."""
  return dtype in _HELD and (
      dtype == jnp.bool_ or jnp.issubdtype(dtype, jnp.complexfloating) or _bits_type(dtype) is not None)


def _first_bits(a: jax.Array) -> jax.Array:
  """The bits of ``a``'s first element (the real part's, for complex) as a scalar unsigned int."""
  v = a.reshape(-1)[0]
  if v.dtype == jnp.bool_:
    return v.astype(jnp.uint8)
  if jnp.issubdtype(v.dtype, jnp.complexfloating):
    v = jax.lax.real(v)
  return jax.lax.bitcast_convert_type(v, _bits_type(v.dtype))


def _kept_or_flipped(keep: jax.Array, bits: jax.Array) -> jax.Array:
  """``bits`` where keep holds, else all of them flipped: the two branches differ whatever bits is."""
  return jnp.where(keep, bits, jnp.bitwise_not(bits))


@jax.custom_jvp
def _after(x: jax.Array, deps: tuple[jax.Array, ...]) -> jax.Array:
  # (bits | 1) != 0 always holds, but no compiler can tell from the bits of a value it does not know: the select
  # keeps x's first element, and x as a whole comes to depend on every dep. One element is rewritten, in place.
  # The other branch differs from x's element even where x is a constant: select(p, c, c) would fold to c, and the
  # dependency with it (a zero cotangent is such a constant).
  # The select runs on x's bits, as unsigned ints: XLA computes a select of a type it lacks natively (float8) in a
  # wider float, which keeps the value but not a NaN's sign or payload.
  keep = functools.reduce(jnp.logical_and, [(_first_bits(d) | 1) != 0 for d in deps])
  idx = (0,) * x.ndim
  bits_type = _bits_type(x.dtype)
  if bits_type is not None:
    bits = jax.lax.bitcast_convert_type(x, bits_type)
    bits = bits.at[idx].set(_kept_or_flipped(keep, bits[idx]))
    return jax.lax.bitcast_convert_type(bits, x.dtype)
  v = x[idx]
  if v.dtype == jnp.bool_:
    v = jnp.where(keep, v, jnp.logical_not(v))
  elif jnp.issubdtype(v.dtype, jnp.complexfloating):
    imag = jax.lax.imag(v)
    imag = jax.lax.bitcast_convert_type(
        _kept_or_flipped(keep, jax.lax.bitcast_convert_type(imag, _bits_type(imag.dtype))), imag.dtype)
    v = jax.lax.complex(jax.lax.real(v), imag)
  else:
    # Widths without an unsigned int (the 6-bit floats): a select on the value, whose other branch is made from a
    # dep's bits, so it is no constant; these types have no NaN, and every value's bits are kept.
    other = _first_bits(deps[0]).astype(jnp.float32).astype(x.dtype)
    v = jnp.where(keep, v, other)
  return x.at[idx].set(v)


@_after.defjvp
def _after_jvp(primals, tangents):
  return _after(*primals), tangents[0]


def _is_array(v: Any) -> bool:
  return isinstance(v, (jax.Array, np.ndarray, np.generic))


def after(x: jax.Array, *deps: Any) -> jax.Array:
  """``x``, unchanged, computed only once every array of ``deps`` (pytrees of arrays) is: a data dependency.

  Orders a collective and a one-sided call (see `Workspace`): ``jax.lax.psum(after(g, y), axis)`` starts after
  the call that made y, ``dispatch(after(x, s), ...)`` after the psum that made s. Costs a select of one element,
  on its bits, which no compiler pass removes, also where x is a constant (unlike
  `jax.lax.optimization_barrier`, which XLA:CPU drops before it schedules). Differentiable in x (its gradient is
  the identity), not in deps. Empty arrays order nothing.

  Args:
    x: a jax or NumPy array, of any dtype XLA computes with: every dtype JAX names but the 1-bit ints and those no
      device holds (complex32 and float8_e5m3fnu in jax 0.12.1); the error names the ones taken.
    *deps: arrays or pytrees of arrays, of any dtype whose bits XLA can read: those of x but the 6-bit floats.
      Python scalars are refused, not taken as constants: a constant orders nothing.

  Returns:
    x, bit for bit, in the same dtype and shape: NaNs keep their sign and payload, in every float type (float8
    and float4 ones included), in complex ones and with x64.

  Raises:
    TypeError: x is not an array or is of a dtype not held; a leaf of deps is not an array, or is of a dtype not
      held or a 6-bit float.
  """
  if not _is_array(x):
    raise TypeError(f"after: x must be an array, got {type(x).__name__}")
  if x.dtype != jax.dtypes.float0 and x.dtype not in _HELD:
    raise TypeError(f"after: x must have a dtype XLA computes with (one of {', '.join(_HELD_NAMES)}), got {x.dtype}")
  leaves = []
  for path, d in jax.tree_util.tree_flatten_with_path(deps)[0]:
    where = f"deps{jax.tree_util.keystr(path)}"
    if not _is_array(d):
      raise TypeError(f"after: {where} must be an array, got {type(d).__name__}")
    if d.dtype == jax.dtypes.float0:
      continue
    if not _readable(d.dtype):
      raise TypeError(f"after: {where} must have a dtype whose bits XLA can read (one of {', '.join(_HELD_NAMES)} "
                      f"but the 6-bit floats), got {d.dtype}")
    if not d.size:
      continue
    leaves.append(jnp.asarray(d))
  if not leaves or not x.size or x.dtype == jax.dtypes.float0:
    return x
  return _after(jnp.asarray(x), tuple(leaves))


# ----------------------------------------------------------------------------------------------------------------
# Orders in both passes: the forward's order by `after`, the backward's by the cotangents' own `after`s
# ----------------------------------------------------------------------------------------------------------------


@jax.custom_vjp
def ordered(first, then):
  """(first, then), unchanged: `then` is computed after `first`, and in the backward `first`'s cotangents after
  `then`'s."""
  return first, after(then, first)


def _ordered_fwd(first, then):
  return ordered(first, then), None


def _ordered_bwd(_, cts):
  ct_first, ct_then = cts
  return jax.tree.map(lambda c: after(c, ct_then), ct_first), ct_then


ordered.defvjp(_ordered_fwd, _ordered_bwd)


@jax.custom_vjp
def after_in_backward(x, dep):
  """x, unchanged; in the backward its cotangent is computed after `dep`, a (small) forward value."""
  return x


def _after_in_backward_fwd(x, dep):
  return x, dep


def _after_in_backward_bwd(dep, ct):
  return after(ct, dep), jnp.zeros_like(dep)


after_in_backward.defvjp(_after_in_backward_fwd, _after_in_backward_bwd)


@jax.custom_vjp
def joined(tree):
  """tree, unchanged; in the backward each of its cotangents is computed after all of them."""
  return tree


def _joined_fwd(tree):
  return tree, None


def _joined_bwd(_, cts):
  return (jax.tree.map(lambda c: after(c, cts), cts),)


joined.defvjp(_joined_fwd, _joined_bwd)
