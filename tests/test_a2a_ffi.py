"""The one-sided dispatch/combine custom calls against the pure-JAX reference: bit for bit, faults, life cycle.

On CPU the simulated devices meet at a process-wide meeting point per call; on a GPU machine (JAX_MOE_A2A_TEST_GPU=1) the
same tests run over NVLink peer memory on every visible GPU.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import skip_without_one_sided_backward
from jax_moe_a2a import _ffi, a2a, layout, quant
from jax_moe_a2a.wire import wire_dispatch

pytestmark = pytest.mark.skipif(not _ffi.available(), reason="compiled extension not built")
AXIS = "ep"


def _bits(a):
  a = np.asarray(a)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _mesh(num_ranks=None):
  devices = jax.devices()
  num_ranks = num_ranks or len(devices)
  return jax.sharding.Mesh(np.array(devices[:num_ranks]), (AXIS,))


def _need_two_ranks(mesh):
  if mesh.shape[AXIS] < 2:
    pytest.skip(f"needs at least two devices on the expert axis, this run has {mesh.shape[AXIS]}")


def _put(mesh, *arrays):
  sharding = NamedSharding(mesh, P(mesh.axis_names))
  return [None if a is None else jax.device_put(a, sharding) for a in arrays]


def _routing(rng, num_ranks, num_tokens, top_k, num_experts, case):
  ids = rng.integers(0, num_experts, (num_ranks * num_tokens, top_k)).astype(np.int32)
  if case == "invalid":
    ids[rng.random(ids.shape) < 0.3] = -1
    ids[0, :] = -1
    ids[min(1, len(ids) - 1), 0] = num_experts + 3  # out of range: no expert
  elif case == "one_rank":
    local = num_experts // num_ranks
    ids = rng.integers(0, local, ids.shape).astype(np.int32) + local * (num_ranks - 1)  # all on the last rank
  elif case == "nobody_to_rank0":
    local = num_experts // num_ranks
    ids = rng.integers(local, num_experts, ids.shape).astype(np.int32)
  weights = rng.random(ids.shape).astype(np.float32)
  return ids, weights


def _inputs(mesh, seed, num_tokens, hidden, top_k, num_experts, case, fmt="bf16"):
  """(x, x_sf, ids, weights) on the mesh: random bf16 rows (fp8_blockwise: quantized, with scales; else x_sf is
  None) and a routing of `case`, drawn from one seeded generator."""
  rng = np.random.default_rng(seed)
  ids, weights = _routing(rng, mesh.shape[AXIS], num_tokens, top_k, num_experts, case)
  x = jnp.asarray(rng.standard_normal((mesh.shape[AXIS] * num_tokens, hidden)), jnp.bfloat16)
  x_sf = None
  if fmt == "fp8_blockwise":
    x, x_sf = quant.quantize_fp8_blockwise(x, impl="reference")
  return _put(mesh, x, x_sf, ids, weights)


def _run(mesh, ws, x, x_sf, ids, weights, num_experts, impl, combine_dtype=jnp.bfloat16):
  spec = P(AXIS)

  def body(x, x_sf, ids, weights):
    res, handle = a2a.dispatch(x, ids, weights, num_experts=num_experts, axis_name=AXIS, x_sf=x_sf, workspace=ws,
                               impl=impl)
    expert_out = (res.recv_x.astype(jnp.float32) * 1.5 if res.recv_x.dtype != jnp.float8_e4m3fn
                  else res.recv_x.astype(jnp.float32)).astype(combine_dtype)
    out = a2a.combine(expert_out, handle, out_dtype=jnp.float32)
    recv_sf = res.recv_x_sf if res.recv_x_sf is not None else jnp.zeros((1,), jnp.float32)
    return (res.recv_x[None], recv_sf[None], res.recv_topk_ids[None], res.recv_topk_weights[None],
            res.recv_counts[None], handle.send_slot, out)

  if x_sf is None:
    f = jax.shard_map(lambda x, i, w: body(x, None, i, w), mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec,) * 7)
    return jax.jit(f)(x, ids, weights)
  f = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec,) * 7)
  return jax.jit(f)(x, x_sf, ids, weights)


def _assert_outputs_equal(got, want):
  names = ("recv_x", "recv_x_sf", "recv_topk_ids", "recv_topk_weights", "recv_counts", "send_slot", "combine")
  for name, g, w in zip(names, got, want):
    assert g.shape == w.shape and g.dtype == w.dtype, name
    np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=name)


@pytest.mark.parametrize("case", ["random", "invalid", "one_rank", "nobody_to_rank0"])
@pytest.mark.parametrize("num_tokens,top_k", [(1, 1), (7, 3), (33, 8)])
def test_dispatch_combine_equal_the_reference_bf16(case, num_tokens, top_k):
  mesh = _mesh()
  num_ranks = mesh.shape[AXIS]
  if case == "nobody_to_rank0":
    _need_two_ranks(mesh)
  num_experts = 4 * num_ranks
  x, _, ids, weights = _inputs(mesh, num_tokens * 31 + top_k, num_tokens, 96, top_k, num_experts, case)
  with a2a.Workspace(mesh, expert_axis=AXIS, capacity=num_tokens, hidden=96, top_k=top_k, timeout_s=20) as ws:
    got = _run(mesh, ws, x, None, ids, weights, num_experts, "ffi")
    want = _run(mesh, None, x, None, ids, weights, num_experts, "reference")
    _assert_outputs_equal(got, want)
    if case == "nobody_to_rank0":
      assert int(np.asarray(got[4]).reshape(num_ranks, num_ranks)[0].sum()) == 0  # rank 0 received nothing


def test_calls_of_zero_tokens_equal_the_reference():
  """A shard of no tokens still returns counts (all zero) and an empty combine, on a workspace of larger capacity."""
  mesh = _mesh()
  num_experts = 2 * mesh.shape[AXIS]
  x, _, ids, weights = _inputs(mesh, 3, 0, 64, 2, num_experts, "random")
  with a2a.Workspace(mesh, expert_axis=AXIS, capacity=4, hidden=64, top_k=2, timeout_s=20) as ws:
    got = _run(mesh, ws, x, None, ids, weights, num_experts, "ffi")
    want = _run(mesh, None, x, None, ids, weights, num_experts, "reference")
  _assert_outputs_equal(got, want)


# On GPUs a dispatch of more than 512 tokens numbers its slots with a scan over the sender blocks' counts (each block
# counts its own range and adds up the earlier blocks'), smaller ones by counting every token before a block's range.
# 700 tokens of 8 KiB rows (4 pieces) give an H200's sender blocks 10-11 tokens each: items of two pieces.
@pytest.mark.parametrize("case,num_tokens,hidden", [(case, n, 64) for case in ("random", "invalid", "nobody_to_rank0")
                                                    for n in (513, 2731)] + [("random", 700, 4096)])
def test_large_dispatch_combine_equal_the_reference(case, num_tokens, hidden):
  mesh = _mesh()
  if case == "nobody_to_rank0":
    _need_two_ranks(mesh)
  num_ranks, top_k = mesh.shape[AXIS], 8
  num_experts = 4 * num_ranks
  x, _, ids, weights = _inputs(mesh, num_tokens + len(case), num_tokens, hidden, top_k, num_experts, case)
  with a2a.Workspace(mesh, expert_axis=AXIS, capacity=num_tokens, hidden=hidden, top_k=top_k, timeout_s=20) as ws:
    got = _run(mesh, ws, x, None, ids, weights, num_experts, "ffi")
    want = _run(mesh, None, x, None, ids, weights, num_experts, "reference")
    _assert_outputs_equal(got, want)
    # Twice more on the same workspace: the scan words of the call before carry its epoch, never this call's.
    for _ in range(2):
      _assert_outputs_equal(_run(mesh, ws, x, None, ids, weights, num_experts, "ffi"), want)


# The other two wire formats, as opaque bytes (every byte value, E4M3 and E8M0 NaNs included): MXFP8 (E4M3 rows, an
# E8M0 scale per 32, scale rows of 7 bytes at hidden 224 or padded to 4 by mx_alignment) and NVFP4 (two E2M1 per
# byte, an E4M3 scale per 16: rows of 24 + 3 bytes at hidden 48, 3584 + 448 at 7168). On GPUs 8 tokens go in LL
# form where the rows allow it, 70 in fenced pieces.
@pytest.mark.parametrize("fmt,hidden,mx_alignment", [("mxfp8", 224, None), ("mxfp8", 96, 128), ("nvfp4", 48, None),
                                                     ("nvfp4", 7168, None)])
@pytest.mark.parametrize("num_tokens", [8, 70])
def test_mxfp8_and_nvfp4_payloads_equal_the_reference(fmt, hidden, mx_alignment, num_tokens):
  mesh = _mesh()
  num_ranks, top_k = mesh.shape[AXIS], 4
  num_experts = 4 * num_ranks
  d = layout.dispatch_layout(hidden, fmt, top_k=top_k, mx_alignment=mx_alignment)
  rng = np.random.default_rng(num_tokens + hidden)
  ids, weights = _routing(rng, num_ranks, num_tokens, top_k, num_experts, "invalid")
  rows = num_ranks * num_tokens
  raw = rng.integers(0, 256, (rows, d.x_bytes_per_token + d.x_sf_bytes_per_token), dtype=np.uint8)
  raw[:, :256] = np.arange(256, dtype=np.uint8)[:min(256, raw.shape[1])]
  x, x_sf = raw[:, :d.x_bytes_per_token], raw[:, d.x_bytes_per_token:]
  if fmt == "mxfp8":
    x, x_sf = x.view(jnp.float8_e4m3fn), x_sf.view(jnp.float8_e8m0fnu)
  else:
    x_sf = x_sf.view(jnp.float8_e4m3fn)
  x, x_sf, ids, weights = _put(mesh, x, x_sf, ids, weights)

  def run(ws, impl):
    def body(x, x_sf, ids, weights):
      res, handle = a2a.dispatch(x, ids, weights, num_experts=num_experts, axis_name=AXIS, x_sf=x_sf, workspace=ws,
                                 impl=impl)
      return (res.recv_x[None], res.recv_x_sf[None], res.recv_topk_ids[None], res.recv_topk_weights[None],
              res.recv_counts[None], handle.send_slot)
    f = jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS),) * 4, out_specs=(P(AXIS),) * 6)
    return jax.jit(f)(x, x_sf, ids, weights)

  with a2a.Workspace(mesh, expert_axis=AXIS, capacity=num_tokens, hidden=hidden, top_k=top_k, fmt=fmt,
                     mx_alignment=mx_alignment, timeout_s=20) as ws:
    got = run(ws, "ffi")
  want = run(None, "reference")
  _assert_outputs_equal(got, want)


# Scale rows of 8 bytes (hidden 256), 16 (512) and 224 (7168, DeepSeek-V3): on GPUs the senders move rows that are
# whole 16-byte vectors in the warp's lanes, loaded with the token's first piece, and the others with a copy.
@pytest.mark.parametrize("hidden", [256, 512, 7168])
def test_fp8_wire_and_a_capacity_larger_than_the_call(hidden):
  mesh = _mesh()
  num_ranks, num_tokens, top_k = mesh.shape[AXIS], 10, 4
  num_experts = 2 * num_ranks
  x_q, x_sf, ids, weights = _inputs(mesh, 7, num_tokens, hidden, top_k, num_experts, "invalid", fmt="fp8_blockwise")
  with a2a.Workspace(mesh, expert_axis=AXIS, capacity=16, hidden=hidden, top_k=top_k, fmt="fp8_blockwise",
                     combine_dtype=jnp.float32, timeout_s=20) as ws:
    got = _run(mesh, ws, x_q, x_sf, ids, weights, num_experts, "ffi", combine_dtype=jnp.float32)
    want = _run(mesh, None, x_q, x_sf, ids, weights, num_experts, "reference", combine_dtype=jnp.float32)
  _assert_outputs_equal(got, want)


@pytest.mark.parametrize("fmt,hidden", [("bf16", 96), ("fp8_blockwise", 512)])
def test_small_calls_in_ll_form_and_larger_ones_in_pieces_share_a_workspace(fmt, hidden):
  """On GPUs a call of at most layout.LL_MAX_TOKENS tokens sends its rows in LL form, a larger one in fenced pieces;
  calls of both kinds follow each other on one workspace (its two buffers alternate between them)."""
  mesh = _mesh()
  num_ranks, top_k = mesh.shape[AXIS], 4
  num_experts = 2 * num_ranks
  capacity = layout.LL_MAX_TOKENS + 9
  with a2a.Workspace(mesh, expert_axis=AXIS, capacity=capacity, hidden=hidden, top_k=top_k, fmt=fmt,
                     combine_dtype=jnp.float32, timeout_s=20) as ws:
    assert ws.layout.ll_tokens == layout.LL_MAX_TOKENS
    for i, num_tokens in enumerate([capacity, 3, layout.LL_MAX_TOKENS, capacity, 1]):
      x, x_sf, ids, weights = _inputs(mesh, 50 + i, num_tokens, hidden, top_k, num_experts, "invalid", fmt=fmt)
      got = _run(mesh, ws, x, x_sf, ids, weights, num_experts, "ffi", combine_dtype=jnp.float32)
      want = _run(mesh, None, x, x_sf, ids, weights, num_experts, "reference", combine_dtype=jnp.float32)
      _assert_outputs_equal(got, want)
    ws.check()


def test_rows_other_than_the_wire_s_fit_a_training_workspace():
  """A workspace made for training (FP8 wire, float32 combine rows) has room for rows of hidden float32 values: such
  rows, the wire's own, and rows that cannot take the LL form (13 bytes) all equal the reference, in LL form (3 tokens)
  and in pieces; without that room the wide rows are an error naming the sizes."""
  mesh = _mesh()
  num_ranks, hidden, top_k = mesh.shape[AXIS], 256, 4
  num_experts = 2 * num_ranks
  capacity = layout.LL_MAX_TOKENS + 9
  with pytest.raises(ValueError, match=r"x row of 1024 bytes > 256 \(workspace format fp8_blockwise, training=False"):
    with a2a.Workspace(mesh, expert_axis=AXIS, capacity=capacity, hidden=hidden, top_k=top_k, fmt="fp8_blockwise",
                       combine_dtype=jnp.float32) as ws:
      x, _, ids, weights = _inputs(mesh, 60, 3, hidden, top_k, num_experts, "invalid")
      _run(mesh, ws, x.astype(jnp.float32), None, ids, weights, num_experts, "ffi", combine_dtype=jnp.float32)
  with a2a.Workspace(mesh, expert_axis=AXIS, capacity=capacity, hidden=hidden, top_k=top_k, fmt="fp8_blockwise",
                     combine_dtype=jnp.float32, training=True) as ws:
    assert ws.layout.x_row_bytes == 4 * hidden
    for i, num_tokens in enumerate([3, capacity]):
      x, _, ids, weights = _inputs(mesh, 61 + i, num_tokens, hidden, top_k, num_experts, "invalid")
      x = x.astype(jnp.float32)
      for fmt in ("bf16", "fp8_blockwise"):
        if fmt == "fp8_blockwise":
          x_q, x_sf, ids, weights = _inputs(mesh, 63 + i, num_tokens, hidden, top_k, num_experts, "invalid", fmt=fmt)
          args = (x_q, x_sf, ids, weights)
        else:
          args = (x, None, ids, weights)
        got = _run(mesh, ws, *args, num_experts, "ffi", combine_dtype=jnp.float32)
        want = _run(mesh, None, *args, num_experts, "reference", combine_dtype=jnp.float32)
        _assert_outputs_equal(got, want)
      odd = jax.device_put(np.random.default_rng(i).integers(0, 256, (num_ranks * num_tokens, 13), np.uint8),
                           NamedSharding(mesh, P(AXIS)))

      def dispatch(ws, impl, odd=odd, ids=ids, weights=weights):
        def body(x, ids, weights):
          res, _ = a2a.dispatch(x, ids, weights, num_experts=num_experts, axis_name=AXIS, workspace=ws, impl=impl)
          return res.recv_x[None], res.recv_topk_ids[None], res.recv_counts[None]
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS),) * 3, out_specs=(P(AXIS),) * 3))(
            odd, ids, weights)
      for g, w in zip(dispatch(ws, "ffi"), dispatch(None, "reference")):
        np.testing.assert_array_equal(_bits(g), _bits(w))
    ws.check()


@pytest.mark.parametrize("fmt,hidden", [("bf16", 1096), ("fp8_blockwise", 2176)])
def test_rows_longer_than_one_copy_piece(fmt, hidden):
  """The GPU kernels move a row in 2 KiB pieces; rows of several pieces, the last one partial, arrive whole."""
  mesh = _mesh()
  num_ranks, num_tokens, top_k = mesh.shape[AXIS], 37, 4
  num_experts = 4 * num_ranks
  x, x_sf, ids, weights = _inputs(mesh, hidden, num_tokens, hidden, top_k, num_experts, "invalid", fmt=fmt)
  with a2a.Workspace(mesh, expert_axis=AXIS, capacity=num_tokens, hidden=hidden, top_k=top_k, fmt=fmt,
                     combine_dtype=jnp.float32, timeout_s=20) as ws:
    got = _run(mesh, ws, x, x_sf, ids, weights, num_experts, "ffi", combine_dtype=jnp.float32)
    want = _run(mesh, None, x, x_sf, ids, weights, num_experts, "reference", combine_dtype=jnp.float32)
    ws.check()
  _assert_outputs_equal(got, want)


def test_many_back_to_back_calls_stay_exact():
  """1000 dispatch+combine pairs in one jit (a fori_loop): buffers alternate, flags and epochs advance."""
  mesh = _mesh()
  num_ranks, num_tokens, hidden, top_k = mesh.shape[AXIS], 4, 32, 2
  num_experts = 2 * num_ranks
  x, _, ids, weights = _inputs(mesh, 11, num_tokens, hidden, top_k, num_experts, "random")
  spec = P(AXIS)

  def loop(ws, impl, steps):
    def body(x, ids, weights):
      def step(i, acc):
        res, handle = a2a.dispatch(acc, ids, weights, num_experts=num_experts, axis_name=AXIS, workspace=ws,
                                   impl=impl)
        back = a2a.combine(res.recv_x.astype(jnp.float32) * 0.5, handle, out_dtype=jnp.bfloat16)
        return jnp.where(jnp.sum((handle.send_slot >= 0).astype(jnp.int32), axis=1, keepdims=True) > 0,
                         back + 1.0, acc)
      return jax.lax.fori_loop(0, steps, step, x)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))(x, ids, weights)

  with a2a.Workspace(mesh, expert_axis=AXIS, capacity=num_tokens, hidden=hidden, top_k=top_k,
                     combine_dtype=jnp.float32, timeout_s=20) as ws:
    got = loop(ws, "ffi", 1000)
    ws.check()
  want = loop(None, "reference", 1000)
  np.testing.assert_array_equal(_bits(got), _bits(want))


def test_independent_calls_of_equal_shapes_pair_up_by_call():
  """Four dispatches and four combines of equal shapes on one workspace, with no data path between them, their
  inputs delayed on each rank in another order (a loop of matmuls on call (i + rank) % 4's): each call meets its own
  counterparts on every rank, whatever order a device runs them in, and equals the reference."""
  mesh = _mesh()
  num_ranks, num_tokens, hidden, top_k, calls = mesh.shape[AXIS], 5, 16, 2, 4
  num_experts = 2 * num_ranks
  inputs = [_inputs(mesh, 40 + i, num_tokens, hidden, top_k, num_experts, "random") for i in range(calls)]
  spec = P(AXIS)

  def delayed(x, steps):  # x, after `steps` rounds of work whose result is discarded (an exact 0 added)
    m = jnp.full((128, 128), 1e-3, jnp.float32)
    work = jax.lax.fori_loop(0, steps, lambda _, a: jnp.tanh(a @ m), m)
    return x + (jnp.sum(work) * 0.0).astype(x.dtype)

  def run(ws, impl):
    def body(*args):
      outs = []
      me = jax.lax.axis_index(AXIS)
      for i, (x, ids, weights) in enumerate(zip(args[0::3], args[1::3], args[2::3])):
        x = delayed(x, 20 * ((i + me) % calls))
        res, handle = a2a.dispatch(x, ids, weights, num_experts=num_experts, axis_name=AXIS, workspace=ws, impl=impl)
        outs += [res.recv_x[None], a2a.combine(res.recv_x, handle, out_dtype=jnp.float32)]
      return tuple(outs)
    args = [a for x, _, ids, weights in inputs for a in (x, ids, weights)]
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * len(args), out_specs=spec))(*args)

  want = run(None, "reference")
  with a2a.Workspace(mesh, expert_axis=AXIS, capacity=num_tokens, hidden=hidden, top_k=top_k,
                     combine_dtype=jnp.bfloat16, timeout_s=20) as ws:
    for _ in range(3):
      got = run(ws, "ffi")
      for g, w in zip(got, want):
        np.testing.assert_array_equal(_bits(g), _bits(w))
    ws.check()


# bf16 expert rows on a bf16 wire: combine's VJP is a one-sided dispatch of the output cotangent (on the handle's
# ids); float32 expert rows (4 bytes a value) do not fit the bf16 wire and take the reference exchange, unless the
# workspace was made for training (rows with room for them). Dispatch's VJP returns the rows' cotangents by a
# one-sided combine (bf16 rows cast exactly into either combine dtype); the weights' always by the exchange.
@pytest.mark.parametrize("combine_dtype,training,one_sided_combine_vjp",
                         [(jnp.bfloat16, False, True), (jnp.float32, False, False), (jnp.float32, True, True)])
def test_gradients_match_the_reference(combine_dtype, training, one_sided_combine_vjp):
  skip_without_one_sided_backward()
  mesh = _mesh()
  num_ranks, num_tokens, hidden, top_k = mesh.shape[AXIS], 6, 16, 3
  num_experts = 2 * num_ranks
  x, _, ids, weights = _inputs(mesh, 5, num_tokens, hidden, top_k, num_experts, "invalid")
  spec = P(AXIS)

  def loss(ws, impl, x, weights):
    def body(x, ids, weights):
      res, handle = a2a.dispatch(x, ids, weights, num_experts=num_experts, axis_name=AXIS, workspace=ws, impl=impl)
      y = res.recv_x.astype(jnp.float32) * jnp.sum(res.recv_topk_weights, axis=-1, keepdims=True)
      return a2a.combine(y.astype(combine_dtype), handle).astype(jnp.float32) ** 2
    return jnp.sum(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)(x, ids, weights))

  with a2a.Workspace(mesh, expert_axis=AXIS, capacity=num_tokens, hidden=hidden, top_k=top_k,
                     combine_dtype=combine_dtype, timeout_s=20, training=training) as ws:
    grad = jax.grad(functools.partial(loss, ws, "ffi"), argnums=(0, 1))
    text = str(jax.make_jaxpr(grad)(x, weights))
    calls = {"dispatch": 1 + one_sided_combine_vjp, "combine": 2, "all_to_all": 2 - one_sided_combine_vjp}
    assert {"dispatch": text.count("jax_moe_a2a_dispatch"), "combine": text.count("jax_moe_a2a_combine"),
            "all_to_all": text.count("all_to_all[")} == calls
    got = jax.jit(grad)(x, weights)
    ws.check()
  want = jax.jit(jax.grad(functools.partial(loss, None, "reference"), argnums=(0, 1)))(x, weights)
  for g, w in zip(got, want):
    assert np.any(np.asarray(g) != 0)
    if ws.platform == "cpu":
      np.testing.assert_array_equal(_bits(g), _bits(w))
    else:  # XLA fuses the two programs' elementwise steps apart: the bf16 dx may differ in its last bit
      np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=2.0**-7, atol=0)


# ----------------------------------------------------------------------------------------------------------------
# Faults and life cycle
# ----------------------------------------------------------------------------------------------------------------


def _skip_rank(mesh, ws, skipped, num_experts=None):
  """Every rank but `skipped` calls dispatch; returns the jitted function's result (or raises)."""
  num_ranks = mesh.shape[AXIS]
  num_experts = num_experts or num_ranks
  spec = P(AXIS)

  def body(x, ids, w):
    def call(_):
      res, _ = a2a.dispatch(x, ids, w, num_experts=num_experts, axis_name=AXIS, workspace=ws, impl="ffi")
      return res.recv_counts
    me = jax.lax.axis_index(AXIS)
    skip = lambda _: jax.lax.pcast(jnp.zeros((num_ranks,), jnp.int32), AXIS, to="varying")
    return jax.lax.cond(me == skipped, skip, call, None)[None]

  x = jnp.ones((num_ranks * 2, 8), jnp.bfloat16)
  ids = jnp.zeros((num_ranks * 2, 1), jnp.int32)
  w = jnp.ones((num_ranks * 2, 1), jnp.float32)
  x, ids, w = _put(mesh, x, ids, w)
  return jax.block_until_ready(jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))(x, ids,
                                                                                                               w))


