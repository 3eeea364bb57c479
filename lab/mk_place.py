"""Does the megakernel's step depend on where its buffers land? (2026-11-30)

flint bench's megakernel figure at ctx 512 moved by 7-13% between runs that differ only in --tokens (the KV cache's
size, so every later allocation's address), while the compiled backend's stayed within 0.5%. This builds ONE set of
synthetic Granite-4.1-3B weights, then creates MegakernelBackend several times, each behind a pad tensor of another
size (which shifts the backend's small buffers: the synchronization counters and the tagged words every block polls),
times the per-launch step (CUDA events, median of --iters steps, --rounds rounds over the configurations in turn)
and prints each configuration's median with the address of its hot buffers.

    device:  python3 lab/mk_place.py --pads 0,512,4096,65536,262144,786432 --rounds 4
             python3 lab/mk_place.py --move dpart,qkv_tag,part,bar_counter+epoch --tries 4
             (--move: one backend; each named buffer, or "+"-joined group, re-allocated --tries times, the rest kept)
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mk_dev import median_step  # noqa: E402  (the per-launch timing shared with lab/mk_dev.py)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="granite-4.1-3b")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--pads", default="0,512,4096,65536,262144,786432", help="pad sizes in bytes, one backend each")
    ap.add_argument("--max-seq", type=int, default=0, help="the backends' max_seq_len (0: ctx + 16)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--move", default="", help="buffers to move one group at a time (see above)")
    ap.add_argument("--tries", type=int, default=4)
    args = ap.parse_args()

    import os

    import torch

    os.environ["FLINT_MK_PLACE"] = "1"  # (the backends' own placement off: this script is the measurement)

    from flint.config import SYNTHETIC, from_hf_dict
    from flint.megakernel import MegakernelBackend
    from flint.synthetic import synthetic_params

    cfg = from_hf_dict(dict(SYNTHETIC[args.model]), args.model)
    params = synthetic_params(cfg, seed=0, int4_group_size=128, dtype=torch.float32, device="cuda")
    if args.move:
        move(args, cfg, params)
        return
    pads = [int(x) for x in args.pads.split(",")]
    keep, mks = [], []
    for p in pads:  # every backend stays alive: the pads and backends alternate in the allocator's pools
        keep.append(torch.empty(max(p, 1), dtype=torch.uint8, device="cuda"))
        mk = MegakernelBackend(cfg, params, args.max_seq or args.ctx + 16)
        mk.k_cache.normal_(0, 1)
        mk.v_cache.normal_(0, 1)
        mks.append(mk)
    del params
    tok = torch.full((1,), 123, device="cuda")
    pos = args.ctx - 1
    for mk in mks:
        for _ in range(5):
            mk.forward(tok, pos)
    torch.cuda.synchronize()
    per = [[] for _ in pads]
    for r in range(args.rounds):
        for i in (range(len(pads)) if r % 2 == 0 else reversed(range(len(pads)))):
            mks[i].forward(tok, pos)
            per[i].append(median_step(mks[i], tok, pos, args.iters))
    print(f"{args.model} ctx {args.ctx} M=1: {len(pads)} backends on the same weights, {args.rounds} rounds x "
          f"{args.iters} steps (median step per round, us)")
    for i, p in enumerate(pads):
        mk = mks[i]
        hot = {n: getattr(mk, n).data_ptr() for n in ("bar_counter", "qkv_tag", "part", "dpart", "epoch")
               if getattr(mk, n, None) is not None}
        addrs = " ".join(f"{n} {a % (1 << 24):#08x}" for n, a in hot.items())
        print(f"pad {p:8d}  {statistics.median(per[i]):8.1f} us  rounds "
              f"{' '.join(f'{x:.1f}' for x in per[i])}  ({addrs}, low 24 bits)")


def move(args, cfg, params) -> None:
    """One backend; each group of scratch buffers re-allocated (zeroed) args.tries times with the others kept, the
    handle re-created on each, the per-launch step timed: which buffers' placement moves the step."""
    import torch

    from flint.megakernel import MegakernelBackend

    mk = MegakernelBackend(cfg, params, args.max_seq or args.ctx + 16)
    mk.k_cache.normal_(0, 1)
    mk.v_cache.normal_(0, 1)
    tok = torch.full((1,), 123, device="cuda")
    pos = args.ctx - 1

    def timed() -> float:
        for _ in range(3):
            mk.forward(tok, pos)
        return statistics.median(median_step(mk, tok, pos, args.iters) for _ in range(args.rounds))

    keep = []
    print(f"{args.model} ctx {args.ctx} M=1: one backend, each group re-allocated {args.tries} times "
          f"(median of {args.rounds} x {args.iters} steps, us)")
    print(f"as created: {timed():.1f}")
    for group in args.move.split(","):
        names = group.split("+")
        row = []
        for _ in range(args.tries):
            fresh = {n: torch.zeros_like(getattr(mk, n)) for n in names}
            keep.append(fresh)
            for n, t in fresh.items():
                setattr(mk, n, t)
            mk._lib.flint_mk_destroy(mk._h)
            mk._h = mk._create_handle()
            mk.reset()  # (counters, epoch and tagged words restart together: a consistent state)
            row.append(timed())
        print(f"{group:24s} " + " ".join(f"{x:.1f}" for x in row) + f"   spread {max(row) / min(row) - 1:.1%}")


if __name__ == "__main__":
    main()
