"""Documents spanning ranks as a grid of key-split tiles, placed by time: ``tolerance="auto"``'s
candidate for batches whose long documents make every other plan move their whole K/V prefix
(issue 21). Pure numpy and Python; no torch.distributed.

Why. A CA-task carries its document's whole K/V prefix: a server taking the late queries of a
document of ``L`` tokens receives ``L`` keys, and every holder of that document sends its piece to
every such server. With a 1M-token document over 32 ranks of 32k tokens, balancing its attention
over 64 ranks makes each of them receive about 4 GB of K/V per layer and each holder send about
8 GB (the descent's plan, measured). Tiles (``key_split``) cut the keys too: a tile of ``m`` queries
and ``n`` keys moves ``m (q + o + lse) + n kv`` bytes for ``m n`` pairs, fewest at ``n = r m`` with
``r = (q + o + lse) / kv`` (about 4 for Llama-3-8B's grouped-query attention), so a server's share
of the document travels in far fewer bytes than its prefix.

The grid. Each long document (``LONG``: its pairs need several servers) whose queries lie on more
than one rank (and whose pieces hold no key-only rows) is cut into query blocks: every piece at multiples of ``m`` tokens from its start (``m`` a
multiple of ``block``); ``r`` consecutive blocks make a key group. Query block ``[a, b)`` gets a full
tile for every key group wholly before it and one causal tile ``[k0, b)`` with ``k0`` the start of its
own key group (``key_split.check_tiles``' two shapes). ``m`` is chosen so that a tile holds about
half of the mean attention a server adds for these documents, which leaves the placement room to
balance.

Placement. Every other document stays colocated (its queries, and its K/V, where they live). Tiles go
largest first (pairs) each to the rank whose predicted time after taking it (and that of the ranks
it makes send: the queries' holder, the key group's holders that the server did not already get) is
least, among the queries' holder, the key group's holders and the ``LEAST_LOADED`` ranks predicted
fastest; the prediction is the time model's (``by_time``'s terms: other work (``rank_time.other_seconds``:
the linear layers, or a pipeline tick's ``base_pairs``), pairs, keys and one task per tile, the
exposed share of bytes at both ends). ``by_time`` then judges the plan exactly, like
every candidate, so an approximate placement can only cost the candidate its turn.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from .carving import Plan, PlannerConfig
from .cost import causal_pairs, tile_pairs
from .pieces import DocumentPieces
from .rank_time import other_seconds

__all__ = ["tile_grid_plan", "DOMINANT", "LEAST_LOADED", "LONG", "TILE_SHARE"]

LEAST_LOADED = 3
"""Besides the ranks holding a tile's queries or keys, the placement tries this many of the ranks
predicted fastest."""

LONG = 8.0
"""A document is tiled when it holds at least this many times the mean pairs per server (its
attention needs that many servers at least); shorter ones stay colocated."""

DOMINANT = 0.5
"""The grid is built only when the long documents hold at least this share of the batch's pairs
(measured: where they hold less, as on the untuned lognormal sample at 512 x 32k, the other
documents, left colocated, make it lose to the descent by 2x or more, and building it costs
100 ms there)."""

TILE_SHARE = 0.5
"""A tile holds about this share of the mean attention (pairs) a server adds for the tiled documents."""


def tile_grid_plan(pieces: DocumentPieces, config: PlannerConfig, *, backward: str | None = None,
                   give_up_at: float = math.inf) -> Plan | None:
    """The tile-grid plan of ``pieces`` (module docstring), its bytes timed in ``backward`` mode
    (default ``config.backward``), every server of ``config.servers`` (all ranks by default) taking
    tiles; ``None`` when no document qualifies, under a sliding window (a full tile must then lie
    inside every query's window: not built here), or when a rank holding queries does not serve.
    ``give_up_at`` (seconds, ``by_time``: the best candidate's step): ``None`` as well, before any
    tile is placed, when the plan is sure to be predicted no faster: some rank's base time (its
    other work and the documents left colocated, which the exact judgement counts and more) reaches it."""
    if config.window is not None:
        return None
    n = pieces.num_ranks
    servers = tuple(range(n)) if config.servers is None else tuple(config.servers)
    is_server = np.zeros(n, dtype=bool)
    is_server[list(servers)] = True
    has_queries = pieces.end > pieces.start
    if not is_server[pieces.rank[has_queries]].all():
        return None
    all_pairs = causal_pairs(pieces.start, pieces.end)
    tiled = _tiled_documents(pieces, all_pairs, LONG * all_pairs.sum() / len(servers))
    doc_pairs = float(all_pairs[tiled].sum())
    if not tiled.any() or doc_pairs < DOMINANT * all_pairs.sum():
        return None
    tm, tb = config.time_model, config.token_bytes
    byte_s = tm.byte_seconds(config.exposed_comm, backward or config.backward)
    returned = tb.o + tb.lse

    # every other piece stays where it is: its rank's base time, other work (the linear layers, or
    # base_pairs' in a pipeline tick: rank_time's formula) included (its K/V transfers, for a spanning
    # document left whole, are not counted: the exact judgement in by_time counts them)
    local = has_queries & ~tiled
    pairs = all_pairs[local].astype(np.float64)
    time = (other_seconds(pieces.tokens(), config)
            + np.bincount(pieces.rank[local], weights=tm.task_seconds(pairs, pieces.end[local]), minlength=n))
    if float(time.max(initial=0.0)) >= give_up_at * (1 + 1e-9):  # (a hair above: sums in another order)
        return None
    if tm.collective_s:
        time = time + tm.collective_s

    # the grid: query blocks of m tokens, key groups of r blocks
    ratio = max(1, round((tb.q + returned) / max(tb.kv, 1)))
    tile = max(TILE_SHARE * doc_pairs / len(servers), 1.0)
    block = config.block
    m = max(block, int(math.sqrt(tile / ratio)) // block * block)
    tiles = _grid(pieces, tiled, m, ratio)  # rows (doc, a, b, k0, k1, source, group)
    if not tiles:
        return None
    holders = _group_holders(pieces, tiled, tiles)

    t = time.tolist()
    heap = [(t[s], s) for s in servers]
    heapq.heapify(heap)
    received: set[tuple[int, int, int]] = set()  # (server, doc, group) whose keys it has
    rows = []
    pair_counts = [int(x) for x in tile_pairs(*(np.asarray([r[i] for r in tiles]) for i in (1, 2, 3, 4)))]
    order = sorted(range(len(tiles)), key=lambda i: (-pair_counts[i], i))
    for i in order:
        doc, a, b, k0, k1, source, group = tiles[i]
        compute = tm.task_seconds(pair_counts[i], k1 - k0)
        queries = b - a
        key_holders = holders[(doc, group)]  # [(rank, tokens of the group's keys it holds within [k0, k1))]
        choices = dict.fromkeys([source] + [h for h, _ in key_holders if is_server[h]])
        for _, s in _least(heap, t, LEAST_LOADED):
            choices.setdefault(s)
        best, best_key = None, None
        for s in choices:
            changes = {s: compute}
            if s != source:
                moved = byte_s * queries * (tb.q + returned)
                changes[s] += moved
                changes[source] = changes.get(source, 0.0) + moved
            if (s, doc, group) not in received:
                for h, tokens in key_holders:
                    if h != s:
                        cost = byte_s * tokens * tb.kv
                        changes[s] += cost
                        changes[h] = changes.get(h, 0.0) + cost
            key = (max(t[r] + add for r, add in changes.items()), sum(changes.values()), s)
            if best_key is None or key < best_key:
                best, best_key = (s, changes), key
        s, changes = best
        for r, add in changes.items():
            t[r] += add
            if is_server[r]:
                heapq.heappush(heap, (t[r], r))
        received.add((s, doc, group))
        rows.append((source, s, doc, a, b, k0, k1))

    # the other documents' tasks: whole prefixes where their queries live
    local_rows = np.stack([pieces.rank[local], pieces.rank[local], pieces.doc[local], pieces.start[local],
                           pieces.end[local], np.zeros(int(local.sum()), dtype=np.int64), pieces.end[local]])
    cols = np.concatenate((local_rows, np.asarray(rows, dtype=np.int64).reshape(-1, 7).T), axis=1)
    order = np.lexsort((cols[5], cols[3], cols[2], cols[0], cols[1]))
    source, server, doc, q_start, q_end, k_start, k_end = (c[order] for c in cols)
    return Plan(source, server, doc, q_start, q_end, n, servers, None, backward or config.backward, k_start, k_end)


def _least(heap, time, count):
    """The ``count`` entries of the lazy min-heap ``heap`` that are current (``time[rank]``), left in it."""
    found, popped = [], []
    while heap and len(found) < count:
        item = heapq.heappop(heap)
        if item[0] != time[item[1]]:
            continue
        popped.append(item)
        found.append(item)
    for item in popped:
        heapq.heappush(heap, item)
    return found


def _tiled_documents(pieces: DocumentPieces, pairs: np.ndarray, min_pairs: float) -> np.ndarray:
    """``[num_pieces]`` bool: the pieces of documents of at least ``min_pairs`` pairs (``pairs``: each
    piece's, ``[num_pieces]``) whose queries lie on more than one rank and whose pieces hold no
    key-only rows (their queries tile ``[0, length)``)."""
    has_queries = pieces.end > pieces.start
    if not has_queries.any():
        return np.zeros(pieces.num_pieces, dtype=bool)
    spans = pieces.query_spanning()
    size = spans.size
    key_only = np.zeros(size, dtype=bool)
    key_only[pieces.doc[pieces.kv_start < pieces.start]] = True
    key_only[pieces.doc[~has_queries]] = True
    long = np.bincount(pieces.doc, weights=pairs.astype(np.float64), minlength=size) >= min_pairs
    return (spans & long & ~key_only)[pieces.doc]


def _grid(pieces: DocumentPieces, tiled: np.ndarray, m: int, ratio: int):
    """Tiles ``(doc, a, b, k0, k1, source, group)`` of the tiled documents (module docstring)."""
    order = np.flatnonzero(tiled)
    order = order[np.lexsort((pieces.start[order], pieces.doc[order]))]
    tiles = []
    blocks: list[tuple[int, int, int]] = []  # the current document's query blocks (a, b, source)
    current = None

    def flush(doc):
        group_start = [blocks[g * ratio][0] for g in range(-(-len(blocks) // ratio))]
        for index, (a, b, source) in enumerate(blocks):
            group = index // ratio
            for g in range(group):
                end = group_start[g + 1]
                tiles.append((doc, a, b, group_start[g], end, source, g))
            tiles.append((doc, a, b, group_start[group], b, source, group))

    for doc, rank, start, end in zip(pieces.doc[order].tolist(), pieces.rank[order].tolist(),
                                     pieces.start[order].tolist(), pieces.end[order].tolist()):
        if doc != current:
            if current is not None:
                flush(current)
            current, blocks = doc, []
        for a in range(start, end, m):
            blocks.append((a, min(a + m, end), rank))
    if current is not None:
        flush(current)
    return tiles


def _group_holders(pieces: DocumentPieces, tiled: np.ndarray, tiles) -> dict:
    """``{(doc, group): [(rank, tokens)]}``: the ranks holding each key group's keys (as far as its
    tiles reach: ``[k0, max k1)``) and how many."""
    reach: dict[tuple[int, int], list[int]] = {}
    for doc, a, b, k0, k1, source, group in tiles:
        span = reach.setdefault((doc, group), [k0, k1])
        span[1] = max(span[1], k1)
    by_doc: dict[int, list[tuple[int, int, int]]] = {}
    for doc, rank, kv_start, end in zip(pieces.doc[tiled].tolist(), pieces.rank[tiled].tolist(),
                                        pieces.kv_start[tiled].tolist(), pieces.end[tiled].tolist()):
        by_doc.setdefault(doc, []).append((kv_start, end, rank))
    holders = {}
    for (doc, group), (k0, k1) in reach.items():
        counts: dict[int, int] = {}
        for x0, x1, rank in by_doc[doc]:
            overlap = min(x1, k1) - max(x0, k0)
            if overlap > 0:
                counts[rank] = counts.get(rank, 0) + overlap
        holders[(doc, group)] = list(counts.items())
    return holders
