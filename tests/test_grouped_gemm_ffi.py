"""The FP8 grouped GEMM custom call (and its reference) against an FP32 GEMM of the dequantized operands.

On CPU this runs the CPU handler; with JAX_MOE_A2A_TEST_GPU=1 on a GPU, the CUDA kernels: the GPU tests run once
with each kernel of 128-row tiles (JAX_MOE_A2A_FP8_GEMM_KERNEL: the CUTLASS one and the one written on wgmma).
Tolerance: calc_diff < 1e-3 (issue #5); the measured values are ~1e-6, the bfloat16 rounding of the output.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe_a2a import _ffi, grouped_gemm, quant
from jax_moe_a2a.testing import calc_diff

pytestmark = pytest.mark.skipif(not _ffi.available(), reason="compiled extension not built")

CALC_DIFF = 1e-3
IMPLS = ("ffi", "reference")
KERNEL_ENV = "JAX_MOE_A2A_FP8_GEMM_KERNEL"
KERNELS = ("cutlass", "wgmma")


@pytest.fixture(params=KERNELS)
def kernel(request, monkeypatch):
  """The CUDA kernel of calls with more than 64 rows per group on average (read by the handler at every call)."""
  monkeypatch.setenv(KERNEL_ENV, request.param)
  return request.param


def _operands(rng, rows_shape, num_groups, n, k):
  """FP8 activations of shape rows_shape + (k,) and FP8 weights [num_groups, n, k], with their scales."""
  x = rng.standard_normal((*rows_shape, k)).astype(np.float32)
  x *= np.exp2(rng.integers(-4, 4, size=(*rows_shape, k // 128, 1))).repeat(128, -1).reshape(x.shape)
  w = rng.standard_normal((num_groups, n, k)).astype(np.float32) * 0.05
  a, a_sf = quant.quantize_fp8_blockwise(jnp.asarray(x.reshape(-1, k)), impl="reference")
  b, b_sf = quant.quantize_fp8_weight(jnp.asarray(w))
  return a.reshape(x.shape), a_sf.reshape(*rows_shape, k // 128), b, b_sf


def _oracle(a, a_sf, b, b_sf, group_sizes):
  """float32 GEMM of the dequantized operands per owned row, zeros elsewhere, and the owned-row mask (numpy)."""
  k = a.shape[-1]
  x = np.asarray(quant.dequantize_fp8_blockwise(a.reshape(-1, k), a_sf.reshape(-1, k // 128))).reshape(a.shape)
  w = np.asarray(quant.dequantize_fp8_weight(b, b_sf))
  sizes = np.maximum(np.asarray(group_sizes), 0)
  if a.ndim == 3:
    out = np.zeros((*a.shape[:2], w.shape[1]), np.float32)
    owned = np.zeros(a.shape[:2], bool)
    for g, s in enumerate(np.minimum(sizes, a.shape[1])):
      out[g, :s] = x[g, :s] @ w[g].T
      owned[g, :s] = True
    return out, owned
  out = np.zeros((a.shape[0], w.shape[1]), np.float32)
  start = 0
  for g, s in enumerate(sizes):
    s = min(s, a.shape[0] - start)
    out[start:start + s] = x[start:start + s] @ w[g].T
    start += s
  return out, np.arange(a.shape[0]) < start


def _check(a, a_sf, b, b_sf, group_sizes, impl):
  got = jax.jit(lambda *args: grouped_gemm.grouped_gemm_fp8(*args, impl=impl))(a, a_sf, b, b_sf, group_sizes)
  want, owned = _oracle(a, a_sf, b, b_sf, group_sizes)
  assert got.dtype == jnp.bfloat16 and got.shape == want.shape
  got = np.asarray(got.astype(jnp.float32))
  assert calc_diff(got, want) < CALC_DIFF
  np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2 * np.abs(want).max())
  # Rows no group owns are exactly zero.
  np.testing.assert_array_equal(got[~owned], 0)
  return got


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("sizes", [(130, 0, 1, 66), (0, 0, 0, 0), (5, 7, 300, 9)])
def test_contiguous(impl, sizes):
  rng = np.random.default_rng(sum(sizes))
  rows = 300  # not a multiple of 128; (5, 7, 300, 9) asks for more rows than there are (clamped)
  a, a_sf, b, b_sf = _operands(rng, (rows,), len(sizes), 256, 384)
  got = _check(a, a_sf, b, b_sf, jnp.asarray(sizes, jnp.int32), impl)
  owned = min(sum(sizes), rows)
  assert not np.any(got[owned:])


@pytest.mark.parametrize("impl", IMPLS)
def test_masked(impl):
  rng = np.random.default_rng(3)
  counts = jnp.asarray([0, 1, 77, 200, 513], jnp.int32)  # empty, one row, partial, full, more than R (clamped)
  a, a_sf, b, b_sf = _operands(rng, (5, 200), 5, 128, 256)
  got = _check(a, a_sf, b, b_sf, counts, impl)
  assert not np.any(got[0]) and not np.any(got[1, 1:]) and not np.any(got[2, 77:])


@pytest.mark.parametrize("impl", IMPLS)
def test_negative_sizes_are_empty(impl):
  rng = np.random.default_rng(4)
  a, a_sf, b, b_sf = _operands(rng, (64,), 3, 128, 128)
  _check(a, a_sf, b, b_sf, jnp.asarray([-5, 40, 10], jnp.int32), impl)


def test_ffi_equals_reference_closely():
  """Same inputs through both implementations: they differ only in float32 summation order."""
  rng = np.random.default_rng(5)
  a, a_sf, b, b_sf = _operands(rng, (257,), 6, 384, 512)
  sizes = jnp.asarray([40, 0, 1, 128, 17, 71], jnp.int32)
  ffi = grouped_gemm.grouped_gemm_fp8(a, a_sf, b, b_sf, sizes, impl="ffi").astype(jnp.float32)
  ref = grouped_gemm.grouped_gemm_fp8(a, a_sf, b, b_sf, sizes, impl="reference").astype(jnp.float32)
  assert calc_diff(ffi, ref) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("masked", [False, True])
def test_gpu_deepseek_shape(masked, kernel):
  """A DeepSeek-V3 expert shape on the GPU kernel: 8 groups of ragged rows, N=4096, K=7168."""
  rng = np.random.default_rng(6)
  sizes = np.asarray([1024, 0, 1, 777, 1000, 129, 513, 1024], np.int32)
  rows_shape = (8, 1024) if masked else (int(sizes.sum()) + 5,)
  a, a_sf, b, b_sf = _operands(rng, rows_shape, 8, 4096, 7168)
  _check(a, a_sf, b, b_sf, jnp.asarray(sizes), "ffi")


@pytest.mark.gpu
def test_gpu_small_and_large_row_tiles_agree(kernel):
  """Decode-sized calls (at most 64 rows per group on average) take the kernel's 64-row tiles, larger ones its
  128-row tiles: the same groups through both (the row count padded past the threshold) against the oracle and
  each other, with groups of 0, 1, 63, 64, 65 and 200 rows (several tiles of either kind)."""
  rng = np.random.default_rng(8)
  sizes = np.asarray([0, 1, 63, 64, 65, 200, 33, 30] * 4, np.int32)  # 32 groups, 1824 rows: 57 on average
  a, a_sf, b, b_sf = _operands(rng, (32 * 80,), 32, 1024, 2048)
  small = _check(a[:32 * 64], a_sf[:32 * 64], b, b_sf, jnp.asarray(sizes), "ffi")
  large = _check(a, a_sf, b, b_sf, jnp.asarray(sizes), "ffi")
  assert calc_diff(small, large[:32 * 64]) < 1e-6
  # The masked layout: R = 64 rows per group (64-row tiles) and R = 72 (128-row tiles).
  a, a_sf, b, b_sf = _operands(rng, (8, 72), 8, 512, 1024)
  counts = jnp.asarray([0, 1, 64, 72, 30, 63, 65, 9], jnp.int32)
  small = _check(a[:, :64], a_sf[:, :64], b, b_sf, counts, "ffi")
  large = _check(a, a_sf, b, b_sf, counts, "ffi")
  assert calc_diff(small, large[:, :64]) < 1e-6


@pytest.mark.gpu
def test_gpu_back_to_back_in_one_jit(kernel):
  """Many calls in one program (scratch reuse, CUDA graphs when XLA captures them) give the same result."""
  rng = np.random.default_rng(7)
  a, a_sf, b, b_sf = _operands(rng, (1000,), 4, 512, 1024)
  sizes = jnp.asarray([300, 0, 650, 50], jnp.int32)

  @jax.jit
  def many(a, a_sf, b, b_sf, sizes):
    outs = [grouped_gemm.grouped_gemm_fp8(a, a_sf, b, b_sf, sizes + 0 * i, impl="ffi") for i in range(20)]
    return jnp.stack(outs)

  outs = np.asarray(many(a, a_sf, b, b_sf, sizes).astype(jnp.float32))
  for o in outs[1:]:
    np.testing.assert_array_equal(o, outs[0])
  want, _ = _oracle(a, a_sf, b, b_sf, sizes)
  assert calc_diff(outs[0], want) < CALC_DIFF


@pytest.mark.gpu
@pytest.mark.parametrize("masked", [False, True])
def test_gpu_kernels_agree(masked, monkeypatch):
  """The CUTLASS kernel and the wgmma kernel on the same ragged groups (tiles that end inside a group, a group
  starting inside another's last tile, empty groups): equal up to float32 summation order and bfloat16 rounding."""
  rng = np.random.default_rng(9)
  sizes = jnp.asarray([300, 0, 129, 1, 128, 255, 0, 211], jnp.int32)
  rows_shape = (8, 300) if masked else (1300,)
  a, a_sf, b, b_sf = _operands(rng, rows_shape, 8, 1024, 2048)
  outs = {}
  for name in KERNELS:
    monkeypatch.setenv(KERNEL_ENV, name)
    outs[name] = _check(a, a_sf, b, b_sf, sizes, "ffi")
  assert calc_diff(outs["cutlass"], outs["wgmma"]) < 1e-5


@pytest.mark.gpu
def test_gpu_unknown_kernel_name_is_refused(monkeypatch):
  rng = np.random.default_rng(10)
  a, a_sf, b, b_sf = _operands(rng, (512,), 2, 128, 128)
  monkeypatch.setenv(KERNEL_ENV, "wgmma2")
  with pytest.raises(Exception, match="JAX_MOE_A2A_FP8_GEMM_KERNEL is 'wgmma2'; expected 'cutlass', 'wgmma' or unset"):
    jax.block_until_ready(grouped_gemm.grouped_gemm_fp8(a, a_sf, b, b_sf, jnp.asarray([256, 256], jnp.int32),
                                                        impl="ffi"))
