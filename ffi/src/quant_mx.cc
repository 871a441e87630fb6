// quant_mx.cc -- handlers of the MXFP8 and NVFP4 custom calls, CPU, and CUDA when built with it:
//   jax_moe_a2a_quantize_mxfp8      x [M, K] -> x_q [M, K] E4M3, x_sf [M, C] E8M0 (C >= ceil(K/32): padding blocks)
//   jax_moe_a2a_dequantize_mxfp8    x_q, x_sf -> out [M, K] bfloat16, float16 or float32
//   jax_moe_a2a_nvfp4_global_scale  x (any shape) -> [] float32
//   jax_moe_a2a_quantize_nvfp4      x [M, K], global_scale [] -> x_q [M, K/2] uint8, x_sf [M, K/16] E4M3
//   jax_moe_a2a_dequantize_nvfp4    x_q, x_sf, global_scale -> out [M, K] bfloat16, float16 or float32
//
// NOTES: the CPU handlers reproduce the references as XLA runs them on CPUs, which treats float32 subnormals as zero,
// both where they are read (inputs, the E8M0 scale 2^-127, a subnormal global scale) and where an operation
// produces one. The CUDA kernels keep subnormals, as XLA does on GPUs.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "common.h"
#include "quant.h"
#include "quant_mx.h"
#include "xla/ffi/api/ffi.h"

#ifdef JAX_MOE_A2A_WITH_CUDA
#include "quant_mx_kernels.cuh"
#endif

