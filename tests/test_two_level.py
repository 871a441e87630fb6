"""Two-level dispatch and combine (nodes x GPUs) on 8 simulated CPU devices as 2 x 4 and 4 x 2 (and the 1 x 8,
8 x 1 edge cases): against the flat dispatch over the same two axes, the one-sided path against the reference, and the
layer against the dense oracle.

What must hold (two_level.dispatch_two_level, two_level.combine_two_level):

- Every (token, expert) assignment arrives at the rank the flat dispatch sends it to, with the same row bits,
  local id and weight (in another slot), and each rank receives each token once.
- Combine regroups the flat float32 sum by node: bit for bit equal to the flat combine with one node or one GPU
  per node, else within float32 rounding (max |err| <= 1e-6 max |y|).
- The one-sided inner calls (a workspace over the local axis) give the reference's bits, forward and backward.
- Gradients: the weights' bit for bit equal to the flat path's (each is one rank's cotangent plus zeros), x's
  within float32 rounding.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from conftest import devices, skip_without_one_sided_backward
from jax_moe_a2a import _ffi, a2a, flax_moe, moe
from jax_moe_a2a.testing import calc_diff, max_rel
from jax_moe_a2a.two_level import combine_two_level, dispatch_two_level
from jax_moe_a2a.workspace import Workspace

import test_moe  # the layer tests' inputs, oracle and tolerances

AXES = ("node", "local")
TOKENS, HIDDEN, TOP_K, LOCAL_EXPERTS = 6, 128, 3, 2
SHAPES = [(2, 4), (4, 2), (1, 8), (8, 1)]


def _mesh(shape):
  return Mesh(np.asarray(devices(8)).reshape(shape), AXES)


def _inputs(seed, num_experts, dtype=jnp.bfloat16):
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, num_experts, (8 * TOKENS, TOP_K)).astype(np.int32)
  ids[rng.random(ids.shape) < 0.2] = -1  # no expert
  w = rng.random(ids.shape).astype(np.float32)
  x = jnp.asarray(rng.standard_normal((8 * TOKENS, HIDDEN)), dtype)
  return x, jnp.asarray(ids), jnp.asarray(w)


def _assignments(res, rank):
  """Sorted (row bytes, local id, weight bits) of every valid (slot, k) rank `rank` received."""
  x = np.asarray(res.recv_x)[rank].reshape(-1, HIDDEN)
  ids = np.asarray(res.recv_topk_ids)[rank].reshape(-1, TOP_K)
  w = np.asarray(res.recv_topk_weights)[rank].reshape(-1, TOP_K).view(np.uint32)
  return sorted((x[j].tobytes(), int(ids[j, k]), int(w[j, k])) for j, k in zip(*np.nonzero(ids >= 0)))


def _per_rank(tree):
  """Per-shard results stacked on dim 0 -> [8, ...] with each rank's block."""
  return jax.tree.map(lambda a: np.asarray(a).reshape((8, -1) + a.shape[1:]), tree)


def _expert(res):
  """A per-row stand-in for the experts: sum_k w_k (id_k + 1) x, in float32, rounded to x's dtype."""
  scale = jnp.sum(jnp.where(res.recv_topk_ids >= 0, res.recv_topk_weights * (res.recv_topk_ids + 1), 0.0), -1)
  return (scale[..., None] * res.recv_x.astype(jnp.float32)).astype(res.recv_x.dtype)


def _both(mesh, num_experts, *, workspace=None, impl="auto"):
  """jit of (flat result, two-level result, flat y, two-level y) over `mesh`."""

  def body(x, ids, w):
    flat, flat_handle = a2a.dispatch(x, ids, w, num_experts=num_experts, axis_name=AXES)
    two, two_handle = dispatch_two_level(x, ids, w, num_experts=num_experts, node_axis="node",
                                             local_axis="local", workspace=workspace, impl=impl)
    y_flat = a2a.combine(_expert(flat), flat_handle, out_dtype=jnp.float32)
    y_two = combine_two_level(_expert(two), two_handle, out_dtype=jnp.float32)
    return flat, two, y_flat, y_two

  spec = P(AXES)
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))