def test_a_missing_peer_is_an_error_naming_it_and_the_process_stays_usable():
  mesh = _mesh()
  _need_two_ranks(mesh)
  num_ranks = mesh.shape[AXIS]
  ws = a2a.Workspace(mesh, expert_axis=AXIS, capacity=2, hidden=8, top_k=1, combine_dtype=jnp.float32,
                     timeout_s=0.5)
  missing = num_ranks - 1
  try:
    _skip_rank(mesh, ws, missing)
  except Exception as e:  # CPU: the call itself fails
    assert "did not arrive" in str(e) and f"[{missing}]" in str(e)
  with pytest.raises(RuntimeError, match=rf"rank {missing} .*did not arrive|\[{missing}\].*did not arrive"):
    ws.check()
  with pytest.raises(Exception, match="unusable after an earlier failure"):
    _skip_rank(mesh, ws, skipped=-1)
  ws.close()
  # A new workspace works.
  with a2a.Workspace(mesh, expert_axis=AXIS, capacity=2, hidden=8, top_k=1, combine_dtype=jnp.float32,
                     timeout_s=5) as fresh:
    counts = np.asarray(_skip_rank(mesh, fresh, skipped=-1)).reshape(num_ranks, num_ranks)
    np.testing.assert_array_equal(counts[0], np.full(num_ranks, 2))


