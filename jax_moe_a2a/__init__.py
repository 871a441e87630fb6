"""jax_moe_a2a: expert-parallel Mixture-of-Experts for JAX on NVIDIA GPUs.

One-sided NVLink dispatch/combine and FP8 block-scaled expert GEMMs as XLA FFI custom calls, each with a
pure-JAX twin that is the CPU fallback and the test oracle.
"""

from jax_moe_a2a import layout
from jax_moe_a2a.layout import FORMATS, dispatch_layout, workspace_layout

__version__ = "0.1.0"

__all__ = ["FORMATS", "dispatch_layout", "layout", "workspace_layout", "__version__"]
