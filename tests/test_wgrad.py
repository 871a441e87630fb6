"""The FP8 weight gradient's references: K-major grouped quantization (`quant.quantize_fp8_grouped_kmajor`) and the
grouped GEMM over each group's tokens (`grouped_gemm.grouped_gemm_fp8_wgrad`), against NumPy oracles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe_a2a import grouped_gemm, quant
from jax_moe_a2a.testing import calc_diff

# Two E4M3 roundings (dy and x, each about 6.5e-4 of calc_diff alone) in a product that sums many of them.
END_TO_END_CALC_DIFF = 2e-3

# (M, sizes): empty groups, sizes not multiples of 128, sum below M, sum above M (clamped), a negative size.
SIZE_CASES = [
    (300, (130, 0, 1, 66)),
    (256, (0, 0, 0)),
    (300, (5, 7, 300, 9)),
    (384, (128, 256)),
    (200, (-3, 150, 40)),
    (0, (4, 0)),
]


def _bits(a):
  a = np.asarray(a)
  return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(np.uint32)


def _clamped(sizes, m):
  """(start, size) per group, clamped as grouped_gemm's contiguous layout (NumPy)."""
  out, start = [], 0
  for s in sizes:
    s = min(max(int(s), 0), m - start)
    out.append((start, s))
    start += s
  return out


def _rows(rng, m, c, dtype, non_finite=False):
  span = 8 if dtype == jnp.float16 else 20  # float16 overflows past 65504
  x = rng.standard_normal((m, c)).astype(np.float32)
  x *= np.exp2(rng.integers(-span, span, size=(m, 1)))  # rows over many binades: scales differ per block
  if non_finite and m > 40:
    x[3, 5] = np.nan
    x[40, c - 1] = np.inf
    x[m - 1, 0] = -np.inf
  return jnp.asarray(x, dtype)