def test_a_peer_calling_with_other_shapes_is_an_error_naming_it():
  """One rank dispatches one token fewer than the others (a cond on the rank): no rank trusts the exchange. On GPUs
  the calls meet and the workspace check names the rank that called differently; on CPU, where the ranks meet per
  call site, the others wait for it in vain (and it for them), and the call names the missing rank(s) and the call
  they waited at instead."""
  mesh = _mesh()
  _need_two_ranks(mesh)
  num_ranks = mesh.shape[AXIS]
  odd = num_ranks - 1
  ws = a2a.Workspace(mesh, expert_axis=AXIS, capacity=2, hidden=8, top_k=1, combine_dtype=jnp.float32,
                     timeout_s=1 if mesh.devices.flat[0].platform == "cpu" else 5)

  def body(x, ids, w):
    def call(n):
      res, _ = a2a.dispatch(x[:n], ids[:n], w[:n], num_experts=num_ranks, axis_name=AXIS, workspace=ws, impl="ffi")
      return res.recv_counts
    me = jax.lax.axis_index(AXIS)
    return jax.lax.cond(me == odd, lambda: call(1), lambda: call(2))[None]

  x, ids, w = _put(mesh, jnp.ones((num_ranks * 2, 8), jnp.bfloat16), jnp.zeros((num_ranks * 2, 1), jnp.int32),
                   jnp.ones((num_ranks * 2, 1), jnp.float32))
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS),) * 3, out_specs=P(AXIS)))
  others = ", ".join(map(str, range(odd)))
  # Every rank times out; whichever reports first is either one waiting for the odd rank or the odd rank itself.
  seen_by_others = (f"for rank(s) [{odd}] of its expert group, which did not arrive; rank {odd} waited at another "
                    "call instead: {op=dispatch T=1 ")
  seen_by_odd = (f"rank {odd} waited 1 s for rank(s) [{others}] of its expert group, which did not arrive; rank 0 "
                 "waited at another call instead: {op=dispatch T=2 ")
  try:
    jax.block_until_ready(f(x, ids, w))
  except Exception as e:  # CPU: the call itself fails
    assert seen_by_others in str(e) or seen_by_odd in str(e), str(e)
  if ws.platform == "cpu":
    with pytest.raises(RuntimeError) as e:
      ws.check()
    assert seen_by_others in str(e.value) or seen_by_odd in str(e.value), str(e.value)
  else:
    with pytest.raises(RuntimeError, match="called with different arguments"):
      ws.check()
  ws.close()


