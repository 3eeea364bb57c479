"""The draft's attention over its own features (flint/speculative/draft_attention.py): decoding with its cache of true
pairs predicts what the batched training-time rollout predicts at every start; a new block starts as the draft without it; it saves
and loads; the kernel and graph rollouts refuse it; the speculative engine stays exact with it (greedy identical to
plain; sampled tokens follow the target's law: tests/test_speculative.py)."""
import json
import math

import pytest
import torch

from flint.config import from_hf_dict
from flint.speculative.draft_head import DraftError, DraftHead, draft_config_for, load_draft, save_draft
from flint.speculative.draft_train import accepted_runs, rollout_losses
from flint.engine import Engine, SamplingParams
from flint.loading import expected_shapes
from flint.model import Transformer
from flint.speculative.verify import SpeculativeEngine


@pytest.fixture(autouse=True)
def one_thread(torch_one_thread):
    """Tiny tensors: intra-op threads only add contention on a shared 2-core CI box."""


def tiny_target(vocab=24, hidden=32):
    cfg = from_hf_dict(dict(model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=64,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False), "tiny")
    g = torch.Generator().manual_seed(0)
    params = {}
    for n, s in expected_shapes(cfg).items():
        params[n] = (1 + 0.1 * torch.randn(s, generator=g)) if n.endswith("norm") else \
            torch.randn(s, generator=g) * (1.5 if n == "lm_head" else 1.0) / s[-1] ** 0.5
    return cfg, params


def attn_draft(cfg, params, heads=4, seed=1):
    torch.manual_seed(seed)
    d = DraftHead(draft_config_for(cfg, intermediate_size=48, attention_heads=heads)).attach_target(cfg, params)
    with torch.no_grad():  # a live attention block (a new one starts with its output projection at zero)
        torch.nn.init.normal_(d.attn.wo.weight, std=0.3)
    return d


def training_predictions(draft, hidden, tokens, k):
    """preds[s][i]: the training-time rollout's predicted hidden state at step s from start i (accepted_runs' shifts)."""
    draft.begin_rollout()
    emb = draft.embed_tokens(tokens[None])
    f_prev, preds = hidden[None, :-1], {}
    with torch.no_grad():
        for s in range(1, k + 1):
            f = draft(f_prev, emb[:, s:])
            preds[s] = f[0]
            f_prev = f[:, :-1]
    return preds


def test_decoding_cache_predicts_what_training_predicts():
    cfg, params = tiny_target()
    draft = attn_draft(cfg, params)
    g = torch.Generator().manual_seed(3)
    L, k = 14, 3
    hidden = torch.randn(L, cfg.hidden_size, generator=g)
    tokens = torch.randint(0, cfg.vocab_size, (L,), generator=g)
    want = training_predictions(draft, hidden, tokens, k)
    draft.reset_state(64)
    last = -1  # the last start: its pair joined the cache in its rollout
    for i in (0, 1, 4, 5, 9):  # starts of a walk; between them the accepted pairs, in chunks with spare rows
        if i - last - 1 > 0:
            m = i - last - 1
            extra = 2  # rows past the count: written, then rewritten by the next append
            hs = torch.cat((hidden[last + 1: i], torch.randn(extra, cfg.hidden_size, generator=g)))
            ts = torch.cat((tokens[last + 2: i + 1], torch.randint(0, cfg.vocab_size, (extra,), generator=g)))
            draft.observe(hs, ts, torch.tensor([m]))
        draft.attn.begin_decode()
        h = hidden[i][None]
        with torch.no_grad():
            for s in range(1, k + 1):
                h = draft.forward(h, draft.embed_tokens(tokens[i + s: i + s + 1]))
                torch.testing.assert_close(h[0], want[s][i], rtol=1e-4, atol=1e-5)
        last = i


def test_a_new_block_is_the_draft_without_it():
    cfg, params = tiny_target()
    torch.manual_seed(1)
    plain = DraftHead(draft_config_for(cfg, intermediate_size=48)).attach_target(cfg, params)
    torch.manual_seed(2)
    with_attn = DraftHead(draft_config_for(cfg, intermediate_size=48, attention_heads=4)).attach_target(cfg, params)
    with_attn.load_state_dict(plain.state_dict(), strict=False)
    g = torch.Generator().manual_seed(4)
    h, t = torch.randn(2, 10, cfg.hidden_size, generator=g), torch.randint(0, cfg.vocab_size, (2, 10), generator=g)
    lens = torch.tensor([10, 7])
    la, _ = rollout_losses(with_attn, h, t, lens, 3)
    lp, _ = rollout_losses(plain, h, t, lens, 3)
    torch.testing.assert_close(la, lp)
    la.backward()
    assert with_attn.attn.wo.weight.grad.abs().sum() > 0  # it learns from there
    assert torch.equal(accepted_runs(with_attn, h, t, lens, 3), accepted_runs(plain, h, t, lens, 3))


