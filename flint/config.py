"""Model configuration: one dataclass for every supported family, built from HF config.json,
GGUF metadata or a named synthetic shape.

Supported HF model_type values: ``llama`` (SmolLM2, Llama 3.x with its scaled RoPE), ``mistral``,
``qwen2`` (q/k/v biases), ``qwen3`` (per-head q/k RMSNorm), ``phi3`` (Phi-3 / 3.5 / 4-mini: fused
weights split at load, partial and LongRoPE), ``granite`` (GraniteForCausalLM, with its four
multipliers) and ``granitemoehybrid`` when every layer is attention with a dense MLP
(Granite-4.0-micro ships that way); mamba or MoE layers are refused with a clear error.
The RoPE variants flint computes (``rope_scaling``) and the features the GPU kernels do not run yet
(``kernel_features``) are described where they are defined; docs/loading.md has the whole table.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import FlintError
from .checks import PLAUSIBLE, check_types, plausible_range_error, read_json


MAX_CONTEXT = 2**31 - 1


class ConfigError(FlintError, ValueError):
    """A config file or field flint cannot run; the message names the file and field."""


@dataclass
class ModelConfig:
    arch: str  # "llama" | "granite" | "granitemoehybrid" | "qwen2" | "qwen3" | "phi3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    use_rope: bool = True
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    embedding_multiplier: float = 1.0
    attention_multiplier: float | None = None  # softmax scale; None -> 1/sqrt(head_dim)
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = ""
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2)
    qk_norm: bool = False  # an RMSNorm over each head of q and of k, before RoPE (Qwen3)
    rotary_dim: int | None = None  # RoPE on each head's first rotary_dim values only (Phi-4-mini); None: all
    rope_scaling: dict | None = None  # a scaled RoPE, normalized by parse_rope_scaling; None: plain RoPE
    sliding_window: int | None = None  # a query attends to the last sliding_window positions only

    @property
    def attn_scale(self) -> float:
        if self.attention_multiplier is not None:
            return float(self.attention_multiplier)
        return 1.0 / math.sqrt(self.head_dim)

    def validate(self, source: str = "config", names: dict | None = None) -> "ModelConfig":
        """Raise ConfigError for a value flint cannot run; ``names`` maps attributes to the
        source's own field names for the message."""
        def name(f):
            return (names or {}).get(f, f)

        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, f)
            if type(v) is not int or v <= 0:  # bool is an int to isinstance
                raise ConfigError(f"{source}: field {name(f)!r} must be a positive integer, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"{source}: {name('num_heads')}={self.num_heads} is not a multiple of "
                              f"{name('num_kv_heads')}={self.num_kv_heads}")
        if self.use_rope and self.head_dim % 2:
            raise ConfigError(f"{source}: {name('head_dim')}={self.head_dim} must be even for RoPE")
        if self.max_position_embeddings > MAX_CONTEXT:
            raise ConfigError(f"{source}: field {name('max_position_embeddings')!r}={self.max_position_embeddings} "
                              f"exceeds {MAX_CONTEXT} (positions are 32-bit)")
        # a NaN, infinite, zero or negative value here runs without error and yields garbage
        positive = ["rms_norm_eps", "embedding_multiplier", "residual_multiplier", "logits_scaling"]
        if self.use_rope:
            positive.append("rope_theta")
        if self.attention_multiplier is not None:
            positive.append("attention_multiplier")
        for f in positive:
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v < math.inf):
                raise ConfigError(f"{source}: field {name(f)!r} must be a finite number > 0, got {v!r}")
            if f in PLAUSIBLE and (why := plausible_range_error(f, v)):
                raise ConfigError(f"{source}: field {name(f)!r} {why}")
        ids = ([] if self.bos_token_id is None else [("bos_token_id", self.bos_token_id)]) + [
            ("eos_token_id", i) for i in self.eos_token_ids]
        for f, i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.vocab_size:
                raise ConfigError(f"{source}: field {name(f)!r}={i!r} is outside the vocabulary "
                                  f"(size {self.vocab_size})")
        check_features(self, source)
        return self

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "ModelConfig":
        return cls(**d).validate()

    def weight_count(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        per_layer = h * d * (2 * self.num_heads + 2 * self.num_kv_heads) + 3 * h * i
        return self.num_layers * per_layer + self.vocab_size * h


def _get(d: dict, source: str, *names, default=None, required=False):
    for n in names:
        if n in d and d[n] is not None:
            return d[n]
    if required:
        raise ConfigError(f"{source}: missing field {names[0]!r}")
    return default


def _eos_list(v) -> list[int]:
    if v is None:
        return []
    if isinstance(v, int):
        return [v]
    return [int(x) for x in v]


def from_hf_dict(d: dict, source: str = "config.json") -> ModelConfig:
    """Build a ModelConfig from a parsed HF config.json."""
    if not isinstance(d, dict):
        raise ConfigError(f"{source}: expected a JSON object, got {type(d).__name__}")
    check_types(d, HF_FIELD_KINDS, source, ConfigError)
    mt = d.get("model_type")
    if mt not in ("llama", "granite", "granitemoehybrid", "mistral", "qwen2", "qwen3", "phi3"):
        arch = d.get("architectures")
        raise ConfigError(f"{source}: unsupported model_type {mt!r} (architectures={arch}); "
                          "flint runs llama, mistral, qwen2, qwen3, phi3, granite and all-attention "
                          "dense granitemoehybrid")
    n_layers = _get(d, source, "num_hidden_layers", required=True)
    hidden = _get(d, source, "hidden_size", required=True)
    heads = _get(d, source, "num_attention_heads", required=True)
    kv = _get(d, source, "num_key_value_heads", default=heads)
    head_dim = _get(d, source, "head_dim", default=None) or (
        hidden // heads if type(hidden) is int and type(heads) is int and heads > 0 else 0)  # 0: validate refuses
    act = d.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConfigError(f"{source}: field 'hidden_act'={act!r} unsupported (flint runs SwiGLU/silu)")
    for f in ("attention_bias", "mlp_bias"):
        if d.get(f):
            raise ConfigError(f"{source}: field {f!r}=true is not supported")
    rotary_dim, rope_scaling = _hf_rope(d, source, head_dim)
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    for key in ("rope_parameters", "rope_scaling"):
        check_types(d.get(key) or {}, {"rope_theta": "number", "rope_type": "str", "type": "str"}, source,
                    ConfigError, prefix=f"{key}.")
    theta = d.get("rope_theta")
    if theta is None and isinstance(rope, dict):
        theta = rope.get("rope_theta")
    theta = float(theta if theta is not None else 10000.0)
    use_rope = True
    intermediate = _get(d, source, "intermediate_size", default=None)
    arch = "llama" if mt == "mistral" else mt
    sliding_window = _hf_sliding_window(d, source)
    if mt == "granitemoehybrid":
        types = d.get("layer_types") or d.get("layers_block_type")
        if not types:
            raise ConfigError(f"{source}: granitemoehybrid without 'layer_types'")
        # checkpoints say "attention"/"mamba"; transformers >= 5 saves "full_attention"/"linear_attention"
        bad = [i for i, t in enumerate(types) if t not in ("attention", "full_attention")]
        if bad:
            raise ConfigError(f"{source}: field 'layer_types' has non-attention (mamba) layers at "
                              f"{bad[:8]}; flint runs only all-attention granitemoehybrid checkpoints")
        if (d.get("num_local_experts") or 0) > 0:
            raise ConfigError(f"{source}: field 'num_local_experts'={d['num_local_experts']}: MoE "
                              "layers are not supported (dense shared_mlp only)")
        intermediate = _get(d, source, "shared_intermediate_size", required=True)
        use_rope = d.get("position_embedding_type") == "rope"
    if intermediate is None:
        raise ConfigError(f"{source}: missing field 'intermediate_size'")
    granite = mt in ("granite", "granitemoehybrid")
    cfg = ModelConfig(
        arch=arch,
        vocab_size=_get(d, source, "vocab_size", required=True),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        rms_norm_eps=float(_get(d, source, "rms_norm_eps", default=1e-6)),
        rope_theta=theta,
        use_rope=use_rope,
        max_position_embeddings=int(_get(d, source, "max_position_embeddings", default=2048)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        embedding_multiplier=float(d.get("embedding_multiplier", 1.0)) if granite else 1.0,
        # Granite's softmax scale; transformers' Granite configs default it to 1.0, not 1/sqrt(d)
        attention_multiplier=float(_get(d, source, "attention_multiplier", default=1.0)) if granite else None,
        residual_multiplier=float(d.get("residual_multiplier", 1.0)) if granite else 1.0,
        logits_scaling=float(d.get("logits_scaling", 1.0)) if granite else 1.0,
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=_eos_list(d.get("eos_token_id")),
        name=d.get("_name_or_path", ""),
        qkv_bias=mt == "qwen2",
        qk_norm=mt == "qwen3",
        rotary_dim=rotary_dim,
        rope_scaling=rope_scaling,
        sliding_window=sliding_window,
    )
    return cfg.validate(source, _HF_NAMES)


# config.json field -> the JSON kind it must hold (flint.checks.KINDS; null counts as absent):
# no coercion, so "false" is not false and "12" is not 12
HF_FIELD_KINDS = {
    **dict.fromkeys(("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                     "shared_intermediate_size"), "posint"),
    **dict.fromkeys(("num_local_experts", "sliding_window"), "uint"),
    "original_max_position_embeddings": "posint",
    **dict.fromkeys(("rms_norm_eps", "rope_theta", "embedding_multiplier", "attention_multiplier",
                     "residual_multiplier", "logits_scaling", "partial_rotary_factor"), "number"),
    **dict.fromkeys(("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window"), "bool"),
    "bos_token_id": "uint", "eos_token_id": "ids",
    **dict.fromkeys(("model_type", "hidden_act", "_name_or_path", "position_embedding_type"), "str"),
    **dict.fromkeys(("architectures", "layer_types", "layers_block_type"), "strs"),
    **dict.fromkeys(("rope_scaling", "rope_parameters", "quantization_config"), "object"),
}


# ------------------------------------------------------------------ features beyond the plain Llama layer

# rope_scaling["rope_type"] -> the fields each type needs (besides the type); flint computes them all in
# flint.model.rope_frequencies. "freq_factors" is flint's name for a GGUF file's rope_freqs tensor (one
# divisor per frequency: how llama.cpp stores Llama 3's scaling).
ROPE_TYPES = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings", "attention_factor"),
    "freq_factors": ("factors",),
}


def _hf_rope(d: dict, source: str, head_dim) -> tuple[int | None, dict | None]:
    """(rotary_dim, rope_scaling) from config.json: ``rope_parameters`` (transformers 5) or
    ``rope_scaling`` (4), either may name the type; ``partial_rotary_factor`` at the top level or in
    that object. A type flint does not compute is refused naming the field."""
    found, key = None, None
    for k in ("rope_parameters", "rope_scaling"):
        r = d.get(k)
        if r is None:
            continue
        if not isinstance(r, dict):
            raise ConfigError(f"{source}: field {k!r} must be an object, got {r!r}"[:300])
        t = r.get("rope_type", r.get("type", "default"))
        if d.get("model_type") == "phi3" and t in ("su", "yarn"):
            t = "longrope"  # Phi-3's early spellings of LongRoPE (transformers reads them so too)
        if t in ("default", None):
            continue
        qc = d.get("quantization_config")
        own = isinstance(qc, dict) and qc.get("quant_method") == "flint-int4-v1"
        if t not in ROPE_TYPES or t == "freq_factors" and not own:  # GGUF files and flint's own only
            raise ConfigError(f"{source}: field {k!r}: rope type {t!r} is not supported (flint computes "
                              "default, linear, llama3, yarn and longrope)")
        if found is not None and _scaling_fields(found) != _scaling_fields(dict(r, rope_type=t)):
            raise ConfigError(f"{source}: fields 'rope_parameters' and 'rope_scaling' describe different RoPE "
                              "scalings; keep one")
        found, key = dict(r, rope_type=t), k
    partial = d.get("partial_rotary_factor")
    for k in ("rope_parameters", "rope_scaling"):
        if partial is None and isinstance(d.get(k), dict):
            partial = d[k].get("partial_rotary_factor")
    rotary_dim = None
    if partial is not None and partial != 1.0:
        if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0 < partial < 1:
            raise ConfigError(f"{source}: field 'partial_rotary_factor'={partial!r} must be in (0, 1]")
        rotary_dim = int(head_dim * partial) if type(head_dim) is int else 0
    if found is None:
        return rotary_dim, None
    return rotary_dim, parse_rope_scaling(found, d, source, key)


def _scaling_fields(r: dict) -> dict:
    """A RoPE object's scaling fields: not the base or the rotary width, the type under one spelling."""
    return {f: v for f, v in r.items() if f not in ("rope_theta", "partial_rotary_factor", "type")}


def parse_rope_scaling(r: dict, d: dict, source: str, key: str) -> dict:
    """The normalized ``rope_scaling`` dict: the type and exactly ROPE_TYPES' fields, defaults filled
    in as transformers fills them (``d``: the rest of the config, for the top-level fallbacks)."""
    t = r["rope_type"]
    out = {"rope_type": t}
    max_pos = d.get("max_position_embeddings")
    orig = r.get("original_max_position_embeddings", d.get("original_max_position_embeddings"))
    if t in ("yarn", "longrope"):
        orig = orig if orig is not None else max_pos
    factor = r.get("factor")
    if t in ("yarn", "longrope") and factor is None and type(max_pos) is int and type(orig) is int and orig > 0:
        factor = max_pos / orig  # transformers' fallback for both
    if t == "yarn":
        out.update(factor=factor, original_max_position_embeddings=orig,
                   beta_fast=r.get("beta_fast") or 32.0, beta_slow=r.get("beta_slow") or 1.0,
                   truncate=r.get("truncate", True))
        att, ms, ms_all = r.get("attention_factor"), r.get("mscale"), r.get("mscale_all_dim")
        if att is None and _positive(factor):
            att = (_yarn_mscale(factor, ms) / _yarn_mscale(factor, ms_all) if ms and ms_all
                   else _yarn_mscale(factor, 1.0))
        out["attention_factor"] = att
    elif t == "longrope":
        att = r.get("attention_factor")
        if att is None and _positive(factor) and type(orig) is int and orig > 1:
            att = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
        out.update(short_factor=r.get("short_factor"), long_factor=r.get("long_factor"),
                   original_max_position_embeddings=orig, attention_factor=att)
    else:
        out.update({f: (orig if f == "original_max_position_embeddings" else r.get(f)) for f in ROPE_TYPES[t]})
    for f in ROPE_TYPES[t]:
        if out.get(f) is None:
            raise ConfigError(f"{source}: field {key!r}: rope type {t!r} needs {f!r}")
    return out


def _positive(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and 0 < v < math.inf


def _yarn_mscale(factor: float, m: float) -> float:
    """YaRN's attention temperature (the paper's eq. 21: 0.1 m ln(s) + 1, and 1 for s <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def _hf_sliding_window(d: dict, source: str) -> int | None:
    """The window every layer attends within (Mistral, Phi-3), or None. Qwen2 / Qwen3's per-layer
    windows (``use_sliding_window``; no released checkpoint sets it) are refused."""
    mt = d.get("model_type")
    if mt in ("qwen2", "qwen3"):
        types = d.get("layer_types") or []
        if d.get("use_sliding_window") or "sliding_attention" in types:
            raise ConfigError(f"{source}: field 'use_sliding_window' / 'layer_types': sliding-window layers "
                              f"are not supported for {mt}")
        return None
    if mt in ("mistral", "phi3"):
        w = d.get("sliding_window")
        if w is None:
            return None
        if type(w) is not int or w <= 0:
            raise ConfigError(f"{source}: field 'sliding_window'={w!r} must be a positive integer or null")
        return w
    return None


def check_features(cfg: ModelConfig, source: str) -> None:
    """The feature fields' values: a rotary width, a window and RoPE scaling parameters flint can run."""
    if cfg.rotary_dim is not None:
        r = cfg.rotary_dim
        if type(r) is not int or r <= 0 or r % 2 or r > cfg.head_dim:
            raise ConfigError(f"{source}: the rotary width {r!r} (field 'partial_rotary_factor' x head_dim) "
                              f"must be even and in 2..{cfg.head_dim}")
    w = cfg.sliding_window
    if w is not None and (type(w) is not int or w <= 0):
        raise ConfigError(f"{source}: field 'sliding_window'={w!r} must be a positive integer or null")
    s = cfg.rope_scaling
    if s is None:
        return
    where = f"{source}: field 'rope_scaling'"
    if not isinstance(s, dict) or s.get("rope_type") not in ROPE_TYPES:
        raise ConfigError(f"{where}: {s!r} is not a rope type flint computes ({', '.join(ROPE_TYPES)})"[:300])
    t = s["rope_type"]
    half = (cfg.rotary_dim or cfg.head_dim) // 2
    for f in ROPE_TYPES[t]:
        v = s.get(f)
        if f in ("short_factor", "long_factor", "factors"):
            if not isinstance(v, list) or len(v) != half or not all(_positive(x) for x in v):
                raise ConfigError(f"{where} ({t}): {f!r} must be {half} finite numbers > 0 (one per RoPE "
                                  f"frequency), got {v!r}"[:300])
        elif f == "original_max_position_embeddings":
            if type(v) is not int or v <= 1:
                raise ConfigError(f"{where} ({t}): {f!r}={v!r} must be an integer > 1")
        elif not _positive(v):
            raise ConfigError(f"{where} ({t}): {f!r}={v!r} must be a finite number > 0")
    if t == "llama3" and s["high_freq_factor"] <= s["low_freq_factor"]:
        raise ConfigError(f"{where} (llama3): 'high_freq_factor'={s['high_freq_factor']} must exceed "
                          f"'low_freq_factor'={s['low_freq_factor']}")


def kernel_features(cfg: ModelConfig, max_seq_len: int | None = None, backend: str = "megakernel") -> list[str]:
    """The features of ``cfg`` GPU backend ``backend`` (megakernel; compiled and compiled-bf16 run every one) does
    not implement yet, each named with its field; empty for a plain Llama / Granite layer. Scaled RoPE (llama3,
    linear, yarn, longrope) and partial RoPE are the RoPE tables every backend reads (flint.model.rope_tables). A
    sliding window counts only when the context ``max_seq_len`` is longer than it (within it, attention is the
    same)."""
    if backend != "megakernel":
        return []
    out = []
    if cfg.head_dim not in (64, 128):
        out.append(f"head_dim {cfg.head_dim} (the kernel's attention reads 64 or 128)")
    if cfg.qkv_bias:
        out.append("q/k/v projection biases (Qwen2)")
    if cfg.qk_norm:
        out.append("per-head q/k RMSNorm (Qwen3)")
    ctx = max_seq_len or cfg.max_position_embeddings
    if cfg.sliding_window is not None and ctx > cfg.sliding_window:
        out.append(f"sliding_window {cfg.sliding_window} below the context {ctx}")
    return out


# ModelConfig attribute -> config.json field, for error messages
_HF_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
             "num_kv_heads": "num_key_value_heads"}


def load_hf_config(path: str | Path) -> ModelConfig:
    p = Path(path)
    return from_hf_dict(read_json(p, ConfigError), str(p))


# Named shapes for speed work without downloads (random weights; see flint.synthetic).
LLAMA3_ROPE = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
LLAMA3_IDS = dict(max_position_embeddings=131072, bos_token_id=128000, eos_token_id=[128001, 128008, 128009])
SYNTHETIC = {
    "granite-4.1-3b": dict(
        model_type="granite", vocab_size=100352, hidden_size=2560, intermediate_size=8192,
        num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=8, head_dim=64,
        rms_norm_eps=1e-5, rope_theta=1e7, attention_multiplier=0.015625, embedding_multiplier=12.0,
        residual_multiplier=0.22, logits_scaling=10.0, tie_word_embeddings=True,
        max_position_embeddings=131072, bos_token_id=100257, eos_token_id=100257),
    "granite-3.3-8b": dict(  # (a vocabulary of 49159: not a multiple of 8)
        model_type="granite", vocab_size=49159, hidden_size=4096, intermediate_size=12800,
        num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope_theta=1e7, attention_multiplier=0.0078125, embedding_multiplier=12.0,
        residual_multiplier=0.22, logits_scaling=16.0, tie_word_embeddings=True,
        max_position_embeddings=131072, bos_token_id=0, eos_token_id=0),
    "llama-3.2-1b": dict(
        model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
        max_position_embeddings=131072, bos_token_id=128000, eos_token_id=128001),
    "llama-3-70b": dict(  # (Llama-3.x-70B's shapes; untied head)
        model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
        max_position_embeddings=131072, bos_token_id=128000, eos_token_id=128001),
    "smollm2-135m": dict(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
        max_position_embeddings=8192, bos_token_id=1, eos_token_id=2),
    # the families of docs/loading.md at their published shapes (each model's config.json); the GPU
    # backends refuse their features until the kernels implement them (kernel_features)
    "llama-3.1-8b": dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling=dict(LLAMA3_ROPE, factor=8.0), **LLAMA3_IDS),
    "llama-3.2-3b": dict(
        model_type="llama", vocab_size=128256, hidden_size=3072, intermediate_size=8192,
        num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
        rope_scaling=dict(LLAMA3_ROPE, factor=32.0), **LLAMA3_IDS),
    "qwen2.5-7b": dict(
        model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, rms_norm_eps=1e-6,
        rope_theta=1e6, tie_word_embeddings=False, max_position_embeddings=32768,
        bos_token_id=151643, eos_token_id=[151643, 151645]),
    "qwen3-8b": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False, max_position_embeddings=40960,
        bos_token_id=151643, eos_token_id=[151643, 151645]),
    "mistral-7b": dict(  # v0.3: no sliding window
        model_type="mistral", vocab_size=32768, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False, max_position_embeddings=32768,
        sliding_window=None, bos_token_id=1, eos_token_id=2),
    "phi-4-mini": dict(  # partial RoPE: 96 of head_dim 128 rotate; LongRoPE factors set to 1.0 and 4.0 as above
        model_type="phi3", vocab_size=200064, hidden_size=3072, intermediate_size=8192,
        num_hidden_layers=32, num_attention_heads=24, num_key_value_heads=8, rms_norm_eps=1e-5,
        rope_theta=10000.0, partial_rotary_factor=0.75, tie_word_embeddings=True, max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        rope_scaling=dict(rope_type="longrope", short_factor=[1.0] * 48, long_factor=[4.0] * 48),
        bos_token_id=199999, eos_token_id=[199999, 200020]),
    "phi-3.5-mini": dict(  # LongRoPE's 48 + 48 factors set to 1.0 and 4.0 here: the speed does not depend on them
        model_type="phi3", vocab_size=32064, hidden_size=3072, intermediate_size=8192,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        rope_scaling=dict(rope_type="longrope", short_factor=[1.0] * 48, long_factor=[4.0] * 48),
        bos_token_id=1, eos_token_id=[32000, 32007]),
}
