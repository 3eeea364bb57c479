// flint decode megakernel: the knobs that select the code the product runs, in one place.
//
// Three come from the build (flint/kernels/build.py sets them per object; nothing else does):
//   FLINT_MK_M    tokens per launch, 1..8: one object per M (plain decode is M = 1, a verify of k drafts M = k + 1)
//   FLINT_MK_GU8  1 in the extra M = 1 object that runs gate|up on the integer dot (groups of 128: Granite)
//   FLINT_MK_LONG 1 in the M = 1 objects launched when attention splits walk several tiles (long context): their
//                 attention runs on the tensor cores with kAttNbufLong K/V tile buffers filled by TMA
//   FLINT_MK_KV8  1 in the objects launched with the int8 KV cache (Params::kv8): a copy of every object (its code in
//                 the fp16 M = 1 objects spilled 32-60 bytes, in the verify objects it cost 0.5-0.7% a step)
//   MK_TRACE      1 in the traced library only (FLINT_MK_TRACE=1): stage and warp stamps compiled in
// The rest are constants of the design, each with the measurement that chose it (docs/megakernel-log.md has
// every alternative that was tried).
#pragma once

#ifndef FLINT_MK_M
#define FLINT_MK_M 1
#endif
#ifndef FLINT_MK_GU8
#define FLINT_MK_GU8 0
#endif
#ifndef FLINT_MK_LONG
#define FLINT_MK_LONG 0
#endif
#ifndef FLINT_MK_KV8
#define FLINT_MK_KV8 0
#endif
#ifndef MK_TRACE
#define MK_TRACE 0
#endif

namespace mk {

// The objects of M <= kFxMaxM (with the FFN split-K): the down partials are added into a 64-bit fixed-point residual
// whose counted words replace the grid barrier and the reduction pass after them, and the hops after attention and
// o are fence-free tagged words (M = 1: −3.2% and −2.9% per step; M = 2: −1.5%; docs/megakernel.md
// "Synchronisation"). Beyond it the fp32 residual, the dpart reduction and fenced barriers: at M = 3 / 4 the
// counted residual's rows are more than one round of loads (two in flight spilled) and it cost +3.7% / +8.8%.
constexpr int kFxMaxM = 2;
// Bulk copies in flight per block: one (−1.4% at ctx 512 against two once the dots got cheaper; three +1.8%) ...
constexpr int kInflight = 1;
// ... and two for the lm_head, the step's last and longest stream, which no hop follows (−0.7% against one).
constexpr int kLmInflight = 2;
// Context splits the register merge of attention holds (one o value and tag per split and thread; 13+ spill at
// M = 1); up to kTmSeqSplits the sequential tagged merge runs, beyond them the counter merge.
constexpr int kTmMaxSplits = 12;
constexpr int kTmSeqSplits = 32;
// The long-context M = 1 objects (FLINT_MK_LONG; the host launches them from kLongFromTiles tiles per split on):
// attention in kAttGroups groups of 4 warps, each group with kAttGroupBufs K/V tile buffers of its own (TMA), no
// block barrier between tiles (mk_attention.cuh). Against the block-wide tile loop with 4 buffers (three block
// barriers a tile): 32k 0.6866 of the step, 8k 0.9361; three groups of two buffers 0.7036 / 0.9286
// (ab_long_groups_2026-12-02.md). A ring slot of the weight stream gives way to the extra buffers.
constexpr int kAttGroups = 2;
constexpr int kAttGroupBufs = 3;

}  // namespace mk
