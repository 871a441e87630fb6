// quant_kernels.cu -- FP8 1x128 blockwise quantization on the GPU.
//
// NOTES:
//   - The rule is quant.h's, bit for bit: a power-of-two scale from the bits of amax, an exact product, clamp to
//     +-E4m3Limit (448, or 240 at the top scale 2^120), hardware round-to-nearest-even conversion.
//   - One group (128 values) is handled by kGroup / kVec consecutive threads, each loading 16 bytes; the group's
//     amax is reduced with shuffles inside that lane segment. Every lane takes part in the shuffles, also lanes
//     past the end (their loads and stores are skipped), so full-warp shuffle masks stay valid.
//   - Groups are enumerated row-major, so a block reads and writes one contiguous stretch of x and x_q. The
//     block-major scale layout [k/128, m] then gets strided 4-byte stores (1/64 of the traffic), which L2 merges
//     with the neighbouring rows' stores of the next blocks.
//   - Each thread keeps kManyUnroll independent 16-byte loads in flight before it computes (fewer when there are few
//     groups, so they spread over more warps).
//   - Grouped K-major (128 tokens of a group x 1 column): a setup launch turns group_sizes into a table of 128-row
//     blocks (first row, rows), one block of threads with a running prefix sum; then one thread block per 128-row
//     block and 256 bytes of columns (128 for E4M3 input) transposes them through a swizzled shared tile
//     (QuantizeKmajorTiledKernel) and stores each column's 128 codes as 16-byte pieces of a q_t row. Every input
//     byte is read once, in 16-byte loads.
//   - 128x128 weight blocks: one thread block per tile; each thread loads its 16-byte pieces of the tile's rows,
//     the tile's amax is reduced over the warp and then the block (shared memory), and each thread encodes and
//     stores its own pieces: one read of the weights, one write of the codes (two when the transposed codes are
//     written too, through a shared-memory tile).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include <cub/block/block_scan.cuh>

#include "device_io.cuh"
#include "quant.h"
#include "quant_device.cuh"
#include "quant_kernels.cuh"

namespace jax_moe_a2a {

namespace {

constexpr int kThreads = 256;
// Groups per thread: kManyUnroll loads in flight, or kFewUnroll where kManyUnroll would leave fewer than kMinBlocks
// blocks (a few rows: decode), so that more warps share each SM.
constexpr int kManyUnroll = 8;
constexpr int kFewUnroll = 2;
constexpr int64_t kMinBlocks = 4 * 132;

template <int kVec>
__device__ __forceinline__ void StoreBytes(uint8_t* dst, const uint8_t* bytes);

template <>
__device__ __forceinline__ void StoreBytes<8>(uint8_t* dst, const uint8_t* bytes) {
  *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(bytes);
}

template <>
__device__ __forceinline__ void StoreBytes<4>(uint8_t* dst, const uint8_t* bytes) {
  *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<const uint32_t*>(bytes);
}

// The rule of quant.h for one group (or block) of amax `amax` and finiteness `finite`, applied to kVec of its
// values: writes their E4M3 codes to `bytes` and returns the group's scale.
template <int kVec>
__device__ __forceinline__ float EncodePiece(const float* v, float amax, int finite, uint8_t* bytes) {
  if (!finite) {
#pragma unroll
    for (int i = 0; i < kVec; ++i) bytes[i] = kE4m3NaN;
    return __uint_as_float(kF32QuietNaN);
  }
  const uint32_t biased = ScaleExponent(__float_as_uint(fmaxf(amax, kAmaxFloor)));
  const float inv_scale = __uint_as_float((254u - biased) << 23);
  const float limit = E4m3Limit(biased);
  EncodeE4m3<kVec>(v, inv_scale, limit, bytes);
  return __uint_as_float(biased << 23);
}

// silu(g) * u in float32: the operations of the CPU handler's Swiglu (quant.cc), each correctly rounded but expf
// (CUDA's, within 2 ulp).
__device__ __forceinline__ float Swiglu(float g, float u) {
  const float sig = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-g)));
  return __fmul_rn(__fmul_rn(g, sig), u);
}

