// grouped_gemm_fp8_wgrad_wgmma_sm90.cu -- the FP8 weight gradient of grouped_gemm_wgrad_kernels.cuh written directly
// on Hopper's TMA and wgmma (sm_90a): d[g] = A_g · B_gᵀ over each group's 128-token blocks. Chosen by
// JAX_MOE_A2A_FP8_GEMM_KERNEL=wgmma, not the default: docs/PERFORMANCE.md has its speed beside the CUTLASS kernel's.
//
// NOTES:
// - Every group has the same (na / 128) x (nb / 128) output tiles, so the tile count is known on the host; a
//   group's K blocks (its padded token columns) come from a table a setup kernel writes. A group without rows runs
//   no K block and stores zeros, so no separate zero fill is needed.
// - One TMA descriptor per operand over the whole array (a_t [na, p], b_t [nb, p]) and one per scale array
//   (a_sf_t [p/128, na], b_sf_t [p/128, nb], MN-major: a K block's 128 scales of a tile are one 512-byte row
//   piece): a stage holds the two 128x128 E4M3 blocks and their two scale vectors.
// - Both operands are scaled per row per 128 tokens, so every accumulator value gets its own product of a row scale
//   and a column scale at each promotion (64 multiplies and 64 fused multiply-adds a thread a K block, twice the
//   forward GEMM's share).
// - Persistent CTAs, one producer thread and two consumer warpgroups, and pairs of CTAs sharing A by multicast, as
//   in grouped_gemm_fp8_wgmma_sm90.cu; tiles are numbered group by group, row block by row block, so the CTAs
//   working at one time share a group's operands.
// - A tile runs few K blocks (8 at 1024 tokens a group), so its epilogue matters: a warpgroup stages its 64x128
//   output block in shared memory and writes it with TMA stores that run while it starts the next tile.
// - The two consumer warpgroups issue their K blocks' wgmma in turn (two named barriers pass the turn), so the
//   tensor cores run one warpgroup's multiply while the other promotes, instead of both multiplying and then both
//   promoting. The forward kernel, two 64-row waves a warpgroup, was measured slower with turns and has none.
#include <algorithm>
#include <cstdint>
#include <string>

#include <cuda_bf16.h>

#include "grouped_gemm_sm90_common.cuh"
#include "grouped_gemm_wgrad_kernels.cuh"
#include "wgmma_sm90.cuh"

