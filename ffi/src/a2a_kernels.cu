// a2a_kernels.cu -- one-sided dispatch and combine over NVLink peer memory.
//
// NOTES:
//   - Dispatch is two kernels on the caller's stream: put (a block per contiguous range of tokens numbers them
//     first -- slots are exclusive prefix counts in token order, from ballots over the ids before and in its
//     range -- then a warp per 2 KiB piece of a row stores it straight into every destination's receive region;
//     the last block raises this rank's flag on every peer with st.release.sys) and receive (waits for every
//     source's flag with a %globaltimer bound, then copies the filled slots to the outputs and pads the rest).
//   - Combine is two kernels: put (rows back to their sources, a warp per 2 KiB piece; the last block raises this
//     rank's flag on every peer) and reduce (waits like receive, then a block per token sums over ranks in
//     ascending order, in float32).
//   - The epoch of each op lives in device memory; only the kernels advance it (the last block of the receive or
//     reduce kernel), so the launches can be captured in a CUDA graph and replayed. Call e uses buffer e & 1.
//   - Flags carry (epoch << 16) | signature. A waiter accepts flag >> 16 >= e (a fast peer may already have
//     posted e + 1) and checks the signature: a peer that called with other shapes is reported, not trusted.
//   - A wait that expires records the missing source in the device's abort word (polled by every waiter, so the
//     others stop too) and in a host-mapped error word (read by the handler) and stops waiting; the outputs of
//     that call are then undefined and the handler fails every later call on the workspace. Waiters never read
//     host memory: a PCIe read per spin, from hundreds of waiting blocks, delayed each wait by ~100 us.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "a2a_kernels.cuh"

namespace jax_moe_a2a {

namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kDispatch = 0;
constexpr int kCombine = 1;

__device__ __forceinline__ uint64_t LoadAcquireSys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void StoreReleaseSys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ int64_t GlobalTimerNs() {
  int64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint64_t* Sync(uint8_t* base, int64_t off_sync, int op) {
  return reinterpret_cast<uint64_t*>(base + off_sync) + op * kSyncWords;
}

__device__ __forceinline__ uint64_t* AbortWord(uint8_t* base, int64_t off_sync) {
  return Sync(base, off_sync, kDispatch) + kSyncAbortWord;
}

__device__ __forceinline__ uint64_t* Flags(uint8_t* base, int64_t off_flags, int op, int num_ranks) {
  return reinterpret_cast<uint64_t*>(base + off_flags) + op * num_ranks;
}

// Copies `bytes` from src to dst with the 32 lanes of a warp, 16 bytes at a time when alignment allows.
__device__ __forceinline__ void WarpCopy(uint8_t* dst, const uint8_t* src, int64_t bytes, int lane) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) |
                      static_cast<uintptr_t>(bytes);
  if ((a & 15) == 0) {
    // kCopyUnroll independent 16-byte loads in flight per lane before their stores.
    constexpr int kCopyUnroll = 4;
    for (int64_t i = lane * 16; i < bytes; i += 32 * 16 * kCopyUnroll) {
      uint4 v[kCopyUnroll];
#pragma unroll
      for (int u = 0; u < kCopyUnroll; ++u) {
        const int64_t o = i + u * 32 * 16;
        if (o < bytes) v[u] = *reinterpret_cast<const uint4*>(src + o);
      }
#pragma unroll
      for (int u = 0; u < kCopyUnroll; ++u) {
        const int64_t o = i + u * 32 * 16;
        if (o < bytes) *reinterpret_cast<uint4*>(dst + o) = v[u];
      }
    }
  } else if ((a & 3) == 0) {
    for (int64_t i = lane * 4; i < bytes; i += 32 * 4)
      *reinterpret_cast<uint32_t*>(dst + i) = *reinterpret_cast<const uint32_t*>(src + i);
  } else {
    for (int64_t i = lane; i < bytes; i += 32) dst[i] = src[i];
  }
}