namespace jax_moe_a2a {

namespace {

constexpr char kMxQuantOp[] = "jax_moe_a2a_quantize_mxfp8";
constexpr char kMxDequantOp[] = "jax_moe_a2a_dequantize_mxfp8";
constexpr char kGlobalScaleOp[] = "jax_moe_a2a_nvfp4_global_scale";
constexpr char kNvQuantOp[] = "jax_moe_a2a_quantize_nvfp4";
constexpr char kNvDequantOp[] = "jax_moe_a2a_dequantize_nvfp4";

// ---------------------------------------------------------------------------------------------------------------
// Shape and dtype checks (shared by both platforms)
// ---------------------------------------------------------------------------------------------------------------

bool IsFloatInput(ffi::DataType dt) {
  return dt == ffi::DataType::BF16 || dt == ffi::DataType::F16 || dt == ffi::DataType::F32;
}

std::string Pair(int64_t a, int64_t b) { return "[" + std::to_string(a) + ", " + std::to_string(b) + "]"; }

ffi::Error CheckFloatInput(const char* op, const ffi::AnyBuffer& x) {
  if (!IsFloatInput(x.element_type())) {
    return InvalidArg(op, "x", "bfloat16, float16 or float32", DataTypeName(x.element_type()));
  }
  return ffi::Error::Success();
}

ffi::Error CheckOutput(const char* op, const ffi::Result<ffi::AnyBuffer>& out, int64_t m, int64_t k) {
  if (!IsFloatInput(out->element_type())) {
    return InvalidArg(op, "out", "bfloat16, float16 or float32", DataTypeName(out->element_type()));
  }
  const auto dims = out->dimensions();
  if (dims.size() != 2 || dims[0] != m || dims[1] != k) {
    return InvalidArg(op, "out", "[M, K] = " + Pair(m, k), DimsToString(dims));
  }
  return ffi::Error::Success();
}

ffi::Error CheckScalar(const char* op, const ffi::Buffer<ffi::F32>& global_scale) {
  if (global_scale.dimensions().size() != 0) {
    return InvalidArg(op, "global_scale", "a float32 scalar (shape [])", DimsToString(global_scale.dimensions()));
  }
  return ffi::Error::Success();
}

struct MxShape {
  int64_t m = 0, k = 0, cols = 0;
};

// x_sf [M, C] E8M0 with C >= ceil(K/32): the blocks past K are padding.
ffi::Error CheckMxScales(const char* op, ffi::DataType dt, ffi::Span<const int64_t> dims, MxShape* s) {
  if (dt != ffi::DataType::F8E8M0FNU) return InvalidArg(op, "x_sf", "float8_e8m0fnu", DataTypeName(dt));
  const int64_t need = (s->k + kMxBlock - 1) / kMxBlock;
  if (dims.size() != 2 || dims[0] != s->m || dims[1] < need) {
    return InvalidArg(op, "x_sf", "[M, C] with M = " + std::to_string(s->m) + " and C >= ceil(K/32) = " +
                                      std::to_string(need), DimsToString(dims));
  }
  s->cols = dims[1];
  return ffi::Error::Success();
}

ffi::Error CheckQuantizeMxfp8(const ffi::AnyBuffer& x, const ffi::Result<ffi::AnyBuffer>& x_q,
                              const ffi::Result<ffi::AnyBuffer>& x_sf, MxShape* s) {
  if (auto err = CheckFloatInput(kMxQuantOp, x); err.failure()) return err;
  const auto dims = x.dimensions();
  if (dims.size() != 2 || dims[1] <= 0) return InvalidArg(kMxQuantOp, "x", "[M, K] with K > 0", DimsToString(dims));
  s->m = dims[0];
  s->k = dims[1];
  if (x_q->element_type() != ffi::DataType::F8E4M3FN) {
    return InvalidArg(kMxQuantOp, "x_q", "float8_e4m3fn", DataTypeName(x_q->element_type()));
  }
  const auto q_dims = x_q->dimensions();
  if (q_dims.size() != 2 || q_dims[0] != s->m || q_dims[1] != s->k) {
    return InvalidArg(kMxQuantOp, "x_q", "[M, K] = " + Pair(s->m, s->k), DimsToString(q_dims));
  }
  return CheckMxScales(kMxQuantOp, x_sf->element_type(), x_sf->dimensions(), s);
}

ffi::Error CheckDequantizeMxfp8(const ffi::AnyBuffer& x_q, const ffi::AnyBuffer& x_sf,
                                const ffi::Result<ffi::AnyBuffer>& out, MxShape* s) {
  if (x_q.element_type() != ffi::DataType::F8E4M3FN) {
    return InvalidArg(kMxDequantOp, "x_q", "float8_e4m3fn", DataTypeName(x_q.element_type()));
  }
  const auto dims = x_q.dimensions();
  if (dims.size() != 2 || dims[1] <= 0) {
    return InvalidArg(kMxDequantOp, "x_q", "[M, K] with K > 0", DimsToString(dims));
  }
  s->m = dims[0];
  s->k = dims[1];
  if (auto err = CheckMxScales(kMxDequantOp, x_sf.element_type(), x_sf.dimensions(), s); err.failure()) return err;
  return CheckOutput(kMxDequantOp, out, s->m, s->k);
}

struct NvShape {
  int64_t m = 0, k = 0;
};

ffi::Error CheckNvfp4Codes(const char* op, ffi::DataType q_type, ffi::Span<const int64_t> q_dims,
                           ffi::DataType sf_type, ffi::Span<const int64_t> sf_dims, const NvShape& s) {
  if (q_type != ffi::DataType::U8) return InvalidArg(op, "x_q", "uint8", DataTypeName(q_type));
  if (q_dims.size() != 2 || q_dims[0] != s.m || q_dims[1] != s.k / 2) {
    return InvalidArg(op, "x_q", "[M, K/2] = " + Pair(s.m, s.k / 2), DimsToString(q_dims));
  }
  if (sf_type != ffi::DataType::F8E4M3FN) return InvalidArg(op, "x_sf", "float8_e4m3fn", DataTypeName(sf_type));
  if (sf_dims.size() != 2 || sf_dims[0] != s.m || sf_dims[1] != s.k / kNvfp4Block) {
    return InvalidArg(op, "x_sf", "[M, K/16] = " + Pair(s.m, s.k / kNvfp4Block), DimsToString(sf_dims));
  }
  return ffi::Error::Success();
}

ffi::Error CheckQuantizeNvfp4(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::F32>& global_scale,
                              const ffi::Result<ffi::AnyBuffer>& x_q, const ffi::Result<ffi::AnyBuffer>& x_sf,
                              NvShape* s) {
  if (auto err = CheckFloatInput(kNvQuantOp, x); err.failure()) return err;
  const auto dims = x.dimensions();
  if (dims.size() != 2 || dims[1] <= 0 || dims[1] % kNvfp4Block != 0) {
    return InvalidArg(kNvQuantOp, "x", "[M, K] with K % 16 == 0 and K > 0", DimsToString(dims));
  }
  s->m = dims[0];
  s->k = dims[1];
  if (auto err = CheckScalar(kNvQuantOp, global_scale); err.failure()) return err;
  return CheckNvfp4Codes(kNvQuantOp, x_q->element_type(), x_q->dimensions(), x_sf->element_type(),
                         x_sf->dimensions(), *s);
}

ffi::Error CheckDequantizeNvfp4(const ffi::AnyBuffer& x_q, const ffi::AnyBuffer& x_sf,
                                const ffi::Buffer<ffi::F32>& global_scale, const ffi::Result<ffi::AnyBuffer>& out,
                                NvShape* s) {
  const auto dims = x_q.dimensions();
  if (dims.size() != 2 || dims[1] <= 0 || (2 * dims[1]) % kNvfp4Block != 0) {
    return InvalidArg(kNvDequantOp, "x_q", "[M, K/2] with K % 16 == 0 and K > 0", DimsToString(dims));
  }
  s->m = dims[0];
  s->k = 2 * dims[1];
  if (auto err = CheckNvfp4Codes(kNvDequantOp, x_q.element_type(), dims, x_sf.element_type(), x_sf.dimensions(), *s);
      err.failure()) {
    return err;
  }
  if (auto err = CheckScalar(kNvDequantOp, global_scale); err.failure()) return err;
  return CheckOutput(kNvDequantOp, out, s->m, s->k);
}

// ---------------------------------------------------------------------------------------------------------------
// CPU: float32 as XLA computes it on CPUs
// ---------------------------------------------------------------------------------------------------------------

inline uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}

inline float FromBits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

// A subnormal becomes a zero of its sign (XLA's CPU code runs with denormals flushed).
inline float Flush(float f) {
  const uint32_t b = Bits(f);
  return (b & 0x7F800000u) == 0 ? FromBits(b & 0x80000000u) : f;
}

inline bool IsNaN(float f) { return (Bits(f) & 0x7FFFFFFFu) > 0x7F800000u; }

inline float Mul(float a, float b) { return Flush(a * b); }

// A dequantized NaN is the float32 quiet NaN, whatever the operands' NaNs (quant_mx._canonical_nan).
inline float CanonicalNaN(float f) { return IsNaN(f) ? FromBits(kF32QuietNaN) : f; }

inline float Div(float a, float b) { return Flush(a / b); }

inline float HalfBitsToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
  if (exp == 0x1Fu) return FromBits(sign | 0x7F800000u | (mant << 13));
  if (exp != 0) return FromBits(sign | ((exp + 112u) << 23) | (mant << 13));
  const float v = std::ldexp(static_cast<float>(mant), -24);  // a float16 subnormal is a float32 normal: exact
  return sign ? -v : v;
}

