"""Tests of the layer's dispatch with its wire format (jax_moe_a2a.wire): the FP8 wire's gradient is the plain
float32 dispatch's, bit for bit; a two-level wire needs its axis pair. Its VJP with a workspace is compared with
the reference exchange in test_a2a_ffi.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_moe_a2a import a2a
from jax_moe_a2a.wire import wire_dispatch

import test_moe  # the layer tests' sizes and meshes


def _wire_vjps(num_ranks=4, num_tokens=12):
  """dx and d(topk_weights) of the FP8 wire and of a plain float32 dispatch, for the same cotangents."""
  rng = np.random.default_rng(0)
  ids = rng.integers(-1, test_moe.EXPERTS, size=(num_ranks * num_tokens, test_moe.TOP_K)).astype(np.int32)
  w = rng.random((num_ranks * num_tokens, test_moe.TOP_K)).astype(np.float32)
  x = rng.standard_normal((num_ranks * num_tokens, test_moe.HIDDEN)).astype(np.float32)
  ct_rows = rng.standard_normal((num_ranks * num_ranks, num_tokens, test_moe.HIDDEN)).astype(np.float32)
  ct_w = rng.standard_normal((num_ranks * num_ranks, num_tokens, test_moe.TOP_K)).astype(np.float32)
  mesh = test_moe._mesh((num_ranks,), ("ep",))  # pylint: disable=protected-access

  def body(x, ids, w, ct_rows, ct_w):
    def wire(x, w):
      rows, _, recv_w, _, _ = wire_dispatch(x, ids, w, wire_format="fp8_blockwise", num_experts=test_moe.EXPERTS,
                                            axis_name="ep", dtype=jnp.float32)
      return rows, recv_w

    def plain(x, w):
      res, _ = a2a.dispatch(x, ids, w, num_experts=test_moe.EXPERTS, axis_name="ep")
      return res.recv_x, res.recv_topk_weights

    _, vjp_wire = jax.vjp(wire, x, w)
    _, vjp_plain = jax.vjp(plain, x, w)
    return vjp_wire((ct_rows, ct_w)) + vjp_plain((ct_rows, ct_w))

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
  return [np.asarray(a) for a in fn(x, ids, w, ct_rows, ct_w)]


def test_fp8_wire_gradient_is_straight_through():
  """The FP8 wire's VJP is the float32 dispatch's VJP, bit for bit: no quantization in the backward pass."""
  dx, dw, dx_plain, dw_plain = _wire_vjps()
  assert np.any(dx != 0) and np.any(dw != 0)
  np.testing.assert_array_equal(dx, dx_plain)
  np.testing.assert_array_equal(dw, dw_plain)


def test_the_wire_in_two_levels_needs_an_axis_pair():
  with pytest.raises(ValueError, match=r"with two_level, axis_name must be the pair \(node axis, local axis\), got "
                                       r"'local'"):
    wire_dispatch(jnp.zeros((4, test_moe.HIDDEN)), jnp.zeros((4, 2), jnp.int32), jnp.zeros((4, 2)),
                  wire_format="bf16", num_experts=8, axis_name="local", two_level=True)
