"""GPTQ, AWQ and compressed-tensors int4 checkpoints, read straight into flint-int4-v1.

flint.loading.load_hf_dir hands a Hugging Face directory whose config.json has a
``quantization_config`` with one of these methods to ``parse_config`` (the fields) and ``decode``
(the tensors). Test: ``pytest tests/test_hfquant.py``; the fp16-min measurement:
``python3 lab/studies/hfquant_mins.py``.

The formats (per linear module ``P``, weight W [N, K] = [out_features, in_features]):

* GPTQ (``quant_method: gptq``; AutoGPTQ, GPTQModel): ``P.qweight`` int32 [K/8, N], the code of
  input k = 8i + j in bits 4j..4j+3 of row i; ``P.qzeros`` int32 [K/G, N/8], the zero of output
  n = 8c + j in bits 4j of column c; ``P.scales`` [K/G, N]; ``P.g_idx`` int32 [K], each input
  column's group. W[n, k] = s (q - z) with z = stored + 1 for ``checkpoint_format: gptq`` (v1,
  the default) and z = stored for ``gptq_v2``.
* AWQ (``quant_method: awq``, ``version: gemm``; AutoAWQ): ``P.qweight`` int32 [K, N/8] packed
  along N, nibble i of a word holding column ``AWQ_ORDER[i]`` of its 8; ``P.qzeros`` int32
  [K/G, N/8] packed the same way; ``P.scales`` [K/G, N]; W = s (q - z), no offset.
* compressed-tensors (``quant_method: compressed-tensors``, format ``pack-quantized``, int
  weights, strategy group or channel): ``P.weight_packed`` int32 [N, K/8], k = 8c + i in bits 4i
  of word c, each value stored + 8; ``P.weight_scale`` [N, K/G]; ``P.weight_zero_point`` int32
  [N/8, K/G] packed along N, also + 8 (asymmetric only; symmetric means zero point 0; an
  unpacked int8 [N, K/G] one is read too, and for a symmetric scheme must be all 0);
  ``P.weight_shape`` [2] = [N, K]. W = s (q - zp).

Into the layout: every format's stored nibble already is flint's code (compressed-tensors' signed
value + 8 is its stored nibble), and with u the zero in the same unsigned terms (GPTQ's z, AWQ's
z, compressed-tensors' zp + 8) W = code s - u s: scales = s and mins = -u s. GPTQ's and
compressed-tensors' code bytes are flint's qweight bytes as they are (little-endian words, code
2j in the low nibble of byte j); AWQ's are unshuffled. Codes and scales are never rounded. A
scale fp16 cannot hold exactly (a bf16 or fp32 one out of fp16's range or precision) makes that
tensor load as float32, the format's values exactly; the int4 backends then requantize it, and
the load says so, as for GGUF Q5_K / Q6_K.

mins: -u s is exact in float32 (at most 15 significant bits) but fp16 keeps 11. For u in
{0, 1, 2, 4, 8, 16} (every symmetric checkpoint: u = 8) it is always exact, for other u only when
the low bits of s allow. A tensor with any inexact min becomes an ``ExactInt4Weight``
(flint.quant.int4; ``ExactMinInt4Weight`` here) with exact scales: its fp16
``mins`` (what the kernels read) are -u s rounded once to fp16, and its ``dequantize`` (what the
reference backend runs) uses the exact float32 -u s, i.e. the format's own values. On the int4
kernels a weight then differs from the format's by at most half an fp16 ulp of its min, at most
s/128 (1/128 of the quantization step): the codes are not rounded again. On a simulated
asymmetric tensor 52-57% of the groups' mins (G = 128..32) are inexact in fp16, off by at most
0.0056 s (bench/results/hfquant_mins_2026-12-02.md).

Group sizes: flint-int4-v1 has G in {32, 64, 128}. A larger source group (256, or per-channel:
GPTQ ``group_size: -1``, compressed-tensors strategy channel) is expressed exactly by repeating
its scale and zero over the layout groups inside it. The model gets one G (the megakernel stacks
projections): the largest of 32 / 64 / 128 dividing every quantized tensor's source group.

Act-order (GPTQ ``desc_act: true``, compressed-tensors ``actorder: group``): the file's g_idx is
accepted when it is the plain grouping k // G (static groups). A permuted g_idx is refused: the
layout's groups are consecutive columns, so the only exact way in is to permute the input columns
and fold the permutation into whatever produces the input. For down_proj that is possible (permute
gate/up rows), but q/k/v and gate/up read the residual stream every layer shares, so a real
act-order checkpoint (all projections permuted) cannot be loaded without a second rounding.

Refused with a LoadError naming the field or tensor: bits other than 4, other packings (GPTQ
marlin / bitblas formats, AWQ gemv / llm-awq, compressed-tensors formats other than
pack-quantized), strategies other than group / channel, quantized activations or KV cache,
sparsity or transforms, per-module overrides (GPTQ ``dynamic``) and config groups that differ,
missing or misshapen tensors, source groups that no layout group divides.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from ..params import LoadError
from .int4 import GROUP_SIZES, ExactInt4Weight, Int4Weight, check_shape, pack_int4, unpack_int4

METHODS = ("gptq", "awq", "compressed-tensors")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_ORDER[i] of its 8
_AWQ_UNSHUFFLE = tuple(AWQ_ORDER.index(j) for j in range(8))  # column j sits in nibble this
_FLOATS = ("F32", "F16", "BF16")
# the tensor suffixes each method writes per linear module, and the dtypes they need
_SUFFIXES = {
    "gptq": {"qweight": ("I32",), "qzeros": ("I32",), "scales": _FLOATS, "g_idx": ("I32",)},
    "awq": {"qweight": ("I32",), "qzeros": ("I32",), "scales": _FLOATS},
    "compressed-tensors": {"weight_packed": ("I32",), "weight_scale": _FLOATS,
                           "weight_zero_point": ("I32", "I8"), "weight_shape": ("I64", "I32"),
                           "weight_g_idx": ("I32", "I64")},
}
_CODES = {"gptq": "qweight", "awq": "qweight", "compressed-tensors": "weight_packed"}


# GPTQ / AWQ tensors with inexact fp16 mins: the shared exact-values weight of flint.quant.int4, its
# scales exact (exact_scales None), its mins -u s in float32
ExactMinInt4Weight = ExactInt4Weight


@dataclass
class Spec:
    """A checked quantization_config: what ``decode`` needs."""

    method: str
    group_size: int | None  # the source group along K; None: per channel (one group of K)
    zero_offset: int = 0  # added to GPTQ's stored zeros (1 in the v1 format)
    symmetric: bool = False  # compressed-tensors: no zero-point tensor, zero point 0
    act_order_field: str = ""  # the field that allows a g_idx, for messages
    needs_g_idx: bool = False  # act-order on: a module without its g_idx cannot be checked
    source: str = "config.json"

    def tensor_dtypes(self, name: str, default: tuple) -> tuple:
        """The safetensors dtypes tensor ``name`` may have (flint.loading checks headers with it)."""
        suffix = name.rsplit(".", 1)[-1]
        return _SUFFIXES[self.method].get(suffix, default)


# ------------------------------------------------------------------ config

def _flag(qc: dict, path: str, name: str, default: bool = False) -> bool:
    v = qc.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise LoadError(f"{path}: field 'quantization_config.{name}'={v!r} must be true or false")
    return v


def _need(ok: bool, path: str, field_name: str, value, why: str) -> None:
    if not ok:
        raise LoadError(f"{path}: field 'quantization_config.{field_name}'={value!r} is not supported: {why}")


def _group(path: str, name: str, g) -> int | None:
    """A source group size: a positive multiple of 8, or -1 / None for per channel."""
    if g is None or g == -1:
        return None
    if type(g) is not int or g <= 0:
        raise LoadError(f"{path}: field 'quantization_config.{name}'={g!r} must be a positive integer or -1")
    if not any(g % lg == 0 for lg in GROUP_SIZES):
        raise LoadError(f"{path}: field 'quantization_config.{name}'={g} is not supported: flint-int4-v1 "
                        f"groups are {'/'.join(map(str, GROUP_SIZES))} values and one of them must divide it")
    return g


def parse_config(qc: dict, path: str) -> Spec:
    """Check a GPTQ / AWQ / compressed-tensors quantization_config; LoadError names the field."""
    method = qc.get("quant_method")
    if method == "gptq":
        return _parse_gptq(qc, path)
    if method == "awq":
        return _parse_awq(qc, path)
    if method == "compressed-tensors":
        return _parse_ct(qc, path)
    raise LoadError(f"{path}: field 'quantization_config.quant_method'={method!r} is not one of {METHODS}")


def _parse_gptq(qc: dict, path: str) -> Spec:
    bits = qc.get("bits")
    _need(type(bits) is int and bits == 4, path, "bits", bits, "flint loads 4-bit GPTQ only")
    fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
    _need(fmt in ("gptq", "gptq_v2"), path, "checkpoint_format", fmt,
          "flint reads the gptq (v1) and gptq_v2 packings")
    pack = qc.get("pack_dtype", "int32")
    _need(pack in ("int32", "torch.int32"), path, "pack_dtype", pack, "flint reads int32 words")
    dyn = qc.get("dynamic")
    _need(not dyn, path, "dynamic", dyn, "per-module overrides make a mixed config; flint needs one")
    _flag(qc, path, "sym", True)
    return Spec("gptq", _group(path, "group_size", qc.get("group_size", -1)),
                zero_offset=1 if fmt == "gptq" else 0, needs_g_idx=_flag(qc, path, "desc_act"),
                act_order_field="quantization_config.desc_act", source=path)


def _parse_awq(qc: dict, path: str) -> Spec:
    bits = qc.get("bits", qc.get("w_bit"))
    _need(bits == 4, path, "bits", bits, "flint loads 4-bit AWQ only")
    version = qc.get("version", "gemm")
    _need(isinstance(version, str) and version.lower() == "gemm", path, "version", version,
          "flint reads AWQ's GEMM packing only")
    backend = qc.get("backend", "autoawq")
    _need(backend == "autoawq", path, "backend", backend, "flint reads AutoAWQ's packing only")
    zp = qc.get("zero_point", True)
    _need(zp is True, path, "zero_point", zp, "AWQ's GEMM packing stores zero points; without them "
          "the format is undocumented")
    g = qc.get("group_size", qc.get("q_group_size"))
    if g is None:
        raise LoadError(f"{path}: field 'quantization_config.group_size' is missing")
    return Spec("awq", _group(path, "group_size", g), source=path)


def _parse_ct(qc: dict, path: str) -> Spec:
    fmt = qc.get("format")
    _need(fmt == "pack-quantized", path, "format", fmt, "flint reads compressed-tensors' "
          "pack-quantized int4 only")
    status = qc.get("quantization_status", "compressed")
    _need(status == "compressed", path, "quantization_status", status,
          "the weights must be stored compressed (packed codes)")
    for f in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        v = qc.get(f)
        dense = isinstance(v, dict) and v.get("format") == "dense" and f == "sparsity_config"
        _need(not v or dense, path, f, v, "flint runs unquantized KV caches, dense weights and no transforms")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise LoadError(f"{path}: field 'quantization_config.config_groups' must be a non-empty object")
    weights = None
    for name, grp in groups.items():
        where = f"config_groups.{name}"
        if not isinstance(grp, dict) or not isinstance(grp.get("weights"), dict):
            raise LoadError(f"{path}: field 'quantization_config.{where}.weights' must be an object")
        for f in ("input_activations", "output_activations"):
            _need(grp.get(f) is None, path, f"{where}.{f}", grp.get(f),
                  "flint runs weight-only quantization (activations in float)")
        gf = grp.get("format", fmt)
        _need(gf in (None, "pack-quantized"), path, f"{where}.format", gf, "pack-quantized only")
        w = {k: v for k, v in grp["weights"].items() if k not in ("observer", "observer_kwargs")}
        if weights is not None and w != weights[1]:
            raise LoadError(f"{path}: field 'quantization_config.config_groups': groups {weights[0]!r} and "
                            f"{name!r} quantize weights differently (a mixed config); flint needs one scheme")
        weights = weights or (name, w)
    where, w = f"config_groups.{weights[0]}.weights", weights[1]
    _need(w.get("num_bits") == 4, path, f"{where}.num_bits", w.get("num_bits"), "flint loads 4-bit weights only")
    _need(w.get("type", "int") == "int", path, f"{where}.type", w.get("type"), "integer codes only")
    strategy = w.get("strategy")
    _need(strategy in ("group", "channel"), path, f"{where}.strategy", strategy,
          "flint-int4-v1 holds group and per-channel scales only")
    _need(not w.get("dynamic"), path, f"{where}.dynamic", w.get("dynamic"), "static scales only")
    _need(w.get("block_structure") is None, path, f"{where}.block_structure", w.get("block_structure"),
          "no block scales")
    sym = w.get("symmetric", True)
    _need(isinstance(sym, bool), path, f"{where}.symmetric", sym, "must be true or false")
    g = _group(path, f"{where}.group_size", w.get("group_size")) if strategy == "group" else None
    if strategy == "group" and g is None:
        raise LoadError(f"{path}: field 'quantization_config.{where}.group_size' must be a positive "
                        "integer for strategy group")
    order = w.get("actorder")
    _need(order in (None, "weight", "static", "group", "dynamic"), path, f"{where}.actorder", order,
          "unknown activation ordering")
    return Spec("compressed-tensors", g, symmetric=sym, needs_g_idx=order in ("group", "dynamic"),
                act_order_field=f"quantization_config.{where}.actorder", source=path)


# ------------------------------------------------------------------ tensors

def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> uint8 [..., 8 W]: value 8c + i from bits 4i..4i+3 of word c."""
    b = words.contiguous().view(torch.uint8)  # little-endian: byte j holds values 2j, 2j + 1
    return torch.stack((b & 0x0F, b >> 4), dim=-1).flatten(-2)