// Index is uint32_t when every element offset fits (cheaper division), else int64_t. kSwiglu: x is [m, 2k], gate
// columns then up columns, and the values quantized are silu(gate) * up (row-major scales only).
template <typename T, bool kBlockMajorK, bool kSwiglu, int kUnroll, typename Index>
__global__ void __launch_bounds__(kThreads) QuantizeFp8BlockwiseKernel(const T* __restrict__ x,
                                                                       uint8_t* __restrict__ x_q,
                                                                       float* __restrict__ x_sf, Index m,
                                                                       Index groups_per_row) {
  constexpr int kVec = 16 / sizeof(T);       // values per 16-byte load
  constexpr int kLanes = kGroup / kVec;      // threads per group: 16 (2-byte input) or 32 (float32)
  constexpr int kGroupsPerPass = kThreads / kLanes;
  const int lane = threadIdx.x % kLanes;
  const Index num_groups = m * groups_per_row;
  const Index first = static_cast<Index>(blockIdx.x) * (kGroupsPerPass * kUnroll) + threadIdx.x / kLanes;

  uint4 raw[kUnroll];
  uint4 raw_up[kSwiglu ? kUnroll : 1];
  Index offset[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const Index f = first + static_cast<Index>(u) * kGroupsPerPass;
    offset[u] = f * kGroup + lane * kVec;  // groups are enumerated row-major: f = row * groups_per_row + g
    if constexpr (kSwiglu) {
      const Index width = groups_per_row * kGroup;                    // k: the gate (and up) columns of a row
      const Index in = offset[u] + (f / groups_per_row) * width;      // row * 2k + column, gate
      raw[u] = f < num_groups ? LoadStreaming(x + in) : make_uint4(0, 0, 0, 0);
      raw_up[u] = f < num_groups ? LoadStreaming(x + in + width) : make_uint4(0, 0, 0, 0);
    } else {
      raw[u] = f < num_groups ? LoadStreaming(x + offset[u]) : make_uint4(0, 0, 0, 0);
    }
  }

#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const Index f = first + static_cast<Index>(u) * kGroupsPerPass;
    float v[kVec];
    Unpack<T>(raw[u], v);
    if constexpr (kSwiglu) {
      float up[kVec];
      Unpack<T>(raw_up[u], up);
#pragma unroll
      for (int i = 0; i < kVec; ++i) v[i] = Swiglu(v[i], up[i]);
    }
    float amax = 0.0f;
    int finite = 1;
    FoldAmax<kVec>(v, amax, finite);
    ReduceAmaxOverLanes<kLanes / 2>(amax, finite);
    if (f >= num_groups) continue;
    uint8_t bytes[kVec];
    const float scale = EncodePiece<kVec>(v, amax, finite, bytes);
    StoreBytes<kVec>(x_q + offset[u], bytes);
    if (lane == 0) x_sf[kBlockMajorK ? (f % groups_per_row) * m + f / groups_per_row : f] = scale;
  }
}

template <typename T, bool kBlockMajorK, bool kSwiglu, int kUnroll>
cudaError_t LaunchKernel(cudaStream_t stream, const T* x, uint8_t* x_q, float* x_sf, int64_t m,
                         int64_t groups_per_row) {
  constexpr int64_t kGroupsPerBlock = static_cast<int64_t>(kThreads / (kGroup / (16 / sizeof(T)))) * kUnroll;
  const int64_t blocks = (m * groups_per_row + kGroupsPerBlock - 1) / kGroupsPerBlock;
  if (blocks > 0x7FFFFFFF) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(blocks));
  // The last block may enumerate groups past the end: those indices (of x, twice as wide with swiglu) must fit the
  // index type too.
  if (blocks * kGroupsPerBlock * kGroup * (kSwiglu ? 2 : 1) >= (int64_t{1} << 32)) {
    QuantizeFp8BlockwiseKernel<T, kBlockMajorK, kSwiglu, kUnroll, int64_t><<<grid, kThreads, 0, stream>>>(
        x, x_q, x_sf, m, groups_per_row);
  } else {
    QuantizeFp8BlockwiseKernel<T, kBlockMajorK, kSwiglu, kUnroll, uint32_t><<<grid, kThreads, 0, stream>>>(
        x, x_q, x_sf, static_cast<uint32_t>(m), static_cast<uint32_t>(groups_per_row));
  }
  return cudaGetLastError();
}

