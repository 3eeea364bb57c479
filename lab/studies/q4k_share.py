"""Each GGUF tensor type's share of what the int4 backends cost on a K-quant file, one type at a time.

    python3 lab/studies/q4k_share.py FILE.gguf [--max-tokens 2048]

Every row changes the matrices of one source type only, the rest (the head included) as the
reference backend loads them (the file's exact values), and is scored by `flint eval`'s evaluate
(the reference decoder in fp32, the default corpus, window 512, stride 256) against the file:
``Q4_K codes kept`` is what the int4 kernels read of the Q4_K matrices (their codes, the fp16
(scale, min)); ``Q4_K re-fitted`` is what they read before the codes were kept (dequantized and
quantized again round-to-nearest at G = 32); ``Q6_K`` / ``Q8_0`` the requantization at G = 32 that
those types still get. Used for bench/results/q4k_codes_kept_2026-12-02.md.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import gguf  # noqa: E402

from flint.evaluate import _reference_decoder, evaluate, read_corpus  # noqa: E402
from flint.loading import _GGUF_LAYER, load_model  # noqa: E402
from flint.params import LINEAR_NAMES  # noqa: E402
from flint.quant.int4 import ExactInt4Weight, Int4Weight, quantize_int4  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--max-tokens", type=int, default=2048)
    a = ap.parse_args()
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(a.path).tensors}
    ours = {v: k for k, v in _GGUF_LAYER.items()}
    lm = load_model(a.path)

    def kind(fl):
        _, i, n = fl.split(".")
        return types[f"blk.{i}.{ours[n]}"]

    layer = [k for k in lm.params if k.startswith("layers.") and k.rsplit(".", 1)[-1] in LINEAR_NAMES]

    def dense(w):
        return w.dequantize() if isinstance(w, Int4Weight) else w

    variants = {
        "Q4_K codes kept (fp16 scale/min)": ("Q4_K", lambda w: w.kernel_view() if isinstance(w, ExactInt4Weight) else w),
        "Q4_K re-fitted RTN g32": ("Q4_K", lambda w: quantize_int4(dense(w), 32)),
        "Q6_K requantized RTN g32": ("Q6_K", lambda w: quantize_int4(dense(w), 32)),
        "Q8_0 requantized RTN g32": ("Q8_0", lambda w: quantize_int4(dense(w), 32)),
    }
    ids = lm.tokenizer.encode(read_corpus(None))[: a.max_tokens]
    cands = []
    for label, (t, f) in variants.items():
        names = [k for k in layer if kind(k) == t]
        params = dict(lm.params, **{k: f(lm.params[k]) for k in names})
        cands.append((f"{label} ({len(names)} matrices)", _reference_decoder(lm.cfg, params, 512, "cpu")))
    rows = evaluate(ids, ("the file", _reference_decoder(lm.cfg, lm.params, 512, "cpu")), cands)
    print(f"{rows[0].tokens} tokens scored, window 512, stride 256")
    print("| variant (only these matrices changed) | PPL | ΔPPL | KL mean | KL p99 | top-1 agree |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        if r.kl_mean is None:
            print(f"| {r.label} | {r.ppl:.3f} | | | | |")
        else:
            print(f"| {r.label} | {r.ppl:.3f} | {r.ppl - rows[0].ppl:+.3f} | {r.kl_mean:.2e} | {r.kl_p99:.2e} | "
                  f"{r.top1_agree:.2%} |")


if __name__ == "__main__":
    main()
