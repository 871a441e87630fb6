// a2a_latency.cu -- per-call time of the one-sided dispatch and combine kernels alone, without XLA, next to the
// floors any such kernel stands on: an empty launch, and a launch that does one cross-GPU flag handshake.
//
// Every visible GPU (all must reach each other through peer access) is one rank; with one GPU, every row is that
// rank's own and nothing crosses NVLink, which leaves the kernels' fixed costs. Each GPU's stream replays a CUDA
// graph of kCalls back-to-back launches of one kernel (launch cost as in an XLA command buffer); the graphs of all
// GPUs start together, and a call takes the slower GPU's graph time / kCalls. Median of kRuns runs after warm-up.
// The calls cycle through `--sets N` sets of inputs and outputs (default 8), each with its own random routing: as in
// a jitted chain of distinct inputs, a call finds them in HBM rather than in L2 (--sets 1: the L2-hot case).
// DeepSeek-V3 shapes: hidden 7168, FP8 wire (7168 bytes + 56 float32 scales per row), top-8 of 256 experts, random
// routing, bf16 combine; tokens per rank from the command line after the options (default 1 8 128 512 4096). The
// workspace offsets come from jax_moe_a2a.layout on stdin (the ranks, the largest size as capacity). Prints one JSON
// object: device, and rows of {op, tokens_per_rank, us_per_call, nvlink_bytes_per_gpu, gb_per_s}.
//
// --ranks R runs R ranks on GPU 0 instead, each launching on its own stream with 1/R of the multiprocessors, so that
// every rank's grid is resident at once: the peer paths of the protocol on one GPU, without NVLink (its timings are
// not NVLink's). --check compares every rank's outputs of each size with a reference computed on the host, bit for
// bit: send slots, counts, received rows, scales, ids and weights, and the combined rows (float32 sums in rank order
// rounded to bf16).
//
// --missing R checks the bounded waits instead of timing: for each size, every rank but R calls dispatch once (and,
// after a dispatch of all ranks, combine once) with a 200 ms timeout; each of them must end with its error word naming
// R (kErrorTimeoutBase + R) within about that time. Then every rank calls, R with another signature (as if with other
// shapes): the others' error words must name R (kErrorMismatchBase + R), R's another rank. The workspaces are zeroed
// before each call, as a fresh one.
//
//   nvcc -arch=sm_90a -O3 -std=c++17 --expt-relaxed-constexpr -Iffi/src -o a2a_latency \
//        bench/cuda/a2a_latency.cu ffi/src/a2a_kernels.cu
//   python3 -c 'from jax_moe_a2a import layout as L
//   w = L.workspace_layout(num_ranks=2, capacity=4096, hidden=7168, top_k=8, fmt="fp8_blockwise")
//   print("ranks 2 capacity 4096 total", w.total_bytes, *(f"{r.name} {r.offset}" for r in w.regions),
//         "ll_tokens", w.ll_tokens, "ll_row_bytes", w.ll_row_bytes)' |
//   ./a2a_latency [--sets N] [--ranks R] [--check] [tokens ...]
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "a2a_kernels.cuh"

