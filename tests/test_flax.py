"""Tests of the Flax layers (jax_moe_a2a.flax_moe): each equals `moe.moe_apply` on its own parameters, carries
its parameters' shardings, and passes gradients to them."""

import contextlib
import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from conftest import devices, skip_without_one_sided_backward
from jax_moe_a2a import _ffi, flax_moe, moe

HIDDEN = 256


def _setup(fp8_weights=False):
  mesh = Mesh(np.asarray(devices(8)).reshape(2, 4), ("data", "tp"))
  config = moe.MoEConfig(num_experts=16, top_k=4, hidden=HIDDEN, ffn=128, dtype=jnp.float32,
                         token_axes=("data",), expert_axis=("data", "tp"), tp_axis="tp", sequence_parallel=True,
                         num_shared_experts=1, fp8_weights=fp8_weights)
  x = jax.random.normal(jax.random.key(1), (64, HIDDEN), jnp.float32)
  return config, mesh, jax.device_put(x, NamedSharding(mesh, P("data", None)))


def _loss(y):
  return jnp.sum(y * jnp.arange(HIDDEN, dtype=jnp.float32) / HIDDEN)


def test_nnx_module_equals_moe_apply_has_shardings_and_passes_gradients():
  config, mesh, x = _setup()
  layer = flax_moe.MoE(config=config, mesh=mesh, rngs=nnx.Rngs(params=0))
  specs = moe.param_specs(config)
  assert set(layer.param_names) == set(specs)
  for name in layer.param_names:
    var = getattr(layer, name)
    assert isinstance(var, nnx.Param), name
    assert P(*var.get_metadata()["out_sharding"]) == specs[name], name
    assert var[...].sharding.is_equivalent_to(NamedSharding(mesh, specs[name]), var[...].ndim), name

  def loss(layer, x):
    y, aux = layer(x)
    return _loss(y), (y, aux)

  (_, (y, aux)), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(layer, x)
  (_, (y_ref, aux_ref)), ref = jax.value_and_grad(
      lambda p: (lambda y, aux: (_loss(y), (y, aux)))(*moe.moe_apply(p, x, config, mesh)), has_aux=True)(
          layer.params())
  np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))
  np.testing.assert_array_equal(np.asarray(aux["expert_load"]), np.asarray(aux_ref["expert_load"]))
  assert set(ref) == set(layer.param_names)
  for name in layer.param_names:
    g = np.asarray(grads[name][...])
    assert np.any(g != 0), name
    np.testing.assert_allclose(g, np.asarray(ref[name]), rtol=1e-5, atol=1e-6 * np.abs(g).max())


def test_nnx_training_step_updates_only_params():
  config, mesh, x = _setup(fp8_weights=True)
  layer = flax_moe.MoE(config=config, mesh=mesh, rngs=nnx.Rngs(0))
  for name in layer.param_names:
    assert isinstance(getattr(layer, name), flax_moe.FP8Weight if name.startswith("w_") else nnx.Param), name
  assert layer.w_gate_up[...].dtype == jnp.float8_e4m3fn
  before = {name: np.asarray(getattr(layer, name)[...]).astype(np.float32) for name in layer.param_names}

  @nnx.jit
  def step(layer, x):
    grads = nnx.grad(lambda layer: _loss(layer(x)[0]))(layer)
    params = nnx.state(layer, nnx.Param)
    nnx.update(layer, jax.tree.map(lambda p, g: p - 1e-2 * g, params, grads))

  step(layer, x)
  changed = {name for name in layer.param_names
             if not np.array_equal(before[name], np.asarray(getattr(layer, name)[...]).astype(np.float32))}
  assert changed == {"router", "shared_w_gate_up", "shared_w_down"}  # FP8 expert weights are not trained


