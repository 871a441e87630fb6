// a2a_kernels.cu -- one-sided dispatch and combine over NVLink peer memory.
//
// NOTES:
//   - Each op is one kernel whose blocks take one of two roles side by side: senders (blocks [0, p.senders)) store
//     rows straight into the peers' receive regions, receivers (the rest) consume what has arrived. Rows cross in
//     kPieceBytes pieces; a sender warp moves one piece of a row at a time, or several (dispatch: two, or a whole
//     row, as the pieces per warp allow; combine: a whole row once there are enough rows to occupy every warp
//     twice). After its stores the warp raises each piece's ready word at the destination (bar.warp.sync, then a
//     fence.acq_rel.sys -- cumulative over the lanes' stores -- then a relaxed system-scope store of the epoch), so
//     the receive side works on each piece as soon as it lands, while the rest is still on the wire. Single pieces
//     are fenced two at a time (FencedReady).
//   - Dispatch senders: block 0 posts this rank's op flag to every destination first; it orders nothing and only
//     carries the call's signature. A block per contiguous range of tokens numbers them (slots are exclusive prefix
//     counts in token order, from ballots over the ids before and in its range; past kScanTokens tokens a block
//     counts only its range and adds up the earlier blocks' counts); the block with the last token then posts the
//     counts as count words, (epoch << 32) | count, one relaxed 64-bit store each: whole without a fence. Rows for
//     this rank go straight to the outputs, rows for a peer into its receive region. Receivers wait for every
//     source's op flag and count word, then each warp polls the ready words of 32 of its (source, slot, piece) items
//     at a time and copies whichever pieces have landed to the outputs, two at a time (with a first piece's scales,
//     ids and weights); slots past a source's count are padded.
//   - Small dispatch calls (p.attrs.ll_tokens, layout.LL_MAX_TOKENS) send peers their rows in LL form instead: every
//     4-byte word with the epoch in one 8-byte unit, so neither a fence nor a ready word stands between a store
//     and its use; twice the bytes on the wire, which pays only for small calls (docs/PERFORMANCE.md). Each
//     receive warp polls the units of its (source, slot, piece) items until they carry its epoch.
//   - Combine senders return the expert rows to their sources, items in slot order across every sender warp;
//     block 0 posts the op flag first. Reducers take two tokens per block at a time; each warp waits for the ready
//     words of the pieces it reads (a lane per word) and sums over ranks in ascending order in float32 from -0.0
//     (+0.0 for a token sent nowhere); rows of this rank are read in place.
//   - Receivers wait only on peers' senders, and senders on nothing of a peer. Within a grid, a sender block of a
//     large dispatch waits for the counts of the sender blocks before it, which post them before they wait for
//     anything, and block gridDim.x - 1 waits, at its end, for every block to have read the epoch, which each does as
//     it starts (EndCall).
//   - The epoch of each op lives in device memory; only the kernel advances it (BeginCall, EndCall), so the launches
//     can be captured in a CUDA graph and replayed. Call e uses buffer e & 1: receive regions, count words and ready
//     words. A source reaches call e + 2 only after every destination has finished call e (its call e + 1
//     needed their rows of e + 1), so buffer e & 1 is never overwritten while it is read.
//   - Op flags carry (epoch << 16) | signature. A waiter accepts flag >> 16 >= e (a fast peer may already have
//     posted e + 1) and checks the signature: a peer that called with other shapes is reported, not trusted.
//     Ready words hold (uint32) epoch, count words its low 32 bits; a waiter accepts exactly its own epoch.
//   - A wait that expires records the missing source in the device's abort word (polled by every waiter, so the
//     others stop too) and in a host-mapped error word (read by the handler) and stops waiting; the outputs of
//     that call are then undefined and the handler fails every later call on the workspace. Waiters never read
//     host memory: a PCIe read per spin, from hundreds of waiting blocks, would delay every wait.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "a2a_device.cuh"
#include "a2a_kernels.cuh"

namespace jax_moe_a2a {

namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kDispatch = 0;
constexpr int kCombine = 1;

// ---------------------------------------------------------------------------------------------------------------
// The protocol: workspace regions, failures, waits, epochs (shared by both ops)
// ---------------------------------------------------------------------------------------------------------------

__device__ __forceinline__ uint64_t* Sync(uint8_t* base, int64_t off_sync, int op) {
  return reinterpret_cast<uint64_t*>(base + off_sync) + op * kSyncWords;
}

__device__ __forceinline__ uint64_t* AbortWord(uint8_t* base, int64_t off_sync) {
  return Sync(base, off_sync, kDispatch) + kSyncAbortWord;
}

__device__ __forceinline__ uint64_t* Flags(uint8_t* base, int64_t off_flags, int op, int num_ranks) {
  return reinterpret_cast<uint64_t*>(base + off_flags) + op * num_ranks;
}

// Ready words of a buffer's receive slots: [source rank, capacity, pieces] uint32.
__device__ __forceinline__ uint32_t* Ready(uint8_t* region, int64_t off_ready) {
  return reinterpret_cast<uint32_t*>(region + off_ready);
}

// Records the first failure of this device: in the device-local abort word, which every waiter polls, and then in
// the host-mapped error word, which the handler reads.
__device__ void Fail(uint64_t* abort, int* error, int code) {
  if (atomicCAS(reinterpret_cast<unsigned long long*>(abort), 0ull, static_cast<unsigned long long>(code)) == 0) {
    atomicCAS(error, 0, code);
  }
}


// Where a waiter gives up: the device's abort word, its host-mapped error word and the bound of one wait.
struct Waiter {
  uint64_t* abort;
  int* error;
  int64_t timeout_ns;

  __device__ bool Aborted() const { return *reinterpret_cast<volatile uint64_t*>(abort) != 0; }

