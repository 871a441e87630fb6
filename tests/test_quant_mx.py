"""The MXFP8 and NVFP4 custom calls (quantize, dequantize, the NVFP4 global scale) against their pure-JAX
references: bit for bit, on CPU (the handlers reproduce the references as XLA runs them there) and on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe_a2a import _ffi, quant, quant_mx

pytestmark = pytest.mark.skipif(not _ffi.available(), reason="compiled extension not built")

F32 = np.float32
_ON_GPU = jax.default_backend() == "gpu"


def _bits(a):
  a = np.asarray(a)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _assert_bits_equal(got, want):
  got, want = jax.tree.leaves(got), jax.tree.leaves(want)
  assert len(got) == len(want)
  for g, w in zip(got, want):
    assert g.dtype == w.dtype and g.shape == w.shape
    gb, wb = np.atleast_1d(_bits(g)), np.atleast_1d(_bits(w))
    bad = np.nonzero(gb != wb)
    assert not bad[0].size, (f"{bad[0].size} of {gb.size} differ, first at {tuple(i[0] for i in bad)}: "
                             f"{gb[bad][:4]} != {wb[bad][:4]}")


def _wide(rng, m, k, dtype, block):
  """Random rows whose blocks span many binades, so every scale and the E4M3/E2M1 subnormal codes occur."""
  span = 10 if dtype == jnp.float16 else 30  # float16 overflows past 65504
  x = rng.standard_normal((m, k)).astype(F32)
  blocks = -(-k // block)
  e = np.exp2(rng.integers(-span, span, size=(m, blocks, 1))).astype(F32)
  return x * np.broadcast_to(e, (m, blocks, block)).reshape(m, blocks * block)[:, :k]


def _edge_rows(k, dtype, block):
  """Rows of edge cases, one case per block where it matters: zeros and -0, NaN and +-inf (each in its own
  block), the largest values of `dtype`, values at E4M3 and E2M1 rounding ties, a block far below its row, and,
  off GPUs, float32 subnormals (flushed on CPUs, by the handler as by XLA), and tiny values beside normal ones."""
  top = float(jnp.finfo(dtype).max)
  rows = np.zeros((10, k), F32)
  rows[0, 1::2] = -0.0
  rows[1, :] = 1.0
  rows[1, 3] = np.nan
  rows[1, min(block + 5, k - 1)] = np.inf
  rows[1, k - 1] = -np.inf
  rows[2, :] = np.linspace(-top, top, k)
  rows[2, :block] = top
  rows[3, :] = -top
  # E4M3 ties: with amax 448 (scale 1) the midpoints between neighbouring codes, e.g. 1.0625 between 1 and 1.125.
  rows[4, :] = 448.0
  rows[4, 1::2] = np.resize(np.array([1.0625, 1.1875, 3.25, 0.0029296875, -2.125, 104.0], F32), (k // 2,))
  # E2M1 ties with a global scale of 1 and block amax 6 (block scale 1): the midpoints of the grid.
  rows[5, :] = np.resize(np.array([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -6.0, -0.25, -0.75, -1.25, -1.75,
                                   -2.5, -3.5, -5.0], F32), (k,))
  rows[6, :] = 1e4
  rows[6, :block] = 1e-6  # far below the rest: tiny block scale (NVFP4: below E4M3's range, all +0)
  rows[7, :] = np.resize(np.array([0.5, -3.0, 7.0, 448.0, 449.0, 1e-3], F32), (k,))
  if not _ON_GPU:
    rows[8, :] = np.resize(np.array([1e-40, -3e-39, 2.0 ** -126, 0.0], F32), (k,))
  # Values below 2^-100 beside a block amax of 1 (the GPU kernel's quotient of these is inexact, its code must still
  # be the reference's signed zero).
  rows[9, :] = np.resize(np.array([1.0, 1e-35, -1e-36, 3e-38, -1e-30, 0.0, -0.0, 2.0 ** -100], F32), (k,))
  return rows


def _inputs(m, k, dtype, block, seed):
  rng = np.random.default_rng(seed)
  x = _wide(rng, m, k, dtype, block)
  if m >= 10:
    x[:10] = _edge_rows(k, dtype, block)
  return jnp.asarray(x, dtype)


# ----------------------------------------------------------------------------------------------------------------
# MXFP8
# ----------------------------------------------------------------------------------------------------------------


def _mx_both(x, mx_alignment):
  f = lambda impl: jax.jit(lambda x: quant_mx.quantize_mxfp8(x, mx_alignment=mx_alignment, impl=impl))(x)
  got, want = f("ffi"), f("reference")
  assert got[0].dtype == jnp.float8_e4m3fn and got[1].dtype == jnp.float8_e8m0fnu
  _assert_bits_equal(got, want)
  return got


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("m,k,mx_alignment", [(1, 32, None), (37, 256, None), (37, 256, 128), (12, 100, 128),
                                              (11, 96, 256), (0, 64, None), (10, 7000, 128)])
def test_mxfp8_ffi_equals_reference(dtype, m, k, mx_alignment):
  """Random and edge-case rows; K padded to the alignment (whole padding blocks, and a block cut at K)."""
  q, sf = _mx_both(_inputs(m, k, dtype, 32, m * 31 + k), mx_alignment)
  if m >= 10:
    sfb = _bits(sf)
    assert sfb[1, 0] == 0xFF and sfb[0, 0] == 0x00  # a NaN block; an all-zero block's scale 2^-127
    if mx_alignment and mx_alignment > 32 and sf.shape[1] * 32 > -(-k // 32) * 32:
      assert np.all(sfb[:, -(-k // 32):] == 0)  # padding-only blocks


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e5m2])
@pytest.mark.parametrize("k,mx_alignment", [(256, None), (100, 128), (24, 64)])
def test_mxfp8_dequantize_ffi_equals_reference_on_every_byte(dtype, k, mx_alignment):
  """Every E4M3 code (NaN 0x7F and 0xFF included) against every E8M0 byte (2^-127, a float32 subnormal, and the
  NaN 0xFF included); float8_e5m2 is the float32 result cast, as the reference casts."""
  rng = np.random.default_rng(k)
  cols = -(-k // (mx_alignment or 32)) * (mx_alignment or 32) // 32
  q = rng.integers(0, 256, (64, k), dtype=np.uint8)
  q[:2, :] = np.resize(np.arange(256, dtype=np.uint8), (2, k))
  sf = rng.integers(0, 256, (64, cols), dtype=np.uint8)
  sf[:3, 0] = (0x00, 0xFF, 0xFE)
  q, sf = jnp.asarray(q).view(jnp.float8_e4m3fn), jnp.asarray(sf).view(jnp.float8_e8m0fnu)
  f = lambda impl: jax.jit(lambda q, sf: quant_mx.dequantize_mxfp8(q, sf, mx_alignment=mx_alignment, dtype=dtype,
                                                                   impl=impl))(q, sf)
  got = f("ffi")
  assert got.dtype == dtype and got.shape == (64, k)
  _assert_bits_equal(got, f("reference"))


def test_mxfp8_round_trip_through_the_custom_calls():
  x = _inputs(64, 512, jnp.bfloat16, 32, 3)
  q, sf = quant_mx.quantize_mxfp8(x, impl="ffi")
  _assert_bits_equal(quant_mx.dequantize_mxfp8(q, sf, dtype=jnp.bfloat16, impl="ffi"),
                     quant_mx.dequantize_mxfp8(q, sf, dtype=jnp.bfloat16, impl="reference"))


# ----------------------------------------------------------------------------------------------------------------
# NVFP4
# ----------------------------------------------------------------------------------------------------------------


def _nv_both(x, global_scale):
  """Both implementations under jit, the global scale (when given) traced, as the layer passes it."""
  if global_scale is None:
    f = lambda impl: jax.jit(lambda x: quant_mx.quantize_nvfp4(x, impl=impl))(x)
  else:
    f = lambda impl: jax.jit(lambda x, g: quant_mx.quantize_nvfp4(x, global_scale=g, impl=impl))(
        x, jnp.float32(global_scale))
  got, want = f("ffi"), f("reference")
  assert got[0].dtype == jnp.uint8 and got[1].dtype == jnp.float8_e4m3fn and got[2].dtype == jnp.float32
  _assert_bits_equal(got, want)
  return got


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("m,k", [(1, 16), (37, 256), (12, 48), (0, 32), (10, 7168)])
@pytest.mark.parametrize("global_scale", [None, 1.0, 1e-3, 3e30])
def test_nvfp4_ffi_equals_reference(dtype, m, k, global_scale):
  """Random and edge-case rows (ties of the E2M1 grid at global scale 1), with the derived scale and given ones
  (3e30: every block's scale far below E4M3's range)."""
  q, sf, gs = _nv_both(_inputs(m, k, dtype, 16, m * 17 + k), global_scale)
  if m >= 10:
    assert _bits(sf)[1, 0] == 0x7F and np.all(np.asarray(q)[1, :8] == 0)  # a NaN block: NaN scale, +0 codes


def test_nvfp4_ties_round_to_the_even_code_in_the_custom_call():
  """At global scale 1 and block amax 6 (block scale 1) the grid's midpoints go to the even neighbour."""
  row = np.array([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 2, F32)
  q, sf, _ = quant_mx.quantize_nvfp4(jnp.asarray(row[None]), global_scale=1.0, impl="ffi")
  codes = np.stack([np.asarray(q)[0] & 0xF, np.asarray(q)[0] >> 4], axis=-1).ravel()
  # 0.25 -> 0 (code 0), 0.75 -> 1.0 (2), 1.25 -> 1.0 (2), 1.75 -> 2.0 (4), 2.5 -> 2.0 (4), 3.5 -> 4.0 (6), 5 -> 4 (6)
  np.testing.assert_array_equal(codes, [7, 0, 2, 2, 4, 4, 6, 6] * 2)
  assert _bits(sf)[0, 0] == 0x38  # E4M3 1.0


@pytest.mark.parametrize("global_scale", [0.0, -0.0, -1.0, np.nan, np.inf, -np.inf, 1e-39])
def test_nvfp4_ffi_equals_reference_with_a_bad_traced_global_scale(global_scale):
  """A traced scale cannot be refused; both give the same fixed bits (zero/negative: +0 codes; NaN, inf: +0 block
  scales; a subnormal scale is zero on CPUs)."""
  x = _inputs(12, 64, jnp.float32, 16, 5)
  _nv_both(x, global_scale)
  q, sf, gs = jax.jit(lambda x, g: quant_mx.quantize_nvfp4(x, global_scale=g, impl="ffi"))(x, jnp.float32(global_scale))
  back = np.asarray(quant_mx.dequantize_nvfp4(q, sf, gs, impl="ffi"))
  if not np.isfinite(global_scale):
    assert np.all(np.isnan(back))
  elif global_scale <= 0:
    assert np.all(np.asarray(q) == 0) and np.all(np.nan_to_num(back, nan=0.0) == 0)


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_nvfp4_ffi_refuses_a_concrete_bad_global_scale_as_the_reference_does(value):
  with pytest.raises(ValueError, match=r"quantize_nvfp4: global_scale must be positive and finite"):
    quant_mx.quantize_nvfp4(jnp.ones((2, 32)), global_scale=value, impl="ffi")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e5m2])
