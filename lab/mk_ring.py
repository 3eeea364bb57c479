"""The weight stream of one layer against its stages (a trace variant: build it with MK_WS_RING=1,
`python3 lab/mk_variants.py ring=.:MK_WS_RING=1`): for the middle layer of one Granite-4.1-3B int4 G128
step at ctx 512 (M tokens, 1 unless given), blocks 0 and last:

- the block's stage ends (its per-layer stamps, BLOCK_STAMPS),
- when the producer issued each of the 32 copies from the layer's first (its empty-slot wait done),
- the FFN split-K down partials per warp: staged, and per chunk of the down slice when the warp began
  to wait for it and when it had arrived (so "arrived - issued" is a copy's latency where a warp waited).

All in us after the block's layer start (SM clock measured in the same launch).

    cd build/var/ring && FLINT_KERNEL_DIR=../../kernels FLINT_MK_TRACE=1 python3 lab/mk_ring.py [M]
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from flint.megakernel import MegakernelBackend  # noqa: E402
from mk_dev import traced_step_stamps, warm_granite  # noqa: E402

mk, step = warm_granite(m=int(sys.argv[1]) if len(sys.argv) > 1 else 1, traced=True)
L = mk.cfg.num_layers
for rep in range(2):
    traced_step_stamps(mk, step)  # one more step, trace cleared first
    for b in (0, 1):
        ghz = mk.sm_clock_ghz(b)
        lay = mk.trace[(b * L + L // 2) * 32:(b * L + L // 2) * 32 + 32].cpu().double()
        gt0, clk0 = lay[0], lay[14]
        w = mk.warp_trace(b)
        if bool(torch.isnan(w[15]).all()):
            sys.exit("mk_ring: no producer stamps: run it on a build with MK_WS_RING=1")

        def us(c):
            return (c - clk0) / ghz / 1e3
        stages = " ".join(f"{n} {(lay[k] - gt0) / 1e3:.2f}" for k, n in enumerate(MegakernelBackend.BLOCK_STAMPS)
                          if k > 0 and lay[k] > 0)
        print(f"rep {rep} block {'0' if b == 0 else 'last'} (SM clock {ghz:.3f} GHz), us after the layer start")
        print(f"  stage ends: {stages}")
        iss = us(w[15])
        print("  copies issued: " + " ".join(f"{q}:{v:.2f}" for q, v in enumerate(iss.tolist()) if v == v))
        if bool(torch.isnan(w[:15, 1]).all()):
            print("  (no FFN down partials in this block)")
            continue
        print("  down partials, per warp: staged | chunk k: wait start / arrived")
        for wp in range(15):
            r = us(w[wp])
            ch = " | ".join(f"{r[2 + 2 * k]:.2f}/{r[3 + 2 * k]:.2f}" for k in range(8) if r[3 + 2 * k] == r[3 + 2 * k])
            print(f"   {wp:2d} {r[1]:6.2f} | {ch} | end {r[20]:.2f}")
