"""Tool calls for `flint serve`: OpenAI's ``tools`` into the prompt, the model's tool-call text out as
``tool_calls``, and the grammar that forces a call.

Each family writes its calls its own way; the format is read from the chat template (``--tool-call-parser``
names one instead, with vLLM's names):

* ``hermes`` (Qwen2.5, Qwen3, Granite 4): ``<tool_call>\n{"name", "arguments"}\n</tool_call>``, one block a
  call; the template renders tools into the system prompt and results as ``<tool_response>`` blocks;
* ``llama3_json`` (Llama 3.1+): a bare ``{"name", "parameters"}`` object, optionally after ``<|python_tag|>``,
  several separated by ``;``; results go back as the template's ``ipython`` turn;
* ``mistral``: ``[TOOL_CALLS] [{"name", "arguments"}, ...]`` (v0.3 to Small 3.1), or ``[TOOL_CALLS]NAME[ARGS]{...}``
  per call (later releases; parsed, while a forced call is written the first way); call ids of 9 letters
  and digits (the templates check them);
* ``granite`` (Granite 3): ``<|tool_call|>[{"name", "arguments"}, ...]``.

A template that renders tools gets them as transformers' ``apply_chat_template(messages, tools=...)`` passes
them: the OpenAI tool objects as they are, assistant ``tool_calls`` with their arguments as a mapping,
``role: "tool"`` messages unchanged. A template without tools (SmolLM2's ChatML) gets them from flint as a
system message asking for the chosen format (Hermes unless named), and earlier calls as that text.

``parse`` turns a finished output into (content, calls); ``ToolStream`` does it piece by piece for SSE
(text that may begin a call marker is held back; each call is emitted when complete); text that is no
valid call stays content, as vLLM's parsers leave it. ``call_grammar`` is the Lark grammar (llguidance,
flint.grammar) that makes the output one call (or several, with parallel_tool_calls) in the format, its
arguments valid for the function's JSON schema: used when tool_choice is "required" or names a function.
Tests: ``pytest tests/test_tools.py tests/test_tool_formats.py``.
"""
from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import dataclass, replace

from ..engine import holdback
from ..grammar import JSON_OPTIONS, GrammarError


@dataclass(frozen=True)
class ToolFormat:
    name: str
    begin: str | None  # the text before a call (None: the output is the call's JSON itself)
    end: str | None  # the text after one (None: none)
    args_key: str  # "arguments" or "parameters"
    parallel: bool  # several calls in one turn
    listed: bool = False  # the calls are one JSON array after `begin`
    native: bool = True  # the chat template renders the tools itself
    short_ids: bool = False  # call ids of 9 letters and digits (Mistral's templates refuse others)


NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # a function without any

HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>", "arguments", True)
GRANITE3 = ToolFormat("granite", "<|tool_call|>", None, "arguments", True, listed=True)
LLAMA3 = ToolFormat("llama3_json", None, None, "parameters", False)
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", None, "arguments", True, listed=True, short_ids=True)
FALLBACK = ToolFormat("hermes", "<tool_call>", "</tool_call>", "arguments", True, native=False)
PARSERS = {f.name: f for f in (HERMES, LLAMA3, MISTRAL, GRANITE3)}  # --tool-call-parser's names (vLLM's)
PARSER_CHOICES = ("auto", *PARSERS)
SEPARATOR = ";"  # between the bare calls of llama3_json
PYTHON_TAG = "<|python_tag|>"  # what may open llama3_json's calls
MISTRAL_ARGS = "[ARGS]"  # between a call's name and its arguments in Mistral's later format


def detect_format(template: str | None, parser: str = "auto") -> ToolFormat:
    """The tool-call format of a chat template, or the one ``parser`` names; a template that does not render
    tools gets them from flint (``native`` false: FALLBACK unless a parser is named)."""
    if parser != "auto" and parser not in PARSERS:
        raise ValueError(f"unknown tool-call parser {parser!r}; use one of {', '.join(PARSER_CHOICES)}")
    native = bool(template) and "tools" in template
    if parser != "auto":
        return PARSERS[parser] if native else replace(PARSERS[parser], native=False)
    if not native:
        return FALLBACK
    for marker, fmt in (("[TOOL_CALLS]", MISTRAL), ("<|tool_call|>", GRANITE3), ("<tool_call>", HERMES),
                        ("<|python_tag|>", LLAMA3), ("ipython", LLAMA3)):
        if marker in template:
            return fmt
    return FALLBACK


