// quant_mx_kernels.cuh -- launchers of the MXFP8 and NVFP4 kernels (implemented in quant_mx_kernels.cu).
//
// Every launcher enqueues on `stream` and returns the launch error, if any; nothing is launched for empty arrays.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "quant_kernels.cuh"  // InputType

namespace jax_moe_a2a {

// Output element type of the dequantizers.
enum class OutputType { kBF16, kF16, kF32 };

// x [m, k] -> x_q [m, k] E4M3 bytes and x_sf [m, cols] E8M0 bytes (cols >= ceil(k/32); the blocks past k are
// padding: zero values, scale byte 0).
cudaError_t LaunchQuantizeMxfp8(cudaStream_t stream, InputType type, const void* x, uint8_t* x_q, uint8_t* x_sf,
                                int64_t m, int64_t k, int64_t cols);

// x_q [m, k] E4M3 bytes and x_sf [m, cols] E8M0 bytes -> out [m, k] of `type`.
cudaError_t LaunchDequantizeMxfp8(cudaStream_t stream, OutputType type, const uint8_t* x_q, const uint8_t* x_sf,
                                  void* out, int64_t m, int64_t k, int64_t cols);

// The NVFP4 global scale of the n values at x: max(amax over the finite |x|, 1e-12) / 2688, into *global_scale
// (device memory, also the launches' scratch).
cudaError_t LaunchNvfp4GlobalScale(cudaStream_t stream, InputType type, const void* x, int64_t n,
                                   float* global_scale);

// x [m, k] (k % 16 == 0) and the global scale (device memory) -> x_q [m, k/2] (two E2M1 codes per byte) and
// x_sf [m, k/16] E4M3 bytes.
cudaError_t LaunchQuantizeNvfp4(cudaStream_t stream, InputType type, const void* x, const float* global_scale,
                                uint8_t* x_q, uint8_t* x_sf, int64_t m, int64_t k);

// x_q [m, k/2], x_sf [m, k/16] and the global scale (device memory) -> out [m, k] of `type`.
cudaError_t LaunchDequantizeNvfp4(cudaStream_t stream, OutputType type, const uint8_t* x_q, const uint8_t* x_sf,
                                  const float* global_scale, void* out, int64_t m, int64_t k);

}  // namespace jax_moe_a2a
