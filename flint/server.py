"""`flint serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) on the batch-1 engine.

    flint serve [--model M] [--backend B] [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--max-queue N]

Routes: GET|HEAD /health (503 while the model loads, 200 after), GET /v1/models[/{id}], POST /v1/completions,
POST /v1/chat/completions (SSE streaming with ``stream``; ``stream_options.include_usage``; logprobs as
OpenAI shapes them; llama.cpp's ``timings`` in each answer), GET /metrics (Prometheus), POST /tokenize and
/detokenize (vLLM's and llama.cpp's field names). Structured output (``response_format``, vLLM's
``structured_outputs``, llama.cpp's ``grammar``) compiles to a flint.grammar constraint the engine applies
each step; ``tools`` / ``tool_choice`` go through flint.tools (rendered by the chat template, the output
parsed into ``tool_calls``, a forced call constrained to the function's schema).
The engine decodes one sequence at a time: requests wait in a FIFO (``--max-queue`` waiting
requests at most, 429 beyond) and one worker thread owns the engine; a client that goes away
cancels its generation at the next token (or the next prefill chunk). Every error is an OpenAI
error object; a request field flint cannot honour is a 400 naming it, never ignored.

Admission comes before work: the body size, the prompt's length against the context (a text of n
characters is at least n / longest-token tokens) and max_tokens are checked before tokenizing, and
tokenizing runs on its own thread. Without an API key only loopback Host names are served
(--allow-host adds others), which keeps web pages (DNS rebinding) out; POST bodies must be JSON;
request heads and bodies have deadlines and open connections a cap. SIGTERM drains: running and
queued requests finish (up to --drain-timeout), new ones get 503. One log line per request (id,
prompt/completion tokens, queue wait, TTFT, decode tok/s). Usage: docs/serve.md. Tests:
``pytest tests/test_server.py tests/test_server_guard.py tests/test_server_ops.py tests/test_structured.py
tests/test_tools.py``.

Heavy imports (fastapi, pydantic, uvicorn, torch) happen inside functions: `flint` imports this
module to build its parser, and other subcommands should not pay for them.
"""
import asyncio
import functools
import hmac
import ipaddress
import json
import logging
import os
import re
import socket
import sys
import threading
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing

log = logging.getLogger("flint.serve")

MAX_BODY_BYTES = 8 << 20  # a request body larger than this is refused (413) before parsing
MAX_STOP_STRINGS = 16
MAX_LOGIT_BIAS = 300  # entries, as OpenAI's limit
MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI's chat limit
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


# ------------------------------------------------------------------ errors

