"""The draft head: save/load round trip, refusal of a draft for another target, harvest data that
matches a teacher-forced forward, resumable harvest, training that lowers the loss, and the
validation acceptance estimate agreeing with real speculative decoding. Tiny models; about 20 s.

Run: ``pytest tests/test_draft.py``
"""
from __future__ import annotations

import json

import pytest
import torch

from flint.config import from_hf_dict
from flint.speculative.draft_head import DraftError, DraftHead, draft_config_for, load_draft, save_draft
from flint.speculative.draft_data import KINDS, draft_prompts, eval_prompts, harvest, load_harvest
from flint.speculative.draft_train import accepted_runs, simulated_acceptance, train_draft
from flint.engine import Engine, SamplingParams
from flint.loading import LoadedModel, expected_shapes
from flint.model import Transformer
from flint.speculative.verify import SpeculativeEngine


@pytest.fixture(autouse=True, scope="module")
def one_thread(torch_one_thread):
    """Tiny tensors: intra-op threads only add contention on a shared 2-core CI box."""


def tiny_lm(seed=0, vocab=16, hidden=32, layers=2):
    cfg = from_hf_dict(dict(
        model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=64,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=True), "tiny")
    g = torch.Generator().manual_seed(seed)
    params = {}
    for name, shape in expected_shapes(cfg).items():
        if name == "lm_head":
            continue
        if name.endswith("norm"):
            params[name] = 1 + 0.1 * torch.randn(shape, generator=g)
        else:
            params[name] = torch.randn(shape, generator=g) / shape[1] ** 0.5
    params["lm_head"] = params["embed"]
    cfg.name = f"tiny-{hidden}-{vocab}"
    return LoadedModel(cfg, params, None, "tiny")


def id_prompts(n, seed=0, vocab=16):
    g = torch.Generator().manual_seed(seed)
    # three lengths, so harvest batches by length
    return [{"kind": KINDS[i % 4], "subject": f"s{i % 8}",
             "ids": torch.randint(0, vocab, (3 + i % 3,), generator=g).tolist()} for i in range(n)]


def test_prompt_set_is_deterministic_with_held_out_subjects():
    rows = draft_prompts()
    assert rows == draft_prompts()
    assert {r["kind"] for r in rows} == set(KINDS)
    assert len(rows) > 3000
    train = {(r["kind"], r["subject"]) for r in rows if r["split"] == "train"}
    held = {(r["kind"], r["subject"]) for r in rows if r["split"] == "eval"}
    assert held and not (train & held)
    ev = eval_prompts(3)
    assert [r["kind"] for r in ev] == [k for k in KINDS for _ in range(3)]


def test_saved_draft_loads_back_identical(tmp_path):
    lm = tiny_lm()
    torch.manual_seed(0)
    draft = DraftHead(draft_config_for(lm.cfg, num_layers=2, k_default=3)).attach_target(lm.cfg, lm.params)
    save_draft(draft, tmp_path / "d")
    back = load_draft(tmp_path / "d", lm.cfg, lm.params)
    assert back.cfg == draft.cfg and back.cfg.k_default == 3
    a, b = draft.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    h = torch.randn(lm.cfg.hidden_size)
    assert torch.equal(draft.propose([1, 2], h, 4)[0], back.propose([1, 2], h, 4)[0])
    # the target's head and embedding are not part of the file
    from safetensors import safe_open
    with safe_open(str(tmp_path / "d" / "draft.safetensors"), framework="pt") as fh:
        assert not any("embed" == k or "head" in k for k in fh.keys())


