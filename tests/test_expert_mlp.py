"""Tests of the expert MLPs (jax_moe_a2a.expert_mlp): the row-tiled MLP against ragged_dot, the bf16 grouped-GEMM
MLP against float32, and the FP8 MLP's FP8 backward against its product emulated in float64.

Matmuls run at full float32 precision (on GPUs XLA's default precision for float32 matmuls is lower).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe_a2a import expert_mlp, grouped_gemm, quant

# The stage's sizes, weights and full-precision matmuls (an autouse fixture, active here once imported).
from test_experts import FFN, HIDDEN, TOL, _max_rel, _weights  # noqa: E402
from test_experts import _float32_matmuls  # noqa: F401  pylint: disable=unused-import


@pytest.mark.parametrize("group_sizes", [(0, 0, 0), (1, 0, 300), (128, 129, 0), (17, 5, 40)])
def test_tiled_and_ragged_dot_agree_with_gradients(group_sizes):
  """The tiled MLP (CPU path, custom VJP) and ragged_dot (JAX's own autodiff): values and all gradients.

  Group sizes include empty groups, a group of one row, groups of exactly and just over one tile, and rows past
  sum(group_sizes), which must give zero and get zero gradient.
  """
  rows = 320
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((rows, HIDDEN)).astype(np.float32))
  weights = _weights(3)
  gs = jnp.asarray(group_sizes, jnp.int32)
  ct = jnp.asarray(rng.standard_normal((rows, HIDDEN)).astype(np.float32))

  def run(method):
    def f(x, wt):
      return expert_mlp.swiglu_mlp_xla(x, gs, wt, compute_dtype=jnp.float32, method=method)
    y, vjp = jax.vjp(f, x, weights)
    return (y,) + vjp(ct)

  tiled = jax.jit(lambda: run("tiled"))()
  ragged = jax.jit(lambda: run("ragged_dot"))()
  total = int(sum(group_sizes))
  y, dx, dw = tiled
  np.testing.assert_array_equal(np.asarray(y)[total:], 0.0)
  np.testing.assert_array_equal(np.asarray(dx)[total:], 0.0)
  for a, b in zip(jax.tree.leaves(tiled), jax.tree.leaves(ragged)):
    a, b = np.asarray(a), np.asarray(b)
    if np.any(b != 0):
      assert _max_rel(a, b) <= TOL
    else:
      np.testing.assert_array_equal(a, 0.0)


@pytest.mark.parametrize("impl", ["ffi", "reference"])
def test_swiglu_mlp_bf16_matches_float32(impl):
  """The bf16 MLP on the grouped GEMMs against the float32 MLP: output and gradients within bf16 rounding."""
  from jax_moe_a2a import _ffi  # pylint: disable=import-outside-toplevel
  from jax_moe_a2a.testing import calc_diff  # pylint: disable=import-outside-toplevel
  if impl == "ffi" and not _ffi.available():
    pytest.skip("compiled extension not built")
  rng = np.random.default_rng(9)
  x = jnp.asarray(rng.standard_normal((150, HIDDEN)), jnp.float32)
  sizes = jnp.asarray([50, 0, 90], jnp.int32)  # 10 rows no expert owns
  weights = _weights(9)
  ct = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)

  def loss(fn):
    return lambda x, gu, dn: jnp.sum(fn(x, expert_mlp.ExpertWeights(gu, dn)).astype(jnp.float32) * ct)

  bf16 = loss(lambda x, w: expert_mlp.swiglu_mlp_bf16(x, sizes, w, impl=impl))
  f32 = loss(lambda x, w: expert_mlp.swiglu_mlp_xla(x, sizes, w, compute_dtype=jnp.float32, method="tiled"))
  y = expert_mlp.swiglu_mlp_bf16(x, sizes, weights, impl=impl)
  assert y.dtype == jnp.bfloat16 and not np.any(np.asarray(y, np.float32)[140:])
  ref = expert_mlp.swiglu_mlp_xla(x, sizes, weights, compute_dtype=jnp.float32, method="tiled")
  assert calc_diff(np.asarray(y, np.float32), ref) < 1e-4
  args = (x, weights.w_gate_up, weights.w_down)
  got = jax.jit(jax.grad(bf16, argnums=(0, 1, 2)))(*args)
  want = jax.jit(jax.grad(f32, argnums=(0, 1, 2)))(*args)
  for name, a, b in zip(("x", "w_gate_up", "w_down"), got, want):
    assert a.dtype == jnp.float32, name  # cotangents in the primals' dtype
    assert calc_diff(a, b) < 5e-4, name
  assert not np.any(np.asarray(got[0])[140:]) and not np.any(np.asarray(got[1])[1])


def _qdq_rows(v):
  """v [M, K] through the 1x128 quantizer and back, float32: what the FP8 GEMM multiplies."""
  q, sf = quant.quantize_fp8_blockwise(jnp.asarray(v, jnp.float32), impl="reference")
  return np.asarray(quant.dequantize_fp8_blockwise(q, sf, dtype=jnp.float32), np.float64)


@pytest.mark.parametrize("backward", ["fp8_dgrad", "fp8"])
@pytest.mark.parametrize("impl", ["ffi", "reference"])
def test_fp8_backward_is_the_fp8_data_gradient(impl, backward):
  """backward="fp8_dgrad" and "fp8": the data gradient is dx = Q(dh) @ W_gu and dh from g = Q(ct) @ W_dn and the
  kept Q(h), Q the 1x128 quantizer, W the forward's FP8 weights: against that product emulated in float64
  (calc_diff 1e-4: the bf16 rounding of g and dx, and dh's quantization where g rounded the other way); the weight
  gradients are the bf16
  GEMMs' ("fp8_dgrad", on the FP8 path's dh and on act recomputed from the kept Q(h)) or the FP8 weight-gradient
  GEMM's ("fp8"); against the float32 MLP every gradient is within FP8 error (calc_diff
  5e-3)."""
  from jax_moe_a2a import _ffi  # pylint: disable=import-outside-toplevel
  from jax_moe_a2a.testing import calc_diff  # pylint: disable=import-outside-toplevel
  if impl == "ffi" and not _ffi.available():
    pytest.skip("compiled extension not built")
  rng = np.random.default_rng(21)
  x = jnp.asarray(rng.standard_normal((300, HIDDEN)), jnp.bfloat16)
  sizes = jnp.asarray([120, 0, 170], jnp.int32)  # 10 rows no expert owns
  weights = _weights(21)
  ct = jnp.asarray(rng.standard_normal((300, HIDDEN)), jnp.float32)

  def loss(backward):
    def f(x, gu, dn):
      y = expert_mlp.swiglu_mlp_fp8(x, sizes, expert_mlp.ExpertWeights(gu, dn), impl=impl, backward=backward)
      return jnp.sum(y.astype(jnp.float32) * ct)
    return jax.jit(jax.grad(f, argnums=(0, 1, 2)))

  args = (x, weights.w_gate_up, weights.w_down)
  fp8, bf16 = loss(backward)(*args), loss("bf16")(*args)
  # The emulation: the forward's FP8 weights and its gate/up rows (as the forward's GEMM made them: the products
  # below are quantized again, so they must start from the same bits), then the two FP8 data-gradient products.
  gu_q, gu_sf = quant.quantize_fp8_weight(weights.w_gate_up, impl="reference")
  dn_q, dn_sf = quant.quantize_fp8_weight(weights.w_down, impl="reference")
  gu = np.asarray(quant.dequantize_fp8_weight(gu_q, gu_sf), np.float64)
  dn = np.asarray(quant.dequantize_fp8_weight(dn_q, dn_sf), np.float64)
  x_q, x_sf = quant.quantize_fp8_blockwise(x, impl="reference")
  h_all = grouped_gemm.grouped_gemm_fp8(x_q, x_sf, gu_q, gu_sf, sizes, impl="reference")
  h_all = jnp.asarray(_qdq_rows(np.asarray(h_all, np.float32)), jnp.float32)  # kept in FP8 for the backward
  ct_b = np.asarray(ct.astype(jnp.bfloat16), np.float32)  # the cotangent of the bf16 output
  want = np.zeros((300, HIDDEN))
  start = 0
  for e, n in enumerate(np.asarray(sizes)):
    rows = slice(start, start + n)
    g = np.asarray(jnp.asarray(_qdq_rows(ct_b[rows]) @ dn[e], jnp.bfloat16), np.float32)  # bf16 out
    dh = expert_mlp.swiglu_backward(h_all[rows], jnp.asarray(g)).astype(jnp.bfloat16)
    want[rows] = _qdq_rows(np.asarray(dh, np.float32)) @ gu[e]
    start += n
  got = np.asarray(fp8[0], np.float64)
  # Where the kernel's g or gate/up rows rounded to bf16 the other way than here, an element of dh quantizes to the
  # neighbouring E4M3 code (1/16 apart): rare, so the energy of the difference stays far below FP8's own error
  # (weights or activations not FP8 would give calc_diff ~1e-3 or more).
  assert calc_diff(got, want) < 1e-4
  assert not np.any(got[290:])
  assert not np.array_equal(np.asarray(fp8[0]), np.asarray(bf16[0]))  # the FP8 path is the one taken
  f32 = lambda x, gu, dn: jnp.sum(expert_mlp.swiglu_mlp_xla(x, sizes, expert_mlp.ExpertWeights(gu, dn),
                                                         compute_dtype=jnp.float32, method="tiled") * ct)
  ref = jax.jit(jax.grad(f32, argnums=(0, 1, 2)))(x.astype(jnp.float32), *args[1:])
  for name, a, b in zip(("x", "w_gate_up", "w_down"), fp8, ref):
    assert calc_diff(a, b) < 5e-3, name


@pytest.mark.parametrize("backward", ["bf16", "fp8_dgrad", "fp8"])
def test_weights_quantized_once_give_the_same_mlp(backward):
  """`swiglu_mlp_fp8` with the weights' FP8 forms made once (`quantize_weights`) gives its output and gradients
  without them, bit for bit; the float weights take the gradients."""
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.standard_normal((300, HIDDEN)), jnp.bfloat16)
  sizes = jnp.asarray([120, 0, 170], jnp.int32)
  weights = _weights(5)
  ct = jnp.asarray(rng.standard_normal((300, HIDDEN)), jnp.float32)
  q = expert_mlp.quantize_weights(weights, backward=backward)

  def run(quantized):
    def f(x, gu, dn):
      y = expert_mlp.swiglu_mlp_fp8(x, sizes, expert_mlp.ExpertWeights(gu, dn), backward=backward,
                                    quantized=quantized)
      return jnp.sum(y.astype(jnp.float32) * ct)
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(x, weights.w_gate_up, weights.w_down)

  base, got = run(None), run(q)
  for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(got)):
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
  assert np.any(np.asarray(got[1][1]) != 0) and np.any(np.asarray(got[1][2]) != 0)


def test_quantized_weights_refusals():
  """Quantized forms with FP8 weights, or on bf16 experts, are refused; so is quantizing FP8 weights."""
  from jax_moe_a2a import experts  # pylint: disable=import-outside-toplevel
  weights = _weights(0)
  q = expert_mlp.quantize_weights(weights)
  fp8 = expert_mlp.ExpertWeights.quantize(weights.w_gate_up, weights.w_down)
  x = jnp.zeros((4, HIDDEN), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"swiglu_mlp_fp8: quantized weights are for float expert weights; these are "
                                       r"FP8 already"):
    expert_mlp.swiglu_mlp_fp8(x, jnp.asarray([4, 0, 0], jnp.int32), fp8, quantized=q)
  with pytest.raises(ValueError, match=r"quantize_weights: weights are FP8 already"):
    expert_mlp.quantize_weights(fp8)
  ids = jnp.zeros((1, 4, 1), jnp.int32)
  with pytest.raises(ValueError, match=r"expert_stage: quantized_weights are the FP8 experts' \(precision 'fp8'\), "
                                       r"got precision 'dtype'"):
    experts.expert_stage(x[None], ids, jnp.ones((1, 4, 1), jnp.float32), weights, quantized_weights=q)


def test_an_unknown_backward_is_refused():
  x = jnp.zeros((4, HIDDEN), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"swiglu_mlp_fp8: backward must be one of bf16, fp8_dgrad, fp8, got 'fp4'"):
    expert_mlp.swiglu_mlp_fp8(x, jnp.asarray([4, 0, 0], jnp.int32), _weights(0), backward="fp4")


def test_kept_scale_exponents_give_back_the_quantizers_scales_bit_for_bit():
  """The FP8 backward keeps the gate/up rows' 1x128 scales as one exponent byte each: every scale the quantizer can
  make (all-zero, tiny, huge, NaN and infinite blocks included) comes back with its float32 bits, so the decoded
  gate/up rows are those of the float32 scales."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((8, 8 * quant.FP8_BLOCK)).astype(np.float32)
  x[0] = 0.0
  x[1] *= 1e-30
  x[2] *= 1e36
  x[3, 5], x[4, 200], x[5, 7] = np.nan, np.inf, 3.0e38
  x[6, :128] = np.finfo(np.float32).tiny
  q, sf = quant.quantize_fp8_blockwise(jnp.asarray(x), impl="reference")
  e = expert_mlp.scale_exponents(sf)
  assert e.dtype == jnp.uint8
  back = expert_mlp.scales_from_exponents(e)
  np.testing.assert_array_equal(np.asarray(back).view(np.uint32), np.asarray(sf).view(np.uint32))
  want = quant.dequantize_fp8_blockwise(q, sf, dtype=jnp.bfloat16)
  got = expert_mlp.gate_up_rows((q, e))
  np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))


