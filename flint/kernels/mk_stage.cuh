// flint decode megakernel: staging a stage's input vector into shared memory.
//
// Every matvec stage starts with every block staging the WHOLE input vector (K values per token) in the form its
// tile dots read: the fused RMSNorm (rstd from the same loads when a row is one round of loads), then either two fp16
// terms per value (hi + lo: 22 significant bits, the fp16 tensor-core dot) or two int8 terms per token and group (the
// integer dot of gate|up at M = 1 in groups of 128), plus per-group sums for the (scale, min) epilogue. Sources: an
// fp32 row in L2 (the residual, the attention output, the act), the block's own act slice in shared memory (the FFN
// split-K), the 24-bit tagged words (the o and gate|up stagings), or the counted fixed-point residual (the q|k|v and
// lm_head stagings), which the staging also polls until every add of the layer has landed.
// Relies on: the layouts of mk_mma.cuh (x chunk order, MMA_XSUM_FLOATS), the word formats of mk_sync.cuh.
#pragma once
#include "mk_common.cuh"
#include "mk_mma.cuh"
#include "mk_producer.cuh"
#include "mk_sync.cuh"

namespace mk {
namespace {

// this object stages x as int8 terms for some stage (the M = 1 and M = 2 objects of groups of 128: gate|up's integer
// dot), and which matrix that is (mi: MAT_*); every other stage of every object runs the fp16 dot
template <int M>
constexpr bool kIdot = FLINT_MK_GU8 && M <= 2;
template <int M>
__host__ __device__ constexpr bool kI8(int mi) { return mi == MAT_GU && kIdot<M>; }

extern __shared__ __align__(1024) uint8_t mk_smem[];

constexpr int ROW_ACTB = 4;  // MiscSmem::rows[ROW_ACTB]: the FFN split-K act slice in shared memory
// The consumers' view of the block: pointers into shared memory and the ring position they share with the producer
template <int M>
struct Ctx {
  const Params* p;
  const Smem* sl;
  Ring ring;
  int slot;            // the ring slot of the next chunk (chunk q: q mod nslots, must match the producer's)
  uint32_t phase;      // its mbarrier phase parity ((q / nslots) & 1)
  MiscSmem* misc;
  float* acc;          // [tiles][16][M] sums across K segments
  float* own;          // [o tiles][16][M] this block's residual rows
  float* rope;         // [M][D/2] cos, [M][D/2] sin
  float* actb;         // FFN split-K: [M][kf] this block's act slice
  float* parts;        // [nslots][pstride]
  uint32_t xs, xsum;   // shared addresses of the staged x and its per-group sums
  int start;
  uint32_t tag0;       // the tag of layer 0 in this launch (epoch * L + 1)
  int fx;              // the next matvec stage's input is the fixed-point residual (0: not; else fx_code)
};

// this block's rows' value in X[b] as its last q|k|v staging read it ([2][o rows of the block][M] int64 in
// shared memory, after Smem::own's rows); its o epilogue turns it into fx(x + o) with one add
template <int M>
__device__ __forceinline__ long long* own_fx(const Ctx<M>& c, int b) {
  return reinterpret_cast<long long*>(mk_smem + c.misc->ownfx) +
         b * (c.misc->tile1[MAT_O] - c.misc->tile0[MAT_O]) * TILE_ROWS * M;
}

// rstd per token from the per-warp sums of squares in misc->red[warp][m] (fixed order), then a cbar.
template <int M>
__device__ __forceinline__ void finish_rstd(const Params& p, MiscSmem* misc) {
  const int t = threadIdx.x;
  if (t < M) {
    float s = 0.f;
    for (int i = 0; i < NCW; ++i) s += misc->red[i][t];
    misc->rstd[t] = rsqrtf(s / (float)p.H + p.eps);
  }
  cbar();
}


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
  finish_rstd<M>(p, misc);
}

// stage_x's parts, one code word (8 values of token m) each; they share its names (x: the word's values, wx: their
// norm weights, r: mult * rstd, t: the thread, ok: a word of the row, kw: its index in the row).
// A word of the counted fixed-point residual (the FX source): the sum of c.fx's buffers, re-polled until every count is
// the layer's; the owner's rows kept for its o epilogue (and written to c.fx's third buffer where one is named).
template <int M>
__device__ __forceinline__ void ld_fx_word(const Ctx<M>& c, int k0, int kw, int m, bool ok, float4& v0, float4& v1) {
  long long sx[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
  for (int bi = 0; bi < 2; ++bi) {
    const int b = (c.fx >> (4 * bi)) & 15;
    if (b == FXB_NONE) break;
    const longlong2* fp = reinterpret_cast<const longlong2*>(fx_buf(*c.p, b + m) + k0) + 4 * kw;
    // counted words: all four loads in flight, re-polled together until every count is the layer's
    longlong2 q[4];
#pragma unroll
    for (int h = 0; h < 4; ++h) q[h] = ok ? ld_fx2(fp + h) : make_longlong2(0, 0);
    // (the count X has reached in this launch: misc->fxc, kept by thread 0 between stages)
    const unsigned long long e56 = (unsigned long long)(c.misc->fxc[b & 1] & 255u) << 56;
    {
      auto done = [&]() {
        bool d = true;
#pragma unroll
        for (int h = 0; h < 4; ++h) d = d && fx_counted(q[h].x, e56) && fx_counted(q[h].y, e56);
        return d;
      };
      // (a count that never comes is a bug: after 2^24 polls, seconds, the launch fails instead of hanging)
      for (uint32_t spins = 0; ok && !done(); ++spins) {
        if (spins == (1u << 24)) __trap();
#pragma unroll
        for (int h = 0; h < 4; ++h) q[h] = ld_fx2(fp + h);
      }
    }
#pragma unroll
    for (int h = 0; h < 4; ++h) {
      sx[2 * h] += (long long)((unsigned long long)q[h].x - e56);
      sx[2 * h + 1] += (long long)((unsigned long long)q[h].y - e56);
    }
  }
  if (ok) {  // the owner's rows: the value its o epilogue turns into fx(x + o) with one add
    const int k = k0 + 8 * kw, n0 = c.misc->tile0[MAT_O] * TILE_ROWS;
    if (k >= n0 && k < min(c.misc->tile1[MAT_O] * TILE_ROWS, c.p->H)) {
      long long* ow = own_fx(c, c.fx & 1);  // (X[b]: fx code b = FXB_X + b)
#pragma unroll
      for (int j = 0; j < 8; ++j) ow[(k + j - n0) * M + m] = sx[j];
    }
  }
  const int wb = (c.fx >> 8) & 15;
  if (wb != FXB_NONE && ok) {
    const int k = k0 + 8 * kw, n0 = c.misc->tile0[MAT_O] * TILE_ROWS;
    if (k >= n0 && k < min(c.misc->tile1[MAT_O] * TILE_ROWS, c.p->H)) {
      longlong2* wp = reinterpret_cast<longlong2*>(fx_buf(*c.p, wb + m) + k);
#pragma unroll
      for (int h = 0; h < 4; ++h) wp[h] = make_longlong2(sx[2 * h], sx[2 * h + 1]);
    }
  }
  v0 = make_float4(fx_val(sx[0]), fx_val(sx[1]), fx_val(sx[2]), fx_val(sx[3]));
  v1 = make_float4(fx_val(sx[4]), fx_val(sx[5]), fx_val(sx[6]), fx_val(sx[7]));
}

// The RMSNorm's rstd per token from the staging's own loads (v: U words a thread, round c0): sums of squares of
// src * mult, warp-private running sums in fixed order, then finish_rstd (its block barriers).
template <int M, int U>
__device__ __forceinline__ void fused_rstd(const Ctx<M>& c, const float4 (&v)[U][2], int c0, int total, int wpr,
                                           float mult, int t) {
  const int lane = t & 31, warp = t >> 5;
  if (lane == 0)
    for (int m = 0; m < M; ++m) c.misc->red[warp][m] = 0.f;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int wi = c0 + u * NCT + t;
    const bool ok = wi < total;
    const int mw = (M == 1 || !ok) ? 0 : wi / wpr;
    const float x[8] = {v[u][0].x, v[u][0].y, v[u][0].z, v[u][0].w, v[u][1].x, v[u][1].y, v[u][1].z, v[u][1].w};
    float s2 = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) s2 = fmaf(x[j] * mult, x[j] * mult, s2);
    // the warp's words belong to one or a few tokens: one warp sum per token present
    unsigned pending = __ballot_sync(0xffffffffu, ok);
    while (pending) {
      const int m0 = __shfl_sync(0xffffffffu, mw, __ffs(pending) - 1);
      const bool mine = ok && mw == m0;
      const float sm = warp_sum(mine ? s2 : 0.f);
      if (lane == 0) c.misc->red[warp][m0] += sm;
      pending &= ~__ballot_sync(0xffffffffu, mine);
    }
  }
  cbar();
  finish_rstd<M>(*c.p, c.misc);
}

