// flint decode megakernel: one persistent cooperative launch runs a whole int4 decode step
// (embedding -> L x [rmsnorm, qkv+rope+kv-append, attention, o-proj, rmsnorm, gate/up+silu, down]
// -> final norm -> lm_head -> argmax) for M tokens at once (M = FLINT_MK_M, 1..8; one object per M).
//
// Per block (one per SM): warp 15 is the PRODUCER: one lane streams this block's share of every
// weight matrix of the whole step, in a fixed order, into a ring of 16 KB shared-memory slots with
// cp.async.bulk (TMA 1-D) completing on mbarriers. Weights do not depend on activations, so it
// runs ahead across grid barriers; only ring space stops it. Warps 0..14 are CONSUMERS: they stage
// the stage's input vector into smem (recomputing RMSNorm per block), compute row pairs from the
// ring, run the epilogue (RoPE + KV append / residual add / silu*up / logits) and meet at grid
// barriers (a monotonic counter; the producer never waits on them).
//
// Sections: [1] PTX helpers  [2] grid barrier  [3] producer  [4] x staging  [5] int4 row-pair dot
//           [6] matvec stage + epilogues  [7] attention  [8] kernel  [9] launch entry point
// Build: python -m flint.kernels.build      Test: pytest tests/test_megakernel.py
#include "mk_common.cuh"

#ifndef FLINT_MK_M
#define FLINT_MK_M 1
#endif
#define MK_CAT2(a, b) a##b
#define MK_CAT(a, b) MK_CAT2(a, b)

namespace mk {
namespace {  // internal linkage: this file is compiled once per M into one library

// =====================================================================[1] PTX helpers
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.shared::cta.b64 st, [%0];\n}" ::"r"(smem_u32(bar))
               : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}" ::"r"(
                   smem_u32(bar)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred p;\n WAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra WAIT_%=;\n}" ::"r"(
          smem_u32(bar)),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar,
                                         uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(
          smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar)), "l"(policy)
      : "memory");
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ float4 lds128(uint32_t a) {
  float4 v;
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(a));
  return v;
}
__device__ __forceinline__ uint2 lds64(uint32_t a) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(a));
  return v;
}
__device__ __forceinline__ uint32_t lds32(uint32_t a) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(a));
  return v;
}
__device__ __forceinline__ float ldsf(uint32_t a) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(a));
  return v;
}
// (a & mask) | magic in ONE LOP3 (the compiler splits it when both are immediates)
template <uint32_t MASK>
__device__ __forceinline__ float nib(uint32_t a, uint32_t magic) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "n"(MASK), "r"(magic));
  return __uint_as_float(d) - 8388608.f;
}
// barrier among the 512 consumer threads only (the producer warp never joins)
__device__ __forceinline__ void cbar() { asm volatile("bar.sync 1, %0;" ::"n"(NCT) : "memory"); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// x prescale so that a nibble masked in place at bits 4i (i = k % 4) needs no shift (see [5])
__device__ __forceinline__ float prescale(int k) { return __int_as_float((127 - 4 * (k & 3)) << 23); }

// =====================================================================[2] grid barrier
// Consumers of every block arrive once per barrier; thread 0 spins on an acquire load. The counter
// only grows: barrier b of launch e completes at nblocks * (e * S + b + 1), S = barriers per launch.
__device__ __forceinline__ void grid_barrier(const Params& p, unsigned long long target) {
  cbar();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(p.bar_counter, 1ull);
    unsigned long long v;
    do {
      asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p.bar_counter) : "memory");
    } while (v < target);
  }
  cbar();
}

// block b's share of a matrix: row pairs [pb0, pb1)
__device__ __forceinline__ void block_pairs(int N, int nb, int b, int& pb0, int& pb1) {
  long long P = N / 2;
  pb0 = (int)(P * b / nb);
  pb1 = (int)(P * (b + 1) / nb);
}

// =====================================================================[3] producer
struct Ring {
  uint8_t* slots;
  uint64_t* full;
  uint64_t* empty;
  int nslots;
};

__device__ void produce_matrix(const Mat& mt, int layer, const Ring& ring, uint32_t& q, uint64_t pol,
                               int nb) {
  int pb0, pb1;
  block_pairs(mt.N, nb, blockIdx.x, pb0, pb1);
  const int ppc = mt.rpc / 2;
  const uint8_t* lbase = mt.base + (long long)layer * mt.layer_stride;
  for (int rb0 = pb0; rb0 < pb1; rb0 += ACC_PAIRS) {
    const int rb1 = min(pb1, rb0 + ACC_PAIRS);
    for (int s = 0; s < mt.nseg; ++s) {
      for (int c0 = rb0; c0 < rb1; c0 += ppc) {
        const int c1 = min(rb1, c0 + ppc);
        const uint32_t bytes = (uint32_t)((c1 - c0) * 2 * mt.srb);
        const int slot = q % ring.nslots;
        const uint32_t fill = q / ring.nslots;
        if (fill > 0) mbar_wait(&ring.empty[slot], (fill - 1) & 1);
        mbar_expect_tx(&ring.full[slot], bytes);
        bulk_g2s(ring.slots + (size_t)slot * SLOT_BYTES,
                 lbase + (long long)s * mt.seg_stride + (long long)c0 * 2 * mt.srb, bytes, &ring.full[slot],
                 pol);
        ++q;
      }
    }
  }
}

