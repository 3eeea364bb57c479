// flint decode megakernel: host side. Unpacks the flat argument arrays that flint/megakernel.py
// builds, lays out shared memory per M, checks co-residency, and dispatches by M to the per-M
// launch functions of megakernel.cu (an unsupported M is an error, never another M's kernel).
// Every CUDA return code is checked; failures return nonzero and flint_mk_last_error() says why.
// Build: python -m flint.kernels.build      Test: pytest tests/test_megakernel.py
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <new>
#include <string>

#include "mk_common.cuh"
#include "mk_mma.cuh"

// (each M's object, and its copy for the int8 KV cache: FLINT_MK_KV8; for M <= kGu8MaxM also the ones with gate|up's
// integer dot, FLINT_MK_GU8: the _gu8 names of larger M are declared, never defined nor used)
#define MK_DECL(m)                                                                                          \
  extern "C" int flint_mk_launch_m##m(const mk::Params*, const mk::Smem*, int, const long long*, int,     \
                                      cudaStream_t, int);                                                  \
  extern "C" int flint_mk_occupancy_m##m(int, int*);                                                       \
  extern "C" int flint_mk_launch_m##m##_kv8(const mk::Params*, const mk::Smem*, int, const long long*, int, \
                                            cudaStream_t, int);                                            \
  extern "C" int flint_mk_occupancy_m##m##_kv8(int, int*);                                                 \
  extern "C" int flint_mk_launch_m##m##_gu8(const mk::Params*, const mk::Smem*, int, const long long*, int, \
                                            cudaStream_t, int);                                            \
  extern "C" int flint_mk_occupancy_m##m##_gu8(int, int*);                                                 \
  extern "C" int flint_mk_launch_m##m##_gu8_kv8(const mk::Params*, const mk::Smem*, int, const long long*, \
                                                int, cudaStream_t, int);                                   \
  extern "C" int flint_mk_occupancy_m##m##_gu8_kv8(int, int*);
MK_DECL(1) MK_DECL(2) MK_DECL(3) MK_DECL(4) MK_DECL(5) MK_DECL(6) MK_DECL(7) MK_DECL(8)
// M = 1, 2 with gate|up's integer dot: launched for models in groups of 128 (the integer dot at M = 3 / 4 cost +2.8% /
// +2.4% a step against the fp16 dot, 2026-12-02: docs/megakernel-log.md)
constexpr int kGu8MaxM = 2;
// M = 1 for long contexts (FLINT_MK_LONG): attention in warp groups with their own K/V buffers (TMA), own layout
extern "C" int flint_mk_launch_m1_long(const mk::Params*, const mk::Smem*, int, const long long*, int, cudaStream_t, int);
extern "C" int flint_mk_occupancy_m1_long(int, int*);
extern "C" int flint_mk_launch_m1_gu8_long(const mk::Params*, const mk::Smem*, int, const long long*, int, cudaStream_t, int);
extern "C" int flint_mk_occupancy_m1_gu8_long(int, int*);
// the M = 1 variants' copies for the int8 KV cache
extern "C" int flint_mk_launch_m1_long_kv8(const mk::Params*, const mk::Smem*, int, const long long*, int, cudaStream_t, int);
extern "C" int flint_mk_occupancy_m1_long_kv8(int, int*);
extern "C" int flint_mk_launch_m1_gu8_long_kv8(const mk::Params*, const mk::Smem*, int, const long long*, int, cudaStream_t,
                                               int);
extern "C" int flint_mk_occupancy_m1_gu8_long_kv8(int, int*);

typedef int (*launch_fn)(const mk::Params*, const mk::Smem*, int, const long long*, int, cudaStream_t, int);
typedef int (*occ_fn)(int, int*);
static const launch_fn kLaunch[mk::MAX_M + 1] = {nullptr,
                                                 flint_mk_launch_m1, flint_mk_launch_m2, flint_mk_launch_m3,
                                                 flint_mk_launch_m4, flint_mk_launch_m5, flint_mk_launch_m6,
                                                 flint_mk_launch_m7, flint_mk_launch_m8};
static const launch_fn kLaunch8[mk::MAX_M + 1] = {nullptr,
                                                  flint_mk_launch_m1_kv8, flint_mk_launch_m2_kv8, flint_mk_launch_m3_kv8,
                                                  flint_mk_launch_m4_kv8, flint_mk_launch_m5_kv8, flint_mk_launch_m6_kv8,
                                                  flint_mk_launch_m7_kv8, flint_mk_launch_m8_kv8};
static const occ_fn kOcc[mk::MAX_M + 1] = {nullptr,
                                           flint_mk_occupancy_m1, flint_mk_occupancy_m2, flint_mk_occupancy_m3,
                                           flint_mk_occupancy_m4, flint_mk_occupancy_m5, flint_mk_occupancy_m6,
                                           flint_mk_occupancy_m7, flint_mk_occupancy_m8};
static const occ_fn kOcc8[mk::MAX_M + 1] = {nullptr,
                                            flint_mk_occupancy_m1_kv8, flint_mk_occupancy_m2_kv8,
                                            flint_mk_occupancy_m3_kv8, flint_mk_occupancy_m4_kv8,
                                            flint_mk_occupancy_m5_kv8, flint_mk_occupancy_m6_kv8,
                                            flint_mk_occupancy_m7_kv8, flint_mk_occupancy_m8_kv8};

static const launch_fn kLaunchGu8[2][kGu8MaxM + 1] = {
    {nullptr, flint_mk_launch_m1_gu8, flint_mk_launch_m2_gu8},
    {nullptr, flint_mk_launch_m1_gu8_kv8, flint_mk_launch_m2_gu8_kv8}};
static const occ_fn kOccGu8[2][kGu8MaxM + 1] = {
    {nullptr, flint_mk_occupancy_m1_gu8, flint_mk_occupancy_m2_gu8},
    {nullptr, flint_mk_occupancy_m1_gu8_kv8, flint_mk_occupancy_m2_gu8_kv8}};

static thread_local char g_err[512];