__device__ __forceinline__ void WarpZero(uint8_t* dst, int64_t bytes, int lane) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(dst) | static_cast<uintptr_t>(bytes);
  if ((a & 15) == 0) {
    for (int64_t i = lane * 16; i < bytes; i += 32 * 16) *reinterpret_cast<uint4*>(dst + i) = make_uint4(0, 0, 0, 0);
  } else {
    for (int64_t i = lane; i < bytes; i += 32) dst[i] = 0;
  }
}

// Records the first failure of this device: in the device-local abort word, which every waiter polls, and then in
// the host-mapped error word, which the handler reads.
__device__ void Fail(uint64_t* abort, int* error, int code) {
  if (atomicCAS(reinterpret_cast<unsigned long long*>(abort), 0ull, static_cast<unsigned long long>(code)) == 0) {
    atomicCAS(error, 0, code);
  }
}

// Threads [0, num_ranks) of the block wait for every source's flag of call `e`; the block then continues. The
// loop reads device memory only (flags, abort word, %globaltimer).
__device__ void WaitForSources(uint64_t* flags, int num_ranks, uint64_t e, uint32_t signature, int64_t timeout_ns,
                               uint64_t* abort, int* error) {
  const int src = threadIdx.x;
  if (src < num_ranks) {
    const int64_t t0 = GlobalTimerNs();
    uint64_t f;
    while (((f = LoadAcquireSys(&flags[src])) >> 16) < e) {
      if (*reinterpret_cast<volatile uint64_t*>(abort) != 0) break;
      if (GlobalTimerNs() - t0 > timeout_ns) {
        Fail(abort, error, kErrorTimeoutBase + src);
        break;
      }
    }
    if ((f >> 16) == e && static_cast<uint32_t>(f & 0xFFFF) != signature) Fail(abort, error, kErrorMismatchBase + src);
  }
  __syncthreads();
}

