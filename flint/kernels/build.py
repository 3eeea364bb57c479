"""Build the decode megakernel library (libflint_mk.so, also holding the draft rollout kernel): the ONE place
with nvcc flags.

The library is cached in ``$FLINT_KERNEL_DIR/<hash>/`` (default ``~/.cache/flint/kernels/<hash>/``),
keyed by a hash of the sources and flags, so a user on a Hopper GPU gets it built on first use and
never again. megakernel.cu is compiled once per token count M (1..8) in parallel, plus the host
part; ptxas's report is parsed and the build FAILS if any function spills registers.

    python -m flint.kernels.build            # build (or find) and print the ptxas report
    python -m flint.kernels.build --force    # rebuild even if cached
    python -m flint.kernels.build --traced   # the traced library (FLINT_MK_TRACE=1: stage stamps compiled in)
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
# every source of the library (megakernel.cu includes the mk_*.cuh headers; the host part shares mk_common.cuh)
SOURCES = ("mk_config.cuh", "mk_common.cuh", "mk_ptx.cuh", "mk_sync.cuh", "mk_trace.cuh", "mk_producer.cuh",
           "mk_stage.cuh", "mk_mma.cuh", "mk_matvec.cuh", "mk_ffn.cuh", "mk_kv8.cuh", "mk_att_mma.cuh",
           "mk_attention.cuh", "megakernel.cu", "megakernel_host.cu", "draft_kernel.cu")
M_VALUES = tuple(range(1, 9))
# more objects of megakernel.cu: (name, its -D flags); m1gu8 / m2gu8 = M = 1 / 2 with gate|up's integer dot (groups
# of 128; megakernel_host.cu kGu8MaxM); m1long / m1gu8long = the M = 1 ones for long contexts (attention on the tensor
# cores, more K/V tile buffers)
EXTRA_OBJECTS = (*((f"m{m}gu8", (f"-DFLINT_MK_M={m}", "-DFLINT_MK_GU8=1")) for m in (1, 2)),
                 ("m1long", ("-DFLINT_MK_M=1", "-DFLINT_MK_LONG=1")),
                 ("m1gu8long", ("-DFLINT_MK_M=1", "-DFLINT_MK_GU8=1", "-DFLINT_MK_LONG=1")),
                 # every object again with the int8 KV cache (FLINT_MK_KV8: launched only with it)
                 *((f"m{m}kv8", (f"-DFLINT_MK_M={m}", "-DFLINT_MK_KV8=1")) for m in range(1, 9)),
                 *((f"m{m}gu8kv8", (f"-DFLINT_MK_M={m}", "-DFLINT_MK_GU8=1", "-DFLINT_MK_KV8=1")) for m in (1, 2)),
                 ("m1longkv8", ("-DFLINT_MK_M=1", "-DFLINT_MK_LONG=1", "-DFLINT_MK_KV8=1")),
                 ("m1gu8longkv8", ("-DFLINT_MK_M=1", "-DFLINT_MK_GU8=1", "-DFLINT_MK_LONG=1", "-DFLINT_MK_KV8=1")))
LIB_NAME = "libflint_mk.so"

NVCC_FLAGS = [
    "-gencode", "arch=compute_90a,code=sm_90a",
    "-O3", "-lineinfo", "-std=c++17",
    "-Xptxas=-v,--warn-on-spills",
    "-Xfatbin=-compress-all",  # (the library 4x smaller, the same SASS: the driver inflates it at load)
    "-Xcompiler", "-fPIC",
]
LINK_FLAGS = ["-shared", "-gencode", "arch=compute_90a,code=sm_90a", "-Xcompiler", "-fPIC"]


try:
    from flint.errors import FlintError
except ImportError:  # (this file loaded by its path, outside the package: lab/sass_hash.py, lab/mk_ab1.py)
    FlintError = Exception


class BuildError(FlintError, RuntimeError):
    pass


# The traced library (FLINT_MK_TRACE=1) is a separate build: the stamps' runtime checks cost 2.5% per
# step when compiled into the default one (2026-11-29).
TRACE_FLAGS = ["-DMK_TRACE=1"]


def source_hash(traced: bool = False) -> str:
    h = hashlib.sha256()
    for name in SOURCES:
        h.update(name.encode())
        h.update((HERE / name).read_bytes())
    h.update(" ".join(NVCC_FLAGS + LINK_FLAGS).encode())
    h.update(repr(M_VALUES).encode())
    h.update(repr(EXTRA_OBJECTS).encode())
    if traced:
        h.update(" ".join(TRACE_FLAGS).encode())
    return h.hexdigest()[:16]


def cache_root() -> Path:
    env = os.environ.get("FLINT_KERNEL_DIR")
    return Path(env) if env else Path.home() / ".cache" / "flint" / "kernels"


def library_path(traced: bool = False) -> Path:
    return cache_root() / source_hash(traced) / LIB_NAME


def find_nvcc() -> str | None:
    nvcc = shutil.which("nvcc")
    if nvcc:
        return nvcc
    for cand in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if cand and (Path(cand) / "bin" / "nvcc").exists():
            return str(Path(cand) / "bin" / "nvcc")
    return None


_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


# The int8-KV-cache copies of the M = 1 objects (FLINT_MK_KV8) may spill up to this many bytes (stores or loads):
# m1kv8 40 / 60, m1gu8kv8 48 / 68, m1gu8longkv8 32 / 48, m1longkv8 0 (2026-12-02); in m1kv8 a 64-bit value spilled
# at the start and reloaded once per stage (25 local-memory instructions in its SASS). The fp16 objects, which every
# other run uses, must not spill at all.
KV8_SPILL_OK = 96


def parse_ptxas(report: str) -> list[dict]:
    """[{function, object, registers, stack, spill_stores, spill_loads}] from a `-Xptxas -v` report (object: the
    build job's name from its "== name" header, or None). Kernels carry their registers; a device function compiled
    as a call (not inlined) has no register line, only its stack and spills: registers None, kept so that its spills
    count."""
    out, cur, obj = [], None, None
    for line in report.splitlines():
        if line.startswith("== "):
            obj, cur = line[3:].strip(), None
            continue
        m = re.search(r"Function properties for (\S+)", line) or re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            if cur is None or cur["function"] != m.group(1):
                cur = {"function": m.group(1), "object": obj, "registers": None, "stack": 0, "spill_stores": 0,
                       "spill_loads": 0}
                out.append(cur)
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame", line)
        if m:
            cur["stack"] = int(m.group(1))
        m = _SPILL.search(line)
        if m:
            cur["spill_stores"], cur["spill_loads"] = int(m.group(1)), int(m.group(2))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            cur["registers"] = int(m.group(1))
    return out


def _run(cmd: list[str]) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise BuildError(f"nvcc failed ({' '.join(cmd)}):\n{r.stdout}\n{r.stderr}")
    return r.stdout + r.stderr


def _kv8_spill_ok(f: dict) -> bool:
    return str(f.get("object") or "").endswith("kv8") and max(f["spill_stores"], f["spill_loads"]) <= KV8_SPILL_OK


def spill_verdict(funcs: list[dict], traced: bool) -> str | None:
    """None when no function spills; else the refusal message, or (a traced build with
    FLINT_MK_TRACE_SPILLS_OK=1: trace variants may spill, their stamps perturb the timing anyway; or a lab variant
    built with FLINT_MK_SPILLS_OK=1, timed at the M whose objects do not spill) a warning."""
    spills = [f for f in funcs if (f["spill_stores"] or f["spill_loads"]) and not _kv8_spill_ok(f)]
    if not spills:
        return None
    listing = "\n".join(map(str, spills))
    if traced and os.environ.get("FLINT_MK_TRACE_SPILLS_OK") == "1":
        return "the traced library spills (allowed by FLINT_MK_TRACE_SPILLS_OK=1):\n" + listing
    if os.environ.get("FLINT_MK_SPILLS_OK") == "1":
        return "the library spills (allowed by FLINT_MK_SPILLS_OK=1: a lab variant):\n" + listing
    return "register spills (build refused" + (
        "; a traced build may set FLINT_MK_TRACE_SPILLS_OK=1" if traced else "") + "):\n" + listing


def build(force: bool = False, verbose: bool = False, traced: bool = False) -> Path:
    """Build (or find) libflint_mk.so (traced: the FLINT_MK_TRACE build); returns its path. Raises
    BuildError on failure or spills."""
    lib = library_path(traced)
    flags = NVCC_FLAGS + (TRACE_FLAGS if traced else [])
    if lib.exists() and not force:
        return lib
    nvcc = find_nvcc()
    if nvcc is None:
        raise BuildError("nvcc not found (install the CUDA toolkit >= 12.4 or set CUDA_HOME); "
                         "the megakernel is built from source on first use")
    lib.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="build-", dir=lib.parent))
    try:
        jobs = [(f"m{m}", [nvcc, *flags, f"-DFLINT_MK_M={m}", "-c", str(HERE / "megakernel.cu"),
                           "-o", str(tmp / f"mk_m{m}.o")]) for m in M_VALUES]
        jobs += [(name, [nvcc, *flags, *defs, "-c", str(HERE / "megakernel.cu"), "-o",
                         str(tmp / f"mk_{name}.o")]) for name, defs in EXTRA_OBJECTS]
        jobs.append(("host", [nvcc, *flags, "-c", str(HERE / "megakernel_host.cu"), "-o",
                              str(tmp / "mk_host.o")]))
        jobs.append(("draft", [nvcc, *flags, "-c", str(HERE / "draft_kernel.cu"), "-o", str(tmp / "draft.o")]))
        with ThreadPoolExecutor(max_workers=min(len(jobs), os.cpu_count() or 4)) as ex:
            reports = list(ex.map(lambda j: (j[0], _run(j[1])), jobs))
        text = "\n".join(f"== {name}\n{rep}" for name, rep in reports)
        funcs = parse_ptxas(text)
        verdict = spill_verdict(funcs, traced)
        if verdict and verdict.startswith("register spills"):
            raise BuildError(verdict)
        if verdict:  # a trace build only, on request: its stamps perturb the timing anyway; say so loudly
            print(f"flint.kernels.build: WARNING: {verdict}", file=sys.stderr)
        _run([nvcc, *LINK_FLAGS, "-o", str(tmp / LIB_NAME), *sorted(str(p) for p in tmp.glob("*.o"))])
        (tmp / "ptxas.txt").write_text(text)
        (tmp / LIB_NAME).replace(lib)
        (tmp / "ptxas.txt").replace(lib.parent / "ptxas.txt")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if verbose:
        print(report(traced))
    return lib


def report(traced: bool = False) -> str:
    p = library_path(traced).parent / "ptxas.txt"
    if not p.exists():
        return "(no ptxas report: library not built)"
    rows = parse_ptxas(p.read_text())
    lines = [f"{'function':60s} {'regs':>5s} {'stack':>6s} {'spill st/ld':>12s}"]
    for f in rows:
        m = re.search(r"decode_kernelILi(\d+)EE", f["function"])
        name = f"decode_kernel<M={m.group(1)}>" if m else f["function"][:60]
        regs = "call" if f["registers"] is None else str(f["registers"])  # (a device function compiled as a call)
        lines.append(f"{name:60s} {regs:>5s} {f['stack']:6d} "
                     f"{f['spill_stores']:5d}/{f['spill_loads']:<5d}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--force", action="store_true", help="rebuild even if a cached library exists")
    ap.add_argument("--traced", action="store_true", help="the traced library (FLINT_MK_TRACE=1)")
    args = ap.parse_args(argv)
    try:
        lib = build(force=args.force, traced=args.traced)
    except BuildError as e:
        print(f"build failed: {e}", file=sys.stderr)
        return 1
    print(report(args.traced))
    print(f"library: {lib}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
