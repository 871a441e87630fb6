"""The FP8 expert MLP (`expert_mlp.swiglu_mlp_fp8`) and the grouped GEMM's argument checks.

Tolerances: against a float32 MLP of the *dequantized* operands only the SwiGLU activation's 1x128 requantization
and bfloat16 roundings differ, calc_diff < 1e-3 (observed ~4e-4); against the float32 MLP of the original float
operands the activations and weights are quantized too, calc_diff < 3e-3 (observed ~1e-3). Gradients are
straight-through bfloat16: calc_diff < 1e-4 between implementations (different GEMMs; observed ~1e-6), and
calc_diff < 3e-3 against the float32 MLP's gradients.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe_a2a import _ffi, expert_mlp, grouped_gemm, quant
from jax_moe_a2a.demo import calc_diff

HIDDEN, FFN, GROUPS = 256, 128, 4
IMPLS = ["reference"] + (["ffi"] if _ffi.available() else [])


def _data(seed, rows=200, sizes=(60, 0, 1, 139)):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((rows, HIDDEN)), jnp.float32)
  w_gu = jnp.asarray(rng.standard_normal((GROUPS, 2 * FFN, HIDDEN)) / np.sqrt(HIDDEN), jnp.float32)
  w_dn = jnp.asarray(rng.standard_normal((GROUPS, HIDDEN, FFN)) / np.sqrt(FFN), jnp.float32)
  return x, jnp.asarray(sizes, jnp.int32), expert_mlp.ExpertWeights(w_gu, w_dn)


def _f32_mlp(x, sizes, weights):
  return expert_mlp.swiglu_mlp_xla(x, sizes, weights, compute_dtype=jnp.float32, method="tiled")


@pytest.mark.parametrize("impl", IMPLS)
def test_mlp_matches_float32(impl):
  x, sizes, weights = _data(0)
  got = jax.jit(lambda x, s, w: expert_mlp.swiglu_mlp_fp8(x, s, w, impl=impl))(x, sizes, weights)
  assert got.dtype == jnp.bfloat16 and got.shape == x.shape
  got = np.asarray(got, np.float32)
  assert calc_diff(got, _f32_mlp(x, sizes, weights)) < 3e-3
  # Against the dequantized operands only the activation's requantization (and bf16 rounding) remains.
  xq, xs = quant.quantize_fp8_blockwise(x, impl="reference")
  fp8 = expert_mlp.ExpertWeights.quantize(weights.w_gate_up, weights.w_down)
  deq = _f32_mlp(quant.dequantize_fp8_blockwise(xq, xs), sizes, expert_mlp.ExpertWeights(*fp8.dequantized(jnp.float32)))
  assert calc_diff(got, deq) < 1e-3
  assert not np.any(got[int(sizes.sum()):])


@pytest.mark.parametrize("impl", IMPLS)
def test_mlp_fp8_inputs_equal_float_inputs(impl):
  """FP8 x (with scales) and FP8 weights give what their float originals give (quantized inside)."""
  x, sizes, weights = _data(1)
  xq, xs = quant.quantize_fp8_blockwise(x, impl="reference")
  fp8 = expert_mlp.ExpertWeights.quantize(weights.w_gate_up, weights.w_down)
  a = expert_mlp.swiglu_mlp_fp8(x, sizes, weights, impl=impl)
  b = expert_mlp.swiglu_mlp_fp8(xq, sizes, fp8, x_sf=xs, impl=impl)
  np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("impl", IMPLS)
def test_masked_equals_contiguous(impl):
  x, sizes, weights = _data(2, rows=60 + 0 + 1 + 139)
  cont = np.asarray(expert_mlp.swiglu_mlp_fp8(x, sizes, weights, impl=impl), np.float32)
  rows = 160
  starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
  xm = np.zeros((GROUPS, rows, HIDDEN), np.float32)
  for g, (s0, n) in enumerate(zip(starts, np.asarray(sizes))):
    xm[g, :n] = x[s0:s0 + n]
  masked = np.asarray(expert_mlp.swiglu_mlp_fp8(jnp.asarray(xm), sizes, weights, impl=impl), np.float32)
  for g, (s0, n) in enumerate(zip(starts, np.asarray(sizes))):
    np.testing.assert_array_equal(masked[g, :n], cont[s0:s0 + n])
    assert not np.any(masked[g, n:])


def _grads(impl, x, sizes, weights, ct):
  def loss(x, w_gu, w_dn):
    y = expert_mlp.swiglu_mlp_fp8(x, sizes, expert_mlp.ExpertWeights(w_gu, w_dn), impl=impl)
    return jnp.sum(y.astype(jnp.float32) * ct)
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, weights.w_gate_up, weights.w_down)


@pytest.mark.skipif(not _ffi.available(), reason="compiled extension not built")
def test_gradients_of_the_custom_calls_equal_the_reference_s():
  """The custom calls against the reference (different grouped GEMMs): equal to float32 rounding of their sums and one
  bfloat16 rounding of each intermediate."""
  x, sizes, weights = _data(3)
  ct = jnp.asarray(np.random.default_rng(4).standard_normal(x.shape), jnp.float32)
  got = {impl: _grads(impl, x, sizes, weights, ct) for impl in ("ffi", "reference")}
  for name, a, b in zip(("x", "w_gate_up", "w_down"), got["reference"], got["ffi"]):
    assert calc_diff(a, b) < 1e-4, name


def test_gradients_are_straight_through_and_close_to_float32():
  x, sizes, weights = _data(3)
  ct = jnp.asarray(np.random.default_rng(4).standard_normal(x.shape), jnp.float32)
  got = {"reference": _grads("reference", x, sizes, weights, ct)}

  def f32_loss(x, w_gu, w_dn):
    return jnp.sum(_f32_mlp(x, sizes, expert_mlp.ExpertWeights(w_gu, w_dn)) * ct)
  want = jax.grad(f32_loss, argnums=(0, 1, 2))(x, weights.w_gate_up, weights.w_down)
  for name, a, b in zip(("x", "w_gate_up", "w_down"), got["reference"], want):
    assert a.dtype == b.dtype == jnp.float32
    assert calc_diff(a, b) < 3e-3, name
  assert not np.any(np.asarray(got["reference"][0])[int(sizes.sum()):])  # rows no expert owns get no gradient
  assert not np.any(np.asarray(got["reference"][1])[1])  # the empty group's weights neither


def test_fp8_weights_get_no_gradient_and_x_still_does():
  x, sizes, weights = _data(5)
  fp8 = expert_mlp.ExpertWeights.quantize(weights.w_gate_up, weights.w_down)

  def loss(x, w_gu, w_dn):
    w = expert_mlp.ExpertWeights(w_gu, w_dn, fp8.w_gate_up_sf, fp8.w_down_sf)
    return jnp.sum(expert_mlp.swiglu_mlp_fp8(x, sizes, w, impl="reference").astype(jnp.float32))

  dx, dw_gu, dw_dn = jax.grad(loss, argnums=(0, 1, 2))(x, fp8.w_gate_up, fp8.w_down)
  assert dx.shape == x.shape and np.any(np.asarray(dx))
  for dw, w in ((dw_gu, fp8.w_gate_up), (dw_dn, fp8.w_down)):
    assert dw.shape == w.shape and not np.any(np.asarray(dw, np.float32))


# ----------------------------------------------------------------------------------------------------------------
# Argument checks
# ----------------------------------------------------------------------------------------------------------------


def _gemm_args(**override):
  a, a_sf = quant.quantize_fp8_blockwise(jnp.ones((64, 256), jnp.float32), impl="reference")
  b, b_sf = quant.quantize_fp8_weight(jnp.ones((3, 128, 256), jnp.float32))
  args = dict(a=a, a_sf=a_sf, b=b, b_sf=b_sf, group_sizes=jnp.asarray([10, 20, 30], jnp.int32))
  args.update(override)
  return args


@pytest.mark.parametrize("override,error,match", [
    (dict(a=jnp.ones((64, 256), jnp.bfloat16)), TypeError, "a must be float8_e4m3fn, got bfloat16"),
    (dict(a_sf=None), ValueError, "a_sf must be given, got None"),
    (dict(a_sf=jnp.ones((64, 3), jnp.float32)), ValueError, r"a_sf must be \[M, K/128\] = \(64, 2\), got shape \(64, 3\)"),
    (dict(a_sf=jnp.ones((2, 64), jnp.float32)), ValueError, r"a_sf must be \[M, K/128\] = \(64, 2\), got shape \(2, 64\)"),
    (dict(b_sf=jnp.ones((3, 1, 2), jnp.float16)), TypeError, "b_sf must be float32, got float16"),
    (dict(b_sf=jnp.ones((3, 2, 1), jnp.float32)), ValueError, r"b_sf must be \[G, N/128, K/128\] = \(3, 1, 2\)"),
    (dict(group_sizes=jnp.asarray([1, 2], jnp.int32)), ValueError, r"group_sizes must be \[G\] = \(3,\)"),
    (dict(group_sizes=jnp.asarray([1, 2, 3], jnp.int16)), TypeError, "group_sizes must be int32, got int16"),
    (dict(b=jnp.zeros((3, 100, 256), jnp.float8_e4m3fn)), ValueError, "N, K positive multiples of 128"),
    (dict(b=jnp.zeros((0, 128, 256), jnp.float8_e4m3fn)), ValueError, "1 <= G <= 65535"),
    (dict(a=jnp.zeros((64, 384), jnp.float8_e4m3fn)), ValueError, r"a \(contiguous\) must be \[M, K\] with K = 256"),
    (dict(a=jnp.zeros((2, 64, 256), jnp.float8_e4m3fn)), ValueError, r"a \(masked\) must be \[G, R, K\] with G = 3"),
    (dict(a=jnp.zeros((256,), jnp.float8_e4m3fn)), ValueError, r"a must be \[M, K\] \(contiguous\) or \[G, R, K\]"),
])
def test_grouped_gemm_errors(override, error, match):
  with pytest.raises(error, match=match):
    grouped_gemm.grouped_gemm_fp8(**_gemm_args(**override), impl="reference")


def test_mlp_errors():
  x, sizes, weights = _data(6)
  with pytest.raises(ValueError, match="x_sf must be given"):
    expert_mlp.swiglu_mlp_fp8(x.astype(jnp.float8_e4m3fn), sizes, weights)
  with pytest.raises(ValueError, match="x_sf is only for float8_e4m3fn x, got x of dtype float32"):
    expert_mlp.swiglu_mlp_fp8(x, sizes, weights, x_sf=jnp.ones((200, 2), jnp.float32))
  odd = expert_mlp.ExpertWeights(jnp.ones((GROUPS, 2 * 96, HIDDEN)), jnp.ones((GROUPS, HIDDEN, 96)))
  with pytest.raises(ValueError, match="ffn must be a positive multiple of 128, got 96"):
    expert_mlp.swiglu_mlp_fp8(x, sizes, odd)
  with pytest.raises(ValueError, match=r"x must be \[M, hidden\] or \[G=4, R, hidden\]"):
    expert_mlp.swiglu_mlp_fp8(x.reshape(2, 100, HIDDEN), sizes, weights)
