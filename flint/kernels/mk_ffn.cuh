// flint decode megakernel: the FFN split-K (the down projection without a grid barrier before it).
//
// With the split (Params::nffn > 0; the host chooses it where the shapes allow), FFN block f owns gate|up tiles
// [f T, (f + 1) T), i.e. act slice [f kf, (f + 1) kf), which its gate|up epilogues write to its own shared memory;
// it then multiplies that slice by down's K slice f (all H rows, Mat MAT_DS: one segment, no K parts, no reducer)
// and contributes its partial sums of every residual row:
//   M = 1: ADDED into the counted 64-bit fixed-point residual X (red.add: integer adds commute, so the sum is
//          bitwise the same in any order); the next q|k|v staging polls X's counts, so no barrier follows;
//   M > 1: written to Params::dpart[m][tile][f][16]; after a grid barrier every block sums its own rows' partials in
//          a fixed order (ffn_down_reduce).
// Block f walks its slice's chunks from chunk f mod chunks on (produce_slice's order), so the blocks' adds spread
// over all rows at a time; a chunk's tiles go round robin over the 15 warps across the whole slice.
#pragma once
#include "mk_common.cuh"
#include "mk_matvec.cuh"
#include "mk_mma.cuh"
#include "mk_stage.cuh"
#include "mk_sync.cuh"

