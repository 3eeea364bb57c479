"""`flint bench`: batch-1 decode speed per backend and context, against the memory bandwidth
measured in the same run.

For each model x backend x context: fill the KV cache to ``ctx`` (prefill of random tokens), decode
``--tokens`` greedy tokens once untimed (warm-up: compiles and captures every attention bucket
those positions touch), then ``--repeats`` timed passes over the same positions (CUDA events on a
GPU, the host clock on a CPU); the figure is the median pass. The greedy loop (``--loop``, the
``loop`` column): ``device`` (default) where the backend has ``greedy_run`` (compiled, megakernel):
each step's argmax is the next step's input on the GPU and the tokens are read back once per pass,
as gpt-fast's generate loop does; ``host``: every step ends in a host sync (greedy_next, or forward +
argmax), as a loop that must see each token before the next (sampling on the host) does.

* bytes per token = what one decode step reads: the backend's weights as it holds them (int4 codes
  + scales + mins/zeros, LM head included, norms, one embedding row) + K and V at ``ctx`` in the
  cache's format (``--kv-cache``: int8 / fp8 count 1 byte a value and a 2-byte scale a row). A
  backend may say itself (``weight_bytes_per_token``, ``kv_bytes(ctx)``); the reference is counted
  from its tensors (its fp16 cache is held in its dtype: 4 bytes a value in fp32).
* read bandwidth: a torch ``sum`` over a buffer far larger than any cache (4 GiB bf16 on a GPU,
  1 GiB fp32 on a CPU), median of 5. MBU = bytes per token x tok/s / that bandwidth. On a CPU
  the same holds against the CPU's measured memory bandwidth.
* L2: when a backend's weights are smaller than 2x the GPU's L2 (60 MB on the H200: int4
  SmolLM2-135M is ~75 MB), a buffer of 4x L2 is streamed before each timed token and tokens are
  timed one by one, so weights come from HBM, as they would for a big model.
* ``--head-group-size 32,64,128``: one pass per int4 group size of the LM head, the body as it is
  (flint.bench_head says what the int4 backends can stream and what is refused).
* synthetic models (``synthetic:NAME``) are built on the bench device with random int4 codes when
  an int4 backend is asked for (the bf16 backends then run those values dequantized), else bf16.

Prints a llama-bench-style markdown table; ``--json PATH`` writes
``{"device", "hbm_read_GBps", "results": [{"model", "backend", "ctx", "loop", "tok_s", "ms_per_token",
"bytes_per_token", "mbu"}]}`` (with ``--kv-cache`` int8 / fp8 also ``"kv_cache"``; the megakernel's rows also ``"placement"``: its scratch sets' step times at load and
the one kept), plus ``"ttft"`` rows with --prompt-len and ``"verify"`` rows with ``--verify 1,2,...,8`` (one forward
of M tokens at every ctx, a speculative verify step of M - 1 drafts: ``"us_per_step"``, ``"x_m1"`` = × the M = 1
step: the verify curve), rewritten after every result; ``--plot PATH.png`` draws tok/s against context per backend with each backend's
bandwidth ceiling (bandwidth / bytes per token) dashed.

Constrained decoding (``--response-format json`` or ``--response-format SCHEMA.json``): per model x backend,
the engine decodes the same prompt greedily without a constraint (``--tokens`` tokens, ignore_eos: the
greedy_run bursts where the backend has them) and under the JSON schema (llguidance's mask each step, the
backend's masked argmax where it has ``set_token_mask``), ``--repeats`` times each after a warm-up, and
reports both decode tok/s (median), their ratio and the grammar's own host time per token (llguidance's
mask fill and advance); every constrained output is parsed and validated against the schema (jsonschema),
and the row counts the valid ones. The built-in schema (``json``) has free strings, bounded integers, an
enum and a boolean. A model without a tokenizer (``synthetic:``) gets the embedded SmolLM2's extended to its
vocabulary size with merges of two tokens (``proxy_tokenizer``: a Granite-size vocabulary for the mask's cost;
its text means nothing). Random weights never close a free string, so on a synthetic model the output is
**forced** (the row says ``"forced": true``; benchmarking only, like ``--draft oracle``): each step llguidance
computes the schema's real mask, then the mask handed to the backend allows only the next token of a fixed
valid document (``FORCED_DOCUMENT``, tokenized; an error if the grammar refuses it), so the grammar does its real
work on realistic text and the device its real masked step. (Bounding the strings instead, maxLength 24, makes
llguidance re-walk the vocabulary on most in-string tokens: 1.5-3 ms spikes at 100k tokens, bench/results.)

Run: ``flint bench --model synthetic:granite-4.1-3b --backend reference,compiled,compiled-bf16
--ctx 512,2048`` (or ``python -m flint.bench ...``); ``flint bench --model synthetic:granite-4.1-3b
--backend megakernel --response-format json``. Test: ``pytest tests/test_bench.py``.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from .assemble import settle_heap
from .backend import BACKENDS, BackendError, check_kv_cache, default_device, make_backend
from .backend_api import ChunkedPrefill, GreedyRun, GreedyStep, KVBytes, MaskedStep, WeightBytes
from .bench_head import INT4_BACKENDS, check_head_backends, head_variants, parse_head_groups
from .errors import FlintError
DEFAULT_BACKENDS = "reference,compiled,compiled-bf16"


class BenchError(FlintError, ValueError):
    pass


# ------------------------------------------------------------------ machine

def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU: {name} ({torch.get_num_threads()} threads)"


def read_bandwidth_GBps(device: torch.device, nbytes: int | None = None, repeats: int = 5) -> float:
    """Streaming read bandwidth in GB/s: median of ``repeats`` sums over an nbytes buffer."""
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    nbytes = nbytes or (4 << 30 if cuda else 1 << 30)
    buf = torch.ones(nbytes // torch.finfo(dtype).bits * 8, dtype=dtype, device=device)
    nbytes = buf.numel() * buf.element_size()
    times = []
    for i in range(repeats + 1):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            buf.sum()
            b.record()
            b.synchronize()
            dt = a.elapsed_time(b) / 1e3
        else:
            t = time.perf_counter()
            buf.sum()
            dt = time.perf_counter() - t
        if i:  # the first is a warm-up
            times.append(dt)
    del buf
    return nbytes / statistics.median(times) / 1e9


# ------------------------------------------------------------------ bytes per token

def _tensor_bytes(t) -> int:
    return t.numel() * t.element_size()


def weight_bytes_per_token(backend) -> int:
    """Bytes of weights one decode step of ``backend`` reads."""
    if isinstance(backend, WeightBytes):
        return int(backend.weight_bytes_per_token)
    from .model import Transformer

    if isinstance(backend, Transformer):
        n = sum(_tensor_bytes(t) for L in backend.layers for t in L.values())
        n += _tensor_bytes(backend.lm_head) + _tensor_bytes(backend.norm)
        return n + backend.embed.shape[1] * backend.embed.element_size()
    raise BenchError(f"backend {getattr(backend, 'name', type(backend).__name__)!r} does not say how many "
                     "bytes a step reads (weight_bytes_per_token)")


def kv_bytes(backend, ctx: int) -> int:
    """Bytes of K and V one decode step reads at context ``ctx``."""
    if isinstance(backend, KVBytes):
        return int(backend.kv_bytes(ctx))
    c = backend.cfg
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * ctx * 2  # (an fp16 cache)


# ------------------------------------------------------------------ timing

def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _stepper(backend):
    """step(token, pos) -> next greedy token (an int: one host sync per token)."""
    if isinstance(backend, GreedyStep):
        return backend.greedy_next

    def step(tok: int, pos: int) -> int:
        logits = backend.forward(torch.tensor([tok], dtype=torch.long), pos)
        return int(torch.argmax(logits[-1]))
    return step


def prefill(backend, start: int, end: int, gen: torch.Generator) -> None:
    """Write random tokens at positions start..end-1 (chunked like the engine)."""
    chunk = (backend.max_chunk if isinstance(backend, ChunkedPrefill) else None) or 1024
    vocab = backend.cfg.vocab_size
    for s in range(start, end, chunk):
        n = min(chunk, end - s)
        backend.forward(torch.randint(0, vocab, (n,), generator=gen), s)


def _check_loop(loop: str) -> None:
    if loop not in ("device", "host"):
        raise BenchError(f"--loop must be 'device' or 'host', got {loop!r}")


def decode_loop(backend, loop: str = "device", flush: torch.Tensor | None = None) -> str:
    """How greedy decoding is timed: "device" when asked for and the backend has greedy_run (each token's
    argmax feeds the next step on the device, as gpt-fast's loop does: no host sync between tokens), else
    "host" (one host round trip per token: greedy_next, or forward + argmax); always "host" with an L2
    flush before each token (tokens are timed one by one then)."""
    _check_loop(loop)
    return "device" if loop == "device" and flush is None and isinstance(backend, GreedyRun) else "host"


def time_decode(backend, ctx: int, n_tokens: int, repeats: int, device: torch.device,
                flush: torch.Tensor | None = None, loop: str = "device") -> float:
    """Median seconds per decoded token at positions ctx..ctx+n-1 (cache assumed filled to ctx).
    loop: see decode_loop."""
    step = _stepper(backend)
    cuda = device.type == "cuda"
    on_device = decode_loop(backend, loop, flush) == "device"

    def one_pass(timed: bool) -> float:
        tok = 1
        if on_device:
            if cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                _sync(device)
                a.record()
                backend.greedy_run(tok, ctx, n_tokens)  # (returns after its one sync)
                b.record()
                b.synchronize()
                return a.elapsed_time(b) / 1e3
            t = time.perf_counter()
            backend.greedy_run(tok, ctx, n_tokens)
            return time.perf_counter() - t
        if not timed:
            for i in range(n_tokens):
                tok = step(tok, ctx + i)
            return 0.0
        if cuda and flush is not None:  # each token alone, L2 flushed before it
            evs = []
            for i in range(n_tokens):
                flush.sum()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                tok = step(tok, ctx + i)
                b.record()
                evs.append((a, b))
            _sync(device)
            return sum(a.elapsed_time(b) for a, b in evs) / 1e3
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            _sync(device)
            a.record()
            for i in range(n_tokens):
                tok = step(tok, ctx + i)
            b.record()
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        t = time.perf_counter()
        for i in range(n_tokens):
            tok = step(tok, ctx + i)
        return time.perf_counter() - t

    one_pass(timed=False)
    return statistics.median(one_pass(timed=True) for _ in range(repeats)) / n_tokens


def time_verify(backend, ctx: int, m: int, repeats: int, device: torch.device, gen: torch.Generator,
                iters: int = 10) -> float:
    """Median seconds of one forward of m tokens at positions ctx..ctx+m-1 (a speculative verify step of m - 1
    drafts; the cache assumed filled to ctx): 3 warm-up forwards, then ``repeats`` timed bursts of ``iters``."""
    toks = torch.randint(0, backend.cfg.vocab_size, (m,), generator=gen)
    for _ in range(3):
        backend.forward(toks, ctx)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            _sync(device)
            a.record()
            for _ in range(iters):
                backend.forward(toks, ctx)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3 / iters)
        else:
            t = time.perf_counter()
            for _ in range(iters):
                backend.forward(toks, ctx)
            times.append((time.perf_counter() - t) / iters)
    return statistics.median(times)


def time_ttft(backend, prompt_len: int, device: torch.device, gen: torch.Generator, repeats: int = 3) -> float:
    """Median seconds from a prompt of prompt_len random tokens to its first token (cold cache)."""
    chunk = (backend.max_chunk if isinstance(backend, ChunkedPrefill) else None) or prompt_len
    prompt = torch.randint(0, backend.cfg.vocab_size, (prompt_len,), generator=gen)
    times = []
    for i in range(repeats + 1):
        _sync(device)
        t = time.perf_counter()
        logits = None
        for s in range(0, prompt_len, chunk):
            logits = backend.forward(prompt[s: s + chunk], s)
        int(torch.argmax(logits[-1]))
        if i:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


# ------------------------------------------------------------------ the run

def _parse_list(s: str, what: str, conv=str) -> list:
    items = [x.strip() for x in s.split(",") if x.strip()]
    if not items:
        raise BenchError(f"--{what}: empty list")
    try:
        return [conv(x) for x in items]
    except ValueError:
        raise BenchError(f"--{what}: {s!r} is not a comma-separated list of integers") from None


# a synthetic model whose weights exceed this share of the GPU's memory is generated there and parked in host
# memory, so a backend's repacked copy and the generated one are not on the device at once (70B-class int4: 37 GB)
HOST_PARK_SHARE = 0.25


def load_bench_model(spec: str | None, int4_group_size: int | None, device: torch.device, seed: int = 0):
    if spec and spec.startswith("synthetic:"):
        from .synthetic import synthetic_bytes, synthetic_config, synthetic_model

        name = spec[len("synthetic:"):]
        store = None
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            if synthetic_bytes(synthetic_config(name), int4_group_size) > HOST_PARK_SHARE * total:
                store = "cpu"
        return synthetic_model(name, seed, int4_group_size=int4_group_size, dtype=torch.bfloat16, device=device,
                               store=store)
    from .loading import load_model

    return load_model(spec)


def run_bench(models: list[str | None], backends: list[str], ctxs: list[int], n_tokens: int = 32,
              repeats: int = 3, prompt_len: int | None = None, device: str | None = None,
              group_size: int = 128, json_path: str | None = None, bw_bytes: int | None = None,
              seed: int = 0, log=print, loop: str = "device", verify: list[int] | None = None,
              kv_cache: str = "fp16", head_groups: list[int] | None = None) -> dict:
    """Run the benchmark; returns the JSON document (also written to json_path after every row). verify: token
    counts M of a verify step to time at every ctx (the "verify" rows: µs per step and the ratio to M = 1).
    kv_cache: the KV cache format of every backend (flint.model.KV_CACHE_FORMATS). head_groups: one pass per
    int4 group size of the LM head (flint.bench_head)."""
    for b in backends:
        if b not in BACKENDS:
            raise BackendError(f"unknown backend {b!r}; choose from {', '.join(BACKENDS)}")
        check_kv_cache(b, kv_cache)
    if n_tokens < 1 or repeats < 1:
        raise BenchError("--tokens and --repeats must be >= 1")
    if any(c < 0 for c in ctxs):
        raise BenchError(f"--ctx values must be >= 0, got {ctxs}")
    if prompt_len is not None and prompt_len < 1:
        raise BenchError("--prompt-len must be >= 1")
    _check_loop(loop)
    if head_groups:
        check_head_backends(backends)
    verify = sorted(set(verify or []))
    if any(m < 1 or m > 64 for m in verify):
        raise BenchError(f"--verify values must be token counts 1..64, got {verify}")
    dev = torch.device(device or default_device())
    doc = {"device": device_name(dev), "hbm_read_GBps": 0.0, "results": []}
    if verify:
        doc["verify"] = []
    if prompt_len:
        doc["ttft"] = []

    def save():
        if json_path:
            Path(json_path).write_text(json.dumps(doc, indent=2) + "\n")

    gen = torch.Generator().manual_seed(seed)
    int4_needed = any(b in INT4_BACKENDS for b in backends)
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size if dev.type == "cuda" else 0
    need = max(max(ctxs) + max([n_tokens] + verify), prompt_len or 0)

    def check_context(cfg, name):
        if need > cfg.max_position_embeddings:
            raise BenchError(f"--ctx {max(ctxs)} + --tokens {n_tokens} (or --verify, --prompt-len) needs {need} positions; "
                             f"model {name} has a context of {cfg.max_position_embeddings}")

    from .synthetic import synthetic_config

    for spec in models:  # synthetic shapes are checked before anything is built
        if spec and spec.startswith("synthetic:"):
            check_context(synthetic_config(spec[len("synthetic:"):]), spec)
    doc["hbm_read_GBps"] = round(read_bandwidth_GBps(dev, bw_bytes), 1)
    log(f"flint bench: {doc['device']}, read bandwidth {doc['hbm_read_GBps']:.1f} GB/s", file=sys.stderr)
    for spec in models:
        lm = load_bench_model(spec, group_size if int4_needed else None, dev, seed)
        check_context(lm.cfg, spec or "embedded:smollm2")
        for name, head, hlm in head_variants(lm, spec or "embedded:smollm2", head_groups):
            first = len(doc["results"])
            for bname in backends:
                try:
                    if isinstance(hlm, Exception):
                        raise hlm
                    _bench_backend(doc, save, hlm, name, bname, ctxs, n_tokens, repeats, prompt_len, dev,
                                   need, group_size, gen, l2, log, loop, verify, kv_cache)
                except Exception as e:  # noqa: BLE001
                    # one backend failing (no sm_90 for the megakernel, a compile error) leaves the rest
                    # of the sweep standing; the error is printed and recorded, and the exit code is 1
                    doc.setdefault("errors", []).append({"model": name, "backend": bname,
                                                         "error": f"{type(e).__name__}: {e}"})
                    save()
                    why = f"{e}" if isinstance(e, ValueError) else f"\n{traceback.format_exc(limit=-4)}"
                    log(f"flint bench: {name} {bname} failed: {why}", file=sys.stderr)
                gc.collect()
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            for r in doc["results"][first:] if head else ():
                r["head"] = head
            del hlm
        del lm
        gc.collect()
    save()
    return doc


_FLUSH: dict = {}  # the L2-flush buffer, made once


def _bench_backend(doc, save, lm, name, bname, ctxs, n_tokens, repeats, prompt_len, dev, need,
                   group_size, gen, l2, log, loop="device", verify=(), kv_cache="fp16") -> None:
    """All rows of one model x backend."""
    mem = {}
    if dev.type == "cuda":  # the backend's own device memory: what it keeps, and the most it held while loading
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    backend = make_backend(bname, lm, max_seq_len=need, device=str(dev), group_size=group_size, kv_cache=kv_cache)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        resident = torch.cuda.memory_allocated(dev) - before
        peak = torch.cuda.max_memory_allocated(dev) - before
        mem = {"resident_GB": round(resident / 1e9, 3), "peak_GB": round(peak / 1e9, 3),
               "peak_x_resident": round(peak / resident, 3) if resident > 0 else None}
        log(f"  {name} {bname}: {mem['resident_GB']} GB resident on the device, {mem['peak_GB']} GB at the peak "
            f"of loading", file=sys.stderr)
    wbytes = weight_bytes_per_token(backend)
    flush = None
    if dev.type == "cuda" and wbytes < 2 * l2:
        if "buf" not in _FLUSH:
            _FLUSH["buf"] = torch.ones(4 * l2 // 2, dtype=torch.bfloat16, device=dev)
        flush = _FLUSH["buf"]
    if prompt_len:
        ttft = time_ttft(backend, prompt_len, dev, gen)
        doc["ttft"].append({"model": name, "backend": bname, "prompt_len": prompt_len,
                            "ttft_ms": round(ttft * 1e3, 3)})
    filled = 0
    for ctx in sorted(ctxs):
        prefill(backend, filled, ctx, gen)
        filled = ctx
        s = time_decode(backend, ctx, n_tokens, repeats, dev, flush, loop)
        nbytes = wbytes + kv_bytes(backend, ctx)
        tok_s = 1.0 / s
        row = {"model": name, "backend": bname, "ctx": ctx, "loop": decode_loop(backend, loop, flush),
               "tok_s": round(tok_s, 2),
               "ms_per_token": round(s * 1e3, 4), "bytes_per_token": int(nbytes),
               "mbu": round(nbytes * tok_s / (doc["hbm_read_GBps"] * 1e9), 4)}
        row.update(mem)
        if kv_cache != "fp16":
            row["kv_cache"] = kv_cache
        if getattr(backend, "placement", None):  # the megakernel's scratch sets timed at load (docs/bench.md)
            row["placement"] = backend.placement
        if bname == "megakernel" and backend.cfg.num_layers >= 3:  # the chain figure (docs/bench.md)
            row["chain_us_per_layer"] = round(backend.chain_us(ctx), 3)
        doc["results"].append(row)
        save()
        log(f"  {name} {bname} ctx {ctx}: {row['tok_s']} tok/s, {row['ms_per_token']} ms/token, "
            f"MBU {row['mbu']:.1%}" + (" (L2 flushed before each token)" if flush is not None else ""),
            file=sys.stderr)
        base = None
        for m in verify:  # the verify curve: one forward of m tokens (m - 1 drafts) against m = 1
            limit = backend.max_chunk if isinstance(backend, ChunkedPrefill) else None
            if limit is not None and m > limit:
                doc["verify"].append({"model": name, "backend": bname, "ctx": ctx, "m": m, "us_per_step": None,
                                      "note": f"the backend takes at most {limit} tokens per forward"})
                continue
            us = time_verify(backend, ctx, m, repeats, dev, gen) * 1e6
            base = us if m == 1 else base
            doc["verify"].append({"model": name, "backend": bname, "ctx": ctx, "m": m, "us_per_step": round(us, 1),
                                  "x_m1": round(us / base, 3) if base else None})
            save()


def ratio_rows(doc: dict) -> list[dict]:
    """Each backend's decode speed against `compiled` (the int4 torch.compile baseline) at the same model and ctx.
    A backend named more than once in one run (``--backend compiled,megakernel,compiled,megakernel``: the passes
    interleave, so slow drift of the card meets both) counts with the median of its rows."""
    speeds: dict = {}
    for r in doc["results"]:
        speeds.setdefault((r["model"], r["ctx"]), {}).setdefault(r["backend"], []).append(r["tok_s"])
    out = []
    for (model, ctx), by in speeds.items():
        if "compiled" not in by:
            continue
        base = statistics.median(by["compiled"])
        for b, v in by.items():
            if b != "compiled" and base > 0:
                med = statistics.median(v)
                out.append({"model": model, "ctx": ctx, "backend": b, "tok_s": med, "x_compiled": med / base})
    return out


def markdown_table(doc: dict) -> str:
    lines = [f"device: {doc['device']} · measured read bandwidth {doc['hbm_read_GBps']:.1f} GB/s", "",
             "| model | backend | ctx | loop | tok/s | ms/token | GB/token | MBU | chain µs/layer |",
             "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in doc["results"]:
        kv = r.get("kv_cache", "fp16")
        bname = r["backend"] + ("" if kv == "fp16" else f" ({kv} KV cache)")
        lines.append(f"| {r['model']} | {bname} | {r['ctx']} | {r.get('loop', 'host')} | {r['tok_s']:.2f} | "
                     f"{r['ms_per_token']:.3f} | {r['bytes_per_token'] / 1e9:.4f} | {r['mbu']:.1%} | "
                     f"{r['chain_us_per_layer'] if r.get('chain_us_per_layer') is not None else '-'} |")
    ratios = ratio_rows(doc)
    if ratios:
        lines += ["", "| model | ctx | backend | tok/s | × compiled |", "| --- | ---: | --- | ---: | ---: |"]
        for r in ratios:
            lines.append(f"| {r['model']} | {r['ctx']} | {r['backend']} | {r['tok_s']:.2f} | {r['x_compiled']:.3f}× |")
    if doc.get("ttft"):
        lines += ["", "| model | backend | prompt tokens | TTFT ms |", "| --- | --- | ---: | ---: |"]
        for r in doc["ttft"]:
            lines.append(f"| {r['model']} | {r['backend']} | {r['prompt_len']} | {r['ttft_ms']:.2f} |")
    return "\n".join(lines)


def verify_table(doc: dict) -> str:
    """The verify curve: µs per forward of M tokens and its ratio to M = 1, per model, backend and ctx."""
    rows = doc.get("verify") or []
    if not rows:
        return ""
    ms = sorted({r["m"] for r in rows})
    keys = list(dict.fromkeys((r["model"], r["backend"], r["ctx"]) for r in rows))
    out = ["| model | backend | ctx | " + " | ".join(f"M = {m}" for m in ms) + " |",
           "|---|---|---:|" + "---:|" * len(ms)]
    for key in keys:
        cells = []
        for m in ms:
            r = next((r for r in rows if (r["model"], r["backend"], r["ctx"]) == key and r["m"] == m), None)
            if r is None or r["us_per_step"] is None:
                cells.append("—")
            else:
                cells.append(f"{r['us_per_step']:.1f} µs" + (f" ({r['x_m1']:.2f}×)" if r.get("x_m1") else ""))
        out.append(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n\nverify: one forward of M tokens (M - 1 drafts and the target's token), × its M = 1 step."


def plot(doc: dict, path: str) -> None:
    """tok/s against context, one line per backend, one panel per model; dashed: bandwidth ceiling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in doc["results"]))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    bw = doc["hbm_read_GBps"] * 1e9
    for ax, model in zip(axes[0], models):
        rows = [r for r in doc["results"] if r["model"] == model]
        for i, b in enumerate(dict.fromkeys(r["backend"] for r in rows)):
            rs = sorted((r for r in rows if r["backend"] == b), key=lambda r: r["ctx"])
            x = [r["ctx"] for r in rs]
            color = f"C{i}"
            ax.plot(x, [r["tok_s"] for r in rs], "o-", color=color, label=b)
            ax.plot(x, [bw / r["bytes_per_token"] for r in rs], "--", color=color, alpha=0.6,
                    label=f"{b}: bandwidth ceiling")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens in the KV cache)")
        ax.set_ylabel("decode tok/s (batch 1)")
        ax.set_title(model, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{doc['device']} · read bandwidth {doc['hbm_read_GBps']:.0f} GB/s", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------ CLI

def run_draft_bench(model: str | None, backends: list[str], draft_path: str, k: int | list[int] | None,
                    per_kind: int, max_new_tokens: int, device: str | None = None,
                    group_size: int = 128, draft_vocab: list[int | None] | None = None,
                    temperature: float = 0.0, seed: int = 0, top_p: float = 1.0, top_k: int = 0,
                    rounds: int = 1, log=print, prompt_set: str = "v1", split: str = "eval") -> dict:
    """Speculative vs plain decoding on held-out draft prompts (flint.speculative.draft_data.eval_prompts;
    ``prompt_set`` workloads: the workload conversations, ``split`` eval or train), per
    backend, k and drafting-vocabulary size: tokens per verify step (accepted drafts + the target's
    own token), acceptance rate, decode tok/s of both, and (greedy) whether the outputs were
    identical. ``temperature`` > 0 samples (lossless speculative sampling; plain samples too), with ``top_p`` /
    ``top_k`` if given. ``rounds`` > 1 runs the prompt set that many times (each prompt speculative then plain):
    tok/s are the rounds' medians, each round's kept as spec_tok_s_rounds / plain_tok_s_rounds / x_plain_rounds."""
    if rounds < 1:
        raise BenchError(f"--repeats {rounds}: the draft bench's rounds must be >= 1")
    from .speculative.draft_head import load_draft
    from .speculative.draft_data import eval_prompts
    from .speculative.draft_train import eval_acceptance
    from .engine import SamplingParams
    from .loading import load_model

    if (top_p != 1.0 or top_k) and not temperature:
        raise BenchError("--top-p / --top-k shape sampling: they need --temperature > 0")
    sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                        seed=seed).validate()
    lm = load_model(model)
    if lm.tokenizer is None:
        raise BenchError(f"--draft needs a model with a tokenizer (real prompts); {model!r} has none")
    dev = device or default_device()
    ks = k if isinstance(k, list) else [k]
    doc = {"device": device_name(torch.device(dev)), "model": model or "embedded:smollm2",
           "draft": draft_path, "temperature": temperature, "top_p": top_p, "top_k": top_k,
           "prompt_set": prompt_set, "split": split, "max_new_tokens": max_new_tokens, "speculative": []}
    prompts = eval_prompts(per_kind, prompt_set=prompt_set, split=split)
    for bname in backends:
        backend = make_backend(bname, lm, max_seq_len=2048, device=dev, group_size=group_size)
        for nv in draft_vocab or [None]:
            draft = load_draft(draft_path, lm.cfg, lm.params, device=backend.device, draft_vocab=nv)
            settle_heap()  # (no full collection of the model's objects inside a timed decode)
            nv_used = getattr(draft, "draft_vocab_size", None)
            for kk in ks:
                kk = kk or getattr(getattr(draft, "cfg", None), "k_default", 4)
                tables = [eval_acceptance(backend, lm.tokenizer, draft, prompts, kk, max_new_tokens=max_new_tokens,
                                          sp=sp, log=lambda *a, **kw: log(*a, file=sys.stderr))
                          for _ in range(rounds)]
                table = tables[0] if rounds == 1 else _median_rounds(tables)
                for kind, row in table.items():
                    doc["speculative"].append({"backend": bname, "k": kk, "draft_vocab": nv_used, "kind": kind,
                                               **row})
                log(f"  {bname} k={kk} draft_vocab={nv_used}: {table.get('all')}", file=sys.stderr)
    if rounds > 1:
        doc["rounds"] = rounds
    return doc


