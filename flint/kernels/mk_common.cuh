// flint decode megakernel: the definitions the device code and the host side share: the block shape, the repacked
// matrix descriptor (Mat), the launch parameters (Params) and the shared-memory layout (Smem, MiscSmem).
//
// Included by megakernel.cu's headers (device code, compiled once per token count M) and by megakernel_host.cu,
// which computes the layout per M. Params and Smem are passed by value as __grid_constant__ kernel parameters.
// Build: `python -m flint.kernels.build` (flags live only in flint/kernels/build.py).
// Test:  `pytest tests/test_megakernel.py` (GPU tests need an sm_90 device).
#pragma once
#include <cuda_runtime.h>
#include <cuda.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "mk_config.cuh"

namespace mk {

// ---- block shape: 15 consumer warps + 1 producer warp (4 warps per SM sub-partition), one block per SM (a
// cooperative launch); the launch bounds give each thread 65536 / 512 = 128 registers
constexpr int NCW = 15;
constexpr int NCT = NCW * 32;
constexpr int NT = NCT + 32;
constexpr int TILE_ROWS = 16;       // weight rows per tile (one mma.m16n8k16 A operand)
constexpr int MAX_SLOTS = 16;       // ring slots, one tile-segment (16 row-segments) each
constexpr int MAX_PARTS = 15;       // K parts per tile (one warp each; <= NCW so a warp holds at most one)
constexpr int PART_FLOATS = 32;     // parts * M <= PART_FLOATS (per-slot partial sums, 64 B each per M)
constexpr int MAX_ACC_TILES = 64;  // tiles per block of a multi-segment matrix
constexpr int XALL_BYTES = 66560;   // stage the whole K of a multi-segment matrix when it fits this (Granite down: M <= 2;
                                    // at M = 2 it costs 2 of 8 ring slots and saves 3 stagings: -6% per verify step)
constexpr int ATT_T = 64;           // keys per attention sub-tile
constexpr int MAX_M = 8;
constexpr int KSEG_MAX = 2560;      // codes per K segment
constexpr int MAX_ROWS_ATT = 64;    // (num_heads / num_kv_heads) * M
// the int8 cache's landing buffer of one tile (mk_attention.cuh): K codes, V codes [ATT_T][D], K and V scales [ATT_T]
__host__ __device__ constexpr int kv8_land_bytes(int D) { return 2 * ATT_T * D + 4 * ATT_T; }

// MAT_DS: down's per-FFN-block K slices (FFN split-K, Params::nffn > 0): slice f = all H rows over the
// K range [f kf, (f + 1) kf) that FFN block f's gate|up tiles produce (K = kf, one segment; seg_stride
// = bytes per slice). With nffn > 0 MAT_D is absent (base == nullptr), else MAT_DS is.
enum { MAT_QKV = 0, MAT_O, MAT_GU, MAT_D, MAT_LM, MAT_DS, NMAT };

// One repacked int4 matrix (all layers). Layout: [layer][seg][row][srb bytes], each row-segment =
// kseg/2 bytes of flint-int4-v1 codes, then (kseg/G) half2 (scale, min), padded to 16 bytes; rows
// padded to a multiple of 16 (zero codes and scales). A tile = 16 consecutive row-segments.
struct Mat {
  const uint8_t* base;
  long long layer_stride;  // bytes
  long long seg_stride;    // bytes = N * srb
  int N;                   // rows, multiple of TILE_ROWS (padded)
  int K, G, gshift, nseg, kseg, srb, nreal;  // nreal: rows before padding
  int ntiles;              // N / TILE_ROWS
};

struct Params {
  Mat mat[NMAT];
  int H, I, nh, nkv, D, L, V, max_seq, use_rope, nblocks;
  int kv8;       // 1: the KV cache is int8 with an fp16 scale per row (kcache / vcache hold int8 codes, kvscale the scales)
  int nffn;      // FFN split-K: blocks 0..nffn-1 own gate|up tiles [f T, (f + 1) T) and down's slice f; 0: off
  int nffn_pad;  // nffn rounded up to 8 (dpart's f stride; entries f >= nffn stay 0)
  float eps, emb_mult, res_mult, attn_scale, inv_logit_scale;
  const float* embed;       // [vocab, H] fp32
  const float* norms;       // [L][2][H]: attn_norm, ffn_norm
  const float* final_norm;  // [H]
  const float* rope_cos;    // [max_seq][D/2]
  const float* rope_sin;
  __half* kcache;           // [L][nkv][max_seq][D] fp16, or with kv8 int8 codes (the same index, one byte each)
  __half* vcache;
  float* resid;             // [M][H]  residual stream (fp32)
  __half* kvscale;          // kv8: the rows' scales, K's [L][nkv][max_seq] then V's at kv_scale_off(); else nullptr
                            // (code * scale is the value; mk_attention.cuh quantizes, flint/model.py's kv_quantize)
  float* attn;              // [M][nh*D] attention output
  float* act;               // [M][I]   silu(gate) * up
  float* part;              // attention partials [nkv][nsplit][rows][D + 2]
  int* att_count;           // [nkv]
  float* logits;            // [M][V]
  float* arg_val;           // [nblocks][M]
  int* arg_idx;             // [nblocks][M]
  int* argmax;              // [M]
  int* done_count;          // [1]
  unsigned long long* bar_counter;  // [1] the monotonic grid-barrier counter
  unsigned long long* epoch;        // [2] launches so far; the barrier counter at this launch's start
  float* dpart;             // FFN split-K partial sums [M][H tiles][nffn_pad][16] (nullptr when nffn == 0)
  unsigned long long* trace;        // optional [L * 16] globaltimer stamps of block 0 (nullptr: off)
  uint32_t* qkvt;           // tagged words (mk_sync.cuh): [M][(nh + 2 nkv) D] (fp32 bits, tag) pairs of this step's
                            // q, k, v rows, then the 24-bit words of the attention output and of x + o
  int ohead;                // always 0 (the host refuses anything else; the validated parameter layout)
  // greedy_run (M = 1): where this launch also writes its argmax (as int64), or nullptr (no device-to-device copy
  // queued between two launches)
  long long* argmax_out;
  // the long-context objects' K/V tiles by TMA (mk_attention.cuh): tensor maps over the caches as [L * nkv * max_seq]
  // rows of D fp16, boxes of ATT_T rows, 128-byte swizzle (the tiles' XOR chunk layout); kv_tma = 0 where they could
  // not be made (head_dim != 64, no driver entry point): the host then launches only the short objects
  int kv_tma;
  CUtensorMap kv_map[2];
};

// this object runs the int8 KV cache's paths (FLINT_MK_KV8: every object has an int8-cache copy, launched only with
// it; a runtime branch on Params::kv8 in one object cost the fp16 verify steps 0.5-0.7%)
constexpr bool kKv8 = FLINT_MK_KV8 != 0;

// Shared-memory layout (byte offsets) and per-matrix work split, computed on the host per M.

struct Smem {
  int bars;    // 3 * MAX_SLOTS mbarriers (full, empty, parts)
  int misc;    // MiscSmem: rstd, reductions, argmax, flags, tile ranges and part bounds per matrix
  int acc;     // [tiles of a multi-segment matrix per block][nseg][16][M] fp32 (per-segment sums)
  int own;     // [o-proj tiles per block][16][M] fp32: this block's rows of the residual stream
  int rope;    // [M][D/2] cos, then [M][D/2] sin of this step's positions
  int parts;   // [nslots][parts][16][M] fp32 partial tile sums
  int xsum;    // [groups staged][MMA_XSUM_FLOATS] fp32
  int uni;     // union: staged x (2 * MAX_M rows of xstride) | attention tiles
  int ring;    // nslots * slot
  int slot;    // bytes per ring slot (max tile-segment bytes, 128-aligned)
  int nslots;
  int total;
  int nparts[NMAT];  // K parts per tile (one warp each)
  int xall[NMAT];    // 1: the whole K is staged once (multi-segment matrices that fit)
  int xstride;       // bytes between staged token rows (for the largest staged K)
  int pstride;       // floats per ring slot of partial sums (max parts * 16 * M)
  int ds_cpt;        // FFN split-K: down-slice tiles per ring slot (one chunk)
  int actb;          // FFN split-K: [M][kf] fp32, this FFN block's act slice (written by its gate|up epilogues)
};

struct MiscSmem {
  float rstd[MAX_M];
  float red[NCW][MAX_M];
  float best_val[NCW][MAX_M];  // per-warp running argmax of the lm_head stage
  int best_idx[NCW][MAX_M];
  float att_m[MAX_ROWS_ATT], att_l[MAX_ROWS_ATT], att_alpha[MAX_ROWS_ATT];
  int seg_count[MAX_ACC_TILES];  // K segments done per tile of a multi-segment matrix
  const float* rows[5][MAX_M]; // per token: embedding row, residual, attention output, act, act slice in smem (kept here, not in registers)
  int tile0[NMAT], tile1[NMAT];  // this block's tiles [tile0, tile1) of each matrix (block_tiles, once per launch)
  int flag;
  unsigned fxc[2];  // M = 1: the adds X[0], X[1] have had in this launch (written by thread 0 between stages)
  int ownfx;        // M = 1: shared-memory offset of [2][o-proj tiles per block][16][M] int64 (after Smem::own's
                    // fp32 rows: the host makes that region larger; not a Smem field, which would move the kernel's
                    // later parameters in every build)
  uint8_t gbound[NMAT][16];  // K-group bound of part p of each matrix (ng * p / S, p <= S; once per launch)
  unsigned long long bar0;   // the grid barrier counter's base for this launch (read by thread 0 only)
};

}  // namespace mk
