// flint kernel-lab microbenchmark: the mainline tensor-core int4 tile dot (mkmma::mma_tile_dot_g,
// flint/kernels/mk_mma.cuh; x staged as two fp16 terms, hi + lo), fed the way the megakernel feeds
// it: one block per SM, 15 consumer warps + 1 producer warp streaming 16-row tiles of flint's
// repacked row segments (codes + half2 (scale, min)) with cp.async.bulk into a ring of shared-memory
// slots (every consumer warp waits on / releases every slot, as the mainline does). The weight
// buffer (default 2 GiB) is larger than the 60 MB L2, so "stream" mode measures the dot at HBM
// speed; "resident" mode re-reads tiles already in shared memory (math only).
// --parts S splits each tile's K groups into S contiguous ranges [ng*p/S, ng*(p+1)/S), one warp each
// (item = tile * S + p, warp = item % 15, as matvec_stage). Timed launches fold the results into a
// register (no global stores, like the megakernel's per-slot partial sums in smem); one extra,
// untimed stream launch writes each part's sums to y_part [S][rows][M] (NaN-poisoned first), the
// host adds the parts in part order and checks them against an fp64 reference on sampled tiles.
// Exit status 1 if any stream result is off (rel >= 2e-3). (The old mainline dot_pair's figures
// are in bench/results/mma_dot_bench_2026-11-29b.log.)
//
// Compile (here or on the device; sm_90a only):
//   mkdir -p build/dev && nvcc -gencode arch=compute_90a,code=sm_90a -O3 -std=c++17 -lineinfo \
//        -Xptxas=--warn-on-spills -o build/dev/mma_dot_bench lab/cuda/mma_dot_bench.cu
// Run:  ./build/dev/mma_dot_bench [--K 2560] [--G 128] [--parts 1] [--warps 15] [--gib 2] [--reps 10]  (M = 1, 2, 4, 8)
// --warps W: only consumer warps 0..W-1 compute (items dealt mod W); all 15 still wait on and release every slot. The
// resident rate against W says whether a scheduler's warps overlap their group chains (docs/megakernel-log.md,
// its `mma_dot_bench --warps` row).
// Output: one line per (mode, M), then one JSON line.
#include "../../flint/kernels/mk_common.cuh"
#include "../../flint/kernels/mk_ptx.cuh"
#include "../../flint/kernels/mk_mma.cuh"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#ifndef MK_UNROLL
#define MK_UNROLL 1  // -DMK_UNROLL=2: two groups per loop iteration (A/B of the group-loop unroll)
#endif
// -DDOT_DIAG=n (timing diagnostics, WRONG results by design; G = 128, M = 1 and 2 only): a copy of the
// mainline group loop (mkmma::mma_tile_dot, packed hi + lo) with one part taken out, to find what bounds the
// resident rate (7 Tcodes/s: gate|up's 41.9 M codes per layer take 6.0 us at that rate, its stage's dot time):
//   1 no decode (the raw code words as A registers: no SHF, no LOP3)   2 no HMMA (an FADD per A register instead)
//   3 x from registers (the first group's hi/lo chunks reused)         4 code words from registers (loaded once)
//   5 = 3 + 4 (only the off / eff / scale loads left in the loop)       6 = 1 + 2 (loads and FADDs only)
//   7 = the copy unchanged (must time as the mainline: the copy's own check)
//   8 = the integer loop of MK_IDOT, an experiment of older revisions (mkmma::imma_tile_dot: 4 m16n8k32.s8 per
//       group), the fp16 x bytes read as int8
//   9 = a candidate, checked like the mainline: two tiles per warp and group sharing one set of x loads (--parts 1)
//  10, 11 = candidates (checked): one tile, its 8 mmas per group on 4 / 8 independent chains (mainline: 2)
//  12 = candidate (checked): 9 with 4 chains per tile (8 per warp)
//  13 = timing only: the integer dot without shifts (even codes w & 0x0F0F0F0F, odd codes x16 as
//       w & 0xF0F0F0F0 in their own u8 x s8 chain; 16 de + do per group)
//  14 = timing only (M = 1): the fp16 dot with 4 groups per accumulator set (B column 2j + h = term h of
//       group j; zeros elsewhere), one epilogue per 4 groups on every lane
#ifndef DOT_DIAG
#define DOT_DIAG 0
#endif
namespace bench {

constexpr int CW = mk::NCW;  // consumer warps
constexpr int NCT = mk::NCT;
constexpr int NTHREADS = mk::NT;
constexpr int SMEM_MAX = 227 * 1024;

extern __shared__ __align__(1024) uint8_t bench_smem[];

using mk::bulk_g2s;
using mk::lds128;
using mk::mbar_arrive;
using mk::mbar_expect_tx;
using mk::mbar_init;
using mk::mbar_wait;
using mk::smem_u32;

// ---- reference x staging: the layout of mk_mma.cuh written the plain way (one element per thread,
// then a pass for the per-group sums); the megakernel's stage_x fuses both
// Token m's terms live in two rows: hi at xs + m * xstride, lo at xs + xlo + m * xstride (xlo = M *
// xstride: M hi rows, then M lo rows; lo = fp16(v - hi), v = x * (k odd ? 1/16 : 1)), each permuted
// by mma_x_pos within its group.
__device__ __forceinline__ void mma_put_x(uint32_t xs, int xstride, uint32_t xlo, int m, int pos, float v) {
  const __half hi = __float2half_rn(v);
  const __half lo = __float2half_rn(v - __half2float(hi));
  const uint32_t a = xs + (uint32_t)(m * xstride + 2 * pos);
  asm volatile("st.shared.u16 [%0], %1;" ::"r"(a), "h"(__half_as_ushort(hi)) : "memory");
  asm volatile("st.shared.u16 [%0], %1;" ::"r"(a + xlo), "h"(__half_as_ushort(lo))
               : "memory");
}

// off / eff sums (header) over the G staged values (hi + lo) of group gi of token n (n < 8; zeros
// for n >= M). Call after a barrier over the threads that staged x.
template <int M>
__device__ void mma_stage_x_sums(int ng, int G, uint32_t xs, int xstride, uint32_t xlo, uint32_t xsum, int tid,
                                 int nthreads) {
  for (int task = tid; task < ng * mkmma::MMA_MAX_TOKENS; task += nthreads) {
    const int gi = task / mkmma::MMA_MAX_TOKENS, n = task - gi * mkmma::MMA_MAX_TOKENS;
    float s_raw = 0.f, s_eff = 0.f;
    if (n < M) {
      for (int half = 0; half < 2; ++half) {
        const uint32_t row = xs + (half ? xlo : 0u) + (uint32_t)(n * xstride + 2 * gi * G);
        for (int ch = 0; ch < G / 8; ++ch) {
          const uint4 v = mk::lds128(row + (uint32_t)(16 * ch));
          const float2 p0 = __half22float2(*reinterpret_cast<const __half2*>(&v.x));  // codes 0, 4
          const float2 p1 = __half22float2(*reinterpret_cast<const __half2*>(&v.y));  // codes 1, 5 (/16)
          const float2 p2 = __half22float2(*reinterpret_cast<const __half2*>(&v.z));  // codes 2, 6
          const float2 p3 = __half22float2(*reinterpret_cast<const __half2*>(&v.w));  // codes 3, 7 (/16)
          const float even = (p0.x + p0.y) + (p2.x + p2.y), odd = (p1.x + p1.y) + (p3.x + p3.y);
          s_raw += even + odd;
          s_eff += even + 16.f * odd;
        }
      }
    }
    const uint32_t a = xsum + (uint32_t)(gi * mkmma::MMA_XSUM_FLOATS * 4);
    const float off = -1024.f * s_raw;
    const uint32_t a_off = a + (uint32_t)(4 * (4 * (n >> 1) + (n & 1)));
    asm volatile("st.shared.f32 [%0], %1;" ::"r"(a_off), "f"(off) : "memory");
    asm volatile("st.shared.f32 [%0], %1;" ::"r"(a_off + 8u), "f"(off) : "memory");
    asm volatile("st.shared.f32 [%0], %1;" ::"r"(a + (uint32_t)(4 * (16 + n))), "f"(s_eff) : "memory");
  }
}

__device__ __forceinline__ void cbar() { asm volatile("bar.sync 1, %0;" ::"n"(NCT) : "memory"); }

#if DOT_DIAG
// mkmma::mma_tile_dot<4, M, 1> (G = 128, PACKED: M <= 4) with the DOT_DIAG part taken out (see the top)
template <int M>
__device__ __forceinline__ void diag_dot(uint32_t tile, int srb, int kseg, int gi0, int gi1, uint32_t xs, int xstride,
                                         uint32_t xsum, int lane, float (&acc)[4]) {
  using namespace mkmma;
  static_assert(2 * M <= 8, "diag_dot: packed hi + lo only (M <= 4)");
  constexpr int WPL = 4, G = 128, LB = M == 1 ? 1 : M == 2 ? 2 : 4;
  constexpr bool DEC = DOT_DIAG != 1 && DOT_DIAG != 6, MMA = DOT_DIAG != 2 && DOT_DIAG != 6;
  constexpr bool XREG = DOT_DIAG == 3 || DOT_DIAG == 5, WREG = DOT_DIAG == 4 || DOT_DIAG == 5;
  // lane (g, t): rows g and g + 8 of the tile, words t * WPL.., the staged row feeding B column g, the group sums
  const int g = lane >> 2, t = lane & 3;
  const uint32_t rows[2] = {tile + (uint32_t)(g * srb), tile + (uint32_t)((g + 8) * srb)};
  const uint32_t code_a = rows[0] + (uint32_t)(16 * t), code_b = rows[1] + (uint32_t)(16 * t);  // WPL * 4 = 16
  const uint32_t sm_a = rows[0] + (uint32_t)(kseg / 2), sm_b = rows[1] + (uint32_t)(kseg / 2);
  const int xrow = g < M ? g : g - LB < M && g >= LB ? M + g - LB : 0;
  const uint32_t xa = xs + (uint32_t)(xrow * xstride + 16 * t);
  const uint32_t xs_off = xsum + 16u * t, xs_eff = xsum + 64u + 8u * t;
  uint32_t magic;
  asm("mov.b32 %0, 0x64006400;" : "=r"(magic));
  uint4 xr[WPL];
  uint32_t war[WPL], wbr[WPL];
  if constexpr (XREG) {
#pragma unroll
    for (int c = 0; c < WPL; ++c) xr[c] = mk::lds128(xa + (uint32_t)(gi0 * G * 2 + c * 64));
  }
  if constexpr (WREG) {
    mma_lds_words<WPL>(code_a + (uint32_t)(gi0 * (G / 2)), war);
    mma_lds_words<WPL>(code_b + (uint32_t)(gi0 * (G / 2)), wbr);
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) acc[j] = 0.f;
#pragma unroll 1
  for (int gi = gi0; gi < gi1; ++gi) {
    uint32_t wa[WPL], wb[WPL];
    if constexpr (WREG) {
#pragma unroll
      for (int c = 0; c < WPL; ++c) { wa[c] = war[c] + (uint32_t)gi; wb[c] = wbr[c] + (uint32_t)gi; }
    } else {
      mma_lds_words<WPL>(code_a + (uint32_t)(gi * (G / 2)), wa);
      mma_lds_words<WPL>(code_b + (uint32_t)(gi * (G / 2)), wb);
    }
    const uint4 off = mk::lds128(xs_off + (uint32_t)(gi * MMA_XSUM_FLOATS * 4));
    float d0[4] = {__uint_as_float(off.x), __uint_as_float(off.y), __uint_as_float(off.z), __uint_as_float(off.w)};
    float d1[4] = {0.f, 0.f, 0.f, 0.f};
    float2 eff;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(eff.x), "=f"(eff.y)
                 : "r"(xs_eff + (uint32_t)(gi * MMA_XSUM_FLOATS * 4)));
#pragma unroll
    for (int c = 0; c < WPL; ++c) {
      uint4 xh;
      if constexpr (XREG) {
        xh = xr[c];
        xh.x += (uint32_t)gi;  // (a new value per group, so the mma is not hoisted)
      } else {
        xh = mk::lds128(xa + (uint32_t)(gi * G * 2 + c * 64));
      }
      // A registers of the word pair: [0] from bits 0..7 of each half, [1] from bits 8..15 (as the mainline)
      uint32_t a[2][4];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t wa_h = h ? wa[c] >> 8 : wa[c], wb_h = h ? wb[c] >> 8 : wb[c];
        if constexpr (DEC) {
          a[h][0] = mma_nib<0x000F000Fu>(wa_h, magic), a[h][1] = mma_nib<0x000F000Fu>(wb_h, magic);
          a[h][2] = mma_nib<0x00F000F0u>(wa_h, magic), a[h][3] = mma_nib<0x00F000F0u>(wb_h, magic);
        } else {
          a[h][0] = a[h][2] = wa[c], a[h][1] = a[h][3] = wb[c];  // (no shift either)
        }
      }
      if constexpr (MMA) {
        mma_16816(d0, a[0][0], a[0][1], a[0][2], a[0][3], xh.x, xh.y);
        mma_16816(d1, a[1][0], a[1][1], a[1][2], a[1][3], xh.z, xh.w);
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          d0[j] += __uint_as_float(a[0][j] ^ (j == 0 ? xh.x : j == 1 ? xh.y : 0u));
          d1[j] += __uint_as_float(a[1][j] ^ (j == 0 ? xh.z : j == 1 ? xh.w : 0u));
        }
      }
    }
    const uint32_t hsa = mk::lds32(sm_a + (uint32_t)(gi * 4)), hsb = mk::lds32(sm_b + (uint32_t)(gi * 4));
    const float2 fa = __half22float2(*reinterpret_cast<const __half2*>(&hsa));
    const float2 fb = __half22float2(*reinterpret_cast<const __half2*>(&hsb));
    acc[0] = fmaf(fa.x, d0[0] + d1[0], fmaf(fa.y, eff.x, acc[0]));
    acc[1] = fmaf(fa.x, d0[1] + d1[1], fmaf(fa.y, eff.y, acc[1]));
    acc[2] = fmaf(fb.x, d0[2] + d1[2], fmaf(fb.y, eff.x, acc[2]));
    acc[3] = fmaf(fb.x, d0[3] + d1[3], fmaf(fb.y, eff.y, acc[3]));
  }
  // token m = column m (hi) + column LB + m (lo): the next register of this lane at M = 1, else lane t ^ LB / 2
