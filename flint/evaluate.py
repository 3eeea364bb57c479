"""`flint eval`: perplexity on a text, and how far a quantized model drifts from its reference.

* Perplexity with a sliding window: windows of ``--window`` tokens advance by ``--stride``; each
  token is scored once, by the first window that holds it with a prediction for it, so after the
  first window every token sees at least window - stride tokens of context.
* Against a reference (``--against REF``, or the loaded model itself when ``--quantize`` makes the
  variants): per scored token KL(P_ref || P_model) over the whole vocabulary, reported as its mean
  and 99th percentile, and top-1 agreement (same argmax). Both models read the same windows.
* ``--quantize 64,32,32:float-head`` re-fits the model's weights in memory, one variant per item:
  every linear weight and the LM head dequantized (exactly) and quantized again round-to-nearest
  at group size G (the largest group size dividing K where G does not); ``:float-head`` keeps the
  head as it was (float, or dequantized from int4).

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

from .quant import GROUP_SIZES, Int4Weight, requantize_params

DEFAULT_CORPUS = Path(__file__).parent / "data" / "eval-corpus.txt"


class EvalError(ValueError):
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


def describe_weights(params: dict) -> str:
    """e.g. 'int4 g32 x210, head float32' / 'int4 g64 x181 + g128 x30, head int4 g64'."""
    sizes = Counter(w.group_size for k, w in params.items() if isinstance(w, Int4Weight) and k != "lm_head")
    body = " + ".join(f"g{g} x{n}" for g, n in sorted(sizes.items())) or "none"
    head = params["lm_head"]
    head_s = f"int4 g{head.group_size}" if isinstance(head, Int4Weight) else str(head.dtype).replace("torch.", "")
    return f"int4 {body}, head {head_s}"


def parse_variants(spec: str) -> list[tuple[int, bool]]:
    """'64,32,32:float-head' -> [(64, False), (32, False), (32, True)]."""
    out = []
    for item in (x.strip() for x in spec.split(",") if x.strip()):
        g, _, opt = item.partition(":")
        if opt not in ("", "float-head"):
            raise EvalError(f"--quantize item {item!r}: unknown option {opt!r} (only ':float-head')")
        try:
            gi = int(g.lstrip("g"))
        except ValueError:
            raise EvalError(f"--quantize item {item!r}: group size must be one of {GROUP_SIZES}") from None
        if gi not in GROUP_SIZES:
            raise EvalError(f"--quantize item {item!r}: group size must be one of {GROUP_SIZES}")
        out.append((gi, opt == "float-head"))
    if not out:
        raise EvalError("--quantize: empty list")
    return out


def _reference_decoder(cfg, params, window: int, device):
    from .model import Transformer

    return Transformer(cfg, params, max_seq_len=window, device=device, dtype=torch.float32)


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
             quantize: str | None = None, window: int = 512, stride: int | None = None,
             max_tokens: int | None = None, backend: str = "reference", device: str = "cpu",
             log=print) -> list[EvalRow]:
    from .loading import load_model

    variants = parse_variants(quantize) if quantize else []  # bad specs fail before any load
    lm = load_model(model)
    if lm.tokenizer is None:
        raise EvalError(f"model {lm.source}: has no tokenizer (synthetic?); flint eval reads text")
    ids = lm.tokenizer.encode(read_corpus(text_path))
    if max_tokens:
        ids = ids[:max_tokens]
    if window > lm.cfg.max_position_embeddings:
        raise EvalError(f"--window {window} exceeds the model's context of {lm.cfg.max_position_embeddings}")
    stride = stride or window // 2
    windows(len(ids), window, stride)  # validates before the models are built

    def build(params, name=backend):
        if name == "reference":
            return _reference_decoder(lm.cfg, params, window, device)
        from .backend import make_backend
        from .loading import LoadedModel

        return make_backend(name, LoadedModel(lm.cfg, params, None, lm.source), max_seq_len=window,
                            device=device)

    model_label = model or "embedded:smollm2"
    cands, weights = [], {}
    if against:
        ref_lm = load_model(against)
        if ref_lm.cfg.vocab_size != lm.cfg.vocab_size:
            raise EvalError(f"--against {against}: vocabulary size {ref_lm.cfg.vocab_size} differs from the "
                            f"model's {lm.cfg.vocab_size}")
        ref = (against, _reference_decoder(ref_lm.cfg, ref_lm.params, window, device))
        weights[against] = describe_weights(ref_lm.params)
        cands.append((model_label, build(lm.params)))
        weights[model_label] = describe_weights(lm.params)
    else:
        ref = (model_label, _reference_decoder(lm.cfg, lm.params, window, device))
        weights[model_label] = describe_weights(lm.params)
    for g, float_head in variants:
        params = requantize_params(lm.params, g, float_head)
        label = f"requantized g{g}" + (", float head" if float_head else "")
        cands.append((label, build(params)))
        weights[label] = describe_weights(params)
    log(f"flint eval: {len(ids)} tokens, window {window}, stride {stride}, {1 + len(cands)} model(s)",
        file=sys.stderr)
    rows = evaluate(ids, ref, cands, window, stride,
                    progress=lambda i, n: log(f"  window {i}/{n}", file=sys.stderr) if i % 4 == 0 or i == n else None)
    for r in rows:
        r.weights = weights[r.label]
    return rows


def markdown_table(rows: list[EvalRow]) -> str:
    ref_ppl = rows[0].ppl
    lines = ["| model | weights | PPL | ΔPPL | KL mean | KL p99 | top-1 agree |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for i, r in enumerate(rows):
        if i == 0:
            lines.append(f"| {r.label} (reference) | {r.weights} | {r.ppl:.3f} | | | | |")
        else:
            lines.append(f"| {r.label} | {r.weights} | {r.ppl:.3f} | {r.ppl - ref_ppl:+.3f} | {r.kl_mean:.4f} | "
                         f"{r.kl_p99:.4f} | {r.top1_agree:.2%} |")
    return "\n".join(lines)


def _run(args) -> int:
    rows = run_eval(args.model, args.file, args.against, args.quantize, args.window, args.stride,
                    args.max_tokens, args.backend, args.device or "cpu")
    print(f"{rows[0].tokens} tokens scored, window {args.window}, stride {args.stride or args.window // 2}")
    print(markdown_table(rows))
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
                   help="also evaluate the model re-quantized in memory at these group sizes, "
                        "each optionally ':float-head', e.g. 64,32,32:float-head")
    p.add_argument("--window", type=int, default=512, help="tokens per window (default 512)")
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
