"""The command-line pieces flint's commands share: argparse types with their range checks, the parser class and its
help formatter, the options of the model and of sampling, the device check, UTF-8 text arguments and the torch
thread count.

flint.cli builds the `flint` parser from them, and the subcommand modules take the options they share from here
(--device, --group-size, --kv-cache; `flint serve` the model options of chat and generate). Every plain number
option of any subcommand gets its range from OPTION_RANGES, so user mistakes argparse can see are refused at parse
time, argparse-style (exit 2). Tests: ``pytest tests/test_cli.py tests/test_input_fuzz.py``.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

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


SEED = int_at_least(-2**63, 2**64 - 1)  # torch's range

# The range of every plain int / float option of a subcommand module, by its dest: flint.cli's build_parser
# puts these types in place, so no number outside its range reaches a command (a batch size of 0,
# a negative stride, a 100000 GiB buffer). tests/test_cli.py checks that no numeric option is left
# without one, except flint serve's, which flint.server.serve checks (check_serve_args).
OPTION_RANGES = {
    **dict.fromkeys(("batch_size", "k", "depth", "steps", "layers", "intermediate_size", "eval_every",
                     "ckpt_every", "num_prompts", "prompts_per_kind", "max_seq_len", "tokens", "repeats",
                     "prompt_len", "draft_prompts", "stride", "max_tokens"), int_at_least(1)),
    **dict.fromkeys(("attention_heads", "size", "draft_vocab", "top_k", "max_new_tokens"), int_at_least(0)),
    "seed": SEED,
    "port": int_at_least(0, 65535),
    "temperature": finite_float(0.0),
    **dict.fromkeys(("lr", "time_budget"), finite_float(0.0, lo_open=True)),
    "reg_weight": finite_float(0.0),
    "top_p": finite_float(0.0, 1.0, lo_open=True),
    "bw_gib": finite_float(0.0, 64.0, lo_open=True),  # a buffer in memory: at most 64 GiB
}


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


def max_threads() -> int:
    """The most --threads this machine takes: its CPU count (more threads than cores only contend,
    and OpenMP aborts on an absurd count)."""
    return max(os.cpu_count() or 1, available_cores())


def set_threads(n: int | None) -> None:
    import torch

    if n is None:
        return
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(n)
    except RuntimeError:
        pass  # only settable once per process, before inter-op work; decode speed is intra-op


def leaf_parsers(parser: argparse.ArgumentParser):
    """The parsers that run a command: parser itself, or the leaves under its subcommands."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield parser
    for a in subs:
        for p in dict.fromkeys(a.choices.values()):  # an alias maps to the same parser
            yield from leaf_parsers(p)


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


def add_device_arg(p: argparse.ArgumentParser) -> None:
    """``--device``, for the commands that run on the GPU when there is one."""
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")


def add_group_size_arg(p: argparse.ArgumentParser, help: str) -> None:
    """``--group-size``: the int4 group size of the weights the backend quantizes at load."""
    p.add_argument("--group-size", type=int, default=128, choices=(32, 64, 128), help=help)


def add_kv_cache_arg(p: argparse.ArgumentParser) -> None:
    """``--kv-cache``: one format (check_kv_cache_arg checks it against the backend before any model loads)."""
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
    """The options that say which engine to build (flint.assemble.load_engine reads them): the model, its backend
    and device, the KV cache, and the drafter of speculative decoding. `flint chat`, `generate` and `serve`."""
    from .backend import BACKENDS

    p.add_argument("--model", default=None,
                   help="GGUF file, HF directory, flint checkpoint, hub id or synthetic:NAME "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--backend", default=None, choices=BACKENDS,
                   help="decode backend (default: megakernel on a Hopper GPU, else reference)")
    add_device_arg(p)
    p.add_argument("--max-seq-len", type=int_at_least(1), default=None,
                   help="KV cache length (default: min(model context, 8192))")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                   help="reference backend precision (default: float32 on CPU, bfloat16 on GPU)")
    add_group_size_arg(p, "int4 group size for weights not already int4 (kernel backends)")
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


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """The sampling options of `flint chat` and `generate` (checked by sampling_params before any model loads)."""
    p.add_argument("--max-new-tokens", type=int_at_least(0), default=256, help="tokens to generate at most")
    p.add_argument("--temperature", type=finite_float(0.0), default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=finite_float(0.0, 1.0, lo_open=True), default=1.0,
                   help="nucleus sampling mass, in (0, 1]; 1 = off")
    p.add_argument("--top-k", type=int_at_least(0), default=0, help="sample from the k likeliest; 0 = off")
    p.add_argument("--seed", type=SEED, default=None, help="sampling seed (default: random)")
    p.add_argument("--stop", action="append", default=[], type=nonempty_text_arg,
                   help="stop string (repeatable)")
    p.set_defaults(sampling=True)


def sampling_params(args):
    """The SamplingParams of the options add_sampling_args adds, validated (ValueError naming the option)."""
    from .engine import SamplingParams

    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                          stop=list(args.stop)).validate()
