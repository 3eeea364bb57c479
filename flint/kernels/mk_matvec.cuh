// flint decode megakernel: the matvec stage and its epilogues.
//
// A stage = one weight matrix of one layer (q|k|v, o, gate|up, down, the lm_head). Block b owns a contiguous range
// of 16-row tiles; the producer streams them through the ring (mk_producer.cuh), one slot per tile-segment. A tile's
// K range is split into S parts (S <= 15: one warp each); part p of item i runs on warp (i S + p) mod 15, so the
// tiles rotate over the warps; the part warps write their 16 x M partial sums into the slot's partial area and hand
// them to the warp of part S-1 through the slot's `parts` mbarrier; that warp sums the parts in order (deterministic)
// and runs the tile's epilogue: RoPE + the KV-cache append + the tagged q|k|v words (q|k|v), the residual add (o,
// down), silu(gate) * up (gate|up), logits + the running argmax (lm_head).
// Relies on: the staging (mk_stage.cuh), the tile dots (mk_mma.cuh), the ring protocol (mk_producer.cuh).
#pragma once
#include "mk_common.cuh"
#include "mk_mma.cuh"
#include "mk_stage.cuh"
#include "mk_sync.cuh"
#include "mk_trace.cuh"

namespace mk {
namespace {

// The tile dot that reads this stage's staging: fp16 hi + lo terms, or (I8) the integer dot; at M <= 2 in groups of
// 64 / 128 the raw-byte integer dot (its staging writes the rows it reads). arow: the tile row of the lane's A rows
// (mkmma::dot_perm_row: conflict-free code loads; -1: lane / 4, the mma's own row)
template <int M, bool I8 = kIdot<M>>
__device__ __forceinline__ void tile_dot(int G, uint32_t tile, int srb, int kseg, int gi0, int gi1, uint32_t xs,
                                         int xstride, uint32_t xlo, uint32_t xsum, int lane, float (&acc)[4],
                                         int arow = -1) {
  if constexpr (I8) {  // (M <= 2 only: kIdot; G = 32: the nibble-split dot; its staging is the one it reads)
    static_assert(M <= 2, "the integer dot runs at M = 1 and 2");
    if (G == 128)
      mkmma::imma_raw_tile_dot<4, M>(tile, srb, kseg, gi0, gi1, xs, mkmma::imma_raw_pitch(xstride), xsum, lane, acc, arow);
    else if (G == 64)
      mkmma::imma_raw_tile_dot<2, M>(tile, srb, kseg, gi0, gi1, xs, mkmma::imma_raw_pitch(xstride), xsum, lane, acc, arow);
    else mkmma::imma_tile_dot<1, M>(tile, srb, kseg, gi0, gi1, xs, xstride, xsum, lane, acc, arow);
  } else
    mkmma::mma_tile_dot_g<M>(G, tile, srb, kseg, gi0, gi1, xs, xstride, xlo, xsum, lane, acc, arow);
}
__device__ __forceinline__ float silu(float g) { return g / (1.f + expf(-g)); }
// Epilogue of one row pair (n0, n0 + 1) of token m (act: m < M; all lanes must call it, the lm_head
// argmax shuffles within the 8 lanes of a token). Pairs are (2i, 2i+1): RoPE pairs for q/k (rows
// were permuted), (gate_j, up_j) for gate/up (rows interleaved).
template <int M>
__device__ __forceinline__ void pair_epilogue(Ctx<M>& c, int mi, int layer, int n0, int own_row, int mm, bool act,
                                              int jp, int warp, float a, float b) {
  const Params& p = *c.p;
  const int pos = c.start + mm;
  if (mi == MAT_QKV) {
    const int qd = p.nh * p.D, kd = p.nkv * p.D;
    if (!act) {
    } else if (n0 < qd + kd) {  // q or k: a pair is (i, i + D/2) of one head
      const int nn = n0 < qd ? n0 : n0 - qd;
      const int head = nn / p.D, ip = (nn % p.D) >> 1, half = p.D >> 1;
      float o1 = a, o2 = b;
      if (p.use_rope) {
        const float cs = c.rope[mm * half + ip], sn = c.rope[(M + mm) * half + ip];
        o1 = a * cs - b * sn;
        o2 = b * cs + a * sn;
      }
      if (n0 < qd) {
        // q only as tagged words: attention polls them, no barrier between the two stages
        st_tagged(qkv_word(p, mm, head * p.D + ip), o1, c.tag0 + layer);
        st_tagged(qkv_word(p, mm, head * p.D + ip + half), o2, c.tag0 + layer);
      } else if (kKv8) {  // the int8 cache: attention quantizes the row (its
        // scale needs the whole row) and writes it
        st_tagged(qkv_word(p, mm, qd + head * p.D + ip), o1, c.tag0 + layer);
        st_tagged(qkv_word(p, mm, qd + head * p.D + ip + half), o2, c.tag0 + layer);
      } else {
        __half* kp = p.kcache + ((((size_t)layer * p.nkv + head) * p.max_seq + pos) * p.D);
        const __half k1 = __float2half_rn(o1), k2 = __float2half_rn(o2);
        kp[ip] = k1;
        kp[ip + half] = k2;
        // and as tagged words, the values as the cache holds them (fp16)
        st_tagged(qkv_word(p, mm, qd + head * p.D + ip), __half2float(k1), c.tag0 + layer);
        st_tagged(qkv_word(p, mm, qd + head * p.D + ip + half), __half2float(k2), c.tag0 + layer);
      }
    } else {  // v: natural row order
      const int nn = n0 - qd - kd;
      const int head = nn / p.D, d0 = nn % p.D;
      if (kKv8) {  // (as k)
        st_tagged(qkv_word(p, mm, n0), a, c.tag0 + layer);
        st_tagged(qkv_word(p, mm, n0 + 1), b, c.tag0 + layer);
      } else {
        __half2* vp = reinterpret_cast<__half2*>(p.vcache + ((((size_t)layer * p.nkv + head) * p.max_seq + pos) * p.D) + d0);
        const __half2 vh = __floats2half2_rn(a, b);
        *vp = vh;
        // and as tagged words, the values as the cache holds them (fp16); v rows are in natural order: row n0
        const float2 vf = __half22float2(vh);
        st_tagged(qkv_word(p, mm, n0), vf.x, c.tag0 + layer);
        st_tagged(qkv_word(p, mm, n0 + 1), vf.y, c.tag0 + layer);
      }
    }
  } else if (mi == MAT_O || mi == MAT_D) {  // residual rows owned by this block (o and down share the tiling)
    if (act && n0 < p.H) {
      float* ow = c.own + own_row * M + mm;
      const float r0 = ow[0] + p.res_mult * a, r1 = ow[M] + p.res_mult * b;
      ow[0] = r0;
      ow[M] = r1;
      *reinterpret_cast<float2*>(p.resid + (size_t)mm * p.H + n0) = make_float2(r0, r1);
      if constexpr (kFx<M>) {
        if (p.nffn && mi == MAT_O) {  // X becomes fx(x + o) at the owner's rows: layer 0 stores (count 0), later
                                      // layers add the difference (the FFN blocks' adds carry the counts)
          unsigned long long* xw = fx_base(p) + (size_t)mm * fx_stride(p) + n0;
          const long long* pv = own_fx(c, 0) + own_row * M + mm;
          if (layer > 0) {
            asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" ::"l"(xw),
                         "l"(FX_CNT + fx_of(r0) - (unsigned long long)pv[0]) : "memory");
            asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" ::"l"(xw + 1),
                         "l"(FX_CNT + fx_of(r1) - (unsigned long long)pv[M]) : "memory");
          } else {
            *reinterpret_cast<longlong2*>(xw) = make_longlong2((long long)fx_of(r0), (long long)fx_of(r1));
          }
          const uint32_t tg = tw24_tag(layer);  // x + o for the gate|up staging, tagged
          asm volatile("st.relaxed.gpu.global.v2.u32 [%0], {%1, %2};" ::"l"(p.qkvt + tw24_resid(p, mm, n0)),
                       "r"(tw24_word(r0, tg)), "r"(tw24_word(r1, tg)) : "memory");
        }
      }
    }
  } else if (mi == MAT_GU) {  // rows interleaved gate_j, up_j
    if (act && (n0 >> 1) < p.I) {
      const float v = silu(a) * b;
      if (p.nffn)  // FFN split-K: only this block's down partials read it (from shared memory)
        c.actb[mm * p.mat[MAT_DS].K + (n0 >> 1) - (int)blockIdx.x * p.mat[MAT_DS].K] = v;
      else
        p.act[(size_t)mm * p.I + (n0 >> 1)] = v;
    }
  } else {  // MAT_LM: logits + this warp's running argmax (first index wins ties)
    const float l0 = a * p.inv_logit_scale, l1 = b * p.inv_logit_scale;
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    if (act && n0 < p.V) {
      float* lp_ = p.logits + (size_t)mm * p.V;
      lp_[n0] = l0;
      bv = l0; bi = n0;
      if (n0 + 1 < p.V) {
        lp_[n0 + 1] = l1;
        if (l1 > bv) { bv = l1; bi = n0 + 1; }
      }
    }
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) {  // within the 8 lanes of token m
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
    }
    if (act && jp == 0) {
      float& wv = c.misc->best_val[warp][mm];
      int& wi = c.misc->best_idx[warp][mm];
      if (bv > wv || (bv == wv && bi < wi)) { wv = bv; wi = bi; }
    }
  }
}

