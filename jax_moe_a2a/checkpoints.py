"""MoE layers of Hugging Face checkpoints as this package's layer: config, parameters, and loading from disk.

`config_from_hf` reads a model's ``config.json`` (a dict) into a `moe.MoEConfig` as transformers' config class of
that model type reads it; `params_from_hf` maps the tensors of one MoE layer (name -> array) to the parameter dict
of `moe.init_params`; `load_hf_layer` does both for one layer of a checkpoint directory, reading only that layer's
tensors and placing them on a mesh. Nothing here imports torch or transformers.

Supported ``model_type`` values and their layer tensors, under the layer's module prefix (`layer_prefix`:
``model.layers.{i}.mlp.``, or ``model.layers.{i}.block_sparse_moe.`` for Mixtral); every linear weight is
``[out_features, in_features]``:

===============  ================================================================================================
``mixtral``      ``gate.weight`` [E, H]; ``experts.{e}.w1`` (gate) / ``w3`` (up) [F, H], ``w2`` (down) [H, F]
``qwen3_moe``    ``gate.weight``; ``experts.{e}.gate_proj`` / ``up_proj`` [F, H], ``down_proj`` [H, F]
``olmoe``        as qwen3_moe
``qwen2_moe``    as qwen3_moe, plus ``shared_expert.{gate,up,down}_proj`` and ``shared_expert_gate.weight`` [1, H]
``deepseek_v3``  as qwen3_moe, plus ``gate.e_score_correction_bias`` [E] and ``shared_experts.{gate,up,down}_proj``
``glm4_moe``     as deepseek_v3
===============  ================================================================================================

The mapping: ``router`` = ``gate.weight``ᵀ [H, E]; ``w_gate_up[e]`` = [gate_proj; up_proj] stacked on the rows
(gate rows first) [2F, H]; ``w_down[e]`` = ``down_proj`` [H, F]; ``router_bias`` = the correction bias (float32);
shared experts likewise, as one shared expert of the checkpoint's width (DeepSeek-V3's ``n_shared_experts``
experts are one MLP of ``n_shared_experts * moe_intermediate_size`` columns there); ``shared_gate`` =
``shared_expert_gate.weight[0]``.

FP8 checkpoints (DeepSeek-V3/R1 and models of their format): a weight stored as float8_e4m3fn comes with
``<name>.weight_scale_inv``, one scale per 128x128 block, ``[ceil(out/128), ceil(in/128)]``, the value being
``code * scale`` (the scale multiplies, despite its name). Into a config with ``fp8_weights`` the routed experts'
codes and scales are taken as they are (the layer's own FP8 weight format); into any other config, and for every
other weight, they are dequantized in float32 (as DeepSeek's ``weight_dequant`` does) and cast to param_dtype.

The routers (transformers `TRANSFORMERS_VERSION`'s modeling code): Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE take the
softmax over all experts in float32, then the top k, renormalized when ``norm_topk_prob`` (always for Mixtral);
DeepSeek-V3 and GLM-4.5 (``glm4_moe``) are ``router_kind="deepseek_v3"``: sigmoid scores plus the correction bias,
the best ``topk_group`` of ``n_group`` groups by their top-2 sums, the top k among them (the others masked with
-inf), the weights renormalized when ``norm_topk_prob`` and scaled by ``routed_scaling_factor``.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any, Mapping, Optional

import ml_dtypes
import numpy as np

from jax_moe_a2a import moe, quant, routing

# The transformers release whose config classes and modeling code this module follows.
TRANSFORMERS_VERSION = "5.25.0"

MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "glm4_moe", "olmoe")

# What an absent key means: the defaults of transformers' config classes (configuration_<model_type>.py of
# TRANSFORMERS_VERSION) for the keys read here. `save_pretrained` may leave out a key whose value is the default.
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "mixtral": {"hidden_size": 4096, "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2,
                "hidden_act": "silu", "router_jitter_noise": 0.0, "num_hidden_layers": 32},
    "qwen2_moe": {"hidden_size": 2048, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
                  "num_experts": 60, "num_experts_per_tok": 4, "norm_topk_prob": False, "hidden_act": "silu",
                  "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 24},
    "qwen3_moe": {"hidden_size": 2048, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                  "norm_topk_prob": False, "hidden_act": "silu", "decoder_sparse_step": 1, "mlp_only_layers": [],
                  "num_hidden_layers": 24},
    "deepseek_v3": {"hidden_size": 7168, "moe_intermediate_size": 2048, "n_routed_experts": 256,
                    "num_experts_per_tok": 8, "n_shared_experts": 1, "n_group": 8, "topk_group": 4,
                    "norm_topk_prob": True, "routed_scaling_factor": 2.5, "hidden_act": "silu",
                    "first_k_dense_replace": 3, "num_hidden_layers": 61},
    "glm4_moe": {"hidden_size": 4096, "moe_intermediate_size": 1408, "n_routed_experts": 128, "num_experts_per_tok": 8,
                 "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
                 "routed_scaling_factor": 1.0, "hidden_act": "silu", "first_k_dense_replace": 1,
                 "num_hidden_layers": 46},
    "olmoe": {"hidden_size": 2048, "intermediate_size": 2048, "num_experts": 64, "num_experts_per_tok": 8,
              "norm_topk_prob": False, "hidden_act": "silu", "num_hidden_layers": 16},
}
# Other names of a key (the config classes' attribute_map): alias -> the key read here. Qwen3-MoE's class writes
# its expert count as num_local_experts.
HF_ALIASES: dict[str, dict[str, str]] = {
    "mixtral": {"num_experts": "num_local_experts"},
    "qwen3_moe": {"num_local_experts": "num_experts"},
    "deepseek_v3": {"num_local_experts": "n_routed_experts"},
    "glm4_moe": {"num_local_experts": "n_routed_experts"},
    "olmoe": {"num_local_experts": "num_experts"},
}
# Keys of DeepSeek's own modeling code (not fields of transformers' classes, which always route as below): when a
# config has them, they must name the router the layer runs.
_ROUTER_FIELDS = {"scoring_func": ("sigmoid",), "topk_method": ("noaux_tc",)}
# The one FP8 checkpoint format read here (DeepSeek-V3's quantization_config).
_FP8_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [quant.FP8_BLOCK, quant.FP8_BLOCK],
                     "activation_scheme": "dynamic"}


# ----------------------------------------------------------------------------------------------------------------
# config.json
# ----------------------------------------------------------------------------------------------------------------


class _Keys:
  """Reads the keys of one config.json as its transformers class does: aliases, defaults, strict types."""

  def __init__(self, hf: Mapping[str, Any], model_type: str, op: str):
    self.hf, self.model_type, self.op = hf, model_type, op

  def raw(self, key: str) -> Any:
    names = [key] + [a for a, k in HF_ALIASES.get(self.model_type, {}).items() if k == key]
    given = [(n, self.hf[n]) for n in names if n in self.hf]
    if len(given) > 1 and any(v != given[0][1] for _, v in given[1:]):
      raise ValueError(f"{self.op}: {' and '.join(repr(n) for n, _ in given)} name one setting of a {self.model_type} "
                       f"config and must agree, got {', '.join(repr(v) for _, v in given)}")
    return given[0][1] if given else HF_DEFAULTS[self.model_type][key]

  def int(self, key: str, minimum: int = 1) -> int:
    v = self.raw(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
      raise ValueError(f"{self.op}: {key!r} must be an int >= {minimum}, got {v!r}")
    return v

  def bool(self, key: str) -> bool:
    v = self.raw(key)
    if not isinstance(v, bool):
      raise ValueError(f"{self.op}: {key!r} must be true or false, got {v!r}")
    return v

  def positive_float(self, key: str) -> float:
    v = self.raw(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
      raise ValueError(f"{self.op}: {key!r} must be a finite number > 0, got {v!r}")
    return float(v)

  def one_of(self, key: str, allowed: tuple[Any, ...], why: str) -> None:
    v = self.raw(key)
    if v not in allowed:
      raise ValueError(f"{self.op}: {key!r} must be {' or '.join(repr(a) for a in allowed)} ({why}), got {v!r}")


def _model_type(op: str, hf: Any) -> str:
  if not isinstance(hf, Mapping):
    raise TypeError(f"{op}: hf must be the parsed config.json (a dict), got {type(hf).__name__}")
  model_type = hf.get("model_type")
  if model_type not in MODEL_TYPES:
    raise ValueError(f"{op}: model_type must be one of {', '.join(MODEL_TYPES)}, got {model_type!r}")
  return model_type


def _check_quantization(op: str, hf: Mapping[str, Any]) -> None:
  q = hf.get("quantization_config")
  if q is None:
    return
  if not isinstance(q, Mapping):
    raise ValueError(f"{op}: 'quantization_config' must be a dict, got {q!r}")
  for key, want in _FP8_QUANTIZATION.items():
    if q.get(key, want) != want:
      raise ValueError(f"{op}: quantization_config[{key!r}] must be {want!r} (FP8 E4M3 weights with one scale per "
                       f"128x128 block, the format read here), got {q.get(key)!r}")


def config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> moe.MoEConfig:
  """The `moe.MoEConfig` of the MoE layers of the model whose ``config.json`` is `hf`.

  Every key is read as transformers' config class of the model type reads it (`TRANSFORMERS_VERSION`): an absent
  key takes the class's default (`HF_DEFAULTS`), an alias (`HF_ALIASES`) names the same key, integers must be
  integers (a bool or a float is refused), sizes positive. Settings the layer does not run are refused, naming the
  key: an activation other than SiLU, router jitter, a DeepSeek ``scoring_func``/``topk_method`` other than
  sigmoid/noaux_tc, a quantization other than 128x128-block FP8.

  Args:
    hf: the parsed ``config.json``; its ``model_type`` must be one of `MODEL_TYPES`.
    **overrides: other `moe.MoEConfig` fields (mesh axes, wire format, dtypes, fp8_weights, ...), or ones to
      replace.

  Raises:
    TypeError: `hf` is not a dict.
    ValueError: an unknown model_type, or a key of the wrong type, out of range, contradicting another, or naming a
      setting the layer does not run (the message names the key).
  """
  op = "config_from_hf"
  model_type = _model_type(op, hf)
  keys = _Keys(hf, model_type, op)
  keys.one_of("hidden_act", ("silu", "swish"), "the experts are SwiGLU MLPs; transformers runs both as SiLU")
  _check_quantization(op, hf)
  experts_key = {"mixtral": "num_local_experts", "deepseek_v3": "n_routed_experts",
                 "glm4_moe": "n_routed_experts"}.get(model_type, "num_experts")
  ffn_key = "intermediate_size" if model_type in ("mixtral", "olmoe") else "moe_intermediate_size"
  num_experts, top_k = keys.int(experts_key), keys.int("num_experts_per_tok")
  if top_k > num_experts:
    raise ValueError(f"{op}: 'num_experts_per_tok' must be <= {experts_key!r} ({num_experts}), got {top_k}")
  kw: dict[str, Any] = {"hidden": keys.int("hidden_size"), "num_experts": num_experts, "top_k": top_k,
                        "ffn": keys.int(ffn_key)}
  if model_type == "mixtral":
    if keys.raw("router_jitter_noise") != 0 or isinstance(keys.raw("router_jitter_noise"), bool):
      raise ValueError(f"{op}: 'router_jitter_noise' must be 0.0 (the layer does not jitter its input in training), "
                       f"got {keys.raw('router_jitter_noise')!r}")
    kw["renormalize"] = True
  elif model_type in ("qwen2_moe", "qwen3_moe", "olmoe"):
    kw["renormalize"] = keys.bool("norm_topk_prob")
    if model_type == "qwen2_moe":
      kw.update(num_shared_experts=1, shared_ffn=keys.int("shared_expert_intermediate_size"),
                shared_expert_gate=True)
  else:
    for key, allowed in _ROUTER_FIELDS.items():
      if key in hf:
        keys.one_of(key, allowed, "the router of transformers' DeepSeek-V3 and of this layer")
    n_group, topk_group = keys.int("n_group"), keys.int("topk_group")
    if num_experts % n_group:
      raise ValueError(f"{op}: 'n_group' must divide {experts_key!r} ({num_experts}), got {n_group}")
    if topk_group > n_group:
      raise ValueError(f"{op}: 'topk_group' must be <= 'n_group' ({n_group}), got {topk_group}")
    if num_experts // n_group < 2:
      raise ValueError(f"{op}: 'n_group' must leave at least 2 experts a group (transformers scores a group by its "
                       f"2 best experts), got {n_group} groups of {num_experts // n_group}")
    if top_k > topk_group * (num_experts // n_group):
      raise ValueError(f"{op}: 'num_experts_per_tok' must be <= 'topk_group' x experts per group "
                       f"({topk_group} x {num_experts // n_group}), got {top_k}")
    kw.update(router_kind=routing.DEEPSEEK_V3, n_group=n_group, topk_group=topk_group,
              renormalize=keys.bool("norm_topk_prob"),
              routed_scaling_factor=keys.positive_float("routed_scaling_factor"))
    shared = keys.int("n_shared_experts", minimum=0)
    if shared:
      kw.update(num_shared_experts=1, shared_ffn=shared * kw["ffn"])
  kw.update(overrides)
  return moe.MoEConfig(**kw)


def layer_prefix(model_type: str, layer: int) -> str:
  """The name prefix of layer `layer`'s MoE module in a `model_type` checkpoint, e.g. ``"model.layers.3.mlp."``."""
  if model_type not in MODEL_TYPES:
    raise ValueError(f"layer_prefix: model_type must be one of {', '.join(MODEL_TYPES)}, got {model_type!r}")
  if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
    raise ValueError(f"layer_prefix: layer must be an int >= 0, got {layer!r}")
  return f"model.layers.{layer}.{'block_sparse_moe' if model_type == 'mixtral' else 'mlp'}."