// A word -> the integer dot's x: two int8 terms per value in its group's scale (the max over the group's L
// lanes), and the group's (scale, sum) entries of xsum.
template <int M>
__device__ __forceinline__ void stage_word_i8(const Ctx<M>& c, const float (&x)[8], const float (&wx)[8], float r,
                                              const float* norm_w, bool ok, int m, int kw, int G, int gshift, int L,
                                              int xstride, uint32_t xlo, int t) {
  float xv[8], amax = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    xv[j] = norm_w ? ((x[j] * r) * wx[j]) : x[j];
    amax = fmaxf(amax, fabsf(xv[j]));
  }
#pragma unroll
  for (int o = 1; o < 16; o <<= 1)  // the group's max over its L lanes
    if (o < L) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float s = amax > 0.f ? amax * (1.f / 127.f) : 1.f;
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int hq[8], lq[8];
  float sx = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    hq[j] = __float2int_rn(xv[j] * inv);
    lq[j] = max(-127, min(127, __float2int_rn((xv[j] - (float)hq[j] * s) * inv * 254.f)));
    sx += (float)hq[j] + (float)lq[j] * (1.f / 254.f);
  }
#pragma unroll
  for (int o = 1; o < 16; o <<= 1)
    if (o < L) sx += __shfl_xor_sync(0xffffffffu, sx, o);
  // bytes of a word: x(8w + {0,2,4,6}), x(8w + {1,3,5,7}) (mk_mma.cuh, the integer tile dot)
  auto pack4 = [](int a, int b, int c2, int d) -> uint32_t {
    return __byte_perm(__byte_perm(a, b, 0x0040), __byte_perm(c2, d, 0x0040), 0x5410);
  };
  const uint32_t h0 = pack4(hq[0], hq[2], hq[4], hq[6]), h1 = pack4(hq[1], hq[3], hq[5], hq[7]);
  const uint32_t l0 = pack4(lq[0], lq[2], lq[4], lq[6]), l1 = pack4(lq[1], lq[3], lq[5], lq[7]);
  if (M <= 2 && G >= 64) {  // the raw-byte dot's rows (mk_mma.cuh, imma_raw_tile_dot): token m's are 4m..4m + 3
    if (ok) {
      const int pitch = mkmma::imma_raw_pitch(xstride), wpl = G >> 5;
      const int k = kw << 3, gi = k >> gshift, wg = (k & (G - 1)) >> 3;
      const int j = wg & (wpl - 1);  // word j of lane wg / wpl's share
      const uint32_t a = c.xs + (uint32_t)(4 * m * pitch + gi * G + (wg - j) * 8 + 4 * j);
      const uint32_t am = a + (uint32_t)(4 * wpl);
      const uint32_t nh0 = pack4(-hq[0], -hq[2], -hq[4], -hq[6]), nl0 = pack4(-lq[0], -lq[2], -lq[4], -lq[6]);
      asm volatile("st.shared.u32 [%0], %1;" ::"r"(a), "r"(h0) : "memory");
      asm volatile("st.shared.u32 [%0], %1;" ::"r"(am), "r"(nh0) : "memory");
      asm volatile("st.shared.u32 [%0], %1;" ::"r"(a + pitch), "r"(l0) : "memory");
      asm volatile("st.shared.u32 [%0], %1;" ::"r"(am + pitch), "r"(nl0) : "memory");
      asm volatile("st.shared.u32 [%0], %1;" ::"r"(a + 2 * pitch), "r"(0u) : "memory");
      asm volatile("st.shared.u32 [%0], %1;" ::"r"(am + 2 * pitch), "r"(h1) : "memory");
      asm volatile("st.shared.u32 [%0], %1;" ::"r"(a + 3 * pitch), "r"(0u) : "memory");
      asm volatile("st.shared.u32 [%0], %1;" ::"r"(am + 3 * pitch), "r"(l1) : "memory");
      if ((t & (L - 1)) == 0) {  // lane t = 2m: (s / 254, X), t = 2m + 1: (s / 4064, 0); M = 1: t = 2, 3 stay 0
        const uint32_t xa = c.xsum + (uint32_t)(gi * mkmma::MMA_XSUM_FLOATS * 4 + 16 + 16 * m);
        asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(xa), "f"(s * (1.f / 254.f)), "f"(s * sx),
                     "f"(s * (1.f / 4064.f)), "f"(0.f) : "memory");
      }
    }
  } else if (ok) {
    const int k = kw << 3;  // first code of this word: its byte offset in the staged row
    const int gi = k >> gshift;
    const uint32_t a = c.xs + (uint32_t)(m * xstride + k);
    asm volatile("st.shared.v2.u32 [%0], {%1, %2};" ::"r"(a), "r"(h0), "r"(h1) : "memory");
    asm volatile("st.shared.v2.u32 [%0], {%1, %2};" ::"r"(a + xlo), "r"(l0), "r"(l1) : "memory");
    if ((t & (L - 1)) == 0) {  // column m (hi): (s, X); column LB + m (lo): (s / 254, 0)
      constexpr int LB = M == 1 ? 1 : M == 2 ? 2 : 4;
      const int n = LB + m;
      const uint32_t xa = c.xsum + (uint32_t)(gi * mkmma::MMA_XSUM_FLOATS * 4);
      asm volatile("st.shared.f32 [%0], %1;" ::"r"(xa + 4u * (4 * (m >> 1) + (m & 1))), "f"(s) : "memory");
      asm volatile("st.shared.f32 [%0], %1;" ::"r"(xa + 4u * (4 * (m >> 1) + 2 + (m & 1))), "f"(s * sx)
                   : "memory");
      asm volatile("st.shared.f32 [%0], %1;" ::"r"(xa + 4u * (4 * (n >> 1) + (n & 1))), "f"(s * (1.f / 254.f))
                   : "memory");
    }
  }
}

