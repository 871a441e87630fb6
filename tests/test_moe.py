"""Tests of the MoE layer (jax_moe_a2a.moe): `moe_apply` against the dense single-device FP32 oracle.

Shapes are small (16 experts, top-4, hidden 256, ffn 128, 64 tokens) so that every mesh, sequence-parallel
setting, wire format and weight format compiles quickly on 8 simulated CPU devices.

Tolerances, and why:

- FP32 compute, BF16 wire (x is BF16-exact, so the wire is lossless), BF16 or FP8 weights (the oracle
  dequantizes the same FP8 weights): the only difference from the oracle is the float32 summation order
  (per-rank partial sums in the combine, tiled matmuls), so ``max |err| <= 2e-5 * max |ref|`` (observed 3e-7).
- FP8-blockwise wire: the experts see E4M3 activations, whose 3 mantissa bits round with a relative error
  uniform in +-2^-4, RMS 2^-4/sqrt(3) = 3.6%, so ``calc_diff(x, y) = 1 - 2 sum(x y) / sum(x^2 + y^2)``, about
  half the squared relative error, is ~6.5e-4 for the activations themselves. Outputs and gradients must stay
  below 2e-3 (observed 5e-4 to 8e-4). Gradients are straight-through (tested bit for bit separately), so only
  the forward activations carry quantization error.
- MXFP8 wire: the same E4M3 codes with a power-of-two (E8M0) scale per 1x32 block instead of per 1x128 group, so
  the same relative error per value (<= 2^-4) and the same limit, 2e-3 (observed 7.5e-4, as the FP8-blockwise
  wire's: for values above E4M3's subnormals, a power-of-two scale does not change the rounding).
- NVFP4 wire: E2M1 keeps one mantissa bit: magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6} on a block of 16 scaled to
  6 (an E4M3 block scale, itself rounded by up to 2^-4), relative steps of 1/3 to 1/2 (e.g. 1 -> 1.5, 4 -> 6) and
  small values flushed to 0. Gaussian rows come back with an RMS relative error of ~9.5%, calc_diff ~4.5e-3 for the
  round trip alone; SwiGLU multiplies two projections of the same rows, so the output's error is about twice
  that (the FP8 wires' 7.5e-4 is likewise twice their 3.5e-4). Outputs and gradients must stay below 3e-2
  (observed 9e-3 output, 8.5e-3 to 1.3e-2 gradients; with FP8 experts on top, up to 1.4e-2).
- FP8 experts (``expert_precision="fp8"``): the experts' input rows and their SwiGLU activations are quantized
  1x128, and float weights 128x128 (FP8 weights are the oracle's own): two or three quantizations of ~6.5e-4 each, so
  outputs and gradients must stay below 4e-3 (observed ~2e-3 with float weights).
- BF16 compute: operands and the combine payload round to 8 bits of mantissa; ``calc_diff < 1e-4`` and
  ``max |err| <= 3e-2 * max |ref|`` (observed 7e-6 and 8e-3).
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from conftest import devices, skip_without_one_sided_backward
from jax_moe_a2a import expert_mlp, moe, routing
from jax_moe_a2a.testing import calc_diff, max_rel

HIDDEN, FFN, EXPERTS, TOP_K, TOKENS = 256, 128, 16, 4, 64
F32_TOL = 2e-5  # max |err| / max |ref| with float32 compute
FP8_CALC_DIFF = 2e-3
FP8_EXPERTS_CALC_DIFF = 4e-3
NVFP4_CALC_DIFF = 3e-2
# The limit of each wire format's calc_diff against the float32 oracle (the module docstring says why), with bf16
# experts and with FP8 experts.
WIRE_CALC_DIFF = {"fp8_blockwise": (FP8_CALC_DIFF, FP8_EXPERTS_CALC_DIFF),
                  "mxfp8": (FP8_CALC_DIFF, FP8_EXPERTS_CALC_DIFF),
                  "nvfp4": (NVFP4_CALC_DIFF, NVFP4_CALC_DIFF)}
BF16_CALC_DIFF, BF16_TOL = 1e-4, 3e-2


def _config(**kw):
  base = dict(num_experts=EXPERTS, top_k=TOP_K, hidden=HIDDEN, ffn=FFN, dtype=jnp.float32)
  base.update(kw)
  return moe.MoEConfig(**base)


def _mesh(shape, names):
  return Mesh(np.asarray(devices(int(np.prod(shape)))).reshape(shape), names)


@functools.lru_cache(maxsize=None)
def _host_params(config, seed):
  """Parameters as NumPy arrays (shapes of `moe.param_shapes`), independent of the test's mesh.

  Drawn with NumPy rather than `moe.init_params` (tested on its own below) to save a compilation per config.
  """
  rng = np.random.default_rng(seed)
  out = {}
  for name, sds in moe.param_shapes(config).items():
    if name.endswith("_sf"):
      continue
    if name == "router_bias":
      out[name] = (0.1 * rng.standard_normal(sds.shape)).astype(np.float32)
      continue
    out[name] = (rng.standard_normal(sds.shape) / np.sqrt(sds.shape[-1])).astype(np.float32)
  if config.fp8_weights:
    w = expert_mlp.ExpertWeights.quantize(jnp.asarray(out["w_gate_up"]), jnp.asarray(out["w_down"]))
    out.update({k: np.asarray(getattr(w, k)) for k in ("w_gate_up", "w_down", "w_gate_up_sf", "w_down_sf")})
  return out


def _inputs(config, mesh, *, seed=0, num_tokens=TOKENS, shape=None):
  """(params, x, ct) placed on the mesh; x holds BF16-exact float32 values (a lossless BF16 wire)."""
  params = {k: jax.device_put(v, NamedSharding(mesh, moe.param_specs(config)[k]))
            for k, v in _host_params(config, seed).items()}
  shape = shape or (num_tokens, HIDDEN)
  kx, kc = jax.random.split(jax.random.key(100 + seed))
  x = jax.random.normal(kx, shape, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)
  ct = jax.random.normal(kc, shape, jnp.float32)
  spec = P(config.token_axes or None, *([None] * (len(shape) - 1)))
  return params, jax.device_put(x, NamedSharding(mesh, spec)), jax.device_put(ct, NamedSharding(mesh, spec))


def _trained(params):
  return [k for k in params if params[k].dtype != jnp.float8_e4m3fn and not k.endswith("_sf") and k != "router_bias"]


def _value_and_grads(apply):
  """jit of (y, aux, grads) for loss = sum(y * ct) + 0.1 * load_balance_loss; grads w.r.t. x and float weights."""

  def loss(trained, rest, x, ct):
    y, aux = apply({**rest, **trained}, x)
    return jnp.sum(y.astype(jnp.float32) * ct) + 0.1 * aux["load_balance_loss"], (y, aux)

  @jax.jit
  def fn(params, x, ct):
    names = _trained(params)
    trained = {k: params[k] for k in names}
    rest = {k: v for k, v in params.items() if k not in names}
    (_, (y, aux)), (g_params, g_x) = jax.value_and_grad(loss, argnums=(0, 2), has_aux=True)(trained, rest, x, ct)
    return y, aux, {"x": g_x, **g_params}

  return fn


@functools.lru_cache(maxsize=None)
def _oracle_fn(config):
  return _value_and_grads(lambda p, x: moe.moe_dense_reference(p, x, config))


def _run(config, mesh, workspace=None, **kw):
  """(moe_apply results, oracle results), each (y, aux, grads) as NumPy."""
  params, x, ct = _inputs(config, mesh, **kw)
  got = _value_and_grads(lambda p, x: moe.moe_apply(p, x, config, mesh, workspace=workspace))(params, x, ct)
  one = jax.devices()[0]
  # The oracle depends on neither mesh nor wire nor compute dtype: share its compilation between tests.
  oracle_config = dataclasses.replace(config, wire_format="bf16", dtype=jnp.float32, token_axes=(),
                                      expert_axis="expert", tp_axis=None, sequence_parallel=False,
                                      expert_precision="dtype", expert_backward="bf16")
  want = _oracle_fn(oracle_config)(*jax.device_put((params, x, ct), one))
  return jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want)


def _assert_close(got, want, tol):
  y, aux, grads = got
  y_ref, aux_ref, grads_ref = want
  assert y.shape == y_ref.shape
  assert max_rel(y, y_ref) <= tol, f"output: {max_rel(y, y_ref):.2e} > {tol:.0e}"
  np.testing.assert_array_equal(aux["expert_load"], aux_ref["expert_load"])
  np.testing.assert_allclose(aux["load_balance_loss"], aux_ref["load_balance_loss"], rtol=1e-5)
  assert sorted(grads) == sorted(grads_ref)
  for name in grads:
    assert max_rel(grads[name], grads_ref[name]) <= tol, f"grad {name}: {max_rel(grads[name], grads_ref[name]):.2e}"


def _assert_calc_diff(got, want, limit):
  y, aux, grads = got
  y_ref, aux_ref, grads_ref = want
  assert calc_diff(y, y_ref) < limit, f"output: calc_diff {calc_diff(y, y_ref):.2e}"
  np.testing.assert_array_equal(aux["expert_load"], aux_ref["expert_load"])
  for name in grads:
    d = calc_diff(grads[name], grads_ref[name])
    assert d < limit, f"grad {name}: calc_diff {d:.2e}"


# ----------------------------------------------------------------------------------------------------------------
# The oracle itself
# ----------------------------------------------------------------------------------------------------------------


def test_dense_reference_matches_per_token_loops():
  """The oracle against float64 NumPy loops: each token through each of its top-k experts, one by one."""
  config = _config(num_shared_experts=1, shared_ffn=64)
  mesh = _mesh((1, 1), ("data", "expert"))
  params, x, _ = _inputs(config, mesh, num_tokens=16)
  y, aux = jax.jit(moe.moe_dense_reference, static_argnums=2)(params, x, config)
  p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  xs = np.asarray(x, np.float64)
  logits = xs @ p["router"]
  weights, ids = routing.route(jnp.asarray(logits, jnp.float32), config.router_config)
  silu = lambda v: v / (1.0 + np.exp(-v))
  mlp = lambda w_gu, w_dn, v: w_dn @ (silu(w_gu[:FFN] @ v) * (w_gu[FFN:] @ v)) if w_gu.shape[0] == 2 * FFN \
      else w_dn @ (silu(w_gu[:64] @ v) * (w_gu[64:] @ v))
  want = np.zeros_like(xs)
  for t in range(xs.shape[0]):
    for k in range(TOP_K):
      e = int(ids[t, k])
      want[t] += float(weights[t, k]) * mlp(p["w_gate_up"][e], p["w_down"][e], xs[t])
    want[t] += mlp(p["shared_w_gate_up"][0], p["shared_w_down"][0], xs[t])
  assert y.dtype == jnp.float32
  assert max_rel(y, want) <= 1e-5
  np.testing.assert_array_equal(np.asarray(aux["expert_load"]), np.bincount(np.asarray(ids).ravel(), minlength=16))


# ----------------------------------------------------------------------------------------------------------------
# Meshes, sequence parallelism, formats
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_matches_oracle_on_data_expert_meshes(shape):
  """Tokens over (data, expert), experts over expert: forward, aux and every gradient equal the oracle."""
  config = _config()
  got, want = _run(config, _mesh(shape, ("data", "expert")))
  _assert_close(got, want, F32_TOL)


# (mesh shape, axis names, config overrides): tp inside the expert axis, and tp beside it.
_TP_CASES = {
    "tp_in_expert_axis": ((2, 4), ("data", "tp"), dict(token_axes=("data",), expert_axis=("data", "tp"),
                                                        tp_axis="tp")),
    "tp_beside_expert_axis": ((4, 2), ("expert", "tp"), dict(token_axes=("expert",), expert_axis="expert",
                                                             tp_axis="tp", num_shared_experts=2,
                                                             router_kind="deepseek_v3", n_group=4, topk_group=2,
                                                             routed_scaling_factor=2.5)),
}


def _all_to_all_capacities(config, mesh, params, x):
  """The capacities (dim 1) of the [num_ranks, capacity, ...] buffers that the forward pass exchanges."""
  text = str(jax.make_jaxpr(lambda p, x: moe.moe_apply(p, x, config, mesh))(params, x))
  return {int(c) for c in re.findall(r":[a-z0-9]+\[\d+,(\d+)[^\]]*\] = all_to_all\[", text)}


@pytest.mark.parametrize("case", sorted(_TP_CASES))
def test_sequence_parallel_matches_oracle_and_baseline(case):
  """Tokens replicated over tp: with and without sequence parallelism the layer equals the oracle (and so each
  other); with it, every rank dispatches only its 1/tp slice (capacity T/tp instead of T)."""
  shape, names, kw = _TP_CASES[case]
  mesh = _mesh(shape, names)
  tp = dict(zip(names, shape))["tp"]
  token_shards = int(np.prod([dict(zip(names, shape))[a] for a in kw["token_axes"]]))
  results = {}
  for sp in (False, True):
    config = _config(sequence_parallel=sp, **kw)
    # The 3-D case: [batch, seq, hidden] with batch sharded.
    x_shape = (8, TOKENS // 8, HIDDEN) if case == "tp_beside_expert_axis" else None
    results[sp] = _run(config, mesh, shape=x_shape)
    _assert_close(*results[sp], F32_TOL)
    params, x, _ = _inputs(config, mesh, shape=x_shape)
    local = TOKENS // token_shards
    assert _all_to_all_capacities(config, mesh, params, x) == {local // tp if sp else local}
  assert max_rel(results[True][0][0], results[False][0][0]) <= F32_TOL


def test_fp8_wire_with_sequence_parallelism():
  shape, names, kw = _TP_CASES["tp_in_expert_axis"]
  config, mesh = _config(wire_format="fp8_blockwise", sequence_parallel=True, **kw), _mesh(shape, names)
  got, want = _run(config, mesh)
  _assert_calc_diff(got, want, FP8_CALC_DIFF)
  assert max_rel(got[0], want[0]) > 1e-4  # the wire really is FP8: the output is not the exact one


def test_fp8_weights_match_oracle_tightly():
  """The oracle dequantizes the same FP8 weights, so with a lossless wire and FP32 compute only rounding differs."""
  config = _config(fp8_weights=True)
  got, want = _run(config, _mesh((2, 4), ("data", "expert")))
  assert sorted(got[2]) == ["router", "x"]  # FP8 weights are not trained
  _assert_close(got, want, F32_TOL)


def test_fp8_wire_and_fp8_weights():
  config = _config(fp8_weights=True, wire_format="fp8_blockwise")
  got, want = _run(config, _mesh((4, 2), ("data", "expert")))
  _assert_calc_diff(got, want, FP8_CALC_DIFF)
  assert max_rel(got[0], want[0]) > 1e-4


@pytest.mark.parametrize("impl", ["ffi", "reference"])
@pytest.mark.parametrize("wire_format", ["mxfp8", "nvfp4"])
def test_every_wire_format_matches_the_oracle(wire_format, impl):
  """The microscaled wires through the layer: with impl="ffi" the quantization custom calls and the one-sided
  dispatch/combine (a workspace; the CPU handlers), with "reference" the pure-JAX quantizers and all_to_all. Output
  and every gradient within the format's limit of the float32 oracle (module docstring), and the wire really lossy."""
  if impl == "ffi":
    pytest.importorskip("jax_moe_a2a._jax_moe_a2a")
    skip_without_one_sided_backward()
  config, mesh = _config(wire_format=wire_format, impl=impl), _mesh((2, 4), ("data", "expert"))
  ws = moe.make_workspace(config, mesh, TOKENS, training=True) if impl == "ffi" else None
  try:
    got, want = _run(config, mesh, workspace=ws)
  finally:
    if ws is not None:
      ws.check()
      ws.close()
  _assert_calc_diff(got, want, WIRE_CALC_DIFF[wire_format][0])
  assert max_rel(got[0], want[0]) > 1e-4
  if wire_format == "nvfp4":  # four bits: more error than an FP8 wire can have
    assert calc_diff(got[0], want[0]) > FP8_CALC_DIFF


