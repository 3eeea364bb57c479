"""The `flint` command: chat, generate, and the subcommands other modules register
(serve, bench, eval, quantize, draft).

    flint chat                      interactive chat on the embedded SmolLM2 (or --model)
    flint chat --selftest           one factual prompt; exit 1 unless the answer is right
    flint generate --prompt TEXT    text to stdout (--chat applies the chat template;
                                    --prompt-file PATH, or - for stdin, instead of --prompt)

A module joins the CLI by exposing ``register(sub)`` (sub: argparse subparsers) that adds its
parser with ``set_defaults(func=fn)``; fn(args) returns the exit code. build_parser() then gives
every leaf subcommand ``--threads`` and a help formatter that shows defaults.

User mistakes never end in a traceback. Those argparse can see (a range, a non-UTF-8 byte in a
text argument, a device that is not there, sampling values) are refused before any model loads,
argparse-style (``flint generate: error: ...``, exit 2); later ones are ValueErrors or OSErrors,
which main() prints as ``flint: error: ...`` with exit 2.
"""
from __future__ import annotations

import argparse
import importlib
import io
import math
import os
import sys

from . import __version__

SUBCOMMAND_MODULES = ("flint.server.serve", "flint.bench", "flint.evaluate", "flint.quant.quantize", "flint.speculative.cli")

SELFTEST_PROMPT = "What is the capital of France? Answer in one sentence."
SELFTEST_KEYWORD = "paris"


# Batch-1 decode is memory-bound: on a 2-core box one thread decodes as fast as two when the box
# is quiet and 2-3x faster when other processes are busy (OpenMP's spin-waiting threads then
# fight them for the cores). Embedded SmolLM2, reference fp32, 1 vs 2 threads: 14.9 vs 14.5 tok/s
# quiet, 12.8 vs 5.6 beside one busy process; on a box already loaded by other jobs 7.9 vs 2.7
# beside one and 3.0 vs 1.1 beside two. Larger machines keep torch's own choice.
SMALL_MACHINE_CORES = 2


class HelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to an option's help unless the help already names its default
    or there is none to show (None, False, an empty list)."""

    @staticmethod
    def shows_default(action) -> bool:
        d = action.default
        return bool(action.option_strings) and not (d is argparse.SUPPRESS or d is None or d is False or d == [])

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text.lower() or not self.shows_default(action):
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """ArgumentParser with HelpFormatter; add_subparsers() hands the class down to subcommands."""

    def __init__(self, *a, **kw):
        kw.setdefault("formatter_class", HelpFormatter)
        super().__init__(*a, **kw)


def int_at_least(lo: int, hi: int | None = None):
    """argparse type: an integer >= lo (and <= hi when given)."""
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}" if hi is None else
                                             f"must be in [{lo}, {hi}], got {v}")
        return v
    return parse


def finite_float(lo: float, hi: float = math.inf, lo_open: bool = False):
    """argparse type: a finite float in [lo, hi] ((lo, hi] with lo_open)."""
    if hi < math.inf:
        span = f"in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
    else:
        span = f"{'>' if lo_open else '>='} {lo:g}"

    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
        if not math.isfinite(v) or v < lo or (lo_open and v == lo) or v > hi:
            raise argparse.ArgumentTypeError(f"must be a finite number {span}, got {s}")
        return v
    return parse


def utf8_error(raw: bytes) -> str | None:
    """None if raw is valid UTF-8, else where it is not: 'byte N (0xXX)'."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"byte {e.start} (0x{raw[e.start]:02x})"
    return None


def text_error(s: str) -> str | None:
    """None if s can be encoded as UTF-8, else where it cannot. Linux hands undecodable bytes
    (in argv, or on stdin with errors=surrogateescape) over as lone surrogates; mapping them back
    gives the byte offset in the input as the user typed it."""
    try:
        s.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        first_bad = e.start
    try:
        return utf8_error(s.encode("utf-8", "surrogateescape"))
    except UnicodeEncodeError:  # a surrogate that no undecodable byte maps to
        return f"character {first_bad} (U+{ord(s[first_bad]):04X}, a lone surrogate)"


def text_arg(s: str) -> str:
    """argparse type: text that the tokenizer can take (refuses non-UTF-8 bytes)."""
    where = text_error(s)
    if where:
        raise argparse.ArgumentTypeError(f"not valid UTF-8 at {where}")
    return s


def nonempty_text_arg(s: str) -> str:
    if not s:
        raise argparse.ArgumentTypeError("must not be empty")
    return text_arg(s)


