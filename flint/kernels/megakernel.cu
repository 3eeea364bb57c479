// flint decode megakernel: one persistent cooperative launch runs a whole int4 decode step for M tokens at once
// (embedding -> L x [rmsnorm, q|k|v + RoPE + KV append, attention, o, rmsnorm, gate|up + silu * up, down]
// -> final norm -> lm_head -> argmax). Compiled once per M (FLINT_MK_M = 1..8) into one library by
// flint/kernels/build.py; the host side (megakernel_host.cu) picks the object by M.
//
// Per block (one per SM, 16 warps): warp 15 is the PRODUCER, one lane streaming the block's tiles of every weight
// matrix of the step into a ring of shared-memory slots (mk_producer.cuh); warps 0..14 are CONSUMERS: they stage each
// stage's input vector (mk_stage.cuh), compute K parts of tiles on the tensor cores (mk_mma.cuh), reduce and run the
// epilogues (mk_matvec.cuh), attention (mk_attention.cuh) and the FFN split-K (mk_ffn.cuh), and meet where a stage
// needs every block's output (mk_sync.cuh: grid barriers, tagged words, counted fixed-point words).
// docs/megakernel.md is the design document: read it first.
//
// Build: python -m flint.kernels.build      Test: pytest tests/test_megakernel.py
#include "mk_config.cuh"
#include "mk_common.cuh"
#include "mk_ptx.cuh"
#include "mk_mma.cuh"
#include "mk_trace.cuh"
#include "mk_sync.cuh"
#include "mk_producer.cuh"
#include "mk_stage.cuh"
#include "mk_matvec.cuh"
#include "mk_ffn.cuh"
#include "mk_attention.cuh"

#define MK_CAT2(a, b) a##b
#define MK_CAT(a, b) MK_CAT2(a, b)

