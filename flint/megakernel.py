"""The megakernel backend: one persistent CUDA launch per decode step (flint/kernels/megakernel.cu).

``MegakernelBackend(cfg, params, max_seq_len)`` repacks every int4 linear once (row-segments of
codes followed by interleaved (scale, min) pairs, q/k rows paired for RoPE, gate/up rows
interleaved; codes are copied, never re-rounded), allocates an fp16 KV cache
[layers, kv_heads, max_seq_len, head_dim] (K and V: 4 * layers * kv_heads * head_dim bytes per
token) and scratch, and serves the backend API (flint.backend_api). The library is built by
flint.kernels.build on first use and bound with ctypes (no torch extension).

Test: ``pytest tests/test_megakernel.py`` (GPU tests need an sm_90 device). Design and measured
numbers: docs/megakernel.md.
"""
from __future__ import annotations

import ctypes
import os
import statistics

import torch

from .backend_api import check_greedy_run, refuse_kernel_features
from .config import ModelConfig
from .errors import FlintError
from .model import kv_format_bytes
from .quant.int4 import Int4Weight

# the kernel's constants this module plans with (mk_common.cuh); check_abi compares them with the library's at load
MAX_M = 8          # tokens per launch compiled (1..8): mk::MAX_M
KSEG_MAX = 2560    # codes per K segment: mk::KSEG_MAX
TILE_ROWS = 16     # rows per weight tile (one mma A operand): mk::TILE_ROWS
ATT_T = 64         # keys per attention tile: mk::ATT_T
MAX_ACC_TILES = 64  # a block's tiles of a matrix in several K segments (their sums wait in shared memory):
                    # mk::MAX_ACC_TILES (tests/test_kernel_sources.py compares them)
ABI_VERSION = 6    # flint_mk_abi_version of the host part whose arguments _pack_args names
KV_CACHE_FORMATS_MK = ("fp16", "int8")  # the KV caches the kernel reads (int8: flint.model's layout, codes + fp16 scales)
LINEARS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
MATRICES = ("qkv", "o", "gu", "down", "lm_head", "dslice")  # the kernel's matrices (mk::MAT_*), as its ABI names them

_libs: dict[bool, ctypes.CDLL] = {}


def load_library(traced: bool = False):
    """Build (cached) and load libflint_mk.so (traced: the FLINT_MK_TRACE=1 build, stage stamps
    compiled in); set the ctypes signatures once."""
    if traced in _libs:
        return _libs[traced]
    from .kernels.build import build

    lib = bind_library(ctypes.CDLL(str(build(traced=traced))))
    check_abi(lib)
    _libs[traced] = lib
    return lib



# The FFN split-K's fixed-point residual stages a whole row in one round of loads: 8 values per consumer thread;
# and its tagged hops' 8-bit tags count layers (mk_sync.cuh, tw24_tag). megakernel.cu refuses a larger hidden size
# or more layers with the split; such models run the plain down stage.
FX_MAX_HIDDEN = 8 * 15 * 32
FX_MAX_LAYERS = 254

