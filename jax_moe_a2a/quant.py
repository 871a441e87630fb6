"""Quantization of activations and expert weights for every wire format of `layout`.

==================  ==================================  ===============================================
format              values                              scales
==================  ==================================  ===============================================
``fp8_blockwise``   ``[M, K] float8_e4m3fn``            ``[M, K/128] float32`` (1x128 groups), or
                                                        ``[K/128, M]`` ("BlockMajorK", M contiguous)
``mxfp8``           ``[M, K] float8_e4m3fn``            ``[M, pad(K, align)/32] float8_e8m0fnu`` (1x32)
``nvfp4``           ``[M, K/2] uint8`` (two E2M1)       ``[M, K/16] float8_e4m3fn`` (1x16) and one
                                                        ``[] float32`` global scale
FP8 weights         ``[..., N, K] float8_e4m3fn``       ``[..., ceil(N/128), ceil(K/128)] float32``
                                                        (128x128 blocks)
==================  ==================================  ===============================================

Every algorithm here is specified to the bit, because the C++ and CUDA kernels reproduce it: the steps are
float32 operations in the order given, divisions are correctly rounded IEEE divisions (never a multiplication
by a reciprocal) and every conversion to a narrow type rounds to nearest, ties to even. Non-finite inputs
never leak into neighbouring groups: a group that holds a NaN or an infinity is marked NaN as a whole, with
fixed bit patterns, and the other groups are quantized as if it were not there.

Float32 subnormal inputs are outside the contract: backends may flush them to zero (XLA on CPU does).

Each quantizer has a pure-JAX reference, ``<op>_reference``, with the same semantics (the CPU path and the oracle of
the custom calls); the public function checks its arguments and calls the reference or the custom call (``impl=``).

MXFP8 and NVFP4 live in `jax_moe_a2a.quant_mx` (paired with ffi/src/quant_mx*); their names are importable from
this module too (``quant.quantize_mxfp8``), and `quantize` / `dequantize` here take every format. What the two modules
share (constants, checks, correctly rounded division, power-of-two scales) is `jax_moe_a2a.quant_base`.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe_a2a import _ffi, layout
from jax_moe_a2a.quant_base import (FLOAT_INPUTS, FLOAT_INPUTS_TEXT, FP8_AMAX_FLOOR, FP8_BLOCK, E4M3_MAX,
                                    E4M3_NAN_BITS, F32_NAN_BITS, check_2d, check_array, check_dtype,
                                    check_float_input, check_out_dtype, e4m3_limit, pow2, pow2_scale_exponent,
                                    where_bits)
# MXFP8 and NVFP4 live in quant_mx; their names are this module's too (quant.quantize_mxfp8).
from jax_moe_a2a.quant_mx import (dequantize_mxfp8, dequantize_mxfp8_reference, dequantize_nvfp4,
                                  dequantize_nvfp4_reference, nvfp4_global_scale, nvfp4_global_scale_reference,
                                  quantize_mxfp8, quantize_mxfp8_reference, quantize_nvfp4, quantize_nvfp4_reference)


def _fp8_block_quantize(g: jax.Array, axes: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
  """Blockwise FP8 E4M3 of float32 `g` whose block dimensions are `axes`; returns (q like g, scale without axes).

  scale = the smallest power of two with max(amax, 1e-12) <= 448 * scale; q = e4m3(clip(g / scale, -L, L)) with
  L = 448, or 240 at the top scale 2^120 (`e4m3_limit`), where the division by a power of two is exact; a block
  holding a NaN or an infinity gets q = NaN (0x7F) everywhere and scale = NaN (0x7FC00000).
  """
  amax = jnp.max(jnp.abs(g), axis=axes, keepdims=True)
  bad = jnp.any(~jnp.isfinite(g), axis=axes, keepdims=True)
  # For finite amax the biased exponent lies in [79, 247], so both 2^e and 2^-e are normal float32 values.
  biased = jnp.clip(pow2_scale_exponent(jnp.maximum(amax, jnp.float32(FP8_AMAX_FLOOR))), 1, 253)
  scale, inv_scale = pow2(biased), pow2(254 - biased)
  limit = e4m3_limit(biased)
  q = jnp.clip(g * inv_scale, -limit, limit).astype(jnp.float8_e4m3fn)
  q = where_bits(bad, E4M3_NAN_BITS, q)
  scale = where_bits(bad, F32_NAN_BITS, scale)
  return q, jnp.squeeze(scale, axis=axes)


# ----------------------------------------------------------------------------------------------------------------
# DeepSeek blockwise FP8: E4M3 with one FP32 scale per 1x128 group
# ----------------------------------------------------------------------------------------------------------------


def check_fp8_blockwise(op: str, x_q: Any, x_sf: Any, *, block_major_k: bool = False) -> tuple[int, int]:
  """Checks a blockwise FP8 activation and its scales (docs/DESIGN.md §1.2); returns (M, K).

  Args:
    op: the caller's name, the first word of every error message.
    x_q: `[M, K] float8_e4m3fn` with K % 128 == 0.
    x_sf: `[M, K/128] float32` scales, one per 1x128 group (`[K/128, M]` when `block_major_k`). A missing scale
      (None) is an error of its own.
    block_major_k: expect the transposed scale layout.

  Raises:
    TypeError: x_q is not float8_e4m3fn, or x_sf is not float32.
    ValueError: x_q is not 2-D or K % 128 != 0, x_sf is missing, or x_sf has the wrong shape.
  """
  # Type and shape checks
  check_dtype(op, "x_q", x_q, jnp.float8_e4m3fn)
  m, k = check_2d(op, "x_q", x_q)
  if k % FP8_BLOCK or k == 0:
    raise ValueError(f"{op}: x_q must be [M, K] with K % {FP8_BLOCK} == 0 and K > 0, got shape {tuple(x_q.shape)}")
  if x_sf is None:
    raise ValueError(f"{op}: x_sf must be given (the float32 scales of the fp8_blockwise activation x_q), got None")
  check_dtype(op, "x_sf", x_sf, jnp.float32)
  want = (k // FP8_BLOCK, m) if block_major_k else (m, k // FP8_BLOCK)
  if tuple(x_sf.shape) != want:
    dims = "[K/128, M]" if block_major_k else "[M, K/128]"
    raise ValueError(f"{op}: x_sf must be {dims} = {want} for x_q of shape {(m, k)}, got shape {tuple(x_sf.shape)}")
  return m, k


@functools.partial(jax.jit, static_argnames=("block_major_k",))
def quantize_fp8_blockwise_reference(x: jax.Array, *, block_major_k: bool = False) -> tuple[jax.Array, jax.Array]:
  """Pure-JAX reference of `quantize_fp8_blockwise` (same signature and semantics, no argument checks)."""
  m, k = x.shape
  g = x.astype(jnp.float32).reshape(m, k // FP8_BLOCK, FP8_BLOCK)
  q, scale = _fp8_block_quantize(g, (2,))
  q = q.reshape(m, k)
  return q, (scale.T if block_major_k else scale)


def _ffi_quantize_fp8_blockwise(x: jax.Array, *, block_major_k: bool = False) -> tuple[jax.Array, jax.Array]:
  """The custom call jax_moe_a2a_quantize_fp8_blockwise (CPU handler or CUDA kernel), one pass over x."""
  m, k = x.shape
  groups = k // FP8_BLOCK
  out = (jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn),
         jax.ShapeDtypeStruct((groups, m) if block_major_k else (m, groups), jnp.float32))
  return _ffi.ffi_call("quantize_fp8_blockwise", out, x, block_major_k=bool(block_major_k), swiglu=False)


def quantize_fp8_blockwise(x: jax.Array, *, block_major_k: bool = False,
                           impl: str = "auto") -> tuple[jax.Array, jax.Array]:
  """Quantizes activations to FP8 E4M3 with one FP32 scale per 1x128 group (DeepSeek blockwise FP8).

  The algorithm, in float32, per row and group of 128 consecutive columns `g`:

  1. `amax = max(|g|)`;
  2. `scale = 2^e`, the smallest power of two with `max(amax, float32(1e-12)) <= 448 * 2^e` (the "UE8M0"
     rounding of DeepSeek-V3.1 and DeepGEMM, stored as FP32), computed exactly from the bits of amax;
  3. `q = e4m3(clip(g / scale, -L, L))` with L = 448, except at the largest scale, 2^120 (amax in float32's top
     binade, [2^127, 2^128)), where L = 240: there a value of at least 248 * 2^120 would round to the code 256,
     and 256 * 2^120 = 2^128 overflows float32, so it saturates at 240 and the round trip stays finite. Dividing
     by a power of two is exact, so the only rounding is the conversion to E4M3 (to nearest, ties to even), and
     every backend and kernel gives the same bits (below the top scale the clip never changes a finite result;
     kernels keep it so their conversions never see an out-of-range value);
  4. if the group holds a NaN or an infinity (amax is not finite): every q of the group is the positive NaN of
     E4M3 (byte 0x7F) and scale is the float32 quiet NaN (0x7FC00000); other groups are unaffected.

  A power-of-two scale costs at most one binade of E4M3's range at the bottom (amax maps into (224, 448]) and
  makes dequantization exact. An all-zero group has scale 2^-48 (from the 1e-12 floor) and zero values.
  float32 subnormal inputs
  (|x| < 2^-126) are outside the contract: XLA on CPU flushes them to zero. `dequantize_fp8_blockwise` gives q * scale;
  for finite x its error is at most |x| * 2^-4 + scale * 2^-10 per element (E4M3 keeps 3 mantissa bits; 2^-10
  is half the spacing of its subnormals), and the result is finite (also for values near the float32 maximum).

  Args:
    x: `[M, K]` bfloat16, float16 or float32 with K % 128 == 0 (M may be 0).
    block_major_k: return the scales transposed, `[K/128, M]` (M contiguous), as the expert GEMM wants them.
      The custom call writes them so directly, without a transpose pass.
    impl: "ffi" (the custom call jax_moe_a2a_quantize_fp8_blockwise), "reference" (the pure-JAX
      `quantize_fp8_blockwise_reference`) or "auto" (see `jax_moe_a2a._ffi.resolve_impl`). Both give the same bits.

  Returns:
    x_q: `[M, K] float8_e4m3fn`.
    x_sf: `[M, K/128] float32`, one scale per 1x128 group (`[K/128, M]` when `block_major_k`).

  Raises:
    TypeError: x is not bfloat16, float16 or float32.
    ValueError: x is not 2-D, or K % 128 != 0 or K == 0.
  """
  # Type and shape checks
  op = "quantize_fp8_blockwise"
  check_float_input(op, "x", x)
  _, k = check_2d(op, "x", x)
  if k % FP8_BLOCK:
    raise ValueError(f"{op}: x must be [M, K] with K % {FP8_BLOCK} == 0, got shape {tuple(x.shape)}")
  if k == 0:
    raise ValueError(f"{op}: x must be [M, K] with K > 0, got shape {tuple(x.shape)}")
  if _ffi.resolve_impl(op, impl) == "ffi":
    return _ffi_quantize_fp8_blockwise(x, block_major_k=bool(block_major_k))
  return quantize_fp8_blockwise_reference(x, block_major_k=bool(block_major_k))


def swiglu_reference(h: jax.Array) -> jax.Array:
  """``silu(gate) * up`` of rows h [M, 2F] (gate columns, then up), in float32, by the operations of the custom
  call: ``(g * (1 / (1 + exp(-g)))) * u``."""
  f = h.shape[-1] // 2
  g, u = h[:, :f].astype(jnp.float32), h[:, f:].astype(jnp.float32)
  return (g * (1.0 / (1.0 + jnp.exp(-g)))) * u


@jax.jit
def swiglu_quantize_fp8_blockwise_reference(h: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Pure-JAX reference of `swiglu_quantize_fp8_blockwise`."""
  return quantize_fp8_blockwise_reference(swiglu_reference(h))


