"""The bf16 grouped GEMM custom call in its three modes (and its reference) against float64 NumPy products.

On CPU this runs the CPU handler; with JAX_MOE_A2A_TEST_GPU=1 on a GPU, the CUTLASS kernels. Both
implementations are compared with an oracle that shares no code with them (NumPy, per group), and with each
other. Tolerance: calc_diff < 1e-5 and |error| within 1% of the largest output (one bfloat16 rounding of a float32
product; float32 output for the weight gradient).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe_a2a import _ffi, grouped_gemm
from jax_moe_a2a.testing import calc_diff

pytestmark = pytest.mark.skipif(not _ffi.available(), reason="compiled extension not built")

IMPLS = ("ffi", "reference")


def _bf16(rng, shape, scale=1.0):
  return jnp.asarray(rng.standard_normal(shape) * scale, jnp.bfloat16)


def _owned(sizes, rows):
  """(start, size) per group after clamping, in NumPy."""
  out, start = [], 0
  for s in np.maximum(np.asarray(sizes), 0):
    s = int(min(s, rows - start))
    out.append((start, s))
    start += s
  return out


def _oracle(a, b, sizes, b_layout):
  a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
  if b_layout == "nk":
    b64 = np.swapaxes(b64, 1, 2)
  out = np.zeros((a64.shape[0], b64.shape[2]))
  for g, (start, s) in enumerate(_owned(sizes, a64.shape[0])):
    out[start:start + s] = a64[start:start + s] @ b64[g]
  return out


def _oracle_wgrad(a, b, sizes):
  a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
  owned = _owned(sizes, a64.shape[0])
  out = np.zeros((len(owned), a64.shape[1], b64.shape[1]))
  for g, (start, s) in enumerate(owned):
    out[g] = a64[start:start + s].T @ b64[start:start + s]
  return out


def _close(got, want):
  got = np.asarray(got.astype(jnp.float32), np.float64)
  assert got.shape == want.shape
  assert calc_diff(got, want) < 1e-5
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-2 * max(np.abs(want).max(), 1e-30))
  return got


SIZES = [(130, 0, 1, 66), (0, 0, 0, 0), (5, 7, 300, 9), (-5, 40, 10, 0)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("b_layout", grouped_gemm.B_LAYOUTS)
@pytest.mark.parametrize("sizes", SIZES)
def test_grouped_gemm_bf16(impl, b_layout, sizes):
  rng = np.random.default_rng(sum(abs(s) for s in sizes))
  rows, k, n = 300, 72, 40  # rows not a multiple of any tile; (5, 7, 300, 9) asks for more rows than there are
  a = _bf16(rng, (rows, k))
  b = _bf16(rng, (4, n, k) if b_layout == "nk" else (4, k, n))
  gs = jnp.asarray(sizes, jnp.int32)
  got = jax.jit(lambda a, b, s: grouped_gemm.grouped_gemm_bf16(a, b, s, b_layout=b_layout, impl=impl))(a, b, gs)
  assert got.dtype == jnp.bfloat16
  got = _close(got, _oracle(a, b, gs, b_layout))
  owned = sum(s for _, s in _owned(sizes, rows))
  np.testing.assert_array_equal(got[owned:], 0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_grouped_gemm_bf16_wgrad(impl, sizes, out_dtype):
  rng = np.random.default_rng(10 + sum(abs(s) for s in sizes))
  rows, k, n = 300, 48, 56
  a, b = _bf16(rng, (rows, k)), _bf16(rng, (rows, n))
  gs = jnp.asarray(sizes, jnp.int32)
  got = jax.jit(lambda a, b, s: grouped_gemm.grouped_gemm_bf16_wgrad(a, b, s, out_dtype=out_dtype, impl=impl))(
      a, b, gs)
  assert got.dtype == out_dtype and got.shape == (4, k, n)
  got = _close(got, _oracle_wgrad(a, b, gs))
  for g, (_, s) in enumerate(_owned(sizes, rows)):
    if s == 0:
      np.testing.assert_array_equal(got[g], 0)


def test_ffi_and_reference_are_different_paths_that_agree():
  """The two implementations lower to different programs (a custom call, a ragged_dot) and agree closely."""
  rng = np.random.default_rng(5)
  a, b = _bf16(rng, (257, 64)), _bf16(rng, (6, 96, 64))
  sizes = jnp.asarray([40, 0, 1, 128, 17, 71], jnp.int32)
  fns = {impl: jax.jit(lambda a, b, s, impl=impl: grouped_gemm.grouped_gemm_bf16(a, b, s, impl=impl))
         for impl in IMPLS}
  assert "jax_moe_a2a_grouped_gemm_bf16" in fns["ffi"].lower(a, b, sizes).as_text()
  assert "jax_moe_a2a_grouped_gemm_bf16" not in fns["reference"].lower(a, b, sizes).as_text()
  ffi, ref = (np.asarray(fns[i](a, b, sizes), np.float32) for i in IMPLS)
  assert calc_diff(ffi, ref) < 1e-5


@pytest.mark.parametrize("fn, args, error, match", [
    ("gemm", dict(a=(8, 16, "f32")), TypeError, r"grouped_gemm_bf16: a must be bfloat16, got float32"),
    ("gemm", dict(a=(8, 12), b=(2, 16, 12)), ValueError, r"grouped_gemm_bf16: K must be a positive multiple of 8 \(16-byte rows\), got 12"),
    ("gemm", dict(b=(3, 16, 16)), ValueError, r"grouped_gemm_bf16: group_sizes must be \[G\] = \(3,\) \(G from b\)"),
    ("gemm", dict(b=(2, 16, 24)), ValueError, r"grouped_gemm_bf16: b must be \[G, N, K\] with K = 16 \(from a\)"),
    ("gemm", dict(layout="tn"), ValueError, r"grouped_gemm_bf16: b_layout must be one of nk, kn, got 'tn'"),
    ("gemm", dict(sizes="i64"), TypeError, r"grouped_gemm_bf16: group_sizes must be an int32 array \[G\], got int64"),
    ("wgrad", dict(b=(9, 16)), ValueError, r"grouped_gemm_bf16_wgrad: b must be \[M, N\] with M = 8 \(from a\)"),
    ("wgrad", dict(b=(8, 4)), ValueError, r"grouped_gemm_bf16_wgrad: N must be a positive multiple of 8"),
    ("wgrad", dict(out="f16"), ValueError, r"grouped_gemm_bf16_wgrad: out_dtype must be float32 or bfloat16, got float16"),
])
def test_argument_errors(fn, args, error, match):
  def arr(spec):
    dtype = jnp.float32 if spec[-1] == "f32" else jnp.bfloat16
    return jnp.zeros(tuple(d for d in spec if isinstance(d, int)), dtype)

  a = arr(args.get("a", (8, 16)))
  sizes = np.zeros((2,), np.int64) if args.get("sizes") == "i64" else jnp.zeros((2,), jnp.int32)
  with pytest.raises(error, match=match):
    if fn == "gemm":
      grouped_gemm.grouped_gemm_bf16(a, arr(args.get("b", (2, 16, 16))), sizes, b_layout=args.get("layout", "nk"),
                                     impl="reference")
    else:
      out_dtype = jnp.float16 if args.get("out") == "f16" else jnp.float32
      grouped_gemm.grouped_gemm_bf16_wgrad(a, arr(args.get("b", (8, 16))), sizes, out_dtype=out_dtype,
                                           impl="reference")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["nk", "kn", "wgrad", "wgrad_bf16"])
def test_gpu_deepseek_shape(mode):
  """DeepSeek-V3 expert shapes on the GPU kernels: 8 groups of ragged rows (one empty), hidden 7168, ffn 2048."""
  rng = np.random.default_rng(6)
  sizes = jnp.asarray([1024, 0, 1, 777, 1000, 129, 513, 1024], jnp.int32)
  rows = int(sizes.sum()) + 5
  if mode.startswith("wgrad"):
    a, b = _bf16(rng, (rows, 4096)), _bf16(rng, (rows, 7168))
    out_dtype = jnp.bfloat16 if mode == "wgrad_bf16" else jnp.float32
    got = grouped_gemm.grouped_gemm_bf16_wgrad(a, b, sizes, out_dtype=out_dtype, impl="ffi")
    assert got.dtype == out_dtype
    got = _close(got, _oracle_wgrad(a, b, sizes))
    np.testing.assert_array_equal(got[1], 0)
  else:
    a = _bf16(rng, (rows, 7168))
    b = _bf16(rng, (8, 4096, 7168) if mode == "nk" else (8, 7168, 4096), 0.05)
    _close(grouped_gemm.grouped_gemm_bf16(a, b, sizes, b_layout=mode, impl="ffi"), _oracle(a, b, sizes, mode))


@pytest.mark.gpu
def test_gpu_back_to_back_in_one_jit():
  """Many calls of every mode in one program (scratch reuse, CUDA graphs) give the same result each time."""
  rng = np.random.default_rng(7)
  a, w, c = _bf16(rng, (1000, 512)), _bf16(rng, (4, 256, 512)), _bf16(rng, (1000, 256))
  sizes = jnp.asarray([300, 0, 650, 50], jnp.int32)

  @jax.jit
  def many(a, w, c, sizes):
    outs = []
    for i in range(10):
      s = sizes + 0 * i
      outs.append((grouped_gemm.grouped_gemm_bf16(a, w, s, impl="ffi"),
                   grouped_gemm.grouped_gemm_bf16(c, w, s, b_layout="kn", impl="ffi"),
                   grouped_gemm.grouped_gemm_bf16_wgrad(c, a, s, impl="ffi")))
    return outs

  outs = many(a, w, c, sizes)
  for o in outs[1:]:
    for x, y in zip(o, outs[0]):
      np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
  _close(outs[0][0], _oracle(a, w, sizes, "nk"))
  _close(outs[0][1], _oracle(c, w, sizes, "kn"))
  _close(outs[0][2], _oracle_wgrad(c, a, sizes))
