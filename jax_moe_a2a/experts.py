"""The expert stage on the receive layout of dispatch: permute by local expert, SwiGLU MLP, weighted un-permute.

Pure JAX. Expert weights use the "NT" layout of the grouped GEMM kernels (DeepGEMM's and CUTLASS's): each
expert's matrix is [N, K] with K (the contraction) contiguous, so an FP8 weight's 128x128 block scales are
[N/128, K/128]:

- ``w_gate_up`` [num_local_experts, 2 * ffn, hidden]: rows [0, ffn) are the gate projection, rows
  [ffn, 2 * ffn) the up projection;
- ``w_down``    [num_local_experts, hidden, ffn].

An expert computes ``down(silu(gate(x)) * up(x))``; the stage returns, per received row, the sum over that row's
local experts of weight * expert(x), accumulated in float32 in top-k order — the combine payload.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from jax_moe_a2a import quant


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExpertWeights:
  """SwiGLU weights of the local experts, BF16/FP32, or FP8 E4M3 with FP32 128x128 block scales.

  Attributes:
    w_gate_up: [num_local_experts, 2 * ffn, hidden] (bfloat16, float32 or float8_e4m3fn).
    w_down: [num_local_experts, hidden, ffn], same dtype family.
    w_gate_up_sf: for FP8 weights, [num_local_experts, ceil(2 * ffn / 128), ceil(hidden / 128)] float32.
    w_down_sf: for FP8 weights, [num_local_experts, ceil(hidden / 128), ceil(ffn / 128)] float32.
  """

  w_gate_up: jax.Array
  w_down: jax.Array
  w_gate_up_sf: Optional[jax.Array] = None
  w_down_sf: Optional[jax.Array] = None

  @property
  def is_fp8(self) -> bool:
    return self.w_gate_up_sf is not None

  @classmethod
  def quantize(cls, w_gate_up: jax.Array, w_down: jax.Array) -> "ExpertWeights":
    """FP8 E4M3 weights with one FP32 scale per 128x128 block, from BF16/FP32 ones."""
    gu, gu_sf = quant.quantize_fp8_weight(w_gate_up)
    dn, dn_sf = quant.quantize_fp8_weight(w_down)
    return cls(gu, dn, gu_sf, dn_sf)

  def dequantized(self, dtype=jnp.bfloat16) -> tuple[jax.Array, jax.Array]:
    """(w_gate_up, w_down) as `dtype`."""
    if not self.is_fp8:
      return self.w_gate_up.astype(dtype), self.w_down.astype(dtype)
    return (quant.dequantize_fp8_weight(self.w_gate_up, self.w_gate_up_sf, dtype=dtype),
            quant.dequantize_fp8_weight(self.w_down, self.w_down_sf, dtype=dtype))


def _check_weights(op: str, weights: ExpertWeights, hidden: int) -> tuple[int, int]:
  gu, dn = weights.w_gate_up, weights.w_down
  if gu.ndim != 3 or gu.shape[1] % 2 or gu.shape[2] != hidden:
    raise ValueError(f"{op}: w_gate_up must be [num_local_experts, 2 * ffn, hidden={hidden}], got {gu.shape}")
  num_local_experts, ffn = gu.shape[0], gu.shape[1] // 2
  if dn.shape != (num_local_experts, hidden, ffn):
    raise ValueError(f"{op}: w_down must be [num_local_experts, hidden, ffn] = {(num_local_experts, hidden, ffn)}, "
                     f"got {dn.shape}")
  if (weights.w_gate_up_sf is None) != (weights.w_down_sf is None):
    raise ValueError(f"{op}: FP8 weights need both w_gate_up_sf and w_down_sf, got only one")
  return num_local_experts, ffn


def swiglu_mlp_reference(x: jax.Array, group_sizes: jax.Array, weights: ExpertWeights, *,
                         compute_dtype=jnp.bfloat16) -> jax.Array:
  """Grouped SwiGLU MLP over rows sorted by expert (pure JAX, `jax.lax.ragged_dot`).

  Args:
    x: [num_rows, hidden] rows sorted by local expert (bfloat16 or float32; FP8 inputs are dequantized by the
      caller). Rows past sum(group_sizes) give zero.
    group_sizes: [num_local_experts] int32, rows of each expert, in order.
    weights: the local experts' weights (BF16 or FP8; FP8 is dequantized to `compute_dtype` first).
    compute_dtype: operand dtype of the matmuls; they accumulate in float32.

  Returns:
    [num_rows, hidden] float32.
  """
  _, ffn = _check_weights("swiglu_mlp_reference", weights, x.shape[-1])
  w_gate_up, w_down = weights.dequantized(compute_dtype)
  h = jax.lax.ragged_dot(x.astype(compute_dtype), jnp.swapaxes(w_gate_up, 1, 2), group_sizes,
                         preferred_element_type=jnp.float32)
  act = jax.nn.silu(h[:, :ffn]) * h[:, ffn:]
  return jax.lax.ragged_dot(act.astype(compute_dtype), jnp.swapaxes(w_down, 1, 2), group_sizes,
                            preferred_element_type=jnp.float32)


def expert_stage(recv_x: jax.Array, recv_topk_ids: jax.Array, recv_topk_weights: jax.Array,
                 weights: ExpertWeights, *, recv_x_sf: Optional[jax.Array] = None, out_dtype=jnp.bfloat16,
                 compute_dtype=jnp.bfloat16) -> jax.Array:
  """Runs the local experts on what dispatch received and returns the combine payload.

  Each (row, k) with a valid local expert id is one assignment. Assignments are sorted by expert (stable, so
  by row and then k within an expert), run through the grouped MLP, weighted, and summed back per row over k in
  ascending order, in float32. Padding rows (every id INVALID = -1) give zero.

  Args:
    recv_x: [num_ranks, capacity, hidden] bfloat16/float32, or float8_e4m3fn with `recv_x_sf`.
    recv_topk_ids: [num_ranks, capacity, top_k] int32 local expert ids, -1 for none.
    recv_topk_weights: [num_ranks, capacity, top_k] float32.
    weights: the local experts' `ExpertWeights`.
    recv_x_sf: for FP8 rows, their [num_ranks, capacity, hidden / 128] float32 1x128 scales.
    out_dtype: dtype of the returned payload.
    compute_dtype: matmul operand dtype.

  Returns:
    [num_ranks, capacity, hidden] `out_dtype`: per row, sum_k weight_k * expert_k(x).
  """
  # Type and shape checks
  op = "expert_stage"
  if recv_x.ndim != 3:
    raise ValueError(f"{op}: recv_x must be [num_ranks, capacity, hidden], got shape {recv_x.shape}")
  num_ranks, capacity, hidden = recv_x.shape
  if recv_topk_ids.ndim != 3 or recv_topk_ids.shape[:2] != (num_ranks, capacity):
    raise ValueError(f"{op}: recv_topk_ids must be [num_ranks, capacity, top_k] = [{num_ranks}, {capacity}, top_k], "
                     f"got {recv_topk_ids.shape}")
  if recv_topk_ids.dtype != jnp.int32:
    raise TypeError(f"{op}: recv_topk_ids must be int32, got {recv_topk_ids.dtype}")
  if recv_topk_weights.shape != recv_topk_ids.shape:
    raise ValueError(f"{op}: recv_topk_weights must have the shape of recv_topk_ids {recv_topk_ids.shape}, "
                     f"got {recv_topk_weights.shape}")
  num_local_experts, _ = _check_weights(op, weights, hidden)
  top_k = recv_topk_ids.shape[-1]

  rows = recv_x.reshape(num_ranks * capacity, hidden)
  if recv_x_sf is not None:
    rows = quant.dequantize_fp8_blockwise(rows, recv_x_sf.reshape(num_ranks * capacity, -1), dtype=jnp.float32)
  elif recv_x.dtype == jnp.float8_e4m3fn:
    raise ValueError(f"{op}: float8_e4m3fn recv_x needs recv_x_sf (its 1x128 scales), got None")
  ids = recv_topk_ids.reshape(-1)
  valid = (ids >= 0) & (ids < num_local_experts)

  with jax.named_scope("permute"):
    key = jnp.where(valid, ids, num_local_experts)
    order = jnp.argsort(key, stable=True)
    group_sizes = jnp.zeros((num_local_experts + 1,), jnp.int32).at[key].add(1)[:num_local_experts]
    x_sorted = rows[order // top_k]
  with jax.named_scope("experts"):
    y_sorted = swiglu_mlp_reference(x_sorted, group_sizes, weights, compute_dtype=compute_dtype)
  with jax.named_scope("unpermute"):
    y = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(num_ranks * capacity, top_k, hidden)
    w = jnp.where(valid, recv_topk_weights.reshape(-1), 0.0).reshape(-1, top_k)
    v = valid.reshape(-1, top_k)
    out = jnp.zeros((num_ranks * capacity, hidden), jnp.float32)
    for k in range(top_k):  # fixed float32 summation order over k
      out = out + jnp.where(v[:, k:k + 1], y[:, k] * w[:, k:k + 1], 0.0)
  return out.reshape(num_ranks, capacity, hidden).astype(out_dtype)
