"""int4 group-quantized weights: flint's one packed layout, and the conversions into it.

Every fast path reads this layout, so it is defined once, here.

Layout ``flint-int4-v1`` for a linear weight W of shape [N, K] (out_features, in_features),
groups of G consecutive values along K (G in {32, 64, 128}; K % G == 0, K % 32 == 0):

* ``qweight``  uint8   [N, K // 2]   row-major; byte j of row n holds code(n, 2j) in its low nibble
                                     and code(n, 2j + 1) in its high nibble. A 16-byte load therefore
                                     reads 32 consecutive codes of one row, and a warp reading a row
                                     reads 512 contiguous bytes: coalesced at M = 1.
* ``scales``   float16 [N, K // G]
* ``mins``     float16 [N, K // G]

  W[n, k] = code(n, k) * scales[n, k // G] + mins[n, k // G]      (codes 0..15; computed in fp32)

GGUF Q4_1 blocks (d, m, 16 bytes of codes; element j in the low nibble of byte j, element j + 16 in
the high nibble) map onto this with G = 32, scales = d, mins = m: only the nibble order changes, no
value is rounded again. Q4_0 (value = (q - 8) * d) is the symmetric case: scales = d, mins = -8 * d,
which fp16 holds exactly (a power-of-two multiple). GGUF Q4_K super-blocks (256 values, 8
sub-blocks of 32 with 6-bit sub-scales sc and mins m under fp16 d and dmin) map onto G = 32 with
the file's codes, scale = d sc and min = -dmin m: both are exact in float32 but only sometimes an
fp16 value, so ``from_q4_k_blocks`` returns an ``ExactInt4Weight`` (below): the kernels read
(scale, min) rounded once to fp16, the reference backend the exact float32 pair. Kernels may
repack scales/mins (interleave them) at load; they never re-round codes.

``ExactInt4Weight``: an Int4Weight whose fp16 ``scales`` / ``mins`` (what every int4 kernel
reads) are float32 values rounded once to nearest, with those float32 values kept beside them
(``exact_scales``, ``exact_mins``; None where the fp16 field is exact). ``dequantize`` (what the
reference backend runs) uses them: a GGUF Q4_K tensor dequantizes bit for bit as gguf's
``dequantize`` does, a GPTQ / AWQ one as its format does (flint/quant/hfquant.py). On the kernels a
weight q s + m moves by at most 15 |ds| + |dm|, where fp16 rounding to nearest gives
|dx| <= max(2^-11 |x|, 2^-25) (half an ulp; 2^-25 in the subnormal range): for a normal scale at
most (15 + |m| / s) / 2048 of the quantization step s, i.e. <= s / 68 in a sub-block whose values
span zero (|m| <= 15 s). tests/test_kquants.py checks the bound; bench/results/q4k_codes_kept_2026-12-02.md
measures it on a Q4_K_M file.

Fits into the layout: ``quantize_int4`` (round-to-nearest from each group's min and max),
``quantize_int4_searched`` (each group's scale and min searched to minimise its squared error), and
GPTQ in flint/quant/gptq.py (errors compensated over calibration activations).

Run ``pytest tests/test_quant.py`` for the round-trip tests, ``tests/test_kquants.py`` for the K-quants.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from ..params import LINEAR_NAMES

GROUP_SIZES = (32, 64, 128)
LAYOUT = "flint-int4-v1"


@dataclass
class Int4Weight:
    """A [N, K] weight in the flint-int4-v1 layout (see module docstring)."""

    qweight: torch.Tensor  # uint8 [N, K // 2]
    scales: torch.Tensor  # float16 [N, K // G]
    mins: torch.Tensor  # float16 [N, K // G]
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.qweight.shape[0], self.qweight.shape[1] * 2)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.mins))

    def to(self, device) -> "Int4Weight":
        return Int4Weight(self.qweight.to(device), self.scales.to(device), self.mins.to(device),
                          self.group_size)

    def codes(self) -> torch.Tensor:
        """uint8 [N, K] codes 0..15."""
        return unpack_int4(self.qweight)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        n, k = self.shape
        g = self.group_size
        q = self.codes().to(torch.float32).view(n, k // g, g)
        w = q * self.scales.float().unsqueeze(-1) + self.mins.float().unsqueeze(-1)
        return w.view(n, k).to(dtype)

    def rows(self, index) -> "Int4Weight":
        """A row subset (exact: rows are independent)."""
        return Int4Weight(self.qweight[index], self.scales[index], self.mins[index], self.group_size)


@dataclass
class ExactInt4Weight(Int4Weight):
    """An Int4Weight whose fp16 scales / mins are float32 values rounded once (module docstring);
    ``dequantize`` uses the float32 values (None: that fp16 field is exact)."""

    # keyword-only: a positional float32 tensor cannot land in the wrong field
    exact_scales: torch.Tensor | None = field(default=None, kw_only=True)  # float32 [N, K // G]
    exact_mins: torch.Tensor | None = field(default=None, kw_only=True)  # float32 [N, K // G]

    def _like(self, w: Int4Weight, f) -> "ExactInt4Weight":
        es, em = (None if t is None else f(t) for t in (self.exact_scales, self.exact_mins))
        return ExactInt4Weight(w.qweight, w.scales, w.mins, w.group_size, exact_scales=es, exact_mins=em)

    def to(self, device) -> "ExactInt4Weight":
        return self._like(super().to(device), lambda t: t.to(device))

    def rows(self, index) -> "ExactInt4Weight":
        return self._like(super().rows(index), lambda t: t[index])

    def kernel_view(self) -> Int4Weight:
        """What the int4 kernels read: the fp16 fields only."""
        return Int4Weight(self.qweight, self.scales, self.mins, self.group_size)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        # codes * s + m in float32, each product and sum rounded once, as the source formats compute it
        s = self.scales if self.exact_scales is None else self.exact_scales
        m = self.mins if self.exact_mins is None else self.exact_mins
        return Int4Weight(self.qweight, s, m, self.group_size).dequantize(dtype)


def kernel_params(params: dict, names=None) -> dict:
    """What the int4 kernels read of ``params``: each exact-values weight (a GGUF Q4_K, a GPTQ / AWQ one) as its fp16
    fields (``kernel_view``), among ``names`` when given; everything else as it is."""
    return {k: w.kernel_view() if isinstance(w, ExactInt4Weight) and (names is None or k in names) else w
            for k, w in params.items()}


def check_shape(name: str, n: int, k: int, group_size: int) -> None:
    if group_size not in GROUP_SIZES:
        raise ValueError(f"{name}: group_size {group_size} is not one of {GROUP_SIZES}")
    if k % group_size != 0:
        raise ValueError(f"{name}: group_size {group_size} does not divide in_features K={k}")
    if k % 32 != 0:
        raise ValueError(f"{name}: in_features K={k} is not a multiple of 32 (16-byte rows)")


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] (values 0..15) -> packed uint8 [N, K // 2] (low nibble = even k)."""
    if codes.shape[-1] % 2:
        raise ValueError("pack_int4: K must be even")
    c = codes.to(torch.uint8)
    if int(c.max()) > 15 if c.numel() else False:
        raise ValueError("pack_int4: codes must be in 0..15")
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """packed uint8 [N, K // 2] -> codes uint8 [N, K]."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def quantize_int4(w: torch.Tensor, group_size: int = 128, name: str = "weight") -> Int4Weight:
    """Round-to-nearest asymmetric int4 per group: scale = (max - min) / 15, min = group min.

    scale and min are rounded to fp16 first and the codes are chosen against the rounded values,
    so dequantize() reproduces exactly what the codes were fitted to.
    """
    if w.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D weight, got shape {tuple(w.shape)}")
    n, k = w.shape
    check_shape(name, n, k, group_size)
    wf = w.detach().to(torch.float32).view(n, k // group_size, group_size)
    lo = wf.amin(dim=-1)
    hi = wf.amax(dim=-1)
    scale = ((hi - lo) / 15.0).to(torch.float16)
    mn = lo.to(torch.float16)
    s = scale.float()
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round((wf - mn.float().unsqueeze(-1)) / safe.unsqueeze(-1)).clamp_(0, 15)
    q = torch.where((s > 0).unsqueeze(-1), q, torch.zeros_like(q))
    return Int4Weight(pack_int4(q.view(n, k).to(torch.uint8)), scale, mn, group_size)


def group_codes(wf: torch.Tensor, s: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Nearest codes 0..15 of groups wf [R, G] for fp16-valued scales / mins [R] (a zero scale: 0)."""
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round((wf - m.unsqueeze(-1)) / safe.unsqueeze(-1)).clamp_(0, 15)
    return torch.where((s > 0).unsqueeze(-1), q, torch.zeros_like(q))