@pytest.mark.parametrize("shape", SHAPES)
def test_each_assignment_arrives_where_the_flat_dispatch_sends_it(shape):
  num_experts = 8 * LOCAL_EXPERTS
  mesh = _mesh(shape)
  x, ids, w = _inputs(1, num_experts)
  flat, two, y_flat, y_two = _both(mesh, num_experts)(x, ids, w)
  flat, two = _per_rank(flat), _per_rank(two)
  num_nodes, num_local = shape
  assert two.recv_x.shape == (8, num_local, num_nodes * TOKENS, HIDDEN)
  for r in range(8):
    assert _assignments(two, r) == _assignments(flat, r), f"rank {r}"
    # Each token arrives once at each rank holding one of its experts, on both paths.
    assert two.recv_counts[r].sum() == flat.recv_counts[r].sum()
  # Combine: the same float32 additions, grouped by node.
  y_flat, y_two = np.asarray(y_flat), np.asarray(y_two)
  if 1 in shape:
    np.testing.assert_array_equal(y_two.view(np.uint32), y_flat.view(np.uint32))
  else:
    assert max_rel(y_two, y_flat) <= 1e-6


def test_a_token_crosses_to_each_node_once():
  """Node level: a token with several experts on one node sends one row there; the counts say so."""
  num_experts = 8 * LOCAL_EXPERTS  # 2 nodes x 4 GPUs: node 0 holds experts 0..7
  mesh = _mesh((2, 4))
  ids = np.full((8 * TOKENS, TOP_K), -1, np.int32)
  ids[0] = [0, 3, 7]  # token 0 of rank (0, 0): three experts on node 0, GPUs 0, 1 and 3
  ids[1] = [8, 15, -1]  # token 1: two experts on node 1
  x, _, w = _inputs(2, num_experts)

  def body(x, ids, w):
    _, handle = dispatch_two_level(x, ids, w, num_experts=num_experts, node_axis="node", local_axis="local")
    return handle.node.recv_counts[None], handle.local.recv_counts[None]

  node_counts, local_counts = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXES), out_specs=P(AXES)))(
      x, jnp.asarray(ids), w)
  node_counts, local_counts = np.asarray(node_counts), np.asarray(local_counts)
  np.testing.assert_array_equal(node_counts[0], [1, 0])  # rank (0, 0) received its own token 0 from node 0
  np.testing.assert_array_equal(node_counts[4], [1, 0])  # rank (1, 0) received token 1 from node 0, once
  for r in (0, 1, 3):  # node 0's GPUs 0, 1, 3 each received token 0 once, from GPU 0
    np.testing.assert_array_equal(local_counts[r], [1, 0, 0, 0])
  np.testing.assert_array_equal(local_counts[2], [0, 0, 0, 0])
  for r in (4, 7):  # node 1's GPUs 0 and 3 received token 1 from GPU 0 of their node
    np.testing.assert_array_equal(local_counts[r], [1, 0, 0, 0])


@pytest.mark.parametrize("shape", [(2, 4), (4, 2)])
def test_one_sided_inner_calls_give_the_references_bits(shape):
  num_experts = 8 * LOCAL_EXPERTS
  mesh = _mesh(shape)
  x, ids, w = _inputs(3, num_experts)
  with Workspace(mesh, expert_axis="local", capacity=shape[0] * TOKENS, hidden=HIDDEN, top_k=TOP_K) as ws:
    got = _both(mesh, num_experts, workspace=ws, impl="ffi")(x, ids, w)
    want = _both(mesh, num_experts, impl="reference")(x, ids, w)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    ws.check()