def _oracle_quantize(x, sizes):
  """q_t, sf_t assembled from `quantize_fp8_blockwise_reference` of each group's 128-token blocks, transposed."""
  m, c = x.shape
  p = quant.grouped_kmajor_length(m, len(sizes))
  q_t = np.zeros((c, p), np.uint8)
  sf_t = np.full((p // 128, c), 2.0**-48, np.float32)
  xf = np.asarray(jnp.asarray(x, jnp.float32))
  off = 0
  for start, size in _clamped(sizes, m):
    for b in range(0, size, 128):
      n = min(128, size - b)
      block = np.zeros((c, 128), np.float32)
      block[:, :n] = xf[start + b:start + b + n].T
      q, sf = quant.quantize_fp8_blockwise_reference(jnp.asarray(block))
      q_t[:, off + b:off + b + n] = _bits(q)[:, :n]
      sf_t[(off + b) // 128] = np.asarray(sf)[:, 0]
    off += -(-size // 128) * 128
  return q_t, sf_t


@pytest.mark.parametrize("m,sizes", SIZE_CASES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_quantize_layout_and_rule(m, sizes, dtype):
  rng = np.random.default_rng(m + len(sizes))
  x = _rows(rng, m, 256, dtype, non_finite=True)
  q_t, sf_t = quant.quantize_fp8_grouped_kmajor(x, jnp.asarray(sizes, jnp.int32), impl="reference")
  p = quant.grouped_kmajor_length(m, len(sizes))
  assert q_t.shape == (256, p) and q_t.dtype == jnp.float8_e4m3fn
  assert sf_t.shape == (p // 128, 256) and sf_t.dtype == jnp.float32
  want_q, want_sf = _oracle_quantize(x, sizes)
  np.testing.assert_array_equal(_bits(q_t), want_q)
  np.testing.assert_array_equal(_bits(sf_t), _bits(want_sf))


def test_quantize_non_finite_block_marks_only_its_rows():
  x = np.ones((200, 128), np.float32)
  x[10, 7] = np.nan  # group 0's first block, column 7
  q_t, sf_t = quant.quantize_fp8_grouped_kmajor(jnp.asarray(x), [100, 100], impl="reference")
  codes = _bits(q_t)
  assert np.all(codes[7, :100] == quant.E4M3_NAN_BITS) and np.all(codes[7, 100:128] == 0)  # padding stays 0
  assert _bits(sf_t)[0, 7] == quant.F32_NAN_BITS
  assert np.isfinite(np.asarray(sf_t)[0, :7]).all() and np.isfinite(np.asarray(sf_t)[1]).all()
  assert not np.any(codes[:7] == quant.E4M3_NAN_BITS) and not np.any(codes[8:] == quant.E4M3_NAN_BITS)


def test_quantize_fp8_input_decodes_then_requantizes():
  rng = np.random.default_rng(1)
  x = _rows(rng, 333, 384, jnp.float32, non_finite=True)
  x_q, x_sf = quant.quantize_fp8_blockwise(x, impl="reference")
  sizes = jnp.asarray([200, 0, 100, 20], jnp.int32)
  got = quant.quantize_fp8_grouped_kmajor(x_q, sizes, x_sf=x_sf, impl="reference")
  want = quant.quantize_fp8_grouped_kmajor(quant.dequantize_fp8_blockwise(x_q, x_sf), sizes, impl="reference")
  for g, w in zip(got, want):
    np.testing.assert_array_equal(_bits(g), _bits(w))


def test_quantize_gather_is_quantizing_the_gathered_rows():
  """rows: sorted row i reads x[rows[i]] (a zero row outside x), the same bits as gathering first; FP8 rows too."""
  rng = np.random.default_rng(3)
  x = _rows(rng, 50, 256, jnp.bfloat16, non_finite=True)
  rows = jnp.asarray(rng.integers(-3, 53, size=300), jnp.int32)  # repeats, negatives and indices past x
  sizes = jnp.asarray([120, 0, 130, 50], jnp.int32)
  gathered = jnp.where(((rows >= 0) & (rows < 50))[:, None], x[jnp.clip(rows, 0, 49)], 0)
  got = quant.quantize_fp8_grouped_kmajor(x, sizes, rows=rows, impl="reference")
  want = quant.quantize_fp8_grouped_kmajor(gathered, sizes, impl="reference")
  for g, w in zip(got, want):
    assert g.shape == w.shape
    np.testing.assert_array_equal(_bits(g), _bits(w))
  x_q, x_sf = quant.quantize_fp8_blockwise(x, impl="reference")
  got = quant.quantize_fp8_grouped_kmajor(x_q, sizes, x_sf, rows=rows, impl="reference")
  want = quant.quantize_fp8_grouped_kmajor(jnp.where(((rows >= 0) & (rows < 50))[:, None],
                                                     quant.dequantize_fp8_blockwise(x_q, x_sf)[jnp.clip(rows, 0, 49)],
                                                     0.0), sizes, impl="reference")
  for g, w in zip(got, want):
    np.testing.assert_array_equal(_bits(g), _bits(w))


def test_quantize_lists_and_jit():
  x = _rows(np.random.default_rng(2), 130, 128, jnp.bfloat16)
  a = quant.quantize_fp8_grouped_kmajor(x, [100, 30], impl="reference")
  b = jax.jit(lambda x, s: quant.quantize_fp8_grouped_kmajor(x, s, impl="reference"))(x, jnp.asarray([100, 30],
                                                                                                      jnp.int32))
  for u, v in zip(a, b):
    np.testing.assert_array_equal(_bits(u), _bits(v))


@pytest.mark.parametrize("args,err,match", [
    (dict(x=jnp.zeros((4, 128), jnp.int32)), TypeError, "x must be bfloat16, float16 or float32, or float8"),
    (dict(x=jnp.zeros((4, 100), jnp.float32)), ValueError, r"C a positive multiple of 128"),
    (dict(x=jnp.zeros((4, 128, 1), jnp.float32)), ValueError, r"x must be 2-D \[M, C\]"),
    (dict(x=jnp.zeros((4, 128), jnp.float8_e4m3fn)), ValueError, "x_sf must be given"),
    (dict(x=jnp.zeros((4, 128), jnp.float8_e4m3fn), x_sf=jnp.zeros((4, 2), jnp.float32)), ValueError,
     r"x_sf must be \[M, C/128\] = \(4, 1\)"),
    (dict(x=jnp.zeros((4, 128), jnp.float8_e4m3fn), x_sf=jnp.zeros((4, 1), jnp.float16)), TypeError,
     "x_sf must be float32"),
    (dict(x=jnp.zeros((4, 128), jnp.float32), x_sf=jnp.zeros((4, 1), jnp.float32)), ValueError,
     "x_sf must be None"),
    (dict(group_sizes=jnp.zeros((2,), jnp.int64 if jax.config.x64_enabled else jnp.float32)), TypeError,
     "group_sizes must be int32"),
    (dict(group_sizes=jnp.zeros((0,), jnp.int32)), ValueError, r"group_sizes must be \[G\] with 1 <= G"),
    (dict(group_sizes=jnp.zeros((2, 1), jnp.int32)), ValueError, r"group_sizes must be \[G\]"),
    (dict(rows=jnp.zeros((4,), jnp.float32)), TypeError, "rows must be int32, got float32"),
    (dict(rows=jnp.zeros((4, 1), jnp.int32)), ValueError, r"rows must be \[M\] with M < 2\^31, got shape \(4, 1\)"),
    (dict(rows=[0, 1]), TypeError, "rows must be an array, got list"),
])
def test_quantize_refuses_bad_arguments(args, err, match):
  kw = dict(x=jnp.zeros((4, 128), jnp.float32), group_sizes=jnp.asarray([2, 2], jnp.int32))
  kw.update(args)
  with pytest.raises(err, match=match):
    quant.quantize_fp8_grouped_kmajor(kw.pop("x"), kw.pop("group_sizes"), **kw, impl="reference")


# ----------------------------------------------------------------------------------------------------------------
# The GEMM
# ----------------------------------------------------------------------------------------------------------------


def _wgrad_oracle(a_t, a_sf_t, b_t, b_sf_t, sizes, m):
  """float64 per-group products of the dequantized operands over each group's padded columns (NumPy)."""
  a = np.asarray(quant.dequantize_fp8_kmajor_reference(a_t, a_sf_t), np.float64)
  b = np.asarray(quant.dequantize_fp8_kmajor_reference(b_t, b_sf_t), np.float64)
  out = np.zeros((len(sizes), a.shape[0], b.shape[0]))
  off = 0
  for g, (_, size) in enumerate(_clamped(sizes, m)):
    pad = -(-size // 128) * 128
    out[g] = a[:, off:off + pad] @ b[:, off:off + pad].T
    off += pad
  return out


def _wgrad_operands(rng, m, na, nb, sizes, dtype=jnp.bfloat16):
  dy = _rows(rng, m, na, dtype)
  x = _rows(rng, m, nb, dtype)
  s = jnp.asarray(sizes, jnp.int32)
  a_t, a_sf = quant.quantize_fp8_grouped_kmajor(dy, s, impl="reference")
  b_t, b_sf = quant.quantize_fp8_grouped_kmajor(x, s, impl="reference")
  return dy, x, (a_t, a_sf, b_t, b_sf)


@pytest.mark.parametrize("m,sizes", SIZE_CASES)
def test_wgrad_reference_equals_float64_oracle(m, sizes):
  rng = np.random.default_rng(7 + m)
  _, _, ops = _wgrad_operands(rng, m, 128, 256, sizes)
  got = grouped_gemm.grouped_gemm_fp8_wgrad(*ops, jnp.asarray(sizes, jnp.int32), impl="reference")
  assert got.shape == (len(sizes), 128, 256) and got.dtype == jnp.float32
  want = _wgrad_oracle(*ops, sizes, m)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max(initial=1.0))
  for g, (_, size) in enumerate(_clamped(sizes, m)):
    if size == 0:
      np.testing.assert_array_equal(np.asarray(got[g]), 0.0)  # empty groups: exact zeros


def test_wgrad_end_to_end_close_to_float32_weight_gradient():
  rng = np.random.default_rng(11)
  m, sizes = 700, (300, 0, 129, 1, 200)
  dy, x, ops = _wgrad_operands(rng, m, 256, 384, sizes)
  for out_dtype in (jnp.float32, jnp.bfloat16):
    got = grouped_gemm.grouped_gemm_fp8_wgrad(*ops, jnp.asarray(sizes, jnp.int32), out_dtype=out_dtype,
                                              impl="reference")
    assert got.dtype == out_dtype
    dyf, xf = np.asarray(dy, np.float32), np.asarray(x, np.float32)
    for g, (start, size) in enumerate(_clamped(sizes, m)):
      want = dyf[start:start + size].T @ xf[start:start + size]
      if size == 0:
        np.testing.assert_array_equal(np.asarray(got[g], np.float32), 0.0)
      else:
        assert calc_diff(np.asarray(got[g], np.float32), want) < END_TO_END_CALC_DIFF


def test_wgrad_clamped_sizes_give_the_same_result_as_clamping_against_m():
  # sum(sizes) > M with M not a multiple of 128: the quantizer clamps against M, the GEMM against round_up(M, 128).
  rng = np.random.default_rng(5)
  m, sizes = 300, (100, 150, 500, 7)
  _, _, ops = _wgrad_operands(rng, m, 128, 128, sizes)
  got = grouped_gemm.grouped_gemm_fp8_wgrad(*ops, jnp.asarray(sizes, jnp.int32), impl="reference")
  want = _wgrad_oracle(*ops, sizes, m)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
  np.testing.assert_array_equal(np.asarray(got[3]), 0.0)


def test_wgrad_non_finite_value_stays_in_its_group():
  rng = np.random.default_rng(9)
  m, sizes = 400, (100, 200, 100)
  dy = np.array(_rows(rng, m, 128, jnp.float32))
  dy[150, 3] = np.nan  # group 1
  x = _rows(rng, m, 128, jnp.float32)
  s = jnp.asarray(sizes, jnp.int32)
  ops = (*quant.quantize_fp8_grouped_kmajor(jnp.asarray(dy), s, impl="reference"),
         *quant.quantize_fp8_grouped_kmajor(x, s, impl="reference"))
  got = np.asarray(grouped_gemm.grouped_gemm_fp8_wgrad(*ops, s, impl="reference"))
  assert np.isfinite(got[0]).all() and np.isfinite(got[2]).all()
  assert np.isnan(got[1, 3]).all() and np.isfinite(np.delete(got[1], 3, axis=0)).all()


def _good_wgrad_args():
  a_t = jnp.zeros((128, 512), jnp.float8_e4m3fn)
  b_t = jnp.zeros((256, 512), jnp.float8_e4m3fn)
  return dict(a_t=a_t, a_sf_t=jnp.ones((4, 128), jnp.float32), b_t=b_t, b_sf_t=jnp.ones((4, 256), jnp.float32),
              group_sizes=jnp.asarray([1, 2], jnp.int32))


@pytest.mark.parametrize("change,err,match", [
    (dict(a_t=jnp.zeros((128, 512), jnp.bfloat16)), TypeError, "a_t must be float8_e4m3fn, got bfloat16"),
    (dict(b_sf_t=jnp.ones((4, 256), jnp.bfloat16)), TypeError, "b_sf_t must be float32, got bfloat16"),
    (dict(a_sf_t=None), TypeError, "a_sf_t must be a float32 array"),
    (dict(group_sizes=jnp.asarray([1.0, 2.0])), TypeError, "group_sizes must be an int32 array"),
    (dict(a_t=jnp.zeros((100, 512), jnp.float8_e4m3fn)), ValueError, r"a_t must be \[N, P\] with N a positive"),
    (dict(b_t=jnp.zeros((256, 512, 1), jnp.float8_e4m3fn)), ValueError, r"b_t must be \[N, P\]"),
    (dict(a_t=jnp.zeros((128, 500), jnp.float8_e4m3fn)), ValueError, "P a multiple of 128"),
    (dict(b_t=jnp.zeros((256, 640), jnp.float8_e4m3fn)), ValueError, r"b_t must be \[Nb, P\] with P = 512"),
    (dict(a_sf_t=jnp.ones((5, 128), jnp.float32)), ValueError, r"a_sf_t must be \[P/128, N\] = \(4, 128\)"),
    (dict(b_sf_t=jnp.ones((4, 128), jnp.float32)), ValueError, r"b_sf_t must be \[P/128, N\] = \(4, 256\)"),
    (dict(group_sizes=jnp.asarray([1, 2, 3, 4, 5], jnp.int32)), ValueError, r"P >= 128 \* G = 640"),
    (dict(group_sizes=jnp.zeros((0,), jnp.int32)), ValueError, r"group_sizes must be \[G\] with 1 <= G"),
])
def test_wgrad_refuses_bad_arguments(change, err, match):
  kw = _good_wgrad_args()
  kw.update(change)
  with pytest.raises(err, match=match):
    grouped_gemm.grouped_gemm_fp8_wgrad(*kw.values(), impl="reference")


def test_wgrad_refuses_bad_out_dtype():
  with pytest.raises(ValueError, match="out_dtype must be float32 or bfloat16, got float16"):
    grouped_gemm.grouped_gemm_fp8_wgrad(*_good_wgrad_args().values(), out_dtype=jnp.float16, impl="reference")