#pragma unroll
  for (int j = 0; j < 4; ++j) acc[j] += M == 1 ? (j & 1 ? 0.f : acc[j + 1]) : __shfl_xor_sync(~0u, acc[j], LB / 2);
}

// DOT_DIAG = 9 / 12 (candidates, correct results): NT = 2 tiles per warp and group, one set of x / off / eff loads for
// both, CH = 2 / 4 independent mma chains per tile; DOT_DIAG = 10 / 11: NT = 1 tile, CH = 4 / 8 chains (the mainline:
// one tile, 2 chains of 4). The mma (c, h) of a tile goes to chain (2c + h) mod CH; otherwise the packed loop unchanged.
template <int M, int CH, int NT>
__device__ __forceinline__ void diag_dotn(const uint32_t (&tile)[NT], int srb, int kseg, int gi0, int gi1, uint32_t xs,
                                          int xstride, uint32_t xsum, int lane, float (&acc)[NT][4]) {
  using namespace mkmma;
  static_assert(2 * M <= 8 && CH % 2 == 0 && CH <= 8, "diag_dotn: packed hi + lo only (M <= 4), CH in 2, 4, 8");
  constexpr int WPL = 4, G = 128, LB = M == 1 ? 1 : M == 2 ? 2 : 4;
  const int g = lane >> 2, t = lane & 3;
  const int xrow = g < M ? g : g - LB < M && g >= LB ? M + g - LB : 0;
  const uint32_t xa = xs + (uint32_t)(xrow * xstride + 16 * t);
  uint32_t magic;
  asm("mov.b32 %0, 0x64006400;" : "=r"(magic));
#pragma unroll
  for (int u = 0; u < NT; ++u)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[u][j] = 0.f;
#pragma unroll 1
  for (int gi = gi0; gi < gi1; ++gi) {
    uint32_t w[NT][2][WPL];  // [tile][row g, row g + 8][word]
#pragma unroll
    for (int u = 0; u < NT; ++u)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        mma_lds_words<WPL>(tile[u] + (uint32_t)((g + 8 * h) * srb + 16 * t + gi * (G / 2)), w[u][h]);
    const uint4 off = mk::lds128(xsum + 16u * t + (uint32_t)(gi * MMA_XSUM_FLOATS * 4));
    float2 eff;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(eff.x), "=f"(eff.y)
                 : "r"(xsum + 64u + 8u * t + (uint32_t)(gi * MMA_XSUM_FLOATS * 4)));
    float d[NT][CH][4];  // [tile][chain]: mma (c, h) of a tile goes to chain (2c + h) mod CH
#pragma unroll
    for (int u = 0; u < NT; ++u) {
      d[u][0][0] = __uint_as_float(off.x), d[u][0][1] = __uint_as_float(off.y);
      d[u][0][2] = __uint_as_float(off.z), d[u][0][3] = __uint_as_float(off.w);
#pragma unroll
      for (int k = 1; k < CH; ++k)
#pragma unroll
        for (int j = 0; j < 4; ++j) d[u][k][j] = 0.f;
    }
#pragma unroll
    for (int c = 0; c < WPL; ++c) {
      const uint4 xh = mk::lds128(xa + (uint32_t)(gi * G * 2 + c * 64));
#pragma unroll
      for (int u = 0; u < NT; ++u) {
        const uint32_t a0 = w[u][0][c], b0 = w[u][1][c], a1 = a0 >> 8, b1 = b0 >> 8;
        mma_16816(d[u][(2 * c) % CH], mma_nib<0x000F000Fu>(a0, magic), mma_nib<0x000F000Fu>(b0, magic),
                  mma_nib<0x00F000F0u>(a0, magic), mma_nib<0x00F000F0u>(b0, magic), xh.x, xh.y);
        mma_16816(d[u][(2 * c + 1) % CH], mma_nib<0x000F000Fu>(a1, magic), mma_nib<0x000F000Fu>(b1, magic),
                  mma_nib<0x00F000F0u>(a1, magic), mma_nib<0x00F000F0u>(b1, magic), xh.z, xh.w);
      }
    }
#pragma unroll
    for (int u = 0; u < NT; ++u)
#pragma unroll
      for (int k = 2; k < CH; k += 2)
#pragma unroll
        for (int j = 0; j < 4; ++j) d[u][0][j] += d[u][k][j], d[u][1][j] += d[u][k + 1][j];
#pragma unroll
    for (int u = 0; u < NT; ++u) {
      const uint32_t hsa = mk::lds32(tile[u] + (uint32_t)(g * srb + kseg / 2 + gi * 4));
      const uint32_t hsb = mk::lds32(tile[u] + (uint32_t)((g + 8) * srb + kseg / 2 + gi * 4));
      const float2 fa = __half22float2(*reinterpret_cast<const __half2*>(&hsa));
      const float2 fb = __half22float2(*reinterpret_cast<const __half2*>(&hsb));
      acc[u][0] = fmaf(fa.x, d[u][0][0] + d[u][1][0], fmaf(fa.y, eff.x, acc[u][0]));
      acc[u][1] = fmaf(fa.x, d[u][0][1] + d[u][1][1], fmaf(fa.y, eff.y, acc[u][1]));
      acc[u][2] = fmaf(fb.x, d[u][0][2] + d[u][1][2], fmaf(fb.y, eff.x, acc[u][2]));
      acc[u][3] = fmaf(fb.x, d[u][0][3] + d[u][1][3], fmaf(fb.y, eff.y, acc[u][3]));
    }
  }