def test_linen_module_equals_moe_apply_and_gradients_flow():
  config, mesh, x = _setup()
  layer = flax_moe.LinenMoE(config=config, mesh=mesh)
  variables = layer.init(jax.random.key(0), x)
  specs = nn.get_partition_spec(variables)["params"]
  assert specs == moe.param_specs(config)
  params = nn.unbox(variables)["params"]
  assert params["w_gate_up"].sharding.is_equivalent_to(NamedSharding(mesh, specs["w_gate_up"]), 3)

  def loss(apply, p):
    y, aux = apply(p)
    return _loss(y), (y, aux)

  (_, (y, aux)), grads = jax.jit(jax.value_and_grad(lambda v: loss(lambda v: layer.apply(v, x), v), has_aux=True))(
      variables)
  (_, (y_ref, _)), ref = jax.value_and_grad(lambda p: loss(lambda p: moe.moe_apply(p, x, config, mesh), p),
                                            has_aux=True)(params)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))
  assert aux["expert_load"].shape == (16,)
  grads = nn.unbox(grads)["params"]
  for name in ref:
    assert np.any(np.asarray(grads[name]) != 0), name
    np.testing.assert_allclose(np.asarray(grads[name]), np.asarray(ref[name]), rtol=1e-5,
                               atol=1e-6 * np.abs(np.asarray(ref[name])).max())


def test_layers_take_experts_quantized_once_with_the_same_bits():
  """NNX (eager and under nnx.jit) and Linen layers with FP8 experts, given `moe.quantize_experts` of their own
  parameters: the output and the gradients of the call without them."""
  config, mesh, x = _setup()
  config = dataclasses.replace(config, dtype=jnp.bfloat16, expert_precision="fp8", expert_backward="fp8")
  x = x.astype(jnp.bfloat16)
  layer = flax_moe.MoE(config=config, mesh=mesh, rngs=nnx.Rngs(params=0))
  q = moe.quantize_experts(layer.params(), config, mesh)
  np.testing.assert_array_equal(np.asarray(layer(x, quantized_experts=q)[0]), np.asarray(layer(x)[0]))
  grad = lambda q: nnx.jit(nnx.grad(lambda layer, x: _loss(layer(x, quantized_experts=q)[0].astype(jnp.float32))))
  base, got = nnx.state(grad(None)(layer, x)), nnx.state(grad(q)(layer, x))
  for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(got)):
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
  linen = flax_moe.LinenMoE(config=config, mesh=mesh)
  variables = linen.init(jax.random.key(0), x)
  lq = moe.quantize_experts(nn.unbox(variables["params"]), config, mesh)
  np.testing.assert_array_equal(np.asarray(linen.apply(variables, x, quantized_experts=lq)[0]),
                                np.asarray(linen.apply(variables, x)[0]))


def test_modules_reject_a_non_config():
  mesh = Mesh(np.asarray(devices(8)).reshape(2, 4), ("data", "expert"))
  with pytest.raises(TypeError, match="MoE: config must be a moe.MoEConfig, got dict"):
    flax_moe.MoE(config={}, mesh=mesh, rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match="LinenMoE: config must be a moe.MoEConfig, got int"):
    flax_moe.LinenMoE(config=42, mesh=mesh).init(jax.random.key(0), jnp.zeros((8, HIDDEN)))


def _one_sided_calls(fn, *args) -> int:
  return str(jax.make_jaxpr(fn)(*args)).count("jax_moe_a2a_dispatch")


@pytest.mark.skipif(not _ffi.available(), reason="compiled extension not built")
def test_workspace_auto_takes_the_reference_on_cpu_and_on_takes_the_one_sided_calls_with_the_same_result(monkeypatch):
  """On CPU "auto" keeps the reference's collectives; "on" makes (once) and uses a workspace; both give the same loss
  and expert weight gradients (the one-sided calls move the same bits; the GEMMs are the same). The router's
  gradient is a sum over tokens and hidden units that XLA:CPU compiles in each program in an order of its own (since
  jax 0.12.1): it agrees to a float32 rounding of its largest element. Without $JAX_MOE_A2A_IMPL, which would turn
  config.impl="auto" into the reference everywhere."""
  skip_without_one_sided_backward()
  monkeypatch.delenv(_ffi.ENV_IMPL, raising=False)
  config, mesh, x = _setup()
  config = dataclasses.replace(config, impl="auto")
  got = {}
  for mode in ("auto", "on"):
    layer = flax_moe.MoE(config=config, mesh=mesh, rngs=nnx.Rngs(params=0), workspace=mode)
    fn = lambda layer, x: nnx.value_and_grad(lambda layer: _loss(layer(x)[0]))(layer)
    one_sided = mode == "on" or jax.default_backend() == "gpu"
    assert _one_sided_calls(lambda x: layer(x)[0], x) == (1 if one_sided else 0)
    got[mode] = nnx.jit(fn)(layer, x)
  assert len(flax_moe._workspaces) == 1  # pylint: disable=protected-access
  ws = next(iter(flax_moe._workspaces.values()))  # pylint: disable=protected-access
  layer = flax_moe.MoE(config=config, mesh=mesh, rngs=nnx.Rngs(params=0), workspace="on")
  layer(x)
  assert next(iter(flax_moe._workspaces.values())) is ws  # pylint: disable=protected-access  (kept, not remade)
  ws.check()
  flax_moe.close_workspaces()
  assert ws.closed and not flax_moe._workspaces  # pylint: disable=protected-access
  (loss_a, g_a), (loss_b, g_b) = got["auto"], got["on"]
  np.testing.assert_array_equal(np.asarray(loss_a), np.asarray(loss_b))
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_a), jax.tree.leaves(g_b)):
    a, b = np.asarray(a), np.asarray(b)
    if jax.tree_util.keystr(path).startswith("['router']"):
      np.testing.assert_allclose(a, b, rtol=0, atol=2.0**-23 * float(np.abs(a).max()))
    else:
      np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


