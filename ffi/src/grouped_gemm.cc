// grouped_gemm.cc -- handlers of jax_moe_a2a_grouped_gemm_fp8, jax_moe_a2a_grouped_gemm_fp8_wgrad and
// jax_moe_a2a_grouped_gemm_bf16 (CPU, and CUDA when built with it).
//
// ── grouped_gemm_fp8 ──
// D_g = A_g · B_gᵀ for every group g, A in E4M3 with one FP32 scale per 1x128 group of a row, B in E4M3 with one
// FP32 scale per 128x128 block, D in bfloat16 (float32 accumulation).
//
// Operands (attribute `masked` picks the layout of A, its scales and D):
//   contiguous: a [M, K], a_sf [M, K/128], d [M, N]; groups own consecutive rows in order, group g the rows
//               [start_g, start_g + size_g) with size_g = group_sizes[g] clamped to >= 0 and to the rows left.
//   masked:     a [G, R, K], a_sf [G, R, K/128], d [G, R, N]; group g owns its first clamp(group_sizes[g], 0, R)
//               rows.
//   always:     b [G, N, K], b_sf [G, N/128, K/128], group_sizes [G] int32; K % 128 == 0, N % 128 == 0.
// Rows of d that no group owns are zero. `scratch` (uint8) is device scratch for the CUDA kernel, sized by
// grouped_gemm_scratch_bytes(G) in the Python module; the CPU handler ignores it.
//
// ── grouped_gemm_fp8_wgrad ──
// d[g] = A_g · B_gᵀ over group g's token columns, both operands K-major E4M3 as quant.quantize_fp8_grouped_kmajor
// writes them: a_t [Na, P], b_t [Nb, P], scales a_sf_t [P/128, Na], b_sf_t [P/128, Nb] (one per 128 tokens x 1
// row), group_sizes [G], d [G, Na, Nb] float32 or bfloat16. Group g contracts the columns [off_g, off_g + pad_g),
// pad_g = round_up(size_g, 128), off_g the sum of the earlier pads, sizes clamped against R = P - 128 G (the
// quantizer's round_up(M, 128)); a group with no rows gives zeros. Na, Nb positive multiples of 128.
//
// ── grouped_gemm_bf16 ──
// bfloat16 operands, float32 accumulation, in three modes (attribute `mode`, grouped_gemm_bf16_kernels.cuh):
//   0 (NT): a [M, K], b [G, N, K], d [M, N] bf16: d_g = a_g · b_gᵀ   (the forward product)
//   1 (NN): a [M, K], b [G, K, N], d [M, N] bf16: d_g = a_g · b_g    (the data gradient)
//   2 (TN): a [M, K], b [M, N],    d [G, K, N] f32 or bf16: d[g] = a_gᵀ · b_g (the weight gradient)
// Rows of a (and of b in mode 2) are grouped as in the contiguous FP8 layout; rows of d no group owns, and d[g] of a
// group that owns no rows, are zero. K and N must be positive multiples of 8 (16-byte rows).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "handlers.h"
#include "quant.h"
#include "xla/ffi/api/ffi.h"

#ifdef JAX_MOE_A2A_WITH_CUDA
#include "grouped_gemm_bf16_kernels.cuh"
#include "grouped_gemm_kernels.cuh"
#include "grouped_gemm_wgrad_kernels.cuh"
#endif

