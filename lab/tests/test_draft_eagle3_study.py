"""lab/draft_eagle3_study.py: the reference decoder's extra layers (Transformer.hidden_layers) are the residuals a
forward over the first layers gives, the last part unchanged; the fused draft starts as the shipped draft (its map
takes the last layer's state), and both views read the last layer's part for the head and the loss."""
import torch

from draft_eagle3_study import FusedDraft, TopView
from flint.config import from_hf_dict
from flint.speculative.draft_head import DraftHead, draft_config_for
from flint.speculative.draft_train import _top_hidden, rollout_losses
from flint.loading import expected_shapes
from flint.model import Transformer


def tiny(layers=3):
    cfg = from_hf_dict(dict(model_type="llama", vocab_size=40, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False), "tiny")
    g = torch.Generator().manual_seed(0)
    params = {n: (1 + 0.1 * torch.randn(s, generator=g)) if n.endswith("norm") else torch.randn(s, generator=g) / s[-1] ** 0.5
              for n, s in expected_shapes(cfg).items()}
    return cfg, params


def test_hidden_layers_are_the_shallower_models_outputs():
    cfg, params = tiny(3)
    toks = torch.tensor([3, 7, 1, 9, 2])
    plain_logits, plain_h = Transformer(cfg, params, 16).forward(toks, 0, return_hidden=True)
    try:
        Transformer.hidden_layers = (0, 1)
        logits, h = Transformer(cfg, params, 16).forward(toks, 0, return_hidden=True)
    finally:
        Transformer.hidden_layers = ()
    assert h.shape == (5, 96) and torch.equal(logits, plain_logits) and torch.equal(h[:, 64:], plain_h)
    # layer 1's output: a 2-layer model's last hidden state on the same weights
    cfg2 = from_hf_dict(dict(model_type="llama", vocab_size=40, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False), "tiny2")
    p2 = {n: v for n, v in params.items() if not n.startswith("layers.2.")}
    _, h2 = Transformer(cfg2, p2, 16).forward(toks, 0, return_hidden=True)
    torch.testing.assert_close(h[:, 32:64], h2)


def test_fused_draft_starts_as_the_shipped_one():
    cfg, params = tiny(3)
    dcfg = draft_config_for(cfg, intermediate_size=48)
    torch.manual_seed(1)
    base = DraftHead(dcfg).attach_target(cfg, params)
    fused, top = FusedDraft(dcfg, 3), TopView(dcfg, 3)
    for d in (fused, top):
        d.load_state_dict(base.state_dict(), strict=False)
        d.attach_target(cfg, params)
    g = torch.Generator().manual_seed(2)
    h3, e = torch.randn(2, 6, 96, generator=g), torch.randn(2, 6, 32, generator=g)
    want = base(h3[..., 64:], e)
    for d in (fused, top):
        torch.testing.assert_close(d(h3, e), want)
        torch.testing.assert_close(d.logits(h3), base.logits(h3[..., 64:]))
        assert torch.equal(_top_hidden(d, h3), h3[..., 64:])
        torch.testing.assert_close(d(want, e), base(want, e))  # a step on its own prediction
    toks = torch.randint(0, 40, (2, 6), generator=g)
    lens = torch.tensor([6, 4])
    loss_f, _ = rollout_losses(fused, h3, toks, lens, 3)
    loss_b, _ = rollout_losses(base, h3[..., 64:].contiguous(), toks, lens, 3)
    torch.testing.assert_close(loss_f, loss_b)
    loss_f.backward()
    assert fused.fuse.weight.grad is not None and fused.fuse.weight.grad[:, :64].abs().sum() > 0