// The last block to arrive on `counter` runs `fn`. With kRelease, every store the block made (to peers too) is
// visible system-wide before the arrival: bar.sync orders the block's stores before thread 0's fence, and PTX
// fences are cumulative, so one fence per block suffices. Without it (blocks that only read) no fence is needed.
template <bool kRelease, typename Fn>
__device__ void LastBlock(uint64_t* counter, Fn fn) {
  __syncthreads();
  if (threadIdx.x == 0) {
    if (kRelease) __threadfence_system();
    if (atomicAdd(reinterpret_cast<unsigned long long*>(counter), 1ull) == gridDim.x - 1) {
      *reinterpret_cast<volatile uint64_t*>(counter) = 0;
      __threadfence_system();
      fn();
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Dispatch
// ---------------------------------------------------------------------------------------------------------------

// Bit r of the result: token t < num_tokens has a valid expert on rank r. 32-bit arithmetic: a 64-bit division per
// id would dominate the slot counting.
__device__ __forceinline__ uint64_t DestMask(const DispatchParams& p, int64_t t, int local) {
  const int32_t* ids = p.ids + t * p.top_k;
  const int top_k = static_cast<int>(p.top_k), num_experts = static_cast<int>(p.num_experts);
  uint64_t mask = 0;
#pragma unroll 8
  for (int k = 0; k < top_k; ++k) {
    const int id = ids[k];
    if (id >= 0 && id < num_experts) mask |= uint64_t{1} << (id / local);
  }
  return mask;
}

// A row of x (or of an expert output) is moved in pieces of kPieceBytes, one warp per (row, piece): one unrolled
// round of WarpCopy, and enough work items to occupy every multiprocessor when there are few tokens.
constexpr int64_t kPieceBytes = 32 * 16 * 4;

__host__ __device__ __forceinline__ int64_t Pieces(int64_t row_bytes) {
  return row_bytes <= kPieceBytes ? 1 : (row_bytes + kPieceBytes - 1) / kPieceBytes;
}

// Adds to counts[r] (shared) how many tokens of [begin, end) have a valid expert on rank r: each warp takes
// kCountUnroll groups of 32 tokens at a time (their ids loaded together, one L2 round trip per step) and counts them
// per rank with ballots.
constexpr int kCountUnroll = 2;

__device__ void CountDestinations(const DispatchParams& p, int64_t begin, int64_t end, int local, int32_t* counts) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int32_t lo = 0, hi = 0;  // this lane's counts for ranks lane and lane + 32
  for (int64_t c = begin + warp * 32 * kCountUnroll; c < end; c += kThreads * kCountUnroll) {
    uint64_t mask[kCountUnroll];
#pragma unroll
    for (int u = 0; u < kCountUnroll; ++u) {
      const int64_t t = c + u * 32 + lane;
      mask[u] = t < end ? DestMask(p, t, local) : 0;
    }
    for (int r = 0; r < p.num_ranks; ++r) {
      int n = 0;
#pragma unroll
      for (int u = 0; u < kCountUnroll; ++u) n += __popc(__ballot_sync(0xFFFFFFFFu, (mask[u] >> r) & 1));
      if (r == lane) lo += n;
      if (r == lane + 32) hi += n;
    }
  }
  if (lo != 0) atomicAdd(&counts[lane], lo);
  if (hi != 0) atomicAdd(&counts[lane + 32], hi);
}

// Block b owns the tokens [b * per_block, (b + 1) * per_block). It first finds their slots: the count per rank of
// the tokens before its range (every block reads those ids: a few tens of KiB from L2), then warp 0 numbers its
// own tokens in order. Then each warp takes (token, piece) items of the range and stores the piece straight into
// every destination's receive region (a row for this rank goes to the outputs). The block with the last token
// knows the totals and posts them as the counts; the last block to finish raises this rank's flag on every peer.
__global__ void __launch_bounds__(kThreads) DispatchPutKernel(const __grid_constant__ DispatchParams p) {
  __shared__ int32_t base[kMaxRanks];
  uint8_t* mine = p.peers.base[p.me];
  uint64_t* sync = Sync(mine, p.off_sync, kDispatch);
  const uint64_t e = *reinterpret_cast<volatile uint64_t*>(&sync[0]) + 1;
  const int64_t buf = static_cast<int64_t>(e & 1) * p.buffer_stride;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int local = static_cast<int>(p.num_experts / p.num_ranks);
  const int64_t per_block = (p.num_tokens + gridDim.x - 1) / gridDim.x;
  const int64_t begin = min(p.num_tokens, blockIdx.x * per_block), end = min(p.num_tokens, begin + per_block);
  if (threadIdx.x < kMaxRanks) base[threadIdx.x] = 0;
  __syncthreads();
  CountDestinations(p, 0, begin, local, base);
  __syncthreads();
  if (warp == 0) {
    for (int64_t c = begin; c < end; c += 32) {
      const int64_t t = c + lane;
      const uint64_t mask = t < end ? DestMask(p, t, local) : 0;
      for (int r = 0; r < p.num_ranks; ++r) {
        const bool dest = (mask >> r) & 1;
        const unsigned ballot = __ballot_sync(0xFFFFFFFFu, dest);
        const int32_t first = base[r];
        if (t < end) p.send_slot[t * p.num_ranks + r] = dest ? first + __popc(ballot & ((1u << lane) - 1u)) : -1;
        __syncwarp();
        if (lane == 0) base[r] = first + __popc(ballot);
        __syncwarp();
      }
    }
  }
  __syncthreads();  // send_slot of the range is visible to the whole block from here on
  if (begin < end && end == p.num_tokens && threadIdx.x < p.num_ranks) {
    reinterpret_cast<int32_t*>(p.peers.base[threadIdx.x] + buf + p.off_counts)[p.me] = base[threadIdx.x];
  }
  const int64_t pieces = Pieces(p.x_row);
  for (int64_t item = warp; item < (end - begin) * pieces; item += kWarps) {
    const int64_t t = begin + item / pieces, piece = item % pieces;
    const int64_t at = piece * kPieceBytes, bytes = min(kPieceBytes, p.x_row - at);
    for (int r = 0; r < p.num_ranks; ++r) {
      const int32_t slot = p.send_slot[t * p.num_ranks + r];
      if (slot < 0) continue;
      // A row for this rank goes straight to the outputs; a row for a peer into its receive region.
      const bool self = r == p.me;
      uint8_t* dst = p.peers.base[r] + buf;
      const int64_t row = self ? p.me * p.num_tokens + slot : p.me * p.capacity + slot;
      uint8_t* dst_x = self ? p.recv_x : dst + p.off_x;
      WarpCopy(dst_x + row * p.x_row + at, p.x + t * p.x_row + at, bytes, lane);
      if (piece != 0) continue;
      uint8_t* dst_sf = self ? p.recv_sf : dst + p.off_sf;
      auto* dst_ids = self ? p.recv_ids : reinterpret_cast<int32_t*>(dst + p.off_ids);
      auto* dst_w = self ? p.recv_weights : reinterpret_cast<float*>(dst + p.off_weights);
      WarpCopy(dst_sf + row * p.sf_row, p.x_sf + t * p.sf_row, p.sf_row, lane);
      for (int64_t k = lane; k < p.top_k; k += 32) {
        const int64_t id = p.ids[t * p.top_k + k];
        const bool here = id >= 0 && id < p.num_experts && id / local == r;
        dst_ids[row * p.top_k + k] = here ? static_cast<int32_t>(id - r * local) : -1;
        dst_w[row * p.top_k + k] = here ? p.weights[t * p.top_k + k] : 0.0f;
      }
    }
  }
  LastBlock<true>(&sync[1], [&] {
    const uint64_t flag = (e << 16) | p.signature;
    for (int q = 0; q < p.num_ranks; ++q)
      StoreReleaseSys(&Flags(p.peers.base[q], p.off_flags, kDispatch, p.num_ranks)[p.me], flag);
  });
}

__global__ void __launch_bounds__(kThreads, 2) DispatchRecvKernel(const __grid_constant__ DispatchParams p) {
  uint8_t* mine = p.peers.base[p.me];
  uint64_t* sync = Sync(mine, p.off_sync, kDispatch);
  const uint64_t e = *reinterpret_cast<volatile uint64_t*>(&sync[0]) + 1;
  const int64_t buf = static_cast<int64_t>(e & 1) * p.buffer_stride;
  WaitForSources(Flags(mine, p.off_flags, kDispatch, p.num_ranks), p.num_ranks, e, p.signature, p.timeout_ns,
                 AbortWord(mine, p.off_sync), p.error);
  const uint8_t* region = mine + buf;
  const auto* counts = reinterpret_cast<const int32_t*>(region + p.off_counts);
  if (blockIdx.x == 0 && threadIdx.x < p.num_ranks) p.recv_counts[threadIdx.x] = counts[threadIdx.x];
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  const int64_t pieces = Pieces(p.x_row);
  const int64_t items = p.num_ranks * p.num_tokens * pieces;
  for (int64_t item = blockIdx.x * kWarps + threadIdx.x / 32; item < items; item += warps) {
    const int64_t o = item / pieces, piece = item - o * pieces;
    const int64_t at = piece * kPieceBytes, bytes = min(kPieceBytes, p.x_row - at);
    const int64_t s = o / p.num_tokens, j = o - s * p.num_tokens;
    const int64_t n = min(static_cast<int64_t>(counts[s]), p.num_tokens);
    const int64_t w = s * p.capacity + j;
    if (j < n && s == p.me) continue;  // written by the put kernel
    if (j < n) {
      WarpCopy(p.recv_x + o * p.x_row + at, region + p.off_x + w * p.x_row + at, bytes, lane);
      if (piece != 0) continue;
      WarpCopy(p.recv_sf + o * p.sf_row, region + p.off_sf + w * p.sf_row, p.sf_row, lane);
      WarpCopy(reinterpret_cast<uint8_t*>(p.recv_ids + o * p.top_k), region + p.off_ids + w * p.top_k * 4,
               p.top_k * 4, lane);
      WarpCopy(reinterpret_cast<uint8_t*>(p.recv_weights + o * p.top_k), region + p.off_weights + w * p.top_k * 4,
               p.top_k * 4, lane);
    } else {
      WarpZero(p.recv_x + o * p.x_row + at, bytes, lane);
      if (piece != 0) continue;
      WarpZero(p.recv_sf + o * p.sf_row, p.sf_row, lane);
      for (int64_t k = lane; k < p.top_k; k += 32) {
        p.recv_ids[o * p.top_k + k] = -1;
        p.recv_weights[o * p.top_k + k] = 0.0f;
      }
    }
  }
  LastBlock<false>(&sync[2], [&] { *reinterpret_cast<volatile uint64_t*>(&sync[0]) = e; });
}

// ---------------------------------------------------------------------------------------------------------------
// Combine
// ---------------------------------------------------------------------------------------------------------------

template <typename In>
__device__ __forceinline__ void LoadVec8(const uint8_t* p, float* v);

template <>
__device__ __forceinline__ void LoadVec8<__nv_bfloat16>(const uint8_t* p, float* v) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}

template <>
__device__ __forceinline__ void LoadVec8<float>(const uint8_t* p, float* v) {
  const uint4 a = reinterpret_cast<const uint4*>(p)[0], b = reinterpret_cast<const uint4*>(p)[1];
  v[0] = __uint_as_float(a.x), v[1] = __uint_as_float(a.y), v[2] = __uint_as_float(a.z), v[3] = __uint_as_float(a.w);
  v[4] = __uint_as_float(b.x), v[5] = __uint_as_float(b.y), v[6] = __uint_as_float(b.z), v[7] = __uint_as_float(b.w);
}

template <typename Out>
__device__ __forceinline__ void StoreVec8(uint8_t* p, const float* v);

template <>
__device__ __forceinline__ void StoreVec8<__nv_bfloat16>(uint8_t* p, const float* v) {
  uint4 raw;
  auto* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = raw;
}

template <>
__device__ __forceinline__ void StoreVec8<float>(uint8_t* p, const float* v) {
  reinterpret_cast<uint4*>(p)[0] = make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]),
                                              __float_as_uint(v[3]));
  reinterpret_cast<uint4*>(p)[1] = make_uint4(__float_as_uint(v[4]), __float_as_uint(v[5]), __float_as_uint(v[6]),
                                              __float_as_uint(v[7]));
}

