"""Tokenizer, chat template and streaming detokenization, above the engine (which knows ids only).

Built on the `tokenizers` library from an HF tokenizer.json, or from GGUF metadata (BPE "gpt2"
vocabularies: tokens, merges, token types, and the pre-tokenizer name, PRE_TOKENIZERS: the split
each family's tokenizer.json makes; other names refused). Chat templates render with a
sandboxed jinja2 environment configured the way HF renders them, so prompts match
``transformers``' apply_chat_template. Test: ``pytest tests/test_gguf.py -k template``.
"""
from __future__ import annotations

import functools
import json
import re
import uuid
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
from tokenizers import (AddedToken, Tokenizer as HFTokenizer, decoders, models, normalizers, pre_tokenizers,
                        processors)

from .errors import FlintError
from .checks import check_types, read_json


class TokenizerError(FlintError, ValueError):
    pass


# How a GGUF's ``tokenizer.ggml.pre`` splits text before BPE, as the family's own tokenizer.json
# does (and llama.cpp for that name): a regex whose matches are the pieces, then the byte-level
# alphabet; None is the GPT-2 regex inside ByteLevel. An absent field means "gpt2".
# Llama 3's split: contractions in any case, a letter run with one non-letter before it, digits in
# threes, newlines kept with the punctuation before them.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {
    "gpt2": None,
    "smollm": "digits",  # SmolLM's: each digit alone, then the GPT-2 regex
    "starcoder": "digits",  # StarCoder's and Refact's: the same
    "refact": "digits",
    "llama-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,  # tiktoken's cl100k split, which Llama 3 took over
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}"),  # Qwen2 / 2.5 / 3: Llama 3's, digits one by one
}


def gguf_pre_tokenizer(pre: str, path: str = "gguf"):
    """The tokenizers pre-tokenizer for a GGUF's ``tokenizer.ggml.pre`` (PRE_TOKENIZERS); any other
    name is refused naming it: a wrong split changes the ids of digits, contractions and spaces."""
    if pre not in PRE_TOKENIZERS:
        raise TokenizerError(f"{path}: field 'tokenizer.ggml.pre'={pre!r} is not supported (flint splits "
                             f"text as {', '.join(PRE_TOKENIZERS)} do)")
    split = PRE_TOKENIZERS[pre]
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split == "digits":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    from tokenizers import Regex

    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _content(tok) -> str | None:
    if tok is None:
        return None
    if isinstance(tok, dict):
        return tok.get("content")
    return str(tok)


def sentencepiece_merges(tokens: list[str], scores: list[float], vocab: dict) -> list[tuple[str, str]]:
    """BPE merges for a SentencePiece vocabulary that has scores and no merges: every way to cut a
    token into two tokens, the higher the whole token's score the earlier, ties going to the longer
    left then right piece, then the token's order and its pieces' ids (the order transformers
    derives for a GGUF, so the two tokenize alike)."""
    cuts = []
    for t, score in zip(tokens, scores):
        pairs = sorted(((vocab[t[:i]], vocab[t[i:]]), t[:i], t[i:]) for i in range(1, len(t))
                       if t[:i] in vocab and t[i:] in vocab)
        cuts += [(score, left, right) for _, left, right in pairs]
    cuts.sort(key=lambda c: (-c[0], -len(c[1]), -len(c[2])))  # stable: equal keys keep their order
    return [(left, right) for _, left, right in cuts]


def sentencepiece_from_gguf(f: dict, tokens: list[str], vocab: dict) -> HFTokenizer:
    """A GGUF's SentencePiece ('llama') vocabulary as a byte-fallback BPE: spaces as U+2581, one in
    front of the text (``tokenizer.ggml.add_space_prefix``, on unless false). Phi-3's files put
    that space in front of leading spaces too (a normalizer), the others only where the text does
    not start with one (Metaspace), as each family's own tokenizer does."""
    unk = f.get("tokenizer.ggml.unknown_token_id")
    tk = HFTokenizer(models.BPE(vocab=vocab, merges=sentencepiece_merges(tokens, f["tokenizer.ggml.scores"], vocab),
                                byte_fallback=True, fuse_unk=True,
                                unk_token=tokens[unk] if unk is not None else None))
    prefix = bool(f.get("tokenizer.ggml.add_space_prefix", True))
    if f.get("general.architecture") == "phi3":
        steps = [normalizers.Replace(" ", "\u2581")]
        tk.normalizer = normalizers.Sequence(([normalizers.Prepend("\u2581")] if prefix else []) + steps)
    else:
        tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first" if prefix else "never",
                                                    split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tk.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tk