#define CK(x)                                                                              \
  do {                                                                                     \
    cudaError_t err_ = (x);                                                                \
    if (err_ != cudaSuccess) {                                                             \
      std::printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(err_));             \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

using jax_moe_a2a::CombineParams;
using jax_moe_a2a::DispatchParams;

namespace {

constexpr int kHidden = 7168, kTopK = 8, kExperts = 256;
constexpr int64_t kXRow = kHidden, kSfRow = kHidden / 128 * 4, kCombineRow = kHidden * 2;
constexpr int kCalls = 200, kRuns = 20, kWarmup = 3;

// Byte offsets in each rank's block, as jax_moe_a2a.layout.workspace_layout computes them (read from stdin: a first
// line "ranks R capacity C total BYTES", then one "name offset" line per region, then "ll_tokens N" and
// "ll_row_bytes N").
struct Layout {
  int ranks = 0;
  int64_t capacity = 0, total = 0;
  int64_t off_x, off_sf, off_ids, off_weights, off_counts, off_ready, off_combine, off_combine_ready, stride;
  int64_t off_ll, ll_tokens, ll_row;
  int64_t off_flags, off_sync, off_scan;

  static Layout Read(std::FILE* in) {
    Layout lay;
    long long capacity = 0, total = 0;
    if (std::fscanf(in, " ranks %d capacity %lld total %lld", &lay.ranks, &capacity, &total) != 3) {
      std::printf("stdin: expected a first line \"ranks R capacity C total BYTES\" (see the header of this file)\n");
      std::exit(1);
    }
    lay.capacity = capacity;
    lay.total = total;
    std::map<std::string, int64_t> off;
    char name[128];
    long long at;
    while (std::fscanf(in, " %127s %lld", name, &at) == 2) off[name] = at;
    auto get = [&](const char* region) {
      const auto it = off.find(region);
      if (it == off.end()) {
        std::printf("stdin: no offset for region %s\n", region);
        std::exit(1);
      }
      return it->second;
    };
    lay.off_x = get("buf0.recv_x");
    lay.off_sf = get("buf0.recv_x_sf");
    lay.off_ids = get("buf0.recv_topk_ids");
    lay.off_weights = get("buf0.recv_topk_weights");
    lay.off_counts = get("buf0.recv_counts");
    lay.off_ready = get("buf0.recv_ready");
    lay.off_combine = get("buf0.combine");
    lay.off_combine_ready = get("buf0.combine_ready");
    lay.stride = get("buf1.recv_x") - lay.off_x;
    lay.off_flags = get("flags");
    lay.off_sync = get("sync");
    lay.off_scan = get("scan");
    lay.off_ll = get("buf0.recv_ll");
    lay.ll_tokens = get("ll_tokens");
    lay.ll_row = get("ll_row_bytes");
    return lay;
  }
};

__global__ void Empty() {}

// One cross-GPU handshake: thread 0 raises this call's epoch in every peer's word for this rank, then waits until
// every peer has raised its own here. epoch[0] counts the calls on this GPU; words[r] is this GPU's word of rank r.
__global__ void Handshake(uint64_t* epoch, jax_moe_a2a::PeerBases words, int me, int ranks) {
  if (threadIdx.x != 0) return;
  const uint64_t e = epoch[0] + 1;
  epoch[0] = e;
  for (int r = 0; r < ranks; ++r) {
    if (r == me) continue;
    auto* f = reinterpret_cast<uint64_t*>(words.base[r]) + me;
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(f), "l"(e) : "memory");
  }
  const auto* mine = reinterpret_cast<const uint64_t*>(words.base[me]);
  for (int r = 0; r < ranks; ++r) {
    if (r == me) continue;
    uint64_t v;
    do {
      asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(mine + r) : "memory");
    } while (v < e);
  }
}

// One call's inputs and outputs on one GPU.
struct Buffers {
  uint8_t *x = nullptr, *x_sf = nullptr, *recv_x = nullptr, *recv_sf = nullptr, *expert_out = nullptr, *out = nullptr;
  int32_t *ids = nullptr, *recv_ids = nullptr, *recv_counts = nullptr, *send_slot = nullptr;
  float *weights = nullptr, *recv_weights = nullptr;
};

// Set 0's inputs of a rank on the host, for --check.
struct HostInputs {
  std::vector<uint8_t> x, x_sf;
  std::vector<int32_t> ids;
  std::vector<float> weights;
  std::vector<uint16_t> expert_out;  // bf16 bits
};

struct Rank {
  int device;
  cudaStream_t stream;
  int num_sms;  // the multiprocessors its launches may use
  HostInputs host;
  uint8_t* block;
  std::vector<Buffers> sets;
  uint64_t* epoch;
  int* error;
  cudaGraphExec_t graph = nullptr;
  cudaEvent_t start, stop;
};

