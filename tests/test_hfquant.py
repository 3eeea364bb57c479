"""GPTQ, AWQ and compressed-tensors int4 checkpoints (flint.quant.hfquant) against each format's own
dequantization, on tiny random Llama / Granite / GraniteMoeHybrid directories written here.

Each case quantizes a random transformers model round-to-nearest, packs the codes, zeros and
scales as the format stores them (GPTQ v1 / v2 and AWQ GEMM: packers written here from the
projects' documented layouts; compressed-tensors: the library's own compressor and config
schema), and checks that flint's load

* keeps every code as the file has it (no second rounding) and the file's scales;
* dequantizes (the reference backend's weights) bit for bit to the format's reference
  dequantization in float32 (GPTQ / AWQ: W = s (q - z) from the documented packing, v1's zero
  offset included; compressed-tensors: the library's decompress with float32 scales);
* gives logits equal (exactly, fp32) to the reference decoder run on those reference weights;
* holds in its fp16 mins (what the int4 kernels read) -z s rounded once, within s / 128.

Then: the refusals (bits, packings, strategies, act-order, mixed configs, missing tensors) name the
field or tensor, and `flint generate` / `flint quantize` run on such a directory. The
compressed-tensors cases skip (reason printed) without the compressed-tensors package.
Run: ``pytest tests/test_hfquant.py``.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import make_hf_model, save_hf_dir
from flint.quant.hfquant import ExactMinInt4Weight
from flint.loading import LoadError, load_model
from flint.model import Transformer
from flint.quant.int4 import Int4Weight, kernel_params, quantize_params

pytestmark = pytest.mark.usefixtures("torch_one_thread")

# big enough for group size 128 along every K (hidden 128, intermediate 256)
SHAPE = dict(hidden_size=128, intermediate_size=256, head_dim=32, num_attention_heads=4,
             num_key_value_heads=2)
GRANITE = dict(embedding_multiplier=3.0, attention_multiplier=0.07, residual_multiplier=0.4,
               logits_scaling=2.5)
FLINT = {"self_attn.q_proj": "wq", "self_attn.k_proj": "wk", "self_attn.v_proj": "wv",
         "self_attn.o_proj": "wo", "mlp.gate_proj": "w_gate", "mlp.up_proj": "w_up",
         "mlp.down_proj": "w_down", "shared_mlp.output_linear": "w_down"}
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble i of a word holds column ORDER[i]


# ------------------------------------------------------------------ round-to-nearest, per format

def rtn(w: torch.Tensor, g: int, sym: bool, zero_range=(0, 15)):
    """codes q [N, K] (0..15), fp16 scales s [N, K/g] and zeros u [N, K/g] with w ~ (q - u) s."""
    n, k = w.shape
    wg = w.view(n, k // g, g)
    if sym:
        s = (wg.abs().amax(-1) / 7.5).to(torch.float16)
        u = torch.full_like(s, 8, dtype=torch.int32)
    else:
        lo, hi = wg.amin(-1), wg.amax(-1)
        s = ((hi - lo) / 15).to(torch.float16)
        u = torch.round(-lo / s.float()).clamp(*zero_range).to(torch.int32)
    q = (torch.round(wg / s.float()[..., None]) + u[..., None]).clamp(0, 15).to(torch.int32)
    return q.view(n, k), s, u


def pack_words(v: np.ndarray) -> np.ndarray:
    """[..., 8 W] values 0..15 -> int32 [..., W]: value i of each 8 in bits 4i."""
    v = v.astype(np.uint32).reshape(*v.shape[:-1], -1, 8)
    return (v << (4 * np.arange(8, dtype=np.uint32))).sum(-1, dtype=np.uint32).view(np.int32)


def unpack_words(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> int64 [..., 8 W] by shifts (the projects' own way of reading them)."""
    x = words.to(torch.int64)[..., None] >> (4 * torch.arange(8))
    return (x & 0xF).flatten(-2)


