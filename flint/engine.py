"""The engine: prompt ids in, a stream of tokens out, on any backend (it never looks inside one).

Greedy and sampled decoding (temperature, top-k, top-p, min-p; a fixed 64-bit seed gives the same
text), logit bias and presence / frequency / repetition penalties, stop on any eos id or stop
string, max_new_tokens, per-token logprobs (each token's log-softmax and its most likely
alternatives), KV reuse of the common prefix between calls (multi-turn chat re-sends the whole
conversation and only the new tail is prefilled), a prefill in chunks that asks the caller between
chunks whether to go on, and per-call stats (prompt tokens, new tokens, time to first token,
decode tok/s). Test: ``pytest tests/test_engine.py`` (logprobs: ``tests/test_server_ops.py``).

Grammar constraints (``sp.constraint``, a flint.grammar.Constraint): each step the host advances the
grammar with the chosen token and fills the next step's allowed-token bitmask into a pinned buffer, which
is copied to the device (non-blocking); greedy decoding on a backend with the masked step (flint.backend_api.MaskedStep)
then sets it and takes ``greedy_next`` (the argmax is masked on the device, no logits reach the host), other
decoding masks the logits on the device before sampling. Constrained greedy decoding runs one token per
host round trip (the next mask needs the token before it), not in ``greedy_run`` bursts; on a backend with the
pipelined step (``PipelinedStep``: the megakernel, the reference) the next step is enqueued before the mask is
filled and takes its token on the device, so no host round trip sits between two steps. Test:
``pytest tests/test_structured.py``.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

import torch

from .backend_api import ChunkedPrefill, GreedyRun, GreedyStep, MaskedStep, PipelinedStep
from .errors import FlintError
from .token_mask import mask_logits


class ContextError(FlintError, ValueError):
    pass


class Cancelled(FlintError):
    """The caller's should_stop() said yes between two prefill chunks."""


MASK64 = (1 << 64) - 1


def generator_seed(seed: int) -> int:
    """A 64-bit seed mixed (splitmix64's finalizer, a bijection on 64 bits) for
    torch.Generator.manual_seed. The CPU generator (mt19937) keeps only the low 32 bits of its
    seed, so unmixed seeds that differ by 2**32 would sample the same text; mixed, every bit of the
    seed moves those 32. (CUDA's Philox keeps all 64.)"""
    x = seed & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


@dataclass
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 -> greedy
    top_k: int = 0  # 0 -> off
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    min_p: float = 0.0  # keep tokens with p >= min_p * max p (0 -> off)
    presence_penalty: float = 0.0  # minus this once for every token already generated
    frequency_penalty: float = 0.0  # minus this times the count of each generated token
    repetition_penalty: float = 1.0  # prompt and generated tokens: logit / r if > 0, * r if < 0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    # None -> off; k -> record each token's log-probability and the k most likely alternatives (the
    # log-softmax of the logits the token was drawn from, after bias and penalties, before temperature
    # and truncation: the model's distribution, as OpenAI reports it)
    logprobs: int | None = None
    constraint: object | None = None  # a flint.grammar.Constraint: only tokens its grammar allows
    skip_special: bool = True  # special tokens' text left out of the decoded text (tool-call markers keep it)

    # the fields that change logits before sampling (min_p acts on the distribution)
    LOGIT_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")

    def adjusted(self) -> list[str]:
        """The logit-changing fields this request sets (not at their neutral value)."""
        neutral = SamplingParams()
        return [f for f in self.LOGIT_FIELDS if getattr(self, f) != getattr(neutral, f)]

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
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 10:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        for t, b in self.logit_bias.items():
            if not -100 <= b <= 100:
                raise ValueError(f"logit_bias: the bias of token {t} must be in [-100, 100], got {b}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0 alternatives, got {self.logprobs}")
        if self.constraint is not None and self.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with a grammar constraint (the grammar ends the output)")
        if self.seed is not None and not -(1 << 63) <= self.seed <= MASK64:
            raise ValueError(f"seed must be a 64-bit integer, got {self.seed}")
        return self


@dataclass
class TokenLogprob:
    """One generated token's log-probability and the most likely alternatives (id, logprob), best first."""
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprob(logits: torch.Tensor, tok: int, k: int) -> TokenLogprob:
    lp = torch.log_softmax(logits.float(), dim=-1)
    top = []
    if k:
        vals, ids = torch.topk(lp, min(k, lp.shape[-1]))
        top = list(zip(ids.tolist(), vals.tolist()))
    return TokenLogprob(tok, float(lp[tok]), top)


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "cancelled" (should_stop() during the prefill)
    prompt_tokens: int
    ttft_s: float
    decode_s: float
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, when sp.logprobs asked for them
    speculative: dict | None = None  # speculative decoding's figures (SpeculativeStats.summary), when it ran

    @property
    def decode_tok_s(self) -> float:
        n = len(self.token_ids) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


