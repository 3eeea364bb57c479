"""`--draft auto`: the drafter chosen step by step, the default of `flint chat`, `generate` and `serve`.

Each verify step asks, in order: does the suffix draft (flint.speculative.suffix, over this request's prompt and output and
the model's recent outputs) propose, and, where the head could draft instead, expect at least ``SUFFIX_STRONG``
accepted tokens (k / 2, if smaller)? Then it drafts. Otherwise the model's draft head drafts where one is shipped
for this model (flint.speculative.draft_head.shipped_head_for: a draft whose target fingerprint equals the model's), at its own k.
Otherwise the step is a plain one (M = 1, nothing proposed). (The suffix draft proposes only what it expects to be
worth its verify against a plain step.)

Each drafter sits behind a gate that backs off where its drafts keep failing: the mean of its accepted tokens
per step (an exponential average, weight ``EMA_WEIGHT`` on the newest step, starting from ``GATE_PRIOR``) falling
below its floor shuts it for ``BACKOFF_STEPS`` steps, twice as long each time it fails again (up to
``BACKOFF_MAX``); a stretch above twice the floor resets the wait. The suffix draft states what each proposal
expects, so its floor is a share (``SUFFIX_FLOOR``) of the same average of what it expected: its gate shuts where
the text stops following the context as its matches predict, not where the matches are short. Gates start afresh
with each request, and a sampled request's suffix proposals come from its own trie only, so a seed gives the same
text whatever requests came before (a greedy text is plain greedy's anyway). So a kind whose text the drafters
cannot predict runs plain steps nearly all the time, and pays only the probes. What each step's drafts earned is read
from the context at the next call (the tokens appended after the proposal), so the draft needs no hook in the
verify loop. ``source`` names the drafter of the last proposal ("suffix", "head" or "none"), which the engine
counts per step (SpeculativeStats.drafters).

Where no drafter would propose, greedy decoding on a backend with a device loop (``greedy_run``) decodes
``PLAIN_RUN`` tokens in one burst (``plain_run``), as plain decoding does, instead of that many host-synchronised
M = 1 steps. With a pipelined head (a greedy rollout begun on the device before the host reads the verify back,
flint.speculative.verify) the head's rollout is begun every step its gate is open, and ``finish`` replaces it by the
suffix proposal where that is strong. Sampling goes through ``propose`` (the suffix proposal as a point mass,
the head's with its q): lossless either way.

Tests: ``pytest tests/test_suffix.py``.
"""
from __future__ import annotations

import torch

from .cost import CPU_VERIFY_COST, best_k
from .ngram import point_mass
from .suffix import K_MAX, SuffixDraft

SUFFIX_STRONG = 1.0   # expected accepted tokens (flint.speculative.suffix's calibrated score) for a suffix proposal to draft
                      # while the head could
SUFFIX_FLOOR = 0.3    # the suffix gate shuts below this share of the accepted tokens its proposals expected
HEAD_TOKEN_COST = 0.01      # the head's rollout a token, in plain steps, on a GPU (4-8% of a step for 7 tokens) ...
HEAD_TOKEN_COST_CPU = 0.035  # ... and on the CPU (its eager rollout: about a quarter of a step for 7)
HEAD_ACCEPT_PRIOR = 0.6      # the per-token acceptance the head's k starts from (its running estimate takes over)
HEAD_ACCEPT_WEIGHT = 8.0     # ... weighted as this many drafted positions; older positions decay by HEAD_ACCEPT_DECAY
HEAD_ACCEPT_DECAY = 0.9      # a step
GATE_PRIOR = 1.0      # a gate's average starts here: three straight failures shut it
EMA_WEIGHT = 0.25     # the newest step's weight in a gate's average
BACKOFF_STEPS = 16    # steps a shut gate waits before its drafter is tried again
BACKOFF_MAX = 256     # the longest wait, after repeated failures
PLAIN_RUN = 4         # tokens decoded in one plain burst where no drafter would propose (backends with greedy_run)


