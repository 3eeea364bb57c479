"""The answer of `flint serve` to a chat or completion request: the job submitted to the queue (429
when full) and cancelled when the client leaves, then the OpenAI response shaped from its events,
one JSON object or an SSE stream: text or tool-call deltas (flint.tools parses the model's calls),
logprobs as OpenAI shapes them for chat and for completions, usage, and llama.cpp's ``timings``.

Used by flint/server_app.py; tests: ``pytest tests/test_server.py tests/test_tools.py``.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import aclosing
from typing import TYPE_CHECKING

from .server_errors import APIError
from .server_openai import ToolPlan, _sampling
from .server_queue import Job, QueueFull

if TYPE_CHECKING:
    from starlette.requests import Request

    from .server_state import ServerState


def submit(state: ServerState, request_id: str, prompt_ids: list[int], sp) -> Job:
    job = Job(request_id, prompt_ids, sp, asyncio.get_running_loop())
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
    """The job's events; cancels the job when the client leaves or this consumer stops."""
    watcher = asyncio.create_task(watch_disconnect(state, request, job))
    try:
        while True:
            kind, value = await job.events.get()
            yield kind, value
            if kind != "text":
                return
    finally:
        watcher.cancel()
        state.scheduler.cancel(job)


def timings(job: Job, r) -> dict:
    """llama.cpp's per-request timings (an extension field): the prompt's part is the prefill up to the
    first token, the predicted part the decode steps after it; queue_ms is the wait before the prefill."""
    def part(n: int, s: float) -> dict:
        return {"n": n, "ms": s * 1e3, "per_token_ms": s * 1e3 / n if n else 0.0,
                "per_second": n / s if n and s > 0 else 0.0}

    out = {"queue_ms": job.wait_s * 1e3}
    for name, (n, sec) in (("prompt", (r.prompt_tokens, r.ttft_s)),
                           ("predicted", (max(0, len(r.token_ids) - 1), r.decode_s))):
        out.update({f"{name}_{k}": v for k, v in part(n, sec).items()})
    if getattr(r, "speculative", None):  # tokens per verify step, the drafters' shares of the steps
        out["speculative"] = r.speculative
    return out


def usage(r) -> dict:
    n_prompt, n_out = r.prompt_tokens, len(r.token_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


def engine_failure(e: Exception) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, ValueError):
        return APIError(400, str(e), code="invalid_value")
    return APIError(500, f"generation failed ({type(e).__name__})", "server_error")


async def respond(state: ServerState, request: Request, req, prompt_ids: list[int], chat: bool,
                  plan: ToolPlan | None = None):
    """The answer to a chat or completion request: one JSON object, or SSE chunks with ``stream``."""
    from fastapi.responses import StreamingResponse

    from .tools import ToolStream

    sp = _sampling(req, state, len(prompt_ids), "messages" if chat else "prompt", plan)
    parsing = plan is not None and plan.parse
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    job = submit(state, rid, prompt_ids, sp)
    head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": state.model_id}

    text_offset = 0  # completions' logprobs.text_offset: where each token's text starts in the completion

    def logprobs(entries: list | None) -> dict | None:
        nonlocal text_offset
        if entries is None:
            return None
        if chat:
            def one(tid: int, lp: float) -> dict:
                text, raw = state.token_text(tid)
                return {"token": text, "logprob": lp, "bytes": raw}

            return {"content": [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top]}
                                for e in entries], "refusal": None}
        tokens, offsets = [], []
        for e in entries:
            text = state.token_text(e.token_id)[0]
            tokens.append(text)
            offsets.append(text_offset)
            text_offset += len(text)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{state.token_text(t)[0]: v for t, v in e.top} for e in entries],
                "text_offset": offsets}

    def choice(text: str | None, finish: str | None, entries: list | None = None) -> dict:
        if chat:
            delta = {} if text is None else {"content": text}
            return {"index": 0, "delta": delta, "logprobs": logprobs(entries), "finish_reason": finish}
        return {"index": 0, "text": text or "", "logprobs": logprobs(entries), "finish_reason": finish}

    if req.stream:
        with_usage = bool(req.stream_options and req.stream_options.include_usage)

        def sse(obj) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        def chunk(choices: list, **extra) -> str:
            return sse({**head, "choices": choices, **({"usage": None} if with_usage else {}), **extra})

        calls = ToolStream(plan.fmt) if parsing else None
        n_calls = 0

        def deltas(parsed: list, entries) -> list[str]:
            """SSE chunks of the tool parser's events (the first carries the tokens' logprobs)."""
            nonlocal n_calls
            out = []
            for kind, v in parsed:
                if kind == "content":
                    out.append(chunk([{"index": 0, "delta": {"content": v}, "logprobs": logprobs(entries),
                                       "finish_reason": None}]))
                else:
                    delta = {"tool_calls": [{"index": n_calls, **v}]}
                    n_calls += 1
                    out.append(chunk([{"index": 0, "delta": delta, "logprobs": logprobs(entries),
                                       "finish_reason": None}]))
                entries = None
            if entries:  # text held back (it may begin a call): the tokens' logprobs go out now
                out.append(chunk([{"index": 0, "delta": {}, "logprobs": logprobs(entries), "finish_reason": None}]))
            return out

        async def body():
            if chat:
                yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])
            async with aclosing(events(state, request, job)) as evs:
                async for kind, value in evs:
                    if kind == "text" and calls is not None:
                        for c in deltas(calls.feed(value[0]), value[1]):
                            yield c
                    elif kind == "text":
                        yield chunk([choice(value[0], None, value[1])])
                    elif kind == "done":
                        finish = value.finish_reason
                        if calls is not None:
                            for c in deltas(calls.finish(), None):
                                yield c
                            if n_calls and finish == "stop":
                                finish = "tool_calls"
                        yield chunk([choice(None if chat else "", finish)],
                                    timings=timings(job, value))
                        if with_usage:
                            yield sse({**head, "choices": [], "usage": usage(value)})
                    else:  # the status line is gone already: report in the stream, then end it
                        yield sse(engine_failure(value).body())
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    text, entries = [], None if sp.logprobs is None else []
    async with aclosing(events(state, request, job)) as evs:
        async for kind, value in evs:
            if kind == "text":
                text.append(value[0])
                if value[1]:
                    entries += value[1]
            elif kind == "error":
                raise engine_failure(value)
            else:
                r = value
    out = "".join(text)
    if chat:
        message, finish = {"role": "assistant", "content": out}, r.finish_reason
        if parsing:
            from .tools import parse

            content, tool_calls = parse(out, plan.fmt)
            if tool_calls:
                message = {"role": "assistant", "content": content, "tool_calls": tool_calls}
                finish = "tool_calls" if finish == "stop" else finish
        first = {"index": 0, "message": message, "logprobs": logprobs(entries), "finish_reason": finish}
        obj = "chat.completion"
    else:
        first = {"index": 0, "text": out, "logprobs": logprobs(entries), "finish_reason": r.finish_reason}
        obj = "text_completion"
    return {**head, "object": obj, "choices": [first], "usage": usage(r), "timings": timings(job, r)}
