"""The KV cache formats (flint.model's docstring: fp16, and int8 / fp8 with an fp16 scale per row):
the fp16 cache is the decoder's float cache as before, the 8-bit round trips stay inside their
per-row bounds, the int8 decoder stays close to fp16 on a tiny random model, backends without an
8-bit cache refuse it, and --kv-cache on the CLI (generate, serve, eval, bench).

Run: ``pytest tests/test_kv_cache.py`` (~15 s on a CPU).
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from flint.backend import BackendError, check_kv_cache, make_backend
from flint.cli import build_parser, main
from flint.model import KV_QMAX, Transformer, kv_dequantize, kv_quantize

FP32_EPS = 2.0 ** -24


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """main() sets torch's thread count for the process; give the other tests theirs back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def rows() -> torch.Tensor:
    """[rows, 64] K/V-like rows: unit-scale, large, tiny (fp16-subnormal scales), one outlier per row,
    and an all-zero row."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 32, 64, generator=g)
    x[1] *= 300.0
    x[2] *= 1e-4
    x[3, :, 5] *= 50.0  # one large channel, as K often has
    x[4] = torch.rand(32, 64, generator=g) * 2 - 1  # uniform: most values near the row max
    x[5, 0] = 0.0
    return x.reshape(-1, 64)


def _decoders_logits(lm, toks, formats, prefill=48):
    """Logits of a prefill of ``prefill`` tokens then M = 1 steps, per cache format."""
    out = {}
    for f in formats:
        m = Transformer(lm.cfg, lm.params, lm.cfg.max_position_embeddings, kv_cache=f)
        steps = [m.forward(toks[:prefill], 0)] + [m.forward(toks[i:i + 1], i) for i in range(prefill, len(toks))]
        out[f] = (torch.cat(steps), m)
    return out


@pytest.fixture(scope="module")
def toks(tiny_llama):
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, tiny_llama.cfg.vocab_size, (64,), generator=g)


# ------------------------------------------------------------------ fp16: the cache as it was

def test_fp16_is_the_float_cache_and_the_default(tiny_llama, toks):
    """fp16 holds K/V at the decoder's dtype with no scales, the layout the code had before the
    option (that commit's logits were checked bit-equal on SmolLM2: bench/results/kv8_quality_2026-12-02.md),
    and the default decoder is it: same logits bit for bit, rollback (a rewrite at an earlier position) included."""
    cfg = tiny_llama.cfg
    for dtype in (torch.float32, torch.bfloat16):
        m = Transformer(cfg, tiny_llama.params, 80, dtype=dtype, kv_cache="fp16")
        assert m.k_cache.dtype == m.v_cache.dtype == dtype
        assert m.k_cache.shape == (cfg.num_layers, 1, cfg.num_kv_heads, 80, cfg.head_dim)
        assert not hasattr(m, "k_scale")
    a, b = Transformer(cfg, tiny_llama.params, 80), Transformer(cfg, tiny_llama.params, 80, kv_cache="fp16")
    for m in (a, b):
        m.out = [m.forward(toks[:40], 0), m.forward(toks[40:41], 40), m.forward(toks[30:35], 30),
                 m.forward(toks[35:36], 35)]
    assert all(torch.equal(x, y) for x, y in zip(a.out, b.out))
    assert b.kv_bytes(100) == 2 * cfg.num_layers * cfg.num_kv_heads * 100 * cfg.head_dim * 4


def test_an_unknown_format_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="--kv-cache 'int4': choose one of fp16, int8, fp8"):
        Transformer(tiny_llama.cfg, tiny_llama.params, 16, kv_cache="int4")
    with pytest.raises(BackendError, match="--kv-cache 'bf16'"):
        check_kv_cache("reference", "bf16")


# ------------------------------------------------------------------ the 8-bit round trips

def test_int8_round_trip_is_within_half_a_step_of_each_rows_scale():
    x = rows()
    q, s = kv_quantize(x, "int8")
    assert q.dtype == torch.int8 and s.dtype == torch.float16 and s.shape == x.shape[:-1]
    sf = s.float()
    amax = x.abs().amax(-1)
    # the scale is max|x| / 127 rounded up to fp16: never below it (no code past 127, nothing clipped)
    assert (sf * 127 >= amax).all()
    normal = amax / 127 >= torch.finfo(torch.float16).tiny  # fp16-normal scales: at most one ulp (2^-10) up
    assert (sf[normal] <= amax[normal] / 127 * (1 + 2.0 ** -10)).all()
    assert q.abs().max() <= 127 and (q != -128).all()
    err = (kv_dequantize(q, s, torch.float32) - x).abs()
    bound = sf[:, None] / 2 + 4 * FP32_EPS * (x.abs() + sf[:, None])  # half a step, plus fp32's divide / multiply
    assert (err <= bound).all(), float((err - bound).max())
    assert (err[amax == 0] == 0).all() and (sf[amax == 0] == 0).all()


def test_fp8_round_trip_is_within_e4m3s_rounding_of_each_value():
    x = rows()
    q, s = kv_quantize(x, "fp8")
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float16
    sf = s.float()
    assert (sf * KV_QMAX["fp8"] >= x.abs().amax(-1)).all()
    y = q.float()
    assert torch.isfinite(y).all() and y.abs().max() <= 448
    err = (kv_dequantize(q, s, torch.float32) - x).abs()
    # e4m3: 3 mantissa bits, so half an ulp is <= 2^-4 of |x / scale| for normals (|y| >= 2^-6);
    # below that the subnormal step is 2^-9, half of it 2^-10, in units of the scale
    bound = torch.maximum(x.abs() * 2.0 ** -4, sf[:, None] * 2.0 ** -10) + 4 * FP32_EPS * (x.abs() + sf[:, None])
    assert (err <= bound).all(), float((err - bound).max())


def _e4m3_rne(y: np.ndarray) -> np.ndarray:
    """fp32 values (|y| <= 448) to the nearest e4m3fn value, ties to the even code: from the table of
    the format's 127 non-negative finite values, not through torch's cast."""
    codes = np.arange(127, dtype=np.int64)  # 0x00..0x7e; 0x7f is NaN
    e, m = codes >> 3, codes & 7
    table = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7)).astype(np.float32)
    a = np.abs(y)
    hi = np.clip(np.searchsorted(table, a), 0, 126)  # first value >= |y|
    lo = np.clip(hi - 1, 0, 126)
    d_lo, d_hi = a - table[lo], table[hi] - a
    pick = np.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)
    return np.sign(y) * table[pick]


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_quantizer_is_the_documented_arithmetic_bit_for_bit(fmt):
    """kv_quantize's docstring steps, written again in numpy (fp32 true divisions, fp16 nearest-even then
    one ulp up when below, round-half-to-even or e4m3 nearest-even, clamp), give the same scales and
    codes bit for bit: the recipe a kernel follows to match the reference."""
    x = rows()
    x[7, :4] = torch.tensor([0.5, 1.5, 2.5, -126.5]) * (x[7].abs().max() / 127)  # near-ties of int8's rounding
    # rows whose max / qmax is exactly an fp16 value: kept as is by a true division, often bumped up by a
    # multiply by the reciprocal (1 / qmax is inexact; for 448, 42 of these 64), so they tell the two apart
    v = torch.linspace(2.0 ** -10, 60.0, 64).to(torch.float16).float()
    edge = (torch.rand(64, 64, generator=torch.Generator().manual_seed(1)) * 2 - 1) * (v * KV_QMAX[fmt])[:, None]
    edge[:, 0] = v * KV_QMAX[fmt]
    x = torch.cat((x, edge))
    q, s = kv_quantize(x, fmt)
    assert torch.equal(s[-64:].float(), v)
    xn = x.numpy().astype(np.float32)
    qmax = np.float32(KV_QMAX[fmt])
    sn = (np.abs(xn).max(-1) / qmax).astype(np.float32)
    h = sn.astype(np.float16)
    up = h.astype(np.float32) < sn
    h[up] = (h[up].view(np.uint16) + 1).view(np.float16)
    hf = h.astype(np.float32)
    y = (xn / np.where(hf > 0, hf, np.float32(1))[:, None]).astype(np.float32)
    assert np.array_equal(s.numpy().view(np.uint16), h.view(np.uint16))
    if fmt == "int8":
        want = np.clip(np.rint(y), -127, 127).astype(np.int8)
        assert np.array_equal(q.numpy(), want)
    else:
        want = _e4m3_rne(np.clip(y, -qmax, qmax))
        assert np.array_equal(q.float().numpy(), want)
    deq = kv_dequantize(q, s, torch.float32).numpy()
    assert np.array_equal(deq, (q.float().numpy() * hf[:, None]).astype(np.float32))


# ------------------------------------------------------------------ the decoder with an 8-bit cache

def test_int8_decoder_stays_close_to_fp16(tiny_llama, toks):
    """Bound: KL(P_fp16 || P_int8) <= 1e-3 nats and |logit change| <= 0.25 at every position, and the
    same argmax wherever fp16's top two logits differ by more than 0.2. Why: each K/V value moves by
    at most 1/254 of its row's max (the test above); on this two-layer random model that measured
    KL <= 5e-4 and |logit change| <= 0.1 at logits of std 1.2, every argmax kept; the bounds leave
    2x room for other BLAS builds, while a cache that read a wrong row or scale gives KL ~1. The first layer's K/V (inputs equal to fp16's) are checked
    against the per-row bound exactly; int8 (a step of 2^-8 of the row max) is also closer than fp8
    (2^-4 of each value), as the two formats' bounds say."""
    out = _decoders_logits(tiny_llama, toks, ("fp16", "int8", "fp8"))
    ref, fp16 = out["fp16"]
    lp = ref.log_softmax(-1)

    def kl(x):
        return (lp.exp() * (lp - x.log_softmax(-1))).sum(-1)

    kl_int8, kl_fp8 = kl(out["int8"][0]), kl(out["fp8"][0])
    assert kl_int8.max() <= 1e-3, float(kl_int8.max())
    top2 = ref.topk(2, -1).values
    assert (out["int8"][0] - ref).abs().max() <= 0.25
    clear = top2[:, 0] - top2[:, 1] > 0.2
    assert clear.sum() >= len(toks) // 3  # the argmax check covers a good part of the positions
    assert torch.equal(out["int8"][0].argmax(-1)[clear], ref.argmax(-1)[clear])
    assert kl_int8.mean() < kl_fp8.mean()
    m = out["int8"][1]
    n = len(toks)
    for vals, scales, exact in ((m.k_cache, m.k_scale, fp16.k_cache), (m.v_cache, m.v_scale, fp16.v_cache)):
        deq = kv_dequantize(vals[0, :, :, :n], scales[0, :, :, :n], torch.float32)
        x = exact[0, :, :, :n]
        sf = scales[0, :, :, :n].float()[..., None]
        assert ((deq - x).abs() <= sf / 2 + 4 * FP32_EPS * (x.abs() + sf)).all()


