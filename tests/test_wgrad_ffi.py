"""The FP8 weight gradient's custom calls against their references: jax_moe_a2a_quantize_fp8_grouped_kmajor bit for bit,
jax_moe_a2a_grouped_gemm_fp8_wgrad to float32 rounding of the accumulation. On CPU the C++ handlers; on a GPU
(JAX_MOE_A2A_TEST_GPU=1) the CUDA kernels, the GEMM's GPU tests once with each kernel (JAX_MOE_A2A_FP8_GEMM_KERNEL:
CUTLASS's and the one written on wgmma).

GPU tolerance of the GEMM: wgmma accumulates each 128-deep block of FP8 products in reduced precision (about 14
mantissa bits) before the float32 promotion, so the kernel differs from the reference's float32 sums by up to ~1e-4 of
the largest output; the tests allow max |diff| <= 2e-3 * max |want| and calc_diff < 1e-6.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe_a2a import _ffi, grouped_gemm, quant
from jax_moe_a2a.testing import calc_diff, max_rel

pytestmark = pytest.mark.skipif(not _ffi.available(), reason="compiled extension not built")

SIZE_CASES = [
    (300, (130, 0, 1, 66)),
    (256, (0, 0, 0)),
    (300, (5, 7, 300, 9)),
    (384, (128, 256)),
    (200, (-3, 150, 40)),
    (0, (4, 0)),
    (1000, (2**31 - 1, 1, 1)),
]


def _bits(a):
  a = np.asarray(a)
  return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(np.uint32)


def _rows(rng, m, c, dtype, non_finite=False):
  span = 8 if dtype == jnp.float16 else 20
  x = rng.standard_normal((m, c)).astype(np.float32)
  x *= np.exp2(rng.integers(-span, span, size=(m, 1)))
  x[:, :3] = 0.0
  x[:, 1] = -0.0
  if non_finite and m > 40:
    x[3, 5] = np.nan
    x[40, c - 1] = np.inf
    x[m - 1, 0] = -np.inf
  return jnp.asarray(x, dtype)


def _quantize(x, sizes, impl, x_sf=None):
  return jax.jit(lambda x, s, sf: quant.quantize_fp8_grouped_kmajor(x, s, x_sf=sf, impl=impl))(x, sizes, x_sf)


def _assert_quantize_same(x, sizes, x_sf=None):
  got = _quantize(x, sizes, "ffi", x_sf)
  want = _quantize(x, sizes, "reference", x_sf)
  for g, w in zip(got, want):
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_array_equal(_bits(g), _bits(w))


@pytest.mark.parametrize("m,sizes", SIZE_CASES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32, jnp.float8_e4m3fn])
def test_quantize_ffi_equals_reference(m, sizes, dtype):
  rng = np.random.default_rng(m + len(sizes))
  s = jnp.asarray(sizes, jnp.int32)
  if dtype == jnp.float8_e4m3fn:
    x_q, x_sf = quant.quantize_fp8_blockwise(_rows(rng, m, 256, jnp.float32, non_finite=True), impl="reference")
    _assert_quantize_same(x_q, s, x_sf)
  else:
    _assert_quantize_same(_rows(rng, m, 256, dtype, non_finite=True), s)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn])
def test_quantize_gather_ffi_equals_reference(dtype):
  """rows (repeats, negatives, indices past x) read by the custom call as by the reference; the DeepSeek-V3 case of
  8 copies of each of 512 tokens in expert order on a GPU."""
  rng = np.random.default_rng(7)
  cases = [(77, 400, [130, 0, 170, 100], 384)]
  if jax.default_backend() == "gpu":
    cases.append((512, 4096, [128] * 32, 7168))
  for r, m, sizes, c in cases:
    rows = jnp.asarray(rng.integers(-2, r + 2, size=m), jnp.int32)
    s = jnp.asarray(sizes, jnp.int32)
    x = _rows(rng, r, c, jnp.float32 if dtype == jnp.float8_e4m3fn else dtype, non_finite=True)
    x_sf = None
    if dtype == jnp.float8_e4m3fn:
      x, x_sf = quant.quantize_fp8_blockwise(x, impl="reference")
    fn = lambda impl: jax.jit(lambda x, sf, rows, s: quant.quantize_fp8_grouped_kmajor(x, s, x_sf=sf, rows=rows,
                                                                                         impl=impl))
    got, want = fn("ffi")(x, x_sf, rows, s), fn("reference")(x, x_sf, rows, s)
    for g, w in zip(got, want):
      assert g.dtype == w.dtype and g.shape == w.shape
      np.testing.assert_array_equal(_bits(g), _bits(w))


def _gemm(ops, sizes, impl, out_dtype=jnp.float32):
  fn = jax.jit(lambda *a: grouped_gemm.grouped_gemm_fp8_wgrad(*a, out_dtype=out_dtype, impl=impl))
  return np.asarray(fn(*ops, sizes).astype(jnp.float32))


def _operands(rng, m, na, nb, sizes, impl="reference"):
  s = jnp.asarray(sizes, jnp.int32)
  dy = _rows(rng, m, na, jnp.bfloat16)
  x = _rows(rng, m, nb, jnp.bfloat16)
  return (*quant.quantize_fp8_grouped_kmajor(dy, s, impl=impl), *quant.quantize_fp8_grouped_kmajor(x, s, impl=impl)), s


def _empty_groups(sizes, m):
  out, start = [], 0
  for g, size in enumerate(sizes):
    size = min(max(size, 0), m - start)
    start += size
    if size == 0:
      out.append(g)
  return out


@pytest.mark.parametrize("m,sizes", SIZE_CASES[:6])
def test_wgrad_ffi_close_to_reference(m, sizes):
  rng = np.random.default_rng(3 + m)
  ops, s = _operands(rng, m, 128, 256, sizes)
  want = _gemm(ops, s, "reference")
  got = _gemm(ops, s, "ffi")
  if jax.default_backend() == "gpu":  # wgmma's reduced-precision block sums (module docstring)
    assert max_rel(got, want) <= 2e-3 and calc_diff(got, want) < 1e-6
  else:
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(initial=1.0))
  for g in _empty_groups(sizes, m):
    np.testing.assert_array_equal(got[g], 0.0)
  got_bf16 = _gemm(ops, s, "ffi", jnp.bfloat16)
  np.testing.assert_allclose(got_bf16, want, rtol=1e-2, atol=1e-2 * np.abs(want).max(initial=1.0))


def test_wgrad_ffi_non_finite_stays_in_its_group():
  rng = np.random.default_rng(8)
  dy = np.array(_rows(rng, 400, 128, jnp.float32))
  dy[150, 3] = np.inf
  s = jnp.asarray([100, 200, 100], jnp.int32)
  ops = (*quant.quantize_fp8_grouped_kmajor(jnp.asarray(dy), s, impl="reference"),
         *quant.quantize_fp8_grouped_kmajor(_rows(rng, 400, 128, jnp.float32), s, impl="reference"))
  got = _gemm(ops, s, "ffi")
  assert np.isfinite(got[0]).all() and np.isfinite(got[2]).all()
  assert np.isnan(got[1, 3]).all() and np.isfinite(np.delete(got[1], 3, axis=0)).all()


def test_cpp_handlers_check_shapes_when_reached():
  # Shapes the Python checks would refuse, sent to the handlers directly.
  x = jnp.zeros((4, 128), jnp.float32)
  no_rows = jnp.zeros((0,), jnp.int32)
  out = (jax.ShapeDtypeStruct((128, 384), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((3, 128), jnp.float32),
         jax.ShapeDtypeStruct((3, 2), jnp.int32))
  with pytest.raises(Exception, match=r"quantize_fp8_grouped_kmajor: q_t must be \[C, P\] = \[128, 256\]"):
    jax.block_until_ready(_ffi.ffi_call("quantize_fp8_grouped_kmajor", out, x, jnp.zeros((0,), jnp.float32),
                                        no_rows, jnp.asarray([4], jnp.int32)))
  with pytest.raises(Exception, match=r"quantize_fp8_grouped_kmajor: x_sf must be \[0\]"):
    jax.block_until_ready(_ffi.ffi_call("quantize_fp8_grouped_kmajor", out, x, jnp.zeros((4, 1), jnp.float32),
                                        no_rows, jnp.asarray([1, 3], jnp.int32)))
  with pytest.raises(Exception, match=r"quantize_fp8_grouped_kmajor: rows must be \[M\] with M < 2\^31, or \[0\], "
                                      r"got \[2, 2\]"):
    jax.block_until_ready(_ffi.ffi_call("quantize_fp8_grouped_kmajor", out, x, jnp.zeros((0,), jnp.float32),
                                        jnp.zeros((2, 2), jnp.int32), jnp.asarray([4], jnp.int32)))
  gathered = (jax.ShapeDtypeStruct((128, 384), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((3, 128), jnp.float32),
              jax.ShapeDtypeStruct((3, 2), jnp.int32))  # 200 gathered rows in 2 groups: P = 256 + 256
  with pytest.raises(Exception, match=r"quantize_fp8_grouped_kmajor: q_t must be \[C, P\] = \[128, 512\]"):
    jax.block_until_ready(_ffi.ffi_call("quantize_fp8_grouped_kmajor", gathered, x, jnp.zeros((0,), jnp.float32),
                                        jnp.zeros((200,), jnp.int32), jnp.asarray([100, 100], jnp.int32)))
  a = jnp.zeros((128, 256), jnp.float8_e4m3fn)
  out = (jax.ShapeDtypeStruct((1, 128, 128), jnp.float32), jax.ShapeDtypeStruct((0,), jnp.uint8))
  with pytest.raises(Exception, match=r"grouped_gemm_fp8_wgrad: b_t must be \[Nb, P\] with P = 256"):
    jax.block_until_ready(_ffi.ffi_call("grouped_gemm_fp8_wgrad", out, a, jnp.ones((2, 128), jnp.float32),
                                        jnp.zeros((128, 384), jnp.float8_e4m3fn), jnp.ones((3, 128), jnp.float32),
                                        jnp.asarray([1], jnp.int32)))
  with pytest.raises(Exception, match=r"grouped_gemm_fp8_wgrad: a_t must be \[Na, P\] with P a multiple of 128 and "
                                      r"P >= 128 \* G = 384"):
    jax.block_until_ready(_ffi.ffi_call("grouped_gemm_fp8_wgrad", out, a, jnp.ones((2, 128), jnp.float32), a,
                                        jnp.ones((2, 128), jnp.float32), jnp.asarray([1, 1, 1], jnp.int32)))


# ----------------------------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------------------------

# DeepSeek-like: 8 experts of uneven sizes, two empty, most not multiples of 128.
DEEPSEEK_SIZES = (1000, 0, 129, 2048, 1, 0, 700, 255)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn])
def test_gpu_quantize_bit_exact(dtype):
  rng = np.random.default_rng(21)
  m, c = 4500, 7168  # sum of sizes 4133 < M
  s = jnp.asarray(DEEPSEEK_SIZES, jnp.int32)
  if dtype == jnp.float8_e4m3fn:
    x_q, x_sf = quant.quantize_fp8_blockwise(_rows(rng, m, c, jnp.bfloat16, non_finite=True))
    _assert_quantize_same(x_q, s, x_sf)
  else:
    _assert_quantize_same(_rows(rng, m, c, dtype, non_finite=True), s)
  _assert_quantize_same(_rows(rng, 300, 256, jnp.bfloat16), jnp.asarray([5, 7, 300, 9], jnp.int32))  # clamped


@pytest.fixture(params=["cutlass", "wgmma"])
def kernel(request, monkeypatch):
  """The CUDA kernel of the weight-gradient GEMM (read by the handler at every call)."""
  monkeypatch.setenv("JAX_MOE_A2A_FP8_GEMM_KERNEL", request.param)
  return request.param


@pytest.mark.gpu
@pytest.mark.parametrize("m,na,nb,sizes", [
    (4500, 7168, 2048, DEEPSEEK_SIZES),
    (4500, 2048, 7168, DEEPSEEK_SIZES),
    (300, 256, 128, (130, 0, 1, 66)),
    (128, 128, 384, (128,)),
    (300, 128, 128, (0, 0, 0)),
])
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_wgrad_close_to_reference(m, na, nb, sizes, out_dtype, kernel):
  rng = np.random.default_rng(m + na)
  ops, s = _operands(rng, m, na, nb, sizes, impl="ffi")
  want = _gemm(ops, s, "reference")
  got = _gemm(ops, s, "ffi", out_dtype)
  scale = np.abs(want).max(initial=0.0)
  if out_dtype == jnp.float32:
    assert max_rel(got, want) <= 2e-3 and calc_diff(got, want) < 1e-6
  else:
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2 * scale)
  for g in _empty_groups(sizes, m):
    np.testing.assert_array_equal(got[g], 0.0)


@pytest.mark.gpu
def test_gpu_wgrad_new_sizes_same_call_site(kernel):
  # One compiled call with other group sizes each time (the kernel's cached parameters do not hold the sizes).
  rng = np.random.default_rng(4)
  m = 1000
  dy, x = _rows(rng, m, 256, jnp.bfloat16), _rows(rng, m, 384, jnp.bfloat16)

  @jax.jit
  def both(dy, x, s):
    ops = (*quant.quantize_fp8_grouped_kmajor(dy, s), *quant.quantize_fp8_grouped_kmajor(x, s))
    return (grouped_gemm.grouped_gemm_fp8_wgrad(*ops, s, impl="ffi"),
            grouped_gemm.grouped_gemm_fp8_wgrad(*ops, s, impl="reference"))

  for sizes in ((500, 0, 500), (0, 1000, 0), (1, 2, 997), (333, 333, 333)):
    got, want = map(np.asarray, both(dy, x, jnp.asarray(sizes, jnp.int32)))
    assert max_rel(got, want) <= 2e-3
    for g in _empty_groups(sizes, m):
      np.testing.assert_array_equal(got[g], 0.0)
