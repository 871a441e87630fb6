// workspace.cc -- workspace registry, CPU meetings, and creation/destruction of workspaces (CPU and CUDA).
#include "workspace.h"

#include "a2a_protocol.h"

#include <algorithm>
#include <cstring>
#include <sstream>

#ifdef JAX_MOE_A2A_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace jax_moe_a2a {

// ---------------------------------------------------------------------------------------------------------------
// Meetings (CPU)
// ---------------------------------------------------------------------------------------------------------------

ffi::Error Meetings::Gather(int64_t site, int rank, const std::string& signature, const void* contribution,
                            std::chrono::nanoseconds timeout, const std::string& op_name, Ticket* ticket,
                            std::vector<const void*>* all) {
  std::unique_lock<std::mutex> lock(mu_);
  const Key key{site, next_[{site, rank}]++};
  Meeting& m = meetings_[key];  // std::map: the reference stays valid while other meetings come and go
  if (m.came.empty()) {
    m.came.assign(num_ranks_, false);
    m.signatures.resize(num_ranks_);
    m.contributions.resize(num_ranks_);
  }
  if (m.expired) {  // came too late: the others stopped waiting (and the workspace is failed)
    return ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                      op_name + ": rank " + std::to_string(rank) + " came to a call its expert group stopped waiting for");
  }
  m.came[rank] = true;
  m.signatures[rank] = signature;
  m.contributions[rank] = contribution;
  ++m.inside;
  if (++m.count == num_ranks_) {
    if (std::any_of(m.signatures.begin(), m.signatures.end(), [&](const std::string& s) { return s != signature; })) {
      // "ranks [0, 1] {sig A}; ranks [2] {sig B}", signatures in the order of their lowest rank.
      std::ostringstream os;
      os << op_name << ": ranks of one expert group called with different arguments:";
      std::vector<bool> listed(num_ranks_, false);
      for (int r = 0; r < num_ranks_; ++r) {
        if (listed[r]) continue;
        os << (r == 0 ? " ranks [" : "; ranks [");
        for (int q = r, n = 0; q < num_ranks_; ++q) {
          if (m.signatures[q] != m.signatures[r]) continue;
          listed[q] = true;
          os << (n++ ? ", " : "") << q;
        }
        os << "] {" << m.signatures[r] << "}";
      }
      m.mismatch = os.str();
    }
    m.complete = true;
    cv_.notify_all();
  } else if (!cv_.wait_for(lock, timeout, [&] { return m.complete; })) {
    // This meeting can no longer complete correctly: the caller marks the workspace failed, a rank that comes later
    // is turned away, and every rank still waiting here reports the same missing ranks.
    m.expired = true;
    std::vector<int> missing;
    std::ostringstream names;
    for (int r = 0; r < num_ranks_; ++r) {
      if (m.came[r]) continue;
      names << (missing.empty() ? "" : ", ") << r;
      missing.push_back(r);
    }
    std::ostringstream os;
    os << op_name << ": rank " << rank << " waited " << std::chrono::duration<double>(timeout).count()
       << " s for rank(s) [" << names.str() << "] of its expert group, which did not arrive"
       << WhereTheyWait(key, missing);
    Exit(key, m);
    return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, os.str());
  }
  if (!m.mismatch.empty()) {
    std::string mismatch = m.mismatch;
    Exit(key, m);
    return ffi::Error::InvalidArgument(mismatch);
  }
  *ticket = Ticket{key.first, key.second};
  *all = m.contributions;
  return ffi::Error::Success();
}

void Meetings::Leave(const Ticket& ticket) {
  std::unique_lock<std::mutex> lock(mu_);
  const Key key{ticket.site, ticket.occurrence};
  Meeting& m = meetings_.at(key);
  if (++m.left == num_ranks_) cv_.notify_all();
  // Every rank came, so every rank leaves: it only copies from the contributions in between.
  cv_.wait(lock, [&] { return m.left == num_ranks_; });
  Exit(key, m);
}

void Meetings::Exit(const Key& key, Meeting& m) {
  // An expired meeting stays, so that a rank coming to it later is turned away rather than left to wait alone.
  if (--m.inside == 0 && !m.expired) meetings_.erase(key);
}

std::string Meetings::WhereTheyWait(const Key& key, const std::vector<int>& missing) const {
  std::ostringstream os;
  for (int r : missing) {
    for (const auto& [other, m] : meetings_) {
      if (other == key || m.complete || !m.came[r]) continue;
      os << "; rank " << r << " waited at another call instead: {" << m.signatures[r] << "}";
      break;
    }
  }
  return os.str();
}

