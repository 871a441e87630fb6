"""The expert stage's row movement (jax_moe_a2a.rows): the custom calls equal their references bit for bit, indices
outside the source rows select nothing, and a NaN in a row no output selects reaches no output."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jax_moe_a2a import _ffi, rows

needs_ext = pytest.mark.skipif(not _ffi.available(), reason="compiled extension not built")


def _bits(a):
  a = np.asarray(a)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _indices(rng, n, num_rows, invalid=True):
  idx = rng.integers(0, num_rows, n).astype(np.int32)
  if invalid and n > 2:
    idx[0], idx[1] = -1, num_rows + 5  # outside the rows: selects nothing
  return jnp.asarray(idx)


@needs_ext
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn, jnp.int32])
@pytest.mark.parametrize("num_rows,hidden,n", [(7, 64, 20), (1, 8, 3), (33, 136, 50)])
def test_gather_rows_equals_the_reference(dtype, num_rows, hidden, n):
  rng = np.random.default_rng(num_rows * hidden)
  x = jnp.asarray(rng.standard_normal((num_rows, hidden)) * 4).astype(dtype)
  idx = _indices(rng, n, num_rows)
  got = jax.jit(lambda x, i: rows.gather_rows(x, i, impl="ffi"))(x, idx)
  want = rows.gather_rows(x, idx, impl="reference")
  np.testing.assert_array_equal(_bits(got), _bits(want))
  np.testing.assert_array_equal(_bits(want[2:]), _bits(x[np.asarray(idx)[2:]]))
  assert not np.any(_bits(want[:2]))


def _permutation_positions(rng, num_rows, k):
  return jnp.asarray(rng.permutation(num_rows * k).astype(np.int32).reshape(num_rows, k))


@needs_ext
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn, jnp.int32])
@pytest.mark.parametrize("num_rows,hidden,k", [(7, 64, 3), (1, 3, 2), (40, 7168, 8), (5, 136, 1), (2300, 520, 2)])
def test_scatter_rows_equals_the_reference_and_the_gather_by_the_inverse(dtype, num_rows, hidden, k):
  """Rows of 6 bytes to 14 KiB (the GPU kernel's narrow words and its segments of one word per lane), k = 1 to 8;
  2300 rows take the GPU kernel's segments of four words per lane (and a partial last segment)."""
  rng = np.random.default_rng(num_rows * hidden + k)
  x = jnp.asarray(rng.standard_normal((num_rows, hidden)) * 4).astype(dtype)
  pos = _permutation_positions(rng, num_rows, k)
  got = jax.jit(lambda x, p: rows.scatter_rows(x, p, impl="ffi"))(x, pos)
  want = rows.scatter_rows(x, pos, impl="reference")
  inverse = np.zeros(num_rows * k, np.int32)
  inverse[np.asarray(pos).reshape(-1)] = np.arange(num_rows * k) // k
  assert got.shape == (num_rows * k, hidden) and got.dtype == x.dtype
  np.testing.assert_array_equal(_bits(got), _bits(want))
  np.testing.assert_array_equal(_bits(want), _bits(rows.gather_rows(x, jnp.asarray(inverse), impl="reference")))


@pytest.mark.parametrize("bad", [[[0, 0], [1, 2]], [[0, 1], [2, 4]], [[0, 1], [2, -1]]])
@pytest.mark.parametrize("impl", ["reference", "ffi"])
def test_scatter_rows_refuses_positions_that_are_not_a_permutation(bad, impl):
  """Named twice, out of range, negative: the reference refuses a concrete pos, the CPU handler any pos."""
  if impl == "ffi" and (not _ffi.available() or jax.default_backend() != "cpu"):
    pytest.skip("the CPU handler checks the permutation; the GPU kernel does not")
  x = jnp.arange(8, dtype=jnp.float32).reshape(2, 4)
  with pytest.raises(Exception, match="permutation"):
    jax.block_until_ready(jax.jit(lambda x, p: rows.scatter_rows(x, p, impl=impl))(x, jnp.asarray(bad, jnp.int32))
                          if impl == "ffi" else rows.scatter_rows(x, jnp.asarray(bad, jnp.int32), impl=impl))


@needs_ext
@pytest.mark.parametrize("in_dtype,out_dtype", [(jnp.bfloat16, jnp.bfloat16), (jnp.float32, jnp.bfloat16),
                                                (jnp.bfloat16, jnp.float32), (jnp.float32, jnp.float32)])
def test_scaled_gather_rows_equals_the_reference(in_dtype, out_dtype):
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((9, 48))).astype(in_dtype)
  idx = _indices(rng, 30, 9)
  scale = jnp.asarray(rng.standard_normal(30), jnp.float32)
  got = jax.jit(lambda x, i, s: rows.gather_rows(x, i, scale=s, out_dtype=out_dtype, impl="ffi"))(x, idx, scale)
  want = rows.gather_rows(x, idx, scale=scale, out_dtype=out_dtype, impl="reference")
  assert got.dtype == want.dtype == jnp.dtype(out_dtype)
  np.testing.assert_array_equal(_bits(got), _bits(want))
  np.testing.assert_allclose(np.asarray(want[2:], np.float32),
                             np.asarray(x, np.float32)[np.asarray(idx)[2:]] * np.asarray(scale)[2:, None],
                             rtol=1e-2 if out_dtype == jnp.bfloat16 else 1e-6)


@needs_ext
@pytest.mark.parametrize("in_dtype,out_dtype", [(jnp.bfloat16, jnp.float32), (jnp.bfloat16, jnp.bfloat16),
                                                (jnp.float32, jnp.float32), (jnp.float32, jnp.bfloat16)])