def test_close_waits_for_calls_already_dispatched():
  """Closing right after an asynchronous call waits for it; its results stay valid and equal the reference's."""
  mesh = _mesh()
  num_ranks, num_tokens, hidden, top_k = mesh.shape[AXIS], 9, 64, 2
  num_experts = 2 * num_ranks
  x, _, ids, weights = _inputs(mesh, 3, num_tokens, hidden, top_k, num_experts, "random")
  ws = a2a.Workspace(mesh, expert_axis=AXIS, capacity=num_tokens, hidden=hidden, top_k=top_k, timeout_s=20)
  got = _run(mesh, ws, x, None, ids, weights, num_experts, "ffi")  # returns before the devices are done
  ws.close()
  want = _run(mesh, None, x, None, ids, weights, num_experts, "reference")
  _assert_outputs_equal(got, want)


def test_life_cycle_and_fit_errors():
  mesh = _mesh()
  ws = a2a.Workspace(mesh, expert_axis=AXIS, capacity=2, hidden=8, top_k=1, combine_dtype=jnp.float32)
  assert "platform" in repr(ws) and not ws.closed
  ws.close()
  ws.close()  # harmless
  assert ws.closed
  with pytest.raises(RuntimeError, match="used after close"):
    _skip_rank(mesh, ws, skipped=-1)
  with a2a.Workspace(mesh, expert_axis=AXIS, capacity=1, hidden=8, top_k=1) as small:
    with pytest.raises(ValueError, match=r"must fit the workspace, got num_tokens 2 > capacity 1"):
      _skip_rank(mesh, small, skipped=-1)
  with a2a.Workspace(mesh, expert_axis=AXIS, capacity=2, hidden=4, top_k=1) as narrow:
    with pytest.raises(ValueError, match=r"x row of 16 bytes > 8 \(workspace format bf16, training=False\)"):
      _skip_rank(mesh, narrow, skipped=-1)
  with pytest.raises(ValueError, match="impl='ffi' needs a workspace"):
    jax.shard_map(lambda x: a2a.dispatch(x, jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.float32),
                                         num_experts=8, axis_name=AXIS, impl="ffi")[0].recv_x,
                  mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))(jnp.zeros((len(mesh.devices), 4)))
  with pytest.raises(ValueError, match="expert_axis must name axes of the mesh"):
    a2a.Workspace(mesh, expert_axis="nope", capacity=2, hidden=8, top_k=1)


