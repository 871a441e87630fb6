// grouped_gemm.cc -- handlers of jax_moe_a2a_grouped_gemm_fp8 (CPU, and CUDA when built with it).
//
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
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

#ifdef JAX_MOE_A2A_WITH_CUDA
#include "grouped_gemm_kernels.cuh"
#endif

namespace jax_moe_a2a {

namespace {

constexpr char kOp[] = "jax_moe_a2a_grouped_gemm_fp8";
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

// float32 value of every E4M3 (fn) byte: 1 sign, 4 exponent (bias 7), 3 mantissa bits, no infinities, NaN 0x7F/0xFF.
struct E4m3Table {
  float value[256];
  E4m3Table() {
    for (int byte = 0; byte < 256; ++byte) {
      const int exp = (byte >> 3) & 0xF, mant = byte & 0x7;
      float v;
      if (exp == 0xF && mant == 0x7) {
        v = std::nanf("");
      } else if (exp == 0) {
        v = std::ldexp(static_cast<float>(mant), -9);  // subnormal: mant/8 * 2^-6
      } else {
        v = std::ldexp(1.0f + mant / 8.0f, exp - 7);
      }
      value[byte] = (byte & 0x80) ? -v : v;
    }
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
ffi::Error GroupedGemmFp8CudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer a, ffi::Buffer<ffi::F32> a_sf,
                                  ffi::AnyBuffer b, ffi::Buffer<ffi::F32> b_sf, ffi::Buffer<ffi::S32> group_sizes,
                                  ffi::Result<ffi::Buffer<ffi::BF16>> d, ffi::Result<ffi::Buffer<ffi::U8>> scratch,
                                  bool masked) {
  GemmShape s;
  if (auto err = CheckGroupedGemm(a, a_sf, b, b_sf, group_sizes, d, masked, &s); err.failure()) return err;
  int current = -1;
  JAX_MOE_A2A_RETURN_IF_CUDA_ERROR(cudaGetDevice(&current));
  if (current != device) JAX_MOE_A2A_RETURN_IF_CUDA_ERROR(cudaSetDevice(device));
  int sm_count = 0;
  std::string error;
  if (cudaError_t err = cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device);
      err != cudaSuccess) {
    error = cudaGetErrorString(err);
  } else {
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
    error = LaunchGroupedGemmFp8(stream, sm_count, args);
  }
  if (current != device) JAX_MOE_A2A_RETURN_IF_CUDA_ERROR(cudaSetDevice(current));
  if (!error.empty()) return ffi::Error::Internal(std::string(kOp) + ": " + error);
  return ffi::Error::Success();
}
#endif

}  // namespace

// Scratch bytes of the CUDA handler for `num_groups` groups on any visible GPU; 0 without one.
size_t GroupedGemmScratchBytes(int64_t num_groups) {
#ifdef JAX_MOE_A2A_WITH_CUDA
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  size_t bytes = 0;
  for (int dev = 0; dev < count; ++dev) {
    int sm_count = 0;
    if (cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) continue;
    const size_t need = GroupedGemmFp8ScratchBytes(num_groups, sm_count);
    bytes = need > bytes ? need : bytes;
  }
  return bytes;
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
