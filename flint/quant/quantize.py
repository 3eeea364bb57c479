"""`flint quantize MODEL OUT`: write a flint int4 checkpoint that `--model OUT` loads directly.

A 3B model is quantized once, then loads in seconds. OUT holds:

* ``model.safetensors``: every linear weight and the LM head as ``<name>.qweight`` (uint8),
  ``<name>.scales`` and ``<name>.mins`` (fp16) in the flint-int4-v1 layout (flint/quant/int4.py), and
  the float tensors under their flint names ("embed", "norm", "layers.{i}.attn_norm", ...).
  "embed" is the embedding lookup's own copy (``--embed``, embedding_for_checkpoint): by default
  int4 where that layout holds the source's values exactly (a GGUF Q4_0 / Q4_1 embedding), else
  fp16 for an fp32 source (a GGUF's Q8_0 embedding dequantizes to fp32; fp16 keeps it within 0.02%
  of its largest value, far below the int4 weights' error), else the source's dtype (bf16 stays
  bf16). The lookup reads one row per token, so its size is file size, not decode time. Every
  backend reads each form (flint.model.dense; the megakernel converts the table to fp32 at load).
  An embedding stored in int4 that equals the int4 head of a tied model is stored once. On the
  embedded SmolLM2 (a 98.4 MB GGUF) the checkpoint is 140.9 MB (fp16 embedding; 197.5 MB with the
  fp32 one, ``--embed source``) and 84.3 MB with ``--embed int4``.
* The LM head (``--head``): int4 round-to-nearest (``rtn``), ``searched`` (each group's scale and
  min searched to minimise its squared error, flint.quant.int4.quantize_int4_searched), ``gptq``, or
  ``float``. ``--method gptq`` quantizes the float linear weights by GPTQ (flint/quant/gptq.py) over
  flint/data/calibration.txt (or ``--calibration PATH``). Int4 weights already at the group size
  are kept as they are whatever the method. What each choice costs on SmolLM2: docs/eval.md.
  The command prints one line each on the linear weights, the head and the embedding.
* ``config.json`` in HF form (model_type llama / granite / granitemoehybrid) with
  ``"quantization_config": {"quant_method": "flint-int4-v1", "group_size": G}``; for an HF source
  it is the source's own config.json plus that field.
* ``generation_config.json`` (bos / eos ids) and the tokenizer: copied from an HF source, written
  from the loaded tokenizer otherwise (tokenizer.json + tokenizer_config.json with the chat
  template and the bos / eos tokens).

Group size: int4 weights already in the source (GGUF Q4_0 / Q4_1 at G = 32) are kept as they are
when G matches and re-fitted (a second rounding, printed) when it does not; float weights are
quantized round-to-nearest (or by GPTQ). The default G is the source's int4 group size, else 128,
or the largest smaller one that divides every K (64 for SmolLM2's K = 576). A G that does not
divide some K is an error naming the tensor. Test: ``pytest tests/test_quant.py -k checkpoint``
and ``pytest tests/test_quantize_head.py``.

Writing: the checkpoint is written into a hidden folder next to OUT and renamed to OUT at the end,
so an interrupted or failed run leaves nothing under OUT (the partial folder is removed). A
non-empty OUT is refused before any work unless --force, which swaps the new folder in for the
old one, so no file of the old checkpoint (a stale shard index) survives next to the new one.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import secrets
import shutil
import signal
import sys
import threading
from pathlib import Path

import torch

from ..config import ModelConfig
from ..errors import FlintError
from ..loading import QUANT_METHOD, LoadedModel, load_model
from ..params import LINEAR_NAMES
from .int4 import (GROUP_SIZES, Int4Weight, check_shape, int4_group_size, quantize_int4,
                    quantize_int4_searched)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")


class QuantizeError(FlintError, ValueError):
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


HEADS = ("rtn", "searched", "gptq", "float")
METHODS = ("rtn", "gptq")
EMBEDS = ("auto", "fp16", "bf16", "int4", "source")
_HEAD_WORDS = {"rtn": "round-to-nearest", "searched": "(scale, min) searched per group",
               "gptq": "GPTQ over the calibration text"}


def _mb(nbytes: int) -> str:
    return f"{nbytes / 1e6:.1f} MB"


def _nbytes(w) -> int:
    return w.nbytes if isinstance(w, Int4Weight) else w.numel() * w.element_size()


def _describe(w) -> str:
    return f"int4 g{w.group_size}" if isinstance(w, Int4Weight) else str(w.dtype).replace("torch.", "")


def quantize_for_checkpoint(params: dict, group_size: int, float_head: bool = False,
                            log=print, head: str | None = None, method: str = "rtn",
                            calibrate=None) -> dict:
    """params with every linear weight (and, unless the head is "float", the LM head) as
    Int4Weight at exactly ``group_size``. Raises QuantizeError naming a tensor whose K it does not
    divide.

    ``method`` quantizes the float linear weights (and int4 ones re-fitted to another group size):
    "rtn" or "gptq". ``head``: "rtn", "searched" (flint.quant.int4.quantize_int4_searched), "gptq" or
    "float" (``float_head`` is the same as "float"); by default the method's. "gptq" needs
    ``calibrate(names, group_sizes) -> {name: Int4Weight}`` (flint.quant.gptq.gptq_params bound to the
    model and its calibration tokens). Logs one line on the linear weights and one on the head.
    """
    if group_size not in GROUP_SIZES:
        raise QuantizeError(f"--group-size {group_size} is not one of {', '.join(map(str, GROUP_SIZES))}")
    head = head or ("float" if float_head else method)
    if float_head and head != "float":
        raise QuantizeError(f"--float-head and --head {head} contradict each other; pass one")
    if method not in METHODS:
        raise QuantizeError(f"--method {method!r} is not one of {', '.join(METHODS)}")
    if head not in HEADS:
        raise QuantizeError(f"--head {head!r} is not one of {', '.join(HEADS)}")
    if "gptq" in (method, head) and calibrate is None:
        raise QuantizeError("GPTQ needs a calibration pass (a model with a tokenizer)")
    out = dict(params)
    targets = _int4_targets(params)
    if head == "float":
        targets.remove("lm_head")
    todo, refit, kept = [], [], 0
    for name in targets:
        w = params[name]
        n, k = w.shape
        try:
            check_shape(name, n, k, group_size)
        except ValueError as e:
            raise QuantizeError(f"{e}; choose a --group-size that divides it") from None
        if isinstance(w, Int4Weight):
            if w.group_size == group_size:
                kept += name != "lm_head"
                continue
            refit.append(name)
        todo.append(name)
    gptq = [n for n in todo if (head if n == "lm_head" else method) == "gptq"]
    if gptq:
        out.update(calibrate(gptq, {n: group_size for n in gptq}))
    for name in todo:
        if name in gptq:
            continue
        w = params[name]  # dequantized one at a time: a 3B model's fp32 copy would be 13 GB
        w = w.dequantize(torch.float32) if isinstance(w, Int4Weight) else w
        fit = quantize_int4_searched if name == "lm_head" and head == "searched" else quantize_int4
        out[name] = fit(w, group_size, name=name)
    if head == "float" and isinstance(params["lm_head"], Int4Weight):
        out["lm_head"] = params["lm_head"].dequantize(torch.float32)
    lin = [n for n in targets if n != "lm_head"]
    parts = [f"{kept} kept as the source's int4 g{group_size}"] if kept else []
    if len(lin) - kept:
        how = "GPTQ over the calibration text" if method == "gptq" else "round-to-nearest"
        parts.append(f"{len(lin) - kept} quantized {how} at g{group_size}")
    lrefit = [n for n in refit if n != "lm_head"]
    if lrefit:
        parts.append(f"{len(lrefit)} of them re-fitted from the source's int4 "
                     f"g{params[lrefit[0]].group_size} (a second rounding)")
    log(f"flint quantize: linear weights: {'; '.join(parts) or 'none'}", file=sys.stderr)
    log(f"flint quantize: LM head: {describe_head(params, out, head)}", file=sys.stderr)
    return out


def describe_head(src: dict, out: dict, head: str) -> str:
    """What became of the LM head, in words (for the log of `flint quantize`)."""
    s, w = src["lm_head"], out["lm_head"]
    tied = " (the source ties it to the embedding)" if src["lm_head"] is src["embed"] else ""
    if w is s:
        return f"kept as the source's {_describe(s)}{tied}, {_mb(_nbytes(w))}"
    if head == "float":
        return f"float32 (dequantized from the source's {_describe(s)}){tied}, {_mb(_nbytes(w))}"
    refit = ", a second rounding" if isinstance(s, Int4Weight) else ""
    return (f"{_describe(w)}, {_HEAD_WORDS[head]}, from the source's {_describe(s)}{tied}{refit}, "
            f"{_mb(_nbytes(w))}")


def embedding_for_checkpoint(src: dict, out: dict, mode: str, group_size: int) -> tuple[object, str]:
    """(the "embed" tensor to store, a line saying what was done to it).

    "auto": int4 when that layout holds the source's values exactly (a GGUF Q4_0 / Q4_1
    embedding at this group size), else fp16 for an fp32 embedding whose values fp16 can hold (a
    GGUF's Q8_0 embedding dequantizes to fp32: its values need up to 18 significant bits, fp16
    keeps 11, an error far below the int4 weights'), else the source's own dtype. "fp16" /
    "bf16": that dtype. "int4": round-to-nearest at ``group_size`` (lossy: the lookup reads int4
    rows), the same tensor as the head when they come out equal. "source": as loaded.
    Every backend reads each of these: the reference and compiled ones through flint.model.dense,
    the megakernel by converting the lookup table to fp32 once at load.
    """
    if mode not in EMBEDS:
        raise QuantizeError(f"--embed {mode!r} is not one of {', '.join(EMBEDS)}")
    e = src["embed"]
    tie = src["lm_head"] is src["embed"] or isinstance(src["lm_head"], Int4Weight) and _tied_int4(src)
    name, was = _describe(e), _mb(_nbytes(e))
    if isinstance(e, Int4Weight):  # a flint checkpoint stored with --embed int4
        if mode in ("auto", "source", "int4") and e.group_size == group_size:
            return _shared(e, out, tie), f"kept as the source's int4 g{group_size}, {_mb(e.nbytes)}"
        e = e.dequantize(torch.float32)
    if mode == "source":
        return e, f"{name}, as in the source, {_mb(_nbytes(e))}"
    # only an fp32 embedding can be an int4 one dequantized (the GGUF loader's copy of Q4_0 / Q4_1)
    if mode == "int4" or (mode == "auto" and e.dtype == torch.float32):
        try:
            check_shape("embed", *e.shape, group_size)
            q = quantize_int4(e, group_size, name="embed")
        except ValueError as err:
            if mode == "int4":
                raise QuantizeError(f"--embed int4: {err}") from None
            q = None
        if q is not None and (mode == "int4" or torch.equal(q.dequantize(e.dtype), e)):
            q = _shared(q, out, tie)
            how = "round-to-nearest (lossy)" if mode == "int4" else "the source's values exactly"
            tied = ", the same tensor as the LM head" if q is out["lm_head"] else ""
            return q, f"int4 g{group_size}, {how}{tied}, {_mb(q.nbytes)} (the source's {name}: {was})"
    if mode == "auto":
        if e.dtype != torch.float32:
            return e, f"{name}, as in the source, {_mb(_nbytes(e))}"
        fits = bool(e.abs().max() <= torch.finfo(torch.float16).max) if e.numel() else True
        mode = "fp16" if fits else "bf16"
    dt = torch.float16 if mode == "fp16" else torch.bfloat16
    t = e.to(dt)
    if not torch.isfinite(t).all():
        raise QuantizeError(f"--embed {mode}: the embedding has values {dt} cannot hold; "
                            "pass --embed bf16 or source")
    err = float((t.float() - e.float()).abs().max()) if e.numel() else 0.0
    top = float(e.float().abs().max()) if e.numel() else 0.0
    rel = f", {err / top:.2%} of the largest |value|" if top else ""
    return t, (f"{str(dt).replace('torch.', '')} from the source's {name} (largest rounding error "
               f"{err:.2g}{rel}), {_mb(_nbytes(t))} (was {was})")


def _tied_int4(src: dict) -> bool:
    """A GGUF tied Q4 embedding loads as its float copy beside the int4 head: tied all the same."""
    h, e = src["lm_head"], src["embed"]
    return isinstance(e, Int4Weight) and e is h or (not isinstance(e, Int4Weight) and tuple(e.shape) == h.shape
                                                    and torch.equal(h.dequantize(e.dtype), e))


def _shared(q: Int4Weight, out: dict, tie: bool) -> Int4Weight:
    """``q``, or the int4 head when the model is tied and the head holds the same values (stored
    once; the loader ties them back)."""
    h = out["lm_head"]
    if (tie and isinstance(h, Int4Weight) and h.group_size == q.group_size and torch.equal(h.qweight, q.qweight)
            and torch.equal(h.scales, q.scales) and torch.equal(h.mins, q.mins)):
        return h
    return q


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
                  "granitemoehybrid": "GraniteMoeHybridForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM"}
    d["architectures"] = [arch_names[cfg.arch]]
    if cfg.sliding_window is not None:  # read back for mistral and phi3 only
        d["sliding_window"] = cfg.sliding_window
        if cfg.arch == "llama":
            d.update(model_type="mistral", architectures=["MistralForCausalLM"])
    if cfg.rotary_dim is not None:
        d["partial_rotary_factor"] = cfg.rotary_dim / cfg.head_dim
    if cfg.rope_scaling is not None:
        d["rope_scaling"] = dict(cfg.rope_scaling)
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
    tied = params["lm_head"] is params["embed"]
    if tied and not cfg.tie_word_embeddings:
        raise QuantizeError("the LM head is the embedding's tensor but the config does not tie them")
    for name, w in params.items():
        if name == "lm_head" and tied:
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
    if not out.absolute().parents or not Path(os.path.abspath(out)).name:
        raise QuantizeError(f"{out}: is a filesystem root; choose another OUT directory")
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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except (OverflowError, ValueError):  # no process can have this id
        return False
    return True


def remove_stale_siblings(out: Path) -> list[Path]:
    """Remove the hidden folders next to ``out`` that a killed run left (SIGKILL, a power cut):
    a partial folder whose process is gone, and an old folder whose swap completed (``out``
    there). An old folder without ``out`` still holds the previous checkpoint: it is kept."""
    gone = []
    for tag in ("partial", "old"):
        for p in out.parent.glob(f".{glob.escape(out.name)}.{tag}-*-*"):
            pid = p.name[len(f".{out.name}.{tag}-"):].split("-")[0]
            if not pid.isascii() or not pid.isdigit() or _pid_alive(int(pid)) or (tag == "old" and not out.exists()):
                continue
            if p.is_symlink():
                p.unlink()
            else:
                shutil.rmtree(p, ignore_errors=True)
            gone.append(p)
    return gone


@contextlib.contextmanager
def _signals_raise():
    """SIGTERM and SIGHUP raise SystemExit(128 + signal) here (as Ctrl-C raises KeyboardInterrupt),
    so the partial folder is removed on the way out; outside the main thread nothing changes."""
    def handler(signum, frame):
        raise SystemExit(128 + signum)
    old = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            old[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def write_dir_atomically(out: Path, write) -> Path:
    """Call ``write(tmp)`` on a new folder next to ``out``, then put it in place of ``out``
    (an existing ``out`` is swapped out and deleted). On any failure, Ctrl-C, SIGTERM and SIGHUP
    included, the partial folder is removed and ``out`` is left as it was; a writer's error is a
    QuantizeError naming ``out``. Folders a killed run left next to ``out`` are removed first
    (remove_stale_siblings)."""
    out = Path(os.path.abspath(out))  # "x/.." has no usable .name to put a sibling next to
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_siblings(out)
    tmp = _sibling(out, "partial")
    with _signals_raise():  # from here to the rename, SIGTERM / SIGHUP unwind through the cleanup below
        tmp.mkdir()
        try:
            try:
                write(tmp)
            except (QuantizeError, KeyboardInterrupt, SystemExit):
                raise
            except Exception as e:  # noqa: BLE001 - OSError, and the safetensors / tokenizers writers' own errors
                raise QuantizeError(f"{out}: writing the checkpoint failed, nothing was written there "
                                    f"({type(e).__name__}: {str(e)[:300]})") from None
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


def calibrator(lm: LoadedModel, text: str | Path | None = None, log=print, device="cpu"):
    """``calibrate(names, group_sizes)`` for quantize_for_checkpoint: GPTQ (flint.quant.gptq) with
    Hessians from ``lm``'s own weights over the calibration text (default: the shipped one), the
    calibration pass and the solves on ``device``."""
    from . import gptq

    if lm.tokenizer is None:
        raise QuantizeError(f"{lm.source}: has no tokenizer (synthetic?); GPTQ calibrates on text")
    try:
        ids = gptq.calibration_ids(lm.tokenizer, text)
    except ValueError as e:
        raise QuantizeError(str(e)) from None

    def calibrate(names, group_sizes):
        what = f"{len(names)} tensor" + "s" * (len(names) != 1)
        log(f"flint quantize: GPTQ on {what}, calibration {len(ids)} tokens of "
            f"{Path(text).name if text else gptq.CALIBRATION_TEXT.name}", file=sys.stderr)
        return gptq.gptq_params(lm.cfg, lm.params, names, group_sizes, ids, device=device)
    return calibrate


def quantize_checkpoint(model: str | None, out: str | Path, group_size: int | None = None,
                        float_head: bool = False, log=print, force: bool = False, head: str | None = None,
                        method: str = "rtn", embed: str = "auto", calibration: str | None = None,
                        device: str = "cpu") -> Path:
    """Load ``model`` (any load_model spec), quantize it and write it to ``out``; a non-empty
    ``out`` is refused unless ``force`` (then replaced as a whole). ``head``, ``method``: see
    quantize_for_checkpoint; ``embed``: see embedding_for_checkpoint; ``calibration``: a UTF-8
    text for GPTQ instead of the shipped one; ``device``: where GPTQ runs."""
    out = Path(out)
    for flag, v, ok in (("--method", method, METHODS), ("--head", head, HEADS + (None,)),
                        ("--embed", embed, EMBEDS)):
        if v not in ok:
            raise QuantizeError(f"{flag} {v!r} is not one of {', '.join(x for x in ok if x)}")
    if calibration and "gptq" not in (method, head):
        raise QuantizeError("--calibration is only read by GPTQ (--method gptq or --head gptq)")
    if device != "cpu" and "gptq" not in (method, head):
        raise QuantizeError(f"--device {device} is only used by GPTQ (--method gptq or --head gptq)")
    check_out_dir(model, out, force)
    lm = load_model(model)
    g = group_size or default_group_size(lm.params)
    cal = calibrator(lm, calibration, log, device) if "gptq" in (method, head) else None
    params = quantize_for_checkpoint(lm.params, g, float_head, log, head=head, method=method, calibrate=cal)
    params["embed"], what = embedding_for_checkpoint(lm.params, params, embed, g)
    log(f"flint quantize: embedding: {what}", file=sys.stderr)
    write_dir_atomically(out, lambda tmp: save_checkpoint(lm, params, g, tmp))
    n4 = sum(w.nbytes for k, w in params.items() if isinstance(w, Int4Weight) and not
             (k == "lm_head" and w is params["embed"]))
    size = sum(f.stat().st_size for f in out.iterdir() if f.name.endswith(".safetensors"))
    log(f"flint quantize: wrote {out} (group size {g}, int4 weights {n4 / 1e6:.1f} MB, "
        f"model.safetensors {size / 1e6:.1f} MB)", file=sys.stderr)
    return out


def _run(args) -> int:
    quantize_checkpoint(args.model, args.out, args.group_size, args.float_head, force=args.force,
                        head=args.head, method=args.method, embed=args.embed, calibration=args.calibration,
                        device=args.device or "cpu")
    return 0


def register(sub) -> None:
    p = sub.add_parser("quantize", help="write a flint int4 checkpoint (safetensors + config + tokenizer)",
                       description="Quantize MODEL's linear weights and LM head to flint-int4-v1 and write "
                                   "a checkpoint directory that --model OUT loads directly. Prints what "
                                   "it did to the linear weights, the LM head and the embedding.")
    p.add_argument("model", metavar="MODEL",
                   help="source: a .gguf, an HF directory or hub id, 'embedded:smollm2', 'synthetic:NAME'")
    p.add_argument("out", metavar="OUT", help="output directory")
    p.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=None,
                   help="int4 group size along K (default: the source's int4 group size, else 128, "
                        "or the largest that divides every K)")
    p.add_argument("--method", choices=METHODS, default="rtn",
                   help="how float linear weights become int4: rtn (round-to-nearest) or gptq (error "
                        "compensation over a calibration text; int4 weights already at the group size "
                        "are kept either way)")
    p.add_argument("--head", choices=HEADS, default=None,
                   help="the LM head: rtn, searched ((scale, min) per group searched to minimise the "
                        "squared error), gptq, or float (default: the --method)")
    p.add_argument("--float-head", action="store_true", help="the same as --head float")
    p.add_argument("--embed", choices=EMBEDS, default="auto",
                   help="the embedding lookup's copy: auto (int4 where that is exact, else fp16 for an "
                        "fp32 source, else the source's dtype), fp16, bf16, int4 (lossy), source")
    p.add_argument("--calibration", default=None, metavar="PATH",
                   help="UTF-8 text for GPTQ (default: the shipped flint/data/calibration.txt)")
    p.add_argument("--device", default=None,
                   help="where GPTQ's calibration pass and solves run: cpu (default) or cuda (a 3B model "
                        "needs its fp32 weights and about 28 GB of Hessians there)")
    p.add_argument("--force", action="store_true",
                   help="replace a non-empty OUT (the old folder is deleted once the new one is complete)")
    p.set_defaults(func=_run)


def main(argv=None) -> int:
    """`python -m flint.quant.quantize` = `flint quantize`."""
    from ..cli import main as cli_main

    return cli_main(["quantize", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
