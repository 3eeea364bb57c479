"""Shared by the GPU tests of loaded int4 formats (test_hfquant.py, test_q4km.py): the megakernel against the
reference decoder on what the kernels read. Not a test file; imported by them.
"""
from __future__ import annotations

import torch

from flint.model import Transformer
from flint.quant.int4 import kernel_params


def assert_megakernel_matches(cfg, params: dict, max_seq: int = 64) -> None:
    """16 tokens of prefill (8 a step, the megakernel's most) and 8 decode steps on the same random tokens: every
    decode step's logits finite and within 1e-2 (relative) of the reference's on kernel_params(params)."""
    from flint.megakernel import MegakernelBackend

    mk = MegakernelBackend(cfg, params, max_seq)
    ref = Transformer(cfg, kernel_params(params), max_seq, device="cuda")
    toks = torch.randint(0, cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(1))
    for i in range(0, 16, 8):
        mk.forward(toks[i:i + 8], i)
        ref.forward(toks[i:i + 8], i)
    for pos in range(16, 24):
        a, b = mk.forward(toks[pos:pos + 1], pos), ref.forward(toks[pos:pos + 1], pos)
        rel = float((a.float() - b.float()).norm() / b.float().norm())
        assert torch.isfinite(a).all() and rel < 1e-2, f"position {pos}: rel {rel:.3e}"