  // Called after a poll that found nothing, with t0 = 0 before the first: whether to stop waiting for `src`. It does
  // once a failure is recorded on this device, or when timeout_ns have passed since the first call (it then records
  // a timeout of `src`).
  __device__ bool GiveUp(int64_t& t0, int src) const {
    if (t0 == 0) t0 = GlobalTimerNs();
    if (Aborted()) return true;
    if (GlobalTimerNs() - t0 <= timeout_ns) return false;
    Fail(abort, error, kErrorTimeoutBase + src);
    return true;
  }
};

// A dispatch count word: the epoch of the call that wrote it (low 32 bits) above the count. One 64-bit store makes
// it whole, so it needs no fence before it and no flag after it.
__device__ __forceinline__ uint64_t CountWord(uint64_t e, int32_t count) {
  return (e << 32) | static_cast<uint32_t>(count);
}

// Threads [0, num_ranks) of the block wait for every source's op flag of call `e`, checking its signature, and
// then, with `count_words`, for the source's count word of call e, whose count they leave in counts[source]
// (shared). The loops read device memory only (flags, count words, abort word, %globaltimer). Block-uniform
// result: false when this block's wait failed (the failure is recorded).
__device__ bool WaitForSources(uint64_t* flags, int num_ranks, uint64_t e, uint32_t signature, const Waiter& w,
                               const uint64_t* count_words = nullptr, int32_t* counts = nullptr) {
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  const int src = threadIdx.x;
  if (src < num_ranks) {
    int64_t t0 = 0;
    bool ok = true;
    uint64_t f;
    while (ok && ((f = LoadAcquireSys(&flags[src])) >> 16) < e) ok = !w.GiveUp(t0, src);
    if (ok && (f >> 16) == e && static_cast<uint32_t>(f & 0xFFFF) != signature) {
      Fail(w.abort, w.error, kErrorMismatchBase + src);
      ok = false;
    }
    if (ok && count_words != nullptr) {
      uint64_t c;
      while (ok && ((c = LoadAcquireSys(&count_words[src])) >> 32) != (e & 0xFFFFFFFFu)) ok = !w.GiveUp(t0, src);
      counts[src] = static_cast<int32_t>(c & 0xFFFFFFFFu);
    }
    if (!ok) failed = 1;
  }
  __syncthreads();
  return failed == 0;
}

// Spins until *word == e (acquire). False when the wait gave up (Waiter::GiveUp).
__device__ bool WaitReady(const uint32_t* word, uint32_t e, int src, const Waiter& w) {
  int64_t t0 = 0;
  while (LoadAcquireSys(word) != e) {
    if (w.GiveUp(t0, src)) return false;
  }
  return true;
}

// A call's epoch: thread 0 of each block reads the op's completed epoch (sync[0]) and, after the barrier, counts the
// block's arrival on sync[1] without waiting for the count. Returns e, the epoch of this call.
__device__ uint64_t BeginCall(uint64_t* sync) {
  __shared__ uint64_t epoch;
  if (threadIdx.x == 0) epoch = *reinterpret_cast<volatile uint64_t*>(&sync[0]) + 1;
  __syncthreads();
  if (threadIdx.x == 0) atomicAdd(reinterpret_cast<unsigned long long*>(&sync[1]), 1ull);
  return epoch;
}

// Block gridDim.x - 1 advances the epoch to e once every block has arrived (and so has read it); the other blocks end
// without waiting. Each block arrives as it starts, waiting on nothing of this one, so the wait ends, and no block
// pays an atomic round trip at its end to find out whether it was the last.
__device__ void EndCall(uint64_t* sync, uint64_t e) {
  if (blockIdx.x == gridDim.x - 1 && threadIdx.x == 0) {
    while (*reinterpret_cast<volatile uint64_t*>(&sync[1]) < gridDim.x) {
    }
    *reinterpret_cast<volatile uint64_t*>(&sync[1]) = 0;
    *reinterpret_cast<volatile uint64_t*>(&sync[0]) = e;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Dispatch
// ---------------------------------------------------------------------------------------------------------------

// The ids of a dispatch call and what maps them to ranks: passed by value to out-of-line code (see DispatchKernel).
struct Routing {
  const int32_t* ids;
  int top_k, num_experts, num_ranks, local;
};

__device__ __forceinline__ Routing RoutingOf(const DispatchParams& p) {
  return {p.ids, static_cast<int>(p.top_k), static_cast<int>(p.attrs.num_experts), p.num_ranks,
          static_cast<int>(p.attrs.num_experts / p.num_ranks)};
}

// Bit r of the result: token t < num_tokens has a valid expert on rank r. The row's ids are loaded before any is
// used (16 bytes at a time where the rows allow), one memory round trip per token. 32-bit arithmetic: a 64-bit
// division per id would dominate the slot counting.
__device__ __forceinline__ uint64_t DestMask(const Routing& routing, int64_t t) {
  const int top_k = routing.top_k, num_experts = routing.num_experts, local = routing.local;
  uint64_t mask = 0;
  auto add = [&](int id) {
    if (id >= 0 && id < num_experts) mask |= uint64_t{1} << (id / local);
  };
  if (top_k % 4 == 0 && (reinterpret_cast<uintptr_t>(routing.ids) & 15) == 0) {
    const int4* ids = reinterpret_cast<const int4*>(routing.ids + t * top_k);
    constexpr int kBatch = 2;  // vectors in flight: top-8 in one round trip
    for (int k = 0; k < top_k / 4; k += kBatch) {
      int4 v[kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        if (k + i < top_k / 4) v[i] = ids[k + i];
      }
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        if (k + i < top_k / 4) add(v[i].x), add(v[i].y), add(v[i].z), add(v[i].w);
      }
    }
    return mask;
  }
  const int32_t* ids = routing.ids + t * top_k;
#pragma unroll 8
  for (int k = 0; k < top_k; ++k) add(ids[k]);
  return mask;
}

// A sender block keeps the destination masks of up to kOwnMasks of its tokens, and the slots of up to kOwnSlots
// (token, rank) pairs, in shared memory; past that it reads them from global memory.
constexpr int kOwnMasks = 1024;
constexpr int kOwnSlots = 2048;

// Adds to counts[r] (shared) how many tokens of [count_begin, count_end) have a valid expert on rank r, and leaves the
// masks of the tokens [begin, end) in own[t - begin] (shared) where t - begin < kOwnMasks: one pass over the ids from
// min(count_begin, begin) to end (count_end <= end). Warp w takes the groups of 32 tokens w, w + kWarps, ...,
// kCountUnroll groups per step with their ids loaded together (up to kCountStep tokens take one step), and counts
// them per rank with ballots. Not inlined, so that its registers do not add to the send loop's; it takes the routing
// by value, not a reference to the kernel parameter.
constexpr int kCountUnroll = 2;
constexpr int64_t kCountStep = kThreads * kCountUnroll;

__device__ __noinline__ void CountDestinations(const Routing routing, int64_t count_begin, int64_t count_end,
                                               int64_t begin, int64_t end, int32_t* counts, uint64_t* own) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int32_t lo = 0, hi = 0;  // this lane's counts for ranks lane and lane + 32
  for (int64_t c = min(count_begin, begin) + warp * 32; c < end; c += kCountStep) {
    uint64_t mask[kCountUnroll];
#pragma unroll
    for (int u = 0; u < kCountUnroll; ++u) {
      const int64_t t = c + u * kThreads + lane;
      mask[u] = t < end ? DestMask(routing, t) : 0;
    }
#pragma unroll
    for (int u = 0; u < kCountUnroll; ++u) {
      const int64_t t = c + u * kThreads + lane;
      if (t >= begin && t < end && t - begin < kOwnMasks) own[t - begin] = mask[u];
      if (t < count_begin || t >= count_end) mask[u] = 0;
    }
    for (int r = 0; r < routing.num_ranks; ++r) {
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

// Dispatches of more than kScanTokens tokens number their slots with a scan over the sender blocks: each block counts
// its own tokens, posts the counts to the scan region of this device ([block, rank] uint64 words, CountWord(e, n))
// and adds up those of the blocks before it, rather than counting every token before its range (a step of
// CountDestinations per kCountStep tokens). A block waits only for blocks of lower index, which post before they wait
// for anything: the wait ends once they run. Below kScanTokens the prefix takes one step and the scan costs more than
// it saves.
constexpr int64_t kScanTokens = kThreads;

// Posts this block's counts per rank (own_counts, shared) to the scan words of call e and adds those of every earlier
// block to counts (shared).
__device__ void AddEarlierBlocks(uint64_t* scan, int ranks, uint64_t e, const int32_t* own_counts, int32_t* counts) {
  if (static_cast<int>(threadIdx.x) < ranks) {
    StoreRelaxedGpu(&scan[blockIdx.x * ranks + threadIdx.x], CountWord(e, own_counts[threadIdx.x]));
  }
  for (int i = threadIdx.x; i < static_cast<int>(blockIdx.x) * ranks; i += kThreads) {
    uint64_t c;
    while (((c = LoadRelaxedGpu(&scan[i])) >> 32) != (e & 0xFFFFFFFFu)) {
    }
    const int32_t n = static_cast<int32_t>(c & 0xFFFFFFFFu);
    if (n != 0) atomicAdd(&counts[i % ranks], n);
  }
}

// Expert `id` as rank r (of `local` experts each) numbers it, or -1: not one of its experts, or invalid. 32-bit
// arithmetic, like DestMask.
__device__ __forceinline__ int32_t LocalExpert(int32_t id, int r, int local, int num_experts) {
  return id >= 0 && id < num_experts && id / local == r ? id - r * local : -1;
}

// A row's scales, ids and weights in the lanes of a warp: lane i holds the i-th 16 bytes of the scale row and the
// i-th id and weight. Used where the row fits (Fits; the receive regions' scale rows are then 16-byte aligned too,
// as every region starts on a 128-byte boundary), so that their loads go out with the row's first piece instead of
// one round trip after another.
struct RowMeta {
  uint4 sf;
  int32_t id;
  float weight;

  // Whether the rows fit the lanes, for a copy between the scale arrays `a` and `b` (both 16-byte aligned).
  __device__ static bool Fits(const DispatchParams& p, const void* a, const void* b) {
    return p.sf_row % 16 == 0 && p.sf_row <= 32 * 16 && p.top_k <= 32 &&
           ((reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b)) & 15) == 0;
  }

  __device__ void Load(const DispatchParams& p, const uint8_t* sf_row, const int32_t* ids, const float* weights,
                       int lane) {
    if (lane * 16 < p.sf_row) sf = *reinterpret_cast<const uint4*>(sf_row + lane * 16);
    if (lane < p.top_k) {
      id = ids[lane];
      weight = weights[lane];
    }
  }

  __device__ void Store(const DispatchParams& p, uint8_t* sf_row, int32_t* ids, float* weights, int lane) const {
    if (lane * 16 < p.sf_row) *reinterpret_cast<uint4*>(sf_row + lane * 16) = sf;
    if (lane < p.top_k) {
      ids[lane] = id;
      weights[lane] = weight;
    }
  }

  // The row as rank r (of `local` experts each) receives it: ids of other ranks' experts -1, their weights 0.
  __device__ RowMeta ForRank(const DispatchParams& p, int r, int local) const {
    RowMeta m = *this;
    m.id = LocalExpert(id, r, local, static_cast<int>(p.attrs.num_experts));
    m.weight = m.id < 0 ? 0.0f : weight;
    return m;
  }
};

// LL form (small calls): word w of a row -- its x, then its scales, ids and weights, 4 bytes each -- travels as unit
// w of its LL row, (epoch << 32) | word, written by one 64-bit store (a vector store's elements are single-copy
// atomic each), so a receiver that reads a unit of its own epoch has the word: no fence, no ready word. Every rank
// decides alike from the call's shapes and the workspace: the senders' choice is the receivers' format. The handler
// admits ll_tokens > 0 only for rows that take the form (x whole 16-byte vectors, scales whole 4-byte words).
__device__ __forceinline__ bool UsesLL(const DispatchParams& p) { return p.num_tokens <= p.attrs.ll_tokens; }

__device__ __forceinline__ uint64_t* LLRow(const DispatchParams& p, uint8_t* region, int64_t source, int64_t slot) {
  return reinterpret_cast<uint64_t*>(region + p.attrs.off_ll + (source * p.attrs.ll_tokens + slot) * p.attrs.ll_row_bytes);
}

__device__ __forceinline__ void StoreUnits(uint64_t* at, uint4 v, uint32_t e) {
  const uint64_t hi = static_cast<uint64_t>(e) << 32;
  asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(at), "l"(hi | v.x), "l"(hi | v.y) : "memory");
  asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(at + 2), "l"(hi | v.z), "l"(hi | v.w) : "memory");
}

__device__ __forceinline__ void StoreUnit(uint64_t* at, uint32_t word, uint32_t e) {
  asm volatile("st.volatile.global.u64 [%0], %1;" ::"l"(at), "l"((static_cast<uint64_t>(e) << 32) | word) : "memory");
}

// Loads the 4 units at `at`; true (and their words in v) when all 4 are of epoch e.
__device__ __forceinline__ bool LoadUnits(const uint64_t* at, uint32_t e, uint4& v) {
  uint64_t a, b, c, d;
  asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(at) : "memory");
  asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(c), "=l"(d) : "l"(at + 2) : "memory");
  v = make_uint4(static_cast<uint32_t>(a), static_cast<uint32_t>(b), static_cast<uint32_t>(c),
                 static_cast<uint32_t>(d));
  return (a >> 32) == e && (b >> 32) == e && (c >> 32) == e && (d >> 32) == e;
}

