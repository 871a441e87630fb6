// grouped_gemm_bf16_sm90.cu -- bf16 grouped GEMMs on Hopper (sm_90a): CUTLASS's pointer-array grouped GEMM (TMA
// loads, warp-specialized cooperative wgmma, float32 accumulation) in the three operand layouts an expert MLP's
// training step needs, fed from device memory by a small setup kernel so that group sizes never reach the host.
//
// NOTES:
// - One kernel type per mode (grouped_gemm_bf16_kernels.cuh): kNT reads both operands K-major, kNN reads the
//   weights N-major (wgmma transposes 16-bit operands in shared memory, so no transposed copy of the weights is
//   made), kTN reads both operands MN-major and contracts over a group's rows, so its K differs per group.
// - The setup kernel turns group_sizes into per-group problem shapes, pointers and strides in the caller's scratch
//   buffer. Groups with no rows get an empty problem (M = 0) and produce no tiles; for kTN their output is zeroed
//   by the fill kernel, as are the rows no group owns for kNT and kNN. TMA stores clip each group's tiles to its
//   own rows, and TMA loads fill a group's K residue (kTN) with zeros.
// - Tiles of 128 x 256 x 64; clusters of two CTAs along N, except kNT (the forward), which runs one CTA per
//   cluster, the faster of the two on the MoE layer's uneven groups (docs/PERFORMANCE.md).
// - The scaffolding (per-group arrays carved from scratch, the setup's scan, the cached host-built parameters) is
//   grouped_gemm_sm90_common.cuh's.
#include <cstdint>
#include <string>
#include <type_traits>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/numeric_types.h"
#include "cutlass/util/packed_stride.hpp"
#include "grouped_gemm_bf16_kernels.cuh"
#include "grouped_gemm_sm90_common.cuh"

