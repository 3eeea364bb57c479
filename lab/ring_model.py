"""A model checker for the megakernel's weight ring protocol (producer -> 15 consumer warps), in Python.

The ring's correctness rests on mbarrier phase semantics that no CPU test exercises and that the GPU
tests only sample. This model runs the protocol under random interleavings and checks it:

* ``try_wait.parity(P)`` is modelled as the hardware answers it: true iff the barrier's current
  (incomplete) phase has the other parity, so a wait issued a phase early or late gets a wrong answer
  instead of an error (the "skip" protocol below reads stale slots that way);
* a count barrier (the slot's ``empty`` and ``parts`` barriers) completes a phase after exactly its
  expected arrivals; an arrival made for another lap lands in whatever phase is open, which the model
  flags;
* the producer's bulk copy lands at an arbitrary later time (copies complete out of order);
* the producer keeps at most ``inflight`` copies in flight (``kInflight`` in mk_config.cuh, 1; the lm_head's
  ``kLmInflight``, 2): before a copy it waits, on the full barrier with the hardware's parity answer, for the copy
  that many before it (0: no cap).

Protocols (the kernel's matvec stages and the FFN split-K's down slices):
``"all"``    every warp waits for every unit's slot and arrives on its empty barrier (the kernel's protocol);
             slice units (the FFN split-K's down slices: no K parts, every warp takes whole tiles)
             arrive on the slot's parts barrier too, so its phases keep following the ring's laps;
``"slice_noparts"`` as "all", but slice units do not arrive on the parts barrier: the model must flag the
             arrivals that then land in another lap's phase;
``"skip"``   warps without a part skip the unit, the reducer arrives for them: the model must find the stale
             slot reads this order allows (a read of a slot already refilled for a later lap).

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


def units(stages: list[tuple]) -> list[tuple[int, int]]:
    """Units of a sequence of stages (ntiles, S); returns (stage, S) per unit in order. S = 0: a slice unit (the FFN
    split-K's down slices: no K parts, no reducer)."""
    return [(i, st[1]) for i, st in enumerate(stages) for _ in range(st[0])]


def run(protocol: str, stages: list[tuple], nslots: int, seed: int, inflight: int = 2) -> None:
    """One random interleaving of the producer and the 15 consumer warps over ``stages``; raises ProtocolError."""
    rng = random.Random(seed)
    every_warp = protocol != "skip"  # every warp waits for every unit's slot and arrives on its empty barrier
    us = units(stages)
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
                while not sl.empty.parity_done((lap - 1) & 1):
                    yield WAIT
            cap = min(inflight, nslots - 1)
            if cap and u >= cap:  # megakernel.cu inflight_cap: the copy `cap` before this one has landed
                u2 = u - cap
                while not full_parity_done(slots[u2 % nslots], (u2 // nslots) & 1):
                    yield WAIT
            landing.append((s, lap))
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
        part, stage = w, -1
        for u, (st, S) in enumerate(us):
            s, lap = u % nslots, u // nslots
            sl = slots[s]
            if st != stage:  # every matvec stage starts its part rotation at the warp's index
                part, stage = w, st
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
            if every_warp or mine:
                while not full_parity_done(sl, lap & 1):
                    yield WAIT
                if mine:
                    if sl.content != lap:
                        raise ProtocolError(f"warp {w} unit {u}: read lap {sl.content}'s data for lap {lap}")
                    yield  # the dot
                    sl.partial[part] = lap
                    if part == S - 1:  # reducer
                        yield from reduce(sl, lap, NCW - (S - 1), S, f"warp {w} (reducer) unit {u}")
                        if not every_warp:
                            sl.empty.arrive(NCW - (S - 1), lap, f"warp {w} (reducer) unit {u}")
                    else:
                        sl.parts.arrive(1, lap, f"warp {w} unit {u}")
                        if not every_warp:
                            sl.empty.arrive(1, lap, f"warp {w} unit {u}")
                if every_warp:
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


def random_stages(rng: random.Random, slices: bool = False) -> list[tuple]:
    """A step-like sequence of stages: (tiles of this block, parts per tile); slices: some stages are
    FFN split-K slice stages (chunks, S = 0), each after a matvec stage as in the kernel."""
    out = []
    for _ in range(rng.randint(2, 6)):
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
        stages = random_stages(rng, slices=protocol in ("all", "slice_noparts"))
        try:
            run(protocol, stages, nslots, seed=rng.randrange(1 << 30), inflight=inflight)
        except ProtocolError as e:
            fails.append(f"run {r} (stages {stages}, {nslots} slots): {e}")
    return fails


if __name__ == "__main__":
    for proto in ("all", "skip", "slice_noparts"):
        f = check(proto, 2000)
        print(f"{proto:13s}: {len(f)} of 2000 random schedules failed" + (f"; first: {f[0]}" if f else ""))