// the long-context objects run from four tiles per split on: their per-item setup (fence, mbarrier init, the first
// TMA tiles' wait, the warps' merge) against the short objects' cp.async tiles: 1.0854 at 2 tiles, 0.9916 at 4
// (ab_long_groups_2026-12-02.md)
static constexpr int kLongFromTiles = 4;

static int fail(const char* msg, int code = 1) {
  snprintf(g_err, sizeof(g_err), "%s", msg);
  return code ? code : 1;
}
static int cuda_fail(const char* what, int e) {
  snprintf(g_err, sizeof(g_err), "%s: %s (%d)", what, cudaGetErrorString((cudaError_t)e), e);
  return e ? e : 1;
}

struct Pipe;  // (the pipelined masked step's shared words, below)

struct Handle {
  mk::Params p;
  mk::Smem sl[mk::MAX_M + 1];
  bool ready[mk::MAX_M + 1];
  mk::Smem sl_long;  // the long-context M = 1 objects' layout (kAttGroups x kAttGroupBufs K/V tile buffers)
  bool ready_long;
  int* h_argmax;  // pinned
  int smem_optin;
  Pipe* pipe_h = nullptr;  // the pipelined masked step (flint_mk_pipe_*): mapped pinned memory, host and device views
  Pipe* pipe_d = nullptr;
  long long* pipe_slot = nullptr;   // the token one pipelined step hands the next, on the device
  int pipe_seq = 0, pipe_pub = 0, pipe_read = 0;  // argmaxes enqueued, published, read
  bool pipe_live = false;  // a pipelined argmax since the last close: the slot holds its token
};

extern "C" const char* flint_mk_last_error() { return g_err; }

extern "C" int flint_mk_abi_version() { return 6; }

// What flint/megakernel.py checks at load against its own copies: the ABI version, the four constants it shares with
// the kernel (mk::MAX_M, KSEG_MAX, TILE_ROWS, ATT_T), and how many kernel objects this host part dispatches to
// (flint/kernels/build.py builds one per entry of its object list).
extern "C" void flint_mk_abi_constants(int* out6) {
  int objects = 4;  // the long-context M = 1 objects: m1long, m1gu8long and their kv8 copies
  for (int m = 1; m <= mk::MAX_M; ++m) objects += (kLaunch[m] != nullptr) + (kLaunch8[m] != nullptr);
  for (int m = 1; m <= kGu8MaxM; ++m) objects += (kLaunchGu8[0][m] != nullptr) + (kLaunchGu8[1][m] != nullptr);
  const int v[6] = {flint_mk_abi_version(), mk::MAX_M, mk::KSEG_MAX, mk::TILE_ROWS, mk::ATT_T, objects};
  for (int i = 0; i < 6; ++i) out6[i] = v[i];
}