__global__ void __launch_bounds__(kThreads) CombinePutKernel(const __grid_constant__ CombineParams p) {
  uint8_t* mine = p.peers.base[p.me];
  uint64_t* sync = Sync(mine, p.off_sync, kCombine);
  const uint64_t e = *reinterpret_cast<volatile uint64_t*>(&sync[0]) + 1;
  const int64_t buf = static_cast<int64_t>(e & 1) * p.buffer_stride;
  const int lane = threadIdx.x % 32;
  const int64_t row_bytes = p.hidden * p.in_bytes;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  const int64_t pieces = Pieces(row_bytes);
  const int64_t items = p.num_ranks * p.num_tokens * pieces;
  for (int64_t item = blockIdx.x * kWarps + threadIdx.x / 32; item < items; item += warps) {
    const int64_t o = item / pieces, piece = item - o * pieces;
    const int64_t s = o / p.num_tokens, j = o - s * p.num_tokens;
    if (s == p.me || j >= min(static_cast<int64_t>(p.recv_counts[s]), p.num_tokens)) continue;  // own: read in place
    const int64_t at = piece * kPieceBytes;
    uint8_t* dst = p.peers.base[s] + buf + p.off_combine + (p.me * p.capacity + j) * row_bytes + at;
    WarpCopy(dst, p.expert_out + o * row_bytes + at, min(kPieceBytes, row_bytes - at), lane);
  }
  LastBlock<true>(&sync[1], [&] {
    const uint64_t flag = (e << 16) | p.signature;
    for (int q = 0; q < p.num_ranks; ++q)
      StoreReleaseSys(&Flags(p.peers.base[q], p.off_flags, kCombine, p.num_ranks)[p.me], flag);
  });
}