// float32 -> float16 bits, round to nearest even (float16 subnormals kept); a NaN stays a quiet NaN of its sign.
inline uint16_t FloatToHalfBits(float f) {
  const uint32_t b = Bits(f);
  const uint16_t sign = static_cast<uint16_t>((b >> 16) & 0x8000u);
  const uint32_t a = b & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds past 65504: inf
  if (a < 0x38800000u) {  // below 2^-14: a float16 subnormal (multiples of 2^-24), rint rounds half to even
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::rint(std::ldexp(FromBits(a), 24))));
  }
  const uint32_t rounded = (a + 0xFFFu + ((a >> 13) & 1u)) >> 13;  // a carry moves into the exponent by itself
  return static_cast<uint16_t>(sign | (rounded - (112u << 10)));
}

// Reads element i of an input as float32, flushed.
struct Reader {
  ffi::DataType type;
  const void* data;
  float operator()(int64_t i) const {
    switch (type) {
      case ffi::DataType::BF16: return Flush(Bf16BitsToFloat(static_cast<const uint16_t*>(data)[i]));
      case ffi::DataType::F16: return Flush(HalfBitsToFloat(static_cast<const uint16_t*>(data)[i]));
      default: return Flush(static_cast<const float*>(data)[i]);
    }
  }
};