class Tokenizer:
    def __init__(self, tk: HFTokenizer, chat_template: str | None, bos_token: str | None,
                 eos_token: str | None, eos_token_ids: list[int], add_bos: bool = False):
        self.tk = tk
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.eos_token_ids = list(eos_token_ids)
        self.add_bos = add_bos
        self.bos_token_id = tk.token_to_id(bos_token) if bos_token else None

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @chat_template.setter
    def chat_template(self, text: str | None) -> None:
        """A new template text drops the compiled one (compiled again at the next render or compile_template)."""
        self._chat_template, self._template = text, None

    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token stands for: a text of n characters is at least
        n / max_token_chars tokens, which bounds a prompt's length before tokenizing it."""
        return max(1, max(len(self.tk.decode([i], skip_special_tokens=False)) for i in range(self.vocab_size)))

    @functools.cached_property
    def _control_re(self):
        """Matches the text of any special (control) token, longest first; None without any."""
        specials = sorted({t.content for t in self.tk.get_added_tokens_decoder().values() if t.special},
                          key=len, reverse=True)
        return re.compile("|".join(map(re.escape, specials))) if specials else None

    @functools.cached_property
    def _as_text(self) -> HFTokenizer:
        """The same tokenizer with special-token text encoded as ordinary text."""
        tk = HFTokenizer.from_str(self.tk.to_str())
        tk.encode_special_tokens = True
        return tk

    # ------------------------------------------------------------- construction
    @classmethod
    def from_hf_dir(cls, d: Path, cfg=None) -> "Tokenizer":
        d = Path(d)
        try:
            tk = HFTokenizer.from_file(str(d / "tokenizer.json"))
        except Exception as e:
            raise TokenizerError(f"{d / 'tokenizer.json'}: cannot be read ({e})") from None
        tc = {}
        tc_path = d / "tokenizer_config.json"
        if tc_path.exists():
            tc = read_json(tc_path, TokenizerError)
            if not isinstance(tc, dict):
                raise TokenizerError(f"{tc_path}: expected a JSON object")
            check_types(tc, {"bos_token": "token", "eos_token": "token", "add_bos_token": "bool"},
                        str(tc_path), TokenizerError)
        tmpl, where = tc.get("chat_template"), f"{tc_path}: field 'chat_template'"
        if isinstance(tmpl, list):  # [{"name": "default", "template": ...}, ...]
            if not all(isinstance(t, dict) and isinstance(t.get("template"), str) for t in tmpl):
                raise TokenizerError(f"{where}: a list must hold objects with a string 'template'")
            named = {t.get("name"): t.get("template") for t in tmpl}
            tmpl = named.get("default") or next(iter(named.values()), None)
        elif tmpl is not None and not isinstance(tmpl, str):
            raise TokenizerError(f"{where} must be a string or a list of named templates")
        if tmpl is None and (d / "chat_template.jinja").exists():
            where = str(d / "chat_template.jinja")
            raw = (d / "chat_template.jinja").read_bytes()
            try:
                tmpl = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise TokenizerError(f"{where}: not valid UTF-8 at byte {e.start}") from None
        bos, eos = _content(tc.get("bos_token")), _content(tc.get("eos_token"))
        eos_ids = []
        if eos and tk.token_to_id(eos) is not None:
            eos_ids.append(tk.token_to_id(eos))
        if cfg is not None:
            eos_ids = sorted(set(eos_ids) | set(cfg.eos_token_ids))
        tok = cls(tk, tmpl, bos, eos, eos_ids, bool(tc.get("add_bos_token", False)))
        tok.compile_template(where)
        return tok

    @classmethod
    def from_gguf_fields(cls, f: dict, path: str = "gguf") -> "Tokenizer":
        kind = f.get("tokenizer.ggml.model")
        if kind not in ("gpt2", "llama"):
            raise TokenizerError(f"{path}: field 'tokenizer.ggml.model'={kind!r} is not supported "
                                 "(flint reads byte-level BPE 'gpt2' and SentencePiece 'llama' vocabularies)")
        tokens = list(f["tokenizer.ggml.tokens"])
        types = list(f.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        vocab = {t: i for i, t in enumerate(tokens)}
        if kind == "llama":
            tk = sentencepiece_from_gguf(f, tokens, vocab)
        else:
            merges = [tuple(m.split(" ", 1)) for m in f.get("tokenizer.ggml.merges", [])]
            tk = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
            tk.pre_tokenizer = gguf_pre_tokenizer(f.get("tokenizer.ggml.pre", "gpt2"), path)
            tk.decoder = decoders.ByteLevel()
            tk.post_processor = processors.ByteLevel(trim_offsets=False)
        # control (3) and user-defined (4) tokens are matched whole in text, never split
        specials = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty in (3, 4)]
        tk.add_special_tokens(specials)

        def tok_at(key):
            i = f.get(key)
            return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

        eos_id = f.get("tokenizer.ggml.eos_token_id")
        eos_ids = [int(eos_id)] if eos_id is not None else []
        for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):  # eom: Llama 3.1's tool turn
            if f.get(key) is not None:
                eos_ids = sorted(set(eos_ids) | {int(f[key])})
        # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
        return cls(tk, f.get("tokenizer.chat_template"), tok_at("tokenizer.ggml.bos_token_id"),
                   tok_at("tokenizer.ggml.eos_token_id"), eos_ids,
                   bool(f.get("tokenizer.ggml.add_bos_token", kind == "llama")))

    # ------------------------------------------------------------- text <-> ids
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.tk.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None and (
                not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        vs = self.vocab_size
        for i in ids:
            if not 0 <= int(i) < vs:
                raise TokenizerError(f"token id {int(i)} is outside the vocabulary (size {vs})")
        return self.tk.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def stream(self, skip_special_tokens: bool = True) -> "StreamDecoder":
        return StreamDecoder(self, skip_special_tokens)

    # ------------------------------------------------------------- chat
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, template_kwargs: dict | None = None) -> str:
        """The rendered conversation. ``template_kwargs``: more variables for the template, as
        transformers' apply_chat_template passes its extra arguments (Qwen3's ``enable_thinking``)."""
        if not self.chat_template:
            raise TokenizerError("this model has no chat template; use plain prompts (no --chat)")
        if self._template is None:
            self.compile_template()
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise TokenizerError(f"chat message {m!r} needs 'role' and 'content'")
        extra = {"tools": tools} if tools else {}  # HF passes tools only when given; templates test "is defined"
        taken = {"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"} & set(template_kwargs or {})
        if taken:
            raise TokenizerError(f"chat template variables {sorted(taken)} are set by flint, not by template_kwargs")
        extra.update(template_kwargs or {})
        return _render(self._template, messages=messages, add_generation_prompt=add_generation_prompt,
                       bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra)

    def compile_template(self, where: str = "chat template") -> None:
        """Compile the chat template (the loaders call this, so a template jinja cannot parse is a
        load error naming ``where``: the file and field), in a sandboxed environment set up as
        transformers sets up its own."""
        if not self.chat_template:
            return
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _GenerationTag])

        def raise_exception(msg):
            raise TokenizerError(f"chat template: {msg}")

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)

        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(self.chat_template)
        except Exception as e:  # noqa: BLE001 - jinja's syntax errors, and a recursion on deep nesting
            line = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
            raise TokenizerError(f"{where}: not a template jinja can compile{line}: "
                                 f"{type(e).__name__}: {str(e)[:300]}") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
        """The ids of the rendered conversation. Control tokens come from the template only: a
        message whose content holds a control token's text (``<|im_end|>`` typed by a user) has that
        text tokenized as text."""
        ctl = self._control_re
        hostile = [i for i, m in enumerate(messages)
                   if ctl is not None and isinstance(m.get("content"), str) and ctl.search(m["content"])]
        if not hostile:  # the usual case, tokenized exactly as transformers does
            return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools, template_kwargs),
                               add_special_tokens=False)
        # render with a marker where each such content goes, then tokenize the template's text (control
        # tokens and all) and those contents (as plain text) apart
        nonce = uuid.uuid4().hex
        marked = [dict(m, content=f"\ue000{nonce}{i}\ue001") if i in hostile else m
                  for i, m in enumerate(messages)]
        text = self.apply_chat_template(marked, add_generation_prompt, tools, template_kwargs)
        ids, at, placed = [], 0, []
        for mt in re.finditer(f"\ue000{nonce}(\\d+)\ue001", text):
            i = int(mt.group(1))
            ids += self.encode(text[at: mt.start()], add_special_tokens=False)
            ids += self._as_text.encode(messages[i]["content"], add_special_tokens=False).ids
            at = mt.end()
            placed.append(i)
        ids += self.encode(text[at:], add_special_tokens=False)
        if sorted(set(placed)) != hostile:
            raise TokenizerError("chat template: it rewrites message contents, so a content holding "
                                 "control-token text cannot be kept as text")
        return ids