def _dense_reason(hf: Mapping[str, Any], model_type: str, layer: int) -> Optional[str]:
  """Why layer `layer` of the model is not a MoE layer in transformers' modeling code, or None when it is one."""
  keys = _Keys(hf, model_type, "load_hf_layer")
  if model_type in ("deepseek_v3", "glm4_moe"):
    first = keys.int("first_k_dense_replace", minimum=0)
    if layer < first:
      return f"its layers below 'first_k_dense_replace' ({first}) are dense"
  elif model_type in ("qwen2_moe", "qwen3_moe"):
    dense = keys.raw("mlp_only_layers")
    dense = [] if dense is None else dense  # as transformers' class reads None
    step = keys.int("decoder_sparse_step")
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
      raise ValueError(f"load_hf_layer: 'mlp_only_layers' must be a list of ints, got {dense!r}")
    if layer in dense:
      return f"'mlp_only_layers' ({dense}) lists it"
    if (layer + 1) % step:
      return f"only layers i with (i + 1) % 'decoder_sparse_step' ({step}) == 0 are MoE layers"
  return None


# ----------------------------------------------------------------------------------------------------------------
# Tensors
# ----------------------------------------------------------------------------------------------------------------

_FLOATS = tuple(np.dtype(d) for d in ("float16", "float32", "float64")) + (np.dtype(ml_dtypes.bfloat16),)
_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
# Scale dtypes whose values float32 holds exactly.
_SCALE_DTYPES = (np.dtype("float32"), np.dtype("float16"), np.dtype(ml_dtypes.bfloat16))
_SCALE_SUFFIX = "_scale_inv"