def test_handler_rejects_a_workspace_too_small_for_the_offsets():
  """Reached directly, the C++ side checks every access range against the block it was given."""
  mesh = _mesh()
  with a2a.Workspace(mesh, expert_axis=AXIS, capacity=2, hidden=8, top_k=1) as ws:
    attrs = ws.attrs("dispatch")
    attrs["off_x"] = np.int64(ws.layout.total_bytes)  # past the end
    spec = P(AXIS)
    num_ranks = mesh.shape[AXIS]

    def body(x, ids, w):
      out = (jax.ShapeDtypeStruct((num_ranks, 2, 8), x.dtype), jax.ShapeDtypeStruct((num_ranks, 2, 0), jnp.uint8),
             jax.ShapeDtypeStruct((num_ranks, 2, 1), jnp.int32), jax.ShapeDtypeStruct((num_ranks, 2, 1), jnp.float32),
             jax.ShapeDtypeStruct((num_ranks,), jnp.int32), jax.ShapeDtypeStruct((2, num_ranks), jnp.int32))
      outs = _ffi.ffi_call("dispatch", out, x, jnp.zeros((2, 0), jnp.uint8), ids, w, jnp.zeros((1,), jnp.uint8),
                           num_experts=np.int64(num_ranks), site=np.int64(0), **attrs)
      return outs[4][None]
    x, ids, w = _put(mesh, jnp.ones((2 * num_ranks, 8), jnp.bfloat16), jnp.zeros((2 * num_ranks, 1), jnp.int32),
                     jnp.ones((2 * num_ranks, 1), jnp.float32))
    with pytest.raises(Exception, match="workspace bytes per device.*too small"):
      jax.block_until_ready(jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec,
                                                  check_vma=False))(x, ids, w))