def _take(flat: dict, prefix: str, suffix: str, source: str, method: str, required=True):
    t = flat.pop(f"{prefix}.{suffix}", None)
    if t is None and required:
        need = ", ".join(s for s in _SUFFIXES[method] if s not in ("g_idx", "weight_zero_point", "weight_g_idx"))
        raise LoadError(f"{source}: tensor '{prefix}.{suffix}' is missing ({method} stores {need} per layer)")
    return t


def _shape(t: torch.Tensor, want: tuple, name: str, source: str) -> None:
    if tuple(t.shape) != tuple(want):
        raise LoadError(f"{source}: tensor {name!r} has shape {list(t.shape)}, expected {list(want)}")


@dataclass
class _Parts:
    """One module in common terms: codes as flint qweight bytes, per-source-group s and u."""

    qweight: torch.Tensor  # uint8 [N, K // 2]
    scales: torch.Tensor  # [N, K // Gs], the file's dtype
    zeros: torch.Tensor  # int [N, K // Gs], unsigned terms (0..16)
    group: int  # Gs


def _groups(k: int, g: int | None, prefix: str, source: str) -> int:
    g = k if g is None else g
    if k % g:
        raise LoadError(f"{source}: '{prefix}': in_features K={k} is not a multiple of the group size {g}")
    return g