def _grads(mesh, num_experts, *, two_level, workspace=None, impl="auto"):
  """jit of the gradients of sum(ct * combine(expert(dispatch(x)))) w.r.t. x and the weights."""

  def loss(x, ids, w, ct):
    def body(x, ids, w):
      if two_level:
        res, handle = dispatch_two_level(x, ids, w, num_experts=num_experts, node_axis="node",
                                             local_axis="local", workspace=workspace, impl=impl)
        return combine_two_level(_expert(res), handle, out_dtype=jnp.float32)
      res, handle = a2a.dispatch(x, ids, w, num_experts=num_experts, axis_name=AXES)
      return a2a.combine(_expert(res), handle, out_dtype=jnp.float32)

    y = jax.shard_map(body, mesh=mesh, in_specs=P(AXES), out_specs=P(AXES), check_vma=False)(x, ids, w)
    return jnp.sum(y * ct)

  return jax.jit(jax.grad(loss, argnums=(0, 2)))


@pytest.mark.parametrize("shape", [(2, 4), (4, 2)])
def test_gradients_match_the_flat_path_and_the_one_sided_calls_the_reference(shape):
  skip_without_one_sided_backward()
  num_experts = 8 * LOCAL_EXPERTS
  mesh = _mesh(shape)
  x, ids, w = _inputs(4, num_experts)
  ct = jnp.asarray(np.random.default_rng(5).standard_normal((8 * TOKENS, HIDDEN)), jnp.float32)
  # float32 x: the flat comparison is then free of bf16 rounding of the gradient.
  dx_flat, dw_flat = _grads(mesh, num_experts, two_level=False)(x.astype(jnp.float32), ids, w, ct)
  dx_two, dw_two = _grads(mesh, num_experts, two_level=True)(x.astype(jnp.float32), ids, w, ct)
  np.testing.assert_array_equal(np.asarray(dw_two), np.asarray(dw_flat))
  assert max_rel(dx_two, dx_flat) <= 1e-6
  with Workspace(mesh, expert_axis="local", capacity=shape[0] * TOKENS, hidden=HIDDEN, top_k=TOP_K,
                 training=True) as ws:
    got = _grads(mesh, num_experts, two_level=True, workspace=ws, impl="ffi")(x, ids, w, ct)
    want = _grads(mesh, num_experts, two_level=True, impl="reference")(x, ids, w, ct)
    for a, b in zip(got, want):
      np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    ws.check()


# ----------------------------------------------------------------------------------------------------------------
# The layer
# ----------------------------------------------------------------------------------------------------------------


def _layer_config(**kw):
  return test_moe._config(expert_axis=AXES, token_axes=AXES, two_level=True, **kw)  # pylint: disable=protected-access


def _layer_run(config, mesh, workspace):
  params, x, ct = test_moe._inputs(config, mesh)  # pylint: disable=protected-access
  got = test_moe._value_and_grads(  # pylint: disable=protected-access
      lambda p, x: moe.moe_apply(p, x, config, mesh, workspace=workspace))(params, x, ct)
  oracle_config = dataclasses.replace(config, wire_format="bf16", dtype=jnp.float32, token_axes=(),
                                               expert_axis="expert", two_level=None, expert_precision="dtype")
  one = jax.devices()[0]
  want = test_moe._oracle_fn(oracle_config)(*jax.device_put((params, x, ct), one))  # pylint: disable=protected-access
  return jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want)


@pytest.mark.parametrize("shape", [(2, 4), (4, 2)])
@pytest.mark.parametrize("with_workspace", [False, True])
def test_layer_matches_the_oracle(shape, with_workspace):
  if with_workspace:
    skip_without_one_sided_backward()
  config = _layer_config()
  mesh = _mesh(shape)
  ws = moe.make_workspace(config, mesh, test_moe.TOKENS, training=True) if with_workspace else None
  try:
    if ws is not None:
      assert ws.expert_axis == "local" and ws.num_ranks == shape[1]
      assert ws.layout.capacity == shape[0] * test_moe.TOKENS // 8  # every node's rows of one shard
    got, want = _layer_run(config, mesh, ws)
    test_moe._assert_close(got, want, test_moe.F32_TOL)  # pylint: disable=protected-access
  finally:
    if ws is not None:
      ws.check()
      ws.close()


