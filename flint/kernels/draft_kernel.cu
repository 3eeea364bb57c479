// flint draft rollout: the K steps of the EAGLE-style draft head (flint/draft.py) in ONE cooperative launch.
//
// A draft step is four matvecs on a few MB of weights (fc 2H -> H, the MLP block's gate|up and down, the
// drafting vocabulary's head), each needing the whole previous vector: as torch ops that is ~13 kernels a step whose
// launch gaps and tails cost more than their reads (SmolLM2: 59.5 us a draft token in a CUDA graph, 2026-12-01).
// Here one grid (one block per SM) runs every step; a phase hands its vector to the next through global memory
// (L2) and a grid barrier; each block recomputes the RMSNorm of the vector it needs itself (a few KB). The argmax of
// the head is reduced per block to one 64-bit key (value bits made orderable, then the complement of the index:
// ties go to the lowest index, the first-index rule of torch.argmax), and every block reduces the keys of all
// blocks in the same way, so every block knows the token without another barrier.
//
// Every matrix (fc, the MLP blocks' gate|up and down, the head) is read either as bf16 rows or as int4 rows in the
// flint-int4-v1 layout (code 2j in the low nibble of byte j, w = code * scale + min per group of G, G % 32 == 0): the
// draft's own matrices quantized once, the head as the target's own int4 rows through the drafting vocabulary's ids
// (no copy). A stage's input vector is staged in the layout its matrix's dot reads: plain for bf16; for int4 the
// 16-byte code chunk c (32 codes) of a lane finds its 32 x values as 8 float4 at [j][c] (j = 0..7: conflict-free
// across the lanes) and the chunk's sum of x (for the min term) at xc[c]. The tokens' embeddings come from a bf16
// row table or from the target's int4 layout.
// Arithmetic is fp32 throughout (the torch path rounds its intermediates to bf16: the two may differ at argmax
// near-ties; tests/test_speculative.py checks tokens against an fp32 emulation on the same weights).
// Host entry: flint_draft_rollout (a cudaError_t, 0 = success). Needs H, I % 8 == 0 (16-byte bf16 loads);
// an int4 matrix needs K % G == 0.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "mk_config.cuh"  // (MK_TRACE: 1 in the traced library)

namespace cg = cooperative_groups;

