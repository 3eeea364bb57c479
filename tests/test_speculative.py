"""Speculative decoding is exact: greedy output equals plain greedy for any draft and K, sampled
output follows the target's distribution (chi-square against the exact joint law), and the KV
cache after rejections equals a fresh prefill; text and stop strings behave as Engine's. Tiny
random models on CPU; about 25 s.

Run: ``pytest tests/test_speculative.py``
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from flint.config import from_hf_dict
from flint.speculative.draft_head import DraftError, DraftHead, draft_config_for
from flint.engine import Engine, SamplingParams, probs_from_logits
from flint.loading import LoadedModel, expected_shapes
from flint.model import Transformer
from flint.speculative import verify as speculative
from flint.speculative.verify import SpeculativeEngine, verify_sampling


@pytest.fixture(autouse=True, scope="module")
def one_thread(torch_one_thread):
    """Tiny tensors: intra-op threads only add contention on a shared 2-core CI box."""


def tiny_lm(seed=0, vocab=10, hidden=32, layers=2, eos=()):
    cfg = from_hf_dict(dict(
        model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=64,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
        eos_token_id=list(eos)), "tiny")
    g = torch.Generator().manual_seed(seed)
    params = {}
    for name, shape in expected_shapes(cfg).items():
        if name.endswith("norm"):
            params[name] = 1 + 0.1 * torch.randn(shape, generator=g)
        else:  # logits of std ~1.5: spread enough for sampling, ties rare for greedy
            scale = 1.5 if name == "lm_head" else 1.0
            params[name] = torch.randn(shape, generator=g) * scale / shape[1] ** 0.5
    return LoadedModel(cfg, params, None, "tiny")


def random_draft(lm, seed=0, vocab=None):
    """vocab: a drafting vocabulary (token ids) or None for all of them."""
    torch.manual_seed(seed)
    return DraftHead(draft_config_for(lm.cfg, intermediate_size=48)).attach_target(lm.cfg, lm.params, vocab=vocab)


class ScriptedDraft:
    """Proposes the known continuation, but a wrong token wherever position % wrong_every == 0:
    runs of accepted drafts, then rejections, at varying offsets."""

    def __init__(self, expected: list[int], vocab: int, wrong_every: int = 4):
        self.expected, self.vocab, self.wrong_every = expected, vocab, wrong_every

    def propose(self, ctx, hidden, k, sp=None, gen=None):
        toks = []
        for i in range(len(ctx), len(ctx) + k):
            t = self.expected[i] if i < len(self.expected) else 0
            toks.append((t + 1) % self.vocab if i % self.wrong_every == 0 else t)
        return torch.tensor(toks), None


PROMPTS = [[1, 2, 3], [4, 0, 7, 7, 2, 9, 1], [5]]


@pytest.mark.parametrize("k,vocab", [(1, None), (2, None), (3, None), (5, None), (3, [9, 2, 5, 0]), (5, [7])])
def test_greedy_identical_with_random_draft(k, vocab):
    """Any draft, any K, a drafting vocabulary or none: the output is plain greedy's."""
    lm = tiny_lm(eos=(5,))
    be = Transformer(lm.cfg, lm.params, 128)
    draft = random_draft(lm, seed=k, vocab=None if vocab is None else torch.tensor(vocab))
    for prompt in PROMPTS:
        sp = SamplingParams(max_new_tokens=30)
        want = Engine(be).generate(prompt, sp)
        eng = SpeculativeEngine(be, None, draft, k=k)
        got = eng.generate(prompt, sp)
        assert got.token_ids == want.token_ids, (k, prompt)
        assert got.finish_reason == want.finish_reason
        st = eng.last_stats
        assert st.steps >= 1 and 1.0 <= st.tokens_per_step <= k + 1
        emitted = st.accepted + st.steps  # tokens the verify steps produced after the first
        if got.finish_reason == "length":  # k is capped so that nothing is produced in vain
            assert emitted == len(got.token_ids) - 1
        else:  # an eos may end a run early
            assert emitted >= len(got.token_ids) - 1


@pytest.mark.parametrize("k", [2, 3, 6])
def test_greedy_identical_with_partly_right_draft(k):
    lm = tiny_lm(seed=1)
    be = Transformer(lm.cfg, lm.params, 128)
    for prompt in PROMPTS:
        sp = SamplingParams(max_new_tokens=40)
        want = Engine(be).generate(prompt, sp).token_ids
        eng = SpeculativeEngine(be, None, ScriptedDraft(prompt + want, lm.cfg.vocab_size), k=k)
        got = eng.generate(prompt, sp).token_ids
        assert got == want
        st = eng.last_stats
        # every emitted token after the first came from a verify step: accepted drafts or the target's own
        assert st.accepted + st.steps >= len(got) - 1
        assert 0 < st.accepted < st.drafted  # both paths ran
        assert st.tokens_per_step > 1.5


class RecordingDraft(ScriptedDraft):
    """ScriptedDraft with ``begin`` / ``finish`` (pipelined=True): records the hidden state and context length each
    step's proposals were made from; a rollout begun from device inputs must have been handed the token the host
    accepts (checked in finish) and asked for no fewer tokens than the step uses."""

    def __init__(self, expected, vocab, pipelined):
        super().__init__(expected, vocab)
        self.pipelined, self.seen, self.begun = pipelined, [], 0

    def propose(self, ctx, hidden, k, sp=None, gen=None):
        self.seen.append((len(ctx), hidden.clone()))
        return super().propose(ctx, hidden, k, sp, gen)

    def begin(self, hidden, tok, k):
        self.begun += 1
        return int(tok[0]), hidden.clone(), k

    def finish(self, pending, ctx, k):
        tok, hidden, k_begun = pending
        assert tok == ctx[-1] and k <= k_begun, (tok, ctx[-1], k, k_begun)
        self.seen.append((len(ctx), hidden))
        return super().propose(ctx, hidden, k)[0]


