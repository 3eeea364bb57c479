"""NumPy emulation of the tile dot in flint/kernels/mk_mma.cuh (namespace mkmma), lane by lane and
register by register, for ONE fp16 term of x: the mainline stages x as two fp16 terms (hi + lo,
mkmma::mma_put_x) and runs this same mapping twice, once per term (its d0/d1 and e0/e1 chains).

It reads the same bytes the CUDA code reads (flint's repacked row segments, the staged fp16 x, the
per-group sums), builds the same 32-bit registers per lane, and runs mma.sync m16n8k16 through the
PTX ISA fragment layout (``mma_m16n8k16``: lanes' registers -> A, B, C matrices -> D -> lanes'
registers). If the k-permutation of the staged x did not match the order in which a lane feeds its
codes into the A fragment, the result would be wrong here before any GPU time is spent. With one
term the x error is fp16 rounding (~2-3e-4 relative), not the mainline's.

Test: ``pytest lab/tests/test_mma_dot_emulation.py`` (CPU, a few seconds).
"""
from __future__ import annotations

import numpy as np

from flint.megakernel import row_segment_bytes, segment_plan
from flint.quant.int4 import Int4Weight

MAGIC_1024 = 0x64006400  # fp16 1024.0 in both halves
MAX_TOKENS = 8
XSUM_FLOATS = 24          # per group; must match mkmma::MMA_XSUM_FLOATS
TILE_ROWS = 16


def x_stride_bytes(kseg: int) -> int:
    """Bytes between staged token rows (mkmma::mma_x_stride_bytes)."""
    return (2 * kseg + 127) // 128 * 128 + 64


def x_pos(k, g: int):
    """fp16 element index of code k inside a staged token row (mkmma::mma_x_pos); k may be an array."""
    wpl = g >> 5
    k = np.asarray(k)
    gi, r = k // g, k % g
    w, i = r >> 3, r & 7
    tig, c = w // wpl, w % wpl
    slot = 2 * (i & 3) + (i >> 2)
    return gi * g + (c * 4 + tig) * 8 + slot


def half_bits(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float16).view(np.uint16)


def halves(reg) -> tuple[np.ndarray, np.ndarray]:
    """A .f16x2 register (uint32 array) -> (low half, high half) as float64 (fp16 values, exact)."""
    reg = np.asarray(reg, dtype=np.uint32)
    lo = (reg & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float64)
    hi = (reg >> 16).astype(np.uint16).view(np.float16).astype(np.float64)
    return lo, hi


def nib(w, mask: int) -> np.ndarray:
    """(w & mask) | 0x64006400: the one-LOP3 dequant of mma_nib."""
    return (np.asarray(w, dtype=np.uint32) & np.uint32(mask)) | np.uint32(MAGIC_1024)


# ---------------------------------------------------------------- the tensor-core operation

