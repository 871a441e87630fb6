"""Hugging Face MoE layers as this package's layer (jax_moe_a2a.checkpoints): for each model type, random tensors
under the checkpoint's names go through `config_from_hf` / `params_from_hf` and `moe.moe_apply`, and must give what
a float64 NumPy forward written from the checkpoint's own definitions (transformers 5.25.0's Mixtral, Qwen2-MoE,
Qwen3-MoE, DeepSeek-V3, GLM-4.5 and OLMoE modeling code: router, gate/up/down, shared experts and their gate)
computes from the same tensors. Config keys are read as transformers' classes read them (checked against the classes
themselves), FP8 checkpoints keep their bits, and a checkpoint directory loads one layer onto a mesh."""

import json
import re

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from conftest import devices
from jax_moe_a2a import checkpoints, moe, quant

H, F, E, K, FS = 64, 32, 16, 4, 48
PREFIX = {"mixtral": "model.layers.2.block_sparse_moe.", "qwen2_moe": "model.layers.2.mlp.",
          "qwen3_moe": "model.layers.2.mlp.", "deepseek_v3": "model.layers.2.mlp.", "glm4_moe": "model.layers.2.mlp.",
          "olmoe": "model.layers.2.mlp."}
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
    # GLM-4.5's config.json as transformers' class writes it: the expert count under its alias.
    "glm4_moe": {"model_type": "glm4_moe", "hidden_size": H, "num_local_experts": E, "num_experts_per_tok": K,
                 "moe_intermediate_size": F, "n_shared_experts": 1, "n_group": 2, "topk_group": 1,
                 "norm_topk_prob": True, "routed_scaling_factor": 1.5},
    "olmoe": {"model_type": "olmoe", "hidden_size": H, "num_experts": E, "num_experts_per_tok": K,
              "intermediate_size": F},
}
SHARED = {"qwen2_moe": ("shared_expert", FS), "deepseek_v3": ("shared_experts", 2 * F),
          "glm4_moe": ("shared_experts", F)}
SIGMOID_ROUTERS = ("deepseek_v3", "glm4_moe")


def _tensors(model_type, rng, prefix=None, h=H, f=F, e=E, shared=None):
  p, t = PREFIX[model_type] if prefix is None else prefix, {}
  t[p + "gate.weight"] = rng.standard_normal((e, h)) / np.sqrt(h)
  names = ("w1", "w3", "w2") if model_type == "mixtral" else ("gate_proj", "up_proj", "down_proj")
  for i in range(e):
    t[p + f"experts.{i}.{names[0]}.weight"] = rng.standard_normal((f, h)) / np.sqrt(h)
    t[p + f"experts.{i}.{names[1]}.weight"] = rng.standard_normal((f, h)) / np.sqrt(h)
    t[p + f"experts.{i}.{names[2]}.weight"] = rng.standard_normal((h, f)) / np.sqrt(f)
  if model_type in SIGMOID_ROUTERS:
    t[p + "gate.e_score_correction_bias"] = rng.standard_normal(e) * 0.05
  shared = SHARED.get(model_type) if shared is None else shared
  if shared:
    m, fs = shared
    t[p + f"{m}.gate_proj.weight"] = rng.standard_normal((fs, h)) / np.sqrt(h)
    t[p + f"{m}.up_proj.weight"] = rng.standard_normal((fs, h)) / np.sqrt(h)
    t[p + f"{m}.down_proj.weight"] = rng.standard_normal((h, fs)) / np.sqrt(fs)
  if model_type == "qwen2_moe":
    t[p + "shared_expert_gate.weight"] = rng.standard_normal((1, h)) / np.sqrt(h)
  return {k: v.astype(np.float32) for k, v in t.items()}


def _silu(v):
  return v / (1 + np.exp(-v))


def _mlp(x, g, u, d):
  return (_silu(x @ g.T) * (x @ u.T)) @ d.T


