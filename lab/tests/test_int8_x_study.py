"""The int8 two-term activation scheme of lab/int8_x_study.py (the candidate for an
integer tile dot): its rounding bound, and its row-dot error against fp64 on Granite-shaped rows. The
real-model greedy check (256 tokens x 3 prompts identical on SmolLM2) takes minutes on CPU and is run
by hand: `python3 lab/int8_x_study.py` (bench/results/int8_x_study_2026-11-29.txt)."""
from __future__ import annotations

import torch

from int8_x_study import int8_two_term, row_errors


def test_two_term_rounding_bound():
    torch.manual_seed(0)
    x = torch.randn(3, 512, dtype=torch.float64) * torch.where(torch.rand(3, 512) < 0.01, 30.0, 1.0)
    y = int8_two_term(x, 128)
    s = x.view(3, 4, 128).abs().amax(-1, keepdim=True) / 127
    # hi rounds to s / 2, lo to (s / 254) / 2 of that remainder
    assert ((x - y).view(3, 4, 128).abs() <= s / 508 * (1 + 1e-9)).all()
    assert torch.equal(int8_two_term(torch.zeros(2, 128), 128), torch.zeros(2, 128, dtype=torch.float64))


def test_row_dot_error_is_small():
    r = row_errors(rows=24, K=2560, G=128, seed=1)
    assert r["fp16x2"]["max"] < 2e-5
    assert r["int8x2"]["max"] < 1e-4          # ~5x the fp16 hi + lo staging, far below fp16 alone
    assert r["int8x2"]["median"] > r["fp16x2"]["median"]
