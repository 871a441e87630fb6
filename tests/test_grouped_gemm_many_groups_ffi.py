"""The CUTLASS grouped GEMMs' shared scaffolding (ffi/src/grouped_gemm_sm90_common.cuh) on more groups than one
setup block has threads (256): the group-size scan carries its running row offset from one chunk of groups to the
next, and every unit carves its per-group arrays from scratch by the same rule. 300 groups, with empty, one-row,
tile-sized and clamped (oversized) groups, through the FP8 GEMM (contiguous and masked), the bf16 GEMM's three
modes and the FP8 weight gradient, each against its reference; then the same compiled call with other sizes (the
cached kernel parameters must not hold them). The tolerances are those of each GEMM's own tests.

GPU tests (JAX_MOE_A2A_TEST_GPU=1 on a GPU): on CPU the custom calls take their C++ loops, not this scaffolding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe_a2a import _ffi, grouped_gemm, quant
from jax_moe_a2a.testing import calc_diff, max_rel

pytestmark = [pytest.mark.skipif(not _ffi.available(), reason="compiled extension not built"), pytest.mark.gpu]

GROUPS = 300


def _sizes(rng, rows):
  """GROUPS sizes: zeros, ones, 128s and random ones; rows owned past the first 256 groups, and the running total
  passing `rows` only at the last three groups (the first of them gets what is left, the others nothing)."""
  s = rng.integers(0, 10, GROUPS)
  s[::7], s[1::11], s[2::31] = 0, 1, 128
  s[-3:] = rows
  assert s[:256].sum() < s[:-3].sum() < rows
  return jnp.asarray(s, jnp.int32)


def _unowned_rows(sizes, rows):
  return np.arange(rows) >= min(int(np.maximum(np.asarray(sizes), 0).sum()), rows)


def _both(fn, *args):
  """fn(*args, impl) for the custom call and the reference, one compiled program each."""
  return [np.asarray(jax.jit(lambda *a, impl=impl: fn(*a, impl=impl))(*args).astype(jnp.float32))
          for impl in ("ffi", "reference")]


@pytest.mark.parametrize("masked", [False, True])
def test_fp8_gemm_on_many_groups(masked):
  rng = np.random.default_rng(1)
  rows = 16 if masked else 2500
  x = jnp.asarray(rng.standard_normal((GROUPS * rows if masked else rows, 256)), jnp.bfloat16)
  a, a_sf = quant.quantize_fp8_blockwise(x, impl="reference")
  b, b_sf = quant.quantize_fp8_weight(jnp.asarray(rng.standard_normal((GROUPS, 128, 256)) * 0.05, jnp.float32))
  if masked:
    a, a_sf = a.reshape(GROUPS, rows, 256), a_sf.reshape(GROUPS, rows, 2)
  sizes = _sizes(rng, 2500)  # masked: each group's rows clamped to its 16
  got, want = _both(grouped_gemm.grouped_gemm_fp8, a, a_sf, b, b_sf, sizes)
  assert calc_diff(got, want) < 1e-3
  np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2 * np.abs(want).max())
  if not masked:
    np.testing.assert_array_equal(got[_unowned_rows(sizes, rows)], 0)


@pytest.mark.parametrize("masked", [False, True])
def test_fp8_wgmma_gemm_on_many_groups(masked, monkeypatch):
  """The wgmma kernel (grouped_gemm_fp8_wgmma_sm90.cu) takes calls of more than 64 rows per group on average; its
  own setup scans the group sizes and then the groups' 128-row blocks across chunks of 256 groups (the weight
  gradient's wgmma kernel: test_fp8_wgrad_on_many_groups)."""
  monkeypatch.setenv("JAX_MOE_A2A_FP8_GEMM_KERNEL", "wgmma")
  rng = np.random.default_rng(2)
  rows = 100 if masked else 100 * GROUPS
  x = jnp.asarray(rng.standard_normal((GROUPS * rows if masked else rows, 256)), jnp.bfloat16)
  a, a_sf = quant.quantize_fp8_blockwise(x, impl="reference")
  b, b_sf = quant.quantize_fp8_weight(jnp.asarray(rng.standard_normal((GROUPS, 128, 256)) * 0.05, jnp.float32))
  if masked:
    a, a_sf = a.reshape(GROUPS, rows, 256), a_sf.reshape(GROUPS, rows, 2)
  s = rng.integers(0, 200, GROUPS)
  s[::7], s[1::11], s[2::31], s[3::13] = 0, 1, 128, 129
  s[-3:] = 100 * GROUPS  # the running total passes the rows at the last three groups
  sizes = jnp.asarray(s, jnp.int32)
  got, want = _both(grouped_gemm.grouped_gemm_fp8, a, a_sf, b, b_sf, sizes)
  assert calc_diff(got, want) < 1e-3
  np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2 * np.abs(want).max())
  if not masked:
    np.testing.assert_array_equal(got[_unowned_rows(sizes, rows)], 0)