def _hf_forward(model_type, t, x, c=None, p=None):
  """The checkpoint's MoE block in float64, from its modeling code's definitions (transformers 5.25.0)."""
  c = HF_CONFIGS[model_type] if c is None else c
  p = PREFIX[model_type] if p is None else p
  t = {k: np.asarray(v).astype(np.float64) for k, v in t.items()}
  x = x.astype(np.float64)
  logits = x @ t[p + "gate.weight"].T
  e, k = logits.shape[1], c["num_experts_per_tok"]
  if model_type in SIGMOID_ROUTERS:
    scores = 1 / (1 + np.exp(-logits))
    choice = scores + t[p + "gate.e_score_correction_bias"]
    groups = choice.reshape(len(x), c["n_group"], -1)
    group_scores = np.sort(groups, axis=-1)[..., -2:].sum(-1)
    keep = np.argsort(-group_scores, axis=-1)[:, :c["topk_group"]]
    mask = np.zeros_like(group_scores, bool)
    np.put_along_axis(mask, keep, True, axis=-1)
    choice = np.where(np.repeat(mask, e // c["n_group"], axis=-1), choice, -np.inf)
    idx = np.argsort(-choice, axis=-1)[:, :k]
    w = np.take_along_axis(scores, idx, axis=-1)
    if c["norm_topk_prob"]:
      w = w / (w.sum(-1, keepdims=True) + 1e-20)
    w = w * c["routed_scaling_factor"]
  else:
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    idx = np.argsort(-probs, axis=-1)[:, :k]
    w = np.take_along_axis(probs, idx, axis=-1)
    if model_type == "mixtral" or c.get("norm_topk_prob"):
      w = w / w.sum(-1, keepdims=True)
  names = ("w1", "w3", "w2") if model_type == "mixtral" else ("gate_proj", "up_proj", "down_proj")
  y = np.zeros_like(x)
  for tok in range(len(x)):
    for j in range(k):
      e = idx[tok, j]
      y[tok] += w[tok, j] * _mlp(x[tok:tok + 1], *(t[p + f"experts.{e}.{n}.weight"] for n in names))[0]
  if model_type == "qwen2_moe":
    m = "shared_expert."
    sh = _mlp(x, t[p + m + "gate_proj.weight"], t[p + m + "up_proj.weight"], t[p + m + "down_proj.weight"])
    y += 1 / (1 + np.exp(-(x @ t[p + "shared_expert_gate.weight"].T))) * sh
  if model_type in SIGMOID_ROUTERS:
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


# ----------------------------------------------------------------------------------------------------------------
# config.json, read as transformers reads it
# ----------------------------------------------------------------------------------------------------------------


def test_configs_take_each_model_s_settings():
  c = checkpoints.config_from_hf(HF_CONFIGS["deepseek_v3"])
  assert (c.router_kind, c.n_group, c.topk_group, c.routed_scaling_factor, c.num_shared_experts, c.shared_ffn) == \
      ("deepseek_v3", 4, 2, 2.5, 1, 2 * F)
  g = checkpoints.config_from_hf(HF_CONFIGS["glm4_moe"])
  assert (g.router_kind, g.num_experts, g.n_group, g.topk_group, g.routed_scaling_factor, g.shared_ffn) == \
      ("deepseek_v3", E, 2, 1, 1.5, F)
  q2 = checkpoints.config_from_hf(HF_CONFIGS["qwen2_moe"])
  assert (q2.renormalize, q2.shared_expert_gate, q2.shared_ffn) == (False, True, FS)
  assert checkpoints.config_from_hf(HF_CONFIGS["qwen3_moe"]).renormalize
  o = checkpoints.config_from_hf(HF_CONFIGS["olmoe"])
  assert (o.router_kind, o.renormalize, o.ffn, o.num_shared_experts) == ("softmax", False, F, 0)
  assert checkpoints.config_from_hf(HF_CONFIGS["mixtral"], top_k=2).top_k == 2  # overrides win


def test_a_trimmed_deepseek_config_takes_the_class_defaults():
  c = checkpoints.config_from_hf({"model_type": "deepseek_v3", "hidden_size": 128, "moe_intermediate_size": 32,
                                  "n_routed_experts": 16, "num_experts_per_tok": 4})
  assert (c.n_group, c.topk_group, c.routed_scaling_factor, c.renormalize) == (8, 4, 2.5, True)
  assert (c.num_shared_experts, c.shared_ffn) == (1, 32)


# What each model type's config class gives for a config.json holding only the model type (transformers 5.25.0).
EMPTY = {
    "mixtral": dict(hidden=4096, num_experts=8, top_k=2, ffn=14336, renormalize=True, num_shared_experts=0),
    "qwen2_moe": dict(hidden=2048, num_experts=60, top_k=4, ffn=1408, renormalize=False, num_shared_experts=1,
                      shared_ffn=5632, shared_expert_gate=True),
    "qwen3_moe": dict(hidden=2048, num_experts=128, top_k=8, ffn=768, renormalize=False, num_shared_experts=0),
    "deepseek_v3": dict(hidden=7168, num_experts=256, top_k=8, ffn=2048, n_group=8, topk_group=4, renormalize=True,
                        routed_scaling_factor=2.5, num_shared_experts=1, shared_ffn=2048, router_kind="deepseek_v3"),
    "glm4_moe": dict(hidden=4096, num_experts=128, top_k=8, ffn=1408, n_group=1, topk_group=1, renormalize=True,
                     routed_scaling_factor=1.0, num_shared_experts=1, shared_ffn=1408, router_kind="deepseek_v3"),
    "olmoe": dict(hidden=2048, num_experts=64, top_k=8, ffn=2048, renormalize=False, num_shared_experts=0),
}


@pytest.mark.parametrize("model_type", checkpoints.MODEL_TYPES)
def test_absent_keys_take_the_class_defaults(model_type):
  c = checkpoints.config_from_hf({"model_type": model_type})
  assert {k: getattr(c, k) for k in EMPTY[model_type]} == EMPTY[model_type]


@pytest.mark.parametrize("model_type", checkpoints.MODEL_TYPES)
def test_defaults_and_aliases_are_transformers_own(model_type):
  """HF_DEFAULTS and HF_ALIASES against the config classes themselves, and a config.json as the class writes it."""
  transformers = pytest.importorskip("transformers")
  assert transformers.__version__ == checkpoints.TRANSFORMERS_VERSION
  cls = transformers.CONFIG_MAPPING[model_type]
  default = cls()
  for key, value in checkpoints.HF_DEFAULTS[model_type].items():
    assert getattr(default, key) == value, key
  for alias, key in checkpoints.HF_ALIASES.get(model_type, {}).items():
    assert getattr(cls.from_dict({"model_type": model_type, alias: 7}), key) == 7, alias
  # The whole config.json the class writes (Qwen3-MoE's names its experts num_local_experts).
  experts = {"mixtral": "num_local_experts", "deepseek_v3": "n_routed_experts",
             "glm4_moe": "n_routed_experts"}.get(model_type, "num_experts")
  written = cls(hidden_size=256, num_experts_per_tok=2, **{experts: 16}).to_dict()
  c = checkpoints.config_from_hf(written)
  assert (c.hidden, c.num_experts, c.top_k) == (256, 16, 2)
  assert c.ffn == getattr(default, "intermediate_size" if model_type in ("mixtral", "olmoe")
                          else "moe_intermediate_size")


@pytest.mark.parametrize("key,value", [("hidden_size", 4096.7), ("hidden_size", True), ("hidden_size", 128.0),
                                       ("num_experts_per_tok", 2.5), ("hidden_size", "128")])
def test_values_transformers_refuses_are_refused(key, value):
  transformers = pytest.importorskip("transformers")
  bad = {**HF_CONFIGS["deepseek_v3"], key: value}
  with pytest.raises(Exception):
    transformers.CONFIG_MAPPING["deepseek_v3"].from_dict(dict(bad))
  with pytest.raises(ValueError, match=rf"config_from_hf: '{key}' must be an int >= 1, got {value!r}"):
    checkpoints.config_from_hf(bad)


@pytest.mark.parametrize("model_type,change,message", [
    ("qwen2_moe", {"shared_expert_intermediate_size": -5}, r"'shared_expert_intermediate_size' must be an int >= 1, "
                                                            r"got -5"),
    ("qwen2_moe", {"norm_topk_prob": 1}, r"'norm_topk_prob' must be true or false, got 1"),
    ("deepseek_v3", {"n_shared_experts": -1}, r"'n_shared_experts' must be an int >= 0, got -1"),
    ("deepseek_v3", {"routed_scaling_factor": 0}, r"'routed_scaling_factor' must be a finite number > 0, got 0"),
    ("deepseek_v3", {"scoring_func": "softmax"}, r"'scoring_func' must be 'sigmoid' .*got 'softmax'"),
    ("deepseek_v3", {"topk_method": "greedy"}, r"'topk_method' must be 'noaux_tc' .*got 'greedy'"),
    # transformers' class takes None (its router then fails): refused here.
    ("deepseek_v3", {"n_group": None}, r"'n_group' must be an int >= 1, got None"),
    ("deepseek_v3", {"n_group": 3}, r"'n_group' must divide 'n_routed_experts' \(16\), got 3"),
    ("deepseek_v3", {"topk_group": 5}, r"'topk_group' must be <= 'n_group' \(4\), got 5"),
    ("deepseek_v3", {"topk_group": 1, "num_experts_per_tok": 5},
     r"'num_experts_per_tok' must be <= 'topk_group' x experts per group \(1 x 4\), got 5"),
    ("deepseek_v3", {"num_local_experts": 32}, r"'n_routed_experts' and 'num_local_experts' name one setting .* "
                                                r"got 16, 32"),
    ("deepseek_v3", {"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}},
     r"quantization_config\['weight_block_size'\] must be \[128, 128\]"),
    ("deepseek_v3", {"quantization_config": {"quant_method": "gptq"}}, r"quantization_config\['quant_method'\] must "
                                                                      r"be 'fp8'"),
    ("olmoe", {"num_experts_per_tok": 17}, r"'num_experts_per_tok' must be <= 'num_experts' \(16\), got 17"),
    ("mixtral", {"router_jitter_noise": 0.01}, r"'router_jitter_noise' must be 0.0 .*got 0.01"),
    ("mixtral", {"hidden_act": "gelu"}, r"'hidden_act' must be 'silu' .*got 'gelu'"),
])
def test_settings_the_layer_does_not_run_are_refused_naming_the_key(model_type, change, message):
  with pytest.raises(ValueError, match=message):
    checkpoints.config_from_hf({**HF_CONFIGS[model_type], **change})


def test_a_deepseek_config_with_groups_of_one_expert_is_refused():
  # transformers scores each group by its 2 best experts (topk(2)), which a group of one does not have.
  with pytest.raises(ValueError, match=r"'n_group' must leave at least 2 experts a group \(transformers scores a group "
                                       r"by its 2 best experts\), got 16 groups of 1"):
    checkpoints.config_from_hf({**HF_CONFIGS["deepseek_v3"], "n_group": 16, "topk_group": 4})


def test_settings_transformers_reads_as_others_are_read_so():
  assert checkpoints.config_from_hf({**HF_CONFIGS["mixtral"], "hidden_act": "swish"}).num_experts == E  # SiLU
  qwen = {**HF_CONFIGS["qwen3_moe"], "mlp_only_layers": None}  # transformers' class reads None as []
  assert checkpoints._dense_reason(qwen, "qwen3_moe", 2) is None  # pylint: disable=protected-access


def test_an_fp8_quantization_config_is_accepted():
  q = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
  assert checkpoints.config_from_hf({**HF_CONFIGS["deepseek_v3"], "quantization_config": q,
                                     "scoring_func": "sigmoid", "topk_method": "noaux_tc"}).num_experts == E


def test_bad_inputs_are_named():
  with pytest.raises(ValueError, match=r"model_type must be one of mixtral, qwen2_moe, qwen3_moe, deepseek_v3, "
                                       r"glm4_moe, olmoe, got 'llama'"):
    checkpoints.config_from_hf({"model_type": "llama"})
  with pytest.raises(TypeError, match=r"config_from_hf: hf must be the parsed config.json \(a dict\), got str"):
    checkpoints.config_from_hf("config.json")
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
  with pytest.raises(TypeError, match=r"params_from_hf: config must be a MoEConfig \(a config.json dict goes "
                                      r"through config_from_hf first\), got dict"):
    checkpoints.params_from_hf(tensors, HF_CONFIGS["qwen3_moe"], model_type="qwen3_moe", prefix="model.layers.2.mlp.")
  with pytest.raises(ValueError, match=r"prefix must be '' or a module name ending in '.'"):
    checkpoints.params_from_hf(tensors, config, model_type="qwen3_moe", prefix="model.layers.2.mlp")


def test_shared_expert_gate_needs_shared_experts():
  with pytest.raises(ValueError, match=r"shared_expert_gate=True needs num_shared_experts > 0, got 0"):
    moe.MoEConfig(num_experts=8, top_k=2, hidden=64, ffn=32, shared_expert_gate=True)


# ----------------------------------------------------------------------------------------------------------------
# Tensors: dtypes, FP8, and tensors the config does not describe
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type,extra,why", [
    ("qwen3_moe", "experts.16.gate_proj.weight", r"the config has num_experts=16 \(experts 0..15\)"),
    ("qwen3_moe", "shared_expert.up_proj.weight", r"the config has no shared experts"),
    ("olmoe", "gate.e_score_correction_bias", r"the config's router_kind 'softmax' has no correction bias"),
    ("mixtral", "experts.0.w1.weight_scale_inv", r"a block scale of a weight that is not float8_e4m3fn"),
    ("deepseek_v3", "experts.3.gate_proj.bias", r"not a tensor of a deepseek_v3 MoE layer"),
])
def test_tensors_the_config_does_not_describe_are_refused(model_type, extra, why):
  p = PREFIX[model_type]
  tensors = _tensors(model_type, np.random.default_rng(1))
  config = checkpoints.config_from_hf(HF_CONFIGS[model_type])
  other_layer = {k.replace(".2.", ".3.", 1): v for k, v in tensors.items()}  # another layer's tensors: ignored
  checkpoints.params_from_hf({**tensors, **other_layer}, config, model_type=model_type, prefix=p)
  with pytest.raises(ValueError, match=rf"tensors under '{p}' that the config does not describe: "
                                       rf"'{p}{extra}' \({why}"):
    checkpoints.params_from_hf({**tensors, p + extra: np.zeros((1,), np.float32)}, config, model_type=model_type,
                               prefix=p)


def test_shared_tensors_without_shared_experts_in_the_config_are_refused():
  c = {**HF_CONFIGS["deepseek_v3"], "n_shared_experts": 0}
  with pytest.raises(ValueError, match=r"'model.layers.2.mlp.shared_experts.down_proj.weight' \(the config has no "
                                       r"shared experts"):
    checkpoints.params_from_hf(_tensors("deepseek_v3", np.random.default_rng(2)), checkpoints.config_from_hf(c),
                               model_type="deepseek_v3", prefix=PREFIX["deepseek_v3"])


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.bool_, np.complex64, np.int32, ml_dtypes.float8_e5m2])
def test_tensors_that_are_not_float_weights_are_refused(dtype):
  p = PREFIX["qwen3_moe"]
  tensors = _tensors("qwen3_moe", np.random.default_rng(3))
  key = p + "experts.5.down_proj.weight"
  tensors[key] = np.ones((H, F), dtype)
  with pytest.raises(ValueError, match=rf"'{key}' must be a float weight .*, got {np.dtype(dtype).name}"):
    checkpoints.params_from_hf(tensors, checkpoints.config_from_hf(HF_CONFIGS["qwen3_moe"]), model_type="qwen3_moe",
                               prefix=p)