def _check_g_idx(g_idx, k: int, g: int, name: str, spec: Spec, source: str) -> None:
    if g_idx is None:
        if spec.needs_g_idx:
            raise LoadError(f"{source}: tensor {name!r} is missing, and {spec.act_order_field} turns "
                            "act-order on: the grouping of the input columns is unknown")
        return
    _shape(g_idx, (k,), name, source)
    if not torch.equal(g_idx.to(torch.int64), torch.arange(k) // g):
        raise LoadError(f"{source}: tensor {name!r} permutes the input columns (act-order, "
                        f"{spec.act_order_field}): flint-int4-v1 groups consecutive columns and the "
                        "permutation cannot be folded exactly into the residual stream that q/k/v and "
                        "gate/up read; use a checkpoint quantized without act-order, or with static groups")


def _gptq(flat: dict, prefix: str, spec: Spec, source: str) -> _Parts:
    qw = _take(flat, prefix, "qweight", source, "gptq")
    qz = _take(flat, prefix, "qzeros", source, "gptq")
    sc = _take(flat, prefix, "scales", source, "gptq")
    g_idx = _take(flat, prefix, "g_idx", source, "gptq", required=False)
    if qw.dim() != 2:
        raise LoadError(f"{source}: tensor '{prefix}.qweight' has shape {list(qw.shape)}, expected [K/8, N]")
    k, n = qw.shape[0] * 8, qw.shape[1]
    if n % 8:
        raise LoadError(f"{source}: tensor '{prefix}.qweight': out_features N={n} is not a multiple of 8")
    g = _groups(k, spec.group_size, prefix, source)
    _shape(qz, (k // g, n // 8), f"{prefix}.qzeros", source)
    _shape(sc, (k // g, n), f"{prefix}.scales", source)
    _check_g_idx(g_idx, k, g, f"{prefix}.g_idx", spec, source)
    zeros = _nibbles(qz).T.to(torch.int32) + spec.zero_offset
    return _Parts(qw.T.contiguous().view(torch.uint8), sc.T, zeros, g)


def _awq(flat: dict, prefix: str, spec: Spec, source: str) -> _Parts:
    qw = _take(flat, prefix, "qweight", source, "awq")
    qz = _take(flat, prefix, "qzeros", source, "awq")
    sc = _take(flat, prefix, "scales", source, "awq")
    if qw.dim() != 2:
        raise LoadError(f"{source}: tensor '{prefix}.qweight' has shape {list(qw.shape)}, expected [K, N/8]")
    k, n = qw.shape[0], qw.shape[1] * 8
    g = _groups(k, spec.group_size, prefix, source)
    _shape(qz, (k // g, n // 8), f"{prefix}.qzeros", source)
    _shape(sc, (k // g, n), f"{prefix}.scales", source)
    unshuffle = list(_AWQ_UNSHUFFLE)

    def columns(words):  # [R, N/8] words -> [R, N] values in column order
        v = _nibbles(words)
        return v.view(v.shape[0], -1, 8)[:, :, unshuffle].reshape(v.shape[0], -1)

    codes = columns(qw).T  # [N, K]
    return _Parts(pack_int4(codes.contiguous()), sc.T, columns(qz).T.to(torch.int32), g)


def _ct(flat: dict, prefix: str, spec: Spec, source: str) -> _Parts:
    packed = _take(flat, prefix, "weight_packed", source, "compressed-tensors")
    sc = _take(flat, prefix, "weight_scale", source, "compressed-tensors")
    shape = _take(flat, prefix, "weight_shape", source, "compressed-tensors")
    zp = _take(flat, prefix, "weight_zero_point", source, "compressed-tensors", required=not spec.symmetric)
    g_idx = _take(flat, prefix, "weight_g_idx", source, "compressed-tensors", required=False)
    if shape.numel() != 2:
        raise LoadError(f"{source}: tensor '{prefix}.weight_shape' must hold [N, K], got {shape.tolist()}")
    n, k = (int(x) for x in shape.tolist())
    if n <= 0 or k <= 0 or k % 8:
        raise LoadError(f"{source}: tensor '{prefix}.weight_shape'={[n, k]}: K must be a positive "
                        "multiple of 8 (whole int32 words)")
    g = _groups(k, spec.group_size, prefix, source)
    _shape(packed, (n, k // 8), f"{prefix}.weight_packed", source)
    _shape(sc, (n, k // g), f"{prefix}.weight_scale", source)
    if zp is None:  # symmetric: zero point 0
        zeros = torch.full((n, k // g), 8, dtype=torch.int32)
    elif zp.dtype == torch.int8:  # unpacked signed zero points, as the library dequantizes with
        _shape(zp, (n, k // g), f"{prefix}.weight_zero_point", source)
        zeros = zp.to(torch.int32) + 8
    else:
        _shape(zp, ((n + 7) // 8, k // g), f"{prefix}.weight_zero_point", source)
        zeros = _nibbles(zp.T)[:, :n].T.to(torch.int32)  # packed along N: words of 8 rows, + 8
    if spec.symmetric and not bool((zeros == 8).all()):
        raise LoadError(f"{source}: tensor '{prefix}.weight_zero_point' has nonzero zero points, but "
                        "the config says symmetric")
    if not bool(((zeros >= 0) & (zeros <= 15)).all()):
        raise LoadError(f"{source}: tensor '{prefix}.weight_zero_point' holds values outside int4's -8..7")
    _check_g_idx(g_idx, k, g, f"{prefix}.weight_g_idx", spec, source)
    return _Parts(packed.contiguous().view(torch.uint8), sc, zeros, g)


_DECODERS = {"gptq": _gptq, "awq": _awq, "compressed-tensors": _ct}


def _layout_weight(p: _Parts, g: int, name: str, source: str):
    """The module in flint-int4-v1 at group size g (dividing p.group), or the format's float32
    values when fp16 cannot hold its scales."""
    n, k = p.qweight.shape[0], p.qweight.shape[1] * 2
    try:
        check_shape(name, n, k, g)
    except ValueError as e:
        raise LoadError(f"{source}: {e}") from None
    s32 = p.scales.to(torch.float32)
    if not torch.isfinite(s32).all():
        raise LoadError(f"{source}: tensor '{name}': a scale is not finite")
    rep = p.group // g
    s32 = s32.repeat_interleave(rep, dim=1)
    exact_min = -(p.zeros.repeat_interleave(rep, dim=1).to(torch.float32) * s32)  # exact in fp32
    s16 = s32.to(torch.float16)
    if not torch.equal(s16.to(torch.float32), s32):
        # the format's (q - u) s, one rounding as the format computes it (q s - u s would round twice)
        q = unpack_int4(p.qweight).to(torch.float32).view(n, k // p.group, p.group)
        w = (q - p.zeros.to(torch.float32)[..., None]) * p.scales.to(torch.float32)[..., None]
        return w.view(n, k), "scales"
    m16 = exact_min.to(torch.float16)
    if not torch.isfinite(m16).all():
        raise LoadError(f"{source}: tensor '{name}': a zero point times its scale overflows fp16")
    if torch.equal(m16.to(torch.float32), exact_min):
        return Int4Weight(p.qweight.contiguous(), s16, m16, g), None
    return ExactInt4Weight(p.qweight.contiguous(), s16, m16, g, exact_mins=exact_min), "mins"


def decode(spec: Spec, flat: dict, source: str, log=print) -> dict:
    """Replace every quantized module's tensors in ``flat`` (the checkpoint's names) by
    ``P.weight``: an Int4Weight (or ExactInt4Weight), or float32 where fp16 cannot hold the
    scales. Other tensors (embeddings, norms, float linears) pass through."""
    if sys.byteorder != "little":  # the int32 words are read as their little-endian bytes
        raise LoadError(f"{source}: {spec.method} int4 words are read on little-endian hosts only")
    code = _CODES[spec.method]
    prefixes = sorted(k[: -len(code) - 1] for k in flat if k.endswith("." + code))
    if not prefixes:
        raise LoadError(f"{source}: no tensor named '*.{code}': the config says {spec.method}, "
                        "but no module is quantized")
    parts = {}
    for p in prefixes:
        if p + ".weight" in flat:
            raise LoadError(f"{source}: module {p!r} has both '{p}.weight' and quantized tensors")
        parts[p] = _DECODERS[spec.method](flat, p, spec, source)
    # one layout group for the model: the largest dividing every source group
    fits = [g for g in GROUP_SIZES if all(x.group % g == 0 for x in parts.values())]
    if not fits:
        sizes = sorted({x.group for x in parts.values()})
        raise LoadError(f"{spec.source}: source group sizes {sizes}: no flint-int4-v1 group size "
                        f"({'/'.join(map(str, GROUP_SIZES))}) divides them all")
    g = max(fits)
    stray = sorted(k for k in flat if k.rsplit(".", 1)[-1] in _SUFFIXES[spec.method])
    if stray:
        raise LoadError(f"{source}: tensor {stray[0]!r} belongs to no quantized module "
                        f"('{stray[0].rsplit('.', 1)[0]}.{code}' is missing)")
    out = dict(flat)
    kept_float = []
    for p, x in parts.items():
        w, note = _layout_weight(x, g, p, source)
        kept_float += [p] if note == "scales" else []
        out[p + ".weight"] = w
    if kept_float:
        log(f"flint: {source}: {len(kept_float)} {spec.method} tensors load as float32 (exact; fp16 "
            f"cannot hold their scales, e.g. {kept_float[0]!r}); the int4 backends requantize them "
            "to int4, a second rounding", file=sys.stderr)
    return out
