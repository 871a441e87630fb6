// rows_kernels.cu -- the expert stage's row movement on the GPU: gathers by index, scatters of each row to its k
// positions, and weighted sums of k rows.
//
// NOTES:
//   - A plain gather moves words (16 bytes, or the widest that divides a row): one warp per output row, four loads
//     in flight per lane. The scaled gather and the sum take one warp per (row, 256-value segment), each lane 8
//     values (16 bytes of bfloat16, 32 of float32), so a warp's loads of one source row are contiguous and a few
//     rows (decode) still fill the GPU. Loads use the read-only path (16-byte ones do not allocate in L1: each
//     source byte is read once per output row that names it).
//   - A scatter reads each source row once and writes it k times: where the source rows exceed the L2 cache, a
//     gather of the same rows reads each from memory once per output row (k times). It works on (row, segment)
//     items, segments of four words per lane, or of one when there are few rows (decode), so they spread over
//     every SM.
//   - Products and sums use __fmul_rn / __fadd_rn: no fused multiply-add, so the CPU handler and the pure-JAX reference
//     (a product, then a sum in ascending k) round the same way.
//   - An index outside the source rows contributes nothing: a zero row for a gather, a term of +0 for a sum (its
//     source row is not read, so a NaN there reaches no output).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "device_io.cuh"
#include "rows_kernels.cuh"

namespace jax_moe_a2a {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kChunk = 8;  // values per lane per step

template <typename T>
struct Chunk;

template <>
struct Chunk<__nv_bfloat16> {
  __device__ static void Load(const __nv_bfloat16* p, float* v) {
    const uint4 raw = LoadStreaming(p);
    const auto* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(h[i]);
      v[2 * i] = f.x;
      v[2 * i + 1] = f.y;
    }
  }
  __device__ static void Store(__nv_bfloat16* p, const float* v) {
    uint4 raw;
    auto* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    *reinterpret_cast<uint4*>(p) = raw;
  }
};

template <>
struct Chunk<float> {
  __device__ static void Load(const float* p, float* v) {
    const uint4 a = LoadStreaming(p), b = LoadStreaming(p + 4);
    v[0] = __uint_as_float(a.x), v[1] = __uint_as_float(a.y), v[2] = __uint_as_float(a.z);
    v[3] = __uint_as_float(a.w), v[4] = __uint_as_float(b.x), v[5] = __uint_as_float(b.y);
    v[6] = __uint_as_float(b.z), v[7] = __uint_as_float(b.w);
  }
  __device__ static void Store(float* p, const float* v) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
    *reinterpret_cast<float4*>(p + 4) = make_float4(v[4], v[5], v[6], v[7]);
  }
};

// A read-only load of one word; 16-byte words go through the path that does not allocate in L1.
template <typename W>
__device__ __forceinline__ W LoadWord(const W* p) {
  return __ldg(p);
}
template <>
__device__ __forceinline__ uint4 LoadWord<uint4>(const uint4* p) {
  return LoadStreaming(p);
}

// Rows of words_per_row words W (the widest word that divides the row's bytes, so every row is aligned to it).
template <typename W>
__global__ void __launch_bounds__(kThreads) GatherRowsKernel(const W* __restrict__ x, const int32_t* __restrict__ idx,
                                                             W* __restrict__ out, int64_t num_x_rows,
                                                             int64_t num_out_rows, int64_t words_per_row) {
  const int lane = threadIdx.x % 32;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; row < num_out_rows;
       row += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t src = idx[row];
    W* dst = out + row * words_per_row;
    if (src < 0 || src >= num_x_rows) {
      for (int64_t v = lane; v < words_per_row; v += 32) dst[v] = W{};
      continue;
    }
    const W* from = x + src * words_per_row;
    int64_t v = lane;
    for (; v + 96 < words_per_row; v += 128) {  // four loads in flight per lane
      const W a = LoadWord(from + v), b = LoadWord(from + v + 32), c = LoadWord(from + v + 64),
              d = LoadWord(from + v + 96);
      dst[v] = a, dst[v + 32] = b, dst[v + 64] = c, dst[v + 96] = d;
    }
    for (; v < words_per_row; v += 32) dst[v] = LoadWord(from + v);
  }
}

