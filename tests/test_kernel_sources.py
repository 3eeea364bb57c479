"""The megakernel's sources stay the shipping design in readable files (CPU only, no nvcc needed):
every source is in build.py's hash, none is over 800 lines, and the knobs are few and in one place."""
from __future__ import annotations

import re
from pathlib import Path

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


def test_the_python_side_knows_the_kernels_segment_tile_cap():
    """flint.megakernel refuses shapes over mk::MAX_ACC_TILES from the config (refuse_shape): its copy must be the
    kernel's."""
    from flint.megakernel import MAX_ACC_TILES

    src = (Path(build.__file__).parent / "mk_common.cuh").read_text()
    m = re.search(r"constexpr int MAX_ACC_TILES = (\d+);", src)
    assert m and int(m.group(1)) == MAX_ACC_TILES