@pytest.mark.parametrize("wire_format", ["mxfp8", "nvfp4"])
def test_fp8_experts_on_a_microscaled_wire(wire_format):
  """FP8 experts get the decoded MXFP8/NVFP4 rows and quantize them 1x128 themselves."""
  config = _config(wire_format=wire_format, expert_precision="fp8")
  got, want = _run(config, _mesh((4, 2), ("data", "expert")))
  _assert_calc_diff(got, want, WIRE_CALC_DIFF[wire_format][1])
  assert max_rel(got[0], want[0]) > 1e-4


@pytest.mark.parametrize("impl", ["auto", "reference"])
@pytest.mark.parametrize("fp8_weights", [False, True])
def test_fp8_experts_on_the_grouped_gemm(impl, fp8_weights):
  """Routed experts in FP8 (grouped GEMM custom call, which "auto" takes with the extension, or its reference):
  activations quantized 1x128 twice."""
  if impl == "auto":
    pytest.importorskip("jax_moe_a2a._jax_moe_a2a")
  config = _config(fp8_weights=fp8_weights, expert_precision="fp8", impl=impl)
  got, want = _run(config, _mesh((2, 4), ("data", "expert")))
  _assert_calc_diff(got, want, FP8_EXPERTS_CALC_DIFF)
  assert max_rel(got[0], want[0]) > 1e-4  # the experts really ran in FP8