# a rendered conversation longer than this is a runaway template, not a prompt
MAX_RENDER_CHARS = 1 << 24


class _GenerationTag(jinja2.ext.Extension):
    """transformers' ``{% generation %}...{% endgeneration %}`` (it marks the assistant's part for
    training masks): rendered as its body, as transformers renders it."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _render(template, **context) -> str:
    """template rendered with context; a failure or a runaway output is a TokenizerError."""
    out, n = [], 0
    try:
        for piece in template.generate(**context):
            n += len(piece)
            if n > MAX_RENDER_CHARS:
                raise TokenizerError(f"chat template: its output exceeds {MAX_RENDER_CHARS} characters")
            out.append(piece)
    except TokenizerError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever the template's own code raises
        raise TokenizerError(f"chat template: cannot render this conversation "
                             f"({type(e).__name__}: {str(e)[:300]})") from None
    return "".join(out)


class StreamDecoder:
    """Incremental detokenization: feed ids one at a time, get text pieces that never split a
    UTF-8 character (bytes of an unfinished character are held until it completes)."""

    def __init__(self, tok: Tokenizer, skip_special_tokens: bool = True):
        self.tok = tok
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def feed(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        before = self.tok.decode(self.ids[self.prefix:self.read], self.skip)
        after = self.tok.decode(self.ids[self.prefix:], self.skip)
        if after.endswith("\ufffd") or len(after) < len(before):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]

    def flush(self) -> str:
        before = self.tok.decode(self.ids[self.prefix:self.read], self.skip)
        after = self.tok.decode(self.ids[self.prefix:], self.skip)
        self.prefix = self.read = len(self.ids)
        return after[len(before):]