def test_int8_greedy_decode_follows_fp16_up_to_a_near_tie(tiny_llama, toks):
    """Free-running greedy decoding, the int8 cache through the backend's greedy_next: its tokens equal
    fp16's, or first differ at a step where fp16's top two logits are within 0.5 (twice the 0.25 logit
    bound of the test above: a smaller change cannot swap them). Measured: the first difference at step
    42 of 48 (index 41), where fp16's top two logits are 0.035 apart."""
    ref = make_backend("reference", tiny_llama, 96, device="cpu")
    q8 = make_backend("reference", tiny_llama, 96, device="cpu", kv_cache="int8")
    assert q8.k_cache.dtype == torch.int8 and ref.k_cache.dtype == torch.float32
    n = 48
    for m in (ref, q8):
        m.forward(toks[:15], 0)
    tok_ref, margin, tok = [], [], int(toks[15])
    for pos in range(15, 15 + n):
        logits = ref.forward(torch.tensor([tok]), pos)[-1]
        top2 = logits.topk(2).values
        tok = int(logits.argmax())
        tok_ref.append(tok)
        margin.append(float(top2[0] - top2[1]))
    tok_q8, tok = [], int(toks[15])
    for pos in range(15, 15 + n):
        tok = q8.greedy_next(tok, pos)
        tok_q8.append(tok)
    d = next((i for i, (x, y) in enumerate(zip(tok_ref, tok_q8)) if x != y), n)
    assert d == n or margin[d] <= 0.5, (d, margin[d])


