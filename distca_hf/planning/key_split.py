"""Key-split CA-tasks (2D tiles): queries ``[a, b)`` of a document against only part of their keys,
``[k0, k1)``. Pure numpy.

A task whose K/V prefix is long and held on other ranks makes its server receive all of it; a long
document's first-piece holders then send their K/V to every server of a later shard. Splitting the
keys instead lets the queries travel to where the early K/V already lives: each tile gives a partial
output and its log-sum-exp, which merge exactly (``kernels.merge``); backward runs each tile with the
row's merged output and log-sum-exp, and the dQ partials of a row sum.

Tile shapes the kernels run (``check_tiles`` enforces them; ``plan.window`` is the sliding window):

- *causal*: ``k1 == b`` and ``key_start(a, window) <= k0 <= a``: bottom-right aligned, as a whole
  CA-task (which is the case ``k0 == key_start(a, window)``);
- *full*: ``k0 < k1 <= a + 1``: every query sees every key (no mask); under a window also
  ``k0 >= b - window``, so that the latest query's window still holds the first key.

Any set of tiles that covers every (query, key) pair of every document exactly once gives the
attention of the whole documents (``check_tiles`` checks it).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .carving import Plan
from .cost import key_start
from .pieces import DocumentPieces
from .ranges import concat_ranges

__all__ = ["full_tiles", "check_tiles", "task_tiles", "with_key_ranges"]


def with_key_ranges(plan: Plan) -> Plan:
    """``plan`` with explicit key ranges (its whole prefixes when it splits no keys)."""
    if plan.splits_keys:
        return plan
    k_start, k_end = plan.key_ranges()
    return dataclasses.replace(plan, k_start=np.asarray(k_start, dtype=np.int64).copy(), k_end=plan.q_end.copy())


def full_tiles(plan: Plan) -> np.ndarray:
    """``[num_tasks]`` bool: the tasks whose every query sees every key (full tiles); all False for a
    plan without key ranges."""
    if not plan.splits_keys:
        return np.zeros(plan.num_tasks, dtype=bool)
    return plan.k_end < plan.q_end


def check_tiles(plan: Plan, pieces: DocumentPieces | None = None) -> None:
    """Raise ``ValueError`` naming the first bad task unless every task of ``plan`` is a causal or a
    full tile (module docstring) and, with ``pieces``, the tiles cover every (query, key) pair of
    every document's queries in ``pieces`` exactly once (no pair twice, none missing)."""
    k_start, k_end = plan.key_ranges()
    a, b, w = plan.q_start, plan.q_end, plan.window
    causal = (k_end == b) & (k_start >= key_start(a, w)) & (k_start <= a)
    full = (k_start < k_end) & (k_end <= a + 1)
    if w is not None:
        full &= k_start >= b - w
    bad = np.flatnonzero(~(causal | full) | (a >= b))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"task {i} (document {int(plan.doc[i])}, queries [{int(a[i])}, {int(b[i])}), keys [{int(k_start[i])}, "
            f"{int(k_end[i])}), window {w}) is neither a causal tile (keys end at the queries' end and start in "
            f"[key_start(q_start), q_start]) nor a full tile (keys end by q_start + 1{', start at q_end - window or later' if w else ''})")
    if pieces is None:
        return
    # every query row of every tile, with the keys it sees there
    lengths = b - a
    task = np.repeat(np.arange(plan.num_tasks), lengths)
    t = concat_ranges(a, lengths)
    lo = np.maximum(k_start[task], key_start(t, w))
    hi = np.minimum(k_end[task], t + 1)
    order = np.lexsort((lo, t, plan.doc[task]))
    doc, t, lo, hi = plan.doc[task][order], t[order], lo[order], hi[order]
    same = np.zeros(doc.size, dtype=bool)
    same[1:] = (doc[1:] == doc[:-1]) & (t[1:] == t[:-1])
    expected_lo = np.where(same, np.concatenate(([0], hi[:-1])), key_start(t, w))
    last = np.ones(doc.size, dtype=bool)
    last[:-1] = ~same[1:]
    wrong = (lo != expected_lo) | (hi <= lo) | (last & (hi != t + 1))
    if wrong.any():
        i = int(np.flatnonzero(wrong)[0])
        raise ValueError(f"document {int(doc[i])}, query {int(t[i])}: its tiles' keys do not cover [key_start, query] "
                         f"exactly once (a tile gives keys [{int(lo[i])}, {int(hi[i])}) where [{int(expected_lo[i])}, ...) "
                         "was expected)")
    # every query of the pieces, each in some tile (the rows above are distinct per (doc, t) start)
    have = np.unique(doc[~same] * (int(b.max(initial=0)) + 1) + t[~same])
    queries = pieces.end - pieces.start
    want = np.unique(np.repeat(pieces.doc, queries) * (int(b.max(initial=0)) + 1) + concat_ranges(pieces.start, queries))
    if not np.array_equal(have, want):
        raise ValueError(f"the tiles cover {have.size} query tokens, the pieces hold {want.size}: a query is lost or "
                         "invented")


def task_tiles(task: tuple, causal_start: int, where) -> list[tuple]:
    """The tiles of a whole-prefix task ``task`` = ``(source, server, doc, a, b, k0, k1)`` whose earlier
    prefix pieces ``where`` = ``[(x0, x1, rank)]`` (in key order, before ``causal_start``) are computed
    on ``rank``: a causal tile ``[a, b) x [causal_start, b)`` on the server, which the pieces the server
    keeps next to it join, and a full tile per piece elsewhere (adjacent pieces on one rank make one).
    ``[task]`` when every piece stays on the server. Rows as ``task``."""
    source, server, doc, a, b = task[:5]
    where, c = list(where), causal_start
    while where and where[-1][2] == server:  # kept pieces next to the causal tile join it
        c = where.pop()[0]
    if not where:
        return [task]
    tiles = [(source, server, doc, a, b, c, b)]
    for x0, x1, h in where:
        last = tiles[-1]
        if len(tiles) > 1 and last[1] == h and last[6] == x0:  # adjacent keys on one rank: one tile
            tiles[-1] = last[:6] + (x1,)
        else:
            tiles.append((source, h, doc, a, b, x0, x1))
    return tiles
