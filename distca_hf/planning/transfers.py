"""What a plan moves: the Q, K/V and O token ranges that cross ranks, and their bytes.

Pure numpy. A server needs, for each document it serves, the K/V prefix ``[0, max q_end)`` of its
tasks of that document (under a sliding window, ``[min key_start(q_start), max q_end)``: the keys
before the window of its earliest query are never seen); each K/V token is sent once per (source rank, server) pair, from the rank
that holds it, however many of the server's tasks use it. Queries go from their rank to the server
when the two differ, and outputs come back the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .cost import TokenBytes, key_start
from .pieces import DocumentPieces
from .planner import Plan
from .ranges import concat_ranges

__all__ = ["KVTransfers", "kv_transfers", "kv_received", "CommBytes", "comm_bytes", "rank_bytes"]


@dataclass(frozen=True, eq=False)
class KVTransfers:
    """K/V ranges to send (arrays ``[num_transfers]``, int64): tokens ``[start, end)`` of document
    ``doc`` go from ``source`` (where they live) to ``server``."""

    source: np.ndarray
    server: np.ndarray
    doc: np.ndarray
    start: np.ndarray
    end: np.ndarray

    def tokens(self) -> int:
        return int((self.end - self.start).sum())


def kv_transfers(plan: Plan, pieces: DocumentPieces) -> KVTransfers:
    """The K/V ranges every server must receive to run its tasks of ``plan`` (cut to ``plan.window``)."""
    window = plan.window
    # The keys each server needs per document: [min key_start, max q_end) over its tasks of it.
    key = plan.server * (int(plan.doc.max(initial=0)) + 1) + plan.doc
    order = np.lexsort((-plan.q_end, key))
    first = np.ones(order.size, dtype=bool)
    first[1:] = key[order][1:] != key[order][:-1]
    need_server, need_doc, need_end = plan.server[order][first], plan.doc[order][first], plan.q_end[order][first]
    need_start = (np.minimum.reduceat(key_start(plan.q_start[order], window), np.flatnonzero(first))
                  if order.size else np.zeros(0, dtype=np.int64))

    # Join each need with every piece of its document (pieces grouped by document).
    by_doc = np.argsort(pieces.doc, kind="stable")
    piece_docs = pieces.doc[by_doc]
    lo = np.searchsorted(piece_docs, need_doc, side="left")
    hi = np.searchsorted(piece_docs, need_doc, side="right")
    counts = hi - lo
    need_idx = np.repeat(np.arange(need_doc.size), counts)
    piece_idx = by_doc[concat_ranges(lo, counts)]

    source = pieces.rank[piece_idx]
    server = need_server[need_idx]
    start = np.maximum(pieces.kv_start[piece_idx], need_start[need_idx])
    end = np.minimum(pieces.end[piece_idx], need_end[need_idx])
    send = (source != server) & (end > start)
    return KVTransfers(source[send], server[send], need_doc[need_idx][send], start[send], end[send])


@dataclass(frozen=True)
class CommBytes:
    """Bytes crossing ranks in one layer's forward under a plan."""

    q: int
    kv: int
    o: int

    @property
    def total(self) -> int:
        return self.q + self.kv + self.o


def kv_received(transfers: KVTransfers, num_ranks: int) -> np.ndarray:
    """``[num_ranks]`` K/V tokens each rank receives as a server in one layer (the memory a plan adds
    on a server, besides the queries it receives)."""
    return np.bincount(transfers.server, weights=transfers.end - transfers.start, minlength=num_ranks).astype(np.int64)


def comm_bytes(plan: Plan, pieces: DocumentPieces, token_bytes: TokenBytes,
               transfers: KVTransfers | None = None) -> CommBytes:
    """Bytes of one layer's forward; pass ``transfers`` when ``kv_transfers`` already ran."""
    moved_q = plan.moved_queries()
    kv_tokens = (transfers if transfers is not None else kv_transfers(plan, pieces)).tokens()
    return CommBytes(q=moved_q * token_bytes.q, kv=kv_tokens * token_bytes.kv, o=moved_q * token_bytes.o)


def rank_bytes(plan: Plan, pieces: DocumentPieces, token_bytes: TokenBytes,
               transfers: KVTransfers | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(sent, received)``, each ``[num_ranks]`` int64: the bytes every rank sends and receives in
    one layer's forward under ``plan`` (Q out and O back for moved tasks, K/V from the holder to the
    server). Both sum to ``comm_bytes(...).total``."""
    transfers = transfers if transfers is not None else kv_transfers(plan, pieces)
    moved = plan.source != plan.server
    queries = (plan.q_end - plan.q_start)[moved]
    source, server = plan.source[moved], plan.server[moved]
    kv = (transfers.end - transfers.start) * token_bytes.kv
    n = plan.num_ranks

    def per_rank(ranks, weights):
        return np.bincount(ranks, weights=weights, minlength=n).astype(np.int64)

    sent = per_rank(source, queries * token_bytes.q) + per_rank(server, queries * token_bytes.o) \
        + per_rank(transfers.source, kv)
    received = per_rank(server, queries * token_bytes.q) + per_rank(source, queries * token_bytes.o) \
        + per_rank(transfers.server, kv)
    return sent, received