__device__ void producer(const Params& p, const Ring& ring) {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  uint32_t q = 0;
  for (int l = 0; l < p.L; ++l)
    for (int m = MAT_QKV; m <= MAT_D; ++m) produce_matrix(p.mat[m], l, ring, q, pol, p.nblocks);
  produce_matrix(p.mat[MAT_LM], 0, ring, q, pol, p.nblocks);
}

// =====================================================================[4] x staging
// The stage's input vector segment [k0, k0 + kseg) for every token goes to smem, prescaled, with
// sums of the unscaled values per 16 codes (sum_k (q s + m) x = s sum q x + m sum x).
template <int M>
struct Stage {
  float* x;      // [M][kseg]
  float* xsum;   // [M][kseg / 16]
  MiscSmem* misc;
};

// rstd per token of the vector rows src[m] (length H), block-wide deterministic reduction.
// Loads are unrolled UNR deep so a thread's L2 round trips overlap (one latency, not H / 480).
constexpr int UNR = 8;
template <int M>
__device__ void compute_rstd(const Params& p, const float* const* src, float mult, MiscSmem* misc) {
  const int t = threadIdx.x, lane = t & 31, w = t >> 5;
#pragma unroll
  for (int m = 0; m < M; ++m) {
    float s = 0.f;
    for (int base = t; base < p.H; base += NCT * UNR) {
      float v[UNR];
#pragma unroll
      for (int u = 0; u < UNR; ++u) {
        const int k = base + u * NCT;
        v[u] = k < p.H ? __ldcg(src[m] + k) * mult : 0.f;
      }
#pragma unroll
      for (int u = 0; u < UNR; ++u) s = fmaf(v[u], v[u], s);
    }
    s = warp_sum(s);
    if (lane == 0) misc->red[w][m] = s;
  }
  cbar();
  if (t < M) {
    float s = 0.f;
    for (int i = 0; i < NCW; ++i) s += misc->red[i][t];
    misc->rstd[t] = rsqrtf(s / (float)p.H + p.eps);
  }
  cbar();
}

// norm_w == nullptr: plain copy (attention output / act); else rmsnorm(src * mult) * norm_w
template <int M>
__device__ void stage_x(const Stage<M>& st, const float* const* src, float mult, const float* norm_w,
                        int k0, int kseg, int G, int gshift) {
  const int t = threadIdx.x;
  constexpr int U = M <= 2 ? UNR : 2;  // register budget of the larger-M kernels
  for (int base = t; base < M * kseg; base += NCT * U) {
    float v[U], wv[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = base + u * NCT;
      const int m = i / kseg, k = i - m * kseg;
      v[u] = i < M * kseg ? __ldcg(src[min(m, M - 1)] + k0 + k) : 0.f;
      wv[u] = (norm_w && i < M * kseg) ? __ldg(norm_w + k0 + k) : 1.f;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = base + u * NCT;
      if (i < M * kseg) {
        const int m = i / kseg, k = i - m * kseg;
        float x = v[u];
        if (norm_w) x = ((x * mult) * st.misc->rstd[m]) * wv[u];
        st.x[i] = x * prescale(k);
      }
    }
  }
  cbar();
  // sums of the unscaled x per 16-code step (the min term is added once per step, see [5])
  const int ns = kseg >> 4;
  for (int task = t; task < M * ns; task += NCT) {
    const int m = task / ns, j = task - m * ns;
    const float4* xp = reinterpret_cast<const float4*>(st.x + m * kseg + j * 16);
    float s = 0.f;
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      const float4 a = xp[v];
      s += a.x + a.y * 16.f + a.z * 256.f + a.w * 4096.f;
    }
    st.xsum[task] = s;
  }
  cbar();
}

// =====================================================================[5] int4 row-pair dot
// One warp, two rows of one chunk, MB tokens. Lane handles 16 codes (8 bytes) per step. A nibble
// at bits 4i of a word, OR-ed into the mantissa of 2^23, minus 2^23, is exactly q * 16^i; x was
// prescaled by 16^-(k%4) so the product is exactly q * x. 3 ops per code (LOP3, FADD, FFMA).
extern __shared__ __align__(1024) uint8_t mk_smem[];