namespace jax_moe_a2a {

namespace {

constexpr char kOp[] = "jax_moe_a2a_grouped_gemm_fp8";
constexpr char kOpBf16[] = "jax_moe_a2a_grouped_gemm_bf16";
constexpr char kOpWgrad[] = "jax_moe_a2a_grouped_gemm_fp8_wgrad";
constexpr int64_t kBlock = 128;
constexpr int64_t kMaxGroups = 65535;  // the zero-fill kernel's grid.y in the masked layout

// ---------------------------------------------------------------------------------------------------------------
// Shape and dtype checks (shared by both platforms)
// ---------------------------------------------------------------------------------------------------------------

struct GemmShape {
  int64_t groups = 0;
  int64_t rows = 0;  // contiguous: M; masked: R (rows per group)
  int64_t n = 0;
  int64_t k = 0;
};

std::string Dims(std::initializer_list<int64_t> dims) { return DimsToString(std::vector<int64_t>(dims)); }

template <typename Buffer>
bool HasDims(const Buffer& buffer, std::initializer_list<int64_t> want) {
  const auto dims = buffer.dimensions();
  if (dims.size() != want.size()) return false;
  size_t i = 0;
  for (int64_t w : want) {
    if (dims[i++] != w) return false;
  }
  return true;
}

ffi::Error CheckGroupedGemm(const ffi::AnyBuffer& a, const ffi::Buffer<ffi::F32>& a_sf, const ffi::AnyBuffer& b,
                            const ffi::Buffer<ffi::F32>& b_sf, const ffi::Buffer<ffi::S32>& group_sizes,
                            const ffi::Result<ffi::Buffer<ffi::BF16>>& d, bool masked, GemmShape* s) {
  if (a.element_type() != ffi::DataType::F8E4M3FN) {
    return InvalidArg(kOp, "a", "float8_e4m3fn", DataTypeName(a.element_type()));
  }
  if (b.element_type() != ffi::DataType::F8E4M3FN) {
    return InvalidArg(kOp, "b", "float8_e4m3fn", DataTypeName(b.element_type()));
  }
  const auto b_dims = b.dimensions();
  if (b_dims.size() != 3 || b_dims[0] < 1 || b_dims[0] > kMaxGroups || b_dims[1] % kBlock || b_dims[1] == 0 ||
      b_dims[2] % kBlock || b_dims[2] == 0) {
    return InvalidArg(kOp, "b", "[G, N, K] with 1 <= G <= 65535 and N, K positive multiples of 128",
                      DimsToString(b_dims));
  }
  s->groups = b_dims[0];
  s->n = b_dims[1];
  s->k = b_dims[2];
  const auto a_dims = a.dimensions();
  if (masked) {
    if (a_dims.size() != 3 || a_dims[0] != s->groups || a_dims[2] != s->k) {
      return InvalidArg(kOp, "a (masked)", "[G, R, K] = [" + std::to_string(s->groups) + ", R, " +
                                               std::to_string(s->k) + "]", DimsToString(a_dims));
    }
    s->rows = a_dims[1];
  } else {
    if (a_dims.size() != 2 || a_dims[1] != s->k) {
      return InvalidArg(kOp, "a (contiguous)", "[M, K] with K = " + std::to_string(s->k), DimsToString(a_dims));
    }
    s->rows = a_dims[0];
  }
  const int64_t kb = s->k / kBlock, nb = s->n / kBlock;
  if (masked ? !HasDims(a_sf, {s->groups, s->rows, kb}) : !HasDims(a_sf, {s->rows, kb})) {
    return InvalidArg(kOp, "a_sf", masked ? Dims({s->groups, s->rows, kb}) : Dims({s->rows, kb}),
                      DimsToString(a_sf.dimensions()));
  }
  if (!HasDims(b_sf, {s->groups, nb, kb})) {
    return InvalidArg(kOp, "b_sf", Dims({s->groups, nb, kb}), DimsToString(b_sf.dimensions()));
  }
  if (!HasDims(group_sizes, {s->groups})) {
    return InvalidArg(kOp, "group_sizes", Dims({s->groups}), DimsToString(group_sizes.dimensions()));
  }
  if (masked ? !HasDims(*d, {s->groups, s->rows, s->n}) : !HasDims(*d, {s->rows, s->n})) {
    return InvalidArg(kOp, "d", masked ? Dims({s->groups, s->rows, s->n}) : Dims({s->rows, s->n}),
                      DimsToString(d->dimensions()));
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------------------------
// CPU
// ---------------------------------------------------------------------------------------------------------------

// float32 value of every E4M3 (fn) byte, looked up in the CPU handlers' inner loops.
struct E4m3Table {
  float value[256];
  E4m3Table() {
    for (int byte = 0; byte < 256; ++byte) value[byte] = E4m3ToFloat(static_cast<uint8_t>(byte));
  }
};

// bfloat16 bits of f, rounded to nearest even; NaN stays NaN.
uint16_t FloatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if (std::isnan(f)) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

ffi::Error GroupedGemmFp8CpuImpl(ffi::AnyBuffer a, ffi::Buffer<ffi::F32> a_sf, ffi::AnyBuffer b,
                                 ffi::Buffer<ffi::F32> b_sf, ffi::Buffer<ffi::S32> group_sizes,
                                 ffi::Result<ffi::Buffer<ffi::BF16>> d, ffi::Result<ffi::Buffer<ffi::U8>> scratch,
                                 bool masked) {
  (void)scratch;
  GemmShape s;
  if (auto err = CheckGroupedGemm(a, a_sf, b, b_sf, group_sizes, d, masked, &s); err.failure()) return err;
  static const E4m3Table table;
  const auto* a_q = static_cast<const uint8_t*>(a.untyped_data());
  const auto* b_q = static_cast<const uint8_t*>(b.untyped_data());
  const float* a_scale = a_sf.typed_data();
  const float* b_scale = b_sf.typed_data();
  const int32_t* sizes = group_sizes.typed_data();
  auto* out = reinterpret_cast<uint16_t*>(d->untyped_data());
  const int64_t kb = s.k / kBlock, nb = s.n / kBlock;
  const int64_t matrices = masked ? s.groups : 1;
  std::memset(out, 0, static_cast<size_t>(matrices * s.rows * s.n) * sizeof(uint16_t));

  std::vector<float> w(static_cast<size_t>(s.n * s.k)), x(static_cast<size_t>(s.k));
  int64_t next = 0;  // contiguous: first row not yet owned
  for (int64_t g = 0; g < s.groups; ++g) {
    const int64_t requested = sizes[g] > 0 ? sizes[g] : 0;
    int64_t start, count;
    if (masked) {
      start = g * s.rows;
      count = requested < s.rows ? requested : s.rows;
    } else {
      start = next;
      count = requested < s.rows - start ? requested : s.rows - start;
      next += count;
    }
    if (count == 0) continue;
    // The group's weights, dequantized once: w[n, k] = b[g, n, k] * b_sf[g, n / 128, k / 128].
    for (int64_t n = 0; n < s.n; ++n) {
      const uint8_t* src = b_q + (g * s.n + n) * s.k;
      const float* sc = b_scale + (g * nb + n / kBlock) * kb;
      for (int64_t k = 0; k < s.k; ++k) w[n * s.k + k] = table.value[src[k]] * sc[k / kBlock];
    }
    for (int64_t r = start; r < start + count; ++r) {
      const uint8_t* src = a_q + r * s.k;
      for (int64_t k = 0; k < s.k; ++k) x[k] = table.value[src[k]] * a_scale[r * kb + k / kBlock];
      uint16_t* dst = out + r * s.n;
      for (int64_t n = 0; n < s.n; ++n) {
        // Eight interleaved float32 partial sums (K % 128 == 0), so the loop vectorizes without reassociation.
        const float* wn = w.data() + n * s.k;
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int64_t k = 0; k < s.k; k += 8) {
          for (int j = 0; j < 8; ++j) acc[j] += x[k + j] * wn[k + j];
        }
        dst[n] = FloatToBf16(((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])));
      }
    }
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------------------------
// CUDA
// ---------------------------------------------------------------------------------------------------------------

#ifdef JAX_MOE_A2A_WITH_CUDA
// Runs launch(sm_count) -> error text ("" on success) with `device` current, as op's error.
template <typename Launch>
ffi::Error LaunchOnDevice(const char* op, int32_t device, Launch launch) {
  ScopedDevice on(device);
  JAX_MOE_A2A_RETURN_IF_CUDA_ERROR(on.error());
  int sm_count = 0;
  JAX_MOE_A2A_RETURN_IF_CUDA_ERROR(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device));
  const std::string error = launch(sm_count);
  if (!error.empty()) return ffi::Error::Internal(std::string(op) + ": " + error);
  return ffi::Error::Success();
}

// The largest need(sm_count) over the visible GPUs; 0 without one.
template <typename Need>
size_t MostOverDevices(Need need) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  size_t bytes = 0;
  for (int dev = 0; dev < count; ++dev) {
    int sm_count = 0;
    if (cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) continue;
    bytes = std::max(bytes, need(sm_count));
  }
  return bytes;
}

ffi::Error GroupedGemmFp8CudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer a, ffi::Buffer<ffi::F32> a_sf,
                                  ffi::AnyBuffer b, ffi::Buffer<ffi::F32> b_sf, ffi::Buffer<ffi::S32> group_sizes,
                                  ffi::Result<ffi::Buffer<ffi::BF16>> d, ffi::Result<ffi::Buffer<ffi::U8>> scratch,
                                  bool masked) {
  GemmShape s;
  if (auto err = CheckGroupedGemm(a, a_sf, b, b_sf, group_sizes, d, masked, &s); err.failure()) return err;
  GroupedGemmFp8Args args;
  args.a = static_cast<const uint8_t*>(a.untyped_data());
  args.a_sf = a_sf.typed_data();
  args.b = static_cast<const uint8_t*>(b.untyped_data());
  args.b_sf = b_sf.typed_data();
  args.group_sizes = group_sizes.typed_data();
  args.d = d->untyped_data();
  args.num_groups = s.groups;
  args.rows = s.rows;
  args.n = s.n;
  args.k = s.k;
  args.masked = masked;
  args.scratch = scratch->untyped_data();
  args.scratch_bytes = static_cast<size_t>(scratch->element_count());
  return LaunchOnDevice(kOp, device, [&](int sm_count) { return LaunchGroupedGemmFp8(stream, sm_count, args); });
}
#endif


// ---------------------------------------------------------------------------------------------------------------
// grouped_gemm_fp8_wgrad: checks (shared by both platforms) and CPU
// ---------------------------------------------------------------------------------------------------------------

struct WgradShape {
  int64_t groups = 0, na = 0, nb = 0, p = 0;
};

ffi::Error CheckWgrad(const ffi::AnyBuffer& a_t, const ffi::Buffer<ffi::F32>& a_sf_t, const ffi::AnyBuffer& b_t,
                      const ffi::Buffer<ffi::F32>& b_sf_t, const ffi::Buffer<ffi::S32>& group_sizes,
                      const ffi::Result<ffi::AnyBuffer>& d, WgradShape* s) {
  for (auto [name, buf] : {std::pair<const char*, const ffi::AnyBuffer*>{"a_t", &a_t}, {"b_t", &b_t}}) {
    if (buf->element_type() != ffi::DataType::F8E4M3FN) {
      return InvalidArg(kOpWgrad, name, "float8_e4m3fn", DataTypeName(buf->element_type()));
    }
    const auto dims = buf->dimensions();
    if (dims.size() != 2 || dims[0] <= 0 || dims[0] % kBlock) {
      return InvalidArg(kOpWgrad, name, "[N, P] with N a positive multiple of 128", DimsToString(dims));
    }
  }
  const auto g_dims = group_sizes.dimensions();
  if (g_dims.size() != 1 || g_dims[0] < 1 || g_dims[0] > kMaxGroups) {
    return InvalidArg(kOpWgrad, "group_sizes", "[G] with 1 <= G <= 65535", DimsToString(g_dims));
  }
  s->groups = g_dims[0];
  s->na = a_t.dimensions()[0];
  s->p = a_t.dimensions()[1];
  s->nb = b_t.dimensions()[0];
  if (s->p % kBlock || s->p < kBlock * s->groups) {
    return InvalidArg(kOpWgrad, "a_t", "[Na, P] with P a multiple of 128 and P >= 128 * G = " +
                                           std::to_string(kBlock * s->groups), DimsToString(a_t.dimensions()));
  }
  if (b_t.dimensions()[1] != s->p) {
    return InvalidArg(kOpWgrad, "b_t", "[Nb, P] with P = " + std::to_string(s->p), DimsToString(b_t.dimensions()));
  }
  if (!HasDims(a_sf_t, {s->p / kBlock, s->na})) {
    return InvalidArg(kOpWgrad, "a_sf_t", Dims({s->p / kBlock, s->na}), DimsToString(a_sf_t.dimensions()));
  }
  if (!HasDims(b_sf_t, {s->p / kBlock, s->nb})) {
    return InvalidArg(kOpWgrad, "b_sf_t", Dims({s->p / kBlock, s->nb}), DimsToString(b_sf_t.dimensions()));
  }
  const ffi::DataType d_type = d->element_type();
  if (d_type != ffi::DataType::F32 && d_type != ffi::DataType::BF16) {
    return InvalidArg(kOpWgrad, "d", "float32 or bfloat16", DataTypeName(d_type));
  }
  if (!HasDims(*d, {s->groups, s->na, s->nb})) {
    return InvalidArg(kOpWgrad, "d", Dims({s->groups, s->na, s->nb}), DimsToString(d->dimensions()));
  }
  return ffi::Error::Success();
}

// The operand [n, P] dequantized over the columns [off, off + len): out[i * len + k] = code * scale of its 128x1 tile.
void DequantizeKmajor(const uint8_t* q, const float* sf, int64_t n, int64_t p, int64_t off, int64_t len,
                      const E4m3Table& table, std::vector<float>* out) {
  out->resize(static_cast<size_t>(n * len));
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t k = 0; k < len; ++k) {
      (*out)[i * len + k] = table.value[q[i * p + off + k]] * sf[((off + k) / kBlock) * n + i];
    }
  }
}

