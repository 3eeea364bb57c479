"""lab/draft_attn_study.py's AttnDraft: with its output projection at zero it is the draft without attention, and its
batched rollout (every start at once) equals a start-by-start rollout with an explicit list of keys."""
import math

import torch
import torch.nn.functional as F

from draft_attn_study import AttnDraft, rope
from flint.draft import DraftConfig, DraftHead


def _cfg():
    return DraftConfig(hidden_size=16, vocab_size=50, intermediate_size=24)


def test_zero_output_projection_is_the_plain_draft():
    torch.manual_seed(0)
    plain, attn = DraftHead(_cfg()), AttnDraft(_cfg(), heads=2)
    attn.load_state_dict(plain.state_dict(), strict=False)
    h, e = torch.randn(3, 9, 16), torch.randn(3, 9, 16)
    attn.begin_rollout()
    with torch.no_grad():
        assert torch.allclose(attn(h, e), plain(h, e), atol=1e-6)


def test_batched_rollout_equals_start_by_start():
    torch.manual_seed(1)
    d = AttnDraft(_cfg(), heads=2)
    with torch.no_grad():
        d.wo.weight.normal_(0, 0.3)
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
            return x, d.attn_norm(x)

        def heads(w, xn, p):  # [heads, hd] at position p
            y = w(xn).view(d.heads, d.hd)[:, None, None, :]
            return rope(y, torch.tensor([p]), d.theta)[:, 0, 0] if w is not d.wv else y[:, 0, 0]

        for bi in range(b):
            for i in range(L - 1):
                keys = []
                for p in range(i + 1):  # the true pairs p <= i
                    _, xn = feat(h[bi, p], e[bi, p + 1])
                    keys.append((heads(d.wk, xn, p), heads(d.wv, xn, p)))
                cur = h[bi, i]
                for s in range(1, depth + 1):
                    if i + s >= L:
                        break
                    x, xn = feat(cur, e[bi, i + s])
                    q = heads(d.wq, xn, i + s - 1)
                    ks = keys if s == 1 else keys + [(heads(d.wk, xn, i + s - 1), heads(d.wv, xn, i + s - 1))]
                    if s > 1:
                        keys = ks
                    kk = torch.stack([k for k, _ in ks], 1)  # [heads, n, hd]
                    vv = torch.stack([v for _, v in ks], 1)
                    w = torch.softmax((kk @ q[:, :, None])[..., 0] / math.sqrt(d.hd), -1)
                    o = (w[..., None] * vv).sum(1).reshape(-1)
                    y = x + d.wo(o)
                    for blk in d.blocks:
                        y = blk(y)
                    assert torch.allclose(fs[s - 1][bi, i], y, atol=1e-5), (bi, i, s)
                    cur = y


def test_trains_through_train_draft(tmp_path):
    """The study's path: flint.draft_train.train_draft drives the attention draft (begin_rollout before each rollout),
    the loss falls and the validation walk runs."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from test_draft import id_prompts, tiny_lm

    from flint.draft import draft_config_for
    from flint.draft_data import harvest, load_harvest
    from flint.draft_train import train_draft

    lm = tiny_lm(seed=2)
    harvest(lm, tmp_path / "h", id_prompts(16, seed=3), batch_size=8, max_new_tokens=16, log=lambda *a: None)
    data = load_harvest(tmp_path / "h", lm.cfg)
    torch.manual_seed(0)
    d = AttnDraft(draft_config_for(lm.cfg, intermediate_size=64), heads=4).attach_target(lm.cfg, lm.params)
    with torch.no_grad():
        d.wo.weight.normal_(0, 0.02)
    rec = train_draft(d, data, tmp_path / "d", steps=40, batch_size=8, lr=3e-3, depth=3, val_frac=0.25,
                      eval_every=20, k_eval=3, log=lambda *a: None)
    assert 1.0 <= rec["val_tokens_per_step"]["3"] <= 4.0
    assert rec["loss_last"] < rec["loss_first"]