// Word k of a row's scales, ids and weights (after its x) as rank r receives it.
__device__ __forceinline__ uint32_t MetaWord(const DispatchParams& p, int64_t t, int64_t k, int r, int local) {
  const int64_t sf_words = p.sf_row / 4;
  if (k < sf_words) return reinterpret_cast<const uint32_t*>(p.x_sf + t * p.sf_row)[k];
  k -= sf_words;
  const int32_t id = LocalExpert(p.ids[t * p.top_k + k % p.top_k], r, local, static_cast<int>(p.attrs.num_experts));
  if (k < p.top_k) return static_cast<uint32_t>(id);
  return id < 0 ? 0u : __float_as_uint(p.weights[t * p.top_k + k - p.top_k]);
}

// A sender warp's items whose ready words are still to be raised. Items of one piece are fenced in pairs: a fence
// waits until the warp's stores have reached the peers, so the second piece's stores go out before that wait rather
// than after it. Whole rows are fenced one by one, so that receivers start copying them while the next rows are on
// the wire.
class FencedReady {
 public:
  // Records item (row, first piece) of the warp (warp-uniform).
  __device__ void Add(int64_t row, int64_t first) {
    (count_ == 0 ? row_[0] : row_[1]) = static_cast<int32_t>(row);
    (count_ == 0 ? first_[0] : first_[1]) = static_cast<int32_t>(first);
    ++count_;
  }

  // Whether to fence now: the pair is full, the item is a whole row (group > 1) or it was the warp's last.
  __device__ bool Due(int64_t group, bool last) const { return count_ == 2 || (count_ > 0 && (group > 1 || last)); }

  // Fences the warp's stores, then lane i calls raise(row, piece) for the i-th (item, piece) pair of the recorded
  // items (of `group` pieces each).
  template <typename Fn>
  __device__ void Raise(int64_t group, int lane, Fn raise) {
    __syncwarp();
    const int64_t pairs = count_ * group;
    if (lane < pairs) {
      FenceSys();
      for (int64_t i = lane; i < pairs; i += 32) {
        const int b = static_cast<int>(i / group);
        raise(b == 0 ? row_[0] : row_[1], (b == 0 ? first_[0] : first_[1]) + i % group);
      }
    }
    count_ = 0;
  }