ffi::Error GroupedGemmFp8WgradCpuImpl(ffi::AnyBuffer a_t, ffi::Buffer<ffi::F32> a_sf_t, ffi::AnyBuffer b_t,
                                      ffi::Buffer<ffi::F32> b_sf_t, ffi::Buffer<ffi::S32> group_sizes,
                                      ffi::Result<ffi::AnyBuffer> d, ffi::Result<ffi::Buffer<ffi::U8>> scratch) {
  (void)scratch;
  WgradShape s;
  if (auto err = CheckWgrad(a_t, a_sf_t, b_t, b_sf_t, group_sizes, d, &s); err.failure()) return err;
  static const E4m3Table table;
  const auto* a_q = static_cast<const uint8_t*>(a_t.untyped_data());
  const auto* b_q = static_cast<const uint8_t*>(b_t.untyped_data());
  const int32_t* sizes = group_sizes.typed_data();
  const int64_t rows = s.p - kBlock * s.groups;  // the quantizer's round_up(M, 128)
  const bool f32_out = d->element_type() == ffi::DataType::F32;
  std::vector<float> a, b, dg(static_cast<size_t>(s.na * s.nb));
  int64_t start = 0, off = 0;
  for (int64_t g = 0; g < s.groups; ++g) {
    const int64_t size = std::min<int64_t>(sizes[g] > 0 ? sizes[g] : 0, rows - start);
    const int64_t len = (size + kBlock - 1) / kBlock * kBlock;
    std::fill(dg.begin(), dg.end(), 0.0f);
    if (len > 0) {
      DequantizeKmajor(a_q, a_sf_t.typed_data(), s.na, s.p, off, len, table, &a);
      DequantizeKmajor(b_q, b_sf_t.typed_data(), s.nb, s.p, off, len, table, &b);
      for (int64_t i = 0; i < s.na; ++i) {
        const float* ai = a.data() + i * len;
        for (int64_t j = 0; j < s.nb; ++j) {
          // Eight interleaved float32 partial sums (len % 128 == 0): the loop vectorizes without reassociation.
          const float* bj = b.data() + j * len;
          float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
          for (int64_t k = 0; k < len; k += 8) {
            for (int u = 0; u < 8; ++u) acc[u] += ai[k + u] * bj[k + u];
          }
          dg[i * s.nb + j] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
        }
      }
    }
    if (f32_out) {
      std::memcpy(static_cast<float*>(d->untyped_data()) + g * s.na * s.nb, dg.data(), dg.size() * sizeof(float));
    } else {
      auto* dst = static_cast<uint16_t*>(d->untyped_data()) + g * s.na * s.nb;
      for (size_t i = 0; i < dg.size(); ++i) dst[i] = FloatToBf16(dg[i]);
    }
    start += size;
    off += len;
  }
  return ffi::Error::Success();
}

