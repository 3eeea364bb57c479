// Can the megakernel's attention hop run inside thread-block clusters? (docs/megakernel-log.md: cluster_probe.cu)
// A probe with the megakernel's block shape (512 threads, the opt-in maximum of dynamic shared memory):
//   1. cudaOccupancyMaxActiveClusters for cluster sizes 1, 2, 4, 8 (and 16, non-portable): how many blocks a grid of
//      whole clusters can keep co-resident (the megakernel needs every block resident: one per SM);
//   2. a cooperative launch (cudaLaunchAttributeCooperative) WITH a cluster dimension, through cudaLaunchKernelEx:
//      is it accepted, and do a grid-wide counter barrier, a cluster barrier and a distributed-shared-memory store
//      (mapa + st.shared::cluster) work in it;
//   3. the hop's cost: rank 0 of each cluster writes a value into every other block's shared memory, then a cluster
//      barrier; timed over many rounds with clock64 (SM clocks per round).
// Build: nvcc -gencode arch=compute_90a,code=sm_90a -O3 -std=c++17 -o build/dev/cluster_probe lab/cuda/cluster_probe.cu
// Run:   build/dev/cluster_probe            (H200, 2026-11-30: bench/results/cluster_probe_session15_2026-11-30.log)
#include <cuda.h>  // (CUtensorMap: mk_ptx.cuh's TMA helpers name it)
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "../../flint/kernels/mk_ptx.cuh"

#define CK(x)                                                                                  \
  do {                                                                                         \
    cudaError_t e_ = (x);                                                                      \
    if (e_ != cudaSuccess) {                                                                   \
      std::printf("%s:%d %s -> %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));         \
      return 1;                                                                                \
    }                                                                                          \
  } while (0)

constexpr int NT = 512;
constexpr int ROUNDS = 1000;

__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ unsigned cluster_size() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// out[block] = {smid, cluster rank, cluster size, value seen from rank 0, SM clocks per hop round}
__global__ void __launch_bounds__(NT, 1) probe(unsigned* counter, long long* out) {
  extern __shared__ __align__(16) unsigned smem[];
  const unsigned rank = cluster_rank(), csize = cluster_size();
  if (threadIdx.x == 0) smem[0] = 0u;
  __syncthreads();
  // grid-wide counter barrier (the megakernel's kind): every block arrives, every block waits for all
  if (threadIdx.x == 0) {
    atomicAdd(counter, 1u);
    while (atomicAdd(counter, 0u) < gridDim.x) {
    }
  }
  __syncthreads();
  cluster_sync();
  long long t0 = clock64();
  for (int r = 1; r <= ROUNDS; ++r) {
    if (rank == 0 && threadIdx.x < csize) {  // rank 0 writes r into block threadIdx.x's smem[0] (DSMEM)
      const unsigned local = (unsigned)__cvta_generic_to_shared(smem);
      unsigned remote;
      asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(threadIdx.x));
      asm volatile("st.shared::cluster.u32 [%0], %1;" ::"r"(remote), "r"((unsigned)r) : "memory");
    }
    cluster_sync();  // the value is visible after the barrier
  }
  long long t1 = clock64();
  if (threadIdx.x == 0) {
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    long long* o = out + 5 * blockIdx.x;
    o[0] = smid;
    o[1] = rank;
    o[2] = csize;
    o[3] = smem[0];
    o[4] = (t1 - t0) / ROUNDS;
  }
}

int main() {
  int dev = 0, sms = 0, optin = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  CK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  std::printf("SMs %d, opt-in shared memory per block %d B\n", sms, optin);
  CK(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, optin));
  CK(cudaFuncSetAttribute(probe, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  unsigned* counter;
  long long* out;
  CK(cudaMalloc(&counter, sizeof(unsigned)));
  CK(cudaMalloc(&out, 5 * sizeof(long long) * sms));
  for (int cs : {1, 2, 4, 8, 16}) {
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[2];
    mk::coop_cluster_attrs(attr, (unsigned)cs);
    cfg.blockDim = dim3(NT);
    cfg.dynamicSmemBytes = optin;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    cfg.gridDim = dim3(cs * (sms / cs));
    int nclusters = 0;
    cudaError_t e = cudaOccupancyMaxActiveClusters(&nclusters, (const void*)probe, &cfg);
    if (e != cudaSuccess) {
      std::printf("cluster %2d: occupancy query failed: %s\n", cs, cudaGetErrorString(e));
      cudaGetLastError();
      continue;
    }
    const int grid = nclusters * cs;
    std::printf("cluster %2d: %d clusters co-resident = %d blocks of %d SMs\n", cs, nclusters, grid, sms);
    if (grid == 0) continue;
    cfg.gridDim = dim3(grid);
    cfg.numAttrs = 2;  // + cooperative
    CK(cudaMemset(counter, 0, sizeof(unsigned)));
    CK(cudaMemset(out, 0xff, 5 * sizeof(long long) * sms));
    e = cudaLaunchKernelEx(&cfg, probe, counter, out);
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    if (e != cudaSuccess) {
      std::printf("  cooperative launch with clusters of %d: %s\n", cs, cudaGetErrorString(e));
      cudaGetLastError();
      continue;
    }
    std::vector<long long> h(5 * grid);
    CK(cudaMemcpy(h.data(), out, h.size() * sizeof(long long), cudaMemcpyDeviceToHost));
    int bad = 0;
    long long cyc_min = 1LL << 62, cyc_max = 0;
    std::vector<int> seen(sms, 0);
    for (int b = 0; b < grid; ++b) {
      const long long* o = &h[5 * b];
      if (o[2] != cs || o[1] != b % cs || o[3] != ROUNDS) ++bad;
      if (o[0] >= 0 && o[0] < sms) ++seen[o[0]];
      cyc_min = o[4] < cyc_min ? o[4] : cyc_min;
      cyc_max = o[4] > cyc_max ? o[4] : cyc_max;
    }
    int twice = 0;
    for (int s = 0; s < sms; ++s) twice += seen[s] > 1;
    std::printf("  cooperative launch with clusters of %d: ok; %d blocks wrong (rank, size or DSMEM value), %d SMs "
                "with two blocks; DSMEM store + cluster barrier: %lld..%lld SM clocks per round\n",
                cs, bad, twice, cyc_min, cyc_max);
  }
  return 0;
}