// The long-context objects' K/V tensor maps (mk_common.cuh, Params::kv_map): the driver's encoder through the runtime's
// entry-point query (no link against libcuda). 0 = made; otherwise the long objects are not launched (the short ones
// run every context).
static int make_kv_maps(mk::Params& p) {
  p.kv_tma = 0;
  if (p.D != 64) return 1;  // (one 128-byte row per key: the swizzle's span)
  using encode_fn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q;
  if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess || !fn)
    return 1;
  // (the int8 cache: rows of D bytes into the landing buffers as they are, no swizzle: the conversion writes the
  // fp16 tile's XOR layout)
  const cuuint64_t dims[2] = {(cuuint64_t)p.D, (cuuint64_t)p.L * p.nkv * p.max_seq};
  const cuuint64_t strides[1] = {(cuuint64_t)p.D * (p.kv8 ? 1 : 2)};
  const cuuint32_t box[2] = {(cuuint32_t)p.D, (cuuint32_t)mk::ATT_T}, estr[2] = {1, 1};
  for (int i = 0; i < 2; ++i)
    if (((encode_fn)fn)(&p.kv_map[i], p.kv8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2,
                        i ? (void*)p.vcache : (void*)p.kcache, dims, strides, box, estr,
                        CU_TENSOR_MAP_INTERLEAVE_NONE, p.kv8 ? CU_TENSOR_MAP_SWIZZLE_NONE : CU_TENSOR_MAP_SWIZZLE_128B,
                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
      return 1;
  p.kv_tma = 1;
  return 0;
}

// The flat argument arrays of flint_mk_create, in order: their one definition. flint_mk_abi_layout names every slot,
// flint/megakernel.py packs its values by those names (and refuses a library that asks for a value it does not have).
enum class Slot { Int, LongLong, Ptr, Float };
struct Arg {
  const char* name;
  size_t offset;  // in mk::Params, mk::Mat (the kMatArgs) or the floats' mk::Params fields
  Slot type;
};
static const Arg kParamArgs[] = {
    {"H", offsetof(mk::Params, H), Slot::Int}, {"I", offsetof(mk::Params, I), Slot::Int},
    {"nh", offsetof(mk::Params, nh), Slot::Int}, {"nkv", offsetof(mk::Params, nkv), Slot::Int},
    {"D", offsetof(mk::Params, D), Slot::Int}, {"L", offsetof(mk::Params, L), Slot::Int},
    {"V", offsetof(mk::Params, V), Slot::Int}, {"max_seq", offsetof(mk::Params, max_seq), Slot::Int},
    {"use_rope", offsetof(mk::Params, use_rope), Slot::Int}, {"nblocks", offsetof(mk::Params, nblocks), Slot::Int},
    {"kv8", offsetof(mk::Params, kv8), Slot::Int}, {"nffn", offsetof(mk::Params, nffn), Slot::Int},
    {"nffn_pad", offsetof(mk::Params, nffn_pad), Slot::Int},
    {"ohead", offsetof(mk::Params, ohead), Slot::Int},  // (a slot of the argument layout: must be 0)
    {"embed", offsetof(mk::Params, embed), Slot::Ptr}, {"norms", offsetof(mk::Params, norms), Slot::Ptr},
    {"final_norm", offsetof(mk::Params, final_norm), Slot::Ptr},
    {"rope_cos", offsetof(mk::Params, rope_cos), Slot::Ptr}, {"rope_sin", offsetof(mk::Params, rope_sin), Slot::Ptr},
    {"kcache", offsetof(mk::Params, kcache), Slot::Ptr}, {"vcache", offsetof(mk::Params, vcache), Slot::Ptr},
    {"resid", offsetof(mk::Params, resid), Slot::Ptr}, {"kvscale", offsetof(mk::Params, kvscale), Slot::Ptr},
    {"attn", offsetof(mk::Params, attn), Slot::Ptr}, {"act", offsetof(mk::Params, act), Slot::Ptr},
    {"part", offsetof(mk::Params, part), Slot::Ptr}, {"att_count", offsetof(mk::Params, att_count), Slot::Ptr},
    {"logits", offsetof(mk::Params, logits), Slot::Ptr}, {"arg_val", offsetof(mk::Params, arg_val), Slot::Ptr},
    {"arg_idx", offsetof(mk::Params, arg_idx), Slot::Ptr}, {"argmax", offsetof(mk::Params, argmax), Slot::Ptr},
    {"done_count", offsetof(mk::Params, done_count), Slot::Ptr},
    {"bar_counter", offsetof(mk::Params, bar_counter), Slot::Ptr}, {"epoch", offsetof(mk::Params, epoch), Slot::Ptr},
    {"dpart", offsetof(mk::Params, dpart), Slot::Ptr}, {"trace", offsetof(mk::Params, trace), Slot::Ptr},
    {"qkvt", offsetof(mk::Params, qkvt), Slot::Ptr}};
// then each matrix's (mk::MAT_* order, named kMatNames) fields
static const char* const kMatNames[mk::NMAT] = {"qkv", "o", "gu", "down", "lm_head", "dslice"};
static const Arg kMatArgs[] = {
    {"base", offsetof(mk::Mat, base), Slot::Ptr}, {"layer_stride", offsetof(mk::Mat, layer_stride), Slot::LongLong},
    {"seg_stride", offsetof(mk::Mat, seg_stride), Slot::LongLong}, {"N", offsetof(mk::Mat, N), Slot::Int},
    {"K", offsetof(mk::Mat, K), Slot::Int}, {"G", offsetof(mk::Mat, G), Slot::Int},
    {"nseg", offsetof(mk::Mat, nseg), Slot::Int}, {"kseg", offsetof(mk::Mat, kseg), Slot::Int},
    {"srb", offsetof(mk::Mat, srb), Slot::Int}, {"nreal", offsetof(mk::Mat, nreal), Slot::Int}};
// the float array
static const Arg kFloatArgs[] = {
    {"eps", offsetof(mk::Params, eps), Slot::Float}, {"emb_mult", offsetof(mk::Params, emb_mult), Slot::Float},
    {"res_mult", offsetof(mk::Params, res_mult), Slot::Float},
    {"attn_scale", offsetof(mk::Params, attn_scale), Slot::Float},
    {"inv_logit_scale", offsetof(mk::Params, inv_logit_scale), Slot::Float}};
constexpr int kNParamArgs = sizeof(kParamArgs) / sizeof(Arg), kNMatArgs = sizeof(kMatArgs) / sizeof(Arg);
constexpr int kNIntArgs = kNParamArgs + mk::NMAT * kNMatArgs, kNFloatArgs = sizeof(kFloatArgs) / sizeof(Arg);

static void put(void* base, const Arg& a, long long v) {
  char* at = (char*)base + a.offset;
  switch (a.type) {
    case Slot::Int: *(int*)at = (int)v; break;
    case Slot::LongLong: *(long long*)at = v; break;
    case Slot::Ptr: *(void**)at = (void*)(uintptr_t)v; break;
    case Slot::Float: break;  // (the float array: put_float)
  }
}

// "name name ... | name ...": the int array's slots (a matrix's as "qkv.base"), then the float array's
extern "C" const char* flint_mk_abi_layout() {
  static const std::string layout = [] {
    std::string s;
    for (const Arg& a : kParamArgs) s += std::string(a.name) + " ";
    for (const char* m : kMatNames)
      for (const Arg& a : kMatArgs) s += std::string(m) + "." + a.name + " ";
    s += "|";
    for (const Arg& a : kFloatArgs) s += std::string(" ") + a.name;
    return s;
  }();
  return layout.c_str();
}

extern "C" int flint_mk_create(const long long* ia, int n_i, const double* fa, int n_f, void** out) {
  *out = nullptr;
  if (n_i != kNIntArgs || n_f != kNFloatArgs) {
    snprintf(g_err, sizeof(g_err), "flint_mk_create: expected %d int and %d float args, got %d and %d", kNIntArgs,
             kNFloatArgs, n_i, n_f);
    return 1;
  }
  Handle* h = new (std::nothrow) Handle();
  if (!h) return fail("flint_mk_create: out of host memory");
  mk::Params& p = h->p;
  int k = 0;
  for (const Arg& a : kParamArgs) put(&p, a, ia[k++]);
  for (int m = 0; m < mk::NMAT; ++m) {
    mk::Mat& mt = p.mat[m];
    for (const Arg& a : kMatArgs) put(&mt, a, ia[k++]);
    // absent: MAT_D with FFN split-K, MAT_DS without (never touched by the kernel then)
    const bool absent = (m == mk::MAT_D && p.nffn > 0) || (m == mk::MAT_DS && p.nffn == 0);
    if (absent) {
      mt = mk::Mat{};
      mt.G = 32; mt.gshift = 5; mt.nseg = 1;
      continue;
    }
    mt.gshift = mt.G == 32 ? 5 : mt.G == 64 ? 6 : mt.G == 128 ? 7 : -1;
    mt.ntiles = mt.N / mk::TILE_ROWS;
    // rows at 16 bytes (a slice: at its code loads' width, G / 8 bytes)
    const int row_align = m == mk::MAT_DS ? (mt.G >> 3) : 16;
    if (mt.gshift < 0 || mt.N % mk::TILE_ROWS || mt.nreal > mt.N || mt.nreal <= mt.N - mk::TILE_ROWS ||
        mt.kseg % mt.G || mt.kseg > mk::KSEG_MAX || mt.kseg * mt.nseg != mt.K || mt.srb % row_align ||
        mt.srb < mt.kseg / 2 + 4 * (mt.kseg / mt.G) || ((uintptr_t)mt.base % 16) || !mt.base) {
      snprintf(g_err, sizeof(g_err), "flint_mk_create: matrix %d has an unsupported layout (N=%d K=%d G=%d kseg=%d)", m,
               mt.N, mt.K, mt.G, mt.kseg);
      delete h;
      return 1;
    }
  }
  make_kv_maps(p);  // (p.kv_tma = 0 where it cannot: then only the short objects run)
  if (p.nffn) {  // FFN split-K: slice f = gate|up tiles [f T, (f + 1) T) = act [f kf, (f + 1) kf)
    const mk::Mat& gu = p.mat[mk::MAT_GU];
    const mk::Mat& ds = p.mat[mk::MAT_DS];
    if (p.nffn < 0 || gu.ntiles % p.nffn || ds.K * p.nffn != p.I || 2 * ds.K != gu.ntiles / p.nffn * mk::TILE_ROWS ||
        ds.N != p.mat[mk::MAT_O].N || p.nffn_pad % 8 || p.nffn_pad < p.nffn || p.nffn_pad >= p.nffn + 8 ||
        !p.dpart) {
      snprintf(g_err, sizeof(g_err), "flint_mk_create: FFN split-K plan does not fit (nffn=%d, slice K=%d, "
               "gate|up tiles=%d, intermediate=%d)", p.nffn, ds.K, gu.ntiles, p.I);
      delete h;
      return 1;
    }
  }
  for (int i = 0; i < kNFloatArgs; ++i) *(float*)((char*)&p + kFloatArgs[i].offset) = (float)fa[i];
  if (p.D != 64 && p.D != 128) { delete h; return fail("flint_mk_create: head_dim must be 64 or 128"); }

  int dev, e;
  if ((e = cudaGetDevice(&dev))) { delete h; return cuda_fail("cudaGetDevice", e); }
  int nsm = 0, optin = 0, coop = 0;
  if ((e = cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, dev))) { delete h; return cuda_fail("attr", e); }
  if ((e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev))) { delete h; return cuda_fail("attr", e); }
  if ((e = cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev))) { delete h; return cuda_fail("attr", e); }
  if (!coop) { delete h; return fail("flint_mk_create: device does not support cooperative launch"); }
  if (p.nblocks <= 0 || p.nblocks > nsm) p.nblocks = nsm;
  if (p.ohead) { delete h; return fail("flint_mk_create: argument ohead must be 0 (no such kernel path)"); }
  if (p.kv8 != 0 && (p.kv8 != 1 || !p.kvscale || p.D % 16)) {
    delete h;
    return fail("flint_mk_create: kv8 must be 0 or 1, and the int8 cache needs its scales and head_dim % 16 == 0");
  }
  if (p.nffn > p.nblocks) {
    snprintf(g_err, sizeof(g_err), "flint_mk_create: FFN split-K needs %d blocks, the grid has %d", p.nffn, p.nblocks);
    delete h;
    return 1;
  }
  h->smem_optin = optin;
  for (int m = 0; m < mk::NMAT; ++m)  // block_tiles divides ntiles * (b + 1) in 32 bits
    if ((long long)p.mat[m].ntiles * (p.nblocks + 1) >= (1ll << 31)) {
      snprintf(g_err, sizeof(g_err), "flint_mk_create: matrix %d has too many rows (%d) for the 32-bit work split", m,
               p.mat[m].N);
      delete h;
      return 1;
    }

  const int g = p.nh / p.nkv;
  auto al = [](int x) { return (x + 127) & ~127; };
  auto cdiv = [](int a, int b) { return (a + b - 1) / b; };
  int slot = 0;
  for (int m = 0; m < mk::NMAT; ++m) slot = slot > mk::TILE_ROWS * p.mat[m].srb ? slot : mk::TILE_ROWS * p.mat[m].srb;
  slot = al(slot);
  char why1[256] = "";
  // M = 1 .. MAX_M with two attention tile buffers, then (index 0) the long-context M = 1 layout
  for (int M0 = 1; M0 <= mk::MAX_M + 1; ++M0) {
    const bool lng = M0 == mk::MAX_M + 1;
    const int M = lng ? 1 : M0, nbuf = lng ? (mk::kAttGroups * mk::kAttGroupBufs) : 2;
    mk::Smem& s = lng ? h->sl_long : h->sl[M];
    (lng ? h->ready_long : h->ready[M]) = false;
    // per matrix: stage the whole K once (multi-segment matrices whose 2 x M token rows fit XALL_BYTES),
    // and the K parts per tile that balance this block's tiles over the 15 consumer warps
    int kx = 0, ngx = 0, acc_tiles = 0, max_acc_tiles = 0, max_parts = 1;
    for (int m = 0; m < mk::NMAT; ++m) {
      const mk::Mat& mt = p.mat[m];
      if (!mt.base) { s.xall[m] = 0; s.nparts[m] = 1; continue; }
      s.xall[m] = mt.nseg > 1 && 2 * M * mkmma::mma_x_stride_bytes(mt.K) <= mk::XALL_BYTES;
      const int kst = s.xall[m] ? mt.K : mt.kseg;
      kx = kx > kst ? kx : kst;
      ngx = ngx > kst / mt.G ? ngx : kst / mt.G;
      const int T = cdiv(mt.ntiles, p.nblocks);
      if (mt.nseg > 1 && T * mt.nseg > acc_tiles) acc_tiles = T * mt.nseg;
      if (mt.nseg > 1 && T > max_acc_tiles) max_acc_tiles = T;
      const int ng = mt.kseg / mt.G;
      int cap = mk::PART_FLOATS / M;
      cap = cap < mk::MAX_PARTS ? cap : mk::MAX_PARTS;
      cap = cap < ng ? cap : ng;
      int best = 1;
      long long best_cost = -1;
      // cost of a warp's units: its groups plus a unit's hand-off, ~2 groups' dot (gate|up on Granite at S = 3
      // instead of 5 measured -0.6% at M = 1 and -0.8% at M = 2; with a hand-off of 1 the model picked 5)
      for (int S = 1; S <= cap; ++S) {
        const long long cost = (long long)cdiv(T * S, mk::NCW) * (cdiv(ng, S) + 2);
        if (best_cost < 0 || cost < best_cost) { best_cost = cost; best = S; }
      }
      s.nparts[m] = best;
      max_parts = max_parts > best ? max_parts : best;
    }
    s.xstride = mkmma::mma_x_stride_bytes(kx);
    s.ds_cpt = p.nffn ? slot / (mk::TILE_ROWS * p.mat[mk::MAT_DS].srb) : 0;
    const int own_tiles = cdiv(p.mat[mk::MAT_O].ntiles, p.nblocks);
    int off = 0;
    s.bars = off; off += al(3 * mk::MAX_SLOTS * 8);
    s.misc = off; off += al((int)sizeof(mk::MiscSmem));
    s.acc = off; off += al(acc_tiles * mk::TILE_ROWS * M * 4);
    s.own = off; off += al(own_tiles * mk::TILE_ROWS * M * 4);
    off += al(2 * own_tiles * mk::TILE_ROWS * M * 8);  // (MiscSmem::ownfx's int64 rows, right after)
    s.rope = off; off += al(2 * M * (p.D / 2) * 4);
    s.actb = off; off += p.nffn ? al(M * p.mat[mk::MAT_DS].K * 4) : 0;
    s.xsum = off; off += al(ngx * mkmma::MMA_XSUM_FLOATS * 4);
    const int R = g * M;
    // (the long layout: its tiles' TMA mbarriers after the scores, and the tiles 1024-aligned for the 128-byte swizzle)
    // (mk_attention.cuh's layout: the fp16 tile buffers, with the int8 cache its landing buffers, q, o, scores, the
    // long layout's mbarriers; with the int8 cache the long layout has one fp16 buffer per warp group)
    const int nfb = lng && p.kv8 ? mk::kAttGroups : nbuf;
    const int att = nfb * mk::ATT_T * p.D * 2 * 2 + (p.kv8 ? nbuf * mk::kv8_land_bytes(p.D) : 0) + R * p.D * 4 * 2 +
                    R * mk::ATT_T * 4 + (lng ? nbuf * 8 : 0);
    const int xs = 2 * M * s.xstride;
    const int red = p.nffn ? M * own_tiles * (p.nffn_pad / 8) * mk::TILE_ROWS * 4 : 0;  // ffn_down_reduce's chunk sums
    int un = att > xs ? att : xs;
    un = un > red ? un : red;
    if (lng) off = (off + 1023) & ~1023;
    s.uni = off; off += al(un);
    const int pstride = max_parts * mk::TILE_ROWS * M * 4;  // bytes per slot of partial sums
    s.parts = off;
    s.pstride = pstride / 4;
    s.slot = slot;
    int ns = (optin - off - 1024) / (slot + pstride);
    if (ns > mk::MAX_SLOTS) ns = mk::MAX_SLOTS;
    if (ns < 0) ns = 0;
    off += al(ns * pstride);
    off = (off + 1023) & ~1023;
    s.ring = off;
    s.nslots = ns;
    s.total = off + ns * slot;
    const bool fits = R <= mk::MAX_ROWS_ATT && ns >= 3 && s.total <= optin && max_acc_tiles <= mk::MAX_ACC_TILES;
    if (M0 == 1)  // (what the refusal below names when M = 1 does not fit)
      snprintf(why1, sizeof(why1), "q rows a kv head %d of at most %d; ring slots %d of at least 3; %d of %d bytes; "
               "tiles a block of a multi-segment matrix %d of at most %d", R, mk::MAX_ROWS_ATT, ns, s.total, optin,
               max_acc_tiles, mk::MAX_ACC_TILES);
    // (the long objects' attention: the rows are the mma's 8 columns, the head dimension 64)
    if (lng) h->ready_long = fits && h->ready[1] && R <= 8 && p.D == 64;
    else h->ready[M] = fits;
  }
  // The counted residual's count field is 8 bits: a word missing any 1..nffn + 1 adds of its layer (the FFN blocks'
  // and the o owner's) must not show the expected count mod 256, so nffn + 1 < 256. (A reader never sees a word more
  // than one layer stale: its own previous staging saw every add of the layer before.)
  if (p.nffn >= 255) {
    delete h;
    return fail("flint_mk_create: the counted fixed-point residual counts at most 254 FFN blocks");
  }
  if (!h->ready[1]) {
    snprintf(g_err, sizeof(g_err), "flint_mk_create: this shape does not fit shared memory even at M=1 (%s)", why1);
    delete h;
    return 1;
  }
  if ((e = cudaMallocHost((void**)&h->h_argmax, mk::MAX_M * sizeof(int)))) { delete h; return cuda_fail("cudaMallocHost", e); }
  *out = h;
  return 0;
}

