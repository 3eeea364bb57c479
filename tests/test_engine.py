"""The engine on a tiny random llama with a byte-level tokenizer (one token per UTF-8 byte).

Sampling is reproducible under a seed and differs across seeds; top_k=1 is greedy; stop strings
cut the text (finish_reason "stop"); eos stops; max_new_tokens gives "length"; streamed pieces
concatenate to the final text; StreamDecoder never emits a broken UTF-8 character; reusing the
KV prefix gives the same tokens as a fresh engine; one M-token step equals M single steps; the
sampling distribution obeys temperature, top-k and top-p. Run: ``pytest tests/test_engine.py``.
"""
from __future__ import annotations

import pytest
import torch

from flint.engine import Engine, SamplingParams, probs_from_logits
from flint.model import Transformer

pytestmark = pytest.mark.usefixtures("torch_one_thread")

MAX_SEQ = 96
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def backend(tiny_llama):
    return Transformer(tiny_llama.cfg, tiny_llama.params, max_seq_len=MAX_SEQ)


@pytest.fixture
def engine(backend, tiny_llama):
    """A fresh engine (empty prefix cache) over the shared backend."""
    return Engine(backend, tiny_llama.tokenizer)


@pytest.fixture(scope="module")
def prompt_ids(tiny_llama):
    return tiny_llama.tokenizer.encode(PROMPT)


def run(engine, ids, **kw):
    """generate() through stream(): (result, streamed pieces)."""
    pieces = [piece for _, piece in engine.stream(ids, SamplingParams(**kw))]
    return engine.last, pieces


def test_seeded_sampling_is_reproducible(engine, prompt_ids):
    a, _ = run(engine, prompt_ids, max_new_tokens=24, temperature=1.0, seed=11, ignore_eos=True)
    b, _ = run(engine, prompt_ids, max_new_tokens=24, temperature=1.0, seed=11, ignore_eos=True)
    c, _ = run(engine, prompt_ids, max_new_tokens=24, temperature=1.0, seed=12, ignore_eos=True)
    assert a.token_ids == b.token_ids and a.text == b.text
    assert a.token_ids != c.token_ids, "seeds 11 and 12 sampled the same 24 tokens"
    greedy, _ = run(engine, prompt_ids, max_new_tokens=24, ignore_eos=True)
    assert a.token_ids != greedy.token_ids, "temperature 1 sampling collapsed to greedy"


def test_top_k_1_is_greedy(engine, prompt_ids):
    greedy, _ = run(engine, prompt_ids, max_new_tokens=20, ignore_eos=True)
    top1, _ = run(engine, prompt_ids, max_new_tokens=20, temperature=1.3, top_k=1, seed=5,
                  ignore_eos=True)
    assert top1.token_ids == greedy.token_ids


def test_tiny_top_p_is_greedy(engine, prompt_ids):
    greedy, _ = run(engine, prompt_ids, max_new_tokens=20, ignore_eos=True)
    nucleus, _ = run(engine, prompt_ids, max_new_tokens=20, temperature=1.0, top_p=1e-6, seed=5,
                     ignore_eos=True)
    assert nucleus.token_ids == greedy.token_ids


def test_max_new_tokens_gives_length(engine, prompt_ids):
    res, pieces = run(engine, prompt_ids, max_new_tokens=17, ignore_eos=True)
    assert res.finish_reason == "length" and len(res.token_ids) == 17
    assert res.prompt_tokens == len(prompt_ids)
    assert "".join(pieces) == res.text
    empty, _ = run(engine, prompt_ids, max_new_tokens=0)
    assert empty.token_ids == [] and empty.finish_reason == "length"


