// quant.cc -- handlers of jax_moe_a2a_quantize_fp8_blockwise (1x128 groups of activation rows) and
// jax_moe_a2a_quantize_fp8_weight (128x128 blocks of weights), CPU, and CUDA when built with it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common.h"
#include "quant.h"
#include "xla/ffi/api/ffi.h"

#ifdef JAX_MOE_A2A_WITH_CUDA
#include "quant_kernels.cuh"
#endif

namespace jax_moe_a2a {

namespace {

constexpr char kOp[] = "jax_moe_a2a_quantize_fp8_blockwise";
constexpr char kWeightOp[] = "jax_moe_a2a_quantize_fp8_weight";

// ---------------------------------------------------------------------------------------------------------------
// Shape and dtype checks (shared by both platforms)
// ---------------------------------------------------------------------------------------------------------------

struct QuantShape {
  int64_t m = 0;
  int64_t k = 0;
};

// swiglu: x is [M, 2K], gate columns then up columns, and the values quantized are silu(gate) * up; the codes and
// scales are those of an [M, K] input.
ffi::Error CheckQuantize(const ffi::AnyBuffer& x, const ffi::Result<ffi::AnyBuffer>& x_q,
                         const ffi::Result<ffi::Buffer<ffi::F32>>& x_sf, bool block_major_k, bool swiglu,
                         QuantShape* shape) {
  const auto dt = x.element_type();
  if (dt != ffi::DataType::BF16 && dt != ffi::DataType::F16 && dt != ffi::DataType::F32) {
    return InvalidArg(kOp, "x", "bfloat16, float16 or float32", DataTypeName(dt));
  }
  if (swiglu && block_major_k) return InvalidArg(kOp, "block_major_k with swiglu", "false", "true");
  const auto dims = x.dimensions();
  const int64_t width = swiglu ? 2 * kGroup : kGroup;
  if (dims.size() != 2 || dims[1] % width != 0) {
    return InvalidArg(kOp, "x", swiglu ? "[M, 2K] with K % 128 == 0 (swiglu)" : "[M, K] with K % 128 == 0",
                      DimsToString(dims));
  }
  shape->m = dims[0];
  shape->k = swiglu ? dims[1] / 2 : dims[1];
  const int64_t groups = shape->k / kGroup;
  if (x_q->element_type() != ffi::DataType::F8E4M3FN) {
    return InvalidArg(kOp, "x_q", "float8_e4m3fn", DataTypeName(x_q->element_type()));
  }
  const auto q_dims = x_q->dimensions();
  if (q_dims.size() != 2 || q_dims[0] != shape->m || q_dims[1] != shape->k) {
    return InvalidArg(kOp, "x_q", "[M, K] = [" + std::to_string(shape->m) + ", " + std::to_string(shape->k) + "]",
                      DimsToString(q_dims));
  }
  const auto sf_dims = x_sf->dimensions();
  const int64_t want0 = block_major_k ? groups : shape->m;
  const int64_t want1 = block_major_k ? shape->m : groups;
  if (sf_dims.size() != 2 || sf_dims[0] != want0 || sf_dims[1] != want1) {
    return InvalidArg(kOp, "x_sf", std::string(block_major_k ? "[K/128, M] = [" : "[M, K/128] = [") +
                                       std::to_string(want0) + ", " + std::to_string(want1) + "]",
                      DimsToString(sf_dims));
  }
  return ffi::Error::Success();
}

struct WeightShape {
  int64_t batch = 1, n = 0, k = 0;
};

ffi::Error CheckQuantizeWeight(const ffi::AnyBuffer& w, const ffi::Result<ffi::AnyBuffer>& w_q,
                               const ffi::Result<ffi::Buffer<ffi::F32>>& w_sf, WeightShape* s) {
  const auto dt = w.element_type();
  if (dt != ffi::DataType::BF16 && dt != ffi::DataType::F16 && dt != ffi::DataType::F32) {
    return InvalidArg(kWeightOp, "w", "bfloat16, float16 or float32", DataTypeName(dt));
  }
  const auto dims = w.dimensions();
  if (dims.size() < 2 || dims[dims.size() - 1] == 0 || dims[dims.size() - 2] == 0) {
    return InvalidArg(kWeightOp, "w", "[..., N, K] with N, K > 0", DimsToString(dims));
  }
  s->n = dims[dims.size() - 2];
  s->k = dims[dims.size() - 1];
  s->batch = 1;
  for (size_t i = 0; i + 2 < dims.size(); ++i) s->batch *= dims[i];
  if (w_q->element_type() != ffi::DataType::F8E4M3FN) {
    return InvalidArg(kWeightOp, "w_q", "float8_e4m3fn", DataTypeName(w_q->element_type()));
  }
  const auto q_dims = w_q->dimensions();
  if (q_dims.size() != dims.size() || !std::equal(q_dims.begin(), q_dims.end(), dims.begin())) {
    return InvalidArg(kWeightOp, "w_q", "w's shape " + DimsToString(dims), DimsToString(q_dims));
  }
  const auto sf_dims = w_sf->dimensions();
  const int64_t nb = (s->n + kGroup - 1) / kGroup, kb = (s->k + kGroup - 1) / kGroup;
  bool sf_ok = sf_dims.size() == dims.size() && sf_dims[dims.size() - 2] == nb && sf_dims[dims.size() - 1] == kb;
  for (size_t i = 0; sf_ok && i + 2 < dims.size(); ++i) sf_ok = sf_dims[i] == dims[i];
  if (!sf_ok) {
    return InvalidArg(kWeightOp, "w_sf", "[..., ceil(N/128), ceil(K/128)] = [..., " + std::to_string(nb) + ", " +
                                             std::to_string(kb) + "]", DimsToString(sf_dims));
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------------------------
// CPU
// ---------------------------------------------------------------------------------------------------------------

inline float F16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0x1Fu) {
    bits = sign | 0x7F800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal half: normalize
    int e = -1;
    do {
      ++e;
      mant <<= 1;
    } while ((mant & 0x400u) == 0);
    bits = sign | ((112u - e) << 23) | ((mant & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// The rule of quant.h for `count` values sharing one scale: writes their E4M3 codes to `codes` and returns the
// scale.
float EncodeGroup(const float* v, int64_t count, uint8_t* codes) {
  float amax = 0.0f;
  bool finite = true;
  for (int64_t i = 0; i < count; ++i) {
    finite = finite && std::isfinite(v[i]);
    amax = std::fmax(amax, std::fabs(v[i]));
  }
  float scale;
  if (!finite) {
    std::memcpy(&scale, &kF32QuietNaN, sizeof(scale));
    std::memset(codes, kE4m3NaN, count);
    return scale;
  }
  const float floored = std::fmax(amax, kAmaxFloor);
  uint32_t amax_bits;
  std::memcpy(&amax_bits, &floored, sizeof(amax_bits));
  const uint32_t biased = ScaleExponent(amax_bits);
  const uint32_t scale_bits = biased << 23, inv_bits = (254u - biased) << 23;
  float inv_scale;
  std::memcpy(&scale, &scale_bits, sizeof(scale));
  std::memcpy(&inv_scale, &inv_bits, sizeof(inv_scale));
  const float limit = E4m3Limit(biased);
  for (int64_t i = 0; i < count; ++i) codes[i] = FloatToE4m3(std::fmin(std::fmax(v[i] * inv_scale, -limit), limit));
  return scale;
}

// silu(g) * u in float32: g * (1 / (1 + exp(-g))), then times u.
float Swiglu(float g, float u) {
  const float sig = 1.0f / (1.0f + std::exp(-g));
  return (g * sig) * u;
}

// Quantizes the rows of an [m, k] input read by to_float(index) of x [m, k], or, with swiglu, of
// silu(x[:, :k]) * x[:, k:] for x [m, 2k].
template <typename ToFloat>
void QuantizeRows(ToFloat to_float, int64_t m, int64_t k, bool swiglu, uint8_t* x_q, float* x_sf,
                  bool block_major_k) {
  const int64_t groups = k / kGroup;
  float v[kGroup];
  for (int64_t row = 0; row < m; ++row) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t base = row * k + g * kGroup;
      if (swiglu) {
        const int64_t in = row * 2 * k + g * kGroup;
        for (int i = 0; i < kGroup; ++i) v[i] = Swiglu(to_float(in + i), to_float(in + k + i));
      } else {
        for (int i = 0; i < kGroup; ++i) v[i] = to_float(base + i);
      }
      x_sf[block_major_k ? g * m + row : row * groups + g] = EncodeGroup(v, kGroup, x_q + base);
    }
  }
}

// 128x128 blocks of w [batch, n, k]: each block's values (those that exist at the edges) share one scale.
template <typename Load>
void QuantizeWeightBlocks(Load load, int64_t batch, int64_t n, int64_t k, uint8_t* w_q, float* w_sf) {
  const int64_t nb = (n + kGroup - 1) / kGroup, kb = (k + kGroup - 1) / kGroup;
  std::vector<float> v(kGroup * kGroup);
  std::vector<uint8_t> codes(kGroup * kGroup);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < nb; ++i) {
      for (int64_t j = 0; j < kb; ++j) {
        const int64_t rows = std::min<int64_t>(kGroup, n - i * kGroup), cols = std::min<int64_t>(kGroup, k - j * kGroup);
        const int64_t base = (b * n + i * kGroup) * k + j * kGroup;
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t c = 0; c < cols; ++c) v[r * cols + c] = load(base + r * k + c);
        }
        w_sf[(b * nb + i) * kb + j] = EncodeGroup(v.data(), rows * cols, codes.data());
        for (int64_t r = 0; r < rows; ++r) std::memcpy(w_q + base + r * k, codes.data() + r * cols, cols);
      }
    }
  }
}

