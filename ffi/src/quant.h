// quant.h -- the FP8 1x128 blockwise quantization rule, shared by the CPU handler and the CUDA kernel.
//
// NOTES: this is the exact rule of quant._jax_quantize_fp8_blockwise; the three must agree bit for bit.
//   For each group g of kGroup consecutive values of a row (values upcast to float32):
//     amax  = max |x|                                                      (exact)
//     scale = 2^e, the smallest power of two with max(amax, kAmaxFloor) <= 448 * 2^e   (from the bits, exact)
//     q     = e4m3_rne(clamp(x * 2^-e, -L, L))                              (the product is exact)
//   with L = 448, or 240 at the top scale 2^120 (E4m3Limit): a value near the float32 maximum would round to the
//   code 256 there, and 256 * 2^120 = 2^128 overflows float32 on dequantization.
//   A group whose amax is not finite (it holds NaN or +-inf) gets q = 0x7F (E4M3 NaN) for every value and
//   scale = the canonical float32 quiet NaN (0x7FC00000).
//   With a power-of-two scale the only rounding is the conversion to E4M3, so the pure-JAX reference (whatever XLA
//   does to its divisions), this handler and the CUDA kernel agree bit for bit.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace jax_moe_a2a {

constexpr int kGroup = 128;             // values per scale (1x128)
constexpr float kE4m3Max = 448.0f;      // largest finite E4M3 (fn) value
constexpr float kAmaxFloor = 1e-12f;    // keeps the scale positive and normal for all-zero groups
constexpr uint8_t kE4m3NaN = 0x7F;      // canonical E4M3 (fn) NaN
constexpr uint32_t kF32QuietNaN = 0x7FC00000u;

// Biased (+127) exponent of the scale 2^e for a finite amax: amax = 1.f * 2^(E - 127) and 448 = 1.75 * 2^8, so
// e = E - 127 - 8, plus one when 1.f > 1.75 (mantissa field > 0x600000). With the floor, it lies in [79, 247].
#ifdef __CUDACC__
__host__ __device__
#endif
inline uint32_t ScaleExponent(uint32_t amax_bits) {
  return ((amax_bits >> 23) & 0xFFu) - 8u + ((amax_bits & 0x7FFFFFu) > 0x600000u ? 1u : 0u);
}

// The largest scale a finite amax gets is 2^120 (biased exponent 247: amax in [1.75 * 2^127, 2^128)); there the
// scaled values are clamped to 240, the largest E4M3 value whose product with 2^120 is finite.
constexpr uint32_t kTopScaleBiased = 247;
constexpr float kE4m3MaxAtTopScale = 240.0f;

// The clamp of the scaled values for a scale of biased exponent `biased` (quant._e4m3_limit).
#ifdef __CUDACC__
__host__ __device__
#endif
inline float E4m3Limit(uint32_t biased) { return biased >= kTopScaleBiased ? kE4m3MaxAtTopScale : kE4m3Max; }

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

// E4M3 (fn) byte -> float32, exact (host; the CUDA kernel uses the hardware conversion, also exact): 1 sign, 4
// exponent (bias 7), 3 mantissa bits, no infinities, NaN 0x7F/0xFF.
inline float E4m3ToFloat(uint8_t byte) {
  const int exp = (byte >> 3) & 0xF, mant = byte & 0x7;
  float v;
  if (exp == 0xF && mant == 0x7) {
    v = std::nanf("");
  } else if (exp == 0) {
    v = std::ldexp(static_cast<float>(mant), -9);  // subnormal: mant/8 * 2^-6
  } else {
    v = std::ldexp(1.0f + mant / 8.0f, exp - 7);
  }
  return (byte & 0x80) ? -v : v;
}

// Grouped K-major layout (quant.quantize_fp8_grouped_kmajor): rows sorted by group, group g's rows clamped as the
// contiguous grouped GEMM clamps them (sizes to >= 0, the running total saturating at the row count), each group
// padded to a multiple of kGroup tokens. P = round_up(rows, 128) + 128 * groups holds every group.
inline int64_t GroupedKmajorLength(int64_t rows, int64_t groups) {
  return (rows + kGroup - 1) / kGroup * kGroup + kGroup * groups;
}

}  // namespace jax_moe_a2a
