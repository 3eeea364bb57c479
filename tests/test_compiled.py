"""The compiled / compiled-bf16 backends against the reference decoder, on the same int4 weights.

CPU (CI): the layer code eagerly (int4 through torch's *_for_cpu tinygemm ops), prefill, decode,
rollback, greedy_next, attention buckets; one real torch.compile run is marked slow. GPU (marked
gpu): tinygemm's format conversion, and the compiled + CUDA-graph step against the reference.
Synthetic models are covered here too. Run: ``pytest tests/test_compiled.py``.
"""
from __future__ import annotations

import pytest
import torch

from flint.backend import BackendError, make_backend
from flint.compiled import BUCKET, CompiledBackend, linear, tinygemm_weight
from flint.config import from_hf_dict
from flint.loading import LoadedModel
from flint.model import Transformer
from flint.quant.int4 import Int4Weight, quantize_int4, quantize_params
from flint.synthetic import synthetic_model, synthetic_params

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SMALL = dict(model_type="granite", vocab_size=320, hidden_size=128, intermediate_size=192,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5,
             rope_theta=1e4, attention_multiplier=0.15, embedding_multiplier=4.0, residual_multiplier=0.6,
             logits_scaling=2.0, tie_word_embeddings=True, max_position_embeddings=320)


def small_model(seed=0, int4=True, **over):
    cfg = from_hf_dict(dict(SMALL, **over))
    params = synthetic_params(cfg, seed, None, torch.float32)
    for k, w in params.items():  # larger weights than the synthetic default: peaked, comparable logits
        if w.dim() == 2:
            params[k] = w * 5
    if cfg.tie_word_embeddings:
        params["lm_head"] = params["embed"]
    if int4:
        params = quantize_params(params, 32)
    return cfg, params


def _assert_close(a, b, tol, what):
    err = float((a - b).abs().max())
    assert err <= tol, f"{what}: max |diff| {err} > {tol} (logit scale {float(b.abs().max()):.2f})"


@pytest.mark.parametrize("int4,tol", [(True, 2e-4), (False, 0.08)])
def test_matches_reference_cpu(int4, tol):
    cfg, params = small_model()
    ref = Transformer(cfg, params, 300)
    be = CompiledBackend(cfg, params, 300, device="cpu", int4=int4, group_size=32)
    assert be.name == ("compiled" if int4 else "compiled-bf16") and not be.compiled
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, cfg.vocab_size, (BUCKET - 3,), generator=g)
    a, ha = ref.forward(prompt, 0, return_hidden=True)
    b, hb = be.forward(prompt, 0, return_hidden=True)
    _assert_close(b, a, tol, "prefill logits")
    _assert_close(hb, ha, tol * 10, "prefill hidden")
    tok = int(a[-1].argmax())
    for pos in range(BUCKET - 3, BUCKET + 3):  # crosses an attention bucket boundary
        la = ref.forward(torch.tensor([tok]), pos)[-1]
        lb = be.forward(torch.tensor([tok]), pos)[-1]
        _assert_close(lb, la, tol, f"decode logits at {pos}")
        if int4:
            assert be.greedy_next(tok, pos) == int(la.argmax())
        tok = int(la.argmax())
    # rollback: overwrite positions 10.. with other tokens, as speculative decoding does
    other = torch.randint(0, cfg.vocab_size, (6,), generator=g)
    _assert_close(be.forward(other, 10), ref.forward(other, 10), tol, "rollback")


def test_vocabulary_not_a_multiple_of_8():
    """tinygemm needs N % 16 == 0 on the CPU: the head (vocab 323, tied) gets zero rows up to 336, their logits dropped."""
    cfg, params = small_model(vocab_size=323)
    ref = Transformer(cfg, params, 64)
    be = CompiledBackend(cfg, params, 64, device="cpu", int4=True, group_size=32)
    assert be.head[0] == "int4" and be.head[4] == 323  # (the real rows; the packed weight holds 336)
    prompt = torch.randint(0, cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(7))
    a, b = ref.forward(prompt, 0), be.forward(prompt, 0)
    assert b.shape == a.shape == (9, 323)
    _assert_close(b, a, 2e-4, "logits with a padded head")
    tok = int(a[-1].argmax())
    assert be.greedy_next(tok, 9) == int(ref.forward(torch.tensor([tok]), 9)[-1].argmax())


def test_prefill_longer_than_a_chunk():
    cfg, params = small_model()
    ref = Transformer(cfg, params, 300)
    be = CompiledBackend(cfg, params, 300, device="cpu", int4=True)
    be.max_chunk = 48  # prefill split into chunks inside forward
    toks = torch.randint(0, cfg.vocab_size, (130,), generator=torch.Generator().manual_seed(2))
    _assert_close(be.forward(toks, 0), ref.forward(toks, 0), 2e-4, "chunked prefill")