namespace jax_moe_a2a {

namespace {

constexpr int kBlock = 128;  // rows and columns of a tile, tokens of a K block
constexpr int kConsumers = 2;
constexpr int kThreads = 128 * (1 + kConsumers);
constexpr int kConsumerWarps = 4 * kConsumers;
// Named barriers 1 and 2 are the consumers' epilogue barriers; 3 and 4 pass the turn to issue wgmma to warpgroup 1
// and 2 (consumer 0 and 1).
constexpr int kTurnBarrier = 3;
constexpr uint32_t kStageBytes = 2 * kBlock * kBlock + 2 * kBlock * sizeof(float);
constexpr int kSetupThreads = 256;

// Stages of the ring: as many as fit beside the output staging (f32: 64 KB, bf16: 32 KB) in 227 KB.
template <typename OutT>
constexpr int kStagesOf = sizeof(OutT) == 4 ? 4 : 5;

template <typename OutT>
struct alignas(1024) SharedStorage {
  uint8_t a[kStagesOf<OutT>][kBlock * kBlock];  // 1024-byte aligned blocks: the 128-byte swizzle's period
  uint8_t b[kStagesOf<OutT>][kBlock * kBlock];
  uint8_t d[kConsumers][wgmma::StagedBlock<OutT>::kBytes];  // each consumer's output block, staged for TMA stores
  float a_scale[kStagesOf<OutT>][kBlock];
  float b_scale[kStagesOf<OutT>][kBlock];
  uint64_t full[kStagesOf<OutT>];
  uint64_t empty[kStagesOf<OutT>];
};
template <typename OutT>
constexpr size_t kSharedBytes = sizeof(SharedStorage<OutT>) + 1024;

// The per-group table: first 128-token block and number of blocks.
struct KTable {
  int32_t* k_blocks;  // [G] ceil(size_g / 128) of the clamped sizes
  int32_t* k_start;   // [G] running sum of k_blocks
};

size_t CarveTable(char* base, int64_t num_groups, KTable* t) {
  size_t offset = 0;
  sm90::TakeScratch(base, &offset, num_groups, &t->k_blocks);
  sm90::TakeScratch(base, &offset, num_groups, &t->k_start);
  return offset;
}

// One block: sizes clamped against the quantizer's rows p - 128 G (starts saturating there), then their 128-token
// block counts and the counts' running sum.
__global__ void __launch_bounds__(kSetupThreads) SetupKernel(GroupedGemmFp8WgradArgs args, KTable t) {
  const int64_t rows = args.p - kBlock * args.num_groups;
  sm90::ScanGroupSizes<kSetupThreads>(args.group_sizes, args.num_groups, [&](int64_t grp, int64_t requested,
                                                                             int64_t before) {
    const int64_t start = min(before, rows);
    const int64_t size = min(requested, rows - start);
    t.k_blocks[grp] = static_cast<int32_t>((size + kBlock - 1) / kBlock);
  });
  __syncthreads();
  sm90::ScanGroupSizes<kSetupThreads>(t.k_blocks, args.num_groups, [&](int64_t grp, int64_t, int64_t before) {
    t.k_start[grp] = static_cast<int32_t>(before);
  });
}

struct WgradParams {
  KTable table;
  int64_t num_groups;
  int32_t na;
  int32_t nb;
};

// kPair: a cluster of two CTAs takes the two column blocks 2c and 2c + 1 of one row block of a group; each loads
// half of the shared A block and multicasts it to both (as in grouped_gemm_fp8_wgmma_sm90.cu).
template <typename OutT, bool kPair>
__global__ void __launch_bounds__(kThreads, 1)
    WgmmaWgradKernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                     const __grid_constant__ CUtensorMap map_a_scale, const __grid_constant__ CUtensorMap map_b_scale,
                     const __grid_constant__ CUtensorMap map_d, const WgradParams p) {
  using wgmma::Barrier;
  constexpr int kCtas = kPair ? 2 : 1;
  extern __shared__ uint8_t raw_shared[];
  auto& s = wgmma::AlignedShared<SharedStorage<OutT>>(raw_shared);

  const int warpgroup = wgmma::WarpgroupIndex();
  const uint32_t rank = kPair ? cute::block_rank_in_cluster() : 0;
  wgmma::InitRing<kStagesOf<OutT>, kCtas>(s.full, s.empty, kConsumerWarps);

  // Units of work: one tile, or (kPair) the two tiles of a cluster; numbered group by group, row block by row block.
  const int32_t col_units = p.nb / kBlock / kCtas;
  const int64_t units_per_group = static_cast<int64_t>(p.na / kBlock) * col_units;
  const int64_t units = p.num_groups * units_per_group;
  const int64_t first_unit = blockIdx.x / kCtas, unit_stride = gridDim.x / kCtas;
  wgmma::Slot<kStagesOf<OutT>> slot;

  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<wgmma::kProducerRegisters>();
    if (threadIdx.x == 0) {
      asm volatile("prefetch.tensormap [%0];" ::"l"(&map_a) : "memory");
      asm volatile("prefetch.tensormap [%0];" ::"l"(&map_b) : "memory");
      for (int64_t unit = first_unit; unit < units; unit += unit_stride) {
        const int64_t group = unit / units_per_group;
        const int32_t in_group = static_cast<int32_t>(unit % units_per_group);
        const int32_t row = (in_group / col_units) * kBlock;
        const int32_t col = ((in_group % col_units) * kCtas + static_cast<int32_t>(rank)) * kBlock;
        const int32_t k0 = __ldg(p.table.k_start + group), k_blocks = __ldg(p.table.k_blocks + group);
        for (int32_t kb = k0; kb < k0 + k_blocks; ++kb) {
          Barrier::wait(&s.empty[slot.stage], slot.phase ^ 1);
          uint64_t* full = &s.full[slot.stage];
          Barrier::arrive_and_expect_tx(full, kStageBytes);
          wgmma::LoadA<kCtas>(&map_a, full, s.a[slot.stage], kb * kBlock, row, rank);
          cute::SM90_TMA_LOAD_2D::copy(&map_b, full, wgmma::kEvictNormal, s.b[slot.stage], kb * kBlock, col);
          cute::SM90_TMA_LOAD_2D::copy(&map_a_scale, full, wgmma::kEvictNormal, s.a_scale[slot.stage], row, kb);
          cute::SM90_TMA_LOAD_2D::copy(&map_b_scale, full, wgmma::kEvictNormal, s.b_scale[slot.stage], col, kb);
          slot.Advance();
        }
      }
    }
    __syncwarp();
  } else {
    cutlass::arch::warpgroup_reg_alloc<wgmma::kConsumerRegisters>();
    const int consumer = warpgroup - 1;
    const wgmma::AccumulatorLayout layout{static_cast<int>(threadIdx.x / 32) % 4, static_cast<int>(threadIdx.x % 32)};
    const int row_in_tile = consumer * 64 + layout.Row();  // and row_in_tile + 8
    float acc[64], part[64];
    bool first_turn = true;
    for (int64_t unit = first_unit; unit < units; unit += unit_stride) {
      const int64_t group = unit / units_per_group;
      const int32_t in_group = static_cast<int32_t>(unit % units_per_group);
      const int32_t row = (in_group / col_units) * kBlock;
      const int32_t col = ((in_group % col_units) * kCtas + static_cast<int32_t>(rank)) * kBlock;
      const int32_t k_blocks = __ldg(p.table.k_blocks + group);
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
      for (int32_t kb = 0; kb < k_blocks; ++kb) {
        Barrier::wait(&s.full[slot.stage], slot.phase);
        // Wait for the other warpgroup to have issued its previous block (warpgroup 1 goes first), issue, and let it
        // issue its next.
        if (consumer == 1 || !first_turn) wgmma::SyncThreads(kTurnBarrier + consumer, 256);
        first_turn = false;
        wgmma::MmaBlock(s.a[slot.stage] + consumer * wgmma::kHalfBlock, s.b[slot.stage], part);
        wgmma::ArriveThreads(kTurnBarrier + 1 - consumer, 256);
        const float scale0 = s.a_scale[slot.stage][row_in_tile], scale1 = s.a_scale[slot.stage][row_in_tile + 8];
        float2 col_scale[16];
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          col_scale[j] = *reinterpret_cast<const float2*>(&s.b_scale[slot.stage][8 * j + layout.Col()]);
        }
        cute::warpgroup_wait<0>();
        wgmma::FenceAccumulators(part);
        if (layout.lane == 0) wgmma::Release<kCtas>(&s.empty[slot.stage]);
        slot.Advance();
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          acc[4 * j + 0] = fmaf(part[4 * j + 0], scale0 * col_scale[j].x, acc[4 * j + 0]);
          acc[4 * j + 1] = fmaf(part[4 * j + 1], scale0 * col_scale[j].y, acc[4 * j + 1]);
          acc[4 * j + 2] = fmaf(part[4 * j + 2], scale1 * col_scale[j].x, acc[4 * j + 2]);
          acc[4 * j + 3] = fmaf(part[4 * j + 3], scale1 * col_scale[j].y, acc[4 * j + 3]);
        }
      }

