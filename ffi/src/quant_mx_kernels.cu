// quant_mx_kernels.cu -- MXFP8 and NVFP4 quantization and dequantization on the GPU.
//
// NOTES:
//   - The rules are quant_mx.h's, bit for bit; every float operation is the correctly rounded one the reference
//     performs (__fmul_rn, __fdiv_rn: no contraction into FMAs, no approximate division), conversions are the
//     hardware's round-to-nearest-even ones, and denormals are kept (as XLA keeps them on GPUs).
//   - Quantizers: one block of 32 (MXFP8) or 16 (NVFP4) values is handled by the few consecutive threads that
//     load it, 16 bytes each; its amax is reduced with shuffles inside that lane segment, and each thread encodes
//     and stores its own values. One read of x, one write of the codes, no shared memory. Every lane takes part
//     in the shuffles, also lanes past the end (their loads and stores are skipped), so full-warp masks stay valid.
//     NVFP4 blocks of 2-byte values (32 bytes) are the exception: one thread loads a whole block in two 16-byte
//     loads and works out its scale once (the scale's two divisions and reciprocal are a large share of the work).
//   - Each thread keeps kManyUnroll 16-byte loads in flight before it computes (one block when there are few, so
//     they spread over more warps).
//   - Dequantizers: one thread per 16 codes (MXFP8: half a block, one 16-byte load) or per NVFP4 block (8 bytes),
//     writing its outputs as 16-byte stores.
//   - MXFP8 with K not a multiple of 32 (an mx_alignment pads the last block) takes a plain kernel, one thread per
//     block and element-wise accesses; it is not a shape the layer uses on the hot path.
//   - The NVFP4 global scale: a grid-stride amax over the finite values, combined across blocks with an atomic max
//     on the float bits (non-negative floats order as their bits, and max does not depend on the order), then one
//     thread divides.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "device_io.cuh"
#include "quant.h"
#include "quant_device.cuh"
#include "quant_mx.h"
#include "quant_mx_kernels.cuh"

namespace jax_moe_a2a {

namespace {

constexpr int kThreads = 256;
constexpr int kManyUnroll = 4;
constexpr int64_t kMinBlocks = 4 * 132;
constexpr int kMaxAmaxBlocks = 8 * 132;

__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float ToFloat(__half v) { return __half2float(v); }
__device__ __forceinline__ float ToFloat(float v) { return v; }

// Two E4M3 bytes -> two floats, exact (through the hardware's E4M3 -> f16 conversion).
__device__ __forceinline__ float2 E4m3PairToFloat2(uint32_t pair) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair), __NV_E4M3);
  return __half22float2(*reinterpret_cast<const __half2*>(&h));
}

__device__ __forceinline__ float E4m3ToFloatDevice(uint32_t byte) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(byte), __NV_E4M3);
  return __half2float(*reinterpret_cast<const __half*>(&h));
}

__device__ __forceinline__ uint32_t FloatToE4m3Device(float f) {
  return __nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3);
}

// kN floats -> kN outputs of OutT at dst (16-byte aligned, kN * sizeof(OutT) a multiple of 16).
template <typename OutT, int kN>
__device__ __forceinline__ void StoreOut(OutT* dst, const float* v) {
  if constexpr (sizeof(OutT) == 4) {
#pragma unroll
    for (int i = 0; i < kN; i += 4) {
      *reinterpret_cast<uint4*>(dst + i) = make_uint4(__float_as_uint(v[i]), __float_as_uint(v[i + 1]),
                                                      __float_as_uint(v[i + 2]), __float_as_uint(v[i + 3]));
    }
  } else {
    uint32_t w[kN / 2];
#pragma unroll
    for (int i = 0; i < kN / 2; ++i) {
      if constexpr (std::is_same_v<OutT, __nv_bfloat16>) {
        const __nv_bfloat162 p = __halves2bfloat162(__float2bfloat16_rn(v[2 * i]), __float2bfloat16_rn(v[2 * i + 1]));
        w[i] = *reinterpret_cast<const uint32_t*>(&p);
      } else {
        const __half2 p = __halves2half2(__float2half_rn(v[2 * i]), __float2half_rn(v[2 * i + 1]));
        w[i] = *reinterpret_cast<const uint32_t*>(&p);
      }
    }
#pragma unroll
    for (int i = 0; i < kN / 2; i += 4) {
      *reinterpret_cast<uint4*>(dst + 2 * i) = make_uint4(w[i], w[i + 1], w[i + 2], w[i + 3]);
    }
  }
}