def test_8bit_cache_bytes_and_bf16_decoder(tiny_llama, toks):
    cfg = tiny_llama.cfg
    m = Transformer(cfg, tiny_llama.params, 64, dtype=torch.bfloat16, kv_cache="int8")
    assert m.k_cache.dtype == torch.int8 and m.k_scale.shape == (cfg.num_layers, 1, cfg.num_kv_heads, 64)
    assert m.kv_bytes(10) == 2 * cfg.num_layers * cfg.num_kv_heads * 10 * (cfg.head_dim + 2)
    assert m.forward(toks[:8], 0).isfinite().all()


# ------------------------------------------------------------------ refusals

@pytest.mark.parametrize("name, fmt", [("compiled", "int8"), ("compiled", "fp8"), ("compiled-bf16", "int8"),
                                       ("compiled-bf16", "fp8"), ("megakernel", "fp8")])
def test_backends_without_an_8bit_cache_refuse_it_before_building(name, fmt, tiny_llama, monkeypatch):
    import flint.compiled

    def built(*a, **k):
        raise AssertionError("the backend was built")
    monkeypatch.setattr(flint.compiled, "CompiledBackend", built)
    with pytest.raises(BackendError, match=f"--kv-cache {fmt}: backend '{name}' has no {fmt} KV cache"):
        make_backend(name, tiny_llama, 32, device="cpu", kv_cache=fmt)


