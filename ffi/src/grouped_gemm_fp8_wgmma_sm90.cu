// grouped_gemm_fp8_wgmma_sm90.cu -- the FP8 block-scaled grouped GEMM of grouped_gemm_kernels.cuh written directly on
// Hopper's TMA and wgmma (sm_90a), for groups of more than 64 rows on average. Chosen by
// JAX_MOE_A2A_FP8_GEMM_KERNEL=wgmma, not the default: docs/PERFORMANCE.md has its speed beside the CUTLASS kernel's.
//
// NOTES:
// - One TMA descriptor per operand over the whole array (a: [rows, K], b: [G*N, K]), so a CTA moving from one
//   group to the next changes only coordinates. A tile is 256 rows of one group by 128 columns; its first row is the
//   group's first row plus a multiple of 256, so a group's last tile may read rows of the next group (or the zeros
//   TMA fills past the array): those rows are computed and never stored, and a warpgroup skips the wgmma of a
//   128-row wave whose 64 rows of it all lie past the group.
// - Persistent CTAs, one per SM, three warpgroups: one producer thread issues the TMA loads of a 4-stage ring of
//   256x128 A and 128x128 B blocks (48 KB a stage); two consumer warpgroups each multiply 64 rows of each of the
//   tile's two 128-row waves by its 128 columns with wgmma m64n128k32 (four per 128-deep K block and wave), then
//   promote the block's partial sums into float32 accumulators with the scales a_sf[row, kb] * b_sf[g, nb, kb] (the
//   FP32 promotion every 128 values that the CUTLASS kernel also does). A 256-row tile reads each B block once for
//   twice the rows of a 128-row tile. The producer runs ahead into the next tile while the consumers store one.
// - The epilogue stages a warpgroup's 64x128 bf16 block in shared memory and writes it with TMA stores, which run
//   while the warpgroup goes on with its next tile; a block of which the group owns only some rows is stored row by
//   row from registers.
// - Tiles are numbered row block by row block, the column blocks of a row block consecutive, so the CTAs working
//   at one time share a few row blocks of A and one group's B in L2.
// - A setup kernel turns group_sizes into per-group starts, sizes and the running count of 256-row blocks in the
//   caller's scratch (no host synchronization) and zeroes the output rows no group owns.
#include <algorithm>
#include <cstdint>
#include <string>

#include <cuda_bf16.h>


#include "grouped_gemm_kernels.cuh"
#include "grouped_gemm_sm90_common.cuh"
#include "wgmma_sm90.cuh"