def test_draft_for_another_target_is_refused(tmp_path):
    lm = tiny_lm()
    save_draft(DraftHead(draft_config_for(lm.cfg)), tmp_path / "d")
    wider = tiny_lm(hidden=48)
    with pytest.raises(DraftError, match="'hidden_size' is 32 .* hidden_size=48"):
        load_draft(tmp_path / "d", wider.cfg, wider.params)
    other_vocab = tiny_lm(vocab=20)
    with pytest.raises(DraftError, match="'vocab_size' is 16 .* vocab_size=20"):
        load_draft(tmp_path / "d", other_vocab.cfg)
    with pytest.raises(DraftError, match="no such draft"):
        load_draft(tmp_path / "missing", lm.cfg)
    cfg = json.loads((tmp_path / "d" / "draft.json").read_text())
    cfg["num_layers"] = 0
    (tmp_path / "d" / "draft.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftError, match="'num_layers' must be a positive integer"):
        load_draft(tmp_path / "d", lm.cfg)


def test_harvest_matches_teacher_forced_forward_and_resumes(tmp_path):
    lm = tiny_lm(seed=1)
    prompts = id_prompts(7)
    out = tmp_path / "h"
    # batches of 3 over lengths 3,3,4,4,5 (then 3,5) mix prompt lengths
    assert harvest(lm, out, prompts[:5], batch_size=3, max_new_tokens=10, log=lambda *a: None) == 5
    assert harvest(lm, out, prompts, batch_size=2, max_new_tokens=10, log=lambda *a: None) == 2  # resume
    data = load_harvest(out, lm.cfg)
    assert sorted(data.prompt_index.tolist()) == list(range(7))
    assert data.kind.tolist() == [KINDS.index(prompts[i]["kind"]) for i in data.prompt_index.tolist()]
    assert len(set(data.group.tolist())) == 7  # one subject per prompt here
    ref = Transformer(lm.cfg, lm.params, 64)
    for row, pi in enumerate(data.prompt_index.tolist()):
        ids = prompts[pi]["ids"]
        gen = Engine(ref).generate(ids, SamplingParams(max_new_tokens=10)).token_ids
        n = int(data.lengths[row])
        assert n == 10
        # region = last prompt token, then the generated ones; hidden at the same positions
        assert data.tokens[row, : n + 1].tolist() == [ids[-1]] + gen
        full = torch.tensor(ids + gen)
        _, hid = Transformer(lm.cfg, lm.params, 64).forward(full, 0, return_hidden=True)
        want = hid[len(ids) - 1: len(ids) - 1 + n].to(torch.bfloat16).float()
        torch.testing.assert_close(data.hidden[row, :n].float(), want, rtol=2e-2, atol=2e-2)
    with pytest.raises(DraftError, match="max_new_tokens"):
        harvest(lm, out, prompts, batch_size=2, max_new_tokens=12, log=lambda *a: None)


def test_training_lowers_loss_and_val_acceptance_matches_engine(tmp_path):
    lm = tiny_lm(seed=2)
    lm.cfg.eos_token_ids = [7]  # some sequences end early
    prompts = id_prompts(24, seed=3)
    harvest(lm, tmp_path / "h", prompts, batch_size=8, max_new_tokens=24, log=lambda *a: None)
    data = load_harvest(tmp_path / "h", lm.cfg)
    torch.manual_seed(0)
    draft = DraftHead(draft_config_for(lm.cfg, intermediate_size=64)).attach_target(lm.cfg, lm.params)
    rec = train_draft(draft, data, tmp_path / "d", steps=60, batch_size=8, lr=3e-3, depth=3,
                      val_frac=0.25, eval_every=20, k_eval=3, log=lambda *a: None)
    # validation holds out whole subjects (2 of 8), and reports by kind
    assert rec["val_sequences"] > 0
    assert rec["val_sequences"] + rec["sequences"] == int((data.lengths >= 2).sum())
    assert set(rec["val_tokens_per_step_by_kind"]) <= {"all", *KINDS}
    hist = json.loads((tmp_path / "d" / "train_log.json").read_text())
    # the draft kept is the best validated one (its k = 3 figure at least every validation's during training)
    assert rec["val_tokens_per_step"]["3"] >= max(v["tokens_per_step_k3"] for v in hist["val"]) - 5e-4 > 1.0
    log = hist["steps"]
    first = sum(r["loss"] for r in log[:5]) / 5
    last = sum(r["loss"] for r in log[-5:]) / 5
    assert rec["steps"] == 60 and last < 0.8 * first, (first, last)
    assert (tmp_path / "d" / "train_state.pt").exists()

    # the walk over harvested greedy sequences predicts what the engine measures
    draft.eval()
    k = 3
    runs = accepted_runs(draft, data.hidden.float(), data.tokens, data.lengths, k)
    predicted = simulated_acceptance(runs, data.lengths)
    be = Transformer(lm.cfg, lm.params, 64)
    eng = SpeculativeEngine(be, None, draft, k=k)
    for pi in data.prompt_index.tolist():
        eng.generate(prompts[pi]["ids"], SamplingParams(max_new_tokens=24))
    measured = eng.total_stats.tokens_per_step
    assert measured > 1.2  # the trained draft gets tokens accepted
    assert data.lengths.min() < 24  # ... and eos cut some sequences
    # equal up to argmax near-ties between the M=1 harvest and the M=k+1 verify numerics
    assert abs(predicted - measured) < 0.01 * measured, (predicted, measured)


def test_cli_registers_draft_commands():
    import argparse

    from flint.speculative import cli as draft_cli

    ap = argparse.ArgumentParser()
    draft_cli.register(ap.add_subparsers(dest="command"))
    a = ap.parse_args(["draft", "train", "--data", "h", "--out", "d", "--depth", "2"])
    assert a.func is draft_cli.cmd_train and a.depth == 2 and a.k == 4 and a.attention_heads == 0
    a = ap.parse_args(["draft", "train", "--data", "h", "--out", "d", "--attention-heads", "-1"])
    with pytest.raises(DraftError, match="--attention-heads must be >= 0"):
        draft_cli.cmd_train(a)  # (before the model or the harvest is read)
    a = ap.parse_args(["draft", "eval", "--draft", "d", "--k", "2,3"])
    assert a.func is draft_cli.cmd_eval
    a = ap.parse_args(["draft", "harvest", "--out", "h"])
    assert a.func is draft_cli.cmd_harvest and a.batch_size == 64


def test_inference_step_equals_training_step():
    """The drafting step (fused norms, one gate|up matmul, addmm residual) computes the training
    step's function: fp32, fresh random inputs."""
    lm = tiny_lm(seed=3)
    torch.manual_seed(3)
    draft = DraftHead(draft_config_for(lm.cfg, num_layers=2)).attach_target(lm.cfg, lm.params)
    for b in draft.blocks:  # weights away from the identity init, so the blocks matter
        torch.nn.init.normal_(b.down.weight, std=0.2)
    h, e = torch.randn(5, 32), torch.randn(5, 32)
    with torch.enable_grad():
        want = draft(h, e)
    with torch.no_grad():
        got = draft(h, e)
        got1 = draft(h[:1], e[:1])  # the 2-D [1, H] path of the rollout
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got1, want[:1].detach(), rtol=1e-5, atol=1e-5)