@pytest.mark.parametrize("k", [1, 3, 6])
def test_pipelined_step_drafts_from_the_accepted_state(k):
    """The greedy step that begins the next rollout on the device before the host reads the verify back: the
    rollout gets the token and hidden state the host-side acceptance picks, k is never short, the output is
    plain greedy's (acceptances and rejections both ran; the context end caps k)."""
    lm = tiny_lm(seed=1)
    be = Transformer(lm.cfg, lm.params, 64)
    total = speculative.SpeculativeStats()
    for prompt in PROMPTS + [list(range(10)) * 2]:
        sp = SamplingParams(max_new_tokens=min(40, 64 - len(prompt)))
        want = Engine(be).generate(prompt, sp).token_ids
        runs = {}
        for pipelined in (False, True):
            d = RecordingDraft(prompt + want, lm.cfg.vocab_size, pipelined)
            eng = SpeculativeEngine(be, None, d, k=k)
            assert eng.generate(prompt, sp).token_ids == want
            runs[pipelined] = d
            total.add(eng.last_stats)
        assert runs[True].begun >= len(runs[True].seen) - 1 and runs[False].begun == 0
        assert [n for n, _ in runs[True].seen] == [n for n, _ in runs[False].seen]
        for (_, a), (_, b) in zip(runs[True].seen, runs[False].seen):
            assert torch.equal(a, b)
    assert 0 < total.accepted < total.drafted


def test_kv_cache_after_rejections_equals_fresh_prefill():
    lm = tiny_lm(seed=2)
    prompt = [3, 1, 4, 1, 5]
    sp = SamplingParams(max_new_tokens=37)
    be = Transformer(lm.cfg, lm.params, 128)
    want = Engine(be).generate(prompt, sp).token_ids
    spec_be = Transformer(lm.cfg, lm.params, 128)
    eng = SpeculativeEngine(spec_be, None, ScriptedDraft(prompt + want, lm.cfg.vocab_size, 3), k=4)
    got = eng.generate(prompt, sp).token_ids
    assert got == want
    assert eng.last_stats.drafted - eng.last_stats.accepted >= 5  # rejected drafts were written
    seq = prompt + got[:-1]
    assert eng.cached == seq
    fresh = Transformer(lm.cfg, lm.params, 128)
    fresh.forward(torch.tensor(seq), 0)
    n = len(seq)
    for name in ("k_cache", "v_cache"):
        a, b = getattr(spec_be, name)[:, :, :, :n], getattr(fresh, name)[:, :, :, :n]
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    # and the next step sees the same context
    nxt = torch.tensor([got[-1]])
    torch.testing.assert_close(spec_be.forward(nxt, n), fresh.forward(nxt, n), rtol=1e-5, atol=1e-5)


def test_prefix_reuse_across_calls():
    """Multi-turn: the second call re-sends the first exchange; only the tail is prefilled."""
    lm = tiny_lm(seed=3)
    sp = SamplingParams(max_new_tokens=20)
    be = Transformer(lm.cfg, lm.params, 128)
    eng = SpeculativeEngine(be, None, random_draft(lm), k=3)
    first = eng.generate([1, 2, 3], sp).token_ids
    turn2 = [1, 2, 3] + first + [6, 6]
    got = eng.generate(turn2, sp).token_ids
    want = Engine(Transformer(lm.cfg, lm.params, 128)).generate(turn2, sp).token_ids
    assert got == want


def test_text_and_stop_strings_as_engine(tiny_llama):
    """Streamed pieces, text, finish reason and tokens equal Engine's, with stop strings hit inside
    a run of accepted drafts and a stop-string prefix held back then released (byte tokenizer)."""
    tok = tiny_llama.tokenizer
    be = Transformer(tiny_llama.cfg, tiny_llama.params, 96)
    ids = tok.encode("Once upon a time")
    free = Engine(be, tok).generate(ids, SamplingParams(max_new_tokens=40, ignore_eos=True))
    text = free.text
    assert len(text) > 24
    for stop in ([], [text[10:13]], [text[20:22] + "\x00never"]):
        sp = SamplingParams(max_new_tokens=40, ignore_eos=True, stop=stop)
        plain = Engine(be, tok)
        want = [piece for _, piece in plain.stream(ids, sp)]
        draft = ScriptedDraft(ids + free.token_ids, tiny_llama.cfg.vocab_size, 5)
        eng = SpeculativeEngine(be, tok, draft, k=4)
        got = [piece for _, piece in eng.stream(ids, sp)]
        assert got == want, stop
        assert (eng.last.text, eng.last.finish_reason, eng.last.token_ids) == \
            (plain.last.text, plain.last.finish_reason, plain.last.token_ids)
        assert eng.last_stats.accepted > 0
        assert eng.last.finish_reason == ("stop" if stop == [text[10:13]] else "length")


def test_context_end_caps_k():
    lm = tiny_lm(seed=4)
    be = Transformer(lm.cfg, lm.params, 32)
    prompt = list(range(10)) * 2
    sp = SamplingParams(max_new_tokens=12)  # prompt + new = the whole 32-token context
    want = Engine(be).generate(prompt, sp).token_ids
    got = SpeculativeEngine(be, None, random_draft(lm), k=8).generate(prompt, sp).token_ids
    assert got == want and len(got) == 12


