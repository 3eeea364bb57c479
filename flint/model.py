"""The reference decoder: plain PyTorch, the truth every fast path is diffed against.

One class, ``Transformer``, runs Llama-family and Granite models (multipliers from ModelConfig) on
CPU or CUDA, in fp32 or bf16, with a KV cache. Its step API is the backend API (flint.backend_api):
``forward(tokens[M], start_pos)`` writes K/V for positions start_pos..start_pos+M-1, attends to
everything before plus causally within the M tokens, and returns fp32 logits [M, V] ([1, V], the
last position's, with ``last_only``). Calling it
again with a smaller start_pos overwrites the cache there, which is how speculative decoding rolls
back. ``tokens`` may also be [B, M] when the model was built with batch_size=B (batched harvest).

int4 weights (flint.quant.Int4Weight) are dequantized once at construction; the codes stay
available in ``params`` for the kernels. Test: ``pytest tests/test_hf_parity.py``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import ModelConfig
from .params import LINEAR_NAMES
from .quant import Int4Weight


def dense(w, dtype, device) -> torch.Tensor:
    if isinstance(w, Int4Weight):
        return w.dequantize(torch.float32).to(device=device, dtype=dtype)
    return w.to(device=device, dtype=dtype)


def rope_tables(cfg: ModelConfig, max_seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin float32 [max_seq_len, head_dim // 2] for HF/NEOX half-split RoPE."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    pos = torch.arange(max_seq_len, dtype=torch.float32)
    ang = torch.outer(pos, inv_freq)
    return ang.cos().to(device), ang.sin().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., M, heads, D]; cos/sin [M, D/2]. out[i] = x[i]c - x[i+D/2]s; out[i+D/2] = x[i+D/2]c + x[i]s."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(w.dtype)


class Transformer:
    name = "reference"

    def __init__(self, cfg: ModelConfig, params: dict, max_seq_len: int | None = None,
                 device="cpu", dtype=torch.float32, batch_size: int = 1):
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_seq_len = min(max_seq_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.batch_size = batch_size
        self.params = params
        dev = self.device
        self.embed = dense(params["embed"], dtype, dev)
        head = params["lm_head"]
        self.lm_head = self.embed if head is params["embed"] else dense(head, dtype, dev)
        self.norm = params["norm"].to(device=dev, dtype=dtype)
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            L = {n: dense(params[p + n], dtype, dev) for n in LINEAR_NAMES}
            L["attn_norm"] = params[p + "attn_norm"].to(device=dev, dtype=dtype)
            L["ffn_norm"] = params[p + "ffn_norm"].to(device=dev, dtype=dtype)
            # fused projections: one matmul for q|k|v and one for gate|up
            L["wqkv"] = torch.cat((L.pop("wq"), L.pop("wk"), L.pop("wv")), 0)
            L["w_gu"] = torch.cat((L.pop("w_gate"), L.pop("w_up")), 0)
            self.layers.append(L)
        self.cos, self.sin = rope_tables(cfg, self.max_seq_len, dev)
        shape = (cfg.num_layers, batch_size, cfg.num_kv_heads, self.max_seq_len, cfg.head_dim)
        self.k_cache = torch.zeros(shape, device=dev, dtype=dtype)
        self.v_cache = torch.zeros(shape, device=dev, dtype=dtype)
        # optional f(x) applied to the input of every linear and of the head: numerics studies only
        # (lab/int8_x_study.py); None in every product path
        self.linear_input = None

    def reset(self) -> None:
        """Nothing to clear: positions at or after start_pos are never read before being written."""

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start_pos: int, return_hidden: bool = False,
                last_only: bool = False):
        cfg = self.cfg
        single = tokens.dim() == 1
        toks = tokens.to(self.device).view(1, -1) if single else tokens.to(self.device)
        b, m = toks.shape
        if b > self.batch_size:
            raise ValueError(f"batch {b} exceeds the cache's batch_size {self.batch_size}")
        end = start_pos + m
        if start_pos < 0 or end > self.max_seq_len:
            raise ValueError(f"positions {start_pos}..{end - 1} exceed max_seq_len {self.max_seq_len}")
        if int(toks.min()) < 0 or int(toks.max()) >= cfg.vocab_size:
            bad = int(toks.max()) if int(toks.max()) >= cfg.vocab_size else int(toks.min())
            raise ValueError(f"token id {bad} is outside the vocabulary (size {cfg.vocab_size})")
        nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        x = F.embedding(toks, self.embed) * cfg.embedding_multiplier  # [B, M, H]
        cos, sin = self.cos[start_pos:end], self.sin[start_pos:end]
        mask = None
        if m > 1:
            qpos = torch.arange(start_pos, end, device=self.device)[:, None]
            kpos = torch.arange(end, device=self.device)[None, :]
            mask = kpos <= qpos  # [M, end]
        rm = cfg.residual_multiplier
        li_in = self.linear_input or (lambda t: t)
        for li, L in enumerate(self.layers):
            h = rms_norm(x, L["attn_norm"], cfg.rms_norm_eps)
            qkv = li_in(h) @ L["wqkv"].T
            q = qkv[..., : nh * d].view(b, m, nh, d)
            k = qkv[..., nh * d: (nh + nkv) * d].view(b, m, nkv, d)
            v = qkv[..., (nh + nkv) * d:].view(b, m, nkv, d)
            if cfg.use_rope:
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            self.k_cache[li, :b, :, start_pos:end] = k.transpose(1, 2)
            self.v_cache[li, :b, :, start_pos:end] = v.transpose(1, 2)
            kk = self.k_cache[li, :b, :, :end]
            vv = self.v_cache[li, :b, :, :end]
            # GQA without materializing repeated K/V (a copy of the whole cache per layer per step)
            att = F.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, attn_mask=mask,
                                                 scale=cfg.attn_scale, enable_gqa=nh != nkv)
            x = x + (li_in(att.transpose(1, 2).reshape(b, m, nh * d)) @ L["wo"].T) * rm
            h = rms_norm(x, L["ffn_norm"], cfg.rms_norm_eps)
            gu = li_in(h) @ L["w_gu"].T
            inter = cfg.intermediate_size
            x = x + (li_in(F.silu(gu[..., :inter]) * gu[..., inter:]) @ L["w_down"].T) * rm
        if last_only:  # a prefill needs the next token's logits only: skip the head on the other rows
            x = x[:, -1:]
        hidden = x
        logits = (li_in(rms_norm(x, self.norm, cfg.rms_norm_eps)) @ self.lm_head.T).float()
        logits = logits / cfg.logits_scaling
        if single:
            logits, hidden = logits[0], hidden[0]
        if return_hidden:
            return logits, hidden.float()
        return logits
