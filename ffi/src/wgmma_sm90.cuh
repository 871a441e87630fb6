// wgmma_sm90.cuh -- the building blocks of the GEMM kernels written directly on Hopper's TMA and wgmma (sm_90a):
// TMA descriptors, shared-memory matrix descriptors, the E4M3 wgmma of a 64x128 accumulator, the ring of stages a
// producer thread fills and the consumer warpgroups drain, and the launch of clusters of two CTAs.
//
// NOTES:
// - Operand blocks are K-major, 128 bytes (128 E4M3 values) along K per row, written by TMA with the 128-byte
//   swizzle: the canonical layout wgmma reads with a descriptor of 8-row atoms 1024 bytes apart. Each block must
//   start at a multiple of 1024 bytes (the swizzle's period).
// - The PTX wrappers (wgmma, mbarrier, TMA copy, register re-division) are CUTLASS's cute/arch and cutlass/arch
//   headers; only the scheduling around them is ours.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "cute/arch/cluster_sm90.hpp"
#include "cute/arch/copy_sm90_desc.hpp"
#include "cute/arch/copy_sm90_tma.hpp"
#include "cute/arch/mma_sm90_desc.hpp"
#include "cute/arch/mma_sm90_gmma.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"
#include "cutlass/cuda_host_adapter.hpp"

namespace jax_moe_a2a::wgmma {

using Barrier = cutlass::arch::ClusterTransactionBarrier;

constexpr uint64_t kEvictNormal = static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL);

// Per-thread registers after a kernel of one producer warpgroup and two consumer warpgroups re-divides the register
// file: 128 * 40 + 256 * 232 <= 65536.
constexpr int kProducerRegisters = 40;
constexpr int kConsumerRegisters = 232;

// A 2D TMA descriptor of a row-major [rows, cols] array of `type` (elements of elem_bytes) read in boxes of
// box_rows x box_cols, with the 128-byte swizzle or none. Returns "" or what failed.
inline std::string EncodeMap(CUtensorMap* map, CUtensorMapDataType type, int elem_bytes, const void* base,
                             int64_t rows, int64_t cols, uint32_t box_rows, uint32_t box_cols, bool swizzle_128b) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols * elem_bytes)};
  const cuuint32_t box[2] = {box_cols, box_rows};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult result = CUTLASS_CUDA_DRIVER_WRAPPER_CALL(cuTensorMapEncodeTiled)(
      map, type, 2, const_cast<void*>(base), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      swizzle_128b ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (result != CUDA_SUCCESS) return "cuTensorMapEncodeTiled failed with CUresult " + std::to_string(result);
  return "";
}

// The descriptor of an E4M3 operand array [rows, cols] read in 128x128 swizzled blocks.
inline std::string EncodeOperandMap(CUtensorMap* map, const void* base, int64_t rows, int64_t cols) {
  return EncodeMap(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, base, rows, cols, 128, 128, true);
}

// A shared-memory matrix descriptor of a K-major block written by TMA with the 128-byte swizzle.
__device__ __forceinline__ uint64_t SmemDescriptor(const void* smem) {
  cute::GmmaDescriptor desc;
  desc.bitfield.start_address_ = static_cast<uint16_t>(cute::cast_smem_ptr_to_uint(smem) >> 4);
  desc.bitfield.leading_byte_offset_ = 1;            // unused with a swizzled K-major layout
  desc.bitfield.stride_byte_offset_ = 1024 >> 4;     // from one 8-row atom to the next
  desc.bitfield.base_offset_ = 0;
  desc.bitfield.layout_type_ = static_cast<uint8_t>(cute::GMMA::LayoutType::B128);
  return desc.desc_;
}

template <size_t... I>
__device__ __forceinline__ void Mma64x128x32(uint64_t desc_a, uint64_t desc_b, float (&d)[64], bool accumulate,
                                             std::index_sequence<I...>) {
  cute::SM90::GMMA::MMA_64x128x32_F32E4M3E4M3_SS_TN<>::fma(
      desc_a, desc_b, d[I]..., accumulate ? cute::GMMA::ScaleOut::One : cute::GMMA::ScaleOut::Zero);
}

// Keeps the compiler from moving accesses of d across the asynchronous wgmma that writes it.
__device__ __forceinline__ void FenceAccumulators(float (&d)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) cute::warpgroup_fence_operand(d[i]);
}

