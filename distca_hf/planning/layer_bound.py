"""A lower bound on the predicted layer time of any plan of a batch (``layer_time_lower_bound``):
what no plan can beat under the time model of ``rank_time``, so how much of a step's time a better
planner could still win. Pure numpy.

Every plan (CA-tasks of any shape, key-split tiles included, on any servers, in either backward
mode) gives rank ``r`` the time ``rank_time.rank_seconds`` counts: its other work, the pairs, keys
and tasks it serves, and its exposed communication. The bound relaxes the plan to a few numbers per
rank and keeps only what is forced:

- ``S``: the pairs ``r`` serves. They sum to the batch's pairs; ranks outside the server pool serve none.
- keys: a tile of ``x`` queries and ``y`` keys holds at most ``x y`` pairs and ``x`` is at most a
  document's query tokens, so ``r`` covers at least ``S / (longest document's query tokens)`` keys.
- bytes (``TokenBytes``; four kinds of transfer, disjoint, so their bytes add up):
    * ``r``'s own pairs computed elsewhere, ``P_away``: a query token carries at most ``min(end,
      window)`` pairs (``end``: the end of its piece), so at least ``P_away / L_r`` of ``r``'s query
      tokens go out (Q) and come back (O);
    * pairs of ``r``'s queries whose key lives on another rank (``F``) and that ``r`` computes itself:
      every such key must come in (K/V), and one key serves at most ``r``'s query tokens of its
      document, so at least ``(F - P_away) / n_r`` keys arrive;
    * pairs of other ranks' queries that ``r`` serves, ``G = S - P + P_away``: their queries come in
      and their outputs go back, at least ``G / L`` query tokens (``L``: the longest ``min(end,
      window)``), and at least ``Phi_here / h_r`` of them when ``Phi_here`` of those pairs have their
      key on ``r`` (``h_r``: the most keys ``r`` holds of one document);
    * pairs whose key is on ``r`` and whose query lives elsewhere (``Phi``), computed elsewhere: the key
      goes out, and one key sent to one server serves at most its document's query tokens held off ``r``.
  Each byte counts ``passes`` times (``cost.COMM_PASSES``: the smaller, ``saved``'s, unless
  ``config.backward`` is ``"resend"``), times ``config.exposed_comm``, over ``bytes_per_s``; the
  log-sum-exp of key-split partials is left out (it only adds). ``collective_s`` counts on every
  rank once any byte crosses ranks; where a plan can move none (no pair needs a key from another
  rank, or those keys cost no bytes), the bound also weighs such plans without it.

- bilinear bytes: ``x`` query tokens and ``y`` keys that both travel hold at most ``x y`` pairs, so
  they take at least ``2 sqrt((q + o) kv pairs)`` bytes; concave, it is counted by its chord over the
  pairs' range (below the curve there): for the pairs of ``r``'s own queries on its own keys that go
  away (at most ``P - F``), and for the pairs it serves for others without their keys (at most what
  it can serve within the step ``T``). The least bytes are the larger of this and the sum above.

So rank ``r`` needs at least ``cost_r(S) = other_r + (attn_s_per_pair + task_key_s / Lq) S +
byte_seconds x (least bytes given S) + collective_s``, a convex function of ``S`` for a given step
``T`` (a least value of a jointly convex piecewise-linear function over a convex set), and a step of
``T`` seconds needs every ``S`` within ``{S : cost_r(S) <= T}`` summing to the batch's pairs: the
bound is the least such ``T`` (bisection on ``T``; each rank's interval by bisection on ``S``).
``task_s`` (a task's fixed time) and memory are left out; dropping a term keeps the bound sound.

How tight. Within 3-18% of the ``auto`` plan on the 8-rank and the wlbllm 512 x 512k rows of ``make
bench-sim``, and within 0.8 of the best tiled plan of a tiny batch by brute force (the tests); 1.6-3x
below it where one long document's K/V fans out to many servers (prolong at 64 and 512 ranks): a key
that the bound counts once serves every query of a server, and a holder sending one prefix to many
servers is not counted. It costs 0.5-1.3 s at 512 ranks: a yardstick for the planner, not part of it.
"""

from __future__ import annotations

import numpy as np

from .carving import PlannerConfig, server_pool
from .cost import COMM_PASSES, causal_pairs, tile_pairs
from .pieces import DocumentPieces
from .rank_time import other_seconds