@pytest.mark.parametrize("global_scale", [1.0, 2.0 ** -20, 3e35, 1e-39, np.nan, -2.5, 0.0])
def test_nvfp4_dequantize_ffi_equals_reference_on_every_byte(dtype, global_scale):
  """Every code byte against E4M3 block scales of every byte (NaN 0x7F and 0xFF included), global scales that
  overflow, underflow, or are not valid at all (a dequantizer takes what it is given)."""
  rng = np.random.default_rng(9)
  q = rng.integers(0, 256, (64, 48), dtype=np.uint8)
  q[0, :] = np.resize(np.arange(256, dtype=np.uint8), 48)
  sf = rng.integers(0, 256, (64, 6), dtype=np.uint8)
  sf[1, :3] = (0x7F, 0xFF, 0x00)
  q, sf = jnp.asarray(q), jnp.asarray(sf).view(jnp.float8_e4m3fn)
  f = lambda impl: jax.jit(lambda q, sf, g: quant_mx.dequantize_nvfp4(q, sf, g, dtype=dtype, impl=impl))(
      q, sf, jnp.float32(global_scale))
  got = f("ffi")
  assert got.dtype == dtype and got.shape == (64, 96)
  _assert_bits_equal(got, f("reference"))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("shape", [(0,), (5,), (3, 7, 11), (64, 256), (1, 1)])