// ---------------------------------------------------------------------------------------------------------------
// Workspace and registry
// ---------------------------------------------------------------------------------------------------------------

void Workspace::Fail(const std::string& why) {
  std::lock_guard<std::mutex> lock(failure_mu);
  if (!failed.load()) failure = why;
  failed.store(true);
}

std::string Workspace::Failure() {
  PollDeviceErrors();
  std::lock_guard<std::mutex> lock(failure_mu);
  return failure;
}

void Workspace::PollDeviceErrors() {
  if (!cuda || failed.load()) return;
  for (const auto& [device, where] : slot_of_device) {
    const int code = *reinterpret_cast<volatile int*>(cuda_error_host[device]);
    if (code == 0) continue;
    const int rank = where.second;
    if (code >= kErrorMismatchBase) {
      Fail("rank " + std::to_string(rank) + " (GPU " + std::to_string(device) + ") found that rank " +
           std::to_string(code - kErrorMismatchBase) + " of its expert group called with different arguments");
    } else {
      Fail("rank " + std::to_string(rank) + " (GPU " + std::to_string(device) + ") waited longer than " +
           std::to_string(std::chrono::duration<double>(timeout).count()) + " s for rank " +
           std::to_string(code - kErrorTimeoutBase) + " of its expert group, which did not arrive");
    }
    return;
  }
}

namespace {
std::mutex g_registry_mu;
std::map<int64_t, std::shared_ptr<Workspace>> g_registry;
int64_t g_next_id = 1;
}  // namespace

std::shared_ptr<Workspace> FindWorkspace(int64_t id) {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  auto it = g_registry.find(id);
  return it == g_registry.end() ? nullptr : it->second;
}

int64_t RegisterWorkspace(std::shared_ptr<Workspace> ws) {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  ws->id = g_next_id++;
  g_registry[ws->id] = ws;
  return ws->id;
}

std::shared_ptr<Workspace> UnregisterWorkspace(int64_t id) {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  auto it = g_registry.find(id);
  if (it == g_registry.end()) return nullptr;
  auto ws = it->second;
  g_registry.erase(it);
  return ws;
}

