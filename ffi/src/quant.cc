// quant.cc -- handlers of jax_moe_a2a_quantize_fp8_blockwise (1x128 groups of activation rows),
// jax_moe_a2a_quantize_fp8_weight[_with_transpose] (128x128 blocks of weights) and jax_moe_a2a_quantize_fp8_grouped_kmajor (128x1
// tiles of each group's tokens, transposed), CPU, and CUDA when built with it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
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
constexpr char kWeightTOp[] = "jax_moe_a2a_quantize_fp8_weight_with_transpose";
constexpr char kKmajorOp[] = "jax_moe_a2a_quantize_fp8_grouped_kmajor";
constexpr int64_t kMaxKmajorGroups = 65535;

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

// w_q_t: the transposed codes [..., K, N] of quantize_fp8_weight_with_transpose, or null.
ffi::Error CheckQuantizeWeight(const ffi::AnyBuffer& w, const ffi::Result<ffi::AnyBuffer>& w_q,
                               const ffi::Result<ffi::Buffer<ffi::F32>>& w_sf, const ffi::AnyBuffer* w_q_t,
                               WeightShape* s) {
  const char* op = w_q_t == nullptr ? kWeightOp : kWeightTOp;
  const auto dt = w.element_type();
  if (dt != ffi::DataType::BF16 && dt != ffi::DataType::F16 && dt != ffi::DataType::F32) {
    return InvalidArg(op, "w", "bfloat16, float16 or float32", DataTypeName(dt));
  }
  const auto dims = w.dimensions();
  if (dims.size() < 2 || dims[dims.size() - 1] == 0 || dims[dims.size() - 2] == 0) {
    return InvalidArg(op, "w", "[..., N, K] with N, K > 0", DimsToString(dims));
  }
  s->n = dims[dims.size() - 2];
  s->k = dims[dims.size() - 1];
  s->batch = 1;
  for (size_t i = 0; i + 2 < dims.size(); ++i) s->batch *= dims[i];
  if (w_q->element_type() != ffi::DataType::F8E4M3FN) {
    return InvalidArg(op, "w_q", "float8_e4m3fn", DataTypeName(w_q->element_type()));
  }
  const auto q_dims = w_q->dimensions();
  if (q_dims.size() != dims.size() || !std::equal(q_dims.begin(), q_dims.end(), dims.begin())) {
    return InvalidArg(op, "w_q", "w's shape " + DimsToString(dims), DimsToString(q_dims));
  }
  const auto sf_dims = w_sf->dimensions();
  const int64_t nb = (s->n + kGroup - 1) / kGroup, kb = (s->k + kGroup - 1) / kGroup;
  bool sf_ok = sf_dims.size() == dims.size() && sf_dims[dims.size() - 2] == nb && sf_dims[dims.size() - 1] == kb;
  for (size_t i = 0; sf_ok && i + 2 < dims.size(); ++i) sf_ok = sf_dims[i] == dims[i];
  if (!sf_ok) {
    return InvalidArg(op, "w_sf", "[..., ceil(N/128), ceil(K/128)] = [..., " + std::to_string(nb) + ", " +
                                             std::to_string(kb) + "]", DimsToString(sf_dims));
  }
  if (w_q_t != nullptr) {
    if (w_q_t->element_type() != ffi::DataType::F8E4M3FN) {
      return InvalidArg(op, "w_q_t", "float8_e4m3fn", DataTypeName(w_q_t->element_type()));
    }
    std::vector<int64_t> t_dims(dims.begin(), dims.end());
    std::swap(t_dims[dims.size() - 2], t_dims[dims.size() - 1]);
    const auto qt_dims = w_q_t->dimensions();
    if (qt_dims.size() != t_dims.size() || !std::equal(qt_dims.begin(), qt_dims.end(), t_dims.begin())) {
      return InvalidArg(op, "w_q_t", "[..., K, N] = " + DimsToString(t_dims), DimsToString(qt_dims));
    }
  }
  return ffi::Error::Success();
}

// quantize_fp8_grouped_kmajor: x [R, C] (bfloat16, float16, float32, or E4M3 with x_sf [R, C/128]; otherwise x_sf
// is [0]), rows [M] int32 (sorted row i is x[rows[i]], a zero row where rows[i] is outside [0, R)) or [0] (M = R,
// sorted row i is x[i]), group_sizes [G] -> q_t [C, P] E4M3, sf_t [P/128, C] float32, blocks [P/128, 2] int32 (per
// block of 128 columns: its first sorted row and how many rows it holds), P = GroupedKmajorLength(M, G).
struct KmajorShape {
  int64_t m = 0, r = 0, c = 0, groups = 0, p = 0;
  bool fp8 = false, gather = false;
};

