"""The verify's cost by width, per backend: what a speculative step of M tokens costs in plain (M = 1) steps.

The draft-free drafters cut their proposals by it (flint.speculative.suffix.best_run: the prefix that maximises
(1 + expected accepted) / cost[M]), and ``--draft auto`` sizes the draft head's k and its gate's floor from it
(flint.speculative.auto). The curve differs by backend and card: the CPU reference's verify of 8 tokens costs
2.33 steps, the megakernel's on an H100 2.04 on SmolLM2 and 2.96 on Granite-4.1-3B's shapes (docs/bench.md). A
backend on the CPU takes ``CPU_VERIFY_COST`` (measured once on the embedded SmolLM2); a GPU backend's is timed at
engine start by ``measure_verify_cost``: forwards of M = 1..8 tokens at the start of its cache (nothing is cached
yet; the engine writes those positions again before it reads them), ``REPS`` each after a warm-up, the median,
made non-decreasing in M (a wider verify never costs less; the timer's noise can say otherwise). The unit is a
token of plain decoding as the engine runs it: on a backend with ``greedy_run`` a token of a burst on the device
loop (no host round trip a token), which a lone forward and its host synchronisation cost more than; so there
cost[1] > 1, and a draft must beat the bursts, not a synchronised step.

Test: ``pytest tests/test_suffix.py -k cost``.
"""
from __future__ import annotations

import statistics
import time
import weakref

import torch

CPU_VERIFY_COST = (1.0, 1.0, 1.1, 1.27, 1.85, 1.91, 2.0, 2.25, 2.33)  # index M: the CPU reference backend, embedded
                                                                      # SmolLM2, 300-token context (2026-12-07)
WIDEST = 8       # the widest verify the kernels run (M = 8: k <= 7)
REPS = 5         # timed forwards a width (after one warm-up)
PLAIN_BURST = 16  # tokens of the greedy_run burst that times a plain token


def _time_forward(backend, toks: torch.Tensor, sync) -> float:
    sync()
    t0 = time.perf_counter()
    backend.forward(toks, 0)
    sync()
    return time.perf_counter() - t0


def _plain_token_time(backend, sync, reps: int) -> float | None:
    """A token of a ``greedy_run`` burst (PLAIN_BURST tokens from position 0), the median of ``reps``; None where
    the backend has no device loop."""
    run = getattr(backend, "greedy_run", None)
    if run is None:
        return None
    n = min(PLAIN_BURST, backend.max_seq_len)

    def once() -> float:
        sync()
        t0 = time.perf_counter()
        run(0, 0, n)
        sync()
        return (time.perf_counter() - t0) / n

    once()  # warm-up
    return statistics.median(once() for _ in range(reps))


def measure_verify_cost(backend, widths: int = WIDEST, reps: int = REPS) -> tuple[float, ...]:
    """(1.0, cost[1], ..., cost[widths]): the median time of a forward of M tokens over a token of plain decoding (a
    token of a ``greedy_run`` burst where the backend has one, else a forward of one token: cost[1] = 1.0), at
    position 0 of ``backend``'s cache (it overwrites those K/V rows), made non-decreasing in M."""
    dev = getattr(backend, "device", torch.device("cpu"))
    dev = torch.device(dev)
    widths = min(widths, getattr(backend, "max_chunk", widths) or widths, backend.max_seq_len)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    toks = torch.zeros(widths, dtype=torch.long, device=dev)
    times = []
    for m in range(1, widths + 1):
        _time_forward(backend, toks[:m], sync)  # warm-up (a first launch, a graph capture)
        times.append(statistics.median(_time_forward(backend, toks[:m], sync) for _ in range(reps)))
    unit = _plain_token_time(backend, sync, reps) or times[0]
    cost, top = [1.0], 0.0
    for t in times:
        top = max(top, t / unit)
        cost.append(round(top, 3))
    return tuple(cost)


_MEASURED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # backend -> its curve, timed once


def verify_cost_of(backend) -> tuple[float, ...]:
    """The backend's curve: measured on a GPU (once per backend: engines that share it share the curve, and their
    caches are not overwritten again), CPU_VERIFY_COST on the CPU."""
    dev = torch.device(getattr(backend, "device", "cpu"))
    if dev.type != "cuda":
        return CPU_VERIFY_COST
    if backend not in _MEASURED:
        _MEASURED[backend] = measure_verify_cost(backend)
    return _MEASURED[backend]


def best_k(cost: tuple[float, ...], accept: float, k_max: int, per_token: float = 0.0) -> tuple[int, float]:
    """(k, value): the draft length that maximises the expected tokens a step, 1 + a + a^2 + ... + a^k for a
    per-token acceptance ``accept``, over the step's cost, cost[k + 1] + k x ``per_token`` (the drafter's own time a
    token, in plain steps); k = 0 (a plain step, value 1.0) where no draft is worth its verify."""
    best, value = 0, 1.0
    gain, p = 1.0, 1.0
    for k in range(1, min(k_max, len(cost) - 2) + 1):
        p *= accept
        gain += p
        v = gain / (cost[k + 1] + k * per_token)
        if v > value:
            best, value = k, v
    return best, value


__all__ = ["CPU_VERIFY_COST", "best_k", "measure_verify_cost", "verify_cost_of"]