def test_eos_stops(backend, tiny_llama, prompt_ids):
    free, _ = run(Engine(backend, tiny_llama.tokenizer), prompt_ids, max_new_tokens=30, ignore_eos=True)
    eos = free.token_ids[6]  # declare a token the model emits as eos
    first = free.token_ids.index(eos)
    res, pieces = run(Engine(backend, tiny_llama.tokenizer, eos_token_ids=[eos]), prompt_ids,
                      max_new_tokens=30)
    assert res.finish_reason == "stop"
    assert res.token_ids == free.token_ids[: first + 1]  # the eos token is the last one returned
    assert "".join(pieces) == res.text
    ignored, _ = run(Engine(backend, tiny_llama.tokenizer, eos_token_ids=[eos]), prompt_ids,
                     max_new_tokens=30, ignore_eos=True)
    assert ignored.token_ids == free.token_ids


def test_stop_string_cuts_text(engine, prompt_ids):
    free, free_pieces = run(engine, prompt_ids, max_new_tokens=40, ignore_eos=True)
    text = free.text
    assert "".join(free_pieces) == text
    # a stop string from the middle of the free-running text, at its first occurrence
    start = next(i for i in range(len(text) // 3, len(text) - 3) if text.find(text[i:i + 3]) == i)
    stop = text[start: start + 3]
    res, pieces = run(engine, prompt_ids, max_new_tokens=40, ignore_eos=True, stop=["\x00never", stop])
    assert res.finish_reason == "stop"
    assert res.text == text[:start], (res.text, stop)
    assert "".join(pieces) == res.text
    assert res.token_ids == free.token_ids[: len(res.token_ids)] and len(res.token_ids) < 40


def test_stop_string_prefix_held_back_then_released(engine, prompt_ids):
    """A stop string whose start appears but never completes: the held text is released."""
    free, _ = run(engine, prompt_ids, max_new_tokens=30, ignore_eos=True)
    tail = free.text[-2:]
    res, pieces = run(engine, prompt_ids, max_new_tokens=30, ignore_eos=True,
                      stop=[tail + "\x00\x01never"])
    assert res.finish_reason == "length" and res.text == free.text
    assert "".join(pieces) == free.text


@pytest.mark.parametrize("text", ["héllo wörld — 東京 😀🙂 ß", "€€€ 𝄞 ok"])
def test_stream_decoder_never_yields_broken_utf8(tiny_llama, text):
    tok = tiny_llama.tokenizer
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8")), "byte tokenizer: one token per byte"
    dec = tok.stream()
    pieces = [dec.feed(i) for i in ids]
    for p in pieces:
        assert "\ufffd" not in p
        p.encode("utf-8")  # a complete, valid string
    assert any(p == "" for p in pieces), "multi-byte characters should be held back"
    assert "".join(pieces) + dec.flush() == text


def test_prefix_reuse_matches_fresh_engine(backend, tiny_llama, prompt_ids):
    class Counting:
        def __init__(self, inner):
            self.inner, self.tokens = inner, 0
            self.cfg, self.device, self.max_seq_len = inner.cfg, inner.device, inner.max_seq_len

        def forward(self, tokens, start_pos, return_hidden=False, last_only=False):
            self.tokens += tokens.shape[-1]
            return self.inner.forward(tokens, start_pos, return_hidden, last_only)

    counting = Counting(backend)
    warm = Engine(counting, tiny_llama.tokenizer)
    first, _ = run(warm, prompt_ids, max_new_tokens=12, ignore_eos=True)
    follow_up = prompt_ids + first.token_ids + tiny_llama.tokenizer.encode(" and then")
    counting.tokens = 0
    again, _ = run(warm, follow_up, max_new_tokens=12, ignore_eos=True)
    # only the part of the follow-up not already cached was prefilled (+ 11 decode steps)
    cached = len(prompt_ids) + len(first.token_ids) - 1  # the last sampled token was never fed
    assert counting.tokens == len(follow_up) - cached + 11
    fresh, _ = run(Engine(Transformer(tiny_llama.cfg, tiny_llama.params, max_seq_len=MAX_SEQ),
                          tiny_llama.tokenizer), follow_up, max_new_tokens=12, ignore_eos=True)
    assert again.token_ids == fresh.token_ids
    # a shorter, diverging prompt afterwards (the cache rolls back) still matches a fresh engine
    branch = prompt_ids[:-2] + tiny_llama.tokenizer.encode("X")
    rolled, _ = run(warm, branch, max_new_tokens=12, ignore_eos=True)
    fresh, _ = run(Engine(Transformer(tiny_llama.cfg, tiny_llama.params, max_seq_len=MAX_SEQ),
                          tiny_llama.tokenizer), branch, max_new_tokens=12, ignore_eos=True)
    assert rolled.token_ids == fresh.token_ids


class _Bursting:
    """A backend with greedy_run (as compiled and megakernel have), recording the bursts it is asked for."""

    def __init__(self, inner):
        self.inner, self.bursts = inner, []
        self.cfg, self.device, self.max_seq_len = inner.cfg, inner.device, inner.max_seq_len

    def forward(self, tokens, start_pos, return_hidden=False, last_only=False):
        return self.inner.forward(tokens, start_pos, return_hidden, last_only)

    def greedy_run(self, token, pos, n):
        self.bursts.append((pos, n))
        out = []
        for i in range(n):
            token = int(self.inner.forward(torch.tensor([token]), pos + i)[-1].argmax())
            out.append(token)
        return out


class _Forwards:
    """A backend recording the (tokens' device, positions) of every forward it is asked for."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []
        self.cfg, self.device, self.max_seq_len = inner.cfg, inner.device, inner.max_seq_len

    def forward(self, tokens, start_pos, return_hidden=False, last_only=False):
        self.calls.append((start_pos, tokens.numel()))
        return self.inner.forward(tokens, start_pos, return_hidden, last_only)


@pytest.mark.parametrize("kw", [dict(temperature=0.9), dict(temperature=0.7, top_k=40, top_p=0.9, min_p=0.02)])
def test_sampled_bursts_match_step_by_step(backend, tiny_llama, prompt_ids, monkeypatch, kw):
    # sampling in bursts (each draw the next forward's input, the tokens read back once a burst) draws the same
    # tokens as the token-by-token loop from the same seed, and stops at eos inside a burst
    monkeypatch.setattr(Engine, "SAMPLED_BURST_DEVICES", ())
    step, _ = run(Engine(backend, tiny_llama.tokenizer), prompt_ids, max_new_tokens=21, ignore_eos=True, seed=3, **kw)
    monkeypatch.setattr(Engine, "SAMPLED_BURST_DEVICES", ("cpu", "cuda"))
    bursts, inner = [], Engine._sampled_burst
    monkeypatch.setattr(Engine, "_sampled_burst", lambda self, tok, pos, n, sp, gen: bursts.append((pos, n)) or
                        inner(self, tok, pos, n, sp, gen))
    f = _Forwards(backend)
    eng = Engine(f, tiny_llama.tokenizer)
    burst, pieces = run(eng, prompt_ids, max_new_tokens=21, ignore_eos=True, seed=3, **kw)
    assert burst.token_ids == step.token_ids and "".join(pieces) == burst.text
    n0 = len(prompt_ids)
    assert bursts == [(n0, 8), (n0 + 8, 8), (n0 + 16, 4)]
    decode = [c for c in f.calls if c[1] == 1]
    assert [c[0] for c in decode] == list(range(n0, n0 + 20))  # 20 steps after the prefill's token, none past
    eos = step.token_ids[9]
    first = step.token_ids.index(eos)
    stopped, _ = run(Engine(backend, tiny_llama.tokenizer, eos_token_ids=[eos]), prompt_ids, max_new_tokens=21,
                     seed=3, **kw)
    assert stopped.finish_reason == "stop" and stopped.token_ids == step.token_ids[: first + 1]


def test_greedy_bursts_match_step_by_step(backend, tiny_llama, prompt_ids):
    # greedy decoding through greedy_run bursts gives the step-by-step tokens, never asks for positions past
    # max_new_tokens, stops at eos inside a burst, and its cache bookkeeping serves a follow-up prompt
    free, _ = run(Engine(backend, tiny_llama.tokenizer), prompt_ids, max_new_tokens=21, ignore_eos=True)
    b = _Bursting(backend)
    res, pieces = run(Engine(b, tiny_llama.tokenizer), prompt_ids, max_new_tokens=21, ignore_eos=True)
    assert res.token_ids == free.token_ids and "".join(pieces) == res.text
    n0 = len(prompt_ids)
    assert b.bursts == [(n0, 8), (n0 + 8, 8), (n0 + 16, 4)]  # 1 token from the prefill + 20 in bursts
    eos = free.token_ids[11]
    first = free.token_ids.index(eos)
    b.bursts.clear()
    stopped, _ = run(Engine(b, tiny_llama.tokenizer, eos_token_ids=[eos]), prompt_ids, max_new_tokens=21)
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[: first + 1]
    eng = Engine(b, tiny_llama.tokenizer)
    first_turn, _ = run(eng, prompt_ids, max_new_tokens=10, ignore_eos=True)
    follow = prompt_ids + first_turn.token_ids + tiny_llama.tokenizer.encode(" more")
    again, _ = run(eng, follow, max_new_tokens=10, ignore_eos=True)
    fresh, _ = run(Engine(backend, tiny_llama.tokenizer), follow, max_new_tokens=10, ignore_eos=True)
    assert again.token_ids == fresh.token_ids


def test_m_token_step_equals_m_single_steps(tiny_llama):
    ids = torch.tensor(tiny_llama.tokenizer.encode("The quick brown fox jumps"))
    a = Transformer(tiny_llama.cfg, tiny_llama.params, max_seq_len=MAX_SEQ)
    b = Transformer(tiny_llama.cfg, tiny_llama.params, max_seq_len=MAX_SEQ)
    a.forward(ids[:6], 0)
    b.forward(ids[:6], 0)
    m = len(ids) - 6
    block = a.forward(ids[6:], 6)  # one verify-style step of M tokens
    singles = torch.cat([b.forward(ids[p: p + 1], p) for p in range(6, len(ids))])
    assert block.shape == singles.shape == (m, tiny_llama.cfg.vocab_size)
    # fp32: a different matmul shape may round differently; 1e-5 of the logit scale is far
    # below any real indexing or masking error
    torch.testing.assert_close(block, singles, rtol=0, atol=1e-5 * singles.abs().max().item())
    kv_a, kv_b = a.k_cache[:, :, :, : len(ids)], b.k_cache[:, :, :, : len(ids)]
    torch.testing.assert_close(kv_a, kv_b, rtol=0, atol=1e-5 * kv_b.abs().max().item())


def test_probs_from_logits():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, generator=g) * 3
    p = probs_from_logits(logits, 1.0)
    torch.testing.assert_close(p, torch.softmax(logits, -1))
    cold, hot = probs_from_logits(logits, 0.25), probs_from_logits(logits, 4.0)
    assert cold.max() > p.max() > hot.max()
    k = probs_from_logits(logits, 1.0, top_k=5)
    assert (k > 0).sum() == 5 and set(k.nonzero().flatten().tolist()) == set(logits.topk(5).indices.tolist())
    torch.testing.assert_close(k.sum(), torch.tensor(1.0))
    nucleus = probs_from_logits(logits, 1.0, top_p=0.6)
    kept = nucleus > 0
    order = p.argsort(descending=True)
    n = int(kept.sum())
    # the kept set is the smallest most-likely prefix whose mass reaches top_p
    assert set(order[:n].tolist()) == set(kept.nonzero().flatten().tolist())
    assert p[order[:n]].sum() >= 0.6 > p[order[: n - 1]].sum()
    torch.testing.assert_close(nucleus[kept], p[kept] / p[kept].sum())


@pytest.mark.parametrize("bad", [dict(max_new_tokens=-1), dict(temperature=-0.5), dict(top_p=0.0),
                                 dict(top_p=1.5), dict(top_k=-2)])
def test_sampling_params_validation(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad).validate()


# ------------------------------------------------------------------ prefill: the last logits only, in chunks

class _Recording:
    """A backend wrapper recording each forward's (M, start_pos, last_only)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []
        self.cfg, self.device, self.max_seq_len = inner.cfg, inner.device, inner.max_seq_len

    def forward(self, tokens, start_pos, return_hidden=False, last_only=False):
        self.calls.append((tokens.shape[-1], start_pos, last_only))
        return self.inner.forward(tokens, start_pos, return_hidden, last_only)


def test_last_only_is_the_last_row(tiny_llama):
    from flint.compiled import CompiledBackend

    ids = torch.tensor(tiny_llama.tokenizer.encode("The quick brown fox jumps"))
    for make in (lambda: Transformer(tiny_llama.cfg, tiny_llama.params, max_seq_len=MAX_SEQ),
                 lambda: CompiledBackend(tiny_llama.cfg, tiny_llama.params, MAX_SEQ, device="cpu")):
        a, b = make(), make()
        full, hid = a.forward(ids, 0, return_hidden=True)
        last, last_hid = b.forward(ids, 0, return_hidden=True, last_only=True)
        assert last.shape == (1, tiny_llama.cfg.vocab_size) and last_hid.shape == (1, hid.shape[-1])
        torch.testing.assert_close(last, full[-1:], rtol=0, atol=1e-5 * full.abs().max().item())
        # the K/V of every position were written all the same: the next step agrees
        nxt = torch.tensor([5])
        torch.testing.assert_close(b.forward(nxt, len(ids)), a.forward(nxt, len(ids)))


def test_prefill_in_chunks_of_last_logits_and_stop_between_chunks(backend, tiny_llama):
    ids = tiny_llama.tokenizer.encode("a prompt of forty-some byte tokens, long enough")
    rec = _Recording(backend)
    eng = Engine(rec, tiny_llama.tokenizer)
    eng.PREFILL_CHUNK = 16
    free, _ = run(Engine(backend, tiny_llama.tokenizer), ids, max_new_tokens=6, ignore_eos=True)
    res, _ = run(eng, ids, max_new_tokens=6, ignore_eos=True)
    assert res.token_ids == free.token_ids
    n = len(ids)
    prefill = [c for c in rec.calls if c[0] > 1 or c[1] < n]
    assert prefill == [(min(16, n - s), s, True) for s in range(0, n, 16)]
    # a caller that leaves after the first chunk: no more forwards, nothing yielded
    rec.calls.clear()
    eng2 = Engine(rec, tiny_llama.tokenizer)
    eng2.PREFILL_CHUNK = 16
    asked = []

    def should_stop():
        asked.append(len(rec.calls))
        return True

    out = list(eng2.stream(ids, SamplingParams(max_new_tokens=6), should_stop=should_stop))
    assert out == [] and eng2.last.finish_reason == "cancelled" and eng2.last.token_ids == []
    assert rec.calls == [(16, 0, True)] and asked == [1]
    assert eng2.cached == ids[:16]  # the chunk done stays cached; the next call continues from it
    again, _ = run(eng2, ids, max_new_tokens=6, ignore_eos=True)
    assert again.token_ids == free.token_ids and rec.calls[1][1] == 16


# ------------------------------------------------------------------ logit bias, penalties, min_p, seeds

def _manual_greedy(backend, ids, n, adjust):
    """Greedy decoding written out step by step: adjust(logits, generated) before each argmax."""
    model = Transformer(backend.cfg, backend.params, max_seq_len=MAX_SEQ)
    logits = model.forward(torch.tensor(ids), 0)[-1]
    out = []
    for i in range(n):
        tok = int(torch.argmax(adjust(logits.clone(), out)))
        out.append(tok)
        logits = model.forward(torch.tensor([tok]), len(ids) + i)[-1]
    return out


def test_logit_bias_changes_greedy_output_and_skips_the_greedy_shortcut(backend, tiny_llama, prompt_ids):
    b = _Bursting(backend)
    free, _ = run(Engine(b, tiny_llama.tokenizer), prompt_ids, max_new_tokens=10, ignore_eos=True)
    assert b.bursts, "the plain greedy run should use greedy_run"
    b.bursts.clear()
    x = tiny_llama.tokenizer.encode("x")[0]
    biased, _ = run(Engine(b, tiny_llama.tokenizer), prompt_ids, max_new_tokens=10, ignore_eos=True,
                    logit_bias={x: 100.0})
    assert biased.token_ids == [x] * 10 and biased.token_ids != free.token_ids
    assert b.bursts == [], "greedy_run cannot apply a logit bias"
    banned = free.token_ids[0]
    res, _ = run(Engine(b, tiny_llama.tokenizer), prompt_ids, max_new_tokens=10, ignore_eos=True,
                 logit_bias={banned: -100.0})
    assert banned not in res.token_ids


@pytest.mark.parametrize("kw", [dict(frequency_penalty=2.0), dict(presence_penalty=2.0),
                                dict(frequency_penalty=-1.0, presence_penalty=1.5),
                                dict(repetition_penalty=3.0)])
def test_penalties_match_their_definitions(backend, tiny_llama, prompt_ids, kw):
    f, p = kw.get("frequency_penalty", 0.0), kw.get("presence_penalty", 0.0)
    r = kw.get("repetition_penalty", 1.0)

    def adjust(logits, out):
        for t in set(out):
            logits[t] -= f * out.count(t) + p
        for t in set(out) | set(prompt_ids):
            logits[t] = logits[t] / r if logits[t] > 0 else logits[t] * r
        return logits

    want = _manual_greedy(backend, prompt_ids, 24, adjust)
    plain, _ = run(Engine(backend, tiny_llama.tokenizer), prompt_ids, max_new_tokens=24, ignore_eos=True)
    got, _ = run(Engine(backend, tiny_llama.tokenizer), prompt_ids, max_new_tokens=24, ignore_eos=True, **kw)
    assert got.token_ids == want
    assert got.token_ids != plain.token_ids, f"{kw} did not change 24 greedy tokens"


def test_min_p_keeps_tokens_near_the_top():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(60, generator=g) * 2
    p = torch.softmax(logits, -1)
    q = probs_from_logits(logits, 1.0, min_p=0.2)
    kept = q > 0
    assert kept.equal(p >= 0.2 * p.max()) and 1 < int(kept.sum()) < 60
    torch.testing.assert_close(q[kept], p[kept] / p[kept].sum())


def test_min_p_changes_sampling(engine, prompt_ids):
    kw = dict(max_new_tokens=24, temperature=1.5, seed=4, ignore_eos=True)
    loose, _ = run(engine, prompt_ids, **kw)
    tight, _ = run(engine, prompt_ids, min_p=0.9, **kw)
    greedy, _ = run(engine, prompt_ids, max_new_tokens=24, ignore_eos=True)
    assert tight.token_ids != loose.token_ids
    # min_p near 1 leaves (almost always) only the most likely token: greedy
    near, _ = run(engine, prompt_ids, min_p=0.999, **kw)
    assert near.token_ids == greedy.token_ids


def test_seeds_use_all_64_bits(engine, prompt_ids):
    kw = dict(max_new_tokens=16, temperature=1.0, ignore_eos=True)
    base = 12345
    texts = {s: run(engine, prompt_ids, seed=s, **kw)[0].token_ids
             for s in (base, base + 2**32, base + 2**62, -base, 2**63 - 1)}
    assert len({tuple(t) for t in texts.values()}) == len(texts), "two 64-bit seeds sampled the same tokens"
    assert run(engine, prompt_ids, seed=base + 2**32, **kw)[0].token_ids == texts[base + 2**32]


def test_speculative_engine_refuses_what_its_loop_does_not_apply(backend, tiny_llama, prompt_ids):
    from flint.speculative.verify import SpeculativeEngine

    eng = SpeculativeEngine(backend, tiny_llama.tokenizer, draft=None, k=2)
    for kw, name in ((dict(presence_penalty=1.0), "presence_penalty"), (dict(logit_bias={5: 1.0}), "logit_bias"),
                     (dict(min_p=0.1, temperature=1.0), "min_p"), (dict(repetition_penalty=1.2), "repetition_penalty")):
        with pytest.raises(ValueError, match=name):
            eng.generate(prompt_ids, SamplingParams(max_new_tokens=4, **kw))
        assert eng.unsupported(SamplingParams(**kw)) == [name]
    assert Engine(backend).unsupported(SamplingParams(presence_penalty=1.0, min_p=0.5)) == []


@pytest.mark.parametrize("bad", [dict(min_p=1.5), dict(presence_penalty=2.5), dict(frequency_penalty=-3.0),
                                 dict(repetition_penalty=0.0), dict(logit_bias={3: 101.0}), dict(seed=2**64)])
def test_new_sampling_params_validation(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad).validate()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 0.9)])
def test_sample_draws_follow_the_sampling_distribution(temperature, top_k, top_p):
    """flint.engine.sample (inverse CDF of one uniform): 20000 draws from fixed logits follow probs_from_logits
    (chi-square, p-value > 1e-3; fixed seeds, so the outcome is deterministic), and never a token of probability 0."""
    from test_speculative import chi_square_pvalue

    from flint.engine import probs_from_logits, sample

    logits = torch.randn(12, generator=torch.Generator().manual_seed(3)) * 2
    sp = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    p = probs_from_logits(logits, temperature, top_k, top_p)
    g = torch.Generator().manual_seed(4)
    counts = torch.zeros(12)
    for _ in range(20000):
        counts[sample(logits, sp, g)] += 1
    assert (counts[p == 0] == 0).all()
    assert chi_square_pvalue(counts, p * 20000) > 1e-3


