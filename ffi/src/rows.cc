// rows.cc -- handlers of jax_moe_a2a_gather_rows, jax_moe_a2a_scatter_rows and jax_moe_a2a_sum_rows (CPU, and CUDA
// when built with it): the expert stage's row movement between the received rows and the rows sorted by expert.
//
//   gather_rows(x [R, H], idx [A], scale [A] or [0]) -> out [A, H]
//     out[i] = x[idx[i]] (any dtype, out's dtype = x's), or float(x[idx[i]]) * scale[i] in out's dtype (x and out
//     bfloat16 or float32); a row whose idx is outside [0, R) is 0.
//   scatter_rows(x [R, H], pos [R, K]) -> out [R * K, H]
//     out[pos[r, j]] = x[r] (any dtype): pos must name every output row once (a permutation of [0, R * K)), which
//     the CPU handler checks and the CUDA one does not (there a row named twice gets one of its values, and a
//     row named by none is not written).
//   sum_rows(y [A, H], pos [R, K], weights [R, K] or [0]) -> out [R, H]
//     out[r] = sum over j in ascending order of float(y[pos[r, j]]) * weights[r, j] (weight 1 without weights), in
//     float32, then in out's dtype (y and out bfloat16 or float32); a term whose pos is outside [0, A) adds +0.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

#ifdef JAX_MOE_A2A_WITH_CUDA
#include "rows_kernels.cuh"
#endif

