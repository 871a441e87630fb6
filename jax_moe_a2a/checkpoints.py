"""MoE layers of Hugging Face checkpoints as this package's layer: config and parameters, over plain arrays.

`config_from_hf` reads a model's ``config.json`` (a dict) into a `moe.MoEConfig`; `params_from_hf` maps the
tensors of one MoE layer (a mapping of name -> array, e.g. from ``safetensors.numpy.load_file``) to the parameter
dict of `moe.init_params`. Nothing here imports torch or transformers.

Supported ``model_type`` values and their layer tensors, under the layer's module prefix (``model.layers.{i}.mlp.``,
or ``model.layers.{i}.block_sparse_moe.`` for Mixtral); every linear weight is ``[out_features, in_features]``:

=============  ==================================================================================================
``mixtral``    ``gate.weight`` [E, H]; ``experts.{e}.w1`` (gate) / ``w3`` (up) [F, H], ``w2`` (down) [H, F]
``qwen3_moe``  ``gate.weight``; ``experts.{e}.gate_proj`` / ``up_proj`` [F, H], ``down_proj`` [H, F]
``qwen2_moe``  as qwen3_moe, plus ``shared_expert.{gate,up,down}_proj`` and ``shared_expert_gate.weight`` [1, H]
``deepseek_v3`` as qwen3_moe, plus ``gate.e_score_correction_bias`` [E] and ``shared_experts.{gate,up,down}_proj``
=============  ==================================================================================================

The mapping: ``router`` = ``gate.weight``ᵀ [H, E]; ``w_gate_up[e]`` = [gate_proj; up_proj] stacked on the rows
(gate rows first) [2F, H]; ``w_down[e]`` = ``down_proj`` [H, F]; ``router_bias`` = the correction bias (float32);
shared experts likewise, as one shared expert of the checkpoint's width (DeepSeek-V3's ``n_shared_experts``
experts are one MLP of ``n_shared_experts * moe_intermediate_size`` columns there); ``shared_gate`` =
``shared_expert_gate.weight[0]``.

The routers: Mixtral, Qwen2-MoE and Qwen3-MoE take the softmax over all experts, then the top k, renormalized
when ``norm_topk_prob`` (always for Mixtral; Qwen2-MoE's default is False, Qwen3-MoE's True); DeepSeek-V3 is
``router_kind="deepseek_v3"`` with its n_group, topk_group, norm_topk_prob and routed_scaling_factor.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from jax_moe_a2a import moe, routing

MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")


def _get(hf: Mapping[str, Any], key: str, model_type: str):
  if key not in hf:
    raise ValueError(f"config_from_hf: a {model_type} config needs {key!r}, got keys {sorted(hf)}")
  return hf[key]


def config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> moe.MoEConfig:
  """The `moe.MoEConfig` of the MoE layers of the model whose ``config.json`` is `hf`.

  Args:
    hf: the parsed ``config.json``; its ``model_type`` must be one of `MODEL_TYPES`.
    **overrides: other `moe.MoEConfig` fields (mesh axes, wire format, dtypes, ...), or ones to replace.

  Raises:
    ValueError: an unknown model_type, or a key the model type needs is missing.
  """
  model_type = hf.get("model_type")
  if model_type not in MODEL_TYPES:
    raise ValueError(f"config_from_hf: model_type must be one of {', '.join(MODEL_TYPES)}, got {model_type!r}")
  get = lambda key: _get(hf, key, model_type)
  kw: dict[str, Any] = {"hidden": int(get("hidden_size")), "top_k": int(get("num_experts_per_tok"))}
  if model_type == "mixtral":
    kw.update(num_experts=int(get("num_local_experts")), ffn=int(get("intermediate_size")), renormalize=True)
  elif model_type in ("qwen2_moe", "qwen3_moe"):
    kw.update(num_experts=int(get("num_experts")), ffn=int(get("moe_intermediate_size")),
              renormalize=bool(hf.get("norm_topk_prob", model_type == "qwen3_moe")))
    if model_type == "qwen2_moe" and int(hf.get("shared_expert_intermediate_size", 0)) > 0:
      kw.update(num_shared_experts=1, shared_ffn=int(get("shared_expert_intermediate_size")), shared_expert_gate=True)
  else:
    ffn = int(get("moe_intermediate_size"))
    kw.update(num_experts=int(get("n_routed_experts")), ffn=ffn, router_kind=routing.DEEPSEEK_V3,
              n_group=int(hf.get("n_group", 1)), topk_group=int(hf.get("topk_group", 1)),
              renormalize=bool(hf.get("norm_topk_prob", True)),
              routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)))
    shared = int(hf.get("n_shared_experts", 0) or 0)
    if shared:
      kw.update(num_shared_experts=1, shared_ffn=shared * ffn)
  kw.update(overrides)
  return moe.MoEConfig(**kw)


def _expert_names(model_type: str) -> tuple[str, str, str]:
  return ("w1", "w3", "w2") if model_type == "mixtral" else ("gate_proj", "up_proj", "down_proj")


def params_from_hf(tensors: Mapping[str, Any], config: moe.MoEConfig, *, model_type: str,
                   prefix: str = "") -> dict[str, np.ndarray]:
  """The parameters (`moe.init_params`' keys) of one MoE layer from its checkpoint tensors.

  Args:
    tensors: name -> array (NumPy or anything `np.asarray` takes), holding at least the layer's tensors.
    config: the layer (e.g. from `config_from_hf`); its param_dtype is the dtype of the float parameters.
    model_type: one of `MODEL_TYPES`.
    prefix: the MoE module's name prefix, e.g. ``"model.layers.3.mlp."``.

  Returns:
    NumPy arrays of `moe.param_shapes(config)`'s shapes and dtypes; put them on the mesh with
    `moe.param_specs(config)`.

  Raises:
    ValueError: an unknown model type, a missing tensor (named), or a tensor of another shape than the config's.
  """
  if model_type not in MODEL_TYPES:
    raise ValueError(f"params_from_hf: model_type must be one of {', '.join(MODEL_TYPES)}, got {model_type!r}")
  if config.fp8_weights:
    raise ValueError("params_from_hf: config.fp8_weights must be False (quantize the mapped weights with "
                     "experts.ExpertWeights.quantize), got True")
  shapes = moe.param_shapes(config)

  def take(name: str, shape: tuple[int, ...]) -> np.ndarray:
    key = prefix + name
    if key not in tensors:
      raise ValueError(f"params_from_hf: the {model_type} layer needs the tensor {key!r}, which is not in tensors")
    a = np.asarray(tensors[key], np.float32)
    if a.shape != shape:
      raise ValueError(f"params_from_hf: {key!r} must have shape {shape} for this config, got {a.shape}")
    return a

  h, e, f = config.hidden, config.num_experts, config.ffn
  gate, up, down = _expert_names(model_type)
  out = {"router": take("gate.weight", (e, h)).T}
  if model_type == "deepseek_v3":
    out["router_bias"] = take("gate.e_score_correction_bias", (e,))
  out["w_gate_up"] = np.stack([np.concatenate([take(f"experts.{i}.{gate}.weight", (f, h)),
                                               take(f"experts.{i}.{up}.weight", (f, h))]) for i in range(e)])
  out["w_down"] = np.stack([take(f"experts.{i}.{down}.weight", (h, f)) for i in range(e)])
  if config.num_shared_experts:
    if config.num_shared_experts != 1:
      raise ValueError(f"params_from_hf: checkpoints hold one shared MLP, so config.num_shared_experts must be 1, "
                       f"got {config.num_shared_experts}")
    module = {"qwen2_moe": "shared_expert", "deepseek_v3": "shared_experts"}.get(model_type)
    if module is None:
      raise ValueError(f"params_from_hf: a {model_type} layer has no shared experts, but the config has "
                       f"{config.num_shared_experts}")
    fs = config.shared_width
    out["shared_w_gate_up"] = np.concatenate([take(f"{module}.gate_proj.weight", (fs, h)),
                                              take(f"{module}.up_proj.weight", (fs, h))])[None]
    out["shared_w_down"] = take(f"{module}.down_proj.weight", (h, fs))[None]
  if config.shared_expert_gate:
    out["shared_gate"] = take("shared_expert_gate.weight", (1, h))[0]
  return {k: v.astype(shapes[k].dtype) for k, v in out.items()}