// One warp, two rows of one chunk, MB tokens; lane handles 16 codes per step, steps st = lane + 32j.
// Operands are byte offsets into mk_smem so the compiler knows they are shared (LDS) and may hoist
// the next step's loads above the current step's math (unroll 2).
template <int MB>
__device__ __forceinline__ void dot_pair(uint32_t r0, int srb, int kseg, int gshift, uint32_t xs, int xstride,
                                         uint32_t xsum, int gstride, int mvalid, int lane, float (&acc)[2][MB]) {
  const int nsteps = kseg >> 4;
  const uint32_t smoff = (uint32_t)(kseg >> 1);
  uint32_t magic;
  asm("mov.b32 %0, 0x4B000000;" : "=r"(magic));
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int m = 0; m < MB; ++m) acc[r][m] = 0.f;
#pragma unroll (MB <= 2 ? 2 : 1)
  for (int st = lane; st < nsteps; st += 32) {
    const int k0 = st << 4;
    const int g = k0 >> gshift;
    float x[MB][16];
    float xg[MB];
#pragma unroll
    for (int m = 0; m < MB; ++m) {
      if (m < mvalid) {
        const float4* xa = reinterpret_cast<const float4*>(mk_smem + xs + (uint32_t)(m * xstride + k0) * 4u);
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          const float4 t = xa[v];
          x[m][4 * v] = t.x; x[m][4 * v + 1] = t.y; x[m][4 * v + 2] = t.z; x[m][4 * v + 3] = t.w;
        }
        xg[m] = *reinterpret_cast<const float*>(mk_smem + xsum + (uint32_t)(m * gstride + st) * 4u);
      } else {
#pragma unroll
        for (int v = 0; v < 16; ++v) x[m][v] = 0.f;
        xg[m] = 0.f;
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint8_t* rp = mk_smem + r0 + (uint32_t)(r * srb);
      const uint2 cw = *reinterpret_cast<const uint2*>(rp + (st << 3));
      const __half2 sm = *reinterpret_cast<const __half2*>(rp + smoff + (g << 2));
      const float sc = __low2float(sm), mn = __high2float(sm);
      float d0[MB], d1[MB];  // two chains (low / high half-words) for ILP
#pragma unroll
      for (int m = 0; m < MB; ++m) { d0[m] = 0.f; d1[m] = 0.f; }
#pragma unroll
      for (int wi = 0; wi < 2; ++wi) {
        const uint32_t w = wi ? cw.y : cw.x;
        const uint32_t hi = w >> 16;
        const float f0 = nib<0xFu>(w, magic), f1 = nib<0xF0u>(w, magic);
        const float f2 = nib<0xF00u>(w, magic), f3 = nib<0xF000u>(w, magic);
        const float h0 = nib<0xFu>(hi, magic), h1 = nib<0xF0u>(hi, magic);
        const float h2 = nib<0xF00u>(hi, magic), h3 = nib<0xF000u>(hi, magic);
#pragma unroll
        for (int m = 0; m < MB; ++m) {
          const float* xm = &x[m][wi * 8];
          d0[m] = fmaf(f0, xm[0], d0[m]); d1[m] = fmaf(h0, xm[4], d1[m]);
          d0[m] = fmaf(f1, xm[1], d0[m]); d1[m] = fmaf(h1, xm[5], d1[m]);
          d0[m] = fmaf(f2, xm[2], d0[m]); d1[m] = fmaf(h2, xm[6], d1[m]);
          d0[m] = fmaf(f3, xm[3], d0[m]); d1[m] = fmaf(h3, xm[7], d1[m]);
        }
      }
#pragma unroll
      for (int m = 0; m < MB; ++m) acc[r][m] = fmaf(sc, d0[m] + d1[m], fmaf(mn, xg[m], acc[r][m]));
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int m = 0; m < MB; ++m) acc[r][m] = warp_sum(acc[r][m]);
}

// =====================================================================[6] matvec stage + epilogues
template <int M>
struct Ctx {
  const Params* p;
  Ring ring;
  uint32_t q;          // chunk sequence number (must match the producer's)
  Stage<M> st;
  float* acc;          // [2 * ACC_PAIRS][M]
  MiscSmem* misc;
  int start;
  const float* tok_src[M];  // embedding rows of the tokens
};

__device__ __forceinline__ float silu(float g) { return g / (1.f + expf(-g)); }

