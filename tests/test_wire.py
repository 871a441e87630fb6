"""Tests of the layer's dispatch with its wire format (jax_moe_a2a.wire), for every format of `layout.FORMATS`:

- the gradient is straight-through: the plain float32 dispatch's VJP, bit for bit;
- the received rows are the format's round trip of the tokens (the quantizers' own rule, NVFP4 with one global scale
  for the whole exchange), moved bit for bit, flat and in two levels;
- the custom calls (quantizers, one-sided dispatch and its VJP on the CPU handlers) give the references' bits;
- a NaN or an infinity spoils its block only; all-zero tokens travel as zeros;
- bad arguments are refused by name.

Its VJP with a workspace is also compared with the reference exchange in test_a2a_ffi.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from conftest import devices, skip_without_one_sided_backward
from jax_moe_a2a import _ffi, a2a, layout, quant
from jax_moe_a2a.two_level import dispatch_two_level
from jax_moe_a2a.wire import exchange_global_scale, wire_dispatch
from jax_moe_a2a.workspace import Workspace

import test_moe  # the layer tests' sizes and meshes

EXPERTS, TOP_K, HIDDEN = test_moe.EXPERTS, test_moe.TOP_K, test_moe.HIDDEN
TOKENS = 12  # per rank
QUANTIZED = ("fp8_blockwise", "mxfp8", "nvfp4")
needs_extension = pytest.mark.skipif(not _ffi.available(), reason="compiled extension not built")


def _bits(a):
  a = np.asarray(a)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _mesh(two_level):
  return Mesh(np.asarray(devices(8)).reshape((2, 4) if two_level else (8,)),
              ("node", "local") if two_level else ("ep",))


def _axis(two_level):
  return ("node", "local") if two_level else "ep"


def _inputs(seed=0):
  """Tokens of 8 ranks (float32, [8 * TOKENS, HIDDEN]), routing, and cotangents of the flat and two-level rows.

  Rank 0's tokens are 1000x the others': a scale per source rank would give the other ranks' NVFP4 rows other bits
  than the exchange's one scale. Token 1 of rank 1 has a 1x32 block 1e-6x its neighbours: MXFP8 keeps it where the
  1x128 group's scale flushes it to zero."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((8 * TOKENS, HIDDEN)).astype(np.float32)
  x[:TOKENS] *= 1000.0
  x[TOKENS + 1, 32:64] *= 1e-6
  ids = rng.integers(-1, EXPERTS, size=(8 * TOKENS, TOP_K)).astype(np.int32)
  ids[0], ids[1] = [0, 5, -1, 9], [3, -1, -1, -1]  # tokens 0 and 1 of rank 0 go somewhere
  w = rng.random((8 * TOKENS, TOP_K)).astype(np.float32)
  cts = {two: (rng.standard_normal((8 * (4 if two else 8), TOKENS * (2 if two else 1), HIDDEN)).astype(np.float32),
               rng.standard_normal((8 * (4 if two else 8), TOKENS * (2 if two else 1), TOP_K)).astype(np.float32))
         for two in (False, True)}
  return x, ids, w, cts


def _round_trip(fmt, x):
  """The format's quantize -> dequantize of x ([8 * TOKENS, HIDDEN], every rank's tokens) as one exchange sees it:
  each row on its own, NVFP4 with the global scale of all of them."""
  x = jnp.asarray(x)
  if fmt == "nvfp4":
    q, sf, gs = quant.quantize_nvfp4(x, global_scale=quant.nvfp4_global_scale(x, impl="reference"),
                                     impl="reference")
    return np.asarray(quant.dequantize_nvfp4(q, sf, gs, impl="reference"))
  q, sf, _ = quant.quantize(x, fmt, impl="reference")
  if fmt == "mxfp8":
    return np.asarray(quant.dequantize_mxfp8(q, sf, impl="reference"))
  return np.asarray(quant.dequantize(q, sf, fmt))


@functools.lru_cache(maxsize=None)
def _plain_rows_fn(two_level):
  """jit of the received rows of the plain (float32, lossless) reference dispatch."""

  def body(x, ids, w):
    if two_level:
      res, _ = dispatch_two_level(x, ids, w, num_experts=EXPERTS, node_axis="node", local_axis="local",
                                  impl="reference")
    else:
      res, _ = a2a.dispatch(x, ids, w, num_experts=EXPERTS, axis_name="ep", impl="reference")
    return res.recv_x

  spec = P(_axis(two_level))
  return jax.jit(jax.shard_map(body, mesh=_mesh(two_level), in_specs=spec, out_specs=spec, check_vma=False))


