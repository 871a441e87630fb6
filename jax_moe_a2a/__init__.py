"""jax_moe_a2a: expert-parallel Mixture-of-Experts for JAX on NVIDIA GPUs.

One-sided NVLink dispatch/combine and FP8 block-scaled expert GEMMs as XLA FFI custom calls, each with a
pure-JAX reference that is the CPU fallback and the test oracle.

What a user calls, from the package itself::

  import jax_moe_a2a as jma

  config = jma.MoEConfig(num_experts=256, top_k=8, hidden=7168, ffn=2048)
  params = jma.init_params(key, config, mesh)
  y, aux = jma.moe_apply(params, x, config, mesh)          # or the Flax layers jma.MoE / jma.LinenMoE

The names below are imported from their modules on first use, so ``import jax_moe_a2a`` alone does not import
jax (the demo sets XLA's flags before that).
"""

import importlib

from jax_moe_a2a import layout
from jax_moe_a2a.layout import FORMATS, dispatch_layout, workspace_layout

__version__ = "0.1.0"

# name -> the module that defines it
_PUBLIC = {
    # the layer
    "MoEConfig": "moe", "init_params": "moe", "param_specs": "moe", "param_shapes": "moe", "moe_apply": "moe",
    "make_workspace": "moe", "moe_dense_reference": "moe", "quantize_experts": "moe",
    # Flax, and Hugging Face checkpoints
    "MoE": "flax_moe", "LinenMoE": "flax_moe", "jit_apply": "flax_moe", "config_from_hf": "checkpoints", "params_from_hf": "checkpoints",
    "load_hf_layer": "checkpoints",
    # the exchange
    "Workspace": "workspace", "dispatch": "a2a", "combine": "a2a", "dispatch_two_level": "two_level",
    "combine_two_level": "two_level",
    # routing
    "RouterConfig": "routing", "route": "routing", "INVALID_EXPERT": "routing",
    # expert math
    "ExpertWeights": "expert_mlp", "QuantizedWeights": "expert_mlp", "grouped_gemm_fp8": "grouped_gemm", "grouped_gemm_bf16": "grouped_gemm",
    # quantization
    "quantize": "quant", "dequantize": "quant", "quantize_fp8_blockwise": "quant",
    "dequantize_fp8_blockwise": "quant", "quantize_fp8_weight": "quant", "dequantize_fp8_weight": "quant",
}

__all__ = sorted(["FORMATS", "dispatch_layout", "layout", "workspace_layout", "__version__", *_PUBLIC])


def __getattr__(name: str):
  if name in _PUBLIC:
    value = getattr(importlib.import_module(f"jax_moe_a2a.{_PUBLIC[name]}"), name)
    globals()[name] = value
    return value
  raise AttributeError(f"module 'jax_moe_a2a' has no attribute {name!r}")


def __dir__():
  return __all__