// Writes element i of an output from float32.
struct Writer {
  ffi::DataType type;
  void* data;
  void operator()(int64_t i, float v) const {
    switch (type) {
      case ffi::DataType::BF16: static_cast<uint16_t*>(data)[i] = FloatToBf16Bits(v); break;
      case ffi::DataType::F16: static_cast<uint16_t*>(data)[i] = FloatToHalfBits(v); break;
      default: static_cast<float*>(data)[i] = v; break;
    }
  }
};

ffi::Error QuantizeMxfp8CpuImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> x_q, ffi::Result<ffi::AnyBuffer> x_sf) {
  MxShape s;
  if (auto err = CheckQuantizeMxfp8(x, x_q, x_sf, &s); err.failure()) return err;
  const Reader read{x.element_type(), x.untyped_data()};
  auto* q = static_cast<uint8_t*>(x_q->untyped_data());
  auto* sf = static_cast<uint8_t*>(x_sf->untyped_data());
  float v[kMxBlock];
  for (int64_t row = 0; row < s.m; ++row) {
    for (int64_t c = 0; c < s.cols; ++c) {
      const int64_t begin = c * kMxBlock;
      const int64_t count = std::clamp<int64_t>(s.k - begin, 0, kMxBlock);
      float amax = 0.0f;
      bool finite = true;
      for (int64_t i = 0; i < kMxBlock; ++i) {
        v[i] = i < count ? read(row * s.k + begin + i) : 0.0f;
        finite = finite && std::isfinite(v[i]);
        amax = std::fmax(amax, std::fabs(v[i]));
      }
      uint8_t* codes = q + row * s.k + begin;
      if (!finite) {
        sf[row * s.cols + c] = kE8m0NaN;
        std::memset(codes, kE4m3NaN, static_cast<size_t>(count));
        continue;
      }
      const uint32_t biased = MxScaleBiased(Bits(amax));
      const float inv_scale = FromBits((254u - biased) << 23), limit = E4m3Limit(biased);
      sf[row * s.cols + c] = static_cast<uint8_t>(biased);
      for (int64_t i = 0; i < count; ++i) codes[i] = FloatToE4m3(std::fmin(std::fmax(Mul(v[i], inv_scale), -limit), limit));
    }
  }
  return ffi::Error::Success();
}

ffi::Error DequantizeMxfp8CpuImpl(ffi::AnyBuffer x_q, ffi::AnyBuffer x_sf, ffi::Result<ffi::AnyBuffer> out) {
  MxShape s;
  if (auto err = CheckDequantizeMxfp8(x_q, x_sf, out, &s); err.failure()) return err;
  const auto* q = static_cast<const uint8_t*>(x_q.untyped_data());
  const auto* sf = static_cast<const uint8_t*>(x_sf.untyped_data());
  const Writer write{out->element_type(), out->untyped_data()};
  for (int64_t row = 0; row < s.m; ++row) {
    for (int64_t col = 0; col < s.k; ++col) {
      const float scale = Flush(FromBits(E8m0ToFloatBits(sf[row * s.cols + col / kMxBlock])));
      write(row * s.k + col, CanonicalNaN(Mul(E4m3ToFloat(q[row * s.k + col]), scale)));
    }
  }
  return ffi::Error::Success();
}

float FiniteAmax(const Reader& read, int64_t n) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float v = read(i);
    if (std::isfinite(v)) amax = std::fmax(amax, std::fabs(v));
  }
  return amax;
}