def test_drafting_vocabulary_is_the_full_draft_restricted(tmp_path):
    """A draft on a drafting vocabulary proposes what the full-vocabulary draft would if its
    argmax were taken over those tokens only; q is 0 outside them and sums to 1."""
    from flint.quant.int4 import quantize_int4

    lm = tiny_lm(seed=4, vocab=64)
    lm.params["embed"] = lm.params["lm_head"] = quantize_int4(lm.params["embed"], 32)  # as a Q4 GGUF's
    torch.manual_seed(4)
    full = DraftHead(draft_config_for(lm.cfg)).attach_target(lm.cfg, lm.params)
    vocab = torch.randperm(64, generator=torch.Generator().manual_seed(4))[:20]
    pruned = DraftHead(draft_config_for(lm.cfg)).attach_target(lm.cfg, lm.params, vocab=vocab)
    pruned.load_state_dict(full.state_dict())
    assert pruned.draft_vocab_size == 20 and pruned.head.shape == (20, 32)
    mask = torch.full((64,), float("-inf"))
    mask[vocab] = 0
    g = torch.Generator().manual_seed(40)
    for _ in range(6):
        h = torch.randn(32, generator=g)
        t = int(torch.randint(0, 64, (1,), generator=g))  # the target's token: any id
        got = pruned.propose([t], h, 4)[0].tolist()
        hh, tok, want = h.view(1, -1), torch.tensor([t]), []
        with torch.no_grad():
            for _ in range(4):
                hh = full(hh, full.embed_tokens(tok))
                tok = (full.logits(hh)[0] + mask).argmax().view(1)
                want.append(int(tok))
        assert got == want
    from flint.engine import SamplingParams
    toks, q = pruned.propose([3], torch.randn(32), 3, SamplingParams(temperature=0.9), torch.Generator().manual_seed(1))
    assert q.shape == (3, 64) and set(toks.tolist()) <= set(vocab.tolist())
    outside = torch.ones(64, dtype=torch.bool)
    outside[vocab] = False
    assert (q[:, outside] == 0).all()
    torch.testing.assert_close(q.sum(-1), torch.ones(3))


