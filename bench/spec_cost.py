"""What one speculative step costs on the megakernel, by part (device; synthetic weights, a random
draft head shaped like the shipped one: 1 MLP block, the target's intermediate size, bf16, the
target's tied head in bf16). Acceptance is NOT measured here (random weights accept nothing): the
tokens-per-step figures that turn these costs into tok/s come from the real SmolLM2 draft
(docs/speculative.md, `flint bench --draft`).

    FLINT_KERNEL_DIR=build/kernels python3 bench/spec_cost.py [--models smollm2-135m,granite-4.1-3b] [--k 5]

Per model: plain M = 1 step (greedy_next), verify steps M = 1..k+1 (forward with hidden states),
the draft's k-step greedy rollout eager and as a CUDA graph, and the whole speculative loop
(SpeculativeEngine, ignore_eos) per verify step, eager vs graphed draft. Medians of wall time around
synchronized calls (what the engine sees), in microseconds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flint.config import SYNTHETIC, from_hf_dict  # noqa: E402
from flint.draft import DraftHead, draft_config_for  # noqa: E402
from flint.engine import Engine, SamplingParams  # noqa: E402
from flint.megakernel import MegakernelBackend  # noqa: E402
from flint.speculative import SpeculativeEngine  # noqa: E402
from flint.synthetic import synthetic_params  # noqa: E402


def timed(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6


def run(model: str, k: int, ctx: int) -> dict:
    cfg = from_hf_dict(dict(SYNTHETIC[model]), model)
    params = synthetic_params(cfg, seed=0, int4_group_size=128 if "granite" in model else 64,
                              dtype=torch.float32, device="cuda")
    mk = MegakernelBackend(cfg, params, ctx + 512)
    mk.k_cache.normal_(0, 1)
    mk.v_cache.normal_(0, 1)
    torch.manual_seed(0)
    draft = DraftHead(draft_config_for(cfg, k_default=k)).to("cuda", torch.bfloat16)
    draft.attach_target(cfg, params, device="cuda", dtype=torch.bfloat16)
    del params
    torch.cuda.empty_cache()
    out = {"model": model, "k": k, "ctx": ctx}
    out["plain_step_us"] = timed(lambda: mk.greedy_next(7, ctx), 50)
    for m in range(1, k + 2):
        toks = torch.full((m,), 7, dtype=torch.long, device="cuda")
        out[f"verify_m{m}_us"] = timed(lambda: mk.forward(toks, ctx, return_hidden=True), 30)
    hidden = torch.randn(cfg.hidden_size, device="cuda")
    os.environ["FLINT_DRAFT_GRAPH"] = "0"
    out["draft_eager_us"] = timed(lambda: draft.propose([7], hidden, k), 30)
    os.environ["FLINT_DRAFT_GRAPH"] = "1"
    out["draft_graph_us"] = timed(lambda: draft.propose([7], hidden, k), 30)
    prompt = [7] * 16
    sp = SamplingParams(max_new_tokens=96, ignore_eos=True)
    plain = Engine(mk)
    plain.generate(prompt, sp)
    torch.cuda.synchronize()
    t = time.perf_counter()
    plain.generate(prompt, sp)
    out["engine_plain_tok_s"] = 96 / (time.perf_counter() - t)
    for mode in ("0", "1"):
        os.environ["FLINT_DRAFT_GRAPH"] = mode
        eng = SpeculativeEngine(mk, None, draft, k=k)
        eng.generate(prompt, sp)
        torch.cuda.synchronize()
        t = time.perf_counter()
        eng.generate(prompt, sp)
        dt = time.perf_counter() - t
        st = eng.last_stats
        out[f"spec_step_us_{'graph' if mode == '1' else 'eager'}"] = dt / st.steps * 1e6
        out[f"spec_tokens_per_step_{'graph' if mode == '1' else 'eager'}"] = st.tokens_per_step
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2-135m,granite-4.1-3b")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = []
    for model in a.models.split(","):
        r = run(model, a.k, a.ctx)
        rows.append(r)
        print(json.dumps(r), flush=True)
        verify = r[f"verify_m{a.k + 1}_us"]
        for tps in (1.77, 2.18):
            for mode in ("eager", "graph"):
                step = r[f"spec_step_us_{mode}"]
                print(f"  {model}: at {tps} tokens/step (SmolLM2 draft, measured on real text) the {mode} loop "
                      f"would give {tps / step * 1e6:.0f} tok/s vs plain {1e6 / r['plain_step_us']:.0f} "
                      f"(projection; step {step:.0f} us = draft + verify {verify:.0f} + host)")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