@pytest.mark.parametrize("model_type", SIGMOID_ROUTERS)
def test_a_router_transformers_keeps_in_float32_is_not_rounded_to_a_narrower_param_dtype(model_type):
  p = PREFIX[model_type]
  tensors = _tensors(model_type, np.random.default_rng(5))
  config = checkpoints.config_from_hf(HF_CONFIGS[model_type], param_dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match=re.escape(
      f"transformers keeps the {model_type} router '{p}gate.weight' in float32; stored as float32, it would be rounded "
      f"to param_dtype bfloat16 and route tokens otherwise: load with param_dtype float32, or from a checkpoint that "
      f"stores it as bfloat16")):
    checkpoints.params_from_hf(tensors, config, model_type=model_type, prefix=p)
  tensors[p + "gate.weight"] = tensors[p + "gate.weight"].astype(ml_dtypes.bfloat16)  # held exactly: taken
  params = checkpoints.params_from_hf(tensors, config, model_type=model_type, prefix=p)
  np.testing.assert_array_equal(params["router"], tensors[p + "gate.weight"].T)
  config = checkpoints.config_from_hf(HF_CONFIGS[model_type], param_dtype=jnp.float32)
  tensors[p + "gate.weight"] = tensors[p + "gate.weight"].astype(np.float64)  # float32, as transformers holds it
  params = checkpoints.params_from_hf(tensors, config, model_type=model_type, prefix=p)
  np.testing.assert_array_equal(params["router"], tensors[p + "gate.weight"].T.astype(np.float32))


