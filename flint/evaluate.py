"""`flint eval`: perplexity on a text, and how far a quantized model drifts from its reference.

* Perplexity with a sliding window: windows of ``--window`` tokens advance by ``--stride``; each
  token is scored once, by the first window that holds it with a prediction for it, so after the
  first window every token sees at least window - stride tokens of context.
* Against a reference (``--against REF``, or the loaded model itself when ``--quantize`` makes the
  variants): per scored token KL(P_ref || P_model) over the whole vocabulary, reported as its mean
  and 99th percentile, and top-1 agreement (same argmax). Both models read the same windows.
* ``--quantize 64,32:searched-head,64:gptq`` re-fits the model's weights in memory, one variant
  per item: every linear weight and the LM head dequantized (exactly) and quantized again
  round-to-nearest at group size G (the largest group size dividing K where G does not). Options
  after ':': ``float-head`` keeps the head as it was (float, or dequantized from int4);
  ``searched-head`` fits the int4 head's (scale, min) per group by search
  (flint.quant.int4.quantize_int4_searched); ``gptq-head`` quantizes the head by GPTQ; ``int8-head``
  holds the head as symmetric 8-bit per 32 values (what an 8-bit head would cost; no kernel reads
  it yet); ``gptq`` quantizes the linear weights and the head by GPTQ (flint/quant/gptq.py, calibrated on
  flint/data/calibration.txt, a text disjoint from the eval corpus); ``int4-embed`` makes the
  embedding lookup read int4 rows too; ``kernel`` is the model as the int4 backends run it at
  ``--group-size G`` (flint.quant.int4.quantize_params: int4 weights kept, with the fp16 scale / min
  the kernels read where the reference holds exact ones, as for a GGUF's Q4_K; float ones such as
  Q6_K / Q8_0 requantized), ``kernel:float-head`` the same with the head left as loaded (to
  separate the head's share). "MB/token" is what a decode step streams: the
  linear weights and the head as held, one embedding row, the norms (K/V not included).

* ``--kv-cache int8,fp8`` also evaluates the model (the loaded one, the model under test) with
  each 8-bit KV cache (flint.model's docstring: the layout), one row each, against the fp16 cache
  (the reference row, or ``--against``): the rows measure what quantizing K and V costs at the
  window's context lengths (every scored token sees window - stride .. window - 1 tokens after
  the first window), with the weights unchanged. ``--window 256,1024,2048`` runs the comparison
  at several context lengths in one call (the model loads once; every row names its window and
  stride, and ``kv_bytes_per_pos``: the K/V bytes the row's cache format stores per position,
  fp16 counted at 2 bytes a value as the kernels hold it, though the reference's CPU cache is fp32).

The default text is flint/data/eval-corpus.txt (written for flint; see flint/data/README.md).
Logits come from the reference decoder in fp32 (``--backend`` picks another for the model under
test). Run: ``flint eval --quantize 64,32`` (SmolLM2 on a CPU: about two minutes). Test:
``pytest tests/test_eval.py``.
"""
from __future__ import annotations

import json
import math
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .errors import FlintError
from .model import kv_format_bytes
from .quant.int4 import (GROUP_SIZES, Int4Weight, fit_group_size, int8_rows, quantize_int4,
                         kernel_params, quantize_params, requantize_params)

DEFAULT_CORPUS = Path(__file__).parent / "data" / "eval-corpus.txt"


class EvalError(FlintError, ValueError):
    pass


@dataclass
class EvalRow:
    label: str
    weights: str  # what the weights are (group sizes, head precision)
    tokens: int  # scored tokens
    ppl: float
    kl_mean: float | None = None  # vs the reference, nats per token
    kl_p99: float | None = None
    top1_agree: float | None = None
    weight_mb: float | None = None  # linear weights + head as a decode step streams them, MB per token
    kv_cache: str = "fp16"  # the KV cache format (flint.model.KV_CACHE_FORMATS)
    kv_bytes_per_pos: int | None = None  # K + V bytes one position holds in that format, every layer
    window: int | None = None
    stride: int | None = None


