"""CPU checks of the integer tile dot's lane mapping (MK_IDOT: flint/kernels/mk_mma.cuh imma_tile_dot and
megakernel.cu's int8 staging) through its NumPy emulation (flint/kernels/dev/imma_dot_emulation.py).
The fragment layout of mma.m16n8k32.s8 is the one written in mk_mma.cuh (confirmed by the GPU tests with
MK_IDOT=1 in session 6)."""
import numpy as np
import pytest
import torch

from flint.kernels.dev import imma_dot_emulation as emu
from flint.quant import quantize_int4


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