class APIError(Exception):
    """An error answered to the client as an OpenAI error object."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class QueueFull(Exception):
    pass


_TYPE_TAGS = {"str", "int", "float", "bool"}


def _validation_error(e) -> APIError:
    """The first problem in a pydantic ValidationError, as a 400 naming the field."""
    err = e.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        why = err.get("ctx", {}).get("error", err["msg"])
        return APIError(400, f"the request body is not valid JSON ({why})", code="invalid_json")
    # a union names the branch it tried ('stop.list[str].0'); the client wants the field path
    loc = [str(x) for x in err["loc"] if not (isinstance(x, str) and ("[" in x or x in _TYPE_TAGS))]
    param = ".".join(loc) or None
    if err["type"] == "extra_forbidden":
        return APIError(400, f"{param}: this field is not supported by flint (refused rather than ignored)",
                        param=param, code="unsupported_parameter")
    return APIError(400, f"{param or 'body'}: {err['msg']}", param=param, code="invalid_value")


# ------------------------------------------------------------------ request schemas

@functools.cache
def schemas():
    """The request models (built on first use so importing this module stays cheap)."""
    from typing import Literal

    from pydantic import BaseModel, ConfigDict, Field

    class _Base(BaseModel):
        model_config = ConfigDict(extra="forbid")  # a field flint does not know is refused (400), not ignored

    class TextPart(_Base):
        type: Literal["text"]
        text: str

    class CallFunction(_Base):
        name: str
        arguments: str  # JSON text, as OpenAI sends it

    class ToolCall(_Base):
        id: str
        type: Literal["function"]
        function: CallFunction

    class ChatMessage(_Base):
        role: str
        content: str | list[TextPart] | None = None
        tool_call_id: str | None = None  # goes to the chat template with the message
        tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls

    class FunctionDef(_Base):
        name: str
        description: str | None = None
        parameters: dict | None = None  # a JSON schema of the arguments
        strict: bool | None = None  # true: the output is constrained under tool_choice auto too (forced calls always are)

    class Tool(_Base):
        type: Literal["function"]
        function: FunctionDef

    class ChoiceFunction(_Base):
        name: str

    class NamedToolChoice(_Base):
        type: Literal["function"]
        function: ChoiceFunction

    class JsonSchemaSpec(_Base):
        model_config = ConfigDict(extra="forbid", populate_by_name=True)
        name: str
        description: str | None = None
        schema_: dict | None = Field(None, alias="schema")
        strict: bool | None = None

    class ResponseFormat(_Base):
        type: Literal["text", "json_object", "json_schema"]
        json_schema: JsonSchemaSpec | None = None

    class StructuredOutputs(_Base):  # vLLM's extension: one of these
        model_config = ConfigDict(extra="forbid", populate_by_name=True)
        json_: dict | None = Field(None, alias="json")
        regex: str | None = None
        choice: list[str] | None = None
        grammar: str | None = None  # Lark (llguidance's dialect)

    class StreamOptions(_Base):
        include_usage: bool = False

    class Common(_Base):
        model: str
        max_tokens: int | None = Field(None, ge=1)
        temperature: float | None = Field(None, ge=0, le=2)  # OpenAI's default is 1
        top_p: float | None = Field(None, gt=0, le=1)
        seed: int | None = Field(None, ge=-(2**63), lt=2**63)  # int64, as OpenAI's
        stop: str | list[str] | None = None
        n: int | None = None
        stream: bool | None = None
        stream_options: StreamOptions | None = None
        presence_penalty: float | None = Field(None, ge=-2, le=2)
        frequency_penalty: float | None = Field(None, ge=-2, le=2)
        logit_bias: dict[str, float] | None = None  # token id (a JSON key, so a string) -> bias
        user: str | None = None  # an end-user label: changes no output
        # extensions (vLLM spells them the same way)
        top_k: int | None = Field(None, ge=0)
        min_p: float | None = Field(None, ge=0, le=1)
        repetition_penalty: float | None = Field(None, gt=0, le=10)
        ignore_eos: bool = False
        structured_outputs: StructuredOutputs | None = None  # vLLM's spelling
        grammar: str | None = None  # llama.cpp's: a GBNF grammar

    class ChatRequest(Common):
        messages: list[ChatMessage] = Field(min_length=1)
        max_completion_tokens: int | None = Field(None, ge=1)
        logprobs: bool | None = None
        top_logprobs: int | None = None
        metadata: dict[str, str] | None = None  # labels: change no output
        response_format: ResponseFormat | None = None
        tools: list[Tool] | None = None
        tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
        parallel_tool_calls: bool | None = None
        # the deprecated function-calling fields: refused (see _refuse_unsupported), tools replace them
        functions: list | None = None
        function_call: str | dict | None = None

    class CompletionRequest(Common):
        prompt: str | list[str] | list[int] | list[list[int]]
        echo: bool | None = None
        logprobs: int | None = None
        best_of: int | None = None
        suffix: str | None = None

    class TokenizeRequest(_Base):
        # vLLM spells the text prompt and add_special_tokens, llama.cpp content and add_special
        model: str | None = None
        prompt: str | None = None
        content: str | None = None
        messages: list[ChatMessage] | None = Field(None, min_length=1)
        add_special_tokens: bool | None = None
        add_special: bool | None = None
        add_generation_prompt: bool = True
        with_pieces: bool = False  # llama.cpp: each token as {"id", "piece"}

    class DetokenizeRequest(_Base):
        model: str | None = None
        tokens: list[int]

    return ChatRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest


# ------------------------------------------------------------------ metrics

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/tokenize",
          "/detokenize")
TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    """The Prometheus metrics of one server, in their own registry (several servers may share a process)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("flint_http_requests", "HTTP requests answered, by route and status code",
                                ["route", "status"], registry=r)
        self.finished = Counter("flint_generations", "generations ended, by finish reason (stop, length, "
                                "cancelled, error, shutdown)", ["reason"], registry=r)
        self.waiting = Gauge("flint_queue_waiting", "generation requests waiting for the engine", registry=r)
        self.running = Gauge("flint_queue_running", "generation requests decoding (0 or 1)", registry=r)
        self.prompt_tokens = Counter("flint_prompt_tokens", "prompt tokens of the generations run", registry=r)
        self.generated = Counter("flint_generation_tokens", "tokens generated", registry=r)
        self.queue_s = Histogram("flint_queue_wait_seconds", "time from admission to the start of the prefill",
                                 buckets=TIME_BUCKETS, registry=r)
        self.ttft_s = Histogram("flint_time_to_first_token_seconds", "prefill and first token, queue wait "
                                "excluded", buckets=TIME_BUCKETS, registry=r)
        self.decode_s = Histogram("flint_decode_seconds", "decode time of a generation after its first token",
                                  buckets=TIME_BUCKETS, registry=r)
        self.tpot_s = Histogram("flint_time_per_output_token_seconds", "decode time per token after the first",
                                buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
                                registry=r)
        self.spec_steps = Counter("flint_spec_verify_steps", "speculative decoding: target verify forwards",
                                  registry=r)
        self.spec_drafted = Counter("flint_spec_draft_tokens", "speculative decoding: draft tokens proposed",
                                    registry=r)
        self.spec_accepted = Counter("flint_spec_accepted_tokens", "speculative decoding: draft tokens accepted",
                                     registry=r)

    def route(self, path: str) -> str:
        if path.startswith("/v1/models/"):
            return "/v1/models/{id}"
        return path if path in ROUTES else "other"  # bounded label values whatever clients send

    def generation(self, engine, r, wait_s: float, reason: str) -> None:
        self.finished.labels(reason).inc()
        self.queue_s.observe(wait_s)
        if r is None:
            return
        self.prompt_tokens.inc(r.prompt_tokens)
        self.generated.inc(len(r.token_ids))
        if r.token_ids:
            self.ttft_s.observe(r.ttft_s)
        if len(r.token_ids) > 1:
            self.decode_s.observe(r.decode_s)
            self.tpot_s.observe(r.decode_s / (len(r.token_ids) - 1))
        stats = getattr(engine, "last_stats", None)  # a speculative engine's counts for this call
        if stats is not None:
            self.spec_steps.inc(stats.steps)
            self.spec_drafted.inc(stats.drafted)
            self.spec_accepted.inc(stats.accepted)

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


# ------------------------------------------------------------------ the queue and its worker

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


def _shutdown_error() -> APIError:
    return APIError(503, "the server is shutting down", "server_error", code="server_shutdown")


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


# ------------------------------------------------------------------ server state

