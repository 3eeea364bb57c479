"""Register pressure of the megakernel, from the compiler's own liveness (no GPU): compiles one object of
flint/kernels/megakernel.cu to a cubin with the build's flags, disassembles it with `nvdisasm --print-life-ranges`,
and reports the live 32-bit registers per source region (max, and the floor: the fewest live anywhere in the region)
and at every grid-barrier arrival (the values that live across stages).

    python3 lab/mk_live.py [--m 1] [--gu8] [-D MACRO=VALUE ...]

Measured 2026-11-30: in v20's M = 1 G128 object 83-90 registers are live at every grid barrier, of the 128 that
__launch_bounds__(512, 1) allows; the stages' peaks are 120-121 (the tile dot, matvec_stage, attention_stage). A
change that adds register demand anywhere re-allocates the whole kernel; with
`-D MK_TM_INIT=1` (an experiment of older revisions) the barriers hold 66-73 (and the step is 2.8% slower:
docs/megakernel-log.md).
Needs nvcc and nvdisasm on the PATH (the pip wheel nvidia-cuda-nvdisasm has it).
"""
from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "lab"))
from mk_stalls import compile_cubin, decode_kernel_lines, kernel_listing, region_names  # noqa: E402


def disassemble(m: int, gu8: bool, defines: list[str]) -> list[tuple[str, int, int, str]]:
    """[(file, line, live registers or -1, instruction)] per instruction of decode_kernel<m>, in address order."""
    nvdisasm = shutil.which("nvdisasm")
    if nvdisasm is None:
        sys.exit("mk_live: nvdisasm not found on the PATH (pip download nvidia-cuda-nvdisasm, or a CUDA toolkit)")
    with tempfile.TemporaryDirectory() as td:
        cub = Path(td) / "mk.cubin"
        compile_cubin(m, gu8, cub, tuple(defines))
        # the line table (-g) and the life ranges (-lrm count) come from two listings of the same code
        lines = subprocess.run([nvdisasm, "-g", "-c", str(cub)], check=True, capture_output=True, text=True).stdout
        live = subprocess.run([nvdisasm, "-lrm", "count", "-c", str(cub)], check=True, capture_output=True,
                              text=True).stdout
    where = kernel_listing(lines)
    # (the life-range listing leaves out the padding after the last EXIT: joined by address)
    count = {}
    for ln in decode_kernel_lines(live):
        mm = re.match(r"\s+/\*([0-9a-f]+)\*/.*?//\s*\|\s*(\d+)", ln)
        if mm:
            count[int(mm.group(1), 16)] = int(mm.group(2))
    if len(count) < 0.99 * len(where):
        sys.exit(f"mk_live: life ranges for {len(count)} of {len(where)} instructions")
    return [(f, ln, count.get(addr, -1), op) for addr, (f, ln), op in where]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--gu8", action="store_true", help="the M = 1 object with gate|up's integer dot (G128 models)")
    ap.add_argument("-D", dest="defines", action="append", default=[], help="MACRO=VALUE for the compile")
    a = ap.parse_args()
    ins = disassemble(a.m, a.gu8, a.defines)
    peak, floor, n = collections.Counter(), {}, collections.Counter()
    bars = []
    for region, (f, ln, c, op) in zip(region_names([(f, ln) for f, ln, _, _ in ins]), ins):
        if c >= 0:
            peak[region] = max(peak[region], c)
            floor[region] = min(floor.get(region, 999), c)
            n[region] += 1
        if region == "grid_barrier" and op.startswith("RED") and c >= 0:
            bars.append(c)
    total = len(ins)
    print(f"decode_kernel<{a.m}>{' (gu8)' if a.gu8 else ''}: {total} instructions; live 32-bit registers per region "
          "(max / floor / instructions)")
    for r in sorted(peak, key=lambda k: -peak[k]):
        print(f"  {r:26s} {peak[r]:4d} {floor[r]:4d} {n[r]:7d}")
    if bars:
        print(f"at the grid barriers' arrivals: {sorted(bars)} (the registers that live across stages)")


if __name__ == "__main__":
    main()
