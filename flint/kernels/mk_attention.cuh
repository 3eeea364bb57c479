// flint decode megakernel: attention (GQA, online softmax) and the merge of its context splits.
//
// Work item = (kv head, contiguous split of the context): all q heads of the group and all M tokens are processed
// together, so K/V are read once. Items are spread over the grid (item i on block i; the split count follows the
// grid and the context: min(tiles of 64 keys, nblocks / nkv)). This step's own K/V rows (and its q rows) come from
// the tagged words the q|k|v epilogues wrote, so no grid barrier separates the two stages. The splits' (m, l, o)
// partials are merged:
//   - at M = 1 with <= kTmMaxSplits splits: by split 0's block, from tagged words, every split's word in flight at
//     once (registers: one o value and tag per split and thread);
//   - at M = 1 with <= kTmSeqSplits splits, and in the objects with the tagged hops (M = 2) with <= kTmSeqSplits: the
//     same, 8 splits' words at a time, in split order;
//   - otherwise: the last split to finish (a counter atomic) merges from plain partials.
// Every merge weighs the splits in split order: deterministic, bitwise repeatable.
// The short objects (every M; M = 1 below the long objects' threshold): sub-tiles of ATT_T = 64 keys double-buffered
// with cp.async. M = 1, D = 64, a split of one tile (Granite and SmolLM2 at short context): scores, softmax and P V
// inside 3 R warps (warp (r, kc) over a third of row r's keys), two block barriers instead of five; M = 3, 4, D = 64,
// one tile: on the tensor cores (mk_att_mma.cuh, V swizzled like K); other splits the generic loop (warp per row).
// The long objects (FLINT_MK_LONG: M = 1, D = 64, R <= 8 rows, from kLongFromTiles tiles per split; the host's
// choice): kAttGroups groups of 4 warps walk the split's tiles in turn (group g: tiles t0 + g, t0 + g + kAttGroups,
// ...), each through kAttGroupBufs buffers of its own filled by two TMA tensor copies (K, V), so no block barrier
// falls between tiles. Warp q of a group owns keys [16 q, 16 q + 16) of its group's tiles and keeps its own online
// softmax (m, l) and O in registers, on the tensor cores (mma.m16n8k16, fp32 accumulation): S = Q K^T (q rows as the
// A operand's rows 0..7, q split into fp16 hi + lo: ~22 bits), the softmax on the accumulators, then O^T += V^T P^T
// with P (hi + lo) as the B operand straight from S's accumulator layout, V^T by transposing ldmatrix. After the
// split's tiles the warps' (m, l, O) are merged in warp order into o_s / att_m / att_l. q sits in q_s (hi | lo,
// fp16); K, V and q rows in 16-byte chunks XOR-swizzled by (row & 7), so every ldmatrix phase hits 8 distinct chunk
// columns.
#pragma once
#include "mk_common.cuh"
#include "mk_mma.cuh"
#include "mk_ptx.cuh"
#include "mk_stage.cuh"
#include "mk_sync.cuh"
#include "mk_trace.cuh"
#include "mk_kv8.cuh"
#include "mk_att_mma.cuh"

