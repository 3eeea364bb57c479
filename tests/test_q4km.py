"""lab/studies/make_q4km.py: its Q4_K / Q6_K writer, and a tiny model written as Q4_K_M loading in flint.

* the Q4_K and Q6_K quantizers' bytes decode with gguf.quants.dequantize to exactly the values the
  quantizer meant (bit for bit, zero and outlier sub-blocks included), and those are within the
  format's own error of the input;
* the recipe: Q6_K for the (tied) head and for attn_v / ffn_down in llama.cpp's "more bits"
  layers, Q4_K elsewhere;
* a tiny model (K = 256 everywhere, so every matrix takes a K-quant) converted by the tool loads in
  flint with every Q4_K matrix int4 g32 (its codes kept) and every tensor equal to gguf's
  dequantize, and the reference backend's logits equal those of gguf's float weights exactly;
  `flint eval --quantize G:kernel` gives the int4 backends' params (quantize_params);
* the int4 backends on that model: the compiled backend (CPU, eager) matches the reference run on
  what the kernels read (the fp16 scale / min), and honours --group-size for the Q6_K matrices it
  quantizes while the Q4_K ones keep g32; the megakernel's repack (CPU) copies the kept codes
  and the fp16 (scale, min), and refuses layers of one matrix at different group sizes.

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
from flint.quant.int4 import ExactInt4Weight, Int4Weight, kernel_params, quantize_params

QT = gguf.GGMLQuantizationType
_spec = importlib.util.spec_from_file_location("make_q4km", Path(__file__).parents[1] / "lab" / "studies" / "make_q4km.py")
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
    q4k = [name for name, _, kind in table if kind == "Q4_K" and name != "token_embd.weight"]  # (the
    # embedding is a float lookup table; its Q4_K values stay exact there)
    kept = [k for k, w in lm.params.items() if isinstance(w, Int4Weight) and k != "lm_head"]
    assert len(kept) == len(q4k) > 0 and all(lm.params[k].group_size == 32 for k in kept)
    assert any(isinstance(lm.params[k], ExactInt4Weight) for k in kept)
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
            # the kept Q4_K codes evaluate as the kernels read them: the fp16 (scale, min)
            assert not isinstance(got, ExactInt4Weight) and torch.equal(got.mins, w.mins)
        else:
            assert torch.equal(got, w)
    assert any(isinstance(w, ExactInt4Weight) for w in want.values())
    (fh,) = parse_variants("32:kernel:float-head")
    params, _, _ = variant_params(lm, fh)
    assert params["lm_head"] is lm.params["lm_head"]
    assert all(isinstance(params[k], Int4Weight) and params[k].group_size == 32
               for k in params if k.rsplit(".", 1)[-1] in LINEAR_NAMES)
    with pytest.raises(EvalError, match="kernel"):
        parse_variants("32:kernel:searched-head")


def test_compiled_backend_runs_the_kept_codes(tiny_q4km):
    from flint.compiled import CompiledBackend

    lm = load_model(str(tiny_q4km[0]))
    ids = torch.randint(0, lm.cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(4))
    be = CompiledBackend(lm.cfg, lm.params, 32, device="cpu", int4=True, group_size=32)
    a = be.forward(ids, 0)
    b = Transformer(lm.cfg, quantize_params(kernel_params(lm.params), 32), max_seq_len=32).forward(ids, 0)
    assert float((a - b).abs().max()) <= 1e-4 * float(b.abs().max())
    # at --group-size 128 the Q6_K matrices it quantizes take 128, the kept Q4_K codes stay g32
    be = CompiledBackend(lm.cfg, lm.params, 32, device="cpu", int4=True, group_size=128)
    down = [(lm.params[f"layers.{i}.w_down"], L[5]) for i, L in enumerate(be.layers)]
    assert {w.group_size for w, _ in down if isinstance(w, Int4Weight)} == {32}
    assert {p[3] for w, p in down if isinstance(w, Int4Weight)} == {32}
    assert {p[3] for w, p in down if not isinstance(w, Int4Weight)} == {128}


def _decode_repacked(blob: torch.Tensor, d: dict, n: int) -> torch.Tensor:
    """megakernel.repack's blob for one layer -> the [n, K] values the kernel computes."""
    kseg, g = d["kseg"], d["G"]
    ng = kseg // g
    parts = []
    for s in range(d["nseg"]):
        seg = blob[s, :n]
        codes = torch.stack((seg[:, :kseg // 2] & 15, seg[:, :kseg // 2] >> 4), -1).flatten(-2).float()
        sm = seg[:, kseg // 2:kseg // 2 + 4 * ng].contiguous().view(torch.float16).view(n, ng, 2).float()
        parts.append((codes.view(n, ng, g) * sm[..., :1] + sm[..., 1:]).view(n, kseg))
    return torch.cat(parts, 1)


def test_megakernel_repack_takes_the_kept_codes(tiny_q4km):
    from flint.megakernel import repack

    lm = load_model(str(tiny_q4km[0]))
    said = []
    params = quantize_params(lm.params, 128, log=lambda *a, **k: said.append(a[0]))
    assert said and "at g32, not at the requested group size 128" in said[0]
    layers = range(lm.cfg.num_layers)
    for name in ("w_down", "wv", "wo"):
        ws = [params[f"layers.{i}.{name}"] for i in layers]
        assert {w.group_size for w in ws} == {32}  # Q4_K kept and Q6_K quantized layers share it
        blob, d = repack(ws, name, "cpu")
        for i, w in enumerate(ws):
            want = (w.kernel_view() if isinstance(w, ExactInt4Weight) else w).dequantize()
            assert torch.equal(_decode_repacked(blob[i], d, w.shape[0]), want), f"{name} layer {i}"
    # the kernels' values are the fp16 ones: off the file's exact values by less than a step / 64
    w = next(params[f"layers.{i}.w_down"] for i in layers if isinstance(params[f"layers.{i}.w_down"], ExactInt4Weight))
    err = (w.kernel_view().dequantize() - w.dequantize()).abs()
    assert 0 < float(err.max()) and bool((err <= w.scales.float().abs().repeat_interleave(32, 1) / 64 + 1e-9).all())
    # a matrix whose layers have different group sizes is refused, naming it
    from flint.quant.int4 import quantize_int4

    mixed = [params["layers.0.w_down"], quantize_int4(params["layers.1.w_down"].dequantize(), 128)]
    with pytest.raises(ValueError, match=r"w_down: layer 1 .*G128, expected .*G32"):
        repack(mixed, "w_down", "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)),
                    reason="needs a CUDA sm_90 (Hopper) GPU")
def test_megakernel_runs_the_kept_codes(tiny_q4km):
    """The megakernel on the tiny Q4_K_M model (kept Q4_K codes, Q6_K quantized at load) against the
    reference decoder on what the kernel reads (fp16 scale / min), within test_megakernel.py's bound."""
    from mk_check import assert_megakernel_matches

    lm = load_model(str(tiny_q4km[0]))
    params = quantize_params(lm.params, 128)
    assert any(isinstance(w, ExactInt4Weight) for w in params.values())
    assert_megakernel_matches(lm.cfg, params)
