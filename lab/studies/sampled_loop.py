"""Plain sampled decoding, two loops: Engine.generate at a temperature with a host sync per token and in bursts (each
draw feeds the next step on the device, the tokens read back once a burst: Engine.SAMPLED_BURST_DEVICES), rounds
alternating in one process on one backend, beside greedy decoding (greedy_run bursts) of the same prompt.

    python3 lab/studies/sampled_loop.py [--model synthetic:smollm2-135m] [--backend megakernel] [--tokens 128]
                                  [--temperature 0.7] [--rounds 5] [--json PATH]

Per round and loop: one generate of --tokens tokens from a random 32-token prompt (a new seed each round, the same
for both loops: they must draw the same tokens, which is checked); decode tok/s from the engine's own timing. Prints
the median over rounds. GPU.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from flint.backend import make_backend
from flint.bench import load_bench_model
from flint.engine import Engine, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="synthetic:smollm2-135m")
    ap.add_argument("--backend", default="megakernel")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda", help="(cpu: a dry run of the script; the bursts are the GPU's)")
    a = ap.parse_args()
    dev = torch.device(a.device)
    group = 128 if "granite" in a.model else 64
    lm = load_bench_model(a.model, group, dev)
    backend = make_backend(a.backend, lm, max_seq_len=1024, device=str(dev), group_size=group)
    eng = Engine(backend)
    prompt = torch.randint(0, lm.cfg.vocab_size, (32,), generator=torch.Generator().manual_seed(0)).tolist()
    eng.generate(prompt, SamplingParams(max_new_tokens=16, temperature=a.temperature, seed=1))  # warm-up
    rows = {"host": [], "burst": [], "greedy": []}
    for r in range(a.rounds):
        toks = {}
        for loop in ("host", "burst", "greedy"):
            eng.SAMPLED_BURST_DEVICES = () if loop == "host" else (dev.type,)
            eng.cached = []
            sp = SamplingParams(max_new_tokens=a.tokens, temperature=0.0 if loop == "greedy" else a.temperature,
                                seed=100 + r, ignore_eos=True)
            res = eng.generate(prompt, sp)
            rows[loop].append(res.decode_tok_s)
            toks[loop] = res.token_ids
        if toks["host"] != toks["burst"]:
            raise SystemExit(f"round {r}: the two sampled loops drew different tokens")
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"{a.model} {a.backend}, T = {a.temperature}, {a.tokens} tokens, {a.rounds} rounds (median decode tok/s):")
    print(f"  sampled, a host sync per token: {med['host']:.1f}")
    print(f"  sampled, bursts:                {med['burst']:.1f}  ({med['burst'] / med['host']:.3f}x)")
    print(f"  greedy (greedy_run bursts):     {med['greedy']:.1f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"model": a.model, "backend": a.backend, "temperature": a.temperature,
                                            "tokens": a.tokens, "rounds": rows, "median": med}, indent=1) + "\n")


if __name__ == "__main__":
    main()