// The warp that finishes a tile-segment's last K part sums the parts (fixed order: deterministic).
// One segment: epilogue now. Several: the segment's sums go to c.acc[tile][s]; the warp that
// completes the tile's last segment (a shared counter per tile) sums the segments in order and runs
// the epilogue, so segments need no barrier between them. Lane = (pair jp = lane & 7, token
// m = lane >> 3 (+4)).
template <int M>
__device__ void tile_epilogue(Ctx<M>& c, int mi, int layer, int tl, int tl_local, int s, const float* pp, int S,
                              int lane, int warp) {
  const Mat& mt = c.p->mat[mi];
  const int jp = lane & 7;
  const int n0 = tl * TILE_ROWS + 2 * jp;
  const int own_row = tl_local * TILE_ROWS + 2 * jp;
  float* acc_t = c.acc + (size_t)tl_local * mt.nseg * TILE_ROWS * M;
#pragma unroll
  for (int m0 = 0; m0 < M; m0 += 4) {
    const int m = m0 + (lane >> 3);
    const bool act = m < M;
    const int mm = act ? m : 0;
    float a = 0.f, b = 0.f;
    for (int pt = 0; pt < S; ++pt) {
      a += pp[(pt * TILE_ROWS + 2 * jp) * M + mm];
      b += pp[(pt * TILE_ROWS + 2 * jp + 1) * M + mm];
    }
    if (mt.nseg == 1) {
      pair_epilogue<M>(c, mi, layer, n0, own_row, mm, act, jp, warp, a, b);
    } else if (act) {
      float* as = acc_t + ((size_t)s * TILE_ROWS + 2 * jp) * M + mm;
      as[0] = a;
      as[M] = b;
    }
  }
  if (mt.nseg == 1) return;
  __syncwarp();
  int last = 0;
  if (lane == 0) {
    __threadfence_block();  // CTA-scope ordering of the segment sums
    last = atomicAdd(&c.misc->seg_count[tl_local], 1) == mt.nseg - 1;
  }
  last = __shfl_sync(0xffffffffu, last, 0);
  if (!last) return;
  __threadfence_block();  // CTA-scope ordering of the segment sums
#pragma unroll
  for (int m0 = 0; m0 < M; m0 += 4) {
    const int m = m0 + (lane >> 3);
    const bool act = m < M;
    const int mm = act ? m : 0;
    float a = 0.f, b = 0.f;
    for (int s2 = 0; s2 < mt.nseg; ++s2) {
      const float* as = acc_t + ((size_t)s2 * TILE_ROWS + 2 * jp) * M + mm;
      a += as[0];
      b += as[M];
    }
    pair_epilogue<M>(c, mi, layer, n0, own_row, mm, act, jp, warp, a, b);
  }
  if (lane == 0) c.misc->seg_count[tl_local] = 0;
}


