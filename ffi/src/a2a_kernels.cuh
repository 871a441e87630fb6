// a2a_kernels.cuh -- launchers of the one-sided dispatch/combine kernels (implemented in a2a_kernels.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "a2a_protocol.h"

namespace jax_moe_a2a {

struct PeerBases {
  uint8_t* base[kMaxRanks];  // every rank's workspace block, valid on every GPU of the group (peer access)
};

struct DispatchParams {
  PeerBases peers;
  int me, num_ranks;
  int64_t capacity, num_tokens, top_k, num_experts, x_row, sf_row;
  const uint8_t* x;
  const uint8_t* x_sf;
  const int32_t* ids;
  const float* weights;
  uint8_t* recv_x;
  uint8_t* recv_sf;
  int32_t* recv_ids;
  float* recv_weights;
  int32_t* recv_counts;
  int32_t* send_slot;
  int64_t off_x, off_sf, off_ids, off_weights, off_counts, off_ready, buffer_stride, off_flags, off_sync;
  // LL form (layout.LL_MAX_TOKENS): calls of at most ll_tokens tokens send peers their rows as ll_row-byte rows of
  // 8-byte units at off_ll; ll_tokens 0: never.
  int64_t off_ll, ll_tokens, ll_row;
  // Scan region of this rank's block: [kScanBlocks, num_ranks] uint64 counts of the sender blocks (large calls).
  int64_t off_scan;
  int64_t timeout_ns;
  int senders;  // blocks [0, senders) of the grid send, the rest receive (set by the launcher)
  uint32_t signature;  // 16 bits: a hash of the call's shapes, equal on every rank of a correct program
  int* error;          // host-mapped error word of this device
};

struct CombineParams {
  PeerBases peers;
  int me, num_ranks;
  int64_t capacity, num_tokens, hidden, in_bytes, out_bytes;
  const uint8_t* expert_out;
  const int32_t* recv_counts;
  const int32_t* send_slot;
  uint8_t* out;
  int64_t off_combine, off_ready, buffer_stride, off_flags, off_sync;
  int64_t timeout_ns;
  int senders;  // blocks [0, senders) of the grid send, the rest reduce (set by the launcher)
  uint32_t signature;
  int* error;
};

cudaError_t LaunchDispatch(cudaStream_t stream, int num_sms, DispatchParams p);
cudaError_t LaunchCombine(cudaStream_t stream, int num_sms, CombineParams p);

}  // namespace jax_moe_a2a
