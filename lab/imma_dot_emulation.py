"""NumPy emulation of the integer tile dot (flint/kernels/mk_mma.cuh, mkmma::imma_tile_dot; MK_IDOT, an
experiment of older revisions), lane by lane: the int8 two-term staging of megakernel.cu's stage_x (MK_IDOT
branch), the code words and x bytes each lane loads, the registers it builds, mma.m16n8k32.s8 through the fragment
layout written in mk_mma.cuh, and the per-group scaling. It checks the mapping the CUDA code assumes
before GPU time is spent; whether the hardware's m16n8k32 .s8 fragments are the ones assumed here is
for the GPU tests to confirm: they did on 2026-11-29 (MK_IDOT=1 passes them, real SmolLM2 included; not
faster: docs/megakernel-log.md).

Also the raw-byte dot (mkmma::imma_raw_tile_dot; MK_IDOT_RAW in older revisions, kept in v21: the code bytes as
u8 and their 0xF0 halves, the four-row staging, one IMAD per lane and group, the lanes' shuffle), MK_DOT_PERM's row
map (also an older revision's macro, kept in v21), and a model of the code loads' shared-memory cycles
(code_load_wavefronts).

Test: ``pytest lab/tests/test_imma_dot_emulation.py`` (CPU, a few seconds).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from flint.quant.int4 import Int4Weight

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (the lab's modules import each other by name)
from mma_dot_emulation import TILE_ROWS, XSUM_FLOATS, repack_segments, x_stride_bytes  # noqa: E402

BYTE_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # staged bytes of word w: x(8w + i) for i in this order


def lb_of(m: int) -> int:
    return 1 if m == 1 else 2 if m == 2 else 4


def imma_m16n8k32(a: np.ndarray, b: np.ndarray, c: np.ndarray, a_unsigned: bool = False) -> np.ndarray:
    """a: uint32 [32, 4], b: uint32 [32, 2], c: int64 [32, 4] -> d [32, 4], per the layout in mk_mma.cuh:
    a0 = A[g][4t..4t+3], a1 = A[g+8][4t..], a2 = A[g][16+4t..], a3 = A[g+8][16+4t..];
    b0 = B[4t..4t+3][g], b1 = B[16+4t..][g]; d0, d1 = D[g][2t, 2t+1], d2, d3 = D[g+8][2t, 2t+1].
    a_unsigned: A's bytes as u8 (mma...u8.s8, the raw-byte dot)."""
    A = np.zeros((16, 32), dtype=np.int64)
    B = np.zeros((32, 8), dtype=np.int64)
    s8 = lambda r: r.astype("<u4").view(np.int8).reshape(4).astype(np.int64)  # noqa: E731
    u8 = lambda r: r.astype("<u4").view(np.uint8).reshape(4).astype(np.int64)  # noqa: E731
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for reg, (row, k0) in enumerate(((g, 4 * t), (g + 8, 4 * t), (g, 16 + 4 * t), (g + 8, 16 + 4 * t))):
            A[row, k0:k0 + 4] = (u8 if a_unsigned else s8)(a[lane, reg:reg + 1])
        for reg, k0 in enumerate((4 * t, 16 + 4 * t)):
            B[k0:k0 + 4, g] = s8(b[lane, reg:reg + 1])
    D = A @ B
    out = c.astype(np.int64).copy()
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        out[lane] += [D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1]]
    return out


