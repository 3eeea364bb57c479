"""A/B timing of megakernel variants in ONE device call (run-to-run differences between lent H200s
are a few percent, larger than many single changes).

Each variant is a copy of the `flint` package under build/var/<name>/ with its library prebuilt
(same FLINT_KERNEL_DIR, different source hash). Variants run alternately in subprocesses, ROUNDS
times each; the table gives each variant's median step (CUDA events, synthetic Granite-4.1-3B
int4 G128, M = 1, ctx 512 unless --ctx).

    python3 lab/mk_variants.py base=HEAD new=.              # or by hand:
    git archive HEAD flint | tar -x -C build/var/base          # baseline = last commit
    mkdir -p build/var/new && cp -r flint build/var/new/        # candidate = working tree
    for v in base new; do (cd build/var/$v && FLINT_KERNEL_DIR=../../kernels python3 -m flint.kernels.build); done
    # device (carry: ["build"]):
    FLINT_KERNEL_DIR=build/kernels python3 lab/mk_ab.py base new
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import statistics, sys, json, torch
from flint.config import SYNTHETIC, from_hf_dict
from flint.megakernel import MegakernelBackend
from flint.synthetic import synthetic_params
ctx, model, group, iters, m = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
cfg = from_hf_dict(dict(SYNTHETIC[model]), model)
params = synthetic_params(cfg, seed=0, int4_group_size=group, dtype=torch.float32, device="cuda")
mk = MegakernelBackend(cfg, params, ctx + 16)
del params
mk.k_cache.normal_(0, 1); mk.v_cache.normal_(0, 1)
tok = torch.full((m,), 123, device="cuda")
for _ in range(10):
    mk.forward(tok, ctx - 1)
torch.cuda.synchronize()
ts = []
for _ in range(iters):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(); mk.forward(tok, ctx - 1); e.record(); e.synchronize()
    ts.append(s.elapsed_time(e) * 1e3)
print(json.dumps(dict(us=statistics.median(ts))))
"""


def ab_parser(rounds: int, iters: int) -> argparse.ArgumentParser:
    """The options of the A/B scripts (this one and lab/mk_ab1.py): variants, shape, rounds, steps per round, M."""
    ap = argparse.ArgumentParser()
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--model", default="granite-4.1-3b")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--iters", type=int, default=iters)
    ap.add_argument("--m", default="1", help="tokens per step, comma-separated for several (verify steps: M > 1)")
    return ap


def main() -> None:
    args = ab_parser(rounds=2, iters=60).parse_args()
    root = Path(__file__).resolve().parents[1]
    ms = [int(x) for x in args.m.split(",")]
    for m in ms:
        run_m(args, root, m)


def run_m(args, root: Path, m: int) -> None:
    res: dict[str, list[float]] = {v: [] for v in args.variants}
    for _ in range(args.rounds):
        for v in args.variants:
            vdir = root / "build" / "var" / v  # cwd = the variant, so `import flint` is its copy
            env = dict(os.environ, PYTHONPATH=str(vdir),
                       FLINT_KERNEL_DIR=str(Path(os.environ.get("FLINT_KERNEL_DIR", "build/kernels")).resolve()))
            out = subprocess.run([sys.executable, "-c", CHILD, str(args.ctx), args.model, str(args.group),
                                  str(args.iters), str(m)], env=env, cwd=vdir, capture_output=True, text=True)
            if out.returncode != 0:
                print(f"{v}: FAILED\n{out.stderr[-2000:]}")
                continue
            res[v].append(json.loads(out.stdout.strip().splitlines()[-1])["us"])
    print(f"{args.model} ctx {args.ctx} M={m} (median step per round, us)")
    for v, ts in res.items():
        if ts:
            print(f"{v:12s} {statistics.median(ts):8.1f} us  {1e6 / statistics.median(ts):7.1f} tok/s   rounds {[round(t, 1) for t in ts]}")


if __name__ == "__main__":
    main()
