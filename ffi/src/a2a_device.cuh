// a2a_device.cuh -- device primitives of the one-sided kernels: memory-ordered loads and stores at system and GPU
// scope, the fence, the global timer, and warp-wide copies (used by a2a_kernels.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_moe_a2a {

__device__ __forceinline__ uint64_t LoadAcquireSys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void StoreReleaseSys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint32_t LoadAcquireSys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void StoreRelaxedSys(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void StoreRelaxedSys(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t LoadRelaxedGpu(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void StoreRelaxedGpu(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void FenceSys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

__device__ __forceinline__ int64_t GlobalTimerNs() {
  int64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Copies `bytes` from src to dst with the 32 lanes of a warp, 16 bytes at a time when alignment allows.
__device__ __forceinline__ void WarpCopy(uint8_t* dst, const uint8_t* src, int64_t bytes, int lane) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) |
                      static_cast<uintptr_t>(bytes);
  if ((a & 15) == 0) {
    // kCopyUnroll independent 16-byte loads in flight per lane before their stores.
    constexpr int kCopyUnroll = 4;
    for (int64_t i = lane * 16; i < bytes; i += 32 * 16 * kCopyUnroll) {
      uint4 v[kCopyUnroll];
#pragma unroll
      for (int u = 0; u < kCopyUnroll; ++u) {
        const int64_t o = i + u * 32 * 16;
        if (o < bytes) v[u] = *reinterpret_cast<const uint4*>(src + o);
      }
#pragma unroll
      for (int u = 0; u < kCopyUnroll; ++u) {
        const int64_t o = i + u * 32 * 16;
        if (o < bytes) *reinterpret_cast<uint4*>(dst + o) = v[u];
      }
    }
  } else if ((a & 3) == 0) {
    for (int64_t i = lane * 4; i < bytes; i += 32 * 4)
      *reinterpret_cast<uint32_t*>(dst + i) = *reinterpret_cast<const uint32_t*>(src + i);
  } else {
    for (int64_t i = lane; i < bytes; i += 32) dst[i] = src[i];
  }
}

__device__ __forceinline__ void WarpZero(uint8_t* dst, int64_t bytes, int lane) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(dst) | static_cast<uintptr_t>(bytes);
  if ((a & 15) == 0) {
    for (int64_t i = lane * 16; i < bytes; i += 32 * 16) *reinterpret_cast<uint4*>(dst + i) = make_uint4(0, 0, 0, 0);
  } else {
    for (int64_t i = lane; i < bytes; i += 32) dst[i] = 0;
  }
}

}  // namespace jax_moe_a2a