@pytest.mark.skipif(not _ffi.available(), reason="compiled extension not built")
def test_linen_workspace_on_uses_the_one_sided_calls(monkeypatch):
  monkeypatch.delenv(_ffi.ENV_IMPL, raising=False)  # it would turn config.impl="auto" into the reference
  config, mesh, x = _setup()
  layer = flax_moe.LinenMoE(config=config, mesh=mesh, workspace="on")
  variables = layer.init(jax.random.key(0), x)
  assert _one_sided_calls(lambda v: layer.apply(v, x)[0], variables) == 1
  y = jax.jit(lambda v: layer.apply(v, x)[0])(variables)
  y_ref = flax_moe.LinenMoE(config=config, mesh=mesh, workspace="off").apply(variables, x)[0]  # op by op
  np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=0, atol=1e-6 * float(np.abs(y_ref).max()))
  flax_moe.close_workspaces()


@pytest.mark.skipif(not _ffi.available(), reason="compiled extension not built")
def test_functions_jitted_before_close_workspaces_make_new_workspaces(monkeypatch):
  """A function jitted (nnx.jit, jax.jit closing over the layer, the one the layer runs outside jit) before
  close_workspaces runs again after it, on a new workspace of the layer, with the same result: the compiled one held
  the closed workspace's id."""
  monkeypatch.delenv(_ffi.ENV_IMPL, raising=False)  # it would turn config.impl="auto" into the reference
  config, mesh, x = _setup()
  flax_moe.close_workspaces()
  layer = flax_moe.MoE(config=config, mesh=mesh, rngs=nnx.Rngs(params=0), workspace="on")
  linen = flax_moe.LinenMoE(config=config, mesh=mesh, workspace="on")
  variables = linen.init(jax.random.key(0), x)
  by_nnx = nnx.jit(lambda layer, x: layer(x)[0])
  by_jax = jax.jit(lambda x: layer(x)[0])
  by_linen = jax.jit(lambda v, x: linen.apply(v, x)[0])
  want = [by_nnx(layer, x), by_jax(x), by_linen(variables, x), layer(x)[0]]  # the last: jitted inside the layer
  (old,) = flax_moe._workspaces.values()  # pylint: disable=protected-access
  flax_moe.close_workspaces()
  try:
    got = [np.asarray(y) for y in (by_nnx(layer, x), by_jax(x), by_linen(variables, x), layer(x)[0])]
    (new,) = flax_moe._workspaces.values()  # pylint: disable=protected-access
    assert old.closed and not new.closed
    new.check()
  finally:
    flax_moe.close_workspaces()
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a, np.asarray(b))


