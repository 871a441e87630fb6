"""Row movement of the expert stage: gathers of rows by index, and weighted sums of k gathered rows.

The expert stage expands the received rows into expert order (`scatter_rows`: each row to its k sorted positions;
`gather_rows` by index where a row is read once per position) and brings the expert outputs back, weighted and
summed over each token's k assignments (`sum_rows`); their backward passes are the same operations the other way
round. Each is the custom call ``jax_moe_a2a_<op>`` (a loop on CPU; on GPUs one warp per row, or per 256-value
segment of one, with wide loads) or its pure-JAX reference, with the same bits.

Indices outside the source rows select nothing: `gather_rows` gives a zero row, and `sum_rows` adds +0 without
reading a source row (a NaN in a row that is not selected reaches no output).
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe_a2a import _ffi

_FLOAT_ROWS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
# The custom calls' float rows; float16 takes the reference.
_CALL_ROWS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def _check_index(op: str, name: str, idx: jax.Array, ndim: int) -> jax.Array:
  if not jnp.issubdtype(idx.dtype, jnp.integer) or idx.ndim != ndim:
    raise ValueError(f"{op}: {name} must be a {ndim}-D integer array, got {idx.dtype} of shape {tuple(idx.shape)}")
  return idx.astype(jnp.int32)


def _float_row_dtype(op: str, name: str, dtype: Any) -> Any:
  dtype = jnp.dtype(dtype)
  if dtype not in _FLOAT_ROWS:
    raise ValueError(f"{op}: {name} must be bfloat16, float16 or float32, got {dtype.name}")
  return dtype


def _use_ffi(op: str, impl: str, dtypes_ok: bool, gpu_ok: bool, why: str) -> bool:
  """Whether `op` takes its custom call: "auto" takes the reference for float16 rows (the handlers take bfloat16 and
  float32) and for shapes the GPU kernel does not handle; "ffi" refuses them."""
  resolved = _ffi.resolve_impl(op, impl)
  if resolved != "ffi":
    return False
  if not dtypes_ok or (not gpu_ok and jax.default_backend() == "gpu"):
    if impl == "ffi":
      raise ValueError(f"{op}: impl='ffi' needs bfloat16 or float32 rows" + (f" and, on GPUs, {why}" if why else ""))
    return False
  return True


def gather_rows(x: jax.Array, idx: jax.Array, *, scale: Optional[jax.Array] = None, out_dtype: Any = None,
                impl: str = "auto") -> jax.Array:
  """``out[i] = x[idx[i]]``, or with `scale`, ``float32(x[idx[i]]) * scale[i]`` rounded to `out_dtype`.

  Args:
    x: [R, H] rows (any dtype without a scale; bfloat16, float16 or float32 with one).
    idx: [A] integer; an index outside [0, R) gives a zero row.
    scale: None, or [A] float32, one factor per output row.
    out_dtype: with a scale, bfloat16, float16 or float32 (default x's dtype); without one it must be x's dtype or
      None.
    impl: "auto", "ffi" or "reference". The custom call takes rows of any dtype and width without a scale, and
      bfloat16 and float32 rows with one (on GPUs with H % 8 == 0); "auto" takes the reference otherwise.

  Returns:
    [A, H] of out_dtype.
  """
  op = "gather_rows"
  if x.ndim != 2:
    raise ValueError(f"{op}: x must be [R, H], got shape {tuple(x.shape)}")
  idx = _check_index(op, "idx", idx, 1)
  out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
  if scale is None:
    if out_dtype != jnp.dtype(x.dtype):
      raise ValueError(f"{op}: out_dtype without a scale must be x's dtype {jnp.dtype(x.dtype).name}, "
                       f"got {out_dtype.name}")
    dtypes_ok, gpu_ok, why = True, True, ""
  else:
    _float_row_dtype(op, "x with a scale", x.dtype)
    _float_row_dtype(op, "out_dtype with a scale", out_dtype)
    if scale.shape != idx.shape or jnp.dtype(scale.dtype) != jnp.dtype(jnp.float32):
      raise ValueError(f"{op}: scale must be float32 {tuple(idx.shape)} (one per idx), got {scale.dtype} of shape "
                       f"{tuple(scale.shape)}")
    dtypes_ok = jnp.dtype(x.dtype) in _CALL_ROWS and out_dtype in _CALL_ROWS
    gpu_ok, why = x.shape[1] % 8 == 0, "H % 8 == 0 with a scale"
  if _use_ffi(op, impl, dtypes_ok, gpu_ok, why) and idx.shape[0] > 0:
    no_scale = jnp.zeros((0,), jnp.float32)
    return _ffi.ffi_call("gather_rows", jax.ShapeDtypeStruct((idx.shape[0], x.shape[1]), out_dtype), x, idx,
                         no_scale if scale is None else scale)
  return gather_rows_reference(x, idx, scale=scale, out_dtype=out_dtype)


def gather_rows_reference(x: jax.Array, idx: jax.Array, *, scale: Optional[jax.Array] = None,
                          out_dtype: Any = None) -> jax.Array:
  """The pure-JAX reference of `gather_rows` (no argument checks)."""
  valid = ((idx >= 0) & (idx < x.shape[0]))[:, None]
  rows = x[jnp.clip(idx, 0, max(x.shape[0] - 1, 0))] if x.shape[0] else jnp.zeros((idx.shape[0], x.shape[1]), x.dtype)
  if scale is None:
    return jnp.where(valid, rows, jnp.zeros((), x.dtype))
  out_dtype = x.dtype if out_dtype is None else out_dtype
  return jnp.where(valid, rows.astype(jnp.float32) * scale[:, None], 0.0).astype(out_dtype)


def scatter_rows(x: jax.Array, pos: jax.Array, *, impl: str = "auto") -> jax.Array:
  """``out[pos[r, j]] = x[r]``: each row of x written to its K positions, [R * K, H].

  pos must name every output row once (a permutation of [0, R * K) laid out as [R, K]), as the expert stage's
  sorted positions do; then this equals ``gather_rows(x, idx)`` with ``idx[pos[r, j]] = r``, bit for bit, but reads
  each row of x once where the gather reads it once per position (K times from memory when x exceeds the cache).

  Args:
    x: [R, H] rows of any dtype.
    pos: [R, K] integer positions, a permutation of [0, R * K).
    impl: "auto", "ffi" or "reference". The CPU handler and the reference refuse (the reference where pos is
      concrete) a pos that is not a permutation; the GPU kernel does not check it (a row named twice gets one of
      its values, a row named by none is not written).

  Returns:
    [R * K, H] of x's dtype.
  """
  op = "scatter_rows"
  if x.ndim != 2:
    raise ValueError(f"{op}: x must be [R, H], got shape {tuple(x.shape)}")
  pos = _check_index(op, "pos", pos, 2)
  if pos.shape[0] != x.shape[0]:
    raise ValueError(f"{op}: pos must be [R, K] with R = {x.shape[0]} (x's rows), got shape {tuple(pos.shape)}")
  if _use_ffi(op, impl, True, True, "") and pos.size > 0:
    return _ffi.ffi_call("scatter_rows", jax.ShapeDtypeStruct((pos.size, x.shape[1]), x.dtype), x, pos)
  return scatter_rows_reference(x, pos)


def scatter_rows_reference(x: jax.Array, pos: jax.Array) -> jax.Array:
  """The pure-JAX reference of `scatter_rows`: a gather by the inverse permutation (no argument checks beyond a
  concrete pos being a permutation)."""
  num = pos.size
  flat = pos.reshape(-1)
  if not isinstance(flat, jax.core.Tracer):
    seen = np.zeros(num, bool)
    values = np.asarray(flat)
    ok = values.min(initial=0) >= 0 and values.max(initial=-1) < num
    if ok:
      seen[values] = True
    if not ok or not seen.all():
      raise ValueError(f"scatter_rows: pos must be a permutation of [0, {num}), got {values.tolist()[:16]}"
                       + ("..." if num > 16 else ""))
  src = jnp.zeros((num,), jnp.int32).at[flat].set(jnp.arange(num, dtype=jnp.int32) // max(pos.shape[1], 1),
                                                   unique_indices=True)
  return x[src] if num else jnp.zeros((0, x.shape[1]), x.dtype)


def sum_rows(y: jax.Array, pos: jax.Array, weights: Optional[jax.Array] = None, *, out_dtype: Any = jnp.float32,
             impl: str = "auto") -> jax.Array:
  """``out[r] = sum_j float32(y[pos[r, j]]) * weights[r, j]`` over j in ascending order, rounded to `out_dtype`.

  Each product is rounded to float32 and added in order (no fused multiply-add); a term whose pos is outside
  [0, A) adds +0 and its row is not read. Without weights every weight is 1 (the product is exact).

  Args:
    y: [A, H] bfloat16, float16 or float32.
    pos: [R, K] integer source rows.
    weights: None, or [R, K] float32.
    out_dtype: bfloat16, float16 or float32.
    impl: "auto", "ffi" or "reference". The custom call takes bfloat16 and float32 (y and out), and on GPUs
      H % 8 == 0; "auto" takes the reference otherwise.

  Returns:
    [R, H] of out_dtype.
  """
  op = "sum_rows"
  if y.ndim != 2:
    raise ValueError(f"{op}: y must be [A, H], got shape {tuple(y.shape)}")
  _float_row_dtype(op, "y", y.dtype)
  out_dtype = _float_row_dtype(op, "out_dtype", out_dtype)
  pos = _check_index(op, "pos", pos, 2)
  if weights is not None and (weights.shape != pos.shape or jnp.dtype(weights.dtype) != jnp.dtype(jnp.float32)):
    raise ValueError(f"{op}: weights must be float32 {tuple(pos.shape)} (the shape of pos), got {weights.dtype} of "
                     f"shape {tuple(weights.shape)}")
  dtypes_ok = jnp.dtype(y.dtype) in _CALL_ROWS and out_dtype in _CALL_ROWS
  if _use_ffi(op, impl, dtypes_ok, y.shape[1] % 8 == 0, "H % 8 == 0") and pos.shape[0] > 0:
    no_weights = jnp.zeros((0,), jnp.float32)
    return _ffi.ffi_call("sum_rows", jax.ShapeDtypeStruct((pos.shape[0], y.shape[1]), out_dtype), y, pos,
                         no_weights if weights is None else weights)
  return sum_rows_reference(y, pos, weights, out_dtype=out_dtype)


def sum_rows_reference(y: jax.Array, pos: jax.Array, weights: Optional[jax.Array] = None, *,
                       out_dtype: Any = jnp.float32) -> jax.Array:
  """The pure-JAX reference of `sum_rows` (no argument checks)."""
  num = y.shape[0]
  out = jnp.zeros((pos.shape[0], y.shape[1]), jnp.float32)
  for j in range(pos.shape[1]):
    p = pos[:, j]
    valid = ((p >= 0) & (p < num))[:, None]
    term = y[jnp.clip(p, 0, max(num - 1, 0))].astype(jnp.float32) if num else jnp.zeros_like(out)
    if weights is not None:
      term = term * weights[:, j:j + 1]
    out = out + jnp.where(valid, term, 0.0)
  return out.astype(out_dtype)
