"""What one `flint serve` process holds: the model and engine (loaded on a thread while /health
answers 503), the grammar compiler, the queue, the metrics, the settings from the command line,
the Host check run without an API key, each token's text and bytes as logprobs report them, and the
tool-call format and reasoning split of the model's chat template (or of --tool-call-parser and
--reasoning-parser).

Used by flint/server/serve.py and flint/server/app.py; tests: ``pytest tests/test_server_ops.py``.
"""
import functools
import ipaddress
import logging
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from .metrics import Metrics
from .queue import Scheduler

log = logging.getLogger("flint.serve")


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte: the printable Latin-1 bytes stand for
    themselves, the other bytes (controls, space, 0x7f-0xa0, 0xad) for 256, 257, ... in byte order."""
    kept = [*range(0x21, 0x7f), *range(0xa1, 0xad), *range(0xae, 0x100)]
    table = {chr(b): b for b in kept}
    shifted = [b for b in range(256) if b not in table.values()]
    table.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return table


class ServerState:
    def __init__(self, model_id: str, api_key: str | None, max_queue: int, default_max_tokens: int = 1024,
                 max_tokens_limit: int = 4096, allow_hosts=(), body_timeout_s: float = 30.0,
                 max_requests: int = 256, tool_parser: str = "auto", reasoning_parser: str = "auto"):
        from .reasoning import PARSER_CHOICES as REASONING_CHOICES
        from .tools import PARSER_CHOICES as TOOL_CHOICES

        for flag, name, choices in (("--tool-call-parser", tool_parser, TOOL_CHOICES),
                                    ("--reasoning-parser", reasoning_parser, REASONING_CHOICES)):
            if name not in choices:
                raise ValueError(f"{flag}: unknown parser {name!r}; use one of {', '.join(choices)}")
        self.tool_parser, self.reasoning_parser = tool_parser, reasoning_parser
        self.model_id = model_id
        self.api_key = api_key
        self.max_queue = max_queue
        self.default_max_tokens = default_max_tokens
        self.max_tokens_limit = max_tokens_limit
        self.allow_hosts = {h.strip().lower().strip("[]").rstrip(".") for h in allow_hosts}
        self.body_timeout_s = body_timeout_s
        self.max_requests = max_requests  # requests in progress at once, /health not counted
        self.created = int(time.time())
        self.lm = None
        self.engine = None
        self.grammars = None  # flint.grammar.Grammars of the model's tokenizer
        self.message_tokens = 0  # template tokens around each chat message, at least (measured at load)
        self.special_ids: set[int] = set()  # the tokenizer's special tokens (a text may leave them out)
        self.scheduler: Scheduler | None = None
        self.ready = threading.Event()
        self.metrics = Metrics()
        self._token_text: dict[int, tuple[str, list[int]]] = {}
        self.should_stop = lambda: False  # set to the server's "shutting down" flag
        self.draining = False  # SIGTERM seen: new requests get 503, the ones in flight finish
        self.in_flight = 0  # HTTP requests being answered, /health not counted (event-loop thread only)
        # admission runs here, one request at a time (parsing, the chat template, tokenizing, grammars): off the
        # event loop, and a burst of large requests takes one core, not all of them
        self.tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="flint-tokenize")

    def load(self, args) -> None:
        from ..assemble import load_engine

        t0 = time.perf_counter()
        lm, backend, engine = load_engine(args, synthetic_text=True)
        if lm.tokenizer is None:
            raise ValueError(f"model {self.model_id!r} has no tokenizer; flint serve needs text in and out")
        lm.tokenizer.max_token_chars  # computed once here, not in the first request
        self.lm, self.engine = lm, engine
        from ..grammar import Grammars

        eos = next((t for t in lm.tokenizer.eos_token_ids if t in engine.eos), min(engine.eos))
        self.grammars = Grammars(lm.tokenizer, lm.cfg.vocab_size, eos)
        try:
            self.grammars.lltok  # built once here (~0.3 s), not in the first constrained request
        except ValueError as e:  # the server still serves unconstrained requests; constrained ones get a 400
            log.warning("%s", e)
        self.message_tokens = self._message_tokens(lm.tokenizer)
        self.special_ids = {i for i, t in lm.tokenizer.tk.get_added_tokens_decoder().items() if t.special}
        self.scheduler = Scheduler(engine, self.max_queue, self.should_stop, self.metrics)
        self.ready.set()
        log.info("model %s ready on backend %s (context %d tokens; tool calls: %s%s; reasoning split: %s) in %.1fs",
                 self.model_id, backend.name, engine.max_seq_len, self.tool_format.name,
                 "" if self.tool_format.native else " through flint's system prompt",
                 "on" if self.reasoning else "off", time.perf_counter() - t0)

    @staticmethod
    def _message_tokens(tok) -> int:
        """The tokens the chat template puts around each message (an empty user and assistant turn, measured
        once): the length pre-check counts them, so a flood of empty messages is refused before tokenizing."""
        turn = [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}]
        try:
            one, three = (len(tok.encode_chat(m, add_generation_prompt=False)) for m in (turn[:1], turn + turn[:1]))
        except Exception:  # no template, or one that refuses these turns: no per-message count
            return 0
        return max(0, (three - one) // 2)

    @functools.cached_property
    def tool_format(self):
        """The tool-call format (flint.server.tools.ToolFormat) of the model's chat template or --tool-call-parser."""
        from .tools import detect_format

        return detect_format(self.lm.tokenizer.chat_template, self.tool_parser)

    @functools.cached_property
    def reasoning(self) -> bool:
        """Whether chat outputs are split into reasoning and content (flint.server.reasoning)."""
        from .reasoning import enabled

        return enabled(self.lm.tokenizer.chat_template, self.reasoning_parser)

    def token_text(self, tid: int) -> tuple[str, list[int]]:
        """A token's text and its UTF-8 bytes, as logprobs report them. A byte-level BPE token may hold
        part of a character: its bytes come from the vocabulary entry, its text shows U+FFFD for them."""
        got = self._token_text.get(tid)
        if got is None:
            tok = self.lm.tokenizer
            piece, raw = tok.tk.id_to_token(tid), None
            if piece is None:
                pass
            elif type(tok.tk.decoder).__name__ == "ByteLevel":
                table = _byte_level_alphabet()
                if all(ch in table for ch in piece):
                    raw = bytes(table[ch] for ch in piece)
            elif re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):  # SentencePiece's byte fallback
                raw = bytes([int(piece[3:5], 16)])
            elif "\u2581" in piece:  # SentencePiece's word mark; decoding one token alone would strip its space
                raw = piece.replace("\u2581", " ").encode()
            if raw is None:
                raw = tok.decode([tid], skip_special_tokens=False).encode()
            got = self._token_text[tid] = (raw.decode("utf-8", errors="replace"), list(raw))
        return got

    def host_allowed(self, host: str) -> bool:
        """Whether a Host (or Origin) name may be served without an API key: a loopback name or
        address, or one given with --allow-host ('*': any)."""
        if self.api_key is not None or "*" in self.allow_hosts:
            return True
        name = host.strip().lower()
        if name.startswith("["):  # [v6]:port
            name = name[1:name.find("]")] if "]" in name else name[1:]
        elif name.count(":") == 1:
            name = name.rsplit(":", 1)[0]
        name = name.rstrip(".")
        if name in self.allow_hosts or name == "localhost" or name.endswith(".localhost"):
            return True
        try:
            return ipaddress.ip_address(name).is_loopback
        except ValueError:
            return False
