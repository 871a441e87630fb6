"""`jax.vmap` over the custom calls: each runs once per batch element (a sequential rule), so a vmapped call equals
the calls made one by one, and the vmapped reference."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from conftest import devices
from jax_moe_a2a import _ffi, a2a, grouped_gemm, quant, quant_mx

pytestmark = pytest.mark.skipif(not _ffi.available(), reason="compiled extension not built")


def _bits(a):
  a = np.asarray(a)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _one_by_one(fn, *batched):
  outs = [fn(*(a[i] for a in batched)) for i in range(batched[0].shape[0])]
  return jax.tree.map(lambda *xs: jnp.stack(xs), *outs)


def test_vmapped_quantization_equals_the_calls_one_by_one_and_the_reference():
  x = jax.random.normal(jax.random.key(0), (3, 5, 256), jnp.float32) * jnp.array([1.0, 1e3, 1e-3])[:, None, None]
  fn = lambda impl: (lambda x: quant.quantize_fp8_blockwise(x, impl=impl))
  got = jax.jit(jax.vmap(fn("ffi")))(x)
  for want in (_one_by_one(fn("ffi"), x), jax.vmap(fn("reference"))(x)):
    for g, w in zip(got, want):
      np.testing.assert_array_equal(_bits(g), _bits(w))


def test_vmapped_mxfp8_and_nvfp4_calls_equal_the_calls_one_by_one_and_the_reference():
  """Each element gets its own NVFP4 global scale (derived, or given per element) and its own round trip."""
  x = jax.random.normal(jax.random.key(3), (3, 5, 256), jnp.float32) * jnp.array([1.0, 1e3, 1e-3])[:, None, None]
  x = x.at[1, 2, 7].set(jnp.nan)
  gs = jnp.array([0.5, 2.0, 1e-4], jnp.float32)

  def mx(impl):
    def f(x):
      q, sf = quant_mx.quantize_mxfp8(x, impl=impl)
      return q, sf, quant_mx.dequantize_mxfp8(q, sf, dtype=jnp.bfloat16, impl=impl)
    return f

  def nv(impl):
    def f(x, g):
      q, sf, derived = quant_mx.quantize_nvfp4(x, impl=impl)
      q2, sf2, _ = quant_mx.quantize_nvfp4(x, global_scale=g, impl=impl)
      return q, sf, derived, q2, sf2, quant_mx.dequantize_nvfp4(q2, sf2, g, impl=impl)
    return f

  for fn, args in ((mx, (x,)), (nv, (x, gs))):
    got = jax.jit(jax.vmap(fn("ffi")))(*args)
    for want in (_one_by_one(fn("ffi"), *args), jax.vmap(fn("reference"))(*args)):
      for g, w in zip(got, want):
        np.testing.assert_array_equal(_bits(g), _bits(w))
  assert len(set(np.asarray(got[2]).tolist())) == 3  # one derived global scale per element


def test_vmapped_grouped_gemms_equal_the_calls_one_by_one():
  a = jax.random.normal(jax.random.key(1), (2, 32, 128), jnp.float32)
  b = jax.random.normal(jax.random.key(2), (2, 3, 128, 128), jnp.float32)
  sizes = jnp.array([[10, 12, 10], [32, 0, 0]], jnp.int32)
  bf16 = lambda a, b, s: grouped_gemm.grouped_gemm_bf16(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), s,
                                                        impl="ffi")

  def fp8(a, b, s):
    a_q, a_sf = quant.quantize_fp8_blockwise(a, impl="ffi")
    b_q, b_sf = quant.quantize_fp8_weight(b)
    return grouped_gemm.grouped_gemm_fp8(a_q, a_sf, b_q, b_sf, s, impl="ffi")

  for fn in (bf16, fp8):
    got = jax.jit(jax.vmap(fn))(a, b, sizes)
    np.testing.assert_array_equal(_bits(got), _bits(_one_by_one(fn, a, b, sizes)))
    assert np.any(np.asarray(got[1, 32 - 1]) != 0)  # the second element's rows all belong to its first group


def test_vmapped_one_sided_dispatch_and_combine_equal_the_reference():
  """Inside shard_map over 8 devices: a batch of 3 exchanges, each one dispatch + combine per element."""
  mesh = Mesh(np.array(devices(8)), ("ep",))
  batch, tokens, hidden, top_k, num_experts = 3, 4, 16, 2, 16
  rng = np.random.default_rng(0)
  ids = jnp.asarray(rng.integers(0, num_experts, (batch, 8 * tokens, top_k)), jnp.int32)
  weights = jnp.asarray(rng.random(ids.shape), jnp.float32)
  x = jnp.asarray(rng.standard_normal((batch, 8 * tokens, hidden)), jnp.bfloat16)
  spec = P(None, "ep")
  sharding = NamedSharding(mesh, spec)

  def exchange(ws, impl):
    def one(x, ids, weights):
      res, handle = a2a.dispatch(x, ids, weights, num_experts=num_experts, axis_name="ep", workspace=ws, impl=impl)
      out = a2a.combine((res.recv_x.astype(jnp.float32) * 3).astype(jnp.bfloat16), handle, out_dtype=jnp.float32)
      return res.recv_x, res.recv_counts, out

    body = lambda x, ids, weights: jax.tree.map(lambda a: a[:, None], jax.vmap(one)(x, ids, weights))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=(P(None, "ep"),) * 3))
    return f(*(jax.device_put(a, sharding) for a in (x, ids, weights)))

  with a2a.Workspace(mesh, expert_axis="ep", capacity=tokens, hidden=hidden, top_k=top_k, timeout_s=20) as ws:
    assert "jax_moe_a2a_dispatch" in str(jax.make_jaxpr(lambda: exchange(ws, "ffi"))())
    got = exchange(ws, "ffi")
    ws.check()
  want = exchange(None, "reference")
  for g, w in zip(got, want):
    np.testing.assert_array_equal(_bits(g), _bits(w))
  # Every row came back: a token goes once to each rank holding one of its experts, and combine sums what those
  # ranks return (weights are the experts' to apply): (number of its ranks) * bf16(3 x).
  ranks = np.asarray(ids) // (num_experts // 8)
  copies = 1 + (ranks[..., 0] != ranks[..., 1])
  out = np.asarray(got[2]).reshape(batch, 8 * tokens, hidden)
  np.testing.assert_array_equal(out, copies[..., None] * np.asarray((x.astype(jnp.float32) * 3).astype(jnp.bfloat16),
                                                                    np.float32))