def stage_x_i8(x: np.ndarray, g: int, byte_order=BYTE_ORDER) -> tuple[np.ndarray, np.ndarray]:
    """x [M, kseg] (M <= 4) -> (staged uint8 [2M, xstride]: hi rows, then lo rows; xsum float32 [ng, 24])
    as megakernel.cu's stage_x does with MK_IDOT (fp32 arithmetic)."""
    m_, kseg = x.shape
    ng = kseg // g
    lb = lb_of(m_)
    xstride = x_stride_bytes(kseg)
    staged = np.zeros((2 * m_, xstride), dtype=np.int8)
    xsum = np.zeros((ng, XSUM_FLOATS), dtype=np.float32)
    xf = x.astype(np.float32)
    for m in range(m_):
        for gi in range(ng):
            xv = xf[m, gi * g:(gi + 1) * g]
            amax = np.float32(np.abs(xv).max())
            s = np.float32(amax * np.float32(1 / 127)) if amax > 0 else np.float32(1)
            inv = np.float32(np.float32(127) / amax) if amax > 0 else np.float32(0)
            hq = np.rint(xv * inv).astype(np.int64)
            lq = np.clip(np.rint((xv - hq.astype(np.float32) * s) * inv * np.float32(254)), -127, 127).astype(np.int64)
            sx = np.float32((hq.astype(np.float32) + lq.astype(np.float32) * np.float32(1 / 254)).sum(dtype=np.float32))
            for w in range(g // 8):
                base = gi * g + 8 * w
                for j, i in enumerate(byte_order):
                    staged[m, base + j] = hq[8 * w + i]
                    staged[m_ + m, base + j] = lq[8 * w + i]
            xsum[gi, 4 * (m >> 1) + (m & 1)] = s
            xsum[gi, 4 * (m >> 1) + 2 + (m & 1)] = s * sx
            n = lb + m
            xsum[gi, 4 * (n >> 1) + (n & 1)] = s * np.float32(1 / 254)
    return staged.view(np.uint8), xsum


def x_effective(x: np.ndarray, g: int) -> np.ndarray:
    """The activations the integer dot really multiplies by: s (hi + lo / 254) per token and group."""
    staged, xsum = stage_x_i8(x, g, byte_order=tuple(range(8)))  # natural order: value by code index
    m_, kseg = x.shape
    out = np.zeros((m_, kseg))
    for m in range(m_):
        for gi in range(kseg // g):
            s = float(xsum[gi, 4 * (m >> 1) + (m & 1)])
            hi = staged[m, gi * g:(gi + 1) * g].view(np.int8).astype(np.float64)
            lo = staged[m_ + m, gi * g:(gi + 1) * g].view(np.int8).astype(np.float64)
            out[m, gi * g:(gi + 1) * g] = s * (hi + lo / 254)
    return out


def _warp(tile: np.ndarray, staged: np.ndarray):
    """The tile dots' common view: row bytes, flat tile and staged x, the x row pitch, lanes, groupID and tig."""
    lane = np.arange(32)
    return tile.shape[1], tile.reshape(-1), staged.reshape(-1), staged.shape[1], lane, lane >> 2, lane & 3


def _words(buf: np.ndarray, addr: np.ndarray, n: int) -> np.ndarray:
    """n consecutive 32-bit words from byte address addr[lane] of buf, per lane -> uint32 [32, n]"""
    idx = addr[:, None, None] + 4 * np.arange(n)[None, :, None] + np.arange(4)
    return buf[idx].view(np.uint32)[..., 0]


def tile_dot_i8(tile: np.ndarray, kseg: int, g: int, staged: np.ndarray, xsum: np.ndarray, mvalid: int) -> np.ndarray:
    """mkmma::imma_tile_dot<G/32, M> for one warp over all groups of the segment -> float32 [16, M]."""
    wpl = g // 32
    srb, flat, xflat, xstride, lane, gr, t = _warp(tile, staged)
    lb = lb_of(mvalid)
    in_lo = (gr >= lb) & (gr < lb + mvalid)
    row = np.where(gr < mvalid, gr, np.where(in_lo, mvalid + gr - lb, 0))
    row_a, row_b = gr * srb, (gr + 8) * srb
    words = _words
    acc = np.zeros((32, 4), dtype=np.float32)
    for gi in range(kseg // g):
        wa = words(flat, row_a + gi * (g // 2) + t * wpl * 4, wpl)
        wb = words(flat, row_b + gi * (g // 2) + t * wpl * 4, wpl)
        xb = words(xflat, row * xstride + t * wpl * 8 + gi * g, 2 * wpl)
        cs = xsum[gi, 4 * t[:, None] + np.arange(4)]
        d = np.zeros((32, 4), dtype=np.int64)
        m4 = np.uint32(0x0F0F0F0F)
        for c in range(wpl):
            a = np.stack((wa[:, c] & m4, wb[:, c] & m4, (wa[:, c] >> np.uint32(4)) & m4,
                          (wb[:, c] >> np.uint32(4)) & m4), 1)
            d = imma_m16n8k32(a, xb[:, 2 * c:2 * c + 2], d)
        sc = np.stack([flat[(r + kseg // 2 + gi * 4)[:, None] + np.arange(4)].copy().view(np.float16)
                       .astype(np.float32) for r in (row_a, row_b)], 1)               # [32, 2, (s, m)]
        for j, (r, col) in enumerate(((0, 0), (0, 1), (1, 0), (1, 1))):
            acc[:, j] = d[:, j].astype(np.float32) * (sc[:, r, 0] * cs[:, col]) + (sc[:, r, 1] * cs[:, 2 + col] + acc[:, j])
    out = np.zeros((TILE_ROWS, 8), dtype=np.float32)
    for j, (rr, col) in enumerate(((gr, 2 * t), (gr, 2 * t + 1), (gr + 8, 2 * t), (gr + 8, 2 * t + 1))):
        out[rr, col] = acc[:, j]
    out[:, :mvalid] = out[:, :mvalid] + out[:, lb:lb + mvalid]   # hi column + lo column
    return out[:, :mvalid]


def matvec_i8(w: Int4Weight, x: np.ndarray, byte_order=BYTE_ORDER) -> np.ndarray:
    """y [N, M] = W x through the emulated integer dot (x [M, K], M <= 4), segment by segment."""
    n, k = w.shape
    m = x.shape[0]
    if not 1 <= m <= 4:
        raise ValueError(f"imma_dot_emulation.matvec_i8: M={m} tokens, expected 1..4")
    segs, nseg, kseg, srb = repack_segments(w)
    g = w.group_size
    y = np.zeros((segs.shape[1], m), dtype=np.float32)
    for s in range(nseg):
        staged, xsum = stage_x_i8(x[:, s * kseg:(s + 1) * kseg], g, byte_order)
        for t0 in range(0, segs.shape[1], TILE_ROWS):
            y[t0:t0 + TILE_ROWS] += tile_dot_i8(segs[s, t0:t0 + TILE_ROWS], kseg, g, staged, xsum, m)
    return y[:n]


# ---------------------------------------------------------------- the raw-byte dot (MK_IDOT_RAW, M = 1) and MK_DOT_PERM
def raw_pitch(xstride: int) -> int:
    """mkmma::imma_raw_pitch"""
    return ((xstride - 64) >> 1) + 16


def dot_perm_row(g: int, srb: int, group: int) -> int:
    """mkmma::dot_perm_row: the tile row the mma's A row g (0..7) reads."""
    w = (srb >> 2) & 31
    if group != 128:
        return g
    if (w & 15) == 8:
        return ((g >> 1) & 1) | ((g & 1) << 1) | (g & 4)
    if (w & 7) == 4:
        return (g >> 1) | ((g & 1) << 2)
    return g


def stage_x_raw(x: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray]:
    """x [1, kseg] -> (staged uint8 [4, pitch], xsum float32 [ng, 24]) as stage_x's MK_IDOT_RAW branch writes them:
    per group and lane t (words t WPL .. t WPL + WPL - 1), 4 WPL bytes for the raw mma then 4 WPL for the masked one;
    rows 0 / 1: x_even hi / lo | their negatives, rows 2 / 3: zeros | x_odd hi / lo; xsum[4 + 2t, 5 + 2t] per lane."""
    m_, kseg = x.shape
    if m_ != 1 or g not in (64, 128):
        raise ValueError(f"stage_x_raw: M={m_}, G={g}: the raw-byte dot is M = 1, G = 64 or 128")
    wpl = g // 32
    pitch = raw_pitch(x_stride_bytes(kseg))
    staged = np.zeros((4, pitch), dtype=np.int8)
    xsum = np.zeros((kseg // g, XSUM_FLOATS), dtype=np.float32)
    hi, _ = stage_x_i8(x, g, byte_order=tuple(range(8)))  # natural order: [hi row, lo row] by code index
    hq, lq = hi[0].view(np.int8).astype(np.int64), hi[1].view(np.int8).astype(np.int64)
    xf = x.astype(np.float32)[0]
    for gi in range(kseg // g):
        xv = xf[gi * g:(gi + 1) * g]
        amax = np.float32(np.abs(xv).max())
        s = np.float32(amax * np.float32(1 / 127)) if amax > 0 else np.float32(1)
        h, lo = hq[gi * g:(gi + 1) * g], lq[gi * g:(gi + 1) * g]
        sx = np.float32((h.astype(np.float32) + lo.astype(np.float32) * np.float32(1 / 254)).sum(dtype=np.float32))
        for wg in range(g // 8):
            t, j = wg // wpl, wg % wpl
            a = gi * g + 8 * wpl * t + 4 * j
            am = a + 4 * wpl
            ev, od = 8 * wg + 2 * np.arange(4), 8 * wg + 2 * np.arange(4) + 1
            staged[0, a:a + 4], staged[0, am:am + 4] = h[ev], -h[ev]
            staged[1, a:a + 4], staged[1, am:am + 4] = lo[ev], -lo[ev]
            staged[2, am:am + 4], staged[3, am:am + 4] = h[od], lo[od]
        xsum[gi, 4:8] = (s * np.float32(1 / 254), s * sx, s * np.float32(1 / 4064), 0)
    return staged.view(np.uint8), xsum


def tile_dot_raw(tile: np.ndarray, kseg: int, g: int, staged: np.ndarray, xsum: np.ndarray,
                 perm: bool = False) -> np.ndarray:
    """mkmma::imma_raw_tile_dot<G/32> for one warp over the segment's groups -> float32 [16] (tile row order);
    perm: the mma's A rows read dot_perm_row's tile rows (MK_DOT_PERM) and the sums land there."""
    wpl = g // 32
    srb, flat, xflat, pitch, lane, gr, t = _warp(tile, staged)
    arow = np.array([dot_perm_row(int(q), srb, g) if perm else int(q) for q in gr])
    row_a, row_b = arow * srb, (arow + 8) * srb
    words = _words
    acc = np.zeros((32, 2), dtype=np.float32)
    hi_mask = np.uint32(0xF0F0F0F0)
    for gi in range(kseg // g):
        wa = words(flat, row_a + gi * (g // 2) + t * wpl * 4, wpl)
        wb = words(flat, row_b + gi * (g // 2) + t * wpl * 4, wpl)
        xb = words(xflat, np.where(gr < 4, gr, 0) * pitch + t * wpl * 8 + gi * g, 2 * wpl)
        cs = xsum[gi, 4 + 2 * t[:, None] + np.arange(2)]
        d = np.zeros((32, 4), dtype=np.int64)
        for c in range(wpl // 2):
            a = np.stack((wa[:, 2 * c], wb[:, 2 * c], wa[:, 2 * c + 1], wb[:, 2 * c + 1]), 1)
            d = imma_m16n8k32(a, xb[:, 2 * c:2 * c + 2], d, a_unsigned=True)
        for c in range(wpl // 2):
            a = np.stack((wa[:, 2 * c] & hi_mask, wb[:, 2 * c] & hi_mask, wa[:, 2 * c + 1] & hi_mask,
                          wb[:, 2 * c + 1] & hi_mask), 1)
            d = imma_m16n8k32(a, xb[:, wpl + 2 * c:wpl + 2 * c + 2], d, a_unsigned=True)
        assert np.abs(d).max() < 2 ** 31 and np.abs(d[:, 0] * 254 + d[:, 1]).max() < 2 ** 31, "int32 overflow"
        sc = np.stack([flat[(r + kseg // 2 + gi * 4)[:, None] + np.arange(4)].copy().view(np.float16)
                       .astype(np.float32) for r in (row_a, row_b)], 1)               # [32, 2, (s, m)]
        for j, r in enumerate((0, 1)):
            comb = (d[:, 2 * j] * 254 + d[:, 2 * j + 1]).astype(np.float32)
            acc[:, j] = comb * (sc[:, r, 0] * cs[:, 0]) + (sc[:, r, 1] * cs[:, 1] + acc[:, j])
    acc = acc + acc[lane ^ 1]  # the shuffle: lanes t = 0 (even codes) and 1 (odd codes)
    out = np.zeros(TILE_ROWS, dtype=np.float32)
    t0 = t == 0
    out[arow[t0]] = acc[t0, 0]
    out[arow[t0] + 8] = acc[t0, 1]
    return out


def matvec_raw(w: Int4Weight, x: np.ndarray, perm: bool = False) -> np.ndarray:
    """y [N] = W x through the emulated raw-byte dot (x [1, K])."""
    n, _ = w.shape
    segs, nseg, kseg, _ = repack_segments(w)
    g = w.group_size
    y = np.zeros(segs.shape[1], dtype=np.float32)
    for s in range(nseg):
        staged, xsum = stage_x_raw(x[:, s * kseg:(s + 1) * kseg], g)
        for t0 in range(0, segs.shape[1], TILE_ROWS):
            y[t0:t0 + TILE_ROWS] += tile_dot_raw(segs[s, t0:t0 + TILE_ROWS], kseg, g, staged, xsum, perm)
    return y[:n]


def code_load_wavefronts(srb: int, group: int, perm: bool) -> int:
    """Shared-memory cycles of one warp's 128-bit code load of rows g (lanes 4g + t, 16 bytes each at row + 16 t):
    per quarter-warp, the most distinct 16-byte chunks that fall into one bank."""
    total = 0
    for q in range(4):
        banks: dict = {}
        for lane in range(8 * q, 8 * q + 8):
            g, t = lane >> 2, lane & 3
            r = dot_perm_row(g, srb, group) if perm else g
            addr = r * srb + 16 * t
            for b in range(addr // 4, addr // 4 + 4):
                banks.setdefault(b % 32, set()).add(addr)
        total += max(len(v) for v in banks.values())
    return total
