"""NumPy emulation of the integer tile dot (flint/kernels/mk_mma.cuh, mkmma::imma_tile_dot, the MK_IDOT
experiment), lane by lane: the int8 two-term staging of megakernel.cu's stage_x (MK_IDOT branch), the
code words and x bytes each lane loads, the registers it builds, mma.m16n8k32.s8 through the fragment
layout written in mk_mma.cuh, and the per-group scaling. It checks the mapping the CUDA code assumes
before GPU time is spent; whether the hardware's m16n8k32 .s8 fragments are the ones assumed here is
for the GPU tests to confirm: they did in session 6 (MK_IDOT=1 passes them, real SmolLM2 included; not
faster: docs/megakernel.md, session 6, 6c).

Test: ``pytest tests/test_imma_dot_emulation.py`` (CPU, a second).
"""
from __future__ import annotations

import numpy as np

from flint.kernels.dev.mma_dot_emulation import TILE_ROWS, XSUM_FLOATS, repack_segments, x_stride_bytes
from flint.quant import Int4Weight

BYTE_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # staged bytes of word w: x(8w + i) for i in this order


def lb_of(m: int) -> int:
    return 1 if m == 1 else 2 if m == 2 else 4


def imma_m16n8k32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """a: uint32 [32, 4], b: uint32 [32, 2], c: int64 [32, 4] -> d [32, 4], per the layout in mk_mma.cuh:
    a0 = A[g][4t..4t+3], a1 = A[g+8][4t..], a2 = A[g][16+4t..], a3 = A[g+8][16+4t..];
    b0 = B[4t..4t+3][g], b1 = B[16+4t..][g]; d0, d1 = D[g][2t, 2t+1], d2, d3 = D[g+8][2t, 2t+1]."""
    A = np.zeros((16, 32), dtype=np.int64)
    B = np.zeros((32, 8), dtype=np.int64)
    s8 = lambda r: r.astype("<u4").view(np.int8).reshape(4).astype(np.int64)  # noqa: E731
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for reg, (row, k0) in enumerate(((g, 4 * t), (g + 8, 4 * t), (g, 16 + 4 * t), (g + 8, 16 + 4 * t))):
            A[row, k0:k0 + 4] = s8(a[lane, reg:reg + 1])
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


def tile_dot_i8(tile: np.ndarray, kseg: int, g: int, staged: np.ndarray, xsum: np.ndarray, mvalid: int) -> np.ndarray:
    """mkmma::imma_tile_dot<G/32, M> for one warp over all groups of the segment -> float32 [16, M]."""
    wpl = g // 32
    srb = tile.shape[1]
    flat = tile.reshape(-1)
    xflat = staged.reshape(-1)
    xstride = staged.shape[1]
    lane = np.arange(32)
    gr, t = lane >> 2, lane & 3
    lb = lb_of(mvalid)
    in_lo = (gr >= lb) & (gr < lb + mvalid)
    row = np.where(gr < mvalid, gr, np.where(in_lo, mvalid + gr - lb, 0))
    row_a, row_b = gr * srb, (gr + 8) * srb

    def words(buf, addr, n):
        idx = addr[:, None, None] + 4 * np.arange(n)[None, :, None] + np.arange(4)
        return buf[idx].view(np.uint32)[..., 0]

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