def _median_rounds(tables: list[dict]) -> dict:
    """Per kind: the first round's row (acceptance: the same text every round at a fixed seed) with its tok/s replaced
    by the rounds' medians, and every round's tok/s and speculative / plain ratio kept."""
    out = {}
    for kind, row in tables[0].items():
        rows = [t[kind] for t in tables if kind in t]
        spec = [r["spec_tok_s"] for r in rows]
        new = {**row, "spec_tok_s": statistics.median(spec), "spec_tok_s_rounds": spec}
        if row.get("plain_tok_s") is not None:
            plain = [r["plain_tok_s"] for r in rows]
            new.update(plain_tok_s=statistics.median(plain), plain_tok_s_rounds=plain,
                       x_plain_rounds=[round(a / b, 4) for a, b in zip(spec, plain)])
        out[kind] = new
    return out


def run_oracle_bench(model: str, backends: list[str], ks: list[int], accepts: list[float], n_prompts: int,
                     max_new_tokens: int, device: str | None = None, group_size: int = 128, seed: int = 0,
                     draft_vocab: int = 8192, log=print) -> dict:
    """Speculative vs plain greedy decoding with ORACLE acceptance (flint.speculative.oracle; benchmarking only): a
    random draft shaped like the shipped one (one MLP block of the target's intermediate size, a ``draft_vocab``-row
    head) runs its rollout, and its proposals are replaced by the target's own continuation, each kept with
    probability ``accept``. Random prompts of 32 token ids; plain is Engine.generate of the same run (greedy_run bursts)."""
    from .speculative.draft_head import DraftHead, draft_config_for
    from .engine import Engine, SamplingParams
    from .speculative.oracle import OracleDraft, expected_tokens_per_step
    from .speculative.verify import SpeculativeEngine

    dev = torch.device(device or default_device())
    lm = load_bench_model(model, group_size, dev, seed)
    cfg = lm.cfg
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, cfg.vocab_size, (32,), generator=g).tolist() for _ in range(n_prompts)]
    sp = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    doc = {"device": device_name(dev), "model": model, "oracle": True,
           "note": "ORACLE acceptance (benchmarking only): the draft's rollout runs, its proposals are replaced by "
                   "the target's own greedy continuation, each kept with probability oracle_accept",
           "speculative": []}
    for bname in backends:
        backend = make_backend(bname, lm, max_seq_len=32 + max_new_tokens + 16, device=str(dev), group_size=group_size)
        plain = Engine(backend)
        plain.generate(prompts[0], dataclasses.replace(sp, max_new_tokens=8))  # warm-up
        refs, plain_s = [], 0.0
        for pr in prompts:
            plain.cached = []
            res = plain.generate(pr, sp)
            refs.append(pr + res.token_ids)
            plain_s += res.decode_s
        plain_tok_s = n_prompts * (max_new_tokens - 1) / plain_s
        torch.manual_seed(seed)
        inner = DraftHead(draft_config_for(cfg)).to(backend.device, torch.bfloat16)
        nv = draft_vocab if 0 < draft_vocab < cfg.vocab_size else None
        vocab = torch.randperm(cfg.vocab_size, generator=g)[:nv] if nv else None
        inner.attach_target(cfg, lm.params, device=backend.device, dtype=torch.bfloat16, vocab=vocab)
        for k in ks:
            for a in accepts:
                steps = acc = tokens = 0
                spec_s = 0.0
                identical = off = 0
                for i, pr in enumerate(prompts):
                    draft = OracleDraft(inner, refs[i], a, cfg.vocab_size, seed=seed + i)
                    eng = SpeculativeEngine(backend, None, draft, k=k)
                    if i == 0:  # warm-up: the draft's graphs for every k reached
                        eng.generate(pr, dataclasses.replace(sp, max_new_tokens=2 * k + 2))
                    eng.cached = []
                    res = eng.generate(pr, sp)
                    st = eng.last_stats
                    steps, acc, tokens = steps + st.steps, acc + st.accepted, tokens + len(res.token_ids) - 1
                    spec_s += res.decode_s
                    identical += int(pr + res.token_ids == refs[i])
                    off += draft.off_reference
                row = {"backend": bname, "k": k, "oracle_accept": a, "draft_vocab": nv or cfg.vocab_size,
                       "prompts": n_prompts, "tokens_per_step": round((acc + steps) / steps, 3),
                       "expected_tokens_per_step": round(expected_tokens_per_step(a, k), 3),
                       "spec_tok_s": round(tokens / spec_s, 1), "plain_tok_s": round(plain_tok_s, 1),
                       "identical_to_plain": f"{identical}/{n_prompts}"}
                if off:
                    row["off_reference_proposals"] = off
                doc["speculative"].append(row)
                log(f"  {bname} k={k} oracle_accept={a}: {row}", file=sys.stderr)
    return doc


