"""The megakernel's weight-ring protocol under random interleavings (lab/ring_model.py):
the mainline protocol and MK_SKIP2 (an experiment of older revisions) hold; skipping units without the counters
(the unit-skipping experiment, cf23d1e:flint/kernels/dev/experiments/4g_skip_units_UNSAFE.patch, which crashed on the
H200) reads stale slots, and the model finds it. The FFN split-K's slice units hold when
they arrive on the slot's parts barrier; without that arrival (the first GPU run of the split, which
hung) the model flags it."""
from __future__ import annotations

from ring_model import check, run


def test_mainline_protocol_holds():
    assert check("all", 400, seed=1) == []


def test_skip2_protocol_holds():
    assert check("skip2", 400, seed=2) == []


def test_skipping_without_counters_is_caught():
    fails = check("skip", 400, seed=3)
    assert fails, "the model should find the stale-slot read of experiment 4g"
    assert any("read lap" in f or "lands in phase" in f or "over-arrival" in f for f in fails)


def test_gate_up_like_stage_sequence():
    # Granite at M = 1 on the busiest block: qkv 2 x 7, o 2 x 7, gate|up 8 x 5, down 8 x 6, eight slots
    for seed in range(50):
        run("all", [(2, 7), (2, 7), (8, 5), (8, 6)] * 2, 8, seed)
        run("skip2", [(2, 7), (2, 7), (8, 5), (8, 6)] * 2, 8, seed)


def test_ffn_split_slice_units():
    # Granite at M = 1 on an FFN block: qkv 2 x 7, o 2 x 7, gate|up 8 x 5, then 5 slice chunks; 8 slots
    step = [(2, 7), (2, 7), (8, 5), (5, 0)]
    for seed in range(50):
        run("all", step * 3, 8, seed)
    assert check("all", 400, seed=4) == []
    fails = check("slice_noparts", 400, seed=5)
    assert len(fails) > 300, "the model should find the missing parts arrival (the hang of the first GPU run)"
    assert any("deadlock" in f for f in fails)


def test_inflight_cap_holds():
    # MK_INFLIGHT (older revisions; kInflight in mk_config.cuh): the producer waits for the copy `cap` before each
    # one to land (0 = no cap, the kernel before v11; 1, the kernel since v22; 2 = the model's default, the kernel's
    # from v11 to v21; caps >= the ring's slots are clamped to nslots - 1)
    for cap in (0, 1, 2, 9):
        assert check("all", 200, seed=10 + cap, inflight=cap) == []
    for seed in range(20):
        run("all", [(2, 7), (2, 7), (8, 5), (5, 0)] * 3, 8, seed, inflight=1)


def test_flat_split_holds():
    # MK_FLAT (an experiment of older revisions, out of the kernel since 2026-11-30, its patch in git history):
    # gate|up 8 tiles x 20 groups in 15 R chunks (R = 1: 2-3 parts per unit), the lm_head's 48 x 20 (a warp spans
    # several units), and random flattened stages mixed with the mainline's and slice units
    from ring_model import flat_parts
    parts = [flat_parts(8, 20, j) for j in range(8)]
    assert {w for p in parts for w in p} == set(range(15))  # every warp holds a part
    assert all(sorted(p[w][0] for w in p) == list(range(len(p))) for p in parts)  # parts 0..Su-1
    assert all(sum(p[w][3] for w in p) == 1 for p in parts)  # one reducer per unit
    assert sum(len(p) for p in parts) == 15 + 7  # every warp once, plus one per unit boundary inside a range
    for seed in range(30):
        run("flat", [(2, 7), (2, 7), (8, -20, 1), (5, 0)] * 2, 8, seed)
        run("flat", [(2, 7), (2, 7), (8, -20, 3), (5, 0)] * 2, 8, seed)
        run("flat", [(48, -20, 1)], 8, seed)
    assert check("flat", 400, seed=11) == []
    fails = check("flat_badcount", 200, seed=12)
    assert len(fails) > 150, "the model should find the reducer's missing arrival"


def test_flat_split_covers_every_group_once():
    # the kernel's arithmetic (flat_groups mirrors the MK_FLAT block of matvec_stage in
    # MK_FLAT's patch, in git history): every (tile, group) pair of the
    # block exactly once, each warp's pieces in unit order, a unit's pieces contiguous in chunk order
    from ring_model import flat_groups, flat_parts
    for nt, ng, rounds in [(8, 20, 1), (8, 20, 2), (8, 20, 3), (7, 20, 3), (48, 20, 1), (48, 20, 4), (2, 20, 1),
                           (1, 18, 1), (24, 18, 2), (5, 3, 1), (13, 7, 2)]:
        seen = {}
        for j in range(nt):
            fp = flat_parts(nt, ng, j, rounds)
            pieces = sorted((fp[w][0], flat_groups(nt, ng, rounds, w, j)) for w in range(15) if w in fp)
            assert all(flat_groups(nt, ng, rounds, w, j) is None for w in range(15) if w not in fp)
            lo = 0
            for _, (g0, g1) in pieces:  # in part order: contiguous from 0 to ng
                assert g0 == lo and g1 >= g0, (nt, ng, rounds, j, pieces)
                lo = g1
                for g in range(g0, g1):
                    seen[(j, g)] = seen.get((j, g), 0) + 1
            assert lo == ng, (nt, ng, rounds, j, pieces)
        assert len(seen) == nt * ng and set(seen.values()) == {1}


