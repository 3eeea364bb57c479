"""The megakernel's sources stay the shipping design in readable files (CPU only, no nvcc needed):
every source is in build.py's hash, none is over 800 lines, the knobs are few and in one place, and the host
ABI (megakernel_host.cu's argument tables, the shared constants) agrees with flint/megakernel.py."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from flint.kernels import build

KERNELS = Path(build.__file__).resolve().parent
SOURCES = sorted(p for p in KERNELS.iterdir() if p.suffix in (".cu", ".cuh"))


def test_build_hashes_every_source():
    # a header missing from SOURCES would not invalidate the cached library when it changes
    assert sorted(build.SOURCES) == [p.name for p in SOURCES]


def test_no_source_over_800_lines():
    long = {p.name: n for p in SOURCES if (n := len(p.read_text().splitlines())) > 800}
    assert not long, f"kernel sources over 800 lines: {long}"


def test_knobs_are_few_and_named_in_one_place():
    defined, tested = set(), set()
    for p in SOURCES:
        for line in p.read_text().splitlines():
            m = re.match(r"\s*#\s*define\s+(\w+)", line)
            if m:
                defined.add(m.group(1))
            m = re.match(r"\s*#\s*(?:if|ifdef|ifndef|elif)\b(.*)", line)
            if m:
                tested |= set(re.findall(r"[A-Za-z_]\w*", m.group(1))) - {"defined"}
    config = set(re.findall(r"^constexpr\s+\w+\s+(\w+)\s*=", (KERNELS / "mk_config.cuh").read_text(), re.M))
    names = defined | tested | config
    assert len(names) <= 16, sorted(names)
    # the preprocessor selects only what the build sets per object (flint/kernels/build.py)
    assert tested <= {"FLINT_MK_M", "FLINT_MK_GU8", "FLINT_MK_LONG", "FLINT_MK_KV8", "MK_TRACE"}, sorted(tested)
    flags = " ".join(" ".join(d) for _, d in build.EXTRA_OBJECTS) + " " + " ".join(build.TRACE_FLAGS)
    for name in tested - {"FLINT_MK_M"}:
        assert f"-D{name}=" in flags, f"{name} is tested in the kernel but no object of build.py sets it"


# ------------------------------------------------------------------ the host ABI (checked at load on a GPU too)

def _host_args(table: str) -> list[str]:
    """The slot names of one of megakernel_host.cu's argument tables (kParamArgs, kMatArgs, kFloatArgs)."""
    src = (KERNELS / "megakernel_host.cu").read_text()
    body = re.search(rf"static const Arg {table}\[\] = \{{(.*?)\}};", src, re.S).group(1)
    return re.findall(r'\{"(\w+)", offsetof', body)


def _host_layout() -> str:
    """flint_mk_abi_layout's string, rebuilt from the source's tables."""
    src = (KERNELS / "megakernel_host.cu").read_text()
    mats = re.findall(r'"(\w+)"', re.search(r"kMatNames\[mk::NMAT\] = \{(.*?)\};", src).group(1))
    ints = _host_args("kParamArgs") + [f"{m}.{f}" for m in mats for f in _host_args("kMatArgs")]
    return " ".join(ints) + " | " + " ".join(_host_args("kFloatArgs"))


def test_megakernel_packs_the_arguments_the_host_names():
    from types import SimpleNamespace

    from flint import megakernel
    from flint.megakernel import MegakernelBackend

    layout = _host_layout()
    cfg = SimpleNamespace(hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3, head_dim=64,
                          num_layers=30, vocab_size=49152, use_rope=True, rms_norm_eps=1e-5, embedding_multiplier=1.0,
                          residual_multiplier=1.0, attn_scale=0.125, logits_scaling=1.0)
    ptr = SimpleNamespace(data_ptr=lambda: 4096)
    desc = dict(N=16, K=576, G=32, nseg=1, kseg=576, srb=384, nreal=16, layer_stride=6144, seg_stride=6144)
    mk = SimpleNamespace(cfg=cfg, ffn_plan=None, max_seq_len=2048, nblocks=132, kv_cache="fp16",
                         _lib=SimpleNamespace(flint_mk_abi_layout=lambda: layout.encode()),
                         mat_desc={k: desc for k in megakernel.MATRICES if k != "dslice"},
                         weights={k: ptr for k in megakernel.MATRICES})
    for n in ("embed", "norms", "final_norm", "rope_cos", "rope_sin", "k_cache", "v_cache", "resid", "kv_scale",
              "attn", "act", "part", "att_count", "logits", "arg_val", "arg_idx", "argmax", "done_count",
              "bar_counter", "epoch", "dpart", "trace", "qkv_tag"):
        setattr(mk, n, ptr)
    ia, fa = MegakernelBackend._pack_args(mk)
    names = layout.split("|")[0].split()
    assert len(ia) == len(names) == 14 + 23 + 6 * 10 and len(fa) == 5
    at = dict(zip(names, ia))
    assert (at["H"], at["nblocks"], at["ohead"], at["embed"], at["qkv.N"], at["dslice.N"]) == (576, 132, 0, 4096, 16, 0)
    mk._lib = SimpleNamespace(flint_mk_abi_layout=lambda: layout.replace("ohead ", "oh2 ").encode())
    with pytest.raises(megakernel.MegakernelError, match="asks for \\['oh2'\\].*also has \\['ohead'\\]"):
        MegakernelBackend._pack_args(mk)


def test_megakernel_constants_match_the_kernel():
    from flint import megakernel

    common = (KERNELS / "mk_common.cuh").read_text()
    for name in ("MAX_M", "KSEG_MAX", "TILE_ROWS", "ATT_T"):
        value = int(re.search(rf"constexpr int {name} = (\d+);", common).group(1))
        assert getattr(megakernel, name) == value, name
    host = (KERNELS / "megakernel_host.cu").read_text()
    assert int(re.search(r"flint_mk_abi_version\(\) \{ return (\d+); \}", host).group(1)) == megakernel.ABI_VERSION
