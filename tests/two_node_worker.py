"""One process of tests/test_two_nodes.py: one "node" of 4 simulated CPU devices under jax.distributed, the
collectives between processes on gloo.

  python tests/two_node_worker.py PROCESS_ID NUM_PROCESSES PORT

Each process sets $JAX_MOE_A2A_HOST to its own name, so the processes count as hosts: a flat workspace over both
is refused, the layer picks two levels by itself, and its workspace spans this process's devices only. The layer
(forward, load statistics, every gradient) is checked against the dense oracle run here on one device, and the
one-sided inner calls against the reference exchange bit for bit, on this process's shards; prints "OK <process id>".
"""

import os
import sys

process_id, num_processes, port = (int(a) for a in sys.argv[1:4])
os.environ["JAX_MOE_A2A_HOST"] = f"node{process_id}"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=num_processes,
                           process_id=process_id)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from jax_moe_a2a import moe  # noqa: E402
from jax_moe_a2a.testing import max_rel  # noqa: E402
from jax_moe_a2a.workspace import Workspace  # noqa: E402

AXES = ("node", "local")
TOKENS, TOL = 64, 2e-5  # float32 compute, bf16-exact x: only the summation order differs from the oracle

devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
num_local = len(devices) // num_processes
mesh = Mesh(np.array(devices).reshape(num_processes, num_local), AXES)
config = moe.MoEConfig(num_experts=4 * len(devices), top_k=4, hidden=256, ffn=128, dtype=jnp.float32,
                       expert_axis=AXES, token_axes=AXES)
assert config.two_level is None and moe.uses_two_level(config, mesh), "auto must pick two levels across hosts"

try:
  Workspace(mesh, expert_axis=AXES, capacity=8, hidden=256, top_k=4)
  raise AssertionError("a flat workspace over two hosts was created")
except ValueError as e:
  assert "must be able to map each other's memory" in str(e) and "on process 1" in str(e), e

rng = np.random.default_rng(0)  # the same global arrays in every process
host = {}
for name, sds in moe.param_shapes(config).items():
  host[name] = (rng.standard_normal(sds.shape) / np.sqrt(sds.shape[-1])).astype(np.float32)
x_host = np.asarray(jnp.asarray(rng.standard_normal((TOKENS, 256)), jnp.bfloat16).astype(jnp.float32))
ct_host = rng.standard_normal((TOKENS, 256)).astype(np.float32)
place = lambda a, spec: jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda i: a[i])
specs = moe.param_specs(config)
params = {k: place(v, specs[k]) for k, v in host.items()}
x, ct = place(x_host, P(AXES)), place(ct_host, P(AXES))


def value_and_grads(apply):
  def loss(params, x, ct):
    y, aux = apply(params, x)
    return jnp.sum(y * ct) + 0.1 * aux["load_balance_loss"], (y, aux)

  @jax.jit
  def fn(params, x, ct):
    (_, (y, aux)), (g_params, g_x) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x, ct)
    return y, aux, {"x": g_x, **g_params}

  return fn


with moe.make_workspace(config, mesh, TOKENS, training=True) as ws:
  assert ws.expert_axis == "local" and ws.num_ranks == num_local, ws
  got = value_and_grads(lambda p, x: moe.moe_apply(p, x, config, mesh, workspace=ws))(params, x, ct)
  reference = value_and_grads(lambda p, x: moe.moe_apply(p, x, config, mesh))(params, x, ct)
  ws.check()

one = jax.local_devices()[0]
want = value_and_grads(lambda p, x: moe.moe_dense_reference(p, x, config))(
    *jax.device_put(({k: jnp.asarray(v) for k, v in host.items()}, x_host, ct_host), one))

for path, g, t, w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(got), jax.tree.leaves(reference),
                         jax.tree.leaves(want)):
  name = jax.tree_util.keystr(path[0])
  w = np.asarray(w)
  for shard, reference_shard in zip(g.addressable_shards, t.addressable_shards):
    a, b = np.atleast_1d(shard.data), np.atleast_1d(reference_shard.data)
    assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"{name}: one-sided differs from the reference exchange"
    ref = np.atleast_1d(w[shard.index])
    if np.issubdtype(a.dtype, np.integer):
      assert np.array_equal(a, ref), f"{name}: {a} != {ref}"
    else:
      assert max_rel(a, ref) <= TOL, f"{name}: max_rel {max_rel(a, ref):.2e}"
print(f"OK {process_id}", flush=True)
