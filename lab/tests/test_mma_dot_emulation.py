"""CPU checks of the tensor-core int4 tile dot's lane mapping (flint/kernels/mk_mma.cuh, namespace mkmma)
through its NumPy emulation (lab/mma_dot_emulation.py), before any GPU time is spent.
The emulation models one fp16 term of x; the mainline runs the same mapping twice (hi and lo terms).

Run: ``pytest lab/tests/test_mma_dot_emulation.py`` (a few seconds).
"""
import numpy as np
import pytest
import torch

import mma_dot_emulation as emu
from flint.quant.int4 import quantize_int4


def _fp16_x_effective(x: np.ndarray) -> np.ndarray:
    """The x the codes are really multiplied by: fp16(x * prescale) / prescale (exact division)."""
    pre = np.where(np.arange(x.shape[1]) & 1, 0.0625, 1.0)
    return (x.astype(np.float32) * pre.astype(np.float32)).astype(np.float16).astype(np.float64) / pre


def test_offset_trick_exact_on_every_code():
    q = np.arange(16, dtype=np.uint16)
    assert np.array_equal((np.uint16(0x6400) | q).view(np.float16).astype(np.float64), 1024.0 + q)
    assert np.array_equal((np.uint16(0x6400) | (q << 4)).view(np.float16).astype(np.float64), 1024.0 + 16 * q)


def test_word_dequant_gives_every_nibble_exactly():
    words = np.random.default_rng(1).integers(0, 2**32, size=4096, dtype=np.uint64).astype(np.uint32)
    nibbles = [(words >> np.uint32(4 * i)) & np.uint32(0xF) for i in range(8)]
    w8 = words >> np.uint32(8)
    expect = {  # register -> (low half, high half) = (code index, multiplier)
        (0, 0x000F000F): ((0, 1), (4, 1)), (0, 0x00F000F0): ((1, 16), (5, 16)),
        (8, 0x000F000F): ((2, 1), (6, 1)), (8, 0x00F000F0): ((3, 16), (7, 16)),
    }
    for (shift, mask), ((ilo, mlo), (ihi, mhi)) in expect.items():
        lo, hi = emu.halves(emu.nib(w8 if shift else words, mask))
        assert np.array_equal(lo, 1024.0 + mlo * nibbles[ilo].astype(np.float64))
        assert np.array_equal(hi, 1024.0 + mhi * nibbles[ihi].astype(np.float64))


@pytest.mark.parametrize("g", [32, 64, 128])
def test_staged_x_positions_are_a_permutation_within_each_group(g):
    kseg = 4 * g
    pos = emu.x_pos(np.arange(kseg), g)
    assert sorted(pos.tolist()) == list(range(kseg))
    assert np.array_equal(pos // g, np.arange(kseg) // g)


def test_mma_model_matches_plain_matmul_for_identity_layout():
    # a lane-layout round trip: registers built from A, B by the PTX formulas give A @ B back
    rng = np.random.default_rng(2)
    A = rng.standard_normal((16, 16)).astype(np.float16)
    B = rng.standard_normal((16, 8)).astype(np.float16)
    a = np.zeros((32, 4), dtype=np.uint32)
    b = np.zeros((32, 2), dtype=np.uint32)
    pack = lambda lo, hi: np.uint32(emu.half_bits(lo)) | (np.uint32(emu.half_bits(hi)) << np.uint32(16))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for reg, (r, c) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
            a[lane, reg] = pack(A[r, c], A[r, c + 1])
        b[lane, 0] = pack(B[2 * t, g], B[2 * t + 1, g])
        b[lane, 1] = pack(B[2 * t + 8, g], B[2 * t + 9, g])
    d = emu.mma_m16n8k16(a, b, np.zeros((32, 4), dtype=np.float32))
    D = A.astype(np.float64) @ B.astype(np.float64)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        np.testing.assert_allclose(d[lane], [D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1]],
                                   rtol=1e-6, atol=1e-6)


CASES = [(32, 576), (64, 576), (128, 256), (128, 2560), (128, 5120), (64, 2048 + 64)]


