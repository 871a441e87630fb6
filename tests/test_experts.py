"""Tests of the expert stage (jax_moe_a2a.experts; its MLPs are tested in test_expert_mlp.py) against a
loop-by-loop float64 NumPy oracle.

With float32 compute the stage differs from the oracle only by float32 rounding: ``max |err| <= 1e-5 *
max |ref|`` (observed ~1e-7). FP8 weights and FP8 rows are compared with an oracle that uses the same
dequantized values, so the same bound holds. Matmuls run at full float32 precision (on GPUs XLA's default
precision for float32 matmuls is lower).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe_a2a import expert_mlp, experts, quant

HIDDEN, FFN, LOCAL, TOP_K = 256, 128, 3, 4
TOL = 1e-5


@pytest.fixture(autouse=True)
def _float32_matmuls():
  with jax.default_matmul_precision("highest"):
    yield


def _max_rel(x, y):
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  return float(np.max(np.abs(x - y)) / np.max(np.abs(y)))


def _layout(seed, num_ranks=2, capacity=10, num_local=LOCAL, top_k=TOP_K, padding=3):
  """A receive layout: random rows, local ids with -1 (other ranks' experts), and all-padding rows at the end."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((num_ranks, capacity, HIDDEN)).astype(np.float32)
  ids = rng.integers(-1, num_local, size=(num_ranks, capacity, top_k)).astype(np.int32)
  w = rng.random((num_ranks, capacity, top_k)).astype(np.float32)
  ids[:, capacity - padding:] = -1
  w[ids < 0] = 0.0
  x[:, capacity - padding:] = 0.0
  return x, ids, w


def _weights(seed, num_local=LOCAL):
  rng = np.random.default_rng(100 + seed)
  gu = (rng.standard_normal((num_local, 2 * FFN, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32)
  dn = (rng.standard_normal((num_local, HIDDEN, FFN)) / np.sqrt(FFN)).astype(np.float32)
  return expert_mlp.ExpertWeights(jnp.asarray(gu), jnp.asarray(dn))


def _oracle(x, ids, w, weights):
  """Per row: sum over k with a valid local id of w * down(silu(gate(x)) * up(x)), in float64."""
  gu, dn = (np.asarray(a, np.float64) for a in weights.dequantized(jnp.float32))
  x = np.asarray(x, np.float64)
  out = np.zeros(x.shape)
  silu = lambda v: v / (1.0 + np.exp(-v))
  for r in range(x.shape[0]):
    for j in range(x.shape[1]):
      for k in range(ids.shape[2]):
        e = ids[r, j, k]
        if 0 <= e < gu.shape[0]:
          h = gu[e] @ x[r, j]
          out[r, j] += w[r, j, k] * (dn[e] @ (silu(h[:FFN]) * h[FFN:]))
  return out


@pytest.mark.parametrize("method", ["tiled", "ragged_dot", "auto"])
def test_expert_stage_matches_loop_oracle(method):
  x, ids, w = _layout(0)
  weights = _weights(0)
  fn = jax.jit(lambda x, ids, w, wt: experts.expert_stage(x, ids, w, wt, out_dtype=jnp.float32,
                                                          compute_dtype=jnp.float32, method=method))
  out = np.asarray(fn(x, ids, w, weights))
  want = _oracle(x, ids, w, weights)
  assert out.shape == x.shape and out.dtype == np.float32
  assert _max_rel(out, want) <= TOL


@pytest.mark.parametrize("num,num_keys", [(1, 3), (37, 5), (4096, 33), (4100, 9), (5000, 300)])
@pytest.mark.parametrize("by_comparison", [True, False])
def test_sorted_positions_are_a_stable_sort_both_ways(num, num_keys, by_comparison, monkeypatch):
  """Counted by comparing pairs (small sizes) or by a sort: both are numpy's stable argsort, with many ties."""
  monkeypatch.setattr(experts, "_RANK_BY_COMPARISON_MAX", 1 << 30 if by_comparison else 0)
  key = np.random.default_rng(num).integers(0, num_keys, num).astype(np.int32)
  order, pos = jax.jit(lambda k: experts._sorted_positions(k, num_keys))(jnp.asarray(key))
  want = np.argsort(key, kind="stable")
  np.testing.assert_array_equal(np.asarray(order), want)
  np.testing.assert_array_equal(np.asarray(pos)[want], np.arange(num))


def test_padding_rows_give_exact_zeros_even_with_garbage_rows():
  x, ids, w = _layout(1, padding=4)
  x[:, -4:] = 1e4  # a padding row's content must not matter: every id is -1
  out = np.asarray(jax.jit(lambda *a: experts.expert_stage(*a, out_dtype=jnp.float32, compute_dtype=jnp.float32))(
      x, ids, w, _weights(1)))
  np.testing.assert_array_equal(out[:, -4:], 0.0)
  assert np.all(np.abs(out[:, :-4]).sum(-1)[(ids[:, :-4] >= 0).any(-1)] > 0)


def test_fp8_weights_and_fp8_rows():
  x, ids, w = _layout(2)
  dense = _weights(2)
  weights = expert_mlp.ExpertWeights.quantize(dense.w_gate_up, dense.w_down)
  assert weights.is_fp8 and weights.w_gate_up.dtype == jnp.float8_e4m3fn
  assert weights.w_gate_up_sf.shape == (LOCAL, 2 * FFN // 128, HIDDEN // 128)
  x_q, x_sf = quant.quantize_fp8_blockwise(jnp.asarray(x.reshape(-1, HIDDEN)))
  x_q, x_sf = x_q.reshape(x.shape), x_sf.reshape(x.shape[:2] + (HIDDEN // 128,))
  fn = jax.jit(lambda *a, x_sf: experts.expert_stage(*a, recv_x_sf=x_sf, out_dtype=jnp.float32,
                                                     compute_dtype=jnp.float32))
  out = np.asarray(fn(x_q, ids, w, weights, x_sf=x_sf))
  x_deq = np.asarray(quant.dequantize_fp8_blockwise(x_q.reshape(-1, HIDDEN), x_sf.reshape(-1, HIDDEN // 128)))
  want = _oracle(x_deq.reshape(x.shape), ids, w, weights)
  assert _max_rel(out, want) <= TOL
  # The FP8 path really quantizes: the result differs from the unquantized one.
  assert _max_rel(out, _oracle(x, ids, w, dense)) > 1e-3


@pytest.mark.parametrize("impl", ["reference", "ffi"])
def test_fp8_experts_take_fp8_rows_as_they_are(impl):
  """With FP8 experts, FP8 rows and their decoded floats give the same bits (1x128 requantization of decoded
  power-of-two-scaled rows is exact), and both stay close to the float32 oracle of the decoded rows."""
  if impl == "ffi":
    pytest.importorskip("jax_moe_a2a._jax_moe_a2a")
  x, ids, w = _layout(3)
  weights = _weights(3)
  x_q, x_sf = quant.quantize_fp8_blockwise(jnp.asarray(x.reshape(-1, HIDDEN)), impl="reference")
  x_deq = quant.dequantize_fp8_blockwise(x_q, x_sf).reshape(x.shape)
  x_q, x_sf = x_q.reshape(x.shape), x_sf.reshape(x.shape[:2] + (HIDDEN // 128,))
  stage = jax.jit(lambda x, ids, w, wt, x_sf=None: experts.expert_stage(
      x, ids, w, wt, recv_x_sf=x_sf, out_dtype=jnp.float32, precision="fp8", impl=impl))
  direct = np.asarray(stage(x_q, ids, w, weights, x_sf=x_sf))
  decoded = np.asarray(stage(x_deq, ids, w, weights))
  np.testing.assert_array_equal(direct, decoded)
  want = _oracle(np.asarray(x_deq), ids, w, weights)
  assert 1.0 - 2.0 * np.sum(direct * want) / np.sum(direct ** 2 + want ** 2) < 3e-3


@pytest.mark.parametrize("impl", ["reference", "ffi"])
def test_fp8_experts_compute_from_wire_codes_and_give_the_decoded_rows_the_gradient(impl):
  """With wire_codes, the FP8 experts compute from the codes that arrived (the same bits as FP8 rows given as
  they are; the decoded rows' values are not read, so even NaN rows change nothing), and the decoded rows get
  the straight-through gradient of the run without codes, up to the bf16 rounding of the decode."""
  if impl == "ffi":
    pytest.importorskip("jax_moe_a2a._jax_moe_a2a")
  x, ids, w = _layout(5)
  weights = _weights(5)
  x_q, x_sf = quant.quantize_fp8_blockwise(jnp.asarray(x.reshape(-1, HIDDEN)), impl="reference")
  rows = quant.dequantize_fp8_blockwise(x_q, x_sf, dtype=jnp.bfloat16).reshape(x.shape)  # rounds
  codes = (x_q.reshape(x.shape), x_sf.reshape(x.shape[:2] + (HIDDEN // 128,)))

  def stage(rows, codes=None, x_sf=None):
    return experts.expert_stage(rows, ids, w, weights, recv_x_sf=x_sf, wire_codes=codes, out_dtype=jnp.float32,
                                precision="fp8", impl=impl)

  with_codes = np.asarray(jax.jit(stage)(rows, codes))
  np.testing.assert_array_equal(with_codes, np.asarray(jax.jit(stage)(codes[0], x_sf=codes[1])))
  np.testing.assert_array_equal(with_codes, np.asarray(jax.jit(stage)(jnp.full_like(rows, jnp.nan), codes)))
  ct = jnp.asarray(np.random.default_rng(6).standard_normal(with_codes.shape).astype(np.float32))
  grad = lambda codes: jax.jit(jax.grad(lambda r: jnp.sum(stage(r, codes) * ct)))(rows)
  g_codes, g_plain = np.asarray(grad(codes), np.float32), np.asarray(grad(None), np.float32)
  assert np.abs(g_codes).max() > 0
  assert 1.0 - 2.0 * np.sum(g_codes * g_plain) / np.sum(g_codes ** 2 + g_plain ** 2) < 1e-4


@pytest.mark.parametrize("bad, match", [
    (lambda q, sf: (q[:, :-1], sf), "wire_codes must be"),
    (lambda q, sf: (q.astype(jnp.bfloat16), sf), "wire_codes must be"),
    (lambda q, sf: (q, sf.astype(jnp.bfloat16)), "wire_codes must be"),
])
def test_wire_codes_of_another_shape_or_dtype_are_refused(bad, match):
  x, ids, w = _layout(5)
  x_q, x_sf = quant.quantize_fp8_blockwise(jnp.asarray(x.reshape(-1, HIDDEN)), impl="reference")
  codes = bad(x_q.reshape(x.shape), x_sf.reshape(x.shape[:2] + (HIDDEN // 128,)))
  with pytest.raises(ValueError, match=match):
    experts.expert_stage(jnp.asarray(x), ids, w, _weights(5), wire_codes=codes, precision="fp8", impl="reference")


def test_bf16_compute_is_close():
  x, ids, w = _layout(4)
  weights = _weights(4)
  out = jax.jit(lambda *a: experts.expert_stage(*a))(jnp.asarray(x, jnp.bfloat16), ids, w, weights)
  assert out.dtype == jnp.bfloat16
  assert _max_rel(np.asarray(out, np.float32), _oracle(x, ids, w, weights)) <= 3e-2


@pytest.mark.parametrize("case,error,match", [
    ("recv_x_rank", ValueError, r"expert_stage: recv_x must be \[num_ranks, capacity, hidden\], got shape"),
    ("ids_shape", ValueError, r"expert_stage: recv_topk_ids must be \[num_ranks, capacity, top_k\]"),
    ("ids_dtype", TypeError, r"expert_stage: recv_topk_ids must be int32, got int16"),
    ("weights_shape", ValueError, r"expert_stage: recv_topk_weights must have the shape of recv_topk_ids"),
    ("w_down_shape", ValueError, r"expert_stage: w_down must be \[num_local_experts, hidden, ffn\]"),
    ("w_gate_up_hidden", ValueError, r"expert_stage: w_gate_up must be \[num_local_experts, 2 \* ffn, hidden=256\]"),
    ("fp8_rows_without_scales", ValueError, r"expert_stage: float8_e4m3fn recv_x needs recv_x_sf"),
    ("method", ValueError, r"swiglu_mlp_xla: method must be one of auto, ragged_dot, tiled, got 'cutlass'"),
    ("no_ffn", ValueError, r"expert_stage: ffn must be a positive multiple of 8, got 0"),
])
def test_errors(case, error, match):
  x, ids, w = _layout(5)
  weights = _weights(5)
  kwargs = {}
  if case == "recv_x_rank":
    x = x[0]
  elif case == "ids_shape":
    ids = ids[:, :5]
  elif case == "ids_dtype":
    ids = ids.astype(np.int16)
  elif case == "weights_shape":
    w = w[..., :2]
  elif case == "w_down_shape":
    weights = expert_mlp.ExpertWeights(weights.w_gate_up, weights.w_down[:, :, :64])
  elif case == "w_gate_up_hidden":
    weights = expert_mlp.ExpertWeights(weights.w_gate_up[:, :, :128], weights.w_down)
  elif case == "fp8_rows_without_scales":
    x = jnp.asarray(x).astype(jnp.float8_e4m3fn)
  elif case == "method":
    kwargs["method"] = "cutlass"
  elif case == "no_ffn":  # bf16 compute on the grouped GEMMs (the default)
    weights = expert_mlp.ExpertWeights(weights.w_gate_up[:, :0], weights.w_down[:, :, :0])
  with pytest.raises(error, match=match):
    experts.expert_stage(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w), weights, **kwargs)


def _dense_jax_oracle(x, ids, w, w_gu, w_dn):
  """The stage written densely in float32 JAX (every expert on every row, masked): differentiable by plain
  autodiff, sharing no code with the stage's permutation, grouped GEMMs or custom VJPs."""
  ffn = w_dn.shape[-1]
  h = jnp.einsum("rch,efh->rcef", x, w_gu)
  y = jnp.einsum("rcef,ehf->rceh", jax.nn.silu(h[..., :ffn]) * h[..., ffn:], w_dn)  # [R, C, E, H]
  onehot = (ids[..., None] == jnp.arange(w_gu.shape[0])).astype(jnp.float32)  # [R, C, K, E]
  return jnp.einsum("rcke,rck,rceh->rch", onehot, w, y)


@pytest.mark.parametrize("compute_dtype, impl", [(jnp.float32, "auto"), (jnp.bfloat16, "ffi"),
                                                 (jnp.bfloat16, "reference")])
def test_expert_stage_gradients_match_dense_autodiff(compute_dtype, impl):
  """Gradients of rows, routing weights and expert weights through the permutation's gather-only VJPs and the
  grouped MLP (float32: tiled reference; bfloat16: the bf16 grouped GEMMs, custom call or reference) against plain
  autodiff of a dense float32 oracle. Tolerance: float32 1e-5 max relative; bfloat16 calc_diff 5e-4 (bf16 operands)."""
  from jax_moe_a2a import _ffi  # pylint: disable=import-outside-toplevel
  if impl == "ffi" and not _ffi.available():
    pytest.skip("compiled extension not built")
  x, ids, w = _layout(7)
  weights = _weights(7)
  ct = np.random.default_rng(8).standard_normal(x.shape).astype(np.float32)

  def stage(x, w, gu, dn):
    out = experts.expert_stage(x, jnp.asarray(ids), w, expert_mlp.ExpertWeights(gu, dn), out_dtype=jnp.float32,
                               compute_dtype=compute_dtype, impl=impl)
    return jnp.sum(out * ct)

  def dense(x, w, gu, dn):
    return jnp.sum(_dense_jax_oracle(x, jnp.asarray(ids), w, gu, dn) * ct)

  args = (jnp.asarray(x), jnp.asarray(w), weights.w_gate_up, weights.w_down)
  got = jax.jit(jax.grad(stage, argnums=(0, 1, 2, 3)))(*args)
  want = jax.jit(jax.grad(dense, argnums=(0, 1, 2, 3)))(*args)
  for name, a, b in zip(("x", "weights", "w_gate_up", "w_down"), got, want):
    assert a.shape == b.shape and a.dtype == b.dtype, name
    if compute_dtype == jnp.float32:
      assert _max_rel(a, b) < TOL, name
    else:
      from jax_moe_a2a.testing import calc_diff  # pylint: disable=import-outside-toplevel
      assert calc_diff(a, b) < 5e-4, name
  # Padding rows and assignments of no local expert get exactly zero gradient.
  assert not np.any(np.asarray(got[0])[:, -3:]) and not np.any(np.asarray(got[1])[ids < 0])


@pytest.mark.parametrize("precision", ["dtype", "fp8"])
def test_grouped_gemm_experts_save_each_row_once_and_no_expert_output(precision):
  """For the backward pass the bf16 and FP8 grouped-GEMM experts keep the received rows once (bf16, or FP8 codes)
  and the gate/up rows: neither the rows expanded to one per assignment nor the expert outputs ([A, hidden],
  A = rows * top_k), which the backward makes again or does without."""
  x, ids, w = _layout(10)
  weights = _weights(10)
  num_rows = x.shape[0] * x.shape[1]

  def stage(x, w, gu, dn):
    return experts.expert_stage(x, jnp.asarray(ids), w, expert_mlp.ExpertWeights(gu, dn), out_dtype=jnp.float32,
                                precision=precision, impl="reference")

  args = (jnp.asarray(x, jnp.bfloat16), jnp.asarray(w), weights.w_gate_up, weights.w_down)
  _, vjp = jax.vjp(stage, *args)
  saved = [tuple(a.shape) for a in jax.tree_util.tree_leaves(vjp)]  # what the backward pass holds
  assert (num_rows * TOP_K, 2 * FFN) in saved  # the gate/up rows
  assert (num_rows, HIDDEN) in saved  # the rows, once
  assert not [s for s in saved if len(s) == 2 and s[0] == num_rows * TOP_K and s[1] != 2 * FFN], saved


@pytest.mark.parametrize("backward,fp8_weights", [("fp8_dgrad", False), ("fp8_dgrad", True), ("fp8", False)])
def test_expert_stage_fp8_backward_gradients_match_dense_autodiff(backward, fp8_weights):
  """The expert pass with backward="fp8_dgrad" or "fp8" (the layer's FP8 path) against plain autodiff of the dense
  float32 oracle at the same (dequantized) weights: calc_diff 5e-3 for every gradient; padding gets exact zeros."""
  from jax_moe_a2a.testing import calc_diff  # pylint: disable=import-outside-toplevel
  x, ids, w = _layout(23, capacity=40)
  weights = _weights(23)
  if fp8_weights:
    weights = expert_mlp.ExpertWeights.quantize(weights.w_gate_up, weights.w_down)
  ct = np.random.default_rng(24).standard_normal(x.shape).astype(np.float32)

  def stage(backward):
    def f(x, w, gu, dn):
      wt = expert_mlp.ExpertWeights(gu, dn, weights.w_gate_up_sf, weights.w_down_sf)
      out = experts.expert_stage(x, jnp.asarray(ids), w, wt, out_dtype=jnp.float32, precision="fp8",
                                 backward=backward)
      return jnp.sum(out * ct)
    return f

  def dense(x, w, gu, dn):
    return jnp.sum(_dense_jax_oracle(x, jnp.asarray(ids), w, gu, dn) * ct)

  argnums = (0, 1) if fp8_weights else (0, 1, 2, 3)
  args = (jnp.asarray(x), jnp.asarray(w), weights.w_gate_up, weights.w_down)
  got = jax.jit(jax.grad(stage(backward), argnums=argnums))(*args)
  bf16 = jax.jit(jax.grad(stage("bf16"), argnums=argnums))(*args)
  gu, dn = weights.dequantized(jnp.float32)
  want = jax.jit(jax.grad(dense, argnums=argnums))(*args[:2], gu, dn)
  for name, a, b in zip(("x", "weights", "w_gate_up", "w_down"), got, want):
    assert a.shape == b.shape and a.dtype == b.dtype, name
    assert calc_diff(a, b) < 5e-3, name
  assert not np.array_equal(np.asarray(got[0]), np.asarray(bf16[0]))
  assert not np.any(np.asarray(got[0])[:, -3:]) and not np.any(np.asarray(got[1])[ids < 0])


def test_the_fp8_backward_keeps_rows_and_gate_up_rows_in_fp8():
  """With backward="fp8" the expert pass keeps, per received row, its FP8 codes and 1x128 scales, and per
  assignment the gate/up rows as FP8 codes and their scales' exponent bytes: no bfloat16 or float32 [A, 2 ffn]
  tensor."""
  x, ids, w = _layout(10)
  weights = _weights(10)
  num_rows, a = x.shape[0] * x.shape[1], x.shape[0] * x.shape[1] * TOP_K

  def stage(x, w, gu, dn):
    return experts.expert_stage(x, jnp.asarray(ids), w, expert_mlp.ExpertWeights(gu, dn), out_dtype=jnp.float32,
                                precision="fp8", impl="reference", backward="fp8")

  _, vjp = jax.vjp(stage, jnp.asarray(x, jnp.bfloat16), jnp.asarray(w), weights.w_gate_up, weights.w_down)
  saved = {(tuple(l.shape), jnp.dtype(l.dtype).name) for l in jax.tree_util.tree_leaves(vjp)}
  assert ((a, 2 * FFN), "float8_e4m3fn") in saved and ((a, 2 * FFN // 128), "uint8") in saved
  assert ((num_rows, HIDDEN), "float8_e4m3fn") in saved and ((num_rows, HIDDEN // 128), "float32") in saved
  assert not [s for s in saved if s[0] == (a, 2 * FFN) and s[1] != "float8_e4m3fn"], saved


def test_the_deprecated_gemm_impl_means_fp8_experts_with_a_warning():
  """gemm_impl=X (the old spelling) warns, naming precision, and runs exactly the FP8 experts of precision="fp8"."""
  x, ids, w = _layout(12)
  weights = _weights(12)
  args = (jnp.asarray(x, jnp.bfloat16), jnp.asarray(ids), jnp.asarray(w), weights)
  want = experts.expert_stage(*args, precision="fp8", impl="reference")
  with pytest.warns(DeprecationWarning, match=r"expert_stage: gemm_impl is deprecated: use precision='fp8'"):
    got = experts.expert_stage(*args, gemm_impl="reference", impl="reference")
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  assert not np.array_equal(np.asarray(want, np.float32),
                            np.asarray(experts.expert_stage(*args, impl="reference"), np.float32))


@pytest.mark.parametrize("kwargs, match", [
    (dict(precision="bf16"), r"expert_stage: precision must be one of 'dtype', 'fp8', got 'bf16'"),
    (dict(gemm_impl="cutlass"), r"expert_stage: gemm_impl \(deprecated: use precision='fp8'\) must be None or one of "
                                r"auto, ffi, reference, got 'cutlass'"),
])
def test_an_unknown_precision_is_refused(kwargs, match):
  x, ids, w = _layout(0)
  with pytest.raises(ValueError, match=match):
    experts.expert_stage(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w), _weights(0), **kwargs)

