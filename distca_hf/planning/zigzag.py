"""Per-document context parallelism as CA-tasks: the "CP-shaped" candidate ``tolerance="auto"`` weighs
beside the descent and the carvings (issue 21). Pure numpy and Python; no torch.distributed.

Zigzag CP (``baselines.head_tail_chunks``, what the simulator's per-document CP runs) cuts a document
spanning ``c`` ranks into ``2 c`` equal chunks and gives holder ``i`` chunks ``i`` and ``2 c - 1 - i``:
every holder gets about the same pairs. Each chunk's queries with their causal prefix is a CA-task,
so the same layout is a plan: here the ``c`` holders are the ranks that hold the document's queries
in the packed batch, in position order (no data-parallel group cuts the document, so nothing of its
attention is dropped), a chunk's queries stay in one task per rank they live on (a task has one
source), and every other document stays colocated. ``by_time`` judges it like every candidate (bytes
from ``transfers``: each holder receives the K/V prefix of its tail chunk from the other holders,
queries travel to their chunk's holder and outputs back), so ``auto`` is never predicted slower
than CP of the documents as they are packed.

Chunk bounds are cut at multiples of ``block`` from the start of the piece they fall in (the
planner's shard rule); a bound that rounds onto its neighbour leaves that chunk empty.
"""

from __future__ import annotations

import numpy as np

from .carving import Plan
from .cost import TimeModel, causal_pairs
from .pieces import DocumentPieces

__all__ = ["zigzag_plan", "zigzag_lower_bound"]


def _query_pieces(pieces: DocumentPieces):
    """``(rank, doc, start, end, spanning, spans)``: the pieces holding queries, ``spanning`` [those
    pieces] true where the piece's document has queries on more than one rank, and ``spans``
    [documents] the same per document (``DocumentPieces.query_spanning``); ``None`` when no document spans
    ranks (the CP-shaped plan would be colocated, so it does not exist)."""
    has_queries = pieces.end > pieces.start
    rank, doc, start, end = (x[has_queries] for x in (pieces.rank, pieces.doc, pieces.start, pieces.end))
    spans = pieces.query_spanning()
    spanning = spans[doc]
    if not spanning.any():
        return None
    return rank, doc, start, end, spanning, spans


def zigzag_plan(pieces: DocumentPieces, servers: tuple[int, ...] | None = None, *, window: int | None = None,
                block: int = 1) -> Plan | None:
    """The CP-shaped plan of ``pieces`` (module docstring): every document whose queries lie on more
    than one rank zigzagged over those ranks, the others colocated. ``None`` when no document's
    queries span ranks (the plan would be colocated) or when a rank holding queries is outside
    ``servers`` (CP computes on the holders, which must then serve). Tasks sorted by server, source,
    document and queries, as plans are."""
    if block < 1:
        raise ValueError(f"block must be an integer >= 1, got {block!r}")
    found = _query_pieces(pieces)
    if found is None:
        return None
    rank, doc, start, end, spanning, _ = found
    if servers is not None:
        is_server = np.zeros(pieces.num_ranks, dtype=bool)
        is_server[list(servers)] = True
        if not is_server[rank].all():
            return None
    servers = tuple(range(pieces.num_ranks)) if servers is None else tuple(servers)
    source, server, q_doc, q_start, q_end = _zigzag_tasks(*(x[spanning] for x in (rank, doc, start, end)), block)
    local = ~spanning
    cols = [np.concatenate((x[local], y)) for x, y in zip((rank, rank, doc, start, end),
                                                             (source, server, q_doc, q_start, q_end))]
    order = np.lexsort((cols[3], cols[2], cols[0], cols[1]))
    return Plan(*(c[order] for c in cols), pieces.num_ranks, servers, window)


def zigzag_lower_bound(pieces: DocumentPieces, time_model: TimeModel, window: int | None = None) -> float:
    """A lower bound (seconds) on the predicted step of ``zigzag_plan(pieces)``, from one pass over the
    pieces, so ``by_time`` skips building and judging it when it cannot win. A rank's compute is at
    least its linear layers and the pairs of its documents on one rank (they stay colocated), its
    ``base``; and for a document spanning ranks, whose pairs its holders share, the busiest holder
    computes at least the mean over the document's pieces of ``base`` of the piece's rank plus the
    document's pairs over its pieces (a holder's share of the document, each counted once per piece
    it holds, sums to at least the document's pairs). Keys, tasks and communication only add
    (``collective_s`` too, but not always: under a sliding window a holder may need nothing from the
    others). ``inf`` when the plan does not exist."""
    found = _query_pieces(pieces)
    if found is None:
        return float("inf")
    rank, doc, start, end, spanning, spans = found
    pairs = causal_pairs(start, end, window).astype(np.float64)
    base = time_model.rank_seconds(pieces.tokens(), np.bincount(rank[~spanning], weights=pairs[~spanning],
                                                              minlength=pieces.num_ranks))
    doc_pieces = np.bincount(doc[spanning], minlength=spans.size)[spans]
    doc_seconds = (np.bincount(doc[spanning], weights=base[rank[spanning]], minlength=spans.size)[spans]
                   + time_model.attn_s_per_pair * np.bincount(doc[spanning], weights=pairs[spanning],
                                                              minlength=spans.size)[spans])
    return float(max(base.max(), (doc_seconds / doc_pieces).max()))


