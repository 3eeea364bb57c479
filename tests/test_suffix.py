"""The suffix draft (flint.speculative.suffix) and the automatic choice of drafter (flint.speculative.auto): the trie's counts against
a brute-force count, removal and least-recently-used eviction, the proposal rule, and speculative decoding with
them exact (greedy identical to plain greedy for every k, sampling distributed as the target's: chi-square).
Tiny random models on CPU. Run: ``pytest tests/test_suffix.py``"""
from __future__ import annotations

import random

import pytest
import torch

from flint.speculative.draft_head import load_draft
from flint.speculative.auto import BACKOFF_STEPS, SUFFIX_STRONG, AutoDraft, Gate
from flint.engine import Engine, SamplingParams
from flint.model import Transformer
from flint.speculative.verify import SpeculativeEngine
import flint.speculative.suffix as suffix
from flint.speculative.suffix import K_MAX, SuffixCache, SuffixDraft, SuffixTrie, best_run, hit
from test_speculative import chi_square_pvalue, exact_joint_t2_t3, random_draft, sample_t2_t3, tiny_lm


def count(seqs, sub) -> int:
    n = len(sub)
    return sum(1 for s in seqs for j in range(len(s) - n + 1) if tuple(s[j:j + n]) == sub)


def walk(trie, path):
    node = trie.root
    for t in path:
        node = trie.child(node, t)
        if node is None:
            return None
    return node


def test_trie_counts_every_substring_and_removal_undoes_adding():
    rnd = random.Random(0)
    trie = SuffixTrie(depth=4)
    seqs = [[rnd.randrange(3) for _ in range(rnd.randint(1, 12))] for _ in range(6)]
    for s in seqs:
        trie.add(s)
    for n in range(1, 5):
        for sub in {tuple(s[j:j + n]) for s in seqs for j in range(len(s) - n + 1)}:
            assert trie.count[walk(trie, sub)] == count(seqs, sub), sub
    assert walk(trie, (0, 1, 2, 0, 1)) is None  # deeper than the trie
    for s in seqs[:3]:
        trie.remove(s)
    for n in range(1, 5):
        for sub in {tuple(s[j:j + n]) for s in seqs for j in range(len(s) - n + 1)}:
            node, want = walk(trie, sub), count(seqs[3:], sub)
            assert (trie.count[node] if node else 0) == want, sub
    for s in seqs[3:]:
        trie.remove(s)
    assert trie.nodes() == 0
    with pytest.raises(ValueError, match="not added"):
        trie.remove([1, 2])


def test_frontier_is_every_suffix_the_trie_holds():
    rnd = random.Random(1)
    trie = SuffixTrie(depth=5)
    seqs = [[rnd.randrange(4) for _ in range(30)] for _ in range(3)]
    for s in seqs:
        trie.add(s)
    ctx = [rnd.randrange(4) for _ in range(20)]
    front = trie.frontier_of(ctx)
    want = [walk(trie, tuple(ctx[len(ctx) - n:])) for n in range(1, 6)]
    assert front == [w for w in want if w is not None][:len(front)] and None not in want[:len(front)]
    assert len(front) == 5 or want[len(front)] is None


def test_best_run_copies_a_repeated_text_and_weighs_branches(monkeypatch):
    trie = SuffixTrie(depth=8)
    text = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    front: list = []
    for t in text + [1] + text[:3]:  # the context ends by repeating the text's start
        front = trie.append(front, t)
    monkeypatch.setattr(suffix, "CUT_BY_COST", False)
    toks, score, m, _ = best_run(trie, front, 4)
    # three tokens matched; each next token's match is one longer, so its chance hit(m) grows
    chances = [hit(3), hit(3) * hit(4), hit(3) * hit(4) * hit(5), hit(3) * hit(4) * hit(5) * hit(6)]
    assert m == 3 and toks == [8, 9, 10, 11] and abs(score - sum(chances)) < 1e-9  # k tokens
    monkeypatch.setattr(suffix, "CUT_BY_COST", True)
    toks, score, m, _ = best_run(trie, front, 7)
    # the prefix worth most per verify time: (1 + expected accepted) / VERIFY_COST[M]
    best = max(range(5), key=lambda n: (1 + sum(chances[:n])) / suffix.VERIFY_COST[1 + n])
    assert best == 2 and toks == [8, 9] and abs(score - sum(chances[:2])) < 1e-9
    trie2 = SuffixTrie(depth=8)
    for s in ([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 9]):  # after (1, 2, 3): 4 twice, 9 once
        trie2.add(s)
    toks, score, m, _ = best_run(trie2, trie2.frontier_of([0, 1, 2, 3]), 7)
    assert toks == [4] and m == 3 and abs(score - 2 / 3 * hit(3)) < 1e-9
    assert best_run(trie2, trie2.frontier_of([7, 7]), 7)[0] == []  # no match


