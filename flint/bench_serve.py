"""`flint bench --serve`: the decode speed a client of `flint serve` sees, beside the engine's in the same run.

Starts `flint serve` on a free loopback port with the bench's model options (``--model``, ``--backend``,
``--device``, ``--group-size``), then streams ``--tokens`` greedy tokens (ignore_eos) from a
fixed prompt through the official ``openai`` client (SSE, /v1/completions), ``--repeats`` times after one
warm-up request. Per request: the client's time to first token (from sending the request to the first text
chunk) and its tok/s over the chunks after the first (tokens after the first / the time from the first chunk
to the last), and the engine's decode tok/s as the server measured it for the same request (its ``timings``:
``predicted_per_second``). The figures are the medians; the ratio client / engine is what a token's Python,
JSON and SSE work leave of the kernel's speed. Prints a table, and ``--json PATH`` writes
``{"device", "results": [{"model", "backend", "tokens", "ttft_ms", "client_tok_s", "engine_tok_s", "ratio"}]}``.

The server answers text: a synthetic model (``synthetic:NAME``) is served with a byte-level tokenizer of its
vocabulary (flint.synthetic.synthetic_tokenizer; its text is noise, its speed the shape's). Test:
``pytest tests/test_server_compat.py -k bench_serve``.
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "Write a long story about a lighthouse keeper and the sea."
START_TIMEOUT_S = 600  # a model load (and the megakernel's build) before the first request
WARMUP_REQUESTS = 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args, backend: str, log) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "flint", "serve", "--port", str(port), "--max-tokens-limit",
           str(max(4096, args.tokens)), "--backend", backend]
    for flag, value in (("--model", args.model), ("--device", args.device), ("--group-size", args.group_size)):
        if value is not None:
            cmd += [flag, str(value)]
    env = {k: v for k, v in os.environ.items() if k != "FLINT_API_KEY"}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    return proc, f"http://127.0.0.1:{port}"


def _wait_ready(proc: subprocess.Popen, url: str, log_path: str) -> str:
    import httpx

    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"flint serve exited with {proc.returncode}:\n{Path(log_path).read_text()[-2000:]}")
        try:
            r = httpx.get(url + "/health", timeout=5)
            if r.status_code == 200:
                return r.json()["model"]
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"flint serve was not ready within {START_TIMEOUT_S} s")


def _one(client, model: str, tokens: int) -> dict:
    """One streamed request: the client's TTFT and tok/s, the engine's tok/s from the answer's timings."""
    t0 = time.perf_counter()
    first = last = None
    chunks, engine = 0, None
    for chunk in client.completions.create(model=model, prompt=PROMPT, max_tokens=tokens, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}):
        now = time.perf_counter()
        c = chunk.choices[0] if chunk.choices else None
        if c is not None and c.text:
            first = first or now
            last = now
            chunks += 1
        timings = (chunk.model_extra or {}).get("timings")
        if timings:
            engine = timings["predicted_per_second"]
    if first is None or engine is None:
        raise RuntimeError("the stream brought no text or no timings")
    span = last - first
    return {"ttft_ms": (first - t0) * 1e3, "client_tok_s": (tokens - 1) / span if span > 0 else 0.0,
            "engine_tok_s": engine}


def run(args) -> int:
    """`flint bench --serve`: one row per backend of ``--backend`` (default: the server's default backend)."""
    import openai
    import torch

    from .backend import default_backend, default_device

    if args.tokens < 2:
        raise ValueError("--serve: --tokens must be at least 2 (a rate needs two tokens)")
    device = args.device or default_device()
    rows = []
    backends = [b.strip() for b in (args.backend or default_backend(quiet=True)).split(",") if b.strip()]
    for backend in backends:
        with tempfile.NamedTemporaryFile("w+b", prefix="flint-bench-serve-", suffix=".log", delete=False) as log:
            proc, url = _start(args, backend, log)
            try:
                model = _wait_ready(proc, url, log.name)
                client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
                for _ in range(WARMUP_REQUESTS):
                    _one(client, model, args.tokens)
                runs = [_one(client, model, args.tokens) for _ in range(args.repeats or 3)]
            finally:
                proc.terminate()
                proc.wait(30)
        row = {"model": model, "backend": backend, "tokens": args.tokens,
               **{k: statistics.median(r[k] for r in runs) for k in runs[0]}}
        row["ratio"] = row["client_tok_s"] / row["engine_tok_s"] if row["engine_tok_s"] else 0.0
        rows.append(row)
    print("| model | backend | tokens | TTFT ms | client tok/s | engine tok/s | client / engine |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['backend']} | {r['tokens']} | {r['ttft_ms']:.1f} | {r['client_tok_s']:.1f} | "
              f"{r['engine_tok_s']:.1f} | {r['ratio']:.1%} |")
    doc = {"device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu", "results": rows}
    print(json.dumps(doc))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0
