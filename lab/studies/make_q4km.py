"""Write a Q4_K_M-like GGUF of a GGUF model (default: the embedded SmolLM2), to measure what
flint's K-quant load path costs (`flint eval`, docs/eval.md).

    python3 lab/studies/make_q4km.py OUT.gguf [--src PATH] [--check] [--report]

Each matrix is dequantized (gguf.quants.dequantize) and quantized again with the types llama.cpp's
Q4_K_M recipe assigns: Q6_K for the output head (the token embedding when the head is tied) and
for attn_v / ffn_down in the layers where llama.cpp's "use more bits" rule holds (i < n/8,
i >= 7n/8, or (i - n/8) % 3 == 2: 14 of 30 layers), Q4_K for every other matrix. K-quants need
K % 256 == 0; where K does not allow it llama.cpp falls back to Q8_0 (for Q6_K) and Q5_0 (for
Q4_K). Q8_0 is written here (gguf.quants.quantize); Q5_0 is not (flint does not read it), so those
matrices keep the source's own blocks and are listed as such. For SmolLM2 (K = 576 except
ffn_down's 1536) this means: ffn_down is the only K-quant tensor (16 Q4_K, 14 Q6_K), the tied
embedding and 14 attn_v are Q8_0, the rest keep the source's Q4_1. Metadata and tokenizer are
copied; general.file_type is set to 15 (Q4_K_M).

The Q4_K / Q6_K quantizers are this file's own: per sub-block a least-squares fit of scale (and
min, Q4_K) to the codes, a few rounds; the super-block scales in fp16 and the 6-bit / 8-bit
sub-scales rounded to nearest; the codes chosen against the rounded scales. The block layouts are
those gguf.quants.dequantize reads; tests/test_q4km.py checks the round trip bit for bit.
``--check`` loads the written file with flint and compares every tensor with gguf's dequantize;
``--report`` prints what the int4 backends requantize, at which group size, and its error (and
the kernel-side error of the kept Q4_K codes: their fp16 (scale, min)).
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

import gguf
import numpy as np

QT = gguf.GGMLQuantizationType
QK = 256


def _f16(x) -> np.ndarray:
    return np.asarray(x, np.float32).astype(np.float16)


def _fit_scale_min(x: np.ndarray, levels: int, rounds: int = 4):
    """Per row of x [R, G]: (scale >= 0, lo <= 0) with x ~ scale * q + lo, q in 0..levels, by
    alternating nearest codes and the least-squares (scale, lo) for those codes. lo <= 0 because
    Q4_K stores the min as dmin * m with m >= 0."""
    lo = np.minimum(x.min(-1), 0.0)
    s = (x.max(-1) - lo) / levels
    for _ in range(rounds):
        safe = np.where(s > 0, s, 1.0)
        q = np.clip(np.rint((x - lo[:, None]) / safe[:, None]), 0, levels)
        n = x.shape[1]
        sq, sx, sqq, sqx = q.sum(-1), x.sum(-1), (q * q).sum(-1), (q * x).sum(-1)
        det = n * sqq - sq * sq
        ok = det > 0
        s_new = np.where(ok, (n * sqx - sq * sx) / np.where(ok, det, 1), s)
        lo_new = np.where(ok, (sx - s_new * sq) / n, lo)
        # keep the constraint: lo > 0 is clipped, and the scale refitted with lo = 0
        pos = lo_new > 0
        s_new = np.where(pos, sqx / np.where(sqq > 0, sqq, 1), s_new)
        lo_new = np.where(pos, 0.0, lo_new)
        s, lo = np.maximum(s_new, 0.0), lo_new
    return s, lo


def quantize_q4_k(x: np.ndarray):
    """float32 [N, K] (K % 256 == 0) -> (Q4_K bytes uint8 [N, K/256*144], the values those bytes
    stand for, float32 [N, K]: (d sc) q - (dmin m), computed in float32 as ggml defines them)."""
    n, k = x.shape
    sub = x.astype(np.float32).reshape(-1, 32)
    s, lo = _fit_scale_min(sub, 15)
    s, mn = s.reshape(-1, 8), (-lo).reshape(-1, 8)
    d = _f16(s.max(-1) / 63).astype(np.float32)
    dmin = _f16(mn.max(-1) / 63).astype(np.float32)
    sc = np.clip(np.rint(s / np.where(d > 0, d, 1)[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(mn / np.where(dmin > 0, dmin, 1)[:, None]), 0, 63).astype(np.uint8)
    S = d[:, None] * sc.astype(np.float32)
    M = dmin[:, None] * m.astype(np.float32)
    xs = sub.reshape(-1, 8, 32)
    q = np.clip(np.rint((xs + M[..., None]) / np.where(S > 0, S, 1)[..., None]), 0, 15)
    q = np.where(S[..., None] > 0, q, 0).astype(np.uint8)
    b = np.zeros((xs.shape[0], 144), np.uint8)
    b[:, 0:2] = _f16(d).view(np.uint8).reshape(-1, 2)
    b[:, 2:4] = _f16(dmin).view(np.uint8).reshape(-1, 2)
    # 6-bit sub-scales / mins: sub-blocks 0..3 in the low 6 bits of bytes 0..3 / 4..7, sub-blocks
    # 4..7 split into a low nibble (bytes 8..11) and two high bits (the top of bytes 0..7)
    b[:, 4:8] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    b[:, 8:12] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    b[:, 12:16] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    qq = q.reshape(-1, 4, 2, 32)  # 32 bytes per pair of sub-blocks: low nibble first
    b[:, 16:] = (qq[:, :, 0] | (qq[:, :, 1] << 4)).reshape(-1, 128)
    vals = (S[..., None] * q.astype(np.float32) - M[..., None]).reshape(n, k)
    return b.reshape(n, -1), vals


def quantize_q6_k(x: np.ndarray):
    """float32 [N, K] (K % 256 == 0) -> (Q6_K bytes uint8 [N, K/256*210], the values they stand
    for: (d sc) (q - 32), float32 [N, K]). Symmetric: codes q - 32 in -32..31, int8 sub-scales
    per 16 values, one fp16 d per 256."""
    n, k = x.shape
    sub = x.astype(np.float32).reshape(-1, 16)
    amax = np.abs(sub).max(-1)
    s = amax / 31.5
    for _ in range(4):  # nearest codes, then the least-squares scale for them
        q = np.clip(np.rint(sub / np.where(s > 0, s, 1)[:, None]), -32, 31)
        qq = (q * q).sum(-1)
        s = np.where(qq > 0, (q * sub).sum(-1) / np.where(qq > 0, qq, 1), 0.0)
    s = s.reshape(-1, 16)
    d = _f16(np.abs(s).max(-1) / 127).astype(np.float32)
    sc = np.clip(np.rint(s / np.where(d > 0, d, 1)[:, None]), -128, 127).astype(np.int8)
    S = d[:, None] * sc.astype(np.float32)
    xs = sub.reshape(-1, 16, 16)
    q = np.clip(np.rint(xs / np.where(S != 0, S, 1)[..., None]), -32, 31)
    q = np.where(S[..., None] != 0, q, 0).astype(np.int8)  # integer codes: no -0.0 from rint
    u = (q + 32).astype(np.uint8).reshape(-1, 2, 128)  # two halves of 128 values
    lo, hi = u & 15, u >> 4
    b = np.zeros((u.shape[0], 210), np.uint8)
    l2 = lo.reshape(-1, 2, 2, 64)  # per half: values 0..63 in the low nibbles, 64..127 in the high
    b[:, 0:128] = (l2[:, :, 0] | (l2[:, :, 1] << 4)).reshape(-1, 128)
    h4 = hi.reshape(-1, 2, 4, 32)  # per half: four runs of 32 values in bit pairs 0, 2, 4, 6
    b[:, 128:192] = (h4[:, :, 0] | (h4[:, :, 1] << 2) | (h4[:, :, 2] << 4) | (h4[:, :, 3] << 6)).reshape(-1, 64)
    b[:, 192:208] = sc.view(np.uint8)
    b[:, 208:210] = _f16(d).view(np.uint8).reshape(-1, 2)
    vals = (S[..., None] * q.astype(np.float32)).reshape(n, k)
    return b.reshape(n, -1), vals


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's rule for the attn_v / ffn_down layers that Q4_K_M gives Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def recipe_type(name: str, n_layers: int, has_output: bool):
    """The type Q4_K_M assigns a matrix (before the K % 256 fallback)."""
    if name == "output.weight" or (name == "token_embd.weight" and not has_output):
        return QT.Q6_K
    if name.startswith("blk.") and name.endswith(("attn_v.weight", "ffn_down.weight")):
        return QT.Q6_K if use_more_bits(int(name.split(".")[1]), n_layers) else QT.Q4_K
    return QT.Q4_K


def _copy_fields(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue  # written by GGUFWriter itself / below
        vtype = f.types[0]
        sub = f.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, f.contents(), vtype, sub)
    writer.add_file_type(15)  # LLAMA_FTYPE_MOSTLY_Q4_K_M


def convert(src: str, dst: str, log=print) -> list[tuple[str, str, str]]:
    """Write ``dst`` from ``src``; returns (tensor, the recipe's type, the type written) per matrix."""
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    n_layers = int(r.fields[f"{arch}.block_count"].contents())
    has_output = any(t.name == "output.weight" for t in r.tensors)
    w = gguf.GGUFWriter(dst, arch)
    _copy_fields(r, w)
    table = []
    for t in r.tensors:
        data = np.asarray(t.data)
        if len(t.shape) == 1:
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)  # norms: as they are
            continue
        want = recipe_type(t.name, n_layers, has_output)
        k = int(t.shape[0])
        x = gguf.quants.dequantize(data, t.tensor_type).astype(np.float32)
        if k % QK == 0:
            raw = (quantize_q6_k if want == QT.Q6_K else quantize_q4_k)(x)[0]
            kind = want
        elif want == QT.Q6_K:  # llama.cpp's fallback for Q6_K where K % 256 != 0
            raw, kind = gguf.quants.quantize(x, QT.Q8_0), QT.Q8_0
        else:  # the fallback would be Q5_0, which flint does not read: the source's blocks stay
            raw, kind = data, t.tensor_type
        w.add_tensor(t.name, raw, raw_dtype=kind)
        table.append((t.name, want.name, kind.name + ("" if kind == want or kind == QT.Q8_0 else " (source)")))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    counts = Counter(k for _, _, k in table)
    log(f"{dst}: {os.path.getsize(dst) / 1e6:.1f} MB; matrices: "
        + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    return table


def check(path: str) -> int:
    """Every tensor flint loads from ``path`` equals gguf's dequantize bit for bit (q/k rows
    un-permuted as flint does); returns how many were compared."""
    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from flint.loading import _GGUF_LAYER, _unpermute_rows, load_model
    from flint.quant.int4 import Int4Weight

    lm = load_model(path)
    top = {"token_embd.weight": "embed", "output_norm.weight": "norm", "output.weight": "lm_head"}
    n = 0
    for t in gguf.GGUFReader(path).tensors:
        want = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
        if t.name in top:
            fl = top[t.name]
        else:
            _, i, rest = t.name.split(".", 2)
            fl = f"layers.{i}.{_GGUF_LAYER[rest]}"
        if fl.endswith((".wq", ".wk")):
            heads = lm.cfg.num_heads if fl.endswith(".wq") else lm.cfg.num_kv_heads
            want = want[_unpermute_rows(want.shape[0], heads).numpy()]
        got = lm.params[fl]
        got = got.dequantize(torch.float32) if isinstance(got, Int4Weight) else got
        if not np.array_equal(got.numpy().view(np.uint32), want.reshape(got.shape).view(np.uint32)):
            raise SystemExit(f"{path}: tensor {t.name!r}: flint's load differs from gguf's dequantize")
        n += 1
    return n


def requant_report(path: str, group_sizes=(32, 128), log=print) -> None:
    """What the int4 backends do to ``path``'s matrices (flint.quant.int4.quantize_params at each
    ``--group-size``): per source type, how many tensors, the group size they get, and the
    relative RMS error of the int4 values the kernels read against the file's, and the largest
    error of one weight in quantization steps (|error| / the group's scale); and the share of Q4_K
    sub-blocks whose (d sc, dmin m) fp16 holds exactly (the others' fp16 pair is rounded once)."""
    from collections import defaultdict

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from flint.loading import _GGUF_LAYER, load_model
    from flint.quant.int4 import ExactInt4Weight, Int4Weight, quantize_params

    r = gguf.GGUFReader(path)
    ours = {v: k for k, v in _GGUF_LAYER.items()}
    types = {t.name: t.tensor_type.name for t in r.tensors}
    lm = load_model(path)

    def source_type(fl):
        if fl == "lm_head":
            return types.get("output.weight", types["token_embd.weight"]) + " head"
        _, i, n = fl.split(".")
        return types[f"blk.{i}.{ours[n]}"]

    for g in group_sizes:
        acc = defaultdict(lambda: [0, 0.0, 0.0, set(), 0.0])
        for k, w in quantize_params(lm.params, g, log=lambda *a, **kw: None).items():
            if k == "embed" or not isinstance(w, Int4Weight):
                continue
            src = lm.params[k]
            kind = source_type(k) + (" (kept as int4)" if w is src else "")
            a = src.dequantize() if isinstance(src, Int4Weight) else src
            kern = w.kernel_view() if isinstance(w, ExactInt4Weight) else w  # what the kernels read
            d = kern.dequantize() - a
            step = kern.scales.float().abs().repeat_interleave(w.group_size, 1)
            row = acc[kind]
            row[0] += 1
            row[1] += float((d ** 2).sum())
            row[2] += float((a ** 2).sum())
            row[3].add(w.group_size)
            row[4] = max(row[4], float((d.abs() / step)[step > 0].max()))
        for kind, (n, se, ss, gs, steps) in sorted(acc.items()):
            log(f"--group-size {g}: {kind}: {n} tensors -> int4 g{'/'.join(map(str, sorted(gs)))}, "
                f"rel. RMS error vs the file {np.sqrt(se / ss):.6f}, max {steps:.4f} steps")
    exact = total = 0
    for t in r.tensors:
        if t.tensor_type == QT.Q4_K:
            b = np.asarray(t.data).reshape(-1, 144)
            d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
            dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
            sc, m = gguf.quants.Q4_K.get_scale_min(b[:, 4:16].copy())
            prods = (d * sc.astype(np.float32), dmin * m.astype(np.float32))
            ok = np.logical_and(*(p.astype(np.float16).astype(np.float32) == p for p in prods))
            exact, total = exact + int(ok.sum()), total + ok.size
    if total:
        log(f"Q4_K sub-blocks whose (d sc, dmin m) fp16 holds exactly: {exact} of {total} ({exact / total:.1%})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the GGUF file to write")
    ap.add_argument("--src", default=None, help="source GGUF (default: the embedded SmolLM2)")
    ap.add_argument("--check", action="store_true", help="load the result with flint and compare "
                    "every tensor with gguf's dequantize")
    ap.add_argument("--report", action="store_true", help="print what the int4 backends requantize "
                    "in the result, at which group size, and its error")
    a = ap.parse_args()
    src = a.src
    if src is None:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        from flint.loading import embedded_gguf_path

        src = str(embedded_gguf_path())
    if not os.path.isfile(src):
        raise SystemExit(f"--src {src}: no such file")
    groups: dict[tuple[str, str], Counter] = {}
    for name, want, kind in convert(src, a.out):
        short = name.split(".", 2)[-1] if name.startswith("blk.") else name
        groups.setdefault((want, kind), Counter())[short.removesuffix(".weight")] += 1
    for (want, kind), names in sorted(groups.items()):
        print(f"  recipe {want}, written {kind}: " + ", ".join(f"{k} x{v}" for k, v in sorted(names.items())))
    if a.check:
        print(f"--check: {check(a.out)} tensors equal gguf's dequantize bit for bit")
    if a.report:
        requant_report(a.out)


if __name__ == "__main__":
    main()