def read_text(path: str) -> str:
    """The UTF-8 text of file ``path`` ('-' = stdin); a non-UTF-8 byte is an error naming it."""
    name = "stdin" if path == "-" else path
    if path == "-":
        raw = (sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer")
               else sys.stdin.read().encode("utf-8", "surrogateescape"))
    else:
        with open(path, "rb") as fh:
            raw = fh.read()
    where = utf8_error(raw)
    if where:
        raise ValueError(f"{name}: not valid UTF-8 at {where}")
    return raw.decode("utf-8")


def check_device(dev: str) -> None:
    """Raises ValueError unless ``dev`` names a device this machine has (cpu, cuda, cuda:N)."""
    import torch

    try:
        d = torch.device(dev)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device {dev!r}: not a device; use cpu, cuda or cuda:N") from None
    if d.type == "cpu":
        return
    if d.type != "cuda":
        raise ValueError(f"--device {dev!r}: flint runs on cpu or cuda")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        raise ValueError(f"--device {dev!r}: no CUDA GPU is available here; use --device cpu")
    if d.index is not None and d.index >= n:
        raise ValueError(f"--device {dev!r}: this machine has {n} CUDA device(s), cuda:0..cuda:{n - 1}")


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_threads() -> int | None:
    """Torch intra-op threads when --threads is not given: 1 on a small machine (see
    SMALL_MACHINE_CORES), else None (torch's choice). OMP_NUM_THREADS, when set, wins."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    return 1 if available_cores() <= SMALL_MACHINE_CORES else None


def set_threads(n: int | None) -> None:
    import torch

    if n is None:
        return
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(n)
    except RuntimeError:
        pass  # only settable once per process, before inter-op work; decode speed is intra-op


def add_kv_cache_arg(p: argparse.ArgumentParser) -> None:
    from .model import KV_CACHE_FORMATS

    p.add_argument("--kv-cache", default="fp16", choices=KV_CACHE_FORMATS,
                   help="KV cache format: fp16 (the backend's float cache; the reference's is its --dtype), or "
                        "8-bit values with an fp16 scale per row (int8, fp8; the reference backend only; "
                        "docs/eval.md gives their cost)")


def check_kv_cache_arg(args, backend: str | None = None) -> None:
    """Refuses --kv-cache for a backend that cannot hold it, before any model loads."""
    from .backend import BackendError, check_kv_cache, default_backend

    if args.kv_cache == "fp16":
        return
    try:
        check_kv_cache(backend or default_backend(quiet=True), args.kv_cache)
    except BackendError as e:
        raise ValueError(str(e)) from None


def add_model_args(p: argparse.ArgumentParser) -> None:
    from .backend import BACKENDS

    p.add_argument("--model", default=None,
                   help="GGUF file, HF directory, flint checkpoint, hub id or synthetic:NAME "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--backend", default=None, choices=BACKENDS,
                   help="decode backend (default: megakernel on a Hopper GPU, else reference)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--max-seq-len", type=int_at_least(1), default=None,
                   help="KV cache length (default: min(model context, 8192))")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                   help="reference backend precision (default: float32 on CPU, bfloat16 on GPU)")
    p.add_argument("--group-size", type=int, default=128, choices=(32, 64, 128),
                   help="int4 group size for weights not already int4 (kernel backends)")
    add_kv_cache_arg(p)
    p.set_defaults(model_args=True)  # check_args checks --kv-cache against --backend
    p.add_argument("--draft", default="auto",
                   help="speculative decoding: auto (default: suffix proposals where they match strongly, else the "
                        "draft head shipped for the model, else plain steps; requests it cannot serve decode plainly), "
                        "none (plain decoding), suffix (suffix-trie proposals from the prompt, the output and recent "
                        "outputs), ngram (prompt lookup), or a draft head (a path, or a shipped name: smollm2-135m)")
    p.add_argument("--draft-k", type=int_at_least(1), default=None,
                   help="draft tokens per verify step at most (default: the draft's own; suffix and auto: 7, the "
                        "widest verify)")
    p.add_argument("--draft-vocab", type=int_at_least(0), default=None,
                   help="draft from the N most generated tokens (a pruned head; default: the draft's own, "
                        "0: the full vocabulary)")


def load_engine(args, quiet: bool = False):
    """(LoadedModel, backend, Engine) from the model args."""
    from .backend import default_backend, make_backend
    from .engine import Engine
    from .loading import load_model
    from .speculative.suffix import K_MAX

    if getattr(args, "draft", None) in ("suffix", "auto") and (args.draft_k or 0) > K_MAX:
        raise ValueError(f"--draft-k {args.draft_k}: the {args.draft} draft proposes at most {K_MAX} tokens a step "
                         f"(the widest verify is M = {K_MAX + 1})")
    lm = load_model(args.model)
    name = args.backend or default_backend(quiet=quiet)
    max_seq = args.max_seq_len or min(lm.cfg.max_position_embeddings, 8192)
    backend = make_backend(name, lm, max_seq, device=args.device, group_size=args.group_size,
                           dtype=getattr(args, "dtype", None), kv_cache=getattr(args, "kv_cache", "fp16"))
    engine = Engine(backend, lm.tokenizer)
    draft_path = getattr(args, "draft", None)
    if draft_path and draft_path != "none":
        from .speculative.draft_head import load_draft
        from .speculative.verify import SpeculativeEngine

        draft = load_draft(draft_path, lm.cfg, lm.params, device=backend.device,
                           draft_vocab=getattr(args, "draft_vocab", None))
        engine = SpeculativeEngine(backend, lm.tokenizer, draft, k=args.draft_k, plain_fallback=draft_path == "auto")
        if name == "megakernel" and not quiet and draft_path != "auto":
            print("flint: speculative decoding on the megakernel is exact but slower than plain decoding except on "
                  "code prompts (its verify step is not yet flat in M; docs/speculative.md)", file=sys.stderr)
    return lm, backend, engine


def _sampling_args(p):
    p.add_argument("--max-new-tokens", type=int_at_least(0), default=256, help="tokens to generate at most")
    p.add_argument("--temperature", type=finite_float(0.0), default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=finite_float(0.0, 1.0, lo_open=True), default=1.0,
                   help="nucleus sampling mass, in (0, 1]; 1 = off")
    p.add_argument("--top-k", type=int_at_least(0), default=0, help="sample from the k likeliest; 0 = off")
    p.add_argument("--seed", type=int_at_least(-2**63, 2**64 - 1), default=None,  # torch's range
                   help="sampling seed (default: random)")
    p.add_argument("--stop", action="append", default=[], type=nonempty_text_arg,
                   help="stop string (repeatable)")
    p.set_defaults(sampling=True)


def _params(args):
    from .engine import SamplingParams

    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                          stop=list(args.stop)).validate()


def _stats_line(r, engine) -> str:
    s = f"{len(r.token_ids)} tokens · {r.decode_tok_s:.1f} tok/s decode · TTFT {r.ttft_s * 1000:.0f} ms"
    spec = getattr(r, "speculative", None)
    if spec:
        shares = ", ".join(f"{k} {v:.0%}" for k, v in spec["drafters"].items())
        s += f" · {spec['tokens_per_step']:.2f} tokens/verify step ({shares})"
    return s + f" · {engine.backend.name}"


def cmd_generate(args) -> int:
    prompt = args.prompt if args.prompt_file is None else read_text(args.prompt_file)
    sp = _params(args)
    lm, backend, engine = load_engine(args, quiet=True)
    tok = lm.tokenizer
    if tok is None:
        raise ValueError(f"model {args.model!r} has no tokenizer; flint generate needs text")
    if args.chat:
        msgs = ([{"role": "system", "content": args.system}] if args.system else [])
        ids = tok.encode_chat(msgs + [{"role": "user", "content": prompt}])
    else:
        ids = tok.encode(prompt)
    for _, piece in engine.stream(ids, sp):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    if args.stats:
        print(_stats_line(engine.last, engine), file=sys.stderr)
    return 0


def _answer(engine, tok, messages, sp, out=sys.stdout):
    ids = tok.encode_chat(messages)
    for _, piece in engine.stream(ids, sp):
        out.write(piece)
        out.flush()
    out.write("\n")
    return engine.last


CHAT_COMMANDS = (("/help", "this list"), ("/reset", "forget the conversation"),
                 ("/stats", "tokens, tok/s and TTFT of the last answer"), ("/exit", "leave (also /quit, Ctrl-D)"))


def _tolerant_stdin() -> None:
    """Let a non-UTF-8 line reach the chat loop as surrogates (reported there, the session goes
    on) instead of raising UnicodeDecodeError inside input(), which loses the buffered input."""
    try:
        sys.stdin.reconfigure(errors="surrogateescape")
    except (AttributeError, ValueError, io.UnsupportedOperation):
        pass  # not a TextIOWrapper (a test's StringIO), or already read from


def cmd_chat(args) -> int:
    sp = _params(args)
    lm, backend, engine = load_engine(args)
    tok = lm.tokenizer
    if tok is None or not tok.chat_template:
        raise ValueError(f"model {lm.source!r} has no chat template; use `flint generate`")
    if args.selftest:
        msgs = [{"role": "user", "content": SELFTEST_PROMPT}]
        print(f"you› {SELFTEST_PROMPT}\nflint› ", end="", flush=True)
        sp.temperature = 0.0
        sp.max_new_tokens = min(sp.max_new_tokens, 64)
        r = _answer(engine, tok, msgs, sp)
        print(f"⚡ {_stats_line(r, engine)}")
        ok = SELFTEST_KEYWORD in r.text.lower()
        print("selftest: " + ("PASS" if ok else f"FAIL (answer lacks {SELFTEST_KEYWORD!r})"))
        return 0 if ok else 1
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = []
    last = None
    print(f"flint chat · {lm.cfg.name or lm.source} · backend {backend.name} · "
          + " ".join(c for c, _ in CHAT_COMMANDS), flush=True)
    _tolerant_stdin()
    while True:
        try:
            line = input("you› ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        except UnicodeDecodeError:
            print("(that input is not valid UTF-8; nothing was sent)", file=sys.stderr, flush=True)
            continue
        where = text_error(line)
        if where:
            print(f"(that line is not valid UTF-8 at {where}; nothing was sent)", file=sys.stderr, flush=True)
            continue
        cmd = line.strip()
        if not cmd:
            continue
        if cmd in ("/exit", "/quit"):
            return 0
        if cmd == "/help":
            for c, what in CHAT_COMMANDS:
                print(f"  {c:<8} {what}")
            print("  anything else is sent to the model")
            continue
        if cmd == "/reset":
            history.clear()
            print("(conversation cleared)")
            continue
        if cmd == "/stats":
            print(_stats_line(last, engine) if last else "(no answer yet)")
            continue
        history.append({"role": "user", "content": line})
        try:
            n_prompt = len(tok.encode_chat(system + history))
        except ValueError as e:  # the template refuses this conversation (raise_exception, a render error)
            history.pop()
            print(f"({e}; nothing was sent)", file=sys.stderr, flush=True)
            continue
        if n_prompt + sp.max_new_tokens > backend.max_seq_len:
            history.pop()
            print(f"(the conversation is {n_prompt} tokens; with --max-new-tokens "
                  f"{sp.max_new_tokens} it exceeds the {backend.max_seq_len}-token context: /reset)")
            continue
        print("flint› ", end="", flush=True)
        try:
            last = _answer(engine, tok, system + history, sp)
        except KeyboardInterrupt:
            print("\n(interrupted)")
            history.pop()
            continue
        history.append({"role": "assistant", "content": last.text})
        print(f"⚡ {_stats_line(last, engine)}", flush=True)


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="flint", description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("chat", help="interactive chat (streams text; /help /reset /stats /exit)")
    add_model_args(p)
    _sampling_args(p)
    p.add_argument("--system", default=None, type=text_arg, help="system prompt")
    p.add_argument("--selftest", action="store_true", help="one factual prompt; non-zero exit if wrong")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("generate", help="generate text for a prompt; text to stdout")
    add_model_args(p)
    _sampling_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", type=text_arg, help="the prompt text")
    src.add_argument("--prompt-file", metavar="PATH", help="read the prompt from a UTF-8 file (- = stdin)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--system", default=None, type=text_arg, help="system prompt (with --chat)")
    p.add_argument("--stats", action="store_true", help="print tokens, tok/s and TTFT to stderr")
    p.set_defaults(func=cmd_generate)

    for mod in SUBCOMMAND_MODULES:
        try:
            m = importlib.import_module(mod)
        except ImportError as e:
            if os.environ.get("FLINT_DEBUG"):
                raise
            if e.name == mod:
                continue  # not built yet
            raise
        m.register(sub)
    ranged = {"port": int_at_least(0, 65535), "temperature": finite_float(0.0),
              "max_new_tokens": int_at_least(0), **OPTION_RANGES}
    for p in leaf_parsers(ap):
        for a in p._actions:
            # a subcommand module's plain int / float option of this name gets its range checked
            # at parse time (an out-of-range port would otherwise wrap around modulo 65536)
            if a.dest in ranged and a.type in (int, float):
                a.type = ranged[a.dest]
        if "--threads" not in p._option_string_actions:
            p.add_argument("--threads", type=int_at_least(1, max_threads()), default=None,
                           help=f"torch CPU threads (default: 1 on a machine with at most "
                                f"{SMALL_MACHINE_CORES} cores, else torch's choice; OMP_NUM_THREADS wins)")
        for a in p._actions:
            if a.help is None and HelpFormatter.shows_default(a):
                a.help = "default: %(default)s"  # argparse prints no help line for help=None
        p.set_defaults(cli_parser=p)
    return ap


# The range of every plain int / float option of a subcommand module, by its dest: build_parser
# puts these types in place, so no number outside its range reaches a command (a batch size of 0,
# a negative stride, a 100000 GiB buffer). tests/test_cli.py checks that no numeric option is left
# without one, except flint serve's, which flint.server.serve checks (check_serve_args).
SEED = int_at_least(-2**63, 2**64 - 1)  # torch's range
OPTION_RANGES = {
    **dict.fromkeys(("batch_size", "k", "depth", "steps", "layers", "intermediate_size", "eval_every",
                     "ckpt_every", "num_prompts", "prompts_per_kind", "max_seq_len", "tokens", "repeats",
                     "prompt_len", "draft_prompts", "stride", "max_tokens"), int_at_least(1)),
    **dict.fromkeys(("attention_heads", "size", "draft_vocab", "top_k"), int_at_least(0)),
    "seed": SEED,
    **dict.fromkeys(("lr", "time_budget"), finite_float(0.0, lo_open=True)),
    "reg_weight": finite_float(0.0),
    "top_p": finite_float(0.0, 1.0, lo_open=True),
    "bw_gib": finite_float(0.0, 64.0, lo_open=True),  # a buffer in memory: at most 64 GiB
}


def max_threads() -> int:
    """The most --threads this machine takes: its CPU count (more threads than cores only contend,
    and OpenMP aborts on an absurd count)."""
    return max(os.cpu_count() or 1, available_cores())


def refuse_unused(args, mode: str, only: dict) -> None:
    """ValueError for an option given a value other than its default in a mode that does not read
    it; ``only`` maps an option's dest to the modes that read it."""
    parser = getattr(args, "cli_parser", None)
    if parser is None:  # a Namespace built by hand, not parsed: no defaults to compare with
        return
    for dest, modes in only.items():
        if mode not in modes and hasattr(args, dest) and getattr(args, dest) != parser.get_default(dest):
            raise ValueError(f"--{dest.replace('_', '-')} does nothing here (it is read only "
                             f"{' or '.join(modes)}); leave it out")