@pytest.mark.parametrize("backward,fp8_weights", [("fp8_dgrad", False), ("fp8_dgrad", True), ("fp8", False)])
def test_the_fp8_backward_matches_the_oracle(backward, fp8_weights):
  """expert_backward="fp8_dgrad" (FP8 data gradients, FP8-kept gate/up rows) and "fp8" (FP8 weight gradients too)
  through the whole layer: output and every gradient within the FP8 experts' tolerance of the float32 oracle, and
  gradients not those of the bf16 backward."""
  config = _config(fp8_weights=fp8_weights, expert_precision="fp8", expert_backward=backward)
  mesh = _mesh((2, 4), ("data", "expert"))
  got, want = _run(config, mesh)
  _assert_calc_diff(got, want, FP8_EXPERTS_CALC_DIFF)
  bf16_backward, _ = _run(dataclasses.replace(config, expert_backward="bf16"), mesh)
  np.testing.assert_array_equal(got[0], bf16_backward[0])  # the same forward
  assert max_rel(got[2]["x"], bf16_backward[2]["x"]) > 1e-4  # another backward


def test_moe_apply_expert_precision_argument_overrides_the_config():
  config, mesh = _config(), _mesh((2, 4), ("data", "expert"))
  params, x, _ = _inputs(config, mesh)
  bf16_path = moe.moe_apply(params, x, config, mesh)[0]
  fp8_path = moe.moe_apply(params, x, config, mesh, expert_precision="fp8")[0]
  same = moe.moe_apply(params, x, dataclasses.replace(config, expert_precision="fp8"), mesh)[0]
  np.testing.assert_array_equal(np.asarray(fp8_path), np.asarray(same))
  assert max_rel(fp8_path, bf16_path) > 1e-4
  back = moe.moe_apply(params, x, dataclasses.replace(config, expert_precision="fp8"), mesh, expert_precision="dtype")
  np.testing.assert_array_equal(np.asarray(back[0]), np.asarray(bf16_path))


