"""The mesh set with `jax.set_mesh`, taken while tracing (inside `jax.jit`, `jax.grad`, `nnx.jit`): there JAX gives
only its `AbstractMesh` (`jax.sharding.get_mesh` refuses to run), and every entry point must give the same bits as
with the mesh passed explicitly, on Auto and on Explicit mesh axes.

Small shapes (hidden 128, 32 tokens) on a 2 x 4 mesh of simulated CPU devices.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from conftest import devices
from jax_moe_a2a import _ffi, flax_moe, moe

HIDDEN, TOKENS = 128, 32
AXIS_TYPES = [pytest.param(AxisType.Auto, id="auto"), pytest.param(AxisType.Explicit, id="explicit")]
needs_extension = pytest.mark.skipif(not _ffi.available(), reason="compiled extension not built")


def _mesh(axis_type, shape=(2, 4), order=None):
  devs = np.asarray(devices(8))
  if order is not None:
    devs = devs[order]
  return Mesh(devs.reshape(shape), ("data", "expert"), axis_types=(axis_type,) * 2)


def _config(**kw):
  return moe.MoEConfig(num_experts=16, top_k=2, hidden=HIDDEN, ffn=128, **kw)


def _x(mesh):
  x = jax.random.normal(jax.random.key(1), (TOKENS, HIDDEN), jnp.bfloat16)
  return jax.device_put(x, NamedSharding(mesh, P(("data", "expert"), None)))


def _equal(got, want):
  """Equal leaves, bit for bit (the Flax boxes' metadata may name the mesh or its AbstractMesh)."""
  got, want = jax.tree.leaves_with_path(got), jax.tree.leaves_with_path(want)
  assert [path for path, _ in got] == [path for path, _ in want]
  for (path, a), (_, b) in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


def _loss(y):
  return jnp.sum(y.astype(jnp.float32) * jnp.arange(HIDDEN, dtype=jnp.float32) / HIDDEN)


# ----------------------------------------------------------------------------------------------------------------
# The functional layer
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_moe_apply_under_jit_and_grad_takes_the_mesh_of_set_mesh(axis_type):
  """moe_apply without a mesh inside jax.jit, under jax.grad and under both: the outputs and the gradients of params
  and x are those of the mesh passed explicitly, bit for bit."""
  mesh, config = _mesh(axis_type), _config()
  params, x = moe.init_params(jax.random.key(0), config, mesh), _x(mesh)
  grad = lambda m: jax.grad(lambda p, x: _loss(moe.moe_apply(p, x, config, m)[0]), argnums=(0, 1))
  with jax.set_mesh(mesh):
    want = jax.jit(lambda p, x: moe.moe_apply(p, x, config, mesh))(params, x)
    want_grads = jax.jit(grad(mesh))(params, x)
    got = jax.jit(lambda p, x: moe.moe_apply(p, x, config))(params, x)
    got_grads = grad(None)(params, x)
    got_jit_grads = jax.jit(grad(None))(params, x)
  _equal(got, want)
  _equal(got_grads, want_grads)
  _equal(got_jit_grads, want_grads)
  assert got[0].sharding.is_equivalent_to(want[0].sharding, 2)


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_init_params_under_jit_takes_the_mesh_of_set_mesh(axis_type):
  """init_params without a mesh inside jax.jit: the values and shardings of init_params with the mesh."""
  mesh, config = _mesh(axis_type), _config(num_shared_experts=1)
  with jax.set_mesh(mesh):  # jax 0.11 draws other bits over Explicit axes with a mesh set: set for both
    want = moe.init_params(jax.random.key(3), config, mesh)
    got = jax.jit(lambda k: moe.init_params(k, config))(jax.random.key(3))
  assert set(got) == set(want)
  for name, value in want.items():
    np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(value), err_msg=name)
    assert got[name].sharding.is_equivalent_to(value.sharding, value.ndim), (name, got[name].sharding)