__all__ = ["RankBoundTerms", "bound_terms", "layer_time_lower_bound"]

_ITERATIONS = 32  # bisection steps over a rank's served pairs: 2^-40 of the batch's pairs
_PRECISION = 1e-5  # the bound's bisection stops within this fraction of it (from below: it stays sound)


class RankBoundTerms:
    """What the bound keeps of a batch, per rank (arrays ``[num_ranks]``, float64; pairs and tokens).

    ``other``: seconds of work besides attention; ``pairs``: the pairs of the rank's own queries;
    ``per_query``: the most pairs one of its query tokens holds; ``foreign``: pairs of its queries
    whose key lives on another rank, ``foreign_queries`` the most of its query tokens of one such
    document; ``held``: pairs of other ranks' queries whose key lives on it, ``held_keys`` the most
    keys it holds of one such document and ``held_away`` the most query tokens such a document has off
    it; ``serves``: whether it is in the server pool. Scalars: ``most_per_query`` (the most pairs any
    query token holds), ``longest`` (the most query tokens of one document) and ``total`` (the pairs).
    """

    def __init__(self, pieces: DocumentPieces, config: PlannerConfig):
        n, window = pieces.num_ranks, config.window
        has_queries = pieces.end > pieces.start
        rank, doc = pieces.rank[has_queries], pieces.doc[has_queries]
        q_start, q_end = pieces.start[has_queries], pieces.end[has_queries]
        pairs = causal_pairs(q_start, q_end, window).astype(np.float64)
        per_query = (np.minimum(q_end, window) if window is not None else q_end).astype(np.float64)
        self.other = other_seconds(pieces.tokens(), config)
        self.pairs = np.bincount(rank, weights=pairs, minlength=n)
        self.per_query = np.zeros(n)
        np.maximum.at(self.per_query, rank, per_query)
        self.most_per_query = float(per_query.max(initial=0.0))
        self.total = float(pairs.sum())
        # query tokens per (rank, document) and per document
        doc_queries = np.bincount(doc, weights=q_end - q_start) if doc.size else np.zeros(0)
        self.longest = float(doc_queries.max(initial=0.0))
        # every (query piece, K/V piece) of one document on different ranks: the pairs that cross ranks
        keys = np.flatnonzero(pieces.end > pieces.kv_start)
        by_doc = {}
        for i in keys:
            by_doc.setdefault(int(pieces.doc[i]), []).append(i)
        self.foreign, self.held = np.zeros(n), np.zeros(n)
        self.foreign_queries, self.held_keys, self.held_away = np.zeros(n), np.zeros(n), np.zeros(n)
        query_pieces = np.flatnonzero(has_queries)
        rank_doc_queries: dict[tuple[int, int], int] = {}
        rank_doc_keys: dict[tuple[int, int], int] = {}
        for i in query_pieces:
            key = (int(pieces.rank[i]), int(pieces.doc[i]))
            rank_doc_queries[key] = rank_doc_queries.get(key, 0) + int(pieces.end[i] - pieces.start[i])
        for i in keys:
            key = (int(pieces.rank[i]), int(pieces.doc[i]))
            rank_doc_keys[key] = rank_doc_keys.get(key, 0) + int(pieces.end[i] - pieces.kv_start[i])
        for i in query_pieces:
            d, r = int(pieces.doc[i]), int(pieces.rank[i])
            for j in by_doc.get(d, ()):
                k = int(pieces.rank[j])
                if k == r:
                    continue
                crossing = float(tile_pairs(pieces.start[i], pieces.end[i], pieces.kv_start[j], pieces.end[j], window))
                if crossing <= 0:
                    continue
                self.foreign[r] += crossing
                self.foreign_queries[r] = max(self.foreign_queries[r], rank_doc_queries[r, d])
                self.held[k] += crossing
                self.held_keys[k] = max(self.held_keys[k], rank_doc_keys[k, d])
                self.held_away[k] = max(self.held_away[k], float(doc_queries[d]) - rank_doc_queries.get((k, d), 0))
        # 1 / each divisor (0 where it is 0: then no pairs of that kind), for least_bytes
        self.inverses = tuple(_inverse(x) for x in (self.per_query, self.foreign_queries, self.held_keys,
                                                    self.held_away, np.full(n, self.most_per_query)))
        self.serves = np.zeros(n, dtype=bool)
        self.serves[list(server_pool(config, n))] = True


