"""Inside one stage, per warp: the middle layer's o-proj stage (blocks 0 and last) and attention
item (block 0) of one Granite-4.1-3B int4 G128 step (ctx 512, M = 1), from %clock64 stamps.

    FLINT_KERNEL_DIR=build/kernels FLINT_MK_TRACE=1 python3 lab/mk_warps.py

(FLINT_MK_TRACE=1 loads the traced library: build it here first with
`FLINT_KERNEL_DIR=build/kernels python3 -m flint.kernels.build --traced`, or name TRACE=1 in
lab/mk_variants.py.)

Times in us since the block entered the stage (cycles / the SM clock measured in the same launch).
o-proj: "slot" = the tile's ring slot was ready, "dot" = the warp's K part done, "parts" = the
reducer saw all parts, "epi" = the reducer's epilogue done (reducer rows only).
"""
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from mk_dev import traced_step_stamps, warm_granite  # noqa: E402

mk, step = warm_granite(traced=True)

def f(v, ghz):
    return "    -" if v is None or math.isnan(v) else f"{v / ghz / 1e3:5.2f}"


for rep in range(2):
    traced_step_stamps(mk, step)  # one more step, trace cleared first
    for b in (0, 1):
        ghz = mk.sm_clock_ghz(b)
        w = mk.warp_clocks(b)
        print(f"rep {rep} block {'0' if b == 0 else 'last'} (SM clock {ghz:.3f} GHz): o-proj stage, us since entry")
        cols = ["o.staged", "o.tile0.slot", "o.tile0.dot", "o.tile0.parts", "o.tile0.epilogue", "o.tile1.slot",
                "o.tile1.dot", "o.tile1.parts", "o.tile1.epilogue", "o.loop_end", "o.exit"]
        print("  warp " + " ".join(f"{c[2:]:>7s}"[-7:] for c in cols))
        for wi in range(15):
            print(f"  {wi:4d} " + " ".join(f"{f(w[c][wi], ghz):>7s}" for c in cols))
        if b == 0 or not math.isnan(w["attn.q"][0]):  # block 0, or a second block with an item (MK_TRACE_B2)
            acols = ["attn.q", "attn.tile", "attn.scores", "attn.softmax", "attn.pv", "attn.partial", "attn.count",
                     "attn.merge", "attn.exit"]
            print("  attention item, warp 0 / max over warps, us since entry:")
            for c in acols:
                vals = [v for v in w[c] if not math.isnan(v)]
                print(f"    {c:13s} {f(w[c][0], ghz)} / {f(max(vals) if vals else float('nan'), ghz)}")