// Epilogue for rows of pairs [rb0, rb1) of matrix `mi`; acc rows are local to the row block.
template <int M>
__device__ void epilogue(Ctx<M>& c, int mi, int layer, int rb0, int rb1) {
  const Params& p = *c.p;
  const int npairs = rb1 - rb0;
  const int t = threadIdx.x;
  for (int i = t; i < npairs * M; i += NCT) {
    const int lp = i / M, m = i - lp * M;
    const int pair = rb0 + lp;
    const float a = c.acc[(2 * lp) * M + m], b = c.acc[(2 * lp + 1) * M + m];
    const int pos = c.start + m;
    if (mi == MAT_QKV) {
      const int n0 = 2 * pair;
      const int qd = p.nh * p.D, kd = p.nkv * p.D;
      if (n0 < qd + kd) {  // q or k: rows were permuted so a pair is (i, i + D/2) of one head
        const int nn = n0 < qd ? n0 : n0 - qd;
        const int head = nn / p.D, ip = (nn % p.D) >> 1, half = p.D >> 1;
        float o1 = a, o2 = b;
        if (p.use_rope) {
          const float cs = __ldg(p.rope_cos + (size_t)pos * half + ip);
          const float sn = __ldg(p.rope_sin + (size_t)pos * half + ip);
          o1 = a * cs - b * sn;
          o2 = b * cs + a * sn;
        }
        if (n0 < qd) {
          float* qp = p.q + (size_t)m * qd + head * p.D;
          qp[ip] = o1;
          qp[ip + half] = o2;
        } else {
          __half* kp = p.kcache + ((((size_t)layer * p.nkv + head) * p.max_seq + pos) * p.D);
          kp[ip] = __float2half_rn(o1);
          kp[ip + half] = __float2half_rn(o2);
        }
      } else {  // v: natural row order
        const int nn = n0 - qd - kd;
        const int head = nn / p.D, d0 = nn % p.D;
        __half* vp = p.vcache + ((((size_t)layer * p.nkv + head) * p.max_seq + pos) * p.D) + d0;
        vp[0] = __float2half_rn(a);
        vp[1] = __float2half_rn(b);
      }
    } else if (mi == MAT_O || mi == MAT_D) {
      const int n0 = 2 * pair;
      float* rp = p.resid + (size_t)m * p.H;
      rp[n0] = rp[n0] + p.res_mult * a;
      if (n0 + 1 < p.H) rp[n0 + 1] = rp[n0 + 1] + p.res_mult * b;
    } else if (mi == MAT_GU) {  // rows interleaved gate_j, up_j
      p.act[(size_t)m * p.I + pair] = silu(a) * b;
    } else {  // MAT_LM
      const int n0 = 2 * pair;
      float* lp_ = p.logits + (size_t)m * p.V;
      const float l0 = a * p.inv_logit_scale, l1 = b * p.inv_logit_scale;
      lp_[n0] = l0;
      c.acc[(2 * lp) * M + m] = l0;
      if (n0 + 1 < p.V) lp_[n0 + 1] = l1;
      c.acc[(2 * lp + 1) * M + m] = (n0 + 1 < p.V) ? l1 : -INFINITY;
    }
  }
  if (mi == MAT_LM) {  // running argmax per token over this block's rows (first index wins ties)
    cbar();
    const int w = t >> 5, lane = t & 31;
    if (w < M) {
      float bv = -INFINITY;
      int bi = 0x7fffffff;
      for (int r = lane; r < 2 * npairs; r += 32) {
        const float v = c.acc[r * M + w];
        if (v > bv) { bv = v; bi = 2 * rb0 + r; }
      }
#pragma unroll
      for (int o = 16; o; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
      }
      if (lane == 0 && (bv > c.misc->best_val[w] || (bv == c.misc->best_val[w] && bi < c.misc->best_idx[w]))) {
        c.misc->best_val[w] = bv;
        c.misc->best_idx[w] = bi;
      }
    }
  }
}