# The model types whose router weight transformers keeps in float32 whatever the model's dtype
# (`_keep_in_fp32_modules_strict`): under a narrower param_dtype, one stored in another dtype would be rounded here
# and not there.
_FLOAT32_ROUTERS = ("deepseek_v3", "glm4_moe")


def _dtype_of(v: Any):
  d = getattr(v, "dtype", None)
  if d is None:
    return np.asarray(v).dtype
  try:
    return np.dtype(d)
  except TypeError:
    return d


def _cast(a: np.ndarray, dtype: Any) -> np.ndarray:
  """``a.astype(dtype)`` rounded once, to nearest even. Some ml_dtypes versions cast float64 to bfloat16 through
  float32, rounding twice (1 + 2^-8 + 2^-30 becomes 1, not 1 + 2^-7); going through float32 rounded to odd
  (truncated, the last bit set where bits were dropped) gives the correctly rounded result for any target of at
  most 22 significand bits."""
  a, dtype = np.asarray(a), np.dtype(dtype)
  if a.dtype != np.float64 or dtype.itemsize >= 4:
    return a.astype(dtype)
  with np.errstate(over="ignore", invalid="ignore"):
    t = a.astype(np.float32)
    t = np.where(np.abs(t) > np.abs(a), np.nextafter(t, np.float32(0)), t)  # toward zero (a finite)
    odd = (t.view(np.uint32) | np.uint32(1)).view(np.float32)
    t = np.where(np.isfinite(a) & (t != a), odd, t)
    return t.astype(dtype)


