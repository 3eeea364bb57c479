"""The queue of `flint serve`: one Job per generation request, a bounded FIFO of them, and the one
worker thread that owns the engine and runs the jobs in order, streaming each token (and its
logprobs) back to the request's event loop; cancellation and shutdown are checked at every token.

Used by flint/server/state.py and flint/server/respond.py; tests: ``pytest tests/test_server_guard.py``.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..errors import FlintError
from .errors import client_closed, shutdown_error

if TYPE_CHECKING:
    from .metrics import Metrics

log = logging.getLogger("flint.serve")


CHAR_TOKENS = 4  # a character's UTF-8 bytes: tokens a pass may add to end between characters
MASK64 = (1 << 64) - 1
SEED_STEP = 0x9E3779B97F4A7C15  # the seed of min_tokens' second pass: the first's times this (odd: a bijection)


class QueueFull(FlintError):
    pass


@dataclass(frozen=True)
class Options:
    """What a request asks beyond SamplingParams, applied around the engine's loop."""
    n: int = 1  # choices, generated one after the other (choice i samples with seed + i)
    min_tokens: int = 0  # no end-of-sequence token, stop token or stop string before this many tokens
    stop_ids: frozenset = frozenset()  # more tokens that end the output (their text left out)
    include_stop: bool = False  # the stop string that ended the text is kept at its end
    prompt_logprobs: int | None = None  # each prompt token's logprob and this many alternatives


class Job:
    """One request's generation: filled by the worker thread, read by the request's coroutine."""

    def __init__(self, request_id: str, prompt_ids: list[int], sp, loop, opts: Options = Options()):
        self.id = request_id
        self.prompt_ids = prompt_ids
        self.sp = sp
        self.opts = opts
        self.loop = loop
        self.cached_tokens = 0  # prompt tokens whose K/V the engine reused (set when the job starts)
        # ("prompt", [TokenLogprob or None]) first when opts.prompt_logprobs; then per choice ("text", (piece,
        # [TokenLogprob] or None))... ("done", result); or ("error", exc)
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.t_submit = time.perf_counter()
        self.wait_s = 0.0  # in the queue, set when the worker takes the job

    def push(self, kind: str, value) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            self.cancelled.set()


