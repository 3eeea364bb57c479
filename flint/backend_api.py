"""The decode-step API every backend serves, and the pieces of it the backends share.

A backend holds the weights and a KV cache for ONE sequence and offers:

    forward(tokens: LongTensor[M], start_pos: int, return_hidden=False, last_only=False)
        -> float32 logits [M, V] on backend.device  (and the last layer's hidden state [M, H],
           before the final norm, when return_hidden); with last_only, the last position's only
           ([1, V] and [1, H]: a prefill needs no other row, and a long one's [M, V] is large)

It writes K/V for positions start_pos..start_pos+M-1 and attends to cache positions < start_pos
plus causally within the M tokens. Positions >= start_pos + M are never read before being written
again, so rolling back (speculative decoding) or reusing a shared prompt prefix is just calling
forward with a smaller start_pos. M >= 1 (the verify step uses M = K + 1).

Optional: ``greedy_next(token, pos) -> int`` (a fast M = 1 argmax path), ``greedy_run(token, pos, n)
-> list[int]`` (n greedy steps, each argmax fed to the next step on the device: one host sync per n
tokens; the engine decodes greedily in bursts through it, `flint bench` times it), ``max_chunk`` (the
largest M one call takes; the engine splits longer prefills).

The backends (flint.compiled, flint.megakernel) import from here; the factory that builds one by
name (flint.backend.make_backend) imports the backends, so this module imports none of them.
"""
from __future__ import annotations


class BackendError(ValueError):
    pass


def refuse_kernel_features(name: str, cfg, max_seq_len: int | None) -> None:
    """BackendError naming each feature of ``cfg`` that backend ``name`` does not implement yet
    (flint.config.kernel_features), before any weight is touched: the reference runs them."""
    from .config import kernel_features

    missing = kernel_features(cfg, max_seq_len)
    if missing:
        raise BackendError(f"backend {name!r} does not implement {'; '.join(missing)} yet: "
                           "use --backend reference (docs/loading.md)")


def check_greedy_run(backend, token: int, pos: int, n: int) -> None:
    """The arguments of ``greedy_run(token, pos, n)``, checked before anything is launched (ValueError)."""
    name = getattr(backend, "name", type(backend).__name__)
    if not 0 <= int(token) < backend.cfg.vocab_size:
        raise ValueError(f"{name}: token id {int(token)} is outside the vocabulary (size {backend.cfg.vocab_size})")
    if n < 1:
        raise ValueError(f"{name}: greedy_run needs n >= 1, got {n}")
    if pos < 0 or pos + n > backend.max_seq_len:
        raise ValueError(f"{name}: positions {pos}..{pos + n - 1} exceed max_seq_len {backend.max_seq_len}")