// One matrix stage: consume this block's chunks (same order as produce_matrix), run epilogues.
template <int M>
__device__ void matvec_stage(Ctx<M>& c, int mi, int layer, const float* const* src, float mult,
                             const float* norm_w) {
  const Params& p = *c.p;
  const Mat& mt = p.mat[mi];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int pb0, pb1;
  block_pairs(mt.N, p.nblocks, blockIdx.x, pb0, pb1);
  const int ppc = mt.rpc / 2;
  const int nst = mt.kseg >> 4;
  constexpr int MB = M <= 2 ? M : (M % 3 == 0 ? 3 : 2);  // register budget: x is 16 * MB floats
  bool staged = false;
  for (int rb0 = pb0; rb0 < pb1; rb0 += ACC_PAIRS) {
    const int rb1 = min(pb1, rb0 + ACC_PAIRS);
    for (int s = 0; s < mt.nseg; ++s) {
      if (!staged || mt.nseg > 1) {
        stage_x<M>(c.st, src, mult, norm_w, s * mt.kseg, mt.kseg, mt.G, mt.gshift);
        staged = true;
      }
      for (int c0 = rb0; c0 < rb1; c0 += ppc) {
        const int c1 = min(rb1, c0 + ppc);
        const int slot = c.q % c.ring.nslots;
        mbar_wait(&c.ring.full[slot], (c.q / c.ring.nslots) & 1);
        const uint8_t* base = c.ring.slots + (size_t)slot * SLOT_BYTES;
        // pair index within the row block decides the warp: the same warp owns a pair in every segment
        int first = c0 - rb0;
        int pi = first + ((warp - first) % NCW + NCW) % NCW;
        for (; pi < c1 - rb0; pi += NCW) {
          const uint32_t r0 = (uint32_t)(base - mk_smem) + (uint32_t)((pi - first) * 2 * mt.srb);
#pragma unroll
          if (p.dbg & 1) continue;  // debug: stream + barriers only
#pragma unroll 1
          for (int tb = 0; tb < M; tb += MB) {
            float acc[2][MB];
            dot_pair<MB>(r0, mt.srb, mt.kseg, mt.gshift,
                         (uint32_t)(reinterpret_cast<const uint8_t*>(c.st.x + tb * mt.kseg) - mk_smem), mt.kseg,
                         (uint32_t)(reinterpret_cast<const uint8_t*>(c.st.xsum + tb * nst) - mk_smem), nst,
                         M - tb, lane, acc);
            if (lane == 0) {
#pragma unroll
              for (int r = 0; r < 2; ++r)
#pragma unroll
                for (int m = 0; m < MB; ++m) {
                  if (tb + m < M) {
                    float* ap = c.acc + (2 * pi + r) * M + tb + m;
                    *ap = (s == 0) ? acc[r][m] : *ap + acc[r][m];
                  }
                }
            }
          }
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(&c.ring.empty[slot]);
        ++c.q;
      }
      cbar();  // acc complete for this segment; x may be restaged
    }
    epilogue<M>(c, mi, layer, rb0, rb1);
    cbar();
  }
}

// =====================================================================[7] attention
// Work item = (kv head, contiguous split of the context). All query heads of the group and all M
// tokens are processed together so K/V are read once. Sub-tiles of ATT_T keys are double-buffered
// with cp.async; online softmax in fp32. Splits are merged by the last block to finish (counter).
template <int M>
__device__ void attention_stage(Ctx<M>& c, int layer, uint8_t* uni) {
  const Params& p = *c.p;
  const int D = p.D, g = p.nh / p.nkv, R = g * M;
  const int start = c.start, Ltot = start + M;
  const int t = threadIdx.x, warp = t >> 5, lane = t & 31;
  const int ntiles = (Ltot + ATT_T - 1) / ATT_T;
  int nsplit = min(ntiles, max(1, p.nblocks / p.nkv));
  const int tps = (ntiles + nsplit - 1) / nsplit;
  nsplit = (ntiles + tps - 1) / tps;
  const int nitems = p.nkv * nsplit;
  const int cpr = D / 8;  // 16-byte chunks per K/V row

  __half* Kb = reinterpret_cast<__half*>(uni);              // [2][ATT_T][D] (swizzled 16B chunks)
  __half* Vb = Kb + 2 * ATT_T * D;                          // [2][ATT_T][D]
  float* q_s = reinterpret_cast<float*>(Vb + 2 * ATT_T * D); // [R][D]
  float* o_s = q_s + R * D;                                 // [R][D]
  float* s_s = o_s + R * D;                                 // [R][ATT_T]
  MiscSmem* ms = c.misc;

  for (int item = blockIdx.x; item < nitems; item += gridDim.x) {
    const int kvh = item / nsplit, sp = item % nsplit;
    const int t0 = sp * tps, t1 = min(ntiles, t0 + tps);
    const size_t cbase = (((size_t)layer * p.nkv + kvh) * p.max_seq) * D;
    const __half* Kc = p.kcache + cbase;
    const __half* Vc = p.vcache + cbase;
    auto load_tile = [&](int tile, int buf) {
      const int j0 = tile * ATT_T;
      for (int i = t; i < ATT_T * cpr * 2; i += NCT) {
        const int isv = i >= ATT_T * cpr;
        const int ii = isv ? i - ATT_T * cpr : i;
        const int j = ii / cpr, ch = ii % cpr;
        if (j0 + j < Ltot) {
          if (isv)
            cp_async16(Vb + ((size_t)buf * ATT_T + j) * D + ch * 8, Vc + (size_t)(j0 + j) * D + ch * 8);
          else
            cp_async16(Kb + ((size_t)buf * ATT_T + j) * D + ((ch ^ (j & 7)) * 8), Kc + (size_t)(j0 + j) * D + ch * 8);
        }
      }
      cp_async_commit();
    };
    load_tile(t0, 0);
    for (int i = t; i < R * D; i += NCT) {
      const int r = i / D, d = i - r * D;
      const int hq = kvh * g + r / M, m = r % M;
      q_s[i] = __ldcg(p.q + (size_t)m * p.nh * D + hq * D + d) * p.attn_scale;
      o_s[i] = 0.f;
    }
    if (t < R) { ms->att_m[t] = -INFINITY; ms->att_l[t] = 0.f; }
    for (int tile = t0; tile < t1; ++tile) {
      const int buf = (tile - t0) & 1;
      if (tile + 1 < t1) { load_tile(tile + 1, buf ^ 1); cp_async_wait<1>(); }
      else cp_async_wait<0>();
      cbar();
      const int j0 = tile * ATT_T;
      const int nvalid = min(ATT_T, Ltot - j0);
      const __half* Kt = Kb + (size_t)buf * ATT_T * D;
      const __half* Vt = Vb + (size_t)buf * ATT_T * D;
      // scores: lanes over keys, warps over (row, key half)
      for (int task = warp; task < R * 2; task += NCW) {
        const int r = task >> 1, j = (task & 1) * 32 + lane;
        const int m = r % M;
        float s = -INFINITY;
        if (j < nvalid && j0 + j <= start + m) {
          const float* qr = q_s + r * D;
          float a0 = 0.f, a1 = 0.f;
          for (int ch = 0; ch < cpr; ++ch) {
            const uint4 kk = *reinterpret_cast<const uint4*>(Kt + (size_t)j * D + ((ch ^ (j & 7)) * 8));
            const float4 qa = *reinterpret_cast<const float4*>(qr + ch * 8);
            const float4 qb = *reinterpret_cast<const float4*>(qr + ch * 8 + 4);
            const float2 k0 = __half22float2(*reinterpret_cast<const __half2*>(&kk.x));
            const float2 k1 = __half22float2(*reinterpret_cast<const __half2*>(&kk.y));
            const float2 k2 = __half22float2(*reinterpret_cast<const __half2*>(&kk.z));
            const float2 k3 = __half22float2(*reinterpret_cast<const __half2*>(&kk.w));
            a0 = fmaf(qa.x, k0.x, a0); a1 = fmaf(qa.y, k0.y, a1);
            a0 = fmaf(qa.z, k1.x, a0); a1 = fmaf(qa.w, k1.y, a1);
            a0 = fmaf(qb.x, k2.x, a0); a1 = fmaf(qb.y, k2.y, a1);
            a0 = fmaf(qb.z, k3.x, a0); a1 = fmaf(qb.w, k3.y, a1);
          }
          s = a0 + a1;
        }
        s_s[r * ATT_T + j] = s;
      }
      cbar();
      // online softmax statistics: warp per row
      for (int r = warp; r < R; r += NCW) {
        const float v0 = s_s[r * ATT_T + lane], v1 = s_s[r * ATT_T + lane + 32];
        const float mo = ms->att_m[r];
        const float mn = fmaxf(mo, warp_max(fmaxf(v0, v1)));
        float p0 = 0.f, p1 = 0.f, alpha = 1.f;
        if (mn != -INFINITY) {
          p0 = expf(v0 - mn);
          p1 = expf(v1 - mn);
          alpha = expf(mo - mn);
        }
        s_s[r * ATT_T + lane] = p0;
        s_s[r * ATT_T + lane + 32] = p1;
        const float ps = warp_sum(p0 + p1);
        if (lane == 0) {
          ms->att_l[r] = ms->att_l[r] * alpha + ps;
          ms->att_m[r] = mn;
          ms->att_alpha[r] = alpha;
        }
      }
      cbar();
      // o = o * alpha + P V: warp per row, lanes over dim pairs
      for (int r = warp; r < R; r += NCW) {
        const float alpha = ms->att_alpha[r];
        const float* pr = s_s + r * ATT_T;
        for (int d2 = lane; d2 < D / 2; d2 += 32) {
          float ox = o_s[r * D + 2 * d2] * alpha, oy = o_s[r * D + 2 * d2 + 1] * alpha;
          for (int j = 0; j < nvalid; ++j) {
            const float pj = pr[j];
            const float2 vv = __half22float2(*reinterpret_cast<const __half2*>(Vt + (size_t)j * D + 2 * d2));
            ox = fmaf(pj, vv.x, ox);
            oy = fmaf(pj, vv.y, oy);
          }
          o_s[r * D + 2 * d2] = ox;
          o_s[r * D + 2 * d2 + 1] = oy;
        }
      }
      cbar();
    }
    // write the result (one split) or the partial (m, l, o) for the merge
    if (nsplit == 1) {
      for (int i = t; i < R * D; i += NCT) {
        const int r = i / D, d = i - r * D;
        const int hq = kvh * g + r / M, m = r % M;
        p.attn[(size_t)m * p.nh * D + hq * D + d] = o_s[i] / ms->att_l[r];
      }
    } else {
      float* pp = p.part + ((size_t)(kvh * nsplit + sp) * R) * (D + 2);
      for (int i = t; i < R * (D + 2); i += NCT) {
        const int r = i / (D + 2), d = i - r * (D + 2);
        pp[i] = d == 0 ? ms->att_m[r] : d == 1 ? ms->att_l[r] : o_s[r * D + d - 2];
      }
      cbar();
      if (t == 0) {
        __threadfence();
        const int old = atomicAdd(p.att_count + kvh, 1);
        ms->flag = (old == nsplit - 1);
        if (ms->flag) __threadfence();
      }
      cbar();
      if (ms->flag) {  // last split done: merge all splits of this kv head in split order
        const float* pk = p.part + ((size_t)kvh * nsplit * R) * (D + 2);
        for (int i = t; i < R * D; i += NCT) {
          const int r = i / D, d = i - r * D;
          float mx = -INFINITY;
          for (int s2 = 0; s2 < nsplit; ++s2) mx = fmaxf(mx, __ldcg(pk + ((size_t)s2 * R + r) * (D + 2)));
          float num = 0.f, den = 0.f;
          for (int s2 = 0; s2 < nsplit; ++s2) {
            const float* e = pk + ((size_t)s2 * R + r) * (D + 2);
            const float ms2 = __ldcg(e);
            const float wgt = ms2 == -INFINITY ? 0.f : expf(ms2 - mx);
            den = fmaf(wgt, __ldcg(e + 1), den);
            num = fmaf(wgt, __ldcg(e + 2 + d), num);
          }
          const int hq = kvh * g + r / M, m = r % M;
          p.attn[(size_t)m * p.nh * D + hq * D + d] = num / den;
        }
        if (t == 0) p.att_count[kvh] = 0;
      }
    }
    cbar();
  }
}

// =====================================================================[8] kernel
template <int M>
__global__ void __launch_bounds__(NT, 1)
    decode_kernel(const __grid_constant__ Params p, const __grid_constant__ Smem sl, int start,
                  const long long* tokens, int tok0) {
  uint8_t* smem = mk_smem;
  Ring ring;
  ring.slots = smem + sl.ring;
  ring.full = reinterpret_cast<uint64_t*>(smem + sl.bars);
  ring.empty = ring.full + MAX_SLOTS;
  ring.nslots = sl.nslots;
  if (threadIdx.x == 0) {
    for (int i = 0; i < ring.nslots; ++i) {
      mbar_init(&ring.full[i], 1);
      mbar_init(&ring.empty[i], NCW);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x >= NCT) {  // producer warp
    if (threadIdx.x == NCT) producer(p, ring);
    return;
  }
  Ctx<M> c;
  c.p = &p;
  c.ring = ring;
  c.q = 0;
  c.misc = reinterpret_cast<MiscSmem*>(smem + sl.misc);
  c.acc = reinterpret_cast<float*>(smem + sl.acc);
  c.st.x = reinterpret_cast<float*>(smem + sl.uni);
  c.st.xsum = reinterpret_cast<float*>(smem + sl.xsum);
  c.st.misc = c.misc;
  c.start = start;
  const unsigned long long epoch = __ldcg(p.epoch);
  const unsigned long long S = 5ull * p.L;
  unsigned long long nbar = 0;
  auto gsync = [&]() { ++nbar; grid_barrier(p, (unsigned long long)p.nblocks * (epoch * S + nbar)); };

  const float* resid_rows[M];
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const long long tk = tokens ? tokens[m] : (long long)tok0;
    c.tok_src[m] = p.embed + (size_t)tk * p.H;
    resid_rows[m] = p.resid + (size_t)m * p.H;
  }
  if (threadIdx.x < M) { c.misc->best_val[threadIdx.x] = -INFINITY; c.misc->best_idx[threadIdx.x] = 0x7fffffff; }
  // residual = embed * multiplier, for the rows this block owns in the o/down stages
  {
    int pb0, pb1;
    block_pairs(p.mat[MAT_O].N, p.nblocks, blockIdx.x, pb0, pb1);
    const int n0 = 2 * pb0, n1 = min(2 * pb1, p.H);
    for (int i = threadIdx.x; i < M * (n1 - n0); i += NCT) {
      const int m = i / (n1 - n0), n = n0 + i % (n1 - n0);
      p.resid[(size_t)m * p.H + n] = __ldg(c.tok_src[m] + n) * p.emb_mult;
    }
  }
  const float* const* attn_rows_dummy = nullptr;
  (void)attn_rows_dummy;
  const float* attn_rows[M];
  const float* act_rows[M];
#pragma unroll
  for (int m = 0; m < M; ++m) {
    attn_rows[m] = p.attn + (size_t)m * p.nh * p.D;
    act_rows[m] = p.act + (size_t)m * p.I;
  }
  uint8_t* uni = smem + sl.uni;
  const bool tracing = p.trace != nullptr && blockIdx.x == 0;
  auto stamp = [&](int l, int k) {
    if (tracing && threadIdx.x == 0) {
      unsigned long long t;
      asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
      p.trace[l * 16 + k] = t;
    }
  };
  for (int l = 0; l < p.L; ++l) {
    stamp(l, 0);
    const float* const* xsrc = l == 0 ? c.tok_src : resid_rows;
    const float mult = l == 0 ? p.emb_mult : 1.f;
    const float* an = p.norms + (size_t)l * 2 * p.H;
    compute_rstd<M>(p, xsrc, mult, c.misc);
    stamp(l, 1);
    matvec_stage<M>(c, MAT_QKV, l, xsrc, mult, an);
    stamp(l, 2);
    gsync();
    stamp(l, 3);
    attention_stage<M>(c, l, uni);
    stamp(l, 4);
    gsync();
    stamp(l, 5);
    matvec_stage<M>(c, MAT_O, l, attn_rows, 1.f, nullptr);
    stamp(l, 6);
    gsync();
    stamp(l, 7);
    compute_rstd<M>(p, resid_rows, 1.f, c.misc);
    stamp(l, 8);
    matvec_stage<M>(c, MAT_GU, l, resid_rows, 1.f, an + p.H);
    stamp(l, 9);
    gsync();
    stamp(l, 10);
    matvec_stage<M>(c, MAT_D, l, act_rows, 1.f, nullptr);
    stamp(l, 11);
    gsync();
  }
  stamp(p.L - 1, 12);
  compute_rstd<M>(p, resid_rows, 1.f, c.misc);
  matvec_stage<M>(c, MAT_LM, 0, resid_rows, 1.f, p.final_norm);
  stamp(p.L - 1, 13);
  // argmax: block partials, the last block to finish reduces them in block order
  if (threadIdx.x < M) {
    p.arg_val[blockIdx.x * M + threadIdx.x] = c.misc->best_val[threadIdx.x];
    p.arg_idx[blockIdx.x * M + threadIdx.x] = c.misc->best_idx[threadIdx.x];
  }
  cbar();
  if (threadIdx.x == 0) {
    __threadfence();
    const int old = atomicAdd(p.done_count, 1);
    c.misc->flag = (old == p.nblocks - 1);
    if (c.misc->flag) __threadfence();
  }
  cbar();
  if (c.misc->flag && threadIdx.x < M) {
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    for (int b = 0; b < p.nblocks; ++b) {
      const float v = __ldcg(p.arg_val + b * M + threadIdx.x);
      const int ix = __ldcg(p.arg_idx + b * M + threadIdx.x);
      if (v > bv || (v == bv && ix < bi)) { bv = v; bi = ix; }
    }
    p.argmax[threadIdx.x] = bi;
  }
  if (c.misc->flag && threadIdx.x == 0) {
    *p.done_count = 0;
    *p.epoch = epoch + 1;  // every block read the epoch before its first barrier
  }
}

}  // namespace
}  // namespace mk