def draft_table(doc: dict) -> str:
    cols = ["backend", "k", "draft_vocab", "kind", "prompts", "tokens_per_step", "accept_rate", "spec_tok_s",
            "plain_tok_s", "x_plain", "identical_to_plain", "drafters"]
    if doc.get("oracle"):
        cols = [c if c != "kind" else "oracle_accept" for c in cols if c != "accept_rate"]
        cols.insert(cols.index("tokens_per_step") + 1, "expected_tokens_per_step")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in doc["speculative"]:
        r = dict(r)
        if r.get("spec_tok_s") and r.get("plain_tok_s"):
            r["x_plain"] = f"{r['spec_tok_s'] / r['plain_tok_s']:.2f}x"
        if isinstance(r.get("drafters"), dict):
            r["drafters"] = " ".join(f"{k} {v:.0%}" for k, v in r["drafters"].items())
        lines.append("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    note = "\n\n" + doc["note"] + "." if doc.get("oracle") else ""
    return "\n".join(lines) + "\n\ntokens_per_step counts the target's own token (1 + accepted drafts)." + note


# ------------------------------------------------------------------ constrained decoding

BENCH_SCHEMA = {"type": "object",
                "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                               "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
                               "kind": {"enum": ["capital", "port", "village"]}, "coastal": {"type": "boolean"}},
                "required": ["city", "country", "population", "kind", "coastal"], "additionalProperties": False}