def test_rotating_reducer_holds():
    # MK_RED_ROT (an experiment of older revisions; the same patch): the reducing part rotates per unit; the
    # protocol is the mainline's
    for seed in range(30):
        run("rotate", [(2, 7), (2, 7), (8, 5), (5, 0)] * 2, 8, seed)
    assert check("rotate", 400, seed=13) == []


def test_qkv_early_order():
    # MK_QKV_EARLY (an experiment of older revisions, off and lost): the producer streams layer l + 1's q|k|v
    # tiles before layer l's down chunks and the consumers take them after those chunks. Granite's FFN block at
    # M = 1: q|k|v 2, o 1, gate|up 8 x 3, then the next q|k|v 2 and 5 chunks in 8 slots (2 + 5 <= 8). The model
    # holds for every such order within the bound and fails past it, by a deadlock or, where the skip spans a whole
    # lap, by a stale read (the 1-bit phase parity aliases laps l and l + 2); the kernel turns the order off there.
    from ring_model import early_schedule
    import random

    stages = [(2, 7), (1, 7), (8, 3), (2, 7), (5, 0), (1, 7), (8, 3), (2, 7), (5, 0), (1, 7), (8, 3), (5, 0), (48, 2)]
    first = [0]
    for st in stages:
        first.append(first[-1] + st[0])
    rng_units = lambda a, b: list(range(first[a], first[b]))  # noqa: E731  (units of stages [a, b))
    order = (rng_units(0, 3) + rng_units(4, 5) + rng_units(3, 4) + rng_units(5, 7) + rng_units(8, 9) + rng_units(7, 8)
             + rng_units(9, 11) + rng_units(11, 13))
    assert sorted(order) == list(range(first[-1]))
    for seed in range(30):
        run("early", stages, 8, seed, order=order)
    assert check("early", 300, seed=6) == []
    fails = check("early_toomany", 100, seed=7)
    assert len(fails) == 100 and any("deadlock" in f for f in fails)
    stages2, order2 = early_schedule(random.Random(8), 8)
    assert sorted(order2) == list(range(sum(st[0] for st in stages2)))


def test_qkv_early_kernel_positions_match_the_model():
    # MK_QKV_EARLY's bookkeeping in an older revision's megakernel.cu, step by step: the consumers' (slot, phase)
    # as the kernel moves them
    # (early_ring_step: back by nq + nch before the q|k|v stage of layer l > 0, forward by nch after it, forward by
    # nq before the down chunks of layer l < L - 1) must name, for every unit, the slot and lap parity the producer filled it in
    # (unit u of the producer's order: slot u mod nslots, parity (u // nslots) & 1), in the model's consumer order.
    import random

    from ring_model import early_schedule

    def kernel_positions(nq, no, ngu, nch, nlm, layers, nslots):
        slot, phase, seen = 0, 0, []

        def step(n):
            nonlocal slot, phase
            s = slot + n
            if s >= nslots:
                s, phase = s - nslots, phase ^ 1
            elif s < 0:
                s, phase = s + nslots, phase ^ 1
            slot = s

        def take(n):
            for _ in range(n):
                seen.append((slot, phase))
                step(1)

        for lay in range(layers):
            if lay > 0:
                step(-(nq + nch))
            take(nq)
            if lay > 0:
                step(nch)
            take(no)
            take(ngu)
            if lay + 1 < layers:
                step(nq)
            take(nch)
        take(nlm)
        return seen

    rng = random.Random(9)
    for _ in range(300):
        nslots = rng.randint(3, 8)
        stages, order = early_schedule(rng, nslots)
        nq, no, ngu = stages[0][0], stages[1][0], stages[2][0]
        nch = stages[4][0] if len(stages) > 4 and stages[4][1] == 0 else 0
        layers = (len(stages) - 1) // (3 + (1 if nch else 0))  # q|k|v, then per layer o, gate|up, next q|k|v, chunks
        got = kernel_positions(nq, no, ngu, nch, stages[-1][0], layers, nslots)
        want = [(u % nslots, (u // nslots) & 1) for u in order]
        assert got == want, (stages, nslots)
