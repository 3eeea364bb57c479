// flint decode megakernel: the traced build's stamps (FLINT_MK_TRACE=1 loads a separate library built with
// MK_TRACE=1; in the default library every function here compiles to nothing). Their runtime checks on every
// stage's critical path cost 2.5% per step when compiled into the default build (2026-11-29), hence two libraries.
//
// Layout of Params::trace (read by flint/megakernel.py: stage_times, block_stamps, block_smids, warp_clocks,
// sm_clock_ghz):
//   [2][L][32]        %globaltimer at the stage boundaries of every layer, of block 0 (row 0) and the last block
//                     (row 1); slots 14 / 15 of a layer: that block's %clock64 at its start / end (the SM clock rate)
//   [nblocks][16]     every block's stamps 0..15 of the middle layer (slot 15: the block's %smid)
//   [2][16][32]       %clock64 of lane 0 of every warp of those two blocks at the WS_* points of the middle layer's
//                     o-projection and attention stages
#pragma once
#include "mk_common.cuh"

namespace mk {
namespace {

// which traced block this is: 0 (block 0), 1 (the last block), -1 (not traced per layer)
__device__ __forceinline__ int traced_block(const Params& p) {
  return blockIdx.x == 0 ? 0 : (int)blockIdx.x == p.nblocks - 1 ? 1 : -1;
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

// the warp stamps' points (MegakernelBackend.WARP_CLOCKS names them)
enum {
  WS_O_ENTER = 0, WS_O_STAGED = 1, WS_O_UNIT = 2,  // + 4 j: slot ready, dot done, parts ready, epilogue done (j < 2)
  WS_O_LOOP_END = 10, WS_O_EXIT = 11,
  WS_A_ENTER = 12, WS_A_Q = 13, WS_A_TILE = 14, WS_A_SCORES = 15, WS_A_SOFTMAX = 16, WS_A_PV = 17,
  WS_A_PART = 18, WS_A_COUNT = 19, WS_A_MERGE = 20, WS_A_EXIT = 21
};
__device__ __forceinline__ void warp_stamp(const Params& p, int l, int slot) {
  if (!MK_TRACE) return;
  if (p.trace == nullptr || l != p.L / 2 || (threadIdx.x & 31)) return;
  const int which = traced_block(p);
  if (which < 0) return;
  p.trace[(size_t)2 * p.L * 32 + (size_t)p.nblocks * 16 + ((which * 16 + (threadIdx.x >> 5)) * 32 + slot)] = clock64();
}

}  // namespace
}  // namespace mk
