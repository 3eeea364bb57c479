"""Bytes per decode token of each LM-head variant on the SmolLM2 and Granite-4.1-3B shapes, computed.

    python3 lab/studies/head_bytes.py

The int4 rows are what the megakernel's ``weight_bytes_per_token`` counts (flint-int4-v1: a nibble
a weight and an fp16 (scale, min) a group, the body at --group-size 128 or the largest group
dividing K, fp32 norms, one fp32 embedding row; K/V not included), from the shapes alone. The int8
and bf16 heads are projections: no int4 backend streams them (flint/bench_head.py). The speed of
the int4 rows: `flint bench --head-group-size` on a GPU. Used for
bench/results/q4k_codes_kept_2026-12-02.md.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from flint.bench_head import int4_bytes  # noqa: E402
from flint.params import LINEAR_NAMES, expected_shapes  # noqa: E402
from flint.quant.int4 import fit_group_size  # noqa: E402
from flint.synthetic import synthetic_config  # noqa: E402

for name in ("smollm2-135m", "granite-4.1-3b"):
    cfg = synthetic_config(name)
    sh = expected_shapes(cfg)
    h, L = cfg.hidden_size, cfg.num_layers
    linear = [shape for key, shape in sh.items() if key.rsplit(".", 1)[-1] in LINEAR_NAMES]
    body = sum(int4_bytes(n, k, fit_group_size(k, 128)) for n, k in linear)
    rest = 4 * h * (2 * L + 1) + 4 * h  # fp32 norms + one fp32 embedding row (the megakernel's count)
    v = cfg.vocab_size
    print(f"{name}: V={v} H={h}; body int4 (g{fit_group_size(h, 128)}) + norms + embedding row: {(body + rest) / 1e6:.2f} MB")
    for label, hb in [(f"int4 g{g}", int4_bytes(v, h, g)) for g in (32, 64, 128) if h % g == 0] + \
                     [("int8 g32 (projection)", v * h + 2 * v * (h // 32)), ("bf16 (projection)", 2 * v * h)]:
        print(f"  head {label}: head {hb / 1e6:.2f} MB, weights per token {(body + rest + hb) / 1e6:.2f} MB")