// One matrix stage. Tile-segment j of segment s is ring chunk q; its K range is split into S parts,
// part pt of item (s, j) goes to warp ((s * ntiles + j) * S + pt) mod 15 (so tiles rotate over the
// warps). A warp writes its part's 16 x M sums to the slot's partial area; the warp of part S-1
// reduces (the slot's parts mbarrier) and runs the epilogue. Every warp waits for every chunk in order
// and all its lanes arrive on its empty barrier after their use of the slot (and of its partial area):
// the mbarrier parity waits are only valid within one phase, so no warp may skip a chunk.
template <int M, bool I8 = kIdot<M>>
__device__ void matvec_stage(Ctx<M>& c, int mi, int layer, const float* const* src, float mult, const float* norm_w) {
  const Params& p = *c.p;
  const Mat& mt = p.mat[mi];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int t0 = c.misc->tile0[mi], t1 = c.misc->tile1[mi];
  const int nt = t1 - t0;
  const int S = c.sl->nparts[mi];
  const bool xall = c.sl->xall[mi] != 0;
  const int ng = mt.kseg >> mt.gshift;
  const int xstride = c.sl->xstride;
  const uint32_t xlo = (uint32_t)(M * xstride);
  const uint32_t ring0 = smem_u32(c.ring.slots);
  const int gq = lane >> 2, tq = lane & 3;
  const bool ws = mi == MAT_O;  // the stage whose inside the traced build stamps (warp_stamp)
  // per-unit bookkeeping without integer division (it cost ~0.3 us per unit and warp, traced):
  // part p of item i runs on warp (i S + p) mod 15, i.e. this warp holds part (warp - i S) mod 15,
  // stepped per item; the K groups of part p are [gtab(p), gtab(p + 1)), one division per lane and stage
  int part = warp;
  const int gtab = lane < 16 ? c.misc->gbound[mi][lane] : ng;  // ng * lane / S, computed once per launch
  if (ws) warp_stamp(p, layer, WS_O_ENTER);
  for (int s = 0; s < mt.nseg; ++s) {
    if (s == 0 || !xall) {
      if (s > 0) cbar();  // every warp is done with segment s-1's x before it is overwritten
      if (kFx<M> && p.nffn && (mi == MAT_O || mi == MAT_GU))  // from the tagged 24-bit words
        stage_x<M, false, false, I8, true>(c, src, mult, norm_w, xall ? 0 : s * mt.kseg, xall ? mt.K : mt.kseg, mt.G,
                                               mt.gshift, p.qkvt + (mi == MAT_O ? tw24_attn(p, 0, 0) : tw24_resid(p, 0, 0)),
                                               mi == MAT_O ? p.nh * p.D : p.H, tw24_tag(layer));
      else if (kFx<M> && c.fx)  // from the counted fixed-point residual
        stage_x<M, false, true, I8>(c, src, mult, norm_w, xall ? 0 : s * mt.kseg, xall ? mt.K : mt.kseg, mt.G,
                                    mt.gshift);
      else
        stage_x<M, false, false, I8>(c, src, mult, norm_w, xall ? 0 : s * mt.kseg, xall ? mt.K : mt.kseg, mt.G, mt.gshift);
      if (s == 0 && mi != MAT_LM) trace_stamp(p, layer, 16 + 4 * mi);
      if (ws) warp_stamp(p, layer, WS_O_STAGED);
    }
    const uint32_t xs = c.xs + (xall ? (uint32_t)(s * mt.kseg * (I8 ? 1 : 2)) : 0u);  // int8 / fp16 x
    const int grow = mkmma::dot_perm_row(gq, mt.srb, mt.G);  // the tile row of this lane's acc[0]
    const uint32_t xsum = c.xsum + (xall ? (uint32_t)(s * ng * mkmma::MMA_XSUM_FLOATS * 4) : 0u);
    for (int j = 0; j < nt; ++j) {
      const int slot = c.slot;
      const uint32_t phase = c.phase;
      mbar_wait(&c.ring.full[slot], phase);
      if (ws && j < 2) warp_stamp(p, layer, WS_O_UNIT + 4 * j);
      if (part < S) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        const int gi0 = __shfl_sync(0xffffffffu, gtab, part), gi1 = __shfl_sync(0xffffffffu, gtab, part + 1);
        tile_dot<M, I8>(mt.G, ring0 + (uint32_t)(slot * c.ring.slot_bytes), mt.srb, mt.kseg, gi0, gi1, xs, xstride, xlo,
                        xsum, lane, acc, grow);
        if (ws && j < 2) warp_stamp(p, layer, WS_O_UNIT + 4 * j + 1);
        float* pp = c.parts + slot * c.sl->pstride;
        float* pw = pp + part * TILE_ROWS * M;
        if (2 * tq < M) { pw[grow * M + 2 * tq] = acc[0]; pw[(grow + 8) * M + 2 * tq] = acc[2]; }
        if (2 * tq + 1 < M) { pw[grow * M + 2 * tq + 1] = acc[1]; pw[(grow + 8) * M + 2 * tq + 1] = acc[3]; }
        // hand-off through the slot's parts mbarrier (NCT arrivals per phase, release/acquire): every
        // lane of the S part warps arrives; the warp of part S-1 adds the missing arrivals, waits,
        // sums the parts in order (deterministic) and runs the tile's epilogue
        if (part == S - 1) {
          mbar_arrive_n(&c.ring.parts[slot], (uint32_t)(NCW - (S - 1)));
          mbar_wait(&c.ring.parts[slot], phase);
          if (ws && j < 2) warp_stamp(p, layer, WS_O_UNIT + 4 * j + 2);
          tile_epilogue<M>(c, mi, layer, t0 + j, j, s, pp, S, lane, warp);
          __syncwarp();
          if (ws && j < 2) warp_stamp(p, layer, WS_O_UNIT + 4 * j + 3);
        } else {
          mbar_arrive(&c.ring.parts[slot]);
        }
      }
      mbar_arrive(&c.ring.empty[slot]);  // (NCT arrivals per phase: every lane)
      if (++c.slot == c.ring.nslots) {
        c.slot = 0;
        c.phase ^= 1u;
      }
      part = part >= S ? part - S : part - S + NCW;  // the next item's part: (warp - (item + 1) S) mod 15
    }
  }
  if (mi != MAT_LM) {
    trace_stamp(p, layer, 16 + 4 * mi + 1);  // thread 0's warp is done
  }
  if (ws) warp_stamp(p, layer, WS_O_LOOP_END);
  cbar();  // all parts and epilogues done; the staged x may be overwritten
  if (ws) warp_stamp(p, layer, WS_O_EXIT);
}

}  // namespace
}  // namespace mk
