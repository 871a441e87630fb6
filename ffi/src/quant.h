// quant.h -- the FP8 1x128 blockwise quantization rule, shared by the CPU handler and the CUDA kernel.
//
// NOTES: this is the exact rule of quant._jax_quantize_fp8_blockwise; the three must agree bit for bit.
//   For each group g of kGroup consecutive values of a row (values upcast to float32):
//     amax  = max |x|                                          (exact)
//     scale = max(amax, kAmaxFloor) * kInvE4m3Max              (one float32 multiplication)
//     q     = e4m3_rne(clamp(x * (1 / scale), -448, 448))      (IEEE reciprocal, one multiplication)
//   A group whose amax is not finite (it holds NaN or +-inf) gets q = 0x7F (E4M3 NaN) for every value and
//   scale = the canonical float32 quiet NaN (0x7FC00000).
//   The rule uses only operations that XLA compiles as written (it turns a division by a constant or by a
//   broadcast into a multiplication by the reciprocal), so the twin, this handler and the kernel agree.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace jax_moe_a2a {

constexpr int kGroup = 128;             // values per scale (1x128)
constexpr float kE4m3Max = 448.0f;      // largest finite E4M3 (fn) value
constexpr float kInvE4m3Max = 1.0f / 448.0f;  // float32(1/448), rounded to nearest
constexpr float kAmaxFloor = 1e-12f;    // keeps the scale positive and normal for all-zero groups
constexpr uint8_t kE4m3NaN = 0x7F;      // canonical E4M3 (fn) NaN
constexpr uint32_t kF32QuietNaN = 0x7FC00000u;

// float32 -> E4M3 (fn) with round-to-nearest-even, for |f| <= 448 (the caller clamps). Host only: the CUDA
// kernel uses the hardware conversion, which rounds the same way.
inline uint8_t FloatToE4m3(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t abs_bits = bits & 0x7FFFFFFFu;
  if (abs_bits > 0x7F800000u) return kE4m3NaN;
  float a;
  std::memcpy(&a, &abs_bits, sizeof(a));
  uint32_t code;
  if (a < 0.015625f) {
    // Subnormal range (below 2^-6): multiples of 2^-9. The product is exact; rint rounds half to even.
    // A result of 8 is the smallest normal, whose code is also 8.
    code = static_cast<uint32_t>(std::rint(a * 512.0f));
  } else {
    // Round the float32 mantissa to 3 bits (half to even); a carry moves into the exponent by itself.
    const uint32_t rounded = (abs_bits + 0x7FFFFu + ((abs_bits >> 20) & 1u)) >> 20;
    code = rounded - (120u << 3);  // rebias the exponent from 127 to 7
  }
  if (code > 0x7Eu) code = 0x7Eu;  // saturate at 448
  return static_cast<uint8_t>(sign | code);
}

}  // namespace jax_moe_a2a