def test_bad_k_is_refused():
    lm = tiny_lm()
    be = Transformer(lm.cfg, lm.params, 32)
    with pytest.raises(ValueError, match="k \\(draft tokens per step\\)"):
        SpeculativeEngine(be, None, random_draft(lm), k=0)


# ------------------------------------------------------------------ sampling is lossless

def test_verify_sampling_one_step_returns_p():
    """One proposal x ~ q, then min(1, p/q) acceptance or the residual: the token is exactly ~ p."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]])
    q = torch.tensor([[0.1, 0.1, 0.2, 0.3, 0.3]])
    counts = torch.zeros(5)
    n_draws = 20000
    for _ in range(n_draws):
        x = torch.multinomial(q[0], 1, generator=g)
        n, nxt = verify_sampling(p, q, x, g).tolist()
        counts[x if n == 1 else nxt] += 1
    assert chi_square_pvalue(counts, p[0] * n_draws) > 1e-3


def chi_square_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells with expected count < 5 are pooled into one."""
    observed, expected = observed.double().flatten(), expected.double().flatten()
    small = expected < 5
    o = torch.cat((observed[~small], observed[small].sum().view(1)))
    e = torch.cat((expected[~small], expected[small].sum().view(1)))
    keep = e > 0
    assert not (o[~keep] > 0).any(), "observed a token sequence of probability 0"
    o, e = o[keep], e[keep]
    stat = ((o - e) ** 2 / e).sum()
    df = torch.tensor(float(len(o) - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


def exact_joint_t2_t3(lm, prompt, sp) -> torch.Tensor:
    """P(second, third generated token) under plain sampling, summed over the first."""
    v = lm.cfg.vocab_size
    m = Transformer(lm.cfg, lm.params, 64)

    def dist(ids):
        logits = m.forward(torch.tensor(ids), 0)[-1]
        return probs_from_logits(logits, sp.temperature, sp.top_k, sp.top_p).double()

    p1 = dist(prompt)
    joint = torch.zeros(v, v, dtype=torch.float64)
    for t1 in range(v):
        if p1[t1] == 0:
            continue
        p2 = dist(prompt + [t1])
        for t2 in range(v):
            if p2[t2] > 0:
                joint[t2] += p1[t1] * p2[t2] * dist(prompt + [t1, t2])
    return joint


def sample_t2_t3(eng, prompt, sp, n: int) -> torch.Tensor:
    v = eng.backend.cfg.vocab_size
    counts = torch.zeros(v, v)
    for seed in range(n):
        sp.seed = 1000 + seed
        ids = eng.generate(prompt, sp).token_ids
        counts[ids[1], ids[2]] += 1
    return counts


@pytest.mark.parametrize("temperature,top_k,top_p,vocab", [(1.0, 0, 1.0, None), (0.8, 6, 0.9, None),
                                                          (1.0, 0, 1.0, [3, 0, 6, 1, 4])])
def test_speculative_sampling_matches_target_distribution(temperature, top_k, top_p, vocab):
    """Chi-square of the (2nd, 3rd) generated tokens over 2500 seeds against the target's exact
    joint law; those tokens come from the first verify step (accepts, residual draws, bonus).
    With a drafting vocabulary the draft's q is 0 at the other tokens: still the target's law.
    Tolerance: p-value > 1e-3 (fixed seeds, so the outcome is deterministic)."""
    lm = tiny_lm(seed=5, vocab=8)
    prompt = [1, 5, 2]
    sp = SamplingParams(max_new_tokens=4, temperature=temperature, top_k=top_k, top_p=top_p)
    exact = exact_joint_t2_t3(lm, prompt, sp)
    be = Transformer(lm.cfg, lm.params, 64)
    eng = SpeculativeEngine(be, None, random_draft(lm, seed=1, vocab=None if vocab is None else torch.tensor(vocab)),
                            k=2)
    n = 2500
    counts = sample_t2_t3(eng, prompt, sp, n)
    st = eng.total_stats
    assert 0.1 < st.accept_rate < 0.95, st  # both acceptance and residual draws were exercised
    assert chi_square_pvalue(counts, exact * n) > 1e-3


def test_speculative_sampling_with_an_attention_draft_matches_target_distribution():
    """The same law with a draft that attends over its own features (a live block: its output projection random),
    its cache of true pairs fed by every verify (flint/speculative/draft_attention.py)."""
    lm = tiny_lm(seed=5, vocab=8)
    prompt = [1, 5, 2]
    sp = SamplingParams(max_new_tokens=5, temperature=1.0)
    exact = exact_joint_t2_t3(lm, prompt, sp)
    torch.manual_seed(1)
    draft = DraftHead(draft_config_for(lm.cfg, intermediate_size=48, attention_heads=4)).attach_target(lm.cfg,
                                                                                                         lm.params)
    with torch.no_grad():
        torch.nn.init.normal_(draft.attn.wo.weight, std=0.3)
    eng = SpeculativeEngine(Transformer(lm.cfg, lm.params, 64), None, draft, k=2)
    n = 2500
    counts = sample_t2_t3(eng, prompt, sp, n)
    assert 0.1 < eng.total_stats.accept_rate < 0.95, eng.total_stats
    assert chi_square_pvalue(counts, exact * n) > 1e-3


def test_draft_draws_follow_its_q():
    """The rollout's inverse-CDF draw from uniform u: its tokens are distributed as the q it
    returns (chi-square over 4000 draws), and never a token of q = 0 (top-k cuts most)."""
    lm = tiny_lm(seed=2, vocab=8)
    draft = random_draft(lm, seed=2)
    with torch.no_grad():  # spread the draft's logits: q far from uniform
        draft.head.mul_(4)
    h = torch.randn(lm.cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    for sp in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3)):
        g = torch.Generator().manual_seed(4)
        counts = torch.zeros(8)
        q0 = None
        for _ in range(4000):
            toks, q = draft.propose([1], h, 1, sp, g)
            q0 = q[0] if q0 is None else q0
            assert torch.equal(q[0], q0)  # q does not depend on the draw
            counts[toks[0]] += 1
        assert (counts[q0 == 0] == 0).all()
        assert chi_square_pvalue(counts, q0 * 4000) > 1e-3, (sp, counts, q0)


def test_sampling_check_detects_a_biased_verifier(monkeypatch):
    """The same check rejects a verifier that keeps every draft (output would follow q, not p)."""
    lm = tiny_lm(seed=5, vocab=8)
    prompt = [1, 5, 2]
    sp = SamplingParams(max_new_tokens=4, temperature=1.0)
    exact = exact_joint_t2_t3(lm, prompt, sp)

    def keep_all(p, q, drafts, gen):
        k = drafts.shape[0]
        return torch.tensor([k, int(torch.multinomial(p[k], 1, generator=gen))])

    monkeypatch.setattr(speculative, "verify_sampling", keep_all)
    eng = SpeculativeEngine(Transformer(lm.cfg, lm.params, 64), None, random_draft(lm, seed=1), k=2)
    n = 1500
    counts = sample_t2_t3(eng, prompt, sp, n)
    assert chi_square_pvalue(counts, exact * n) < 1e-3


def test_same_seed_same_text():
    lm = tiny_lm(seed=6)
    be = Transformer(lm.cfg, lm.params, 64)
    eng = SpeculativeEngine(be, None, random_draft(lm), k=3)
    sp = SamplingParams(max_new_tokens=20, temperature=0.9, seed=7)
    assert eng.generate([2, 3], sp).token_ids == eng.generate([2, 3], sp).token_ids


HAVE_CUDA = torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA GPU (the draft's CUDA-graph rollout)")
@pytest.mark.parametrize("k,pruned,temperature", [(1, False, 0), (3, False, 0), (5, False, 0), (3, True, 0),
                                                  (3, True, 0.8)])
def test_graphed_rollout_matches_eager(k, pruned, temperature, monkeypatch):
    """The captured rollout proposes exactly the eager rollout's tokens, for fresh random hidden
    states, on a draft whose logits are spread (no argmax ties); also with a drafting vocabulary
    (the target's token embedded from the int4 layout), and sampling (the same uniform draws)."""
    lm = tiny_lm(vocab=300, hidden=64)
    draft = random_draft(lm, seed=k).to("cuda")  # fp32: the graph, not the bf16-only rollout kernel
    vocab = torch.randperm(300, generator=torch.Generator().manual_seed(k))[:120] if pruned else None
    draft.attach_target(lm.cfg, lm.params, device="cuda", dtype=torch.float32, vocab=vocab)
    g = torch.Generator().manual_seed(100 + k)
    for trial in range(4):
        hidden = torch.randn(64, generator=g).cuda()
        ctx = [int(torch.randint(0, 300, (1,), generator=g))]
        sp = SamplingParams(temperature=temperature, top_p=0.9) if temperature else None
        monkeypatch.setenv("FLINT_DRAFT_GRAPH", "0")
        want, wq = draft.propose(ctx, hidden, k, sp, torch.Generator(device="cuda").manual_seed(trial))
        monkeypatch.setenv("FLINT_DRAFT_GRAPH", "1")
        got, gq = draft.propose(ctx, hidden, k, sp, torch.Generator(device="cuda").manual_seed(trial))
        assert got.tolist() == want.tolist(), (k, trial)
        if sp is not None:
            torch.testing.assert_close(gq, wq)
        if vocab is not None:
            assert set(got.tolist()) <= set(vocab.tolist())
    assert draft._graphed_rollout(k, (temperature, 0, 0.9) if temperature else ()) is not None  # the graph ran


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA GPU (the draft's CUDA-graph rollout)")
def test_greedy_identical_with_graphed_draft_on_cuda():
    lm = tiny_lm(eos=(5,))
    params = {n: t.cuda() for n, t in lm.params.items()}
    be = Transformer(lm.cfg, params, 128, device="cuda", dtype=torch.float32)
    draft = random_draft(lm, seed=3).to("cuda")
    draft.attach_target(lm.cfg, params, device="cuda", dtype=torch.float32)
    for prompt in PROMPTS:
        sp = SamplingParams(max_new_tokens=30)
        want = Engine(be).generate(prompt, sp)
        got = SpeculativeEngine(be, None, draft, k=4).generate(prompt, sp)
        assert got.token_ids == want.token_ids, prompt


def test_int4_rollout_weights_round_once_and_borrow_the_targets_int4(monkeypatch):
    """The kernel rollout's int4 matrices: the draft's fc / gate|up / down rounded to nearest in groups of 128 or the
    largest that divides K (each value within half a step of its group); the target's int4 embedding and head are
    the target's own tensors (no copy), a dense one rounded once; a bad FLINT_DRAFT_WEIGHTS is refused by name."""
    from flint.speculative.draft_head import int4_rollout_weights, kernel_weights
    from flint.quant.int4 import quantize_int4

    lm = tiny_lm(vocab=40, hidden=96)
    torch.manual_seed(1)
    draft = DraftHead(draft_config_for(lm.cfg, intermediate_size=64)).attach_target(lm.cfg, lm.params)
    q = int4_rollout_weights(draft)
    assert (q["fc"].group_size, q["gu0"].group_size, q["down0"].group_size) == (64, 32, 64)  # K = 192, 96, 64
    for name, w in (("fc", draft.fc.weight), ("gu0", draft.blocks[0]._gate_up()), ("down0", draft.blocks[0].down.weight)):
        qw = q[name]
        assert qw.shape == tuple(w.shape)
        step = qw.scales.float().repeat_interleave(qw.group_size, 1)
        assert bool(((qw.dequantize() - w.float()).abs() <= 0.5 * step + 1e-3).all()), name
    assert q["head"] is not q["embed"]  # untied: the head's own rows
    params = dict(lm.params)
    params["embed"] = quantize_int4(lm.params["embed"], 32)
    params["lm_head"] = quantize_int4(lm.params["lm_head"], 32)
    draft.attach_target(lm.cfg, params, vocab=torch.arange(0, 40, 3))
    q = int4_rollout_weights(draft)
    assert q["embed"].qweight is params["embed"].qweight and q["head"].qweight is params["lm_head"].qweight
    monkeypatch.setenv("FLINT_DRAFT_WEIGHTS", "fp8")
    with pytest.raises(DraftError, match="FLINT_DRAFT_WEIGHTS"):
        kernel_weights()
    monkeypatch.delenv("FLINT_DRAFT_WEIGHTS")
    assert kernel_weights() == "int4"


def int4_reference(draft):
    """An fp32 copy of ``draft`` whose matrices are the dequantized int4 ones the kernel rollout reads (its fc, gate|up
    and down rounded once; the target's int4 head and embedding rows): what the int4 kernel must propose."""
    import copy

    from flint.speculative.draft_head import int4_rollout_weights

    q = int4_rollout_weights(draft)
    ref = copy.deepcopy(draft).float()
    h, inter = draft.cfg.hidden_size, draft.cfg.intermediate_size
    with torch.no_grad():
        ref.fc.weight.copy_(q["fc"].dequantize())
        for i, b in enumerate(ref.blocks):
            gu = q[f"gu{i}"].dequantize()
            b.gate.weight.copy_(gu[:inter])
            b.up.weight.copy_(gu[inter:])
            b.down.weight.copy_(q[f"down{i}"].dequantize())
    ids = draft.vocab_ids
    rows = (lambda w: w.rows(ids)) if ids is not None else (lambda w: w)  # noqa: E731
    ref.head = rows(q["head"]).dequantize()
    ref.embed = rows(q["embed"]).dequantize()
    ref.embed_src = q["embed"] if ids is not None else None
    ref.final_norm = draft.final_norm.float()
    assert h == ref.head.shape[1]
    return ref


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA GPU (the draft's one-launch rollout kernel)")
@pytest.mark.parametrize("weights", ["int4", "bf16"])
@pytest.mark.parametrize("pruned,layers,hidden", [(False, 1, 64), (True, 1, 64), (True, 2, 64), (True, 1, 192)])
def test_kernel_rollout_matches_fp32_emulation(monkeypatch, weights, pruned, layers, hidden):
    """flint_draft_rollout (one cooperative launch, fp32 arithmetic) proposes the tokens of the eager rollout run in
    fp32 on the weights it reads: the bf16-rounded ones, or (int4, the default) the draft's matrices rounded to int4
    once and the target's int4 head and embedding; for fresh random hidden states and tokens; with a drafting
    vocabulary (the target's token embedded from the int4 layout) and without; 1 and 2 MLP blocks; groups of 128 / 64
    (hidden 64) and 128 / 64 / 32 (hidden 192: fc's K = 384, gate|up's 192, down's 96)."""
    import copy

    from flint.speculative.draft_head import DraftHead, draft_config_for

    monkeypatch.setenv("FLINT_DRAFT_WEIGHTS", weights)
    lm = tiny_lm(vocab=300, hidden=hidden)
    torch.manual_seed(7)
    draft = DraftHead(draft_config_for(lm.cfg, intermediate_size=64 if hidden == 64 else 96, num_layers=layers))
    with torch.no_grad():
        for b in draft.blocks:
            torch.nn.init.normal_(b.down.weight, std=0.3)
    draft = draft.to("cuda", torch.bfloat16)
    vocab = torch.randperm(300, generator=torch.Generator().manual_seed(8))[:96] if pruned else None
    draft.attach_target(lm.cfg, lm.params, device="cuda", dtype=torch.bfloat16, vocab=vocab)
    if weights == "int4":
        ref = int4_reference(draft)
    else:
        ref = copy.deepcopy(draft).float()
        ref.head, ref.embed, ref.final_norm = draft.head.float(), draft.embed.float(), draft.final_norm.float()
    assert draft._kernel_rollout() is not None and ref._kernel_rollout() is None
    assert draft._kernel_rollout().weights == weights
    g = torch.Generator().manual_seed(9)
    for trial in range(6):
        hidden_state = torch.randn(hidden, generator=g).cuda()
        tok = torch.randint(0, 300, (1,), generator=g).cuda()
        got, _ = draft.propose([int(tok)], hidden_state, 5)
        want, _ = ref._rollout(hidden_state.view(1, -1), tok, 5)
        assert got.tolist() == want.tolist(), (weights, pruned, layers, hidden, trial)
        if vocab is not None:
            assert set(got.tolist()) <= set(vocab.tolist())


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA GPU (the draft's one-launch rollout kernel)")
def test_greedy_identical_with_kernel_draft_on_cuda(monkeypatch):
    """Speculative decoding with the bf16 draft on its one-launch kernel (widths that take no int4 group: bf16
    matrices, and int4 asked for by name refused): output equals plain greedy."""
    lm = tiny_lm(eos=(5,), vocab=64, hidden=64)
    params = {n: t.cuda() for n, t in lm.params.items()}
    be = Transformer(lm.cfg, params, 128, device="cuda", dtype=torch.float32)
    draft = random_draft(lm, seed=3).to("cuda", torch.bfloat16)
    draft.attach_target(lm.cfg, params, device="cuda", dtype=torch.bfloat16, vocab=torch.arange(0, 64, 2))
    assert draft._kernel_rollout().weights == "bf16"  # intermediate 48: no int4 group, the default falls back
    monkeypatch.setenv("FLINT_DRAFT_WEIGHTS", "int4")
    with pytest.raises(DraftError, match="multiples of 32"):
        draft._kernel_rollout()
    monkeypatch.delenv("FLINT_DRAFT_WEIGHTS")
    for prompt in PROMPTS:
        sp = SamplingParams(max_new_tokens=30)
        want = Engine(be).generate(prompt, sp)
        got = SpeculativeEngine(be, None, draft, k=4).generate(prompt, sp)
        assert got.token_ids == want.token_ids, prompt


@pytest.mark.gpu
@pytest.mark.skipif(not (HAVE_CUDA and torch.cuda.get_device_capability() >= (9, 0)),
                    reason="needs a CUDA sm_90 (Hopper) GPU (the megakernel and the draft's rollout kernel)")
@pytest.mark.parametrize("temperature,heads", [(0.0, 0), (0.8, 0), (0.0, 4)])
def test_step_has_one_host_sync_on_the_megakernel(temperature, heads):
    """A speculative step on the megakernel with the kernel draft, greedy or sampled at a temperature: the draft's
    rollout, the verify and the accept (sampling: the acceptance test and the residual or bonus draw on the
    device), with one host synchronisation, the wait on an event after the verify's values are copied out (counted
    here), the next step's rollout enqueued before it; no synchronising torch call (torch's sync debug mode
    warns of each); greedy output equals plain greedy. heads > 0: a draft with attention (its eager rollout, the
    cache fed after each verify, on the device too)."""
    import warnings

    from flint.megakernel import MegakernelBackend
    from flint.synthetic import synthetic_params

    cfg = from_hf_dict(dict(model_type="llama", vocab_size=512, hidden_size=256, intermediate_size=512,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=64,
                            rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                            max_position_embeddings=512), "tiny-mk")
    params = synthetic_params(cfg, seed=0, int4_group_size=64, dtype=torch.float32, device="cuda")
    be = MegakernelBackend(cfg, params, 256)
    torch.manual_seed(3)
    draft = DraftHead(draft_config_for(cfg, intermediate_size=256, attention_heads=heads)).to("cuda", torch.bfloat16)
    draft.attach_target(cfg, params, device="cuda", dtype=torch.bfloat16, vocab=torch.arange(0, 512, 2))
    if heads:
        with torch.no_grad():
            torch.nn.init.normal_(draft.attn.wo.weight, std=0.05)
    assert (draft._kernel_rollout() is not None) == (heads == 0)
    sp = SamplingParams(max_new_tokens=40, ignore_eos=True, temperature=temperature)
    prompt = [5, 17, 3, 99, 250]
    want = Engine(be).generate(prompt, sp).token_ids
    eng = SpeculativeEngine(be, None, draft, k=3)
    eng.generate(prompt, dataclasses.replace(sp, max_new_tokens=8))  # warm-up (first launches, caches)
    eng.cached, eng.should_stop, eng.step_logprobs = [], None, []
    eng._on_start()
    assert draft.samples_pipelined(sp) == (temperature > 0)
    it = eng._tokens(list(prompt), sp, torch.Generator(device="cuda").manual_seed(0) if temperature else None)
    got = [next(it)]  # the prefill's token
    torch.cuda.synchronize()
    waits = []
    event_sync = torch.cuda.Event.synchronize

    def counted(ev):
        waits.append(1)
        return event_sync(ev)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        torch.cuda.Event.synchronize = counted
        try:
            while len(got) < sp.max_new_tokens:
                got.append(next(it))
        finally:
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.Event.synchronize = event_sync
    # (torch's warning for each synchronising call; switching the mode on adds one of its own, "... a prototype
    # feature and does not yet detect all synchronizing operations", which is not one)
    syncs = [f"{w.filename}:{w.lineno}" for w in caught if "synchronizing CUDA operation" in str(w.message)]
    steps = eng.last_stats.steps
    assert got == want or temperature > 0
    assert len(got) == sp.max_new_tokens and all(0 <= t < cfg.vocab_size for t in got)
    assert steps >= 8 and not syncs, f"{len(syncs)} synchronising torch calls in {steps} steps: {sorted(set(syncs))}"
    assert len(waits) == steps


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_logprobs_are_the_targets_own(temperature):
    """Each emitted token's logprob (and top alternatives) is the target's log-softmax at its position: the
    verify row it was chosen from, equal to a teacher-forced forward over the generated text."""
    lm = tiny_lm(eos=(5,))
    be = Transformer(lm.cfg, lm.params, 128)
    eng = SpeculativeEngine(be, None, random_draft(lm, seed=2), k=3)
    assert eng.unsupported(SamplingParams(logprobs=2)) == []
    prompt = [4, 0, 7, 7, 2]
    res = eng.generate(prompt, SamplingParams(max_new_tokens=20, temperature=temperature, seed=3, logprobs=3))
    assert res.logprobs is not None and len(res.logprobs) == len(res.token_ids) > 3
    lp = torch.log_softmax(Transformer(lm.cfg, lm.params, 128).forward(torch.tensor(prompt + res.token_ids), 0), -1)
    for i, (t, e) in enumerate(zip(res.token_ids, res.logprobs)):
        row = lp[len(prompt) - 1 + i]
        assert e.token_id == t and abs(e.logprob - float(row[t])) < 1e-4, i
        assert [x for x, _ in e.top] == row.topk(3).indices.tolist(), i


def kernel_draft(monkeypatch, weights, hidden=64, vocab_rows=96, spread=1.0):
    """A bf16 draft on CUDA for the rollout kernel (int4 or bf16 matrices) with a pruned head of ``vocab_rows`` rows,
    and its fp32 emulation on the weights the kernel reads (``int4_reference``, or the bf16 values in fp32)."""
    import copy

    monkeypatch.setenv("FLINT_DRAFT_WEIGHTS", weights)
    lm = tiny_lm(vocab=300, hidden=hidden)
    torch.manual_seed(7)
    draft = DraftHead(draft_config_for(lm.cfg, intermediate_size=64))
    with torch.no_grad():
        for b in draft.blocks:
            torch.nn.init.normal_(b.down.weight, std=0.3)
    draft = draft.to("cuda", torch.bfloat16)
    params = dict(lm.params)
    params["lm_head"] = params["lm_head"] * spread
    vocab = torch.randperm(300, generator=torch.Generator().manual_seed(8))[:vocab_rows]
    draft.attach_target(lm.cfg, params, device="cuda", dtype=torch.bfloat16, vocab=vocab)
    if weights == "int4":
        ref = int4_reference(draft)
    else:
        ref = copy.deepcopy(draft).float()
        ref.head, ref.embed, ref.final_norm = draft.head.float(), draft.embed.float(), draft.final_norm.float()
    assert draft._kernel_rollout() is not None and draft._kernel_rollout().weights == weights
    return draft, ref, vocab


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA GPU (the draft's one-launch rollout kernel)")
@pytest.mark.parametrize("weights", ["int4", "bf16"])
def test_kernel_rollout_sampling_logits_follow_the_emulation(monkeypatch, weights):
    """Sampling on the rollout kernel: step j's logits equal the fp32 emulation's on the weights the kernel reads, given
    the tokens the kernel drew before it; q is softmax(logits / T) over the drafting vocabulary, 0 elsewhere; the
    tokens are in the drafting vocabulary; the seed comes from the request's generator (same seed, same draws)."""
    draft, ref, vocab = kernel_draft(monkeypatch, weights)
    calls = []
    kr = draft._kernel_rollout()
    orig = type(kr).__call__
    monkeypatch.setattr(type(kr), "__call__", lambda self, *a, **kw: calls.append(a) or orig(self, *a, **kw))
    g = torch.Generator().manual_seed(11)
    sp = SamplingParams(temperature=0.8)
    for trial in range(4):
        h0 = torch.randn(64, generator=g).cuda()
        tok0 = int(torch.randint(0, 300, (1,), generator=g))
        gen = torch.Generator(device="cuda").manual_seed(trial)
        toks, q = draft.propose([tok0], h0, 3, sp, gen)
        toks2, q2 = draft.propose([tok0], h0, 3, sp, torch.Generator(device="cuda").manual_seed(trial))
        assert toks.tolist() == toks2.tolist() and torch.equal(q, q2)
        assert set(toks.tolist()) <= set(vocab.tolist())
        assert q.shape == (3, 300)
        torch.testing.assert_close(q.sum(1), torch.ones(3, device="cuda"))
        assert (q[:, [t for t in range(300) if t not in set(vocab.tolist())]] == 0).all()
        # the emulation, step by step along the kernel's own draws
        h = h0.view(1, -1)
        e = ref.embed_tokens(torch.tensor([tok0], device="cuda"))
        for j, t in enumerate(toks.tolist()):
            h = ref.forward(h, e)
            want = probs_from_logits(ref.logits(h)[0], sp.temperature)
            torch.testing.assert_close(q[j, vocab.cuda()], want, atol=2e-4, rtol=2e-3)
            e = ref.embed[(vocab == t).nonzero()[0].cuda()]
    assert len(calls) == 8  # every sampled proposal ran on the kernel
    # a top-p request takes the kernel too, and its q is the kernel's softmax(logits / T) (top-p shapes the target's p)
    n = len(calls)
    toks, q = draft.propose([tok0], h0, 3, SamplingParams(temperature=0.8, top_p=0.5),
                            torch.Generator(device="cuda").manual_seed(0))
    assert len(calls) == n + 1
    assert (q[:, vocab.cuda()] > 0).all()  # not truncated to a nucleus


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA GPU (the draft's one-launch rollout kernel)")
def test_kernel_rollout_draws_follow_its_q(monkeypatch):
    """The kernel's Gumbel-max draws are distributed as the q it returns: chi-square of step 0's token over 4000
    launches with a fixed hidden state and token (p-value > 1e-3; fixed seeds, so the outcome is deterministic)."""
    draft, _, vocab = kernel_draft(monkeypatch, "int4", vocab_rows=24)
    h0 = torch.randn(64, generator=torch.Generator().manual_seed(5)).cuda()
    gen = torch.Generator(device="cuda").manual_seed(1)
    sp = SamplingParams(temperature=1.0)
    counts = torch.zeros(300)
    q0 = None
    for _ in range(4000):
        toks, q = draft.propose([17], h0, 1, sp, gen)
        q0 = q[0].cpu() if q0 is None else q0
        counts[int(toks[0])] += 1
    assert (counts[q0 == 0] == 0).all()
    assert q0.max() < 0.6 and (q0 > 0.01).sum() >= 8, q0  # a spread q: the test can see a bias
    assert chi_square_pvalue(counts, q0.double() * 4000) > 1e-3, (counts[vocab], q0[vocab])


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA GPU (the draft's one-launch rollout kernel)")
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.9, 4, 1.0), (0.8, 0, 0.8)])
def test_speculative_sampling_on_the_kernel_draft_matches_target_distribution(monkeypatch, temperature, top_k, top_p):
    """Speculative sampling with the draft on the rollout kernel (int4 matrices, a drafting vocabulary) and the target
    on CUDA: the (2nd, 3rd) generated tokens over 2500 seeds follow the target's exact joint law (chi-square), also
    under top-k / top-p, which shape the target's p while the kernel draws from softmax(logits / T)."""
    monkeypatch.setenv("FLINT_DRAFT_WEIGHTS", "int4")
    lm = tiny_lm(seed=5, vocab=8)
    prompt = [1, 5, 2]
    sp = SamplingParams(max_new_tokens=4, temperature=temperature, top_k=top_k, top_p=top_p)
    exact = exact_joint_t2_t3(lm, prompt, sp)
    params = {n: t.cuda() for n, t in lm.params.items()}
    be = Transformer(lm.cfg, params, 64, device="cuda", dtype=torch.float32)
    torch.manual_seed(1)
    draft = DraftHead(draft_config_for(lm.cfg, intermediate_size=64)).to("cuda", torch.bfloat16)
    draft.attach_target(lm.cfg, params, device="cuda", dtype=torch.bfloat16, vocab=torch.tensor([3, 0, 6, 1, 4]))
    assert draft._kernel_rollout() is not None and draft._kernel_rollout().weights == "int4"
    assert draft.samples_pipelined(sp)
    begun = []
    orig = DraftHead.begin_sampled
    monkeypatch.setattr(DraftHead, "begin_sampled", lambda self, *a: begun.append(1) or orig(self, *a))
    eng = SpeculativeEngine(be, None, draft, k=2)
    n = 2500
    counts = sample_t2_t3(eng, prompt, sp, n)
    st = eng.total_stats
    assert 0.1 < st.accept_rate < 0.95, st
    assert len(begun) >= n  # every proposal was the kernel's sampled rollout
    assert chi_square_pvalue(counts, exact * n) > 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA GPU (the captured acceptance)")
@pytest.mark.parametrize("top_k,top_p,kernel", [(0, 1.0, "1"), (40, 0.9, "1"), (40, 0.9, "0")])
def test_captured_acceptance_is_the_eager_one_bit_for_bit(monkeypatch, top_k, top_p, kernel):
    """The sampled step's acceptance replayed as a CUDA graph (AcceptGraphs) emits the eager path's tokens for the
    same seed, with the draft on the rollout kernel (q from its logits inside the graph) and on the captured rollout
    (FLINT_DRAFT_KERNEL=0: its q); the graphs were built and replayed."""
    monkeypatch.setenv("FLINT_DRAFT_KERNEL", kernel)
    lm = tiny_lm(seed=4, vocab=300, hidden=64)
    params = {n: t.cuda() for n, t in lm.params.items()}
    be = Transformer(lm.cfg, params, 128, device="cuda", dtype=torch.float32)
    torch.manual_seed(2)
    draft = DraftHead(draft_config_for(lm.cfg, intermediate_size=64)).to("cuda", torch.bfloat16)
    draft.attach_target(lm.cfg, params, device="cuda", dtype=torch.bfloat16, vocab=torch.arange(0, 300, 3))
    sp = SamplingParams(max_new_tokens=40, temperature=0.8, top_k=top_k, top_p=top_p, ignore_eos=True)
    assert draft.samples_pipelined(sp) == (kernel == "1")
    replays = []
    orig = speculative._AcceptGraph.__call__
    monkeypatch.setattr(speculative._AcceptGraph, "__call__", lambda self, *a: replays.append(1) or orig(self, *a))
    for seed in range(3):
        out = {}
        for graph in ("0", "1"):
            monkeypatch.setenv("FLINT_SPEC_GRAPH", graph)
            eng = SpeculativeEngine(be, None, draft, k=3)
            out[graph] = eng.generate([7, 1, 250, 3], dataclasses.replace(sp, seed=seed)).token_ids
        assert out["1"] == out["0"] and len(out["1"]) == 40, seed
    assert len(replays) >= 3 * 10


def test_acceptance_step_through_the_graph_interface_matches_eager(monkeypatch):
    """On the CPU, the captured acceptance's path through the engine (static buffers copied in, the uniforms drawn
    outside, (n, next, drafts) read from one tensor) with the graph replaced by an eager run of its body: the same
    tokens as verify_sampling's path for the same seed."""

    class EagerBody(speculative._AcceptGraph):
        def __init__(self, logits, q_src, q_fn, drafts, u, sampling):
            self.logits, self.drafts, self.u = torch.empty_like(logits), torch.empty_like(drafts), torch.empty_like(u)
            self.q_src = None if q_src is None else torch.empty_like(q_src)
            self.q_fn, self.sampling, self.graph = q_fn, sampling, self

        def replay(self):
            self.out = self._body()

    lm = tiny_lm(seed=6, vocab=40)
    be = Transformer(lm.cfg, lm.params, 64)
    sp = SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
    want = SpeculativeEngine(be, None, random_draft(lm, seed=4), k=3).generate([2, 3, 9], sp).token_ids
    monkeypatch.setattr(speculative.AcceptGraphs, "applies", staticmethod(lambda device: True))
    monkeypatch.setattr(speculative, "_AcceptGraph", EagerBody)
    eng = SpeculativeEngine(be, None, random_draft(lm, seed=4), k=3)
    assert eng.generate([2, 3, 9], sp).token_ids == want
    assert len(eng._accept.cache) >= 1