def test_float_tensors_are_cast_once():
  p = PREFIX["olmoe"]
  tensors = _tensors("olmoe", np.random.default_rng(4))
  exact = {p + "experts.1.gate_proj.weight": np.float16, p + "experts.2.up_proj.weight": ml_dtypes.bfloat16,
           p + "gate.weight": np.float64}
  for key, dtype in exact.items():
    tensors[key] = tensors[key].astype(dtype)
  # 1 + 2^-8 + 2^-30: bfloat16 of it is 1 + 2^-7; through float32 first it would round twice, to 1.
  tensors[p + "experts.3.down_proj.weight"] = np.full((H, F), 1 + 2**-8 + 2**-30, np.float64)
  for param_dtype in (jnp.float32, jnp.bfloat16):
    config = checkpoints.config_from_hf(HF_CONFIGS["olmoe"], param_dtype=param_dtype)
    params = checkpoints.params_from_hf(tensors, config, model_type="olmoe", prefix=p)
    pd = np.dtype(param_dtype)
    np.testing.assert_array_equal(params["router"], tensors[p + "gate.weight"].T.astype(pd))
    np.testing.assert_array_equal(params["w_gate_up"][1, :F], tensors[p + "experts.1.gate_proj.weight"].astype(pd))
    np.testing.assert_array_equal(params["w_gate_up"][2, F:], tensors[p + "experts.2.up_proj.weight"].astype(pd))
  assert np.all(params["w_down"][3] == np.float32(1 + 2**-7))