#ifdef JAX_MOE_A2A_WITH_CUDA
ffi::Error GroupedGemmFp8WgradCudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer a_t,
                                       ffi::Buffer<ffi::F32> a_sf_t, ffi::AnyBuffer b_t, ffi::Buffer<ffi::F32> b_sf_t,
                                       ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> d,
                                       ffi::Result<ffi::Buffer<ffi::U8>> scratch) {
  WgradShape s;
  if (auto err = CheckWgrad(a_t, a_sf_t, b_t, b_sf_t, group_sizes, d, &s); err.failure()) return err;
  GroupedGemmFp8WgradArgs args;
  args.a_t = static_cast<const uint8_t*>(a_t.untyped_data());
  args.a_sf_t = a_sf_t.typed_data();
  args.b_t = static_cast<const uint8_t*>(b_t.untyped_data());
  args.b_sf_t = b_sf_t.typed_data();
  args.group_sizes = group_sizes.typed_data();
  args.d = d->untyped_data();
  args.d_bf16 = d->element_type() == ffi::DataType::BF16;
  args.num_groups = s.groups;
  args.na = s.na;
  args.nb = s.nb;
  args.p = s.p;
  args.scratch = scratch->untyped_data();
  args.scratch_bytes = static_cast<size_t>(scratch->element_count());
  return LaunchOnDevice(kOpWgrad, device, [&](int sm_count) { return LaunchGroupedGemmFp8Wgrad(stream, sm_count, args); });
}
#endif

