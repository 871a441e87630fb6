// quant_mx.h -- the MXFP8 and NVFP4 rules shared by the CPU handlers (quant_mx.cc) and the CUDA kernels
// (quant_mx_kernels.cu); the pure-JAX references are in jax_moe_a2a/quant_mx.py, and the three agree bit for bit.
//
// MXFP8, per block of kMxBlock values of a row (float32):
//   biased = clamp(E(amax) - 8 + (mantissa(amax) > 0x600000), 0, 254)      the E8M0 byte, from the bits of amax
//   q      = e4m3_rne(clamp(x * 2^(127 - biased), -L, L))                   L = E4m3Limit(biased), the product exact
//   a block holding a NaN or an infinity: q = 0x7F everywhere, scale byte 0xFF.
// NVFP4, per block of kNvfp4Block values, with the global (decode) scale gs:
//   ratio = (amax / 6) / gs                                                  correctly rounded divisions
//   s     = e4m3_rne(ratio > 0 ? min(ratio, 448) : +0)                       (NaN ratio: +0)
//   d     = float(s) * gs;  code = d > 0 ? e2m1(x / d) : +0                  e2m1: nearest even, saturating at 6
//   a block holding a NaN or an infinity: codes +0, s = 0x7F.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace jax_moe_a2a {

constexpr int kMxBlock = 32;      // values per E8M0 scale
constexpr int kNvfp4Block = 16;   // values per E4M3 scale
constexpr uint8_t kE8m0NaN = 0xFF;
constexpr float kE2m1Max = 6.0f;
constexpr float kNvfp4GlobalDivisor = 2688.0f;  // 448 * 6: the global scale maps the tensor amax to 448 * 6

#ifdef __CUDACC__
#define JAX_MOE_A2A_HD __host__ __device__
#else
#define JAX_MOE_A2A_HD
#endif

// The E8M0 byte of a block of finite amax (bits `amax_bits`): the biased exponent of the smallest power of two
// 2^e with amax <= 448 * 2^e, clamped to E8M0's finite range (an all-zero block gets 0, i.e. 2^-127).
JAX_MOE_A2A_HD inline uint32_t MxScaleBiased(uint32_t amax_bits) {
  const int e = static_cast<int>((amax_bits >> 23) & 0xFFu) - 8 + ((amax_bits & 0x7FFFFFu) > 0x600000u ? 1 : 0);
  return static_cast<uint32_t>(e < 0 ? 0 : (e > 254 ? 254 : e));
}

// float32 (not NaN) -> E2M1 code (0..15): the magnitude's index in {0, 0.5, 1, 1.5, 2, 3, 4, 6}, rounded to
// nearest with ties to the even code, saturated at 6; bit 3 is the sign bit of v (so -0 gives 8). The reference's
// threshold comparisons, computed from the bits: below 1 the grid is the multiples of 0.5 (rint of 2|v|, half to
// even); from 1 up, rounding the float32 mantissa to one bit (half to even) gives the code directly, since E2M1's
// exponent bias is 1 (code = rounded - 2 * 126), and a carry moves into the exponent by itself.
JAX_MOE_A2A_HD inline uint32_t E2m1Code(float v, uint32_t v_bits) {
  const uint32_t abs_bits = v_bits & 0x7FFFFFFFu;
  uint32_t mag;
  if (abs_bits < 0x3F800000u) {
    mag = static_cast<uint32_t>(rintf((v < 0.0f ? -v : v) * 2.0f));
  } else {
    const uint32_t rounded = ((abs_bits + 0x1FFFFFu + ((abs_bits >> 22) & 1u)) >> 22) - 252u;
    mag = rounded < 7u ? rounded : 7u;
  }
  return mag | ((v_bits >> 28) & 8u);
}

// E2M1 code (low 4 bits) -> float32, exact.
JAX_MOE_A2A_HD inline float E2m1Value(uint32_t code) {
  const uint32_t e = (code >> 1) & 3u, m = code & 1u;
  // e == 0: 0 or 0.5; otherwise (1 + m/2) * 2^(e-1).
  uint32_t bits = e == 0 ? (m ? 0x3F000000u : 0u) : (((e + 126u) << 23) | (m << 22));
  bits |= (code & 8u) << 28;
  float f;
#ifdef __CUDA_ARCH__
  f = __uint_as_float(bits);
#else
  std::memcpy(&f, &bits, sizeof(f));
#endif
  return f;
}

// E8M0 byte -> float32 scale: 2^(byte - 127); 0xFF is NaN. Byte 0 is 2^-127, a float32 subnormal.
JAX_MOE_A2A_HD inline uint32_t E8m0ToFloatBits(uint32_t byte) {
  return byte == kE8m0NaN ? 0x7FC00000u : (byte == 0 ? 0x00400000u : byte << 23);
}

#undef JAX_MOE_A2A_HD

}  // namespace jax_moe_a2a