      // The block goes out by TMA from shared memory, asynchronously: the warpgroup goes on with its next tile while
      // it is written, and waits for the reads of the previous store before staging over it.
      const bool leader = threadIdx.x % 128 == 0;
      if (leader) cute::tma_store_wait<0>();
      wgmma::SyncThreads(1 + consumer, 128);
      wgmma::StageAccumulators<OutT>(s.d[consumer], layout, acc);
      cute::tma_store_fence();
      wgmma::SyncThreads(1 + consumer, 128);
      if (leader) {
        wgmma::StoreStaged<OutT>(&map_d, s.d[consumer], static_cast<int32_t>(group * p.na + row + consumer * 64), col);
      }
    }
    if (threadIdx.x % 128 == 0) cute::tma_store_wait<0>();
    // Warpgroup 1 takes the last turn warpgroup 2 passes it, so that no arrival is left on the barrier.
    if (consumer == 0 && !first_turn) wgmma::SyncThreads(kTurnBarrier, 256);
  }
  if constexpr (kPair) {
    cute::cluster_sync();  // no CTA leaves while its peer may still write its shared memory or signal its barriers
  }
}

// The descriptor of the output d [G * na, nb] of OutT, written in a consumer's StagedBlock boxes.
template <typename OutT>
std::string EncodeOutputMap(CUtensorMap* map, const GroupedGemmFp8WgradArgs& args) {
  constexpr bool kF32 = sizeof(OutT) == 4;
  return wgmma::EncodeMap(map, kF32 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, sizeof(OutT),
                          args.d, args.num_groups * args.na, args.nb, 64, wgmma::StagedBlock<OutT>::kBoxCols, true);
}

