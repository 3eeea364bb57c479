"""Build and measure a SmolLM2-135M-Instruct draft head in one GPU call.

harvest (continuations of a draft prompt set, batched: pass 0 greedy, then --sampled-passes passes
sampled from the target) -> train (teacher forcing + rollout depth 3, from a random init or --init
DRAFT) -> the drafting vocabulary (vocab.safetensors ranking, --draft-vocab rows, as `flint draft
vocab` builds it) -> K sweep (real speculative decoding, tok/s) -> acceptance by prompt kind with
plain decoding beside it. Each phase has a time budget, and --total-budget caps the whole run (the
training budget shrinks to leave the evals their time; the sweep is skipped when the time left
cannot hold it), so the run fits one device call; the eager reference backend costs ~35 ms a
forward on the H200 whatever the batch (measured 2026-11-29), so harvest batches are wide and the
B=1 evals are short. Results are written as each phase ends: OUT/draft/ (the draft, loadable with
flint.speculative.draft_head.load_draft; draft.json's training record names the prompt set, the passes and the
init), OUT/results.json, OUT/train_log.json. docs/speculative.md has the staging commands and
the figures.

    python bench/draft_smollm2.py --model PATH.gguf --out OUT [--work DIR] [--prompt-set v2]
        [--sampled-passes S] [--temperature 0.7,1.0] [--init smollm2-135m] [--attention-heads 9]
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
from flint.speculative.draft_head import (DraftHead, draft_config_for, load_draft, num_parameters, save_draft,  # noqa: E402
                                          save_vocab_ranking)
from flint.speculative.cli import parse_passes, temperature_list  # noqa: E402
from flint.speculative.draft_data import (draft_prompts, eval_prompts, harvest, load_harvest, rank_vocab,  # noqa: E402
                                          resolve_prompt_set)
from flint.speculative.draft_train import eval_acceptance, init_weights, print_eval_table, train_draft  # noqa: E402
from flint.engine import SamplingParams  # noqa: E402
from flint.loading import load_model  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/flint-draft-work", help="harvest shards and train state")
    ap.add_argument("--prompt-set", default="v1", help="training prompts: v1 or v2 (default v1)")
    ap.add_argument("--sampled-passes", type=int, default=0, help="sampled passes after the greedy one")
    ap.add_argument("--temperature", type=temperature_list, default=None,
                    help="temperature of the sampled passes, or a comma list they take in turn (default 0.7,1.0)")
    ap.add_argument("--top-p", type=float, default=None, help="nucleus of the sampled passes (default 0.95)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the sampled passes")
    ap.add_argument("--init", default=None, help="start from this draft's weights (a directory or a shipped name)")
    ap.add_argument("--attention-heads", type=int, default=0,
                    help="add the attention block over the draft's own features in this many heads (0: none; "
                         "flint/speculative/draft_attention.py; its output projection starts at zero, so --init's draft is step 0)")
    ap.add_argument("--batch-size", type=int, default=1024, help="harvest rows per step (lengths mix)")
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--harvest-budget", type=float, default=75)
    ap.add_argument("--train-budget", type=float, default=85)
    ap.add_argument("--train-batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--draft-vocab", type=int, default=8192, help="drafting vocabulary rows (0: all)")
    ap.add_argument("--sweep", default="3,4,6", help="K values timed on one prompt per kind")
    ap.add_argument("--eval-set", default="v1", help="held-out prompts of this set for the evals (default v1)")
    ap.add_argument("--eval-per-kind", type=int, default=4)
    ap.add_argument("--eval-budget", type=float, default=35)
    ap.add_argument("--eval-new-tokens", type=int, default=96)
    ap.add_argument("--total-budget", type=float, default=510,
                    help="seconds for the whole run: later phases shrink or are skipped to stay inside it")
    args = ap.parse_args(argv)
    args.prompt_set = resolve_prompt_set(args.prompt_set)
    args.eval_set = resolve_prompt_set(args.eval_set)
    args.passes = parse_passes(args.sampled_passes, args.temperature, args.top_p)
    if args.draft_vocab < 0:
        ap.error(f"--draft-vocab must be >= 0, got {args.draft_vocab}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t_all = time.perf_counter()

    def left() -> float:
        return args.total_budget - (time.perf_counter() - t_all)

    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    res = {"card": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "args": {k: (v if k != "passes" else [vars(p) for p in v]) for k, v in vars(args).items()}}

    def save():
        res["elapsed_s"] = round(time.perf_counter() - t_all, 1)
        (out / "results.json").write_text(json.dumps(res, indent=2) + "\n")

    lm = load_model(args.model)
    res["load_s"] = round(time.perf_counter() - t_all, 1)
    t = time.perf_counter()
    prompts = draft_prompts("train", args.prompt_set)
    n = harvest(lm, work / "harvest", prompts, args.batch_size, args.max_new_tokens, device=dev,
                time_budget=min(args.harvest_budget, left()), seed=args.seed, passes=args.passes,
                prompt_set=args.prompt_set)
    data = load_harvest(work / "harvest", lm.cfg)
    res["harvest"] = {"prompt_set": args.prompt_set, "prompts": len(prompts), "new_sequences": n,
                      "sequences": int(data.tokens.shape[0]), "tokens": int(data.lengths.sum()),
                      "passes": data.meta["passes"], "s": round(time.perf_counter() - t, 1)}
    print("harvest:", res["harvest"], flush=True)
    save()

    torch.manual_seed(0)
    draft = DraftHead(draft_config_for(lm.cfg, k_default=4, attention_heads=args.attention_heads)).to(dev)
    init = init_weights(draft, args.init, lm.cfg) if args.init else None
    draft.attach_target(lm.cfg, lm.params, dev)
    res["draft_params"] = num_parameters(draft)
    # leave the evals their budget, the sweep (~8 s a k) and ~20 s for loading and saving
    after = args.eval_budget + 8 * len(args.sweep.split(",")) + 20
    budget = max(1.0, min(args.train_budget, left() - after))
    res["train_budget_s"] = round(budget, 1)
    rec = train_draft(draft, data, work / "train", steps=100000, batch_size=args.train_batch, lr=args.lr,
                      depth=args.depth, time_budget=budget, eval_every=200, ckpt_every=10**9, k_eval=4, init=init)
    res["train"] = rec
    # the drafting vocabulary, as `flint draft vocab --data SHARDS --size N` builds it
    order, vmeta = rank_vocab(data, lm.cfg.vocab_size)
    draft.cfg.draft_vocab = args.draft_vocab if args.draft_vocab < lm.cfg.vocab_size else 0
    save_draft(draft, out / "draft", dtype=torch.bfloat16)
    save_vocab_ranking(out / "draft", order, vmeta)
    res["vocab"] = {"draft_vocab": draft.cfg.draft_vocab, **vmeta}
    shutil.copy(work / "train" / "train_log.json", out / "train_log.json")
    save()
    del data

    backend = make_backend("reference", lm, 1024, device=str(dev))
    shipped = load_draft(out / "draft", lm.cfg, lm.params, device=dev)  # bf16 and the drafting vocabulary, as shipped
    ks = [int(x) for x in args.sweep.split(",")]
    sweep = {}
    if left() > args.eval_budget + 8 * len(ks) + 10:
        for k in ks:
            table = eval_acceptance(backend, lm.tokenizer, shipped, eval_prompts(1, prompt_set=args.eval_set), k,
                                    args.eval_new_tokens, compare_plain=False)
            sweep[k] = table["all"]
            print(f"sweep k={k}: {table['all']}", flush=True)
            res["sweep"] = sweep
            save()
    best = max(sweep, key=lambda k: sweep[k]["spec_tok_s"] or 0) if sweep else ks[0]
    shipped.cfg.k_default = draft.cfg.k_default = best
    save_draft(draft, out / "draft", dtype=torch.bfloat16)
    save()

    sp = SamplingParams(max_new_tokens=args.eval_new_tokens, temperature=0.0)
    table = eval_acceptance(backend, lm.tokenizer, shipped, eval_prompts(args.eval_per_kind, prompt_set=args.eval_set),
                            best, args.eval_new_tokens, sp, compare_plain=True,
                            time_budget=max(5.0, min(args.eval_budget, left() - 15)))
    print_eval_table(table, best)
    res["eval"] = {"k": best, "prompt_set": args.eval_set, "greedy": table}
    save()
    if left() > 15:
        spt = SamplingParams(max_new_tokens=args.eval_new_tokens, temperature=0.7, seed=0)
        res["eval"]["t0.7"] = eval_acceptance(backend, lm.tokenizer, shipped, eval_prompts(1, prompt_set=args.eval_set),
                                              best, args.eval_new_tokens, spt, compare_plain=False,
                                              time_budget=max(5.0, left() - 10))
        print("sampling T=0.7:", res["eval"]["t0.7"].get("all"), flush=True)
    res["total_s"] = round(time.perf_counter() - t_all, 1)
    save()
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