ffi::Error Nvfp4GlobalScaleCpuImpl(ffi::AnyBuffer x, ffi::Result<ffi::Buffer<ffi::F32>> global_scale) {
  if (auto err = CheckFloatInput(kGlobalScaleOp, x); err.failure()) return err;
  if (global_scale->dimensions().size() != 0) {
    return InvalidArg(kGlobalScaleOp, "global_scale", "a float32 scalar (shape [])",
                      DimsToString(global_scale->dimensions()));
  }
  const float amax = FiniteAmax(Reader{x.element_type(), x.untyped_data()}, static_cast<int64_t>(x.element_count()));
  *global_scale->typed_data() = Div(std::fmax(amax, kAmaxFloor), kNvfp4GlobalDivisor);
  return ffi::Error::Success();
}

ffi::Error QuantizeNvfp4CpuImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::F32> global_scale,
                                ffi::Result<ffi::AnyBuffer> x_q, ffi::Result<ffi::AnyBuffer> x_sf) {
  NvShape s;
  if (auto err = CheckQuantizeNvfp4(x, global_scale, x_q, x_sf, &s); err.failure()) return err;
  const Reader read{x.element_type(), x.untyped_data()};
  const float gs = Flush(*global_scale.typed_data());
  auto* q = static_cast<uint8_t*>(x_q->untyped_data());
  auto* sf = static_cast<uint8_t*>(x_sf->untyped_data());
  const int64_t blocks = s.m * (s.k / kNvfp4Block);
  float v[kNvfp4Block];
  for (int64_t b = 0; b < blocks; ++b) {
    float amax = 0.0f;
    bool finite = true;
    for (int i = 0; i < kNvfp4Block; ++i) {
      v[i] = read(b * kNvfp4Block + i);
      finite = finite && std::isfinite(v[i]);
      amax = std::fmax(amax, std::fabs(v[i]));
    }
    uint8_t* packed = q + b * (kNvfp4Block / 2);
    if (!finite) {
      sf[b] = kE4m3NaN;
      std::memset(packed, 0, kNvfp4Block / 2);
      continue;
    }
    const float ratio = Div(Div(amax, kE2m1Max), gs);
    sf[b] = FloatToE4m3(ratio > 0.0f ? std::fmin(ratio, kE4m3Max) : 0.0f);
    const float denom = Mul(E4m3ToFloat(sf[b]), gs);
    for (int i = 0; i < kNvfp4Block; i += 2) {
      const float lo = denom > 0.0f ? Div(v[i], denom) : 0.0f, hi = denom > 0.0f ? Div(v[i + 1], denom) : 0.0f;
      packed[i / 2] = static_cast<uint8_t>(E2m1Code(lo, Bits(lo)) | (E2m1Code(hi, Bits(hi)) << 4));
    }
  }
  return ffi::Error::Success();
}

