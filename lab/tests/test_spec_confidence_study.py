"""lab/spec_confidence_study.py's replayed greedy walk: proposals that all match emit k + 1 tokens a step, none one,
a width-0 policy is plain decoding, and the walk never reads past the text; its batched rollout is the draft's own
greedy rollout position by position."""
import torch

from flint.config import from_hf_dict
from flint.speculative.draft_head import DraftHead, draft_config_for
from flint.loading import expected_shapes
from spec_confidence_study import rollouts, walk


def tiny_target():
    cfg = from_hf_dict(dict(model_type="llama", vocab_size=40, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False), "tiny")
    g = torch.Generator().manual_seed(0)
    return cfg, {n: torch.randn(shape, generator=g) / shape[-1] ** 0.5 for n, shape in expected_shapes(cfg).items()}


def test_walk_counts_accepted_runs():
    seq = list(range(20))  # first = 4: tokens 5..19 to produce
    first = 4
    right = [[p + 1 + j for j in range(3)] for p in range(first, 20)]  # the target's own continuation
    wrong = [[-1, -1, -1] for _ in range(first, 20)]
    conf = [[0.9, 0.9, 0.9] for _ in range(first, 20)]
    e, s, w = walk(seq, first, right, conf, lambda c: 3)
    assert e == 15 and s == 4 and w[:3] == [3, 3, 3]  # 4 + 4 + 4, then the last 3 with a shorter width
    e, s, _ = walk(seq, first, wrong, conf, lambda c: 3)
    assert (e, s) == (15, 15)
    e, s, w = walk(seq, first, right, conf, lambda c: 0)
    assert (e, s) == (15, 15) and set(w) == {0}
    # a partial match: the first draft right, the second wrong -> 2 tokens a step
    half = [[p + 1, -1, -1] for p in range(first, 20)]
    e, s, _ = walk(seq, first, half, conf, lambda c: 3)
    assert e == 15 and s == 8


def test_batched_rollout_is_the_drafts_greedy_rollout():
    cfg, params = tiny_target()
    torch.manual_seed(0)
    draft = DraftHead(draft_config_for(cfg, intermediate_size=32)).attach_target(cfg, params)
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(0, cfg.vocab_size, (12,), generator=g)
    hid = torch.randn(12, cfg.hidden_size, generator=g)
    props, conf = rollouts(draft, hid, seq, 5, 3)
    assert props.shape == conf.shape == (7, 3) and ((conf > 0) & (conf <= 1)).all()
    for i, p in enumerate(range(5, 12)):
        want = draft._rollout(hid[p - 1].view(1, -1), seq[p].view(1), 3)[0]
        assert props[i].tolist() == want.tolist(), p