extern "C" void flint_mk_destroy(void* hv) {
  Handle* h = (Handle*)hv;
  if (!h) return;
  if (h->h_argmax) cudaFreeHost(h->h_argmax);
  if (h->pipe_h) {  // an argmax still waiting for its mask would read freed memory: release it and wait
    if (h->pipe_pub < h->pipe_seq) {
      __atomic_store_n((int*)h->pipe_h, h->pipe_seq, __ATOMIC_RELEASE);  // (Pipe::flag, the first word)
      cudaDeviceSynchronize();
    }
    cudaFreeHost(h->pipe_h);
  }
  if (h->pipe_slot) cudaFree(h->pipe_slot);
  delete h;
}

extern "C" int flint_mk_max_m(void* hv) {
  Handle* h = (Handle*)hv;
  int m = 0;
  while (m < mk::MAX_M && h->ready[m + 1]) ++m;
  return m;
}

extern "C" int flint_mk_smem_info(void* hv, int M, int* out4) {
  Handle* h = (Handle*)hv;
  if (M < 1 || M > mk::MAX_M) return fail("flint_mk_smem_info: bad M");
  out4[0] = h->sl[M].total; out4[1] = h->sl[M].nslots; out4[2] = h->sl[M].slot; out4[3] = h->p.nblocks;
  return 0;
}