template <typename T, bool kBlockMajorK, bool kSwiglu>
cudaError_t LaunchUnrolled(cudaStream_t stream, const T* x, uint8_t* x_q, float* x_sf, int64_t m,
                           int64_t groups_per_row) {
  constexpr int64_t kGroupsPerBlock = static_cast<int64_t>(kThreads / (kGroup / (16 / sizeof(T)))) * kManyUnroll;
  if ((m * groups_per_row + kGroupsPerBlock - 1) / kGroupsPerBlock >= kMinBlocks) {
    return LaunchKernel<T, kBlockMajorK, kSwiglu, kManyUnroll>(stream, x, x_q, x_sf, m, groups_per_row);
  }
  return LaunchKernel<T, kBlockMajorK, kSwiglu, kFewUnroll>(stream, x, x_q, x_sf, m, groups_per_row);
}

template <typename T>
cudaError_t Launch(cudaStream_t stream, const void* x, uint8_t* x_q, float* x_sf, int64_t m, int64_t k,
                   bool block_major_k, bool swiglu) {
  const int64_t groups_per_row = k / kGroup;
  if (m * groups_per_row == 0) return cudaSuccess;
  if (swiglu && block_major_k) return cudaErrorInvalidValue;
  const auto* xt = static_cast<const T*>(x);
  if (swiglu) return LaunchUnrolled<T, false, true>(stream, xt, x_q, x_sf, m, groups_per_row);
  if (block_major_k) return LaunchUnrolled<T, true, false>(stream, xt, x_q, x_sf, m, groups_per_row);
  return LaunchUnrolled<T, false, false>(stream, xt, x_q, x_sf, m, groups_per_row);
}

// ---------------------------------------------------------------------------------------------------------------
// 128x128 weight blocks
// ---------------------------------------------------------------------------------------------------------------

// The byte offset in the shared 128x128 code tile of the 4-byte word `word` (0..31) of tile row `row`: words are
// XORed with 4 x the row's 16-row piece, which keeps each aligned pair of words (a thread's 8-byte store) together.
__device__ __forceinline__ int TileWord(int row, int word) {
  return row * kGroup + ((word ^ (((row >> 4) & 7) << 2)) << 2);
}