namespace jax_moe_a2a {

namespace {

constexpr char kGatherOp[] = "jax_moe_a2a_gather_rows";
constexpr char kScatterOp[] = "jax_moe_a2a_scatter_rows";
constexpr char kSumOp[] = "jax_moe_a2a_sum_rows";

bool IsFloatRow(ffi::DataType t) { return t == ffi::DataType::BF16 || t == ffi::DataType::F32; }

// ---------------------------------------------------------------------------------------------------------------
// Shape and dtype checks (shared by both platforms)
// ---------------------------------------------------------------------------------------------------------------

struct GatherShape {
  int64_t x_rows = 0, out_rows = 0, hidden = 0, row_bytes = 0;
  bool scaled = false;
};

ffi::Error CheckGather(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::S32>& idx, const ffi::Buffer<ffi::F32>& scale,
                       const ffi::Result<ffi::AnyBuffer>& out, GatherShape* s) {
  const auto xd = x.dimensions();
  if (xd.size() != 2) return InvalidArg(kGatherOp, "x", "[R, H]", DimsToString(xd));
  const auto id = idx.dimensions();
  if (id.size() != 1) return InvalidArg(kGatherOp, "idx", "[A]", DimsToString(id));
  s->x_rows = xd[0], s->hidden = xd[1], s->out_rows = id[0];
  const auto sd = scale.dimensions();
  if (sd.size() != 1 || (sd[0] != 0 && sd[0] != s->out_rows)) {
    return InvalidArg(kGatherOp, "scale", "[0] or [A] = [" + std::to_string(s->out_rows) + "]", DimsToString(sd));
  }
  s->scaled = sd[0] == s->out_rows && s->out_rows > 0;
  const auto od = out->dimensions();
  if (od.size() != 2 || od[0] != s->out_rows || od[1] != s->hidden) {
    return InvalidArg(kGatherOp, "out", "[A, H] = [" + std::to_string(s->out_rows) + ", " + std::to_string(s->hidden) +
                                            "]", DimsToString(od));
  }
  if (s->scaled) {
    if (!IsFloatRow(x.element_type())) {
      return InvalidArg(kGatherOp, "x with a scale", "bfloat16 or float32", DataTypeName(x.element_type()));
    }
    if (!IsFloatRow(out->element_type())) {
      return InvalidArg(kGatherOp, "out with a scale", "bfloat16 or float32", DataTypeName(out->element_type()));
    }
  } else if (out->element_type() != x.element_type()) {
    return InvalidArg(kGatherOp, "out without a scale", "x's dtype " + DataTypeName(x.element_type()),
                      DataTypeName(out->element_type()));
  }
  s->row_bytes = static_cast<int64_t>(ffi::ByteWidth(x.element_type())) * s->hidden;
  return ffi::Error::Success();
}

struct ScatterShape {
  int64_t x_rows = 0, k = 0, out_rows = 0, row_bytes = 0;
};

ffi::Error CheckScatter(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::S32>& pos,
                        const ffi::Result<ffi::AnyBuffer>& out, ScatterShape* s) {
  const auto xd = x.dimensions();
  if (xd.size() != 2) return InvalidArg(kScatterOp, "x", "[R, H]", DimsToString(xd));
  const auto pd = pos.dimensions();
  if (pd.size() != 2 || pd[0] != xd[0]) {
    return InvalidArg(kScatterOp, "pos", "[R, K] with R = " + std::to_string(xd[0]), DimsToString(pd));
  }
  s->x_rows = xd[0], s->k = pd[1], s->out_rows = xd[0] * pd[1];
  const auto od = out->dimensions();
  if (od.size() != 2 || od[0] != s->out_rows || od[1] != xd[1]) {
    return InvalidArg(kScatterOp, "out", "[R * K, H] = [" + std::to_string(s->out_rows) + ", " +
                                             std::to_string(xd[1]) + "]", DimsToString(od));
  }
  if (out->element_type() != x.element_type()) {
    return InvalidArg(kScatterOp, "out", "x's dtype " + DataTypeName(x.element_type()),
                      DataTypeName(out->element_type()));
  }
  s->row_bytes = static_cast<int64_t>(ffi::ByteWidth(x.element_type())) * xd[1];
  return ffi::Error::Success();
}

struct SumShape {
  int64_t y_rows = 0, out_rows = 0, k = 0, hidden = 0;
  bool weighted = false;
};

ffi::Error CheckSum(const ffi::AnyBuffer& y, const ffi::Buffer<ffi::S32>& pos, const ffi::Buffer<ffi::F32>& weights,
                    const ffi::Result<ffi::AnyBuffer>& out, SumShape* s) {
  const auto yd = y.dimensions();
  if (yd.size() != 2) return InvalidArg(kSumOp, "y", "[A, H]", DimsToString(yd));
  if (!IsFloatRow(y.element_type())) {
    return InvalidArg(kSumOp, "y", "bfloat16 or float32", DataTypeName(y.element_type()));
  }
  const auto pd = pos.dimensions();
  if (pd.size() != 2) return InvalidArg(kSumOp, "pos", "[R, K]", DimsToString(pd));
  s->y_rows = yd[0], s->hidden = yd[1], s->out_rows = pd[0], s->k = pd[1];
  const auto wd = weights.dimensions();
  const bool none = wd.size() == 1 && wd[0] == 0;
  if (!none && (wd.size() != 2 || wd[0] != s->out_rows || wd[1] != s->k)) {
    return InvalidArg(kSumOp, "weights", "[0] or [R, K] = " + DimsToString(pd), DimsToString(wd));
  }
  s->weighted = !none;
  const auto od = out->dimensions();
  if (od.size() != 2 || od[0] != s->out_rows || od[1] != s->hidden) {
    return InvalidArg(kSumOp, "out", "[R, H] = [" + std::to_string(s->out_rows) + ", " + std::to_string(s->hidden) +
                                         "]", DimsToString(od));
  }
  if (!IsFloatRow(out->element_type())) {
    return InvalidArg(kSumOp, "out", "bfloat16 or float32", DataTypeName(out->element_type()));
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------------------------
// CPU
// ---------------------------------------------------------------------------------------------------------------

float LoadValue(ffi::DataType t, const void* base, int64_t i) {
  if (t == ffi::DataType::BF16) return Bf16BitsToFloat(static_cast<const uint16_t*>(base)[i]);
  return static_cast<const float*>(base)[i];
}

void StoreValue(ffi::DataType t, void* base, int64_t i, float v) {
  if (t == ffi::DataType::BF16) {
    static_cast<uint16_t*>(base)[i] = FloatToBf16Bits(v);
  } else {
    static_cast<float*>(base)[i] = v;
  }
}

ffi::Error GatherRowsCpuImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> idx, ffi::Buffer<ffi::F32> scale,
                             ffi::Result<ffi::AnyBuffer> out) {
  GatherShape s;
  if (auto err = CheckGather(x, idx, scale, out, &s); err.failure()) return err;
  const int32_t* ids = idx.typed_data();
  for (int64_t i = 0; i < s.out_rows; ++i) {
    const int64_t src = ids[i];
    const bool valid = src >= 0 && src < s.x_rows;
    if (!s.scaled) {
      auto* dst = static_cast<uint8_t*>(out->untyped_data()) + i * s.row_bytes;
      if (valid) {
        std::memcpy(dst, static_cast<const uint8_t*>(x.untyped_data()) + src * s.row_bytes, s.row_bytes);
      } else {
        std::memset(dst, 0, s.row_bytes);
      }
      continue;
    }
    const float f = scale.typed_data()[i];
    for (int64_t h = 0; h < s.hidden; ++h) {
      const float v = valid ? LoadValue(x.element_type(), x.untyped_data(), src * s.hidden + h) * f : 0.0f;
      StoreValue(out->element_type(), out->untyped_data(), i * s.hidden + h, v);
    }
  }
  return ffi::Error::Success();
}

ffi::Error ScatterRowsCpuImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> pos, ffi::Result<ffi::AnyBuffer> out) {
  ScatterShape s;
  if (auto err = CheckScatter(x, pos, out, &s); err.failure()) return err;
  const int32_t* p = pos.typed_data();
  std::vector<bool> named(static_cast<size_t>(s.out_rows), false);
  for (int64_t i = 0; i < s.out_rows; ++i) {
    const int64_t dst = p[i];
    if (dst < 0 || dst >= s.out_rows || named[dst]) {
      return InvalidArg(kScatterOp, "pos", "a permutation of [0, " + std::to_string(s.out_rows) + ")",
                        "entry " + std::to_string(i) + " = " + std::to_string(dst) +
                            (dst >= 0 && dst < s.out_rows ? " (named twice)" : " (out of range)"));
    }
    named[dst] = true;
  }
  for (int64_t i = 0; i < s.out_rows; ++i) {
    std::memcpy(static_cast<uint8_t*>(out->untyped_data()) + p[i] * s.row_bytes,
                static_cast<const uint8_t*>(x.untyped_data()) + (i / s.k) * s.row_bytes, s.row_bytes);
  }
  return ffi::Error::Success();
}

ffi::Error SumRowsCpuImpl(ffi::AnyBuffer y, ffi::Buffer<ffi::S32> pos, ffi::Buffer<ffi::F32> weights,
                          ffi::Result<ffi::AnyBuffer> out) {
  SumShape s;
  if (auto err = CheckSum(y, pos, weights, out, &s); err.failure()) return err;
  const int32_t* p = pos.typed_data();
  for (int64_t r = 0; r < s.out_rows; ++r) {
    for (int64_t h = 0; h < s.hidden; ++h) {
      float acc = 0.0f;
      for (int64_t j = 0; j < s.k; ++j) {
        const int64_t src = p[r * s.k + j];
        float term = 0.0f;
        if (src >= 0 && src < s.y_rows) {
          const float w = s.weighted ? weights.typed_data()[r * s.k + j] : 1.0f;
          term = LoadValue(y.element_type(), y.untyped_data(), src * s.hidden + h) * w;
        }
        acc = acc + term;
      }
      StoreValue(out->element_type(), out->untyped_data(), r * s.hidden + h, acc);
    }
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------------------------
// CUDA
// ---------------------------------------------------------------------------------------------------------------

#ifdef JAX_MOE_A2A_WITH_CUDA
RowType TypeOf(ffi::DataType t) { return t == ffi::DataType::BF16 ? RowType::kBF16 : RowType::kF32; }

ffi::Error GatherRowsCudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> idx,
                              ffi::Buffer<ffi::F32> scale, ffi::Result<ffi::AnyBuffer> out) {
  GatherShape s;
  if (auto err = CheckGather(x, idx, scale, out, &s); err.failure()) return err;
  if (s.scaled && s.hidden % 8 != 0) {
    return InvalidArg(kGatherOp, "H with a scale on the GPU", "a multiple of 8", s.hidden);
  }
  ScopedDevice on(device);
  JAX_MOE_A2A_RETURN_IF_CUDA_ERROR(on.error());
  if (s.scaled) {
    JAX_MOE_A2A_RETURN_IF_CUDA_ERROR(LaunchGatherRowsScaled(stream, TypeOf(x.element_type()),
                                                            TypeOf(out->element_type()), x.untyped_data(),
                                                            idx.typed_data(), scale.typed_data(),
                                                            out->untyped_data(), s.x_rows, s.out_rows, s.hidden));
  } else {
    JAX_MOE_A2A_RETURN_IF_CUDA_ERROR(LaunchGatherRows(stream, x.untyped_data(), idx.typed_data(), out->untyped_data(),
                                                      s.x_rows, s.out_rows, s.row_bytes));
  }
  return ffi::Error::Success();
}

ffi::Error ScatterRowsCudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> pos,
                               ffi::Result<ffi::AnyBuffer> out) {
  ScatterShape s;
  if (auto err = CheckScatter(x, pos, out, &s); err.failure()) return err;
  ScopedDevice on(device);
  JAX_MOE_A2A_RETURN_IF_CUDA_ERROR(on.error());
  JAX_MOE_A2A_RETURN_IF_CUDA_ERROR(LaunchScatterRows(stream, x.untyped_data(), pos.typed_data(), out->untyped_data(),
                                                     s.x_rows, s.k, s.out_rows, s.row_bytes));
  return ffi::Error::Success();
}

ffi::Error SumRowsCudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer y, ffi::Buffer<ffi::S32> pos,
                           ffi::Buffer<ffi::F32> weights, ffi::Result<ffi::AnyBuffer> out) {
  SumShape s;
  if (auto err = CheckSum(y, pos, weights, out, &s); err.failure()) return err;
  if (s.hidden % 8 != 0) return InvalidArg(kSumOp, "H on the GPU", "a multiple of 8", s.hidden);
  ScopedDevice on(device);
  JAX_MOE_A2A_RETURN_IF_CUDA_ERROR(on.error());
  JAX_MOE_A2A_RETURN_IF_CUDA_ERROR(LaunchSumRows(stream, TypeOf(y.element_type()), TypeOf(out->element_type()),
                                                 y.untyped_data(), pos.typed_data(),
                                                 s.weighted ? weights.typed_data() : nullptr, out->untyped_data(),
                                                 s.y_rows, s.out_rows, s.k, s.hidden));
  return ffi::Error::Success();
}
#endif

}  // namespace

}  // namespace jax_moe_a2a

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeA2aGatherRowsCpu, jax_moe_a2a::GatherRowsCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()                  // x
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()      // idx
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()      // scale
                                  .Ret<xla::ffi::AnyBuffer>());                // out

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeA2aScatterRowsCpu, jax_moe_a2a::ScatterRowsCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()                  // x
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()      // pos
                                  .Ret<xla::ffi::AnyBuffer>());                // out

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeA2aSumRowsCpu, jax_moe_a2a::SumRowsCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()                  // y
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()      // pos
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()      // weights
                                  .Ret<xla::ffi::AnyBuffer>());                // out

#ifdef JAX_MOE_A2A_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeA2aGatherRowsCuda, jax_moe_a2a::GatherRowsCudaImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .Arg<xla::ffi::AnyBuffer>()                     // x
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // idx
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()         // scale
                                  .Ret<xla::ffi::AnyBuffer>(),                    // out
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeA2aScatterRowsCuda, jax_moe_a2a::ScatterRowsCudaImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .Arg<xla::ffi::AnyBuffer>()                     // x
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // pos
                                  .Ret<xla::ffi::AnyBuffer>(),                    // out
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeA2aSumRowsCuda, jax_moe_a2a::SumRowsCudaImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .Arg<xla::ffi::AnyBuffer>()                     // y
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // pos
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()         // weights
                                  .Ret<xla::ffi::AnyBuffer>(),                    // out
                              {xla::ffi::Traits::kCmdBufferCompatible});
#endif