// A word -> the fp16 dot's x: hi and lo terms in mma chunk order, and the group's offset and effective sums in
// xsum (mk_mma.cuh, the group algebra).
template <int M>
__device__ __forceinline__ void stage_word_f16(const Ctx<M>& c, const float (&x)[8], const float (&wx)[8], float r,
                                               const float* norm_w, bool ok, int m, int kw, int G, int gshift, int L,
                                               int xstride, uint32_t xlo, int t, int wshift) {
  uint32_t hw[8], lw[8];
  float s_raw = 0.f, s_eff = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    float xv = norm_w ? ((x[j] * r) * wx[j]) : x[j];
    if (j & 1) xv *= 0.0625f;  // odd k: the code arrives as 16 q
    const __half hi = __float2half_rn(xv);
    const __half lo = __float2half_rn(xv - __half2float(hi));
    const float sum = __half2float(hi) + __half2float(lo);
    s_raw += sum;
    s_eff += (j & 1) ? 16.f * sum : sum;
    hw[j] = __half_as_ushort(hi);
    lw[j] = __half_as_ushort(lo);
  }
  // chunk order {0,4,1,5,2,6,3,7}
  const uint4 hc = make_uint4(hw[0] | (hw[4] << 16), hw[1] | (hw[5] << 16), hw[2] | (hw[6] << 16),
                              hw[3] | (hw[7] << 16));
  const uint4 lc = make_uint4(lw[0] | (lw[4] << 16), lw[1] | (lw[5] << 16), lw[2] | (lw[6] << 16),
                              lw[3] | (lw[7] << 16));
