// grouped_gemm_sm90_common.cuh -- what the SM90 grouped GEMM units share: their problem shapes and operand pointers
// live in device memory, filled by a setup kernel from group sizes that never reach the host. Here: the per-group
// arrays and their carving from the caller's scratch buffer, the scan over group sizes the setup kernels run, the
// zeroing of output rows no group owns, and for the CUTLASS pointer-array kernels their arguments, scratch size, the
// cache of their host-built parameters and the launch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cuda_runtime_api.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/gemm.h"
#include "cutlass/kernel_hardware_info.h"

namespace jax_moe_a2a::sm90 {

// Alignment of every array carved from a scratch buffer.
constexpr size_t kScratchAlign = 256;

inline size_t AlignScratch(size_t v) { return (v + kScratchAlign - 1) / kScratchAlign * kScratchAlign; }

// Takes count elements of *ptr's type at `*offset` of `base` (nullptr: only counts) and advances the offset.
template <typename T>
void TakeScratch(char* base, size_t* offset, int64_t count, T** ptr) {
  *ptr = base ? reinterpret_cast<T*>(base + *offset) : nullptr;
  *offset = AlignScratch(*offset + sizeof(T) * static_cast<size_t>(count));
}

inline std::string CutlassError(const char* what, cutlass::Status status) {
  return std::string(what) + " failed: " + cutlass::cutlassGetStatusString(status);
}

// Whether the FP8 GEMMs take the kernels written on wgmma (grouped_gemm_fp8_wgmma_sm90.cu,
// grouped_gemm_fp8_wgrad_wgmma_sm90.cu) instead of the CUTLASS ones: JAX_MOE_A2A_FP8_GEMM_KERNEL = "wgmma", or
// "cutlass" / empty / unset. Read each time the handler runs, so that a benchmark can compare both in one process
// (one jitted function for each). XLA records the handler's launches into a CUDA graph and replays them, running the
// handler again only when it records anew (first run, new buffers), so a change of the variable between two calls
// of one compiled function need not take effect. Returns "" or the error of an unknown name.
inline std::string ChosenFp8Kernels(bool* wgmma) {
  constexpr char kEnv[] = "JAX_MOE_A2A_FP8_GEMM_KERNEL";
  const char* name = std::getenv(kEnv);
  const std::string_view chosen = name == nullptr ? "" : name;
  *wgmma = chosen == "wgmma";
  if (*wgmma || chosen.empty() || chosen == "cutlass") return "";
  return std::string(kEnv) + " is '" + std::string(chosen) + "'; expected 'cutlass', 'wgmma' or unset";
}

// The error of a call whose scratch buffer is smaller than it needs ("" when it is large enough).
inline std::string ScratchShortfall(size_t have, size_t need) {
  if (have >= need) return "";
  return "scratch holds " + std::to_string(have) + " bytes, the call needs " + std::to_string(need);
}

// ---------------------------------------------------------------------------------------------------------------
// Per-group arrays
// ---------------------------------------------------------------------------------------------------------------

// The blockwise scales' pointers and layouts of each group; `ScaleConfig` is a Sm90BlockwiseScaleConfig, void for
// a kernel without scales (no members, nothing carved).
template <class ScaleConfig>
struct GroupScales {
  static constexpr bool kScaled = true;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  const float** sfa;
  const float** sfb;
  LayoutSFA* layout_sfa;
  LayoutSFB* layout_sfb;
};

template <>
struct GroupScales<void> {
  static constexpr bool kScaled = false;
};

// The arrays a setup kernel fills and the GEMM reads, one entry per group. `Kernel` is the GemmUniversal kernel
// whose shapes and strides they hold; `ElementD` may be void when one setup kernel serves kernels that differ only
// in the output type (the GEMM's arguments cast d to the kernel's own).
template <class Kernel, class ScaleConfig = void, class ElementD = typename Kernel::ElementD>
struct GroupArrays : GroupScales<ScaleConfig> {
  using GroupShape = typename Kernel::ProblemShape::UnderlyingProblemShape;
  using ElementA = typename Kernel::ElementA;
  using ElementB = typename Kernel::ElementB;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  GroupShape* shapes;
  const ElementA** a;
  const ElementB** b;
  ElementD** d;
  StrideA* stride_a;
  StrideB* stride_b;
  StrideD* stride_d;
};

// Carves `out`'s arrays from `base` (nullptr: only counts) and returns the bytes they take.
template <class Arrays>
size_t CarveGroupArrays(char* base, int64_t num_groups, Arrays* out) {
  size_t offset = 0;
  TakeScratch(base, &offset, num_groups, &out->shapes);
  TakeScratch(base, &offset, num_groups, &out->a);
  TakeScratch(base, &offset, num_groups, &out->b);
  TakeScratch(base, &offset, num_groups, &out->d);
  if constexpr (Arrays::kScaled) {
    TakeScratch(base, &offset, num_groups, &out->sfa);
    TakeScratch(base, &offset, num_groups, &out->sfb);
  }
  TakeScratch(base, &offset, num_groups, &out->stride_a);
  TakeScratch(base, &offset, num_groups, &out->stride_b);
  TakeScratch(base, &offset, num_groups, &out->stride_d);
  if constexpr (Arrays::kScaled) {
    TakeScratch(base, &offset, num_groups, &out->layout_sfa);
    TakeScratch(base, &offset, num_groups, &out->layout_sfb);
  }
  return offset;
}

// ---------------------------------------------------------------------------------------------------------------
// Setup on the device
// ---------------------------------------------------------------------------------------------------------------

// One block walks the groups in chunks of kThreads, one thread per group, and calls visit(grp, requested, before)
// for every group: its size clamped to >= 0 and the sum of those of the groups before it (int64: at most 65535
// int32 sizes). Every thread of the block must call it.
template <int kThreads, class Visit>
__device__ void ScanGroupSizes(const int32_t* group_sizes, int64_t num_groups, Visit visit) {
  using Scan = cub::BlockScan<int64_t, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ int64_t chunk_base;
  if (threadIdx.x == 0) chunk_base = 0;
  __syncthreads();
  for (int64_t first = 0; first < num_groups; first += kThreads) {
    const int64_t grp = first + threadIdx.x;
    const int64_t requested = grp < num_groups ? max(group_sizes[grp], 0) : 0;
    int64_t before = 0, chunk_total = 0;
    Scan(scan_storage).ExclusiveSum(requested, before, chunk_total);
    if (grp < num_groups) visit(grp, requested, chunk_base + before);
    __syncthreads();  // everyone has read chunk_base
    if (threadIdx.x == 0) chunk_base += chunk_total;
    __syncthreads();
  }
}

// The rows of group grp in the FP8 GEMM's layouts (grouped_gemm_kernels.cuh), from its requested size (clamped to
// >= 0) and the sum of the earlier ones (ScanGroupSizes): masked, rows [grp * rows, + min(requested, rows)) of its
// own matrix; contiguous, the next min(requested, rows left) rows, starts saturating at `rows`.
__device__ __forceinline__ void GroupRows(bool masked, int64_t rows, int64_t grp, int64_t requested, int64_t before,
                                          int64_t* start, int64_t* size) {
  if (masked) {
    *start = grp * rows;
    *size = min(requested, rows);
  } else {
    *start = min(before, rows);
    *size = min(requested, rows - *start);
  }
}

// Zeroes the bfloat16 output rows [block_row * kRows, + kRows) that no group owns, of matrix blockIdx.y of
// d [.., rows, n] in the masked layout, of the one matrix d [rows, n] in the contiguous layout (n % 8 == 0). Every
// thread of the block must call it.
template <int kThreads, int kRows>
__device__ void ZeroUnownedRows(const int32_t* group_sizes, int64_t num_groups, int64_t rows, int64_t n, bool masked,
                                void* d, int64_t block_row) {
  int64_t owned;  // rows [0, owned) of this block's matrix belong to groups
  if (masked) {
    owned = min(static_cast<int64_t>(max(group_sizes[blockIdx.y], 0)), rows);
  } else {
    using Reduce = cub::BlockReduce<int64_t, kThreads>;
    __shared__ typename Reduce::TempStorage reduce_storage;
    __shared__ int64_t total;
    int64_t sum = 0;
    for (int64_t grp = threadIdx.x; grp < num_groups; grp += kThreads) sum += max(group_sizes[grp], 0);
    sum = Reduce(reduce_storage).Sum(sum);
    if (threadIdx.x == 0) total = sum;
    __syncthreads();
    owned = min(total, rows);
  }
  const int64_t first = block_row * kRows;
  const int64_t begin = max(first, owned), end = min(first + kRows, rows);
  if (begin >= end) return;
  const int64_t vecs_per_row = n / 8;  // 8 bfloat16 per 16-byte store
  uint4* out = reinterpret_cast<uint4*>(d) + (static_cast<int64_t>(blockIdx.y) * rows) * vecs_per_row;
  for (int64_t i = begin * vecs_per_row + threadIdx.x; i < end * vecs_per_row; i += kThreads) {
    out[i] = make_uint4(0, 0, 0, 0);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Arguments, scratch size, parameters and launch on the host
// ---------------------------------------------------------------------------------------------------------------

// The arguments of `Gemm` (a GemmUniversalAdapter) over the arrays `g`: D = 1 · A·B (no C operand), problem shapes
// read on the device only.
template <class Gemm, class Arrays>
typename Gemm::Arguments MakeArguments(const Arrays& g, int num_groups, int device, int sm_count) {
  using ElementD = typename Gemm::GemmKernel::ElementD;
  cutlass::KernelHardwareInfo hw_info;
  hw_info.device_id = device;
  hw_info.sm_count = sm_count;
  typename Gemm::GemmKernel::MainloopArguments mainloop;
  if constexpr (Arrays::kScaled) {
    mainloop = {g.a, g.stride_a, g.b, g.stride_b, g.sfa, g.layout_sfa, g.sfb, g.layout_sfb};
  } else {
    mainloop = {g.a, g.stride_a, g.b, g.stride_b};
  }
  typename Gemm::Arguments arguments{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {num_groups, g.shapes, nullptr},  // problem shapes live on the device only
      mainloop,
      {{}, nullptr, nullptr, reinterpret_cast<ElementD**>(g.d), g.stride_d},
      hw_info};
  auto& fusion = arguments.epilogue.thread;
  fusion.alpha = 1.0f;
  fusion.beta = 0.0f;
  fusion.alpha_ptr = nullptr;
  fusion.beta_ptr = nullptr;
  fusion.alpha_ptr_array = nullptr;
  fusion.beta_ptr_array = nullptr;
  fusion.dAlpha = {cute::_0{}, cute::_0{}, 0};
  fusion.dBeta = {cute::_0{}, cute::_0{}, 0};
  return arguments;
}

// Bytes of scratch one call of `Gemm` over `Arrays` needs: the per-group arrays, then the kernel's own workspace.
template <class Gemm, class Arrays>
size_t ScratchBytes(int64_t num_groups, int sm_count) {
  Arrays arrays{};
  const size_t array_bytes = CarveGroupArrays(nullptr, num_groups, &arrays);
  const auto arguments = MakeArguments<Gemm>(arrays, static_cast<int>(num_groups), 0, sm_count);
  return array_bytes + AlignScratch(Gemm::get_workspace_size(arguments));
}

// Kernel parameters (TMA descriptors built on the host, pointers into the scratch buffer) depend only on the device,
// the scratch address, the group count and the SM count when the problem shapes and operand addresses are read from
// device arrays. XLA gives a call site the same scratch buffer every time it runs, so caching them keeps the host
// work of a call to its launches.
template <class GemmKernel>
struct ParamsCache {
  using Params = typename GemmKernel::Params;
  using Key = std::tuple<int, const void*, int64_t, int>;  // device, scratch, groups, SM count
  static constexpr size_t kMaxEntries = 1024;
  std::mutex mu;
  std::map<Key, Params> entries;

  bool LookUp(const Key& key, Params* out) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = entries.find(key);
    if (it == entries.end()) return false;
    *out = it->second;
    return true;
  }

  void Store(const Key& key, const Params& params) {
    std::lock_guard<std::mutex> lock(mu);
    if (entries.size() >= kMaxEntries) entries.clear();
    entries[key] = params;
  }

  static ParamsCache& Get() {
    static ParamsCache* cache = new ParamsCache;  // never destroyed: handlers may run during process exit
    return *cache;
  }
};

// Runs `Gemm` (a GemmUniversalAdapter) on `arguments` with its parameters cached under (device, scratch, groups,
// SM count); `workspace` is the kernel's own workspace (Gemm::get_workspace_size bytes).
template <class Gemm>
std::string RunCachedGemm(cudaStream_t stream, int device, int sm_count, const void* scratch, int64_t num_groups,
                          const typename Gemm::Arguments& arguments, void* workspace) {
  using GemmKernel = typename Gemm::GemmKernel;
  auto& cache = ParamsCache<GemmKernel>::Get();
  const typename ParamsCache<GemmKernel>::Key key(device, scratch, num_groups, sm_count);
  typename GemmKernel::Params params;
  if (!cache.LookUp(key, &params)) {
    Gemm gemm;
    if (auto status = gemm.can_implement(arguments); status != cutlass::Status::kSuccess) {
      return CutlassError("can_implement", status);
    }
    if (auto status = gemm.initialize(arguments, workspace, stream); status != cutlass::Status::kSuccess) {
      return CutlassError("initialize", status);
    }
    params = gemm.params();
    cache.Store(key, params);
  } else if (auto status = GemmKernel::initialize_workspace(arguments, workspace, stream);
             status != cutlass::Status::kSuccess) {
    return CutlassError("initialize_workspace", status);
  }
  if (auto status = Gemm::run(params, stream); status != cutlass::Status::kSuccess) {
    return CutlassError("run", status);
  }
  return "";
}

// Runs `Gemm` on the arrays a setup kernel (enqueued before on `stream`) fills in `scratch`; its workspace follows
// the arrays there.
template <class Gemm, class Arrays>
std::string RunGroupedGemm(cudaStream_t stream, int device, int sm_count, void* scratch, int64_t num_groups,
                           const Arrays& arrays, size_t array_bytes) {
  const auto arguments = MakeArguments<Gemm>(arrays, static_cast<int>(num_groups), device, sm_count);
  return RunCachedGemm<Gemm>(stream, device, sm_count, scratch, num_groups, arguments,
                             static_cast<char*>(scratch) + array_bytes);
}

}  // namespace jax_moe_a2a::sm90