def _expand_blocks(scale: np.ndarray, n: int, k: int) -> np.ndarray:
  b = quant.FP8_BLOCK
  return np.repeat(np.repeat(scale, b, axis=0), b, axis=1)[:n, :k]


class _Layer:
  """One MoE layer's tensors, checked against a config from their shapes and dtypes alone, and read on demand.

  `value(param, index)` reads the part `index` (a tuple of slices of the global shape) of one parameter; for the
  routed experts' weights it reads only the experts `index` selects.
  """

  def __init__(self, tensors: Mapping[str, Any], config: moe.MoEConfig, model_type: str, prefix: str, op: str):
    self.tensors, self.config, self.model_type, self.prefix, self.op = tensors, config, model_type, prefix, op
    self.shapes = moe.param_shapes(config)
    self.used: set[str] = set()
    self._pending: dict[tuple, np.ndarray] = {}  # halves of routed-expert parts read with the other half
    self._plan()
    self._check_unexpected()

  # -- names, shapes and dtypes ----------------------------------------------------------------------------------

  def _linear(self, name: str, shape: tuple[int, int]) -> bool:
    """Checks the weight ``<name>.weight`` [out, in] (and its scale when FP8); True when it is FP8."""
    key = f"{self.prefix}{name}.weight"
    t = self._tensor(key)
    fp8 = self._check_weight(key, t, shape)
    if fp8:
      skey = key + _SCALE_SUFFIX
      if skey not in self.tensors:
        raise ValueError(f"{self.op}: {key!r} is float8_e4m3fn, so the checkpoint must have its block scales "
                         f"{skey!r}, which are not in tensors")
      s = self.tensors[skey]
      want = quant.fp8_weight_scale_shape(tuple(shape))
      if tuple(s.shape) != want or _dtype_of(s) not in _SCALE_DTYPES:
        raise ValueError(f"{self.op}: {skey!r} must be [ceil({shape[0]}/128), ceil({shape[1]}/128)] = {want} of "
                         f"float32 (one scale per 128x128 block of {key!r}), got {tuple(s.shape)} of "
                         f"{_dtype_of(s)}")
      self.used.add(skey)
    return fp8

  def _tensor(self, key: str) -> Any:
    if key not in self.tensors:
      raise ValueError(f"{self.op}: the {self.model_type} layer needs the tensor {key!r}, which is not in tensors")
    self.used.add(key)
    return self.tensors[key]

  def _check_weight(self, key: str, t: Any, shape: tuple[int, ...]) -> bool:
    if tuple(t.shape) != shape:
      raise ValueError(f"{self.op}: {key!r} must have shape {shape} for this config, got {tuple(t.shape)}")
    dtype = _dtype_of(t)
    if dtype == _E4M3 and len(shape) == 2:
      return True
    if dtype not in _FLOATS:
      what = "float16, bfloat16, float32, float64" + (", or float8_e4m3fn with its scales" if len(shape) == 2 else "")
      raise ValueError(f"{self.op}: {key!r} must be a float weight ({what}), got {getattr(dtype, 'name', dtype)}")
    return False

  def _plan(self) -> None:
    c, mt = self.config, self.model_type
    h, e, f = c.hidden, c.num_experts, c.ffn
    self.fp8 = {"router": self._linear("gate", (e, h))}
    if mt in _FLOAT32_ROUTERS and not self.fp8["router"]:
      key = self.prefix + "gate.weight"
      stored, pd = np.dtype(_dtype_of(self._tensor(key))), np.dtype(c.param_dtype)
      if pd != np.dtype(np.float32) and stored != pd:
        raise ValueError(f"{self.op}: transformers keeps the {mt} router {key!r} in float32; stored as {stored.name}, "
                         f"it would be rounded to param_dtype {pd.name} and route tokens otherwise: load with "
                         f"param_dtype float32, or from a checkpoint that stores it as {pd.name}")
    if c.router_kind == routing.DEEPSEEK_V3:
      key = self.prefix + "gate.e_score_correction_bias"
      self._check_weight(key, self._tensor(key), (e,))
    gate, up, down = ("w1", "w3", "w2") if mt == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    self.expert_names = (gate, up, down)
    routed = [(self._linear(f"experts.{i}.{gate}", (f, h)), self._linear(f"experts.{i}.{up}", (f, h)),
               self._linear(f"experts.{i}.{down}", (h, f))) for i in range(e)]
    self.routed_fp8 = routed
    if c.fp8_weights:
      for i, (g8, u8, d8) in enumerate(routed):
        if g8 != u8:
          raise ValueError(f"{self.op}: expert {i}'s {gate} and {up} must both be float8_e4m3fn or both float to "
                           f"make one FP8 w_gate_up, got {'float8' if g8 else 'float'} and "
                           f"{'float8' if u8 else 'float'}")
        if g8 and f % quant.FP8_BLOCK:
          raise ValueError(f"{self.op}: config.fp8_weights takes FP8 experts as they are, which needs ffn % 128 == 0 "
                           f"(gate and up rows stacked keep their 128x128 blocks), got ffn={f}; use a config without "
                           f"fp8_weights to dequantize them")
    if c.num_shared_experts:
      if c.num_shared_experts != 1:
        raise ValueError(f"{self.op}: checkpoints hold one shared MLP, so config.num_shared_experts must be 1, got "
                         f"{c.num_shared_experts}")
      module = {"qwen2_moe": "shared_expert", "deepseek_v3": "shared_experts", "glm4_moe": "shared_experts"}.get(mt)
      if module is None:
        raise ValueError(f"{self.op}: a {mt} layer has no shared experts, but the config has "
                         f"{c.num_shared_experts}")
      fs = c.shared_width
      self.shared_module = module
      self.fp8["shared"] = tuple(self._linear(f"{module}.{n}", s) for n, s in
                                 (("gate_proj", (fs, h)), ("up_proj", (fs, h)), ("down_proj", (h, fs))))
    if c.shared_expert_gate:
      self.fp8["shared_gate"] = self._linear("shared_expert_gate", (1, h))

  def _check_unexpected(self) -> None:
    extra = sorted(k for k in self.tensors if k.startswith(self.prefix) and k not in self.used)
    if not extra:
      return
    c = self.config
    notes = []
    for k in extra[:6]:
      name = k[len(self.prefix):]
      m = re.match(r"experts\.(\d+)\.", name)
      if m and int(m.group(1)) >= c.num_experts:
        why = f"the config has num_experts={c.num_experts} (experts 0..{c.num_experts - 1})"
      elif name.startswith("shared_expert_gate."):
        why = "the config has shared_expert_gate=False"
      elif name.startswith(("shared_expert.", "shared_experts.")):
        why = "the config has no shared experts (num_shared_experts=0)"
      elif name == "gate.e_score_correction_bias":
        why = f"the config's router_kind {c.router_kind!r} has no correction bias"
      elif name.endswith(_SCALE_SUFFIX):
        why = "a block scale of a weight that is not float8_e4m3fn"
      else:
        why = f"not a tensor of a {self.model_type} MoE layer"
      notes.append(f"{k!r} ({why})")
    more = f", and {len(extra) - 6} more" if len(extra) > 6 else ""
    raise ValueError(f"{self.op}: the checkpoint has tensors under {self.prefix!r} that the config does not "
                     f"describe: {'; '.join(notes)}{more}")

  # -- values ----------------------------------------------------------------------------------------------------

  def _scales(self, key: str) -> np.ndarray:
    """The float32 block scales of the FP8 weight `key`; non-finite ones are refused."""
    s = np.asarray(self.tensors[key + _SCALE_SUFFIX]).astype(np.float32)
    if not np.all(np.isfinite(s)):
      raise ValueError(f"{self.op}: {key + _SCALE_SUFFIX!r} must hold finite scales, got a NaN or an infinity")
    return s

  def _dense(self, name: str, fp8: bool, dtype) -> np.ndarray:
    """The weight ``<name>.weight`` as `dtype`: FP8 codes times their block scales in float32, or one cast."""
    key = f"{self.prefix}{name}.weight"
    w = np.asarray(self.tensors[key])
    if not fp8:
      return _cast(w, dtype)
    return (w.astype(np.float32) * _expand_blocks(self._scales(key), *w.shape)).astype(dtype)

  def _fp8(self, name: str) -> tuple[np.ndarray, np.ndarray]:
    key = f"{self.prefix}{name}.weight"
    return np.asarray(self.tensors[key]), self._scales(key)

  def _expert(self, i: int, which: str) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """Expert i's w_gate_up [2F, H] or w_down [H, F]: (values, None), or (codes, scales) with fp8_weights."""
    gate, up, down = self.expert_names
    g8, _, d8 = self.routed_fp8[i]
    names, fp8 = ((f"experts.{i}.{gate}", f"experts.{i}.{up}"), g8) if which == "w_gate_up" \
        else ((f"experts.{i}.{down}",), d8)
    if self.config.fp8_weights and fp8:
      parts = [self._fp8(n) for n in names]
      return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    dtype = np.float32 if self.config.fp8_weights else self.shapes[which].dtype
    w = np.concatenate([self._dense(n, fp8, dtype) for n in names])
    if not self.config.fp8_weights:
      return w, None
    q, s = quant.quantize_fp8_weight(w)
    return np.asarray(q), np.asarray(s)

  def value(self, param: str, index: tuple[slice, ...]) -> np.ndarray:
    c = self.config
    dtype = self.shapes[param].dtype
    if param in ("w_gate_up", "w_down", "w_gate_up_sf", "w_down_sf"):
      which = param.removesuffix("_sf")
      key = (param, tuple((s.start, s.stop, s.step) for s in index))
      if key in self._pending:  # the other half of a part already read for the codes or the scales
        return self._pending.pop(key)
      experts = range(*index[0].indices(c.num_experts))
      parts = [self._expert(i, which) for i in experts]
      halves = {}
      for name, half in ((which, 0), (which + "_sf", 1)):
        if name in self.shapes:
          stacked = np.stack([p[half] for p in parts]) if parts else \
              np.zeros((0, *self.shapes[name].shape[1:]), self.shapes[name].dtype)
          halves[name] = stacked[(slice(None), *index[1:])].astype(self.shapes[name].dtype)
      # FP8 codes and scales come from one read (and, for float experts, one quantization) of each expert.
      self._pending.update({(name, key[1]): v for name, v in halves.items() if name != param})
      return halves[param]
    if param == "router":
      out = self._dense("gate", self.fp8["router"], dtype).T
    elif param == "router_bias":
      out = _cast(self.tensors[self.prefix + "gate.e_score_correction_bias"], dtype)
    elif param in ("shared_w_gate_up", "shared_w_down"):
      m, (g8, u8, d8) = self.shared_module, self.fp8["shared"]
      out = (np.concatenate([self._dense(f"{m}.gate_proj", g8, dtype), self._dense(f"{m}.up_proj", u8, dtype)])
             if param == "shared_w_gate_up" else self._dense(f"{m}.down_proj", d8, dtype))[None]
    elif param == "shared_gate":
      out = self._dense("shared_expert_gate", self.fp8["shared_gate"], dtype)[0]
    else:
      raise AssertionError(param)
    return np.ascontiguousarray(out[index])


