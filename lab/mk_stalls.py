"""Warp-stall samples of the megakernel per source line and per stage region, from an Nsight
Compute source-page export (lab/mk_ncu.py says how to make it on the device).

    python3 lab/mk_stalls.py mk_sass.csv [--m 1] [--top 40] [--smem]

--smem: shared-memory wavefronts per source line instead (the SourceCounters columns `L1 Wavefronts Shared` and
`… Excessive`: an excess is a bank conflict; on 2026-11-30 the tile dots' code loads were at twice their ideal).
A .csv.gz is read as is.

The CSV lists SASS instructions with absolute addresses; this compiles the same M's object here
(the build flags of flint/kernels/build.py, -cubin), reads its line table with `nvdisasm -g` and
maps every sampled instruction to a line of the kernel's sources (flint/kernels/*.cu, *.cuh). The instruction
counts must agree (else the CSV was made from another source: an error, not a guess).
"""
from __future__ import annotations

import argparse
import collections
import csv
import gzip
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from flint.kernels import build as _build  # noqa: E402
from flint.kernels.build import NVCC_FLAGS, find_nvcc  # noqa: E402

# ptxas options the kernel source asked for (older trees' MK_REG_USAGE_LEVEL; none where build.py has no such hook)
ptxas_extra = getattr(_build, "ptxas_extra", lambda: [])
KERNELS = ROOT / "flint" / "kernels"
# files whose functions are not regions: their inlined code counts for the caller (PTX wrappers, shared definitions,
# trace stamps); the tile dot (mk_mma.cuh) is a region of its own
NOT_REGIONS = ("mk_ptx.cuh", "mk_common.cuh", "mk_trace.cuh", "mk_config.cuh")

REASONS = ["barrier", "branch_resolving", "dispatch", "drain", "imc", "lg", "long_sb", "math", "membar", "mio",
           "misc", "no_inst", "not_selected", "selected", "short_sb", "sleep", "tex", "wait"]


