"""Packing that knows micro-batches: a step's documents spread over its micro-batch rows so that no row
holds much more attention than the others, at equal tokens. Pure numpy.

This is the cheap balance any user can do without moving attention between ranks (issue 20's
``balanced_micro_batches`` baseline): it changes which row a document goes to, never how its
attention is computed. What it cannot fix is a single piece whose attention alone exceeds a
balanced row (the tail of a document longer than a row attends to the whole prefix); only moving
attention (CAD) splits that.
"""

from __future__ import annotations

import math

import numpy as np

from .baselines import pack_pieces
from .cost import causal_pairs, check_document_lengths, check_window, start_with_pairs
from .pieces import DocumentPieces

__all__ = ["MAX_ROWS", "balance_micro_batches"]

MAX_ROWS = 1 << 20
"""The most micro-batch rows ``balance_micro_batches`` fills: far beyond any step (data-parallel ranks x
micro-batches), and few enough that its per-row arrays fit in memory (a huge count is named, not a
``MemoryError``)."""


def balance_micro_batches(lengths, *, micro_batches: int, tokens: int, window: int | None = None) -> DocumentPieces:
    """Documents of ``lengths`` tokens assigned to ``micro_batches`` rows of at most ``tokens`` tokens,
    minimising the largest row's attention pairs.

    Documents longer than a row are first cut into the fewest consecutive pieces of at most ``tokens``
    tokens, shorter towards the end so that the largest piece's attention is smallest (later queries
    see longer prefixes); a piece keeps its place in its document and attends to the whole prefix
    (``causal_pairs(start, end)``: cutting never changes the attention computed).
    Pieces then go, most pairs first, each to the row with the fewest pairs that has room for all of
    it; a piece that fits no row whole is cut to fill the row with the most room, and its rest goes on.
    The result is compared with packing the documents in order (``baselines.pack_pieces``) and the one
    whose busiest row holds fewer pairs is returned, so it is never worse than that.

    Args:
        lengths: ``[documents]`` tokens of each document (>= 1), in any order.
        micro_batches: rows to fill (>= 1); a data-parallel step of ``D`` ranks x ``M`` micro-batches
            passes ``D * M`` (row ``m * D + d``: micro-batch ``m`` of rank ``d``).
        tokens: tokens a row holds (>= 1).
        window: sliding attention window counted in the pairs (``None``: full causal; else an integer >= 1).

    Returns:
        ``DocumentPieces`` with ``num_ranks = micro_batches`` (a "rank" is a row) and ``doc`` indexing
        ``lengths``: every token of every document exactly once, no row over ``tokens``; when the
        documents total ``micro_batches * tokens`` every row holds exactly ``tokens``.

    Raises:
        ValueError: bad arguments, or more tokens than the rows hold (naming both numbers).
    """
    for name, value in (("micro_batches", micro_batches), ("tokens", tokens)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if micro_batches > MAX_ROWS:
        raise ValueError(f"micro_batches must be at most {MAX_ROWS} rows (data-parallel ranks x micro-batches of one "
                         f"step), got {micro_batches}")
    lengths = check_document_lengths(lengths, "lengths", minimum=1)
    window = check_window(window)
    capacity = int(micro_batches) * int(tokens)
    if int(lengths.sum()) > capacity:
        raise ValueError(f"the documents hold {int(lengths.sum())} tokens, more than {micro_batches} micro-batch "
                         f"rows x {tokens} tokens = {capacity}; pass fewer documents or more rows")
    naive = pack_pieces(lengths, int(micro_batches), int(tokens))
    if lengths.size == 0:
        return naive
    # documents cut into consecutive pieces of at most a row: (doc, start, end)
    doc, start, end = [], [], []
    for d, n in enumerate(lengths.tolist()):
        bounds = _cut_document(n, int(tokens), window) if n > tokens else [0, n]
        doc += [d] * (len(bounds) - 1)
        start += bounds[:-1]
        end += bounds[1:]
    doc, start, end = np.array(doc), np.array(start), np.array(end)
    pairs = causal_pairs(start, end, window)
    order = np.lexsort((start, doc, -(end - start), -pairs))  # most pairs first; ties: longer, then in order

    free = np.full(micro_batches, tokens, dtype=np.int64)
    load = np.zeros(micro_batches, dtype=np.float64)
    rows, docs, starts, ends = [], [], [], []
    for i in order.tolist():
        d, s, e = int(doc[i]), int(start[i]), int(end[i])
        while s < e:
            fits = free >= e - s
            if fits.any():
                r, cut = int(np.argmin(np.where(fits, load, np.inf))), e
            else:  # fits no row whole: fill the roomiest row with its front, go on with the rest
                r = int(np.argmax(free))
                cut = s + int(free[r])
            rows.append(r), docs.append(d), starts.append(s), ends.append(cut)
            free[r] -= cut - s
            load[r] += float(causal_pairs(s, cut, window))
            s = cut
    balanced = _merge_touching(np.array(rows), np.array(docs), np.array(starts), np.array(ends), int(micro_batches))
    if balanced.local_pairs(window).max() <= naive.local_pairs(window).max():
        return balanced
    return naive


def _cut_document(length: int, tokens: int, window: int | None) -> list[int]:
    """Bounds ``[0, b1, ..., length]`` of the fewest pieces of at most ``tokens`` tokens
    (``ceil(length / tokens)``) whose largest attention is smallest: later queries see longer
    prefixes, so the pieces shorten towards the document's end (a binary search on the largest
    piece's pairs, each trial cutting from the end the longest piece under it)."""
    count = -(-length // tokens)

    def cut(most: int) -> list[int] | None:
        bounds, end = [length], length
        while end > 0 and len(bounds) <= count:
            begin = max(end - tokens, 0, math.ceil(start_with_pairs(end, most, window)) - 1)
            while begin < end and causal_pairs(begin, end, window) > most:
                begin += 1
            if begin == end:  # one query alone sees more keys than `most`
                return None
            bounds.append(begin)
            end = begin
        return bounds[::-1] if end == 0 else None

    aligned = list(range(0, length, tokens)) + [length]  # row-sized from the start: always feasible
    high = max(int(causal_pairs(a, b, window)) for a, b in zip(aligned, aligned[1:]))
    low = -(-int(causal_pairs(0, length, window)) // count)
    while low < high:
        middle = (low + high) // 2
        if cut(middle) is None:
            low = middle + 1
        else:
            high = middle
    return cut(high) or aligned


def _merge_touching(rank, doc, start, end, num_ranks) -> DocumentPieces:
    """One piece for consecutive pieces of a document that landed on the same row."""
    order = np.lexsort((start, rank, doc))
    rank, doc, start, end = rank[order], doc[order], start[order], end[order]
    joins = np.zeros(rank.size, dtype=bool)
    joins[1:] = (doc[1:] == doc[:-1]) & (rank[1:] == rank[:-1]) & (start[1:] == end[:-1])
    group = np.cumsum(~joins) - 1
    keep = ~joins
    merged_end = np.zeros(int(keep.sum()), dtype=np.int64)
    np.maximum.at(merged_end, group, end)
    return DocumentPieces(rank[keep], doc[keep], start[keep], merged_end, num_ranks)
