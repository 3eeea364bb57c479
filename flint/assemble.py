"""Assembling an Engine from the model options (flint.options.add_model_args): the model loaded, its backend
built, and the drafter of speculative decoding attached. `flint chat`, `generate` and `serve` build their engine
here, so each command's flags mean the same engine.

Test: ``pytest tests/test_cli.py tests/test_server.py``.
"""
from __future__ import annotations

import gc
import sys

MAX_SEQ_LEN = 8192  # the KV cache's length when --max-seq-len is not given (less where the model's context is)


def check_draft_k(draft: str | None, k: int | None, shown=None) -> None:
    """ValueError when the suffix or auto drafter is asked for more tokens a step than it proposes (``shown``: the
    option's text, when it is not k itself)."""
    from .speculative.suffix import K_MAX

    if draft in ("suffix", "auto") and (k or 0) > K_MAX:
        raise ValueError(f"--draft-k {k if shown is None else shown}: the {draft} draft proposes at most {K_MAX} "
                         f"tokens a step (the widest verify is M = {K_MAX + 1})")


def settle_heap() -> None:
    """Once the engine is built: a full collection, then every object alive (the model, the tokenizer, torch's own)
    moved into the cyclic collector's permanent generation, so that a full collection while decoding walks only what
    decoding allocated. With torch loaded such a walk took 30-65 ms on the build machine, a stall in the middle of a
    stream wherever the collector's thresholds fell due. Earlier frozen objects are unfrozen first, so that cycles
    that died since an earlier engine was built are still collected."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def _refuse_unless_fits(args) -> None:
    """Before any weight is read: a model the megakernel cannot hold on this GPU is refused naming both sizes (its
    config read alone: flint.loading.peek_config; flint.megakernel.refuse_unless_fits)."""
    import torch

    from .loading import peek_config

    device = args.device or "cuda"
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return  # (make_backend refuses the megakernel there)
    cfg = peek_config(args.model)
    if cfg is None:
        return  # (the backend checks again before it allocates, from the weights)
    from .megakernel import refuse_unless_fits

    max_seq = args.max_seq_len or min(cfg.max_position_embeddings, MAX_SEQ_LEN)
    refuse_unless_fits(cfg, max_seq, getattr(args, "kv_cache", "fp16"), device, group_size=args.group_size or 128)


def load_engine(args, quiet: bool = False, synthetic_text: bool = False):
    """(LoadedModel, backend, Engine) from the model options; with ``--draft`` other than none the Engine is a
    SpeculativeEngine. ``quiet``: no notes on stderr. ``synthetic_text``: a synthetic model gets the byte-level
    tokenizer of its vocabulary (flint.synthetic.synthetic_tokenizer; `flint serve`, so its speed can be served)."""
    from .backend import default_backend, make_backend
    from .engine import Engine
    from .loading import load_model

    check_draft_k(getattr(args, "draft", None), getattr(args, "draft_k", None))
    name = args.backend or default_backend(quiet=quiet)
    if name == "megakernel":
        _refuse_unless_fits(args)
    lm = load_model(args.model)
    if synthetic_text and lm.tokenizer is None and str(args.model).startswith("synthetic:"):
        from .synthetic import synthetic_tokenizer

        lm.tokenizer = synthetic_tokenizer(lm.cfg)
    max_seq = args.max_seq_len or min(lm.cfg.max_position_embeddings, MAX_SEQ_LEN)
    backend = make_backend(name, lm, max_seq, device=args.device, group_size=args.group_size,
                           dtype=getattr(args, "dtype", None), kv_cache=getattr(args, "kv_cache", "fp16"))
    engine = Engine(backend, lm.tokenizer)
    draft_path = getattr(args, "draft", None)
    if draft_path and draft_path != "none":
        from .speculative.draft_head import load_draft
        from .speculative.verify import SpeculativeEngine

        draft = load_draft(draft_path, lm.cfg, lm.params, device=backend.device,
                           draft_vocab=getattr(args, "draft_vocab", None))
        engine = SpeculativeEngine(backend, lm.tokenizer, draft, k=args.draft_k, plain_fallback=draft_path == "auto")
        if name == "megakernel" and not quiet and draft_path != "auto":
            print("flint: speculative decoding on the megakernel is exact but slower than plain decoding except on "
                  "code prompts (its verify step is not yet flat in M; docs/speculative.md)", file=sys.stderr)
    settle_heap()
    return lm, backend, engine