def _wire_fn(fmt, two_level, workspace=None):
  """jit of (rows, received weights, dx, d(weights)): the wire's float32 rows and weights, and its VJP of the given
  cotangents; on the custom calls with a workspace, else on the references."""

  def body(x, ids, w, ct_rows, ct_w):
    def f(x, w):
      rows, _, recv_w, _, _ = wire_dispatch(x, ids, w, wire_format=fmt, num_experts=EXPERTS,
                                            axis_name=_axis(two_level), dtype=jnp.float32, workspace=workspace,
                                            impl="reference" if workspace is None else "ffi", two_level=two_level)
      return rows, recv_w

    out, vjp = jax.vjp(f, x, w)
    return out + vjp((ct_rows, ct_w))

  spec = P(_axis(two_level))
  return jax.jit(jax.shard_map(body, mesh=_mesh(two_level), in_specs=spec, out_specs=spec))


_reference_wire_fn = functools.lru_cache(maxsize=None)(_wire_fn)


def _run_reference(fmt, two_level, x, ids, w, cts):
  return [np.asarray(a) for a in _reference_wire_fn(fmt, two_level)(x, ids, w, *cts[two_level])]


# ----------------------------------------------------------------------------------------------------------------
# The gradient
# ----------------------------------------------------------------------------------------------------------------


def _wire_vjps(fmt, num_ranks=4, num_tokens=12):
  """dx and d(topk_weights) of the wire and of a plain float32 dispatch, for the same cotangents."""
  rng = np.random.default_rng(0)
  ids = rng.integers(-1, EXPERTS, size=(num_ranks * num_tokens, TOP_K)).astype(np.int32)
  w = rng.random((num_ranks * num_tokens, TOP_K)).astype(np.float32)
  x = rng.standard_normal((num_ranks * num_tokens, HIDDEN)).astype(np.float32)
  ct_rows = rng.standard_normal((num_ranks * num_ranks, num_tokens, HIDDEN)).astype(np.float32)
  ct_w = rng.standard_normal((num_ranks * num_ranks, num_tokens, TOP_K)).astype(np.float32)
  mesh = test_moe._mesh((num_ranks,), ("ep",))  # pylint: disable=protected-access

  def body(x, ids, w, ct_rows, ct_w):
    def wire(x, w):
      rows, _, recv_w, _, _ = wire_dispatch(x, ids, w, wire_format=fmt, num_experts=EXPERTS, axis_name="ep",
                                            dtype=jnp.float32)
      return rows, recv_w

    def plain(x, w):
      res, _ = a2a.dispatch(x, ids, w, num_experts=EXPERTS, axis_name="ep")
      return res.recv_x, res.recv_topk_weights

    _, vjp_wire = jax.vjp(wire, x, w)
    _, vjp_plain = jax.vjp(plain, x, w)
    return vjp_wire((ct_rows, ct_w)) + vjp_plain((ct_rows, ct_w))

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
  return [np.asarray(a) for a in fn(x, ids, w, ct_rows, ct_w)]


@pytest.mark.parametrize("fmt", layout.FORMATS)
def test_the_gradient_is_straight_through(fmt):
  """Every wire's VJP is the float32 dispatch's VJP, bit for bit: no quantization in the backward pass, and the
  cotangents' exchange is the same whatever the format."""
  dx, dw, dx_plain, dw_plain = _wire_vjps(fmt)
  assert np.any(dx != 0) and np.any(dw != 0)
  np.testing.assert_array_equal(dx, dx_plain)
  np.testing.assert_array_equal(dw, dw_plain)


