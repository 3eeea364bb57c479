"""The greedy loop's host round trip, measured: the same backend timed with one host sync per token
(greedy_next) and with the argmax fed back on the device (greedy_run), alternately, in one process.

    python3 lab/studies/greedy_loop.py [--backends megakernel,compiled] [--ctx 512] [--tokens 32] [--rounds 3]

Per backend: fill the cache to ctx with random tokens, check that both loops produce the same tokens, then
`flint.bench.time_decode` with loop="host" and loop="device" per round (each the median of 3 passes).
Prints ms per token for each and the difference (the host round trip per token).
"""
from __future__ import annotations

import argparse
import statistics

import torch

from flint.backend import make_backend
from flint.bench import load_bench_model, prefill, time_decode


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="synthetic:granite-4.1-3b")
    ap.add_argument("--backends", default="megakernel,compiled")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    dev = torch.device("cuda")
    lm = load_bench_model(args.model, 128, dev)
    gen = torch.Generator().manual_seed(0)
    for name in args.backends.split(","):
        be = make_backend(name, lm, max_seq_len=args.ctx + args.tokens, device="cuda", group_size=128)
        prefill(be, 0, args.ctx, gen)
        t, host = 1, []
        for i in range(args.tokens):
            t = be.greedy_next(t, args.ctx + i)
            host.append(t)
        same = be.greedy_run(1, args.ctx, args.tokens) == host
        res = {"host": [], "device": []}
        for _ in range(args.rounds):
            for loop in ("host", "device"):
                res[loop].append(1e3 * time_decode(be, args.ctx, args.tokens, 3, dev, None, loop))
        h, d = statistics.median(res["host"]), statistics.median(res["device"])
        print(f"{args.model} {name} ctx {args.ctx}: host loop {h:.4f} ms/token {res['host']}, device loop "
              f"{d:.4f} ms/token {res['device']}; difference {1e3 * (h - d):.1f} us/token ({(h - d) / h:.1%}); "
              f"tokens identical: {same}", flush=True)
        del be
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
