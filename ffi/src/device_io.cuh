// device_io.cuh -- memory primitives shared by the kernels.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_moe_a2a {

// A 16-byte load through the read-only path that does not allocate in L1: for data read once per kernel and
// never written during it.
__device__ __forceinline__ uint4 LoadStreaming(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

}  // namespace jax_moe_a2a
