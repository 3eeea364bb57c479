"""The megakernel's host ABI: flint_mk_create's argument slots as megakernel_host.cu names them, packed by
flint/megakernel.py; the constants both sides hold; the ABI check at load. CPU: the source-level checks need
nothing, the library checks need nvcc (the host part linked with stub kernel objects; no GPU, so flint_mk_create
runs until its first CUDA call). Run: ``pytest tests/test_mk_abi.py``."""
from __future__ import annotations

import ctypes
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from flint import megakernel
from flint.kernels import build
from flint.megakernel import MegakernelBackend, MegakernelError

KERNELS = Path(build.__file__).resolve().parent
HOST = (KERNELS / "megakernel_host.cu").read_text()


def _host_args(table: str) -> list[str]:
    """The slot names of one of megakernel_host.cu's argument tables (kParamArgs, kMatArgs, kFloatArgs)."""
    body = re.search(rf"static const Arg {table}\[\] = \{{(.*?)\}};", HOST, re.S).group(1)
    return re.findall(r'\{"(\w+)", offsetof', body)


def _source_layout() -> str:
    """flint_mk_abi_layout's string, rebuilt from the source's tables."""
    mats = re.findall(r'"(\w+)"', re.search(r"kMatNames\[mk::NMAT\] = \{(.*?)\};", HOST).group(1))
    ints = _host_args("kParamArgs") + [f"{m}.{f}" for m in mats for f in _host_args("kMatArgs")]
    return " ".join(ints) + " | " + " ".join(_host_args("kFloatArgs"))


def fake_backend(layout, ffn_plan=None, desc=None):
    """What MegakernelBackend._pack_args reads, without a GPU: a small model's shape, tensors at address 4096."""
    cfg = SimpleNamespace(hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3, head_dim=64,
                          num_layers=30, vocab_size=49152, use_rope=True, rms_norm_eps=1e-5, embedding_multiplier=1.0,
                          residual_multiplier=1.0, attn_scale=0.125, logits_scaling=1.0, qk_norm=False,
                          qkv_bias=False)
    ptr = SimpleNamespace(data_ptr=lambda: 4096)
    desc = desc or dict(N=16, K=576, G=32, nseg=1, kseg=576, srb=384, nreal=16, layer_stride=6144, seg_stride=6144)
    absent = "down" if ffn_plan else "dslice"
    mk = SimpleNamespace(cfg=cfg, ffn_plan=ffn_plan, max_seq_len=2048, nblocks=132, kv_cache="fp16", qk_norm=None, qkv_bias=None,
                         _lib=SimpleNamespace(flint_mk_abi_layout=lambda: layout.encode()) if isinstance(layout, str)
                         else layout,
                         mat_desc={k: dict(desc) for k in megakernel.MATRICES if k != absent},
                         weights={k: ptr for k in megakernel.MATRICES})
    for n in ("embed", "norms", "final_norm", "rope_cos", "rope_sin", "k_cache", "v_cache", "resid", "kv_scale",
              "attn", "act", "part", "att_count", "logits", "arg_val", "arg_idx", "argmax", "done_count",
              "bar_counter", "epoch", "dpart", "trace", "qkv_tag"):
        setattr(mk, n, ptr)
    return mk


def test_megakernel_packs_the_arguments_the_host_names():
    layout = _source_layout()
    ia, fa = MegakernelBackend._pack_args(fake_backend(layout))
    names = layout.split("|")[0].split()
    # 14 ints and 23 pointers (lab/patches/qkv_bias.patch: 24, qk_norm.patch: 25), then 6 matrices of 10 fields
    assert len(ia) == len(names) in (14 + n + 6 * 10 for n in (23, 24, 25)) and len(fa) == 5
    at = dict(zip(names, ia))
    assert (at["H"], at["nblocks"], at["ohead"], at["embed"], at["qkv.N"], at["dslice.N"]) == (576, 132, 0, 4096, 16, 0)
    with pytest.raises(MegakernelError, match="asks for \\['oh2'\\].*also has \\['ohead'\\]"):
        MegakernelBackend._pack_args(fake_backend(layout.replace("ohead ", "oh2 ")))