@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte: the printable Latin-1 bytes stand for
    themselves, the other bytes (controls, space, 0x7f-0xa0, 0xad) for 256, 257, ... in byte order."""
    kept = [*range(0x21, 0x7f), *range(0xa1, 0xad), *range(0xae, 0x100)]
    table = {chr(b): b for b in kept}
    shifted = [b for b in range(256) if b not in table.values()]
    table.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return table


class ServerState:
    def __init__(self, model_id: str, api_key: str | None, max_queue: int, default_max_tokens: int = 1024,
                 max_tokens_limit: int = 4096, allow_hosts=(), body_timeout_s: float = 30.0):
        self.model_id = model_id
        self.api_key = api_key
        self.max_queue = max_queue
        self.default_max_tokens = default_max_tokens
        self.max_tokens_limit = max_tokens_limit
        self.allow_hosts = {h.strip().lower().strip("[]").rstrip(".") for h in allow_hosts}
        self.body_timeout_s = body_timeout_s
        self.created = int(time.time())
        self.lm = None
        self.engine = None
        self.grammars = None  # flint.grammar.Grammars of the model's tokenizer
        self.scheduler: Scheduler | None = None
        self.ready = threading.Event()
        self.metrics = Metrics()
        self._token_text: dict[int, tuple[str, list[int]]] = {}
        self.should_stop = lambda: False  # set to the server's "shutting down" flag
        self.draining = False  # SIGTERM seen: new requests get 503, the ones in flight finish
        self.in_flight = 0  # HTTP requests being answered (event-loop thread only)
        # tokenizing (and the chat template) runs here, one prompt at a time: off the event loop, and a burst
        # of long prompts takes one core, not all of them
        self.tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="flint-tokenize")

    def load(self, args) -> None:
        from .cli import load_engine

        t0 = time.perf_counter()
        lm, backend, engine = load_engine(args)
        if lm.tokenizer is None:
            raise ValueError(f"model {self.model_id!r} has no tokenizer; flint serve needs text in and out")
        lm.tokenizer.max_token_chars  # computed once here, not in the first request
        self.lm, self.engine = lm, engine
        from .grammar import Grammars

        eos = next((t for t in lm.tokenizer.eos_token_ids if t in engine.eos), min(engine.eos))
        self.grammars = Grammars(lm.tokenizer, lm.cfg.vocab_size, eos)
        try:
            self.grammars.lltok  # built once here (~0.3 s), not in the first constrained request
        except ValueError as e:  # the server still serves unconstrained requests; constrained ones get a 400
            log.warning("%s", e)
        self.scheduler = Scheduler(engine, self.max_queue, self.should_stop, self.metrics)
        self.ready.set()
        log.info("model %s ready on backend %s (context %d tokens) in %.1fs", self.model_id,
                 backend.name, engine.max_seq_len, time.perf_counter() - t0)

    def token_text(self, tid: int) -> tuple[str, list[int]]:
        """A token's text and its UTF-8 bytes, as logprobs report them. A byte-level BPE token may hold
        part of a character: its bytes come from the vocabulary entry, its text shows U+FFFD for them."""
        got = self._token_text.get(tid)
        if got is None:
            tok = self.lm.tokenizer
            piece, raw = tok.tk.id_to_token(tid), None
            if piece is None:
                pass
            elif type(tok.tk.decoder).__name__ == "ByteLevel":
                table = _byte_level_alphabet()
                if all(ch in table for ch in piece):
                    raw = bytes(table[ch] for ch in piece)
            elif re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):  # SentencePiece's byte fallback
                raw = bytes([int(piece[3:5], 16)])
            elif "\u2581" in piece:  # SentencePiece's word mark; decoding one token alone would strip its space
                raw = piece.replace("\u2581", " ").encode()
            if raw is None:
                raw = tok.decode([tid], skip_special_tokens=False).encode()
            got = self._token_text[tid] = (raw.decode("utf-8", errors="replace"), list(raw))
        return got

    def host_allowed(self, host: str) -> bool:
        """Whether a Host (or Origin) name may be served without an API key: a loopback name or
        address, or one given with --allow-host ('*': any)."""
        if self.api_key is not None or "*" in self.allow_hosts:
            return True
        name = host.strip().lower()
        if name.startswith("["):  # [v6]:port
            name = name[1:name.find("]")] if "]" in name else name[1:]
        elif name.count(":") == 1:
            name = name.rsplit(":", 1)[0]
        name = name.rstrip(".")
        if name in self.allow_hosts or name == "localhost" or name.endswith(".localhost"):
            return True
        try:
            return ipaddress.ip_address(name).is_loopback
        except ValueError:
            return False


# ------------------------------------------------------------------ turning requests into jobs

def _requested_max_tokens(req) -> int | None:
    if getattr(req, "max_tokens", None) is not None:
        return req.max_tokens
    return getattr(req, "max_completion_tokens", None)


def _refuse_unsupported(req, state: ServerState) -> None:
    """400s for fields whose value flint cannot honour (before any work). Fields at their neutral
    value (tools [], response_format {"type": "text"}) change nothing and pass."""
    def refuse(param: str, message: str, code: str = "unsupported_parameter"):
        raise APIError(400, message, param=param, code=code)

    if req.stream_options is not None and not req.stream:
        refuse("stream_options", "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
               "invalid_value")
    if req.n not in (None, 1):
        refuse("n", f"n={req.n} is not supported: flint decodes one sequence per request (n=1)", "unsupported_value")
    limit = state.max_tokens_limit
    for name in ("max_tokens", "max_completion_tokens"):
        v = getattr(req, name, None)
        if v is not None and v > limit:
            refuse(name, f"{name}={v} is over this server's limit of {limit} (--max-tokens-limit)", "invalid_value")
    if len(req.logit_bias or {}) > MAX_LOGIT_BIAS:
        refuse("logit_bias", f"logit_bias: at most {MAX_LOGIT_BIAS} entries", "invalid_value")
    if hasattr(req, "messages"):
        if req.top_logprobs is not None:
            if not req.logprobs:
                refuse("top_logprobs", "top_logprobs requires logprobs: true", "invalid_value")
            if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
                refuse("top_logprobs", f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {req.top_logprobs}",
                       "invalid_value")
        for name in ("functions", "function_call"):
            if getattr(req, name) is not None:
                refuse(name, f"{name}: the deprecated function-calling field is not supported; use tools and "
                             "tool_choice")
        if req.tool_choice not in (None, "none") and not req.tools:
            refuse("tool_choice", "tool_choice needs tools", "invalid_value")
        rf = req.response_format
        if rf is not None and rf.type == "json_schema" and (rf.json_schema is None or rf.json_schema.schema_ is None):
            refuse("response_format.json_schema.schema", "response_format: type json_schema needs "
                   "json_schema.schema", "invalid_value")
    else:
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
            refuse("logprobs", f"logprobs must be in 0..{MAX_TOP_LOGPROBS} (alternatives per token), got "
                               f"{req.logprobs}", "invalid_value")
        for field, bad in (("echo", req.echo), ("best_of", req.best_of not in (None, 1)), ("suffix", req.suffix)):
            if bad:
                refuse(field, f"{field} is not supported", "unsupported_value")


def _too_long(param: str, n_prompt: int, max_tokens: int | None, context: int, at_least: bool = False) -> APIError:
    room = f" + max_tokens ({max_tokens})" if max_tokens is not None else ""
    size = f"at least {n_prompt} tokens" if at_least else f"{n_prompt} tokens"
    return APIError(400, f"{param}: the prompt ({size}){room} does not fit the context of {context} tokens",
                    param=param, code="context_length_exceeded")


def _check_length(n_chars: int, req, state: ServerState, param: str) -> None:
    """Refuse, before tokenizing, a prompt too long to fit: n characters are at least
    n / max_token_chars tokens. This bounds what tokenizing costs."""
    least = -(-n_chars // state.lm.tokenizer.max_token_chars)
    want = _requested_max_tokens(req)
    if least + (want or 1) > state.engine.max_seq_len:
        raise _too_long(param, least, want, state.engine.max_seq_len, at_least=True)


def _logprobs_wanted(req) -> int | None:
    """Alternatives per token the request wants with its logprobs (None: no logprobs)."""
    if hasattr(req, "messages"):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


class ToolPlan:
    """How one chat request uses tools: the format its template speaks, the tools shown to the model, whether
    the output is parsed for calls, and the grammar that forces a call (tool_choice required or named)."""

    def __init__(self, fmt, tools: list[dict] | None, parse: bool, force=None, keep_special: bool = False,
                 param: str = "tool_choice"):
        self.fmt, self.tools, self.parse, self.force, self.keep_special = fmt, tools, parse, force, keep_special
        self.param = param  # the field the grammar comes from: tool_choice (a forced call), tools (strict, auto)


def _tool_plan(req, state: ServerState) -> ToolPlan:
    from .grammar import GrammarError
    from .tools import auto_grammar, call_grammar, check_tools, detect_format

    fmt = detect_format(state.lm.tokenizer.chat_template)
    if not req.tools or req.tool_choice == "none":  # "none": the tools are not shown, the output is text
        return ToolPlan(fmt, None, False)
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    force, param = None, "tool_choice"
    try:
        check_tools(tools)
        choice = req.tool_choice
        if choice == "required" or not isinstance(choice, (str, type(None))):
            chosen = tools
            if choice != "required":
                chosen = [t for t in tools if t["function"]["name"] == choice.function.name]
                if not chosen:
                    raise GrammarError(f"tool_choice: no tool is named {choice.function.name[:80]!r}",
                                       "tool_choice.function.name")
            # a named function is called once; "required" allows several when parallel_tool_calls permits
            parallel = choice == "required" and req.parallel_tool_calls is not False
            _refuse_on_draft(state, "tool_choice", "forcing a tool call")
            force = call_grammar(state.grammars, fmt, chosen, parallel)
        elif any(t["function"].get("strict") for t in tools):  # auto, strict: text, or calls valid for their schemas
            _refuse_on_draft(state, "tools", "strict function schemas")
            force, param = auto_grammar(state.grammars, fmt, tools, req.parallel_tool_calls is not False), "tools"
        else:  # auto: the schemas must still be ones the engine could force
            for i, t in enumerate(tools):
                if "parameters" in t["function"]:
                    state.grammars.json_schema(t["function"]["parameters"], f"tools.{i}.function.parameters")
    except GrammarError as e:
        raise APIError(400, str(e), param=e.param or "tools", code="invalid_value") from None
    tok = state.lm.tokenizer
    specials = {t.content for t in tok.tk.get_added_tokens_decoder().values() if t.special}
    return ToolPlan(fmt, tools, True, force, keep_special=bool({fmt.begin, fmt.end} & specials), param=param)


def _refuse_on_draft(state: ServerState, param: str, what: str) -> None:
    """A 400 naming ``param`` when the engine cannot apply a grammar (speculative decoding: no token mask)."""
    from .engine import SamplingParams

    if state.engine.unsupported(SamplingParams(constraint=object())):
        raise APIError(400, f"{param}: {what} needs grammar-constrained decoding, which speculative decoding "
                            "(this server runs --draft) does not apply", param=param, code="unsupported_parameter")


def _constraint(req, state: ServerState, plan: ToolPlan | None):
    """The grammar constraint a request asks for (at most one source), compiled; None without one."""
    from .grammar import GrammarError

    g = state.grammars
    asked = []  # (param, build)
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type == "json_object":
        asked.append(("response_format", lambda: g.json_object("response_format")))
    elif rf is not None and rf.type == "json_schema":
        asked.append(("response_format", lambda: g.json_schema(rf.json_schema.schema_,
                                                               "response_format.json_schema.schema")))
    so = req.structured_outputs
    if so is not None:
        given = [(n, v) for n, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                     ("grammar", so.grammar)) if v is not None]
        if len(given) != 1:
            raise APIError(400, "structured_outputs: give exactly one of json, regex, choice, grammar",
                           param="structured_outputs", code="invalid_value")
        (name, v), = given
        where = f"structured_outputs.{name}"
        compile_ = {"json": g.json_schema, "regex": g.regex, "choice": g.choice, "grammar": g.lark}[name]
        asked.append(("structured_outputs", lambda: compile_(v, where)))
    if req.grammar is not None:
        asked.append(("grammar", lambda: g.gbnf(req.grammar, "grammar")))
    if plan is not None and plan.force is not None:
        asked.append((plan.param, lambda: plan.force))
    if not asked:
        return None
    if len(asked) > 1:
        raise APIError(400, f"{asked[1][0]}: only one output constraint per request ({asked[0][0]} is given too)",
                       param=asked[1][0], code="invalid_value")
    param, build = asked[0]
    if req.ignore_eos:
        raise APIError(400, f"ignore_eos cannot be combined with {param} (the grammar ends the output)",
                       param="ignore_eos", code="invalid_value")
    _refuse_on_draft(state, param, "this output constraint")
    try:
        return build()
    except GrammarError as e:
        raise APIError(400, str(e), param=e.param or param, code="invalid_value") from None


def _sampling(req, state: ServerState, n_prompt: int, prompt_param: str, plan: ToolPlan | None = None):
    """SamplingParams for a validated request, with the context checked (400 before any work)."""
    from .engine import ContextError, SamplingParams

    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP_STRINGS or any(not s for s in stop):
        raise APIError(400, f"stop: at most {MAX_STOP_STRINGS} non-empty strings", param="stop",
                       code="invalid_value")
    max_tokens = _requested_max_tokens(req)
    engine = state.engine
    try:
        if max_tokens is None:  # the server's default, or what the context leaves when that is less
            engine.check_fits(n_prompt, 1)
            max_tokens = min(state.default_max_tokens, engine.max_seq_len - n_prompt)
        else:
            engine.check_fits(n_prompt, max_tokens)
    except ContextError:
        if n_prompt == 0:
            raise APIError(400, f"{prompt_param}: the prompt is empty", param=prompt_param,
                           code="invalid_value") from None
        raise _too_long(prompt_param, n_prompt, _requested_max_tokens(req), engine.max_seq_len) from None
    bias = {}
    vocab = state.lm.cfg.vocab_size
    for key, b in (req.logit_bias or {}).items():
        try:
            t = int(key)
        except ValueError:
            t = -1
        if not 0 <= t < vocab:
            raise APIError(400, f"logit_bias: {key!r} is not a token id of this model (0..{vocab - 1})",
                           param="logit_bias", code="invalid_value")
        bias[t] = b
    sp = SamplingParams(max_new_tokens=max_tokens,
                        temperature=1.0 if req.temperature is None else req.temperature,
                        top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
                        seed=req.seed, stop=stop, ignore_eos=req.ignore_eos, min_p=req.min_p or 0.0,
                        presence_penalty=req.presence_penalty or 0.0,
                        frequency_penalty=req.frequency_penalty or 0.0,
                        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                        logit_bias=bias, logprobs=_logprobs_wanted(req), constraint=_constraint(req, state, plan),
                        skip_special=not (plan is not None and plan.keep_special))
    try:
        sp.validate()
    except ValueError as e:
        field = str(e).split(" ")[0].rstrip(":")
        raise APIError(400, str(e), param=field if field in type(req).model_fields else None,
                       code="invalid_value") from None
    bad = engine.unsupported(sp)
    if bad:
        raise APIError(400, f"{bad[0]} is not supported with speculative decoding (this server runs --draft)",
                       param=bad[0], code="unsupported_parameter")
    return sp


def _chat_messages(req, state: ServerState) -> list[dict]:
    """The messages as the chat template takes them, roles checked, their length against the context."""
    messages = []
    for i, m in enumerate(req.messages):
        role = ROLES.get(m.role)
        if role is None:
            raise APIError(400, f"messages.{i}.role: {m.role[:40]!r} is not a role; use one of "
                                f"{', '.join(ROLES)}", param=f"messages.{i}.role", code="invalid_value")
        c = m.content
        if isinstance(c, list):
            c = "".join(p.text for p in c)
        msg = {"role": role, "content": c or ""}
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            if role != "assistant":
                raise APIError(400, f"messages.{i}.tool_calls: only assistant messages have tool calls",
                               param=f"messages.{i}.tool_calls", code="invalid_value")
            for j, tc in enumerate(m.tool_calls):
                try:
                    json.loads(tc.function.arguments)
                except ValueError:
                    raise APIError(400, f"messages.{i}.tool_calls.{j}.function.arguments: not valid JSON",
                                   param=f"messages.{i}.tool_calls.{j}.function.arguments",
                                   code="invalid_value") from None
            msg["tool_calls"] = [tc.model_dump() for tc in m.tool_calls]
        messages.append(msg)
    extra = sum(len(json.dumps(t.model_dump(exclude_none=True))) for t in (getattr(req, "tools", None) or []))
    extra += sum(len(json.dumps(m["tool_calls"])) for m in messages if "tool_calls" in m)
    _check_length(sum(len(m["content"]) for m in messages) + extra, req, state, "messages")
    return messages


def _encode_chat(messages: list[dict], state: ServerState, add_generation_prompt: bool = True,
                 plan: ToolPlan | None = None) -> list[int]:
    from .tools import FALLBACK, detect_format, render

    fmt = plan.fmt if plan is not None else detect_format(state.lm.tokenizer.chat_template)
    messages, tools = render(messages, plan.tools if plan is not None else None, fmt or FALLBACK)
    try:
        return state.lm.tokenizer.encode_chat(messages, add_generation_prompt, tools)
    except ValueError as e:  # no chat template, or the template rejects the conversation
        raise APIError(400, str(e), param="messages", code="invalid_value") from None
    except Exception as e:  # a template error (jinja) on unusual input
        raise APIError(400, f"the chat template failed on these messages ({type(e).__name__}: {e})",
                       param="messages", code="invalid_value") from None


def _completion_input(req, state: ServerState) -> str | list[int]:
    """The prompt: a string (its length checked against the context) or checked token ids."""
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise APIError(400, f"prompt: {len(p)} prompts given; flint serves one per request",
                           param="prompt", code="unsupported_value")
        p = p[0]
    if isinstance(p, str):
        _check_length(len(p), req, state, "prompt")
        return p
    want = _requested_max_tokens(req)
    if len(p) + (want or 1) > state.engine.max_seq_len:  # before looking at each id
        raise _too_long("prompt", len(p), want, state.engine.max_seq_len)
    vocab = state.lm.cfg.vocab_size
    for t in p:
        if not 0 <= t < vocab:
            raise APIError(400, f"prompt: token id {t} is outside the vocabulary (size {vocab})",
                           param="prompt", code="invalid_value")
    return list(p)


# ------------------------------------------------------------------ the app

def create_app(state: ServerState):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse
    from pydantic import ValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from starlette.requests import ClientDisconnect

    ChatRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest = schemas()
    app = FastAPI(title="flint", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        headers = dict(e.headers or {})
        if e.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        if request.url.path.startswith("/v1/") and e.status != 499:  # 499: logged when cancelled
            log.info("%s %s -> %d %s", request.method, request.url.path, e.status, e.message)
        return JSONResponse(e.body(), status_code=e.status, headers=headers or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e):  # 404 route, 405 method (its Allow header kept)
        return JSONResponse(APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                                     code="not_found" if e.status_code == 404 else None).body(),
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        return JSONResponse(APIError(500, f"internal error ({type(e).__name__})", "server_error").body(),
                            status_code=500)

    def authorize(request: Request) -> None:
        if state.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "missing API key: send the header 'Authorization: Bearer KEY'",
                           code="invalid_api_key")
        if not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
            raise APIError(401, "incorrect API key", code="invalid_api_key")

    def require_ready() -> None:
        if not state.ready.is_set():
            raise APIError(503, "the model is still loading; retry when GET /health answers 200",
                           "service_unavailable", code="model_loading")

    def too_large() -> APIError:
        return APIError(413, f"request body over {MAX_BODY_BYTES} bytes", code="request_too_large")

    async def read_body(request: Request) -> bytes:
        """The body, within MAX_BODY_BYTES and state.body_timeout_s."""
        try:
            if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
                raise too_large()
        except ValueError:
            raise APIError(400, "Content-Length: not a number", code="invalid_value") from None
        body = bytearray()
        try:
            async with asyncio.timeout(state.body_timeout_s):
                async for chunk in request.stream():
                    body += chunk
                    if len(body) > MAX_BODY_BYTES:
                        raise too_large()
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive within {state.body_timeout_s:g}s "
                                f"({len(body)} bytes came)", code="request_timeout") from None
        except ClientDisconnect:
            log.info("%s %s: the client disconnected during the upload (%d bytes read)", request.method,
                     request.url.path, len(body))
            raise APIError(499, "the client closed the request", code="client_closed") from None
        return bytes(body)

    def check_model(name: str | None) -> None:
        if name is not None and name != state.model_id:
            raise APIError(404, f"model {name!r} does not exist; this server serves {state.model_id!r}",
                           param="model", code="model_not_found")

    async def read_request(request: Request, model_cls):
        authorize(request)
        require_ready()
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
            raise APIError(415, f"Content-Type: the body must be JSON (application/json), got "
                                f"{media or 'none'!r}", param="Content-Type", code="unsupported_media_type")
        body = await read_body(request)
        try:
            req = model_cls.model_validate_json(body, strict=True)
        except ValidationError as e:
            raise _validation_error(e) from None
        check_model(req.model)
        if hasattr(req, "stream"):  # a generation request
            _refuse_unsupported(req, state)
        return req

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: the status alone, for load balancers
    async def health():
        if not state.ready.is_set():
            return JSONResponse(APIError(503, "the model is loading", "service_unavailable",
                                         code="model_loading").body(), status_code=503)
        s = state.scheduler
        return {"status": "ok", "model": state.model_id, "waiting": len(s.waiting),
                "running": s.running is not None, "served": s.served}

    @app.get("/metrics")
    async def metrics(request: Request):
        from fastapi.responses import Response
        from prometheus_client import CONTENT_TYPE_LATEST

        authorize(request)
        return Response(state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        req = await read_request(request, TokenizeRequest)
        given = [name for name in ("prompt", "content", "messages") if getattr(req, name) is not None]
        if len(given) != 1:
            raise APIError(400, "give one of prompt (or content, llama.cpp's name) and messages"
                           + (f", not {' and '.join(given)}" if given else ""),
                           param=given[-1] if given else "prompt", code="invalid_value")
        if req.add_special_tokens is not None and req.add_special is not None:
            raise APIError(400, "give add_special_tokens or add_special (the same switch), not both",
                           param="add_special", code="invalid_value")
        special = req.add_special if req.add_special_tokens is None else req.add_special_tokens
        if req.messages is not None:
            if special is not None:  # the chat template places the special tokens
                raise APIError(400, f"{'add_special' if req.add_special is not None else 'add_special_tokens'}: "
                                    "not with messages (the chat template places the special tokens)",
                               param="add_special_tokens" if req.add_special is None else "add_special",
                               code="invalid_value")
            messages = _chat_messages(req, state)
            ids = await tokenize(lambda m: _encode_chat(m, state, req.add_generation_prompt), messages)
        else:
            text = req.prompt if req.prompt is not None else req.content
            _check_length(len(text), req, state, given[0])
            ids = await tokenize(lambda t: state.lm.tokenizer.encode(t, add_special_tokens=special is not False),
                                 text)
        tokens = [{"id": t, "piece": state.token_text(t)[0]} for t in ids] if req.with_pieces else ids
        return {"tokens": tokens, "count": len(ids), "max_model_len": state.engine.max_seq_len}

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        req = await read_request(request, DetokenizeRequest)
        vocab = state.lm.cfg.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"tokens: token id {bad} is outside the vocabulary (size {vocab})",
                           param="tokens", code="invalid_value")
        text = await tokenize(lambda ids: state.lm.tokenizer.decode(ids, skip_special_tokens=False), req.tokens)
        return {"prompt": text, "content": text}  # vLLM's name and llama.cpp's

    def model_card() -> dict:
        return {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "flint"}

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str):
        authorize(request)
        check_model(model_id)
        return model_card()

    def submit(request_id: str, prompt_ids: list[int], sp) -> Job:
        job = Job(request_id, prompt_ids, sp, asyncio.get_running_loop())
        try:
            state.scheduler.submit(job)
        except QueueFull:
            raise APIError(429, f"the queue is full ({state.max_queue} waiting, the --max-queue limit); "
                                "retry later", "rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        return job

    async def watch_disconnect(request: Request, job: Job) -> None:
        """Cancel the job when the client goes away (the body is read; what remains is disconnect)."""
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                state.scheduler.cancel(job)
                return

    async def events(request: Request, job: Job):
        """The job's events; cancels the job when the client leaves or this consumer stops."""
        watcher = asyncio.create_task(watch_disconnect(request, job))
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

    async def respond(request: Request, req, prompt_ids: list[int], chat: bool, plan: ToolPlan | None = None):
        from .tools import ToolStream

        sp = _sampling(req, state, len(prompt_ids), "messages" if chat else "prompt", plan)
        parsing = plan is not None and plan.parse
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        job = submit(rid, prompt_ids, sp)
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
                async with aclosing(events(request, job)) as evs:
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
        async with aclosing(events(request, job)) as evs:
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

    async def tokenize(fn, arg) -> list[int]:
        # off the event loop (a long prompt must not stall others), on the one tokenizer thread; what
        # reaches it was length-checked already, so one prompt holds it for a bounded time
        return await asyncio.get_running_loop().run_in_executor(state.tokenize_pool, fn, arg)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await read_request(request, ChatRequest)
        messages = _chat_messages(req, state)
        plan = _tool_plan(req, state)
        ids = await tokenize(lambda m: _encode_chat(m, state, plan=plan), messages)
        return await respond(request, req, ids, chat=True, plan=plan)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await read_request(request, CompletionRequest)
        prompt = _completion_input(req, state)
        ids = prompt if isinstance(prompt, list) else await tokenize(state.lm.tokenizer.encode, prompt)
        return await respond(request, req, ids, chat=False)

    return Guard(app, state)