namespace jax_moe_a2a {

namespace {

constexpr int kWaves = 2;              // 128-row halves of a tile, 64 rows of each per consumer warpgroup
constexpr int kBlockM = 128 * kWaves;  // rows of a tile
constexpr int kBlockN = 128;
constexpr int kBlockK = 128;  // one scale block
constexpr int kStages = 4;    // 48 KB each, beside the 32 KB of output staging
constexpr int kConsumers = 2;                       // warpgroups
constexpr int kThreads = 128 * (1 + kConsumers);    // warpgroup 0 produces
constexpr int kConsumerWarps = 4 * kConsumers;
constexpr uint32_t kStageBytes = (kBlockM + kBlockN) * kBlockK;  // E4M3: one byte an element
constexpr int kSetupThreads = 256;
constexpr int kZeroRowsPerBlock = 32;

struct alignas(1024) SharedStorage {
  uint8_t a[kStages][kBlockM * kBlockK];  // each block 1024-byte aligned: the 128-byte swizzle's period
  uint8_t b[kStages][kBlockN * kBlockK];
  uint8_t d[kConsumers][wgmma::StagedBlock<__nv_bfloat16>::kBytes];  // each consumer's 64 output rows, for TMA
  uint64_t full[kStages];   // TMA bytes landed
  uint64_t empty[kStages];  // every consumer warp done reading
};
constexpr size_t kSharedBytes = sizeof(SharedStorage) + 1024;  // + alignment of the dynamic base

// The per-group table the setup kernel writes and the GEMM reads.
struct GroupTable {
  int64_t* row_start;    // [G] first row of the group in a / d
  int32_t* row_count;    // [G]
  int32_t* row_blocks;   // [G] ceil(row_count / kBlockM)
  int32_t* block_start;  // [G + 1] running sum of row_blocks
};

size_t CarveTable(char* base, int64_t num_groups, GroupTable* t) {
  size_t offset = 0;
  sm90::TakeScratch(base, &offset, num_groups, &t->row_start);
  sm90::TakeScratch(base, &offset, num_groups, &t->row_count);
  sm90::TakeScratch(base, &offset, num_groups, &t->row_blocks);
  sm90::TakeScratch(base, &offset, num_groups + 1, &t->block_start);
  return offset;
}

// ---------------------------------------------------------------------------------------------------------------
// Setup
// ---------------------------------------------------------------------------------------------------------------

// Grid: (ceil(rows / kZeroRowsPerBlock) + 1, masked ? num_groups : 1). Block (0, 0) fills the table; blocks
// (x > 0, y) zero the unowned rows of row block x - 1 of matrix y.
__global__ void __launch_bounds__(kSetupThreads) SetupKernel(GroupedGemmFp8Args args, GroupTable t) {
  if (blockIdx.x > 0) {
    sm90::ZeroUnownedRows<kSetupThreads, kZeroRowsPerBlock>(args.group_sizes, args.num_groups, args.rows, args.n,
                                                             args.masked, args.d, blockIdx.x - 1);
    return;
  }
  if (blockIdx.y != 0) return;
  sm90::ScanGroupSizes<kSetupThreads>(args.group_sizes, args.num_groups, [&](int64_t grp, int64_t requested,
                                                                             int64_t before) {
    int64_t start, size;
    sm90::GroupRows(args.masked, args.rows, grp, requested, before, &start, &size);
    t.row_start[grp] = start;
    t.row_count[grp] = static_cast<int32_t>(size);
    t.row_blocks[grp] = static_cast<int32_t>((size + kBlockM - 1) / kBlockM);
  });
  __syncthreads();
  sm90::ScanGroupSizes<kSetupThreads>(t.row_blocks, args.num_groups, [&](int64_t grp, int64_t blocks,
                                                                          int64_t before) {
    t.block_start[grp] = static_cast<int32_t>(before);
    if (grp == args.num_groups - 1) t.block_start[grp + 1] = static_cast<int32_t>(before + blocks);
  });
}

// ---------------------------------------------------------------------------------------------------------------
// The GEMM
// ---------------------------------------------------------------------------------------------------------------

struct GemmParams {
  const float* a_sf;
  const float* b_sf;
  __nv_bfloat16* d;
  GroupTable table;
  int64_t num_groups;
  int64_t total_rows;  // rows of a (all matrices in the masked layout)
  int32_t n;
  int32_t k_blocks;
};

// The group of row block `row_block` and the block's first row within it. `group` is the group of the previous
// tile of this CTA (tiles only move forward), or 0.
__device__ __forceinline__ int64_t GroupOf(const GemmParams& p, int32_t row_block, int64_t group) {
  while (__ldg(p.table.block_start + group + 1) <= row_block) ++group;
  return group;
}

struct TilePos {
  int32_t row_block;
  int32_t col_block;
};

// The row block and column block of `unit` (kCtas column blocks of one row block; this CTA takes column block
// `rank` of them), and `group` moved on to the row block's group.
template <int kCtas>
__device__ __forceinline__ TilePos Locate(const GemmParams& p, int64_t unit, int32_t col_units, uint32_t rank,
                                          int64_t& group) {
  const int32_t row_block = static_cast<int32_t>(unit / col_units);
  group = GroupOf(p, row_block, group);
  return {row_block, static_cast<int32_t>(unit % col_units) * kCtas + static_cast<int32_t>(rank)};
}

// acc += part * scale: scale0 for the thread's first row, scale1 for its row 8 below (wgmma::AccumulatorLayout).
__device__ __forceinline__ void Promote(float (&acc)[64], const float (&part)[64], float scale0, float scale1) {
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    acc[4 * j + 0] = fmaf(part[4 * j + 0], scale0, acc[4 * j + 0]);
    acc[4 * j + 1] = fmaf(part[4 * j + 1], scale0, acc[4 * j + 1]);
    acc[4 * j + 2] = fmaf(part[4 * j + 2], scale1, acc[4 * j + 2]);
    acc[4 * j + 3] = fmaf(part[4 * j + 3], scale1, acc[4 * j + 3]);
  }
}

// kPair: a cluster of two CTAs takes the two column blocks 2c and 2c + 1 of one row block; each loads half of the
// shared 256-row A block and multicasts it to both, so A is read from L2 once per pair (32 KB a CTA a K block
// instead of 48). A stage of either CTA is refilled only when the consumers of both have released it: every
// consumer warp arrives on the empty barrier of both CTAs.
template <bool kPair>
__global__ void __launch_bounds__(kThreads, 1)
    WgmmaGemmKernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                    const __grid_constant__ CUtensorMap map_d, const GemmParams p) {
  using wgmma::Barrier;
  constexpr int kCtas = kPair ? 2 : 1;
  extern __shared__ uint8_t raw_shared[];
  auto& s = wgmma::AlignedShared<SharedStorage>(raw_shared);

  const int warpgroup = wgmma::WarpgroupIndex();
  const uint32_t rank = kPair ? cute::block_rank_in_cluster() : 0;
  wgmma::InitRing<kStages, kCtas>(s.full, s.empty, kConsumerWarps);

  // Units of work: one tile, or (kPair) the two tiles of a cluster.
  const int32_t col_units = p.n / kBlockN / kCtas;
  const int64_t units = static_cast<int64_t>(__ldg(p.table.block_start + p.num_groups)) * col_units;
  const int64_t first_unit = blockIdx.x / kCtas, unit_stride = gridDim.x / kCtas;
  wgmma::Slot<kStages> slot;
  int64_t group = 0;

  if (warpgroup == 0) {
    // Producer: one thread; the warpgroup gives its registers to the consumers first.
    cutlass::arch::warpgroup_reg_dealloc<wgmma::kProducerRegisters>();
    if (threadIdx.x == 0) {
      asm volatile("prefetch.tensormap [%0];" ::"l"(&map_a) : "memory");
      asm volatile("prefetch.tensormap [%0];" ::"l"(&map_b) : "memory");
      for (int64_t unit = first_unit; unit < units; unit += unit_stride) {
        const auto [row_block, col_block] = Locate<kCtas>(p, unit, col_units, rank, group);
        const int32_t row = static_cast<int32_t>(__ldg(p.table.row_start + group) +
                                                 (row_block - __ldg(p.table.block_start + group)) * kBlockM);
        const int32_t b_row = static_cast<int32_t>(group * p.n + col_block * kBlockN);
        for (int32_t kb = 0; kb < p.k_blocks; ++kb) {
          Barrier::wait(&s.empty[slot.stage], slot.phase ^ 1);
          uint64_t* full = &s.full[slot.stage];
          Barrier::arrive_and_expect_tx(full, kStageBytes);
          wgmma::LoadA<kCtas, kBlockM>(&map_a, full, s.a[slot.stage], kb * kBlockK, row, rank);
          cute::SM90_TMA_LOAD_2D::copy(&map_b, full, wgmma::kEvictNormal, s.b[slot.stage], kb * kBlockK, b_row);
          slot.Advance();
        }
      }
    }
    __syncwarp();
  } else {
    cutlass::arch::warpgroup_reg_alloc<wgmma::kConsumerRegisters>();
    // Consumers: warpgroup 1 takes rows [0, 64) of each 128-row wave of a tile, warpgroup 2 rows [64, 128).
    const int consumer = warpgroup - 1;
    const wgmma::AccumulatorLayout layout{static_cast<int>(threadIdx.x / 32) % 4, static_cast<int>(threadIdx.x % 32)};
    const int row_in_wave = consumer * 64 + layout.Row();  // and row_in_wave + 8
    float acc[kWaves][64], part[64];
    for (int64_t unit = first_unit; unit < units; unit += unit_stride) {
      const auto [row_block, col_block] = Locate<kCtas>(p, unit, col_units, rank, group);
      const int32_t row_in_group = (row_block - __ldg(p.table.block_start + group)) * kBlockM;
      const int64_t first_row = __ldg(p.table.row_start + group) + row_in_group;
      const int32_t rows_left = __ldg(p.table.row_count + group) - row_in_group;
      // Waves whose 64 rows of this warpgroup are all past the group are not computed (nor stored).
      bool active[kWaves];
      const float* sa[kWaves][2];
#pragma unroll
      for (int w = 0; w < kWaves; ++w) {
        active[w] = w * 128 + consumer * 64 < rows_left;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          sa[w][h] = p.a_sf + min(first_row + w * 128 + row_in_wave + 8 * h, p.total_rows - 1) * p.k_blocks;
        }
      }
      const float* sb = p.b_sf + (group * (p.n / kBlockN) + col_block) * p.k_blocks;
#pragma unroll
      for (int w = 0; w < kWaves; ++w) {
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[w][i] = 0.0f;
      }
      // The scales of the next K block are loaded while this one is multiplied.
      float next_a[kWaves][2], next_b = __ldg(sb);
#pragma unroll
      for (int w = 0; w < kWaves; ++w) {
        next_a[w][0] = __ldg(sa[w][0]);
        next_a[w][1] = __ldg(sa[w][1]);
      }
      for (int32_t kb = 0; kb < p.k_blocks; ++kb) {
        float a[kWaves][2];
        const float b = next_b;
#pragma unroll
        for (int w = 0; w < kWaves; ++w) {
          a[w][0] = next_a[w][0];
          a[w][1] = next_a[w][1];
        }
        if (kb + 1 < p.k_blocks) {
#pragma unroll
          for (int w = 0; w < kWaves; ++w) {
            next_a[w][0] = __ldg(sa[w][0] + kb + 1);
            next_a[w][1] = __ldg(sa[w][1] + kb + 1);
          }
          next_b = __ldg(sb + kb + 1);
        }
        Barrier::wait(&s.full[slot.stage], slot.phase);
#pragma unroll
        for (int w = 0; w < kWaves; ++w) {
          if (active[w]) {
            wgmma::MmaBlock(s.a[slot.stage] + (2 * w + consumer) * wgmma::kHalfBlock, s.b[slot.stage], part);
            cute::warpgroup_wait<0>();
            wgmma::FenceAccumulators(part);
          }
          if (w == kWaves - 1 && layout.lane == 0) wgmma::Release<kCtas>(&s.empty[slot.stage]);
          if (active[w]) Promote(acc[w], part, a[w][0] * b, a[w][1] * b);
        }
        slot.Advance();
      }

      // Store the rows the group owns: a warpgroup's 64 rows of a wave by TMA from shared memory where the group
      // owns them all (asynchronously: the warpgroup waits for the reads of its previous store before staging over
      // it), else row by row from registers.
      const bool leader = threadIdx.x % 128 == 0;
#pragma unroll
      for (int w = 0; w < kWaves; ++w) {
        const int block_row = w * 128 + consumer * 64;
        if (block_row + 64 <= rows_left) {
          if (leader) cute::tma_store_wait<0>();
          wgmma::SyncThreads(1 + consumer, 128);
          wgmma::StageAccumulators<__nv_bfloat16>(s.d[consumer], layout, acc[w]);
          cute::tma_store_fence();
          wgmma::SyncThreads(1 + consumer, 128);
          if (leader) {
            wgmma::StoreStaged<__nv_bfloat16>(&map_d, s.d[consumer], static_cast<int32_t>(first_row + block_row),
                                              col_block * kBlockN);
          }
        } else if (block_row < rows_left) {
          __nv_bfloat16* d = p.d + first_row * p.n + col_block * kBlockN + layout.Col();
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int row = w * 128 + row_in_wave + 8 * half;
            if (row < rows_left) {
              __nv_bfloat16* out = d + static_cast<int64_t>(row) * p.n;
#pragma unroll
              for (int j = 0; j < 16; ++j) {
                *reinterpret_cast<__nv_bfloat162*>(out + 8 * j) =
                    __floats2bfloat162_rn(acc[w][4 * j + 2 * half], acc[w][4 * j + 2 * half + 1]);
              }
            }
          }
        }
      }
    }
    if (threadIdx.x % 128 == 0) cute::tma_store_wait<0>();
  }
  if constexpr (kPair) {
    cute::cluster_sync();  // no CTA leaves while its peer may still write its shared memory or signal its barriers
  }
}

}  // namespace