#pragma unroll
  for (int u = 0; u < NT; ++u)
#pragma unroll
    for (int j = 0; j < 4; ++j)
      acc[u][j] += M == 1 ? (j & 1 ? 0.f : acc[u][j + 1]) : __shfl_xor_sync(~0u, acc[u][j], LB / 2);
}


// DOT_DIAG = 13 (timing only; the staged fp16 x bytes read as int8, so WRONG values): the integer dot with
// no shift in the decode. A code word w gives its even codes as bytes (w & 0x0F0F0F0F) and its odd codes times 16
// (w & 0xF0F0F0F0, unsigned bytes 0..240): two LOP3 per 8 codes (MK_IDOT: SHF + 2 LOP3, mainline fp16: SHF + 4 LOP3).
// The even and odd bytes go to separate m16n8k32 chains (u8 x s8), combined exactly as 16 de + do per group.
__device__ __forceinline__ void imma_u8(int (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                        uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
template <int M>
__device__ __forceinline__ void diag_idot2(uint32_t tile, int srb, int kseg, int gi0, int gi1, uint32_t xs, int xstride,
                                           uint32_t xsum, int lane, float (&acc)[4]) {
  using namespace mkmma;
  constexpr int WPL = 4, G = 128;
  const ImmaLane<WPL, M> ln(tile, srb, kseg, xs, xstride, xsum, lane);  // (the integer tile dot's lane addresses)
  const uint32_t code_a = ln.code_a, code_b = ln.code_b, sm_a = ln.sm_a, sm_b = ln.sm_b, xa = ln.xa, xs_c = ln.xs_c;
#pragma unroll
  for (int j = 0; j < 4; ++j) acc[j] = 0.f;
#pragma unroll 1
  for (int gi = gi0; gi < gi1; ++gi) {
    uint32_t wa[WPL], wb[WPL];
    mma_lds_words<WPL>(code_a + (uint32_t)(gi * (G / 2)), wa);
    mma_lds_words<WPL>(code_b + (uint32_t)(gi * (G / 2)), wb);
    const uint4 x0 = mk::lds128(xa + (uint32_t)(gi * G)), x1 = mk::lds128(xa + (uint32_t)(gi * G + 16));
    const uint4 cs = mk::lds128(xs_c + (uint32_t)(gi * MMA_XSUM_FLOATS * 4));
    int de[4] = {0, 0, 0, 0}, dd[4] = {0, 0, 0, 0};
    constexpr uint32_t LO = 0x0F0F0F0Fu, HI = 0xF0F0F0F0u;
    imma_u8(de, wa[0] & LO, wb[0] & LO, wa[1] & LO, wb[1] & LO, x0.x, x0.z);
    imma_u8(dd, wa[0] & HI, wb[0] & HI, wa[1] & HI, wb[1] & HI, x0.y, x0.w);
    imma_u8(de, wa[2] & LO, wb[2] & LO, wa[3] & LO, wb[3] & LO, x1.x, x1.z);
    imma_u8(dd, wa[2] & HI, wb[2] & HI, wa[3] & HI, wb[3] & HI, x1.y, x1.w);
    const uint32_t hsa = mk::lds32(sm_a + (uint32_t)(gi * 4)), hsb = mk::lds32(sm_b + (uint32_t)(gi * 4));
    const float2 fa = __half22float2(*reinterpret_cast<const __half2*>(&hsa));
    const float2 fb = __half22float2(*reinterpret_cast<const __half2*>(&hsb));
    const float c0 = __uint_as_float(cs.x), c1 = __uint_as_float(cs.y);  // (the real form: cs / 16)
    const float m0 = __uint_as_float(cs.z), m1 = __uint_as_float(cs.w);
    acc[0] = fmaf(__int2float_rn(16 * de[0] + dd[0]), fa.x * c0, fmaf(fa.y, m0, acc[0]));
    acc[1] = fmaf(__int2float_rn(16 * de[1] + dd[1]), fa.x * c1, fmaf(fa.y, m1, acc[1]));
    acc[2] = fmaf(__int2float_rn(16 * de[2] + dd[2]), fb.x * c0, fmaf(fb.y, m0, acc[2]));
    acc[3] = fmaf(__int2float_rn(16 * de[3] + dd[3]), fb.x * c1, fmaf(fb.y, m1, acc[3]));
  }
  fold_lo_columns<M>(acc);
}

// DOT_DIAG = 14 (timing only; M = 1; WRONG values: the column sums are not staged for it): the fp16 dot
// with the 8 B columns holding 4 groups at once ("super-group" SG of 4 groups): column n = 2j + h carries term h (hi /
// lo) of group j of the SG, zeros in the other groups' mmas (lane (g, t) loads its column's x only in group g >> 1's
// mmas, a zero area otherwise), so the accumulators keep 4 groups apart over a 16-mma chain and the per-group epilogue
// runs once per SG on every lane (lane t: group t), not once per group on all lanes (3 of 4 of them dropped).
template <int M>
__device__ __forceinline__ void diag_sg(uint32_t tile, int srb, int kseg, int gi0, int gi1, uint32_t xs, int xstride,
                                        uint32_t xzero, uint32_t xsum, int lane, float (&acc)[4]) {
  using namespace mkmma;
  constexpr int WPL = 4, G = 128;
  const int g = lane >> 2, t = lane & 3;
  const uint32_t row_a = tile + (uint32_t)(g * srb), row_b = row_a + (uint32_t)(8 * srb);
  const uint32_t code_a = row_a + (uint32_t)(t * WPL * 4), code_b = row_b + (uint32_t)(t * WPL * 4);
  const uint32_t sm_a = row_a + (uint32_t)(kseg >> 1), sm_b = row_b + (uint32_t)(kseg >> 1);
  const uint32_t xa = xs + (uint32_t)((g & 1) * xstride + t * 16);  // column g: term g & 1 of group g >> 1
  const uint32_t xz = xzero + (uint32_t)(t * 16);
  uint32_t magic;
  asm("mov.b32 %0, 0x64006400;" : "=r"(magic));
  float aa = 0.f, ab = 0.f;
#pragma unroll 1
  for (int sg = gi0; sg < gi1; sg += 4) {
    const int cnt = min(4, gi1 - sg);
    const int mine = sg + t < gi1 ? sg + t : sg;  // this lane's group in the SG (its epilogue)
    float2 o2;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(o2.x), "=f"(o2.y)
                 : "r"(xsum + (uint32_t)(mine * MMA_XSUM_FLOATS * 4)));
    float d0[4] = {o2.x, o2.y, o2.x, o2.y}, d1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 1
    for (int j = 0; j < cnt; ++j) {
      const int gi = sg + j;
      uint32_t wa[WPL], wb[WPL];
      mma_lds_words<WPL>(code_a + (uint32_t)(gi * (G / 2)), wa);
      mma_lds_words<WPL>(code_b + (uint32_t)(gi * (G / 2)), wb);
      const uint32_t xg = j == (g >> 1) ? xa + (uint32_t)(gi * G * 2) : xz;
#pragma unroll
      for (int c = 0; c < WPL; ++c) {
        const uint4 xh = mk::lds128(xg + (uint32_t)(c * 64));
        const uint32_t a_lo = wa[c], b_lo = wb[c], a_hi = a_lo >> 8, b_hi = b_lo >> 8;
        mma_16816(d0, mma_nib<0x000F000Fu>(a_lo, magic), mma_nib<0x000F000Fu>(b_lo, magic),
                  mma_nib<0x00F000F0u>(a_lo, magic), mma_nib<0x00F000F0u>(b_lo, magic), xh.x, xh.y);
        mma_16816(d1, mma_nib<0x000F000Fu>(a_hi, magic), mma_nib<0x000F000Fu>(b_hi, magic),
                  mma_nib<0x00F000F0u>(a_hi, magic), mma_nib<0x00F000F0u>(b_hi, magic), xh.z, xh.w);
      }
    }
    const uint32_t hsa = mk::lds32(sm_a + (uint32_t)(mine * 4)), hsb = mk::lds32(sm_b + (uint32_t)(mine * 4));
    const float eff = __uint_as_float(mk::lds32(xsum + (uint32_t)(mine * MMA_XSUM_FLOATS * 4 + 64)));
    const float2 fa = __half22float2(*reinterpret_cast<const __half2*>(&hsa));
    const float2 fb = __half22float2(*reinterpret_cast<const __half2*>(&hsb));
    const bool on = t < cnt;
    aa += on ? fmaf(fa.x, (d0[0] + d1[0]) + (d0[1] + d1[1]), fa.y * eff) : 0.f;
    ab += on ? fmaf(fb.x, (d0[2] + d1[2]) + (d0[3] + d1[3]), fb.y * eff) : 0.f;
  }
  aa += __shfl_xor_sync(0xffffffffu, aa, 1);
  ab += __shfl_xor_sync(0xffffffffu, ab, 1);
  aa += __shfl_xor_sync(0xffffffffu, aa, 2);
  ab += __shfl_xor_sync(0xffffffffu, ab, 2);
  acc[0] = aa, acc[1] = 0.f, acc[2] = ab, acc[3] = 0.f;
}
#endif

struct Cfg {
  const uint8_t* w;  // [rows][srb]
  long long rows;
  int K, G, srb, nslots, resident_reps, parts, store;
  int warps;       // consumer warps that compute (--warps; the others only wait on and release the slots)
  const float* x;  // [M][K] fp32
  float* y;        // y_part [parts][rows][M] (store != 0); y[0] keeps the math otherwise
  int x_off, xsum_off, ring_off, bar_off;  // smem byte offsets
};

__host__ __device__ inline uint32_t hash32(uint32_t v) {
  v ^= v >> 16; v *= 0x7feb352dU; v ^= v >> 15; v *= 0x846ca68bU; v ^= v >> 16;
  return v;
}

// codes: hashed bytes; (scale, min) per group: small positive scales, non-positive mins; padding 0
__global__ void fill_weights(uint8_t* w, long long rows, int K, int G, int srb) {
  const long long n = rows * srb;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    const long long r = i / srb;
    const int b = (int)(i - r * srb);
    uint8_t v = 0;
    if (b < K / 2) {
      v = (uint8_t)hash32((uint32_t)(r * 7919 + b));
    } else if (b < K / 2 + 4 * (K / G)) {
      const int gi = (b - K / 2) / 4, part = (b - K / 2) & 3;
      const uint32_t h = hash32((uint32_t)(r * 131 + gi) ^ 0x9e3779b9u);
      const __half s = __float2half_rn(0.002f + (h % 1000) * 2e-5f);
      const __half m = __float2half_rn(-(float)((h >> 10) % 1000) * 1e-4f);  // (float) first: unsigned negation gave inf
      const uint32_t hm = (uint32_t)__half_as_ushort(s) | ((uint32_t)__half_as_ushort(m) << 16);
      v = (uint8_t)(hm >> (8 * part));
    }
    w[i] = v;
  }
}