# strings of at most 24 characters: what random weights would need to end a document unforced, and what costs
# llguidance most per token (lab/studies/constrained_host_cost.py, lab/constrained_trace.py --bounded)
BENCH_SCHEMA_BOUNDED = {**BENCH_SCHEMA, "properties": {**BENCH_SCHEMA["properties"],
                                                       "city": {"type": "string", "maxLength": 24},
                                                       "country": {"type": "string", "maxLength": 24}}}
BENCH_PROMPT = "Describe Lisbon as a JSON object: city, country, population, kind, coastal."
FORCED_DOCUMENT = {"city": "Lisbon", "country": "Portugal", "population": 545923, "kind": "capital", "coastal": True}


class ForcedConstraint:
    """A constraint whose every mask allows one token: the next of ``ids`` (then eos), after the real grammar's mask
    has been computed and checked to allow it (the module doc: synthetic models). Its ``seconds`` are the real
    grammar's."""

    def __init__(self, constraint, ids: list[int], eos: int):
        self.inner, self.ids, self.eos = constraint, list(ids), eos

    @property
    def seconds(self) -> float:
        return self.inner.seconds

    @seconds.setter
    def seconds(self, v: float) -> None:
        self.inner.seconds = v

    def matcher(self):
        return _ForcedMatcher(self.inner.matcher(), self.ids, self.eos)


