// quant_kernels.cuh -- launchers of the quantization kernels (implemented in quant_kernels.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace jax_moe_a2a {

enum class InputType { kBF16, kF16, kF32 };

// x [m, k] (k % 128 == 0) -> x_q [m, k] E4M3 bytes and x_sf float32, [m, k/128] or, when block_major_k,
// [k/128, m]. Enqueues on `stream`; returns the launch error, if any.
cudaError_t LaunchQuantizeFp8Blockwise(cudaStream_t stream, InputType type, const void* x, uint8_t* x_q,
                                       float* x_sf, int64_t m, int64_t k, bool block_major_k);

}  // namespace jax_moe_a2a
