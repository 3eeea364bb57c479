"""A/B of megakernel variants inside ONE process, on ONE set of weights and buffers.

lab/mk_ab.py runs each variant in its own process; between processes the same library's step time moves by up to
5% (2026-11-30: base rounds 1351.7 .. 1414.9 us in one call), more than most single changes. Here one
MegakernelBackend (the working tree's package and library) owns the weights, caches and scratch; every variant's
library (built by lab/mk_variants.py into build/kernels/<hash>/) is loaded next to it and gets its own handle from
flint_mk_create on the SAME arguments (the same device pointers), and the variants' launches alternate on one stream,
the order rotated every round. Per round and variant: the median of --iters steps (CUDA events); the table gives the
median over rounds and, against the first variant, the median and range of the per-round ratios (paired: the same
round, seconds apart). Synthetic Granite-4.1-3B int4 G128, ctx 512 unless --ctx.

    here:    python3 lab/mk_variants.py base=. new=.:MK_SOMETHING=1
    device:  FLINT_KERNEL_DIR=build/kernels python3 lab/mk_ab1.py base new --m 1,2 --rounds 15   (carry ["build"])

A variant may also be LABEL@NAME:ENV=VALUE[:ENV=VALUE...]: NAME's library with a handle created while ENV is set (the
host side's create-time overrides of that revision, e.g. 6606628's nb5@cur:FLINT_MK_ATT_NBUF=5).

The variants must share the host side (megakernel_host.cu's flint_mk_create arguments); the first variant's library
should be the working tree's (it is the one the backend loads).
"""
from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "lab"))
from mk_ab import ab_parser  # noqa: E402  (the shared options)


def variant_library(name: str) -> Path:
    """build/kernels/<hash>/libflint_mk.so of build/var/NAME (its own build.py computes its sources' hash)."""
    bp = ROOT / "build" / "var" / name / "flint" / "kernels" / "build.py"
    if not bp.exists():
        raise SystemExit(f"mk_ab1: {bp} not found (build the variant with lab/mk_variants.py)")
    spec = importlib.util.spec_from_file_location(f"_flint_build_{name}", bp)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    lib = mod.library_path(False)
    if not lib.exists():
        raise SystemExit(f"mk_ab1: variant {name}: {lib} not built (FLINT_KERNEL_DIR={os.environ.get('FLINT_KERNEL_DIR')})")
    return lib


def main() -> None:
    ap = ab_parser(rounds=15, iters=20)
    ap.add_argument("--json", default=None, help="write every round's figures here")
    ap.add_argument("--check", action="store_true",
                    help="before timing, each variant's logits against the first's on the same input (rel. diff, bitwise?)")
    args = ap.parse_args()

    import torch

    from flint.config import SYNTHETIC, from_hf_dict
    from flint.megakernel import MegakernelBackend, bind_library
    from flint.synthetic import synthetic_params

    def parse(v: str) -> tuple[str, dict]:
        if "@" not in v:
            return v, {}
        name, *envs = v.split("@", 1)[1].split(":")
        bad = [e for e in envs if "=" not in e]
        if bad:
            raise SystemExit(f"mk_ab1: variant {v}: {bad[0]!r} is not ENV=VALUE")
        return name, dict(e.split("=", 1) for e in envs)

    specs = {v: parse(v) for v in args.variants}
    libs = {v: variant_library(specs[v][0]) for v in args.variants}
    ms = [int(x) for x in args.m.split(",")]
    cfg = from_hf_dict(dict(SYNTHETIC[args.model]), args.model)
    params = synthetic_params(cfg, seed=0, int4_group_size=args.group, dtype=torch.float32, device="cuda")
    mk = MegakernelBackend(cfg, params, args.ctx + 16)
    del params
    mk.k_cache.normal_(0, 1)
    mk.v_cache.normal_(0, 1)
    ia, fa = mk._pack_args()
    handles = {}
    for v, path in libs.items():
        lib = bind_library(ctypes.CDLL(str(path)))
        h = ctypes.c_void_p()
        env = specs[v][1]
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            rc = lib.flint_mk_create((ctypes.c_longlong * len(ia))(*ia), len(ia), (ctypes.c_double * len(fa))(*fa),
                                     len(fa), ctypes.byref(h))
        finally:
            for k, old in saved.items():
                if old is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = old
        if rc != 0:
            raise SystemExit(f"mk_ab1: variant {v}: flint_mk_create failed: {lib.flint_mk_last_error().decode()}")
        handles[v] = (lib, h)
        print(f"{v:12s} {path.parent.name}")
    own = (mk._lib, mk._h)

    def step(v: str, tok, pos: int) -> None:
        mk._lib, mk._h = handles[v]
        try:
            mk.forward(tok, pos)
        finally:
            mk._lib, mk._h = own

    record = {}
    for m in ms:
        tok = torch.full((m,), 123, device="cuda")
        pos = args.ctx - 1
        for v in args.variants:  # warm every variant (and check it runs) before timing
            for _ in range(5):
                step(v, tok, pos)
        torch.cuda.synchronize()
        if args.check:  # the same token at the same position from the same caches: identical arithmetic, identical bits
            ref = None
            for v in args.variants:
                mk._lib, mk._h = handles[v]
                try:
                    out = mk.forward(tok, pos).float().clone()
                finally:
                    mk._lib, mk._h = own
                if ref is None:
                    ref = out
                    continue
                rd = float((out - ref).norm() / ref.norm())
                print(f"check M={m} {v:12s} vs {args.variants[0]}: rel {rd:.3e}  max|d| {float((out - ref).abs().max()):.3e}"
                      f"  {'bitwise equal' if torch.equal(out, ref) else 'differs'}"
                      f"  argmax {int(out[-1].argmax())} vs {int(ref[-1].argmax())}")
        per: dict[str, list[float]] = {v: [] for v in args.variants}
        for r in range(args.rounds):
            order = args.variants[r % len(args.variants):] + args.variants[:r % len(args.variants)]
            for v in order:
                step(v, tok, pos)
                ts = []
                for _ in range(args.iters):
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    step(v, tok, pos)
                    e.record()
                    e.synchronize()
                    ts.append(s.elapsed_time(e) * 1e3)
                per[v].append(statistics.median(ts))
        a = args.variants[0]
        print(f"{args.model} ctx {args.ctx} M={m}: {args.rounds} rounds x {args.iters} steps, one process "
              f"(median step per round, us; ratio = per-round paired ratio to {a})")
        for v in args.variants:
            med = statistics.median(per[v])
            line = f"{v:12s} {med:8.1f} us {1e6 / med:7.1f} tok/s  rounds {min(per[v]):.1f}..{max(per[v]):.1f}"
            if v != a:
                rat = [x / y for x, y in zip(per[v], per[a])]
                line += (f"  ratio {statistics.median(rat):.4f} [{min(rat):.4f}, {max(rat):.4f}]"
                         f" {sum(x < 1 for x in rat)}/{len(rat)} rounds faster")
                if abs(statistics.median(rat) - 1) < 0.01 and libs[v] != libs[a]:
                    # code that never runs moved the step by up to 0.9% (docs/megakernel-log.md, null compiles)
                    line += "  (within the compile's own spread: replicate against a null variant)"
            print(line)
        record[f"m{m}"] = per
    if args.json:
        Path(args.json).write_text(json.dumps(dict(args=vars(args), libs={v: str(p) for v, p in libs.items()},
                                                   rounds=record), indent=1))
    for v, (lib, h) in handles.items():
        lib.flint_mk_destroy(h)


if __name__ == "__main__":
    sys.exit(main())
