"""Device-side megakernel check + timing, one call: correctness vs flint.model.Transformer, timing with
CUDA events (warm-up, median), HBM read bandwidth in the same run, a short table last, JSON in $OUT.

Builds nothing when the library is carried: run `FLINT_KERNEL_DIR=build/kernels python -m
flint.kernels.build` here first, then on the device (carry: ["build"]):

    FLINT_KERNEL_DIR=build/kernels PYTHONUNBUFFERED=1 python3 lab/mk_dev.py [--quick] [--skip-check]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flint.config import ModelConfig, from_hf_dict, SYNTHETIC  # noqa: E402
from flint.megakernel import MegakernelBackend  # noqa: E402
from flint.model import Transformer  # noqa: E402
from flint.synthetic import synthetic_params  # noqa: E402

OUT = Path(os.environ.get("OUT", "out"))


# the small llama shape of the sanitizer runs (bench/sanitize_run.py owns it)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from sanitize_run import small_cfg  # noqa: E402


def granite_cfg() -> ModelConfig:
    return from_hf_dict(dict(SYNTHETIC["granite-4.1-3b"]), "granite")


def traced_step_stamps(mk, step):
    """Run one more step with the trace cleared; every block's stage-end stamps (MegakernelBackend.block_stamps)."""
    mk.trace.zero_()
    step()
    torch.cuda.synchronize()
    return mk.block_stamps()


def warm_granite(layers: int | None = None, pos: int = 511, warmup: int = 4, m: int = 1, traced: bool = False,
                 max_seq: int = 1024):
    """The synthetic Granite-4.1-3B int4 G128 backend (max_seq_len max_seq), warmed up with `warmup`
    steps of `m` tokens (M = m, a verify step when m > 1) at position `pos`; returns (backend, a
    function running one more such step). The trace tools (mk_prof, mk_blocks, mk_warps) start
    from this; traced=True exits unless FLINT_MK_TRACE=1 (the traced library) is set."""
    if traced and os.environ.get("FLINT_MK_TRACE") != "1":
        sys.exit("set FLINT_MK_TRACE=1 (it loads the traced library: build it with "
                 "`python3 -m flint.kernels.build --traced`, or name TRACE=1 in lab/mk_variants.py)")
    cfg = granite_cfg()
    if layers is not None:
        cfg.num_layers = layers
    params = synthetic_params(cfg, seed=0, int4_group_size=128, dtype=torch.float32, device="cuda")
    mk = MegakernelBackend(cfg, params, max_seq)
    tok = torch.full((m,), 7, device="cuda")

    def step():
        mk.forward(tok, pos)

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    return mk, step


def step_times(mk, tok, pos: int, iters: int) -> list[float]:
    """``iters`` per-launch steps of ``mk`` (CUDA events around each), microseconds."""
    ts = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        mk.forward(tok, pos)
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) * 1e3)
    return ts


def median_step(mk, tok, pos: int, iters: int) -> float:
    return statistics.median(step_times(mk, tok, pos, iters))


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def check(cfg, group, ctxs, seed=0, chunk=8, verify_m=(1, 3, 8)) -> list[dict]:
    """Fill both caches with the same tokens (chunks of `chunk`), compare logits at each ctx."""
    params = synthetic_params(cfg, seed=seed, int4_group_size=group, dtype=torch.float32, device="cuda")
    maxlen = max(ctxs) + 16
    mk = MegakernelBackend(cfg, params, maxlen)
    ref = Transformer(cfg, params, maxlen, device="cuda", dtype=torch.float32)
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    toks = torch.randint(0, cfg.vocab_size, (maxlen,), generator=gen)
    rows = []
    pos = 0
    for ctx in sorted(ctxs):
        # bring both to ctx - 1 cached tokens, then one M=1 step at position ctx - 1
        while pos < ctx - 1:
            m = min(chunk, ctx - 1 - pos)
            a = mk.forward(toks[pos:pos + m], pos)
            b = ref.forward(toks[pos:pos + m], pos)
            pos += m
        a = mk.forward(toks[ctx - 1:ctx], ctx - 1)
        b = ref.forward(toks[ctx - 1:ctx], ctx - 1)
        a2 = mk.forward(toks[ctx - 1:ctx], ctx - 1)
        rows.append(dict(cfg=cfg.name or f"H{cfg.hidden_size}", G=group, ctx=ctx, M=1, rel=rel(a, b),
                         argmax_ok=int(a.argmax()) == int(b.argmax()), bitwise=bool(torch.equal(a, a2))))
        pos = ctx
        for vm in verify_m:  # verify shapes: M tokens at ctx (then roll back by rewriting)
            if vm == 1 or ctx + vm > maxlen:
                continue
            a, ha = mk.forward(toks[ctx:ctx + vm], ctx, return_hidden=True)
            b, hb = ref.forward(toks[ctx:ctx + vm], ctx, return_hidden=True)
            rows.append(dict(cfg=cfg.name or f"H{cfg.hidden_size}", G=group, ctx=ctx, M=vm, rel=rel(a, b),
                             hidden_rel=rel(ha, hb),
                             argmax_ok=bool(torch.equal(a.argmax(-1), b.argmax(-1))), bitwise=None))
        print(rows[-1] if rows else None, flush=True)
    g1 = mk.greedy_next(int(toks[pos]), pos)
    b = ref.forward(toks[pos:pos + 1], pos)
    rows.append(dict(cfg="greedy_next", ctx=pos + 1, M=1, rel=0.0, argmax_ok=g1 == int(b.argmax()), bitwise=None))
    del mk, ref, params
    torch.cuda.empty_cache()
    return rows