namespace mk {
namespace {

constexpr int D_LONG = 64;  // the long objects' head dimension (the host launches them only for D = 64)
// named barrier 2 + g among warp group g's 128 threads (the long objects' tile loop; 0 and 1 are the block's and
// the consumers')
__device__ __forceinline__ void grp_bar(int g) { asm volatile("bar.sync %0, 128;" ::"r"(2 + g) : "memory"); }

template <int M>
__device__ void attention_stage(Ctx<M>& c, int layer, uint8_t* uni) {
  const Params& p = *c.p;
  const int D = p.D, g = p.nh / p.nkv, R = g * M;
  const int start = c.start, Ltot = start + M;
  const int t = threadIdx.x, warp = t >> 5, lane = t & 31;
  const int ntiles = (Ltot + ATT_T - 1) / ATT_T;
  int nsplit = min(ntiles, max(1, p.nblocks / p.nkv));
  const int tps = (ntiles + nsplit - 1) / nsplit;
  nsplit = (ntiles + tps - 1) / tps;
  const int nitems = p.nkv * nsplit;
  const uint32_t qtag = c.tag0 + (uint32_t)layer;  // this layer's tag
  const int cpr = D / 8;  // 16-byte chunks per K/V row

  // the long-context objects: the tensor-core path with NB tile buffers (the host checks the rows fit, tc_fit); the
  // others: the one-tile path or the generic one, two buffers
  constexpr bool kTc = M == 1 && FLINT_MK_LONG;
  constexpr int NB = kTc ? (kAttGroups * kAttGroupBufs) : 2;
  // (the long objects: D = 64, the host's check; their warps' partials fit the tile buffers after the loop)
  static_assert(4 * kAttGroups * 8 * (D_LONG + 2) * 4 <= kAttGroups * ATT_T * D_LONG * 2 * 2, "partials");
  static_assert(4 * kAttGroups <= NCW, "warp groups");
  // fp16 tile buffers (the long objects with the int8 cache: one per warp group, the copies land beside them)
  constexpr bool kv8 = kKv8;
  const int nfb = kTc && kv8 ? kAttGroups : NB;
  __half* Kb = reinterpret_cast<__half*>(uni);              // [nfb][ATT_T][D] (swizzled 16B chunks)
  __half* Vb = Kb + nfb * ATT_T * D;                        // [nfb][ATT_T][D]
  uint8_t* land = reinterpret_cast<uint8_t*>(Vb + nfb * ATT_T * D);  // kv8: [NB] landing buffers (kv8_land_bytes)
  const int lbytes = kv8_land_bytes(D);
  float* q_s = reinterpret_cast<float*>(land + (kv8 ? NB * lbytes : 0)); // [R][D]
  float* o_s = q_s + R * D;                                 // [R][D]
  float* s_s = o_s + R * D;                                 // [R][ATT_T]
  uint64_t* tbar = reinterpret_cast<uint64_t*>(s_s + R * ATT_T);  // long objects: [NB] mbarriers of the TMA tiles
  MiscSmem* ms = c.misc;


  for (int item = blockIdx.x; item < nitems; item += gridDim.x) {
    warp_stamp(p, layer, WS_A_ENTER);
    const int kvh = item / nsplit, sp = item % nsplit;
    const int t0 = sp * tps, t1 = min(ntiles, t0 + tps);
    constexpr bool tc = kTc;
    // the verify objects' one-tile split on the tensor cores (mk_att_mma.cuh; V swizzled like K, q as hi | lo)
    constexpr bool kVtc = !kTc && M >= ATT_MMA_MIN_M && M <= ATT_MMA_MAX_M;
    const bool vtc = kVtc && D == ATT_MMA_D && R <= 16 * ATT_MMA_MAX_RB && t1 - t0 == 1;
    const bool one_tile = !kTc && !vtc && M == 1 && D == 64 && 3 * R <= NCW && t1 - t0 == 1;
    const size_t cbase = (((size_t)layer * p.nkv + kvh) * p.max_seq) * D;
    const __half* Kc = p.kcache + cbase;
    const __half* Vc = p.vcache + cbase;
    // the long objects: every tile is two TMA copies (K, V) issued by thread 0, completing on the buffer's mbarrier;
    // they land in the XOR chunk layout the tile loop reads (the 128-byte swizzle, on 1024-aligned buffers). The
    // rows the cache does not hold yet (this step's, and past the context) are patched after the copy lands
    // (after the tile's wait in the loop). The other objects: cp.async per 16-byte chunk, this step's rows from the
    // tagged words.
    auto load_tile = [&](int tile, int buf) {
      const int j0 = tile * ATT_T;
      if constexpr (tc) {  // (one thread: the caller's)
        const int row = (layer * p.nkv + kvh) * p.max_seq + j0;
        if (kv8) {  // codes (two tensor copies) and the rows' scales (two bulk copies of ATT_T halves) into landing buf
          uint8_t* lb = land + (size_t)buf * lbytes;
          mbar_expect_tx(&tbar[buf], 2 * ATT_T * D + 4 * ATT_T);
          tma_g2s_2d(lb, &p.kv_map[0], 0, row, &tbar[buf]);
          tma_g2s_2d(lb + ATT_T * D, &p.kv_map[1], 0, row, &tbar[buf]);
          bulk_g2s_plain(lb + 2 * ATT_T * D, p.kvscale + row, 2 * ATT_T, &tbar[buf]);
          bulk_g2s_plain(lb + 2 * ATT_T * D + 2 * ATT_T, p.kvscale + kv_scale_off(p) + row, 2 * ATT_T, &tbar[buf]);
        } else {
          mbar_expect_tx(&tbar[buf], 2 * ATT_T * D * 2);
          tma_g2s_2d(Kb + (size_t)buf * ATT_T * D, &p.kv_map[0], 0, row, &tbar[buf]);
          tma_g2s_2d(Vb + (size_t)buf * ATT_T * D, &p.kv_map[1], 0, row, &tbar[buf]);
        }
      } else if (kv8) {  // the rows' codes and the tile's scales by cp.async into landing buf (this step's rows too:
                         // kv8_step_rows wrote them to the cache first)
        uint8_t* lb = land + (size_t)buf * lbytes;
        const int cc = D >> 4, nc = ATT_T * cc * 2;
        const size_t srow = ((size_t)layer * p.nkv + kvh) * p.max_seq + j0;
        const int8_t* K8 = reinterpret_cast<const int8_t*>(p.kcache) + cbase;
        const int8_t* V8 = reinterpret_cast<const int8_t*>(p.vcache) + cbase;
        for (int i = t; i < nc + 2 * (ATT_T * 2 / 16); i += NCT) {
          if (i < nc) {
            const int isv = i >= ATT_T * cc;
            const int ii = isv ? i - ATT_T * cc : i;
            const int j = ii / cc, c2 = ii - j * cc;
            if (j0 + j < Ltot)
              cp_async16(lb + (size_t)isv * ATT_T * D + j * D + c2 * 16, (isv ? V8 : K8) + (size_t)(j0 + j) * D + c2 * 16);
          } else {
            const int k2 = i - nc, isv = k2 >= ATT_T * 2 / 16, c2 = isv ? k2 - ATT_T * 2 / 16 : k2;
            cp_async16(lb + 2 * ATT_T * D + isv * ATT_T * 2 + c2 * 16,
                       p.kvscale + srow + (isv ? kv_scale_off(p) : 0) + c2 * 8);
          }
        }
        cp_async_commit();
      } else {
        for (int i = t; i < ATT_T * cpr * 2; i += NCT) {
          const int isv = i >= ATT_T * cpr;
          const int ii = isv ? i - ATT_T * cpr : i;
          const int j = ii / cpr, ch = ii % cpr;
          if (j0 + j >= start && j0 + j < Ltot) {  // this step's row: from the tagged words
            const int m = j0 + j - start;
            float4 a, b;
            ld_tagged8(qkv_word(p, m, (p.nh + isv * p.nkv + kvh) * D + ch * 8), qtag, a, b);
            const __half2 hv[4] = {__floats2half2_rn(a.x, a.y), __floats2half2_rn(a.z, a.w),
                                   __floats2half2_rn(b.x, b.y), __floats2half2_rn(b.z, b.w)};
            const uint32_t* h = reinterpret_cast<const uint32_t*>(hv);
            __half* dst = isv ? Vb + ((size_t)buf * ATT_T + j) * D + ((vtc ? ch ^ (j & 7) : ch) * 8)
                              : Kb + ((size_t)buf * ATT_T + j) * D + ((ch ^ (j & 7)) * 8);
            *reinterpret_cast<uint4*>(dst) = make_uint4(h[0], h[1], h[2], h[3]);
          } else if (j0 + j < Ltot) {
            if (isv)
              cp_async16(Vb + ((size_t)buf * ATT_T + j) * D + ((vtc ? ch ^ (j & 7) : ch) * 8),
                         Vc + (size_t)(j0 + j) * D + ch * 8);
            else
              cp_async16(Kb + ((size_t)buf * ATT_T + j) * D + ((ch ^ (j & 7)) * 8), Kc + (size_t)(j0 + j) * D + ch * 8);
          }
        }
        cp_async_commit();
      }
    };
    if (kv8) {  // this step's rows into the cache first (the split that holds them), then the copies
      kv8_step_rows(p, layer, kvh, t0 * ATT_T, t1 * ATT_T, start, Ltot, qtag, t, NCT);
      if constexpr (!tc) cbar();
    }
    if constexpr (tc) {  // the region was written by other stages (generic proxy) and its barriers are new each item
      if ((smem_u32(Kb) & 1023) != 0) __trap();  // (the host aligns the long layout's tiles: a broken invariant)
      if (kv8) fence_proxy_async_all();  // (and this step's cache rows, which the tensor copies read)
      else fence_proxy_async_smem();
      if (t == 0) {
        for (int b = 0; b < NB; ++b) mbar_init(&tbar[b], 1);
        fence_mbar_init();
      }
      cbar();
    }
    if constexpr (tc) {  // every group's first kAttGroupBufs tiles, before q (whose words may still be on their way)
      if (t == 0)
        for (int gq = 0; gq < kAttGroups; ++gq)
          for (int u = 0; u < kAttGroupBufs; ++u)
            if (t0 + gq + u * kAttGroups < t1) load_tile(t0 + gq + u * kAttGroups, gq * kAttGroupBufs + u);
    } else {
      load_tile(t0, 0);
    }
    __half* qh = reinterpret_cast<__half*>(q_s);  // tc: [R][D] hi, then [R][D] lo (swizzled chunks), in q_s
    for (int i = t; i < R * D; i += NCT) {
      const int r = i / D, d = i - r * D;
      const int hq = kvh * g + r / M, m = r % M;
      const float qv = ld_tagged(qkv_word(p, m, hq * D + d), qtag) * p.attn_scale;
      if (tc || vtc) {
        const __half hi = __float2half_rn(qv);
        const int o = r * D + (((d >> 3) ^ (r & 7)) << 3) + (d & 7);
        qh[o] = hi;
        qh[R * D + o] = __float2half_rn(qv - __half2float(hi));
      } else {
        q_s[i] = qv;
        o_s[i] = 0.f;
      }
    }
    if (t < R) { ms->att_m[t] = -INFINITY; ms->att_l[t] = 0.f; }
    warp_stamp(p, layer, WS_A_Q);
    if (tc) {
      // (the header's long objects) group gi's u-th tile is t0 + gi + u kAttGroups, in its buffer u mod GB (that
      // buffer's fill u / GB); a group barrier (named barrier 2 + gi) frees the buffer for its next copy
      constexpr int GB = kAttGroupBufs;
      const int gi = warp >> 2, wq = warp & 3;  // group, the warp's 16-key quarter of a tile
      const bool in_grp = gi < kAttGroups;
      const uint32_t qh_a = smem_u32(qh);
      // the rows are the A operand's rows 0..7 (R <= 8, the host's check; rows 8..15 are zero and discarded):
      // this lane's row r0 of S, P and O
      const int r0 = lane >> 2, ra = (lane & 7) < R ? (lane & 7) : 0;  // (A rows past R read row 0: dropped)
      // O^T = V^T P^T (dims as the mma's M, the R <= 8 rows as its N): 16-dim pieces, all four accumulators used
      float oacc[D_LONG / 16][4];
#pragma unroll
      for (int n = 0; n < D_LONG / 16; ++n) oacc[n][0] = oacc[n][1] = oacc[n][2] = oacc[n][3] = 0.f;
      float mrow = -INFINITY, lrow = 0.f;  // row r0 (l: this lane's keys)
      cbar();  // q landed
      if (in_grp) {
        for (int u = 0;; ++u) {
          const int tile = t0 + gi + u * kAttGroups;
          if (tile >= t1) break;
          const int buf = gi * GB + u % GB;
          mbar_wait(&tbar[buf], (u / GB) & 1);
          const int j0 = tile * ATT_T;
          const int fb = kv8 ? gi : buf;  // the fp16 buffer the tile is read from
          if (kv8) {  // the landed codes -> the group's fp16 buffer; V past the context 0
            const int gt = t - gi * 128;
            kv8_convert(land + (size_t)buf * lbytes, Kb + (size_t)fb * ATT_T * D, Vb + (size_t)fb * ATT_T * D, D,
                        max(0, min(ATT_T, Ltot - j0)), true, gt, 128);
            if ((tile + 1) * ATT_T > Ltot) {
              for (int i = gt; i < ATT_T * cpr; i += 128) {
                const int j = i / cpr, ch = i - j * cpr;
                if (j0 + j >= Ltot)
                  *reinterpret_cast<uint4*>(Vb + ((size_t)fb * ATT_T + j) * D + ((ch ^ (j & 7)) * 8)) =
                      make_uint4(0u, 0u, 0u, 0u);
              }
            }
            grp_bar(gi);
            const int nxt = tile + GB * kAttGroups;  // the landing buffer is free: its next tile
            if (nxt < t1 && wq == 0 && lane == 0) load_tile(nxt, buf);
          } else if ((tile + 1) * ATT_T > start) {  // the rows the cache does not hold: this step's (the tagged words), and
            // V past the context zeroed (P is 0 there, and 0 x stale NaN bits is not); the group's 128 threads
            for (int i = t - gi * 128; i < ATT_T * cpr * 2; i += 128) {
              const int isv = i >= ATT_T * cpr;
              const int ii = isv ? i - ATT_T * cpr : i;
              const int j = ii / cpr, ch = ii % cpr;
              __half* dst = (isv ? Vb : Kb) + ((size_t)buf * ATT_T + j) * D + ((ch ^ (j & 7)) * 8);
              if (j0 + j >= start && j0 + j < Ltot) {
                float4 a, b;
                ld_tagged8(qkv_word(p, j0 + j - start, (p.nh + isv * p.nkv + kvh) * D + ch * 8), qtag, a, b);
                const __half2 hv[4] = {__floats2half2_rn(a.x, a.y), __floats2half2_rn(a.z, a.w),
                                       __floats2half2_rn(b.x, b.y), __floats2half2_rn(b.z, b.w)};
                const uint32_t* h = reinterpret_cast<const uint32_t*>(hv);
                *reinterpret_cast<uint4*>(dst) = make_uint4(h[0], h[1], h[2], h[3]);
              } else if (j0 + j >= Ltot && isv) {
                *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
              }
            }
            grp_bar(gi);
          }
          warp_stamp(p, layer, WS_A_TILE);
          const uint32_t kt_a = smem_u32(Kb + (size_t)fb * ATT_T * D), vt_a = smem_u32(Vb + (size_t)fb * ATT_T * D);
          const int kb = wq * 16;  // this warp's keys [kb, kb + 16) of the tile
          // S = Q K^T: two 8-key pieces x four 16-dim k-steps, q as hi + lo (two mmas a step)
          float sc[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
#pragma unroll 1  // (unrolled, the long object spills 52 bytes)
          for (int ks = 0; ks < D_LONG / 16; ++ks) {
            uint32_t bk[4];  // [0..1]: keys kb..kb+7, [2..3]: kb+8..kb+15 (dim chunks 2 ks, 2 ks + 1)
            {
              const int kj = kb + (lane & 7) + ((lane >> 4) << 3), kc = 2 * ks + ((lane >> 3) & 1);
              ldsm_x4(kt_a + (uint32_t)((kj * D + ((kc ^ (kj & 7)) << 3)) * 2), bk[0], bk[1], bk[2], bk[3]);
            }
            const int qc = 2 * ks + ((lane >> 3) & 1);  // (x2: lanes 0..7 chunk 2 ks, 8..15 chunk 2 ks + 1)
            const uint32_t qa = qh_a + (uint32_t)((ra * D + ((qc ^ (ra & 7)) << 3)) * 2);
            uint32_t a0, a2;
            ldsm_x2(qa, a0, a2);
            mkmma::mma_16816_top(sc[0], a0, a2, bk[0], bk[1]);
            mkmma::mma_16816_top(sc[1], a0, a2, bk[2], bk[3]);
            ldsm_x2(qa + (uint32_t)(R * D * 2), a0, a2);
            mkmma::mma_16816_top(sc[0], a0, a2, bk[0], bk[1]);
            mkmma::mma_16816_top(sc[1], a0, a2, bk[2], bk[3]);
          }
          // online softmax on the registers: row r0's 16 keys sit in the four lanes of a quad
          float s4[4];
#pragma unroll
          for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int j = j0 + kb + 8 * nt + 2 * (lane & 3) + e;
              s4[2 * nt + e] = j <= start ? sc[nt][e] : -INFINITY;  // (M = 1: key j <= start, inside the context)
            }
          float mx = fmaxf(fmaxf(s4[0], s4[1]), fmaxf(s4[2], s4[3]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float mn = fmaxf(mrow, mx);
          float alpha = 1.f;
          if (mn != -INFINITY) {
            alpha = expf(mrow - mn);
#pragma unroll
            for (int e = 0; e < 4; ++e) s4[e] = expf(s4[e] - mn);
          } else {
#pragma unroll
            for (int e = 0; e < 4; ++e) s4[e] = 0.f;
          }
          mrow = mn;
          lrow = fmaf(lrow, alpha, (s4[0] + s4[1]) + (s4[2] + s4[3]));
          // O^T's columns are rows 2 (lane & 3) + {0, 1}: their alphas from the quads of those rows
          const float al0 = __shfl_sync(0xffffffffu, alpha, 8 * (lane & 3));
          const float al1 = __shfl_sync(0xffffffffu, alpha, 8 * (lane & 3) + 4);
#pragma unroll
          for (int n = 0; n < D_LONG / 16; ++n) {
            oacc[n][0] *= al0; oacc[n][1] *= al1; oacc[n][2] *= al0; oacc[n][3] *= al1;
          }
          // P^T as the B operand (keys x rows): the S accumulators' layout as they are, hi and lo
          uint32_t ph[2], pl[2];
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            const __half2 hi = __floats2half2_rn(s4[2 * nt], s4[2 * nt + 1]);
            const float2 hf = __half22float2(hi);
            const __half2 lo = __floats2half2_rn(s4[2 * nt] - hf.x, s4[2 * nt + 1] - hf.y);
            ph[nt] = *reinterpret_cast<const uint32_t*>(&hi);
            pl[nt] = *reinterpret_cast<const uint32_t*>(&lo);
          }
          // O^T += V^T P^T: four 16-dim pieces, the warp's 16 keys as one k-step; V^T by transposing loads
#pragma unroll
          for (int n = 0; n < D_LONG / 16; ++n) {
            uint32_t v0, v1, v2, v3;  // (dims 16 n + 0..7 | 8..15) x (keys kb + 0..7 | 8..15)
            const int vj = kb + (lane & 7) + ((lane >> 4) << 3), vc = 2 * n + ((lane >> 3) & 1);
            ldsm_x4_trans(vt_a + (uint32_t)((vj * D + ((vc ^ (vj & 7)) << 3)) * 2), v0, v1, v2, v3);
            mkmma::mma_16816(oacc[n], v0, v1, v2, v3, ph[0], ph[1]);
            mkmma::mma_16816(oacc[n], v0, v1, v2, v3, pl[0], pl[1]);
          }
          warp_stamp(p, layer, WS_A_PV);
          // the group's warps are past this buffer: its next tile may be copied in (kv8: converted into it)
          const int nxt = tile + GB * kAttGroups;
          if (kv8) {
            if (tile + kAttGroups < t1) grp_bar(gi);
          } else if (nxt < t1) {
            grp_bar(gi);
            if (wq == 0 && lane == 0) load_tile(nxt, buf);
          }
        }
      }
      // every warp is past its last tile (no copy in flight: a group waits for every tile it issued), so the
      // buffers hold the warps' partials now: [warp][R][D + 2] = (m, l, o[D])
      cbar();
      if (t == 0)
        for (int b = 0; b < NB; ++b) mbar_inval(&tbar[b]);
      float* wp = reinterpret_cast<float*>(Kb);
      if (in_grp) {
        float l = lrow;
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        float* pr = wp + ((size_t)warp * R + r0) * (D + 2);
        if (r0 < R && (lane & 3) == 0) { pr[0] = mrow; pr[1] = l; }
#pragma unroll
        for (int e = 0; e < 2; ++e) {  // O^T (dim 16 n + lane / 4 (+ 8), row 2 (lane & 3) + e)
          const int r = 2 * (lane & 3) + e;
          float* po = wp + ((size_t)warp * R + r) * (D + 2) + 2;
          if (r < R)
#pragma unroll
            for (int n = 0; n < D_LONG / 16; ++n) {
              po[16 * n + (lane >> 2)] = oacc[n][e];
              po[16 * n + 8 + (lane >> 2)] = oacc[n][2 + e];
            }
        }
      }
      cbar();
      for (int i = t; i < R * D; i += NCT) {  // the warps' partials in warp order
        const int r = i / D, d = i - r * D;
        float mx = -INFINITY;
        for (int w = 0; w < 4 * kAttGroups; ++w) mx = fmaxf(mx, wp[((size_t)w * R + r) * (D + 2)]);
        float o = 0.f, l = 0.f;
        if (mx != -INFINITY)
          for (int w = 0; w < 4 * kAttGroups; ++w) {
            const float* pr = wp + ((size_t)w * R + r) * (D + 2);
            const float wt = pr[0] == -INFINITY ? 0.f : expf(pr[0] - mx);
            o = fmaf(wt, pr[2 + d], o);
            l = fmaf(wt, pr[1], l);
          }
        o_s[i] = o;
        if (d == 0) { ms->att_m[r] = mx; ms->att_l[r] = l; }
      }
      cbar();
    } else if (one_tile) {
      cp_async_wait<0>();
      cbar();  // the tile and q_s are in
      if (kv8) {  // the cache rows' codes -> the fp16 tile
        kv8_convert(land, Kb, Vb, D, max(0, min(ATT_T, Ltot - t0 * ATT_T)), false, t, NCT);
        cbar();
      }
      warp_stamp(p, layer, WS_A_TILE);
      const int nvalid = min(ATT_T, Ltot - t0 * ATT_T);
      float* scr = reinterpret_cast<float*>(Kb + (size_t)ATT_T * D);  // [3 R][D + 2]: (m, l, o[D]) per warp
      if (warp < 3 * R) {
        const int r = warp / 3, kc = warp - 3 * r;
        const int ja = kc * nvalid / 3, cnt = (kc + 1) * nvalid / 3 - ja;
        const int j = ja + lane;
        float sc = -INFINITY;
        // (the score loop repeats the general path's below; one shared inline helper gave the same bits but other
        // schedules: M = 2 0.3% slower in 19/20 rounds)
        if (lane < cnt && t0 * ATT_T + j <= start) {
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
        for (int jj = 0; jj < cnt; ++jj) {
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
    } else if (vtc) {
      for (int i = t; i < (ATT_T - min(ATT_T, Ltot - t0 * ATT_T)) * cpr; i += NCT)  // V past the context: 0
        *reinterpret_cast<uint4*>(Vb + (size_t)(ATT_T - 1 - i / cpr) * D + (i % cpr) * 8) = make_uint4(0u, 0u, 0u, 0u);
      cp_async_wait<0>();
      cbar();  // the tile and q are in
      if (kv8) {  // the cache rows' codes -> the fp16 tile (V swizzled)
        kv8_convert(land, Kb, Vb, D, max(0, min(ATT_T, Ltot - t0 * ATT_T)), true, t, NCT);
        cbar();
      }
      warp_stamp(p, layer, WS_A_TILE);
      att_tile_mma<M>(Kb, Vb, reinterpret_cast<const __half*>(q_s), R, t0 * ATT_T, start, o_s, ms->att_m, ms->att_l,
                      reinterpret_cast<__half*>(s_s), reinterpret_cast<float*>(Kb + (size_t)ATT_T * D));
      warp_stamp(p, layer, WS_A_PV);
    } else
    for (int tile = t0; tile < t1; ++tile) {
      const int buf = (tile - t0) & 1;
      if (tile + 1 < t1) { load_tile(tile + 1, buf ^ 1); cp_async_wait<1>(); }
      else cp_async_wait<0>();
      cbar();
      if (kv8) {  // the cache rows' codes -> the fp16 tile
        kv8_convert(land + (size_t)buf * lbytes, Kb + (size_t)buf * ATT_T * D, Vb + (size_t)buf * ATT_T * D, D,
                    max(0, min(ATT_T, Ltot - tile * ATT_T)), false, t, NCT);
        cbar();
      }
      warp_stamp(p, layer, WS_A_TILE);
      const int j0 = tile * ATT_T;
      const int nvalid = min(ATT_T, Ltot - j0);
      const __half* Kt = Kb + (size_t)buf * ATT_T * D;
      const __half* Vt = Vb + (size_t)buf * ATT_T * D;
      // scores: lanes over keys, warps over (row, key half)
      for (int task = warp; task < R * 2; task += NCW) {
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
      for (int r = warp; r < R; r += NCW) {
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
      if (M == 1 && 3 * R <= NCW && D == 64) {
        // three warps per row, each over a third of the keys; their sums join o in a fixed order
        // (o * alpha + part 0, then + part 1, then + part 2: one block barrier between, deterministic)
        const int r = warp / 3, kc = warp - 3 * r;
        const bool act = warp < 3 * R;
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
      for (int r = warp; r < R; r += NCW) {
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
        attn_out(p, m, hq * D + d, o_s[i] / ms->att_l[r], layer);
      }
    } else if ((M > 1 ? kFxObj : nsplit > kTmMaxSplits) && nsplit <= kTmSeqSplits &&
               2 * R * kTmSeqSplits <= R * ATT_T) {
      // M = 1 with more splits than the register merge holds, and the M = 2 object (its o staging polls the output:
      // 0.9754 of the counter merge with the counted residual, neutral without it): the (m, l) pairs first, then
      // every output thread polls and weighs the splits' o words 8 at a time (in flight together), in split order
      // (deterministic); a thread takes outputs t, t + NCT, ... Its hand-over loop and its 16-byte (m, l) poll repeat
      // the register merge's below: as shared inline helpers they compiled to other register assignments
      uint32_t* tk = reinterpret_cast<uint32_t*>(p.part) + 2 * ((size_t)kvh * nsplit * R) * (D + 2);
      if (sp != 0) {
        uint32_t* tp = tk + 2 * ((size_t)sp * R) * (D + 2);
        for (int i = t; i < R * (D + 2); i += NCT) {
          const int r = i / (D + 2), d = i - r * (D + 2);
          st_tagged(tp + 2 * i, d == 0 ? ms->att_m[r] : d == 1 ? ms->att_l[r] : o_s[r * D + d - 2], qtag);
        }
      } else {
        float* wt = s_s;  // [R][kTmSeqSplits] (m, l)
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
          wt[2 * (rr * kTmSeqSplits + s2)] = mv;
          wt[2 * (rr * kTmSeqSplits + s2) + 1] = lv;
        }
        cbar();
        // the split weights once per (row, split), in q_s (free after the scores)
        float* w1 = q_s;  // [R][kTmSeqSplits]
        for (int i = t; i < R * nsplit; i += NCT) {
          const int rr = i / nsplit, s2 = i - rr * nsplit;
          const float* wr = wt + 2 * rr * kTmSeqSplits;
          float mx = -INFINITY;
          for (int k = 0; k < nsplit; ++k) mx = fmaxf(mx, wr[2 * k]);
          const float m2 = wr[2 * s2];
          w1[rr * kTmSeqSplits + s2] = m2 == -INFINITY ? 0.f : expf(m2 - mx);
        }
        cbar();
        for (int i = t; i < R * D; i += NCT) {
          const int r = i / D, d = i - r * D;
          const float* wr = wt + 2 * r * kTmSeqSplits;
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
                ov[k] = s2 == 0 ? o_s[i] : __uint_as_float(v);
              }
              ok = true;
#pragma unroll
              for (int k = 0; k < 8; ++k) ok = ok && tg[k] == qtag;
            } while (!ok);
#pragma unroll
            for (int k = 0; k < 8; ++k) {
              const int s2 = s0 + k;
              if (s2 < nsplit) {
                const float w2 = w1[r * kTmSeqSplits + s2];
                den = fmaf(w2, wr[2 * s2 + 1], den);
                num = fmaf(w2, ov[k], num);
              }
            }
          }
          const int hq = kvh * g + r / M, m = r % M;
          attn_out(p, m, hq * D + d, num / den, layer);
        }
      }
    } else if (M <= 1 && nsplit <= kTmMaxSplits && R * D <= NCT && R * nsplit <= NCT) {
      uint32_t* tk = reinterpret_cast<uint32_t*>(p.part) + 2 * ((size_t)kvh * nsplit * R) * (D + 2);
      if (sp != 0) {  // hand the partial over: one tagged word per value
        uint32_t* tp = tk + 2 * ((size_t)sp * R) * (D + 2);
        for (int i = t; i < R * (D + 2); i += NCT) {
          const int r = i / (D + 2), d = i - r * (D + 2);
          st_tagged(tp + 2 * i, d == 0 ? ms->att_m[r] : d == 1 ? ms->att_l[r] : o_s[r * D + d - 2], qtag);
        }
        warp_stamp(p, layer, WS_A_PART);  // (the partial's stores issued)
      } else {  // split 0's block merges: its own partial from shared memory, the others' as they arrive
        const int r = t / D, d = t - r * D;
        float ov[kTmMaxSplits];
        if (t < R * D) {
          bool ok;
          do {  // every split's word in flight at once, re-polled until all carry this layer's tag
            uint32_t tg[kTmMaxSplits];
#pragma unroll
            for (int s2 = 1; s2 < kTmMaxSplits; ++s2) {
              if (s2 < nsplit) {
                uint32_t v;
                asm volatile("ld.relaxed.gpu.global.v2.u32 {%0, %1}, [%2];"
                             : "=r"(v), "=r"(tg[s2]) : "l"(tk + 2 * (((size_t)s2 * R + r) * (D + 2) + 2 + d)) : "memory");
                ov[s2] = __uint_as_float(v);
              }
            }
            ok = true;
#pragma unroll
            for (int s2 = 1; s2 < kTmMaxSplits; ++s2) ok = ok && (s2 >= nsplit || tg[s2] == qtag);
          } while (!ok);
          ov[0] = o_s[t];
        }
        warp_stamp(p, layer, WS_A_PART);  // (the merger: every split's o words seen by this warp)
        float* wt = s_s;  // [R][kTmMaxSplits] (m, l) then (weight, l); s_s (R x ATT_T floats) is free now
        if (t < R * nsplit) {
          const int rr = t / nsplit, s2 = t - rr * nsplit;
          float mv, lv;
          if (s2 == 0) {
            mv = ms->att_m[rr];
            lv = ms->att_l[rr];
          } else {
            const uint32_t* e = tk + 2 * (((size_t)s2 * R + rr) * (D + 2));
            // (m, tag), (l, tag): one 16-byte load (16-byte aligned: rows of D + 2 = 66 words)
            uint4 u;
            do {
              asm volatile("ld.relaxed.gpu.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                           : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w) : "l"(e) : "memory");
            } while (u.y != qtag || u.w != qtag);
            mv = __uint_as_float(u.x);
            lv = __uint_as_float(u.z);
          }
          wt[2 * (rr * kTmMaxSplits + s2)] = mv;
          wt[2 * (rr * kTmMaxSplits + s2) + 1] = lv;
        }
        cbar();
        warp_stamp(p, layer, WS_A_COUNT);  // (the merger: every (m, l) in shared memory)
        // each split's weight once per (row, split) (R x nsplit threads), then the output threads only sum (-1.1%
        // against every output thread computing all its row's weights, 9 expf at ctx 512)
        float* w1 = wt + 2 * R * kTmMaxSplits;  // [R][kTmMaxSplits] (s_s holds R x ATT_T floats)
        if (t < R * nsplit) {
          const int rr = t / nsplit, s2 = t - rr * nsplit;
          const float* wr = wt + 2 * rr * kTmMaxSplits;
          float mx = -INFINITY;
#pragma unroll
          for (int k = 0; k < kTmMaxSplits; ++k)
            if (k < nsplit) mx = fmaxf(mx, wr[2 * k]);
          const float m2 = wr[2 * s2];
          w1[rr * kTmMaxSplits + s2] = m2 == -INFINITY ? 0.f : expf(m2 - mx);
        }
        cbar();
        if (t < R * D) {
          const float* wr = wt + 2 * r * kTmMaxSplits;
          const float* wv = w1 + r * kTmMaxSplits;
          float num = 0.f, den = 0.f;
#pragma unroll
          for (int s2 = 0; s2 < kTmMaxSplits; ++s2)
            if (s2 < nsplit) {
              const float w2 = wv[s2];
              den = fmaf(w2, wr[2 * s2 + 1], den);
              num = fmaf(w2, ov[s2], num);
            }
          const int hq = kvh * g + r / M, m = r % M;
          attn_out(p, m, hq * D + d, num / den, layer);
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
          attn_out(p, m, hq * D + d, num / den, layer);
        }
        if (t == 0) p.att_count[kvh] = 0;
      }
    }
    warp_stamp(p, layer, WS_A_MERGE);
    cbar();
    warp_stamp(p, layer, WS_A_EXIT);
  }
}

}  // namespace
}  // namespace mk
