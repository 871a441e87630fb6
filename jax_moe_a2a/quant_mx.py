"""MXFP8 and NVFP4 activations: the quantizers of the two microscaled wire formats, with their custom calls.

==========  ==================================  ==================================================
format      values                              scales
==========  ==================================  ==================================================
``mxfp8``   ``[M, K] float8_e4m3fn``            ``[M, pad(K, align)/32] float8_e8m0fnu`` (1x32)
``nvfp4``   ``[M, K/2] uint8`` (two E2M1)       ``[M, K/16] float8_e4m3fn`` (1x16) and one
                                                ``[] float32`` global scale
==========  ==================================  ==================================================

The rules follow `jax_moe_a2a.quant`'s conventions (float32 steps in the order given, correctly rounded
divisions, round to nearest even, NaN blocks marked with fixed bit patterns) with the helpers of
`jax_moe_a2a.quant_base`; `quant` re-exports every public name here, so ``quant.quantize_mxfp8`` and the format
dispatch ``quant.quantize(x, "nvfp4")`` work too. The custom calls live in ffi/src/quant_mx.cc (CPU) and
ffi/src/quant_mx_kernels.cu (CUDA).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jax_moe_a2a import _ffi, layout
from jax_moe_a2a.quant_base import (E2M1_MAX, E2M1_VALUES, E4M3_MAX, E4M3_NAN_BITS, E8M0_NAN_BITS, F32_NAN_BITS,
                                    FP8_AMAX_FLOOR, MX_BLOCK, NVFP4_BLOCK, check_2d, check_dtype, check_float_input,
                                    check_global_scale, check_global_scale_value, check_out_dtype, e4m3_limit, pow2,
                                    pow2_scale_exponent, true_div, where_bits)

# ----------------------------------------------------------------------------------------------------------------
# MXFP8: E4M3 with one E8M0 (power-of-two) scale per 1x32 block
# ----------------------------------------------------------------------------------------------------------------


def _mx_dims(op: str, name: str, x: Any, mx_alignment: Optional[int]) -> tuple[int, int, int]:
  """Checks [M, K] and the alignment; returns (M, K, scale columns)."""
  m, k = check_2d(op, name, x)
  if mx_alignment is not None and (isinstance(mx_alignment, bool) or not isinstance(mx_alignment, int)
                                   or mx_alignment <= 0 or mx_alignment % MX_BLOCK):
    raise ValueError(f"{op}: mx_alignment must be None or a positive multiple of {MX_BLOCK}, got {mx_alignment!r}")
  if k == 0:
    raise ValueError(f"{op}: {name} must be [M, K] with K > 0, got shape {tuple(x.shape)}")
  if mx_alignment is None and k % MX_BLOCK:
    raise ValueError(f"{op}: {name} must be [M, K] with K % {MX_BLOCK} == 0 (or give an mx_alignment), "
                     f"got shape {tuple(x.shape)}")
  return m, k, layout.dispatch_layout(k, layout.MXFP8, mx_alignment=mx_alignment).scale_cols


@functools.partial(jax.jit, static_argnames=("mx_alignment",))
def quantize_mxfp8_reference(x: jax.Array, *, mx_alignment: Optional[int] = None) -> tuple[jax.Array, jax.Array]:
  """Pure-JAX reference of `quantize_mxfp8` (same signature and semantics, no argument checks)."""
  m, k = x.shape
  cols = layout.dispatch_layout(k, layout.MXFP8, mx_alignment=mx_alignment).scale_cols
  g = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, cols * MX_BLOCK - k))).reshape(m, cols, MX_BLOCK)
  amax = jnp.max(jnp.abs(g), axis=2)
  bad = jnp.any(~jnp.isfinite(g), axis=2)
  # Biased (+127) exponent of the scale, clamped to E8M0's finite range.
  biased = jnp.clip(pow2_scale_exponent(amax), 0, 254)
  # 1 / scale = 2^(127 - biased), a normal float32 (biased <= 247 for finite amax): the product is exact.
  inv_scale = pow2(254 - biased)
  limit = e4m3_limit(biased)[..., None]
  q = jnp.clip(g * inv_scale[..., None], -limit, limit).astype(jnp.float8_e4m3fn)
  q = where_bits(bad[..., None], E4M3_NAN_BITS, q).reshape(m, cols * MX_BLOCK)[:, :k]
  biased = jnp.where(bad, E8M0_NAN_BITS, biased).astype(jnp.uint8)
  return q, jax.lax.bitcast_convert_type(biased, jnp.float8_e8m0fnu)


def _ffi_quantize_mxfp8(x: jax.Array, cols: int) -> tuple[jax.Array, jax.Array]:
  """The custom call jax_moe_a2a_quantize_mxfp8: one pass over x; the scale count carries the padding."""
  m, k = x.shape
  out = (jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((m, cols), jnp.float8_e8m0fnu))
  return _ffi.ffi_call("quantize_mxfp8", out, x)


def quantize_mxfp8(x: jax.Array, *, mx_alignment: Optional[int] = None,
                   impl: str = "auto") -> tuple[jax.Array, jax.Array]:
  """Quantizes activations to MXFP8: E4M3 values with one power-of-two (E8M0) scale per 1x32 block.

  K is first padded with zero columns up to `pad(K, mx_alignment)` (`layout.dispatch_layout` gives the count).
  Per row and block `g` of 32 columns, in float32:

  1. `amax = max(|g|)`;
  2. `scale = 2^e` with `e` the smallest integer in [-127, 127] such that `amax <= 448 * 2^e`, computed exactly
     from the bits of amax (no logarithm); an all-zero block therefore gets the smallest scale, 2^-127 (byte
     0x00), and zero values;
  3. `q = e4m3(clip(g * 2^-e, -L, L))`: the product is exact and |g * 2^-e| <= 448; L = 448, except at the
     largest scale of a finite block, 2^120, where L = 240 (as in `quantize_fp8_blockwise`: the code 256 would
     dequantize to 2^128 = inf); the conversion rounds to nearest even;
  4. if the block holds a NaN or an infinity: scale is the E8M0 NaN (byte 0xFF) and every q of the block is the
     E4M3 NaN (0x7F); other blocks are unaffected.

  Values in the padded columns are not returned; blocks made only of padding have scale 2^-127.
  For finite x the error of `dequantize_mxfp8` is at most |x| * 2^-4 + scale * 2^-10 per element, and its
  result is finite.

  Args:
    x: `[M, K]` bfloat16, float16 or float32; K % 32 == 0 unless `mx_alignment` is given.
    mx_alignment: pad K up to this positive multiple of 32 before forming blocks (None: no padding).
    impl: "ffi" (the custom call jax_moe_a2a_quantize_mxfp8), "reference" (the pure-JAX `quantize_mxfp8_reference`)
      or "auto" (see `jax_moe_a2a._ffi.resolve_impl`). Both give the same bits.

  Returns:
    x_q: `[M, K] float8_e4m3fn`.
    x_sf: `[M, pad(K, mx_alignment) / 32] float8_e8m0fnu`, one scale per 1x32 block.

  Raises:
    TypeError: x is not bfloat16, float16 or float32.
    ValueError: x is not 2-D, K == 0, K % 32 != 0 without an alignment, or a bad alignment.
  """
  # Type and shape checks
  op = "quantize_mxfp8"
  check_float_input(op, "x", x)
  _, _, cols = _mx_dims(op, "x", x, mx_alignment)
  if _ffi.resolve_impl(op, impl) == "ffi":
    return _ffi_quantize_mxfp8(x, cols)
  return quantize_mxfp8_reference(x, mx_alignment=mx_alignment)


def _canonical_nan(g: jax.Array) -> jax.Array:
  """A NaN product becomes the float32 quiet NaN 0x7FC00000 before the cast: which operand's NaN a product
  returns depends on the backend and on how the compiler orders the operands, so it is fixed here."""
  return where_bits(jnp.isnan(g), F32_NAN_BITS, g)


@functools.partial(jax.jit, static_argnames=("dtype",))
def dequantize_mxfp8_reference(x_q: jax.Array, x_sf: jax.Array, *, dtype: Any = jnp.float32) -> jax.Array:
  """Pure-JAX reference of `dequantize_mxfp8` (no argument checks; the scale count carries the alignment)."""
  m, k = x_q.shape
  cols = x_sf.shape[1]
  g = jnp.pad(x_q.astype(jnp.float32), ((0, 0), (0, cols * MX_BLOCK - k))).reshape(m, cols, MX_BLOCK)
  g = g * x_sf.astype(jnp.float32)[..., None]
  return _canonical_nan(g.reshape(m, cols * MX_BLOCK)[:, :k]).astype(dtype)


def _ffi_dequantize(target: str, shape: tuple[int, int], dtype: Any, *args: jax.Array) -> jax.Array:
  """A dequantizing custom call: bfloat16, float16 and float32 are written directly; any other floating dtype is
  the float32 result cast, as the reference casts its float32 values."""
  direct = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
  out = _ffi.ffi_call(target, jax.ShapeDtypeStruct(shape, dtype if direct else jnp.float32), *args)
  return out if direct else out.astype(dtype)


def dequantize_mxfp8(x_q: jax.Array, x_sf: jax.Array, *, mx_alignment: Optional[int] = None,
                     dtype: Any = jnp.float32, impl: str = "auto") -> jax.Array:
  """Inverse of `quantize_mxfp8`: `float32(x_q) * 2^e` of its block, then cast to `dtype`.

  Args:
    x_q: `[M, K] float8_e4m3fn`.
    x_sf: `[M, pad(K, mx_alignment) / 32] float8_e8m0fnu`, one scale per 1x32 block.
    mx_alignment: the alignment `x_sf` was made with (None: K % 32 == 0, no padding).
    dtype: the floating output dtype.
    impl: "ffi" (the custom call jax_moe_a2a_dequantize_mxfp8), "reference" or "auto"; both give the same bits.

  Returns:
    `[M, K] dtype`; NaN blocks come back as NaN (`_canonical_nan`).
  """
  # Type and shape checks
  op = "dequantize_mxfp8"
  check_dtype(op, "x_q", x_q, jnp.float8_e4m3fn)
  m, k, cols = _mx_dims(op, "x_q", x_q, mx_alignment)
  check_dtype(op, "x_sf", x_sf, jnp.float8_e8m0fnu)
  if tuple(x_sf.shape) != (m, cols):
    raise ValueError(f"{op}: x_sf must be [M, pad(K, mx_alignment) / 32] = {(m, cols)} for x_q of shape "
                     f"{(m, k)} and mx_alignment={mx_alignment}, got shape {tuple(x_sf.shape)}")
  dtype = check_out_dtype(op, dtype)
  if _ffi.resolve_impl(op, impl) == "ffi":
    return _ffi_dequantize("dequantize_mxfp8", (m, k), dtype, x_q, x_sf)
  return dequantize_mxfp8_reference(x_q, x_sf, dtype=dtype)


# ----------------------------------------------------------------------------------------------------------------
# NVFP4: E2M1 with one E4M3 scale per 1x16 block and one FP32 global scale
# ----------------------------------------------------------------------------------------------------------------


def _e2m1_encode(v: jax.Array) -> jax.Array:
  """float32 -> E2M1 code (uint8, 0..15): round to nearest even on the grid, saturate at ±6, keep the sign.

  Each threshold is the midpoint between two neighbouring magnitudes; at a tie the even code wins, so the
  comparison is strict above an even code and inclusive above an odd one.
  """
  a = jnp.abs(v)
  mag = ((a > 0.25).astype(jnp.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5)
         + (a > 5.0))
  return mag.astype(jnp.uint8) | (jnp.signbit(v).astype(jnp.uint8) << 3)


def _e2m1_decode(code: jax.Array) -> jax.Array:
  """E2M1 code (uint8, 0..15) -> float32."""
  mag = jnp.asarray(E2M1_VALUES, jnp.float32)[(code & 7).astype(jnp.int32)]
  return jnp.where((code & 8) != 0, -mag, mag)


@jax.jit
def nvfp4_global_scale_reference(x: jax.Array) -> jax.Array:
  xf = x.astype(jnp.float32)
  amax = jnp.max(jnp.where(jnp.isfinite(xf), jnp.abs(xf), 0.0), initial=0.0)
  return true_div(jnp.maximum(amax, jnp.float32(FP8_AMAX_FLOOR)), jnp.float32(E4M3_MAX * E2M1_MAX))


def nvfp4_global_scale(x: jax.Array, *, impl: str = "auto") -> jax.Array:
  """The NVFP4 global (decode) scale of `x`: `max(amax, float32(1e-12)) / float32(2688)` (2688 = 448 * 6).

  amax is the largest |x| over the finite elements only, so a NaN or an infinity does not spoil the other
  blocks; the 1e-12 floor keeps an all-zero (or empty) tensor's scale positive.

  Args:
    x: any shape, bfloat16, float16 or float32.
    impl: "ffi" (the custom call jax_moe_a2a_nvfp4_global_scale: one pass over x), "reference" or "auto"; both
      give the same bits.

  Returns:
    `[] float32`.
  """
  # Type and shape checks
  op = "nvfp4_global_scale"
  check_float_input(op, "x", x)
  if _ffi.resolve_impl(op, impl) == "ffi":
    return _ffi.ffi_call("nvfp4_global_scale", jax.ShapeDtypeStruct((), jnp.float32), x)
  return nvfp4_global_scale_reference(x)


@jax.jit
def quantize_nvfp4_reference(x: jax.Array, *, global_scale: Optional[jax.Array] = None
                             ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Pure-JAX reference of `quantize_nvfp4` (same signature and semantics, no argument checks)."""
  m, k = x.shape
  gs = nvfp4_global_scale_reference(x) if global_scale is None else jnp.asarray(global_scale, jnp.float32)
  g = x.astype(jnp.float32).reshape(m, k // NVFP4_BLOCK, NVFP4_BLOCK)
  amax = jnp.max(jnp.abs(g), axis=2)
  bad = jnp.any(~jnp.isfinite(g), axis=2)
  ratio = true_div(true_div(amax, jnp.float32(E2M1_MAX)), gs)
  # ratio > 0 selects +0 for a zero, negative or NaN ratio (a bad global scale under jit): fixed bits everywhere.
  sf = jnp.where(ratio > 0, jnp.minimum(ratio, jnp.float32(E4M3_MAX)), jnp.float32(0.0)).astype(jnp.float8_e4m3fn)
  # XLA may drop a narrowing conversion followed by a widening one (excess precision, on GPUs); the barrier keeps
  # the E4M3 rounding of the scale that divides the block.
  denom = jax.lax.optimization_barrier(sf).astype(jnp.float32) * gs
  v = jnp.where(denom[..., None] > 0, true_div(g, denom[..., None]), 0.0)
  code = jnp.where(bad[..., None], jnp.uint8(0), _e2m1_encode(v)).reshape(m, k // 2, 2)
  x_q = code[..., 0] | (code[..., 1] << 4)
  return x_q, where_bits(bad, E4M3_NAN_BITS, sf), gs


def _ffi_quantize_nvfp4(x: jax.Array, global_scale: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The custom call jax_moe_a2a_quantize_nvfp4: one pass over x with the global scale read on the device."""
  m, k = x.shape
  out = (jax.ShapeDtypeStruct((m, k // 2), jnp.uint8),
         jax.ShapeDtypeStruct((m, k // NVFP4_BLOCK), jnp.float8_e4m3fn))
  return _ffi.ffi_call("quantize_nvfp4", out, x, global_scale)


def quantize_nvfp4(x: jax.Array, *, global_scale: Optional[jax.Array] = None,
                   impl: str = "auto") -> tuple[jax.Array, jax.Array, jax.Array]:
  """Quantizes activations to NVFP4: E2M1 values, one E4M3 scale per 1x16 block, one FP32 global scale.

  `global_scale` is the FP32 *decode* factor: x ≈ e2m1 value * float32(block scale) * global_scale. In float32,
  per row and block `g` of 16 columns:

  1. `global_scale` (when not given) `= max(amax(x), 1e-12) / 2688`, amax over the finite elements of x (see
     `nvfp4_global_scale`);
  2. `r = (max(|g|) / 6) / global_scale` (correctly rounded divisions) and `s_b = e4m3(min(r, 448))` where r > 0,
     else +0 (round to nearest even; the 448 only matters for a given global_scale that is too small);
  3. `d = float32(s_b) * global_scale`; the codes are `e2m1(g / d)`, rounded to nearest even on the grid
     {0, 0.5, 1, 1.5, 2, 3, 4, 6}, saturated at ±6, sign kept (so -0 and small negatives give code 0x8);
  4. when `s_b` is 0 (an all-zero block, or one far below the global scale) every code of the block is +0;
  5. when the block holds a NaN or an infinity: `s_b` is the E4M3 NaN (0x7F) and every code is +0 (E2M1 has
     no NaN), so the block dequantizes to NaN; other blocks are unaffected.

  Packing: byte j of a row holds column 2j in its low nibble and column 2j+1 in its high nibble; a nibble is
  sign (bit 3) and the index of the magnitude in {0, 0.5, 1, 1.5, 2, 3, 4, 6} (bits 0-2).

  With the derived global scale and s_b an E4M3 normal, the error of `dequantize_nvfp4` is at most
  `max(|g|) / 6 * (1 + 2^-4)` per element (half the widest E2M1 step, at the scale rounded up by 2^-4).

  Args:
    x: `[M, K]` bfloat16, float16 or float32 with K % 16 == 0.
    global_scale: `[] float32` decode factor, positive and finite (None: derived from x as in step 1). Give one
      to share a scale between tensors, e.g. across ranks. A concrete value (a Python or NumPy number, a
      committed array) is checked. A traced one (under `jax.jit`, where its value is not known) cannot be: there
      a zero or negative scale gives all-zero codes (every block dequantizes to 0) and a NaN or infinite one
      gives blocks that dequantize to NaN, with no error.
    impl: "ffi" (the custom calls jax_moe_a2a_nvfp4_global_scale, when the scale is derived, and
      jax_moe_a2a_quantize_nvfp4), "reference" (the pure-JAX `quantize_nvfp4_reference`) or "auto" (see
      `jax_moe_a2a._ffi.resolve_impl`). Both give the same bits.

  Returns:
    x_q: `[M, K/2] uint8`, two E2M1 codes per byte.
    x_sf: `[M, K/16] float8_e4m3fn`, one scale per 1x16 block.
    global_scale: `[] float32`.

  Raises:
    TypeError: x is not bfloat16, float16 or float32, or global_scale is not a float scalar.
    ValueError: x is not 2-D, K % 16 != 0 or K == 0, or global_scale is not a scalar, or a concrete global_scale
      is zero, negative, infinite or NaN.
  """
  # Type and shape checks
  op = "quantize_nvfp4"
  check_float_input(op, "x", x)
  _, k = check_2d(op, "x", x)
  if k % NVFP4_BLOCK or k == 0:
    raise ValueError(f"{op}: x must be [M, K] with K % {NVFP4_BLOCK} == 0 and K > 0, got shape {tuple(x.shape)}")
  if global_scale is not None:
    global_scale = check_global_scale(op, global_scale)
    check_global_scale_value(op, global_scale)
  if _ffi.resolve_impl(op, impl) == "ffi":
    if global_scale is None:
      global_scale = nvfp4_global_scale(x, impl="ffi")
    return (*_ffi_quantize_nvfp4(x, global_scale), global_scale)
  return quantize_nvfp4_reference(x, global_scale=global_scale)


@functools.partial(jax.jit, static_argnames=("dtype",))
def dequantize_nvfp4_reference(x_q: jax.Array, x_sf: jax.Array, global_scale: jax.Array, *,
                               dtype: Any = jnp.float32) -> jax.Array:
  """Pure-JAX reference of `dequantize_nvfp4` (no argument checks)."""
  m, half_k = x_q.shape
  code = jnp.stack([x_q & 0xF, x_q >> 4], axis=-1).reshape(m, 2 * half_k // NVFP4_BLOCK, NVFP4_BLOCK)
  g = (_e2m1_decode(code) * x_sf.astype(jnp.float32)[..., None]) * jnp.asarray(global_scale, jnp.float32)
  return _canonical_nan(g.reshape(m, 2 * half_k)).astype(dtype)


def dequantize_nvfp4(x_q: jax.Array, x_sf: jax.Array, global_scale: jax.Array, *,
                     dtype: Any = jnp.float32, impl: str = "auto") -> jax.Array:
  """Inverse of `quantize_nvfp4`: `(e2m1 value * float32(s_b)) * global_scale`, then cast to `dtype`.

  Args:
    x_q: `[M, K/2] uint8`, two E2M1 codes per byte (low nibble: even column).
    x_sf: `[M, K/16] float8_e4m3fn`, one scale per 1x16 block.
    global_scale: `[] float32` decode factor.
    dtype: the floating output dtype.
    impl: "ffi" (the custom call jax_moe_a2a_dequantize_nvfp4), "reference" or "auto"; both give the same bits.

  Returns:
    `[M, K] dtype`; NaN blocks come back as NaN (`_canonical_nan`).
  """
  # Type and shape checks
  op = "dequantize_nvfp4"
  check_dtype(op, "x_q", x_q, jnp.uint8)
  m, half_k = check_2d(op, "x_q", x_q, "[M, K/2]")
  k = 2 * half_k
  if k % NVFP4_BLOCK or k == 0:
    raise ValueError(f"{op}: x_q must be [M, K/2] with K % {NVFP4_BLOCK} == 0 and K > 0, got shape "
                     f"{tuple(x_q.shape)}")
  check_dtype(op, "x_sf", x_sf, jnp.float8_e4m3fn)
  if tuple(x_sf.shape) != (m, k // NVFP4_BLOCK):
    raise ValueError(f"{op}: x_sf must be [M, K/16] = {(m, k // NVFP4_BLOCK)} for x_q of shape {(m, half_k)}, "
                     f"got shape {tuple(x_sf.shape)}")
  global_scale = check_global_scale(op, global_scale)
  dtype = check_out_dtype(op, dtype)
  if _ffi.resolve_impl(op, impl) == "ffi":
    return _ffi_dequantize("dequantize_nvfp4", (m, k), dtype, x_q, x_sf, global_scale)
  return dequantize_nvfp4_reference(x_q, x_sf, global_scale, dtype=dtype)