class _ForcedMatcher:
    """ForcedConstraint's matcher: the real one's mask, checked to allow the forced token, then only that token."""

    def __init__(self, inner, ids: list[int], eos: int):
        self.inner, self.ids, self.eos, self.n = inner, ids, eos, 0

    def fill(self, mask):
        self.inner.fill(mask)
        t = self.ids[self.n] if self.n < len(self.ids) else self.eos
        if not (int(mask[t >> 5]) >> (t & 31)) & 1:
            raise BenchError(f"the forced document's token {self.n} ({t}) is not allowed by the schema")
        mask.zero_()
        bit = 1 << (t & 31)
        mask[t >> 5] = bit - (1 << 32) if bit >= 1 << 31 else bit  # (int32 words)
        return mask

    def consume(self, token):
        self.inner.consume(token)
        self.n += 1

    done = property(lambda self: self.inner.done)
    accepting = property(lambda self: self.inner.accepting)


def proxy_tokenizer(vocab_size: int):
    """The embedded SmolLM2 tokenizer grown to ``vocab_size`` tokens with merges of two of its first 20000
    tokens (seeded): a vocabulary of a real model's size and byte-level shape, for timing grammar masks."""
    import random

    from tokenizers import Tokenizer as HFTokenizer

    from .loading import load_model
    from .tokenizer import Tokenizer

    base = load_model("embedded:smollm2").tokenizer
    spec = json.loads(base.tk.to_str())
    vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
    if vocab_size < len(vocab):
        raise BenchError(f"proxy tokenizer: vocabulary {vocab_size} is smaller than SmolLM2's {len(vocab)}")
    pool = [t for t, i in sorted(vocab.items(), key=lambda kv: kv[1])[:20000] if i >= 32]  # not specials
    rng, n = random.Random(0), len(vocab)
    while n < vocab_size:
        a, b = rng.choice(pool), rng.choice(pool)
        if a + b not in vocab:
            vocab[a + b] = n
            merges.append([a, b] if merges and isinstance(merges[0], list) else f"{a} {b}")
            n += 1
    return Tokenizer(HFTokenizer.from_str(json.dumps(spec)), base.chat_template, base.bos_token, base.eos_token,
                     base.eos_token_ids)


