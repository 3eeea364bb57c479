"""The embedded SmolLM2-135M-Instruct GGUF (Q4_1 + Q8_0) against transformers' own GGUF loading.

* weights: every tensor flint loads (Q4_1 codes dequantized, Q8_0 and F32, attn_q/attn_k rows
  un-permuted) equals transformers' dequantized state dict exactly;
* greedy continuations of several prompts, 32+ tokens, equal transformers' (flint reference, CPU
  fp32), and the logits agree to fp32 tolerance;
* the chat prompt renders exactly like transformers' apply_chat_template;
* token ids equal transformers' GGUF tokenizer, with one documented exception (digits, below).

Digits: the GGUF says ``tokenizer.ggml.pre = "smollm"``; llama.cpp splits such text with ``\\p{N}``
(one digit per piece) before the GPT-2 regex, and SmolLM2's original tokenizer.json does the same
(pre_tokenizer Sequence[Digits(individual_digits=True), ByteLevel]). The vocabulary has no
multi-digit tokens, so the digits themselves always come out one per token; the split matters for
the whitespace in front of a digit: "  1" is [ĠĠ, 1] with the digit split and [Ġ, Ġ, 1] without.
transformers 5.x builds its GGUF tokenizer with a plain ByteLevel pre-tokenizer (it ignores
"smollm") and so returns the latter. flint follows llama.cpp and the original;
``test_digit_split_follows_original_pretokenizer`` checks that transformers' own tokenizer with
the original pre-tokenizer put back gives flint's ids, for the texts where the two differ.

transformers needs ``accelerate`` to load a GGUF model. Run: ``pytest tests/test_gguf.py``.
"""
from __future__ import annotations

import functools
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from flint.engine import Engine, SamplingParams
from flint.loading import embedded_gguf_path, load_model
from flint.model import Transformer
from flint.quant.int4 import Int4Weight

pytestmark = pytest.mark.usefixtures("torch_one_thread")

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 32
PROMPTS = [  # plain text, code, and (in the continuations fixture) a rendered chat prompt
    "Once upon a time, in 1999,",
    "def fibonacci(n):",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke about a café ☕ in 2024."}],
]
TEXTS = [
    "Hello world",
    "12345 and 3.14159 or 1,000,000 (year 2024)",
    "naïve café — 東京 😀 ü ß Ω",
    "def f(x):\n    return x**2  # square\n\tindented",
    "x=[1,2,3];y={'a':0x1F}",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<|endoftext|>abc<|im_end|> <|im_start|>",
    "  leading spaces\n\n\nnewlines   trailing  ",
]
# texts where a digit follows a run of whitespace (see the module docstring)
DIGIT_WHITESPACE_TEXTS = ["  1", "a  2024", "x\n\n3", "   42 apples", "total:\t\t7"]


@pytest.fixture(scope="module")
def gguf_path():
    return embedded_gguf_path()


@pytest.fixture(scope="module")
def lm():
    return load_model(None)  # no spec: the embedded default