// The long-context M = 1 layout: (ready, shared-memory bytes, ring slots, K/V tile buffers, tiles per split from which
// a launch uses it)
extern "C" int flint_mk_long_layout_info(void* hv, int* out5) {
  Handle* h = (Handle*)hv;
  out5[0] = h->ready_long; out5[1] = h->sl_long.total; out5[2] = h->sl_long.nslots; out5[3] = (mk::kAttGroups * mk::kAttGroupBufs);
  out5[4] = kLongFromTiles;
  return 0;
}

extern "C" int flint_mk_kv_tma(void* hv) { return ((Handle*)hv)->p.kv_tma; }

// 64-key tiles each attention split walks at context length Ltot (attention_stage's split rule)
static int att_tiles_per_split(const mk::Params& p, int Ltot) {
  const int ntiles = (Ltot + mk::ATT_T - 1) / mk::ATT_T;
  int nsplit = ntiles < p.nblocks / p.nkv ? ntiles : p.nblocks / p.nkv;
  if (nsplit < 1) nsplit = 1;
  return (ntiles + nsplit - 1) / nsplit;
}

static int launch(Handle* h, int M, int start, const long long* tokens, int tok0, cudaStream_t stream) {
  if (M < 1 || M > mk::MAX_M || !kLaunch[M]) {
    snprintf(g_err, sizeof(g_err), "megakernel: M=%d tokens per step is not compiled (1..%d)", M, mk::MAX_M);
    return 1;
  }
  if (!h->ready[M]) {
    snprintf(g_err, sizeof(g_err), "megakernel: M=%d does not fit this model's shared-memory layout "
             "(query heads per kv head * M must be <= %d)", M, mk::MAX_ROWS_ATT);
    return 1;
  }
  if (start < 0 || start + M > h->p.max_seq) {
    snprintf(g_err, sizeof(g_err), "megakernel: positions %d..%d exceed max_seq_len %d", start, start + M - 1,
             h->p.max_seq);
    return 1;
  }
  // M <= kGu8MaxM on a model in groups of 128: the objects with gate|up's integer dot (M = 1 since v15, M = 2 v30)
  const bool gu8 = M <= kGu8MaxM && h->p.mat[mk::MAT_GU].G == 128;
  // M = 1 whose attention splits walk several tiles: the long-context object (when its layout fits)
  // (their K/V tiles come by TMA: only where the tensor maps were made)
  const bool lng = M == 1 && h->ready_long && h->p.kv_tma && att_tiles_per_split(h->p, start + M) >= kLongFromTiles;
  // (the int8 KV cache: the kv8 copies of the same objects)
  const bool k8 = h->p.kv8;
  const launch_fn lgu8 = gu8 ? kLaunchGu8[k8][M] : nullptr;
  const occ_fn ogu8 = gu8 ? kOccGu8[k8][M] : nullptr;
  const launch_fn lf = k8 ? (lng ? (gu8 ? flint_mk_launch_m1_gu8_long_kv8 : flint_mk_launch_m1_long_kv8)
                                 : gu8 ? lgu8 : kLaunch8[M])
                          : lng ? (gu8 ? flint_mk_launch_m1_gu8_long : flint_mk_launch_m1_long)
                                : gu8 ? lgu8 : kLaunch[M];
  const occ_fn of = k8 ? (lng ? (gu8 ? flint_mk_occupancy_m1_gu8_long_kv8 : flint_mk_occupancy_m1_long_kv8)
                              : gu8 ? ogu8 : kOcc8[M])
                       : lng ? (gu8 ? flint_mk_occupancy_m1_gu8_long : flint_mk_occupancy_m1_long)
                             : gu8 ? ogu8 : kOcc[M];
  static bool attr_done[2][mk::MAX_M + 1] = {{false}}, attr_done_gu8[2][kGu8MaxM + 1] = {{false}};
  static bool attr_done_long[2][2] = {{false, false}, {false, false}};
  bool& done = lng ? attr_done_long[k8][gu8] : gu8 ? attr_done_gu8[k8][M] : attr_done[k8][M];
  int set_attr = 0;
  if (!done) {
    int bps = 0;
    int e = of(h->smem_optin, &bps);
    if (e) return cuda_fail("megakernel occupancy query", e);
    if (bps < 1) return fail("megakernel: kernel cannot be resident with the requested shared memory");
    done = true;  // the occupancy query raised the kernel's smem limit to the opt-in maximum
  }
  int e = lf(&h->p, lng ? &h->sl_long : &h->sl[M], start, tokens, tok0, stream, set_attr);
  if (e) return cuda_fail("megakernel launch", e);
  return 0;
}

