"""Speculative decoding on any backend: a draft proposes K tokens, the target checks them in ONE
forward of M = K + 1 tokens, and the output is exactly what the target alone would produce.

Greedy: the matching prefix of the proposals is accepted, plus the target's own next token (a
correction on a mismatch, a bonus when all K match). Sampling (temperature / top-k / top-p, the
same transforms as flint.engine): standard speculative sampling — proposal x drawn from the draft's
q is kept with probability min(1, p(x)/q(x)), a rejection is replaced by a draw from
norm(max(0, p - q)), and when all K are kept a bonus token is drawn from p — so every token is
distributed as the target's. Rejected positions need no cleanup: the next forward starts at the
right start_pos and overwrites them (the backend API's rollback).

The draft is any object with ``propose(context_ids, hidden, k, sp, gen) -> (tokens[j], q[j, V] or
None)``, j <= k (flint.speculative.draft_head.DraftHead; flint.speculative.ngram.NgramDraft, which may propose
fewer or none; ``hidden`` is the target's last-layer hidden state before context_ids[-1]). A step with no proposal
is a plain M = 1 step. Logprobs (``sp.logprobs``) come from the verify row each emitted token was chosen
from, the target's own distribution at its position. Acceptance is reported as tokens per verify step = accepted drafts + 1 (the
target's own token is counted), so it lies in [1, K + 1]. Grammar constraints (``sp.constraint``) are refused,
as logit bias and penalties are (``Engine.unsupported``: this loop applies no token mask to its drafts or its
verify rows); `flint serve --draft` answers a constrained request with a 400 naming its field, unless the engine
was built with ``plain_fallback`` (``--draft auto``), which decodes such a request plainly. Optional parts of the
draft interface: ``source`` or ``name`` (the drafter counted per step in ``SpeculativeStats.drafters``),
``end_request(context, prompt_len)`` (a generation ended: flint.speculative.suffix keeps its output),
``plain_run(context)`` (tokens to decode plainly first, as one burst of a backend's ``greedy_run``, greedy only).
Tests: ``pytest tests/test_speculative.py`` (the refusal: ``tests/test_structured.py``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from ..engine import Engine, SamplingParams, inverse_cdf_draw, probs_from_logits, sample, token_logprob


@dataclass
class SpeculativeStats:
    steps: int = 0  # target verify forwards
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    drafters: dict = field(default_factory=dict)  # verify steps by the drafter that proposed ("none": a plain step)

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens emitted per verify step: accepted drafts + the target's own token."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    @property
    def accept_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def add(self, other: "SpeculativeStats") -> None:
        self.steps += other.steps
        self.drafted += other.drafted
        self.accepted += other.accepted
        for name, n in other.drafters.items():
            self.drafters[name] = self.drafters.get(name, 0) + n

    def summary(self) -> dict | None:
        """Tokens per verify step and the share of steps each drafter proposed (what --stats and a response's
        timings report); None without a verify step (a plain generation)."""
        if not self.steps:
            return None
        return {"tokens_per_step": round(self.tokens_per_step, 3), "verify_steps": self.steps,
                "drafters": {k: round(v / self.steps, 3) for k, v in sorted(self.drafters.items())}}


def verify_greedy(target_tokens: list[int], drafts: list[int]) -> tuple[int, int]:
    """target_tokens: the target's argmax after each of the M = k+1 verified tokens. Returns
    (drafts accepted n, the target's own next token target_tokens[n])."""
    n = 0
    while n < len(drafts) and drafts[n] == target_tokens[n]:
        n += 1
    return n, target_tokens[n]


def verify_sampling(p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor,
                    gen: torch.Generator | None) -> torch.Tensor:
    """Speculative sampling, every step on p's device (no host synchronisation). p [k+1, V]: the target's
    distributions after each verified token; q [k, V]: the draft's, drafts [k] drawn from q (k = 0: q None).
    Returns a LongTensor [2] on p's device: (accepted n, next token), the next token drawn from
    norm(max(0, p[n] - q[n])) after a rejection, from p[k] when all are accepted, by inverse CDF of a uniform.
    The k + 1 uniforms are drawn from ``gen`` first, then ``accept_with`` decides."""
    u = torch.rand(drafts.shape[0] + 1, generator=gen, device=p.device)
    return accept_with(p, q, drafts, u)


def accept_with(p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """verify_sampling's decision given its uniforms u [k+1] (u[j] tests draft j, u[k] draws the next token): fixed
    shapes, no host sync, no generator (the body of the captured acceptance, ``AcceptGraphs``)."""
    k = drafts.shape[0]
    dev = p.device
    if k:
        idx = torch.arange(k, device=dev)
        keep = u[:k] * q[idx, drafts] <= p[idx, drafts]  # u < p/q without dividing; q(x) > 0 since x ~ q
        n = keep.long().cumprod(0).sum(0, keepdim=True)
        # row j < k: the residual after rejecting draft j; row k: p[k], the bonus token's distribution
        r = torch.cat(((p[:k] - q).clamp_min(0), p[k:k + 1])).index_select(0, n)[0]
        pn = p.index_select(0, n)[0]
        r = torch.where(r.sum() > 0, r, pn)  # p == q up to rounding: that rejection had probability ~0
    else:
        n = torch.zeros(1, dtype=torch.long, device=dev)
        r = p[0]
    return torch.cat((n, inverse_cdf_draw(r, u[k:])))


# the captured acceptances kept per engine (one per k, transform and shapes; a server's requests bring their own)
ACCEPT_GRAPHS_MAX = 16


class AcceptGraphs:
    """A sampled verify step's acceptance on CUDA as one captured graph: p = probs_from_logits(verify logits), the
    draft's q (``q_fn`` of what the draft returned: its probabilities, or the rollout kernel's logits), accept_with,
    and the step's values (n, next token, drafts) in one tensor. Run eagerly it is ~125 small aten calls a step, and
    the sampled step was bound by their launches (1427 against the greedy step's 975 µs with 931 against 890 µs of
    GPU kernels, lab/spec_sampled_profile.py). Inputs are copied into static buffers, the uniforms drawn outside
    (verify_sampling's draws, so the tokens are the eager path's bit for bit); FLINT_SPEC_GRAPH=0 runs it eagerly."""

    def __init__(self):
        self.cache: dict = {}

    @staticmethod
    def applies(device: torch.device) -> bool:
        return device.type == "cuda" and os.environ.get("FLINT_SPEC_GRAPH", "1") != "0"

    def __call__(self, logits: torch.Tensor, q_src: torch.Tensor | None, q_fn, q_key, drafts: torch.Tensor,
                 u: torch.Tensor, sampling: tuple) -> torch.Tensor:
        """(n, next token, drafts...) LongTensor [k + 2] on the device; the returned tensor is the graph's own output,
        valid until its next replay (read it, or copy it, on the same stream)."""
        k = drafts.shape[0]
        key = (k, tuple(logits.shape), logits.dtype, logits.device, None if q_src is None else tuple(q_src.shape),
               None if q_src is None else q_src.dtype, q_key, sampling)
        g = self.cache.get(key)
        if g is None:
            if len(self.cache) >= ACCEPT_GRAPHS_MAX:
                self.cache.pop(next(iter(self.cache)))
            g = self.cache[key] = _AcceptGraph(logits, q_src, q_fn, drafts, u, sampling)
        return g(logits, q_src, drafts, u)


class _AcceptGraph:
    def __init__(self, logits, q_src, q_fn, drafts, u, sampling):
        dev = logits.device
        self.logits = torch.zeros_like(logits)
        self.q_src = None if q_src is None else torch.full_like(q_src, 1.0 / q_src.shape[-1])
        self.drafts = torch.zeros_like(drafts)
        self.u = torch.full_like(u, 0.5)
        self.q_fn, self.sampling = q_fn, sampling
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.inference_mode(), torch.cuda.stream(side):  # warm-up off the capture (workspaces, kernels)
            for _ in range(2):
                self._body()
        torch.cuda.current_stream(dev).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(self.graph):
            self.out = self._body()

    def _body(self) -> torch.Tensor:
        p = probs_from_logits(self.logits, *self.sampling)
        q = None if self.q_src is None else self.q_fn(self.q_src)
        return torch.cat((accept_with(p, q, self.drafts, self.u), self.drafts))

    def __call__(self, logits, q_src, drafts, u) -> torch.Tensor:
        self.logits.copy_(logits)
        if q_src is not None:
            self.q_src.copy_(q_src)
        self.drafts.copy_(drafts)
        self.u.copy_(u)
        self.graph.replay()
        return self.out


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


class SpeculativeEngine(Engine):
    """Engine's interface (stream / generate / last / check_fits, KV reuse across calls) with
    speculative decoding; ``last_stats`` / ``acceptance()`` give the last call's acceptance and
    ``total_stats`` the running sum."""

    def __init__(self, backend, tokenizer, draft, k: int | None = None, eos_token_ids=None,
                 plain_fallback: bool = False):
        """``plain_fallback``: a request the speculative loop cannot honour (logit bias, penalties, min_p, a grammar)
        decodes plainly instead of being refused (``--draft auto``: speculation only where it can run)."""
        super().__init__(backend, tokenizer, eos_token_ids)
        if k is None:
            k = getattr(getattr(draft, "cfg", None), "k_default", 4)
        if not isinstance(k, int) or k < 1:
            raise ValueError("speculative decoding: k (draft tokens per step) must be an integer >= 1, "
                             f"got {k!r}")
        self.draft = draft
        self.k = k
        self.plain_fallback = plain_fallback
        self.verify_cost = None  # the backend's verify cost by width, where the draft cuts its proposals by it
        if hasattr(draft, "set_verify_cost"):
            from .cost import verify_cost_of

            self.verify_cost = verify_cost_of(backend)
            draft.set_verify_cost(self.verify_cost)
        self._request = None  # (context, prompt length) of the generation running, for the draft's end_request
        self.last_stats = SpeculativeStats()
        self.total_stats = SpeculativeStats()
        self._host_vals = self._read_done = None  # the pipelined step's pinned read-back buffer and its event
        self._accept = AcceptGraphs()

    def acceptance(self) -> float:
        """Mean tokens per verify step of the last call (accepted drafts + the target's token)."""
        return self.last_stats.tokens_per_step

    def unsupported(self, sp: SamplingParams) -> list[str]:
        """Logprobs are honoured: each emitted token's distribution is the verify row it was chosen from (the
        first token's, the prefill's). Logit bias, penalties and min_p are not: the verify compares the
        draft with unadjusted distributions."""
        if self.plain_fallback:
            return []
        return self._spec_unsupported(sp)

    def _spec_unsupported(self, sp: SamplingParams) -> list[str]:
        return [f for f in super().unsupported(sp) if f != "logprobs"]

    def _on_start(self) -> None:
        self.last_stats = SpeculativeStats()

    def stream(self, prompt_ids: list[int], sp: SamplingParams, should_stop=None):
        try:
            yield from super().stream(prompt_ids, sp, should_stop)
        finally:
            if self.last is not None:
                self.last.speculative = self.last_stats.summary()

    def _on_finish(self) -> None:
        self.total_stats.add(self.last_stats)
        req, self._request = self._request, None
        end = getattr(self.draft, "end_request", None)  # (a draft that learns from finished outputs)
        if req is not None and end is not None:
            end(*req)

    def _tokens(self, prompt_ids: list[int], sp: SamplingParams, gen):
        """Yield generated token ids one at a time: the first from the prefill, then the tokens each
        verify step emits. Stops only when closed; never writes past the context."""
        if self.plain_fallback and self._spec_unsupported(sp):
            yield from Engine._tokens(self, prompt_ids, sp, gen)
            return
        stats = self.last_stats
        greedy = sp.temperature == 0
        logits, hidden = self.prefill(list(prompt_ids), return_hidden=True)
        pos = len(prompt_ids)
        tok = sample(logits, sp, gen)
        if sp.logprobs is not None:
            self.step_logprobs.append(token_logprob(logits, tok, sp.logprobs))
        ctx = list(prompt_ids) + [tok]
        self._request = (ctx, len(prompt_ids))
        yield tok
        dev = self.backend.device
        # with a draft that rolls out from device inputs (``begin``; sampling: ``begin_sampled``, where the draft's
        # ``samples_pipelined`` says so): the next step's rollout is enqueued before this step's verify is read back,
        # from the accepted count and token computed on the device, so the GPU drafts while the host accepts, emits
        # and launches (that host time otherwise leaves the GPU idle)
        pipelined = bool(getattr(self.draft, "pipelined", False)) and (
            greedy or bool(getattr(self.draft, "samples_pipelined", lambda sp: False)(sp)))
        pending = None  # (k, handle): the rollout begun for this step
        # a draft with state across steps (attention over its own features): a fresh cache of true pairs now, and
        # after each verify the pairs it accepted (``observe``, their count on the device) before the next rollout
        stateful = bool(getattr(self.draft, "stateful", False))
        if stateful:
            self.draft.reset_state(self.max_seq_len + self.k + 2)
        # sampling on CUDA: p, q and the acceptance replay as one captured graph (AcceptGraphs)
        graphed = not greedy and AcceptGraphs.applies(torch.device(dev))
        sampling = (float(sp.temperature), int(sp.top_k), float(sp.top_p))
        if graphed and pipelined:
            def q_from_rollout(x, draft=self.draft, t=sampling[0]):
                return draft.q_from_logits(x, t)
        q_state = {"fn": _same, "key": "q"}

        def launch(pending, hidden):
            """Enqueue the verify of the step at ``pos`` after ``tok``: its drafts (from the rollout begun for it, or
            proposed now) and the target's forward. Returns (k, step, logits, hidden states, q, the drafter's name)."""
            remaining = sp.max_new_tokens - (len(ctx) - len(prompt_ids))
            k = max(0, min(self.k, remaining - 1, self.max_seq_len - 1 - pos))
            q = None
            if k:
                if pending is not None:  # (its k bounds this one: finish refuses more)
                    if greedy:
                        drafts = self.draft.finish(pending[1], ctx, k)
                    elif graphed:  # the rollout's logits: q is computed inside the captured acceptance
                        drafts, q = self.draft.finish_sampled(pending[1], k, sp, raw=True)
                        q_state.update(fn=q_from_rollout, key="rollout-logits")
                    else:
                        drafts, q = self.draft.finish_sampled(pending[1], k, sp)
                else:
                    drafts, q = self.draft.propose(ctx, hidden, k, None if greedy else sp, gen)
                    q_state.update(fn=_same, key="q")
                if drafts.shape[0] > k:
                    raise ValueError(f"speculative decoding: the draft proposed {drafts.shape[0]} tokens, "
                                     f"at most {k} were asked for")
                k = int(drafts.shape[0])  # a draft may propose fewer (an n-gram draft with no match: none)
            src = (getattr(self.draft, "source", None) or getattr(self.draft, "name", "head")) if k else "none"
            if not k:
                drafts, q = torch.empty(0, dtype=torch.long, device=dev), None
            # the verify's tokens [tok, d1..dk] without a host synchronisation: a fill and a device copy on the stream
            # (a host tensor copied in would wait for the draft's rollout to finish before the verify is enqueued)
            step = torch.empty(k + 1, dtype=torch.long, device=dev)
            step[:1].fill_(tok)
            if k:
                step[1:].copy_(drafts, non_blocking=True)  # (from host memory: staged at once, no device sync)
            logits, hid = self.backend.forward(step, pos, return_hidden=True)
            return k, step, logits, hid, q, src

        launched = None  # the pipelined loop's verify, enqueued before the step before it emitted its tokens
        # a draft with nothing to propose for a while (``plain_run``: --draft auto with its drafters idle) hands those
        # tokens to the backend's device loop (greedy_run: one host sync per burst, as plain decoding runs)
        bursts = greedy and sp.logprobs is None and hasattr(self.backend, "greedy_run") and \
            hasattr(self.draft, "plain_run")
        while True:
            n_run = 0
            if launched is None and bursts:
                n_run = min(self.draft.plain_run(ctx), sp.max_new_tokens - (len(ctx) - len(prompt_ids)),
                            self.max_seq_len - pos)
            if n_run > 0:
                new = self.backend.greedy_run(tok, pos, n_run)
                if not sp.ignore_eos:
                    at = next((j for j, t in enumerate(new) if t in self.eos), None)
                    new = new if at is None else new[: at + 1]
                pos += n_run
                tok = new[-1]
                ctx.extend(new)
                stats.steps += len(new)
                stats.drafters["none"] = stats.drafters.get("none", 0) + len(new)
                hidden = pending = None  # (the next step drafts without the head: no hidden state from a burst)
                for t in new:
                    yield t
                continue
            if launched is None:
                launched = launch(pending, hidden)
            k, step, logits, hid, q, src = launched
            launched = None
            remaining = sp.max_new_tokens - (len(ctx) - len(prompt_ids))
            # the next step drafts at most this many: at least one token is emitted now
            k_next = max(0, min(self.k, remaining - 2, self.max_seq_len - 2 - pos)) if pipelined else 0
            if greedy:
                am = torch.argmax(logits, -1)
                vals_dev = torch.cat((am, step[1:]))
                if pipelined:
                    n_dev = (am[:k] == step[1:]).long().cumprod(0).sum(0, keepdim=True)  # (k = 0: n = 0)
                    vals, pending = self._read_back_beginning(
                        vals_dev, hid, n_dev, am.index_select(0, n_dev), k_next,
                        self.draft.begin, (lambda: self.draft.observe(hid[:k], step[1:], n_dev)) if stateful else None)
                else:
                    vals = vals_dev.tolist()  # the step's one device sync
                proposed = vals[k + 1:]
                n, nxt = verify_greedy(vals[: k + 1], proposed)
            else:
                if graphed:
                    u = torch.rand(k + 1, generator=gen, device=dev)  # (verify_sampling's draws)
                    vals_dev = self._accept(logits, None if q is None else q.to(dev), q_state["fn"],
                                            q_state["key"], step[1:], u, sampling)
                    nn = vals_dev[:2]
                else:
                    p = probs_from_logits(logits, sp.temperature, sp.top_k, sp.top_p)
                    nn = verify_sampling(p, q.to(p.device) if q is not None else q, step[1:], gen)
                    vals_dev = torch.cat((nn, step[1:]))
                if pipelined:
                    vals, pending = self._read_back_beginning(
                        vals_dev, hid, nn[:1], nn[1:], k_next,
                        lambda h, t, kn: self.draft.begin_sampled(h, t, kn, sp, gen),
                        (lambda: self.draft.observe(hid[:k], step[1:], nn[:1])) if stateful else None)
                else:
                    vals = vals_dev.tolist()  # the step's one device sync
                n, nxt = vals[0], vals[1]
                proposed = vals[2:]
            if stateful and not pipelined:  # (pipelined: observed on the device before the next rollout was begun)
                self.draft.observe(hid[:k], step[1:], torch.full((1,), n, dtype=torch.long, device=dev))
            new = proposed[:n] + [nxt]
            at = None
            if not sp.ignore_eos:  # tokens after an eos are never emitted: not counted as accepted
                at = next((j for j, t in enumerate(new) if t in self.eos), None)
                if at is not None:
                    new = new[: at + 1]
            pos += n + 1
            tok = nxt
            ctx.extend(new)
            # pipelined: the next verify is enqueued now, before this step's tokens go out (the caller's work per token
            # and this loop's bookkeeping then overlap the GPU's verify), unless this step ends the generation
            if pipelined and at is None and len(ctx) - len(prompt_ids) < sp.max_new_tokens:
                launched = launch(pending, None)
            stats.steps += 1
            stats.drafted += k
            stats.accepted += len(new) - 1
            stats.drafters[src] = stats.drafters.get(src, 0) + 1
            # token new[j] was chosen from verify row j (the target after step[j]); its entry is added as it is
            # yielded, so a consumer reading step_logprobs meanwhile (a server's stream) sees only tokens emitted
            lps = [token_logprob(logits[j], t, sp.logprobs) for j, t in enumerate(new)] if sp.logprobs is not None \
                else None
            hidden = None if pipelined else hid[n]
            for j, t in enumerate(new):
                if lps is not None:
                    self.step_logprobs.append(lps[j])
                yield t

    def _read_back_beginning(self, vals_dev: torch.Tensor, hid: torch.Tensor, n_dev: torch.Tensor,
                             tok_dev: torch.Tensor, k_next: int, begin, observe=None):
        """Read the verify's values back (the step's one host wait), having enqueued first their copy and then the
        next step's rollout of ``k_next`` tokens from the device's own acceptance: ``n_dev`` [1] accepted drafts and
        ``tok_dev`` [1] the token after them (both on the device, what the host computes from the values read
        back), the rollout from hidden state hid[n] by ``begin(hidden, token, k_next)``. Returns (values,
        (k_next, handle) or None)."""
        cuda = vals_dev.is_cuda
        if cuda:
            m = vals_dev.shape[0]
            if self._host_vals is None or self._host_vals.shape[0] < m:
                self._host_vals = torch.empty(max(2 * self.k + 2, m), dtype=torch.long, pin_memory=True)
                self._read_done = torch.cuda.Event()
            buf = self._host_vals[:m]
            buf.copy_(vals_dev, non_blocking=True)
            self._read_done.record()
        pending = None
        if observe is not None:  # (a stateful draft: this step's accepted pairs, before the next rollout)
            observe()
        if k_next:
            pending = (k_next, begin(hid.index_select(0, n_dev)[0], tok_dev, k_next))
        if not cuda:
            return vals_dev.tolist(), pending
        self._read_done.synchronize()  # the verify and the copy: the rollout just enqueued runs on
        return buf.tolist(), pending


__all__ = ["AcceptGraphs", "SpeculativeEngine", "SpeculativeStats", "accept_with", "verify_greedy",
           "verify_sampling"]
