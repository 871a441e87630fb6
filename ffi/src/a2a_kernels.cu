// a2a_kernels.cu -- one-sided dispatch and combine over NVLink peer memory.
//
// NOTES:
//   - Dispatch is three kernels on the caller's stream: slots (one block; warp r scans the tokens bound for
//     rank r with ballots, so slots are exclusive prefix counts in token order), put (a warp per token stores
//     its rows straight into every destination's receive region, then the last block raises this rank's flag on
//     every peer with st.release.sys), receive (waits for every source's flag with a %globaltimer bound, then
//     copies the filled slots to the outputs and pads the rest). Combine is two: put (rows back to their
//     sources) and reduce (wait, then sum per token over ranks in ascending order, in float32).
//   - The epoch of each op lives in device memory; only the kernels advance it (the last block of the receive
//     kernel), so the launches can be captured in a CUDA graph and replayed. Call e uses buffer e & 1.
//   - Flags carry (epoch << 16) | signature. A waiter accepts flag >> 16 >= e (a fast peer may already have
//     posted e + 1) and checks the signature: a peer that called with other shapes is reported, not trusted.
//   - A wait that expires records the missing source in a host-mapped error word and stops waiting; the outputs
//     of that call are then undefined and the handler fails every later call on the workspace.
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

// Threads [0, num_ranks) of the block wait for every source's flag of call `e`; the block then continues.
__device__ void WaitForSources(uint64_t* flags, int num_ranks, uint64_t e, uint32_t signature, int64_t timeout_ns,
                               int* error) {
  const int src = threadIdx.x;
  if (src < num_ranks) {
    const int64_t t0 = GlobalTimerNs();
    uint64_t f;
    while (((f = LoadAcquireSys(&flags[src])) >> 16) < e) {
      if (*reinterpret_cast<volatile int*>(error) != 0) break;
      if (GlobalTimerNs() - t0 > timeout_ns) {
        atomicCAS(error, 0, kErrorTimeoutBase + src);
        break;
      }
    }
    if ((f >> 16) == e && static_cast<uint32_t>(f & 0xFFFF) != signature) atomicCAS(error, 0, kErrorMismatchBase + src);
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

// Bit r of the result: token t has a valid expert on rank r.
__device__ __forceinline__ uint64_t DestMask(const DispatchParams& p, int64_t t, int64_t local) {
  uint64_t mask = 0;
  if (t < p.num_tokens) {
    for (int64_t k = 0; k < p.top_k; ++k) {
      const int64_t id = p.ids[t * p.top_k + k];
      if (id >= 0 && id < p.num_experts) mask |= uint64_t{1} << (id / local);
    }
  }
  return mask;
}

// One block. Warp w owns a contiguous range of tokens: it counts them per rank (ballots), the warps' counts are
// scanned per rank in shared memory, then each warp assigns its slots from its base in token order.
__global__ void __launch_bounds__(1024) DispatchSlotsKernel(const __grid_constant__ DispatchParams p) {
  __shared__ int32_t base[32][kMaxRanks];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, num_warps = blockDim.x / 32;
  const int64_t local = p.num_experts / p.num_ranks;
  const int64_t per_warp = ((p.num_tokens + num_warps - 1) / num_warps + 31) / 32 * 32;
  const int64_t begin = warp * per_warp, end = min(p.num_tokens, begin + per_warp);
  int32_t count_lo = 0, count_hi = 0;  // this lane's counts for ranks lane and lane + 32
  for (int64_t c = begin; c < end; c += 32) {
    const uint64_t mask = c + lane < end ? DestMask(p, c + lane, local) : 0;
    for (int r = 0; r < p.num_ranks; ++r) {
      const int n = __popc(__ballot_sync(0xFFFFFFFFu, (mask >> r) & 1));
      if (r == lane) count_lo += n;
      if (r == lane + 32) count_hi += n;
    }
  }
  if (lane < p.num_ranks) base[warp][lane] = count_lo;
  if (lane + 32 < p.num_ranks) base[warp][lane + 32] = count_hi;
  __syncthreads();
  auto* send_counts = reinterpret_cast<int32_t*>(p.peers.base[p.me] + p.off_sync + kSyncCountsOffset);
  if (threadIdx.x < p.num_ranks) {  // exclusive scan over warps, per rank
    int32_t running = 0;
    for (int w = 0; w < num_warps; ++w) {
      const int32_t n = base[w][threadIdx.x];
      base[w][threadIdx.x] = running;
      running += n;
    }
    send_counts[threadIdx.x] = running;
  }
  __syncthreads();
  for (int64_t c = begin; c < end; c += 32) {
    const int64_t t = c + lane;
    const uint64_t mask = t < end ? DestMask(p, t, local) : 0;
    for (int r = 0; r < p.num_ranks; ++r) {
      const bool dest = (mask >> r) & 1;
      const unsigned ballot = __ballot_sync(0xFFFFFFFFu, dest);
      const int32_t first = base[warp][r];
      if (t < end) p.send_slot[t * p.num_ranks + r] = dest ? first + __popc(ballot & ((1u << lane) - 1u)) : -1;
      __syncwarp();
      if (lane == 0) base[warp][r] = first + __popc(ballot);
      __syncwarp();
    }
  }
}

__global__ void __launch_bounds__(kThreads) DispatchPutKernel(const __grid_constant__ DispatchParams p) {
  uint8_t* mine = p.peers.base[p.me];
  uint64_t* sync = Sync(mine, p.off_sync, kDispatch);
  const uint64_t e = *reinterpret_cast<volatile uint64_t*>(&sync[0]) + 1;
  const int64_t buf = static_cast<int64_t>(e & 1) * p.buffer_stride;
  const int lane = threadIdx.x % 32;
  const int64_t local = p.num_experts / p.num_ranks;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t t = blockIdx.x * kWarps + threadIdx.x / 32; t < p.num_tokens; t += warps) {
    for (int r = 0; r < p.num_ranks; ++r) {
      const int32_t slot = p.send_slot[t * p.num_ranks + r];
      if (slot < 0) continue;
      // A row for this rank goes straight to the outputs; a row for a peer into its receive region.
      const bool self = r == p.me;
      uint8_t* dst = p.peers.base[r] + buf;
      const int64_t row = self ? p.me * p.num_tokens + slot : p.me * p.capacity + slot;
      uint8_t* dst_x = self ? p.recv_x : dst + p.off_x;
      uint8_t* dst_sf = self ? p.recv_sf : dst + p.off_sf;
      auto* dst_ids = self ? p.recv_ids : reinterpret_cast<int32_t*>(dst + p.off_ids);
      auto* dst_w = self ? p.recv_weights : reinterpret_cast<float*>(dst + p.off_weights);
      WarpCopy(dst_x + row * p.x_row, p.x + t * p.x_row, p.x_row, lane);
      WarpCopy(dst_sf + row * p.sf_row, p.x_sf + t * p.sf_row, p.sf_row, lane);
      for (int64_t k = lane; k < p.top_k; k += 32) {
        const int64_t id = p.ids[t * p.top_k + k];
        const bool here = id >= 0 && id < p.num_experts && id / local == r;
        dst_ids[row * p.top_k + k] = here ? static_cast<int32_t>(id - r * local) : -1;
        dst_w[row * p.top_k + k] = here ? p.weights[t * p.top_k + k] : 0.0f;
      }
    }
  }
  if (blockIdx.x == 0 && threadIdx.x < p.num_ranks) {
    const auto* send_counts = reinterpret_cast<const int32_t*>(mine + p.off_sync + kSyncCountsOffset);
    reinterpret_cast<int32_t*>(p.peers.base[threadIdx.x] + buf + p.off_counts)[p.me] = send_counts[threadIdx.x];
  }
  LastBlock<true>(&sync[1], [&] {
    const uint64_t flag = (e << 16) | p.signature;
    for (int q = 0; q < p.num_ranks; ++q)
      StoreReleaseSys(&Flags(p.peers.base[q], p.off_flags, kDispatch, p.num_ranks)[p.me], flag);
  });
}

__global__ void __launch_bounds__(kThreads) DispatchRecvKernel(const __grid_constant__ DispatchParams p) {
  uint8_t* mine = p.peers.base[p.me];
  uint64_t* sync = Sync(mine, p.off_sync, kDispatch);
  const uint64_t e = *reinterpret_cast<volatile uint64_t*>(&sync[0]) + 1;
  const int64_t buf = static_cast<int64_t>(e & 1) * p.buffer_stride;
  WaitForSources(Flags(mine, p.off_flags, kDispatch, p.num_ranks), p.num_ranks, e, p.signature, p.timeout_ns,
                 p.error);
  const uint8_t* region = mine + buf;
  const auto* counts = reinterpret_cast<const int32_t*>(region + p.off_counts);
  if (blockIdx.x == 0 && threadIdx.x < p.num_ranks) p.recv_counts[threadIdx.x] = counts[threadIdx.x];
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  const int64_t rows = p.num_ranks * p.num_tokens;
  for (int64_t o = blockIdx.x * kWarps + threadIdx.x / 32; o < rows; o += warps) {
    const int64_t s = o / p.num_tokens, j = o % p.num_tokens;
    const int64_t n = min(static_cast<int64_t>(counts[s]), p.num_tokens);
    const int64_t w = s * p.capacity + j;
    if (j < n && s == p.me) continue;  // written by the put kernel
    if (j < n) {
      WarpCopy(p.recv_x + o * p.x_row, region + p.off_x + w * p.x_row, p.x_row, lane);
      WarpCopy(p.recv_sf + o * p.sf_row, region + p.off_sf + w * p.sf_row, p.sf_row, lane);
      WarpCopy(reinterpret_cast<uint8_t*>(p.recv_ids + o * p.top_k), region + p.off_ids + w * p.top_k * 4,
               p.top_k * 4, lane);
      WarpCopy(reinterpret_cast<uint8_t*>(p.recv_weights + o * p.top_k), region + p.off_weights + w * p.top_k * 4,
               p.top_k * 4, lane);
    } else {
      WarpZero(p.recv_x + o * p.x_row, p.x_row, lane);
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

__global__ void __launch_bounds__(kThreads) CombinePutKernel(const __grid_constant__ CombineParams p) {
  uint8_t* mine = p.peers.base[p.me];
  uint64_t* sync = Sync(mine, p.off_sync, kCombine);
  const uint64_t e = *reinterpret_cast<volatile uint64_t*>(&sync[0]) + 1;
  const int64_t buf = static_cast<int64_t>(e & 1) * p.buffer_stride;
  const int lane = threadIdx.x % 32;
  const int64_t row_bytes = p.hidden * p.in_bytes;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  const int64_t rows = p.num_ranks * p.num_tokens;
  for (int64_t o = blockIdx.x * kWarps + threadIdx.x / 32; o < rows; o += warps) {
    const int64_t s = o / p.num_tokens, j = o % p.num_tokens;
    if (s == p.me || j >= min(static_cast<int64_t>(p.recv_counts[s]), p.num_tokens)) continue;  // own: read in place
    uint8_t* dst = p.peers.base[s] + buf + p.off_combine + (p.me * p.capacity + j) * row_bytes;
    WarpCopy(dst, p.expert_out + o * row_bytes, row_bytes, lane);
  }
  LastBlock<true>(&sync[1], [&] {
    const uint64_t flag = (e << 16) | p.signature;
    for (int q = 0; q < p.num_ranks; ++q)
      StoreReleaseSys(&Flags(p.peers.base[q], p.off_flags, kCombine, p.num_ranks)[p.me], flag);
  });
}

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

// Each thread sums 8 consecutive values of one token over the ranks, in ascending rank order, in float32. Rows
// from this rank are read where the expert stage left them (expert_out), the others from the combine region.
template <typename In, typename Out>
__global__ void __launch_bounds__(kThreads) CombineReduceKernel(const __grid_constant__ CombineParams p) {
  uint8_t* mine = p.peers.base[p.me];
  uint64_t* sync = Sync(mine, p.off_sync, kCombine);
  const uint64_t e = *reinterpret_cast<volatile uint64_t*>(&sync[0]) + 1;
  const int64_t buf = static_cast<int64_t>(e & 1) * p.buffer_stride;
  WaitForSources(Flags(mine, p.off_flags, kCombine, p.num_ranks), p.num_ranks, e, p.signature, p.timeout_ns,
                 p.error);
  const uint8_t* region = mine + buf + p.off_combine;
  const int64_t vecs_per_row = p.hidden / 8;
  const int64_t total = p.num_tokens * vecs_per_row;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / vecs_per_row, h = (i % vecs_per_row) * 8;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int r = 0; r < p.num_ranks; ++r) {
      const int32_t slot = p.send_slot[t * p.num_ranks + r];
      if (slot < 0) continue;
      const uint8_t* row = r == p.me ? p.expert_out + (p.me * p.num_tokens + slot) * p.hidden * sizeof(In)
                                     : region + (r * p.capacity + slot) * p.hidden * sizeof(In);
      float v[8];
      LoadVec8<In>(row + h * sizeof(In), v);
#pragma unroll
      for (int u = 0; u < 8; ++u) acc[u] = __fadd_rn(acc[u], v[u]);
    }
    StoreVec8<Out>(p.out + (t * p.hidden + h) * sizeof(Out), acc);
  }
  LastBlock<false>(&sync[2], [&] { *reinterpret_cast<volatile uint64_t*>(&sync[0]) = e; });
}

int Blocks(int64_t work_items, int64_t per_block, int cap) {
  const int64_t b = (work_items + per_block - 1) / per_block;
  return static_cast<int>(b < 1 ? 1 : (b > cap ? cap : b));
}

}  // namespace

cudaError_t LaunchDispatch(cudaStream_t stream, int num_sms, const DispatchParams& p) {
  DispatchSlotsKernel<<<1, 1024, 0, stream>>>(p);
  DispatchPutKernel<<<Blocks(p.num_tokens, kWarps, num_sms), kThreads, 0, stream>>>(p);
  DispatchRecvKernel<<<Blocks(p.num_ranks * p.num_tokens, kWarps, 2 * num_sms), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t LaunchCombine(cudaStream_t stream, int num_sms, const CombineParams& p) {
  if (p.hidden % 8 != 0) return cudaErrorInvalidValue;  // the handler rejects this before launching
  CombinePutKernel<<<Blocks(p.num_ranks * p.num_tokens, kWarps, num_sms), kThreads, 0, stream>>>(p);
  const dim3 grid(Blocks(p.num_tokens * p.hidden / 8, kThreads, 2 * num_sms));
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
