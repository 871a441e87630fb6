// module.cc -- the pybind11 module: hands the FFI handlers to Python as capsules, per platform.
#include <pybind11/pybind11.h>

#include <string>

#include "common.h"
#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

namespace py = pybind11;

// Handlers defined in the other translation units.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMoeA2aQuantizeFp8BlockwiseCpu);
#ifdef JAX_MOE_A2A_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMoeA2aQuantizeFp8BlockwiseCuda);
#endif

namespace jax_moe_a2a {

std::string DataTypeName(ffi::DataType dtype) {
  switch (dtype) {
    case ffi::DataType::PRED: return "bool";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::S16: return "int16";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::U16: return "uint16";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::U64: return "uint64";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F8E4M3FN: return "float8_e4m3fn";
    case ffi::DataType::F8E5M2: return "float8_e5m2";
    default: return "dtype #" + std::to_string(static_cast<int>(dtype));
  }
}

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
        platforms["cpu"] = cpu;
#ifdef JAX_MOE_A2A_WITH_CUDA
        py::dict cuda;
        cuda["jax_moe_a2a_quantize_fp8_blockwise"] = jax_moe_a2a::Capsule(JaxMoeA2aQuantizeFp8BlockwiseCuda);
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
  m.attr("ffi_api_version") = py::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
}
