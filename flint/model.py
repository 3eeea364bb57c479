"""The reference decoder: plain PyTorch, the truth every fast path is diffed against.

One class, ``Transformer``, runs Llama-family and Granite models (multipliers from ModelConfig) on
CPU or CUDA, in fp32 or bf16, with a KV cache; with the features ModelConfig names, also Qwen2 (q/k/v
biases), Qwen3 (per-head q/k RMSNorm before RoPE), Phi-3 (partial RoPE, LongRoPE), Mistral (a
sliding window: the cache keeps every position, the mask hides those behind the window) and scaled
RoPE (rope_frequencies). Its step API is the backend API (flint.backend_api):
``forward(tokens[M], start_pos)`` writes K/V for positions start_pos..start_pos+M-1, attends to
everything before plus causally within the M tokens, and returns fp32 logits [M, V] ([1, V], the
last position's, with ``last_only``). Calling it
again with a smaller start_pos overwrites the cache there, which is how speculative decoding rolls
back. ``tokens`` may also be [B, M] when the model was built with batch_size=B (batched harvest).

int4 weights (flint.quant.int4.Int4Weight) are dequantized once at construction; the codes stay
available in ``params`` for the kernels. Test: ``pytest tests/test_hf_parity.py``.

The KV cache (``kv_cache=``, the CLI's ``--kv-cache``; flint.evaluate measures what each costs):

* ``"fp16"`` (default): the unquantized cache, held at the decoder's own dtype (fp32 on a CPU, bf16
  on a GPU; the name is the kernels', whose float cache is fp16). ``k_cache`` / ``v_cache``
  [layers, batch, kv_heads, max_seq_len, head_dim].
* ``"int8"`` and ``"fp8"``: 8-bit values with one scale per written row, i.e. per (layer, batch,
  kv head, position) over that row's head_dim values, quantized on write and dequantized on read.
  ``k_cache`` / ``v_cache`` hold the values (int8, or torch.float8_e4m3fn) in the same
  [layers, batch, kv_heads, max_seq_len, head_dim] layout, and ``k_scale`` / ``v_scale`` the
  scales, fp16 [layers, batch, kv_heads, max_seq_len]: row (l, b, h, p) is
  ``values[l, b, h, p, :].float() * scale[l, b, h, p]``. A kernel reads a tile of positions as
  head_dim bytes per row plus a contiguous run of 2-byte scales (one per row), so the 8-bit cache
  costs head_dim + 2 bytes per row against 2 x head_dim for fp16 (66 / 128 bytes at head_dim 64,
  130 / 256 at 128).
  The scale is the row's max |x| over the format's largest value (127 for int8, 448 for e4m3),
  rounded *up* to fp16, so no value leaves the code range and none is clipped: int8 codes are
  round(x / scale) in [-127, 127] (symmetric: -128 unused), the error at most scale / 2 per value;
  fp8 values are x / scale cast to e4m3 (round to nearest), the error at most 2^-4 of |x| (3
  mantissa bits), or scale x 2^-10 in e4m3's subnormal range. The scale is fp16 rather than fp32
  because it halves the scale's bytes and fp16's 11-bit significand changes it by at most 2^-10
  (rounded up; more for a row whose scale is an fp16 subnormal, max |x| < 7.8e-3 for int8, where
  the error bound above still holds with the stored scale): far below the 8-bit values' own step.
  An all-zero row gets scale 0 (decoded as 0). What each format costs: docs/eval.md.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from .config import ModelConfig
from .params import LINEAR_NAMES
from .quant.int4 import Int4Weight


def dense(w, dtype, device) -> torch.Tensor:
    if isinstance(w, Int4Weight):
        return w.dequantize(torch.float32).to(device=device, dtype=dtype)
    return w.to(device=device, dtype=dtype)


def rope_frequencies(cfg: ModelConfig, max_seq_len: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies float32 [R/2], attention factor) for a rotary width R (cfg.rotary_dim, else
    head_dim), with cfg.rope_scaling applied as transformers computes it; the factor multiplies cos
    and sin. LongRoPE's factor set is picked once from the context ``max_seq_len``: the long set when
    it exceeds the original context, as llama.cpp picks it (transformers picks per call, so the two
    agree on every call within the original context and on a prefill past it)."""
    r = cfg.rotary_dim or cfg.head_dim
    base = cfg.rope_theta ** (torch.arange(0, r, 2, dtype=torch.int64).float() / r)
    inv = 1.0 / base
    s = cfg.rope_scaling or {"rope_type": "default"}
    kind = s["rope_type"]
    if kind == "linear":
        inv = inv / s["factor"]
    elif kind == "freq_factors":  # a GGUF rope_freqs tensor: llama.cpp divides each frequency by it
        inv = inv / torch.tensor(s["factors"], dtype=torch.float32)
    elif kind == "llama3":  # long wavelengths slowed by factor, short ones kept, a smooth blend between
        f, lo, hi, old = (s[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                         "original_max_position_embeddings"))
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / f, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        blend = (1 - smooth) * scaled / f + smooth * scaled
        inv = torch.where((wavelen >= old / hi) & (wavelen <= old / lo), blend, scaled)
    elif kind == "yarn":  # interpolated below the correction range, extrapolated above, a ramp between
        f, old = s["factor"], s["original_max_position_embeddings"]

        def dim_at(rotations):  # the dimension whose wavelength makes ``rotations`` turns in ``old`` positions
            return r * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

        lo, hi = dim_at(s["beta_fast"]), dim_at(s["beta_slow"])
        if s.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, r - 1)
        ramp = ((torch.arange(r // 2, dtype=torch.float32) - lo) / ((hi - lo) or 0.001)).clamp(0, 1)
        keep = 1 - ramp  # 1: extrapolate (the plain frequency), 0: interpolate (divided by factor)
        inv = (1.0 / (f * base)) * (1 - keep) + inv * keep
    elif kind == "longrope":
        long = max_seq_len > s["original_max_position_embeddings"]
        ext = torch.tensor(s["long_factor" if long else "short_factor"], dtype=torch.float32)
        inv = 1.0 / (ext * base)
    return inv, float(s.get("attention_factor", 1.0))


def rope_tables(cfg: ModelConfig, max_seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin float32 [max_seq_len, R // 2] for HF/NEOX half-split RoPE over the rotary width R
    (rope_frequencies: scaled, and times the attention factor)."""
    inv_freq, att = rope_frequencies(cfg, max_seq_len)
    pos = torch.arange(max_seq_len, dtype=torch.float32)
    ang = torch.outer(pos, inv_freq)
    return (ang.cos() * att).to(device), (ang.sin() * att).to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., M, heads, D]; cos/sin [M, R/2] for a rotary width R <= D: the first R values of each
    head rotate, out[i] = x[i]c - x[i+R/2]s; out[i+R/2] = x[i+R/2]c + x[i]s, the other D - R pass."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half].float(), x[..., half: 2 * half].float()
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, x[..., 2 * half:].float()), dim=-1).to(x.dtype)


KV_CACHE_FORMATS = ("fp16", "int8", "fp8")
KV_QMAX = {"int8": 127.0, "fp8": 448.0}  # largest code magnitude: int8's symmetric range, e4m3's finite max


def kv_format_bytes(cfg: ModelConfig, fmt: str) -> int:
    """K + V bytes one position of one sequence holds in cache format ``fmt``, every layer: a row is
    2 x head_dim bytes for fp16 (the kernels' float cache), head_dim + 2 for the 8-bit formats."""
    if fmt not in KV_CACHE_FORMATS:
        raise ValueError(f"--kv-cache {fmt!r}: choose one of {', '.join(KV_CACHE_FORMATS)}")
    row = 2 * cfg.head_dim if fmt == "fp16" else cfg.head_dim + 2
    return 2 * cfg.num_layers * cfg.num_kv_heads * row


@functools.lru_cache(maxsize=None)  # the fp8 probe cast runs once, not every layer and step
def kv_value_dtype(fmt: str):
    """The cache values' dtype for an 8-bit format; refuses a format or a torch that cannot hold it."""
    if fmt == "int8":
        return torch.int8
    if fmt == "fp8":
        dt = getattr(torch, "float8_e4m3fn", None)
        try:
            if dt is None:
                raise TypeError("no torch.float8_e4m3fn")
            torch.ones(2).to(dt).float()
        except (TypeError, RuntimeError) as e:
            raise ValueError(f"--kv-cache fp8: this torch build ({torch.__version__}) cannot cast to and from "
                             f"float8_e4m3fn ({e}); use --kv-cache int8") from None
        return dt
    raise ValueError(f"--kv-cache {fmt!r}: choose one of {', '.join(KV_CACHE_FORMATS)}")


def kv_quantize(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (8-bit values [..., head_dim], fp16 scales [...]): one scale per row,
    max |x| / KV_QMAX[fmt] rounded up to fp16 (the layout in the module docstring).

    The arithmetic, step by step, for a kernel to match bit for bit (x: the row as the decoder holds
    it, K after RoPE, widened to fp32: the reference's rows are fp32 on a CPU, bf16 on a GPU; every
    step in fp32 with IEEE round-to-nearest-even, no fast-math):

    1. a = max |x_i| over the row's head_dim values (exact);
    2. s = a / qmax, a true fp32 division (qmax = 127.0 or 448.0; not a multiply by 1/qmax);
    3. h = s rounded to fp16 (nearest-even); if float(h) < s, h = the next fp16 up (bits + 1: h >= 0),
       so float(h) >= s and no code leaves [-qmax, qmax]; h is the stored scale (0 for an all-zero row);
    4. y_i = x_i / float(h), a true fp32 division (x_i / 1 when h == 0, i.e. 0);
    5. int8: q_i = round-half-to-even(y_i) clamped to [-127, 127] (CUDA: __float2int_rn then min/max);
       fp8: q_i = y_i clamped to [-448, 448], cast to e4m3fn round-to-nearest-even (CUDA:
       __nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3) gives the same values after the clamp);
    6. read back: float(q_i) * float(h), one fp32 multiply, then the decoder's dtype.

    The decoder quantizes every row it writes and reads every row back this way, the rows of the
    current step included (attention never sees a row's unquantized K or V)."""
    xf = x.float()
    a = xf.abs().amax(-1)
    s = a / torch.full_like(a, KV_QMAX[fmt])  # a tensor divisor: on CUDA, torch turns `/ python_float`
    # into a multiply by its fp32 reciprocal, which differs from the division in the last bit
    s16 = s.to(torch.float16)
    s16 = torch.where(s16.float() < s, torch.nextafter(s16, torch.full_like(s16, float("inf"))), s16)
    sf = s16.float()
    y = xf / torch.where(sf > 0, sf, torch.ones_like(sf))[..., None]
    qmax = KV_QMAX[fmt]
    if fmt == "int8":  # |y| <= 127 up to fp32 rounding: the clamp only guards that last ulp
        q = y.round().clamp_(-qmax, qmax).to(torch.int8)
    else:  # e4m3fn has no infinity: a value past 448 would cast to NaN
        q = y.clamp_(-qmax, qmax).to(kv_value_dtype(fmt))
    return q, s16


def kv_dequantize(q: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    """The inverse of kv_quantize: values [..., head_dim] x scales [...] -> ``dtype``."""
    return (q.float() * scale.float()[..., None]).to(dtype)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(w.dtype)


class Transformer:
    name = "reference"
    # layer indices whose output residual forward(return_hidden=True) also returns, concatenated before the last
    # layer's along the last dimension: draft-feature studies only (lab/draft_eagle3_study.py sets it on the class for
    # a harvest); () in every product path
    hidden_layers: tuple = ()

    def __init__(self, cfg: ModelConfig, params: dict, max_seq_len: int | None = None,
                 device="cpu", dtype=torch.float32, batch_size: int = 1, kv_cache: str = "fp16"):
        if kv_cache not in KV_CACHE_FORMATS:
            raise ValueError(f"--kv-cache {kv_cache!r}: choose one of {', '.join(KV_CACHE_FORMATS)}")
        self.cfg = cfg
        self.kv_cache = kv_cache
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
            if cfg.qkv_bias:
                L["bqkv"] = torch.cat([params[p + n].to(device=dev, dtype=dtype) for n in ("bq", "bk", "bv")])
            if cfg.qk_norm:
                L["q_norm"] = params[p + "q_norm"].to(device=dev, dtype=dtype)
                L["k_norm"] = params[p + "k_norm"].to(device=dev, dtype=dtype)
            self.layers.append(L)
        self.cos, self.sin = rope_tables(cfg, self.max_seq_len, dev)
        shape = (cfg.num_layers, batch_size, cfg.num_kv_heads, self.max_seq_len, cfg.head_dim)
        if kv_cache == "fp16":
            self.k_cache = torch.zeros(shape, device=dev, dtype=dtype)
            self.v_cache = torch.zeros(shape, device=dev, dtype=dtype)
        else:
            vdt = kv_value_dtype(kv_cache)
            self.k_cache = torch.zeros(shape, device=dev, dtype=vdt)
            self.v_cache = torch.zeros(shape, device=dev, dtype=vdt)
            self.k_scale = torch.zeros(shape[:-1], device=dev, dtype=torch.float16)
            self.v_scale = torch.zeros(shape[:-1], device=dev, dtype=torch.float16)
        # optional f(x) applied to the input of every linear and of the head: numerics studies only
        # (lab/int8_x_study.py); None in every product path
        self.linear_input = None

    def kv_bytes(self, ctx: int) -> int:
        """Bytes of K and V (values and scales) one decode step of one sequence reads at context ``ctx``."""
        c = self.cfg
        row = c.head_dim * self.k_cache.element_size() + (0 if self.kv_cache == "fp16" else 2)
        return 2 * c.num_layers * c.num_kv_heads * ctx * row

    def _write_read_kv(self, li: int, b: int, start_pos: int, end: int, k, v):
        """Writes K/V [B, M, KV, D] at start_pos..end-1 of layer li; returns the cache's K, V [B, KV, end, D]."""
        if self.kv_cache == "fp16":
            self.k_cache[li, :b, :, start_pos:end] = k.transpose(1, 2)
            self.v_cache[li, :b, :, start_pos:end] = v.transpose(1, 2)
            return self.k_cache[li, :b, :, :end], self.v_cache[li, :b, :, :end]
        out = []
        for x, vals, scales in ((k, self.k_cache, self.k_scale), (v, self.v_cache, self.v_scale)):
            q, s = kv_quantize(x.transpose(1, 2), self.kv_cache)
            vals[li, :b, :, start_pos:end] = q
            scales[li, :b, :, start_pos:end] = s
            # every row is read back quantized, the ones just written included (as a kernel reading the cache)
            out.append(kv_dequantize(vals[li, :b, :, :end], scales[li, :b, :, :end], x.dtype))
        return out

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
        window = cfg.sliding_window
        if m > 1 or (window is not None and end > window):
            qpos = torch.arange(start_pos, end, device=self.device)[:, None]
            kpos = torch.arange(end, device=self.device)[None, :]
            mask = kpos <= qpos  # [M, end]
            if window is not None:  # the query's own position and the window - 1 before it
                mask = mask & (kpos > qpos - window)
        rm = cfg.residual_multiplier
        li_in = self.linear_input or (lambda t: t)
        caught = []
        for li, L in enumerate(self.layers):
            h = rms_norm(x, L["attn_norm"], cfg.rms_norm_eps)
            qkv = li_in(h) @ L["wqkv"].T
            if cfg.qkv_bias:
                qkv = qkv + L["bqkv"]
            q = qkv[..., : nh * d].view(b, m, nh, d)
            k = qkv[..., nh * d: (nh + nkv) * d].view(b, m, nkv, d)
            v = qkv[..., (nh + nkv) * d:].view(b, m, nkv, d)
            if cfg.qk_norm:
                q, k = rms_norm(q, L["q_norm"], cfg.rms_norm_eps), rms_norm(k, L["k_norm"], cfg.rms_norm_eps)
            if cfg.use_rope:
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            kk, vv = self._write_read_kv(li, b, start_pos, end, k, v)
            # GQA without materializing repeated K/V (a copy of the whole cache per layer per step)
            att = F.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, attn_mask=mask,
                                                 scale=cfg.attn_scale, enable_gqa=nh != nkv)
            x = x + (li_in(att.transpose(1, 2).reshape(b, m, nh * d)) @ L["wo"].T) * rm
            h = rms_norm(x, L["ffn_norm"], cfg.rms_norm_eps)
            gu = li_in(h) @ L["w_gu"].T
            inter = cfg.intermediate_size
            x = x + (li_in(F.silu(gu[..., :inter]) * gu[..., inter:]) @ L["w_down"].T) * rm
            if li in self.hidden_layers:
                caught.append(x)
        if last_only:  # a prefill needs the next token's logits only: skip the head on the other rows
            x = x[:, -1:]
            caught = [c[:, -1:] for c in caught]
        hidden = torch.cat((*caught, x), -1) if caught else x
        logits = (li_in(rms_norm(x, self.norm, cfg.rms_norm_eps)) @ self.lm_head.T).float()
        logits = logits / cfg.logits_scaling
        if single:
            logits, hidden = logits[0], hidden[0]
        if return_hidden:
            return logits, hidden.float()
        return logits
