"""lab/mk_variants.py's variant specs and knob rewriting (CPU, no build): both knob forms (`#define NAME VALUE`,
`constexpr TYPE NAME = VALUE;`) in any kernel source file, comments kept, a misspelt knob an error."""
from pathlib import Path

import pytest

import mk_variants as mv

ROOT = Path(__file__).resolve().parents[2]

CONFIG = """#pragma once
namespace mk {
constexpr int kInflight = 1;   // copies in flight
constexpr bool kDotPerm = true;
inline constexpr unsigned long long kBits = 44ull;
template <int M> constexpr bool kFx = M == 1;
constexpr int kInflightMax = 4;
}
"""
KERNEL = """#ifndef MK_QTAG
#define MK_QTAG 1  // tagged q
#endif
#define MK_DS_INFLIGHT MK_INFLIGHT
#if FLINT_MK_M == 1
#define MK_FX1 1
#else
#define MK_FX1 0
#endif
#define MK_CAT(a, b) MK_CAT2(a, b)
constexpr bool kIdot = kIdotMask != 0;  // x
"""


def texts():
    return {"mk_config.cuh": CONFIG, "megakernel.cu": KERNEL}


def test_parse():
    assert mv.parse("a=.") == ("a", ".", [], [])
    assert mv.parse("b=cf23d1e+p.patch+cf23d1e:flint/x.patch:MK_INFLIGHT=2:kMat=Mat::kGu:X=(1 << 3)") == (
        "b", "cf23d1e", ["p.patch", "cf23d1e:flint/x.patch"], [("MK_INFLIGHT", "2"), ("kMat", "Mat::kGu"), ("X", "(1 << 3)")])
    for bad in ("a", "a=.:MK_X", "a=.:kX= ", "bad name=."):
        with pytest.raises(SystemExit):
            mv.parse(bad)


def test_constexpr_knobs():
    t = texts()
    assert mv.set_knob(t, "kInflight", "2") == ["mk_config.cuh:3"]
    assert mv.set_knob(t, "kDotPerm", "false") == ["mk_config.cuh:4"]
    assert mv.set_knob(t, "kBits", "172ull") == ["mk_config.cuh:5"]
    assert mv.set_knob(t, "kFx", "false") == ["mk_config.cuh:6"]
    lines = t["mk_config.cuh"].splitlines()
    assert lines[2:6] == ["constexpr int kInflight = 2;   // copies in flight", "constexpr bool kDotPerm = false;",
                          "inline constexpr unsigned long long kBits = 172ull;",
                          "template <int M> constexpr bool kFx = false;"]
    assert "constexpr int kInflightMax = 4;" in lines  # a longer name is another knob
    assert t["megakernel.cu"] == KERNEL


def test_define_knobs():
    t = texts()
    assert mv.set_knob(t, "MK_QTAG", "0") == ["megakernel.cu:2"]
    assert "#define MK_QTAG 0  // tagged q" in t["megakernel.cu"]
    assert mv.set_knob(t, "MK_FX1", "0") == ["megakernel.cu:6", "megakernel.cu:8"]  # every definition
    assert mv.set_knob(t, "kIdot", "false") == ["megakernel.cu:11"]
    assert "constexpr bool kIdot = false;  // x" in t["megakernel.cu"]
    assert "#define MK_DS_INFLIGHT MK_INFLIGHT" in t["megakernel.cu"]


@pytest.mark.parametrize("knob", ["kInflght", "MK_INFLIGHT", "MK_CAT", "kIdotMask", "M", "not a name"])
def test_missing_knob_is_an_error(knob):
    t = texts()
    with pytest.raises(SystemExit):
        mv.set_knob(t, knob, "1")
    assert t == texts()


def test_working_tree_sources():
    t = mv.kernel_texts(ROOT)
    assert "megakernel.cu" in t and all(f.endswith((".cu", ".cuh")) for f in t)
    with pytest.raises(SystemExit, match="kNoSuchKnob"):
        mv.set_knob(t, "kNoSuchKnob", "1")


def test_source_hash_of_a_tree_is_its_build_hash():
    """The libraries kept between runs are found by the hash each variant tree's own build.py gives."""
    from flint.kernels.build import source_hash

    assert mv.source_hash(ROOT) == source_hash()


@pytest.mark.parametrize("patch", sorted(p.name for p in (ROOT / "lab" / "patches").glob("*.patch")))
def test_lab_patches_apply_to_the_tree(patch):
    """A variant patch kept in the lab still applies to today's kernel sources (else rebase it or log it as lost)."""
    import subprocess

    r = subprocess.run(["git", "apply", "--check", str(ROOT / "lab" / "patches" / patch)], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