@pytest.mark.parametrize("g,k", CASES)
def test_tile_dot_matches_float64_reference(g, k):
    rng = np.random.default_rng(g * 7919 + k)
    torch.manual_seed(g + k)
    w = quantize_int4(torch.randn(32, k) * 0.05, g)
    wd = w.dequantize().double().numpy()
    for m in range(1, 9):
        x = (rng.standard_normal((m, k)) * rng.choice([0.01, 1.0, 30.0])).astype(np.float32)
        y = emu.matvec(w, x).astype(np.float64)
        ref = wd @ x.T.astype(np.float64)
        rel = np.linalg.norm(y - ref, axis=0) / np.linalg.norm(ref, axis=0)
        assert rel.max() < 2e-3, (g, k, m, rel)
        # against the fp16 x the codes really see, only fp32 rounding remains; the 1024 offset
        # cancels in fp32 (~7 bits), which shows as ~1-2e-5 here (emulated, one rounding per mma)
        ref16 = wd @ _fp16_x_effective(x).T
        rel16 = np.linalg.norm(y - ref16, axis=0) / np.linalg.norm(ref16, axis=0)
        assert rel16.max() < 1e-4, (g, k, m, rel16)


@pytest.mark.parametrize("g,k", [(32, 576), (128, 2560), (64, 2048 + 64)])
def test_two_term_tile_dot_is_fp32_accurate(g, k):
    # the mainline: x as hi + lo fp16, lo in the idle B columns for M <= 4 (every LB case: M = 1, 2,
    # 3, 4) and in a second mma for M > 4; the error is the fp32 accumulation's, not fp16 x's
    rng = np.random.default_rng(g + 3 * k)
    torch.manual_seed(k)
    w = quantize_int4(torch.randn(32, k) * 0.05, g)
    wd = w.dequantize().double().numpy()
    for m in range(1, 9):
        x = (rng.standard_normal((m, k)) * rng.choice([0.1, 1.0, 30.0])).astype(np.float32)
        ref = wd @ x.T.astype(np.float64)
        y2 = emu.matvec(w, x, terms=2).astype(np.float64)
        rel = np.linalg.norm(y2 - ref, axis=0) / np.linalg.norm(ref, axis=0)
        # ~1e-5 (emulated: one fp32 rounding per mma; the 1024 offset cancels in fp32), vs ~2.5e-4
        assert rel.max() < 1e-4, (g, k, m, rel)
        y1 = emu.matvec(w, x, terms=1).astype(np.float64)
        rel1 = np.linalg.norm(y1 - ref, axis=0) / np.linalg.norm(ref, axis=0)
        assert rel.max() < rel1.max() / 3, (g, k, m, rel, rel1)  # the lo term buys the precision


def test_packed_lo_columns_are_needed():
    # the combine has teeth: dropping the lo columns (hi only, packed layout) loses the precision
    g, k = 128, 512
    w = quantize_int4(torch.randn(16, k) * 0.05, g)
    x = np.random.default_rng(5).standard_normal((3, k)).astype(np.float32)
    ref = w.dequantize().double().numpy() @ x.T.astype(np.float64)
    staged, xsum = emu.stage_x2(x, g)
    staged[3:] = 0  # zero the lo rows: only the hi term reaches the mma, the sums still include lo
    segs, nseg, kseg, _ = emu.repack_segments(w)
    y = emu.tile_dot(segs[0, :16], kseg, g, staged, xsum, 3, terms=2).astype(np.float64)
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) > 1e-4


def test_wrong_permutation_is_caught(monkeypatch):
    # the test above has teeth: staging x in natural order (ignoring the fragment permutation) fails
    g, k = 64, 256
    w = quantize_int4(torch.randn(16, k), g)
    x = np.random.default_rng(3).standard_normal((2, k)).astype(np.float32)
    ref = w.dequantize().double().numpy() @ x.T.astype(np.float64)
    monkeypatch.setattr(emu, "x_pos", lambda kk, gg: np.asarray(kk))
    y = emu.matvec(w, x)
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) > 0.1


def test_bad_token_count_is_refused():
    w = quantize_int4(torch.randn(16, 128), 32)
    with pytest.raises(ValueError, match="M=9"):
        emu.matvec(w, np.zeros((9, 128), dtype=np.float32))