def test_nvfp4_global_scale_ffi_equals_reference(dtype, shape):
  rng = np.random.default_rng(sum(shape))
  x = (rng.standard_normal(shape) * 100).astype(F32)
  if x.size > 3:
    x.flat[1], x.flat[2] = np.nan, -np.inf  # not counted
  x = jnp.asarray(x, dtype)
  _assert_bits_equal(quant_mx.nvfp4_global_scale(x, impl="ffi"), quant_mx.nvfp4_global_scale(x, impl="reference"))


def test_nvfp4_global_scale_of_only_non_finite_or_zero_values_is_the_floor():
  want = quant_mx.nvfp4_global_scale(jnp.zeros((4,)), impl="reference")
  for x in (jnp.zeros((4, 16)), jnp.asarray([[np.nan, np.inf, -np.inf, 0.0]])):
    got = quant_mx.nvfp4_global_scale(x, impl="ffi")
    assert _bits(got) == _bits(want) and float(got) == np.float32(1e-12) / np.float32(2688)


def test_nvfp4_round_trip_through_the_custom_calls():
  x = _inputs(64, 512, jnp.bfloat16, 16, 4)
  q, sf, gs = quant_mx.quantize_nvfp4(x, impl="ffi")
  _assert_bits_equal(quant_mx.dequantize_nvfp4(q, sf, gs, dtype=jnp.bfloat16, impl="ffi"),
                     quant_mx.dequantize_nvfp4(q, sf, gs, dtype=jnp.bfloat16, impl="reference"))