ffi::Error DequantizeNvfp4CpuImpl(ffi::AnyBuffer x_q, ffi::AnyBuffer x_sf, ffi::Buffer<ffi::F32> global_scale,
                                  ffi::Result<ffi::AnyBuffer> out) {
  NvShape s;
  if (auto err = CheckDequantizeNvfp4(x_q, x_sf, global_scale, out, &s); err.failure()) return err;
  const auto* q = static_cast<const uint8_t*>(x_q.untyped_data());
  const auto* sf = static_cast<const uint8_t*>(x_sf.untyped_data());
  const float gs = Flush(*global_scale.typed_data());
  const Writer write{out->element_type(), out->untyped_data()};
  const int64_t n = s.m * s.k;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t code = (q[i / 2] >> (4 * (i % 2))) & 0xFu;
    write(i, CanonicalNaN(Mul(Mul(E2m1Value(code), E4m3ToFloat(sf[i / kNvfp4Block])), gs)));
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------------------------
// CUDA
// ---------------------------------------------------------------------------------------------------------------

#ifdef JAX_MOE_A2A_WITH_CUDA
InputType InputTypeOf(ffi::DataType dt) {
  return dt == ffi::DataType::BF16 ? InputType::kBF16 : (dt == ffi::DataType::F16 ? InputType::kF16 : InputType::kF32);
}

OutputType OutputTypeOf(ffi::DataType dt) {
  return dt == ffi::DataType::BF16 ? OutputType::kBF16
                                   : (dt == ffi::DataType::F16 ? OutputType::kF16 : OutputType::kF32);
}

ffi::Error QuantizeMxfp8CudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                                 ffi::Result<ffi::AnyBuffer> x_q, ffi::Result<ffi::AnyBuffer> x_sf) {
  MxShape s;
  if (auto err = CheckQuantizeMxfp8(x, x_q, x_sf, &s); err.failure()) return err;
  ScopedDevice on(device);
  JAX_MOE_A2A_RETURN_IF_CUDA_ERROR(on.error());
  JAX_MOE_A2A_RETURN_IF_CUDA_ERROR(LaunchQuantizeMxfp8(stream, InputTypeOf(x.element_type()), x.untyped_data(),
                                                       static_cast<uint8_t*>(x_q->untyped_data()),
                                                       static_cast<uint8_t*>(x_sf->untyped_data()), s.m, s.k, s.cols));
  return ffi::Error::Success();
}

ffi::Error DequantizeMxfp8CudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x_q, ffi::AnyBuffer x_sf,
                                   ffi::Result<ffi::AnyBuffer> out) {
  MxShape s;
  if (auto err = CheckDequantizeMxfp8(x_q, x_sf, out, &s); err.failure()) return err;
  ScopedDevice on(device);
  JAX_MOE_A2A_RETURN_IF_CUDA_ERROR(on.error());
  JAX_MOE_A2A_RETURN_IF_CUDA_ERROR(LaunchDequantizeMxfp8(
      stream, OutputTypeOf(out->element_type()), static_cast<const uint8_t*>(x_q.untyped_data()),
      static_cast<const uint8_t*>(x_sf.untyped_data()), out->untyped_data(), s.m, s.k, s.cols));
  return ffi::Error::Success();
}

ffi::Error Nvfp4GlobalScaleCudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                                    ffi::Result<ffi::Buffer<ffi::F32>> global_scale) {
  if (auto err = CheckFloatInput(kGlobalScaleOp, x); err.failure()) return err;
  if (global_scale->dimensions().size() != 0) {
    return InvalidArg(kGlobalScaleOp, "global_scale", "a float32 scalar (shape [])",
                      DimsToString(global_scale->dimensions()));
  }
  ScopedDevice on(device);
  JAX_MOE_A2A_RETURN_IF_CUDA_ERROR(on.error());
  JAX_MOE_A2A_RETURN_IF_CUDA_ERROR(LaunchNvfp4GlobalScale(stream, InputTypeOf(x.element_type()), x.untyped_data(),
                                                          static_cast<int64_t>(x.element_count()),
                                                          global_scale->typed_data()));
  return ffi::Error::Success();
}

ffi::Error QuantizeNvfp4CudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                                 ffi::Buffer<ffi::F32> global_scale, ffi::Result<ffi::AnyBuffer> x_q,
                                 ffi::Result<ffi::AnyBuffer> x_sf) {
  NvShape s;
  if (auto err = CheckQuantizeNvfp4(x, global_scale, x_q, x_sf, &s); err.failure()) return err;
  ScopedDevice on(device);
  JAX_MOE_A2A_RETURN_IF_CUDA_ERROR(on.error());
  JAX_MOE_A2A_RETURN_IF_CUDA_ERROR(LaunchQuantizeNvfp4(stream, InputTypeOf(x.element_type()), x.untyped_data(),
                                                       global_scale.typed_data(),
                                                       static_cast<uint8_t*>(x_q->untyped_data()),
                                                       static_cast<uint8_t*>(x_sf->untyped_data()), s.m, s.k));
  return ffi::Error::Success();
}

