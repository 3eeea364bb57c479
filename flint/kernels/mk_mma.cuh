// flint decode megakernel: int4 x fp16 dot of a 16-row weight tile with up to 8 tokens on the
// tensor cores (mma.sync m16n8k16, fp32 accumulation), reading flint's repacked row-segment layout.
// x is carried as two fp16 terms (hi + lo, ~22 significant bits), so the dot's error is that of the
// fp32 accumulation, not of fp16 activations. The lane/register mapping below is emulated
// bit-for-bit (one term) in lab/mma_dot_emulation.py (pytest lab/tests/test_mma_dot_emulation.py);
// validated on the H200 by lab/cuda/mma_dot_bench.cu (fp64 host reference: 4.8e-6 relative
// at K = 2560, G = 128, M = 1..4; 1.3e-5 at M = 8) and inside the megakernel by tests/test_megakernel.py.
//
// ---- Operand layout (source: PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point
// type", .f16 A/B, .f32 C/D; groupID = lane >> 2, tig = lane & 3):
//   A (16x16, row-major, 4 x .f16x2 regs): a0 = A[groupID  ][2tig, 2tig+1]   a1 = A[groupID+8][2tig, 2tig+1]
//                                           a2 = A[groupID  ][2tig+8, +9]    a3 = A[groupID+8][2tig+8, +9]
//   B (16x8, col-major, 2 x .f16x2 regs):   b0 = B[2tig, 2tig+1][groupID]    b1 = B[2tig+8, 2tig+9][groupID]
//   C/D (16x8, 4 x f32):                    c0,c1 = D[groupID][2tig, 2tig+1] c2,c3 = D[groupID+8][2tig, 2tig+1]
//   (lower k / lower column in the low 16 bits of a .f16x2 register.)
// Here: A rows = 16 weight rows of the tile, B columns = staged x rows: tokens' hi terms, and for
// M <= 4 also their lo terms (see mma_tile_dot); columns of absent tokens read a valid row and their
// outputs are dropped.
//
// ---- Weights (flint/megakernel.py repack): row r of the tile starts at tile + r * srb; bytes
// [0, kseg/2) are flint-int4-v1 codes (byte j: code 2j low nibble, 2j+1 high nibble, so nibble i of
// 32-bit word w is code 8w + i), then kseg/G half2 (scale, min). Per group (G codes) a lane loads
// WPL = G/32 words of its row groupID and WPL words of row groupID+8: words tig*WPL .. tig*WPL+WPL-1
// of the group (one LDS.32 / .64 / .128). A whole mma (16 k) therefore stays inside one group, so
// one fp32 accumulator per group can take the group's scale.
//
// ---- Dequant (exact): fp16 0x6400 = 1024 with ulp 1, so for a word w with nibbles q0..q7
//   (w      & 0x000F000F) | 0x64006400 = half2(1024 + q0, 1024 + q4)
//   (w      & 0x00F000F0) | 0x64006400 = half2(1024 + 16 q1, 1024 + 16 q5)   (x prescaled by 1/16)
//   (w >> 8 & 0x000F000F) | 0x64006400 = half2(1024 + q2, 1024 + q6)
//   (w >> 8 & 0x00F000F0) | 0x64006400 = half2(1024 + 16 q3, 1024 + 16 q7)
// one SHF + four LOP3 per 8 codes. Word c of the lane's group share feeds two mmas:
//   mma 2c:   a0/a1 = (q0, q4) of rows g / g+8, a2/a3 = (16q1, 16q5)
//   mma 2c+1: a0/a1 = (q2, q6),                 a2/a3 = (16q3, 16q7)
//
// ---- Staged x (fp16; written by stage_x, mk_stage.cuh; lab/cuda/mma_dot_bench.cu has a plain
// reference of the same layout): hi row of token m at
// xs + m * xstride, lo row at xs + (M + m) * xstride; within a row the G codes
// of group gi occupy fp16 elements [gi*G, gi*G + G) but permuted: lane tig's B fragments for word c
// are ONE 16-byte chunk at element gi*G + (4c + tig) * 8, slots
//   [b0 lo, b0 hi, b1 lo, b1 hi] of mma 2c, then of mma 2c+1  =  codes 8w + {0, 4, 1, 5, 2, 6, 3, 7}
// (w = tig*WPL + c), odd codes (the 16q nibbles) stored as x/16. So the 4 lanes of one token read 64
// contiguous bytes per LDS.128; xstride = roundup(2 kseg, 128) + 64 bytes puts tokens g and g+1
// (the same 8-lane phase) in opposite halves of the 32 banks.
// xsum: MMA_XSUM_FLOATS (24) floats per group gi, for 8 tokens n (zeros for absent tokens), with
//   off_n = -1024 * (fp32 sum of the group's staged fp16 values x'),  eff_n = sum of x' * (16 if odd k else 1)
//   [4t .. 4t+3] = (off_2t, off_2t+1, off_2t, off_2t+1)   t = 0..3: lane tig's initial C, one LDS.128
//   [16 + n]     = eff_n                                  lane tig reads eff_2t, eff_2t+1: one LDS.64
//
// ---- Group algebra: with x'_k the staged fp16 value and c_k = 16 for odd k else 1,
//   C = sum_k (1024 + c_k q_k) x'_k  =  1024 sum x' + sum q x_eff        (x_eff = c_k x'_k, exact)
//   sum_k (s q_k + m) x_eff_k = s (C - 1024 sum x') + m sum x_eff.
// The -1024 sum x' term is the initial C of the group's first mma chain (no extra FADD); two mma
// chains per group (even / odd mma) halve the dependent HMMA chain. Precision: C carries ~1024|x|
// per element while the signal is ~7.5|x|, i.e. ~7 bits of the fp32 accumulator go to the offset
// (measured by the dev bench against fp64: 4.8e-6 relative for the whole dot at K = 2560).
// Limits: a lo term below 2^-14 (|x| < ~1e-3 for odd codes, stored / 16) is subnormal and adds
// little precision (those elements contribute little to the sum); |x| >= 65520 overflows fp16
// (hi = inf, lo = -inf: the dot returns NaN).
#pragma once
#include <cuda_fp16.h>
#include <stdint.h>

