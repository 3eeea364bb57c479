"""The sanitizer run of bench/gpu_validate.sh: a 1-layer megakernel model stepped three times, every intermediate
buffer diffed against a hand-written torch step (the Python twin of the kernel's stages), small enough for
compute-sanitizer's memcheck and racecheck. Device-side:

    FLINT_KERNEL_DIR=build/kernels python3 bench/sanitize_run.py
    FLINT_KERNEL_DIR=build/kernels compute-sanitizer --tool racecheck python3 bench/sanitize_run.py
    FLINT_MK_FFN_SPLIT=1 ...         # the FFN split-K path (16 FFN blocks on this shape)
    FLINT_MK_DEBUG_HEAD_DIM=64 ...   # head_dim 64 instead of 128 (the paths kept to D = 64, e.g. MK_PV3)
    FLINT_MK_DEBUG_GROUP=128 ...     # int4 groups of 128 instead of 64: the M = 1 object with gate|up's integer dot
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flint.config import ModelConfig, from_hf_dict  # noqa: E402
from flint.megakernel import MegakernelBackend  # noqa: E402
from flint.model import rope_tables  # noqa: E402
from flint.synthetic import synthetic_params  # noqa: E402


def small_cfg(**kw) -> ModelConfig:
    """The small llama shape of the sanitizer runs (lab/mk_dev.py's correctness checks use the same one)."""
    d = dict(model_type="llama", vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=1, head_dim=128, rms_norm_eps=1e-5, rope_theta=10000.0,
             tie_word_embeddings=False, max_position_embeddings=8192)
    d.update(kw)
    return from_hf_dict(d, "small")


def mk_q(mk, nq):
    """Token 0's roped q: p.q if a kernel wrote it, else the tagged words (fp32 bits, tag) the q|k|v epilogues write."""
    if torch.count_nonzero(mk.q[0]):
        return mk.q[0]
    return mk.qkv_tag.view(-1, 2)[:nq, 0].contiguous().view(torch.float32)


def rel(a, b):
    return f"{float((a.float() - b.float()).norm() / (b.float().norm() + 1e-30)):.3e}"


def main():
    # one scratch placement: the placement trial at load times dozens of steps, which under racecheck alone outlasts
    # the sanitizer run's time limit, and where the scratch lands does not change what the sanitizers check
    os.environ.setdefault("FLINT_MK_PLACE", "1")
    hd = int(os.environ.get("FLINT_MK_DEBUG_HEAD_DIM", "128"))
    if hd not in (64, 128):
        sys.exit(f"FLINT_MK_DEBUG_HEAD_DIM={hd}: 64 or 128 (4 heads x head_dim must fit the hidden size 256)")
    gs = int(os.environ.get("FLINT_MK_DEBUG_GROUP", "64"))
    if gs not in (32, 64, 128):
        sys.exit(f"FLINT_MK_DEBUG_GROUP={gs}: 32, 64 or 128")
    cfg = small_cfg(num_hidden_layers=1, head_dim=hd)
    P = synthetic_params(cfg, seed=0, int4_group_size=gs, dtype=torch.float32, device="cuda")
    mk = MegakernelBackend(cfg, P, 64)
    W = {k: (v.dequantize() if hasattr(v, "dequantize") else v.float()) for k, v in P.items()}
    nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    cos, sin = rope_tables(cfg, 64, "cuda")
    kc, vc = [], []
    for pos, t in enumerate([5, 17, 300]):
        logits = mk.forward(torch.tensor([t]), pos)
        torch.cuda.synchronize()
        x = W["embed"][t] * cfg.embedding_multiplier
        ms = lambda v, w: w * (v * torch.rsqrt(v.pow(2).mean() + cfg.rms_norm_eps))  # noqa: E731
        h = ms(x, W["layers.0.attn_norm"])
        q = (h @ W["layers.0.wq"].T).view(nh, d)
        k = (h @ W["layers.0.wk"].T).view(nkv, d)
        v = (h @ W["layers.0.wv"].T).view(nkv, d)

        def rope(z):
            z1, z2 = z[:, : d // 2], z[:, d // 2:]
            c, s = cos[pos], sin[pos]
            return torch.cat((z1 * c - z2 * s, z2 * c + z1 * s), -1)
        q, k = rope(q), rope(k)
        kc.append(k); vc.append(v)
        K = torch.stack(kc, 1); V = torch.stack(vc, 1)  # [nkv, T, d]
        g = nh // nkv
        att = []
        for hq in range(nh):
            sc = (K[hq // g] @ q[hq]) * cfg.attn_scale
            att.append(torch.softmax(sc, -1) @ V[hq // g])
        att = torch.cat(att)
        x1 = x + (att @ W["layers.0.wo"].T) * cfg.residual_multiplier
        h2 = ms(x1, W["layers.0.ffn_norm"])
        act = F.silu(h2 @ W["layers.0.w_gate"].T) * (h2 @ W["layers.0.w_up"].T)
        x2 = x1 + (act @ W["layers.0.w_down"].T) * cfg.residual_multiplier
        lg = ms(x2, W["norm"]) @ W["lm_head"].T / cfg.logits_scaling
        print(f"pos {pos}: q {rel(mk_q(mk, q.numel()), q.flatten())} k {rel(mk.k_cache[0, :, pos], k)} "
              f"v {rel(mk.v_cache[0, :, pos], v)} attn {rel(mk.attn[0], att)} "
              f"act {'(FFN split-K: in shared memory)' if mk.ffn_plan else rel(mk.act[0], act)} "
              f"resid {rel(mk.resid[0], x2)} logits {rel(logits[0], lg)}")
        if pos == 0:
            print(" q mk ", mk_q(mk, q.numel())[:6].tolist(), "\n q ref", q.flatten()[:6].tolist())
            print(" v mk ", mk.v_cache[0, 0, 0, :6].tolist(), "\n v ref", v[0, :6].tolist())
            print(" act mk ", mk.act[0, :6].tolist(), "\n act ref", act[:6].tolist())


if __name__ == "__main__":
    main()
