"""What every quantizer shares: `quant` (FP8: blockwise activations, 128x128 weights, the K-major re-tiling) and
`quant_mx` (MXFP8 and NVFP4) build on it.

Here: the formats' block sizes, largest values and NaN bit patterns; the argument checks and their messages;
correctly rounded float32 division on every backend (`true_div`); power-of-two scales computed from the bits
(`pow2_scale_exponent`, `pow2`, `e4m3_limit`); selects on raw bits (`where_bits`). The conventions they serve are
`quant`'s module docstring's.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from jax_moe_a2a import layout

# ----------------------------------------------------------------------------------------------------------------
# Constants
# ----------------------------------------------------------------------------------------------------------------

FP8_BLOCK = layout.format_spec(layout.FP8_BLOCKWISE).block  # 128: activation group and weight block edge
MX_BLOCK = layout.format_spec(layout.MXFP8).block  # 32
NVFP4_BLOCK = layout.format_spec(layout.NVFP4).block  # 16

E4M3_MAX = 448.0  # largest finite float8_e4m3fn
E2M1_MAX = 6.0  # largest float4_e2m1fn
# Floor of a blockwise FP8 group's amax: an all-zero group gets scale 2^-48 (the power of two for 1e-12) instead
# of 0. Also the floor of the NVFP4 tensor amax behind the derived global scale.
FP8_AMAX_FLOOR = 1e-12

# Fixed bit patterns of the NaN markers.
E4M3_NAN_BITS = 0x7F  # canonical positive NaN of float8_e4m3fn
F32_NAN_BITS = 0x7FC00000  # canonical quiet NaN of float32
E8M0_NAN_BITS = 0xFF  # the only NaN of float8_e8m0fnu

# E2M1 code (low 3 bits; bit 3 is the sign) -> magnitude.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

FLOAT_INPUTS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
FLOAT_INPUTS_TEXT = "bfloat16, float16 or float32"

# ----------------------------------------------------------------------------------------------------------------
# Checks and helpers
# ----------------------------------------------------------------------------------------------------------------


def check_array(op: str, name: str, x: Any) -> None:
  if x is None or not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{op}: {name} must be an array, got {type(x).__name__}")


def check_float_input(op: str, name: str, x: Any) -> None:
  check_array(op, name, x)
  if jnp.dtype(x.dtype) not in FLOAT_INPUTS:
    raise TypeError(f"{op}: {name} must be {FLOAT_INPUTS_TEXT}, got {x.dtype}")


def check_dtype(op: str, name: str, x: Any, dtype: Any) -> None:
  check_array(op, name, x)
  if jnp.dtype(x.dtype) != jnp.dtype(dtype):
    raise TypeError(f"{op}: {name} must be {jnp.dtype(dtype).name}, got {x.dtype}")


def check_2d(op: str, name: str, x: Any, dims: str = "[M, K]") -> tuple[int, int]:
  if len(x.shape) != 2:
    raise ValueError(f"{op}: {name} must be 2-D {dims}, got shape {tuple(x.shape)}")
  return tuple(x.shape)


def check_out_dtype(op: str, dtype: Any) -> jnp.dtype:
  try:
    dt = jnp.dtype(dtype)
  except TypeError:
    dt = None
  if dt is None or not jnp.issubdtype(dt, jnp.floating):
    raise TypeError(f"{op}: dtype must be a floating dtype, got {dtype!r}")
  return dt


def check_global_scale(op: str, global_scale: Any) -> jax.Array:
  if isinstance(global_scale, bool) or not (isinstance(global_scale, (int, float)) or hasattr(global_scale, "dtype")):
    raise TypeError(f"{op}: global_scale must be a float32 scalar, got {type(global_scale).__name__}")
  if hasattr(global_scale, "dtype"):
    if not jnp.issubdtype(global_scale.dtype, jnp.floating):
      raise TypeError(f"{op}: global_scale must be a float32 scalar, got {global_scale.dtype}")
    if tuple(global_scale.shape) != ():
      raise ValueError(f"{op}: global_scale must be a scalar (shape ()), got shape {tuple(global_scale.shape)}")
  return jnp.asarray(global_scale, jnp.float32)


def check_global_scale_value(op: str, global_scale: Any) -> None:
  """Checks a concrete global scale: positive and finite. A traced one (under jit) cannot be checked here."""
  if isinstance(global_scale, jax.core.Tracer):
    return
  try:
    value = float(jax.device_get(global_scale))
  except (TypeError, jax.errors.ConcretizationTypeError):
    return  # an abstract value (e.g. a ShapeDtypeStruct): nothing to check
  if not (math.isfinite(value) and value > 0.0):
    raise ValueError(f"{op}: global_scale must be positive and finite (0 < global_scale < inf), got {value!r}")


def true_div(a: jax.Array, b: jax.Array) -> jax.Array:
  """`a / b` in float32, correctly rounded on every backend, both operands broadcast to one shape.

  XLA rewrites a division by a constant or by a broadcast into a multiplication by the reciprocal, which differs
  from true division in the last bit for about half of all inputs; passing full-shape operands through an
  optimization barrier hides that pattern (at the cost of materializing the divisor). On GPUs XLA's float32
  division itself is not correctly rounded (29% of random quotients measured an ulp off, 0.06% more), so the
  quotient is rounded again from its exact remainder on every backend (`round_quotient`).
  """
  a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
  a, b = jax.lax.optimization_barrier((a, b))
  return round_quotient(a, b, a / b)


def round_quotient(a: jax.Array, b: jax.Array, q: jax.Array, steps: int = 3) -> jax.Array:
  """`a / b` correctly rounded, given a float32 quotient `q` within `steps - 1` ulps of it.

  Where a, b or the quotient is zero, subnormal, infinite or NaN, `q` is returned as it is. Otherwise, with
  `|a| = ma 2^ea` and `|b| = mb 2^eb` (ma, mb in [0.5, 1)) and `qm = |q| 2^(eb - ea)` near `ma / mb` in
  (0.5, 2), each step computes the remainder `r = ma - qm mb` exactly (Dekker's product with Veltkamp's split:
  every partial product is exact, so contracting a product and a sum into an FMA changes nothing) and moves
  `qm` one ulp toward the quotient when `|r|` exceeds half the gap to that neighbour times `mb` (exactly
  representable, the gap being a power of two). A quotient is never exactly halfway between two floats, so
  there are no ties. The remainder is exact once `qm` is within an ulp; a first step from farther away still
  moves the right way.
  """
  f32 = jnp.float32
  tiny = jnp.finfo(f32).tiny
  ma, ea = jnp.frexp(jnp.abs(a))
  mb, eb = jnp.frexp(jnp.abs(b))
  qm = jnp.ldexp(jnp.abs(q), eb - ea)

  def split(x):  # x = hi + lo, each with at most 12 significant bits
    c = x * f32(4097.0)
    hi = c - (c - x)
    return hi, x - hi

  bh, bl = split(mb)
  for _ in range(steps):
    qh, ql = split(qm)
    p = qm * mb
    r = (ma - p) - ((((qh * bh - p) + qh * bl) + ql * bh) + ql * bl)
    up, down = jnp.nextafter(qm, f32(4.0)), jnp.nextafter(qm, f32(0.0))
    qm = jnp.where(r > mb * (up - qm) * f32(0.5), up, jnp.where(-r > mb * (qm - down) * f32(0.5), down, qm))
  out = jnp.where(jnp.signbit(a) != jnp.signbit(b), -1.0, 1.0).astype(f32) * jnp.ldexp(qm, ea - eb)
  normal = lambda x: jnp.isfinite(x) & (jnp.abs(x) >= tiny)
  return jnp.where(normal(a) & normal(b) & normal(q) & normal(out), out, q)


def where_bits(cond: jax.Array, bits: int, x: jax.Array) -> jax.Array:
  """`where(cond, <the value with bit pattern bits>, x)`, selecting on the raw bits so the pattern is exact."""
  udtype = {1: jnp.uint8, 4: jnp.uint32}[jnp.dtype(x.dtype).itemsize]
  xb = jax.lax.bitcast_convert_type(x, udtype)
  return jax.lax.bitcast_convert_type(jnp.where(cond, udtype(bits), xb), x.dtype)


def pow2_scale_exponent(amax: jax.Array) -> jax.Array:
  """Biased exponent (+127) of the smallest power of two 2^e with amax <= 448 * 2^e, for finite amax >= 0.

  amax = 1.f * 2^(E - 127) and 448 = 1.75 * 2^8, so e = E - 127 - 8, plus one when 1.f > 1.75 (mantissa field
  > 0x600000). Computed from the bits, exactly, on every backend.
  """
  bits = jax.lax.bitcast_convert_type(amax, jnp.uint32)
  exp_field = ((bits >> 23) & 0xFF).astype(jnp.int32)
  return exp_field - 8 + ((bits & 0x7FFFFF) > 0x600000).astype(jnp.int32)


# The largest scale a finite amax gets (float32's largest binade, 2^127, maps into (224, 448] at 2^120) and the
# largest E4M3 magnitude whose product with it is finite: 256 * 2^120 = 2^128 overflows, 240 * 2^120 does not.
TOP_SCALE_BIASED = 247
E4M3_MAX_AT_TOP_SCALE = 240.0


def e4m3_limit(biased: jax.Array) -> jax.Array:
  """The clip of the scaled values for a scale of biased exponent `biased`: 448, or 240 at the top scale 2^120,
  so that a value near the float32 maximum does not round up to the code 256, whose product with 2^120 is inf."""
  return jnp.where(biased >= TOP_SCALE_BIASED, jnp.float32(E4M3_MAX_AT_TOP_SCALE), jnp.float32(E4M3_MAX))


def pow2(biased: jax.Array) -> jax.Array:
  """2^(biased - 127) as float32, for biased in [1, 254]."""
  return jax.lax.bitcast_convert_type((biased << 23).astype(jnp.uint32), jnp.float32)
