"""int4 layout and `flint quantize`: pack/unpack, the RTN error bound, exact GGUF block conversion,
checkpoint round trips (HF and GGUF sources), and clear errors for group sizes that do not fit.

Run: ``pytest tests/test_quant.py`` (~15 s; the GGUF tokenizer test reads the embedded SmolLM2).
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from flint.quant.int4 import (Int4Weight, concat_rows, fit_group_size, from_q4_0_blocks, from_q4_1_blocks,
                              pack_int4, quantize_int4, requantize_params, unpack_int4)


def test_pack_unpack_exact_and_nibble_order():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (7, 64), dtype=torch.uint8, generator=g)
    packed = pack_int4(codes)
    assert packed.shape == (7, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), codes)
    # the documented order: byte j holds k = 2j in its low nibble, k = 2j + 1 in its high nibble
    assert int(packed[3, 5]) == int(codes[3, 10]) | (int(codes[3, 11]) << 4)
    every = torch.arange(256, dtype=torch.uint8).view(1, 256)
    assert torch.equal(pack_int4(unpack_int4(every)), every)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_quantize_error_within_half_a_step(group_size):
    g = torch.Generator().manual_seed(group_size)
    w = torch.randn(48, 256, generator=g) * 0.05
    w[0, :group_size] = 0.3  # a constant group: scale 0, must round-trip exactly
    q = quantize_int4(w, group_size)
    assert q.qweight.shape == (48, 128) and q.scales.shape == (48, 256 // group_size)
    assert q.scales.dtype == torch.float16 and q.mins.dtype == torch.float16
    err = (q.dequantize() - w).abs().view(48, -1, group_size)
    bound = q.scales.float().unsqueeze(-1) / 2
    # codes are fitted to the fp16-rounded min; its rounding (<= 2^-11 relative) is the slack
    slack = q.mins.float().abs().unsqueeze(-1) * 2 ** -11 + 1e-7
    assert bool((err <= bound + slack).all()), float((err - bound - slack).max())
    assert float(err[0, 0].max()) <= 0.3 * 2 ** -11


def test_group_size_not_dividing_k_is_a_clear_error():
    with pytest.raises(ValueError, match=r"layers\.0\.wq: group_size 128 does not divide in_features K=576"):
        quantize_int4(torch.randn(64, 576), 128, name="layers.0.wq")
    assert fit_group_size(576, 128) == 64 and fit_group_size(1536, 128) == 128
    with pytest.raises(ValueError, match="K=48"):
        fit_group_size(48, 128)


def _fp16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(*x.shape, 2)


def _random_q4_1_blocks(n, k, rng):
    d = rng.uniform(1e-3, 5e-2, (n, k // 32))
    m = rng.uniform(-0.5, 0.1, (n, k // 32))
    qs = rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8)
    raw = np.concatenate([_fp16_bytes(d), _fp16_bytes(m), qs], axis=-1)
    return raw.reshape(n, -1), d.astype(np.float16), m.astype(np.float16), qs


def test_q4_1_conversion_is_exact():
    rng = np.random.default_rng(1)
    n, k = 8, 128
    raw, d, m, qs = _random_q4_1_blocks(n, k, rng)
    # a straightforward reading of the block format: y[j] = (qs[j] & 15) d + m, y[j+16] = (qs[j] >> 4) d + m
    want = np.zeros((n, k), np.float32)
    for r in range(n):
        for b in range(k // 32):
            for j in range(16):
                want[r, b * 32 + j] = (qs[r, b, j] & 15) * np.float32(d[r, b]) + np.float32(m[r, b])
                want[r, b * 32 + j + 16] = (qs[r, b, j] >> 4) * np.float32(d[r, b]) + np.float32(m[r, b])
    q = from_q4_1_blocks(raw, n, k)
    assert q.group_size == 32
    assert torch.equal(q.dequantize(), torch.from_numpy(want))
    gguf = pytest.importorskip("gguf")
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1)
    assert np.array_equal(q.dequantize().numpy(), ref.reshape(n, k))


def test_q4_0_conversion_is_exact():
    rng = np.random.default_rng(2)
    n, k = 6, 96
    d = rng.uniform(-4e-2, 4e-2, (n, k // 32))
    qs = rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8)
    raw = np.concatenate([_fp16_bytes(d), qs], axis=-1).reshape(n, -1)
    d16 = d.astype(np.float16).astype(np.float32)
    lo = ((qs & 15).astype(np.float32) - 8) * d16[..., None]
    hi = ((qs >> 4).astype(np.float32) - 8) * d16[..., None]
    want = np.concatenate([lo, hi], axis=-1).reshape(n, k)
    q = from_q4_0_blocks(raw, n, k)
    assert torch.equal(q.dequantize(), torch.from_numpy(want))


def test_concat_rows_and_requantize():
    g = torch.Generator().manual_seed(3)
    a, b = quantize_int4(torch.randn(8, 64, generator=g), 32), quantize_int4(torch.randn(16, 64, generator=g), 32)
    c = concat_rows([a, b])
    assert torch.equal(c.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    with pytest.raises(ValueError, match="group sizes"):
        concat_rows([a, quantize_int4(torch.randn(8, 64, generator=g), 64)])
    # re-fitting an int4 weight at its own group size lands on the same grid (all codes reused)
    again = requantize_params({"layers.0.wq": a, "lm_head": a, "embed": a.dequantize()}, 32)
    assert torch.allclose(again["layers.0.wq"].dequantize(), a.dequantize(), atol=1e-3)
    assert again["embed"] is not None and isinstance(again["lm_head"], Int4Weight)


# ---------------------------------------------------------------- `flint quantize` checkpoints

def test_quantize_checkpoint_round_trip_hf(tiny_llama_dir, tmp_path):
    from flint.loading import load_model
    from flint.quant.quantize import quantize_checkpoint

    src = load_model(str(tiny_llama_dir))
    out = quantize_checkpoint(str(tiny_llama_dir), tmp_path / "q", group_size=32, log=lambda *a, **k: None)
    cfg_json = json.loads((out / "config.json").read_text())
    assert cfg_json["quantization_config"] == {"quant_method": "flint-int4-v1", "group_size": 32}
    assert (out / "generation_config.json").exists() and (out / "tokenizer.json").exists()
    lm = load_model(str(out))
    assert lm.cfg.to_json() | {"name": ""} == src.cfg.to_json() | {"name": ""}
    for name, w in src.params.items():
        got = lm.params[name]
        if name == "embed":  # an fp32 embedding is stored in fp16 (--embed auto)
            assert got.dtype == torch.float16 and torch.equal(got, w.half()), name
        elif w.dim() == 1:
            assert torch.equal(got, w), name  # the norms are stored as they are
        else:
            assert isinstance(got, Int4Weight) and got.group_size == 32, name
            want = quantize_int4(w, 32)
            assert torch.equal(got.qweight, want.qweight) and torch.equal(got.scales, want.scales), name
    assert lm.tokenizer.encode("héllo") == src.tokenizer.encode("héllo")
    msgs = [{"role": "user", "content": "hi"}]
    assert lm.tokenizer.apply_chat_template(msgs) == src.tokenizer.apply_chat_template(msgs)


def test_quantize_group_size_must_divide_k(tiny_llama_dir, tmp_path):
    from flint.quant.quantize import QuantizeError, quantize_checkpoint

    # w_down has K = 96: 64 does not divide it
    with pytest.raises(QuantizeError, match=r"w_down: group_size 64 does not divide in_features K=96"):
        quantize_checkpoint(str(tiny_llama_dir), tmp_path / "q", group_size=64, log=lambda *a, **k: None)


def _quantize_cli(*argv: str) -> int:
    from flint.cli import main

    return main(["quantize", *argv, "--group-size", "32"])


def test_quantize_checkpoint_refuses_a_non_empty_out_before_any_work(tiny_llama_dir, tmp_path,
                                                                       monkeypatch, capsys):
    import flint.quant.quantize

    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before OUT was checked")
    monkeypatch.setattr(flint.quant.quantize, "load_model", refuse)
    assert _quantize_cli(str(tiny_llama_dir), str(out)) == 2
    err = capsys.readouterr().err
    assert f"flint: error: {out}: is not empty" in err and "--force" in err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert _quantize_cli(str(tiny_llama_dir), str(out / "notes.txt" / "q")) == 2
    assert f"{out / 'notes.txt'} is not a directory" in capsys.readouterr().err
    # the source itself, or a folder holding it, is refused even with --force
    assert _quantize_cli(str(tiny_llama_dir), str(tiny_llama_dir), "--force") == 2
    assert "holds the source model" in capsys.readouterr().err
    monkeypatch.chdir(out)  # and so is the folder a shell stands in
    assert _quantize_cli(str(tiny_llama_dir), ".", "--force") == 2
    assert "is or holds the current directory" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_quantize_checkpoint_force_replaces_a_stale_sharded_checkpoint(tiny_llama_dir, tmp_path):
    """--force over an old sharded checkpoint: its index must not survive to shadow the new file
    (the loader reads model.safetensors.index.json first and then misses "embed")."""
    from flint.loading import load_model

    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}))
    (out / "model-00001-of-00002.safetensors").write_bytes(b"old")
    assert _quantize_cli(str(tiny_llama_dir), str(out), "--force") == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"])
    assert load_model(str(out)).cfg.num_layers == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary folder left


@pytest.mark.parametrize("existing", [False, True])
def test_quantize_checkpoint_interrupted_leaves_nothing_half_written(tiny_llama_dir, tmp_path, monkeypatch,
                                                                     existing):
    """Ctrl-C after the weights and config are written but before the tokenizer: OUT is absent
    (or, with --force over an old checkpoint, that old checkpoint unchanged), and no partial folder
    is left next to it."""
    import flint.quant.quantize
    from conftest import dir_snapshot

    out = tmp_path / "out"
    if existing:
        assert _quantize_cli(str(tiny_llama_dir), str(out)) == 0
    before = dir_snapshot(out) if existing else None

    def interrupt(lm, where):
        assert (where / "model.safetensors").exists()
        raise KeyboardInterrupt
    monkeypatch.setattr(flint.quant.quantize, "_write_tokenizer", interrupt)
    assert _quantize_cli(str(tiny_llama_dir), str(out), *(["--force"] if existing else [])) == 130
    assert sorted(p.name for p in tmp_path.iterdir()) == (["out"] if existing else [])
    if existing:
        assert dir_snapshot(out) == before


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from flint.loading import LoadError, embedded_gguf_path, read_gguf
    from flint.tokenizer import Tokenizer

    try:
        path = embedded_gguf_path()
    except LoadError as e:
        pytest.skip(str(e))
    fields, _ = read_gguf(path)
    return Tokenizer.from_gguf_fields(fields, str(path)), str(path)


def test_quantize_checkpoint_from_gguf_writes_config_and_tokenizer(smollm2_tokenizer, tmp_path):
    """A GGUF source: config.json is built from ModelConfig and the GGUF tokenizer is saved; both
    load back (same ids, same chat prompt). Weights: a tiny random model with SmolLM2's vocab and
    a Q4_1-like int4 part at G = 32, which must be kept bit for bit."""
    from flint.config import from_hf_dict
    from flint.loading import LoadedModel, load_model
    from flint.quant.quantize import default_group_size, quantize_for_checkpoint, save_checkpoint
    from flint.synthetic import synthetic_params

    tok, path = smollm2_tokenizer
    cfg = from_hf_dict(dict(model_type="granite", vocab_size=49152, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                            rms_norm_eps=1e-5, rope_theta=1e5, attention_multiplier=0.1, embedding_multiplier=2.0,
                            residual_multiplier=0.5, logits_scaling=4.0, tie_word_embeddings=True,
                            max_position_embeddings=256, bos_token_id=1, eos_token_id=[2, 7]))
    params = synthetic_params(cfg, 0, None, torch.float32)
    params["layers.0.wq"] = quantize_int4(params["layers.0.wq"], 32)  # as a GGUF Q4_1 tensor would be
    lm = LoadedModel(cfg, params, tok, path)
    g = default_group_size(params)
    assert g == 32
    q = quantize_for_checkpoint(params, g, log=lambda *a, **k: None)
    assert q["layers.0.wq"] is params["layers.0.wq"]  # no second rounding
    out = save_checkpoint(lm, q, g, tmp_path / "q")
    back = load_model(str(out))
    assert back.cfg.to_json() | {"name": ""} == cfg.to_json() | {"name": ""}
    assert torch.equal(back.params["layers.0.wq"].qweight, params["layers.0.wq"].qweight)
    assert torch.equal(back.params["embed"], params["embed"]) and back.params["embed"].dtype == torch.float32
    # (save_checkpoint stores what it is given; quantize_checkpoint's --embed choice: test_quantize_head.py)
    text = "The quick brown fox, 1234 <|im_start|> naïve 日本"
    assert back.tokenizer.encode(text) == tok.encode(text)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 42"}]
    assert back.tokenizer.apply_chat_template(msgs) == tok.apply_chat_template(msgs)
    assert back.tokenizer.encode_chat(msgs) == tok.encode_chat(msgs)
    assert back.tokenizer.eos_token == tok.eos_token and back.cfg.eos_token_ids == [2, 7]


# ---------------------------------------------------------------- the searched int4 fit, the 8-bit head

@pytest.mark.parametrize("group_size", [32, 64])
def test_searched_fit_never_worse_than_rtn_group_by_group(group_size):
    """Same layout, every group's squared error <= round-to-nearest's, the total clearly lower on
    heavy-tailed weights (where shrinking the range pays), and exact where RTN already is."""
    from flint.quant.int4 import quantize_int4_searched

    g = torch.Generator().manual_seed(5)
    w = torch.randn(96, 256, generator=g) ** 3
    rtn, srch = quantize_int4(w, group_size), quantize_int4_searched(w, group_size, chunk_rows=40)
    assert srch.qweight.shape == rtn.qweight.shape and srch.scales.dtype == torch.float16
    assert srch.scales.shape == rtn.scales.shape and srch.group_size == group_size

    def group_err(q):
        return (q.dequantize() - w).square().view(96, -1, group_size).sum(-1)

    assert bool((group_err(srch) <= group_err(rtn)).all())
    assert float(group_err(srch).sum()) < 0.85 * float(group_err(rtn).sum())
    exact = rtn.dequantize()  # values on an int4 grid whose groups span codes 0..15: RTN is exact
    again = quantize_int4_searched(exact, group_size)
    assert torch.equal(again.dequantize(), quantize_int4(exact, group_size).dequantize())


def test_searched_fit_constant_group_and_errors():
    from flint.quant.int4 import quantize_int4_searched

    w = torch.zeros(2, 64)
    w[1] = 0.25
    q = quantize_int4_searched(w, 32)
    assert torch.equal(q.dequantize(), w)
    with pytest.raises(ValueError, match="does not divide"):
        quantize_int4_searched(torch.randn(4, 96), 64, name="lm_head")


def test_int8_rows_error_and_bytes():
    from flint.quant.int4 import int8_rows

    g = torch.Generator().manual_seed(6)
    w = torch.randn(10, 64, generator=g)
    v, nbytes = int8_rows(w, 32)
    step = (w.view(10, 2, 32).abs().amax(-1) / 127).half().float()
    assert bool(((v - w).abs().view(10, 2, 32) <= step.unsqueeze(-1) / 2 * (1 + 1e-3)).all())
    assert nbytes == 10 * 64 + 2 * 10 * 2