@pytest.mark.gpu
def test_gpu_uses_peer_memory_on_every_gpu():
  assert jax.default_backend() == "gpu"
  mesh = _mesh()
  _need_two_ranks(mesh)
  with a2a.Workspace(mesh, expert_axis=AXIS, capacity=8, hidden=8, top_k=1) as ws:
    assert ws.platform == "gpu"


@pytest.mark.gpu
def test_gpu_calls_replay_from_cuda_graphs(tmp_path):
  """XLA's command buffers capture the handlers' launches into CUDA graphs and replay them (the epochs live in
  device memory, so a replay needs no host work): the profile shows graph launches, every kernel of every call,
  and the results still equal the reference's bit for bit."""
  mesh = _mesh()
  num_ranks, num_tokens, hidden, top_k, calls, runs = mesh.shape[AXIS], 64, 1024, 4, 4, 3
  num_experts = 16 * num_ranks
  x, _, ids, weights = _inputs(mesh, 13, num_tokens, hidden, top_k, num_experts, "random")

  def chain(ws, impl):
    def body(x, ids, weights):
      for _ in range(calls):
        res, handle = a2a.dispatch(x, ids, weights, num_experts=num_experts, axis_name=AXIS, workspace=ws, impl=impl)
        x = a2a.combine(res.recv_x, handle)
      return x
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS),) * 3, out_specs=P(AXIS)))

  with a2a.Workspace(mesh, expert_axis=AXIS, capacity=num_tokens, hidden=hidden, top_k=top_k, timeout_s=20) as ws:
    f = chain(ws, "ffi")
    got = jax.block_until_ready(f(x, ids, weights))
    with jax.profiler.trace(str(tmp_path)):
      for _ in range(runs):
        got = jax.block_until_ready(f(x, ids, weights))
    ws.check()
  want = chain(None, "reference")(x, ids, weights)
  np.testing.assert_array_equal(_bits(got), _bits(want))
  import glob  # pylint: disable=import-outside-toplevel
  profile = jax.profiler.ProfileData.from_file(glob.glob(str(tmp_path / "**" / "*.xplane.pb"), recursive=True)[0])
  graph_launches = kernels = 0
  for plane in profile.planes:
    for line in plane.lines:
      for event in line.events:
        graph_launches += plane.name.startswith("/host") and event.name.startswith("cuGraphLaunch")
        kernels += plane.name.startswith("/device") and "jax_moe_a2a" in event.name
  assert graph_launches >= runs
  assert kernels == runs * calls * 2 * num_ranks  # a dispatch kernel and a combine kernel per call and device


