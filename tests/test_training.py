"""Training with the FP8 recipe: a small MoE regression model trained for 300 steps with FP8 experts and the FP8
backward (`MoEConfig(expert_precision="fp8", expert_backward="fp8")`) ends within 2 % of the loss of the same model
trained with bf16 experts, from the same start on the same data (a fresh batch each step, as in pretraining: the loss is
the model's, not how well it memorized a few batches). The FP8 steps run the grouped-GEMM custom call's CPU handler
here (the reference under JAX_MOE_A2A_IMPL=reference) and the CUDA kernels on a GPU."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jax_moe_a2a import _ffi, moe

STEPS, TOKENS, HIDDEN = 300, 256, 128


def _batches(mesh):
  """The data: x Gaussian, y a fixed random SwiGLU MLP of x (another function than the model's start)."""
  rng = np.random.default_rng(0)
  w1 = rng.standard_normal((HIDDEN, 2 * HIDDEN)) / np.sqrt(HIDDEN)
  w2 = rng.standard_normal((2 * HIDDEN, HIDDEN)) / np.sqrt(2 * HIDDEN)
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "expert")))
  out = []
  for _ in range(STEPS):
    x = rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    h = x @ w1
    y = ((h / (1 + np.exp(-h))) @ w2).astype(np.float32)
    out.append(jax.device_put((jnp.asarray(x, jnp.bfloat16), jnp.asarray(y)), sharding))
  return out


def _train(config, mesh, batches, params):
  opt = optax.adam(3e-3)

  def loss_fn(p, x, y):
    out, aux = moe.moe_apply(p, x, config, mesh)
    return jnp.mean(jnp.square(out.astype(jnp.float32) - y)) + 0.01 * aux["load_balance_loss"]

  @jax.jit
  def step(p, state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(p, x, y)
    updates, state = opt.update(grads, state, p)
    return optax.apply_updates(p, updates), state, loss

  state = opt.init(params)
  losses = []
  for x, y in batches:
    params, state, loss = step(params, state, x, y)
    losses.append(float(loss))
  return np.asarray(losses)


def test_the_fp8_recipe_trains_as_bf16_does():
  n = 4 if len(jax.devices()) >= 4 else 1  # 4 simulated CPU devices, or one GPU
  mesh = jax.make_mesh((1, n), ("data", "expert"), devices=jax.devices()[:n],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  bf16 = moe.MoEConfig(num_experts=8, top_k=2, hidden=HIDDEN, ffn=128, dtype=jnp.bfloat16, param_dtype=jnp.float32)
  fp8 = dataclasses.replace(bf16, expert_precision="fp8", expert_backward="fp8")
  batches = _batches(mesh)
  params = moe.init_params(jax.random.key(0), bf16, mesh)
  base = _train(bf16, mesh, batches, params)
  got = _train(fp8, mesh, batches, params)
  assert base[-20:].mean() < 0.5 * base[:20].mean()  # it learns
  assert np.all(np.isfinite(got))
  assert abs(got[-20:].mean() - base[-20:].mean()) <= 0.02 * base[-20:].mean(), (got[-20:].mean(), base[-20:].mean())


def _computations(hlo: str) -> dict[str, str]:
  """The computations of an HLO module's text, by name."""
  out, name = {}, None
  for line in hlo.splitlines():
    m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
    if m:
      name = m.group(1)
      out[name] = ""
    elif name is not None:
      out[name] += line + "\n"
  return out


def _called_from_loops(comps: dict[str, str]) -> set[str]:
  """The computations a while loop's body or condition runs, with everything they call."""
  refs = lambda text: set(re.findall(r"(?:body|condition|calls|to_apply|branch_computations=\{[^}]*)=?%([\w.\-]+)",
                                     text))
  todo = set().union(*(set(re.findall(r"(?:body|condition)=%([\w.\-]+)", t)) for t in comps.values()))
  seen = set()
  while todo:
    name = todo.pop()
    if name in seen or name not in comps:
      continue
    seen.add(name)
    todo |= refs(comps[name])
  return seen


@pytest.mark.parametrize("backward", ["bf16", "fp8_dgrad", "fp8"])
def test_micro_batches_quantize_the_weights_once(backward, monkeypatch, request):
  """Gradient accumulation over micro-batches written as a `lax.scan` with the parameters closed over, as
  the README says: the FP8 weight quantization depends on no micro-batch, and XLA:CPU hoists it out of the loop,
  so a step quantizes the master weights once, not once per micro-batch. XLA:GPU (jax 0.11.2, one H100) leaves it
  in the loop body: marked as an expected failure there (strict: it fails once XLA:GPU hoists it, so the README's
  note can go)."""
  if not _ffi.available():
    pytest.skip("the weight quantizer is found in the compiled program as the extension's custom call")
  if jax.default_backend() == "gpu":
    request.applymarker(pytest.mark.xfail(strict=True, reason="XLA:GPU keeps the weight quantization in the loop"))
  monkeypatch.delenv(_ffi.ENV_IMPL, raising=False)  # impl="auto": the custom calls where the extension has them
  n = 4 if len(jax.devices()) >= 4 else 1
  mesh = jax.make_mesh((1, n), ("data", "expert"), devices=jax.devices()[:n],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  config = moe.MoEConfig(num_experts=8, top_k=2, hidden=256, ffn=256, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                         expert_precision="fp8", expert_backward=backward)
  params = moe.init_params(jax.random.key(0), config, mesh)

  def step(p, xs):
    grad = jax.grad(lambda p, x: jnp.mean(jnp.square(moe.moe_apply(p, x, config, mesh)[0].astype(jnp.float32))))
    acc, _ = jax.lax.scan(lambda acc, x: (jax.tree.map(jnp.add, acc, grad(p, x)), None),
                          jax.tree.map(jnp.zeros_like, p), xs)
    return acc

  xs = jnp.zeros((4, 16 * n, config.hidden), jnp.bfloat16)
  comps = _computations(jax.jit(step).lower(params, xs).compile().as_text())
  quantizes = lambda text: len(re.findall(r'custom_call_target="jax_moe_a2a_quantize_fp8_weight', text))
  in_loops = _called_from_loops(comps)
  assert in_loops, "the micro-batch loop is gone from the compiled program"
  assert sum(quantizes(t) for t in comps.values()) == 2  # gate/up and down, each once
  assert not [name for name in in_loops if quantizes(comps[name])]
