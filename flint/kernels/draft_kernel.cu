// flint draft rollout: the K steps of the EAGLE-style draft head (flint/draft.py) in ONE cooperative launch.
//
// A draft step is four matvecs on a few MB of bf16 weights (fc 2H -> H, the MLP block's gate|up and down, the
// drafting vocabulary's head), each needing the whole previous vector: as torch ops that is ~13 kernels a step whose
// launch gaps and tails cost more than their reads (SmolLM2: 59.5 us a draft token in a CUDA graph, 2026-12-01).
// Here one grid (one block per SM) runs every step; a phase hands its vector to the next through global memory
// (L2) and a grid barrier; each block recomputes the RMSNorm of the vector it needs itself (a few KB). The argmax of
// the head is reduced per block to one 64-bit key (value bits made orderable, then the complement of the index:
// ties go to the lowest index, the first-index rule of torch.argmax), and every block reduces the keys of all
// blocks in the same way, so every block knows the token without another barrier.
//
// Inputs are the draft's own tensors (bf16) and the first token's embedding either as a bf16 row or from the
// target's int4 layout (flint-int4-v1: code 2j in the low nibble of byte j, w = code * scale + min per group).
// Arithmetic is fp32 throughout (the torch path rounds its intermediates to bf16: the two may differ at argmax
// near-ties; tests/test_speculative.py checks tokens against an fp32 emulation).
// Host entry: flint_draft_rollout (a cudaError_t, 0 = success). Needs H, I % 8 == 0 (16-byte weight loads).
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace cg = cooperative_groups;

namespace {

// 32 warps a block, one block per SM: 4 loads of 16 B in flight per lane make ~64 KB per SM, what a streaming read
// needs on the H200 (256 threads: Granite's rollout read 0.9 TB/s, 2026-12-01)
constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxBlocks = 4;  // MLP blocks of the draft (the shipped one has 1)

struct DraftArgs {
  const __nv_bfloat16* fc;       // [H, 2H]
  const __nv_bfloat16* w_nh;     // [H] norm_hidden
  const __nv_bfloat16* w_ne;     // [H] norm_embed
  const __nv_bfloat16* w_bn[kMaxBlocks];   // [H] each block's norm
  const __nv_bfloat16* gu[kMaxBlocks];     // [2I, H]: gate rows, then up rows
  const __nv_bfloat16* down[kMaxBlocks];   // [H, I]
  const __nv_bfloat16* w_final;  // [H] the target's final norm
  const __nv_bfloat16* head;     // [N, H] the drafting vocabulary's head rows
  const __nv_bfloat16* embed;    // [N, H] their embeddings (== head when tied)
  const long long* vocab_ids;    // [N] token ids of the rows (null: row = id)
  // the first token: its id, and its embedding from a bf16 table [V, H] (emb_full) or the int4 layout
  const long long* tok;          // [1] device
  const __nv_bfloat16* emb_full;
  const uint8_t* e_q;            // [V, H/2]
  const __half* e_scale;         // [V, H/G]
  const __half* e_min;           // [V, H/G]
  int e_group;
  const float* h0;               // [H] the target's hidden state (fp32)
  float* f;                      // [H] scratch
  float* act;                    // [I] scratch
  float* x;                      // [H] scratch: the step's predicted hidden state
  unsigned long long* keys;      // [gridDim.x] scratch
  long long* out;                // [k] the proposed token ids
  float eps, teps;
  int H, I, N, nblocks, k;
};

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// sum over the block (fixed order: deterministic); red: kWarps floats of shared memory
__device__ float block_sum(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float s = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) s += red[w];
  return s;
}

// dot of a bf16 row [K] (K % 8 == 0, 16-byte aligned) with fp32 x [K] in shared memory, by one warp
__device__ __forceinline__ float row_dot(const __nv_bfloat16* w, const float* xs, int K) {
  const uint4* wp = reinterpret_cast<const uint4*>(w);
  float s = 0.f;
  const int nc = K >> 3;
#pragma unroll 4
  for (int c = threadIdx.x & 31; c < nc; c += 32) {
    const uint4 u = __ldg(wp + c);
    const float4 xa = *reinterpret_cast<const float4*>(xs + 8 * c);
    const float4 xb = *reinterpret_cast<const float4*>(xs + 8 * c + 4);
    const float2 w0 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
    const float2 w1 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
    const float2 w2 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.z));
    const float2 w3 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.w));
    s = fmaf(w0.x, xa.x, s); s = fmaf(w0.y, xa.y, s); s = fmaf(w1.x, xa.z, s); s = fmaf(w1.y, xa.w, s);
    s = fmaf(w2.x, xb.x, s); s = fmaf(w2.y, xb.y, s); s = fmaf(w3.x, xb.z, s); s = fmaf(w3.y, xb.w, s);
  }
  return warp_sum(s);
}