def test_layer_with_fp8_wire_and_fp8_experts():
  skip_without_one_sided_backward()
  config = _layer_config(wire_format="fp8_blockwise", expert_precision="fp8", dtype=jnp.bfloat16)
  mesh = _mesh((2, 4))
  with moe.make_workspace(config, mesh, test_moe.TOKENS, training=True) as ws:
    got, want = _layer_run(config, mesh, ws)
    test_moe._assert_calc_diff(got, want, test_moe.FP8_EXPERTS_CALC_DIFF)  # pylint: disable=protected-access
    ws.check()


@pytest.mark.parametrize("with_workspace", [False, True])
@pytest.mark.parametrize("wire_format", ["mxfp8", "nvfp4"])
def test_layer_on_a_microscaled_wire_matches_the_oracle_and_the_flat_layer(wire_format, with_workspace):
  """MXFP8 and NVFP4 rows cross nodes and fan out inside them as any payload does: on the one-sided calls and the
  quantization custom calls (impl="ffi", a workspace over the local axis) or on the references, the layer is within
  the format's limit of the oracle (test_moe's docstring). On the references it equals the flat layer over the same
  ranks up to float32 regrouping: the same decoded rows (NVFP4: the same global scale for every rank of both axes)."""
  if with_workspace:
    pytest.importorskip("jax_moe_a2a._jax_moe_a2a")
    skip_without_one_sided_backward()
  config = _layer_config(wire_format=wire_format, impl="ffi" if with_workspace else "reference")
  mesh = _mesh((2, 4))
  ws = moe.make_workspace(config, mesh, test_moe.TOKENS, training=True) if with_workspace else None
  try:
    got, want = _layer_run(config, mesh, ws)
  finally:
    if ws is not None:
      ws.check()
      ws.close()
  test_moe._assert_calc_diff(got, want, test_moe.WIRE_CALC_DIFF[wire_format][0])  # pylint: disable=protected-access
  if not with_workspace:
    flat, _ = _layer_run(dataclasses.replace(config, two_level=False), mesh, None)
    for a, b in zip(jax.tree.leaves((got[0], got[2])), jax.tree.leaves((flat[0], flat[2]))):
      assert max_rel(a, b) <= 1e-6


def test_one_node_gives_the_flat_layers_bits():
  """A node axis of size 1: the node level moves every token to itself and each partial sum is the whole sum, so
  the two-level layer equals the flat one bit for bit, forward and gradients (one-sided calls on CPU)."""
  skip_without_one_sided_backward()
  mesh = _mesh((1, 8))
  two = _layer_config(wire_format="fp8_blockwise", dtype=jnp.bfloat16)
  flat = dataclasses.replace(two, two_level=False)
  params, x, ct = test_moe._inputs(two, mesh)  # pylint: disable=protected-access
  run = lambda config, ws: jax.tree.map(np.asarray, test_moe._value_and_grads(  # pylint: disable=protected-access
      lambda p, x: moe.moe_apply(p, x, config, mesh, workspace=ws))(params, x, ct))
  with moe.make_workspace(two, mesh, test_moe.TOKENS, training=True) as ws_two, \
      moe.make_workspace(flat, mesh, test_moe.TOKENS, training=True) as ws_flat:
    for a, b in zip(jax.tree.leaves(run(two, ws_two)), jax.tree.leaves(run(flat, ws_flat))):
      np.testing.assert_array_equal(np.atleast_1d(a).view(np.uint8), np.atleast_1d(b).view(np.uint8))


