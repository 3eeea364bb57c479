"""Draft-free speculative decoding from suffix tries: proposals from this request's prompt and output and from the
recent outputs of the same model, with the speculation length chosen per step from the match's counts.

The structure is a suffix trie cut at ``TRIE_DEPTH`` tokens whose nodes count their occurrences (the paths of
SuffixDecoding's suffix trees, bounded in depth). Chosen over a suffix automaton for three reasons: the counts of
every continuation, which set how far to speculate, are read off a node's children (an automaton keeps end
positions, not per-branch counts, without a pass over its suffix links); a whole sequence can be removed again
by walking its paths and decrementing, which least-recently-used eviction of the cache of outputs needs (an
automaton cannot forget); and appending one token touches at most ``TRIE_DEPTH`` nodes, so the context grows at a
bounded cost per token. The price is memory: at most ``TRIE_DEPTH`` nodes per token stored.

Two tries answer a proposal: the request's own (its prompt, then each token it emits) and the cache of the
model's recent outputs (``SuffixCache``: ``CACHE_TOKENS`` tokens at most, whole outputs evicted least recently
used first; an output counts as used when it is added and whenever a proposal from the cache followed a path it
was the last to pass through). The draft object holds one cache; a server builds one draft per loaded model, so
the cache is per model. In each trie the match is the longest suffix of the context that occurred before with a
continuation (at least ``MIN_MATCH`` tokens); the proposal follows the most frequent child (of equals, the latest
seen: a request's trie records positions, the cache sequence numbers), re-matching after each token. A token's
chance of being right is its share of the match's continuations x ``hit(m)``, which grows with the match length m
(0.25 after one token, 0.94 after eight: fitted to how often the target followed the workloads' train split,
lab/studies/copy_ceiling.py; x ``CACHE_TRUST`` for the cache, another request's text); a run's chance is the
product, and the run stops when that falls below ``MIN_PROB`` or at the engine's k (at most the verify's widest,
M = 8: k <= 7). Of the run, the prefix that maximises (1 + its expected accepted tokens) / the time of verifying it
(``verify_cost``, by width: the backend's, flint.speculative.cost) is proposed, nothing where a plain step is worth more: a short match gives
a token or two, a long one the whole k. Its score is the expected number of accepted tokens; the trie with the
higher score proposes.
A sampled request reads its own trie only: its draws, and so its text for a seed, do not depend on other requests.

Verification is flint.speculative.verify's: greedy output identical to plain greedy; sampling takes the proposal as a
point mass (q one-hot), so it is lossless (flint.speculative.ngram's docstring has the argument).

    flint chat --draft suffix        flint bench --draft suffix --prompt-set workloads
Tests: ``pytest tests/test_suffix.py``.
"""
from __future__ import annotations

from collections import OrderedDict

from .cost import CPU_VERIFY_COST
from .ngram import point_mass

TRIE_DEPTH = 16       # tokens per stored path: a match plus its continuation (nodes per token stored, at most)
K_MAX = 7             # the widest verify the kernels run is M = 8 tokens
MIN_MATCH = 1         # the shortest match that proposes (a 1-token match: a short proposal, by its low chance)
MIN_PROB = 0.1        # stop once the estimated chance that every token so far is right falls below this
HIT_MISS = 0.75       # a token after an m-token match is right with chance (its share) x hit(m),
HIT_DECAY = 0.7       # hit(m) = 1 - HIT_MISS x HIT_DECAY^(m - 1): 0.25, 0.48, 0.63, 0.74 ... (fitted on the workloads'
                      # train split: 0.26, 0.52, 0.61, 0.80 for the first token; a later token's match has grown)
CACHE_TRUST = 0.6     # the cache's matches hit less often (another request's text): hit(m) x this
CUT_BY_COST = True    # propose the run's prefix that maximises (1 + expected accepted) / the verify's cost
VERIFY_COST = CPU_VERIFY_COST  # a verify of M tokens (index M) in plain steps, until the engine gives the backend's
                               # own (SuffixDraft.verify_cost, flint.speculative.cost)
