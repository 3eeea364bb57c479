"""Would a stop on the draft's confidence pay? The shipped draft's greedy rollout from every position of the target's
own greedy text (teacher forced: the target's hidden state there, as a verify would hand it over), with the draft's
probability of each proposal, then the greedy walk of speculative decoding replayed under several policies: a fixed
k, and "propose while the draft is confident" (each proposal's own probability >= tau, or the product along the
rollout >= tau), k at most --k-max. Reports tokens per verify step, the verify widths used, and a PROJECTED tok/s per
policy from a cost model: the verify step's cost by width (a measured curve, --verify-curve, × the M = 1 step), a
rollout cost per draft token, and a host penalty per step for the policies that decide the width from the rollout's
output (the host must read it before it launches the verify).

    python3 lab/spec_confidence_study.py --model <SmolLM2 GGUF> [--per-kind 2] [--tokens 128] [--k-max 5]
        [--device cpu] [--json PATH]

The prompts are `flint bench --draft`'s held-out set (eval_prompts); on the CPU the reference decoder takes about a
minute for the default 8 prompts of 128 tokens. The fixed-k rows are a check: their tokens per step should match
the engine's on the same prompts (bench/results: 1.738 / 1.813 at k = 2 / 3 on the megakernel).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flint.backend import make_backend  # noqa: E402
from flint.speculative.draft_head import load_draft  # noqa: E402
from flint.speculative.draft_data import eval_prompts  # noqa: E402
from flint.engine import Engine, SamplingParams  # noqa: E402
from flint.loading import load_model  # noqa: E402

# measured verify curves, × the M = 1 step, M = 1..5 (verify_curve_v31_2026-12-03.json), and the M = 1 step in µs
CURVES = {"smollm2": ([1.0, 1.23, 1.38, 1.42, 1.59], 645.0), "granite": ([1.0, 1.46, 1.60, 1.82, 2.37], 1187.8)}
# the kernel rollout per draft token, µs (SmolLM2 22.5, Granite 57.4: draft_trace_greedy_2026-12-03.json)
ROLLOUT_US = {"smollm2": 22.5, "granite": 57.4}


@torch.inference_mode()
def rollouts(draft, hid: torch.Tensor, seq: torch.Tensor, first: int, k: int):
    """The draft's greedy k-step rollout from every position p >= first of seq (its input: the target's hidden state
    at p - 1 and token seq[p]), batched over positions. Returns (proposals [P, k] token ids, their draft
    probabilities [P, k])."""
    pos = torch.arange(first, seq.shape[0])
    h = hid[pos - 1].to(draft.dtype)
    e = draft.embed_tokens(seq[pos])
    ids, probs = [], []
    for _ in range(k):
        h = draft.forward(h, e)
        pr = torch.softmax(draft.logits(h), -1)
        conf, i = pr.max(-1)
        ids.append(draft.ids(i))
        probs.append(conf)
        e = F.embedding(i, draft.embed)
    return torch.stack(ids, 1), torch.stack(probs, 1).float()


def walk(seq: list[int], first: int, props: list[list[int]], conf: list[list[float]], width) -> tuple[int, int, list]:
    """Speculative greedy decoding of seq[first + 1:] given the rollout at each position: width(conf row) drafts are
    proposed, the leading matches accepted, one token more emitted. Returns (tokens emitted, steps, widths used)."""
    p, emitted, steps, widths = first, 0, 0, []
    end = len(seq) - 1
    while p < end:
        row = p - first
        c = min(width(conf[row]), end - p - 1) if end - p - 1 > 0 else 0
        n = 0
        while n < c and props[row][n] == seq[p + 1 + n]:
            n += 1
        emitted += n + 1
        steps += 1
        widths.append(c)
        p += n + 1
    return emitted, steps, widths


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="the SmolLM2 GGUF")
    ap.add_argument("--draft", default="smollm2-135m")
    ap.add_argument("--per-kind", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--k-max", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="reference")
    ap.add_argument("--host-penalty-us", type=float, default=50.0,
                    help="per step, for the policies that read the rollout before launching the verify")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not 1 <= a.k_max <= 4:
        raise SystemExit(f"--k-max {a.k_max}: 1..4 (the verify curves are measured up to M = 5)")
    lm = load_model(a.model)
    tok = lm.tokenizer
    backend = make_backend(a.backend, lm, max_seq_len=2048, device=a.device)
    draft = load_draft(a.draft, lm.cfg, lm.params, device=backend.device)
    eng = Engine(backend, tok)
    sp = SamplingParams(max_new_tokens=a.tokens, ignore_eos=False)
    data = []  # (kind, seq, first, proposals, conf)
    mismatched = 0
    for r in eval_prompts(a.per_kind):
        ids = tok.encode_chat([{"role": "user", "content": r["text"]}])
        eng.cached = []
        out = eng.generate(ids, sp).token_ids
        seq = ids + out
        logits, hid = backend.forward(torch.tensor(seq, device=backend.device), 0, return_hidden=True)
        tf = logits.argmax(-1).tolist()
        first = len(ids)  # seq[first] came from the prefill; positions first .. len - 2 predict what follows
        mismatched += sum(tf[p] != seq[p + 1] for p in range(first, len(seq) - 1))
        props, conf = rollouts(draft, hid.float(), torch.tensor(seq, device=backend.device), first, a.k_max)
        data.append((r["kind"], seq, first, props.tolist(), conf.tolist()))
        print(f"{r['kind']}: {len(out)} tokens", file=sys.stderr)

    # calibration: how often a proposal matches the target, by the draft's probability of it (every position's
    # rollout, proposal j given that proposals before it matched)
    bins = [[0, 0] for _ in range(10)]
    for _, seq, first, props, conf in data:
        for row, (pr, cf) in enumerate(zip(props, conf)):
            p0 = first + row
            for j in range(len(pr)):
                if p0 + 1 + j >= len(seq):
                    break
                b = bins[min(9, int(cf[j] * 10))]
                b[1] += 1
                hit = pr[j] == seq[p0 + 1 + j]
                b[0] += int(hit)
                if not hit:
                    break
    calibration = [{"p": f"{i / 10:.1f}-{(i + 1) / 10:.1f}", "proposals": n, "matched": round(m / n, 3) if n else None}
                   for i, (m, n) in enumerate(bins)]
    policies = {f"fixed k={k}": (lambda c, k=k: k) for k in range(1, a.k_max + 1)}
    for tau in (0.1, 0.2, 0.3, 0.5):
        policies[f"each p >= {tau}, at least 1"] = lambda c, t=tau: max(1, next((j for j, x in enumerate(c) if x < t),
                                                                           len(c)))
    for tau in (0.3, 0.5, 0.7, 0.8, 0.9):
        policies[f"each p >= {tau}"] = lambda c, t=tau: next((j for j, x in enumerate(c) if x < t), len(c))

        def cum(c, t=tau):
            prod, j = 1.0, 0
            for x in c:
                prod *= x
                if prod < t:
                    break
                j += 1
            return j
        policies[f"product >= {tau}"] = cum
    rows = []
    for name, width in policies.items():
        emitted = steps = 0
        widths: list[int] = []
        by_kind: dict[str, list[int]] = {}
        for kind, seq, first, props, conf in data:
            e, s, w = walk(seq, first, props, conf, width)
            emitted, steps = emitted + e, steps + s
            widths += w
            bk = by_kind.setdefault(kind, [0, 0])
            bk[0] += e
            bk[1] += s
        row = {"policy": name, "tokens_per_step": round(emitted / steps, 3),
               "by_kind": {k: round(v[0] / v[1], 3) for k, v in by_kind.items()},
               "width_histogram": [widths.count(c) for c in range(a.k_max + 1)]}
        dynamic = not name.startswith("fixed")
        k_roll = a.k_max if dynamic else int(name.split("=")[1])
        for shape, (curve, t1) in CURVES.items():
            us = sum(curve[c] * t1 for c in widths) / len(widths) + ROLLOUT_US[shape] * k_roll
            row[f"projected_{shape}_x_plain"] = round(row["tokens_per_step"] * t1 / (us + (a.host_penalty_us if dynamic
                                                                                            else 0.0)), 3)
            row[f"projected_{shape}_x_plain_no_penalty"] = round(row["tokens_per_step"] * t1 / us, 3)
        rows.append(row)
    doc = {"model": a.model, "draft": a.draft, "prompts": len(data), "tokens": a.tokens, "k_max": a.k_max,
           "teacher_forced_argmax_mismatches": mismatched, "curves": CURVES, "rollout_us": ROLLOUT_US,
           "host_penalty_us": a.host_penalty_us, "calibration": calibration, "rows": rows,
           "note": "projected_*_x_plain: a PROJECTION from the measured verify curve, rollout cost and host penalty, "
                   "against a plain step of the M = 1 cost; the SmolLM2 draft's acceptance applied to Granite's curve "
                   "is hypothetical (random Granite weights accept nothing)"}
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1))
    print(f"teacher-forced argmax against the generated text: {mismatched} mismatches")
    print("calibration (draft probability: proposals, fraction matched):",
          ", ".join(f"{c['p']}: {c['proposals']} {c['matched']}" for c in calibration))
    print("| policy | tokens/step | widths 0..k | SmolLM2 × plain (projected; no host penalty) | Granite curve × plain "
          "(projected; no host penalty) |")
    print("|---|---:|---|---:|---:|")
    for r in rows:
        print(f"| {r['policy']} | {r['tokens_per_step']} | {r['width_histogram']} | {r['projected_smollm2_x_plain']} "
              f"({r['projected_smollm2_x_plain_no_penalty']}) | {r['projected_granite_x_plain']} "
              f"({r['projected_granite_x_plain_no_penalty']}) |")


if __name__ == "__main__":
    main()
