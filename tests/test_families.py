"""The model families beyond the plain Llama layer (docs/loading.md): what flint refuses and why, and
the cases tests/test_hf_parity.py's per-family parity does not reach.

* LongRoPE past the original context: the long factor set, against transformers on a prefill;
* config fields flint cannot honour are refused naming the field (HF and GGUF);
* the GPU backends refuse a feature they do not implement, naming it, before touching weights;
* a flint int4 checkpoint of such a model keeps its features.

Run: ``pytest tests/test_families.py``.
"""
from __future__ import annotations

import json

import pytest
import torch

from conftest import make_hf_model, save_hf_dir
from flint.backend import BackendError, make_backend
from flint.config import kernel_features
from flint.loading import LoadError, load_model
from flint.model import Transformer

pytestmark = pytest.mark.usefixtures("torch_one_thread")

transformers = pytest.importorskip("transformers")

LONGROPE = dict(rope_type="longrope", rope_theta=1e4, short_factor=[1.0, 1.5, 2.0, 3.0, 1.2, 1.1, 1.0, 1.0],
                long_factor=[4.0, 3.0, 2.5, 2.0, 6.0, 1.5, 1.2, 1.1])


def logits_close(got: torch.Tensor, want: torch.Tensor) -> float:
    diff = (got - want).abs().max().item()
    assert diff <= 1e-4 * max(1.0, want.abs().max().item()), f"logits differ from transformers by {diff}"
    return diff


def test_longrope_long_factors_past_the_original_context(tmp_path):
    """A context longer than original_max_position_embeddings takes the long factors (flint picks
    them from the context it is built with); a 20-token prefill past an original 8 is where
    transformers uses them too. Within the original context, the short ones (both agree)."""
    hf = make_hf_model("phi3", seed=4, original_max_position_embeddings=8, rope_parameters=LONGROPE)
    lm = load_model(str(save_hf_dir(hf, tmp_path / "phi3", tokenizer=False)))
    assert lm.cfg.rope_scaling["original_max_position_embeddings"] == 8
    ids = torch.arange(3, 23)
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    logits_close(Transformer(lm.cfg, lm.params, max_seq_len=64).forward(ids, 0), want)
    with torch.no_grad():
        short = hf(ids[None, :8]).logits[0]
    logits_close(Transformer(lm.cfg, lm.params, max_seq_len=8).forward(ids[:8], 0), short)
    # and the two factor sets do differ here (the test would not see a wrong pick otherwise)
    assert (Transformer(lm.cfg, lm.params, max_seq_len=8).forward(ids[:8], 0) -
            Transformer(lm.cfg, lm.params, max_seq_len=64).forward(ids[:8], 0)).abs().max() > 1e-2


@pytest.mark.parametrize("family,edit,field", [
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "rope_parameters"),
    ("llama", {"rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0}}, "original_max_position_embeddings"),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 4.0,
                                   "high_freq_factor": 1.0, "original_max_position_embeddings": 16}},
     "high_freq_factor"),
    ("phi3", {"rope_parameters": dict(LONGROPE, short_factor=[1.0] * 3)}, "short_factor"),
    ("phi3", {"partial_rotary_factor": 1.5}, "partial_rotary_factor"),
    ("qwen2", {"use_sliding_window": True}, "use_sliding_window"),
    ("qwen3", {"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ("qwen3", {"attention_bias": True}, "attention_bias"),
    ("mistral", {"sliding_window": 0}, "sliding_window"),
])
def test_unhonoured_fields_are_refused(tmp_path, family, edit, field):
    d = save_hf_dir(make_hf_model(family, seed=2), tmp_path / family, tokenizer=False)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(edit)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoadError) as info:
        load_model(str(d))
    assert field in str(info.value) and "config.json" in str(info.value)


