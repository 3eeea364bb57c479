"""The HTTP app of `flint serve` (FastAPI): the routes, the request reading every route shares (API
key, readiness, Content-Type, the body within its size and deadline, the schema), the error
handlers that answer OpenAI error objects, and Guard, the ASGI middleware in front of everything
(503 while draining, the Host / Origin check without an API key, the cap on requests in progress).

Built by flint/server/serve.py's cmd_serve; tests: ``pytest tests/test_server.py tests/test_server_guard.py
tests/test_server_ops.py``.
"""
import asyncio
import hmac
import json
import logging

from .errors import APIError, client_closed, shutdown_error
from .schemas import (chat_messages, check_fits, check_message_count, completion_input, encode_chat, encode_text,
                      options, plan_reasoning, refuse_unsupported, sampling, schemas, _tool_plan,
                      validation_error)
from .respond import respond
from .state import ServerState

log = logging.getLogger("flint.serve")

MAX_BODY_BYTES = 8 << 20  # a request body larger than this is refused (413) before parsing


def create_app(state: ServerState):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from pydantic import ValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from starlette.requests import ClientDisconnect

    ChatRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest, ResponsesRequest = schemas()
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
            raise client_closed() from None
        return bytes(body)

    def check_model(name: str | None) -> None:
        if name is not None and name != state.model_id:
            raise APIError(404, f"model {name!r} does not exist; this server serves {state.model_id!r}",
                           param="model", code="model_not_found")

    async def off_loop(fn, *args):
        # on the one admission thread: parsing, tokenizing, templates and grammars never hold the event
        # loop, and a burst of large requests takes one core, not all of them
        return await asyncio.get_running_loop().run_in_executor(state.tokenize_pool, fn, *args)

    async def read_request(request: Request, model_cls, admit=None):
        """The validated request (and ``admit(req)``'s result, when given), the work off the event loop."""
        authorize(request)
        require_ready()
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
            raise APIError(415, f"Content-Type: the body must be JSON (application/json), got "
                                f"{media or 'none'!r}", param="Content-Type", code="unsupported_media_type")
        body = await read_body(request)

        def work():
            if "messages" in model_cls.model_fields:
                check_message_count(body.count(b'"role"'))  # before building one object per message
            try:
                req = model_cls.model_validate_json(body, strict=True)
            except ValidationError as e:
                raise validation_error(e) from None
            check_model(req.model)
            if hasattr(req, "stream_options"):  # a chat or completion request
                refuse_unsupported(req, state)
            return req if admit is None else admit(req)

        return await off_loop(work)

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
        def admit(req):
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
                ids = encode_chat(chat_messages(req, state), state, req.add_generation_prompt)
                check_fits(len(ids), req, state, "messages")
            else:
                text = req.prompt if req.prompt is not None else req.content
                ids = encode_text(text, req, state, given[0], special is not False)
            # at most the context's tokens, each piece built here, off the event loop
            tokens = [{"id": t, "piece": state.token_text(t)[0]} for t in ids] if req.with_pieces else ids
            return json.dumps({"tokens": tokens, "count": len(ids), "max_model_len": state.engine.max_seq_len},
                              ensure_ascii=False).encode()

        from fastapi.responses import Response

        return Response(await read_request(request, TokenizeRequest, admit), media_type="application/json")

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        req = await read_request(request, DetokenizeRequest)
        vocab = state.lm.cfg.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"tokens: token id {bad} is outside the vocabulary (size {vocab})",
                           param="tokens", code="invalid_value")
        text = await off_loop(lambda ids: state.lm.tokenizer.decode(ids, skip_special_tokens=False), req.tokens)
        return {"prompt": text, "content": text}  # vLLM's name and llama.cpp's

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request):
        # vLLM's route (its --enable-tokenizer-info-endpoint): lm-evaluation-harness's local-completions
        # looks for it, with /tokenize, to tokenize through the server instead of loading a tokenizer itself
        authorize(request)
        require_ready()
        tok = state.lm.tokenizer
        eos = tok.eos_token or next((tok.tk.id_to_token(t) for t in tok.eos_token_ids), None)
        return {"tokenizer_class": "flint", "eos_token": eos, "bos_token": tok.bos_token, "pad_token": None,
                "chat_template": tok.chat_template, "model_max_length": state.engine.max_seq_len,
                "add_bos_token": bool(tok.add_bos)}

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

    def admit_chat(req):
        messages = chat_messages(req, state)
        plan = _tool_plan(req, state)
        ids = encode_chat(messages, state, plan=plan, template_kwargs=req.chat_template_kwargs)
        sp = sampling(req, state, len(ids), "messages", plan)
        plan_reasoning(plan, state, ids, sp)
        return req, ids, plan, sp, options(req, sp)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req, ids, plan, sp, opts = await read_request(request, ChatRequest, admit_chat)
        return await respond(state, request, req, ids, sp, chat=True, plan=plan, opts=opts)

    @app.post("/v1/responses")
    async def responses(request: Request):
        from contextlib import aclosing

        from fastapi.responses import Response, StreamingResponse

        from .responses import chat_body, events, response

        def admit(req):
            try:
                chat = ChatRequest.model_validate(chat_body(req))
            except ValidationError as e:
                raise validation_error(e) from None
            refuse_unsupported(chat, state)
            return req, admit_chat(chat)

        req, (chat, ids, plan, sp, opts) = await read_request(request, ResponsesRequest, admit)
        answer = await respond(state, request, chat, ids, sp, chat=True, plan=plan, opts=opts)
        if not req.stream:
            return Response(json.dumps(response(req, json.loads(answer.body)), ensure_ascii=False).encode(),
                            media_type="application/json")

        async def chunks():  # the chat stream's chunks, as dicts
            async with aclosing(answer.body_iterator) as body:
                async for piece in body:
                    for line in piece.split("\n"):
                        if line.startswith("data: {"):
                            yield json.loads(line[6:])

        return StreamingResponse(events(req, chunks(), state.model_id), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        authorize(request)
        raise APIError(400, "/v1/embeddings: flint serves a decoder for text generation and defines no embedding "
                            "(a causal model's hidden states are not trained as one)", param="model",
                       code="embeddings_not_supported")

    @app.post("/v1/completions")
    async def completions(request: Request):
        def admit(req):
            prompt = completion_input(req, state)
            ids = prompt if isinstance(prompt, list) else encode_text(prompt, req, state, "prompt")
            sp = sampling(req, state, len(ids), "prompt")
            echo = None
            if req.echo:  # the prompt as given, or its ids' text
                echo = prompt if isinstance(prompt, str) else state.lm.tokenizer.decode(ids, skip_special_tokens=False)
            return req, ids, sp, options(req, sp), echo

        req, ids, sp, opts, echo = await read_request(request, CompletionRequest, admit)
        return await respond(state, request, req, ids, sp, chat=False, opts=opts, echo=echo)

    return Guard(app, state)


class Guard:
    """ASGI middleware in front of every route: 503 while draining, the Host / Origin check without
    an API key (a web page can make a browser send requests to loopback, and DNS rebinding can make
    it read the answers: both carry a foreign name), and the cap on requests in progress (counted from
    the request head, so idle sockets hold nothing; /health is outside it)."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    def refusal(self, scope) -> APIError | None:
        if self.state.draining:
            return shutdown_error()
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

        counted = scope["path"] != "/health"  # the probe is answered whatever the load
        if counted and self.state.in_flight >= self.state.max_requests:
            err = APIError(503, f"the server is answering {self.state.max_requests} requests already (the "
                                "--max-requests limit); retry later", "server_error", code="too_many_requests",
                           headers={"Retry-After": "1"})
            self.state.metrics.requests.labels(self.state.metrics.route(scope["path"]), "503").inc()
            return await JSONResponse(err.body(), status_code=503, headers=err.headers)(scope, receive, send)
        self.state.in_flight += counted
        try:
            await self.app(scope, receive, send_seen)
        finally:
            self.state.in_flight -= counted
            if status:  # else the client left before any answer
                self.state.metrics.requests.labels(self.state.metrics.route(scope["path"]), str(status[0])).inc()
