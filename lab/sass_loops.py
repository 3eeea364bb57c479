"""The tensor-core inner loops of a built megakernel library, from its SASS (no GPU needed): for one
token count M, every backward branch whose loop body holds an HMMA or IMMA and is shorter than 200
instructions (the tile dots' group loops), as (instructions, mma) pairs.

    python3 lab/sass_loops.py [LIB] [--m 1]       # default LIB: the library of this tree
    python3 lab/sass_loops.py build/kernels/<hash>/libflint_mk.so --m 1

docs/megakernel-log.md quotes these counts (fp16 dot 91 instructions per group of 128 codes at M = 1; the
integer dot of MK_IDOT, an experiment of older revisions, 60: 120 per two groups, the compiler unrolls that loop
by 2).
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def kernel_sass(lib: str, m: int) -> list[tuple[int, str]]:
    out = subprocess.run(["cuobjdump", "-sass", lib], capture_output=True, text=True, check=True).stdout
    funcs = re.split(r"\n\s*Function : ", out)
    name = f"decode_kernelILi{m}EE"
    body = next((f for f in funcs if f.split("\n", 1)[0].find(name) >= 0), None)
    if body is None:
        raise SystemExit(f"sass_loops: no decode_kernel<{m}> in {lib}")
    ins = []
    for ln in body.splitlines():
        mm = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", ln)
        if mm:
            ins.append((int(mm.group(1), 16), mm.group(2).strip()))
    return ins


def mma_loops(ins: list[tuple[int, str]], limit: int = 200) -> list[tuple[int, int]]:
    idx = {a: i for i, (a, _) in enumerate(ins)}
    found = set()
    for i, (a, s) in enumerate(ins):
        mm = re.search(r"BRA.*?0x([0-9a-f]+)", s)
        if not mm:
            continue
        tgt = int(mm.group(1), 16)
        if tgt < a and tgt in idx:
            body = ins[idx[tgt]:i + 1]
            n_mma = sum(("HMMA" in x) or ("IMMA" in x) for _, x in body)
            if n_mma and len(body) < limit:
                found.add((len(body), n_mma))
    return sorted(found)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("lib", nargs="?", default=None)
    ap.add_argument("--m", type=int, default=1)
    args = ap.parse_args()
    lib = args.lib
    if lib is None:
        from flint.kernels.build import build

        lib = str(build())
    for n, k in mma_loops(kernel_sass(lib, args.m)):
        print(f"loop of {n:4d} instructions, {k} mma")
    return 0


if __name__ == "__main__":
    sys.exit(main())