@pytest.mark.parametrize("wire", ["bf16", "fp8_blockwise"])
@pytest.mark.parametrize("combine_dtype,x_dtype", [(jnp.bfloat16, jnp.float32), (jnp.float32, jnp.float32),
                                                   (jnp.float32, jnp.bfloat16)])
def test_wire_dispatch_vjp_with_a_workspace_equals_the_reference(wire, combine_dtype, x_dtype):
  """wire.wire_dispatch's VJP with a workspace (float32 rows: the one-sided combine; else the reference exchange)
  gives the reference's cotangents bit for bit, for the same cotangents of every output; for bfloat16 x the one-sided
  combine writes bfloat16, one rounding of the float32 sums as the reference's cast."""
  mesh = _mesh()
  num_ranks, num_tokens, hidden, top_k = mesh.shape[AXIS], 16, 256, 3
  num_experts = 4 * num_ranks
  rng = np.random.default_rng(5)
  ids, weights = _routing(rng, num_ranks, num_tokens, top_k, num_experts, "invalid")
  x = rng.standard_normal((num_ranks * num_tokens, hidden)).astype(np.float32)
  ct_rows = rng.standard_normal((num_ranks * num_ranks, num_tokens, hidden)).astype(np.float32)
  ct_w = rng.standard_normal((num_ranks * num_ranks, num_tokens, top_k)).astype(np.float32)
  x, ids, weights, ct_rows, ct_w = _put(mesh, x, ids, weights, ct_rows, ct_w)
  x = x.astype(x_dtype)

  def grads(ws):
    def body(x, ids, weights, ct_rows, ct_w):
      def f(x, weights):
        rows, _, recv_w, _, _ = wire_dispatch(x, ids, weights, wire_format=wire, num_experts=num_experts,
                                                  axis_name=AXIS, dtype=jnp.float32, workspace=ws,
                                                  impl="reference" if ws is None else "ffi")
        return rows, recv_w
      _, vjp = jax.vjp(f, x, weights)
      return vjp((ct_rows, ct_w))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS),) * 5, out_specs=P(AXIS)))(
        x, ids, weights, ct_rows, ct_w)

  with a2a.Workspace(mesh, expert_axis=AXIS, capacity=num_tokens, hidden=hidden, top_k=top_k, fmt=wire,
                     combine_dtype=combine_dtype) as ws:
    got = grads(ws)
    ws.check()
  want = grads(None)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(_bits(g), _bits(w))