// A dequantized NaN is the float32 quiet NaN before the cast (quant_mx._canonical_nan).
__device__ __forceinline__ float CanonicalNaN(float v) { return isnan(v) ? __uint_as_float(kF32QuietNaN) : v; }

template <typename OutT>
__device__ __forceinline__ OutT FromFloat(float v) {
  if constexpr (std::is_same_v<OutT, __nv_bfloat16>) {
    return __float2bfloat16_rn(v);
  } else if constexpr (std::is_same_v<OutT, __half>) {
    return __float2half_rn(v);
  } else {
    return v;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// MXFP8
// ---------------------------------------------------------------------------------------------------------------

// The MXFP8 codes of kVec values of a block of amax `amax` and finiteness `finite`; returns the E8M0 byte.
template <int kVec>
__device__ __forceinline__ uint32_t EncodeMxPiece(const float* v, float amax, int finite, uint8_t* bytes) {
  if (!finite) {
#pragma unroll
    for (int i = 0; i < kVec; ++i) bytes[i] = kE4m3NaN;
    return kE8m0NaN;
  }
  const uint32_t biased = MxScaleBiased(__float_as_uint(amax));
  const float inv_scale = __uint_as_float((254u - biased) << 23);
  const float limit = E4m3Limit(biased);
  EncodeE4m3<kVec>(v, inv_scale, limit, bytes);
  return biased;
}

template <int kBytes>
__device__ __forceinline__ void StoreBytes(uint8_t* dst, const uint8_t* bytes) {
  if constexpr (kBytes == 8) {
    *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(bytes);
  } else if constexpr (kBytes == 4) {
    *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<const uint32_t*>(bytes);
  } else {
    static_assert(kBytes == 2, "2, 4 or 8 bytes");
    *reinterpret_cast<uint16_t*>(dst) = *reinterpret_cast<const uint16_t*>(bytes);
  }
}

// k % 32 == 0: blocks are enumerated row-major over the m * (k/32) blocks that hold values; block f's scale goes
// to row * cols + f % (k/32), and the lane that writes a row's last scale also writes its padding scales (0).
template <typename T, int kUnroll>
__global__ void __launch_bounds__(kThreads) QuantizeMxfp8Kernel(const T* __restrict__ x, uint8_t* __restrict__ x_q,
                                                                uint8_t* __restrict__ x_sf, int64_t num_blocks,
                                                                int64_t blocks_per_row, int64_t cols) {
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kLanes = kMxBlock / kVec;  // 4 (2-byte input) or 8 (float32)
  constexpr int kPerPass = kThreads / kLanes;
  const int lane = threadIdx.x % kLanes;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * (kPerPass * kUnroll) + threadIdx.x / kLanes;

  uint4 raw[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t f = first + static_cast<int64_t>(u) * kPerPass;
    raw[u] = f < num_blocks ? LoadStreaming(x + f * kMxBlock + lane * kVec) : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t f = first + static_cast<int64_t>(u) * kPerPass;
    float v[kVec];
    Unpack<T>(raw[u], v);
    float amax = 0.0f;
    int finite = 1;
    if constexpr (sizeof(T) == 2) {
      AmaxOfHalves<T, 1, kLanes>(&raw[u], amax, finite);
    } else {
      FoldAmax<kVec>(v, amax, finite);
      ReduceAmaxOverLanes<kLanes / 2>(amax, finite);
    }
    if (f >= num_blocks) continue;
    uint8_t bytes[kVec];
    const uint32_t scale = EncodeMxPiece<kVec>(v, amax, finite, bytes);
    StoreBytes<kVec>(x_q + f * kMxBlock + lane * kVec, bytes);
    if (lane == 0) {
      if (cols == blocks_per_row) {
        x_sf[f] = static_cast<uint8_t>(scale);
      } else {
        const int64_t row = f / blocks_per_row, g = f - row * blocks_per_row;
        x_sf[row * cols + g] = static_cast<uint8_t>(scale);
        if (g == blocks_per_row - 1) {
          for (int64_t c = blocks_per_row; c < cols; ++c) x_sf[row * cols + c] = 0;
        }
      }
    }
  }
}

// Any k: one thread per (row, scale column); columns past k count as zeros and are not stored.
template <typename T>
__global__ void __launch_bounds__(kThreads) QuantizeMxfp8AnyKernel(const T* __restrict__ x,
                                                                   uint8_t* __restrict__ x_q,
                                                                   uint8_t* __restrict__ x_sf, int64_t m,
                                                                   int64_t k, int64_t cols) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (t >= m * cols) return;
  const int64_t row = t / cols, c = t - row * cols;
  const int64_t begin = c * kMxBlock;
  const int count = begin >= k ? 0 : static_cast<int>(k - begin < kMxBlock ? k - begin : kMxBlock);
  float v[kMxBlock];
  float amax = 0.0f;
  int finite = 1;
#pragma unroll
  for (int i = 0; i < kMxBlock; ++i) {
    v[i] = i < count ? ToFloat(x[row * k + begin + i]) : 0.0f;
    finite &= isfinite(v[i]) ? 1 : 0;
    amax = fmaxf(amax, fabsf(v[i]));
  }
  uint8_t bytes[kMxBlock];
  x_sf[t] = static_cast<uint8_t>(EncodeMxPiece<kMxBlock>(v, amax, finite, bytes));
  for (int i = 0; i < count; ++i) x_q[row * k + begin + i] = bytes[i];
}

// k % 16 == 0: one thread per 16 codes (half a block).
template <typename OutT>
__global__ void __launch_bounds__(kThreads) DequantizeMxfp8Kernel(const uint8_t* __restrict__ x_q,
                                                                  const uint8_t* __restrict__ x_sf,
                                                                  OutT* __restrict__ out, int64_t pieces,
                                                                  int64_t pieces_per_row, int64_t cols) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (t >= pieces) return;
  int64_t s;
  if (cols * 2 == pieces_per_row) {
    s = t / 2;
  } else {
    const int64_t row = t / pieces_per_row;
    s = row * cols + (t - row * pieces_per_row) / 2;
  }
  const float scale = __uint_as_float(E8m0ToFloatBits(x_sf[s]));
  const uint4 raw = LoadStreaming(x_q + t * 16);
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
  float v[16];
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const float2 lo = E4m3PairToFloat2(words[w] & 0xFFFFu), hi = E4m3PairToFloat2(words[w] >> 16);
    v[4 * w] = CanonicalNaN(__fmul_rn(lo.x, scale));
    v[4 * w + 1] = CanonicalNaN(__fmul_rn(lo.y, scale));
    v[4 * w + 2] = CanonicalNaN(__fmul_rn(hi.x, scale));
    v[4 * w + 3] = CanonicalNaN(__fmul_rn(hi.y, scale));
  }
  StoreOut<OutT, 16>(out + t * 16, v);
}