@pytest.mark.skipif(not _ffi.available(), reason="compiled extension not built")
@pytest.mark.parametrize("wire_format", ["mxfp8", "nvfp4"])
def test_layers_on_a_microscaled_wire_equal_moe_apply(monkeypatch, wire_format):
  """The Flax layers take the config's wire format as it is: NNX with workspace="on" makes a workspace sized for the
  format and equals moe_apply on it, Linen equals moe_apply without one, bit for bit."""
  monkeypatch.delenv(_ffi.ENV_IMPL, raising=False)  # it would turn config.impl="auto" into the reference
  flax_moe.close_workspaces()
  config, mesh, x = _setup()
  config = dataclasses.replace(config, wire_format=wire_format, impl="auto")
  layer = flax_moe.MoE(config=config, mesh=mesh, rngs=nnx.Rngs(params=0), workspace="on")
  y = nnx.jit(lambda layer, x: layer(x)[0])(layer, x)
  (ws,) = flax_moe._workspaces.values()  # pylint: disable=protected-access
  assert ws.layout.dispatch.fmt == wire_format
  np.testing.assert_array_equal(np.asarray(y), np.asarray(moe.moe_apply(layer.params(), x, config, mesh,
                                                                        workspace=ws)[0]))
  ws.check()
  flax_moe.close_workspaces()
  linen = flax_moe.LinenMoE(config=config, mesh=mesh, workspace="off")
  variables = linen.init(jax.random.key(0), x)
  y = jax.jit(linen.apply)(variables, x)[0]
  np.testing.assert_array_equal(np.asarray(y), np.asarray(moe.moe_apply(nn.unbox(variables)["params"], x, config,
                                                                        mesh)[0]))


def test_modules_reject_an_unknown_workspace_mode():
  config, mesh, x = _setup()
  with pytest.raises(ValueError, match=r"MoE: workspace must be one of 'auto', 'on', 'off', None \(as 'off'\) or "
                                       r"an a2a.Workspace, got 'yes'"):
    flax_moe.MoE(config=config, mesh=mesh, rngs=nnx.Rngs(0), workspace="yes")
  with pytest.raises(ValueError, match=r"LinenMoE: workspace must be one of .* got 1"):
    flax_moe.LinenMoE(config=config, mesh=mesh, workspace=1).init(jax.random.key(0), x)


def test_layers_take_the_mesh_set_with_jax_set_mesh():
  """MoE and LinenMoE without a mesh use the one set with jax.set_mesh: the same parameters and output as with it;
  with neither, a clear error."""
  config, mesh, x = _setup()
  want = flax_moe.MoE(config=config, mesh=mesh, rngs=nnx.Rngs(params=0))
  linen_want = flax_moe.LinenMoE(config=config, mesh=mesh)
  variables = linen_want.init(jax.random.key(0), x)
  with jax.set_mesh(mesh):
    got = flax_moe.MoE(config=config, rngs=nnx.Rngs(params=0))
    y = got(x)[0]
    linen_got = flax_moe.LinenMoE(config=config)
    got_variables = linen_got.init(jax.random.key(0), x)
    y_linen = linen_got.apply(got_variables, x)[0]
  np.testing.assert_array_equal(np.asarray(y), np.asarray(want(x)[0]))
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got_variables, variables)
  np.testing.assert_array_equal(np.asarray(y_linen), np.asarray(linen_want.apply(variables, x)[0]))
  with pytest.raises(ValueError, match=r"MoE: mesh must be given, or set with jax.set_mesh\(mesh\), got neither"):
    flax_moe.MoE(config=config, rngs=nnx.Rngs(params=0))
  with pytest.raises(ValueError, match=r"LinenMoE: mesh must be given, or set with jax.set_mesh"):
    flax_moe.LinenMoE(config=config).init(jax.random.key(0), x)


# ------------------------------------------------------------------------------------------------------------------
# Calling the layers fast (flax_moe's module docstring): the same bits as moe_apply, no retrace per call, and no
# parameter copied out of the program.
# ------------------------------------------------------------------------------------------------------------------


def _has_tree_mode() -> bool:
  return {"graph", "graph_updates"} <= set(inspect.signature(nnx.jit).parameters)


def _nnx_calls(layer):
  """The ways the NNX layer is called, each a function of x returning (y, aux)."""
  apply, state = flax_moe.jit_apply(layer)
  plain = nnx.jit(lambda layer, x: layer(x))
  calls = {"eager": layer, "nnx.jit": lambda x: plain(layer, x), "jit_apply": lambda x: apply(state, x)}
  if _has_tree_mode():
    tree = nnx.jit(lambda layer, x: layer(x), graph=False)
    calls["nnx.jit tree"] = lambda x: tree(layer, x)
  return calls