def test_the_proposal_grows_with_the_match():
    """A 1-token match proposes one token (its chance is low: a second would cost more than it is expected to
    earn); a long one the whole k (each token near certain, the widest verify worth its cost)."""
    assert hit(1) < 0.3 < 0.9 < hit(10) < 1.0
    text = list(range(10, 40))
    trie = SuffixTrie()
    trie.add(text + [2, 10])
    assert best_run(trie, trie.frontier_of(text + [2, 10]), 7)[0] == [11]
    trie.add(text + [2] + text[:20])
    toks, score, m, _ = best_run(trie, trie.frontier_of(text + [2] + text[:20]), 7)
    assert m == 15 and toks == text[20:27] and score > 6.0


def test_cache_evicts_least_recently_used_whole_outputs():
    cache = SuffixCache(max_tokens=20, depth=4)
    a, b, c = [1, 2, 3, 4, 5, 6, 7, 8], [11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23, 24, 25, 26, 27, 28]
    cache.add(a)
    cache.add(b)
    cache.touch(0)  # a used again: b is now the least recently used
    cache.add(c)
    assert len(cache) == 2 and cache.tokens == 16
    assert walk(cache.trie, (12, 13)) is None and cache.trie.count[walk(cache.trie, (2, 3))] == 1
    assert cache.trie.nodes() <= 4 * cache.tokens
    with pytest.raises(ValueError, match="max_tokens"):
        SuffixCache(max_tokens=-1)


def test_a_request_drafts_from_an_earlier_output():
    d = SuffixDraft(100, cache=SuffixCache(depth=16))
    out = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]
    d.end_request([1, 2] + out, 2)
    ctx = [9, 9, 40, 41, 42, 43, 44]
    toks, score = d.lookup(ctx, 7)
    assert toks and toks == out[5:5 + len(toks)] and d.last[0] == "cache"
    toks, q = d.propose([3, 4, 5, 3, 4], None, 3, SamplingParams(temperature=0.7))
    n = len(toks)
    assert toks.tolist() == [5, 3, 4][:n] and n and q.shape == (n, 100) and q[0, 5] == 1
    assert d.last[0] == "prompt+output"


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError, match="k_default"):
        SuffixDraft(10, k_default=K_MAX + 1)
    with pytest.raises(ValueError, match="depth"):
        SuffixTrie(depth=1)
    with pytest.raises(ValueError, match="draft_vocab"):
        load_draft("suffix", tiny_lm().cfg, draft_vocab=8)


def test_gate_backs_off_and_doubles_its_wait():
    g = Gate(0.5)
    for _ in range(3):
        assert g.open
        g.record(0)
    assert not g.open and g.wait == BACKOFF_STEPS
    for _ in range(BACKOFF_STEPS):
        g.tick()
    assert g.open
    for _ in range(3):
        g.record(0)
    assert g.wait == 2 * BACKOFF_STEPS  # failed again: a longer wait
    g2 = Gate(0.5)
    for _ in range(20):
        g2.record(3)
    assert g2.open


def test_gate_against_what_the_drafter_expected():
    """The suffix gate holds a drafter that stated its expected accepted tokens to a share of that: proposals that
    expect little and earn little keep it open, proposals that expect much and earn nothing shut it."""
    g = Gate(0.3)
    for _ in range(30):
        g.record(0 if _ % 4 else 1, expected=0.25)  # earns what it expected
    assert g.open
    for _ in range(3):
        g.record(0, expected=4.0)
    assert not g.open


