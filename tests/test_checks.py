"""The loaders' shared checks (flint/checks.py) on the cases that used to load wrong or escape as
another exception: side-file fields of the wrong JSON type, NaN / Infinity / deep nesting,
implausible hyperparameters, chat templates that do not compile or render, shard paths outside
the model directory, a layer index in two spellings, non-finite and mislabelled weights, NaN
logits at run time. Each must be a LoadError (or a TokenizerError / ValueError at run time) whose
message names the file and the field or tensor.

Run: ``pytest tests/test_checks.py`` (~15 s).
"""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from flint.checks import magnitude_problem, parse_json
from flint.loading import LoadError, load_model
from test_loader_fuzz import write_small_gguf, write_small_safetensors

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A small HF llama directory with the byte tokenizer and a ChatML template (read-only)."""
    d = tmp_path_factory.mktemp("checks") / "ckpt"
    write_small_safetensors(d, tokenizer=True)
    return d


@pytest.fixture
def ckpt(hf_dir, tmp_path) -> Path:
    return Path(shutil.copytree(hf_dir, tmp_path / "ckpt"))


def edit_json(path: Path, **fields) -> None:
    d = json.loads(path.read_text())
    d.update(fields)
    path.write_text(json.dumps(d))


def load_error(spec, *needles) -> str:
    with pytest.raises(LoadError) as info:
        load_model(str(spec))
    msg = str(info.value)
    for n in (str(spec), *needles):
        assert n in msg, f"{msg!r} lacks {n!r}"
    return msg


def test_the_target_loads(hf_dir):
    lm = load_model(str(hf_dir))
    assert lm.cfg.vocab_size == 259 and lm.tokenizer.encode_chat([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("field, value, needle", [
    ("tie_word_embeddings", "false", "true or false"),
    ("eos_token_id", "12", "non-negative integer"),
    ("eos_token_id", [2, 1.0], "non-negative integer"),
    ("rms_norm_eps", True, "finite number"),
    ("num_hidden_layers", 2.0, "positive integer"),
    ("bos_token_id", [1], "non-negative integer"),
    ("rms_norm_eps", 3e38, "plausible range"),
    ("rms_norm_eps", 1e300, "plausible range"),
    ("rope_theta", 1e-300, "plausible range"),
    ("rope_theta", 1e13, "plausible range"),
    ("hidden_act", 1, "a string"),
    ("rope_scaling", [1], "an object"),
    ("rope_parameters", {"rope_theta": True, "rope_type": "default"}, "rope_parameters.rope_theta"),
])
def test_config_field_of_the_wrong_type_or_range(ckpt, field, value, needle):
    edit_json(ckpt / "config.json", **{field: value})
    load_error(ckpt, "config.json", field, needle)


@pytest.mark.parametrize("text, needle", [
    ('{"model_type": "llama", "rope_theta": Infinity}', "Infinity"),
    ('{"model_type": "llama", "rope_theta": NaN}', "NaN"),
    ('{"model_type": "llama", "rope_theta": 1e400}', "beyond a float"),
    ('{"model_type": "llama", "model_type": "llama"}', "appears twice"),
    ("[" * 100_000 + "]" * 100_000, "nested deeper"),
    ('{"a": ' * 70 + "1" + "}" * 70, "nested deeper"),
])
def test_config_json_read_strictly(ckpt, text, needle):
    (ckpt / "config.json").write_text(text)
    load_error(ckpt, "config.json", needle)


def test_non_utf8_side_file_named(ckpt):
    (ckpt / "generation_config.json").write_bytes(b'{"eos_token_id": "\xff"}')
    load_error(ckpt, "generation_config.json", "UTF-8 at byte 18")


@pytest.mark.parametrize("body, needle", [
    ([1, 2], "JSON object"),
    ({"eos_token_id": "2"}, "eos_token_id"),
    ({"eos_token_id": None, "bos_token_id": True}, "bos_token_id"),
])
def test_generation_config_typed(ckpt, body, needle):
    (ckpt / "generation_config.json").write_text(json.dumps(body))
    load_error(ckpt, "generation_config.json", needle)


@pytest.mark.parametrize("fields, needle", [
    ({"chat_template": [1, 2]}, "chat_template"),
    ({"chat_template": 7}, "chat_template"),
    ({"bos_token": {"content": 5}}, "bos_token"),
    ({"add_bos_token": "yes"}, "add_bos_token"),
    ({"chat_template": "{% for m in messages %}{{ m.content }}"}, "chat_template"),  # no endfor
    ({"chat_template": "{{ 1 +* 2 }}"}, "line 1"),
])
def test_tokenizer_config_typed_and_template_compiled_at_load(ckpt, fields, needle):
    edit_json(ckpt / "tokenizer_config.json", **fields)
    load_error(ckpt, "tokenizer_config.json", needle)


def test_generation_tag_renders_its_body(ckpt):
    """transformers' {% generation %} block renders as its body."""
    tmpl = ("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}A:{{ m.content }}"
            "{% endgeneration %}{% else %}U:{{ m.content }}{% endif %}{% endfor %}")
    edit_json(ckpt / "tokenizer_config.json", chat_template=tmpl)
    tok = load_model(str(ckpt)).tokenizer
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    assert tok.apply_chat_template(msgs) == "U:xA:y"