ffi::Error ResolveCallSite(const char* op, int64_t ws_id, int device, int64_t num_ranks, int64_t needed_bytes,
                           bool cuda, CallSite* site) {
  site->ws = FindWorkspace(ws_id);
  Workspace* ws = site->ws.get();
  if (ws == nullptr) {
    return ffi::Error::InvalidArgument(std::string(op) + ": workspace " + std::to_string(ws_id) +
                                       " does not exist (closed, or never created in this process)");
  }
  if (ws->cuda != cuda) {
    return ffi::Error::InvalidArgument(std::string(op) + ": workspace " + std::to_string(ws_id) + " was created for " +
                                       (ws->cuda ? "GPUs" : "CPU devices") + ", called on " +
                                       (cuda ? "a GPU" : "a CPU device"));
  }
  ws->PollDeviceErrors();
  if (ws->failed.load()) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      std::string(op) + ": workspace " + std::to_string(ws_id) + " is unusable after an earlier "
                      "failure (" + ws->Failure() + "); close it and create a new one");
  }
  auto it = ws->slot_of_device.find(device);
  if (it == ws->slot_of_device.end()) {
    return ffi::Error::InvalidArgument(std::string(op) + ": device " + std::to_string(device) +
                                       " is not part of workspace " + std::to_string(ws_id));
  }
  site->group = it->second.first;
  site->rank = it->second.second;
  if (num_ranks != ws->num_ranks) {
    return ffi::Error::InvalidArgument(std::string(op) + ": num_ranks must be the workspace's " +
                                       std::to_string(ws->num_ranks) + ", got " + std::to_string(num_ranks));
  }
  if (needed_bytes < 0 || static_cast<size_t>(needed_bytes) > ws->bytes) {
    return ffi::Error::InvalidArgument(std::string(op) + ": the call needs " + std::to_string(needed_bytes) +
                                       " workspace bytes per device, workspace " + std::to_string(ws_id) +
                                       " has " + std::to_string(ws->bytes) + " (too small; size it with "
                                       "layout.workspace_layout for this call's shapes)");
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------------------------
// Creation and destruction (host side, outside jit)
// ---------------------------------------------------------------------------------------------------------------

namespace {

std::string CheckGroups(const std::vector<std::vector<int>>& devices) {
  if (devices.empty() || devices[0].empty()) return "devices must be a non-empty [groups][ranks] table";
  std::map<int, int> seen;
  for (const auto& group : devices) {
    if (group.size() != devices[0].size()) return "every group must have the same number of ranks";
    for (int d : group) {
      if (d < -1) return "device ordinals must be >= 0 (or -1 for a device of another process)";
      if (d >= 0 && seen[d]++) return "device " + std::to_string(d) + " appears twice";
    }
  }
  return "";
}

std::shared_ptr<Workspace> NewWorkspace(const std::vector<std::vector<int>>& devices, size_t bytes,
                                        int64_t timeout_ns, bool cuda) {
  auto ws = std::make_shared<Workspace>();
  ws->cuda = cuda;
  ws->num_ranks = static_cast<int>(devices[0].size());
  ws->bytes = bytes;
  ws->timeout = std::chrono::nanoseconds(timeout_ns);
  ws->devices = devices;
  ws->base.assign(devices.size(), std::vector<uint8_t*>(ws->num_ranks, nullptr));
  for (size_t g = 0; g < devices.size(); ++g) {
    for (int r = 0; r < ws->num_ranks; ++r) {
      if (devices[g][r] < 0) continue;  // another process's device
      ws->slot_of_device[devices[g][r]] = {static_cast<int>(g), r};
    }
  }
  return ws;
}

}  // namespace

std::string CreateCpuWorkspace(const std::vector<std::vector<int>>& devices, size_t bytes, int64_t timeout_ns,
                               int64_t* id) {
  if (std::string err = CheckGroups(devices); !err.empty()) return err;
  for (const auto& group : devices)
    for (int d : group)
      if (d < 0) return "simulated CPU devices of one expert group must all belong to this process";
  auto ws = NewWorkspace(devices, bytes, timeout_ns, /*cuda=*/false);
  for (size_t g = 0; g < devices.size(); ++g) ws->meetings.push_back(std::make_unique<Meetings>(ws->num_ranks));
  *id = RegisterWorkspace(ws);
  return "";
}

#ifdef JAX_MOE_A2A_WITH_CUDA

namespace {
std::string CudaMessage(const char* what, cudaError_t err) {
  return std::string(what) + " failed: " + cudaGetErrorString(err);
}

void FreeCuda(Workspace* ws) {
  for (const auto& [device, ptr] : ws->ipc_opened) {  // peers' blocks mapped from other processes
    cudaSetDevice(device);
    cudaIpcCloseMemHandle(ptr);
  }
  ws->ipc_opened.clear();
  for (size_t g = 0; g < ws->devices.size(); ++g) {
    for (int r = 0; r < ws->num_ranks; ++r) {
      if (ws->devices[g][r] < 0) {
        ws->base[g][r] = nullptr;
      } else if (ws->base[g][r] != nullptr) {
        cudaSetDevice(ws->devices[g][r]);
        cudaFree(ws->base[g][r]);
        ws->base[g][r] = nullptr;
      }
    }
  }
  for (int* p : ws->cuda_error_host) cudaFreeHost(p);
  ws->cuda_error_host.clear();
  ws->cuda_error_dev.clear();
}
}  // namespace

std::string CreateCudaWorkspace(const std::vector<std::vector<int>>& devices, size_t bytes, int64_t timeout_ns,
                                int64_t* id) {
  if (std::string err = CheckGroups(devices); !err.empty()) return err;
  auto ws = NewWorkspace(devices, bytes, timeout_ns, /*cuda=*/true);
  int previous = 0;
  cudaGetDevice(&previous);
  std::string err;
  int max_ordinal = 0;
  for (const auto& group : devices)
    for (int d : group) max_ordinal = std::max(max_ordinal, d);
  ws->cuda_num_sms.assign(max_ordinal + 1, 0);
  ws->cuda_error_host.assign(max_ordinal + 1, nullptr);
  ws->cuda_error_dev.assign(max_ordinal + 1, nullptr);
  for (size_t g = 0; g < devices.size() && err.empty(); ++g) {
    for (int r = 0; r < ws->num_ranks && err.empty(); ++r) {
      const int d = devices[g][r];
      if (d < 0) continue;  // allocated by its own process, mapped later (OpenIpcPeers)
      cudaError_t e;
      if ((e = cudaSetDevice(d)) != cudaSuccess) { err = CudaMessage("cudaSetDevice", e); break; }
      cudaDeviceGetAttribute(&ws->cuda_num_sms[d], cudaDevAttrMultiProcessorCount, d);
      void* p = nullptr;
      if ((e = cudaMalloc(&p, bytes)) != cudaSuccess) { err = CudaMessage("cudaMalloc", e); break; }
      ws->base[g][r] = static_cast<uint8_t*>(p);
      if ((e = cudaMemset(p, 0, bytes)) != cudaSuccess) { err = CudaMessage("cudaMemset", e); break; }
      int* host = nullptr;
      if ((e = cudaHostAlloc(reinterpret_cast<void**>(&host), sizeof(int),
                             cudaHostAllocMapped | cudaHostAllocPortable)) != cudaSuccess) {
        err = CudaMessage("cudaHostAlloc", e);
        break;
      }
      *host = 0;
      ws->cuda_error_host[d] = host;
      int* dev = nullptr;
      if ((e = cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev), host, 0)) != cudaSuccess) {
        err = CudaMessage("cudaHostGetDevicePointer", e);
        break;
      }
      ws->cuda_error_dev[d] = dev;
      for (int peer : devices[g]) {
        if (peer == d || peer < 0) continue;
        int can = 0;
        cudaDeviceCanAccessPeer(&can, d, peer);
        if (!can) {
          err = "GPU " + std::to_string(d) + " cannot access GPU " + std::to_string(peer) + " as a peer";
          break;
        }
        e = cudaDeviceEnablePeerAccess(peer, 0);
        if (e == cudaErrorPeerAccessAlreadyEnabled) {
          cudaGetLastError();
        } else if (e != cudaSuccess) {
          err = CudaMessage("cudaDeviceEnablePeerAccess", e);
          break;
        }
      }
    }
  }
  for (const auto& group : devices) {
    for (int d : group) {
      if (d < 0) continue;
      cudaSetDevice(d);
      cudaError_t e = cudaDeviceSynchronize();
      if (err.empty() && e != cudaSuccess) err = CudaMessage("cudaDeviceSynchronize", e);
    }
  }
  cudaSetDevice(previous);
  if (!err.empty()) {
    FreeCuda(ws.get());
    return err;
  }
  *id = RegisterWorkspace(ws);
  return "";
}
std::string IpcHandles(int64_t id, std::map<int, std::string>* handles) {
  auto ws = FindWorkspace(id);
  if (ws == nullptr || !ws->cuda) return "no CUDA workspace " + std::to_string(id);
  for (const auto& [device, where] : ws->slot_of_device) {
    cudaIpcMemHandle_t h;
    cudaSetDevice(device);
    cudaError_t e = cudaIpcGetMemHandle(&h, ws->base[where.first][where.second]);
    if (e != cudaSuccess) return CudaMessage("cudaIpcGetMemHandle", e);
    (*handles)[device] = std::string(reinterpret_cast<const char*>(&h), sizeof(h));
  }
  return "";
}

