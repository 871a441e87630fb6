// grouped_gemm_kernels.cuh -- host interface of the FP8 block-scaled grouped GEMM for sm_90a.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

namespace jax_moe_a2a {

// One grouped GEMM D_g = A_g · B_gᵀ over num_groups groups (see grouped_gemm.cc for the contract).
//
// Contiguous: a [rows, k], a_sf [rows, k/128], d [rows, n]; group g owns rows [start_g, start_g + size_g) where
//   the sizes are group_sizes clamped to >= 0 and to what is left of `rows`.
// Masked:     a [num_groups, rows, k], a_sf [num_groups, rows, k/128], d [num_groups, rows, n]; group g owns
//   its first clamp(group_sizes[g], 0, rows) rows.
// Both: b [num_groups, n, k] E4M3 (k contiguous), b_sf [num_groups, n/128, k/128]; d is bfloat16 and rows that
// no group owns are written as zeros. group_sizes stays in device memory (no host synchronization).
struct GroupedGemmFp8Args {
  const uint8_t* a = nullptr;
  const float* a_sf = nullptr;
  const uint8_t* b = nullptr;
  const float* b_sf = nullptr;
  const int32_t* group_sizes = nullptr;
  void* d = nullptr;
  int64_t num_groups = 0;
  int64_t rows = 0;
  int64_t n = 0;
  int64_t k = 0;
  bool masked = false;
  void* scratch = nullptr;
  size_t scratch_bytes = 0;
};

// Bytes of device scratch one call needs: the per-group argument arrays plus the kernel's own workspace
// (per-SM TMA descriptors). Depends only on the group count and the device's SM count.
size_t GroupedGemmFp8ScratchBytes(int64_t num_groups, int sm_count);

// Enqueues the grouped GEMM on `stream` (the current device must be the stream's). Returns an empty string on
// success, otherwise what failed. Calls of more than 64 rows per group on average take the kernel that
// JAX_MOE_A2A_FP8_GEMM_KERNEL names: "cutlass" (unset or empty: the default) or "wgmma" (sm90::ChosenFp8Kernels,
// which says when the variable is read).
std::string LaunchGroupedGemmFp8(cudaStream_t stream, int sm_count, const GroupedGemmFp8Args& args);

// The kernel of grouped_gemm_fp8_wgmma_sm90.cu: its scratch bytes and its launch (any rows per group; 128-row tiles).
size_t GroupedGemmFp8WgmmaScratchBytes(int64_t num_groups);
std::string LaunchGroupedGemmFp8Wgmma(cudaStream_t stream, int sm_count, const GroupedGemmFp8Args& args);

}  // namespace jax_moe_a2a