@pytest.mark.parametrize("tmpl, needle", [
    ("{{ messages[5].content }}", "cannot render"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{{ nothing.attribute }}", "UndefinedError"),
    ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
    ("{% for i in range(99999) %}{% for j in range(99999) %}xxxxxxxxxxxxxxxx{% endfor %}{% endfor %}", "exceeds"),
])
def test_render_errors_are_tokenizer_errors(ckpt, tmpl, needle):
    from flint.tokenizer import TokenizerError

    edit_json(ckpt / "tokenizer_config.json", chat_template=tmpl)
    tok = load_model(str(ckpt)).tokenizer
    with pytest.raises(TokenizerError, match="chat template") as info:
        tok.encode_chat([{"role": "user", "content": "hi"}])
    assert needle in str(info.value)


def _index(ckpt: Path, entry) -> None:
    from safetensors import safe_open

    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        wm = {k: "model.safetensors" for k in f.keys()}
    wm["model.norm.weight"] = entry
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))


@pytest.mark.parametrize("entry", [None, ["model.safetensors"], "../ckpt/model.safetensors", "/etc/hostname",
                                   "sub/model.safetensors", ".."])
def test_shard_names_confined_to_the_directory(ckpt, entry):
    _index(ckpt, entry)
    load_error(ckpt, "model.safetensors.index.json", "weight_map", "model.norm.weight")


