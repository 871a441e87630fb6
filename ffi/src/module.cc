// module.cc -- the pybind11 module: hands the FFI handlers to Python as capsules, per platform.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "a2a_protocol.h"
#include "common.h"
#include "handlers.h"
#include "workspace.h"
#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

namespace py = pybind11;

namespace jax_moe_a2a {

namespace {

template <typename Fn>
py::capsule Capsule(Fn* fn) {
  return py::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

}  // namespace jax_moe_a2a

PYBIND11_MODULE(_jax_moe_a2a, m) {
  m.doc() = "XLA FFI handlers of jax_moe_a2a (use jax_moe_a2a._ffi, which registers them).";
  m.def(
      "registrations",
      []() {
        py::dict platforms;
        py::dict cpu;
        cpu["jax_moe_a2a_quantize_fp8_blockwise"] = jax_moe_a2a::Capsule(JaxMoeA2aQuantizeFp8BlockwiseCpu);
        cpu["jax_moe_a2a_quantize_fp8_weight"] = jax_moe_a2a::Capsule(JaxMoeA2aQuantizeFp8WeightCpu);
        cpu["jax_moe_a2a_quantize_fp8_weight_with_transpose"] =
            jax_moe_a2a::Capsule(JaxMoeA2aQuantizeFp8WeightWithTransposeCpu);
        cpu["jax_moe_a2a_quantize_fp8_grouped_kmajor"] = jax_moe_a2a::Capsule(JaxMoeA2aQuantizeFp8GroupedKmajorCpu);
        cpu["jax_moe_a2a_quantize_mxfp8"] = jax_moe_a2a::Capsule(JaxMoeA2aQuantizeMxfp8Cpu);
        cpu["jax_moe_a2a_dequantize_mxfp8"] = jax_moe_a2a::Capsule(JaxMoeA2aDequantizeMxfp8Cpu);
        cpu["jax_moe_a2a_nvfp4_global_scale"] = jax_moe_a2a::Capsule(JaxMoeA2aNvfp4GlobalScaleCpu);
        cpu["jax_moe_a2a_quantize_nvfp4"] = jax_moe_a2a::Capsule(JaxMoeA2aQuantizeNvfp4Cpu);
        cpu["jax_moe_a2a_dequantize_nvfp4"] = jax_moe_a2a::Capsule(JaxMoeA2aDequantizeNvfp4Cpu);
        cpu["jax_moe_a2a_dispatch"] = jax_moe_a2a::Capsule(JaxMoeA2aDispatchCpu);
        cpu["jax_moe_a2a_combine"] = jax_moe_a2a::Capsule(JaxMoeA2aCombineCpu);
        cpu["jax_moe_a2a_grouped_gemm_fp8"] = jax_moe_a2a::Capsule(JaxMoeA2aGroupedGemmFp8Cpu);
        cpu["jax_moe_a2a_grouped_gemm_fp8_wgrad"] = jax_moe_a2a::Capsule(JaxMoeA2aGroupedGemmFp8WgradCpu);
        cpu["jax_moe_a2a_grouped_gemm_bf16"] = jax_moe_a2a::Capsule(JaxMoeA2aGroupedGemmBf16Cpu);
        cpu["jax_moe_a2a_gather_rows"] = jax_moe_a2a::Capsule(JaxMoeA2aGatherRowsCpu);
        cpu["jax_moe_a2a_scatter_rows"] = jax_moe_a2a::Capsule(JaxMoeA2aScatterRowsCpu);
        cpu["jax_moe_a2a_sum_rows"] = jax_moe_a2a::Capsule(JaxMoeA2aSumRowsCpu);
        platforms["cpu"] = cpu;
#ifdef JAX_MOE_A2A_WITH_CUDA
        py::dict cuda;
        cuda["jax_moe_a2a_quantize_fp8_blockwise"] = jax_moe_a2a::Capsule(JaxMoeA2aQuantizeFp8BlockwiseCuda);
        cuda["jax_moe_a2a_quantize_fp8_weight"] = jax_moe_a2a::Capsule(JaxMoeA2aQuantizeFp8WeightCuda);
        cuda["jax_moe_a2a_quantize_fp8_weight_with_transpose"] =
            jax_moe_a2a::Capsule(JaxMoeA2aQuantizeFp8WeightWithTransposeCuda);
        cuda["jax_moe_a2a_quantize_fp8_grouped_kmajor"] = jax_moe_a2a::Capsule(JaxMoeA2aQuantizeFp8GroupedKmajorCuda);
        cuda["jax_moe_a2a_quantize_mxfp8"] = jax_moe_a2a::Capsule(JaxMoeA2aQuantizeMxfp8Cuda);
        cuda["jax_moe_a2a_dequantize_mxfp8"] = jax_moe_a2a::Capsule(JaxMoeA2aDequantizeMxfp8Cuda);
        cuda["jax_moe_a2a_nvfp4_global_scale"] = jax_moe_a2a::Capsule(JaxMoeA2aNvfp4GlobalScaleCuda);
        cuda["jax_moe_a2a_quantize_nvfp4"] = jax_moe_a2a::Capsule(JaxMoeA2aQuantizeNvfp4Cuda);
        cuda["jax_moe_a2a_dequantize_nvfp4"] = jax_moe_a2a::Capsule(JaxMoeA2aDequantizeNvfp4Cuda);
        cuda["jax_moe_a2a_dispatch"] = jax_moe_a2a::Capsule(JaxMoeA2aDispatchCuda);
        cuda["jax_moe_a2a_combine"] = jax_moe_a2a::Capsule(JaxMoeA2aCombineCuda);
        cuda["jax_moe_a2a_grouped_gemm_fp8"] = jax_moe_a2a::Capsule(JaxMoeA2aGroupedGemmFp8Cuda);
        cuda["jax_moe_a2a_grouped_gemm_fp8_wgrad"] = jax_moe_a2a::Capsule(JaxMoeA2aGroupedGemmFp8WgradCuda);
        cuda["jax_moe_a2a_grouped_gemm_bf16"] = jax_moe_a2a::Capsule(JaxMoeA2aGroupedGemmBf16Cuda);
        cuda["jax_moe_a2a_gather_rows"] = jax_moe_a2a::Capsule(JaxMoeA2aGatherRowsCuda);
        cuda["jax_moe_a2a_scatter_rows"] = jax_moe_a2a::Capsule(JaxMoeA2aScatterRowsCuda);
        cuda["jax_moe_a2a_sum_rows"] = jax_moe_a2a::Capsule(JaxMoeA2aSumRowsCuda);
        platforms["CUDA"] = cuda;
#endif
        return platforms;
      },
      "Platform name -> {FFI target name -> handler capsule}, for every platform this build supports.");
  m.def(
      "with_cuda",
      []() {
#ifdef JAX_MOE_A2A_WITH_CUDA
        return true;
#else
        return false;
#endif
      },
      "Whether the CUDA handlers were built.");
  m.def(
      "workspace_create",
      [](const std::string& platform, const std::vector<std::vector<int>>& devices, size_t bytes,
         int64_t timeout_ns) {
        int64_t id = 0;
        std::string err;
        if (platform == "cpu") {
          err = jax_moe_a2a::CreateCpuWorkspace(devices, bytes, timeout_ns, &id);
#ifdef JAX_MOE_A2A_WITH_CUDA
        } else if (platform == "gpu") {
          err = jax_moe_a2a::CreateCudaWorkspace(devices, bytes, timeout_ns, &id);
#endif
        } else {
          err = "no workspace support for platform '" + platform + "' in this build";
        }
        if (!err.empty()) throw std::runtime_error("workspace_create: " + err);
        return id;
      },
      py::arg("platform"), py::arg("devices"), py::arg("bytes"), py::arg("timeout_ns"),
      "Allocates a one-sided workspace of `bytes` per device for devices[group][rank]; returns its id.");
  m.def(
      "workspace_ipc_handles",
      [](int64_t id) {
        py::dict out;
#ifdef JAX_MOE_A2A_WITH_CUDA
        std::map<int, std::string> handles;
        if (std::string err = jax_moe_a2a::IpcHandles(id, &handles); !err.empty())
          throw std::runtime_error("workspace_ipc_handles: " + err);
        for (const auto& [device, h] : handles) out[py::int_(device)] = py::bytes(h);
#else
        throw std::runtime_error("workspace_ipc_handles: this build has no CUDA");
#endif
        return out;
      },
      py::arg("id"), "CUDA IPC handle (bytes) of this process's block, per local device ordinal.");
  m.def(
      "workspace_open_peers",
      [](int64_t id, const std::map<std::pair<int, int>, py::bytes>& handles) {
#ifdef JAX_MOE_A2A_WITH_CUDA
        std::map<std::pair<int, int>, std::string> raw;
        for (const auto& [where, h] : handles) raw[where] = std::string(h);
        if (std::string err = jax_moe_a2a::OpenIpcPeers(id, raw); !err.empty())
          throw std::runtime_error("workspace_open_peers: " + err);
#else
        throw std::runtime_error("workspace_open_peers: this build has no CUDA");
#endif
      },
      py::arg("id"), py::arg("handles"),
      "Maps the blocks of other processes' devices, {(group, rank): IPC handle}, into this process.");
  m.def(
      "workspace_destroy", [](int64_t id) { jax_moe_a2a::DestroyWorkspace(id); }, py::arg("id"),
      "Frees a workspace (after the devices are idle); unknown ids are ignored.");
  m.def(
      "workspace_failure",
      [](int64_t id) {
        auto ws = jax_moe_a2a::FindWorkspace(id);
        return ws == nullptr ? std::string() : ws->Failure();
      },
      py::arg("id"), "The sticky failure of a workspace, or an empty string.");
  m.def("grouped_gemm_scratch_bytes", &jax_moe_a2a::GroupedGemmScratchBytes, py::arg("num_groups"),
        py::arg("bf16_mode") = -1, py::arg("f32_out") = false,
        "Device scratch bytes of one jax_moe_a2a_grouped_gemm_fp8 call (bf16_mode < 0) or jax_moe_a2a_grouped_gemm_bf16 "
        "call in that mode (mode 2: float32 output when f32_out), with `num_groups` groups on any visible GPU "
        "(0 without a GPU or without the CUDA handlers).");
  m.def("grouped_gemm_fp8_wgrad_scratch_bytes", &jax_moe_a2a::GroupedGemmFp8WgradScratchBytes, py::arg("num_groups"),
        "Device scratch bytes of one jax_moe_a2a_grouped_gemm_fp8_wgrad call with `num_groups` groups on any visible "
        "GPU (0 without a GPU or without the CUDA handlers).");
  m.attr("ffi_api_version") = py::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
  // The protocol's piece size and sender block bound, for the tests that layout.PIECE_BYTES and layout.SCAN_BLOCKS
  // size the ready and scan regions with the same values.
  m.attr("piece_bytes") = jax_moe_a2a::kPieceBytes;
  m.attr("scan_blocks") = jax_moe_a2a::kScanBlocks;
}
