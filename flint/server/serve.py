"""`flint serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) on the batch-1 engine.

    flint serve [--model M] [--backend B] [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--max-queue N]

Routes: GET|HEAD /health (503 while the model loads, 200 after), GET /v1/models[/{id}], POST /v1/completions,
POST /v1/chat/completions (SSE streaming with ``stream``; ``stream_options.include_usage``; logprobs as
OpenAI shapes them; ``n`` choices one after the other; llama.cpp's ``timings`` in each answer), POST
/v1/responses (text and function tools, through the chat path), POST /v1/embeddings (refused: no embedding
is defined), GET /metrics (Prometheus), POST /tokenize and /detokenize (vLLM's and llama.cpp's field
names), GET /tokenizer_info (vLLM's: what lm-evaluation-harness's remote tokenizer reads). Structured output (``response_format``, vLLM's ``structured_outputs``, llama.cpp's ``grammar``)
compiles to a flint.grammar constraint the engine applies each step; ``tools`` / ``tool_choice`` go
through flint.server.tools (rendered by the chat template, the output parsed into ``tool_calls``, a forced call
constrained to the function's schema).
The engine decodes one sequence at a time: requests wait in a FIFO (``--max-queue`` waiting
requests at most, 429 beyond) and one worker thread owns the engine; a client that goes away
cancels its generation at the next token (or the next prefill chunk). Every error is an OpenAI
error object; a request field flint cannot honour is a 400 naming it, never ignored.

Admission comes before work: the body size, the message count, the prompt's length against the context
(a text of n characters is at least n / longest-token tokens, a message at least its template's tokens)
and max_tokens are checked before tokenizing; parsing, templates, tokenizing and grammars (their first
steps run) happen on one admission thread, off the event loop. Without an API key only loopback Host
names are served (--allow-host adds others), which keeps web pages (DNS rebinding) out; POST bodies must
be JSON; request heads and bodies have deadlines and requests in progress a cap (idle sockets do not
count). SIGTERM drains: running and queued requests finish (up to --drain-timeout), new ones get 503.
One log line per request (id, prompt/completion tokens, queue wait, TTFT, decode tok/s). Usage:
docs/serve.md.

This file is the command: its flags, the listening socket, uvicorn with the request-head deadline
and the draining shutdown. The parts, one file each in flint/server/:
    app.py        the FastAPI routes, request reading, error handlers, the Guard middleware
    schemas.py    request schemas, validation into SamplingParams, prompts, tool plans
    errors.py     the OpenAI error object every failure is answered with
    respond.py    a request's job and its answer: JSON or SSE, logprobs, tool calls, timings
    responses.py  the Responses API as a chat request and its answer as a response object
    queue.py      the FIFO and the one engine thread
    state.py      the model, engine, queue, metrics and settings of one server
    metrics.py    the Prometheus metrics
    tools.py      tool calling: chat-template rendering, call formats, parsing, forced-call grammars

Tests: ``pytest tests/test_server.py tests/test_server_guard.py tests/test_server_ops.py
tests/test_server_compat.py tests/test_structured.py tests/test_tools.py``.

Heavy imports (fastapi, pydantic, uvicorn, torch) happen inside functions: `flint` imports this
module to build its parser, and other subcommands should not pay for them.
"""
from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .state import ServerState

log = logging.getLogger("flint.serve")


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

    from ..loading import DEFAULT_MODEL
    from .app import create_app
    from .state import ServerState

    for name in ("max_queue", "default_max_tokens", "max_tokens_limit", "max_requests"):
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
                        args.max_tokens_limit, allow, args.body_timeout, args.max_requests, args.tool_call_parser,
                        args.reasoning_parser)
    sock = _bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    # no uvicorn limit_concurrency: it counts sockets before any byte arrives, so idle connections could
    # lock every client out; the Guard middleware caps requests in progress instead, and the head
    # deadline closes a socket that sends nothing
    config = uvicorn.Config(create_app(state), log_level="warning", access_log=False, timeout_graceful_shutdown=3,
                            lifespan="off", http=_protocol(args.header_timeout), timeout_keep_alive=5)
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
    from ..options import add_model_args

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
    from .reasoning import PARSER_CHOICES as REASONING_CHOICES
    from .tools import PARSER_CHOICES as TOOL_CHOICES

    p.add_argument("--tool-call-parser", choices=TOOL_CHOICES, default="auto",
                   help="the format of the model's tool calls (vLLM's names; default: read from the chat template)")
    p.add_argument("--reasoning-parser", choices=REASONING_CHOICES, default="auto",
                   help="split a <think>...</think> block off into reasoning_content (qwen3 and deepseek_r1 both "
                        "do; default: when the chat template writes one; none: never)")
    for flag, kind, default, text in (
            ("--default-max-tokens", int, 1024, "max_tokens of a request that gives none (less if the context has "
                                                "less room)"),
            ("--max-tokens-limit", int, 4096, "the largest max_tokens a request may ask for; more is a 400"),
            ("--max-requests", int, 256, "requests in progress at once (/health not counted); one more gets 503"),
            ("--header-timeout", float, 10.0, "seconds a connection may take to send a request head"),
            ("--body-timeout", float, 30.0, "seconds a request may take to send its body; later is a 408"),
            ("--drain-timeout", float, 30.0, "on SIGTERM, seconds the requests in flight may take to finish")):
        p.add_argument(flag, type=kind, default=default, metavar="N" if kind is int else "SECONDS",
                       help=f"{text} (default {default:g})")
    p.set_defaults(func=cmd_serve)
