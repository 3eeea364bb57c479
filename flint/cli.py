"""The `flint` command: chat, generate, and the subcommands other modules register
(serve, bench, eval, quantize, draft).

    flint chat                      interactive chat on the embedded SmolLM2 (or --model)
    flint chat --selftest           one factual prompt; exit 1 unless the answer is right
    flint generate --prompt TEXT    text to stdout (--chat applies the chat template)

A module joins the CLI by exposing ``register(sub)`` (sub: argparse subparsers) that adds its
parser with ``set_defaults(func=fn)``; fn(args) returns the exit code. User mistakes are
ValueErrors: main() prints ``flint: error: ...`` and exits 2, with no traceback.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

SUBCOMMAND_MODULES = ("flint.server", "flint.bench", "flint.evaluate", "flint.quantize", "flint.draft")

SELFTEST_PROMPT = "What is the capital of France? Answer in one sentence."
SELFTEST_KEYWORD = "paris"


def add_model_args(p: argparse.ArgumentParser) -> None:
    from .backend import BACKENDS

    p.add_argument("--model", default=None,
                   help="GGUF file, HF directory, flint checkpoint, hub id or synthetic:NAME "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--backend", default=None, choices=BACKENDS,
                   help="decode backend (default: megakernel on a Hopper GPU, else reference)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="KV cache length (default: min(model context, 8192))")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                   help="reference backend precision (default: float32 on CPU, bfloat16 on GPU)")
    p.add_argument("--group-size", type=int, default=128, choices=(32, 64, 128),
                   help="int4 group size for weights not already int4 (kernel backends)")
    p.add_argument("--draft", default=None,
                   help="speculative decoding with this draft: a draft head (a path, or a shipped name: smollm2-135m), "
                        "or ngram (prompt-lookup proposals, any model, no draft model)")
    p.add_argument("--draft-k", type=int, default=None,
                   help="draft tokens per verify step (default: the draft's own)")


def load_engine(args, quiet: bool = False):
    """(LoadedModel, backend, Engine) from the model args."""
    from .backend import default_backend, make_backend
    from .engine import Engine
    from .loading import load_model

    lm = load_model(args.model)
    name = args.backend or default_backend(quiet=quiet)
    max_seq = args.max_seq_len or min(lm.cfg.max_position_embeddings, 8192)
    backend = make_backend(name, lm, max_seq, device=args.device, group_size=args.group_size,
                           dtype=getattr(args, "dtype", None))
    engine = Engine(backend, lm.tokenizer)
    draft_path = getattr(args, "draft", None)
    if draft_path:
        from .draft import load_draft
        from .speculative import SpeculativeEngine

        draft = load_draft(draft_path, lm.cfg, lm.params, device=backend.device)
        engine = SpeculativeEngine(backend, lm.tokenizer, draft, k=args.draft_k)
        if name == "megakernel" and not quiet:
            print("flint: speculative decoding on the megakernel is exact but still slower than plain decoding "
                  "(its verify step is not yet flat in M; docs/speculative.md)", file=sys.stderr)
    return lm, backend, engine


def _sampling_args(p):
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _params(args):
    from .engine import SamplingParams

    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=list(args.stop))


def _stats_line(r, engine) -> str:
    s = f"{len(r.token_ids)} tokens · {r.decode_tok_s:.1f} tok/s decode · TTFT {r.ttft_s * 1000:.0f} ms"
    acc = getattr(engine, "acceptance", None)
    if acc is not None:
        s += f" · {acc():.2f} tokens/verify step"
    return s + f" · {engine.backend.name}"


def cmd_generate(args) -> int:
    lm, backend, engine = load_engine(args, quiet=True)
    tok = lm.tokenizer
    if tok is None:
        raise ValueError(f"model {args.model!r} has no tokenizer; flint generate needs text")
    if args.chat:
        msgs = ([{"role": "system", "content": args.system}] if args.system else [])
        ids = tok.encode_chat(msgs + [{"role": "user", "content": args.prompt}])
    else:
        ids = tok.encode(args.prompt)
    for _, piece in engine.stream(ids, _params(args)):
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


def cmd_chat(args) -> int:
    lm, backend, engine = load_engine(args)
    tok = lm.tokenizer
    if tok is None or not tok.chat_template:
        raise ValueError(f"model {lm.source!r} has no chat template; use `flint generate`")
    sp = _params(args)
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
          "/reset /stats /exit", flush=True)
    while True:
        try:
            line = input("you› ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        cmd = line.strip()
        if not cmd:
            continue
        if cmd in ("/exit", "/quit"):
            return 0
        if cmd == "/reset":
            history.clear()
            print("(conversation cleared)")
            continue
        if cmd == "/stats":
            print(_stats_line(last, engine) if last else "(no answer yet)")
            continue
        history.append({"role": "user", "content": line})
        n_prompt = len(tok.encode_chat(system + history))
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
    ap = argparse.ArgumentParser(prog="flint", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("chat", help="interactive chat (streams text; /reset /stats /exit)")
    add_model_args(p)
    _sampling_args(p)
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--selftest", action="store_true", help="one factual prompt; non-zero exit if wrong")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("generate", help="generate text for a prompt; text to stdout")
    add_model_args(p)
    _sampling_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--system", default=None)
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
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except ValueError as e:
        if os.environ.get("FLINT_DEBUG"):
            raise
        print(f"flint: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if os.environ.get("FLINT_DEBUG"):
            raise
        print(f"flint: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
