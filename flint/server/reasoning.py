"""Reasoning for `flint serve`: a thinking model's ``<think>...</think>`` block (Qwen3, QwQ, DeepSeek-R1
distills) goes to the message's ``reasoning_content`` (and to ``delta.reasoning_content`` when streamed), the
text after it to ``content``, where the tool-call parser (flint.server.tools) reads it.

A template that writes ``<think>`` and ``</think>`` turns the split on (``--reasoning-parser none`` turns it
off; ``qwen3`` or ``deepseek_r1``, vLLM's names, turn it on for any template). The block counts only at the
start of the output, or from the first token when the rendered prompt itself ends by opening one (templates
that make the model think, DeepSeek-R1's, Qwen3's thinking-only releases). An output that opens the block and
never closes it (cut by max_tokens) is all reasoning. Under a grammar only a block the output itself opens
counts: the tools' grammars (flint.server.tools) allow one before the calls, the others (response_format,
structured_outputs) shape the output from its first token.
``chat_template_kwargs: {"enable_thinking": false}`` reaches Qwen3's template, which then closes an empty
block in the prompt, and the output is all content.

``Reply`` feeds the reasoning split and then the tool parser piece by piece; ``split`` does it for a whole
output. Tests: ``pytest tests/test_tool_formats.py``.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..engine import holdback
from .tools import ToolStream, collect

OPEN, CLOSE = "<think>", "</think>"
PARSER_CHOICES = ("auto", "none", "qwen3", "deepseek_r1")


def enabled(template: str | None, parser: str = "auto") -> bool:
    """Whether outputs are split into reasoning and content, for this template and --reasoning-parser."""
    if parser not in PARSER_CHOICES:
        raise ValueError(f"unknown reasoning parser {parser!r}; use one of {', '.join(PARSER_CHOICES)}")
    if parser != "auto":
        return parser != "none"
    return bool(template) and OPEN in template and CLOSE in template


def opened_by(prompt_tail: str) -> bool:
    """Whether a rendered prompt ending with ``prompt_tail`` leaves the model inside a reasoning block."""
    tail = prompt_tail.rstrip()
    return tail.endswith(OPEN)


class ThinkStream:
    """Piece by piece: ``feed`` and ``finish`` return ("reasoning", text) and ("content", text) events. The
    whitespace around the reasoning and before the content is dropped (the newlines the templates put
    there), so the pieces add up to what ``split`` gives."""

    def __init__(self, inside: bool = False):
        self.inside = inside  # the prompt opened the block (the output may still open it again)
        self.state = "start"
        self.buf = ""
        self.lead = True  # at the start of the current part: its leading whitespace is dropped
        self.space = ""  # whitespace at the end of the reasoning seen so far (dropped if the block closes)

    def feed(self, piece: str) -> list:
        self.buf += piece
        out = []
        if self.state == "start":
            head = self.buf.lstrip()
            if not head or (OPEN.startswith(head) and head != OPEN):
                return out  # not decided yet
            if head.startswith(OPEN):
                self.state, self.buf = "reasoning", head[len(OPEN):]
            elif self.inside:
                self.state = "reasoning"
            else:
                self.state, self.lead = "content", False  # no block: the output is content as it is
        if self.state == "reasoning":
            at = self.buf.find(CLOSE)
            if at < 0:
                keep = holdback(self.buf, [CLOSE])
                self._reason(self.buf[:len(self.buf) - keep], out)
                self.buf = self.buf[len(self.buf) - keep:]
                return out
            self._reason(self.buf[:at], out)
            self.state, self.buf, self.lead, self.space = "content", self.buf[at + len(CLOSE):], True, ""
        text, self.buf = self.buf, ""
        if self.lead:
            text = text.lstrip()
            self.lead = not text
        if text:
            out.append(("content", text))
        return out

    def _reason(self, text: str, out: list) -> None:
        if self.lead:
            text = text.lstrip()
            self.lead = not text
        body = text.rstrip()
        if body:
            out.append(("reasoning", self.space + body))
            self.space = ""
        self.space += text[len(body):]

    def finish(self) -> list:
        out = []
        if self.state == "start" and self.buf and not self.inside:
            out.append(("content", self.buf))
        elif self.state in ("start", "reasoning"):
            self._reason(self.buf, out)
        self.buf = ""
        return out


@dataclass
class Reply:
    """The chat output's events, piece by piece: ("reasoning", text), ("content", text), ("call", tool_call).
    ``think``: the reasoning split (None: off; True when the prompt opened the block); ``fmt``: the tool-call
    format to parse the content with (None: none)."""
    think: bool | None
    fmt: object | None

    def __post_init__(self):
        self.thinking = ThinkStream(self.think) if self.think is not None else None
        self.tools = ToolStream(self.fmt) if self.fmt is not None else None

    def feed(self, piece: str) -> list:
        return self._on(self.thinking.feed(piece) if self.thinking else [("content", piece)], False)

    def finish(self) -> list:
        return self._on(self.thinking.finish() if self.thinking else [], True)

    def _on(self, events: list, last: bool) -> list:
        if self.tools is None:
            return events
        out = []
        for kind, v in events:
            out += [(kind, v)] if kind == "reasoning" else self.tools.feed(v)
        return out + (self.tools.finish() if last else [])


def split(text: str, think: bool | None, fmt=None) -> tuple[str | None, str | None, list[dict]]:
    """(reasoning, content, tool_calls) of a finished output; content is None when there are calls and no
    other text, reasoning None when there is none."""
    r = Reply(think, fmt)
    events = r.feed(text) + r.finish()
    return ("".join(v for k, v in events if k == "reasoning") or None, *collect(events))
