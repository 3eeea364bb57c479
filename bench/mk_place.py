"""Does the megakernel's step depend on where its buffers land? (session 20)

flint bench's megakernel figure at ctx 512 moved by 7-13% between runs that differ only in --tokens (the KV cache's
size, so every later allocation's address), while the compiled backend's stayed within 0.5%. This builds ONE set of
synthetic Granite-4.1-3B weights, then creates MegakernelBackend several times, each behind a pad tensor of another
size (which shifts the backend's small buffers: the synchronization counters and the tagged words every block polls),
times the per-launch step (CUDA events, median of --iters steps, --rounds rounds over the configurations in turn)
and prints each configuration's median with the address of its hot buffers.

    device:  python3 bench/mk_place.py --pads 0,512,4096,65536,262144,786432 --rounds 4
"""
from __future__ import annotations

import argparse
import statistics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="granite-4.1-3b")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--pads", default="0,512,4096,65536,262144,786432", help="pad sizes in bytes, one backend each")
    ap.add_argument("--max-seq", type=int, default=0, help="the backends' max_seq_len (0: ctx + 16)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()

    import torch

    from flint.config import SYNTHETIC, from_hf_dict
    from flint.megakernel import MegakernelBackend
    from flint.synthetic import synthetic_params

    cfg = from_hf_dict(dict(SYNTHETIC[args.model]), args.model)
    params = synthetic_params(cfg, seed=0, int4_group_size=128, dtype=torch.float32, device="cuda")
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
            mk = mks[i]
            mk.forward(tok, pos)
            ts = []
            for _ in range(args.iters):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                mk.forward(tok, pos)
                e.record()
                e.synchronize()
                ts.append(s.elapsed_time(e) * 1e3)
            per[i].append(statistics.median(ts))
    print(f"{args.model} ctx {args.ctx} M=1: {len(pads)} backends on the same weights, {args.rounds} rounds x "
          f"{args.iters} steps (median step per round, us)")
    for i, p in enumerate(pads):
        mk = mks[i]
        hot = {n: getattr(mk, n).data_ptr() for n in ("bar_counter", "qkv_tag", "part", "dpart", "epoch")
               if getattr(mk, n, None) is not None}
        addrs = " ".join(f"{n} {a % (1 << 24):#08x}" for n, a in hot.items())
        print(f"pad {p:8d}  {statistics.median(per[i]):8.1f} us  rounds "
              f"{' '.join(f'{x:.1f}' for x in per[i])}  ({addrs}, low 24 bits)")


if __name__ == "__main__":
    main()