def test_the_deprecated_gemm_impl_is_read_as_expert_precision_fp8_with_a_warning():
  """The old spelling keeps working for one release: MoEConfig(gemm_impl=...) and moe_apply(..., gemm_impl=...)
  warn, naming expert_precision, and make the config (equal, same hash) and the output of expert_precision="fp8"."""
  new = _config(expert_precision="fp8")
  with pytest.warns(DeprecationWarning, match=r"MoEConfig: gemm_impl is deprecated: use expert_precision='fp8'"):
    old = _config(gemm_impl="reference")
  assert old == new and hash(old) == hash(new) and old.gemm_impl is None
  mesh = _mesh((2, 4), ("data", "expert"))
  params, x, _ = _inputs(new, mesh)
  want = moe.moe_apply(params, x, new, mesh)[0]
  with pytest.warns(DeprecationWarning, match=r"moe_apply: gemm_impl is deprecated: use expert_precision='fp8'"):
    got = moe.moe_apply(params, x, _config(), mesh, gemm_impl="auto")[0]
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_bf16_compute():
  config = _config(dtype=jnp.bfloat16)
  got, want = _run(config, _mesh((2, 4), ("data", "expert")))
  _assert_calc_diff(got, want, BF16_CALC_DIFF)
  assert max_rel(got[0], want[0]) <= BF16_TOL


