"""`flint eval` on a tiny model and a tiny text: sliding-window perplexity against a direct
computation, KL / top-1 against the model itself and a re-quantized copy, the shipped corpus, and
clear errors. Run: ``pytest tests/test_eval.py`` (~10 s).
"""
from __future__ import annotations

import math

import pytest
import torch

from flint.evaluate import (DEFAULT_CORPUS, EvalError, evaluate, main, markdown_table, parse_variants,
                            run_eval, windows)
from conftest import BYTE_VOCAB, TINY
from flint.model import Transformer

TEXT = ("The lighthouse keeper climbed the stairs every evening and wrote the time in the logbook. "
        "Bread rises because yeast makes gas and gluten holds it. ") * 2


def _quiet(*a, **k):
    pass


@pytest.mark.parametrize("n,window,stride", [(10, 4, 2), (97, 32, 16), (33, 32, 31), (5, 8, 4)])
def test_windows_score_each_target_once(n, window, stride):
    ws = windows(n, window, stride)
    targets = [t for b, e, t0 in ws for t in range(t0, e)]
    assert targets == list(range(1, n))
    for b, e, t0 in ws:
        assert e - b <= window and t0 > b
        assert t0 == 1 or t0 - 1 - b >= window - stride - 1  # context before the first scored token


def test_perplexity_matches_a_direct_computation(tiny_llama, tmp_path):
    ids = tiny_llama.tokenizer.encode(TEXT)[:90]
    ref = Transformer(tiny_llama.cfg, tiny_llama.params, 96)
    logits = ref.forward(torch.tensor(ids), 0)
    lp = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])
    want = math.exp(float(-lp.mean()))
    rows = evaluate(ids, ("m", ref), [], window=96, stride=48)
    assert rows[0].tokens == len(ids) - 1
    assert rows[0].ppl == pytest.approx(want, rel=1e-5)
    # sliding windows give a different but close figure (less context for some tokens)
    slid = evaluate(ids, ("m", ref), [], window=32, stride=16)[0].ppl
    assert slid != pytest.approx(want, rel=1e-6) and slid == pytest.approx(want, rel=0.5)


def test_kl_and_top1(tiny_llama_dir, tmp_path):
    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    rows = run_eval(str(tiny_llama_dir), str(f), against=str(tiny_llama_dir), quantize="32,32:float-head",
                    window=64, stride=32, log=_quiet)
    ref, same, q32, q32fh = rows
    assert same.kl_mean == pytest.approx(0.0, abs=1e-6) and same.top1_agree == 1.0
    assert same.ppl == pytest.approx(ref.ppl, rel=1e-6)
    # a random toy (PPL ~ 4e5) is fragile: int4 moves it, but far less than a different model would
    assert 0 < q32.kl_mean < 3 and q32.kl_p99 >= q32.kl_mean and 0.3 < q32.top1_agree < 1.0
    assert 0 < q32fh.kl_mean  # float head: only the linear weights are re-quantized
    assert q32.weights.startswith("int4 g32 x14") and "head int4 g32" in q32.weights
    assert "head float32" in q32fh.weights and ref.weights == "int4 none, head float32"
    table = markdown_table(rows)
    assert "(reference)" in table and "requantized g32, float head" in table


def test_head_and_calibrated_variants(tiny_llama_dir, tmp_path, torch_one_thread):
    """searched / GPTQ / 8-bit heads, GPTQ linears and an int4 embedding run end to end; each
    row's weights and bytes per token say what it holds, and each differs from the plain RTN row."""
    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    spec = "32,32:searched-head,32:gptq-head,32:int8-head,32:gptq,32:int4-embed"
    rows = run_eval(str(tiny_llama_dir), str(f), quantize=spec, window=64, stride=32, log=_quiet)
    ref, rtn, searched, gptq_head, int8, gptq, emb = rows
    assert [r.label for r in rows[1:]] == [v.label for v in parse_variants(spec)]
    assert gptq.label == "GPTQ g32" and int8.label == "requantized g32, 8-bit head"
    assert "head int8 g32" in int8.weights and "embed int4 g32" in emb.weights
    for r in rows[1:]:
        assert r.kl_mean > 0 and r.weight_mb > 0
    for r in (searched, gptq_head, int8, gptq, emb):
        assert r.ppl != rtn.ppl, r.label
    # the 8-bit head streams 1 + 1/16 bytes a value, the int4 one 1/2 + 1/8
    v, h = BYTE_VOCAB, TINY["hidden_size"]
    assert int8.weight_mb - rtn.weight_mb == pytest.approx((v * h * (1 + 2 / 32) - v * h * (0.5 + 4 / 32)) / 1e6)
    assert searched.weight_mb == rtn.weight_mb == gptq.weight_mb


def test_shipped_corpus_is_there():
    text = DEFAULT_CORPUS.read_text(encoding="utf-8")
    assert len(text.split()) > 3000
    assert (DEFAULT_CORPUS.parent / "README.md").read_text().count("License") >= 1


def test_bad_arguments_are_clear_errors(tiny_llama_dir, tmp_path, capsys):
    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    with pytest.raises(EvalError, match="--stride must be in 1..window-1"):
        run_eval(str(tiny_llama_dir), str(f), window=32, stride=32, log=_quiet)
    with pytest.raises(EvalError, match="--window 512 exceeds the model's context of 96"):
        run_eval(str(tiny_llama_dir), str(f), log=_quiet)
    with pytest.raises(EvalError, match="group size must be one of"):
        parse_variants("48")
    with pytest.raises(EvalError, match="unknown option"):
        parse_variants("32:int9-head")
    with pytest.raises(EvalError, match="names two heads"):
        parse_variants("32:searched-head:float-head")
    with pytest.raises(EvalError, match="file not found"):
        run_eval(str(tiny_llama_dir), str(tmp_path / "nope.txt"), log=_quiet)
    cfg = tmp_path / "config.json"
    cfg.write_text('{"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, '
                   '"num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 64}')
    assert main(["--model", f"synthetic:{cfg}", "--file", str(f)]) == 2
    assert "has no tokenizer" in capsys.readouterr().err


def test_cli(tiny_llama_dir, tmp_path, capsys):
    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    out = tmp_path / "e.json"
    assert main(["--model", str(tiny_llama_dir), "--file", str(f), "--window", "64", "--quantize", "32",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| requantized g32 |" in printed and "tokens scored, window 64, stride 32" in printed
    assert out.read_text().count('"ppl"') == 2