class Guard:
    """ASGI middleware in front of every route: 503 while draining, the Host / Origin check without
    an API key (a web page can make a browser send requests to loopback, and DNS rebinding can make
    it read the answers: both carry a foreign name), and the count of requests in flight."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    def refusal(self, scope) -> APIError | None:
        if self.state.draining:
            return _shutdown_error()
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host")
        if host is not None and not self.state.host_allowed(host):
            return APIError(403, f"Host {host[:100]!r} is not served: without --api-key only loopback names are "
                                 "(add it with --allow-host)", "permission_error", param="Host",
                            code="host_not_allowed")
        origin = headers.get("origin")
        if origin:  # "null" (a sandboxed or file: page) is no loopback name either
            name = origin.split("://", 1)[-1].split("/", 1)[0]
            if not self.state.host_allowed(name):
                return APIError(403, f"Origin {origin[:100]!r} is not served: without --api-key only loopback "
                                     "origins are (add it with --allow-host)", "permission_error",
                                param="Origin", code="origin_not_allowed")
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        from fastapi.responses import JSONResponse

        err = self.refusal(scope)
        if err is not None:
            log.info("%s %s -> %d %s", scope["method"], scope["path"], err.status, err.message)
            self.state.metrics.requests.labels(self.state.metrics.route(scope["path"]), str(err.status)).inc()
            return await JSONResponse(err.body(), status_code=err.status)(scope, receive, send)
        status = []

        async def send_seen(msg):
            if msg["type"] == "http.response.start":
                status.append(msg["status"])
            await send(msg)

        self.state.in_flight += 1
        try:
            await self.app(scope, receive, send_seen)
        finally:
            self.state.in_flight -= 1
            if status:  # else the client left before any answer
                self.state.metrics.requests.labels(self.state.metrics.route(scope["path"]), str(status[0])).inc()


# ------------------------------------------------------------------ the command

def _bind(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None
    sock.set_inheritable(True)
    return sock


def _protocol(header_timeout_s: float):
    """uvicorn's h11 protocol with a deadline on each request head: from the connection's start, or
    from the previous response's end, a whole head must arrive within header_timeout_s, else the
    connection closes (uvicorn's keep-alive timer stops at the first byte, so a client sending a
    header a byte at a time would hold its connection forever)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        def connection_made(self, transport):
            self._head_timer = None
            super().connection_made(transport)
            self._arm_head_timer()

        def _arm_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_cycle = self.cycle  # a new request head makes a new cycle
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_timeout)

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self.cycle is self._head_cycle and not self.transport.is_closing():
                self.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            if self._head_timer is not None and self.cycle is not self._head_cycle:
                self._head_timer.cancel()
                self._head_timer = None

        def on_response_complete(self) -> None:
            self._arm_head_timer()  # before: the next pipelined head may be handled inside
            super().on_response_complete()

        def connection_lost(self, exc) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().connection_lost(exc)

    return Protocol


