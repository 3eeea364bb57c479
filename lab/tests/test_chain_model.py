"""lab/chain_model.py: the layer's chain model against the traced stage stamps, and its parts' invariants. CPU."""
from __future__ import annotations

import dataclasses

import pytest

import chain_model as cm


@pytest.fixture(scope="module")
def fitted():
    traces = cm.load_traces()
    return traces, cm.fit(traces)


def test_traces_cover_both_shapes_at_m1_to_m4():
    traces = cm.load_traces()
    for shape in cm.SHAPES:
        for m in (1, 2, 3, 4):
            obs = cm.observed(traces[(shape, m)])
            assert obs["layer"] > 10, (shape, m, obs["layer"])


def test_calibrated_within_ten_percent_at_m1_and_m4(fitted):
    # the bar for the model: within 10% of the measured layer on Granite and SmolLM2 shapes, M = 1 and M = 4
    traces, prims = fitted
    rows = {(r["shape"], r["M"]): r for r in cm.calibration(traces, prims)}
    for shape in cm.SHAPES:
        for m in (1, 4):
            r = rows[(shape, m)]
            assert abs(r["err"]) < 0.10, r


def test_fitted_primitives_are_physical(fitted):
    # a hand-off costs at least the idle one-way flag hop (0.22 µs, GPU.md) and less than a whole stage; the dot's
    # group step on resident data is within 2x of what the measured dot rate gives (10.35 Tcodes/s over 132 SMs:
    # 15 warps x 16 rows x 128 codes a step -> 0.39 µs)
    _, p = fitted
    assert 0.22 <= p.hop < 3.0
    assert 0.39 / 2 < p.group < 0.39 * 2
    assert all(getattr(p, n) >= 0 for n in cm.FIT_NAMES)


def test_parts_choice_matches_the_host():
    # docs/megakernel.md: Granite at M = 1: q|k|v 1-2 tiles per block in 7 parts of 3 groups, gate|up 8 tiles in 3
    # parts, lm_head 47-48 tiles in 2 parts
    assert cm.parts_and_steps(2, 20) == (7, 3)
    assert cm.parts_and_steps(8, 20)[0] == 3
    assert cm.parts_and_steps(48, 20)[0] == 2
    assert cm.parts_and_steps(0, 20) == (1, 0)


def test_layer_bytes_of_granite():
    # docs/megakernel.md: a Granite-4.1-3B layer streams about 44 MB (q|k|v 4.9, o 3.5, gate|up 22.3, down 13.1-13.9)
    b = cm.SHAPES["granite-4.1-3b"].layer_bytes()
    assert 43e6 < b < 46e6, b
    assert cm.SHAPES["granite-4.1-3b"].seg_bytes(2560) == 16 * 1360


def test_the_stream_binds_only_when_it_is_slow(fitted):
    _, p = fitted
    g = cm.SHAPES["granite-4.1-3b"]
    fast = cm.layer(g, cm.CARDS["h200"], 1, p)
    slow = cm.layer(g, dataclasses.replace(cm.CARDS["h200"], read_gbs=400.0), 1, p)
    assert slow["categories"]["stream"] > 5 * max(fast["categories"]["stream"], 0.1)
    assert slow["layer_us"] > fast["layer_us"]
    free = cm.layer(g, dataclasses.replace(cm.CARDS["h200"], read_gbs=400.0), 1, p,
                    dataclasses.replace(cm.TODAY, stream_free=True))
    assert free["categories"]["stream"] == 0.0
    assert free["layer_us"] == pytest.approx(max(free["chain_us"], free["stream_us"]))


def test_every_candidate_shortens_the_chain(fitted):
    _, p = fitted
    card = cm.CARDS["h200"]
    for shape in cm.SHAPES.values():
        today = cm.chain_us(shape, card, 1, p)
        for d in cm.DESIGNS[1:]:
            assert cm.chain_us(shape, card, 1, p, d) <= today + 1e-9, (shape.name, d.name)
        together = cm.chain_us(shape, card, 1, p, cm.DESIGNS[-1])
        assert together < min(cm.chain_us(shape, card, 1, p, d) for d in cm.DESIGNS[1:-1])


def test_predicts_the_other_cards_steps(fitted):
    # fitted on the H200's traces, checked on the H100's flint bench file (not in the fit): the M = 1 and M = 4 steps
    # of both shapes within 10%
    _, prims = fitted
    rows = {r["what"]: r for r in cm.checks(prims)}
    for shape in cm.SHAPES:
        for m in (1, 4):
            r = rows[f"{shape} M = {m} step µs"]
            assert abs(r["err"]) < 0.10, r


def test_pinned_primitives_hold_their_measured_bound(fitted):
    # a primitive an A/B bounded (PINNED) stays under its bound, and the traces alone would have put more there
    traces, p = fitted
    free = cm.fit(traces, pinned={})
    for name, pin in cm.PINNED.items():
        assert getattr(p, name) <= pin.bound + 1e-9, (name, getattr(p, name))
        assert getattr(free, name) > pin.bound, (name, getattr(free, name))
        assert "docs/megakernel-log.md" in pin.evidence
        assert any(d.name == pin.design for d in cm.DESIGNS), pin.design


def test_predicts_m8_beyond_the_traces(fitted):
    # the traces stop at M = 4; the H100 bench's M = 8 steps (rows of several load rounds, an rstd pass first) within
    # 10%
    _, prims = fitted
    rows = {r["what"]: r for r in cm.checks(prims)}
    for shape in cm.SHAPES:
        r = rows[f"{shape} M = 8 step µs"]
        assert abs(r["err"]) < 0.10, r
