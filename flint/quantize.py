"""`flint quantize MODEL OUT`: write a flint int4 checkpoint that `--model OUT` loads directly.

A 3B model is quantized once, then loads in seconds. OUT holds:

* ``model.safetensors``: every linear weight and the LM head as ``<name>.qweight`` (uint8),
  ``<name>.scales`` and ``<name>.mins`` (fp16) in the flint-int4-v1 layout (flint/quant.py), and
  the float tensors under their flint names ("embed", "norm", "layers.{i}.attn_norm", ...).
  "embed" is the embedding lookup's own copy and keeps the source's float dtype (fp32 for a GGUF
  source, whose Q8_0 embedding dequantizes exactly only in fp32; bf16 for a bf16 checkpoint): the
  lookup reads one row per token, so an exact copy costs nothing at decode time. The head of a
  tied model is a separate int4 tensor quantized from that embedding.
* ``config.json`` in HF form (model_type llama / granite / granitemoehybrid) with
  ``"quantization_config": {"quant_method": "flint-int4-v1", "group_size": G}``; for an HF source
  it is the source's own config.json plus that field.
* ``generation_config.json`` (bos / eos ids) and the tokenizer: copied from an HF source, written
  from the loaded tokenizer otherwise (tokenizer.json + tokenizer_config.json with the chat
  template and the bos / eos tokens).

Group size: int4 weights already in the source (GGUF Q4_0 / Q4_1 at G = 32) are kept as they are
when G matches and re-fitted (a second rounding, printed) when it does not; float weights are
quantized round-to-nearest. The default G is the source's int4 group size, else 128, or the largest
smaller one that divides every K (64 for SmolLM2's K = 576). A G that does not divide some K is an
error naming the tensor. Test: ``pytest tests/test_quant.py -k checkpoint``.

Writing: the checkpoint is written into a hidden folder next to OUT and renamed to OUT at the end,
so an interrupted or failed run leaves nothing under OUT (the partial folder is removed). A
non-empty OUT is refused before any work unless --force, which swaps the new folder in for the
old one, so no file of the old checkpoint (a stale shard index) survives next to the new one.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
from pathlib import Path

import torch

from .config import ModelConfig
from .loading import QUANT_METHOD, LoadedModel, load_model
from .params import LINEAR_NAMES
from .quant import GROUP_SIZES, Int4Weight, check_shape, int4_group_size, quantize_int4

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")


class QuantizeError(ValueError):
    pass


def _int4_targets(params: dict) -> list[str]:
    return [k for k in params if k.rsplit(".", 1)[-1] in LINEAR_NAMES] + ["lm_head"]


def default_group_size(params: dict) -> int:
    """The source's int4 group size if it has int4 weights, else the largest of 128/64/32 that
    divides the K of every weight to quantize."""
    try:
        g = int4_group_size(params)
    except ValueError as e:
        raise QuantizeError(f"the source's {e}; pass --group-size") from None
    if g:
        return g
    ks = {params[k].shape[1] for k in _int4_targets(params)}
    for g in sorted(GROUP_SIZES, reverse=True):
        if all(k % g == 0 for k in ks):
            return g
    raise QuantizeError(f"no group size in {GROUP_SIZES} divides every in_features K {sorted(ks)}")


def quantize_for_checkpoint(params: dict, group_size: int, float_head: bool = False,
                            log=print) -> dict:
    """params with every linear weight (and, unless float_head, the LM head) as Int4Weight at
    exactly ``group_size``. Raises QuantizeError naming a tensor whose K it does not divide."""
    if group_size not in GROUP_SIZES:
        raise QuantizeError(f"--group-size {group_size} is not one of {', '.join(map(str, GROUP_SIZES))}")
    out = dict(params)
    targets = _int4_targets(params)
    if float_head:
        targets.remove("lm_head")
    refit = []
    for name in targets:
        w = params[name]
        n, k = w.shape
        try:
            check_shape(name, n, k, group_size)
        except ValueError as e:
            raise QuantizeError(f"{e}; choose a --group-size that divides it") from None
        if isinstance(w, Int4Weight):
            if w.group_size == group_size:
                continue
            refit.append(name)
            w = w.dequantize(torch.float32)
        out[name] = quantize_int4(w, group_size, name=name)
    if float_head and isinstance(params["lm_head"], Int4Weight):
        out["lm_head"] = params["lm_head"].dequantize(torch.float32)
    if refit:
        log(f"flint quantize: {len(refit)} int4 tensors re-fitted from group size "
            f"{params[refit[0]].group_size} to {group_size} (a second rounding)", file=sys.stderr)
    return out


def hf_config_dict(cfg: ModelConfig) -> dict:
    """An HF-style config.json dict that flint.config.from_hf_dict maps back to ``cfg``."""
    d = {
        "model_type": cfg.arch,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids) if len(cfg.eos_token_ids) != 1 else cfg.eos_token_ids[0],
        "_name_or_path": cfg.name,
    }
    arch_names = {"llama": "LlamaForCausalLM", "granite": "GraniteForCausalLM",
                  "granitemoehybrid": "GraniteMoeHybridForCausalLM"}
    d["architectures"] = [arch_names[cfg.arch]]
    if cfg.arch in ("granite", "granitemoehybrid"):
        d.update(embedding_multiplier=cfg.embedding_multiplier, residual_multiplier=cfg.residual_multiplier,
                 logits_scaling=cfg.logits_scaling)
        if cfg.attention_multiplier is not None:
            d["attention_multiplier"] = cfg.attention_multiplier
    if cfg.arch == "granitemoehybrid":
        d.update(layer_types=["attention"] * cfg.num_layers, shared_intermediate_size=cfg.intermediate_size,
                 num_local_experts=0, position_embedding_type="rope" if cfg.use_rope else "nope")
    return d


def _write_tokenizer(lm: LoadedModel, out: Path) -> None:
    src = Path(lm.source)
    if src.is_dir() and (src / "tokenizer.json").exists():
        for f in TOKENIZER_FILES:
            if (src / f).exists():
                shutil.copyfile(src / f, out / f)
        return
    tok = lm.tokenizer
    if tok is None:
        return  # a synthetic model: no tokenizer to write
    tok.tk.save(str(out / "tokenizer.json"))
    tc = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": bool(tok.add_bos),
          "bos_token": tok.bos_token, "eos_token": tok.eos_token}
    if tok.chat_template:
        tc["chat_template"] = tok.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")


def save_checkpoint(lm: LoadedModel, params: dict, group_size: int, out: str | Path) -> Path:
    """Write ``params`` (already quantized) with lm's config and tokenizer to directory ``out``."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = lm.cfg
    tensors = {}
    tied_float_head = params["lm_head"] is params["embed"]
    for name, w in params.items():
        if name == "lm_head" and tied_float_head:
            continue  # the loader ties it back to "embed"
        if isinstance(w, Int4Weight):
            tensors[name + ".qweight"] = w.qweight.contiguous().cpu()
            tensors[name + ".scales"] = w.scales.contiguous().cpu()
            tensors[name + ".mins"] = w.mins.contiguous().cpu()
        else:
            tensors[name] = w.detach().contiguous().cpu()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "layout": QUANT_METHOD})

    src = Path(lm.source)
    if src.is_dir() and (src / "config.json").exists():
        cfg_json = json.loads((src / "config.json").read_text())
    else:
        cfg_json = hf_config_dict(cfg)
    cfg_json["quantization_config"] = {"quant_method": QUANT_METHOD, "group_size": group_size}
    cfg_json["tie_word_embeddings"] = cfg.tie_word_embeddings
    (out / "config.json").write_text(json.dumps(cfg_json, indent=2) + "\n")
    gen = {"bos_token_id": cfg.bos_token_id,
           "eos_token_id": cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else list(cfg.eos_token_ids)}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    _write_tokenizer(lm, out)
    return out


