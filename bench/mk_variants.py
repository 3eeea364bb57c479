"""Prepare megakernel variants for bench/mk_ab.py (run HERE, on the build machine; then one device call).

Each argument is NAME=SOURCE[+PATCH...][:MACRO=VALUE...]:
  SOURCE  a git revision (HEAD, 5e27073, ...) or "." for the working tree
  PATCH   a patch file applied with `git apply` on top of SOURCE (e.g. the losing variants in
          flint/kernels/dev/experiments/)
  MACRO   a `#define MACRO value` line of flint/kernels/megakernel.cu (or megakernel_host.cu, mk_common.cuh, mk_mma.cuh) rewritten
          to VALUE (the line must exist: a misspelt macro is an error, not a silent no-op); TRACE=1 (or
          any MK_WS_* macro) also builds the variant's traced library (FLINT_MK_TRACE=1 runs need it:
          build.py --traced)

    python3 bench/mk_variants.py base=HEAD hop1=.:MK_HOP_CAP=1 hop2=.:MK_HOP_CAP=2
    # device (carry: ["build"]):  FLINT_KERNEL_DIR=build/kernels python3 bench/mk_ab.py base hop1 hop2

Variants go to build/var/NAME (the flint package, without its bundled data, and bench/), libraries to
build/kernels/<source hash> (shared by identical sources). The carry must stay under 64 MB: the
total is printed, and old build/var and build/kernels entries not named here are removed.
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNEL = Path("flint/kernels/megakernel.cu")
# the sources a macro may be defined in (the first with a "#define NAME ..." line gets the value)
SOURCES = (KERNEL, Path("flint/kernels/megakernel_host.cu"), Path("flint/kernels/mk_common.cuh"),
           Path("flint/kernels/mk_mma.cuh"))


def parse(spec: str) -> tuple[str, str, list[str], list[tuple[str, str]]]:
    if "=" not in spec:
        raise SystemExit(f"mk_variants: {spec!r}: expected NAME=SOURCE[+PATCH...][:MACRO=VALUE...]")
    name, rest = spec.split("=", 1)
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise SystemExit(f"mk_variants: bad variant name {name!r}")
    parts = rest.split(":")
    src_and_patches = parts[0].split("+")
    macros = []
    for m in parts[1:]:
        if "=" not in m:
            raise SystemExit(f"mk_variants: {spec!r}: macro {m!r} must be MACRO=VALUE")
        macros.append(tuple(m.split("=", 1)))
    return name, src_and_patches[0], src_and_patches[1:], macros


def materialize(name: str, source: str, patches: list[str], macros: list[tuple[str, str]]) -> Path:
    dst = ROOT / "build" / "var" / name
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    if source == ".":
        for d in ("flint", "bench"):
            shutil.copytree(ROOT / d, dst / d, ignore=shutil.ignore_patterns("__pycache__"))
    else:
        arch = subprocess.run(["git", "-C", str(ROOT), "archive", source, "flint", "bench"], capture_output=True)
        if arch.returncode:
            raise SystemExit(f"mk_variants: {name}: git archive {source}: {arch.stderr.decode().strip()}")
        subprocess.run(["tar", "-x", "-C", str(dst)], input=arch.stdout, check=True)
    for patch in patches:
        p = (ROOT / patch).resolve()
        # git apply inside build/ would resolve paths against the enclosing repository and skip the
        # files silently; check and apply with an explicit work tree of its own instead
        r = subprocess.run(["git", "--git-dir", str(dst / ".none"), "--work-tree", str(dst), "apply", "--check",
                            str(p)], cwd=dst, capture_output=True, text=True)
        if not r.returncode:
            r = subprocess.run(["git", "--git-dir", str(dst / ".none"), "--work-tree", str(dst), "apply", str(p)],
                               cwd=dst, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"mk_variants: {name}: patch {patch} does not apply on {source}: {r.stderr.strip()}")
    texts = {f: (dst / f).read_text() for f in SOURCES}
    for macro, value in macros:
        if macro == "TRACE":
            continue
        pat = re.compile(rf"^(#define {re.escape(macro)}) \S+", re.M)
        where = [f for f in SOURCES if pat.search(texts[f])]
        if not where:
            files = " or ".join(map(str, SOURCES))
            raise SystemExit(f"mk_variants: {name}: no '#define {macro} ...' line in {files} of {source}")
        texts[where[0]] = pat.sub(lambda m: f"{m.group(1)} {value}", texts[where[0]], count=1)
    for f, text in texts.items():
        (dst / f).write_text(text)
    shutil.rmtree(dst / "flint" / "data", ignore_errors=True)  # bundled draft/corpus: not needed to time
    shutil.rmtree(dst / "flint" / "kernels" / "dev", ignore_errors=True)
    return dst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--keep", action="store_true", help="keep build/var and build/kernels entries not named")
    args = ap.parse_args()
    specs = [parse(s) for s in args.variants]
    names = [s[0] for s in specs]
    if len(set(names)) != len(names):
        raise SystemExit("mk_variants: variant names must differ")
    var = ROOT / "build" / "var"
    kdir = ROOT / "build" / "kernels"
    dsts = []
    for s in specs:  # every spec is checked before anything else is removed
        try:
            dsts.append(materialize(*s))
        except SystemExit:
            shutil.rmtree(var / s[0], ignore_errors=True)
            raise
    if not args.keep:
        for d in var.iterdir():
            if d.name not in names:
                shutil.rmtree(d)
        if kdir.exists():
            shutil.rmtree(kdir)
    used = []
    for (name, source, patches, macros), dst in zip(specs, dsts):
        r = subprocess.run([sys.executable, "-m", "flint.kernels.build"], cwd=dst, capture_output=True, text=True,
                           env={**__import__("os").environ, "FLINT_KERNEL_DIR": str(kdir)})
        if r.returncode:
            raise SystemExit(f"mk_variants: {name}: build failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        if any(m == "TRACE" or m.startswith("MK_WS") for m, _ in macros):
            rt = subprocess.run([sys.executable, "-m", "flint.kernels.build", "--traced"], cwd=dst, capture_output=True,
                                text=True, env={**__import__("os").environ, "FLINT_KERNEL_DIR": str(kdir)})
            if rt.returncode:
                raise SystemExit(f"mk_variants: {name}: traced build failed:\n{rt.stdout[-3000:]}\n{rt.stderr[-3000:]}")
        lib = [ln for ln in r.stdout.splitlines() if ln.startswith("library:")]
        used.append(lib[-1].split("/")[-2] if lib else "?")
        print(f"{name:12s} {source}{' + ' + ' + '.join(patches) if patches else ''}"
              f"{' ' + ' '.join(f'{m}={v}' for m, v in macros) if macros else ''}  -> build/kernels/{used[-1]}")
    size = sum(f.stat().st_size for f in (ROOT / "build").rglob("*") if f.is_file())
    print(f"build/ is {size / 2**20:.1f} MiB (the device carry limit is 64 MiB)")
    return 0 if size < 64 * 2**20 else 1


if __name__ == "__main__":
    sys.exit(main())
