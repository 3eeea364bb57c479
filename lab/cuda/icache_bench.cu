// flint kernel-lab microbenchmark: the instruction cache of this GPU, the way the megakernel meets it. A kernel whose
// loop body is N distinct instructions (straight-line FFMA on 8 independent chains: no dependency stall, so a warp
// can issue one per cycle) runs `iters` times on one block per SM; the warm iterations' clocks per instruction
// show where the body stops fitting a cache level (the L0 of an SM sub-partition, the SM's L1 instruction cache)
// and what a fetch from the next level costs. The first (cold) iteration is reported too: the cost of running N
// instructions once after they were evicted, which is what a persistent kernel whose per-layer code exceeds the
// cache pays at every stage of every layer.
//
// The question (2026-11-30): the M = 1 megakernel executes ~70 KB of code per layer (the v20 Nsight Compute export:
// instructions executed at least 5000 times), the traced builds more; is that over the cache?
//
// Build (here): nvcc -gencode arch=compute_90a,code=sm_90a -O3 -std=c++17 -o build/dev/icache_bench \
//                 lab/cuda/icache_bench.cu
// Run (device): ./build/dev/icache_bench [--iters 20] [--warps 4,16]
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#define CK(x)                                                                                          \
  do {                                                                                                 \
    cudaError_t e_ = (x);                                                                              \
    if (e_ != cudaSuccess) {                                                                           \
      fprintf(stderr, "icache_bench: %s: %s (line %d)\n", #x, cudaGetErrorString(e_), __LINE__);      \
      exit(1);                                                                                         \
    }                                                                                                  \
  } while (0)

// out[block][warp][0] = clocks of the first iteration, [1] = clocks of iterations 1..iters-1
template <int N>
__global__ void __launch_bounds__(512, 1) body(int iters, long long* out, float* sink) {
  float r0 = threadIdx.x, r1 = r0 + 1.f, r2 = r0 + 2.f, r3 = r0 + 3.f, r4 = r0 + 4.f, r5 = r0 + 5.f, r6 = r0 + 6.f,
        r7 = r0 + 7.f;
  const float a = 1.0001f;
  __syncthreads();
  long long t0 = clock64(), t1 = t0;
  for (int it = 0; it < iters; ++it) {
    if (it == 1) t1 = clock64();
#pragma unroll
    for (int i = 0; i < N / 8; ++i) {
      asm volatile("fma.rn.f32 %0, %0, %1, %1;" : "+f"(r0) : "f"(a));
      asm volatile("fma.rn.f32 %0, %0, %1, %1;" : "+f"(r1) : "f"(a));
      asm volatile("fma.rn.f32 %0, %0, %1, %1;" : "+f"(r2) : "f"(a));
      asm volatile("fma.rn.f32 %0, %0, %1, %1;" : "+f"(r3) : "f"(a));
      asm volatile("fma.rn.f32 %0, %0, %1, %1;" : "+f"(r4) : "f"(a));
      asm volatile("fma.rn.f32 %0, %0, %1, %1;" : "+f"(r5) : "f"(a));
      asm volatile("fma.rn.f32 %0, %0, %1, %1;" : "+f"(r6) : "f"(a));
      asm volatile("fma.rn.f32 %0, %0, %1, %1;" : "+f"(r7) : "f"(a));
    }
  }
  const long long t2 = clock64();
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) {
    long long* o = out + ((size_t)blockIdx.x * 16 + warp) * 2;
    o[0] = t1 - t0;
    o[1] = t2 - t1;
  }
  const float s = r0 + r1 + r2 + r3 + r4 + r5 + r6 + r7;
  if (s == 1.2345f) sink[0] = s;  // (never)
}

using Kern = void (*)(int, long long*, float*);
struct Size {
  int n;
  Kern k;
};

static int cmp_ll(const void* a, const void* b) {
  const long long x = *(const long long*)a, y = *(const long long*)b;
  return x < y ? -1 : x > y;
}

int main(int argc, char** argv) {
  int iters = 20;
  std::vector<int> warps = {4, 16};
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--iters") && i + 1 < argc) {
      iters = atoi(argv[++i]);
    } else if (!strcmp(argv[i], "--warps") && i + 1 < argc) {
      warps.clear();
      std::string s = argv[++i];
      size_t p = 0;
      while (p < s.size()) {
        const size_t q = s.find(',', p);
        warps.push_back(atoi(s.substr(p, q == std::string::npos ? std::string::npos : q - p).c_str()));
        p = q == std::string::npos ? s.size() : q + 1;
      }
    } else {
      fprintf(stderr, "icache_bench: unknown argument %s (--iters N, --warps 4,16)\n", argv[i]);
      return 2;
    }
  }
  if (iters < 3) {
    fprintf(stderr, "icache_bench: --iters must be >= 3\n");
    return 2;
  }
  const Size sizes[] = {{512, body<512>},     {1024, body<1024>},   {1536, body<1536>},   {2048, body<2048>},
                        {3072, body<3072>},   {4096, body<4096>},   {5120, body<5120>},   {6144, body<6144>},
                        {7168, body<7168>},   {8192, body<8192>},   {9216, body<9216>},   {10240, body<10240>},
                        {12288, body<12288>}, {16384, body<16384>}};
  int dev = 0, nsm = 0, clk = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, dev));
  CK(cudaDeviceGetAttribute(&clk, cudaDevAttrClockRate, dev));
  long long* out;
  float* sink;
  CK(cudaMalloc(&out, (size_t)nsm * 16 * 2 * sizeof(long long)));
  CK(cudaMalloc(&sink, sizeof(float)));
  std::vector<long long> h((size_t)nsm * 16 * 2);
  printf("icache_bench: %d SMs, one block per SM, %d iterations; clocks per instruction and warp (median over "
         "warps): warm = iterations 1.., cold = the first\n", nsm, iters);
  for (int w : warps) {
    if (w < 1 || w > 16) {
      fprintf(stderr, "icache_bench: --warps: 1..16 per block\n");
      return 2;
    }
    printf("warps per block %d (%d per SM sub-partition)\n", w, (w + 3) / 4);
    printf("  %8s %8s %12s %12s %14s\n", "instr", "KiB", "warm clk/ins", "cold clk/ins", "cold extra us");
    for (const Size& s : sizes) {
      CK(cudaMemset(out, 0, h.size() * sizeof(long long)));
      s.k<<<nsm, 32 * w>>>(iters, out, sink);  // warm-up launch (module load)
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      s.k<<<nsm, 32 * w>>>(iters, out, sink);
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      CK(cudaMemcpy(h.data(), out, h.size() * sizeof(long long), cudaMemcpyDeviceToHost));
      std::vector<long long> cold, warm;
      for (int b = 0; b < nsm; ++b)
        for (int k = 0; k < w; ++k) {
          cold.push_back(h[((size_t)b * 16 + k) * 2]);
          warm.push_back(h[((size_t)b * 16 + k) * 2 + 1]);
        }
      qsort(cold.data(), cold.size(), sizeof(long long), cmp_ll);
      qsort(warm.data(), warm.size(), sizeof(long long), cmp_ll);
      const double wc = (double)warm[warm.size() / 2] / ((double)(iters - 1) * s.n);
      const double cc = (double)cold[cold.size() / 2] / s.n;
      printf("  %8d %8.0f %12.3f %12.3f %14.3f\n", s.n, s.n * 16 / 1024.0, wc, cc,
             (cc - wc) * s.n / (clk * 1e-3));
    }
  }
  CK(cudaFree(out));
  CK(cudaFree(sink));
  return 0;
}