def _call_text(fmt: ToolFormat, calls: list[dict]) -> str:
    """Assistant tool calls as the model would have written them (for a template without tools)."""
    objs = [{"name": c["name"], fmt.args_key: c["arguments"]} for c in calls]
    if fmt.listed:
        return f"{fmt.begin} {json.dumps(objs, ensure_ascii=False)}"
    if fmt.begin is None:
        return f"{SEPARATOR} ".join(json.dumps(o, ensure_ascii=False) for o in objs)
    return "\n".join(f"{fmt.begin}\n{json.dumps(o, ensure_ascii=False)}\n{fmt.end}" for o in objs)


def system_prompt(tools: list[dict], fmt: ToolFormat = FALLBACK) -> str:
    lines = ["You can call these functions (JSON schemas of their arguments):"]
    lines += [json.dumps(t["function"], ensure_ascii=False) for t in tools]
    example = _call_text(fmt, [{"name": "NAME", "arguments": {"ARGUMENT": "VALUE"}}])
    several = ("one such block per call" if fmt.end else "several calls in the one list" if fmt.listed
               else "several calls separated by ';'" if fmt.parallel else "one call at a time")
    lines.append(f"To call one, answer with {example} and nothing else; {several}. Otherwise answer normally.")
    return "\n".join(lines)


def _short_id(call_id: str) -> str:
    """A call id as Mistral's templates take it (9 letters and digits): kept when it is one, else derived."""
    if re.fullmatch(r"[A-Za-z0-9]{9}", call_id):
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


def render(messages: list[dict], tools: list[dict] | None, fmt: ToolFormat) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) for the chat template. ``messages`` may hold assistant ``tool_calls`` (OpenAI's
    shape, arguments a JSON string) and ``tool`` messages."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if fmt.short_ids and m.get("tool_call_id") is not None:
            m["tool_call_id"] = _short_id(m["tool_call_id"])
        if calls:
            parsed = [{"id": _short_id(c["id"]) if fmt.short_ids else c["id"], "name": c["function"]["name"],
                       "arguments": json.loads(c["function"]["arguments"])} for c in calls]
            if fmt.native:  # HF's convention: arguments as a mapping, under "function"
                m["tool_calls"] = [{"id": c["id"], "type": "function",
                                    "function": {"name": c["name"], "arguments": c["arguments"]}} for c in parsed]
            else:
                m["content"] = ((m.get("content") or "") + "\n" + _call_text(fmt, parsed)).lstrip("\n")
        out.append(m)
    if not tools:
        return out, None
    if fmt.native:
        return out, tools
    text = system_prompt(tools, fmt)
    if out and out[0]["role"] == "system":
        out[0] = dict(out[0], content=out[0]["content"] + "\n\n" + text)
    else:
        out.insert(0, {"role": "system", "content": text})
    return out, None


def _new_call(name: str, args, fmt: ToolFormat) -> dict:
    call_id = uuid.uuid4().hex[:9] if fmt.short_ids else "call_" + uuid.uuid4().hex[:24]
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def _as_call(obj, fmt: ToolFormat) -> dict | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(fmt.args_key, obj.get("arguments", obj.get("parameters", {})))
    if not isinstance(args, dict):
        return None
    return _new_call(obj["name"], args, fmt)


def _json_values(text: str) -> list | None:
    """The JSON values of ``a; b; c`` (llama3_json's several calls), or None when it is not that."""
    dec, out, at = json.JSONDecoder(), [], 0
    while True:
        try:
            value, at = dec.raw_decode(text, at)
        except ValueError:
            return None
        out.append(value)
        rest = text[at:].lstrip()
        if not rest:
            return out
        if not rest.startswith(SEPARATOR):
            return None
        at = len(text) - len(rest) + 1
        at += len(text[at:]) - len(text[at:].lstrip())


def _named_args(body: str, fmt: ToolFormat) -> list[dict] | None:
    """The calls of Mistral's later templates, ``NAME[ARGS]{...}`` after each [TOOL_CALLS], as call objects."""
    objs = []
    for part in body.split(fmt.begin):
        name, sep, args = part.strip().partition(MISTRAL_ARGS)
        if not sep or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
            return None
        try:
            objs.append({"name": name, fmt.args_key: json.loads(args)})
        except ValueError:
            return None
    return objs


