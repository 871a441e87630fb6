// a2a.cc -- handlers of jax_moe_a2a_dispatch and jax_moe_a2a_combine (CPU, and CUDA when built with it).
//
// NOTES (the contract is a2a.py's; these handlers reproduce the pure-JAX reference bit for bit):
//   - Per rank `me` of an expert group of R ranks, T tokens, top_k experts, L = num_experts / R local experts:
//     a token goes to rank r once if any of its valid experts (0 <= id < num_experts) lives there; its slot on
//     r is the number of earlier tokens bound for r (exclusive prefix count), never an atomic counter.
//   - GPUs, one-sided: the source writes every payload straight into the destination's receive region, at
//     [source rank, slot], in the buffer (call count & 1) of that op. Workspace rows are indexed with the
//     workspace's capacity C >= T. A source writes buffer b again only two calls later, which it reaches only
//     after the flag wait of the call in between, and no rank passes that before it has finished reading buffer b
//     (a2a_kernels.cu has the protocol).
//   - CPU: the simulated devices of a group meet once per call (Meetings, keyed by the call's `site` attribute and
//     its occurrence) and each rank reads what it receives straight from its peers' inputs; nobody leaves before
//     every rank has read. The GPUs ignore `site`: each runs its calls in program order.
//   - Receive side: the rows of slots j < count[s] are source s's tokens; padding rows get zero bits, ids -1 and
//     weights 0.0, as the reference defines.
//   - Combine sums, per token, float32(row from rank r) over r = 0, 1, ..., R-1 in that order, starting at -0.0
//     (+0.0 for a token sent nowhere).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "a2a_protocol.h"
#include "common.h"
#include "workspace.h"
#include "xla/ffi/api/ffi.h"

#ifdef JAX_MOE_A2A_WITH_CUDA
#include "a2a_kernels.cuh"
#endif

