// flint decode megakernel: one persistent cooperative launch runs a whole int4 decode step
// (embedding -> L x [rmsnorm, qkv+rope+kv-append, attention, o-proj, rmsnorm, gate/up+silu, down]
// -> final norm -> lm_head -> argmax) for M tokens at once (M = FLINT_MK_M, 1..8; one object per M).
//
// Per block (one per SM): warp 15 is the PRODUCER: one lane streams this block's tiles (16 row-
// segments) of every weight matrix of the whole step, in a fixed order, into a ring of shared-memory
// slots with cp.async.bulk (TMA 1-D) completing on mbarriers. Weights do not depend on activations,
// so it runs ahead across grid barriers; only ring space stops it. Warps 0..14 are CONSUMERS: they
// stage the stage's input vector into smem as two fp16 terms (recomputing RMSNorm per block),
// compute K parts of tiles on the tensor cores (mk_mma.cuh), the last warp of a tile reduces the
// parts and runs its epilogue (RoPE + KV append / residual add / silu*up / logits + argmax), and
// meet at grid barriers (a monotonic counter; the producer never waits on them).
//
// Sections: [1] PTX helpers  [2] grid barrier  [3] producer  [4] x staging
//           [5] matvec stage + epilogues  [6] (tile dot: mk_mma.cuh)  [7] attention  [8] kernel
//           [9] launch entry point
// Build: python -m flint.kernels.build      Test: pytest tests/test_megakernel.py
// Measured and removed in session 5 (reproducible from 0117668 with bench/mk_variants.py): MK_SKIP2
// (warps skip units without a part, made safe by per-slot counters: +1.2%) and MK_RSTD_TREE (rstd
// by a fixed tree in every staging thread: noise).
// Measured and removed in session 17 (flint/kernels/dev/experiments/17_skip_order_poll2_rstd.patch restores them,
// off): MK_PASS_SKIP (+3.2%: a proof-based form of session 5's MK_SKIP2), MK_WARP_ORDER (+0.75%), MK_POLL2 (+2 to
// +4%), MK_RSTD_REG (+0.9%: session 5's MK_RSTD_TREE in another form).
// Measured and removed in session 18 (flint/kernels/dev/experiments/18_att_mma_noinline_prod_compact.patch restores
// them, off): MK_ATT_MMA (attention's split on the tensor cores: 0.9985 in MK_ATT_W3's place, +2.4 to +3.2% beside it),
// MK_ATT_NOINLINE (+13%, spills), MK_PROD_COMPACT (the producer's loops rolled: 0.9992). Session 18's lesson: this
// kernel's compile moves the step by up to 5% when unexecuted code is added (MK_ATT_MMA = 2); a sub-3% A/B of a kernel
// change measures the change AND a re-roll of ptxas's allocation and schedule for the whole kernel.
// Kept off in the source: MK_TM_INIT (~20 registers freed at every grid barrier: +2.8%), MK_NCW, MK_DIAG_ICBLOB.
// Session 19 (v21, v22): on, MK_DOT_PERM (conflict-free code loads), MK_IDOT_RAW (gate|up's raw-byte integer dot),
// MK_INFLIGHT = 1 with MK_LM_INFLIGHT = 2. Measured and removed (flint/kernels/dev/experiments/
// 19_dot_xq_ds_perm_i8_xlo.patch restores them, off; 19_dot_xq_hoisted.patch applies after it): MK_DOT_XQ (x loaded
// only by the lanes of live B columns, a predicated LDS: +2.0%, hoisted +2.5%), MK_DS_PERM (the down slices' rows
// permuted for their code loads' banks: no gain), MK_I8_XLO (the integer staging's lo row off the hi row's banks: no
// gain). Not built: the raw integer dot in the down slices (19_ds_raw.patch: the M = 1 objects spill 36 bytes).
// Session 20 (v23): on, MK_NOFENCE bit 32 (no barrier after the down partials at M = 1: -3.2%). Measured and removed
// (flint/kernels/dev/experiments/20_rstd_defer_inflight_caps.patch, 20_dot_xp.patch, 20_dot_ch.patch; each applies on
// its own): MK_RSTD_DEFER (the rstd in the epilogues: no gain), MK_GU_INFLIGHT = 2 (+3.1%), MK_QKV_INFLIGHT = 2 (no
// gain), MK_DOT_XP (the x loads predicated with zeroed registers: +1.7 to +2.4%), MK_DOT_CH (shorter mma chains: fp16
// +1.6%, the raw dot's no gain).
// Measured and removed in session 6 (reproducible from 80bb088 with bench/mk_variants.py; numbers in
// bench/results/mk_ab_session6_2026-11-29.log): MK_DS_PREFETCH (down slices into L2 during attention:
// +5.5%), MK_PACKED_NOZERO (4 FADD less per group: +1.7%, noise), MK_ATT_PRE (attention's old K/V rows in
// flight before the qkv barrier: +2.1%, noise), MK_FAST_MERGE (the split merge's loads in one round trip,
// one acq_rel atomic: noise); MK_POLL_RELAXED (5h: -1.2%, noise) from 181cb55.
// Measured and removed in session 7 (bench/results/mk_ab_session7_2026-11-29.log): MK_BAR_GROUPS (the grid barrier on
// 12 counters: noise; from 672f796), MK_RTAG (no o -> gate|up barrier: +2.3%, and its per-M barrier count deadlocked
// mixed-M tests; from f8a9637), MK_TM_ML (the merge's (m, l) in the o poll: +0.8%; experiments/7f_tm_ml.patch).
// MK_IDOT (EXPERIMENT, off; session 6: correct on the GPU, real SmolLM2 greedy identical, but +1.9% at M = 1,
// +3.3% at M = 2: the dots are not bound by instruction issue): kernels with M <= 4 stage x as two int8
// terms per token and group and run the integer tile dot (mkmma::imma_tile_dot, mma.m16n8k32.s8): about
// 40% fewer dot instructions; numerics (flint/kernels/dev/int8_x_study.py), lane mapping
// (flint/kernels/dev/imma_dot_emulation.py).
#ifndef MK_IDOT
#define MK_IDOT 0
#endif
// MK_BAR_SMEM (on since v14, session 13): the grid barrier's base count (MK_FXRES) kept in shared memory for the one
// thread that waits, instead of a 64-bit register pair held across the kernel (MK_IDOT's M = 1 kernel spilled it).
// bench/mk_ab1.py, M = 1: -0.7 to -0.8% in two calls (25/30 and 28/30 rounds faster); M = 2 unchanged.
#ifndef MK_BAR_SMEM
#define MK_BAR_SMEM 1
#endif
// MK_IDOT_MASK (session 14): the integer dot and its int8 staging per matrix, bit mi (MAT_* order: 1 q|k|v, 2 o,
// 4 gate|up, 16 lm_head, 32 the down slices; MAT_D's stage follows bit 8); MK_IDOT = 1 means every matrix. Session
// 14's A/Bs (bench/results/mk_ab1_session14_2026-11-30.md, a and b): skipping gate|up's dot saves 113 us per step
// from the fp16 kernel but 38 us from the all-integer one, and yet the all-integer kernel is no faster; per matrix,
// gate|up alone is -0.7 to -1.5% at M = 1 (+0.4% at M = 2), the down slices +2.2%, lm_head +0.3%. The default
// kernels use it through FLINT_MK_GU8 only (below).
#ifndef MK_IDOT_MASK
#define MK_IDOT_MASK 0
#endif
// FLINT_MK_GU8 (set by flint/kernels/build.py for one more M = 1 object, flint_mk_launch_m1_gu8; v15, session 14):
// gate|up with the integer dot. The host launches it at M = 1 for models quantized in groups of 128: -1.5% per step
// on Granite-4.1-3B G128, but +1.3% on SmolLM2's groups of 32, where the integer dot's per-group epilogue is spread
// over 32 codes only (bench/results/mk_ab1_session14_2026-11-30.md). One kernel with both gate|up paths and a run-time
// choice spills at M = 1.
#ifndef FLINT_MK_GU8
#define FLINT_MK_GU8 0
#endif
// MK_IDOT_MAXM: the token counts that use MK_IDOT_MASK (at most 4: the integer dot packs hi and lo as B columns)
#ifndef MK_IDOT_MAXM
#define MK_IDOT_MAXM 1
#endif
static_assert(MK_IDOT_MAXM >= 1 && MK_IDOT_MAXM <= 4, "MK_IDOT_MAXM: 1..4");
constexpr int kIdotMask = MK_IDOT ? 0x3F : (MK_IDOT_MASK | (FLINT_MK_GU8 ? 4 : 0));
template <int M>
constexpr bool kIdot = kIdotMask != 0 && M <= MK_IDOT_MAXM;  // some stage of this kernel stages int8 x, integer dot
template <int M>
__host__ __device__ constexpr bool kI8(int mi) { return ((kIdotMask >> mi) & 1) && M <= MK_IDOT_MAXM; }
// a mixed mask: the fp16 staging also clears the lo columns' entries of xsum that an integer staging wrote
constexpr bool kIdotMixed = kIdotMask != 0 && kIdotMask != 0x3F;
// MK_DIAG (DIAGNOSTIC ONLY, wrong answers, off): what a part of the attention stage costs, by removing it
// (session 6, bench/results/mk_ab_session6_2026-11-29.log). 1: no merge of the context splits (each split
// writes its partial and leaves: no counter, no merge); 2: the attention stage skipped; 3: attention's
// loads and merge kept, its arithmetic skipped (session 18: MK_ATT_W3's too); 4: no grid barrier between qkv and
// attention.
#ifndef MK_DIAG
#define MK_DIAG 0
#endif
// MK_DS_EPI (on since v16, session 14: -1.2% against v15 with MK_DOT_M1 off, 28/40 rounds; with MK_DOT_M1, v16, -0.3%;
// session 13: with MK_DOT_M1 -0.4 to -0.6%, but the changed rounding flipped a near tie of the real-SmolLM2 greedy test
// at token 127 of one prompt, docs 13e; v16 passes it, and the test now knows ties): the down-slice tiles' epilogue
// at M = 1 with MK_FXRES in fewer instructions
// (session 12's MK_DIAG2 = 2: the down-slice dot and its adds cost up to 3.3 us per layer, about twice the mainline
// dot's cost per code, and half of a tile's ~66 instructions are its epilogue): the hi and lo columns summed before
// the (scale, min) (the lo mma's zero accumulators were added too), the min term's two columns summed once per call,
// the residual multiplier folded with 2^32 (a power of two: the same bits), one 64-bit address per tile (the row
// g + 8 word at +64 bytes).
#ifndef MK_DS_EPI
#define MK_DS_EPI 1
#endif
// MK_DIAG2 (DIAGNOSTIC ONLY, wrong answers, off; session 12), a bit mask: what a part of the FFN costs at M = 1 with
// MK_FXRES, by removing it. 1: the down partials written with a plain 64-bit store instead of red.add (the L2's atomic
// work); 2: the down-slice dot and its adds skipped (the ring waits and arrivals kept); 4: no grid barrier between
// o and gate|up (bar3); 8: the down-slice dot computed, its adds dropped; 16: the adds of zeros, the dot dropped;
// 64 << mi: matrix mi's tile dot skipped in matvec_stage (its sums 0; 64: q|k|v, 128: o, 256: gate|up, 1024: lm_head);
// 4096 (session 15, not yet run): each FFN block's down adds aimed at its own private rows (20 KB per block in p.dpart,
// which M = 1 does not use otherwise) instead of the shared residual: with 16, whether the adds-only phase is the L2's
// same-line serialization across blocks (then it shortens) or the SM's own write path (docs/megakernel.md, 15k).
#ifndef MK_DIAG2
#define MK_DIAG2 0
#endif
// MK_BAR_RELAXED (session 16, a DIAGNOSTIC: wrong by the memory model, never a default): the grid barriers named by the
// bits (1: bar2 attention -> o, 2: bar3 o -> gate|up, 4: bar4 down -> next q|k|v) arrive with a relaxed reduction and
// poll with relaxed loads, i.e. WITHOUT the release fence (MEMBAR.ALL.GPU). hop_bench --sync (session 16) measured that
// fence at 0.42 us with no copies in flight and 1.25 us with 2 x 16 KB in flight per SM (it waits for the producer's
// bulk copies): this prices what fence-free hops could give the step, before one is designed.
#ifndef MK_BAR_RELAXED
#define MK_BAR_RELAXED 0
#endif
// MK_DS_ROT (session 16, a DIAGNOSTIC of the down phase's imbalance; 1 = the default): 0 starts every FFN block's
// down chunks at chunk 0 (no rotation by block), in the producer and the consumers alike (same arithmetic, other order)
#ifndef MK_DS_ROT
#define MK_DS_ROT 1
#endif
// MK_QTAG (on since session 7; session 6: -3.1% per step at M = 1; validated in full: bench/results/v8_2026-11-29.md,
// v9_2026-11-29.md): no grid barrier between qkv and attention. The qkv
// epilogues also write this step's q, k and v rows as (fp32 bits, tag) pairs (p.qkvt, one 8-byte store
// each, tag = epoch * L + layer + 1), and attention polls exactly the words it needs: its q rows and the
// K/V rows of this step's positions (older positions come from the cache, written by earlier launches).
#ifndef MK_QTAG
#define MK_QTAG 1
#endif
// MK_TMERGE = the largest M it runs for (0: off): attention's context splits hand their partials to the
// merge as tagged words (p.part as (fp32 bits, tag) pairs, the layer's MK_QTAG tag) and the block of split 0
// merges them as they arrive: no counter atomic, no fences, no "last block" round trip (at most
// TM_MAX_SPLITS splits; else the counter path). Session 7 (same-call A/B, ctx 512): M = 1 -3.7%, M = 2
// +3.6%, so on for M = 1 only (bench/results/mk_ab_session7_2026-11-29.log).
#ifndef MK_TMERGE
#define MK_TMERGE 1
#endif
static_assert(MK_TMERGE <= 2, "MK_TMERGE: the merge's registers hold M <= 2");
// MK_ATT_ROT (DIAGNOSTIC, session 17; 0 = off): attention item i runs on block (i + MK_ATT_ROT) mod grid instead of
// block i, to tell effects of running attention from effects of the block's id (the down phase's slow first chunk)
#ifndef MK_ATT_ROT
#define MK_ATT_ROT 0
#endif
// MK_W3_PV4 (EXPERIMENT, session 17, off): MK_ATT_W3's P.V loop over the warp's keys unrolled by 4 (the same adds in
// the same order: the loads and shuffles of four keys in flight together instead of one key's round trip at a time)
#ifndef MK_W3_PV4
#define MK_W3_PV4 0
#endif
// MK_TM_INIT (EXPERIMENT, session 18; 0 = off): the 12-split register merge's ov[] and tg[] set to 0 before their
// predicated loads. nvdisasm's life ranges (bench/mk_live.py) show their ~22 registers live at every grid barrier of
// v20 (a register whose only writes are predicated is live into them, so across the layer loop's back edge)
#ifndef MK_TM_INIT
#define MK_TM_INIT 0
#endif
// MK_REG_USAGE_LEVEL (session 18; -1 = unset): read by flint/kernels/build.py, not by the compiler: ptxas's
// --register-usage-level for the M = 1 G128 object (m1gu8; 0..10, ptxas default 5)
#define MK_REG_USAGE_LEVEL -1
// MK_DIAG_ICBLOB (DIAGNOSTIC, session 18; 0 = off): blocks >= MK_DIAG_ICBLOB_FROM run MK_DIAG_ICBLOB distinct FFMA
// instructions (MK_DIAG_ICBLOB * 16 bytes of code, two chains) right after the attention stage, where
// the blocks without an attention item wait anyway. Test of session 17's hypothesis (17r): if the down phase's slow
// first chunk on the attention blocks is the instruction cache (attention's code evicting the down loop), this code
// makes the other blocks' first chunk slow too (traced: mk_blocks / mk_ring).
#ifndef MK_DIAG_ICBLOB
#define MK_DIAG_ICBLOB 0
#endif
#ifndef MK_DIAG_ICBLOB_FROM
#define MK_DIAG_ICBLOB_FROM 64
#endif
// MK_IDOT_RAW (on since v21, session 19: with MK_DOT_PERM -1.2 to -1.7% per step at M = 1 against v20, 29-30/30 rounds,
// -0.5 to -0.8% over MK_DOT_PERM alone; neutral without it, call 1): the integer gate|up dot at M = 1 on the code bytes
// as they are.
// A byte of codes read as u8 is q_even + 16 q_odd, and masked with 0xF0 it is 16 q_odd: mma.m16n8k32.u8.s8 on the raw
// words with x_even in B columns 0 / 1 (hi / lo terms), plus one on the masked words with -x_even in columns 0 / 1
// and x_odd in columns 2 / 3, leaves sum q_even x_even in columns 0 / 1 and 16 sum q_odd x_odd in 2 / 3, exactly
// (integers). One LOP3 per code word instead of LOP3 + SHF + LOP3 (the v20 loop: 24 of its 60 instructions per group
// of 128 codes are the nibble split). Layout: mk_mma.cuh, imma_raw_tile_dot.
#ifndef MK_IDOT_RAW
#define MK_IDOT_RAW 1
#endif
// MK_TM_MAX_SPLITS: the most context splits MK_TMERGE merges (registers: one o value and tag per split and
// thread; more than 12 spills at M = 1). 12 covers Granite to ctx 768; beyond, the counter merge runs. Session 8
// measured a two-phase merge that fits 16 (MK_TM2, from 0a332c7): no gain at ctx 2048 (+0.7%, inside that
// call's noise), so it was removed.
#ifndef MK_TM_MAX_SPLITS
#define MK_TM_MAX_SPLITS 12
#endif
constexpr int TM_MAX_SPLITS = MK_TM_MAX_SPLITS;
// MK_TM_SEQ (on since v17, session 15): at M <= MK_TMERGE with TM_MAX_SPLITS < splits <= TM_SEQ_SPLITS (Granite
// ctx 2048 and up: 16 splits), a tagged merge too: split 0's block reads the (m, l) pairs first, then each output
// thread polls the splits' o words 8 at a time and weighs them in split order (no register array over the splits).
// Replaces the counter merge there, which costs 4.1 us per layer at ctx 2048 (14k). Session 14: a first form, each
// split's word polled to its tag before the next (16 round trips in a row), lost: ctx 2048 +6.1%, ctx 8192 +4.0%.
// This form (8 words in flight, one re-poll per batch), session 15: ctx 2048 -1.9% (16/16 rounds), ctx 8192 -1.7%
// (10/10), bitwise the counter merge's logits, 26 GPU tests (bench/results/mk_ab1_session15_tmseq_*).
#ifndef MK_TM_SEQ
#define MK_TM_SEQ 1
#endif
constexpr int TM_SEQ_SPLITS = 32;
// MK_TM_CAP (EXPERIMENT, session 14, off): at M <= MK_TMERGE, at most TM_MAX_SPLITS context splits, so the tagged
// merge runs at every context (Granite ctx 2048: 11 splits of 3 tiles instead of 16 of 2 and the counter merge, which
// costs 166 us per step there: bench/results/mk_ab1_session14_2026-11-30.md, i). Measured (j): ctx 2048 -0.7% (15/15),
// ctx 8192 +9.8% (11 tiles per split instead of 8), ctx 512 unchanged; correct (26 GPU tests). The longer splits
// cost what the merge saves.
#ifndef MK_TM_CAP
#define MK_TM_CAP 0
#endif
static_assert(TM_MAX_SPLITS <= 12, "MK_TM_MAX_SPLITS > 12 spills the merge at M = 1");
static_assert(2 * TM_MAX_SPLITS <= 64, "MK_TM_MAX_SPLITS: the merge's (m, l) table lives in s_s (R x ATT_T floats)");
// MK_PV3 (on since session 8: -2.4% in session 7's A/B, validated in full as bench/results/v10_2026-11-29.md):
// attention's P.V on three warps per row (a third of the keys each) where
// 3 R <= 15 warps and D = 64 (M = 1 on Granite and SmolLM2), not one: the P.V phase is 1.1 us of the 3.6 us of a split's
// own work (bench/results/mk_warps_v9_2026-11-29.log)
// MK_ATT_W3 (on since v15, session 14: -0.2 to -0.8% on Granite, +0.7% on SmolLM2's 3 rows): at M = 1, D = 64, a context split of ONE 64-key tile (ctx 512 on Granite:
// 8 splits of one tile) runs as 3 R warps, warp (r, kc) over a third of the keys of row r: scores (lane = key),
// softmax statistics and P V (p by shuffle, lane = dim pair) inside the warp, its (m, l, o) partial into the unused K/V
// buffer 1, and one pass merges the three partials per row in a fixed order (deterministic). Two block barriers
// after the tile lands instead of five (scores, softmax, PV3's two, the tile's end); the trace (session 11) puts a
// split's scores + softmax + P V at ~1.9 us for 64 keys.
#ifndef MK_ATT_W3
#define MK_ATT_W3 1
#endif
#ifndef MK_PV3
#define MK_PV3 1
#endif
// MK_ATAG (EXPERIMENT, session 7, off: correct, 23 GPU tests, but +5.4% per step at M = 1 and +6.8% at M = 2,
// bench/results/mk_ab_session7_2026-11-29.log; all 132 blocks poll the 8 merge blocks' words): no grid
// barrier between attention and the o projection. The attention output is also written as (fp32 bits, tag) words (after the q|k|v words in p.qkvt, the layer's
// MK_QTAG tag), and the o stage's staging polls them instead. Needs MK_QTAG. Safe without the barrier:
// every head's output depends on every qkv tile (its q, k, v rows), so once a block has staged the whole
// attention output, every block has finished the qkv staging that read the residual the o epilogue
// rewrites (a block without qkv tiles stages too, but its staged x is never used).
#ifndef MK_ATAG
#define MK_ATAG 0
#endif
static_assert(!MK_ATAG || MK_QTAG, "MK_ATAG needs MK_QTAG (the layer tags)");
// MK_TRACE: the trace stamps (FLINT_MK_TRACE=1) are compiled only into a separate traced library
// (flint/kernels/build.py build(traced=True) adds -DMK_TRACE=1): their runtime checks on every stage's
// chain cost 2.5% per step (session 5, bench/results/mk_ab_session4_2026-11-29.log).
#ifndef MK_TRACE
#define MK_TRACE 0
#endif
#include "mk_common.cuh"
#include "mk_ptx.cuh"
#include "mk_mma.cuh"

