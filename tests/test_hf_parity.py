"""flint's reference decoder against transformers, on tiny random checkpoints.

Each case builds a random GraniteForCausalLM, LlamaForCausalLM (plain, or with llama3 / linear /
yarn RoPE scaling), Qwen2, Qwen3, Mistral (a sliding window), Phi3 (LongRoPE, partial RoPE, a
window) or (all-attention, dense) GraniteMoeHybridForCausalLM, saves it with save_pretrained, loads the directory with
flint.loading.load_model and checks, in fp32, that flint's logits equal HF's: for a prefill from
position 0, for token-by-token decode through the KV cache, for an M > 1 chunk at start_pos > 0,
and after rolling the cache back. Cases vary head_dim, kv heads (1, 2, = heads), tied/untied,
the four Granite multipliers, rope_theta and RoPE on/off. Run: ``pytest tests/test_hf_parity.py``.
"""
from __future__ import annotations

import pytest
import torch

from conftest import make_hf_model, save_hf_dir
from flint.loading import load_model
from flint.model import Transformer

pytestmark = pytest.mark.usefixtures("torch_one_thread")

transformers = pytest.importorskip("transformers")

GRANITE_MULTIPLIERS = dict(embedding_multiplier=3.0, attention_multiplier=0.07,
                           residual_multiplier=0.4, logits_scaling=2.5)

# id -> (family, rope_theta, overrides)
CASES = {
    "llama-gqa-headdim24-untied": ("llama", 5000.0, dict(head_dim=24, num_key_value_heads=2)),
    "llama-mqa-tied": ("llama", 10000.0, dict(num_key_value_heads=1, tie_word_embeddings=True)),
    "llama-mha-headdim32": ("llama", 500000.0, dict(head_dim=32, num_key_value_heads=4)),
    "granite-gqa-tied": ("granite", 1e6, dict(GRANITE_MULTIPLIERS, tie_word_embeddings=True)),
    "granite-mqa-headdim8-untied": ("granite", 20000.0,
                                    dict(GRANITE_MULTIPLIERS, head_dim=8, num_key_value_heads=1)),
    "granitemoehybrid-rope": ("granitemoehybrid", 3000.0,
                              dict(GRANITE_MULTIPLIERS, tie_word_embeddings=True)),
    "granitemoehybrid-norope-mha": ("granitemoehybrid", 10000.0,
                                    dict(GRANITE_MULTIPLIERS, position_embedding_type=None,
                                         num_key_value_heads=4)),
    # the families of docs/loading.md: each feature on the tiny shape (original contexts below SEQ
    # so the scaled frequencies are the ones in use)
    "llama3-rope": ("llama", 500000.0, dict(head_dim=32, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16))),
    "llama-linear-rope": ("llama", 10000.0, dict(rope_parameters=dict(rope_type="linear", rope_theta=1e4,
                                                                      factor=2.5))),
    "llama-yarn-rope": ("llama", 10000.0, dict(head_dim=32, rope_parameters=dict(
        rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=12))),
    "qwen2-biases": ("qwen2", 1e6, dict(tie_word_embeddings=True)),
    "qwen3-qknorm": ("qwen3", 1e6, dict(head_dim=24, num_key_value_heads=1)),
    "mistral-window5": ("mistral", 1e6, dict(sliding_window=5, head_dim=16)),
    "phi3-longrope-partial-window": ("phi3", 1e4, dict(
        partial_rotary_factor=0.75, sliding_window=7, original_max_position_embeddings=64,
        rope_parameters=dict(rope_type="longrope", rope_theta=1e4, partial_rotary_factor=0.75,
                             short_factor=[1.0, 1.5, 2.0, 3.0, 1.2, 1.1], long_factor=[4.0] * 6))),
}

# the same families from a GGUF written the way llama.cpp's converter writes them (tests/test_gguf.py's
# write_tiny_gguf: matrices in a cycle of quantized types), against transformers with those weights
GGUF_CASES = ["llama3-rope", "llama-linear-rope", "llama-yarn-rope", "qwen2-biases", "qwen3-qknorm",
              "mistral-window5", "phi3-longrope-partial-window"]
CASES.update({f"{name}-gguf": (CASES[name][0], CASES[name][1], dict(CASES[name][2], tie_word_embeddings=False))
              for name in GGUF_CASES})

SEQ = 20  # tokens compared per case