// Per call, in microseconds: the median over runs of the slower GPU's graph time / kCalls. `launch(g, i)` enqueues
// call i on GPU g's stream.
template <typename Launch>
double TimeCalls(std::vector<Rank>& ranks, Launch launch) {
  for (size_t g = 0; g < ranks.size(); ++g) {
    CK(cudaSetDevice(ranks[g].device));
    cudaGraph_t graph;
    CK(cudaStreamBeginCapture(ranks[g].stream, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < kCalls; ++i) launch(static_cast<int>(g), i);
    CK(cudaStreamEndCapture(ranks[g].stream, &graph));
    if (ranks[g].graph) CK(cudaGraphExecDestroy(ranks[g].graph));
    CK(cudaGraphInstantiate(&ranks[g].graph, graph, 0));
    CK(cudaGraphDestroy(graph));
  }
  std::vector<double> per_call;
  for (int run = 0; run < kWarmup + kRuns; ++run) {
    for (size_t g = 0; g < ranks.size(); ++g) {
      CK(cudaSetDevice(ranks[g].device));
      CK(cudaEventRecord(ranks[g].start, ranks[g].stream));
      CK(cudaGraphLaunch(ranks[g].graph, ranks[g].stream));
      CK(cudaEventRecord(ranks[g].stop, ranks[g].stream));
    }
    float slowest = 0;
    for (size_t g = 0; g < ranks.size(); ++g) {
      CK(cudaSetDevice(ranks[g].device));
      CK(cudaEventSynchronize(ranks[g].stop));
      float ms;
      CK(cudaEventElapsedTime(&ms, ranks[g].start, ranks[g].stop));
      slowest = std::max(slowest, ms);
      if (*ranks[g].error != 0) {
        std::printf("GPU %zu: kernel error word %d\n", g, *ranks[g].error);
        std::exit(1);
      }
    }
    if (run >= kWarmup) per_call.push_back(slowest * 1e3 / kCalls);
  }
  std::sort(per_call.begin(), per_call.end());
  return per_call[per_call.size() / 2];
}

int64_t g_timeout_ns = 5'000'000'000;  // of every wait in the kernels

// The fields that DispatchParams and CombineParams share: who is where, the call's size, flags and epochs.
template <typename Params>
void SetShared(Params& p, const jax_moe_a2a::PeerBases& peers, int me, int ranks, int64_t capacity, int64_t tokens,
               const Layout& lay, const Rank& r) {
  p.peers = peers;
  p.me = me;
  p.num_ranks = ranks;
  p.capacity = capacity;
  p.num_tokens = tokens;
  p.buffer_stride = lay.stride;
  p.off_flags = lay.off_flags;
  p.off_sync = lay.off_sync;
  p.timeout_ns = g_timeout_ns;
  CK(cudaHostGetDevicePointer(&p.error, r.error, 0));
}

template <typename T>
T* Alloc(int64_t count) {
  T* p;
  CK(cudaMalloc(&p, std::max<int64_t>(1, count) * sizeof(T)));
  CK(cudaMemset(p, 0, std::max<int64_t>(1, count) * sizeof(T)));
  return p;
}

float Bf16ToFloat(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t FloatToBf16(float f) {  // round to nearest even; the sums here are finite
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

template <typename T>
std::vector<T> Download(const T* device, int64_t count) {
  std::vector<T> host(count);
  CK(cudaMemcpy(host.data(), device, count * sizeof(T), cudaMemcpyDeviceToHost));
  return host;
}

// Every rank's outputs of set 0 against the host reference (see the header). Exits on the first difference.
void Check(std::vector<Rank>& ranks, int64_t tokens) {
  const int n = static_cast<int>(ranks.size()), local = kExperts / n;
  // slot[s][t * n + r]: token t of source s on rank r (-1: not sent); count[s][r].
  std::vector<std::vector<int32_t>> slot(n, std::vector<int32_t>(tokens * n, -1)), count(n, std::vector<int32_t>(n));
  for (int s = 0; s < n; ++s) {
    for (int64_t t = 0; t < tokens; ++t) {
      for (int k = 0; k < kTopK; ++k) {
        const int id = ranks[s].host.ids[t * kTopK + k];
        if (id >= 0 && id < kExperts) slot[s][t * n + id / local] = 0;
      }
      for (int r = 0; r < n; ++r) {
        if (slot[s][t * n + r] == 0) slot[s][t * n + r] = count[s][r]++;
      }
    }
  }
  auto fail = [&](int me, const char* what, int64_t at, double got, double want) {
    std::printf("--check: rank %d, %lld tokens: %s differs at %lld: got %g, expected %g\n", me,
                static_cast<long long>(tokens), what, static_cast<long long>(at), got, want);
    std::exit(1);
  };
  for (int me = 0; me < n; ++me) {
    CK(cudaSetDevice(ranks[me].device));
    const Buffers& b = ranks[me].sets[0];
    const auto send_slot = Download(b.send_slot, tokens * n);
    const auto counts = Download(b.recv_counts, n);
    const auto recv_x = Download(b.recv_x, n * tokens * kXRow);
    const auto recv_sf = Download(b.recv_sf, n * tokens * kSfRow);
    const auto recv_ids = Download(b.recv_ids, n * tokens * kTopK);
    const auto recv_w = Download(b.recv_weights, n * tokens * kTopK);
    const auto out = Download(reinterpret_cast<const uint16_t*>(b.out), tokens * kHidden);
    for (int64_t i = 0; i < tokens * n; ++i) {
      if (send_slot[i] != slot[me][i]) fail(me, "send_slot", i, send_slot[i], slot[me][i]);
    }
    for (int s = 0; s < n; ++s) {
      if (counts[s] != count[s][me]) fail(me, "recv_counts", s, counts[s], count[s][me]);
      std::vector<int64_t> token_of(tokens, -1);  // slot j of source s -> its token
      for (int64_t t = 0; t < tokens; ++t) {
        if (slot[s][t * n + me] >= 0) token_of[slot[s][t * n + me]] = t;
      }
      const HostInputs& in = ranks[s].host;
      for (int64_t j = 0; j < tokens; ++j) {
        const int64_t o = s * tokens + j, t = token_of[j];
        for (int64_t i = 0; i < kXRow; ++i) {
          const int want = t < 0 ? 0 : in.x[t * kXRow + i];
          if (recv_x[o * kXRow + i] != want) fail(me, "recv_x", o * kXRow + i, recv_x[o * kXRow + i], want);
        }
        for (int64_t i = 0; i < kSfRow; ++i) {
          const int want = t < 0 ? 0 : in.x_sf[t * kSfRow + i];
          if (recv_sf[o * kSfRow + i] != want) fail(me, "recv_x_sf", o * kSfRow + i, recv_sf[o * kSfRow + i], want);
        }
        for (int k = 0; k < kTopK; ++k) {
          const int id = t < 0 ? -1 : in.ids[t * kTopK + k];
          const int want_id = id >= 0 && id < kExperts && id / local == me ? id - me * local : -1;
          const float want_w = want_id < 0 ? 0.0f : in.weights[t * kTopK + k];
          if (recv_ids[o * kTopK + k] != want_id) fail(me, "recv_topk_ids", o * kTopK + k, recv_ids[o * kTopK + k], want_id);
          if (std::memcmp(&recv_w[o * kTopK + k], &want_w, 4) != 0) {
            fail(me, "recv_topk_weights", o * kTopK + k, recv_w[o * kTopK + k], want_w);
          }
        }
      }
    }
    for (int64_t t = 0; t < tokens; ++t) {
      bool sent = false;
      for (int r = 0; r < n; ++r) sent |= slot[me][t * n + r] >= 0;
      for (int64_t h = 0; h < kHidden; ++h) {
        float acc = sent ? -0.0f : 0.0f;
        for (int r = 0; r < n; ++r) {
          const int32_t j = slot[me][t * n + r];
          if (j >= 0) acc += Bf16ToFloat(ranks[r].host.expert_out[(me * tokens + j) * kHidden + h]);
        }
        const uint16_t want = FloatToBf16(acc);
        if (out[t * kHidden + h] != want) {
          fail(me, "combine", t * kHidden + h, Bf16ToFloat(out[t * kHidden + h]), Bf16ToFloat(want));
        }
      }
    }
  }
}

// Zeroes every rank's workspace block and error word (a fresh workspace: epoch 0, no abort), with no kernel running.
void ResetWorkspaces(std::vector<Rank>& ranks, const Layout& lay) {
  for (Rank& r : ranks) {
    CK(cudaSetDevice(r.device));
    CK(cudaDeviceSynchronize());
    CK(cudaMemset(r.block, 0, lay.total));
    CK(cudaDeviceSynchronize());
    *r.error = 0;
  }
}

// Launches `launch(g, 0)` on every rank but `skip` (-1: none) and waits for them; returns the milliseconds taken.
template <typename Launch>
double LaunchAllBut(std::vector<Rank>& ranks, int skip, Launch launch) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int g = 0; g < static_cast<int>(ranks.size()); ++g) {
    CK(cudaSetDevice(ranks[g].device));
    if (g != skip) launch(g, 0);
  }
  for (Rank& r : ranks) {
    CK(cudaSetDevice(r.device));
    CK(cudaStreamSynchronize(r.stream));
  }
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// --missing: a dispatch without rank `missing`, then a combine without it (after a dispatch of all ranks); then a
// dispatch and a combine of all ranks in which `missing` calls with another signature (`odd_rank`, read by the
// launches). Prints a row per case (after the timing rows of the empty kernels) with every rank's error word; exits
// with 1 unless each names the expected source.
template <typename Dispatch, typename Combine>
void Faults(std::vector<Rank>& ranks, const Layout& lay, int64_t tokens, int missing, int& odd_rank,
            Dispatch dispatch, Combine combine) {
  const int n = static_cast<int>(ranks.size());
  auto report = [&](const char* what, double ms, int base) {
    bool ok = true;
    std::printf(", {\"op\": \"%s\", \"rank\": %d, \"tokens_per_rank\": %lld, \"ms\": %.1f, \"error_words\": [", what,
                missing, static_cast<long long>(tokens), ms);
    for (int g = 0; g < n; ++g) {
      const int word = *ranks[g].error;
      std::printf("%s%d", g ? ", " : "", word);
      if (g != missing) {
        ok = ok && word == base + missing;
      } else if (base == jax_moe_a2a::kErrorMismatchBase) {
        ok = ok && word >= base && word < base + n && word != base + missing;
      }
    }
    std::printf("]}\n");
    std::fflush(stdout);
    if (!ok) {
      std::printf("--missing: expected the error words of the other ranks to be %d\n", base + missing);
      std::exit(1);
    }
  };
  auto all_succeed = [&](const char* what) {
    for (int g = 0; g < n; ++g) {
      if (*ranks[g].error != 0) {
        std::printf("--missing: %s of every rank failed on rank %d: error word %d\n", what, g, *ranks[g].error);
        std::exit(1);
      }
    }
  };
  const int timeout = jax_moe_a2a::kErrorTimeoutBase, mismatch = jax_moe_a2a::kErrorMismatchBase;
  ResetWorkspaces(ranks, lay);
  report("dispatch, rank missing", LaunchAllBut(ranks, missing, dispatch), timeout);
  ResetWorkspaces(ranks, lay);
  LaunchAllBut(ranks, -1, dispatch);
  all_succeed("a dispatch");
  report("combine, rank missing", LaunchAllBut(ranks, missing, combine), timeout);
  ResetWorkspaces(ranks, lay);
  odd_rank = missing;
  report("dispatch, rank with another signature", LaunchAllBut(ranks, -1, dispatch), mismatch);
  ResetWorkspaces(ranks, lay);
  odd_rank = -1;
  LaunchAllBut(ranks, -1, dispatch);
  all_succeed("a dispatch");
  odd_rank = missing;
  report("combine, rank with another signature", LaunchAllBut(ranks, -1, combine), mismatch);
  odd_rank = -1;
  ResetWorkspaces(ranks, lay);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> sizes;
  int num_sets = 8, ranks_on_one = 0, missing = -1;
  bool check = false;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--sets" && i + 1 < argc) {
      num_sets = std::atoi(argv[++i]);
      if (num_sets < 1) {
        std::printf("--sets: expected a count >= 1, got %s\n", argv[i]);
        return 1;
      }
    } else if (std::string(argv[i]) == "--ranks" && i + 1 < argc) {
      ranks_on_one = std::atoi(argv[++i]);
      if (ranks_on_one < 1 || ranks_on_one > jax_moe_a2a::kMaxRanks) {
        std::printf("--ranks: expected a count in [1, %d], got %s\n", jax_moe_a2a::kMaxRanks, argv[i]);
        return 1;
      }
    } else if (std::string(argv[i]) == "--missing" && i + 1 < argc) {
      missing = std::atoi(argv[++i]);
    } else if (std::string(argv[i]) == "--check") {
      check = true;
    } else {
      sizes.push_back(std::atoll(argv[i]));
    }
  }
  if (sizes.empty()) sizes = {1, 8, 128, 512, 4096};
  if (missing != -1) g_timeout_ns = 200'000'000;
  const Layout lay = Layout::Read(stdin);
  std::fprintf(stderr, "layout: %d ranks, capacity %lld, %lld bytes, buffer stride %lld, sync at %lld\n", lay.ranks,
               static_cast<long long>(lay.capacity), static_cast<long long>(lay.total),
               static_cast<long long>(lay.stride), static_cast<long long>(lay.off_sync));
  int gpus;
  CK(cudaGetDeviceCount(&gpus));
  if (gpus < 1) {
    std::printf("needs a GPU, found none\n");
    return 1;
  }
  if (ranks_on_one > 0) gpus = 1;
  const int n = ranks_on_one > 0 ? ranks_on_one : gpus;  // ranks
  if (missing != -1 && (n < 2 || missing < 0 || missing >= n)) {
    std::printf("--missing: expected a rank in [0, %d) of at least two ranks, got %d\n", n, missing);
    return 1;
  }
  for (int a = 0; a < gpus; ++a) {
    CK(cudaSetDevice(a));
    for (int b = 0; b < gpus; ++b) {
      if (a == b) continue;
      int ok;
      CK(cudaDeviceCanAccessPeer(&ok, a, b));
      if (!ok) {
        std::printf("GPU %d cannot reach GPU %d\n", a, b);
        return 1;
      }
      CK(cudaDeviceEnablePeerAccess(b, 0));
    }
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("{\"device\": \"%dx %s\", \"ranks\": %d, \"calls_per_graph\": %d, \"runs\": %d, \"input_sets\": %d, "
              "\"checked\": %s, \"rows\": [\n", gpus, prop.name, n, kCalls, kRuns, num_sets, check ? "true" : "false");

  const int64_t max_tokens = lay.capacity;
  if (lay.ranks != n || *std::max_element(sizes.begin(), sizes.end()) > max_tokens) {
    std::printf("the layout is for %d ranks and %lld tokens per rank; this run has %d ranks and up to %lld tokens\n",
                lay.ranks, static_cast<long long>(max_tokens), n,
                static_cast<long long>(*std::max_element(sizes.begin(), sizes.end())));
    return 1;
  }
  std::vector<Rank> ranks(n);
  jax_moe_a2a::PeerBases peers{}, handshake_words{};
  std::mt19937 rng(1234);
  for (int g = 0; g < n; ++g) {
    Rank& r = ranks[g];
    r.device = ranks_on_one > 0 ? 0 : g;
    CK(cudaSetDevice(r.device));
    CK(cudaStreamCreateWithFlags(&r.stream, cudaStreamNonBlocking));
    CK(cudaDeviceGetAttribute(&r.num_sms, cudaDevAttrMultiProcessorCount, r.device));
    if (ranks_on_one > 0) r.num_sms /= ranks_on_one;
    r.block = Alloc<uint8_t>(lay.total);
    peers.base[g] = r.block;
    r.epoch = Alloc<uint64_t>(1);
    handshake_words.base[g] = reinterpret_cast<uint8_t*>(Alloc<uint64_t>(n));
    int* host_error;
    CK(cudaHostAlloc(&host_error, sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable));
    *host_error = 0;
    r.error = host_error;
    CK(cudaEventCreate(&r.start));
    CK(cudaEventCreate(&r.stop));
  }

  bool first = true;
  auto row = [&](const char* what, int64_t tokens, double us, double bytes) {
    std::printf("%s {\"op\": \"%s\", \"tokens_per_rank\": %lld, \"us_per_call\": %.2f, \"nvlink_bytes_per_gpu\": %.0f, "
                "\"gb_per_s\": %.1f}\n",
                first ? " " : ",", what, static_cast<long long>(tokens), us, bytes, bytes > 0 ? bytes / us / 1e3 : 0.0);
    std::fflush(stdout);
    first = false;
  };

  row("empty kernel, 1 block", 0, TimeCalls(ranks, [&](int g, int) { Empty<<<1, 32, 0, ranks[g].stream>>>(); }), 0);
  row("empty kernel, 1 block of 512 per SM", 0, TimeCalls(ranks, [&](int g, int) {
        Empty<<<ranks[g].num_sms, 512, 0, ranks[g].stream>>>();
      }), 0);
  row("handshake kernel", 0, TimeCalls(ranks, [&](int g, int) {
        Handshake<<<1, 32, 0, ranks[g].stream>>>(ranks[g].epoch, handshake_words, g, n);
      }), 0);

  for (int64_t tokens : sizes) {
    // Fresh inputs per size: random bytes for x and scales, top-8 distinct experts per token.
    double routed = 0;  // (token, other rank) pairs, over all GPUs and sets
    for (int g = 0; g < n; ++g) {
      CK(cudaSetDevice(ranks[g].device));
      for (Buffers& r : ranks[g].sets) {
        for (uint8_t* p : {r.x, r.x_sf, r.recv_x, r.recv_sf, r.expert_out, r.out}) CK(cudaFree(p));
        for (int32_t* p : {r.ids, r.recv_ids, r.recv_counts, r.send_slot}) CK(cudaFree(p));
        for (float* p : {r.weights, r.recv_weights}) CK(cudaFree(p));
      }
      ranks[g].sets.assign(num_sets, Buffers{});
      for (Buffers& r : ranks[g].sets) {
        const bool keep = check && &r == &ranks[g].sets[0];  // set 0's inputs, for --check
        r.x = Alloc<uint8_t>(tokens * kXRow);
        r.x_sf = Alloc<uint8_t>(tokens * kSfRow);
        r.ids = Alloc<int32_t>(tokens * kTopK);
        r.weights = Alloc<float>(tokens * kTopK);
        r.recv_x = Alloc<uint8_t>(n * tokens * kXRow);
        r.recv_sf = Alloc<uint8_t>(n * tokens * kSfRow);
        r.recv_ids = Alloc<int32_t>(n * tokens * kTopK);
        r.recv_weights = Alloc<float>(n * tokens * kTopK);
        r.recv_counts = Alloc<int32_t>(n);
        r.send_slot = Alloc<int32_t>(tokens * n);
        r.expert_out = Alloc<uint8_t>(n * tokens * kCombineRow);
        r.out = Alloc<uint8_t>(tokens * kCombineRow);
        std::vector<uint8_t> bytes(tokens * kXRow), sf_bytes(tokens * kSfRow);
        for (auto& b : bytes) b = static_cast<uint8_t>(rng());
        for (auto& b : sf_bytes) b = static_cast<uint8_t>(rng());
        CK(cudaMemcpy(r.x, bytes.data(), bytes.size(), cudaMemcpyHostToDevice));
        CK(cudaMemcpy(r.x_sf, sf_bytes.data(), sf_bytes.size(), cudaMemcpyHostToDevice));
        std::vector<int32_t> ids(tokens * kTopK);
        std::vector<float> weights(tokens * kTopK);
        for (auto& w : weights) w = std::uniform_real_distribution<float>(0.0f, 1.0f)(rng);
        std::vector<int> experts(kExperts);
        for (int e = 0; e < kExperts; ++e) experts[e] = e;
        for (int64_t t = 0; t < tokens; ++t) {
          std::shuffle(experts.begin(), experts.end(), rng);
          std::vector<bool> to(n, false);
          for (int k = 0; k < kTopK; ++k) {
            ids[t * kTopK + k] = experts[k];
            to[experts[k] / (kExperts / n)] = true;
          }
          for (int d = 0; d < n; ++d) routed += d != g && to[d];
        }
        CK(cudaMemcpy(r.ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(r.weights, weights.data(), weights.size() * 4, cudaMemcpyHostToDevice));
        if (keep) {  // expert outputs: bf16 of uniform values in [-1, 1)
          std::vector<uint16_t> expert_out(n * tokens * kHidden);
          for (auto& v : expert_out) v = FloatToBf16(std::uniform_real_distribution<float>(-1.0f, 1.0f)(rng));
          CK(cudaMemcpy(r.expert_out, expert_out.data(), expert_out.size() * 2, cudaMemcpyHostToDevice));
          ranks[g].host = {std::move(bytes), std::move(sf_bytes), std::move(ids), std::move(weights),
                           std::move(expert_out)};
        }
      }
    }
    int odd_rank = -1;  // --missing: the rank that calls with another signature
    auto dispatch = [&](int g, int i) {
      const Buffers& r = ranks[g].sets[i % num_sets];
      DispatchParams p{};
      SetShared(p, peers, g, n, max_tokens, tokens, lay, ranks[g]);
      p.top_k = kTopK;
      p.num_experts = kExperts;
      p.x_row = kXRow;
      p.sf_row = kSfRow;
      p.x = r.x;
      p.x_sf = r.x_sf;
      p.ids = r.ids;
      p.weights = r.weights;
      p.recv_x = r.recv_x;
      p.recv_sf = r.recv_sf;
      p.recv_ids = r.recv_ids;
      p.recv_weights = r.recv_weights;
      p.recv_counts = r.recv_counts;
      p.send_slot = r.send_slot;
      p.off_x = lay.off_x;
      p.off_sf = lay.off_sf;
      p.off_ids = lay.off_ids;
      p.off_weights = lay.off_weights;
      p.off_counts = lay.off_counts;
      p.off_scan = lay.off_scan;
      p.off_ready = lay.off_ready;
      p.off_ll = lay.off_ll;
      p.ll_tokens = lay.ll_tokens;
      p.ll_row = lay.ll_row;
      p.signature = g == odd_rank ? 3 : 1;
      CK(jax_moe_a2a::LaunchDispatch(ranks[g].stream, ranks[g].num_sms, p));
    };
    auto combine = [&](int g, int i) {  // on the routing that dispatch left in set i
      const Buffers& r = ranks[g].sets[i % num_sets];
      CombineParams p{};
      SetShared(p, peers, g, n, max_tokens, tokens, lay, ranks[g]);
      p.hidden = kHidden;
      p.in_bytes = 2;
      p.out_bytes = 2;
      p.expert_out = r.expert_out;
      p.recv_counts = r.recv_counts;
      p.send_slot = r.send_slot;
      p.out = r.out;
      p.off_combine = lay.off_combine;
      p.off_ready = lay.off_combine_ready;
      p.signature = g == odd_rank ? 4 : 2;
      CK(jax_moe_a2a::LaunchCombine(ranks[g].stream, ranks[g].num_sms, p));
    };
    if (missing >= 0) {
      Faults(ranks, lay, tokens, missing, odd_rank, dispatch, combine);
      continue;
    }
    const double per_gpu = routed / n / num_sets;
    row("dispatch", tokens, TimeCalls(ranks, dispatch), per_gpu * (kXRow + kSfRow + kTopK * 8));
    row("combine", tokens, TimeCalls(ranks, combine), per_gpu * kCombineRow);
    if (check) Check(ranks, tokens);
  }
  std::printf("]}\n");
  return 0;
}
