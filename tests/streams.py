"""Pure helpers for tests of documents spanning ranks: a global token stream cut into rank slices,
and the K/V positions a server holds under a plan (shared by test_span and test_variants)."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st


def draw_slices(data, doc_lengths, world: int):
    """Cut the stream of ``doc_lengths`` into ``min(world, total)`` non-empty slices at cut points
    drawn from ``data`` (hypothesis); returns ``(per_rank lengths, first positions)``, what
    ``stitch_rank_documents`` takes."""
    total = sum(doc_lengths)
    world = min(world, total)  # every rank holds a row of at least one token
    cuts = sorted(data.draw(st.lists(st.integers(1, total - 1), min_size=world - 1, max_size=world - 1, unique=True))
                  if world > 1 else [])
    bounds = [0, *cuts, total]
    starts = np.cumsum([0, *doc_lengths[:-1]])
    per_rank, firsts = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        docs = [(max(lo, s), min(hi, s + n), s) for s, n in zip(starts, doc_lengths) if max(lo, s) < min(hi, s + n)]
        per_rank.append(np.array([b - a for a, b, _ in docs], dtype=np.int64))
        firsts.append(int(docs[0][0] - docs[0][2]) if docs else 0)
    return per_rank, firsts


def keys_on_server(pieces, transfers, server: int, doc: int) -> set:
    """Positions of document ``doc`` whose K/V ``server`` holds: its own pieces and what it receives."""
    have = set()
    for r, d, start, end in zip(pieces.rank, pieces.doc, pieces.kv_start, pieces.end):
        if d == doc and r == server:
            have.update(range(int(start), int(end)))
    for v, d, start, end in zip(transfers.server, transfers.doc, transfers.start, transfers.end):
        if v == server and d == doc:
            have.update(range(int(start), int(end)))
    return have