class Scheduler:
    """A bounded FIFO of jobs and the one thread that runs them on the engine, in order.

    ``should_stop()`` (the server is shutting down) is checked at every token: the running job and
    all waiting ones then end with a 503 error event, so open streams close and shutdown is quick.
    """

    def __init__(self, engine, max_queue: int, should_stop=lambda: False, metrics: Metrics | None = None):
        self.engine = engine
        self.metrics = metrics
        self.max_queue = max_queue
        self.should_stop = should_stop
        self.closed = False
        self.waiting: deque[Job] = deque()
        self.running: Job | None = None
        self.cv = threading.Condition()
        self.served = 0
        if metrics is not None:
            metrics.waiting.set_function(lambda: len(self.waiting))
            metrics.running.set_function(lambda: int(self.running is not None))
        self.thread = threading.Thread(target=self._loop, name="flint-engine", daemon=True)
        self.thread.start()

    def stopping(self) -> bool:
        return self.closed or self.should_stop()

    def submit(self, job: Job) -> None:
        with self.cv:
            if self.stopping():
                raise shutdown_error()
            if len(self.waiting) >= self.max_queue:
                raise QueueFull
            self.waiting.append(job)
            self.cv.notify()

    def cancel(self, job: Job) -> None:
        job.cancelled.set()
        with self.cv:
            try:
                self.waiting.remove(job)
            except ValueError:
                return  # running (stops at its next token) or done
        log.info("%s cancelled while queued (%.2fs)", job.id, time.perf_counter() - job.t_submit)
        job.push("error", client_closed())

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the worker (after its current token) and wait for it."""
        with self.cv:
            self.closed = True
            self.cv.notify_all()
        self.thread.join(timeout_s)

    def _loop(self) -> None:
        while True:
            with self.cv:
                while not self.waiting and not self.stopping():
                    self.cv.wait()
                if self.stopping():
                    for job in self.waiting:
                        job.push("error", shutdown_error())
                    self.waiting.clear()
                    return
                job = self.waiting.popleft()
                self.running = job
            try:
                self._run(job)
            finally:
                with self.cv:
                    self.running = None
                    self.served += 1

    def _run(self, job: Job) -> None:
        wait_s = job.wait_s = time.perf_counter() - job.t_submit
        if job.cancelled.is_set():  # the client left between the queue and here
            return
        c = next((i for i, (a, b) in enumerate(zip(self.engine.cached, job.prompt_ids)) if a != b),
                 min(len(self.engine.cached), len(job.prompt_ids)))
        job.cached_tokens = min(c, len(job.prompt_ids) - 1)  # the engine's prefill reuses these
        try:
            if job.opts.prompt_logprobs is not None:  # every position's logits: the prompt is run whole
                job.cached_tokens = 0
                job.push("prompt", self._prompt_logprobs(job, job.opts.prompt_logprobs))
            for i in range(job.opts.n):  # n choices, one after the other, the prompt's K/V reused
                sp = job.sp if i == 0 or job.sp.seed is None else replace(job.sp, seed=(job.sp.seed + i) & MASK64)
                r, stopped = self._choice(job, sp)
                self._report(job, r, stopped, wait_s)
                if stopped == "cancelled":  # ends the consumer's wait, whatever choice it waits for
                    job.push("error", client_closed())
                    return
                if stopped == "shutdown":
                    job.push("error", shutdown_error())
                    return
                job.push("done", r)
        except Exception as e:  # the worker must outlive any one request
            log.exception("%s failed in the engine", job.id)
            if self.metrics is not None:
                self.metrics.generation(self.engine, None, wait_s, "error")
            job.push("error", e)

    def _report(self, job: Job, r, stopped: str | None, wait_s: float) -> None:
        log.info("%s prompt=%d completion=%d queued=%.2fs ttft=%.3fs decode=%.1f tok/s finish=%s",
                 job.id, len(job.prompt_ids), len(r.token_ids), wait_s, r.ttft_s, r.decode_tok_s,
                 stopped or r.finish_reason)
        if self.metrics is not None:
            self.metrics.generation(self.engine, r, wait_s, stopped or r.finish_reason)

    def _prompt_logprobs(self, job: Job, k: int) -> list:
        """Each prompt token's TokenLogprob under the tokens before it (None for the first), from a prefill of
        every position's logits in chunks; the engine's cache then holds the prompt, so the generation after
        it prefills one token."""
        import torch

        from ..engine import token_logprob

        b, ids, out = self.engine.backend, job.prompt_ids, [None]
        chunk = min(getattr(b, "max_chunk", None) or self.engine.PREFILL_CHUNK, self.engine.PREFILL_CHUNK)
        self.engine.cached = []
        for s in range(0, len(ids), chunk):
            if self.stopping() or job.cancelled.is_set():  # the generation after it stops too
                break
            logits = b.forward(torch.tensor(ids[s: s + chunk], dtype=torch.long), s)
            self.engine.cached = ids[: s + chunk]
            for j in range(logits.shape[0]):
                if s + j + 1 < len(ids):
                    out.append(token_logprob(logits[j], ids[s + j + 1], k))
        return out

    def _choice(self, job: Job, sp) -> tuple:
        """One generation: (the result, why it stopped early or None). min_tokens runs in two passes: the first
        min_tokens tokens with every ending token banned and no stop strings, then the rest after them."""
        from ..engine import GenerationResult

        o = job.opts
        first = None
        if o.min_tokens:
            ban = {t: -100.0 for t in (*self.engine.eos, *o.stop_ids)}
            head = replace(sp, max_new_tokens=min(o.min_tokens, sp.max_new_tokens), stop=[], ignore_eos=True,
                           logit_bias={**sp.logit_bias, **ban})
            first, stopped = self._pass(job, job.prompt_ids, head, frozenset(), whole_chars=sp.max_new_tokens)
            left = sp.max_new_tokens - len(first.token_ids)
            if stopped or left <= 0:
                return first, stopped
            sp = replace(sp, max_new_tokens=left, seed=None if sp.seed is None else (sp.seed * SEED_STEP + 1) & MASK64)
        r, stopped = self._pass(job, job.prompt_ids + (first.token_ids if first else []), sp, o.stop_ids)
        if r.finish_reason == "stop" and o.include_stop and not stopped:
            self._stop_string(job, sp, r)
        if first is not None:
            r = GenerationResult(first.token_ids + r.token_ids, first.text + r.text, r.finish_reason,
                                 len(job.prompt_ids), first.ttft_s, first.decode_s + r.ttft_s + r.decode_s,
                                 None if sp.logprobs is None else first.logprobs + r.logprobs)
        return r, stopped

    def _stop_string(self, job: Job, sp, r) -> None:
        """include_stop_str_in_output: the stop string that ended the text follows it."""
        if not r.token_ids or r.token_ids[-1] in self.engine.eos or r.token_ids[-1] in job.opts.stop_ids:
            return
        tail = self.engine.tokenizer.decode(r.token_ids, sp.skip_special)[len(r.text):]
        hit = max((s for s in sp.stop if tail.startswith(s)), key=len, default=None)
        if hit:
            job.push("text", (hit, [] if sp.logprobs is not None else None))
            r.text += hit

    def _pass(self, job: Job, prompt_ids: list[int], sp, stop_ids: frozenset, whole_chars: int = 0):
        """One engine.stream pass, its text and logprobs pushed as they come: (the result, why it stopped
        early or None). A token of ``stop_ids`` ends it with finish_reason stop (its text left out); with
        ``whole_chars`` (the most tokens it may take) the pass ends only between characters (a later pass
        decodes its own text)."""
        def should_stop() -> bool:  # asked between prefill chunks
            return job.cancelled.is_set() or self.stopping()

        limit = sp.max_new_tokens
        if whole_chars:  # room to finish a character split over tokens
            sp = replace(sp, max_new_tokens=min(limit + CHAR_TOKENS, whole_chars))
        stream = self.engine.stream(prompt_ids, sp, should_stop=should_stop)
        stopped = None  # why decoding ended early: the client left, or the server is stopping
        want_lp = sp.logprobs is not None
        taken = 0  # engine.step_logprobs entries already sent
        sent, ids = [], []  # the text pieces pushed, the tokens seen
        by_id = False

        def new_logprobs() -> list | None:
            # the tokens decoded since the last event; an eos that ends the text is no part of it
            nonlocal taken
            if not want_lp:
                return None
            fresh = self.engine.step_logprobs[taken:]
            taken += len(fresh)
            eos = () if sp.ignore_eos else self.engine.eos
            return [e for e in fresh if e.token_id not in eos]

        try:
            for n, (tok, piece) in enumerate(stream, 1):
                if job.cancelled.is_set() or self.stopping():
                    stopped = "cancelled" if job.cancelled.is_set() else "shutdown"
                    break
                if tok in stop_ids:
                    by_id = True
                    break
                lps = new_logprobs()
                if piece or lps:
                    job.push("text", (piece, lps))
                    sent.append(piece)
                ids.append(tok)
                if whole_chars and n >= limit and not self.engine.tokenizer.decode(
                        ids, sp.skip_special).endswith("\ufffd"):
                    break
            if stopped is None and want_lp and not by_id:  # a token that completed a stop string yields no text
                lps = new_logprobs()
                if lps:
                    job.push("text", ("", lps))
        finally:
            stream.close()
        r = self.engine.last
        if r.finish_reason == "cancelled":  # during the prefill
            stopped = "shutdown" if self.stopping() and not job.cancelled.is_set() else "cancelled"
        if by_id:  # the text the engine held back (a stop string's beginning), then the stop token's end
            text = self.engine.tokenizer.decode(r.token_ids[:-1], sp.skip_special)
            done = "".join(sent)
            if len(text) > len(done):
                job.push("text", (text[len(done):], [] if want_lp else None))
            r = replace(r, text=text, finish_reason="stop",
                        logprobs=None if r.logprobs is None else r.logprobs[:len(r.token_ids)])
        return r, stopped