def test_flax_layer_runs_two_levels_on_a_workspace_over_the_local_axis(monkeypatch):
  monkeypatch.delenv(_ffi.ENV_IMPL, raising=False)  # it would turn impl="auto" into the reference
  config = _layer_config()
  mesh = _mesh((2, 4))
  layer = flax_moe.MoE(config=config, mesh=mesh, rngs=nnx.Rngs(params=0), workspace="on")
  x = jax.random.normal(jax.random.key(1), (test_moe.TOKENS, test_moe.HIDDEN)).astype(jnp.bfloat16)
  x = jax.device_put(x.astype(jnp.float32), NamedSharding(mesh, P(AXES)))  # bf16-exact: a lossless wire
  y = nnx.jit(lambda layer, x: layer(x)[0])(layer, x)
  (ws,) = flax_moe._workspaces.values()  # pylint: disable=protected-access
  assert ws.expert_axis == "local"
  np.testing.assert_array_equal(np.asarray(y), np.asarray(moe.moe_apply(layer.params(), x, config, mesh,
                                                                        workspace=ws)[0]))
  y_ref = jax.jit(moe.moe_dense_reference, static_argnums=2)(layer.params(), x, config)[0]
  assert max_rel(y, y_ref) <= test_moe.F32_TOL
  ws.check()
  flax_moe.close_workspaces()


def test_one_process_picks_the_flat_path():
  """Without several processes every device maps every other's memory: None (auto) stays flat."""
  config = test_moe._config(expert_axis=AXES, token_axes=AXES)  # pylint: disable=protected-access
  assert config.two_level is None
  assert not moe.uses_two_level(config, _mesh((2, 4)))
  assert moe.uses_two_level(_layer_config(), _mesh((2, 4)))


# ----------------------------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw,match", [
    (dict(expert_axis="expert", two_level=True), r"two_level=True needs expert_axis of two mesh axes"),
    (dict(expert_axis=("a", "b", "c"), two_level=True), r"two_level=True needs expert_axis of two mesh axes"),
    (dict(expert_axis=AXES, two_level="yes"), r"two_level must be None, True or False, got 'yes'"),
])
def test_config_errors(kw, match):
  with pytest.raises(ValueError, match=match):
    test_moe._config(**kw)  # pylint: disable=protected-access


def test_a_flat_workspace_for_a_two_level_layer_is_refused():
  config = _layer_config()
  mesh = _mesh((2, 4))
  params, x, _ = test_moe._inputs(config, mesh)  # pylint: disable=protected-access
  with Workspace(mesh, expert_axis=AXES, capacity=16, hidden=HIDDEN // 2, top_k=test_moe.TOP_K) as ws:
    with pytest.raises(ValueError, match=r"a two-level layer needs a workspace over its local axis 'local'"):
      moe.moe_apply(params, x, config, mesh, workspace=ws)


def _trace_two_level(mesh, **kw):
  args = dict(num_experts=16, node_axis="node", local_axis="local")
  args.update(kw)
  x, ids, w = _inputs(0, 16)
  body = lambda x, ids, w: dispatch_two_level(x, ids, w, **args)[0].recv_x
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXES), out_specs=P(AXES))).trace(x, ids, w)


@pytest.mark.parametrize("kw,match", [
    (dict(num_experts=12), r"num_experts must be a positive multiple of 8 \(the sizes of 'node' x 'local'\), got 12"),
    (dict(local_axis="node"), r"node_axis and local_axis must be two mesh axes, got 'node' for both"),
    (dict(node_axis="nodes"), r"axis_name must be a mesh axis bound by an enclosing shard_map, got 'nodes'"),
])
def test_dispatch_two_level_rejects_bad_arguments(kw, match):
  with pytest.raises(ValueError, match=match):
    _trace_two_level(_mesh((2, 4)), **kw)


def test_dispatch_two_level_refuses_a_workspace_over_another_axis():
  mesh = _mesh((2, 4))
  with Workspace(mesh, expert_axis=AXES, capacity=16, hidden=HIDDEN, top_k=TOP_K) as ws:
    with pytest.raises(ValueError, match=r"workspace must be created over local_axis 'local' \(one expert group "
                                         r"per node\), got a workspace over \('node', 'local'\)"):
      _trace_two_level(mesh, workspace=ws)


