"""The torch side of the backends' token mask (the contract: flint.backend's docstring): checking a mask
``set_token_mask`` is given, and applying one to logits on their device. A module of its own so that the
backends (flint.compiled) and the engine import it without importing the factory in flint.backend.
Test: ``pytest tests/test_structured.py -k mask``.
"""
from __future__ import annotations

import torch


def check_token_mask(backend, mask):
    """``mask`` as set_token_mask takes it (None clears), else ValueError naming what is wrong."""
    if mask is None:
        return None
    name = getattr(backend, "name", type(backend).__name__)
    words = (backend.cfg.vocab_size + 31) // 32
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.int32 or mask.dim() != 1 \
            or mask.numel() != words or not mask.is_contiguous():
        got = f"{mask.dtype} {list(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"{name}: set_token_mask takes a contiguous int32 tensor of {words} words "
                         f"(vocabulary {backend.cfg.vocab_size}), got {got}")
    if not _same_device(mask.device, torch.device(backend.device)):
        raise ValueError(f"{name}: the token mask is on {mask.device}, the backend on {backend.device}")
    return mask


def _same_device(a: torch.device, b: torch.device) -> bool:
    # "cuda" names the current device: a tensor's device always carries its index ("cuda:0")
    def idx(d):
        return d.index if d.index is not None else (torch.cuda.current_device() if d.type == "cuda" else 0)
    return a.type == b.type and idx(a) == idx(b)


_SHIFTS: dict = {}


def mask_logits(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``logits`` [..., V] with every token the bitmask does not allow at -inf (torch ops on the logits'
    device: no copy to the host)."""
    v = logits.shape[-1]
    shifts = _SHIFTS.get(mask.device)
    if shifts is None:
        shifts = _SHIFTS[mask.device] = torch.arange(32, dtype=torch.int32, device=mask.device)
    allowed = ((mask.view(-1, 1) >> shifts) & 1).view(-1)[:v].bool()
    return logits.masked_fill(~allowed, float("-inf"))
