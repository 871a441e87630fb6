// grouped_gemm_wgrad_sm90.cu -- the FP8 weight gradient's grouped GEMM on Hopper (sm_90a): d[g] = A_g · B_gᵀ over each
// group's tokens, with CUTLASS's pointer-array grouped GEMM and blockwise scaling (TMA loads, warp-specialized
// cooperative wgmma, FP32 promotion of every 128-deep K block), the per-group problems built on the device.
//
// NOTES:
// - Both operands are K-major with the tokens as K (quant.quantize_fp8_grouped_kmajor): A_g is the [Na, K_g] window of
//   a_t [Na, P] starting at column off_g (row stride P), B_g likewise of b_t; K_g = round_up(size_g, 128), so every
//   group runs whole 128-deep K blocks and its padding columns are code 0.
// - Scales: one per row of A (and of B) per 128-token block: Sm90BlockwiseScaleConfig<1, 1, 128, MN, MN>, i.e.
//   ScaleMsPerTile = ScaleNsPerTile = 128 in CUTLASS's mainloop. The scale arrays are MN-major [P/128, N]: the
//   group's scales are the rows from off_g / 128 on, a compact block, which is the layout CUTLASS derives from the
//   group's problem shape (K-block stride N).
// - Group offsets come from group_sizes on the device: a one-block setup kernel scans them (sizes clamped against
//   P - 128 G, the quantizer's round_up(M, 128)) and writes shapes, pointers, strides and scale layouts into the
//   caller's scratch buffer. A group without rows gets M = 0 and so no tiles; a second launch zeroes its d[g].
// - One tile shape: 128x128x128 tiles on two cooperative warpgroups, cluster 1x2x1 (weight-gradient problems are
//   Na x Nb per group, thousands by thousands). float32 and bfloat16 outputs are two instantiations.
#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include <cub/block/block_scan.cuh>

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
#include "grouped_gemm_sm90_common.cuh"
#include "grouped_gemm_wgrad_kernels.cuh"

namespace jax_moe_a2a {

namespace {

using namespace cute;

// ---------------------------------------------------------------------------------------------------------------
// The kernel types
// ---------------------------------------------------------------------------------------------------------------

constexpr int64_t kBlock = 128;

using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (Na, Nb, K_g) per group
using GroupShape = ProblemShape::UnderlyingProblemShape;

using ElementA = cutlass::float_e4m3_t;
using ElementB = cutlass::float_e4m3_t;
using LayoutA = cutlass::layout::RowMajor;     // [Na, K], K (tokens) contiguous
using LayoutB = cutlass::layout::ColumnMajor;  // [Nb, K], K contiguous
using LayoutD = cutlass::layout::RowMajor;     // [Na, Nb]
constexpr int kAlignmentA = 16;
constexpr int kAlignmentB = 16;

using TileShape = Shape<_128, _128, _128>;
using ClusterShape = Shape<_1, _2, _1>;
using ScaleConfig =
    cutlass::detail::Sm90BlockwiseScaleConfig<1, 1, 128, cute::GMMA::Major::MN, cute::GMMA::Major::MN>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

template <class ElementD>
struct WgradConfig {
  static constexpr int kAlignmentD = 16 / static_cast<int>(sizeof(ElementD));

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD*, kAlignmentD,  // no C operand
      ElementD, LayoutD*, kAlignmentD, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, cute::tuple<LayoutA*, LayoutSFA*>, kAlignmentA,
      ElementB, cute::tuple<LayoutB*, LayoutSFB*>, kAlignmentB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise>::CollectiveOp;

  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
};

using F32Out = WgradConfig<float>;
using Bf16Out = WgradConfig<cutlass::bfloat16_t>;

using StrideA = typename F32Out::GemmKernel::InternalStrideA;
using StrideB = typename F32Out::GemmKernel::InternalStrideB;
using StrideD = typename F32Out::GemmKernel::InternalStrideD;
static_assert(std::is_same_v<StrideA, typename Bf16Out::GemmKernel::InternalStrideA> &&
              std::is_same_v<StrideB, typename Bf16Out::GemmKernel::InternalStrideB> &&
              std::is_same_v<StrideD, typename Bf16Out::GemmKernel::InternalStrideD>);

// The per-group arrays, carved from the caller's scratch buffer; d is untyped so that one setup kernel serves both
// output types.
using GroupArrays = sm90::GroupArrays<F32Out::GemmKernel, ScaleConfig, void>;

template <class Config>
size_t ScratchBytes(int64_t num_groups, int sm_count) {
  return sm90::ScratchBytes<typename Config::Gemm, GroupArrays>(num_groups, sm_count);
}

// ---------------------------------------------------------------------------------------------------------------
// Device kernels: setup, zero fill of empty groups
// ---------------------------------------------------------------------------------------------------------------

constexpr int kSetupThreads = 256;

// One block: groups in chunks of kSetupThreads with running row and column offsets (int64: at most 65535 int32
// sizes). Row starts saturate at `rows` as quant._clamped_groups does.
__global__ void __launch_bounds__(kSetupThreads) SetupWgradKernel(GroupedGemmFp8WgradArgs args, GroupArrays g) {
  using Scan = cub::BlockScan<int64_t, kSetupThreads>;
  __shared__ typename Scan::TempStorage storage;
  __shared__ int64_t base_rows, base_cols;
  if (threadIdx.x == 0) {
    base_rows = 0;
    base_cols = 0;
  }
  __syncthreads();
  const int64_t rows = args.p - kBlock * args.num_groups;
  const int64_t d_bytes = args.d_bf16 ? 2 : 4;
  for (int64_t first = 0; first < args.num_groups; first += kSetupThreads) {
    const int64_t grp = first + threadIdx.x;
    const int64_t requested = grp < args.num_groups ? max(args.group_sizes[grp], 0) : 0;
    int64_t rows_before = 0, rows_total = 0;
    Scan(storage).ExclusiveSum(requested, rows_before, rows_total);
    const int64_t start = min(base_rows + rows_before, rows);
    const int64_t size = min(requested, rows - start);
    const int64_t k = (size + kBlock - 1) / kBlock * kBlock;
    __syncthreads();  // the scan storage is used again
    int64_t cols_before = 0, cols_total = 0;
    Scan(storage).ExclusiveSum(k, cols_before, cols_total);
    if (grp < args.num_groups) {
      const int64_t off = base_cols + cols_before;
      const int na = static_cast<int>(args.na), nb = static_cast<int>(args.nb);
      const int kk = static_cast<int>(k > 0 ? k : kBlock);
      g.shapes[grp] = GroupShape(k > 0 ? na : 0, nb, kk);  // M = 0: no tiles
      g.a[grp] = reinterpret_cast<const ElementA*>(args.a_t) + off;
      g.b[grp] = reinterpret_cast<const ElementB*>(args.b_t) + off;
      g.sfa[grp] = args.a_sf_t + (off / kBlock) * args.na;
      g.sfb[grp] = args.b_sf_t + (off / kBlock) * args.nb;
      g.d[grp] = static_cast<char*>(args.d) + grp * args.na * args.nb * d_bytes;
      g.stride_a[grp] = make_stride(args.p, Int<1>{}, Int<0>{});
      g.stride_b[grp] = make_stride(args.p, Int<1>{}, Int<0>{});
      g.stride_d[grp] = make_stride(args.nb, Int<1>{}, Int<0>{});
      g.layout_sfa[grp] = ScaleConfig::tile_atom_to_shape_SFA(make_shape(na, nb, kk, 1));
      g.layout_sfb[grp] = ScaleConfig::tile_atom_to_shape_SFB(make_shape(na, nb, kk, 1));
    }
    __syncthreads();  // everyone has read the bases
    if (threadIdx.x == 0) {
      base_rows += rows_total;
      base_cols += cols_total;
    }
    __syncthreads();
  }
}

constexpr int kZeroThreads = 256;
constexpr int64_t kZeroMaxBlocksPerGroup = 64;

// Grid (blocks per group, groups): zeroes d[blockIdx.y] when the setup gave its group no rows.
__global__ void __launch_bounds__(kZeroThreads) ZeroEmptyGroupsKernel(GroupedGemmFp8WgradArgs args, GroupArrays g) {
  if (get<0>(g.shapes[blockIdx.y]) != 0) return;
  const int64_t vecs = args.na * args.nb * (args.d_bf16 ? 2 : 4) / 16;  // na % 128 == 0: whole 16-byte vectors
  uint4* d = static_cast<uint4*>(g.d[blockIdx.y]);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kZeroThreads + threadIdx.x; i < vecs;
       i += static_cast<int64_t>(gridDim.x) * kZeroThreads) {
    d[i] = make_uint4(0, 0, 0, 0);
  }
}

}  // namespace

