"""What one speculative step costs on the megakernel, by part (device; synthetic weights, a random
draft head shaped like the shipped one: 1 MLP block, the target's intermediate size, bf16; the
head either the target's whole tied head in bf16 or a pruned one of N rows, --draft-vocab).
Acceptance is NOT measured here (random weights accept nothing): the tokens-per-step figures that turn these costs into tok/s come from the real SmolLM2 draft
(docs/speculative.md, `flint bench --draft`).

    FLINT_KERNEL_DIR=build/kernels python3 lab/studies/spec_cost.py [--models smollm2-135m,granite-4.1-3b] [--k 5]

Per model: plain M = 1 step (greedy_next), verify steps M = 1..k+1 (forward with hidden states),
the draft's k-step greedy rollout eager, as a CUDA graph and as the one-launch kernel (on bf16 matrices, and on
the int4 ones it reads by default: the draft's rounded once, the target's own int4 head), and the whole
speculative loop (SpeculativeEngine, ignore_eos) per verify step with each. Medians of wall time around
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from flint.config import SYNTHETIC, from_hf_dict  # noqa: E402
from flint.speculative.draft_head import DraftHead, draft_config_for  # noqa: E402
from flint.engine import Engine, SamplingParams  # noqa: E402
from flint.megakernel import MegakernelBackend  # noqa: E402
from flint.speculative.verify import SpeculativeEngine  # noqa: E402
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


def run(model: str, k: int, ctx: int, vocabs: list[int]) -> dict:
    cfg = from_hf_dict(dict(SYNTHETIC[model]), model)
    params = synthetic_params(cfg, seed=0, int4_group_size=128 if "granite" in model else 64,
                              dtype=torch.float32, device="cuda")
    mk = MegakernelBackend(cfg, params, ctx + 512)
    mk.k_cache.normal_(0, 1)
    mk.v_cache.normal_(0, 1)
    torch.manual_seed(0)
    draft = DraftHead(draft_config_for(cfg, k_default=k)).to("cuda", torch.bfloat16)
    out = {"model": model, "k": k, "ctx": ctx}
    out["plain_step_us"] = timed(lambda: mk.greedy_next(7, ctx), 50)
    for m in range(1, k + 2):
        toks = torch.full((m,), 7, dtype=torch.long, device="cuda")
        out[f"verify_m{m}_us"] = timed(lambda: mk.forward(toks, ctx, return_hidden=True), 30)
    hidden = torch.randn(cfg.hidden_size, device="cuda")
    prompt = [7] * 16
    sp = SamplingParams(max_new_tokens=96, ignore_eos=True)
    plain = Engine(mk)
    plain.generate(prompt, sp)
    torch.cuda.synchronize()
    t = time.perf_counter()
    plain.generate(prompt, sp)
    out["engine_plain_tok_s"] = 96 / (time.perf_counter() - t)
    for nv in vocabs:  # 0: the target's whole head in bf16; N: a pruned head of N rows (which ones: no matter here)
        tag = f"v{nv}"
        vocab = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(0))[:nv] if nv else None
        draft.attach_target(cfg, params, device="cuda", dtype=torch.bfloat16, vocab=vocab)
        torch.cuda.empty_cache()
        # FLINT_DRAFT_KERNEL, _GRAPH, _WEIGHTS (the kernel's matrices: int4, the default, or bf16)
        modes = {"eager": ("0", "0", "int4"), "graph": ("0", "1", "int4"), "kernel_bf16": ("1", "1", "bf16"),
                 "kernel": ("1", "1", "int4")}
        for mode, (kern, graph, weights) in modes.items():
            os.environ["FLINT_DRAFT_KERNEL"], os.environ["FLINT_DRAFT_GRAPH"] = kern, graph
            os.environ["FLINT_DRAFT_WEIGHTS"] = weights
            out[f"draft_{mode}_us_{tag}"] = r = timed(lambda: draft.propose([7], hidden, k), 30)
            out[f"draft_token_share_of_plain_{mode}_{tag}"] = round(r / k / out["plain_step_us"], 4)
            eng = SpeculativeEngine(mk, None, draft, k=k)
            eng.generate(prompt, sp)
            torch.cuda.synchronize()
            t = time.perf_counter()
            eng.generate(prompt, sp)
            dt = time.perf_counter() - t
            st = eng.last_stats
            out[f"spec_step_us_{mode}_{tag}"] = dt / st.steps * 1e6
            out[f"spec_tokens_per_step_{mode}_{tag}"] = st.tokens_per_step
        draft.__dict__.pop("_graphs", None)
    del params
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2-135m,granite-4.1-3b")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--json", default=None)
    ap.add_argument("--draft-vocab", default="0", help="comma list of drafting vocabulary sizes (0: the whole head)")
    a = ap.parse_args()
    vocabs = [int(x) for x in a.draft_vocab.split(",")]
    rows = []
    for model in a.models.split(","):
        r = run(model, a.k, a.ctx, vocabs)
        rows.append(r)
        print(json.dumps(r), flush=True)
    print(f"\n| model | draft vocab | rollout k={a.k}: eager / graph / kernel bf16 / kernel int4 us | per draft token "
          "(kernel bf16 → int4) us | share of plain step (graph → int4) | spec step us (graph → bf16 → int4) | "
          "verify M=k+1 us | plain step us |")
    print("|---|---|---|---|---|---|---:|---:|")
    for r in rows:
        for nv in vocabs:
            t = f"v{nv}"
            d = {m: r[f"draft_{m}_us_{t}"] for m in ("eager", "graph", "kernel_bf16", "kernel")}
            print(f"| {r['model']} | {nv or 'all'} | {d['eager']:.0f} / {d['graph']:.0f} / {d['kernel_bf16']:.0f} / "
                  f"{d['kernel']:.0f} | {d['kernel_bf16'] / a.k:.1f} → {d['kernel'] / a.k:.1f} | "
                  f"{r['draft_token_share_of_plain_graph_' + t]:.3f} → {r['draft_token_share_of_plain_kernel_' + t]:.3f} | "
                  f"{r['spec_step_us_graph_' + t]:.0f} → {r['spec_step_us_kernel_bf16_' + t]:.0f} → "
                  f"{r['spec_step_us_kernel_' + t]:.0f} | {r[f'verify_m{a.k + 1}_us']:.0f} | {r['plain_step_us']:.0f} |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
