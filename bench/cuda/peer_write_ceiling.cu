// peer_write_ceiling.cu -- how fast SMs can write into a peer GPU over NVLink: the ceiling the one-sided
// dispatch/combine kernels work against.
//
// GPUs 0 and 1 each write 16384 rows of 7168 bytes (an FP8 hidden row) into the other at the same time, with
// (a) the copy engines (cudaMemcpyPeerAsync), (b) warp-wide 16-byte stores, 4 KiB (two 2 KiB pieces) loaded per
// warp before they are stored, as the dispatch senders do, (c) TMA bulk stores from shared memory; (b) and (c)
// also with a system-scope fence and a flag store after each row, as the senders raise their ready words.
// Prints the median of 10 timed runs (after 2 warm-ups) of the slower GPU, in GB/s per direction.
//
//   nvcc -arch=sm_90a -O3 -std=c++17 -o peer_write_ceiling bench/cuda/peer_write_ceiling.cu && ./peer_write_ceiling
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)

constexpr int kRow = 7168;

__device__ __forceinline__ void FenceSys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
__device__ __forceinline__ void StoreRelaxedSys(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Warp stores: each warp takes whole rows, 4 KiB at a time (loads, then stores). kFence: after each row, a
// system-scope fence and a flag store by lane 0.
template <bool kFence>
__global__ void __launch_bounds__(512) WarpStores(const uint8_t* src, uint8_t* dst, uint32_t* flags, int rows, uint32_t e) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warps = gridDim.x * 16;
  for (int r = blockIdx.x * 16 + warp; r < rows; r += warps) {
    const uint8_t* s = src + (int64_t)r * kRow;
    uint8_t* d = dst + (int64_t)r * kRow;
    for (int q = 0; q < kRow; q += 4096) {
      uint4 v[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) { int o = q + (u * 32 + lane) * 16; if (o < kRow) v[u] = *reinterpret_cast<const uint4*>(s + o); }
#pragma unroll
      for (int u = 0; u < 8; ++u) { int o = q + (u * 32 + lane) * 16; if (o < kRow) *reinterpret_cast<uint4*>(d + o) = v[u]; }
    }
    if (kFence) {
      __syncwarp();
      if (lane == 0) { FenceSys(); StoreRelaxedSys(flags + r, e); }
    }
  }
}