#pragma unroll
  for (int o = 1; o < 16; o <<= 1) {  // group sums over the L lanes of (m, group)
    if (o < L) {
      s_raw += __shfl_xor_sync(0xffffffffu, s_raw, o);
      s_eff += __shfl_xor_sync(0xffffffffu, s_eff, o);
    }
  }
  if (ok) {
    const int k = kw << 3;                  // first code of this word, relative to k0
    const int gi = k >> gshift, w = (k & (G - 1)) >> 3;
    const int pos = gi * G + ((w & ((1 << wshift) - 1)) * 4 + (w >> wshift)) * 8;
    const uint32_t a = c.xs + (uint32_t)(m * xstride + 2 * pos);
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(a), "r"(hc.x), "r"(hc.y), "r"(hc.z), "r"(hc.w)
                 : "memory");
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(a + xlo), "r"(lc.x), "r"(lc.y), "r"(lc.z),
                 "r"(lc.w)
                 : "memory");
    if ((t & (L - 1)) == 0) {
      const uint32_t xa = c.xsum + (uint32_t)(gi * mkmma::MMA_XSUM_FLOATS * 4);
      const float off = -1024.f * s_raw;
      const uint32_t a_off = xa + (uint32_t)(4 * (4 * (m >> 1) + (m & 1)));
      asm volatile("st.shared.f32 [%0], %1;" ::"r"(a_off), "f"(off) : "memory");
      asm volatile("st.shared.f32 [%0], %1;" ::"r"(a_off + 8u), "f"(off) : "memory");
      asm volatile("st.shared.f32 [%0], %1;" ::"r"(xa + (uint32_t)(4 * (16 + m))), "f"(s_eff) : "memory");
      if constexpr (kIdot<M> && 2 * M <= 8) {  // the lo column's entries an integer staging of this object may have
        constexpr int LB = M == 1 ? 1 : M == 2 ? 2 : 4;  // written (M = 2: the raw-byte rows' scales, rows g and g + 8)
        const int n = LB + m;
        asm volatile("st.shared.f32 [%0], %1;" ::"r"(xa + 4u * (4 * (n >> 1) + (n & 1))), "f"(0.f) : "memory");
        if constexpr (M == 2)
          asm volatile("st.shared.f32 [%0], %1;" ::"r"(xa + 4u * (4 * (n >> 1) + 2 + (n & 1))), "f"(0.f) : "memory");
      }
    }
  }
}

