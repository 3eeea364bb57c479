"""The oracle-acceptance benchmark draft (flint.speculative.oracle): tokens per step follow the set probability, the
output stays plain greedy's, and it is refused where it would mislead. Tiny random model on CPU; a few seconds.

Run: ``pytest tests/test_oracle.py``
"""
from __future__ import annotations

import pytest
import torch

from flint.bench import BenchError, _run, run_oracle_bench
from flint.speculative.oracle import OracleDraft, expected_tokens_per_step


@pytest.fixture(autouse=True, scope="module")
def one_thread(torch_one_thread):
    """Tiny tensors: intra-op threads only add contention on a shared 2-core CI box."""


def test_expected_tokens_per_step():
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(1.0, 4) == 5.0
    assert abs(expected_tokens_per_step(0.7, 4) - (1 + 0.7 + 0.49 + 0.343 + 0.2401)) < 1e-12


def tiny_lm():
    from flint.config import from_hf_dict
    from flint.loading import LoadedModel, expected_shapes

    cfg = from_hf_dict(dict(model_type="llama", vocab_size=600, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=True), "tiny")
    g = torch.Generator().manual_seed(0)
    params = {n: (1 + 0.1 * torch.randn(sh, generator=g)) if n.endswith("norm") else torch.randn(sh, generator=g)
              for n, sh in expected_shapes(cfg).items() if n != "lm_head"}
    params["lm_head"] = params["embed"]
    return LoadedModel(cfg, params, None, "tiny")


def test_oracle_bench_sets_acceptance_and_keeps_output(monkeypatch):
    from flint import bench

    monkeypatch.setattr(bench, "load_bench_model", lambda *a, **k: tiny_lm())
    doc = run_oracle_bench("synthetic:tiny", ["reference"], [3], [0.0, 0.6, 1.0], n_prompts=2,
                           max_new_tokens=60, device="cpu", draft_vocab=512, log=lambda *a, **k: None)
    assert doc["oracle"] is True and "ORACLE" in doc["note"]
    rows = {r["oracle_accept"]: r for r in doc["speculative"]}
    assert all(r["identical_to_plain"] == "2/2" for r in rows.values())
    assert rows[0.0]["tokens_per_step"] == 1.0
    assert rows[1.0]["tokens_per_step"] > 3.5  # 4 per step but where k shrinks at the end
    assert 1.5 < rows[0.6]["tokens_per_step"] < 2.6 and rows[0.6]["expected_tokens_per_step"] == pytest.approx(2.176)
    assert all(r["draft_vocab"] == 512 and "off_reference_proposals" not in r for r in rows.values())


def test_oracle_refusals():
    class Inner:
        def propose(self, ctx, hidden, k, sp, gen):
            return torch.zeros(k, dtype=torch.long), None

    from flint.engine import SamplingParams
    with pytest.raises(ValueError, match="accept must lie in"):
        OracleDraft(Inner(), [1, 2, 3], 1.5, 10)
    with pytest.raises(ValueError, match="greedy only"):
        OracleDraft(Inner(), [1, 2, 3], 0.5, 10).propose([1], None, 2, SamplingParams(temperature=0.5))
    import argparse
    base = dict(draft="oracle", temperature=0.0, draft_vocab=None, backend="reference", device="cpu", draft_k=None,
                oracle_accept="0.7", draft_prompts=1, tokens=4, group_size=128, seed=0, json=None)
    with pytest.raises(BenchError, match="for synthetic models"):
        _run(argparse.Namespace(**{**base, "model": "some.gguf"}))
    with pytest.raises(BenchError, match="greedy only"):
        _run(argparse.Namespace(**{**base, "model": "synthetic:smollm2-135m", "temperature": 0.7}))