// The kernel for an output type and a pairing.
template <typename OutT>
auto* WgradKernel(bool pair) {
  return pair ? WgmmaWgradKernel<OutT, true> : WgmmaWgradKernel<OutT, false>;
}

}  // namespace

size_t GroupedGemmFp8WgradWgmmaScratchBytes(int64_t num_groups) {
  KTable table{};
  return CarveTable(nullptr, num_groups, &table);
}

std::string LaunchGroupedGemmFp8WgradWgmma(cudaStream_t stream, int sm_count, const GroupedGemmFp8WgradArgs& args) {
  if (args.num_groups == 0) return "";
  if (std::string error =
          sm90::ScratchShortfall(args.scratch_bytes, GroupedGemmFp8WgradWgmmaScratchBytes(args.num_groups));
      !error.empty()) {
    return error;
  }
  KTable table{};
  CarveTable(static_cast<char*>(args.scratch), args.num_groups, &table);
  SetupKernel<<<1, kSetupThreads, 0, stream>>>(args, table);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return cudaGetErrorString(err);

  const int64_t k_blocks = args.p / kBlock;
  CUtensorMap map_a, map_b, map_a_scale, map_b_scale;
  if (std::string e = wgmma::EncodeMap(&map_a, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, args.a_t, args.na, args.p, kBlock / 2,
                                       kBlock, true);
      !e.empty()) {
    return e;
  }
  if (std::string e = wgmma::EncodeOperandMap(&map_b, args.b_t, args.nb, args.p); !e.empty()) return e;
  if (std::string e = wgmma::EncodeMap(&map_a_scale, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, args.a_sf_t, k_blocks, args.na,
                                       1, kBlock, false);
      !e.empty()) {
    return e;
  }
  if (std::string e = wgmma::EncodeMap(&map_b_scale, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, args.b_sf_t, k_blocks, args.nb,
                                       1, kBlock, false);
      !e.empty()) {
    return e;
  }
  if (args.num_groups * args.na >= (int64_t{1} << 31)) return "more than 2^31 rows in d";
  CUtensorMap map_d;
  if (std::string e = args.d_bf16 ? EncodeOutputMap<__nv_bfloat16>(&map_d, args) : EncodeOutputMap<float>(&map_d, args);
      !e.empty()) {
    return e;
  }
  WgradParams p;
  p.table = table;
  p.num_groups = args.num_groups;
  p.na = static_cast<int32_t>(args.na);
  p.nb = static_cast<int32_t>(args.nb);
  const bool pair = (args.nb / kBlock) % 2 == 0;  // pairs where the column blocks pair up
  auto* kernel = args.d_bf16 ? WgradKernel<__nv_bfloat16>(pair) : WgradKernel<float>(pair);
  const size_t smem = args.d_bf16 ? kSharedBytes<__nv_bfloat16> : kSharedBytes<float>;
  if (cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      err != cudaSuccess) {
    return cudaGetErrorString(err);
  }
  if (pair) {
    return wgmma::LaunchPairs(kernel, kThreads, smem, sm_count, stream, map_a, map_b, map_a_scale, map_b_scale, map_d,
                              p);
  }
  const int64_t tiles = args.num_groups * (args.na / kBlock) * (args.nb / kBlock);
  kernel<<<static_cast<unsigned>(std::min<int64_t>(sm_count, tiles)), kThreads, smem, stream>>>(
      map_a, map_b, map_a_scale, map_b_scale, map_d, p);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return cudaGetErrorString(err);
  return "";
}

}  // namespace jax_moe_a2a