// d = A·Bᵀ over one 128-deep K block: A 64 rows at smem_a, B 128 rows at smem_b, both swizzled K-major blocks.
// Enqueued, not waited for: cute::warpgroup_wait<0>() and FenceAccumulators(d) before d is read.
__device__ __forceinline__ void MmaBlock(const uint8_t* smem_a, const uint8_t* smem_b, float (&d)[64]) {
  FenceAccumulators(d);
  cute::warpgroup_arrive();
  const uint64_t desc_a = SmemDescriptor(smem_a);
  const uint64_t desc_b = SmemDescriptor(smem_b);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    // 32 bytes further along K: 2 in the descriptor's 16-byte units.
    Mma64x128x32(desc_a + 2 * kk, desc_b + 2 * kk, d, kk > 0, std::make_index_sequence<64>{});
  }
  cute::warpgroup_commit_batch();
}

// The kernel's shared storage at the first multiple of 1024 bytes (the 128-byte swizzle's period) of the dynamic
// shared memory, which is allocated with 1024 bytes to spare.
template <typename Storage>
__device__ __forceinline__ Storage& AlignedShared(uint8_t* raw) {
  return *reinterpret_cast<Storage*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t{1023});
}

// Initializes a ring of kStages stages: full[i] waits for the producer's arrival and the TMA bytes, empty[i] for one
// arrival from every consumer warp of the kCtas CTAs of the cluster; every thread of the CTA calls it, and no one
// signals a barrier (of this CTA or of the cluster's other) before all are initialized.
template <int kStages, int kCtas>
__device__ __forceinline__ void InitRing(uint64_t* full, uint64_t* empty, int consumer_warps) {
  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      Barrier::init(&full[i], 1);
      Barrier::init(&empty[i], consumer_warps * kCtas);
    }
    cutlass::arch::fence_barrier_init();
  }
  if constexpr (kCtas > 1) {
    cute::cluster_sync();
  } else {
    __syncthreads();
  }
}

// Bytes of 64 rows of a 128x128 E4M3 block: the box of an A operand's descriptor.
constexpr int kHalfBlock = 64 * 128;

// Enqueues the TMA load of the kRows-row A block (a multiple of 64) at column k, row `row` of map_a (a 64-row box)
// into smem_a, completing on `full`: with kCtas == 2 this CTA loads its half (`rank`) into both CTAs of its pair,
// else all of it.
template <int kCtas, int kRows = 128>
__device__ __forceinline__ void LoadA(const CUtensorMap* map_a, uint64_t* full, uint8_t* smem_a, int32_t k, int32_t row,
                                      uint32_t rank) {
  constexpr int kBoxes = kRows / 64;
  static_assert(kRows % 64 == 0 && kBoxes % kCtas == 0, "A blocks are loaded in 64-row boxes, evenly per CTA");
  constexpr int kMine = kBoxes / kCtas;
#pragma unroll
  for (int i = 0; i < kMine; ++i) {
    const int box = static_cast<int>(rank) * kMine + i;
    if constexpr (kCtas == 2) {
      cute::SM90_TMA_LOAD_MULTICAST_2D::copy(map_a, full, 0b11, kEvictNormal, smem_a + box * kHalfBlock, k,
                                             row + box * 64);
    } else {
      cute::SM90_TMA_LOAD_2D::copy(map_a, full, kEvictNormal, smem_a + box * kHalfBlock, k, row + box * 64);
    }
  }
}

// Arrives on the empty barrier of a stage in each of the kCtas CTAs of the cluster (1: this CTA's only).
template <int kCtas>
__device__ __forceinline__ void Release(uint64_t* empty) {
  if constexpr (kCtas == 1) {
    Barrier::arrive(empty);
  } else {
#pragma unroll
    for (uint32_t cta = 0; cta < kCtas; ++cta) Barrier::arrive(empty, cta, 1);
  }
}

// The calling thread's warpgroup, as a value the compiler knows to be the same across the warp (lane 0's, by a
// shuffle), so that what is derived from it (shared-memory addresses, wgmma descriptors) can stay in uniform registers.
__device__ __forceinline__ int WarpgroupIndex() {
  return __shfl_sync(0xFFFFFFFFu, static_cast<int>(threadIdx.x / 128), 0);
}