ffi::Error CheckQuantizeKmajor(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::F32>& x_sf,
                               const ffi::Buffer<ffi::S32>& rows, const ffi::Buffer<ffi::S32>& group_sizes,
                               const ffi::Result<ffi::AnyBuffer>& q_t,
                               const ffi::Result<ffi::Buffer<ffi::F32>>& sf_t,
                               const ffi::Result<ffi::Buffer<ffi::S32>>& blocks, KmajorShape* s) {
  const auto dt = x.element_type();
  if (dt != ffi::DataType::BF16 && dt != ffi::DataType::F16 && dt != ffi::DataType::F32 &&
      dt != ffi::DataType::F8E4M3FN) {
    return InvalidArg(kKmajorOp, "x", "bfloat16, float16, float32 or float8_e4m3fn", DataTypeName(dt));
  }
  s->fp8 = dt == ffi::DataType::F8E4M3FN;
  const auto dims = x.dimensions();
  if (dims.size() != 2 || dims[1] <= 0 || dims[1] % kGroup != 0 || dims[0] > 0x7FFFFFFF) {
    return InvalidArg(kKmajorOp, "x", "[R, C] with C a positive multiple of 128 and R < 2^31", DimsToString(dims));
  }
  s->r = dims[0];
  s->c = dims[1];
  const auto r_dims = rows.dimensions();
  if (r_dims.size() != 1 || r_dims[0] > 0x7FFFFFFF) {
    return InvalidArg(kKmajorOp, "rows", "[M] with M < 2^31, or [0]", DimsToString(r_dims));
  }
  s->gather = r_dims[0] > 0;
  s->m = s->gather ? r_dims[0] : s->r;
  const auto sf_dims = x_sf.dimensions();
  if (s->fp8 ? (sf_dims.size() != 2 || sf_dims[0] != s->r || sf_dims[1] != s->c / kGroup)
             : (sf_dims.size() != 1 || sf_dims[0] != 0)) {
    return InvalidArg(kKmajorOp, "x_sf", s->fp8 ? "[R, C/128] = [" + std::to_string(s->r) + ", " +
                                                      std::to_string(s->c / kGroup) + "] (x is float8_e4m3fn)"
                                                : std::string("[0] (x is not float8_e4m3fn)"),
                      DimsToString(sf_dims));
  }
  const auto g_dims = group_sizes.dimensions();
  if (g_dims.size() != 1 || g_dims[0] < 1 || g_dims[0] > kMaxKmajorGroups) {
    return InvalidArg(kKmajorOp, "group_sizes", "[G] with 1 <= G <= 65535", DimsToString(g_dims));
  }
  s->groups = g_dims[0];
  s->p = GroupedKmajorLength(s->m, s->groups);
  if (q_t->element_type() != ffi::DataType::F8E4M3FN) {
    return InvalidArg(kKmajorOp, "q_t", "float8_e4m3fn", DataTypeName(q_t->element_type()));
  }
  const auto q_dims = q_t->dimensions();
  if (q_dims.size() != 2 || q_dims[0] != s->c || q_dims[1] != s->p) {
    return InvalidArg(kKmajorOp, "q_t", "[C, P] = [" + std::to_string(s->c) + ", " + std::to_string(s->p) + "]",
                      DimsToString(q_dims));
  }
  const auto t_dims = sf_t->dimensions();
  if (t_dims.size() != 2 || t_dims[0] != s->p / kGroup || t_dims[1] != s->c) {
    return InvalidArg(kKmajorOp, "sf_t", "[P/128, C] = [" + std::to_string(s->p / kGroup) + ", " +
                                             std::to_string(s->c) + "]", DimsToString(t_dims));
  }
  const auto b_dims = blocks->dimensions();
  if (b_dims.size() != 2 || b_dims[0] != s->p / kGroup || b_dims[1] != 2) {
    return InvalidArg(kKmajorOp, "blocks", "[P/128, 2] = [" + std::to_string(s->p / kGroup) + ", 2]",
                      DimsToString(b_dims));
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
// w_q_t, when not null, receives the codes transposed: [batch, k, n].
template <typename Load>
void QuantizeWeightBlocks(Load load, int64_t batch, int64_t n, int64_t k, uint8_t* w_q, float* w_sf,
                          uint8_t* w_q_t) {
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
        if (w_q_t == nullptr) continue;
        for (int64_t c = 0; c < cols; ++c) {
          uint8_t* dst = w_q_t + (b * k + j * kGroup + c) * n + i * kGroup;
          for (int64_t r = 0; r < rows; ++r) dst[r] = codes[r * cols + c];
        }
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

ffi::Error QuantizeWeightCpu(const ffi::AnyBuffer& w, ffi::Result<ffi::AnyBuffer>& w_q,
                             ffi::Result<ffi::Buffer<ffi::F32>>& w_sf, ffi::AnyBuffer* w_q_t) {
  WeightShape s;
  if (auto err = CheckQuantizeWeight(w, w_q, w_sf, w_q_t, &s); err.failure()) return err;
  auto* q = reinterpret_cast<uint8_t*>(w_q->untyped_data());
  float* sf = w_sf->typed_data();
  auto* q_t = w_q_t == nullptr ? nullptr : reinterpret_cast<uint8_t*>(w_q_t->untyped_data());
  switch (w.element_type()) {
    case ffi::DataType::BF16: {
      const auto* p = reinterpret_cast<const uint16_t*>(w.untyped_data());
      QuantizeWeightBlocks([p](int64_t i) { return Bf16BitsToFloat(p[i]); }, s.batch, s.n, s.k, q, sf, q_t);
      break;
    }
    case ffi::DataType::F16: {
      const auto* p = reinterpret_cast<const uint16_t*>(w.untyped_data());
      QuantizeWeightBlocks([p](int64_t i) { return F16ToFloat(p[i]); }, s.batch, s.n, s.k, q, sf, q_t);
      break;
    }
    default: {
      const auto* p = reinterpret_cast<const float*>(w.untyped_data());
      QuantizeWeightBlocks([p](int64_t i) { return p[i]; }, s.batch, s.n, s.k, q, sf, q_t);
      break;
    }
  }
  return ffi::Error::Success();
}

ffi::Error QuantizeFp8WeightCpuImpl(ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> w_q,
                                    ffi::Result<ffi::Buffer<ffi::F32>> w_sf) {
  return QuantizeWeightCpu(w, w_q, w_sf, nullptr);
}

ffi::Error QuantizeFp8WeightWithTransposeCpuImpl(ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> w_q,
                                                 ffi::Result<ffi::Buffer<ffi::F32>> w_sf,
                                                 ffi::Result<ffi::AnyBuffer> w_q_t) {
  return QuantizeWeightCpu(w, w_q, w_sf, &*w_q_t);
}

// Per block j of 128 columns of the K-major layout: blocks[2j] = its first source row, blocks[2j + 1] = how many of
// its columns hold rows (0: padding only). The device's setup kernel computes the same table.
void GroupedKmajorBlocks(const int32_t* sizes, int64_t groups, int64_t rows, int64_t p, int32_t* blocks) {
  std::memset(blocks, 0, static_cast<size_t>(p / kGroup) * 2 * sizeof(int32_t));
  int64_t start = 0, block = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t size = std::min<int64_t>(std::max<int64_t>(sizes[g], 0), rows - start);
    for (int64_t done = 0; done < size; done += kGroup, ++block) {
      blocks[2 * block] = static_cast<int32_t>(start + done);
      blocks[2 * block + 1] = static_cast<int32_t>(std::min<int64_t>(kGroup, size - done));
    }
    start += size;
  }
}

// q_t and sf_t of the K-major layout from the rows read by load(row, column): each block of 128 columns and each
// column c of x is one group of the rule (padding counts as 0 and stays code 0).
template <typename Load>
void QuantizeKmajorBlocks(Load load_x, const KmajorShape& s, const int32_t* gather, const int32_t* blocks,
                          uint8_t* q_t, float* sf_t) {
  // Sorted row i is x[gather[i]] (a zero row outside [0, R)), or x[i] without a gather.
  auto load = [&](int64_t i, int64_t c) {
    const int64_t src = gather == nullptr ? i : gather[i];
    return src < 0 || src >= s.r ? 0.0f : load_x(src, c);
  };
  std::vector<float> rows(static_cast<size_t>(kGroup * s.c));
  float v[kGroup];
  uint8_t codes[kGroup];
  for (int64_t j = 0; j < s.p / kGroup; ++j) {
    const int64_t first = blocks[2 * j], count = blocks[2 * j + 1];
    for (int64_t i = 0; i < count; ++i) {
      for (int64_t c = 0; c < s.c; ++c) rows[i * s.c + c] = load(first + i, c);
    }
    for (int64_t c = 0; c < s.c; ++c) {
      for (int64_t i = 0; i < kGroup; ++i) v[i] = i < count ? rows[i * s.c + c] : 0.0f;
      sf_t[j * s.c + c] = EncodeGroup(v, kGroup, codes);
      std::memset(codes + count, 0, static_cast<size_t>(kGroup - count));
      std::memcpy(q_t + c * s.p + j * kGroup, codes, kGroup);
    }
  }
}

ffi::Error QuantizeFp8GroupedKmajorCpuImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::F32> x_sf, ffi::Buffer<ffi::S32> rows,
                                           ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> q_t,
                                           ffi::Result<ffi::Buffer<ffi::F32>> sf_t,
                                           ffi::Result<ffi::Buffer<ffi::S32>> blocks) {
  KmajorShape s;
  if (auto err = CheckQuantizeKmajor(x, x_sf, rows, group_sizes, q_t, sf_t, blocks, &s); err.failure()) return err;
  const int32_t* gather = s.gather ? rows.typed_data() : nullptr;
  int32_t* table = blocks->typed_data();
  GroupedKmajorBlocks(group_sizes.typed_data(), s.groups, s.m, s.p, table);
  auto* q = reinterpret_cast<uint8_t*>(q_t->untyped_data());
  float* sf = sf_t->typed_data();
  const int64_t c = s.c;
  switch (x.element_type()) {
    case ffi::DataType::BF16: {
      const auto* p = reinterpret_cast<const uint16_t*>(x.untyped_data());
      QuantizeKmajorBlocks([p, c](int64_t r, int64_t k) { return Bf16BitsToFloat(p[r * c + k]); }, s, gather, table, q, sf);
      break;
    }
    case ffi::DataType::F16: {
      const auto* p = reinterpret_cast<const uint16_t*>(x.untyped_data());
      QuantizeKmajorBlocks([p, c](int64_t r, int64_t k) { return F16ToFloat(p[r * c + k]); }, s, gather, table, q, sf);
      break;
    }
    case ffi::DataType::F32: {
      const auto* p = reinterpret_cast<const float*>(x.untyped_data());
      QuantizeKmajorBlocks([p, c](int64_t r, int64_t k) { return p[r * c + k]; }, s, gather, table, q, sf);
      break;
    }
    default: {  // E4M3 codes, decoded with their 1x128 scales: code * scale in float32
      const auto* p = reinterpret_cast<const uint8_t*>(x.untyped_data());
      const float* scale = x_sf.typed_data();
      const int64_t groups_per_row = c / kGroup;
      QuantizeKmajorBlocks([p, c, scale, groups_per_row](int64_t r, int64_t k) {
        return E4m3ToFloat(p[r * c + k]) * scale[r * groups_per_row + k / kGroup];
      }, s, gather, table, q, sf);
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

ffi::Error QuantizeWeightCuda(cudaStream_t stream, int32_t device, const ffi::AnyBuffer& w,
                              ffi::Result<ffi::AnyBuffer>& w_q, ffi::Result<ffi::Buffer<ffi::F32>>& w_sf,
                              ffi::AnyBuffer* w_q_t) {
  WeightShape s;
  if (auto err = CheckQuantizeWeight(w, w_q, w_sf, w_q_t, &s); err.failure()) return err;
  const char* op = w_q_t == nullptr ? kWeightOp : kWeightTOp;
  const int64_t vec = 16 / static_cast<int64_t>(ffi::ByteWidth(w.element_type()));
  if (s.k % vec != 0) return InvalidArg(op, "K on the GPU", "a multiple of " + std::to_string(vec), s.k);
  if (w_q_t != nullptr && s.n % 16 != 0) return InvalidArg(op, "N on the GPU", "a multiple of 16", s.n);
  if ((s.n + kGroup - 1) / kGroup > 65535 || s.batch > 65535) {
    return InvalidArg(op, "w on the GPU", "ceil(N/128) <= 65535 and a batch of at most 65535",
                      DimsToString(w.dimensions()));
  }
  InputType type = InputType::kF32;
  if (w.element_type() == ffi::DataType::BF16) type = InputType::kBF16;
  if (w.element_type() == ffi::DataType::F16) type = InputType::kF16;
  ScopedDevice on(device);
  JAX_MOE_A2A_RETURN_IF_CUDA_ERROR(on.error());
  JAX_MOE_A2A_RETURN_IF_CUDA_ERROR(LaunchQuantizeFp8Weight(
      stream, type, w.untyped_data(), reinterpret_cast<uint8_t*>(w_q->untyped_data()), w_sf->typed_data(),
      w_q_t == nullptr ? nullptr : reinterpret_cast<uint8_t*>(w_q_t->untyped_data()), s.batch, s.n, s.k));
  return ffi::Error::Success();
}

ffi::Error QuantizeFp8WeightCudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer w,
                                     ffi::Result<ffi::AnyBuffer> w_q, ffi::Result<ffi::Buffer<ffi::F32>> w_sf) {
  return QuantizeWeightCuda(stream, device, w, w_q, w_sf, nullptr);
}

ffi::Error QuantizeFp8WeightWithTransposeCudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer w,
                                                  ffi::Result<ffi::AnyBuffer> w_q,
                                                  ffi::Result<ffi::Buffer<ffi::F32>> w_sf,
                                                  ffi::Result<ffi::AnyBuffer> w_q_t) {
  return QuantizeWeightCuda(stream, device, w, w_q, w_sf, &*w_q_t);
}
ffi::Error QuantizeFp8GroupedKmajorCudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                                            ffi::Buffer<ffi::F32> x_sf, ffi::Buffer<ffi::S32> rows,
                                            ffi::Buffer<ffi::S32> group_sizes,
                                            ffi::Result<ffi::AnyBuffer> q_t, ffi::Result<ffi::Buffer<ffi::F32>> sf_t,
                                            ffi::Result<ffi::Buffer<ffi::S32>> blocks) {
  KmajorShape s;
  if (auto err = CheckQuantizeKmajor(x, x_sf, rows, group_sizes, q_t, sf_t, blocks, &s); err.failure()) return err;
  InputType type = InputType::kF32;
  if (x.element_type() == ffi::DataType::BF16) type = InputType::kBF16;
  if (x.element_type() == ffi::DataType::F16) type = InputType::kF16;
  ScopedDevice on(device);
  JAX_MOE_A2A_RETURN_IF_CUDA_ERROR(on.error());
  JAX_MOE_A2A_RETURN_IF_CUDA_ERROR(LaunchQuantizeFp8GroupedKmajor(
      stream, type, x.untyped_data(), s.fp8 ? x_sf.typed_data() : nullptr, s.gather ? rows.typed_data() : nullptr,
      s.r, group_sizes.typed_data(), s.groups, reinterpret_cast<uint8_t*>(q_t->untyped_data()), sf_t->typed_data(),
      blocks->typed_data(), s.m, s.c));
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeA2aQuantizeFp8WeightWithTransposeCpu,
                              jax_moe_a2a::QuantizeFp8WeightWithTransposeCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()                  // w
                                  .Ret<xla::ffi::AnyBuffer>()                  // w_q
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()      // w_sf
                                  .Ret<xla::ffi::AnyBuffer>());                // w_q_t

#ifdef JAX_MOE_A2A_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeA2aQuantizeFp8WeightWithTransposeCuda,
                              jax_moe_a2a::QuantizeFp8WeightWithTransposeCudaImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .Arg<xla::ffi::AnyBuffer>()                     // w
                                  .Ret<xla::ffi::AnyBuffer>()                     // w_q
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()         // w_sf
                                  .Ret<xla::ffi::AnyBuffer>(),                    // w_q_t
                              {xla::ffi::Traits::kCmdBufferCompatible});
#endif

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeA2aQuantizeFp8GroupedKmajorCpu, jax_moe_a2a::QuantizeFp8GroupedKmajorCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()                  // x
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()      // x_sf ([0] unless x is E4M3)
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()      // rows ([0]: x's rows in order)
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()      // group_sizes
                                  .Ret<xla::ffi::AnyBuffer>()                  // q_t
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()      // sf_t
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>());    // blocks

#ifdef JAX_MOE_A2A_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeA2aQuantizeFp8GroupedKmajorCuda, jax_moe_a2a::QuantizeFp8GroupedKmajorCudaImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .Arg<xla::ffi::AnyBuffer>()                     // x
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()         // x_sf
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // rows
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // group_sizes
                                  .Ret<xla::ffi::AnyBuffer>()                     // q_t
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()         // sf_t
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>(),        // blocks
                              {xla::ffi::Traits::kCmdBufferCompatible});
#endif