def check_out_dir(model: str | None, out: Path, force: bool = False) -> None:
    """Refuse an OUT that quantizing ``model`` into must not touch; runs before any work."""
    if out.exists() and not out.is_dir():
        raise QuantizeError(f"{out}: exists and is not a directory")
    parent = next(p for p in out.absolute().parents if p.exists())
    if not parent.is_dir():
        raise QuantizeError(f"{out}: {parent} is not a directory")
    if not os.access(parent, os.W_OK):  # the checkpoint is written next to OUT, then renamed
        raise QuantizeError(f"{out}: {parent} is not writable")
    if not out.is_dir():
        return
    resolved = out.resolve()
    for label, precious in (("the current directory", Path.cwd()), ("your home directory", Path.home())):
        if resolved == precious or resolved in precious.parents:  # a swap would delete it
            raise QuantizeError(f"{out}: is or holds {label} ({precious}); choose another OUT directory")
    if model and Path(model).exists():
        src = Path(model).resolve()
        if src == resolved or resolved in src.parents:
            raise QuantizeError(f"{out}: holds the source model; choose another OUT directory")
    if not any(out.iterdir()):
        return
    if not force:
        raise QuantizeError(f"{out}: is not empty; choose an empty or new OUT directory, "
                            "or pass --force to replace its contents")


