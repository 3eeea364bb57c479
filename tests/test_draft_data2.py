"""More draft data: multi-pass harvests (greedy pass 0, sampled passes from the target's own
distribution, resumable by (prompt, pass), old single-pass shards still valid), the prompt set
flint-draft-prompts-v2, warm starts (--init), and bench/draft_smollm2.py end to end on a tiny
model. CPU, tiny models; about 40 s.

Run: ``pytest tests/test_draft_data2.py``
"""
from __future__ import annotations

import collections
import json

import pytest
import torch

from flint.speculative.draft_head import DraftError, DraftHead, draft_config_for, load_draft, save_draft
from flint.speculative.draft_data import (ALL_KINDS, KINDS, PROMPT_SET, PROMPT_SET_V2, Pass, draft_prompts, eval_prompts,
                                          harvest, harvest_passes, load_harvest, sample_rows, sample_uniforms)
from flint.speculative.draft_train import init_weights, train_draft
from flint.engine import probs_from_logits
from flint.model import Transformer

from test_draft import id_prompts, tiny_lm

QUIET = dict(log=lambda *a: None)


@pytest.fixture(autouse=True, scope="module")
def one_thread(torch_one_thread):
    """Tiny tensors: intra-op threads only add contention on a shared 2-core CI box."""


def by_key(data):
    """{(prompt index, pass): (tokens, hidden) of that sequence}"""
    out = {}
    for r, (pi, ps) in enumerate(zip(data.prompt_index.tolist(), data.pass_index.tolist())):
        n = int(data.lengths[r])
        out[(pi, ps)] = (data.tokens[r, : n + 1].tolist(), data.hidden[r, :n].float())
    return out


# ------------------------------------------------------------------ sampling