# ------------------------------------------------------------------ the CLI

@pytest.fixture
def no_model_load(monkeypatch):
    import flint.loading

    build_parser()  # the subcommand modules import load_model first: patch the module's name afterwards

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before --kv-cache was checked")
    monkeypatch.setattr(flint.loading, "load_model", refuse)


def test_every_backend_building_command_takes_the_option():
    ap = build_parser()
    for argv in (["generate", "--prompt", "x"], ["chat"], ["serve"], ["bench"]):
        assert ap.parse_args(argv).kv_cache == "fp16", argv
        assert ap.parse_args([*argv, "--kv-cache", "int8"]).kv_cache == "int8", argv
    assert ap.parse_args(["eval", "--kv-cache", "int8,fp8"]).kv_cache == "int8,fp8"


@pytest.mark.parametrize("argv, needle", [
    (["generate", "--prompt", "x", "--kv-cache", "int4"], "argument --kv-cache: invalid choice: 'int4'"),
    (["generate", "--prompt", "x", "--backend", "compiled", "--kv-cache", "int8"],
     "flint generate: error: --kv-cache int8: backend 'compiled' has no int8 KV cache"),
    (["serve", "--backend", "megakernel", "--kv-cache", "fp8"],
     "flint serve: error: --kv-cache fp8: backend 'megakernel' has no fp8 KV cache"),
    (["chat", "--backend", "compiled-bf16", "--kv-cache", "int8"], "backend 'compiled-bf16' has no int8 KV cache"),
])
def test_cli_refuses_before_the_model_loads(argv, needle, no_model_load, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    (["eval", "--kv-cache", "int8,int9"], "--kv-cache item 'int9': choose from fp16, int8, fp8"),
    (["eval", "--backend", "megakernel", "--kv-cache", "int8,fp8"], "backend 'megakernel' has no fp8 KV cache"),
    (["bench", "--backend", "reference,compiled", "--kv-cache", "int8", "--device", "cpu"],
     "backend 'compiled' has no int8 KV cache"),
])
def test_eval_and_bench_refuse_before_the_model_loads(argv, needle, no_model_load, capsys, monkeypatch):
    import flint.bench

    monkeypatch.setattr(flint.bench, "read_bandwidth_GBps", lambda *a, **k: 1.0)
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_generate_runs_with_an_int8_cache(tiny_llama_dir, capsys):
    argv = ["generate", "--model", str(tiny_llama_dir), "--backend", "reference", "--device", "cpu",
            "--max-new-tokens", "4", "--prompt", "hi", "--kv-cache", "int8"]
    assert main(argv) == 0
    assert capsys.readouterr().out.strip()