// A block per token (grid-stride), its threads across the row: each thread sums 8 consecutive values over the
// ranks, in ascending rank order, in float32. Rows from this rank are read where the expert stage left them
// (expert_out), the others from the combine region.
template <typename In, typename Out>
__global__ void __launch_bounds__(kThreads) CombineReduceKernel(const __grid_constant__ CombineParams p) {
  uint8_t* mine = p.peers.base[p.me];
  uint64_t* sync = Sync(mine, p.off_sync, kCombine);
  const uint64_t e = *reinterpret_cast<volatile uint64_t*>(&sync[0]) + 1;
  const int64_t buf = static_cast<int64_t>(e & 1) * p.buffer_stride;
  WaitForSources(Flags(mine, p.off_flags, kCombine, p.num_ranks), p.num_ranks, e, p.signature, p.timeout_ns,
                 AbortWord(mine, p.off_sync), p.error);
  const uint8_t* region = mine + buf + p.off_combine;
  const int64_t in_row = p.hidden * sizeof(In);
  for (int64_t t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
    const int32_t* slots = p.send_slot + t * p.num_ranks;
    // Two 8-value vectors per thread and step, their loads issued before the adds (more bytes in flight).
    for (int64_t h0 = threadIdx.x * 8; h0 < p.hidden; h0 += 2 * blockDim.x * 8) {
      const int64_t h1 = h0 + blockDim.x * 8;
      const bool two = h1 < p.hidden;
      float acc0[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, acc1[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int r = 0; r < p.num_ranks; ++r) {
        const int32_t slot = slots[r];
        if (slot < 0) continue;
        const uint8_t* row = r == p.me ? p.expert_out + (p.me * p.num_tokens + slot) * in_row
                                       : region + (r * p.capacity + slot) * in_row;
        float v0[8], v1[8];
        LoadVec8<In>(row + h0 * sizeof(In), v0);
        if (two) LoadVec8<In>(row + h1 * sizeof(In), v1);
#pragma unroll
        for (int u = 0; u < 8; ++u) acc0[u] = __fadd_rn(acc0[u], v0[u]);
        if (two) {
#pragma unroll
          for (int u = 0; u < 8; ++u) acc1[u] = __fadd_rn(acc1[u], v1[u]);
        }
      }
      StoreVec8<Out>(p.out + (t * p.hidden + h0) * sizeof(Out), acc0);
      if (two) StoreVec8<Out>(p.out + (t * p.hidden + h1) * sizeof(Out), acc1);
    }
  }
  LastBlock<false>(&sync[2], [&] { *reinterpret_cast<volatile uint64_t*>(&sync[0]) = e; });
}

int Blocks(int64_t work_items, int64_t per_block, int cap) {
  const int64_t b = (work_items + per_block - 1) / per_block;
  return static_cast<int>(b < 1 ? 1 : (b > cap ? cap : b));
}

}  // namespace