# ----------------------------------------------------------------------------------------------------------------
# The layer's exchanges (the wire's own gradient: test_wire.py)
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("wire_format", ["bf16", "fp8_blockwise", "mxfp8", "nvfp4"])
def test_backward_adds_two_exchanges_and_no_dispatch(wire_format):
  """The backward pass is one combine for the wire and one dispatch-shaped exchange for the combine's VJP."""
  config = _config(wire_format=wire_format)
  mesh = _mesh((2, 4), ("data", "expert"))
  params, x, _ = _inputs(config, mesh)

  def count(fn):
    return str(jax.make_jaxpr(fn)(params, x)).count("all_to_all[")

  forward = count(lambda p, x: moe.moe_apply(p, x, config, mesh)[0])
  backward = count(jax.grad(lambda p, x: jnp.sum(moe.moe_apply(p, x, config, mesh)[0]), argnums=(0, 1)))
  # dispatch: x (+ scales, but for bf16), ids, weights, counts; combine: 1. NVFP4's global scale is a pmax.
  assert forward == (5 if wire_format == "bf16" else 6)
  assert backward == forward + 2


# ----------------------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------------------


def test_jit_training_step_lowers_the_loss():
  """Toy regression: fit a teacher MoE's outputs with Adam; 20 jitted steps at least halve the loss."""
  config = _config()
  mesh = _mesh((2, 4), ("data", "expert"))
  student, x, _ = _inputs(config, mesh, seed=0)
  teacher, _, _ = _inputs(config, mesh, seed=1)
  target = moe.moe_apply(teacher, x, config, mesh)[0]
  opt = optax.adam(3e-3)

  def loss_fn(params):
    y, aux = moe.moe_apply(params, x, config, mesh)
    return jnp.mean((y - target) ** 2) + 1e-2 * aux["load_balance_loss"]

  @jax.jit
  def step(params, state):
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  state = opt.init(student)
  losses = []
  for _ in range(20):
    student, state, loss = step(student, state)
    losses.append(float(loss))
  assert np.all(np.isfinite(losses))
  assert losses[-1] < 0.5 * losses[0], losses
  assert student["w_gate_up"].sharding.is_equivalent_to(NamedSharding(mesh, moe.param_specs(config)["w_gate_up"]), 3)


