"""Faults of the one-sided calls that gave wrong answers or hung without an error (issue 22), and their guards.

- A workspace used under a mesh that orders its devices otherwise than the workspace's mesh is refused when the call
  is lowered (the handlers take a device's rank and peers from the workspace).
- Every XLA collective of a program with one-sided calls is ordered by data with respect to each of them: XLA:CPU
  runs independent ops of a device program concurrently and in any order, and a device waiting inside a one-sided
  call for a peer that waits inside a collective for it deadlocks. Checked on the compiled HLO, and by many jitted
  training steps, each run in a subprocess under a time limit (a deadlock ends in XLA aborting the process).
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from conftest import devices
from jax_moe_a2a import _ffi, a2a, moe

pytestmark = pytest.mark.skipif(not _ffi.available(), reason="compiled extension not built")


def _bits(a):
  a = np.asarray(a)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


# ----------------------------------------------------------------------------------------------------------------
# The calling mesh must order the devices as the workspace's does
# ----------------------------------------------------------------------------------------------------------------

_HIDDEN, _TOP_K = 16, 2


def _exchange(mesh, ws, axis="ep"):
  """dispatch + combine under `mesh`, each payload naming its origin: (recv_x, recv_topk_ids, recv_counts, out)."""
  num_ranks = mesh.shape[axis]
  num_experts, num_tokens = 2 * num_ranks, 4
  n = mesh.devices.size
  rng = np.random.default_rng(0)
  ids = rng.integers(0, num_experts, (n * num_tokens, _TOP_K)).astype(np.int32)
  weights = rng.random(ids.shape).astype(np.float32)
  x = (np.arange(n * num_tokens)[:, None] + np.zeros((1, _HIDDEN))).astype(jnp.bfloat16)  # row t holds t
  spec = P(mesh.axis_names)
  sharding = NamedSharding(mesh, spec)

  def body(x, ids, weights):
    res, handle = a2a.dispatch(x, ids, weights, num_experts=num_experts, axis_name=axis, workspace=ws)
    out = a2a.combine((res.recv_x.astype(jnp.float32) * 2).astype(jnp.bfloat16), handle, out_dtype=jnp.float32)
    return res.recv_x[None], res.recv_topk_ids[None], res.recv_counts[None], out

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec,) * 4))
  return f(*(jax.device_put(a, sharding) for a in (x, ids, weights)))


def _workspace(mesh, axis="ep"):
  return a2a.Workspace(mesh, expert_axis=axis, capacity=4, hidden=_HIDDEN, top_k=_TOP_K, timeout_s=20)


@pytest.mark.parametrize("case", ["reversed_1x8", "transposed_2x4", "ranks_swapped_2x4"])
def test_a_mesh_ordering_the_devices_otherwise_is_refused_naming_both_orders(case):
  """Without the check, each of these calls runs without an error, and the rows, ids and counts it receives differ
  from the twin's."""
  devs = np.array(devices(8))
  if case == "reversed_1x8":
    ws_mesh, call_mesh = Mesh(devs, ("ep",)), Mesh(devs[::-1], ("ep",))
    want, got = r"\[\[0, 1, 2, 3, 4, 5, 6, 7\]\]", r"\[\[7, 6, 5, 4, 3, 2, 1, 0\]\]"
  elif case == "transposed_2x4":  # other groups: {0, 2, 4, 6} and {1, 3, 5, 7}
    ws_mesh = Mesh(devs.reshape(2, 4), ("data", "ep"))
    call_mesh = Mesh(devs.reshape(4, 2).T, ("data", "ep"))
    want, got = r"\[\[0, 1, 2, 3\], \[4, 5, 6, 7\]\]", r"\[\[0, 2, 4, 6\], \[1, 3, 5, 7\]\]"
  else:  # the same groups, ranks in another order within one of them
    ws_mesh = Mesh(devs.reshape(2, 4), ("data", "ep"))
    call_mesh = Mesh(np.array([devs[:4], devs[4:][::-1]]), ("data", "ep"))
    want, got = r"\[\[0, 1, 2, 3\], \[4, 5, 6, 7\]\]", r"\[\[0, 1, 2, 3\], \[7, 6, 5, 4\]\]"
  with _workspace(ws_mesh) as ws:
    with pytest.raises(ValueError, match=rf"dispatch: the mesh's expert groups over 'ep' \(device ids in rank "
                                         rf"order\) must be groups of the workspace's mesh, {want}, got {got}"):
      _exchange(call_mesh, ws)
    ws.check()  # nothing ran


def test_a_mesh_with_the_workspace_s_groups_and_ranks_equals_the_twin():
  """Another Mesh object, the data axis reversed and renamed: the same groups with the same ranks, so the calls run
  and equal the twin bit for bit."""
  devs = np.array(devices(8))
  ws_mesh = Mesh(devs.reshape(2, 4), ("data", "ep"))
  call_mesh = Mesh(devs.reshape(2, 4)[::-1], ("batch", "ep"))
  want = _exchange(call_mesh, None)
  with _workspace(ws_mesh) as ws:
    got = _exchange(call_mesh, ws)
    ws.check()
  for g, w in zip(got, want):
    np.testing.assert_array_equal(_bits(g), _bits(w))


def test_moe_apply_refuses_a_workspace_made_for_another_device_order():
  devs = np.array(devices(8))
  cfg = moe.MoEConfig(num_experts=8, top_k=2, hidden=64, ffn=32, token_axes=("expert",), expert_axis="expert",
                      dtype=jnp.float32)
  mesh, reversed_mesh = Mesh(devs, ("expert",)), Mesh(devs[::-1], ("expert",))
  params = moe.init_params(jax.random.key(0), cfg, reversed_mesh)
  x = jax.device_put(jax.random.normal(jax.random.key(1), (32, 64)), NamedSharding(reversed_mesh, P("expert")))
  with moe.make_workspace(cfg, mesh, 32) as ws:
    with pytest.raises(ValueError, match=r"moe_apply: the mesh's expert groups over 'expert' .* must be groups of the "
                                         r"workspace's mesh, \[\[0, 1, .*, 7\]\], got \[\[7, 6, .*, 0\]\]"):
      moe.moe_apply(params, x, cfg, reversed_mesh, workspace=ws)
  with moe.make_workspace(cfg, reversed_mesh, 32) as ws:  # made for the mesh it runs on: fine
    y, _ = moe.moe_apply(params, x, cfg, reversed_mesh, workspace=ws)
    ws.check()
  y_ref, _ = moe.moe_apply(params, x, cfg, reversed_mesh)
  np.testing.assert_array_equal(_bits(y), _bits(y_ref))
