"""OpenAI's Responses API on `flint serve` (POST /v1/responses, the OpenAI Agents SDK's default transport),
for text and function tools: the request's ``input`` items (messages, earlier ``function_call`` items and
their ``function_call_output``), ``instructions``, ``tools``, ``tool_choice`` and ``text.format`` become a
chat completion request, run as one; its answer becomes a ``response`` object whose ``output`` holds a
``message`` item and ``function_call`` items. Nothing is stored (``store`` true and ``previous_response_id``
are refused), and so is any item or tool that is not text or a function; ``stream`` turns the chat stream into
the Responses API's events.

Used by flint/server/app.py; tests: ``pytest tests/test_server_compat.py``.
"""
import json
import time
import uuid

from .errors import APIError

ROLES = ("user", "system", "developer", "assistant")


def _refuse(param: str, message: str, code: str = "unsupported_value"):
    raise APIError(400, f"{param}: {message}", param=param, code=code)


def _text(content, param: str) -> str:
    """A message's content: a string, or parts of type input_text / output_text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        _refuse(param, "give a string or a list of text parts", "invalid_value")
    out = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text") \
                or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            _refuse(f"{param}.{j}", f"{kind!r} parts are not supported (text only: input_text, output_text)")
        out.append(part["text"])
    return "".join(out)


def _messages(req) -> list[dict]:
    """The chat messages of a Responses request's instructions and input."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    for i, item in enumerate(items):
        where = f"input.{i}"
        if not isinstance(item, dict):
            _refuse(where, "an input item must be an object", "invalid_value")
        kind = item.get("type", "message")
        if kind == "message":
            if item.get("role") not in ROLES:
                _refuse(f"{where}.role", f"{str(item.get('role'))[:40]!r} is not a role; use one of {', '.join(ROLES)}",
                        "invalid_value")
            messages.append({"role": item["role"], "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    _refuse(f"{where}.{key}", "a string is required", "invalid_value")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str):
                _refuse(f"{where}.call_id", "a string is required", "invalid_value")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(output, f"{where}.output")})
        else:
            _refuse(f"{where}.type", f"{str(kind)[:40]!r} items are not supported (message, function_call, "
                                     "function_call_output)")
    if not messages:
        _refuse("input", "no messages", "invalid_value")
    return messages


def _tools(req) -> dict:
    out = {}
    if req.tools:
        tools = []
        for i, t in enumerate(req.tools):
            if t.get("type") != "function":
                _refuse(f"tools.{i}.type", f"{str(t.get('type'))[:40]!r} tools are not supported (function only)")
            tools.append({"type": "function", "function": {k: v for k, v in t.items() if k != "type"}})
        out["tools"] = tools
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            _refuse("tool_choice", "give auto, none, required or {\"type\": \"function\", \"name\": NAME}",
                    "invalid_value")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        out["tool_choice"] = choice
    return out


def chat_body(req) -> dict:
    """The chat completion request that answers a validated Responses request."""
    if req.store:
        _refuse("store", "flint stores no responses (store: false)")
    if req.previous_response_id is not None:
        _refuse("previous_response_id", "flint stores no responses: send the whole conversation in input")
    if req.include:
        _refuse("include", "no extra output data is available")
    if req.reasoning is not None:
        _refuse("reasoning", "not supported")
    if req.truncation not in (None, "disabled"):
        _refuse("truncation", "only disabled (a prompt that does not fit the context is a 400)")
    body = {"model": req.model, "messages": _messages(req), **_tools(req)}
    if req.stream:
        body.update(stream=True, stream_options={"include_usage": True})
    for src, dst in (("temperature", "temperature"), ("top_p", "top_p"), ("max_output_tokens", "max_tokens"),
                     ("parallel_tool_calls", "parallel_tool_calls"), ("user", "user"), ("metadata", "metadata")):
        if getattr(req, src) is not None:
            body[dst] = getattr(req, src)
    fmt = (req.text or {}).get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            _refuse("text.format", "give type text, json_object or json_schema", "invalid_value")
        if fmt["type"] == "json_schema":
            spec = {k: fmt[k] for k in ("name", "schema", "description", "strict") if k in fmt}
            body["response_format"] = {"type": "json_schema", "json_schema": spec}
        else:
            body["response_format"] = {"type": fmt["type"]}
    return body


def _message_item(text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": "msg_" + uuid.uuid4().hex[:24], "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []}


