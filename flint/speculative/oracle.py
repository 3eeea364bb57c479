"""Oracle acceptance: a benchmarking-only draft that sets speculative decoding's acceptance by hand.

Random weights (synthetic Granite shapes) accept nothing a draft proposes, so their speculative tok/s says
nothing about a real model's. The oracle runs a real draft's whole rollout (its cost is paid and timed) and then
replaces its proposals with the target's own greedy continuation, known from a plain greedy run of the same
prompt; each proposal is kept with probability ``accept`` (independently, seeded), and the first one not kept
is changed to a token the target rejects. Tokens per verify step then average (1 - a^(k+1)) / (1 - a) and are
measured and recorded beside tok/s. The output is still the target's own (the verify is unchanged): a run whose
output differs from plain greedy is a bug and is reported. Greedy only.

    flint bench --model synthetic:granite-4.1-3b --backend megakernel --draft oracle --oracle-accept 0.7 --draft-k 4
Tests: ``pytest tests/test_oracle.py``.
"""
from __future__ import annotations

import random

import torch


def expected_tokens_per_step(accept: float, k: int) -> float:
    """Mean tokens per verify step (accepted drafts + the target's own) when each of k drafts is kept with
    probability ``accept`` until the first that is not."""
    return float(k + 1) if accept >= 1 else (1 - accept ** (k + 1)) / (1 - accept)


class OracleDraft:
    """The draft interface of flint.speculative.verify: ``propose(context_ids, hidden, k, sp, gen)``. ``inner``: the
    draft whose rollout runs (and is discarded); ``reference``: prompt + the target's plain greedy tokens."""

    def __init__(self, inner, reference: list[int], accept: float, vocab_size: int, seed: int = 0):
        if not 0 <= accept <= 1:
            raise ValueError(f"oracle draft: accept must lie in [0, 1], got {accept!r}")
        self.inner, self.reference, self.accept, self.vocab_size = inner, list(reference), accept, vocab_size
        self.cfg = getattr(inner, "cfg", None)
        self.rng = random.Random(seed)
        self.off_reference = 0  # proposals asked for at a context that is not the reference's (a bug)

    def propose(self, context_ids: list[int], hidden, k: int, sp=None, gen=None):
        if sp is not None and sp.temperature != 0:
            raise ValueError("oracle draft: greedy only (temperature 0)")
        toks, _ = self.inner.propose(context_ids, hidden, k, None, gen)  # the real rollout's cost
        return self._replace(context_ids, toks, k), None

    @property
    def pipelined(self) -> bool:
        """Whether ``begin`` / ``finish`` apply: where the inner draft has them."""
        return bool(getattr(self.inner, "pipelined", False))

    def begin(self, hidden, tok, k: int):
        """The inner draft's rollout enqueued from device inputs (flint.speculative.verify's pipelined step): its cost
        is paid; ``finish`` replaces its proposals once the context is known."""
        return self.inner.begin(hidden, tok, k)

    def finish(self, pending, context_ids: list[int], k: int):
        return self._replace(context_ids, self.inner.finish(pending, context_ids, k), k)

    def _replace(self, context_ids: list[int], toks, k: int):
        n = len(context_ids)
        ref = self.reference
        if context_ids[-1] != ref[n - 1] or n + k > len(ref):
            if context_ids[-1] != ref[n - 1]:
                self.off_reference += 1
            return toks  # past the reference (or off it): the draft's own proposals
        out = list(ref[n:n + k])
        for j in range(k):
            if self.rng.random() >= self.accept:
                out[j] = (out[j] + 1) % self.vocab_size  # not the target's token: rejected here
                break
        return torch.tensor(out, dtype=torch.long)  # (host ids: the verify's step copies them in, async)


__all__ = ["OracleDraft", "expected_tokens_per_step"]