@pytest.mark.parametrize("wire", ["bf16", "fp8_blockwise"])
def test_moe_apply_with_a_workspace_equals_the_reference(wire):
  """The MoE layer on the one-sided custom calls gives the reference's output and gradients (the reference is
  itself checked against the dense oracle in test_moe.py), with one expert group per data index, within float32
  rounding: XLA compiles the two programs' expert matmuls and the weighted sum's fusions apart, one ulp apart at most
  seen (the exchanges themselves are bit-exact: test_wire_dispatch_vjp_with_a_workspace_equals_the_reference)."""
  skip_without_one_sided_backward()
  from jax_moe_a2a import moe  # pylint: disable=import-outside-toplevel
  n = len(jax.devices())
  data = 2 if n >= 4 else 1
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(data, n // data), ("data", "expert"))
  cfg = moe.MoEConfig(num_experts=4 * (n // data), top_k=3, hidden=256, ffn=128, wire_format=wire,
                      token_axes=("data", "expert"), expert_axis="expert", dtype=jnp.float32)
  params = moe.init_params(jax.random.key(0), cfg, mesh)
  x = jax.random.normal(jax.random.key(1), (8 * n, 256), jnp.float32)
  x = jax.device_put(x, NamedSharding(mesh, P(("data", "expert"))))
  # The two paths named: one-sided calls (and the quantization custom calls) against the reference everywhere.
  configs = {"ffi": dataclasses.replace(cfg, impl="ffi"), "reference": dataclasses.replace(cfg, impl="reference")}
  apply = lambda x, ws, impl: moe.moe_apply(params, x, configs[impl], mesh, workspace=ws)[0]
  loss = lambda x, ws, impl: jnp.sum(apply(x, ws, impl) ** 2)
  with moe.make_workspace(cfg, mesh, 8 * n) as ws:
    assert "jax_moe_a2a_dispatch" in str(jax.make_jaxpr(lambda x: apply(x, ws, "ffi"))(x))
    y_ffi = apply(x, ws, "ffi")
    g_ffi = jax.grad(loss)(x, ws, "ffi")
    ws.check()
  y_ref = apply(x, None, "reference")
  g_ref = jax.grad(loss)(x, None, "reference")
  np.testing.assert_allclose(np.asarray(y_ffi), np.asarray(y_ref), rtol=0, atol=1e-6 * float(jnp.max(jnp.abs(y_ref))))
  np.testing.assert_allclose(np.asarray(g_ffi), np.asarray(g_ref), rtol=0, atol=1e-6 * float(jnp.max(jnp.abs(g_ref))))


@pytest.mark.parametrize("wire_format,training", [("bf16", False), ("fp8_blockwise", True)])
def test_moe_training_gradients_with_a_workspace_equal_the_reference(wire_format, training, monkeypatch):
  """A training step of the layer (bf16 rows, a shared expert, one expert group per data index): the gradients of
  every parameter and of x equal the reference's bit for bit on CPU. Combine's VJP is a one-sided dispatch here (its
  bf16 rows fit a bf16 wire's rows, and an FP8 wire's with room for training), and the wire's VJP a one-sided
  combine after it. Its cotangent is known from the start, so without its `after` operand (the forward combine's
  result) XLA:CPU could start it on some devices while others wait in the data axis's all-reduce: every device
  would wait for another."""
  skip_without_one_sided_backward()
  from jax_moe_a2a import moe  # pylint: disable=import-outside-toplevel
  # Bit for bit needs the same expert GEMMs on both sides: the reference's "auto" must resolve as impl="ffi" does.
  monkeypatch.delenv(_ffi.ENV_IMPL, raising=False)
  n = len(jax.devices())
  data = 2 if n >= 4 else 1
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(data, n // data), ("data", "expert"))
  cfg = moe.MoEConfig(num_experts=16 * (n // data), top_k=6, hidden=256, ffn=128, wire_format=wire_format,
                      num_shared_experts=1, token_axes=("data", "expert"), expert_axis="expert", dtype=jnp.bfloat16)
  params = moe.init_params(jax.random.key(0), cfg, mesh)
  sharding = NamedSharding(mesh, P(("data", "expert")))
  x = jax.device_put(jax.random.normal(jax.random.key(1), (64 * n, 256), jnp.float32).astype(jnp.bfloat16), sharding)
  ct = jax.device_put(jax.random.normal(jax.random.key(2), (64 * n, 256), jnp.float32), sharding)

  def step(ws):  # the loss too: the forward combine stays in the program; with a workspace, impl="ffi" always
    c = cfg if ws is None else dataclasses.replace(cfg, impl="ffi")
    loss = lambda p, x: jnp.sum(moe.moe_apply(p, x, c, mesh, workspace=ws)[0].astype(jnp.float32) * ct)
    return jax.value_and_grad(loss, argnums=(0, 1))

  grads = lambda ws: jax.jit(step(ws))(params, x)
  with moe.make_workspace(cfg, mesh, 64 * n, training=training) as ws:
    text = str(jax.make_jaxpr(step(ws))(params, x))
    assert (text.count("jax_moe_a2a_dispatch"), text.count("jax_moe_a2a_combine")) == (2, 2)
    got = [grads(ws) for _ in range(2)]
    ws.check()
  want = grads(None)
  for g in got:
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(want)):
      if jax.devices()[0].platform == "cpu":
        np.testing.assert_array_equal(_bits(a), _bits(b))
      else:
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=0,
                                   atol=1e-2 * float(jnp.max(jnp.abs(b.astype(jnp.float32)))))


@pytest.mark.parametrize("wire_format,remat", [("bf16", False), ("fp8_blockwise", True)])
def test_layers_under_lax_scan_share_a_workspace_as_an_unrolled_loop_does(wire_format, remat):
  """Layers stacked along a leading axis and applied in a `lax.scan` (the usual way to compile a deep model once)
  call the one-sided dispatch and combine of one workspace in every iteration, forward and backward: the loss and
  every gradient equal the unrolled loop's over the same layers, bit for bit on CPU. With `remat` each layer is
  under `jax.checkpoint` saving nothing, so the backward runs every layer's dispatch and combine a second time."""
  skip_without_one_sided_backward()
  from jax_moe_a2a import moe  # pylint: disable=import-outside-toplevel
  n = len(jax.devices())
  data = 2 if n >= 4 else 1
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(data, n // data), ("data", "expert"))
  cfg = moe.MoEConfig(num_experts=4 * (n // data), top_k=3, hidden=256, ffn=128, wire_format=wire_format,
                      token_axes=("data", "expert"), expert_axis="expert", dtype=jnp.float32, impl="ffi")
  layers = [moe.init_params(jax.random.key(i), cfg, mesh) for i in range(3)]
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *layers)
  x = jax.device_put(jax.random.normal(jax.random.key(9), (8 * n, 256), jnp.float32),
                     NamedSharding(mesh, P(("data", "expert"))))
  with moe.make_workspace(cfg, mesh, 8 * n) as ws:
    layer = lambda p, x: x + moe.moe_apply(p, x, cfg, mesh, workspace=ws)[0]

    def unrolled(ps, x):
      for p in ps:
        x = layer(p, x)
      return jnp.sum(x ** 2)

    body = lambda x, p: (layer(p, x), None)
    if remat:
      body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)

    def scanned(ps, x):
      return jnp.sum(jax.lax.scan(body, x, ps)[0] ** 2)

    text = str(jax.make_jaxpr(jax.grad(scanned))(stacked, x))
    assert "jax_moe_a2a_dispatch" in text and "jax_moe_a2a_combine" in text and ("remat" in text) == remat
    want = jax.jit(jax.value_and_grad(unrolled, argnums=(0, 1)))(layers, x)
    got = jax.jit(jax.value_and_grad(scanned, argnums=(0, 1)))(stacked, x)
    ws.check()
  want = (want[0], (jax.tree.map(lambda *a: jnp.stack(a), *want[1][0]), want[1][1]))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    if jax.devices()[0].platform == "cpu":
      np.testing.assert_array_equal(_bits(a), _bits(b))
    else:
      # XLA:GPU may fuse the scan's body apart from the unrolled layers: float32 rounding apart.
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-4 * float(jnp.max(jnp.abs(b))))