def test_mixed_group_sizes_and_float_weights():
    """q/k/v with different group sizes run as separate parts; float weights are quantized at the
    largest group size dividing K (K = 192 takes 64 when 128 is asked for)."""
    cfg, params = small_model(int4=False)
    ref_params = dict(params)
    ref_params["layers.0.wq"] = quantize_int4(params["layers.0.wq"], 32)
    ref_params["layers.0.wk"] = quantize_int4(params["layers.0.wk"], 64)
    be = CompiledBackend(cfg, ref_params, 64, device="cpu", int4=True, group_size=128)
    assert be.layers[0][1][0] == "cat" and be.layers[1][1][0] == "int4"
    assert be.layers[0][5][3] == 64  # w_down, K = 192
    want = dict(ref_params)
    for k in list(want):
        if not isinstance(want[k], Int4Weight) and want[k].dim() == 2 and k != "embed":
            want[k] = quantize_int4(want[k], 64 if want[k].shape[1] % 128 else 128)
    ref = Transformer(cfg, want, 64)
    toks = torch.randint(0, cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(3))
    _assert_close(be.forward(toks, 0), ref.forward(toks, 0), 2e-4, "mixed")


def test_greedy_run_matches_a_host_loop():
    """greedy_run (each argmax fed back on the device) gives the tokens of greedy_next step by step, writes
    the same cache, and refuses what greedy_next refuses."""
    cfg, params = small_model()
    be = CompiledBackend(cfg, params, 64, device="cpu")
    prompt = torch.randint(0, cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(5))
    tok = int(torch.argmax(be.forward(prompt, 0)[-1]))
    want, t = [], tok
    for i in range(6):
        t = be.greedy_next(t, 9 + i)
        want.append(t)
    assert be.greedy_run(tok, 9, 6) == want
    assert be.greedy_run(want[2], 12, 3) == want[3:]  # from the middle: the cache before 12 is the same
    with pytest.raises(ValueError, match="outside the vocabulary"):
        be.greedy_run(cfg.vocab_size, 9, 2)
    with pytest.raises(ValueError, match=r"positions 60\.\.64 exceed max_seq_len 64"):
        be.greedy_run(tok, 60, 5)
    with pytest.raises(ValueError, match="n >= 1"):
        be.greedy_run(tok, 9, 0)


def test_bad_input_is_a_clear_error():
    cfg, params = small_model()
    be = CompiledBackend(cfg, params, 64, device="cpu")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        be.forward(torch.tensor([cfg.vocab_size]), 0)
    with pytest.raises(ValueError, match="exceed max_seq_len 64"):
        be.forward(torch.tensor([1, 2]), 63)
    with pytest.raises(BackendError, match=r"tokens \[M\]"):
        be.forward(torch.tensor([[1, 2]]), 0)
    lm = LoadedModel(cfg, params, None, "test")
    with pytest.raises(BackendError, match="unknown backend 'fast'"):
        make_backend("fast", lm, 64, "cpu")
    with pytest.raises(BackendError, match="exceeds the model's context"):
        make_backend("compiled", lm, cfg.max_position_embeddings + 1, "cpu")


def test_make_backend_builds_every_torch_backend_on_cpu():
    cfg, params = small_model()
    lm = LoadedModel(cfg, params, None, "test")
    toks = torch.tensor([5, 6, 7])
    want = Transformer(cfg, params, 32).forward(toks, 0)
    for name, tol in (("reference", 1e-5), ("compiled", 2e-4), ("compiled-bf16", 0.08)):
        be = make_backend(name, lm, 32, "cpu", group_size=32)
        _assert_close(be.forward(toks, 0), want, tol, name)


def test_synthetic_models():
    lm = synthetic_model("smollm2-135m", seed=3, int4_group_size=128)
    assert lm.tokenizer is None and lm.cfg.num_layers == 30 and lm.cfg.name == "synthetic:smollm2-135m"
    wq, wd = lm.params["layers.0.wq"], lm.params["layers.0.w_down"]
    assert wq.group_size == 64 and wd.group_size == 128  # K = 576 takes 64; K = 1536 keeps 128
    head_rows = lm.params["lm_head"].rows(slice(0, 4)).dequantize(torch.bfloat16)
    assert torch.equal(lm.params["embed"][:4], head_rows)  # tied: the lookup holds the head's values
    w = wq.dequantize()
    assert float(w.abs().min()) >= 0 and 0.01 < float(w.std()) < 0.04 and float(w.abs().max()) > 0
    fl = synthetic_model("smollm2-135m", seed=0)
    assert fl.params["layers.0.wq"].dtype == torch.bfloat16 and fl.params["lm_head"] is fl.params["embed"]
    assert float(fl.params["layers.0.wq"].float().std()) == pytest.approx(0.02, rel=0.05)
    assert int((fl.params["norm"] == 0).sum()) == 0
    from flint.loading import LoadError, load_model

    with pytest.raises(LoadError, match="unknown synthetic model"):
        load_model("synthetic:nope")


