"""Prepare megakernel variants for lab/mk_ab1.py / lab/mk_ab.py (run HERE, on the build machine; then one device call).

Each argument is NAME=SOURCE[+PATCH...][:KNOB=VALUE...]:
  SOURCE  a git revision (HEAD, 5e27073, ...) or "." for the working tree
  PATCH   a patch applied with `git apply` on top of SOURCE: a file (a path from the repository root, or absolute),
          or REV:PATH, a patch file as git history has it (the losing experiments, e.g.
          cf23d1e:flint/kernels/dev/experiments/20_nofence_bits64_128.patch)
  KNOB    a named knob of the kernel, set to VALUE in the variant's sources: every line of any
          flint/kernels/*.cu or *.cuh file of SOURCE that defines it, either a `#define KNOB VALUE` line or a
          `constexpr TYPE KNOB = VALUE;` line (e.g. `constexpr int kInflight = 1;` in mk_config.cuh), gets the new
          value (a trailing comment is kept). The line must exist: a misspelt knob is an error, not a silent no-op.
          An older revision is searched in its own file set (cf23d1e: `#define MK_INFLIGHT 1` in megakernel.cu).
          TRACE=1 (or, in revisions that have them, an MK_WS* knob) also builds the variant's traced library
          (FLINT_MK_TRACE=1 runs need it: build.py --traced)

    python3 lab/mk_variants.py base=. in2=.:kInflight=2
    # device (carry: ["build"]):  FLINT_KERNEL_DIR=build/kernels python3 lab/mk_ab1.py base in2 --m 1,2
    python3 lab/mk_variants.py base=. old=cf23d1e old2=cf23d1e:MK_INFLIGHT=2     # another revision's sources:
    # device: FLINT_KERNEL_DIR=build/kernels python3 lab/mk_ab.py base old old2   (mk_ab1 needs one host side)

Variants go to build/var/NAME (the flint package without its bundled data, and the tools: lab/ and bench/ without
bench/results, so a variant's own tools run against its own package), libraries to build/kernels/<source hash> (shared
by identical sources). The carry must stay under 64 MB: the total is printed, and old build/var and build/kernels
entries not named here are removed (the libraries of the named variants' sources are kept).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNELS = Path("flint/kernels")  # a knob may be defined in any *.cu / *.cuh file here (not in subfolders)
TOOLS = ("flint", "bench", "lab")  # what a variant holds (those of them its SOURCE has)
_SEP = re.compile(r":(?=[A-Za-z_]\w*=)")  # a ':' that starts KNOB=...: a value may hold '::' (Mat::kGu)
_QUAL = r"(?:(?:static|inline|const|__host__|__device__|__constant__)[ \t]+)*"


def source_hash(tree: Path) -> str:
    """The library hash of a materialized variant (its own build.py over its own sources)."""
    r = subprocess.run([sys.executable, "-c", "from flint.kernels.build import source_hash; print(source_hash())"],
                       cwd=tree, capture_output=True, text=True, check=True)
    return r.stdout.strip()


def parse(spec: str) -> tuple[str, str, list[str], list[tuple[str, str]]]:
    if "=" not in spec:
        raise SystemExit(f"mk_variants: {spec!r}: expected NAME=SOURCE[+PATCH...][:KNOB=VALUE...]")
    name, rest = spec.split("=", 1)
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise SystemExit(f"mk_variants: bad variant name {name!r}")
    parts = _SEP.split(rest)
    src_and_patches = parts[0].split("+")
    knobs = []
    for m in parts[1:]:
        knob, value = m.split("=", 1)
        if not value.strip() or "\n" in value:
            raise SystemExit(f"mk_variants: {spec!r}: knob {knob} needs a value (KNOB=VALUE)")
        knobs.append((knob, value.strip()))
    if ":" in src_and_patches[0]:
        raise SystemExit(f"mk_variants: {spec!r}: {parts[0]!r}: each knob must be KNOB=VALUE")
    return name, src_and_patches[0], src_and_patches[1:], knobs


def knob_patterns(knob: str) -> tuple[re.Pattern, re.Pattern]:
    """(the `#define KNOB VALUE` line, the `constexpr TYPE KNOB = VALUE;` line), each with groups head / value / tail:
    head + new value + tail is the rewritten line."""
    k = re.escape(knob)
    define = re.compile(rf"^(?P<head>[ \t]*#[ \t]*define[ \t]+{k}[ \t]+)(?P<value>\S.*?)"
                        rf"(?P<tail>[ \t]*(?://.*|/\*.*)?)$", re.M)
    constexpr = re.compile(rf"^(?P<head>[ \t]*(?:template[ \t]*<[^>\n]*>[ \t]*)?{_QUAL}constexpr[ \t]+{_QUAL}"
                           rf"[A-Za-z_][\w:<>, \t]*?[ \t]+{k}[ \t]*=[ \t]*)(?P<value>[^;\s][^;\n]*?)"
                           rf"(?P<tail>[ \t]*;.*)$", re.M)
    return define, constexpr


def set_knob(texts: dict[str, str], knob: str, value: str) -> list[str]:
    """Set `knob` to `value` in texts ({file name: source text}, changed in place) on every line that defines it
    (either form); returns the lines changed as "file:line". No such line: SystemExit."""
    if not re.fullmatch(r"[A-Za-z_]\w*", knob):
        raise SystemExit(f"mk_variants: {knob!r} is not a knob name (an identifier)")
    where = []
    for f in sorted(texts):
        text = texts[f]
        for pat in knob_patterns(knob):
            def sub(m: re.Match) -> str:
                if m.group("value").rstrip().endswith("\\"):
                    raise SystemExit(f"mk_variants: {f}: {knob}: a multi-line definition; set it by a patch")
                where.append(f"{f}:{text.count(chr(10), 0, m.start()) + 1}")
                return m.group("head") + value + m.group("tail")
            text = pat.sub(sub, text)
        texts[f] = text
    if not where:
        raise SystemExit(f"mk_variants: no '#define {knob} VALUE' or 'constexpr TYPE {knob} = VALUE;' line in "
                         f"{', '.join(sorted(texts))}")
    return where


def kernel_texts(root: Path) -> dict[str, str]:
    """{file name: text} of the kernel sources a knob may be set in: root/flint/kernels/*.cu and *.cuh."""
    files = sorted(p for p in (root / KERNELS).iterdir() if p.is_file() and p.suffix in (".cu", ".cuh"))
    return {p.name: p.read_text() for p in files}


def traced(knobs: list[tuple[str, str]]) -> bool:
    """Does the variant need its traced library too (TRACE=1, or a knob of the warp-stamp traces)?"""
    return any(k == "TRACE" or k.startswith("MK_WS") for k, _ in knobs)


def _ignore(folder: str, names: list[str]) -> list[str]:
    """What a working-tree copy leaves out: caches, and bench/results (measurements, megabytes of carry)."""
    skip = {"__pycache__", ".pytest_cache"} | ({"results"} if Path(folder) == ROOT / "bench" else set())
    return [n for n in names if n in skip]


def materialize(name: str, source: str, patches: list[str], knobs: list[tuple[str, str]]) -> tuple[Path, list[str]]:
    """build/var/NAME: SOURCE's package and tools, the patches applied, the knobs set; returns it and the knobs' lines."""
    dst = ROOT / "build" / "var" / name
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    if source == ".":
        for d in TOOLS:
            if (ROOT / d).is_dir():
                shutil.copytree(ROOT / d, dst / d, ignore=_ignore)
    else:
        # an older revision has the tools it had (bench/ only, before lab/): archive those of TOOLS it holds
        ls = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", source, "--", *TOOLS],
                            capture_output=True, text=True)
        have = ls.stdout.split()
        if ls.returncode or "flint" not in have:
            raise SystemExit(f"mk_variants: {name}: git ls-tree {source}: {ls.stderr.strip() or 'no flint/ there'}")
        arch = subprocess.run(["git", "-C", str(ROOT), "archive", source, *have], capture_output=True)
        if arch.returncode:
            raise SystemExit(f"mk_variants: {name}: git archive {source}: {arch.stderr.decode().strip()}")
        subprocess.run(["tar", "-x", "-C", str(dst)], input=arch.stdout, check=True)
        shutil.rmtree(dst / "bench" / "results", ignore_errors=True)  # (as _ignore does for the working tree)
    for i, patch in enumerate(patches):
        p = (ROOT / patch).resolve()
        if not p.is_file() and ":" in patch:  # REV:PATH, a patch in git history
            show = subprocess.run(["git", "-C", str(ROOT), "show", patch], capture_output=True)
            if show.returncode:
                raise SystemExit(f"mk_variants: {name}: git show {patch}: {show.stderr.decode().strip()}")
            p = dst / f".patch{i}"
            p.write_bytes(show.stdout)
        # git apply inside build/ would resolve paths against the enclosing repository and skip the
        # files silently; check and apply with an explicit work tree of its own instead
        r = subprocess.run(["git", "--git-dir", str(dst / ".none"), "--work-tree", str(dst), "apply", "--check",
                            str(p)], cwd=dst, capture_output=True, text=True)
        if not r.returncode:
            r = subprocess.run(["git", "--git-dir", str(dst / ".none"), "--work-tree", str(dst), "apply", str(p)],
                               cwd=dst, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"mk_variants: {name}: patch {patch} does not apply on {source}: {r.stderr.strip()}")
        if p.parent == dst:
            p.unlink()
    texts = kernel_texts(dst)
    before = dict(texts)
    where = []
    for knob, value in knobs:
        if knob == "TRACE":
            continue
        try:
            lines = set_knob(texts, knob, value)
        except SystemExit as e:
            raise SystemExit(f"mk_variants: {name} ({source}): {str(e).removeprefix('mk_variants: ')}") from None
        where.append(f"{knob}={value} at {', '.join(lines)}")
    for f, text in texts.items():
        if text != before[f]:
            (dst / KERNELS / f).write_text(text)
    shutil.rmtree(dst / "flint" / "data", ignore_errors=True)  # bundled draft/corpus: not needed to time
    shutil.rmtree(dst / "flint" / "kernels" / "dev", ignore_errors=True)  # (older revisions: the lab was here)
    return dst, where


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
    dsts, wheres = [], []
    for s in specs:  # every spec is checked before anything else is removed
        try:
            dst, where = materialize(*s)
        except SystemExit:
            shutil.rmtree(var / s[0], ignore_errors=True)
            raise
        dsts.append(dst)
        wheres.append(where)
    if not args.keep:  # (the libraries the named variants' sources hash to stay: a rebuild is minutes)
        for d in var.iterdir():
            if d.name not in names:
                shutil.rmtree(d)
        wanted = {source_hash(dst) for dst in dsts}
        for d in kdir.iterdir() if kdir.exists() else ():
            if d.name not in wanted:
                shutil.rmtree(d)
    used = []
    for (name, source, patches, knobs), dst, where in zip(specs, dsts, wheres):
        r = subprocess.run([sys.executable, "-m", "flint.kernels.build"], cwd=dst, capture_output=True, text=True,
                           env={**os.environ, "FLINT_KERNEL_DIR": str(kdir)})
        if r.returncode:
            raise SystemExit(f"mk_variants: {name}: build failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        if traced(knobs):
            rt = subprocess.run([sys.executable, "-m", "flint.kernels.build", "--traced"], cwd=dst, capture_output=True,
                                text=True, env={**os.environ, "FLINT_KERNEL_DIR": str(kdir)})
            if rt.returncode:
                raise SystemExit(f"mk_variants: {name}: traced build failed:\n{rt.stdout[-3000:]}\n{rt.stderr[-3000:]}")
        lib = [ln for ln in r.stdout.splitlines() if ln.startswith("library:")]
        used.append(lib[-1].split("/")[-2] if lib else "?")
        print(f"{name:12s} {source}{' + ' + ' + '.join(patches) if patches else ''}"
              f"{' ' + ' '.join(f'{m}={v}' for m, v in knobs) if knobs else ''}  -> build/kernels/{used[-1]}")
        for w in where:
            print(f"{'':12s}   {w}")
    size = sum(f.stat().st_size for f in (ROOT / "build").rglob("*") if f.is_file())
    print(f"build/ is {size / 2**20:.1f} MiB (the device carry limit is 64 MiB)")
    return 0 if size < 64 * 2**20 else 1


if __name__ == "__main__":
    sys.exit(main())