#ifndef FLINT_MK_M
#define FLINT_MK_M 1
#endif
#define MK_CAT2(a, b) a##b
#define MK_CAT(a, b) MK_CAT2(a, b)

namespace mk {
namespace {  // internal linkage: this file is compiled once per M into one library

// =====================================================================[1] PTX helpers
// (shared-memory, mbarrier and copy helpers: mk_ptx.cuh)
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
// =====================================================================[2] grid barrier
// Consumers of every block arrive once per barrier; thread 0 spins on an acquire load. The counter
// only grows: barrier b of launch e (seq = e * S + b + 1, S = barriers per launch) completes at nblocks * seq.
template <bool RELAXED = false>
__device__ __forceinline__ void grid_barrier(const Params& p, unsigned long long target) {
  cbar();
  if (threadIdx.x == 0) {
    unsigned long long v;
    if constexpr (RELAXED) {  // MK_BAR_RELAXED: a timing diagnostic only (no release, no acquire)
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

// FLINT_MK_TRACE: blocks 0 and nblocks-1 stamp %globaltimer at stage boundaries, trace[2][L][32]
// Also: every block's stamps 0..15 of the middle layer at trace[2 * L * 32 + block * 16 + k], and
// block 0's / the last block's SM clock (%clock64) at the start (slot 14) and end (slot 15) of each
// layer, so the clock rate during the launch is known (MegakernelBackend.block_stamps / sm_clock_ghz).
// which traced block this is: 0 (block 0), 1 (the last block), -1 (not traced per layer)
// MK_TRACE_B2 (trace variants): the second traced block (default -1: the last block), e.g. 7 = kv head 0's split 7 at
// ctx 512, the split that polls this step's K/V rows (bench/mk_warps.py then shows its attention item too)
#ifndef MK_TRACE_B2
#define MK_TRACE_B2 -1
#endif
__device__ __forceinline__ int traced_block(const Params& p) {
  return blockIdx.x == 0 ? 0 : (int)blockIdx.x == (MK_TRACE_B2 >= 0 ? MK_TRACE_B2 : p.nblocks - 1) ? 1 : -1;
}
__device__ __forceinline__ void trace_stamp(const Params& p, int l, int k) {
  if (!MK_TRACE) return;
  if (p.trace == nullptr || threadIdx.x != 0) return;
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  if (l == p.L / 2 && k < 16) p.trace[(size_t)2 * p.L * 32 + blockIdx.x * 16 + k] = t;
  const int which = traced_block(p);
  if (which < 0) return;
  p.trace[((size_t)which * p.L + l) * 32 + k] = t;
  if (k == 0 || k == 11) p.trace[((size_t)which * p.L + l) * 32 + (k == 0 ? 14 : 15)] = clock64();
}

// FLINT_MK_TRACE, inside a stage: lane 0 of every warp of blocks 0 and nblocks-1 records %clock64
// (SM cycles) at fixed points of the middle layer's o-proj stage and attention stage, at
// trace[2 * L * 32 + nblocks * 16 + ((which * 16 + warp) * 32 + slot)] (MegakernelBackend.warp_clocks).
enum {
  WS_O_ENTER = 0, WS_O_STAGED = 1, WS_O_UNIT = 2,  // + 4 j: slot ready, dot done, parts ready, epilogue done (j < 2)
  WS_O_LOOP_END = 10, WS_O_EXIT = 11,
  WS_A_ENTER = 12, WS_A_Q = 13, WS_A_TILE = 14, WS_A_SCORES = 15, WS_A_SOFTMAX = 16, WS_A_PV = 17,
  WS_A_PART = 18, WS_A_COUNT = 19, WS_A_MERGE = 20, WS_A_EXIT = 21
};
// The matrix stage whose inside warp_stamp traces (FLINT_MK_TRACE only): o-proj by default; a
// multi-segment matrix (down) keeps its last segment's stamps, a stage of more tiles its first two.
#ifndef MK_WS_MAT
#define MK_WS_MAT MAT_O
#endif
// MK_WS_ALL = 1 (trace variant): every unit (item = segment x tile, first 8) of the traced stage gets
// three stamps (slot ready, the warp's part done, the reducer's epilogue done) at 2 + 3 u .. 4 + 3 u; its input's
// staging (stage_x, session 9) stamps 26 (a normed stage: the warp's loads landed, squares summed), 27 (the rstd
// known) and 28 (the warp's words converted and stored; slot 1 is after stage_x's final block barrier),
// loop end at 30, exit at 31; the attention stamps are off (bench/mk_units.py reads them).
#ifndef MK_WS_ALL
#define MK_WS_ALL 0
#endif
__device__ __forceinline__ void warp_stamp_raw(const Params& p, int l, int slot) {
  if (!MK_TRACE) return;
  if (p.trace == nullptr || l != p.L / 2 || (threadIdx.x & 31)) return;
  const int which = traced_block(p);
  if (which < 0) return;
  p.trace[(size_t)2 * p.L * 32 + (size_t)p.nblocks * 16 + ((which * 16 + (threadIdx.x >> 5)) * 32 + slot)] = clock64();
}
// MK_WS_RING = 1 (trace variant, bench/mk_ring.py): the weight stream of the middle layer. The producer (warp 15)
// stamps the issue of each of the 32 copies from the middle layer's first (slot = copy index); the consumers stamp
// the FFN split-K down partials (ffn_down_partial): entry (0), staged (1), chunk k < 8 wait start (2 + 2k) and
// done (3 + 2k), loop end (20). Every other warp stamp is off.
#ifndef MK_WS_RING
#define MK_WS_RING 0
#endif
// the WS_* points (in a MK_WS_ALL build the attention points are off: the units use their slots)
__device__ __forceinline__ void warp_stamp(const Params& p, int l, int slot) {
  if (MK_WS_RING) return;
  if (MK_WS_ALL && slot >= WS_A_ENTER && slot <= WS_A_EXIT) return;
  warp_stamp_raw(p, l, slot);
}

// =====================================================================[3] producer
struct Ring {
  uint8_t* slots;
  uint64_t* full;
  uint64_t* empty;
  uint64_t* parts;   // K parts of the slot's tile done (NCT arrivals per phase)
  int nslots;
  int slot_bytes;
};

// MK_INFLIGHT (session 8; 2 by default, 0 = no cap): at most this many bulk copies in flight per block (fewer than
// the ring's slots): before issuing a copy the producer waits until the one MK_INFLIGHT before it has landed. The
// middle layer's stream trace (bench/mk_ring.py) showed a copy landing 5 to 7 us after its issue during the FFN,
// one slot per ~1 us: the copies queue. Capped at 2, a copy lands within ~1.4 us and the step is 0.8-1.6% faster
// at ctx 512 (three same-call A/Bs; neutral at ctx 2048 / 8192); 1 measured the same as 2, 3 as 2, 5 in between.
// Since v22 (session 19) 1, with the lm_head's own cap at 2: once v21's dots had become cheaper (MK_DOT_PERM,
// MK_IDOT_RAW), one copy in flight per block made the hops faster than the stream lost: -1.4% at ctx 512 (28/30
// rounds), -1.1% at ctx 2048 (12/12) and at M = 2 (28/30), -0.9% at ctx 8192 (8/8); 1 for every stage including the
// lm_head -0.7%; 3 +1.8% (session 16: 1 and 2 within 0.3%, 3 +1.8%).
#ifndef MK_INFLIGHT
#define MK_INFLIGHT 1
#endif
// MK_DS_INFLIGHT (EXPERIMENT, session 17; default MK_INFLIGHT): the cap for the FFN split-K's down-slice chunks alone
// (the down phase has no hop to slow down but its own adds, and its chunks may land at the cap's rate)
#ifndef MK_DS_INFLIGHT
#define MK_DS_INFLIGHT MK_INFLIGHT
#endif
// MK_LM_INFLIGHT (session 17; 2 since v22): the cap for the lm_head's copies (the step's last stage: 128 MB at M = 1
// on Granite, ~38 us traced against ~29 us of bytes at the read bandwidth; no hop follows but the argmax's). Session
// 17 at MK_INFLIGHT = 2: 4 and 6 within 0.1%; session 19 at MK_INFLIGHT = 1: 2 -0.7% against 1
#ifndef MK_LM_INFLIGHT
#define MK_LM_INFLIGHT 2
#endif
template <int CAP = MK_INFLIGHT>
__device__ __forceinline__ void inflight_cap(const Ring& ring, int slot, uint32_t lap) {
  if (!CAP) return;
  const int cap = CAP < ring.nslots ? CAP : ring.nslots - 1;
  int s2 = slot - cap;
  uint32_t l2 = lap;
  if (s2 < 0) {
    if (lap == 0) return;
    s2 += ring.nslots;
    l2 = lap - 1;
  }
  mbar_wait(&ring.full[s2], l2 & 1);
}
// MK_QKV_EARLY (EXPERIMENT, session 15, off; written after the last device call: builds, NOT run on a GPU): at M = 1
// with the FFN split-K, the producer streams layer l + 1's q|k|v tiles right after layer l's gate|up tiles, before
// its down slice's chunks, and the consumers take those slots after the chunks (the q|k|v stage steps the ring back
// to them, then forward again). Session 15 (15l): bar4 runs ~1 us longer than bar2 / bar3 under the stream of the
// next layer's q|k|v copies, which the ring's order puts behind the 5 down chunks; holding them back moved their cost
// into the q|k|v stage. Here they land during the down phase, and nothing streams at bar4 (the next copy, gate|up's
// first tile, waits for a deferred slot). Deadlock-free iff the deferred tiles plus the chunks fit the ring
// (flint/kernels/dev/ring_model.py "early", tests/test_ring_protocol.py): else the default order.
#ifndef MK_QKV_EARLY
#define MK_QKV_EARLY 0
#endif
// this block's q|k|v ring units per layer (nq) and down-slice chunks (nch); the early order applies iff it returns true
__device__ __forceinline__ bool qkv_early(const Params& p, const Smem& sl, const MiscSmem* misc, int nslots, int& nq,
                                         int& nch) {
  nq = (misc->tile1[MAT_QKV] - misc->tile0[MAT_QKV]) * p.mat[MAT_QKV].nseg;
  nch = sl.ds_cpt > 0 ? (misc->tile1[MAT_DS] + sl.ds_cpt - 1) / sl.ds_cpt : 0;
  return MK_QKV_EARLY && p.nffn && nq + nch <= nslots;
}
// MK_DS_RR (on since session 9): the FFN split-K's down-slice tiles round robin over the whole slice (tile t + i of
// chunk t to warp (t + i) mod 15), not per chunk: with per-chunk assignment a chunk of 34 tiles gave warps 0..3 a
// third tile, i.e. a second two-tile iteration, in every chunk (15 tiles and 10 iterations vs 11 and 5-6).
// Session 5's 5i (the same, as a patch) measured noise while the slice bytes arrived late; with MK_INFLIGHT every
// chunk is in before the warps ask for it. Session 9's same-call A/Bs at ctx 512: M = 1 -3.8%, M = 2 -1.6%
// (bench/results/mk_ab_session9_rr_wa_2026-11-30.log). 0 = the per-chunk assignment.
#ifndef MK_DS_RR
#define MK_DS_RR 1
#endif
// MK_WARP_ARRIVE (EXPERIMENT, session 8, off; session 9's A/B: noise, +0.5% at M = 1, -0.5% at M = 2): a warp's arrivals on a ring slot's parts and
// empty mbarriers as one arrive of count 32 n by lane 0 after a __syncwarp (which orders the lanes' shared-memory
// accesses before it), not 32 arrives of count n (one per lane); the expected counts stay NCT per phase.
// Hypothesis from 8e: the per-lane arrivals are 960 arrive operations on two shared words per ring unit.
#ifndef MK_WARP_ARRIVE
#define MK_WARP_ARRIVE 0
#endif
// MK_FXRES (session 10; FFN split-K, M = 1 only): the residual stream between layers as 64-bit fixed point (2^-32
// units) in Hp words after the partial sums in p.dpart, and each FFN block ADDS its down partials into it with
// red.global.add.u64 (integer adds commute: deterministic, bitwise-repeatable) instead of writing them to dpart
// for every block to sum after a grid barrier. The o epilogue stores its rows' value (fp32 as before, and in fixed
// point); the next layer's qkv staging reads the fixed-point words right after the FFN's barrier, converts them and
// keeps the block's own rows (c.own, p.resid) for the o epilogue. No ffn_down_reduce and one grid barrier less per
// layer. Each FFN block walks its slice's chunks from chunk (f mod chunks) on, so the 128 blocks' adds spread over
// all rows (from chunk 0 on: no gain, session 10). Session 10's same-call A/Bs at ctx 512, every M: M = 1 -1.7% and
// -2.4%, M = 2 (twice the adds) +1 to +2%, hence M = 1 only; this form: M = 1 -1.0%, ctx 2048 -1.7% (23 GPU tests
// pass; docs/megakernel.md 10c-10e); session 11: -3.2% (24 GPU tests), the default since v13. The qkv staging's loads land 0.6-0.9 us
// later than from the fp32 residual (the L2 still applying the adds), which eats most of the 2.5 us removed.
// Barriers per launch then depend on M: the barrier target counts from a base kept in p.epoch[1].
// 2 (EXPERIMENT; session 11: +0.5% against 1, noise): also the tiles inside a chunk start at tile f mod n (the hoisted
// slice dot), so the ~26 blocks working on one chunk at a time add to different rows.
// Session 14, against v16 in one process: 2 is +0.8% (37/40 rounds slower).
// MK_DS_RED4 (on since v15, session 14: -0.3 to -0.5%, bitwise the same results; MK_DS_EPI's loop has it too since v16):
// at M = 1 with MK_FXRES, the
// down partials of an iteration's two tiles as ONE 32-lane red.add (lane (g, t): tile t >> 1, row g + 8 (t & 1); the
// four values come from lane (g, 0) by shuffles) instead of four 8-lane ones: 4x fewer write instructions, the same
// adds (integer: the same bits). Session 12's 12e: the down phase's write side alone costs ~2.7 us per layer.
#ifndef MK_DS_RED4
#define MK_DS_RED4 1
#endif
#ifndef MK_FXRES
#define MK_FXRES 1
#endif
// MK_STAGE_SKIP (on since v17, session 15; session 10's experiment): in stage_x's conversion pass a warp none of whose
// lanes holds a word skips it (it computed the whole pass on zeros: the break before is block-uniform). Session 10's
// qkv unit trace: the pass takes 0.55-0.6 us after the rstd, and warps 10-14, which hold no word at M = 1 (320 words),
// end it at the same time as the others, i.e. the pass looks issue-bound over 15 warps; the FFN's act staging (8 words
// per block) runs it on 15 warps for one warp's words. Projection: qkv / o / gate|up stagings -0.15 us each, the act
// staging -0.4 us: -0.5 to -1 us per layer (-1.5 to -3%). Measured (one same-call A/B, 3 rounds; a __all_sync vote, as
// the plain warp-uniform branch spilled at M = 1): M = 1 +2.5% (rounds 1376-1420 vs 1378-1382), M = 2 -1.7%:
// unresolved (docs/megakernel.md 10g). Session 15, one process (bench/mk_ab1.py, 30 rounds): M = 1 -0.22% (26/30
// rounds faster), M = 2 -0.56% (30/30), M = 4 -0.20% (26/30); the same arithmetic (a skipped warp held no word).
#ifndef MK_STAGE_SKIP
#define MK_STAGE_SKIP 1
#endif
// the M = 1 object only (one object per M: FLINT_MK_M); the other M's code is the default's, but for the barrier base
#if MK_FXRES && defined(FLINT_MK_M) && FLINT_MK_M == 1
#define MK_FX1 1
#else
#define MK_FX1 0
#endif
template <int M>
constexpr bool kFx = MK_FX1 && M == 1;
// MK_OHEAD (EXPERIMENT, session 10, off; session 11: correct, 24 GPU tests, but +4.9% per step at M = 1 (+8.0% with
// MK_FXRES = 2); traced (docs/megakernel.md 11i): the o hop gains ~0.5-1 us per layer, the two-buffer fixed-point
// stagings of qkv and gate|up lose ~1 and ~1.8 us; needs MK_FXRES; M = 1, FFN split-K, where the host
// finds the shapes fit (Params::ohead = blocks per kv head B), requested by FLINT_MK_OHEAD=1): the o projection by kv
// head. Blocks [h B, (h + 1) B) own o's row tiles [j T, (j + 1) T) (j = b - h B) over head h's q heads' columns
// (mat[MAT_D]: o repacked as per-q-head column slices); they poll head h's attention output (tagged words, written
// by its merge), dot their slices and ADD their rows' sums into the fixed-point o accumulator: no grid barrier after
// attention and no o matvec stage. Residual buffers (int64, M = 1, parity q = layer & 1; fx_buf): X[q] the layer's
// input, O[q] the o sums, Y[q] = X + O, D[q] the down sums. The gate|up staging reads X + O and each row's owner
// writes it to Y; the next qkv staging reads Y + D and the owners write it to the next X (two buffers per staging:
// three spilled); owners zero the other parity's O and D after bar3 (every read of them was before it, every add
// into them comes after the next bar4); the last block zeroes the last layer's.
// docs/megakernel.md, session 10's next steps, item 5. Projection: -2 to -3 us per layer.
#ifndef MK_OHEAD
#define MK_OHEAD 0
#endif
static_assert(!kIdotMixed || (!MK_OHEAD && !MK_ATAG), "MK_IDOT_MASK: a mixed mask with MK_OHEAD / MK_ATAG (their stagings) is not written");
static_assert(!MK_OHEAD || MK_FXRES, "MK_OHEAD needs MK_FXRES (its fixed-point adds)");
static_assert(!(MK_QKV_EARLY && MK_OHEAD), "MK_QKV_EARLY: the ring order of the default o stage only");
#if MK_OHEAD && MK_FX1
#define MK_OH1 1
#else
#define MK_OH1 0
#endif
// MK_NOFENCE (session 16, M = 1 with MK_FXRES; bits): the grid barriers after the down partials (4), and after
// attention and o (8), without their release fence. hop_bench --sync measured that fence (MEMBAR.ALL.GPU) waiting for the
// block's bulk copies in flight: 0.42 us with none, 1.25 us with two 16 KB copies per SM; MK_BAR_RELAXED = 7 (the
// three barriers relaxed, a diagnostic) took 6.7% off the step. The barrier stays as a relaxed counter (a hint: every
// block has arrived) and the data carry their own proof:
//   (1 and 2, measured and lost in session 16 (+0.9%, +3.5%): 8-byte proofs, the attention output as (fp32, tag)
//   words and two counted residual buffers: flint/kernels/dev/experiments/16_nofence_bits12.patch)
//   4 (one counted buffer X; alone, with the o barrier fenced): the owners STORE fx(x + o) into X with count 0 before
//      that barrier, the FFN blocks' adds carry the count, and the next staging re-polls a word until it shows nffn
//      adds (nffn < 256, the host checks). A stale word cannot show nffn: the store it replaced is ordered before every reader by the
//      fenced o barrier, and a layer's stores come after the owner's own staging saw every add of the layer before.
//   8 (with 4; session 16): bars 2 and 3 relaxed too, their data as 32-bit words (the fp32 value truncated to its top
//      24 bits: 16 significant bits; then the tag's low 8 bits): the merge output for the o staging and x + o (the o
//      owners' rows) for the gate|up staging: the bytes of today's fp32 rows, the stagings re-poll stale words (a word
//      is rewritten every layer and the tag grows by one per layer, so 8 bits tell this layer's from any earlier one).
//      The o owners ADD fx(x + o) - (the value they read at the q|k|v staging) into the one buffer X (count + 1: adds
//      commute with the FFN blocks'; layer 0 stores behind its fenced o barrier), so the next staging expects nffn + l (nffn + 1) adds after layer l. The two stagings' inputs keep 16 significant
//      bits (truncated: relative error < 2^-15; the stagings convert to fp16 hi + lo, 22 bits, or two int8 terms, ~15
//      bits). v19 = bits 4 + 8 (session 16: -2.9% per step against v18, logits within 2.1e-4 of v18's).
//   16 (with 8; session 16, EXPERIMENT): no counter at all at the barrier after o for layers > 0: the gate|up staging
//      polls the owners' tagged x + o words directly (the causal chain that orders the residual's adds runs through
//      those words: a block's down adds need every owner's x + o, each owner's o needs every block's q|k|v).
//   32 (with 8; session 20, on since v23: -3.0 to -3.2% per step at ctx 512 in two calls (29/30 and 30/30 rounds, its
//      null compile -3.1%), -2.2% at ctx 2048, -1.6% at ctx 8192; bitwise equal): no barrier after the down partials at all: the next staging's count polls are
//      the proof (a word shows the expected count exactly when every add of the layer has landed; the next adds into X,
//      the o owners' of the next layer, need every block's next q|k|v epilogue through attention, so no word can run
//      past its count before every block has read it). Bits 64 (the count polls backing off 64 ns: 0.9703 against
//      0.9682) and 128 (no counter after attention either: 0.9898 against 0.9697) are
//      flint/kernels/dev/experiments/20_nofence_bits64_128.patch.
// (MK_NOFENCE itself is defined in mk_common.cuh: the host's shared-memory layout needs it too)
#define MK_NF (MK_FX1 ? MK_NOFENCE : 0)  // (this object's: the M = 1 object only)
static_assert(!MK_NOFENCE || (MK_FXRES && MK_BAR_SMEM && !MK_OHEAD && !MK_ATAG && !MK_BAR_RELAXED && !MK_QKV_EARLY),
              "MK_NOFENCE: the fixed-point residual, the barrier base in shared memory, no MK_OHEAD / MK_ATAG / MK_BAR_RELAXED");
constexpr unsigned long long FX_CNT = (MK_NF & 12) ? (1ull << 56) : 0ull;  // what every add into X carries
static_assert(!(MK_NOFENCE & 3), "MK_NOFENCE: bits 1 and 2 are experiments/16_nofence_bits12.patch");
static_assert(!(MK_NOFENCE & 8) || (MK_NOFENCE & 4), "MK_NOFENCE: bit 8 with 4");
static_assert(!(MK_NOFENCE & 16) || (MK_NOFENCE & 8), "MK_NOFENCE: bit 16 with 8");
static_assert(!(MK_NOFENCE & 32) || (MK_NOFENCE & 8), "MK_NOFENCE: bit 32 with 8");
// the fixed-point buffers of MK_FXRES / MK_OHEAD (M = 1): X[0..1], O[0..1], D[0..1], Y[0..1] (MK_FXRES alone: X[0]);
// a stage_x source code: the two buffers to add (b: 15 = none) and the one the rows' owners write the sum to
enum { FXB_X = 0, FXB_O = 2, FXB_D = 4, FXB_Y = 6, FXB_NONE = 15 };
__host__ __device__ constexpr int fx_code(int a, int b, int w) { return 1 << 12 | a | b << 4 | w << 8; }
// (|v| >= 2^31 saturates where fp32 would carry on: far above any residual of the models flint runs)
constexpr float FX_SCALE = 4294967296.f, FX_INV = 1.f / 4294967296.f;
__device__ __forceinline__ unsigned long long fx_of(float v) { return (unsigned long long)__float2ll_rn(v * FX_SCALE); }
__device__ __forceinline__ float fx_val(long long x) { return __ll2float_rn(x) * FX_INV; }
// MK_NOFENCE: two residual words, re-read from L2 on every poll; a word holds the expected count e56 = E << 56 when
// its value w - e56 is within 2^55 of 0 (a missing add leaves it 2^56 away: |value| < 2^55 is the format's bound)
__device__ __forceinline__ longlong2 ld_fx2(const longlong2* a) {
  long long x, y;
  asm volatile("ld.relaxed.gpu.global.v2.s64 {%0, %1}, [%2];" : "=l"(x), "=l"(y) : "l"(a) : "memory");
  return make_longlong2(x, y);
}
__device__ __forceinline__ bool fx_counted(long long w, unsigned long long e56) {
  return ((unsigned long long)w - e56 + (1ull << 55)) < (1ull << 56);
}
__device__ __forceinline__ void fx_red(unsigned long long* a, float v) {
  if (MK_DIAG2 & 1) {
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(a), "l"(fx_of(v)) : "memory");
    return;
  }
  if (MK_DIAG2 & 8) {  // the sum computed, no write (one that never happens keeps the dot alive)
    if (v == 1.2345e-30f) asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" ::"l"(a), "l"(fx_of(v)) : "memory");
    return;
  }
  asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" ::"l"(a), "l"(fx_of(v) + FX_CNT) : "memory");
}
// the fixed-point residual: token m's row at fx_base(p) + m * fx_stride(p) (the padded rows of the down tiles), after
// the partial sums in p.dpart (not over them: the slices f >= nffn there must stay 0 for the other M's reduction)
__device__ __forceinline__ unsigned long long* fx_base(const Params& p) {
  return reinterpret_cast<unsigned long long*>(p.dpart + (size_t)MAX_M * p.mat[MAT_DS].ntiles * p.nffn_pad * TILE_ROWS);
}
__device__ __forceinline__ int fx_stride(const Params& p) { return p.mat[MAT_DS].ntiles * TILE_ROWS; }
__device__ __forceinline__ unsigned long long* fx_buf(const Params& p, int b) {
  return fx_base(p) + (size_t)b * fx_stride(p);
}
// a warp's arrivals on a ring slot's parts / empty mbarrier: n per lane (NCT per phase in all)
__device__ __forceinline__ void ring_arrive_n(uint64_t* bar, uint32_t n, int lane) {
  if (MK_WARP_ARRIVE) {
    __syncwarp();
    if (lane == 0) mbar_arrive_n(bar, 32u * n);
  } else {
    mbar_arrive_n(bar, n);
  }
}
__device__ __forceinline__ void ring_arrive(uint64_t* bar, int lane) {
  if (MK_WARP_ARRIVE) {
    __syncwarp();
    if (lane == 0) mbar_arrive_n(bar, 32u);
  } else {
    mbar_arrive(bar);  // every lane: no divergent lane-0 branch
  }
}
#if MK_WS_RING
// copy q of the stream from the middle layer's first (the producer counts them: rseq, -1 before that layer)
__device__ __forceinline__ void ring_stamp(const Params& p, int& rseq) {
  if (rseq >= 0 && rseq < 32) warp_stamp_raw(p, p.L / 2, rseq);
  if (rseq >= 0) ++rseq;
}
#define RING_ARGS , const Params& p, int& rseq
#define RING_PASS , p, rseq
#define RING_STAMP() ring_stamp(p, rseq)
#else
#define RING_ARGS
#define RING_PASS
#define RING_STAMP()
#endif
// One bulk copy into the next ring slot (chunk q: slot q mod nslots on lap q / nslots): once the slot's previous lap
// is consumed and at most MK_INFLIGHT copies are in flight
template <int CAP = MK_INFLIGHT>
__device__ __forceinline__ void ring_copy(const Ring& ring, int& slot, uint32_t& lap, const uint8_t* src,
                                          uint32_t bytes, uint64_t pol RING_ARGS) {
  if (lap > 0) mbar_wait(&ring.empty[slot], (lap - 1) & 1);
  inflight_cap<CAP>(ring, slot, lap);
  RING_STAMP();
  mbar_expect_tx(&ring.full[slot], bytes);
  bulk_g2s(ring.slots + (size_t)slot * ring.slot_bytes, src, bytes, &ring.full[slot], pol);
  if (++slot == ring.nslots) { slot = 0; ++lap; }
}
// One ring slot per tile-segment (16 row-segments), in the consumers' order: segment-major, tiles
// in order within a segment. Chunk q goes to slot q mod nslots on lap q / nslots, kept as (slot, lap)
// and stepped (no division per copy: the one producer lane issues every copy of the block).
template <int CAP = MK_INFLIGHT>
__device__ void produce_matrix(const Mat& mt, int t0, int t1, int layer, const Ring& ring, int& slot, uint32_t& lap,
                               uint64_t pol RING_ARGS) {
  const uint32_t bytes = (uint32_t)(TILE_ROWS * mt.srb);
  const uint8_t* lbase = mt.base + (long long)layer * mt.layer_stride;
  for (int s = 0; s < mt.nseg; ++s) {
    const uint8_t* src = lbase + (long long)s * mt.seg_stride + (long long)t0 * bytes;
    for (int tl = t0; tl < t1; ++tl, src += bytes) {
      ring_copy<CAP>(ring, slot, lap, src, bytes, pol RING_PASS);
    }
  }
}

// FFN split-K: this block's down slice (all its row tiles, one K slice) in chunks of cpt tiles per
// slot, in the consumers' order (ffn_down_partial)
__device__ void produce_slice(const Mat& mt, int ntl, int cpt, int layer, const Ring& ring, int& slot, uint32_t& lap,
                              uint64_t pol, bool fxrot RING_ARGS) {
  const uint32_t tb = (uint32_t)(TILE_ROWS * mt.srb);
  const uint8_t* src = mt.base + (long long)layer * mt.layer_stride + (long long)blockIdx.x * mt.seg_stride;
#if MK_FX1  // (kFx: chunks from chunk (f mod chunks) on: ffn_down_partial's order)
  const int nch = (ntl + cpt - 1) / cpt, ch0 = fxrot && MK_DS_ROT ? (int)blockIdx.x % nch : 0;
  for (int ci = 0; ci < nch; ++ci) {
    const int t = (ci + ch0 < nch ? ci + ch0 : ci + ch0 - nch) * cpt;
    const uint8_t* cs = src + (size_t)t * tb;
#else
  for (int t = 0; t < ntl; t += cpt, src += (size_t)cpt * tb) {
    const uint8_t* cs = src;
#endif
    const uint32_t bytes = (uint32_t)min(cpt, ntl - t) * tb;
    ring_copy<MK_DS_INFLIGHT>(ring, slot, lap, cs, bytes, pol RING_PASS);
  }
}

#if MK_OH1
// MK_OHEAD: this block's o column slices, one per q head of its kv head, each its T row tiles (o_head_stage's order;
// pp: the params, as p comes with RING_ARGS in MK_WS_RING builds)
__device__ void produce_oslices(const Params& pp, int layer, const Ring& ring, int& slot, uint32_t& lap,
                                uint64_t pol RING_ARGS) {
  const Mat& mt = pp.mat[MAT_D];
  const int B = pp.ohead, h = (int)blockIdx.x / B, j = (int)blockIdx.x - h * B;
  if (h >= pp.nkv) return;  // (the blocks past nkv B have no o work)
  const int gq = pp.nh / pp.nkv, T = mt.ntiles / B;
  const uint32_t tb = (uint32_t)(TILE_ROWS * mt.srb), bytes = (uint32_t)T * tb;
  for (int qh = 0; qh < gq; ++qh) {
    const uint8_t* cs = mt.base + (long long)layer * mt.layer_stride + (long long)(h * gq + qh) * mt.seg_stride +
                        (long long)j * T * tb;
    ring_copy(ring, slot, lap, cs, bytes, pol RING_PASS);
  }
}
#endif

__device__ void producer(const Params& p, const Smem& sl, const Ring& ring, const MiscSmem* misc, bool fxrot,
                         bool oh) {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  int slot = 0;
  uint32_t lap = 0;
#if MK_WS_RING
  int rseq = -1;
#endif
#if MK_QKV_EARLY
  int nq, nch;
  const bool early = fxrot && qkv_early(p, sl, misc, ring.nslots, nq, nch);  // (fxrot: this M runs MK_FXRES)
#else
  constexpr bool early = false;
#endif
  for (int l = 0; l < p.L; ++l) {
#if MK_WS_RING
    if (l == p.L / 2) rseq = 0;
#endif
    for (int m = MAT_QKV; m <= MAT_GU; ++m) {
      if (early && m == MAT_QKV && l > 0) continue;  // MK_QKV_EARLY: streamed during the layer before
#if MK_OH1
      if (m == MAT_O && oh) {
        produce_oslices(p, l, ring, slot, lap, pol RING_PASS);
        continue;
      }
#endif
      produce_matrix(p.mat[m], misc->tile0[m], misc->tile1[m], l, ring, slot, lap, pol RING_PASS);
    }
    if (early && l + 1 < p.L)  // MK_QKV_EARLY: the next layer's q|k|v before this layer's down chunks
      produce_matrix(p.mat[MAT_QKV], misc->tile0[MAT_QKV], misc->tile1[MAT_QKV], l + 1, ring, slot, lap, pol RING_PASS);
    if (p.nffn) produce_slice(p.mat[MAT_DS], misc->tile1[MAT_DS], sl.ds_cpt, l, ring, slot, lap, pol, fxrot RING_PASS);
    else produce_matrix(p.mat[MAT_D], misc->tile0[MAT_D], misc->tile1[MAT_D], l, ring, slot, lap, pol RING_PASS);
  }
  produce_matrix<MK_LM_INFLIGHT>(p.mat[MAT_LM], misc->tile0[MAT_LM], misc->tile1[MAT_LM], 0, ring, slot, lap,
                                 pol RING_PASS);
}

// =====================================================================[4] x staging
// MK_QTAG: one 8-byte store (single-copy atomic) carries a value and the tag that says it is this step's
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
// MK_NOFENCE bit 8: 32-bit words (fp32 value truncated to 24 bits, low 8 bits of the tag), after the q|k|v and
// attention words of MAX_M tokens: the attention output [MAX_M][nh D], then x + o [MAX_M][H] (word offsets into p.qkvt)
__device__ __forceinline__ size_t tw24_attn(const Params& p, int m, int i) {
  return (size_t)2 * MAX_M * (2 * p.nh + 2 * p.nkv) * p.D + (size_t)m * p.nh * p.D + i;
}
__device__ __forceinline__ size_t tw24_resid(const Params& p, int m, int n) {
  return (size_t)2 * MAX_M * (2 * p.nh + 2 * p.nkv) * p.D + (size_t)MAX_M * p.nh * p.D + (size_t)m * p.H + n;
}
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
    if (MK_NF & 16) __nanosleep(64);    // (bit 16: polls without a counter first; fewer of them)
  }
  auto h = [](uint32_t x) { return __uint_as_float(__byte_perm(x, 0u, 0x3214)); };  // (the tag byte cleared)
  a = make_float4(h(u[0].x), h(u[0].y), h(u[0].z), h(u[0].w));
  b = make_float4(h(u[1].x), h(u[1].y), h(u[1].z), h(u[1].w));
}
// MK_ATAG: the word of attention output element i (head-major) of token m, after the q|k|v words of MAX_M tokens
__device__ __forceinline__ uint32_t* attn_word(const Params& p, int m, int i) {
  return p.qkvt + 2 * ((size_t)MAX_M * (p.nh + 2 * p.nkv) * p.D + (size_t)m * p.nh * p.D + i);
}
__device__ __forceinline__ void attn_out(const Params& p, int m, int i, float v, uint32_t tag) {
  p.attn[(size_t)m * p.nh * p.D + i] = v;
  if (MK_ATAG || (MK_OH1 && p.ohead)) st_tagged(attn_word(p, m, i), v, tag);  // (MK_OHEAD: the o blocks poll it)
#if MK_NF & 8
  st_tw24(p.qkvt + tw24_attn(p, m, i), v, tag);
#endif
}
__device__ __forceinline__ float ld_tagged(const uint32_t* w, uint32_t tag) {  // spins until the tag is this one
  uint32_t v, tg;
  do {
    asm volatile("ld.relaxed.gpu.global.v2.u32 {%0, %1}, [%2];" : "=r"(v), "=r"(tg) : "l"(w) : "memory");
  } while (tg != tag);
  return __uint_as_float(v);
}

extern __shared__ __align__(1024) uint8_t mk_smem[];

constexpr int ROW_ACTB = 4;  // MiscSmem::rows[ROW_ACTB]: the FFN split-K act slice in shared memory
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
  uint32_t tag0;       // MK_QTAG: the tag of layer 0 in this launch (epoch * L + 1)
#if MK_WS_ALL
  int wsl;             // MK_WS_ALL: the layer whose stage_x stamps slots 26-28 (-1: none)
#endif
#if MK_FX1
  int fx;              // MK_FXRES: the next matvec stage's input is the fixed-point residual (0: not; else fx_code)
#endif
};

#if MK_NF & 8
// MK_NOFENCE: this block's rows' value in X[b] as it last read or set it ([2][o rows of the block][M] in shared memory)
// (only b = 0 since the two-buffer form left for a patch; the index by c.fx, fxc[2] and the host's two buffers stay
// until the next validation: folding them changes the validated v19 SASS)
template <int M>
__device__ __forceinline__ long long* own_fx(const Ctx<M>& c, int b) {
  return reinterpret_cast<long long*>(mk_smem + c.misc->ownfx) +
         b * (c.misc->tile1[MAT_O] - c.misc->tile0[MAT_O]) * TILE_ROWS * M;
}
#endif
// MK_QKV_EARLY: the consumers' ring position moved where the early order needs it (no-op otherwise): before layer
// l > 0's q|k|v stage back over the down chunks and the q|k|v units (nq + nch), after it forward over the chunks (nch),
// before layer l < L - 1's down chunks forward over the next layer's q|k|v units (nq); |n| <= nslots by qkv_early
enum { EARLY_BEFORE_QKV, EARLY_AFTER_QKV, EARLY_BEFORE_DOWN };
template <int M>
__device__ __forceinline__ void early_ring_step(Ctx<M>& c, int where) {
#if MK_QKV_EARLY
  int nq, nch;
  if (!kFx<M> || !qkv_early(*c.p, *c.sl, c.misc, c.ring.nslots, nq, nch)) return;
  const int n = where == EARLY_BEFORE_QKV ? -(nq + nch) : where == EARLY_AFTER_QKV ? nch : nq;
  int s = c.slot + n;
  if (s >= c.ring.nslots) {
    s -= c.ring.nslots;
    c.phase ^= 1u;
  } else if (s < 0) {
    s += c.ring.nslots;
    c.phase ^= 1u;
  }
  c.slot = s;
#endif
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

// The stage's input [k0, k0 + kst) for every token -> hi/lo fp16 terms in mma order (mk_mma.cuh) and
// the per-group sums, in ONE pass: thread = one 32-bit code word's 8 codes (two float4 loads, U
// words in flight); it writes the word's 16-byte hi chunk and lo chunk; the G/8 lanes of a
// (token, group) sit in one warp and reduce the group sums with shuffles (fixed order:
// deterministic). norm_w == nullptr: plain copy (attention output / act); else
// rmsnorm(src * mult) * norm_w (rstd fused into the loads, or compute_rstd). xsum entries of tokens >= M stay 0
// (zeroed at kernel start).
// SMEM_SRC: src rows are in shared memory (generic loads); TAGGED (MK_ATAG): the source is tagged
// words instead, token m's row at tw + 2 m tstride (a separate instantiation: the polls' registers)
template <int M, bool SMEM_SRC = false, bool TAGGED = false, bool FX = false, bool I8 = kIdot<M>, bool T24 = false>
__device__ void stage_x(const Ctx<M>& c, const float* const* src, float mult, const float* norm_w, int k0, int kst,
                        int G, int gshift, const uint32_t* tw = nullptr, int tstride = 0, uint32_t tag = 0) {
  const int t = threadIdx.x;
  const int xstride = c.sl->xstride;
  const uint32_t xlo = (uint32_t)(M * xstride);
  const int wpr = kst >> 3;         // code words per token row
  const int total = M * wpr;
  const int L = G >> 3;             // lanes per (token, group)
  const int wshift = gshift - 5;
  // words in flight per thread (more raises register pressure for the whole kernel; FX: one, its loads are 4x wider;
  // TAGGED with MK_NOFENCE: one, the gate|up staging's integer x spilled 36 bytes with two)
  constexpr int U = (FX || T24) ? 1 : 2;  // (T24, MK_NOFENCE bit 8: with two, the gate|up integer object spilled)
  // RMSNorm: when the whole row is one round of loads (decode on Granite and SmolLM2), the rstd comes
  // from the same loads (no separate pass, one L2 round trip less); else from compute_rstd first
  const bool fused = norm_w != nullptr && k0 == 0 && kst == c.p->H && total <= U * NCT;
  // (FX: whole rows in one round, so its rstd is always fused: the launch refuses H > 8 NCT with MK_FXRES)
  if constexpr (!FX)
    if (norm_w != nullptr && !fused) compute_rstd<M>(*c.p, src, mult, c.misc);
  for (int c0 = 0; c0 < total; c0 += NCT * U) {
    float4 v[U][2], wv[U][2];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int wi = c0 + u * NCT + t;
      const bool ok = wi < total;
      const int m = (M == 1 || !ok) ? 0 : wi / wpr, kw = wi - m * wpr;
      constexpr bool tagged = (MK_ATAG || MK_OH1) && !SMEM_SRC && TAGGED;
      if (tagged) {
        v[u][0] = v[u][1] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (ok) ld_tagged8(tw + 2 * ((size_t)m * tstride + k0 + 8 * kw), tag, v[u][0], v[u][1]);
      }
      if constexpr (T24) {  // MK_NOFENCE bit 8: (24-bit value, 8-bit tag) words
        v[u][0] = v[u][1] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (ok) ld_tw24x8(tw + (size_t)m * tstride + k0 + 8 * kw, tag, v[u][0], v[u][1]);
      }
#if MK_FX1
      if constexpr (FX) {  // the fixed-point residual: the sum of c.fx's buffers, 8 words of 8 bytes each
        long long sx[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
        for (int bi = 0; bi < 2; ++bi) {
          const int b = (c.fx >> (4 * bi)) & 15;
          if (b == FXB_NONE) break;
          const longlong2* fp = reinterpret_cast<const longlong2*>(fx_buf(*c.p, b + m) + k0) + 4 * kw;
#if MK_NF & 4  // counted words: all four loads in flight, re-polled together until every count is the layer's
          longlong2 q[4];
#pragma unroll
          for (int h = 0; h < 4; ++h) q[h] = ok ? ld_fx2(fp + h) : make_longlong2(0, 0);
          // (bit 8: the count X has reached in this launch; bit 4 alone: X is stored with count 0 behind the fenced o
          // barrier, and every FFN block adds once)
          const unsigned long long e56 =
              (unsigned long long)(((MK_NF & 8) ? c.misc->fxc[b & 1] : (unsigned)c.p->nffn) & 255u) << 56;
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
#else
#pragma unroll
          for (int h = 0; h < 4; ++h) {
            const longlong2 q = ok ? __ldcg(fp + h) : make_longlong2(0, 0);
            sx[2 * h] += q.x;
            sx[2 * h + 1] += q.y;
          }
#endif
        }
#if MK_NF & 8
        if (ok) {  // the owner's rows: the value its o epilogue turns into fx(x + o) with one add
          const int k = k0 + 8 * kw, n0 = c.misc->tile0[MAT_O] * TILE_ROWS;
          if (k >= n0 && k < min(c.misc->tile1[MAT_O] * TILE_ROWS, c.p->H)) {
            long long* ow = own_fx(c, c.fx & 1);  // (X[b]: fx code b = FXB_X + b)
#pragma unroll
            for (int j = 0; j < 8; ++j) ow[(k + j - n0) * M + m] = sx[j];
          }
        }
#endif
        const int wb = (c.fx >> 8) & 15;  // the rows' owners keep the sum (MK_OHEAD: Y, the next layer's X)
        if (wb != FXB_NONE && ok) {
          const int k = k0 + 8 * kw, n0 = c.misc->tile0[MAT_O] * TILE_ROWS;
          if (k >= n0 && k < min(c.misc->tile1[MAT_O] * TILE_ROWS, c.p->H)) {
            longlong2* wp = reinterpret_cast<longlong2*>(fx_buf(*c.p, wb + m) + k);
#pragma unroll
            for (int h = 0; h < 4; ++h) wp[h] = make_longlong2(sx[2 * h], sx[2 * h + 1]);
          }
        }
        v[u][0] = make_float4(fx_val(sx[0]), fx_val(sx[1]), fx_val(sx[2]), fx_val(sx[3]));
        v[u][1] = make_float4(fx_val(sx[4]), fx_val(sx[5]), fx_val(sx[6]), fx_val(sx[7]));
      }
#endif
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float4* sp = reinterpret_cast<const float4*>(src[m] + k0) + 2 * kw + h;
        if (!tagged && !FX && !T24) v[u][h] = !ok ? make_float4(0.f, 0.f, 0.f, 0.f) : SMEM_SRC ? *sp : __ldcg(sp);
        wv[u][h] = (norm_w && ok) ? __ldg(reinterpret_cast<const float4*>(norm_w + k0) + 2 * kw + h)
                                  : make_float4(1.f, 1.f, 1.f, 1.f);
      }
    }
    if (fused) {  // sum of squares of src * mult per token: warp-private running sums, fixed order
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
#if MK_WS_ALL
      if (M <= 2 && c.wsl >= 0) warp_stamp_raw(*c.p, c.wsl, 26);  // this warp's loads landed and its squares are summed
#endif
      cbar();
      finish_rstd<M>(*c.p, c.misc);
#if MK_WS_ALL
      if (M <= 2 && c.wsl >= 0) warp_stamp_raw(*c.p, c.wsl, 27);  // the block's rstd is known
#endif
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (c0 + u * NCT >= total) break;  // block-uniform: no idle rounds
      // MK_STAGE_SKIP: a warp with no word left stops (warp-uniform: the pass has no block barrier and its shuffles
      // stay within a warp; a warp's later words are further on)
      if (MK_STAGE_SKIP && __all_sync(0xffffffffu, c0 + u * NCT + t >= total)) break;
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
      if constexpr (I8) {  // the integer dot's x: two int8 terms per token and group
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
        if (M == 1 && MK_IDOT_RAW && G >= 64) {  // the raw-byte dot's rows (mk_mma.cuh, imma_raw_tile_dot)
          if (ok) {
            const int pitch = mkmma::imma_raw_pitch(xstride), wpl = G >> 5;
            const int k = kw << 3, gi = k >> gshift, wg = (k & (G - 1)) >> 3;
            const int j = wg & (wpl - 1);  // word j of lane wg / wpl's share
            const uint32_t a = c.xs + (uint32_t)(gi * G + (wg - j) * 8 + 4 * j), am = a + (uint32_t)(4 * wpl);
            const uint32_t nh0 = pack4(-hq[0], -hq[2], -hq[4], -hq[6]), nl0 = pack4(-lq[0], -lq[2], -lq[4], -lq[6]);
            asm volatile("st.shared.u32 [%0], %1;" ::"r"(a), "r"(h0) : "memory");
            asm volatile("st.shared.u32 [%0], %1;" ::"r"(am), "r"(nh0) : "memory");
            asm volatile("st.shared.u32 [%0], %1;" ::"r"(a + pitch), "r"(l0) : "memory");
            asm volatile("st.shared.u32 [%0], %1;" ::"r"(am + pitch), "r"(nl0) : "memory");
            asm volatile("st.shared.u32 [%0], %1;" ::"r"(a + 2 * pitch), "r"(0u) : "memory");
            asm volatile("st.shared.u32 [%0], %1;" ::"r"(am + 2 * pitch), "r"(h1) : "memory");
            asm volatile("st.shared.u32 [%0], %1;" ::"r"(a + 3 * pitch), "r"(0u) : "memory");
            asm volatile("st.shared.u32 [%0], %1;" ::"r"(am + 3 * pitch), "r"(l1) : "memory");
            if ((t & (L - 1)) == 0) {  // lane t = 0: (s / 254, X), t = 1: (s / 4064, 0); t = 2, 3 stay 0
              const uint32_t xa = c.xsum + (uint32_t)(gi * mkmma::MMA_XSUM_FLOATS * 4 + 16);
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
      } else {
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
      const uint4 hc = make_uint4(hw[0] | (hw[4] << 16), hw[1] | (hw[5] << 16), hw[2] | (hw[6] << 16), hw[3] | (hw[7] << 16));
      const uint4 lc = make_uint4(lw[0] | (lw[4] << 16), lw[1] | (lw[5] << 16), lw[2] | (lw[6] << 16), lw[3] | (lw[7] << 16));
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
          if constexpr (kIdotMixed && kIdot<M> && 2 * M <= 8) {  // the lo column's entry an integer staging may have written
            constexpr int LB = M == 1 ? 1 : M == 2 ? 2 : 4;
            const int n = LB + m;
            asm volatile("st.shared.f32 [%0], %1;" ::"r"(xa + 4u * (4 * (n >> 1) + (n & 1))), "f"(0.f) : "memory");
          }
        }
      }
      }  // fp16 terms
    }
  }
#if MK_WS_ALL
  if (M <= 2 && c.wsl >= 0) warp_stamp_raw(*c.p, c.wsl, 28);  // this warp's words converted and stored
#endif
  cbar();
}

// =====================================================================[5] matvec stage + epilogues
// The tile dot of this kernel's x staging: fp16 hi + lo terms, or with MK_IDOT (M <= 4) the integer dot
// (arow: the tile row of the lane's A rows, MK_DOT_PERM; -1: lane / 4, the mma's own row)
template <int M, bool I8 = kIdot<M>>
__device__ __forceinline__ void tile_dot(int G, uint32_t tile, int srb, int kseg, int gi0, int gi1, uint32_t xs,
                                         int xstride, uint32_t xlo, uint32_t xsum, int lane, float (&acc)[4],
                                         int arow = -1) {
  if constexpr (I8 && M == 1 && MK_IDOT_RAW) {  // (G = 32: the nibble-split dot; its staging is the one it reads)
    if (G == 128)
      mkmma::imma_raw_tile_dot<4>(tile, srb, kseg, gi0, gi1, xs, mkmma::imma_raw_pitch(xstride), xsum, lane, acc, arow);
    else if (G == 64)
      mkmma::imma_raw_tile_dot<2>(tile, srb, kseg, gi0, gi1, xs, mkmma::imma_raw_pitch(xstride), xsum, lane, acc, arow);
    else mkmma::imma_tile_dot<1, M>(tile, srb, kseg, gi0, gi1, xs, xstride, xsum, lane, acc, arow);
  } else if constexpr (I8)
    mkmma::imma_tile_dot_g<M>(G, tile, srb, kseg, gi0, gi1, xs, xstride, xsum, lane, acc, arow);
  else
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
        if (MK_QTAG) {
          st_tagged(qkv_word(p, mm, head * p.D + ip), o1, c.tag0 + layer);
          st_tagged(qkv_word(p, mm, head * p.D + ip + half), o2, c.tag0 + layer);
        } else {
          float* qp = p.q + (size_t)mm * qd + head * p.D;
          qp[ip] = o1;
          qp[ip + half] = o2;
        }
      } else {
        __half* kp = p.kcache + ((((size_t)layer * p.nkv + head) * p.max_seq + pos) * p.D);
        const __half k1 = __float2half_rn(o1), k2 = __float2half_rn(o2);
        kp[ip] = k1;
        kp[ip + half] = k2;
        if (MK_QTAG) {  // the values as the cache holds them (fp16)
          st_tagged(qkv_word(p, mm, qd + head * p.D + ip), __half2float(k1), c.tag0 + layer);
          st_tagged(qkv_word(p, mm, qd + head * p.D + ip + half), __half2float(k2), c.tag0 + layer);
        }
      }
    } else {  // v: natural row order
      const int nn = n0 - qd - kd;
      const int head = nn / p.D, d0 = nn % p.D;
      __half2* vp = reinterpret_cast<__half2*>(p.vcache + ((((size_t)layer * p.nkv + head) * p.max_seq + pos) * p.D) + d0);
      const __half2 vh = __floats2half2_rn(a, b);
      *vp = vh;
      if (MK_QTAG) {  // the values as the cache holds them (fp16); v rows are in natural order: row n0
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
#if MK_FX1
      if (kFx<M> && p.nffn && mi == MAT_O) {  // the fixed-point residual the FFN blocks add their down partials into
#if MK_NF & 8
        {  // X becomes fx(x + o) at the owner's rows: layer 0 stores (count 0), later layers add the difference
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
          const uint32_t tg = c.tag0 + (uint32_t)layer;  // x + o for the gate|up staging, tagged
          asm volatile("st.relaxed.gpu.global.v2.u32 [%0], {%1, %2};" ::"l"(p.qkvt + tw24_resid(p, mm, n0)),
                       "r"(tw24_word(r0, tg)), "r"(tw24_word(r1, tg)) : "memory");
        }
#else
        *reinterpret_cast<longlong2*>(fx_base(p) + (size_t)mm * fx_stride(p) + n0) =
            make_longlong2((long long)fx_of(r0), (long long)fx_of(r1));
#endif
      }
#endif
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
// the mbarrier parity waits are only valid within one phase, so no warp may skip a chunk (4g).
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
  // the stage whose inside is traced (warp_stamp; MK_WS_ALL: M <= 2, the stamps' registers spill at larger M)
  const bool ws = mi == MK_WS_MAT && (!MK_WS_ALL || M <= 2);
  // per-unit bookkeeping without integer division (it cost ~0.3 us per unit and warp, bench/mk_units.py):
  // part p of item i runs on warp (i S + p) mod 15, i.e. this warp holds part (warp - i S) mod 15,
  // stepped per item; the K groups of part p are [gtab(p), gtab(p + 1)), one division per lane and stage
  int part = warp;
  const int gtab = lane < 16 ? c.misc->gbound[mi][lane] : ng;  // ng * lane / S, computed once per launch
  if (ws) warp_stamp(p, layer, WS_O_ENTER);
  for (int s = 0; s < mt.nseg; ++s) {
    if (s == 0 || !xall) {
      if (s > 0) cbar();  // every warp is done with segment s-1's x before it is overwritten
#if MK_NF & 8
      if (kFx<M> && p.nffn && (mi == MAT_O || mi == MAT_GU))  // MK_NOFENCE bit 8: the tagged 24-bit words
        stage_x<M, false, false, false, I8, true>(c, src, mult, norm_w, xall ? 0 : s * mt.kseg, xall ? mt.K : mt.kseg, mt.G,
                                               mt.gshift, p.qkvt + (mi == MAT_O ? tw24_attn(p, 0, 0) : tw24_resid(p, 0, 0)),
                                               mi == MAT_O ? p.nh * p.D : p.H, c.tag0 + (uint32_t)layer);
      else
#endif
      if (MK_ATAG && mi == MAT_O)
        stage_x<M, false, true, false, I8>(c, src, mult, norm_w, xall ? 0 : s * mt.kseg, xall ? mt.K : mt.kseg, mt.G, mt.gshift,
                                attn_word(p, 0, 0), p.nh * p.D, c.tag0 + (uint32_t)layer);
      else {
#if MK_WS_ALL
        c.wsl = ws ? layer : -1;
#endif
#if MK_FX1
        if (kFx<M> && c.fx)
          stage_x<M, false, false, true, I8>(c, src, mult, norm_w, xall ? 0 : s * mt.kseg, xall ? mt.K : mt.kseg, mt.G,
                                         mt.gshift);
        else
#endif
        stage_x<M, false, false, false, I8>(c, src, mult, norm_w, xall ? 0 : s * mt.kseg, xall ? mt.K : mt.kseg, mt.G, mt.gshift);
#if MK_WS_ALL
        c.wsl = -1;
#endif
      }
      if (s == 0 && mi != MAT_LM) trace_stamp(p, layer, 16 + 4 * mi);
      if (ws) warp_stamp(p, layer, WS_O_STAGED);
    }
    const uint32_t xs = c.xs + (xall ? (uint32_t)(s * mt.kseg * (I8 ? 1 : 2)) : 0u);  // int8 / fp16 x
    const int grow = MK_DOT_PERM ? mkmma::dot_perm_row(gq, mt.srb, mt.G) : gq;  // the tile row of this lane's acc[0]
    const uint32_t xsum = c.xsum + (xall ? (uint32_t)(s * ng * mkmma::MMA_XSUM_FLOATS * 4) : 0u);
    for (int j = 0; j < nt; ++j) {
      const int slot = c.slot;
      const uint32_t phase = c.phase;
      mbar_wait(&c.ring.full[slot], phase);
#if MK_WS_ALL
      const int wu = s * nt + j;  // the unit's stamps: 2 + 3 wu (ready), + 1 (part done), + 2 (epilogue done)
      const bool wsu = ws && wu < 8;
      if (wsu) warp_stamp_raw(p, layer, 2 + 3 * wu);
#endif
      if (!MK_WS_ALL && ws && j < 2) warp_stamp(p, layer, WS_O_UNIT + 4 * j);
      if (part < S) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        const int gi0 = __shfl_sync(0xffffffffu, gtab, part), gi1 = __shfl_sync(0xffffffffu, gtab, part + 1);
        if (!(p.dbg & 1) && !((MK_DIAG2 >> 6) & (1 << mi))) {
          tile_dot<M, I8>(mt.G, ring0 + (uint32_t)(slot * c.ring.slot_bytes), mt.srb, mt.kseg, gi0, gi1, xs, xstride, xlo,
                      xsum, lane, acc, grow);
        }
        if (!MK_WS_ALL && ws && j < 2) warp_stamp(p, layer, WS_O_UNIT + 4 * j + 1);
#if MK_WS_ALL
        if (wsu) warp_stamp_raw(p, layer, 3 + 3 * wu);
#endif
        float* pp = c.parts + slot * c.sl->pstride;
        float* pw = pp + part * TILE_ROWS * M;
        if (2 * tq < M) { pw[grow * M + 2 * tq] = acc[0]; pw[(grow + 8) * M + 2 * tq] = acc[2]; }
        if (2 * tq + 1 < M) { pw[grow * M + 2 * tq + 1] = acc[1]; pw[(grow + 8) * M + 2 * tq + 1] = acc[3]; }
        // hand-off through the slot's parts mbarrier (NCT arrivals per phase, release/acquire): every
        // lane of the S part warps arrives; the warp of part S-1 adds the missing arrivals, waits,
        // sums the parts in order (deterministic) and runs the tile's epilogue
        if (part == S - 1) {
          ring_arrive_n(&c.ring.parts[slot], (uint32_t)(NCW - (S - 1)), lane);
          mbar_wait(&c.ring.parts[slot], phase);
          if (!MK_WS_ALL && ws && j < 2) warp_stamp(p, layer, WS_O_UNIT + 4 * j + 2);
          tile_epilogue<M>(c, mi, layer, t0 + j, j, s, pp, S, lane, warp);
          __syncwarp();
          if (!MK_WS_ALL && ws && j < 2) warp_stamp(p, layer, WS_O_UNIT + 4 * j + 3);
#if MK_WS_ALL
          if (wsu) warp_stamp_raw(p, layer, 4 + 3 * wu);
#endif
        } else {
          ring_arrive(&c.ring.parts[slot], lane);
        }
      }
      ring_arrive(&c.ring.empty[slot], lane);  // (NCT arrivals per phase)
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
  if (ws) warp_stamp(p, layer, MK_WS_ALL ? 30 : WS_O_LOOP_END);
  cbar();  // all parts and epilogues done; the staged x may be overwritten
  if (ws) warp_stamp(p, layer, MK_WS_ALL ? 31 : WS_O_EXIT);
}

// FFN split-K: the tiles of a down slice that is ONE quantization group (kf == G): the
// staged x, its group sums and the offsets are the same for every tile, so a warp loads them once and
// per tile reads only its code words and (scale, min); two tiles per iteration (their loads first).
// Same arithmetic as mkmma::mma_tile_dot for one group (see mk_mma.cuh for the layouts); I8 (MK_IDOT,
// M <= 2): the same with mkmma::imma_tile_dot's x bytes, column scales and integer mma.
template <int WPL, int M, bool I8 = false>
__device__ __forceinline__ void ds_tiles_one_group(uint32_t sb, uint32_t tb, int srb, int kseg, int n, int i0,
                                                   uint32_t xs, int xstride, uint32_t xlo, uint32_t xsum, int lane,
                                                   float* dp0, size_t tstride, size_t mstride, float rm = 0.f,
                                                   int rot = 0) {
  using namespace mkmma;
  static_assert(!I8 || M <= 2, "hoisted integer slice dot: M <= 2");
  constexpr bool PACKED = 2 * M <= 8;
  constexpr int LB = M == 1 ? 1 : M == 2 ? 2 : 4;
  const int g = lane >> 2, t = lane & 3;
  const int row = !PACKED ? min(g, M - 1) : g < M ? g : (g >= LB && g < LB + M) ? M + g - LB : 0;
  // fp16: hi / lo chunks and the group's offsets; I8: the x bytes and the columns' (scale, min term)
  uint4 xh[WPL], xl[WPL], off;
  float2 eff;
  uint32_t magic;
  if constexpr (I8) {
    const uint32_t xa = xs + (uint32_t)(row * xstride + t * WPL * 8);
    if constexpr (WPL == 1) {
      asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(xh[0].x), "=r"(xh[0].y) : "r"(xa));
    } else {
      xh[0] = lds128(xa);
    }
    off = lds128(xsum + (uint32_t)(t * 16));
  } else {
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
  // the chunk's tile at position i (MK_FXRES = 2 at M = 1: rotated by rot, so the blocks on one chunk add to other
  // rows at a time)
  auto tix = [&](int i) -> int {
    if constexpr (kFx<M> && MK_FXRES == 2) return i + rot < n ? i + rot : i + rot - n;
    return i;
  };
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
#if MK_FX1 && MK_DS_EPI
  if constexpr (kFx<M> && !I8) {  // M = 1, fixed point: lanes t == 0 hold columns 0 (hi) and 1 (lo) of rows g, g + 8
    const float effs = eff.x + eff.y, kfx = rm * FX_SCALE;
    unsigned long long* const dq0 = reinterpret_cast<unsigned long long*>(dp0);  // row g of the chunk's tile 0
    for (int i = i0; i < n; i += 2 * NCW) {
      const bool two = i + NCW < n;
      uint32_t wa[2][WPL], wb[2][WPL], hs[2][2];
      load_pair(i, two, wa, wb, hs);
      [[maybe_unused]] float kv[2][2] = {{0.f, 0.f}, {0.f, 0.f}};  // MK_DS_RED4: lane (g, 0)'s values per tile
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
        if (MK_DS_RED4) {  // (the four values go out in one 32-lane add below)
          const float2 fa = __half22float2(*reinterpret_cast<const __half2*>(&hs[u][0]));
          const float2 fb = __half22float2(*reinterpret_cast<const __half2*>(&hs[u][1]));
          const float cg = (d0[0] + d1[0]) + (d0[1] + d1[1]), cg8 = (d0[2] + d1[2]) + (d0[3] + d1[3]);
          kv[u][0] = fmaf(fa.x, cg, fa.y * effs) * kfx;
          kv[u][1] = fmaf(fb.x, cg8, fb.y * effs) * kfx;
        } else if (t == 0) {
          const float2 fa = __half22float2(*reinterpret_cast<const __half2*>(&hs[u][0]));
          const float2 fb = __half22float2(*reinterpret_cast<const __half2*>(&hs[u][1]));
          const float cg = (d0[0] + d1[0]) + (d0[1] + d1[1]), cg8 = (d0[2] + d1[2]) + (d0[3] + d1[3]);
          unsigned long long* const dq = dq0 + (uint32_t)tix(u ? i + NCW : i) * (uint32_t)TILE_ROWS;
          const float v0 = fmaf(fa.x, cg, fa.y * effs) * kfx, v1 = fmaf(fb.x, cg8, fb.y * effs) * kfx;
          asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" ::"l"(dq),
                       "l"((unsigned long long)__float2ll_rn(v0) + FX_CNT)
                       : "memory");
          asm volatile("red.relaxed.gpu.global.add.u64 [%0+64], %1;" ::"l"(dq),
                       "l"((unsigned long long)__float2ll_rn(v1) + FX_CNT)
                       : "memory");
        }
      }
      if (MK_DS_RED4) {  // lane (g, t): tile t >> 1, row g + 8 (t & 1), from lane (g, 0)
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
#endif
  for (int i = i0; i < n; i += 2 * NCW) {
    const bool two = i + NCW < n;
    uint32_t wa[2][WPL], wb[2][WPL], hs[2][2];
    load_pair(i, two, wa, wb, hs);
    [[maybe_unused]] float keep[2][2] = {{0.f, 0.f}, {0.f, 0.f}};  // MK_DS_RED4: lane (g, 0)'s rows g, g + 8 per tile
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      if (u && !two) break;
      float acc[4];
      if constexpr (I8) {
        const uint32_t xb[4] = {xh[0].x, xh[0].y, xh[0].z, xh[0].w};  // bytes of word c: xb[2c], xb[2c + 1]
        int d[4] = {0, 0, 0, 0};
#pragma unroll
        for (int c = 0; c < WPL; ++c)
          imma_16832(d, wa[u][c] & 0x0F0F0F0Fu, wb[u][c] & 0x0F0F0F0Fu, (wa[u][c] >> 4) & 0x0F0F0F0Fu,
                     (wb[u][c] >> 4) & 0x0F0F0F0Fu, xb[2 * c], xb[2 * c + 1]);
        const float2 fa = __half22float2(*reinterpret_cast<const __half2*>(&hs[u][0]));
        const float2 fb = __half22float2(*reinterpret_cast<const __half2*>(&hs[u][1]));
        const float c0 = __uint_as_float(off.x), c1 = __uint_as_float(off.y);
        const float m0 = __uint_as_float(off.z), m1 = __uint_as_float(off.w);
        acc[0] = fmaf(__int2float_rn(d[0]), fa.x * c0, fa.y * m0);
        acc[1] = fmaf(__int2float_rn(d[1]), fa.x * c1, fa.y * m1);
        acc[2] = fmaf(__int2float_rn(d[2]), fb.x * c0, fb.y * m0);
        acc[3] = fmaf(__int2float_rn(d[3]), fb.x * c1, fb.y * m1);
      } else {
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
        if (MK_DIAG2 & 16) acc[0] = acc[1] = acc[2] = acc[3] = 0.f;  // the adds kept, the dot dropped
      }
      if constexpr (PACKED) fold_lo_columns<M>(acc);
#if MK_FX1  // kFx: dp0 is the fixed-point residual's row g of the chunk's first tile (tstride 16, mstride: Hp)
      if constexpr (kFx<M> && M == 1 && MK_DS_RED4) {
        keep[u][0] = rm * acc[0];
        keep[u][1] = rm * acc[2];
      } else if constexpr (kFx<M>) {
      unsigned long long* dq = reinterpret_cast<unsigned long long*>(dp0) + (size_t)tix(u ? i + NCW : i) * tstride;
      if (2 * t < M) { fx_red(dq + 2 * t * mstride, rm * acc[0]); fx_red(dq + 2 * t * mstride + 8, rm * acc[2]); }
      if (2 * t + 1 < M) {
        fx_red(dq + (2 * t + 1) * mstride, rm * acc[1]);
        fx_red(dq + (2 * t + 1) * mstride + 8, rm * acc[3]);
      }
      } else
#endif
      {
      float* dp = dp0 + (size_t)(u ? i + NCW : i) * tstride;
      if (2 * t < M) { dp[2 * t * mstride] = acc[0]; dp[2 * t * mstride + 8] = acc[2]; }
      if (2 * t + 1 < M) { dp[(2 * t + 1) * mstride] = acc[1]; dp[(2 * t + 1) * mstride + 8] = acc[3]; }
      }
    }
#if MK_FX1
    if constexpr (kFx<M> && M == 1 && MK_DS_RED4) {  // one 32-lane add: lane (g, t) takes tile t >> 1, row g + 8 (t & 1)
      const int src = lane & ~3;
      const float v00 = __shfl_sync(0xffffffffu, keep[0][0], src), v01 = __shfl_sync(0xffffffffu, keep[0][1], src);
      const float v10 = __shfl_sync(0xffffffffu, keep[1][0], src), v11 = __shfl_sync(0xffffffffu, keep[1][1], src);
      const int u = t >> 1;
      if (u == 0 || two) {
        const float v = t == 0 ? v00 : t == 1 ? v01 : t == 2 ? v10 : v11;
        unsigned long long* dq =
            reinterpret_cast<unsigned long long*>(dp0) + (size_t)tix(u ? i + NCW : i) * tstride + 8 * (t & 1);
        fx_red(dq, v);
      }
    }
#endif
  }
}

// FFN split-K, part 1 (in the gate|up stage, after its epilogues): FFN block f stages its own act
// slice [f kf, (f + 1) kf) from shared memory (its gate|up epilogues wrote it there, not to global
// memory: 5e, −0.3% against staging it from L2), then every warp takes whole row tiles of down's slice f (one K range, no K parts, no reducer) and
// writes their 16 x M partial sums to dpart[m][tile][f][16]. Every warp waits for every chunk and
// arrives on its empty barrier, as in matvec_stage (the ring's parity protocol), and on its parts
// barrier (without that arrival the slot's parts phases fall a lap behind and the next matvec stage's
// parity wait on it passes early or never: the first GPU run of this stage hung).
#if MK_WS_RING
#define DP_STAMP(k) warp_stamp_raw(p, layer, (k))
#else
#define DP_STAMP(k)
#endif
template <int M>
__device__ void ffn_down_partial(Ctx<M>& c, int layer) {
  const Params& p = *c.p;
  const Mat& mt = p.mat[MAT_DS];
  const int nt = c.misc->tile1[MAT_DS];  // all H row tiles, or 0 (blocks >= nffn)
  if (nt == 0) return;                   // block-uniform
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int f = blockIdx.x;
  DP_STAMP(0);
  stage_x<M, true, false, false, kI8<M>(MAT_DS)>(c, c.misc->rows[ROW_ACTB], 1.f, nullptr, 0, mt.K, mt.G, mt.gshift);  // ends with a block barrier
  DP_STAMP(1);
  const int cpt = c.sl->ds_cpt, ng = mt.kseg >> mt.gshift;
  const int xstride = c.sl->xstride;
  const uint32_t xlo = (uint32_t)(M * xstride);
  const uint32_t ring0 = smem_u32(c.ring.slots);
  const uint32_t tb = (uint32_t)(TILE_ROWS * mt.srb);
  const int gq = lane >> 2, tq = lane & 3;
  const size_t mstride = (size_t)mt.ntiles * p.nffn_pad * TILE_ROWS;
  float* dpf = p.dpart + (size_t)f * TILE_ROWS + gq;
#if MK_DS_RR && !MK_FX1  // (MK_FXRES computes the rotation from t itself)
  const int cpt15 = cpt % NCW;  // tile t + i of the slice goes to warp (t + i) mod 15; rot = t mod 15
  int rot = 0;
#endif
#if MK_FX1
  const int nch = (nt + cpt - 1) / cpt, ch0 = kFx<M> && MK_DS_ROT ? f % nch : 0;  // (the producer's order: produce_slice)
  for (int ci = 0; ci < nch; ++ci) {
    const int t = (ci + ch0 < nch ? ci + ch0 : ci + ch0 - nch) * cpt;
    int i0 = warp >= t % NCW ? warp - t % NCW : warp - t % NCW + NCW;  // tile t + i to warp (t + i) mod 15
    // (MK_OHEAD: D[layer & 1]; else the residual X itself)
    unsigned long long* fxr = fx_buf(p, MK_OH1 && p.ohead ? FXB_D + (layer & 1) : FXB_X) + (size_t)t * TILE_ROWS + gq;
    if (MK_DIAG2 & 4096)  // DIAGNOSTIC: private rows per block (wrong answers)
      fxr = reinterpret_cast<unsigned long long*>(p.dpart) + (size_t)f * fx_stride(p) + (size_t)t * TILE_ROWS + gq;
    const size_t fxs = (size_t)fx_stride(p);
#else
  for (int t = 0; t < nt; t += cpt) {
    int i0 = warp;  // this warp's first tile of the chunk
#if MK_DS_RR
    i0 = warp >= rot ? warp - rot : warp - rot + NCW;
    if ((rot += cpt15) >= NCW) rot -= NCW;
#endif
#endif
    if (t < 8 * cpt) DP_STAMP(2 + 2 * (t / cpt));
    mbar_wait(&c.ring.full[c.slot], c.phase);
    if (t < 8 * cpt) DP_STAMP(3 + 2 * (t / cpt));
    const int n = min(cpt, nt - t);
    const uint32_t sb = ring0 + (uint32_t)(c.slot * c.ring.slot_bytes);
    // (hoisted only where the registers allow: M <= 2 and G <= 64; else the generic tile dot)
    if (MK_DIAG2 & 2) {
    } else if (M <= 2 && ng == 1 && mt.G <= 64) {
#if MK_FX1
      float* dp0 = kFx<M> ? reinterpret_cast<float*>(fxr) : dpf + (size_t)t * p.nffn_pad * TILE_ROWS;
      const size_t ts = kFx<M> ? (size_t)TILE_ROWS : (size_t)p.nffn_pad * TILE_ROWS, ms = kFx<M> ? fxs : mstride;
#else
      float* dp0 = dpf + (size_t)t * p.nffn_pad * TILE_ROWS;
      const size_t ts = (size_t)p.nffn_pad * TILE_ROWS, ms = mstride;
#endif
      if constexpr (M <= 2) {
        constexpr bool I8 = kI8<M>(MAT_DS);
        if (mt.G == 64)
          ds_tiles_one_group<2, M, I8>(sb, tb, mt.srb, mt.kseg, n, i0, c.xs, xstride, xlo, c.xsum, lane, dp0, ts,
                                       ms, p.res_mult, kFx<M> ? f % n : 0);
        else
          ds_tiles_one_group<1, M, I8>(sb, tb, mt.srb, mt.kseg, n, i0, c.xs, xstride, xlo, c.xsum, lane, dp0, ts,
                                       ms, p.res_mult, kFx<M> ? f % n : 0);
      }
    } else
    for (int i = i0; i < n; i += NCW) {
      float acc[4];
      tile_dot<M, kI8<M>(MAT_DS)>(mt.G, sb + (uint32_t)i * tb, mt.srb, mt.kseg, 0, ng, c.xs, xstride, xlo, c.xsum, lane, acc);
#if MK_FX1
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
      } else
#endif
      {
      float* dp = dpf + (size_t)(t + i) * p.nffn_pad * TILE_ROWS;
      if (2 * tq < M) { dp[2 * tq * mstride] = acc[0]; dp[2 * tq * mstride + 8] = acc[2]; }
      if (2 * tq + 1 < M) { dp[(2 * tq + 1) * mstride] = acc[1]; dp[(2 * tq + 1) * mstride + 8] = acc[3]; }
      }
    }
    // every lane, on the slot's parts barrier too: its phases must follow the ring's laps (matvec_stage
    // waits on it with the lap parity), so a lap of the slot without K parts still completes one
    ring_arrive(&c.ring.parts[c.slot], lane);
    ring_arrive(&c.ring.empty[c.slot], lane);  // (NCT arrivals per phase)
    if (++c.slot == c.ring.nslots) {
      c.slot = 0;
      c.phase ^= 1u;
    }
  }
  DP_STAMP(20);
  // (traced builds only: a block barrier, so that the stamp after this stage is the block's end, not thread 0's warp's;
  // the grid barrier that follows starts with the same block barrier. Session 15, 15k)
  if (MK_TRACE) cbar();
}

// FFN split-K, part 2 (after the grid barrier; replaces the down stage): the block's own residual rows
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

// =====================================================================[7] attention
// MK_TMERGE: row t's (m, l) per split s in wt[2 (t TM_MAX_SPLITS + s)] (+ 1) -> each split's weight exp(m_s - max)
// in place of m_s; returns the denominator sum_s w_s l_s (fixed order)
__device__ __forceinline__ float tm_weights(float* wt, int t, int nsplit) {
  float mx = -INFINITY, den = 0.f;
  for (int s2 = 0; s2 < nsplit; ++s2) mx = fmaxf(mx, wt[2 * (t * TM_MAX_SPLITS + s2)]);
  for (int s2 = 0; s2 < nsplit; ++s2) {
    const float m2 = wt[2 * (t * TM_MAX_SPLITS + s2)];
    const float w2 = m2 == -INFINITY ? 0.f : expf(m2 - mx);
    wt[2 * (t * TM_MAX_SPLITS + s2)] = w2;
    den = fmaf(w2, wt[2 * (t * TM_MAX_SPLITS + s2) + 1], den);
  }
  return den;
}

// MK_TM_FAST (on since v14, session 13; session 11's two calls, -2.3% and +0.6% at M = 1, could not resolve it, and the
// traced tail after the (m, l) pairs stayed 0.92 us: docs 11h; bench/mk_ab1.py: -0.6%, 24/30 rounds faster: docs 13b): the MK_TMERGE merger's tail shortened. Session 11's trace of the merging
// block (bench/results/mk_warps_session11_v13_2026-11-30.log): every split's o words seen at 5.1 us after entry, the
// (m, l) pairs in shared memory at 5.76 (two dependent tagged loads: two round trips), the output written at 6.72 (a
// serial pass of R threads over the splits' weights, then a block barrier). Here each (m, l) pair is one 16-byte
// load, and every output thread computes its row's weights itself, unrolled (the same arithmetic in the same order:
// bitwise the same output).
#ifndef MK_TM_FAST
#define MK_TM_FAST 1
#endif
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
  if (MK_TM_CAP && M <= MK_TMERGE) nsplit = min(nsplit, TM_MAX_SPLITS);  // (the tagged merge: at most 12 splits)
  const int tps = (ntiles + nsplit - 1) / nsplit;
  nsplit = (ntiles + tps - 1) / tps;
  const int nitems = p.nkv * nsplit;
  const uint32_t qtag = c.tag0 + (uint32_t)layer;  // MK_QTAG: this layer's tag
  const int cpr = D / 8;  // 16-byte chunks per K/V row

  __half* Kb = reinterpret_cast<__half*>(uni);              // [2][ATT_T][D] (swizzled 16B chunks)
  __half* Vb = Kb + 2 * ATT_T * D;                          // [2][ATT_T][D]
  float* q_s = reinterpret_cast<float*>(Vb + 2 * ATT_T * D); // [R][D]
  float* o_s = q_s + R * D;                                 // [R][D]
  float* s_s = o_s + R * D;                                 // [R][ATT_T]
  MiscSmem* ms = c.misc;

#if MK_ATT_ROT  // (a diagnostic of session 17: item i runs on block (i + MK_ATT_ROT) mod grid)
  for (int item = ((int)blockIdx.x + (int)gridDim.x - MK_ATT_ROT % (int)gridDim.x) % (int)gridDim.x; item < nitems;
       item += gridDim.x) {
#else
  for (int item = blockIdx.x; item < nitems; item += gridDim.x) {
#endif
    warp_stamp(p, layer, WS_A_ENTER);
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
        if (MK_QTAG && j0 + j >= start && j0 + j < Ltot) {  // this step's row: from the tagged words
          const int m = j0 + j - start;
          float4 a, b;
          ld_tagged8(qkv_word(p, m, (p.nh + isv * p.nkv + kvh) * D + ch * 8), qtag, a, b);
          const __half2 hv[4] = {__floats2half2_rn(a.x, a.y), __floats2half2_rn(a.z, a.w), __floats2half2_rn(b.x, b.y),
                                 __floats2half2_rn(b.z, b.w)};
          const uint32_t* h = reinterpret_cast<const uint32_t*>(hv);
          __half* dst = isv ? Vb + ((size_t)buf * ATT_T + j) * D + ch * 8
                            : Kb + ((size_t)buf * ATT_T + j) * D + ((ch ^ (j & 7)) * 8);
          *reinterpret_cast<uint4*>(dst) = make_uint4(h[0], h[1], h[2], h[3]);
        } else if (j0 + j < Ltot) {
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
      q_s[i] = (MK_QTAG ? ld_tagged(qkv_word(p, m, hq * D + d), qtag)
                        : __ldcg(p.q + (size_t)m * p.nh * D + hq * D + d)) * p.attn_scale;
      o_s[i] = 0.f;
    }
    if (t < R) { ms->att_m[t] = -INFINITY; ms->att_l[t] = 0.f; }
    warp_stamp(p, layer, WS_A_Q);
#if MK_ATT_W3
    if (M == 1 && D == 64 && 3 * R <= NCW && t1 - t0 == 1) {
      cp_async_wait<0>();
      cbar();  // the tile and q_s are in
      warp_stamp(p, layer, WS_A_TILE);
      const int nvalid = min(ATT_T, Ltot - t0 * ATT_T);
      float* scr = reinterpret_cast<float*>(Kb + (size_t)ATT_T * D);  // [3 R][D + 2]: (m, l, o[D]) per warp
      if (warp < 3 * R) {
        const int r = warp / 3, kc = warp - 3 * r;
        const int ja = kc * nvalid / 3, cnt = (kc + 1) * nvalid / 3 - ja;
        const int j = ja + lane;
        float sc = -INFINITY;
        // (the score loop repeats the general path's below; one shared inline helper gave the same bits but other
        // schedules, M = 2 0.3% slower in 19/20 rounds: bench/results/mk_ab1_session14_2026-11-30.md, k)
        if (MK_DIAG == 3) {  // (DIAGNOSTIC: W3's arithmetic skipped, its reductions and merge kept)
          if (lane < cnt && t0 * ATT_T + j <= start) sc = 0.f;
        } else if (lane < cnt && t0 * ATT_T + j <= start) {
          const float* qr = q_s + r * D;
          float a0 = 0.f, a1 = 0.f;
#pragma unroll
          for (int ch = 0; ch < 8; ++ch) {
            const uint4 kk = *reinterpret_cast<const uint4*>(Kb + (size_t)j * D + ((ch ^ (j & 7)) * 8));
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
          sc = a0 + a1;
        }
        const float mx = warp_max(sc);
        const float pj = mx == -INFINITY ? 0.f : expf(sc - mx);
        const float ls = warp_sum(pj);
        float px = 0.f, py = 0.f;  // lane = dim pair
#if MK_W3_PV4
#pragma unroll 4
#endif
        for (int jj = 0; jj < (MK_DIAG == 3 ? 0 : cnt); ++jj) {
          const float pv = __shfl_sync(0xffffffffu, pj, jj);
          const float2 vv = __half22float2(*reinterpret_cast<const __half2*>(Vb + (size_t)(ja + jj) * D + 2 * lane));
          px = fmaf(pv, vv.x, px);
          py = fmaf(pv, vv.y, py);
        }
        float* pw = scr + warp * (D + 2);
        *reinterpret_cast<float2*>(pw + 2 + 2 * lane) = make_float2(px, py);
        if (lane == 0) { pw[0] = mx; pw[1] = ls; }
      }
      cbar();
      warp_stamp(p, layer, WS_A_SCORES);
      if (t < R * D) {  // the row's three partials, in order
        const int r = t / D, d = t - r * D;
        const float* pr = scr + 3 * r * (D + 2);
        const float mn = fmaxf(fmaxf(pr[0], pr[D + 2]), pr[2 * (D + 2)]);
        float o = 0.f, l = 0.f;
        if (mn != -INFINITY) {
#pragma unroll
          for (int kc = 0; kc < 3; ++kc) {
            const float* pk = pr + kc * (D + 2);
            const float w = pk[0] == -INFINITY ? 0.f : expf(pk[0] - mn);
            o = fmaf(w, pk[2 + d], o);
            l = fmaf(w, pk[1], l);
          }
        }
        o_s[t] = o;
        if (d == 0) { ms->att_m[r] = mn; ms->att_l[r] = l; }
      }
      cbar();
      warp_stamp(p, layer, WS_A_PV);
    } else
#endif
    for (int tile = t0; tile < t1; ++tile) {
      const int buf = (tile - t0) & 1;
      if (tile + 1 < t1) { load_tile(tile + 1, buf ^ 1); cp_async_wait<1>(); }
      else cp_async_wait<0>();
      cbar();
      warp_stamp(p, layer, WS_A_TILE);
      const int j0 = tile * ATT_T;
      const int nvalid = min(ATT_T, Ltot - j0);
      const __half* Kt = Kb + (size_t)buf * ATT_T * D;
      const __half* Vt = Vb + (size_t)buf * ATT_T * D;
      // scores: lanes over keys, warps over (row, key half)
      for (int task = warp; task < (MK_DIAG == 3 ? 0 : R * 2); task += NCW) {
        const int r = task >> 1, j = (task & 1) * 32 + lane;
        const int m = r % M;
        float s = -INFINITY;
        if (j < nvalid && j0 + j <= start + m) {
          const float* qr = q_s + r * D;
          float a0 = 0.f, a1 = 0.f;
#pragma unroll 8
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
      warp_stamp(p, layer, WS_A_SCORES);
      // online softmax statistics: warp per row
      for (int r = warp; r < (MK_DIAG == 3 ? 0 : R); r += NCW) {
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
        __syncwarp();  // every lane has read att_m[r] before lane 0 overwrites it
        if (lane == 0) {
          ms->att_l[r] = ms->att_l[r] * alpha + ps;
          ms->att_m[r] = mn;
          ms->att_alpha[r] = alpha;
        }
      }
      cbar();
      warp_stamp(p, layer, WS_A_SOFTMAX);
      // o = o * alpha + P V: warp per row, lanes over dim pairs
      if (MK_PV3 && M == 1 && 3 * R <= NCW && D == 64) {
        // MK_PV3: three warps per row, each over a third of the keys; their sums join o in a fixed order
        // (o * alpha + part 0, then + part 1, then + part 2: one block barrier between, deterministic)
        const int r = warp / 3, kc = warp - 3 * r;
        const bool act = MK_DIAG != 3 && warp < 3 * R;
        const int ja = kc * nvalid / 3, jb = (kc + 1) * nvalid / 3;
        float px = 0.f, py = 0.f;  // lane = dim pair (D = 64)
        if (act) {
          const float* pr = s_s + r * ATT_T;
#pragma unroll 2
          for (int j = ja; j < jb; ++j) {
            const float pj = pr[j];
            const float2 vv = __half22float2(*reinterpret_cast<const __half2*>(Vt + (size_t)j * D + 2 * lane));
            px = fmaf(pj, vv.x, px);
            py = fmaf(pj, vv.y, py);
          }
        }
        for (int ph = 0; ph < 3; ++ph) {
          if (act && kc == ph) {
            const float alpha = ph == 0 ? ms->att_alpha[r] : 1.f;
            o_s[r * D + 2 * lane] = fmaf(o_s[r * D + 2 * lane], alpha, px);
            o_s[r * D + 2 * lane + 1] = fmaf(o_s[r * D + 2 * lane + 1], alpha, py);
          }
          if (ph < 2) cbar();
        }
      } else
      for (int r = warp; r < (MK_DIAG == 3 ? 0 : R); r += NCW) {
        const float alpha = ms->att_alpha[r];
        const float* pr = s_s + r * ATT_T;
        for (int d2 = lane; d2 < D / 2; d2 += 32) {
          float ox = o_s[r * D + 2 * d2] * alpha, oy = o_s[r * D + 2 * d2 + 1] * alpha;
#pragma unroll 4
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
      warp_stamp(p, layer, WS_A_PV);
    }
    // write the result (one split) or the partial (m, l, o) for the merge
    if (nsplit == 1) {
      for (int i = t; i < R * D; i += NCT) {
        const int r = i / D, d = i - r * D;
        const int hq = kvh * g + r / M, m = r % M;
        attn_out(p, m, hq * D + d, o_s[i] / ms->att_l[r], qtag);
      }
#if MK_TM_SEQ
    } else if (M <= MK_TMERGE && nsplit > TM_MAX_SPLITS && nsplit <= TM_SEQ_SPLITS && R * D <= NCT &&
               2 * R * TM_SEQ_SPLITS <= R * ATT_T) {
      // MK_TM_SEQ: more splits than the register merge holds: the (m, l) pairs first, then every output thread polls
      // and weighs the splits' o words 8 at a time (in flight together), in split order (deterministic). Its hand-over
      // loop and its 16-byte (m, l) poll repeat MK_TMERGE's below: as shared inline helpers they compile to other
      // register assignments in the validated v17 kernel (session 15's review), so they wait for the next validation
      uint32_t* tk = reinterpret_cast<uint32_t*>(p.part) + 2 * ((size_t)kvh * nsplit * R) * (D + 2);
      if (sp != 0) {
        uint32_t* tp = tk + 2 * ((size_t)sp * R) * (D + 2);
        for (int i = t; i < R * (D + 2); i += NCT) {
          const int r = i / (D + 2), d = i - r * (D + 2);
          st_tagged(tp + 2 * i, d == 0 ? ms->att_m[r] : d == 1 ? ms->att_l[r] : o_s[r * D + d - 2], qtag);
        }
      } else {
        float* wt = s_s;  // [R][TM_SEQ_SPLITS] (m, l)
        for (int i = t; i < R * nsplit; i += NCT) {
          const int rr = i / nsplit, s2 = i - rr * nsplit;
          float mv, lv;
          if (s2 == 0) {
            mv = ms->att_m[rr];
            lv = ms->att_l[rr];
          } else {
            const uint32_t* e = tk + 2 * (((size_t)s2 * R + rr) * (D + 2));
            uint4 u;
            do {
              asm volatile("ld.relaxed.gpu.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                           : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w) : "l"(e) : "memory");
            } while (u.y != qtag || u.w != qtag);
            mv = __uint_as_float(u.x);
            lv = __uint_as_float(u.z);
          }
          wt[2 * (rr * TM_SEQ_SPLITS + s2)] = mv;
          wt[2 * (rr * TM_SEQ_SPLITS + s2) + 1] = lv;
        }
        cbar();
        // the split weights once per (row, split), in q_s (free after the scores; since v20, session 17: each output
        // thread computed all of them before, 16 expf at ctx 2048)
        float* w1 = q_s;  // [R][TM_SEQ_SPLITS]
        for (int i = t; i < R * nsplit; i += NCT) {
          const int rr = i / nsplit, s2 = i - rr * nsplit;
          const float* wr = wt + 2 * rr * TM_SEQ_SPLITS;
          float mx = -INFINITY;
          for (int k = 0; k < nsplit; ++k) mx = fmaxf(mx, wr[2 * k]);
          const float m2 = wr[2 * s2];
          w1[rr * TM_SEQ_SPLITS + s2] = m2 == -INFINITY ? 0.f : expf(m2 - mx);
        }
        cbar();
        if (t < R * D) {
          const int r = t / D, d = t - r * D;
          const float* wr = wt + 2 * r * TM_SEQ_SPLITS;
          float num = 0.f, den = 0.f;
          for (int s0 = 0; s0 < nsplit; s0 += 8) {
            float ov[8];
            bool ok;
            do {  // the batch's 8 words in flight together, re-polled until every tag is this layer's
              uint32_t tg[8];
#pragma unroll
              for (int k = 0; k < 8; ++k) {
                const int s2 = s0 + k;
                uint32_t v = 0u;
                tg[k] = qtag;
                if (s2 > 0 && s2 < nsplit)
                  asm volatile("ld.relaxed.gpu.global.v2.u32 {%0, %1}, [%2];"
                               : "=r"(v), "=r"(tg[k]) : "l"(tk + 2 * (((size_t)s2 * R + r) * (D + 2) + 2 + d)) : "memory");
                ov[k] = s2 == 0 ? o_s[t] : __uint_as_float(v);
              }
              ok = true;
#pragma unroll
              for (int k = 0; k < 8; ++k) ok = ok && tg[k] == qtag;
            } while (!ok);
#pragma unroll
            for (int k = 0; k < 8; ++k) {
              const int s2 = s0 + k;
              if (s2 < nsplit) {
                const float w2 = w1[r * TM_SEQ_SPLITS + s2];
                den = fmaf(w2, wr[2 * s2 + 1], den);
                num = fmaf(w2, ov[k], num);
              }
            }
          }
          const int hq = kvh * g + r / M, m = r % M;
          attn_out(p, m, hq * D + d, num / den, qtag);
        }
      }
#endif
    } else if (M <= MK_TMERGE && nsplit <= TM_MAX_SPLITS && R * D <= NCT && R * nsplit <= NCT) {
      uint32_t* tk = reinterpret_cast<uint32_t*>(p.part) + 2 * ((size_t)kvh * nsplit * R) * (D + 2);
      if (sp != 0) {  // hand the partial over: one tagged word per value
        uint32_t* tp = tk + 2 * ((size_t)sp * R) * (D + 2);
        for (int i = t; i < R * (D + 2); i += NCT) {
          const int r = i / (D + 2), d = i - r * (D + 2);
          st_tagged(tp + 2 * i, d == 0 ? ms->att_m[r] : d == 1 ? ms->att_l[r] : o_s[r * D + d - 2], qtag);
        }
        warp_stamp(p, layer, WS_A_PART);  // (MK_TMERGE: the partial's stores issued)
      } else {  // split 0's block merges: its own partial from shared memory, the others' as they arrive
        const int r = t / D, d = t - r * D;
        float ov[TM_MAX_SPLITS];
        if (MK_TM_INIT) {  // (see the macro: defined registers before the predicated loads)
#pragma unroll
          for (int s2 = 0; s2 < TM_MAX_SPLITS; ++s2) ov[s2] = 0.f;
        }
        if (t < R * D) {
          bool ok;
          do {  // every split's word in flight at once, re-polled until all carry this layer's tag
            uint32_t tg[TM_MAX_SPLITS];
            if (MK_TM_INIT) {
#pragma unroll
              for (int s2 = 0; s2 < TM_MAX_SPLITS; ++s2) tg[s2] = 0u;
            }
#pragma unroll
            for (int s2 = 1; s2 < TM_MAX_SPLITS; ++s2) {
              if (s2 < nsplit) {
                uint32_t v;
                asm volatile("ld.relaxed.gpu.global.v2.u32 {%0, %1}, [%2];"
                             : "=r"(v), "=r"(tg[s2]) : "l"(tk + 2 * (((size_t)s2 * R + r) * (D + 2) + 2 + d)) : "memory");
                ov[s2] = __uint_as_float(v);
              }
            }
            ok = true;
#pragma unroll
            for (int s2 = 1; s2 < TM_MAX_SPLITS; ++s2) ok = ok && (s2 >= nsplit || tg[s2] == qtag);
          } while (!ok);
          ov[0] = o_s[t];
        }
        warp_stamp(p, layer, WS_A_PART);  // (MK_TMERGE merger: every split's o words seen by this warp)
        float* wt = s_s;  // [R][TM_MAX_SPLITS] (m, l) then (weight, l); s_s (R x ATT_T floats) is free now
        if (t < R * nsplit) {
          const int rr = t / nsplit, s2 = t - rr * nsplit;
          float mv, lv;
          if (s2 == 0) {
            mv = ms->att_m[rr];
            lv = ms->att_l[rr];
          } else {
            const uint32_t* e = tk + 2 * (((size_t)s2 * R + rr) * (D + 2));
            if (MK_TM_FAST) {  // (m, tag), (l, tag): one 16-byte load (16-byte aligned: rows of D + 2 = 66 words)
              uint4 u;
              do {
                asm volatile("ld.relaxed.gpu.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                             : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w) : "l"(e) : "memory");
              } while (u.y != qtag || u.w != qtag);
              mv = __uint_as_float(u.x);
              lv = __uint_as_float(u.z);
            } else {
              mv = ld_tagged(e, qtag);
              lv = ld_tagged(e + 2, qtag);
            }
          }
          wt[2 * (rr * TM_MAX_SPLITS + s2)] = mv;
          wt[2 * (rr * TM_MAX_SPLITS + s2) + 1] = lv;
        }
        cbar();
        warp_stamp(p, layer, WS_A_COUNT);  // (MK_TMERGE merger: every (m, l) in shared memory)
        if (MK_TM_FAST) {
          // each split's weight once per (row, split) (R x nsplit threads), then the output threads only sum (since v20,
          // session 17: before, each of a row's D output threads computed all its weights, 9 expf at ctx 512; -1.1%)
          float* w1 = wt + 2 * R * TM_MAX_SPLITS;  // [R][TM_MAX_SPLITS] (s_s holds R x ATT_T floats)
          if (t < R * nsplit) {
            const int rr = t / nsplit, s2 = t - rr * nsplit;
            const float* wr = wt + 2 * rr * TM_MAX_SPLITS;
            float mx = -INFINITY;
#pragma unroll
            for (int k = 0; k < TM_MAX_SPLITS; ++k)
              if (k < nsplit) mx = fmaxf(mx, wr[2 * k]);
            const float m2 = wr[2 * s2];
            w1[rr * TM_MAX_SPLITS + s2] = m2 == -INFINITY ? 0.f : expf(m2 - mx);
          }
          cbar();
          if (t < R * D) {
            const float* wr = wt + 2 * r * TM_MAX_SPLITS;
            const float* wv = w1 + r * TM_MAX_SPLITS;
            float num = 0.f, den = 0.f;
#pragma unroll
            for (int s2 = 0; s2 < TM_MAX_SPLITS; ++s2)
              if (s2 < nsplit) {
                const float w2 = wv[s2];
                den = fmaf(w2, wr[2 * s2 + 1], den);
                num = fmaf(w2, ov[s2], num);
              }
            const int hq = kvh * g + r / M, m = r % M;
            attn_out(p, m, hq * D + d, num / den, qtag);
          }
        } else {
        if (t < R) ms->att_alpha[t] = tm_weights(wt, t, nsplit);
        cbar();
        if (t < R * D) {
          float num = 0.f;
#pragma unroll
          for (int s2 = 0; s2 < TM_MAX_SPLITS; ++s2)
            if (s2 < nsplit) num = fmaf(wt[2 * (r * TM_MAX_SPLITS + s2)], ov[s2], num);
          const int hq = kvh * g + r / M, m = r % M;
          attn_out(p, m, hq * D + d, num / ms->att_alpha[r], qtag);
        }
        }
      }
    } else {
      float* pp = p.part + ((size_t)(kvh * nsplit + sp) * R) * (D + 2);
      for (int i = t; i < R * (D + 2); i += NCT) {
        const int r = i / (D + 2), d = i - r * (D + 2);
        pp[i] = d == 0 ? ms->att_m[r] : d == 1 ? ms->att_l[r] : o_s[r * D + d - 2];
      }
      cbar();
      warp_stamp(p, layer, WS_A_PART);
      if (MK_DIAG == 1) continue;  // (at most one item per block: nitems <= nblocks)
      if (t == 0) {
        __threadfence();
        const int old = atomicAdd(p.att_count + kvh, 1);
        ms->flag = (old == nsplit - 1);
        if (ms->flag) __threadfence();
      }
      cbar();
      warp_stamp(p, layer, WS_A_COUNT);
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
          attn_out(p, m, hq * D + d, num / den, qtag);
        }
        if (t == 0) p.att_count[kvh] = 0;
      }
    }
    warp_stamp(p, layer, WS_A_MERGE);
    cbar();
    warp_stamp(p, layer, WS_A_EXIT);
  }
}

#if MK_OH1
// MK_OHEAD (M = 1): block b = h B + j polls kv head h's attention output (its q heads' gq x D tagged words), stages it
// as gq groups of D, dots its T row tiles of each q head's o column slice (one ring unit per slice, producer order:
// produce_oslices), sums the gq slices per row in order in registers (deterministic) and adds res_mult x the sum into
// O[layer & 1] (red.global.add.u64 of fixed point). Every warp passes every unit (the ring's parity protocol) and
// arrives on its parts barrier too, as ffn_down_partial does. Warp w < T owns tile w (T <= 15: the host checks).
template <int M>
__device__ void o_head_stage(Ctx<M>& c, int layer, const float* const* attn_rows) {
  const Params& p = *c.p;
  const int B = p.ohead, h = (int)blockIdx.x / B, j = (int)blockIdx.x - h * B;
  if (h >= p.nkv) return;  // block-uniform: no o work, no ring units
  const Mat& mt = p.mat[MAT_D];
  const int gq = p.nh / p.nkv, T = mt.ntiles / B;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gr = lane >> 2, tq = lane & 3;
  cbar();  // the staged x shares its shared memory with attention's tiles (the grid barrier after attention did this)
  stage_x<M, false, true>(c, attn_rows, 1.f, nullptr, h * gq * p.D, gq * p.D, mt.G, mt.gshift, attn_word(p, 0, 0),
                          p.nh * p.D, c.tag0 + (uint32_t)layer);  // (ends with a block barrier)
  const uint32_t ring0 = smem_u32(c.ring.slots), tb = (uint32_t)(TILE_ROWS * mt.srb);
  const uint32_t xlo = (uint32_t)(M * c.sl->xstride);
  float racc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int qh = 0; qh < gq; ++qh) {
    mbar_wait(&c.ring.full[c.slot], c.phase);
    if (warp < T) {
      float acc[4];
      tile_dot<M>(mt.G, ring0 + (uint32_t)(c.slot * c.ring.slot_bytes) + (uint32_t)warp * tb, mt.srb, mt.kseg, 0, 1,
                  c.xs + (uint32_t)(qh * mt.G * 2), c.sl->xstride, xlo,
                  c.xsum + (uint32_t)(qh * mkmma::MMA_XSUM_FLOATS * 4), lane, acc);
#pragma unroll
      for (int i = 0; i < 4; ++i) racc[i] += acc[i];
    }
    ring_arrive(&c.ring.parts[c.slot], lane);
    ring_arrive(&c.ring.empty[c.slot], lane);
    if (++c.slot == c.ring.nslots) {
      c.slot = 0;
      c.phase ^= 1u;
    }
  }
  if (warp < T && tq == 0) {  // M = 1: lanes tq = 0 hold token 0's rows gr and gr + 8
    unsigned long long* o = fx_buf(p, FXB_O + (layer & 1)) + (size_t)(j * T + warp) * TILE_ROWS + gr;
    fx_red(o, p.res_mult * racc[0]);
    fx_red(o + 8, p.res_mult * racc[2]);
  }
}
#endif

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
#if MK_NOFENCE
  if (threadIdx.x < 2) misc->fxc[threadIdx.x] = 0u;
  if (threadIdx.x == 0) {  // (the host's layout: Smem::own's rows, 128-byte aligned, then these)
    const int own_tiles = (p.mat[MAT_O].ntiles + p.nblocks - 1) / p.nblocks;
    misc->ownfx = sl.own + ((own_tiles * TILE_ROWS * M * 4 + 127) & ~127);
  }
#endif
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
    if (threadIdx.x == NCT) producer(p, sl, ring, misc, kFx<M>, MK_OH1 && kFx<M> && p.ohead > 0);
    return;
  }
  Ctx<M> c;
  c.p = &p;
#if MK_WS_ALL
  c.wsl = -1;
#endif
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
#if MK_FX1
  c.fx = 0;
#endif
#if MK_OH1
  const bool oh = kFx<M> && p.ohead > 0;  // MK_OHEAD at this M
#else
  constexpr bool oh = false;
#endif
  const unsigned long long epoch = __ldcg(p.epoch);
  c.tag0 = (uint32_t)(epoch * (unsigned long long)p.L) + 1u;
  // grid barriers per launch: 5 per layer, less the qkv -> attention one (MK_QTAG) and the attention -> o one
  // (MK_ATAG). S must be the same for every M: the counter's target assumes every earlier launch had this S
  // (session 7's MK_RTAG, compiled in for M <= 2 only, deadlocked the tests that mix M; removed, from f8a9637)
  unsigned long long nbar = 0;
#if MK_FXRES  // the barriers per launch depend on M: count from the base the previous launch left in p.epoch[1]
  // (it replaces the epoch as the one 64-bit value held across the kernel: the end re-reads the epoch; a static
  // __shared__ copy does not fit next to the dynamic shared memory)
#if MK_BAR_SMEM  // the base in shared memory, read by the one thread that waits: no 64-bit value held across the kernel
  if (threadIdx.x == 0) misc->bar0 = __ldcg(p.epoch + 1);
  auto gsync = [&]() {
    ++nbar;
    grid_barrier(p, threadIdx.x == 0 ? misc->bar0 + (unsigned long long)p.nblocks * nbar : 0ull);
  };
#if MK_BAR_RELAXED || MK_NF
  auto gsync_if = [&](bool relaxed) {  // (MK_BAR_RELAXED, MK_NOFENCE: a barrier without its release fence)
    ++nbar;
    const unsigned long long tg = threadIdx.x == 0 ? misc->bar0 + (unsigned long long)p.nblocks * nbar : 0ull;
    if (relaxed) grid_barrier<true>(p, tg); else grid_barrier(p, tg);
  };
  // the barriers without a fence: bit 1 after attention, 2 after o, 4 after the down partials (MK_NOFENCE's bit 8 is 1 | 2)
  constexpr int kFenceFree = (MK_NF & 4) | ((MK_NF & 8) ? 3 : 0);
#define MK_GSYNC(bit, nf_ok) gsync_if((MK_BAR_RELAXED & (bit)) || ((kFenceFree & (bit)) && (nf_ok)))
#else
#define MK_GSYNC(bit, nf_ok) gsync()
#endif
#else
  const unsigned long long bar0 = __ldcg(p.epoch + 1);
  auto gsync = [&]() { ++nbar; grid_barrier(p, bar0 + (unsigned long long)p.nblocks * nbar); };
#endif
#else
  const unsigned long long S = (5ull - (MK_DIAG == 4 || MK_QTAG ? 1 : 0) - (MK_ATAG ? 1 : 0)) * p.L;
  auto gsync = [&]() { ++nbar; grid_barrier(p, (unsigned long long)p.nblocks * (epoch * S + nbar)); };
#endif
#ifndef MK_GSYNC  // (MK_BAR_RELAXED needs MK_FXRES and MK_BAR_SMEM)
#define MK_GSYNC(bit, nf_ok) gsync()
#endif

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
      if (oh) fx_buf(p, FXB_X)[n] = fx_of(v);  // MK_OHEAD: layer 0's X (M = 1)
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
#if MK_FX1
    if (kFx<M> && p.nffn && l > 0) {  // MK_OHEAD: Y + D of the last layer, the owners keep it as this layer's X
      const int par = l & 1;
      c.fx = oh ? fx_code(FXB_Y + (par ^ 1), FXB_D + (par ^ 1), FXB_X + par) : fx_code(FXB_X, FXB_NONE, FXB_NONE);
    }
#endif
    if (l > 0) early_ring_step(c, EARLY_BEFORE_QKV);  // (MK_QKV_EARLY)
    matvec_stage<M, kI8<M>(MAT_QKV)>(c, MAT_QKV, l, xsrc, mult, an);
    if (l > 0) early_ring_step(c, EARLY_AFTER_QKV);
#if MK_FX1
    c.fx = 0;
#endif
    stamp(l, 2);
    if (MK_DIAG != 4 && !MK_QTAG) gsync();
    stamp(l, 3);
    if (MK_DIAG != 2) attention_stage<M>(c, l, uni);
#if MK_DIAG_ICBLOB
    if ((int)blockIdx.x >= MK_DIAG_ICBLOB_FROM && threadIdx.x < 32) {  // DIAGNOSTIC: code only (see the macro)
      float v0 = (float)threadIdx.x, v1 = v0 + 1.f;
#pragma unroll
      for (int i = 0; i < MK_DIAG_ICBLOB / 2; ++i) {  // (asm volatile: one FFMA each, two registers)
        asm volatile("fma.rn.f32 %0, %0, 0f3F800347, 0f3F000000;" : "+f"(v0));
        asm volatile("fma.rn.f32 %0, %0, 0f3F7FF972, 0fBF000000;" : "+f"(v1));
      }
      if (v0 + v1 == 1.2345f) p.argmax[0] = 0;  // (never true: keeps the chains)
    }
#endif
    stamp(l, 4);
#if MK_OH1
    if (oh) {  // the o projection by kv head: its sums added into O[l & 1], no barrier before it
      const int par = l & 1;
      o_head_stage<M>(c, l, attn_rows);
      stamp(l, 5);
      stamp(l, 6);
      gsync();
      stamp(l, 7);
      {  // the other parity's O and D: this block's rows to zero (read for the last time before this barrier)
        const int n0 = c.misc->tile0[MAT_O] * TILE_ROWS, n1 = min(c.misc->tile1[MAT_O] * TILE_ROWS, p.H);
        unsigned long long* zo = fx_buf(p, FXB_O + (par ^ 1));
        unsigned long long* zd = fx_buf(p, FXB_D + (par ^ 1));
        for (int n = n0 + (int)threadIdx.x; n < n1; n += NCT) zo[n] = zd[n] = 0ull;
      }
      c.fx = fx_code(FXB_X + par, FXB_O + par, FXB_Y + par);  // (the owners keep X + O as Y)
      matvec_stage<M, kI8<M>(MAT_GU)>(c, MAT_GU, l, resid_rows, 1.f, an + p.H);
      c.fx = 0;
    } else
#endif
    {
      if (!MK_ATAG) MK_GSYNC(1, p.nffn);  // (MK_NOFENCE bit 8: the tagged words with the FFN split only)
      stamp(l, 5);
      matvec_stage<M, kI8<M>(MAT_O)>(c, MAT_O, l, attn_rows, 1.f, nullptr);
#if MK_NF & 8
      if (kFx<M> && p.nffn && l > 0 && threadIdx.x == 0) ++misc->fxc[0];  // the owners' adds (read after a block barrier)
#endif
      stamp(l, 6);
      if ((MK_NF & 16) && l > 0 && p.nffn) {
        // MK_NOFENCE bit 16: no barrier (the staging polls the tagged words)
      } else if (!(kFx<M> && (MK_DIAG2 & 4))) {
        MK_GSYNC(2, l > 0 && p.nffn);  // (MK_NOFENCE: layer 0's X is stored, not added)
      }
      stamp(l, 7);
      matvec_stage<M, kI8<M>(MAT_GU)>(c, MAT_GU, l, resid_rows, 1.f, an + p.H);
    }
    stamp(l, 8);
    if (p.nffn) {  // FFN split-K: down's partials from this block's own act slice, then a reduction
      if (l + 1 < p.L) early_ring_step(c, EARLY_BEFORE_DOWN);  // (MK_QKV_EARLY)
      ffn_down_partial<M>(c, l);
#if MK_NF & 8
      if (kFx<M> && threadIdx.x == 0) misc->fxc[0] += (uint32_t)p.nffn;  // (every FFN block adds once per row)
#endif
      stamp(l, 9);
      if (!((MK_NF & 32) && kFx<M>)) MK_GSYNC(4, true);  // (MK_NOFENCE bit 32: the next staging's count polls only,
      else cbar();                                        //  after a block barrier)
      stamp(l, 10);
      if (kFx<M>) {  // the partials were added into the fixed-point residual: the next stage reads it
        stamp(l, 11);
        continue;
      }
      ffn_down_reduce<M>(c, uni);
    } else {
      stamp(l, 9);
      gsync();
      stamp(l, 10);
      matvec_stage<M, kI8<M>(MAT_D)>(c, MAT_D, l, act_rows, 1.f, nullptr);
    }
    stamp(l, 11);
    gsync();
  }
  stamp(p.L - 1, 12);
#if MK_FX1
  if (kFx<M> && p.nffn) {
    const int lp = (p.L - 1) & 1;
    c.fx = oh ? fx_code(FXB_Y + lp, FXB_D + lp, FXB_NONE) : fx_code(FXB_X, FXB_NONE, FXB_NONE);
  }
#endif
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
#if MK_OH1
  if (oh && c.misc->flag) {  // every block is done: the last layer's O and D to zero for the next launch
    const int lp = (p.L - 1) & 1, hp = fx_stride(p);
    unsigned long long* zo = fx_buf(p, FXB_O + lp);
    unsigned long long* zd = fx_buf(p, FXB_D + lp);
    for (int n = threadIdx.x; n < hp; n += NCT) zo[n] = zd[n] = 0ull;
  }
#endif
  if (c.misc->flag && threadIdx.x == 0) {
    *p.done_count = 0;
#if MK_FXRES
    *p.epoch = __ldcg(p.epoch) + 1;  // every block read the epoch before its first barrier
#if MK_BAR_SMEM
    p.epoch[1] = misc->bar0 + (unsigned long long)p.nblocks * nbar;  // (every block has passed all nbar barriers)
#else
    p.epoch[1] = bar0 + (unsigned long long)p.nblocks * nbar;  // (every block has passed all nbar barriers)
#endif
#else
    *p.epoch = epoch + 1;  // every block read the epoch before its first barrier
#endif
  }
}

}  // namespace
}  // namespace mk

// =====================================================================[9] launch entry point
// One per M: flint_mk_launch_m<M>. The host dispatcher (megakernel_host.cu) picks by M and raises
// for anything else; there is no fall-through to another M.
#if FLINT_MK_GU8
#define MK_SYM(base) MK_CAT(MK_CAT(base, FLINT_MK_M), _gu8)
#else
#define MK_SYM(base) MK_CAT(base, FLINT_MK_M)
#endif
// MK_CLUSTER (EXPERIMENT, session 15, 1 = off; written after the last device call, builds, NOT run): the cooperative
// launch with a cluster dimension (cudaLaunchKernelEx, attributes ClusterDimension + Cooperative), the step before a
// pair of FFN blocks can exchange through distributed shared memory (docs/megakernel.md, session 15, next 2).
// flint/kernels/dev/cluster_probe.cu measured that such a launch is accepted with this block shape and that clusters
// of 2 keep all 132 blocks co-resident (4 and 8: 120). The kernel itself does not use the cluster: an A/B of this
// launch alone prices the pairs' placement. The grid must be whole clusters (else cudaErrorNotSupported).
#ifndef MK_CLUSTER
#define MK_CLUSTER 1
#endif
extern "C" int MK_SYM(flint_mk_launch_m)(const mk::Params* p, const mk::Smem* sl, int start,
                                                       const long long* tokens, int tok0, cudaStream_t stream,
                                                       int set_attr) {
  auto kern = mk::decode_kernel<FLINT_MK_M>;
  cudaError_t e;
  // MK_FXRES stages the fixed-point residual as whole rows of one round (one word of 8 codes per thread)
  if (MK_FX1 && p->nffn && p->H > 8 * mk::NCT) return (int)cudaErrorNotSupported;
  if (set_attr) {
    e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, sl->total);
    if (e != cudaSuccess) return (int)e;
  }
  mk::Params pp = *p;
  mk::Smem ss = *sl;
  void* args[] = {(void*)&pp, (void*)&ss, (void*)&start, (void*)&tokens, (void*)&tok0};
#if MK_CLUSTER > 1
  if (p->nblocks % MK_CLUSTER) return (int)cudaErrorNotSupported;
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[2];
  mk::coop_cluster_attrs(attr, MK_CLUSTER);
  cfg.gridDim = dim3(p->nblocks);
  cfg.blockDim = dim3(mk::NT);
  cfg.dynamicSmemBytes = (size_t)sl->total;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 2;
  e = cudaLaunchKernelExC(&cfg, (const void*)kern, args);
#else
  e = cudaLaunchCooperativeKernel((const void*)kern, dim3(p->nblocks), dim3(mk::NT), args, (size_t)sl->total,
                                  stream);
#endif
  return (int)e;
}

extern "C" int MK_SYM(flint_mk_occupancy_m)(int smem_bytes, int* blocks_per_sm) {
  auto kern = mk::decode_kernel<FLINT_MK_M>;
  cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (e != cudaSuccess) return (int)e;
  return (int)cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks_per_sm, kern, mk::NT, smem_bytes);
}