def windows(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first_target) per window over n tokens: the window reads ids[begin:end] and
    scores targets first_target..end-1 (each target t predicted by the logits at t - 1)."""
    if window < 2:
        raise EvalError(f"--window must be >= 2, got {window}")
    if not 1 <= stride <= window - 1:
        raise EvalError(f"--stride must be in 1..window-1 ({window - 1}), got {stride}")
    if n < 2:
        raise EvalError(f"the text has {n} token(s); perplexity needs at least 2")
    out, scored_to = [], 1
    begin = 0
    while True:
        end = min(begin + window, n)
        out.append((begin, end, scored_to))
        scored_to = end
        if end == n:
            return out
        begin += stride


def describe_weights(params: dict, head: str | None = None) -> str:
    """e.g. 'int4 g32 x210, head float32' / 'int4 g64 x181 + g128 x30, head int4 g64'; ``head``
    overrides the head's part (an 8-bit head held as its float values)."""
    sizes = Counter(w.group_size for k, w in params.items()
                    if isinstance(w, Int4Weight) and k not in ("lm_head", "embed"))
    body = " + ".join(f"g{g} x{n}" for g, n in sorted(sizes.items())) or "none"
    w = params["lm_head"]
    head = head or (f"int4 g{w.group_size}" if isinstance(w, Int4Weight) else str(w.dtype).replace("torch.", ""))
    emb = params["embed"]
    emb_s = f", embed int4 g{emb.group_size}" if isinstance(emb, Int4Weight) else ""
    return f"int4 {body}, head {head}{emb_s}"


def weight_bytes(params: dict, head_bytes: int | None = None) -> int:
    """What a decode step streams: every linear weight and the head as held (int4 codes + scales +
    mins, or a float tensor at its dtype; ``head_bytes`` overrides the head), plus one embedding
    row and the norms, which are small."""
    def size(w):
        return w.nbytes if isinstance(w, Int4Weight) else w.numel() * w.element_size()

    n = sum(size(w) for k, w in params.items() if k not in ("embed", "lm_head"))
    e = params["embed"]
    row = e.nbytes // e.shape[0] if isinstance(e, Int4Weight) else e.shape[1] * e.element_size()
    return n + (head_bytes if head_bytes is not None else size(params["lm_head"])) + row


HEAD_OPTIONS = {"float-head": "float", "searched-head": "searched", "gptq-head": "gptq", "int8-head": "int8"}
OPTIONS = (*HEAD_OPTIONS, "gptq", "int4-embed", "kernel")
_HEAD_LABEL = {"float": "float head", "searched": "searched head", "gptq": "GPTQ head", "int8": "8-bit head",
               "rtn": "RTN head"}


@dataclass(frozen=True)
class Variant:
    """One ``--quantize`` item: G[:option...]."""

    group_size: int
    head: str = "rtn"  # rtn, searched, gptq, float, int8
    method: str = "rtn"  # the linear weights: rtn or gptq
    int4_embed: bool = False
    kernel: bool = False  # as the int4 backends see it: quantize_params, nothing else

    @property
    def label(self) -> str:
        if self.kernel:
            return f"int4 kernels, --group-size {self.group_size}" + (", float head" if self.head == "float" else "")
        words = [f"{'GPTQ' if self.method == 'gptq' else 'requantized'} g{self.group_size}"]
        if self.head != self.method:
            words.append(_HEAD_LABEL[self.head])
        if self.int4_embed:
            words.append("int4 embedding")
        return ", ".join(words)


def parse_variants(spec: str) -> list[Variant]:
    """'64,32:searched-head,64:gptq' -> Variant per item. Options: float-head, searched-head,
    gptq-head, int8-head (at most one of these), gptq (linears and head), int4-embed."""
    out = []
    for item in (x.strip() for x in spec.split(",") if x.strip()):
        g, *opts = item.split(":")
        for o in opts:
            if o not in OPTIONS:
                raise EvalError(f"--quantize item {item!r}: unknown option {o!r} (one of {', '.join(OPTIONS)})")
        heads = [HEAD_OPTIONS[o] for o in opts if o in HEAD_OPTIONS]
        if len(heads) > 1 or len(set(opts)) != len(opts):
            raise EvalError(f"--quantize item {item!r}: repeats an option or names two heads")
        try:
            gi = int(g.lstrip("g"))
        except ValueError:
            raise EvalError(f"--quantize item {item!r}: group size must be one of {GROUP_SIZES}") from None
        if gi not in GROUP_SIZES:
            raise EvalError(f"--quantize item {item!r}: group size must be one of {GROUP_SIZES}")
        if "kernel" in opts and not set(opts) <= {"kernel", "float-head"}:
            raise EvalError(f"--quantize item {item!r}: 'kernel' takes no option but float-head (it "
                            "is the model as the int4 backends load it)")
        method = "gptq" if "gptq" in opts else "rtn"
        out.append(Variant(gi, heads[0] if heads else method, method, "int4-embed" in opts,
                           "kernel" in opts))
    if not out:
        raise EvalError("--quantize: empty list")
    return out