@pytest.mark.parametrize("v", [1, 7, 1024, 1500, 3072, 100352])
def test_inverse_cdf_draw_is_the_first_token_past_u(v):
    """The blockwise inverse CDF (flint.engine.inverse_cdf_draw: running sums per block of CDF_BLOCK, then over the
    blocks) picks the token a float64 cumulative sum picks, up to fp32 rounding at a boundary, at vocabularies inside
    one block, at block edges and beyond; never a token of weight 0 (zeros everywhere, u = 0, u just below 1)."""
    from flint.engine import inverse_cdf_draw

    g = torch.Generator().manual_seed(v)
    for trial in range(60):
        p = torch.rand(v, generator=g) ** 6
        if trial % 2:
            p[torch.rand(v, generator=g) < 0.8] = 0.0
        p[int(torch.randint(0, v, (1,), generator=g))] = 0.5  # a positive total
        u = torch.rand(1, generator=g)
        if trial % 20 == 0:
            u = torch.tensor([0.0])
        elif trial % 20 == 1:
            u = torch.tensor([1.0 - 2.0 ** -24])
        i = int(inverse_cdf_draw(p, u))
        assert 0 <= i < v and p[i] > 0
        c = p.double().cumsum(0)
        t, tol = float(u) * float(c[-1]), 1e-5 * float(c[-1])
        lo = float(c[i - 1]) if i > 0 else 0.0
        assert lo - tol <= t <= float(c[i]) + tol, (trial, i, t, lo, float(c[i]))
