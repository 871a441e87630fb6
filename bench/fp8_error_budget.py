"""How much of the FP8 experts' error the recipe itself makes: the SwiGLU MLP in float32 with each of its four E4M3
roundings (the input rows and the SwiGLU output 1x128, `quant.quantize_fp8_blockwise`; both weights 128x128,
`quant.quantize_fp8_weight`) applied alone and together, each dequantized exactly, against the float32 MLP.

No GEMM kernel and no bf16 rounding takes part, so the figures are the floor of any implementation of the recipe:
calc_diff = 1 - 2 sum(a b) / sum(a^2 + b^2) of the output, Gaussian rows, weights scaled as `moe.init_params`
scales them. Runs on the CPU in seconds.

  python bench/fp8_error_budget.py [--rows 2048] [--hidden 2048] [--ffn 1024] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from jax_moe_a2a import quant
from jax_moe_a2a.demo import positive_int
from jax_moe_a2a.testing import calc_diff


def _rows(a: jax.Array) -> jax.Array:
  """a rounded as the layer rounds activations: E4M3 with one power-of-two float32 scale per 1x128 block."""
  q, sf = quant.quantize_fp8_blockwise(a, impl="reference")
  return quant.dequantize_fp8_blockwise(q, sf, dtype=jnp.float32)


def _weight(w: jax.Array) -> jax.Array:
  """w rounded as the layer rounds weights: E4M3 with one power-of-two float32 scale per 128x128 block."""
  q, sf = quant.quantize_fp8_weight(w[None], impl="reference")
  return quant.dequantize_fp8_weight(q, sf, dtype=jnp.float32)[0]


def budget(rows: int, hidden: int, ffn: int, seed: int) -> dict[str, float]:
  """calc_diff of the MLP's output with each rounding alone, the activations' two, the weights' two, and all four."""
  k = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(k[0], (rows, hidden), jnp.float32)
  w_gu = jax.random.normal(k[1], (2 * ffn, hidden), jnp.float32) / hidden ** 0.5
  w_dn = jax.random.normal(k[2], (hidden, ffn), jnp.float32) / ffn ** 0.5
  keep = lambda a: a  # noqa: E731

  def mlp(rx, rgu, rh, rdn):
    with jax.default_matmul_precision("highest"):
      h = rx(x) @ rgu(w_gu).T
      act = jax.nn.silu(h[:, :ffn]) * h[:, ffn:]
      return rh(act) @ rdn(w_dn).T

  exact = mlp(keep, keep, keep, keep)
  cases = {"x (1x128)": (_rows, keep, keep, keep), "w_gate_up (128x128)": (keep, _weight, keep, keep),
           "act (1x128)": (keep, keep, _rows, keep), "w_down (128x128)": (keep, keep, keep, _weight),
           "x and act": (_rows, keep, _rows, keep), "both weights": (keep, _weight, keep, _weight),
           "all four": (_rows, _weight, _rows, _weight)}
  return {name: float(calc_diff(mlp(*r), exact)) for name, r in cases.items()}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--rows", type=positive_int, default=2048)
  p.add_argument("--hidden", type=positive_int, default=2048, help="a multiple of 128")
  p.add_argument("--ffn", type=positive_int, default=1024, help="a multiple of 128")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  for name in ("hidden", "ffn"):
    if getattr(args, name) % 128:
      p.error(f"--{name} must be a multiple of 128, got {getattr(args, name)}")
  for name, v in budget(args.rows, args.hidden, args.ffn, args.seed).items():
    print(f"{name:>20}: calc_diff {v:.2e}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