ffi::Error QuantizeFp8BlockwiseCpuImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> x_q,
                                       ffi::Result<ffi::Buffer<ffi::F32>> x_sf, bool block_major_k, bool swiglu) {
  QuantShape s;
  if (auto err = CheckQuantize(x, x_q, x_sf, block_major_k, swiglu, &s); err.failure()) return err;
  auto* q = reinterpret_cast<uint8_t*>(x_q->untyped_data());
  float* sf = x_sf->typed_data();
  switch (x.element_type()) {
    case ffi::DataType::BF16: {
      const auto* p = reinterpret_cast<const uint16_t*>(x.untyped_data());
      QuantizeRows([p](int64_t i) { return Bf16BitsToFloat(p[i]); }, s.m, s.k, swiglu, q, sf, block_major_k);
      break;
    }
    case ffi::DataType::F16: {
      const auto* p = reinterpret_cast<const uint16_t*>(x.untyped_data());
      QuantizeRows([p](int64_t i) { return F16ToFloat(p[i]); }, s.m, s.k, swiglu, q, sf, block_major_k);
      break;
    }
    default: {
      const auto* p = reinterpret_cast<const float*>(x.untyped_data());
      QuantizeRows([p](int64_t i) { return p[i]; }, s.m, s.k, swiglu, q, sf, block_major_k);
      break;
    }
  }
  return ffi::Error::Success();
}

