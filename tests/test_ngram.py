"""The n-gram (prompt-lookup) draft: its lookup against a brute-force search, and speculative decoding with it
exact: greedy output identical to plain greedy, sampled output distributed as the target's (chi-square).
Tiny random models on CPU. Run: ``pytest tests/test_ngram.py``"""
from __future__ import annotations

import random

import pytest
import torch

from flint.speculative.draft_head import load_draft
from flint.engine import Engine, SamplingParams
from flint.model import Transformer
from flint.speculative.ngram import NgramDraft
from flint.speculative.verify import SpeculativeEngine
from test_speculative import chi_square_pvalue, exact_joint_t2_t3, sample_t2_t3, tiny_lm


def brute_force(ctx, k, max_n, min_n):
    L = len(ctx)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        for j in range(L - 1, n - 1, -1):  # the latest earlier occurrence with a continuation
            if ctx[j - n:j] == ctx[L - n:]:
                return ctx[j:j + k]
    return []


def test_lookup_matches_brute_force_while_the_context_grows():
    rnd = random.Random(0)
    for trial in range(30):
        vocab = rnd.choice([2, 3, 5, 20])
        d = NgramDraft(vocab, max_ngram=rnd.choice([1, 2, 3, 4]), min_ngram=1, k_default=4)
        d.cfg = type(d.cfg)(vocab, d.cfg.max_ngram, rnd.randint(1, d.cfg.max_ngram), 4)
        ctx = [rnd.randrange(vocab) for _ in range(rnd.randint(0, 3))]
        for _ in range(60):  # one growing list, as SpeculativeEngine passes it: the index is kept
            k = rnd.randint(1, 6)
            assert d.lookup(ctx, k) == brute_force(ctx, k, d.cfg.max_ngram, d.cfg.min_ngram), (trial, ctx, k)
            ctx.extend(rnd.randrange(vocab) for _ in range(rnd.randint(1, 3)))


def test_lookup_examples_and_a_new_context_rebuilds():
    d = NgramDraft(100, max_ngram=3, min_ngram=2)
    ctx = [7, 8, 9, 1, 2, 3, 4, 7, 8, 9]
    assert d.lookup(ctx, 3) == [1, 2, 3]          # (7, 8, 9) seen before: what followed it
    assert d.lookup(ctx, 10) == [1, 2, 3, 4, 7, 8, 9]  # up to the context's end
    assert d.lookup([1, 2, 3, 4], 3) == []        # another list: no stale index entries
    assert d.lookup([5, 6, 1, 5], 3) == []        # only 1-token matches: below min_ngram
    toks, q = d.propose([1, 2, 5, 1, 2], None, 2)
    assert toks.tolist() == [5, 1] and q is None
    toks, q = d.propose([1, 2, 5, 1, 2], None, 2, SamplingParams(temperature=0.7))
    assert q.shape == (2, 100) and q.sum(-1).tolist() == [1.0, 1.0] and q[0, 5] == 1 and q[1, 1] == 1


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError, match="min_ngram"):
        NgramDraft(10, max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match="k_default"):
        NgramDraft(10, k_default=0)


def test_load_draft_ngram_is_the_draft_free_mode():
    lm = tiny_lm()
    d = load_draft("ngram", lm.cfg)
    assert isinstance(d, NgramDraft) and d.cfg.vocab_size == lm.cfg.vocab_size and d.cfg.k_default >= 1


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_identical_to_plain(k):
    lm = tiny_lm(seed=2, vocab=6)  # a small vocabulary: the output repeats, so proposals are made
    be = Transformer(lm.cfg, lm.params, 128)
    drafted = 0
    for prompt in ([1, 2, 3, 1, 2, 3, 1, 2], [4, 0, 4, 0, 4], [3]):
        sp = SamplingParams(max_new_tokens=40)
        want = Engine(be).generate(prompt, sp)
        eng = SpeculativeEngine(be, None, NgramDraft(lm.cfg.vocab_size, min_ngram=1), k=k)
        got = eng.generate(prompt, sp)
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason, (k, prompt)
        st = eng.last_stats
        assert st.steps >= 1 and st.drafted <= k * st.steps and 1.0 <= st.tokens_per_step <= k + 1
        assert st.accepted + st.steps == len(got.token_ids) - 1  # (no eos: every step's tokens are emitted)
        drafted += st.drafted
    assert drafted > 0  # the lookup proposed something somewhere


def test_sampling_matches_target_distribution():
    """Chi-square of the (2nd, 3rd) generated tokens over 2500 seeds against the target's exact joint law, with
    point-mass proposals (kept with probability p(x); a rejection draws from p without x)."""
    lm = tiny_lm(seed=5, vocab=8)
    prompt = [1, 5, 2, 1, 5]
    sp = SamplingParams(max_new_tokens=4, temperature=1.0)
    exact = exact_joint_t2_t3(lm, prompt, sp)
    be = Transformer(lm.cfg, lm.params, 64)
    eng = SpeculativeEngine(be, None, NgramDraft(lm.cfg.vocab_size, min_ngram=1), k=2)
    n = 2500
    counts = sample_t2_t3(eng, prompt, sp, n)
    st = eng.total_stats
    assert st.drafted > 0 and 0.05 < st.accept_rate < 0.95, st  # accepts and residual draws both ran
    assert chi_square_pvalue(counts, exact * n) > 1e-3


def test_a_draft_proposing_more_than_asked_is_refused():
    class Greedy:
        def propose(self, ctx, hidden, k, sp=None, gen=None):
            return torch.zeros(k + 1, dtype=torch.long), None

    lm = tiny_lm()
    eng = SpeculativeEngine(Transformer(lm.cfg, lm.params, 64), None, Greedy(), k=2)
    with pytest.raises(ValueError, match="at most 2"):
        eng.generate([1, 2], SamplingParams(max_new_tokens=8))