def variant_params(lm, v: Variant, hessians=None) -> tuple[dict, str | None, int | None]:
    """(params of ``lm`` re-fitted as ``v`` says, the head's description when the params hold
    it as float values of another format, the head's bytes then). ``hessians()`` gives GPTQ's
    (flint.quant.gptq.collect_hessians, computed once per run by the caller)."""
    from .quant import gptq

    if v.kernel:
        linear = [k for k in lm.params if k.rsplit(".", 1)[-1] in gptq.LINEAR_NAMES]
        names = linear if v.head == "float" else linear + ["lm_head"]
        params = quantize_params(lm.params, v.group_size, names)
        return kernel_params(params, names), None, None
    params = requantize_params(lm.params, v.group_size, head=v.head if v.head in ("rtn", "searched", "float")
                               else "rtn" if v.head == "gptq" else "float")
    names = [k for k in params if k.rsplit(".", 1)[-1] in gptq.LINEAR_NAMES] if v.method == "gptq" else []
    if v.head == "gptq":
        names.append("lm_head")
    if names:
        sizes = {n: fit_group_size(lm.params[n].shape[1], v.group_size, n) for n in names}
        params.update(gptq.gptq_params(lm.cfg, lm.params, names, sizes, hessians=hessians()))
    head_desc = head_bytes = None
    if v.head == "int8":
        w = lm.params["lm_head"]
        w = w.dequantize(torch.float32) if isinstance(w, Int4Weight) else w
        params["lm_head"], head_bytes = int8_rows(w, 32)
        head_desc = "int8 g32"
    if v.int4_embed:
        e = lm.params["embed"]
        e = e.dequantize(torch.float32) if isinstance(e, Int4Weight) else e
        params["embed"] = quantize_int4(e, fit_group_size(e.shape[1], v.group_size, "embed"), name="embed")
    return params, head_desc, head_bytes


def parse_kv_caches(spec: str) -> list[str]:
    """'int8,fp8' -> ['int8', 'fp8'] (fp16, the reference's cache, adds no row)."""
    from .model import KV_CACHE_FORMATS

    out = [x.strip() for x in spec.split(",") if x.strip()]
    for f in out:
        if f not in KV_CACHE_FORMATS:
            raise EvalError(f"--kv-cache item {f!r}: choose from {', '.join(KV_CACHE_FORMATS)}")
    if not out or len(set(out)) != len(out):
        raise EvalError(f"--kv-cache {spec!r}: an empty list or a repeated format")
    return [f for f in out if f != "fp16"]


def parse_windows(spec) -> list[int]:
    """'256,1024,2048' (or an int, or a list of them) -> [256, 1024, 2048]."""
    items = [spec] if isinstance(spec, int) else spec if isinstance(spec, (list, tuple)) else str(spec).split(",")
    out = []
    for x in (str(x).strip() for x in items if str(x).strip()):
        try:
            out.append(int(x))
        except ValueError:
            raise EvalError(f"--window {spec!r}: {x!r} is not a whole number") from None
    if not out or len(set(out)) != len(out):
        raise EvalError(f"--window {spec!r}: an empty list or a repeated size")
    return out


def _reference_decoder(cfg, params, window: int, device, kv_cache: str = "fp16"):
    from .model import Transformer

    return Transformer(cfg, params, max_seq_len=window, device=device, dtype=torch.float32, kv_cache=kv_cache)