__global__ void read_bandwidth(const uint4* p, long long n, unsigned* sink) {
  uint32_t acc = 0;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    const uint4 v = __ldcs(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) *sink = acc;  // keeps the loads
}

// x [M][K] -> hi/lo fp16 terms in mma order (M hi rows, then M lo rows at xlo), then the group sums
template <int M>
__device__ void stage(const Cfg& c) {
  const int t = threadIdx.x;
  const int xstride = mkmma::mma_x_stride_bytes(c.K);
  const uint32_t xs = smem_u32(bench_smem) + c.x_off, xsum = smem_u32(bench_smem) + c.xsum_off;
  const uint32_t xlo = (uint32_t)(M * xstride);
  for (int i = t; i < M * c.K; i += NCT) {
    const int m = i / c.K, k = i - m * c.K;
    const float x = c.x[i];
    mma_put_x(xs, xstride, xlo, m, mkmma::mma_x_pos(k, c.G), (k & 1) ? x * 0.0625f : x);
  }
  cbar();
  mma_stage_x_sums<M>(c.K / c.G, c.G, xs, xstride, xlo, xsum, t, NCT);
  cbar();
}

// One launch = the whole buffer once (stream) or resident_reps passes over the first tiles (resident).
template <int M>
__global__ void __launch_bounds__(NTHREADS, 1) dot_bench(Cfg c) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  uint64_t* full = reinterpret_cast<uint64_t*>(bench_smem + c.bar_off);
  uint64_t* empty = full + c.nslots;
  uint8_t* ring = bench_smem + c.ring_off;
  const int tile_bytes = 16 * c.srb;
  const long long ntiles = c.rows / 16;
  const long long t0 = ntiles * blockIdx.x / gridDim.x, t1 = ntiles * (blockIdx.x + 1) / gridDim.x;
  const bool resident = c.resident_reps > 0;
  const long long nt = resident ? (t1 - t0 < c.nslots ? t1 - t0 : (long long)c.nslots) : t1 - t0;
  if (threadIdx.x == 0) {
    for (int s = 0; s < c.nslots; ++s) { mbar_init(&full[s], 1); mbar_init(&empty[s], CW); }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp == CW) {  // producer
    if (lane == 0) {
      uint64_t pol;
      asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
      for (long long j = 0; j < nt; ++j) {
        const int slot = (int)(j % c.nslots);
        const uint32_t fill = (uint32_t)(j / c.nslots);
        if (fill > 0) mbar_wait(&empty[slot], (fill - 1) & 1);
        mbar_expect_tx(&full[slot], (uint32_t)tile_bytes);
        bulk_g2s(ring + (size_t)slot * tile_bytes, c.w + (t0 + j) * (long long)tile_bytes, (uint32_t)tile_bytes,
                 &full[slot], pol);
      }
    }
    return;
  }
  stage<M>(c);
  const uint32_t base = smem_u32(bench_smem);
  const int xstride = mkmma::mma_x_stride_bytes(c.K);
  const uint32_t xlo = (uint32_t)(M * xstride);
  const int S = c.parts, ng = c.K / c.G;
  const int g = lane >> 2, t = lane & 3;
  const int passes = resident ? c.resident_reps : 1;
  float keep = 0.f;
  // The per-tile bookkeeping runs in every warp for every tile (each waits for every chunk), so it is kept to a few
  // integer ops, as in the megakernel: slot / parity and the owner rotate by counters, the parts' group bounds come
  // from a per-lane table. (An earlier version of this bench used 64-bit modulo and two divisions per tile and warp:
  // 60% of the warp samples of a d0 profile were there, not in the dot; bench/results/mma_dot_diag_2026-11-30.log.)
  const int gtab = lane <= S ? ng * lane / S : ng;  // part p's groups: [gtab(p), gtab(p + 1))