def test_vocab_ranking_saved_and_loaded(tmp_path, capsys):
    """The ranking counts generated tokens only; `flint draft vocab` writes it and the size;
    load_draft takes the first N; bad sizes, a missing ranking and ngram sizes are refused."""
    from flint.speculative.draft_head import load_vocab_ranking, save_vocab_ranking
    from flint.speculative.cli import cmd_vocab
    from flint.speculative.draft_data import HarvestData, rank_vocab

    lm = tiny_lm()
    tokens = torch.tensor([[9, 3, 3, 5, 0], [1, 5, 3, 7, 7]])  # region 0 = the last prompt token
    data = HarvestData(tokens, torch.zeros(2, 5, 32), torch.tensor([3, 2]), torch.arange(2), {})
    order, meta = rank_vocab(data, 16)
    # generated: row 0 -> 3, 3, 5; row 1 -> 5, 3 : counts 3: 3, 5: 2, then the rest in id order
    assert order[:2].tolist() == [3, 5] and order[2:5].tolist() == [0, 1, 2]
    assert sorted(order.tolist()) == list(range(16)) and meta["tokens_counted"] == 5 and meta["distinct"] == 2
    torch.manual_seed(0)
    d = tmp_path / "d"
    save_draft(DraftHead(draft_config_for(lm.cfg)), d)
    with pytest.raises(DraftError, match="vocab.safetensors: file not found"):
        load_draft(d, lm.cfg, lm.params, draft_vocab=4)
    save_vocab_ranking(d, order, meta)
    assert torch.equal(load_vocab_ranking(d, 16), order)
    dr = load_draft(d, lm.cfg, lm.params, draft_vocab=4)
    assert dr.vocab_ids.tolist() == order[:4].tolist()
    assert load_draft(d, lm.cfg, lm.params).vocab_ids is None  # draft.json's default: 0, the full vocabulary
    import argparse
    assert cmd_vocab(argparse.Namespace(draft=str(d), data=None, size=6)) == 0
    assert json.loads((d / "draft.json").read_text())["draft_vocab"] == 6
    assert load_draft(d, lm.cfg, lm.params).draft_vocab_size == 6
    with pytest.raises(DraftError, match="--size must lie in 0..16"):
        cmd_vocab(argparse.Namespace(draft=str(d), data=None, size=17))
    with pytest.raises(DraftError, match="draft_vocab must be an integer >= 0"):
        load_draft(d, lm.cfg, lm.params, draft_vocab=-1)
    with pytest.raises(DraftError, match="ngram draft .* no drafting vocabulary"):
        load_draft("ngram", lm.cfg, draft_vocab=8)
    from safetensors.torch import save_file
    save_file({"ids": torch.tensor([0, 0, 1], dtype=torch.int32)}, str(d / "vocab.safetensors"))
    with pytest.raises(DraftError, match="must rank all 16 token ids"):
        load_draft(d, lm.cfg, lm.params)
    save_file({"ids": torch.tensor([0] * 16, dtype=torch.int32)}, str(d / "vocab.safetensors"))
    with pytest.raises(DraftError, match="repeats a token id"):
        load_draft(d, lm.cfg, lm.params)