def run_constrained_bench(models: list[str | None], backends: list[str], schema: dict | None, n_tokens: int = 64,
                          repeats: int = 3, device: str | None = None, group_size: int = 128, seed: int = 0,
                          log=print, prompt: str = BENCH_PROMPT) -> dict:
    """Constrained against unconstrained decode tok/s in one run (see the module doc); returns the JSON doc."""
    from .engine import Engine, SamplingParams
    from .grammar import Grammars

    try:
        import jsonschema
    except ImportError:
        raise BenchError("--response-format validates every output with jsonschema: pip install jsonschema") from None
    given = schema
    if given is not None:
        jsonschema.Draft202012Validator.check_schema(given)
    dev = torch.device(device or default_device())
    doc = {"device": device_name(dev), "constrained": []}
    for spec in models:
        lm = load_bench_model(spec, group_size if any(b in INT4_BACKENDS for b in backends) else None, dev, seed)
        name = spec or "embedded:smollm2"
        tok = lm.tokenizer or proxy_tokenizer(lm.cfg.vocab_size)
        forced = lm.tokenizer is None  # random weights: the output is forced (the module doc)
        if forced and given is not None:
            raise BenchError(f"--response-format SCHEMA on {name}: a random-weight model needs the built-in schema "
                             "(its output is forced to a document valid for it); use --response-format json")
        schema = given or BENCH_SCHEMA
        eos = tok.eos_token_ids[:1]
        ids = tok.encode_chat([{"role": "user", "content": prompt}]) if tok.chat_template else tok.encode(prompt)
        grammars = Grammars(tok, lm.cfg.vocab_size, eos[0])
        constraint = grammars.json_schema(schema, "--response-format")
        if forced:
            constraint = ForcedConstraint(constraint, tok.encode(json.dumps(FORCED_DOCUMENT)), eos[0])
        for bname in backends:
            backend = make_backend(bname, lm, max_seq_len=len(ids) + 4 * n_tokens + 8, device=str(dev),
                                   group_size=group_size)
            engine = Engine(backend, tok, eos_token_ids=eos)
            free = SamplingParams(max_new_tokens=n_tokens, ignore_eos=True)
            bound = SamplingParams(max_new_tokens=4 * n_tokens, constraint=constraint)
            engine.generate(ids, free)  # warm-up: compiles, captures, places scratch
            engine.generate(ids, bound)
            plain, masked, valid, lengths, errors, grammar_s = [], [], 0, [], [], []
            for _ in range(repeats):
                engine.cached = []  # the same prefill every pass
                plain.append(engine.generate(ids, free).decode_tok_s)
                engine.cached = []
                constraint.seconds = 0.0
                r = engine.generate(ids, bound)
                masked.append(r.decode_tok_s)
                grammar_s.append(constraint.seconds / max(1, len(r.token_ids)))
                lengths.append(len(r.token_ids))
                try:
                    jsonschema.validate(json.loads(r.text), schema)
                    valid += 1
                except (ValueError, jsonschema.ValidationError) as e:
                    errors.append(f"{type(e).__name__}: {str(e)[:120]} in {r.text[:200]!r}")
            row = {"model": name, "backend": bname, "unconstrained_tok_s": round(statistics.median(plain), 2),
                   "constrained_tok_s": round(statistics.median(masked), 2),
                   "ratio": round(statistics.median(masked) / statistics.median(plain), 4),
                   "kernel_mask": isinstance(backend, MaskedStep),
                   "grammar_us_per_token": round(statistics.median(grammar_s) * 1e6, 1),
                   "outputs": repeats, "valid": valid, "constrained_tokens": lengths, "vocab": lm.cfg.vocab_size,
                   "schema": schema, "forced": forced}
            if errors:
                row["invalid"] = errors
            doc["constrained"].append(row)
            log(f"  {name} {bname}: unconstrained {row['unconstrained_tok_s']} tok/s, constrained "
                f"{row['constrained_tok_s']} tok/s ({row['ratio']:.1%}), {valid}/{repeats} outputs valid",
                file=sys.stderr)
            del engine, backend
            gc.collect()
        del lm
        gc.collect()
    return doc


