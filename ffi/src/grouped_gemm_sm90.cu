// grouped_gemm_sm90.cu -- FP8 block-scaled grouped GEMM on Hopper (sm_90a): CUTLASS's pointer-array grouped GEMM
// with blockwise scaling (TMA loads, warp-specialized cooperative wgmma, FP32 promotion of every 128-deep
// K block), fed from device memory by a small setup kernel so that group sizes never reach the host.
//
// NOTES:
// - Scale layouts are K-major for both operands: activation scales [rows, K/128] (what quantization and dispatch
//   produce, so contiguous and masked groups are plain row slices of them), weight scales [N/128, K/128].
//   CUTLASS derives a group's scale layout from its problem shape, so a group's scales must be one compact
//   row-major block -- which row slices of a K-major array are, and slices of an MN-major [K/128, rows] array
//   are not.
// - The setup kernel turns group_sizes into per-group problem shapes, pointers, strides and scale layouts in the
//   caller's scratch buffer; the GEMM reads them there. Groups with no rows produce no tiles.
// - Output rows that no group owns are zeroed by the setup kernel's other blocks; TMA stores clip each group's
//   tiles to its rows, so the GEMM never writes outside a group.
// - Two instantiations serve both layouts (which differ only in the setup): tiles of 128 rows on two cooperative
//   warpgroups, and, when the average group has at most 64 rows (decode), tiles of 64 rows on ping-pong
//   warpgroups. A tile's tensor-core work does not depend on how many of its rows a group fills, so at a few rows
//   per expert the 128-row tiles do twice the work of the 64-row ones for the same weight reads; both read each
//   weight tile once per row tile. Cluster 1x2x1 in both.
// - The scaffolding (per-group arrays carved from scratch, the setup's scan, the cached host-built parameters) is
//   grouped_gemm_sm90_common.cuh's.
#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/numeric_types.h"
#include "cutlass/util/packed_stride.hpp"
#include "grouped_gemm_kernels.cuh"
#include "grouped_gemm_sm90_common.cuh"

namespace jax_moe_a2a {

namespace {

using namespace cute;

// ---------------------------------------------------------------------------------------------------------------
// The kernel type
// ---------------------------------------------------------------------------------------------------------------

using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M, N, K) per group

using ElementA = cutlass::float_e4m3_t;
using ElementB = cutlass::float_e4m3_t;
using ElementD = cutlass::bfloat16_t;
using LayoutA = cutlass::layout::RowMajor;     // [M, K], K contiguous
using LayoutB = cutlass::layout::ColumnMajor;  // [N, K], K contiguous
using LayoutD = cutlass::layout::RowMajor;     // [M, N]
constexpr int kAlignmentA = 16;                // elements per 16-byte access
constexpr int kAlignmentB = 16;
constexpr int kAlignmentD = 8;

using ClusterShape = Shape<_1, _2, _1>;
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128, cute::GMMA::Major::K, cute::GMMA::Major::K>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

// One instantiation of the grouped GEMM: its tile shape and its mainloop and epilogue schedules.
template <class TileShape, class MainloopSchedule, class EpilogueSchedule>
struct Fp8GemmConfig {
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD*, kAlignmentD,  // no C operand
      ElementD, LayoutD*, kAlignmentD, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, cute::tuple<LayoutA*, LayoutSFA*>, kAlignmentA,
      ElementB, cute::tuple<LayoutB*, LayoutSFB*>, kAlignmentB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;

  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
};

// Tiles of 128 rows, two consumer warpgroups on one tile.
using LargeTiles = Fp8GemmConfig<Shape<_128, _128, _128>,
                                 cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise,
                                 cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
// Tiles of 64 rows, the two consumer warpgroups on alternate tiles.
using SmallTiles = Fp8GemmConfig<Shape<_64, _128, _128>,
                                 cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise,
                                 cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>;
// The largest average group (rows per group) that takes SmallTiles.
constexpr int64_t kSmallTileMaxRows = 64;

// The per-group arrays are the same for both instantiations.
using StrideA = typename LargeTiles::GemmKernel::InternalStrideA;
using StrideB = typename LargeTiles::GemmKernel::InternalStrideB;
using StrideD = typename LargeTiles::GemmKernel::InternalStrideD;
static_assert(std::is_same_v<StrideA, typename SmallTiles::GemmKernel::InternalStrideA> &&
              std::is_same_v<StrideB, typename SmallTiles::GemmKernel::InternalStrideB> &&
              std::is_same_v<StrideD, typename SmallTiles::GemmKernel::InternalStrideD>);

// The per-group arrays, carved from the caller's scratch buffer; one setup kernel fills them for both.
using GroupArrays = sm90::GroupArrays<LargeTiles::GemmKernel, ScaleConfig>;
using GroupShape = GroupArrays::GroupShape;

// ---------------------------------------------------------------------------------------------------------------
// Device kernel: setup and zero fill
// ---------------------------------------------------------------------------------------------------------------

constexpr int kSetupThreads = 256;

// Fills the per-group arrays (one block).
__device__ void SetupGroups(const GroupedGemmFp8Args& args, const GroupArrays& g) {
  const int64_t k_blocks = args.k / 128, n_blocks = args.n / 128;
  sm90::ScanGroupSizes<kSetupThreads>(args.group_sizes, args.num_groups, [&](int64_t grp, int64_t requested,
                                                                             int64_t before) {
    int64_t start, size;
    sm90::GroupRows(args.masked, args.rows, grp, requested, before, &start, &size);
    const int m = static_cast<int>(size), n = static_cast<int>(args.n), k = static_cast<int>(args.k);
    g.shapes[grp] = GroupShape(m, n, k);
    g.a[grp] = reinterpret_cast<const ElementA*>(args.a) + start * args.k;
    g.sfa[grp] = args.a_sf + start * k_blocks;
    g.b[grp] = reinterpret_cast<const ElementB*>(args.b) + grp * args.n * args.k;
    g.sfb[grp] = args.b_sf + grp * n_blocks * k_blocks;
    g.d[grp] = reinterpret_cast<ElementD*>(args.d) + start * args.n;
    g.stride_a[grp] = cutlass::make_cute_packed_stride(StrideA{}, make_shape(m, k, 1));
    g.stride_b[grp] = cutlass::make_cute_packed_stride(StrideB{}, make_shape(n, k, 1));
    g.stride_d[grp] = cutlass::make_cute_packed_stride(StrideD{}, make_shape(m, n, 1));
    g.layout_sfa[grp] = ScaleConfig::tile_atom_to_shape_SFA(make_shape(m, n, k, 1));
    g.layout_sfb[grp] = ScaleConfig::tile_atom_to_shape_SFB(make_shape(m, n, k, 1));
  });
}

constexpr int kZeroRowsPerBlock = 32;

// One launch before the GEMM. Grid: (ceil(rows / kZeroRowsPerBlock) + 1, masked ? num_groups : 1); block
// (0, 0) fills the per-group arrays, blocks (x > 0, y) zero rows x - 1 of matrix y.
__global__ void __launch_bounds__(kSetupThreads) PrepareGroupsKernel(GroupedGemmFp8Args args, GroupArrays g) {
  if (blockIdx.x == 0) {
    if (blockIdx.y == 0) SetupGroups(args, g);
    return;
  }
  sm90::ZeroUnownedRows<kSetupThreads, kZeroRowsPerBlock>(args.group_sizes, args.num_groups, args.rows, args.n,
                                                           args.masked, args.d, static_cast<int64_t>(blockIdx.x) - 1);
}

// Whether a call takes the 64-row tiles: its average group (the static row count over the groups) is small.
bool TakesSmallTiles(const GroupedGemmFp8Args& args) {
  const int64_t average_rows = args.masked ? args.rows : args.rows / std::max<int64_t>(args.num_groups, 1);
  return average_rows <= kSmallTileMaxRows;
}

}  // namespace

