"""bench/make_q4km.py: its Q4_K / Q6_K writer, and a tiny model written as Q4_K_M loading in flint.

* the Q4_K and Q6_K quantizers' bytes decode with gguf.quants.dequantize to exactly the values the
  quantizer meant (bit for bit, zero and outlier sub-blocks included), and those are within the
  format's own error of the input;
* the recipe: Q6_K for the (tied) head and for attn_v / ffn_down in llama.cpp's "more bits"
  layers, Q4_K elsewhere;
* a tiny model (K = 256 everywhere, so every matrix takes a K-quant) converted by the tool loads in
  flint with every tensor equal to gguf's dequantize, and the reference backend's logits equal
  those of gguf's float weights exactly; `flint eval --quantize G:kernel` gives the int4 backends'
  params (quantize_params).

Run: ``pytest tests/test_q4km.py`` (a few seconds).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from flint.loading import load_model
from flint.model import Transformer
from flint.params import LINEAR_NAMES
from flint.quant import Int4Weight, quantize_params

QT = gguf.GGMLQuantizationType
_spec = importlib.util.spec_from_file_location("make_q4km", Path(__file__).parents[1] / "bench" / "make_q4km.py")
mq = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mq)


def _bits(x) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32)


def _weights(rng, n=32, k=512) -> np.ndarray:
    x = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    x[0, :256] = 0.0  # an all-zero super-block
    x[1, :32] = 0.0  # a zero sub-block next to nonzero ones
    x[2, 40] = 0.9  # an outlier: its sub-block's scale, not the rest, absorbs it
    x[3, :256] = np.abs(x[3, :256]) + 0.01  # all positive: Q4_K's min clips at 0
    return x


@pytest.mark.parametrize("kind,quantize,tol", [(QT.Q4_K, mq.quantize_q4_k, 0.09),
                                                (QT.Q6_K, mq.quantize_q6_k, 0.025)])
def test_writer_round_trips_through_gguf_bit_for_bit(kind, quantize, tol):
    x = _weights(np.random.default_rng(int(kind)))
    raw, meant = quantize(x)
    assert raw.dtype == np.uint8 and raw.shape == (x.shape[0], x.shape[1] // 256 * gguf.GGML_QUANT_SIZES[kind][1])
    got = gguf.quants.dequantize(raw, kind)
    assert np.array_equal(_bits(got), _bits(meant)), f"{kind.name}: the bytes decode to other values"
    assert np.all(got[0, :256] == 0) and np.all(got[1, :32] == 0)
    # within the format's error: relative RMS error of a 4-bit / 6-bit code on Gaussian weights
    rows = slice(4, None)
    rel = np.sqrt(np.mean((got[rows] - x[rows]) ** 2) / np.mean(x[rows] ** 2))
    assert rel < tol, f"{kind.name}: relative RMS error {rel:.4f}"
    # away from the outlier's super-block, every value within about one code step of its sub-block
    # (Q4_K: range / 15; Q6_K, symmetric: 2 max|x| / 63), the sub-scales' rounding included
    sub = 32 if kind == QT.Q4_K else 16
    xs = x[rows].reshape(-1, sub)
    step = np.ptp(xs, axis=-1) / 15 if kind == QT.Q4_K else 2 * np.abs(xs).max(-1) / 63
    err = np.abs(got[rows] - x[rows]).reshape(-1, sub).max(-1)
    assert np.all(err <= 1.1 * step)


def test_recipe_types():
    n = 30
    more = [i for i in range(n) if mq.use_more_bits(i, n)]
    assert more == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]
    assert mq.recipe_type("token_embd.weight", n, has_output=False) == QT.Q6_K
    assert mq.recipe_type("token_embd.weight", n, has_output=True) == QT.Q4_K
    assert mq.recipe_type("output.weight", n, has_output=True) == QT.Q6_K
    assert mq.recipe_type("blk.5.attn_v.weight", n, False) == QT.Q6_K
    assert mq.recipe_type("blk.6.ffn_down.weight", n, False) == QT.Q4_K
    assert mq.recipe_type("blk.5.attn_q.weight", n, False) == QT.Q4_K


@pytest.fixture(scope="module")
def tiny_q4km(tmp_path_factory):
    from conftest import make_hf_model
    from test_gguf import write_tiny_gguf

    # K = 256 for every matrix: hidden 256 (4 heads of 64), ffn 256; 8 layers so both types occur
    hf = make_hf_model("llama", seed=5, hidden_size=256, intermediate_size=256, head_dim=64,
                       num_hidden_layers=8)
    d = tmp_path_factory.mktemp("q4km")
    write_tiny_gguf(hf, d / "src.gguf")
    table = mq.convert(str(d / "src.gguf"), str(d / "q4km.gguf"), log=lambda *a: None)
    return d / "q4km.gguf", table


def test_tiny_q4km_loads_exactly(tiny_q4km):
    path, table = tiny_q4km
    written = {name: kind for name, _, kind in table}
    assert {name: want for name, want, _ in table} == written  # every matrix took its K-quant
    assert set(written.values()) == {"Q4_K", "Q6_K"}
    assert written["output.weight"] == "Q6_K"
    r = gguf.GGUFReader(str(path))
    assert int(r.fields["general.file_type"].contents()) == 15
    assert mq.check(str(path)) == len(r.tensors)  # every tensor equals gguf's dequantize
    lm = load_model(str(path))
    floats = {k: (w.dequantize(torch.float32) if isinstance(w, Int4Weight) else w) for k, w in lm.params.items()}
    ids = torch.arange(3, 40)
    got = Transformer(lm.cfg, lm.params, max_seq_len=64).forward(ids, 0)
    want = Transformer(lm.cfg, floats, max_seq_len=64).forward(ids, 0)
    assert torch.isfinite(want).all() and torch.equal(got, want)


def test_eval_kernel_variant_is_what_the_int4_backends_load(tiny_q4km):
    from flint.evaluate import EvalError, parse_variants, variant_params

    lm = load_model(str(tiny_q4km[0]))
    (v,) = parse_variants("128:kernel")
    params, _, _ = variant_params(lm, v)
    want = quantize_params(lm.params, 128)
    assert params.keys() == want.keys()
    for k, w in want.items():
        got = params[k]
        if isinstance(w, Int4Weight):
            assert isinstance(got, Int4Weight) and got.group_size == w.group_size
            assert torch.equal(got.qweight, w.qweight) and torch.equal(got.scales, w.scales)
        else:
            assert torch.equal(got, w)
    (fh,) = parse_variants("32:kernel:float-head")
    params, _, _ = variant_params(lm, fh)
    assert params["lm_head"] is lm.params["lm_head"]
    assert all(isinstance(params[k], Int4Weight) and params[k].group_size == 32
               for k in params if k.rsplit(".", 1)[-1] in LINEAR_NAMES)
    with pytest.raises(EvalError, match="kernel"):
        parse_variants("32:kernel:searched-head")