def close(ours: torch.Tensor, theirs: torch.Tensor) -> tuple[bool, float]:
    """fp32 agreement: max abs diff below 1e-4 of the logit scale."""
    diff = (ours - theirs).abs().max().item()
    return diff <= 1e-4 * max(1.0, theirs.abs().max().item()), diff


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tmp_path_factory):
    family, theta, overrides = CASES[request.param]
    hf = make_hf_model(family, seed=len(request.param), rope_theta=theta, **overrides)
    if request.param.endswith("-gguf"):
        from test_gguf import write_tiny_gguf

        path = tmp_path_factory.mktemp(request.param) / "tiny.gguf"
        hf.load_state_dict(write_tiny_gguf(hf, path))
        lm = load_model(str(path))
    else:
        lm = load_model(str(save_hf_dir(hf, tmp_path_factory.mktemp(request.param), tokenizer=False)))
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, hf.config.vocab_size, (SEQ,), generator=g)
    # HF's full-sequence logits and its last decoder layer's output (before the final norm)
    captured = {}
    hook = hf.model.layers[-1].register_forward_hook(
        lambda mod, inp, out: captured.__setitem__("h", out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        logits = hf(ids[None]).logits[0].float()
    hook.remove()
    return dict(name=request.param, hf=hf, lm=lm, ids=ids, logits=logits, hidden=captured["h"][0])


def test_config_read_from_checkpoint(case):
    cfg, hc = case["lm"].cfg, case["hf"].config
    assert cfg.head_dim == (getattr(hc, "head_dim", None) or hc.hidden_size // hc.num_attention_heads)
    assert cfg.num_kv_heads == hc.num_key_value_heads
    assert cfg.tie_word_embeddings == bool(hc.tie_word_embeddings)
    if cfg.tie_word_embeddings:
        assert case["lm"].params["lm_head"] is case["lm"].params["embed"]
    assert cfg.use_rope == (getattr(hc, "position_embedding_type", "rope") == "rope")
    # the family features, from config.json or the GGUF's metadata and tensors alike
    assert cfg.qkv_bias == (hc.model_type == "qwen2") and cfg.qk_norm == (hc.model_type == "qwen3")
    assert cfg.sliding_window == (getattr(hc, "sliding_window", None) if hc.model_type in ("mistral", "phi3") else None)
    partial = hc.rope_parameters.get("partial_rotary_factor", 1.0)
    assert cfg.rotary_dim == (None if partial == 1.0 else int(cfg.head_dim * partial))
    kind = hc.rope_parameters.get("rope_type", "default")
    gguf_kind = {"llama3": "freq_factors"} if case["name"].endswith("-gguf") else {}
    assert (cfg.rope_scaling or {}).get("rope_type", "default") == gguf_kind.get(kind, kind)


def test_prefill_matches_hf(case):
    model = Transformer(case["lm"].cfg, case["lm"].params, max_seq_len=64)
    logits, hidden = model.forward(case["ids"], 0, return_hidden=True)
    ok, diff = close(logits, case["logits"])
    assert ok, f"{case['name']}: prefill logits differ from HF by {diff}"
    ok, diff = close(hidden, case["hidden"])
    assert ok, f"{case['name']}: last hidden state differs from HF by {diff}"


def test_decode_token_by_token_matches_hf(case):
    model = Transformer(case["lm"].cfg, case["lm"].params, max_seq_len=64)
    for pos in range(SEQ):
        step = model.forward(case["ids"][pos: pos + 1], pos)
        ok, diff = close(step[0], case["logits"][pos])
        assert ok, f"{case['name']}: decode step at position {pos} differs from HF by {diff}"


def test_chunk_at_offset_and_rollback_match_hf(case):
    """Prefill 7, a 6-token chunk at start_pos 7, singles after; then roll back to 5 and diverge."""
    ids, ref = case["ids"], case["logits"]
    model = Transformer(case["lm"].cfg, case["lm"].params, max_seq_len=64)
    parts = [model.forward(ids[:7], 0), model.forward(ids[7:13], 7)]
    parts += [model.forward(ids[p: p + 1], p) for p in range(13, SEQ)]
    ok, diff = close(torch.cat(parts), ref)
    assert ok, f"{case['name']}: chunked decode differs from HF by {diff}"

    # speculative-decoding rollback: rewrite positions 5.. with other tokens (longer than before
    # is not needed: stale cache entries past the new end must simply never be read)
    other = (ids[5:9] + 1) % case["hf"].config.vocab_size
    got = model.forward(other, 5)
    with torch.no_grad():
        want = case["hf"](torch.cat((ids[:5], other))[None]).logits[0, 5:].float()
    ok, diff = close(got, want)
    assert ok, f"{case['name']}: after rollback to position 5 logits differ from HF by {diff}"


def test_batched_rows_match_single(case):
    """The [B, M] form (batch_size=B) gives each row the logits it has alone."""
    cfg, params, ids = case["lm"].cfg, case["lm"].params, case["ids"]
    model = Transformer(cfg, params, max_seq_len=64, batch_size=2)
    rows = torch.stack((ids[:10], ids[10:20]))
    got = model.forward(rows, 0)
    with torch.no_grad():
        want = case["hf"](rows).logits.float()
    ok, diff = close(got, want)
    assert ok, f"{case['name']}: batched logits differ from HF by {diff}"


def prefill_matches_hf(lm, hf) -> tuple[bool, float]:
    """Prefill 16 tokens through flint's reference and through the HF model; (close?, max diff)."""
    ids = torch.arange(3, 19)
    got = Transformer(lm.cfg, lm.params, max_seq_len=32).forward(ids, 0)
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    return close(got, want)


def test_sharded_checkpoint_loads_identically(tmp_path):
    hf = make_hf_model("granite", seed=3, rope_theta=1e4, head_dim=24, **GRANITE_MULTIPLIERS)
    d = save_hf_dir(hf, tmp_path / "sharded", max_shard_size="40KB", tokenizer=False)
    shards = sorted(p.name for p in d.glob("*.safetensors"))
    assert (d / "model.safetensors.index.json").exists() and len(shards) > 2, shards
    lm = load_model(str(d))
    ok, diff = prefill_matches_hf(lm, hf)
    assert ok, f"sharded checkpoint ({len(shards)} shards): logits differ from HF by {diff}"


@pytest.mark.parametrize("family", ["granite", "granitemoehybrid"])
def test_granite_multipliers_default_like_transformers(tmp_path, family):
    """A config.json without the four multipliers means transformers' defaults (all 1.0; the
    attention scale is attention_multiplier = 1.0, not 1/sqrt(head_dim))."""
    import json

    from transformers import AutoModelForCausalLM

    d = save_hf_dir(make_hf_model(family, seed=5), tmp_path / family, tokenizer=False)
    cfg = json.loads((d / "config.json").read_text())
    for field in GRANITE_MULTIPLIERS:
        cfg.pop(field, None)
    (d / "config.json").write_text(json.dumps(cfg))
    hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    lm = load_model(str(d))
    ok, diff = prefill_matches_hf(lm, hf)
    assert ok, f"{family} with default multipliers: logits differ from HF by {diff}"