#include "mk_ptx.cuh"


namespace mkmma {

constexpr int MMA_MAX_TOKENS = 8;
constexpr int MMA_XSUM_FLOATS = 24;  // per group (see the header)

// Bytes between staged token rows (see the header: conflict-free LDS.128 for tokens g, g+1).
__host__ __device__ constexpr int mma_x_stride_bytes(int kseg) { return (2 * kseg + 127) / 128 * 128 + 64; }

// fp16 element index of code k (0 <= k < kseg) inside a staged token row, group size G (32/64/128).
__host__ __device__ inline int mma_x_pos(int k, int G) {
  const int wpl = G >> 5;
  const int gi = k / G, r = k - gi * G;
  const int w = r >> 3, i = r & 7;
  const int tig = w / wpl, c = w - tig * wpl;
  const int slot = 2 * (i & 3) + (i >> 2);  // inverse of {0,4,1,5,2,6,3,7}
  return gi * G + (c * 4 + tig) * 8 + slot;
}

// WPL consecutive 32-bit code words (one LDS of 4, 8 or 16 bytes)
template <int WPL>
__device__ __forceinline__ void mma_lds_words(uint32_t a, uint32_t (&w)[WPL]) {
  if constexpr (WPL == 1) {
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(w[0]) : "r"(a));
  } else if constexpr (WPL == 2) {
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "r"(a));
  } else {
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "r"(a));
  }
}

// (a & MASK) | magic in one LOP3 (magic in a register: with two immediates ptxas emits two ops)
template <uint32_t MASK>
__device__ __forceinline__ uint32_t mma_nib(uint32_t a, uint32_t magic) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "n"(MASK), "r"(magic));
  return d;
}

// dot_perm_row: the tile row that the mma's A row g (0..7; row g + 8 -> the result + 8) reads, for rows of srb bytes
// and G = 128 (a lane loads 16 bytes of its row per group: one quarter-warp covers rows g = 2q, 2q + 1, 64 bytes each).
// Two rows d apart sit (d srb / 4) mod 32 banks apart; the pair (r, r + d) with d srb / 4 = 16 mod 32 takes the
// quarter's two rows: d = 1 (srb / 4 = 16 mod 32: the identity), 2 (8 mod 16), 4 (4 mod 8). Otherwise the identity.
__host__ __device__ inline int dot_perm_row(int g, int srb, int G) {
  const int w = (srb >> 2) & 31;
  if (G != 128) return g;
  if ((w & 15) == 8) return ((g >> 1) & 1) | ((g & 1) << 1) | (g & 4);  // pairs (r, r + 2), r in {0, 1, 4, 5}
  if ((w & 7) == 4) return (g >> 1) | ((g & 1) << 2);                  // pairs (r, r + 4), r in 0..3
  return g;
}

