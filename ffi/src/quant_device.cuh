// quant_device.cuh -- device pieces shared by the quantizer kernels (quant_kernels.cu, quant_mx_kernels.cu).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "quant.h"

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

// The amax and finiteness of a block of 2-byte values from its raw words, kWords 16-byte pieces in each of kLanes
// consecutive lanes: the largest magnitude has the largest sign-cleared bit pattern, finite when that is below
// infinity's. Two halves per instruction, without a float compare per value. Every lane of the warp takes part.
template <typename T, int kWords, int kLanes>
__device__ __forceinline__ void AmaxOfHalves(const uint4* w, float& amax, int& finite) {
  constexpr uint32_t kAbs = 0x7FFF7FFFu;
  uint32_t m = __vmaxu2(__vmaxu2(w[0].x & kAbs, w[0].y & kAbs), __vmaxu2(w[0].z & kAbs, w[0].w & kAbs));
#pragma unroll
  for (int l = 1; l < kWords; ++l) {
    m = __vmaxu2(m, __vmaxu2(__vmaxu2(w[l].x & kAbs, w[l].y & kAbs), __vmaxu2(w[l].z & kAbs, w[l].w & kAbs)));
  }
#pragma unroll
  for (int o = kLanes / 2; o >= 1; o >>= 1) m = __vmaxu2(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
  const uint32_t top = max(m & 0xFFFFu, m >> 16);
  if constexpr (std::is_same_v<T, __half>) {
    finite = top < 0x7C00u;
    amax = __half2float(__ushort_as_half(static_cast<unsigned short>(top)));
  } else {
    static_assert(std::is_same_v<T, __nv_bfloat16>, "2-byte inputs: bf16 or f16");
    finite = top < 0x7F80u;
    amax = __uint_as_float(top << 16);
  }
}

// The E4M3 codes of v[0 .. kN) times inv_scale (a power of two: the product is exact) clamped to [-limit, limit],
// rounded to nearest even by the hardware's pair conversion: the encoding step of quant.h and quant_mx.h. The
// conversion saturates to 448 by itself, so the clamp is only spent where the limit is lower (the top scale).
template <int kN>
__device__ __forceinline__ void EncodeE4m3(const float* v, float inv_scale, float limit, uint8_t* bytes) {
  const bool clamp = limit != kE4m3Max;
#pragma unroll
  for (int i = 0; i < kN; i += 2) {
    float2 q = make_float2(__fmul_rn(v[i], inv_scale), __fmul_rn(v[i + 1], inv_scale));
    if (clamp) {
      q.x = fminf(fmaxf(q.x, -limit), limit);
      q.y = fminf(fmaxf(q.y, -limit), limit);
    }
    const __nv_fp8x2_storage_t pair = __nv_cvt_float2_to_fp8x2(q, __NV_SATFINITE, __NV_E4M3);
    bytes[i] = static_cast<uint8_t>(pair & 0xFF);
    bytes[i + 1] = static_cast<uint8_t>(pair >> 8);
  }
}

}  // namespace jax_moe_a2a
