// flint decode megakernel: how blocks wait for each other.
//
// Three mechanisms, from the heaviest to the lightest (docs/megakernel.md, "Synchronisation", says which stage
// boundary uses which and why each is safe):
//   - the grid barrier: one monotonic 64-bit counter that only grows; barrier n of a launch completes when it reaches
//     base + nblocks * n, the base being what the previous launch left in Params::epoch[1];
//   - tagged words: a value and the tag of the layer that wrote it in ONE store (8 bytes: fp32 + 32-bit tag; or 4
//     bytes: the fp32's top 24 bits + the tag's low 8 bits); a reader re-polls until every word it needs carries this
//     layer's tag, so no barrier is needed between the writer's stage and the reader's;
//   - counted fixed-point words (the objects of M <= kFxMaxM): the residual stream as 64-bit fixed point (2^-32
//     units) whose top byte counts the adds it has received; integer adds commute, so the sum is bitwise the same in
//     any order, and a reader knows from the count alone that every add of the layer has landed.
// Relies on: Params / NCT (mk_common.cuh); the consumer warps' named barrier 1 (the producer warp never joins it).
#pragma once
#include "mk_common.cuh"

namespace mk {
namespace {

// barrier among the consumer threads only (the producer warp never joins)
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

// ---- the grid barrier
// Every block's consumers arrive once (a block barrier, then thread 0's add); thread 0 spins until the counter reaches
// `target`. The fenced form releases the block's writes (cumulative over what the block barrier ordered before it)
// and acquires everyone else's. RELAXED = a counter without the fence (MEMBAR.ALL.GPU, which also waits for the
// block's bulk copies in flight: 0.42 us idle, 1.25 us with two 16 KB copies in flight, lab/cuda/hop_bench.cu): used
// only where the data behind it carry their own proof (tagged words), so the counter is a hint that every block has
// arrived, not the ordering.
template <bool RELAXED = false>
__device__ __forceinline__ void grid_barrier(const Params& p, unsigned long long target) {
  cbar();
  if (threadIdx.x == 0) {
    unsigned long long v;
    if constexpr (RELAXED) {
      asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" ::"l"(p.bar_counter), "l"(1ull) : "memory");
      do {
        asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p.bar_counter) : "memory");
      } while (v < target);
    } else {
      // release (cumulative over the block's writes ordered before it by cbar); no return value to wait for
      asm volatile("red.release.gpu.global.add.u64 [%0], %1;" ::"l"(p.bar_counter), "l"(1ull) : "memory");
      do {
        asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p.bar_counter) : "memory");
      } while (v < target);
    }
  }
  cbar();
}

// block b's share of a matrix: tiles [t0, t1)
// (32-bit: the host refuses ntiles * nblocks >= 2^31; a 64-bit division is a ~70-instruction call)
__device__ __forceinline__ void block_tiles(int ntiles, int nb, int b, int& t0, int& t1) {
  t0 = (int)((uint32_t)(ntiles * b) / (uint32_t)nb);
  t1 = (int)((uint32_t)(ntiles * (b + 1)) / (uint32_t)nb);
}