# ----------------------------------------------------------------------------------------------------------------
# What the receiver gets
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("two_level", [False, True], ids=["flat", "two_level"])
@pytest.mark.parametrize("fmt", QUANTIZED)
def test_received_rows_are_the_formats_round_trip_of_the_tokens(fmt, two_level):
  """The decoded rows are, bit for bit, the plain dispatch of quantize -> dequantize of the tokens: each row with its
  own block scales and, for NVFP4, one global scale from every rank's tokens (so all receivers decode alike)."""
  x, ids, w, cts = _inputs()
  rows = _run_reference(fmt, two_level, x, ids, w, cts)[0]
  want = np.asarray(_plain_rows_fn(two_level)(_round_trip(fmt, x), ids, w))
  np.testing.assert_array_equal(_bits(rows), _bits(want))
  assert np.any(rows != np.asarray(_plain_rows_fn(two_level)(x, ids, w)))  # the wire is lossy
  # The inputs tell the formats' rules apart: a scale per source rank (NVFP4), or 1x128 groups for MXFP8's 1x32
  # blocks, would have given other bits.
  if fmt == "nvfp4":
    per_rank = np.concatenate([_round_trip(fmt, x[r * TOKENS:(r + 1) * TOKENS]) for r in range(8)])
    assert np.any(per_rank[TOKENS:] != _round_trip(fmt, x)[TOKENS:])
  if fmt == "mxfp8":
    assert np.any(_round_trip("mxfp8", x)[TOKENS + 1] != _round_trip("fp8_blockwise", x)[TOKENS + 1])


