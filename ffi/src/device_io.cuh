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

// A 16-byte copy from global to shared memory that bypasses registers and L1 (cp.async.cg); it lands once the
// issuing thread has called WaitCopies, and only that thread may rely on it without a barrier.
__device__ __forceinline__ void CopyAsync16(void* smem, const void* gmem) {
  const auto s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}

// Waits for every CopyAsync16 this thread has issued.
__device__ __forceinline__ void WaitCopies() {
  asm volatile(
      "cp.async.commit_group;\n"
      "cp.async.wait_group 0;" ::: "memory");
}

}  // namespace jax_moe_a2a