#if DOT_DIAG == 9 || DOT_DIAG == 12
  // tiles (j, j + 1) to one warp, whole K (--parts 1); the pair's owner rotates per pass as the items do
  for (int pass = 0; pass < passes; ++pass) {
    const int W = c.warps;
    int slot = 0, own = pass % W;
    uint32_t ph = 0;
    for (int j = 0; j < (int)nt; j += 2) {
      const bool two = j + 1 < nt;
      const int slot2 = slot + 1 == c.nslots ? 0 : slot + 1;
      const uint32_t ph2 = slot2 == 0 ? ph ^ 1u : ph;
      if (pass == 0) {
        mbar_wait(&full[slot], ph);
        if (two) mbar_wait(&full[slot2], ph2);
      }
      if (warp == own) {
        float acc[2][4];
        if constexpr (2 * M <= 8) {
          const uint32_t tl[2] = {base + (uint32_t)(c.ring_off + slot * tile_bytes),
                                  base + (uint32_t)(c.ring_off + (two ? slot2 : slot) * tile_bytes)};
          diag_dotn<M, DOT_DIAG == 12 ? 4 : 2, 2>(tl, c.srb, c.K, 0, ng, base + c.x_off, xstride, base + c.xsum_off,
                                                 lane, acc);
        } else {
          for (int u = 0; u < 2; ++u) acc[u][0] = acc[u][1] = acc[u][2] = acc[u][3] = 0.f;
        }
        for (int u = 0; u < (two ? 2 : 1); ++u) {
          if (c.store) {
            float* yp = c.y + (t0 + j + u) * 16 * M;  // part 0 (--parts 1)
            if (2 * t < M) { yp[g * M + 2 * t] = acc[u][0]; yp[(g + 8) * M + 2 * t] = acc[u][2]; }
            if (2 * t + 1 < M) { yp[g * M + 2 * t + 1] = acc[u][1]; yp[(g + 8) * M + 2 * t + 1] = acc[u][3]; }
          } else {
            keep += (acc[u][0] + acc[u][1]) + (acc[u][2] + acc[u][3]);
          }
        }
      }
      __syncwarp();
      if (lane == 0 && pass == 0) {
        mbar_arrive(&empty[slot]);
        if (two) mbar_arrive(&empty[slot2]);
      }
      slot = two ? slot2 : slot;
      ph = two ? ph2 : ph;
      if (++slot == c.nslots) { slot = 0; ph ^= 1u; }
      if (++own == W) own = 0;
    }
  }
  (void)S; (void)xlo; (void)gtab;