def test_every_way_of_calling_the_layers_gives_moe_apply_bits():
  config, mesh, x = _setup()
  layer = flax_moe.MoE(config=config, mesh=mesh, rngs=nnx.Rngs(params=0))
  want_y, want_aux = jax.jit(lambda p, x: moe.moe_apply(p, x, config, mesh))(layer.params(), x)
  linen = flax_moe.LinenMoE(config=config, mesh=mesh)
  variables = linen.init(jax.random.key(0), x)
  linen_y, linen_aux = jax.jit(lambda p, x: moe.moe_apply(p, x, config, mesh))(nn.unbox(variables)["params"], x)
  got = {name: (call(x), (want_y, want_aux)) for name, call in _nnx_calls(layer).items()}
  got["linen"] = (jax.jit(linen.apply)(variables, x), (linen_y, linen_aux))
  assert len(got) >= 4
  for name, ((y, aux), (y_ref, aux_ref)) in got.items():
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref), err_msg=name)
    for k in aux_ref:
      np.testing.assert_array_equal(np.asarray(aux[k]), np.asarray(aux_ref[k]), err_msg=f"{name} {k}")


def test_jit_apply_is_differentiable_in_the_state_with_moe_apply_gradients():
  config, mesh, x = _setup()
  layer = flax_moe.MoE(config=config, mesh=mesh, rngs=nnx.Rngs(params=0))
  apply, state = flax_moe.jit_apply(layer)
  grads = jax.jit(jax.grad(lambda s, x: _loss(apply(s, x)[0])))(state, x)
  ref = jax.jit(jax.grad(lambda p, x: _loss(moe.moe_apply(p, x, config, mesh)[0])))(layer.params(), x)
  for name in layer.param_names:
    np.testing.assert_array_equal(np.asarray(grads[name][...]), np.asarray(ref[name]), err_msg=name)


def test_jit_apply_rejects_what_is_not_an_nnx_layer():
  config, mesh, _ = _setup()
  with pytest.raises(TypeError, match="jit_apply: layer must be a flax_moe.MoE, got LinenMoE"):
    flax_moe.jit_apply(flax_moe.LinenMoE(config=config, mesh=mesh))


@contextlib.contextmanager
def _traces_and_compiles():
  """Counts JAX's traces to a jaxpr and backend compiles while the block runs."""
  counts = {"trace": 0, "compile": 0}
  events = {"/jax/core/compile/jaxpr_trace_duration": "trace", "/jax/core/compile/backend_compile_duration": "compile"}

  def listener(event, duration, **kwargs):
    if event in events:
      counts[events[event]] += 1

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield counts
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def test_calls_after_the_first_neither_trace_nor_compile():
  """Each way of calling the layers traces and compiles on its first call only: nothing the layer keeps (config,
  mesh, workspace, the jitted eager path) changes or is rebuilt from call to call."""
  config, mesh, x = _setup()
  layer = flax_moe.MoE(config=config, mesh=mesh, rngs=nnx.Rngs(params=0))
  calls = _nnx_calls(layer)
  linen = flax_moe.LinenMoE(config=config, mesh=mesh)
  variables = linen.init(jax.random.key(0), x)
  linen_apply = jax.jit(linen.apply)
  calls["linen"] = lambda x: linen_apply(variables, x)
  xs = [x * (i + 1) for i in range(3)]
  jax.clear_caches()  # so that each path's first call traces here, also where an earlier test ran it
  for name, call in calls.items():
    with _traces_and_compiles() as first:
      jax.block_until_ready(call(xs[0]))
    assert first["trace"] >= 1, name  # the counter sees this path's first trace
    with _traces_and_compiles() as later:
      for xi in xs:
        jax.block_until_ready(call(xi))
    assert later == {"trace": 0, "compile": 0}, name


def _output_bytes(jitted, *args) -> int:
  return jitted.lower(*args).compile().memory_analysis().output_size_in_bytes


