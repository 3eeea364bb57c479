// flint kernel-lab microbenchmark: what one dependent cross-SM "hop" costs on this GPU, the way the
// megakernel makes them: every block writes its slice of a vector, a grid barrier (the mainline's
// red.release + ld.acquire monotonic counter), then every block loads the WHOLE vector (__ldcg, one
// round of loads per thread, like stage_x). Optionally one warp per block streams a buffer larger than
// L2 with 1-D bulk copies into a shared-memory ring (the megakernel's producer), with at most
// `--inflight` copies in flight per SM, so the hop is measured under the weight stream too.
// `--work NS`: the consumers busy-wait NS ns per iteration before writing (a stand-in for a stage's
// tile phase, when the stream has something to overlap with); `--policy 1`: the producer issues no
// new copy while its block's consumers are in a hop (from the barrier arrival until the loads are
// done), the schedule of MK_HOP_CAP (an experiment of older revisions; lost: docs/megakernel-log.md).
// The achieved stream bandwidth is reported, so the trade between cheaper hops and a slower stream is
// measured, not guessed.
// `--sync 1`: the arrival as fence.acq_rel.gpu + a relaxed reduction, the fence's own stall timed in SM clocks
// (does the release wait for the producer warp's bulk copies in flight? It does, 2026-11-30:
// bench/results/hop_bench_sync_session16_2026-11-30.log); `--sync 2`: a relaxed
// reduction and a relaxed poll, no ordering of the slice's stores at all (a timing diagnostic, not a barrier).
//
// Per iteration and block (%globaltimer, ns): arrive = before the barrier's arrival, exit = after
// the barrier (poll + block barrier), loaded = after the loads and a block barrier. Reported:
// barrier latency = exit - the LAST block's arrive (median, p90 over blocks and iterations), load
// latency = loaded - exit, and the step = the whole iteration.
//
// Build (here): nvcc -gencode arch=compute_90a,code=sm_90a -O3 -std=c++17 -lineinfo \
//                 -o build/dev/hop_bench lab/cuda/hop_bench.cu
// Run (device): ./build/dev/hop_bench [--iters 200] [--n 2560] [--stream 0|1] [--inflight 8] [--gib 2]
//                                    [--work 0] [--policy 0|1] [--sync 0|1|2]
#include <cooperative_groups.h>
#include <cuda.h>  // (CUtensorMap: mk_ptx.cuh's TMA helpers name it)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "../../flint/kernels/mk_ptx.cuh"

#define CK(x)                                                                                  \
  do {                                                                                         \
    cudaError_t e_ = (x);                                                                      \
    if (e_ != cudaSuccess) {                                                                   \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));      \
      exit(1);                                                                                 \
    }                                                                                          \
  } while (0)

constexpr int NCW = 15, NCT = NCW * 32, NT = NCT + 32;
constexpr int SLOTS = 8, SLOT_BYTES = 16384;

struct Args {
  float* vec;                    // [2][n]
  unsigned long long* counter;   // barrier counter (monotonic)
  unsigned long long* stamps;    // [iters][nblocks][3]
  const uint8_t* big;            // stream source
  long long big_bytes;
  int* stop;
  float* sink;                   // [nblocks] checksums (keeps the loads alive)
  unsigned long long* copies;    // [nblocks] bulk copies completed by each producer
  int n, iters, stream, inflight, work_ns, policy, sync;
};
constexpr int NST = 6;  // stamps per (iteration, block): start, arrive, released, exit, loaded, release clocks

__device__ __forceinline__ unsigned long long now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void cbar() { asm volatile("bar.sync 1, %0;" ::"n"(NCT) : "memory"); }