def constrained_table(doc: dict) -> str:
    lines = ["| model | backend | vocab | unconstrained tok/s | constrained tok/s | ratio | grammar us/token | "
             "kernel mask | valid |", "|---|---|---|---|---|---|---|---|---|"]
    for r in doc["constrained"]:
        lines.append(f"| {r['model']}{' (forced)' if r.get('forced') else ''} | {r['backend']} | {r['vocab']} | "
                     f"{r['unconstrained_tok_s']} | "
                     f"{r['constrained_tok_s']} | {r['ratio']:.1%} | {r['grammar_us_per_token']} | "
                     f"{'yes' if r['kernel_mask'] else 'no'} | {r['valid']}/{r['outputs']} |")
    return "\n".join(lines)


def default_backends(device: torch.device) -> str:
    from .backend import cuda_sm90

    return DEFAULT_BACKENDS + (",megakernel" if device.type == "cuda" and cuda_sm90() else "")


# the options each bench mode reads (flint.options.refuse_unused refuses any other given a value)
_MODE_OPTIONS = {
    "oracle_accept": ("with --draft oracle",),
    **dict.fromkeys(("draft_k", "draft_vocab", "draft_prompts"), ("with --draft oracle", "with --draft PATH")),
    "temperature": ("with --draft PATH",),
    **dict.fromkeys(("bw_gib", "verify", "plot", "ctx", "prompt_len"), ("in plain decode timing",)),
}


# the comma-list options: (item type, lowest, highest) of each item
_LIST_RANGES = {"ctx": (int, 1, None), "draft_k": (int, 1, None), "draft_vocab": (int, 0, None),
                "verify": (int, 1, None), "oracle_accept": (float, 0.0, 1.0)}


def _check_lists(args) -> None:
    """Every item of a comma-list option parses and lies in its range (BenchError naming it)."""
    for dest, (conv, lo, hi) in _LIST_RANGES.items():
        raw = getattr(args, dest, None)
        if raw is None:
            continue
        name = dest.replace("_", "-")
        for v in _parse_list(raw, name, conv):
            if not (math.isfinite(v) and v >= lo and (hi is None or v <= hi)):
                raise BenchError(f"--{name}: {v} is outside [{lo}, {'inf' if hi is None else hi}]")


def _mode(args) -> str:
    return ("with --draft oracle" if args.draft == "oracle" else "with --draft PATH" if args.draft
            else "with --response-format" if getattr(args, "response_format", None) else "in plain decode timing")


def _run(args) -> int:
    if getattr(args, "serve", False):  # through `flint serve` and the openai client: flint.bench_serve
        from .bench_serve import run

        return run(args)
    from .assemble import check_draft_k
    from .options import refuse_unused

    refuse_unused(args, _mode(args), _MODE_OPTIONS)
    _check_lists(args)
    dev = torch.device(args.device or default_device())
    args.backend = args.backend or default_backends(dev)
    head_groups = getattr(args, "head_group_size", None)  # (a Namespace built by hand may lack it)
    if head_groups and (args.draft or args.response_format):
        raise BenchError("--head-group-size times plain decoding; it does not combine with --draft or --response-format")
    top_p, top_k = getattr(args, "top_p", 1.0), getattr(args, "top_k", 0)
    if (top_p != 1.0 or top_k) and (not args.draft or args.draft == "oracle"):
        raise BenchError("--top-p / --top-k shape the sampling of --draft PATH (with --temperature > 0); "
                         "no other bench mode samples with them")
    if (getattr(args, "prompt_set", "v1") != "v1" or getattr(args, "prompt_split", "eval") != "eval") and \
            (not args.draft or args.draft == "oracle"):
        raise BenchError("--prompt-set / --prompt-split choose the prompts of --draft PATH|ngram|suffix|auto; "
                         "no other bench mode reads them")
    if args.draft_k:
        try:
            check_draft_k(args.draft, max(_parse_list(args.draft_k, "draft-k", int)), shown=args.draft_k)
        except ValueError as e:
            raise BenchError(str(e)) from None
    rounds = getattr(args, "repeats", None)  # (a Namespace built by hand may lack it)
    if args.draft == "oracle" and rounds not in (None, 1):
        raise BenchError("--repeats: --draft oracle runs one pass over its prompts (more: --draft-prompts)")
    if not args.draft:
        args.repeats = 3 if rounds is None else rounds
    if args.draft == "oracle":
        if not (args.model or "").startswith("synthetic:"):
            raise BenchError("--draft oracle is for synthetic models (random weights accept nothing); a real model "
                             "measures its real acceptance with --draft PATH")
        if args.temperature:
            raise BenchError("--draft oracle is greedy only (--temperature 0)")
        if args.draft_vocab and len(_parse_list(args.draft_vocab, "draft-vocab", int)) > 1:
            raise BenchError("--draft oracle takes one --draft-vocab size")
        doc = run_oracle_bench(args.model, _parse_list(args.backend, "backend"),
                               _parse_list(args.draft_k, "draft-k", int) if args.draft_k else [4],
                               _parse_list(args.oracle_accept, "oracle-accept", float), args.draft_prompts,
                               args.tokens * 4, device=str(dev), group_size=args.group_size, seed=args.seed,
                               draft_vocab=int(args.draft_vocab) if args.draft_vocab else 8192)
        print(draft_table(doc))
        if args.json:
            Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        return 0
    if args.draft:
        doc = run_draft_bench(args.model, _parse_list(args.backend, "backend"), args.draft,
                              _parse_list(args.draft_k, "draft-k", int) if args.draft_k else None,
                              args.draft_prompts, args.tokens * 4, device=str(dev),
                              group_size=args.group_size,
                              draft_vocab=_parse_list(args.draft_vocab, "draft-vocab", int) if args.draft_vocab else None,
                              temperature=args.temperature, seed=args.seed, top_p=top_p, top_k=top_k,
                              rounds=1 if rounds is None else rounds, prompt_set=getattr(args, "prompt_set", "v1"),
                              split=getattr(args, "prompt_split", "eval"))
        print(draft_table(doc))
        if args.json:
            Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        return 0
    if args.response_format:
        if args.response_format == "json":
            schema = None  # BENCH_SCHEMA, or its bounded-strings form on a synthetic model
        else:
            try:
                schema = json.loads(Path(args.response_format).read_text())
            except (OSError, ValueError) as e:
                raise BenchError(f"--response-format {args.response_format}: not a readable JSON schema file "
                                 f"({e})") from None
        doc = run_constrained_bench([m or None for m in (args.model.split(",") if args.model else [None])],
                                    _parse_list(args.backend, "backend"), schema, args.tokens, args.repeats,
                                    device=str(dev), group_size=args.group_size, seed=args.seed)
        print(constrained_table(doc))
        if args.json:
            Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        return 0 if all(r["valid"] == r["outputs"] for r in doc["constrained"]) else 1
    ctx_default = "128,512,2048,8192" if dev.type == "cuda" else "128,512"
    doc = run_bench(
        models=[m or None for m in (args.model.split(",") if args.model else [None])],
        backends=_parse_list(args.backend, "backend"),
        ctxs=_parse_list(args.ctx or ctx_default, "ctx", int),
        n_tokens=args.tokens, repeats=args.repeats, prompt_len=args.prompt_len, device=str(dev),
        group_size=args.group_size, json_path=args.json,
        bw_bytes=int(args.bw_gib * (1 << 30)) if args.bw_gib else None, seed=args.seed, loop=args.loop,
        verify=_parse_list(args.verify, "verify", int) if args.verify else None, kv_cache=args.kv_cache,
        head_groups=parse_head_groups(head_groups) if head_groups else None)
    print(markdown_table(doc))
    if doc.get("verify"):
        print("\n" + verify_table(doc))
    if args.plot and doc["results"]:
        plot(doc, args.plot)
    return 1 if doc.get("errors") else 0