@pytest.mark.parametrize("weighted", [True, False])
def test_sum_rows_equals_the_reference(in_dtype, out_dtype, weighted):
  rng = np.random.default_rng(2)
  num_rows, k, hidden = 40, 5, 72
  y = jnp.asarray(rng.standard_normal((num_rows, hidden))).astype(in_dtype)
  pos = rng.integers(0, num_rows, (17, k)).astype(np.int32)
  pos[0, :] = -1  # a row of nothing: +0
  pos[1, 2] = num_rows  # one term left out
  pos = jnp.asarray(pos)
  w = jnp.asarray(rng.standard_normal((17, k)), jnp.float32) if weighted else None
  got = jax.jit(lambda y, p, w: rows.sum_rows(y, p, w, out_dtype=out_dtype, impl="ffi"))(y, pos, w)
  want = rows.sum_rows(y, pos, w, out_dtype=out_dtype, impl="reference")
  np.testing.assert_array_equal(_bits(got), _bits(want))
  assert np.all(_bits(want[0]) == 0)  # +0, not -0
  y64, p = np.asarray(y, np.float64), np.asarray(pos)
  w64 = np.ones(p.shape) if w is None else np.asarray(w, np.float64)
  ok = (p >= 0) & (p < num_rows)
  ref = np.einsum("rk,rkh->rh", np.where(ok, w64, 0), y64[np.clip(p, 0, num_rows - 1)])
  np.testing.assert_allclose(np.asarray(want, np.float64), ref, rtol=2e-2 if out_dtype == jnp.bfloat16 else 1e-5,
                             atol=1e-2 if out_dtype == jnp.bfloat16 else 1e-5)


@needs_ext
@pytest.mark.parametrize("impl", ["ffi", "reference"])
def test_a_nan_in_a_row_nobody_selects_reaches_no_output(impl):
  y = jnp.ones((6, 16), jnp.bfloat16).at[5].set(jnp.nan)
  pos = jnp.array([[0, 1], [5, -1], [2, 3]], jnp.int32).at[1, 0].set(-1)  # row 5 is never selected
  out = rows.sum_rows(y, pos, jnp.ones((3, 2), jnp.float32), impl=impl)
  assert np.all(np.isfinite(np.asarray(out)))
  g = rows.gather_rows(y, jnp.array([0, -1, 4], jnp.int32), impl=impl)
  assert np.all(np.isfinite(np.asarray(g, np.float32)))


def test_arguments_are_checked():
  y = jnp.zeros((4, 8), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"sum_rows: y must be bfloat16, float16 or float32, got int32"):
    rows.sum_rows(y.astype(jnp.int32), jnp.zeros((2, 2), jnp.int32))
  with pytest.raises(ValueError, match=r"sum_rows: weights must be float32 \(2, 2\) \(the shape of pos\), got "
                                       r"float32 of shape \(2, 3\)"):
    rows.sum_rows(y, jnp.zeros((2, 2), jnp.int32), jnp.zeros((2, 3), jnp.float32))
  with pytest.raises(ValueError, match=r"gather_rows: idx must be a 1-D integer array, got float32 of shape \(3,\)"):
    rows.gather_rows(y, jnp.zeros((3,), jnp.float32))
  with pytest.raises(ValueError, match=r"gather_rows: out_dtype without a scale must be x's dtype bfloat16, got "
                                       r"float32"):
    rows.gather_rows(y, jnp.zeros((3,), jnp.int32), out_dtype=jnp.float32)
  with pytest.raises(ValueError, match=r"gather_rows: scale must be float32 \(3,\) \(one per idx\)"):
    rows.gather_rows(y, jnp.zeros((3,), jnp.int32), scale=jnp.zeros((2,), jnp.float32))
  if _ffi.available():
    with pytest.raises(ValueError, match=r"sum_rows: impl='ffi' needs bfloat16 or float32 rows"):
      rows.sum_rows(y.astype(jnp.float16), jnp.zeros((2, 2), jnp.int32), impl="ffi")
  # float16 rows take the reference under "auto"
  np.testing.assert_array_equal(np.asarray(rows.sum_rows(y.astype(jnp.float16), jnp.zeros((2, 2), jnp.int32),
                                                         out_dtype=jnp.float16)), np.zeros((2, 8)))


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["expand", "expand_fp8", "unpermute", "scaled"])
def test_deepseek_shapes_on_the_gpu_equal_the_reference(op):
  """4096 tokens, top-8, hidden 7168: the layer's permute and un-permute, custom call against reference."""
  rng = np.random.default_rng(3)
  tokens, k, hidden = 4096, 8, 7168
  order = jnp.asarray(rng.permutation(tokens * k).astype(np.int32))
  if op in ("expand", "expand_fp8", "scaled"):
    x = jax.random.normal(jax.random.key(0), (tokens, hidden), jnp.float32)
    x = x.astype(jnp.float8_e4m3fn if op == "expand_fp8" else jnp.bfloat16)
    args = (x, order // k)
    kw = {"scale": jnp.asarray(rng.standard_normal(tokens * k), jnp.float32)} if op == "scaled" else {}
    fn = lambda impl: jax.jit(lambda *a: rows.gather_rows(*a, **kw, impl=impl))
  else:
    y = jax.random.normal(jax.random.key(0), (tokens * k, hidden), jnp.bfloat16)
    pos = order.reshape(tokens, k).at[::7, 3].set(-1)
    args = (y, pos, jnp.asarray(rng.random((tokens, k)), jnp.float32))
    fn = lambda impl: jax.jit(lambda *a: rows.sum_rows(*a, out_dtype=jnp.bfloat16, impl=impl))
  np.testing.assert_array_equal(_bits(fn("ffi")(*args)), _bits(fn("reference")(*args)))