// xs[i] = v[i] * rstd(v) * w[i] for i < H; v read by `get`
template <class Get>
__device__ void rms_into(float* xs, const __nv_bfloat16* w, int H, float eps, float* red, Get get) {
  float s2 = 0.f;
  for (int i = threadIdx.x; i < H; i += kThreads) {
    const float v = get(i);
    xs[i] = v;
    s2 = fmaf(v, v, s2);
  }
  const float r = rsqrtf(block_sum(s2, red) / (float)H + eps);
  for (int i = threadIdx.x; i < H; i += kThreads) xs[i] = xs[i] * r * __bfloat162float(w[i]);
  __syncthreads();
}

// a float's bits as an unsigned key that orders like the float (NaN aside)
__device__ __forceinline__ uint32_t ordered(float v) {
  const uint32_t b = __float_as_uint(v);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__global__ void __launch_bounds__(kThreads) draft_rollout_kernel(DraftArgs a) {
  extern __shared__ float smem[];
  __shared__ float red[kWarps];
  __shared__ unsigned long long wkey[kWarps];
  const int H = a.H, I = a.I;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gwarp = blockIdx.x * kWarps + warp, nwarps = gridDim.x * kWarps;
  long long tok = __ldg(a.tok);  // this step's input token (its id; afterwards its drafting-vocabulary row)
  bool first = true;
  for (int j = 0; j < a.k; ++j) {
    // fc over [rmsnorm(h) * w_nh | rmsnorm(e) * w_ne]
    float* xs = smem;  // [2H]
    if (first) {
      rms_into(xs, a.w_nh, H, a.eps, red, [&](int i) { return __ldg(a.h0 + i); });
      if (a.emb_full != nullptr) {
        const __nv_bfloat16* er = a.emb_full + (size_t)tok * H;
        rms_into(xs + H, a.w_ne, H, a.eps, red, [&](int i) { return __bfloat162float(er[i]); });
      } else {
        const uint8_t* q = a.e_q + (size_t)tok * (H / 2);
        const int ng = H / a.e_group;
        const __half* sc = a.e_scale + (size_t)tok * ng;
        const __half* mn = a.e_min + (size_t)tok * ng;
        rms_into(xs + H, a.w_ne, H, a.eps, red, [&](int i) {
          const int code = (q[i >> 1] >> (4 * (i & 1))) & 15;
          const int g = i / a.e_group;
          return (float)code * __half2float(sc[g]) + __half2float(mn[g]);
        });
      }
    } else {
      rms_into(xs, a.w_nh, H, a.eps, red, [&](int i) { return __ldcg(a.x + i); });
      const __nv_bfloat16* er = a.embed + (size_t)tok * H;
      rms_into(xs + H, a.w_ne, H, a.eps, red, [&](int i) { return __bfloat162float(er[i]); });
    }
    first = false;
    for (int r = gwarp; r < H; r += nwarps) {
      const float s = row_dot(a.fc + (size_t)r * 2 * H, xs, 2 * H);
      if (lane == 0) a.f[r] = s;
    }
    cg::this_grid().sync();  // (the grid_group object held across the loop spilled 8 bytes)
    for (int b = 0; b < a.nblocks; ++b) {
      float* fcur = b == 0 ? a.f : a.x;  // the block's input: fc's output, then the previous block's
      rms_into(xs, a.w_bn[b], H, a.eps, red, [&](int i) { return __ldcg(fcur + i); });
      for (int r = gwarp; r < I; r += nwarps) {
        const float g = row_dot(a.gu[b] + (size_t)r * H, xs, H);
        const float u = row_dot(a.gu[b] + (size_t)(I + r) * H, xs, H);
        if (lane == 0) a.act[r] = g / (1.f + __expf(-g)) * u;
      }
      cg::this_grid().sync();
      for (int i = threadIdx.x; i < I; i += kThreads) xs[i] = __ldcg(a.act + i);
      __syncthreads();
      // x = fcur + down(act); for b > 0 fcur is x itself: each row is read then written by one lane only
      for (int r = gwarp; r < H; r += nwarps) {
        const float s = row_dot(a.down[b] + (size_t)r * I, xs, I);
        if (lane == 0) a.x[r] = __ldcg(fcur + r) + s;
      }
      cg::this_grid().sync();
    }
    // the head's argmax over the drafting vocabulary on rmsnorm(x) * w_final (the logit scale cannot move it)
    rms_into(xs, a.w_final, H, a.teps, red, [&](int i) { return __ldcg(a.x + i); });
    unsigned long long best = 0ull;
    for (int n = gwarp; n < a.N; n += nwarps) {
      const float s = row_dot(a.head + (size_t)n * H, xs, H);
      const unsigned long long key = (unsigned long long)ordered(s) << 32 | (0xffffffffu - (uint32_t)n);
      best = key > best ? key : best;
    }
    if (lane == 0) wkey[warp] = best;
    __syncthreads();
    if (threadIdx.x == 0) {
      unsigned long long m = 0ull;
      for (int w = 0; w < kWarps; ++w) m = wkey[w] > m ? wkey[w] : m;
      a.keys[blockIdx.x] = m;
    }
    cg::this_grid().sync();
    // every block reduces all blocks' keys: the same token everywhere
    unsigned long long m = 0ull;
    for (int i = threadIdx.x; i < (int)gridDim.x; i += kThreads) {
      const unsigned long long v = __ldcg(a.keys + i);
      m = v > m ? v : m;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const unsigned long long v = __shfl_xor_sync(0xffffffffu, m, o);
      m = v > m ? v : m;
    }
    __syncthreads();  // (wkey is reused)
    if (lane == 0) wkey[warp] = m;
    __syncthreads();
    m = 0ull;
    for (int w = 0; w < kWarps; ++w) m = wkey[w] > m ? wkey[w] : m;
    const int row = (int)(0xffffffffu - (uint32_t)(m & 0xffffffffu));
    if (blockIdx.x == 0 && threadIdx.x == 0) a.out[j] = a.vocab_ids ? a.vocab_ids[row] : (long long)row;
    tok = row;
    __syncthreads();  // (xs and wkey are rewritten by the next step)
  }
}

}  // namespace