def test_combine_two_level_needs_its_handle():
  with pytest.raises(ValueError, match=r"handle must be the TwoLevelHandle returned by dispatch_two_level, got "
                                       r"DispatchHandle"):
    combine_two_level(jnp.zeros((2, 4, 8)), a2a.DispatchHandle(
        send_slot=jnp.zeros((4, 2), jnp.int32), recv_counts=jnp.zeros((2,), jnp.int32), axis_name="x",
        num_ranks=2, num_experts=2))


def test_a_workspace_over_devices_that_cannot_map_each_other_is_refused(monkeypatch):
  """A group whose devices sit in two memory domains (hosts, for GPUs) fails at creation, naming the devices."""
  monkeypatch.setattr("jax_moe_a2a.workspace._memory_domain", lambda d: ("host", f"h{d.id // 4}"))
  mesh = _mesh((2, 4))
  with pytest.raises(ValueError, match=r"Workspace: the devices of an expert group must be able to map each "
                                       r"other's memory .* device 0 on host h0, .* device 4 on host h1, .* "
                                       r"Give the expert axis as two mesh axes"):
    Workspace(mesh, expert_axis=AXES, capacity=4, hidden=HIDDEN, top_k=TOP_K)
  # Over the local axis every group lies in one domain.
  Workspace(mesh, expert_axis="local", capacity=4, hidden=HIDDEN, top_k=TOP_K).close()


# ----------------------------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_two_level_with_one_node_equals_the_flat_layer_and_the_reference():
  """Every GPU of this host as one node (a node axis of size 1), FP8 wire and FP8 experts, forward and every
  gradient: the two-level layer on its one-sided workspace gives the flat layer's bits (one node: the node
  level moves every token to itself, and each float32 partial sum is the whole sum) and the two-level reference's.

  Except where XLA's own dots take part: the router's and x's gradients come from XLA GEMMs whose algorithm
  (split-K in particular) the autotuner picks per program, so across two programs they agree within float32
  summation order, calc_diff <= 1e-6 (measured on one H200: 1.1e-9 and 6.9e-11 against the reference; bit for bit
  against the flat layer)."""
  n = len(jax.devices())
  mesh = Mesh(np.asarray(jax.devices()).reshape(1, n), AXES)
  base = dict(num_experts=32 * n, top_k=8, hidden=2048, ffn=1024, wire_format="fp8_blockwise", expert_precision="fp8",
              dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, expert_axis=AXES, token_axes=AXES)
  two, flat = moe.MoEConfig(**base, two_level=True), moe.MoEConfig(**base, two_level=False)
  tokens = 4096 * n
  params = moe.init_params(jax.random.key(0), two, mesh)
  sharding = NamedSharding(mesh, P(AXES))
  x = jax.device_put(jax.random.normal(jax.random.key(1), (tokens, base["hidden"]), jnp.bfloat16), sharding)
  ct = jax.device_put(jax.random.normal(jax.random.key(2), (tokens, base["hidden"]), jnp.float32), sharding)
  run = lambda config, ws: jax.tree.map(np.asarray, test_moe._value_and_grads(  # pylint: disable=protected-access
      lambda p, x: moe.moe_apply(p, x, config, mesh, workspace=ws))(params, x, ct))
  with moe.make_workspace(two, mesh, tokens, training=True) as ws_two, \
      moe.make_workspace(flat, mesh, tokens, training=True) as ws_flat:
    got = run(two, ws_two)
    problems = []
    for label, want in (("flat", run(flat, ws_flat)), ("reference", run(two, None))):
      for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        name = jax.tree_util.keystr(path)
        same = np.array_equal(np.atleast_1d(a).view(np.uint8), np.atleast_1d(b).view(np.uint8))
        d = 0.0 if same else calc_diff(a, b)
        print(f"{label} {name}: {'bits equal' if same else f'calc_diff {d:.2e}'}")
        xla_dot = name in ("[2]['router']", "[2]['x']")
        if not same and not (xla_dot and d <= 1e-6):
          problems.append(f"{label} {name}: calc_diff {d:.2e}")
    assert not problems, problems
    ws_two.check()
    ws_flat.check()
