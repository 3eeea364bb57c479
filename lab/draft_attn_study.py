"""Does attention over the draft's own features raise acceptance? The shipped draft's shape (fc, one SwiGLU block) plus
one causal self-attention block after fc (EAGLE-1's decoder layer), against the same shape without it, both warm
started from the shipped draft and trained the same steps on the same harvest; the validation is train_draft's
(the greedy walk on greedy sequences of held-out subjects, tokens per verify step by k).

    python3 lab/draft_attn_study.py --model <SmolLM2 GGUF> --data SHARDS --out DIR [--init smollm2-135m]
                                    [--budget 120] [--steps 4000] [--heads 9]

SHARDS: a harvest (`flint draft harvest --model <gguf> --out SHARDS --prompt-set v2 --sampled-passes 1
--batch-size 1024 --time-budget 150` on the GPU, or bench/draft_smollm2.py's). The attention draft starts with its
output projection at zero, so step 0 is the shipped draft exactly. Its rollout (AttnDraft): step 1 attends causally over the true pairs (h_p, token p + 1);
step s from start i attends over the true pairs p <= i and its own steps 2..s at that start, as a speculative step
would after the verify accepted through i (RoPE at position i + s - 1). Not runnable by the engine: a study.
GPU (CPU works on a tiny harvest).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flint.draft import DraftHead, RMSNorm, draft_config_for  # noqa: E402


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Half-split rotary embedding of x [B, heads, n, d] at positions pos [n]."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d // 2, device=x.device, dtype=torch.float32) / (d // 2))
    ang = pos.float()[:, None] * inv[None]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), -1)


class AttnDraft(DraftHead):
    """DraftHead plus x = x + Attn(norm(x)) after fc. Calls between begin_rollout() and the next are the steps of one
    rollout: the first over the true pairs [B, n1, H] (causal), step s over starts 0..n1 - s (flint/draft_train.py's
    rollout_losses and accepted_runs shift their inputs that way)."""

    def __init__(self, cfg, heads: int, theta: float = 10000.0):
        super().__init__(cfg)
        h = cfg.hidden_size
        if h % heads:
            raise SystemExit(f"--heads {heads} does not divide the hidden size {h}")
        self.heads, self.hd, self.theta = heads, h // heads, theta
        self.attn_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.wq, self.wk, self.wv = (nn.Linear(h, h, bias=False) for _ in range(3))
        self.wo = nn.Linear(h, h, bias=False)
        with torch.no_grad():
            self.wo.weight.zero_()  # step 0: the draft without attention
        self._state = None

    def begin_rollout(self) -> None:
        self._state = None

    def _split(self, x):
        b, n, _ = x.shape
        return x.view(b, n, self.heads, self.hd).transpose(1, 2)

    def _attend(self, xn: torch.Tensor) -> torch.Tensor:
        q, k, v = self._split(self.wq(xn)), self._split(self.wk(xn)), self._split(self.wv(xn))
        n = q.shape[2]
        st = self._state
        if st is None:  # step 1: the true pairs, causal, positions 0..n-1
            pos = torch.arange(n, device=xn.device)
            q, k = rope(q, pos, self.theta), rope(k, pos, self.theta)
            self._state = {"k1": k, "v1": v, "own": []}
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # step s >= 2 from starts i = 0..n-1: the true pairs p <= i, then its own steps 2..s at start i
            s = len(st["own"]) + 2
            pos = torch.arange(n, device=xn.device) + s - 1
            q, k = rope(q, pos, self.theta), rope(k, pos, self.theta)
            own = [(ko[:, :, :n], vo[:, :, :n]) for ko, vo in st["own"]] + [(k, v)]
            k1, v1 = st["k1"][:, :, :n], st["v1"][:, :, :n]
            scale = 1.0 / math.sqrt(self.hd)
            s_true = (q @ k1.transpose(-1, -2)) * scale  # [B, heads, n, n]
            causal = torch.ones(n, n, dtype=torch.bool, device=xn.device).tril()
            s_true = s_true.masked_fill(~causal, float("-inf"))
            s_own = torch.stack([(q * ko).sum(-1) * scale for ko, _ in own], -1)  # [B, heads, n, s - 1]
            w = torch.softmax(torch.cat((s_true, s_own), -1).float(), -1).to(q.dtype)
            o = w[..., :n] @ v1 + sum(w[..., n + t, None] * vo for t, (_, vo) in enumerate(own))
            st["own"].append((k, v))
        b = o.shape[0]
        return self.wo(o.transpose(1, 2).reshape(b, n, -1))

    def forward(self, hidden: torch.Tensor, token_embed: torch.Tensor) -> torch.Tensor:
        dt = self.fc.weight.dtype
        x = self.fc(torch.cat((self.norm_hidden(hidden.to(dt)), self.norm_embed(token_embed.to(dt))), -1))
        x = x + self._attend(self.attn_norm(x))
        for blk in self.blocks:
            x = blk(x)
        return x


def main() -> None:
    from flint.draft import load_draft
    from flint.draft_data import load_harvest
    from flint.draft_train import init_weights, train_draft
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
    for name, make in (("plain", lambda: DraftHead(dcfg)), ("attention", lambda: AttnDraft(dcfg, a.heads))):
        draft = make().to(dev)
        init = init_weights(draft, a.init, lm.cfg)
        draft.attach_target(lm.cfg, lm.params, dev, torch.float32 if dev.type == "cpu" else torch.bfloat16)
        rec = train_draft(draft, data, Path(a.out) / name, steps=a.steps, batch_size=a.batch_size, lr=a.lr,
                          time_budget=a.budget, k_eval=a.k, init=init)
        doc["variants"][name] = {k: rec.get(k) for k in ("steps", "kept_step", "val_tokens_per_step",
                                                          "val_tokens_per_step_by_kind", "loss_first", "loss_last")}
        print(f"{name}: val tokens/step {rec.get('val_tokens_per_step')}", flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "draft_attn_study.json").write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