class Gate:
    """Back-off for one drafter: ``open`` while its average accepted tokens per step stay above ``floor``, or, for a
    drafter that states what it expects (``record``'s ``expected``), above ``floor`` x the average expected."""

    def __init__(self, floor: float):
        self.floor = floor
        self.mean = GATE_PRIOR
        self.expect = GATE_PRIOR
        self.wait = 0
        self.backoff = BACKOFF_STEPS

    @property
    def open(self) -> bool:
        return self.wait == 0

    def tick(self, steps: int = 1) -> None:
        """Verify steps passed."""
        if self.wait:
            self.wait = max(0, self.wait - steps)
            if not self.wait:
                self.mean = self.expect = GATE_PRIOR

    def record(self, accepted: int, expected: float | None = None) -> None:
        self.mean = (1 - EMA_WEIGHT) * self.mean + EMA_WEIGHT * accepted
        bar = self.floor
        if expected is not None:
            self.expect = (1 - EMA_WEIGHT) * self.expect + EMA_WEIGHT * expected
            bar *= self.expect
        if self.mean < bar:
            self.wait, self.backoff = self.backoff, min(2 * self.backoff, BACKOFF_MAX)
        elif self.mean >= 2 * bar:
            self.backoff = BACKOFF_STEPS


class AutoDraft:
    """The draft interface of flint.speculative.verify over a SuffixDraft and an optional draft head (module docstring)."""

    def __init__(self, suffix: SuffixDraft, head=None):
        self.suffix = suffix
        self.head = head
        self.vocab_size = suffix.vocab_size
        self.k_default = K_MAX
        self.head_k = getattr(getattr(head, "cfg", None), "k_default", 0) if head is not None else 0
        on_cpu = getattr(getattr(head, "device", None), "type", "cpu") == "cpu"
        self.head_token_cost = HEAD_TOKEN_COST_CPU if on_cpu else HEAD_TOKEN_COST
        self.verify_cost = CPU_VERIFY_COST
        self.gates = self._fresh_gates()
        self.source = "none"
        self._last = None  # (context list, its length then, the proposal, its drafter, its expected accepted)

    @property
    def cfg(self):  # SpeculativeEngine reads the default k from draft.cfg.k_default
        return self

    @property
    def pipelined(self) -> bool:
        return bool(getattr(self.head, "pipelined", False))

    @property
    def stateful(self) -> bool:
        return bool(getattr(self.head, "stateful", False))

    def reset_state(self, max_len: int) -> None:
        self.head.reset_state(max_len)

    def observe(self, hidden, tokens, count) -> None:
        self.head.observe(hidden, tokens, count)

    def samples_pipelined(self, sp) -> bool:
        return False

    def _settle(self, ctx: list[int]) -> None:
        """Score the previous proposal against what the verify appended to the same context since."""
        last, self._last = self._last, None
        for g in self.gates.values():
            g.tick()
        if last is None or last[0] is not ctx or len(ctx) <= last[1]:
            return
        _, at, drafts, src, expected = last
        if isinstance(drafts, torch.Tensor):  # (a head's rollout: read now, after the verify's own read-back)
            drafts = drafts.tolist()
        got = ctx[at:at + len(drafts)]
        n = 0
        while n < len(got) and got[n] == drafts[n]:
            n += 1
        self.gates[src].record(n, expected)
        if src == "head":
            a, t = self._head_counts
            self._head_counts = (HEAD_ACCEPT_DECAY * a + n, HEAD_ACCEPT_DECAY * t + n + (n < len(drafts)))

    def _suffix(self, ctx: list[int], k: int, greedy: bool = True) -> list[int]:
        """The suffix proposal where its gate is open and, while the head's gate is open too, it is strong (expects
        at least SUFFIX_STRONG accepted tokens, k / 2 if smaller), else [] (sampling: from the request's own trie,
        so a seed gives the same text whatever other requests left in the cache)."""
        if not self.gates["suffix"].open:
            return []
        toks, score = self.suffix.lookup(ctx, k, use_cache=greedy)
        return toks if not self._head_open() or score >= min(SUFFIX_STRONG, k / 2) else []

    def plain_run(self, ctx: list[int]) -> int:
        """Greedy decoding asks before each step: how many tokens to decode plainly first (flint.speculative.verify runs them
        as one burst of the backend's device loop): PLAIN_RUN where no drafter would propose now (the head absent,
        stateful or shut, no suffix proposal), else 0."""
        if self.stateful or self._head_open():
            return 0
        if self.gates["suffix"].open and self.suffix.lookup(ctx, K_MAX)[0]:
            return 0
        for g in self.gates.values():
            g.tick(PLAIN_RUN)
        self.source = "none"
        return PLAIN_RUN

    def _chosen(self, ctx: list[int], toks: list[int], src: str, expected: float | None = None) -> None:
        self.source = src if len(toks) else "none"
        self._last = (ctx, len(ctx), toks, src, expected) if len(toks) else None

    def _head_open(self) -> bool:
        return self.head is not None and self.gates["head"].open and self._head_draft_k(K_MAX) > 0

    def set_verify_cost(self, cost: tuple[float, ...]) -> None:
        """The backend's verify cost by width (flint.speculative.cost): the suffix draft's cut, the head's k and its
        gate's floor."""
        self.verify_cost = tuple(cost)
        self.suffix.set_verify_cost(cost)

    def _head_accept(self) -> float:
        """The head's per-token acceptance: its decayed counts of accepted over tried positions, with the prior."""
        return ((self._head_counts[0] + HEAD_ACCEPT_PRIOR * HEAD_ACCEPT_WEIGHT)
                / (self._head_counts[1] + HEAD_ACCEPT_WEIGHT))

    def _head_draft_k(self, k: int) -> int:
        """The head's draft length this step (at most ``k`` and its own k_default): the one worth most per verify
        time at its acceptance so far (flint.speculative.cost.best_k); 0 where no draft pays for its verify. (The head
        gate judges each head step against that k's break-even: the accepted tokens that pay for its verify and
        rollout, set by _head_drafts.)"""
        return best_k(self.verify_cost, self._head_accept(), min(k, self.head_k), self.head_token_cost)[0]

    def _head_drafts(self, k: int) -> int:
        """_head_draft_k for a step the head drafts now: its gate will judge the step against that k's break-even."""
        kk = self._head_draft_k(k)
        self.gates["head"].floor = self.verify_cost[kk + 1] + kk * self.head_token_cost - 1.0
        return kk

    def propose(self, context_ids: list[int], hidden=None, k: int = K_MAX, sp=None, gen=None):
        self._settle(context_ids)
        toks = self._suffix(context_ids, k, sp is None or sp.temperature == 0)
        if toks:
            self._chosen(context_ids, toks, "suffix", self.suffix.last[1])
            return point_mass(toks, self.vocab_size, sp)
        if self._head_open() and hidden is not None:
            t, q = self.head.propose(context_ids, hidden, self._head_drafts(k), sp, gen)
            self._chosen(context_ids, t, "head")
            return t, q
        self._chosen(context_ids, [], "none")
        return point_mass([], self.vocab_size, sp)

    def begin(self, hidden: torch.Tensor, tok: torch.Tensor, k: int):
        """The head's rollout for the next step, begun on the device while its gate is open (None otherwise)."""
        return self.head.begin(hidden, tok, self._head_drafts(k)) if self._head_open() else None

    def finish(self, pending, context_ids: list[int], k: int) -> torch.Tensor:
        self._settle(context_ids)
        toks = self._suffix(context_ids, k)
        if toks:
            self._chosen(context_ids, toks, "suffix", self.suffix.last[1])
            return torch.tensor(toks, dtype=torch.long)
        if pending is not None:
            t = self.head.finish(pending, context_ids, min(k, pending.shape[0]))
            self._chosen(context_ids, t, "head")
            return t
        self._chosen(context_ids, [], "none")
        return torch.empty(0, dtype=torch.long)

    def end_request(self, ctx: list[int], prompt_len: int) -> None:
        """The output joins the suffix cache; the gates start afresh (a request's drafts do not depend on the
        requests before it but through the cache, which sampled requests do not read)."""
        self.suffix.end_request(ctx, prompt_len)
        self._last = None
        self.gates = self._fresh_gates()

    def _fresh_gates(self) -> dict:
        """New gates (and the head's acceptance back to its prior); the head's floor is set with its k each step."""
        self._head_counts = (0.0, 0.0)
        return {"suffix": Gate(SUFFIX_FLOOR), "head": Gate(0.0)}


__all__ = ["AutoDraft", "Gate"]
