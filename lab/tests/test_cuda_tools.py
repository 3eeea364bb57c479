"""Every CUDA tool in lab/cuda compiles for sm_90a with the flags its header gives (nvcc only, no GPU): the tools
include the kernel's headers, so a change there that breaks one shows here. Run: ``pytest lab/tests/test_cuda_tools.py``
(about a minute and a half on 2 cores; icache_bench's unrolled bodies are most of it)."""
from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from flint.kernels.build import find_nvcc

TOOLS = sorted((Path(__file__).resolve().parents[1] / "cuda").glob("*.cu"))
FLAGS = ["-gencode", "arch=compute_90a,code=sm_90a", "-O3", "-std=c++17"]


def test_every_tool_is_listed():
    assert {p.name for p in TOOLS} >= {"cluster_probe.cu", "hop_bench.cu", "icache_bench.cu", "mma_dot_bench.cu"}


def test_every_tool_compiles(tmp_path):
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")

    def compile_one(src: Path):
        r = subprocess.run([nvcc, *FLAGS, "-c", str(src), "-o", str(tmp_path / f"{src.stem}.o")],
                           capture_output=True, text=True)
        return src.name, r.returncode, r.stderr[-2000:]

    with ThreadPoolExecutor(max_workers=len(TOOLS)) as ex:
        failed = [(name, err) for name, rc, err in ex.map(compile_one, TOOLS) if rc]
    assert not failed, failed