def test_gguf_unhonoured_rope_scaling_refused(tmp_path):
    from test_gguf import write_tiny_gguf

    hf = make_hf_model("llama", seed=3, rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0,
                                                             original_max_position_embeddings=16))
    write_tiny_gguf(hf, tmp_path / "ok.gguf")
    assert load_model(str(tmp_path / "ok.gguf")).cfg.rope_scaling["rope_type"] == "yarn"
    # the same file with a YaRN field flint does not compute
    write_tiny_gguf(hf, tmp_path / "yarn.gguf", extra=lambda w: w.add_rope_scaling_yarn_log_mul(0.1))
    with pytest.raises(LoadError) as info:
        load_model(str(tmp_path / "yarn.gguf"))
    assert "llama.rope.scaling.yarn_log_multiplier" in str(info.value)


@pytest.mark.parametrize("family,overrides,feature", [
    ("qwen2", {}, "q/k/v projection biases"),
    ("qwen3", {}, "q/k RMSNorm"),
    ("mistral", dict(sliding_window=8), "sliding_window 8"),
    ("llama", {}, "head_dim 16"),
])
def test_megakernel_refuses_unimplemented_features(tmp_path, family, overrides, feature):
    """The megakernel names what it does not run, before touching weights (on any machine); the reference and
    `compiled` run every family."""
    lm = load_model(str(save_hf_dir(make_hf_model(family, seed=1, **overrides), tmp_path / family,
                                    tokenizer=False)))
    if not any(feature in f for f in kernel_features(lm.cfg, 32)):  # (a tree with a lab patch that runs it:
        pytest.skip(f"the megakernel runs {feature} here")           # lab/patches/qk_norm.patch, qkv_bias.patch)
    with pytest.raises(BackendError) as info:
        make_backend("megakernel", lm, max_seq_len=32, device="cpu")
    assert feature in str(info.value) and "reference" in str(info.value)
    assert kernel_features(lm.cfg, 32, "compiled") == []
    make_backend("reference", lm, max_seq_len=32, device="cpu")
    make_backend("compiled", lm, max_seq_len=32, device="cpu")


# each family's features on `compiled` (CPU: eager, int4 G32 through tinygemm's CPU ops) against the reference on
# the same int4 weights: q|k|v biases, q/k norm, scaled RoPE (llama3, linear, YaRN, LongRoPE past the original
# context), partial RoPE, a sliding window shorter than the context
FEATURES = [
    ("qwen2", {}),
    ("qwen3", {}),
    ("llama", dict(rope_parameters=dict(rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=1.0,
                                        high_freq_factor=4.0, original_max_position_embeddings=16))),
    ("llama", dict(rope_parameters=dict(rope_type="linear", rope_theta=1e4, factor=2.0))),
    ("llama", dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0,
                                        original_max_position_embeddings=16))),
    ("phi3", dict(partial_rotary_factor=0.5, original_max_position_embeddings=16,
                  rope_parameters=dict(LONGROPE, partial_rotary_factor=0.5, short_factor=LONGROPE["short_factor"][:4],
                                       long_factor=LONGROPE["long_factor"][:4]))),
    ("mistral", dict(sliding_window=6)),
]


@pytest.mark.parametrize("family,overrides", FEATURES)
def test_compiled_runs_the_families_features(tmp_path, family, overrides):
    from flint.params import LoadedModel
    from flint.quant.int4 import quantize_params

    lm = load_model(str(save_hf_dir(make_hf_model(family, seed=2, **overrides), tmp_path / family, tokenizer=False)))
    q = LoadedModel(lm.cfg, quantize_params(lm.params, 32), None, "q")
    ref = make_backend("reference", q, max_seq_len=48, device="cpu")
    be = make_backend("compiled", q, max_seq_len=48, device="cpu", group_size=32)
    toks = torch.randint(0, lm.cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(3))
    want, got = ref.forward(toks, 0), be.forward(toks, 0)
    scale = max(1.0, float(want.abs().max()))
    assert float((got - want).abs().max()) <= 2e-4 * scale, "prefill"
    for pos in range(20, 26):  # decode steps through the cache, past the window where there is one
        t = torch.tensor([int(want[-1].argmax())])
        want, got = ref.forward(t, pos), be.forward(t, pos)
        assert float((got - want).abs().max()) <= 2e-4 * scale, f"decode at {pos}"