namespace jax_moe_a2a {

namespace {

using namespace cute;

// ---------------------------------------------------------------------------------------------------------------
// The kernel types
// ---------------------------------------------------------------------------------------------------------------

using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M, N, K) per group
using GroupShape = ProblemShape::UnderlyingProblemShape;
using Bf16 = cutlass::bfloat16_t;

template <class LayoutA, class LayoutB, class ElementD, class ClusterShape_ = Shape<_1, _2, _1>>
struct Bf16Kernel {
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignmentAB = 8;  // bf16 elements per 16-byte access
  static constexpr int kAlignmentD = 16 / sizeof(ElementD);
  using TileShape = Shape<_128, _256, _64>;
  using ClusterShape = ClusterShape_;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD*, kAlignmentD,  // no C operand
      ElementD, LayoutD*, kAlignmentD, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Bf16, LayoutA*, kAlignmentAB, Bf16, LayoutB*,
      kAlignmentAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;

  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  using StrideA = typename GemmKernel::InternalStrideA;
  using StrideB = typename GemmKernel::InternalStrideB;
  using StrideD = typename GemmKernel::InternalStrideD;
  using Element = ElementD;
};

using RowMajor = cutlass::layout::RowMajor;
using ColumnMajor = cutlass::layout::ColumnMajor;
// In CUTLASS's terms A is [M, K] and B is [K, N]: RowMajor A and ColumnMajor B are K-major.
using KernelNT = Bf16Kernel<RowMajor, ColumnMajor, Bf16, Shape<_1, _1, _1>>;  // a [rows, k], b [G, n, k]
using KernelNN = Bf16Kernel<RowMajor, RowMajor, Bf16>;      // a [rows, k], b [G, k, n]
using KernelTN = Bf16Kernel<ColumnMajor, RowMajor, float>;  // aᵀ: [k, rows] read from a [rows, k]; b [rows, n]
using KernelTNBf16 = Bf16Kernel<ColumnMajor, RowMajor, Bf16>;  // the same with a bfloat16 d

// The per-group arrays of kernel K, carved from the caller's scratch buffer.
template <class K>
using GroupArrays = sm90::GroupArrays<typename K::GemmKernel>;

// ---------------------------------------------------------------------------------------------------------------
// Device kernels: setup and zero fill
// ---------------------------------------------------------------------------------------------------------------

constexpr int kSetupThreads = 256;

// Fills the per-group arrays (one block).
template <class K, Bf16GemmMode kMode>
__global__ void __launch_bounds__(kSetupThreads) SetupGroupsKernel(GroupedGemmBf16Args args, GroupArrays<K> g) {
  const auto* a = static_cast<const Bf16*>(args.a);
  const auto* b = static_cast<const Bf16*>(args.b);
  auto* d = static_cast<typename K::Element*>(args.d);
  const int n = static_cast<int>(args.n), k = static_cast<int>(args.k);
  sm90::ScanGroupSizes<kSetupThreads>(args.group_sizes, args.num_groups, [&](int64_t grp, int64_t requested,
                                                                             int64_t before) {
    const int64_t start = min(before, args.rows);
    const int size = static_cast<int>(min(requested, args.rows - start));
    g.a[grp] = a + start * args.k;
    if constexpr (kMode == Bf16GemmMode::kTN) {
      // d[g] [k, n] = a_gᵀ · b_g: M = k, N = n, K = the group's rows.
      g.shapes[grp] = size > 0 ? GroupShape(k, n, size) : GroupShape(0, n, 0);
      g.b[grp] = b + start * args.n;
      g.d[grp] = d + grp * args.k * args.n;
      g.stride_a[grp] = cutlass::make_cute_packed_stride(typename K::StrideA{}, make_shape(k, size, 1));
      g.stride_b[grp] = cutlass::make_cute_packed_stride(typename K::StrideB{}, make_shape(n, size, 1));
      g.stride_d[grp] = cutlass::make_cute_packed_stride(typename K::StrideD{}, make_shape(k, n, 1));
    } else {
      g.shapes[grp] = GroupShape(size, n, k);
      g.b[grp] = b + grp * args.n * args.k;
      g.d[grp] = d + start * args.n;
      g.stride_a[grp] = cutlass::make_cute_packed_stride(typename K::StrideA{}, make_shape(size, k, 1));
      g.stride_b[grp] = cutlass::make_cute_packed_stride(typename K::StrideB{}, make_shape(n, k, 1));
      g.stride_d[grp] = cutlass::make_cute_packed_stride(typename K::StrideD{}, make_shape(size, n, 1));
    }
  });
}

constexpr int kZeroThreads = 256;
constexpr int64_t kZeroVecsPerBlock = 4096;  // 64 KiB of output per block

// kNT, kNN: zeroes the rows of d past the owned ones. Grid: ceil(rows * n / 8 / kZeroVecsPerBlock).
__global__ void __launch_bounds__(kZeroThreads) ZeroUnownedRowsKernel(GroupedGemmBf16Args args) {
  using Reduce = cub::BlockReduce<int64_t, kZeroThreads>;
  __shared__ typename Reduce::TempStorage reduce_storage;
  __shared__ int64_t total;
  int64_t sum = 0;
  for (int64_t grp = threadIdx.x; grp < args.num_groups; grp += kZeroThreads) sum += max(args.group_sizes[grp], 0);
  sum = Reduce(reduce_storage).Sum(sum);
  if (threadIdx.x == 0) total = min(sum, args.rows);
  __syncthreads();
  const int64_t vecs_per_row = args.n / 8;  // 8 bfloat16 per 16-byte store
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kZeroVecsPerBlock;
  const int64_t begin = max(first, total * vecs_per_row);
  const int64_t end = min(first + kZeroVecsPerBlock, args.rows * vecs_per_row);
  uint4* d = static_cast<uint4*>(args.d);
  for (int64_t i = begin + threadIdx.x; i < end; i += kZeroThreads) d[i] = make_uint4(0, 0, 0, 0);
}

// kTN: zeroes d[g] of every group that owns no rows. Grid: (ceil(d[g] bytes / 16 / kZeroVecsPerBlock), num_groups).
__global__ void __launch_bounds__(kZeroThreads) ZeroEmptyGroupsKernel(GroupedGemmBf16Args args) {
  using Scan = cub::BlockReduce<int64_t, kZeroThreads>;
  __shared__ typename Scan::TempStorage reduce_storage;
  __shared__ int64_t owned;
  // The group's clamped size needs the requested sizes of the groups before it.
  const int64_t grp = blockIdx.y;
  int64_t before = 0;
  for (int64_t i = threadIdx.x; i < grp; i += kZeroThreads) before += max(args.group_sizes[i], 0);
  before = Scan(reduce_storage).Sum(before);
  if (threadIdx.x == 0) {
    const int64_t start = min(before, args.rows);
    owned = min(static_cast<int64_t>(max(args.group_sizes[grp], 0)), args.rows - start);
  }
  __syncthreads();
  if (owned > 0) return;
  const int64_t vecs = args.k * args.n / (args.d_bf16 ? 8 : 4);  // 16-byte stores per d[g]
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kZeroVecsPerBlock;
  const int64_t end = min(begin + kZeroVecsPerBlock, vecs);
  uint4* d = static_cast<uint4*>(args.d) + grp * vecs;
  for (int64_t i = begin + threadIdx.x; i < end; i += kZeroThreads) d[i] = make_uint4(0, 0, 0, 0);
}

// ---------------------------------------------------------------------------------------------------------------
// Launch
// ---------------------------------------------------------------------------------------------------------------

template <class K>
size_t ScratchBytes(int64_t num_groups, int sm_count) {
  return sm90::ScratchBytes<typename K::Gemm, GroupArrays<K>>(num_groups, sm_count);
}

template <class K, Bf16GemmMode kMode>
std::string Launch(cudaStream_t stream, int sm_count, const GroupedGemmBf16Args& args) {
  const size_t needed = ScratchBytes<K>(args.num_groups, sm_count);
  static_assert(kMode == Bf16GemmMode::kTN || std::is_same_v<typename K::Element, Bf16>, "kNT, kNN write bf16");
  if (std::string error = sm90::ScratchShortfall(args.scratch_bytes, needed); !error.empty()) return error;
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return cudaGetErrorString(err);

  GroupArrays<K> arrays{};
  char* base = static_cast<char*>(args.scratch);
  const size_t array_bytes = sm90::CarveGroupArrays(base, args.num_groups, &arrays);
  SetupGroupsKernel<K, kMode><<<1, kSetupThreads, 0, stream>>>(args, arrays);
  if constexpr (kMode == Bf16GemmMode::kTN) {
    const int64_t vecs = args.k * args.n / (args.d_bf16 ? 8 : 4);
    const dim3 grid(static_cast<unsigned>((vecs + kZeroVecsPerBlock - 1) / kZeroVecsPerBlock),
                    static_cast<unsigned>(args.num_groups));
    ZeroEmptyGroupsKernel<<<grid, kZeroThreads, 0, stream>>>(args);
  } else {
    const int64_t vecs = args.rows * args.n / 8;
    ZeroUnownedRowsKernel<<<static_cast<unsigned>((vecs + kZeroVecsPerBlock - 1) / kZeroVecsPerBlock),
                            kZeroThreads, 0, stream>>>(args);
  }
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return cudaGetErrorString(err);

  if (std::string error = sm90::RunGroupedGemm<typename K::Gemm>(stream, device, sm_count, base, args.num_groups,
                                                                 arrays, array_bytes);
      !error.empty()) {
    return error;
  }
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return cudaGetErrorString(err);
  return "";
}

}  // namespace