extern "C" int flint_mk_forward(void* hv, int M, const long long* tokens_dev, int start, void* stream) {
  return launch((Handle*)hv, M, start, tokens_dev, 0, (cudaStream_t)stream);
}

// Greedy decoding of n tokens with no host round trip between them: step i > 0 reads its input token from
// hist[i - 1], where launch i - 1 wrote its argmax (Params::argmax_out, as int64), so the n launches queue back to
// back on the stream with nothing between them. hist: n int64 in device memory. Nothing is synchronized here: the
// caller reads hist when it needs the tokens. Positions pos .. pos + n - 1 are checked before anything is launched.
extern "C" int flint_mk_greedy_run(void* hv, int token, int pos, int n, long long* hist, void* stream) {
  Handle* h = (Handle*)hv;
  cudaStream_t s = (cudaStream_t)stream;
  if (n < 1 || hist == nullptr) return fail("megakernel greedy_run: needs n >= 1 and a history buffer");
  if (pos < 0 || (long long)pos + n > h->p.max_seq) {
    snprintf(g_err, sizeof(g_err), "megakernel: positions %d..%lld exceed max_seq_len %d", pos,
             (long long)pos + n - 1, h->p.max_seq);
    return 1;
  }
  for (int i = 0; i < n; ++i) {
    h->p.argmax_out = hist + i;  // (the launch copies the parameters: each launch writes its own entry)
    int e = i == 0 ? launch(h, 1, pos, nullptr, token, s) : launch(h, 1, pos + i, hist + (i - 1), 0, s);
    h->p.argmax_out = nullptr;
    if (e) return e;
  }
  return 0;
}