def gptq_tensors(q, s, u, g, v1: bool):
    k = q.shape[1]
    stored = u - 1 if v1 else u
    assert int(stored.min()) >= 0 and int(stored.max()) <= 15
    return {"qweight": torch.from_numpy(pack_words(q.numpy()).T.copy()),  # [K/8, N], packed along K
            "qzeros": torch.from_numpy(pack_words(stored.T.contiguous().numpy())),
            "scales": s.T.contiguous(),
            "g_idx": (torch.arange(k) // g).to(torch.int32)}


def gptq_reference(t, g, v1: bool) -> torch.Tensor:
    """GPTQ's dequantization: W[n, k] = s[g_idx[k], n] (q[k, n] - z[g_idx[k], n]), z = stored (+ 1)."""
    q = unpack_words(t["qweight"].T).T  # qweight [K/8, N]: input column 8i + j in bits 4j of row i
    z = unpack_words(t["qzeros"]) + (1 if v1 else 0)  # [K/G, N]
    gi = t["g_idx"].long()
    return (t["scales"].float()[gi] * (q - z[gi]).float()).T.contiguous()


def awq_tensors(q, s, u):
    def pack(v):  # [R, N] -> [R, N/8]: nibble i of word c holds column 8c + ORDER[i]
        v = v.numpy().reshape(v.shape[0], -1, 8)[:, :, AWQ_PACK_ORDER]
        return torch.from_numpy(pack_words(v.reshape(v.shape[0], -1)))
    return {"qweight": pack(q.T.contiguous()), "qzeros": pack(u.T.contiguous()), "scales": s.T.contiguous()}


def awq_reference(t, g) -> torch.Tensor:
    """AutoAWQ's dequantize_gemm: unpack, undo the order, W^T = (q - z) s per group."""
    back = [AWQ_PACK_ORDER.index(j) for j in range(8)]

    def unpack(words):
        v = unpack_words(words)
        return v.view(v.shape[0], -1, 8)[:, :, back].reshape(v.shape[0], -1)
    q, z = unpack(t["qweight"]), unpack(t["qzeros"]).repeat_interleave(g, 0)
    return ((q - z).float() * t["scales"].float().repeat_interleave(g, 0)).T.contiguous()


def ct_scheme(g, sym, strategy="group"):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=4, type="int", symmetric=sym, strategy=strategy,
                            group_size=g if strategy == "group" else None)
    return QuantizationScheme(targets=["Linear"], weights=args, format="pack-quantized")


def ct_config(scheme) -> dict:
    from compressed_tensors.quantization import QuantizationConfig

    return QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized",
                              quantization_status="compressed", ignore=["lm_head"]).model_dump(mode="json")


def ct_tensors(w, q, s, u, scheme):
    """The library's own compressor, given our scales and zero points (signed: u - 8)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    out = PackedQuantizationCompressor.compress(
        {"weight": w.to(torch.float16), "weight_scale": s, "weight_zero_point": (u - 8).to(torch.int8)}, scheme)
    return dict(out)


def ct_codes(t, shape) -> torch.Tensor:
    """The library's unpacked (signed) values + 8: the unsigned codes."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    return unpack_from_int32(t["weight_packed"], 4, shape).to(torch.int32) + 8