// ---- counted fixed-point residual words (the objects of M <= kFxMaxM, with the FFN split-K)
// Every add into the residual buffer X carries 1 << 56 (its count); values stay within 2^55 of 0 (|v| < 2^23 in
// fp32 terms: far above any residual of the models flint runs; beyond, the conversion saturates).
constexpr bool kFxObj = FLINT_MK_M <= kFxMaxM;  // (this object runs the counted residual and the tagged hops)
static_assert(kFxMaxM <= 2, "the counted residual's stagings fuse the rstd: rows of one round of loads (M <= 2)");
constexpr unsigned long long FX_CNT = kFxObj ? (1ull << 56) : 0ull;
template <int M>
constexpr bool kFx = kFxObj && M == FLINT_MK_M;  // (the object's one kernel)
// The fixed-point buffers (after the FFN partial sums in Params::dpart): X[0..1] (only X[0] is used; the second
// buffer, the codes' O / D / Y slots and misc->fxc[1] are the layout the kernel was validated with). A stage_x source
// code names the two buffers to add (b: FXB_NONE = none) and the one the rows' owners write the sum to.
enum { FXB_X = 0, FXB_O = 2, FXB_D = 4, FXB_Y = 6, FXB_NONE = 15 };
__host__ __device__ constexpr int fx_code(int a, int b, int w) { return 1 << 12 | a | b << 4 | w << 8; }
constexpr float FX_SCALE = 4294967296.f, FX_INV = 1.f / 4294967296.f;
__device__ __forceinline__ unsigned long long fx_of(float v) { return (unsigned long long)__float2ll_rn(v * FX_SCALE); }
__device__ __forceinline__ float fx_val(long long x) { return __ll2float_rn(x) * FX_INV; }
// two residual words, re-read from L2 on every poll
__device__ __forceinline__ longlong2 ld_fx2(const longlong2* a) {
  long long x, y;
  asm volatile("ld.relaxed.gpu.global.v2.s64 {%0, %1}, [%2];" : "=l"(x), "=l"(y) : "l"(a) : "memory");
  return make_longlong2(x, y);
}
// a word holds the expected count e56 = E << 56 when its value w - e56 is within 2^55 of 0 (a missing add leaves it
// 2^56 away)
__device__ __forceinline__ bool fx_counted(long long w, unsigned long long e56) {
  return ((unsigned long long)w - e56 + (1ull << 55)) < (1ull << 56);
}
__device__ __forceinline__ void fx_red(unsigned long long* a, float v) {
  asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" ::"l"(a), "l"(fx_of(v) + FX_CNT) : "memory");
}
// token m's fixed-point row at fx_base(p) + m * fx_stride(p) (the padded rows of the down tiles), after the partial
// sums in p.dpart (not over them: the slices f >= nffn there must stay 0 for the other M's reduction)
__device__ __forceinline__ unsigned long long* fx_base(const Params& p) {
  return reinterpret_cast<unsigned long long*>(p.dpart + (size_t)MAX_M * p.mat[MAT_DS].ntiles * p.nffn_pad * TILE_ROWS);
}
__device__ __forceinline__ int fx_stride(const Params& p) { return p.mat[MAT_DS].ntiles * TILE_ROWS; }
__device__ __forceinline__ unsigned long long* fx_buf(const Params& p, int b) {
  return fx_base(p) + (size_t)b * fx_stride(p);
}