CACHE_TOKENS = 16384  # recent outputs kept per model (the trie then holds at most TRIE_DEPTH x this many nodes)


class SuffixTrie:
    """Every substring of at most ``depth`` tokens of the sequences added, with occurrence counts. A sequence is
    added one token at a time through its *frontier*: the nodes of its suffixes of 1..depth tokens, shortest first.

    A node is an integer: ``kids[n]`` maps a token to the child node, ``count[n]`` counts the occurrences of n's
    path, ``seq[n]`` is its latest occurrence (a position in a request's trie, a sequence number in the cache's).
    Only ints are stored, so the dicts stay untracked by Python's cyclic collector: a trie of a full cache (about
    230k nodes) as objects made each full collection walk them (100-150 ms on the build machine, a stall in the middle
    of a decode), and building one from a long prompt set off collections all along; as ints the collector has a few
    lists to visit and building needs no pause of it. Node 0 is the root; removed nodes are reused."""

    def __init__(self, depth: int = TRIE_DEPTH):
        if not isinstance(depth, int) or depth < 2:
            raise ValueError(f"suffix trie: depth must be an integer >= 2, got {depth!r}")
        self.depth = depth
        self.root = 0
        self.kids: list[dict[int, int]] = [{}]
        self.count: list[int] = [0]
        self.seq: list[int] = [-1]
        self._free: list[int] = []

    def _new(self) -> int:
        if self._free:
            return self._free.pop()
        self.kids.append({})
        self.count.append(0)
        self.seq.append(-1)
        return len(self.kids) - 1

    def child(self, node: int, token: int) -> int | None:
        return self.kids[node].get(token)

    def append(self, frontier: list, token: int, seq: int = -1) -> list:
        """Add ``token`` after the sequence whose frontier is given; returns the new frontier."""
        out = []
        kids, count, last = self.kids, self.count, self.seq
        for node in [0] + frontier[: self.depth - 1]:
            child = kids[node].get(token)
            if child is None:
                child = self._new()
                kids[node][token] = child
            count[child] += 1
            last[child] = seq
            out.append(child)
        return out

    def add(self, tokens, seq: int = -1) -> None:
        frontier: list = []
        for t in tokens:
            frontier = self.append(frontier, int(t), seq)

    def remove(self, tokens) -> None:
        """Undo ``add(tokens)``: the same paths, each count decremented, nodes that reach 0 dropped (a node's
        descendants reach 0 in the same walk: a longer path occurs at most as often as its prefix)."""
        frontier: list = []
        dropped = []
        for t in tokens:
            t = int(t)
            out = []
            for node in [0] + frontier[: self.depth - 1]:
                child = self.kids[node].get(t)
                if child is None:  # (a path this sequence added is gone only if it was never added)
                    raise ValueError("suffix trie: removing a sequence that was not added")
                self.count[child] -= 1
                if self.count[child] == 0:
                    del self.kids[node][t]
                    dropped.append(child)
                out.append(child)
            frontier = out
        for n in dropped:
            self.kids[n].clear()
            self.seq[n] = -1
        self._free.extend(dropped)

    def follow(self, frontier: list, token: int) -> list:
        """The frontier of the context extended by ``token``, without adding it: the nodes of its suffixes that the
        trie holds (the lengths 1..n for some n: a suffix absent means every longer one is)."""
        out = []
        for prev in [0] + frontier[: self.depth - 1]:
            node = self.kids[prev].get(token)
            if node is None:
                break
            out.append(node)
        return out

    def frontier_of(self, tokens: list[int]) -> list:
        """The frontier of a context looked up (not added): only its last ``depth`` tokens matter."""
        frontier: list = []
        for t in tokens[-self.depth:]:
            frontier = self.follow(frontier, t)
        return frontier

    def nodes(self) -> int:
        """Nodes in use, the root not counted (every other node is one edge)."""
        return sum(len(k) for k in self.kids)


