"""Faults of the one-sided calls that gave wrong answers or hung without an error (issue 22), and their guards.

- A workspace used under a mesh that orders its devices otherwise than the workspace's mesh is refused when the call
  is lowered (the handlers take a device's rank and peers from the workspace).
- Every XLA collective of a program with one-sided calls is ordered by data with respect to each of them: XLA:CPU
  runs independent ops of a device program concurrently and in any order, and a device waiting inside a one-sided
  call for a peer that waits inside a collective for it deadlocks. Checked on the compiled HLO, and by many jitted
  training steps, each run in a subprocess under a time limit (a deadlock ends in XLA aborting the process).
- A NaN or an infinity in one expert's rows, weights or cotangents, or in rows no expert owns, changes no other
  expert's outputs, row gradients or weight gradients, on every path of the expert MLP (the tiled and ragged_dot
  references, the bf16 and FP8 MLPs on both implementations) and in every grouped GEMM.
- Group sizes whose running total passes int32 clamp in the references as in the custom calls; group sizes given as a
  list of ints are taken, other values refused by name.
- quantize_nvfp4 refuses a concrete global scale that is zero, negative or not finite.
- FP8 round trips (blockwise, MXFP8, weights) of values near the float32 and bfloat16 maximum stay finite, the
  custom call equal to the reference bit for bit.
- The handlers check their attributes before any arithmetic on them: reached directly with num_ranks=0, dispatch
  returns an error instead of killing the process (run in a subprocess, so a crash fails the cases).
"""

import functools
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from conftest import devices, skip_without_one_sided_backward
from jax_moe_a2a import _ffi, a2a, expert_mlp, grouped_gemm, moe, quant

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
    res, handle = a2a.dispatch(x, ids, weights, num_experts=num_experts, axis_name=axis, workspace=ws,
                               impl="reference" if ws is None else "ffi")
    out = a2a.combine((res.recv_x.astype(jnp.float32) * 2).astype(jnp.bfloat16), handle, out_dtype=jnp.float32)
    return res.recv_x[None], res.recv_topk_ids[None], res.recv_counts[None], out

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec,) * 4))
  return f(*(jax.device_put(a, sharding) for a in (x, ids, weights)))


def _workspace(mesh, axis="ep"):
  return a2a.Workspace(mesh, expert_axis=axis, capacity=4, hidden=_HIDDEN, top_k=_TOP_K, timeout_s=20)


@pytest.mark.parametrize("case", ["reversed_1x8", "transposed_2x4", "ranks_swapped_2x4"])
def test_a_mesh_ordering_the_devices_otherwise_is_refused_naming_both_orders(case):
  """Without the check, each of these calls runs without an error, and the rows, ids and counts it receives differ
  from the reference's."""
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


def test_a_mesh_with_the_workspace_s_groups_and_ranks_equals_the_reference():
  """Another Mesh object, the data axis reversed and renamed: the same groups with the same ranks, so the calls run
  and equal the reference bit for bit."""
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


# ----------------------------------------------------------------------------------------------------------------
# Every collective is ordered by data with respect to every one-sided call
# ----------------------------------------------------------------------------------------------------------------

_COLLECTIVES = frozenset({"all-reduce", "all-reduce-start", "all-to-all", "all-gather", "all-gather-start",
                          "reduce-scatter", "collective-permute", "collective-permute-start", "ragged-all-to-all"})