#else
  for (int pass = 0; pass < passes; ++pass) {
    // item = tile * S + part, warp = item mod W (W = 15 as the megakernel; --warps: fewer warps compute)
    const int W = c.warps;
    int slot = 0, part = warp < W ? warp - (pass * S) % W : S;
    if (part < 0) part += W;
    uint32_t ph = 0;
    for (int j = 0; j < (int)nt; ++j) {
      if (pass == 0) mbar_wait(&full[slot], ph);
      if (part < S) {
        const int gi0 = __shfl_sync(0xffffffffu, gtab, part), gi1 = __shfl_sync(0xffffffffu, gtab, part + 1);
        float acc[4];
#if DOT_DIAG
        (void)xlo;  // (the packed loop has the lo terms in B columns)
        if constexpr (2 * M <= 8 && DOT_DIAG == 13)
          diag_idot2<M>(base + (uint32_t)(c.ring_off + slot * tile_bytes), c.srb, c.K, gi0, gi1, base + c.x_off,
                        xstride, base + c.xsum_off, lane, acc);
        else if constexpr (M == 1 && DOT_DIAG == 14)  // the zero area: the end of the xsum block (timing only)
          diag_sg<M>(base + (uint32_t)(c.ring_off + slot * tile_bytes), c.srb, c.K, gi0, gi1, base + c.x_off, xstride,
                     base + c.bar_off - 256u, base + c.xsum_off, lane, acc);
        else if constexpr (2 * M <= 8 && DOT_DIAG == 8)  // MK_IDOT's loop, the staged fp16 x bytes read as int8
          mkmma::imma_tile_dot<4, M>(base + (uint32_t)(c.ring_off + slot * tile_bytes), c.srb, c.K, gi0, gi1,
                                     base + c.x_off, xstride, base + c.xsum_off, lane, acc);
        else if constexpr (2 * M <= 8 && (DOT_DIAG == 10 || DOT_DIAG == 11)) {
          const uint32_t tl[1] = {base + (uint32_t)(c.ring_off + slot * tile_bytes)};
          float a1[1][4];
          diag_dotn<M, DOT_DIAG == 10 ? 4 : 8, 1>(tl, c.srb, c.K, gi0, gi1, base + c.x_off, xstride, base + c.xsum_off,
                                                 lane, a1);
          acc[0] = a1[0][0], acc[1] = a1[0][1], acc[2] = a1[0][2], acc[3] = a1[0][3];
        } else if constexpr (2 * M <= 8)
          diag_dot<M>(base + (uint32_t)(c.ring_off + slot * tile_bytes), c.srb, c.K, gi0, gi1, base + c.x_off, xstride,
                      base + c.xsum_off, lane, acc);
        else
          acc[0] = acc[1] = acc[2] = acc[3] = 0.f;  // (not run: main() refuses M > 2 in a DOT_DIAG build)
#else
        mkmma::mma_tile_dot_g<M, MK_UNROLL>(c.G, base + (uint32_t)(c.ring_off + slot * tile_bytes), c.srb, c.K, gi0,
                                            gi1, base + c.x_off, xstride, xlo, base + c.xsum_off, lane, acc);
#endif
        if (c.store) {
          float* yp = c.y + ((long long)part * c.rows + (t0 + j) * 16) * M;
          if (2 * t < M) { yp[g * M + 2 * t] = acc[0]; yp[(g + 8) * M + 2 * t] = acc[2]; }
          if (2 * t + 1 < M) { yp[g * M + 2 * t + 1] = acc[1]; yp[(g + 8) * M + 2 * t + 1] = acc[3]; }
        } else {
          keep += (acc[0] + acc[1]) + (acc[2] + acc[3]);
        }
      }
      __syncwarp();
      if (lane == 0 && pass == 0) mbar_arrive(&empty[slot]);
      if (++slot == c.nslots) { slot = 0; ph ^= 1u; }
      if (warp < W) part = part >= S ? part - S : part - S + W;  // the next tile's part: (warp - (j + 1 + pass) S) mod W
    }
  }
