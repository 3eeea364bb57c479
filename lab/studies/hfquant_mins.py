"""How often, and by how much, fp16 cannot hold the min -u s of a GPTQ / AWQ / compressed-tensors
group (CPU, about a minute).

    python3 lab/studies/hfquant_mins.py [--tokens 96] [--seed 0]

flint-int4-v1 stores per group (scale, min) in fp16; a zero-point format stores (s, u) with
W = s (q - u), so min = -u s, exact in float32 but not always in fp16 (flint.quant.hfquant). Part 1: a
Gaussian [2048, 2048] weight quantized asymmetric round-to-nearest (s = range / 15 in fp16,
u = round(-min / s) in 0..15, as GPTQ / AWQ / compressed-tensors' min-max observers do) at
G = 32 / 64 / 128: the share of groups whose min fp16 does not hold, the largest |fp16(min) - min|
in units of s, and the relative RMS of that difference over the weight against the RMS of the
quantization error itself. Part 2: the embedded SmolLM2-135M with every linear weight and the
head quantized that way at G = 64 (its K = 576 takes no 128): the reference decoder's logits with
the exact mins (the format's values) against the fp16 mins (what the int4 kernels read), over a
fixed English text: max |logit diff|, mean KL(exact || fp16), top-1 agreement.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from flint.quant.hfquant import ExactMinInt4Weight  # noqa: E402
from flint.quant.int4 import Int4Weight, pack_int4  # noqa: E402

TEXT = ("The river rose through the night, and by morning the old stone bridge stood alone in a "
        "brown sea. Farmers came down from the hills to look at it, and the miller, who had seen "
        "three floods, said this one would be remembered longest. Children threw sticks from the ")


def zero_point_rtn(w: torch.Tensor, g: int) -> tuple[Int4Weight, torch.Tensor]:
    """(the int4 weight with fp16 mins, the exact float32 mins) of an asymmetric min-max RTN."""
    n, k = w.shape
    wg = w.float().view(n, k // g, g)
    lo, hi = wg.amin(-1), wg.amax(-1)
    s = ((hi - lo) / 15).to(torch.float16)
    sf = s.float()
    u = torch.round(-lo / sf).clamp(0, 15)
    q = (torch.round(wg / sf[..., None]) + u[..., None]).clamp(0, 15).to(torch.uint8).view(n, k)
    exact = -u * sf
    w4 = ExactMinInt4Weight(pack_int4(q), s, exact.to(torch.float16), g, exact_mins=exact)
    return w4, exact


def part1(seed: int) -> None:
    torch.manual_seed(seed)
    w = torch.randn(2048, 2048) * 0.02
    print("part 1: Gaussian [2048, 2048], asymmetric min-max RTN")
    print("  G    inexact mins   max |fp16(min)-min|/s   rms(kernel - format)/rms(format - float)")
    for g in (32, 64, 128):
        w4, exact = zero_point_rtn(w, g)
        err = (w4.mins.float() - exact).abs() / w4.scales.float()
        fmt = w4.dequantize()
        kern = Int4Weight(w4.qweight, w4.scales, w4.mins, g).dequantize()
        rel = (kern - fmt).pow(2).mean().sqrt() / (fmt - w).pow(2).mean().sqrt()
        print(f"  {g:<4} {100 * (err > 0).float().mean().item():6.2f}%        "
              f"{err.max().item():.5f} (bound 1/128 = {1 / 128:.5f})   {rel.item():.2e}")


def part2(tokens: int) -> None:
    from flint.loading import load_model
    from flint.model import Transformer
    from flint.params import LINEAR_NAMES

    lm = load_model(None)
    exact_p, fp16_p = dict(lm.params), dict(lm.params)
    for name, w in lm.params.items():
        if name.rsplit(".", 1)[-1] in LINEAR_NAMES or name == "lm_head":
            dense = w.dequantize() if isinstance(w, Int4Weight) else w.float()
            w4, _ = zero_point_rtn(dense, 64)
            exact_p[name] = w4
            fp16_p[name] = Int4Weight(w4.qweight, w4.scales, w4.mins, 64)
    ids = torch.tensor(lm.tokenizer.encode(TEXT)[:tokens])
    a = Transformer(lm.cfg, exact_p, max_seq_len=len(ids)).forward(ids, 0)
    b = Transformer(lm.cfg, fp16_p, max_seq_len=len(ids)).forward(ids, 0)
    la, lb = a.log_softmax(-1), b.log_softmax(-1)
    kl = (la.exp() * (la - lb)).sum(-1).mean().item()
    top1 = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    print(f"part 2: SmolLM2-135M, every linear + head asymmetric RTN g64, {len(ids)} tokens")
    print(f"  max |logit diff| {(a - b).abs().max().item():.4f} (logits' max |x| {a.abs().max().item():.1f}), "
          f"mean KL(exact || fp16 mins) {kl:.2e} nats, top-1 agreement {100 * top1:.1f}%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.set_num_threads(1)
    part1(a.seed)
    part2(a.tokens)


if __name__ == "__main__":
    main()
