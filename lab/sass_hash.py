"""Per-object SASS fingerprints of the megakernel library, built here (no GPU): the proof that a source change
which should not move the kernel (a refactor, a comment, a file split) leaves every object's machine code as it was.

    python3 lab/sass_hash.py                      # this tree's flint/kernels
    python3 lab/sass_hash.py --src DIR --traced   # another copy of flint/kernels; also the traced objects
    python3 lab/sass_hash.py --json out.json      # write the table as JSON too

Each object of flint/kernels/build.py (one per M, the extra objects, the host part) is compiled with build.py's own
flags, disassembled with cuobjdump -sass (on PATH, or $CUOBJDUMP) and reduced to its instructions (addresses,
comments and file names dropped); the table gives an md5 per kernel function and the ptxas registers / spills.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_build(src: Path):
    spec = importlib.util.spec_from_file_location("flint_build_copy", src / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def normalized_sass(obj: Path, cuobjdump: str) -> dict[str, str]:
    """{function: md5 of its instruction lines} from one object file."""
    out = subprocess.run([cuobjdump, "-sass", str(obj)], capture_output=True, text=True, check=True).stdout
    funcs: dict[str, list[str]] = {}
    cur = None
    for line in out.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:  # (the anonymous namespace's name hashes the file and flags: not the code)
            cur = funcs.setdefault(re.sub(r"_GLOBAL__N__\w+?_[0-9a-f]{8}(?=\d)", "_ANON_", m.group(1)), [])
            continue
        if cur is None:
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s*(.*?)\s*;", line)
        if m:
            cur.append(re.sub(r"_GLOBAL__N__\w+?_[0-9a-f]{8}(?=\d)", "_ANON_", m.group(1)))
    return {f: hashlib.md5("\n".join(v).encode()).hexdigest()[:12] for f, v in funcs.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, default=ROOT / "flint" / "kernels")
    ap.add_argument("--traced", action="store_true", help="also the traced objects (build.py's TRACE_FLAGS)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    b = load_build(args.src.resolve())
    nvcc = b.find_nvcc() or sys.exit("sass_hash: nvcc not found")
    cuobjdump = os.environ.get("CUOBJDUMP", "cuobjdump")
    src = args.src.resolve()
    kernel = src / "megakernel.cu"
    jobs = []
    for traced in (False, True) if args.traced else (False,):
        flags = b.NVCC_FLAGS + (b.TRACE_FLAGS if traced else [])
        tag = "t" if traced else ""
        jobs += [(f"{tag}m{m}", [nvcc, *flags, f"-DFLINT_MK_M={m}", "-c", str(kernel)]) for m in b.M_VALUES]
        extra = b.ptxas_extra() if hasattr(b, "ptxas_extra") else []
        jobs += [(f"{tag}{n}", [nvcc, *flags, *extra, *d, "-c", str(kernel)]) for n, d in b.EXTRA_OBJECTS]
    jobs.append(("host", [nvcc, *b.NVCC_FLAGS, "-c", str(src / "megakernel_host.cu")]))
    tmp = Path(tempfile.mkdtemp(prefix="sass-"))

    def run(job):
        name, cmd = job
        obj = tmp / f"{name}.o"
        r = subprocess.run([*cmd, "-o", str(obj)], capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"sass_hash: {name}: nvcc failed\n{r.stderr[-4000:]}")
        return name, normalized_sass(obj, cuobjdump), b.parse_ptxas(r.stdout + r.stderr)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as ex:
        results = list(ex.map(run, jobs))
    table = {}
    for name, sass, ptx in results:
        anon = lambda f: re.sub(r"_GLOBAL__N__\w+?_[0-9a-f]{8}(?=\d)", "_ANON_", f)
        regs = {anon(f["function"]): f for f in ptx}
        for fn, h in sorted(sass.items()):
            r = regs.get(fn, {})
            table[f"{name}:{fn}"] = {"md5": h, "registers": r.get("registers"),
                                    "spill": (r.get("spill_stores", 0), r.get("spill_loads", 0))}
            print(f"{name:7s} {h}  regs {r.get('registers')!s:>4}  spill {r.get('spill_stores', 0)}/"
                  f"{r.get('spill_loads', 0)}  {fn[:70]}")
    whole = hashlib.md5(json.dumps({k: v['md5'] for k, v in table.items()}, sort_keys=True).encode()).hexdigest()
    print(f"all objects: {whole}")
    if args.json:
        args.json.write_text(json.dumps({"all": whole, "objects": table}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
