"""A model checker for the megakernel's weight ring protocol (producer -> 15 consumer warps), in Python.

The ring's correctness rests on mbarrier phase semantics that no CPU test exercises and that the GPU
tests only sample. This model runs the protocol under random interleavings and checks it:

* ``try_wait.parity(P)`` is modelled as the hardware answers it: true iff the barrier's current
  (incomplete) phase has the other parity, so a wait issued a phase early or late gets a wrong answer
  instead of an error (that is what made the unit-skipping experiment read stale slots: its patch is
  cf23d1e:flint/kernels/dev/experiments/4g_skip_units_UNSAFE.patch);
* a count barrier (the slot's ``empty`` and ``parts`` barriers) completes a phase after exactly its
  expected arrivals; an arrival made for another lap lands in whatever phase is open, which the model
  flags;
* the producer's bulk copy lands at an arbitrary later time (copies complete out of order);
* the producer keeps at most ``inflight`` copies in flight (``MK_INFLIGHT`` in older revisions,
  ``kInflight`` in mk_config.cuh; the model's default 2 is the kernel's from v11 to v21, 1 since v22):
  before a copy it waits, on the full barrier with the hardware's parity answer, for the copy that many
  before it (0: no cap).

Protocols (megakernel.cu, [5] matvec_stage and the FFN split-K's ffn_down_partial):
``"all"``    every warp waits for every unit's slot and arrives on its empty barrier (the mainline);
             slice units (the FFN split-K's down slices: no K parts, every warp takes whole tiles)
             arrive on the slot's parts barrier too, so its phases keep following the ring's laps;
``"slice_noparts"`` as "all", but slice units do not arrive on the parts barrier: the first GPU run of
             the FFN split-K (2026-11-29) hung this way; the model flags it as an arrival landing in
             another lap's phase;
``"skip"``   warps without a part skip the unit, the reducer arrives for them (the unit-skipping experiment: wrong);
``"skip2"``  as "skip", with monotonic per-slot ``consumed`` / ``issued`` counters instead of the
             empty barrier and a wait for ``issued`` before the full-barrier parity wait (MK_SKIP2, an experiment
             of older revisions: correct, but +1.2% per step on the H200 (2026-11-29); removed from the kernel, in
             0117668).

``"flat"``   as "all", with some matvec stages on MK_FLAT's flattened split (an experiment of older revisions;
             1-4 rounds of chunks; lost: +6.5% / +10.5% for R = 1 / 3 on 2026-11-30, out of the kernel; its patch
             is in git history, cf23d1e:flint/kernels/dev/experiments/10_flat_redrot_spin.patch): per
             unit the warps whose chunks meet it hold its parts, the last chunk ending inside it reduces;
``"flat_badcount"`` as "flat", the reducer arriving for one warp too few (must be caught);
``"rotate"`` as "all", the part that reduces unit i of a stage being S - 1 - (i mod S) (MK_RED_ROT, an experiment of
             older revisions; lost: +1.2% on 2026-11-30, same patch).
``"early"``  as "all", the producer streaming layer l + 1's q|k|v tiles right after layer l's gate|up, before its down
             slices, and the consumers taking them after those slices (MK_QKV_EARLY, an experiment of older revisions;
             lost: docs/megakernel-log.md): a consumer order that is not the ring's order. Deadlock-free iff the
             deferred units plus the slice chunks after them fit the ring (nq + nch <= slots); ``"early_toomany"``
             breaks that bound (must deadlock).

Checked per run: every part reads the lap it expects, the reducer sees every part of its unit, no
arrival lands in another lap's phase, and everything finishes (no deadlock).
    python3 lab/ring_model.py        # a few thousand random schedules per protocol
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

NCW = 15  # consumer warps
WAIT = "wait"  # what an actor yields while it spins on a barrier (no progress)


class ProtocolError(AssertionError):
    pass


@dataclass
class CountBarrier:
    """An mbarrier used with arrival counts only (empty, parts)."""
    expected: int
    done: int = 0        # completed phases
    pending: int = 0     # arrivals in the open phase

    def arrive(self, n: int, lap: int, who: str) -> None:
        if lap != self.done:
            raise ProtocolError(f"{who}: arrival for lap {lap} lands in phase {self.done}")
        self.pending += n
        if self.pending > self.expected:
            raise ProtocolError(f"{who}: over-arrival in phase {self.done}")
        if self.pending == self.expected:
            self.done += 1
            self.pending = 0

    def parity_done(self, parity: int) -> bool:
        """try_wait.parity as the hardware answers it."""
        return (self.done & 1) != parity


@dataclass
class Slot:
    full_done: int = 0            # completed fill phases of the full barrier
    content: int = -1             # the lap whose data the slot holds
    empty: CountBarrier = field(default_factory=lambda: CountBarrier(NCW))
    parts: CountBarrier = field(default_factory=lambda: CountBarrier(NCW))
    partial: dict = field(default_factory=dict)   # part -> lap written
    issued: int = 0               # skip2: laps issued
    consumed: int = 0             # skip2: cumulative arrivals


def units(stages: list[tuple]) -> list[tuple[int, int]]:
    """Units of a sequence of stages (ntiles, S) or (ntiles, -ng, rounds); returns (stage, S) per unit in order.
    S = 0: a slice unit (ffn_down_partial: no K parts, no reducer). (ntiles, -ng, rounds): a unit of MK_FLAT's
    flattened split, ng K groups per tile in 15 rounds chunks (flat_parts gives each warp's part)."""
    return [(i, st[1]) for i, st in enumerate(stages) for _ in range(st[0])]


def flat_parts(nt: int, ng: int, j: int, rounds: int = 1, bad_count: bool = False) -> dict[int, tuple[int, int, int, bool]]:
    """MK_FLAT = rounds (matvec_stage with MK_FLAT's patch, in git history): the block's N = nt x ng (tile, group) pairs, tile-major, cut
    into C = 15 rounds chunks (chunk k = [k N / C, (k + 1) N / C)) dealt to warp k mod 15; unit j's parts
    {warp: (part, parts, reducer's arrival count, reduces)} for the chunks that meet it, the reducer being the last
    chunk that ends inside the unit (or the only one). bad_count: the reducer arrives for one warp too few."""
    n, c = nt * ng, NCW * rounds
    u0, u1 = j * ng, (j + 1) * ng
    kf, kl = ((u0 + 1) * c - 1) // n, (u1 * c - 1) // n
    su = kl - kf + 1
    assert su <= NCW, "the host keeps a unit's chunks <= 15"
    kl_ends = (kl + 1) * n // c == u1
    rpt = su - 1 if kl_ends or su == 1 else su - 2
    extra = NCW - (su - 1) - (1 if bad_count else 0)
    return {k % NCW: (k - kf, su, extra, k - kf == rpt) for k in range(kf, kl + 1)}


def flat_groups(nt: int, ng: int, rounds: int, w: int, j: int) -> tuple[int, int] | None:
    """The groups [g0, g1) of unit j that warp w holds under MK_FLAT = rounds (the kernel's arithmetic), or None."""
    n, c = nt * ng, NCW * rounds
    u0, u1 = j * ng, (j + 1) * ng
    kf, kl = ((u0 + 1) * c - 1) // n, (u1 * c - 1) // n
    k = kf + (w - kf % NCW) % NCW
    if k > kl:
        return None
    return max(k * n // c, u0) - u0, min((k + 1) * n // c, u1) - u0


def early_schedule(rng: random.Random, nslots: int, too_many: bool = False) -> tuple[list[tuple], list[int]]:
    """MK_QKV_EARLY's ring: per layer q|k|v (nq tiles), o, gate|up, then the NEXT layer's q|k|v, then the down slice's
    nch chunks (S = 0); the last layer is followed by an lm_head stage. Returns the stages in the producer's order and
    the consumers' order of the units (layer l + 1's q|k|v after layer l's chunks). nq + nch <= nslots unless too_many."""
    nlayers = rng.randint(2, 4)
    nq = rng.randint(1, 3)
    nch = rng.randint(nslots - nq + 1, nslots + 2) if too_many else rng.randint(0, nslots - nq)
    qkv, o, gu = (nq, rng.randint(1, NCW)), (rng.randint(1, 2), rng.randint(1, NCW)), (rng.randint(1, 8), rng.randint(1, 5))
    stages, cons = [qkv], [0]  # cons: the stage indices in the consumers' order
    for lay in range(nlayers):
        stages += [o, gu]
        cons += [len(stages) - 2, len(stages) - 1]
        nxt = None
        if lay + 1 < nlayers:
            stages.append(qkv)
            nxt = len(stages) - 1
        if nch:
            stages.append((nch, 0))
            cons.append(len(stages) - 1)
        if nxt is not None:
            cons.append(nxt)
    stages.append((rng.randint(1, 6), rng.randint(1, NCW)))
    cons.append(len(stages) - 1)
    first = [0]
    for st in stages:
        first.append(first[-1] + st[0])
    order = [u for st in cons for u in range(first[st], first[st + 1])]
    assert sorted(order) == list(range(first[-1]))
    return stages, order


def run(protocol: str, stages: list[tuple], nslots: int, seed: int, inflight: int = 2,
        order: list[int] | None = None) -> None:
    rng = random.Random(seed)
    mainline = protocol in ("all", "flat", "flat_badcount", "rotate", "early", "early_toomany")  # (+ flat ones)
    us = units(stages)
    seq = order if order is not None else list(range(len(us)))  # the consumers' order of the units
    slots = [Slot() for _ in range(nslots)]
    landing: list[tuple[int, int]] = []  # (slot, lap) copies in flight
    where: dict = {}  # actor -> what it waits on (the deadlock report)

    def full_parity_done(sl: Slot, parity: int) -> bool:
        return (sl.full_done & 1) != parity

    def producer():
        for u in range(len(us)):
            s, lap = u % nslots, u // nslots
            sl = slots[s]
            if lap > 0:
                if protocol == "skip2":
                    while sl.consumed < NCW * lap:
                        yield WAIT
                else:
                    while not sl.empty.parity_done((lap - 1) & 1):
                        yield WAIT
            cap = min(inflight, nslots - 1)
            if cap and u >= cap:  # megakernel.cu inflight_cap: the copy `cap` before this one has landed
                u2 = u - cap
                while not full_parity_done(slots[u2 % nslots], (u2 // nslots) & 1):
                    yield WAIT
            landing.append((s, lap))
            if protocol == "skip2":
                sl.issued = lap + 1
            yield

    def reduce(sl: Slot, lap: int, extra: int, nparts: int, who: str):
        """The reducer: arrives for the warps without a part, waits for the parts phase, checks every part's lap,
        runs the epilogue."""
        sl.parts.arrive(extra, lap, who)
        while not sl.parts.parity_done(lap & 1):
            yield WAIT
        got = [sl.partial.get(p) for p in range(nparts)]
        if any(g != lap for g in got):
            raise ProtocolError(f"{who}: parts of laps {got} for lap {lap}")
        yield  # the epilogue

    def warp(w: int):
        part, stage, j = w, -1, 0
        for u in seq:
            st, S = us[u]
            s, lap = u % nslots, u // nslots
            sl = slots[s]
            if st != stage:  # every matvec stage starts its part rotation at the warp's index
                part, stage, j = w, st, 0
            else:
                j += 1
            if S < 0:  # MK_FLAT: every warp waits for the slot; the warps whose chunks meet the unit hold parts
                nt, _, rounds = stages[st]
                fp = flat_parts(nt, -S, j, rounds, bad_count=protocol == "flat_badcount")
                where[w] = f"unit {u} full"
                while not full_parity_done(sl, lap & 1):
                    yield WAIT
                if w in fp:
                    pt, su, extra, reduces = fp[w]
                    if sl.content != lap:
                        raise ProtocolError(f"warp {w} flat unit {u}: read lap {sl.content}'s data for lap {lap}")
                    yield  # the dot
                    sl.partial[pt] = lap
                    if reduces:
                        where[w] = f"unit {u} parts (reducer)"
                        yield from reduce(sl, lap, extra, su, f"warp {w} (flat reducer) unit {u}")
                    else:
                        sl.parts.arrive(1, lap, f"warp {w} flat unit {u}")
                sl.empty.arrive(1, lap, f"warp {w} flat unit {u}")
                yield
                continue
            if S == 0:  # a slice unit: every warp reads the slot, no parts hand-off
                while not full_parity_done(sl, lap & 1):
                    yield WAIT
                if sl.content != lap:
                    raise ProtocolError(f"warp {w} slice unit {u}: read lap {sl.content}'s data for lap {lap}")
                yield  # whole tiles
                if protocol != "slice_noparts":
                    sl.parts.arrive(1, lap, f"warp {w} slice unit {u} (parts)")
                sl.empty.arrive(1, lap, f"warp {w} slice unit {u}")
                yield
                continue
            mine = part < S
            if mainline or mine:
                if protocol == "skip2":
                    while sl.issued <= lap:
                        yield WAIT
                while not full_parity_done(sl, lap & 1):
                    yield WAIT
                if mine:
                    if sl.content != lap:
                        raise ProtocolError(f"warp {w} unit {u}: read lap {sl.content}'s data for lap {lap}")
                    yield  # the dot
                    sl.partial[part] = lap
                    rpart = S - 1 - (j % S) if protocol == "rotate" else S - 1  # MK_RED_ROT: the reducer rotates
                    if part == rpart:  # reducer
                        yield from reduce(sl, lap, NCW - (S - 1), S, f"warp {w} (reducer) unit {u}")
                        if protocol == "skip":
                            sl.empty.arrive(NCW - (S - 1), lap, f"warp {w} (reducer) unit {u}")
                        elif protocol == "skip2":
                            sl.consumed += NCW - (S - 1)
                    else:
                        sl.parts.arrive(1, lap, f"warp {w} unit {u}")
                        if protocol == "skip":
                            sl.empty.arrive(1, lap, f"warp {w} unit {u}")
                        elif protocol == "skip2":
                            sl.consumed += 1
                if mainline:
                    sl.empty.arrive(1, lap, f"warp {w} unit {u}")
            part = part - S if part >= S else part - S + NCW
            yield

    actors = [producer()] + [warp(w) for w in range(NCW)]
    live = list(range(len(actors)))
    idle = 0
    while live or landing:
        if landing and (not live or rng.random() < 0.15):
            i = rng.randrange(len(landing))  # copies land out of order
            s, lap = landing.pop(i)
            slots[s].content = lap
            slots[s].full_done += 1
            idle = 0
            continue
        k = rng.choice(live)
        idle += 1
        try:
            if next(actors[k]) is not WAIT:
                idle = 0
        except StopIteration:
            live.remove(k)
            idle = 0
        if idle > 20000:
            raise ProtocolError("deadlock: every actor spins on a barrier" + (f" ({where})" if where else ""))


def random_stages(rng: random.Random, slices: bool = False, flat: bool = False) -> list[tuple]:
    """A step-like sequence of stages: (tiles of this block, parts per tile); slices: some stages are
    FFN split-K slice stages (chunks, S = 0), each after a matvec stage as in the kernel; flat: some matvec
    stages use MK_FLAT's flattened split (S = -groups per tile)."""
    out = []
    for _ in range(rng.randint(2, 6)):
        if flat and rng.random() < 0.5:  # (ntiles, -groups per tile, rounds): a unit's chunks <= 15
            nt, ng = rng.randint(1, 12), rng.randint(1, 24)
            out.append((nt, -ng, rng.choice([r for r in (1, 2, 3, 4) if r == 1 or 15 * r <= 14 * nt])))
        else:
            out.append((rng.randint(1, 9), rng.randint(1, NCW)))
        if slices and rng.random() < 0.5:
            out.append((rng.randint(1, 6), 0))
    return out


def check(protocol: str, runs: int, seed: int = 0, inflight: int = 2) -> list[str]:
    """Run `runs` random schedules; return the failures (empty if the protocol held every time)."""
    rng = random.Random(seed)
    fails = []
    for r in range(runs):
        nslots = rng.randint(3, 8)
        order = None
        if protocol in ("early", "early_toomany"):
            stages, order = early_schedule(rng, nslots, too_many=protocol == "early_toomany")
        else:
            stages = random_stages(rng, slices=protocol in ("all", "slice_noparts", "flat", "flat_badcount", "rotate"),
                                   flat=protocol in ("flat", "flat_badcount"))
        try:
            run(protocol, stages, nslots, seed=rng.randrange(1 << 30), inflight=inflight, order=order)
        except ProtocolError as e:
            fails.append(f"run {r} (stages {stages}, {nslots} slots): {e}")
    return fails


if __name__ == "__main__":
    for proto in ("all", "skip", "skip2", "slice_noparts", "flat", "flat_badcount", "rotate", "early", "early_toomany"):
        f = check(proto, 2000)
        print(f"{proto:6s}: {len(f)} of 2000 random schedules failed" + (f"; first: {f[0]}" if f else ""))