def _check_layer_args(op: str, config: Any, model_type: Any, prefix: Any) -> None:
  if not isinstance(config, moe.MoEConfig):
    hint = " (a config.json dict goes through config_from_hf first)" if isinstance(config, Mapping) else ""
    raise TypeError(f"{op}: config must be a MoEConfig{hint}, got {type(config).__name__}")
  if model_type not in MODEL_TYPES:
    raise ValueError(f"{op}: model_type must be one of {', '.join(MODEL_TYPES)}, got {model_type!r}")
  if not isinstance(prefix, str) or (prefix and not prefix.endswith(".")):
    raise ValueError(f"{op}: prefix must be '' or a module name ending in '.', e.g. 'model.layers.3.mlp.', "
                     f"got {prefix!r}")


def params_from_hf(tensors: Mapping[str, Any], config: moe.MoEConfig, *, model_type: str,
                   prefix: str = "") -> dict[str, np.ndarray]:
  """The parameters (`moe.init_params`' keys) of one MoE layer from its checkpoint tensors.

  Float weights (float16, bfloat16, float32, float64) are cast once to param_dtype. float8_e4m3fn weights with
  their ``weight_scale_inv`` go into an ``fp8_weights`` config as they are (routed experts: codes and scales bit for
  bit), else dequantized (codes times scales in float32) and cast to param_dtype; float routed experts into an
  ``fp8_weights`` config are quantized with `quant.quantize_fp8_weight`.

  Args:
    tensors: name -> array (NumPy, JAX, or anything with shape and dtype that `np.asarray` takes), holding the
      layer's tensors; tensors outside `prefix` are ignored.
    config: the layer (e.g. from `config_from_hf`).
    model_type: one of `MODEL_TYPES`.
    prefix: the MoE module's name prefix, e.g. ``"model.layers.3.mlp."`` (`layer_prefix`); '' when `tensors` holds
      this layer only.

  Returns:
    NumPy arrays of `moe.param_shapes(config)`'s shapes and dtypes; put them on the mesh with
    `moe.param_specs(config)` (or load from disk with `load_hf_layer`).

  Raises:
    TypeError: `config` is not a MoEConfig, or `tensors` not a mapping.
    ValueError: an unknown model type; a tensor missing, of another shape than the config's, of a dtype that is not
      a float weight, float8 without its scales or with scales of the wrong shape; a tensor under `prefix` that the
      config does not describe (each named).
  """
  op = "params_from_hf"
  _check_layer_args(op, config, model_type, prefix)
  if not isinstance(tensors, Mapping):
    raise TypeError(f"{op}: tensors must be a mapping of name -> array, got {type(tensors).__name__}")
  layer = _Layer(tensors, config, model_type, prefix, op)
  return {name: layer.value(name, tuple(slice(None) for _ in sds.shape)) for name, sds in layer.shapes.items()}