def test_auto_drafts_a_weak_suffix_match_only_without_an_open_head():
    """Without a head a suffix proposal worth its verify drafts, however little it expects; with the head's gate
    open the suffix must expect SUFFIX_STRONG accepted tokens, else the head drafts."""
    class Head:  # proposes one fixed token
        cfg = type("Cfg", (), {"k_default": 3})

        def propose(self, ctx, hidden, k, sp=None, gen=None):
            return torch.tensor([49]), None

    ctx = [1, 2, 3, 4, 5, 6, 40, 2, 3]  # (2, 3) matched: a 2-token match, expected accepted below SUFFIX_STRONG
    alone = AutoDraft(SuffixDraft(50, cache=SuffixCache(max_tokens=0)))
    toks, _ = alone.propose(ctx, None, K_MAX)
    assert toks.tolist()[:1] == [4] and alone.source == "suffix" and alone.suffix.last[1] < SUFFIX_STRONG
    head = AutoDraft(SuffixDraft(50, cache=SuffixCache(max_tokens=0)), Head())
    hidden = torch.zeros(1, 8)
    head.propose(ctx, hidden, K_MAX)
    assert head.source == "head"
    long = list(range(10, 30)) + [2] + list(range(10, 25))  # a long match: strong
    head.propose(long, hidden, K_MAX)
    assert head.source == "suffix" and head.suffix.last[1] >= SUFFIX_STRONG


def _drafts(lm):
    return {"suffix": lambda: SuffixDraft(lm.cfg.vocab_size),
            "auto": lambda: AutoDraft(SuffixDraft(lm.cfg.vocab_size)),
            "auto+head": lambda: AutoDraft(SuffixDraft(lm.cfg.vocab_size), random_draft(lm, seed=3))}


@pytest.mark.parametrize("name", ["suffix", "auto", "auto+head"])
@pytest.mark.parametrize("k", [1, 3, 7])
def test_greedy_identical_to_plain(name, k):
    lm = tiny_lm(seed=2, vocab=6)  # a small vocabulary: the output repeats, so proposals are made
    be = Transformer(lm.cfg, lm.params, 128)
    eng = SpeculativeEngine(be, None, _drafts(lm)[name](), k=k)  # one engine: later prompts meet the cache
    drafted = 0
    for prompt in ([1, 2, 3, 1, 2, 3, 1, 2], [4, 0, 4, 0, 4], [3], [1, 2, 3, 1, 2, 3, 1, 2]):
        sp = SamplingParams(max_new_tokens=40)
        want = Engine(be).generate(prompt, sp)
        got = eng.generate(prompt, sp)
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason, (k, prompt)
        st = eng.last_stats
        assert st.drafted <= k * st.steps and 1.0 <= st.tokens_per_step <= k + 1
        assert st.accepted + st.steps == len(got.token_ids) - 1 and sum(st.drafters.values()) == st.steps
        drafted += st.drafted
    assert drafted > 0
    assert set(eng.total_stats.drafters) <= {"suffix", "head", "none"}


@pytest.mark.parametrize("name", ["suffix", "auto+head"])
def test_sampling_matches_target_distribution(name):
    """Chi-square of the (2nd, 3rd) generated tokens over 2500 seeds against the target's exact joint law: the
    suffix draft's proposals as point masses (the context repeats, so its first verify proposes); auto mixes them
    with the head's sampled proposals and their q."""
    lm = tiny_lm(seed=5, vocab=8)
    prompt = [1, 5, 2, 1, 5, 2, 1, 5]
    sp = SamplingParams(max_new_tokens=4, temperature=1.0)
    exact = exact_joint_t2_t3(lm, prompt, sp)
    be = Transformer(lm.cfg, lm.params, 64)
    suffix = SuffixDraft(lm.cfg.vocab_size, cache=SuffixCache(max_tokens=0))
    draft = suffix if name == "suffix" else AutoDraft(suffix, random_draft(lm, seed=3))
    eng = SpeculativeEngine(be, None, draft, k=3)
    n = 2500
    counts = sample_t2_t3(eng, prompt, sp, n)
    st = eng.total_stats
    assert st.drafted > 0 and 0.05 < st.accept_rate < 0.95, st
    if name != "suffix":
        assert {"suffix", "head"} <= set(st.drafters), st.drafters  # both kinds of proposal were verified
    assert chi_square_pvalue(counts, exact * n) > 1e-3