def swiglu_quantize_fp8_blockwise(h: jax.Array, *, impl: str = "auto") -> tuple[jax.Array, jax.Array]:
  """SwiGLU of gate/up rows, quantized as `quantize_fp8_blockwise`: one pass over h, no float32 activation.

  ``quantize_fp8_blockwise(silu(h[:, :F]) * h[:, F:])`` with the SwiGLU in float32 (`swiglu_reference`): the
  expert MLP's activation, ready for its down projection. The custom call and the reference compute the same float32
  operations, but ``exp`` is the backend's (CUDA's expf is within 2 ulp), so a code can differ by one E4M3 step
  where a value lies at a rounding boundary, and a scale by a factor of 2 where a group's amax lies at a power of
  two; the dequantized values agree to within E4M3 rounding (tests/test_quant_ffi.py states the tolerance).

  Args:
    h: `[M, 2F]` bfloat16, float16 or float32 with F % 128 == 0: gate columns, then up columns.
    impl: "ffi" (the custom call jax_moe_a2a_quantize_fp8_blockwise with swiglu), "reference" or "auto".

  Returns:
    act_q: `[M, F] float8_e4m3fn`; act_sf: `[M, F/128] float32`.

  Raises:
    TypeError: h is not bfloat16, float16 or float32.
    ValueError: h is not 2-D, or 2F is not a positive multiple of 256.
  """
  op = "swiglu_quantize_fp8_blockwise"
  check_float_input(op, "h", h)
  m, k2 = check_2d(op, "h", h)
  if k2 % (2 * FP8_BLOCK) or k2 == 0:
    raise ValueError(f"{op}: h must be [M, 2F] with F a positive multiple of {FP8_BLOCK}, got shape {tuple(h.shape)}")
  if _ffi.resolve_impl(op, impl) == "ffi":
    f = k2 // 2
    out = (jax.ShapeDtypeStruct((m, f), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((m, f // FP8_BLOCK), jnp.float32))
    return _ffi.ffi_call("quantize_fp8_blockwise", out, h, block_major_k=False, swiglu=True)
  return swiglu_quantize_fp8_blockwise_reference(h)


@functools.partial(jax.jit, static_argnames=("block_major_k", "dtype"))
def dequantize_fp8_blockwise_reference(x_q: jax.Array, x_sf: jax.Array, *, block_major_k: bool = False,
                                       dtype: Any = jnp.float32) -> jax.Array:
  """Pure-JAX reference of `dequantize_fp8_blockwise` (no argument checks)."""
  m, k = x_q.shape
  scale = x_sf.T if block_major_k else x_sf
  g = x_q.astype(jnp.float32).reshape(m, k // FP8_BLOCK, FP8_BLOCK) * scale[..., None]
  return g.reshape(m, k).astype(dtype)


def dequantize_fp8_blockwise(x_q: jax.Array, x_sf: jax.Array, *, block_major_k: bool = False,
                             dtype: Any = jnp.float32) -> jax.Array:
  """Inverse of `quantize_fp8_blockwise`: `float32(x_q) * scale` of its group, then cast to `dtype`.

  NaN groups come back as NaN.

  Args:
    x_q: `[M, K] float8_e4m3fn` with K % 128 == 0.
    x_sf: `[M, K/128] float32`, one scale per 1x128 group (`[K/128, M]` when `block_major_k`).
    block_major_k: x_sf is in the transposed layout.
    dtype: the floating output dtype.

  Returns:
    `[M, K] dtype`.
  """
  # Type and shape checks
  op = "dequantize_fp8_blockwise"
  check_fp8_blockwise(op, x_q, x_sf, block_major_k=block_major_k)
  dtype = check_out_dtype(op, dtype)
  return dequantize_fp8_blockwise_reference(x_q, x_sf, block_major_k=bool(block_major_k), dtype=dtype)


def to_block_major_k(x_q: jax.Array, x_sf: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Checks a blockwise FP8 activation and transposes its scales to the BlockMajorK layout.

  Args:
    x_q: `[M, K] float8_e4m3fn` with K % 128 == 0.
    x_sf: `[M, K/128] float32`, one scale per 1x128 group; must be given.

  Returns:
    x_q: unchanged.
    x_sf_t: `[K/128, M] float32` (M contiguous: DeepGEMM's and CUTLASS SM90's MN-major activation scales).

  Raises:
    TypeError, ValueError: as `check_fp8_blockwise`.
  """
  # Type and shape checks
  check_fp8_blockwise("to_block_major_k", x_q, x_sf)
  return x_q, x_sf.T


# ----------------------------------------------------------------------------------------------------------------
# Grouped K-major FP8 for the weight gradient: 128x1 tiles along the tokens of each group
# ----------------------------------------------------------------------------------------------------------------

MAX_KMAJOR_GROUPS = 65535


def grouped_kmajor_length(m: int, num_groups: int) -> int:
  """P, the padded token length of `quantize_fp8_grouped_kmajor` for M rows in G groups: ``round_up(M, 128) + 128 G``.

  Each group's rows are padded to a multiple of 128, which adds fewer than 128 columns per group, so P holds every
  group for any sizes; it is static (it depends on shapes only). The GEMM reads it back as
  ``round_up(M, 128) = P - 128 G`` (`kmajor_column_groups`).
  """
  return layout.round_up(int(m), FP8_BLOCK) + FP8_BLOCK * int(num_groups)


def _clamped_groups(group_sizes: jax.Array, rows: int) -> tuple[jax.Array, jax.Array]:
  """(start, size) per group, int32 [G] each, of rows sorted by group: sizes clamped to [0, rows] and summed with
  saturation at `rows` (as `grouped_gemm.owned_rows` with masked=False, no partial sum leaving [0, rows])."""
  req = jnp.clip(group_sizes.astype(jnp.int32), 0, rows)
  end = jax.lax.associative_scan(lambda a, b: a + jnp.minimum(b, rows - a), req)
  start = jnp.concatenate([jnp.zeros((1,), jnp.int32), end[:-1]])
  return start, end - start


def kmajor_column_groups(group_sizes: jax.Array, rows: int, p: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The padded K-major layout of rows sorted by group, per column of [.., P]: (group, source row, is a row).

  Group g (sizes clamped as `_clamped_groups` says, against `rows`) owns the columns [off_g, off_g + pad_g) with
  pad_g = round_up(size_g, 128) and off_g the sum of pad over earlier groups; the first size_g of them hold its
  rows in order, the others are padding. Returns int32 [P] group ids (G past the last group), int32 [P] source
  rows (0 where there is none) and bool [P] (the column holds a row).
  """
  num_groups = group_sizes.shape[0]
  start, size = _clamped_groups(group_sizes, rows)
  padded = (size + (FP8_BLOCK - 1)) // FP8_BLOCK * FP8_BLOCK
  end_off = jnp.cumsum(padded)
  col = jnp.arange(p, dtype=jnp.int32)
  # The first group whose padded range ends after the column (empty groups end where they start: skipped).
  group = jnp.searchsorted(end_off, col, side="right").astype(jnp.int32)
  gi = jnp.minimum(group, num_groups - 1)
  within = col - (end_off[gi] - padded[gi])
  is_row = (group < num_groups) & (within < size[gi])
  return group, jnp.where(is_row, start[gi] + within, 0), is_row


def _check_kmajor_group_sizes(op: str, group_sizes: Any) -> jax.Array:
  """group_sizes as int32 [G], 1 <= G <= 65535 (a list or tuple of ints is converted)."""
  if isinstance(group_sizes, (list, tuple)):
    values = np.asarray(group_sizes)
    if values.dtype.kind not in "iu" or (values.size and (values.min() < -2**31 or values.max() >= 2**31)):
      raise TypeError(f"{op}: group_sizes must be int32 [G] (an int32 array, or a list of ints), got "
                      f"{type(group_sizes).__name__} {group_sizes!r}")
    group_sizes = jnp.asarray(values.astype(np.int32))
  check_dtype(op, "group_sizes", group_sizes, jnp.int32)
  if len(group_sizes.shape) != 1 or not 1 <= group_sizes.shape[0] <= MAX_KMAJOR_GROUPS:
    raise ValueError(f"{op}: group_sizes must be [G] with 1 <= G <= {MAX_KMAJOR_GROUPS}, got shape "
                     f"{tuple(group_sizes.shape)}")
  return group_sizes


@jax.jit
def quantize_fp8_grouped_kmajor_reference(x: jax.Array, group_sizes: jax.Array, x_sf: Optional[jax.Array] = None,
                                          rows: Optional[jax.Array] = None) -> tuple[jax.Array, jax.Array]:
  """Pure-JAX reference of `quantize_fp8_grouped_kmajor` (same semantics, no argument checks)."""
  r, c = x.shape
  m = r if rows is None else rows.shape[0]
  p = grouped_kmajor_length(m, group_sizes.shape[0])
  _, src, is_row = kmajor_column_groups(group_sizes, m, p)
  if m == 0 or r == 0:
    xt = jnp.zeros((c, p), jnp.float32)
  else:
    xf = x.astype(jnp.float32) if x_sf is None else dequantize_fp8_blockwise_reference(x, x_sf)
    if rows is not None:
      xf = jnp.where(((rows >= 0) & (rows < r))[:, None], xf[jnp.clip(rows, 0, r - 1)], 0.0)
    xt = jnp.where(is_row[None, :], xf[src].T, 0.0)  # [C, P]
  q, scale = _fp8_block_quantize(xt.reshape(c, p // FP8_BLOCK, FP8_BLOCK), (2,))
  # Padding columns are code 0 also in a block marked NaN.
  q = where_bits(~is_row[None, :], 0, q.reshape(c, p))
  return q, scale.T


def _ffi_quantize_fp8_grouped_kmajor(x, group_sizes, x_sf, rows):
  m, c = x.shape if rows is None else (rows.shape[0], x.shape[1])
  p = grouped_kmajor_length(m, group_sizes.shape[0])
  out = (jax.ShapeDtypeStruct((c, p), jnp.float8_e4m3fn),
         jax.ShapeDtypeStruct((p // FP8_BLOCK, c), jnp.float32),
         jax.ShapeDtypeStruct((p // FP8_BLOCK, 2), jnp.int32))  # per 128 columns: first source row, rows
  sf_in = jnp.zeros((0,), jnp.float32) if x_sf is None else x_sf
  rows_in = jnp.zeros((0,), jnp.int32) if rows is None else rows
  q, sf, _ = _ffi.ffi_call("quantize_fp8_grouped_kmajor", out, x, sf_in, rows_in, group_sizes)
  return q, sf


def quantize_fp8_grouped_kmajor(x: jax.Array, group_sizes: Any, x_sf: Optional[jax.Array] = None, *,
                                rows: Optional[jax.Array] = None, impl: str = "auto") -> tuple[jax.Array, jax.Array]:
  """Transposes rows sorted by group to K-major FP8 with one FP32 scale per 128 tokens of a group x 1 column.

  The operands of the weight gradient ``dW[g] = dy_g^T x_g`` (`grouped_gemm.grouped_gemm_fp8_wgrad`): FP8 wgmma
  needs the contracted token dimension contiguous, so x [M, C] becomes q_t [C, P] with each group's rows padded to
  a multiple of 128 tokens, and each scale covers 128 tokens of one group in one column ("128x1 tiles").

  Layout: rows are grouped as in `grouped_gemm` (contiguous): group g owns the `group_sizes[g]` rows after those
  of groups 0..g-1, sizes clamped to >= 0 and to the rows that are left. Its rows occupy the columns
  [off_g, off_g + size_g) of q_t, off_g = the sum of round_up(size_h, 128) over the groups h before g, so each group
  starts on a 128-column block and no block holds two groups. P = `grouped_kmajor_length(M, G)`
  = round_up(M, 128) + 128 G (static). Padding columns, and every column past the last group, are code 0; a
  block with no rows has the all-zero block's scale, 2^-48.

  Scales: each block of 128 columns of one row of q_t is quantized by the rule of `quantize_fp8_blockwise` over
  its 128 values (padding counts as 0): power-of-two scale from amax, one E4M3 rounding; a block holding a NaN or
  an infinity gets the E4M3 NaN code for each of its rows and the float32 NaN scale (its padding stays code 0).
  The reference, the CPU handler and the CUDA kernel give the same bits.

  FP8 input: x float8_e4m3fn with its 1x128 scales x_sf [M, C/128] is first decoded exactly as
  `dequantize_fp8_blockwise` does (code * scale in float32), then quantized along the tokens. That is a second
  rounding: a 128x1 tile's scale comes from another set of values than the 1x128 group's, so the codes change
  (the error of both roundings adds up). `to_block_major_k` is not that: it keeps the codes and 1x128 tiles
  and only transposes the scale array.

  Gather: with `rows`, the M sorted rows are read from x where they are (sorted row i is ``x[rows[i]]``, a zero
  row where ``rows[i]`` is outside [0, R)), so rows kept once per token need not be expanded to one copy per
  assignment first: the same bits as quantizing ``rows.gather_rows(x, rows)``, without writing and reading that.

  Args:
    x: [M, C] (or [R, C] with `rows`) bfloat16, float16 or float32, or float8_e4m3fn with `x_sf`; C a positive
      multiple of 128.
    group_sizes: int32 [G], 1 <= G <= 65535 (run-time values; a list of ints is converted).
    x_sf: float32 [M, C/128] (or [R, C/128]), the 1x128 scales of an FP8 `x` (None otherwise).
    rows: None, or int32 [M]: the row of x that each sorted row reads.
    impl: "auto", "ffi" (the custom call jax_moe_a2a_quantize_fp8_grouped_kmajor) or "reference".

  Returns:
    q_t: float8_e4m3fn [C, P].
    sf_t: float32 [P/128, C] (MN-major: C contiguous, so one group's scales are a compact block of rows, which
      is what the GEMM's per-group scale layout needs).

  Raises:
    TypeError: x, x_sf or group_sizes has the wrong dtype.
    ValueError: a shape is wrong (x not 2-D, C not a positive multiple of 128, x_sf not x's rows by C/128, x_sf
      given for a float x or missing for an FP8 x, group_sizes not [G], rows not [M] with M < 2^31).
  """
  op = "quantize_fp8_grouped_kmajor"
  check_array(op, "x", x)
  fp8 = jnp.dtype(x.dtype) == jnp.dtype(jnp.float8_e4m3fn)
  if not fp8 and jnp.dtype(x.dtype) not in FLOAT_INPUTS:
    raise TypeError(f"{op}: x must be {FLOAT_INPUTS_TEXT}, or float8_e4m3fn with x_sf, got {x.dtype}")
  m, c = check_2d(op, "x", x, "[M, C]")
  if c % FP8_BLOCK or c == 0:
    raise ValueError(f"{op}: x must be [M, C] with C a positive multiple of {FP8_BLOCK}, got shape {tuple(x.shape)}")
  if fp8:
    if x_sf is None:
      raise ValueError(f"{op}: x_sf must be given for a float8_e4m3fn x (its [M, C/128] float32 scales), got None")
    check_dtype(op, "x_sf", x_sf, jnp.float32)
    if tuple(x_sf.shape) != (m, c // FP8_BLOCK):
      raise ValueError(f"{op}: x_sf must be [M, C/128] = {(m, c // FP8_BLOCK)} for x of shape {(m, c)}, got shape "
                       f"{tuple(x_sf.shape)}")
  elif x_sf is not None:
    raise ValueError(f"{op}: x_sf must be None for a {jnp.dtype(x.dtype).name} x (scales belong to an FP8 x), got "
                     f"{type(x_sf).__name__}")
  group_sizes = _check_kmajor_group_sizes(op, group_sizes)
  if rows is not None:
    check_array(op, "rows", rows)
    if jnp.dtype(rows.dtype) != jnp.dtype(jnp.int32):
      raise TypeError(f"{op}: rows must be int32, got {rows.dtype}")
    if rows.ndim != 1 or rows.shape[0] >= 2 ** 31:
      raise ValueError(f"{op}: rows must be [M] with M < 2^31, got shape {tuple(rows.shape)}")
  # An empty gather ([0] rows) goes to the reference: the custom call reads [0] as "no gather".
  if _ffi.resolve_impl(op, impl) == "ffi" and (rows is None or rows.shape[0] > 0):
    return _ffi_quantize_fp8_grouped_kmajor(x, group_sizes, x_sf, rows)
  return quantize_fp8_grouped_kmajor_reference(x, group_sizes, x_sf, rows)


@functools.partial(jax.jit, static_argnames=("dtype",))
def dequantize_fp8_kmajor_reference(q_t: jax.Array, sf_t: jax.Array, *, dtype: Any = jnp.float32) -> jax.Array:
  """``float32(q_t) * scale`` of its 128x1 tile for q_t [C, P] and sf_t [P/128, C]: [C, P] `dtype`."""
  c, p = q_t.shape
  g = q_t.astype(jnp.float32).reshape(c, p // FP8_BLOCK, FP8_BLOCK) * sf_t.T[..., None]
  return g.reshape(c, p).astype(dtype)


# ----------------------------------------------------------------------------------------------------------------
# FP8 weights: E4M3 with one FP32 scale per 128x128 block
# ----------------------------------------------------------------------------------------------------------------


def fp8_weight_scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
  """The shape of the 128x128 block scales of FP8 weights of `shape` [..., N, K]: [..., ceil(N/128), ceil(K/128)]."""
  *batch, n, k = shape
  return (*batch, -(-n // FP8_BLOCK), -(-k // FP8_BLOCK))


def _weight_dims(op: str, w: Any, name: str) -> tuple[tuple[int, ...], int, int]:
  if len(w.shape) < 2:
    raise ValueError(f"{op}: {name} must be [..., N, K] (at least 2-D), got shape {tuple(w.shape)}")
  *batch, n, k = w.shape
  if n == 0 or k == 0:
    raise ValueError(f"{op}: {name} must be [..., N, K] with N > 0 and K > 0, got shape {tuple(w.shape)}")
  return tuple(batch), n, k


def _pad_nk(w: jax.Array, n: int, k: int) -> jax.Array:
  pads = [(0, 0)] * (w.ndim - 2) + [(0, layout.round_up(n, FP8_BLOCK) - n), (0, layout.round_up(k, FP8_BLOCK) - k)]
  return jnp.pad(w, pads)


@jax.jit
def quantize_fp8_weight_reference(w: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Pure-JAX reference of `quantize_fp8_weight` (same signature and semantics, no argument checks)."""
  *batch, n, k = w.shape
  *_, nb, kb = fp8_weight_scale_shape(w.shape)
  g = _pad_nk(w.astype(jnp.float32), n, k).reshape(*batch, nb, FP8_BLOCK, kb, FP8_BLOCK)
  q, scale = _fp8_block_quantize(g, (g.ndim - 3, g.ndim - 1))
  q = q.reshape(*batch, nb * FP8_BLOCK, kb * FP8_BLOCK)[..., :n, :k]
  return q, scale


def _ffi_quantize_fp8_weight(w: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The custom call jax_moe_a2a_quantize_fp8_weight (CPU handler or CUDA kernel), one pass over w."""
  out = (jax.ShapeDtypeStruct(w.shape, jnp.float8_e4m3fn),
         jax.ShapeDtypeStruct(fp8_weight_scale_shape(w.shape), jnp.float32))
  return _ffi.ffi_call("quantize_fp8_weight", out, w)


def quantize_fp8_weight(w: jax.Array, *, impl: str = "auto") -> tuple[jax.Array, jax.Array]:
  """Quantizes weights to FP8 E4M3 with one FP32 scale per 128x128 block.

  Each 128x128 block of the last two dims is quantized exactly as a 1x128 group of `quantize_fp8_blockwise`
  (scale = smallest power of two with max(amax, 1e-12) <= 448 * scale, q = e4m3(clip(w / scale, -L, L)) with
  L = 448, or 240 at the top scale 2^120 so that the dequantized values stay finite, NaN/inf block -> q 0x7F and
  scale 0x7FC00000, all-zero block -> scale 2^-48). When N or K is not a multiple of 128 the edge blocks are
  padded with zeros for the amax only; the padding is not returned.

  Args:
    w: `[..., N, K]` bfloat16, float16 or float32 (any leading dims, e.g. `[num_experts, N, K]`).
    impl: "ffi" (the custom call jax_moe_a2a_quantize_fp8_weight: one read of w, one write of the codes),
      "reference" (the pure-JAX `quantize_fp8_weight_reference`) or "auto" (see `jax_moe_a2a._ffi.resolve_impl`;
      the reference where the GPU kernel does not apply: K not a multiple of 16 bytes of w, more than 65535 blocks
      of 128 rows or 65535 matrices). Both give the same bits.

  Returns:
    w_q: `[..., N, K] float8_e4m3fn`.
    w_sf: `[..., ceil(N/128), ceil(K/128)] float32`, one scale per 128x128 block.

  Raises:
    TypeError: w is not bfloat16, float16 or float32.
    ValueError: w has fewer than 2 dims, or N or K is 0.
  """
  # Type and shape checks
  op = "quantize_fp8_weight"
  check_float_input(op, "w", w)
  _weight_dims(op, w, "w")
  if _ffi.resolve_impl(op, impl) == "ffi":
    *batch, n, k = w.shape
    gpu_ok = (k * jnp.dtype(w.dtype).itemsize) % 16 == 0 and -(-n // FP8_BLOCK) <= 65535 and \
        math.prod(batch) <= 65535
    if gpu_ok or jax.default_backend() != "gpu":
      return _ffi_quantize_fp8_weight(w)
    if impl == "ffi":
      raise ValueError(f"{op}: impl='ffi' on GPUs needs K a multiple of 16 bytes of w, ceil(N/128) <= 65535 and at "
                       f"most 65535 matrices, got shape {tuple(w.shape)} of {jnp.dtype(w.dtype).name}")
  return quantize_fp8_weight_reference(w)


@jax.jit
def quantize_fp8_weight_with_transpose_reference(w: jax.Array
                                                 ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Pure-JAX reference of `quantize_fp8_weight_with_transpose` (no argument checks)."""
  w_q, w_sf = quantize_fp8_weight_reference(w)
  return w_q, w_sf, jnp.swapaxes(w_q, -1, -2), jnp.swapaxes(w_sf, -1, -2)


def quantize_fp8_weight_with_transpose(w: jax.Array, *, impl: str = "auto"
                                       ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """`quantize_fp8_weight`, with the codes also written transposed: the operands of ``x @ w.T`` and ``g @ w``.

  FP8 tensor-core GEMMs read both operands K-major, so a data gradient ``g @ w`` needs the codes as ``[..., K, N]``.
  A 128x128 block's scale is the same for its transpose (same amax), so the transposed operand is the same codes
  moved and the scales swapped: written by the quantizer while it holds each block, this costs one more write of
  the codes instead of a separate read and write.

  Args:
    w: `[..., N, K]` bfloat16, float16 or float32.
    impl: as `quantize_fp8_weight` ("auto" takes the reference on GPUs where N is not a multiple of 16 or
      the kernel's other limits are not met). Both give the same bits.

  Returns:
    w_q: `[..., N, K] float8_e4m3fn` and w_sf `[..., ceil(N/128), ceil(K/128)] float32`, as `quantize_fp8_weight`.
    w_q_t: `[..., K, N] float8_e4m3fn`, ``swapaxes(w_q, -1, -2)``.
    w_sf_t: `[..., ceil(K/128), ceil(N/128)] float32`, ``swapaxes(w_sf, -1, -2)``.

  Raises:
    TypeError: w is not bfloat16, float16 or float32.
    ValueError: w has fewer than 2 dims, or N or K is 0.
  """
  # Type and shape checks
  op = "quantize_fp8_weight_with_transpose"
  check_float_input(op, "w", w)
  _weight_dims(op, w, "w")
  if _ffi.resolve_impl(op, impl) == "ffi":
    *batch, n, k = w.shape
    gpu_ok = (k * jnp.dtype(w.dtype).itemsize) % 16 == 0 and n % 16 == 0 and -(-n // FP8_BLOCK) <= 65535 and \
        math.prod(batch) <= 65535
    if gpu_ok or jax.default_backend() != "gpu":
      out = (jax.ShapeDtypeStruct(w.shape, jnp.float8_e4m3fn),
             jax.ShapeDtypeStruct(fp8_weight_scale_shape(w.shape), jnp.float32),
             jax.ShapeDtypeStruct((*batch, k, n), jnp.float8_e4m3fn))
      w_q, w_sf, w_q_t = _ffi.ffi_call("quantize_fp8_weight_with_transpose", out, w)
      return w_q, w_sf, w_q_t, jnp.swapaxes(w_sf, -1, -2)
    if impl == "ffi":
      raise ValueError(f"{op}: impl='ffi' on GPUs needs K a multiple of 16 bytes of w, N a multiple of 16, "
                       f"ceil(N/128) <= 65535 and at most 65535 matrices, got shape {tuple(w.shape)} of "
                       f"{jnp.dtype(w.dtype).name}")
  return quantize_fp8_weight_with_transpose_reference(w)


@functools.partial(jax.jit, static_argnames=("dtype",))
def dequantize_fp8_weight_reference(w_q: jax.Array, w_sf: jax.Array, *, dtype: Any = jnp.float32) -> jax.Array:
  """Pure-JAX reference of `dequantize_fp8_weight` (no argument checks)."""
  *batch, n, k = w_q.shape
  *_, nb, kb = fp8_weight_scale_shape(w_q.shape)
  g = _pad_nk(w_q.astype(jnp.float32), n, k).reshape(*batch, nb, FP8_BLOCK, kb, FP8_BLOCK)
  g = g * w_sf[..., :, None, :, None]
  return g.reshape(*batch, nb * FP8_BLOCK, kb * FP8_BLOCK)[..., :n, :k].astype(dtype)


def dequantize_fp8_weight(w_q: jax.Array, w_sf: jax.Array, *, dtype: Any = jnp.float32) -> jax.Array:
  """Inverse of `quantize_fp8_weight`: `float32(w_q) * scale` of its 128x128 block, then cast to `dtype`.

  Args:
    w_q: `[..., N, K] float8_e4m3fn`.
    w_sf: `[..., ceil(N/128), ceil(K/128)] float32`, one scale per 128x128 block.
    dtype: the floating output dtype.

  Returns:
    `[..., N, K] dtype`.
  """
  # Type and shape checks
  op = "dequantize_fp8_weight"
  check_dtype(op, "w_q", w_q, jnp.float8_e4m3fn)
  _weight_dims(op, w_q, "w_q")
  check_dtype(op, "w_sf", w_sf, jnp.float32)
  want = fp8_weight_scale_shape(w_q.shape)
  if tuple(w_sf.shape) != want:
    raise ValueError(f"{op}: w_sf must be [..., ceil(N/128), ceil(K/128)] = {want} for w_q of shape "
                     f"{tuple(w_q.shape)}, got shape {tuple(w_sf.shape)}")
  dtype = check_out_dtype(op, dtype)
  return dequantize_fp8_weight_reference(w_q, w_sf, dtype=dtype)


# ----------------------------------------------------------------------------------------------------------------
# Dispatch over formats
# ----------------------------------------------------------------------------------------------------------------


def _check_format(op: str, fmt: Any) -> str:
  if not isinstance(fmt, str) or fmt not in layout.FORMATS:
    raise ValueError(f"{op}: fmt must be one of {', '.join(layout.FORMATS)}, got {fmt!r}")
  return fmt


def quantize(x: jax.Array, fmt: str, **kwargs: Any
             ) -> tuple[jax.Array, Optional[jax.Array], Optional[jax.Array]]:
  """Quantizes `[M, K]` activations to wire format `fmt`; returns `(x_q, x_sf, global_scale)`.

  `bf16` is a cast with no scales (`x_sf` and `global_scale` None); `fp8_blockwise` and `mxfp8` have no global
  scale (None); `nvfp4` has all three. `kwargs` go to the format's quantizer (`block_major_k`, `mx_alignment`,
  `global_scale`).
  """
  # Type and shape checks
  fmt = _check_format("quantize", fmt)
  if fmt == layout.BF16:
    if kwargs:
      raise TypeError(f"quantize: {fmt} takes no options, got {sorted(kwargs)}")
    check_float_input("quantize", "x", x)
    check_2d("quantize", "x", x)
    return x.astype(jnp.bfloat16), None, None
  if fmt == layout.FP8_BLOCKWISE:
    return (*quantize_fp8_blockwise(x, **kwargs), None)
  if fmt == layout.MXFP8:
    return (*quantize_mxfp8(x, **kwargs), None)
  return quantize_nvfp4(x, **kwargs)


def dequantize(x_q: jax.Array, x_sf: Optional[jax.Array], fmt: str, *, global_scale: Optional[jax.Array] = None,
               dtype: Any = jnp.float32, **kwargs: Any) -> jax.Array:
  """Inverse of `quantize`: `[M, K] dtype` from the `(x_q, x_sf, global_scale)` of wire format `fmt`.

  `kwargs` go to the format's dequantizer (`block_major_k`; `mx_alignment`; `impl` for mxfp8 and nvfp4, whose
  dequantizers are custom calls; bf16 and fp8_blockwise are a cast and a multiply that XLA fuses).
  """
  # Type and shape checks
  op = "dequantize"
  fmt = _check_format(op, fmt)
  if fmt != layout.NVFP4 and global_scale is not None:
    raise ValueError(f"{op}: global_scale must be None for {fmt}, got {type(global_scale).__name__}")
  if fmt == layout.BF16:
    if kwargs:
      raise TypeError(f"{op}: {fmt} takes no options, got {sorted(kwargs)}")
    if x_sf is not None:
      raise ValueError(f"{op}: x_sf must be None for {fmt}, got {type(x_sf).__name__}")
    check_dtype(op, "x_q", x_q, jnp.bfloat16)
    return x_q.astype(check_out_dtype(op, dtype))
  if fmt == layout.FP8_BLOCKWISE:
    if "impl" in kwargs:
      raise TypeError(f"{op}: {fmt} has no custom call to choose (its dequantization is a multiply XLA fuses): "
                      f"impl is for mxfp8 and nvfp4, got impl={kwargs['impl']!r}")
    return dequantize_fp8_blockwise(x_q, x_sf, dtype=dtype, **kwargs)
  if fmt == layout.MXFP8:
    return dequantize_mxfp8(x_q, x_sf, dtype=dtype, **kwargs)
  if set(kwargs) - {"impl"}:
    raise TypeError(f"{op}: {fmt} takes only the option impl, got {sorted(kwargs)}")
  if global_scale is None:
    raise ValueError(f"{op}: global_scale must be given for {fmt}, got None")
  return dequantize_nvfp4(x_q, x_sf, global_scale, dtype=dtype, **kwargs)
