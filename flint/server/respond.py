"""The answer of `flint serve` to a chat or completion request: the job submitted to the queue (429
when full) and cancelled when the client leaves, then the OpenAI response shaped from its events,
one JSON object or an SSE stream: text, reasoning or tool-call deltas (flint.server.reasoning splits a
thinking model's reasoning off, flint.server.tools parses the model's calls),
logprobs as OpenAI shapes them for chat and for completions, usage, and llama.cpp's ``timings``.

Used by flint/server/app.py; tests: ``pytest tests/test_server.py tests/test_tools.py
tests/test_tool_formats.py``.
"""
from __future__ import annotations

import asyncio
import codecs
import json
import time
import uuid
from contextlib import aclosing
from typing import TYPE_CHECKING

from .errors import APIError
from .schemas import ToolPlan, first_line
from .queue import Job, Options, QueueFull

if TYPE_CHECKING:
    from starlette.requests import Request

    from .state import ServerState


def submit(state: ServerState, request_id: str, prompt_ids: list[int], sp, opts: Options) -> Job:
    job = Job(request_id, prompt_ids, sp, asyncio.get_running_loop(), opts)
    try:
        state.scheduler.submit(job)
    except QueueFull:
        raise APIError(429, f"the queue is full ({state.max_queue} waiting, the --max-queue limit); "
                            "retry later", "rate_limit_error", code="queue_full",
                       headers={"Retry-After": "1"}) from None
    return job


