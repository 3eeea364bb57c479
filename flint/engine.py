"""The engine: prompt ids in, a stream of tokens out, on any backend (it never looks inside one).

Greedy and sampled decoding (temperature, top-k, top-p; a fixed seed gives the same text), stop on
any eos id or stop string, max_new_tokens, KV reuse of the common prefix between calls (multi-turn
chat re-sends the whole conversation and only the new tail is prefilled), and per-call stats
(prompt tokens, new tokens, time to first token, decode tok/s). Test: ``pytest tests/test_engine.py``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


class ContextError(ValueError):
    pass


@dataclass
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 -> greedy
    top_k: int = 0  # 0 -> off
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def validate(self) -> "SamplingParams":
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        return self


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    ttft_s: float
    decode_s: float

    @property
    def decode_tok_s(self) -> float:
        n = len(self.token_ids) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


def probs_from_logits(logits: torch.Tensor, temperature: float, top_k: int = 0,
                      top_p: float = 1.0) -> torch.Tensor:
    """The sampling distribution (fp32, sums to 1) after temperature, top-k and top-p."""
    x = logits.float() / max(temperature, 1e-6)
    if top_k and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    p = torch.softmax(x, dim=-1)
    if top_p < 1.0:
        sp, idx = torch.sort(p, dim=-1, descending=True)
        cum = sp.cumsum(-1)
        drop = (cum - sp) > top_p  # keep the smallest prefix whose mass reaches top_p
        sp = sp.masked_fill(drop, 0.0)
        p = torch.zeros_like(p).scatter(-1, idx, sp)
        p = p / p.sum(-1, keepdim=True)
    return p


def sample(logits: torch.Tensor, sp: SamplingParams, gen: torch.Generator | None) -> int:
    if sp.temperature == 0:
        return int(torch.argmax(logits))
    p = probs_from_logits(logits, sp.temperature, sp.top_k, sp.top_p)
    return int(torch.multinomial(p, 1, generator=gen))


def _stop_holdback(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                best = max(best, n)
                break
    return best


class Engine:
    # greedy decoding on a backend with greedy_run: tokens per burst (each argmax feeds the next step on the
    # device, one host sync per burst; a stop inside a burst wastes at most GREEDY_BURST - 1 steps)
    GREEDY_BURST = 8

    def __init__(self, backend, tokenizer=None, eos_token_ids=None):
        self.backend = backend
        self.tokenizer = tokenizer
        self.eos = set(eos_token_ids if eos_token_ids is not None else backend.cfg.eos_token_ids)
        self.cached: list[int] = []  # tokens whose K/V sit in the backend's cache, in order
        self.last: GenerationResult | None = None

    @property
    def max_seq_len(self) -> int:
        return self.backend.max_seq_len

    def check_fits(self, n_prompt: int, max_new_tokens: int) -> None:
        if n_prompt == 0:
            raise ContextError("the prompt is empty")
        if n_prompt + max_new_tokens > self.max_seq_len:
            raise ContextError(f"prompt ({n_prompt} tokens) + max_new_tokens ({max_new_tokens}) "
                               f"exceeds the context of {self.max_seq_len} tokens")

    def prefill(self, ids: list[int], return_hidden: bool = False):
        """Bring the cache to ``ids`` (reusing the common prefix); returns the last logits (and
        the last hidden state when return_hidden: the draft head's input)."""
        c = 0
        for a, b in zip(self.cached, ids):
            if a != b:
                break
            c += 1
        c = min(c, len(ids) - 1)
        chunk = getattr(self.backend, "max_chunk", None) or len(ids)
        out = None
        self.cached = self.cached[:c]
        for s in range(c, len(ids), chunk):
            part = ids[s: s + chunk]
            out = self.backend.forward(torch.tensor(part, dtype=torch.long), s, return_hidden=return_hidden)
            self.cached += part
        if return_hidden:
            return out[0][-1], out[1][-1]
        return out[-1]

    def _tokens(self, prompt_ids: list[int], sp: SamplingParams, gen):
        """Yield generated token ids: the first from the prefill, then one per decode step.
        Subclasses (speculative decoding) override this; stream() does the text side."""
        logits = self.prefill(list(prompt_ids))
        pos = len(prompt_ids)
        greedy = sp.temperature == 0
        burst = greedy and hasattr(self.backend, "greedy_run")
        fast = greedy and hasattr(self.backend, "greedy_next")
        tok = sample(logits, sp, gen)
        produced = 1
        while True:
            yield tok
            if burst:  # the consumer asked for more: at least one token is still wanted
                n = max(1, min(self.GREEDY_BURST, sp.max_new_tokens - produced))
                toks = self.backend.greedy_run(tok, pos, n)
                pos, produced = pos + n, produced + n
                yield from toks[:-1]
                tok = toks[-1]
                continue
            if fast:
                tok = self.backend.greedy_next(tok, pos)
            else:
                logits = self.backend.forward(torch.tensor([tok], dtype=torch.long), pos)[-1]
                tok = sample(logits, sp, gen)
            pos += 1
            produced += 1

    def _on_start(self) -> None:
        """Hook: a generation begins (subclasses reset their per-call stats)."""

    def _on_finish(self) -> None:
        """Hook: a generation ended (normally, by a stop, or because the consumer closed)."""

    def stream(self, prompt_ids: list[int], sp: SamplingParams):
        """Yield (token_id, text_piece) as tokens decode; sets self.last when done.

        Text pieces need a tokenizer; without one they are "". Closing the generator early (a
        client that went away) stops decoding at the next token (greedy on a backend with greedy_run:
        after the current burst of at most GREEDY_BURST tokens, already computed).
        """
        sp.validate()
        self.check_fits(len(prompt_ids), sp.max_new_tokens)
        vs = self.backend.cfg.vocab_size
        for t in prompt_ids:
            if not 0 <= int(t) < vs:
                raise ValueError(f"token id {int(t)} is outside the vocabulary (size {vs})")
        gen = None
        if sp.temperature > 0:
            gen = torch.Generator(device=self.backend.device)
            gen.manual_seed(sp.seed if sp.seed is not None else int(time.time_ns() % (2**31)))
        dec = self.tokenizer.stream() if self.tokenizer is not None else None
        self.last = None
        self._on_start()
        if sp.max_new_tokens == 0:
            self.last = GenerationResult([], "", "length", len(prompt_ids), 0.0, 0.0)
            return
        t0 = time.perf_counter()
        out: list[int] = []
        text, emitted, finish = "", 0, "length"
        tokens = self._tokens(prompt_ids, sp, gen)
        tok = next(tokens)
        t_first = time.perf_counter()
        try:
            while True:
                out.append(tok)
                if tok in self.eos and not sp.ignore_eos:
                    finish = "stop"
                    break
                piece = dec.feed(tok) if dec else ""
                if piece:
                    text += piece
                    hit = [h for h in (text.find(s, max(0, emitted - len(s))) for s in sp.stop) if h >= 0]
                    if hit:
                        cut = min(hit)
                        if cut > emitted:
                            yield tok, text[emitted:cut]
                        text, emitted, finish = text[:cut], cut, "stop"
                        break
                    hold = _stop_holdback(text, sp.stop) if sp.stop else 0
                    if len(text) - hold > emitted:
                        yield tok, text[emitted: len(text) - hold]
                        emitted = len(text) - hold
                    else:
                        yield tok, ""
                else:
                    yield tok, ""
                if len(out) >= sp.max_new_tokens:
                    break
                tok = next(tokens)
        finally:
            tokens.close()
            # every emitted token but the last has its K/V in the cache
            self.cached = list(prompt_ids) + out[:-1]
            self._on_finish()
            self.last = GenerationResult(out, text, finish, len(prompt_ids), t_first - t0,
                                         time.perf_counter() - t_first)
        if emitted < len(text):  # a held-back stop-string prefix that never completed
            yield out[-1], text[emitted:]

    def generate(self, prompt_ids: list[int], sp: SamplingParams) -> GenerationResult:
        for _ in self.stream(prompt_ids, sp):
            pass
        return self.last
