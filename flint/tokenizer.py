"""Tokenizer, chat template and streaming detokenization, above the engine (which knows ids only).

Built on the `tokenizers` library from an HF tokenizer.json, or from GGUF metadata (BPE "gpt2"
vocabularies: tokens, merges, token types, pre-tokenizer name). Chat templates render with a
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
import jinja2.sandbox
from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, processors


class TokenizerError(ValueError):
    pass


def _content(tok) -> str | None:
    if tok is None:
        return None
    if isinstance(tok, dict):
        return tok.get("content")
    return str(tok)


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
        self._template = None

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
        if (d / "tokenizer_config.json").exists():
            try:
                tc = json.loads((d / "tokenizer_config.json").read_text())
            except ValueError as e:  # bad JSON or bad UTF-8
                raise TokenizerError(f"{d / 'tokenizer_config.json'}: not valid JSON ({e})") from None
            if not isinstance(tc, dict):
                raise TokenizerError(f"{d / 'tokenizer_config.json'}: expected a JSON object")
        tmpl = tc.get("chat_template")
        if isinstance(tmpl, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in tmpl}
            tmpl = named.get("default") or next(iter(named.values()), None)
        if tmpl is None and (d / "chat_template.jinja").exists():
            tmpl = (d / "chat_template.jinja").read_text()
        bos, eos = _content(tc.get("bos_token")), _content(tc.get("eos_token"))
        eos_ids = []
        if eos and tk.token_to_id(eos) is not None:
            eos_ids.append(tk.token_to_id(eos))
        if cfg is not None:
            eos_ids = sorted(set(eos_ids) | set(cfg.eos_token_ids))
        return cls(tk, tmpl, bos, eos, eos_ids, bool(tc.get("add_bos_token", False)))

    @classmethod
    def from_gguf_fields(cls, f: dict, path: str = "gguf") -> "Tokenizer":
        kind = f.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise TokenizerError(f"{path}: field 'tokenizer.ggml.model'={kind!r} is not supported "
                                 "(flint reads BPE 'gpt2' vocabularies)")
        tokens = list(f["tokenizer.ggml.tokens"])
        types = list(f.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        merges = [tuple(m.split(" ", 1)) for m in f.get("tokenizer.ggml.merges", [])]
        vocab = {t: i for i, t in enumerate(tokens)}
        tk = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        pre = f.get("tokenizer.ggml.pre", "gpt2")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre == "smollm":  # llama.cpp's "smollm": digits one by one, then the GPT-2 split
            tk.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level])
        else:
            tk.pre_tokenizer = byte_level
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
        eot = f.get("tokenizer.ggml.eot_token_id")
        if eot is not None:
            eos_ids = sorted(set(eos_ids) | {int(eot)})
        return cls(tk, f.get("tokenizer.chat_template"), tok_at("tokenizer.ggml.bos_token_id"),
                   tok_at("tokenizer.ggml.eos_token_id"), eos_ids,
                   bool(f.get("tokenizer.ggml.add_bos_token", False)))

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
                            tools: list[dict] | None = None, extra: dict | None = None) -> str:
        """The conversation as the template renders it; ``extra``: more template variables (a server's
        chat_template_kwargs, e.g. enable_thinking)."""
        if not self.chat_template:
            raise TokenizerError("this model has no chat template; use plain prompts (no --chat)")
        if self._template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])

            def raise_exception(msg):
                raise TokenizerError(f"chat template: {msg}")

            def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
                return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                                  separators=separators, sort_keys=sort_keys)

            env.filters["tojson"] = tojson
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise TokenizerError(f"chat message {m!r} needs 'role' and 'content'")
        given = {"tools": tools} if tools else {}  # HF passes tools only when given; templates test "is defined"
        return self._template.render(**(extra or {}), messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "", **given)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, extra: dict | None = None) -> list[int]:
        """The ids of the rendered conversation. Control tokens come from the template only: a
        message whose content holds a control token's text (``<|im_end|>`` typed by a user) has that
        text tokenized as text."""
        ctl = self._control_re
        hostile = [i for i, m in enumerate(messages)
                   if ctl is not None and isinstance(m.get("content"), str) and ctl.search(m["content"])]
        if not hostile:  # the usual case, tokenized exactly as transformers does
            return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools, extra),
                               add_special_tokens=False)
        # render with a marker where each such content goes, then tokenize the template's text (control
        # tokens and all) and those contents (as plain text) apart
        nonce = uuid.uuid4().hex
        marked = [dict(m, content=f"\ue000{nonce}{i}\ue001") if i in hostile else m
                  for i, m in enumerate(messages)]
        text = self.apply_chat_template(marked, add_generation_prompt, tools, extra)
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