def test_auto_decodes_plainly_what_speculation_cannot_serve():
    lm = tiny_lm(seed=2, vocab=6)
    be = Transformer(lm.cfg, lm.params, 128)
    eng = SpeculativeEngine(be, None, AutoDraft(SuffixDraft(6)), k=K_MAX, plain_fallback=True)
    sp = SamplingParams(max_new_tokens=20, logit_bias={3: 2.0}, repetition_penalty=1.3)
    assert eng.unsupported(sp) == []
    want = Engine(be).generate([1, 2, 3, 1, 2], sp)
    got = eng.generate([1, 2, 3, 1, 2], sp)
    assert got.token_ids == want.token_ids and eng.last_stats.steps == 0
    strict = SpeculativeEngine(be, None, SuffixDraft(6), k=3)
    assert strict.unsupported(sp)  # without the fallback: refused, as before


def test_load_draft_suffix_and_auto():
    lm = tiny_lm()
    assert isinstance(load_draft("suffix", lm.cfg), SuffixDraft)
    auto = load_draft("auto", lm.cfg, lm.params)
    assert isinstance(auto, AutoDraft) and auto.head is None and auto.cfg.k_default == K_MAX  # no head ships for it
    with pytest.raises(ValueError, match="no draft head"):
        load_draft("auto", lm.cfg, lm.params, draft_vocab=8)


def test_cli_refuses_a_k_wider_than_the_verify(capsys):
    from flint.cli import main

    assert main(["generate", "--prompt", "x", "--draft", "suffix", "--draft-k", str(K_MAX + 1)]) == 2
    assert f"--draft-k {K_MAX + 1}" in capsys.readouterr().err


def test_generate_stats_name_the_drafters(capsys, tmp_path):
    """`flint generate` runs --draft auto by default; --stats reports tokens per verify step and the drafters."""
    from flint.cli import main

    assert main(["generate", "--prompt", "one two three one two three one two", "--max-new-tokens", "6",
                 "--backend", "reference", "--device", "cpu", "--stats"]) == 0
    err = capsys.readouterr().err
    assert "tokens/verify step (" in err, err


@pytest.mark.parametrize("name", ["suffix", "auto+head"])
def test_a_seed_gives_the_same_text_whatever_came_before(name):
    """The cache and the gates carry state between requests; a seeded sampled request must not depend on it."""
    lm = tiny_lm(seed=2, vocab=6)
    be = Transformer(lm.cfg, lm.params, 128)
    eng = SpeculativeEngine(be, None, _drafts(lm)[name](), k=4)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    sp = SamplingParams(max_new_tokens=24, temperature=0.9, seed=77)
    first = eng.generate(prompt, sp).token_ids
    for other in ([4, 0, 4, 0, 4], [3, 3, 3]):  # outputs that fill the cache, drafts that move the gates
        eng.generate(other, SamplingParams(max_new_tokens=30))
    assert eng.generate(prompt, sp).token_ids == first


def test_workload_prompt_set_and_its_bench_options():
    from flint.bench import main as bench_main
    from flint.speculative.draft_data import eval_prompts, workload_prompts

    rows = workload_prompts()
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    assert kinds == ["codeedit", "textfix", "summarise", "quote", "json", "multiturn", "agent", "code", "explain", "qa",
                     "chat"]
    for kind in kinds:
        mine = [r for r in rows if r["kind"] == kind]
        assert sorted(r["split"] for r in mine) == ["eval", "eval", "train", "train"], kind
        assert not {r["subject"] for r in mine if r["split"] == "eval"} & {r["subject"] for r in mine
                                                                         if r["split"] == "train"}
    assert all(r["messages"][-1]["role"] in ("user", "tool") and r["text"] == r["messages"][-1]["content"]
               for r in rows)
    held = eval_prompts(1, prompt_set="workloads")
    assert [r["kind"] for r in held] == kinds and all(r["split"] == "eval" for r in held)
    with pytest.raises(ValueError, match="split"):
        eval_prompts(1, prompt_set="v1", split="train")
    assert bench_main(["--prompt-set", "workloads", "--device", "cpu"]) == 2  # without --draft: refused
    assert bench_main(["--draft", "suffix", "--draft-k", "8", "--device", "cpu"]) == 2