# ----------------------------------------------------------------------------------------------------------------
# From disk
# ----------------------------------------------------------------------------------------------------------------


class _LazyTensors(Mapping):
  """name -> tensor of a checkpoint's safetensors files, for the names under a prefix; files open on first use."""

  def __init__(self, model_dir: str, weight_map: Mapping[str, str]):
    self.model_dir, self.weight_map = model_dir, weight_map
    self._files: dict[str, dict] = {}

  def __getitem__(self, name: str):
    from jax_moe_a2a import safetensors_reader  # pylint: disable=import-outside-toplevel
    file = self.weight_map[name]
    if file not in self._files:
      self._files[file] = safetensors_reader.open_file(os.path.join(self.model_dir, file))
    tensors = self._files[file]
    if name not in tensors:
      raise ValueError(f"load_hf_layer: the index names {file} for tensor {name!r}, which that file does not have")
    return tensors[name]

  def __iter__(self):
    return iter(self.weight_map)

  def __len__(self):
    return len(self.weight_map)


def _weight_map(model_dir: str, prefixes: tuple[str, ...]) -> dict[str, str]:
  """tensor name -> file, for the tensors under `prefixes`, from the index or the single file's header."""
  from jax_moe_a2a import safetensors_reader  # pylint: disable=import-outside-toplevel
  index = os.path.join(model_dir, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index) as f:
      weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict):
      raise ValueError(f"load_hf_layer: {index} must have a 'weight_map' of tensor name -> file")
  elif os.path.exists(os.path.join(model_dir, "model.safetensors")):
    header, _ = safetensors_reader.read_header(os.path.join(model_dir, "model.safetensors"))
    weight_map = {name: "model.safetensors" for name in header}
  else:
    raise ValueError(f"load_hf_layer: {model_dir} must hold model.safetensors.index.json or model.safetensors, "
                     f"it has neither")
  return {k: v for k, v in weight_map.items() if k.startswith(prefixes)}


