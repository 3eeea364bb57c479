"""Where a long-context attention split's time goes: block 0's item in the middle layer of one Granite-4.1-3B int4 G128
step at ctx C (M = 1), from the traced build's per-warp %clock64 stamps: entry, q seen, and the last tile's phases (the
stamps inside the tile loop keep the last tile's), plus the stage's span from the block stamps.

    FLINT_KERNEL_DIR=build/kernels python3 -m flint.kernels.build --traced     (FLINT_MK_TRACE_SPILLS_OK=1 if it spills)
    FLINT_KERNEL_DIR=build/kernels FLINT_MK_TRACE=1 python3 lab/mk_attn_tiles.py 32768 8192
"""
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from mk_dev import traced_step_stamps, warm_granite  # noqa: E402

for ctx in [int(a) for a in sys.argv[1:]] or [32768]:
    mk, step = warm_granite(pos=ctx - 1, traced=True, max_seq=ctx + 16)
    ntiles = (ctx + 63) // 64
    nsplit = min(ntiles, max(1, mk.nblocks // mk.cfg.num_kv_heads))
    tps = (ntiles + nsplit - 1) // nsplit
    names = mk.BLOCK_STAMPS
    a_in, a_out = names.index("bar1"), names.index("attn")
    for rep in range(2):
        t = traced_step_stamps(mk, step)
        ghz = mk.sm_clock_ghz(0)
        w = mk.warp_clocks(0)

        def us(c, agg=max):
            vals = [v for v in w[c] if not math.isnan(v)]
            return agg(vals) / ghz / 1e3 if vals else float("nan")

        q, tile, sc, sm, pv, ex = (us(c) for c in ("attn.q", "attn.tile", "attn.scores", "attn.softmax", "attn.pv",
                                                    "attn.exit"))
        span = float((t[:, a_out] - t[:, a_in]).median())
        print(f"ctx {ctx} rep {rep}: {tps} tiles per split, SM clock {ghz:.3f} GHz; block 0, us since its entry "
              f"(max over warps): q {q:.2f}, last tile landed {tile:.2f}, scores {sc:.2f}, softmax {sm:.2f}, "
              f"P V {pv:.2f}, exit {ex:.2f}; loop {(pv - q):.2f} us = {(pv - q) / tps:.3f} us a tile; last tile: "
              f"scores {sc - tile:.2f}, softmax {sm - sc:.2f}, "
              f"P V {pv - sm:.2f}; stage span over blocks (median) {span:.2f} us")
    del mk
