"""The draft's optional attention over its own features (EAGLE-1's decoder layer, one causal self-attention block
after fc): ``DraftConfig.attention_heads`` > 0 adds it to flint.speculative.draft_head.DraftHead as
x = x + Attn(norm(x)).

What it attends over. The draft's feature at region position p is x_p = fc([norm(h_p), norm(embed[t_{p+1}])]), the
pair of the target's hidden state at p and the token after it; the region starts at the last prompt token. A
rollout from start i (the pair of the target's state at i and the token it chose) attends over the true pairs 0..i,
and its step s >= 2 also over its own steps 2..s of that rollout, RoPE at position i + s - 1. The true pairs are
what the verify confirmed, so they never roll back: the rollout's own steps are kept only for the rollout.

Two modes, told apart by the input's rank. Training and validation (flint/speculative/draft_train.py: [B, n, H],
every start at once): begin_rollout(), then the first call is step 1 over the true pairs (causal), later calls step s over starts
0..n-s (the inputs shifted as rollout_losses and accepted_runs shift them). Decoding ([1, H], flint.speculative.verify):
reset_state(max_len) when a generation starts, ``append`` (DraftHead.observe) adds the pairs each verify accepted before the next
rollout (their count on the device: no host sync), each rollout's first step appends its own start pair; the cache
is [max_len] rows with a device-side length, masked, so every shape is fixed.

Runs on torch only (the rollout kernel and the graph rollout refuse a draft with attention: DraftHead). The
acceptance it buys, measured as a study: docs/speculative.md (lab/draft_attn_study.py).
Tests: tests/test_draft_attn.py.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..model import apply_rope

ROPE_THETA = 10000.0  # the draft's own positions (region indices), not the target's


_INV_FREQ: dict = {}  # (width, device) -> the rotary frequencies, built once (a decode step rotates twice)


def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """flint.model.apply_rope (half-split, fp32) of x [..., n, heads, d] at positions pos [n], a tensor that may live
    on the device (a decode step's position is the cache's device-side length)."""
    d = x.shape[-1]
    inv = _INV_FREQ.get((d, x.device))
    if inv is None:
        inv = _INV_FREQ[(d, x.device)] = ROPE_THETA ** (
            -torch.arange(0, d // 2, device=x.device, dtype=torch.float32) / (d // 2))
    ang = pos.float()[:, None] * inv[None]
    return apply_rope(x, ang.cos(), ang.sin())


def heads_fit(dim: int, heads: int) -> bool:
    """Whether ``heads`` split ``dim`` into heads of even width (RoPE's halves)."""
    return heads >= 1 and dim % heads == 0 and (dim // heads) % 2 == 0


class DraftAttention(nn.Module):
    """The block: ``norm`` (the draft's RMSNorm of the features), q / k / v / o projections of dim -> dim."""

    def __init__(self, dim: int, heads: int, norm: nn.Module):
        super().__init__()  # (DraftHead refuses heads that do not fit: heads_fit)
        self.heads, self.hd = heads, dim // heads
        self.norm = norm
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim, bias=False)
        with torch.no_grad():
            self.wo.weight.zero_()  # a new block starts as no attention: the draft it was added to
        self._train = None  # training: the rollout's step-1 keys and its own steps
        self._cache = None  # decoding: the true pairs' keys and values, their count, this rollout's own steps

    # ---------------------------------------------------------------- training ([B, n, H])
    def begin_rollout(self) -> None:
        self._train = None

    def _attend_train(self, xn: torch.Tensor) -> torch.Tensor:
        b, n, _ = xn.shape
        q, k, v = (w(xn).view(b, n, self.heads, self.hd) for w in (self.wq, self.wk, self.wv))
        st = self._train
        # step 1: the true pairs, causal, positions 0..n-1; step s: positions i + s - 1 from starts i
        pos = torch.arange(n, device=xn.device) + (0 if st is None else len(st["own"]) + 1)
        q, k, v = (t.transpose(1, 2) for t in (rope(q, pos), rope(k, pos), v))  # [B, heads, n, hd]
        if st is None:
            self._train = {"k1": k, "v1": v, "own": []}
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # step s >= 2 from starts i = 0..n-1: the true pairs p <= i, then its own steps 2..s at start i
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
        return self.wo(o.transpose(1, 2).reshape(b, n, -1))

    # ---------------------------------------------------------------- decoding ([1, H])
    def reset_state(self, max_len: int, device, dtype) -> None:
        """A new generation: an empty cache of ``max_len`` true pairs."""
        z = torch.zeros(max_len, self.heads, self.hd, device=device, dtype=dtype)
        self._cache = {"k": z, "v": z.clone(), "len": torch.zeros(1, dtype=torch.long, device=device),
                       "own": None, "start": None}

    @property
    def has_state(self) -> bool:
        return self._cache is not None

    def _need_cache(self):
        if self._cache is None:
            raise RuntimeError("draft attention: reset_state(max_len) before decoding")
        return self._cache

    def append(self, xn: torch.Tensor, count: torch.Tensor) -> None:
        """Write the keys / values of the true pairs xn [m, H] (normed features) at rows len .. len + m - 1 and
        advance the length by ``count`` [1] (<= m, on the device): rows past it are rewritten by the next append."""
        c = self._need_cache()
        m = xn.shape[0]
        if m == 0:
            return
        rows = c["len"] + torch.arange(m, device=xn.device)
        k = rope(self.wk(xn).view(m, self.heads, self.hd), rows)
        v = self.wv(xn).view(m, self.heads, self.hd)
        c["k"].index_copy_(0, rows, k.to(c["k"].dtype))
        c["v"].index_copy_(0, rows, v.to(c["v"].dtype))
        c["len"] += count.reshape(1).to(torch.long)

    def begin_decode(self) -> None:
        """A rollout starts: its first call appends its start pair as a true one."""
        c = self._need_cache()
        c["own"], c["start"] = [], None

    def _attend_decode(self, xn: torch.Tensor) -> torch.Tensor:
        c = self._need_cache()
        if c["own"] is None:
            raise RuntimeError("draft attention: begin_decode() before a rollout's first step")
        first = c["start"] is None
        if first:  # step 1: the start pair joins the true pairs (it attends over them, itself included)
            self.append(xn, torch.ones(1, dtype=torch.long, device=xn.device))
            c["start"] = c["len"] - 1
            pos = c["start"]
        else:  # step s >= 2: over the true pairs and this rollout's steps 2..s, itself included
            pos = c["start"] + len(c["own"]) + 1
            k = rope(self.wk(xn).view(1, self.heads, self.hd), pos)
            c["own"].append((k, self.wv(xn).view(1, self.heads, self.hd)))
        q = rope(self.wq(xn).view(1, self.heads, self.hd), pos)  # [1, heads, hd]
        scale = 1.0 / math.sqrt(self.hd)
        kc, vc = c["k"].to(q.dtype), c["v"].to(q.dtype)
        live = torch.arange(kc.shape[0], device=xn.device) < c["len"]
        scores = [(torch.einsum("qhd,lhd->hl", q, kc) * scale).masked_fill(~live[None], float("-inf"))]
        values = [vc]
        if not first:
            ko = torch.cat([a for a, _ in c["own"]])  # [s - 1, heads, hd]
            scores.append(torch.einsum("qhd,lhd->hl", q, ko) * scale)
            values.append(torch.cat([v for _, v in c["own"]]))
        w = torch.softmax(torch.cat(scores, -1).float(), -1).to(q.dtype)  # [heads, rows]
        o = torch.einsum("hl,lhd->hd", w, torch.cat(values))
        return self.wo(o.reshape(1, -1))

    def forward(self, xn: torch.Tensor) -> torch.Tensor:
        return self._attend_train(xn) if xn.dim() == 3 else self._attend_decode(xn)