def load_hf_layer(model_dir: str, layer: int, mesh=None, *, prefix: Optional[str] = None,
                  **overrides: Any) -> tuple[moe.MoEConfig, dict[str, Any]]:
  """One MoE layer of a Hugging Face checkpoint directory, on a mesh: its config and its parameters.

  Reads ``config.json`` (`config_from_hf`) and, from the ``*.safetensors`` files (``model.safetensors`` or the
  shards listed in ``model.safetensors.index.json``), only the tensors of layer `layer`, mapped from the files:
  each parameter is assembled per device, so a process reads only the experts its devices hold (and the small
  replicated tensors). The values are mapped as `params_from_hf` says.

  Args:
    model_dir: the checkpoint directory.
    layer: the decoder layer's index; it must be a MoE layer of the model.
    mesh: the mesh to place the parameters on (`moe.param_specs`' shardings); None: the mesh set with
      ``jax.set_mesh``.
    prefix: the MoE module's name prefix; None: `layer_prefix(model_type, layer)` (for Mixtral, ``mlp.`` in place
      of ``block_sparse_moe.`` when the checkpoint names it so).
    **overrides: `moe.MoEConfig` fields for `config_from_hf` (dtype, param_dtype, fp8_weights, mesh axes, ...).

  Returns:
    (config, params): params as `moe.init_params` returns them, global arrays with their shardings on `mesh`.

  Raises:
    ValueError: what `config_from_hf` and `params_from_hf` raise; a layer that is dense in the model or has no
      tensors; a directory without config.json or safetensors files; a malformed safetensors file.
  """
  import jax  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding  # pylint: disable=import-outside-toplevel
  op = "load_hf_layer"
  path = os.path.join(model_dir, "config.json")
  if not os.path.exists(path):
    raise ValueError(f"{op}: model_dir must hold config.json, {path} does not exist")
  with open(path) as f:
    hf = json.load(f)
  model_type = _model_type(op, hf)
  if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
    raise ValueError(f"{op}: layer must be an int >= 0, got {layer!r}")
  config = config_from_hf(hf, **overrides)
  dense = _dense_reason(hf, model_type, layer)
  if dense is not None:
    raise ValueError(f"{op}: layer {layer} of this {model_type} model is dense, not a MoE layer: {dense}")
  if prefix is None:
    prefix = layer_prefix(model_type, layer)
    candidates = (prefix, f"model.layers.{layer}.mlp.") if model_type == "mixtral" else (prefix,)
    weight_map = _weight_map(model_dir, candidates)
    found = [p for p in candidates if any(k.startswith(p) for k in weight_map)]
    prefix = found[0] if found else prefix
  else:
    _check_layer_args(op, config, model_type, prefix)
    weight_map = _weight_map(model_dir, (prefix,) if prefix else ("",))
  weight_map = {k: v for k, v in weight_map.items() if k.startswith(prefix)}
  if not weight_map:
    raise ValueError(f"{op}: the checkpoint has no tensors under {prefix!r} (layer {layer}; the model has "
                     f"{_Keys(hf, model_type, op).raw('num_hidden_layers')} layers)")
  mesh = moe.resolve_mesh(op, mesh)
  moe.mesh_axis_sizes(op, config, mesh)
  source = _Layer(_LazyTensors(model_dir, weight_map), config, model_type, prefix, op)
  params = {}
  for name, spec in moe.param_specs(config).items():
    sds = source.shapes[name]
    cache: dict[Any, np.ndarray] = {}

    def read(index, name=name, cache=cache):
      key = tuple((s.start, s.stop, s.step) for s in index)
      if key not in cache:  # replicated parameters are asked for once per device
        cache[key] = source.value(name, index)
      return cache[key]

    params[name] = jax.make_array_from_callback(sds.shape, NamedSharding(mesh, spec), read)
  return config, params