def _zigzag_tasks(rank: np.ndarray, doc: np.ndarray, start: np.ndarray, end: np.ndarray, block: int):
    """``(source, server, doc, q_start, q_end)`` arrays of the tasks of the documents whose query pieces
    are ``rank``/``doc``/``start``/``end`` (``[pieces]``, each document on more than one rank): a
    document's query span ``[first start, last end)`` cut into ``2 c`` chunks for its ``c`` holder
    ranks (in position order), chunk ``k`` served by holder ``min(k, 2 c - 1 - k)``, a chunk cut where
    the pieces holding its queries end (a task has one source), touching tasks of one source and
    server joined (the middle holder's two chunks)."""
    order = np.lexsort((start, doc))
    rank, doc, start, end = rank[order], doc[order], start[order], end[order]
    docs, first, pieces_per_doc = np.unique(doc, return_index=True, return_counts=True)
    # holders: the distinct ranks of a document's pieces, numbered in position order
    holder_key = doc * (int(rank.max()) + 1) + rank
    keys, where = np.unique(holder_key, return_index=True)
    by_position = np.argsort(where, kind="stable")
    holder_doc = keys[by_position] // (int(rank.max()) + 1)
    holder_rank = keys[by_position] % (int(rank.max()) + 1)
    holder_order = np.lexsort((where[by_position], holder_doc))  # holders by document, then position
    holder_rank = holder_rank[holder_order]
    holders = np.bincount(np.searchsorted(docs, holder_doc[holder_order]), minlength=docs.size)
    holder_first = np.cumsum(holders) - holders
    # chunk bounds, 2c + 1 per document, in document positions
    q0 = start[first]
    q1 = np.maximum.reduceat(end, first)
    count = 2 * holders
    size, extra = (q1 - q0) // count, (q1 - q0) % count
    bound_doc = np.repeat(np.arange(docs.size), count + 1)
    k = np.arange(bound_doc.size) - np.repeat(np.cumsum(count + 1) - (count + 1), count + 1)
    bound = q0[bound_doc] + k * size[bound_doc] + np.minimum(k, extra[bound_doc])
    # an inner bound inside a piece moves to a multiple of `block` from that piece's start
    span = int(q1.max()) + 1
    g_start = np.searchsorted(docs, doc) * span + start  # positions made global: documents never mix
    g_end = g_start - start + end
    g_bound = bound_doc * span + bound
    inside = np.minimum(np.searchsorted(g_end, g_bound, side="right"), g_end.size - 1)
    inner = (g_start[inside] < g_bound) & (g_bound < g_end[inside])
    rounded = np.minimum(start[inside] + (bound - start[inside] + block // 2) // block * block, end[inside])
    bound = np.where(inner, rounded, bound)
    g_bound = np.maximum.accumulate(bound_doc * span + bound)  # kept ordered within each document
    # elementary segments between consecutive points of the bounds and the piece edges
    points = np.unique(np.concatenate((g_bound, g_start, g_end)))
    lo, hi = points[:-1], points[1:]
    piece = np.searchsorted(g_start, lo, side="right") - 1
    keep = (piece >= 0) & (lo < g_end[np.maximum(piece, 0)]) & (hi <= g_end[np.maximum(piece, 0)])
    lo, hi, piece = lo[keep], hi[keep], piece[keep]
    chunk = np.searchsorted(g_bound, lo, side="right") - 1  # the global index of the bound starting its chunk
    seg_doc = bound_doc[chunk]
    k = chunk - (np.cumsum(count + 1) - (count + 1))[seg_doc]
    holder = np.minimum(k, count[seg_doc] - 1 - k)
    server = holder_rank[holder_first[seg_doc] + holder]
    source = rank[piece]
    # join touching segments of one (document, source, server)
    new = np.ones(lo.size, dtype=bool)
    new[1:] = (lo[1:] != hi[:-1]) | (source[1:] != source[:-1]) | (server[1:] != server[:-1])
    starts = np.flatnonzero(new)
    ends = np.concatenate((starts[1:], [lo.size])) - 1
    base = seg_doc[starts] * span
    return (source[starts], server[starts], docs[seg_doc[starts]], lo[starts] - base, hi[ends] - base)