def compile_cubin(m: int, gu8: bool, cubin: Path, defines: tuple[str, ...] = ()) -> None:
    """decode_kernel<m>'s object as the build makes it (its flags; gu8: the M = 1 object with gate|up's integer dot,
    which the backend launches for models in groups of 128, with its ptxas options), as a cubin; defines: MACRO=VALUE"""
    src = ROOT / "flint" / "kernels" / "megakernel.cu"
    flags = [f for f in NVCC_FLAGS if f not in ("-c",)] + (ptxas_extra() if gu8 else [])
    extra = (["-DFLINT_MK_GU8=1"] if gu8 else []) + [f"-D{d}" for d in defines]
    r = subprocess.run([find_nvcc(), *flags, f"-DFLINT_MK_M={m}", *extra, "-cubin", str(src), "-o", str(cubin)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"nvcc failed:\n{r.stderr[-3000:]}")


def decode_kernel_lines(text: str):
    """The lines of an nvdisasm listing that belong to decode_kernel's section (up to the next function's)"""
    inside = False
    for ln in text.splitlines():
        if ln.startswith(".text."):
            if inside:
                return  # the next function
            inside = "decode_kernel" in ln
            continue
        if inside:
            yield ln


def kernel_listing(text: str) -> list[tuple[int, tuple[str, int], str]]:
    """(address, (file, line), instruction) of every instruction of decode_kernel in an `nvdisasm -g` listing"""
    out, cur = [], ("?", 0)
    for ln in decode_kernel_lines(text):
        mm = re.search(r'//## File "([^"]+)", line (\d+)', ln)
        if mm:
            cur = (Path(mm.group(1)).name, int(mm.group(2)))
            continue
        mm = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(.*?)\s*;", ln)
        if mm:
            out.append((int(mm.group(1), 16), cur, mm.group(2).strip()))
    return out


def line_table(m: int, gu8: bool = False) -> list[tuple[str, int]]:
    """(file, line) of every instruction of decode_kernel<m> (gu8: see compile_cubin), in address order."""
    with tempfile.TemporaryDirectory() as td:
        cub = Path(td) / "mk.cubin"
        compile_cubin(m, gu8, cub)
        text = subprocess.run(["nvdisasm", "-g", "-c", str(cub)], check=True, capture_output=True, text=True).stdout
    return [where for _, where, _ in kernel_listing(text)]


def region_names(where: list[tuple[str, int]]) -> list[str]:
    """The region of each instruction, given its (file, line) in address order: the kernel function it belongs to
    (megakernel.cu's, or a stage header's); inlined helpers (cbar, warp_sum, the PTX helpers of NOT_REGIONS,
    intrinsics) count for the last line outside them before it (address order: the caller, approximately); the tile
    dot (mk_mma.cuh) is its own region."""
    starts: dict[str, list[tuple[int, str]]] = {}
    for path in sorted(KERNELS.glob("*.cu*")):
        if path.suffix not in (".cu", ".cuh") or path.name in NOT_REGIONS or path.name == "mk_mma.cuh":
            continue
        st = starts.setdefault(path.name, [])
        for i, t in enumerate(path.read_text().splitlines(), 1):
            mm = re.match(r"(?:__device__|__global__)[^(]*?(\w+)\(", t)
            if mm:
                st.append((i, mm.group(1)))
            elif t.startswith("    decode_kernel("):
                st.append((i, "decode_kernel"))
    helpers = {"cta_fence", "cbar", "warp_sum", "warp_max"}

    def func(f: str, ln: int) -> str:
        name = "?"
        for st, nm in starts[f]:
            if st <= ln:
                name = nm
        return name

    out, ctx = [], "decode_kernel"
    for f, ln in where:
        if f in starts and func(f, ln) not in helpers:
            ctx = func(f, ln)
        out.append("tile dot (mk_mma.cuh)" if f == "mk_mma.cuh" else ctx)
    return out


def kernel_sources() -> dict:
    """The kernel's source files' lines, by file name (for quoting a source line)"""
    return {p.name: p.read_text().splitlines() for p in sorted(KERNELS.glob("*.cu*")) if p.suffix in (".cu", ".cuh")}


def smem_report(table: list, ins: list, col: dict, top: int) -> None:
    """Shared-memory wavefronts per source line: all, the excess over the ideal (bank conflicts), and the launch's
    totals; lines ranked by their excess."""
    keys = ("L1 Wavefronts Shared", "L1 Wavefronts Shared Excessive", "L1 Wavefronts Shared Ideal")
    miss = [k for k in keys if k not in col]
    if miss:
        sys.exit(f"mk_stalls --smem: the export has no {miss} columns (profile with --section SourceCounters)")

    def num(x: str) -> float:
        try:
            return float(x.replace(",", ""))
        except ValueError:
            return 0.0

    per = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
    for where, r in zip(table, ins):
        for i, k in enumerate(keys):
            per[where][i] += num(r[col[k]])
    tw, te, ti = (sum(v[i] for v in per.values()) for i in range(3))
    print(f"{len(ins)} instructions: {tw / 1e6:.2f} M shared-memory wavefronts, {te / 1e6:.2f} M excess "
          f"({100 * te / max(tw, 1):.1f}%), {ti / 1e6:.2f} M ideal")
    src = kernel_sources()
    print(f"\ntop {top} source lines by excess wavefronts (excess / all / ideal, M)")
    for (f, ln), (w, e, i) in sorted(per.items(), key=lambda kv: -kv[1][1])[:top]:
        if w == 0:
            break
        text = src[f][ln - 1].strip()[:70] if f in src and 0 < ln <= len(src[f]) else ""
        print(f"{e / 1e6:6.2f} {w / 1e6:6.2f} {i / 1e6:6.2f}  {f}:{ln:<4d} {text}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--gu8", action="store_true", help="the M = 1 object with gate|up's integer dot (G128 models)")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--smem", action="store_true", help="shared-memory wavefronts (and their excess) per source line")
    a = ap.parse_args()
    rows = list(csv.reader(gzip.open(a.csv, "rt") if a.csv.endswith(".gz") else open(a.csv)))
    hdr = rows[1]
    col = {h: i for i, h in enumerate(hdr)}
    ins = [r for r in rows[2:] if len(r) == len(hdr) and r[0].startswith("0x")]
    table = line_table(a.m, a.gu8)
    if len(table) != len(ins):
        sys.exit(f"mk_stalls: {a.csv}: {len(ins)} SASS instructions, this source's decode_kernel<{a.m}> has "
                 f"{len(table)}: profile and analyse the same source")
    if a.smem:
        smem_report(table, ins, col, a.top)
        return
    by_line: dict = collections.defaultdict(lambda: collections.Counter())
    total = collections.Counter()
    for (f, ln), r in zip(table, ins):
        for k in REASONS:
            c = col.get(f"stall_{k}")
            v = int(float(r[c] or 0)) if c is not None else 0
            if v:
                by_line[(f, ln)][k] += v
                total[k] += v
    tot = sum(total.values())
    print(f"{len(ins)} instructions, {tot} stall samples: " +
          ", ".join(f"{k} {100 * v / tot:.1f}%" for k, v in total.most_common(8)))
    src = kernel_sources()
    why_region: dict = collections.defaultdict(lambda: collections.Counter())  # region -> reason -> samples
    for where, r in zip(region_names(table), ins):
        for k in REASONS:
            if f"stall_{k}" in col:
                why_region[where][k] += int(float(r[col[f"stall_{k}"]] or 0))
    print("\nsamples per region (inlined helpers count for their caller); main reasons, and no_inst (instruction "
          "fetch: a cold instruction cache or a branch target) within the region")
    for k, c in sorted(why_region.items(), key=lambda kv: -sum(kv[1].values())):
        v = sum(c.values())
        why = ", ".join(f"{kk} {vv * 100 // max(v, 1)}%" for kk, vv in c.most_common(3))
        print(f"{100 * v / tot:5.1f}%  {k:24s} [{why}; no_inst {100 * c['no_inst'] / max(v, 1):.1f}%]")
    nb = sum(total.values()) - total["barrier"]
    print(f"\nno_inst: {100 * total['no_inst'] / tot:.1f}% of all samples, {100 * total['no_inst'] / max(nb, 1):.1f}% of "
          "the samples not waiting at a block barrier")
    print(f"\ntop {a.top} source lines (share of all samples; main reasons)")
    for (f, ln), c in sorted(by_line.items(), key=lambda kv: -sum(kv[1].values()))[:a.top]:
        n = sum(c.values())
        text = src[f][ln - 1].strip()[:70] if f in src and 0 < ln <= len(src[f]) else ""
        why = ", ".join(f"{k} {v * 100 // n}%" for k, v in c.most_common(3))
        print(f"{100 * n / tot:5.1f}%  {f}:{ln:<4d} {text:70s} [{why}]")


if __name__ == "__main__":
    main()