def test_rope_pair_order_emulates_the_rotation():
    """The megakernel's row order and padded tables (flint.megakernel.rope_pair_order, rope_tables_padded), its
    epilogue emulated: pair i = rows (2i, 2i + 1) rotated by table entry i, written to dims (i, i + D/2). For full
    and partial rotary widths the result is apply_rope's, permuted the same way for every head, so q . k is kept."""
    from flint.config import from_hf_dict
    from flint.megakernel import rope_pair_order, rope_tables_padded
    from flint.model import apply_rope, rope_tables

    g = torch.Generator().manual_seed(0)
    for d, factor in ((64, 1.0), (128, 0.75), (64, 0.5)):
        cfg = from_hf_dict(dict(model_type="phi3", vocab_size=64, hidden_size=2 * d, intermediate_size=64,
                                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=d,
                                partial_rotary_factor=factor, max_position_embeddings=32))
        r = cfg.rotary_dim or d
        order = rope_pair_order(d, r)
        assert sorted(order.tolist()) == list(range(d))
        if r == d:  # full rotation: the pairs (i, i + D/2)
            assert order.tolist() == [v for i in range(d // 2) for v in (i, i + d // 2)]
        cos, sin = rope_tables(cfg, 32, "cpu")
        pc, ps = rope_tables_padded(cfg, 32, "cpu")
        assert pc.shape == (32, d // 2)
        q, k = torch.randn(5, 2, d, generator=g), torch.randn(5, 1, d, generator=g)
        pos = torch.tensor([0, 3, 7, 19, 31])

        def kernel(x):  # rows in kernel order -> the epilogue -> the cache's dims
            rows = x[..., order].view(*x.shape[:-1], d // 2, 2)
            a, b = rows[..., 0], rows[..., 1]
            c, s = pc[pos][:, None, :], ps[pos][:, None, :]
            return torch.cat((a * c - b * s, b * c + a * s), -1)

        want_q, want_k = apply_rope(q, cos[pos], sin[pos]), apply_rope(k, cos[pos], sin[pos])
        virt = torch.cat((order[0::2], order[1::2]))  # cache dim j holds true dim virt[j]
        assert torch.allclose(kernel(q), want_q[..., virt], atol=1e-5)
        assert torch.allclose(kernel(k), want_k[..., virt], atol=1e-5)
        scores = torch.einsum("mhd,mkd->mhk", kernel(q), kernel(k))
        assert torch.allclose(scores, torch.einsum("mhd,mkd->mhk", want_q, want_k), atol=1e-4)


def test_window_counts_only_past_the_context(tmp_path):
    lm = load_model(str(save_hf_dir(make_hf_model("mistral", seed=1, sliding_window=8, head_dim=64), tmp_path / "m",
                                    tokenizer=False)))
    assert kernel_features(lm.cfg, 8) == []
    assert kernel_features(lm.cfg, 9) == ["sliding_window 8 below the context 9"]


@pytest.mark.parametrize("family,overrides", [
    ("qwen3", {}),
    ("phi3", dict(partial_rotary_factor=0.5, sliding_window=6, original_max_position_embeddings=16,
                  rope_parameters=dict(LONGROPE, partial_rotary_factor=0.5, short_factor=LONGROPE["short_factor"][:4],
                                       long_factor=LONGROPE["long_factor"][:4]))),
])
def test_int4_checkpoint_keeps_the_features(tmp_path, family, overrides):
    """flint quantize of such a model (from its HF directory and from its GGUF) loads back with the
    same config and the same float feature tensors (norms, biases) as the model it was written from."""
    from flint.quant.quantize import quantize_checkpoint

    from test_gguf import write_tiny_gguf

    hf = make_hf_model(family, seed=6, tie_word_embeddings=False, **overrides)
    write_tiny_gguf(hf, tmp_path / "tiny.gguf")
    for src in (save_hf_dir(hf, tmp_path / "hf", tokenizer=False), tmp_path / "tiny.gguf"):
        lm = load_model(str(src))
        back = load_model(str(quantize_checkpoint(str(src), tmp_path / f"q-{src.name}", group_size=32,
                                                  log=lambda *a, **k: None)))
        for f in ("qkv_bias", "qk_norm", "rotary_dim", "rope_scaling", "sliding_window", "arch"):
            assert getattr(back.cfg, f) == getattr(lm.cfg, f), f
        extra = [n for n in lm.params if n.endswith(("q_norm", "k_norm", ".bq", ".bk", ".bv"))]
        assert len(extra) == (2 * lm.cfg.num_layers if family == "qwen3" else 0)
        for n in extra:
            assert torch.equal(back.params[n].float(), lm.params[n].float()), n


# The pre_tokenizer objects of each family's own tokenizer.json, as those files spell them (Llama 3:
# meta-llama/Llama-3.1-8B; Qwen2: Qwen/Qwen2.5-7B, and Qwen3's is the same; SmolLM2; GPT-2).
_LLAMA3_JSON = (r'{"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": '
                r'"(?i:\u0027s|\u0027t|\u0027re|\u0027ve|\u0027m|\u0027ll|\u0027d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|'
                r'\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}, "behavior": "Isolated", '
                r'"invert": false}, {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, '
                r'"use_regex": false}]}')
FAMILY_PRE_TOKENIZERS = {
    "llama-bpe": _LLAMA3_JSON,
    "qwen2": _LLAMA3_JSON.replace(r"\\p{N}{1,3}", r"\\p{N}"),
    "smollm": ('{"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": true}, '
               '{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}]}'),
    "gpt2": '{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}',
}
SPLIT_TEXTS = ["I DON'T know, it's 12345 apples!\n\n  Hello   world\r\n\tx", "héllo wörld 3.14159 ÅNGSTRÖM",
               "can't've 2024-12-07 ...\n\n\nend", "   leading spaces and trailing   ", "x\ny\r\n\r\nz 7a8b9"]


@pytest.fixture(scope="module")
def tiny_llama_model():
    return make_hf_model("llama", seed=8)


# llama.cpp's names that stand for one of those splits
PRE_ALIASES = {"starcoder": "smollm", "refact": "smollm", "dbrx": "llama-bpe", "smaug-bpe": "llama-bpe"}


@pytest.mark.parametrize("pre", list(FAMILY_PRE_TOKENIZERS) + list(PRE_ALIASES))
def test_gguf_pre_tokenizer_splits_like_the_family(tmp_path, tiny_llama_model, pre):
    """A GGUF's tokenizer.ggml.pre gives the split of that family's tokenizer.json, piece for piece
    and id for id (tokenizers itself reads the family's JSON for the reference)."""
    from tokenizers import Tokenizer

    from test_gguf import write_tiny_gguf

    write_tiny_gguf(tiny_llama_model, tmp_path / "t.gguf", pre=pre)
    tok = load_model(str(tmp_path / "t.gguf")).tokenizer
    ref = json.loads(tok.tk.to_str())
    ref["pre_tokenizer"] = json.loads(FAMILY_PRE_TOKENIZERS[PRE_ALIASES.get(pre, pre)])
    ref = Tokenizer.from_str(json.dumps(ref))
    gpt2_differs = False
    for text in SPLIT_TEXTS:
        pieces = [p for p, _ in tok.tk.pre_tokenizer.pre_tokenize_str(text)]
        assert pieces == [p for p, _ in ref.pre_tokenizer.pre_tokenize_str(text)], (pre, text)
        assert tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False).ids
        gpt2_differs |= pieces != [p for p, _ in json_pre(FAMILY_PRE_TOKENIZERS["gpt2"]).pre_tokenize_str(text)]
    assert gpt2_differs == (pre != "gpt2"), "the texts should tell this split from GPT-2's"
    # and transformers' GGUF loader splits with the same regex, for the names it knows
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    from flint.tokenizer import PRE_TOKENIZERS

    if pre in GGUF_PRE_TOKENIZER_SPLITS:
        assert PRE_TOKENIZERS[pre] == GGUF_PRE_TOKENIZER_SPLITS[pre]


def json_pre(spec: str):
    """A tokenizers pre-tokenizer from its tokenizer.json object."""
    from tokenizers import Tokenizer, models

    tk = Tokenizer(models.BPE())
    d = json.loads(tk.to_str())
    d["pre_tokenizer"] = json.loads(spec)
    return Tokenizer.from_str(json.dumps(d)).pre_tokenizer


@pytest.mark.parametrize("pre", ["default", "tekken", "deepseek-llm"])
def test_gguf_unknown_pre_tokenizer_refused(tmp_path, tiny_llama_model, pre):
    from test_gguf import write_tiny_gguf

    write_tiny_gguf(tiny_llama_model, tmp_path / "t.gguf", pre=pre)
    with pytest.raises(LoadError) as info:
        load_model(str(tmp_path / "t.gguf"))
    assert "tokenizer.ggml.pre" in str(info.value) and repr(pre) in str(info.value)


def test_gguf_end_of_turn_tokens_stop(tmp_path, tiny_llama_model):
    """A GGUF's eot and eom ids (Llama 3.1 ends a tool-call turn with eom) stop generation like eos."""
    from test_gguf import write_tiny_gguf

    def stops(w):
        w.add_eot_token_id(3)
        w.add_eom_token_id(4)

    write_tiny_gguf(tiny_llama_model, tmp_path / "t.gguf", extra=stops)
    lm = load_model(str(tmp_path / "t.gguf"))
    eos = lm.tokenizer.tk.token_to_id("<|im_end|>")
    assert lm.cfg.eos_token_ids == sorted({eos, 3, 4}) == lm.tokenizer.eos_token_ids


@pytest.mark.parametrize("name,arch,features", [
    ("llama-3.1-8b", "llama", []),
    ("llama-3.2-3b", "llama", []),
    ("qwen2.5-7b", "qwen2", ["q/k/v projection biases (Qwen2)"]),
    ("qwen3-8b", "qwen3", ["per-head q/k RMSNorm (Qwen3)"]),
    ("mistral-7b", "llama", []),
    ("phi-3.5-mini", "phi3", ["head_dim 96 (the kernel's attention reads 64 or 128)"]),
    ("phi-4-mini", "phi3", []),
])
def test_synthetic_family_shapes(name, arch, features):
    """The families' published shapes as synthetic: names, with the features the kernels must take."""
    from flint.synthetic import synthetic_config

    cfg = synthetic_config(name)
    # (a tree with a lab patch runs its family's feature: lab/patches/qkv_bias.patch, qk_norm.patch)
    patched = {"qwen2": "q/k/v projection biases (Qwen2)", "qwen3": "per-head q/k RMSNorm (Qwen3)"}
    assert cfg.arch == arch and kernel_features(cfg, 4096) in (features, [f for f in features if f != patched.get(arch)])


def test_synthetic_biases_and_norms_run(tmp_path):
    """A synthetic model with every feature's tensors (biases, q/k norms) builds and runs on the reference."""
    from flint.synthetic import synthetic_model

    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(model_type="qwen2", vocab_size=300, hidden_size=64, intermediate_size=96,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=64)))
    lm = synthetic_model(str(path), dtype=torch.float32)
    assert lm.params["layers.0.bq"].abs().max() < 0.2  # biases drawn like weights, not like norms
    logits = Transformer(lm.cfg, lm.params, max_seq_len=16).forward(torch.arange(5), 0)
    assert logits.shape == (5, 300) and torch.isfinite(logits).all()


def test_template_kwargs_reach_the_template(tiny_llama_dir):
    """Variables such as Qwen3's enable_thinking render as transformers passes them; flint's own
    variables cannot be overridden that way."""
    from transformers import AutoTokenizer

    from flint.tokenizer import TokenizerError

    tok = load_model(str(tiny_llama_dir)).tokenizer
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                         "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>{% endif %}")
    msgs = [{"role": "user", "content": "hi"}]
    hf = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    for kw in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
        want = hf.apply_chat_template(msgs, tokenize=False, chat_template=tok.chat_template, **kw)
        assert tok.apply_chat_template(msgs, template_kwargs=kw) == want
    assert tok.encode_chat(msgs, template_kwargs={"enable_thinking": False}) == tok.encode("hi<think>\n\n</think>",
                                                                                      add_special_tokens=False)
    with pytest.raises(TokenizerError):
        tok.apply_chat_template(msgs, template_kwargs={"messages": []})