# ----------------------------------------------------------------------------------------------------------------
# impl, jit, shard_map, the format dispatch
# ----------------------------------------------------------------------------------------------------------------


def test_auto_takes_the_custom_calls_where_the_extension_has_handlers():
  x = jnp.ones((4, 64), jnp.bfloat16)
  text = str(jax.make_jaxpr(lambda x: (quant_mx.quantize_mxfp8(x), quant_mx.quantize_nvfp4(x)))(x))
  for target in ("quantize_mxfp8", "nvfp4_global_scale", "quantize_nvfp4"):
    assert ("jax_moe_a2a_" + target in text) == (jax.default_backend() in _ffi.register()), target
  text = str(jax.make_jaxpr(lambda x: quant_mx.quantize_mxfp8(x, impl="reference"))(x))
  assert "jax_moe_a2a_" not in text


@pytest.mark.parametrize("call", [
    lambda: quant_mx.quantize_mxfp8(jnp.ones((2, 32)), impl="fast"),
    lambda: quant_mx.dequantize_mxfp8(jnp.ones((2, 32), jnp.float8_e4m3fn), jnp.ones((2, 1), jnp.float8_e8m0fnu),
                                      impl="fast"),
    lambda: quant_mx.nvfp4_global_scale(jnp.ones((2, 32)), impl="fast"),
    lambda: quant_mx.quantize_nvfp4(jnp.ones((2, 32)), impl="fast"),
    lambda: quant_mx.dequantize_nvfp4(jnp.ones((2, 16), jnp.uint8), jnp.ones((2, 2), jnp.float8_e4m3fn), 1.0,
                                      impl="fast"),
])
def test_a_bad_impl_is_refused_by_name(call):
  with pytest.raises(ValueError, match=r"(quantize|dequantize)_(mxfp8|nvfp4)|nvfp4_global_scale: impl must be one of "
                                       r"auto, ffi, reference, got 'fast'"):
    call()


def test_quant_reexports_the_mx_functions_and_dispatches_to_them():
  assert quant.quantize_mxfp8 is quant_mx.quantize_mxfp8 and quant.dequantize_nvfp4 is quant_mx.dequantize_nvfp4
  with pytest.raises(AttributeError, match="has no attribute 'quantize_fp5'"):
    _ = quant.quantize_fp5
  x = _inputs(16, 256, jnp.bfloat16, 32, 6)
  _assert_bits_equal(quant.quantize(x, "mxfp8")[:2], quant_mx.quantize_mxfp8(x, impl="reference"))
  _assert_bits_equal(quant.quantize(x, "nvfp4"), quant_mx.quantize_nvfp4(x, impl="reference"))


