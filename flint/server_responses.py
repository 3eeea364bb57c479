"""OpenAI's Responses API on `flint serve` (POST /v1/responses, the OpenAI Agents SDK's default transport),
for text and function tools: the request's ``input`` items (messages, earlier ``function_call`` items and
their ``function_call_output``), ``instructions``, ``tools``, ``tool_choice`` and ``text.format`` become a
chat completion request, run as one; its answer becomes a ``response`` object whose ``output`` holds a
``message`` item and ``function_call`` items. Nothing is stored (``store`` true and ``previous_response_id``
are refused), streaming is refused, and so is any item or tool that is not text or a function.

Used by flint/server_app.py; tests: ``pytest tests/test_server_compat.py``.
"""
import time
import uuid

from .server_errors import APIError

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
    if req.stream:
        _refuse("stream", "streaming is not supported on /v1/responses (use /v1/chat/completions to stream)")
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


def response(req, chat: dict) -> dict:
    """A response object from the chat completion answer ``chat``."""
    choice = chat["choices"][0]
    message, output = choice["message"], []
    if message.get("content"):
        output.append({"type": "message", "id": "msg_" + uuid.uuid4().hex[:24], "status": "completed",
                       "role": "assistant",
                       "content": [{"type": "output_text", "text": message["content"], "annotations": []}]})
    for call in message.get("tool_calls") or []:
        output.append({"type": "function_call", "id": "fc_" + uuid.uuid4().hex[:24], "call_id": call["id"],
                       "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                       "status": "completed"})
    u = chat["usage"]
    cut = choice["finish_reason"] == "length"
    return {"id": "resp_" + uuid.uuid4().hex[:24], "object": "response", "created_at": int(time.time()),
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
