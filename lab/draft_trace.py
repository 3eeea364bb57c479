"""Where the draft's one-launch rollout (flint/kernels/draft_kernel.cu) spends a draft token, by phase. GPU.

    FLINT_KERNEL_DIR=build/kernels python3 lab/draft_trace.py [--models smollm2-135m,granite-4.1-3b] [--k 3]
        [--draft-vocab 8192] [--temperature 0] [--json OUT.json]

A random draft shaped like the shipped one (1 MLP block, the target's intermediate size) on synthetic target weights
(int4 groups of 128 on Granite, 64 otherwise), the default int4 matrices. Two measurements per model:
- the untraced kernel's GPU time per launch by CUDA events (25 launches back to back, median of 9 such runs; the host
  enqueues faster than the GPU runs them, so no host time is counted), and the
  wall time of one synchronized `propose` call (what lab/studies/spec_cost.py reports), per draft token;
- the traced library (built with `python3 -m flint.kernels.build --traced`): block 0's %globaltimer stamps before and
  after every grid barrier, medians over 100 launches, per step: each phase's own work on block 0 (its staging, dots
  and stores) and its barrier (the wait for the slowest block plus the barrier itself); `tail` is the keys' reduction
  after the head's barrier. The stamps' own cost is a few ns each.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import flint.megakernel as mkmod  # noqa: E402
from flint.config import SYNTHETIC, from_hf_dict  # noqa: E402
from flint.speculative.draft_head import DraftHead, draft_config_for  # noqa: E402
from flint.engine import SamplingParams  # noqa: E402
from flint.synthetic import synthetic_params  # noqa: E402
from spec_cost import timed  # noqa: E402  (median wall time of synchronized calls, µs)


def phases(nblocks: int) -> list[str]:
    names = ["fc"]
    for b in range(nblocks):
        names += [f"gate_up{b}", f"down{b}"]
    return names + ["head"]


def run(model: str, k: int, nv: int, temperature: float) -> dict:
    cfg = from_hf_dict(dict(SYNTHETIC[model]), model)
    params = synthetic_params(cfg, seed=0, int4_group_size=128 if "granite" in model else 64,
                              dtype=torch.float32, device="cuda")
    torch.manual_seed(0)
    draft = DraftHead(draft_config_for(cfg, k_default=k)).to("cuda", torch.bfloat16)
    vocab = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(0))[:nv] if nv else None
    draft.attach_target(cfg, params, device="cuda", dtype=torch.bfloat16, vocab=vocab)
    del params
    hidden = torch.randn(cfg.hidden_size, device="cuda")
    tok = torch.full((1,), 7, dtype=torch.long, device="cuda")
    seed = torch.zeros(1, dtype=torch.long, device="cuda")
    out = {"model": model, "k": k, "draft_vocab": nv, "temperature": temperature}

    def launch(kr):
        return kr(hidden, tok, k, temperature, seed) if temperature else kr(hidden, tok, k)

    kr = draft._kernel_rollout()
    assert kr is not None and kr.weights == "int4", "the int4 kernel rollout does not apply"
    for _ in range(20):
        launch(kr)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gpu = []
    for _ in range(9):  # 25 launches back to back: the queue stays ahead of the GPU, so no host time is counted
        start.record()
        for _ in range(25):
            launch(kr)
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end) * 1e3 / 25)
    out["kernel_gpu_us"] = statistics.median(gpu)
    sp = SamplingParams(temperature=temperature) if temperature else None
    gen = torch.Generator(device="cuda").manual_seed(0)
    out["propose_wall_us"] = timed(lambda: draft.propose([7], hidden, k, sp, gen), 200)
    out["per_token_gpu_us"] = out["kernel_gpu_us"] / k
    out["per_token_wall_us"] = out["propose_wall_us"] / k

    # the traced library: the same kernel with block 0's stamps
    plain_load = mkmod.load_library
    mkmod.load_library = lambda traced=False: plain_load(True)
    try:
        draft.__dict__.pop("_kernels", None)
        kt = draft._kernel_rollout()
    finally:
        mkmod.load_library = plain_load
    names = phases(len(draft.blocks))
    per_step = 1 + 2 * len(names)
    buf = torch.zeros(1 + k * per_step, dtype=torch.long, device="cuda")
    kt.ptrs[kt.i_trace] = buf.data_ptr()
    rows = []
    for it in range(120):
        buf.zero_()
        launch(kt)
        torch.cuda.synchronize()
        if it >= 20:
            rows.append(buf.tolist())
    kt.ptrs[kt.i_trace] = None
    draft.__dict__.pop("_kernels", None)
    assert all(r[-1] > 0 for r in rows), "no stamps: is the traced library built with MK_TRACE?"
    table = {}
    for j in range(k):
        base = 1 + j * per_step
        for i, n in enumerate(names):
            pre, post = base + 2 * i, base + 2 * i + 1
            prev = pre - 1  # the stamp before this phase's work: the step's start or the last barrier's exit
            table[f"step{j}.{n}.work"] = statistics.median(r[pre] - r[prev] for r in rows) / 1e3
            table[f"step{j}.{n}.barrier"] = statistics.median(r[post] - r[pre] for r in rows) / 1e3
        table[f"step{j}.tail"] = statistics.median(r[base + per_step - 1] - r[base + per_step - 2] for r in rows) / 1e3
    table["traced_total_us"] = statistics.median(r[-1] - r[0] for r in rows) / 1e3
    out["trace_us"] = table
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2-135m,granite-4.1-3b")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    res = [run(m, a.k, a.draft_vocab, a.temperature) for m in a.models.split(",")]
    names = phases(1)
    print("\n| model | per token: GPU (events) / wall us | traced step (block 0): "
          + " | ".join(f"{n} work / barrier" for n in names) + " | tail |")
    print("|---|---|" + "---|" * (len(names) + 1))
    for r in res:
        t = r["trace_us"]
        cells = []
        for n in names:
            w = statistics.mean(t[f"step{j}.{n}.work"] for j in range(r["k"]))
            b = statistics.mean(t[f"step{j}.{n}.barrier"] for j in range(r["k"]))
            cells.append(f"{w:.2f} / {b:.2f}")
        tail = statistics.mean(t[f"step{j}.tail"] for j in range(r["k"]))
        print(f"| {r['model']} | {r['per_token_gpu_us']:.1f} / {r['per_token_wall_us']:.1f} | "
              + " | ".join(cells) + f" | {tail:.2f} |")
    if a.json:
        tmp = Path(a.json + ".tmp")
        tmp.write_text(json.dumps(res, indent=1) + "\n")
        tmp.replace(a.json)


if __name__ == "__main__":
    main()