// One block of kThreads threads per 128x128 tile of w [batch, n, k] (k % (16 / sizeof(T)) == 0): every thread
// loads its kPasses 16-byte pieces (rows threadIdx.x / kLanes + pass * kRowsPerPass, columns from lane * kVec),
// the tile's amax and finiteness are reduced over the warp and then over the block through shared memory, and
// each thread converts and stores its own pieces. Pieces past n or k are neither loaded nor stored.
//
// With kTransposed, the codes are also written as w_q_t [batch, k, n] (n % 16 == 0): each thread's codes go to a
// shared 128x128 tile, then each thread reads a 16-row x 4-column piece of it as sixteen 4-byte words, transposes it
// in registers with byte permutes, and writes four 16-byte pieces of w_q_t rows. The 8 lanes of a warp that hold the
// same 4 columns hold the tile's 8 row pieces, so each of their stores writes a whole 128-byte line of a w_q_t row;
// the tile's 4-byte words are swizzled by row piece (TileWord) so that those lanes' reads of one column word fall on
// distinct banks. The weights are still read once.
template <typename T, bool kTransposed>
__global__ void __launch_bounds__(kThreads) QuantizeFp8WeightKernel(const T* __restrict__ w,
                                                                    uint8_t* __restrict__ w_q,
                                                                    float* __restrict__ w_sf,
                                                                    uint8_t* __restrict__ w_q_t, int64_t n,
                                                                    int64_t k) {
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kLanes = kGroup / kVec;            // threads per tile row: 16 (2-byte input) or 32 (float32)
  constexpr int kRowsPerPass = kThreads / kLanes;  // 16 or 8
  constexpr int kPasses = kGroup / kRowsPerPass;   // 8 or 16
  constexpr int kWarps = kThreads / 32;
  const int64_t kb = blockIdx.x, nb = blockIdx.y, batch = blockIdx.z;
  const int64_t col = kb * kGroup + (threadIdx.x % kLanes) * kVec;
  const int64_t row0 = nb * kGroup + threadIdx.x / kLanes;
  const T* src = w + batch * n * k;
  uint8_t* dst = w_q + batch * n * k;

  uint4 raw[kPasses];
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const int64_t row = row0 + p * kRowsPerPass;
    raw[p] = row < n && col < k ? LoadStreaming(src + row * k + col) : make_uint4(0, 0, 0, 0);
  }
  float amax = 0.0f;
  int finite = 1;
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    float v[kVec];
    Unpack<T>(raw[p], v);
    FoldAmax<kVec>(v, amax, finite);
  }
  ReduceAmaxOverLanes<16>(amax, finite);
  __shared__ float warp_amax[kWarps];
  __shared__ int warp_finite[kWarps];
  if (threadIdx.x % 32 == 0) {
    warp_amax[threadIdx.x / 32] = amax;
    warp_finite[threadIdx.x / 32] = finite;
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kWarps; ++i) {
    amax = fmaxf(amax, warp_amax[i]);
    finite &= warp_finite[i];
  }

  float scale = 0.0f;
  __shared__ __align__(16) uint8_t tile[kTransposed ? kGroup * kGroup : 1];
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const int64_t row = row0 + p * kRowsPerPass;
    float v[kVec];
    Unpack<T>(raw[p], v);
    uint8_t bytes[kVec];
    scale = EncodePiece<kVec>(v, amax, finite, bytes);
    if (row < n && col < k) StoreBytes<kVec>(dst + row * k + col, bytes);
    if constexpr (kTransposed) {
      const int tile_row = threadIdx.x / kLanes + p * kRowsPerPass, tile_col = (threadIdx.x % kLanes) * kVec;
      StoreBytes<kVec>(tile + TileWord(tile_row, tile_col / 4), bytes);
    }
  }
  if (threadIdx.x == 0) w_sf[(batch * gridDim.y + nb) * gridDim.x + kb] = scale;
  if constexpr (kTransposed) {
    __syncthreads();
    // Lane l of warp w: the 16-row piece l % 8 of the 4 columns from 4 (4 w + l / 8).
    const int c0 = (4 * (threadIdx.x / 32) + (threadIdx.x % 32) / 8) * 4, r0 = (threadIdx.x % 8) * 16;
    uint32_t out[4][4];  // [column c0 + j][rows r0 + 4g .. r0 + 4g + 3]
#pragma unroll
    for (int g = 0; g < 4; ++g) {
      uint32_t a[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = *reinterpret_cast<const uint32_t*>(tile + TileWord(r0 + 4 * g + i, c0 / 4));
      const uint32_t lo01 = __byte_perm(a[0], a[1], 0x5140), lo23 = __byte_perm(a[2], a[3], 0x5140);
      const uint32_t hi01 = __byte_perm(a[0], a[1], 0x7362), hi23 = __byte_perm(a[2], a[3], 0x7362);
      out[0][g] = __byte_perm(lo01, lo23, 0x5410);
      out[1][g] = __byte_perm(lo01, lo23, 0x7632);
      out[2][g] = __byte_perm(hi01, hi23, 0x5410);
      out[3][g] = __byte_perm(hi01, hi23, 0x7632);
    }
    const int64_t out_col = nb * kGroup + r0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t out_row = kb * kGroup + c0 + j;
      if (out_row < k && out_col < n) {
        *reinterpret_cast<uint4*>(w_q_t + (batch * k + out_row) * n + out_col) =
            make_uint4(out[j][0], out[j][1], out[j][2], out[j][3]);
      }
    }
  }
}