// ints: H, I, N, nblocks, k, e_group; ptrs: see DraftArgs (in its order, w_bn/gu/down kMaxBlocks each)
extern "C" int flint_draft_rollout(const long long* ints, const void* const* ptrs, const float* floats, void* stream) {
  DraftArgs a{};
  a.H = (int)ints[0]; a.I = (int)ints[1]; a.N = (int)ints[2]; a.nblocks = (int)ints[3]; a.k = (int)ints[4];
  a.e_group = (int)ints[5];
  if (a.H <= 0 || a.I <= 0 || a.N <= 0 || a.k <= 0 || a.H % 8 || a.I % 8 || a.nblocks < 1 || a.nblocks > kMaxBlocks ||
      (a.e_group > 0 && a.H % a.e_group))
    return (int)cudaErrorInvalidValue;
  int i = 0;
  a.fc = (const __nv_bfloat16*)ptrs[i++];
  a.w_nh = (const __nv_bfloat16*)ptrs[i++];
  a.w_ne = (const __nv_bfloat16*)ptrs[i++];
  for (int b = 0; b < kMaxBlocks; ++b) a.w_bn[b] = (const __nv_bfloat16*)ptrs[i++];
  for (int b = 0; b < kMaxBlocks; ++b) a.gu[b] = (const __nv_bfloat16*)ptrs[i++];
  for (int b = 0; b < kMaxBlocks; ++b) a.down[b] = (const __nv_bfloat16*)ptrs[i++];
  a.w_final = (const __nv_bfloat16*)ptrs[i++];
  a.head = (const __nv_bfloat16*)ptrs[i++];
  a.embed = (const __nv_bfloat16*)ptrs[i++];
  a.vocab_ids = (const long long*)ptrs[i++];
  a.tok = (const long long*)ptrs[i++];
  a.emb_full = (const __nv_bfloat16*)ptrs[i++];
  a.e_q = (const uint8_t*)ptrs[i++];
  a.e_scale = (const __half*)ptrs[i++];
  a.e_min = (const __half*)ptrs[i++];
  a.h0 = (const float*)ptrs[i++];
  a.f = (float*)ptrs[i++];
  a.act = (float*)ptrs[i++];
  a.x = (float*)ptrs[i++];
  a.keys = (unsigned long long*)ptrs[i++];
  a.out = (long long*)ptrs[i++];
  a.eps = floats[0];
  a.teps = floats[1];
  if ((a.emb_full == nullptr) == (a.e_q == nullptr)) return (int)cudaErrorInvalidValue;
  int dev = 0, sms = 0, per_sm = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  const size_t smem = sizeof(float) * (size_t)(2 * a.H > a.I ? 2 * a.H : a.I);
  if (e == cudaSuccess && smem > 48 * 1024)
    e = cudaFuncSetAttribute(draft_rollout_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (e == cudaSuccess) e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, draft_rollout_kernel, kThreads, smem);
  if (e != cudaSuccess) return (int)e;
  if (per_sm < 1) return (int)cudaErrorInvalidConfiguration;
  void* args[] = {&a};
  e = cudaLaunchCooperativeKernel((const void*)draft_rollout_kernel, dim3(sms), dim3(kThreads), args, smem,
                                  (cudaStream_t)stream);
  return (int)e;
}

// scratch the caller allocates: floats for f, act, x and the block keys (unsigned long long per SM)
extern "C" int flint_draft_grid_blocks() {
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
    return -1;
  return sms;
}