def test_sample_rows_draws_the_engines_distribution():
    """Inverse CDF at uniform u over probs_from_logits: frequencies match p, nothing outside the
    nucleus is ever drawn, the same u gives the same tokens."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 12, generator=g) * 2
    n = 40000
    u = torch.rand(n, generator=g, dtype=torch.float64)
    for temp, top_p in ((1.0, 1.0), (0.7, 0.9)):
        p = probs_from_logits(logits, temp, top_p=top_p)[0]
        tok = sample_rows(logits.expand(n, -1), temp, top_p, u)
        freq = torch.bincount(tok, minlength=12).double() / n
        assert (freq[p == 0] == 0).all()
        assert (p > 0).sum() < 12 or top_p == 1.0  # the nucleus cut something at 0.9
        assert torch.allclose(freq, p.double(), atol=0.012), (freq, p)
        assert torch.equal(tok, sample_rows(logits.expand(n, -1), temp, top_p, u))


def test_sample_uniforms_are_counter_based():
    a = sample_uniforms(7, 1, [11, 12, 13], 20)
    assert a.shape == (3, 20) and a.dtype == torch.float64 and 0 <= float(a.min()) and float(a.max()) < 1
    # a row depends on its own key only, not on the others in the batch
    assert torch.equal(sample_uniforms(7, 1, [13, 11], 20), a[[2, 0]])
    assert not torch.equal(sample_uniforms(8, 1, [11], 20)[0], a[0])  # another seed
    assert not torch.equal(sample_uniforms(7, 2, [11], 20)[0], a[0])  # another pass
    assert len(set(a.flatten().tolist())) == 60


def test_harvest_passes_validate():
    ps = harvest_passes(3, [0.7, 1.0], 0.9)
    assert ps == [Pass(), Pass(0.7, 0.9), Pass(1.0, 0.9), Pass(0.7, 0.9)] and ps[0].greedy
    with pytest.raises(DraftError, match="temperature > 0, got 0"):
        harvest_passes(1, [0.0])
    with pytest.raises(DraftError, match=r"top_p must be in \(0, 1\], got 1.5"):
        harvest_passes(1, [0.7], 1.5)
    with pytest.raises(DraftError, match="sampled passes must be >= 0"):
        harvest_passes(-1)


# ------------------------------------------------------------------ multi-pass harvest

def test_multipass_harvest_distinct_sequences_resume_and_reproducible(tmp_path):
    lm = tiny_lm(seed=5)
    prompts = id_prompts(6, seed=5)
    passes = harvest_passes(2, [1.0, 1.5], 1.0)
    # killed after pass 0 and part of pass 1: a run over all prompts and passes resumes it
    out = tmp_path / "h"
    assert harvest(lm, out, prompts[:4], batch_size=3, max_new_tokens=8, passes=passes[:2], seed=3, **QUIET) == 8
    assert harvest(lm, out, prompts, batch_size=4, max_new_tokens=8, passes=passes, seed=3, **QUIET) == 10
    assert harvest(lm, out, prompts, batch_size=4, max_new_tokens=8, passes=passes, seed=3, **QUIET) == 0
    data = load_harvest(out, lm.cfg)
    seqs = by_key(data)
    assert sorted(seqs) == [(i, p) for i in range(6) for p in range(3)]
    assert [p["sequences"] for p in data.meta["passes"]] == [6, 6, 6]
    assert [(p["temperature"], p["seed"]) for p in data.meta["passes"]] == [(0.0, None), (1.0, 3), (1.5, 3)]
    assert data.temperature.tolist() == [[0.0, 1.0, 1.5][p] for p in data.pass_index.tolist()]
    assert data.greedy_rows().tolist() == [p == 0 for p in data.pass_index.tolist()]
    # each pass is its own sequence: sampled ones differ from the greedy one and from each other
    for i in range(6):
        assert len({tuple(seqs[(i, p)][0]) for p in range(3)}) == 3
    # one shot, other batching: the same sampled text (a counter-based stream per prompt and pass)
    out2 = tmp_path / "h2"
    harvest(lm, out2, prompts, batch_size=6, max_new_tokens=8, passes=passes, seed=3, **QUIET)
    seqs2 = by_key(load_harvest(out2, lm.cfg))
    for key in seqs:
        assert seqs2[key][0] == seqs[key][0], key
    # another seed: other sampled text, the same greedy text
    out3 = tmp_path / "h3"
    harvest(lm, out3, prompts, batch_size=6, max_new_tokens=8, passes=passes, seed=4, **QUIET)
    seqs3 = by_key(load_harvest(out3, lm.cfg))
    assert all(seqs3[(i, 0)][0] == seqs[(i, 0)][0] for i in range(6))
    assert sum(seqs3[(i, 1)][0] != seqs[(i, 1)][0] for i in range(6)) >= 4
    # a resume that asks another temperature or seed of a pass already there is refused
    with pytest.raises(DraftError, match="pass 1 was harvested at temperature 1.0, top_p 1.0, seed 3"):
        harvest(lm, out, prompts, batch_size=4, max_new_tokens=8, passes=harvest_passes(1, [0.7], 1.0),
                seed=3, **QUIET)
    with pytest.raises(DraftError, match="seed 3; this harvest asks .* seed 9"):
        harvest(lm, out, prompts, batch_size=4, max_new_tokens=8, passes=passes, seed=9, **QUIET)


def test_sampled_sequences_are_the_targets_draws_with_its_hidden_states(tmp_path):
    """Every sampled token is sample_rows of the target's teacher-forced logits at the uniform of
    its (prompt, pass, position); hidden states are stored as for greedy sequences."""
    lm = tiny_lm(seed=6)
    lm.cfg.eos_token_ids = [7]
    prompts = id_prompts(5, seed=6)
    passes = harvest_passes(1, [0.9], 0.8)
    harvest(lm, tmp_path / "h", prompts, batch_size=5, max_new_tokens=12, passes=passes, seed=11, **QUIET)
    data = load_harvest(tmp_path / "h", lm.cfg)
    from flint.speculative.draft_data import _prompt_key
    checked = 0
    for r, (pi, ps) in enumerate(zip(data.prompt_index.tolist(), data.pass_index.tolist())):
        if ps != 1:
            continue
        ids = prompts[pi]["ids"]
        n = int(data.lengths[r])
        gen = data.tokens[r, 1: n + 1].tolist()
        full = torch.tensor(ids + gen)
        logits, hid = Transformer(lm.cfg, lm.params, 64).forward(full, 0, return_hidden=True)
        u = sample_uniforms(11, 1, [_prompt_key(ids)], len(full))[0]
        P = len(ids)
        want = sample_rows(logits[P - 1: P - 1 + len(gen)], 0.9, 0.8, u[P: P + len(gen)])
        assert want.tolist() == gen
        assert n == 12 or gen[-1] == 7  # eos ends a sampled sequence too
        torch.testing.assert_close(data.hidden[r, :n].float(), hid[P - 1: P - 1 + n].to(torch.bfloat16).float(),
                                   rtol=2e-2, atol=2e-2)
        checked += 1
    assert checked == 5


def test_old_single_pass_shards_stay_valid_as_pass_0(tmp_path):
    """A shard written before passes (no 'pass' tensor or metadata) is pass 0: it loads, and a
    multi-pass harvest over the same directory adds only the sampled pass."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    lm = tiny_lm(seed=7)
    prompts = id_prompts(4, seed=7)
    out = tmp_path / "h"
    harvest(lm, out, prompts, batch_size=4, max_new_tokens=6, **QUIET)
    sh = next(out.glob("shard_*.safetensors"))
    with safe_open(str(sh), framework="pt") as fh:
        t = {k: fh.get_tensor(k) for k in fh.keys() if k != "pass"}
        m = {k: v for k, v in (fh.metadata() or {}).items() if k not in ("pass", "top_p", "seed")}
    save_file(t, str(sh), metadata=m)  # as the harvest wrote it before passes
    old = load_harvest(out, lm.cfg)
    assert old.pass_index.tolist() == [0] * 4 and old.meta["passes"][0]["temperature"] == 0.0
    assert harvest(lm, out, prompts, batch_size=4, max_new_tokens=6, passes=harvest_passes(1, [1.0]), **QUIET) == 4
    data = load_harvest(out, lm.cfg)
    assert collections.Counter(data.pass_index.tolist()) == {0: 4, 1: 4}