def ct_reference(t, scheme) -> torch.Tensor:
    """The library's decompress, with float32 scales: the exact (q - zp) s."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    d = PackedQuantizationCompressor.decompress(dict(t, weight_scale=t["weight_scale"].float()), scheme)
    return d["weight"]


# ------------------------------------------------------------------ writing a checkpoint

def quantized_dir(path: Path, family: str, method: str, g: int | None, sym: bool, seed: int = 0,
                  v1: bool = True, ct_strategy: str = "group", scale_dtype=torch.float16, head: bool = False,
                  **overrides):
    """Write a tiny random model quantized in ``method``; returns (dir, {flint name: (ref W, codes)})."""
    over = dict(SHAPE, **(GRANITE if family != "llama" else {}), **overrides)
    if family == "granitemoehybrid":
        over["shared_intermediate_size"] = over.pop("intermediate_size")
    hf = make_hf_model(family, seed=seed, **over)
    d = save_hf_dir(hf, path)
    sd = load_file(str(d / "model.safetensors"))
    scheme = ct_scheme(g, sym, ct_strategy) if method == "compressed-tensors" else None
    refs = {}
    heads = ["lm_head.weight"] if head else []  # GPTQModel's lm_head: true
    for name in [k for k in sd if k.endswith("_proj.weight") or "shared_mlp" in k] + heads:
        w = sd.pop(name).float()
        prefix = name[: -len(".weight")]
        gs = g or w.shape[1]
        q, s, u = rtn(w, gs, sym, (1, 15) if method == "gptq" and v1 else (0, 15))
        s = s.to(scale_dtype)  # bf16: what llm-compressor writes for a bf16 model
        if method == "gptq":
            t = gptq_tensors(q, s, u, gs, v1)
            ref = gptq_reference(t, gs, v1)
        elif method == "awq":
            t = awq_tensors(q, s, u)
            ref = awq_reference(t, gs)
        else:
            t = ct_tensors(w, q, s, u, scheme)
            ref = ct_reference(t, scheme)
            q = ct_codes(t, w.shape)
        sd.update({f"{prefix}.{k}": v for k, v in t.items()})
        if prefix == "lm_head":
            refs["lm_head"] = (ref, q)
            continue
        li = int(prefix.split(".")[2])
        rest = prefix.split(".", 3)[3]
        if rest == "shared_mlp.input_linear":
            half = w.shape[0] // 2
            refs[f"layers.{li}.w_gate"] = (ref[:half], q[:half])
            refs[f"layers.{li}.w_up"] = (ref[half:], q[half:])
        else:
            refs[f"layers.{li}.{FLINT[rest]}"] = (ref, q)
    save_file(sd, str(d / "model.safetensors"))
    cfg = json.loads((d / "config.json").read_text())
    if method == "gptq":
        qc = {"quant_method": "gptq", "bits": 4, "group_size": g or -1, "desc_act": False, "sym": sym,
              "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    elif method == "awq":
        qc = {"quant_method": "awq", "bits": 4, "group_size": g, "zero_point": True, "version": "gemm"}
    else:
        qc = ct_config(scheme)
    cfg["quantization_config"] = qc
    (d / "config.json").write_text(json.dumps(cfg))
    return d, refs


def edit_qc(d: Path, **fields) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"].update(fields)
    (d / "config.json").write_text(json.dumps(cfg))


def edit_tensors(d: Path, fn) -> None:
    sd = load_file(str(d / "model.safetensors"))
    fn(sd)
    save_file(sd, str(d / "model.safetensors"))


# ------------------------------------------------------------------ parity

# id -> (family, method, group size (None: per channel), symmetric, extra)
CASES = {
    "gptq-v1-asym-g32-llama-int4-head": ("llama", "gptq", 32, False, dict(head=True, vocab_size=264)),
    "gptq-v2-asym-g64-granite": ("granite", "gptq", 64, False, dict(v1=False)),
    "gptq-v1-sym-g128-llama": ("llama", "gptq", 128, True, {}),
    "gptq-v2-perchannel-granitemoehybrid": ("granitemoehybrid", "gptq", None, False, dict(v1=False)),
    "awq-g32-llama": ("llama", "awq", 32, False, {}),
    "awq-g128-granite": ("granite", "awq", 128, False, {}),
    "awq-g256-llama": ("llama", "awq", 256, False, dict(hidden_size=256, head_dim=64, intermediate_size=512)),
    "ct-asym-g32-llama": ("llama", "compressed-tensors", 32, False, {}),
    "ct-sym-g128-granite": ("granite", "compressed-tensors", 128, True, {}),
    "ct-asym-g64-granitemoehybrid": ("granitemoehybrid", "compressed-tensors", 64, False, {}),
    "ct-channel-asym-llama": ("llama", "compressed-tensors", None, False, dict(ct_strategy="channel")),
    "ct-asym-g128-bf16-scales-granite": ("granite", "compressed-tensors", 128, False,
                                         dict(scale_dtype=torch.bfloat16)),
}


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tmp_path_factory):
    family, method, g, sym, extra = CASES[request.param]
    if method == "compressed-tensors":
        pytest.importorskip("compressed_tensors", reason="the compressed-tensors package is not installed")
    d, refs = quantized_dir(tmp_path_factory.mktemp(request.param), family, method, g, sym,
                            seed=len(request.param), **extra)
    return request.param, d, refs, load_model(str(d))


def test_codes_and_scales_are_the_files(case):
    name, _, refs, lm = case
    for fl, (_, q) in refs.items():
        w = lm.params[fl]
        assert isinstance(w, Int4Weight), f"{name}: {fl} is {type(w).__name__}, not int4"
        assert torch.equal(w.codes().to(torch.int32), q), f"{name}: {fl}: codes changed"


def test_dequantize_equals_the_formats_reference_bit_for_bit(case):
    name, _, refs, lm = case
    for fl, (ref, _) in refs.items():
        got = lm.params[fl].dequantize(torch.float32)
        assert torch.equal(got.view(torch.int32), ref.float().contiguous().view(torch.int32)), \
            f"{name}: {fl}: max diff {(got - ref).abs().max().item():.3g}"


def test_logits_equal_the_reference_dequantized_model(case):
    name, _, refs, lm = case
    ref_params = dict(lm.params, **{fl: ref.float() for fl, (ref, _) in refs.items()})
    ids = torch.randint(0, lm.cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(3))
    ours = Transformer(lm.cfg, lm.params, max_seq_len=32).forward(ids, 0)
    theirs = Transformer(lm.cfg, ref_params, max_seq_len=32).forward(ids, 0)
    assert torch.equal(ours, theirs), f"{name}: max logit diff {(ours - theirs).abs().max().item():.3g}"
    assert ours.abs().max() > 0.5  # not a degenerate model


def test_kernel_mins_are_the_exact_mins_rounded_once(case):
    """The fp16 mins the int4 kernels read: -u s rounded to nearest, at most s/128 off; a
    symmetric checkpoint needs no rounding at all (-8 s is exact)."""
    name, _, refs, lm = case
    sym = CASES[name][3]
    inexact = 0
    for fl in refs:
        w = lm.params[fl]
        exact = w.exact_mins if isinstance(w, ExactMinInt4Weight) else w.mins.float()
        assert torch.equal(w.mins, exact.to(torch.float16))
        assert ((w.mins.float() - exact).abs() <= w.scales.float().abs() / 128).all()
        kernel = Int4Weight(w.qweight, w.scales, w.mins, w.group_size).dequantize()
        step = w.scales.float().repeat_interleave(w.group_size, 1).abs()
        assert ((kernel - refs[fl][0]).abs() <= step / 128).all(), f"{name}: {fl}"
        inexact += isinstance(w, ExactMinInt4Weight)
    assert inexact == 0 if sym else inexact > 0, f"{name}: {inexact} tensors with inexact fp16 mins"


def test_int4_backends_keep_the_loaded_weights(case):
    """quantize_params (what the int4 backends call) keeps the loaded int4 weights as they are."""
    _, _, refs, lm = case
    g = next(iter(lm.params[fl] for fl in refs)).group_size
    q = quantize_params(lm.params, 128)
    assert all(q[fl] is lm.params[fl] for fl in refs)
    assert {w.group_size for fl, w in q.items() if isinstance(w, Int4Weight) and fl != "lm_head"} == {g}


def test_compiled_backend_runs_the_loaded_weights(case):
    """The compiled backend (int4 through torch's tinygemm ops, eager on CPU) on the loaded model
    against the reference decoder on what the int4 kernels read (the fp16 mins)."""
    from flint.compiled import CompiledBackend

    name, _, refs, lm = case
    g = next(iter(lm.params[fl] for fl in refs)).group_size
    be = CompiledBackend(lm.cfg, lm.params, 32, device="cpu", int4=True, group_size=g)
    ids = torch.randint(0, lm.cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(4))
    a = be.forward(ids, 0)
    b = Transformer(lm.cfg, quantize_params(kernel_params(lm.params), g), max_seq_len=32).forward(ids, 0)
    err = float((a - b).abs().max())
    assert err <= 1e-4 * float(b.abs().max()), f"{name}: max |diff| {err:.3g}"


def test_scales_fp16_cannot_hold_load_as_the_formats_float_values(gptq_dir, capsys):
    """A scale fp16 cannot hold (fp32 with more than 11 significant bits): that tensor loads as
    float32, exactly the format's values, and the load says the int4 backends requantize it."""
    p = "model.layers.0.mlp.up_proj"
    edit_tensors(gptq_dir, lambda sd: sd.update({f"{p}.scales": sd[f"{p}.scales"].float() * (1 + 2.0 ** -20)}))
    sd = load_file(str(gptq_dir / "model.safetensors"))
    ref = gptq_reference({k: sd[f"{p}.{k}"] for k in ("qweight", "qzeros", "scales", "g_idx")}, 32, True)
    lm = load_model(str(gptq_dir))
    w = lm.params["layers.0.w_up"]
    assert not isinstance(w, Int4Weight) and torch.equal(w, ref)
    assert isinstance(lm.params["layers.0.w_gate"], Int4Weight)
    err = capsys.readouterr().err
    assert "1 gptq tensors load as float32" in err and p in err and "requantize" in err


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)),
                    reason="needs a CUDA sm_90 (Hopper) GPU")