size_t GroupedGemmFp8WgradScratchBytesFor(int64_t num_groups, int sm_count) {
  return std::max({ScratchBytes<F32Out>(num_groups, sm_count), ScratchBytes<Bf16Out>(num_groups, sm_count),
                   GroupedGemmFp8WgradWgmmaScratchBytes(num_groups)});
}

std::string LaunchGroupedGemmFp8Wgrad(cudaStream_t stream, int sm_count, const GroupedGemmFp8WgradArgs& args) {
  if (args.num_groups == 0) return "";
  if (args.num_groups > 65535 || args.na > 0x7FFFFFFF || args.nb > 0x7FFFFFFF || args.p > 0x7FFFFFFF) {
    return "more than 65535 groups, or a dimension past 2^31 - 1";
  }
  const size_t needed = GroupedGemmFp8WgradScratchBytesFor(args.num_groups, sm_count);
  if (std::string error = sm90::ScratchShortfall(args.scratch_bytes, needed); !error.empty()) return error;
  bool wgmma = false;
  if (std::string error = sm90::ChosenFp8Kernels(&wgmma); !error.empty()) return error;
  if (wgmma) return LaunchGroupedGemmFp8WgradWgmma(stream, sm_count, args);
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return cudaGetErrorString(err);

  GroupArrays arrays{};
  char* base = static_cast<char*>(args.scratch);
  const size_t array_bytes = sm90::CarveGroupArrays(base, args.num_groups, &arrays);
  SetupWgradKernel<<<1, kSetupThreads, 0, stream>>>(args, arrays);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return cudaGetErrorString(err);
  const int64_t vecs = args.na * args.nb * (args.d_bf16 ? 2 : 4) / 16;
  const int64_t per_group = std::min<int64_t>((vecs + kZeroThreads * 16 - 1) / (kZeroThreads * 16),
                                              kZeroMaxBlocksPerGroup);
  ZeroEmptyGroupsKernel<<<dim3(static_cast<unsigned>(per_group), static_cast<unsigned>(args.num_groups)),
                          kZeroThreads, 0, stream>>>(args, arrays);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return cudaGetErrorString(err);

  std::string error =
      args.d_bf16
          ? sm90::RunGroupedGemm<Bf16Out::Gemm>(stream, device, sm_count, base, args.num_groups, arrays, array_bytes)
          : sm90::RunGroupedGemm<F32Out::Gemm>(stream, device, sm_count, base, args.num_groups, arrays, array_bytes);
  if (!error.empty()) return error;
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return cudaGetErrorString(err);
  return "";
}

}  // namespace jax_moe_a2a
