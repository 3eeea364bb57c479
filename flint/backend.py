"""The factory that builds a decode backend by name, and the reference backend.

Every backend serves the decode-step API of flint.backend_api: ``forward`` (the DecodeBackend
protocol), and the optional steps it lists (greedy_next, greedy_run, the masked and pipelined
steps), with ``BackendError`` (re-exported here). flint.token_mask holds the masks' shared torch side
(``check_token_mask``, ``mask_logits``: the reference and compiled backends use them, the engine masks
logits with it before sampling). Test: ``pytest tests/test_structured.py -k mask``.

Backends: reference (eager PyTorch), compiled / compiled-bf16 (torch.compile baselines,
flint.compiled), megakernel (the persistent CUDA kernel, flint.megakernel).

KV cache formats (``kv_cache``, the CLI's ``--kv-cache``): fp16 (every backend's float cache), int8
and fp8 (8-bit values with an fp16 scale per row, flint.model's docstring gives the layout). The
reference reads both 8-bit caches, the megakernel int8; ``check_kv_cache`` refuses the rest (the
CLI calls it before any weights load). Test: ``pytest tests/test_kv_cache.py``.
"""
from __future__ import annotations

import sys

import torch

from .backend_api import BackendError, refuse_kernel_features  # noqa: F401  (BackendError re-exported: callers catch flint.backend.BackendError)
from .model import KV_CACHE_FORMATS, Transformer, kv_value_dtype
from .token_mask import check_token_mask, mask_logits  # noqa: F401  (mask_logits re-exported)

BACKENDS = ("reference", "compiled", "compiled-bf16", "megakernel")


class ReferenceBackend(Transformer):
    """The reference decoder (flint.model) with the masked M = 1 argmax step ``greedy_next`` and the pipelined
    masked step (flint.backend_api.PipelinedStep), run in order: a step is computed when its mask is published."""

    token_mask = None
    _pipe = None
    _pipe_out = ()  # (a list from pipe_begin on)
    _pipe_words = None

    def set_token_mask(self, mask) -> None:
        self.token_mask = check_token_mask(self, mask)

    def greedy_next(self, token: int, pos: int) -> int:
        return self._argmax(self._step(token, pos), self.token_mask)

    def _step(self, token: int, pos: int) -> torch.Tensor:
        return self.forward(torch.tensor([int(token)], dtype=torch.long), pos)[-1]

    def _argmax(self, logits: torch.Tensor, mask) -> int:
        if mask is not None:
            logits = mask_logits(logits, check_token_mask(self, mask))
        return int(torch.argmax(logits))

    def pipe_begin(self, token: int, pos: int) -> None:
        self._pipe = [(int(pos), int(token))]
        self._pipe_out = []
        self._pipe_last = None

    def pipe_ahead(self, pos: int) -> None:
        if self._pipe is None:
            raise RuntimeError(f"{self.name}: pipe_ahead without a pipe_begin before it")
        self._pipe.append((int(pos), None))

    @property
    def pipe_mask(self) -> torch.Tensor:
        if self._pipe_words is None:
            self._pipe_words = torch.zeros((self.cfg.vocab_size + 31) // 32, dtype=torch.int32)
        return self._pipe_words

    def pipe_publish(self) -> None:
        if not self._pipe:
            raise RuntimeError(f"{self.name}: pipe_publish with no step waiting")
        pos, tok = self._pipe.pop(0)
        logits = self._step(self._pipe_last if tok is None else tok, pos)
        mask = self.pipe_mask.to(self.device)
        t = self._argmax(logits, mask) if bool(mask.any()) else -1
        self._pipe_last = max(t, 0)
        self._pipe_out.append(t)

    def pipe_token(self) -> int:
        if not self._pipe_out:
            raise RuntimeError(f"{self.name}: pipe_token with no published step")
        t = self._pipe_out.pop(0)
        if t < 0:
            raise RuntimeError(f"{self.name}: the token mask allows no token")
        return t

    def pipe_close(self) -> None:
        self._pipe, self._pipe_out = None, []


def cuda_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def default_backend(quiet: bool = False) -> str:
    """megakernel on a Hopper GPU, else the reference (with one line saying so)."""
    if cuda_sm90():
        return "megakernel"
    if not quiet:
        where = "no CUDA GPU" if not torch.cuda.is_available() else "GPU is not sm_90"
        print(f"flint: {where}: using the reference backend", file=sys.stderr)
    return "reference"


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


KV_CACHE_BACKENDS = {"fp16": BACKENDS, "int8": ("reference", "megakernel"), "fp8": ("reference",)}


def check_kv_cache(name: str, kv_cache: str) -> None:
    """Raises BackendError unless backend ``name`` can hold a ``kv_cache`` cache."""
    if kv_cache not in KV_CACHE_FORMATS:
        raise BackendError(f"--kv-cache {kv_cache!r}: choose one of {', '.join(KV_CACHE_FORMATS)}")
    if name not in KV_CACHE_BACKENDS[kv_cache]:
        raise BackendError(f"--kv-cache {kv_cache}: backend {name!r} has no {kv_cache} KV cache (it holds fp16 "
                           f"K/V); backends that read it: {', '.join(KV_CACHE_BACKENDS[kv_cache])}")
    if kv_cache != "fp16":
        try:
            kv_value_dtype(kv_cache)  # fp8 needs a torch with float8_e4m3fn casts
        except ValueError as e:
            raise BackendError(str(e)) from None


def make_backend(name: str, lm, max_seq_len: int | None = None, device: str | None = None,
                 group_size: int = 128, dtype: str | None = None, kv_cache: str = "fp16"):
    """Build backend ``name`` for a LoadedModel ``lm`` with a ``kv_cache`` KV cache (KV_CACHE_FORMATS)."""
    if name not in BACKENDS:
        raise BackendError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    check_kv_cache(name, kv_cache)
    cfg = lm.cfg
    max_seq_len = max_seq_len or cfg.max_position_embeddings
    if max_seq_len > cfg.max_position_embeddings:
        raise BackendError(f"max_seq_len {max_seq_len} exceeds the model's context "
                           f"{cfg.max_position_embeddings}")
    device = device or default_device()
    if name != "reference":
        refuse_kernel_features(name, cfg, max_seq_len)
    if name == "reference":
        if dtype is None:
            dtype = "float32" if torch.device(device).type == "cpu" else "bfloat16"
        if dtype not in ("float32", "bfloat16"):
            raise BackendError(f"--dtype {dtype!r}: the reference runs float32 or bfloat16")
        return ReferenceBackend(cfg, lm.params, max_seq_len, device=device, dtype=getattr(torch, dtype),
                                kv_cache=kv_cache)
    if name in ("compiled", "compiled-bf16"):
        from .compiled import CompiledBackend

        return CompiledBackend(cfg, lm.params, max_seq_len, device=device,
                               int4=(name == "compiled"), group_size=group_size)
    if name == "megakernel":
        if not cuda_sm90():
            raise BackendError("backend 'megakernel' needs an sm_90 (Hopper) CUDA GPU")
        from .megakernel import MegakernelBackend
        from .quant.int4 import quantize_params

        return MegakernelBackend(cfg, quantize_params(lm.params, group_size), max_seq_len, device="cuda",
                                 kv_cache=kv_cache)
    raise AssertionError(name)