 private:
  int count_ = 0;
  int32_t row_[2], first_[2];  // a token or slot index, and a piece: both fit
};

// Pieces a sender warp loads before storing them.
constexpr int kSendInFlight = 2;

// Sender block b owns the tokens [b * per_block, (b + 1) * per_block). It first finds their slots: one pass over the
// ids up to its last token counts per rank the tokens before its range and keeps the destination masks of its own
// (every sender reads those ids: a few tens of KiB from L2), then warp 0 numbers its own tokens in order. The block
// with the last token knows the totals and posts them to every destination. Then each warp takes (token, piece)
// items of the range, stores the piece into every destination (a row for this rank into the outputs) and raises its
// ready words on the peers. Inlined into the kernel, so that its reads of p are constant-bank operands (see
// DispatchKernel).
__device__ __forceinline__ void DispatchSend(const DispatchParams& p, uint64_t e, int64_t buf) {
  __shared__ int32_t base[kMaxRanks], own_counts[kMaxRanks];
  __shared__ uint64_t own_masks[kOwnMasks];
  __shared__ int32_t own_slots[kOwnSlots];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const Routing routing = RoutingOf(p);
  const int64_t per_block = (p.num_tokens + p.senders - 1) / p.senders;
  const int64_t begin = min(p.num_tokens, blockIdx.x * per_block), end = min(p.num_tokens, begin + per_block);
  // Token t's slot on each rank (-1: none), t in [begin, end).
  const bool slots_shared = (end - begin) * p.num_ranks <= kOwnSlots;
  auto slots_of = [&](int64_t t) -> const int32_t* {
    return slots_shared ? own_slots + (t - begin) * p.num_ranks : p.send_slot + t * p.num_ranks;
  };
  if (blockIdx.x == 0 && threadIdx.x < p.num_ranks) {
    StoreRelaxedSys(&Flags(p.peers.base[threadIdx.x], p.attrs.off_flags, kDispatch, p.num_ranks)[p.me],
                    (e << 16) | p.signature);
  }
  if (threadIdx.x < kMaxRanks) base[threadIdx.x] = own_counts[threadIdx.x] = 0;
  __syncthreads();
  // The tokens before the range, per rank, into base: counted here, or added up from the earlier blocks' counts (the
  // scan). Block 0 has no tokens before its range and needs neither unless it posts its counts: its warp 0 reads its
  // own ids (one round trip less before its first send).
  const bool scan = p.num_tokens > kScanTokens, counted = scan || begin > 0;
  if (scan) {
    CountDestinations(routing, begin, end, begin, end, own_counts, own_masks);
    __syncthreads();
    AddEarlierBlocks(reinterpret_cast<uint64_t*>(p.peers.base[p.me] + p.attrs.off_scan), p.num_ranks, e, own_counts, base);
  } else if (counted) {
    CountDestinations(routing, 0, begin, begin, end, base, own_masks);
  }
  __syncthreads();
  if (warp == 0) {
    for (int64_t c = begin; c < end; c += 32) {
      const int64_t t = c + lane;
      const uint64_t mask =
          t >= end ? 0 : counted && t - begin < kOwnMasks ? own_masks[t - begin] : DestMask(routing, t);
      for (int r = 0; r < p.num_ranks; ++r) {
        const bool dest = (mask >> r) & 1;
        const unsigned ballot = __ballot_sync(0xFFFFFFFFu, dest);
        const int32_t first = base[r];
        if (t < end) {
          const int32_t slot = dest ? first + __popc(ballot & ((1u << lane) - 1u)) : -1;
          p.send_slot[t * p.num_ranks + r] = slot;
          if (slots_shared) own_slots[(t - begin) * p.num_ranks + r] = slot;
        }
        __syncwarp();
        if (lane == 0) base[r] = first + __popc(ballot);
        __syncwarp();
      }
    }
  }
  __syncthreads();  // the slots of the range are visible to the whole block from here on
  if (begin < end && end == p.num_tokens && threadIdx.x < p.num_ranks) {
    StoreRelaxedSys(reinterpret_cast<uint64_t*>(p.peers.base[threadIdx.x] + buf + p.attrs.off_counts) + p.me,
                    CountWord(e, base[threadIdx.x]));
  }
  // An item is `group` pieces of a token: its whole row once the range has a row for every warp, else two pieces where
  // the rows split so and the range has two pieces for every warp, else one. Fewer, larger items need fewer fences
  // (one per item and warp) and have more pieces in flight per load.
  const int64_t pieces = Pieces(p.x_row);
  const int whole = static_cast<int>(pieces), per_warp = static_cast<int>((end - begin) * pieces / kWarps);
  const int64_t group = per_warp >= whole ? whole : whole % 2 == 0 && per_warp >= 2 ? 2 : 1, per_token = pieces / group;
  const bool vectors = p.x_row % 16 == 0, meta_in_lanes = RowMeta::Fits(p, p.x_sf, p.recv_sf), ll = UsesLL(p);
  const int64_t items = (end - begin) * per_token;
  FencedReady pending;
  for (int64_t item = warp; item < items; item += kWarps) {
    const int64_t t = begin + item / per_token, first = (item % per_token) * group;
    const int32_t* slots = slots_of(t);
    bool to_peer = false;
    RowMeta meta;
    if (first == 0 && meta_in_lanes) {
      meta.Load(p, p.x_sf + t * p.sf_row, p.ids + t * p.top_k, p.weights + t * p.top_k, lane);
    }
    // Where token t's row goes on rank r: the outputs for this rank, the receive region for a peer.
    auto row_of = [&](int r) { return r == p.me ? p.me * p.num_tokens + slots[r] : p.me * p.attrs.capacity + slots[r]; };
    auto x_of = [&](int r) { return r == p.me ? p.recv_x : p.peers.base[r] + buf + p.attrs.off_x; };
    for (int64_t q = first; q < first + group; q += kSendInFlight) {
      if (vectors) {
        // Up to kSendInFlight pieces are loaded once, then stored to every destination.
        constexpr int kVec = kPieceBytes / (32 * 16);
        uint4 v[kSendInFlight][kVec];
#pragma unroll
        for (int i = 0; i < kSendInFlight; ++i) {
#pragma unroll
          for (int u = 0; u < kVec; ++u) {
            const int64_t o = (q + i) * kPieceBytes + (u * 32 + lane) * 16;
            if (q + i < first + group && o < p.x_row) v[i][u] = *reinterpret_cast<const uint4*>(p.x + t * p.x_row + o);
          }
        }
        for (int r = 0; r < p.num_ranks; ++r) {
          if (slots[r] < 0) continue;
          if (ll && r != p.me) {  // a peer's row in LL form
            uint64_t* units = LLRow(p, p.peers.base[r] + buf, p.me, slots[r]);
#pragma unroll
            for (int i = 0; i < kSendInFlight; ++i) {
#pragma unroll
              for (int u = 0; u < kVec; ++u) {
                const int64_t o = (q + i) * kPieceBytes + (u * 32 + lane) * 16;
                if (q + i < first + group && o < p.x_row) StoreUnits(units + o / 4, v[i][u], static_cast<uint32_t>(e));
              }
            }
            continue;
          }
          to_peer |= r != p.me;
          uint8_t* dst = x_of(r) + row_of(r) * p.x_row;
#pragma unroll
          for (int i = 0; i < kSendInFlight; ++i) {
#pragma unroll
            for (int u = 0; u < kVec; ++u) {
              const int64_t o = (q + i) * kPieceBytes + (u * 32 + lane) * 16;
              if (q + i < first + group && o < p.x_row) *reinterpret_cast<uint4*>(dst + o) = v[i][u];
            }
          }
        }
      } else {
        for (int64_t piece = q; piece < min(q + kSendInFlight, first + group); ++piece) {
          const int64_t at = piece * kPieceBytes;
          for (int r = 0; r < p.num_ranks; ++r) {
            if (slots[r] < 0) continue;
            to_peer |= r != p.me;
            WarpCopy(x_of(r) + row_of(r) * p.x_row + at, p.x + t * p.x_row + at, min(kPieceBytes, p.x_row - at), lane);
          }
        }
      }
    }
    if (first == 0) {  // the token's scales, ids and weights travel with its first piece
      for (int r = 0; r < p.num_ranks; ++r) {
        if (slots[r] < 0) continue;
        const bool self = r == p.me;
        if (ll && !self) {
          uint64_t* units = LLRow(p, p.peers.base[r] + buf, p.me, slots[r]) + p.x_row / 4;
          for (int64_t k = lane; k < p.sf_row / 4 + 2 * p.top_k; k += 32) {
            StoreUnit(units + k, MetaWord(p, t, k, r, routing.local), static_cast<uint32_t>(e));
          }
          continue;
        }
        uint8_t* dst = p.peers.base[r] + buf;
        const int64_t row = row_of(r);
        uint8_t* dst_sf = self ? p.recv_sf : dst + p.attrs.off_x_sf;
        auto* dst_ids = self ? p.recv_ids : reinterpret_cast<int32_t*>(dst + p.attrs.off_ids);
        auto* dst_w = self ? p.recv_weights : reinterpret_cast<float*>(dst + p.attrs.off_weights);
        if (meta_in_lanes) {
          meta.ForRank(p, r, routing.local)
              .Store(p, dst_sf + row * p.sf_row, dst_ids + row * p.top_k, dst_w + row * p.top_k, lane);
          continue;
        }
        WarpCopy(dst_sf + row * p.sf_row, p.x_sf + t * p.sf_row, p.sf_row, lane);
        for (int64_t k = lane; k < p.top_k; k += 32) {
          const int32_t id = LocalExpert(p.ids[t * p.top_k + k], r, routing.local, static_cast<int>(p.attrs.num_experts));
          dst_ids[row * p.top_k + k] = id;
          dst_w[row * p.top_k + k] = id < 0 ? 0.0f : p.weights[t * p.top_k + k];
        }
      }
    }
    if (to_peer) pending.Add(t, first);
    if (pending.Due(group, item + kWarps >= items)) {
      pending.Raise(group, lane, [&](int64_t token, int64_t piece) {
        const int32_t* to = slots_of(token);
        for (int r = 0; r < p.num_ranks; ++r) {
          if (to[r] < 0 || r == p.me) continue;
          uint32_t* ready = Ready(p.peers.base[r] + buf, p.attrs.off_ready);
          StoreRelaxedSys(&ready[(p.me * p.attrs.capacity + to[r]) * pieces + piece], static_cast<uint32_t>(e));
        }
      });
    }
  }
}

