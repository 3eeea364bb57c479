// flint decode megakernel: a context split of one 64-key tile on the tensor cores, for the verify objects of
// M = 3 and 4 at short context, head_dim 64.
//
// The scalar loops of mk_attention.cuh give a warp a row: at M = 4 on Granite (20 rows) scores, softmax and P V take
// 5.3 us of a traced split, a third of attention and the wait after it. Here rows go in blocks of 16 (the mma's M),
// four warps a block: warp (rb, wq), wq = warp & 3, computes S = Q K^T for rows [16 rb, 16 rb + 16) and keys
// [16 wq, 16 wq + 16) (q as fp16 hi + lo: two mmas a k-step, ~22 bits); the four agree on each row's maximum through
// shared memory (a block barrier), write P = exp(S - max) as fp16 hi + lo and their rows' partial sums (a block
// barrier), then the same warp computes O = P V for dims [16 wq, 16 wq + 16) over all 64 keys (P by ldmatrix as the A
// operand, V by transposing ldmatrix) and writes it: no sum of partial O's. The result is what the scalar loops
// leave: o_s [R][64] unnormalised, att_m / att_l the split's row maximum and sum (the quarters' sums added in order).
// Against those loops, one process (docs/megakernel-log.md, "Attention"): Granite M = 3 / 4 0.980 / 0.953 of the step,
// SmolLM2 1.004 / 0.979; at M = 2 it lost (1.008 / 1.015).
#pragma once
#include "mk_common.cuh"
#include "mk_mma.cuh"
#include "mk_ptx.cuh"
#include "mk_stage.cuh"

namespace mk {
namespace {

constexpr int ATT_MMA_D = 64;  // the head dimension of this path (the caller's check)
// row blocks of 16 this path takes, 4 warps each: R <= 48 holds every verify width of Granite (R = 5 M) and SmolLM2
// (R = 3 M)
constexpr int ATT_MMA_MAX_RB = 3;
// the widths whose objects take this path: M = 2 lost against the scalar loop (above); M = 1 keeps its own loop
// (3 warps a row; with this path its objects spilled 44-208 bytes); the M >= 5 objects, at 128 registers before it,
// spilled 4-16 bytes with it
constexpr int ATT_MMA_MIN_M = 3;
constexpr int ATT_MMA_MAX_M = 4;

// Kt, Vt: the tile, [64 keys][64] fp16 in 16-byte chunks XOR-swizzled by (key & 7), keys past the context zero in V
// (P is 0 there, and 0 x stale NaN bits is not); qh: q as fp16, [R][64] hi then [R][64] lo, chunks swizzled by
// (row & 7). Row r is (q head r / M, token r % M); key j0 + j counts for row r while j0 + j <= start + r % M.
// pb: P, [R][64] fp16 hi then lo (R x 256 bytes, swizzled like q); scr: 2 x 4 ATT_MMA_MAX_RB 16 floats (the quarters'
// row maxima and sums). Every consumer thread calls it (the block barriers); warps past 4 row blocks idle.
template <int M>
__device__ __forceinline__ void att_tile_mma(const __half* Kt, const __half* Vt, const __half* qh, int R, int j0,
                                             int start, float* o_s, float* att_m, float* att_l, __half* pb,
                                             float* scr) {
  constexpr int D = ATT_MMA_D, KEYS = 64;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rb = warp >> 2, wq = warp & 3, kb = 16 * wq, g = lane >> 2;
  const bool act = rb < ((R + 15) >> 4);
  float* smax = scr;                          // [rb][wq][16]
  float* ssum = scr + 4 * ATT_MMA_MAX_RB * 16;  // [rb][wq][16]
  if (act) {
    float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};  // [8-key half][c0..c3]: rows g (c0, c1), g + 8
    const uint32_t kt_a = smem_u32(Kt), q_a = smem_u32(qh);
    const int ar = 16 * rb + (lane & 15), ra = ar < R ? ar : 0;  // this lane's A row (rows past R read row 0: dropped)
#pragma unroll 1  // (a k-step at a time, as measured: fewer live registers)
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t bk[4];  // [0..1]: keys kb..kb+7, [2..3]: kb+8..kb+15 (dim chunks 2 ks, 2 ks + 1)
      {
        const int kj = kb + (lane & 7) + ((lane >> 4) << 3), kc = 2 * ks + ((lane >> 3) & 1);
        ldsm_x4(kt_a + (uint32_t)((kj * D + ((kc ^ (kj & 7)) << 3)) * 2), bk[0], bk[1], bk[2], bk[3]);
      }
      const int qc = 2 * ks + (lane >> 4);  // (x4: lanes 0..15 rows at chunk 2 ks, 16..31 at 2 ks + 1)
      const uint32_t qa = q_a + (uint32_t)((ra * D + ((qc ^ (ra & 7)) << 3)) * 2);
      uint32_t a0, a1, a2, a3;
      ldsm_x4(qa, a0, a1, a2, a3);
      mkmma::mma_16816(sc[0], a0, a1, a2, a3, bk[0], bk[1]);
      mkmma::mma_16816(sc[1], a0, a1, a2, a3, bk[2], bk[3]);
      ldsm_x4(qa + (uint32_t)(R * D * 2), a0, a1, a2, a3);
      mkmma::mma_16816(sc[0], a0, a1, a2, a3, bk[0], bk[1]);
      mkmma::mma_16816(sc[1], a0, a1, a2, a3, bk[2], bk[3]);
    }
    // the causal mask, then each row's maximum over the quarter (a row's 16 keys sit in the four lanes of a quad);
    // the masked S goes to o_s (free until O), so no score stays in registers across the barrier
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = 16 * rb + g + 8 * h;
      const int lim = r < R ? start + r % M - j0 : -1;  // the row's last key, tile-relative
      float mx = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int j = kb + 8 * nt + 2 * (lane & 3);
        const float s0 = j <= lim ? sc[nt][2 * h] : -INFINITY, s1 = j + 1 <= lim ? sc[nt][2 * h + 1] : -INFINITY;
        mx = fmaxf(mx, fmaxf(s0, s1));
        if (r < R) *reinterpret_cast<float2*>(o_s + r * KEYS + j) = make_float2(s0, s1);
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      if ((lane & 3) == 0) smax[(rb * 4 + wq) * 16 + g + 8 * h] = mx;
    }
  }
  cbar();
  if (act) {  // P = exp(S - the row's maximum) as fp16 hi + lo into pb; the quarter's row sums into ssum
#pragma unroll 1
    for (int h = 0; h < 2; ++h) {
      const int r = 16 * rb + g + 8 * h;
      const float* sm = smax + rb * 64 + g + 8 * h;
      const float m = fmaxf(fmaxf(sm[0], sm[16]), fmaxf(sm[32], sm[48]));
      float l = 0.f;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int j = kb + 8 * nt + 2 * (lane & 3);
        const float2 sv =
            r < R ? *reinterpret_cast<const float2*>(o_s + r * KEYS + j) : make_float2(-INFINITY, -INFINITY);
        const float p0 = m == -INFINITY ? 0.f : expf(sv.x - m);
        const float p1 = m == -INFINITY ? 0.f : expf(sv.y - m);
        l += p0 + p1;
        const __half2 hi = __floats2half2_rn(p0, p1);
        const float2 hf = __half22float2(hi);
        if (r < R) {
          const int o = r * KEYS + (((2 * wq + nt) ^ (r & 7)) << 3) + (j & 7);
          *reinterpret_cast<__half2*>(pb + o) = hi;
          *reinterpret_cast<__half2*>(pb + R * KEYS + o) = __floats2half2_rn(p0 - hf.x, p1 - hf.y);
        }
      }
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      if ((lane & 3) == 0) ssum[(rb * 4 + wq) * 16 + g + 8 * h] = l;
      if (wq == 0 && (lane & 3) == 0 && r < R) att_m[r] = m;
    }
  }
  cbar();
  if (act) {  // O = P V for dims [16 wq, 16 wq + 16): the 64 keys as four k-steps
    float oacc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};  // dims 16 wq + 8 n + ..., rows g / g + 8
    const uint32_t vt_a = smem_u32(Vt), p_a = smem_u32(pb);
    const int ar = 16 * rb + (lane & 15), ra = ar < R ? ar : 0;