#endif
  if (!c.store && keep == 1.2345e-30f) c.y[0] = keep;  // keeps the math
}

}  // namespace bench

using namespace bench;

#define CK(call)                                                                               \
  do {                                                                                         \
    cudaError_t e_ = (call);                                                                   \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "mma_dot_bench: %s failed: %s\n", #call, cudaGetErrorString(e_));   \
      std::exit(2);                                                                            \
    }                                                                                          \
  } while (0)

struct Result { std::string mode; int M, nslots; double us, gbps, codes_per_s, rel_err; };

template <int M>
static Result run_one(Cfg c, bool resident, int reps, int nsm, const std::vector<int>& sample_tiles,
                      const std::vector<uint8_t>& sample_bytes, const std::vector<float>& hx) {
  const int xsz = 2 * M * mkmma::mma_x_stride_bytes(c.K);  // hi rows, then lo rows
  const int xsumsz = (c.K / c.G) * mkmma::MMA_XSUM_FLOATS * 4;
  c.x_off = 0;
  c.xsum_off = (xsz + 127) / 128 * 128;
  c.bar_off = (c.xsum_off + xsumsz + 127) / 128 * 128;
  c.ring_off = c.bar_off + 2 * mk::MAX_SLOTS * 8;  // 256 B of mbarriers: stays 128-aligned
  const int tile_bytes = 16 * c.srb;
  c.nslots = std::min(mk::MAX_SLOTS, (SMEM_MAX - c.ring_off) / tile_bytes);
  const int smem = c.ring_off + c.nslots * tile_bytes;
  if (c.nslots < 2) { std::fprintf(stderr, "mma_dot_bench: K=%d M=%d leaves %d ring slots\n", c.K, M, c.nslots); std::exit(2); }
  c.resident_reps = resident ? 200 : 0;
  c.store = 0;
  auto kern = dot_bench<M>;
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int r = 0; r < reps + 2; ++r) {
    CK(cudaEventRecord(e0));
    kern<<<nsm, NTHREADS, smem>>>(c);
    CK(cudaGetLastError());
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    CK(cudaGetLastError());
    float t; CK(cudaEventElapsedTime(&t, e0, e1));
    if (r >= 2) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  const double med = ms[ms.size() / 2] * 1e-3;
  Result res{resident ? "resident" : "stream", M, c.nslots, med * 1e6, 0, 0, -1};
  if (resident) {
    const long long per_block = std::min<long long>(c.rows / 16 / nsm, c.nslots);
    res.codes_per_s = (double)nsm * per_block * 16 * c.K * c.resident_reps / med;
  } else {
    res.gbps = (double)c.rows * c.srb / med / 1e9;
    res.codes_per_s = (double)c.rows * c.K / med;
    // one untimed launch that stores every part's sums, then the fp64 reference on the sampled tiles
    const int S = c.parts;
    const size_t ny = (size_t)S * c.rows * M;
    CK(cudaMemset(c.y, 0xFF, ny * 4));  // NaN poison: unwritten (part, row) entries show
    c.store = 1;
    kern<<<nsm, NTHREADS, smem>>>(c);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    std::vector<float> yp(ny);
    CK(cudaMemcpy(yp.data(), c.y, ny * 4, cudaMemcpyDeviceToHost));
    long long nonfinite = 0, first_bad = -1;
    for (size_t i = 0; i < ny; ++i)
      if (!std::isfinite(yp[i])) { if (first_bad < 0) first_bad = (long long)i; ++nonfinite; }
    if (nonfinite) {
      const long long pr = first_bad / M;  // part * rows + row
      std::printf("  [%s S=%d M=%d] %lld non-finite partial y of %zu; first at part %lld row %lld token %lld (tile %lld)\n",
                  res.mode.c_str(), S, M, nonfinite, ny, pr / c.rows, pr % c.rows, first_bad % M, pr % c.rows / 16);
    }
    auto ysum = [&](long long row, int m) {  // parts added in part order, in fp32 (as the megakernel)
      float v = 0.f;
      for (int p = 0; p < S; ++p) v += yp[((size_t)p * c.rows + row) * M + m];
      return v;
    };
    double num = 0, den = 0;
    int shown = 0;
    for (size_t si = 0; si < sample_tiles.size(); ++si)
      for (int r = 0; r < 16; ++r) {
        const uint8_t* row = sample_bytes.data() + (si * 16 + r) * c.srb;
        const long long gr = (long long)sample_tiles[si] * 16 + r;
        for (int m = 0; m < M; ++m) {
          double ref = 0;
          for (int k = 0; k < c.K; ++k) {
            const int q = (row[k / 2] >> (4 * (k & 1))) & 15;
            const int gi = k / c.G;
            __half s, mn;
            std::memcpy(&s, row + c.K / 2 + 4 * gi, 2);
            std::memcpy(&mn, row + c.K / 2 + 4 * gi + 2, 2);
            ref += ((double)q * __half2float(s) + __half2float(mn)) * hx[(size_t)m * c.K + k];
          }
          const float y = ysum(gr, m);
          const double d = y - ref;
          if (shown < 3 && (si == 0 || !std::isfinite(d))) {
            std::printf("  [%s S=%d M=%d] tile %d row %d token %d: y %.6g ref %.6g\n", res.mode.c_str(), S, M,
                        sample_tiles[si], r, m, y, ref);
            ++shown;
          }
          num += d * d; den += ref * ref;
        }
      }
    res.rel_err = std::sqrt(num / den);
  }
  CK(cudaEventDestroy(e0)); CK(cudaEventDestroy(e1));
  return res;
}