def bound_terms(pieces: DocumentPieces, config: PlannerConfig) -> RankBoundTerms:
    """The per-rank terms the bound keeps of ``pieces`` under ``config`` (``RankBoundTerms``)."""
    return RankBoundTerms(pieces, config)


def _inverse(x) -> np.ndarray:
    """``1 / x`` elementwise, 0 where ``x`` is 0 (a divisor that is 0 only where its pairs are 0)."""
    x = np.asarray(x, dtype=np.float64)
    return np.divide(1.0, x, out=np.zeros_like(x), where=x > 0)


def least_bytes(terms: RankBoundTerms, served, query_bytes: float, kv_bytes: float) -> np.ndarray:
    """``[num_ranks]`` the fewest bytes (sent + received, one forward) each rank moves when it serves
    ``served`` (``[num_ranks]``) pairs: the least, over how many of its own pairs go away and how many
    of the pairs on its keys it computes, of the four kinds of transfer (module docstring). The
    function is piecewise linear and convex in those two, so its least value lies on a vertex of its
    pieces over the feasible polygon, all of which are tried."""
    own, foreign, held = terms.pairs, terms.foreign, terms.held
    per_query, foreign_queries, held_keys, held_away, most = terms.inverses
    low = np.maximum(own - served, 0.0)
    # incoming = max(received / M, here / h) (inverses hold 1 / M and 1 / h): its two counts cross at
    # here = received x h / M, the vertex between its pieces
    slope = np.divide(most, held_keys, out=np.zeros_like(most), where=held_keys > 0)
    aways = [low, own, np.clip(foreign, low, own), np.clip(held + own - served, low, own),
             np.clip(np.divide(held, slope, out=np.zeros_like(held), where=slope > 0) + own - served, low, own)]
    best = np.full(own.shape, np.inf)
    for away in aways:
        received_pairs = np.maximum(served - own + away, 0.0)
        fixed = query_bytes * away * per_query + kv_bytes * np.maximum(foreign - away, 0.0) * foreign_queries
        top = np.minimum(held, received_pairs)
        for here in (0.0, top, np.minimum(slope * received_pairs, top)):
            incoming = np.maximum(received_pairs * most, here * held_keys)
            best = np.minimum(best, fixed + query_bytes * incoming + kv_bytes * (held - here) * held_away)
    return best


def _rank_seconds(terms: RankBoundTerms, served, config: PlannerConfig, collective: float,
                  level: float | None = None) -> np.ndarray:
    """``[num_ranks]`` ``cost_r(served)``: the least seconds each rank can take serving ``served``
    pairs, in a step of at most ``level`` seconds (``None``: any step; only the bilinear bytes of the
    pairs it serves for others need it, module docstring)."""
    tm, tb = config.time_model, config.token_bytes
    passes = COMM_PASSES["resend"] if config.backward == "resend" else min(COMM_PASSES.values())
    per_byte = config.exposed_comm * passes / tm.bytes_per_s
    keys = tm.task_key_s * served * (1.0 / terms.longest if terms.longest else 0.0)
    query_bytes, kv_bytes = tb.q + tb.o, tb.kv
    moved = least_bytes(terms, served, query_bytes, kv_bytes)
    # bilinear: x queries and y keys that both travel hold at most x y pairs, so they take at least
    # 2 sqrt((q + o) kv pairs) bytes, and at least the chord of that over [0, most] for pairs <= most
    product = query_bytes * kv_bytes
    own_keyed = terms.pairs - terms.foreign  # own queries on own keys: when they go away, both travel
    shed = 2.0 * np.sqrt(product * _inverse(own_keyed)) * np.maximum(terms.pairs - served - terms.foreign, 0.0)
    if level is None or tm.attn_s_per_pair == 0:
        most = np.full_like(terms.pairs, np.inf)
    else:  # pairs a rank serves within the level, its other work alone already counted
        most = np.clip((level - terms.other) / tm.attn_s_per_pair, 0.0, terms.total)
    taken = 2.0 * np.sqrt(product * _inverse(most)) * np.maximum(served - terms.pairs - terms.held, 0.0)
    moved = np.maximum(moved, shed + taken)
    return terms.other + tm.attn_s_per_pair * served + keys + per_byte * moved + collective


