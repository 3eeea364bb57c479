"""Host cost per token of the engine's constrained loop, without a model: a stub backend whose greedy_next
returns the lowest token its mask allows (numpy over the mask words), so what is timed is flint's own per-token
work (llguidance's mask fill, the mask copy and set_token_mask, the grammar advance, the engine's bookkeeping)
plus the stub's pick, which is timed alone and subtracted. The lowest allowed token inside a free string never
closes it, so that walk ends at 300 tokens, most of them in a string (the common state of real outputs).

    python3 lab/studies/constrained_host_cost.py [--vocab 49152,100352] [--reps 5]

Results: bench/results/grammar_engines_2026-12-02.md.
"""
from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import numpy as np
import torch

from flint.bench import BENCH_SCHEMA, BENCH_SCHEMA_BOUNDED, proxy_tokenizer
from flint.engine import Engine, SamplingParams
from flint.grammar import Grammars
from flint.token_mask import check_token_mask


class StubBackend:
    """greedy_next = the lowest allowed token (no model); forward = zeros (the first token's logits)."""
    name = "stub"

    def __init__(self, vocab: int):
        self.cfg = SimpleNamespace(vocab_size=vocab, eos_token_ids=[2])
        self.device, self.max_seq_len, self.mask, self.pick_s = torch.device("cpu"), 4096, None, 0.0

    def forward(self, tokens, start_pos, return_hidden=False, last_only=False):
        return torch.zeros(1, self.cfg.vocab_size)

    def set_token_mask(self, mask):
        self.mask = check_token_mask(self, mask)

    def greedy_next(self, token, pos):
        t0 = time.perf_counter()
        w = self.mask.numpy().view(np.uint32)
        i = int(np.flatnonzero(w)[0])
        word = int(w[i])
        tok = 32 * i + ((word & -word).bit_length() - 1)
        self.pick_s += time.perf_counter() - t0
        return tok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", default="49152,100352")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    for vocab in (int(v) for v in args.vocab.split(",")):
        tok = proxy_tokenizer(vocab)
        b = StubBackend(vocab)
        engine = Engine(b, tok, eos_token_ids=[2])
        for label, schema in (("free strings", BENCH_SCHEMA), ("strings of maxLength 24", BENCH_SCHEMA_BOUNDED)):
            c = Grammars(tok, vocab, 2).json_schema(schema)
            ids = tok.encode("Describe a city as JSON:")
            per_token, grammar, n = [], [], 0
            for _ in range(args.reps + 1):
                b.pick_s, c.seconds = 0.0, 0.0
                engine.cached = []
                t0 = time.perf_counter()
                r = engine.generate(ids, SamplingParams(max_new_tokens=300, constraint=c))
                dt = time.perf_counter() - t0 - b.pick_s
                per_token.append(dt / len(r.token_ids))
                grammar.append(c.seconds / len(r.token_ids))
                n = len(r.token_ids)
            us = sorted(x * 1e6 for x in per_token[1:])  # the first walk warms up
            print(f"vocab {vocab}, {label}: {n} tokens ({r.finish_reason}), engine host work per constrained token: "
                  f"median {statistics.median(us):.0f} us (min {us[0]:.0f}, max {us[-1]:.0f}), of which the grammar "
                  f"{statistics.median(grammar[1:]) * 1e6:.0f} us, over {args.reps} walks")

if __name__ == "__main__":
    main()
