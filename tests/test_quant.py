"""Quantization formats: bit-exact NumPy references, error bounds, layouts, non-finite groups and errors."""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_moe_a2a import layout, quant, quant_base

F32 = np.float32
E4M3 = ml_dtypes.float8_e4m3fn


def _bits(a):
  """Raw bits of an array, for exact comparisons that also cover NaN payloads and signed zeros."""
  a = np.asarray(a)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _abstract(shape, dtype=jnp.float32):
  """Shape and dtype only: the argument checks must reject it before any computation."""
  return jax.ShapeDtypeStruct(shape, dtype)


def _e4m3_positive_values():
  """All finite positive E4M3 values, ascending."""
  return np.arange(1, 0x7F, dtype=np.uint8).view(E4M3).astype(F32)


def _wide(rng, m, k, lo=-40, hi=40, spread=24):
  """[m, k] float32: each 1x128 group has its own binade in [lo, hi], elements spread over `spread` binades below.

  Many elements land in the E4M3 subnormal range of their group (|x| / amax < 2^-6 / 448), none in float32's.
  """
  base = rng.integers(lo, hi, size=(m, k // 128, 1)).repeat(128, axis=-1).reshape(m, k)
  mag = np.exp2(base - rng.uniform(0, spread, size=(m, k))) * (1 + rng.uniform(0, 1, size=(m, k)))
  return (np.where(rng.uniform(size=(m, k)) < 0.5, -1, 1) * mag).astype(F32)


def _tie_group(rng, exp):
  """A 1x128 group whose scale is exactly 2^exp and whose other values sit exactly halfway between E4M3 values."""
  v = _e4m3_positive_values()
  mids = np.concatenate([[v[0] / 2], (v[:-1] + v[1:]) / 2])  # 126 midpoints, subnormal ones included
  g = np.concatenate([[448.0], mids * np.where(rng.uniform(size=mids.size) < 0.5, -1, 1), [-0.0]]).astype(F32)
  assert g.size == 128
  return np.ldexp(g, exp).astype(F32)


# ----------------------------------------------------------------------------------------------------------------
# NumPy references (float32 NumPy arithmetic + ml_dtypes conversions), written from the docstrings
# ----------------------------------------------------------------------------------------------------------------


def _ref_pow2_scale(amax):
  """Smallest power of two s with max(amax, 1e-12) <= 448 * s, from frexp: a = f * 2^ex, 448 = 0.875 * 2^9."""
  f, ex = np.frexp(np.maximum(amax, F32(1e-12)))
  return np.ldexp(F32(1), ex - 9 + (f > 0.875)).astype(F32)


def _ref_fp8_groups(g, axes):
  """Blockwise FP8 of float32 g over block axes; returns (q bits uint8 like g, scale bits uint32 keepdims)."""
  with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
    amax = np.max(np.abs(g), axis=axes, keepdims=True)
    bad = ~np.all(np.isfinite(g), axis=axes, keepdims=True)
    scale = _ref_pow2_scale(amax)
    q = np.clip(g / scale, F32(-448), F32(448)).astype(E4M3).view(np.uint8)
  assert scale.dtype == np.float32
  return np.where(bad, np.uint8(0x7F), q), np.where(bad, np.uint32(0x7FC00000), scale.view(np.uint32))


def _ref_fp8_blockwise(x):
  x = np.asarray(x).astype(F32)
  m, k = x.shape
  q, s = _ref_fp8_groups(x.reshape(m, k // 128, 128), (2,))
  return q.reshape(m, k), s[..., 0]


def _ref_fp8_weight(w):
  w = np.asarray(w).astype(F32)
  *b, n, k = w.shape
  nb, kb = -(-n // 128), -(-k // 128)
  wp = np.zeros((*b, nb * 128, kb * 128), F32)
  wp[..., :n, :k] = w
  q, s = _ref_fp8_groups(wp.reshape(*b, nb, 128, kb, 128), (-3, -1))
  return q.reshape(*b, nb * 128, kb * 128)[..., :n, :k], s[..., 0, :, 0]


def _ref_mxfp8(x, mx_alignment=None):
  """MXFP8 with e derived independently, from frexp: amax = f * 2^ex, f in [0.5, 1), 448 = 0.875 * 2^9."""
  x = np.asarray(x).astype(F32)
  m, k = x.shape
  kp = layout.round_up(k, mx_alignment or 32)
  g = np.zeros((m, kp), F32)
  g[:, :k] = x
  g = g.reshape(m, kp // 32, 32)
  with np.errstate(invalid="ignore", over="ignore"):
    amax = np.max(np.abs(g), axis=2)
    bad = ~np.all(np.isfinite(g), axis=2)
    f, ex = np.frexp(amax)
    e = np.where(f <= 0.875, ex - 9, ex - 8)
    e = np.where(amax == 0, -127, np.clip(e, -127, 127)).astype(np.int32)
    q = np.ldexp(g, -e[..., None]).astype(F32).astype(E4M3).view(np.uint8)
  q = np.where(bad[..., None], np.uint8(0x7F), q).reshape(m, kp)[:, :k]
  sf = np.where(bad, 0xFF, e + 127).astype(np.uint8)
  return q, sf


def _ref_nvfp4(x, global_scale=None):
  """NVFP4 with the E2M1 rounding done by ml_dtypes' float4_e2m1fn (an independent encoder)."""
  x = np.asarray(x).astype(F32)
  m, k = x.shape
  with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
    if global_scale is None:
      amax = np.max(np.where(np.isfinite(x), np.abs(x), F32(0)), initial=F32(0))
      global_scale = np.maximum(amax, F32(1e-12)) / F32(2688)
    gs = F32(global_scale)
    g = x.reshape(m, k // 16, 16)
    amax_b = np.max(np.abs(g), axis=2)
    bad = ~np.all(np.isfinite(g), axis=2)
    sf = np.clip((amax_b / F32(6)) / gs, F32(0), F32(448)).astype(E4M3)
    denom = (sf.astype(F32) * gs)[..., None]
    v = np.where(denom > 0, g / denom, F32(0)).astype(F32)
    code = np.clip(v, F32(-6), F32(6)).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
  code = np.where(bad[..., None], np.uint8(0), code).reshape(m, k)
  packed = (code[:, 0::2] | (code[:, 1::2] << 4)).astype(np.uint8)
  return packed, np.where(bad, np.uint8(0x7F), sf.view(np.uint8)), np.asarray(gs, F32)


def _e2m1_table_decode(packed):
  table = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], F32)
  codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
  return table[codes]


# ----------------------------------------------------------------------------------------------------------------
# fp8_blockwise
# ----------------------------------------------------------------------------------------------------------------


def _fp8_test_input(dtype):
  rng = np.random.default_rng(0)
  if dtype == jnp.float16:
    x = _wide(rng, 16, 512, lo=0, hi=15, spread=20)
  else:
    x = _wide(rng, 16, 512)
  x[0, :128] = _tie_group(rng, 0)
  x[1, 128:256] = _tie_group(rng, 5)
  x[2, 256:384] = 0.0
  x[3, 384 + 17] = np.nan
  x[4, 3] = np.inf
  x[5, 200] = -np.inf
  x[6, 7] = -0.0
  return np.asarray(jnp.asarray(x, dtype))  # the exact input values in `dtype`


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_fp8_blockwise_matches_numpy_reference_bit_for_bit(dtype):
  x = _fp8_test_input(dtype)
  q, sf = quant.quantize_fp8_blockwise(jnp.asarray(x))
  q_ref, sf_ref = _ref_fp8_blockwise(x)
  assert q.dtype == jnp.float8_e4m3fn and sf.dtype == jnp.float32
  np.testing.assert_array_equal(_bits(q), q_ref)
  np.testing.assert_array_equal(_bits(sf), sf_ref)
  # The data really exercise ties, E4M3 subnormals (exponent field 0, nonzero) and signed zeros.
  qb = _bits(q)
  assert np.sum(((qb & 0x78) == 0) & ((qb & 0x7) != 0)) > 500
  assert np.any(qb == 0x80) and np.any(qb == 0x00)
  if dtype == jnp.float32:  # inlined into a caller's jit, the result is the same
    q_jit, sf_jit = jax.jit(lambda x: quant.quantize_fp8_blockwise(x * 1))(jnp.asarray(x))
    np.testing.assert_array_equal(_bits(q_jit), q_ref)
    np.testing.assert_array_equal(_bits(sf_jit), sf_ref)


def test_fp8_blockwise_ties_round_to_even():
  x = np.zeros((16, 512), F32)
  x[0, :128] = _tie_group(np.random.default_rng(1), -3)
  q, sf = quant.quantize_fp8_blockwise(jnp.asarray(x))
  assert _bits(sf)[0, 0] == np.float32(2.0**-3).view(np.uint32)
  # Each midpoint between codes c and c + 1 goes to the even code; the group also ends with -0 (0x80).
  mags = _bits(q)[0, 1:127] & 0x7F
  assert np.all(mags % 2 == 0)
  np.testing.assert_array_equal(mags, 2 * ((np.arange(126) + 1) // 2))
  assert _bits(q)[0, 0] == 0x7E and _bits(q)[0, 127] == 0x80


def test_fp8_blockwise_round_trip_bound():
  """|deq - x| <= |x| * 2^-4 + scale * 2^-10: 3 mantissa bits for normals, half a subnormal step below 2^-6."""
  x = _wide(np.random.default_rng(2), 16, 512)
  q, sf = quant.quantize_fp8_blockwise(jnp.asarray(x))
  deq = np.asarray(quant.dequantize_fp8_blockwise(q, sf))
  scale = np.repeat(np.asarray(sf), 128, axis=1)
  bound = (np.abs(x) * 2.0**-4 + scale * 2.0**-10) * (1 + 2.0**-20)
  assert np.all(np.abs(deq - x) <= bound)
  assert np.max(np.abs(deq - x) / bound) > 0.5  # the bound is tight, not vacuous
  bf = quant.dequantize_fp8_blockwise(q, sf, dtype=jnp.bfloat16)
  assert bf.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(bf), np.asarray(jnp.asarray(deq, jnp.bfloat16)))


def test_fp8_blockwise_scales_on_hand_made_groups():
  x = np.zeros((16, 512), F32)
  x[0, 5], x[0, 9] = -448.0, 3.0  # amax 448 -> scale 1, values exact
  x[0, 200] = 896.0  # amax 896 -> scale 2
  x[0, 300] = 1.0  # amax 1 -> scale 2^-8 (the smallest power of two with 1 <= 448 * scale), value 256
  # x[0, 384:] stays zero -> scale 2^-48 (from the 1e-12 floor), values zero
  q, sf = quant.quantize_fp8_blockwise(jnp.asarray(x))
  sf = np.asarray(sf)
  np.testing.assert_array_equal(_bits(sf[0]), np.array([1.0, 2.0, 2.0**-8, 2.0**-48],
                                                       F32).view(np.uint32))
  q = np.asarray(q).astype(F32)
  assert q[0, 5] == -448 and q[0, 9] == 3 and q[0, 200] == 448 and q[0, 300] == 256
  assert np.all(q[0, 384:] == 0) and np.sum(q != 0) == 4
  assert np.all(_bits(sf[1:]) == _bits(F32(2.0**-48)))


def test_fp8_blockwise_block_major_k_is_the_transpose():
  x = jnp.asarray(_wide(np.random.default_rng(3), 16, 512), jnp.bfloat16)
  q, sf = quant.quantize_fp8_blockwise(x)
  q_t, sf_t = quant.quantize_fp8_blockwise(x, block_major_k=True)
  assert sf.shape == (16, 4) and sf_t.shape == (4, 16)
  np.testing.assert_array_equal(_bits(q_t), _bits(q))
  np.testing.assert_array_equal(_bits(sf_t), _bits(sf).T)
  np.testing.assert_array_equal(np.asarray(quant.dequantize_fp8_blockwise(q_t, sf_t, block_major_k=True)),
                                np.asarray(quant.dequantize_fp8_blockwise(q, sf)))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_fp8_blockwise_non_finite_group_is_nan_and_isolated(bad):
  x = _wide(np.random.default_rng(4), 16, 512)
  clean = x.copy()
  x[1, 130] = bad
  q, sf = quant.quantize_fp8_blockwise(jnp.asarray(x))
  q_clean, sf_clean = quant.quantize_fp8_blockwise(jnp.asarray(clean))
  qb, sb = _bits(q).copy(), _bits(sf).copy()
  assert np.all(qb[1, 128:256] == 0x7F) and sb[1, 1] == 0x7FC00000
  qb[1, 128:256], sb[1, 1] = _bits(q_clean)[1, 128:256], _bits(sf_clean)[1, 1]
  np.testing.assert_array_equal(qb, _bits(q_clean))
  np.testing.assert_array_equal(sb, _bits(sf_clean))
  deq = np.asarray(quant.dequantize_fp8_blockwise(q, sf))
  assert np.all(np.isnan(deq[1, 128:256])) and np.sum(np.isnan(deq)) == 128


def test_fp8_blockwise_empty_rows():
  for block_major_k, sf_shape in ((False, (0, 2)), (True, (2, 0))):
    q, sf = quant.quantize_fp8_blockwise(jnp.zeros((0, 256), jnp.bfloat16), block_major_k=block_major_k)
    assert q.shape == (0, 256) and q.dtype == jnp.float8_e4m3fn and sf.shape == sf_shape
    assert quant.dequantize_fp8_blockwise(q, sf, block_major_k=block_major_k).shape == (0, 256)


@pytest.mark.parametrize("x,exc,msg", [
    (_abstract((4, 128), jnp.int32), TypeError, r"quantize_fp8_blockwise: x must be bfloat16, float16 or float32, "
     r"got int32"),
    (_abstract((128,), jnp.float32), ValueError, r"quantize_fp8_blockwise: x must be 2-D \[M, K\], got shape "
     r"\(128,\)"),
    (_abstract((4, 100), jnp.bfloat16), ValueError, r"quantize_fp8_blockwise: x must be \[M, K\] with K % 128 == 0, "
     r"got shape \(4, 100\)"),
    (_abstract((4, 0), jnp.bfloat16), ValueError, r"x must be \[M, K\] with K > 0, got shape \(4, 0\)"),
    (None, TypeError, r"quantize_fp8_blockwise: x must be an array, got NoneType"),
])
def test_fp8_blockwise_errors(x, exc, msg):
  with pytest.raises(exc, match=msg):
    quant.quantize_fp8_blockwise(x)


# ----------------------------------------------------------------------------------------------------------------
# to_block_major_k and check_fp8_blockwise
# ----------------------------------------------------------------------------------------------------------------


def test_to_block_major_k():
  q, sf = quant.quantize_fp8_blockwise(jnp.asarray(_wide(np.random.default_rng(5), 16, 512)))
  q2, sf_t = quant.to_block_major_k(q, sf)
  assert q2 is q and sf_t.shape == (4, 16) and sf_t.dtype == jnp.float32
  np.testing.assert_array_equal(_bits(sf_t), _bits(sf).T)
  assert quant.check_fp8_blockwise("my_op", q, sf_t, block_major_k=True) == (16, 512)


_Q = _abstract((4, 256), jnp.float8_e4m3fn)
_SF = _abstract((4, 2), jnp.float32)


@pytest.mark.parametrize("x_q,x_sf,exc,msg", [
    (_abstract((4, 256), jnp.bfloat16), _SF, TypeError, r"to_block_major_k: x_q must be float8_e4m3fn, got bfloat16"),
    (_abstract((4, 2, 128), jnp.float8_e4m3fn), _SF, ValueError,
     r"to_block_major_k: x_q must be 2-D \[M, K\], got shape \(4, 2, 128\)"),
    (_abstract((4, 200), jnp.float8_e4m3fn), _SF, ValueError,
     r"to_block_major_k: x_q must be \[M, K\] with K % 128 == 0 and K > 0, got shape \(4, 200\)"),
    (_Q, None, ValueError, r"to_block_major_k: x_sf must be given .*, got None"),
    (_Q, _abstract((4, 2), jnp.bfloat16), TypeError, r"to_block_major_k: x_sf must be float32, got bfloat16"),
    (_Q, _abstract((2, 4), jnp.float32), ValueError,
     r"to_block_major_k: x_sf must be \[M, K/128\] = \(4, 2\) for x_q of shape \(4, 256\), got shape \(2, 4\)"),
    (_Q, _abstract((4, 3), jnp.float32), ValueError, r"x_sf must be \[M, K/128\] = \(4, 2\) .*got shape \(4, 3\)"),
])
def test_to_block_major_k_errors(x_q, x_sf, exc, msg):
  with pytest.raises(exc, match=msg):
    quant.to_block_major_k(x_q, x_sf)


def test_check_fp8_blockwise_names_the_caller_and_the_transposed_layout():
  with pytest.raises(ValueError, match=r"grouped_gemm: x_sf must be \[K/128, M\] = \(2, 4\) .*got shape \(4, 2\)"):
    quant.check_fp8_blockwise("grouped_gemm", _Q, _SF, block_major_k=True)
  with pytest.raises(ValueError, match=r"dequantize_fp8_blockwise: x_sf must be given"):
    quant.dequantize_fp8_blockwise(_Q, None)
  with pytest.raises(TypeError, match=r"dequantize_fp8_blockwise: dtype must be a floating dtype, got .*int32"):
    quant.dequantize_fp8_blockwise(_Q, _SF, dtype=jnp.int32)


# ----------------------------------------------------------------------------------------------------------------
# mxfp8
# ----------------------------------------------------------------------------------------------------------------


def _mx_input(m=16, k=256):
  rng = np.random.default_rng(6)
  x = _wide(rng, m, k)
  x[0, :32] = np.ldexp(np.linspace(-448, 448, 32), 3)  # amax exactly 448 * 2^3 -> scale 2^3
  x[1, :32] = np.nextafter(F32(448), F32(1000))  # just above 448 -> scale 2
  x[2, 32:64] = 0.0
  x[3, 70] = np.nan
  x[4, 100] = -np.inf
  return x


@pytest.mark.parametrize("k,mx_alignment", [(256, None), (100, 128), (256, 128), (96, 64)])
def test_mxfp8_matches_numpy_reference_bit_for_bit(k, mx_alignment):
  x = _mx_input(k=max(k, 128))[:, :k]
  q, sf = quant.quantize_mxfp8(jnp.asarray(x), mx_alignment=mx_alignment)
  q_ref, sf_ref = _ref_mxfp8(x, mx_alignment)
  assert q.dtype == jnp.float8_e4m3fn and sf.dtype == jnp.float8_e8m0fnu
  assert sf.shape == (16, layout.dispatch_layout(k, layout.MXFP8, mx_alignment=mx_alignment).scale_cols)
  np.testing.assert_array_equal(_bits(q), q_ref)
  np.testing.assert_array_equal(_bits(sf), sf_ref)


def test_mxfp8_scales_are_the_smallest_powers_of_two_that_fit():
  x = _mx_input()
  x[3, 70], x[4, 100] = 1.0, 1.0
  q, sf = quant.quantize_mxfp8(jnp.asarray(x))
  e = _bits(sf).astype(np.int32) - 127
  scale = np.asarray(sf).astype(np.float64)
  np.testing.assert_array_equal(scale, np.exp2(e))  # the E8M0 byte is exactly the exponent
  amax = np.max(np.abs(x.reshape(16, 8, 32)), axis=2).astype(np.float64)
  assert np.all(amax / scale <= 448)
  nonzero = amax > 0
  assert np.all(amax[nonzero] / (scale[nonzero] / 2) > 448)  # half the scale would not fit
  assert e[0, 0] == 3 and e[1, 0] == 1 and e[2, 1] == -127
  assert np.all(np.abs(np.asarray(q).astype(np.float64)) <= 448)


def test_mxfp8_round_trip_bound():
  x = _wide(np.random.default_rng(7), 16, 256)
  q, sf = quant.quantize_mxfp8(jnp.asarray(x))
  deq = np.asarray(quant.dequantize_mxfp8(q, sf))
  scale = np.repeat(np.asarray(sf).astype(F32), 32, axis=1)
  bound = np.abs(x) * 2.0**-4 + scale * 2.0**-10
  assert np.all(np.abs(deq - x) <= bound)
  assert np.max(np.abs(deq - x) / bound) > 0.5


def test_mxfp8_alignment_pads_with_zero_blocks():
  x = _wide(np.random.default_rng(8), 4, 128)[:, :100]
  q, sf = quant.quantize_mxfp8(jnp.asarray(x), mx_alignment=256)
  assert q.shape == (4, 100) and sf.shape == (4, 8)
  padded = np.zeros((4, 128), F32)
  padded[:, :100] = x
  q_p, sf_p = quant.quantize_mxfp8(jnp.asarray(padded))
  np.testing.assert_array_equal(_bits(q), _bits(q_p)[:, :100])
  np.testing.assert_array_equal(_bits(sf)[:, :4], _bits(sf_p))
  assert np.all(_bits(sf)[:, 4:] == 0x00)  # padding-only blocks: scale 2^-127
  deq = np.asarray(quant.dequantize_mxfp8(q, sf, mx_alignment=256))
  np.testing.assert_array_equal(deq, np.asarray(quant.dequantize_mxfp8(q_p, sf_p))[:, :100])


def test_mxfp8_zero_block_and_non_finite_blocks():
  x = np.ones((2, 128), F32)
  x[0, :32] = 0.0
  x[0, 40] = np.nan
  x[1, 127] = np.inf
  q, sf = quant.quantize_mxfp8(jnp.asarray(x))
  np.testing.assert_array_equal(_bits(sf), [[0x00, 0xFF, 119, 119], [119, 119, 119, 0xFF]])
  qb = _bits(q)
  assert np.all(qb[0, :32] == 0) and np.all(qb[0, 32:64] == 0x7F) and np.all(qb[1, 96:] == 0x7F)
  assert np.all(np.asarray(q).astype(F32)[0, 64:] == 256.0)  # 1 / 2^-8
  deq = np.asarray(quant.dequantize_mxfp8(q, sf))
  assert np.sum(np.isnan(deq)) == 64 and np.all(deq[0, :32] == 0) and np.all(deq[1, :96] == 1)


@pytest.mark.parametrize("call,exc,msg", [
    (lambda: quant.quantize_mxfp8(_abstract((2, 100))), ValueError,
     r"quantize_mxfp8: x must be \[M, K\] with K % 32 == 0 \(or give an mx_alignment\), got shape \(2, 100\)"),
    (lambda: quant.quantize_mxfp8(_abstract((2, 64)), mx_alignment=48), ValueError,
     r"quantize_mxfp8: mx_alignment must be None or a positive multiple of 32, got 48"),
    (lambda: quant.quantize_mxfp8(_abstract((2, 64), jnp.int8)), TypeError, r"quantize_mxfp8: x must be bfloat16"),
    (lambda: quant.dequantize_mxfp8(_abstract((2, 64), jnp.float8_e4m3fn), _abstract((2, 2), jnp.float32)),
     TypeError, r"dequantize_mxfp8: x_sf must be float8_e8m0fnu, got float32"),
    (lambda: quant.dequantize_mxfp8(_abstract((2, 64), jnp.float8_e4m3fn), _abstract((2, 2), jnp.float8_e8m0fnu),
                                    mx_alignment=128), ValueError,
     r"dequantize_mxfp8: x_sf must be \[M, pad\(K, mx_alignment\) / 32\] = \(2, 4\) .*got shape \(2, 2\)"),
])
def test_mxfp8_errors(call, exc, msg):
  with pytest.raises(exc, match=msg):
    call()


# ----------------------------------------------------------------------------------------------------------------
# nvfp4
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ulps", [-2, -1, 0, 1, 2])
def test_a_quotient_up_to_two_ulps_off_is_rounded_correctly(ulps):
  """The reference's divisions must be correctly rounded on every backend (XLA's float32 division on GPUs is not):
  from a quotient `ulps` off, over 2^-60..2^60 operands of both signs, the correction gives NumPy's a / b."""
  rng = np.random.default_rng(1)
  n = 1 << 16
  a = (rng.standard_normal(n) * np.exp2(rng.integers(-60, 60, n))).astype(F32)
  b = (rng.standard_normal(n) * np.exp2(rng.integers(-60, 60, n))).astype(F32)
  want = a / b
  off = (want.view(np.int32) + np.int32(ulps)).view(F32)
  got = np.asarray(jax.jit(quant_base.round_quotient)(a, b, off))
  np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_true_division_keeps_zeros_infinities_and_nans():
  """Signed zeros, infinities and NaNs as NumPy's. A subnormal quotient is the backend's division (XLA:CPU flushes
  it to a signed zero), so only its sign and range are checked."""
  vals = np.array([0.0, -0.0, 1.2e-38, 0.3, -1.5, 6.0, 2688.0, 1e30, 3.4e38, np.inf, -np.inf, np.nan], F32)
  a, b = (v.ravel() for v in np.meshgrid(vals, vals))
  with np.errstate(all="ignore"):
    want = a / b
  got = np.asarray(jax.jit(quant_base.true_div)(a, b))
  nan, sub = np.isnan(want), (want != 0) & (np.abs(want) < np.finfo(F32).tiny)
  rest = ~nan & ~sub
  np.testing.assert_array_equal(got[rest].view(np.uint32), want[rest].view(np.uint32))
  assert np.isnan(got[nan]).all()
  assert sub.any() and (np.abs(got[sub]) < np.finfo(F32).tiny).all()
  np.testing.assert_array_equal(np.signbit(got[sub]), np.signbit(want[sub]))


def _nv_input(m=8, k=256, rng_seed=9):
  """Block amaxes within 2^3 of the tensor amax, so every block scale is an E4M3 normal."""
  rng = np.random.default_rng(rng_seed)
  x = rng.standard_normal((m, k)).astype(F32)
  x *= np.exp2(rng.integers(-3, 1, size=(m, k // 16, 1))).repeat(16, axis=-1).reshape(m, k).astype(F32)
  return x


@pytest.mark.parametrize("given", [False, True])
def test_nvfp4_matches_numpy_reference_bit_for_bit(given):
  x = _nv_input()
  amax = np.max(np.abs(x))
  x[4, :16] *= 1e-6 * amax / np.max(np.abs(x[4, :16]))  # block scale 448e-6 rounds to zero
  x[6, :16] *= 2e-5 * amax / np.max(np.abs(x[6, :16]))  # block scale 448 * 2e-5 is an E4M3 subnormal
  x[0, 5], x[1, 40], x[2, 255] = np.nan, np.inf, -np.inf
  x[3, 16:32] = 0.0
  x[5, 3] = -0.0
  gs = F32(0.0123) if given else None
  q, sf, g = quant.quantize_nvfp4(jnp.asarray(x), global_scale=gs)
  q_ref, sf_ref, g_ref = _ref_nvfp4(x, gs)
  assert q.dtype == jnp.uint8 and q.shape == (8, 128) and sf.dtype == jnp.float8_e4m3fn and sf.shape == (8, 16)
  assert g.dtype == jnp.float32 and g.shape == ()
  np.testing.assert_array_equal(np.asarray(q), q_ref)
  np.testing.assert_array_equal(_bits(sf), sf_ref)
  assert _bits(g) == _bits(g_ref)
  if not given:  # the special blocks are what they claim to be
    assert _bits(sf)[4, 0] == 0 and 0 < (_bits(sf)[6, 0] & 0x7F) < 8
  # Decoding is (value * s_b) * global_scale: value * s_b is exact, so there is one rounding.
  sfv = np.repeat(np.asarray(sf).astype(F32), 16, axis=1)
  with np.errstate(invalid="ignore"):
    want = (_e2m1_table_decode(q_ref) * sfv) * g_ref
  got, nan = np.asarray(quant.dequantize_nvfp4(q, sf, g)), np.isnan(want)
  np.testing.assert_array_equal(_bits(got[~nan]), _bits(want[~nan]))
  assert nan.any() and np.isnan(got[nan]).all()  # a NaN's payload is the backend's


def test_nvfp4_block_scale_divides_by_6_then_by_the_global_scale():
  """Pins the order of the two divisions with amaxes where (a / 6) / gs and a / (6 * gs) round apart in E4M3."""
  gs = F32(np.pi / 1000)  # a full 24-bit mantissa, so 6 * gs is inexact
  v = _e4m3_positive_values()
  mids = ((v[:-1] + v[1:]) / 2)[v[:-1] >= 2.0**-6]  # midpoints between normal E4M3 values
  a = (mids[:, None] * F32(6) * gs).astype(F32)
  steps = np.arange(-40, 41)
  a = (a.view(np.int32) + steps[None, :]).astype(np.int32).view(F32).ravel()
  ours = ((a / F32(6)) / gs).astype(E4M3).view(np.uint8)
  other = (a / (F32(6) * gs)).astype(E4M3).view(np.uint8)
  picked = a[ours != other][:128]
  assert picked.size >= 16  # enough cases where the order matters
  x = np.zeros((8, 256), F32)
  x.reshape(128, 16)[:picked.size, 0] = picked
  _, sf, _ = quant.quantize_nvfp4(jnp.asarray(x), global_scale=gs)
  got = _bits(sf).reshape(128)[:picked.size]
  np.testing.assert_array_equal(got, ((picked / F32(6)) / gs).astype(E4M3).view(np.uint8))


def test_nvfp4_e2m1_rounding_ties_and_saturation():
  rows = np.array([
      [6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, -0.1, -6],
      [6, 0.26, 0.74, 1.26, 1.74, 2.51, 3.49, 5.01, 4.99, -0.76, -2.4, 0, -0.0, 0.24, 2.6, 3.6],
      [5376, 448, -3136, 2239, -2240, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # scale clipped to 448
  ], F32)
  q, sf, g = quant.quantize_nvfp4(jnp.asarray(rows), global_scale=1.0)
  assert float(g) == 1.0
  np.testing.assert_array_equal(np.asarray(sf).astype(F32)[:, 0], [1.0, 1.0, 448.0])
  codes = np.stack([np.asarray(q) & 0xF, np.asarray(q) >> 4], axis=-1).reshape(3, 16)
  np.testing.assert_array_equal(codes[0], [7, 0, 2, 2, 4, 4, 6, 6, 1, 2, 3, 4, 5, 6, 8, 15])
  np.testing.assert_array_equal(codes[1], [7, 1, 1, 3, 3, 5, 5, 7, 6, 10, 12, 0, 8, 0, 5, 6])
  # x / 448 = 12 and -7 saturate to ±6; 4.998 -> 4; -5 is a tie between 4 and 6 -> 4 (even code).
  np.testing.assert_array_equal(codes[2, :5], [7, 2, 15, 6, 14])


def test_nvfp4_packing_low_nibble_is_the_even_column():
  x = np.zeros((1, 16), F32)
  x[0, :4] = [1.0, 6.0, -0.5, 3.0]  # codes 2, 7, 9, 5
  q, sf, _ = quant.quantize_nvfp4(jnp.asarray(x), global_scale=1.0)
  assert np.asarray(sf).astype(F32)[0, 0] == 1.0
  np.testing.assert_array_equal(np.asarray(q)[0, :2], [0x72, 0x59])
  assert np.all(np.asarray(q)[0, 2:] == 0)
  np.testing.assert_array_equal(np.asarray(quant.dequantize_nvfp4(q, sf, 1.0))[0], x[0])


def test_nvfp4_round_trip_bound_relative_to_block_amax():
  x = _nv_input(rng_seed=10)
  q, sf, g = quant.quantize_nvfp4(jnp.asarray(x))
  deq = np.asarray(quant.dequantize_nvfp4(q, sf, g))
  amax_b = np.repeat(np.max(np.abs(x.reshape(8, 16, 16)), axis=2), 16, axis=1)
  bound = amax_b / 6 * (1 + 2.0**-4) * (1 + 2.0**-20)
  assert np.all(np.abs(deq - x) <= bound)
  assert np.max(np.abs(deq - x) / bound) > 0.5
  # and the decode is exactly value * s_b * global_scale, in that order
  sfv = np.repeat(np.asarray(sf).astype(F32), 16, axis=1)
  np.testing.assert_array_equal(deq, (_e2m1_table_decode(np.asarray(q)) * sfv) * np.asarray(g))


def test_nvfp4_global_scale_given_or_derived():
  x = _nv_input()
  _, sf, g = quant.quantize_nvfp4(jnp.asarray(x))
  assert _bits(g) == _bits(np.max(np.abs(x)).astype(F32) / F32(2688))
  assert _bits(quant.nvfp4_global_scale(jnp.asarray(x))) == _bits(g)
  assert float(np.max(np.asarray(sf).astype(F32))) == 448.0  # the largest block uses the full E4M3 range
  q2, sf2, g2 = quant.quantize_nvfp4(jnp.asarray(x), global_scale=jnp.float32(2 * float(g)))
  assert float(g2) == np.float32(2 * float(g))
  assert float(np.max(np.asarray(sf2).astype(F32))) == 224.0
  deq2 = np.asarray(quant.dequantize_nvfp4(q2, sf2, g2))
  amax_b = np.repeat(np.max(np.abs(x.reshape(8, 16, 16)), axis=2), 16, axis=1)
  assert np.all(np.abs(deq2 - x) <= amax_b / 6 * (1 + 2.0**-4) * (1 + 2.0**-20))


def test_nvfp4_zero_input():
  q, sf, g = quant.quantize_nvfp4(jnp.zeros((4, 256), jnp.bfloat16))
  assert _bits(g) == _bits(F32(1e-12) / F32(2688))
  assert np.all(np.asarray(q) == 0) and np.all(_bits(sf) == 0)
  np.testing.assert_array_equal(np.asarray(quant.dequantize_nvfp4(q, sf, g)), np.zeros((4, 256)))
  q, sf, g = quant.quantize_nvfp4(jnp.zeros((0, 32), jnp.float32))
  assert q.shape == (0, 16) and sf.shape == (0, 2) and _bits(g) == _bits(F32(1e-12) / F32(2688))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nvfp4_non_finite_block_is_nan_and_isolated(bad):
  x = _nv_input()
  clean = x.copy()
  x[2, 37] = bad
  q, sf, g = quant.quantize_nvfp4(jnp.asarray(x))
  q_c, sf_c, g_c = quant.quantize_nvfp4(jnp.asarray(clean))
  assert _bits(g) == _bits(g_c)  # the global scale ignores non-finite values
  assert _bits(sf)[2, 2] == 0x7F and np.all(np.asarray(q)[2, 16:24] == 0)
  qb, sb = np.asarray(q).copy(), _bits(sf).copy()
  qb[2, 16:24], sb[2, 2] = np.asarray(q_c)[2, 16:24], _bits(sf_c)[2, 2]
  np.testing.assert_array_equal(qb, np.asarray(q_c))
  np.testing.assert_array_equal(sb, _bits(sf_c))
  deq = np.asarray(quant.dequantize_nvfp4(q, sf, g))
  assert np.all(np.isnan(deq[2, 32:48])) and np.sum(np.isnan(deq)) == 16


@pytest.mark.parametrize("call,exc,msg", [
    (lambda: quant.quantize_nvfp4(_abstract((2, 40))), ValueError,
     r"quantize_nvfp4: x must be \[M, K\] with K % 16 == 0 and K > 0, got shape \(2, 40\)"),
    (lambda: quant.quantize_nvfp4(_abstract((2, 32)), global_scale=jnp.ones(2)), ValueError,
     r"quantize_nvfp4: global_scale must be a scalar \(shape \(\)\), got shape \(2,\)"),
    (lambda: quant.quantize_nvfp4(_abstract((2, 32)), global_scale="1"), TypeError,
     r"quantize_nvfp4: global_scale must be a float32 scalar, got str"),
    (lambda: quant.dequantize_nvfp4(_abstract((2, 16), jnp.int8), _abstract((2, 2), jnp.float8_e4m3fn), 1.0),
     TypeError, r"dequantize_nvfp4: x_q must be uint8, got int8"),
    (lambda: quant.dequantize_nvfp4(_abstract((2, 16), jnp.uint8), _abstract((2, 4), jnp.float8_e4m3fn), 1.0),
     ValueError, r"dequantize_nvfp4: x_sf must be \[M, K/16\] = \(2, 2\) .*got shape \(2, 4\)"),
])
def test_nvfp4_errors(call, exc, msg):
  with pytest.raises(exc, match=msg):
    call()


# ----------------------------------------------------------------------------------------------------------------
# FP8 weights (128x128 blocks)
# ----------------------------------------------------------------------------------------------------------------


def test_fp8_weight_matches_reference_with_batch_dims_and_ragged_edges():
  rng = np.random.default_rng(11)
  w = (rng.standard_normal((2, 3, 200, 300)) * np.exp2(rng.integers(-10, 10, size=(2, 3, 1, 1)))).astype(F32)
  w[1, 2, 150, 290] = np.nan  # the last (partial) block of one matrix
  w = np.asarray(jnp.asarray(w, jnp.bfloat16))
  w_q, w_sf = jax.jit(quant.quantize_fp8_weight)(jnp.asarray(w))
  assert w_q.shape == (2, 3, 200, 300) and w_sf.shape == (2, 3, 2, 3) and w_sf.dtype == jnp.float32
  q_ref, sf_ref = _ref_fp8_weight(w)
  np.testing.assert_array_equal(_bits(w_q), q_ref)
  np.testing.assert_array_equal(_bits(w_sf), sf_ref)
  assert _bits(w_sf)[1, 2, 1, 2] == 0x7FC00000 and np.sum(np.isnan(np.asarray(w_sf))) == 1
  assert np.all(_bits(w_q)[1, 2, 128:, 256:] == 0x7F)


def test_fp8_weight_per_block_bound():
  rng = np.random.default_rng(12)
  w = (rng.standard_normal((4, 256, 200)) * np.exp2(rng.uniform(-12, 4, size=(4, 256, 200)))).astype(F32)
  w_q, w_sf = quant.quantize_fp8_weight(jnp.asarray(w))
  # Each scale is the power of two for its block's amax, blocks cut at 128x128 (the K edge block is 72 wide).
  amax = np.max(np.abs(w.reshape(4, 2, 128, 200)[..., :128]), axis=(2, 3))
  np.testing.assert_array_equal(np.asarray(w_sf)[..., 0], _ref_pow2_scale(amax))
  amax = np.max(np.abs(w.reshape(4, 2, 128, 200)[..., 128:]), axis=(2, 3))
  np.testing.assert_array_equal(np.asarray(w_sf)[..., 1], _ref_pow2_scale(amax))
  deq = np.asarray(quant.dequantize_fp8_weight(w_q, w_sf))
  scale = np.repeat(np.repeat(np.asarray(w_sf), 128, axis=1), 128, axis=2)[:, :256, :200]
  bound = np.abs(w) * 2.0**-4 + scale * 2.0**-10
  assert np.all(np.abs(deq - w) <= bound)
  assert np.max(np.abs(deq - w) / bound) > 0.5


def test_fp8_weight_zero_block_and_errors():
  w_q, w_sf = quant.quantize_fp8_weight(jnp.zeros((130, 5), jnp.float16))
  assert w_sf.shape == (2, 1) and np.all(_bits(w_sf) == _bits(F32(2.0**-48)))
  assert np.all(_bits(w_q) == 0)
  with pytest.raises(ValueError, match=r"quantize_fp8_weight: w must be \[..., N, K\] \(at least 2-D\), got shape"):
    quant.quantize_fp8_weight(_abstract((128,)))
  with pytest.raises(TypeError, match=r"quantize_fp8_weight: w must be bfloat16, float16 or float32, got int32"):
    quant.quantize_fp8_weight(_abstract((128, 128), jnp.int32))
  with pytest.raises(ValueError, match=r"dequantize_fp8_weight: w_sf must be \[..., ceil\(N/128\), ceil\(K/128\)\] "
                     r"= \(3, 2, 1\) .*got shape \(3, 1, 1\)"):
    quant.dequantize_fp8_weight(_abstract((3, 130, 5), jnp.float8_e4m3fn), _abstract((3, 1, 1), jnp.float32))


# ----------------------------------------------------------------------------------------------------------------
# Dispatch over formats
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", layout.FORMATS)
def test_quantize_dequantize_dispatch(fmt):
  x = jnp.asarray(_nv_input(4, 256), jnp.bfloat16)
  x_q, x_sf, gs = quant.quantize(x, fmt)
  d = layout.dispatch_layout(256, fmt)
  assert x_q.size * x_q.dtype.itemsize == 4 * d.x_bytes_per_token  # the bytes `layout` says travel
  assert (0 if x_sf is None else x_sf.size * x_sf.dtype.itemsize) == 4 * d.x_sf_bytes_per_token
  assert (gs is not None) == (fmt == layout.NVFP4)
  deq = np.asarray(quant.dequantize(x_q, x_sf, fmt, global_scale=gs))
  xf = np.asarray(x).astype(F32)
  if fmt == layout.BF16:
    np.testing.assert_array_equal(deq, xf)
  else:
    err = np.linalg.norm(deq - xf) / np.linalg.norm(xf)
    assert err < (0.15 if fmt == layout.NVFP4 else 0.04)


@pytest.mark.parametrize("fmt", [layout.MXFP8, layout.NVFP4])
def test_dequantize_dispatch_passes_impl_on(fmt):
  x = jnp.asarray(_nv_input(4, 256), jnp.bfloat16)
  x_q, x_sf, gs = quant.quantize(x, fmt, impl="reference")
  want = np.asarray(quant.dequantize(x_q, x_sf, fmt, global_scale=gs))
  got = np.asarray(quant.dequantize(x_q, x_sf, fmt, global_scale=gs, impl="reference"))
  np.testing.assert_array_equal(got, want)
  with pytest.raises(ValueError, match=f"dequantize_{fmt}: impl must be one of auto, ffi, reference, got 'gpu'"):
    quant.dequantize(x_q, x_sf, fmt, global_scale=gs, impl="gpu")  # the format's own dequantizer reads it


def test_dequantize_dispatch_refuses_impl_where_no_custom_call_is_chosen():
  x_q, x_sf, _ = quant.quantize(jnp.ones((2, 128), jnp.bfloat16), layout.FP8_BLOCKWISE)
  with pytest.raises(TypeError, match=re.escape(
      "dequantize: fp8_blockwise has no custom call to choose (its dequantization is a multiply XLA fuses): impl is "
      "for mxfp8 and nvfp4, got impl='ffi'")):
    quant.dequantize(x_q, x_sf, layout.FP8_BLOCKWISE, impl="ffi")
  with pytest.raises(TypeError, match=re.escape("dequantize: nvfp4 takes only the option impl, got ['block_major_k']")):
    quant.dequantize(jnp.zeros((2, 64), jnp.uint8), jnp.zeros((2, 8), jnp.float8_e4m3fn), layout.NVFP4,
                     global_scale=jnp.float32(1.0), block_major_k=True)


def test_dispatch_errors():
  with pytest.raises(ValueError, match=r"quantize: fmt must be one of bf16, fp8_blockwise, mxfp8, nvfp4, got 'fp4'"):
    quant.quantize(_abstract((2, 128)), "fp4")
  with pytest.raises(ValueError, match=r"dequantize: global_scale must be given for nvfp4, got None"):
    quant.dequantize(_abstract((2, 8), jnp.uint8), _abstract((2, 1), jnp.float8_e4m3fn), "nvfp4")
