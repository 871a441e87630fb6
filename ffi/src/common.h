// common.h -- helpers shared by every handler: error construction and CUDA call checking.
#pragma once

#include <cstdint>
#include <cstring>
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

// bfloat16 <-> float32 on the host: widening is exact; narrowing rounds to nearest even and keeps a NaN a (quiet)
// NaN of the same sign, as XLA and the GPU's conversion do.
inline float Bf16BitsToFloat(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t FloatToBf16Bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

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

namespace jax_moe_a2a {

// Makes `device` the current CUDA device for the enclosing scope (one process may drive several GPUs, and a
// handler launches on its stream's device); restores the previous one when the scope ends. Check `error()`.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    error_ = cudaGetDevice(&previous_);
    if (error_ == cudaSuccess && previous_ != device) {
      error_ = cudaSetDevice(device);
      switched_ = error_ == cudaSuccess;
    }
  }
  ~ScopedDevice() {
    if (switched_) cudaSetDevice(previous_);
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;
  cudaError_t error() const { return error_; }

 private:
  int previous_ = -1;
  bool switched_ = false;
  cudaError_t error_ = cudaSuccess;
};

}  // namespace jax_moe_a2a
#endif