def _retensor(ckpt: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    t = load_file(str(ckpt / "model.safetensors"))
    change(t)
    save_file(t, str(ckpt / "model.safetensors"))


@pytest.mark.parametrize("alias", ["model.layers.01.mlp.up_proj.weight", "model.layers.\u0661.mlp.up_proj.weight"])
def test_layer_index_in_canonical_form_only(ckpt, alias):
    _retensor(ckpt, lambda t: t.update({alias: t["model.layers.1.mlp.up_proj.weight"].clone()}))
    load_error(ckpt, alias)


def test_two_sources_for_one_tensor_refused(ckpt):
    _retensor(ckpt, lambda t: t.update({"model.layers.0.shared_mlp.output_linear.weight":
                                        t["model.layers.0.mlp.down_proj.weight"].clone()}))
    load_error(ckpt, "model.layers.0.mlp.down_proj.weight", "model.layers.0.shared_mlp.output_linear.weight",
               "layers.0.w_down")


@pytest.mark.parametrize("extra", ["embed.weight", "layers.0.wq"])
def test_flint_int4_checkpoint_with_two_sources_refused(hf_dir, tmp_path, extra):
    """A flint checkpoint with a float tensor beside the int4 one of the same flint name (or
    "embed.weight" beside "embed"): refused, not the later one silently kept."""
    from flint.quant.quantize import quantize_checkpoint
    from test_quantize_safety import TINY

    (tmp_path / "tiny.json").write_text(json.dumps(TINY))
    out = quantize_checkpoint(f"synthetic:{tmp_path / 'tiny.json'}", tmp_path / "q", 32, log=lambda *a, **k: None)
    _retensor(out, lambda t: t.update({extra: torch.zeros(TINY["hidden_size"], TINY["hidden_size"])}))
    load_error(out, "both flint's")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weight_named(ckpt, value):
    def change(t):
        t["model.layers.1.self_attn.o_proj.weight"][3, 5] = value
    _retensor(ckpt, change)
    load_error(ckpt, "model.layers.1.self_attn.o_proj.weight", "NaN or infinite", "[3, 5]")


@pytest.mark.parametrize("stored, label", [("F16", "BF16"), ("BF16", "F16")])
def test_half_precision_mislabel_detected(ckpt, stored, label):
    """Weights saved in one half-precision type with the header saying the other."""
    dt = {"F16": torch.float16, "BF16": torch.bfloat16}[stored]
    _retensor(ckpt, lambda t: t.update({k: v.to(dt) for k, v in t.items()}))
    raw = (ckpt / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    hdr = raw[8:8 + n].replace(f'"dtype":"{stored}"'.encode(), f'"dtype":"{label}"'.encode())
    assert hdr != raw[8:8 + n]
    (ckpt / "model.safetensors").write_bytes(struct.pack("<Q", len(hdr)) + hdr + raw[8 + n:])
    load_error(ckpt, "model.safetensors", "likely wrong")


def test_magnitudes_of_real_and_mislabelled_tensors():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 256, generator=g) * 0.02
    assert magnitude_problem(w) is None and magnitude_problem(w.to(torch.bfloat16)) is None
    as_f16 = w.to(torch.bfloat16).view(torch.float16)
    as_bf16 = w.to(torch.float16).view(torch.bfloat16)
    assert "bfloat16 bytes read as float16" in magnitude_problem(as_f16)
    assert "float16 bytes read as bfloat16" in magnitude_problem(as_bf16)
    random_scales = torch.from_numpy(np.random.default_rng(0).integers(0, 0x7BFF, (64, 64), dtype=np.int16)).view(
        torch.float16)
    assert "decades" in magnitude_problem(random_scales)


@pytest.mark.parametrize("seed", range(3))
def test_q4_k_and_q4_0_swapped_caught(seed):
    """Q4_K and Q4_0 take the same bytes a value (144 per 256): either read as the other gives
    scales from code bytes, NaN or absurdly spread, and check_weight refuses the tensor."""
    import gguf

    from flint.checks import check_weight
    from flint.quant.int4 import dequant_q4_k_blocks, from_q4_0_blocks, from_q4_k_blocks
    from test_kquants import kquant_blocks

    qt = gguf.GGMLQuantizationType
    rng = np.random.default_rng(seed)
    n, k = 64, 512
    q4k = kquant_blocks(qt.Q4_K, n, k, rng).reshape(-1)
    q40 = gguf.quants.quantize((rng.standard_normal((n, k)) * 0.02).astype(np.float32), qt.Q4_0).reshape(-1)
    with np.errstate(all="ignore"):
        as_q40 = from_q4_0_blocks(q4k, n, k)
        as_q4k = from_q4_k_blocks(q40.view(np.uint8), n, k) or dequant_q4_k_blocks(q40.view(np.uint8), n, k)
    for w in (as_q40, as_q4k):
        with pytest.raises(ValueError, match="tensor 't'.*(NaN or infinite|decades)"):
            check_weight("t", w, "f")
    check_weight("t", from_q4_0_blocks(q40.view(np.uint8), n, k), "f")  # read as itself: fine


def test_parse_json_refuses_before_recursing():
    with pytest.raises(ValueError, match="nested deeper"):
        parse_json(b"[" * 10_000_000, "x.json")


# ------------------------------------------------------------------ GGUF

def test_gguf_layer_index_spelled_twice(tmp_path):
    def edit(name, x, kind):
        extra = [(name.replace("blk.1.", "blk.01."), x, kind)] if name == "blk.1.attn_q.weight" else []
        return [(name, x, kind)] + extra
    p = tmp_path / "m.gguf"
    write_small_gguf(p, edit=edit)
    load_error(p, "blk.01.attn_q.weight")


def test_gguf_nan_weight_named(tmp_path):
    import gguf

    def edit(name, x, kind):
        if name == "blk.0.ffn_up.weight":
            x = x.copy()
            x[1, 7] = np.nan
            kind = gguf.GGMLQuantizationType.F32
        return [(name, x, kind)]
    p = tmp_path / "m.gguf"
    write_small_gguf(p, edit=edit)
    load_error(p, "blk.0.ffn_up.weight", "NaN or infinite")


def test_gguf_nan_scale_named(tmp_path):
    """A Q8_0 block whose fp16 scale is NaN: every value of its block is NaN."""
    import gguf

    def edit(name, x, kind):
        return [(name, x, gguf.GGMLQuantizationType.Q8_0 if name == "blk.1.attn_v.weight" else kind)]
    p = tmp_path / "m.gguf"
    write_small_gguf(p, edit=edit)
    from flint import gguf_file

    t = next(t for t in gguf_file.read(p).tensors if t.name == "blk.1.attn_v.weight")
    raw = bytearray(p.read_bytes())
    off = raw.find(bytes(t.data[:34]))  # the first block: its fp16 scale, then 32 int8 codes
    raw[off:off + 2] = struct.pack("<e", float("nan"))
    p.write_bytes(bytes(raw))
    load_error(p, "blk.1.attn_v.weight", "NaN or infinite")


# ------------------------------------------------------------------ run time

def test_nan_logits_are_a_clear_error(hf_dir):
    from flint.engine import NonFiniteLogits, SamplingParams, sample

    logits = torch.zeros(10)
    logits[3] = float("nan")
    for t in (0.0, 0.7):
        with pytest.raises(NonFiniteLogits, match="NaN"):
            sample(logits, SamplingParams(temperature=t), torch.Generator().manual_seed(0))
