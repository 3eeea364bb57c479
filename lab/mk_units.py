"""Every unit of one matrix stage, per warp (a trace variant: build it with MK_WS_ALL=1 and the
stage picked by MK_WS_MAT, e.g. `python3 lab/mk_variants.py gu=.:MK_WS_ALL=1:MK_WS_MAT=MAT_GU`):
for the middle layer of one Granite-4.1-3B int4 G128 step (ctx 512), blocks 0 and last, per warp and
unit u (item = segment x tile, the first 8): when its ring slot was ready ("r"), when the warp's K
part was done ("d", warps holding a part), when the reducer's epilogue was done ("e"); us since the
block entered the stage (SM cycles / the clock measured in the same launch). Builds from session 9 on also
time the input's staging inside stage_x (loads landed, rstd known, words stored).

    cd build/var/gu && FLINT_KERNEL_DIR=../../kernels FLINT_MK_TRACE=1 python3 lab/mk_units.py [M]
"""
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from mk_dev import warm_granite  # noqa: E402

mk, step = warm_granite(m=int(sys.argv[1]) if len(sys.argv) > 1 else 1, traced=True)
mk.trace.zero_()
step()
torch.cuda.synchronize()
for b in (0, 1):
    ghz = mk.sm_clock_ghz(b)
    w = mk.warp_trace(b)
    t0 = float(torch.nan_to_num(w[:15, 0], nan=float("inf")).min())
    if bool(torch.isnan(w[:15, 31]).all()):
        sys.exit("mk_units: no unit stamps (slot 31 never written): run it on a build with MK_WS_ALL=1 "
                 "(python3 lab/mk_variants.py NAME=.:MK_WS_ALL=1:MK_WS_MAT=MAT_GU)")

    def f(v):
        return "    -" if math.isnan(v) else f"{(v - t0) / ghz / 1e3:5.2f}"

    print(f"block {'0' if b == 0 else 'last'} (SM clock {ghz:.3f} GHz), us since stage entry; per unit r/d/e")
    if not bool(torch.isnan(w[:15, 28]).all()):  # stage_x's own stamps (builds from session 9 on)
        print("staging, per warp: loads landed + squares summed (normed stages) / rstd known / words stored / staged")
        for wi in range(15):
            print(f"  {wi:2d}  " + " / ".join(f(float(w[wi, k])) for k in (26, 27, 28, 1)))
    print("warp staged | " + " | ".join(f"u{u}: r     d     e   " for u in range(8)) + "| loop  exit")
    for wi in range(15):
        units = " | ".join(" ".join(f(float(w[wi, 2 + 3 * u + k])) for k in range(3)) for u in range(8))
        print(f"{wi:4d} {f(float(w[wi, 1]))} | {units} | {f(float(w[wi, 30]))} {f(float(w[wi, 31]))}")