namespace {

// 24 warps a block, one block per SM: 4 loads of 16 B in flight per lane make ~48 KB per SM on a bf16 row (256
// threads: Granite's rollout read 0.9 TB/s, 2026-12-01); 1024 threads cap registers at 64, where the int4 dot spills
constexpr int kThreads = 768;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxBlocks = 4;  // MLP blocks of the draft (the shipped one has 1)
constexpr int kMaxDevices = 64;  // the launch checks are cached per device

// a matrix of R rows of K: bf16 rows (w), or int4 rows (q [R][K/2], s and m [R][K/G]); rows: the physical row of
// logical row r (the head over the target's rows: the drafting vocabulary's ids), null: r itself
struct Mat {
  const __nv_bfloat16* w;
  const uint8_t* q;
  const __half* s;
  const __half* m;
  const long long* rows;
  int G;
};

struct DraftArgs {
  Mat fc;                        // [H, 2H]
  const __nv_bfloat16* w_nh;     // [H] norm_hidden
  const __nv_bfloat16* w_ne;     // [H] norm_embed
  const __nv_bfloat16* w_bn[kMaxBlocks];   // [H] each block's norm
  Mat gu[kMaxBlocks];            // [2I, H]: gate rows, then up rows
  Mat down[kMaxBlocks];          // [H, I]
  const __nv_bfloat16* w_final;  // [H] the target's final norm
  Mat head;                      // [N, H] the drafting vocabulary's head rows
  const __nv_bfloat16* embed;    // [N, H] bf16 embeddings of the head's rows, or null: the int4 layout (e_q) by id
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
  // sampling (logits non-null): step j writes its logits l = dot / scale over the N rows to logits[j][N] and draws
  // its token by the Gumbel-max rule, the argmax of l / temp + g, g = -log(-log(u)), u uniform in (0, 1) from a
  // hash of (seed, j, row): exactly a draw from softmax(l / temp)
  float* logits;
  const unsigned long long* seed;  // [1] device
  unsigned long long* trace;     // the traced build (MK_TRACE): block 0's %globaltimer stamps, else unused
  // the accept prologue (acc_am non-null, greedy only): the previous verify of acc_m tokens is accepted here, so the
  // next verify needs no host value. acc_step [acc_m + 1]: its tokens and start position; acc_am [acc_m]: the target's
  // argmax after each (int32); acc_resid [acc_m][H]: its hidden states (fp32). n = the leading drafts acc_step[1 + i]
  // equal to acc_am[i]; the rollout starts from token acc_am[n] and hidden state acc_resid[n] (tok and h0 unused).
  // Block 0 writes acc_vals [acc_m + 1] = (n, acc_am[n], the drafts) for the host, and the next verify's token
  // buffer acc_next [k + 2] = (acc_am[n], the k proposals (out = acc_next + 1), start + n + 1).
  const int* acc_am;
  const long long* acc_step;
  const float* acc_resid;
  long long* acc_vals;
  long long* acc_next;
  float eps, teps, scale, temp;
  int H, I, N, nblocks, k, acc_m;
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

// code b (0..3) of a word of four byte-wide codes as a float: 2^23 + code by its bits, less 2^23 (exact)
__device__ __forceinline__ float code_f(uint32_t v, int b) {
  return __uint_as_float(__byte_perm(v, 0x4B000000u, 0x7440u | (uint32_t)b)) - 8388608.f;
}

// sum over 32 codes (one 16-byte chunk) of code * x, x the chunk's 8 float4 at x4[j * nc]
__device__ __forceinline__ float chunk_dot(const uint4 u, const float4* x4, int nc) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
  float d = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // word i: codes 8i..8i+7 in its nibbles, in order
    const uint32_t lo = w[i] & 0x0F0F0F0Fu, hi = (w[i] >> 4) & 0x0F0F0F0Fu;  // codes 8i + {0,2,4,6}, {1,3,5,7}
    const float4 xa = x4[(2 * i) * nc], xb = x4[(2 * i + 1) * nc];
    d = fmaf(code_f(lo, 0), xa.x, d); d = fmaf(code_f(hi, 0), xa.y, d);
    d = fmaf(code_f(lo, 1), xa.z, d); d = fmaf(code_f(hi, 1), xa.w, d);
    d = fmaf(code_f(lo, 2), xb.x, d); d = fmaf(code_f(hi, 2), xb.y, d);
    d = fmaf(code_f(lo, 3), xb.z, d); d = fmaf(code_f(hi, 3), xb.w, d);
  }
  return d;
}