def _parse_body(body: str, fmt: ToolFormat) -> list[dict] | None:
    """The calls in one marker's body, or None when it is not valid call JSON."""
    if fmt.begin is None:
        objs = _json_values(body)
        if objs is None:
            return None
    else:
        try:
            obj = json.loads(body)
        except ValueError:
            objs = _named_args(body, fmt) if fmt.short_ids else None
            if objs is None:
                return None
        else:
            objs = obj if isinstance(obj, list) and fmt.listed else [obj]
    calls = [_as_call(o, fmt) for o in objs]
    return calls if calls and all(calls) else None


def collect(events: list) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a whole output's events; content None when there are calls and no other text."""
    content = "".join(v for k, v in events if k == "content")
    calls = [v for k, v in events if k == "call"]
    return ((content.strip() or None), calls) if calls else (content, [])


def parse(text: str, fmt: ToolFormat) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a finished output; text that is no valid call stays content."""
    s = ToolStream(fmt)
    return collect(s.feed(text) + s.finish())


class ToolStream:
    """Incremental parse: ``feed(piece)`` and ``finish()`` return events ("content", text) and
    ("call", tool_call), in output order."""

    def __init__(self, fmt: ToolFormat):
        self.fmt = fmt
        self.buf = ""
        self.in_call = False
        self.started = False  # any non-space text seen (a bare-JSON format decides on its first one)
        self.calls = 0
        self.space = ""  # whitespace after a call: dropped if another call follows, else content

    def feed(self, piece: str) -> list:
        return self._between(self._feed(piece))

    def _between(self, events: list) -> list:
        """Whitespace at the end of the text so far waits for what follows: dropped before and between calls
        (the newlines around Hermes blocks are no content), content before more text."""
        out = []
        for kind, v in events:
            if kind == "content":
                v, self.space = self.space + v, ""
                body = v.rstrip()
                self.space = v[len(body):]
                if body:
                    out.append((kind, body))
            else:
                self.space = ""
                out.append((kind, v))
        return out

    def _feed(self, piece: str) -> list:
        self.buf += piece
        fmt, out = self.fmt, []
        if fmt.begin is None:  # the whole output is the call, or it is content
            head = self.buf.lstrip()
            if not self.started and head and not (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
                self.started = True
                self.in_call = head.startswith(("{", PYTHON_TAG))
            if self.started and not self.in_call:
                out.append(("content", self.buf))
                self.buf = ""
            return out
        while True:
            if not self.in_call:
                at = self.buf.find(fmt.begin)
                if at < 0:
                    keep = holdback(self.buf, [fmt.begin])
                    if len(self.buf) > keep:
                        out.append(("content", self.buf[:len(self.buf) - keep]))
                        self.buf = self.buf[len(self.buf) - keep:]
                    return out
                if at:
                    out.append(("content", self.buf[:at]))
                self.buf = self.buf[at + len(fmt.begin):]
                self.in_call = True
            if fmt.end is None:  # a listed format: the array runs to the end of the output
                return out
            at = self.buf.find(fmt.end)
            if at < 0:
                return out
            body, self.buf = self.buf[:at], self.buf[at + len(fmt.end):]
            out += self._calls(body)
            self.in_call = False

    def _calls(self, body: str, closed: bool = True) -> list:
        """The calls in a marker's body (``closed``: its end marker was seen), or the text back as content."""
        fmt = self.fmt
        text = body.strip()
        if fmt.begin is None and text.startswith(PYTHON_TAG):
            text = text[len(PYTHON_TAG):]
        calls = _parse_body(text, fmt)
        if calls is None:  # not a call after all: give the text back as content
            if fmt.begin is None:
                return [("content", body)]
            return [("content", fmt.begin + body + ((fmt.end or "") if closed else ""))]
        self.calls += len(calls)
        return [("call", c) for c in calls]

    def finish(self) -> list:
        out = self._between(self._finish())
        if self.space and not self.calls:  # an output without calls keeps its text as it is
            out.append(("content", self.space))
        self.space = ""
        return out

    def _finish(self) -> list:
        if self.in_call or (self.fmt.begin is None and self.buf):
            body, self.buf, self.in_call = self.buf, "", False
            return self._calls(body, closed=False)
        out = [("content", self.buf)] if self.buf else []
        self.buf = ""
        return out


def _call_schema(tool: dict, fmt: ToolFormat) -> dict:
    f = tool["function"]
    params = f.get("parameters") or NO_PARAMETERS
    return {"type": "object", "properties": {"name": {"const": f["name"]}, fmt.args_key: params},
            "required": ["name", fmt.args_key], "additionalProperties": False}