def _sibling(out: Path, tag: str) -> Path:
    """A fresh hidden path next to ``out`` (same filesystem, so renames are atomic)."""
    return out.parent / f".{out.name}.{tag}-{os.getpid()}-{secrets.token_hex(4)}"


def write_dir_atomically(out: Path, write) -> Path:
    """Call ``write(tmp)`` on a new folder next to ``out``, then put it in place of ``out``
    (an existing ``out`` is swapped out and deleted). On any failure, Ctrl-C included, the
    partial folder is removed and ``out`` is left as it was."""
    out = Path(os.path.abspath(out))  # "x/.." has no usable .name to put a sibling next to
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(out, "partial")
    tmp.mkdir()
    try:
        write(tmp)
        if out.exists():
            old = _sibling(out, "old")
            os.rename(out, old)
            try:
                os.rename(tmp, out)
            except BaseException:
                os.rename(old, out)
                raise
            if old.is_symlink():  # OUT was a link: drop the link, not what it pointed to
                old.unlink()
            else:
                shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def quantize_checkpoint(model: str | None, out: str | Path, group_size: int | None = None,
                        float_head: bool = False, log=print, force: bool = False) -> Path:
    """Load ``model`` (any load_model spec), quantize it and write it to ``out``; a non-empty
    ``out`` is refused unless ``force`` (then replaced as a whole)."""
    out = Path(out)
    check_out_dir(model, out, force)
    lm = load_model(model)
    g = group_size or default_group_size(lm.params)
    params = quantize_for_checkpoint(lm.params, g, float_head, log)
    write_dir_atomically(out, lambda tmp: save_checkpoint(lm, params, g, tmp))
    n4 = sum(w.nbytes for w in params.values() if isinstance(w, Int4Weight))
    log(f"flint quantize: wrote {out} (group size {g}, int4 weights {n4 / 1e6:.1f} MB)", file=sys.stderr)
    return out


def _run(args) -> int:
    quantize_checkpoint(args.model, args.out, args.group_size, args.float_head, force=args.force)
    return 0


def register(sub) -> None:
    p = sub.add_parser("quantize", help="write a flint int4 checkpoint (safetensors + config + tokenizer)",
                       description="Quantize MODEL's linear weights and LM head to flint-int4-v1 and write "
                                   "a checkpoint directory that --model OUT loads directly.")
    p.add_argument("model", metavar="MODEL",
                   help="source: a .gguf, an HF directory or hub id, 'embedded:smollm2', 'synthetic:NAME'")
    p.add_argument("out", metavar="OUT", help="output directory")
    p.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=None,
                   help="int4 group size along K (default: the source's int4 group size, else 128, "
                        "or the largest that divides every K)")
    p.add_argument("--float-head", action="store_true",
                   help="keep the LM head in float (default: int4 like the other linear weights)")
    p.add_argument("--force", action="store_true",
                   help="replace a non-empty OUT (the old folder is deleted once the new one is complete)")
    p.set_defaults(func=_run)


def main(argv=None) -> int:
    """`python -m flint.quantize` = `flint quantize`."""
    from .cli import main as cli_main

    return cli_main(["quantize", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
