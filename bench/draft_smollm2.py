"""Build and measure the shipped SmolLM2-135M-Instruct draft head in one GPU call.

harvest (greedy continuations of flint-draft-prompts-v1, batched) -> train (teacher forcing +
rollout depth 3) -> K sweep (real speculative decoding, tok/s) -> acceptance by prompt kind with
plain decoding beside it. Each phase has a time budget so the whole run fits one device call; the
eager reference backend costs ~35 ms a forward on the H200 whatever the batch (measured
2026-11-29), so harvest batches are wide and the B=1 evals are short.
Results: OUT/draft/ (the draft), OUT/results.json, OUT/train_log.json. docs/speculative.md has
the staging commands and the figures.

    python bench/draft_smollm2.py --model PATH.gguf --out OUT [--work DIR]
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flint.backend import make_backend  # noqa: E402
from flint.draft import DraftHead, draft_config_for, load_draft, num_parameters, save_draft  # noqa: E402
from flint.draft_data import draft_prompts, eval_prompts, harvest, load_harvest  # noqa: E402
from flint.draft_train import eval_acceptance, print_eval_table, train_draft  # noqa: E402
from flint.engine import SamplingParams  # noqa: E402
from flint.loading import load_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/flint-draft-work", help="harvest shards and train state")
    ap.add_argument("--batch-size", type=int, default=1024, help="harvest rows per step (lengths mix)")
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--harvest-budget", type=float, default=75)
    ap.add_argument("--train-budget", type=float, default=85)
    ap.add_argument("--train-batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--sweep", default="3,4,6", help="K values timed on one prompt per kind")
    ap.add_argument("--eval-per-kind", type=int, default=4)
    ap.add_argument("--eval-budget", type=float, default=35)
    ap.add_argument("--eval-new-tokens", type=int, default=96)
    args = ap.parse_args()
    t_all = time.perf_counter()
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    res = {"card": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
           "torch": torch.__version__, "args": vars(args)}

    def save():
        (out / "results.json").write_text(json.dumps(res, indent=2) + "\n")

    lm = load_model(args.model)
    res["load_s"] = round(time.perf_counter() - t_all, 1)
    t = time.perf_counter()
    prompts = draft_prompts("train")
    n = harvest(lm, work / "harvest", prompts, args.batch_size, args.max_new_tokens, 0.0, dev,
                time_budget=args.harvest_budget)
    data = load_harvest(work / "harvest", lm.cfg)
    res["harvest"] = {"new_sequences": n, "sequences": int(data.tokens.shape[0]),
                      "tokens": int(data.lengths.sum()), "s": round(time.perf_counter() - t, 1)}
    print("harvest:", res["harvest"], flush=True)
    save()

    torch.manual_seed(0)
    draft = DraftHead(draft_config_for(lm.cfg, k_default=4)).to(dev)
    draft.attach_target(lm.cfg, lm.params, dev)
    res["draft_params"] = num_parameters(draft)
    rec = train_draft(draft, data, work / "train", steps=100000, batch_size=args.train_batch, lr=args.lr,
                      depth=args.depth, time_budget=args.train_budget, eval_every=200,
                      ckpt_every=10**9, k_eval=4)
    res["train"] = rec
    save_draft(draft, out / "draft", dtype=torch.bfloat16)
    shutil.copy(work / "train" / "train_log.json", out / "train_log.json")
    save()
    del data

    backend = make_backend("reference", lm, 1024, device=str(dev))
    shipped = load_draft(out / "draft", lm.cfg, lm.params, device=dev)  # bf16, as shipped
    sweep = {}
    for k in [int(x) for x in args.sweep.split(",")]:
        table = eval_acceptance(backend, lm.tokenizer, shipped, eval_prompts(1), k, args.eval_new_tokens,
                                compare_plain=False)
        sweep[k] = table["all"]
        print(f"sweep k={k}: {table['all']}", flush=True)
    res["sweep"] = sweep
    best = max(sweep, key=lambda k: sweep[k]["spec_tok_s"] or 0)
    shipped.cfg.k_default = draft.cfg.k_default = best
    save_draft(draft, out / "draft", dtype=torch.bfloat16)
    save()

    sp = SamplingParams(max_new_tokens=args.eval_new_tokens, temperature=0.0)
    table = eval_acceptance(backend, lm.tokenizer, shipped, eval_prompts(args.eval_per_kind), best,
                            args.eval_new_tokens, sp, compare_plain=True, time_budget=args.eval_budget)
    print_eval_table(table, best)
    res["eval"] = {"k": best, "greedy": table}
    spt = SamplingParams(max_new_tokens=args.eval_new_tokens, temperature=0.7, seed=0)
    res["eval"]["t0.7"] = eval_acceptance(backend, lm.tokenizer, shipped, eval_prompts(1), best,
                                          args.eval_new_tokens, spt, compare_plain=False)
    print("sampling T=0.7:", res["eval"]["t0.7"].get("all"), flush=True)
    res["total_s"] = round(time.perf_counter() - t_all, 1)
    save()
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
