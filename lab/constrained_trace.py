"""Where a constrained greedy token's time goes on the megakernel: the engine's pipelined loop (pipe_ahead, the
grammar's consume and fill while the step runs, pipe_publish, the wait in pipe_token) timed per token from the
host, beside the same model's unconstrained per-token loop (greedy_next, no mask) and its device loop (greedy_run),
in one process. ``--sequential`` hides the pipelined step, so the engine takes the sequential loop (set_token_mask,
greedy_next: the megakernel's launch, then its finish over the mask, the mask filled before the launch).

    FLINT_KERNEL_DIR=build/kernels python3 lab/constrained_trace.py [synthetic:granite-4.1-3b|embedded:smollm2] [--json F]

Per token it records each call's host time: the enqueue (pipe_ahead or greedy_launch), consume, fill, publish, and
the wait (pipe_token or greedy_finish: the step's remaining time plus the argmax). While fill + consume stay under
the step, the pipelined token costs the device loop's token plus the argmax; a fill longer than the step shows as
a wait near zero and a longer token.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from flint import grammar  # noqa: E402
from flint.backend import make_backend  # noqa: E402
from flint.bench import (BENCH_PROMPT, BENCH_SCHEMA, BENCH_SCHEMA_BOUNDED, FORCED_DOCUMENT, ForcedConstraint,  # noqa: E402
                         load_bench_model, proxy_tokenizer)
from flint.engine import Engine, SamplingParams  # noqa: E402


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="synthetic:granite-4.1-3b")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sequential", action="store_true", help="hide the pipelined step (the sequential loop)")
    ap.add_argument("--bounded", action="store_true",
                    help="the schema with maxLength-24 strings, unforced (random weights end it by the bound)")
    ap.add_argument("--json")
    a = ap.parse_args()
    dev = torch.device("cuda")
    lm = load_bench_model(a.model, 128, dev, 0)
    tok = lm.tokenizer or proxy_tokenizer(lm.cfg.vocab_size)
    schema = BENCH_SCHEMA_BOUNDED if a.bounded else BENCH_SCHEMA
    eos = tok.eos_token_ids[:1]
    ids = tok.encode_chat([{"role": "user", "content": BENCH_PROMPT}]) if tok.chat_template else tok.encode(BENCH_PROMPT)
    cons = grammar.Grammars(tok, lm.cfg.vocab_size, eos[0]).json_schema(schema, "schema")
    if lm.tokenizer is None and not a.bounded:  # random weights: forced, as flint bench does
        cons = ForcedConstraint(cons, tok.encode(json.dumps(FORCED_DOCUMENT)), eos[0])
    be = make_backend("megakernel", lm, max_seq_len=len(ids) + 4 * a.tokens + 8, device="cuda", group_size=128)

    class NoPipe:  # the backend without the pipelined step: the engine takes the sequential loop
        def __getattr__(self, name):
            if name.startswith("pipe_"):
                raise AttributeError(name)
            return getattr(be, name)

    eng = Engine(NoPipe() if a.sequential else be, tok, eos_token_ids=eos)

    ev = []  # (name, t) stamps

    def wrap(obj, name):
        f = getattr(obj, name)

        def g(*args, **kw):
            t0 = time.perf_counter()
            r = f(*args, **kw)
            ev.append((name, t0, time.perf_counter()))
            return r
        setattr(obj, name, g)

    for n in ("greedy_launch", "greedy_finish", "pipe_ahead", "pipe_publish", "pipe_token"):
        wrap(be, n)
    for n in ("fill", "consume"):
        orig = getattr(grammar.Matcher, n)

        def g(self, *args, _f=orig, _n=n, **kw):
            t0 = time.perf_counter()
            r = _f(self, *args, **kw)
            ev.append((_n, t0, time.perf_counter()))
            return r
        setattr(grammar.Matcher, n, g)

    free = SamplingParams(max_new_tokens=a.tokens, ignore_eos=True)
    bound = SamplingParams(max_new_tokens=4 * a.tokens, constraint=cons)
    eng.generate(ids, free)
    eng.generate(ids, bound)
    rows = {"greedy_run": [], "greedy_next": [], "constrained": []}
    names = ("greedy_launch", "consume", "fill", "greedy_finish") if a.sequential else \
        ("pipe_ahead", "consume", "fill", "pipe_publish", "pipe_token")
    per = {k: [] for k in names + ("token",)}
    for _ in range(a.repeats):
        eng.cached = []
        rows["greedy_run"].append(1e6 / eng.generate(ids, free).decode_tok_s)
        # the unconstrained per-token host loop: greedy_next token by token (what the constrained loop replaces)
        eng.cached = []
        r = eng.generate(ids, SamplingParams(max_new_tokens=1))
        t, p = r.token_ids[-1], len(ids)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(a.tokens):
            t = be.greedy_next(t, p + i)
        rows["greedy_next"].append((time.perf_counter() - t0) * 1e6 / a.tokens)
        eng.cached = []
        ev.clear()
        r = eng.generate(ids, bound)
        rows["constrained"].append(1e6 / r.decode_tok_s)
        wait = "greedy_finish" if a.sequential else "pipe_token"
        fin = [e for e in ev if e[0] == wait]
        for name in per:
            per[name] += [(e[2] - e[1]) * 1e6 for e in ev if e[0] == name][1:]
        per["token"] += [(b[2] - a_[2]) * 1e6 for a_, b in zip(fin, fin[1:])]
    out = {"model": a.model, "loop": "sequential" if a.sequential else "pipelined", "us_per_token": {k: statistics.median(v) for k, v in rows.items()},
           "per_token": {k: {"median": statistics.median(v), "p90": pct(v, 0.9), "max": max(v), "n": len(v)}
                         for k, v in per.items() if v}}
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    print(f"{a.model}: us per token, median of {a.repeats}: " +
          ", ".join(f"{k} {v:.1f}" for k, v in out["us_per_token"].items()))
    print("| per constrained token (us) | median | p90 | max |\n|---|---:|---:|---:|")
    for k, v in out["per_token"].items():
        print(f"| {k} | {v['median']:.1f} | {v['p90']:.1f} | {v['max']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