def test_validation_uses_greedy_sequences_only(tmp_path):
    lm = tiny_lm(seed=8)
    prompts = id_prompts(16, seed=8)
    with pytest.raises(DraftError, match="prompt 0 has 3 tokens; with max_new_tokens=126 it exceeds the "
                                         "target's context"):
        harvest(lm, tmp_path / "x", prompts[:1], max_new_tokens=126, **QUIET)
    harvest(lm, tmp_path / "h", prompts, batch_size=8, max_new_tokens=10, passes=harvest_passes(1, [1.0]), **QUIET)
    data = load_harvest(tmp_path / "h", lm.cfg)
    torch.manual_seed(0)
    draft = DraftHead(draft_config_for(lm.cfg, intermediate_size=64)).attach_target(lm.cfg, lm.params)
    rec = train_draft(draft, data, tmp_path / "d", steps=4, batch_size=4, val_frac=0.25, eval_every=2,
                      k_eval=2, **QUIET)
    # 2 of 8 subjects held out: their 4 greedy sequences validate, their sampled ones are dropped
    assert rec["val_sequences"] == 4 and rec["sequences"] == 24 and rec["sampled_sequences"] == 12
    assert [p["pass"] for p in rec["harvest"]["passes"]] == [0, 1]
    assert rec["init"] is None


# ------------------------------------------------------------------ prompt set v2

def test_prompt_set_v2_is_deterministic_larger_and_holds_out_subjects():
    v1, v2 = draft_prompts(prompt_set="v1"), draft_prompts(prompt_set="v2")
    assert draft_prompts(prompt_set=PROMPT_SET_V2) == v2 and v1 == draft_prompts()
    assert len({r["text"] for r in v2}) == len(v2)
    tr1 = [r for r in v1 if r["split"] == "train"]
    tr2 = [r for r in v2 if r["split"] == "train"]
    assert len(tr1) == 2757 and len(tr2) >= 2.8 * len(tr1)
    assert {r["kind"] for r in v2} == set(ALL_KINDS) and {r["kind"] for r in v1} == set(KINDS)
    # v1 is part of v2, each prompt in the same split: v1's held-out prompts stay unseen by v2 training
    split2 = {r["text"]: r["split"] for r in v2}
    assert all(split2[r["text"]] == r["split"] for r in v1)
    train = {(r["kind"], r["subject"]) for r in tr2}
    held = {(r["kind"], r["subject"]) for r in v2 if r["split"] == "eval"}
    assert not (train & held)
    for kind in ALL_KINDS:  # every kind holds out some subjects
        assert any(k == kind for k, _ in held), kind
    # the new kinds hand the model a text to change: the prompt carries the text
    rw = [r for r in v2 if r["kind"] == "rewrite"]
    assert len(rw) > 500 and all(len(r["text"]) > 150 for r in rw)
    ce = [r for r in v2 if r["kind"] == "codeedit"]
    assert len(ce) > 300 and all("\n" in r["text"] for r in ce)
    ev = eval_prompts(2, prompt_set="v2")
    assert [r["kind"] for r in ev] == [k for k in ALL_KINDS for _ in range(2)]
    assert eval_prompts(2) == eval_prompts(2, prompt_set=PROMPT_SET)
    with pytest.raises(DraftError, match="unknown prompt set 'v9'"):
        draft_prompts(prompt_set="v9")


# ------------------------------------------------------------------ warm start