namespace jax_moe_a2a {

namespace {

constexpr char kDispatchOp[] = "jax_moe_a2a_dispatch";
constexpr char kCombineOp[] = "jax_moe_a2a_combine";

// ---------------------------------------------------------------------------------------------------------------
// Attribute checks (shared by both platforms), before any arithmetic on the attributes
// ---------------------------------------------------------------------------------------------------------------

// NOTES: a2a.Workspace.attrs makes every attribute, but the targets can be reached directly (jax.ffi.ffi_call), so
//   each handler checks their ranges first: num_ranks divides (num_experts / num_ranks) and multiplies, capacity and
//   the offsets enter the byte counts. With these bounds no product or sum of the geometry overflows int64 (byte
//   counts of a row are those of buffers XLA allocated), and slot ids (num_ranks * capacity) fit int32.
constexpr int64_t kMaxAttrRanks = int64_t{1} << 16;
constexpr int64_t kMaxAttrBytes = int64_t{1} << 48;  // byte offsets and strides
constexpr int64_t kMaxInt32 = 0x7FFFFFFF;

ffi::Error CheckRange(const char* op, const char* name, int64_t v, int64_t lo, int64_t hi) {
  if (v < lo || v > hi) return InvalidArg(op, name, "in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]", v);
  return ffi::Error::Success();
}

// The members DispatchAttrs and CombineAttrs share.
template <typename Attrs>
ffi::Error CheckCommonAttrs(const char* op, const Attrs& a) {
  if (auto e = CheckRange(op, "num_ranks", a.num_ranks, 1, kMaxAttrRanks); e.failure()) return e;
  if (auto e = CheckRange(op, "capacity", a.capacity, 0, kMaxInt32 / a.num_ranks); e.failure()) return e;
  for (auto [name, v] : {std::pair<const char*, int64_t>{"buffer_stride", a.buffer_stride},
                         {"off_flags", a.off_flags}, {"off_sync", a.off_sync}}) {
    if (auto e = CheckRange(op, name, v, 0, kMaxAttrBytes); e.failure()) return e;
  }
  return ffi::Error::Success();
}

ffi::Error CheckDispatchAttrs(const DispatchAttrs& a) {
  if (auto e = CheckCommonAttrs(kDispatchOp, a); e.failure()) return e;
  if (auto e = CheckRange(kDispatchOp, "num_experts", a.num_experts, 1, kMaxInt32); e.failure()) return e;
  for (auto [name, v] : {std::pair<const char*, int64_t>{"off_x", a.off_x}, {"off_x_sf", a.off_x_sf},
                         {"off_ids", a.off_ids}, {"off_weights", a.off_weights}, {"off_counts", a.off_counts},
                         {"off_ready", a.off_ready}, {"off_ll", a.off_ll}, {"off_scan", a.off_scan}}) {
    if (auto e = CheckRange(kDispatchOp, name, v, 0, kMaxAttrBytes); e.failure()) return e;
  }
  return CheckRange(kDispatchOp, "ll_row_bytes", a.ll_row_bytes, 0, kMaxInt32);
}

ffi::Error CheckCombineAttrs(const CombineAttrs& a) {
  if (auto e = CheckCommonAttrs(kCombineOp, a); e.failure()) return e;
  for (auto [name, v] : {std::pair<const char*, int64_t>{"off_combine", a.off_combine}, {"off_ready", a.off_ready}}) {
    if (auto e = CheckRange(kCombineOp, name, v, 0, kMaxAttrBytes); e.failure()) return e;
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------------------------
// Geometry helpers (both ops, both platforms)
// ---------------------------------------------------------------------------------------------------------------

// The sync region: per op {epoch, block arrivals, spare, abort word or spare} uint64.
int64_t SyncBytes() { return 2 * kSyncWords * 8; }

int64_t RowBytes(const ffi::AnyBuffer& b, int64_t leading) {
  return leading == 0 ? 0 : static_cast<int64_t>(b.size_bytes()) / leading;
}

// ---------------------------------------------------------------------------------------------------------------
// Dispatch: shape checks and workspace geometry (both platforms), the CPU handler
// ---------------------------------------------------------------------------------------------------------------

// The call's shape with its attributes (DispatchAttrs): what the handlers work from.
struct DispatchGeometry : DispatchAttrs {
  int64_t num_tokens, top_k, num_local_experts;
  int64_t x_row, sf_row;  // bytes
};

ffi::Error CheckDispatch(const ffi::AnyBuffer& x, const ffi::AnyBuffer& x_sf, const ffi::Buffer<ffi::S32>& ids,
                         const ffi::Buffer<ffi::F32>& weights, const ffi::AnyBuffer& recv_x,
                         const ffi::AnyBuffer& recv_x_sf, const ffi::Buffer<ffi::S32>& recv_ids,
                         const ffi::Buffer<ffi::F32>& recv_weights, const ffi::Buffer<ffi::S32>& recv_counts,
                         const ffi::Buffer<ffi::S32>& send_slot, DispatchGeometry* g) {
  if (auto e = CheckDispatchAttrs(*g); e.failure()) return e;
  const auto id_dims = ids.dimensions();
  if (id_dims.size() != 2) return InvalidArg(kDispatchOp, "topk_ids", "[T, top_k]", DimsToString(id_dims));
  g->num_tokens = id_dims[0];
  g->top_k = id_dims[1];
  if (weights.dimensions().size() != 2 || weights.dimensions()[0] != g->num_tokens ||
      weights.dimensions()[1] != g->top_k) {
    return InvalidArg(kDispatchOp, "topk_weights", "[T, top_k] = " + DimsToString(id_dims),
                      DimsToString(weights.dimensions()));
  }
  const int64_t t = g->num_tokens, r = g->num_ranks;
  if (x.dimensions().size() == 0 || x.dimensions()[0] != t) {
    return InvalidArg(kDispatchOp, "x", "[T = " + std::to_string(t) + ", ...]", DimsToString(x.dimensions()));
  }
  if (x_sf.dimensions().size() == 0 || x_sf.dimensions()[0] != t) {
    return InvalidArg(kDispatchOp, "x_sf", "[T = " + std::to_string(t) + ", ...]", DimsToString(x_sf.dimensions()));
  }
  if (g->num_experts <= 0 || g->num_experts % r != 0) {
    return InvalidArg(kDispatchOp, "num_experts", "a positive multiple of num_ranks = " + std::to_string(r),
                      g->num_experts);
  }
  if (g->capacity < t) {
    return InvalidArg(kDispatchOp, "capacity (the workspace's tokens per rank)", ">= T = " + std::to_string(t),
                      g->capacity);
  }
  g->num_local_experts = g->num_experts / r;
  g->x_row = RowBytes(x, t);
  g->sf_row = RowBytes(x_sf, t);
  auto expect = [&](const char* name, int64_t got_bytes, int64_t want_bytes, ffi::DataType got_dt,
                    ffi::DataType want_dt) -> ffi::Error {
    if (got_bytes != want_bytes || got_dt != want_dt) {
      return InvalidArg(kDispatchOp, name, std::to_string(want_bytes) + " bytes of " + DataTypeName(want_dt),
                        std::to_string(got_bytes) + " bytes of " + DataTypeName(got_dt));
    }
    return ffi::Error::Success();
  };
  if (auto e = expect("recv_x", recv_x.size_bytes(), r * t * g->x_row, recv_x.element_type(), x.element_type());
      e.failure())
    return e;
  if (auto e = expect("recv_x_sf", recv_x_sf.size_bytes(), r * t * g->sf_row, recv_x_sf.element_type(),
                      x_sf.element_type());
      e.failure())
    return e;
  if (recv_ids.element_count() != static_cast<size_t>(r * t * g->top_k) ||
      recv_weights.element_count() != static_cast<size_t>(r * t * g->top_k)) {
    return InvalidArg(kDispatchOp, "recv_topk_ids/recv_topk_weights", "[R, T, top_k]",
                      DimsToString(recv_ids.dimensions()));
  }
  if (recv_counts.element_count() != static_cast<size_t>(r)) {
    return InvalidArg(kDispatchOp, "recv_counts", "[R = " + std::to_string(r) + "]",
                      DimsToString(recv_counts.dimensions()));
  }
  if (send_slot.element_count() != static_cast<size_t>(t * r)) {
    return InvalidArg(kDispatchOp, "send_slot", "[T, R]", DimsToString(send_slot.dimensions()));
  }
  return ffi::Error::Success();
}

// Bytes of a device's block that the dispatch touches: both buffers' regions, the flags, epochs and scan words.
int64_t DispatchNeededBytes(const DispatchGeometry& g) {
  const int64_t slots = g.num_ranks * g.capacity;
  int64_t end = std::max({g.off_x + slots * g.x_row, g.off_x_sf + slots * g.sf_row,
                          g.off_ids + slots * g.top_k * 4, g.off_weights + slots * g.top_k * 4,
                          g.off_counts + g.num_ranks * 8, g.off_ready + slots * Pieces(g.x_row) * 4,
                          g.off_ll + g.num_ranks * g.ll_tokens * g.ll_row_bytes});
  return std::max({end + g.buffer_stride, g.off_flags + 2 * g.num_ranks * 8, g.off_sync + SyncBytes(),
                   g.off_scan + kScanBlocks * g.num_ranks * 8});
}

std::string DispatchSignature(const DispatchGeometry& g) {
  std::ostringstream os;
  os << "op=dispatch T=" << g.num_tokens << " top_k=" << g.top_k << " num_experts=" << g.num_experts
     << " x_row_bytes=" << g.x_row << " x_sf_row_bytes=" << g.sf_row;
  return os.str();
}

// The shared first half of both dispatch handlers: shapes, the rank limit of the kernels, the workspace.
ffi::Error PrepareDispatch(int32_t device, const ffi::AnyBuffer& x, const ffi::AnyBuffer& x_sf,
                           const ffi::Buffer<ffi::S32>& ids, const ffi::Buffer<ffi::F32>& weights,
                           const ffi::AnyBuffer& recv_x, const ffi::AnyBuffer& recv_x_sf,
                           const ffi::Buffer<ffi::S32>& recv_ids, const ffi::Buffer<ffi::F32>& recv_weights,
                           const ffi::Buffer<ffi::S32>& recv_counts, const ffi::Buffer<ffi::S32>& send_slot,
                           bool cuda, DispatchGeometry* g, CallSite* site) {
  if (auto e = CheckDispatch(x, x_sf, ids, weights, recv_x, recv_x_sf, recv_ids, recv_weights, recv_counts,
                             send_slot, g);
      e.failure())
    return e;
  if (cuda && g->num_ranks > kMaxRanks) {
    return InvalidArg(kDispatchOp, "num_ranks", "<= " + std::to_string(kMaxRanks) + " on GPUs", g->num_ranks);
  }
  if (g->ll_tokens < 0 || g->ll_tokens > g->capacity) {
    return InvalidArg(kDispatchOp, "ll_tokens", "in [0, capacity = " + std::to_string(g->capacity) + "]",
                      g->ll_tokens);
  }
  // Rows in LL form (layout.ll_row_bytes): x of whole 16-byte vectors, scales of whole 4-byte words, and each 4 bytes
  // of x, scales, ids and weights in an 8-byte unit. The kernels take ll_tokens > 0 as the go-ahead.
  if (g->ll_tokens > 0 && (g->x_row % 16 != 0 || g->sf_row % 4 != 0)) {
    return InvalidArg(kDispatchOp, "ll_tokens", "0 for rows of " + std::to_string(g->x_row) + " x bytes and " +
                      std::to_string(g->sf_row) + " scale bytes (LL form needs multiples of 16 and 4)", g->ll_tokens);
  }
  const int64_t ll_min = 2 * (g->x_row + g->sf_row + 8 * g->top_k);
  if (g->ll_tokens > 0 && (g->ll_row_bytes < ll_min || g->ll_row_bytes % 16 != 0)) {
    return InvalidArg(kDispatchOp, "ll_row_bytes", "a multiple of 16, >= " + std::to_string(ll_min),
                      g->ll_row_bytes);
  }
  return ResolveCallSite(kDispatchOp, g->workspace, device, g->num_ranks, DispatchNeededBytes(*g), cuda, site);
}

// Slots, in token order: slot[t * R + r] (-1: not sent), counts[r]. Returns the destinations of each token.
void ComputeSlots(const int32_t* ids, int64_t t_count, int64_t top_k, int64_t num_ranks, int64_t local,
                  int32_t* slot, std::vector<int32_t>* counts) {
  counts->assign(num_ranks, 0);
  const int64_t num_experts = local * num_ranks;
  for (int64_t t = 0; t < t_count; ++t) {
    int32_t* row = slot + t * num_ranks;
    for (int64_t r = 0; r < num_ranks; ++r) row[r] = -1;
    for (int64_t k = 0; k < top_k; ++k) {
      const int64_t id = ids[t * top_k + k];
      if (id >= 0 && id < num_experts) row[id / local] = 0;  // mark
    }
    for (int64_t r = 0; r < num_ranks; ++r) {
      if (row[r] == 0) row[r] = (*counts)[r]++;
    }
  }
}

// What a rank brings to a dispatch meeting: its inputs and the slots it numbered (send_slot, counts per rank).
struct DispatchContribution {
  const uint8_t* x;
  const uint8_t* x_sf;
  const int32_t* ids;
  const float* weights;
  const int32_t* slot;
  const int32_t* counts;
};

ffi::Error DispatchCpuImpl(int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer x_sf, ffi::Buffer<ffi::S32> ids,
                           ffi::Buffer<ffi::F32> weights, ffi::AnyBuffer /*after*/, ffi::Result<ffi::AnyBuffer> recv_x,
                           ffi::Result<ffi::AnyBuffer> recv_x_sf, ffi::Result<ffi::Buffer<ffi::S32>> recv_ids,
                           ffi::Result<ffi::Buffer<ffi::F32>> recv_weights,
                           ffi::Result<ffi::Buffer<ffi::S32>> recv_counts,
                           ffi::Result<ffi::Buffer<ffi::S32>> send_slot, DispatchAttrs attrs) {
  DispatchGeometry g{attrs};
  CallSite site;
  if (auto e = PrepareDispatch(device, x, x_sf, ids, weights, *recv_x, *recv_x_sf, *recv_ids, *recv_weights,
                               *recv_counts, *send_slot, /*cuda=*/false, &g, &site);
      e.failure())
    return e;
  Workspace& ws = *site.ws;
  const int me = site.rank;
  const int64_t t_count = g.num_tokens, top_k = g.top_k, local = g.num_local_experts, num_ranks = g.num_ranks;

  std::vector<int32_t> counts;
  ComputeSlots(ids.typed_data(), t_count, top_k, num_ranks, local, send_slot->typed_data(), &counts);
  const DispatchContribution mine{static_cast<const uint8_t*>(x.untyped_data()),
                                  static_cast<const uint8_t*>(x_sf.untyped_data()), ids.typed_data(),
                                  weights.typed_data(), send_slot->typed_data(), counts.data()};
  Meetings& meetings = *ws.meetings[site.group];
  Meetings::Ticket ticket;
  std::vector<const void*> all;
  if (auto e = meetings.Gather(g.site, me, DispatchSignature(g), &mine, ws.timeout, kDispatchOp, &ticket, &all);
      e.failure()) {
    ws.Fail(e.message());
    return e;
  }

  // Receive from each source s (equal signatures: its T and rows are ours): its tokens bound here, at their slots;
  // the slots past its count are padding.
  auto* out_x = static_cast<uint8_t*>(recv_x->untyped_data());
  auto* out_sf = static_cast<uint8_t*>(recv_x_sf->untyped_data());
  int32_t* out_ids = recv_ids->typed_data();
  float* out_w = recv_weights->typed_data();
  for (int64_t s = 0; s < num_ranks; ++s) {
    const auto& from = *static_cast<const DispatchContribution*>(all[s]);
    const int32_t n = from.counts[me];
    recv_counts->typed_data()[s] = n;
    for (int64_t j = n; j < t_count; ++j) {
      const int64_t o = s * t_count + j;
      std::memset(out_x + o * g.x_row, 0, g.x_row);
      std::memset(out_sf + o * g.sf_row, 0, g.sf_row);
      std::fill(out_ids + o * top_k, out_ids + (o + 1) * top_k, -1);
      std::fill(out_w + o * top_k, out_w + (o + 1) * top_k, 0.0f);
    }
    for (int64_t t = 0; t < t_count; ++t) {
      const int32_t j = from.slot[t * num_ranks + me];
      if (j < 0) continue;
      const int64_t o = s * t_count + j;
      std::memcpy(out_x + o * g.x_row, from.x + t * g.x_row, g.x_row);
      std::memcpy(out_sf + o * g.sf_row, from.x_sf + t * g.sf_row, g.sf_row);
      for (int64_t k = 0; k < top_k; ++k) {
        const int64_t id = from.ids[t * top_k + k];
        const bool here = id >= 0 && id < g.num_experts && id / local == me;
        out_ids[o * top_k + k] = here ? static_cast<int32_t>(id - me * local) : -1;
        out_w[o * top_k + k] = here ? from.weights[t * top_k + k] : 0.0f;
      }
    }
  }
  meetings.Leave(ticket);
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------------------------
// Combine: shape checks and workspace geometry (both platforms), the CPU handler
// ---------------------------------------------------------------------------------------------------------------

// The call's shape with its attributes (CombineAttrs).
struct CombineGeometry : CombineAttrs {
  int64_t num_tokens, hidden, in_bytes, out_bytes;
};

bool IsCombineFloat(ffi::DataType dt) { return dt == ffi::DataType::BF16 || dt == ffi::DataType::F32; }

ffi::Error CheckCombine(const ffi::AnyBuffer& expert_out, const ffi::Buffer<ffi::S32>& recv_counts,
                        const ffi::Buffer<ffi::S32>& send_slot, const ffi::AnyBuffer& out, CombineGeometry* g) {
  if (auto e = CheckCombineAttrs(*g); e.failure()) return e;
  const auto dims = expert_out.dimensions();
  if (dims.size() != 3 || dims[0] != g->num_ranks) {
    return InvalidArg(kCombineOp, "expert_out", "[R = " + std::to_string(g->num_ranks) + ", T, hidden]",
                      DimsToString(dims));
  }
  g->num_tokens = dims[1];
  g->hidden = dims[2];
  if (!IsCombineFloat(expert_out.element_type())) {
    return InvalidArg(kCombineOp, "expert_out", "bfloat16 or float32", DataTypeName(expert_out.element_type()));
  }
  if (!IsCombineFloat(out.element_type())) {
    return InvalidArg(kCombineOp, "out", "bfloat16 or float32", DataTypeName(out.element_type()));
  }
  const auto od = out.dimensions();
  if (od.size() != 2 || od[0] != g->num_tokens || od[1] != g->hidden) {
    return InvalidArg(kCombineOp, "out", "[T, hidden]", DimsToString(od));
  }
  if (recv_counts.element_count() != static_cast<size_t>(g->num_ranks)) {
    return InvalidArg(kCombineOp, "recv_counts", "[R]", DimsToString(recv_counts.dimensions()));
  }
  const auto sd = send_slot.dimensions();
  if (sd.size() != 2 || sd[0] != g->num_tokens || sd[1] != g->num_ranks) {
    return InvalidArg(kCombineOp, "send_slot", "[T, R]", DimsToString(sd));
  }
  if (g->capacity < g->num_tokens) {
    return InvalidArg(kCombineOp, "capacity (the workspace's tokens per rank)",
                      ">= T = " + std::to_string(g->num_tokens), g->capacity);
  }
  g->in_bytes = expert_out.element_type() == ffi::DataType::BF16 ? 2 : 4;
  g->out_bytes = out.element_type() == ffi::DataType::BF16 ? 2 : 4;
  return ffi::Error::Success();
}

int64_t CombineNeededBytes(const CombineGeometry& g) {
  const int64_t slots = g.num_ranks * g.capacity;
  return std::max({std::max(g.off_combine + slots * g.hidden * g.in_bytes,
                            g.off_ready + slots * Pieces(g.hidden * g.in_bytes) * 4) + g.buffer_stride,
                   g.off_flags + 2 * g.num_ranks * 8, g.off_sync + SyncBytes()});
}

std::string CombineSignature(const CombineGeometry& g) {
  std::ostringstream os;
  os << "op=combine T=" << g.num_tokens << " hidden=" << g.hidden << " in_bytes=" << g.in_bytes;
  return os.str();
}

// The shared first half of both combine handlers.
ffi::Error PrepareCombine(int32_t device, const ffi::AnyBuffer& expert_out,
                          const ffi::Buffer<ffi::S32>& recv_counts, const ffi::Buffer<ffi::S32>& send_slot,
                          const ffi::AnyBuffer& out, bool cuda, CombineGeometry* g, CallSite* site) {
  if (auto e = CheckCombine(expert_out, recv_counts, send_slot, out, g); e.failure()) return e;
  if (cuda && g->num_ranks > kMaxRanks) {
    return InvalidArg(kCombineOp, "num_ranks", "<= " + std::to_string(kMaxRanks) + " on GPUs", g->num_ranks);
  }
  if (cuda && g->hidden % 8 != 0) return InvalidArg(kCombineOp, "hidden", "a multiple of 8 on GPUs", g->hidden);
  return ResolveCallSite(kCombineOp, g->workspace, device, g->num_ranks, CombineNeededBytes(*g), cuda, site);
}

inline float LoadFloat(const uint8_t* p, int64_t bytes) {
  float f;
  if (bytes == 4) {
    std::memcpy(&f, p, 4);
  } else {
    uint16_t h;
    std::memcpy(&h, p, 2);
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    std::memcpy(&f, &bits, 4);
  }
  return f;
}

inline void StoreFloat(uint8_t* p, int64_t bytes, float f) {
  if (bytes == 4) {
    std::memcpy(p, &f, 4);
    return;
  }
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  uint16_t h;
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) {
    h = static_cast<uint16_t>((bits >> 16) | 0x40u);  // NaN stays NaN (quiet)
  } else {
    h = static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);  // round to nearest even
  }
  std::memcpy(p, &h, 2);
}

ffi::Error CombineCpuImpl(int32_t device, ffi::AnyBuffer expert_out, ffi::Buffer<ffi::S32> recv_counts,
                          ffi::Buffer<ffi::S32> send_slot, ffi::AnyBuffer /*after*/, ffi::Result<ffi::AnyBuffer> out,
                          CombineAttrs attrs) {
  CombineGeometry g{attrs};
  CallSite site;
  if (auto e = PrepareCombine(device, expert_out, recv_counts, send_slot, *out, /*cuda=*/false, &g, &site);
      e.failure())
    return e;
  Workspace& ws = *site.ws;
  const int me = site.rank;
  const int64_t row_bytes = g.hidden * g.in_bytes, t_count = g.num_tokens, num_ranks = g.num_ranks;

  // A rank's contribution is its expert_out: [source, slot] rows, of which ours are [me, ...].
  Meetings& meetings = *ws.meetings[site.group];
  Meetings::Ticket ticket;
  std::vector<const void*> all;
  if (auto e = meetings.Gather(g.site, me, CombineSignature(g), expert_out.untyped_data(), ws.timeout, kCombineOp,
                               &ticket, &all);
      e.failure()) {
    ws.Fail(e.message());
    return e;
  }
  // Reduce: float32, ranks in ascending order.
  const int32_t* slot = send_slot.typed_data();
  auto* dst = static_cast<uint8_t*>(out->untyped_data());
  std::vector<float> acc(g.hidden);
  for (int64_t t = 0; t < t_count; ++t) {
    // From -0.0, the exact additive identity; +0.0 for a token sent nowhere (the reference's contract).
    const bool sent = std::any_of(slot + t * num_ranks, slot + (t + 1) * num_ranks, [](int32_t j) { return j >= 0; });
    std::fill(acc.begin(), acc.end(), sent ? -0.0f : 0.0f);
    for (int64_t r = 0; r < num_ranks; ++r) {
      const int32_t j = slot[t * num_ranks + r];
      if (j < 0 || j >= t_count) continue;  // slots of a dispatch are < T
      const uint8_t* row = static_cast<const uint8_t*>(all[r]) + (me * t_count + j) * row_bytes;
      for (int64_t h = 0; h < g.hidden; ++h) acc[h] += LoadFloat(row + h * g.in_bytes, g.in_bytes);
    }
    for (int64_t h = 0; h < g.hidden; ++h) StoreFloat(dst + (t * g.hidden + h) * g.out_bytes, g.out_bytes, acc[h]);
  }
  meetings.Leave(ticket);
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------------------------
// CUDA: the launches of dispatch and combine
// ---------------------------------------------------------------------------------------------------------------

#ifdef JAX_MOE_A2A_WITH_CUDA

// 16-bit FNV-1a of a call's signature: carried in the flags, so a peer that called with other shapes is caught.
uint32_t Signature16(const std::string& s) {
  uint32_t h = 2166136261u;
  for (unsigned char c : s) h = (h ^ c) * 16777619u;
  return (h ^ (h >> 16)) & 0xFFFFu;
}

// The launch parameters both ops share: the decoded attributes, the group's peer table, this rank, the workspace's
// timeout and this device's error word, and the call's signature.
template <typename Params, typename Geometry>
Params LaunchParams(const Geometry& g, const CallSite& site, int device, const std::string& signature) {
  const Workspace& ws = *site.ws;
  Params p{};
  p.attrs = g;  // the decoded attributes, as checked
  for (int r = 0; r < ws.num_ranks; ++r) p.peers.base[r] = ws.base[site.group][r];
  p.me = site.rank;
  p.num_ranks = static_cast<int>(g.num_ranks);
  p.num_tokens = g.num_tokens;
  p.timeout_ns = ws.timeout.count();
  p.signature = Signature16(signature);
  p.error = ws.cuda_error_dev[device];
  return p;
}

ffi::Error DispatchCudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer x_sf,
                            ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> weights, ffi::AnyBuffer /*after*/,
                            ffi::Result<ffi::AnyBuffer> recv_x, ffi::Result<ffi::AnyBuffer> recv_x_sf,
                            ffi::Result<ffi::Buffer<ffi::S32>> recv_ids,
                            ffi::Result<ffi::Buffer<ffi::F32>> recv_weights,
                            ffi::Result<ffi::Buffer<ffi::S32>> recv_counts,
                            ffi::Result<ffi::Buffer<ffi::S32>> send_slot, DispatchAttrs attrs) {
  DispatchGeometry g{attrs};
  CallSite site;
  if (auto e = PrepareDispatch(device, x, x_sf, ids, weights, *recv_x, *recv_x_sf, *recv_ids, *recv_weights,
                               *recv_counts, *send_slot, /*cuda=*/true, &g, &site);
      e.failure())
    return e;
  if (g.num_tokens == 0) {  // nothing to move on any rank (shapes are static): no counts to exchange either
    ScopedDevice scoped(device);
    JAX_MOE_A2A_RETURN_IF_CUDA_ERROR(scoped.error());
    JAX_MOE_A2A_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(recv_counts->typed_data(), 0, g.num_ranks * 4, stream));
    return ffi::Error::Success();
  }
  auto p = LaunchParams<DispatchParams>(g, site, device, DispatchSignature(g));
  p.top_k = g.top_k;
  p.x_row = g.x_row;
  p.sf_row = g.sf_row;
  p.x = static_cast<const uint8_t*>(x.untyped_data());
  p.x_sf = static_cast<const uint8_t*>(x_sf.untyped_data());
  p.ids = ids.typed_data();
  p.weights = weights.typed_data();
  p.recv_x = static_cast<uint8_t*>(recv_x->untyped_data());
  p.recv_sf = static_cast<uint8_t*>(recv_x_sf->untyped_data());
  p.recv_ids = recv_ids->typed_data();
  p.recv_weights = recv_weights->typed_data();
  p.recv_counts = recv_counts->typed_data();
  p.send_slot = send_slot->typed_data();
  ScopedDevice scoped(device);
  JAX_MOE_A2A_RETURN_IF_CUDA_ERROR(scoped.error());
  JAX_MOE_A2A_RETURN_IF_CUDA_ERROR(LaunchDispatch(stream, site.ws->cuda_num_sms[device], p));
  return ffi::Error::Success();
}

ffi::Error CombineCudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer expert_out,
                           ffi::Buffer<ffi::S32> recv_counts, ffi::Buffer<ffi::S32> send_slot,
                           ffi::AnyBuffer /*after*/, ffi::Result<ffi::AnyBuffer> out, CombineAttrs attrs) {
  CombineGeometry g{attrs};
  CallSite site;
  if (auto e = PrepareCombine(device, expert_out, recv_counts, send_slot, *out, /*cuda=*/true, &g, &site);
      e.failure())
    return e;
  if (g.num_tokens == 0) return ffi::Error::Success();
  auto p = LaunchParams<CombineParams>(g, site, device, CombineSignature(g));
  p.hidden = g.hidden;
  p.in_bytes = g.in_bytes;
  p.out_bytes = g.out_bytes;
  p.expert_out = static_cast<const uint8_t*>(expert_out.untyped_data());
  p.recv_counts = recv_counts.typed_data();
  p.send_slot = send_slot.typed_data();
  p.out = static_cast<uint8_t*>(out->untyped_data());
  ScopedDevice scoped(device);
  JAX_MOE_A2A_RETURN_IF_CUDA_ERROR(scoped.error());
  JAX_MOE_A2A_RETURN_IF_CUDA_ERROR(LaunchCombine(stream, site.ws->cuda_num_sms[device], p));
  return ffi::Error::Success();
}

#endif  // JAX_MOE_A2A_WITH_CUDA

}  // namespace

}  // namespace jax_moe_a2a