// Any k: one thread per element.
template <typename OutT>
__global__ void __launch_bounds__(kThreads) DequantizeMxfp8AnyKernel(const uint8_t* __restrict__ x_q,
                                                                     const uint8_t* __restrict__ x_sf,
                                                                     OutT* __restrict__ out, int64_t m, int64_t k,
                                                                     int64_t cols) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (t >= m * k) return;
  const int64_t row = t / k, col = t - row * k;
  const float scale = __uint_as_float(E8m0ToFloatBits(x_sf[row * cols + col / kMxBlock]));
  out[t] = FromFloat<OutT>(CanonicalNaN(__fmul_rn(E4m3ToFloatDevice(x_q[t]), scale)));
}

// ---------------------------------------------------------------------------------------------------------------
// NVFP4
// ---------------------------------------------------------------------------------------------------------------

__global__ void __launch_bounds__(1) ZeroWord(uint32_t* word) { *word = 0u; }

template <typename T>
__global__ void __launch_bounds__(kThreads) FiniteAmaxKernel(const T* __restrict__ x, int64_t n,
                                                             uint32_t* __restrict__ amax_bits) {
  constexpr int kVec = 16 / sizeof(T);
  const int64_t vectors = n / kVec, stride = static_cast<int64_t>(gridDim.x) * kThreads;
  float amax = 0.0f;
  // kManyUnroll loads in flight per thread, then their values.
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; base < vectors;
       base += kManyUnroll * stride) {
    uint4 raw[kManyUnroll];
#pragma unroll
    for (int u = 0; u < kManyUnroll; ++u) {
      const int64_t i = base + u * stride;
      raw[u] = i < vectors ? LoadStreaming(x + i * kVec) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kManyUnroll; ++u) {
      float v[kVec];
      Unpack<T>(raw[u], v);
#pragma unroll
      for (int j = 0; j < kVec; ++j) amax = isfinite(v[j]) ? fmaxf(amax, fabsf(v[j])) : amax;
    }
  }
  if (blockIdx.x == 0 && threadIdx.x < n - vectors * kVec) {
    const float v = ToFloat(x[vectors * kVec + threadIdx.x]);
    amax = isfinite(v) ? fmaxf(amax, fabsf(v)) : amax;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
  __shared__ float warp_amax[kThreads / 32];
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
  __syncthreads();
  if (threadIdx.x == 0) {
#pragma unroll
    for (int w = 1; w < kThreads / 32; ++w) amax = fmaxf(amax, warp_amax[w]);
    atomicMax(amax_bits, __float_as_uint(amax));
  }
}

