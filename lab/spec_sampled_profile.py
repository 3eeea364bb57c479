"""Where a sampled speculative step's time goes, against a greedy one: a random draft shaped like the shipped one
(one MLP block, an 8192-row drafting head) on a synthetic target, SpeculativeEngine at T = 0 and T = 0.7 with the
same k, each run --rounds times (median µs per verify step from the engine's decode time), then one sampled and one
greedy run under torch.profiler: the GPU time per step by kernel (top rows) and the host's time per step.

    python3 lab/spec_sampled_profile.py [--model synthetic:smollm2-135m] [--k 3] [--tokens 96] [--json PATH]

Random weights accept almost nothing, so a step is ~1 token: the figure is the step's cost, not tok/s. GPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flint.backend import make_backend  # noqa: E402
from flint.bench import load_bench_model  # noqa: E402
from flint.speculative.draft_head import DraftHead, draft_config_for  # noqa: E402
from flint.engine import SamplingParams  # noqa: E402
from flint.speculative.verify import SpeculativeEngine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="synthetic:smollm2-135m")
    ap.add_argument("--backend", default="megakernel")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda", help="(cpu: a dry run of the script)")
    a = ap.parse_args()
    dev = torch.device(a.device)
    group = 128 if "granite" in a.model else 64
    lm = load_bench_model(a.model, group, dev)
    cfg = lm.cfg
    backend = make_backend(a.backend, lm, max_seq_len=1024, device=a.device, group_size=group)
    torch.manual_seed(0)
    draft = DraftHead(draft_config_for(cfg)).to(dev, torch.bfloat16)
    vocab = torch.randperm(cfg.vocab_size)[:8192] if cfg.vocab_size > 8192 else None
    draft.attach_target(cfg, lm.params, device=dev, dtype=torch.bfloat16, vocab=vocab)
    eng = SpeculativeEngine(backend, None, draft, k=a.k)
    prompt = torch.randint(0, cfg.vocab_size, (32,)).tolist()
    base = SamplingParams(max_new_tokens=a.tokens, ignore_eos=True, seed=1)
    sps = {"greedy": base, "sampled": dataclasses.replace(base, temperature=a.temperature)}
    for sp in sps.values():  # warm-up: kernels, graphs
        eng.cached = []
        eng.generate(prompt, dataclasses.replace(sp, max_new_tokens=2 * a.k + 4))
    out = {"model": a.model, "k": a.k, "tokens": a.tokens, "temperature": a.temperature, "us_per_step": {},
           "tokens_per_step": {}}
    per = {n: [] for n in sps}
    for _ in range(a.rounds):
        for n, sp in sps.items():
            eng.cached = []
            res = eng.generate(prompt, sp)
            st = eng.last_stats
            per[n].append(1e6 * res.decode_s / st.steps)
            out["tokens_per_step"][n] = round(st.tokens_per_step, 3)
    for n in sps:
        out["us_per_step"][n] = round(statistics.median(per[n]), 1)
    from torch.profiler import ProfilerActivity, profile

    out["profile"] = {}
    for n, sp in sps.items():
        eng.cached = []
        if dev.type == "cuda":
            torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            res = eng.generate(prompt, sp)
            if dev.type == "cuda":
                torch.cuda.synchronize()
        steps = eng.last_stats.steps
        rows = []
        for ev in prof.key_averages():
            dt = getattr(ev, "device_time_total", None)
            if dt is None:
                dt = getattr(ev, "cuda_time_total", 0)
            rows.append((ev.key, ev.count, dt, ev.self_cpu_time_total))
        gpu = sorted((r for r in rows if r[2] > 0 and not r[0].startswith("aten::")), key=lambda r: -r[2])
        cpu = sorted((r for r in rows if r[0].startswith("aten::")), key=lambda r: -r[3])
        out["profile"][n] = {
            "steps": steps,
            "gpu_kernels_per_step": [{"kernel": k[:90], "launches_per_step": round(c / steps, 2),
                                      "us_per_step": round(t / steps, 1)} for k, c, t, _ in gpu[:14]],
            "aten_ops_per_step": [{"op": k, "calls_per_step": round(c / steps, 2),
                                   "self_cpu_us_per_step": round(s / steps, 1)} for k, c, _, s in cpu[:16]],
            "aten_calls_per_step": round(sum(r[1] for r in rows if r[0].startswith("aten::")) / steps, 1),
        }
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    for n in sps:
        pr = out["profile"][n]
        print(f"\n== {n}: {out['us_per_step'][n]} µs per verify step (median of {a.rounds}), "
              f"{out['tokens_per_step'][n]} tokens/step, {pr['aten_calls_per_step']} aten calls per step")
        for r in pr["gpu_kernels_per_step"]:
            print(f"  {r['us_per_step']:8.1f} µs  x{r['launches_per_step']:<5}  {r['kernel']}")
        for r in pr["aten_ops_per_step"][:10]:
            print(f"  cpu {r['self_cpu_us_per_step']:7.1f} µs  x{r['calls_per_step']:<5}  {r['op']}")
    print(f"\nus per verify step: greedy {out['us_per_step']['greedy']}, sampled {out['us_per_step']['sampled']}")


if __name__ == "__main__":
    main()
