// common.h -- helpers shared by every handler: error construction and CUDA call checking.
#pragma once

#include <cstdint>
#include <sstream>
#include <string>
#include <string_view>

#include "xla/ffi/api/ffi.h"

namespace jax_moe_a2a {

namespace ffi = xla::ffi;

// "<op>: <what> must be <expected>, got <actual>" as an INVALID_ARGUMENT error.
template <typename Actual>
ffi::Error InvalidArg(std::string_view op, std::string_view what, std::string_view expected, const Actual& actual) {
  std::ostringstream os;
  os << op << ": " << what << " must be " << expected << ", got " << actual;
  return ffi::Error::InvalidArgument(os.str());
}

// Renders dimensions as "[d0, d1, ...]".
template <typename Dims>
std::string DimsToString(const Dims& dims) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < dims.size(); ++i) os << (i ? ", " : "") << dims[i];
  os << "]";
  return os.str();
}

std::string DataTypeName(ffi::DataType dtype);

}  // namespace jax_moe_a2a

#ifdef JAX_MOE_A2A_WITH_CUDA
#include <cuda_runtime_api.h>

// Returns an ffi::Error (with file and line) from the enclosing function when a CUDA call fails.
#define JAX_MOE_A2A_RETURN_IF_CUDA_ERROR(expr)                                                                 \
  do {                                                                                                         \
    cudaError_t _err = (expr);                                                                                 \
    if (_err != cudaSuccess) {                                                                                 \
      return ::xla::ffi::Error::Internal(std::string(__FILE__) + ":" + std::to_string(__LINE__) + ": " #expr  \
                                         " failed: " + cudaGetErrorString(_err));                             \
    }                                                                                                          \
  } while (0)
#endif