@pytest.mark.parametrize("mode", ["nk", "kn", "wgrad", "wgrad_bf16"])
def test_bf16_gemm_on_many_groups(mode):
  rng = np.random.default_rng(2)
  rows = 2500
  sizes = _sizes(rng, rows)
  a = jnp.asarray(rng.standard_normal((rows, 128)), jnp.bfloat16)
  if mode.startswith("wgrad"):
    c = jnp.asarray(rng.standard_normal((rows, 256)), jnp.bfloat16)
    out_dtype = jnp.bfloat16 if mode == "wgrad_bf16" else jnp.float32
    got, want = _both(lambda a, c, s, impl: grouped_gemm.grouped_gemm_bf16_wgrad(a, c, s, out_dtype=out_dtype,
                                                                                  impl=impl), a, c, sizes)
    empty = np.flatnonzero(np.asarray(sizes) == 0)
    np.testing.assert_array_equal(got[empty], 0)
  else:
    w = jnp.asarray(rng.standard_normal((GROUPS, 256, 128) if mode == "nk" else (GROUPS, 128, 256)) * 0.05,
                    jnp.bfloat16)
    got, want = _both(lambda a, w, s, impl: grouped_gemm.grouped_gemm_bf16(a, w, s, b_layout=mode, impl=impl),
                      a, w, sizes)
    np.testing.assert_array_equal(got[_unowned_rows(sizes, rows)], 0)
  assert calc_diff(got, want) < 1e-5
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-2 * max(np.abs(want).max(), 1e-30))


@pytest.mark.parametrize("kernel", ["cutlass", "wgmma"])
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_fp8_wgrad_on_many_groups(out_dtype, kernel, monkeypatch):
  monkeypatch.setenv("JAX_MOE_A2A_FP8_GEMM_KERNEL", kernel)
  rng = np.random.default_rng(3)
  rows = 2500
  sizes = _sizes(rng, rows)
  dy = jnp.asarray(rng.standard_normal((rows, 128)), jnp.bfloat16)
  x = jnp.asarray(rng.standard_normal((rows, 256)), jnp.bfloat16)
  ops = (*quant.quantize_fp8_grouped_kmajor(dy, sizes, impl="reference"),
         *quant.quantize_fp8_grouped_kmajor(x, sizes, impl="reference"))
  got, want = _both(lambda *a, impl: grouped_gemm.grouped_gemm_fp8_wgrad(*a, out_dtype=out_dtype, impl=impl),
                    *ops, sizes)
  if out_dtype == jnp.float32:
    assert max_rel(got, want) <= 2e-3 and calc_diff(got, want) < 1e-6
  else:
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2 * np.abs(want).max())
  empty = np.flatnonzero(np.asarray(sizes) == 0)
  np.testing.assert_array_equal(got[empty], 0)


def test_one_compiled_call_with_other_sizes_on_many_groups():
  rng = np.random.default_rng(4)
  rows = 2500
  x = jnp.asarray(rng.standard_normal((rows, 256)), jnp.bfloat16)
  a, a_sf = quant.quantize_fp8_blockwise(x, impl="reference")
  b, b_sf = quant.quantize_fp8_weight(jnp.asarray(rng.standard_normal((GROUPS, 128, 256)) * 0.05, jnp.float32))
  w = jnp.asarray(rng.standard_normal((GROUPS, 128, 256)) * 0.05, jnp.bfloat16)

  @jax.jit
  def both(s):
    return [(grouped_gemm.grouped_gemm_fp8(a, a_sf, b, b_sf, s, impl=impl),
             grouped_gemm.grouped_gemm_bf16(x, w, s, impl=impl)) for impl in ("ffi", "reference")]

  for seed in range(3):
    sizes = _sizes(np.random.default_rng(10 + seed), rows)
    (fp8, bf16), (fp8_ref, bf16_ref) = [[np.asarray(o.astype(jnp.float32)) for o in p] for p in both(sizes)]
    assert calc_diff(fp8, fp8_ref) < 1e-3 and calc_diff(bf16, bf16_ref) < 1e-5
    for got in (fp8, bf16):
      np.testing.assert_array_equal(got[_unowned_rows(sizes, rows)], 0)
