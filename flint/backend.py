"""The decode-step API every backend serves, and the factory that builds one by name.

A backend holds the weights and a KV cache for ONE sequence and offers:

    forward(tokens: LongTensor[M], start_pos: int, return_hidden=False)
        -> float32 logits [M, V] on backend.device  (and the last layer's hidden state [M, H],
           before the final norm, when return_hidden)

It writes K/V for positions start_pos..start_pos+M-1 and attends to cache positions < start_pos
plus causally within the M tokens. Positions >= start_pos + M are never read before being written
again, so rolling back (speculative decoding) or reusing a shared prompt prefix is just calling
forward with a smaller start_pos. M >= 1 (the verify step uses M = K + 1).

Optional: ``greedy_next(token, pos) -> int`` (a fast M = 1 argmax path), ``greedy_run(token, pos, n)
-> list[int]`` (n greedy steps, each argmax fed to the next step on the device: one host sync per n
tokens; the engine decodes greedily in bursts through it, `flint bench` times it), ``max_chunk`` (the
largest M one call takes; the engine splits longer prefills).

Backends: reference (eager PyTorch), compiled / compiled-bf16 (torch.compile baselines,
flint.compiled), megakernel (the persistent CUDA kernel, flint.megakernel).
"""
from __future__ import annotations

import sys

import torch

BACKENDS = ("reference", "compiled", "compiled-bf16", "megakernel")


class BackendError(ValueError):
    pass


def check_greedy_run(backend, token: int, pos: int, n: int) -> None:
    """The arguments of ``greedy_run(token, pos, n)``, checked before anything is launched (ValueError)."""
    name = getattr(backend, "name", type(backend).__name__)
    if not 0 <= int(token) < backend.cfg.vocab_size:
        raise ValueError(f"{name}: token id {int(token)} is outside the vocabulary (size {backend.cfg.vocab_size})")
    if n < 1:
        raise ValueError(f"{name}: greedy_run needs n >= 1, got {n}")
    if pos < 0 or pos + n > backend.max_seq_len:
        raise ValueError(f"{name}: positions {pos}..{pos + n - 1} exceed max_seq_len {backend.max_seq_len}")


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


def make_backend(name: str, lm, max_seq_len: int | None = None, device: str | None = None,
                 group_size: int = 128, dtype: str | None = None):
    """Build backend ``name`` for a LoadedModel ``lm``."""
    if name not in BACKENDS:
        raise BackendError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    cfg = lm.cfg
    max_seq_len = max_seq_len or cfg.max_position_embeddings
    if max_seq_len > cfg.max_position_embeddings:
        raise BackendError(f"max_seq_len {max_seq_len} exceeds the model's context "
                           f"{cfg.max_position_embeddings}")
    device = device or default_device()
    if name == "reference":
        from .model import Transformer

        if dtype is None:
            dtype = "float32" if torch.device(device).type == "cpu" else "bfloat16"
        if dtype not in ("float32", "bfloat16"):
            raise BackendError(f"--dtype {dtype!r}: the reference runs float32 or bfloat16")
        return Transformer(cfg, lm.params, max_seq_len, device=device, dtype=getattr(torch, dtype))
    if name in ("compiled", "compiled-bf16"):
        from .compiled import CompiledBackend

        return CompiledBackend(cfg, lm.params, max_seq_len, device=device,
                               int4=(name == "compiled"), group_size=group_size)
    if name == "megakernel":
        if not cuda_sm90():
            raise BackendError("backend 'megakernel' needs an sm_90 (Hopper) CUDA GPU")
        from .megakernel import MegakernelBackend
        from .quant import quantize_params

        return MegakernelBackend(cfg, quantize_params(lm.params, group_size), max_seq_len, device="cuda")
    raise AssertionError(name)
