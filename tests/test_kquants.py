"""GGUF K-quants (Q4_K, Q5_K, Q6_K) against the gguf package's own dequantize, bit for bit.

* flint.quant.int4's K-quant dequantizers equal gguf.quants.dequantize on blocks built from chosen
  super-block scales and random codes/sub-scales (edge values included: zero, negative and
  subnormal d, the largest 6-bit sub-scales);
* a Q4_K tensor becomes int4 G = 32 with the file's codes: a plain Int4Weight when fp16 holds
  every d * sc and dmin * m (the predicate is computed here from gguf's own sub-scale unpacking),
  else an ExactInt4Weight; either dequantizes to gguf's values bit for bit, and the fp16 fields the
  kernels read are the products rounded once, within flint.quant.int4's stated bound (at most
  15 |ds| + |dm| per weight, |dx| <= max(2^-11 |x|, 2^-25)); a product beyond fp16's range loads
  as float32;
* a tiny model whose matrices are Q4_K / Q5_K / Q6_K loads with every tensor equal to gguf's
  dequantize, the reference backend's logits equal (fp32, exactly) those of the same model built
  from gguf's float weights, and the load says which tensors the int4 backends requantize;
* a K-quant tensor whose type does not match its bytes is refused with a LoadError.

Run: ``pytest tests/test_kquants.py``.
"""
from __future__ import annotations

import re
import struct

import gguf
import numpy as np
import pytest
import torch

from flint.loading import LoadError, load_model
from flint.model import Transformer
from flint.quant.int4 import (ExactInt4Weight, Int4Weight, dequant_q4_k_blocks, dequant_q5_k_blocks, dequant_q6_k_blocks,
                              from_q4_k_blocks, int4_group_size, quantize_params)

QT = gguf.GGMLQuantizationType
BLOCK = {QT.Q4_K: 144, QT.Q5_K: 176, QT.Q6_K: 210}
DEQUANT = {QT.Q4_K: dequant_q4_k_blocks, QT.Q5_K: dequant_q5_k_blocks, QT.Q6_K: dequant_q6_k_blocks}


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return np.atleast_1d(np.asarray(x, dtype=np.float16)).view(np.uint8).reshape(-1, 2)


def kquant_blocks(kind, n: int, k: int, rng, d=None, dmin=None) -> np.ndarray:
    """Random codes and sub-scales with the given fp16 super-block scales: uint8 [n, k/256*size]."""
    nb = n * k // 256
    b = rng.integers(0, 256, size=(nb, BLOCK[kind]), dtype=np.uint8)
    d = rng.standard_normal(nb) * 2e-4 if d is None else d
    if kind == QT.Q6_K:
        b[:, 208:210] = _f16_bytes(d)
    else:
        b[:, 0:2] = _f16_bytes(np.abs(d))
        b[:, 2:4] = _f16_bytes(np.abs(rng.standard_normal(nb) * 2e-4) if dmin is None else dmin)
    return b.reshape(n, -1)


def exact_d(nb: int, rng) -> np.ndarray:
    """fp16 scales of at most 5 significant bits: d * sc (sc < 64) needs at most 11, fp16 has 11."""
    return rng.integers(1, 32, nb) * np.exp2(-rng.integers(16, 19, nb).astype(np.float64))


def fp16_holds_q4_k_scales(raw: np.ndarray) -> bool:
    """From gguf's own unpacking: is every d * sc and dmin * m (fp32) an fp16 value?"""
    b = raw.reshape(-1, 144)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = gguf.quants.Q4_K.get_scale_min(b[:, 4:16].copy())
    prods = np.concatenate([d * sc.astype(np.float32), dmin * m.astype(np.float32)])
    return bool(np.array_equal(prods.astype(np.float16).astype(np.float32), prods))


def same_bits(a: torch.Tensor, b: np.ndarray) -> bool:
    return a.dtype == torch.float32 and np.array_equal(a.numpy().view(np.uint32),
                                                       np.asarray(b, np.float32).view(np.uint32))