__global__ void __launch_bounds__(1) FinishGlobalScale(float* global_scale) {
  const float amax = __uint_as_float(*reinterpret_cast<const uint32_t*>(global_scale));
  *global_scale = __fdiv_rn(fmaxf(amax, kAmaxFloor), kNvfp4GlobalDivisor);
}

// v / d correctly rounded, from d's correctly rounded reciprocal r: q = v * r is within an ulp, the residual
// v - q * d is exact in an FMA, and q + residual * r rounds to v / d (Markstein's theorem) when nothing underflows
// or overflows, i.e. for |v| >= 2^-100 where d and the block's largest quotient are far from both ends
// (`MarksteinBlock`). The sign of the result is not kept for zeros: the codes take v's sign (`E2m1CodeOf`).
__device__ __forceinline__ float MarksteinQuotient(float v, float d, float r) {
  const float q = __fmul_rn(v, r);
  return __fmaf_rn(__fmaf_rn(-q, d, v), r, q);
}

// Whether a block divided by d may take the straight-line path (`MarksteinQuotient`, then `E2m1CodeOf`) for every
// value: d in [2^-60, 2^100] and amax / d at most 6.5. Values with |v| >= 2^-100 then get v / d exactly; smaller
// ones have |v / d| < 2^-40, as has their inexact quotient, and both are E2M1 magnitude 0. The bound keeps every
// quotient below 7, where `E2m1CodeOf` is exact; a scale rounded to E4M3 leaves amax / d at most 6 * 17 / 16, so
// only blocks whose scale saturated or became subnormal take the exact per-value path.
__device__ __forceinline__ bool MarksteinBlock(float d, float r, float amax) {
  return d >= 0x1p-60f && d <= 0x1p100f && __fmul_rn(amax, r) <= 6.5f;
}

// E2m1Code (quant_mx.h) of a quotient q with |q| < 7 of a value whose float32 bits are v_bits, on the FMA pipe: the
// sign is v's (the reference's quotient has v's sign, also when it is zero). Where the E2M1 grid has one step, an FMA
// puts the code into the low bits of 2^23 + code, rounding once half to even: 2 |q| + 2^23 on [0, 2) (step 0.5,
// codes 0-4), |q| + 2^23 + 2 on [2, 4) (step 1, codes 4-6), |q| / 2 + 2^23 + 4 on [4, 7) (step 2, codes 6-7). On each
// range its line is the lowest of the three (they meet at 2 and 4), so their minimum holds the code: checked for
// every float32 in [0, 7) against the reference's rounding.
__device__ __forceinline__ uint32_t E2m1CodeOf(float q, uint32_t v_bits) {
  const float t = fabsf(q);
  const float c = fminf(fminf(__fmaf_rn(t, 2.0f, 0x1p23f), __fmaf_rn(t, 1.0f, 0x1p23f + 2.0f)),
                        __fmaf_rn(t, 0.5f, 0x1p23f + 4.0f));
  return (__float_as_uint(c) & 7u) | ((v_bits >> 28) & 8u);
}

