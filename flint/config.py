"""Model configuration: one dataclass for every supported family, built from HF config.json,
GGUF metadata or a named synthetic shape.

Supported HF model_type values: ``llama`` (SmolLM2 and friends), ``granite`` (GraniteForCausalLM,
with its four multipliers) and ``granitemoehybrid`` when every layer is attention with a dense MLP
(Granite-4.0-micro ships that way); mamba or MoE layers are refused with a clear error.
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
    arch: str  # "llama" | "granite" | "granitemoehybrid"
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
    if mt not in ("llama", "granite", "granitemoehybrid", "mistral"):
        arch = d.get("architectures")
        raise ConfigError(f"{source}: unsupported model_type {mt!r} (architectures={arch}); "
                          "flint runs llama, granite and all-attention dense granitemoehybrid")
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
    for key in ("rope_parameters", "rope_scaling"):  # transformers 5 / 4 spellings; check both
        r = d.get(key)
        rope_type = r.get("rope_type", r.get("type", "default")) if isinstance(r, dict) else "default"
        if rope_type not in ("default", None):
            raise ConfigError(f"{source}: field {key!r}: rope type {rope_type!r} is not supported")
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
    if mt == "mistral" and d.get("sliding_window"):
        raise ConfigError(f"{source}: field 'sliding_window' is not supported")
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
    )
    return cfg.validate(source, _HF_NAMES)


# config.json field -> the JSON kind it must hold (flint.checks.KINDS; null counts as absent):
# no coercion, so "false" is not false and "12" is not 12
HF_FIELD_KINDS = {
    **dict.fromkeys(("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                     "shared_intermediate_size"), "posint"),
    **dict.fromkeys(("num_local_experts", "sliding_window"), "uint"),
    **dict.fromkeys(("rms_norm_eps", "rope_theta", "embedding_multiplier", "attention_multiplier",
                     "residual_multiplier", "logits_scaling"), "number"),
    **dict.fromkeys(("tie_word_embeddings", "attention_bias", "mlp_bias"), "bool"),
    "bos_token_id": "uint", "eos_token_id": "ids",
    **dict.fromkeys(("model_type", "hidden_act", "_name_or_path", "position_embedding_type"), "str"),
    **dict.fromkeys(("architectures", "layer_types", "layers_block_type"), "strs"),
    **dict.fromkeys(("rope_scaling", "rope_parameters", "quantization_config"), "object"),
}

# ModelConfig attribute -> config.json field, for error messages
_HF_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
             "num_kv_heads": "num_key_value_heads"}


def load_hf_config(path: str | Path) -> ModelConfig:
    p = Path(path)
    return from_hf_dict(read_json(p, ConfigError), str(p))


# Named shapes for speed work without downloads (random weights; see flint.synthetic).
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
}
