"""The Prometheus metrics of `flint serve` (GET /metrics): requests by route and status, generations
by finish reason, queue depth, token counts, queue wait / TTFT / decode-time histograms, and the
speculative-decoding counts. Each server keeps its own registry.

Tests: ``pytest tests/test_server_ops.py``.
"""
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings", "/v1/models", "/health",
          "/metrics", "/tokenize", "/detokenize", "/tokenizer_info")
TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    """The Prometheus metrics of one server, in their own registry (several servers may share a process)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("flint_http_requests", "HTTP requests answered, by route and status code",
                                ["route", "status"], registry=r)
        self.finished = Counter("flint_generations", "generations ended, by finish reason (stop, length, "
                                "cancelled, error, shutdown)", ["reason"], registry=r)
        self.waiting = Gauge("flint_queue_waiting", "generation requests waiting for the engine", registry=r)
        self.running = Gauge("flint_queue_running", "generation requests decoding (0 or 1)", registry=r)
        self.prompt_tokens = Counter("flint_prompt_tokens", "prompt tokens of the generations run", registry=r)
        self.generated = Counter("flint_generation_tokens", "tokens generated", registry=r)
        self.queue_s = Histogram("flint_queue_wait_seconds", "time from admission to the start of the prefill",
                                 buckets=TIME_BUCKETS, registry=r)
        self.ttft_s = Histogram("flint_time_to_first_token_seconds", "prefill and first token, queue wait "
                                "excluded", buckets=TIME_BUCKETS, registry=r)
        self.decode_s = Histogram("flint_decode_seconds", "decode time of a generation after its first token",
                                  buckets=TIME_BUCKETS, registry=r)
        self.tpot_s = Histogram("flint_time_per_output_token_seconds", "decode time per token after the first",
                                buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
                                registry=r)
        self.spec_steps = Counter("flint_spec_verify_steps", "speculative decoding: target verify forwards",
                                  registry=r)
        self.spec_drafted = Counter("flint_spec_draft_tokens", "speculative decoding: draft tokens proposed",
                                    registry=r)
        self.spec_accepted = Counter("flint_spec_accepted_tokens", "speculative decoding: draft tokens accepted",
                                     registry=r)
        self.spec_drafter_steps = Counter("flint_spec_drafter_steps", "speculative decoding: verify steps by the "
                                          "drafter that proposed (none: a plain step)", ["drafter"], registry=r)
        self.spec_tokens_per_step = Gauge("flint_spec_tokens_per_verify_step", "speculative decoding: tokens per "
                                          "verify step since the start (accepted drafts + 1)", registry=r)

    def route(self, path: str) -> str:
        if path.startswith("/v1/models/"):
            return "/v1/models/{id}"
        return path if path in ROUTES else "other"  # bounded label values whatever clients send

    def generation(self, engine, r, wait_s: float, reason: str) -> None:
        self.finished.labels(reason).inc()
        self.queue_s.observe(wait_s)
        if r is None:
            return
        self.prompt_tokens.inc(r.prompt_tokens)
        self.generated.inc(len(r.token_ids))
        if r.token_ids:
            self.ttft_s.observe(r.ttft_s)
        if len(r.token_ids) > 1:
            self.decode_s.observe(r.decode_s)
            self.tpot_s.observe(r.decode_s / (len(r.token_ids) - 1))
        stats = getattr(engine, "last_stats", None)  # a speculative engine's counts for this call
        if stats is not None:
            self.spec_steps.inc(stats.steps)
            self.spec_drafted.inc(stats.drafted)
            self.spec_accepted.inc(stats.accepted)
            for name, n in stats.drafters.items():
                self.spec_drafter_steps.labels(name).inc(n)
            self.spec_tokens_per_step.set(engine.total_stats.tokens_per_step)

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