def register(sub) -> None:
    from .options import add_device_arg, add_group_size_arg, add_kv_cache_arg

    p = sub.add_parser("bench", help="batch-1 decode tok/s, bytes per token and MBU per backend and context",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None,
                   help="model spec(s), comma-separated: synthetic:granite-4.1-3b, synthetic:smollm2-135m, "
                        "a .gguf, a checkpoint directory (default: the embedded SmolLM2)")
    p.add_argument("--backend", default=None, help=f"comma-separated, from {', '.join(BACKENDS)} "
                   f"(default {DEFAULT_BACKENDS}, plus megakernel on a Hopper GPU)")
    p.add_argument("--ctx", default=None, help="contexts, comma-separated (default 128,512,2048,8192 on a GPU, "
                   "128,512 on a CPU)")
    p.add_argument("--tokens", type=int, default=32, help="decoded tokens per timed pass (default 32)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed passes; the median is reported (default 3; with --draft PATH: rounds over the prompt "
                        "set, default 1)")
    p.add_argument("--prompt-len", type=int, default=None, help="also time TTFT for a prompt of this many tokens")
    add_device_arg(p)
    add_group_size_arg(p, "int4 group size for weights quantized at load and synthetic int4 (default 128)")
    p.add_argument("--head-group-size", default=None, metavar="G,...",
                   help="one pass per int4 group size of the LM head (32,64,128; the body as loaded), for the "
                        "int4 backends (compiled, megakernel): bytes per token and tok/s per head variant")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", default=None, metavar="PATH.png", help="plot tok/s against context")
    p.add_argument("--bw-gib", type=float, default=None,
                   help="buffer for the bandwidth measurement in GiB (default 4 on a GPU, 1 on a CPU)")
    p.add_argument("--seed", type=int, default=0, help="seed of synthetic weights and random tokens")
    add_kv_cache_arg(p)
    p.add_argument("--loop", default="device", choices=("device", "host"),
                   help="greedy decode loop: device = each argmax feeds the next step on the GPU, no host sync "
                        "between tokens (gpt-fast's loop; backends with greedy_run), host = one round trip "
                        "per token (default device)")
    p.add_argument("--draft", default=None, metavar="PATH",
                   help="speculative decoding with this draft head (a path or a shipped name, e.g. "
                        "smollm2-135m; ngram: prompt-lookup proposals, no draft model; suffix: suffix-trie proposals, "
                        "no draft model; auto: the drafter flint chooses per step (chat's default); oracle: synthetic models "
                        "only, acceptance set by --oracle-accept, benchmarking only): acceptance and tok/s "
                        "beside plain decoding, on real prompts")
    p.add_argument("--verify", default=None, metavar="M,...",
                   help="also time one forward of M tokens (a verify step of M - 1 drafts) at every ctx, e.g. "
                        "1,2,3,4,5,6,7,8: the verify curve, µs and × the M = 1 step")
    p.add_argument("--draft-k", default=None, metavar="K,...",
                   help="draft tokens per verify step, comma-separated to sweep (default: the draft's)")
    p.add_argument("--draft-vocab", default=None, metavar="N,...",
                   help="drafting vocabulary sizes to compare (default: the draft's own; 0: the full vocabulary)")
    p.add_argument("--oracle-accept", default="0.7", metavar="A,...",
                   help="with --draft oracle (synthetic models, benchmarking only): the probability each draft token "
                        "is kept, comma-separated to sweep (default 0.7: 2.8 tokens per step at k = 4)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="with --draft: sample at this temperature (lossless speculative sampling; default 0 = greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="with --draft and --temperature: nucleus sampling")
    p.add_argument("--top-k", type=int, default=0, help="with --draft and --temperature: top-k sampling (0: off)")
    p.add_argument("--draft-prompts", type=int, default=2, help="held-out prompts per kind (default 2)")
    p.add_argument("--prompt-set", default="v1",
                   help="with --draft: the prompts, v1 or v2 (the draft prompt sets' held-out prompts) or workloads "
                        "(flint/data/workloads.json: input-grounded and open-ended conversations; default v1)")
    p.add_argument("--prompt-split", default="eval", choices=("eval", "train"),
                   help="with --draft --prompt-set workloads: the held-out prompts (eval) or the tuning ones (train)")
    p.add_argument("--response-format", default=None, metavar="json|SCHEMA.json",
                   help="constrained decoding: greedy decode tok/s under a JSON schema (json: a built-in bounded "
                        "one; or a schema file) beside unconstrained in the same run, every output validated; "
                        "exit 1 if any is invalid")
    p.add_argument("--serve", action="store_true",
                   help="stream --tokens through `flint serve` with the openai client: the client's TTFT and tok/s "
                        "beside the engine's (flint.bench_serve)")
    p.set_defaults(func=_run)


def main(argv=None) -> int:
    """`python -m flint.bench` = `flint bench`."""
    from .cli import main as cli_main

    return cli_main(["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
