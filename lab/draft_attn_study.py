"""Does attention over the draft's own features raise acceptance? The shipped draft's shape (fc, one SwiGLU block) plus
one causal self-attention block after fc (EAGLE-1's decoder layer: ``DraftConfig.attention_heads``,
flint/speculative/draft_attention.py),
against the same shape without it, both warm started from the shipped draft and trained the same steps on the same
harvest; the validation is train_draft's (the greedy walk on greedy sequences of held-out subjects, tokens per
verify step by k).

    python3 lab/draft_attn_study.py --model <SmolLM2 GGUF> --data SHARDS --out DIR [--init smollm2-135m]
                                    [--budget 120] [--steps 4000] [--heads 9]

SHARDS: a harvest (`flint draft harvest --model <gguf> --out SHARDS --prompt-set v2 --sampled-passes 1
--batch-size 1024 --time-budget 150` on the GPU, or bench/draft_smollm2.py's). The attention block starts with its
output projection at zero, so step 0 is the shipped draft exactly. `flint draft train --attention-heads N` trains the
same draft as a product (the engine decodes with it on the torch path). GPU (CPU works on a tiny harvest).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flint.speculative.draft_head import DraftHead, draft_config_for  # noqa: E402


def train_warm(draft, lm, data, out_dir: Path, init: str, dev, steps: int, batch_size: int, lr: float, budget: float,
               k: int) -> dict:
    """Train ``draft`` from ``init``'s weights (the keys they share) for ``budget`` seconds on ``data``; the record's
    steps, kept step, validated tokens per step (by k and by kind) and first / last loss. (The studies' common run.)"""
    from flint.speculative.draft_train import init_weights, train_draft

    draft = draft.to(dev)
    rec_init = init_weights(draft, init, lm.cfg)
    draft.attach_target(lm.cfg, lm.params, dev, torch.float32 if dev.type == "cpu" else torch.bfloat16)
    rec = train_draft(draft, data, out_dir, steps=steps, batch_size=batch_size, lr=lr, time_budget=budget, k_eval=k,
                      init=rec_init)
    return {key: rec.get(key) for key in ("steps", "kept_step", "val_tokens_per_step", "val_tokens_per_step_by_kind",
                                          "loss_first", "loss_last")}


def main() -> None:
    from flint.speculative.draft_head import load_draft
    from flint.speculative.draft_data import load_harvest
    from flint.loading import load_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--init", default="smollm2-135m")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--budget", type=float, default=120.0, help="training seconds per variant")
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--k", type=int, default=4)
    a = ap.parse_args()
    lm = load_model(a.model)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = load_harvest(a.data, lm.cfg)
    src = load_draft(a.init, lm.cfg, dtype=torch.float32)
    dcfg = draft_config_for(lm.cfg, src.cfg.num_layers, src.cfg.intermediate_size, a.k)
    doc = {"model": a.model, "data": a.data, "init": a.init, "budget_s": a.budget, "heads": a.heads, "variants": {}}
    for name, make in (("plain", lambda: DraftHead(dcfg)),
                       ("attention", lambda: DraftHead(dataclasses.replace(dcfg, attention_heads=a.heads)))):
        rec = doc["variants"][name] = train_warm(make(), lm, data, Path(a.out) / name, a.init, dev, a.steps,
                                                 a.batch_size, a.lr, a.budget, a.k)
        print(f"{name}: val tokens/step {rec['val_tokens_per_step']}", flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "draft_attn_study.json").write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