def test_ffi_under_shard_map():
  """Each device quantizes its own rows with its own global scale (the calls run on every simulated device)."""
  if len(jax.devices()) < 2:
    pytest.skip("needs 2 devices: the check is that each derives its own global scale")
  mesh = jax.make_mesh((len(jax.devices()),), ("x",))
  spec = jax.sharding.PartitionSpec("x")
  x = jax.device_put(_inputs(8 * len(jax.devices()), 256, jnp.bfloat16, 16, 7),
                     jax.sharding.NamedSharding(mesh, spec))

  def both(impl):
    def body(x):
      q, sf, gs = quant_mx.quantize_nvfp4(x, impl=impl)
      mq, msf = quant_mx.quantize_mxfp8(x, impl=impl)
      return q, sf, gs[None], mq, msf, quant_mx.dequantize_nvfp4(q, sf, gs, impl=impl)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=(spec,) * 6))(x)

  got = both("ffi")
  assert len(np.unique(_bits(got[2]))) > 1  # the ranks' scales differ: each derived its own
  _assert_bits_equal(got, both("reference"))


# ----------------------------------------------------------------------------------------------------------------
# The handlers' own checks (reached only by a direct call: the Python functions check first)
# ----------------------------------------------------------------------------------------------------------------

_S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("target,out,args,match", [
    ("quantize_mxfp8", (_S((4, 64), jnp.float8_e4m3fn), _S((4, 1), jnp.float8_e8m0fnu)),
     (jnp.zeros((4, 64), jnp.bfloat16),), r"x_sf must be \[M, C\] with M = 4 and C >= ceil\(K/32\) = 2, got \[4, 1\]"),
    ("quantize_mxfp8", (_S((4, 64), jnp.float8_e4m3fn), _S((4, 2), jnp.uint8)),
     (jnp.zeros((4, 64), jnp.bfloat16),), r"x_sf must be float8_e8m0fnu, got uint8"),
    ("quantize_mxfp8", (_S((4, 64), jnp.float8_e4m3fn), _S((4, 2), jnp.float8_e8m0fnu)),
     (jnp.zeros((4, 64), jnp.int32),), r"x must be bfloat16, float16 or float32, got int32"),
    ("quantize_mxfp8", (_S((4, 32), jnp.float8_e4m3fn), _S((4, 2), jnp.float8_e8m0fnu)),
     (jnp.zeros((4, 64), jnp.float32),), r"x_q must be \[M, K\] = \[4, 64\], got \[4, 32\]"),
    ("dequantize_mxfp8", _S((4, 64), jnp.int32),
     (jnp.zeros((4, 64), jnp.float8_e4m3fn), jnp.zeros((4, 2), jnp.float8_e8m0fnu)),
     r"out must be bfloat16, float16 or float32, got int32"),
    ("dequantize_mxfp8", _S((4, 64), jnp.float32),
     (jnp.zeros((4, 64), jnp.float8_e4m3fn), jnp.zeros((4, 2), jnp.float8_e4m3fn)),
     r"x_sf must be float8_e8m0fnu, got float8_e4m3fn"),
    ("nvfp4_global_scale", _S((1,), jnp.float32), (jnp.zeros((4, 64), jnp.float32),),
     r"global_scale must be a float32 scalar \(shape \[\]\), got \[1\]"),
    ("quantize_nvfp4", (_S((4, 32), jnp.uint8), _S((4, 4), jnp.float8_e4m3fn)),
     (jnp.zeros((4, 64), jnp.float32), jnp.ones((1,), jnp.float32)),
     r"global_scale must be a float32 scalar \(shape \[\]\), got \[1\]"),
    ("quantize_nvfp4", (_S((4, 32), jnp.uint8), _S((4, 4), jnp.float8_e4m3fn)),
     (jnp.zeros((4, 40), jnp.float32), jnp.float32(1)), r"x must be \[M, K\] with K % 16 == 0 and K > 0, got \[4, 40\]"),
    ("quantize_nvfp4", (_S((4, 64), jnp.uint8), _S((4, 4), jnp.float8_e4m3fn)),
     (jnp.zeros((4, 64), jnp.float32), jnp.float32(1)), r"x_q must be \[M, K/2\] = \[4, 32\], got \[4, 64\]"),
    ("quantize_nvfp4", (_S((4, 32), jnp.uint8), _S((4, 2), jnp.float8_e4m3fn)),
     (jnp.zeros((4, 64), jnp.float32), jnp.float32(1)), r"x_sf must be \[M, K/16\] = \[4, 4\], got \[4, 2\]"),
    ("dequantize_nvfp4", _S((4, 64), jnp.float32),
     (jnp.zeros((4, 32), jnp.int8), jnp.zeros((4, 4), jnp.float8_e4m3fn), jnp.float32(1)),
     r"x_q must be uint8, got int8"),
    ("dequantize_nvfp4", _S((4, 60), jnp.float32),
     (jnp.zeros((4, 32), jnp.uint8), jnp.zeros((4, 4), jnp.float8_e4m3fn), jnp.float32(1)),
     r"out must be \[M, K\] = \[4, 64\], got \[4, 60\]"),
])
def test_handlers_check_shapes_and_dtypes_when_reached(target, out, args, match):
  with pytest.raises(Exception, match=f"jax_moe_a2a_{target}: " + match):
    jax.block_until_ready(_ffi.ffi_call(target, out, *args))