def test_megakernel_runs_a_gptq_checkpoint(tmp_path):
    """The megakernel on a loaded asymmetric GPTQ model (exact-min weights among them) against the
    reference decoder on what the kernel reads (fp16 mins), within test_megakernel.py's bound."""
    from mk_check import assert_megakernel_matches

    d, _ = quantized_dir(tmp_path / "mk", "llama", "gptq", 64, False, v1=False, hidden_size=256,
                         intermediate_size=512, num_attention_heads=4, num_key_value_heads=1, head_dim=128)
    lm = load_model(str(d))
    params = quantize_params(lm.params, 64)  # the float head to int4, as the backend factory does
    assert any(isinstance(w, ExactMinInt4Weight) for w in params.values())
    assert_megakernel_matches(lm.cfg, params)


# ------------------------------------------------------------------ refusals

@pytest.fixture(scope="module")
def gptq_src(tmp_path_factory):
    return quantized_dir(tmp_path_factory.mktemp("gptq-src"), "llama", "gptq", 32, False, seed=5,
                         num_hidden_layers=1)[0]


@pytest.fixture
def gptq_dir(gptq_src, tmp_path):
    import shutil

    return Path(shutil.copytree(gptq_src, tmp_path / "m"))


def refused(d: Path, *needles: str) -> str:
    with pytest.raises(LoadError) as e:
        load_model(str(d))
    msg = str(e.value)
    for n in needles:
        assert n in msg, f"{msg!r} does not name {n!r}"
    return msg