__global__ void __launch_bounds__(NT, 1) hop_kernel(Args a) {
  extern __shared__ __align__(1024) uint8_t smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint8_t* ring = smem + 1024;
  __shared__ float red[NCW];
  __shared__ volatile int in_hop;
  const int nb = gridDim.x, b = blockIdx.x, t = threadIdx.x;
  if (t == 0) {
    in_hop = 0;
    for (int i = 0; i < SLOTS; ++i) mk::mbar_init(&full[i], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (t >= NCT) {  // producer warp: stream `big` through the ring until the consumers are done
    if (t != NCT || !a.stream) return;
    const long long nchunks = a.big_bytes / SLOT_BYTES;
    long long c = b;
    uint32_t q = 0;
    for (;; ++q) {
      if (*(volatile int*)a.stop) break;
      if (a.policy == 1 && in_hop) {
        __nanosleep(32);
        --q;  // nothing issued in this pass
        continue;
      }
      const int slot = q % SLOTS;
      // at most `inflight` copies outstanding, and a slot is reused only after its copy landed
      const uint32_t back = (uint32_t)min(a.inflight, SLOTS);
      if (q >= back) mk::mbar_wait(&full[(q - back) % SLOTS], ((q - back) / SLOTS) & 1);
      mk::mbar_expect_tx(&full[slot], SLOT_BYTES);
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
              mk::smem_u32(ring + (size_t)slot * SLOT_BYTES)),
          "l"(a.big + (c % nchunks) * SLOT_BYTES), "r"(SLOT_BYTES), "r"(mk::smem_u32(&full[slot]))
          : "memory");
      c += nb;
    }
    // drain: every copy still in flight lands before the block exits
    for (uint32_t k = q > SLOTS ? q - SLOTS : 0; k < q; ++k) mk::mbar_wait(&full[k % SLOTS], (k / SLOTS) & 1);
    a.copies[b] = q;
    return;
  }
  const int per = (a.n + nb - 1) / nb;
  float acc = 0.f;
  for (int it = 0; it < a.iters; ++it) {
    float* v = a.vec + (size_t)(it & 1) * a.n;
    const unsigned long long t0 = now();
    if (a.work_ns) {  // the stand-in for a stage's tile phase
      while (now() - t0 < (unsigned long long)a.work_ns) {
      }
    }
    // write this block's slice
    for (int i = b * per + t; i < min(a.n, (b + 1) * per); i += NCT) v[i] = (float)(it * 7 + i);
    cbar();
    const unsigned long long t_arrive = now();
    unsigned long long t_rel = t_arrive;
    long long rel_clk = 0;
    if (t == 0) {
      in_hop = 1;
      // --sync 0: the mainline arrival (red.release: the fence is part of the reduction);
      //        1: fence.acq_rel.gpu then a relaxed reduction (the fence's own stall is timed in SM clocks);
      //        2: a relaxed reduction and a relaxed poll: NO ordering of the slice's stores (a timing diagnostic)
      const long long c0 = clock64();
      if (a.sync == 0) {
        asm volatile("red.release.gpu.global.add.u64 [%0], %1;" ::"l"(a.counter), "l"(1ull) : "memory");
      } else if (a.sync == 1) {
        asm volatile("fence.acq_rel.gpu;" ::: "memory");
        rel_clk = clock64() - c0;
        asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" ::"l"(a.counter), "l"(1ull) : "memory");
      } else {
        asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" ::"l"(a.counter), "l"(1ull) : "memory");
      }
      if (a.sync != 1) rel_clk = clock64() - c0;
      t_rel = now();
      const unsigned long long target = (unsigned long long)nb * (it + 1);
      unsigned long long c;
      do {
        if (a.sync == 2)
          asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(c) : "l"(a.counter) : "memory");
        else
          asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(c) : "l"(a.counter) : "memory");
      } while (c < target);
    }
    cbar();
    const unsigned long long t_exit = now();
    // load the whole vector: one round (float4 per thread, like stage_x's one code word = 2 float4)
    float s = 0.f;
    for (int i = 4 * t; i < a.n; i += 4 * NCT) {
      const float4 x = __ldcg(reinterpret_cast<const float4*>(v + i));
      s += x.x + x.y + x.z + x.w;
    }
    for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if ((t & 31) == 0) red[t >> 5] = s;
    cbar();
    const unsigned long long t_loaded = now();
    if (t == 0) in_hop = 0;
    if (t == 0) {
      float bs = 0.f;
      for (int w = 0; w < NCW; ++w) bs += red[w];
      acc += bs;
      unsigned long long* st = a.stamps + ((size_t)it * nb + b) * NST;
      st[0] = t0;
      st[1] = t_arrive;
      st[2] = t_rel;
      st[3] = t_exit;
      st[4] = t_loaded;
      st[5] = (unsigned long long)rel_clk;
    }
    cbar();
  }
  if (t == 0) {
    a.sink[b] = acc;
    // every block's consumers are done once the counter reaches nb * (iters + 1): then stop the streams
    asm volatile("red.release.gpu.global.add.u64 [%0], %1;" ::"l"(a.counter), "l"(1ull) : "memory");
    const unsigned long long target = (unsigned long long)nb * (a.iters + 1);
    unsigned long long c;
    do {
      asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(c) : "l"(a.counter) : "memory");
    } while (c < target);
    *(volatile int*)a.stop = 1;
  }
}

static double pct(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, (size_t)(p * (v.size() - 1) + 0.5))];
}

