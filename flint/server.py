"""`flint serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) on the batch-1 engine.

    flint serve [--model M] [--backend B] [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--max-queue N]

Routes: GET /health (503 while the model loads, 200 after), GET /v1/models, POST /v1/completions,
POST /v1/chat/completions (SSE streaming with ``stream``; ``stream_options.include_usage``).
The engine decodes one sequence at a time: requests wait in a FIFO (``--max-queue`` waiting
requests at most, 429 beyond) and one worker thread owns the engine; a client that goes away
cancels its generation at the next token. Every error is an OpenAI error object. One log line per
request (id, prompt/completion tokens, queue wait, TTFT, decode tok/s). Usage: docs/serve.md.
Test: ``pytest tests/test_server.py``.

Heavy imports (fastapi, pydantic, uvicorn, torch) happen inside functions: `flint` imports this
module to build its parser, and other subcommands should not pay for them.
"""
import asyncio
import functools
import hmac
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections import deque
from contextlib import aclosing

log = logging.getLogger("flint.serve")

MAX_BODY_BYTES = 8 << 20  # a request body larger than this is refused (413) before parsing
MAX_STOP_STRINGS = 16


# ------------------------------------------------------------------ errors

class APIError(Exception):
    """An error answered to the client as an OpenAI error object."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

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
    return APIError(400, f"{param or 'body'}: {err['msg']}", param=param, code="invalid_value")


# ------------------------------------------------------------------ request schemas

@functools.cache
def schemas():
    """The request models (built on first use so importing this module stays cheap)."""
    from typing import Literal

    from pydantic import BaseModel, ConfigDict, Field

    class _Base(BaseModel):
        model_config = ConfigDict(extra="ignore")  # unknown OpenAI fields are accepted and ignored

    class TextPart(_Base):
        type: Literal["text"]
        text: str

    class ChatMessage(_Base):
        role: str
        content: str | list[TextPart] | None = None

    class StreamOptions(_Base):
        include_usage: bool = False

    class Common(_Base):
        model: str | None = None
        max_tokens: int | None = Field(None, ge=1)
        temperature: float | None = Field(None, ge=0, le=2)  # OpenAI's default is 1
        top_p: float | None = Field(None, gt=0, le=1)
        seed: int | None = Field(None, ge=-(2**63), lt=2**63)  # int64, as OpenAI's
        stop: str | list[str] | None = None
        n: int | None = None
        stream: bool | None = None
        stream_options: StreamOptions | None = None
        # extensions (vLLM spells them the same way)
        top_k: int | None = Field(None, ge=0)
        ignore_eos: bool = False

    class ChatRequest(Common):
        messages: list[ChatMessage] = Field(min_length=1)
        max_completion_tokens: int | None = Field(None, ge=1)
        logprobs: bool | None = None

    class CompletionRequest(Common):
        prompt: str | list[str] | list[int] | list[list[int]]
        echo: bool | None = None
        logprobs: int | None = None
        best_of: int | None = None
        suffix: str | None = None

    return ChatRequest, CompletionRequest


# ------------------------------------------------------------------ the queue and its worker

class Job:
    """One request's generation: filled by the worker thread, read by the request's coroutine."""

    def __init__(self, request_id: str, prompt_ids: list[int], sp, loop):
        self.id = request_id
        self.prompt_ids = prompt_ids
        self.sp = sp
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()  # ("text", str) / ("done", result) / ("error", exc)
        self.cancelled = threading.Event()
        self.t_submit = time.perf_counter()

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

    def __init__(self, engine, max_queue: int, should_stop=lambda: False):
        self.engine = engine
        self.max_queue = max_queue
        self.should_stop = should_stop
        self.closed = False
        self.waiting: deque[Job] = deque()
        self.running: Job | None = None
        self.cv = threading.Condition()
        self.served = 0
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
        wait_s = time.perf_counter() - job.t_submit
        if job.cancelled.is_set():  # the client left between the queue and here
            return
        stream = self.engine.stream(job.prompt_ids, job.sp)
        stopped = None  # why decoding ended early: the client left, or the server is stopping
        try:
            for _tok, piece in stream:
                if job.cancelled.is_set() or self.stopping():
                    stopped = "cancelled" if job.cancelled.is_set() else "shutdown"
                    break
                if piece:
                    job.push("text", piece)
        except Exception as e:  # the worker must outlive any one request
            log.exception("%s failed in the engine", job.id)
            job.push("error", e)
            return
        finally:
            stream.close()
        r = self.engine.last
        log.info("%s prompt=%d completion=%d queued=%.2fs ttft=%.3fs decode=%.1f tok/s finish=%s",
                 job.id, len(job.prompt_ids), len(r.token_ids), wait_s, r.ttft_s, r.decode_tok_s,
                 stopped or r.finish_reason)
        if stopped == "shutdown":
            job.push("error", _shutdown_error())
        else:
            job.push("done", r)


# ------------------------------------------------------------------ server state

class ServerState:
    def __init__(self, model_id: str, api_key: str | None, max_queue: int):
        self.model_id = model_id
        self.api_key = api_key
        self.max_queue = max_queue
        self.created = int(time.time())
        self.lm = None
        self.engine = None
        self.scheduler: Scheduler | None = None
        self.ready = threading.Event()
        self.should_stop = lambda: False  # set to the server's "shutting down" flag

    def load(self, args) -> None:
        from .cli import load_engine

        t0 = time.perf_counter()
        lm, backend, engine = load_engine(args)
        if lm.tokenizer is None:
            raise ValueError(f"model {self.model_id!r} has no tokenizer; flint serve needs text in and out")
        self.lm, self.engine = lm, engine
        self.scheduler = Scheduler(engine, self.max_queue, self.should_stop)
        self.ready.set()
        log.info("model %s ready on backend %s (context %d tokens) in %.1fs", self.model_id,
                 backend.name, engine.max_seq_len, time.perf_counter() - t0)


# ------------------------------------------------------------------ turning requests into jobs

def _sampling(req, state: ServerState, n_prompt: int, prompt_param: str):
    """SamplingParams for a validated request, with the context checked (400 before any work)."""
    from .engine import ContextError, SamplingParams

    if req.n not in (None, 1):
        raise APIError(400, f"n={req.n} is not supported: flint decodes one sequence per request (n=1)",
                       param="n", code="unsupported_value")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP_STRINGS or any(not s for s in stop):
        raise APIError(400, f"stop: at most {MAX_STOP_STRINGS} non-empty strings", param="stop",
                       code="invalid_value")
    max_tokens = req.max_tokens
    if max_tokens is None:
        max_tokens = getattr(req, "max_completion_tokens", None)
    engine = state.engine
    try:
        if max_tokens is None:  # as much as the context leaves
            engine.check_fits(n_prompt, 1)
            max_tokens = engine.max_seq_len - n_prompt
        else:
            engine.check_fits(n_prompt, max_tokens)
    except ContextError:
        if n_prompt == 0:
            raise APIError(400, f"{prompt_param}: the prompt is empty", param=prompt_param,
                           code="invalid_value") from None
        room = f" + max_tokens ({max_tokens})" if max_tokens is not None else ""
        raise APIError(400, f"{prompt_param}: the prompt ({n_prompt} tokens){room} does not fit the "
                            f"context of {engine.max_seq_len} tokens", param=prompt_param,
                       code="context_length_exceeded") from None
    sp = SamplingParams(max_new_tokens=max_tokens,
                        temperature=1.0 if req.temperature is None else req.temperature,
                        top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
                        seed=req.seed, stop=stop, ignore_eos=req.ignore_eos)
    try:
        return sp.validate()
    except ValueError as e:
        raise APIError(400, str(e), code="invalid_value") from None


def _chat_prompt(req, state: ServerState) -> list[int]:
    if req.logprobs:
        raise APIError(400, "logprobs are not supported", param="logprobs", code="unsupported_value")
    messages = []
    for m in req.messages:
        c = m.content
        if isinstance(c, list):
            c = "".join(p.text for p in c)
        messages.append({"role": m.role, "content": c or ""})
    try:
        return state.lm.tokenizer.encode_chat(messages)
    except ValueError as e:  # no chat template, or the template rejects the conversation
        raise APIError(400, str(e), param="messages", code="invalid_value") from None
    except Exception as e:  # a template error (jinja) on unusual input
        raise APIError(400, f"the chat template failed on these messages ({type(e).__name__}: {e})",
                       param="messages", code="invalid_value") from None


def _completion_prompt(req, state: ServerState) -> list[int]:
    for field, bad in (("echo", req.echo), ("logprobs", req.logprobs is not None),
                       ("best_of", req.best_of not in (None, 1)), ("suffix", req.suffix)):
        if bad:
            raise APIError(400, f"{field} is not supported", param=field, code="unsupported_value")
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise APIError(400, f"prompt: {len(p)} prompts given; flint serves one per request",
                           param="prompt", code="unsupported_value")
        p = p[0]
    if isinstance(p, str):
        return state.lm.tokenizer.encode(p)
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

    ChatRequest, CompletionRequest = schemas()
    app = FastAPI(title="flint", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        if request.url.path.startswith("/v1/") and e.status != 499:  # 499: logged when cancelled
            log.info("%s %s -> %d %s", request.method, request.url.path, e.status, e.message)
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e):  # 404 route, 405 method
        return JSONResponse(APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                                     code="not_found" if e.status_code == 404 else None).body(),
                            status_code=e.status_code)

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

    async def read_request(request: Request, model_cls):
        authorize(request)
        require_ready()
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                raise APIError(413, f"request body over {MAX_BODY_BYTES} bytes", code="request_too_large")
        try:
            req = model_cls.model_validate_json(bytes(body), strict=True)
        except ValidationError as e:
            raise _validation_error(e) from None
        if req.model is not None and req.model != state.model_id:
            raise APIError(404, f"model {req.model!r} does not exist; this server serves {state.model_id!r}",
                           param="model", code="model_not_found")
        return req

    @app.get("/health")
    async def health():
        if not state.ready.is_set():
            return JSONResponse(APIError(503, "the model is loading", "service_unavailable",
                                         code="model_loading").body(), status_code=503)
        s = state.scheduler
        return {"status": "ok", "model": state.model_id, "waiting": len(s.waiting),
                "running": s.running is not None, "served": s.served}

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [{"id": state.model_id, "object": "model",
                                            "created": state.created, "owned_by": "flint"}]}

    def submit(request_id: str, prompt_ids: list[int], sp) -> Job:
        job = Job(request_id, prompt_ids, sp, asyncio.get_running_loop())
        try:
            state.scheduler.submit(job)
        except QueueFull:
            raise APIError(429, f"the queue is full ({state.max_queue} waiting, the --max-queue limit); "
                                "retry later", "rate_limit_error", code="queue_full") from None
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

    def usage(r) -> dict:
        n_prompt, n_out = r.prompt_tokens, len(r.token_ids)
        return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}

    def engine_failure(e: Exception) -> APIError:
        if isinstance(e, APIError):
            return e
        if isinstance(e, ValueError):
            return APIError(400, str(e), code="invalid_value")
        return APIError(500, f"generation failed ({type(e).__name__})", "server_error")

    async def respond(request: Request, req, prompt_ids: list[int], chat: bool):
        sp = _sampling(req, state, len(prompt_ids), "messages" if chat else "prompt")
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        job = submit(rid, prompt_ids, sp)
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": state.model_id}

        def choice(text: str | None, finish: str | None) -> dict:
            if chat:
                delta = {} if text is None else {"content": text}
                return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

        if req.stream:
            with_usage = bool(req.stream_options and req.stream_options.include_usage)

            def sse(obj) -> str:
                return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

            def chunk(choices: list, **extra) -> str:
                return sse({**head, "choices": choices, **({"usage": None} if with_usage else {}), **extra})

            async def body():
                if chat:
                    yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}])
                async with aclosing(events(request, job)) as evs:
                    async for kind, value in evs:
                        if kind == "text":
                            yield chunk([choice(value, None)])
                        elif kind == "done":
                            yield chunk([choice(None if chat else "", value.finish_reason)])
                            if with_usage:
                                yield sse({**head, "choices": [], "usage": usage(value)})
                        else:  # the status line is gone already: report in the stream, then end it
                            yield sse(engine_failure(value).body())
                yield "data: [DONE]\n\n"

            return StreamingResponse(body(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        text = []
        async with aclosing(events(request, job)) as evs:
            async for kind, value in evs:
                if kind == "text":
                    text.append(value)
                elif kind == "error":
                    raise engine_failure(value)
                else:
                    r = value
        out = "".join(text)
        if chat:
            first = {"index": 0, "message": {"role": "assistant", "content": out}, "logprobs": None,
                     "finish_reason": r.finish_reason}
            obj = "chat.completion"
        else:
            first = {"index": 0, "text": out, "logprobs": None, "finish_reason": r.finish_reason}
            obj = "text_completion"
        return {**head, "object": obj, "choices": [first], "usage": usage(r)}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await read_request(request, ChatRequest)
        # tokenizing (and the chat template) off the event loop: a long prompt must not stall others
        prompt_ids = await asyncio.to_thread(_chat_prompt, req, state)
        return await respond(request, req, prompt_ids, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await read_request(request, CompletionRequest)
        prompt_ids = await asyncio.to_thread(_completion_prompt, req, state)
        return await respond(request, req, prompt_ids, chat=False)

    return app


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


def cmd_serve(args) -> int:
    import uvicorn

    from .loading import DEFAULT_MODEL

    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    log.setLevel(logging.INFO)
    if not log.handlers and not logging.getLogger().handlers:  # else the embedding app's logging rules
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(asctime)s flint serve: %(message)s", "%H:%M:%S"))
        log.addHandler(h)
        log.propagate = False
    state = ServerState(args.model or DEFAULT_MODEL, args.api_key, args.max_queue)
    sock = _bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    server = uvicorn.Server(uvicorn.Config(create_app(state), log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=3, lifespan="off"))
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
             "API key required" if args.api_key else "no API key")
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
                   help="require 'Authorization: Bearer KEY' on every /v1 route (default: $FLINT_API_KEY, "
                        "which keeps the key out of process listings)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait while one decodes; more are answered 429 (default 64)")
    p.set_defaults(func=cmd_serve)