def _match(trie: SuffixTrie, frontier: list):
    """The deepest frontier node with a continuation, at least MIN_MATCH deep: (node, its depth) or (None, 0)."""
    for i in range(min(len(frontier), trie.depth - 1) - 1, MIN_MATCH - 2, -1):
        if trie.kids[frontier[i]]:
            return frontier[i], i + 1
    return None, 0


def hit(m: int, trust: float = 1.0) -> float:
    """The chance that the continuation of an m-token match is the target's next token, given its share of the
    match's continuations is 1 (calibrated on the workloads' train split, lab/studies/copy_ceiling.py)."""
    return trust * (1.0 - HIT_MISS * HIT_DECAY ** (m - 1))


def best_run(trie: SuffixTrie, frontier: list, k: int, trust: float = 1.0,
             cost: tuple[float, ...] = VERIFY_COST) -> tuple[list[int], float, int, int | None]:
    """The proposal from a context's frontier in ``trie``: (tokens, score, match length, the last node used). At
    each token the longest match with a continuation gives the most frequent child (a variable-order model: the
    match is re-taken after every proposed token, so a run is not cut by the trie's depth); its chance is the
    child's share of the continuations x hit(the match's length, ``trust``), and the run's chance so far the product
    of those. The run stops when that falls below MIN_PROB or at k tokens; then, with CUT_BY_COST, the prefix of it
    that maximises (1 + its expected accepted tokens) / the cost of verifying it (``cost``) is proposed, none
    where a plain step is worth more. score = the sum of the proposed prefix's chances (the expected number of
    tokens accepted)."""
    node, m = _match(trie, frontier)
    if node is None:
        return [], 0.0, 0, None
    k = min(k, len(cost) - 2)
    toks, p, scores, used, depth = [], 1.0, [0.0], [None], m
    while node is not None and len(toks) < k:
        kids, count, last = trie.kids[node], trie.count, trie.seq
        total = sum(count[c] for c in kids.values())
        t, child = max(kids.items(), key=lambda kv: (count[kv[1]], last[kv[1]]))  # ties: the latest
        p *= count[child] / total * hit(depth, trust)
        if p < MIN_PROB:
            break
        toks.append(t)
        scores.append(scores[-1] + p)
        used.append(child)
        frontier = trie.follow(frontier, t)
        node, depth = _match(trie, frontier)
    n = len(toks)
    if CUT_BY_COST:
        n = max(range(n + 1), key=lambda i: (1.0 + scores[i]) / cost[1 + i])
    return toks[:n], scores[n], m, used[n]


class SuffixCache:
    """The recent outputs of one model in a suffix trie: ``max_tokens`` tokens at most, whole outputs evicted least
    recently used first (``touch`` marks one used)."""

    def __init__(self, max_tokens: int = CACHE_TOKENS, depth: int = TRIE_DEPTH):
        if not isinstance(max_tokens, int) or max_tokens < 0:
            raise ValueError(f"suffix cache: max_tokens must be an integer >= 0, got {max_tokens!r}")
        self.trie = SuffixTrie(depth)
        self.max_tokens = max_tokens
        self.tokens = 0
        self._seqs: OrderedDict[int, tuple[int, ...]] = OrderedDict()  # least recently used first
        self._next = 0

    def add(self, tokens) -> None:
        seq = tuple(int(t) for t in tokens)[-self.max_tokens:] if self.max_tokens else ()
        if len(seq) < MIN_MATCH + 1:
            return
        while self._seqs and self.tokens + len(seq) > self.max_tokens:
            _, old = self._seqs.popitem(last=False)
            self.trie.remove(old)
            self.tokens -= len(old)
        sid, self._next = self._next, self._next + 1
        self.trie.add(seq, sid)
        self._seqs[sid] = seq
        self.tokens += len(seq)

    def touch(self, seq: int) -> None:
        if seq in self._seqs:
            self._seqs.move_to_end(seq)

    def __len__(self) -> int:
        return len(self._seqs)