def test_saves_loads_and_refuses_the_kernel_and_graph_rollouts(tmp_path):
    cfg, params = tiny_target()
    draft = attn_draft(cfg, params)
    save_draft(draft, tmp_path / "d")
    back = load_draft(tmp_path / "d", cfg, params)
    assert back.cfg.attention_heads == 4 and back.stateful
    assert all(torch.equal(a, b) for a, b in zip(draft.state_dict().values(), back.state_dict().values()))
    assert back._kernel_rollout() is None and back._graphed_rollout(3) is None
    with pytest.raises(DraftError, match="attention_heads 5"):
        DraftHead(draft_config_for(cfg, attention_heads=5))
    with pytest.raises(DraftError, match="reset_state"):
        DraftHead(draft_config_for(cfg, attention_heads=4)).attach_target(cfg, params).propose(
            [1, 2], torch.zeros(cfg.hidden_size), 2)


def test_speculative_greedy_with_attention_draft_is_plain_greedy():
    cfg, params = tiny_target()
    draft = attn_draft(cfg, params)
    be = Transformer(cfg, params, 96)
    eng = SpeculativeEngine(be, None, draft, k=3)
    for prompt in ([1, 2, 3], [5, 9, 9, 2, 7], [0]):
        sp = SamplingParams(max_new_tokens=30, ignore_eos=True)
        want = Engine(be).generate(prompt, sp).token_ids
        assert eng.generate(prompt, sp).token_ids == want, prompt
    assert eng.total_stats.steps > 0


def test_batched_training_rollout_equals_an_explicit_start_by_start_one():
    """The training-time semantics, written out: from start i, step 1 attends over the true pairs p <= i, step s over
    those and its own steps 2..s (RoPE at i + s - 1)."""
    from flint.speculative.draft_attention import rope

    cfg, params = tiny_target(hidden=16)
    torch.manual_seed(1)
    d = DraftHead(draft_config_for(cfg, intermediate_size=24, attention_heads=2)).attach_target(cfg, params)
    a = d.attn
    with torch.no_grad():
        a.wo.weight.normal_(0, 0.3)
    b, L, depth = 2, 7, 3
    h, e = torch.randn(b, L, 16), torch.randn(b, L, 16)
    with torch.no_grad():
        d.begin_rollout()  # as rollout_losses / accepted_runs call it: step s on starts 0..L-1-s
        fs, f_prev = [], h[:, :-1]
        for s in range(1, depth + 1):
            f = d(f_prev, e[:, s:])
            fs.append(f)
            f_prev = f[:, :-1]

        def feat(hid, emb):  # fc, then the attention input
            x = d.fc(torch.cat((d.norm_hidden(hid), d.norm_embed(emb)), -1))
            return x, a.norm(x)

        def heads(w, xn, p):  # [heads, hd] at position p
            y = w(xn).view(a.heads, a.hd)[:, None, None, :]
            return rope(y, torch.tensor([p]))[:, 0, 0] if w is not a.wv else y[:, 0, 0]

        for bi in range(b):
            for i in range(L - 1):
                keys = []
                for p in range(i + 1):  # the true pairs p <= i
                    _, xn = feat(h[bi, p], e[bi, p + 1])
                    keys.append((heads(a.wk, xn, p), heads(a.wv, xn, p)))
                cur = h[bi, i]
                for s in range(1, depth + 1):
                    if i + s >= L:
                        break
                    x, xn = feat(cur, e[bi, i + s])
                    q = heads(a.wq, xn, i + s - 1)
                    ks = keys if s == 1 else keys + [(heads(a.wk, xn, i + s - 1), heads(a.wv, xn, i + s - 1))]
                    if s > 1:
                        keys = ks
                    kk = torch.stack([k for k, _ in ks], 1)  # [heads, n, hd]
                    vv = torch.stack([v for _, v in ks], 1)
                    w = torch.softmax((kk @ q[:, :, None])[..., 0] / math.sqrt(a.hd), -1)
                    o = (w[..., None] * vv).sum(1).reshape(-1)
                    y = x + a.wo(o)
                    for blk in d.blocks:
                        y = blk(y)
                    assert torch.allclose(fs[s - 1][bi, i], y, atol=1e-5), (bi, i, s)
                    cur = y


def test_trains_through_train_draft(tmp_path):
    """flint.speculative.draft_train.train_draft drives a draft with attention (begin_rollout before each rollout):
    the loss falls, the validation walk runs, and the saved draft loads with its block."""
    from test_draft import id_prompts, tiny_lm

    from flint.speculative.draft_data import harvest, load_harvest
    from flint.speculative.draft_train import train_draft

    lm = tiny_lm(seed=2)
    harvest(lm, tmp_path / "h", id_prompts(16, seed=3), batch_size=8, max_new_tokens=16, log=lambda *a: None)
    data = load_harvest(tmp_path / "h", lm.cfg)
    torch.manual_seed(0)
    d = DraftHead(draft_config_for(lm.cfg, intermediate_size=64, attention_heads=4)).attach_target(lm.cfg, lm.params)
    with torch.no_grad():
        d.attn.wo.weight.normal_(0, 0.02)
    rec = train_draft(d, data, tmp_path / "d", steps=40, batch_size=8, lr=3e-3, depth=3, val_frac=0.25,
                      eval_every=20, k_eval=3, log=lambda *a: None)
    val = json.loads((tmp_path / "d" / "train_log.json").read_text())["val"]
    # the draft kept is the best validated one (its k = 3 figure at least every validation's during training)
    assert rec["val_tokens_per_step"]["3"] >= max(v["tokens_per_step_k3"] for v in val) - 5e-4 > 1.0
    assert rec["loss_last"] < rec["loss_first"]
