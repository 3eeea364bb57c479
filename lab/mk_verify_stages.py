"""Where a verify step's time goes: per-layer stage times of the megakernel for M = 1, 2, 4, 8 tokens (traced
library), on synthetic Granite-4.1-3B and SmolLM2-135M shapes at one context, beside the untraced step time.

    FLINT_KERNEL_DIR=build/kernels FLINT_MK_TRACE=1 python3 lab/mk_verify_stages.py [--ms 1,2,4,8] [--pos 511] [--warps]
        [--traced-only] [--models granite-4.1-3b,smollm2-135m]

Each (model, M): 4 warm-up launches, then 9 traced launches; the table holds the median over launches of block
0's mean per-layer stage times (MegakernelBackend.stage_times), µs. The untraced step times come from a second
backend on the untraced library in the same process (CUDA events, median of 30). `--warps` adds, per M, the middle
layer's attention item on block 0 (split 0 of kv head 0, the merger where there is one): each phase's end as the
median over launches of the latest warp's stamp, µs after the item's entry (MegakernelBackend.warp_clocks). GPU.
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
sys.path.insert(0, str(Path(__file__).resolve().parent))
from flint.config import SYNTHETIC, from_hf_dict  # noqa: E402
from flint.megakernel import MegakernelBackend  # noqa: E402
from flint.synthetic import synthetic_params  # noqa: E402
from mk_dev import median_step  # noqa: E402


ATT_PHASES = ("attn.q", "attn.tile", "attn.scores", "attn.softmax", "attn.pv", "attn.partial", "attn.count",
              "attn.merge", "attn.exit")


def attention_phases(mk) -> dict:
    """Block 0's attention item in the middle layer of the last launch: per phase the latest warp's stamp, µs
    after the item's entry (absent where no warp stamped it)."""
    ghz = mk.sm_clock_ghz(0)
    w = mk.warp_clocks(0)
    out = {}
    for name in ATT_PHASES:
        vals = [v for v in w[name] if v == v]
        if vals:
            out["w." + name] = max(vals) / ghz / 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="granite-4.1-3b,smollm2-135m")
    ap.add_argument("--ms", default="1,2,4,8")
    ap.add_argument("--pos", type=int, default=511)
    ap.add_argument("--json", default=None)
    ap.add_argument("--warps", action="store_true", help="block 0's attention phases per M (the middle layer)")
    ap.add_argument("--traced-only", action="store_true",
                    help="no untraced backend (no step_us): only the traced library needs to be present")
    a = ap.parse_args()
    if os.environ.get("FLINT_MK_TRACE") != "1":
        sys.exit("set FLINT_MK_TRACE=1 (the traced library: python3 -m flint.kernels.build --traced)")
    ms = [int(x) for x in a.ms.split(",")]
    doc = []
    for model in a.models.split(","):
        cfg = from_hf_dict(dict(SYNTHETIC[model]), model)
        params = synthetic_params(cfg, seed=0, int4_group_size=128 if "granite" in model else 64,
                                  dtype=torch.float32, device="cuda")
        traced = MegakernelBackend(cfg, params, a.pos + 16)
        plain = None
        if not a.traced_only:
            os.environ["FLINT_MK_TRACE"] = "0"
            plain = MegakernelBackend(cfg, params, a.pos + 16)
            os.environ["FLINT_MK_TRACE"] = "1"
        del params
        rows = {}
        for m in ms:
            tok = torch.full((m,), 7, device="cuda")
            for _ in range(4):
                traced.forward(tok, a.pos)
            runs = []
            for _ in range(9):
                traced.trace.zero_()
                traced.forward(tok, a.pos)
                torch.cuda.synchronize()
                runs.append(traced.stage_times(0))
                if a.warps:
                    runs[-1].update(attention_phases(traced))
            st = {k: statistics.median(r[k] for r in runs if k in r) for k in dict.fromkeys(k for r in runs for k in r)}
            if plain is not None:
                st["step_us"] = median_step(plain, tok, a.pos, 30)
            st["ring_slots"] = traced.smem_info(m)["ring_slots"]  # (lab/chain_model.py's Shape.nslots)
            rows[m] = st
        doc.append({"model": model, "pos": a.pos, "stages": rows})
        keys = [k for k in rows[ms[0]] if not k.startswith("w.")] + \
            [f"w.{n}" for n in ATT_PHASES if any(f"w.{n}" in rows[m] for m in ms)]
        print(f"\n{model}, position {a.pos}: µs per layer by stage (block 0, traced), step µs untraced")
        print("| stage | " + " | ".join(f"M = {m}" for m in ms) + " | " + " | ".join(f"×{m}/1" for m in ms[1:]) + " |")
        print("|---|" + "---:|" * (2 * len(ms) - 1))
        for k in keys:
            v = [rows[m].get(k, float("nan")) for m in ms]
            ratio = [f"{x / v[0]:.2f}" if v[0] > 0.05 else "" for x in v[1:]]
            print(f"| {k} | " + " | ".join(f"{x:.2f}" for x in v) + " | " + " | ".join(ratio) + " |")
        del traced, plain
        torch.cuda.empty_cache()
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