_ONE_SIDED = re.compile(r'custom_call_target="jax_moe_a2a_(dispatch|combine)"')
_HEADER = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s+\(.*\{$")
_INSTRUCTION = re.compile(r"^(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"^(?:\((?:[^()]|\([^()]*\))*\)|\S+)\s+([\w\-]+)\(")
_CALLED = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%([\w.\-]+)"
                     r"|\bbranch_computations=\{([^}]*)\}")


def _called(rest):
  """The computations an instruction calls."""
  return [c for a, b in _CALLED.findall(rest) for c in ([a] if a else re.findall(r"%([\w.\-]+)", b))]


def _group_size(attrs):
  """Devices per replica group of a collective, or None where the text does not say."""
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)  # mesh['data'=2,'expert'=4] {'data'}
  if m:
    sizes = {k.strip("' "): int(v) for k, v in (kv.split("=") for kv in m.group(1).split(","))}
    return int(np.prod([sizes[a.strip("' ")] for a in m.group(2).split(",") if a.strip()]))
  m = re.search(r"replica_groups=\{\{([^}]*)\}", attrs)  # {{0,1},{2,3}}
  if m:
    return len(m.group(1).split(","))
  m = re.search(r"replica_groups=\[\d+,(\d+)\]", attrs)  # [2,4]<=[8]
  return int(m.group(1)) if m else None


def _blocking(rest):
  """'one-sided', 'collective' (over groups of more than one device) or None, for an instruction's text."""
  if _ONE_SIDED.search(rest):
    return "one-sided"
  m = _OPCODE.match(rest)
  if m and m.group(1) in _COLLECTIVES and _group_size(rest) != 1:
    return "collective"
  return None


def _ordering(hlo: str):
  """Parses compiled HLO text: (one-sided calls, collectives, pairs with no data or control path between them).

  A pair is a one-sided call and a collective, or two one-sided calls, of one computation; an instruction that calls
  a computation holding such ops (a while loop, a conditional) stands for them.
  """
  comps, cur = {}, None
  for line in hlo.splitlines():
    s = re.sub(r"/\*.*?\*/", "", line.strip())
    head = _HEADER.match(s)
    if head and "=" not in s.split("(")[0]:
      cur = comps.setdefault(head.group(2), [])
    elif s == "}":
      cur = None
    elif cur is not None and (m := _INSTRUCTION.match(s)):
      cur.append((m.group(1), m.group(2)))

  def kinds_of(comp, seen=()):
    out = set()
    for _, rest in comps.get(comp, []):
      k = _blocking(rest)
      out |= {k} if k else set()
      for c in _called(rest):
        if c not in seen:
          out |= kinds_of(c, seen + (comp,))
    return out

  counts = {"one-sided": 0, "collective": 0}
  unordered = []
  for comp, instrs in comps.items():
    index = {n: i for i, (n, _) in enumerate(instrs)}
    ancestors, blocking = [0] * len(instrs), []
    for i, (name, rest) in enumerate(instrs):
      for op in set(re.findall(r"%([\w.\-]+)", rest.split(", metadata=")[0])):
        j = index.get(op)
        if j is not None and j != i:
          ancestors[i] |= ancestors[j] | (1 << j)
      k = _blocking(rest)
      kinds = {k} if k else set().union(*(kinds_of(c) for c in _called(rest)))
      if k:
        counts[k] += 1
      if kinds:
        blocking.append((i, name, kinds))
    for a, (i, ni, ki) in enumerate(blocking):
      for j, nj, kj in blocking[a + 1:]:
        if "one-sided" in ki | kj and not (ancestors[j] >> i) & 1 and not (ancestors[i] >> j) & 1:
          unordered.append(f"{ni} / {nj}")
  return counts["one-sided"], counts["collective"], unordered


def _moe_step_hlo(mesh_shape, dtype, wire="bf16", training=False, shared=0):
  """Compiled HLO of a jitted forward + backward of moe_apply with a workspace (cotangents given, so that the
  program's only collectives are the layer's): (text, number of devices the program has)."""
  devs = np.array(devices(8))
  sp = len(mesh_shape) == 3
  names = ("data", "tp", "expert") if sp else ("data", "expert")
  mesh = Mesh(devs.reshape(mesh_shape), names)
  cfg = moe.MoEConfig(num_experts=2 * mesh.shape["expert"], top_k=2, hidden=128, ffn=64, wire_format=wire,
                      num_shared_experts=shared, token_axes=("data", "expert"), expert_axis="expert", dtype=dtype,
                      impl="ffi", tp_axis="tp" if sp else None, sequence_parallel=sp)
  params = moe.init_params(jax.random.key(0), cfg, mesh)
  sharding = NamedSharding(mesh, P(("data", "expert")))
  x = jax.device_put(jnp.zeros((64, 128), dtype), sharding)
  ct = {"load_balance_loss": jnp.float32(1.0), "expert_load": np.zeros((cfg.num_experts,), jax.dtypes.float0)}

  def step(params, x, ct_y, ws):
    _, vjp = jax.vjp(lambda p, x: moe.moe_apply(p, x, cfg, mesh, workspace=ws), params, x)
    return vjp((ct_y, ct))

  with moe.make_workspace(cfg, mesh, 64, training=training) as ws:
    return jax.jit(functools.partial(step, ws=ws)).lower(params, x, x).compile().as_text()


_ORDER_CASES = {  # mesh, compute dtype, wire, training, shared experts; one-sided calls in the program
    "1x8_float32": (((1, 8), jnp.float32, "bf16", False, 0), 3),  # issue 22's; combine's VJP on the reference
    "2x4_bf16_shared": (((2, 4), jnp.bfloat16, "bf16", False, 1), 4),
    "2x4_float32_fp8_wire_training": (((2, 4), jnp.float32, "fp8_blockwise", True, 0), 4),
    "sequence_parallel_1x2x4_bf16": (((1, 2, 4), jnp.bfloat16, "bf16", False, 1), 4),
}


@pytest.mark.parametrize("case", list(_ORDER_CASES))
def test_every_collective_of_a_training_step_is_ordered_with_every_one_sided_call(case):
  """Without the ordering, the weights' all_to_all in the wire's VJP, the statistics' all-reduces, the psums of the
  replicated parameters' gradients and the sequence-parallel psum_scatter each have no data path to or from one of
  the one-sided calls, and XLA:CPU may run them in either order on different devices."""
  skip_without_one_sided_backward()
  args, want_calls = _ORDER_CASES[case]
  calls, collectives, unordered = _ordering(_moe_step_hlo(*args))
  assert calls == want_calls and collectives >= 3
  assert unordered == []


def test_the_dispatch_vjp_s_exchanges_are_ordered_with_its_one_sided_combine():
  """a2a.dispatch differentiated directly, FP8 rows with scales: the rows' cotangents go back one-sided, the scales'
  and the weights' by all_to_all, after them by data; combine's VJP (float32 rows, too wide for the FP8 wire) takes
  the reference exchange, after the forward combine by data."""
  skip_without_one_sided_backward()
  mesh = Mesh(np.array(devices(8)), ("ep",))
  num_tokens, hidden, top_k, num_experts = 8, 128, 2, 16
  ws = a2a.Workspace(mesh, expert_axis="ep", capacity=num_tokens, hidden=hidden, top_k=top_k, fmt="fp8_blockwise",
                     combine_dtype=jnp.float32)

  def body(x, x_sf, ids, weights):
    def f(x_sf, weights):
      res, handle = a2a.dispatch(x, ids, weights, num_experts=num_experts, axis_name="ep", x_sf=x_sf, workspace=ws,
                                 impl="ffi")
      rows = res.recv_x.astype(jnp.float32) * res.recv_topk_weights[..., :1]
      return a2a.combine(rows, handle), res.recv_x_sf
    (y, sf), vjp = jax.vjp(f, x_sf, weights)
    return vjp((y, sf))

  spec = P("ep")
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec,) * 2))
  sds = jax.ShapeDtypeStruct
  shapes = [sds((8 * num_tokens, hidden), jnp.float8_e4m3fn), sds((8 * num_tokens, hidden // 128), jnp.float32),
            sds((8 * num_tokens, top_k), jnp.int32), sds((8 * num_tokens, top_k), jnp.float32)]
  with ws:
    calls, collectives, unordered = _ordering(f.lower(*shapes).compile().as_text())
  # dispatch, combine, and the dispatch VJP's combine; the all_to_alls of combine's VJP and the scales' and weights'
  assert calls == 3 and collectives >= 3
  assert unordered == []


# ----------------------------------------------------------------------------------------------------------------
# Many training steps, each case in a subprocess under a time limit
# ----------------------------------------------------------------------------------------------------------------

_STRESS_HIDDEN, _STRESS_TOKENS = 256, 32  # per device; at these sizes XLA:CPU runs a device's independent ops
                                          # concurrently (at much smaller ones it runs them one after another)


def _stress(mesh_shape: tuple[int, int], dtype: str, steps: int) -> None:
  """Runs `steps` jitted forward + backward steps of moe_apply with a workspace; prints "ok <steps>" at the end."""
  devs = np.array(jax.devices()[:int(np.prod(mesh_shape))]).reshape(mesh_shape)
  mesh = Mesh(devs, ("data", "expert"))
  cfg = moe.MoEConfig(num_experts=2 * mesh.shape["expert"], top_k=2, hidden=_STRESS_HIDDEN, ffn=_STRESS_HIDDEN // 2,
                      token_axes=("data", "expert"), expert_axis="expert", dtype=jnp.dtype(dtype), impl="ffi")
  params = moe.init_params(jax.random.key(0), cfg, mesh)
  num_tokens = _STRESS_TOKENS * devs.size
  x = jax.random.normal(jax.random.key(1), (num_tokens, _STRESS_HIDDEN), jnp.float32).astype(cfg.dtype)
  x = jax.device_put(x, NamedSharding(mesh, P(("data", "expert"))))
  with moe.make_workspace(cfg, mesh, num_tokens, timeout_s=5) as ws:
    def loss(params, x):
      y, aux = moe.moe_apply(params, x, cfg, mesh, workspace=ws)
      return jnp.sum(y.astype(jnp.float32) ** 2) + aux["load_balance_loss"]
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    for _ in range(steps):
      jax.block_until_ready(step(params, x))
    ws.check()
  print(f"ok {steps}", flush=True)


def _subprocess_env() -> dict:
  """The environment of a case's subprocess: the package may be a checkout rather than installed (as on the GPU
  machines), so its root goes on the path."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))


def _run_stress(mesh_shape, dtype, steps, timeout_s):
  cmd = [sys.executable, __file__, "stress", "x".join(map(str, mesh_shape)), dtype, str(steps)]
  try:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=_subprocess_env())
  except subprocess.TimeoutExpired as e:
    pytest.fail(f"{steps} steps on a {mesh_shape} mesh did not finish in {timeout_s} s (a deadlock?):\n"
                f"{(e.stdout or b'')[-3000:]}{(e.stderr or b'')[-3000:]}")
  assert r.returncode == 0 and f"ok {steps}" in r.stdout, f"rc {r.returncode}:\n{r.stdout[-3000:]}{r.stderr[-6000:]}"


@pytest.mark.parametrize("mesh_shape,dtype", [((2, 4), "bfloat16"), ((1, 8), "float32")],
                         ids=["2x4-bfloat16", "1x8-float32"])
def test_300_training_steps_with_a_workspace_finish(mesh_shape, dtype):
  """The two settings that deadlocked before the ordering: a 2x4 bf16 run failed in about one run of four (a
  one-sided call timed out waiting for peers that sat in an all_to_all); issue 22 saw 1x8 float32 runs abort too,
  on more cores."""
  skip_without_one_sided_backward()
  devices(8)
  _run_stress(mesh_shape, dtype, steps=300, timeout_s=240)


@pytest.mark.gpu
def test_200_training_steps_with_a_workspace_finish_on_one_gpu():
  devices(1)
  _run_stress((1, 1), "bfloat16", steps=200, timeout_s=300)


# ----------------------------------------------------------------------------------------------------------------
# A NaN or an infinity in one expert's rows or weights stays in that expert's outputs and gradients
# ----------------------------------------------------------------------------------------------------------------

_NAN_SIZES = (3, 0, 6, 4)  # 16 rows: 13 owned (one group empty), 3 that no expert owns
_NAN_ROWS, _NAN_HIDDEN, _NAN_FFN = 16, 128, 128


def _owner(sizes, rows):
  own, start = np.full(rows, -1), 0
  for g, n in enumerate(sizes):
    own[start:start + n] = g
    start += n
  return own


def _mlp(path):
  """fn(x, group_sizes, weights) of one path of the expert MLP."""
  if path.startswith("xla_"):  # swiglu_mlp_xla with this method
    method = path[len("xla_"):]
    return lambda x, gs, w: expert_mlp.swiglu_mlp_xla(x, gs, w, compute_dtype=jnp.float32, method=method)
  kind, impl = path.rsplit("_", 1)
  if kind == "bf16":
    return lambda x, gs, w: expert_mlp.swiglu_mlp_bf16(x, gs, w, impl=impl)
  if kind == "fp8":
    return lambda x, gs, w: expert_mlp.swiglu_mlp_fp8(x, gs, w, impl=impl)
  # fp8_masked: [G, R, hidden] rows, group g owning its first sizes[g]
  def masked(x, gs, w):
    xm = x.reshape(len(_NAN_SIZES), -1, x.shape[-1])
    return expert_mlp.swiglu_mlp_fp8(xm, gs, w, impl=impl).reshape(x.shape)
  return masked


_MLP_PATHS = ["xla_tiled", "xla_ragged_dot", "bf16_ffi", "bf16_reference", "fp8_ffi", "fp8_reference",
              "fp8_masked_ffi", "fp8_masked_reference"]


@pytest.mark.parametrize("poison", ["rows", "weights", "rows_no_expert_owns"])
@pytest.mark.parametrize("path", _MLP_PATHS)
def test_a_nan_in_one_expert_changes_no_other_expert_s_outputs_or_gradients(path, poison):
  """NaN and inf in one expert's rows (and their cotangents), in its weights, or in rows no expert owns: every other
  expert's outputs, row gradients and weight gradients keep their bits, and unowned rows give 0. Without the fixes the
  tiled backward ran a group's last tile into the next group's rows (0 * NaN reached its weight gradients), and
  jax.lax.ragged_dot (the references of the grouped GEMMs) spread a NaN in one group's weights to every row."""
  masked = "masked" in path
  sizes, rows = _NAN_SIZES, _NAN_ROWS
  if masked:  # 4 rows per group: owner of row (g, r) is g for r < sizes[g]
    sizes = (3, 0, 4, 2)
    own = np.array([g if r < n else -1 for g, n in enumerate(sizes) for r in range(rows // len(sizes))])
  else:
    own = _owner(sizes, rows)
  rng = np.random.default_rng(0)
  num_groups = len(sizes)
  x = rng.standard_normal((rows, _NAN_HIDDEN)).astype(np.float32)
  gu = (rng.standard_normal((num_groups, 2 * _NAN_FFN, _NAN_HIDDEN)) / 16).astype(np.float32)
  dn = (rng.standard_normal((num_groups, _NAN_HIDDEN, _NAN_FFN)) / 16).astype(np.float32)
  ct = rng.standard_normal((rows, _NAN_HIDDEN)).astype(np.float32)
  fn = _mlp(path)

  @jax.jit
  def run(x, gu, dn, ct):
    f = lambda x, gu, dn: fn(x, jnp.asarray(sizes, jnp.int32), expert_mlp.ExpertWeights(gu, dn)).astype(jnp.float32)
    y, vjp = jax.vjp(f, x, gu, dn)
    return (y, *vjp(ct))

  with jax.default_matmul_precision("highest"):
    clean = [np.asarray(a) for a in run(x, gu, dn, ct)]
    if poison == "rows":
      bad_g = 2
      x[own == bad_g, 5], x[own == bad_g, 9], ct[own == bad_g, 7] = np.nan, np.inf, np.nan
    elif poison == "weights":
      bad_g = 0
      gu[bad_g, 3, 5], dn[bad_g, 9, 2] = np.nan, np.inf
    else:
      bad_g = -1
      x[own == -1], ct[own == -1] = np.nan, np.inf
    bad = [np.asarray(a) for a in run(x, gu, dn, ct)]
  others = own != bad_g
  for name, c, b in (("y", clean[0], bad[0]), ("dx", clean[1], bad[1])):
    np.testing.assert_array_equal(_bits(b[others]), _bits(c[others]), err_msg=f"{name}: rows of other experts")
  for name, c, b in (("dw_gate_up", clean[2], bad[2]), ("dw_down", clean[3], bad[3])):
    for e in range(num_groups):
      if e != bad_g:
        np.testing.assert_array_equal(_bits(b[e]), _bits(c[e]), err_msg=f"{name}[{e}]")
  assert np.all(bad[0][own == -1] == 0)


_OP_PATHS = ["fp8_contiguous", "fp8_masked", "bf16_nk", "bf16_kn", "bf16_wgrad"]


@pytest.mark.parametrize("impl", ["ffi", "reference"])
@pytest.mark.parametrize("op", _OP_PATHS)
def test_a_nan_in_one_group_of_a_grouped_gemm_reaches_no_other_group(op, impl):
  """Each grouped GEMM, a NaN in group 0's weights (in group 2's rows for the weight gradient): the other groups'
  results keep their bits."""
  rng = np.random.default_rng(1)
  sizes = jnp.asarray(_NAN_SIZES, jnp.int32)
  num_groups, rows, k, n = len(_NAN_SIZES), _NAN_ROWS, 128, 128
  own = _owner(_NAN_SIZES, rows)
  a = rng.standard_normal((rows, k)).astype(np.float32)
  b = rng.standard_normal((num_groups, n, k)).astype(np.float32)

  def run(a, b):
    if op.startswith("fp8"):
      lhs = a.reshape(num_groups, rows // num_groups, k) if op == "fp8_masked" else a
      q, q_sf = quant.quantize_fp8_blockwise(jnp.asarray(lhs.reshape(-1, k)), impl="reference")
      q, q_sf = q.reshape(*lhs.shape), q_sf.reshape(*lhs.shape[:-1], k // 128)
      w, w_sf = quant.quantize_fp8_weight(jnp.asarray(b))
      return np.asarray(grouped_gemm.grouped_gemm_fp8(q, q_sf, w, w_sf, sizes, impl=impl).astype(jnp.float32))
    a16, b16 = jnp.asarray(a, jnp.bfloat16), jnp.asarray(b, jnp.bfloat16)
    if op == "bf16_wgrad":
      return np.asarray(grouped_gemm.grouped_gemm_bf16_wgrad(a16, a16 * 2, sizes, impl=impl))
    if op == "bf16_kn":
      b16 = jnp.swapaxes(b16, 1, 2)
    return np.asarray(grouped_gemm.grouped_gemm_bf16(a16, b16, sizes, b_layout=op[-2:], impl=impl)
                      .astype(jnp.float32))

  clean = run(a, b)
  if op == "bf16_wgrad":
    a[own == 2, 3] = np.nan
    bad = run(a, b)
    for e in (0, 1, 3):
      np.testing.assert_array_equal(_bits(bad[e]), _bits(clean[e]), err_msg=f"group {e}")
    return
  b[0, 5, 7] = np.nan
  bad = run(a, b)
  if op == "fp8_masked":
    clean, bad = clean.reshape(num_groups, -1, n)[1:], bad.reshape(num_groups, -1, n)[1:]
  else:
    clean, bad = clean[own != 0], bad[own != 0]
  np.testing.assert_array_equal(_bits(bad), _bits(clean))


# ----------------------------------------------------------------------------------------------------------------
# Group sizes: a running total past int32 saturates as in the custom call; host lists are taken
# ----------------------------------------------------------------------------------------------------------------


def _gemm_operands(num_groups=3, rows=8):
  rng = np.random.default_rng(2)
  a = jnp.asarray(rng.standard_normal((rows, 128)), jnp.float32)
  b = jnp.asarray(rng.standard_normal((num_groups, 128, 128)), jnp.float32)
  q, q_sf = quant.quantize_fp8_blockwise(a, impl="reference")
  w, w_sf = quant.quantize_fp8_weight(b)
  return (q, q_sf, w, w_sf), (a.astype(jnp.bfloat16), b.astype(jnp.bfloat16))


@pytest.mark.parametrize("sizes", [[2**31 - 1, 1, 1], [5, 2**31 - 1, 2**31 - 1], [-4, 2**31 - 2, 3]],
                         ids=["first_huge", "two_huge", "negative_then_huge"])
def test_group_sizes_whose_running_total_passes_int32_clamp_as_the_custom_call_does(sizes):
  """The reference's int32 cumulative sum wrapped: with sizes [2**31 - 1, 1, 1] groups 1 and 2 came out starting at a
  negative row and took rows the custom call gives to group 0 alone."""
  fp8, (a, b) = _gemm_operands()
  gs = jnp.asarray(sizes, jnp.int32)
  pairs = {
      "fp8": [grouped_gemm.grouped_gemm_fp8(*fp8, gs, impl=i) for i in ("ffi", "reference")],
      "bf16": [grouped_gemm.grouped_gemm_bf16(a, b, gs, impl=i) for i in ("ffi", "reference")],
      "wgrad": [grouped_gemm.grouped_gemm_bf16_wgrad(a, a, gs, impl=i) for i in ("ffi", "reference")],
  }
  # The custom call's rule, in Python integers: each group takes what it asks for of the rows that are left.
  want_start, want_size, taken = [], [], 0
  for v in sizes:
    want_start.append(taken)
    want_size.append(min(max(v, 0), 8 - taken))
    taken += want_size[-1]
  start, size = grouped_gemm.owned_rows(gs, 8, masked=False)
  np.testing.assert_array_equal(np.asarray(start), want_start)
  np.testing.assert_array_equal(np.asarray(size), want_size)
  for name, (ffi, ref) in pairs.items():
    ffi, ref = np.asarray(ffi, np.float32), np.asarray(ref, np.float32)
    np.testing.assert_allclose(ref, ffi, rtol=2e-2, atol=1e-2, err_msg=name)
    assert np.abs(ffi).max() > 0


def test_group_sizes_given_as_a_list_or_an_int32_numpy_array_are_taken():
  fp8, (a, b) = _gemm_operands(num_groups=2)
  want = np.asarray(grouped_gemm.grouped_gemm_fp8(*fp8, jnp.asarray([4, 4], jnp.int32), impl="reference"),
                    np.float32)
  for sizes in ([4, 4], (4, 4), [np.int64(4), 4], np.array([4, 4], np.int32)):
    got = grouped_gemm.grouped_gemm_fp8(*fp8, sizes, impl="reference")
    np.testing.assert_array_equal(np.asarray(got, np.float32), want)
  want = np.asarray(grouped_gemm.grouped_gemm_bf16(a, b, jnp.asarray([4, 4], jnp.int32), impl="reference"))
  np.testing.assert_array_equal(np.asarray(grouped_gemm.grouped_gemm_bf16(a, b, [4, 4], impl="reference")), want)
  want = np.asarray(grouped_gemm.grouped_gemm_bf16_wgrad(a, a, jnp.asarray([4, 4], jnp.int32), impl="reference"))
  np.testing.assert_array_equal(
      np.asarray(grouped_gemm.grouped_gemm_bf16_wgrad(a, a, (4, 4), impl="reference")), want)


@pytest.mark.parametrize("sizes, error, match", [
    ([4.0, 4.0], TypeError, r"grouped_gemm_fp8: group_sizes must be int32 \[G\] \(an int32 array, or a list of "
                            r"ints\), got a list of float64"),
    (np.array([4, 4], np.int64), TypeError, r"grouped_gemm_fp8: group_sizes must be int32, got int64"),
    ([True, False], TypeError, r"grouped_gemm_fp8: group_sizes must be int32 \[G\] .*, got a list of bool"),
    ([2**31, 0], ValueError, r"grouped_gemm_fp8: group_sizes must fit int32 \[-2147483648, 2147483647\], got values "
                             r"in \[0, 2147483648\]"),
])
def test_group_sizes_that_are_not_int32_values_are_refused_by_name(sizes, error, match):
  fp8, _ = _gemm_operands(num_groups=2)
  with pytest.raises(error, match=match):
    grouped_gemm.grouped_gemm_fp8(*fp8, sizes, impl="reference")


# ----------------------------------------------------------------------------------------------------------------
# NVFP4: a concrete global scale must be positive and finite
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0.0, -0.0, -1.0, float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("form", ["python", "numpy", "jax"])
def test_quantize_nvfp4_refuses_a_global_scale_that_is_not_positive_and_finite(value, form):
  """Before: a zero or negative scale gave all-zero codes, a non-finite one blocks that dequantize to NaN."""
  gs = {"python": value, "numpy": np.float32(value), "jax": jnp.float32(value)}[form]
  x = jnp.ones((2, 32), jnp.float32)
  with pytest.raises(ValueError, match=r"quantize_nvfp4: global_scale must be positive and finite "
                                       r"\(0 < global_scale < inf\), got (-?0\.0|-1\.0|nan|-?inf)"):
    quant.quantize_nvfp4(x, global_scale=gs)


def test_quantize_nvfp4_under_jit_runs_as_documented_with_an_unchecked_scale():
  """A traced global scale cannot be checked: zero gives all-zero codes (blocks dequantize to 0), NaN gives NaN."""
  x = jnp.ones((2, 32), jnp.float32)
  f = jax.jit(lambda x, gs: quant.dequantize_nvfp4(*quant.quantize_nvfp4(x, global_scale=gs)[:2], gs))
  np.testing.assert_array_equal(np.asarray(jax.jit(lambda x, gs: quant.quantize_nvfp4(x, global_scale=gs)[0])(
      x, jnp.float32(0.0))), 0)
  assert np.all(np.asarray(f(x, jnp.float32(0.0))) == 0)
  assert np.all(np.isnan(np.asarray(f(x, jnp.float32(np.nan)))))
  np.testing.assert_allclose(np.asarray(f(x, jnp.float32(1 / 1024))), 1.0, rtol=2**-4)  # a valid scale works


# ----------------------------------------------------------------------------------------------------------------
# FP8 round trips of values near the float32 and bfloat16 maximum stay finite
# ----------------------------------------------------------------------------------------------------------------


def _near_max(dtype):
  """[4, 128] values in the top binade of `dtype` (its maximum among them), both signs, and one small row."""
  top = float(jnp.finfo(dtype).max)
  rng = np.random.default_rng(3)
  x = (top * (1.0 - rng.random((4, 128)) * 0.1) * rng.choice([-1.0, 1.0], (4, 128))).astype(np.float32)
  x[0, 0], x[1, 5], x[2] = top, -top, np.linspace(-1, 1, 128)
  return jnp.asarray(x).astype(dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fmt", ["fp8_blockwise_ffi", "fp8_blockwise_reference", "mxfp8", "fp8_weight"])
def test_values_near_the_maximum_stay_finite_after_an_fp8_round_trip(fmt, dtype):
  """Before: the E4M3 code of the largest values rounded up to 256 at scale 2^120, and 256 * 2^120 = 2^128 is inf.
  The error stays within the documented bound |x| * 2^-4 + scale * 2^-10."""
  x = _near_max(jnp.dtype(dtype))
  if fmt.startswith("fp8_blockwise"):
    q, sf = quant.quantize_fp8_blockwise(x, impl=fmt.rsplit("_", 1)[1])
    y, scale = quant.dequantize_fp8_blockwise(q, sf), np.repeat(np.asarray(sf), 128, axis=1)
  elif fmt == "mxfp8":
    q, sf = quant.quantize_mxfp8(x)
    y, scale = quant.dequantize_mxfp8(q, sf), np.repeat(np.asarray(sf, np.float32), 32, axis=1)
  else:
    w = jnp.tile(x, (32, 1))  # one 128x128 block
    q, sf = quant.quantize_fp8_weight(w)
    x, y, scale = w, quant.dequantize_fp8_weight(q, sf), np.full(w.shape, float(np.asarray(sf).max()))
  xf, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  assert np.all(np.isfinite(y)), f"{np.sum(~np.isfinite(y))} values came back non-finite"
  assert np.all(np.abs(y - xf) <= np.abs(xf) * 2**-4 + scale * 2**-10)
  if dtype == "bfloat16":  # the dequantized values are finite in bfloat16 too
    assert np.all(np.isfinite(np.asarray(y.astype(np.float32)).astype(jnp.bfloat16).astype(np.float32)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_the_custom_call_quantizes_values_near_the_maximum_as_the_reference_does(dtype):
  x = _near_max(jnp.dtype(dtype))
  got, want = (quant.quantize_fp8_blockwise(x, impl=i) for i in ("ffi", "reference"))
  for g, w in zip(got, want):
    np.testing.assert_array_equal(_bits(g), _bits(w))


# ----------------------------------------------------------------------------------------------------------------
# Handlers check their attributes before any arithmetic on them (each case in one subprocess: a crash fails it)
# ----------------------------------------------------------------------------------------------------------------

_DISPATCH_ATTRS = dict(buffer_stride=0, capacity=2, num_ranks=1, off_flags=0, off_sync=0, workspace=-1, site=0,
                       num_experts=2, off_x=0, off_x_sf=0, off_ids=0, off_weights=0, off_counts=0, off_ready=0,
                       off_ll=0, off_scan=0, ll_tokens=0, ll_row_bytes=0)
_COMBINE_ATTRS = dict(buffer_stride=0, capacity=2, num_ranks=1, off_flags=0, off_sync=0, workspace=-1, site=0,
                      off_combine=0, off_ready=0)
_ATTR_CASES = {  # name: (target, changed attributes, message)
    "dispatch_valid_attributes": ("dispatch", {}, r"workspace -1 does not exist"),
    "dispatch_num_ranks_0": ("dispatch", {"num_ranks": 0},
                             r"jax_moe_a2a_dispatch: num_ranks must be in \[1, 65536\], got 0"),
    "dispatch_num_ranks_negative": ("dispatch", {"num_ranks": -2},
                                    r"jax_moe_a2a_dispatch: num_ranks must be in \[1, 65536\], got -2"),
    "dispatch_capacity_negative": ("dispatch", {"capacity": -1},
                                   r"jax_moe_a2a_dispatch: capacity must be in \[0, 2147483647\], got -1"),
    "dispatch_capacity_too_large": ("dispatch", {"num_ranks": 4, "capacity": 2**40},
                                    r"jax_moe_a2a_dispatch: capacity must be in \[0, 536870911\], got 1099511627776"),
    "dispatch_offset_negative": ("dispatch", {"off_x": -16},
                                 r"jax_moe_a2a_dispatch: off_x must be in \[0, 281474976710656\], got -16"),
    "dispatch_num_experts_0": ("dispatch", {"num_experts": 0},
                               r"jax_moe_a2a_dispatch: num_experts must be in \[1, 2147483647\], got 0"),
    "combine_num_ranks_0": ("combine", {"num_ranks": 0},
                            r"jax_moe_a2a_combine: num_ranks must be in \[1, 65536\], got 0"),
    "combine_stride_negative": ("combine", {"buffer_stride": -1},
                                r"jax_moe_a2a_combine: buffer_stride must be in \[0, 281474976710656\], got -1"),
    "grouped_gemm_bf16_mode_7": ("grouped_gemm_bf16", {"mode": 7},
                                 r"jax_moe_a2a_grouped_gemm_bf16: mode must be 0 \(NT\), 1 \(NN\) or 2 \(TN\), got 7"),
}


def _call_with_attrs(case: str) -> str:
  """Runs one case of _ATTR_CASES on one device; returns the error message ('' if it ran)."""
  target, changed, _ = _ATTR_CASES[case]
  sds = jax.ShapeDtypeStruct
  if target == "dispatch":
    t, r = 2, 1
    args = (jnp.ones((t, 8), jnp.bfloat16), jnp.zeros((t, 0), jnp.uint8), jnp.zeros((t, 1), jnp.int32),
            jnp.ones((t, 1), jnp.float32), jnp.zeros((1,), jnp.uint8))
    out = (sds((r, t, 8), jnp.bfloat16), sds((r, t, 0), jnp.uint8), sds((r, t, 1), jnp.int32),
           sds((r, t, 1), jnp.float32), sds((r,), jnp.int32), sds((t, r), jnp.int32))
    attrs = {**_DISPATCH_ATTRS, **changed}
  elif target == "combine":
    args = (jnp.ones((1, 2, 8), jnp.bfloat16), jnp.zeros((1,), jnp.int32), jnp.zeros((2, 1), jnp.int32),
            jnp.zeros((1,), jnp.uint8))
    out = sds((2, 8), jnp.bfloat16)
    attrs = {**_COMBINE_ATTRS, **changed}
  else:
    args = (jnp.ones((4, 8), jnp.bfloat16), jnp.ones((1, 8, 8), jnp.bfloat16), jnp.asarray([4], jnp.int32))
    out = (sds((4, 8), jnp.bfloat16), sds((0,), jnp.uint8))
    attrs = {"mode": np.int32(changed["mode"])}
  attrs = {k: (v if isinstance(v, np.int32) else np.int64(v)) for k, v in attrs.items()}
  try:
    jax.block_until_ready(jax.jit(lambda *a: _ffi.ffi_call(target, out, *a, **attrs))(*args))
  except Exception as e:  # pylint: disable=broad-except
    return str(e)
  return ""


@functools.lru_cache(maxsize=1)
def _attr_case_results() -> tuple[int, str]:
  """Runs every case in one subprocess (a SIGFPE ends it): (return code, its output)."""
  cmd = [sys.executable, __file__, "attrs", *_ATTR_CASES]
  r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_subprocess_env())
  return r.returncode, r.stdout + r.stderr


@pytest.mark.parametrize("case", list(_ATTR_CASES))
def test_a_custom_call_with_a_bad_attribute_returns_an_error_naming_it(case):
  """Reached directly (jax.ffi.ffi_call) with num_ranks=0, the dispatch handler divided by it and SIGFPE killed the
  process; every handler now checks its attributes' ranges first and returns an error naming the attribute."""
  rc, output = _attr_case_results()
  line = next((l for l in output.splitlines() if l.startswith(f"case {case}: ")), None)
  assert line is not None, f"no result for {case} (the subprocess ended with rc {rc}):\n{output[-4000:]}"
  assert re.search(_ATTR_CASES[case][2], line), line


if __name__ == "__main__" and sys.argv[1:2] == ["attrs"]:
  for _case in sys.argv[2:]:
    print(f"case {_case}: " + _call_with_attrs(_case).replace("\n", " ")[:2000], flush=True)


if __name__ == "__main__" and sys.argv[1:2] == ["stress"]:
  _stress(tuple(int(n) for n in sys.argv[2].split("x")), sys.argv[3], int(sys.argv[4]))