// Copies two pieces (16-byte aligned, at most kPieceBytes each; 0 bytes: none) with the warp, both pieces' loads
// issued before the first store.
__device__ __forceinline__ void WarpCopyTwoPieces(uint8_t* dst0, const uint8_t* src0, int64_t bytes0, uint8_t* dst1,
                                                  const uint8_t* src1, int64_t bytes1, int lane) {
  constexpr int kVec = kPieceBytes / (32 * 16);
  uint4 v0[kVec], v1[kVec];
#pragma unroll
  for (int u = 0; u < kVec; ++u) {
    const int64_t o = (u * 32 + lane) * 16;
    if (o < bytes0) v0[u] = *reinterpret_cast<const uint4*>(src0 + o);
    if (o < bytes1) v1[u] = *reinterpret_cast<const uint4*>(src1 + o);
  }
#pragma unroll
  for (int u = 0; u < kVec; ++u) {
    const int64_t o = (u * 32 + lane) * 16;
    if (o < bytes0) *reinterpret_cast<uint4*>(dst0 + o) = v0[u];
    if (o < bytes1) *reinterpret_cast<uint4*>(dst1 + o) = v1[u];
  }
}

// Takes piece `piece` of an LL row (and with the first piece the row's scales, ids and weights) into output row o as
// its units arrive: each lane polls up to kVec 16-byte vectors of the piece at once. Warp-uniform; false when the
// wait gave up (the failure is recorded; `src` is the source waited for).
__device__ bool ReceiveLL(const DispatchParams& p, const uint64_t* units, int64_t o, int64_t piece, uint32_t e, int src,
                          const Waiter& w, int lane) {
  constexpr int kVec = kPieceBytes / (32 * 16);
  const int64_t at = piece * kPieceBytes;
  int64_t t0 = 0;
  auto keep_waiting = [&] { return !w.GiveUp(t0, src); };
  bool ok = true;
  unsigned missing = 0;
#pragma unroll
  for (int u = 0; u < kVec; ++u) {
    if (at + (u * 32 + lane) * 16 < min(at + kPieceBytes, p.x_row)) missing |= 1u << u;
  }
  while (ok && missing != 0) {
#pragma unroll
    for (int u = 0; u < kVec; ++u) {
      if (!(missing & (1u << u))) continue;
      const int64_t off = at + (u * 32 + lane) * 16;
      uint4 v;
      if (LoadUnits(units + off / 4, e, v)) {
        *reinterpret_cast<uint4*>(p.recv_x + o * p.x_row + off) = v;
        missing &= ~(1u << u);
      }
    }
    if (missing != 0) ok = keep_waiting();
  }
  if (piece == 0) {
    const int64_t sf_words = p.sf_row / 4;
    for (int64_t k = lane; ok && k < sf_words + 2 * p.top_k; k += 32) {
      uint64_t unit;
      for (;;) {
        asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(unit) : "l"(units + p.x_row / 4 + k) : "memory");
        if ((unit >> 32) == e) break;
        if (!(ok = keep_waiting())) break;
      }
      if (!ok) break;
      const uint32_t word = static_cast<uint32_t>(unit);
      if (k < sf_words) {
        reinterpret_cast<uint32_t*>(p.recv_sf + o * p.sf_row)[k] = word;
      } else if (k < sf_words + p.top_k) {
        p.recv_ids[o * p.top_k + k - sf_words] = static_cast<int32_t>(word);
      } else {
        p.recv_weights[o * p.top_k + k - sf_words - p.top_k] = __uint_as_float(word);
      }
    }
  }
  return __all_sync(0xFFFFFFFFu, ok);
}