def _server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """The first SIGTERM / SIGINT drains: new requests get 503 while the running and queued
        ones finish, for up to drain_timeout_s; then uvicorn's shutdown. A second signal exits now."""

        state: ServerState
        drain_timeout_s: float

        def handle_exit(self, sig, frame) -> None:
            if self.state.draining:
                if self.should_exit:
                    self.force_exit = True
                self.should_exit = True
                return
            self.state.draining = True
            threading.Thread(target=self._drain, name="flint-drain", daemon=True).start()

        def _drain(self) -> None:
            t0 = time.monotonic()
            log.info("draining: %d request(s) in flight finish (up to %gs), new ones get 503; a second signal "
                     "stops now", self.state.in_flight, self.drain_timeout_s)
            while self.state.in_flight and time.monotonic() - t0 < self.drain_timeout_s and not self.should_exit:
                time.sleep(0.05)
            if self.state.in_flight:
                log.info("drain timeout: %d request(s) still in flight end with 503", self.state.in_flight)
            self.should_exit = True

    return DrainingServer


def cmd_serve(args) -> int:
    import uvicorn

    from .loading import DEFAULT_MODEL

    for name in ("max_queue", "default_max_tokens", "max_tokens_limit", "max_connections"):
        low = 0 if name == "max_queue" else 1
        if getattr(args, name) < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    for name in ("header_timeout", "body_timeout", "drain_timeout"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0 seconds, got {getattr(args, name)}")
    if args.default_max_tokens > args.max_tokens_limit:
        raise ValueError(f"--default-max-tokens {args.default_max_tokens} is over --max-tokens-limit "
                         f"{args.max_tokens_limit}")
    # the engine thread takes the GIL back after each of its many small torch ops; while the event loop
    # is busy in Python (a large body arriving) each of those waits up to the switch interval (5 ms by
    # default): shorter, decoding keeps its speed next to a busy loop
    sys.setswitchinterval(0.0005)
    log.setLevel(logging.INFO)
    if not log.handlers and not logging.getLogger().handlers:  # else the embedding app's logging rules
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(asctime)s flint serve: %(message)s", "%H:%M:%S"))
        log.addHandler(h)
        log.propagate = False
    allow = [h.strip() for item in args.allow_host for h in item.split(",") if h.strip()]
    state = ServerState(args.model or DEFAULT_MODEL, args.api_key, args.max_queue, args.default_max_tokens,
                        args.max_tokens_limit, allow, args.body_timeout)
    sock = _bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    # limit_concurrency counts the connection a request arrives on: + 1 serves max_connections of them
    config = uvicorn.Config(create_app(state), log_level="warning", access_log=False, timeout_graceful_shutdown=3,
                            lifespan="off", http=_protocol(args.header_timeout),
                            limit_concurrency=args.max_connections + 1, timeout_keep_alive=5)
    server = _server_class()(config)
    server.state, server.drain_timeout_s = state, args.drain_timeout
    state.should_stop = lambda: server.should_exit
    failure: list[str] = []

    def load() -> None:
        # waits until uvicorn listens, so /health answers 503 during the whole load
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            state.load(args)
        except Exception as e:  # report, then stop the server: it has nothing to serve
            failure.append(str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}")
            server.should_exit = True

    threading.Thread(target=load, name="flint-load", daemon=True).start()
    url_host = f"[{host}]" if ":" in host else host
    log.info("listening on http://%s:%d (model %s loading; %s)", url_host, port, state.model_id,
             "API key required" if args.api_key else
             "no API key: loopback Host names only" + (f", and {', '.join(allow)}" if allow else ""))
    server.run(sockets=[sock])
    if state.scheduler is not None:
        state.scheduler.close()
    if failure:
        print(f"flint: error: {failure[0]}", file=sys.stderr)
        return 2
    return 0


def register(sub) -> None:
    from .cli import add_model_args

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat and completions, SSE)",
                       description="An OpenAI-compatible HTTP server on the engine; see docs/serve.md.")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port (0 = any free port, printed at start)")
    p.add_argument("--api-key", default=os.environ.get("FLINT_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: $FLINT_API_KEY, "
                        "which keeps the key out of process listings)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait while one decodes; more are answered 429 (default 64)")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="without --api-key, also serve requests whose Host (or Origin) is NAME (repeatable, or "
                        "comma-separated; '*' = any); by default only loopback names are served")
    for flag, kind, default, text in (
            ("--default-max-tokens", int, 1024, "max_tokens of a request that gives none (less if the context has "
                                                "less room)"),
            ("--max-tokens-limit", int, 4096, "the largest max_tokens a request may ask for; more is a 400"),
            ("--max-connections", int, 256, "open connections served at once; a request on one more gets 503"),
            ("--header-timeout", float, 10.0, "seconds a connection may take to send a request head"),
            ("--body-timeout", float, 30.0, "seconds a request may take to send its body; later is a 408"),
            ("--drain-timeout", float, 30.0, "on SIGTERM, seconds the requests in flight may take to finish")):
        p.add_argument(flag, type=kind, default=default, metavar="N" if kind is int else "SECONDS",
                       help=f"{text} (default {default:g})")
    p.set_defaults(func=cmd_serve)