__device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

#pragma nv_diag_suppress 550  // (mma_16816_top's discarded half is set and never used: by design)
// the same mma for A rows 0..7 only (rows 8..15 zero): d accumulates rows 0..7, the other half is discarded
__device__ __forceinline__ void mma_16816_top(float (&d)[2], uint32_t a0, uint32_t a2, uint32_t b0, uint32_t b1) {
  float x2, x3;
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %6, %5, %6}, {%7, %8}, "
      "{%0, %1, %9, %9};"
      : "+f"(d[0]), "+f"(d[1]), "=f"(x2), "=f"(x3)
      : "r"(a0), "r"(a2), "r"(0u), "r"(b0), "r"(b1), "f"(0.f));
}
#pragma nv_diag_default 550

// ---------------------------------------------------------------- the tile dot (one warp)
// tile: shared address of the tile's row 0 (rows at stride srb); kseg codes per row; groups
// [gi0, gi1) of the tile (G = 32 * WPL); xs / xstride / xsum: the staged x of this K range
// (group gi of the tile reads x group gi); M tokens (1..8).
// Out: acc[0], acc[1] = row groupID, tokens 2tig, 2tig+1; acc[2], acc[3] = row groupID+8, same tokens.
// No warp reduction: the mma sums across lanes.
// The hi and lo terms: for M <= 4 they share ONE mma, as B columns (n < M: hi rows of the tokens,
// LB <= n < LB + M: the lo rows, staged rows M..2M-1; the xsum entries of columns >= M are 0), and
// the token sums are col m + col LB + m (same lane for M = 1, a shuffle for M = 2..4); for M > 4 the
// lo rows take a second mma per word.
// Packed hi and lo columns (M <= 4): token m's sum = column m (hi) + column LB + m (lo), LB = 1 / 2 / 4 for M = 1 / 2 /
// 3..4; in the same lane at M = 1, else in lanes tig and tig ^ (LB / 2) (a shuffle). Every tile dot's last step.
template <int M>
__device__ __forceinline__ void fold_lo_columns(float (&acc)[4]) {
  static_assert(M >= 1 && M <= 4, "packed columns: M <= 4");
  constexpr int LB = M == 1 ? 1 : M == 2 ? 2 : 4;
  if constexpr (M == 1) {
    acc[0] += acc[1];
    acc[2] += acc[3];
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], LB / 2);
  }
}