template <typename T>
cudaError_t LaunchWeight(cudaStream_t stream, const void* w, uint8_t* w_q, float* w_sf, uint8_t* w_q_t,
                         int64_t batch, int64_t n, int64_t k) {
  const dim3 grid(static_cast<unsigned>((k + kGroup - 1) / kGroup), static_cast<unsigned>((n + kGroup - 1) / kGroup),
                  static_cast<unsigned>(batch));
  const auto* wt = static_cast<const T*>(w);
  if (w_q_t != nullptr) {
    QuantizeFp8WeightKernel<T, true><<<grid, kThreads, 0, stream>>>(wt, w_q, w_sf, w_q_t, n, k);
  } else {
    QuantizeFp8WeightKernel<T, false><<<grid, kThreads, 0, stream>>>(wt, w_q, w_sf, nullptr, n, k);
  }
  return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------------------------------
// Grouped K-major: 128 tokens of one group x 1 column
// ---------------------------------------------------------------------------------------------------------------

constexpr int kKmajorThreads = 256;

// One block: blocks[j] = {first source row, rows} of every 128-column block j of the layout, {0, 0} past the last
// group. Sizes are clamped as quant._clamped_groups: the start of g is min(prefix, rows), its size min(size, rows -
// start); prefix sums are int64 (at most 65535 int32 values, no overflow).
__global__ void __launch_bounds__(kKmajorThreads) KmajorBlocksKernel(const int32_t* __restrict__ sizes,
                                                                     int64_t num_groups, int64_t rows,
                                                                     int64_t num_blocks, int2* __restrict__ blocks) {
  using Scan = cub::BlockScan<int64_t, kKmajorThreads>;
  __shared__ typename Scan::TempStorage storage;
  __shared__ int64_t base_rows, base_blocks;
  if (threadIdx.x == 0) {
    base_rows = 0;
    base_blocks = 0;
  }
  __syncthreads();
  for (int64_t first = 0; first < num_groups; first += kKmajorThreads) {
    const int64_t g = first + threadIdx.x;
    const int64_t requested = g < num_groups ? max(sizes[g], 0) : 0;
    int64_t rows_before = 0, rows_total = 0;
    Scan(storage).ExclusiveSum(requested, rows_before, rows_total);
    const int64_t start = min(base_rows + rows_before, rows);
    const int64_t size = min(requested, rows - start);
    const int64_t count = (size + kGroup - 1) / kGroup;
    __syncthreads();  // the scan storage is used again
    int64_t blocks_before = 0, blocks_total = 0;
    Scan(storage).ExclusiveSum(count, blocks_before, blocks_total);
    int2* out = blocks + base_blocks + blocks_before;
    for (int64_t b = 0; b < count; ++b) {
      out[b] = make_int2(static_cast<int>(start + b * kGroup), static_cast<int>(min(static_cast<int64_t>(kGroup), size - b * kGroup)));
    }
    __syncthreads();  // everyone has read the bases
    if (threadIdx.x == 0) {
      base_rows += rows_total;
      base_blocks += blocks_total;
    }
    __syncthreads();
  }
  for (int64_t j = base_blocks + threadIdx.x; j < num_blocks; j += kKmajorThreads) blocks[j] = make_int2(0, 0);
}

// Tiled: one thread block per 128-row block of the layout and kCols columns. The 128 rows x kRowBytes are read in
// 16-byte pieces (each warp reads whole row segments) into a shared tile whose 16-byte chunks are swizzled by row
// (chunk ^ (row / 16) % 8); then 8 lanes share each 4-byte column word, lane s reading rows 16s .. 16s + 15 of it
// (the swizzle puts the 8 row segments of a warp's 4 words on 32 distinct banks), reduce each column's amax with
// three shuffles and store their 16 codes of the column as one 16-byte piece of a q_t row. E4M3 input is decoded
// and multiplied by its row's 1x128 scale before the amax, as quant.quantize_fp8_grouped_kmajor's reference does.
template <typename T>
struct KmajorTile {
  static constexpr bool kFp8 = std::is_same_v<T, uint8_t>;
  static constexpr int kRowBytes = kFp8 ? kGroup : 256;  // E4M3: one 1x128 scale group per tile row
  static constexpr int kCols = kRowBytes / static_cast<int>(sizeof(T));
  static constexpr int kPieces = kRowBytes / 16;              // 16-byte pieces per row
  static constexpr int kRowsPerPass = kKmajorThreads / kPieces;
  static constexpr int kPasses = kGroup / kRowsPerPass;
  static constexpr int kWords = kRowBytes / 4;                // 4-byte column words per row
  static constexpr int kItems = kWords * 8 / kKmajorThreads;  // (word, 16-row segment) pairs per thread
  static constexpr int kColsPerWord = 4 / static_cast<int>(sizeof(T));
};

// Column j of the 4-byte word w of one row, as float32 (E4M3: decoded, times the row's 1x128 scale).
template <typename T>
__device__ __forceinline__ float WordColumn(uint32_t w, int j, float row_scale) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __uint_as_float(j == 0 ? w << 16 : w & 0xFFFF0000u);
  } else if constexpr (std::is_same_v<T, __half>) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(j == 0 ? w & 0xFFFFu : w >> 16)));
  } else if constexpr (std::is_same_v<T, float>) {
    return __uint_as_float(w);
  } else {
    const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>((w >> (8 * j)) & 0xFFu), __NV_E4M3);
    return __fmul_rn(__half2float(__half(h)), row_scale);  // the decode is exact, NaN stays NaN
  }
}