def _group_sq_err(wf, s, m):
    """(codes, squared error per group) of groups wf [R, G] against fp16 scales / mins [R]."""
    q = group_codes(wf, s, m)
    return q, (q * s.unsqueeze(-1) + m.unsqueeze(-1) - wf).square_().sum(-1)


# shrink factors of the group's range tried at each end by the searched fit: 0 is plain RTN
SEARCH_SHRINK = tuple(i / 40 for i in range(9))  # 0, 0.025, ..., 0.2
SEARCH_LSQ_STEPS = 3


def fit_groups_searched(wf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, min) as fp16 [R] for groups wf [R, G] (fp32) minimising each group's squared error.

    Candidates: the range [lo, hi] shrunk by SEARCH_SHRINK at either end (a 9 x 9 grid; (0, 0) is
    round-to-nearest's fit), then SEARCH_LSQ_STEPS alternating steps from the best one (codes for
    the current scale/min, then scale/min by least squares for those codes). Every candidate is
    rounded to fp16 and scored with the codes it gets, and a group keeps its best: never worse than
    round-to-nearest, group by group.
    """
    g = wf.shape[-1]
    lo, hi = wf.amin(-1), wf.amax(-1)
    rng = hi - lo
    best_s = best_m = best_e = None
    for a in SEARCH_SHRINK:
        for b in SEARCH_SHRINK:
            l, h = lo + a * rng, hi - b * rng
            s, m = ((h - l) / 15.0).half().float(), l.half().float()
            e = _group_sq_err(wf, s, m)[1]
            if best_e is None:
                best_s, best_m, best_e = s, m, e
            else:
                better = e < best_e
                best_s, best_m = torch.where(better, s, best_s), torch.where(better, m, best_m)
                best_e = torch.minimum(e, best_e)
    for _ in range(SEARCH_LSQ_STEPS):
        q = group_codes(wf, best_s, best_m)
        sq, sqq = q.sum(-1), (q * q).sum(-1)
        sw, sqw = wf.sum(-1), (q * wf).sum(-1)
        det = g * sqq - sq * sq  # > 0 unless every code is the same
        ok = det > 0
        s = torch.where(ok, (g * sqw - sq * sw) / torch.where(ok, det, torch.ones_like(det)), best_s)
        s = s.clamp_min(0.0)
        m = torch.where(ok, (sw - s * sq) / g, best_m)
        s, m = s.half().float(), m.half().float()
        e = _group_sq_err(wf, s, m)[1]
        better = (e < best_e) & torch.isfinite(e)
        best_s, best_m = torch.where(better, s, best_s), torch.where(better, m, best_m)
        best_e = torch.where(better, e, best_e)
    return best_s.half(), best_m.half()


def quantize_int4_searched(w: torch.Tensor, group_size: int = 128, name: str = "weight",
                           chunk_rows: int = 4096) -> Int4Weight:
    """int4 in the same layout as quantize_int4, each group's (scale, min) searched to minimise
    its squared error (fit_groups_searched) instead of taken from its min and max.

    Every backend runs the result unchanged. On SmolLM2's LM head (G = 32) it lowers the squared
    error of the head's weights by about a fifth (docs/eval.md). Rows are fitted in chunks of
    ``chunk_rows`` to bound the memory of the candidate search.
    """
    if w.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D weight, got shape {tuple(w.shape)}")
    n, k = w.shape
    check_shape(name, n, k, group_size)
    codes, scales, mins = [], [], []
    for r in range(0, n, chunk_rows):
        wf = w[r:r + chunk_rows].detach().to(torch.float32).reshape(-1, group_size)
        s, m = fit_groups_searched(wf)
        rows = wf.shape[0] * group_size // k
        codes.append(group_codes(wf, s.float(), m.float()).to(torch.uint8).view(rows, k))
        scales.append(s.view(rows, k // group_size))
        mins.append(m.view(rows, k // group_size))
    return Int4Weight(pack_int4(torch.cat(codes)), torch.cat(scales), torch.cat(mins), group_size)


# ---------------------------------------------------------------- GGUF block formats (exact)

def from_q4_1_blocks(raw, n: int, k: int) -> Int4Weight:
    """GGUF Q4_1 raw bytes [n, k/32*20] -> Int4Weight (G = 32), no re-rounding."""
    import numpy as np

    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // 32, 20)
    d = b[..., 0:2].copy().view(np.float16)[..., 0]
    m = b[..., 2:4].copy().view(np.float16)[..., 0]
    qs = b[..., 4:20]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)
    return Int4Weight(pack_int4(torch.from_numpy(codes)), torch.from_numpy(d.copy()),
                      torch.from_numpy(m.copy()), 32)


def from_q4_0_blocks(raw, n: int, k: int) -> Int4Weight:
    """GGUF Q4_0 raw bytes [n, k/32*18] -> Int4Weight (G = 32): value = (q - 8) d = q d + (-8 d)."""
    import numpy as np

    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // 32, 18)
    d = b[..., 0:2].copy().view(np.float16)[..., 0]
    qs = b[..., 2:18]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)
    m = (d.astype(np.float32) * -8.0).astype(np.float16)
    return Int4Weight(pack_int4(torch.from_numpy(codes)), torch.from_numpy(d.copy()),
                      torch.from_numpy(m), 32)


def dequant_q8_0_blocks(raw, n: int, k: int) -> torch.Tensor:
    """GGUF Q8_0 raw bytes [n, k/32*34] -> float32 [n, k] (exact)."""
    import numpy as np

    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // 32, 34)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = b[..., 2:34].copy().view(np.int8).astype(np.float32)
    return torch.from_numpy((q * d[..., None]).reshape(n, k))


# GGUF K-quants: super-blocks of 256 values along K. Every function returns exactly the float32
# values gguf.quants.dequantize computes (the same products, in the same order, each rounded once).

QK_K = 256
KQUANT_BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def _kquant_blocks(raw, n: int, k: int, kind: str):
    import numpy as np

    size = KQUANT_BLOCK_BYTES[kind]
    if k % QK_K:
        raise ValueError(f"{kind}: row length {k} is not a multiple of {QK_K}")
    b = np.ascontiguousarray(raw, dtype=np.uint8)
    if b.size != n * (k // QK_K) * size:
        raise ValueError(f"{kind}: {b.size} bytes for a [{n}, {k}] tensor, expected "
                         f"{n * (k // QK_K) * size}")
    return b.reshape(n * (k // QK_K), size)


def _f16(b):
    import numpy as np

    return b.copy().view(np.float16)[..., 0].astype(np.float32)


def _kquant_scales_mins(s12):
    """12 packed bytes -> (scales, mins), 8 six-bit values each, as float32 [blocks, 8].

    Sub-blocks 0..3 keep their 6 bits in the low bits of bytes 0..3 (scales) and 4..7 (mins);
    sub-blocks 4..7 take their low 4 bits from bytes 8..11 (scale low nibble, min high nibble)
    and their top 2 bits from the top of bytes 0..3 (scales) and 4..7 (mins).
    """
    import numpy as np

    lo_s, lo_m, mix = s12[:, 0:4], s12[:, 4:8], s12[:, 8:12]
    sc = np.concatenate([lo_s & 0x3F, (mix & 0x0F) | ((lo_s >> 6) << 4)], axis=1)
    mn = np.concatenate([lo_m & 0x3F, (mix >> 4) | ((lo_m >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q4_k_parts(b):
    """Q4_K blocks [B, 144] -> (d * sc [B, 8], dmin * m [B, 8], codes uint8 [B, 8, 32])."""
    import numpy as np

    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _kquant_scales_mins(b[:, 4:16])
    # 4 runs of 32 bytes; run r holds sub-block 2r in its low nibbles and 2r + 1 in its high ones
    qs = b[:, 16:144].reshape(-1, 4, 1, 32)
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)
    return d[:, None] * sc, dmin[:, None] * mn, codes


def dequant_q4_k_blocks(raw, n: int, k: int) -> torch.Tensor:
    """GGUF Q4_K raw bytes -> float32 [n, k] (exact): w = (d sc_j) q - (dmin m_j) per 32."""
    b = _kquant_blocks(raw, n, k, "Q4_K")
    scale, dm, codes = _q4_k_parts(b)
    w = scale[..., None] * codes.astype("float32") - dm[..., None]
    return torch.from_numpy(w.reshape(n, k))


def dequant_q5_k_blocks(raw, n: int, k: int) -> torch.Tensor:
    """GGUF Q5_K raw bytes -> float32 [n, k] (exact): Q4_K's layout plus a fifth bit per value."""
    import numpy as np

    b = _kquant_blocks(raw, n, k, "Q5_K")
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _kquant_scales_mins(b[:, 4:16])
    # bit j of byte i of the 32 high-bit bytes is the fifth bit of value i of sub-block j
    qh = (b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    qs = b[:, 48:176].reshape(-1, 4, 1, 32)
    lo = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)
    q = (lo | (qh << 4)).astype(np.float32)
    w = (d[:, None] * sc)[..., None] * q - (dmin[:, None] * mn)[..., None]
    return torch.from_numpy(w.reshape(n, k))