template <int WPL, int M, int UNROLL>
__device__ __forceinline__ void mma_tile_dot(uint32_t tile, int srb, int kseg, int gi0, int gi1, uint32_t xs,
                                             int xstride, uint32_t xlo, uint32_t xsum, int lane, float (&acc)[4],
                                             int arow = -1) {
  constexpr int G = 32 * WPL;
  constexpr bool PACKED = 2 * M <= 8;
  const int g = lane >> 2, t = lane & 3;
  // staged row feeding B column g: hi rows 0..M-1 in columns 0..M-1; PACKED: lo rows M..2M-1 in
  // columns LB..LB+M-1, LB = 1 / 2 / 4 for M = 1 / 2 / 3..4 (so a token's two columns are in one lane
  // or in lanes tig and tig ^ (LB / 2)); other columns read row 0 and are dropped
  constexpr int LB = M == 1 ? 1 : M == 2 ? 2 : 4;
  const int row = !PACKED ? min(g, M - 1) : g < M ? g : (g >= LB && g < LB + M) ? M + g - LB : 0;
  const uint32_t row_a = tile + (uint32_t)((arow < 0 ? g : arow) * srb);
  const uint32_t row_b = row_a + (uint32_t)(8 * srb);
  const uint32_t code_a = row_a + (uint32_t)(t * WPL * 4), code_b = row_b + (uint32_t)(t * WPL * 4);
  const uint32_t sm_a = row_a + (uint32_t)(kseg >> 1), sm_b = row_b + (uint32_t)(kseg >> 1);
  const uint32_t xa = xs + (uint32_t)(row * xstride + t * 16);
  const uint32_t xs_off = xsum + (uint32_t)(t * 16), xs_eff = xsum + (uint32_t)(64 + t * 8);
  uint32_t magic;
  asm("mov.b32 %0, 0x64006400;" : "=r"(magic));
#pragma unroll
  for (int j = 0; j < 4; ++j) acc[j] = 0.f;
#pragma unroll UNROLL
  for (int gi = gi0; gi < gi1; ++gi) {
    uint32_t wa[WPL], wb[WPL];
    mma_lds_words<WPL>(code_a + (uint32_t)(gi * (G / 2)), wa);
    mma_lds_words<WPL>(code_b + (uint32_t)(gi * (G / 2)), wb);
    // the first chain starts at -1024 sum x' (columns 2t, 2t+1 for rows g and g+8; 0 for lo columns)
    const uint4 off = mk::lds128(xs_off + (uint32_t)(gi * MMA_XSUM_FLOATS * 4));
    float d0[4] = {__uint_as_float(off.x), __uint_as_float(off.y), __uint_as_float(off.z), __uint_as_float(off.w)};
    float d1[4] = {0.f, 0.f, 0.f, 0.f}, e0[4] = {0.f, 0.f, 0.f, 0.f}, e1[4] = {0.f, 0.f, 0.f, 0.f};
    float2 eff;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(eff.x), "=f"(eff.y)
                 : "r"(xs_eff + (uint32_t)(gi * MMA_XSUM_FLOATS * 4)));
#pragma unroll
    for (int c = 0; c < WPL; ++c) {
      const uint32_t xo = xa + (uint32_t)(gi * G * 2 + c * 64);
      const uint4 xh = mk::lds128(xo);
      const uint32_t a_lo = wa[c], b_lo = wb[c];
      const uint32_t a_hi = a_lo >> 8, b_hi = b_lo >> 8;
      const uint32_t p0 = mma_nib<0x000F000Fu>(a_lo, magic), p1 = mma_nib<0x000F000Fu>(b_lo, magic);
      const uint32_t p2 = mma_nib<0x00F000F0u>(a_lo, magic), p3 = mma_nib<0x00F000F0u>(b_lo, magic);
      const uint32_t r0 = mma_nib<0x000F000Fu>(a_hi, magic), r1 = mma_nib<0x000F000Fu>(b_hi, magic);
      const uint32_t r2 = mma_nib<0x00F000F0u>(a_hi, magic), r3 = mma_nib<0x00F000F0u>(b_hi, magic);
      mma_16816(d0, p0, p1, p2, p3, xh.x, xh.y);
      mma_16816(d1, r0, r1, r2, r3, xh.z, xh.w);
      if constexpr (!PACKED) {  // the lo rows in their own mma
        const uint4 xl = mk::lds128(xo + xlo);
        mma_16816(e0, p0, p1, p2, p3, xl.x, xl.y);
        mma_16816(e1, r0, r1, r2, r3, xl.z, xl.w);
      }
    }
    const uint32_t hsa = mk::lds32(sm_a + (uint32_t)(gi * 4)), hsb = mk::lds32(sm_b + (uint32_t)(gi * 4));
    const float2 fa = __half22float2(*reinterpret_cast<const __half2*>(&hsa));  // (scale, min) row g
    const float2 fb = __half22float2(*reinterpret_cast<const __half2*>(&hsb));  // row g + 8
    if constexpr (M == 1) {  // columns 0 (hi) and 1 (lo) of the one token, summed before the scale
      const float effs = eff.x + eff.y;
      acc[0] = fmaf(fa.x, (d0[0] + d1[0]) + (d0[1] + d1[1]), fmaf(fa.y, effs, acc[0]));
      acc[2] = fmaf(fb.x, (d0[2] + d1[2]) + (d0[3] + d1[3]), fmaf(fb.y, effs, acc[2]));
    } else {
      acc[0] = fmaf(fa.x, (d0[0] + d1[0]) + (e0[0] + e1[0]), fmaf(fa.y, eff.x, acc[0]));
      acc[1] = fmaf(fa.x, (d0[1] + d1[1]) + (e0[1] + e1[1]), fmaf(fa.y, eff.y, acc[1]));
      acc[2] = fmaf(fb.x, (d0[2] + d1[2]) + (e0[2] + e1[2]), fmaf(fb.y, eff.x, acc[2]));
      acc[3] = fmaf(fb.x, (d0[3] + d1[3]) + (e0[3] + e1[3]), fmaf(fb.y, eff.y, acc[3]));
    }
  }
  if constexpr (PACKED) fold_lo_columns<M>(acc);
}