@pytest.mark.parametrize("backward,limit_kib", [("fp8", 40), ("bf16", 72)])
def test_bytes_the_backward_keeps_per_token(backward, limit_kib):
  """What the expert stage keeps per token for its backward, at DeepSeek-V3's shapes (hidden 7168, ffn 2048, top-8):
  with the FP8 recipe at most 40 KiB (the received row's FP8 codes and scales, the k gate/up rows' codes and scale
  exponents, routing and permutation indices), against 71.4 KiB with the bf16 backward's bfloat16 gate/up rows. The
  per-token part of the VJP's residuals, from their shapes at two token counts."""
  from jax_moe_a2a import experts  # pylint: disable=import-outside-toplevel
  hidden, ffn, top_k, num_experts = 7168, 2048, 8, 32
  sds = jax.ShapeDtypeStruct

  def kept_bytes(tokens):
    ids = jnp.zeros((1, tokens, top_k), jnp.int32)

    def vjp_of(x, w, gu, dn):
      stage = lambda x, w, gu, dn: experts.expert_stage(x, ids, w, expert_mlp.ExpertWeights(gu, dn),
                                                        precision="fp8", backward=backward, impl="reference")
      return jax.vjp(stage, x, w, gu, dn)[1]

    residuals = jax.eval_shape(vjp_of, sds((1, tokens, hidden), jnp.bfloat16), sds((1, tokens, top_k), jnp.float32),
                               sds((num_experts, 2 * ffn, hidden), jnp.bfloat16),
                               sds((num_experts, hidden, ffn), jnp.bfloat16))
    return sum(r.size * r.dtype.itemsize for r in jax.tree.leaves(residuals))

  per_token = (kept_bytes(2048) - kept_bytes(1024)) / 1024
  assert per_token <= limit_kib * 1024, per_token / 1024
