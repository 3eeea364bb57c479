"""Grammar-constrained decoding: which tokens may come next, as a vocabulary bitmask, through llguidance.

A ``Grammars`` wraps one tokenizer (its llguidance view is built once, ~0.3 s for 49k tokens) and compiles
JSON schemas, "any JSON object", regular expressions, Lark grammars (llguidance's dialect, with ``%json``
for embedded schemas) and GBNF (llama.cpp's grammar format, translated to Lark) into a ``Constraint``,
checked before any decoding (``GrammarError`` names what the engine cannot compile). A constraint makes
one ``Matcher`` per generation: ``fill(mask)`` writes the allowed tokens of the next step into an int32
tensor of ceil(V / 32) words (bit i & 31 of word i >> 5 set = token i allowed: the layout the backends'
``set_token_mask`` takes), ``consume(token)`` advances. When the grammar is complete only the end-of-
sequence token is allowed, so a mask is never empty.

Why llguidance (bench/results/grammar_engines_2026-12-02.md): on this CPU its mask costs 21 / 49 us a
token (mean; SmolLM2's 49152-token vocabulary / a 100352-token one), against xgrammar's 8 / 22 and
outlines-core's 459 / 1536; both of the first two fit a decode step (~1.1 ms for Granite-4.1-3B on the
megakernel), and llguidance installs with no dependencies (7.6 MB, imports in 0.06 s) where xgrammar
needs triton (1 GB) and transformers (3.3 s to import). Its weak spot: strings with a maxLength, whose masks
it cannot precompute (~250 us a token at 100352 tokens, xgrammar 54). Tests: ``pytest tests/test_structured.py``.
"""
from __future__ import annotations

import functools
import json
import time

import torch

from .errors import FlintError


class GrammarError(FlintError, ValueError):
    """A grammar, schema or pattern the engine cannot compile; ``param`` names the request field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


# JSON output without free whitespace: a small model otherwise can emit newlines forever inside a
# valid document; the separators are the ones json.dumps writes
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def mask_words(vocab: int) -> int:
    return (vocab + 31) // 32


class Matcher:
    """One generation's position in the grammar."""

    def __init__(self, constraint: "Constraint"):
        import llguidance

        self.m = llguidance.LLMatcher(constraint.grammars.lltok, constraint.grammar)
        if self.m.is_error():
            raise GrammarError(self.m.get_error(), constraint.param)
        self.words = mask_words(constraint.grammars.vocab)
        self.constraint = constraint

    def fill(self, mask: torch.Tensor) -> torch.Tensor:
        """Write the next step's allowed tokens into ``mask`` (int32 [ceil(V / 32)], on the CPU, contiguous)."""
        if mask.dtype != torch.int32 or mask.device.type != "cpu" or not mask.is_contiguous() \
                or mask.numel() != self.words:
            raise ValueError(f"the token mask must be a contiguous CPU int32 tensor of {self.words} words")
        t0 = time.perf_counter()
        self.m.unsafe_compute_mask_ptr(mask.data_ptr(), self.words * 4)
        self.constraint.seconds += time.perf_counter() - t0
        if self.m.is_error():
            raise RuntimeError(f"grammar: {self.m.get_error()}")
        return mask

    def consume(self, token: int) -> None:
        t0 = time.perf_counter()
        ok = self.m.consume_token(int(token))
        self.constraint.seconds += time.perf_counter() - t0
        if not ok:
            raise RuntimeError(f"grammar: token {int(token)} was not allowed ({self.m.get_error()})")

    @property
    def done(self) -> bool:
        """Nothing but the end of sequence may follow (or it was consumed)."""
        return self.m.is_stopped()

    @property
    def accepting(self) -> bool:
        return self.m.is_accepting()


class Constraint:
    """A compiled grammar (a JSON string of llguidance's grammar spec) and the field it came from."""

    def __init__(self, grammars: "Grammars", grammar: str, param: str | None, kind: str,
                 schema: dict | None = None):
        self.grammars, self.grammar, self.param, self.kind, self.schema = grammars, grammar, param, kind, schema
        self.seconds = 0.0  # host time its matchers spent in fill and consume (flint bench reports it)

    def matcher(self) -> Matcher:
        return Matcher(self)


class Grammars:
    """The grammar compiler of one tokenizer. ``vocab``: the model's vocabulary size (the mask's length,
    at least the tokenizer's); ``eos``: the token a complete grammar allows (one the engine stops on)."""

    def __init__(self, tokenizer, vocab: int, eos: int):
        self.tokenizer, self.vocab, self.eos = tokenizer, vocab, eos

    @functools.cached_property
    def _lltok(self):
        """llguidance's view of the tokenizer, or the reason it cannot be built (kept: it is not retried)."""
        import llguidance

        try:
            return llguidance.LLTokenizer(self.tokenizer.tk.to_str(), n_vocab=self.vocab, eos_token=self.eos)
        except (ValueError, RuntimeError, TypeError) as e:
            return f"grammar constraints are not available for this tokenizer (llguidance: {e})"

    @property
    def lltok(self):
        if isinstance(self._lltok, str):
            raise GrammarError(self._lltok)
        return self._lltok

    def _check(self, grammar: str, param: str, kind: str, schema: dict | None = None) -> Constraint:
        import llguidance

        try:
            err = llguidance.LLMatcher.validate_grammar(grammar, self.lltok)
        except (ValueError, RuntimeError) as e:
            err = str(e)
        if err:
            raise GrammarError(f"{param}: the {kind} cannot be compiled ({err})", param)
        return Constraint(self, grammar, param, kind, schema)

    def _compile(self, make, param: str, what: str, schema=None) -> Constraint:
        """``make(LLMatcher)`` builds the grammar; its failure is a GrammarError naming ``param``."""
        import llguidance

        try:
            grammar = make(llguidance.LLMatcher)
        except (ValueError, RuntimeError, TypeError) as e:
            raise GrammarError(f"{param}: the {what} cannot be compiled ({e})", param) from None
        return self._check(grammar, param, what, schema)

    def json_schema(self, schema, param: str = "response_format.json_schema.schema") -> Constraint:
        if not isinstance(schema, dict):
            raise GrammarError(f"{param}: a JSON schema must be an object", param)
        return self._compile(lambda m: m.grammar_from_json_schema(schema, defaults=JSON_OPTIONS), param,
                             "JSON schema", schema)

    def json_object(self, param: str = "response_format") -> Constraint:
        return self.json_schema({"type": "object"}, param)

    def regex(self, pattern: str, param: str) -> Constraint:
        return self._compile(lambda m: m.grammar_from_regex(pattern), param, "regular expression")

    def lark(self, text: str, param: str) -> Constraint:
        return self._compile(lambda m: m.grammar_from_lark(text), param, "grammar")

    def gbnf(self, text: str, param: str) -> Constraint:
        from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

        try:
            lark = gbnf_to_lark(text)
        except (GbnfToLarkError, ValueError, KeyError, IndexError) as e:
            raise GrammarError(f"{param}: the GBNF grammar cannot be read ({e})", param) from None
        return self.lark(lark, param)

    def choice(self, options: list[str], param: str) -> Constraint:
        if not options or not all(isinstance(o, str) and o for o in options):
            raise GrammarError(f"{param}: give a non-empty list of non-empty strings", param)
        return self.lark("start: " + " | ".join(json.dumps(o) for o in options), param)

    def literal(self, text: str) -> str:
        """A Lark term matching ``text``: a token reference when the tokenizer holds it as one special token
        (``<tool_call>`` in some vocabularies: its text never matches a grammar literal), else a string."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1 and self.lltok.is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return json.dumps(text)
