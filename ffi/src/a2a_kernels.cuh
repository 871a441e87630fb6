// a2a_kernels.cuh -- launchers of the one-sided dispatch/combine kernels (implemented in a2a_kernels.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "a2a_protocol.h"

namespace jax_moe_a2a {

struct PeerBases {
  uint8_t* base[kMaxRanks];  // every rank's workspace block, valid on every GPU of the group (peer access)
};

// What a launch needs: the call's decoded attributes as the handler checked them, and what the handler adds (peer
// table, rank, the shapes of its buffers, their addresses, the workspace's timeout and error word).
struct DispatchParams {
  DispatchAttrs attrs;
  PeerBases peers;
  int me, num_ranks;  // num_ranks: attrs.num_ranks, as the int the kernels compute with
  int64_t num_tokens, top_k, x_row, sf_row;  // x_row, sf_row: bytes per row
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
  int64_t timeout_ns;
  int senders;  // blocks [0, senders) of the grid send, the rest receive (set by the launcher)
  uint32_t signature;  // 16 bits: a hash of the call's shapes, equal on every rank of a correct program
  int* error;          // host-mapped error word of this device
};

struct CombineParams {
  CombineAttrs attrs;
  PeerBases peers;
  int me, num_ranks;
  int64_t num_tokens, hidden, in_bytes, out_bytes;
  const uint8_t* expert_out;
  const int32_t* recv_counts;
  const int32_t* send_slot;
  uint8_t* out;
  int64_t timeout_ns;
  int senders;  // blocks [0, senders) of the grid send, the rest reduce (set by the launcher)
  uint32_t signature;
  int* error;
};

cudaError_t LaunchDispatch(cudaStream_t stream, int num_sms, DispatchParams p);
cudaError_t LaunchCombine(cudaStream_t stream, int num_sms, CombineParams p);

}  // namespace jax_moe_a2a