def test_init_loads_weights_and_refuses_another_shape(tmp_path):
    lm = tiny_lm()
    torch.manual_seed(1)
    src = DraftHead(draft_config_for(lm.cfg, intermediate_size=64))
    for p in src.parameters():
        torch.nn.init.normal_(p, std=0.1)
    src.cfg.training = {"steps": 5, "harvest": {"prompt_set": PROMPT_SET}}
    save_draft(src, tmp_path / "src")
    torch.manual_seed(2)
    draft = DraftHead(draft_config_for(lm.cfg, intermediate_size=64))
    rec = init_weights(draft, tmp_path / "src", lm.cfg)
    assert rec == {"draft": str(tmp_path / "src"), "prompt_set": PROMPT_SET, "steps": 5}
    for k, v in src.state_dict().items():
        assert torch.equal(draft.state_dict()[k], v), k
    with pytest.raises(DraftError, match="field 'num_layers' is 1, the draft being trained has num_layers=2"):
        init_weights(DraftHead(draft_config_for(lm.cfg, num_layers=2, intermediate_size=64)), tmp_path / "src", lm.cfg)
    with pytest.raises(DraftError, match="no such draft directory"):
        init_weights(draft, tmp_path / "nope", lm.cfg)


def test_cli_harvest_and_train_options():
    import argparse

    from flint.speculative import cli as draft_cli

    ap = argparse.ArgumentParser()
    draft_cli.register(ap.add_subparsers(dest="command"))
    a = ap.parse_args(["draft", "harvest", "--out", "h", "--prompt-set", "v2", "--sampled-passes", "3",
                       "--temperature", "0.7,1.0", "--top-p", "0.9"])
    assert a.prompt_set == "v2" and a.sampled_passes == 3 and a.temperature == [0.7, 1.0]
    assert draft_cli.parse_passes(a.sampled_passes, a.temperature, a.top_p) == harvest_passes(3, [0.7, 1.0], 0.9)
    with pytest.raises(DraftError, match="give --sampled-passes"):
        draft_cli.parse_passes(0, [0.7], None)
    a = ap.parse_args(["draft", "train", "--data", "h", "--out", "d", "--init", "smollm2-135m"])
    assert a.init == "smollm2-135m"


# ------------------------------------------------------------------ the build script

def test_build_script_end_to_end_on_a_tiny_model(tmp_path):
    """bench/draft_smollm2.py with v2, a sampled pass and a warm start, on CPU with tiny budgets:
    the draft loads, draft.json records prompt set, passes and init, the vocabulary is pruned."""
    import importlib.util
    from pathlib import Path

    from conftest import make_hf_model, save_hf_dir

    from flint.loading import load_model

    # the byte tokenizer makes v2's longest prompts ~700 tokens
    tiny_llama_dir = save_hf_dir(make_hf_model("llama", seed=1, max_position_embeddings=1024), tmp_path / "m")
    spec = importlib.util.spec_from_file_location(
        "draft_smollm2", Path(__file__).resolve().parents[1] / "bench" / "draft_smollm2.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    lm = load_model(str(tiny_llama_dir))
    torch.manual_seed(0)
    save_draft(DraftHead(draft_config_for(lm.cfg)), tmp_path / "init")
    out = tmp_path / "out"
    argv = ["--model", str(tiny_llama_dir), "--out", str(out), "--work", str(tmp_path / "work"),
            "--prompt-set", "v2", "--sampled-passes", "1", "--temperature", "0.8", "--init", str(tmp_path / "init"),
            "--batch-size", "16", "--max-new-tokens", "6", "--harvest-budget", "0.01", "--train-budget", "2",
            "--train-batch", "4", "--draft-vocab", "40", "--sweep", "2", "--eval-per-kind", "1",
            "--eval-budget", "5", "--eval-new-tokens", "4", "--attention-heads", "2"]
    assert mod.main(argv) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["harvest"]["prompt_set"] == PROMPT_SET_V2 and res["harvest"]["sequences"] == 16
    d = json.loads((out / "draft" / "draft.json").read_text())
    tr = d["training"]
    assert tr["harvest"]["prompt_set"] == PROMPT_SET_V2
    assert tr["harvest"]["passes"][0]["temperature"] == 0.0  # the budget left room for one batch: pass 0
    assert tr["init"]["draft"] == str(tmp_path / "init")
    assert d["draft_vocab"] == 40 and d["k_default"] == 2
    dr = load_draft(out / "draft", lm.cfg, lm.params)
    assert dr.draft_vocab_size == 40 and d["attention_heads"] == 2 and dr.stateful  # (the eval decoded with it)
    assert "greedy" in res["eval"] and res["eval"]["prompt_set"] == PROMPT_SET