# ----------------------------------------------------------------------------------------------------------------
# Parameters
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fp8_weights", [False, True])
def test_init_params_shapes_and_shardings(fp8_weights):
  config = _config(fp8_weights=fp8_weights, router_kind="deepseek_v3", n_group=4, topk_group=2,
                   num_shared_experts=1, token_axes=("data",), expert_axis=("data", "tp"), tp_axis="tp")
  mesh = _mesh((2, 4), ("data", "tp"))
  params = moe.init_params(jax.random.key(0), config, mesh)
  shapes, specs = moe.param_shapes(config), moe.param_specs(config)
  assert sorted(params) == sorted(shapes) == sorted(specs)
  for name, p in params.items():
    assert (p.shape, p.dtype) == (shapes[name].shape, shapes[name].dtype), name
    assert p.sharding == NamedSharding(mesh, specs[name]), name
  assert params["w_gate_up"].addressable_shards[0].data.shape[0] == EXPERTS // 8
  assert params["router"].addressable_shards[0].data.shape == (HIDDEN, EXPERTS)
  np.testing.assert_array_equal(np.asarray(params["router_bias"]), 0.0)
  assert params["w_gate_up"].dtype == (jnp.float8_e4m3fn if fp8_weights else jnp.float32)


# ----------------------------------------------------------------------------------------------------------------
# Errors at trace time
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw,match", [
    (dict(top_k=17), "MoEConfig: top_k must be <= num_experts=16, got 17"),
    (dict(top_k=0), "MoEConfig: top_k must be a positive int, got 0"),
    (dict(hidden=200, wire_format="fp8_blockwise"), "hidden=200 does not fit wire_format 'fp8_blockwise'"),
    (dict(hidden=208, wire_format="mxfp8"), "hidden=208 does not fit wire_format 'mxfp8': dispatch_layout: mxfp8 "
                                            "needs hidden % 32 == 0 or an mx_alignment, got hidden=208"),
    (dict(hidden=200, wire_format="nvfp4"), "hidden=200 does not fit wire_format 'nvfp4': dispatch_layout: nvfp4 "
                                            "needs hidden % 16 == 0, got hidden=200"),
    (dict(wire_format="fp4"), "wire_format must be one of bf16, fp8_blockwise, mxfp8, nvfp4, got 'fp4'"),
    (dict(sequence_parallel=True), "sequence_parallel=True needs tp_axis"),
    (dict(tp_axis="data"), "tp_axis must not be one of token_axes"),
    (dict(expert_axis=("expert", "expert")), "expert_axis must not repeat an axis"),
    (dict(expert_axis=()), "expert_axis must be a mesh axis name or a tuple of them"),
    (dict(dtype=jnp.int32), "dtype must be bfloat16, float16 or float32"),
    (dict(impl="cuda"), "impl must be one of auto, ffi, reference"),
    (dict(router_kind="deepseek_v3", n_group=3), "invalid router settings"),
    (dict(num_shared_experts=-1), "num_shared_experts must be an int >= 0"),
    (dict(gemm_impl="cutlass"), "gemm_impl (deprecated: use expert_precision='fp8') must be None or one of auto, "
                                "ffi, reference, got 'cutlass'"),
    (dict(expert_precision="bf16"), "expert_precision must be one of 'dtype', 'fp8', got 'bf16'"),
    (dict(expert_precision="fp8", ffn=96), "ffn must be a multiple of 128 with expert_precision='fp8' (FP8 experts), "
                                           "got ffn=96"),
    (dict(expert_backward="fp4"), "expert_backward must be one of bf16, fp8_dgrad, fp8, got 'fp4'"),
    (dict(expert_backward="fp8"), "expert_backward='fp8' is a backward of FP8 experts, so it needs "
                                  "expert_precision='fp8', got expert_precision='dtype'"),
])
def test_config_errors(kw, match):
  with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
    _config(**kw)