// Grid (p/128, c/kCols).
// E4M3 input holds four columns per word: 3 blocks per SM leave it the registers to keep them without spilling.
template <typename T>
__global__ void __launch_bounds__(kKmajorThreads, KmajorTile<T>::kFp8 ? 3 : 4)
    QuantizeKmajorTiledKernel(const T* __restrict__ x, const float* __restrict__ x_sf,
                              const int32_t* __restrict__ gather, int64_t x_rows, const int2* __restrict__ blocks,
                              uint8_t* __restrict__ q_t, float* __restrict__ sf_t, int64_t c, int64_t p) {
  using Tile = KmajorTile<T>;
  __shared__ __align__(16) uint8_t tile[kGroup * Tile::kRowBytes];
  __shared__ int64_t src_row[kGroup];
  __shared__ float row_scale[Tile::kFp8 ? kGroup : 1];
  const int64_t block = blockIdx.x;
  const int64_t col0 = static_cast<int64_t>(blockIdx.y) * Tile::kCols;
  const int2 range = blocks[block];  // first source row, rows

  // src_row[r]: the row of x that sorted row range.x + r reads, or -1 for a zero row (padding, or a gather index
  // outside x).
  if (threadIdx.x < kGroup) {
    const int r = threadIdx.x;
    const int64_t sorted = static_cast<int64_t>(range.x) + r;
    const int64_t s = r >= range.y ? -1 : gather == nullptr ? sorted : gather[sorted];
    const int64_t valid = s >= 0 && s < x_rows ? s : -1;
    src_row[r] = valid;
    if constexpr (Tile::kFp8) row_scale[r] = valid >= 0 ? x_sf[valid * (c / kGroup) + col0 / kGroup] : 0.0f;
  }
  __syncthreads();

  const int piece = threadIdx.x % Tile::kPieces;
  uint4 raw[Tile::kPasses];
#pragma unroll
  for (int i = 0; i < Tile::kPasses; ++i) {
    const int64_t s = src_row[threadIdx.x / Tile::kPieces + i * Tile::kRowsPerPass];
    raw[i] = s >= 0 ? LoadStreaming(reinterpret_cast<const uint8_t*>(x + s * c + col0) + 16 * piece)
                    : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int i = 0; i < Tile::kPasses; ++i) {
    const int r = threadIdx.x / Tile::kPieces + i * Tile::kRowsPerPass;
    *reinterpret_cast<uint4*>(tile + r * Tile::kRowBytes + 16 * (piece ^ ((r / 16) % 8))) = raw[i];
  }
  __syncthreads();

  const int lane = threadIdx.x % 32, seg = lane / 4;
#pragma unroll
  for (int it = 0; it < Tile::kItems; ++it) {
    const int item = threadIdx.x + it * kKmajorThreads;
    const int word = lane % 4 + 4 * (item / 32);
    uint32_t w[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int r = 16 * seg + i;
      w[i] = *reinterpret_cast<const uint32_t*>(tile + r * Tile::kRowBytes + 16 * ((word / 4) ^ seg) + 4 * (word % 4));
    }
    const int64_t col = col0 + word * Tile::kColsPerWord;
    float scale[Tile::kColsPerWord];
#pragma unroll
    for (int j = 0; j < Tile::kColsPerWord; ++j) {
      float v[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) v[i] = WordColumn<T>(w[i], j, Tile::kFp8 ? row_scale[16 * seg + i] : 0.0f);
      float amax = 0.0f;
      int finite = 1;
      FoldAmax<16>(v, amax, finite);
      ReduceAmaxOverLanes<16, 4>(amax, finite);  // the 8 lanes of a column word: lane bits 2..4
      __align__(16) uint8_t bytes[16];
      scale[j] = EncodePiece<16>(v, amax, finite, bytes);
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        if (16 * seg + i >= range.y) bytes[i] = 0;  // padding stays code 0, also in a NaN block
      }
      *reinterpret_cast<uint4*>(q_t + (col + j) * p + block * kGroup + 16 * seg) =
          *reinterpret_cast<const uint4*>(bytes);
    }
    if (seg == 0) {
#pragma unroll
      for (int j = 0; j < Tile::kColsPerWord; ++j) sf_t[block * c + col + j] = scale[j];
    }
  }
}