def test_an_abstract_mesh_is_taken_while_tracing_and_refused_outside():
  """A mesh given as an AbstractMesh: inside jit without jax.set_mesh it runs (the same bits); outside jit it is
  resolved to the mesh set with jax.set_mesh that it describes, and refused without one."""
  mesh, config = _mesh(AxisType.Auto), _config()
  params, x = moe.init_params(jax.random.key(0), config, mesh), _x(mesh)
  want = moe.moe_apply(params, x, config, mesh)
  _equal(jax.jit(lambda p, x: moe.moe_apply(p, x, config, mesh.abstract_mesh))(params, x), want)
  with jax.set_mesh(mesh):
    assert moe.resolve_mesh("op", mesh.abstract_mesh) is mesh
  with pytest.raises(ValueError, match=r"moe_apply: mesh must be a jax.sharding.Mesh outside jit \(an AbstractMesh "
                                       r"only while tracing, or under jax.set_mesh of a mesh it describes\), got "
                                       r"AbstractMesh"):
    moe.moe_apply(params, x, config, mesh.abstract_mesh)
  with pytest.raises(ValueError, match=r"init_params: mesh must be given, or set with jax.set_mesh\(mesh\), got "
                                       r"neither"):
    jax.jit(lambda k: moe.init_params(k, config))(jax.random.key(0))


def test_two_levels_are_decided_without_devices_in_one_process(monkeypatch):
  """An expert axis of two mesh axes with two_level=None under an AbstractMesh: in one process every device can map
  every other's memory, so the layer is flat (the bits of the mesh given); with devices of several processes and
  no mesh with devices to look at, a ValueError asks for two_level or the mesh."""
  mesh = _mesh(AxisType.Auto)
  config = _config(token_axes=("data", "expert"), expert_axis=("data", "expert"))
  params, x = moe.init_params(jax.random.key(0), config, mesh), _x(mesh)
  assert not moe.uses_two_level(config, mesh) and not moe.uses_two_level(config, mesh.abstract_mesh)
  apply = jax.jit(lambda p, x: moe.moe_apply(p, x, config, mesh.abstract_mesh))
  _equal(apply(params, x), moe.moe_apply(params, x, config, mesh))
  monkeypatch.setattr(jax, "process_count", lambda *_: 2)
  with pytest.raises(ValueError, match=r"uses_two_level: mesh must be a jax.sharding.Mesh to tell whether an expert "
                                       r"group over \('data', 'expert'\) spans hosts \(2 processes\), got the "
                                       r"AbstractMesh \{'data': 2, 'expert': 4\}; set MoEConfig\(two_level="):
    moe.uses_two_level(config, mesh.abstract_mesh)
  seen = []
  with jax.set_mesh(mesh):  # the mesh set with jax.set_mesh has the devices
    jax.make_jaxpr(lambda: seen.append(moe.uses_two_level(config, jax.sharding.get_abstract_mesh())))()
  assert seen == [False]


# ----------------------------------------------------------------------------------------------------------------
# A workspace made outside jit, under the abstract mesh
# ----------------------------------------------------------------------------------------------------------------


@needs_extension
@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_a_workspace_is_matched_with_the_abstract_mesh_by_axis_names_and_sizes(axis_type):
  """A workspace made outside jit on the mesh, used inside jit under jax.set_mesh: the one-sided calls give the
  bits of the mesh given; a mesh of other axis sizes is refused at trace time naming both; one of the same axes but
  other devices when lowered, also by the function traced and lowered before for the workspace's own (JAX would
  otherwise reuse that lowering, which names no devices); make_workspace itself refuses to run inside jit."""
  mesh, config = _mesh(axis_type), _config(impl="ffi")
  params, x = moe.init_params(jax.random.key(0), config, mesh), _x(mesh)
  with moe.make_workspace(config, mesh, TOKENS) as ws:
    want = jax.jit(lambda p, x: moe.moe_apply(p, x, config, mesh, workspace=ws))(params, x)
    apply = jax.jit(lambda p, x: moe.moe_apply(p, x, config, workspace=ws))
    with jax.set_mesh(mesh):
      assert "jax_moe_a2a_dispatch" in str(jax.make_jaxpr(apply)(params, x))
      _equal(apply(params, x), want)
      with pytest.raises(ValueError, match=r"make_workspace: mesh must be a jax.sharding.Mesh \(the workspace is "
                                           r"memory on its devices\), got the AbstractMesh \{'data': 2, 'expert': 4\}"):
        jax.jit(lambda: moe.make_workspace(config, None, TOKENS))()
    other = _mesh(axis_type, (1, 8))
    with jax.set_mesh(other):
      with pytest.raises(ValueError, match=r"moe_apply: the mesh must have the axis names and sizes of the "
                                           r"workspace's mesh, \{'data': 2, 'expert': 4\}, got \{'data': 1, "
                                           r"'expert': 8\}"):
        apply(moe.init_params(jax.random.key(0), config), _x(other))
    reversed_mesh = _mesh(axis_type, order=np.arange(8)[::-1])
    with jax.set_mesh(reversed_mesh):
      with pytest.raises(ValueError, match=r"moe_apply: the mesh's expert groups over 'expert' \(device ids in rank "
                                           r"order\) must be groups of the workspace's mesh, \[\[0, 1, 2, 3\], "
                                           r"\[4, 5, 6, 7\]\], got \[\[7, 6, 5, 4\], \[3, 2, 1, 0\]\]"):
        apply(moe.init_params(jax.random.key(0), config), _x(reversed_mesh))


