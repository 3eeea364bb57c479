"""Does the FFN split-K (and with it the M <= 2 objects' fence-free protocol: tagged hops, the counted residual)
pay on a shape whose FFN plan covers less than 90% of the grid? Two backends on one set of synthetic weights, one
with the split forced (ffn_split="1") and one as shipped ("auto"), their logits against the reference decoder, then
their steps alternated in rounds at each M (paired per-round ratios, medians), with the L2 flushed before each step
or not, and the chain figure (MegakernelBackend.chain_us) of each.

    FLINT_KERNEL_DIR=build/kernels python3 lab/mk_split_ab.py [--model smollm2-135m] [--ms 1,2,3,4,8] [--json OUT]

lab/chain_model.py projects it first (Shape.ffn_split). GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flint.config import SYNTHETIC, from_hf_dict  # noqa: E402
from flint.megakernel import MegakernelBackend  # noqa: E402
from flint.model import Transformer  # noqa: E402
from flint.synthetic import synthetic_params  # noqa: E402


def timed(mk, tok, pos: int, flush: torch.Tensor | None) -> float:
    if flush is not None:
        flush.mul_(1.0)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    mk.forward(tok, pos)
    e.record()
    e.synchronize()
    return s.elapsed_time(e) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--ms", default="1,2,3,4,8")
    ap.add_argument("--pos", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    os.environ.setdefault("FLINT_MK_PLACE", "1")
    cfg = from_hf_dict(dict(SYNTHETIC[a.model]), a.model)
    params = synthetic_params(cfg, seed=0, int4_group_size=a.group, dtype=torch.float32, device="cuda")
    maxlen = a.pos + 16
    backs = {"auto": MegakernelBackend(cfg, params, maxlen, ffn_split="auto"),
             "split": MegakernelBackend(cfg, params, maxlen, ffn_split="1")}
    ref = Transformer(cfg, params, maxlen, device="cuda", dtype=torch.float32)
    plans = {k: (b.ffn_plan or {}).get("nffn", 0) for k, b in backs.items()}
    toks = torch.randint(0, cfg.vocab_size, (a.pos + 8,), generator=torch.Generator().manual_seed(1))
    for i in range(0, a.pos, 8):  # the same context in all three
        for b in (*backs.values(), ref):
            b.forward(toks[i:i + 8], i)
    want = ref.forward(toks[a.pos:a.pos + 1], a.pos).float()
    err = {k: float((b.forward(toks[a.pos:a.pos + 1], a.pos).float() - want).norm() / want.norm())
           for k, b in backs.items()}
    del ref
    flush = torch.ones(torch.cuda.get_device_properties(0).L2_cache_size, dtype=torch.float32, device="cuda")
    doc = {"model": a.model, "pos": a.pos, "device": torch.cuda.get_device_name(0), "nffn": plans,
           "rel_err_vs_reference": err, "rows": []}
    print(f"{a.model}: FFN blocks with the split {plans['split']}; logits vs reference {err}")
    for m in [int(x) for x in a.ms.split(",")]:
        tok = toks[a.pos:a.pos + m]
        for fl in (None, flush):
            t = {k: [] for k in backs}
            for r in range(a.rounds + 1):
                for k in (backs if r % 2 else reversed(list(backs))):
                    us = statistics.median(timed(backs[k], tok, a.pos, fl) for _ in range(a.iters))
                    if r:
                        t[k].append(us)
            ratio = statistics.median(s / b for s, b in zip(t["split"], t["auto"]))
            row = {"m": m, "l2_flushed": fl is not None, "auto_us": statistics.median(t["auto"]),
                   "split_us": statistics.median(t["split"]), "split_over_auto": ratio,
                   "rounds_faster": sum(s < b for s, b in zip(t["split"], t["auto"])), "rounds": a.rounds}
            doc["rows"].append(row)
            print(f"M = {m} {'flushed' if fl is not None else 'L2-warm'}: auto {row['auto_us']:.1f} µs, split "
                  f"{row['split_us']:.1f} µs, split/auto {ratio:.4f} ({row['rounds_faster']}/{a.rounds} rounds faster)")
    doc["chain_us"] = {k: b.chain_us(a.pos) for k, b in backs.items()}
    print("chain µs/layer:", {k: round(v, 3) for k, v in doc["chain_us"].items()})
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
