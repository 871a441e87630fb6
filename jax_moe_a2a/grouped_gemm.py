"""FP8 block-scaled grouped GEMM: ``d[g] = a[g] @ b[g].T`` per expert group, E4M3 operands, bfloat16 output.

Activations are E4M3 with one float32 scale per 1x128 group of a row (`quant.quantize_fp8_blockwise`), weights are
E4M3 with one float32 scale per 128x128 block (`quant.quantize_fp8_weight`), in the "NT" layout of
`experts.ExpertWeights`: ``b`` is [G, N, K] with K contiguous. The product accumulates in float32 and is rounded
to bfloat16 once.

Two layouts of the rows, told apart by the rank of ``a``:

- **contiguous** (``a`` [M, K]): rows sorted by group; group g owns the ``group_sizes[g]`` rows after those of
  groups 0..g-1 (what `jax.lax.ragged_dot` takes). Sizes are clamped to >= 0 and to the rows that are left, so a
  sum above M drops the excess rows of the last groups; rows past the owned ones come back as zeros.
- **masked** (``a`` [G, R, K]): group g owns its first ``clamp(group_sizes[g], 0, R)`` rows; the other rows of d
  are zeros. This is the layout of a per-expert receive buffer, read without a copy.

Group sizes are run-time values and stay on the device: the custom call has no host synchronization and can
be captured in a CUDA graph. Empty groups are fine.

Implementations (``impl=``): ``"ffi"`` is the custom call ``jax_moe_a2a_grouped_gemm_fp8`` -- on GPUs a
CUTLASS SM90 warp-specialized grouped GEMM with blockwise scaling (TMA, wgmma, float32 promotion every 128 of
K), on CPU a loop over the dequantized operands in float32; ``"reference"`` is the pure-JAX twin (dequantize,
float32 matmul at HIGHEST precision); ``"auto"`` picks as `jax_moe_a2a._ffi.resolve_impl` says. The
implementations agree to float32 rounding of the accumulation (then one bfloat16 rounding), not bit for bit.

This op is not differentiable by itself (its operands are FP8 codes); `experts.swiglu_mlp_fp8` is the trainable
expert MLP built on it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jax_moe_a2a import _ffi, quant

BLOCK = quant.FP8_BLOCK
MAX_GROUPS = 65535


def _check(op: str, a: Any, a_sf: Any, b: Any, b_sf: Any, group_sizes: Any) -> tuple[bool, int, int, int, int]:
  """Checks the operands; returns (masked, G, rows, N, K) with rows = M (contiguous) or R (masked)."""
  for name, v, dtype in (("a", a, jnp.float8_e4m3fn), ("b", b, jnp.float8_e4m3fn), ("a_sf", a_sf, jnp.float32),
                         ("b_sf", b_sf, jnp.float32), ("group_sizes", group_sizes, jnp.int32)):
    if v is None:
      raise ValueError(f"{op}: {name} must be given, got None")
    if jnp.dtype(v.dtype) != jnp.dtype(dtype):
      raise TypeError(f"{op}: {name} must be {jnp.dtype(dtype).name}, got {jnp.dtype(v.dtype).name}")
  if (b.ndim != 3 or not 1 <= b.shape[0] <= MAX_GROUPS or b.shape[1] % BLOCK or b.shape[2] % BLOCK
      or not b.shape[1] or not b.shape[2]):
    raise ValueError(f"{op}: b must be [G, N, K] with 1 <= G <= {MAX_GROUPS} and N, K positive multiples of "
                     f"{BLOCK}, got shape {tuple(b.shape)}")
  g, n, k = b.shape
  if a.ndim == 2:
    masked, rows = False, a.shape[0]
    if a.shape[1] != k:
      raise ValueError(f"{op}: a (contiguous) must be [M, K] with K = {k} (from b), got shape {tuple(a.shape)}")
    want_sf = (rows, k // BLOCK)
  elif a.ndim == 3:
    masked, rows = True, a.shape[1]
    if a.shape[0] != g or a.shape[2] != k:
      raise ValueError(f"{op}: a (masked) must be [G, R, K] with G = {g}, K = {k} (from b), got shape "
                       f"{tuple(a.shape)}")
    want_sf = (g, rows, k // BLOCK)
  else:
    raise ValueError(f"{op}: a must be [M, K] (contiguous) or [G, R, K] (masked), got shape {tuple(a.shape)}")
  if tuple(a_sf.shape) != want_sf:
    dims = "[G, R, K/128]" if masked else "[M, K/128]"
    raise ValueError(f"{op}: a_sf must be {dims} = {want_sf}, got shape {tuple(a_sf.shape)}")
  if tuple(b_sf.shape) != (g, n // BLOCK, k // BLOCK):
    raise ValueError(f"{op}: b_sf must be [G, N/128, K/128] = {(g, n // BLOCK, k // BLOCK)}, got shape "
                     f"{tuple(b_sf.shape)}")
  if tuple(group_sizes.shape) != (g,):
    raise ValueError(f"{op}: group_sizes must be [G] = ({g},), got shape {tuple(group_sizes.shape)}")
  return masked, g, rows, n, k


def owned_rows(group_sizes: jax.Array, rows: int, *, masked: bool) -> tuple[jax.Array, jax.Array]:
  """(start, size) per group after clamping, as int32 [G] each (start is 0 for every masked group)."""
  req = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  if masked:
    return jnp.zeros_like(req), jnp.minimum(req, rows)
  start = jnp.minimum(jnp.cumsum(req) - req, rows)
  return start, jnp.minimum(req, rows - start)


@jax.jit
def _jax_grouped_gemm_fp8(a, a_sf, b, b_sf, group_sizes):
  """Pure-JAX twin: dequantize both operands to float32 and multiply at HIGHEST precision."""
  w = quant._jax_dequantize_fp8_weight(b, b_sf)  # pylint: disable=protected-access  # [G, N, K]
  if a.ndim == 3:
    num_groups, rows, k = a.shape
    x = quant._jax_dequantize_fp8_blockwise(a.reshape(-1, k), a_sf.reshape(-1, k // BLOCK))  # pylint: disable=protected-access
    y = jnp.einsum("grk,gnk->grn", x.reshape(num_groups, rows, k), w, precision=jax.lax.Precision.HIGHEST,
                   preferred_element_type=jnp.float32)
    _, size = owned_rows(group_sizes, rows, masked=True)
    live = jnp.arange(rows)[None, :] < size[:, None]
    return jnp.where(live[..., None], y, 0.0).astype(jnp.bfloat16)
  rows = a.shape[0]
  x = quant._jax_dequantize_fp8_blockwise(a, a_sf)  # pylint: disable=protected-access
  _, size = owned_rows(group_sizes, rows, masked=False)
  y = jax.lax.ragged_dot(x, jnp.swapaxes(w, 1, 2), size, precision=jax.lax.Precision.HIGHEST,
                         preferred_element_type=jnp.float32)
  live = jnp.arange(rows) < jnp.sum(size)
  return jnp.where(live[:, None], y, 0.0).astype(jnp.bfloat16)


def scratch_bytes(num_groups: int) -> int:
  """Device scratch of one custom call with `num_groups` groups (0 on CPU)."""
  if jax.default_backend() != "gpu":
    return 0
  return int(_ffi.extension().grouped_gemm_scratch_bytes(int(num_groups)))


def _ffi_grouped_gemm_fp8(a, a_sf, b, b_sf, group_sizes, *, masked: bool, num_groups: int, n: int):
  out_shape = (*a.shape[:-1], n)
  out = (jax.ShapeDtypeStruct(out_shape, jnp.bfloat16),
         jax.ShapeDtypeStruct((scratch_bytes(num_groups),), jnp.uint8))
  d, _ = _ffi.ffi_call("grouped_gemm_fp8", out, a, a_sf, b, b_sf, group_sizes, masked=bool(masked))
  return d


def grouped_gemm_fp8(a: jax.Array, a_sf: jax.Array, b: jax.Array, b_sf: jax.Array, group_sizes: jax.Array, *,
                     impl: str = "auto") -> jax.Array:
  """Grouped ``a[g] @ b[g].T`` with FP8 block-scaled operands (see the module docstring for the layouts).

  Args:
    a: float8_e4m3fn activations, [M, K] (contiguous) or [G, R, K] (masked), K % 128 == 0.
    a_sf: float32 1x128 scales of `a`: [M, K/128] or [G, R, K/128] (DESIGN.md §1.2), as
      `quant.quantize_fp8_blockwise` returns them by default. The kernel reads one group's scales as a compact
      block, which row slices of this layout are; the transposed [K/128, M] layout is not accepted.
    b: float8_e4m3fn weights [G, N, K], N and K multiples of 128.
    b_sf: float32 128x128 block scales of `b`, [G, N/128, K/128].
    group_sizes: int32 [G] rows per group (run-time values; clamped as the module docstring says).
    impl: "auto", "ffi" or "reference".

  Returns:
    bfloat16 [M, N] (contiguous) or [G, R, N] (masked); rows no group owns are 0.

  Raises:
    TypeError / ValueError: an operand has the wrong dtype or shape, or is None; the message names it and
      gives the expected and actual values.
  """
  op = "grouped_gemm_fp8"
  masked, num_groups, _, n, _ = _check(op, a, a_sf, b, b_sf, group_sizes)
  if _ffi.resolve_impl(op, impl) == "ffi":
    return _ffi_grouped_gemm_fp8(a, a_sf, b, b_sf, group_sizes, masked=masked, num_groups=num_groups, n=n)
  return _jax_grouped_gemm_fp8(a, a_sf, b, b_sf, group_sizes)