int main(int argc, char** argv) {
  int K = 2560, G = 128, reps = 10, S = 1, W = CW;
  double gib = 2.0;
  for (int i = 1; i < argc; i += 2) {
    const std::string a = argv[i];
    if (i + 1 >= argc) { std::fprintf(stderr, "mma_dot_bench: %s needs a value\n", argv[i]); return 2; }
    if (a == "--K") K = std::atoi(argv[i + 1]);
    else if (a == "--G") G = std::atoi(argv[i + 1]);
    else if (a == "--parts") S = std::atoi(argv[i + 1]);
    else if (a == "--gib") gib = std::atof(argv[i + 1]);
    else if (a == "--reps") reps = std::atoi(argv[i + 1]);
    else if (a == "--warps") W = std::atoi(argv[i + 1]);
    else { std::fprintf(stderr, "mma_dot_bench: unknown argument %s\n", argv[i]); return 2; }
  }
  if ((G != 32 && G != 64 && G != 128) || K <= 0 || K % G || K > mk::KSEG_MAX) {
    std::fprintf(stderr, "mma_dot_bench: --K %d --G %d: need G in 32/64/128, K %% G == 0, K <= %d\n", K, G, mk::KSEG_MAX);
    return 2;
  }
  if (S < 1 || S > mk::MAX_PARTS || S > K / G) {
    std::fprintf(stderr, "mma_dot_bench: --parts %d: need 1 <= S <= min(%d, K/G = %d)\n", S, mk::MAX_PARTS, K / G);
    return 2;
  }
  if (reps < 1) { std::fprintf(stderr, "mma_dot_bench: --reps %d: need >= 1\n", reps); return 2; }
  if (W < 1 || W > CW) { std::fprintf(stderr, "mma_dot_bench: --warps %d: need 1..%d\n", W, CW); return 2; }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int nsm = prop.multiProcessorCount;
  const int srb = K / 2 + (K / G * 4 + 15) / 16 * 16;  // flint/megakernel.py row_segment_bytes
  const long long rows = (long long)(gib * (1ll << 30) / srb) / (16ll * nsm) * (16ll * nsm);
  if (rows <= 0) { std::fprintf(stderr, "mma_dot_bench: --gib %g is too small\n", gib); return 2; }
  Cfg c{};
  c.rows = rows; c.K = K; c.G = G; c.srb = srb; c.parts = S; c.warps = W;
  uint8_t* w; float *x, *y; unsigned* sink;
  CK(cudaMalloc(&w, (size_t)rows * srb));
  CK(cudaMalloc(&x, (size_t)8 * K * 4));
  CK(cudaMalloc(&y, (size_t)S * rows * 8 * 4));  // y_part [S][rows][M], M <= 8
  CK(cudaMalloc(&sink, 4));
  fill_weights<<<4 * nsm, 256>>>(w, rows, K, G, srb);
  CK(cudaGetLastError());
  std::vector<float> hx((size_t)8 * K);
  for (size_t i = 0; i < hx.size(); ++i) hx[i] = (float)((int)(hash32((uint32_t)i ^ 0xabcdefu) % 2001) - 1000) / 1000.f;
  CK(cudaMemcpy(x, hx.data(), hx.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaDeviceSynchronize());
  c.w = w; c.x = x; c.y = y;
  std::vector<int> sample_tiles;
  for (long long t = 0; t < rows / 16; t += 997) sample_tiles.push_back((int)t);
  sample_tiles.push_back((int)(rows / 16 - 1));
  std::vector<uint8_t> sample_bytes(sample_tiles.size() * 16 * (size_t)srb);
  for (size_t i = 0; i < sample_tiles.size(); ++i)
    CK(cudaMemcpy(sample_bytes.data() + i * 16 * srb, w + (size_t)sample_tiles[i] * 16 * srb, 16 * (size_t)srb,
                  cudaMemcpyDeviceToHost));
  // HBM read reference over the same buffer
  std::vector<float> bw;
  for (int r = 0; r < reps + 2; ++r) {
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    CK(cudaEventRecord(e0));
    read_bandwidth<<<4 * nsm, 512>>>(reinterpret_cast<const uint4*>(w), (long long)rows * srb / 16, sink);
    CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
    float t; CK(cudaEventElapsedTime(&t, e0, e1));
    if (r >= 2) bw.push_back((float)((double)rows * srb / (t * 1e-3) / 1e9));
    CK(cudaEventDestroy(e0)); CK(cudaEventDestroy(e1));
  }
  std::sort(bw.begin(), bw.end());
  const double hbm = bw[bw.size() / 2];
  std::printf("device %s, %d SMs; buffer %.2f GB (%lld rows x %d B, K=%d G=%d, %d part%s per tile, %d computing "
              "warp%s); HBM read %.0f GB/s\n", prop.name, nsm, rows * (double)srb / 1e9, rows, srb, K, G, S,
              S > 1 ? "s" : "", W, W > 1 ? "s" : "", hbm);
  std::vector<Result> out;
  if (DOT_DIAG && G != 128) { std::fprintf(stderr, "mma_dot_bench: DOT_DIAG builds take --G 128 only\n"); return 2; }
  if ((DOT_DIAG == 9 || DOT_DIAG == 12) && S != 1) {
    std::fprintf(stderr, "mma_dot_bench: DOT_DIAG=9 / 12 take --parts 1 (tile pairs)\n");
    return 2;
  }
  for (int resident = 0; resident < 2; ++resident) {
    out.push_back(run_one<1>(c, resident, reps, nsm, sample_tiles, sample_bytes, hx));
    out.push_back(run_one<2>(c, resident, reps, nsm, sample_tiles, sample_bytes, hx));
    if (DOT_DIAG) continue;  // (the diagnostic copy is the packed M <= 4 loop; M = 1 and 2 suffice)
    out.push_back(run_one<4>(c, resident, reps, nsm, sample_tiles, sample_bytes, hx));
    out.push_back(run_one<8>(c, resident, reps, nsm, sample_tiles, sample_bytes, hx));
  }
  std::printf("%-9s %2s %2s %5s %10s %8s %7s %12s %9s\n", "mode", "S", "M", "slots", "us", "GB/s", "of HBM", "Gcodes/s",
              "rel err");
  bool ok = true;
  for (const Result& r : out) {
    std::printf("%-9s %2d %2d %5d %10.1f %8.0f %6.1f%% %12.1f %9.2e\n", r.mode.c_str(), S, r.M, r.nslots, r.us, r.gbps,
                r.gbps > 0 ? 100.0 * r.gbps / hbm : 0.0, r.codes_per_s / 1e9, r.rel_err);
    const bool checked = DOT_DIAG == 0 || DOT_DIAG == 7 || (DOT_DIAG >= 9 && DOT_DIAG <= 12);  // the others are wrong by design
    if (r.mode == "stream" && !(r.rel_err >= 0 && r.rel_err < 2e-3) && checked) ok = false;
  }
  std::printf("{\"device\": \"%s\", \"K\": %d, \"G\": %d, \"parts\": %d, \"dot_diag\": %d, \"hbm_read_gbps\": %.1f, "
              "\"results\": [", prop.name, K, G, S, DOT_DIAG, hbm);
  for (size_t i = 0; i < out.size(); ++i)
    std::printf("%s{\"mode\": \"%s\", \"M\": %d, \"slots\": %d, \"us\": %.2f, \"gbps\": %.1f, \"gcodes_per_s\": %.2f, "
                "\"rel_err\": %.3e}", i ? ", " : "", out[i].mode.c_str(), out[i].M, out[i].nslots, out[i].us,
                out[i].gbps, out[i].codes_per_s / 1e9, out[i].rel_err);
  std::printf("], \"correct\": %s}\n", ok ? "true" : "false");
  CK(cudaFree(w)); CK(cudaFree(x)); CK(cudaFree(y)); CK(cudaFree(sink));
  return ok ? 0 : 1;
}