// out[pos[r, j]] = x[r] for j < k, on (row, segment) items: a warp reads kPerLane words per lane of one source row
// (a segment of 32 * kPerLane words, all loads in flight at once) and writes them to the row's k positions.
// Positions outside [0, num_out_rows) are skipped.
template <typename W, int kPerLane>
__global__ void __launch_bounds__(kThreads) ScatterRowsKernel(const W* __restrict__ x, const int32_t* __restrict__ pos,
                                                              W* __restrict__ out, int64_t num_x_rows, int k,
                                                              int64_t num_out_rows, int64_t words_per_row) {
  constexpr int64_t kSegmentWords = 32 * kPerLane;
  const int lane = threadIdx.x % 32;
  const int64_t segments = (words_per_row + kSegmentWords - 1) / kSegmentWords;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; item < num_x_rows * segments;
       item += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t row = item / segments, first = (item % segments) * kSegmentWords + lane;
    const W* from = x + row * words_per_row;
    W v[kPerLane] = {};
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      if (first + 32 * i < words_per_row) v[i] = LoadWord(from + first + 32 * i);
    }
    const int32_t* row_pos = pos + row * k;
    for (int j = 0; j < k; ++j) {
      const int64_t p = row_pos[j];  // the same address in every lane: one load for the warp
      if (p < 0 || p >= num_out_rows) continue;
      W* dst = out + p * words_per_row;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        if (first + 32 * i < words_per_row) dst[first + 32 * i] = v[i];
      }
    }
  }
}

// The scaled gather and the sum work on (row, segment) items: a segment is one chunk of kChunk values per lane
// (32 * kChunk values of a row), so short row counts (decode) still spread over every SM.
constexpr int64_t kSegment = 32 * kChunk;

__host__ __device__ inline int64_t Segments(int64_t hidden) { return (hidden + kSegment - 1) / kSegment; }

template <typename TIn, typename TOut>
__global__ void __launch_bounds__(kThreads) GatherRowsScaledKernel(const TIn* __restrict__ x,
                                                                   const int32_t* __restrict__ idx,
                                                                   const float* __restrict__ scale,
                                                                   TOut* __restrict__ out, int64_t num_x_rows,
                                                                   int64_t num_out_rows, int64_t hidden) {
  const int lane = threadIdx.x % 32;
  const int64_t segments = Segments(hidden);
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; item < num_out_rows * segments;
       item += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t row = item / segments, c = (item % segments) * kSegment + lane * kChunk;
    if (c >= hidden) continue;
    const int64_t src = idx[row];
    float v[kChunk];
    if (src >= 0 && src < num_x_rows) {
      const float s = scale[row];
      Chunk<TIn>::Load(x + src * hidden + c, v);
#pragma unroll
      for (int i = 0; i < kChunk; ++i) v[i] = __fmul_rn(v[i], s);
    } else {
#pragma unroll
      for (int i = 0; i < kChunk; ++i) v[i] = 0.0f;
    }
    Chunk<TOut>::Store(out + row * hidden + c, v);
  }
}

// Terms are loaded kBatch at a time (independent loads in flight) and added in ascending j.
constexpr int kBatch = 4;

template <typename TIn, typename TOut>
__global__ void __launch_bounds__(kThreads) SumRowsKernel(const TIn* __restrict__ y, const int32_t* __restrict__ pos,
                                                          const float* __restrict__ weights, TOut* __restrict__ out,
                                                          int64_t num_y_rows, int64_t num_out_rows, int k,
                                                          int64_t hidden) {
  const int lane = threadIdx.x % 32;
  const int64_t segments = Segments(hidden);
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; item < num_out_rows * segments;
       item += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t row = item / segments, c = (item % segments) * kSegment + lane * kChunk;
    if (c >= hidden) continue;
    const int32_t* row_pos = pos + row * k;
    const float* row_w = weights == nullptr ? nullptr : weights + row * k;
    float acc[kChunk];
#pragma unroll
    for (int i = 0; i < kChunk; ++i) acc[i] = 0.0f;
    for (int j0 = 0; j0 < k; j0 += kBatch) {
      float v[kBatch][kChunk];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int j = j0 + b;
        const int64_t p = j < k ? row_pos[j] : -1;  // the same address in every lane: one load for the warp
        if (p >= 0 && p < num_y_rows) {
          const float w = row_w == nullptr ? 1.0f : row_w[j];
          Chunk<TIn>::Load(y + p * hidden + c, v[b]);
#pragma unroll
          for (int i = 0; i < kChunk; ++i) v[b][i] = __fmul_rn(v[b][i], w);
        } else {
#pragma unroll
          for (int i = 0; i < kChunk; ++i) v[b][i] = 0.0f;  // a left-out term adds +0, as in the reference
        }
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        if (j0 + b >= k) break;
#pragma unroll
        for (int i = 0; i < kChunk; ++i) acc[i] = __fadd_rn(acc[i], v[b][i]);
      }
    }
    Chunk<TOut>::Store(out + row * hidden + c, acc);
  }
}

// Warps below which a scatter takes segments of one word per lane: 16 warps on each of 132 SMs.
constexpr int64_t kMinScatterWarps = 16 * 132;

// Blocks for `items` warp-sized work items (a grid-stride loop covers the rest).
unsigned Blocks(int64_t items) {
  const int64_t want = (items + kWarps - 1) / kWarps;
  return static_cast<unsigned>(want < 65536 * 4 ? (want > 0 ? want : 1) : 65536 * 4);
}

