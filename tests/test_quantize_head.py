"""`flint quantize`'s head and embedding: what it reports, the embedding's stored form (fp16 from
fp32, int4 where exact or asked), the searched and GPTQ heads, GPTQ linears, and refusals.
Every checkpoint is loaded back and run by the reference decoder and the compiled backend on
the CPU (the megakernel reads "embed" the same way: any float dtype or int4, converted to fp32
once at load). Run: ``pytest tests/test_quantize_head.py`` (~30 s).
"""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from conftest import make_hf_model, save_hf_dir
from flint.compiled import CompiledBackend
from flint.loading import LoadedModel, load_model
from flint.model import Transformer
from flint.quant.int4 import Int4Weight, quantize_int4, quantize_int4_searched
from flint.quant.quantize import (QuantizeError, embedding_for_checkpoint, main, quantize_checkpoint,
                                  quantize_for_checkpoint, save_checkpoint)

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    return save_hf_dir(make_hf_model("llama", seed=4, tie_word_embeddings=True),
                       tmp_path_factory.mktemp("tied-llama"))


def _run(src, out, **kw):
    lines = []
    quantize_checkpoint(str(src), out, log=lambda *a, **k: lines.append(" ".join(map(str, a))), **kw)
    return load_model(str(out)), lines


def _keys(out):
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def _runs_on_cpu(lm, want_logits=None):
    """The loaded checkpoint through the reference decoder and the compiled backend (CPU, int4)."""
    toks = torch.tensor([5, 40, 77, 3, 120, 9])
    ref = Transformer(lm.cfg, lm.params, 32).forward(toks, 0)
    comp = CompiledBackend(lm.cfg, lm.params, 32, device="cpu", int4=True,
                           group_size=lm.params["layers.0.wq"].group_size).forward(toks, 0)
    assert float((comp - ref).abs().max()) < 1e-3 * float(ref.abs().max()) + 1e-4
    if want_logits is not None:
        assert torch.allclose(ref, want_logits, atol=1e-5)
    return ref


def test_reports_and_stores_the_embedding_in_fp16(tiny_llama_dir, tmp_path):
    src = load_model(str(tiny_llama_dir))
    lm, lines = _run(tiny_llama_dir, tmp_path / "q", group_size=32)
    text = "\n".join(lines)
    assert "linear weights: 14 quantized round-to-nearest at g32" in text
    assert "LM head: int4 g32, round-to-nearest, from the source's float32" in text
    assert "embedding: float16 from the source's float32 (largest rounding error" in text
    assert "model.safetensors" in lines[-1]
    assert lm.params["embed"].dtype == torch.float16 and torch.equal(lm.params["embed"], src.params["embed"].half())
    _runs_on_cpu(lm)


def test_tied_int4_embedding_is_stored_once(tied_dir, tmp_path):
    """--embed int4 on a tied model with an RTN head: one int4 tensor serves the lookup and the
    head (no lm_head.* in the file); the loader ties them back."""
    src = load_model(str(tied_dir))
    lm, lines = _run(tied_dir, tmp_path / "q", group_size=32, embed="int4")
    assert "the same tensor as the LM head" in "\n".join(lines)
    assert not any(k.startswith("lm_head") for k in _keys(tmp_path / "q"))
    assert isinstance(lm.params["embed"], Int4Weight) and lm.params["lm_head"] is lm.params["embed"]
    want = quantize_int4(src.params["embed"], 32)
    assert torch.equal(lm.params["embed"].qweight, want.qweight)
    _runs_on_cpu(lm)
    # a searched head differs from the RTN lookup copy: both stored
    lm2, _ = _run(tied_dir, tmp_path / "q2", group_size=32, embed="int4", head="searched")
    assert lm2.params["lm_head"] is not lm2.params["embed"]
    assert torch.equal(lm2.params["lm_head"].scales, quantize_int4_searched(src.params["embed"], 32).scales)
    assert torch.equal(lm2.params["embed"].qweight, want.qweight)
    _runs_on_cpu(lm2)