def _error_case(name):
  """(config, mesh, params, x) with one thing wrong."""
  config = _config()
  mesh = _mesh((2, 4), ("data", "expert"))
  params, x, _ = _inputs(config, mesh)
  if name == "missing_axis":
    config = _config(expert_axis="experts")
  elif name == "experts_not_divisible":
    config = _config(num_experts=18)
  elif name == "tp_missing":
    config = _config(token_axes=("data",), tp_axis="tp")
  elif name == "tokens_not_divisible":
    x = x[:60]
  elif name == "sp_tokens_not_divisible":
    mesh = _mesh((2, 4), ("data", "tp"))
    config = _config(token_axes=("data",), expert_axis=("data", "tp"), tp_axis="tp", sequence_parallel=True)
    x = x[:36]
  elif name == "x_hidden":
    x = x[:, :128]
  elif name == "x_rank":
    x = x[0]
  elif name == "x_dtype":
    x = x.astype(jnp.int32)
  elif name == "param_shape":
    params = dict(params, w_down=params["w_down"][:, :, :64])
  elif name == "param_missing":
    params = {k: v for k, v in params.items() if k != "router"}
  elif name == "param_dtype":
    params = dict(params, w_gate_up=params["w_gate_up"].astype(jnp.int8))
  elif name == "fp8_scales_missing":
    config = _config(fp8_weights=True)
  return config, mesh, params, x


@pytest.mark.parametrize("name,match", [
    ("missing_axis", r"moe_apply: expert_axis must name axes of the mesh \('data', 'expert'\), got 'experts'"),
    ("experts_not_divisible", r"num_experts must be divisible by the size of expert_axis 'expert' \(4\), got 18"),
    ("tp_missing", r"tp_axis must name axes of the mesh \('data', 'expert'\), got 'tp'"),
    ("tokens_not_divisible", r"num_tokens must be divisible by the token sharding .* \(8 shards\), got 60"),
    ("sp_tokens_not_divisible", r"divisible by the size of tp_axis 'tp' \(4\) under sequence parallelism, got 18"),
    ("x_hidden", r"x must be \[num_tokens, hidden=256\] .*got shape \(64, 128\)"),
    ("x_rank", r"x must be \[num_tokens, hidden=256\] .*got shape \(256,\)"),
    ("x_dtype", r"x must be bfloat16, float16 or float32, got int32"),
    ("param_shape", r"params\['w_down'\] must have shape \(16, 256, 128\), got \(16, 256, 64\)"),
    ("param_missing", r"params must have the keys .* \(missing \['router'\], unexpected \[\]\)"),
    ("param_dtype", r"params\['w_gate_up'\] must be a floating dtype of 16 or 32 bits, got int8"),
    ("fp8_scales_missing", r"params must have the keys .*missing \['w_down_sf', 'w_gate_up_sf'\]"),
])
def test_moe_apply_errors(name, match):
  config, mesh, params, x = _error_case(name)
  with pytest.raises(ValueError, match=match):
    moe.moe_apply(params, x, config, mesh)
  with pytest.raises(ValueError, match=match):  # the same error when traced under jit
    jax.jit(lambda p, x: moe.moe_apply(p, x, config, mesh)).lower(params, x)


def test_moe_apply_rejects_a_non_config():
  mesh = _mesh((2, 4), ("data", "expert"))
  with pytest.raises(TypeError, match="moe_apply: config must be a MoEConfig, got dict"):
    moe.moe_apply({}, jnp.zeros((8, HIDDEN)), {"num_experts": 16}, mesh)