// Receivers: after every source's op flag (and so its counts), receive warp g of G takes the items g, g + G,
// g + 2G, ... of the (source, slot, piece) sequence, 32 at a time: lane i polls the ready word of the i-th, and the
// warp copies every piece that has landed (two at once), pads slots past a count, skips this rank's own
// rows (the senders wrote them) and polls the rest again, so a late piece holds up no other.
__device__ __noinline__ void DispatchReceive(const DispatchParams& p, uint64_t e, int64_t buf, uint8_t* mine) {
  const Waiter w{AbortWord(mine, p.attrs.off_sync), p.error, p.timeout_ns};
  __shared__ int32_t counts[kMaxRanks];
  const uint8_t* region = mine + buf;
  if (!WaitForSources(Flags(mine, p.attrs.off_flags, kDispatch, p.num_ranks), p.num_ranks, e, p.signature, w,
                      reinterpret_cast<const uint64_t*>(region + p.attrs.off_counts), counts)) {
    return;
  }
  const int rb = blockIdx.x - p.senders, lane = threadIdx.x % 32;
  if (rb == 0 && threadIdx.x < p.num_ranks) p.recv_counts[threadIdx.x] = counts[threadIdx.x];
  const uint32_t* ready = Ready(mine + buf, p.attrs.off_ready);
  const int64_t pieces = Pieces(p.x_row), items = p.num_ranks * p.num_tokens * pieces;
  const int64_t warps = static_cast<int64_t>(gridDim.x - p.senders) * kWarps, g = rb * kWarps + threadIdx.x / 32;
  const bool vectors = p.x_row % 16 == 0, meta_in_lanes = RowMeta::Fits(p, p.recv_sf, region + p.attrs.off_x_sf);
  // Item -> (source s, slot j, piece); o = s * T + j is its output row, n the source's count.
  auto where = [&](int64_t item, int64_t& o, int64_t& s, int64_t& j, int64_t& piece, bool& filled) {
    o = item / pieces;
    piece = item - o * pieces;
    s = o / p.num_tokens;
    j = o - s * p.num_tokens;
    filled = j < min(static_cast<int64_t>(counts[s]), p.num_tokens);
  };
  // Padding: piece `piece` of output row o, and with its first piece the row's scales, ids (-1) and weights.
  auto pad = [&](int64_t o, int64_t piece) {
    const int64_t at = piece * kPieceBytes;
    WarpZero(p.recv_x + o * p.x_row + at, min(kPieceBytes, p.x_row - at), lane);
    if (piece != 0) return;
    WarpZero(p.recv_sf + o * p.sf_row, p.sf_row, lane);
    for (int64_t k = lane; k < p.top_k; k += 32) {
      p.recv_ids[o * p.top_k + k] = -1;
      p.recv_weights[o * p.top_k + k] = 0.0f;
    }
  };
  if (UsesLL(p)) {
    // Warp g takes the items g, g + G, ...: a peer's piece is taken from its LL row as its units arrive.
    for (int64_t item = g; item < items; item += warps) {
      int64_t o, s, j, piece;
      bool filled;
      where(item, o, s, j, piece, filled);
      if (!filled) {
        pad(o, piece);
      } else if (s != p.me && !ReceiveLL(p, LLRow(p, mine + buf, s, j), o, piece, static_cast<uint32_t>(e),
                                         static_cast<int>(s), w, lane)) {
        return;
      }
    }
    return;
  }
  for (int64_t round = 0; g + round * 32 * warps < items; ++round) {
    const int64_t item = g + (round * 32 + lane) * warps;
    int src = 0;
    const uint32_t* word = nullptr;  // null: ready now (padding)
    bool pending = false;
    if (item < items) {
      int64_t o, s, j, piece;
      bool filled;
      where(item, o, s, j, piece, filled);
      src = static_cast<int>(s);
      pending = !filled || s != p.me;
      if (filled) word = &ready[(s * p.attrs.capacity + j) * pieces + piece];
    }
    int64_t t0 = 0;
    for (;;) {
      if (!__any_sync(0xFFFFFFFFu, pending)) break;
      const bool go = pending && (word == nullptr || LoadAcquireSys(word) == static_cast<uint32_t>(e));
      unsigned todo = __ballot_sync(0xFFFFFFFFu, go);
      if (todo == 0) {
        if (__any_sync(0xFFFFFFFFu, pending && w.GiveUp(t0, src))) return;
        continue;
      }
      __syncwarp();  // the polling lanes' acquires happen before every lane's loads below
      while (todo != 0) {
        // Up to two landed pieces are copied together, with the scales, ids and weights of their rows where they
        // are first pieces (their loads go out with the pieces'); padding and unaligned rows are handled on the way.
        uint8_t* dst[2] = {nullptr, nullptr};
        const uint8_t* from[2] = {nullptr, nullptr};
        int64_t bytes[2] = {0, 0};
        int32_t meta_slot[2] = {-1, -1}, meta_out[2] = {0, 0};  // slot in the region -> output row
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          while (todo != 0) {
            const int b = __ffs(todo) - 1;
            todo &= todo - 1;
            int64_t o, s, j, piece;
            bool filled;
            where(g + (round * 32 + b) * warps, o, s, j, piece, filled);
            const int64_t at = piece * kPieceBytes, nbytes = min(kPieceBytes, p.x_row - at);
            if (!filled) {
              pad(o, piece);
              continue;
            }
            const int64_t r = s * p.attrs.capacity + j;
            if (piece == 0 && vectors && meta_in_lanes) {
              meta_slot[n] = static_cast<int32_t>(r);
              meta_out[n] = static_cast<int32_t>(o);
            } else if (piece == 0) {
              WarpCopy(p.recv_sf + o * p.sf_row, region + p.attrs.off_x_sf + r * p.sf_row, p.sf_row, lane);
              WarpCopy(reinterpret_cast<uint8_t*>(p.recv_ids + o * p.top_k), region + p.attrs.off_ids + r * p.top_k * 4,
                       p.top_k * 4, lane);
              WarpCopy(reinterpret_cast<uint8_t*>(p.recv_weights + o * p.top_k),
                       region + p.attrs.off_weights + r * p.top_k * 4, p.top_k * 4, lane);
            }
            if (!vectors) {
              WarpCopy(p.recv_x + o * p.x_row + at, region + p.attrs.off_x + r * p.x_row + at, nbytes, lane);
              continue;
            }
            dst[n] = p.recv_x + o * p.x_row + at;
            from[n] = region + p.attrs.off_x + r * p.x_row + at;
            bytes[n] = nbytes;
            break;
          }
        }
        RowMeta meta[2];
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          if (meta_slot[n] < 0) continue;
          const int64_t r = meta_slot[n];
          meta[n].Load(p, region + p.attrs.off_x_sf + r * p.sf_row,
                       reinterpret_cast<const int32_t*>(region + p.attrs.off_ids) + r * p.top_k,
                       reinterpret_cast<const float*>(region + p.attrs.off_weights) + r * p.top_k, lane);
        }
        WarpCopyTwoPieces(dst[0], from[0], bytes[0], dst[1], from[1], bytes[1], lane);
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          if (meta_slot[n] < 0) continue;
          const int64_t o = meta_out[n];
          meta[n].Store(p, p.recv_sf + o * p.sf_row, p.recv_ids + o * p.top_k, p.recv_weights + o * p.top_k, lane);
        }
      }
      if (go) pending = false;
      t0 = 0;
    }
  }
}

