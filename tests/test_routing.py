"""Tests for jax_moe_a2a.routing: top-k routers against NumPy references, placement, load and aux loss."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from conftest import devices
from jax_moe_a2a import routing
from jax_moe_a2a.routing import INVALID_EXPERT, RouterConfig

# ----------------------------------------------------------------------------------------------------------------
# NumPy references (float64, written independently of the JAX code: per-token loops and stable sorts)
# ----------------------------------------------------------------------------------------------------------------


def _np_desc_order(values):
  """Indices by descending value, ties toward the lower index."""
  return sorted(range(len(values)), key=lambda i: (-values[i], i))


def _np_topk_softmax(logits, top_k, renormalize):
  logits = np.asarray(logits, np.float64)
  num_tokens = logits.shape[0]
  weights = np.zeros((num_tokens, top_k))
  ids = np.zeros((num_tokens, top_k), np.int64)
  for t in range(num_tokens):
    z = np.exp(logits[t] - logits[t].max())
    probs = z / z.sum()
    chosen = _np_desc_order(logits[t])[:top_k]
    w = probs[chosen]
    weights[t] = w / w.sum() if renormalize else w
    ids[t] = chosen
  return weights, ids


def _np_group_scores(choice_row, n_group):
  group_size = len(choice_row) // n_group
  return [sum(sorted(choice_row[g * group_size:(g + 1) * group_size], reverse=True)[:2]) for g in range(n_group)]


def _np_best_groups(choice_row, n_group, topk_group):
  return set(_np_desc_order(_np_group_scores(choice_row, n_group))[:topk_group])


def _np_grouped_sigmoid(logits, top_k, bias, n_group, topk_group, renormalize, scale):
  logits = np.asarray(logits, np.float64)
  num_tokens, num_experts = logits.shape
  group_size = num_experts // n_group
  scores = 1.0 / (1.0 + np.exp(-logits))
  choice = scores + (0.0 if bias is None else np.asarray(bias, np.float64)[None, :])
  weights = np.zeros((num_tokens, top_k))
  ids = np.zeros((num_tokens, top_k), np.int64)
  for t in range(num_tokens):
    best = _np_best_groups(list(choice[t]), n_group, topk_group)
    candidates = [e for e in range(num_experts) if e // group_size in best]
    chosen = sorted(candidates, key=lambda e: (-choice[t, e], e))[:top_k]
    w = scores[t, chosen]
    if renormalize:
      w = w / w.sum()
    weights[t] = w * scale
    ids[t] = chosen
  return weights, ids


def _normal(seed, *shape, dtype=np.float32):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32).astype(dtype)


def _logits(seed, num_tokens, num_experts, dtype=np.float32):
  return _normal(seed, num_tokens, num_experts, dtype=dtype)


# Jitted entry points: one compile per configuration instead of one per eager primitive keeps the suite fast.
_softmax = jax.jit(routing.topk_softmax, static_argnums=1, static_argnames=("renormalize",))
_grouped = jax.jit(routing.topk_grouped_sigmoid, static_argnums=1,
                   static_argnames=("n_group", "topk_group", "renormalize", "routed_scaling_factor"))
_loss = jax.jit(routing.load_balance_loss, static_argnums=2)
_load = jax.jit(routing.expert_load, static_argnums=1)


# ----------------------------------------------------------------------------------------------------------------
# Softmax top-k
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_experts,top_k,renormalize",
                         [(8, 1, True), (16, 4, False), (64, 8, True), (5, 5, True)])
def test_topk_softmax_matches_numpy(num_experts, top_k, renormalize):
  logits = _logits(0, 64, num_experts)
  weights, ids = jax.jit(routing.topk_softmax, static_argnums=1, static_argnames="renormalize")(
      logits, top_k, renormalize=renormalize)
  assert weights.shape == (64, top_k) and weights.dtype == jnp.float32
  assert ids.shape == (64, top_k) and ids.dtype == jnp.int32
  ref_w, ref_ids = _np_topk_softmax(logits, top_k, renormalize)
  np.testing.assert_array_equal(np.asarray(ids), ref_ids)
  np.testing.assert_allclose(np.asarray(weights), ref_w, rtol=1e-5, atol=1e-7)
  # Ids come in descending order of probability.
  assert np.all(np.diff(np.asarray(weights), axis=-1) <= 0)
  sums = np.asarray(weights).sum(-1)
  if renormalize:
    np.testing.assert_allclose(sums, 1.0, rtol=1e-6)
  elif top_k < num_experts:
    assert np.all(sums < 1.0)


def test_topk_softmax_bf16_logits_computes_in_float32():
  logits = _logits(1, 32, 16, jnp.bfloat16)
  weights, ids = _softmax(logits, 3, renormalize=False)
  assert weights.dtype == jnp.float32
  ref_w, ref_ids = _np_topk_softmax(np.asarray(logits.astype(jnp.float32)), 3, False)
  np.testing.assert_array_equal(np.asarray(ids), ref_ids)
  np.testing.assert_allclose(np.asarray(weights), ref_w, rtol=1e-5)


def test_topk_softmax_breaks_ties_toward_lower_id():
  logits = jnp.array([[1.0, 3.0, 3.0, 0.0, 3.0, 3.0],
                      [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                      [2.0, 5.0, 2.0, 2.0, 5.0, 2.0]])
  weights, ids = _softmax(logits, 3)
  np.testing.assert_array_equal(np.asarray(ids), [[1, 2, 4], [0, 1, 2], [1, 4, 0]])
  np.testing.assert_allclose(np.asarray(weights)[1], [1 / 3] * 3, rtol=1e-6)


def test_topk_softmax_ties_at_scale_under_jit():
  # Small integer logits: nearly every row has ties across the top-k boundary.
  logits = np.random.default_rng(2).integers(0, 4, (512, 64)).astype(np.float32)
  _, ids = _softmax(logits, 8)
  _, ref_ids = _np_topk_softmax(logits, 8, True)
  np.testing.assert_array_equal(np.asarray(ids), ref_ids)


# ----------------------------------------------------------------------------------------------------------------
# DeepSeek-V3 grouped sigmoid top-k
# ----------------------------------------------------------------------------------------------------------------

GROUPED_CASES = [
    # num_experts, top_k, n_group, topk_group, with_bias
    (16, 4, 4, 2, False),
    (16, 4, 4, 2, True),
    (64, 8, 8, 4, True),  # DeepSeek-V3's 8/4 grouping, scaled down
    (32, 6, 8, 3, True),
    (8, 2, 1, 1, True),  # ungrouped
    (8, 3, 4, 4, True),  # all groups kept
    (8, 2, 8, 2, True),  # one expert per group: group score is that expert's
]


@pytest.mark.parametrize("num_experts,top_k,n_group,topk_group,with_bias", GROUPED_CASES)
def test_grouped_sigmoid_matches_numpy(num_experts, top_k, n_group, topk_group, with_bias):
  logits = _logits(3, 128, num_experts)
  bias = 0.3 * _normal(4, num_experts) if with_bias else None
  weights, ids = _grouped(logits, top_k, bias=bias, n_group=n_group, topk_group=topk_group)
  assert weights.dtype == jnp.float32 and ids.dtype == jnp.int32 and ids.shape == (128, top_k)
  ref_w, ref_ids = _np_grouped_sigmoid(logits, top_k, bias, n_group, topk_group, True, 1.0)
  np.testing.assert_array_equal(np.asarray(ids), ref_ids)
  np.testing.assert_allclose(np.asarray(weights), ref_w, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("num_experts,top_k,n_group,topk_group", [(16, 4, 4, 2), (64, 8, 8, 4)])
def test_grouped_sigmoid_chooses_only_from_best_groups(num_experts, top_k, n_group, topk_group):
  logits = _logits(5, 128, num_experts)
  bias = 0.5 * _normal(6, num_experts)
  _, ids = _grouped(logits, top_k, bias=bias, n_group=n_group, topk_group=topk_group)
  choice = 1.0 / (1.0 + np.exp(-np.asarray(logits, np.float64))) + np.asarray(bias, np.float64)
  group_size = num_experts // n_group
  ids = np.asarray(ids)
  for t in range(ids.shape[0]):
    best = _np_best_groups(list(choice[t]), n_group, topk_group)
    assert {int(e) // group_size for e in ids[t]} <= best, t
  # The restriction bites: an unrestricted top-k would often pick an expert outside the kept groups.
  _, free_ids = _grouped(logits, top_k, bias=bias)
  assert np.any(np.sort(np.asarray(free_ids), -1) != np.sort(ids, -1))


def test_grouped_sigmoid_group_limit_excludes_best_single_expert():
  # Groups of 2: g0 = {0: very high, 1: very low} (top-2 sum ~1.0), g1 = {2, 3} ~1.76, g2 = {4, 5} ~1.63,
  # g3 = {6, 7} low. Keeping 2 groups drops g0, so expert 0 (the best single score) is not chosen.
  logits = jnp.array([[5.0, -5.0, 2.0, 1.9, 1.5, 1.6, -3.0, -3.0]])
  _, ids = _grouped(logits, 3, n_group=4, topk_group=2)
  np.testing.assert_array_equal(np.asarray(ids), [[2, 3, 5]])
  _, ungrouped = _grouped(logits, 3)
  np.testing.assert_array_equal(np.asarray(ungrouped), [[0, 2, 3]])


def test_grouped_sigmoid_excluded_groups_lose_to_negative_choices():
  # A negative bias makes every score + bias negative. Excluded groups must still lose (masked to -inf, not 0).
  logits = np.zeros((1, 8), np.float32)
  bias = np.array([-1.0, -1.1, -1.2, -1.3, -2.0, -2.0, -2.0, -2.0], np.float32)
  _, ids = _grouped(logits, 3, bias=bias, n_group=4, topk_group=2)
  np.testing.assert_array_equal(np.asarray(ids), [[0, 1, 2]])


def test_grouped_sigmoid_bias_changes_choice_but_not_weights():
  logits = jnp.array([[3.0, 2.0, 0.0, 0.0, -1.0, -1.5, 0.5, 0.2]])
  bias = jnp.array([0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
  _, ids0 = _grouped(logits, 2, n_group=2, topk_group=1)
  np.testing.assert_array_equal(np.asarray(ids0), [[0, 1]])
  weights, ids = _grouped(logits, 2, bias=bias, n_group=2, topk_group=1, renormalize=False)
  # With the bias, group 1 ({4..7}) wins and experts 4, 5 lead it; the weights are their unbiased scores.
  np.testing.assert_array_equal(np.asarray(ids), [[4, 5]])
  sig = 1.0 / (1.0 + np.exp(-np.array([-1.0, -1.5])))
  np.testing.assert_allclose(np.asarray(weights), [sig], rtol=1e-6)


def test_grouped_sigmoid_random_bias_changes_many_choices():
  logits = _logits(7, 128, 16)
  bias = _normal(8, 16)
  _, ids_plain = _grouped(logits, 4, n_group=4, topk_group=2)
  _, ids_bias = _grouped(logits, 4, bias=bias, n_group=4, topk_group=2)
  assert np.mean(np.any(np.asarray(ids_plain) != np.asarray(ids_bias), -1)) > 0.5


def test_grouped_sigmoid_without_bias_equals_zero_bias():
  logits = _logits(9, 128, 16)
  a = _grouped(logits, 4, n_group=4, topk_group=2)
  b = _grouped(logits, 4, bias=jnp.zeros(16), n_group=4, topk_group=2)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_grouped_sigmoid_routed_scaling_factor():
  logits = _logits(10, 128, 16)
  bias = 0.2 * _normal(11, 16)
  kwargs = dict(bias=bias, n_group=4, topk_group=2)
  w1, ids1 = _grouped(logits, 4, **kwargs)
  w25, ids25 = _grouped(logits, 4, routed_scaling_factor=2.5, **kwargs)
  np.testing.assert_array_equal(np.asarray(ids1), np.asarray(ids25))
  np.testing.assert_allclose(np.asarray(w25), 2.5 * np.asarray(w1), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(w25).sum(-1), 2.5, rtol=1e-6)  # scaled after renormalization
  ref_w, _ = _np_grouped_sigmoid(logits, 4, bias, 4, 2, True, 2.5)
  np.testing.assert_allclose(np.asarray(w25), ref_w, rtol=1e-5)
  # Without renormalization the raw sigmoid scores are scaled.
  w_raw, ids_raw = _grouped(logits, 4, routed_scaling_factor=2.5, renormalize=False, **kwargs)
  np.testing.assert_array_equal(np.asarray(ids_raw), np.asarray(ids1))
  ref_w, _ = _np_grouped_sigmoid(logits, 4, bias, 4, 2, False, 2.5)
  np.testing.assert_allclose(np.asarray(w_raw), ref_w, rtol=1e-5)


def test_grouped_sigmoid_ties_toward_lower_ids_and_groups():
  logits = np.array([
      [0.0] * 16,  # all equal: group 0 is kept, experts 0..3 tie and come in id order
      [0.0] * 4 + [1.0] * 4 + [0.0] * 4 + [1.0] * 4,  # groups 1 and 3 tie for best: group 1 is kept
      [0.0] * 4 + [1.0, 0.5, 0.5, 0.5] + [0.0] * 4 + [1.0] * 4,  # equal maxima: group 3 wins on its top-2 sum
  ], np.float32)
  _, ids = _grouped(logits, 4, n_group=4, topk_group=1)
  np.testing.assert_array_equal(np.asarray(ids), [[0, 1, 2, 3], [4, 5, 6, 7], [12, 13, 14, 15]])


def test_grouped_sigmoid_bf16_logits_and_bias():
  logits = _logits(12, 32, 16, jnp.bfloat16)
  bias = (0.2 * _normal(13, 16)).astype(jnp.bfloat16)
  weights, ids = _grouped(logits, 4, bias=bias, n_group=4, topk_group=2)
  assert weights.dtype == jnp.float32
  ref_w, ref_ids = _np_grouped_sigmoid(np.asarray(logits.astype(jnp.float32)), 4,
                                       np.asarray(bias.astype(jnp.float32)), 4, 2, True, 1.0)
  np.testing.assert_array_equal(np.asarray(ids), ref_ids)
  np.testing.assert_allclose(np.asarray(weights), ref_w, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# RouterConfig and route
# ----------------------------------------------------------------------------------------------------------------


def test_route_dispatches_and_config_is_static():
  logits = _logits(14, 128, 16)
  bias = 0.3 * _normal(15, 16)
  soft = RouterConfig(kind="softmax", num_experts=16, top_k=2)
  ds = RouterConfig(kind="deepseek_v3", num_experts=16, top_k=4, n_group=4, topk_group=2,
                    routed_scaling_factor=2.5)
  assert hash(ds) == hash(RouterConfig(kind="deepseek_v3", num_experts=16, top_k=4, n_group=4, topk_group=2,
                                       routed_scaling_factor=2.5))
  with pytest.raises(AttributeError):
    ds.top_k = 3  # frozen
  jit_route = jax.jit(routing.route, static_argnames="config")
  for got, want in [
      (jit_route(logits, config=soft), _np_topk_softmax(logits, 2, True)),
      (jit_route(logits, config=ds, bias=bias), _np_grouped_sigmoid(logits, 4, bias, 4, 2, True, 2.5)),
  ]:
    np.testing.assert_array_equal(np.asarray(got[1]), want[1])
    np.testing.assert_allclose(np.asarray(got[0]), want[0], rtol=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# Invalid ids and expert placement
# ----------------------------------------------------------------------------------------------------------------

# 8 experts on 4 ranks: 2 local experts each. -1 is the sentinel; -5, 8 and 100 are out of range.
IDS = np.array([[0, 1, 2, 7], [3, -1, 6, 5], [4, -5, 8, 100]], np.int32)


def test_expert_to_rank_with_invalid_and_out_of_range_ids():
  ranks = routing.expert_to_rank(jnp.asarray(IDS), 8, 4)
  assert ranks.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(ranks), [[0, 0, 1, 3], [1, -1, 3, 2], [2, -1, -1, -1]])
  np.testing.assert_array_equal(np.asarray(routing.expert_to_rank(IDS, 8, 1)),
                                [[0, 0, 0, 0], [0, -1, 0, 0], [0, -1, -1, -1]])
  np.testing.assert_array_equal(np.asarray(routing.expert_to_rank(IDS, 8, 8)),
                                np.where((IDS >= 0) & (IDS < 8), IDS, -1))


def test_local_expert_ids_static_rank():
  expected = {
      0: [[0, 1, -1, -1], [-1, -1, -1, -1], [-1, -1, -1, -1]],
      1: [[-1, -1, 0, -1], [1, -1, -1, -1], [-1, -1, -1, -1]],
      2: [[-1, -1, -1, -1], [-1, -1, -1, 1], [0, -1, -1, -1]],
      3: [[-1, -1, -1, 1], [-1, -1, 0, -1], [-1, -1, -1, -1]],
  }
  for rank, want in expected.items():
    got = routing.local_expert_ids(jnp.asarray(IDS), rank, 8, 4)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"rank {rank}")


def test_local_expert_ids_traced_rank_agrees_and_partitions_valid_ids():
  ids = np.random.default_rng(16).integers(-3, 20, (64, 4)).astype(np.int32)  # includes invalid ids
  fn = jax.jit(lambda i, r: routing.local_expert_ids(i, r, 16, 4))
  hits = np.zeros(ids.shape, np.int32)
  reconstructed = np.full(ids.shape, -1, np.int32)
  for rank in range(4):
    got = np.asarray(fn(ids, jnp.int32(rank)))
    np.testing.assert_array_equal(got, np.asarray(routing.local_expert_ids(ids, rank, 16, 4)))
    assert np.all((got == -1) | ((got >= 0) & (got < 4)))
    hits += got >= 0
    reconstructed = np.where(got >= 0, rank * 4 + got, reconstructed)
  ids = np.asarray(ids)
  valid = (ids >= 0) & (ids < 16)
  np.testing.assert_array_equal(hits, valid.astype(np.int32))  # each valid id on exactly one rank
  np.testing.assert_array_equal(reconstructed, np.where(valid, ids, -1))


def test_local_expert_ids_under_shard_map_axis_index():
  mesh = jax.make_mesh((8,), ("ep",), devices=devices(8))
  ids = np.tile(np.arange(-1, 17, dtype=np.int32), (8, 1))  # [8, 18]: every id on every rank, plus invalid
  fn = jax.shard_map(lambda i: routing.local_expert_ids(i, jax.lax.axis_index("ep"), 16, 8), mesh=mesh,
                     in_specs=P("ep"), out_specs=P("ep"))
  got = np.asarray(fn(jax.device_put(ids, NamedSharding(mesh, P("ep")))))
  for rank in range(8):
    want = [(e - 2 * rank) if 0 <= e < 16 and e // 2 == rank else -1 for e in ids[rank]]
    np.testing.assert_array_equal(got[rank], want, err_msg=f"rank {rank}")


def test_mask_invalid():
  weights = np.arange(12, dtype=np.float32).reshape(3, 4) + 1.0
  ids, w = routing.mask_invalid(jnp.asarray(IDS), jnp.asarray(weights), 8)
  valid = (IDS >= 0) & (IDS < 8)
  assert ids.dtype == jnp.int32 and w.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(ids), np.where(valid, IDS, INVALID_EXPERT))
  np.testing.assert_array_equal(np.asarray(w), np.where(valid, weights, 0.0))
  ids_only, none = routing.mask_invalid(IDS, None, 8)
  assert none is None
  np.testing.assert_array_equal(np.asarray(ids_only), np.where(valid, IDS, INVALID_EXPERT))
  np.testing.assert_array_equal(np.asarray(routing.valid_mask(IDS, 8)), valid)


# ----------------------------------------------------------------------------------------------------------------
# Load statistics and the auxiliary loss
# ----------------------------------------------------------------------------------------------------------------


def test_expert_load_counts_valid_ids_only():
  load = _load(jnp.asarray(IDS), 8)
  assert load.dtype == jnp.int32 and load.shape == (8,)
  # Valid ids: 0 1 2 7 / 3 6 5 / 4 -> one each; -1, -5, 8, 100 ignored (-1 must not wrap to expert 7).
  np.testing.assert_array_equal(np.asarray(load), [1, 1, 1, 1, 1, 1, 1, 1])
  ids = jnp.array([[0, 0], [0, 3], [-1, 3], [9, -1]], jnp.int32)
  np.testing.assert_array_equal(np.asarray(_load(ids, 4)), [3, 0, 0, 2])


def test_load_balance_loss_uniform_is_one():
  # 4 experts, top-2, every expert chosen equally often and every probability 1/4.
  probs = jnp.full((4, 4), 0.25)
  ids = jnp.array([[0, 1], [2, 3], [1, 0], [3, 2]], jnp.int32)
  np.testing.assert_allclose(float(_loss(probs, ids, 4)), 1.0, rtol=1e-6)
  # Padding slots change nothing: they are not assignments.
  ids_pad = jnp.concatenate([ids, jnp.full((4, 1), INVALID_EXPERT, jnp.int32)], axis=1)
  np.testing.assert_allclose(float(_loss(probs, ids_pad, 4)), 1.0, rtol=1e-6)


def test_load_balance_loss_hand_computed():
  probs = jnp.array([[0.7, 0.1, 0.1, 0.1],
                     [0.4, 0.4, 0.1, 0.1],
                     [0.1, 0.2, 0.3, 0.4]])
  ids = jnp.array([[0, 1], [0, -1], [3, 0]], jnp.int32)
  # Valid assignments: 0, 1, 0, 3, 0 -> f = [3/5, 1/5, 0, 1/5]; P = [1.2, 0.7, 0.5, 0.6] / 3.
  # loss = 4 * (3/5 * 0.4 + 1/5 * 0.7/3 + 1/5 * 0.2) = 4 * (0.24 + 0.04667 + 0.04) = 1.30667
  want = 4 * (0.6 * 0.4 + 0.2 * 0.7 / 3 + 0.2 * 0.2)
  got = _loss(probs, ids, 4)
  assert got.shape == () and got.dtype == jnp.float32
  np.testing.assert_allclose(float(got), want, rtol=1e-6)
  # The gradient flows through P only: d loss / d probs[t, e] = num_experts * f_e / num_tokens.
  grad = jax.jit(jax.grad(routing.load_balance_loss), static_argnums=2)(probs, ids, 4)
  np.testing.assert_allclose(np.asarray(grad), np.tile(4 * np.array([0.6, 0.2, 0.0, 0.2]) / 3, (3, 1)), rtol=1e-6)
  # No valid assignment at all: 0, not NaN.
  assert float(_loss(probs, jnp.full((3, 2), -1, jnp.int32), 4)) == 0.0


def test_load_balance_loss_and_load_under_shard_map_equal_global():
  mesh = jax.make_mesh((8,), ("ep",), devices=devices(8))
  num_tokens, num_experts, top_k = 64, 16, 2
  # Skewed logits so that shards differ: the mean of local losses is not the global loss.
  logits = _logits(17, num_tokens, num_experts) + jnp.linspace(0.0, 3.0, num_tokens)[:, None] * \
      jnp.linspace(-1.0, 1.0, num_experts)[None, :]
  probs = jax.nn.softmax(logits, axis=-1)
  _, ids = _softmax(logits, top_k)
  ids = ids.at[5, 1].set(INVALID_EXPERT).at[40, 0].set(INVALID_EXPERT)  # unequal valid counts per shard
  want_loss = float(_loss(probs, ids, num_experts))
  want_load = np.asarray(_load(ids, num_experts))

  sharding = NamedSharding(mesh, P("ep"))
  probs_s, ids_s = jax.device_put(probs, sharding), jax.device_put(ids, sharding)

  def local(p, i):
    return (routing.load_balance_loss(p, i, num_experts, axis_name="ep"),
            routing.expert_load(i, num_experts, axis_name="ep"),
            routing.load_balance_loss(p, i, num_experts)[None])

  loss, load, local_losses = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("ep"), P("ep")),
                                                   out_specs=(P(), P(), P("ep"))))(probs_s, ids_s)
  np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(load), want_load)
  assert abs(float(np.mean(np.asarray(local_losses))) - want_loss) > 1e-2  # the psum is what makes it global


# ----------------------------------------------------------------------------------------------------------------
# Trace-time validation
# ----------------------------------------------------------------------------------------------------------------

X8 = jnp.zeros((4, 8), jnp.float32)
IDS8 = jnp.zeros((4, 2), jnp.int32)


@pytest.mark.parametrize("call,exc,match", [
    # topk_softmax
    (lambda: routing.topk_softmax(jnp.zeros((8,)), 2), ValueError,
     r"topk_softmax: logits must be a 2-D \[num_tokens, num_experts\] array, got shape \(8,\)"),
    (lambda: routing.topk_softmax(jnp.zeros((4, 8), jnp.int32), 2), TypeError,
     r"topk_softmax: logits must have a floating dtype, got int32"),
    (lambda: routing.topk_softmax(X8, 9), ValueError,
     r"topk_softmax: top_k must be an int in \[1, num_experts=8\], got 9"),
    (lambda: routing.topk_softmax(X8, 0), ValueError, r"top_k must be an int in \[1, num_experts=8\], got 0"),
    (lambda: routing.topk_softmax(X8, 2.0), ValueError, r"top_k must be an int .* got 2.0"),
    (lambda: routing.topk_softmax(X8, 2, renormalize=1), TypeError,
     r"topk_softmax: renormalize must be a bool, got 1"),
    # topk_grouped_sigmoid
    (lambda: routing.topk_grouped_sigmoid(jnp.zeros((2, 4, 8)), 2), ValueError,
     r"topk_grouped_sigmoid: logits must be a 2-D"),
    (lambda: routing.topk_grouped_sigmoid(X8, 9), ValueError,
     r"topk_grouped_sigmoid: top_k must be an int in \[1, num_experts=8\], got 9"),
    (lambda: routing.topk_grouped_sigmoid(X8, 2, n_group=3, topk_group=1), ValueError,
     r"topk_grouped_sigmoid: n_group must divide num_experts=8, got 3"),
    (lambda: routing.topk_grouped_sigmoid(X8, 2, n_group=0, topk_group=1), ValueError,
     r"topk_grouped_sigmoid: n_group must be a positive int, got 0"),
    (lambda: routing.topk_grouped_sigmoid(X8, 2, n_group=4, topk_group=5), ValueError,
     r"topk_grouped_sigmoid: topk_group must be an int in \[1, n_group=4\], got 5"),
    (lambda: routing.topk_grouped_sigmoid(X8, 2, n_group=4, topk_group=0), ValueError,
     r"topk_group must be an int in \[1, n_group=4\], got 0"),
    (lambda: routing.topk_grouped_sigmoid(X8, 3, n_group=4, topk_group=1), ValueError,
     r"topk_grouped_sigmoid: top_k must be <= topk_group \* \(num_experts // n_group\) = 1 \* 2 = 2, got 3"),
    (lambda: routing.topk_grouped_sigmoid(X8, 2, bias=jnp.zeros((7,))), ValueError,
     r"topk_grouped_sigmoid: bias must have shape \[num_experts\] = \(8,\), got \(7,\)"),
    (lambda: routing.topk_grouped_sigmoid(X8, 2, bias=jnp.zeros((1, 8))), ValueError,
     r"bias must have shape \[num_experts\] = \(8,\), got \(1, 8\)"),
    (lambda: routing.topk_grouped_sigmoid(X8, 2, bias=jnp.zeros((8,), jnp.int32)), TypeError,
     r"topk_grouped_sigmoid: bias must have a floating dtype, got int32"),
    (lambda: routing.topk_grouped_sigmoid(X8, 2, routed_scaling_factor=0.0), ValueError,
     r"topk_grouped_sigmoid: routed_scaling_factor must be a finite float > 0, got 0.0"),
    (lambda: routing.topk_grouped_sigmoid(X8, 2, routed_scaling_factor=math.nan), ValueError,
     r"routed_scaling_factor must be a finite float > 0, got nan"),
    # placement
    (lambda: routing.expert_to_rank(IDS8, 8, 3), ValueError,
     r"expert_to_rank: num_ranks must divide num_experts=8, got 3"),
    (lambda: routing.expert_to_rank(IDS8, 8, 0), ValueError,
     r"expert_to_rank: num_ranks must be a positive int, got 0"),
    (lambda: routing.expert_to_rank(jnp.zeros((4, 2)), 8, 4), TypeError,
     r"expert_to_rank: topk_ids must have an integer dtype, got float32"),
    (lambda: routing.local_expert_ids(IDS8, 0, 10, 4), ValueError,
     r"local_expert_ids: num_ranks must divide num_experts=10, got 4"),
    (lambda: routing.local_expert_ids(IDS8, 4, 8, 4), ValueError,
     r"local_expert_ids: rank must be in \[0, num_ranks=4\), got 4"),
    (lambda: routing.local_expert_ids(IDS8, -1, 8, 4), ValueError, r"rank must be in \[0, num_ranks=4\), got -1"),
    (lambda: routing.local_expert_ids(IDS8, jnp.float32(1), 8, 4), TypeError,
     r"local_expert_ids: rank must be an int or an integer scalar array"),
    (lambda: routing.local_expert_ids(IDS8, jnp.array([0, 1]), 8, 4), TypeError,
     r"rank must be an int or an integer scalar array"),
    (lambda: routing.mask_invalid(IDS8, jnp.zeros((4, 3)), 8), ValueError,
     r"mask_invalid: topk_weights must have the shape of topk_ids \(4, 2\), got \(4, 3\)"),
    # load statistics
    (lambda: routing.expert_load(jnp.zeros((4, 2)), 8), TypeError, r"expert_load: topk_ids must have an integer"),
    (lambda: routing.expert_load(IDS8, 0), ValueError, r"expert_load: num_experts must be a positive int, got 0"),
    (lambda: routing.load_balance_loss(jnp.zeros((4, 7)), IDS8, 8), ValueError,
     r"load_balance_loss: router_probs must be a 2-D \[num_tokens, num_experts=8\] array, got shape \(4, 7\)"),
    (lambda: routing.load_balance_loss(jnp.zeros((4, 8), jnp.int32), IDS8, 8), TypeError,
     r"load_balance_loss: router_probs must have a floating dtype, got int32"),
    (lambda: routing.load_balance_loss(X8, jnp.zeros((5, 2), jnp.int32), 8), ValueError,
     r"load_balance_loss: topk_ids must be a 2-D \[num_tokens=4, top_k\] array, got shape \(5, 2\)"),
    # config and route
    (lambda: RouterConfig(kind="topk", num_experts=8, top_k=2), ValueError,
     r"RouterConfig: kind must be one of 'softmax', 'deepseek_v3', got 'topk'"),
    (lambda: RouterConfig(kind="softmax", num_experts=8, top_k=9), ValueError,
     r"RouterConfig: top_k must be an int in \[1, num_experts=8\], got 9"),
    (lambda: RouterConfig(kind="softmax", num_experts=8, top_k=2, n_group=2), ValueError,
     r"RouterConfig: n_group, topk_group and routed_scaling_factor must be 1, 1 and 1.0 for kind 'softmax'"),
    (lambda: RouterConfig(kind="deepseek_v3", num_experts=8, top_k=2, n_group=3), ValueError,
     r"RouterConfig: n_group must divide num_experts=8, got 3"),
    (lambda: RouterConfig(kind="deepseek_v3", num_experts=8, top_k=2, n_group=4, topk_group=5), ValueError,
     r"RouterConfig: topk_group must be an int in \[1, n_group=4\], got 5"),
    (lambda: RouterConfig(kind="deepseek_v3", num_experts=8, top_k=4, n_group=4, topk_group=1), ValueError,
     r"RouterConfig: top_k must be <= topk_group \* \(num_experts // n_group\) = 1 \* 2 = 2, got 4"),
    (lambda: RouterConfig(kind="deepseek_v3", num_experts=8, top_k=2, routed_scaling_factor=-1.0), ValueError,
     r"RouterConfig: routed_scaling_factor must be a finite float > 0, got -1.0"),
    (lambda: routing.route(jnp.zeros((4, 16)), RouterConfig(kind="softmax", num_experts=8, top_k=2)), ValueError,
     r"route: logits must have config.num_experts=8 columns, got shape \(4, 16\)"),
    (lambda: routing.route(X8, RouterConfig(kind="softmax", num_experts=8, top_k=2), bias=jnp.zeros(8)), ValueError,
     r"route: bias must be None for kind 'softmax'"),
    (lambda: routing.route(X8, {"kind": "softmax"}), TypeError, r"route: config must be a RouterConfig, got dict"),
])
def test_validation_errors(call, exc, match):
  with pytest.raises(exc, match=match):
    call()


def test_validation_happens_at_trace_time():
  # The checks fire while tracing (no compile, no run): eval_shape only traces.
  with pytest.raises(ValueError, match=r"topk_softmax: top_k must be an int in \[1, num_experts=8\], got 9"):
    jax.eval_shape(lambda x: routing.topk_softmax(x, 9), jax.ShapeDtypeStruct((4, 8), jnp.float32))
  with pytest.raises(ValueError, match=r"n_group must divide num_experts=8, got 3"):
    jax.eval_shape(lambda x: routing.topk_grouped_sigmoid(x, 2, n_group=3), jax.ShapeDtypeStruct((4, 8), jnp.float32))
  with pytest.raises(ValueError, match=r"bias must have shape"):
    jax.jit(lambda x, b: routing.topk_grouped_sigmoid(x, 2, bias=b))(X8, jnp.zeros(7))
