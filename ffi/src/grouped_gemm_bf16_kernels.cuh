// grouped_gemm_bf16_kernels.cuh -- host interface of the bf16 grouped GEMMs for sm_90a (the expert MLP's forward,
// data-gradient and weight-gradient products).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

namespace jax_moe_a2a {

// Which product one call computes. In every mode `a` is [rows, k] bfloat16 with rows sorted by group: group g owns
// rows [start_g, start_g + size_g), the sizes being group_sizes clamped to >= 0 and to the rows that are left.
//
//   kNT (forward):        b [G, n, k] (k contiguous), d [rows, n] bf16:  d_g = a_g · b_gᵀ
//   kNN (data gradient):  b [G, k, n] (n contiguous), d [rows, n] bf16:  d_g = a_g · b_g
//   kTN (weight gradient): b [rows, n] (grouped like a), d [G, k, n] f32 or bf16 (`d_bf16`): d[g] = a_gᵀ · b_g
//                          (contraction over the group's rows; a group with no rows gives zeros)
//
// Rows of d that no group owns (kNT, kNN) are zeros. All products accumulate in float32.
enum class Bf16GemmMode : int32_t { kNT = 0, kNN = 1, kTN = 2 };

struct GroupedGemmBf16Args {
  Bf16GemmMode mode = Bf16GemmMode::kNT;
  const void* a = nullptr;
  const void* b = nullptr;
  const int32_t* group_sizes = nullptr;
  void* d = nullptr;
  bool d_bf16 = true;  // kTN only: d is bfloat16 (else float32); kNT and kNN always write bfloat16
  int64_t num_groups = 0;
  int64_t rows = 0;
  int64_t n = 0;
  int64_t k = 0;
  void* scratch = nullptr;
  size_t scratch_bytes = 0;
};

// Bytes of device scratch one call of `mode` (and, for kTN, output dtype) needs: per-group argument arrays and the
// kernel's workspace.
size_t GroupedGemmBf16ScratchBytes(Bf16GemmMode mode, bool d_bf16, int64_t num_groups, int sm_count);

// Enqueues the grouped GEMM on `stream` (the current device must be the stream's). Returns an empty string on
// success, otherwise what failed.
std::string LaunchGroupedGemmBf16(cudaStream_t stream, int sm_count, const GroupedGemmBf16Args& args);

}  // namespace jax_moe_a2a