std::string OpenIpcPeers(int64_t id, const std::map<std::pair<int, int>, std::string>& handles) {
  auto ws = FindWorkspace(id);
  if (ws == nullptr || !ws->cuda) return "no CUDA workspace " + std::to_string(id);
  int previous = 0;
  cudaGetDevice(&previous);
  std::string err;
  for (const auto& [where, bytes] : handles) {
    const auto [g, r] = where;
    if (g < 0 || g >= static_cast<int>(ws->devices.size()) || r < 0 || r >= ws->num_ranks || ws->devices[g][r] >= 0) {
      err = "peer (" + std::to_string(g) + ", " + std::to_string(r) + ") is not a device of another process";
      break;
    }
    int local = -1, locals = 0;
    for (int d : ws->devices[g]) {
      if (d >= 0) local = d, ++locals;
    }
    if (locals != 1) {
      err = "an expert group that spans processes must have exactly one device in each process, group " +
            std::to_string(g) + " has " + std::to_string(locals) + " here";
      break;
    }
    if (bytes.size() != sizeof(cudaIpcMemHandle_t)) {
      err = "malformed IPC handle";
      break;
    }
    cudaIpcMemHandle_t h;
    std::memcpy(&h, bytes.data(), sizeof(h));
    cudaSetDevice(local);
    void* p = nullptr;
    cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
      err = CudaMessage("cudaIpcOpenMemHandle", e);
      break;
    }
    ws->base[g][r] = static_cast<uint8_t*>(p);
    ws->ipc_opened.emplace_back(local, p);
  }
  cudaSetDevice(previous);
  return err;
}
#endif

std::string DestroyWorkspace(int64_t id) {
  auto ws = UnregisterWorkspace(id);
  if (ws == nullptr) return "";  // closing twice is harmless
#ifdef JAX_MOE_A2A_WITH_CUDA
  if (ws->cuda) {
    int previous = 0;
    cudaGetDevice(&previous);
    for (const auto& group : ws->devices) {
      for (int d : group) {
        if (d < 0) continue;
        cudaSetDevice(d);
        cudaDeviceSynchronize();  // no kernel may still touch the memory
      }
    }
    FreeCuda(ws.get());
    cudaSetDevice(previous);
  }
#endif
  return "";
}

}  // namespace jax_moe_a2a