def test_an_exactly_int4_embedding_stays_int4(tied_dir, tmp_path):
    """A GGUF Q4_0 / Q4_1 tied embedding (loaded as the int4 head plus its float copy): --embed
    auto stores the int4 tensor once, bit for bit, and the model computes what the source did."""
    src = load_model(str(tied_dir))
    params = dict(src.params)
    q4 = quantize_int4(params["embed"], 32)
    params["lm_head"], params["embed"] = q4, q4.dequantize()
    lm = LoadedModel(src.cfg, params, src.tokenizer, str(tied_dir))
    logs = []
    out = quantize_for_checkpoint(params, 32, log=lambda *a, **k: logs.append(a[0]))
    assert out["lm_head"] is q4 and "LM head: kept as the source's int4 g32" in logs[-1]
    out["embed"], what = embedding_for_checkpoint(params, out, "auto", 32)
    assert out["embed"] is q4 and what.startswith("int4 g32, the source's values exactly, the same tensor")
    save_checkpoint(lm, out, 32, tmp_path / "q")
    back = load_model(str(tmp_path / "q"))
    assert back.params["lm_head"] is back.params["embed"] and torch.equal(back.params["embed"].qweight, q4.qweight)
    want = Transformer(src.cfg, {**params, **{k: v for k, v in out.items() if k != "embed"}}, 32).forward(
        torch.tensor([5, 40, 77, 3, 120, 9]), 0)
    _runs_on_cpu(back, want)


def test_gptq_method_and_head(tiny_llama_dir, tmp_path):
    src = load_model(str(tiny_llama_dir))
    lm, lines = _run(tiny_llama_dir, tmp_path / "q", group_size=32, method="gptq")
    text = "\n".join(lines)
    assert "GPTQ on 15 tensors, calibration" in text and "calibration.txt" in text
    assert "14 quantized GPTQ over the calibration text at g32" in text
    assert "LM head: int4 g32, GPTQ over the calibration text" in text
    rtn = quantize_int4(src.params["layers.0.wq"], 32)
    assert not torch.equal(lm.params["layers.0.wq"].qweight, rtn.qweight)
    _runs_on_cpu(lm)
    # GPTQ for the head only, over another text
    cal = tmp_path / "cal.txt"
    cal.write_text("Some other words to calibrate on, repeated a few times. " * 8)
    lm2, lines2 = _run(tiny_llama_dir, tmp_path / "q2", group_size=32, head="gptq", calibration=str(cal))
    assert "GPTQ on 1 tensor," in "\n".join(lines2) and "cal.txt" in "\n".join(lines2)
    assert torch.equal(lm2.params["layers.0.wq"].qweight, rtn.qweight)


def test_refusals(tiny_llama_dir, tmp_path, capsys):
    with pytest.raises(QuantizeError, match="--float-head and --head searched contradict"):
        quantize_checkpoint(str(tiny_llama_dir), tmp_path / "a", float_head=True, head="searched", log=print)
    with pytest.raises(QuantizeError, match="--calibration is only read by GPTQ"):
        quantize_checkpoint(str(tiny_llama_dir), tmp_path / "b", calibration="x.txt", log=print)
    with pytest.raises(QuantizeError, match="--device cuda is only used by GPTQ"):
        quantize_checkpoint(str(tiny_llama_dir), tmp_path / "b", device="cuda", log=print)
    with pytest.raises(QuantizeError, match="--embed 'fp8' is not one of"):
        quantize_checkpoint(str(tiny_llama_dir), tmp_path / "c", embed="fp8", log=print)
    cfg = tmp_path / "config.json"
    cfg.write_text('{"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, '
                   '"num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 64}')
    with pytest.raises(QuantizeError, match="has no tokenizer"):
        quantize_checkpoint(f"synthetic:{cfg}", tmp_path / "d", method="gptq", log=print)
    assert not any(p.name in ("a", "b", "c", "d") for p in tmp_path.iterdir())
    assert main([str(tiny_llama_dir), str(tmp_path / "e"), "--head", "searched", "--embed", "bf16",
                 "--group-size", "32"]) == 0
    err = capsys.readouterr().err
    assert "LM head: int4 g32, (scale, min) searched per group" in err and "embedding: bfloat16" in err
    assert load_model(str(tmp_path / "e")).params["embed"].dtype == torch.bfloat16