// =====================================================================[9] launch entry point
// One per M: flint_mk_launch_m<M>. The host dispatcher (megakernel_host.cu) picks by M and raises
// for anything else; there is no fall-through to another M.
extern "C" int MK_CAT(flint_mk_launch_m, FLINT_MK_M)(const mk::Params* p, const mk::Smem* sl, int start,
                                                       const long long* tokens, int tok0, cudaStream_t stream,
                                                       int set_attr) {
  auto kern = mk::decode_kernel<FLINT_MK_M>;
  cudaError_t e;
  if (set_attr) {
    e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, sl->total);
    if (e != cudaSuccess) return (int)e;
  }
  mk::Params pp = *p;
  mk::Smem ss = *sl;
  void* args[] = {(void*)&pp, (void*)&ss, (void*)&start, (void*)&tokens, (void*)&tok0};
  e = cudaLaunchCooperativeKernel((const void*)kern, dim3(p->nblocks), dim3(mk::NT), args, (size_t)sl->total,
                                  stream);
  return (int)e;
}

extern "C" int MK_CAT(flint_mk_occupancy_m, FLINT_MK_M)(int smem_bytes, int* blocks_per_sm) {
  auto kern = mk::decode_kernel<FLINT_MK_M>;
  cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (e != cudaSuccess) return (int)e;
  return (int)cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks_per_sm, kern, mk::NT, smem_bytes);
}
