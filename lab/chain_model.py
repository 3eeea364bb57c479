"""The decode step's chain, modelled: where a layer's time goes today and what each candidate design would leave.

One layer of the megakernel at M tokens, seen by block 0, is a chain of segments: grid hand-offs (a relaxed counter,
tagged words, the counted residual's polls, a fenced barrier), stagings (L2 load rounds, the RMSNorm's reduction, the
per-value conversion to the dot's terms), tile dots on data in shared memory, attention (q seen, a one-tile split's
scores / softmax / P·V per row, the partials published and merged) and the FFN's down partials. Beside it runs the
block's weight stream: one producer lane copying tile-segments into a ring of ``nslots`` slots, one bulk copy in
flight, each copy taking a latency plus its bytes at the SM's share of the read bandwidth; a dot waits for its unit
to land, and a unit's copy waits for a free slot. ``layer()`` simulates that for a few layers (the ring carries over)
and reports the steady layer split into categories.

The primitive costs (``Prims``) are fitted (``fit``) to the traced build's stage stamps of block 0 (per layer, µs;
``lab/mk_verify_stages.py``, the files in ``TRACE_FILES``) over both shapes and M = 1..4 at ctx 512; the fit is
checked on the layer's total per (shape, M), and by leaving each M out of the fit and predicting it
(``leave_one_m_out``). A candidate design (``DESIGNS``) is a named change of primitives or of the chain's
structure, each with the physical reason for its figure; its rows are projections and are printed as such.

    python3 lab/chain_model.py               # the fit, the calibration table, the candidates' table (markdown)
    python3 lab/chain_model.py --json OUT    # the same as one JSON document

Here (CPU). Tests: lab/tests/test_chain_model.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

ROOT = Path(__file__).resolve().parents[1]
NCT = 480          # consumer threads per block (15 warps)
NCW = 15
SMS = 132
KSEG = 2560        # codes per K segment
TILE = 16          # rows per tile
DS_CHUNK = 34      # down-slice tiles per ring slot (the FFN split-K)
PART_FLOATS = 32   # K parts x M per tile (mk_common.cuh)
TRACE_FILES = ("verify_stages_warps_2026-12-03.json",)  # H200, 2026-12-03: Granite and SmolLM2, M = 1..4, ctx 512


@dataclass(frozen=True)
class Card:
    name: str
    read_gbs: float   # the read bandwidth flint bench measures on it (GB/s)
    l2_mb: float


CARDS = {"h200": Card("H200", 4108.0, 60.0), "h100": Card("H100", 3000.0, 50.0)}


@dataclass(frozen=True)
class Shape:
    name: str
    H: int
    I: int
    nh: int
    nkv: int
    D: int
    L: int
    V: int
    G: int            # group size of the synthetic weights flint bench and the traces use
    ffn_split: bool   # the FFN split-K runs (>= 90% of the grid are FFN blocks)
    nslots: tuple     # ring slots at M = 1..4 (megakernel_host.cu's layout: what shared memory leaves)

    def seg_bytes(self, K: int) -> int:
        """One tile-segment (16 row-segments of <= KSEG codes: codes, then (scale, min) half2 per group)."""
        k = min(K, KSEG)
        srb = -(-(k // 2 + (k // self.G) * 4) // 16) * 16
        return TILE * srb

    def layer_bytes(self) -> int:
        """The layer's repacked weights (q|k|v, o, gate|up, down)."""
        q = (self.nh + 2 * self.nkv) * self.D
        b = 0
        for n, k in ((q, self.H), (self.H, self.nh * self.D), (2 * self.I, self.H), (self.H, self.I)):
            b += (n // TILE) * self.seg_bytes(k) * -(-k // KSEG)
        return b

    def head_bytes(self) -> int:
        return (self.V // TILE) * self.seg_bytes(self.H)


SHAPES = {
    "granite-4.1-3b": Shape("granite-4.1-3b", 2560, 8192, 40, 8, 64, 40, 100352, 128, True, (8, 8, 7, 7)),
    "smollm2-135m": Shape("smollm2-135m", 576, 1536, 9, 3, 64, 30, 49152, 64, False, (16, 16, 16, 16)),
}


def parts_and_steps(tiles: int, groups: int, M: int = 1, handoff: int = 2) -> tuple[int, int]:
    """The host's K-part choice (megakernel_host.cu): S <= min(32 / M, 15, groups) minimising
    ceil(T S / 15) (ceil(groups / S) + handoff), the smallest S on ties; returns (S, the dot's group steps per warp =
    ceil(T S / 15) ceil(groups / S))."""
    if tiles <= 0:
        return 1, 0
    best = None
    for s in range(1, min(PART_FLOATS // M, NCW, groups) + 1):
        c = -(-tiles * s // NCW) * (-(-groups // s) + handoff)
        if best is None or c < best[0]:
            best = (c, s)
    s = best[1]
    return s, -(-tiles * s // NCW) * -(-groups // s)


@dataclass(frozen=True)
class Prims:
    """Primitive costs, µs (fitted; ``fit``)."""
    hop: float = 0.8        # a relaxed grid hand-off (counter or tagged words): the last writer seen by the waiter
    fence: float = 1.0      # a fenced barrier's extra (the release waits for the block's bulk copies in flight)
    spread_ffn: float = 1.5  # the slowest FFN block behind block 0 at the end of the down partials
    round: float = 0.5      # one round of a staging's L2 loads
    reduce: float = 0.2     # a block reduction (the RMSNorm's sum of squares, the rstd)
    conv: float = 0.1       # per value a consumer thread stages (fp16 hi / lo terms, group sums)
    conv_fx: float = 0.05   # its extra where the staging polls tagged or counted words (the M <= 2 protocol)
    group: float = 0.05     # one group step of a tile dot on resident data (per warp; the fp16 hi / lo mma dot)
    group_m: float = 0.1    # its growth per extra token, relative
    group_i8: float = 0.05  # the same for gate|up's raw-byte integer dot (groups of 128, M <= 2)
    tail: float = 0.7       # a matvec stage's K-part hand-off and epilogue
    tail_m: float = 0.1     # its growth per extra token
    att_q: float = 1.5      # attention: the split sees its q rows and its tile lands
    att_row: float = 0.3    # attention: a one-tile split's scores, softmax and P·V per row (q heads per kv head x M)
    att_merge: float = 2.0  # attention: the partials published, seen by the merger and merged
    att_merge_seq: float = 2.0  # the M = 2 objects' sequential tagged merge, beyond the M = 1 register merge
    chunk: float = 0.8      # a down-slice chunk (34 tiles: dots and the adds into the residual)
    chunk_m: float = 0.2    # its growth per extra token, relative
    reduce_ffn: float = 1.0  # M >= 3 with the split: the fenced dpart reduction (per token row pass)

    def replace(self, **kw) -> "Prims":
        return dataclasses.replace(self, **kw)


FIT_NAMES = tuple(f.name for f in dataclasses.fields(Prims))
# A bulk copy's latency beyond its bytes at the SM's share of the read bandwidth: Little's law on GPU.md's streaming
# read with one 16-byte load in flight per thread (256 threads, 4 KiB per SM in flight: 1.30 TB/s on the H200, i.e.
# 4096 B / 9.85 GB/s per SM = 0.42 µs). Not fitted: the traces cannot separate it from the dots (the ring is full).
COPY_LAT = 0.42


@dataclass(frozen=True)
class Design:
    """A candidate: primitives replaced (``prims``: name -> value or callable(Prims) -> value) and structural
    switches, with the reason for each figure (``why``)."""
    name: str
    why: str
    prims: dict = field(default_factory=dict)
    stream_free: bool = False     # the weights never wait (they are in shared memory or L2 when the chain needs them)
    no_o_stage: bool = False      # o applied to each split's partial: no o staging, no hand-off between merge and o
    staging_once: bool = False    # the rows' owners publish the converted terms and rstd; every block copies them
    fx_all_m: bool = False        # every M on the M = 1 protocol (relaxed hand-offs, the counted residual)
    one_pass_rstd: bool = False   # the normed stagings' sums of squares from their own loads at any row length

    def apply(self, p: Prims) -> Prims:
        return p.replace(**{k: (v(p) if callable(v) else v) for k, v in self.prims.items()})


TODAY = Design("today (kernel v31)", "the shipped protocol")


def _fx(shape: Shape, M: int, design: Design) -> bool:
    return shape.ffn_split and (M <= 2 or design.fx_all_m)


def _staging(p: Prims, M: int, K: int, norm: bool, fx: bool, design: Design) -> float:
    words = M * K / 8  # 8-float words
    rounds = math.ceil(words / (NCT * (3 if M == 4 else 2)))  # (mk_stage.cuh's U: words a thread loads a round)
    # a normed row of several rounds: compute_rstd's pass over the row first (one more round of loads)
    rounds += 1 if norm and rounds > 1 and not (design.staging_once or design.one_pass_rstd) else 0
    if design.staging_once:  # copies of the owners' converted rows: the loads stay, the reduction and conversion go
        return p.round * rounds
    return p.round * rounds + (p.reduce if norm else 0.0) + (p.conv + (p.conv_fx if fx else 0.0)) * M * K / NCT


def ffn_tiles(shape: Shape) -> int:
    """gate|up tiles an FFN block owns under the split (flint/megakernel.py ffn_split_plan: the fewest tiles, a
    multiple of 4 dividing the gate|up tiles, with at most one FFN block per SM)."""
    ntg = 2 * shape.I // TILE
    return next(t for t in range(4, ntg + 1, 4) if ntg % t == 0 and ntg // t <= SMS)


def _block_units(shape: Shape, M: int) -> list[tuple[str, int, int]]:
    """Block 0's stream units of one layer, in ring order: (stage, bytes, count)."""
    q = (shape.nh + 2 * shape.nkv) * shape.D
    t_qkv = -(-(q // TILE) // SMS)
    t_o = -(-(shape.H // TILE) // SMS)
    if shape.ffn_split:
        t_gu = ffn_tiles(shape)
        n_ds = -(-(shape.H // TILE) // DS_CHUNK)
        ds = [("down", DS_CHUNK * 40 * TILE, n_ds)]
    else:
        t_gu = -(-(2 * shape.I // TILE) // SMS)
        ds = [("down", shape.seg_bytes(shape.I), -(-(shape.H // TILE) // SMS))]
    return [("qkv", shape.seg_bytes(shape.H), t_qkv), ("o", shape.seg_bytes(shape.nh * shape.D), t_o),
            ("gu", shape.seg_bytes(shape.H), t_gu), *ds]


def _unit_time(p: Prims, shape: Shape, M: int, stage: str, tiles: int) -> float:
    """One stream unit's dot on resident data: a down-slice chunk, or a tile's share of its stage's dots (all
    the block's tiles, the warps' K parts in parallel)."""
    if stage == "down" and shape.ffn_split:
        return p.chunk * (1 + p.chunk_m * (M - 1))
    K = {"qkv": shape.H, "o": shape.nh * shape.D, "gu": shape.H, "down": shape.I}[stage]
    _, steps = parts_and_steps(tiles, -(-K // shape.G), M)
    per = p.group_i8 if stage == "gu" and shape.G == 128 and M <= 2 else p.group
    return steps * per * (1 + p.group_m * (M - 1)) / max(tiles, 1)


def layer(shape: Shape, card: Card, M: int, prims: Prims, design: Design = TODAY, layers: int = 4) -> dict:
    """The steady layer (the last of ``layers`` simulated), block 0: per stage µs and per category µs
    ("hand-off", "staging", "dot", "attention", "tail", "stream": waiting for a unit to land)."""
    p = design.apply(prims)
    fx = _fx(shape, M, design)
    nslots = shape.nslots[min(M, 4) - 1]
    r_sm = card.read_gbs * 1e3 / SMS  # bytes per µs per SM
    units = []  # per layer: (stage, bytes, dot µs per unit)
    for st, nbytes, cnt in _block_units(shape, M):
        units += [(st, nbytes, _unit_time(p, shape, M, st, cnt))] * cnt
    U = len(units)
    landed, freed = [], []   # per global unit index
    issue_free = 0.0         # the producer: its previous copy landed

    def produce_until(q: int) -> None:
        """Land units up to q: a copy starts when the one before it landed (one in flight) and its slot is free (the
        unit nslots before it consumed; the consumers take units in ring order, so that time is known)."""
        nonlocal issue_free
        while len(landed) <= q:
            i = len(landed)
            if design.stream_free:
                landed.append(-math.inf)
                continue
            start = max(issue_free, freed[i - nslots] if i >= nslots else 0.0)
            issue_free = start + COPY_LAT + units[i % U][1] / r_sm
            landed.append(issue_free)

    t = 0.0
    cats = dict.fromkeys(("hand-off", "staging", "dot", "attention", "tail", "stream"), 0.0)
    stages = {}
    for lay in range(layers):
        last = lay == layers - 1
        c = dict.fromkeys(cats, 0.0)
        s = {}
        t0 = t
        base = lay * U

        def run_units(stage: str, t: float) -> float:
            for j, (st, _, dt) in enumerate(units):
                if st != stage:
                    continue
                q = base + j
                produce_until(q)
                wait = max(0.0, landed[q] - t)
                c["stream"] += wait
                t += wait + dt
                c["dot"] += dt
                freed.append(t)
            return t

        def add(cat: str, name: str, dt: float) -> None:
            nonlocal t
            c[cat] += dt
            s[name] = s.get(name, 0.0) + dt
            t += dt

        # q|k|v: the residual's readiness (counted polls after the slowest FFN block; else the fenced barrier)
        if fx:
            add("hand-off", "qkv.wait", p.hop + p.spread_ffn)
        else:
            add("hand-off", "qkv.wait", p.hop + p.fence + (p.spread_ffn if shape.ffn_split else 0.0))
        add("staging", "qkv.stage_x", _staging(p, M, shape.H, True, fx, design))
        t1 = t
        t = run_units("qkv", t)
        s["qkv.tiles"] = t - t1
        add("tail", "qkv.tail", p.tail + p.tail_m * (M - 1))
        # attention: q and the tile, the split's rows, the merge; then the hop to o
        R = shape.nh // shape.nkv * M
        add("attention", "attn.q", p.att_q)
        add("attention", "attn", p.att_row * R + p.att_merge + (p.att_merge_seq if fx and M == 2 else 0.0))
        if not design.no_o_stage:
            add("hand-off", "bar2", p.hop + (0.0 if fx else p.fence))
            add("staging", "o.stage_x", _staging(p, M, shape.nh * shape.D, False, fx, design))
            t1 = t
            t = run_units("o", t)
            s["o.tiles"] = t - t1
            add("tail", "o.tail", p.tail + p.tail_m * (M - 1))
        else:  # o's dots folded into the splits (their tiles still stream), its adds into the residual
            t1 = t
            t = run_units("o", t)
            s["o.tiles"] = t - t1
        add("hand-off", "bar3", p.hop + (0.0 if fx else p.fence))
        add("staging", "gate_up.stage_x", _staging(p, M, shape.H, True, fx, design))
        t1 = t
        t = run_units("gu", t)
        s["gate_up.tiles"] = t - t1
        add("tail", "gate_up.tail", p.tail + p.tail_m * (M - 1))
        if shape.ffn_split:
            t1 = t
            t = run_units("down", t)
            s["dpart"] = t - t1
            if not fx:  # the fenced dpart reduction (M >= 3)
                add("hand-off", "bar4", p.hop + p.fence)
                add("staging", "down.reduce", p.reduce_ffn * M)
        else:
            add("hand-off", "bar4", p.hop + p.fence)
            add("staging", "down.stage_x", _staging(p, M, shape.I, False, fx, design))
            t1 = t
            t = run_units("down", t)
            s["down.tiles"] = t - t1
            add("tail", "down.tail", p.tail + p.tail_m * (M - 1))
        if last:
            cats, stages = c, s
            stages["layer"] = t - t0
    # where nothing waits for the weights, the layer still cannot beat its bytes at the read bandwidth
    stream_us = shape.layer_bytes() / (card.read_gbs * 1e3)
    chain = stages["layer"]
    return dict(layer_us=max(chain, stream_us) if design.stream_free else chain, chain_us=chain,
                stream_us=stream_us, stages=stages, categories=cats)


def step_us(shape: Shape, card: Card, M: int, prims: Prims, design: Design = TODAY) -> float:
    """A step: L layers plus the lm_head streamed at the read bandwidth (it is one long stream, no hop follows)."""
    return shape.L * layer(shape, card, M, prims, design)["layer_us"] + shape.head_bytes() / (card.read_gbs * 1e3)


# ---- the data: the traced stage stamps, grouped into what the model predicts ----

def load_traces(files=TRACE_FILES) -> dict:
    """{(shape, M): stages dict} from the traced JSON files in bench/results."""
    out = {}
    for f in files:
        for rec in json.loads((ROOT / "bench" / "results" / f).read_text()):
            if "stages" not in rec:
                continue
            for m, st in rec["stages"].items():
                out[(rec["model"], int(m))] = st
    return out


def observed(st: dict) -> dict:
    """The traced stages grouped as the model's segments (µs per layer, block 0)."""
    ffn = st.get("dpart", 0) + st.get("bar4", 0) + st.get("down", 0)
    return {
        "qkv": st["rstd1"] + st["qkv"] + st["bar1"] + st["bar5"],
        "qkv.stage_x": st["qkv.stage_x"],
        "qkv.tiles": st["qkv.tiles"],
        "o.tiles": st["o.tiles"],
        "gate_up.tiles": st["gate_up.tiles"],
        "attn+bar2": st["attn"] + st["bar2"],
        "attn.q": st["w.attn.q"],
        "o": st["o"],
        "o.stage_x": st["o.stage_x"],
        "bar3": st["bar3"],
        "gate_up": st["gate_up"],
        "gate_up.stage_x": st["gate_up.stage_x"],
        "ffn": ffn,
        "layer": sum(st[k] for k in ("rstd1", "qkv", "bar1", "attn", "bar2", "o", "bar3", "gate_up", "dpart", "bar4",
                                     "down", "bar5")),
    }


def predicted(shape: Shape, card: Card, M: int, prims: Prims, design: Design = TODAY) -> dict:
    r = layer(shape, card, M, prims, design)
    s = r["stages"]
    fx = _fx(shape, M, design)
    # the traced "qkv" span: the staging's wait is inside it where the counted residual is polled; bar5 holds it
    # otherwise (observed() sums both)
    out = {
        "qkv": s["qkv.wait"] + s["qkv.stage_x"] + s["qkv.tiles"] + s["qkv.tail"],
        "qkv.stage_x": s["qkv.stage_x"] + (s["qkv.wait"] if fx else 0.0),
        "qkv.tiles": s["qkv.tiles"],
        "o.tiles": s["o.tiles"],
        "gate_up.tiles": s["gate_up.tiles"],
        "attn+bar2": s["attn.q"] + s["attn"] + s.get("bar2", 0.0),
        "attn.q": s["attn.q"],
        "o": s.get("o.stage_x", 0.0) + s["o.tiles"] + s.get("o.tail", 0.0),
        "o.stage_x": s.get("o.stage_x", 0.0),
        "bar3": s["bar3"],
        "gate_up": s["gate_up.stage_x"] + s["gate_up.tiles"] + s["gate_up.tail"],
        "gate_up.stage_x": s["gate_up.stage_x"],
        "ffn": s.get("dpart", 0.0) + s.get("bar4", 0.0) + s.get("down.reduce", 0.0) + s.get("down.stage_x", 0.0) +
        s.get("down.tiles", 0.0) + s.get("down.tail", 0.0),
        "layer": r["layer_us"],
    }
    return out


FIT_KEYS = ("qkv", "qkv.stage_x", "qkv.tiles", "attn+bar2", "attn.q", "o", "o.stage_x", "o.tiles", "bar3", "gate_up",
            "gate_up.stage_x", "gate_up.tiles", "ffn")


# Upper bounds on primitives the traces cannot separate, from A/Bs that removed the work: name -> (µs, evidence).
# Without them the fit puts a staging's wait for its loads into the RMSNorm's block reduction (1.48 µs a staging)
# and projects a 10% step from taking the reduction off the chain, which the A/B below measured as nothing.
@dataclass(frozen=True)
class Pin:
    bound: float      # µs, the primitive's upper bound
    design: str       # the DESIGNS row the A/B built
    measured: float   # its step / the base's (Granite M = 1, H200)
    evidence: str


PINNED = {
    "reduce": Pin(0.2, "rstd in the epilogue", 1.0024,
                  "the normed stagings without the block reduction, the reducers scaling (MK_RSTD_DEFER, "
                  "docs/megakernel-log.md): 11/30 rounds faster, noise: the reduction costs at most ~0.1-0.2 µs a "
                  "staging"),
}


def fit(traces: dict, card: Card = CARDS["h200"], keys=None, start: Prims = Prims(), pinned=None) -> Prims:
    """Least squares over every (shape, M) in ``traces`` and every observable (non-negative primitives, each at most
    its ``pinned`` bound: ``PINNED`` unless given; ``{}``: the traces alone)."""
    keys = list(traces) if keys is None else keys
    pinned = PINNED if pinned is None else pinned
    x0 = np.array([getattr(start, n) for n in FIT_NAMES])
    hi = np.array([pinned[n].bound if n in pinned else 20.0 for n in FIT_NAMES])
    x0 = np.minimum(x0, hi / 2)

    def resid(x):
        p = Prims(*x)
        r = []
        for key in keys:
            shape = SHAPES[key[0]]
            obs = observed(traces[key])
            pred = predicted(shape, card, key[1], p)
            r += [pred[k] - obs[k] for k in FIT_KEYS]
        return np.array(r)

    sol = least_squares(resid, x0, bounds=(np.zeros_like(x0), hi), x_scale=0.5)
    return Prims(*sol.x)


def calibration(traces: dict, prims: Prims, card: Card = CARDS["h200"]) -> list[dict]:
    rows = []
    for key in sorted(traces):
        obs = observed(traces[key])
        pred = predicted(SHAPES[key[0]], card, key[1], prims)
        rows.append(dict(shape=key[0], M=key[1], measured=obs["layer"], model=pred["layer"],
                         err=pred["layer"] / obs["layer"] - 1, stages={k: (obs[k], pred[k]) for k in FIT_KEYS}))
    return rows


def leave_one_m_out(traces: dict, card: Card = CARDS["h200"]) -> list[dict]:
    """Fit without M = m (both shapes), predict m's layers."""
    rows = []
    for m in sorted({k[1] for k in traces}):
        keep = {k: v for k, v in traces.items() if k[1] != m}
        p = fit(keep, card)
        for key in sorted(k for k in traces if k[1] == m):
            obs = observed(traces[key])["layer"]
            pred = predicted(SHAPES[key[0]], card, m, p)["layer"]
            rows.append(dict(shape=key[0], M=m, measured=obs, model=pred, err=pred / obs - 1))
    return rows


# ---- checks on measurements the fit does not use ----

CHECK_FILE = "bench_chain_figure_h100_2026-12-07.json"  # flint bench on the H100: verify curve and chain figure


def checks(prims: Prims, file: str = CHECK_FILE) -> list[dict]:
    """The model against a flint bench file of another card: each shape's M = 1 step and its verify ratios (the
    steps timed one by one with CUDA events), and the chain figure against the streamed layer."""
    doc = json.loads((ROOT / "bench" / "results" / file).read_text())
    card = CARDS["h100"] if "H100" in doc["device"] else CARDS["h200"]
    card = dataclasses.replace(card, read_gbs=doc["hbm_read_GBps"])
    rows = []
    for v in doc["verify"]:
        name = v["model"].split(":")[-1]
        if name not in SHAPES or not v.get("us_per_step"):
            continue
        shape = SHAPES[name]
        base = next(x["us_per_step"] for x in doc["verify"] if x["model"] == v["model"] and x["m"] == 1)
        model = step_us(shape, card, v["m"], prims)
        model1 = step_us(shape, card, 1, prims)
        rows.append(dict(what=f"{name} M = {v['m']} step µs", measured=v["us_per_step"], model=model,
                         err=model / v["us_per_step"] - 1))
        if v["m"] > 1:
            rows.append(dict(what=f"{name} M = {v['m']} / M = 1", measured=v["us_per_step"] / base,
                             model=model / model1, err=(model / model1) / (v["us_per_step"] / base) - 1))
    for r in doc["results"]:
        name = r["model"].split(":")[-1]
        if name in SHAPES and r.get("chain_us_per_layer"):
            rows.append(dict(what=f"{name} chain µs a layer", measured=r["chain_us_per_layer"],
                             model=chain_us(SHAPES[name], card, 1, prims),
                             err=chain_us(SHAPES[name], card, 1, prims) / r["chain_us_per_layer"] - 1))
    return rows


# ---- the candidates: each figure's reason in ``why``; every row a projection ----

HOP_FLOOR = 0.5  # a hand-off at one L2 round trip under load (GPU.md: one-way 0.22-0.30 µs idle; a poll sees it
                 # a round trip later)

DESIGNS = (
    TODAY,
    Design("stream never waits", "pages handed stage to stage or L2 prefetch by idle blocks: every unit resident "
           "when its dot starts", stream_free=True),
    Design("hops at one L2 round trip", f"every grid hand-off {HOP_FLOOR} µs, no fence, no straggler (balanced FFN "
           "blocks)", prims=dict(hop=HOP_FLOOR, fence=0.0, spread_ffn=0.0)),
    Design("staging once", "the rows' owners publish the converted terms and rstd; blocks only copy them",
           staging_once=True),
    Design("rstd in the epilogue", "the staging converts x * norm_w and the epilogue scales by the rstd: the sums of "
           "squares ride the staging's loads, no block reduction before the conversion, no rstd pass over a long row",
           prims=dict(reduce=0.0), one_pass_rstd=True),
    Design("o on the splits", "o applied to each split's partial and merged linearly: no o staging, no hop "
           "between merge and o", no_o_stage=True),
    Design("dot 3x on resident data", "the lop3 conversion and fewer instructions a code: group steps / 3",
           prims=dict(group=lambda p: p.group / 3, chunk=lambda p: p.chunk / 3)),
    Design("attention merge at one hop", "a kv head's splits merged by the o blocks as they stage (no separate "
           "merge hop): att_merge = one hop floor", prims=dict(att_merge=HOP_FLOOR)),
    Design("all of the above", "every change above together", stream_free=True, staging_once=True,
           no_o_stage=True, fx_all_m=True,
           prims=dict(hop=HOP_FLOOR, fence=0.0, spread_ffn=0.0, group=lambda p: p.group / 3,
                      chunk=lambda p: p.chunk / 3, att_merge=HOP_FLOOR)),
)


def chain_us(shape: Shape, card: Card, M: int, prims: Prims, design: Design = TODAY) -> float:
    """The chain figure (flint bench's): µs a layer with the weights resident (the stream never waits)."""
    d = dataclasses.replace(design, stream_free=True)
    return layer(shape, card, M, prims, d)["chain_us"]


def candidates(prims: Prims, card: Card) -> list[dict]:
    rows = []
    for d in DESIGNS:
        for sname, shape in SHAPES.items():
            r1 = layer(shape, card, 1, prims, d)
            st1 = step_us(shape, card, 1, prims, d)
            st4 = step_us(shape, card, 4, prims, d)
            floor = shape.L * shape.layer_bytes() / (card.read_gbs * 1e3) + shape.head_bytes() / (card.read_gbs * 1e3)
            resident = shape.L * shape.layer_bytes() < card.l2_mb * 1e6  # an L2 figure, not a bandwidth one
            rows.append(dict(design=d.name, why=d.why, shape=sname, layer_us=r1["layer_us"],
                             chain_us=chain_us(shape, card, 1, prims, d), step_us=st1, tok_s=1e6 / st1,
                             mbu=None if resident else floor / st1, m4_ratio=st4 / st1, categories=r1["categories"]))
    return rows


def _md_calibration(rows: list[dict]) -> str:
    out = ["| shape | M | measured µs/layer | model | error |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['shape']} | {r['M']} | {r['measured']:.2f} | {r['model']:.2f} | {100 * r['err']:+.1f}% |")
    return "\n".join(out)


def _md_split(prims: Prims, card: Card) -> str:
    out = ["| shape | M | layer | hand-off | staging | attention | dot | tail | stream wait |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for sname, shape in SHAPES.items():
        for M in (1, 4):
            r = layer(shape, card, M, prims)
            c = r["categories"]
            out.append(f"| {sname} | {M} | {r['layer_us']:.1f} | {c['hand-off']:.1f} | {c['staging']:.1f} | "
                       f"{c['attention']:.1f} | {c['dot']:.1f} | {c['tail']:.1f} | {c['stream']:.1f} |")
    return "\n".join(out)


def _md_candidates(rows: list[dict], card: Card) -> str:
    out = [f"| design ({card.name}, projected) | shape | µs/layer | chain µs/layer | tok/s | MBU | M=4 / M=1 |",
           "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        mbu = "L2" if r["mbu"] is None else f"{100 * r['mbu']:.0f}%"
        out.append(f"| {r['design']} | {r['shape']} | {r['layer_us']:.1f} | {r['chain_us']:.1f} | {r['tok_s']:.0f} | "
                   f"{mbu} | {r['m4_ratio']:.2f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--card", default="h200", choices=sorted(CARDS))
    a = ap.parse_args()
    traces = load_traces()
    prims = fit(traces)
    cal = calibration(traces, prims)
    loo = leave_one_m_out(traces)
    card = CARDS[a.card]
    cand = candidates(prims, card)
    print("fitted primitives (µs):", ", ".join(f"{n} {getattr(prims, n):.3f}" for n in FIT_NAMES))
    print("\ncalibration (H200 traces, block 0, ctx 512):\n" + _md_calibration(cal))
    print("\nleave one M out (fit without it, predict it):\n" + _md_calibration(loo))
    print("\nchecks on data the fit did not use (" + CHECK_FILE + "):")
    print("| what | measured | model | error |\n|---|---:|---:|---:|")
    chk = checks(prims)
    for r in chk:
        print(f"| {r['what']} | {r['measured']:.2f} | {r['model']:.2f} | {100 * r['err']:+.1f}% |")
    free = fit(traces, pinned={})
    g, h200 = SHAPES["granite-4.1-3b"], CARDS["h200"]
    print("\nthe A/Bs behind PINNED (Granite M = 1, H200; step variant / base):")
    print("| design | measured | model, traces alone | model, pinned |\n|---|---:|---:|---:|")
    for pin in PINNED.values():
        d = next(x for x in DESIGNS if x.name == pin.design)
        print(f"| {d.name} | {pin.measured:.4f} | {step_us(g, h200, 1, free, d) / step_us(g, h200, 1, free):.3f} | "
              f"{step_us(g, h200, 1, prims, d) / step_us(g, h200, 1, prims):.3f} |")
    print("\nwhere a layer goes today (model, H200):\n" + _md_split(prims, CARDS["h200"]))
    print("\n" + _md_candidates(cand, card))
    if a.json:
        Path(a.json).write_text(json.dumps(dict(prims=dataclasses.asdict(prims), calibration=cal,
                                                leave_one_m_out=loo, checks=chk, candidates=cand, card=card.name),
                                           indent=1, default=float))


if __name__ == "__main__":
    main()
