"""Draft-free speculative decoding: prompt-lookup (n-gram) proposals for any model, no training.

The proposal for the next tokens is what followed the most recent earlier occurrence of the context's last n
tokens (n from ``max_ngram`` down to ``min_ngram``; the longest match wins), up to k tokens. It shines where the
answer repeats its input (editing, summarising, code); where nothing matches it proposes nothing and the verify
step is a plain M = 1 step, so it never costs more than the match it found. Verification is the same lossless
verify as a trained draft's (flint.speculative.verify): greedy output identical to plain greedy; with sampling the
proposal is a point mass (q = one-hot), so a draft token x is kept with probability p(x) and a rejection is drawn
from p without x.

The index of n-grams is kept across the calls of one generation (the context only grows), so a proposal costs
O(max_ngram) dictionary operations per new token, not a scan of the context.

    flint chat --draft ngram            flint bench --model M --draft ngram --draft-k 4
Tests: ``pytest tests/test_ngram.py``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class NgramConfig:
    vocab_size: int
    max_ngram: int = 3  # the longest suffix looked up
    min_ngram: int = 2  # the shortest (1-token matches propose noise: each wrong token is a wider verify)
    k_default: int = 4  # tokens proposed per step at most (SpeculativeEngine's k)


class NgramDraft:
    """``propose(context_ids, hidden, k, sp, gen) -> (tokens[<= k], q or None)``: the draft interface of
    flint.speculative.verify; ``hidden`` is unused."""

    name = "ngram"  # (what the engine's statistics call this drafter)

    def __init__(self, vocab_size: int, max_ngram: int = 3, min_ngram: int = 2, k_default: int = 4):
        for name, v in (("vocab_size", vocab_size), ("max_ngram", max_ngram), ("min_ngram", min_ngram),
                        ("k_default", k_default)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"ngram draft: {name} must be a positive integer, got {v!r}")
        if min_ngram > max_ngram:
            raise ValueError(f"ngram draft: min_ngram ({min_ngram}) must be <= max_ngram ({max_ngram})")
        self.cfg = NgramConfig(vocab_size, max_ngram, min_ngram, k_default)
        self._ctx_id = None  # the context list the index was built from
        self._indexed = 0    # continuation positions j < _indexed are in the index
        self._last: list[dict] = []

    def _update(self, ctx: list[int]) -> None:
        """Index every n-gram ctx[j - n:j] that has a continuation (j < len(ctx)) at its latest j."""
        if ctx is not self._ctx_id or len(ctx) < self._indexed:
            self._ctx_id, self._indexed = ctx, 0
            self._last = [dict() for _ in range(self.cfg.max_ngram + 1)]
        for j in range(max(self._indexed, 1), len(ctx)):
            for n in range(self.cfg.min_ngram, min(self.cfg.max_ngram, j) + 1):
                self._last[n][tuple(ctx[j - n:j])] = j
        self._indexed = max(self._indexed, len(ctx))

    def lookup(self, ctx: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix ([] if none)."""
        if k < 1 or len(ctx) < self.cfg.min_ngram + 1:
            return []
        self._update(ctx)
        L = len(ctx)
        for n in range(min(self.cfg.max_ngram, L - 1), self.cfg.min_ngram - 1, -1):
            j = self._last[n].get(tuple(ctx[L - n:]))
            if j is not None:
                return ctx[j:j + k]
        return []

    def propose(self, context_ids: list[int], hidden=None, k: int = 4, sp=None, gen=None):
        return point_mass(self.lookup(context_ids, k), self.cfg.vocab_size, sp)


def point_mass(toks: list[int], vocab_size: int, sp):
    """A draft-free proposal as flint.speculative.verify takes it: (tokens, q), q None when greedy, else one-hot
    rows."""
    t = torch.tensor(toks, dtype=torch.long)
    if sp is None or sp.temperature == 0:
        return t, None
    q = torch.zeros((len(toks), vocab_size))
    if toks:
        q[torch.arange(len(toks)), t] = 1.0
    return t, q


__all__ = ["NgramConfig", "NgramDraft", "point_mass"]