# ----------------------------------------------------------------------------------------------------------------
# GPU: the CUDA kernels against the references compiled by XLA for the GPU
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_gpu_mxfp8_bit_exact(dtype):
  assert jax.default_backend() == "gpu"
  x = _inputs(4099, 7168, dtype, 32, 11)
  q, sf = _mx_both(x, None)
  for out in (jnp.bfloat16, jnp.float32):
    _assert_bits_equal(quant_mx.dequantize_mxfp8(q, sf, dtype=out, impl="ffi"),
                       quant_mx.dequantize_mxfp8(q, sf, dtype=out, impl="reference"))
  _mx_both(x[:37, :7000], 128)  # the padded shape: the per-block kernel, and padding scales


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("global_scale", [None, 1.0, 1e-30, 3e30])
def test_gpu_nvfp4_bit_exact(dtype, global_scale):
  """1e-30: block scales clipped at 448, quotients far above 6 (the kernel's full division); 3e30: all +0."""
  assert jax.default_backend() == "gpu"
  q, sf, gs = _nv_both(_inputs(4099, 7168, dtype, 16, 12), global_scale)
  for out in (jnp.bfloat16, jnp.float32):
    _assert_bits_equal(quant_mx.dequantize_nvfp4(q, sf, gs, dtype=out, impl="ffi"),
                       quant_mx.dequantize_nvfp4(q, sf, gs, dtype=out, impl="reference"))


@pytest.mark.gpu
def test_gpu_dequantizers_on_every_byte_and_bad_scales():
  assert jax.default_backend() == "gpu"
  test_mxfp8_dequantize_ffi_equals_reference_on_every_byte(jnp.bfloat16, 100, 128)
  for gs in (np.nan, 0.0, 3e35):
    test_nvfp4_dequantize_ffi_equals_reference_on_every_byte(jnp.bfloat16, gs)
  for gs in (0.0, np.nan, np.inf):
    _nv_both(_inputs(12, 64, jnp.float32, 16, 5), gs)


@pytest.mark.gpu
def test_gpu_global_scale_of_a_large_tensor_and_empty_rows():
  assert jax.default_backend() == "gpu"
  x = _inputs(16384, 7168, jnp.bfloat16, 16, 13)
  x = x.at[9000, 5].set(3e38).at[100, 7].set(np.inf)  # the largest finite value sits far from the start
  _assert_bits_equal(quant_mx.nvfp4_global_scale(x, impl="ffi"), quant_mx.nvfp4_global_scale(x, impl="reference"))
  _assert_bits_equal(quant_mx.nvfp4_global_scale(x[:, :7] , impl="ffi"),
                     quant_mx.nvfp4_global_scale(x[:, :7], impl="reference"))  # a tail that is not 16 bytes
  for fn in (lambda impl: quant_mx.quantize_nvfp4(jnp.zeros((0, 64), jnp.bfloat16), impl=impl),
             lambda impl: quant_mx.quantize_mxfp8(jnp.zeros((0, 64), jnp.bfloat16), impl=impl)):
    _assert_bits_equal(fn("ffi"), fn("reference"))
