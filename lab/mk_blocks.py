"""Where a layer's time goes across ALL blocks: every block's stage-end times in the middle layer of one
Granite-4.1-3B int4 G128 step (ctx 512, M = 1), plus the SM clock during the launch.

    FLINT_KERNEL_DIR=build/kernels FLINT_MK_TRACE=1 python3 lab/mk_blocks.py [layers] [M]

(FLINT_MK_TRACE=1 loads the traced library: build it here first with
`FLINT_KERNEL_DIR=build/kernels python3 -m flint.kernels.build --traced`, or name TRACE=1 in
lab/mk_variants.py.)

(M > 1: a verify step of M tokens at the same position.)

Per stage: min / median / max over the blocks of the time the stage ended (us after the earliest
block's layer start) and the blocks that ended last; then per-stage durations. The grid barriers
("barN") show how long after the LAST block's arrival the blocks leave; the spread of a stage's end
shows the imbalance the next barrier waits for.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from flint.megakernel import MegakernelBackend  # noqa: E402
from mk_dev import traced_step_stamps, warm_granite  # noqa: E402

mk, step = warm_granite(int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1] != "-" else None,
                        m=int(sys.argv[2]) if len(sys.argv) > 2 else 1, traced=True)
names = MegakernelBackend.BLOCK_STAMPS
for rep in range(2):
    t = traced_step_stamps(mk, step)
    print(f"rep {rep}: SM clock {mk.sm_clock_ghz(0):.3f} GHz (block 0), {mk.sm_clock_ghz(1):.3f} GHz (last block)")
    print("  stage end, us: min / median / max   (blocks that ended last)")
    for k, n in enumerate(names):
        col = t[:, k]
        print(f"  {n:8s} {col.min():7.2f} {col.median():7.2f} {col.max():7.2f}   "
              f"{torch.argsort(col, descending=True)[:6].tolist()}")
    for n, a, b in (("qkv", 1, 2), ("attn", 3, 4), ("o", 5, 6), ("gate_up", 7, 8), ("dpart", 8, 9), ("down", 10, 11)):
        d = t[:, b] - t[:, a]
        q = torch.quantile(d, torch.tensor([0.0, 0.5, 0.9, 1.0], dtype=torch.float64))
        print(f"  duration {n:8s} min {q[0]:.2f} median {q[1]:.2f} p90 {q[2]:.2f} max {q[3]:.2f}")
    # the down partials' duration on the blocks that ran an attention item (its stage took > 1 us) against the others
    # (2026-11-30: the slow first down chunk follows attention)
    da, dd = t[:, 4] - t[:, 3], t[:, 9] - t[:, 8]
    nf = mk.ffn_plan["nffn"] if mk.ffn_plan else len(dd)
    for name, sel in (("attention", da[:nf] > 1.0), ("no attention", da[:nf] <= 1.0)):
        x = dd[:nf][sel]
        if len(x):
            print(f"  down partials, {name} FFN blocks ({len(x)}): min {x.min():.2f} median {x.median():.2f} "
                  f"mean {x.mean():.2f} max {x.max():.2f}")
    if rep == 1:  # the down partials' duration per block against the SM it ran on (slow blocks: where?)
        sm = mk.block_smids()
        d = t[:, 9] - t[:, 8]
        nffn = mk.ffn_plan["nffn"] if mk.ffn_plan else len(d)  # (blocks >= nffn have no down partials)
        order = [b for b in torch.argsort(d, descending=True).tolist() if b < nffn]
        print("  down partials, slowest 16 FFN blocks (block:sm:us):",
              " ".join(f"{b}:{int(sm[b])}:{d[b]:.2f}" for b in order[:16]))
        print("  down partials, fastest 8 FFN blocks (block:sm:us):",
              " ".join(f"{b}:{int(sm[b])}:{d[b]:.2f}" for b in order[-8:]))