// A position in a ring of kStages stages, and the parity of the round it is in.
template <int kStages>
struct Slot {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void Advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

// Where a thread's accumulator values lie in the 64x128 block of its warpgroup: value 4 j + 2 h + c is at row
// Row() + 8 h, column 8 j + Col() + c (h, c in {0, 1}, j in [0, 16)).
struct AccumulatorLayout {
  int warp;  // within the warpgroup
  int lane;
  __device__ __forceinline__ int Row() const { return warp * 16 + lane / 4; }
  __device__ __forceinline__ int Col() const { return (lane % 4) * 2; }
};

// A consumer warpgroup's 64x128 output block staged in shared memory for TMA stores: boxes of 64 rows by 128 bytes
// (the widest box the 128-byte swizzle allows), each 1024-byte aligned, the rows' 16-byte chunks swizzled as TMA
// reads them, so the warp's stores of 8 rows x 16 bytes land in 32 distinct banks.
template <typename OutT>
struct StagedBlock {
  static constexpr int kBoxCols = 128 / static_cast<int>(sizeof(OutT));
  static constexpr int kBoxes = 128 / kBoxCols;
  static constexpr int kBoxBytes = 64 * 128;
  static constexpr int kBytes = kBoxes * kBoxBytes;

  // The byte offset of (row, col) of the block.
  __device__ __forceinline__ static uint32_t Offset(int row, int col) {
    const int byte = col * static_cast<int>(sizeof(OutT));
    const int chunk = (byte % 128) / 16;
    return (byte / 128) * kBoxBytes + row * 128 + ((chunk ^ (row % 8)) * 16) + byte % 16;
  }
};

// Every thread of a consumer warpgroup writes its accumulator values (AccumulatorLayout), as OutT (float or bf16),
// into the staged block with shared-memory stores (a generic pointer would make them generic stores).
template <typename OutT>
__device__ __forceinline__ void StageAccumulators(uint8_t* block, const AccumulatorLayout& layout,
                                                  const float (&acc)[64]) {
  static_assert(sizeof(OutT) == 4 || sizeof(OutT) == 2, "float or bf16");
  const uint32_t base = cute::cast_smem_ptr_to_uint(block);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const uint32_t addr = base + StagedBlock<OutT>::Offset(layout.Row() + 8 * half, 8 * j + layout.Col());
      const float x = acc[4 * j + 2 * half], y = acc[4 * j + 2 * half + 1];
      if constexpr (sizeof(OutT) == 4) {
        asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(x), "f"(y));
      } else {
        const __nv_bfloat162 pair = __floats2bfloat162_rn(x, y);
        asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(*reinterpret_cast<const uint32_t*>(&pair)));
      }
    }
  }
}

// One thread: the TMA stores of a staged block to (row, col) of map (boxes of 64 rows by StagedBlock::kBoxCols), as
// one bulk group; wait with cute::tma_store_wait<0>() before the block is written again or the CTA exits.
template <typename OutT>
__device__ __forceinline__ void StoreStaged(const CUtensorMap* map, uint8_t* block, int32_t row, int32_t col) {
#pragma unroll
  for (int b = 0; b < StagedBlock<OutT>::kBoxes; ++b) {
    cute::SM90_TMA_STORE_2D::copy(map, block + b * StagedBlock<OutT>::kBoxBytes, col + b * StagedBlock<OutT>::kBoxCols,
                                  row);
  }
  cute::tma_store_arrive();
}

// bar.sync on named barrier `id` (1..15) for the `threads` threads that use it.
__device__ __forceinline__ void SyncThreads(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// bar.arrive on named barrier `id`: counts the calling threads toward the `threads` a bar.sync on it waits for,
// without waiting.
__device__ __forceinline__ void ArriveThreads(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Launches `kernel` (threads a CTA, smem bytes of dynamic shared memory) on `stream` as clusters of two CTAs along x,
// as many clusters as can be resident at once on the current device (a persistent kernel: more would wait for a
// whole earlier cluster to finish). The count is cached per device and kernel.
template <typename... Params, typename... Args>
std::string LaunchPairs(void (*kernel)(Params...), int threads, size_t smem, int sm_count, cudaStream_t stream,
                        Args&&... args) {
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = 2;
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(sm_count / 2 * 2));
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;

  static std::mutex mu;
  static std::map<std::pair<int, const void*>, int> resident;  // (device, kernel) -> clusters
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return cudaGetErrorString(err);
  int clusters = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    const auto key = std::make_pair(device, reinterpret_cast<const void*>(kernel));
    if (auto it = resident.find(key); it != resident.end()) {
      clusters = it->second;
    } else {
      if (cudaError_t err = cudaOccupancyMaxActiveClusters(&clusters, kernel, &config); err != cudaSuccess) {
        return cudaGetErrorString(err);
      }
      resident[key] = clusters;
    }
  }
  if (clusters < 1) return "no cluster of two CTAs fits on this device";
  config.gridDim = dim3(static_cast<unsigned>(2 * std::min(clusters, sm_count / 2)));
  if (cudaError_t err = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...); err != cudaSuccess) {
    return cudaGetErrorString(err);
  }
  return "";
}

}  // namespace jax_moe_a2a::wgmma
