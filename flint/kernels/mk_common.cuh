// flint decode megakernel: shared definitions (Params, smem layout, barriers, bulk copies).
//
// Included by megakernel.cu (device code, compiled once per token count M) and by the host part.
// Build: `python -m flint.kernels.build` (flags live only in flint/kernels/build.py).
// Test:  `pytest tests/test_megakernel.py` (GPU tests need an sm_90 device).
#pragma once
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace mk {

// ---- block shape: 15 consumer warps + 1 producer warp (4 warps per SM sub-partition: 128 registers each), one block per SM (cooperative launch)
constexpr int NCW = 15;
constexpr int NCT = NCW * 32;
constexpr int NT = NCT + 32;
constexpr int SLOT_BYTES = 16384;   // one weight chunk (whole row-segments) per ring slot
constexpr int MAX_SLOTS = 16;
constexpr int ACC_PAIRS = 128;      // row pairs accumulated per row-block (acc in smem)
constexpr int ATT_T = 64;           // keys per attention sub-tile
constexpr int MAX_M = 8;
constexpr int KSEG_MAX = 2560;      // codes per K segment: MAX_M * KSEG_MAX * 4 B of staged x
constexpr int MAX_ROWS_ATT = 64;    // (num_heads / num_kv_heads) * M

enum { MAT_QKV = 0, MAT_O, MAT_GU, MAT_D, MAT_LM, NMAT };

// One repacked int4 matrix (all layers). Layout: [layer][seg][row][srb bytes], each row-segment =
// kseg/2 bytes of flint-int4-v1 codes, then (kseg/G) half2 (scale, min), padded to 16 bytes.
struct Mat {
  const uint8_t* base;
  long long layer_stride;  // bytes
  long long seg_stride;    // bytes = N * srb
  int N;                   // rows, even (padded)
  int K, G, gshift, nseg, kseg, srb, rpc;  // rpc: rows per chunk (even, rpc * srb <= SLOT_BYTES)
};

struct Params {
  Mat mat[NMAT];
  int H, I, nh, nkv, D, L, V, max_seq, use_rope, nblocks, dbg;  // dbg bit 0: skip dot (timing)
  float eps, emb_mult, res_mult, attn_scale, inv_logit_scale;
  const float* embed;       // [vocab, H] fp32
  const float* norms;       // [L][2][H]: attn_norm, ffn_norm
  const float* final_norm;  // [H]
  const float* rope_cos;    // [max_seq][D/2]
  const float* rope_sin;
  __half* kcache;           // [L][nkv][max_seq][D]
  __half* vcache;
  float* resid;             // [M][H]  residual stream (fp32)
  float* q;                 // [M][nh*D] roped queries
  float* attn;              // [M][nh*D] attention output
  float* act;               // [M][I]   silu(gate) * up
  float* part;              // attention partials [nkv][nsplit][rows][D + 2]
  int* att_count;           // [nkv]
  float* logits;            // [M][V]
  float* arg_val;           // [nblocks][M]
  int* arg_idx;             // [nblocks][M]
  int* argmax;              // [M]
  int* done_count;          // [1]
  unsigned long long* bar_counter;  // [1] monotonic grid-barrier counter
  unsigned long long* epoch;        // [1] launches so far
  unsigned long long* trace;        // optional [L * 16] globaltimer stamps of block 0 (nullptr: off)
};

// Shared-memory layout (byte offsets), computed on the host per M.
struct Smem {
  int bars;    // 2 * MAX_SLOTS mbarriers (full, empty)
  int misc;    // small scalars (rstd, reductions, argmax, flags)
  int acc;     // [2 * ACC_PAIRS][M] fp32
  int xsum;    // [M][KSEG_MAX / 16] fp32
  int uni;     // union: staged x [M][kseg] | attention tiles
  int ring;    // nslots * SLOT_BYTES
  int nslots;
  int total;
};

struct MiscSmem {
  float rstd[MAX_M];
  float red[NCW][MAX_M];
  float best_val[MAX_M];
  int best_idx[MAX_M];
  float att_m[MAX_ROWS_ATT], att_l[MAX_ROWS_ATT], att_alpha[MAX_ROWS_ATT];
  int flag;
};

}  // namespace mk
