"""The queue of `flint serve`: one Job per generation request, a bounded FIFO of them, and the one
worker thread that owns the engine and runs the jobs in order, streaming each token (and its
logprobs) back to the request's event loop; cancellation and shutdown are checked at every token.

Used by flint/server_state.py and flint/server_respond.py; tests: ``pytest tests/test_server_guard.py``.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

from .server_errors import APIError, _shutdown_error

if TYPE_CHECKING:
    from .server_metrics import Metrics

log = logging.getLogger("flint.serve")


class QueueFull(Exception):
    pass


class Job:
    """One request's generation: filled by the worker thread, read by the request's coroutine."""

    def __init__(self, request_id: str, prompt_ids: list[int], sp, loop):
        self.id = request_id
        self.prompt_ids = prompt_ids
        self.sp = sp
        self.loop = loop
        # ("text", (piece, [TokenLogprob] or None)) / ("done", result) / ("error", exc)
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
                raise _shutdown_error()
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
        job.push("error", APIError(499, "the client closed the request", code="client_closed"))

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
                        job.push("error", _shutdown_error())
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
        def should_stop() -> bool:  # asked between prefill chunks
            return job.cancelled.is_set() or self.stopping()

        stream = self.engine.stream(job.prompt_ids, job.sp, should_stop=should_stop)
        stopped = None  # why decoding ended early: the client left, or the server is stopping
        want_lp = job.sp.logprobs is not None
        taken = 0  # engine.step_logprobs entries already sent

        def new_logprobs() -> list | None:
            # the tokens decoded since the last event; an eos that ends the text is no part of it
            nonlocal taken
            if not want_lp:
                return None
            fresh = self.engine.step_logprobs[taken:]
            taken += len(fresh)
            eos = () if job.sp.ignore_eos else self.engine.eos
            return [e for e in fresh if e.token_id not in eos]

        try:
            for _tok, piece in stream:
                if job.cancelled.is_set() or self.stopping():
                    stopped = "cancelled" if job.cancelled.is_set() else "shutdown"
                    break
                lps = new_logprobs()
                if piece or lps:
                    job.push("text", (piece, lps))
            if stopped is None and want_lp:  # a token that completed a stop string yields no text
                lps = new_logprobs()
                if lps:
                    job.push("text", ("", lps))
        except Exception as e:  # the worker must outlive any one request
            log.exception("%s failed in the engine", job.id)
            if self.metrics is not None:
                self.metrics.generation(self.engine, None, wait_s, "error")
            job.push("error", e)
            return
        finally:
            stream.close()
        r = self.engine.last
        if r.finish_reason == "cancelled":  # during the prefill
            stopped = "shutdown" if self.stopping() and not job.cancelled.is_set() else "cancelled"
        log.info("%s prompt=%d completion=%d queued=%.2fs ttft=%.3fs decode=%.1f tok/s finish=%s",
                 job.id, len(job.prompt_ids), len(r.token_ids), wait_s, r.ttft_s, r.decode_tok_s,
                 stopped or r.finish_reason)
        if self.metrics is not None:
            self.metrics.generation(self.engine, r, wait_s, stopped or r.finish_reason)
        if stopped == "shutdown":
            job.push("error", _shutdown_error())
        else:
            job.push("done", r)
