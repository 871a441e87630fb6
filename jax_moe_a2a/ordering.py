"""Ordering by data: `after` makes an array wait for others, where XLA could otherwise run it earlier.

A one-sided call must not start before the collective that frees its buffers, nor a backward pass before the
forward output whose buffers it should not overlap; XLA orders ops by their data only, so the order is made data.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp


def _uint(dtype) -> Any:
  """The unsigned int type of dtype's width, or None (bool, 4-bit types)."""
  if dtype == jnp.bool_:
    return None
  bits = jnp.finfo(dtype).bits if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).bits
  return jnp.dtype(f"uint{bits}") if bits in (8, 16, 32, 64) else None


def _first_bits(a: jax.Array) -> jax.Array:
  """The bits of ``a``'s first element as a scalar unsigned int."""
  v = a.reshape(-1)[0]
  if v.dtype == jnp.bool_:
    return v.astype(jnp.uint8)
  if _uint(v.dtype) is None:  # 4-bit types
    v = v.astype(jnp.float32)
  return jax.lax.bitcast_convert_type(v, _uint(v.dtype))


def _other_than(v: jax.Array) -> jax.Array:
  """A scalar of v's dtype whose bits differ from v's (all flipped; 4-bit types: v + 1, which may not differ)."""
  if v.dtype == jnp.bool_:
    return jnp.logical_not(v)
  if _uint(v.dtype) is None:
    return v + jnp.ones((), v.dtype)
  return jax.lax.bitcast_convert_type(jnp.bitwise_not(jax.lax.bitcast_convert_type(v, _uint(v.dtype))), v.dtype)


@jax.custom_jvp
def _after(x: jax.Array, deps: tuple[jax.Array, ...]) -> jax.Array:
  # (bits | 1) != 0 always holds, but no compiler can tell from the bits of a value it does not know: the select
  # keeps x's first element, and x as a whole comes to depend on every dep. One element is rewritten, in place.
  # The other branch differs from x's element even where x is a constant: select(p, c, c) would fold to c, and the
  # dependency with it (a zero cotangent is such a constant).
  keep = functools.reduce(jnp.logical_and, [(_first_bits(d) | 1) != 0 for d in deps])
  idx = (0,) * x.ndim
  return x.at[idx].set(jnp.where(keep, x[idx], _other_than(x[idx])))


@_after.defjvp
def _after_jvp(primals, tangents):
  return _after(*primals), tangents[0]


def after(x: jax.Array, *deps: Any) -> jax.Array:
  """``x``, unchanged, computed only once every array of ``deps`` (pytrees of arrays) is: a data dependency.

  Orders a collective and a one-sided call (see `Workspace`): ``jax.lax.psum(after(g, y), axis)`` starts after
  the call that made y, ``dispatch(after(x, s), ...)`` after the psum that made s. Costs a select of one element,
  which no compiler pass removes (unlike `jax.lax.optimization_barrier`, which XLA:CPU drops before it schedules).
  Differentiable in x (its gradient is the identity), not in deps. Empty arrays order nothing.

  Args:
    x: any array.
    *deps: arrays or pytrees of arrays, any dtype.

  Returns:
    x, bit for bit, in the same dtype and shape.
  """
  leaves = tuple(jnp.asarray(d) for d in jax.tree.leaves(deps) if d.size and d.dtype != jax.dtypes.float0)
  if not leaves or not x.size or x.dtype == jax.dtypes.float0:
    return x
  return _after(jnp.asarray(x), leaves)
