"""Tokens per verify step of the draft-free drafters, replayed over recorded greedy continuations: greedy speculative
decoding emits exactly the plain greedy text, so its walk (propose from the context, keep the leading proposals
that equal the text, then the target's own token) can be replayed from the text alone, without the model, for
any drafter and any setting of its knobs. Requests run in order through one draft, as a server's would (the
suffix draft's cache of outputs fills as they end).

    python3 lab/suffix_replay.py record --split train --tokens 128 --out runs/train.json   # plain greedy, once
    python3 lab/suffix_replay.py replay runs/train.json [--k 7] [--set MIN_MATCH=2 ...]
    python3 lab/suffix_replay.py cost      # the verify's time by width on the CPU: flint.speculative.suffix.VERIFY_COST

``record`` decodes the workload prompts (flint/data/workloads.json) plainly on the reference backend (CPU);
``replay`` prints tokens per step by kind for ngram, suffix and auto's suffix rule (auto's head is not replayed: it
needs the target's hidden states; a step auto would give the head counts here as a plain one), then each one's
speed against plain decoding projected from the verify's time by width (flint.speculative.suffix.VERIFY_COST, the CPU's).
``--set NAME=V`` overrides a knob of flint.speculative.suffix or flint.speculative.auto for the replay.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def record(args) -> None:
    from flint.backend import make_backend
    from flint.speculative.draft_data import workload_prompts
    from flint.engine import Engine, SamplingParams
    from flint.options import default_threads, set_threads
    from flint.loading import load_model

    set_threads(default_threads())  # (one thread on a 2-core box: as `flint` itself)
    lm = load_model(args.model)
    be = make_backend("reference", lm, 2048, device="cpu")
    eng = Engine(be, lm.tokenizer)
    rows = [r for r in workload_prompts(args.split) if not args.kinds or r["kind"] in args.kinds.split(",")]
    out = []
    for i, r in enumerate(rows):
        ids = lm.tokenizer.encode_chat(r["messages"])
        eng.cached = []
        res = eng.generate(ids, SamplingParams(max_new_tokens=args.tokens))
        out.append({"kind": r["kind"], "subject": r["subject"], "prompt": ids, "output": res.token_ids})
        print(f"{i + 1}/{len(rows)} {r['kind']} {len(res.token_ids)} tokens", file=sys.stderr, flush=True)
        Path(args.out).write_text(json.dumps({"split": args.split, "tokens": args.tokens, "records": out}))


def walk(draft, prompt: list[int], output: list[int], k: int, cost=None) -> tuple[int, int, float]:
    """(verify steps, tokens emitted after the first, their time in plain steps under ``cost``: the verify's time by
    its width M, cost[M], default flint.speculative.suffix.VERIFY_COST, the CPU's) of greedy speculative decoding that produces
    ``output``."""
    from flint.speculative.suffix import VERIFY_COST

    cost = cost or VERIFY_COST
    ctx = list(prompt) + output[:1]
    steps, time = 0, 0.0
    while len(ctx) - len(prompt) < len(output):
        left = len(output) - (len(ctx) - len(prompt))
        kk = max(0, min(k, left - 1))
        props = draft.propose(ctx, None, kk)[0].tolist() if kk else []
        truth = output[len(ctx) - len(prompt):]
        n = 0
        while n < len(props) and n < len(truth) - 1 and props[n] == truth[n]:
            n += 1
        ctx.extend(truth[:n + 1])
        steps += 1
        time += cost[1 + len(props)]
    if hasattr(draft, "end_request"):
        draft.end_request(ctx, len(prompt))
    return steps, len(output) - 1, time


def drafters(k: int) -> dict:
    """name -> a maker of each replayed drafter (the module's knobs read when it runs)."""
    import flint.speculative.auto as auto
    import flint.speculative.suffix as suffix
    from flint.speculative.ngram import NgramDraft

    return {"ngram": lambda: NgramDraft(49152, k_default=k), "suffix": lambda: suffix.SuffixDraft(49152),
            "auto (suffix rule)": lambda: auto.AutoDraft(suffix.SuffixDraft(49152))}


def replay(args) -> None:
    import flint.speculative.auto as auto
    import flint.speculative.suffix as suffix

    for kv in args.set or []:
        name, v = kv.split("=")
        for mod in (suffix, auto):
            if hasattr(mod, name):
                cur = getattr(mod, name)
                if isinstance(cur, bool):
                    val = v.lower() in ("1", "true")
                elif isinstance(cur, tuple):  # a table: comma-separated numbers (e.g. VERIFY_COST of another card)
                    val = tuple(type(cur[0])(x) for x in v.strip("()").split(","))
                else:
                    val = type(cur)(v)
                setattr(mod, name, val)
    recs = json.loads(Path(args.path).read_text())["records"]
    table = {}
    for name, make in drafters(args.k).items():
        d = make()
        for r in recs:
            s, t, c = walk(d, r["prompt"], r["output"], args.k)
            for key in (r["kind"], "all"):
                a = table.setdefault(name, {}).setdefault(key, [0, 0, 0.0])
                a[0] += s
                a[1] += t
                a[2] += c
    kinds = list(dict.fromkeys(r["kind"] for r in recs)) + ["all"]
    print(f"{'drafter':<20}" + "".join(f"{k:>11}" for k in kinds))
    for name, row in table.items():
        print(f"{name:<20}" + "".join(f"{row[k][1] / row[k][0]:>11.2f}" for k in kinds))
    print("tokens per verify step (the target's token counted)")
    for name, row in table.items():
        print(f"{name:<20}" + "".join(f"{row[k][1] / row[k][2]:>11.2f}" for k in kinds))
    print("x plain projected from the verify's time by width (flint.speculative.suffix.VERIFY_COST = "
          f"{', '.join(f'{c:g}' for c in suffix.VERIFY_COST[1:])} for M = 1..)")


def cost(args) -> None:
    """The verify's time by width on the reference backend (CPU), relative to M = 1: flint.speculative.suffix.VERIFY_COST."""
    import statistics
    import time

    import torch

    from flint.backend import make_backend
    from flint.options import default_threads, set_threads
    from flint.loading import load_model

    set_threads(default_threads())
    lm = load_model(args.model)
    be = make_backend("reference", lm, 2048, device="cpu")
    toks = torch.randint(0, 1000, (args.ctx,))
    be.forward(toks, 0)
    ts: dict[int, list[float]] = {m: [] for m in range(1, 9)}
    for _ in range(args.repeats):
        for m in ts:  # (widths interleaved: a shared machine's load falls on all alike)
            t0 = time.perf_counter()
            be.forward(toks[:m], args.ctx)
            ts[m].append(time.perf_counter() - t0)
    base = statistics.median(ts[1])
    print(f"M = 1: {base * 1e3:.1f} ms; by M:", {m: round(statistics.median(v) / base, 2) for m, v in ts.items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("record")
    p.add_argument("--model", default=None)
    p.add_argument("--split", default="train", choices=("train", "eval"))
    p.add_argument("--kinds", default=None, help="comma list (default: all)")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--out", required=True)
    p.set_defaults(func=record)
    p = sub.add_parser("replay")
    p.add_argument("path")
    p.add_argument("--k", type=int, default=7)
    p.add_argument("--set", action="append", help="NAME=VALUE: a knob of flint.speculative.suffix / flint.speculative.auto")
    p.set_defaults(func=replay)
    p = sub.add_parser("cost")
    p.add_argument("--model", default=None)
    p.add_argument("--ctx", type=int, default=300, help="context before the verified tokens")
    p.add_argument("--repeats", type=int, default=15)
    p.set_defaults(func=cost)
    args = ap.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