size_t GroupedGemmFp8ScratchBytes(int64_t num_groups, int sm_count) {
  return std::max({sm90::ScratchBytes<LargeTiles::Gemm, GroupArrays>(num_groups, sm_count),
                   sm90::ScratchBytes<SmallTiles::Gemm, GroupArrays>(num_groups, sm_count),
                   GroupedGemmFp8WgmmaScratchBytes(num_groups)});
}

std::string LaunchGroupedGemmFp8(cudaStream_t stream, int sm_count, const GroupedGemmFp8Args& args) {
  if (args.rows == 0 || args.num_groups == 0) return "";
  bool wgmma = false;
  if (std::string error = sm90::ChosenFp8Kernels(&wgmma); !error.empty()) return error;
  if (wgmma && !TakesSmallTiles(args)) return LaunchGroupedGemmFp8Wgmma(stream, sm_count, args);
  const size_t needed = GroupedGemmFp8ScratchBytes(args.num_groups, sm_count);
  if (std::string error = sm90::ScratchShortfall(args.scratch_bytes, needed); !error.empty()) return error;
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return cudaGetErrorString(err);

  GroupArrays arrays{};
  char* base = static_cast<char*>(args.scratch);
  const size_t array_bytes = sm90::CarveGroupArrays(base, args.num_groups, &arrays);
  const dim3 grid(static_cast<unsigned>((args.rows + kZeroRowsPerBlock - 1) / kZeroRowsPerBlock + 1),
                  args.masked ? static_cast<unsigned>(args.num_groups) : 1u);
  PrepareGroupsKernel<<<grid, kSetupThreads, 0, stream>>>(args, arrays);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return cudaGetErrorString(err);

  const int64_t groups = args.num_groups;
  std::string error =
      TakesSmallTiles(args)
          ? sm90::RunGroupedGemm<SmallTiles::Gemm>(stream, device, sm_count, base, groups, arrays, array_bytes)
          : sm90::RunGroupedGemm<LargeTiles::Gemm>(stream, device, sm_count, base, groups, arrays, array_bytes);
  if (!error.empty()) return error;
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return cudaGetErrorString(err);
  return "";
}

}  // namespace jax_moe_a2a
