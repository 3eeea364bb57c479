"""flint's params dict: the names and shapes it must have, and the LoadedModel that carries it.

``params`` maps flint names ("embed", "layers.{i}.wq", ..., "norm", "lm_head") to float tensors or
``flint.quant.Int4Weight``; a tied head is the same object as "embed". ``expected_shapes(cfg)``
gives every name's shape, ``check_params`` raises ``LoadError`` for a missing or misshapen tensor,
and ``LINEAR_NAMES`` are the per-layer linear weights (the ones quantized to int4).

The loaders (flint.loading), the synthetic models (flint.synthetic), the reference decoder
(flint.model) and the quantizer (flint.quant) all build on this; it imports only flint.config.
"""
from __future__ import annotations

from dataclasses import dataclass

from .config import ModelConfig

LINEAR_NAMES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


class LoadError(ValueError):
    """A checkpoint flint cannot load; the message names the file and the tensor or field."""


@dataclass
class LoadedModel:
    cfg: ModelConfig
    params: dict
    tokenizer: object | None  # flint.tokenizer.Tokenizer
    source: str


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes = {"embed": (cfg.vocab_size, h), "norm": (h,), "lm_head": (cfg.vocab_size, h)}
    for li in range(cfg.num_layers):
        p = f"layers.{li}."
        shapes.update({
            p + "attn_norm": (h,), p + "ffn_norm": (h,),
            p + "wq": (cfg.num_heads * d, h), p + "wk": (cfg.num_kv_heads * d, h),
            p + "wv": (cfg.num_kv_heads * d, h), p + "wo": (h, cfg.num_heads * d),
            p + "w_gate": (i, h), p + "w_up": (i, h), p + "w_down": (h, i),
        })
    return shapes


def check_params(cfg: ModelConfig, params: dict, source: str) -> None:
    want = expected_shapes(cfg)
    for name, shape in want.items():
        if name not in params:
            raise LoadError(f"{source}: tensor {name!r} is missing")
        t = params[name]
        got = tuple(t.shape)
        if got != shape:
            raise LoadError(f"{source}: tensor {name!r} has shape {list(got)}, config implies {list(shape)}")