@pytest.mark.parametrize("fields, needles", [
    (dict(bits=8), ["config.json", "quantization_config.bits", "8"]),
    (dict(bits=3), ["config.json", "quantization_config.bits", "3"]),
    (dict(checkpoint_format="marlin"), ["config.json", "quantization_config.checkpoint_format", "marlin"]),
    (dict(dynamic={"-:.*down_proj": {}}), ["config.json", "quantization_config.dynamic"]),
    (dict(group_size=16), ["config.json", "quantization_config.group_size", "16"]),
    (dict(desc_act="yes"), ["config.json", "quantization_config.desc_act"]),
    (dict(group_size=64), ["model.safetensors", ".qzeros", "shape"]),  # the tensors say 32
])
def test_gptq_config_refused(gptq_dir, fields, needles):
    edit_qc(gptq_dir, **fields)
    refused(gptq_dir, *needles)


def test_gptq_act_order_permutation_refused(gptq_dir):
    def permute(sd):
        k = "model.layers.0.mlp.down_proj.g_idx"
        sd[k] = sd[k][torch.randperm(sd[k].numel(), generator=torch.Generator().manual_seed(0))].contiguous()
    edit_tensors(gptq_dir, permute)
    edit_qc(gptq_dir, desc_act=True)
    refused(gptq_dir, "model.layers.0.mlp.down_proj.g_idx", "quantization_config.desc_act", "act-order")


def test_gptq_act_order_with_static_groups_loads(gptq_dir):
    edit_qc(gptq_dir, desc_act=True)  # the g_idx is the plain grouping: nothing to undo
    assert isinstance(load_model(str(gptq_dir)).params["layers.0.wq"], Int4Weight)