#pragma unroll 1
    for (int ks = 0; ks < KEYS / 16; ++ks) {
      uint32_t v0, v1, v2, v3;  // (keys 16 ks + 0..7 | 8..15) x (dims 16 wq + 0..7 | 8..15), transposed
      const int vj = 16 * ks + (lane & 7) + ((lane >> 4) << 3), vc = 2 * wq + ((lane >> 3) & 1);
      ldsm_x4_trans(vt_a + (uint32_t)((vj * D + ((vc ^ (vj & 7)) << 3)) * 2), v0, v1, v2, v3);
      const int pc = 2 * ks + (lane >> 4);
      const uint32_t pa = p_a + (uint32_t)((ra * KEYS + ((pc ^ (ra & 7)) << 3)) * 2);
      uint32_t a0, a1, a2, a3;
      ldsm_x4(pa, a0, a1, a2, a3);
      mkmma::mma_16816(oacc[0], a0, a1, a2, a3, v0, v2);
      mkmma::mma_16816(oacc[1], a0, a1, a2, a3, v1, v3);
      ldsm_x4(pa + (uint32_t)(R * KEYS * 2), a0, a1, a2, a3);
      mkmma::mma_16816(oacc[0], a0, a1, a2, a3, v0, v2);
      mkmma::mma_16816(oacc[1], a0, a1, a2, a3, v1, v3);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = 16 * rb + g + 8 * h;
      if (r < R) {
#pragma unroll
        for (int n = 0; n < 2; ++n)
          *reinterpret_cast<float2*>(o_s + r * D + 16 * wq + 8 * n + 2 * (lane & 3)) =
              make_float2(oacc[n][2 * h], oacc[n][2 * h + 1]);
        if (wq == 0 && (lane & 3) == 0) {  // the row's sum, its quarters in order
          const float* ss = ssum + rb * 64 + g + 8 * h;
          att_l[r] = ((ss[0] + ss[16]) + ss[32]) + ss[48];
        }
      }
    }
  }
  cbar();
}

}  // namespace
}  // namespace mk