def _call_item(call: dict) -> dict:
    return {"type": "function_call", "id": "fc_" + uuid.uuid4().hex[:24], "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}


def response(req, chat: dict, output: list | None = None, rid: str | None = None) -> dict:
    """A response object from the chat completion answer ``chat`` (its ``output`` items, when built already)."""
    choice = chat["choices"][0]
    if output is None:
        message = choice["message"]
        output = [_message_item(message["content"])] if message.get("content") else []
        output += [_call_item(c) for c in message.get("tool_calls") or []]
    u = chat["usage"]
    cut = choice["finish_reason"] == "length"
    return {"id": rid or "resp_" + uuid.uuid4().hex[:24], "object": "response", "created_at": int(time.time()),
            "status": "incomplete" if cut else "completed", "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "model": chat["model"], "output": output, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": req.temperature, "top_p": req.top_p, "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [], "text": req.text or {"format": {"type": "text"}}, "truncation": "disabled",
            "previous_response_id": None, "reasoning": None, "store": False,
            "usage": {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
                      "total_tokens": u["total_tokens"],
                      "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
                      "output_tokens_details": {"reasoning_tokens": 0}},
            "timings": chat.get("timings")}


async def events(req, chunks, model: str):
    """The Responses API's SSE events (``event: TYPE`` and its data) from the chat stream's chunks (dicts):
    response.created; per text message output_item.added, content_part.added, output_text.delta...,
    output_text.done, content_part.done, output_item.done; per call output_item.added,
    function_call_arguments.delta and .done, output_item.done; then response.completed (or incomplete), or
    an error event."""
    rid, seq, output = "resp_" + uuid.uuid4().hex[:24], [0], []
    message, text = [None], []  # the open message item (None: none) and its text so far
    finish = None

    def sse(kind: str, **data) -> str:
        seq[0] += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq[0] - 1, **data})}\n\n"

    def close_message() -> list[str]:
        item = message[0]
        if item is None:
            return []
        message[0] = None
        done = "".join(text)
        text.clear()
        at, part = output.index(item), {"type": "output_text", "text": done, "annotations": []}
        item.update(status="completed", content=[part])
        ids = {"item_id": item["id"], "output_index": at, "content_index": 0}
        return [sse("response.output_text.done", **ids, text=done, logprobs=[]),
                sse("response.content_part.done", **ids, part=part),
                sse("response.output_item.done", output_index=at, item=item)]

    skeleton = {"id": rid, "object": "response", "created_at": int(time.time()), "status": "in_progress",
                "model": model, "output": [], "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
                "parallel_tool_calls": req.parallel_tool_calls is not False}
    yield sse("response.created", response=skeleton)
    async for chunk in chunks:
        if "error" in chunk:
            for e in close_message():
                yield e
            yield sse("error", **{k: chunk["error"][k] for k in ("message", "code", "param")})
            return
        if not chunk["choices"]:  # the usage chunk: the end
            chat = {"model": model, "usage": chunk["usage"], "timings": None,
                    "choices": [{"finish_reason": finish, "message": {}}]}
            done = response(req, chat, output, rid)
            yield sse("response.incomplete" if done["status"] == "incomplete" else "response.completed",
                      response=done)
            return
        choice = chunk["choices"][0]
        delta = choice.get("delta") or {}
        if delta.get("content"):
            if message[0] is None:
                message[0] = _message_item("", "in_progress")
                output.append(message[0])
                at = len(output) - 1
                yield sse("response.output_item.added", output_index=at, item=dict(message[0]))
                yield sse("response.content_part.added", item_id=message[0]["id"], output_index=at, content_index=0,
                          part={"type": "output_text", "text": "", "annotations": []})
            text.append(delta["content"])
            yield sse("response.output_text.delta", item_id=message[0]["id"], output_index=output.index(message[0]),
                      content_index=0, delta=delta["content"], logprobs=[])
        for call in delta.get("tool_calls") or []:
            for e in close_message():
                yield e
            item = _call_item(call)
            output.append(item)
            at = len(output) - 1
            yield sse("response.output_item.added", output_index=at, item={**item, "arguments": "",
                                                                            "status": "in_progress"})
            yield sse("response.function_call_arguments.delta", item_id=item["id"], output_index=at,
                      delta=item["arguments"])
            yield sse("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                      name=item["name"], arguments=item["arguments"])
            yield sse("response.output_item.done", output_index=at, item=item)
        if choice.get("finish_reason"):
            finish = choice["finish_reason"]
            for e in close_message():
                yield e