size_t GroupedGemmBf16ScratchBytes(Bf16GemmMode mode, bool d_bf16, int64_t num_groups, int sm_count) {
  switch (mode) {
    case Bf16GemmMode::kNT: return ScratchBytes<KernelNT>(num_groups, sm_count);
    case Bf16GemmMode::kNN: return ScratchBytes<KernelNN>(num_groups, sm_count);
    case Bf16GemmMode::kTN:
      return d_bf16 ? ScratchBytes<KernelTNBf16>(num_groups, sm_count) : ScratchBytes<KernelTN>(num_groups, sm_count);
  }
  return 0;
}

std::string LaunchGroupedGemmBf16(cudaStream_t stream, int sm_count, const GroupedGemmBf16Args& args) {
  if (args.num_groups == 0) return "";
  if (args.mode != Bf16GemmMode::kTN && args.rows == 0) return "";
  switch (args.mode) {
    case Bf16GemmMode::kNT: return Launch<KernelNT, Bf16GemmMode::kNT>(stream, sm_count, args);
    case Bf16GemmMode::kNN: return Launch<KernelNN, Bf16GemmMode::kNN>(stream, sm_count, args);
    case Bf16GemmMode::kTN:
      return args.d_bf16 ? Launch<KernelTNBf16, Bf16GemmMode::kTN>(stream, sm_count, args)
                         : Launch<KernelTN, Bf16GemmMode::kTN>(stream, sm_count, args);
  }
  return "unknown mode " + std::to_string(static_cast<int>(args.mode));
}

}  // namespace jax_moe_a2a