def test_gptq_act_order_without_g_idx_refused(gptq_dir):
    edit_tensors(gptq_dir, lambda sd: sd.pop("model.layers.0.self_attn.k_proj.g_idx"))
    assert isinstance(load_model(str(gptq_dir)).params["layers.0.wk"], Int4Weight)  # desc_act off: fine
    edit_qc(gptq_dir, desc_act=True)
    refused(gptq_dir, "model.layers.0.self_attn.k_proj.g_idx", "quantization_config.desc_act")


@pytest.mark.parametrize("drop, needle", [
    ("model.layers.0.self_attn.q_proj.qzeros", "model.layers.0.self_attn.q_proj.qzeros' is missing"),
    ("model.layers.0.mlp.up_proj.scales", "model.layers.0.mlp.up_proj.scales' is missing"),
    ("model.layers.0.mlp.up_proj.qweight", "model.layers.0.mlp.up_proj.qweight' is missing"),
])
def test_missing_tensor_refused(gptq_dir, drop, needle):
    edit_tensors(gptq_dir, lambda sd: sd.pop(drop))
    refused(gptq_dir, needle)


def test_wrong_dtype_and_shape_refused(gptq_dir):
    edit_tensors(gptq_dir, lambda sd: sd.update({"model.layers.0.mlp.up_proj.qzeros":
                                                 sd["model.layers.0.mlp.up_proj.qzeros"].to(torch.int64)}))
    refused(gptq_dir, "model.layers.0.mlp.up_proj.qzeros", "I64", "I32")
    edit_tensors(gptq_dir, lambda sd: sd.update({"model.layers.0.mlp.up_proj.qzeros":
                                                 sd["model.layers.0.mlp.up_proj.qzeros"][:, :-1].to(torch.int32).contiguous()}))
    refused(gptq_dir, "model.layers.0.mlp.up_proj.qzeros", "shape")


def each_refused_then_loads(d: Path, cases) -> None:
    """Each (mutate(quantization_config), needles) is refused naming config.json and the needles;
    the untouched config then loads."""
    base = json.loads((d / "config.json").read_text())
    for mutate, needles in cases:
        cfg = json.loads(json.dumps(base))
        mutate(cfg["quantization_config"])
        (d / "config.json").write_text(json.dumps(cfg))
        refused(d, "config.json", *needles)
    (d / "config.json").write_text(json.dumps(base))
    assert isinstance(load_model(str(d)).params["layers.0.wo"], Int4Weight)


def test_awq_config_refused(tmp_path):
    d, _ = quantized_dir(tmp_path / "awq", "llama", "awq", 32, False, num_hidden_layers=1)
    cases = []
    for fields, needles in [(dict(version="gemv"), ["quantization_config.version", "gemv"]),
                            (dict(zero_point=False), ["quantization_config.zero_point"]),
                            (dict(bits=8), ["quantization_config.bits"]),
                            (dict(backend="llm-awq"), ["quantization_config.backend"])]:
        cases.append((lambda qc, f=fields: qc.update(f), needles))
    each_refused_then_loads(d, cases)


def test_compressed_tensors_config_refused(tmp_path):
    pytest.importorskip("compressed_tensors", reason="the compressed-tensors package is not installed")
    d, _ = quantized_dir(tmp_path / "ct", "llama", "compressed-tensors", 32, False, num_hidden_layers=1)
    w = "config_groups.group_0.weights"

    def weights(**f):
        return lambda qc: qc["config_groups"]["group_0"]["weights"].update(f)

    def second_group(qc):  # another group quantizing the MLP at a different group size
        other = json.loads(json.dumps(qc["config_groups"]["group_0"]))
        other.update(targets=["re:.*mlp.*"])
        other["weights"]["group_size"] = 64
        qc["config_groups"]["group_1"] = other

    cases = [
        (lambda qc: qc.update(format="float-quantized"), ["quantization_config.format"]),
        (lambda qc: qc.update(quantization_status="frozen"), ["quantization_config.quantization_status"]),
        (lambda qc: qc.update(kv_cache_scheme={"num_bits": 8}), ["quantization_config.kv_cache_scheme"]),
        (weights(num_bits=8), [f"quantization_config.{w}.num_bits", "8"]),
        (weights(strategy="tensor"), [f"quantization_config.{w}.strategy", "tensor"]),
        (weights(strategy="block", block_structure=[128, 128]), [f"{w}.strategy", "block"]),
        (weights(actorder="sideways"), [f"{w}.actorder"]),
        (lambda qc: qc["config_groups"]["group_0"].update(input_activations={"num_bits": 8}),
         ["config_groups.group_0.input_activations"]),
        (second_group, ["quantization_config.config_groups", "mixed"]),
    ]
    each_refused_then_loads(d, cases)