# a small SentencePiece vocabulary as a GGUF spells it: unknown, control, 256 byte tokens, then pieces
# (U+2581 for a space) scored so that longer, commoner pieces win
SPM_PIECES = ["\u2581", "\u2581t", "he", "\u2581the", "\u2581h", "el", "lo", "ll", "\u2581hel", "\u2581hello",
              "\u2581w", "or", "ld", "\u2581wor", "\u2581world", "ing", "\u2581th", "in", "ng", "\u2581a", "\u2581and",
              "an", "nd", "\u2581\u2581", "\u2581\u2581\u2581"] + list("abcdefghijklmnopqrstuvwxyzTHW,.!'")


def write_spm_vocab(w):
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 259 + [-float(i) - (10.0 if len(t) == 1 else 0.0) for i, t in enumerate(SPM_PIECES)])
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES))
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


@pytest.mark.parametrize("family", ["mistral", "phi3"])
def test_gguf_sentencepiece_vocabulary_matches_transformers(tmp_path, family):
    """A SentencePiece ('llama') GGUF vocabulary (Mistral, Phi-3) tokenizes as transformers' GGUF
    loader builds it: merges from the scores, byte fallback, the prefix space per family."""
    from transformers import AutoTokenizer

    from test_gguf import write_tiny_gguf

    hf = make_hf_model(family, seed=5, vocab_size=259 + len(SPM_PIECES))
    write_tiny_gguf(hf, tmp_path / "t.gguf", tokenizer=write_spm_vocab)
    tok = load_model(str(tmp_path / "t.gguf")).tokenizer
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="t.gguf")
    for text in ["hello world", "the thing and the world!", "  hello  world", "Hi, W\u00f6rld \u2603 hello",
                 "hellohello andand", "\nthe\tend "]:
        want = theirs(text)["input_ids"]
        got = tok.encode(text)
        assert got == want, (family, text, got, want)
        assert got[0] == 1  # BOS, which llama.cpp adds to a SentencePiece vocabulary by default
        assert tok.decode(got) == theirs.decode(want, skip_special_tokens=True), (family, text)