// ---------------------------------------------------------------------------------------------------------------
// grouped_gemm_bf16: checks (shared by both platforms)
// ---------------------------------------------------------------------------------------------------------------

constexpr int32_t kModeNT = 0, kModeNN = 1, kModeTN = 2;

struct Bf16Shape {
  int64_t groups = 0;
  int64_t rows = 0;
  int64_t n = 0;
  int64_t k = 0;
};

ffi::Error CheckGroupedGemmBf16(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b,
                                const ffi::Buffer<ffi::S32>& group_sizes, const ffi::Result<ffi::AnyBuffer>& d,
                                int32_t mode, Bf16Shape* s) {
  if (mode != kModeNT && mode != kModeNN && mode != kModeTN) {
    return InvalidArg(kOpBf16, "mode", "0 (NT), 1 (NN) or 2 (TN)", mode);
  }
  for (auto [name, buf] : {std::pair<const char*, const ffi::AnyBuffer*>{"a", &a}, {"b", &b}}) {
    if (buf->element_type() != ffi::DataType::BF16) {
      return InvalidArg(kOpBf16, name, "bfloat16", DataTypeName(buf->element_type()));
    }
  }
  const auto a_dims = a.dimensions();
  if (a_dims.size() != 2 || a_dims[1] <= 0 || a_dims[1] % 8) {
    return InvalidArg(kOpBf16, "a", "[M, K] with K a positive multiple of 8", DimsToString(a_dims));
  }
  s->rows = a_dims[0];
  s->k = a_dims[1];
  const auto g_dims = group_sizes.dimensions();
  if (g_dims.size() != 1 || g_dims[0] < 1 || g_dims[0] > kMaxGroups) {
    return InvalidArg(kOpBf16, "group_sizes", "[G] with 1 <= G <= 65535", DimsToString(g_dims));
  }
  s->groups = g_dims[0];
  const auto b_dims = b.dimensions();
  if (mode == kModeTN) {
    if (b_dims.size() != 2 || b_dims[0] != s->rows || b_dims[1] <= 0 || b_dims[1] % 8) {
      return InvalidArg(kOpBf16, "b (mode TN)", "[M, N] with M = " + std::to_string(s->rows) +
                                                    " and N a positive multiple of 8", DimsToString(b_dims));
    }
    s->n = b_dims[1];
  } else {
    const bool nt = mode == kModeNT;
    const int64_t k_dim = nt ? 2 : 1, n_dim = nt ? 1 : 2;
    if (b_dims.size() != 3 || b_dims[0] != s->groups || b_dims[k_dim] != s->k || b_dims[n_dim] <= 0 ||
        b_dims[n_dim] % 8) {
      const std::string g = std::to_string(s->groups), k = std::to_string(s->k);
      return InvalidArg(kOpBf16, nt ? "b (mode NT)" : "b (mode NN)",
                        (nt ? "[G, N, K] = [" + g + ", N, " + k : "[G, K, N] = [" + g + ", " + k + ", N") +
                            "] with N a positive multiple of 8",
                        DimsToString(b_dims));
    }
    s->n = b_dims[n_dim];
  }
  const bool tn = mode == kModeTN;
  const ffi::DataType d_type = d->element_type();
  if (tn ? (d_type != ffi::DataType::F32 && d_type != ffi::DataType::BF16) : d_type != ffi::DataType::BF16) {
    return InvalidArg(kOpBf16, "d", tn ? "float32 or bfloat16 (mode TN)" : "bfloat16", DataTypeName(d_type));
  }
  if (tn ? !HasDims(*d, {s->groups, s->k, s->n}) : !HasDims(*d, {s->rows, s->n})) {
    return InvalidArg(kOpBf16, "d", tn ? Dims({s->groups, s->k, s->n}) : Dims({s->rows, s->n}),
                      DimsToString(d->dimensions()));
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------------------------
// grouped_gemm_bf16: CPU
// ---------------------------------------------------------------------------------------------------------------

float Bf16ToFloat(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof(f));
  return f;
}

ffi::Error GroupedGemmBf16CpuImpl(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Buffer<ffi::S32> group_sizes,
                                  ffi::Result<ffi::AnyBuffer> d, ffi::Result<ffi::Buffer<ffi::U8>> scratch,
                                  int32_t mode) {
  (void)scratch;
  Bf16Shape s;
  if (auto err = CheckGroupedGemmBf16(a, b, group_sizes, d, mode, &s); err.failure()) return err;
  const auto* a_bits = static_cast<const uint16_t*>(a.untyped_data());
  const auto* b_bits = static_cast<const uint16_t*>(b.untyped_data());
  const int32_t* sizes = group_sizes.typed_data();
  std::vector<float> x(static_cast<size_t>(s.rows * s.k)), w;
  for (size_t i = 0; i < x.size(); ++i) x[i] = Bf16ToFloat(a_bits[i]);

  if (mode == kModeTN) {
    std::vector<float> out(static_cast<size_t>(s.groups * s.k * s.n), 0.0f);
    std::vector<float> y(static_cast<size_t>(s.rows * s.n));
    for (size_t i = 0; i < y.size(); ++i) y[i] = Bf16ToFloat(b_bits[i]);
    int64_t next = 0;
    for (int64_t g = 0; g < s.groups; ++g) {
      const int64_t requested = sizes[g] > 0 ? sizes[g] : 0;
      const int64_t count = requested < s.rows - next ? requested : s.rows - next;
      float* dg = out.data() + g * s.k * s.n;
      // One output row at a time (it stays in cache) over the group's rows in ascending order: a fixed float32
      // summation order.
      for (int64_t kk = 0; kk < s.k; ++kk) {
        float* row = dg + kk * s.n;
        for (int64_t r = next; r < next + count; ++r) {
          const float xv = x[r * s.k + kk];
          const float* yr = y.data() + r * s.n;
          for (int64_t n = 0; n < s.n; ++n) row[n] += xv * yr[n];
        }
      }
      next += count;
    }
    if (d->element_type() == ffi::DataType::F32) {
      std::memcpy(d->untyped_data(), out.data(), out.size() * sizeof(float));
    } else {
      auto* dst = static_cast<uint16_t*>(d->untyped_data());
      for (size_t i = 0; i < out.size(); ++i) dst[i] = FloatToBf16(out[i]);
    }
    return ffi::Error::Success();
  }

  auto* out = static_cast<uint16_t*>(d->untyped_data());
  std::memset(out, 0, static_cast<size_t>(s.rows * s.n) * sizeof(uint16_t));
  w.resize(static_cast<size_t>(s.n * s.k));
  int64_t next = 0;
  for (int64_t g = 0; g < s.groups; ++g) {
    const int64_t requested = sizes[g] > 0 ? sizes[g] : 0;
    const int64_t count = requested < s.rows - next ? requested : s.rows - next;
    if (count > 0) {
      // The group's weights as w[n, k], whichever way b stores them.
      const uint16_t* bg = b_bits + g * s.n * s.k;
      for (int64_t n = 0; n < s.n; ++n) {
        for (int64_t kk = 0; kk < s.k; ++kk) {
          w[n * s.k + kk] = Bf16ToFloat(mode == kModeNT ? bg[n * s.k + kk] : bg[kk * s.n + n]);
        }
      }
      // Rows in blocks of kRowBlock against each weight row, eight interleaved float32 partial sums per output
      // (K % 8 == 0): the loop vectorizes without reassociation and reads the weights once per block.
      constexpr int64_t kRowBlock = 4;
      for (int64_t r0 = next; r0 < next + count; r0 += kRowBlock) {
        const int64_t block = next + count - r0 < kRowBlock ? next + count - r0 : kRowBlock;
        for (int64_t n = 0; n < s.n; ++n) {
          const float* wn = w.data() + n * s.k;
          float acc[kRowBlock][8] = {};
          for (int64_t kk = 0; kk < s.k; kk += 8) {
            for (int64_t i = 0; i < kRowBlock; ++i) {
              const float* xr = x.data() + (r0 + (i < block ? i : 0)) * s.k + kk;
              for (int j = 0; j < 8; ++j) acc[i][j] += xr[j] * wn[kk + j];
            }
          }
          for (int64_t i = 0; i < block; ++i) {
            const float* a8 = acc[i];
            out[(r0 + i) * s.n + n] = FloatToBf16(((a8[0] + a8[1]) + (a8[2] + a8[3])) + ((a8[4] + a8[5]) + (a8[6] + a8[7])));
          }
        }
      }
    }
    next += count;
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------------------------
// grouped_gemm_bf16: CUDA
// ---------------------------------------------------------------------------------------------------------------

#ifdef JAX_MOE_A2A_WITH_CUDA
ffi::Error GroupedGemmBf16CudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer a, ffi::AnyBuffer b,
                                   ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> d,
                                   ffi::Result<ffi::Buffer<ffi::U8>> scratch, int32_t mode) {
  Bf16Shape s;
  if (auto err = CheckGroupedGemmBf16(a, b, group_sizes, d, mode, &s); err.failure()) return err;
  GroupedGemmBf16Args args;
  args.mode = static_cast<Bf16GemmMode>(mode);
  args.a = a.untyped_data();
  args.b = b.untyped_data();
  args.group_sizes = group_sizes.typed_data();
  args.d = d->untyped_data();
  args.d_bf16 = d->element_type() == ffi::DataType::BF16;
  args.num_groups = s.groups;
  args.rows = s.rows;
  args.n = s.n;
  args.k = s.k;
  args.scratch = scratch->untyped_data();
  args.scratch_bytes = static_cast<size_t>(scratch->element_count());
  return LaunchOnDevice(kOpBf16, device, [&](int sm_count) { return LaunchGroupedGemmBf16(stream, sm_count, args); });
}
#endif

}  // namespace

// Scratch bytes of the CUDA handler for `num_groups` groups on any visible GPU; 0 without one. `bf16_mode` < 0: the
// FP8 op; else the bf16 op in that mode (mode 2 with a float32 d when `f32_out`).
size_t GroupedGemmScratchBytes(int64_t num_groups, int32_t bf16_mode, bool f32_out) {
#ifdef JAX_MOE_A2A_WITH_CUDA
  return MostOverDevices([&](int sm_count) {
    return bf16_mode < 0 ? GroupedGemmFp8ScratchBytes(num_groups, sm_count)
                         : GroupedGemmBf16ScratchBytes(static_cast<Bf16GemmMode>(bf16_mode), !f32_out, num_groups,
                                                       sm_count);
  });
#else
  (void)num_groups;
  (void)bf16_mode;
  (void)f32_out;
  return 0;
#endif
}

// Scratch bytes of the CUDA grouped_gemm_fp8_wgrad handler for `num_groups` groups on any visible GPU; 0 without one.
size_t GroupedGemmFp8WgradScratchBytes(int64_t num_groups) {
#ifdef JAX_MOE_A2A_WITH_CUDA
  return MostOverDevices([&](int sm_count) { return GroupedGemmFp8WgradScratchBytesFor(num_groups, sm_count); });
#else
  (void)num_groups;
  return 0;
#endif
}

}  // namespace jax_moe_a2a

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeA2aGroupedGemmFp8Cpu, jax_moe_a2a::GroupedGemmFp8CpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()                  // a
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()      // a_sf
                                  .Arg<xla::ffi::AnyBuffer>()                  // b
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()      // b_sf
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()      // group_sizes
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()     // d
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>()       // scratch
                                  .Attr<bool>("masked"));

