// a2a_protocol.h -- constants of the one-sided protocol shared by host code and kernels.
#pragma once

#include <cstdint>

namespace jax_moe_a2a {

// Ranks of one expert group that the GPU kernels' peer table holds.
constexpr int kMaxRanks = 64;

// Sync region, per op: {epoch, arrivals of the kernel's blocks, spare, spare} uint64. Flags: [op][source rank]
// uint64 = (epoch << 16) | call signature.
constexpr int kSyncWords = 4;
// The last word of the dispatch op holds this device's error code (below) in device memory: waiting threads
// poll it there, never the host-mapped error word, whose reads cross PCIe and stall every poller behind them.
constexpr int kSyncAbortWord = 3;

// Dispatch sender blocks of one call at most: each has a uint64 count word per rank in the scan region, which
// layout.SCAN_BLOCKS sizes (tests/test_layout.py checks the two against each other through `scan_blocks`).
constexpr int kScanBlocks = 256;

// Rows cross in pieces of kPieceBytes; each piece of a receive slot has a uint32 ready word (the epoch of the
// call that filled it) in the ready regions. layout.PIECE_BYTES states the same size (tests/test_layout.py checks
// the two against each other through the extension's `piece_bytes`).
constexpr int64_t kPieceBytes = 2048;
constexpr int64_t Pieces(int64_t row_bytes) {
  return row_bytes <= kPieceBytes ? 1 : (row_bytes + kPieceBytes - 1) / kPieceBytes;
}

// Error word values written by the kernels (host-mapped, sticky until the workspace is closed).
constexpr int kErrorTimeoutBase = 1;         // + source rank: that source did not raise its flag in time
constexpr int kErrorMismatchBase = 1 << 16;  // + source rank: that source called with other arguments

// The attributes of a call (a2a.Workspace.attrs), decoded by name at the end of a2a.cc; members in that
// decoding's order. Offsets are workspace byte offsets of buffer 0 (buffer b adds b * buffer_stride).
struct DispatchAttrs {
  int64_t buffer_stride, capacity, num_ranks, off_flags, off_sync, workspace;
  int64_t site;  // the call site: a trace-time id, the same in every device's program (CPU meetings)
  int64_t num_experts;
  int64_t off_x, off_x_sf, off_ids, off_weights, off_counts, off_ready;
  int64_t off_ll;    // LL rows (layout.LL_MAX_TOKENS): calls of at most ll_tokens tokens, ll_row_bytes per row
  int64_t off_scan;  // the sender blocks' counts: [kScanBlocks, num_ranks] uint64 (GPU kernels)
  int64_t ll_tokens, ll_row_bytes;
};

struct CombineAttrs {
  int64_t buffer_stride, capacity, num_ranks, off_flags, off_sync, workspace;
  int64_t site;
  int64_t off_combine, off_ready;
};

}  // namespace jax_moe_a2a
