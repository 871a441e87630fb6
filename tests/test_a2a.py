"""Tests of the pure-JAX dispatch/combine (jax_moe_a2a.a2a): the contract the one-sided custom call must match.

Payloads encode their origin (source rank and token index) so a receiver can check where every row came from;
data movement is compared bit for bit against a loop-by-loop NumPy oracle.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P
from jax.test_util import check_grads

from conftest import devices
from jax_moe_a2a import a2a

AXIS = "ep"


def _mesh(num_ranks):
  return Mesh(np.array(devices(num_ranks)), (AXIS,))


def _bits(a):
  """Raw bytes of an array, for bit-exact comparisons (NaN payloads and signed zeros included)."""
  a = np.ascontiguousarray(np.asarray(a))
  return a.view(np.uint8).reshape(a.shape + (-1,))


def _assert_bits_equal(actual, expected):
  assert np.asarray(actual).dtype == np.asarray(expected).dtype
  np.testing.assert_array_equal(_bits(actual), _bits(expected))


# ----------------------------------------------------------------------------------------------------------------
# Oracle and runner
# ----------------------------------------------------------------------------------------------------------------


def _oracle(x, ids, w, num_experts, x_sf=None):
  """The contract written as loops. Inputs are per source: x [R, T, *row], ids/w [R, T, top_k].

  Returns a dict of per-destination arrays: recv_x [R_dest, R_src, T, *row], recv_x_sf likewise,
  recv_topk_ids / recv_topk_weights [R_dest, R_src, T, top_k], recv_counts [R_dest, R_src], and
  send_slot [R_src, T, R_dest].
  """
  num_ranks, num_tokens, top_k = ids.shape
  local = num_experts // num_ranks
  out = {
      "recv_x": np.zeros((num_ranks, num_ranks, num_tokens) + x.shape[2:], x.dtype),
      "recv_topk_ids": np.full((num_ranks, num_ranks, num_tokens, top_k), -1, np.int32),
      "recv_topk_weights": np.zeros((num_ranks, num_ranks, num_tokens, top_k), np.float32),
      "recv_counts": np.zeros((num_ranks, num_ranks), np.int32),
      "send_slot": np.full((num_ranks, num_tokens, num_ranks), -1, np.int32),
  }
  if x_sf is not None:
    out["recv_x_sf"] = np.zeros((num_ranks, num_ranks, num_tokens) + x_sf.shape[2:], x_sf.dtype)
  for s in range(num_ranks):
    for t in range(num_tokens):
      for r in range(num_ranks):
        ks = [k for k in range(top_k) if 0 <= ids[s, t, k] < num_experts and ids[s, t, k] // local == r]
        if not ks:
          continue
        j = out["recv_counts"][r, s]
        out["recv_counts"][r, s] += 1
        out["send_slot"][s, t, r] = j
        out["recv_x"][r, s, j] = x[s, t]
        if x_sf is not None:
          out["recv_x_sf"][r, s, j] = x_sf[s, t]
        for k in ks:
          out["recv_topk_ids"][r, s, j, k] = ids[s, t, k] - r * local
          out["recv_topk_weights"][r, s, j, k] = w[s, t, k]
  return out


def _run_dispatch(x, ids, w, num_experts, x_sf=None, *, jit=True):
  """Runs dispatch on an R-rank mesh; inputs and outputs per rank as in `_oracle`."""
  num_ranks, num_tokens = ids.shape[:2]

  def body(x, ids, w, x_sf):
    res, handle = a2a.dispatch(x, ids, w, num_experts=num_experts, axis_name=AXIS, x_sf=x_sf)
    return res, handle

  fn = jax.shard_map(body, mesh=_mesh(num_ranks), in_specs=P(AXIS), out_specs=P(AXIS))
  if jit:
    fn = jax.jit(fn)
  flat = lambda a: None if a is None else a.reshape((num_ranks * num_tokens,) + a.shape[2:])
  res, handle = fn(flat(x), flat(ids), flat(w), flat(x_sf))
  per_rank = lambda a: None if a is None else np.asarray(a).reshape((num_ranks, num_ranks) + a.shape[1:])
  got = {name: per_rank(getattr(res, name)) for name in a2a.DispatchResult._fields}
  got["recv_counts"] = np.asarray(res.recv_counts).reshape(num_ranks, num_ranks)
  got["send_slot"] = np.asarray(handle.send_slot).reshape(num_ranks, num_tokens, num_ranks)
  return got


def _check_against_oracle(got, want):
  for name in want:
    _assert_bits_equal(got[name], want[name])


def _random_ids(rng, num_ranks, num_tokens, top_k, num_experts, invalid_fraction=0.25):
  ids = rng.integers(0, num_experts, size=(num_ranks, num_tokens, top_k))
  bad = rng.choice(np.array([-1, -7, num_experts, num_experts + 5, 2**31 - 1, -(2**31)], np.int64),
                   size=ids.shape)
  ids = np.where(rng.random(ids.shape) < invalid_fraction, bad, ids)
  return ids.astype(np.int32)


def _origin_x(num_ranks, num_tokens, hidden):
  """x_s[t, h] = 1000 s + t + h / 64, exact in float32."""
  s = np.arange(num_ranks)[:, None, None]
  t = np.arange(num_tokens)[None, :, None]
  h = np.arange(hidden)[None, None, :]
  return (1000.0 * s + t + h / 64.0).astype(np.float32)


# ----------------------------------------------------------------------------------------------------------------
# Dispatch: data movement
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_ranks,num_tokens,top_k,local", [
    (8, 7, 3, 2),
    (8, 1, 2, 1),
    (4, 7, 4, 3),
    (2, 16, 2, 4),
    (2, 5, 1, 1),
])
def test_dispatch_matches_oracle(num_ranks, num_tokens, top_k, local):
  rng = np.random.default_rng(num_ranks * 100 + num_tokens)
  num_experts = num_ranks * local
  ids = _random_ids(rng, num_ranks, num_tokens, top_k, num_experts)
  w = rng.standard_normal((num_ranks, num_tokens, top_k)).astype(np.float32)
  x = _origin_x(num_ranks, num_tokens, 8)
  got = _run_dispatch(x, ids, w, num_experts)
  _check_against_oracle(got, _oracle(x, ids, w, num_experts))
  assert got["recv_x_sf"] is None


def test_rows_encode_origin_and_follow_token_order():
  num_ranks, num_tokens, top_k, local = 8, 7, 3, 2
  rng = np.random.default_rng(1)
  num_experts = num_ranks * local
  ids = _random_ids(rng, num_ranks, num_tokens, top_k, num_experts, invalid_fraction=0.1)
  w = rng.random((num_ranks, num_tokens, top_k)).astype(np.float32)
  x = _origin_x(num_ranks, num_tokens, 4)
  got = _run_dispatch(x, ids, w, num_experts)
  for r in range(num_ranks):
    for s in range(num_ranks):
      count = got["recv_counts"][r, s]
      rows = got["recv_x"][r, s]
      src = np.floor(rows[:count, 0] / 1000).astype(int)
      tok = (rows[:count, 0] - 1000 * src).astype(int)
      assert (src == s).all()
      np.testing.assert_array_equal(rows[:count], x[s, tok])
      assert (np.diff(tok) > 0).all(), "slots must follow token order"
      bound = [t for t in range(num_tokens)
               if any(0 <= i < num_experts and i // local == r for i in ids[s, t])]
      np.testing.assert_array_equal(tok, bound)
      np.testing.assert_array_equal(got["send_slot"][s, tok, r], np.arange(count))


def test_experts_on_one_rank_are_sent_once():
  num_ranks, num_tokens, top_k, local = 4, 5, 4, 4
  num_experts = num_ranks * local
  # Every token of source s picks all four experts of rank (s + 1) % R, in a scrambled order.
  ids = np.stack([np.tile(((s + 1) % num_ranks) * local + np.array([2, 0, 3, 1]), (num_tokens, 1))
                  for s in range(num_ranks)]).astype(np.int32)
  w = np.arange(num_ranks * num_tokens * top_k, dtype=np.float32).reshape(ids.shape)
  x = _origin_x(num_ranks, num_tokens, 2)
  got = _run_dispatch(x, ids, w, num_experts)
  for s in range(num_ranks):
    r = (s + 1) % num_ranks
    expected_counts = np.zeros(num_ranks, np.int32)
    expected_counts[s] = num_tokens
    np.testing.assert_array_equal(got["recv_counts"][r], expected_counts)
    np.testing.assert_array_equal(got["recv_topk_ids"][r, s], np.tile([2, 0, 3, 1], (num_tokens, 1)))
    np.testing.assert_array_equal(got["recv_topk_weights"][r, s], w[s])
    np.testing.assert_array_equal(got["recv_x"][r, s], x[s])
  _check_against_oracle(got, _oracle(x, ids, w, num_experts))


def test_invalid_ids_route_nowhere_and_idle_rank_gets_only_padding():
  num_ranks, num_tokens, top_k, local = 4, 6, 3, 2
  num_experts = num_ranks * local
  ids = np.full((num_ranks, num_tokens, top_k), a2a.INVALID_EXPERT, np.int32)
  ids[:, :, 0] = np.array([0, 1, 2, 3, 4, 5]) % 6  # ranks 0..2 only; rank 3 holds experts 6, 7
  ids[:, 1, 1] = num_experts  # out of range: ignored
  ids[:, 2, 2] = -(2**31)
  ids[:, 4, :] = [-1, num_experts, 2**31 - 1]  # token 4 goes nowhere
  w = np.full(ids.shape, 0.5, np.float32)
  x = _origin_x(num_ranks, num_tokens, 3)
  got = _run_dispatch(x, ids, w, num_experts)
  _check_against_oracle(got, _oracle(x, ids, w, num_experts))
  idle = num_ranks - 1
  np.testing.assert_array_equal(got["recv_counts"][idle], np.zeros(num_ranks))
  _assert_bits_equal(got["recv_x"][idle], np.zeros_like(got["recv_x"][idle]))
  np.testing.assert_array_equal(got["recv_topk_ids"][idle], -1)
  _assert_bits_equal(got["recv_topk_weights"][idle], np.zeros_like(got["recv_topk_weights"][idle]))
  assert (got["send_slot"][:, 4, :] == -1).all()
  # Only the valid k of a token carry a local id and a weight.
  np.testing.assert_array_equal(got["recv_topk_ids"][0, :, 1], [[1, -1, -1]] * num_ranks)  # token 1 on rank 0
  np.testing.assert_array_equal(got["recv_topk_weights"][0, :, 1], [[0.5, 0.0, 0.0]] * num_ranks)
  np.testing.assert_array_equal(got["recv_counts"][:3], [[2] * 4, [2] * 4, [1] * 4])


@pytest.mark.parametrize("row_shape", [(), (2, 3)])
def test_any_row_shape_moves_unchanged(row_shape):
  num_ranks, num_tokens, top_k, local = 2, 7, 2, 3
  rng = np.random.default_rng(5)
  num_experts = num_ranks * local
  ids = _random_ids(rng, num_ranks, num_tokens, top_k, num_experts)
  w = rng.random((num_ranks, num_tokens, top_k)).astype(np.float32)
  x = rng.integers(-2**31, 2**31 - 1, size=(num_ranks, num_tokens) + row_shape).astype(np.int32)
  got = _run_dispatch(x, ids, w, num_experts)
  _check_against_oracle(got, _oracle(x, ids, w, num_experts))


def test_quantized_payloads_are_bit_exact():
  num_ranks, num_tokens, top_k, local, hidden = 4, 7, 2, 2, 256
  rng = np.random.default_rng(7)
  num_experts = num_ranks * local
  ids = _random_ids(rng, num_ranks, num_tokens, top_k, num_experts)
  w = rng.random((num_ranks, num_tokens, top_k)).astype(np.float32)
  # Every byte value, including E4M3 NaN (0x7f, 0xff) and -0.0 (0x80).
  raw = rng.integers(0, 256, size=(num_ranks, num_tokens, hidden), dtype=np.uint8)
  raw[..., :256] = np.arange(256, dtype=np.uint8)
  fp8 = raw.view(ml_dtypes.float8_e4m3fn)
  sf = rng.standard_normal((num_ranks, num_tokens, hidden // 128)).astype(np.float32)
  sf[0, 0, 0] = -0.0
  sf[0, 0, 1] = np.frombuffer(np.uint32(0x7fc12345).tobytes(), np.float32)[0]  # NaN with a payload
  e8m0 = rng.integers(0, 256, size=(num_ranks, num_tokens, hidden // 32), dtype=np.uint8)
  e8m0 = e8m0.view(ml_dtypes.float8_e8m0fnu)
  e4m3_sf = rng.integers(0, 256, size=(num_ranks, num_tokens, hidden // 16), dtype=np.uint8)
  e4m3_sf = e4m3_sf.view(ml_dtypes.float8_e4m3fn)
  cases = [(fp8, sf), (fp8, e8m0), (raw[..., :hidden // 2], e4m3_sf), (raw.view(jnp.bfloat16), None)]
  for x, x_sf in cases:
    got = _run_dispatch(x, ids, w, num_experts, x_sf=x_sf)
    _check_against_oracle(got, _oracle(x, ids, w, num_experts, x_sf=x_sf))
    # Padding is all-zero bits, even for E8M0 (which has no zero value).
    for name in ("recv_x",) + (() if x_sf is None else ("recv_x_sf",)):
      for r in range(num_ranks):
        for s in range(num_ranks):
          assert not _bits(got[name][r, s, got["recv_counts"][r, s]:]).any()


def test_zero_tokens():
  got = _run_dispatch(np.zeros((2, 0, 4), np.float32), np.zeros((2, 0, 2), np.int32),
                      np.zeros((2, 0, 2), np.float32), 4)
  assert got["recv_x"].shape == (2, 2, 0, 4)
  np.testing.assert_array_equal(got["recv_counts"], 0)


@pytest.mark.parametrize("mesh_shape", [(2, 4), (4, 2)])
def test_dispatch_over_one_axis_of_a_2d_mesh(mesh_shape):
  groups, num_ranks = mesh_shape
  num_tokens, top_k, local = 5, 2, 2
  num_experts = num_ranks * local
  mesh = Mesh(np.array(devices(groups * num_ranks)).reshape(mesh_shape), ("dp", AXIS))
  rng = np.random.default_rng(11)
  ids = _random_ids(rng, groups * num_ranks, num_tokens, top_k, num_experts)
  w = rng.random(ids.shape).astype(np.float32)
  x = _origin_x(groups * num_ranks, num_tokens, 3)

  def body(x, ids, w):
    res, handle = a2a.dispatch(x, ids, w, num_experts=num_experts, axis_name=AXIS)
    return res, handle

  spec = P(("dp", AXIS))
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
  flat = lambda a: a.reshape((-1,) + a.shape[2:])
  res, handle = fn(flat(x), flat(ids), flat(w))
  for g in range(groups):
    sl = slice(g * num_ranks, (g + 1) * num_ranks)
    want = _oracle(x[sl], ids[sl], w[sl], num_experts)
    per_rank = lambda a: np.asarray(a).reshape((groups, num_ranks, num_ranks) + a.shape[1:])[g]
    _assert_bits_equal(per_rank(res.recv_x), want["recv_x"])
    _assert_bits_equal(per_rank(res.recv_topk_ids), want["recv_topk_ids"])
    _assert_bits_equal(per_rank(res.recv_topk_weights), want["recv_topk_weights"])
    _assert_bits_equal(np.asarray(res.recv_counts).reshape(groups, num_ranks, num_ranks)[g], want["recv_counts"])
    _assert_bits_equal(np.asarray(handle.send_slot).reshape(groups, num_ranks, num_tokens, num_ranks)[g],
                       want["send_slot"])


def test_jit_and_eager_agree_bit_for_bit():
  num_ranks, num_tokens, top_k, local = 2, 7, 3, 2  # eager shard_map runs op by op: keep it small
  rng = np.random.default_rng(3)
  num_experts = num_ranks * local
  ids = _random_ids(rng, num_ranks, num_tokens, top_k, num_experts)
  w = rng.standard_normal(ids.shape).astype(np.float32)
  x = rng.standard_normal((num_ranks, num_tokens, 16)).astype(jnp.bfloat16)
  eager = _run_dispatch(x, ids, w, num_experts, jit=False)
  jitted = _run_dispatch(x, ids, w, num_experts, jit=True)
  for name in ("recv_x", "recv_topk_ids", "recv_topk_weights", "recv_counts", "send_slot"):
    _assert_bits_equal(jitted[name], eager[name])
  _check_against_oracle(jitted, _oracle(x, ids, w, num_experts))


def test_handle_is_a_pytree_of_its_slots_and_counts():
  handle = a2a.DispatchHandle(send_slot=jnp.zeros((3, 2), jnp.int32), recv_counts=jnp.zeros((2,), jnp.int32),
                              axis_name=AXIS, num_ranks=2, num_experts=6)
  leaves, treedef = jax.tree_util.tree_flatten(handle)
  assert len(leaves) == 2 and leaves[0].shape == (3, 2) and leaves[1].shape == (2,)
  rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
  assert (rebuilt.axis_name, rebuilt.num_ranks, rebuilt.num_experts) == (AXIS, 2, 6)
  assert (rebuilt.num_tokens, rebuilt.num_local_experts) == (3, 3)


# ----------------------------------------------------------------------------------------------------------------
# Combine
# ----------------------------------------------------------------------------------------------------------------


def _run_dispatch_combine(x, ids, w, num_experts, expert_fn, *, out_dtype=None):
  """Dispatch, expert_out = expert_fn(result, me), combine; per-rank inputs [R, T, ...]; returns [R, T, H]."""
  num_ranks, num_tokens = ids.shape[:2]

  def body(x, ids, w):
    res, handle = a2a.dispatch(x, ids, w, num_experts=num_experts, axis_name=AXIS)
    return a2a.combine(expert_fn(res, jax.lax.axis_index(AXIS)), handle, out_dtype=out_dtype)

  fn = jax.jit(jax.shard_map(body, mesh=_mesh(num_ranks), in_specs=P(AXIS), out_specs=P(AXIS)))
  flat = lambda a: a.reshape((num_ranks * num_tokens,) + a.shape[2:])
  return np.asarray(fn(flat(x), flat(ids), flat(w))).reshape((num_ranks, num_tokens) + x.shape[2:])


def _weighted_identity(res, me):
  return res.recv_x * jnp.sum(res.recv_topk_weights, axis=-1)[..., None]


@pytest.mark.parametrize("num_ranks,num_tokens,top_k,local", [(8, 7, 3, 2), (4, 1, 2, 1), (2, 9, 4, 2)])
def test_combine_of_weighted_identity_gives_weighted_x(num_ranks, num_tokens, top_k, local):
  rng = np.random.default_rng(num_tokens)
  num_experts = num_ranks * local
  ids = _random_ids(rng, num_ranks, num_tokens, top_k, num_experts)
  # Small integers times powers of two: every partial sum is exact, so the result must be too.
  w = rng.choice(np.array([0.25, 0.5, 1.0, 2.0], np.float32), size=ids.shape)
  x = rng.integers(-8, 8, size=(num_ranks, num_tokens, 6)).astype(np.float32)
  out = _run_dispatch_combine(x, ids, w, num_experts, _weighted_identity)
  valid = (ids >= 0) & (ids < num_experts)
  expected = x * np.where(valid, w, 0.0).sum(-1, keepdims=True)
  np.testing.assert_array_equal(out, expected)


def test_combine_ignores_padding_and_tokens_sent_nowhere_get_zero():
  num_ranks, num_tokens, top_k, local = 4, 5, 2, 1
  ids = np.full((num_ranks, num_tokens, top_k), -1, np.int32)
  ids[:, 0] = [1, 2]
  ids[:, 3] = [0, 9]
  x = np.ones((num_ranks, num_tokens, 3), np.float32)
  w = np.ones(ids.shape, np.float32)

  def nan_padding(res, me):
    filled = jnp.arange(num_tokens)[None, :] < res.recv_counts[:, None]
    return jnp.where(filled[..., None], res.recv_x * (me + 1).astype(jnp.float32), jnp.nan)

  out = _run_dispatch_combine(x, ids, w, num_ranks * local, nan_padding)
  expected = np.zeros_like(x)
  expected[:, 0] = 2.0 + 3.0
  expected[:, 3] = 1.0
  _assert_bits_equal(out, expected)  # +0.0 for tokens sent nowhere


def test_combine_sums_ranks_in_ascending_order_in_float32():
  num_ranks, num_tokens = 4, 3
  # Rank r returns v[r] for every slot. Ascending order: ((1e8 + 1) - 1e8) + 1 = 1 in float32; descending or
  # pairwise order gives 0.
  v = np.array([1e8, 1.0, -1e8, 1.0], np.float32)
  f32 = np.float32
  assert ((f32(0) + v[0]) + v[1]) + v[2] + v[3] == 1.0
  assert ((f32(0) + v[3]) + v[2]) + v[1] + v[0] == 0.0
  assert (v[0] + v[1]) + (v[2] + v[3]) == 0.0
  ids = np.tile(np.arange(num_ranks, dtype=np.int32)[::-1], (num_ranks, num_tokens, 1))  # top-k order reversed
  ids[:, 1] = [3, 1, 0, -1]  # ranks 0, 1, 3: ((1e8 + 1) + 1) = 1e8
  x = np.ones((num_ranks, num_tokens, 2), np.float32)
  w = np.ones(ids.shape, np.float32)

  def per_rank_value(res, me):
    return jnp.zeros_like(res.recv_x) + jnp.asarray(v)[me]

  out = _run_dispatch_combine(x, ids, w, num_ranks, per_rank_value)
  np.testing.assert_array_equal(out[:, 0], 1.0)
  np.testing.assert_array_equal(out[:, 1], 1e8)
  np.testing.assert_array_equal(out[:, 2], 1.0)


def test_combine_accumulates_bf16_in_float32_then_casts():
  num_ranks, num_tokens = 4, 2
  # bf16 accumulation: 256 + 1 = 256 (spacing 2), + 1 = 256. float32: 258, exact in bf16.
  v = np.array([256.0, 1.0, 1.0, 0.0], np.float32)
  ids = np.tile(np.array([0, 1, 2], np.int32), (num_ranks, num_tokens, 1))
  x = np.ones((num_ranks, num_tokens, 4), jnp.bfloat16)
  w = np.ones(ids.shape, np.float32)

  def per_rank_value(res, me):
    return (jnp.zeros(res.recv_x.shape, jnp.float32) + jnp.asarray(v)[me]).astype(jnp.bfloat16)

  out = _run_dispatch_combine(x, ids, w, num_ranks, per_rank_value)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_array_equal(out.astype(np.float32), 258.0)
  out32 = _run_dispatch_combine(x, ids, w, num_ranks, per_rank_value, out_dtype=jnp.float32)
  assert out32.dtype == np.float32
  np.testing.assert_array_equal(out32, 258.0)


# ----------------------------------------------------------------------------------------------------------------
# Autodiff
# ----------------------------------------------------------------------------------------------------------------


def _dispatch_fn(ids, num_experts):
  """f(x, w) -> (recv_x, recv_topk_weights) on an R-rank mesh, with fixed routing; global arrays."""
  num_ranks = ids.shape[0]
  flat_ids = ids.reshape(-1, ids.shape[-1])

  def body(x, w, ids):
    res, _ = a2a.dispatch(x, ids, w, num_experts=num_experts, axis_name=AXIS)
    return res.recv_x, res.recv_topk_weights

  sm = jax.shard_map(body, mesh=_mesh(num_ranks), in_specs=P(AXIS), out_specs=P(AXIS))
  return jax.jit(lambda x, w: sm(x, w, flat_ids))


def _combine_fn(ids, num_experts, out_dtype=None):
  """f(expert_out [R * R, T, H]) -> out [R * T, H], with the routing of ids."""
  num_ranks, num_tokens, top_k = ids.shape
  flat_ids = ids.reshape(-1, top_k)

  def body(expert_out, ids):
    w = jnp.ones(ids.shape, jnp.float32)
    x = jnp.zeros((num_tokens, 1), jnp.float32)
    _, handle = a2a.dispatch(x, ids, w, num_experts=num_experts, axis_name=AXIS)
    return a2a.combine(expert_out, handle, out_dtype=out_dtype)

  sm = jax.shard_map(body, mesh=_mesh(num_ranks), in_specs=P(AXIS), out_specs=P(AXIS))
  return jax.jit(lambda expert_out: sm(expert_out, flat_ids))


@pytest.mark.parametrize("num_ranks", [2, 8])
def test_check_grads(num_ranks):
  num_tokens, top_k, local, hidden = 7, 3, 2, 4
  rng = np.random.default_rng(num_ranks)
  num_experts = num_ranks * local
  ids = _random_ids(rng, num_ranks, num_tokens, top_k, num_experts)
  x = rng.standard_normal((num_ranks * num_tokens, hidden)).astype(np.float32)
  w = rng.standard_normal((num_ranks * num_tokens, top_k)).astype(np.float32)
  check_grads(_dispatch_fn(ids, num_experts), (x, w), order=1, modes=["rev"])
  expert_out = rng.standard_normal((num_ranks * num_ranks, num_tokens, hidden)).astype(np.float32)
  check_grads(_combine_fn(ids, num_experts), (expert_out,), order=1, modes=["rev"])


def test_dispatch_vjp_matches_oracle():
  num_ranks, num_tokens, top_k, local, hidden = 4, 7, 3, 2, 5
  rng = np.random.default_rng(21)
  num_experts = num_ranks * local
  ids = _random_ids(rng, num_ranks, num_tokens, top_k, num_experts)
  x = rng.standard_normal((num_ranks * num_tokens, hidden)).astype(np.float32)
  w = rng.standard_normal((num_ranks * num_tokens, top_k)).astype(np.float32)
  f = _dispatch_fn(ids, num_experts)
  (recv_x, recv_w), vjp = jax.vjp(f, x, w)
  ct_x = rng.standard_normal(recv_x.shape).astype(np.float32)
  ct_w = rng.standard_normal(recv_w.shape).astype(np.float32)
  dx, dw = vjp((ct_x, ct_w))
  want = _oracle(x.reshape(num_ranks, num_tokens, hidden), ids, w.reshape(ids.shape), num_experts)
  ct_x = ct_x.reshape(num_ranks, num_ranks, num_tokens, hidden)
  ct_w = ct_w.reshape(num_ranks, num_ranks, num_tokens, top_k)
  dx_want = np.zeros((num_ranks, num_tokens, hidden), np.float32)
  dw_want = np.zeros(ids.shape, np.float32)
  for s in range(num_ranks):
    for t in range(num_tokens):
      for r in range(num_ranks):  # ascending rank order, float32
        j = want["send_slot"][s, t, r]
        if j >= 0:
          dx_want[s, t] += ct_x[r, s, j]
          for k in np.nonzero(want["recv_topk_ids"][r, s, j] >= 0)[0]:
            dw_want[s, t, k] = ct_w[r, s, j, k]
  np.testing.assert_array_equal(np.asarray(dx).reshape(dx_want.shape), dx_want)
  np.testing.assert_array_equal(np.asarray(dw).reshape(dw_want.shape), dw_want)


def test_grads_with_opaque_payload_and_scales():
  """uint8 payloads get no gradient; float scales get the same path as x; weights still differentiate."""
  num_ranks, num_tokens, top_k, local = 2, 5, 2, 2
  rng = np.random.default_rng(4)
  num_experts = num_ranks * local
  ids = _random_ids(rng, num_ranks, num_tokens, top_k, num_experts).reshape(-1, top_k)
  x = rng.integers(0, 256, size=(num_ranks * num_tokens, 8), dtype=np.uint8)
  sf = rng.standard_normal((num_ranks * num_tokens, 2)).astype(np.float32)
  w = rng.standard_normal(ids.shape).astype(np.float32)

  def body(x, sf, w, ids):
    res, _ = a2a.dispatch(x, ids, w, num_experts=num_experts, axis_name=AXIS, x_sf=sf)
    return res.recv_x_sf, res.recv_topk_weights

  sm = jax.shard_map(body, mesh=_mesh(num_ranks), in_specs=P(AXIS), out_specs=P(AXIS))
  loss = lambda sf, w: sum(jnp.sum(o * o) for o in sm(x, sf, w, ids))
  dsf, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(sf, w)
  valid = (ids >= 0) & (ids < num_experts)
  ranks = np.where(valid, ids // local, -1)
  sends = np.array([len(set(r[r >= 0])) for r in ranks])
  np.testing.assert_allclose(dsf, 2 * sf * sends[:, None], rtol=1e-6)
  np.testing.assert_allclose(dw, np.where(valid, 2 * w, 0.0), rtol=1e-6)


def test_combine_vjp_is_a_dispatch_of_the_cotangent():
  num_ranks, num_tokens, top_k, local, hidden = 4, 6, 2, 1, 3
  rng = np.random.default_rng(8)
  ids = _random_ids(rng, num_ranks, num_tokens, top_k, num_ranks * local)
  expert_out = rng.standard_normal((num_ranks * num_ranks, num_tokens, hidden)).astype(jnp.bfloat16)
  f = _combine_fn(ids, num_ranks * local, out_dtype=jnp.float32)
  out, vjp = jax.vjp(f, expert_out)
  assert out.dtype == np.float32
  ct = rng.standard_normal(out.shape).astype(np.float32)
  (d_expert_out,) = vjp(ct)
  assert d_expert_out.dtype == jnp.bfloat16
  ct_r = ct.reshape(num_ranks, num_tokens, hidden).astype(jnp.bfloat16)
  want = _oracle(ct_r, ids, np.zeros(ids.shape, np.float32), num_ranks * local)["recv_x"]
  _assert_bits_equal(np.asarray(d_expert_out).reshape(want.shape), want)


def test_expert_parallel_layer_matches_dense_values_and_grads():
  """A linear MoE layer through dispatch/combine equals its dense formulation, and so do its gradients."""
  num_ranks, num_tokens, top_k, local, hidden = 4, 7, 3, 2, 8
  rng = np.random.default_rng(13)
  num_experts = num_ranks * local
  ids = _random_ids(rng, num_ranks, num_tokens, top_k, num_experts).reshape(-1, top_k)
  x = rng.standard_normal((num_ranks * num_tokens, hidden)).astype(np.float32)
  w = rng.random(ids.shape).astype(np.float32)
  experts = (rng.standard_normal((num_experts, hidden, hidden)) / np.sqrt(hidden)).astype(np.float32)

  def ep_body(x, w, experts, ids):  # experts: [num_local_experts, hidden, hidden], this rank's block
    res, handle = a2a.dispatch(x, ids, w, num_experts=num_experts, axis_name=AXIS)
    y = jnp.einsum("sjh,lhd->sjld", res.recv_x, experts)
    gate = jnp.einsum("sjkl,sjk->sjl", jax.nn.one_hot(res.recv_topk_ids, local), res.recv_topk_weights)
    return a2a.combine(jnp.einsum("sjl,sjld->sjd", gate, y), handle)

  ep = jax.shard_map(ep_body, mesh=_mesh(num_ranks), in_specs=P(AXIS), out_specs=P(AXIS))

  def dense(x, w, experts, ids):
    valid = (ids >= 0) & (ids < num_experts)
    y = jnp.einsum("th,tkhd->tkd", x, experts[jnp.where(valid, ids, 0)])
    return jnp.einsum("tk,tkd->td", jnp.where(valid, w, 0.0), y)

  np.testing.assert_allclose(jax.jit(ep)(x, w, experts, ids), dense(x, w, experts, ids), rtol=1e-5, atol=1e-5)
  ct = rng.standard_normal(x.shape).astype(np.float32)
  loss = lambda f: lambda *a: jnp.sum(f(*a, ids) * ct)
  g_ep = jax.jit(jax.grad(loss(ep), argnums=(0, 1, 2)))(x, w, experts)
  g_dense = jax.grad(loss(dense), argnums=(0, 1, 2))(x, w, experts)
  for a, b in zip(g_ep, g_dense):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------------------------


def _trace(body, *args, num_ranks=2):
  return jax.jit(jax.shard_map(body, mesh=_mesh(num_ranks), in_specs=P(AXIS), out_specs=P(AXIS)))(*args)


def _dispatch_body(num_experts=4, axis_name=AXIS, x_sf=None):
  def body(x, ids, w):
    res, handle = a2a.dispatch(x, ids, w, num_experts=num_experts, axis_name=axis_name, x_sf=x_sf)
    return res.recv_x
  return body


_X = np.zeros((6, 4), np.float32)
_IDS = np.zeros((6, 2), np.int32)
_W = np.zeros((6, 2), np.float32)


@pytest.mark.parametrize("args,kwargs,match", [
    ((_X, _IDS.astype(np.float32), _W), {}, r"dispatch: topk_ids must be a 2-D int32 array .* got shape \(3, 2\) "
                                              r"dtype float32"),
    ((_X, _IDS[:, 0], _W), {}, r"dispatch: topk_ids must be a 2-D int32 array .* got shape \(3,\)"),
    ((_X, _IDS, _W.astype(jnp.bfloat16)), {}, r"dispatch: topk_weights must be a float32 array of shape \(3, 2\)"),
    ((_X, _IDS, _W[:, :1]), {}, r"dispatch: topk_weights must be .* got shape \(3, 1\)"),
    ((_X[:4], _IDS, _W), {}, r"dispatch: x must be an array \[num_tokens=3, ...\].* got shape \(2, 4\)"),
    ((_X, _IDS, _W), {"num_experts": 5}, r"dispatch: num_experts must be a positive multiple of num_ranks=2 .* "
                                         r"got 5"),
    ((_X, _IDS, _W), {"num_experts": 0}, r"dispatch: num_experts must be a positive multiple .* got 0"),
    ((_X, _IDS, _W), {"axis_name": "tp"}, r"dispatch: axis_name must be a mesh axis bound by an enclosing "
                                          r"shard_map, got 'tp'"),
])
def test_dispatch_rejects_bad_inputs(args, kwargs, match):
  with pytest.raises(ValueError, match=match):
    _trace(_dispatch_body(**kwargs), *args)


def test_dispatch_rejects_bad_scales():
  def body(x, ids, w, sf):
    return a2a.dispatch(x, ids, w, num_experts=4, axis_name=AXIS, x_sf=sf[1:])[0].recv_x
  with pytest.raises(ValueError, match=r"dispatch: x_sf must be None or an array \[num_tokens=3, ...\].* "
                                       r"got shape \(2, 1\)"):
    _trace(body, _X, _IDS, _W, np.zeros((6, 1), np.float32))


@pytest.mark.parametrize("make_expert_out,kwargs,match", [
    (lambda x: jnp.zeros((2, 2, 4), jnp.float32), {}, r"combine: expert_out must be a floating array "
                                                      r"\[num_ranks=2, num_tokens=3, hidden\], got shape \(2, 2, 4\)"),
    (lambda x: jnp.zeros((2, 3, 4), jnp.int32), {}, r"combine: expert_out must be .* dtype int32"),
    (lambda x: jnp.zeros((2, 3), jnp.float32), {}, r"combine: expert_out must be .* got shape \(2, 3\)"),
    (lambda x: jnp.zeros((2, 3, 4), jnp.float32), {"out_dtype": jnp.int32}, r"combine: out_dtype must be a "
                                                                            r"floating dtype, got int32"),
])
def test_combine_rejects_bad_inputs(make_expert_out, kwargs, match):
  def body(x, ids, w):
    _, handle = a2a.dispatch(x, ids, w, num_experts=4, axis_name=AXIS)
    return a2a.combine(make_expert_out(x), handle, **kwargs)
  with pytest.raises(ValueError, match=match):
    _trace(body, _X, _IDS, _W)


def test_combine_rejects_a_foreign_handle_and_a_resized_axis():
  def body(x):
    return a2a.combine(jnp.zeros((2, 3, 4), jnp.float32), {"send_slot": None})
  with pytest.raises(ValueError, match=r"combine: handle must be the DispatchHandle returned by dispatch, got dict"):
    _trace(body, _X)
  handle = a2a.DispatchHandle(send_slot=jnp.zeros((3, 4), jnp.int32), recv_counts=jnp.zeros((4,), jnp.int32),
                              axis_name=AXIS, num_ranks=4, num_experts=4)
  with pytest.raises(ValueError, match=r"combine: axis 'ep' must have the size it had at dispatch, 4, got 2"):
    _trace(lambda x: a2a.combine(jnp.zeros((2, 3, 4), jnp.float32), handle), _X)


def test_combine_sum_keeps_the_sign_of_zero():
  # back [R = 2, 2 slots, 2 values]; three tokens: sent to both ranks, to rank 0 only, nowhere.
  back = jnp.array([[[-0.0, 1.0], [-0.0, 2.0]], [[-0.0, -0.0], [5.0, -0.0]]], jnp.float32)
  send_slot = jnp.array([[0, 0], [1, -1], [-1, -1]], jnp.int32)
  want = np.array([[-0.0, 1.0], [-0.0, 2.0], [0.0, 0.0]], np.float32).view(np.uint32)
  for fn in (a2a._sum_from_slots, jax.jit(a2a._sum_from_slots)):  # pylint: disable=protected-access
    np.testing.assert_array_equal(np.asarray(fn(back, send_slot)).view(np.uint32), want)