// How an NVFP4 block of T is spread over lanes: a 2-byte block (32 bytes) is one lane's two 16-byte loads, so the
// block's scale is worked out once, not by each lane holding part of it; a float32 block is four lanes' loads.
template <typename T>
struct Nvfp4Lanes {
  static constexpr int kVec = 16 / sizeof(T);                     // values per 16-byte load
  static constexpr int kLoads = sizeof(T) == 2 ? 2 : 1;           // 16-byte loads per lane
  static constexpr int kPerLane = kVec * kLoads;                  // 16 or 4
  static constexpr int kLanes = kNvfp4Block / kPerLane;           // 1 or 4
  static constexpr int kPerPass = kThreads / kLanes;              // blocks per pass of a thread block
  static constexpr int kUnrollMany = kManyUnroll / kLoads;        // kManyUnroll 16-byte loads in flight per lane
};

// Blocks of 16 values enumerated row-major (the scale index is the block index).
template <typename T, int kUnroll>
__global__ void __launch_bounds__(kThreads) QuantizeNvfp4Kernel(const T* __restrict__ x,
                                                                const float* __restrict__ global_scale,
                                                                uint8_t* __restrict__ x_q,
                                                                uint8_t* __restrict__ x_sf, int64_t num_blocks) {
  using L = Nvfp4Lanes<T>;
  constexpr int kVec = L::kVec, kLoads = L::kLoads, kPerLane = L::kPerLane, kLanes = L::kLanes;
  const int lane = threadIdx.x % kLanes;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * (L::kPerPass * kUnroll) + threadIdx.x / kLanes;

  uint4 raw[kUnroll][kLoads];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t f = first + static_cast<int64_t>(u) * L::kPerPass;
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      raw[u][l] = f < num_blocks ? LoadStreaming(x + f * kNvfp4Block + lane * kPerLane + l * kVec)
                                 : make_uint4(0, 0, 0, 0);
    }
  }
  const float gs = __ldg(global_scale);
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t f = first + static_cast<int64_t>(u) * L::kPerPass;
    float v[kPerLane];
#pragma unroll
    for (int l = 0; l < kLoads; ++l) Unpack<T>(raw[u][l], v + l * kVec);
    float amax = 0.0f;
    int finite = 1;
    if constexpr (sizeof(T) == 2) {
      AmaxOfHalves<T, kLoads, kLanes>(raw[u], amax, finite);
    } else {
      FoldAmax<kPerLane>(v, amax, finite);
      ReduceAmaxOverLanes<kLanes / 2>(amax, finite);
    }
    if (f >= num_blocks) continue;
    uint8_t packed[kPerLane / 2];
    uint32_t scale = kE4m3NaN;
    if (finite) {
      const float ratio = __fdiv_rn(__fdiv_rn(amax, kE2m1Max), gs);
      scale = FloatToE4m3Device(ratio > 0.0f ? fminf(ratio, kE4m3Max) : 0.0f);
      const float denom = __fmul_rn(E4m3ToFloatDevice(scale), gs);
      const float recip = __frcp_rn(denom);
      uint32_t code[kPerLane];
      if (MarksteinBlock(denom, recip, amax)) {  // every block of a usual tensor: straight-line code
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
          code[i] = E2m1CodeOf(MarksteinQuotient(v[i], denom, recip), __float_as_uint(v[i]));
        }
      } else {
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
          const float q = denom > 0.0f ? __fdiv_rn(v[i], denom) : 0.0f;
          code[i] = E2m1Code(q, __float_as_uint(q));
        }
      }
#pragma unroll
      for (int i = 0; i < kPerLane; i += 2) packed[i / 2] = static_cast<uint8_t>(code[i] | (code[i + 1] << 4));
    } else {
#pragma unroll
      for (int i = 0; i < kPerLane / 2; ++i) packed[i] = 0;
    }
    StoreBytes<kPerLane / 2>(x_q + f * (kNvfp4Block / 2) + lane * (kPerLane / 2), packed);
    if (lane == 0) x_sf[f] = static_cast<uint8_t>(scale);
  }
}

