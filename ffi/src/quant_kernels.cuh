// quant_kernels.cuh -- launchers of the quantization kernels (implemented in quant_kernels.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace jax_moe_a2a {

enum class InputType { kBF16, kF16, kF32 };

// x [m, k] (k % 128 == 0) -> x_q [m, k] E4M3 bytes and x_sf float32, [m, k/128] or, when block_major_k,
// [k/128, m]. With swiglu, x is [m, 2k] (gate columns, then up columns) and the values quantized are
// silu(gate) * up in float32 (not with block_major_k). Enqueues on `stream`; returns the launch error, if any.
cudaError_t LaunchQuantizeFp8Blockwise(cudaStream_t stream, InputType type, const void* x, uint8_t* x_q,
                                       float* x_sf, int64_t m, int64_t k, bool block_major_k, bool swiglu);

// w [batch, n, k] (k % (16 / element size) == 0) -> w_q [batch, n, k] E4M3 bytes and w_sf float32
// [batch, ceil(n/128), ceil(k/128)], one scale per 128x128 block (edge blocks: the values that exist). Needs
// ceil(n/128) <= 65535 and batch <= 65535. When w_q_t is not null (then n % 16 == 0), the same codes are also
// written transposed, w_q_t [batch, k, n].
cudaError_t LaunchQuantizeFp8Weight(cudaStream_t stream, InputType type, const void* w, uint8_t* w_q, float* w_sf,
                                    uint8_t* w_q_t, int64_t batch, int64_t n, int64_t k);

// Grouped K-major quantization (quant.quantize_fp8_grouped_kmajor): m rows sorted by group, row i being x[rows[i]]
// (a zero row where rows[i] is outside [0, x_rows)) or, when rows is null, x[i]; x [x_rows, c] (c % 128 == 0) of
// `type`, or E4M3 codes decoded with their 1x128 scales x_sf [x_rows, c/128] when x_sf is not null (type is then
// ignored) -> q_t [c, p] E4M3 bytes and sf_t [p/128, c] float32, p = GroupedKmajorLength(m, num_groups); blocks
// [p/128, 2] int32 receives each 128-column block's first sorted row and row count. group_sizes stays on the
// device (two launches: the block table, then the quantization).
cudaError_t LaunchQuantizeFp8GroupedKmajor(cudaStream_t stream, InputType type, const void* x, const float* x_sf,
                                           const int32_t* rows, int64_t x_rows, const int32_t* group_sizes,
                                           int64_t num_groups, uint8_t* q_t, float* sf_t, int32_t* blocks, int64_t m,
                                           int64_t c);

}  // namespace jax_moe_a2a