__global__ void __launch_bounds__(kThreads, 1) DispatchKernel(const __grid_constant__ DispatchParams p) {
  uint8_t* mine = p.peers.base[p.me];
  uint64_t* sync = Sync(mine, p.attrs.off_sync, kDispatch);
  const uint64_t e = BeginCall(sync);
  const int64_t buf = static_cast<int64_t>(e & 1) * p.attrs.buffer_stride;
  // Code out of line reaches the kernel parameter through a pointer, and loads each field it reads through memory;
  // inlined code reads it from the constant bank. The send role is inlined; the receive role stays out of line (the
  // two roles inlined together spill several hundred bytes) and reads a copy of p in shared memory instead.
  if (static_cast<int>(blockIdx.x) < p.senders) {
    DispatchSend(p, e, buf);
  } else {
    __shared__ DispatchParams shared_p;
    static_assert(sizeof(DispatchParams) % sizeof(uint64_t) == 0, "DispatchParams is copied in 8-byte words");
    for (int i = threadIdx.x; i < static_cast<int>(sizeof(DispatchParams) / sizeof(uint64_t)); i += kThreads) {
      reinterpret_cast<uint64_t*>(&shared_p)[i] = reinterpret_cast<const uint64_t*>(&p)[i];
    }
    __syncthreads();
    DispatchReceive(shared_p, e, buf, mine);
  }
  EndCall(sync, e);
}

// ---------------------------------------------------------------------------------------------------------------
// Combine
// ---------------------------------------------------------------------------------------------------------------

// 8 consecutive values of type In as loaded: their conversion to float32 waits until they are added, so that the
// loads of several rows can be in flight at once.
template <typename In>
struct Raw8 {
  uint4 w[sizeof(In) / 2];

  __device__ void Load(const uint8_t* p) {
#pragma unroll
    for (int i = 0; i < static_cast<int>(sizeof(In) / 2); ++i) w[i] = reinterpret_cast<const uint4*>(p)[i];
  }

  // acc[u] = acc[u] + value u, rounded to nearest.
  __device__ void AddTo(float* acc) const;
};

template <>
__device__ __forceinline__ void Raw8<__nv_bfloat16>::AddTo(float* acc) const {
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&w[0]);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    acc[2 * i] = __fadd_rn(acc[2 * i], f.x);
    acc[2 * i + 1] = __fadd_rn(acc[2 * i + 1], f.y);
  }
}

