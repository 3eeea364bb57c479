// flint decode megakernel: the int8 KV cache's pieces of attention (mk_attention.cuh uses them).
// Relies on: Params / ATT_T / kv8_land_bytes (mk_common.cuh), the tagged q|k|v words (mk_sync.cuh).
#pragma once
#include "mk_common.cuh"
#include "mk_sync.cuh"

namespace mk {
namespace {

// ---- the int8 KV cache (Params::kv8): codes [L][nkv][max_seq][D] int8, one fp16 scale per row (kvscale: K's rows,
// then V's at kv_scale_off). A tile's rows land as codes and scales in a landing buffer (kv8_land_bytes) and are
// converted to the fp16 tile the loops read. This step's rows are quantized from the tagged words' fp32 values by
// the block of the split that holds them and written to the cache before that split's tiles are copied. The
// arithmetic is flint/model.py's kv_quantize: s = max |x| / 127 (a true division), the scale h = s rounded up to
// fp16, codes round-half-even(x / h) clamped to [-127, 127] (x / 1 for an all-zero row), the value code * h in fp32
// (here then rounded to fp16 for the tile).
__device__ __forceinline__ size_t kv_scale_off(const Params& p) { return (size_t)p.L * p.nkv * p.max_seq + ATT_T; }
// a landed tile's first nrows cache rows -> fp16 (K: chunks XOR-swizzled by row; V too when swz_v), threads
// tid, tid + nthr, ...: one 16-code chunk each
__device__ __forceinline__ void kv8_convert(const uint8_t* lb, __half* Kt, __half* Vt, int D, int nrows, bool swz_v,
                                            int tid, int nthr) {
  const int cc = D >> 4;
  const __half* sc = reinterpret_cast<const __half*>(lb + 2 * ATT_T * D);
  for (int i = tid; i < 2 * nrows * cc; i += nthr) {
    const int isv = i >= nrows * cc;
    const int ii = isv ? i - nrows * cc : i;
    const int j = ii / cc, c = ii - j * cc;
    const uint4 w = *reinterpret_cast<const uint4*>(lb + (size_t)isv * ATT_T * D + j * D + c * 16);
    const __half hs = sc[isv * ATT_T + j];
    const __half2 h2 = __halves2half2(hs, hs), bias = __float2half2_rn(1152.f);
    const uint32_t wd[4] = {w.x ^ 0x80808080u, w.y ^ 0x80808080u, w.z ^ 0x80808080u, w.w ^ 0x80808080u};
    uint32_t o[8];
#pragma unroll
    for (int e = 0; e < 4; ++e) {  // code x as the fp16 1024 + (x + 128), less 1152: exact; then x * h, one rounding
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const uint32_t b = __byte_perm(wd[e], 0x64646464u, hh ? 0x4342u : 0x4140u);
        const __half2 v = __hmul2(__hsub2(*reinterpret_cast<const __half2*>(&b), bias), h2);
        o[2 * e + hh] = *reinterpret_cast<const uint32_t*>(&v);
      }
    }
    __half* row = (isv ? Vt : Kt) + (size_t)j * D;
    const bool sw = !isv || swz_v;
    *reinterpret_cast<uint4*>(row + (((2 * c) ^ (sw ? (j & 7) : 0)) << 3)) = make_uint4(o[0], o[1], o[2], o[3]);
    *reinterpret_cast<uint4*>(row + (((2 * c + 1) ^ (sw ? (j & 7) : 0)) << 3)) = make_uint4(o[4], o[5], o[6], o[7]);
  }
}
// this step's rows of the split ([start, Ltot) within [r_lo, r_hi)): from the tagged words, quantized (the D / 8
// lanes of a row, consecutive and aligned, reduce its max) and written to the cache, before the split's tiles are
// copied (the copies then bring them like any row). Threads tid, tid + nthr, ... (multiples of D / 8 apart).
__device__ __forceinline__ void kv8_step_rows(const Params& p, int layer, int kvh, int r_lo, int r_hi, int start,
                                              int Ltot, uint32_t qtag, int tid, int nthr) {
  const int D = p.D, cpr = D >> 3;
  const int r0 = max(start, r_lo), nr = min(Ltot, r_hi) - r0;
  if (nr <= 0) return;
  const int lane = threadIdx.x & 31;
  const uint32_t gmask = (cpr >= 32 ? 0xffffffffu : ((1u << cpr) - 1u)) << (lane & ~(cpr - 1) & 31);
  for (int i = tid; i < 2 * nr * cpr; i += nthr) {
    const int isv = i >= nr * cpr;
    const int ii = isv ? i - nr * cpr : i;
    const int jr = ii / cpr, ch = ii - jr * cpr;
    const int pos = r0 + jr;
    float4 a, b;
    ld_tagged8(qkv_word(p, pos - start, (p.nh + isv * p.nkv + kvh) * D + ch * 8), qtag, a, b);
    const float x[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    float mx = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) mx = fmaxf(mx, fabsf(x[e]));
    for (int o = 1; o < cpr; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(gmask, mx, o));
    const __half hs = __float2half_ru(__fdiv_rn(mx, 127.f));
    const float h = __half2float(hs), den = h > 0.f ? h : 1.f;
    uint32_t cw[2] = {0u, 0u};
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int q = max(-127, min(127, __float2int_rn(__fdiv_rn(x[e], den))));
      cw[e >> 2] |= ((uint32_t)q & 0xffu) << (8 * (e & 3));
    }
    const size_t row = ((size_t)layer * p.nkv + kvh) * p.max_seq + pos;
    int8_t* cache = reinterpret_cast<int8_t*>(isv ? p.vcache : p.kcache);
    *reinterpret_cast<uint2*>(cache + row * D + ch * 8) = make_uint2(cw[0], cw[1]);
    if (ch == 0) p.kvscale[row + (isv ? kv_scale_off(p) : 0)] = hs;
  }
}

}  // namespace
}  // namespace mk
