"""The megakernel's weight-ring protocol under random interleavings (lab/ring_model.py): the kernel's protocol holds,
with the FFN split-K's slice units and every in-flight cap; the model finds the faults it exists to find (warps that
skip units read stale slots; slice units that skip the parts barrier make later arrivals land in another lap's phase)."""
from __future__ import annotations

from ring_model import check, run


def test_kernel_protocol_holds():
    assert check("all", 400, seed=1) == []


def test_skipping_units_is_caught():
    fails = check("skip", 400, seed=3)
    assert fails, "the model should find the stale-slot reads of warps that skip units"
    assert any("read lap" in f or "lands in phase" in f or "over-arrival" in f for f in fails)


def test_gate_up_like_stage_sequence():
    # Granite at M = 1 on the busiest block: qkv 2 x 7, o 2 x 7, gate|up 8 x 5, down 8 x 6, eight slots
    for seed in range(50):
        run("all", [(2, 7), (2, 7), (8, 5), (8, 6)] * 2, 8, seed)


def test_ffn_split_slice_units():
    # Granite at M = 1 on an FFN block: qkv 2 x 7, o 2 x 7, gate|up 8 x 5, then 5 slice chunks; 8 slots
    step = [(2, 7), (2, 7), (8, 5), (5, 0)]
    for seed in range(50):
        run("all", step * 3, 8, seed)
    assert check("all", 400, seed=4) == []
    fails = check("slice_noparts", 400, seed=5)
    assert len(fails) > 250, "the model should find the missing parts arrival"
    assert all("lands in phase" in f or "deadlock" in f for f in fails)


def test_inflight_cap_holds():
    # the producer waits for the copy `cap` before each one to land: 0 = no cap, 1 = kInflight, 2 = kLmInflight;
    # caps >= the ring's slots are clamped to nslots - 1
    for cap in (0, 1, 2, 9):
        assert check("all", 200, seed=10 + cap, inflight=cap) == []
    for seed in range(20):
        run("all", [(2, 7), (2, 7), (8, 5), (5, 0)] * 3, 8, seed, inflight=1)