def bind_library(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Set the ctypes signatures of a loaded libflint_mk.so (also used by lab/mk_ab1.py, which loads
    several variants' libraries into one process)."""
    c_ll_p, c_d_p, vp = ctypes.POINTER(ctypes.c_longlong), ctypes.POINTER(ctypes.c_double), ctypes.c_void_p
    lib.flint_mk_create.argtypes = [c_ll_p, ctypes.c_int, c_d_p, ctypes.c_int, ctypes.POINTER(vp)]
    lib.flint_mk_create.restype = ctypes.c_int
    lib.flint_mk_destroy.argtypes = [vp]
    lib.flint_mk_destroy.restype = None
    lib.flint_mk_forward.argtypes = [vp, ctypes.c_int, vp, ctypes.c_int, vp]
    lib.flint_mk_forward.restype = ctypes.c_int
    lib.flint_mk_greedy.argtypes = [vp, ctypes.c_int, ctypes.c_int, vp, ctypes.POINTER(ctypes.c_int)]
    lib.flint_mk_greedy.restype = ctypes.c_int
    lib.flint_mk_greedy_run.argtypes = [vp, ctypes.c_int, ctypes.c_int, ctypes.c_int, vp, vp]
    lib.flint_mk_greedy_run.restype = ctypes.c_int
    lib.flint_mk_max_m.argtypes = [vp]
    lib.flint_mk_max_m.restype = ctypes.c_int
    lib.flint_mk_smem_info.argtypes = [vp, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
    lib.flint_mk_smem_info.restype = ctypes.c_int
    lib.flint_mk_last_error.argtypes = []
    lib.flint_mk_last_error.restype = ctypes.c_char_p
    if hasattr(lib, "flint_mk_abi_layout"):  # (variant libraries of older revisions lack them)
        lib.flint_mk_abi_layout.argtypes = []
        lib.flint_mk_abi_layout.restype = ctypes.c_char_p
        lib.flint_mk_abi_constants.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.flint_mk_abi_constants.restype = None
    if hasattr(lib, "flint_mk_long_layout_info"):  # (variant libraries of older revisions lack it)
        lib.flint_mk_long_layout_info.argtypes = [vp, ctypes.POINTER(ctypes.c_int)]
        lib.flint_mk_long_layout_info.restype = ctypes.c_int
    if hasattr(lib, "flint_mk_kv_tma"):
        lib.flint_mk_kv_tma.argtypes = [vp]
        lib.flint_mk_kv_tma.restype = ctypes.c_int
    if hasattr(lib, "flint_mk_finish_argmax"):  # (variant libraries of older revisions lack them)
        lib.flint_mk_launch_token.argtypes = [vp, ctypes.c_int, ctypes.c_int, vp]
        lib.flint_mk_launch_token.restype = ctypes.c_int
        lib.flint_mk_finish_argmax.argtypes = [vp, vp, vp, ctypes.POINTER(ctypes.c_int)]
        lib.flint_mk_finish_argmax.restype = ctypes.c_int
    if hasattr(lib, "flint_mk_pipe_step"):  # (variant libraries of older revisions lack them)
        lib.flint_mk_pipe_mask.argtypes = [vp]
        lib.flint_mk_pipe_mask.restype = vp
        lib.flint_mk_pipe_step.argtypes = [vp, ctypes.c_int, ctypes.c_int, ctypes.c_int, vp]
        lib.flint_mk_pipe_publish.argtypes = [vp]
        lib.flint_mk_pipe_token.argtypes = [vp, vp, ctypes.POINTER(ctypes.c_int)]
        lib.flint_mk_pipe_close.argtypes = [vp, vp]
        for f in ("step", "publish", "token", "close"):
            getattr(lib, f"flint_mk_pipe_{f}").restype = ctypes.c_int
    if hasattr(lib, "flint_draft_rollout"):  # (variant libraries of older revisions lack the draft kernel)
        lib.flint_draft_rollout.argtypes = [c_ll_p, ctypes.POINTER(vp), ctypes.POINTER(ctypes.c_float), vp]
        lib.flint_draft_rollout.restype = ctypes.c_int
        lib.flint_draft_grid_blocks.argtypes = []
        lib.flint_draft_grid_blocks.restype = ctypes.c_int
    return lib


def names_int4(cfg: ModelConfig) -> list[str]:
    return [f"layers.{i}.{n}" for i in range(cfg.num_layers) for n in LINEARS] + ["lm_head"]


class MegakernelError(FlintError, RuntimeError):
    pass


def check_abi(lib: ctypes.CDLL) -> None:
    """Refuse a library whose ABI version, shared constants or count of kernel objects differ from this module's
    and flint/kernels/build.py's object list (MegakernelError)."""
    from .kernels.build import EXTRA_OBJECTS, M_VALUES

    if not hasattr(lib, "flint_mk_abi_constants"):
        raise MegakernelError("the kernel library reports no ABI (rebuild: python -m flint.kernels.build --force)")
    got = (ctypes.c_int * 6)()
    lib.flint_mk_abi_constants(got)
    want = {"ABI version": ABI_VERSION, "MAX_M": MAX_M, "KSEG_MAX": KSEG_MAX, "TILE_ROWS": TILE_ROWS, "ATT_T": ATT_T,
            "kernel objects": len(M_VALUES) + len(EXTRA_OBJECTS)}
    bad = [f"{k} {g} (flint: {w})" for (k, w), g in zip(want.items(), got) if g != w]
    if bad:
        raise MegakernelError(f"the kernel library does not match flint.megakernel: {', '.join(bad)} "
                              "(rebuild: python -m flint.kernels.build --force)")


def abi_layout(lib: ctypes.CDLL) -> tuple[list[str], list[str]]:
    """The names of flint_mk_create's int and float argument slots, in order (megakernel_host.cu defines them; a
    matrix's fields as "qkv.base", "qkv.layer_stride", ...)."""
    ints, floats = lib.flint_mk_abi_layout().decode().split("|")
    return ints.split(), floats.split()


def _check(rc: int, lib) -> None:
    """Raise with the library's own error string (each library has its own)."""
    if rc != 0:
        raise MegakernelError(lib.flint_mk_last_error().decode(errors="replace"))


# ------------------------------------------------------------------ repacking (once, at load)

def segment_plan(k: int, g: int) -> tuple[int, int]:
    """(nseg, kseg): the fewest equal K segments of at most KSEG_MAX codes, each a multiple of G."""
    unit = max(g, 32)
    n = max(1, -(-k // KSEG_MAX))
    while n <= k // unit:
        if k % n == 0 and (k // n) % unit == 0 and k // n <= KSEG_MAX:
            return n, k // n
        n += 1
    raise ValueError(f"K={k} cannot be split into segments of <= {KSEG_MAX} codes at group size {g}")


def row_segment_bytes(kseg: int, g: int) -> int:
    sm = kseg // g * 4
    return kseg // 2 + (sm + 15) // 16 * 16


def repack_layout(n: int, k: int, g: int) -> dict:
    """The descriptor of an [N, K] G-group int4 matrix repacked as [nseg, N16, srb] a layer (repack_into)."""
    nseg, kseg = segment_plan(k, g)
    srb = row_segment_bytes(kseg, g)
    n_pad = -(-n // TILE_ROWS) * TILE_ROWS
    return dict(N=n_pad, K=k, G=g, nseg=nseg, kseg=kseg, srb=srb, nreal=n,
                layer_stride=nseg * n_pad * srb, seg_stride=n_pad * srb)


def repack_into(out: torch.Tensor, w: Int4Weight, desc: dict, name: str) -> None:
    """One layer of an int4 matrix -> ``out`` (uint8 [nseg, N16, srb], zeroed: the padding rows stay zero codes
    with zero (scale, min))."""
    n, k, g, kseg = desc["nreal"], desc["K"], desc["G"], desc["kseg"]
    if w.shape != (n, k) or w.group_size != g:
        raise ValueError(f"{name} has shape {w.shape}/G{w.group_size}, expected {(n, k)}/G{g}")
    ng = kseg // g
    qw = w.qweight.to(out.device)
    sm = torch.stack((w.scales.to(out.device, torch.float16), w.mins.to(out.device, torch.float16)), -1)
    for s in range(desc["nseg"]):
        out[s, :n, : kseg // 2] = qw[:, s * kseg // 2:(s + 1) * kseg // 2]
        out[s, :n, kseg // 2: kseg // 2 + ng * 4] = sm[:, s * ng:(s + 1) * ng].contiguous().view(torch.uint8).view(n, ng * 4)


def repack(ws: list[Int4Weight], name: str, device) -> tuple[torch.Tensor, dict]:
    """Layers of one [N, K] int4 matrix -> uint8 [layers, nseg, N16, srb] and its descriptor; N is
    padded to a multiple of 16 rows (a tile) with zero codes and zero (scale, min)."""
    desc = repack_layout(*ws[0].shape, ws[0].group_size)
    out = torch.zeros((len(ws), desc["nseg"], desc["N"], desc["srb"]), dtype=torch.uint8, device=device)
    for li, w in enumerate(ws):
        repack_into(out[li], w, desc, f"{name}: layer {li}")
    return out, desc


def ffn_split_plan(intermediate: int, group: int, nblocks: int) -> dict | None:
    """FFN split-K (docs/megakernel.md, "FFN split-K"): FFN block f owns gate|up tiles [f T, (f + 1) T) (the
    rows are interleaved gate_j, up_j, so a tile is 8 act indices) and computes down's partial sums over
    its own kf = 8 T act values. The plan with the most FFN blocks that fit the grid: T a multiple of 4
    (kf a multiple of 32), T dividing the gate|up tiles exactly, kf within one K segment, and the slice
    aligned to the quantization groups (kf a multiple of G, or G a multiple of kf: the slice's group
    is then kf with the covering group's (scale, min)). None: no plan."""
    ntg = 2 * intermediate // TILE_ROWS
    if 2 * intermediate % TILE_ROWS:
        return None
    for tiles in range(4, ntg + 1, 4):
        nffn, kf = ntg // tiles, 8 * tiles
        if ntg % tiles or nffn > nblocks:
            continue
        if kf > KSEG_MAX:
            return None
        gs = min(group, kf)
        if kf % gs or (group % kf and kf % group):
            continue
        return dict(nffn=nffn, nffn_pad=-(-nffn // 8) * 8, tiles=tiles, kf=kf, G=gs)
    return None


def down_slices_layout(n: int, k: int, g: int, plan: dict) -> dict:
    """The descriptor of down [H, I] repacked as FFN-block K slices [nffn, H16, srb] a layer (down_slices_into):
    srb padded to the dot's code-load width (plan's G / 8 bytes)."""
    nffn, kf, gs = plan["nffn"], plan["kf"], plan["G"]
    if nffn * kf != k:
        raise ValueError(f"down slices: {nffn} x {kf} != K={k}")
    w8 = gs // 8
    srb = -(-(kf // 2 + 4 * (kf // gs)) // w8) * w8
    n_pad = -(-n // TILE_ROWS) * TILE_ROWS
    return dict(N=n_pad, K=kf, G=gs, nseg=1, kseg=kf, srb=srb, nreal=n,
                layer_stride=nffn * n_pad * srb, seg_stride=n_pad * srb)


def down_slices_into(out: torch.Tensor, w: Int4Weight, plan: dict, expect: tuple, name: str) -> None:
    """One layer of down -> ``out`` (uint8 [nffn, H16, srb], zeroed): slice f = every row over the K range
    [f kf, (f + 1) kf), codes as stored, one (scale, min) per row and slice group of plan["G"] codes (copied
    from the group that covers it). ``expect``: (N, K, G) of every layer's down."""
    n, k, g = expect
    if w.shape != (n, k) or w.group_size != g:
        raise ValueError(f"{name} has shape {w.shape}/G{w.group_size}, expected {(n, k)}/G{g}")
    nffn, kf, gs = plan["nffn"], plan["kf"], plan["G"]
    ngs = kf // gs
    dev = out.device
    gidx = ((torch.arange(nffn)[:, None] * kf + torch.arange(ngs)[None, :] * gs) // g).flatten().to(dev)
    out[:, :n, :kf // 2] = w.qweight.to(dev).view(n, nffn, kf // 2).permute(1, 0, 2)
    sm = torch.stack((w.scales.to(dev, torch.float16), w.mins.to(dev, torch.float16)), -1)
    sel = sm[:, gidx].reshape(n, nffn, ngs * 2).permute(1, 0, 2).contiguous()
    out[:, :n, kf // 2:kf // 2 + 4 * ngs] = sel.view(torch.uint8)


def repack_down_slices(ws: list[Int4Weight], plan: dict, device) -> tuple[torch.Tensor, dict]:
    """Layers of down [H, I] -> uint8 [layers, nffn, H16, srb] (down_slices_into each) and the descriptor."""
    desc = down_slices_layout(*ws[0].shape, ws[0].group_size, plan)
    out = torch.zeros((len(ws), plan["nffn"], desc["N"], desc["srb"]), dtype=torch.uint8, device=device)
    for li, w in enumerate(ws):
        down_slices_into(out[li], w, plan, (*ws[0].shape, ws[0].group_size), f"down: layer {li}")
    return out, desc


def rope_pair_order(d: int, r: int) -> torch.Tensor:
    """A head's rows in the kernel's order: pair i (i < D/2) is rows (2i, 2i + 1), which the epilogue rotates by
    the table's angle i. For i < R/2 (R: the rotary width) the pair is dims (i, i + R/2), HF's half-split
    rotation; past R/2 it is two dims of the unrotated rest, (R + 2j, R + 2j + 1) with j = i - R/2, whose table
    entries are cos 1, sin 0 (rope_tables_padded). The cache and the tagged words then hold q and k in this
    order, the same permutation for both, so their dot products are unchanged."""
    half, rh = d // 2, r // 2
    i = torch.arange(half)
    first = torch.where(i < rh, i, r + 2 * (i - rh))
    second = torch.where(i < rh, i + rh, r + 2 * (i - rh) + 1)
    return torch.stack((first, second), 1).flatten()


def rope_tables_padded(cfg: ModelConfig, max_seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin float32 [max_seq_len, D/2]: flint.model.rope_tables over the rotary width R, then cos 1, sin 0 for
    the D/2 - R/2 pairs that do not rotate (rope_pair_order)."""
    from .model import rope_tables

    cos, sin = rope_tables(cfg, max_seq_len, device)
    pad = cfg.head_dim // 2 - cos.shape[1]
    if pad:
        cos = torch.cat((cos, cos.new_ones(max_seq_len, pad)), 1)
        sin = torch.cat((sin, sin.new_zeros(max_seq_len, pad)), 1)
    return cos.contiguous(), sin.contiguous()


def _rope_pair_rows(w: Int4Weight, heads: int, d: int, r: int) -> Int4Weight:
    """The q or k rows of every head in rope_pair_order, so one warp holds both rows of a RoPE pair."""
    per_head = rope_pair_order(d, r)
    idx = (torch.arange(heads)[:, None] * d + per_head[None, :]).flatten()
    return w.rows(idx.to(w.qweight.device))


def _cat(ws: list[Int4Weight], name: str) -> Int4Weight:
    g = ws[0].group_size
    if any(w.group_size != g for w in ws):
        raise ValueError(f"{name}: parts have different group sizes {[w.group_size for w in ws]}")
    return Int4Weight(torch.cat([w.qweight for w in ws]), torch.cat([w.scales for w in ws]),
                      torch.cat([w.mins for w in ws]), g)


def _interleave_rows(a: Int4Weight, b: Int4Weight, name: str) -> Int4Weight:
    n = a.shape[0]
    both = _cat([a, b], name)
    idx = torch.stack((torch.arange(n), torch.arange(n) + n), 1).flatten()
    return both.rows(idx.to(both.qweight.device))


def config_matrices(cfg: ModelConfig) -> dict:
    """{matrix: (N, K)} of the matrices the kernel streams, from the config: a layer's q|k|v, o, gate|up and down,
    and the LM head."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    return {"q|k|v": ((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h), "o": (h, cfg.num_heads * d),
            "gate|up": (2 * i, h), "down": (h, i), "lm_head": (cfg.vocab_size, h)}


def device_bytes(cfg: ModelConfig, max_seq_len: int, kv_cache: str = "fp16", group_size: int = 128,
                 weights: int | None = None) -> dict:
    """What the backend holds on the device, from the config alone: the repacked int4 matrices (every linear and the
    LM head at ``group_size``, or the largest group dividing K; ``weights`` where the repack's own layouts are known),
    the fp32 embedding, the K/V cache at ``max_seq_len``. Bytes by part and their ``total``."""
    from .quant.int4 import fit_group_size

    if weights is None:
        weights = 0
        for name, (n, k) in config_matrices(cfg).items():
            blob = repack_layout(n, k, fit_group_size(k, group_size, name))["layer_stride"]
            weights += blob * (1 if name == "lm_head" else cfg.num_layers)
    parts = {"weights": weights, "embed": 4 * cfg.vocab_size * cfg.hidden_size,
             "kv": kv_format_bytes(cfg, kv_cache) * max_seq_len}
    parts["total"] = sum(parts.values())
    return parts


def segmented_tiles(cfg: ModelConfig, nblocks: int, group_size: int = 128) -> dict:
    """{matrix: a block's tiles} for the matrices whose K is staged in several segments (K > KSEG_MAX): each such tile
    keeps its partial sums in shared memory until its last segment, MAX_ACC_TILES of them at most."""
    from .quant.int4 import fit_group_size

    out = {}
    for name, (n, k) in config_matrices(cfg).items():
        if segment_plan(k, fit_group_size(k, group_size, name))[0] > 1:
            tiles = -(-n // TILE_ROWS)
            out[name] = -(-tiles // nblocks)
    return out


def refuse_shape(cfg: ModelConfig, nblocks: int, group_size: int = 128) -> None:
    """MegakernelError, from the config alone, for a shape whose multi-segment matrices give a block more tiles than
    the kernel holds partial sums for (Phi-4-mini's 200k-vocabulary lm_head at hidden 3072: 95 on 132 SMs)."""
    over = {m: t for m, t in segmented_tiles(cfg, nblocks, group_size).items() if t > MAX_ACC_TILES}
    if over:
        what = ", ".join(f"{m} {t}" for m, t in over.items())
        raise MegakernelError(
            f"megakernel: {cfg.name} does not fit: a block's tiles of a matrix staged in K segments ({what}) exceed "
            f"the {MAX_ACC_TILES} the kernel holds partial sums for ({nblocks} blocks; hidden {cfg.hidden_size} > "
            f"{KSEG_MAX} codes a segment)")


def refuse_unless_fits(cfg: ModelConfig, max_seq_len: int, kv_cache: str, device, weights: int | None = None,
                       group_size: int = 128) -> None:
    """MegakernelError where the shape does not fit the kernel (refuse_shape) or device_bytes exceeds the device's
    free memory (naming both sizes)."""
    refuse_shape(cfg, torch.cuda.get_device_properties(torch.device(device)).multi_processor_count, group_size)
    need = device_bytes(cfg, max_seq_len, kv_cache, group_size, weights)
    free, total = torch.cuda.mem_get_info(torch.device(device))
    if need["total"] > free:
        gb = 1e9
        raise MegakernelError(
            f"megakernel: {cfg.name} needs {need['total'] / gb:.1f} GB on the device (int4 weights "
            f"{need['weights'] / gb:.1f}, fp32 embedding {need['embed'] / gb:.1f}, K/V cache {need['kv'] / gb:.1f} at "
            f"max_seq_len {max_seq_len}); {free / gb:.1f} of {total / gb:.1f} GB are free")


# ------------------------------------------------------------------ the backend

class MegakernelBackend:
    name = "megakernel"

    def __init__(self, cfg: ModelConfig, params: dict, max_seq_len: int, device="cuda",
                 ffn_split: str | None = None, kv_cache: str = "fp16"):
        self.cfg = cfg
        self.device = torch.device(device)
        self.max_seq_len = int(max_seq_len)
        refuse_kernel_features("megakernel", cfg, self.max_seq_len)
        if kv_cache not in KV_CACHE_FORMATS_MK:
            raise ValueError(f"megakernel: kv_cache={kv_cache!r}: the kernel reads {', '.join(KV_CACHE_FORMATS_MK)}")
        self.kv_cache = kv_cache
        if self.device.type != "cuda":
            raise ValueError(f"megakernel: device must be CUDA, got {device!r}")
        if torch.cuda.get_device_capability(self.device) < (9, 0):
            raise ValueError("megakernel: needs an sm_90 (Hopper) GPU")
        self._validate(cfg, params)
        traced = os.environ.get("FLINT_MK_TRACE") == "1"
        lib = load_library(traced)
        dev = self.device
        nkv, d, L, H = cfg.num_kv_heads, cfg.head_dim, cfg.num_layers, cfg.hidden_size
        self.nblocks = torch.cuda.get_device_properties(dev).multi_processor_count
        self.ffn_plan = self._ffn_plan(ffn_split, params["layers.0.w_down"].group_size)
        with torch.device(dev):
            # one layer at a time: its matrices are moved, concatenated and repacked into the preallocated blobs,
            # so the device holds the repacked weights and one layer's transient copies (not a second model)
            descs = self._layouts(params)
            self._check_fits(descs)
            mats = {key: torch.zeros((L if key != "lm_head" else 1, dsc["layer_stride"] // dsc["seg_stride"],
                                      dsc["N"], dsc["srb"]), dtype=torch.uint8) for key, dsc in descs.items()}
            w0 = params["layers.0.w_down"]
            down0 = (*w0.shape, w0.group_size)
            for i in range(L):
                for key, w in self._layer_matrices(params, i).items():
                    if key == "dslice":
                        down_slices_into(mats[key][i], w, self.ffn_plan, down0, f"layers.{i}.w_down")
                    else:
                        repack_into(mats[key][i], w, descs[key], f"layers.{i}.{key}")
            repack_into(mats["lm_head"][0], params["lm_head"].to(dev), descs["lm_head"], "lm_head")
            self.weights = mats
            self.mat_desc = descs
            emb = params["embed"]
            emb = emb.dequantize(torch.float32) if isinstance(emb, Int4Weight) else emb
            self.embed = emb.to(dev, torch.float32).contiguous()
            self.norms = torch.stack([torch.stack((params[f"layers.{i}.attn_norm"].float(),
                                                   params[f"layers.{i}.ffn_norm"].float()))
                                      for i in range(L)]).to(dev).contiguous()
            self.final_norm = params["norm"].to(dev, torch.float32).contiguous()
            self.rope_cos, self.rope_sin = rope_tables_padded(cfg, self.max_seq_len, dev)
            if kv_cache == "int8":  # codes, and one fp16 scale a row: K's, then V's after ATT_T entries of padding
                # (a tile's 64 scales are one bulk copy; the last tile's may reach past max_seq_len)
                self.k_cache = torch.zeros((L, nkv, self.max_seq_len, d), dtype=torch.int8)
                self.v_cache = torch.zeros_like(self.k_cache)
                n = L * nkv * self.max_seq_len
                self.kv_scale = torch.zeros((2 * (n + ATT_T),), dtype=torch.float16)
                self.k_scale = self.kv_scale[:n].view(L, nkv, self.max_seq_len)
                self.v_scale = self.kv_scale[n + ATT_T:2 * n + ATT_T].view(L, nkv, self.max_seq_len)
            else:
                self.k_cache = torch.zeros((L, nkv, self.max_seq_len, d), dtype=torch.float16)
                self.v_cache = torch.zeros_like(self.k_cache)
                self.kv_scale = None
            self._set_scratch(self._alloc_scratch())
            # FLINT_MK_TRACE=1: blocks 0 and nblocks-1 stamp %globaltimer at stage boundaries (stage_times)
            self.trace = (torch.zeros((2 * L * 32 + self.nblocks * 16 + 2 * 16 * 32,), dtype=torch.int64)
                          if traced else None)
        torch.cuda.synchronize(dev)
        self._lib = lib
        self._h = None
        self._h = self._create_handle()
        self.max_chunk = lib.flint_mk_max_m(self._h)
        # FLINT_MK_PLACE (default 6; 0 or 1: off): scratch sets tried for the fastest placement (_place_scratch)
        tries = os.environ.get("FLINT_MK_PLACE", "6")
        if not tries.isdigit():
            raise ValueError(f"megakernel: FLINT_MK_PLACE={tries!r}: expected a count of scratch sets (0 or 1: off)")
        self.placement = None
        if int(tries) > 1 and not traced:
            self._place_scratch(int(tries))
        # K and V bytes a step reads per position of context (int8: the codes and a 2-byte scale a row)
        self.kv_bytes_per_token = kv_format_bytes(cfg, kv_cache)
        # what one step reads besides K/V: int4 codes + scales/mins of every linear and the head,
        # the fp32 norm weights, one fp32 embedding row (flint bench's bytes-per-token)
        self.weight_bytes_per_token = (sum(params[n].nbytes for n in names_int4(cfg))
                                       + 4 * H * (2 * L + 1) + 4 * H)

    # the step's scratch: every buffer the blocks hand data or counts through (the barrier counter, the tagged words,
    # the attention partials, the fixed-point residual in dpart's tail), not the weights or the K/V cache
    SCRATCH = ("resid", "q", "qkv_tag", "attn", "act", "part", "att_count", "logits", "arg_val", "arg_idx", "argmax",
               "done_count", "bar_counter", "epoch", "dpart")

    def _alloc_scratch(self) -> dict:
        """Fresh zeroed scratch buffers (a new barrier counter and epoch: a consistent start)."""
        cfg, dev = self.cfg, self.device
        nh, nkv, d, H, I, V = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size,
                               cfg.intermediate_size, cfg.vocab_size)
        g = nh // nkv
        nsplit = max(1, self.nblocks // nkv)
        f32 = dict(dtype=torch.float32, device=dev)
        i32 = dict(dtype=torch.int32, device=dev)
        hp = -(-H // TILE_ROWS) * TILE_ROWS
        return dict(
            resid=torch.zeros((MAX_M, H), **f32),
            q=torch.zeros((MAX_M, nh * d), **f32),
            # (fp32 bits, tag) words: this step's q|k|v rows, then room for MAX_M attention rows of such words (unused
            # by the shipped kernel: the layout it was validated with); then the (24-bit value, 8-bit tag) words of
            # the attention output and of x + o (M <= 2); their 8-bit tags count layers (mk_sync.cuh)
            qkv_tag=torch.zeros((MAX_M * ((2 * nh + 2 * nkv) * d * 2 + nh * d + H),), **i32),
            attn=torch.zeros((MAX_M, nh * d), **f32),
            act=torch.zeros((MAX_M, I), **f32),
            # attention partials; twice the floats: the tagged merge (M = 1) writes them as (fp32 bits, tag) pairs
            part=torch.zeros((2 * nkv * nsplit * g * MAX_M * (d + 2),), **f32),
            att_count=torch.zeros((nkv,), **i32),
            logits=torch.zeros((MAX_M, V), **f32),
            arg_val=torch.zeros((self.nblocks * MAX_M,), **f32),
            arg_idx=torch.zeros((self.nblocks * MAX_M,), **i32),
            argmax=torch.zeros((MAX_M,), **i32),
            done_count=torch.zeros((1,), **i32),
            bar_counter=torch.zeros((1,), dtype=torch.int64, device=dev),
            # launches so far; the barrier counter's value at a launch's start (the barriers per launch depend on M)
            epoch=torch.zeros((2,), dtype=torch.int64, device=dev),
            # FFN split-K partial sums [M][H tiles][nffn_pad][16] (f >= nffn stay 0), then room for the kernel's
            # fixed-point residual [M][H tiles * 16] of 8-byte words (M = 1)
            dpart=(torch.zeros((MAX_M * hp * self.ffn_plan["nffn_pad"] + 2 * MAX_M * hp,), **f32)
                   if self.ffn_plan else None))

    def _set_scratch(self, bufs: dict) -> None:
        for n in self.SCRATCH:
            setattr(self, n, bufs[n])

    def _create_handle(self, override: dict | None = None) -> ctypes.c_void_p:
        h = ctypes.c_void_p()
        ia, fa = self._pack_args(override)
        _check(self._lib.flint_mk_create((ctypes.c_longlong * len(ia))(*ia), len(ia),
                                         (ctypes.c_double * len(fa))(*fa), len(fa), ctypes.byref(h)), self._lib)
        return h

    def chain_us(self, pos: int, rounds: int = 5, steps: int = 8) -> float:
        """The chain figure: µs a layer of an M = 1 step when the layers' weights are L2-resident. Two more handles
        over this backend's buffers read layer 0's weights at every layer (layer stride 0), one with the model's L
        layers and one with 2; the difference of their steps over L - 2 is a layer (the lm_head, the embedding and
        the launch cancel). A layer's weights stay in L2 where they fit it (SmolLM2 ~3 MB; Granite-4.1-3B 44 MB
        against 50 MB on an H100, 60 MB on an H200), so on large layers the figure carries part of the stream.
        Steps at ``pos``; the K/V rows at pos are restored afterwards, and the tagged words are cleared before each
        handle's first launch and after the last (their 8-bit tags assume one layer count per buffer set)."""
        L = self.cfg.num_layers
        if L < 3:
            raise ValueError(f"megakernel chain_us: needs at least 3 layers (the model has {L})")
        if not 0 <= pos < self.max_seq_len:
            raise ValueError(f"megakernel chain_us: pos {pos} outside the cache (max_seq_len {self.max_seq_len})")
        strides = {f"{k}.layer_stride": 0 for k in self.mat_desc if k != "lm_head"}
        caches = [self.k_cache, self.v_cache] + ([self.k_scale, self.v_scale] if self.kv_scale is not None else [])
        saved = [t[:, :, pos].clone() for t in caches]
        tok = torch.zeros(1, dtype=torch.int64, device=self.device)
        stream = torch.cuda.current_stream(self.device)
        handles, times = {}, {L: [], 2: []}
        try:
            for n in times:
                handles[n] = self._create_handle({"L": n, **strides})
            for r in range(rounds + 1):  # round 0 warms both
                for n, h in handles.items():
                    self._clear_tags()
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    for i in range(steps + 1):
                        if i == 1:
                            s.record(stream)
                        _check(self._lib.flint_mk_forward(h, 1, ctypes.c_void_p(tok.data_ptr()), int(pos),
                                                          ctypes.c_void_p(stream.cuda_stream)), self._lib)
                    e.record(stream)
                    e.synchronize()
                    if r:
                        times[n].append(s.elapsed_time(e) / steps * 1e3)
        finally:
            torch.cuda.synchronize(self.device)
            for h in handles.values():
                self._lib.flint_mk_destroy(h)
            self._clear_tags()
            for t, v in zip(caches, saved):
                t[:, :, pos].copy_(v)
        med = {n: statistics.median(t) for n, t in times.items()}
        return (med[L] - med[2]) / (L - 2)

    def _clear_tags(self) -> None:
        """Zero the tagged words and the attention partials (no tag is 0), so that no word left by a launch of
        another layer count reads as this launch's."""
        self.qkv_tag.zero_()
        self.part.zero_()

    def _place_scratch(self, tries: int) -> None:  # (no inference_mode: the chosen set's tensors stay ordinary ones)
        """The scratch placement (docs/megakernel.md): the step's time depends on WHERE the scratch lands, by up to
        15% at Granite-4.1-3B ctx 512 (lab/mk_place.py: the same weights behind pads of other sizes ran 1135 to
        1312 us, each configuration steady over rounds), i.e. on which L2 slices hold the lines every block polls and
        adds into. The addresses' physical placement is the driver's, so: allocate ``tries`` scratch sets, time a few
        M = 1 steps on each (rounds alternate over the sets), keep the fastest and free the others. ~0.2 s on
        Granite-4.1-3B; the arithmetic does not depend on the placement (the logits are the same bits)."""
        pos = min(self.max_seq_len - 1, 256)
        tok = torch.zeros(1, dtype=torch.int64, device=self.device)
        sets = [({n: getattr(self, n) for n in self.SCRATCH}, self._h)]
        for _ in range(tries - 1):
            bufs = self._alloc_scratch()
            self._set_scratch(bufs)
            sets.append((bufs, self._create_handle()))
        stream = torch.cuda.current_stream(self.device)

        def step(h) -> None:
            _check(self._lib.flint_mk_forward(h, 1, ctypes.c_void_p(tok.data_ptr()), pos,
                                              ctypes.c_void_p(stream.cuda_stream)), self._lib)

        times = [[] for _ in sets]
        try:
            for r in range(4):  # round 0 warms every set; rounds 1..3 are timed
                for i in (range(len(sets)) if r % 2 else reversed(range(len(sets)))):
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    step(sets[i][1])
                    s.record(stream)
                    for _ in range(6):
                        step(sets[i][1])
                    e.record(stream)
                    e.synchronize()
                    if r:
                        times[i].append(s.elapsed_time(e) / 6 * 1e3)
        finally:
            med = [sorted(t)[len(t) // 2] if t else float("inf") for t in times]
            best = min(range(len(sets)), key=lambda i: med[i])
            for i, (_, h) in enumerate(sets):
                if i != best:
                    self._lib.flint_mk_destroy(h)
            self._set_scratch(sets[best][0])
            self._h = sets[best][1]
            self.placement = dict(tries=len(sets), chosen=best, step_us=[round(x, 1) for x in med])

    def _ffn_plan(self, mode: str | None, group: int) -> dict | None:
        """FFN split-K or not: ffn_split (or FLINT_MK_FFN_SPLIT) "auto" (default: when the plan's FFN
        blocks fill >= 90% of the grid, e.g. Granite-4.1-3B: 128 of 132), "1" (whenever a plan exists;
        an error otherwise) or "0"."""
        src = "ffn_split" if mode is not None else "FLINT_MK_FFN_SPLIT"
        mode = str(mode if mode is not None else os.environ.get("FLINT_MK_FFN_SPLIT", "auto"))
        if mode not in ("auto", "0", "1"):
            raise ValueError(f"megakernel: {src}={mode!r}: expected auto, 0 or 1")
        plan = ffn_split_plan(self.cfg.intermediate_size, group, self.nblocks)
        why = (f"intermediate_size={self.cfg.intermediate_size} at group size {group} has no FFN split-K plan over "
               f"{self.nblocks} blocks")
        # (the split's fixed-point residual: whole rows in one round of loads, layer-counting tags)
        if plan is not None and self.cfg.hidden_size > FX_MAX_HIDDEN:
            plan, why = None, f"hidden_size={self.cfg.hidden_size} > {FX_MAX_HIDDEN} (the split's limit)"
        if plan is not None and self.cfg.num_layers > FX_MAX_LAYERS:
            plan, why = None, f"num_layers={self.cfg.num_layers} > {FX_MAX_LAYERS} (the split's limit)"
        if mode == "1" and plan is None:
            raise ValueError(f"megakernel: {src}=1 but {why}")
        if mode == "0" or plan is None or (mode == "auto" and plan["nffn"] < 0.9 * self.nblocks):
            return None
        return plan

    def _layouts(self, params: dict) -> dict:
        """Each repacked matrix's descriptor, from layer 0's shapes (every layer is checked as it is packed)."""
        p = "layers.0."
        q, k, v, o = (params[p + n] for n in ("wq", "wk", "wv", "wo"))
        gate, down, head = params[p + "w_gate"], params[p + "w_down"], params["lm_head"]
        descs = {"qkv": repack_layout(q.shape[0] + k.shape[0] + v.shape[0], q.shape[1], q.group_size),
                 "o": repack_layout(*o.shape, o.group_size),
                 "gu": repack_layout(2 * gate.shape[0], gate.shape[1], gate.group_size)}
        if self.ffn_plan:
            descs["dslice"] = down_slices_layout(*down.shape, down.group_size, self.ffn_plan)
        else:
            descs["down"] = repack_layout(*down.shape, down.group_size)
        descs["lm_head"] = repack_layout(*head.shape, head.group_size)
        return descs

    def _check_fits(self, descs: dict) -> None:
        """Refuse, before anything is allocated, a model whose repacked weights, fp32 embedding and K/V cache exceed
        the device's free memory (MegakernelError naming both sizes)."""
        L = self.cfg.num_layers
        weights = sum(d["layer_stride"] * (1 if key == "lm_head" else L) for key, d in descs.items())
        refuse_unless_fits(self.cfg, self.max_seq_len, self.kv_cache, self.device, weights)

    def _layer_matrices(self, params: dict, i: int) -> dict:
        """Layer i's matrices as the kernel reads them, on the device: q|k|v (q and k rows in RoPE pair order), o,
        gate|up (rows interleaved), and down (``dslice`` with FFN split-K)."""
        cfg, dev, p = self.cfg, self.device, f"layers.{i}."
        nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        r = cfg.rotary_dim or d
        wq = _rope_pair_rows(params[p + "wq"].to(dev), nh, d, r)
        wk = _rope_pair_rows(params[p + "wk"].to(dev), nkv, d, r)
        return {"qkv": _cat([wq, wk, params[p + "wv"].to(dev)], p + "wq|wk|wv"),
                "o": params[p + "wo"].to(dev),
                "gu": _interleave_rows(params[p + "w_gate"].to(dev), params[p + "w_up"].to(dev), p + "w_gate|w_up"),
                "dslice" if self.ffn_plan else "down": params[p + "w_down"].to(dev)}

    @staticmethod
    def _validate(cfg: ModelConfig, params: dict) -> None:
        if cfg.head_dim not in (64, 128):
            raise ValueError(f"megakernel: head_dim={cfg.head_dim} is not supported (64 or 128)")
        if cfg.num_heads % cfg.num_kv_heads:
            raise ValueError(f"megakernel: num_heads={cfg.num_heads} is not a multiple of "
                             f"num_kv_heads={cfg.num_kv_heads}")
        if cfg.num_heads // cfg.num_kv_heads > 64:
            raise ValueError(f"megakernel: num_heads/num_kv_heads={cfg.num_heads // cfg.num_kv_heads} > 64")
        if cfg.hidden_size % 32 or cfg.intermediate_size % 32 or (cfg.num_heads * cfg.head_dim) % 32:
            raise ValueError(f"megakernel: hidden_size={cfg.hidden_size}, intermediate_size="
                             f"{cfg.intermediate_size} and num_heads*head_dim must be multiples of 32")
        for n in names_int4(cfg):
            w = params.get(n)
            if not isinstance(w, Int4Weight):
                raise ValueError(f"megakernel: tensor {n!r} must be an Int4Weight (flint-int4-v1), got "
                                 f"{type(w).__name__}; quantize with flint.quant.int4.quantize_params")
            if w.group_size not in (32, 64, 128):
                raise ValueError(f"megakernel: tensor {n!r} has group_size {w.group_size} (32/64/128)")
        for n in ("embed", "norm"):
            if n not in params:
                raise ValueError(f"megakernel: tensor {n!r} is missing")

    def _pack_args(self, override: dict | None = None) -> tuple[list[int], list[float]]:
        """flint_mk_create's int and float arrays: each value named as the library names its slot (abi_layout);
        ``override``: values replaced by name (chain_us: the layer count, the layer strides)."""
        c, plan = self.cfg, self.ffn_plan or {}
        vals = {"H": c.hidden_size, "I": c.intermediate_size, "nh": c.num_heads, "nkv": c.num_kv_heads,
                "D": c.head_dim, "L": c.num_layers, "V": c.vocab_size, "max_seq": self.max_seq_len,
                "use_rope": int(bool(c.use_rope)), "nblocks": self.nblocks, "kv8": int(self.kv_cache == "int8"),
                "nffn": plan.get("nffn", 0), "nffn_pad": plan.get("nffn_pad", 0),
                "ohead": 0}  # always 0 (the o projection runs as its own stage)
        tensors = {"embed": self.embed, "norms": self.norms, "final_norm": self.final_norm,
                   "rope_cos": self.rope_cos, "rope_sin": self.rope_sin, "kcache": self.k_cache,
                   "vcache": self.v_cache, "resid": self.resid, "kvscale": self.kv_scale, "attn": self.attn,
                   "act": self.act, "part": self.part, "att_count": self.att_count, "logits": self.logits,
                   "arg_val": self.arg_val, "arg_idx": self.arg_idx, "argmax": self.argmax,
                   "done_count": self.done_count, "bar_counter": self.bar_counter, "epoch": self.epoch,
                   "dpart": self.dpart, "trace": self.trace, "qkvt": self.qkv_tag}
        vals.update((n, t.data_ptr() if t is not None else 0) for n, t in tensors.items())
        for key, dsc in self.mat_desc.items():
            vals[f"{key}.base"] = self.weights[key].data_ptr()
            vals.update((f"{key}.{f}", v) for f, v in dsc.items())
        floats = {"eps": c.rms_norm_eps, "emb_mult": c.embedding_multiplier, "res_mult": c.residual_multiplier,
                  "attn_scale": c.attn_scale, "inv_logit_scale": 1.0 / c.logits_scaling}
        int_names, float_names = abi_layout(self._lib)
        # an absent matrix's fields (down with FFN split-K, dslice without) are zeros
        vals.update((n, 0) for n in int_names if n.partition(".")[0] in set(MATRICES) - set(self.mat_desc))
        vals.update(override or {})
        missing = [n for n in int_names if n not in vals] + [n for n in float_names if n not in floats]
        unused = sorted(set(vals) - set(int_names)) + sorted(set(floats) - set(float_names))
        if missing or unused:
            raise MegakernelError(f"the kernel library's arguments differ from flint.megakernel's: it asks for "
                                  f"{missing or 'nothing more'}, flint also has {unused or 'nothing more'}")
        return [vals[n] for n in int_names], [floats[n] for n in float_names]

    def kv_bytes(self, ctx: int) -> int:
        """Bytes of K and V (int8: codes and scales) one decode step reads at context ``ctx``."""
        return self.kv_bytes_per_token * int(ctx)

    def weight_bytes(self) -> int:
        """Bytes of int4 weights (codes + scales/mins, as streamed) read per decode step."""
        return sum(t.numel() for t in self.weights.values())

    def __del__(self):
        h = getattr(self, "_h", None)
        lib = getattr(self, "_lib", None)
        if h is not None and h.value and lib is not None:
            lib.flint_mk_destroy(h)
            self._h = None

    def reset(self) -> None:
        """Clear the barrier/merge counters (needed only after a failed launch); the cache needs no
        clearing (positions >= start_pos are written before they are read)."""
        for t in (self.bar_counter, self.epoch, self.att_count, self.done_count, self.qkv_tag, self.part, self.dpart):
            if t is not None:  # (dpart: the FFN split's partials and the fixed-point residual buffers)
                t.zero_()
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start_pos: int, return_hidden: bool = False,
                last_only: bool = False):
        toks = tokens.reshape(-1)
        m = toks.numel()
        if m < 1 or m > self.max_chunk:
            raise ValueError(f"megakernel: {m} tokens per step is not supported (1..{self.max_chunk})")
        if start_pos < 0 or start_pos + m > self.max_seq_len:
            raise ValueError(f"megakernel: positions {start_pos}..{start_pos + m - 1} exceed max_seq_len "
                             f"{self.max_seq_len}")
        if toks.device.type == "cpu":
            lo, hi = int(toks.min()), int(toks.max())
            if lo < 0 or hi >= self.cfg.vocab_size:
                raise ValueError(f"megakernel: token id {hi if hi >= self.cfg.vocab_size else lo} is outside "
                                 f"the vocabulary (size {self.cfg.vocab_size})")
        toks = toks.to(self.device, torch.int64).contiguous()
        stream = torch.cuda.current_stream(self.device)
        _check(self._lib.flint_mk_forward(self._h, m, ctypes.c_void_p(toks.data_ptr()), int(start_pos),
                                          ctypes.c_void_p(stream.cuda_stream)), self._lib)
        rows = slice(m - 1, m) if last_only else slice(0, m)
        logits = self.logits[rows].clone()
        if return_hidden:
            return logits, self.resid[rows].clone()
        return logits

    _token_mask = None
    _launched = False

    def set_token_mask(self, mask: torch.Tensor | None) -> None:
        """Structured output: every following ``greedy_next`` picks the largest logit among the tokens whose bit is
        set (bit i & 31 of int32 word i >> 5), in a small kernel that re-reads the step's logits on the device (the
        megakernel's own argmax stays unmasked: plain decoding pays nothing); None clears it. ``forward``'s logits
        are never masked. The tensor is kept, not copied: refill it in place on the current stream."""
        from flint.token_mask import check_token_mask

        self._token_mask = check_token_mask(self, mask)

    def _check_step(self, token: int, pos: int) -> None:
        if not 0 <= token < self.cfg.vocab_size:
            raise ValueError(f"megakernel: token id {token} is outside the vocabulary")
        if not 0 <= pos < self.max_seq_len:
            raise ValueError(f"megakernel: position {pos} exceeds max_seq_len {self.max_seq_len}")

    def greedy_next(self, token: int, pos: int) -> int:
        """One M = 1 step for ``token`` at ``pos``; returns the argmax (over the allowed tokens when a token mask
        is set). One launch (two with a mask) + one 4-byte copy."""
        self._check_step(token, pos)
        if self._token_mask is not None:
            self.greedy_launch(token, pos)  # (checks again: cheap, and the mask path is not the hot one)
            return self.greedy_finish(self._token_mask)
        out = ctypes.c_int()
        stream = torch.cuda.current_stream(self.device)
        _check(self._lib.flint_mk_greedy(self._h, int(token), int(pos), ctypes.c_void_p(stream.cuda_stream),
                                         ctypes.byref(out)), self._lib)
        return out.value

    def greedy_launch(self, token: int, pos: int) -> None:
        """Enqueue the M = 1 step for ``token`` at ``pos`` and return at once (greedy_finish reads its token):
        the host's work in between (the next grammar mask) overlaps the step."""
        self._check_step(token, pos)
        stream = torch.cuda.current_stream(self.device)
        _check(self._lib.flint_mk_launch_token(self._h, int(token), int(pos), ctypes.c_void_p(stream.cuda_stream)),
               self._lib)
        self._launched = True

    def greedy_finish(self, mask: torch.Tensor | None) -> int:
        """The launched step's argmax, over ``mask`` (a token mask as set_token_mask takes, filled on the current
        stream; None: unmasked), by a one-block kernel after the step; one stream sync."""
        from flint.token_mask import check_token_mask

        if not self._launched:
            raise RuntimeError("megakernel: greedy_finish without a greedy_launch before it")
        self._launched = False
        mask = check_token_mask(self, mask)
        out = ctypes.c_int()
        stream = torch.cuda.current_stream(self.device)
        _check(self._lib.flint_mk_finish_argmax(self._h, None if mask is None else ctypes.c_void_p(mask.data_ptr()),
                                                ctypes.c_void_p(stream.cuda_stream), ctypes.byref(out)), self._lib)
        if out.value < 0:
            raise RuntimeError("megakernel: the token mask allows no token")
        return out.value

    # The pipelined masked step (structured output with no host round trip between steps; flint.backend's docstring
    # has the contract, megakernel_host.cu the protocol): each step's masked argmax waits on the device for the host
    # to publish its mask, then hands its token to the next step, enqueued while the mask was being filled.
    @property
    def pipe_mask(self) -> torch.Tensor:
        """The mask the host fills before pipe_publish: ceil(V / 32) int32 words of mapped pinned memory."""
        if getattr(self, "_pipe_mask", None) is None:
            ptr = self._lib.flint_mk_pipe_mask(self._h)
            if not ptr:
                _check(1, self._lib)
            words = (self.cfg.vocab_size + 31) // 32
            self._pipe_mask = torch.frombuffer((ctypes.c_int32 * words).from_address(ptr), dtype=torch.int32)
        return self._pipe_mask

    def _pipe_step(self, token: int, pos: int, from_slot: int) -> None:
        stream = torch.cuda.current_stream(self.device)
        _check(self._lib.flint_mk_pipe_step(self._h, int(token), int(pos), from_slot,
                                            ctypes.c_void_p(stream.cuda_stream)), self._lib)

    def pipe_begin(self, token: int, pos: int) -> None:
        """Enqueue the step for ``token`` at ``pos`` and its masked argmax (it waits for pipe_publish)."""
        self._check_step(token, pos)
        self.pipe_mask  # (allocated before the first launch)
        self._pipe_step(token, pos, 0)

    def pipe_ahead(self, pos: int) -> None:
        """Enqueue the step at ``pos`` whose token is the latest enqueued argmax's (read on the device)."""
        self._check_step(0, pos)
        self._pipe_step(0, pos, 1)

    def pipe_publish(self) -> None:
        """The oldest waiting argmax may read pipe_mask now."""
        _check(self._lib.flint_mk_pipe_publish(self._h), self._lib)

    def pipe_token(self) -> int:
        """The oldest published argmax's token (waits for it)."""
        out = ctypes.c_int()
        stream = torch.cuda.current_stream(self.device)
        _check(self._lib.flint_mk_pipe_token(self._h, ctypes.c_void_p(stream.cuda_stream), ctypes.byref(out)),
               self._lib)
        if out.value < 0:
            raise RuntimeError("megakernel: the token mask allows no token")
        return out.value

    def pipe_close(self) -> None:
        """Release every waiting argmax and drain the stream (their tokens are dropped)."""
        stream = torch.cuda.current_stream(self.device)
        _check(self._lib.flint_mk_pipe_close(self._h, ctypes.c_void_p(stream.cuda_stream)), self._lib)

    def greedy_run(self, token: int, pos: int, n: int) -> list[int]:
        """``n`` greedy M = 1 steps from ``token`` at ``pos``; returns their argmax tokens. Step i + 1 reads
        step i's argmax on the device, so the n launches queue back to back (no host round trip between
        tokens; one sync at the end). The K/V of positions pos .. pos + n - 1 are written."""
        check_greedy_run(self, token, pos, n)
        if self._token_mask is not None:
            raise ValueError("megakernel: greedy_run cannot honour a token mask (each step's mask depends on the "
                             "token before it): use greedy_next")
        hist = torch.zeros(n, dtype=torch.int64, device=self.device)
        stream = torch.cuda.current_stream(self.device)
        _check(self._lib.flint_mk_greedy_run(self._h, int(token), int(pos), int(n), ctypes.c_void_p(hist.data_ptr()),
                                             ctypes.c_void_p(stream.cuda_stream)), self._lib)
        return hist.tolist()

    STAGES = ("rstd1", "qkv", "bar1", "attn", "bar2", "o", "bar3", "gate_up", "dpart", "bar4", "down", "bar5")
    SUBSTAGES = ("qkv", "o", "gate_up", "down")

    def stage_times(self, block: int = 0) -> dict:
        """Mean microseconds per stage per layer of the last launch (needs FLINT_MK_TRACE=1); block 0
        or 1 (= the last block). "<stage>.stage_x": staging of the stage's input, "<stage>.tiles": the
        tile loop of thread 0's warp, the rest of the stage is waiting for the other warps."""
        if self.trace is None:
            raise RuntimeError("stage_times needs FLINT_MK_TRACE=1 at construction")
        L = self.cfg.num_layers
        t = self.trace[:2 * L * 32].view(2, L, 32)[block].cpu().double()  # (the per-block and per-warp stamps follow)
        out = {}
        for i, n in enumerate(self.STAGES[:-1]):
            out[n] = float((t[:, i + 1] - t[:, i]).mean()) / 1e3
        out["bar5"] = float((t[1:, 0] - t[:-1, 11]).mean()) / 1e3 if L > 1 else 0.0
        out["lm_head"] = float(t[-1, 13] - t[-1, 12]) / 1e3
        starts = {"qkv": 1, "o": 5, "gate_up": 7, "down": 10}
        for mi, n in enumerate(self.SUBSTAGES):
            if not bool((t[:, 16 + 4 * mi] != 0).all()):  # a stage this launch does not run (down with the FFN split)
                continue
            out[n + ".stage_x"] = float((t[:, 16 + 4 * mi] - t[:, starts[n]]).mean()) / 1e3
            out[n + ".tiles"] = float((t[:, 17 + 4 * mi] - t[:, 16 + 4 * mi]).mean()) / 1e3
        return out

    # "gu_tiles": gate|up's tiles and epilogues done; "gate_up": with FFN split-K also down's partials
    BLOCK_STAMPS = ("start", "rstd1", "qkv", "bar1", "attn", "bar2", "o", "bar3", "gu_tiles", "gate_up", "bar4", "down")

    def block_smids(self) -> torch.Tensor:
        """[nblocks] the SM each block ran on in the last traced launch (%smid; FLINT_MK_TRACE=1 builds record it in
        the block's unused 16th stamp slot)."""
        if self.trace is None:
            raise RuntimeError("block_smids needs FLINT_MK_TRACE=1 at construction")
        base = 2 * self.cfg.num_layers * 32
        return self.trace[base:base + self.nblocks * 16].view(self.nblocks, 16)[:, 15].cpu()

    def block_stamps(self) -> torch.Tensor:
        """Every block's stage-end times in the middle layer of the last launch (needs FLINT_MK_TRACE=1):
        [nblocks, 12] microseconds after the earliest block's layer start, columns BLOCK_STAMPS (the
        end of the named stage; "barN" = leaving that grid barrier)."""
        if self.trace is None:
            raise RuntimeError("block_stamps needs FLINT_MK_TRACE=1 at construction")
        L = self.cfg.num_layers
        base = 2 * L * 32
        t = self.trace[base:base + self.nblocks * 16].view(self.nblocks, 16)[:, :len(self.BLOCK_STAMPS)].cpu().double()
        return (t - t[:, 0].min()) / 1e3

    WARP_CLOCKS = {"o.enter": 0, "o.staged": 1, "o.tile0.slot": 2, "o.tile0.dot": 3, "o.tile0.parts": 4,
                   "o.tile0.epilogue": 5, "o.tile1.slot": 6, "o.tile1.dot": 7, "o.tile1.parts": 8,
                   "o.tile1.epilogue": 9, "o.loop_end": 10, "o.exit": 11, "attn.enter": 12, "attn.q": 13,
                   "attn.tile": 14, "attn.scores": 15, "attn.softmax": 16, "attn.pv": 17, "attn.partial": 18,
                   "attn.count": 19, "attn.merge": 20, "attn.exit": 21}

    def warp_clocks(self, block: int = 0) -> dict:
        """Inside the middle layer's o-proj and attention stages of the last launch (needs
        FLINT_MK_TRACE=1): per warp (16: 15 consumers + the producer, which never stamps), SM cycles
        since the block's o-stage or attention entry at each point of WARP_CLOCKS (NaN: not reached
        by that warp, e.g. a part it did not hold). block 0 or 1 (= the last block)."""
        w = self.warp_trace(block, "warp_clocks")
        out = {}
        o0 = float(torch.nan_to_num(w[:, 0], nan=float("inf")).min())
        a0 = float(torch.nan_to_num(w[:, 12], nan=float("inf")).min())
        for name, k in self.WARP_CLOCKS.items():
            out[name] = (w[:15, k] - (o0 if name.startswith("o.") else a0)).tolist()
        return out

    def warp_trace(self, block: int = 0, who: str = "warp_trace") -> torch.Tensor:
        """The raw per-warp %clock64 stamps of the last launch (needs FLINT_MK_TRACE=1): [16 warps, 32
        slots] float64 for block 0 or 1 (= the last block), NaN where nothing was stamped. Slots: the
        WARP_CLOCKS points (lab/mk_warps.py reads them)."""
        if self.trace is None:
            raise RuntimeError(f"{who} needs FLINT_MK_TRACE=1 at construction")
        base = 2 * self.cfg.num_layers * 32 + self.nblocks * 16
        w = self.trace[base:base + 2 * 16 * 32].view(2, 16, 32)[block].cpu().double()
        return torch.where(w == 0, torch.full_like(w, float("nan")), w)

    def sm_clock_ghz(self, block: int = 0) -> float:
        """The SM clock during the last launch (needs FLINT_MK_TRACE=1): %clock64 cycles over %globaltimer
        nanoseconds from the first layer's start to the last layer's end, block 0 or 1 (= the last)."""
        if self.trace is None:
            raise RuntimeError("sm_clock_ghz needs FLINT_MK_TRACE=1 at construction")
        L = self.cfg.num_layers
        t = self.trace[:2 * L * 32].view(2, L, 32)[block].cpu()
        return float(t[-1, 15] - t[0, 14]) / float(t[-1, 11] - t[0, 0])

    def smem_info(self, m: int = 1) -> dict:
        arr = (ctypes.c_int * 4)()
        _check(self._lib.flint_mk_smem_info(self._h, m, arr), self._lib)
        out = dict(smem_bytes=arr[0], ring_slots=arr[1], slot_bytes=arr[2], blocks=arr[3])
        if m == 1 and hasattr(self._lib, "flint_mk_long_layout_info"):
            a5 = (ctypes.c_int * 5)()
            _check(self._lib.flint_mk_long_layout_info(self._h, a5), self._lib)
            out["long_context"] = dict(ready=bool(a5[0]), smem_bytes=a5[1], ring_slots=a5[2], kv_tile_buffers=a5[3],
                                       from_tiles_per_split=a5[4])
            if hasattr(self._lib, "flint_mk_kv_tma"):  # the K/V tiles by TMA (tensor maps made)
                out["long_context"]["kv_tma"] = bool(self._lib.flint_mk_kv_tma(self._h))
        return out
