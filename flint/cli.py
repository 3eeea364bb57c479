"""The `flint` command: chat, generate, and the subcommands other modules register
(serve, bench, eval, quantize, draft).

    flint chat                      interactive chat on the embedded SmolLM2 (or --model)
    flint chat --selftest           one factual prompt; exit 1 unless the answer is right
    flint generate --prompt TEXT    text to stdout (--chat applies the chat template;
                                    --prompt-file PATH, or - for stdin, instead of --prompt)

A module joins the CLI by exposing ``register(sub)`` (sub: argparse subparsers) that adds its
parser with ``set_defaults(func=fn)``; fn(args) returns the exit code. build_parser() then gives
every leaf subcommand ``--threads`` and a help formatter that shows defaults. The options the commands
share, and their types, are flint.options'; the engine the model options describe is built by
flint.assemble (flint serve builds its engine there too).

User mistakes never end in a traceback. Those argparse can see (a range, a non-UTF-8 byte in a
text argument, a device that is not there, sampling values) are refused before any model loads,
argparse-style (``flint generate: error: ...``, exit 2); later ones are ValueErrors or OSErrors,
which main() prints as ``flint: error: ...`` with exit 2.
"""
from __future__ import annotations

import argparse
import importlib
import io
import os
import sys

from . import __version__
from .assemble import load_engine
from .options import (OPTION_RANGES, SMALL_MACHINE_CORES, HelpFormatter, Parser, add_model_args, add_sampling_args,
                      check_device, check_kv_cache_arg, default_threads, int_at_least, leaf_parsers,
                      max_threads, read_text, refuse_unused, sampling_params, set_threads, text_arg, text_error)

SUBCOMMAND_MODULES = ("flint.server.serve", "flint.bench", "flint.evaluate", "flint.quant.quantize",
                      "flint.speculative.cli")

SELFTEST_PROMPT = "What is the capital of France? Answer in one sentence."
SELFTEST_KEYWORD = "paris"


def _stats_line(r, engine) -> str:
    s = f"{len(r.token_ids)} tokens · {r.decode_tok_s:.1f} tok/s decode · TTFT {r.ttft_s * 1000:.0f} ms"
    spec = getattr(r, "speculative", None)
    if spec:
        shares = ", ".join(f"{k} {v:.0%}" for k, v in spec["drafters"].items())
        s += f" · {spec['tokens_per_step']:.2f} tokens/verify step ({shares})"
    return s + f" · {engine.backend.name}"


def cmd_generate(args) -> int:
    prompt = args.prompt if args.prompt_file is None else read_text(args.prompt_file)
    sp = sampling_params(args)
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
    sp = sampling_params(args)
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
    add_sampling_args(p)
    p.add_argument("--system", default=None, type=text_arg, help="system prompt")
    p.add_argument("--selftest", action="store_true", help="one factual prompt; non-zero exit if wrong")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("generate", help="generate text for a prompt; text to stdout")
    add_model_args(p)
    add_sampling_args(p)
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
    for p in leaf_parsers(ap):
        for a in p._actions:
            # a subcommand module's plain int / float option of this name gets its range checked
            # at parse time (an out-of-range port would otherwise wrap around modulo 65536)
            if a.dest in OPTION_RANGES and a.type in (int, float):
                a.type = OPTION_RANGES[a.dest]
        if "--threads" not in p._option_string_actions:
            p.add_argument("--threads", type=int_at_least(1, max_threads()), default=None,
                           help=f"torch CPU threads (default: 1 on a machine with at most "
                                f"{SMALL_MACHINE_CORES} cores, else torch's choice; OMP_NUM_THREADS wins)")
        for a in p._actions:
            if a.help is None and HelpFormatter.shows_default(a):
                a.help = "default: %(default)s"  # argparse prints no help line for help=None
        p.set_defaults(cli_parser=p)
    return ap


def check_args(args) -> None:
    """The checks that need more than argparse's types, run before any model loads."""
    if getattr(args, "device", None):
        check_device(args.device)
    if getattr(args, "sampling", False):
        sampling_params(args)
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


def _exit_130(signum, frame):
    os._exit(130)


def main(argv=None) -> int:
    # Ctrl-C while the subcommand modules import torch and numpy: exit 130 at once (a KeyboardInterrupt raised
    # inside their native initialisation aborts the process or is swallowed by it)
    import signal
    import threading

    old = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    if old is not None:  # (None: not the main thread, or a handler installed outside Python: left as it is)
        signal.signal(signal.SIGINT, _exit_130)
    try:
        ap = build_parser()
        args = ap.parse_args(argv)
    except KeyboardInterrupt:
        return 130
    finally:
        if old is not None:
            signal.signal(signal.SIGINT, old)
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