# ----------------------------------------------------------------------------------------------------------------
# The Flax layers
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_nnx_layer_made_and_called_under_nnx_jit_takes_the_mesh_of_set_mesh(axis_type):
  """The NNX layer made inside nnx.jit under jax.set_mesh has the parameters of the layer given the mesh; called
  under nnx.jit (with gradients) and eagerly it gives the same bits."""
  mesh, config = _mesh(axis_type), _config()
  x = _x(mesh)
  value_and_grad = nnx.jit(lambda layer, x: nnx.value_and_grad(lambda layer: _loss(layer(x)[0]))(layer))
  with jax.set_mesh(mesh):  # for both: jax 0.11 draws other bits over Explicit axes with a mesh set
    want_layer = flax_moe.MoE(config=config, mesh=mesh, rngs=nnx.Rngs(params=0))
    want = value_and_grad(want_layer, x)
    layer = nnx.jit(lambda: flax_moe.MoE(config=config, rngs=nnx.Rngs(params=0)))()
    _equal(layer.params(), want_layer.params())
    got = value_and_grad(layer, x)
    _equal(layer(x)[0], want_layer(x)[0])
  _equal(got, want)


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_linen_layer_init_and_apply_under_jit_take_the_mesh_of_set_mesh(axis_type):
  """LinenMoE without a mesh, its init and apply under jax.jit with jax.set_mesh: the variables and output of the
  layer given the mesh, and its apply outside jit gives them too."""
  mesh, config = _mesh(axis_type), _config()
  x = _x(mesh)
  with jax.set_mesh(mesh):  # Linen's boxes constrain over Explicit axes only with a mesh set
    want_layer = flax_moe.LinenMoE(config=config, mesh=mesh)
    want_variables = jax.jit(want_layer.init)(jax.random.key(0), x)
    want = jax.jit(want_layer.apply)(want_variables, x)
    layer = flax_moe.LinenMoE(config=config)
    variables = jax.jit(layer.init)(jax.random.key(0), x)
    got = jax.jit(layer.apply)(variables, x)
    _equal(layer.apply(variables, x), want)
  _equal(variables, want_variables)
  _equal(got, want)


@needs_extension
def test_layers_make_their_workspace_on_the_devices_of_set_mesh_inside_jit(monkeypatch):
  """workspace="on" inside jit under jax.set_mesh: the layer's workspace is made on the mesh set (the same one as a
  call outside jit keeps) and gives the bits of the reference; with an abstract mesh and no mesh set, a clear error."""
  monkeypatch.delenv(_ffi.ENV_IMPL, raising=False)  # it would turn config.impl="auto" into the reference
  mesh, config = _mesh(AxisType.Auto), _config()
  x = _x(mesh)
  flax_moe.close_workspaces()
  try:
    variables = flax_moe.LinenMoE(config=config, mesh=mesh).init(jax.random.key(0), x)
    want = jax.jit(flax_moe.LinenMoE(config=config, mesh=mesh, workspace="off").apply)(variables, x)
    with jax.set_mesh(mesh):
      layer = flax_moe.LinenMoE(config=config, workspace="on")
      got = jax.jit(layer.apply)(variables, x)
    _equal(got, want)
    assert [key[1] for key in flax_moe._workspaces] == [mesh]  # pylint: disable=protected-access
    with pytest.raises(ValueError, match=r"LinenMoE: mesh must have devices to make the layer's workspace "
                                         r"\(workspace='on'\), got the AbstractMesh \{'data': 2, 'expert': 4\} "
                                         r"with no jax.set_mesh of it; give the layer mesh="):
      jax.jit(flax_moe.LinenMoE(config=config, mesh=mesh.abstract_mesh, workspace="on").apply)(variables, x)
  finally:
    flax_moe.close_workspaces()