int main(int argc, char** argv) {
  int iters = 200, n = 2560, stream = 0, inflight = 8, work_ns = 0, policy = 0, sync = 0;
  double gib = 2.0;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--iters")) iters = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--n")) n = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--stream")) stream = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--inflight")) inflight = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--gib")) gib = atof(argv[i + 1]);
    else if (!strcmp(argv[i], "--work")) work_ns = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--policy")) policy = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--sync")) sync = atoi(argv[i + 1]);
    else { fprintf(stderr, "unknown argument %s\n", argv[i]); return 2; }
  }
  if (n % 4 || n <= 0 || iters <= 0 || inflight <= 0 || work_ns < 0 || (policy != 0 && policy != 1) || sync < 0 || sync > 2) {
    fprintf(stderr, "bad --n/--iters/--inflight/--work/--policy/--sync\n");
    return 2;
  }
  int dev = 0, nsm = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  Args a{};
  a.n = n; a.iters = iters; a.stream = stream; a.inflight = inflight; a.work_ns = work_ns; a.policy = policy; a.sync = sync;
  a.big_bytes = stream ? (long long)(gib * (1ll << 30)) / SLOT_BYTES * SLOT_BYTES : SLOT_BYTES;
  CK(cudaMalloc(&a.vec, 2 * (size_t)n * sizeof(float)));
  CK(cudaMalloc(&a.counter, sizeof(unsigned long long)));
  CK(cudaMemset(a.counter, 0, sizeof(unsigned long long)));
  CK(cudaMalloc(&a.stamps, (size_t)iters * nsm * NST * sizeof(unsigned long long)));
  CK(cudaMalloc((void**)&a.big, (size_t)a.big_bytes));
  CK(cudaMemset((void*)a.big, 1, (size_t)a.big_bytes));
  CK(cudaMalloc(&a.stop, sizeof(int)));
  CK(cudaMemset(a.stop, 0, sizeof(int)));
  CK(cudaMalloc(&a.sink, nsm * sizeof(float)));
  CK(cudaMalloc(&a.copies, nsm * sizeof(unsigned long long)));
  CK(cudaMemset(a.copies, 0, nsm * sizeof(unsigned long long)));
  const int smem = 1024 + SLOTS * SLOT_BYTES;
  CK(cudaFuncSetAttribute(hop_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  void* args[] = {&a};
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaEventRecord(e0));
  CK(cudaLaunchCooperativeKernel((void*)hop_kernel, dim3(nsm), dim3(NT), args, smem, 0));
  CK(cudaEventRecord(e1));
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, e0, e1));
  std::vector<unsigned long long> st((size_t)iters * nsm * NST);
  CK(cudaMemcpy(st.data(), a.stamps, st.size() * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
  std::vector<double> bar, load, step, rel, relclk;
  for (int it = 10; it < iters; ++it) {  // skip the first iterations (warm-up)
    unsigned long long last_arrive = 0, first_start = ~0ull, last_loaded = 0;
    for (int b = 0; b < nsm; ++b) {
      const unsigned long long* s = &st[((size_t)it * nsm + b) * NST];
      last_arrive = std::max(last_arrive, s[1]);
      first_start = std::min(first_start, s[0]);
      last_loaded = std::max(last_loaded, s[4]);
    }
    for (int b = 0; b < nsm; ++b) {
      const unsigned long long* s = &st[((size_t)it * nsm + b) * NST];
      bar.push_back((double)(s[3] - last_arrive));
      load.push_back((double)(s[4] - s[3]));
      rel.push_back((double)(s[2] - s[1]));
      relclk.push_back((double)s[5]);
    }
    step.push_back((double)(last_loaded - first_start));
  }
  std::vector<unsigned long long> copies(nsm);
  CK(cudaMemcpy(copies.data(), a.copies, nsm * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
  double bytes = 0;
  for (int b = 0; b < nsm; ++b) bytes += (double)copies[b] * SLOT_BYTES;
  printf("%s, %d SMs, n = %d floats, %d iterations, work %d ns, stream %s (in flight <= %d x %d KB per SM, policy %d), "
         "sync %d, kernel %.2f ms, stream %.0f GB/s\n",
         prop.name, nsm, n, iters, work_ns, stream ? "on" : "off", std::min(inflight, SLOTS), SLOT_BYTES / 1024,
         policy, sync, ms, bytes / (ms * 1e-3) / 1e9);
  printf("  barrier: exit - last arrival   median %6.0f ns  p90 %6.0f  max %6.0f\n", pct(bar, 0.5), pct(bar, 0.9),
         pct(bar, 1.0));
  printf("  arrival instruction(s) stall   median %6.0f ns  p90 %6.0f  max %6.0f   (SM clocks: median %.0f p90 %.0f)\n",
         pct(rel, 0.5), pct(rel, 0.9), pct(rel, 1.0), pct(relclk, 0.5), pct(relclk, 0.9));
  printf("  load whole vector + block bar  median %6.0f ns  p90 %6.0f  max %6.0f\n", pct(load, 0.5), pct(load, 0.9),
         pct(load, 1.0));
  printf("  iteration (write, barrier, load) median %6.0f ns\n", pct(step, 0.5));
  return 0;
}