def _cheapest_served(terms: RankBoundTerms, config: PlannerConfig, collective: float, level: float) -> np.ndarray:
    """``[num_ranks]`` the pairs at which each rank's ``cost_r`` (within ``level``) is least (ternary
    search over ``[0, total]``, ``cost_r`` being convex; the breakpoints ``0``, ``P - F`` and ``P``
    weighed too, where a flat stretch could hide the least value); 0 for ranks outside the server pool."""
    low, high = np.zeros_like(terms.pairs), np.full_like(terms.pairs, terms.total)
    for _ in range(2 * _ITERATIONS):
        left, right = low + (high - low) / 3, high - (high - low) / 3
        lower = (_rank_seconds(terms, left, config, collective, level)
                 <= _rank_seconds(terms, right, config, collective, level))
        low, high = np.where(lower, low, left), np.where(lower, right, high)
    candidates = np.stack([(low + high) / 2, np.zeros_like(low), np.maximum(terms.pairs - terms.foreign, 0.0),
                           terms.pairs])
    values = np.stack([_rank_seconds(terms, c, config, collective, level) for c in candidates])
    best = candidates[values.argmin(axis=0), np.arange(low.size)]
    return np.where(terms.serves, best, 0.0)


def _served_range(terms: RankBoundTerms, config: PlannerConfig, collective: float, level: float):
    """``(low, high, ok)``, each ``[num_ranks]``: the pairs each rank may serve within ``level``
    seconds (an interval around ``_cheapest_served``, ``cost_r`` being convex) and whether it can at all."""
    seconds = lambda served: _rank_seconds(terms, served, config, collective, level)
    best = _cheapest_served(terms, config, collective, level)
    ok = seconds(best) <= level

    def edge(inside, outside):  # bisection between a served count within the level and one past it
        for _ in range(_ITERATIONS):
            middle = (inside + outside) / 2
            within = seconds(middle) <= level
            inside, outside = np.where(within, middle, inside), np.where(within, outside, middle)
        return outside  # the interval's far side: a wider interval keeps the bound sound

    top, none = np.full_like(best, terms.total), np.zeros_like(best)
    high = np.where(seconds(top) <= level, top, edge(best, top))
    low = np.where(seconds(none) <= level, 0.0, edge(best, none))
    return np.where(terms.serves, low, 0.0), np.where(terms.serves, high, 0.0), ok


def _least_level(terms: RankBoundTerms, config: PlannerConfig, collective: float) -> float:
    def feasible(level):
        low, high, ok = _served_range(terms, config, collective, level)
        return bool(ok.all()) and low.sum() <= terms.total <= high.sum()

    # every rank's least time with no level (the bilinear bytes of what it serves for others left out)
    start = _rank_seconds(terms, _cheapest_served(terms, config, collective, None), config, collective).max(initial=0.0)
    low, high = float(start), float(max(start, 1e-12))
    while not feasible(high):
        low, high = high, 2 * high
    while high - low > _PRECISION * high:
        middle = (low + high) / 2
        low, high = (low, middle) if feasible(middle) else (middle, high)
    return low


def layer_time_lower_bound(pieces: DocumentPieces, config: PlannerConfig, terms: RankBoundTerms | None = None) -> float:
    """Seconds (one layer, forward + backward) that no plan of ``pieces`` is predicted to beat on its
    slowest rank under ``config`` (its time model, token bytes, ``exposed_comm``, ``base_pairs``,
    ``window``, servers): ``rank_time.step_seconds`` of every plan is at least this (module
    docstring). ``terms``: ``bound_terms(pieces, config)`` when in hand."""
    terms = bound_terms(pieces, config) if terms is None else terms
    if terms.total == 0 and not terms.other.any():  # no pairs and no other work
        return 0.0
    moving = _least_level(terms, config, config.time_model.collective_s)
    # a plan that moves no byte pays no collective: one exists unless some pair must move bytes (its key
    # or its query), i.e. a pair's key lives off its query's rank or a query lives outside the pool
    query_bytes, kv_bytes = config.token_bytes.q + config.token_bytes.o, config.token_bytes.kv
    outside = bool(((terms.pairs > 0) & ~terms.serves).any())
    if query_bytes > 0 and (outside or (kv_bytes > 0 and terms.foreign.sum() > 0)):
        return moving
    if query_bytes > 0:  # queries stay where they live: every rank serves its own pairs
        still = float(_rank_seconds(terms, terms.pairs, config, 0.0).max(initial=0.0))
    else:  # queries (and outputs) travel for free
        still = _least_level(terms, config, 0.0)
    return min(moving, still)