size_t GroupedGemmFp8WgmmaScratchBytes(int64_t num_groups) {
  GroupTable table{};
  return CarveTable(nullptr, num_groups, &table);
}

std::string LaunchGroupedGemmFp8Wgmma(cudaStream_t stream, int sm_count, const GroupedGemmFp8Args& args) {
  if (args.rows == 0 || args.num_groups == 0) return "";
  if (std::string error = sm90::ScratchShortfall(args.scratch_bytes, GroupedGemmFp8WgmmaScratchBytes(args.num_groups));
      !error.empty()) {
    return error;
  }
  const int64_t total_rows = args.masked ? args.num_groups * args.rows : args.rows;
  if (total_rows >= (int64_t{1} << 31) || args.num_groups * args.n >= (int64_t{1} << 31)) {
    return "more than 2^31 rows in a or b";
  }
  GroupTable table{};
  CarveTable(static_cast<char*>(args.scratch), args.num_groups, &table);
  const dim3 setup_grid(static_cast<unsigned>((args.rows + kZeroRowsPerBlock - 1) / kZeroRowsPerBlock + 1),
                        args.masked ? static_cast<unsigned>(args.num_groups) : 1u);
  SetupKernel<<<setup_grid, kSetupThreads, 0, stream>>>(args, table);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return cudaGetErrorString(err);

  CUtensorMap map_a, map_b;
  if (std::string e = wgmma::EncodeMap(&map_a, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, args.a, total_rows, args.k,
                                       64, kBlockK, true);
      !e.empty()) {
    return e;
  }
  if (std::string e = wgmma::EncodeOperandMap(&map_b, args.b, args.num_groups * args.n, args.k); !e.empty()) return e;
  CUtensorMap map_d;
  if (std::string e = wgmma::EncodeMap(&map_d, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, args.d, total_rows, args.n, 64,
                                       wgmma::StagedBlock<__nv_bfloat16>::kBoxCols, true);
      !e.empty()) {
    return e;
  }
  GemmParams p;
  p.a_sf = args.a_sf;
  p.b_sf = args.b_sf;
  p.d = static_cast<__nv_bfloat16*>(args.d);
  p.table = table;
  p.num_groups = args.num_groups;
  p.total_rows = total_rows;
  p.n = static_cast<int32_t>(args.n);
  p.k_blocks = static_cast<int32_t>(args.k / kBlockK);

  // Pairs where the column blocks pair up, single CTAs otherwise.
  const bool pair = (args.n / kBlockN) % 2 == 0;
  auto* kernel = pair ? WgmmaGemmKernel<true> : WgmmaGemmKernel<false>;
  if (cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSharedBytes);
      err != cudaSuccess) {
    return cudaGetErrorString(err);
  }
  if (pair) return wgmma::LaunchPairs(kernel, kThreads, kSharedBytes, sm_count, stream, map_a, map_b, map_d, p);
  kernel<<<sm_count, kThreads, kSharedBytes, stream>>>(map_a, map_b, map_d, p);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return cudaGetErrorString(err);
  return "";
}

}  // namespace jax_moe_a2a