// Runtime G dispatch (G in 32/64/128; anything else is refused by the host at create time).
template <int M, int UNROLL = 1>
__device__ __forceinline__ void mma_tile_dot_g(int G, uint32_t tile, int srb, int kseg, int gi0, int gi1, uint32_t xs,
                                               int xstride, uint32_t xlo, uint32_t xsum, int lane, float (&acc)[4],
                                               int arow = -1) {
  if (G == 128) mma_tile_dot<4, M, UNROLL>(tile, srb, kseg, gi0, gi1, xs, xstride, xlo, xsum, lane, acc, arow);
  else if (G == 64) mma_tile_dot<2, M, UNROLL>(tile, srb, kseg, gi0, gi1, xs, xstride, xlo, xsum, lane, acc);
  else mma_tile_dot<1, M, UNROLL>(tile, srb, kseg, gi0, gi1, xs, xstride, xlo, xsum, lane, acc);
}

// ---------------------------------------------------------------- the integer tile dot
// x as two int8 terms per token and group (the numerics: lab/int8_x_study.py; the lane mapping:
// lab/imma_dot_emulation.py): mma.m16n8k32.s32.s8.s8.s32 on the codes as bytes, M <= 4 (hi and lo terms as B
// columns, as in the packed fp16 dot). The product runs it at M = 1 only: gate|up in groups of 32 of the integer
// object (the raw-byte form below takes groups of 64 and 128).
// Fragments (PTX ISA, m16n8k32 .s8; groupID g = lane >> 2, tig t = lane & 3), as used here and in the
// emulation (confirmed on the H200: the real-SmolLM2 greedy test passes with every stage on this dot):
//   A: a0 = A[g][4t .. 4t+3]  a1 = A[g+8][4t .. 4t+3]  a2 = A[g][16+4t .. +3]  a3 = A[g+8][16+4t .. +3]
//   B: b0 = B[4t .. 4t+3][g]  b1 = B[16+4t .. +3][g]   (byte i of a register = element i)
//   D: d0, d1 = D[g][2t, 2t+1]  d2, d3 = D[g+8][2t, 2t+1]   (s32)
// The weight layout is unchanged: mma c of a group uses word w = t * WPL + c of rows g and g+8;
// w & 0x0F0F0F0F holds codes 8w + {0,2,4,6} (the k = 4t.. of a0 / a1), (w >> 4) & 0x0F0F0F0F codes
// 8w + {1,3,5,7} (k = 16 + 4t..). The staged x row (int8, hi rows 0..M-1, lo rows M..2M-1 as for fp16)
// keeps word order with the bytes of each word as x(8w + {0,2,4,6,1,3,5,7}), so lane t's B registers for
// its WPL words are 8 WPL contiguous bytes. xsum per group: [4t + j] = (cs(2t), cs(2t+1), cm(2t),
// cm(2t+1)) with column n = token m (hi: cs = s_m, cm = X_m = s_m (sum hi + sum lo / 254)) or LB + m
// (lo: cs = s_m / 254, cm = 0); absent columns 0. Per group: acc_n += s_w cs_n D_n + m_w cm_n.
// (U8A: A's bytes unsigned, the raw-byte dot below)
template <bool U8A = false>
__device__ __forceinline__ void imma_16832(int (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                           uint32_t b0, uint32_t b1) {
  if constexpr (U8A)
    asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  else
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// the raw-byte staging's row pitch from the fp16 staging's xstride (= roundup(2 K, 128) + 64): four rows fit the fp16 hi and lo
// rows' 2 xstride bytes, and rows 0 / 1 start 16 or 80 bytes apart modulo 128 (conflict-free LDS.128 phases)
__host__ __device__ constexpr int imma_raw_pitch(int xstride) { return ((xstride - 64) >> 1) + 16; }

// A lane's shared-memory addresses in the integer tile dot (group 0): its code words of rows g and g + 8, their
// (scale, min) words, its x bytes (B column g: hi rows 0..M-1, lo rows in columns LB..LB+M-1) and its xsum entries
template <int WPL, int M>
struct ImmaLane {
  uint32_t code_a, code_b, sm_a, sm_b, xa, xs_c;
  __device__ __forceinline__ ImmaLane(uint32_t tile, int srb, int kseg, uint32_t xs, int xstride, uint32_t xsum,
                                      int lane, int arow = -1) {
    constexpr int LB = M == 1 ? 1 : M == 2 ? 2 : 4;
    const int g = lane >> 2, t = lane & 3;
    const int row = g < M ? g : (g >= LB && g < LB + M) ? M + g - LB : 0;
    const uint32_t row_a = tile + (uint32_t)((arow < 0 ? g : arow) * srb), row_b = row_a + (uint32_t)(8 * srb);
    code_a = row_a + (uint32_t)(t * WPL * 4);
    code_b = row_b + (uint32_t)(t * WPL * 4);
    sm_a = row_a + (uint32_t)(kseg >> 1);
    sm_b = row_b + (uint32_t)(kseg >> 1);
    xa = xs + (uint32_t)(row * xstride + t * WPL * 8);
    xs_c = xsum + (uint32_t)(t * 16);
  }
};

template <int WPL, int M>
__device__ __forceinline__ void imma_tile_dot(uint32_t tile, int srb, int kseg, int gi0, int gi1, uint32_t xs,
                                              int xstride, uint32_t xsum, int lane, float (&acc)[4], int arow = -1) {
  static_assert(M >= 1 && M <= 4, "the integer dot packs hi and lo terms as B columns: M <= 4");
  constexpr int G = 32 * WPL;
  const ImmaLane<WPL, M> ln(tile, srb, kseg, xs, xstride, xsum, lane, arow);
  const uint32_t code_a = ln.code_a, code_b = ln.code_b, sm_a = ln.sm_a, sm_b = ln.sm_b, xa = ln.xa, xs_c = ln.xs_c;
#pragma unroll
  for (int j = 0; j < 4; ++j) acc[j] = 0.f;
  for (int gi = gi0; gi < gi1; ++gi) {
    uint32_t wa[WPL], wb[WPL], xb[2 * WPL];
    mma_lds_words<WPL>(code_a + (uint32_t)(gi * (G / 2)), wa);
    mma_lds_words<WPL>(code_b + (uint32_t)(gi * (G / 2)), wb);
    const uint32_t xg = xa + (uint32_t)(gi * G);
    if constexpr (WPL == 1) {
      asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(xb[0]), "=r"(xb[1]) : "r"(xg));
    } else {
#pragma unroll
      for (int h = 0; h < WPL / 2; ++h) {
        const uint4 v = mk::lds128(xg + (uint32_t)(16 * h));
        xb[4 * h] = v.x; xb[4 * h + 1] = v.y; xb[4 * h + 2] = v.z; xb[4 * h + 3] = v.w;
      }
    }
    const uint4 cs = mk::lds128(xs_c + (uint32_t)(gi * MMA_XSUM_FLOATS * 4));
    int d[4] = {0, 0, 0, 0};
#pragma unroll
    for (int c = 0; c < WPL; ++c) {
      const uint32_t a0 = wa[c] & 0x0F0F0F0Fu, a1 = wb[c] & 0x0F0F0F0Fu;
      const uint32_t a2 = (wa[c] >> 4) & 0x0F0F0F0Fu, a3 = (wb[c] >> 4) & 0x0F0F0F0Fu;
      imma_16832(d, a0, a1, a2, a3, xb[2 * c], xb[2 * c + 1]);
    }
    const uint32_t hsa = mk::lds32(sm_a + (uint32_t)(gi * 4)), hsb = mk::lds32(sm_b + (uint32_t)(gi * 4));
    const float2 fa = __half22float2(*reinterpret_cast<const __half2*>(&hsa));  // (scale, min) row g
    const float2 fb = __half22float2(*reinterpret_cast<const __half2*>(&hsb));  // row g + 8
    const float c0 = __uint_as_float(cs.x), c1 = __uint_as_float(cs.y);
    const float m0 = __uint_as_float(cs.z), m1 = __uint_as_float(cs.w);
    acc[0] = fmaf(__int2float_rn(d[0]), fa.x * c0, fmaf(fa.y, m0, acc[0]));
    acc[1] = fmaf(__int2float_rn(d[1]), fa.x * c1, fmaf(fa.y, m1, acc[1]));
    acc[2] = fmaf(__int2float_rn(d[2]), fb.x * c0, fmaf(fb.y, m0, acc[2]));
    acc[3] = fmaf(__int2float_rn(d[3]), fb.x * c1, fmaf(fb.y, m1, acc[3]));
  }
  fold_lo_columns<M>(acc);  // as in the packed fp16 dot
}

// ---------------------------------------------------------------- the raw-byte integer tile dot (M = 1, 2)
// The integer dot above splits each code word into its even and odd nibbles
// (w & 0x0F0F0F0F, (w >> 4) & 0x0F0F0F0F: LOP3 + SHF + LOP3 per word). Here the words go to mma.m16n8k32.u8.s8 as they
// are, byte i of word w being r = q(8w + 2i) + 16 q(8w + 2i + 1) (0..255), and once masked, w & 0xF0F0F0F0, byte i
// being 16 q(8w + 2i + 1): one LOP3 per word. With B columns (M = 1; column n is the x row lane group g = n reads)
//   raw mma:    col 0 = xh_e, col 1 = xl_e, cols 2, 3 = 0            (x_e = x(8w + 2i), x_o = x(8w + 2i + 1); hi and
//   masked mma: col 0 = -xh_e, col 1 = -xl_e, col 2 = xh_o, col 3 = xl_o  lo int8 terms of the int8 staging)
// their sum is, exactly (int32): col 0 = sum q_e xh_e, col 1 = sum q_e xl_e, col 2 = 16 sum q_o xh_o, col 3 = 16 sum
// q_o xl_o. Lane t = 0 holds columns 0, 1 and lane t = 1 columns 2, 3 (D fragment), so each forms 254 d_hi + d_lo
// (one IMAD; |.| < 2^29) and applies its own column scale: (s / 254) for t = 0, (s / 4064) for t = 1, 0 for t = 2, 3;
// the group's min term m_w * X rides on t = 0 only. The two lanes' sums are added once per call (a shuffle).
// Mma c of a group (WPL / 2 per group) takes words 2c and 2c + 1 of the lane's WPL (a0 / a1: k = 4t .. 4t + 3 of rows
// g / g + 8, a2 / a3: k = 16 + 4t ..). Staged row n (pitch `pitch` bytes, rows 0..3, lane groups g >= 4 read row 0):
// per group G bytes, lane t's 8 WPL bytes at gi G + 8 WPL t: first the raw mma's B (4 WPL bytes: word j's 4 bytes at
// 4 j), then the masked mma's (the same at + 4 WPL). xsum per group: floats [4 + 2t, 5 + 2t] = (column scale, min
// term) of lane t: (s / 254, X), (s / 4064, 0), then zeros. The staging: stage_x (mk_stage.cuh), its raw-byte branch.
// M = 2 fills the 8 columns: token m's four are 4m .. 4m + 3 (staged rows 4m .. 4m + 3, lanes t = 2m, 2m + 1, xsum
// floats 4 + 4m ..): per token the same exact int32 sums and fp32 epilogue as M = 1, so its rows equal the M = 1 dot's.
template <int WPL, int M = 1>
__device__ __forceinline__ void imma_raw_tile_dot(uint32_t tile, int srb, int kseg, int gi0, int gi1, uint32_t xs,
                                                  int pitch, uint32_t xsum, int lane, float (&acc)[4],
                                                  int arow = -1) {
  static_assert(WPL == 2 || WPL == 4, "the raw-byte dot: one mma takes two words per row (G = 64 or 128)");
  static_assert(M == 1 || M == 2, "the raw-byte dot: four columns a token");
  constexpr int G = 32 * WPL;
  const int g = lane >> 2, t = lane & 3;
  // (x's registers as an array set to zero first: the form v21 and v22 were validated with; without the zeroing
  // ptxas allocates and schedules the kernel differently, another compile, not measured)
  uint4 xq[WPL / 2];
#pragma unroll
  for (int h = 0; h < WPL / 2; ++h) xq[h] = make_uint4(0u, 0u, 0u, 0u);
  const uint32_t row_a = tile + (uint32_t)((arow < 0 ? g : arow) * srb), row_b = row_a + (uint32_t)(8 * srb);
  const uint32_t code_a = row_a + (uint32_t)(t * WPL * 4), code_b = row_b + (uint32_t)(t * WPL * 4);
  const uint32_t sm_a = row_a + (uint32_t)(kseg >> 1), sm_b = row_b + (uint32_t)(kseg >> 1);
  const uint32_t xa = xs + (uint32_t)((M == 2 ? g : g < 4 ? g : 0) * pitch + t * WPL * 8);
  const uint32_t xs_c = xsum + (uint32_t)(16 + t * 8);
  acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
  for (int gi = gi0; gi < gi1; ++gi) {
    uint32_t wa[WPL], wb[WPL], xb[2 * WPL];
    mma_lds_words<WPL>(code_a + (uint32_t)(gi * (G / 2)), wa);
    mma_lds_words<WPL>(code_b + (uint32_t)(gi * (G / 2)), wb);
    const uint32_t xg = xa + (uint32_t)(gi * G);
#pragma unroll
    for (int h = 0; h < WPL / 2; ++h) {
      xq[h] = mk::lds128(xg + (uint32_t)(16 * h));
      const uint4 v = xq[h];
      xb[4 * h] = v.x; xb[4 * h + 1] = v.y; xb[4 * h + 2] = v.z; xb[4 * h + 3] = v.w;
    }
    float2 cs;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(cs.x), "=f"(cs.y)
                 : "r"(xs_c + (uint32_t)(gi * MMA_XSUM_FLOATS * 4)));
    int d[4] = {0, 0, 0, 0};
#pragma unroll
    for (int c = 0; c < WPL / 2; ++c)  // raw words, x_even
      imma_16832<true>(d, wa[2 * c], wb[2 * c], wa[2 * c + 1], wb[2 * c + 1], xb[2 * c], xb[2 * c + 1]);
#pragma unroll
    for (int c = 0; c < WPL / 2; ++c)  // odd nibbles in place (16 q), -x_even | x_odd
      imma_16832<true>(d, wa[2 * c] & 0xF0F0F0F0u, wb[2 * c] & 0xF0F0F0F0u, wa[2 * c + 1] & 0xF0F0F0F0u,
                    wb[2 * c + 1] & 0xF0F0F0F0u, xb[WPL + 2 * c], xb[WPL + 2 * c + 1]);
    const uint32_t hsa = mk::lds32(sm_a + (uint32_t)(gi * 4)), hsb = mk::lds32(sm_b + (uint32_t)(gi * 4));
    const float2 fa = __half22float2(*reinterpret_cast<const __half2*>(&hsa));  // (scale, min) row g
    const float2 fb = __half22float2(*reinterpret_cast<const __half2*>(&hsb));  // row g + 8
    const int ca = d[0] * 254 + d[1], cb = d[2] * 254 + d[3];
    acc[0] = fmaf(__int2float_rn(ca), fa.x * cs.x, fmaf(fa.y, cs.y, acc[0]));
    acc[2] = fmaf(__int2float_rn(cb), fb.x * cs.x, fmaf(fb.y, cs.y, acc[2]));
  }
  acc[0] += __shfl_xor_sync(0xffffffffu, acc[0], 1);  // lanes t = 0 and 1: the even and the odd codes
  acc[2] += __shfl_xor_sync(0xffffffffu, acc[2], 1);
  if constexpr (M == 2) {  // token 1's sums (lanes t = 2, 3) to acc[1] / acc[3] of lanes t = 0, 1 (the packed dots' layout)
    acc[1] = __shfl_xor_sync(0xffffffffu, acc[0], 2);
    acc[3] = __shfl_xor_sync(0xffffffffu, acc[2], 2);
  }
}

}  // namespace mkmma
