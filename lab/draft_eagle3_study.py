"""Do EAGLE-3-style features raise acceptance? The draft's first step reads the target's residual after a low and a
middle layer as well as the last layer's (each RMS-normalised, then one linear map 3H -> H), against the shipped
design that reads the last layer's alone; later steps feed the draft's own prediction as both do. Both start from
the shipped draft (the map starts as "take the last layer's": step 0 is the shipped draft exactly) and train the
same seconds on one harvest that stores all three layers; the validation is train_draft's (the greedy walk on greedy
sequences of held-out subjects, tokens per verify step by k).

    python3 lab/draft_eagle3_study.py --model <SmolLM2 GGUF> --out DIR [--layers 3,15] [--harvest-budget 130]
        [--budget 100] [--batch-size 1024]

The harvest is `flint draft harvest`'s (prompt set v2, one greedy and one sampled pass) with the reference decoder
returning the chosen layers' residuals too (flint.model.Transformer.hidden_layers); --data DIR reuses one. Not
runnable by the engine: a study. GPU (CPU works with small budgets and --num-prompts).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flint.speculative.draft_head import DraftHead, RMSNorm, draft_config_for  # noqa: E402


class TopView(DraftHead):
    """The shipped design on a harvest of several layers' states: reads the last layer's part only."""

    def __init__(self, cfg, n_layers: int):
        super().__init__(cfg)
        self.n_in = n_layers

    def top_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        h = self.cfg.hidden_size
        return hidden[..., -h:] if hidden.shape[-1] == self.n_in * h else hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().logits(self.top_hidden(hidden))

    def forward(self, hidden: torch.Tensor, token_embed: torch.Tensor) -> torch.Tensor:
        return super().forward(self.top_hidden(hidden), token_embed)


class FusedDraft(TopView):
    """The first step's input is fuse([norm(low), norm(mid), last]) (the last layer's raw: the shipped draft's own
    input norm follows); a step on the draft's own prediction (width H) passes it through unchanged."""

    def __init__(self, cfg, n_layers: int):
        super().__init__(cfg, n_layers)
        h = cfg.hidden_size
        self.in_norms = nn.ModuleList(RMSNorm(h, cfg.rms_norm_eps) for _ in range(n_layers - 1))
        self.fuse = nn.Linear(n_layers * h, h, bias=False)
        with torch.no_grad():  # step 0: the last layer's state alone
            self.fuse.weight.zero_()
            self.fuse.weight[:, -h:] = torch.eye(h)

    def fused(self, hidden: torch.Tensor) -> torch.Tensor:
        h = self.cfg.hidden_size
        if hidden.shape[-1] != self.n_in * h:
            return hidden
        dt = self.fuse.weight.dtype
        parts = [n(hidden[..., i * h:(i + 1) * h].to(dt)) for i, n in enumerate(self.in_norms)]
        return self.fuse(torch.cat((*parts, hidden[..., -h:].to(dt)), -1))

    def forward(self, hidden: torch.Tensor, token_embed: torch.Tensor) -> torch.Tensor:
        return DraftHead.forward(self, self.fused(hidden), token_embed)


def main() -> None:
    from flint.speculative.cli import parse_passes
    from flint.speculative.draft_data import draft_prompts, harvest, load_harvest
    from draft_attn_study import train_warm
    from flint.loading import load_model
    from flint.model import Transformer

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--data", default=None, help="a harvest of these layers to reuse (default: harvest into OUT/shards)")
    ap.add_argument("--layers", default="3,15", help="the low and middle layers (0-based), besides the last")
    ap.add_argument("--init", default="smollm2-135m")
    ap.add_argument("--harvest-budget", type=float, default=130.0)
    ap.add_argument("--batch-size", type=int, default=1024, help="harvest rows per decode step")
    ap.add_argument("--num-prompts", type=int, default=0, help="harvest only the first N prompts (0: all)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--budget", type=float, default=100.0, help="training seconds per variant")
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--train-batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--k", type=int, default=4)
    a = ap.parse_args()
    layers = tuple(int(x) for x in a.layers.split(","))
    lm = load_model(a.model)
    if not all(0 <= i < lm.cfg.num_layers - 1 for i in layers) or list(layers) != sorted(set(layers)):
        raise SystemExit(f"--layers {a.layers}: increasing layer indices below the last ({lm.cfg.num_layers - 1})")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data_dir = Path(a.data) if a.data else Path(a.out) / "shards"
    if not a.data:
        Transformer.hidden_layers = layers
        try:
            prompts = draft_prompts("train", "v2")
            if a.num_prompts:
                prompts = prompts[: a.num_prompts]
            harvest(lm, data_dir, prompts, a.batch_size, a.max_new_tokens, device=dev,
                    time_budget=a.harvest_budget, passes=parse_passes(1, None, None), prompt_set="v2")
        finally:
            Transformer.hidden_layers = ()
    data = load_harvest(data_dir, lm.cfg)
    n_in = len(layers) + 1
    if data.hidden.shape[-1] != n_in * lm.cfg.hidden_size:
        raise SystemExit(f"{data_dir}: hidden rows of width {data.hidden.shape[-1]}, not {n_in} x "
                         f"{lm.cfg.hidden_size} (--layers {a.layers})")
    from flint.speculative.draft_head import load_draft

    src = load_draft(a.init, lm.cfg, dtype=torch.float32)
    dcfg = draft_config_for(lm.cfg, src.cfg.num_layers, src.cfg.intermediate_size, a.k)
    doc = {"model": "<SmolLM2 GGUF>" if a.model.endswith(".gguf") else a.model, "layers": list(layers),
           "sequences": int(data.tokens.shape[0]), "init": a.init, "budget_s": a.budget, "variants": {}}
    for name, make in (("last layer", lambda: TopView(dcfg, n_in)), ("fused", lambda: FusedDraft(dcfg, n_in))):
        rec = doc["variants"][name] = train_warm(make(), lm, data, Path(a.out) / name.replace(" ", "_"), a.init, dev,
                                                 a.steps, a.train_batch, a.lr, a.budget, a.k)
        print(f"{name}: val tokens/step {rec['val_tokens_per_step']}", flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "draft_eagle3_study.json").write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