// The attributes of each call decode by name into DispatchAttrs / CombineAttrs. Each call's last argument, `after`,
// is never read: it is a result of an earlier call on the workspace, so that XLA starts this call only after that
// one on every device. On CPU this keeps a call that could start early (a VJP's, on a cotangent known from the
// start) from waiting at its meeting on some devices while others wait in an XLA collective.
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    jax_moe_a2a::DispatchAttrs, xla::ffi::StructMember<int64_t>("buffer_stride"),
    xla::ffi::StructMember<int64_t>("capacity"), xla::ffi::StructMember<int64_t>("num_ranks"),
    xla::ffi::StructMember<int64_t>("off_flags"), xla::ffi::StructMember<int64_t>("off_sync"),
    xla::ffi::StructMember<int64_t>("workspace"), xla::ffi::StructMember<int64_t>("site"),
    xla::ffi::StructMember<int64_t>("num_experts"),
    xla::ffi::StructMember<int64_t>("off_x"), xla::ffi::StructMember<int64_t>("off_x_sf"),
    xla::ffi::StructMember<int64_t>("off_ids"), xla::ffi::StructMember<int64_t>("off_weights"),
    xla::ffi::StructMember<int64_t>("off_counts"), xla::ffi::StructMember<int64_t>("off_ready"),
    xla::ffi::StructMember<int64_t>("off_ll"), xla::ffi::StructMember<int64_t>("off_scan"),
    xla::ffi::StructMember<int64_t>("ll_tokens"), xla::ffi::StructMember<int64_t>("ll_row_bytes"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    jax_moe_a2a::CombineAttrs, xla::ffi::StructMember<int64_t>("buffer_stride"),
    xla::ffi::StructMember<int64_t>("capacity"), xla::ffi::StructMember<int64_t>("num_ranks"),
    xla::ffi::StructMember<int64_t>("off_flags"), xla::ffi::StructMember<int64_t>("off_sync"),
    xla::ffi::StructMember<int64_t>("workspace"), xla::ffi::StructMember<int64_t>("site"),
    xla::ffi::StructMember<int64_t>("off_combine"),
    xla::ffi::StructMember<int64_t>("off_ready"));