def probs_from_logits(logits: torch.Tensor, temperature: float, top_k: int = 0,
                      top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """The sampling distribution (fp32, sums to 1) after temperature, top-k, min-p and top-p."""
    x = logits.float() / max(temperature, 1e-6)
    if top_k and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    p = torch.softmax(x, dim=-1)
    if min_p > 0:  # the most likely token always survives (p >= min_p * p)
        p = p.masked_fill(p < min_p * p.amax(-1, keepdim=True), 0.0)
        p = p / p.sum(-1, keepdim=True)
    if top_p < 1.0:
        sp, idx = torch.sort(p, dim=-1, descending=True)
        cum = sp.cumsum(-1)
        drop = (cum - sp) > top_p  # keep the smallest prefix whose mass reaches top_p
        sp = sp.masked_fill(drop, 0.0)
        p = torch.zeros_like(p).scatter(-1, idx, sp)
        p = p / p.sum(-1, keepdim=True)
    return p


# inverse_cdf_draw's block: the running sums are taken per block of this many weights, then over the blocks' totals
# (on CUDA a scan along the rows of a 2-D tensor is deterministic; one over a whole long vector is not,
# pytorch/pytorch#75240, and a seeded draw must not depend on the scan's timing)
CDF_BLOCK = 1024


def inverse_cdf_draw(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token of weights p [V] (any nonnegative scale, a positive total) at uniform u [1] in [0, 1): the first whose
    cumulative weight exceeds u times the total, as a LongTensor [1] on p's device (no host sync, capturable in a CUDA
    graph; never a token of weight 0). The cumulative weights are summed in blocks of CDF_BLOCK in a fixed order:
    the same bits on every run."""
    v = p.shape[0]
    nb = -(-v // CDF_BLOCK)
    w = p if nb * CDF_BLOCK == v else torch.nn.functional.pad(p, (0, nb * CDF_BLOCK - v))
    rows = w.view(nb, CDF_BLOCK).cumsum(1)  # running sums inside each block
    tot = rows[:, -1].contiguous()
    pre = tot.cumsum(0)  # the blocks' running totals (nb values: one tile)
    target = u.reshape(1) * pre[-1:]
    # the first block whose running total exceeds the target (at most the last block with weight)
    b = torch.minimum(torch.searchsorted(pre, target, right=True), torch.searchsorted(pre, pre[-1:], right=False))
    before = torch.where(b > 0, pre.index_select(0, (b - 1).clamp_min(0)), torch.zeros_like(target))
    row = rows.index_select(0, b)  # [1, CDF_BLOCK]
    # inside it: the first running sum past what is left (at most the block's last token with weight)
    j = torch.minimum(torch.searchsorted(row, (target - before).view(1, 1), right=True),
                      torch.searchsorted(row, row[:, -1:], right=False)).view(1)
    return b * CDF_BLOCK + j


def sample(logits: torch.Tensor, sp: SamplingParams, gen: torch.Generator | None) -> int:
    """The next token from logits [V]: the argmax at temperature 0, else a draw from probs_from_logits by inverse CDF
    of one uniform (inverse_cdf_draw; with one scan over the row it took 84 against torch.multinomial's 135 µs a draw
    at V = 49152 on the H200, lab/studies/sampling_cost.py, `sampling_cost_2026-12-03.json`; the blockwise scan is not
    timed yet)."""
    top = float(logits.max())  # one reduction: NaN propagates (a draw from NaN weights is no token at all)
    if not math.isfinite(top):
        raise NonFiniteLogits(f"the model's logits are {'all -inf' if top < 0 else 'NaN or infinite'}: its weights "
                              "or hyperparameters are broken (a NaN weight, an overflowing activation); no token "
                              "can be drawn")
    if sp.temperature == 0:
        return int(torch.argmax(logits))
    return int(draw(logits, sp, gen))


class NonFiniteLogits(FlintError, RuntimeError):
    """A decode step's logits hold NaN or +inf (or are all -inf): the model's output is broken."""


def draw(logits: torch.Tensor, sp: SamplingParams, gen: torch.Generator | None) -> torch.Tensor:
    """sample()'s draw at a temperature, left on the device: a LongTensor [1] (no host sync)."""
    p = probs_from_logits(logits, sp.temperature, sp.top_k, sp.top_p, sp.min_p).reshape(-1)
    return inverse_cdf_draw(p, torch.rand(1, generator=gen, device=p.device))


class LogitAdjuster:
    """Logit bias and the penalties of one generation, applied to each step's logits [V].

    presence / frequency count the generated tokens (OpenAI's definition); repetition_penalty
    (the CTRL paper's, as vLLM and transformers apply it) covers prompt and generated tokens."""

    def __init__(self, sp: SamplingParams, prompt_ids: list[int], vocab: int, device):
        self.sp = sp
        self.bias = None
        if sp.logit_bias:
            self.bias = torch.zeros(vocab, dtype=torch.float32, device=device)
            ids = torch.tensor(list(sp.logit_bias), dtype=torch.long, device=device)
            self.bias[ids] = torch.tensor(list(sp.logit_bias.values()), dtype=torch.float32, device=device)
        self.counts = None
        if sp.presence_penalty or sp.frequency_penalty:
            self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        self.seen = None
        if sp.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            self.seen[torch.tensor(prompt_ids, dtype=torch.long, device=device)] = True

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        x = logits.float()
        sp = self.sp
        if self.seen is not None:
            r = sp.repetition_penalty
            x = torch.where(self.seen, torch.where(x > 0, x / r, x * r), x)
        if self.counts is not None:
            x = x - sp.frequency_penalty * self.counts - sp.presence_penalty * (self.counts > 0).float()
        if self.bias is not None:
            x = x + self.bias
        return x

    def add(self, tok: int) -> None:
        if self.counts is not None:
            self.counts[tok] += 1
        if self.seen is not None:
            self.seen[tok] = True


def holdback(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of one of ``stops`` (text a stream must hold
    back until it knows whether a stop string or a marker begins there)."""
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
    # sampled decoding (no penalties, no logprobs) runs in bursts of GREEDY_BURST on these devices, each draw feeding
    # the next step on the device (on the H200 a per-token host sync left the GPU idle between steps; on a CPU it
    # costs nothing)
    SAMPLED_BURST_DEVICES = ("cuda",)
    # prefill tokens per forward at most: bounds a long prompt's activations and lets a caller that
    # no longer wants the answer stop between chunks
    PREFILL_CHUNK = 512

    def __init__(self, backend, tokenizer=None, eos_token_ids=None):
        self.backend = backend
        self.tokenizer = tokenizer
        self.eos = set(eos_token_ids if eos_token_ids is not None else backend.cfg.eos_token_ids)
        self.cached: list[int] = []  # tokens whose K/V sit in the backend's cache, in order
        self.last: GenerationResult | None = None
        self.should_stop = None  # during stream(): the caller's "stop now?" check, asked between prefill chunks
        # during stream() with sp.logprobs: one TokenLogprob per token generated so far (a consumer reads
        # the entry of each token as it is yielded)
        self.step_logprobs: list[TokenLogprob] = []

    @property
    def max_seq_len(self) -> int:
        return self.backend.max_seq_len

    def check_fits(self, n_prompt: int, max_new_tokens: int) -> None:
        if n_prompt == 0:
            raise ContextError("the prompt is empty")
        if n_prompt + max_new_tokens > self.max_seq_len:
            raise ContextError(f"prompt ({n_prompt} tokens) + max_new_tokens ({max_new_tokens}) "
                               f"exceeds the context of {self.max_seq_len} tokens")

    def unsupported(self, sp: SamplingParams) -> list[str]:
        """The fields of sp this engine would not honour. Engine's own token loop applies them all;
        a subclass with its own loop (speculative decoding verifies the draft against unadjusted
        distributions) does not apply logit bias, penalties or min_p."""
        if type(self)._tokens is Engine._tokens:
            return []
        return (sp.adjusted() + (["min_p"] if sp.min_p else []) + (["logprobs"] if sp.logprobs is not None else [])
                + (["constraint"] if sp.constraint is not None else []))

    def prefill(self, ids: list[int], return_hidden: bool = False):
        """Bring the cache to ``ids`` (reusing the common prefix), in chunks of PREFILL_CHUNK tokens at most
        (raises Cancelled when should_stop() says so between two); returns the last position's logits (and
        its hidden state when return_hidden: the draft head's input). Only that position's logits are
        computed."""
        c = 0
        for a, b in zip(self.cached, ids):
            if a != b:
                break
            c += 1
        c = min(c, len(ids) - 1)
        limit = self.backend.max_chunk if isinstance(self.backend, ChunkedPrefill) else None
        chunk = min(limit or self.PREFILL_CHUNK, self.PREFILL_CHUNK)
        out = None
        self.cached = self.cached[:c]
        for s in range(c, len(ids), chunk):
            if s > c and self.should_stop is not None and self.should_stop():
                raise Cancelled
            part = ids[s: s + chunk]
            out = self.backend.forward(torch.tensor(part, dtype=torch.long), s, return_hidden=return_hidden,
                                       last_only=True)
            self.cached += part
        if return_hidden:
            return out[0][-1], out[1][-1]
        return out[-1]

    def _tokens(self, prompt_ids: list[int], sp: SamplingParams, gen):
        """Yield generated token ids: the first from the prefill, then one per decode step.
        Subclasses (speculative decoding) override this; stream() does the text side."""
        logits = self.prefill(list(prompt_ids))
        pos = len(prompt_ids)
        adjust = None
        if sp.adjusted():  # the logits change every step: no on-device argmax shortcut
            adjust = LogitAdjuster(sp, prompt_ids, self.backend.cfg.vocab_size, logits.device)
        if sp.constraint is not None:
            yield from self._constrained(logits, pos, sp, gen, adjust)
            return
        # the on-device greedy shortcuts return no logits: logprobs take the logits path
        greedy = sp.temperature == 0 and adjust is None and sp.logprobs is None
        burst = greedy and isinstance(self.backend, GreedyRun)
        fast = greedy and isinstance(self.backend, GreedyStep)
        # sampling on a GPU without penalties or logprobs: bursts too, each draw (sample's) feeding the next forward
        # on the device, one host sync per burst
        if sp.temperature > 0 and adjust is None and sp.logprobs is None and \
                logits.device.type in self.SAMPLED_BURST_DEVICES:
            burst = True
            run = lambda t, p, n: self._sampled_burst(t, p, n, sp, gen)  # noqa: E731
        elif burst:
            run = self.backend.greedy_run
        if adjust:
            logits = adjust(logits)
        tok = sample(logits, sp, gen)
        if sp.logprobs is not None:
            self.step_logprobs.append(token_logprob(logits, tok, sp.logprobs))
        produced = 1
        while True:
            yield tok
            if burst:  # the consumer asked for more: at least one token is still wanted
                n = max(1, min(self.GREEDY_BURST, sp.max_new_tokens - produced))
                toks = run(tok, pos, n)
                pos, produced = pos + n, produced + n
                yield from toks[:-1]
                tok = toks[-1]
                continue
            if fast:
                tok = self.backend.greedy_next(tok, pos)
            else:
                logits = self.backend.forward(torch.tensor([tok], dtype=torch.long), pos)[-1]
                if adjust:
                    adjust.add(tok)
                    logits = adjust(logits)
                tok = sample(logits, sp, gen)
                if sp.logprobs is not None:
                    self.step_logprobs.append(token_logprob(logits, tok, sp.logprobs))
            pos += 1
            produced += 1

    def _sampled_burst(self, tok: int, pos: int, n: int, sp: SamplingParams, gen) -> list[int]:
        """n sampled tokens after tok at pos: each step's draw (sample()'s, so the tokens are the step-by-step loop's)
        is the next step's input on the device; the tokens come back once."""
        t = torch.tensor([tok], dtype=torch.long, device=self.backend.device)
        out = []
        for i in range(n):
            t = draw(self.backend.forward(t, pos + i)[-1], sp, gen)
            out.append(t)
        return torch.cat(out).tolist()

    def _constrained(self, logits, pos: int, sp: SamplingParams, gen, adjust):
        """_tokens under a grammar: every token drawn from the grammar's allowed set (see the module doc)."""
        b = self.backend
        matcher = sp.constraint.matcher()
        words = (b.cfg.vocab_size + 31) // 32
        on_cpu = logits.device.type == "cpu"
        host = torch.zeros(words, dtype=torch.int32, pin_memory=not on_cpu and torch.cuda.is_available())
        dev = host if on_cpu else torch.empty(words, dtype=torch.int32, device=logits.device)
        # the kernel's masked argmax: greedy, no logit changes, no logprobs (they need the logits)
        kernel = (sp.temperature == 0 and adjust is None and sp.logprobs is None
                  and isinstance(b, MaskedStep))

        def next_mask() -> torch.Tensor:
            matcher.fill(host)
            if dev is not host:  # the previous step's read of dev is done: its token came back
                dev.copy_(host, non_blocking=True)
            return dev

        def choose(logits) -> int:
            if adjust:
                logits = adjust(logits)
            tok = sample(mask_logits(logits, next_mask()), sp, gen)
            if sp.logprobs is not None:  # the model's distribution, not the grammar's
                self.step_logprobs.append(token_logprob(logits, tok, sp.logprobs))
            return tok

        tok = choose(logits)
        if kernel and isinstance(b, PipelinedStep) and pos < b.max_seq_len:
            tok, pos = yield from self._piped(b, matcher, tok, pos)
        try:
            while True:
                matcher.consume(tok)
                yield tok
                if kernel:
                    b.set_token_mask(next_mask())
                    tok = b.greedy_next(tok, pos)
                else:
                    logits = b.forward(torch.tensor([tok], dtype=torch.long), pos)[-1]
                    if adjust:
                        adjust.add(tok)
                    tok = choose(logits)
                pos += 1
        finally:
            if kernel:
                b.set_token_mask(None)

    @staticmethod
    def _piped(b, matcher, tok: int, pos: int):
        """The pipelined masked steps (flint.backend_api.PipelinedStep): step n + 1 is enqueued before step n's mask is
        filled, and takes step n's token on the device, so the device runs step after step while the host consumes
        a token and fills the next mask. Returns (token, pos) where the context has no room for one more step."""
        b.pipe_begin(tok, pos)
        try:
            while pos + 1 < b.max_seq_len:
                b.pipe_ahead(pos + 1)
                matcher.consume(tok)
                yield tok
                matcher.fill(b.pipe_mask)
                b.pipe_publish()
                tok = b.pipe_token()
                pos += 1
            matcher.consume(tok)  # the last position: its step, then the sequential loop (which ends there)
            yield tok
            matcher.fill(b.pipe_mask)
            b.pipe_publish()
            tok = b.pipe_token()
            pos += 1
        finally:
            b.pipe_close()
        return tok, pos

    def _on_start(self) -> None:
        """Hook: a generation begins (subclasses reset their per-call stats)."""

    def _on_finish(self) -> None:
        """Hook: a generation ended (normally, by a stop, or because the consumer closed)."""

    def stream(self, prompt_ids: list[int], sp: SamplingParams, should_stop=None):
        """Yield (token_id, text_piece) as tokens decode; sets self.last when done.

        Text pieces need a tokenizer; without one they are "". Closing the generator early (a
        client that went away) stops decoding at the next token (greedy on a backend with greedy_run, and sampling
        on a GPU: after the current burst of at most GREEDY_BURST tokens, already computed). ``should_stop()``,
        when given, is asked between prefill chunks: True ends the call there, with nothing yielded
        and finish_reason "cancelled".
        """
        sp.validate()
        bad = self.unsupported(sp)
        if bad:
            raise ValueError(f"{bad[0]} is not supported by {type(self).__name__} (its token loop does not "
                             "apply it)")
        self.check_fits(len(prompt_ids), sp.max_new_tokens)
        vs = self.backend.cfg.vocab_size
        for t in prompt_ids:
            if not 0 <= int(t) < vs:
                raise ValueError(f"token id {int(t)} is outside the vocabulary (size {vs})")
        for t in sp.logit_bias:
            if not 0 <= int(t) < vs:
                raise ValueError(f"logit_bias: token id {int(t)} is outside the vocabulary (size {vs})")
        gen = None
        if sp.temperature > 0:
            gen = torch.Generator(device=self.backend.device)
            seed = sp.seed if sp.seed is not None else int.from_bytes(os.urandom(8), "little")
            gen.manual_seed(generator_seed(seed))
        dec = self.tokenizer.stream(sp.skip_special) if self.tokenizer is not None else None
        self.last = None
        self.step_logprobs = []
        self._on_start()
        if sp.max_new_tokens == 0:
            self.last = GenerationResult([], "", "length", len(prompt_ids), 0.0, 0.0)
            return
        t0 = time.perf_counter()
        out: list[int] = []
        text, emitted, finish = "", 0, "length"
        tokens = self._tokens(prompt_ids, sp, gen)
        self.should_stop = should_stop
        try:
            tok = next(tokens)
        except Cancelled:
            self._on_finish()
            self.last = GenerationResult([], "", "cancelled", len(prompt_ids), 0.0, 0.0)
            return
        finally:
            self.should_stop = None
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
                    hold = holdback(text, sp.stop) if sp.stop else 0
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
                                         time.perf_counter() - t_first,
                                         self.step_logprobs[:len(out)] if sp.logprobs is not None else None)
        if emitted < len(text):  # a held-back stop-string prefix that never completed
            yield out[-1], text[emitted:]

    def generate(self, prompt_ids: list[int], sp: SamplingParams) -> GenerationResult:
        for _ in self.stream(prompt_ids, sp):
            pass
        return self.last
