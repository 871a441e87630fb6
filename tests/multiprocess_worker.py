"""One process of tests/test_a2a_multiprocess.py: one GPU per process under jax.distributed.

  python tests/multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT

Checks the one-sided dispatch/combine (workspace mapped through CUDA IPC) against the all_to_all reference, bit for bit,
on this process's shards; prints "OK <process id>" on success.
"""

import sys

import jax

process_id, num_processes, port = (int(a) for a in sys.argv[1:4])
jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=num_processes,
                           process_id=process_id, local_device_ids=[process_id])

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from jax_moe_a2a import a2a  # noqa: E402

AXIS = "ep"
mesh = jax.sharding.Mesh(np.array(jax.devices()), (AXIS,))
num_ranks = mesh.shape[AXIS]
num_tokens, hidden, top_k = 33, 256, 4
num_experts = 4 * num_ranks
rng = np.random.default_rng(0)  # the same global arrays in every process
x = np.asarray(jnp.asarray(rng.standard_normal((num_ranks * num_tokens, hidden)), jnp.bfloat16))
ids = rng.integers(-1, num_experts, (num_ranks * num_tokens, top_k)).astype(np.int32)
weights = rng.random(ids.shape).astype(np.float32)
sharding = NamedSharding(mesh, P(AXIS))
x, ids, weights = (jax.make_array_from_callback(a.shape, sharding, lambda index, a=a: a[index])
                   for a in (x, ids, weights))


def run(ws, impl, steps):
  def body(x, ids, weights):
    def step(i, acc):
      res, handle = a2a.dispatch(acc, ids, weights, num_experts=num_experts, axis_name=AXIS, workspace=ws, impl=impl)
      out = a2a.combine(res.recv_x.astype(jnp.float32) * 0.5, handle, out_dtype=jnp.bfloat16)
      return out + jnp.asarray(1.0, jnp.bfloat16)
    res, handle = a2a.dispatch(x, ids, weights, num_experts=num_experts, axis_name=AXIS, workspace=ws, impl=impl)
    return (res.recv_x[None], res.recv_topk_ids[None], res.recv_topk_weights[None], res.recv_counts[None],
            jax.lax.fori_loop(0, steps, step, x))
  f = jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS),) * 3, out_specs=(P(AXIS),) * 5)
  return jax.block_until_ready(jax.jit(f)(x, ids, weights))


with a2a.Workspace(mesh, expert_axis=AXIS, capacity=num_tokens, hidden=hidden, top_k=top_k,
                   combine_dtype=jnp.float32, timeout_s=30) as ws:
  got = run(ws, "ffi", 100)
  ws.check()
want = run(None, "reference", 100)
for g, w in zip(got, want):
  for gs, ws_ in zip(g.addressable_shards, w.addressable_shards):
    a, b = np.asarray(gs.data), np.asarray(ws_.data)
    view = {1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
    if not np.array_equal(a.view(view), b.view(view)):
      print(f"MISMATCH process {process_id} shape {a.shape}", flush=True)
      sys.exit(1)
print(f"OK {process_id}", flush=True)
jax.distributed.shutdown()
