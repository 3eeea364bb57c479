// flint decode megakernel: the weight producer and its ring.
//
// Weights do not depend on activations, so one lane of warp 15 of every block streams the block's share of EVERY
// weight matrix of the whole step, in the fixed order the consumers read them (per layer: q|k|v, o, gate|up, then
// down or the FFN block's down slice; then the lm_head), into a ring of shared-memory slots with 1-D bulk copies
// (cp.async.bulk, completing on an mbarrier). It runs ahead across grid barriers; only ring space stops it.
//
// Ring protocol (three mbarriers per slot; chunk q lives in slot q mod nslots on lap q / nslots):
//   full[s]   the producer's expect_tx + the copy's complete_tx; consumers wait on parity lap & 1
//   empty[s]  NCT arrivals per lap (every consumer lane, whether it used the slot or not); the producer waits on it
//             before reusing the slot
//   parts[s]  NCT arrivals per lap: the K-part warps hand their partial sums to the tile's reducer (mk_matvec.cuh)
// Every consumer warp waits for every chunk in order and arrives on every slot (parity waits are valid only within
// one phase, so no warp may skip a chunk). The ring's deadlock freedom and the producer's lead are modelled in
// lab/ring_model.py (tested in lab/tests/test_ring_protocol.py).
#pragma once
#include "mk_common.cuh"
#include "mk_ptx.cuh"

namespace mk {
namespace {

struct Ring {
  uint8_t* slots;
  uint64_t* full;
  uint64_t* empty;
  uint64_t* parts;   // K parts of the slot's tile done (NCT arrivals per phase)
  int nslots;
  int slot_bytes;
};

// At most CAP bulk copies in flight per block: before a copy the producer waits until the one CAP before it has
// landed (copies queued behind each other landed 5-7 us after issue; one in flight lets the grid-barrier hops run
// without competing copies: mk_config.cuh's kInflight)
template <int CAP = kInflight>
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
// One bulk copy into the next ring slot, once the slot's previous lap is consumed and the cap allows
template <int CAP = kInflight>
__device__ __forceinline__ void ring_copy(const Ring& ring, int& slot, uint32_t& lap, const uint8_t* src,
                                          uint32_t bytes, uint64_t pol) {
  if (lap > 0) mbar_wait(&ring.empty[slot], (lap - 1) & 1);
  inflight_cap<CAP>(ring, slot, lap);
  mbar_expect_tx(&ring.full[slot], bytes);
  bulk_g2s(ring.slots + (size_t)slot * ring.slot_bytes, src, bytes, &ring.full[slot], pol);
  if (++slot == ring.nslots) { slot = 0; ++lap; }
}
// One ring slot per tile-segment (16 row-segments), in the consumers' order: segment-major, tiles in order within a
// segment; (slot, lap) stepped, no division per copy (the one producer lane issues every copy of the block)
template <int CAP = kInflight>
__device__ void produce_matrix(const Mat& mt, int t0, int t1, int layer, const Ring& ring, int& slot, uint32_t& lap,
                               uint64_t pol) {
  const uint32_t bytes = (uint32_t)(TILE_ROWS * mt.srb);
  const uint8_t* lbase = mt.base + (long long)layer * mt.layer_stride;
  for (int s = 0; s < mt.nseg; ++s) {
    const uint8_t* src = lbase + (long long)s * mt.seg_stride + (long long)t0 * bytes;
    for (int tl = t0; tl < t1; ++tl, src += bytes) {
      ring_copy<CAP>(ring, slot, lap, src, bytes, pol);
    }
  }
}

// FFN split-K: this block's down slice (all its row tiles, one K slice) in chunks of cpt tiles per slot, in
// ffn_down_partial's order. With the counted residual (fxrot) block f starts at chunk f mod chunks, so that the FFN
// blocks' adds into the shared fixed-point residual spread over all rows at a time.
__device__ void produce_slice(const Mat& mt, int ntl, int cpt, int layer, const Ring& ring, int& slot, uint32_t& lap,
                              uint64_t pol, bool fxrot) {
  const uint32_t tb = (uint32_t)(TILE_ROWS * mt.srb);
  const uint8_t* src = mt.base + (long long)layer * mt.layer_stride + (long long)blockIdx.x * mt.seg_stride;
  const int nch = (ntl + cpt - 1) / cpt, ch0 = fxrot ? (int)blockIdx.x % nch : 0;
  for (int ci = 0; ci < nch; ++ci) {
    const int t = (ci + ch0 < nch ? ci + ch0 : ci + ch0 - nch) * cpt;
    const uint8_t* cs = src + (size_t)t * tb;
    const uint32_t bytes = (uint32_t)min(cpt, ntl - t) * tb;
    ring_copy<kInflight>(ring, slot, lap, cs, bytes, pol);
  }
}

// The producer lane's whole step. The weights are read once per step: evict_first keeps them from pushing the
// activations, caches and scratch out of L2.
__device__ void producer(const Params& p, const Smem& sl, const Ring& ring, const MiscSmem* misc, bool fxrot) {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  int slot = 0;
  uint32_t lap = 0;
  for (int l = 0; l < p.L; ++l) {
    for (int m = MAT_QKV; m <= MAT_GU; ++m)
      produce_matrix(p.mat[m], misc->tile0[m], misc->tile1[m], l, ring, slot, lap, pol);
    if (p.nffn) produce_slice(p.mat[MAT_DS], misc->tile1[MAT_DS], sl.ds_cpt, l, ring, slot, lap, pol, fxrot);
    else produce_matrix(p.mat[MAT_D], misc->tile0[MAT_D], misc->tile1[MAT_D], l, ring, slot, lap, pol);
  }
  produce_matrix<kLmInflight>(p.mat[MAT_LM], misc->tile0[MAT_LM], misc->tile1[MAT_LM], 0, ring, slot, lap, pol);
}

}  // namespace
}  // namespace mk