def leaf_parsers(parser: argparse.ArgumentParser):
    """The parsers that run a command: parser itself, or the leaves under its subcommands."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield parser
    for a in subs:
        for p in dict.fromkeys(a.choices.values()):  # an alias maps to the same parser
            yield from leaf_parsers(p)


def check_args(args) -> None:
    """The checks that need more than argparse's types, run before any model loads."""
    if getattr(args, "device", None):
        check_device(args.device)
    if getattr(args, "sampling", False):
        _params(args)
        sampled = "at --temperature > 0"
        refuse_unused(args, sampled if args.temperature > 0 else "greedy",
                      dict.fromkeys(("top_p", "top_k", "seed"), (sampled,)))
    if getattr(args, "model_args", False):
        check_kv_cache_arg(args, args.backend)
        drafting = args.draft not in (None, "none")
        refuse_unused(args, "with --draft" if drafting else "with --draft none",
                      {"draft_k": ("with --draft",), "draft_vocab": ("with --draft",)})
        from .backend import default_backend

        backend = f"with --backend {args.backend or default_backend(quiet=True)}"
        refuse_unused(args, backend, {"dtype": ("with --backend reference",),
                                      "group_size": ("with --backend compiled", "with --backend megakernel")})
    if getattr(args, "model", None) == "":
        raise ValueError("--model: must not be empty (leave it out for the default model)")
    if getattr(args, "system", None) is not None and hasattr(args, "chat") and not args.chat:
        raise ValueError("--system does nothing without --chat (the chat template places it)")


def main(argv=None) -> int:
    try:
        ap = build_parser()
        args = ap.parse_args(argv)
    except KeyboardInterrupt:  # Ctrl-C while the subcommand modules import torch: no traceback
        return 130
    try:
        check_args(args)
    except ValueError as e:
        getattr(args, "cli_parser", ap).error(str(e))
    set_threads(args.threads if args.threads is not None else default_threads())
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError) as e:
        if os.environ.get("FLINT_DEBUG"):
            raise
        print(f"flint: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        from .engine import NonFiniteLogits

        if not isinstance(e, NonFiniteLogits) or os.environ.get("FLINT_DEBUG"):
            raise
        print(f"flint: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
