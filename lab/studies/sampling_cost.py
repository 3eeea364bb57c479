"""What drawing one sampled token costs on the host loop's critical path (device): the engine's sampling step on a
logits row of the vocabulary's size, from the row to the token id on the host, per way of drawing it.

    python3 lab/studies/sampling_cost.py [--vocab 49152,100352] [--temperature 0.7] [--top-p 1.0] [--reps 300]

Ways: `multinomial` (probs_from_logits, then torch.multinomial), `inverse_cdf` (the same probs, then
flint.engine.inverse_cdf_draw of one uniform: flint.engine.sample), `gumbel` (the argmax of logits / T minus
log(-log u), temperature only).
Each: the median wall time of --reps synchronized draws, µs; and greedy's argmax beside them. GPU (CUDA).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from flint.engine import inverse_cdf_draw, probs_from_logits  # noqa: E402
from spec_cost import timed  # noqa: E402  (median wall time of synchronized calls, µs)


def ways(temperature: float, top_p: float):
    def multinomial(x, g):
        return int(torch.multinomial(probs_from_logits(x, temperature, 0, top_p), 1, generator=g))

    def inverse_cdf(x, g):
        u = torch.rand(1, generator=g, device=x.device)
        return int(inverse_cdf_draw(probs_from_logits(x, temperature, 0, top_p), u))

    def gumbel(x, g):
        u = torch.rand(x.shape[0], generator=g, device=x.device)
        return int(torch.argmax(x.float() / temperature - torch.log(-torch.log(u))))

    def argmax(x, g):
        return int(torch.argmax(x))

    w = {"multinomial": multinomial, "inverse_cdf": inverse_cdf, "argmax": argmax}
    if top_p >= 1.0:
        w["gumbel"] = gumbel
    return w


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", default="49152,100352")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sampling_cost: needs a CUDA device")
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for v in (int(s) for s in a.vocab.split(",")):
        x = torch.randn(v, device="cuda") * 3
        row = {"vocab": v, "temperature": a.temperature, "top_p": a.top_p}
        for name, fn in ways(a.temperature, a.top_p).items():
            row[f"{name}_us"] = round(timed(lambda: fn(x, g), a.reps), 1)
        rows.append(row)
        print(row)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