@pytest.mark.parametrize("kind", [QT.Q4_K, QT.Q5_K, QT.Q6_K])
def test_dequant_equals_gguf_bit_for_bit(kind):
    rng = np.random.default_rng(int(kind))
    n, k = 8, 1024
    raw = kquant_blocks(kind, n, k, rng)
    # edge blocks: d = 0, negative d, a subnormal d, every sub-scale / min at 63 (bytes 0xFF)
    blocks = raw.reshape(-1, BLOCK[kind])
    off = 208 if kind == QT.Q6_K else 0
    blocks[0, off:off + 2] = _f16_bytes(0.0)
    blocks[1, off:off + 2] = _f16_bytes(-3e-4)
    blocks[2, off:off + 2] = _f16_bytes(3e-7)
    if kind != QT.Q6_K:
        blocks[3, 4:16] = 0xFF
    want = gguf.quants.dequantize(raw, kind)
    got = DEQUANT[kind](raw, n, k)
    assert got.shape == (n, k) and same_bits(got, want), f"{kind.name}: differs from gguf's dequantize"


def q4_k_products(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(d * sc, -(dmin * m)) per sub-block, float32 [blocks * 8], from gguf's own unpacking."""
    b = raw.reshape(-1, 144)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = gguf.quants.Q4_K.get_scale_min(b[:, 4:16].copy())
    return (d * sc.astype(np.float32)).ravel(), -(dmin * m.astype(np.float32)).ravel()


def fp16_half_ulp(x: np.ndarray) -> np.ndarray:
    """The bound on |fp16(x) - x| of rounding to nearest: 2^-11 |x|, or 2^-25 below fp16's normals."""
    return np.maximum(np.abs(x) * 2.0 ** -11, 2.0 ** -25)


def check_kernel_bound(w: Int4Weight, raw: np.ndarray, n: int, k: int) -> float:
    """The fp16 (scale, min) the kernels read: the exact products rounded once to nearest, and every
    kernel-side weight within 15 |ds| + |dm| of gguf's (|dx| <= fp16_half_ulp(x)). Returns the
    largest error in quantization steps over sub-blocks with a normal, nonzero scale."""
    s, m = q4_k_products(raw)
    s16, m16 = w.scales.numpy().ravel(), w.mins.numpy().ravel()
    assert np.array_equal(s16, s.astype(np.float16)) and np.array_equal(m16, m.astype(np.float16))
    ds, dm = np.abs(s16.astype(np.float64) - s), np.abs(m16.astype(np.float64) - m)
    assert np.all(ds <= fp16_half_ulp(s)) and np.all(dm <= fp16_half_ulp(m))
    kernel = (w.kernel_view() if isinstance(w, ExactInt4Weight) else w).dequantize().numpy()
    err = np.abs(kernel.astype(np.float64) - gguf.quants.dequantize(raw, QT.Q4_K)).reshape(-1, 32)
    assert np.all(err.max(-1) <= 15 * ds + dm + 1e-30)
    normal = np.abs(s) >= 2.0 ** -14
    steps = err.max(-1)[normal] / np.abs(s[normal])
    # in steps: (15 + |m| / s) / 2048 for a normal scale
    assert np.all(steps <= (15 + np.abs(m[normal]) / np.abs(s[normal])) * 2.0 ** -11 * (1 + 1e-6))
    return float(steps.max(initial=0.0))


@pytest.mark.parametrize("exact", [True, False])
def test_q4_k_keeps_its_codes(exact):
    rng = np.random.default_rng(7 + exact)
    n, k = 6, 512
    nb = n * k // 256
    raw = (kquant_blocks(QT.Q4_K, n, k, rng, d=exact_d(nb, rng), dmin=exact_d(nb, rng)) if exact
           else kquant_blocks(QT.Q4_K, n, k, rng))
    assert fp16_holds_q4_k_scales(raw) == exact  # the test data is what it is meant to be
    w = from_q4_k_blocks(raw, n, k)
    assert isinstance(w, Int4Weight) and w.group_size == 32 and w.shape == (n, k)
    assert isinstance(w, ExactInt4Weight) != exact
    want = gguf.quants.dequantize(raw, QT.Q4_K)
    assert same_bits(w.dequantize(torch.float32), want)
    # the codes are the file's own: at the exact (scale, min) they give gguf's values
    s, m = q4_k_products(raw)
    q = w.codes().view(n, k // 32, 32).float()
    assert int(w.codes().max()) <= 15
    got = q * torch.from_numpy(s).view(n, -1, 1) + torch.from_numpy(m).view(n, -1, 1)
    assert same_bits(got.view(n, k), want)
    worst = check_kernel_bound(w, raw, n, k)
    assert worst == 0.0 if exact else 0 < worst <= 15 / 1024 + 63 / 2048  # (m <= 63 dmin here)
    # rows() and to() keep the exact values (the loader un-permutes q / k rows with rows())
    idx = torch.tensor([5, 0, 3])
    assert same_bits(w.rows(idx).to("cpu").dequantize(), want[idx.numpy()])


def test_q4_k_kernel_bound_at_the_edges():
    """Extreme super-block scales: subnormal and zero d, sub-scales and mins of 63 with a tiny d
    (|m| >> s), large d; a product beyond fp16's range makes the tensor float (None)."""
    rng = np.random.default_rng(21)
    n, k = 8, 256
    raw = kquant_blocks(QT.Q4_K, n, k, rng)
    b = raw.reshape(-1, 144)
    b[0, 0:2] = _f16_bytes(3e-7)  # subnormal d
    b[1, 0:2] = _f16_bytes(0.0)
    b[2, 4:16] = 0xFF  # every sub-scale and min 63
    b[3, 0:2], b[3, 2:4] = _f16_bytes(1e-5), _f16_bytes(0.5)  # mins far larger than the step
    b[4, 0:2], b[4, 2:4] = _f16_bytes(900.0), _f16_bytes(1000.0)  # 900 * 63 still fits fp16
    w = from_q4_k_blocks(raw, n, k)
    assert isinstance(w, ExactInt4Weight)
    assert same_bits(w.dequantize(), gguf.quants.dequantize(raw, QT.Q4_K))
    check_kernel_bound(w, raw, n, k)
    b[5, 0:2] = _f16_bytes(2000.0)  # 2000 * sc overflows fp16 for sc > 32
    b[5, 4:16] = 0xFF
    assert from_q4_k_blocks(raw, n, k) is None


def test_kquant_wrong_size_is_refused():
    with pytest.raises(ValueError, match="Q6_K"):
        dequant_q6_k_blocks(np.zeros(209, np.uint8), 1, 256)
    with pytest.raises(ValueError, match="multiple of 256"):
        from_q4_k_blocks(np.zeros(144, np.uint8), 2, 128)


def kquant_encoder(seed: int, written: dict):
    """Matrices cycle through fp16-exact Q4_K (an Int4Weight), plain Q4_K (an ExactInt4Weight),
    Q6_K and Q5_K (float); records {HF name: the cycle's label} in ``written``."""
    rng = np.random.default_rng(seed)
    cycle = iter(["Q4_K exact", "Q4_K", "Q6_K", "Q5_K"] * 100)

    def encode(name, x):
        n, k = x.shape
        kind = written[name] = next(cycle)
        if kind == "Q4_K exact":
            nb = n * k // 256
            return kquant_blocks(QT.Q4_K, n, k, rng, d=exact_d(nb, rng), dmin=exact_d(nb, rng)), QT.Q4_K
        return kquant_blocks(QT[kind], n, k, rng), QT[kind]
    return encode


@pytest.fixture(scope="module")
def tiny_kquant(tmp_path_factory):
    from conftest import make_hf_model
    from test_gguf import write_tiny_gguf

    # K = 256 everywhere: hidden 256, 4 heads of 64, ffn 256
    hf = make_hf_model("llama", seed=3, hidden_size=256, intermediate_size=256, head_dim=64)
    path = tmp_path_factory.mktemp("kquant") / "tiny-kquant.gguf"
    written = {}
    expected = write_tiny_gguf(hf, path, encode=kquant_encoder(11, written))
    return path, expected, written


def test_tiny_kquant_model_loads_exactly(tiny_kquant, capfd):
    from test_gguf import hf_to_flint_names

    path, expected, written = tiny_kquant
    lm = load_model(str(path))
    notice = capfd.readouterr().err
    flint_name = hf_to_flint_names(lm.cfg.num_layers)
    int4, floats = 0, {}
    for key, want in expected.items():
        got = lm.params[flint_name[key]]
        int4 += isinstance(got, Int4Weight) and key != "model.embed_tokens.weight"
        got = got.dequantize() if isinstance(got, Int4Weight) else got
        assert same_bits(got, want.numpy()), f"{key}: flint's load differs from gguf's dequantize"
        floats[flint_name[key]] = want
    q4k = [k for k, v in written.items() if v.startswith("Q4_K") and k != "model.embed_tokens.weight"]
    assert int4 == len(q4k) >= 6, "every Q4_K tensor should stay int4 codes"
    assert any(isinstance(lm.params[flint_name[k]], ExactInt4Weight) for k in q4k)
    assert any(isinstance(w, torch.Tensor) and w.dim() == 2 for k, w in lm.params.items() if k != "embed")
    # one line counting what the int4 backends requantize (the untied embedding's float copy is
    # only a lookup table, so it is not counted)
    line = [s for s in notice.splitlines() if "requantize" in s]
    assert not lm.cfg.tie_word_embeddings and len(line) == 1
    floated = [v for k, v in written.items() if not v.startswith("Q4_K") and k != "model.embed_tokens.weight"]
    for kind in ("Q5_K", "Q6_K"):
        assert re.search(rf"\b{floated.count(kind)} {kind}\b", line[0]), line[0]
    assert not re.search(r"\d+ Q4_K\b", line[0]) and "Q4_K tensors keep their 4-bit codes" in line[0]
    # the reference backend's logits equal those of gguf's float weights, exactly
    ids = torch.arange(3, 40)
    got = Transformer(lm.cfg, lm.params, max_seq_len=64).forward(ids, 0)
    want = Transformer(lm.cfg, floats, max_seq_len=64).forward(ids, 0)
    assert torch.isfinite(want).all() and torch.equal(got, want)


def test_tiny_kquant_int4_backends_share_one_layer_group_size(tiny_kquant):
    lm = load_model(str(tiny_kquant[0]))
    said = []
    q = quantize_params(lm.params, 128, log=lambda *a, **k: said.append(a[0]))
    # the float layer weights follow the file's g32, and the call says so
    assert len(said) == 1 and "at g32, not at the requested group size 128" in said[0]
    assert q["lm_head"].group_size == 128  # the head is no layer weight: it takes the requested one
    layers = {k: w for k, w in q.items() if k.startswith("layers.") and isinstance(w, Int4Weight)}
    assert len(layers) == 7 * lm.cfg.num_layers
    assert int4_group_size(layers) == 32
    # the kept Q4_K codes are untouched
    for k, w in lm.params.items():
        if isinstance(w, Int4Weight) and k in q:
            assert q[k] is w


def test_kquant_type_not_matching_bytes_is_refused(tiny_kquant, tmp_path):
    path = tiny_kquant[0]
    buf = bytearray(path.read_bytes())
    name = b"blk.0.attn_output.weight"
    pos = buf.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", buf, pos)[0]
    at = pos + 4 + 8 * n_dims
    assert struct.unpack_from("<I", buf, at)[0] in (int(QT.Q4_K), int(QT.Q5_K), int(QT.Q6_K))
    for other in (QT.Q4_K, QT.Q6_K):
        if struct.unpack_from("<I", buf, at)[0] == int(other):
            continue
        struct.pack_into("<I", buf, at, int(other))
        bad = tmp_path / f"bad-{other.name}.gguf"
        bad.write_bytes(bytes(buf))
        with pytest.raises(LoadError, match=r"bad-.*attn_output"):
            load_model(str(bad))