class BurstingTransformer(Transformer):
    """The reference model with a device loop's interface (greedy_run), as the GPU backends have: n argmax steps."""

    bursts = 0

    def greedy_run(self, token: int, pos: int, n: int) -> list[int]:
        type(self).bursts += 1
        out = []
        for i in range(n):
            token = int(torch.argmax(self.forward(torch.tensor([token]), pos + i)[-1]))
            out.append(token)
        return out


def test_auto_bursts_plain_tokens_where_nothing_drafts():
    lm = tiny_lm(seed=2, vocab=6, eos=(5,))
    be = BurstingTransformer(lm.cfg, lm.params, 128)
    eng = SpeculativeEngine(be, None, AutoDraft(SuffixDraft(6)), k=K_MAX)
    for prompt in ([1, 2, 3, 1, 2, 3, 1, 2], [4, 0, 4, 0, 4], [3]):
        for n in (1, 7, 40):
            sp = SamplingParams(max_new_tokens=n)
            want = Engine(Transformer(lm.cfg, lm.params, 128)).generate(prompt, sp)
            got = eng.generate(prompt, sp)
            assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason, (prompt, n)
            st = eng.last_stats
            assert st.accepted + st.steps == len(got.token_ids) - 1 and sum(st.drafters.values()) == st.steps
    assert BurstingTransformer.bursts > 0 and eng.total_stats.drafters.get("none", 0) > 0


def test_auto_finds_the_head_shipped_for_the_embedded_model():
    from flint.speculative.draft_head import shipped_head_for
    from flint.loading import load_model

    assert shipped_head_for(load_model(None).cfg) == "smollm2-135m"
    assert shipped_head_for(tiny_lm().cfg) is None


def test_cost_best_k_and_a_measured_curve():
    """best_k: the draft length worth most per verify time; measure_verify_cost on a CPU backend: 1.0 at M = 1,
    non-decreasing, one entry per width up to the backend's widest."""
    from flint.backend import make_backend
    from flint.speculative.cost import CPU_VERIFY_COST, best_k, measure_verify_cost, verify_cost_of

    flat = (1.0,) * 10
    assert best_k(flat, 0.9, 7) == (7, pytest.approx(sum(0.9 ** i for i in range(8))))  # free verifies: the longest
    steep = (1.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0)
    assert best_k(steep, 0.9, 7)[0] == 0  # a draft never pays for a verify that costs a step a token
    h100 = (1.0, 1.0, 1.23, 1.31, 1.40, 1.56, 1.71, 1.86, 2.04)  # the H100's synthetic SmolLM2 (bench, 2026-12-07)
    assert best_k(h100, 0.6, 7, 0.01)[0] == 3 and best_k(h100, 0.95, 7, 0.01)[0] == 7
    assert best_k(h100, 0.1, 7, 0.01)[0] == 0
    be = make_backend("reference", tiny_lm(), 64, "cpu")
    cost = measure_verify_cost(be, widths=4, reps=2)
    assert len(cost) == 5 and cost[:2] == (1.0, 1.0) and all(a <= b for a, b in zip(cost, cost[1:]))
    assert verify_cost_of(be) == CPU_VERIFY_COST  # (a CPU backend is not timed)


def test_a_gpu_backend_is_timed_once(monkeypatch):
    """Engines sharing a GPU backend share one measured curve (the timing writes the start of its cache)."""
    import flint.speculative.cost as cost

    calls = []
    monkeypatch.setattr(cost, "measure_verify_cost", lambda b: calls.append(b) or (1.0, 1.0, 1.2))

    class FakeGpuBackend:
        device = torch.device("cuda")

    a, b = FakeGpuBackend(), FakeGpuBackend()
    assert cost.verify_cost_of(a) == cost.verify_cost_of(a) == (1.0, 1.0, 1.2)
    cost.verify_cost_of(b)
    assert calls == [a, b]