// ---- tagged words
// one 8-byte store (single-copy atomic) carries a value and the tag that says which layer of which launch wrote it
// (tag = epoch * L + layer + 1: it grows by one per layer and never repeats within 2^32 layers)
__device__ __forceinline__ void st_tagged(uint32_t* w, float v, uint32_t tag) {
  asm volatile("st.relaxed.gpu.global.v2.u32 [%0], {%1, %2};" ::"l"(w), "r"(__float_as_uint(v)), "r"(tag) : "memory");
}
// the word of row `row` of token m's q | k | v vector (rows as the qkv matrix orders them: q, k, v; head-major)
__device__ __forceinline__ uint32_t* qkv_word(const Params& p, int m, int row) {
  return p.qkvt + 2 * ((size_t)m * (p.nh + 2 * p.nkv) * p.D + row);
}
// 8 consecutive (value, tag) words, all loads in flight at once, re-polled until every tag is this one
__device__ __forceinline__ void ld_tagged8(const uint32_t* w, uint32_t tag, float4& a, float4& b) {
  uint4 u[4];
  bool ok;
  do {
#pragma unroll
    for (int e = 0; e < 4; ++e)
      asm volatile("ld.relaxed.gpu.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(u[e].x), "=r"(u[e].y), "=r"(u[e].z), "=r"(u[e].w) : "l"(w + 4 * e) : "memory");
    ok = true;
#pragma unroll
    for (int e = 0; e < 4; ++e) ok = ok && u[e].y == tag && u[e].w == tag;
  } while (!ok);
  a = make_float4(__uint_as_float(u[0].x), __uint_as_float(u[0].z), __uint_as_float(u[1].x), __uint_as_float(u[1].z));
  b = make_float4(__uint_as_float(u[2].x), __uint_as_float(u[2].z), __uint_as_float(u[3].x), __uint_as_float(u[3].z));
}
__device__ __forceinline__ float ld_tagged(const uint32_t* w, uint32_t tag) {  // spins until the tag is this one
  uint32_t v, tg;
  do {
    asm volatile("ld.relaxed.gpu.global.v2.u32 {%0, %1}, [%2];" : "=r"(v), "=r"(tg) : "l"(w) : "memory");
  } while (tg != tag);
  return __uint_as_float(v);
}
// 32-bit tagged words (the fp32 value truncated to its top 24 bits: 16 significant bits, relative error < 2^-15;
// then an 8-bit tag, tw24_tag: layer + 1. Enough because every launch rewrites the rows it uses at every layer: a
// stale word is either this launch's previous layer (tag = layer) or, at layer 0, the last layer of the launch that
// last wrote it (tag = L, and that launch ended before this one began); so L <= 254, which the launch checks),
// after the q|k|v words of MAX_M tokens: the attention output [MAX_M][nh D], then x + o [MAX_M][H] (word offsets
// into p.qkvt). The stagings that read them convert to fp16 hi + lo (22 bits) or int8 terms (~15 bits).
__device__ __forceinline__ size_t tw24_attn(const Params& p, int m, int i) {
  return (size_t)2 * MAX_M * (2 * p.nh + 2 * p.nkv) * p.D + (size_t)m * p.nh * p.D + i;
}
__device__ __forceinline__ size_t tw24_resid(const Params& p, int m, int n) {
  return (size_t)2 * MAX_M * (2 * p.nh + 2 * p.nkv) * p.D + (size_t)MAX_M * p.nh * p.D + (size_t)m * p.H + n;
}
__device__ __forceinline__ uint32_t tw24_tag(int layer) { return (uint32_t)layer + 1u; }
__device__ __forceinline__ uint32_t tw24_word(float v, uint32_t tag) {  // (the value's top 3 bytes, the tag's low byte)
  return __byte_perm(__float_as_uint(v), tag, 0x3214);
}
__device__ __forceinline__ void st_tw24(uint32_t* w, float v, uint32_t tag) {
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(w), "r"(tw24_word(v, tag)) : "memory");
}
// 8 consecutive words (two 16-byte loads in flight), re-polled until every tag is this one's low 8 bits
__device__ __forceinline__ void ld_tw24x8(const uint32_t* w, uint32_t tag, float4& a, float4& b) {
  uint4 u[2];
  const uint32_t t8 = tag & 0xffu;
  for (uint32_t spins = 0;; ++spins) {
#pragma unroll
    for (int e = 0; e < 2; ++e)
      asm volatile("ld.relaxed.gpu.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(u[e].x), "=r"(u[e].y), "=r"(u[e].z), "=r"(u[e].w) : "l"(w + 4 * e) : "memory");
    // the 8 tag bytes as two words, against the tag byte repeated
    const uint32_t g0 = __byte_perm(__byte_perm(u[0].x, u[0].y, 0x0040), __byte_perm(u[0].z, u[0].w, 0x0040), 0x5410);
    const uint32_t g1 = __byte_perm(__byte_perm(u[1].x, u[1].y, 0x0040), __byte_perm(u[1].z, u[1].w, 0x0040), 0x5410);
    if (g0 == t8 * 0x01010101u && g1 == t8 * 0x01010101u) break;
    if (spins == (1u << 24)) __trap();  // (a tag that never comes is a bug: the launch fails instead of hanging)
  }
  auto h = [](uint32_t x) { return __uint_as_float(__byte_perm(x, 0u, 0x3214)); };  // (the tag byte cleared)
  a = make_float4(h(u[0].x), h(u[0].y), h(u[0].z), h(u[0].w));
  b = make_float4(h(u[1].x), h(u[1].y), h(u[1].z), h(u[1].w));
}
// attention output element i (head-major) of token m: the fp32 row, and in the objects with the tagged hops its
// 24-bit tagged word (the o staging polls those instead of waiting at a fenced barrier)
__device__ __forceinline__ void attn_out(const Params& p, int m, int i, float v, int layer) {
  p.attn[(size_t)m * p.nh * p.D + i] = v;
  if constexpr (kFxObj) st_tw24(p.qkvt + tw24_attn(p, m, i), v, tw24_tag(layer));
}

}  // namespace
}  // namespace mk