def _calls_rule(grammars, fmt: ToolFormat, tools: list[dict], many: bool) -> str:
    """Lark rules whose ``calls`` is one call (several when ``many``) of one of ``tools``."""
    schemas = [_call_schema(t, fmt) for t in tools]
    one = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    one = dict(one, **{"x-guidance": JSON_OPTIONS})
    if fmt.listed:
        arr = {"type": "array", "items": one, "minItems": 1, **({} if many else {"maxItems": 1}),
               "x-guidance": JSON_OPTIONS}
        return f"calls: {grammars.literal(fmt.begin)} %json {json.dumps(arr)}"
    if fmt.begin is None:
        return f"calls: %json {json.dumps(one)}"
    call = f'{grammars.literal(fmt.begin)} "\\n" %json {json.dumps(one)} "\\n" {grammars.literal(fmt.end)}'
    return f'calls: call ("\\n" call)*\ncall: {call}' if many else f"calls: {call}"


def _compile(grammars, lark: str, tools: list[dict], param: str):
    for i, t in enumerate(tools):  # each schema alone first, so an error names its tool
        grammars.json_schema(t["function"].get("parameters") or NO_PARAMETERS, f"tools.{i}.function.parameters")
    try:
        return grammars.lark(lark, param)
    except GrammarError as e:
        raise GrammarError(f"{param}: the tools' call grammar cannot be compiled ({e})", param) from None


# a reasoning block the output opens before the calls or text (flint.server.reasoning): one closing tag, then the
# whitespace up to the answer; one lexeme, so that the answer's first byte ends it
THINK_RULE = r"THINK: /<think>(.|\n)*<\/think>[ \t\n]*/ & ~/(.|\n)*<\/think>(.|\n)*<\/think>(.|\n)*/"


def call_grammar(grammars, fmt: ToolFormat, tools: list[dict], parallel: bool, param: str = "tool_choice",
                 think: bool = False):
    """The Constraint that makes the output a call of one of ``tools`` (several when ``parallel`` and the format
    allows them), each tool's schema checked first; ``think``: a reasoning block may come first."""
    rules = _calls_rule(grammars, fmt, tools, parallel and fmt.parallel)
    start = f"start: THINK? calls\n{THINK_RULE}\n" if think else "start: calls\n"
    return _compile(grammars, start + rules, tools, param)


_REGEX_META = set("\\.+*?()|[]{}^$&~")


def auto_grammar(grammars, fmt: ToolFormat, tools: list[dict], parallel: bool, param: str = "tools",
                 think: bool = False):
    """tool_choice auto with strict tools: the output is either text with no call in it, or calls whose arguments
    are valid for their schemas (text before a call is not allowed under this grammar); ``think``: a reasoning
    block may come first (the text then does not open another)."""
    if fmt.begin is None:  # a bare-JSON format: text is anything that does not open an object
        text = r"/[^{ \t\n](.|\n)*/"
    elif grammars.literal(fmt.begin).startswith("<["):  # a special token: text can never produce it
        text = r"/(.|\n)+/"
    else:
        marker = "".join("\\" + c if c in _REGEX_META else c for c in fmt.begin)
        text = rf"/(.|\n)+/ & ~/(.|\n)*{marker}(.|\n)*/"
    if think:
        text += r" & ~/(.|\n)*<\/think>(.|\n)*/"
    rules = _calls_rule(grammars, fmt, tools, parallel and fmt.parallel)
    start = f"start: THINK? (TEXT | calls)\n{THINK_RULE}\n" if think else "start: TEXT | calls\n"
    return _compile(grammars, f"{start}TEXT: {text}\n" + rules, tools, param)


def check_tools(tools: list[dict]) -> None:
    """Names unique and function-like (OpenAI: a-z, A-Z, 0-9, _ and -, at most 64)."""
    seen = set()
    for i, t in enumerate(tools):
        name = t["function"]["name"]
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
            raise GrammarError(f"tools.{i}.function.name: {name[:80]!r} is not a function name "
                               "(a-z, A-Z, 0-9, _ and -, at most 64)", f"tools.{i}.function.name")
        if name in seen:
            raise GrammarError(f"tools.{i}.function.name: {name!r} is defined twice", f"tools.{i}.function.name")
        seen.add(name)