def test_eval_rows_for_the_8bit_caches(tiny_llama_dir, tmp_path):
    from flint.evaluate import run_eval

    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 3)
    rows = run_eval(str(tiny_llama_dir), str(text), window=32, stride=16, max_tokens=64, kv_caches="fp16,int8,fp8",
                    log=lambda *a, **k: None)
    assert [r.kv_cache for r in rows] == ["fp16", "int8", "fp8"]
    assert rows[1].label.endswith("int8 KV cache") and rows[1].tokens == rows[0].tokens == 63
    assert 0 <= rows[1].kl_mean < rows[2].kl_mean  # int8's step is finer than e4m3's


def test_bench_counts_the_8bit_cache_bytes(tmp_path):
    from flint.bench import run_bench
    from flint.synthetic import synthetic_config

    cfgp = tmp_path / "config.json"
    cfgp.write_text(json.dumps(dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=64)))
    spec = f"synthetic:{cfgp}"
    docs = {f: run_bench([spec], ["reference"], [8, 24], n_tokens=2, repeats=1, device="cpu", bw_bytes=8 << 20,
                         log=lambda *a, **k: None, kv_cache=f) for f in ("fp16", "int8")}
    cfg = synthetic_config(str(cfgp))
    per_pos = {"fp16": 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4,  # the reference's fp32 cache
               "int8": 2 * cfg.num_layers * cfg.num_kv_heads * (cfg.head_dim + 2)}
    for f, doc in docs.items():
        by = {r["ctx"]: r["bytes_per_token"] for r in doc["results"]}
        assert by[24] - by[8] == 16 * per_pos[f], f
        assert all(r.get("kv_cache", "fp16") == f for r in doc["results"])
    assert docs["fp16"]["results"][0]["bytes_per_token"] - docs["int8"]["results"][0]["bytes_per_token"] \
        == 8 * (per_pos["fp16"] - per_pos["int8"])


def test_eval_at_several_windows_in_one_call(tiny_llama_dir, tmp_path, capsys):
    """--window 24,32 gives each window's rows as a run at that window alone would, each row naming its
    window, stride and the K/V bytes its cache format stores per position; the JSON holds them all."""
    from flint.evaluate import EvalError, parse_windows, run_eval
    from flint.loading import load_model
    from flint.model import kv_format_bytes

    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 3)
    quiet = dict(max_tokens=64, kv_caches="int8", log=lambda *a, **k: None)
    rows = run_eval(str(tiny_llama_dir), str(text), window="24,32", **quiet)
    assert [(r.window, r.stride, r.kv_cache) for r in rows] == [(24, 12, "fp16"), (24, 12, "int8"),
                                                               (32, 16, "fp16"), (32, 16, "int8")]
    alone = run_eval(str(tiny_llama_dir), str(text), window=32, **quiet)
    assert [(r.ppl, r.kl_mean) for r in rows[2:]] == [(r.ppl, r.kl_mean) for r in alone]
    cfg = load_model(str(tiny_llama_dir)).cfg
    per_row = {"fp16": 2 * cfg.head_dim, "int8": cfg.head_dim + 2}
    for r in rows:
        assert r.kv_bytes_per_pos == kv_format_bytes(cfg, r.kv_cache) \
            == 2 * cfg.num_layers * cfg.num_kv_heads * per_row[r.kv_cache]
    out = tmp_path / "e.json"
    assert main(["eval", "--model", str(tiny_llama_dir), "--file", str(text), "--max-tokens", "64",
                 "--window", "24,32", "--kv-cache", "int8", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "window 24, stride 12" in printed and "window 32, stride 16" in printed
    doc = json.loads(out.read_text())
    assert [(d["window"], d["kv_cache"], d["kv_bytes_per_pos"]) for d in doc] == \
        [(r.window, r.kv_cache, r.kv_bytes_per_pos) for r in rows]
    assert [d["ppl"] for d in doc] == [r.ppl for r in rows]
    for bad, needle in (("24,x", "'x' is not a whole number"), ("24,24", "a repeated size"), ("", "an empty list")):
        with pytest.raises(EvalError, match=needle):
            parse_windows(bad)
    with pytest.raises(EvalError, match="--window 128 exceeds the model's context of 96"):
        run_eval(str(tiny_llama_dir), str(text), window="32,128", **quiet)
    with pytest.raises(ValueError, match="--kv-cache 'int4'"):
        kv_format_bytes(cfg, "int4")