def test_megakernel_constants_match_the_kernel():
    common = (KERNELS / "mk_common.cuh").read_text()
    for name in ("MAX_M", "KSEG_MAX", "TILE_ROWS", "ATT_T"):
        value = int(re.search(rf"constexpr int {name} = (\d+);", common).group(1))
        assert getattr(megakernel, name) == value, name
    assert int(re.search(r"flint_mk_abi_version\(\) \{ return (\d+); \}", HOST).group(1)) == megakernel.ABI_VERSION


@pytest.fixture(scope="module")
def host_library(tmp_path_factory):
    """megakernel_host.cu linked with stubs of the kernel objects' launch and occupancy functions."""
    nvcc = build.find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    tmp = tmp_path_factory.mktemp("mk_abi")
    sig = "(const mk::Params*, const mk::Smem*, int, const long long*, int, cudaStream_t, int)"
    names = [f"m{m}{v}" for m in range(1, megakernel.MAX_M + 1) for v in ("", "_kv8", "_gu8", "_gu8_kv8")]
    names += ["m1_long", "m1_gu8_long", "m1_long_kv8", "m1_gu8_long_kv8"]
    stub = ['#include "mk_common.cuh"']
    for n in names:
        stub += [f'extern "C" int flint_mk_launch_{n}{sig} {{ return 1; }}',
                 f'extern "C" int flint_mk_occupancy_{n}(int, int*) {{ return 1; }}']
    (tmp / "stub.cu").write_text("\n".join(stub) + "\n")
    flags = [f for f in build.NVCC_FLAGS if not f.startswith("-Xptxas")] + ["-I", str(KERNELS)]
    for src, obj in ((KERNELS / "megakernel_host.cu", "host.o"), (tmp / "stub.cu", "stub.o")):
        subprocess.run([nvcc, *flags, "-c", str(src), "-o", str(tmp / obj)], check=True, capture_output=True)
    lib = tmp / "libabi.so"
    subprocess.run([nvcc, *build.LINK_FLAGS, "-o", str(lib), str(tmp / "host.o"), str(tmp / "stub.o")], check=True,
                   capture_output=True)
    return megakernel.bind_library(ctypes.CDLL(str(lib)))


def _create(lib, mk) -> str:
    ia, fa = MegakernelBackend._pack_args(mk)
    h = ctypes.c_void_p()
    rc = lib.flint_mk_create((ctypes.c_longlong * len(ia))(*ia), len(ia), (ctypes.c_double * len(fa))(*fa), len(fa),
                             ctypes.byref(h))
    assert rc != 0 and not h.value  # (no GPU here: it stops at its first CUDA call at the latest)
    return lib.flint_mk_last_error().decode()


def test_library_reports_its_abi(host_library):
    megakernel.check_abi(host_library)  # version, constants, 24 objects = build.py's list
    assert host_library.flint_mk_abi_layout().decode() == _source_layout()


def test_library_unpacks_the_named_arguments(host_library):
    # the arguments pass every check before the first CUDA call
    assert _create(host_library, fake_backend(host_library)).startswith("cudaGetDevice")
    # each value lands in the field of its name: the messages print what the host unpacked
    bad = dict(N=16, K=576, G=48, nseg=1, kseg=576, srb=384, nreal=16, layer_stride=6144, seg_stride=6144)
    assert "matrix 0 has an unsupported layout (N=16 K=576 G=48 kseg=576)" in _create(
        host_library, fake_backend(host_library, desc=bad))
    plan = {"nffn": 3, "nffn_pad": 5}
    assert "(nffn=3, slice K=576, gate|up tiles=1, intermediate=1536)" in _create(
        host_library, fake_backend(host_library, ffn_plan=plan))