class SuffixDraft:
    """``propose(context_ids, hidden, k, sp, gen) -> (tokens[<= k], q or None)``: the draft interface of
    flint.speculative.verify (``hidden`` unused). ``end_request(context, prompt_len)`` (called by the engine when a
    generation ends) adds its output to the cache. ``last`` holds the last proposal's (source, score, match length)."""

    name = "suffix"  # (what the engine's statistics call this drafter)

    def __init__(self, vocab_size: int, k_default: int = K_MAX, cache: SuffixCache | None = None,
                 depth: int = TRIE_DEPTH):
        for name, v in (("vocab_size", vocab_size), ("k_default", k_default)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"suffix draft: {name} must be a positive integer, got {v!r}")
        if k_default > K_MAX:
            raise ValueError(f"suffix draft: k_default must be <= {K_MAX} (the widest verify is M = {K_MAX + 1}), "
                             f"got {k_default}")
        self.vocab_size = vocab_size
        self.k_default = k_default
        self.cache = cache if cache is not None else SuffixCache(depth=depth)
        if self.cache.trie.depth != depth:
            raise ValueError(f"suffix draft: the cache's depth {self.cache.trie.depth} differs from {depth}")
        self.depth = depth
        self.verify_cost = VERIFY_COST  # (the engine sets its backend's: set_verify_cost)
        self._ctx = None
        self._seen = 0
        self.last: tuple[str, float, int] = ("none", 0.0, 0)

    @property
    def cfg(self):  # SpeculativeEngine reads the default k from draft.cfg.k_default
        return self

    def _sync(self, ctx: list[int]) -> None:
        """Bring the request's trie and both frontiers up to ``ctx`` (a new list: a new request)."""
        if ctx is not self._ctx or len(ctx) < self._seen:
            self._ctx, self._seen = ctx, 0
            self._local = SuffixTrie(self.depth)
            self._lfront: list = []
            self._gfront = self.cache.trie.frontier_of(ctx)
            for i, t in enumerate(ctx):
                self._lfront = self._local.append(self._lfront, t, i)
            self._seen = len(ctx)
            return
        for i in range(self._seen, len(ctx)):
            self._lfront = self._local.append(self._lfront, ctx[i], i)
            self._gfront = self.cache.trie.follow(self._gfront, ctx[i])
        self._seen = len(ctx)

    def lookup(self, ctx: list[int], k: int, use_cache: bool = True) -> tuple[list[int], float]:
        """The better of the two tries' proposals for ``ctx`` (tokens, score); ([], 0.0) when neither matches.
        ``use_cache`` False: the request's own trie only (a sampled request: its draws, and so its text for a
        seed, must not depend on what other requests left in the cache)."""
        if k < 1 or len(ctx) < MIN_MATCH + 1:
            self.last = ("none", 0.0, 0)
            return [], 0.0
        self._sync(ctx)
        k = min(k, K_MAX)
        toks, score, m, _ = best_run(self._local, self._lfront, k, cost=self.verify_cost)
        src = "prompt+output"
        g = (best_run(self.cache.trie, self._gfront, k, CACHE_TRUST, self.verify_cost) if use_cache
             else ([], 0.0, 0, None))
        if g[1] > score:
            toks, score, m = g[0], g[1], g[2]
            src = "cache"
            if g[3] is not None:
                self.cache.touch(self.cache.trie.seq[g[3]])
        self.last = (src if toks else "none", score, m)
        return toks, score

    def set_verify_cost(self, cost: tuple[float, ...]) -> None:
        """The backend's verify cost by width (flint.speculative.cost), which the proposals are cut by."""
        self.verify_cost = tuple(cost)

    def propose(self, context_ids: list[int], hidden=None, k: int = K_MAX, sp=None, gen=None):
        toks, _ = self.lookup(context_ids, k, use_cache=sp is None or sp.temperature == 0)
        return point_mass(toks, self.vocab_size, sp)

    def end_request(self, ctx: list[int], prompt_len: int) -> None:
        """A generation ended: its output (``ctx[prompt_len:]``) joins the cache of recent outputs."""
        self.cache.add(ctx[prompt_len:])
        self._ctx = None


__all__ = ["CACHE_TOKENS", "K_MAX", "SuffixCache", "SuffixDraft", "SuffixTrie", "TRIE_DEPTH", "best_run"]