def test_compressed_tensors_act_order_refused(tmp_path):
    pytest.importorskip("compressed_tensors", reason="the compressed-tensors package is not installed")
    d, _ = quantized_dir(tmp_path / "ct", "llama", "compressed-tensors", 32, True, num_hidden_layers=1)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    (d / "config.json").write_text(json.dumps(cfg))
    refused(d, "weight_g_idx' is missing", "actorder")
    k = 128
    edit_tensors(d, lambda sd: sd.update({f"model.layers.0.{m}.weight_g_idx": (torch.arange(k) // 32).to(torch.int32)
                                          for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                    "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj")}
                                         | {"model.layers.0.mlp.down_proj.weight_g_idx":
                                            (torch.arange(256) // 32).flip(0).to(torch.int32).contiguous()}))
    refused(d, "model.layers.0.mlp.down_proj.weight_g_idx", "act-order")


def test_old_autogptq_quantize_config_json_is_named(gptq_dir):
    cfg = json.loads((gptq_dir / "config.json").read_text())
    (gptq_dir / "quantize_config.json").write_text(json.dumps(cfg.pop("quantization_config")))
    (gptq_dir / "config.json").write_text(json.dumps(cfg))
    refused(gptq_dir, "quantize_config.json", "quantization_config")


def test_compressed_tensors_unpacked_int8_zero_points(tmp_path):
    """Zero points stored unpacked as int8 [N, K/G] (the form the library dequantizes with) load to
    the same weights; on a symmetric scheme they must be 0."""
    pytest.importorskip("compressed_tensors", reason="the compressed-tensors package is not installed")
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    d, refs = quantized_dir(tmp_path / "ct", "llama", "compressed-tensors", 32, False, num_hidden_layers=1)
    before = load_model(str(d)).params

    def unpack(sd):
        for k in [k for k in sd if k.endswith(".weight_zero_point")]:
            shape = sd[k[: -len("zero_point")] + "shape"]
            sd[k] = unpack_from_int32(sd[k], 4, (int(shape[0]), sd[k].shape[1]), packed_dim=0).contiguous()
    edit_tensors(d, unpack)
    after = load_model(str(d)).params
    for fl, (ref, _) in refs.items():
        assert torch.equal(after[fl].dequantize(), before[fl].dequantize())
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] = True
    (d / "config.json").write_text(json.dumps(cfg))
    refused(d, ".weight_zero_point", "nonzero", "symmetric")
    edit_tensors(d, lambda sd: sd.update({k: torch.zeros_like(v) for k, v in sd.items()
                                          if k.endswith(".weight_zero_point")}))
    assert all(torch.equal(w.mins, -8 * w.scales) for k, w in load_model(str(d)).params.items()
               if isinstance(w, Int4Weight))


# ------------------------------------------------------------------ the CLI

def test_cli_generate_and_quantize(gptq_src, tmp_path, capsys):
    from flint.cli import main

    assert main(["generate", "--model", str(gptq_src), "--prompt", "hi", "--max-new-tokens", "4",
                 "--temperature", "0"]) == 0
    out = tmp_path / "flint-int4"
    assert main(["quantize", str(gptq_src), str(out)]) == 0
    src, q = load_model(str(gptq_src)), load_model(str(out))
    for name, w in src.params.items():
        if isinstance(w, Int4Weight):  # the same codes and scales; mins as the kernels read them
            assert torch.equal(q.params[name].qweight, w.qweight) and torch.equal(q.params[name].scales, w.scales)
            assert torch.equal(q.params[name].mins, w.mins)
