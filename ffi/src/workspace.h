// workspace.h -- the one-sided communication memory of every device on an expert axis, and its registry.
//
// NOTES:
//   - A workspace is created once, outside jit, from Python (a2a.Workspace.create): it allocates one block per
//     device (host memory for simulated CPU devices, cudaMalloc for GPUs, with peer access enabled between the
//     GPUs of a group) and registers it under an id. Handlers find it by that id; they never allocate and never
//     enable peer access.
//   - One process per GPU (jax.distributed): a group's devices of other processes are -1 in the table; their
//     blocks are allocated by their own process and mapped here through CUDA IPC handles, which Python exchanges
//     through JAX's distributed key-value store (CUDA IPC needs nothing beyond the CUDA runtime and works for
//     any device pair with peer access; NCCL windows would add a communicator for no gain here).
//   - Devices are organised in groups (one per expert-axis instance of the mesh: a (data, expert) mesh has one
//     group per data index); within a group a device has a rank. A device belongs to at most one group.
//   - Region offsets come from jax_moe_a2a.layout.workspace_layout through the handlers' attributes; this file
//     knows only total sizes and checks every access range against them.
//   - After a peer misses a rendezvous (CPU) or a bounded wait expires (GPU), the workspace is marked failed: its
//     buffers may hold a half-finished exchange, so every later call on it reports the failure. Other
//     workspaces, and the process, stay usable; close it and create a new one.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jax_moe_a2a {

namespace ffi = xla::ffi;

// Which collective a call belongs to: each has its own call counter (buffer parity) and flags.
enum class A2aOp : int { kDispatch = 0, kCombine = 1 };
constexpr int kNumA2aOps = 2;

// A process-wide meeting point for the simulated CPU devices of one group, with a time bound. Every arrival
// brings a signature (op, shapes, attributes); the generation completes only if all signatures agree.
class Rendezvous {
 public:
  explicit Rendezvous(int num_ranks) : num_ranks_(num_ranks), arrived_(num_ranks, false), signatures_(num_ranks) {}
  // Waits until every rank of the group has arrived, at most `timeout`; fails every rank of a meeting whose ranks
  // arrived with different signatures, naming the ranks of each signature.
  ffi::Error Arrive(int rank, const std::string& signature, std::chrono::nanoseconds timeout,
                    const std::string& op_name);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  const int num_ranks_;
  int count_ = 0;
  uint64_t generation_ = 0;
  std::vector<bool> arrived_;
  std::vector<std::string> signatures_;  // [rank], of this meeting
  std::string last_mismatch_;            // of the previous meeting, read by its waiters; empty when they agreed
};

struct Workspace {
  int64_t id = 0;
  bool cuda = false;
  int num_ranks = 0;
  size_t bytes = 0;  // per device
  std::chrono::nanoseconds timeout{0};
  std::vector<std::vector<int>> devices;  // [group][rank] -> device ordinal
  std::map<int, std::pair<int, int>> slot_of_device;  // ordinal -> (group, rank)
  std::vector<std::vector<uint8_t*>> base;            // [group][rank] -> memory (host or device)
  // CPU only.
  std::vector<std::unique_ptr<uint8_t[]>> host_blocks;
  std::vector<std::unique_ptr<Rendezvous>> rendezvous;       // per group
  std::map<int, std::array<uint64_t, kNumA2aOps>> calls;     // per device ordinal, touched by its thread only
  // CUDA only: per device, a host-mapped word the kernels set when a bounded wait expires (0: fine,
  // 1 + source rank: that source did not arrive in time).
  std::vector<int*> cuda_error_host;                         // [device index in flat order]
  std::vector<int*> cuda_error_dev;
  std::vector<int> cuda_num_sms;                             // per device ordinal
  std::vector<std::pair<int, void*>> ipc_opened;             // (local device, peer block mapped through CUDA IPC)
  // Failure, sticky.
  std::atomic<bool> failed{false};
  std::mutex failure_mu;
  std::string failure;

  void Fail(const std::string& why);
  // The failure so far (after polling the GPUs' error words), or "".
  std::string Failure();
  // Turns a nonzero GPU error word into the workspace's failure.
  void PollDeviceErrors();
};

// Registry: handlers look workspaces up by id.
std::shared_ptr<Workspace> FindWorkspace(int64_t id);
int64_t RegisterWorkspace(std::shared_ptr<Workspace> ws);
std::shared_ptr<Workspace> UnregisterWorkspace(int64_t id);

// Resolves (workspace, group, rank, base) for a call on `device`, checking that the workspace is usable and
// that [0, needed_bytes) fits every block.
struct CallSite {
  std::shared_ptr<Workspace> ws;
  int group = 0;
  int rank = 0;
};
ffi::Error ResolveCallSite(const char* op, int64_t ws_id, int device, int64_t num_ranks, int64_t needed_bytes,
                           bool cuda, CallSite* site);

}  // namespace jax_moe_a2a
