// workspace.h -- the one-sided communication memory of every device on an expert axis, and its registry.
//
// NOTES:
//   - A workspace is created once, outside jit, from Python (a2a.Workspace.create): for GPUs it allocates one block
//     per device (cudaMalloc, with peer access enabled between the GPUs of a group), for simulated CPU devices the
//     meeting points of each group (their ranks read each other's inputs there: no block), and registers it under
//     an id. Handlers find it by that id; they never allocate and never enable peer access.
//   - One process per GPU (jax.distributed): a group's devices of other processes are -1 in the table; their
//     blocks are allocated by their own process and mapped here through CUDA IPC handles, which Python exchanges
//     through JAX's distributed key-value store (CUDA IPC needs nothing beyond the CUDA runtime and works for
//     any device pair with peer access; NCCL windows would add a communicator for no gain here).
//   - Devices are organised in groups (one per expert-axis instance of the mesh: a (data, expert) mesh has one
//     group per data index); within a group a device has a rank. A device belongs to at most one group.
//   - Region offsets come from jax_moe_a2a.layout.workspace_layout through the handlers' attributes; this file
//     knows only total sizes and checks every access range against them (on CPU too, against the size the layout
//     gave, so that CI checks the attributes the GPUs get).
//   - After a peer misses a meeting (CPU) or a bounded wait expires (GPU), the workspace is marked failed: its
//     buffers may hold a half-finished exchange, so every later call on it reports the failure. Other
//     workspaces, and the process, stay usable; close it and create a new one.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jax_moe_a2a {

namespace ffi = xla::ffi;

// Where the simulated CPU devices of one group meet: one meeting per call, named by the call's site (a trace-time id
// that every device's program shares) and its occurrence on each rank, so calls pair by identity, whatever order
// XLA:CPU runs a device's independent ops in (any, and concurrently). Each rank brings a signature (op, shapes,
// attributes) and a pointer to its contribution (its inputs); Gather hands every rank all contributions once all have
// come, and Leave returns once every rank has finished reading them, so none is released while a peer reads it.
class Meetings {
 public:
  // A rank's place at one meeting, from Gather for Leave.
  struct Ticket {
    int64_t site = 0;
    uint64_t occurrence = 0;
  };

  explicit Meetings(int num_ranks) : num_ranks_(num_ranks) {}

  // Waits until every rank of the group has come to this rank's next meeting at `site`, at most `timeout`, and leaves
  // their contributions in all[rank]. Fails, without a meeting to leave, when the wait expires (naming the ranks that
  // did not come, and where they wait instead) or when the ranks came with different signatures (naming the ranks of
  // each).
  ffi::Error Gather(int64_t site, int rank, const std::string& signature, const void* contribution,
                    std::chrono::nanoseconds timeout, const std::string& op_name, Ticket* ticket,
                    std::vector<const void*>* all);
  // Returns once every rank of the meeting has called Leave (after a successful Gather).
  void Leave(const Ticket& ticket);

 private:
  struct Meeting {
    std::vector<bool> came;
    std::vector<std::string> signatures;
    std::vector<const void*> contributions;
    int count = 0;   // ranks that came
    int left = 0;    // ranks done reading
    int inside = 0;  // ranks in Gather or between Gather and the end of Leave
    bool complete = false;
    bool expired = false;  // a rank stopped waiting: the meeting can no longer complete
    std::string mismatch;  // set at completion when the signatures differ
  };
  using Key = std::pair<int64_t, uint64_t>;  // (site, occurrence)

  // "; rank 3 waited at another call instead: {op=dispatch T=1 ...}" for each rank in `missing` found at another
  // meeting that did not complete.
  std::string WhereTheyWait(const Key& key, const std::vector<int>& missing) const;
  void Exit(const Key& key, Meeting& m);

  std::mutex mu_;
  std::condition_variable cv_;
  const int num_ranks_;
  std::map<std::pair<int64_t, int>, uint64_t> next_;  // (site, rank) -> its next occurrence
  std::map<Key, Meeting> meetings_;
};

struct Workspace {
  int64_t id = 0;
  bool cuda = false;
  int num_ranks = 0;
  size_t bytes = 0;  // per device
  std::chrono::nanoseconds timeout{0};
  std::vector<std::vector<int>> devices;  // [group][rank] -> device ordinal
  std::map<int, std::pair<int, int>> slot_of_device;  // ordinal -> (group, rank)
  std::vector<std::vector<uint8_t*>> base;            // [group][rank] -> device memory (CUDA only)
  // CPU only: the meetings of each group (no memory: the ranks read each other's inputs at the meeting).
  std::vector<std::unique_ptr<Meetings>> meetings;          // per group
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

// The registry's entry points from Python (module.cc): each returns "" on success or the error's message.
std::string CreateCpuWorkspace(const std::vector<std::vector<int>>& devices, size_t bytes, int64_t timeout_ns,
                               int64_t* id);
#ifdef JAX_MOE_A2A_WITH_CUDA
std::string CreateCudaWorkspace(const std::vector<std::vector<int>>& devices, size_t bytes, int64_t timeout_ns,
                                int64_t* id);
std::string IpcHandles(int64_t id, std::map<int, std::string>* handles);
std::string OpenIpcPeers(int64_t id, const std::map<std::pair<int, int>, std::string>& handles);
#endif
std::string DestroyWorkspace(int64_t id);

}  // namespace jax_moe_a2a
