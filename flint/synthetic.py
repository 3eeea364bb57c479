"""Synthetic models: real shapes, random weights, no download. For speed work and tests.

``synthetic_model("granite-4.1-3b")`` (a name in flint.config.SYNTHETIC) or
``synthetic_model("path/to/config.json")`` returns a LoadedModel with tokenizer None. Weights are
random but never zero and scaled like a trained model's (linears ~ N(0, 0.02), norms ~ 1), so
logits are not degenerate. Speed does not depend on the values, so big shapes are made cheaply:

* float: generated directly in ``dtype`` (bf16 by default) on ``device``;
* ``int4_group_size=G``: every linear weight and the LM head are random flint-int4-v1 codes with
  random fp16 scales (G, or the largest group size dividing K where G does not: 64 for K = 576) (no fp32 intermediate: Granite-3B int4 is 1.8 GB, not 13 GB of fp32). A tied
  embedding is then the head's own dequantized values, so the lookup and the head agree.

CLI: ``--model synthetic:NAME`` everywhere a model is taken. `flint serve` gives it ``synthetic_tokenizer``, a
byte-level tokenizer of its vocabulary size, so a synthetic shape can be served and `flint bench --serve` can time it
(its text is noise: random weights). Test: ``pytest tests/test_compiled.py``.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .config import SYNTHETIC, ConfigError, ModelConfig, from_hf_dict, load_hf_config
from .params import LoadedModel, LoadError, expected_shapes
from .quant.int4 import Int4Weight, check_shape, fit_group_size

WEIGHT_STD = 0.02
# uniform codes 0..15 have std sqrt((16^2 - 1) / 12) = 4.61 steps: scale = std / 4.61
_CODE_STD = 4.61


def synthetic_config(name_or_path: str) -> ModelConfig:
    """The ModelConfig for a SYNTHETIC name or an HF config.json path."""
    if name_or_path in SYNTHETIC:
        cfg = from_hf_dict(dict(SYNTHETIC[name_or_path]), f"synthetic:{name_or_path}")
    elif name_or_path.endswith(".json") or Path(name_or_path).is_file():
        try:
            cfg = load_hf_config(name_or_path)
        except ConfigError as e:
            raise LoadError(str(e)) from None
    else:
        raise LoadError(f"synthetic:{name_or_path}: unknown synthetic model; choose one of "
                        f"{', '.join(sorted(SYNTHETIC))} or give a config.json path")
    cfg.name = f"synthetic:{name_or_path}"
    return cfg


def random_int4(n: int, k: int, group_size: int, gen: torch.Generator, device,
                std: float = WEIGHT_STD, name: str = "weight") -> Int4Weight:
    """Random flint-int4-v1 weight: uniform codes, scales ~ std / 4.61 (x e^N(0, 0.1)), centred
    mins, so values have roughly the given std and mean 0. The group size is ``group_size`` or,
    where that does not divide K, the largest one that does (flint.quant.int4.fit_group_size)."""
    group_size = fit_group_size(k, group_size, name)
    check_shape(name, n, k, group_size)
    qweight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen, device=device)
    jitter = torch.randn((n, k // group_size), generator=gen, device=device).mul_(0.1).exp_()
    scales = (jitter * (std / _CODE_STD)).to(torch.float16)
    mins = (scales.float() * -7.5).to(torch.float16)
    return Int4Weight(qweight, scales, mins, group_size)


def synthetic_params(cfg: ModelConfig, seed: int = 0, int4_group_size: int | None = None,
                     dtype=torch.bfloat16, device="cpu", store=None) -> dict:
    """The random weights, generated on ``device``; ``store``: where each tensor is kept once made (a model larger
    than the device's memory can take twice is generated on the GPU and parked in host memory, and a backend
    moves it layer by layer)."""
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    params = {}
    for name, shape in expected_shapes(cfg).items():
        if name == "embed" or (name == "lm_head" and cfg.tie_word_embeddings):
            continue
        if name.endswith((".bq", ".bk", ".bv")):  # biases ~ N(0, 0.02) like the weights
            params[name] = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).mul_(0.02).to(dtype)
        elif len(shape) == 1:  # RMSNorm weights ~ 1
            w = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).mul_(0.1).add_(1.0)
            params[name] = w.to(dtype)
        elif int4_group_size:
            params[name] = random_int4(*shape, int4_group_size, gen, device, name=name)
        else:
            params[name] = torch.randn(shape, generator=gen, device=device, dtype=dtype).mul_(WEIGHT_STD)
        if store is not None:
            params[name] = params[name].to(store)
    v, h = cfg.vocab_size, cfg.hidden_size
    if cfg.tie_word_embeddings and int4_group_size:
        head = random_int4(v, h, int4_group_size, gen, device, name="lm_head")
        params["lm_head"] = head
        # the lookup copy holds exactly the head's values (in dtype), row block by row block
        embed = torch.empty((v, h), dtype=dtype, device=device)
        step = 8192
        for r in range(0, v, step):
            embed[r: r + step] = head.rows(slice(r, r + step)).dequantize(dtype)
        params["embed"] = embed
    else:
        params["embed"] = torch.randn((v, h), generator=gen, device=device, dtype=dtype).mul_(WEIGHT_STD)
        if cfg.tie_word_embeddings:
            params["lm_head"] = params["embed"]
    if store is not None:
        tied = params.get("lm_head") is params["embed"]
        params["embed"] = params["embed"].to(store)
        params["lm_head"] = params["embed"] if tied else params["lm_head"].to(store)
    return params


def synthetic_bytes(cfg: ModelConfig, int4_group_size: int | None, dtype=torch.bfloat16) -> int:
    """The bytes synthetic_params makes for ``cfg`` (int4 codes with fp16 scale and min a group, or ``dtype``)."""
    size = torch.finfo(dtype).bits // 8
    total = 0
    for name, shape in expected_shapes(cfg).items():
        if name == "lm_head" and cfg.tie_word_embeddings and not int4_group_size:
            continue  # the embedding itself
        n = 1
        for x in shape:
            n *= x
        if int4_group_size and len(shape) == 2 and name != "embed":
            total += n // 2 + 4 * n // fit_group_size(shape[1], int4_group_size, name)
        else:
            total += n * size
    return total


SYNTHETIC_SPECIALS = ("<|im_start|>", "<|im_end|>")
SYNTHETIC_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                      "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def synthetic_tokenizer(cfg: ModelConfig):
    """A tokenizer of ``cfg.vocab_size`` ids for a synthetic model: the 256 bytes (byte-level, no merges: text
    encodes byte by byte), the ChatML markers as special tokens, then one filler word a remaining id (" w<id>"), so
    every id the random model emits decodes; the end-of-sequence ids are the config's (else <|im_end|>)."""
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    from .tokenizer import Tokenizer

    nspec = len(SYNTHETIC_SPECIALS)
    if cfg.vocab_size < 256 + nspec:
        raise LoadError(f"{cfg.name}: vocab_size {cfg.vocab_size} is below the synthetic tokenizer's "
                        f"{256 + nspec} (the bytes and the chat markers)")
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab.update({t: 256 + i for i, t in enumerate(SYNTHETIC_SPECIALS)})
    vocab.update({f"\u0120w{i}": i for i in range(256 + nspec, cfg.vocab_size)})  # (U+0120: byte-level's space)
    tk = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SYNTHETIC_SPECIALS])
    eos_ids = [i for i in cfg.eos_token_ids if i < cfg.vocab_size] or [256 + 1]
    tok = Tokenizer(tk, SYNTHETIC_TEMPLATE, None, tk.id_to_token(eos_ids[0]), eos_ids)
    tok.compile_template("synthetic chat template")
    return tok


def synthetic_model(name_or_path: str, seed: int = 0, int4_group_size: int | None = None,
                    dtype=torch.bfloat16, device="cpu", store=None, tokenizer: bool = False) -> LoadedModel:
    """A LoadedModel with random weights (see module docstring); with ``tokenizer`` the synthetic_tokenizer of its
    vocabulary, else None. ``store``: see synthetic_params."""
    cfg = synthetic_config(name_or_path)
    params = synthetic_params(cfg, seed, int4_group_size, dtype, device, store)
    return LoadedModel(cfg, params, synthetic_tokenizer(cfg) if tokenizer else None, cfg.name)
