"""CPU checks of the integer tile dot's lane mapping (MK_IDOT, an experiment of older revisions:
flint/kernels/mk_mma.cuh imma_tile_dot and megakernel.cu's int8 staging; since v21 the raw-byte dot
imma_raw_tile_dot and MK_DOT_PERM's row map, MK_DOT_PERM being an older revision's macro) through its
NumPy emulation (lab/imma_dot_emulation.py).
The fragment layout of mma.m16n8k32.s8 is the one written in mk_mma.cuh (confirmed by the GPU tests with
MK_IDOT=1 on 2026-11-29)."""
import numpy as np
import pytest
import torch

import imma_dot_emulation as emu
from flint.quant.int4 import quantize_int4


@pytest.mark.parametrize("g", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_integer_dot_matches_dequant_times_effective_x(g, m):
    torch.manual_seed(g + m)
    k = 2 * g + 512 if g < 128 else 2560
    w = quantize_int4(torch.randn(24, k), g)
    rng = np.random.default_rng(g * 10 + m)
    x = rng.standard_normal((m, k)) * np.where(rng.random((m, k)) < 0.01, 20.0, 1.0)
    y = emu.matvec_i8(w, x)
    wd = w.dequantize().double().numpy()
    ref_eff = wd @ emu.x_effective(x, g).T          # what the integer sums represent, exactly
    scale = np.abs(wd) @ np.abs(x).T
    assert np.abs(y - ref_eff).max() / scale.max() < 1e-6, "the lane mapping or the scaling is wrong"
    assert np.abs(y - wd @ x.T).max() / scale.max() < 1e-4  # the int8 two-term rounding itself (~2e-5)


def test_a_wrong_byte_order_is_caught():
    torch.manual_seed(0)
    w = quantize_int4(torch.randn(16, 256), 64)
    x = np.random.default_rng(0).standard_normal((1, 256))
    wd = w.dequantize().double().numpy()
    good = emu.matvec_i8(w, x)
    bad = emu.matvec_i8(w, x, byte_order=tuple(range(8)))   # natural order: x no longer meets its code
    ref = wd @ x.T
    assert np.abs(good - ref).max() < 1e-3 * np.abs(ref).max()
    assert np.abs(bad - ref).max() > 1e-2 * np.abs(ref).max()


@pytest.mark.parametrize("g,k", [(64, 640), (128, 2560), (128, 1024)])
@pytest.mark.parametrize("perm", [False, True])
def test_raw_byte_dot_matches_the_nibble_split_dot(g, k, perm):
    # MK_IDOT_RAW: the raw code bytes (u8) and their 0xF0 halves, -x_even / x_odd in B columns 0..3, one IMAD per lane;
    # with MK_DOT_PERM: K = 2560 (1360-byte rows) pairs rows r, r + 4, K = 1024 (544-byte rows) rows r, r + 2
    torch.manual_seed(g + k)
    w = quantize_int4(torch.randn(40, k), g)
    rng = np.random.default_rng(g + k + perm)
    x = rng.standard_normal((1, k)) * np.where(rng.random((1, k)) < 0.01, 20.0, 1.0)
    y = emu.matvec_raw(w, x, perm=perm)
    wd = w.dequantize().double().numpy()
    ref_eff = (wd @ emu.x_effective(x, g).T)[:, 0]
    scale = (np.abs(wd) @ np.abs(x).T)[:, 0].max()
    assert np.abs(y - ref_eff).max() / scale < 1e-6, "the raw layout, the columns or the lane sum is wrong"
    assert np.abs(y - emu.matvec_i8(w, x)[:, 0]).max() / scale < 1e-6


def test_raw_staging_refuses_what_the_kernel_does_not_run():
    with pytest.raises(ValueError, match="M = 1, G = 64 or 128"):
        emu.stage_x_raw(np.zeros((2, 256)), 128)
    with pytest.raises(ValueError, match="M = 1, G = 64 or 128"):
        emu.stage_x_raw(np.zeros((1, 256)), 32)


@pytest.mark.parametrize("srb", [1360, 1296, 720, 1312, 1344, 592])
def test_dot_perm_makes_the_code_loads_conflict_free(srb):
    # MK_DOT_PERM: Granite's 1360-byte rows (K = 2560, G = 128) took 2 cycles per quarter-warp; other widths too
    assert emu.code_load_wavefronts(srb, 128, perm=True) == 4
    if (srb >> 2) % 32 != 16:
        assert emu.code_load_wavefronts(srb, 128, perm=False) == 8
    assert sorted(emu.dot_perm_row(g, srb, 128) for g in range(8)) == list(range(8))