// M = 1 greedy step: token by value, argmax back through pinned memory; one stream sync.
extern "C" int flint_mk_finish_argmax(void* hv, const void* mask, void* stream, int* out);  // (below)

extern "C" int flint_mk_greedy(void* hv, int token, int pos, void* stream, int* out) {
  const int e = launch((Handle*)hv, 1, pos, nullptr, token, (cudaStream_t)stream);
  return e ? e : flint_mk_finish_argmax(hv, nullptr, stream, out);
}

// ---- structured output: the argmax over the allowed tokens only. The megakernel's own argmax stays unmasked (no cost
// to plain decoding); this one block re-reads the logits the step wrote (V floats, L2-resident) with the vocabulary
// bitmask (bit i & 31 of word i >> 5: token i allowed) and writes the first index of the largest allowed logit, or -1
// when the mask allows nothing.
static constexpr int kMaskThreads = 1024;

// The pipelined form (flint_mk_pipe_*, below) reads its mask from mapped host memory once the host has published
// it: `pipe` non-null makes thread 0 wait for pipe->flag >= seq (an acquire at system scope, the host's release
// store after it filled the mask), read the mask with volatile loads, and hand the token to the next step through
// `slot` (device int64, the next launch's input) and to the host through pipe->tok / pipe->done.
struct Pipe {
  int flag;  // host -> device: the mask for argmax `flag` is written
  int done;  // device -> host: argmax `done` wrote tok[done & 1]
  int tok[2];
  uint32_t mask[1];  // ceil(V / 32) words (allocated past the struct)
};
static constexpr long long kPipeWaitNs = 60ll * 1000 * 1000 * 1000;  // a host that never publishes: fail, not hang

