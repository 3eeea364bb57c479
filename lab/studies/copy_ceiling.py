"""How much of the target's greedy text could any drafter that copies from the context predict? Oracles replayed
over recorded plain greedy continuations (lab/suffix_replay.py record), beside the draft-free drafters as they are.

Greedy speculative decoding emits the plain greedy text, so its walk can be replayed from the text alone: at each
step a drafter proposes up to k tokens, the leading ones equal to the text are kept, then the target's own token
(lab/suffix_replay.py's walk). The oracles know the text and propose the most of it that a copying drafter could:

- ``copy``: the longest run of the coming text (<= k tokens) that occurs verbatim anywhere in the sources (this
  request's prompt and output so far, and the earlier requests' outputs, as the suffix draft's cache holds them).
  A perfect choice among every position: the best any drafter of contiguous copies can do.
- ``copy, keyed m``: the same, where the copied run must follow an occurrence of the context's last m tokens (the
  drafter finds its copy by matching m tokens, then chooses perfectly among the matches).
- ``spliced m``: each proposed token must follow, somewhere in the sources, an occurrence of the m tokens before it
  (the context and the tokens proposed so far): the bound on every suffix / n-gram drafter with matches of at
  least m tokens that re-matches after each token (suffix re-matches; MIN_MATCH = 2). ``spliced 0``: every
  proposed token occurs in the sources at all.

    python3 lab/studies/copy_ceiling.py RECORDED.json [RECORDED2.json ...] [--k 7] [--out result.json]

Prints tokens per verify step by kind (the target's token counted; "grounded": the input-grounded kinds' prompts
pooled, "mean": those kinds' mean, as flint bench's figure) per oracle and drafter, and how often the suffix
draft's tokens are right by the length of the match behind them (what flint.speculative.suffix.hit is fitted to, on the train
split), then one JSON document (also written to --out). CPU, seconds.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from suffix_replay import drafters, walk  # noqa: E402

from flint.speculative.draft_data import WORKLOADS_FILE  # noqa: E402

GROUNDED = set(json.loads(WORKLOADS_FILE.read_text())["grounded_kinds"])  # the input-grounded kinds


class Sources:
    """Every n-gram (n <= depth) of the sources with what followed it; sequences added token by token."""

    def __init__(self, depth: int = 8):
        self.depth = depth
        self.grams: set[tuple[int, ...]] = set()

    def add(self, seq: list[int], start: int = 0) -> None:
        """Index the n-grams of ``seq`` that end at positions >= ``start``."""
        for j in range(start, len(seq)):
            for n in range(1, min(self.depth, j + 1) + 1):
                self.grams.add(tuple(seq[j + 1 - n:j + 1]))

    def has(self, gram) -> bool:
        return tuple(gram) in self.grams


class Oracle:
    """A drafter that knows the text (``output``) and proposes the most of it its rule allows (module docstring)."""

    def __init__(self, rule: str, m: int, k: int):
        self.rule, self.m = rule, m
        self.cache = Sources(depth=k + m + 1)  # the earlier requests' outputs
        self.src = Sources(depth=k + m + 1)    # this request's prompt and output
        self.prompt_len = 0
        self.output: list[int] = []
        self._seen = 0

    def start(self, prompt: list[int], output: list[int]) -> None:
        self.prompt_len, self.output, self._seen = len(prompt), output, 0
        self.src = Sources(self.src.depth)

    def _has(self, gram) -> bool:
        return self.src.has(gram) or self.cache.has(gram)

    def propose(self, ctx: list[int], hidden, k: int):
        import torch

        self.src.add(ctx, self._seen)
        self._seen = len(ctx)
        truth = self.output[len(ctx) - self.prompt_len:][:k]
        m = self.m
        n = 0
        if self.rule == "copy":
            key = ctx[len(ctx) - m:] if m else []
            while n < len(truth) and self._has(key + truth[:n + 1]):
                n += 1
        else:  # spliced: each token follows an occurrence of the m tokens before it
            seq = list(ctx)
            while n < len(truth) and self._has((seq[len(seq) - m:] if m else []) + [truth[n]]):
                seq.append(truth[n])
                n += 1
        return torch.tensor(truth[:n], dtype=torch.long), None

    def end_request(self, ctx: list[int], prompt_len: int) -> None:
        """The output stays a source for later requests (the suffix draft's cache)."""
        self.cache.add(ctx[prompt_len:])


def oracles(k: int) -> dict:
    return {"copy": lambda: Oracle("copy", 0, k), "copy, keyed 1": lambda: Oracle("copy", 1, k),
            "copy, keyed 2": lambda: Oracle("copy", 2, k), "spliced 0": lambda: Oracle("spliced", 0, k),
            "spliced 1": lambda: Oracle("spliced", 1, k), "spliced 2": lambda: Oracle("spliced", 2, k)}


def table(recs: list[dict], makers: dict, k: int) -> dict:
    out = {}
    for name, make in makers.items():
        d = make()
        acc: dict[str, list[int]] = {}
        for r in recs:
            if isinstance(d, Oracle):
                d.start(r["prompt"], r["output"])
            s, t, _ = walk(d, r["prompt"], r["output"], k)
            for key in (r["kind"], "all") + (("grounded",) if r["kind"] in GROUNDED else ()):
                a = acc.setdefault(key, [0, 0])
                a[0] += s
                a[1] += t
        out[name] = {key: round(t / s, 3) for key, (s, t) in acc.items()}
        mine = [v for key, v in out[name].items() if key in GROUNDED]
        out[name]["mean"] = round(sum(mine) / max(1, len(mine)), 3)  # the grounded kinds' mean (flint bench's)
    return out


def calibration(recs: list[dict], k: int) -> dict:
    """How often the suffix draft's i-th proposed token (the one before it right) is the target's, by the match
    length behind it (the first match's m + i: a right token lengthens the match), for the request's own trie and
    the cache, against flint.speculative.suffix.hit. Proposals taken whole (no cost cut, no floor on their chance)."""
    import flint.speculative.suffix as suffix

    saved = suffix.MIN_PROB, suffix.CUT_BY_COST
    suffix.MIN_PROB, suffix.CUT_BY_COST = 0.0, False
    d, tally = suffix.SuffixDraft(49152), {}
    try:
        for r in recs:
            prompt, output = r["prompt"], r["output"]
            ctx = list(prompt) + output[:1]
            while len(ctx) - len(prompt) < len(output) - 1:
                toks, _ = d.lookup(ctx, k)
                src, _, m = d.last
                truth = output[len(ctx) - len(prompt):]
                n = 0
                while n < len(toks) and n < len(truth) - 1 and toks[n] == truth[n]:
                    n += 1
                for i in range(min(len(toks), len(truth) - 1, n + 1)):  # tried: those up to the first wrong
                    a = tally.setdefault(src, {}).setdefault(min(m + i, 8), [0, 0])
                    a[0] += 1
                    a[1] += i < n
                ctx.extend(truth[:n + 1])
            d.end_request(ctx, len(prompt))
    finally:
        suffix.MIN_PROB, suffix.CUT_BY_COST = saved
    trust = {"prompt+output": 1.0, "cache": suffix.CACHE_TRUST}
    return {src: {m: {"tried": t, "right": round(a / t, 3), "hit": round(suffix.hit(m, trust[src]), 3)}
                  for m, (t, a) in sorted(rows.items())} for src, rows in tally.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    doc = {"k": args.k, "unit": "tokens per verify step, the target's token counted", "splits": {}}
    for path in args.paths:
        rec = json.loads(Path(path).read_text())
        recs = rec["records"]
        res = table(recs, {**oracles(args.k), **drafters(args.k)}, args.k)
        cal = calibration(recs, args.k)
        doc["splits"][rec["split"]] = {"file": Path(path).name, "prompts": len(recs), "tokens": rec["tokens"],
                                       "table": res, "calibration": cal}
        kinds = list(dict.fromkeys(r["kind"] for r in recs)) + ["grounded", "mean", "all"]
        print(f"## {rec['split']} ({len(recs)} prompts, {Path(path).name})")
        print(f"{'':<20}" + "".join(f"{c:>10}" for c in kinds))
        for name, row in res.items():
            print(f"{name:<20}" + "".join(f"{row[c]:>10.2f}" for c in kinds))
        for src, rows in cal.items():
            print(f"suffix's proposals from {src}, by match length: right / tried (flint.speculative.suffix.hit): " + ", ".join(
                f"{m}: {v['right']:.2f} of {v['tried']} ({v['hit']:.2f})" for m, v in rows.items()))
    print(json.dumps(doc))
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
