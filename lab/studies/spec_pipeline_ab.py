"""What the pipelined greedy speculative step buys: the same engine, backend and draft, with the next step's
rollout enqueued before the verify is read back (flint.speculative.verify's default for drafts with ``begin``) and in
host order (the draft wrapped so that it only has ``propose``: rollout after the read-back), rounds alternating
between the two and plain greedy decoding, all in one process (device).

    # real SmolLM2 and its shipped draft, the held-out prompts of `flint bench --draft`:
    FLINT_KERNEL_DIR=build/kernels python3 lab/studies/spec_pipeline_ab.py --model <SmolLM2 GGUF> --k 2,3 --rounds 3
    # Granite-4.1-3B shapes, oracle acceptance (benchmarking only, flint.speculative.oracle):
    FLINT_KERNEL_DIR=build/kernels python3 lab/studies/spec_pipeline_ab.py --model synthetic:granite-4.1-3b \\
        --oracle-accept 0.77 --k 3 --rounds 3

Per k and variant: tokens per verify step, tok/s per round, their median and the ratio to plain greedy of the same
round, and whether the outputs were plain greedy's. --variants pipelined,pipelined_bf16 sets the draft's int4 kernel
rollout (the default) against the same kernel on bf16 matrices, `graph` against the CUDA graph of torch kernels
(FLINT_DRAFT_KERNEL=0). --temperature T samples (real models; plain samples too, the same seeds; the outputs are
not compared; each round and prompt its own seed, the same for every variant), with --top-p / --top-k if given. JSON with --json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from flint.bench import device_name, load_bench_model, make_backend  # noqa: E402
from flint.engine import Engine, SamplingParams  # noqa: E402
from flint.speculative.verify import SpeculativeEngine  # noqa: E402


class DraftEnv:
    """A draft whose calls run under the environment ``env`` (FLINT_DRAFT_WEIGHTS=bf16: the kernel rollout on bf16
    matrices; FLINT_DRAFT_KERNEL=0: the CUDA graph of torch kernels). The draft keeps one kernel rollout per format
    and one graph per k, so alternating costs nothing."""

    def __init__(self, draft, env: dict):
        self.draft, self.env = draft, env

    def __getattr__(self, name):
        attr = getattr(self.draft, name)
        if name not in ("begin", "propose"):
            return attr

        def call(*a, **kw):
            old = {n: os.environ.get(n) for n in self.env}
            os.environ.update(self.env)
            try:
                return attr(*a, **kw)
            finally:
                for n, v in old.items():
                    if v is None:
                        del os.environ[n]
                    else:
                        os.environ[n] = v
        return call


class HostOrder:
    """A draft seen through ``propose`` only: the speculative loop then drafts after the read-back."""

    def __init__(self, draft):
        self.draft, self.cfg = draft, getattr(draft, "cfg", None)

    def propose(self, *a, **kw):
        return self.draft.propose(*a, **kw)


VARIANTS = ("pipelined", "host_order", "pipelined_bf16", "graph")


def _decode(eng, ids: list[int], sp, seed: int = 0) -> tuple[list[int], float]:
    eng.cached = []
    res = eng.generate(ids, dataclasses.replace(sp, seed=seed) if sp.temperature else sp)
    return res.token_ids, res.decode_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a GGUF path or synthetic:NAME (then --oracle-accept)")
    ap.add_argument("--draft", default="smollm2-135m", help="the draft of a real model")
    ap.add_argument("--k", default="2,3")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--per-kind", type=int, default=2, help="held-out prompts per kind (real model)")
    ap.add_argument("--prompts", type=int, default=3, help="random prompts (oracle)")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per prompt")
    ap.add_argument("--oracle-accept", type=float, default=None)
    ap.add_argument("--draft-vocab", type=int, default=8192, help="the oracle's random draft's head rows")
    ap.add_argument("--variants", default="pipelined,host_order",
                    help="of pipelined, host_order, pipelined_bf16 (the kernel rollout on bf16 matrices), graph "
                         "(the CUDA graph rollout)")
    ap.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature (real models)")
    ap.add_argument("--top-p", type=float, default=1.0, help="with --temperature: nucleus sampling")
    ap.add_argument("--top-k", type=int, default=0, help="with --temperature: top-k sampling (0: off)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    variants = tuple(a.variants.split(","))
    if not variants or not set(variants) <= set(VARIANTS):
        raise SystemExit(f"--variants {a.variants!r}: a comma list of {', '.join(VARIANTS)}")
    if a.temperature < 0:
        raise SystemExit(f"--temperature {a.temperature}: must be >= 0")
    if (a.top_p != 1.0 or a.top_k) and not a.temperature:
        raise SystemExit("--top-p / --top-k shape sampling: they need --temperature > 0")
    ks = [int(x) for x in a.k.split(",")]
    dev = torch.device("cuda")
    synthetic = a.model.startswith("synthetic:")
    if synthetic != (a.oracle_accept is not None):
        raise SystemExit("--oracle-accept goes with a synthetic:NAME model, and only there")
    if synthetic and a.temperature:
        raise SystemExit("--temperature: the oracle draft is greedy only")
    if synthetic:
        from flint.speculative.draft_head import DraftHead, draft_config_for
        from flint.speculative.oracle import OracleDraft

        lm = load_bench_model(a.model, 128, dev, 0)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, lm.cfg.vocab_size, (32,), generator=g).tolist() for _ in range(a.prompts)]
        sp = SamplingParams(max_new_tokens=a.tokens, ignore_eos=True)
        backend = make_backend("megakernel", lm, max_seq_len=32 + a.tokens + 16, device="cuda", group_size=128)
        torch.manual_seed(0)
        inner = DraftHead(draft_config_for(lm.cfg)).to(dev, torch.bfloat16)
        vocab = torch.randperm(lm.cfg.vocab_size, generator=g)[:a.draft_vocab]
        inner.attach_target(lm.cfg, lm.params, device=dev, dtype=torch.bfloat16, vocab=vocab)
    else:
        from flint.speculative.draft_head import load_draft
        from flint.speculative.draft_data import eval_prompts
        from flint.loading import load_model

        lm = load_model(a.model)
        tok = lm.tokenizer
        prompts = [tok.encode_chat([{"role": "user", "content": r["text"]}]) for r in eval_prompts(a.per_kind)]
        sp = SamplingParams(max_new_tokens=a.tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                            seed=0).validate()
        backend = make_backend("megakernel", lm, max_seq_len=2048, device="cuda", group_size=128)
        inner = load_draft(a.draft, lm.cfg, lm.params, device=dev)
    plain = Engine(backend)
    plain.generate(prompts[0], dataclasses.replace(sp, max_new_tokens=8))  # warm-up
    refs = [pr + _decode(plain, pr, sp)[0] for pr in prompts]

    def engine(k: int, variant: str, i: int):
        d = inner
        if synthetic:
            d = OracleDraft(inner, refs[i], a.oracle_accept, lm.cfg.vocab_size, seed=i)
        d = {"pipelined": d, "host_order": HostOrder(d), "pipelined_bf16": DraftEnv(d, {"FLINT_DRAFT_WEIGHTS": "bf16"}),
             "graph": DraftEnv(d, {"FLINT_DRAFT_KERNEL": "0"})}[variant]
        return SpeculativeEngine(backend, None, d, k=k)

    doc = {"device": device_name(dev), "model": a.model, "oracle": synthetic, "oracle_accept": a.oracle_accept,
           "temperature": a.temperature, "top_p": a.top_p, "top_k": a.top_k,
           "tokens": a.tokens, "prompts": len(prompts), "rounds": a.rounds, "rows": []}
    for k in ks:
        for v in variants:  # warm-up: the draft's launches for every k reached
            engine(k, v, 0).generate(prompts[0], dataclasses.replace(sp, max_new_tokens=2 * k + 2))
        per = {v: {"tok_s": [], "x_plain": [], "steps": 0, "accepted": 0, "identical": 0} for v in variants}
        for r in range(a.rounds):
            order = variants if r % 2 == 0 else variants[::-1]  # interleaved: where the scratch lands moves both
            n_plain, s_plain = 0, 0.0
            for i, pr in enumerate(prompts):
                toks, s = _decode(plain, pr, sp, 1000 * r + i)
                n_plain, s_plain = n_plain + len(toks) - 1, s_plain + s
            plain_tok_s = n_plain / s_plain
            for v in order:
                n_spec, s_spec = 0, 0.0
                for i, pr in enumerate(prompts):
                    eng = engine(k, v, i)
                    toks, s = _decode(eng, pr, sp, 1000 * r + i)  # (sampling: a new draw each round)
                    n_spec, s_spec = n_spec + len(toks) - 1, s_spec + s
                    st = eng.last_stats
                    per[v]["steps"] += st.steps
                    per[v]["accepted"] += st.accepted
                    per[v]["identical"] += int(pr + toks == refs[i])
                per[v]["tok_s"].append(round(n_spec / s_spec, 1))
                per[v]["x_plain"].append(round(n_spec / s_spec / plain_tok_s, 4))
            print(f"k={k} round {r}: plain {plain_tok_s:.1f} "
                  + " ".join(f"{v} {per[v]['tok_s'][-1]}" for v in variants), file=sys.stderr)
        for v in variants:
            p = per[v]
            doc["rows"].append({"k": k, "variant": v, "tokens_per_step": round((p["accepted"] + p["steps"]) / p["steps"], 3),
                                "tok_s": p["tok_s"], "median_tok_s": statistics.median(p["tok_s"]),
                                "x_plain": p["x_plain"], "median_x_plain": statistics.median(p["x_plain"]),
                                "identical_to_plain": (f"{p['identical']}/{len(prompts) * a.rounds}"
                                                       if not a.temperature else None)})
        row = {x["variant"]: x for x in doc["rows"] if x["k"] == k}
        for v in VARIANTS[1:]:
            if "pipelined" in row and v in row:
                row["pipelined"][f"pipelined_over_{v}"] = [round(x / y, 4) for x, y in
                                                           zip(row["pipelined"]["tok_s"], row[v]["tok_s"])]
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    print("| k | variant | tokens / step | tok/s (median) | × plain (median) | identical |")
    print("|---|---|---:|---:|---:|---|")
    for x in doc["rows"]:
        print(f"| {x['k']} | {x['variant']} | {x['tokens_per_step']} | {x['median_tok_s']} | {x['median_x_plain']} "
              f"| {x['identical_to_plain']} |")
    for x in doc["rows"]:
        for v in VARIANTS[1:]:
            if f"pipelined_over_{v}" in x:
                print(f"k={x['k']}: pipelined / {v} per round {x[f'pipelined_over_{v}']}")


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