__device__ __forceinline__ int ld_acquire_sys(const int* p) {
  int v;
  asm volatile("ld.acquire.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_sys(int* p, int v) {
  asm volatile("st.release.sys.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned long long globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint4 ld_relaxed_sys_v4(const uint32_t* p) {
  uint4 v;
  asm volatile("ld.relaxed.sys.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}

__global__ void __launch_bounds__(kMaskThreads) masked_argmax_kernel(const float* logits, const uint32_t* mask, int V,
                                                                     int* out, Pipe* pipe, int seq, long long* slot) {
  extern __shared__ uint32_t staged[];  // the piped mask, copied in once (one round of 16-byte loads over the bus)
  __shared__ int timed_out;
  if (pipe != nullptr) {
    if (threadIdx.x == 0) {
      const unsigned long long t0 = globaltimer();
      int late = 0;
      while (ld_acquire_sys(&pipe->flag) - seq < 0) {
        if (globaltimer() - t0 > (unsigned long long)kPipeWaitNs) { late = 1; break; }
        __nanosleep(128);
      }
      timed_out = late;
    }
    __syncthreads();
    const int words = (V + 31) / 32;
    for (int w = threadIdx.x * 4; w < words; w += kMaskThreads * 4) {
      if (w + 4 <= words) {
        const uint4 v = ld_relaxed_sys_v4(pipe->mask + w);
        staged[w] = v.x; staged[w + 1] = v.y; staged[w + 2] = v.z; staged[w + 3] = v.w;
      } else {
        for (int j = w; j < words; ++j) staged[j] = ((const volatile uint32_t*)pipe->mask)[j];
      }
    }
    __syncthreads();
    mask = staged;
  }
  float bv = -INFINITY;
  int bi = 0x7fffffff;
  for (int i = threadIdx.x; i < V; i += kMaskThreads) {  // ascending per thread: ">" keeps the first of equals
    const float v = logits[i];
    if (((mask[i >> 5] >> (i & 31)) & 1u) && (v > bv || bi == 0x7fffffff)) { bv = v; bi = i; }
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (oi != 0x7fffffff && (bi == 0x7fffffff || ov > bv || (ov == bv && oi < bi))) { bv = ov; bi = oi; }
  }
  __shared__ float sv[kMaskThreads / 32];
  __shared__ int si[kMaskThreads / 32];
  if ((threadIdx.x & 31) == 0) { sv[threadIdx.x >> 5] = bv; si[threadIdx.x >> 5] = bi; }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kMaskThreads / 32; ++w)
      if (si[w] != 0x7fffffff && (bi == 0x7fffffff || sv[w] > bv || (sv[w] == bv && si[w] < bi))) { bv = sv[w]; bi = si[w]; }
    const int tok = bi == 0x7fffffff ? -1 : bi;
    if (pipe == nullptr) {
      *out = tok;
    } else {
      const int r = timed_out ? -2 : tok;
      *slot = r < 0 ? 0 : r;  // (a valid token for the step behind it; the host raises on r < 0)
      pipe->tok[seq & 1] = r;
      st_release_sys(&pipe->done, seq);
    }
  }
}

// The M = 1 step in two halves, so that the host can work between them (structured output fills the next mask while
// the step runs): flint_mk_launch_token enqueues the step for `token` at `pos` and returns; flint_mk_finish_argmax
// enqueues the argmax over `mask` (device memory, ceil(V / 32) words; nullptr: the step's own argmax), copies it back
// and synchronizes the stream. *out = -1: the mask allows no token.
extern "C" int flint_mk_launch_token(void* hv, int token, int pos, void* stream) {
  return launch((Handle*)hv, 1, pos, nullptr, token, (cudaStream_t)stream);
}

extern "C" int flint_mk_finish_argmax(void* hv, const void* mask, void* stream, int* out) {
  Handle* h = (Handle*)hv;
  cudaStream_t s = (cudaStream_t)stream;
  int e;
  if ((uintptr_t)mask & 3) return fail("megakernel finish_argmax: the mask is not 4-byte aligned");
  if (mask != nullptr) {
    masked_argmax_kernel<<<1, kMaskThreads, 0, s>>>(h->p.logits, (const uint32_t*)mask, h->p.V, h->p.argmax,
                                                      nullptr, 0, nullptr);
    if ((e = cudaGetLastError())) return cuda_fail("masked argmax launch", e);
  }
  if ((e = cudaMemcpyAsync(h->h_argmax, h->p.argmax, sizeof(int), cudaMemcpyDeviceToHost, s)))
    return cuda_fail("megakernel argmax copy", e);
  if ((e = cudaStreamSynchronize(s))) return cuda_fail("megakernel step", e);
  *out = h->h_argmax[0];
  return 0;
}

// ---- structured output, pipelined: no host round trip between the steps. flint_mk_pipe_step enqueues the M = 1 step
// at `pos` (its token: `token`, or with from_slot the previous pipelined argmax's, read on the device) and behind it
// the masked argmax numbered `seq`, which waits for the host to publish that step's mask. The host fills the mask
// (flint_mk_pipe_mask: ceil(V / 32) words of mapped pinned memory), publishes it (flint_mk_pipe_publish), and reads
// the token (flint_mk_pipe_token); by then the next step, enqueued before the mask was filled, is already running.
// One argmax is outstanding at a time, so one mask buffer serves: the host fills mask n + 1 only after reading token
// n, which argmax n writes after its last read of the mask. flint_mk_pipe_close publishes every enqueued argmax and
// drains the stream (a consumer that stops mid-way).
static int pipe_open(Handle* h) {
  if (h->pipe_h) return 0;
  if ((h->p.V + 31) / 32 * 4 > 48 * 1024)  // (the argmax copies the mask into its default shared memory)
    return fail("megakernel pipe: a vocabulary above 393216 tokens does not fit the masked argmax's shared memory");
  const size_t bytes = sizeof(Pipe) + sizeof(uint32_t) * (size_t)((h->p.V + 31) / 32);
  int e;
  if ((e = cudaHostAlloc((void**)&h->pipe_h, bytes, cudaHostAllocMapped))) return cuda_fail("pipe cudaHostAlloc", e);
  memset(h->pipe_h, 0, bytes);
  if ((e = cudaHostGetDevicePointer((void**)&h->pipe_d, h->pipe_h, 0))) return cuda_fail("pipe device pointer", e);
  if ((e = cudaMalloc((void**)&h->pipe_slot, sizeof(long long)))) return cuda_fail("pipe slot", e);
  h->pipe_seq = h->pipe_pub = h->pipe_read = 0;
  return 0;
}

extern "C" void* flint_mk_pipe_mask(void* hv) {
  Handle* h = (Handle*)hv;
  return pipe_open(h) ? nullptr : (void*)h->pipe_h->mask;
}

extern "C" int flint_mk_pipe_step(void* hv, int token, int pos, int from_slot, void* stream) {
  Handle* h = (Handle*)hv;
  cudaStream_t s = (cudaStream_t)stream;
  int e;
  if ((e = pipe_open(h))) return e;
  if (from_slot && !h->pipe_live) return fail("megakernel pipe: a step from the slot with no pipelined argmax before it");
  if ((e = launch(h, 1, pos, from_slot ? h->pipe_slot : nullptr, token, s))) return e;
  h->pipe_live = true;
  const int seq = ++h->pipe_seq;
  const size_t staged = sizeof(uint32_t) * (size_t)((h->p.V + 31) / 32);
  masked_argmax_kernel<<<1, kMaskThreads, staged, s>>>(h->p.logits, nullptr, h->p.V, nullptr, h->pipe_d, seq,
                                                       h->pipe_slot);
  if ((e = cudaGetLastError())) return cuda_fail("pipe argmax launch", e);
  return 0;
}

extern "C" int flint_mk_pipe_publish(void* hv) {
  Handle* h = (Handle*)hv;
  if (!h->pipe_h || h->pipe_pub >= h->pipe_seq) return fail("megakernel pipe: publish with no argmax waiting");
  __atomic_store_n(&h->pipe_h->flag, ++h->pipe_pub, __ATOMIC_RELEASE);
  return 0;
}

extern "C" int flint_mk_pipe_token(void* hv, void* stream, int* out) {
  Handle* h = (Handle*)hv;
  if (!h->pipe_h || h->pipe_read >= h->pipe_pub) return fail("megakernel pipe: no published argmax to read");
  const int want = h->pipe_read + 1;
  for (unsigned spins = 1;; ++spins) {  // a busy wait, as cudaStreamSynchronize's default; the stream's errors end it
    if (__atomic_load_n(&h->pipe_h->done, __ATOMIC_ACQUIRE) - want >= 0) break;
    if ((spins & 1023) == 0) {
      const int e = cudaStreamQuery((cudaStream_t)stream);
      if (e != cudaSuccess && e != cudaErrorNotReady) return cuda_fail("megakernel pipelined step", e);
      if (e == cudaSuccess && __atomic_load_n(&h->pipe_h->done, __ATOMIC_ACQUIRE) - want < 0)
        return fail("megakernel pipe: the stream is idle and the argmax did not run");
    }
  }
  h->pipe_read = want;
  *out = h->pipe_h->tok[want & 1];
  if (*out == -2) return fail("megakernel pipe: the argmax waited 60 s for its mask");
  return 0;
}

extern "C" int flint_mk_pipe_close(void* hv, void* stream) {
  Handle* h = (Handle*)hv;
  if (!h->pipe_h) return 0;
  h->pipe_pub = h->pipe_seq;
  __atomic_store_n(&h->pipe_h->flag, h->pipe_pub, __ATOMIC_RELEASE);
  h->pipe_read = h->pipe_seq;
  h->pipe_live = false;
  const int e = cudaStreamSynchronize((cudaStream_t)stream);
  return e ? cuda_fail("megakernel pipe close", e) : 0;
}