// dots of NR int4 rows of A (logical rows r[]) with the staged x [K] (int4 layout) and its chunk sums xc, by one
// warp: sum over chunks of scale * sum(code * x) + min * sum(x); the rows share each x load
template <int NR>
__device__ __forceinline__ void dot_q4(const Mat& A, const int* r, int K, const float* xs, const float* xc, float* out) {
  const int nc = K >> 5, ng = K / A.G, lane = threadIdx.x & 31;
  const int cshift = 31 - __clz(A.G >> 5);  // chunks per group: 1, 2, 4
  size_t row[NR];
#pragma unroll
  for (int i = 0; i < NR; ++i) row[i] = A.rows ? (size_t)A.rows[r[i]] : (size_t)r[i];
  float acc[NR];
#pragma unroll
  for (int i = 0; i < NR; ++i) acc[i] = 0.f;
  const float4* x4 = reinterpret_cast<const float4*>(xs);
  const uint4* q4 = reinterpret_cast<const uint4*>(A.q);
  constexpr int B = 4 / NR;  // chunks a lane has in flight per row (more spilled at 64 registers)
  for (int c0 = lane; c0 < nc; c0 += 32 * B) {
    uint4 u[B][NR];
    __half sc[B][NR], mn[B][NR];  // (loaded with the codes: one round trip)
#pragma unroll
    for (int t = 0; t < B; ++t)
#pragma unroll
      for (int i = 0; i < NR; ++i) {
        const int c = c0 + 32 * t;
        const bool in = c < nc;
        u[t][i] = in ? __ldg(q4 + row[i] * nc + c) : make_uint4(0u, 0u, 0u, 0u);
        sc[t][i] = in ? __ldg(A.s + row[i] * ng + (c >> cshift)) : __half();
        mn[t][i] = in ? __ldg(A.m + row[i] * ng + (c >> cshift)) : __half();
      }
#pragma unroll
    for (int t = 0; t < B; ++t) {
      const int c = c0 + 32 * t;
      if (c >= nc) break;
      const float sx = xc[c];
#pragma unroll
      for (int i = 0; i < NR; ++i) {
        acc[i] = fmaf(__half2float(sc[t][i]), chunk_dot(u[t][i], x4 + c, nc), acc[i]);
        acc[i] = fmaf(__half2float(mn[t][i]), sx, acc[i]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < NR; ++i) out[i] = warp_sum(acc[i]);
}

// one row of A (either format) with the staged x
__device__ __forceinline__ float mat_dot(const Mat& A, int r, int K, const float* xs, const float* xc) {
  if (A.q == nullptr) return row_dot(A.w + (size_t)r * K, xs, K);
  float o;
  dot_q4<1>(A, &r, K, xs, xc, &o);
  return o;
}

// where x[k] of a K-vector lives in shared memory for a matrix of this format (q4: the int4 dot's layout)
__device__ __forceinline__ int xpos(int k, int K, bool q4) {
  return q4 ? 4 * (((k >> 2) & 7) * (K >> 5) + (k >> 5)) + (k & 3) : k;
}

// x[off + i] = v[i] * rstd(v) * w[i] for i < H, in the layout of a K-vector of the format q4; v read by `get`.
// For q4 (H, off multiples of 32) each warp's 32 values are one code chunk: its sum goes to xc by a warp sum
template <class Get>
__device__ void rms_into(float* xs, float* xc, const __nv_bfloat16* w, int H, int off, int K, bool q4, float eps,
                         float* red, Get get) {
  float s2 = 0.f;
  for (int i = threadIdx.x; i < H; i += kThreads) {
    const float v = get(i);
    xs[xpos(off + i, K, q4)] = v;
    s2 = fmaf(v, v, s2);
  }
  const float r = rsqrtf(block_sum(s2, red) / (float)H + eps);
  for (int i = threadIdx.x; i < H; i += kThreads) {  // (a thread rescales the values it wrote itself)
    const int p = xpos(off + i, K, q4);
    const float v = xs[p] * r * __bfloat162float(w[i]);
    xs[p] = v;
    if (q4) {
      const float c = warp_sum(v);  // whole warps: H % 32 == 0
      if ((threadIdx.x & 31) == 0) xc[(off + i) >> 5] = c;
    }
  }
  __syncthreads();
}

// x[i] = v[i] for i < K in the layout of its format, and for q4 the chunk sums (K % 32 == 0)
template <class Get>
__device__ void stage_into(float* xs, float* xc, int K, bool q4, Get get) {
  for (int i = threadIdx.x; i < K; i += kThreads) {
    const float v = get(i);
    xs[xpos(i, K, q4)] = v;
    if (q4) {
      const float c = warp_sum(v);
      if ((threadIdx.x & 31) == 0) xc[i >> 5] = c;
    }
  }
  __syncthreads();
}

// a Gumbel(0, 1) draw from counter c of stream seed: u from the top 24 bits of a 64-bit mix (splitmix64's
// finalizer) of seed + (c + 1) times the golden ratio, in (0, 1) at 2^-24 steps; g = -log(-log(u))
__device__ __forceinline__ float gumbel(unsigned long long seed, unsigned long long c) {
  unsigned long long z = seed + (c + 1ull) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  const float u = ((float)(uint32_t)(z >> 40) + 0.5f) * 5.9604644775390625e-8f;
  return -logf(-logf(u));
}

// a float's bits as an unsigned key that orders like the float (NaN aside)
__device__ __forceinline__ uint32_t ordered(float v) {
  const uint32_t b = __float_as_uint(v);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// the embedding of token `id` (row `row` of the head's drafting vocabulary when a bf16 row table is given)
__device__ void embed_into(const DraftArgs& a, float* xs, float* xc, const __nv_bfloat16* table, long long row,
                           long long id, int K, bool q4, float* red) {
  const int H = a.H;
  if (table != nullptr) {
    const __nv_bfloat16* er = table + (size_t)row * H;
    rms_into(xs, xc, a.w_ne, H, H, K, q4, a.eps, red, [&](int i) { return __bfloat162float(er[i]); });
  } else {
    const uint8_t* q = a.e_q + (size_t)id * (H / 2);
    const int ng = H / a.e_group;
    const __half* sc = a.e_scale + (size_t)id * ng;
    const __half* mn = a.e_min + (size_t)id * ng;
    rms_into(xs, xc, a.w_ne, H, H, K, q4, a.eps, red, [&](int i) {
      const int code = (q[i >> 1] >> (4 * (i & 1))) & 15;
      const int g = i / a.e_group;
      return (float)code * __half2float(sc[g]) + __half2float(mn[g]);
    });
  }
}

__global__ void __launch_bounds__(kThreads) draft_rollout_kernel(DraftArgs a) {
  extern __shared__ float smem[];
  __shared__ float red[kWarps];
  __shared__ unsigned long long wkey[kWarps];
  const int H = a.H, I = a.I;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gwarp = blockIdx.x * kWarps + warp, nwarps = gridDim.x * kWarps;
  float* xs = smem;                                   // [max(2H, I)] the staged vector
  float* xc = smem + (2 * H > I ? 2 * H : I);         // [max(2H, I) / 32] its chunk sums (int4 layout)
  __shared__ int acc_n;  // (the prologue's n: kept here, a register held across the steps spilled)
  long long tok;  // this step's input token: its id, afterwards its drafting-vocabulary row
  if (a.acc_am != nullptr) {  // the accept prologue: every thread finds n (a few L2 words), block 0 writes
    const int k0 = a.acc_m - 1;
    int n = 0;
    while (n < k0 && (long long)a.acc_am[n] == a.acc_step[1 + n]) ++n;
    tok = a.acc_am[n];
    if (threadIdx.x == 0) acc_n = n;
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      a.acc_vals[0] = n;
      a.acc_vals[1] = tok;
      for (int i = 0; i < k0; ++i) a.acc_vals[2 + i] = a.acc_step[1 + i];
      a.acc_next[0] = tok;
      a.acc_next[a.k + 1] = a.acc_step[a.acc_m] + n + 1;
    }
  } else {
    tok = __ldg(a.tok);
  }
  __syncthreads();  // (acc_n)
  // the traced build's stamps (MK_TRACE): block 0's %globaltimer (ns) at the start, then per step before and after
  // each grid barrier (fc, each MLP block's gate|up and down, the head's keys) and at the step's end:
  // 1 + k * (5 + 4 * nblocks) (lab/draft_trace.py reads them); no code in the shipped build
  int ti = 0;
  auto stamp = [&]() {
    if constexpr (MK_TRACE) {
      if (blockIdx.x == 0 && threadIdx.x == 0 && a.trace != nullptr) {
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        a.trace[ti++] = t;
      }
    }
  };
  stamp();
  for (int j = 0; j < a.k; ++j) {
    // fc over [rmsnorm(h) * w_nh | rmsnorm(e) * w_ne]
    const bool qf = a.fc.q != nullptr;
    if (j == 0) {
      rms_into(xs, xc, a.w_nh, H, 0, 2 * H, qf, a.eps, red, [&](int i) { return __ldg((a.acc_am ? a.acc_resid + (size_t)acc_n * H : a.h0) + i); });
      embed_into(a, xs, xc, a.emb_full, tok, tok, 2 * H, qf, red);
    } else {
      rms_into(xs, xc, a.w_nh, H, 0, 2 * H, qf, a.eps, red, [&](int i) { return __ldcg(a.x + i); });
      embed_into(a, xs, xc, a.embed, tok, a.vocab_ids ? a.vocab_ids[tok] : tok, 2 * H, qf, red);
    }
    for (int r = gwarp; r < H; r += nwarps) {
      const float s = mat_dot(a.fc, r, 2 * H, xs, xc);
      if (lane == 0) a.f[r] = s;
    }
    stamp();
    cg::this_grid().sync();  // (the grid_group object held across the loop spilled 8 bytes)
    stamp();
    for (int b = 0; b < a.nblocks; ++b) {
      float* fcur = b == 0 ? a.f : a.x;  // the block's input: fc's output, then the previous block's
      const bool qg = a.gu[b].q != nullptr, qd = a.down[b].q != nullptr;
      rms_into(xs, xc, a.w_bn[b], H, 0, H, qg, a.eps, red, [&](int i) { return __ldcg(fcur + i); });
      for (int r = gwarp; r < I; r += nwarps) {
        float g, u;
        if (qg) {  // the gate and up rows share the x loads
          const int rr[2] = {r, I + r};
          float o[2];
          dot_q4<2>(a.gu[b], rr, H, xs, xc, o);
          g = o[0], u = o[1];
        } else {
          g = row_dot(a.gu[b].w + (size_t)r * H, xs, H);
          u = row_dot(a.gu[b].w + (size_t)(I + r) * H, xs, H);
        }
        if (lane == 0) a.act[r] = g / (1.f + __expf(-g)) * u;
      }
      stamp();
      cg::this_grid().sync();
      stamp();
      stage_into(xs, xc, I, qd, [&](int i) { return __ldcg(a.act + i); });
      // x = fcur + down(act); for b > 0 fcur is x itself: each row is read then written by one lane only
      for (int r = gwarp; r < H; r += nwarps) {
        const float s = mat_dot(a.down[b], r, I, xs, xc);
        if (lane == 0) a.x[r] = __ldcg(fcur + r) + s;
      }
      stamp();
      cg::this_grid().sync();
      stamp();
    }
    // the head's argmax over the drafting vocabulary on rmsnorm(x) * w_final (the logit scale cannot move it)
    const bool qh = a.head.q != nullptr;
    rms_into(xs, xc, a.w_final, H, 0, H, qh, a.teps, red, [&](int i) { return __ldcg(a.x + i); });
    unsigned long long best = 0ull;
    const unsigned long long seed = a.logits != nullptr ? __ldg(a.seed) : 0ull;
    auto keep = [&](float s, int n) {
      if (a.logits != nullptr) {  // sampling: the logit, then its Gumbel-perturbed key
        const float l = s / a.scale;
        if (lane == 0) a.logits[(size_t)j * a.N + n] = l;
        s = l / a.temp + gumbel(seed, (unsigned long long)j * (unsigned)a.N + (unsigned)n);
      }
      const unsigned long long key = (unsigned long long)ordered(s) << 32 | (0xffffffffu - (uint32_t)n);
      best = key > best ? key : best;
    };
    int n = gwarp;
    if (qh)  // two rows a pass where the warp has two (they share the x loads)
      for (; n + nwarps < a.N; n += 2 * nwarps) {
        const int rr[2] = {n, n + nwarps};
        float o[2];
        dot_q4<2>(a.head, rr, H, xs, xc, o);
        keep(o[0], rr[0]);
        keep(o[1], rr[1]);
      }
    for (; n < a.N; n += nwarps) keep(mat_dot(a.head, n, H, xs, xc), n);
    if (lane == 0) wkey[warp] = best;
    __syncthreads();
    if (threadIdx.x == 0) {
      unsigned long long m = 0ull;
      for (int w = 0; w < kWarps; ++w) m = wkey[w] > m ? wkey[w] : m;
      a.keys[blockIdx.x] = m;
    }
    stamp();
    cg::this_grid().sync();
    stamp();
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
    stamp();
  }
}

}  // namespace

// a Mat's slots: 4 pointers (w, q, s, m) and its group size (0 for bf16)
static const void* const* take_mat(Mat& A, const void* const* p, long long G) {
  A.w = (const __nv_bfloat16*)p[0];
  A.q = (const uint8_t*)p[1];
  A.s = (const __half*)p[2];
  A.m = (const __half*)p[3];
  A.G = (int)G;
  return p + 4;
}

// one format, and an int4 group size the dot handles (G in 32, 64, 128 dividing K)
static bool mat_ok(const Mat& A, int K) {
  if ((A.w == nullptr) == (A.q == nullptr)) return false;
  if (A.w != nullptr) return A.G == 0 && K % 8 == 0;
  return A.s != nullptr && A.m != nullptr && (A.G == 32 || A.G == 64 || A.G == 128) && K % A.G == 0;
}

// ints: H, I, N, nblocks, k, e_group, then the group sizes of fc, gu[kMaxBlocks], down[kMaxBlocks], head (0: bf16).
// ptrs, in order: fc (w, q, s, m), w_nh, w_ne, w_bn[kMaxBlocks], gu[kMaxBlocks] (4 each), down[kMaxBlocks] (4 each),
// w_final, head (4), head's row ids, embed, vocab_ids, tok, emb_full, e_q, e_scale, e_min, h0, f, act, x, keys, out,
// logits (null: greedy), seed, trace, then the accept prologue's acc_am (null: none), acc_step, acc_resid, acc_vals,
// acc_next (ints[16]: acc_m). floats: eps, the target's eps, the logit scale, the temperature (sampling).
extern "C" int flint_draft_rollout(const long long* ints, const void* const* ptrs, const float* floats, void* stream) {
  DraftArgs a{};
  a.H = (int)ints[0]; a.I = (int)ints[1]; a.N = (int)ints[2]; a.nblocks = (int)ints[3]; a.k = (int)ints[4];
  a.e_group = (int)ints[5];
  const long long* gs = ints + 6;
  if (a.H <= 0 || a.I <= 0 || a.N <= 0 || a.k <= 0 || a.H % 8 || a.I % 8 || a.nblocks < 1 || a.nblocks > kMaxBlocks ||
      (a.e_group > 0 && a.H % a.e_group))
    return (int)cudaErrorInvalidValue;
  const void* const* p = take_mat(a.fc, ptrs, gs[0]);
  a.w_nh = (const __nv_bfloat16*)*p++;
  a.w_ne = (const __nv_bfloat16*)*p++;
  for (int b = 0; b < kMaxBlocks; ++b) a.w_bn[b] = (const __nv_bfloat16*)*p++;
  for (int b = 0; b < kMaxBlocks; ++b) p = take_mat(a.gu[b], p, gs[1 + b]);
  for (int b = 0; b < kMaxBlocks; ++b) p = take_mat(a.down[b], p, gs[1 + kMaxBlocks + b]);
  a.w_final = (const __nv_bfloat16*)*p++;
  p = take_mat(a.head, p, gs[1 + 2 * kMaxBlocks]);
  a.head.rows = (const long long*)*p++;
  a.embed = (const __nv_bfloat16*)*p++;
  a.vocab_ids = (const long long*)*p++;
  a.tok = (const long long*)*p++;
  a.emb_full = (const __nv_bfloat16*)*p++;
  a.e_q = (const uint8_t*)*p++;
  a.e_scale = (const __half*)*p++;
  a.e_min = (const __half*)*p++;
  a.h0 = (const float*)*p++;
  a.f = (float*)*p++;
  a.act = (float*)*p++;
  a.x = (float*)*p++;
  a.keys = (unsigned long long*)*p++;
  a.out = (long long*)*p++;
  a.logits = (float*)*p++;
  a.seed = (const unsigned long long*)*p++;
  a.trace = (unsigned long long*)*p++;
  a.acc_am = (const int*)*p++;
  a.acc_step = (const long long*)*p++;
  a.acc_resid = (const float*)*p++;
  a.acc_vals = (long long*)*p++;
  a.acc_next = (long long*)*p++;
  a.acc_m = (int)ints[6 + 2 + 2 * kMaxBlocks];
  a.eps = floats[0];
  a.teps = floats[1];
  a.scale = floats[2];
  a.temp = floats[3];
  bool ok = mat_ok(a.fc, 2 * a.H) && (a.fc.q == nullptr || a.H % 32 == 0) && mat_ok(a.head, a.H) && (a.head.rows == nullptr || a.head.q != nullptr);
  for (int b = 0; b < a.nblocks; ++b) ok = ok && mat_ok(a.gu[b], a.H) && mat_ok(a.down[b], a.I);
  // the first token from a bf16 table or the int4 layout; the proposals from the bf16 rows or the int4 layout
  ok = ok && (a.emb_full != nullptr || a.e_q != nullptr) && (a.embed != nullptr || a.e_q != nullptr);
  ok = ok && (a.e_q == nullptr || (a.e_scale != nullptr && a.e_min != nullptr && a.e_group > 0));
  ok = ok && (a.logits == nullptr || (a.seed != nullptr && a.scale > 0.f && a.temp > 0.f));
  // the prologue: greedy, all its buffers, the rollout's proposals written into the next verify's buffer
  ok = ok && (a.acc_am == nullptr ? a.tok != nullptr && a.h0 != nullptr
                                  : a.logits == nullptr && a.acc_step && a.acc_resid && a.acc_vals && a.acc_next &&
                                        a.acc_m >= 1 && a.acc_m <= 64 && a.out == a.acc_next + 1);
  if (!ok) return (int)cudaErrorInvalidValue;
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return (int)e;
  const size_t xn = (size_t)(2 * a.H > a.I ? 2 * a.H : a.I);
  const size_t smem = sizeof(float) * (xn + xn / 32 + 1);  // the staged vector and its chunk sums
  // the launch's checks, once per (device, shared-memory size): they cost as much as the launch
  static struct { int sms; size_t smem; } done[kMaxDevices] = {};
  if (dev < 0 || dev >= kMaxDevices) return (int)cudaErrorInvalidDevice;
  if (done[dev].sms == 0 || done[dev].smem < smem) {
    int sms = 0, per_sm = 0;
    e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (e == cudaSuccess && smem > 48 * 1024)
      e = cudaFuncSetAttribute(draft_rollout_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e == cudaSuccess) e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, draft_rollout_kernel, kThreads, smem);
    if (e != cudaSuccess) return (int)e;
    if (per_sm < 1) return (int)cudaErrorInvalidConfiguration;
    done[dev].sms = sms;
    done[dev].smem = smem;
  }
  const int sms = done[dev].sms;
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