ffi::Error QuantizeFp8WeightCpuImpl(ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> w_q,
                                    ffi::Result<ffi::Buffer<ffi::F32>> w_sf) {
  WeightShape s;
  if (auto err = CheckQuantizeWeight(w, w_q, w_sf, &s); err.failure()) return err;
  auto* q = reinterpret_cast<uint8_t*>(w_q->untyped_data());
  float* sf = w_sf->typed_data();
  switch (w.element_type()) {
    case ffi::DataType::BF16: {
      const auto* p = reinterpret_cast<const uint16_t*>(w.untyped_data());
      QuantizeWeightBlocks([p](int64_t i) { return Bf16BitsToFloat(p[i]); }, s.batch, s.n, s.k, q, sf);
      break;
    }
    case ffi::DataType::F16: {
      const auto* p = reinterpret_cast<const uint16_t*>(w.untyped_data());
      QuantizeWeightBlocks([p](int64_t i) { return F16ToFloat(p[i]); }, s.batch, s.n, s.k, q, sf);
      break;
    }
    default: {
      const auto* p = reinterpret_cast<const float*>(w.untyped_data());
      QuantizeWeightBlocks([p](int64_t i) { return p[i]; }, s.batch, s.n, s.k, q, sf);
      break;
    }
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------------------------
// CUDA
// ---------------------------------------------------------------------------------------------------------------

#ifdef JAX_MOE_A2A_WITH_CUDA
ffi::Error QuantizeFp8BlockwiseCudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                                        ffi::Result<ffi::AnyBuffer> x_q,
                                        ffi::Result<ffi::Buffer<ffi::F32>> x_sf, bool block_major_k, bool swiglu) {
  QuantShape s;
  if (auto err = CheckQuantize(x, x_q, x_sf, block_major_k, swiglu, &s); err.failure()) return err;
  if (s.m == 0) return ffi::Error::Success();
  InputType type = InputType::kF32;
  if (x.element_type() == ffi::DataType::BF16) type = InputType::kBF16;
  if (x.element_type() == ffi::DataType::F16) type = InputType::kF16;
  ScopedDevice on(device);
  JAX_MOE_A2A_RETURN_IF_CUDA_ERROR(on.error());
  JAX_MOE_A2A_RETURN_IF_CUDA_ERROR(LaunchQuantizeFp8Blockwise(
      stream, type, x.untyped_data(), reinterpret_cast<uint8_t*>(x_q->untyped_data()), x_sf->typed_data(), s.m,
      s.k, block_major_k, swiglu));
  return ffi::Error::Success();
}

ffi::Error QuantizeFp8WeightCudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer w,
                                     ffi::Result<ffi::AnyBuffer> w_q, ffi::Result<ffi::Buffer<ffi::F32>> w_sf) {
  WeightShape s;
  if (auto err = CheckQuantizeWeight(w, w_q, w_sf, &s); err.failure()) return err;
  const int64_t vec = 16 / static_cast<int64_t>(ffi::ByteWidth(w.element_type()));
  if (s.k % vec != 0) return InvalidArg(kWeightOp, "K on the GPU", "a multiple of " + std::to_string(vec), s.k);
  if ((s.n + kGroup - 1) / kGroup > 65535 || s.batch > 65535) {
    return InvalidArg(kWeightOp, "w on the GPU", "ceil(N/128) <= 65535 and a batch of at most 65535",
                      DimsToString(w.dimensions()));
  }
  InputType type = InputType::kF32;
  if (w.element_type() == ffi::DataType::BF16) type = InputType::kBF16;
  if (w.element_type() == ffi::DataType::F16) type = InputType::kF16;
  ScopedDevice on(device);
  JAX_MOE_A2A_RETURN_IF_CUDA_ERROR(on.error());
  JAX_MOE_A2A_RETURN_IF_CUDA_ERROR(LaunchQuantizeFp8Weight(stream, type, w.untyped_data(),
                                                           reinterpret_cast<uint8_t*>(w_q->untyped_data()),
                                                           w_sf->typed_data(), s.batch, s.n, s.k));
  return ffi::Error::Success();
}
#endif

}  // namespace

}  // namespace jax_moe_a2a

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeA2aQuantizeFp8BlockwiseCpu, jax_moe_a2a::QuantizeFp8BlockwiseCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()                  // x
                                  .Ret<xla::ffi::AnyBuffer>()             // x_q
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()       // x_sf
                                  .Attr<bool>("block_major_k")                  // block_major_k
                                  .Attr<bool>("swiglu"));                       // swiglu

#ifdef JAX_MOE_A2A_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeA2aQuantizeFp8BlockwiseCuda, jax_moe_a2a::QuantizeFp8BlockwiseCudaImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .Arg<xla::ffi::AnyBuffer>()                     // x
                                  .Ret<xla::ffi::AnyBuffer>()                // x_q
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()          // x_sf
                                  .Attr<bool>("block_major_k")                     // block_major_k
                                  .Attr<bool>("swiglu"),                           // swiglu
                              {xla::ffi::Traits::kCmdBufferCompatible});
#endif

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeA2aQuantizeFp8WeightCpu, jax_moe_a2a::QuantizeFp8WeightCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()                  // w
                                  .Ret<xla::ffi::AnyBuffer>()                  // w_q
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());    // w_sf

#ifdef JAX_MOE_A2A_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeA2aQuantizeFp8WeightCuda, jax_moe_a2a::QuantizeFp8WeightCudaImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .Arg<xla::ffi::AnyBuffer>()                     // w
                                  .Ret<xla::ffi::AnyBuffer>()                     // w_q
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),        // w_sf
                              {xla::ffi::Traits::kCmdBufferCompatible});
#endif
