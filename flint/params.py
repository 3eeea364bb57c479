"""flint's params dict: the names and shapes it must have, and the LoadedModel that carries it.

``params`` maps flint names ("embed", "layers.{i}.wq", ..., "norm", "lm_head"; with the config's
features also "layers.{i}.bq" / "bk" / "bv" and "layers.{i}.q_norm" / "k_norm") to float tensors or
``flint.quant.int4.Int4Weight``; a tied head is the same object as "embed". ``expected_shapes(cfg)``
gives every name's shape, ``check_params`` raises ``LoadError`` for a missing, unexpected or
misshapen tensor, a dtype that does not suit it, or a layer count other than the layers present,
and ``LINEAR_NAMES`` are the per-layer linear weights (the ones quantized to int4).

The loaders (flint.loading), the synthetic models (flint.synthetic), the reference decoder
(flint.model) and the quantizer (flint.quant.int4) all build on this; it imports only flint.config.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .config import ModelConfig
from .errors import FlintError

LINEAR_NAMES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
FLOAT_DTYPES = ("torch.float32", "torch.float16", "torch.bfloat16")


class LoadError(FlintError, ValueError):
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
        if cfg.qkv_bias:
            shapes.update({p + "bq": (cfg.num_heads * d,), p + "bk": (cfg.num_kv_heads * d,),
                           p + "bv": (cfg.num_kv_heads * d,)})
        if cfg.qk_norm:
            shapes.update({p + "q_norm": (d,), p + "k_norm": (d,)})
    return shapes


def check_params(cfg: ModelConfig, params: dict, source: str, layers_field: str = "the config") -> None:
    """Every expected tensor present with its shape and a dtype that suits it, and nothing else:
    a layer count one short would otherwise drop the last layer silently."""
    import torch

    layers = {int(n.split(".")[1]) for n in params if re.fullmatch(r"layers\.\d+\..+", n)}
    if len(layers) != cfg.num_layers or (layers and max(layers) != cfg.num_layers - 1):
        # before expected_shapes: a layer count of 2^31 must fail without building its names
        extra = sorted(i for i in layers if i >= cfg.num_layers)
        got = f"tensors for layer {extra[0]}" if extra else f"tensors for {len(layers)} layers"
        raise LoadError(f"{source}: {layers_field} says {cfg.num_layers} layers, the checkpoint has {got}")
    want = expected_shapes(cfg)
    for name in params:
        if name not in want:
            raise LoadError(f"{source}: unexpected tensor {name!r}")
    for name, shape in want.items():
        if name not in params:
            raise LoadError(f"{source}: tensor {name!r} is missing")
        t = params[name]
        got = tuple(t.shape)
        if got != shape:
            raise LoadError(f"{source}: tensor {name!r} has shape {list(got)}, config implies {list(shape)}")
        if hasattr(t, "qweight"):  # flint.quant.int4.Int4Weight
            n, k = shape
            g = t.group_size
            groups = (n, k // g) if isinstance(g, int) and g > 0 and k % g == 0 else None
            if (t.qweight.dtype != torch.uint8 or groups is None
                    or any(x.dtype != torch.float16 or tuple(x.shape) != groups for x in (t.scales, t.mins))):
                raise LoadError(f"{source}: tensor {name!r}: int4 weight needs uint8 codes [N, K/2] and "
                                f"float16 scales and mins [N, K/G] (G={g!r}); got {t.qweight.dtype}, "
                                f"{t.scales.dtype} {list(t.scales.shape)}, {t.mins.dtype} {list(t.mins.shape)}")
        elif str(t.dtype) not in FLOAT_DTYPES:
            raise LoadError(f"{source}: tensor {name!r} has dtype {t.dtype}; a float weight needs one of "
                            "float32, float16, bfloat16")