@torch.inference_mode()
def evaluate(ids: list[int], ref: tuple[str, object], candidates: list[tuple[str, object]],
             window: int = 512, stride: int = 256, progress=None) -> list[EvalRow]:
    """ref and candidates are (label, backend) pairs over the same vocabulary. Returns the
    reference's row (ppl only) followed by one row per candidate."""
    n = len(ids)
    ws = windows(n, window, stride)
    toks = torch.tensor(ids, dtype=torch.long)
    nll = [0.0] * (1 + len(candidates))
    kls: list[list[torch.Tensor]] = [[] for _ in candidates]
    agree = [0] * len(candidates)
    scored = 0
    for wi, (b, e, t0) in enumerate(ws):
        inp = toks[b:e]
        targets = toks[t0:e]
        sl = slice(t0 - 1 - b, e - 1 - b)
        ref_lp = torch.log_softmax(ref[1].forward(inp, 0)[sl].float().cpu(), dim=-1)
        nll[0] += float(-ref_lp.gather(1, targets[:, None]).sum())
        ref_p = ref_lp.exp()
        ref_top = ref_lp.argmax(-1)
        for ci, (_, backend) in enumerate(candidates):
            lp = torch.log_softmax(backend.forward(inp, 0)[sl].float().cpu(), dim=-1)
            nll[ci + 1] += float(-lp.gather(1, targets[:, None]).sum())
            kls[ci].append((ref_p * (ref_lp - lp)).sum(-1).clamp_min(0.0))
            agree[ci] += int((lp.argmax(-1) == ref_top).sum())
        scored += targets.numel()
        if progress:
            progress(wi + 1, len(ws))
    rows = []
    rows.append(EvalRow(ref[0], "", scored, math.exp(nll[0] / scored)))
    for ci, (label, _) in enumerate(candidates):
        kl = torch.cat(kls[ci])
        rows.append(EvalRow(label, "", scored, math.exp(nll[ci + 1] / scored), float(kl.mean()),
                            float(torch.quantile(kl.double(), 0.99)), agree[ci] / scored))
    return rows


def read_corpus(path: str | Path | None) -> str:
    p = Path(path) if path else DEFAULT_CORPUS
    try:
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise EvalError(f"{p}: file not found") from None
    except UnicodeDecodeError as e:
        raise EvalError(f"{p}: not UTF-8 text ({e})") from None