def _fp8_block(w):
  """DeepSeek's weight format: codes e4m3(w / s), s = amax / 448 per 128x128 block (not a power of two)."""
  n, k = w.shape
  nb, kb = -(-n // 128), -(-k // 128)
  pad = np.zeros((nb * 128, kb * 128), np.float32)
  pad[:n, :k] = w
  blocks = pad.reshape(nb, 128, kb, 128)
  s = (np.abs(blocks).max(axis=(1, 3)) / 448).astype(np.float32)
  s = np.where(s == 0, np.float32(1), s)
  q = (blocks / s[:, None, :, None]).reshape(nb * 128, kb * 128)[:n, :k].astype(ml_dtypes.float8_e4m3fn)
  return q, s


def _dequant(q, s):
  n, k = q.shape
  return q.astype(np.float32) * np.repeat(np.repeat(s, 128, 0), 128, 1)[:n, :k]


H8, F8, E8 = 256, 128, 8
FP8_CONFIG = {"model_type": "deepseek_v3", "hidden_size": H8, "moe_intermediate_size": F8, "n_routed_experts": E8,
              "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1,
              "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                      "activation_scheme": "dynamic"}}


def _fp8_tensors(rng, prefix="model.layers.2.mlp.", f=F8):
  """A DeepSeek-V3 FP8 layer: every expert and shared-expert weight FP8 with its scales, the router bf16."""
  t = _tensors("deepseek_v3", rng, prefix=prefix, h=H8, f=f, e=E8, shared=("shared_experts", f))
  out = {}
  for k, v in t.items():
    if ("experts." in k) and k.endswith(".weight"):
      out[k], out[k + "_scale_inv"] = _fp8_block(v * rng.uniform(0.5, 8))
    elif k.endswith("gate.weight"):
      out[k] = v.astype(ml_dtypes.bfloat16)
    else:
      out[k] = v
  return out


def test_an_fp8_checkpoint_keeps_its_bits_in_an_fp8_config_and_dequantizes_in_another():
  p = "model.layers.2.mlp."
  t = _fp8_tensors(np.random.default_rng(5))
  fp8 = checkpoints.params_from_hf(t, checkpoints.config_from_hf(FP8_CONFIG, fp8_weights=True),
                                   model_type="deepseek_v3", prefix=p)
  f32 = checkpoints.params_from_hf(t, checkpoints.config_from_hf(FP8_CONFIG), model_type="deepseek_v3", prefix=p)
  bits = lambda a: np.asarray(a).view(np.uint8)
  for e in range(E8):
    g, u, d = (p + f"experts.{e}.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj"))
    np.testing.assert_array_equal(bits(fp8["w_gate_up"][e]), bits(np.concatenate([t[g], t[u]])))
    np.testing.assert_array_equal(fp8["w_gate_up_sf"][e], np.concatenate([t[g + "_scale_inv"], t[u + "_scale_inv"]]))
    np.testing.assert_array_equal(bits(fp8["w_down"][e]), bits(t[d]))
    np.testing.assert_array_equal(fp8["w_down_sf"][e], t[d + "_scale_inv"])
    np.testing.assert_array_equal(f32["w_gate_up"][e], np.concatenate([_dequant(t[g], t[g + "_scale_inv"]),
                                                                       _dequant(t[u], t[u + "_scale_inv"])]))
    np.testing.assert_array_equal(f32["w_down"][e], _dequant(t[d], t[d + "_scale_inv"]))
  m = p + "shared_experts.down_proj.weight"
  for params in (fp8, f32):  # the shared expert is dequantized in both
    np.testing.assert_array_equal(params["shared_w_down"][0], _dequant(t[m], t[m + "_scale_inv"]))
    np.testing.assert_array_equal(params["router"], t[p + "gate.weight"].astype(np.float32).T)


def test_an_fp8_checkpoint_runs_as_its_dequantized_weights():
  mesh = Mesh(np.array(devices(8)).reshape(2, 4), ("data", "expert"))
  p = "model.layers.2.mlp."
  rng = np.random.default_rng(6)
  t = _fp8_tensors(rng)
  dequantized = {k: _dequant(v, t[k + "_scale_inv"]) if v.dtype == ml_dtypes.float8_e4m3fn else v
                 for k, v in t.items() if not k.endswith("_scale_inv")}
  x = np.asarray(jnp.asarray(rng.standard_normal((64, H8)), jnp.bfloat16), np.float32)
  c = {**FP8_CONFIG, "norm_topk_prob": True, "routed_scaling_factor": 2.5}
  want = _hf_forward("deepseek_v3", dequantized, x, c=c, p=p)
  # Max error over max |output|: float32 experts on the dequantized weights, the stored FP8 weights, and the FP8
  # GEMMs (activations rounded to E4M3 too).
  for overrides, tol in (({}, 2e-5), ({"fp8_weights": True}, 2e-5),
                         ({"fp8_weights": True, "expert_precision": "fp8"}, 6e-2)):
    config = checkpoints.config_from_hf(FP8_CONFIG, dtype=jnp.float32, **overrides)
    params = checkpoints.params_from_hf(t, config, model_type="deepseek_v3", prefix=p)
    specs = moe.param_specs(config)
    params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
    y, _ = jax.jit(lambda p, x, config=config: moe.moe_apply(p, x, config, mesh))(
        params, jax.device_put(x, NamedSharding(mesh, P(("data", "expert")))))
    err = np.abs(np.asarray(y, np.float64) - want).max() / np.abs(want).max()
    assert err <= tol, (overrides, err)


def test_fp8_tensors_without_their_scales_or_with_wrong_ones_are_refused():
  p = "model.layers.2.mlp."
  config = checkpoints.config_from_hf(FP8_CONFIG, fp8_weights=True)
  t = _fp8_tensors(np.random.default_rng(7))
  key = p + "experts.4.up_proj.weight"
  no_scale = {k: v for k, v in t.items() if k != key + "_scale_inv"}
  with pytest.raises(ValueError, match=rf"'{key}' is float8_e4m3fn, so the checkpoint must have its block scales "
                                       rf"'{key}_scale_inv'"):
    checkpoints.params_from_hf(no_scale, config, model_type="deepseek_v3", prefix=p)
  with pytest.raises(ValueError, match=rf"'{key}_scale_inv' must be \[ceil\(128/128\), ceil\(256/128\)\] = \(1, 2\) "
                                       rf"of float32 .*got \(2, 2\) of float32"):
    checkpoints.params_from_hf({**t, key + "_scale_inv": np.ones((2, 2), np.float32)}, config,
                               model_type="deepseek_v3", prefix=p)
  with pytest.raises(ValueError, match=r"got \(1, 2\) of int32"):
    checkpoints.params_from_hf({**t, key + "_scale_inv": np.ones((1, 2), np.int32)}, config,
                               model_type="deepseek_v3", prefix=p)
  with pytest.raises(ValueError, match=rf"'{key}_scale_inv' must hold finite scales"):
    checkpoints.params_from_hf({**t, key + "_scale_inv": np.full((1, 2), np.nan, np.float32)}, config,
                               model_type="deepseek_v3", prefix=p)
  mixed = {**t, key: _dequant(t[key], t[key + "_scale_inv"])}
  del mixed[key + "_scale_inv"]
  with pytest.raises(ValueError, match=r"expert 4's gate_proj and up_proj must both be float8_e4m3fn or both float"):
    checkpoints.params_from_hf(mixed, config, model_type="deepseek_v3", prefix=p)


def test_fp8_experts_whose_blocks_do_not_stack_are_refused_in_an_fp8_config():
  p = "model.layers.2.mlp."
  t = _fp8_tensors(np.random.default_rng(8), f=192)
  c = {**FP8_CONFIG, "moe_intermediate_size": 192}
  with pytest.raises(ValueError, match=r"config.fp8_weights takes FP8 experts as they are, which needs ffn % 128 == 0"):
    checkpoints.params_from_hf(t, checkpoints.config_from_hf(c, fp8_weights=True), model_type="deepseek_v3", prefix=p)
  params = checkpoints.params_from_hf(t, checkpoints.config_from_hf(c), model_type="deepseek_v3", prefix=p)
  g = p + "experts.0.gate_proj.weight"
  np.testing.assert_array_equal(params["w_gate_up"][0, :192], _dequant(t[g], t[g + "_scale_inv"]))


def test_float_experts_into_an_fp8_config_are_quantized_as_the_layer_quantizes():
  p = "model.layers.2.mlp."
  t = _tensors("deepseek_v3", np.random.default_rng(9), prefix=p, h=H8, f=F8, e=E8, shared=("shared_experts", F8))
  config = checkpoints.config_from_hf(FP8_CONFIG, fp8_weights=True)
  params = checkpoints.params_from_hf(t, config, model_type="deepseek_v3", prefix=p)
  gu = np.stack([np.concatenate([t[p + f"experts.{e}.gate_proj.weight"], t[p + f"experts.{e}.up_proj.weight"]])
                 for e in range(E8)])
  q, s = quant.quantize_fp8_weight(jnp.asarray(gu), impl="reference")
  np.testing.assert_array_equal(params["w_gate_up"].view(np.uint8), np.asarray(q).view(np.uint8))
  np.testing.assert_array_equal(params["w_gate_up_sf"], s)


# ----------------------------------------------------------------------------------------------------------------
# A checkpoint directory
# ----------------------------------------------------------------------------------------------------------------


def _write_checkpoint(path, hf, tensors, shards=1):
  """config.json and the tensors as transformers writes them: safetensors files, an index when sharded."""
  save_file = pytest.importorskip("safetensors.numpy").save_file
  path.mkdir()
  (path / "config.json").write_text(json.dumps(hf))
  names = sorted(tensors)
  if shards == 1:
    save_file(tensors, str(path / "model.safetensors"))
    return
  weight_map = {}
  for i in range(shards):
    file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
    part = names[i::shards]  # each layer's tensors spread over every file
    save_file({k: tensors[k] for k in part}, str(path / file))
    weight_map.update({k: file for k in part})
  (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _mesh():
  return Mesh(np.array(devices(8)).reshape(2, 4), ("data", "expert"))


def test_a_layer_loads_from_a_sharded_fp8_checkpoint_bit_for_bit(tmp_path):
  rng = np.random.default_rng(10)
  hf = {**FP8_CONFIG, "num_hidden_layers": 3, "first_k_dense_replace": 1}
  tensors = {"model.layers.0.mlp.gate_proj.weight": np.ones((64, H8), ml_dtypes.bfloat16),
             "model.embed_tokens.weight": np.ones((10, H8), ml_dtypes.bfloat16)}
  for layer in (1, 2):
    tensors.update(_fp8_tensors(rng, prefix=f"model.layers.{layer}.mlp."))
  _write_checkpoint(tmp_path / "ckpt", hf, tensors, shards=3)
  mesh = _mesh()
  for overrides in ({"fp8_weights": True}, {"param_dtype": jnp.bfloat16}):
    config, params = checkpoints.load_hf_layer(str(tmp_path / "ckpt"), 2, mesh, **overrides)
    assert config == checkpoints.config_from_hf(hf, **overrides)
    want = checkpoints.params_from_hf(tensors, config, model_type="deepseek_v3", prefix="model.layers.2.mlp.")
    specs = moe.param_specs(config)
    assert sorted(params) == sorted(want)
    for name, value in params.items():
      assert value.sharding == NamedSharding(mesh, specs[name]), name
      assert value.dtype == want[name].dtype, name
      np.testing.assert_array_equal(np.asarray(value).view(np.uint8), want[name].view(np.uint8), err_msg=name)
  y, _ = jax.jit(lambda p, x: moe.moe_apply(p, x, config, mesh))(params, jnp.ones((64, H8), jnp.bfloat16))
  assert np.all(np.isfinite(np.asarray(y, np.float32)))
  with pytest.raises(ValueError, match=r"layer 0 of this deepseek_v3 model is dense, not a MoE layer: its layers "
                                       r"below 'first_k_dense_replace' \(1\) are dense"):
    checkpoints.load_hf_layer(str(tmp_path / "ckpt"), 0, mesh)
  with pytest.raises(ValueError, match=r"the checkpoint has no tensors under 'model.layers.7.mlp.' \(layer 7; the "
                                       r"model has 3 layers\)"):
    checkpoints.load_hf_layer(str(tmp_path / "ckpt"), 7, mesh)


def test_a_mixtral_layer_loads_under_either_module_name(tmp_path):
  rng = np.random.default_rng(11)
  hf = {**HF_CONFIGS["mixtral"], "num_hidden_layers": 4}
  for module in ("block_sparse_moe", "mlp"):
    prefix = f"model.layers.3.{module}."
    tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in _tensors("mixtral", rng, prefix=prefix).items()}
    _write_checkpoint(tmp_path / module, hf, tensors)
    config, params = checkpoints.load_hf_layer(str(tmp_path / module), 3, _mesh(), param_dtype=jnp.bfloat16)
    want = checkpoints.params_from_hf(tensors, config, model_type="mixtral", prefix=prefix)
    for name in want:
      np.testing.assert_array_equal(np.asarray(params[name]), want[name])


def test_a_qwen_layer_that_is_dense_is_refused(tmp_path):
  hf = {**HF_CONFIGS["qwen3_moe"], "mlp_only_layers": [1], "decoder_sparse_step": 2}
  _write_checkpoint(tmp_path / "q", hf, _tensors("qwen3_moe", np.random.default_rng(12), prefix="model.layers.3.mlp."))
  with pytest.raises(ValueError, match=r"'mlp_only_layers' \(\[1\]\) lists it"):
    checkpoints.load_hf_layer(str(tmp_path / "q"), 1, _mesh())
  with pytest.raises(ValueError, match=r"only layers i with \(i \+ 1\) % 'decoder_sparse_step' \(2\) == 0"):
    checkpoints.load_hf_layer(str(tmp_path / "q"), 2, _mesh())
  assert checkpoints.load_hf_layer(str(tmp_path / "q"), 3, _mesh())[0].num_experts == E


def test_a_device_s_part_reads_only_its_experts(tmp_path):
  """make_array_from_callback asks for each device's part: the routed experts' tensors outside it are not read."""
  p = "model.layers.2.mlp."
  tensors = _fp8_tensors(np.random.default_rng(13))
  read = []

  class Recording(dict):
    def __getitem__(self, key):
      read.append(key)
      return dict.__getitem__(self, key)

  config = checkpoints.config_from_hf(FP8_CONFIG, fp8_weights=True)
  layer = checkpoints._Layer(Recording(tensors), config, "deepseek_v3", p, "test")  # pylint: disable=protected-access
  read.clear()
  part = layer.value("w_gate_up", (slice(2, 4), slice(None), slice(None)))
  assert part.shape == (2, 2 * F8, H8)
  assert {k.split(".")[5] for k in read if ".experts." in k} == {"2", "3"}


def test_load_hf_layer_refuses_what_is_not_a_checkpoint(tmp_path):
  with pytest.raises(ValueError, match=r"model_dir must hold config.json"):
    checkpoints.load_hf_layer(str(tmp_path), 1, _mesh())
  (tmp_path / "config.json").write_text(json.dumps(HF_CONFIGS["olmoe"]))
  with pytest.raises(ValueError, match=r"must hold model.safetensors.index.json or model.safetensors, it has neither"):
    checkpoints.load_hf_layer(str(tmp_path), 1, _mesh())
  with pytest.raises(ValueError, match=r"layer must be an int >= 0, got -1"):
    checkpoints.load_hf_layer(str(tmp_path), -1, _mesh())
