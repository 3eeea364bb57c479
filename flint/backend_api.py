"""The decode-step API every backend serves, as types, and the pieces of it the backends share.

``DecodeBackend`` is the one required protocol: a backend holds the weights and a KV cache for ONE
sequence and steps it with ``forward``. The others are optional steps a backend may add; the engine
and the benchmark ask ``isinstance(backend, GreedyRun)`` and so on (the protocols are
``runtime_checkable``: a backend need not inherit from them, having the members is enough) and fall
back to ``forward`` when the answer is no.

| protocol        | members                                             | served by                        |
|-----------------|-----------------------------------------------------|----------------------------------|
| DecodeBackend   | cfg, device, max_seq_len, forward                   | every backend                    |
| GreedyStep      | greedy_next                                         | reference, compiled, megakernel  |
| GreedyRun       | greedy_run                                          | compiled, megakernel             |
| ChunkedPrefill  | max_chunk                                           | compiled, megakernel             |
| MaskedStep      | set_token_mask, greedy_next                         | reference, compiled, megakernel  |
| PipelinedStep   | MaskedStep's, pipe_begin ... pipe_close, pipe_mask  | reference, megakernel            |
| WeightBytes     | weight_bytes_per_token                              | compiled, megakernel             |
| KVBytes         | kv_bytes                                            | every backend                    |

The backends (flint.compiled, flint.megakernel) import from here; the factory that builds one by
name (flint.backend.make_backend) imports the backends, so this module imports none of them.
Test: ``pytest tests/test_structured.py -k protocol``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .errors import FlintError

if TYPE_CHECKING:
    import torch


class BackendError(FlintError, ValueError):
    pass


@runtime_checkable
class DecodeBackend(Protocol):
    """The required step.

    ``forward(tokens, start_pos, return_hidden=False, last_only=False)`` takes a LongTensor[M] of token
    ids (M >= 1; the verify step of speculative decoding uses M = K + 1) and returns float32 logits
    [M, V] on ``device`` (and the last layer's hidden state [M, H], before the final norm, when
    return_hidden); with last_only, the last position's only ([1, V] and [1, H]: a prefill needs no
    other row, and a long one's [M, V] is large). It writes K/V for positions start_pos..start_pos+M-1
    and attends to cache positions < start_pos plus causally within the M tokens. Positions >=
    start_pos + M are never read before being written again, so rolling back (speculative decoding) or
    reusing a shared prompt prefix is just calling forward with a smaller start_pos."""

    cfg: Any  # flint.config.ModelConfig
    device: torch.device
    max_seq_len: int

    def forward(self, tokens: torch.Tensor, start_pos: int, return_hidden: bool = False,
                last_only: bool = False): ...


@runtime_checkable
class GreedyStep(Protocol):
    """A fast M = 1 argmax step: the next token's id for ``token`` at ``pos`` (no logits reach the host)."""

    def greedy_next(self, token: int, pos: int) -> int: ...


@runtime_checkable
class GreedyRun(Protocol):
    """n greedy steps, each argmax fed to the next step on the device: one host sync per n tokens (the
    engine decodes greedily in bursts through it, ``flint bench`` times it). check_greedy_run checks
    its arguments."""

    def greedy_run(self, token: int, pos: int, n: int) -> list[int]: ...


@runtime_checkable
class ChunkedPrefill(Protocol):
    """``max_chunk``: the largest M one forward takes (the engine splits longer prefills)."""

    max_chunk: int


@runtime_checkable
class MaskedStep(Protocol):
    """Grammar-constrained greedy decoding. ``set_token_mask(mask)`` takes a contiguous int32 tensor of
    ceil(V / 32) words on the backend's device (bit i & 31 of word i >> 5 set = token i allowed), or None
    to clear it; it applies to the argmax of every following ``greedy_next`` / ``greedy_run`` call until
    set again, never to ``forward``'s logits (logprobs stay the model's distribution). An all-zero mask
    is the caller's error (the result is undefined). flint.token_mask holds the shared torch side."""

    def set_token_mask(self, mask: torch.Tensor | None) -> None: ...

    def greedy_next(self, token: int, pos: int) -> int: ...


@runtime_checkable
class PipelinedStep(MaskedStep, Protocol):
    """The masked steps pipelined, so that no host round trip sits between two steps (the engine then
    takes that loop). ``pipe_begin(token, pos)`` enqueues the step and its masked argmax, which waits
    until the host has filled ``pipe_mask`` (a CPU int32 tensor of the same words) and called
    ``pipe_publish()``; ``pipe_ahead(pos)`` enqueues the next step, whose token is the latest enqueued
    argmax's (it never leaves the device); ``pipe_token()`` returns the oldest published argmax's token
    (RuntimeError when its mask allowed nothing); ``pipe_close()`` releases whatever still waits."""

    @property
    def pipe_mask(self) -> torch.Tensor: ...

    def pipe_begin(self, token: int, pos: int) -> None: ...

    def pipe_ahead(self, pos: int) -> None: ...

    def pipe_publish(self) -> None: ...

    def pipe_token(self) -> int: ...

    def pipe_close(self) -> None: ...


@runtime_checkable
class WeightBytes(Protocol):
    """The bytes of weights one decode step reads, as the backend stores them (the benchmark's bandwidth
    figures; flint.bench counts a reference decoder's itself)."""

    weight_bytes_per_token: int


@runtime_checkable
class KVBytes(Protocol):
    """The bytes of K and V one decode step reads at context ``ctx``, in the backend's cache format."""

    def kv_bytes(self, ctx: int) -> int: ...


def refuse_kernel_features(name: str, cfg, max_seq_len: int | None) -> None:
    """BackendError naming each feature of ``cfg`` that backend ``name`` does not implement yet
    (flint.config.kernel_features), before any weight is touched: the reference runs them."""
    from .config import kernel_features

    missing = kernel_features(cfg, max_seq_len, name)
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
