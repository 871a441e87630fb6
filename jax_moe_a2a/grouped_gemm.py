"""Grouped expert GEMMs. FP8 block-scaled: ``d[g] = a[g] @ b[g].T`` per expert group, E4M3 operands, bfloat16 output.

Activations are E4M3 with one float32 scale per 1x128 group of a row (`quant.quantize_fp8_blockwise`), weights are
E4M3 with one float32 scale per 128x128 block (`quant.quantize_fp8_weight`), in the "NT" layout of
`expert_mlp.ExpertWeights`: ``b`` is [G, N, K] with K contiguous. The product accumulates in float32 and is rounded
to bfloat16 once.

Two layouts of the rows, told apart by the rank of ``a``:

- **contiguous** (``a`` [M, K]): rows sorted by group; group g owns the ``group_sizes[g]`` rows after those of
  groups 0..g-1 (what `jax.lax.ragged_dot` takes). Sizes are clamped to >= 0 and to the rows that are left, so a
  sum above M drops the excess rows of the last groups; rows past the owned ones come back as zeros.
- **masked** (``a`` [G, R, K]): group g owns its first ``clamp(group_sizes[g], 0, R)`` rows; the other rows of d
  are zeros. This is the layout of a per-expert receive buffer, read without a copy.

Group sizes are run-time values and stay on the device: the custom call has no host synchronization and can
be captured in a CUDA graph. Empty groups are fine.

Implementations (``impl=``): ``"ffi"`` is the custom call ``jax_moe_a2a_grouped_gemm_fp8`` -- on GPUs a
CUTLASS SM90 warp-specialized grouped GEMM with blockwise scaling (TMA, wgmma, float32 promotion every 128 of
K), on CPU a loop over the dequantized operands in float32; ``"reference"`` is the pure-JAX reference (dequantize,
float32 matmul at HIGHEST precision); ``"auto"`` picks as `jax_moe_a2a._ffi.resolve_impl` says. The
implementations agree to float32 rounding of the accumulation (then one bfloat16 rounding), not bit for bit.

This op is not differentiable by itself (its operands are FP8 codes); `expert_mlp.swiglu_mlp_fp8` is the trainable
expert MLP built on it.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe_a2a import _ffi, quant

BLOCK = quant.FP8_BLOCK
MAX_GROUPS = 65535


def _as_group_sizes(op: str, group_sizes: Any) -> Any:
  """Group sizes given as a Python list or tuple of ints, as an int32 array; anything else as it is.

  Python ints have no width, so a list is converted (after a range check); an array (NumPy's or JAX's) names its
  dtype, and one that is not int32 is refused by the dtype check rather than narrowed here.

  Raises:
    TypeError: a list or tuple that is not made of ints.
    ValueError: a list or tuple with a value outside the int32 range.
  """
  if not isinstance(group_sizes, (list, tuple)):
    return group_sizes
  values = np.asarray(group_sizes)
  if values.dtype.kind not in "iu":
    kind = type(group_sizes).__name__ + ("" if values.dtype == object else f" of {values.dtype.name}")
    raise TypeError(f"{op}: group_sizes must be int32 [G] (an int32 array, or a list of ints), got a {kind}")
  info = np.iinfo(np.int32)
  if values.size and (values.min() < info.min or values.max() > info.max):
    raise ValueError(f"{op}: group_sizes must fit int32 [{info.min}, {info.max}], got values in "
                     f"[{values.min()}, {values.max()}]")
  return jnp.asarray(values.astype(np.int32))


def _check(op: str, a: Any, a_sf: Any, b: Any, b_sf: Any, group_sizes: Any) -> tuple[bool, int, int, int, int]:
  """Checks the operands; returns (masked, G, rows, N, K) with rows = M (contiguous) or R (masked)."""
  for name, v, dtype in (("a", a, jnp.float8_e4m3fn), ("b", b, jnp.float8_e4m3fn), ("a_sf", a_sf, jnp.float32),
                         ("b_sf", b_sf, jnp.float32), ("group_sizes", group_sizes, jnp.int32)):
    if v is None:
      raise ValueError(f"{op}: {name} must be given, got None")
    if jnp.dtype(v.dtype) != jnp.dtype(dtype):
      raise TypeError(f"{op}: {name} must be {jnp.dtype(dtype).name}, got {jnp.dtype(v.dtype).name}")
  if (b.ndim != 3 or not 1 <= b.shape[0] <= MAX_GROUPS or b.shape[1] % BLOCK or b.shape[2] % BLOCK
      or not b.shape[1] or not b.shape[2]):
    raise ValueError(f"{op}: b must be [G, N, K] with 1 <= G <= {MAX_GROUPS} and N, K positive multiples of "
                     f"{BLOCK}, got shape {tuple(b.shape)}")
  g, n, k = b.shape
  if a.ndim == 2:
    masked, rows = False, a.shape[0]
    if a.shape[1] != k:
      raise ValueError(f"{op}: a (contiguous) must be [M, K] with K = {k} (from b), got shape {tuple(a.shape)}")
    want_sf = (rows, k // BLOCK)
  elif a.ndim == 3:
    masked, rows = True, a.shape[1]
    if a.shape[0] != g or a.shape[2] != k:
      raise ValueError(f"{op}: a (masked) must be [G, R, K] with G = {g}, K = {k} (from b), got shape "
                       f"{tuple(a.shape)}")
    want_sf = (g, rows, k // BLOCK)
  else:
    raise ValueError(f"{op}: a must be [M, K] (contiguous) or [G, R, K] (masked), got shape {tuple(a.shape)}")
  if tuple(a_sf.shape) != want_sf:
    dims = "[G, R, K/128]" if masked else "[M, K/128]"
    raise ValueError(f"{op}: a_sf must be {dims} = {want_sf}, got shape {tuple(a_sf.shape)}")
  if tuple(b_sf.shape) != (g, n // BLOCK, k // BLOCK):
    raise ValueError(f"{op}: b_sf must be [G, N/128, K/128] = {(g, n // BLOCK, k // BLOCK)}, got shape "
                     f"{tuple(b_sf.shape)}")
  if tuple(group_sizes.shape) != (g,):
    raise ValueError(f"{op}: group_sizes must be [G] = ({g},), got shape {tuple(group_sizes.shape)}")
  return masked, g, rows, n, k


def owned_rows(group_sizes: jax.Array, rows: int, *, masked: bool) -> tuple[jax.Array, jax.Array]:
  """(start, size) per group after clamping, as int32 [G] each (start is 0 for every masked group).

  Contiguous: the running total saturates at `rows`, as the custom call's 64-bit one does once clamped: sizes are
  clamped to [0, rows] and added with ``min(a + b, rows)`` (computed as ``a + min(b, rows - a)``, so no partial sum
  leaves [0, rows] and nothing wraps in int32, e.g. for sizes [2**31 - 1, 1, 1]).
  """
  req = jnp.clip(group_sizes.astype(jnp.int32), 0, rows)
  if masked:
    return jnp.zeros_like(req), req
  if req.shape[0] == 0:
    return req, req
  end = jax.lax.associative_scan(lambda a, b: a + jnp.minimum(b, rows - a), req)
  start = jnp.concatenate([jnp.zeros((1,), jnp.int32), end[:-1]])
  return start, end - start


def _group_rows(group_sizes: jax.Array, rows: int) -> jax.Array:
  """Owning group of each of `rows` contiguous rows, int32 [rows]; G (no group) for rows past the owned ones."""
  start, size = owned_rows(group_sizes, rows, masked=False)
  end = start + size
  # Row r belongs to the first group whose end exceeds r (empty groups have end == start and own nothing).
  return jnp.searchsorted(end, jnp.arange(rows, dtype=jnp.int32), side="right").astype(jnp.int32)


def grouped_matmul_reference(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                             precision: Any = None, preferred_element_type: Any = None) -> jax.Array:
  """``lhs[rows of g] @ rhs[g]`` per group: `jax.lax.ragged_dot`'s product, with each group's values kept apart.

  XLA (on CPU and GPU) expands ragged_dot into one dense product over all groups with the other groups' rows of
  lhs zeroed, so a NaN or an infinity in one group's rhs reaches every row (0 * NaN = NaN). Here group g's product
  reads lhs with every row outside g zeroed and only g's rows of it are kept, one group at a time: the same work
  as that expansion, and a non-finite value of one group's rows or weights changes only that group's rows -- also
  in the gradients JAX derives from it (dlhs is selected per group, drhs[g] contracts only g's rows).

  Args:
    lhs: [M, K] rows sorted by group (grouped as `owned_rows` with masked=False says; rows no group owns give 0).
    rhs: [G, K, N].
    group_sizes: int32 [G].
    precision, preferred_element_type: as for `jax.lax.dot`.

  Returns:
    [M, N].
  """
  rows = lhs.shape[0]
  owner = _group_rows(group_sizes, rows)[:, None]
  out_dtype = preferred_element_type or jnp.result_type(lhs, rhs)

  def one(g, y):
    mine = owner == g
    yg = jnp.dot(jnp.where(mine, lhs, 0), rhs[g], precision=precision, preferred_element_type=preferred_element_type)
    return jnp.where(mine, yg.astype(out_dtype), y)

  return jax.lax.fori_loop(0, rhs.shape[0], one, jnp.zeros((rows, rhs.shape[2]), out_dtype))


def _grouped_wgrad_reference(a: jax.Array, b: jax.Array, group_sizes: jax.Array) -> jax.Array:
  """Per group, ``a[rows of g].T @ b[rows of g]`` in float32 at HIGHEST precision, [G, K, N], both operands zeroed
  outside the group (so a non-finite row reaches only its own group's product)."""
  rows = a.shape[0]
  owner = _group_rows(group_sizes, rows)[:, None]

  def one(g):
    mine = owner == g
    return jax.lax.dot_general(jnp.where(mine, a, 0), jnp.where(mine, b, 0), (((0,), (0,)), ((), ())),
                               precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)

  return jax.lax.map(one, jnp.arange(group_sizes.shape[0], dtype=jnp.int32))


@jax.jit
def grouped_gemm_fp8_reference(a, a_sf, b, b_sf, group_sizes):
  """Pure-JAX reference of `grouped_gemm_fp8`: both operands dequantized to float32, multiplied at HIGHEST precision."""
  w = quant.dequantize_fp8_weight_reference(b, b_sf)  # [G, N, K]
  if a.ndim == 3:
    num_groups, rows, k = a.shape
    x = quant.dequantize_fp8_blockwise_reference(a.reshape(-1, k), a_sf.reshape(-1, k // BLOCK))
    y = jnp.einsum("grk,gnk->grn", x.reshape(num_groups, rows, k), w, precision=jax.lax.Precision.HIGHEST,
                   preferred_element_type=jnp.float32)
    _, size = owned_rows(group_sizes, rows, masked=True)
    live = jnp.arange(rows)[None, :] < size[:, None]
    return jnp.where(live[..., None], y, 0.0).astype(jnp.bfloat16)
  x = quant.dequantize_fp8_blockwise_reference(a, a_sf)
  y = grouped_matmul_reference(x, jnp.swapaxes(w, 1, 2), group_sizes, precision=jax.lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)
  return y.astype(jnp.bfloat16)


def scratch_bytes(num_groups: int) -> int:
  """Device scratch of one custom call with `num_groups` groups (0 on CPU)."""
  if jax.default_backend() != "gpu":
    return 0
  return int(_ffi.extension().grouped_gemm_scratch_bytes(int(num_groups)))


def _ffi_grouped_gemm_fp8(a, a_sf, b, b_sf, group_sizes, *, masked: bool, num_groups: int, n: int):
  out_shape = (*a.shape[:-1], n)
  out = (jax.ShapeDtypeStruct(out_shape, jnp.bfloat16),
         jax.ShapeDtypeStruct((scratch_bytes(num_groups),), jnp.uint8))
  d, _ = _ffi.ffi_call("grouped_gemm_fp8", out, a, a_sf, b, b_sf, group_sizes, masked=bool(masked))
  return d


def grouped_gemm_fp8(a: jax.Array, a_sf: jax.Array, b: jax.Array, b_sf: jax.Array, group_sizes: jax.Array, *,
                     impl: str = "auto") -> jax.Array:
  """Grouped ``a[g] @ b[g].T`` with FP8 block-scaled operands (see the module docstring for the layouts).

  Args:
    a: float8_e4m3fn activations, [M, K] (contiguous) or [G, R, K] (masked), K % 128 == 0.
    a_sf: float32 1x128 scales of `a`: [M, K/128] or [G, R, K/128] (docs/DESIGN.md §1.2), as
      `quant.quantize_fp8_blockwise` returns them by default. The kernel reads one group's scales as a compact
      block, which row slices of this layout are; the transposed [K/128, M] layout is not accepted.
    b: float8_e4m3fn weights [G, N, K], N and K multiples of 128.
    b_sf: float32 128x128 block scales of `b`, [G, N/128, K/128].
    group_sizes: int32 [G] rows per group (run-time values; clamped as the module docstring says); a list of
      ints is converted to int32 (a NumPy array must be int32).
    impl: "auto", "ffi" or "reference".

  Returns:
    bfloat16 [M, N] (contiguous) or [G, R, N] (masked); rows no group owns are 0.

  Raises:
    TypeError / ValueError: an operand has the wrong dtype or shape, or is None; the message names it and
      gives the expected and actual values.
  """
  op = "grouped_gemm_fp8"
  group_sizes = _as_group_sizes(op, group_sizes)
  masked, num_groups, _, n, _ = _check(op, a, a_sf, b, b_sf, group_sizes)
  if _ffi.resolve_impl(op, impl) == "ffi":
    return _ffi_grouped_gemm_fp8(a, a_sf, b, b_sf, group_sizes, masked=masked, num_groups=num_groups, n=n)
  return grouped_gemm_fp8_reference(a, a_sf, b, b_sf, group_sizes)


# ----------------------------------------------------------------------------------------------------------------
# bf16 grouped GEMMs: the expert MLP's forward, data-gradient and weight-gradient products
# ----------------------------------------------------------------------------------------------------------------

# Layouts of `b` in `grouped_gemm_bf16`: "nk" is [G, N, K] (K contiguous: d = a @ b[g].T, the forward product
# with the weights of `expert_mlp.ExpertWeights`), "kn" is [G, K, N] (N contiguous: d = a @ b[g], the data gradient
# with the same weights, read without a transposed copy).
B_LAYOUTS = ("nk", "kn")
_MODE = {"nk": 0, "kn": 1, "wgrad": 2}  # the custom call's `mode` attribute (grouped_gemm.cc)


def _check_bf16(op: str, name: str, v: Any, ndim: int) -> None:
  if v is None or not hasattr(v, "dtype"):
    raise TypeError(f"{op}: {name} must be a bfloat16 array, got {type(v).__name__}")
  if jnp.dtype(v.dtype) != jnp.dtype(jnp.bfloat16):
    raise TypeError(f"{op}: {name} must be bfloat16, got {jnp.dtype(v.dtype).name}")
  if v.ndim != ndim:
    raise ValueError(f"{op}: {name} must have {ndim} dimensions, got shape {tuple(v.shape)}")


def _check_group_sizes(op: str, group_sizes: Any, num_groups: Optional[int]) -> int:
  if not hasattr(group_sizes, "dtype") or jnp.dtype(group_sizes.dtype) != jnp.dtype(jnp.int32):
    raise TypeError(f"{op}: group_sizes must be an int32 array [G], got "
                    f"{getattr(getattr(group_sizes, 'dtype', None), 'name', type(group_sizes).__name__)}")
  if group_sizes.ndim != 1 or not 1 <= group_sizes.shape[0] <= MAX_GROUPS:
    raise ValueError(f"{op}: group_sizes must be [G] with 1 <= G <= {MAX_GROUPS}, got shape {tuple(group_sizes.shape)}")
  if num_groups is not None and group_sizes.shape[0] != num_groups:
    raise ValueError(f"{op}: group_sizes must be [G] = ({num_groups},) (G from b), got shape "
                     f"{tuple(group_sizes.shape)}")
  return group_sizes.shape[0]


def _wgrad_out_dtype(op: str, out_dtype: Any) -> jnp.dtype:
  """A weight gradient's output dtype: float32 or bfloat16 (what the optimizer keeps)."""
  try:
    out_dtype = jnp.dtype(out_dtype)
  except TypeError:
    out_dtype = None
  if out_dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
    raise ValueError(f"{op}: out_dtype must be float32 or bfloat16, got {out_dtype}")
  return out_dtype


def _check_width(op: str, name: str, v: int) -> None:
  if v <= 0 or v % 8:
    raise ValueError(f"{op}: {name} must be a positive multiple of 8 (16-byte rows), got {v}")


def _bf16_scratch(num_groups: int, mode: int, f32_out: bool = False) -> jax.ShapeDtypeStruct:
  nbytes = 0
  if jax.default_backend() == "gpu":
    nbytes = int(_ffi.extension().grouped_gemm_scratch_bytes(int(num_groups), int(mode), bool(f32_out)))
  return jax.ShapeDtypeStruct((nbytes,), jnp.uint8)


@functools.partial(jax.jit, static_argnames=("b_layout",))
def grouped_gemm_bf16_reference(a, b, group_sizes, *, b_layout):
  """Pure-JAX reference of `grouped_gemm_bf16`: float32 products at HIGHEST precision, one bfloat16 rounding."""
  rhs = jnp.swapaxes(b, 1, 2) if b_layout == "nk" else b  # [G, K, N]
  y = grouped_matmul_reference(a, rhs, group_sizes, precision=jax.lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)
  return y.astype(jnp.bfloat16)


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def grouped_gemm_bf16_wgrad_reference(a, b, group_sizes, *, out_dtype):
  """Pure-JAX reference of `grouped_gemm_bf16_wgrad`: one float32 product per group over its rows."""
  return _grouped_wgrad_reference(a, b, group_sizes).astype(out_dtype)


def grouped_gemm_bf16(a: jax.Array, b: jax.Array, group_sizes: jax.Array, *, b_layout: str = "nk",
                      impl: str = "auto") -> jax.Array:
  """Grouped bfloat16 GEMM over rows sorted by group: ``a[rows of g] @ b[g].T`` ("nk") or ``@ b[g]`` ("kn").

  Rows are grouped as in the contiguous FP8 layout (module docstring): group g owns the ``group_sizes[g]`` rows
  after those of groups 0..g-1, sizes clamped to >= 0 and to the rows that are left; rows no group owns give 0.
  On GPUs the custom call ``jax_moe_a2a_grouped_gemm_bf16`` runs CUTLASS's SM90 warp-specialized grouped GEMM
  (TMA, wgmma, float32 accumulation) with the group sizes on the device; the "kn" layout is read in place
  (no transposed copy of b). The reference is `grouped_matmul_reference` at HIGHEST precision (ragged_dot's product,
  each group kept apart).

  Args:
    a: bfloat16 [M, K], K a positive multiple of 8.
    b: bfloat16 weights, [G, N, K] for ``b_layout="nk"`` or [G, K, N] for ``"kn"``; N a positive multiple of 8.
    group_sizes: int32 [G] rows per group (run-time values); a list of ints is converted (a
      NumPy array must be int32).
    b_layout: "nk" or "kn".
    impl: "auto", "ffi" or "reference".

  Returns:
    bfloat16 [M, N]: the float32 product rounded once.
  """
  op = "grouped_gemm_bf16"
  if b_layout not in B_LAYOUTS:
    raise ValueError(f"{op}: b_layout must be one of {', '.join(B_LAYOUTS)}, got {b_layout!r}")
  _check_bf16(op, "a", a, 2)
  _check_bf16(op, "b", b, 3)
  rows, k = a.shape
  group_sizes = _as_group_sizes(op, group_sizes)
  num_groups = _check_group_sizes(op, group_sizes, b.shape[0])
  n, bk = (b.shape[1], b.shape[2]) if b_layout == "nk" else (b.shape[2], b.shape[1])
  if bk != k:
    dims = "[G, N, K]" if b_layout == "nk" else "[G, K, N]"
    raise ValueError(f"{op}: b must be {dims} with K = {k} (from a) for b_layout={b_layout!r}, got shape "
                     f"{tuple(b.shape)}")
  _check_width(op, "K", k)
  _check_width(op, "N", n)
  if _ffi.resolve_impl(op, impl) == "ffi":
    mode = _MODE[b_layout]
    out = (jax.ShapeDtypeStruct((rows, n), jnp.bfloat16), _bf16_scratch(num_groups, mode))
    return _ffi.ffi_call("grouped_gemm_bf16", out, a, b, group_sizes, mode=np.int32(mode))[0]
  return grouped_gemm_bf16_reference(a, b, group_sizes, b_layout=b_layout)


def grouped_gemm_bf16_wgrad(a: jax.Array, b: jax.Array, group_sizes: jax.Array, *, out_dtype=jnp.float32,
                            impl: str = "auto") -> jax.Array:
  """Per group, ``a[rows of g].T @ b[rows of g]``: the weight gradient of a grouped GEMM (float32 accumulation).

  The contraction runs over each group's rows (grouped as in `grouped_gemm_bf16`), so it differs per group; a group
  that owns no rows gives zeros. For the forward ``y = grouped_gemm_bf16(x, w, ...)`` with w [G, N, K], the
  gradient of w is ``grouped_gemm_bf16_wgrad(dy, x, ...)`` [G, N, K].

  Args:
    a: bfloat16 [M, K] (e.g. the output cotangent dy), K a positive multiple of 8.
    b: bfloat16 [M, N] (e.g. the forward input x), N a positive multiple of 8.
    group_sizes: int32 [G] rows per group; a list of ints is converted (a NumPy array must be int32).
    out_dtype: float32 or bfloat16 (the float32 sums rounded once; half the bytes to write).
    impl: "auto", "ffi" or "reference".

  Returns:
    [G, K, N] out_dtype.
  """
  op = "grouped_gemm_bf16_wgrad"
  _check_bf16(op, "a", a, 2)
  _check_bf16(op, "b", b, 2)
  if b.shape[0] != a.shape[0]:
    raise ValueError(f"{op}: b must be [M, N] with M = {a.shape[0]} (from a), got shape {tuple(b.shape)}")
  rows, k = a.shape
  n = b.shape[1]
  group_sizes = _as_group_sizes(op, group_sizes)
  num_groups = _check_group_sizes(op, group_sizes, None)
  _check_width(op, "K", k)
  _check_width(op, "N", n)
  out_dtype = _wgrad_out_dtype(op, out_dtype)
  if _ffi.resolve_impl(op, impl) == "ffi":
    mode, f32_out = _MODE["wgrad"], out_dtype == jnp.dtype(jnp.float32)
    out = (jax.ShapeDtypeStruct((num_groups, k, n), out_dtype), _bf16_scratch(num_groups, mode, f32_out))
    return _ffi.ffi_call("grouped_gemm_bf16", out, a, b, group_sizes, mode=np.int32(mode))[0]
  return grouped_gemm_bf16_wgrad_reference(a, b, group_sizes, out_dtype=out_dtype)


# ----------------------------------------------------------------------------------------------------------------
# FP8 weight gradient: per group, a contraction over its tokens of K-major operands with 128x1 scales
# ----------------------------------------------------------------------------------------------------------------


def _check_wgrad_fp8(op: str, a_t: Any, a_sf_t: Any, b_t: Any, b_sf_t: Any,
                     group_sizes: Any) -> tuple[int, int, int, int]:
  """Checks the operands of `grouped_gemm_fp8_wgrad`; returns (G, Na, Nb, P)."""
  for name, v, dtype in (("a_t", a_t, jnp.float8_e4m3fn), ("a_sf_t", a_sf_t, jnp.float32),
                         ("b_t", b_t, jnp.float8_e4m3fn), ("b_sf_t", b_sf_t, jnp.float32)):
    if v is None or not hasattr(v, "dtype"):
      raise TypeError(f"{op}: {name} must be a {jnp.dtype(dtype).name} array, got {type(v).__name__}")
    if jnp.dtype(v.dtype) != jnp.dtype(dtype):
      raise TypeError(f"{op}: {name} must be {jnp.dtype(dtype).name}, got {jnp.dtype(v.dtype).name}")
  num_groups = _check_group_sizes(op, group_sizes, None)
  for name, v in (("a_t", a_t), ("b_t", b_t)):
    if v.ndim != 2 or not v.shape[0] or v.shape[0] % BLOCK:
      raise ValueError(f"{op}: {name} must be [N, P] with N a positive multiple of {BLOCK}, got shape "
                       f"{tuple(v.shape)}")
  na, p = a_t.shape
  nb = b_t.shape[0]
  if p % BLOCK or p < BLOCK * num_groups:
    raise ValueError(f"{op}: a_t must be [Na, P] with P a multiple of {BLOCK} and P >= 128 * G = "
                     f"{BLOCK * num_groups} (G = {num_groups} from group_sizes: P = round_up(M, 128) + 128 G, "
                     f"quant.grouped_kmajor_length), got shape {tuple(a_t.shape)}")
  if b_t.shape[1] != p:
    raise ValueError(f"{op}: b_t must be [Nb, P] with P = {p} (from a_t), got shape {tuple(b_t.shape)}")
  for name, v, n in (("a_sf_t", a_sf_t, na), ("b_sf_t", b_sf_t, nb)):
    if tuple(v.shape) != (p // BLOCK, n):
      raise ValueError(f"{op}: {name} must be [P/128, N] = {(p // BLOCK, n)}, got shape {tuple(v.shape)}")
  return num_groups, na, nb, p


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def grouped_gemm_fp8_wgrad_reference(a_t, a_sf_t, b_t, b_sf_t, group_sizes, *, out_dtype=jnp.float32):
  """Pure-JAX reference of `grouped_gemm_fp8_wgrad`: both operands dequantized, one float32 product per group over its
  padded token columns at HIGHEST precision (the other columns zeroed, so a non-finite value stays in its group)."""
  num_groups = group_sizes.shape[0]
  p = a_t.shape[1]
  a = quant.dequantize_fp8_kmajor_reference(a_t, a_sf_t)
  b = quant.dequantize_fp8_kmajor_reference(b_t, b_sf_t)
  # P = round_up(M, 128) + 128 G: clamping against round_up(M, 128) reads the same columns as against M, since every
  # column past the quantizer's last row is code 0 (module docstring of the op).
  owner, _, _ = quant.kmajor_column_groups(group_sizes, p - BLOCK * num_groups, p)

  def one(g):
    mine = (owner == g)[None, :]
    return jax.lax.dot_general(jnp.where(mine, a, 0.0), jnp.where(mine, b, 0.0), (((1,), (1,)), ((), ())),
                               precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)

  return jax.lax.map(one, jnp.arange(num_groups, dtype=jnp.int32)).astype(out_dtype)


def wgrad_scratch_bytes(num_groups: int) -> int:
  """Device scratch of one `grouped_gemm_fp8_wgrad` custom call with `num_groups` groups (0 on CPU)."""
  if jax.default_backend() != "gpu":
    return 0
  return int(_ffi.extension().grouped_gemm_fp8_wgrad_scratch_bytes(int(num_groups)))


def grouped_gemm_fp8_wgrad(a_t: jax.Array, a_sf_t: jax.Array, b_t: jax.Array, b_sf_t: jax.Array,
                           group_sizes: jax.Array, *, out_dtype=jnp.float32, impl: str = "auto") -> jax.Array:
  """Per group, ``d[g] = A_g B_g^T`` over its tokens, A and B in the K-major FP8 of `quant.quantize_fp8_grouped_kmajor`.

  The FP8 weight gradient of the expert MLP (DeepSeek-V3's recipe): for ``y = x @ W[g]^T`` per group,
  ``dW = grouped_gemm_fp8_wgrad(*quantize_fp8_grouped_kmajor(dy, sizes), *quantize_fp8_grouped_kmajor(x, sizes),
  sizes)``. Group g contracts the columns [off_g, off_g + round_up(size_g, 128)) of both operands (its tokens and
  their code-0 padding): K is a run-time multiple of 128 per group, read on the device (no host synchronization;
  CUDA-graph safe). Accumulation is float32 with the scales applied once per 128-token block. A group that owns no
  rows gives zeros.

  Sizes are clamped as the quantizer does, but against round_up(M, 128) = P - 128 G, the row count the padded
  length gives back: where the quantizer clamped against M the extra columns this reads are code 0, so the
  result is the same.

  Implementations: ``"ffi"`` is the custom call ``jax_moe_a2a_grouped_gemm_fp8_wgrad`` -- on GPUs CUTLASS's SM90
  pointer-array grouped GEMM with blockwise scaling (one scale per row of A and of B per 128-deep K block), on CPU
  a float32 loop over the dequantized operands; ``"reference"`` is the reference (float32 at HIGHEST precision). They
  agree to float32 rounding of the accumulation.

  Args:
    a_t: float8_e4m3fn [Na, P] (e.g. dy quantized K-major), Na a positive multiple of 128.
    a_sf_t: float32 [P/128, Na].
    b_t: float8_e4m3fn [Nb, P] (e.g. the forward input x), same P, Nb a positive multiple of 128.
    b_sf_t: float32 [P/128, Nb].
    group_sizes: int32 [G], the sizes given to the quantizer (a list of ints is converted).
    out_dtype: float32 or bfloat16 (the float32 sums rounded once).
    impl: "auto", "ffi" or "reference".

  Returns:
    [G, Na, Nb] out_dtype.

  Raises:
    TypeError / ValueError: an operand has the wrong dtype or shape (P not a multiple of 128, P < 128 G, the P of
      b_t or of a scale differing from a_t's), or out_dtype is not float32 or bfloat16.
  """
  op = "grouped_gemm_fp8_wgrad"
  group_sizes = _as_group_sizes(op, group_sizes)
  num_groups, na, nb, _ = _check_wgrad_fp8(op, a_t, a_sf_t, b_t, b_sf_t, group_sizes)
  out_dtype = _wgrad_out_dtype(op, out_dtype)
  if _ffi.resolve_impl(op, impl) == "ffi":
    out = (jax.ShapeDtypeStruct((num_groups, na, nb), out_dtype),
           jax.ShapeDtypeStruct((wgrad_scratch_bytes(num_groups),), jnp.uint8))
    return _ffi.ffi_call("grouped_gemm_fp8_wgrad", out, a_t, a_sf_t, b_t, b_sf_t, group_sizes)[0]
  return grouped_gemm_fp8_wgrad_reference(a_t, a_sf_t, b_t, b_sf_t, group_sizes, out_dtype=out_dtype)