def mma_m16n8k16(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 on per-lane registers.

    a: uint32 [32, 4] (.f16x2 a0..a3), b: uint32 [32, 2] (b0, b1), c: float32 [32, 4].
    Fragment layout (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"):
    groupID = lane >> 2, tig = lane & 3;
      A element (row, col): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..2t+1), a2 = (g, 2t+8..2t+9), a3 = (g+8, 2t+8..2t+9)
      B element (k, col):   b0 = (2t..2t+1, g), b1 = (2t+8..2t+9, g)
      C/D element:          c0, c1 = (g, 2t), (g, 2t+1); c2, c3 = (g+8, 2t), (g+8, 2t+1)
    Products of fp16 values are exact in float64; the sum is rounded once to float32 (the tensor
    core's own accumulation order/rounding is not modelled: that is what the GPU bench measures).
    """
    lane = np.arange(32)
    g, t = lane >> 2, lane & 3
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    C = np.zeros((16, 8))
    for reg, (row, col) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
        A[row, col], A[row, col + 1] = halves(a[:, reg])
    for reg, k in enumerate((2 * t, 2 * t + 8)):
        B[k, g], B[k + 1, g] = halves(b[:, reg])
    for reg, (row, col) in enumerate(((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1))):
        C[row, col] = c[:, reg]
    D = (A @ B + C).astype(np.float32)
    return np.stack([D[row, col] for row, col in ((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1))], 1)


# ---------------------------------------------------------------- layouts (as the GPU sees them)

def repack_segments(w: Int4Weight) -> tuple[np.ndarray, int, int, int]:
    """flint/megakernel.py's row-segment layout for one matrix, rows padded to a multiple of 16.

    Returns (bytes uint8 [nseg, N16, srb], nseg, kseg, srb). Codes copied unchanged, then (scale, min)
    half2 per group, padded to 16 bytes (row_segment_bytes)."""
    n, k = w.shape
    g = w.group_size
    nseg, kseg = segment_plan(k, g)
    srb = row_segment_bytes(kseg, g)
    n16 = -(-n // TILE_ROWS) * TILE_ROWS
    qw = w.qweight.cpu().numpy()
    sm = np.stack((half_bits(w.scales.cpu().numpy()), half_bits(w.mins.cpu().numpy())), -1)  # [n, K/G, 2]
    ng = kseg // g
    out = np.zeros((nseg, n16, srb), dtype=np.uint8)
    for s in range(nseg):
        out[s, :n, :kseg // 2] = qw[:, s * kseg // 2:(s + 1) * kseg // 2]
        out[s, :n, kseg // 2:kseg // 2 + 4 * ng] = sm[:, s * ng:(s + 1) * ng].reshape(n, -1).view(np.uint8)
    return out, nseg, kseg, srb


def stage_x(x: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray]:
    """The hi term only of mkmma::mma_put_x (no lo rows), then mkmma::mma_stage_x_sums, for one K
    segment: x float [M, kseg] -> (staged bytes uint8 [M, x_stride_bytes], xsum float32 [kseg/G, 24])."""
    m, kseg = x.shape
    xstride = x_stride_bytes(kseg)
    staged = np.zeros((m, xstride // 2), dtype=np.uint16)
    k = np.arange(kseg)
    pre = np.where(k & 1, 0.0625, 1.0).astype(np.float32)
    xh = (x.astype(np.float32) * pre).astype(np.float16)           # fp16(src * prescale), as __float2half_rn
    staged[:, x_pos(k, g)] = xh.view(np.uint16)
    ng = kseg // g
    xsum = np.zeros((ng, XSUM_FLOATS), dtype=np.float32)
    for gi in range(ng):
        for n in range(m):
            v = staged[n, gi * g:(gi + 1) * g].view(np.float16).astype(np.float32).reshape(-1, 4, 2)
            # chunk slots: [(0,4), (1,5), (2,6), (3,7)] -> even codes in slot pairs 0 and 2
            even = (v[:, 0, 0] + v[:, 0, 1]) + (v[:, 2, 0] + v[:, 2, 1])
            odd = (v[:, 1, 0] + v[:, 1, 1]) + (v[:, 3, 0] + v[:, 3, 1])
            s_raw = np.float32(0)
            s_eff = np.float32(0)
            for e, o in zip(even, odd):                              # the GPU's sequential fp32 sums
                s_raw = np.float32(s_raw + (e + o))
                s_eff = np.float32(s_eff + (e + np.float32(16) * o))
            off = np.float32(-1024) * s_raw
            xsum[gi, 4 * (n >> 1) + (n & 1)] = off
            xsum[gi, 4 * (n >> 1) + (n & 1) + 2] = off
            xsum[gi, 16 + n] = s_eff
    return staged.view(np.uint8), xsum


def stage_x2(x: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray]:
    """The mainline staging (megakernel.cu stage_x): hi = fp16(v), lo = fp16(v - hi) for
    v = x * (1/16 if k odd else 1), hi rows 0..M-1 then lo rows M..2M-1; per-group sums of hi + lo
    per code word (codes in k order), then the xor-tree over the group's words as the warp's shuffles
    add them. x float [M, kseg] -> (staged uint8 [2M, xstride], xsum float32 [kseg/G, 24])."""
    m, kseg = x.shape
    xstride = x_stride_bytes(kseg)
    staged = np.zeros((2 * m, xstride // 2), dtype=np.uint16)
    k = np.arange(kseg)
    pre = np.where(k & 1, 0.0625, 1.0).astype(np.float32)
    v = x.astype(np.float32) * pre
    hi = v.astype(np.float16)
    lo = (v - hi.astype(np.float32)).astype(np.float16)
    staged[:m, x_pos(k, g)] = hi.view(np.uint16)
    staged[m:, x_pos(k, g)] = lo.view(np.uint16)
    both = hi.astype(np.float32) + lo.astype(np.float32)              # per code, fp32
    ng, words = kseg // g, g // 8
    xsum = np.zeros((ng, XSUM_FLOATS), dtype=np.float32)
    for n in range(m):
        for gi in range(ng):
            raw = np.zeros(words, dtype=np.float32)
            eff = np.zeros(words, dtype=np.float32)
            for w in range(words):
                for j in range(8):
                    b = both[n, gi * g + 8 * w + j]
                    raw[w] = np.float32(raw[w] + b)
                    eff[w] = np.float32(eff[w] + (np.float32(16) * b if j & 1 else b))
            o = 1
            while o < words:                                          # __shfl_xor_sync tree
                idx = np.arange(words) ^ o
                raw, eff = (raw + raw[idx]).astype(np.float32), (eff + eff[idx]).astype(np.float32)
                o <<= 1
            off = np.float32(-1024) * raw[0]
            xsum[gi, 4 * (n >> 1) + (n & 1)] = off
            xsum[gi, 4 * (n >> 1) + (n & 1) + 2] = off
            xsum[gi, 16 + n] = eff[0]
    return staged.view(np.uint8), xsum


# ---------------------------------------------------------------- the tile dot, per lane

def tile_dot(tile: np.ndarray, kseg: int, g: int, staged: np.ndarray, xsum: np.ndarray, mvalid: int,
             terms: int = 1) -> np.ndarray:
    """mkmma::mma_tile_dot<G/32, M> for one warp, all groups of the segment. tile: uint8 [16, srb]
    (row r at r * srb, as in the slot); staged: uint8 [M or 2M, xstride]; returns float32
    [16, mvalid] (rows x tokens). terms=1: one fp16 term (stage_x); terms=2: the mainline's hi + lo
    (stage_x2): for M <= 4 the lo rows ride in B columns LB..LB+M-1 of the same mma (LB = 1/2/4) and
    token m = column m + column LB + m; for M > 4 a second mma per word reads the lo rows."""
    wpl = g // 32
    srb = tile.shape[1]
    flat = tile.reshape(-1)
    xflat = staged.reshape(-1)
    xstride = staged.shape[1]
    ng = kseg // g
    acc = np.zeros((32, 4), dtype=np.float32)
    lane = np.arange(32)
    gr, t = lane >> 2, lane & 3
    packed = terms == 2 and 2 * mvalid <= 8
    lb = 1 if mvalid == 1 else 2 if mvalid == 2 else 4
    if packed:
        in_lo = (gr >= lb) & (gr < lb + mvalid)
        tok = np.where(gr < mvalid, gr, np.where(in_lo, mvalid + gr - lb, 0))
    else:
        tok = np.minimum(gr, mvalid - 1)
    row_a, row_b = gr * srb, (gr + 8) * srb

    def words(buf, addr, n):  # n consecutive little-endian 32-bit words at byte address addr[lane]
        idx = addr[:, None, None] + 4 * np.arange(n)[None, :, None] + np.arange(4)
        return buf[idx].view(np.uint32)[..., 0]

    for gi in range(ng):
        # per lane: WPL code words of rows g and g+8 (one LDS each), WPL 16-byte x chunks, the sums
        a_words = words(flat, row_a + gi * (g // 2) + t * wpl * 4, wpl)                 # [32, wpl]
        b_words = words(flat, row_b + gi * (g // 2) + t * wpl * 4, wpl)
        xb = np.stack([words(xflat, tok * xstride + t * 16 + gi * g * 2 + c * 64, 4) for c in range(wpl)], 1)
        if terms == 2 and not packed:  # the lo rows for the second mma of each word
            xl = np.stack([words(xflat, (mvalid + tok) * xstride + t * 16 + gi * g * 2 + c * 64, 4)
                           for c in range(wpl)], 1)
        d0 = xsum[gi, 4 * t[:, None] + np.arange(4)]                                     # initial C: off
        eff = xsum[gi, 16 + 2 * t[:, None] + np.arange(2)]
        sc = np.stack([flat[(row + kseg // 2 + gi * 4)[:, None] + np.arange(4)].copy().view(np.float16)
                       .astype(np.float32) for row in (row_a, row_b)], 1)              # [32, 2, (s, m)]
        d1 = np.zeros((32, 4), dtype=np.float32)
        e0 = np.zeros((32, 4), dtype=np.float32)
        e1 = np.zeros((32, 4), dtype=np.float32)
        for c in range(wpl):
            wa, wb = a_words[:, c], b_words[:, c]
            wa8, wb8 = wa >> np.uint32(8), wb >> np.uint32(8)
            lo, hi = 0x000F000F, 0x00F000F0   # registers a0, a1, a2, a3 = rows g, g+8, g, g+8
            a_even = np.stack((nib(wa, lo), nib(wb, lo), nib(wa, hi), nib(wb, hi)), 1)
            a_odd = np.stack((nib(wa8, lo), nib(wb8, lo), nib(wa8, hi), nib(wb8, hi)), 1)
            d0 = mma_m16n8k16(a_even, xb[:, c, 0:2], d0)
            d1 = mma_m16n8k16(a_odd, xb[:, c, 2:4], d1)
            if terms == 2 and not packed:
                e0 = mma_m16n8k16(a_even, xl[:, c, 0:2], e0)
                e1 = mma_m16n8k16(a_odd, xl[:, c, 2:4], e1)
        s = (d0 + d1) + (e0 + e1)
        for j, (r, e) in enumerate(((0, 0), (0, 1), (1, 0), (1, 1))):
            inner = sc[:, r, 1] * eff[:, e] + acc[:, j]          # fmaf(min, eff, acc); unfused here
            acc[:, j] = sc[:, r, 0] * s[:, j] + inner
    out = np.zeros((TILE_ROWS, MAX_TOKENS), dtype=np.float32)
    for j, (row, col) in enumerate(((gr, 2 * t), (gr, 2 * t + 1), (gr + 8, 2 * t), (gr + 8, 2 * t + 1))):
        out[row, col] = acc[:, j]
    if packed:  # the combine (in-lane for M = 1, a shuffle for M = 2..4)
        out[:, :mvalid] = out[:, :mvalid] + out[:, lb:lb + mvalid]
    return out[:, :mvalid]


def matvec(w: Int4Weight, x: np.ndarray, terms: int = 1) -> np.ndarray:
    """y [N, M] = W x for x [M, K] through the emulated tile dot, segment by segment (fp32 sums
    across segments). terms=2: the mainline's hi + lo staging and mma mapping."""
    n, k = w.shape
    m = x.shape[0]
    if not 1 <= m <= MAX_TOKENS:
        raise ValueError(f"mma_dot_emulation.matvec: M={m} tokens, expected 1..{MAX_TOKENS}")
    if x.shape[1] != k:
        raise ValueError(f"mma_dot_emulation.matvec: x has K={x.shape[1]}, weight has K={k}")
    segs, nseg, kseg, srb = repack_segments(w)
    y = np.zeros((segs.shape[1], m), dtype=np.float32)
    for s in range(nseg):
        stage = stage_x2 if terms == 2 else stage_x
        staged, xsum = stage(x[:, s * kseg:(s + 1) * kseg], w.group_size)
        for r0 in range(0, segs.shape[1], TILE_ROWS):
            y[r0:r0 + TILE_ROWS] += tile_dot(segs[s, r0:r0 + TILE_ROWS], kseg, w.group_size, staged, xsum, m,
                                             terms)
    return y[:n]