cudaError_t LaunchDispatch(cudaStream_t stream, int num_sms, const DispatchParams& p) {
  // Put: contiguous token ranges, at most one block per multiprocessor, none empty.
  const int64_t per_block = (p.num_tokens + num_sms - 1) / num_sms;
  DispatchPutKernel<<<Blocks(p.num_tokens, per_block, num_sms), kThreads, 0, stream>>>(p);
  const int64_t pieces = Pieces(p.x_row);
  DispatchRecvKernel<<<Blocks(p.num_ranks * p.num_tokens * pieces, kWarps, 2 * num_sms), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t LaunchCombine(cudaStream_t stream, int num_sms, const CombineParams& p) {
  if (p.hidden % 8 != 0) return cudaErrorInvalidValue;  // the handler rejects this before launching
  const int64_t pieces = Pieces(p.hidden * p.in_bytes);
  CombinePutKernel<<<Blocks(p.num_ranks * p.num_tokens * pieces, kWarps, num_sms), kThreads, 0, stream>>>(p);
  const dim3 grid(Blocks(p.num_tokens, 1, 2 * num_sms));
  if (p.in_bytes == 2 && p.out_bytes == 2) {
    CombineReduceKernel<__nv_bfloat16, __nv_bfloat16><<<grid, kThreads, 0, stream>>>(p);
  } else if (p.in_bytes == 2) {
    CombineReduceKernel<__nv_bfloat16, float><<<grid, kThreads, 0, stream>>>(p);
  } else if (p.out_bytes == 2) {
    CombineReduceKernel<float, __nv_bfloat16><<<grid, kThreads, 0, stream>>>(p);
  } else {
    CombineReduceKernel<float, float><<<grid, kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace jax_moe_a2a
