"""`flint bench --head-group-size` on a CPU (flint.bench_head): the option's parsing and refusals, one
pass per head group size with the head really at that group size, and bytes per token that differ
between head variants by exactly the head's (scale, min) bytes. Run: ``pytest tests/test_bench_head.py``.
"""
from __future__ import annotations

import json

import pytest
import torch

from flint.bench import main, markdown_table, run_bench
from flint.bench_head import HeadOptionError, head_variants, int4_bytes, parse_head_groups
from flint.quant.int4 import Int4Weight
from flint.synthetic import synthetic_model

TINY = dict(model_type="llama", vocab_size=256, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=24, rms_norm_eps=1e-5,
            tie_word_embeddings=True, max_position_embeddings=64)  # K = 96: heads at g32, not g64 / g128


@pytest.fixture(scope="module")
def tiny_spec(tmp_path_factory):
    p = tmp_path_factory.mktemp("bench_head") / "config.json"
    p.write_text(json.dumps(TINY))
    return f"synthetic:{p}"


def _quiet(*a, **k):
    pass


def test_parse_head_groups_and_refusals():
    assert parse_head_groups("32, 64,128,32") == [32, 64, 128]
    for bad in ("float", "int8", "16", "256", ""):
        with pytest.raises(HeadOptionError, match="--head-group-size"):
            parse_head_groups(bad)
    with pytest.raises(HeadOptionError, match="float or 8-bit head"):
        parse_head_groups("32,float")


def test_float_backends_are_refused(tiny_spec, capsys):
    for b in ("reference", "compiled-bf16"):
        with pytest.raises(HeadOptionError, match=f"backend '{b}' holds the LM head in float"):
            run_bench([tiny_spec], ["compiled", b], [8], device="cpu", log=_quiet, head_groups=[32])
    assert main(["--model", tiny_spec, "--backend", "compiled", "--device", "cpu", "--head-group-size", "32",
                 "--response-format", "json"]) != 0
    assert "does not combine with --draft" in capsys.readouterr().err
    assert main(["--model", tiny_spec, "--backend", "compiled", "--device", "cpu", "--head-group-size",
                 "float"]) != 0
    assert "no int4 backend streams a float or 8-bit head" in capsys.readouterr().err


def test_head_variants_replace_only_the_head(tiny_spec):
    lm = synthetic_model(tiny_spec[len("synthetic:"):], int4_group_size=32, dtype=torch.float32)
    out = list(head_variants(lm, "m", [32, 64]))
    assert [(n, h) for n, h, _ in out] == [("m · head int4 g32", "int4 g32"), ("m · head int4 g64", "int4 g64")]
    (_, _, v32), (_, _, err) = out
    assert isinstance(err, HeadOptionError) and "K=96" in str(err)
    head = v32.params["lm_head"]
    assert isinstance(head, Int4Weight) and head.group_size == 32 and head.nbytes == int4_bytes(256, 96, 32)
    assert all(v32.params[k] is w for k, w in lm.params.items() if k != "lm_head")
    assert lm.params["lm_head"] is not head  # the model itself is untouched
    assert list(head_variants(lm, "m", None)) == [("m", None, lm)]


def test_one_run_one_pass_per_head(tmp_path):
    """Body at g32 with K = 128 (hidden 128): heads g32 / g64 / g128 on the compiled backend (CPU: fp32
    (scale, zero) pairs, 8 bytes a group); the rows differ by the head's group bytes only."""
    cfg = dict(TINY, hidden_size=128, head_dim=32)
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    spec = f"synthetic:{p}"
    doc = run_bench([spec], ["compiled"], [8], n_tokens=2, repeats=1, device="cpu", group_size=32,
                    bw_bytes=8 << 20, log=_quiet, head_groups=[32, 64, 128])
    assert not doc.get("errors")
    rows = {r["head"]: r for r in doc["results"]}
    assert list(rows) == ["int4 g32", "int4 g64", "int4 g128"]
    assert [r["model"] for r in doc["results"]] == [f"{spec} · head {h}" for h in rows]
    v, k = cfg["vocab_size"], cfg["hidden_size"]
    b = {h: r["bytes_per_token"] for h, r in rows.items()}
    # codes are the same bytes at every group size; each group of each row costs an fp32 (scale, zero)
    assert b["int4 g32"] - b["int4 g64"] == v * (k // 32 - k // 64) * 8
    assert b["int4 g64"] - b["int4 g128"] == v * (k // 64 - k // 128) * 8
    # the megakernel's layout streams fp16 (scale, min): half of that
    assert int4_bytes(v, k, 32) - int4_bytes(v, k, 64) == v * (k // 32 - k // 64) * 4
    table = markdown_table(doc)
    assert all(f"head {h}" in table for h in rows)


def test_a_head_group_that_does_not_divide_k_is_an_error_row(tiny_spec):
    doc = run_bench([tiny_spec], ["compiled"], [8], n_tokens=1, repeats=1, device="cpu", group_size=32,
                    bw_bytes=8 << 20, log=_quiet, head_groups=[32, 64])
    assert [r["head"] for r in doc["results"]] == ["int4 g32"]
    (err,) = doc["errors"]
    assert err["model"].endswith("head int4 g64") and "K=96" in err["error"]
