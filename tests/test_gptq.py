"""GPTQ (flint/quant/gptq.py): lower output error than round-to-nearest for correlated inputs, exact on
weights already on an int4 grid, Hessians collected at the right sites of the reference decoder,
and clear errors. Run: ``pytest tests/test_gptq.py`` (~10 s).
"""
from __future__ import annotations

import pytest
import torch

from flint.quant.gptq import CALIBRATION_TEXT, calibration_ids, collect_hessians, gptq_int4, gptq_params, output_error
from flint.model import Transformer, rms_norm
from flint.quant.int4 import Int4Weight, quantize_int4

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _correlated_inputs(k: int, tokens: int, seed: int, draw: int = 0) -> torch.Tensor:
    """Inputs whose channels are correlated and of unequal size, as a norm's outputs are; the
    channel mix is ``seed``'s, the samples ``draw``'s."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k ** 0.5 + torch.eye(k)
    scale = torch.exp(torch.randn(k, generator=g))
    noise = torch.randn(tokens, k, generator=torch.Generator().manual_seed(1000 + draw))
    return (noise @ mix) * scale


@pytest.mark.parametrize("group_size", [32, 64])
def test_gptq_beats_rtn_on_output_error(group_size):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 128, generator=g)
    x = _correlated_inputs(128, 400, 1)
    h = x.T.double() @ x.double()
    q = gptq_int4(w, h, group_size, "w")
    assert isinstance(q, Int4Weight) and q.shape == (48, 128) and q.group_size == group_size
    assert q.scales.dtype == torch.float16 and q.scales.shape == (48, 128 // group_size)
    rtn = output_error(w, quantize_int4(w, group_size), h)
    assert output_error(w, q, h) < 0.8 * rtn
    # the layer's output on held-out inputs drawn the same way improves too
    xt = _correlated_inputs(128, 200, 1, draw=1)
    assert (xt @ (w - q.dequantize()).T).norm() < (xt @ (w - quantize_int4(w, group_size).dequantize()).T).norm()


def test_gptq_is_exact_on_weights_already_on_an_int4_grid():
    """A Q4_1-like tensor (every group holds codes 0 and 15): no rounding error to move, so the
    codes, scales and mins come back as they were."""
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (16, 64), generator=g)
    codes[:, ::32] = 0
    codes[:, 1::32] = 15
    src = quantize_int4(codes.float() * 0.01 - 0.07, 32)
    w = src.dequantize()
    x = _correlated_inputs(64, 100, 3)
    q = gptq_int4(w, x.T.double() @ x.double(), 32, "w")
    assert torch.equal(q.qweight, src.qweight) and torch.equal(q.scales, src.scales) and torch.equal(q.mins, src.mins)


def test_hessians_are_collected_at_each_weights_input(tiny_llama):
    """The head's H is the sum of x x^T over the final-norm outputs; q/k/v share one H, gate/up
    another; w_down's is [I, I]."""
    cfg, params = tiny_llama.cfg, tiny_llama.params
    ids = list(range(3, 60))
    hs = collect_hessians(cfg, params, ids, window=32, progress=False)
    m = Transformer(cfg, params, max_seq_len=32)
    xs = []
    for i in range(0, len(ids), 32):
        _, hidden = m.forward(torch.tensor(ids[i:i + 32]), 0, return_hidden=True)
        xs.append(rms_norm(hidden, m.norm, cfg.rms_norm_eps))
    x = torch.cat(xs).double()
    assert hs["lm_head"].dtype == torch.float64
    assert torch.allclose(hs["lm_head"], x.T @ x, rtol=1e-4, atol=1e-6)
    assert hs["layers.1.wq"] is hs["layers.1.wk"] is hs["layers.1.wv"]
    assert hs["layers.0.w_gate"] is hs["layers.0.w_up"] and hs["layers.0.w_gate"] is not hs["layers.0.wq"]
    assert hs["layers.0.w_down"].shape == (cfg.intermediate_size, cfg.intermediate_size)
    assert not torch.equal(hs["layers.0.wq"], hs["layers.1.wq"])


def test_gptq_params_and_errors(tiny_llama, tmp_path):
    cfg, params = tiny_llama.cfg, tiny_llama.params
    out = gptq_params(cfg, params, ["layers.0.wq", "lm_head"], {"layers.0.wq": 32, "lm_head": 64},
                      ids=list(range(3, 40)), progress=False)
    assert out["layers.0.wq"].group_size == 32 and out["lm_head"].group_size == 64
    with pytest.raises(ValueError, match="not a linear weight"):
        gptq_params(cfg, params, ["norm"], {"norm": 32}, ids=list(range(3, 40)), progress=False)
    with pytest.raises(ValueError, match="does not match in_features"):
        gptq_int4(torch.randn(8, 64), torch.eye(32), 32, "w")
    short = tmp_path / "short.txt"
    short.write_text("hi")
    with pytest.raises(ValueError, match="short.txt: calibration text has 2 tokens"):
        calibration_ids(tiny_llama.tokenizer, short)
    with pytest.raises(ValueError, match="calibration text not found"):
        calibration_ids(tiny_llama.tokenizer, tmp_path / "none.txt")


def test_shipped_calibration_text():
    text = CALIBRATION_TEXT.read_text(encoding="utf-8")
    assert 3000 < len(text) < 20000
    corpus = (CALIBRATION_TEXT.parent / "eval-corpus.txt").read_text(encoding="utf-8")
    # disjoint from the eval corpus: no sentence of one is in the other
    for sentence in (s.strip() for s in text.split(".") if len(s.strip()) > 40):
        assert sentence not in corpus


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gptq_on_the_gpu(tiny_llama):
    """Hessians and solves on CUDA: the same sites, the result on the CPU and as good as the CPU's."""
    cfg, params = tiny_llama.cfg, tiny_llama.params
    ids = list(range(3, 60))
    hc = collect_hessians(cfg, params, ids, window=32, progress=False)
    hg = collect_hessians(cfg, params, ids, window=32, progress=False, device="cuda")
    assert hg["lm_head"].device.type == "cuda"
    assert torch.allclose(hg["lm_head"].cpu(), hc["lm_head"], rtol=1e-3, atol=1e-4)
    w = params["layers.0.w_up"].float()
    qg, qc = gptq_int4(w, hg["layers.0.w_up"], 32, "w_up"), gptq_int4(w, hc["layers.0.w_up"], 32, "w_up")
    assert qg.qweight.device.type == "cpu"
    h = hc["layers.0.w_up"]
    assert output_error(w, qg, h) == pytest.approx(output_error(w, qc, h), rel=0.05)