namespace mk {
namespace {

template <int M>
__global__ void __launch_bounds__(NT, 1)
    decode_kernel(const __grid_constant__ Params p, const __grid_constant__ Smem sl, int start,
                  const long long* tokens, int tok0) {
  // a verify whose start position is on the device (flint_mk_forward_dev, tok0 < 0): tokens[M], where the draft
  // rollout that wrote this step's tokens put it; clamped into the cache (the host checked the largest it can be)
  if constexpr (M >= 2) {
    if (tok0 < 0) start = max(0, min((int)tokens[M], p.max_seq - M));
  }
  uint8_t* smem = mk_smem;
  Ring ring;
  ring.slots = smem + sl.ring;
  ring.full = reinterpret_cast<uint64_t*>(smem + sl.bars);
  ring.empty = ring.full + MAX_SLOTS;
  ring.parts = ring.empty + MAX_SLOTS;
  ring.nslots = sl.nslots;
  ring.slot_bytes = sl.slot;
  MiscSmem* misc = reinterpret_cast<MiscSmem*>(smem + sl.misc);
  if (threadIdx.x == 0) {
    for (int i = 0; i < ring.nslots; ++i) {
      mbar_init(&ring.full[i], 1);
      mbar_init(&ring.empty[i], NCT);
      mbar_init(&ring.parts[i], NCT);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if (threadIdx.x < MAX_ACC_TILES) misc->seg_count[threadIdx.x] = 0;
  if (threadIdx.x < 2) misc->fxc[threadIdx.x] = 0u;
  if (threadIdx.x == 0) {  // (the host's layout: Smem::own's rows, 128-byte aligned, then these)
    const int own_tiles = (p.mat[MAT_O].ntiles + p.nblocks - 1) / p.nblocks;
    misc->ownfx = sl.own + ((own_tiles * TILE_ROWS * M * 4 + 127) & ~127);
  }
  if (threadIdx.x < NMAT * 16) {  // the K-group bounds of the S parts of each matrix, once
    const int m = threadIdx.x >> 4, pt = threadIdx.x & 15, S = sl.nparts[m];
    const int ng = p.mat[m].kseg >> p.mat[m].gshift;
    misc->gbound[m][pt] = (uint8_t)(pt <= S ? ng * pt / S : ng);
  }
  if (threadIdx.x < NMAT) {  // this block's tiles of every matrix, once (a division per call otherwise)
    const int mi = threadIdx.x;
    int t0, t1;
    if (p.nffn && (mi == MAT_GU || mi == MAT_DS)) {  // FFN split-K: FFN block f owns gate|up tiles [f T, (f + 1) T)
      const int T = p.mat[MAT_GU].ntiles / p.nffn;   // (exact: the host checks) and every row tile of slice f
      const bool on = (int)blockIdx.x < p.nffn;
      t0 = on && mi == MAT_GU ? (int)blockIdx.x * T : 0;
      t1 = !on ? 0 : mi == MAT_GU ? t0 + T : p.mat[MAT_DS].ntiles;
    } else {
      block_tiles(p.mat[mi].ntiles, p.nblocks, blockIdx.x, t0, t1);
    }
    misc->tile0[threadIdx.x] = t0;
    misc->tile1[threadIdx.x] = t1;
  }
  for (int i = threadIdx.x; i < (sl.uni - sl.xsum) / 4; i += blockDim.x) reinterpret_cast<float*>(smem + sl.xsum)[i] = 0.f;
  for (int i = threadIdx.x; i < NCW * M; i += blockDim.x) {
    misc->best_val[i / M][i % M] = -INFINITY;
    misc->best_idx[i / M][i % M] = 0x7fffffff;
  }
  __syncthreads();
  if (threadIdx.x >= NCT) {  // producer warp
    if (threadIdx.x == NCT) producer(p, sl, ring, misc, kFx<M>);
    return;
  }
  Ctx<M> c;
  c.p = &p;
  c.sl = &sl;
  c.ring = ring;
  c.slot = 0;
  c.phase = 0;
  c.misc = misc;
  c.acc = reinterpret_cast<float*>(smem + sl.acc);
  c.own = reinterpret_cast<float*>(smem + sl.own);
  c.rope = reinterpret_cast<float*>(smem + sl.rope);
  c.actb = reinterpret_cast<float*>(smem + sl.actb);
  c.parts = reinterpret_cast<float*>(smem + sl.parts);
  c.xs = smem_u32(smem + sl.uni);
  c.xsum = smem_u32(smem + sl.xsum);
  c.start = start;
  c.fx = 0;
  const unsigned long long epoch = __ldcg(p.epoch);
  c.tag0 = (uint32_t)(epoch * (unsigned long long)p.L) + 1u;
  // Grid barriers: the counter's target counts from the base the previous launch left in p.epoch[1] (barriers per
  // launch depend on M); the base lives in shared memory, read by the one thread that waits (no 64-bit value held in
  // registers across the kernel). fence_free (the objects with the counted residual): a relaxed counter, where the
  // data behind it are tagged words that carry their own proof.
  unsigned long long nbar = 0;
  if (threadIdx.x == 0) misc->bar0 = __ldcg(p.epoch + 1);
  auto gsync = [&](bool fence_free) {
    ++nbar;
    const unsigned long long tg = threadIdx.x == 0 ? misc->bar0 + (unsigned long long)p.nblocks * nbar : 0ull;
    if (kFxObj && fence_free) grid_barrier<true>(p, tg); else grid_barrier(p, tg);
  };

  enum { ROW_TOK = 0, ROW_RESID, ROW_ATTN, ROW_ACT };
  if (threadIdx.x < M) {
    const int m = threadIdx.x;
    const long long tk = tokens ? tokens[m] : (long long)tok0;
    misc->rows[ROW_TOK][m] = p.embed + (size_t)tk * p.H;
    misc->rows[ROW_RESID][m] = p.resid + (size_t)m * p.H;
    misc->rows[ROW_ATTN][m] = p.attn + (size_t)m * p.nh * p.D;
    misc->rows[ROW_ACT][m] = p.act + (size_t)m * p.I;
    misc->rows[ROW_ACTB][m] = reinterpret_cast<const float*>(smem + sl.actb) + (size_t)m * p.mat[MAT_DS].K;
  }
  cbar();
  const float* const* tok_src = misc->rows[ROW_TOK];
  const float* const* resid_rows = misc->rows[ROW_RESID];
  const float* const* attn_rows = misc->rows[ROW_ATTN];
  const float* const* act_rows = misc->rows[ROW_ACT];
  // this step's RoPE rows, once
  {
    const int half = p.D >> 1;
    for (int i = threadIdx.x; i < M * half; i += NCT) {
      const int m = i / half, ip = i - m * half;
      c.rope[i] = p.use_rope ? __ldg(p.rope_cos + (size_t)(start + m) * half + ip) : 1.f;
      c.rope[M * half + i] = p.use_rope ? __ldg(p.rope_sin + (size_t)(start + m) * half + ip) : 0.f;
    }
  }
  // residual = embed * multiplier, for the rows this block owns in the o/down stages (kept in smem too)
  {
    int t0, t1;
    block_tiles(p.mat[MAT_O].ntiles, p.nblocks, blockIdx.x, t0, t1);
    const int n0 = t0 * TILE_ROWS, n1 = min(t1 * TILE_ROWS, p.H);
    for (int i = threadIdx.x; i < M * (n1 - n0); i += NCT) {
      const int m = i / (n1 - n0), n = n0 + i % (n1 - n0);
      const float v = __ldg(tok_src[m] + n) * p.emb_mult;
      c.own[(n - n0) * M + m] = v;
      p.resid[(size_t)m * p.H + n] = v;
    }
  }
  uint8_t* uni = smem + sl.uni;
  auto stamp = [&](int l, int k) { trace_stamp(p, l, k); };
  if (MK_TRACE && p.trace != nullptr && threadIdx.x == 0) {  // (traced builds: the block's SM, in its unused 16th slot)
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    p.trace[(size_t)2 * p.L * 32 + blockIdx.x * 16 + 15] = smid;
  }
  for (int l = 0; l < p.L; ++l) {
    stamp(l, 0);
    const float* const* xsrc = l == 0 ? tok_src : resid_rows;
    const float mult = l == 0 ? p.emb_mult : 1.f;
    const float* an = p.norms + (size_t)l * 2 * p.H;
    stamp(l, 1);
    // with the split: the q|k|v staging reads the counted fixed-point residual (layer 0: the embedding)
    if (kFx<M> && p.nffn && l > 0) c.fx = fx_code(FXB_X, FXB_NONE, FXB_NONE);
    matvec_stage<M, kI8<M>(MAT_QKV)>(c, MAT_QKV, l, xsrc, mult, an);
    c.fx = 0;
    stamp(l, 2);
    // (no barrier: attention polls this step's q, k, v rows as tagged words)
    stamp(l, 3);
    attention_stage<M>(c, l, uni);
    stamp(l, 4);
    gsync(p.nffn);  // (with the split: fence-free, the o staging polls the attention output's tagged words)
    stamp(l, 5);
    matvec_stage<M, kI8<M>(MAT_O)>(c, MAT_O, l, attn_rows, 1.f, nullptr);
    if (kFx<M> && p.nffn && l > 0 && threadIdx.x == 0) ++misc->fxc[0];  // the owners' adds (read after a block barrier)
    stamp(l, 6);
    gsync(l > 0 && p.nffn);  // (fence-free from layer 1 on, the gate|up staging polls x + o's tagged words;
                             //  layer 0's X is stored, not added, behind the fenced barrier)
    stamp(l, 7);
    matvec_stage<M, kI8<M>(MAT_GU)>(c, MAT_GU, l, resid_rows, 1.f, an + p.H);
    stamp(l, 8);
    if (p.nffn) {  // FFN split-K: down's partials from this block's own act slice, then a reduction
      ffn_down_partial<M>(c, l);
      if (kFx<M> && threadIdx.x == 0) misc->fxc[0] += (uint32_t)p.nffn;  // (every FFN block adds once per row)
      stamp(l, 9);
      // the counted residual: no grid barrier: the next staging's count polls are the proof (a word shows the
      // expected count exactly when every add of the layer has landed; the next adds into X, the o owners' of the
      // next layer, need every block's next q|k|v epilogue through attention, so no word runs past its count before
      // every block read it)
      if (!kFx<M>) gsync(true);
      else cbar();
      stamp(l, 10);

      if (kFx<M>) {  // the partials were added into the fixed-point residual: the next stage reads it
        stamp(l, 11);
        continue;
      }
      ffn_down_reduce<M>(c, uni);
    } else {
      stamp(l, 9);
      gsync(false);
      stamp(l, 10);
      matvec_stage<M, kI8<M>(MAT_D)>(c, MAT_D, l, act_rows, 1.f, nullptr);
    }
    stamp(l, 11);
    gsync(false);
  }
  stamp(p.L - 1, 12);
  if (kFx<M> && p.nffn) c.fx = fx_code(FXB_X, FXB_NONE, FXB_NONE);
  matvec_stage<M, kI8<M>(MAT_LM)>(c, MAT_LM, 0, resid_rows, 1.f, p.final_norm);
  stamp(p.L - 1, 13);
  // argmax: warps' partials -> block partial (warp order) -> the last block reduces blocks in order
  if (threadIdx.x < M) {
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    for (int w = 0; w < NCW; ++w) {
      const float v = c.misc->best_val[w][threadIdx.x];
      const int ix = c.misc->best_idx[w][threadIdx.x];
      if (v > bv || (v == bv && ix < bi)) { bv = v; bi = ix; }
    }
    p.arg_val[blockIdx.x * M + threadIdx.x] = bv;
    p.arg_idx[blockIdx.x * M + threadIdx.x] = bi;
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
    if (p.argmax_out != nullptr) p.argmax_out[threadIdx.x] = bi;
  }
  if (c.misc->flag && threadIdx.x == 0) {
    *p.done_count = 0;
    *p.epoch = __ldcg(p.epoch) + 1;  // every block read the epoch before its first barrier
    p.epoch[1] = misc->bar0 + (unsigned long long)p.nblocks * nbar;  // (every block has passed all nbar barriers)
  }
}

}  // namespace
}  // namespace mk

// ---- launch entry points: flint_mk_launch_m<M> (and _gu8). The host dispatcher (megakernel_host.cu) picks by M and
// raises for anything else; there is no fall-through to another M.
#if FLINT_MK_GU8 && FLINT_MK_LONG && FLINT_MK_KV8
#define MK_SYM(base) MK_CAT(MK_CAT(base, FLINT_MK_M), _gu8_long_kv8)
#elif FLINT_MK_GU8 && FLINT_MK_LONG
#define MK_SYM(base) MK_CAT(MK_CAT(base, FLINT_MK_M), _gu8_long)
#elif FLINT_MK_GU8 && FLINT_MK_KV8
#define MK_SYM(base) MK_CAT(MK_CAT(base, FLINT_MK_M), _gu8_kv8)
#elif FLINT_MK_GU8
#define MK_SYM(base) MK_CAT(MK_CAT(base, FLINT_MK_M), _gu8)
#elif FLINT_MK_LONG && FLINT_MK_KV8
#define MK_SYM(base) MK_CAT(MK_CAT(base, FLINT_MK_M), _long_kv8)
#elif FLINT_MK_LONG
#define MK_SYM(base) MK_CAT(MK_CAT(base, FLINT_MK_M), _long)
#elif FLINT_MK_KV8
#define MK_SYM(base) MK_CAT(MK_CAT(base, FLINT_MK_M), _kv8)
#else
#define MK_SYM(base) MK_CAT(base, FLINT_MK_M)
#endif
extern "C" int MK_SYM(flint_mk_launch_m)(const mk::Params* p, const mk::Smem* sl, int start,
                                                       const long long* tokens, int tok0, cudaStream_t stream,
                                                       int set_attr) {
  auto kern = mk::decode_kernel<FLINT_MK_M>;
  cudaError_t e;
  // the counted residual: its stagings read whole rows in one round (8 codes a word, M words per thread); the 8-bit
  // tags of the tagged hops count layers (mk_sync.cuh, tw24_tag). flint/megakernel.py turns the split off first.
  if (mk::kFxObj && p->nffn && (p->H > 8 * mk::NCT || p->L > 254)) return (int)cudaErrorNotSupported;
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

extern "C" int MK_SYM(flint_mk_occupancy_m)(int smem_bytes, int* blocks_per_sm) {
  auto kern = mk::decode_kernel<FLINT_MK_M>;
  cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (e != cudaSuccess) return (int)e;
  return (int)cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks_per_sm, kern, mk::NT, smem_bytes);
}