ffi::Error DequantizeNvfp4CudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x_q, ffi::AnyBuffer x_sf,
                                   ffi::Buffer<ffi::F32> global_scale, ffi::Result<ffi::AnyBuffer> out) {
  NvShape s;
  if (auto err = CheckDequantizeNvfp4(x_q, x_sf, global_scale, out, &s); err.failure()) return err;
  ScopedDevice on(device);
  JAX_MOE_A2A_RETURN_IF_CUDA_ERROR(on.error());
  JAX_MOE_A2A_RETURN_IF_CUDA_ERROR(LaunchDequantizeNvfp4(
      stream, OutputTypeOf(out->element_type()), static_cast<const uint8_t*>(x_q.untyped_data()),
      static_cast<const uint8_t*>(x_sf.untyped_data()), global_scale.typed_data(), out->untyped_data(), s.m, s.k));
  return ffi::Error::Success();
}
#endif

}  // namespace

}  // namespace jax_moe_a2a

// clang-format off
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeA2aQuantizeMxfp8Cpu, jax_moe_a2a::QuantizeMxfp8CpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()    // x
                                  .Ret<xla::ffi::AnyBuffer>()    // x_q
                                  .Ret<xla::ffi::AnyBuffer>());  // x_sf

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeA2aDequantizeMxfp8Cpu, jax_moe_a2a::DequantizeMxfp8CpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()    // x_q
                                  .Arg<xla::ffi::AnyBuffer>()    // x_sf
                                  .Ret<xla::ffi::AnyBuffer>());  // out

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeA2aNvfp4GlobalScaleCpu, jax_moe_a2a::Nvfp4GlobalScaleCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()                  // x
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());    // global_scale

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeA2aQuantizeNvfp4Cpu, jax_moe_a2a::QuantizeNvfp4CpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()                // x
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()    // global_scale
                                  .Ret<xla::ffi::AnyBuffer>()                // x_q
                                  .Ret<xla::ffi::AnyBuffer>());              // x_sf

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeA2aDequantizeNvfp4Cpu, jax_moe_a2a::DequantizeNvfp4CpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()                // x_q
                                  .Arg<xla::ffi::AnyBuffer>()                // x_sf
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()    // global_scale
                                  .Ret<xla::ffi::AnyBuffer>());              // out

#ifdef JAX_MOE_A2A_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeA2aQuantizeMxfp8Cuda, jax_moe_a2a::QuantizeMxfp8CudaImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .Arg<xla::ffi::AnyBuffer>()                     // x
                                  .Ret<xla::ffi::AnyBuffer>()                     // x_q
                                  .Ret<xla::ffi::AnyBuffer>(),                    // x_sf
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeA2aDequantizeMxfp8Cuda, jax_moe_a2a::DequantizeMxfp8CudaImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .Arg<xla::ffi::AnyBuffer>()                     // x_q
                                  .Arg<xla::ffi::AnyBuffer>()                     // x_sf
                                  .Ret<xla::ffi::AnyBuffer>(),                    // out
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeA2aNvfp4GlobalScaleCuda, jax_moe_a2a::Nvfp4GlobalScaleCudaImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .Arg<xla::ffi::AnyBuffer>()                     // x
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),        // global_scale
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeA2aQuantizeNvfp4Cuda, jax_moe_a2a::QuantizeNvfp4CudaImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .Arg<xla::ffi::AnyBuffer>()                     // x
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()         // global_scale
                                  .Ret<xla::ffi::AnyBuffer>()                     // x_q
                                  .Ret<xla::ffi::AnyBuffer>(),                    // x_sf
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeA2aDequantizeNvfp4Cuda, jax_moe_a2a::DequantizeNvfp4CudaImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .Arg<xla::ffi::AnyBuffer>()                     // x_q
                                  .Arg<xla::ffi::AnyBuffer>()                     // x_sf
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()         // global_scale
                                  .Ret<xla::ffi::AnyBuffer>(),                    // out
                              {xla::ffi::Traits::kCmdBufferCompatible});
#endif
// clang-format on
