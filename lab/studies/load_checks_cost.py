"""What the loaders' weight checks (flint.checks.check_weight: every value finite, magnitudes
plausible) add to a load: the embedded SmolLM2 GGUF loaded with and without them, the checks
alone on its weights, and their throughput on a large bf16 tensor (a 3B checkpoint's scale).

    python3 lab/studies/load_checks_cost.py [--repeats 5] [--threads 1]

Prints one line per figure, then one JSON document. CPU.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import flint.loading as loading  # noqa: E402
from flint.checks import check_weight  # noqa: E402


def median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    doc = {"threads": args.threads, "repeats": args.repeats}
    doc["load_s"] = median_s(lambda: loading.load_model(None), args.repeats)
    real = loading.check_weight
    loading.check_weight = lambda *a, **k: None
    try:
        doc["load_unchecked_s"] = median_s(lambda: loading.load_model(None), args.repeats)
    finally:
        loading.check_weight = real
    lm = loading.load_model(None)
    weights = list({id(w): (k, w) for k, w in lm.params.items()}.values())
    doc["checks_s"] = median_s(lambda: [check_weight(k, w, "x") for k, w in weights], args.repeats)
    big = torch.randn(1 << 27, dtype=torch.bfloat16).view(-1, 4096)  # 256 MiB
    s = median_s(lambda: check_weight("big", big, "x"), args.repeats)
    doc["bf16_GiB_per_s"] = 0.25 / s
    print(f"embedded SmolLM2 load: {doc['load_s']:.2f} s checked, {doc['load_unchecked_s']:.2f} s unchecked; "
          f"the checks alone {doc['checks_s'] * 1000:.0f} ms")
    print(f"float weights: {doc['bf16_GiB_per_s']:.2f} GiB/s of bf16 ({args.threads} thread)")
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