namespace mk {
namespace {

// The tiles of a down slice that is ONE quantization group (kf == G): the staged x, its group sums and the offsets
// are the same for every tile, so a warp loads them once and per tile reads only its code words and (scale, min);
// two tiles per iteration (their loads first). Same arithmetic as mkmma::mma_tile_dot for one group (mk_mma.cuh has
// the layouts). kFx<M>: the sums go into the fixed-point residual (dp0: row g of the chunk's first tile), as ONE
// 32-lane red.add per iteration (lane (g, t): tile t >> 1, row g + 8 (t & 1), its value from lane (g, 0) by
// shuffles): 4x fewer write instructions than per-tile 8-lane adds, the same integer sums. Else dp0 is fp32 partials.
template <int WPL, int M>
__device__ __forceinline__ void ds_tiles_one_group(uint32_t sb, uint32_t tb, int srb, int kseg, int n, int i0,
                                                   uint32_t xs, int xstride, uint32_t xlo, uint32_t xsum, int lane,
                                                   float* dp0, size_t tstride, size_t mstride, float rm = 0.f) {
  using namespace mkmma;
  constexpr bool PACKED = 2 * M <= 8;
  constexpr int LB = M == 1 ? 1 : M == 2 ? 2 : 4;
  const int g = lane >> 2, t = lane & 3;
  const int row = !PACKED ? min(g, M - 1) : g < M ? g : (g >= LB && g < LB + M) ? M + g - LB : 0;
  // hi / lo chunks and the group's offsets
  uint4 xh[WPL], xl[WPL], off;
  float2 eff;
  uint32_t magic;
  {
    const uint32_t xa = xs + (uint32_t)(row * xstride + t * 16);
#pragma unroll
    for (int c = 0; c < WPL; ++c) {
      xh[c] = lds128(xa + (uint32_t)(c * 64));
      xl[c] = PACKED ? xh[c] : lds128(xa + (uint32_t)(c * 64) + xlo);
    }
    off = lds128(xsum + (uint32_t)(t * 16));
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(eff.x), "=f"(eff.y) : "r"(xsum + (uint32_t)(64 + t * 8)));
    asm("mov.b32 %0, 0x64006400;" : "=r"(magic));
  }
  const uint32_t ra = (uint32_t)(g * srb), rb = ra + (uint32_t)(8 * srb);
  // the chunk's tile at position i (an identity, kept as a call: written inline, the M = 1 object compiles to other
  // machine code)
  auto tix = [&](int i) -> int { return i; };
  // the iteration's tiles i and (two) i + NCW: lane (g, t)'s code words of rows g and g + 8, and their (scale, min)
  auto load_pair = [&](int i, bool two, uint32_t (&wa)[2][WPL], uint32_t (&wb)[2][WPL], uint32_t (&hs)[2][2]) {
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const uint32_t tile = sb + (uint32_t)tix(u && two ? i + NCW : i) * tb;
      mma_lds_words<WPL>(tile + ra + (uint32_t)(t * WPL * 4), wa[u]);
      mma_lds_words<WPL>(tile + rb + (uint32_t)(t * WPL * 4), wb[u]);
      hs[u][0] = lds32(tile + ra + (uint32_t)(kseg >> 1));
      hs[u][1] = lds32(tile + rb + (uint32_t)(kseg >> 1));
    }
  };
  if constexpr (kFx<M>) {  // M = 1, fixed point: lanes t == 0 hold columns 0 (hi) and 1 (lo) of rows g, g + 8
    const float effs = eff.x + eff.y, kfx = rm * FX_SCALE;
    unsigned long long* const dq0 = reinterpret_cast<unsigned long long*>(dp0);  // row g of the chunk's tile 0
    for (int i = i0; i < n; i += 2 * NCW) {
      const bool two = i + NCW < n;
      uint32_t wa[2][WPL], wb[2][WPL], hs[2][2];
      load_pair(i, two, wa, wb, hs);
      float kv[2][2] = {{0.f, 0.f}, {0.f, 0.f}};  // lane (g, 0)'s values per tile
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        if (u && !two) break;
        float d0[4] = {__uint_as_float(off.x), __uint_as_float(off.y), __uint_as_float(off.z), __uint_as_float(off.w)};
        float d1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int c = 0; c < WPL; ++c) {
          const uint32_t a_lo = wa[u][c], b_lo = wb[u][c];
          const uint32_t a_hi = a_lo >> 8, b_hi = b_lo >> 8;
          mma_16816(d0, mma_nib<0x000F000Fu>(a_lo, magic), mma_nib<0x000F000Fu>(b_lo, magic),
                    mma_nib<0x00F000F0u>(a_lo, magic), mma_nib<0x00F000F0u>(b_lo, magic), xh[c].x, xh[c].y);
          mma_16816(d1, mma_nib<0x000F000Fu>(a_hi, magic), mma_nib<0x000F000Fu>(b_hi, magic),
                    mma_nib<0x00F000F0u>(a_hi, magic), mma_nib<0x00F000F0u>(b_hi, magic), xh[c].z, xh[c].w);
        }
        // the hi and lo columns summed before the (scale, min); the residual multiplier folded with 2^32
        const float2 fa = __half22float2(*reinterpret_cast<const __half2*>(&hs[u][0]));
        const float2 fb = __half22float2(*reinterpret_cast<const __half2*>(&hs[u][1]));
        const float cg = (d0[0] + d1[0]) + (d0[1] + d1[1]), cg8 = (d0[2] + d1[2]) + (d0[3] + d1[3]);
        kv[u][0] = fmaf(fa.x, cg, fa.y * effs) * kfx;
        kv[u][1] = fmaf(fb.x, cg8, fb.y * effs) * kfx;
      }
      {  // lane (g, t): tile t >> 1, row g + 8 (t & 1), from lane (g, 0)
        const int src = lane & ~3;
        const float v00 = __shfl_sync(0xffffffffu, kv[0][0], src), v01 = __shfl_sync(0xffffffffu, kv[0][1], src);
        const float v10 = __shfl_sync(0xffffffffu, kv[1][0], src), v11 = __shfl_sync(0xffffffffu, kv[1][1], src);
        const int u = t >> 1;
        if (u == 0 || two) {
          const float v = t == 0 ? v00 : t == 1 ? v01 : t == 2 ? v10 : v11;
          unsigned long long* const dq = dq0 + (uint32_t)tix(u ? i + NCW : i) * (uint32_t)TILE_ROWS + 8 * (t & 1);
          asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" ::"l"(dq),
                       "l"((unsigned long long)__float2ll_rn(v) + FX_CNT)
                       : "memory");
        }
      }
    }
    return;
  }
  for (int i = i0; i < n; i += 2 * NCW) {
    const bool two = i + NCW < n;
    uint32_t wa[2][WPL], wb[2][WPL], hs[2][2];
    load_pair(i, two, wa, wb, hs);
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      if (u && !two) break;
      float acc[4];
      {
        float d0[4] = {__uint_as_float(off.x), __uint_as_float(off.y), __uint_as_float(off.z), __uint_as_float(off.w)};
        float d1[4] = {0.f, 0.f, 0.f, 0.f}, e0[4] = {0.f, 0.f, 0.f, 0.f}, e1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int c = 0; c < WPL; ++c) {
          const uint32_t a_lo = wa[u][c], b_lo = wb[u][c];
          const uint32_t a_hi = a_lo >> 8, b_hi = b_lo >> 8;
          const uint32_t p0 = mma_nib<0x000F000Fu>(a_lo, magic), p1 = mma_nib<0x000F000Fu>(b_lo, magic);
          const uint32_t p2 = mma_nib<0x00F000F0u>(a_lo, magic), p3 = mma_nib<0x00F000F0u>(b_lo, magic);
          const uint32_t r0 = mma_nib<0x000F000Fu>(a_hi, magic), r1 = mma_nib<0x000F000Fu>(b_hi, magic);
          const uint32_t r2 = mma_nib<0x00F000F0u>(a_hi, magic), r3 = mma_nib<0x00F000F0u>(b_hi, magic);
          mma_16816(d0, p0, p1, p2, p3, xh[c].x, xh[c].y);
          mma_16816(d1, r0, r1, r2, r3, xh[c].z, xh[c].w);
          if constexpr (!PACKED) {
            mma_16816(e0, p0, p1, p2, p3, xl[c].x, xl[c].y);
            mma_16816(e1, r0, r1, r2, r3, xl[c].z, xl[c].w);
          }
        }
        const float2 fa = __half22float2(*reinterpret_cast<const __half2*>(&hs[u][0]));
        const float2 fb = __half22float2(*reinterpret_cast<const __half2*>(&hs[u][1]));
        acc[0] = fmaf(fa.x, (d0[0] + d1[0]) + (e0[0] + e1[0]), fmaf(fa.y, eff.x, 0.f));
        acc[1] = fmaf(fa.x, (d0[1] + d1[1]) + (e0[1] + e1[1]), fmaf(fa.y, eff.y, 0.f));
        acc[2] = fmaf(fb.x, (d0[2] + d1[2]) + (e0[2] + e1[2]), fmaf(fb.y, eff.x, 0.f));
        acc[3] = fmaf(fb.x, (d0[3] + d1[3]) + (e0[3] + e1[3]), fmaf(fb.y, eff.y, 0.f));
      }
      if constexpr (PACKED) fold_lo_columns<M>(acc);
      float* dp = dp0 + (size_t)(u ? i + NCW : i) * tstride;
      if (2 * t < M) { dp[2 * t * mstride] = acc[0]; dp[2 * t * mstride + 8] = acc[2]; }
      if (2 * t + 1 < M) { dp[(2 * t + 1) * mstride] = acc[1]; dp[(2 * t + 1) * mstride + 8] = acc[3]; }
    }
  }
}