@needs_extension
@pytest.mark.parametrize("two_level", [False, True], ids=["flat", "two_level"])
@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_the_custom_calls_give_the_references_bits(fmt, two_level):
  """impl="ffi" with a workspace (the quantization custom calls and the one-sided dispatch and VJP on the CPU
  handlers, MXFP8's E8M0 and NVFP4's packed uint8 codes and E4M3 scales in the workspace's regions) against the
  references everywhere: rows, weights and both cotangents, bit for bit."""
  skip_without_one_sided_backward()
  x, ids, w, cts = _inputs(1)
  mesh = _mesh(two_level)
  with Workspace(mesh, expert_axis="local" if two_level else "ep", capacity=TOKENS * (2 if two_level else 1),
                 hidden=HIDDEN, top_k=TOP_K, fmt=fmt, combine_dtype=jnp.float32, training=True) as ws:
    got = [np.asarray(a) for a in _wire_fn(fmt, two_level, ws)(x, ids, w, *cts[two_level])]
    ws.check()
  want = _run_reference(fmt, two_level, x, ids, w, cts)
  assert np.any(got[2] != 0)
  for name, g, r in zip(("rows", "weights", "dx", "d(weights)"), got, want):
    np.testing.assert_array_equal(_bits(g), _bits(r), err_msg=name)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_a_non_finite_value_spoils_its_block_only(fmt):
  """A NaN or an infinity in a token makes its block of the decoded row NaN (32 values for MXFP8, 16 for NVFP4),
  as the quantizers document, and nothing else: the row's other blocks, the other tokens and NVFP4's global scale
  (taken over the finite values) are those of the finite tokens."""
  x, ids, w, cts = _inputs(2)
  x[0, 5], x[1, 40] = np.nan, np.inf
  rows = _run_reference(fmt, False, x, ids, w, cts)[0]
  np.testing.assert_array_equal(rows, np.asarray(_plain_rows_fn(False)(_round_trip(fmt, x), ids, w)))
  block = layout.format_spec(fmt).block
  destinations = lambda t: len({int(e) // (EXPERTS // 8) for e in ids[t] if e >= 0})
  assert np.sum(np.isnan(rows)) == block * (destinations(0) + destinations(1))
  assert not np.any(np.isinf(rows))
  # The global scale is that of the finite values: with the NaN and the infinity replaced by zeros, every other
  # value decodes to the same bits.
  finite = x.copy()
  finite[0, 5], finite[1, 40] = 0.0, 0.0
  spoilt = np.isnan(_round_trip(fmt, x))
  assert np.sum(spoilt) == 2 * block
  np.testing.assert_array_equal(_round_trip(fmt, x)[~spoilt], _round_trip(fmt, finite)[~spoilt])


def test_all_zero_tokens_travel_as_zeros_on_nvfp4():
  """All-zero tokens on every rank: the exchange's global scale is the floor's (positive and finite, never one that
  quantize_nvfp4 would refuse), every block scale 0, and the rows decode to zeros, with no NaN."""
  x, ids, w, cts = _inputs(3)
  zeros = np.zeros_like(x)
  rows = _run_reference("nvfp4", True, zeros, ids, w, cts)[0]
  assert not np.any(np.isnan(rows)) and not np.any(rows)

  def body(x):
    return exchange_global_scale(x, "ep", impl="reference")[None]

  mesh = _mesh(False)
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
  scales = np.asarray(fn(jax.device_put(zeros, NamedSharding(mesh, P("ep")))))
  np.testing.assert_array_equal(scales, np.float32(1e-12) / np.float32(2688))
  # A rank's non-finite values do not reach the scale; every rank gets the largest finite amax of all.
  spoilt = x.copy()
  spoilt[TOKENS, 0], spoilt[2 * TOKENS, 0] = np.inf, np.nan
  scales = np.asarray(fn(jax.device_put(spoilt, NamedSharding(mesh, P("ep")))))
  np.testing.assert_array_equal(scales, np.asarray(quant.nvfp4_global_scale(jnp.asarray(x), impl="reference")))


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_a_call_of_no_tokens_receives_no_rows(fmt):
  """Shards of no tokens (static shapes): [num_ranks, 0, hidden] rows, and nothing to decode."""
  mesh = _mesh(False)

  def body(x, ids, w):
    return wire_dispatch(x, ids, w, wire_format=fmt, num_experts=EXPERTS, axis_name="ep", dtype=jnp.float32,
                         impl="reference")[0]

  rows = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(
      jnp.zeros((0, 128)), jnp.zeros((0, TOP_K), jnp.int32), jnp.zeros((0, TOP_K)))
  assert rows.shape == (64, 0, 128) and rows.dtype == jnp.float32


# ----------------------------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------------------------


def test_the_wire_in_two_levels_needs_an_axis_pair():
  with pytest.raises(ValueError, match=r"with two_level, axis_name must be the pair \(node axis, local axis\), got "
                                       r"'local'"):
    wire_dispatch(jnp.zeros((4, HIDDEN)), jnp.zeros((4, 2), jnp.int32), jnp.zeros((4, 2)),
                  wire_format="bf16", num_experts=8, axis_name="local", two_level=True)


@pytest.mark.parametrize("kw,match", [
    (dict(wire_format="fp4"), r"wire_dispatch: wire_format must be one of bf16, fp8_blockwise, mxfp8, nvfp4, got "
                              r"'fp4'"),
    (dict(wire_format="fp8_blockwise", x=jnp.zeros((4, 200))), r"wire_dispatch: x's hidden must be a positive "
                                                               r"multiple of 128 for wire_format 'fp8_blockwise', got "
                                                               r"shape \(4, 200\)"),
    (dict(wire_format="mxfp8", x=jnp.zeros((4, 48))), r"wire_dispatch: x's hidden must be a positive multiple of 32 "
                                                      r"for wire_format 'mxfp8', got shape \(4, 48\)"),
    (dict(wire_format="nvfp4", x=jnp.zeros((4, 40))), r"wire_dispatch: x's hidden must be a positive multiple of 16 "
                                                      r"for wire_format 'nvfp4', got shape \(4, 40\)"),
    (dict(x=jnp.zeros((4, HIDDEN), jnp.int32)), r"wire_dispatch: x must be a 2-D bfloat16, float16 or float32 array "
                                                r"\[num_tokens, hidden\], got shape \(4, 256\) dtype int32"),
    (dict(x=jnp.zeros((2, 2, HIDDEN))), r"wire_dispatch: x must be a 2-D bfloat16, float16 or float32 array "
                                        r"\[num_tokens, hidden\], got shape \(2, 2, 256\) dtype float32"),
    (dict(dtype=jnp.int8), r"wire_dispatch: dtype \(of the decoded rows\) must be bfloat16, float16 or float32, got "
                           r"<class 'jax.numpy.int8'>"),
])
def test_bad_arguments_are_refused_by_name(kw, match):
  args = dict(x=jnp.zeros((4, HIDDEN)), wire_format="nvfp4", dtype=jnp.float32)
  args.update(kw)
  x = args.pop("x")
  with pytest.raises(ValueError, match=match):
    wire_dispatch(x, jnp.zeros((x.shape[0], 2), jnp.int32), jnp.zeros((x.shape[0], 2)), num_experts=8,
                  axis_name="ep", **args)