@pytest.fixture(scope="module")
def hf_tok(gguf_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    """transformers' own GGUF loading (dequantized to fp32), once per module."""
    from transformers import AutoModelForCausalLM

    try:
        import accelerate  # noqa: F401
    except ImportError:
        pytest.fail("transformers needs `accelerate` to load a GGUF model: pip install accelerate")
    # transformers rebuilds gguf's (pure) tensor-name table once per module of the model; caching
    # it halves the load (15.5 s -> 7.6 s CPU, measured on the 2-core dev box) and changes no weight
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                     dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def reference(lm):
    return Transformer(lm.cfg, lm.params, max_seq_len=256)



def hf_to_flint_names(num_layers: int) -> dict[str, str]:
    """HF tensor name -> flint param name, written out here independently of flint.loading."""
    names = {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm", "lm_head.weight": "lm_head"}
    per_layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "wq", "self_attn.k_proj": "wk",
                 "self_attn.v_proj": "wv", "self_attn.o_proj": "wo", "post_attention_layernorm": "ffn_norm",
                 "mlp.gate_proj": "w_gate", "mlp.up_proj": "w_up", "mlp.down_proj": "w_down"}
    for i in range(num_layers):
        for theirs, ours in per_layer.items():
            names[f"model.layers.{i}.{theirs}.weight"] = f"layers.{i}.{ours}"
    return names

def test_embedded_default_is_smollm2(lm, gguf_path):
    assert lm.source == str(gguf_path)
    assert lm.cfg.arch == "llama" and lm.cfg.num_heads % lm.cfg.num_kv_heads == 0
    assert isinstance(lm.params["layers.0.wq"], Int4Weight)  # Q4_1 kept as codes
    assert lm.params["lm_head"].shape == (lm.cfg.vocab_size, lm.cfg.hidden_size)


def test_weights_equal_transformers_dequantization(lm, hf_model):
    sd = hf_model.state_dict()
    hf_name = {ours: theirs for theirs, ours in hf_to_flint_names(lm.cfg.num_layers).items()
               if theirs != "lm_head.weight"}
    for name, key in hf_name.items():
        w = lm.params[name]
        w = w.dequantize() if isinstance(w, Int4Weight) else w
        assert torch.equal(w.float(), sd[key].float()), f"{name} differs from transformers' {key}"
    head = lm.params["lm_head"]
    head = head.dequantize() if isinstance(head, Int4Weight) else head
    assert torch.equal(head.float(), sd["lm_head.weight"].float())


@pytest.fixture(scope="module")
def continuations(lm, reference):
    """flint's greedy continuations (eos ignored so every prompt gives NEW_TOKENS tokens)."""
    engine = Engine(reference, lm.tokenizer)
    out = {}
    for prompt in PROMPTS + [lm.tokenizer.apply_chat_template(CONVERSATIONS[0])]:
        ids = lm.tokenizer.encode(prompt)
        res = engine.generate(ids, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
        out[prompt] = (ids, res.token_ids)
    return out


def test_greedy_continuations_match_transformers(continuations, hf_model, hf_tok):
    """transformers' greedy pick at every position of prompt + flint's continuation is flint's next
    token (one forward per prompt decides all NEW_TOKENS greedy steps), and logits agree."""
    for prompt, (ids, new) in continuations.items():
        assert ids == hf_tok(prompt).input_ids, f"prompt ids differ for {prompt!r}"
        assert len(new) == NEW_TOKENS
        seq = torch.tensor([ids + new[:-1]])
        with torch.no_grad():
            logits = hf_model(seq).logits[0, len(ids) - 1:]
        hf_greedy = logits.argmax(-1).tolist()
        assert hf_greedy == new, (f"{prompt!r}: transformers continues {hf_tok.decode(hf_greedy)!r}, "
                                  f"flint {hf_tok.decode(new)!r}")


def test_logits_match_transformers(continuations, hf_model, reference):
    ids, new = continuations[PROMPTS[1]]
    seq = torch.tensor(ids + new)
    ours = reference.forward(seq, 0)
    with torch.no_grad():
        theirs = hf_model(seq[None]).logits[0]
    diff = (ours - theirs).abs().max().item()
    assert diff <= 1e-4 * theirs.abs().max().item(), f"SmolLM2 logits differ from transformers by {diff}"


def test_generate_matches_transformers_generate(continuations, hf_model, lm):
    """One prompt through transformers' own generate() (its KV cache; stops at eos) for 32
    tokens: flint's greedy tokens up to and including the first eos."""
    ids, new = continuations[PROMPTS[1]]
    eos = set(lm.tokenizer.eos_token_ids)
    cut = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
    with torch.no_grad():
        hf_out = hf_model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
    assert hf_out[0, len(ids):].tolist() == new[:cut]


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_matches_transformers(lm, hf_tok, generation_prompt):
    for conv in CONVERSATIONS:
        want = hf_tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=generation_prompt)
        got = lm.tokenizer.apply_chat_template(conv, add_generation_prompt=generation_prompt)
        assert got == want
        assert lm.tokenizer.encode_chat(conv, generation_prompt) == hf_tok(want).input_ids


def test_token_ids_match_transformers(lm, hf_tok):
    for text in TEXTS:
        ids = lm.tokenizer.encode(text)
        assert ids == hf_tok(text).input_ids, f"ids differ for {text!r}"
        assert lm.tokenizer.decode(ids, skip_special_tokens=False) == text
    special = lm.tokenizer.encode("<|im_start|><|im_end|>")
    assert special == [hf_tok.convert_tokens_to_ids("<|im_start|>"), hf_tok.convert_tokens_to_ids("<|im_end|>")]
    assert lm.tokenizer.eos_token_ids == [hf_tok.eos_token_id]


def test_digit_split_follows_original_pretokenizer(lm, hf_tok):
    from tokenizers import pre_tokenizers

    original = hf_tok.backend_tokenizer.__class__.from_str(hf_tok.backend_tokenizer.to_str())
    original.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    for text in DIGIT_WHITESPACE_TEXTS + TEXTS:
        ids = lm.tokenizer.encode(text)
        assert ids == original.encode(text).ids, f"ids differ from the original pre-tokenizer for {text!r}"
        digits = [i for i in ids if lm.tokenizer.decode([i]).strip().isdigit()]
        assert all(len(lm.tokenizer.decode([i]).strip()) == 1 for i in digits), text


def test_stream_decoder_never_splits_utf8(lm):
    text = "café ☕ — 東京 😀🙂 ü"
    ids = lm.tokenizer.encode(text)
    assert len(ids) > len(text.split()), "expected multi-byte characters to span several tokens"
    dec = lm.tokenizer.stream()
    pieces = [dec.feed(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces), pieces
    assert "".join(pieces) + dec.flush() == text


# ------------------------------------------------------------------ tiny GGUFs written here
# Every tensor type flint reads (F32, F16, BF16, Q8_0, Q4_0, Q4_1), q/k rows permuted the way
# llama.cpp's converter stores them, llama and granite metadata, an explicit key_length.

TYPE_CYCLE = ["Q4_0", "Q4_1", "BF16", "Q8_0", "F16", "F32"]


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF half-split rows -> llama.cpp's interleaved (pairwise) rows, per head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(hf, path: Path, encode=None, pre: str = "gpt2", extra=None, tokenizer=None) -> dict:
    """Write ``hf`` (a tiny transformers llama, mistral, granite, qwen2, qwen3 or phi3) as a GGUF the
    way llama.cpp's converter lays it out (llama / granite q and k rows interleaved; phi3's fused
    tensors kept fused; Llama 3's RoPE scaling as a rope_freqs tensor, Phi-3's LongRoPE as
    rope_factors tensors); returns {HF name: the float weight a GGUF reader must reconstruct}
    (quantize -> dequantize with the gguf package).

    ``encode(name, x) -> (raw, kind)``, when given, makes each matrix's blocks instead (raw: the
    uint8 rows gguf.quants.quantize would return); ``extra(writer)`` adds metadata;
    ``tokenizer(writer)`` writes the tokenizer fields instead of the byte-level vocabulary's."""
    from tokenizers import Tokenizer
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from conftest import SPECIALS, byte_tokenizer_json

    c = hf.config
    arch = {"granite": "granite", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3"}.get(c.model_type, "llama")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rope = dict(c.rope_parameters)
    rot = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    if arch != "phi3":  # llama.cpp's phi3 files carry no key_length: the head is hidden / heads
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_dimension_count(rot)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(rope["rope_theta"])
    if getattr(c, "sliding_window", None):
        w.add_sliding_window(c.sliding_window)
    kind = rope.get("rope_type", "default")
    if kind in ("linear", "yarn"):
        w.add_rope_scaling_type(gguf.RopeScalingType(kind))
        w.add_rope_scaling_factor(rope["factor"])
        if kind == "yarn":
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    rope_vectors = {}
    if kind == "llama3":  # llama.cpp's divisors: the plain frequencies over the scaled ones
        plain = 1.0 / (rope["rope_theta"] ** (torch.arange(0, rot, 2).float() / rot))
        rope_vectors["rope_freqs.weight"] = (plain / ROPE_INIT_FUNCTIONS["llama3"](c, None)[0]).numpy()
    if kind == "longrope":
        w.add_rope_scaling_attn_factors(ROPE_INIT_FUNCTIONS["longrope"](c, None)[1])
        w.add_rope_scaling_orig_ctx_len(c.original_max_position_embeddings)
        rope_vectors["rope_factors_long.weight"] = np.array(rope["long_factor"], dtype=np.float32)
        rope_vectors["rope_factors_short.weight"] = np.array(rope["short_factor"], dtype=np.float32)
    if extra is not None:
        extra(w)
    if arch == "granite":
        w.add_embedding_scale(c.embedding_multiplier)
        w.add_attention_scale(c.attention_multiplier)
        w.add_residual_scale(c.residual_multiplier)
        w.add_logit_scale(c.logits_scaling)
    if tokenizer is not None:
        tokenizer(w)
    else:
        vocab = Tokenizer.from_str(byte_tokenizer_json()).get_vocab()
        tokens = sorted(vocab, key=vocab.get)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
        w.add_token_merges([])
        w.add_bos_token_id(vocab["<|im_start|>"])
        w.add_eos_token_id(vocab["<|im_end|>"])

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
                 "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm",
                 "self_attn.k_norm": "attn_k_norm", "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
    for i in range(c.num_hidden_layers):
        for ours, theirs in per_layer.items():
            names[f"model.layers.{i}.{ours}.weight"] = f"blk.{i}.{theirs}.weight"
            names[f"model.layers.{i}.{ours}.bias"] = f"blk.{i}.{theirs}.bias"
    for name, v in rope_vectors.items():
        w.add_tensor(name, v.astype(np.float32))
    expected, kinds = {}, iter(TYPE_CYCLE * 100)
    for key, value in hf.state_dict().items():
        x = value.float().numpy()
        if encode is not None and x.ndim == 2:
            q, kind = encode(key, x)
        else:
            kind = gguf.GGMLQuantizationType.F32 if x.ndim == 1 else getattr(gguf.GGMLQuantizationType, next(kinds))
            q = gguf.quants.quantize(x, kind)
        expected[key] = torch.from_numpy(np.asarray(gguf.quants.dequantize(q, kind), dtype=np.float32))
        if arch not in ("llama", "granite"):
            pass  # qwen2 / qwen3 / phi3: llama.cpp ropes halves (NEOX) and keeps the rows as they are
        elif key.endswith("q_proj.weight"):  # quantization is per row: permuting rows commutes with it
            q = llama_cpp_permute(q, c.num_attention_heads)
        elif key.endswith("k_proj.weight"):
            q = llama_cpp_permute(q, c.num_key_value_heads)
        w.add_tensor(names[key], q, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.mark.parametrize("family,overrides", [
    ("llama", dict(head_dim=24, num_key_value_heads=2)),
    ("granite", dict(head_dim=24, num_key_value_heads=1, embedding_multiplier=3.0,
                     attention_multiplier=0.07, residual_multiplier=0.4, logits_scaling=2.5)),
])
def test_tiny_gguf_every_tensor_type(tmp_path, family, overrides):
    from conftest import make_hf_model

    hf = make_hf_model(family, seed=9, rope_theta=20000.0, **overrides)
    expected = write_tiny_gguf(hf, tmp_path / "tiny.gguf")
    lm = load_model(str(tmp_path / "tiny.gguf"))
    assert lm.cfg.arch == family and lm.cfg.head_dim == 24
    assert lm.cfg.num_kv_heads == overrides["num_key_value_heads"]
    # every tensor exactly as the gguf package dequantizes it, rows back in HF order
    flint_name = hf_to_flint_names(lm.cfg.num_layers)
    int4 = 0
    for key, want in expected.items():
        got = lm.params[flint_name[key]]
        int4 += isinstance(got, Int4Weight)
        got = got.dequantize() if isinstance(got, Int4Weight) else got
        assert torch.equal(got.float(), want), f"{key}: flint's GGUF load differs from gguf's dequantize"
    assert int4 >= 4, "Q4_0 / Q4_1 tensors should stay int4 codes"
    # and the model runs like transformers' with those weights
    hf.load_state_dict(expected)
    ids = torch.arange(3, 23)
    got = Transformer(lm.cfg, lm.params, max_seq_len=32).forward(ids, 0)
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    diff = (got - want).abs().max().item()
    assert diff <= 1e-4 * max(1.0, want.abs().max().item()), f"tiny {family} GGUF: logits differ by {diff}"
    # the tokenizer comes from the GGUF metadata
    text = "héllo <|im_end|> 42"
    assert lm.tokenizer.decode(lm.tokenizer.encode(text), skip_special_tokens=False) == text
    assert lm.tokenizer.eos_token_ids == [lm.tokenizer.tk.token_to_id("<|im_end|>")]