async def watch_disconnect(state: ServerState, request: Request, job: Job) -> None:
    """Cancel the job when the client goes away (the body is read; what remains is disconnect)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            state.scheduler.cancel(job)
            return


async def events(state: ServerState, request: Request, job: Job):
    """The job's events up to its last choice's "done" (or an error); cancels the job when the client
    leaves or this consumer stops."""
    watcher = asyncio.create_task(watch_disconnect(state, request, job))
    done = 0
    try:
        while True:
            kind, value = await job.events.get()
            yield kind, value
            done += kind == "done"
            if kind == "error" or done == job.opts.n:
                return
    finally:
        watcher.cancel()
        state.scheduler.cancel(job)


def timings(job: Job, r) -> dict:
    """llama.cpp's per-request timings (an extension field): the prompt's part is the prefill up to the
    first token (prompt_n the tokens it processed, cache_n those whose K/V were reused), the predicted
    part the decode steps after it; queue_ms is the wait before the prefill."""
    def part(n: int, s: float) -> dict:
        return {"n": n, "ms": s * 1e3, "per_token_ms": s * 1e3 / n if n else 0.0,
                "per_second": n / s if n and s > 0 else 0.0}

    out = {"queue_ms": job.wait_s * 1e3, "cache_n": job.cached_tokens}
    for name, (n, sec) in (("prompt", (r.prompt_tokens - job.cached_tokens, r.ttft_s)),
                           ("predicted", (max(0, len(r.token_ids) - 1), r.decode_s))):
        out.update({f"{name}_{k}": v for k, v in part(n, sec).items()})
    if getattr(r, "speculative", None):  # tokens per verify step, the drafters' shares of the steps
        out["speculative"] = r.speculative
    return out


def usage(job: Job, results: list) -> dict:
    n_prompt, n_out = len(job.prompt_ids), sum(len(r.token_ids) for r in results)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
            "prompt_tokens_details": {"cached_tokens": job.cached_tokens}}


def engine_failure(e: Exception, sp=None) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, ValueError):
        return APIError(400, str(e), code="invalid_value")
    if isinstance(e, RuntimeError) and str(e).startswith("grammar:") and sp is not None and sp.constraint:
        # the grammar engine gave up mid-output (a parser limit the admission probe did not reach): the
        # request's grammar is what cannot be run, named as such
        param = sp.constraint.param
        return APIError(400, f"{param}: the engine could not continue this {sp.constraint.kind} ({first_line(e)})",
                        param=param, code="grammar_failed")
    return APIError(500, f"generation failed ({type(e).__name__})", "server_error")


class LegacyLogprobs:
    """Completions' logprobs (the legacy shape) of one choice, piece by piece: a token's string is its text,
    or ``bytes:\\xNN...`` when it holds part of a character (as OpenAI keys such tokens), "" for a special
    token the text leaves out; ``text_offset`` counts the characters completed before each token."""

    def __init__(self, state: ServerState, skip_special: bool):
        self.state, self.skip = state, skip_special
        self.chars = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.offset = 0

    def key(self, tid: int) -> str:
        text, raw = self.state.token_text(tid)
        try:
            bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return text

    def __call__(self, entries: list, prompt: bool = False) -> dict:
        tokens, offsets, lps, tops = [], [], [], []
        for e in entries:
            if e is None:  # the prompt's first token: nothing before it to predict it
                tid, lp, top = self.first, None, None
            else:
                tid, lp, top = e.token_id, e.logprob, {self.key(t): v for t, v in e.top}
            skipped = not prompt and self.skip and tid in self.state.special_ids
            tokens.append("" if skipped else self.key(tid))
            offsets.append(self.offset)
            if not skipped:
                self.offset += len(self.chars.decode(bytes(self.state.token_text(tid)[1])))
            lps.append(lp)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def merge_legacy(a: dict | None, b: dict | None) -> dict | None:
    if a is None or b is None:
        return a or b
    return {k: a[k] + b[k] for k in a}


async def respond(state: ServerState, request: Request, req, prompt_ids: list[int], sp, chat: bool,
                  plan: ToolPlan | None = None, opts: Options = Options(), echo: str | None = None):
    """The answer to a chat or completion request (its SamplingParams ``sp``, the Options around them): one
    JSON object, or SSE chunks with ``stream``; ``echo``: the prompt's text, which a completion's text starts
    with (its logprobs too, when asked)."""
    from fastapi.responses import Response, StreamingResponse

    from .reasoning import Reply, split

    parsing = plan is not None and plan.parse
    think = plan.think if plan is not None else None
    shaped = parsing or think is not None  # the output is parsed (reasoning, calls), not sent as it is
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    job = submit(state, rid, prompt_ids, sp, opts)
    head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": state.model_id}
    legacy = [None]  # completions: the current choice's LegacyLogprobs

    def new_choice() -> None:
        legacy[0] = LegacyLogprobs(state, sp.skip_special)

    def logprobs(entries: list | None) -> dict | None:
        if entries is None:
            return None
        if not chat:
            return legacy[0](entries)

        def one(tid: int, lp: float, emitted: bool = False) -> dict:
            if emitted and sp.skip_special and tid in state.special_ids:  # not in the text
                return {"token": "", "logprob": lp, "bytes": []}
            text, raw = state.token_text(tid)
            return {"token": text, "logprob": lp, "bytes": raw}

        return {"content": [{**one(e.token_id, e.logprob, True), "top_logprobs": [one(t, v) for t, v in e.top]}
                            for e in entries], "refusal": None}

    def echoed(prompt_lps: list | None) -> tuple[str, dict | None]:
        """The echoed prompt's text and its logprobs (the legacy shape)."""
        if prompt_lps is None:
            return echo, None
        lp = legacy[0]
        lp.first = prompt_ids[0]
        out = lp(prompt_lps, prompt=True)
        lp.offset = len(echo)  # the completion's tokens count from the echoed text's end
        lp.chars = codecs.getincrementaldecoder("utf-8")(errors="replace")
        return echo, out

    def choice(i: int, text: str | None, finish: str | None, lps: dict | None = None) -> dict:
        if chat:
            delta = {} if text is None else {"content": text}
            return {"index": i, "delta": delta, "logprobs": lps, "finish_reason": finish}
        return {"index": i, "text": text or "", "logprobs": lps, "finish_reason": finish}

    if req.stream:
        with_usage = bool(req.stream_options and req.stream_options.include_usage)

        def sse(obj) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        def chunk(choices: list, **extra) -> str:
            return sse({**head, "choices": choices, **({"usage": None} if with_usage else {}), **extra})

        n_calls = [0]  # the current choice's calls sent

        def deltas(i: int, parsed: list, entries) -> list[str]:
            """SSE chunks of the tool parser's events (the first carries the tokens' logprobs)."""
            out = []
            for kind, v in parsed:
                if kind == "content":
                    delta = {"content": v}
                elif kind == "reasoning":
                    delta = {"reasoning_content": v}
                else:
                    delta = {"tool_calls": [{"index": n_calls[0], **v}]}
                    n_calls[0] += 1
                out.append(chunk([{"index": i, "delta": delta, "logprobs": logprobs(entries), "finish_reason": None}]))
                entries = None
            if entries:  # text held back (it may begin a call): the tokens' logprobs go out now
                out.append(chunk([{"index": i, "delta": {}, "logprobs": logprobs(entries), "finish_reason": None}]))
            return out

        async def body():
            i, calls, prompt_lps, results = 0, None, None, []

            def begin() -> list[str]:  # a choice's first chunk
                nonlocal calls
                new_choice()
                calls = Reply(think, plan.fmt if parsing else None) if shaped else None
                n_calls[0] = 0
                if chat:
                    return [chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}])]
                if echo is not None:
                    text, lps = echoed(prompt_lps)
                    return [chunk([choice(i, text, None, lps)])]
                return []

            started = False
            async with aclosing(events(state, request, job)) as evs:
                async for kind, value in evs:
                    if kind == "prompt":
                        prompt_lps = value
                        continue
                    if not started and kind != "error":
                        for c in begin():
                            yield c
                        started = True
                    if kind == "text" and calls is not None:
                        for c in deltas(i, calls.feed(value[0]), value[1]):
                            yield c
                    elif kind == "text":
                        yield chunk([choice(i, value[0], None, logprobs(value[1]))])
                    elif kind == "done":
                        finish = value.finish_reason
                        if calls is not None:
                            for c in deltas(i, calls.finish(), None):
                                yield c
                            if n_calls[0] and finish == "stop":
                                finish = "tool_calls"
                        yield chunk([choice(i, None if chat else "", finish)], timings=timings(job, value))
                        results.append(value)
                        i, started = i + 1, False
                    else:  # the status line is gone already: report in the stream, then end it
                        yield sse(engine_failure(value, sp).body())
            if with_usage and len(results) == opts.n:
                yield sse({**head, "choices": [], "usage": usage(job, results)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    prompt_lps, runs, text, entries = None, [], [], None if sp.logprobs is None else []
    async with aclosing(events(state, request, job)) as evs:
        async for kind, value in evs:
            if kind == "prompt":
                prompt_lps = value
            elif kind == "text":
                text.append(value[0])
                if value[1]:
                    entries += value[1]
            elif kind == "error":
                raise engine_failure(value, sp)
            else:
                runs.append((value, "".join(text), entries))
                text, entries = [], None if sp.logprobs is None else []

    def answer() -> bytes:  # logprobs make it large: built off the event loop
        choices = [one(i, *run) for i, run in enumerate(runs)]
        results = [r for r, _, _ in runs]
        return json.dumps({**head, "object": "chat.completion" if chat else "text_completion", "choices": choices,
                           "usage": usage(job, results), "timings": timings(job, results[0])},
                          ensure_ascii=False).encode()

    def one(i: int, r, out: str, entries) -> dict:
        new_choice()
        if chat:
            message, finish = {"role": "assistant", "content": out}, r.finish_reason
            if shaped:
                reasoning, content, tool_calls = split(out, think, plan.fmt if parsing else None)
                message = {"role": "assistant", "content": content}
                if think is not None:
                    message["reasoning_content"] = reasoning
                if tool_calls:
                    message["tool_calls"] = tool_calls
                    finish = "tool_calls" if finish == "stop" else finish
            return {"index": i, "message": message, "logprobs": logprobs(entries), "finish_reason": finish}
        lps = None
        if echo is not None:
            prefix, lps = echoed(prompt_lps)
            out = prefix + out
        return {"index": i, "text": out, "logprobs": merge_legacy(lps, logprobs(entries)),
                "finish_reason": r.finish_reason}

    return Response(await asyncio.to_thread(answer), media_type="application/json")
