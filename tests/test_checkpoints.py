"""Hugging Face MoE layers as this package's layer (jax_moe_a2a.checkpoints): for each model type, random tensors
under the checkpoint's names go through `config_from_hf` / `params_from_hf` and `moe.moe_apply`, and must give what
a float64 NumPy forward written from the checkpoint's own definitions (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3
modeling code: router, gate/up/down, shared experts and their gate) computes from the same tensors."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from conftest import devices
from jax_moe_a2a import checkpoints, moe

H, F, E, K, FS = 64, 32, 16, 4, 48
PREFIX = {"mixtral": "model.layers.2.block_sparse_moe.", "qwen2_moe": "model.layers.2.mlp.",
          "qwen3_moe": "model.layers.2.mlp.", "deepseek_v3": "model.layers.2.mlp."}
HF_CONFIGS = {
    "mixtral": {"model_type": "mixtral", "hidden_size": H, "num_local_experts": E, "num_experts_per_tok": K,
                "intermediate_size": F},
    "qwen2_moe": {"model_type": "qwen2_moe", "hidden_size": H, "num_experts": E, "num_experts_per_tok": K,
                  "moe_intermediate_size": F, "shared_expert_intermediate_size": FS, "norm_topk_prob": False},
    "qwen3_moe": {"model_type": "qwen3_moe", "hidden_size": H, "num_experts": E, "num_experts_per_tok": K,
                  "moe_intermediate_size": F, "norm_topk_prob": True},
    "deepseek_v3": {"model_type": "deepseek_v3", "hidden_size": H, "n_routed_experts": E, "num_experts_per_tok": K,
                    "moe_intermediate_size": F, "n_shared_experts": 2, "n_group": 4, "topk_group": 2,
                    "norm_topk_prob": True, "routed_scaling_factor": 2.5},
}


def _tensors(model_type, rng):
  p, t = PREFIX[model_type], {}
  t[p + "gate.weight"] = rng.standard_normal((E, H)) / np.sqrt(H)
  names = ("w1", "w3", "w2") if model_type == "mixtral" else ("gate_proj", "up_proj", "down_proj")
  for e in range(E):
    t[p + f"experts.{e}.{names[0]}.weight"] = rng.standard_normal((F, H)) / np.sqrt(H)
    t[p + f"experts.{e}.{names[1]}.weight"] = rng.standard_normal((F, H)) / np.sqrt(H)
    t[p + f"experts.{e}.{names[2]}.weight"] = rng.standard_normal((H, F)) / np.sqrt(F)
  if model_type == "deepseek_v3":
    t[p + "gate.e_score_correction_bias"] = rng.standard_normal(E) * 0.05
  shared = {"qwen2_moe": ("shared_expert", FS), "deepseek_v3": ("shared_experts", 2 * F)}.get(model_type)
  if shared:
    m, fs = shared
    t[p + f"{m}.gate_proj.weight"] = rng.standard_normal((fs, H)) / np.sqrt(H)
    t[p + f"{m}.up_proj.weight"] = rng.standard_normal((fs, H)) / np.sqrt(H)
    t[p + f"{m}.down_proj.weight"] = rng.standard_normal((H, fs)) / np.sqrt(fs)
  if model_type == "qwen2_moe":
    t[p + "shared_expert_gate.weight"] = rng.standard_normal((1, H)) / np.sqrt(H)
  return {k: v.astype(np.float32) for k, v in t.items()}


def _silu(v):
  return v / (1 + np.exp(-v))


def _mlp(x, g, u, d):
  return (_silu(x @ g.T) * (x @ u.T)) @ d.T


def _hf_forward(model_type, t, x):
  """The checkpoint's MoE block in float64, from its modeling code's definitions."""
  c, p = HF_CONFIGS[model_type], PREFIX[model_type]
  t = {k: v.astype(np.float64) for k, v in t.items()}
  x = x.astype(np.float64)
  logits = x @ t[p + "gate.weight"].T
  if model_type == "deepseek_v3":
    scores = 1 / (1 + np.exp(-logits))
    choice = scores + t[p + "gate.e_score_correction_bias"]
    groups = choice.reshape(len(x), c["n_group"], -1)
    group_scores = np.sort(groups, axis=-1)[..., -2:].sum(-1)
    keep = np.argsort(-group_scores, axis=-1)[:, :c["topk_group"]]
    mask = np.zeros_like(group_scores, bool)
    np.put_along_axis(mask, keep, True, axis=-1)
    # The modeling code masks dropped groups with 0.0 (the layer with -inf): the same choice for positive scores.
    choice = np.where(np.repeat(mask, E // c["n_group"], axis=-1), choice, -np.inf)
    idx = np.argsort(-choice, axis=-1)[:, :K]
    w = np.take_along_axis(scores, idx, axis=-1)
    w = w / (w.sum(-1, keepdims=True) + 1e-20) * c["routed_scaling_factor"]
  else:
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    idx = np.argsort(-probs, axis=-1)[:, :K]
    w = np.take_along_axis(probs, idx, axis=-1)
    if model_type == "mixtral" or c.get("norm_topk_prob"):
      w = w / w.sum(-1, keepdims=True)
  names = ("w1", "w3", "w2") if model_type == "mixtral" else ("gate_proj", "up_proj", "down_proj")
  y = np.zeros_like(x)
  for tok in range(len(x)):
    for j in range(K):
      e = idx[tok, j]
      y[tok] += w[tok, j] * _mlp(x[tok:tok + 1], *(t[p + f"experts.{e}.{n}.weight"] for n in names))[0]
  if model_type == "qwen2_moe":
    m = "shared_expert."
    sh = _mlp(x, t[p + m + "gate_proj.weight"], t[p + m + "up_proj.weight"], t[p + m + "down_proj.weight"])
    y += 1 / (1 + np.exp(-(x @ t[p + "shared_expert_gate.weight"].T))) * sh
  if model_type == "deepseek_v3":
    m = "shared_experts."
    y += _mlp(x, t[p + m + "gate_proj.weight"], t[p + m + "up_proj.weight"], t[p + m + "down_proj.weight"])
  return y


@pytest.mark.parametrize("model_type", checkpoints.MODEL_TYPES)
def test_the_layer_on_mapped_tensors_equals_the_checkpoint_s_forward(model_type):
  mesh = Mesh(np.array(devices(8)).reshape(2, 4), ("data", "expert"))
  rng = np.random.default_rng(len(model_type))
  tensors = _tensors(model_type, rng)
  config = checkpoints.config_from_hf(HF_CONFIGS[model_type], dtype=jnp.float32, param_dtype=jnp.float32)
  params = checkpoints.params_from_hf(tensors, config, model_type=model_type, prefix=PREFIX[model_type])
  assert {k: (v.shape, v.dtype) for k, v in params.items()} == \
      {k: (s.shape, s.dtype) for k, s in moe.param_shapes(config).items()}
  specs = moe.param_specs(config)
  params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
  x = np.asarray(jnp.asarray(rng.standard_normal((64, H)), jnp.bfloat16), np.float32)  # the bf16 wire is lossless
  y, _ = jax.jit(lambda p, x: moe.moe_apply(p, x, config, mesh))(
      params, jax.device_put(x, NamedSharding(mesh, P(("data", "expert")))))
  want = _hf_forward(model_type, tensors, x)
  np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=0, atol=2e-5 * np.abs(want).max())
  if config.shared_expert_gate:  # the gate trains: its gradient is the checkpoint forward's, by finite differences
    loss = lambda p: jnp.sum(moe.moe_apply(p, jnp.asarray(x), config, mesh)[0] * jnp.arange(H, dtype=jnp.float32))
    g = np.asarray(jax.grad(loss)(params)["shared_gate"], np.float64)
    eps, name = 1e-3, PREFIX[model_type] + "shared_expert_gate.weight"
    for i in (0, 7):
      bump = lambda d: {**tensors, name: tensors[name] + d * np.eye(H, dtype=np.float32)[i][None]}
      fd = (_hf_forward(model_type, bump(eps), x) - _hf_forward(model_type, bump(-eps), x)) @ np.arange(H) / (2 * eps)
      np.testing.assert_allclose(g[i], fd.sum(), rtol=1e-3)


def test_configs_take_each_model_s_settings():
  c = checkpoints.config_from_hf(HF_CONFIGS["deepseek_v3"])
  assert (c.router_kind, c.n_group, c.topk_group, c.routed_scaling_factor, c.num_shared_experts, c.shared_ffn) == \
      ("deepseek_v3", 4, 2, 2.5, 1, 2 * F)
  q2 = checkpoints.config_from_hf(HF_CONFIGS["qwen2_moe"])
  assert (q2.renormalize, q2.shared_expert_gate, q2.shared_ffn) == (False, True, FS)
  assert checkpoints.config_from_hf(HF_CONFIGS["qwen3_moe"]).renormalize
  assert checkpoints.config_from_hf(HF_CONFIGS["mixtral"], top_k=2).top_k == 2  # overrides win


def test_bad_inputs_are_named():
  with pytest.raises(ValueError, match=r"model_type must be one of mixtral, qwen2_moe, qwen3_moe, deepseek_v3, "
                                       r"got 'llama'"):
    checkpoints.config_from_hf({"model_type": "llama"})
  with pytest.raises(ValueError, match=r"a mixtral config needs 'num_local_experts'"):
    checkpoints.config_from_hf({"model_type": "mixtral", "hidden_size": H, "num_experts_per_tok": K})
  tensors = _tensors("qwen3_moe", np.random.default_rng(0))
  config = checkpoints.config_from_hf(HF_CONFIGS["qwen3_moe"])
  missing = dict(tensors)
  del missing["model.layers.2.mlp.experts.3.up_proj.weight"]
  with pytest.raises(ValueError, match=r"needs the tensor 'model.layers.2.mlp.experts.3.up_proj.weight'"):
    checkpoints.params_from_hf(missing, config, model_type="qwen3_moe", prefix="model.layers.2.mlp.")
  with pytest.raises(ValueError, match=r"'model.layers.2.mlp.gate.weight' must have shape \(16, 64\) for this "
                                       r"config, got \(16, 32\)"):
    checkpoints.params_from_hf({**tensors, "model.layers.2.mlp.gate.weight": np.zeros((16, 32))}, config,
                               model_type="qwen3_moe", prefix="model.layers.2.mlp.")


def test_shared_expert_gate_needs_shared_experts():
  with pytest.raises(ValueError, match=r"shared_expert_gate=True needs num_shared_experts > 0, got 0"):
    moe.MoEConfig(num_experts=8, top_k=2, hidden=64, ffn=32, shared_expert_gate=True)