def dequant_q6_k_blocks(raw, n: int, k: int) -> torch.Tensor:
    """GGUF Q6_K raw bytes -> float32 [n, k] (exact): w = (d s_j) (q - 32), 16 sub-blocks of 16."""
    import numpy as np

    b = _kquant_blocks(raw, n, k, "Q6_K")
    # two halves of 128 values: 64 bytes of low nibbles (values 0..63 low, 64..127 high) and 32
    # bytes of 2-bit pairs (value 32 s + i in bits 2s..2s+1 of byte i)
    ql = b[:, 0:128].reshape(-1, 2, 1, 64)
    lo = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(-1, 2, 128)
    qh = (b[:, 128:192].reshape(-1, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
    q = (lo | (qh.reshape(-1, 2, 128) << 4)).astype(np.int8) - np.int8(32)
    s = b[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(b[:, 208:210])
    w = (d[:, None] * s)[..., None] * q.reshape(-1, 16, 16).astype(np.float32)
    return torch.from_numpy(w.reshape(n, k))


def from_q4_k_blocks(raw, n: int, k: int) -> Int4Weight | None:
    """GGUF Q4_K raw bytes -> int4 G = 32 with the file's codes: each sub-block of 32 is a group
    with scale = d sc_j and min = -dmin m_j.

    An Int4Weight where fp16 holds every product exactly, else an ExactInt4Weight (fp16 fields
    rounded once for the kernels, the float32 products for dequantize: gguf's values bit for bit).
    None when a product overflows fp16 (|d sc| or |dmin m| > 65504): the caller keeps the float.
    """
    import numpy as np

    b = _kquant_blocks(raw, n, k, "Q4_K")
    scale, dm, codes = _q4_k_parts(b)
    mn = -dm
    with np.errstate(over="ignore", invalid="ignore"):
        s16, m16 = scale.astype(np.float16), mn.astype(np.float16)
    if not (np.isfinite(s16).all() and np.isfinite(m16).all()):
        return None
    g = k // 32

    def exact(x16, x32):
        return None if np.array_equal(x16.astype(np.float32), x32) else torch.from_numpy(x32.reshape(n, g))

    parts = (pack_int4(torch.from_numpy(codes.reshape(n, k))), torch.from_numpy(s16.reshape(n, g)),
             torch.from_numpy(m16.reshape(n, g)), 32)
    es, em = exact(s16, scale), exact(m16, mn)
    if es is None and em is None:
        return Int4Weight(*parts)
    return ExactInt4Weight(*parts, exact_scales=es, exact_mins=em)


def quantize_params(params: dict, group_size: int = 128, names=None, log=print) -> dict:
    """Return a params dict whose linear weights (and the LM head) are all Int4Weight.

    Weights already in int4 (GGUF Q4_0/Q4_1/Q4_K, a flint checkpoint) are kept as they are; float
    ones are quantized round-to-nearest at ``group_size`` (layer weights next to int4 ones at the
    smallest group size among those, and ``log`` says so when that is not ``group_size``). "embed"
    (the lookup's copy) is left as it is: float, or int4 from a checkpoint written with
    ``flint quantize --embed int4``.
    """
    out = dict(params)
    linear = [k for k in params if k.rsplit(".", 1)[-1] in LINEAR_NAMES]
    targets = names or linear + ["lm_head"]
    # a file mixing int4 and float layer weights (Q4_K with Q6_K attn_v / ffn_down): the float
    # ones take the int4 ones' group size, as the megakernel fuses and stacks them across layers
    have = [params[k].group_size for k in linear if isinstance(params[k], Int4Weight)]
    layer_g = min([group_size, *have])
    floats = [k for k in targets if k in linear and not isinstance(params[k], Int4Weight)]
    if floats and layer_g != group_size:
        log(f"flint: {len(floats)} layer weights not stored as int4 (e.g. {floats[0]!r}) quantized at "
            f"g{layer_g}, not at the requested group size {group_size}: the model's int4 layer weights "
            f"are g{layer_g} (their codes are kept), and the megakernel runs each projection of every "
            f"layer at one group size", file=sys.stderr)
    for k in targets:
        w = params[k]
        if not isinstance(w, Int4Weight):
            # the largest group <= the preferred one dividing K (SmolLM2's K = 576 takes 64)
            g = layer_g if k in linear else group_size
            out[k] = quantize_int4(w, fit_group_size(w.shape[1], g, k), name=k)
    return out


# ---------------------------------------------------------------- helpers (fusing, re-fitting, group sizes)

def concat_rows(weights: list[Int4Weight], name: str = "weight") -> Int4Weight:
    """Stack int4 weights along N (fused q|k|v, gate|up). Exact: rows are independent.

    All parts must share K and the group size (the layout has one group size per tensor).
    """
    g = weights[0].group_size
    k = weights[0].shape[1]
    for w in weights:
        if w.group_size != g or w.shape[1] != k:
            raise ValueError(f"{name}: cannot fuse int4 parts with group sizes "
                             f"{[x.group_size for x in weights]} and K {[x.shape[1] for x in weights]}")
    return Int4Weight(torch.cat([w.qweight for w in weights]), torch.cat([w.scales for w in weights]),
                      torch.cat([w.mins for w in weights]), g)


def requantize_params(params: dict, group_size: int, float_head: bool = False, head: str = "rtn") -> dict:
    """Every linear weight and the LM head re-fitted at ``group_size``, round-to-nearest.

    Unlike quantize_params, int4 weights are NOT kept: they are dequantized (exactly, to fp32)
    and quantized again, a second rounding. That is what `flint eval --quantize` measures. Where
    ``group_size`` does not divide a tensor's K, the largest group size that does is used
    (fit_group_size). With ``float_head`` (or ``head="float"``) the head stays (or becomes) a float
    tensor; ``head="searched"`` fits it with quantize_int4_searched. "embed" (the lookup copy) is
    never touched.
    """
    if head not in ("rtn", "searched", "float"):
        raise ValueError(f"requantize_params: head {head!r} is not one of rtn, searched, float")
    float_head = float_head or head == "float"
    out = dict(params)
    targets = [k for k in params if k.rsplit(".", 1)[-1] in LINEAR_NAMES]
    if not float_head:
        targets.append("lm_head")
    for k in targets:
        w = params[k]
        dense = w.dequantize(torch.float32) if isinstance(w, Int4Weight) else w
        fit = quantize_int4_searched if k == "lm_head" and head == "searched" else quantize_int4
        out[k] = fit(dense, fit_group_size(dense.shape[1], group_size, k), name=k)
    if float_head and isinstance(params["lm_head"], Int4Weight):
        out["lm_head"] = params["lm_head"].dequantize(torch.float32)
    return out


def int8_rows(w: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, int]:
    """(the values of ``w`` [N, K] after symmetric 8-bit quantization per group of ``group_size``
    along K, as float32; the bytes that format takes: one int8 per value, one fp16 scale per group).

    The scale is max|w| / 127 rounded to fp16 (GGUF Q8_0's rule at G = 32). flint's kernels do not
    read an 8-bit head yet: this measures what one would cost and buy (`flint eval ...:int8-head`).
    """
    n, k = w.shape
    check_shape("lm_head", n, k, group_size)
    wf = w.detach().to(torch.float32).view(n, k // group_size, group_size)
    d = (wf.abs().amax(-1) / 127.0).half().float()
    safe = torch.where(d > 0, d, torch.ones_like(d)).unsqueeze(-1)
    q = torch.round(wf / safe).clamp_(-127, 127)
    return (q * d.unsqueeze(-1)).view(n, k), n * k + 2 * n * (k // group_size)


def int4_group_size(params: dict) -> int | None:
    """The group size shared by the int4 weights in ``params``; None when there are none.

    Raises ValueError when they mix group sizes (a flint checkpoint stores one).
    """
    sizes = {w.group_size for w in params.values() if isinstance(w, Int4Weight)}
    if len(sizes) > 1:
        raise ValueError(f"int4 weights mix group sizes {sorted(sizes)}")
    return next(iter(sizes), None)


def fit_group_size(k: int, preferred: int, name: str = "weight") -> int:
    """The largest group size in GROUP_SIZES that is <= ``preferred`` and divides K.

    SmolLM2's K = 576 takes 64, not 128. Raises ValueError when even 32 does not divide K.
    """
    for g in sorted(GROUP_SIZES, reverse=True):
        if g <= preferred and k % g == 0:
            return g
    raise ValueError(f"{name}: no group size <= {preferred} in {GROUP_SIZES} divides in_features K={k}")
