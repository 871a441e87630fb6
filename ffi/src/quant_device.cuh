// quant_device.cuh -- device pieces shared by the quantizer kernels (quant_kernels.cu, quant_mx_kernels.cu).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace jax_moe_a2a {

// The float32 values of a 16-byte piece of T (bfloat16, float16 or float32) elements.
template <typename T>
__device__ __forceinline__ void Unpack(const uint4& raw, float* v);

template <>
__device__ __forceinline__ void Unpack<__nv_bfloat16>(const uint4& raw, float* v) {
  const auto* p = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(p[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}

template <>
__device__ __forceinline__ void Unpack<__half>(const uint4& raw, float* v) {
  const auto* p = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(p[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}

template <>
__device__ __forceinline__ void Unpack<float>(const uint4& raw, float* v) {
  v[0] = __uint_as_float(raw.x);
  v[1] = __uint_as_float(raw.y);
  v[2] = __uint_as_float(raw.z);
  v[3] = __uint_as_float(raw.w);
}

// Folds the magnitudes and the finiteness of v[0 .. kN) into amax and finite.
template <int kN>
__device__ __forceinline__ void FoldAmax(const float* v, float& amax, int& finite) {
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    finite &= isfinite(v[i]) ? 1 : 0;
    amax = fmaxf(amax, fabsf(v[i]));
  }
}

// Combines amax and finite over the lanes whose indices differ only in the bits of kLowest .. kHighest (powers of
// two): the shuffles' offsets. Every lane of the warp must take part.
template <int kHighest, int kLowest = 1>
__device__ __forceinline__ void ReduceAmaxOverLanes(float& amax, int& finite) {
#pragma unroll
  for (int o = kHighest; o >= kLowest; o >>= 1) {
    amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
    finite &= __shfl_xor_sync(0xFFFFFFFFu, finite, o);
  }
}

}  // namespace jax_moe_a2a
