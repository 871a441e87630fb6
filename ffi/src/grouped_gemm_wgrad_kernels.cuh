// grouped_gemm_wgrad_kernels.cuh -- host interface of the FP8 weight-gradient grouped GEMM for sm_90a.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

namespace jax_moe_a2a {

// d[g] = A_g · B_gᵀ per group over its token columns (see grouped_gemm.cc for the contract): a_t [na, p] and b_t
// [nb, p] E4M3 (tokens contiguous), a_sf_t [p/128, na] and b_sf_t [p/128, nb] float32, d [num_groups, na, nb]
// float32 or bfloat16 (d_bf16). Group g contracts columns [off_g, off_g + round_up(size_g, 128)) with sizes clamped
// against p - 128 * num_groups; groups without rows are written as zeros. group_sizes stays in device memory.
struct GroupedGemmFp8WgradArgs {
  const uint8_t* a_t = nullptr;
  const float* a_sf_t = nullptr;
  const uint8_t* b_t = nullptr;
  const float* b_sf_t = nullptr;
  const int32_t* group_sizes = nullptr;
  void* d = nullptr;
  bool d_bf16 = false;
  int64_t num_groups = 0;
  int64_t na = 0;
  int64_t nb = 0;
  int64_t p = 0;
  void* scratch = nullptr;
  size_t scratch_bytes = 0;
};

// Bytes of device scratch one call needs (per-group argument arrays and the kernel's workspace).
size_t GroupedGemmFp8WgradScratchBytesFor(int64_t num_groups, int sm_count);

// Enqueues the GEMM on `stream` (the current device must be the stream's). Returns "" on success, else what failed.
// The kernel is CUTLASS's or the one written on wgmma, as JAX_MOE_A2A_FP8_GEMM_KERNEL says (grouped_gemm_kernels.cuh).
std::string LaunchGroupedGemmFp8Wgrad(cudaStream_t stream, int sm_count, const GroupedGemmFp8WgradArgs& args);

// The kernel of grouped_gemm_fp8_wgrad_wgmma_sm90.cu: its scratch bytes and its launch.
size_t GroupedGemmFp8WgradWgmmaScratchBytes(int64_t num_groups);
std::string LaunchGroupedGemmFp8WgradWgmma(cudaStream_t stream, int sm_count, const GroupedGemmFp8WgradArgs& args);

}  // namespace jax_moe_a2a