// One thread per block of 16 values: 8 bytes of codes, one scale byte, 16 outputs.
template <typename OutT>
__global__ void __launch_bounds__(kThreads) DequantizeNvfp4Kernel(const uint8_t* __restrict__ x_q,
                                                                  const uint8_t* __restrict__ x_sf,
                                                                  const float* __restrict__ global_scale,
                                                                  OutT* __restrict__ out, int64_t num_blocks) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (t >= num_blocks) return;
  const float gs = __ldg(global_scale);
  const float scale = E4m3ToFloatDevice(x_sf[t]);
  const uint2 raw = __ldg(reinterpret_cast<const uint2*>(x_q) + t);
  const uint32_t words[2] = {raw.x, raw.y};
  float v[kNvfp4Block];
#pragma unroll
  for (int i = 0; i < kNvfp4Block; ++i) {
    const uint32_t code = (words[i / 8] >> (4 * (i % 8))) & 0xFu;
    v[i] = CanonicalNaN(__fmul_rn(__fmul_rn(E2m1Value(code), scale), gs));
  }
  StoreOut<OutT, kNvfp4Block>(out + t * kNvfp4Block, v);
}

int64_t Ceil(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

cudaError_t LaunchQuantizeMxfp8(cudaStream_t stream, InputType type, const void* x, uint8_t* x_q, uint8_t* x_sf,
                                int64_t m, int64_t k, int64_t cols) {
  if (m == 0 || cols == 0) return cudaSuccess;
  if (k % kMxBlock != 0) {
    const int64_t grid = Ceil(m * cols, kThreads);
    if (grid > 0x7FFFFFFF) return cudaErrorInvalidValue;
    switch (type) {
      case InputType::kBF16:
        QuantizeMxfp8AnyKernel<<<grid, kThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(x), x_q, x_sf, m,
                                                              k, cols);
        break;
      case InputType::kF16:
        QuantizeMxfp8AnyKernel<<<grid, kThreads, 0, stream>>>(static_cast<const __half*>(x), x_q, x_sf, m, k, cols);
        break;
      default:
        QuantizeMxfp8AnyKernel<<<grid, kThreads, 0, stream>>>(static_cast<const float*>(x), x_q, x_sf, m, k, cols);
        break;
    }
    return cudaGetLastError();
  }
  const int64_t blocks_per_row = k / kMxBlock, num_blocks = m * blocks_per_row;
  auto launch = [&](auto* typed) -> cudaError_t {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(typed)>>;
    constexpr int64_t kPerPass = kThreads / (kMxBlock / (16 / sizeof(T)));
    const int64_t many = Ceil(num_blocks, kPerPass * kManyUnroll);
    if (many >= kMinBlocks) {
      if (many > 0x7FFFFFFF) return cudaErrorInvalidValue;
      QuantizeMxfp8Kernel<T, kManyUnroll><<<many, kThreads, 0, stream>>>(typed, x_q, x_sf, num_blocks,
                                                                         blocks_per_row, cols);
    } else {
      QuantizeMxfp8Kernel<T, 1><<<Ceil(num_blocks, kPerPass), kThreads, 0, stream>>>(typed, x_q, x_sf, num_blocks,
                                                                                     blocks_per_row, cols);
    }
    return cudaGetLastError();
  };
  switch (type) {
    case InputType::kBF16: return launch(static_cast<const __nv_bfloat16*>(x));
    case InputType::kF16: return launch(static_cast<const __half*>(x));
    default: return launch(static_cast<const float*>(x));
  }
}

cudaError_t LaunchDequantizeMxfp8(cudaStream_t stream, OutputType type, const uint8_t* x_q, const uint8_t* x_sf,
                                  void* out, int64_t m, int64_t k, int64_t cols) {
  if (m == 0) return cudaSuccess;
  auto launch = [&](auto* typed) -> cudaError_t {
    if (k % 16 == 0) {
      const int64_t pieces = m * (k / 16), grid = Ceil(pieces, kThreads);
      if (grid > 0x7FFFFFFF) return cudaErrorInvalidValue;
      DequantizeMxfp8Kernel<<<grid, kThreads, 0, stream>>>(x_q, x_sf, typed, pieces, k / 16, cols);
    } else {
      const int64_t grid = Ceil(m * k, kThreads);
      if (grid > 0x7FFFFFFF) return cudaErrorInvalidValue;
      DequantizeMxfp8AnyKernel<<<grid, kThreads, 0, stream>>>(x_q, x_sf, typed, m, k, cols);
    }
    return cudaGetLastError();
  };
  switch (type) {
    case OutputType::kBF16: return launch(static_cast<__nv_bfloat16*>(out));
    case OutputType::kF16: return launch(static_cast<__half*>(out));
    default: return launch(static_cast<float*>(out));
  }
}