// Calls fn with a value of the element type `type` names (its type picks the kernel instantiation).
template <typename Fn>
cudaError_t WithInputType(InputType type, Fn fn) {
  switch (type) {
    case InputType::kBF16:
      return fn(__nv_bfloat16{});
    case InputType::kF16:
      return fn(__half{});
    case InputType::kF32:
      return fn(float{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t LaunchQuantizeFp8Blockwise(cudaStream_t stream, InputType type, const void* x, uint8_t* x_q,
                                       float* x_sf, int64_t m, int64_t k, bool block_major_k, bool swiglu) {
  return WithInputType(type, [&](auto tag) {
    return Launch<decltype(tag)>(stream, x, x_q, x_sf, m, k, block_major_k, swiglu);
  });
}

cudaError_t LaunchQuantizeFp8Weight(cudaStream_t stream, InputType type, const void* w, uint8_t* w_q, float* w_sf,
                                    uint8_t* w_q_t, int64_t batch, int64_t n, int64_t k) {
  if (batch == 0 || n == 0 || k == 0) return cudaSuccess;
  if ((k + kGroup - 1) / kGroup > 0x7FFFFFFF || (n + kGroup - 1) / kGroup > 65535 || batch > 65535 ||
      (w_q_t != nullptr && n % 16 != 0)) {
    return cudaErrorInvalidValue;
  }
  return WithInputType(type, [&](auto tag) {
    return LaunchWeight<decltype(tag)>(stream, w, w_q, w_sf, w_q_t, batch, n, k);
  });
}

cudaError_t LaunchQuantizeFp8GroupedKmajor(cudaStream_t stream, InputType type, const void* x, const float* x_sf,
                                           const int32_t* rows, int64_t x_rows, const int32_t* group_sizes,
                                           int64_t num_groups, uint8_t* q_t, float* sf_t, int32_t* blocks, int64_t m,
                                           int64_t c) {
  const int64_t p = GroupedKmajorLength(m, num_groups);
  const int64_t num_blocks = p / kGroup;
  // The grid's second dimension is c / kCols, largest for float32 input (the narrowest tile).
  if (c % kGroup != 0 || c / KmajorTile<float>::kCols > 65535 || num_blocks > 0x7FFFFFFF || m > 0x7FFFFFFF) {
    return cudaErrorInvalidValue;
  }
  auto* table = reinterpret_cast<int2*>(blocks);
  KmajorBlocksKernel<<<1, kKmajorThreads, 0, stream>>>(group_sizes, num_groups, m, num_blocks, table);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  const auto launch = [&](auto tag, const float* scales) {
    using T = decltype(tag);
    const dim3 grid(static_cast<unsigned>(num_blocks), static_cast<unsigned>(c / KmajorTile<T>::kCols));
    QuantizeKmajorTiledKernel<T><<<grid, kKmajorThreads, 0, stream>>>(static_cast<const T*>(x), scales, rows, x_rows,
                                                                      table, q_t, sf_t, c, p);
    return cudaGetLastError();
  };
  if (x_sf != nullptr) return launch(uint8_t{}, x_sf);
  return WithInputType(type, [&](auto tag) { return launch(tag, nullptr); });
}

}  // namespace jax_moe_a2a
