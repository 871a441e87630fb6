"""The FP8 quantization custom calls (1x128 activation groups, 128x128 weight blocks) against their pure-JAX
references: bit for bit, on CPU and on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe_a2a import _ffi, quant

pytestmark = pytest.mark.skipif(not _ffi.available(), reason="compiled extension not built")


def _bits(a):
  a = np.asarray(a)
  return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(np.uint32)


def _wide_range(rng, m, k, dtype):
  """Random rows whose groups span many binades, so scales and E4M3 subnormals are all exercised."""
  span = 10 if dtype == jnp.float16 else 30  # float16 overflows past 65504
  x = rng.standard_normal((m, k)).astype(np.float32)
  x *= np.exp2(rng.integers(-span, span, size=(m, k // 128, 1))).repeat(128, axis=-1).reshape(m, k)
  x[:, :7] = 0.0  # a few exact zeros and a negative zero
  x[:, 3] = -0.0
  return jnp.asarray(x, dtype)


def _assert_same(x, block_major_k):
  q_ffi, sf_ffi = jax.jit(lambda x: quant.quantize_fp8_blockwise(x, block_major_k=block_major_k, impl="ffi"))(x)
  q_ref, sf_ref = jax.jit(
      lambda x: quant.quantize_fp8_blockwise(x, block_major_k=block_major_k, impl="reference"))(x)
  assert q_ffi.dtype == jnp.float8_e4m3fn and sf_ffi.dtype == jnp.float32
  assert q_ffi.shape == q_ref.shape and sf_ffi.shape == sf_ref.shape
  np.testing.assert_array_equal(_bits(q_ffi), _bits(q_ref))
  np.testing.assert_array_equal(_bits(sf_ffi), _bits(sf_ref))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("block_major_k", [False, True])
@pytest.mark.parametrize("m,k", [(1, 128), (37, 384), (256, 1024)])
def test_ffi_equals_reference(dtype, block_major_k, m, k):
  rng = np.random.default_rng(m * 7 + k)
  _assert_same(_wide_range(rng, m, k, dtype), block_major_k)


@pytest.mark.parametrize("block_major_k", [False, True])
def test_ffi_non_finite_groups(block_major_k):
  x = np.random.default_rng(1).standard_normal((3, 512)).astype(np.float32)
  x[0, 5] = np.nan
  x[1, 130] = np.inf
  x[2, 511] = -np.inf
  _assert_same(jnp.asarray(x, jnp.bfloat16), block_major_k)
  q, sf = quant.quantize_fp8_blockwise(jnp.asarray(x, jnp.bfloat16), impl="ffi")
  assert np.isnan(np.asarray(sf)[[0, 1, 2], [0, 1, 3]]).all()
  assert np.isfinite(np.asarray(sf)[0, 1:]).all()


def test_ffi_empty_rows():
  q, sf = quant.quantize_fp8_blockwise(jnp.zeros((0, 256), jnp.bfloat16), block_major_k=True, impl="ffi")
  assert q.shape == (0, 256) and sf.shape == (2, 0)


def test_ffi_under_shard_map():
  """Each device quantizes its own rows; the custom call runs on every simulated device."""
  mesh = jax.make_mesh((len(jax.devices()),), ("x",))
  m = 8 * len(jax.devices())
  x = _wide_range(np.random.default_rng(2), m, 256, jnp.bfloat16)
  spec = jax.sharding.PartitionSpec("x")
  x = jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
  f = jax.shard_map(lambda x: quant.quantize_fp8_blockwise(x, impl="ffi"), mesh=mesh, in_specs=spec,
                    out_specs=(spec, spec))
  q, sf = jax.jit(f)(x)
  q_ref, sf_ref = quant.quantize_fp8_blockwise(x, impl="reference")
  np.testing.assert_array_equal(_bits(q), _bits(q_ref))
  np.testing.assert_array_equal(_bits(sf), _bits(sf_ref))


def test_ffi_rejects_bad_input_before_the_call():
  with pytest.raises(ValueError, match="K % 128"):
    quant.quantize_fp8_blockwise(jnp.zeros((4, 100), jnp.bfloat16), impl="ffi")
  with pytest.raises(TypeError, match="int32"):
    quant.quantize_fp8_blockwise(jnp.zeros((4, 128), jnp.int32), impl="ffi")


def test_cpp_handler_checks_shapes_when_reached():
  """Called directly with a scale shape that does not match, the handler itself returns a clear error."""
  x = jnp.zeros((4, 256), jnp.bfloat16)
  bad = (jax.ShapeDtypeStruct((4, 256), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((4, 3), jnp.float32))
  with pytest.raises(Exception, match=r"x_sf must be \[M, K/128\] = \[4, 2\], got \[4, 3\]"):
    jax.block_until_ready(_ffi.ffi_call("quantize_fp8_blockwise", bad, x, block_major_k=False, swiglu=False))
  bad_dtype = (jax.ShapeDtypeStruct((4, 256), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((4, 2), jnp.float32))
  with pytest.raises(Exception, match="x must be bfloat16, float16 or float32, got int32"):
    jax.block_until_ready(_ffi.ffi_call("quantize_fp8_blockwise", bad_dtype, jnp.zeros((4, 256), jnp.int32),
                                        block_major_k=False, swiglu=False))


@pytest.mark.gpu
@pytest.mark.parametrize("block_major_k", [False, True])
def test_gpu_large_bit_exact(block_major_k):
  """On a GPU: DeepSeek-V3 hidden size, many rows, the CUDA kernel against the reference compiled by XLA for the GPU."""
  assert jax.default_backend() == "gpu"
  x = _wide_range(np.random.default_rng(3), 4099, 7168, jnp.bfloat16)
  _assert_same(x, block_major_k)


# ----------------------------------------------------------------------------------------------------------------
# SwiGLU fused with 1x128 quantization
# ----------------------------------------------------------------------------------------------------------------


def _assert_swiglu_close(h, codes_equal=0.999):
  """The custom call against the reference. Both compute (g * (1 / (1 + exp(-g)))) * u in float32 with the backend's exp
  (not bit-exact across backends), so a code may move one E4M3 step where a value sits on a rounding boundary, and
  a scale by 2x where a group's amax sits on a power of two. Tolerances: every dequantized value within one E4M3
  step of the reference's (2^-3 relative, plus half the subnormal spacing of the larger scale), at least `codes_equal`
  of the codes and 99% of the scales identical, and NaN groups identical."""
  q_ffi, sf_ffi = jax.jit(lambda h: quant.swiglu_quantize_fp8_blockwise(h, impl="ffi"))(h)
  q_ref, sf_ref = jax.jit(lambda h: quant.swiglu_quantize_fp8_blockwise(h, impl="reference"))(h)
  m, f = h.shape[0], h.shape[1] // 2
  assert q_ffi.dtype == jnp.float8_e4m3fn and q_ffi.shape == (m, f) and sf_ffi.shape == (m, f // 128)
  if m == 0:
    return
  a = np.asarray(quant.dequantize_fp8_blockwise(q_ffi, sf_ffi), np.float64)
  b = np.asarray(quant.dequantize_fp8_blockwise(q_ref, sf_ref), np.float64)
  np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
  ok = ~np.isnan(b)
  scale = np.maximum(np.asarray(sf_ffi), np.asarray(sf_ref)).repeat(128, axis=1)
  assert np.all(np.abs(a - b)[ok] <= (2.0 ** -3 * np.maximum(np.abs(a), np.abs(b)) + scale * 2.0 ** -9)[ok])
  assert np.mean(_bits(q_ffi) == _bits(q_ref)) >= codes_equal
  assert np.mean(_bits(sf_ffi) == _bits(sf_ref)) >= 0.99


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("m,f", [(0, 128), (1, 128), (37, 256), (130, 512)])
def test_swiglu_quantize_ffi_close_to_reference(dtype, m, f):
  rng = np.random.default_rng(m + f)
  h = _wide_range(rng, m, 2 * f, dtype) if m else jnp.zeros((0, 2 * f), dtype)
  if m:  # gates of moderate size, so silu is far from both of its asymptotes somewhere in every group
    h = h.at[:, :f].set((rng.standard_normal((m, f)) * 3).astype(np.float32).astype(dtype))
  _assert_swiglu_close(h)


def test_swiglu_quantize_non_finite_groups_stay_in_their_group():
  h = np.random.default_rng(5).standard_normal((4, 512)).astype(np.float32)
  h[1, 3] = np.nan  # gate of group 0, row 1
  h[2, 256 + 130] = np.inf  # up of group 1, row 2
  q, sf = quant.swiglu_quantize_fp8_blockwise(jnp.asarray(h), impl="ffi")
  sf = np.asarray(sf)
  assert np.isnan(sf[1, 0]) and np.isnan(sf[2, 1])
  assert np.isfinite(np.delete(sf.ravel(), [1 * 2 + 0, 2 * 2 + 1])).all()
  _assert_swiglu_close(jnp.asarray(h))


def test_swiglu_quantize_equals_quantizing_the_reference_swiglu():
  """The reference is quantize_fp8_blockwise of swiglu_reference, bit for bit (the rule is the quantizer's)."""
  h = jax.random.normal(jax.random.key(0), (64, 512), jnp.bfloat16)
  q, sf = quant.swiglu_quantize_fp8_blockwise(h, impl="reference")
  q2, sf2 = quant.quantize_fp8_blockwise(quant.swiglu_reference(h), impl="reference")
  np.testing.assert_array_equal(_bits(q), _bits(q2))
  np.testing.assert_array_equal(_bits(sf), _bits(sf2))


@pytest.mark.parametrize("shape,dtype,err,match", [
    ((4, 128), jnp.bfloat16, ValueError,
     r"h must be \[M, 2F\] with F a positive multiple of 128, got shape \(4, 128\)"),
    ((4, 0), jnp.bfloat16, ValueError, r"h must be .*F a positive multiple of 128, got shape \(4, 0\)"),
    ((4, 256, 1), jnp.bfloat16, ValueError, r"h must be 2-D"),
    ((4, 256), jnp.int32, TypeError, r"h must be .*got int32"),
])
def test_swiglu_quantize_refuses_bad_inputs(shape, dtype, err, match):
  with pytest.raises(err, match="swiglu_quantize_fp8_blockwise: " + match):
    quant.swiglu_quantize_fp8_blockwise(jnp.zeros(shape, dtype), impl="ffi")


def test_cpp_handler_checks_swiglu_shapes_when_reached():
  h = jnp.zeros((4, 384), jnp.bfloat16)  # 2F = 384: F = 192 is not a multiple of 128
  out = (jax.ShapeDtypeStruct((4, 192), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((4, 1), jnp.float32))
  with pytest.raises(Exception, match=r"x must be \[M, 2K\] with K % 128 == 0 \(swiglu\), got \[4, 384\]"):
    jax.block_until_ready(_ffi.ffi_call("quantize_fp8_blockwise", out, h, block_major_k=False, swiglu=True))
  out = (jax.ShapeDtypeStruct((4, 128), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((1, 4), jnp.float32))
  with pytest.raises(Exception, match=r"block_major_k with swiglu must be false, got true"):
    jax.block_until_ready(_ffi.ffi_call("quantize_fp8_blockwise", out, jnp.zeros((4, 256), jnp.bfloat16),
                                        block_major_k=True, swiglu=True))


@pytest.mark.gpu
def test_gpu_swiglu_quantize_close_to_reference():
  """On a GPU, at the expert MLP's shape (F = 2048), bf16 gate/up rows."""
  assert jax.default_backend() == "gpu"
  rng = np.random.default_rng(6)
  h = jnp.asarray((rng.standard_normal((4099, 4096)) * 2).astype(np.float32), jnp.bfloat16)
  _assert_swiglu_close(h)


# ----------------------------------------------------------------------------------------------------------------
# 128x128 weight blocks
# ----------------------------------------------------------------------------------------------------------------


def _weights(rng, shape, dtype):
  """Random weights whose 128x128 blocks span many binades (and hold zeros), so every scale is exercised."""
  *batch, n, k = shape
  span = 10 if dtype == jnp.float16 else 30
  w = rng.standard_normal(shape).astype(np.float32)
  nb, kb = -(-n // 128), -(-k // 128)
  e = np.exp2(rng.integers(-span, span, size=(*batch, nb, 1, kb, 1))).astype(np.float32)
  w *= np.broadcast_to(e, (*batch, nb, 128, kb, 128)).reshape(*batch, nb * 128, kb * 128)[..., :n, :k]
  w[..., :3, :5] = 0.0
  return jnp.asarray(w, dtype)


def _assert_same_weight(w):
  q_ffi, sf_ffi = jax.jit(lambda w: quant.quantize_fp8_weight(w, impl="ffi"))(w)
  q_ref, sf_ref = jax.jit(lambda w: quant.quantize_fp8_weight(w, impl="reference"))(w)
  assert q_ffi.dtype == jnp.float8_e4m3fn and q_ffi.shape == q_ref.shape and sf_ffi.shape == sf_ref.shape
  np.testing.assert_array_equal(_bits(q_ffi), _bits(q_ref))
  np.testing.assert_array_equal(_bits(sf_ffi), _bits(sf_ref))
  if w.shape[-2] % 16 and jax.default_backend() == "gpu":
    return  # the kernel's transposed rows are written 16 bytes at a time
  both = jax.jit(lambda w: quant.quantize_fp8_weight_with_transpose(w, impl="ffi"))(w)
  both_ref = jax.jit(lambda w: quant.quantize_fp8_weight_with_transpose(w, impl="reference"))(w)
  for got, want in zip(both, (q_ref, sf_ref, jnp.swapaxes(q_ref, -1, -2), jnp.swapaxes(sf_ref, -1, -2))):
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(_bits(got), _bits(want))
  for got, want in zip(both_ref, both):
    np.testing.assert_array_equal(_bits(got), _bits(want))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("shape", [(128, 128), (3, 256, 384), (2, 200, 136), (1, 5, 16), (2, 2, 129, 264),
                                   (2, 144, 264)])
def test_weight_ffi_equals_reference(dtype, shape):
  """Edge blocks (N or K not a multiple of 128) take the values that exist, as the reference's zero padding does;
  (2, 144, 264) has edge blocks along both that the GPU kernel also writes transposed (N a multiple of 16)."""
  _assert_same_weight(_weights(np.random.default_rng(sum(shape)), shape, dtype))


def test_weight_ffi_non_finite_and_top_scale_blocks():
  w = np.random.default_rng(4).standard_normal((2, 256, 256)).astype(np.float32)
  w[0, 5, 200] = np.nan  # block (0, 0, 1)
  w[1, 130, 3] = -np.inf  # block (1, 1, 0)
  w[1, :128, 128:] *= 3.3e38 / np.abs(w[1, :128, 128:]).max()  # block (1, 0, 1): the top scale, 2^120
  _assert_same_weight(jnp.asarray(w))
  q, sf = quant.quantize_fp8_weight(jnp.asarray(w), impl="ffi")
  sf = np.asarray(sf)
  assert np.isnan(sf[0, 0, 1]) and np.isnan(sf[1, 1, 0]) and np.isfinite(sf[0, 0, 0])
  assert sf[1, 0, 1] == np.float32(2.0 ** 120)
  back = np.asarray(quant.dequantize_fp8_weight(q, jnp.asarray(sf)))
  assert np.isfinite(back[1, :128, 128:]).all()


def test_weight_cpp_handler_checks_shapes_when_reached():
  w = jnp.zeros((2, 256, 384), jnp.bfloat16)
  bad = (jax.ShapeDtypeStruct((2, 256, 384), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((2, 2, 2), jnp.float32))
  with pytest.raises(Exception, match=r"w_sf must be \[\.\.\., ceil\(N/128\), ceil\(K/128\)\] = \[\.\.\., 2, 3\], "
                                      r"got \[2, 2, 2\]"):
    jax.block_until_ready(_ffi.ffi_call("quantize_fp8_weight", bad, w))


def test_weight_with_transpose_cpp_handler_checks_shapes_when_reached():
  w = jnp.zeros((2, 256, 384), jnp.bfloat16)
  bad = (jax.ShapeDtypeStruct((2, 256, 384), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((2, 2, 3), jnp.float32),
         jax.ShapeDtypeStruct((2, 256, 384), jnp.float8_e4m3fn))
  with pytest.raises(Exception, match=r"w_q_t must be \[\.\.\., K, N\] = \[2, 384, 256\], got \[2, 256, 384\]"):
    jax.block_until_ready(_ffi.ffi_call("quantize_fp8_weight_with_transpose", bad, w))


def test_weight_with_transpose_refuses_what_quantize_fp8_weight_refuses():
  with pytest.raises(TypeError, match="quantize_fp8_weight_with_transpose: w must be"):
    quant.quantize_fp8_weight_with_transpose(jnp.zeros((128, 128), jnp.int8))
  with pytest.raises(ValueError, match=r"quantize_fp8_weight_with_transpose: w must be \[\.\.\., N, K\]"):
    quant.quantize_fp8_weight_with_transpose(jnp.zeros((128,), jnp.bfloat16))


@pytest.mark.gpu
def test_gpu_weight_deepseek_shapes_bit_exact():
  """On a GPU: gate/up and down weights of eight DeepSeek-V3 experts, kernel against the reference compiled by XLA."""
  assert jax.default_backend() == "gpu"
  rng = np.random.default_rng(5)
  for shape in ((8, 4096, 7168), (8, 7168, 2048)):
    _assert_same_weight(_weights(rng, shape, jnp.bfloat16))