#ifdef JAX_MOE_A2A_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeA2aGroupedGemmFp8Cuda, jax_moe_a2a::GroupedGemmFp8CudaImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .Arg<xla::ffi::AnyBuffer>()                     // a
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()         // a_sf
                                  .Arg<xla::ffi::AnyBuffer>()                     // b
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()         // b_sf
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // group_sizes
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()        // d
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>()          // scratch
                                  .Attr<bool>("masked"),                          // masked
                              {xla::ffi::Traits::kCmdBufferCompatible});
#endif

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeA2aGroupedGemmBf16Cpu, jax_moe_a2a::GroupedGemmBf16CpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()                  // a
                                  .Arg<xla::ffi::AnyBuffer>()                  // b
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()      // group_sizes
                                  .Ret<xla::ffi::AnyBuffer>()                  // d
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>()       // scratch
                                  .Attr<int32_t>("mode"));                     // mode

#ifdef JAX_MOE_A2A_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeA2aGroupedGemmBf16Cuda, jax_moe_a2a::GroupedGemmBf16CudaImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .Arg<xla::ffi::AnyBuffer>()                     // a
                                  .Arg<xla::ffi::AnyBuffer>()                     // b
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // group_sizes
                                  .Ret<xla::ffi::AnyBuffer>()                     // d
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>()          // scratch
                                  .Attr<int32_t>("mode"),                         // mode
                              {xla::ffi::Traits::kCmdBufferCompatible});
#endif

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeA2aGroupedGemmFp8WgradCpu, jax_moe_a2a::GroupedGemmFp8WgradCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()                  // a_t
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()      // a_sf_t
                                  .Arg<xla::ffi::AnyBuffer>()                  // b_t
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()      // b_sf_t
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()      // group_sizes
                                  .Ret<xla::ffi::AnyBuffer>()                  // d
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>());     // scratch

#ifdef JAX_MOE_A2A_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeA2aGroupedGemmFp8WgradCuda, jax_moe_a2a::GroupedGemmFp8WgradCudaImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .Arg<xla::ffi::AnyBuffer>()                     // a_t
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()         // a_sf_t
                                  .Arg<xla::ffi::AnyBuffer>()                     // b_t
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()         // b_sf_t
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // group_sizes
                                  .Ret<xla::ffi::AnyBuffer>()                     // d
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>(),         // scratch
                              {xla::ffi::Traits::kCmdBufferCompatible});
#endif
