"""Does Python's cyclic collector walk the suffix drafter's memory? A full output cache (flint.speculative.suffix's
SuffixCache filled with 130 outputs of 128 tokens), then the time of a full collection and the objects it tracks,
and the time to build a request's trie from a 2000-token prompt with the collector on and off (CPU; the numbers are
the build machine's).

    python3 lab/studies/gc_walk_suffix.py
"""
from __future__ import annotations

import gc
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flint.speculative.suffix import SuffixCache, SuffixTrie  # noqa: E402


def ms(f) -> float:
    t = time.perf_counter()
    f()
    return (time.perf_counter() - t) * 1e3


def main() -> None:
    rnd = random.Random(0)
    gc.collect()
    print(f"before the cache: a full collection {ms(gc.collect):.1f} ms, {len(gc.get_objects())} tracked objects")
    cache = SuffixCache()
    for _ in range(130):
        cache.add([rnd.randrange(2000) for _ in range(128)])
    walks = [ms(gc.collect) for _ in range(3)]
    print(f"a full cache ({cache.trie.nodes()} nodes): a full collection {min(walks):.1f}-{max(walks):.1f} ms, "
          f"{len(gc.get_objects())} tracked objects")
    toks = [rnd.randrange(3000) for _ in range(2000)]

    def build():
        trie, front = SuffixTrie(), []
        for i, t in enumerate(toks):
            front = trie.append(front, t, i)

    for on in (True, False):
        gc.collect()
        if not on:
            gc.disable()
        t = ms(build)
        gc.enable()
        print(f"a 2000-token prompt's trie, collector {'on' if on else 'off'}: {t:.1f} ms")


if __name__ == "__main__":
    main()