def run_eval(model: str | None = None, text_path: str | None = None, against: str | None = None,
             quantize: str | None = None, window: int | str | list[int] = 512, stride: int | None = None,
             max_tokens: int | None = None, backend: str = "reference", device: str = "cpu",
             log=print, kv_caches: str | None = None) -> list[EvalRow]:
    from .backend import check_kv_cache
    from .loading import load_model

    variants = parse_variants(quantize) if quantize else []  # bad specs fail before any load
    kv_formats = parse_kv_caches(kv_caches) if kv_caches else []
    sizes = parse_windows(window)
    for f in kv_formats:
        check_kv_cache(backend, f)
    lm = load_model(model)
    if lm.tokenizer is None:
        raise EvalError(f"model {lm.source}: has no tokenizer (synthetic?); flint eval reads text")
    ids = lm.tokenizer.encode(read_corpus(text_path))
    if max_tokens:
        ids = ids[:max_tokens]
    for w in sizes:
        if w > lm.cfg.max_position_embeddings:
            raise EvalError(f"--window {w} exceeds the model's context of {lm.cfg.max_position_embeddings}")
        windows(len(ids), w, stride or w // 2)  # validates every size before a model is built

    def build(params, w, name=backend, kv_cache="fp16"):
        if name == "reference":
            return _reference_decoder(lm.cfg, params, w, device, kv_cache)
        from .backend import make_backend
        from .loading import LoadedModel

        return make_backend(name, LoadedModel(lm.cfg, params, None, lm.source), max_seq_len=w,
                            device=device, kv_cache=kv_cache)

    model_label = model or "embedded:smollm2"
    # the models under test: (label, params, backend name, KV cache format)
    specs, weights = [], {}
    if against:
        ref_lm = load_model(against)
        if ref_lm.cfg.vocab_size != lm.cfg.vocab_size:
            raise EvalError(f"--against {against}: vocabulary size {ref_lm.cfg.vocab_size} differs from the "
                            f"model's {lm.cfg.vocab_size}")
        ref_spec = (against, ref_lm)
        weights[against] = (describe_weights(ref_lm.params), weight_bytes(ref_lm.params), ref_lm.cfg)
        specs.append((model_label, lm.params, backend, "fp16"))
    else:
        ref_spec = (model_label, lm)
    weights[model_label] = (describe_weights(lm.params), weight_bytes(lm.params), lm.cfg)
    hs = {}

    def hessians():
        if "h" not in hs:
            from .quant import gptq

            hs["h"] = gptq.collect_hessians(lm.cfg, lm.params, gptq.calibration_ids(lm.tokenizer),
                                            device=device)
        return hs["h"]

    for v in variants:
        params, head_desc, head_bytes = variant_params(lm, v, hessians)
        specs.append((v.label, params, backend, "fp16"))
        weights[v.label] = (describe_weights(params, head_desc), weight_bytes(params, head_bytes), lm.cfg)
    for f in kv_formats:  # the model's own weights, an 8-bit K/V cache
        label = f"{model_label}, {f} KV cache"
        specs.append((label, lm.params, backend, f))
        weights[label] = weights[model_label]
    rows = []
    for w in sizes:
        st = stride or w // 2
        ref = (ref_spec[0], _reference_decoder(ref_spec[1].cfg, ref_spec[1].params, w, device))
        cands = [(label, build(params, w, name, f)) for label, params, name, f in specs]
        log(f"flint eval: {len(ids)} tokens, window {w}, stride {st}, {1 + len(specs)} model(s)", file=sys.stderr)
        got = evaluate(ids, ref, cands, w, st, progress=lambda i, n: log(f"  window {i}/{n}", file=sys.stderr)
                       if i % 4 == 0 or i == n else None)
        del ref, cands
        for r, f in zip(got, ["fp16"] + [sp[3] for sp in specs]):
            r.weights, nbytes, cfg = weights[r.label]
            r.weight_mb = nbytes / 1e6
            r.kv_cache, r.window, r.stride = f, w, st
            r.kv_bytes_per_pos = kv_format_bytes(cfg, f)
        rows += got
    return rows


def markdown_table(rows: list[EvalRow]) -> str:
    """The rows of one window, the reference first. "KV B/pos": the K/V cache's bytes per position."""
    ref_ppl = rows[0].ppl
    lines = ["| model | weights | MB/token | KV B/pos | PPL | ΔPPL | KL mean | KL p99 | top-1 agree |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for i, r in enumerate(rows):
        mb = f"{r.weight_mb:.1f}" if r.weight_mb is not None else ""
        kvb = f"{r.kv_bytes_per_pos:,}" if r.kv_bytes_per_pos is not None else ""
        if i == 0:
            lines.append(f"| {r.label} (reference) | {r.weights} | {mb} | {kvb} | {r.ppl:.3f} | | | | |")
        else:
            lines.append(f"| {r.label} | {r.weights} | {mb} | {kvb} | {r.ppl:.3f} | {r.ppl - ref_ppl:+.3f} | "
                         f"{r.kl_mean:.4f} | {r.kl_p99:.4f} | {r.top1_agree:.2%} |")
    return "\n".join(lines)


def _run(args) -> int:
    rows = run_eval(args.model, args.file, args.against, args.quantize, args.window, args.stride,
                    args.max_tokens, args.backend, args.device or "cpu", kv_caches=args.kv_cache)
    for w in dict.fromkeys(r.window for r in rows):
        part = [r for r in rows if r.window == w]
        print(f"{part[0].tokens} tokens scored, window {w}, stride {part[0].stride}")
        print(markdown_table(part))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    return 0


def register(sub) -> None:
    p = sub.add_parser("eval", help="perplexity on a text; KL divergence and top-1 agreement vs a reference",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model spec (default: the embedded SmolLM2)")
    p.add_argument("--file", default=None, help=f"UTF-8 text (default: the shipped corpus, {DEFAULT_CORPUS.name})")
    p.add_argument("--against", default=None, metavar="REF", help="reference model spec for KL / top-1")
    p.add_argument("--quantize", default=None, metavar="G[,G...]",
                   help="also evaluate the model re-quantized in memory at these group sizes, each "
                        "with options after ':' (float-head, searched-head, gptq-head, int8-head, gptq, "
                        "int4-embed; or kernel: as the int4 backends load it), e.g. 64,32:searched-head,128:kernel")
    p.add_argument("--kv-cache", default=None, metavar="FMT[,FMT...]",
                   help="also evaluate the model with these KV cache formats (int8, fp8), each against the fp16 "
                        "cache, e.g. int8,fp8")
    p.add_argument("--window", default="512", metavar="N[,N...]",
                   help="tokens per window (default 512); a list runs the whole evaluation at each size, "
                        "e.g. 256,1024,2048 (the context lengths of a --kv-cache comparison)")
    p.add_argument("--stride", type=int, default=None, help="window advance (default: half the window)")
    p.add_argument("--max-tokens", type=int, default=None, help="only the first N tokens of the text")
    p.add_argument("--backend", default="reference", help="backend of the model under test (default: the "
                   "reference decoder in fp32)")
    p.add_argument("--device", default=None, help="cpu (default) or cuda")
    p.add_argument("--json", default=None, metavar="PATH", help="write the rows as JSON")
    p.set_defaults(func=_run)


def main(argv=None) -> int:
    """`python -m flint.evaluate` = `flint eval`."""
    from .cli import main as cli_main

    return cli_main(["eval", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