def test_megakernel_refuses_a_head_over_its_segment_tiles_from_the_config():
    """A matrix staged in K segments keeps a block's tile sums in shared memory, MAX_ACC_TILES of them: the shapes
    over it (a 152k-200k vocabulary at hidden > 2560) are refused from the config, naming the matrix and the count,
    before any weight is read; the ones under it pass, on the 132 SMs of an H100 SXM or H200 (an H100 PCIe's 114
    give a block more tiles)."""
    from flint.megakernel import MAX_ACC_TILES, MegakernelError, refuse_shape, segmented_tiles
    from flint.synthetic import synthetic_config

    for name in ("llama-3.1-8b", "llama-3.2-3b", "mistral-7b", "granite-4.1-3b", "llama-3-70b"):
        refuse_shape(synthetic_config(name), 132)
    # (lab/patches/acc_tiles_128.patch raises the cap to 128: then these run)
    for name, blocks, tiles in (("phi-4-mini", 132, 95), ("qwen2.5-7b", 132, 72), ("qwen3-8b", 132, 72),
                                ("llama-3.1-8b", 114, 71)):
        cfg = synthetic_config(name)
        assert segmented_tiles(cfg, blocks)["lm_head"] == tiles
        if tiles > MAX_ACC_TILES:
            with pytest.raises(MegakernelError, match=rf"lm_head {tiles}\).*{MAX_ACC_TILES}"):
                refuse_shape(cfg, blocks)
        else:
            refuse_shape(cfg, blocks)