// Calls fn with values of the float row types `in` and `out` name (bfloat16 or float32 each).
template <typename Fn>
cudaError_t WithRowTypes(RowType in, RowType out, Fn fn) {
  using bf16 = __nv_bfloat16;
  if (in == RowType::kBF16 && out == RowType::kBF16) return fn(bf16{}, bf16{});
  if (in == RowType::kBF16 && out == RowType::kF32) return fn(bf16{}, float{});
  if (in == RowType::kF32 && out == RowType::kBF16) return fn(float{}, bf16{});
  if (in == RowType::kF32 && out == RowType::kF32) return fn(float{}, float{});
  return cudaErrorInvalidValue;
}

// Calls fn with a value of the widest word (16, 8, 4, 2 or 1 bytes) that divides row_bytes, so every row of a
// contiguous array of such rows is aligned to it.
template <typename Fn>
cudaError_t WithRowWord(int64_t row_bytes, Fn fn) {
  if (row_bytes % 16 == 0) return fn(uint4{});
  if (row_bytes % 8 == 0) return fn(uint2{});
  if (row_bytes % 4 == 0) return fn(uint32_t{});
  if (row_bytes % 2 == 0) return fn(uint16_t{});
  return fn(uint8_t{});
}

}  // namespace

cudaError_t LaunchGatherRows(cudaStream_t stream, const void* x, const int32_t* idx, void* out, int64_t num_x_rows,
                             int64_t num_out_rows, int64_t row_bytes) {
  if (num_out_rows == 0) return cudaSuccess;
  return WithRowWord(row_bytes, [&](auto word) {
    using W = decltype(word);
    GatherRowsKernel<W><<<Blocks(num_out_rows), kThreads, 0, stream>>>(
        static_cast<const W*>(x), idx, static_cast<W*>(out), num_x_rows, num_out_rows,
        row_bytes / static_cast<int64_t>(sizeof(W)));
    return cudaGetLastError();
  });
}

cudaError_t LaunchScatterRows(cudaStream_t stream, const void* x, const int32_t* pos, void* out, int64_t num_x_rows,
                              int64_t k, int64_t num_out_rows, int64_t row_bytes) {
  if (num_x_rows == 0 || k == 0) return cudaSuccess;
  return WithRowWord(row_bytes, [&](auto word) {
    using W = decltype(word);
    const int64_t words_per_row = row_bytes / static_cast<int64_t>(sizeof(W));
    // Segments of four words per lane, or of one where that leaves too few warps to fill the GPU (a few rows:
    // decode).
    const int64_t wide_items = num_x_rows * ((words_per_row + 127) / 128);
    if (wide_items >= kMinScatterWarps) {
      ScatterRowsKernel<W, 4><<<Blocks(wide_items), kThreads, 0, stream>>>(
          static_cast<const W*>(x), pos, static_cast<W*>(out), num_x_rows, static_cast<int>(k), num_out_rows,
          words_per_row);
    } else {
      ScatterRowsKernel<W, 1><<<Blocks(num_x_rows * ((words_per_row + 31) / 32)), kThreads, 0, stream>>>(
          static_cast<const W*>(x), pos, static_cast<W*>(out), num_x_rows, static_cast<int>(k), num_out_rows,
          words_per_row);
    }
    return cudaGetLastError();
  });
}

cudaError_t LaunchGatherRowsScaled(cudaStream_t stream, RowType in, RowType out_type, const void* x,
                                   const int32_t* idx, const float* scale, void* out, int64_t num_x_rows,
                                   int64_t num_out_rows, int64_t hidden) {
  if (num_out_rows == 0) return cudaSuccess;
  return WithRowTypes(in, out_type, [&](auto in_tag, auto out_tag) {
    using TIn = decltype(in_tag);
    using TOut = decltype(out_tag);
    GatherRowsScaledKernel<TIn, TOut><<<Blocks(num_out_rows * Segments(hidden)), kThreads, 0, stream>>>(
        static_cast<const TIn*>(x), idx, scale, static_cast<TOut*>(out), num_x_rows, num_out_rows, hidden);
    return cudaGetLastError();
  });
}

cudaError_t LaunchSumRows(cudaStream_t stream, RowType in, RowType out_type, const void* y, const int32_t* pos,
                          const float* weights, void* out, int64_t num_y_rows, int64_t num_out_rows, int64_t k,
                          int64_t hidden) {
  if (num_out_rows == 0) return cudaSuccess;
  return WithRowTypes(in, out_type, [&](auto in_tag, auto out_tag) {
    using TIn = decltype(in_tag);
    using TOut = decltype(out_tag);
    SumRowsKernel<TIn, TOut><<<Blocks(num_out_rows * Segments(hidden)), kThreads, 0, stream>>>(
        static_cast<const TIn*>(y), pos, weights, static_cast<TOut*>(out), num_y_rows, num_out_rows,
        static_cast<int>(k), hidden);
    return cudaGetLastError();
  });
}

}  // namespace jax_moe_a2a