// TMA: each warp's lane 0 moves rows through a private smem buffer of kStages rows.
constexpr int kStages = 2;
__device__ __forceinline__ uint32_t Smem(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

template <bool kFence, int kWarpsPerBlock>
__global__ void TmaStores(const uint8_t* src, uint8_t* dst, uint32_t* flags, int rows, uint32_t e) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ __align__(8) uint64_t bars[kWarpsPerBlock][kStages];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane != 0) return;
  uint8_t* buf = smem + warp * kStages * kRow;
  for (int s = 0; s < kStages; ++s)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(Smem(&bars[warp][s])));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  const int warps = gridDim.x * kWarpsPerBlock;
  uint32_t phase[kStages] = {};
  int it = 0;
  for (int r = blockIdx.x * kWarpsPerBlock + warp; r < rows; r += warps, ++it) {
    const int s = it % kStages;
    uint8_t* b = buf + s * kRow;
    // buffer s free: wait until the store issued kStages rows ago has read it
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kStages - 1) : "memory");
    uint32_t bar = Smem(&bars[warp][s]);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(kRow) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(Smem(b)), "l"(src + (int64_t)r * kRow), "r"(kRow), "r"(bar) : "memory");
    asm volatile("{\n.reg .pred p;\nW: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra W;\n}"
                 ::"r"(bar), "r"(phase[s]) : "memory");
    phase[s] ^= 1;
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                 ::"l"(dst + (int64_t)r * kRow), "r"(Smem(b)), "r"(kRow) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    if (kFence) {
      asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
      FenceSys();
      StoreRelaxedSys(flags + r, e);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

int main() {
  const int rows = 4096 * 4;  // 117 MB per direction
  const int64_t bytes = (int64_t)rows * kRow;
  uint8_t *src[2], *dst[2];
  uint32_t* flags[2];
  cudaStream_t st[2];
  cudaEvent_t a[2], b[2];
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  for (int d = 0; d < 2; ++d) {
    CK(cudaSetDevice(d));
    CK(cudaDeviceEnablePeerAccess(1 - d, 0));
    CK(cudaMalloc(&src[d], bytes));
    CK(cudaMalloc(&dst[d], bytes));
    CK(cudaMalloc(&flags[d], rows * 4));
    CK(cudaMemset(src[d], d + 1, bytes));
    CK(cudaStreamCreate(&st[d]));
    CK(cudaEventCreate(&a[d]));
    CK(cudaEventCreate(&b[d]));
  }
  auto run = [&](const char* name, auto launch) {
    std::vector<float> ts;
    for (int i = 0; i < 12; ++i) {
      for (int d = 0; d < 2; ++d) { CK(cudaSetDevice(d)); CK(cudaStreamSynchronize(st[d])); }
      for (int d = 0; d < 2; ++d) {
        CK(cudaSetDevice(d));
        CK(cudaEventRecord(a[d], st[d]));
        launch(d, i);
        CK(cudaEventRecord(b[d], st[d]));
      }
      float worst = 0;
      for (int d = 0; d < 2; ++d) {
        CK(cudaSetDevice(d)); CK(cudaEventSynchronize(b[d]));
        float ms; CK(cudaEventElapsedTime(&ms, a[d], b[d])); worst = std::max(worst, ms);
      }
      CK(cudaGetLastError());
      if (i >= 2) ts.push_back(worst);
    }
    std::sort(ts.begin(), ts.end());
    float ms = ts[ts.size() / 2];
    printf("%-40s %8.1f us  %6.1f GB/s per direction\n", name, ms * 1e3, bytes / (ms * 1e-3) / 1e9);
  };
  // copy engine
  run("cudaMemcpyPeerAsync", [&](int d, int) { CK(cudaMemcpyPeerAsync(dst[1 - d], 1 - d, src[d], d, bytes, st[d])); });
  for (int blocks : {sms / 2, sms}) {
    char n[64];
    snprintf(n, 64, "warp stores, %d blocks", blocks);
    run(n, [&](int d, int i) { WarpStores<false><<<blocks, 512, 0, st[d]>>>(src[d], dst[1 - d], flags[1 - d], rows, i); });
    snprintf(n, 64, "warp stores + fence/row, %d blocks", blocks);
    run(n, [&](int d, int i) { WarpStores<true><<<blocks, 512, 0, st[d]>>>(src[d], dst[1 - d], flags[1 - d], rows, i); });
  }
  constexpr int kW = 8;
  const int smem = kW * kStages * kRow;  // 114 KB
  CK(cudaSetDevice(0)); CK(cudaFuncSetAttribute(TmaStores<false, kW>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CK(cudaFuncSetAttribute(TmaStores<true, kW>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CK(cudaSetDevice(1)); CK(cudaFuncSetAttribute(TmaStores<false, kW>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CK(cudaFuncSetAttribute(TmaStores<true, kW>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  for (int blocks : {sms / 4, sms / 2, sms}) {
    char n[64];
    snprintf(n, 64, "TMA, 8 warps x 2 stages, %d blocks", blocks);
    run(n, [&](int d, int i) { TmaStores<false, kW><<<blocks, kW * 32, smem, st[d]>>>(src[d], dst[1 - d], flags[1 - d], rows, i); });
    snprintf(n, 64, "TMA + wait/fence/row, %d blocks", blocks);
    run(n, [&](int d, int i) { TmaStores<true, kW><<<blocks, kW * 32, smem, st[d]>>>(src[d], dst[1 - d], flags[1 - d], rows, i); });
  }
  // check data
  std::vector<uint8_t> h(1024);
  for (int d = 0; d < 2; ++d) {
    CK(cudaSetDevice(d));
    CK(cudaMemcpy(h.data(), dst[d] + bytes - 1024, 1024, cudaMemcpyDeviceToHost));
    printf("dst[%d] last bytes = %d (want %d)\n", d, h[1023], 2 - d);
  }
  return 0;
}