#define JAX_MOE_A2A_DISPATCH_BINDING(platform_ctx)                        \
  xla::ffi::Ffi::Bind() platform_ctx                                      \
      .Ctx<xla::ffi::DeviceOrdinal>()         /* device */                \
      .Arg<xla::ffi::AnyBuffer>()             /* x [T, ...] */            \
      .Arg<xla::ffi::AnyBuffer>()             /* x_sf [T, ...] */         \
      .Arg<xla::ffi::Buffer<xla::ffi::S32>>() /* topk_ids [T, K] */       \
      .Arg<xla::ffi::Buffer<xla::ffi::F32>>() /* topk_weights [T, K] */   \
      .Arg<xla::ffi::AnyBuffer>()             /* after (see above) */     \
      .Ret<xla::ffi::AnyBuffer>()             /* recv_x [R, T, ...] */    \
      .Ret<xla::ffi::AnyBuffer>()             /* recv_x_sf [R, T, ...] */ \
      .Ret<xla::ffi::Buffer<xla::ffi::S32>>() /* recv_topk_ids */         \
      .Ret<xla::ffi::Buffer<xla::ffi::F32>>() /* recv_topk_weights */     \
      .Ret<xla::ffi::Buffer<xla::ffi::S32>>() /* recv_counts [R] */       \
      .Ret<xla::ffi::Buffer<xla::ffi::S32>>() /* send_slot [T, R] */      \
      .Attrs<jax_moe_a2a::DispatchAttrs>()