// The stage's input [k0, k0 + kst) for every token -> hi/lo fp16 terms in mma order (mk_mma.cuh) and the per-group
// sums, in ONE pass: thread = one 32-bit code word's 8 codes (two float4 loads, U words in flight); it writes the
// word's 16-byte hi chunk and lo chunk; the G/8 lanes of a (token, group) sit in one warp and reduce the group sums
// with shuffles (fixed order: deterministic). norm_w == nullptr: plain copy (attention output / act); else
// rmsnorm(src * mult) * norm_w (rstd fused into the loads, or compute_rstd first). xsum entries of tokens >= M stay 0
// (zeroed at kernel start). Sources: SMEM_SRC, rows in shared memory (generic loads); FX, the fixed-point residual
// (c.fx's buffers); T24, the 24-bit tagged words at tw + m tstride; else fp32 rows in L2.
// I8: int8 terms for the integer dot instead of fp16 terms.
template <int M, bool SMEM_SRC = false, bool FX = false, bool I8 = kIdot<M>, bool T24 = false>
__device__ void stage_x(const Ctx<M>& c, const float* const* src, float mult, const float* norm_w, int k0, int kst,
                        int G, int gshift, const uint32_t* tw = nullptr, int tstride = 0, uint32_t tag = 0) {
  const int t = threadIdx.x;
  const int xstride = c.sl->xstride;
  const uint32_t xlo = (uint32_t)(M * xstride);
  const int wpr = kst >> 3;         // code words per token row
  const int total = M * wpr;
  const int L = G >> 3;             // lanes per (token, group)
  const int wshift = gshift - 5;
  // words in flight per thread (more raises register pressure for the whole kernel). FX and T24 (M <= 2): M, so
  // a row of up to 480 words a token is one round (at M = 1 one: its loads are 4x wider, and two spilled the gate|up
  // integer object). M = 4: three, so Granite's 4 x 320 words are one round and the RMSNorm's rstd comes from the same
  // loads (M = 4 step -6.2%; three at M = 5..8 +5 to +7%, 2026-12-01)
  constexpr int U = (FX || T24) ? M : (M == 4 ? 3 : 2);
  // RMSNorm: when the whole row is one round of loads (decode on Granite and SmolLM2), the rstd comes
  // from the same loads (no separate pass, one L2 round trip less); else from compute_rstd first
  const bool fused = norm_w != nullptr && k0 == 0 && kst == c.p->H && total <= U * NCT;
  // (FX and T24, run at M <= kFxMaxM = 2 only: whole rows in one round, so the rstd is always fused: the launch
  // refuses H > 8 NCT with the split)
  if constexpr (!FX && !T24)
    if (norm_w != nullptr && !fused) compute_rstd<M>(*c.p, src, mult, c.misc);
  for (int c0 = 0; c0 < total; c0 += NCT * U) {
    float4 v[U][2], wv[U][2];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int wi = c0 + u * NCT + t;
      const bool ok = wi < total;
      const int m = (M == 1 || !ok) ? 0 : wi / wpr, kw = wi - m * wpr;
      if constexpr (T24) {  // (24-bit value, 8-bit tag) words
        v[u][0] = v[u][1] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (ok) ld_tw24x8(tw + (size_t)m * tstride + k0 + 8 * kw, tag, v[u][0], v[u][1]);
      }
      if constexpr (FX) {  // the fixed-point residual: the sum of c.fx's buffers, 8 words of 8 bytes each
        ld_fx_word<M>(c, k0, kw, m, ok, v[u][0], v[u][1]);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float4* sp = reinterpret_cast<const float4*>(src[m] + k0) + 2 * kw + h;
        if (!FX && !T24) v[u][h] = !ok ? make_float4(0.f, 0.f, 0.f, 0.f) : SMEM_SRC ? *sp : __ldcg(sp);
        wv[u][h] = (norm_w && ok) ? __ldg(reinterpret_cast<const float4*>(norm_w + k0) + 2 * kw + h)
                                  : make_float4(1.f, 1.f, 1.f, 1.f);
      }
    }
    if (fused) fused_rstd<M, U>(c, v, c0, total, wpr, mult, t);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (c0 + u * NCT >= total) break;  // block-uniform: no idle rounds
      // a warp with no word left stops (warp-uniform: the pass has no block barrier and its shuffles stay within a
      // warp; a warp's later words are further on)
      if (__all_sync(0xffffffffu, c0 + u * NCT + t >= total)) break;
      const int wi = c0 + u * NCT + t;
      const bool ok = wi < total;
      const int m = (M == 1 || !ok) ? 0 : wi / wpr, kw = wi - m * wpr;
      const float x[8] = {v[u][0].x, v[u][0].y, v[u][0].z, v[u][0].w, v[u][1].x, v[u][1].y, v[u][1].z, v[u][1].w};
      const float wx[8] = {wv[u][0].x, wv[u][0].y, wv[u][0].z, wv[u][0].w,
                           wv[u][1].x, wv[u][1].y, wv[u][1].z, wv[u][1].w};
      const float r = norm_w ? mult * c.misc->rstd[m] : 1.f;
      if constexpr (FX) {  // the block's own rows (the o tiling) for the o epilogue, and the fp32 hidden state
        const int k = k0 + 8 * kw, n0 = c.misc->tile0[MAT_O] * TILE_ROWS;
        const int n1 = min(c.misc->tile1[MAT_O] * TILE_ROWS, c.p->H);
        if (ok && k >= n0 && k < n1) {
#pragma unroll
          for (int j = 0; j < 8; ++j) c.own[(k + j - n0) * M + m] = x[j];
          float4* rp = reinterpret_cast<float4*>(c.p->resid + (size_t)m * c.p->H + k);
          rp[0] = v[u][0];
          rp[1] = v[u][1];
        }
      }
      if constexpr (I8)  // the integer dot's x: two int8 terms per token and group
        stage_word_i8<M>(c, x, wx, r, norm_w, ok, m, kw, G, gshift, L, xstride, xlo, t);
      else
        stage_word_f16<M>(c, x, wx, r, norm_w, ok, m, kw, G, gshift, L, xstride, xlo, t, wshift);
    }
  }
  cbar();
}

}  // namespace
}  // namespace mk