def test_fast_calls_return_no_parameter_and_plain_nnx_jit_returns_them_all():
  """The cause of plain nnx.jit's cost, and its absence from the fast calls: their programs return what moe_apply's
  returns, nnx.jit's in graph mode with graph updates also a copy of every parameter."""
  config, mesh, x = _setup()
  layer = flax_moe.MoE(config=config, mesh=mesh, rngs=nnx.Rngs(params=0))
  params = layer.params()
  want = _output_bytes(jax.jit(lambda p, x: moe.moe_apply(p, x, config, mesh)), params, x)
  param_bytes = sum(v.addressable_shards[0].data.nbytes for v in params.values())  # per device, as the program's
  apply, state = flax_moe.jit_apply(layer)
  assert _output_bytes(apply, state, x) == want
  if _has_tree_mode():
    assert _output_bytes(nnx.jit(lambda layer, x: layer(x), graph=False), layer, x) == want
    graph_mode = nnx.jit(lambda layer, x: layer(x), graph=True, graph_updates=True)
  else:
    graph_mode = nnx.jit(lambda layer, x: layer(x))
  assert _output_bytes(graph_mode, layer, x) >= want + param_bytes  # (and 8 bytes per output for the tuple)


@pytest.mark.gpu
def test_gpu_fast_calls_take_the_one_sided_calls_with_moe_apply_bits(monkeypatch):
  """On GPUs the layer's default workspace ("auto") puts the one-sided calls in every fast call (outside jit,
  jit_apply, tree mode), each giving moe_apply's bits on that workspace."""
  monkeypatch.delenv(_ffi.ENV_IMPL, raising=False)  # it would turn config.impl="auto" into the reference
  assert jax.default_backend() == "gpu"
  n = jax.device_count()
  mesh = jax.make_mesh((1, n), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  config = moe.MoEConfig(num_experts=8 * n, top_k=2, hidden=256, ffn=512)  # the README's quickstart: bf16
  x = jax.device_put(jax.random.normal(jax.random.key(1), (64 * n, 256), jnp.bfloat16),
                     NamedSharding(mesh, P(config.token_axes, None)))
  flax_moe.close_workspaces()
  try:
    layer = flax_moe.MoE(config=config, mesh=mesh, rngs=nnx.Rngs(params=0))
    apply, state = flax_moe.jit_apply(layer)
    assert _one_sided_calls(lambda s, x: apply(s, x)[0], state, x) == 1
    got = {name: call(x) for name, call in _nnx_calls(layer).items()}
    (ws,) = flax_moe._workspaces.values()  # pylint: disable=protected-access
    y_ref, aux_ref = jax.jit(lambda p, x: moe.moe_apply(p, x, config, mesh, workspace=ws))(layer.params(), x)
    ws.check()
  finally:
    flax_moe.close_workspaces()
  for name, (y, aux) in got.items():
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref), err_msg=name)
    np.testing.assert_array_equal(np.asarray(aux["expert_load"]), np.asarray(aux_ref["expert_load"]), err_msg=name)


@pytest.mark.skipif(not _ffi.available(), reason="compiled extension not built")
def test_workspace_auto_keeps_the_collectives_for_a_dtype_the_one_sided_calls_do_not_combine(monkeypatch):
  """The one-sided calls combine bfloat16 and float32 rows: on GPUs (made to look present here) "auto" takes them
  for float32 and the reference's collectives for float16, and "on" refuses float16 by name."""
  skip_without_one_sided_backward()
  monkeypatch.delenv(_ffi.ENV_IMPL, raising=False)
  monkeypatch.setattr(_ffi, "with_cuda", lambda: True)
  monkeypatch.setattr(flax_moe, "_on_gpus", lambda mesh: True)
  config, mesh, x = _setup()
  config = dataclasses.replace(config, impl="auto")
  layer = flax_moe.MoE(config=config, mesh=mesh, rngs=nnx.Rngs(params=0), workspace="auto")
  assert _one_sided_calls(lambda x: layer(x)[0], x) == 1
  config = dataclasses.replace(config, dtype=jnp.float16)
  x = x.astype(jnp.float16)
  layer = flax_moe.MoE(config=config, mesh=mesh, rngs=nnx.Rngs(params=0), workspace="auto")
  assert _one_sided_calls(lambda x: layer(x)[0], x) == 0
  want = flax_moe.MoE(config=config, mesh=mesh, rngs=nnx.Rngs(params=0), workspace="off")(x)[0]
  np.testing.assert_array_equal(np.asarray(layer(x)[0]), np.asarray(want))
  with pytest.raises(ValueError, match="make_workspace: the one-sided exchange combines bfloat16 or float32 rows, "
                                       "got config.dtype float16"):
    flax_moe.MoE(config=config, mesh=mesh, rngs=nnx.Rngs(params=0), workspace="on")(x)
  flax_moe.close_workspaces()