def test_auto_sizes_the_head_from_the_verify_cost():
    """The head drafts the k its running acceptance is worth on the backend's curve: a head whose drafts all fail
    stops drafting (k 0: plain steps), one whose drafts all hold drafts its whole k; the gate's floor is that k's
    break-even."""
    class Head:  # proposes the next k fresh token ids (right: the text goes on with them; else with others)
        cfg = type("Cfg", (), {"k_default": 7})

        def __init__(self, right):
            self.right, self.asked = right, []

        def propose(self, ctx, hidden, k, sp=None, gen=None):
            self.asked.append(k)
            return torch.arange(ctx[-1] + 1, ctx[-1] + 1 + k), None

    h100 = (1.0, 1.0, 1.23, 1.31, 1.40, 1.56, 1.71, 1.86, 2.04)
    hidden = torch.zeros(1, 8)
    for right in (False, True):
        head = Head(right)
        auto = AutoDraft(SuffixDraft(1000, cache=SuffixCache(max_tokens=0)), head)
        auto.set_verify_cost(h100)
        assert auto.suffix.verify_cost == h100
        ctx = [1]
        for _ in range(12):
            toks, _ = auto.propose(ctx, hidden, K_MAX)
            # what the verify appended to the context (the engine's own list): the drafts and the target's token, or
            # a token past them; every id fresh, so the suffix draft never matches
            n = len(toks) + 1 if right else 1
            ctx.extend(range(ctx[-1] + 1 + (0 if right else 500), ctx[-1] + 1 + (0 if right else 500) + n))
        assert head.asked[0] == 3  # the prior 0.6 on this curve
        if right:
            assert head.asked[-1] == 7 and auto.source == "head"
        else:
            assert auto.source == "none" and len(head.asked) < 12
        k = head.asked[-1]
        assert auto.gates["head"].floor == pytest.approx(h100[k + 1] + k * auto.head_token_cost - 1.0)


def test_a_full_cache_adds_no_objects_for_the_cyclic_collector_and_reuses_its_nodes():
    """A decode must not stall on Python's full collection walking the tries (150 ms a full cache of node
    objects): the trie holds ints only, so its dicts stay untracked, and evicted outputs' nodes are reused."""
    import gc

    rnd = random.Random(3)
    cache = SuffixCache(max_tokens=2000)
    gc.collect()
    before = len(gc.get_objects())
    for _ in range(40):  # 5120 tokens through a 2000-token cache: evictions all along
        cache.add([rnd.randrange(500) for _ in range(128)])
    gc.collect()
    assert cache.trie.nodes() > 10 * cache.tokens  # (thousands of nodes live)
    assert len(gc.get_objects()) - before < 200
    high = len(cache.trie.kids)
    for _ in range(40):
        cache.add([rnd.randrange(500) for _ in range(128)])
    assert len(cache.trie.kids) <= high * 1.1  # the freed nodes were taken again
    assert cache.trie.nodes() <= cache.trie.depth * cache.tokens


def test_the_verify_cost_is_counted_in_tokens_of_the_device_loop(monkeypatch):
    """On a backend with greedy_run, plain decoding runs bursts with no host round trip a token: the verify's cost is
    in those tokens, so a lone synchronised step costs more than 1 and a draft must beat the bursts."""
    import flint.speculative.cost as cost

    clock = [0.0]
    monkeypatch.setattr(cost.time, "perf_counter", lambda: clock[0])

    class Loop:  # a forward of M tokens takes 1.0 + 0.1 M (launch and sync included), a burst token 0.9
        device = torch.device("cpu")
        max_chunk, max_seq_len = 8, 64

        def forward(self, toks, pos):
            clock[0] += 1.0 + 0.1 * len(toks)

        def greedy_run(self, token, pos, n):
            clock[0] += 0.9 * n
            return [0] * n

    c = cost.measure_verify_cost(Loop(), widths=4, reps=3)
    assert c == pytest.approx((1.0, 1.1 / 0.9, 1.2 / 0.9, 1.3 / 0.9, 1.4 / 0.9), abs=1e-3)
    del Loop.greedy_run  # no device loop: the unit is a forward of one token
    assert cost.measure_verify_cost(Loop(), widths=2, reps=3) == pytest.approx((1.0, 1.0, 1.2 / 1.1), abs=1e-3)