#define JAX_MOE_A2A_COMBINE_BINDING(platform_ctx)                          \
  xla::ffi::Ffi::Bind() platform_ctx                                       \
      .Ctx<xla::ffi::DeviceOrdinal>()         /* device */                 \
      .Arg<xla::ffi::AnyBuffer>()             /* expert_out [R, T, H] */   \
      .Arg<xla::ffi::Buffer<xla::ffi::S32>>() /* recv_counts [R] */        \
      .Arg<xla::ffi::Buffer<xla::ffi::S32>>() /* send_slot [T, R] */       \
      .Arg<xla::ffi::AnyBuffer>()             /* after (see above) */      \
      .Ret<xla::ffi::AnyBuffer>()             /* out [T, H] */             \
      .Attrs<jax_moe_a2a::CombineAttrs>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeA2aDispatchCpu, jax_moe_a2a::DispatchCpuImpl, JAX_MOE_A2A_DISPATCH_BINDING());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeA2aCombineCpu, jax_moe_a2a::CombineCpuImpl, JAX_MOE_A2A_COMBINE_BINDING());

#ifdef JAX_MOE_A2A_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeA2aDispatchCuda, jax_moe_a2a::DispatchCudaImpl,
                              JAX_MOE_A2A_DISPATCH_BINDING(.Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeA2aCombineCuda, jax_moe_a2a::CombineCudaImpl,
                              JAX_MOE_A2A_COMBINE_BINDING(.Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
#endif
