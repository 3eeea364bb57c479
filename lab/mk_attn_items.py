"""Attention's work items across blocks: for the middle layer of one Granite-4.1-3B int4 G128 step
(ctx 512 unless given, at most 1024; M = 1), every item's block entry and end (us after the earliest block's layer start),
laid out as kv head x context split (item = kvh * nsplit + sp runs on block item).

    FLINT_KERNEL_DIR=build/kernels FLINT_MK_TRACE=1 python3 lab/mk_attn_items.py [ctx]

Shows whether a kv head's merge (split 0's block with MK_TMERGE) waits for one late split or for all.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from mk_dev import traced_step_stamps, warm_granite  # noqa: E402

ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 512
mk, step = warm_granite(None, pos=ctx - 1, m=1, traced=True)  # the step's token at position ctx - 1
names = mk.BLOCK_STAMPS
qe, a_in, a_out = names.index("qkv"), names.index("bar1"), names.index("attn")
nkv = mk.cfg.num_kv_heads
ntiles = (ctx + 63) // 64  # 64-key tiles (ATT_T) over positions 0 .. ctx - 1
nsplit = min(ntiles, max(1, mk.nblocks // nkv))
tps = (ntiles + nsplit - 1) // nsplit
nsplit = (ntiles + tps - 1) // tps
for rep in range(2):
    t = traced_step_stamps(mk, step)
    print(f"rep {rep}: ctx {ctx}, {nkv} kv heads x {nsplit} splits; per item: qkv end / attention entry / end (us)")
    for h in range(nkv):
        cells = []
        for sp in range(nsplit):
            b = h * nsplit + sp
            cells.append(f"{t[b, qe]:5.2f}/{t[b, a_in]:5.2f}/{t[b, a_out]:5.2f}")
        print(f"  kvh {h}: " + "  ".join(cells))
    print(f"  qkv end over all blocks: min {t[:, qe].min():.2f} median {t[:, qe].median():.2f} max {t[:, qe].max():.2f}")