template <>
__device__ __forceinline__ void Raw8<float>::AddTo(float* acc) const {
  const auto* f = reinterpret_cast<const float*>(&w[0]);
#pragma unroll
  for (int u = 0; u < 8; ++u) acc[u] = __fadd_rn(acc[u], f[u]);
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

// Senders: items (slot j, source s, piece) in that order, spread over every sender warp, so all sources' rows
// arrive in slot order -- the order of their tokens, which is the order the reducers take them in. With enough
// rows to occupy every warp twice, an item is a whole row (fewer fences).
__device__ void CombineSend(const CombineParams& p, uint64_t e, int64_t buf) {
  if (blockIdx.x == 0 && threadIdx.x < p.num_ranks) {
    StoreReleaseSys(&Flags(p.peers.base[threadIdx.x], p.attrs.off_flags, kCombine, p.num_ranks)[p.me],
                    (e << 16) | p.signature);
  }
  const int lane = threadIdx.x % 32;
  const int64_t row_bytes = p.hidden * p.in_bytes, pieces = Pieces(row_bytes);
  int64_t most = 0, rows = 0;
  for (int s = 0; s < p.num_ranks; ++s) {
    const int64_t n = s == p.me ? 0 : min(static_cast<int64_t>(p.recv_counts[s]), p.num_tokens);
    most = max(most, n);
    rows += max(n, int64_t{0});
  }
  const int64_t warps = static_cast<int64_t>(p.senders) * kWarps;
  const int64_t group = rows >= 2 * warps ? pieces : 1, per_row = pieces / group;
  const int64_t items = most * p.num_ranks * per_row;
  FencedReady pending;
  for (int64_t item = blockIdx.x * kWarps + threadIdx.x / 32; item < items; item += warps) {
    const int64_t first = (item % per_row) * group, sj = item / per_row, s = sj % p.num_ranks, j = sj / p.num_ranks;
    // Rows for this rank are read in place.
    if (s != p.me && j < min(static_cast<int64_t>(p.recv_counts[s]), p.num_tokens)) {
      uint8_t* dst = p.peers.base[s] + buf + p.attrs.off_combine + (p.me * p.attrs.capacity + j) * row_bytes;
      const uint8_t* src = p.expert_out + (s * p.num_tokens + j) * row_bytes;
      for (int64_t q = first; q < first + group; q += 2) {  // rows are whole 16-byte vectors: hidden % 8 == 0
        const int64_t at0 = q * kPieceBytes, at1 = at0 + kPieceBytes;
        WarpCopyTwoPieces(dst + at0, src + at0, min(kPieceBytes, row_bytes - at0), dst + at1, src + at1,
                          q + 1 < first + group ? min(kPieceBytes, row_bytes - at1) : 0, lane);
      }
      pending.Add(sj, first);
    }
    if (pending.Due(group, item + warps >= items)) {
      pending.Raise(group, lane, [&](int64_t slot_rank, int64_t piece) {  // slot_rank: j * num_ranks + s
        const int64_t to = slot_rank % p.num_ranks, slot = slot_rank / p.num_ranks;
        uint32_t* ready = Ready(p.peers.base[to] + buf, p.attrs.off_ready) + (p.me * p.attrs.capacity + slot) * pieces;
        StoreRelaxedSys(&ready[piece], static_cast<uint32_t>(e));
      });
    }
  }
}

// Reducers: each block takes kReduceTokens tokens at a time (stride: the reducer blocks), each token with kSub of its
// threads across its row: a thread sums up to kReduceVecs vectors of 8 consecutive values over the ranks, in ascending
// rank order, in float32. Each warp works on its own: its lanes poll the ready words of the pieces it reads from
// peers, one word each, and it loads the rows of kRanksInFlight ranks at once; a token's send slots are read a token
// ahead: the polls and loads of a warp are in flight together instead of one round trip after another. Two tokens
// per block keep small combines spread over more blocks.
constexpr int kReduceTokens = 2;
constexpr int kReduceVecs = 4;
constexpr int kRanksInFlight = 2;

template <typename In, typename Out>
__device__ void CombineReduce(const CombineParams& p, uint64_t e, int64_t buf, uint8_t* mine) {
  const Waiter w{AbortWord(mine, p.attrs.off_sync), p.error, p.timeout_ns};
  if (!WaitForSources(Flags(mine, p.attrs.off_flags, kCombine, p.num_ranks), p.num_ranks, e, p.signature, w)) return;
  const uint8_t* region = mine + buf + p.attrs.off_combine;
  const uint32_t* ready = Ready(mine + buf, p.attrs.off_ready);
  const int64_t in_row = p.hidden * sizeof(In), pieces = Pieces(in_row);
  const uint32_t epoch = static_cast<uint32_t>(e);
  constexpr int kSub = kThreads / kReduceTokens;  // threads per token
  constexpr int64_t kStep = kSub * 8;             // values between a thread's vectors
  // A warp's vector k spans 32 * 8 values from a multiple of that: inside one piece, whose ready word covers it.
  static_assert(kPieceBytes % (32 * 8 * sizeof(In)) == 0, "a warp's vector lies inside one piece");
  const int sub = threadIdx.x / kSub, tid = threadIdx.x % kSub, lane = threadIdx.x % 32;
  const int ranks = p.num_ranks;
  const int64_t stride = (gridDim.x - p.senders) * kReduceTokens;
  // This lane's send slots of token t: ranks lane and lane + 32 (-1: not sent there); slot_of broadcasts rank r's.
  auto slots_of = [&](int64_t t) {
    const int32_t* s = p.send_slot + t * ranks;
    return t < p.num_tokens ? make_int2(lane < ranks ? s[lane] : -1, lane + 32 < ranks ? s[lane + 32] : -1)
                            : make_int2(-1, -1);
  };
  auto slot_of = [&](int2 slots, int r) { return __shfl_sync(0xFFFFFFFFu, r < 32 ? slots.x : slots.y, r % 32); };
  int64_t t = (blockIdx.x - p.senders) * kReduceTokens + sub;
  for (int2 slots = slots_of(t); t < p.num_tokens; t += stride) {
    const int2 next = slots_of(t + stride);
    // The sum starts at -0.0, the exact additive identity; a token sent nowhere gets +0.0 (the reference's contract).
    const bool sent = __any_sync(0xFFFFFFFFu, slots.x >= 0 || slots.y >= 0);
    for (int64_t h0 = tid * 8; h0 - lane * 8 < p.hidden; h0 += kReduceVecs * kStep) {
      // Lane i polls the word of (rank i / kReduceVecs, vector i % kReduceVecs) for the whole warp.
      bool landed = true;
      for (int i = lane; i - lane < ranks * kReduceVecs; i += 32) {
        const int r = min(i / kReduceVecs, ranks - 1), k = i % kReduceVecs;
        const int32_t slot = slot_of(slots, r);
        const int64_t h = h0 - lane * 8 + k * kStep;  // the warp's first value of vector k
        if (i < ranks * kReduceVecs && r != p.me && slot >= 0 && h < p.hidden && landed) {
          landed = WaitReady(&ready[(r * p.attrs.capacity + slot) * pieces + h * sizeof(In) / kPieceBytes], epoch, r, w);
        }
      }
      // Every lane's loads below come after the polling lanes' acquires; a wait that gave up ends the warp's work.
      if (!__all_sync(0xFFFFFFFFu, landed)) return;
      __syncwarp();
      float acc[kReduceVecs][8];
#pragma unroll
      for (int k = 0; k < kReduceVecs; ++k) {
#pragma unroll
        for (int u = 0; u < 8; ++u) acc[k][u] = sent ? -0.0f : 0.0f;
      }
      for (int r0 = 0; r0 < ranks; r0 += kRanksInFlight) {
        Raw8<In> v[kRanksInFlight][kReduceVecs];
        int32_t slot[kRanksInFlight];
#pragma unroll
        for (int i = 0; i < kRanksInFlight; ++i) {
          const int r = min(r0 + i, ranks - 1);
          slot[i] = slot_of(slots, r);
          if (r0 + i >= ranks) slot[i] = -1;
          if (slot[i] < 0) continue;
          // Rows of this rank are read in place.
          const uint8_t* row = r == p.me ? p.expert_out + (p.me * p.num_tokens + slot[i]) * in_row
                                         : region + (r * p.attrs.capacity + slot[i]) * in_row;
#pragma unroll
          for (int k = 0; k < kReduceVecs; ++k) {
            if (h0 + k * kStep < p.hidden) v[i][k].Load(row + (h0 + k * kStep) * sizeof(In));
          }
        }
#pragma unroll
        for (int i = 0; i < kRanksInFlight; ++i) {
          if (slot[i] < 0) continue;
#pragma unroll
          for (int k = 0; k < kReduceVecs; ++k) {
            if (h0 + k * kStep < p.hidden) v[i][k].AddTo(acc[k]);
          }
        }
      }
#pragma unroll
      for (int k = 0; k < kReduceVecs; ++k) {
        if (h0 + k * kStep < p.hidden) StoreVec8<Out>(p.out + (t * p.hidden + h0 + k * kStep) * sizeof(Out), acc[k]);
      }
    }
    slots = next;
  }
}

template <typename In, typename Out>
__global__ void __launch_bounds__(kThreads, 1) CombineKernel(const __grid_constant__ CombineParams p) {
  uint8_t* mine = p.peers.base[p.me];
  uint64_t* sync = Sync(mine, p.attrs.off_sync, kCombine);
  const uint64_t e = BeginCall(sync);
  const int64_t buf = static_cast<int64_t>(e & 1) * p.attrs.buffer_stride;
  if (static_cast<int>(blockIdx.x) < p.senders) {
    CombineSend(p, e, buf);
  } else {
    CombineReduce<In, Out>(p, e, buf, mine);
  }
  EndCall(sync, e);
}

int Blocks(int64_t work_items, int64_t per_block, int cap) {
  const int64_t b = (work_items + per_block - 1) / per_block;
  return static_cast<int>(b < 1 ? 1 : (b > cap ? cap : b));
}

// At most this share of the multiprocessors receives (dispatch) or reduces (combine), the send role gets the rest:
// combine's reduction reads every rank's rows and so takes more of them (the shares tried: docs/PERFORMANCE.md).
int ReceiveShare(int num_sms) { return std::max(1, num_sms / 2); }
int ReduceShare(int num_sms) { return std::max(1, num_sms * 3 / 5); }

}  // namespace

// At most one block per multiprocessor (one fits: 512 threads of at most 128 registers), so every block is resident
// at once; senders come first in the grid.
cudaError_t LaunchDispatch(cudaStream_t stream, int num_sms, DispatchParams p) {
  const int64_t items = p.num_ranks * p.num_tokens * Pieces(p.x_row);
  const int receivers = Blocks(items, kWarps, ReceiveShare(num_sms));
  const int cap = std::max(1, std::min(num_sms - receivers, kScanBlocks));
  p.senders = Blocks(p.num_tokens, (p.num_tokens + cap - 1) / cap, cap);
  DispatchKernel<<<p.senders + receivers, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t LaunchCombine(cudaStream_t stream, int num_sms, CombineParams p) {
  if (p.hidden % 8 != 0) return cudaErrorInvalidValue;  // the handler rejects this before launching
  const int reducers = Blocks(p.num_tokens, kReduceTokens, ReduceShare(num_sms));
  const int64_t pieces = Pieces(p.hidden * p.in_bytes);
  p.senders = Blocks((p.num_ranks - 1) * p.num_tokens * pieces, kWarps, std::max(1, num_sms - reducers));
  const dim3 grid(p.senders + reducers);
  if (p.in_bytes == 2 && p.out_bytes == 2) {
    CombineKernel<__nv_bfloat16, __nv_bfloat16><<<grid, kThreads, 0, stream>>>(p);
  } else if (p.in_bytes == 2) {
    CombineKernel<__nv_bfloat16, float><<<grid, kThreads, 0, stream>>>(p);
  } else if (p.out_bytes == 2) {
    CombineKernel<float, __nv_bfloat16><<<grid, kThreads, 0, stream>>>(p);
  } else {
    CombineKernel<float, float><<<grid, kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace jax_moe_a2a
