// grouped_gemm_sm90_common.cuh -- host scaffolding for CUTLASS SM90 pointer-array grouped GEMMs whose problem
// shapes and operand pointers live in device memory (filled by a setup kernel): scratch carving, the cache of the
// kernel's host-built parameters, and the launch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include <cuda_runtime_api.h>

#include "cutlass/cutlass.h"

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

}  // namespace jax_moe_a2a::sm90