// Part 1 (in the gate|up stage, after its epilogues): FFN block f stages its own act slice from shared memory (its
// gate|up epilogues wrote it there, not to L2: -0.3%), then every warp takes whole row tiles of down's slice f.
// Every warp waits for every chunk and arrives on its empty barrier, as in matvec_stage (the ring's parity protocol),
// AND on its parts barrier: without that arrival the slot's parts phases fall a lap behind and the next matvec
// stage's parity wait on it passes early or never.
template <int M>
__device__ void ffn_down_partial(Ctx<M>& c, int layer) {
  const Params& p = *c.p;
  const Mat& mt = p.mat[MAT_DS];
  const int nt = c.misc->tile1[MAT_DS];  // all H row tiles, or 0 (blocks >= nffn)
  if (nt == 0) return;                   // block-uniform
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int f = blockIdx.x;
  stage_x<M, true, false, false>(c, c.misc->rows[ROW_ACTB], 1.f, nullptr, 0, mt.K, mt.G, mt.gshift);  // ends with a block barrier
  const int cpt = c.sl->ds_cpt, ng = mt.kseg >> mt.gshift;
  const int xstride = c.sl->xstride;
  const uint32_t xlo = (uint32_t)(M * xstride);
  const uint32_t ring0 = smem_u32(c.ring.slots);
  const uint32_t tb = (uint32_t)(TILE_ROWS * mt.srb);
  const int gq = lane >> 2, tq = lane & 3;
  const size_t mstride = (size_t)mt.ntiles * p.nffn_pad * TILE_ROWS;
  float* dpf = p.dpart + (size_t)f * TILE_ROWS + gq;
  // The chunks: with the counted residual from chunk f mod chunks on (produce_slice's order: the FFN blocks' adds
  // spread over the rows), else from chunk 0 on; tile t + i of the slice goes to warp (t + i) mod 15.
  const int nch = (nt + cpt - 1) / cpt, ch0 = kFx<M> ? f % nch : 0;
  for (int ci = 0; ci < nch; ++ci) {
    const int t = (ci + ch0 < nch ? ci + ch0 : ci + ch0 - nch) * cpt;
    int i0 = warp >= t % NCW ? warp - t % NCW : warp - t % NCW + NCW;
    unsigned long long* fxr = fx_buf(p, FXB_X) + (size_t)t * TILE_ROWS + gq;  // X at row gq of tile t
    const size_t fxs = (size_t)fx_stride(p);
    mbar_wait(&c.ring.full[c.slot], c.phase);
    const int n = min(cpt, nt - t);
    const uint32_t sb = ring0 + (uint32_t)(c.slot * c.ring.slot_bytes);
    if ((kFx<M> ? M == 1 : M <= 2) && ng == 1 && mt.G <= 64) {  // (the fixed-point one-group dot: M = 1 only)
      float* dp0 = kFx<M> ? reinterpret_cast<float*>(fxr) : dpf + (size_t)t * p.nffn_pad * TILE_ROWS;
      const size_t ts = kFx<M> ? (size_t)TILE_ROWS : (size_t)p.nffn_pad * TILE_ROWS, ms = kFx<M> ? fxs : mstride;
      if constexpr (kFx<M> ? M == 1 : M <= 2) {
        if (mt.G == 64)
          ds_tiles_one_group<2, M>(sb, tb, mt.srb, mt.kseg, n, i0, c.xs, xstride, xlo, c.xsum, lane, dp0, ts, ms,
                                   p.res_mult);
        else
          ds_tiles_one_group<1, M>(sb, tb, mt.srb, mt.kseg, n, i0, c.xs, xstride, xlo, c.xsum, lane, dp0, ts, ms,
                                   p.res_mult);
      }
    } else
    for (int i = i0; i < n; i += NCW) {
      float acc[4];
      tile_dot<M, false>(mt.G, sb + (uint32_t)i * tb, mt.srb, mt.kseg, 0, ng, c.xs, xstride, xlo, c.xsum, lane, acc);
      if constexpr (kFx<M>) {
        unsigned long long* dq = fxr + (size_t)i * TILE_ROWS;
        if (2 * tq < M) {
          fx_red(dq + 2 * tq * fxs, p.res_mult * acc[0]);
          fx_red(dq + 2 * tq * fxs + 8, p.res_mult * acc[2]);
        }
        if (2 * tq + 1 < M) {
          fx_red(dq + (2 * tq + 1) * fxs, p.res_mult * acc[1]);
          fx_red(dq + (2 * tq + 1) * fxs + 8, p.res_mult * acc[3]);
        }
      } else {
        float* dp = dpf + (size_t)(t + i) * p.nffn_pad * TILE_ROWS;
        if (2 * tq < M) { dp[2 * tq * mstride] = acc[0]; dp[2 * tq * mstride + 8] = acc[2]; }
        if (2 * tq + 1 < M) { dp[(2 * tq + 1) * mstride] = acc[1]; dp[(2 * tq + 1) * mstride + 8] = acc[3]; }
      }
    }
    // every lane, on the slot's parts barrier too: its phases must follow the ring's laps (matvec_stage
    // waits on it with the lap parity), so a lap of the slot without K parts still completes one
    mbar_arrive(&c.ring.parts[c.slot]);
    mbar_arrive(&c.ring.empty[c.slot]);  // (NCT arrivals per phase)
    if (++c.slot == c.ring.nslots) {
      c.slot = 0;
      c.phase ^= 1u;
    }
  }
  // (traced builds only: a block barrier, so that the stamp after this stage is the block's end, not thread 0's
  // warp's; the grid barrier that follows starts with the same block barrier)
  if (MK_TRACE) cbar();
}