def test_synthetic_from_config_path(tmp_path):
    import json

    p = tmp_path / "config.json"
    p.write_text(json.dumps(SMALL))
    lm = synthetic_model(str(p), seed=1)
    logits = Transformer(lm.cfg, lm.params, 16).forward(torch.tensor([1, 2, 3]), 0)
    assert torch.isfinite(logits).all() and float(logits.std()) > 0
    a, b = (synthetic_model(str(p), seed=7, int4_group_size=64) for _ in range(2))
    assert torch.equal(a.params["layers.1.w_up"].qweight, b.params["layers.1.w_up"].qweight)  # seeded
    c = synthetic_model(str(p), seed=8, int4_group_size=64)
    assert not torch.equal(a.params["layers.1.w_up"].qweight, c.params["layers.1.w_up"].qweight)


@pytest.mark.slow
def test_real_torch_compile_cpu():
    """One real inductor compile of the layer (CPU, tiny, ~30 s on 2 cores): same logits."""
    cfg, params = small_model(num_hidden_layers=1)
    ref = Transformer(cfg, params, 200)
    be = CompiledBackend(cfg, params, 200, device="cpu", compile=True)
    toks = torch.randint(0, cfg.vocab_size, (BUCKET,), generator=torch.Generator().manual_seed(4))
    _assert_close(be.forward(toks, 0), ref.forward(toks, 0), 2e-4, "prefill")
    for pos in (BUCKET, BUCKET + 1):  # two buckets, one compile (the attention length is dynamic)
        _assert_close(be.forward(toks[:1], pos), ref.forward(toks[:1], pos), 2e-4, f"compiled decode {pos}")


# ---------------------------------------------------------------- GPU

@pytest.mark.gpu
@cuda
def test_tinygemm_conversion_gpu():
    g = torch.Generator().manual_seed(5)
    for n, k, gs in ((256, 512, 128), (192, 576, 64), (64, 256, 32), (195, 256, 32)):  # (195: padded to 200)
        w = quantize_int4(torch.randn(n, k, generator=g) * 0.02, gs)
        tw = tinygemm_weight(w, torch.device("cuda"), torch.bfloat16)
        x = torch.randn(3, k, generator=g).to("cuda", torch.bfloat16)
        got = linear(x, tw).float()
        want = x.float() @ w.dequantize().cuda().T
        rel = float((got - want).abs().max() / want.abs().max())
        assert rel < 2e-2, (n, k, gs, rel)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("int4", [True, False])
def test_compiled_matches_reference_gpu(int4):
    cfg, params = small_model()
    ref = Transformer(cfg, params, 300, device="cuda", dtype=torch.float32)
    be = CompiledBackend(cfg, params, 300, device="cuda", int4=int4, group_size=32)
    assert be.compiled and be.cuda_graphs
    prompt = torch.randint(0, cfg.vocab_size, (BUCKET - 2,), generator=torch.Generator().manual_seed(6))
    a, b = ref.forward(prompt, 0), be.forward(prompt, 0)
    scale = float(a.abs().max())
    _assert_close(b, a, 0.05 * scale, "prefill")
    tok, agree = int(a[-1].argmax()), 0
    for pos in range(BUCKET - 2, BUCKET + 4):
        la = ref.forward(torch.tensor([tok]), pos)[-1]
        lb = be.forward(torch.tensor([tok]), pos)[-1]
        _assert_close(lb, la, 0.05 * scale, f"decode {pos}")
        nxt = be.greedy_next(tok, pos)
        agree += nxt == int(la.argmax())
        tok = int(la.argmax())
    assert agree >= 5
    assert len(be.graphs) == 2


def test_synthetic_bytes_and_store(tmp_path):
    """synthetic_bytes predicts what synthetic_params makes (int4 and float, tied or not); ``store`` parks every
    tensor there with the same values and keeps a tied float head the embedding itself."""
    import json

    from flint.quant.int4 import Int4Weight
    from flint.synthetic import synthetic_bytes, synthetic_config

    def nbytes(params):
        seen, total = set(), 0
        for t in params.values():
            if id(t) not in seen:
                seen.add(id(t))
                total += t.nbytes if isinstance(t, Int4Weight) else t.numel() * t.element_size()
        return total

    for tie in (True, False):
        p = tmp_path / f"config_{tie}.json"
        p.write_text(json.dumps(dict(SMALL, tie_word_embeddings=tie)))
        cfg = synthetic_config(str(p))
        for g in (None, 32):
            assert nbytes(synthetic_params(cfg, 0, g)) == synthetic_bytes(cfg, g), (tie, g)
            a, b = synthetic_params(cfg, 5, g), synthetic_params(cfg, 5, g, store="meta")
            assert set(a) == set(b)
            for n, t in b.items():
                ts = (t.qweight, t.scales, t.mins) if isinstance(t, Int4Weight) else (t,)
                assert all(x.device.type == "meta" for x in ts), n
            assert (b["lm_head"] is b["embed"]) == (tie and g is None)
    big = synthetic_config("smollm2-135m")
    assert synthetic_bytes(big, 128) < synthetic_bytes(big, None)
