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
// ceil(n/128) <= 65535 and batch <= 65535.
cudaError_t LaunchQuantizeFp8Weight(cudaStream_t stream, InputType type, const void* w, uint8_t* w_q, float* w_sf,
                                    int64_t batch, int64_t n, int64_t k);

}  // namespace jax_moe_a2a