// Part 2 at M > 1 (after the grid barrier; replaces the down stage): the block's own residual rows
// (the o tiling) summed over the nffn_pad partials in a fixed order (deterministic): a warp loads a
// chunk of 8 slices x 16 rows (one float4 per lane, all of a thread's chunks in flight together), sums
// the 8 slices by a fixed butterfly, the chunks' sums go to shared memory and one thread per
// (token, row) adds them in order, then the residual (as down's epilogue did).
template <int M>
__device__ void ffn_down_reduce(Ctx<M>& c, uint8_t* uni) {
  const Params& p = *c.p;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int t0 = c.misc->tile0[MAT_O], nt = c.misc->tile1[MAT_O] - t0;
  const int ntH = p.mat[MAT_DS].ntiles, cpm = p.nffn_pad >> 3;  // chunks per (token, tile)
  const int nch = M * nt * cpm;
  float* buf = reinterpret_cast<float*>(uni);  // [nch][16]
  constexpr int B = 4;                         // chunks in flight per warp
  for (int c0 = warp; c0 < nch; c0 += B * NCW) {
    float4 v[B];
#pragma unroll
    for (int u = 0; u < B; ++u) {
      const int ch = c0 + u * NCW;
      v[u] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (ch < nch) {
        const int mt_ = ch / cpm, k = ch - mt_ * cpm;
        const int m = mt_ / nt, tl = t0 + (mt_ - m * nt);
        const float* src = p.dpart + (((size_t)m * ntH + tl) * p.nffn_pad + k * 8 + (lane >> 2)) * TILE_ROWS;
        v[u] = __ldcg(reinterpret_cast<const float4*>(src) + (lane & 3));
      }
    }
#pragma unroll
    for (int u = 0; u < B; ++u) {
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) {
        v[u].x += __shfl_xor_sync(0xffffffffu, v[u].x, o);
        v[u].y += __shfl_xor_sync(0xffffffffu, v[u].y, o);
        v[u].z += __shfl_xor_sync(0xffffffffu, v[u].z, o);
        v[u].w += __shfl_xor_sync(0xffffffffu, v[u].w, o);
      }
      const int ch = c0 + u * NCW;
      if (ch < nch && lane < 4) reinterpret_cast<float4*>(buf + ch * TILE_ROWS)[lane] = v[u];
    }
  }
  cbar();
  for (int i = threadIdx.x; i < M * nt * TILE_ROWS; i += NCT) {
    const int mt_ = i >> 4, r = i & 15;
    const int m = mt_ / nt, tlo = mt_ - m * nt;
    const float* b = buf + (size_t)mt_ * cpm * TILE_ROWS + r;
    float s0 = 0.f, s1 = 0.f;
    for (int k = 0; k < cpm; k += 2) {  // two chains, fixed order
      s0 += b[k * TILE_ROWS];
      if (k + 1 < cpm) s1 += b[(k + 1) * TILE_ROWS];
    }
    const int n = (t0 + tlo) * TILE_ROWS + r;
    if (n < p.H) {
      float* ow = c.own + (tlo * TILE_ROWS + r) * M + m;
      const float v = *ow + p.res_mult * (s0 + s1);
      *ow = v;
      p.resid[(size_t)m * p.H + n] = v;
    }
  }
}

}  // namespace
}  // namespace mk