# ----------------------------------------------------------------------------------------------------------------
# The mesh from jax.set_mesh; names for remat policies
# ----------------------------------------------------------------------------------------------------------------


def test_the_mesh_can_come_from_jax_set_mesh():
  """init_params, make_workspace and moe_apply without a mesh take the one set with jax.set_mesh: the same bits as
  passing it."""
  config = _config()
  mesh = _mesh((2, 4), ("data", "expert"))
  params, x, _ = _inputs(config, mesh)
  want = moe.moe_apply(params, x, config, mesh)
  with jax.set_mesh(mesh):
    got = moe.moe_apply(params, x, config)
    drawn = moe.init_params(jax.random.key(3), config)
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
  for name, value in moe.init_params(jax.random.key(3), config, mesh).items():
    np.testing.assert_array_equal(np.asarray(drawn[name]), np.asarray(value))
    assert drawn[name].sharding == value.sharding


@pytest.mark.parametrize("fn", ["moe_apply", "init_params", "make_workspace"])
def test_no_mesh_given_or_set_is_refused(fn):
  config = _config()
  call = {"moe_apply": lambda: moe.moe_apply({}, jnp.zeros((8, HIDDEN)), config),
          "init_params": lambda: moe.init_params(jax.random.key(0), config),
          "make_workspace": lambda: moe.make_workspace(config, None, 64)}[fn]
  with pytest.raises(ValueError, match=rf"{fn}: mesh must be given, or set with jax.set_mesh\(mesh\), got neither"):
    call()


@pytest.mark.parametrize("path", ["f32", "bf16"])
def test_tensors_the_backward_needs_carry_checkpoint_names(path):
  """router_logits, dispatched_rows, and expert_gate_up (bf16 experts) or expert_rows (XLA's experts) are named in
  the program, so a remat policy such as jax.checkpoint_policies.save_only_these_names can keep or drop them; and a
  layer under jax.checkpoint with that policy gives the same gradients."""
  dtype = jnp.float32 if path == "f32" else jnp.bfloat16
  config = _config(dtype=dtype)
  mesh = _mesh((1, 2), ("data", "expert"))
  params, x, ct = _inputs(config, mesh, num_tokens=16)
  names = ["router_logits", "dispatched_rows"] + (["expert_gate_up"] if path == "bf16" else ["expert_rows"])
  text = str(jax.make_jaxpr(lambda p, x: moe.moe_apply(p, x, config, mesh))(params, x))
  for name in names:
    assert re.search(rf"name={name}\b", text), f"no checkpoint_name {name!r} in the layer's program"
  plain = _value_and_grads(lambda p, x: moe.moe_apply(p, x, config, mesh))(params, x, ct)
  policy = jax.checkpoint_policies.save_only_these_names(*names)
  remat = _value_and_grads(jax.checkpoint(lambda p, x: moe.moe_apply(p, x, config, mesh), policy=policy))(
      params, x, ct)
  for name in plain[2]:
    np.testing.assert_array_equal(np.asarray(remat[2][name]), np.asarray(plain[2][name]))


def test_bf16_router_logits_are_the_float32_product():
  """bf16 x and router multiply in one bf16 pass accumulating in float32: every product is exact, so the logits are
  the float64 product rounded by float32 summation alone, and their gradients reach x and the router."""
  rng = np.random.default_rng(7)
  x = jnp.asarray(rng.standard_normal((64, HIDDEN)), jnp.bfloat16)
  router = jnp.asarray(rng.standard_normal((HIDDEN, EXPERTS)) / 16, jnp.bfloat16)
  router_logits = moe._router_logits  # pylint: disable=protected-access
  logits = router_logits(x, router)
  assert logits.dtype == jnp.float32
  want = np.asarray(x, np.float64) @ np.asarray(router, np.float64)
  assert max_rel(logits, want) <= 1e-6
  gx, gr = jax.grad(lambda x, r: jnp.sum(router_logits(x, r) ** 2), argnums=(0, 1))(x, router)
  assert gx.dtype == jnp.bfloat16 and gr.dtype == jnp.bfloat16
  g64 = 2 * want
  assert max_rel(gx, g64 @ np.asarray(router, np.float64).T) <= 1e-2
  assert max_rel(gr, np.asarray(x, np.float64).T @ g64) <= 1e-2