cudaError_t LaunchNvfp4GlobalScale(cudaStream_t stream, InputType type, const void* x, int64_t n,
                                   float* global_scale) {
  auto* bits = reinterpret_cast<uint32_t*>(global_scale);
  ZeroWord<<<1, 1, 0, stream>>>(bits);
  if (n > 0) {
    auto launch = [&](auto* typed) {
      using T = std::remove_const_t<std::remove_pointer_t<decltype(typed)>>;
      const int64_t vectors = n / (16 / sizeof(T));
      const int grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(Ceil(vectors, kThreads * kManyUnroll),
                                                                                kMaxAmaxBlocks)));
      FiniteAmaxKernel<<<grid, kThreads, 0, stream>>>(typed, n, bits);
    };
    switch (type) {
      case InputType::kBF16: launch(static_cast<const __nv_bfloat16*>(x)); break;
      case InputType::kF16: launch(static_cast<const __half*>(x)); break;
      default: launch(static_cast<const float*>(x)); break;
    }
  }
  FinishGlobalScale<<<1, 1, 0, stream>>>(global_scale);
  return cudaGetLastError();
}

cudaError_t LaunchQuantizeNvfp4(cudaStream_t stream, InputType type, const void* x, const float* global_scale,
                                uint8_t* x_q, uint8_t* x_sf, int64_t m, int64_t k) {
  const int64_t num_blocks = m * (k / kNvfp4Block);
  if (num_blocks == 0) return cudaSuccess;
  auto launch = [&](auto* typed) -> cudaError_t {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(typed)>>;
    using L = Nvfp4Lanes<T>;
    const int64_t many = Ceil(num_blocks, L::kPerPass * L::kUnrollMany);
    if (many >= kMinBlocks) {
      if (many > 0x7FFFFFFF) return cudaErrorInvalidValue;
      QuantizeNvfp4Kernel<T, L::kUnrollMany><<<many, kThreads, 0, stream>>>(typed, global_scale, x_q, x_sf,
                                                                            num_blocks);
    } else {
      QuantizeNvfp4Kernel<T, 1><<<Ceil(num_blocks, L::kPerPass), kThreads, 0, stream>>>(typed, global_scale, x_q,
                                                                                        x_sf, num_blocks);
    }
    return cudaGetLastError();
  };
  switch (type) {
    case InputType::kBF16: return launch(static_cast<const __nv_bfloat16*>(x));
    case InputType::kF16: return launch(static_cast<const __half*>(x));
    default: return launch(static_cast<const float*>(x));
  }
}

cudaError_t LaunchDequantizeNvfp4(cudaStream_t stream, OutputType type, const uint8_t* x_q, const uint8_t* x_sf,
                                  const float* global_scale, void* out, int64_t m, int64_t k) {
  const int64_t num_blocks = m * (k / kNvfp4Block);
  if (num_blocks == 0) return cudaSuccess;
  const int64_t grid = Ceil(num_blocks, kThreads);
  if (grid > 0x7FFFFFFF) return cudaErrorInvalidValue;
  switch (type) {
    case OutputType::kBF16:
      DequantizeNvfp4Kernel<<<grid, kThreads, 0, stream>>>(x_q, x_sf, global_scale, static_cast<__nv_bfloat16*>(out),
                                                           num_blocks);
      break;
    case OutputType::kF16:
      DequantizeNvfp4Kernel<<<grid, kThreads, 0, stream>>>(x_q, x_sf, global_scale, static_cast<__half*>(out),
                                                           num_blocks);
      break;
    default:
      DequantizeNvfp4Kernel<<<grid, kThreads, 0, stream>>>(x_q, x_sf, global_scale, static_cast<float*>(out),
                                                           num_blocks);
      break;
  }
  return cudaGetLastError();
}

}  // namespace jax_moe_a2a
