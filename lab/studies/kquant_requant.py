"""What requantizing a Q4_K tensor to flint-int4-v1 costs, on a simulated tensor (CPU, seconds).

    python3 lab/studies/kquant_requant.py [--n 576] [--k 1536] [--seed 0]

A Gaussian weight is quantized to Q4_K the simple way (per sub-block of 32: min = min(0, lowest),
scale = range / 15; per super-block d = max scale / 63 and dmin = max min / 63 in fp16, 6-bit
sub-scales and mins rounded to nearest; codes rounded and clamped), packed as GGUF Q4_K bytes and
read back with gguf's own dequantize (flint's equals it bit for bit). Printed: how many of the
(d sc, dmin m) pairs fp16 holds exactly, and the relative RMS error against the Q4_K values of
(a) keeping the codes with (scale, min) rounded to fp16 and (b) flint's round-to-nearest
quantize_int4 at G = 32, 64, 128. llama.cpp fits its sub-scales by a search, so a real file's
sub-blocks need not span codes 0..15 as these do: (b) at G = 32 is then less close than here.
"""
from __future__ import annotations

import argparse
import os
import sys

import gguf
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from flint.quant.int4 import dequant_q4_k_blocks, quantize_int4  # noqa: E402


def simulated_q4_k(w: np.ndarray):
    """float32 [n, k] -> (Q4_K bytes [n, k/256*144], fp32 scales [B, 8], fp32 mins [B, 8], codes)."""
    s = w.reshape(-1, 8, 32)
    lo = np.minimum(s.min(-1), 0)
    scale, mn = (s.max(-1) - lo) / 15, -lo
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (mn.max(-1) / 63).astype(np.float16)
    sc = np.clip(np.rint(scale / d.astype(np.float32)[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(mn / dmin.astype(np.float32)[:, None]), 0, 63).astype(np.uint8)
    S = d.astype(np.float32)[:, None] * sc
    M = dmin.astype(np.float32)[:, None] * m
    q = np.clip(np.rint((s + M[..., None]) / np.where(S > 0, S, 1)[..., None]), 0, 15).astype(np.uint8)
    b = np.zeros((s.shape[0], 144), np.uint8)
    b[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
    b[:, 2:4] = dmin.view(np.uint8).reshape(-1, 2)
    b[:, 4:8] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    b[:, 8:12] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    b[:, 12:16] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    qq = q.reshape(-1, 4, 2, 32)
    b[:, 16:] = (qq[:, :, 0] | (qq[:, :, 1] << 4)).reshape(-1, 128)
    return b.reshape(w.shape[0], -1), S, -M, q


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=576)
    ap.add_argument("--k", type=int, default=1536)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    w = (np.random.default_rng(a.seed).standard_normal((a.n, a.k)) * 0.02).astype(np.float32)
    raw, S, M, q = simulated_q4_k(w)
    wk = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K)
    assert np.array_equal(wk, dequant_q4_k_blocks(raw, a.n, a.k).numpy())

    def rel(x):
        return float(np.sqrt(np.mean((x - wk) ** 2)) / np.sqrt(np.mean(wk ** 2)))

    f16 = lambda x: x.astype(np.float16).astype(np.float32)  # noqa: E731
    exact = (f16(S) == S) & (f16(M) == M)
    print(f"[{a.n}, {a.k}] Q4_K: vs the float weight {rel(w):.4f} rel. RMS")
    print(f"fp16 holds (scale, min) exactly: {exact.mean():.2%} of sub-blocks, "
          f"{exact.all(1).mean():.2%} of super-blocks")
    keep = (q * f16(S)[..., None] + f16(M)[..., None]).reshape(a.n, a.k)
    print(f"codes kept, (scale, min) rounded to fp16: {rel(keep):.2e} rel. RMS vs Q4_K")
    for g in (32, 64, 128):
        r = quantize_int4(torch.from_numpy(wk), g).dequantize().numpy()
        print(f"round-to-nearest int4 at G = {g}: {rel(r):.2e} rel. RMS vs Q4_K")


if __name__ == "__main__":
    main()