def hbm_read_bandwidth() -> float:
    x = torch.empty(int(4e9) // 2, dtype=torch.bfloat16, device="cuda").uniform_()
    for _ in range(3):
        x.sum()
    ts = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); x.sum(); e.record(); e.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    bw = x.numel() * 2 / statistics.median(ts)
    del x
    torch.cuda.empty_cache()
    return bw


def time_model(name, ctxs, group=128, iters=50) -> tuple[list[dict], MegakernelBackend]:
    cfg = from_hf_dict(dict(SYNTHETIC[name]), name)
    params = synthetic_params(cfg, seed=0, int4_group_size=group, dtype=torch.float32, device="cuda")
    maxlen = max(ctxs) + 16
    mk = MegakernelBackend(cfg, params, maxlen)
    del params
    torch.cuda.empty_cache()
    mk.k_cache.normal_(0, 1)
    mk.v_cache.normal_(0, 1)
    wbytes = mk.weight_bytes()
    rows = []
    tok = torch.tensor([123], device="cuda")
    for ctx in ctxs:
        pos = ctx - 1
        for _ in range(5):
            mk.forward(tok, pos)
        torch.cuda.synchronize()
        ts = step_times(mk, tok, pos, iters)
        t = statistics.median(ts) / 1e6
        # greedy path: host-visible tok/s including launch + sync + python
        for _ in range(5):
            mk.greedy_next(123, pos)
        t0 = time.perf_counter()
        for _ in range(iters):
            mk.greedy_next(123, pos)
        tg = (time.perf_counter() - t0) / iters
        kv = mk.kv_bytes_per_token * ctx
        rows.append(dict(model=f"{name} int4 G{group} synthetic", ctx=ctx, step_us=t * 1e6, tok_s=1 / t,
                         greedy_tok_s=1 / tg, weight_bytes=wbytes, kv_bytes=kv, achieved_GBps=(wbytes + kv) / t / 1e9,
                         min_us=min(ts), max_us=max(ts)))
        print(rows[-1], flush=True)
    return rows, mk


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--ctxs", default="512,2048,8192")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    dev = torch.cuda.get_device_name()
    res = dict(device=dev, date=time.strftime("%Y-%m-%d"), checks=[], timing=[])
    if not args.skip_check:
      try:
        res["checks"] += check(small_cfg(), 64, [1, 17, 511] if not args.quick else [1, 17])
        res["checks"] += check(small_cfg(num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=1003,
                                         hidden_size=320, intermediate_size=640), 32, [1, 17, 130])
        (OUT / "mk_dev.json").write_text(json.dumps(res, indent=1))
        if not args.quick:
            g = granite_cfg()
            g.num_layers = 4
            res["checks"] += check(g, 128, [1, 17, 511], chunk=8)
        (OUT / "mk_dev.json").write_text(json.dumps(res, indent=1))
      except Exception as e:  # keep going to the timing; the table shows what failed
        import traceback
        traceback.print_exc()
        res["check_error"] = repr(e)
    bw = hbm_read_bandwidth()
    res["hbm_read_Bps"] = bw
    rows, mk = time_model("granite-4.1-3b", [int(c) for c in args.ctxs.split(",")])
    res["smem"] = mk.smem_info(1)
    del mk
    torch.cuda.empty_cache()
    srows, _ = time_model("smollm2-135m", [512], group=32)  # L2-resident: weights (~90 MB) vs 60 MB L2
    rows += srows
    for r in rows:
        r["MBU"] = (r["weight_bytes"] + r["kv_bytes"]) * r["tok_s"] / bw
    res["timing"] = rows
    (OUT / "mk_dev.json").write_text(json.dumps(res, indent=1))
    print("\n== correctness (logits rel err vs flint.model.Transformer fp32)")
    for c in res["checks"]:
        print(f"{str(c.get('cfg')):14s} G{c.get('G', '-')!s:4s} ctx {c['ctx']:5d} M {c['M']}  rel {c['rel']:.2e}  "
              f"argmax {'ok' if c['argmax_ok'] else 'DIFF'}  bitwise {c['bitwise']}")
    print(f"\n== timing on {dev}; HBM read (torch bf16 sum, 4 GB) {bw / 1e12:.2f} TB/s; smem {res['smem']}")
    print(f"{'model':34s} {'ctx':>6s} {'step us':>9s} {'tok/s':>8s} {'greedy tok/s':>13s} {'GB/step':>8s} {'MBU':>6s}")
    for r in rows:
        print(f"{r['model']:34s} {r['ctx']:6d} {r['step_us']:9.1f} {r['tok_s']:8.1f} {r['greedy_tok_s']:13.1f} "
              f"{(r['weight_bytes'] + r['kv_bytes']) / 1e9:8.3f} {r['MBU']:6.1%}")


if __name__ == "__main__":
    main()
