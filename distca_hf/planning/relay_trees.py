"""K/V relay trees: servers forwarding a holder's K/V to the next servers that need it (pure numpy).

Without relays (``transfers.kv_transfers``) every rank holding a piece of a document sends the K/V a
server needs directly to each server of a later shard, so a long document's holders send their K/V
once per server, and their links can bound the layer. With relays, the ``S`` servers that need one
K/V range of one holder form a tree: the holder sends the range to at most ``holder_fanout`` of them,
and every server that has it forwards it to at most ``fanout`` more. Each server still receives each
K/V token it needs exactly once; the holder sends each range at most ``holder_fanout`` times instead
of ``S``.

Trees: the servers of one (holder, document) are ordered by a priority (the planner's: the least
loaded first, nearest the root, since they forward the most), then by how far into the document
they need keys (furthest first), then by rank, and every elementary K/V range takes them in that
order, so a server that needs a prefix sits near the root of every tree of that prefix and a parent
forwards one contiguous range per child (sends merged per (sender, receiver, document, round)). The
root holder has children ``0 .. holder_fanout - 1``; server ``j`` (0-based in that order) has
children ``holder_fanout + j * fanout ..``, a complete tree whose depth grows as ``log_fanout S``.
A send at depth ``d`` goes out in exchange round ``d`` (round 1: the holders' own sends).

``RelayTrees`` is what a plan carries (``Plan.relays``, chosen by ``relay.relay_trees_where_they_help``
or forced by the ``kv_relays`` setting): which (holder, document) groups go along trees, their fanout
and their servers' order. It applies to any subset of the plan's K/V sends (a wave's, a ping-pong
nano-batch's), so every rank derives the same sends from the agreed plan (``plan_kv_sends``). The
runtime runs one more K/V exchange per round beyond the first in the forward, and sends the K/V
gradients back up the same trees in the backward (each server summing its children's into its own
rows before they go up), ``runtime/tables.py`` and ``runtime/phases.py``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..config import MAX_RELAY_FANOUT
from .carving import Plan
from .pieces import DocumentPieces
from .transfers import KVTransfers, RangeSends, kv_transfers

__all__ = ["RelaySends", "RelayTrees", "relay_kv_sends", "plan_kv_sends", "check_fanout", "holder_groups",
           "relay_group", "group_layout", "layout_rows", "GroupLayout", "as_sends", "sends_rounds"]


@dataclass(frozen=True, eq=False)
class RelaySends(RangeSends):
    """K/V ranges sent along relay trees (``RangeSends``: ``source`` is the sender, a holder or a
    server forwarding, ``server`` the receiver); ``round`` (``[num_sends]``, int64, from 1) is the
    exchange round of each send: 1 for a holder's own sends, ``d`` at depth ``d`` of its tree."""

    round: np.ndarray

    @property
    def rounds(self) -> int:
        """K/V exchange rounds of a layer's forward (the deepest tree; 1 = direct, 0 = nothing moves)."""
        return int(self.round.max(initial=0))


def sends_rounds(sends: RangeSends) -> np.ndarray:
    """``[num_sends]`` exchange round of every send: ``RelaySends.round``, or 1 for direct sends."""
    rounds = getattr(sends, "round", None)
    return rounds if rounds is not None else np.ones(sends.source.size, dtype=np.int64)


@dataclass(frozen=True, eq=False)
class RelayTrees:
    """Which K/V groups of a plan go along relay trees (``Plan.relays``; module docstring). Arrays
    ``[num_groups]`` (int64): the K/V of document ``doc`` that rank ``holder`` sends goes along trees
    of ``fanout`` (>= 1, the holder's own sends included), their servers in the order of ``members``
    (``[sum of member_counts]``: group after group, ``member_counts[g]`` server ranks each). Groups
    not listed go direct; servers a group does not list join its trees after the listed ones (in
    ``tree_order``'s order), so they too receive through forwarders."""

    holder: np.ndarray
    doc: np.ndarray
    fanout: np.ndarray
    members: np.ndarray
    member_counts: np.ndarray

    def __post_init__(self):
        sizes = {self.holder.size, self.doc.size, self.fanout.size, self.member_counts.size}
        if len(sizes) != 1 or int(self.member_counts.sum()) != self.members.size:
            raise ValueError("RelayTrees: holder, doc, fanout and member_counts need one entry per group, and members "
                             "sum(member_counts) ranks")
        if self.fanout.size and int(self.fanout.min()) < 1:
            raise ValueError(f"RelayTrees: every fanout must be >= 1, got {self.fanout.tolist()}")

    @classmethod
    def of(cls, groups) -> "RelayTrees":
        """From ``(holder, doc, fanout, members)`` tuples (``members``: server ranks in tree order)."""
        groups = list(groups)
        ints = lambda values: np.asarray(values, dtype=np.int64)
        return cls(ints([g[0] for g in groups]), ints([g[1] for g in groups]), ints([g[2] for g in groups]),
                   ints([s for g in groups for s in g[3]]), ints([len(g[3]) for g in groups]))

    @property
    def num_groups(self) -> int:
        return int(self.holder.size)

    def renamed(self, ranks, docs) -> "RelayTrees":
        """These trees with rank ``r`` as ``ranks[r]`` and document ``d`` as ``docs[d]`` (``[n]`` int
        arrays: a plan of a subset of ranks carried into the plan of the whole, as
        ``pipeline_cost`` joins each stage's plan into a tick's)."""
        ranks, docs = np.asarray(ranks, dtype=np.int64), np.asarray(docs, dtype=np.int64)
        return RelayTrees(ranks[self.holder], docs[self.doc], self.fanout.copy(), ranks[self.members],
                          self.member_counts.copy())

    @classmethod
    def joined(cls, parts) -> "RelayTrees":
        """The trees of ``parts`` (``RelayTrees`` of disjoint (holder, document) groups) as one."""
        parts = list(parts)
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) if parts else np.zeros(0, dtype=np.int64)
                     for f in ("holder", "doc", "fanout", "members", "member_counts")))

    def sends(self, transfers: KVTransfers) -> RelaySends:
        """The sends that deliver ``transfers`` (direct K/V sends of a plan or of a subset of it)
        along these trees; groups not listed go direct (their sends as they are, round 1)."""
        ends = np.cumsum(self.member_counts)
        table = {(h, d): (f, self.members[e - n: e].tolist()) for h, d, f, n, e in
                 zip(self.holder.tolist(), self.doc.tolist(), self.fanout.tolist(), self.member_counts.tolist(),
                     ends.tolist())}
        listed = np.zeros(transfers.source.size, dtype=bool)
        if table:
            width = int(max(transfers.doc.max(initial=0), self.doc.max(initial=0))) + 1
            listed = np.isin(transfers.source * width + transfers.doc, self.holder * width + self.doc)
        rows = []
        for group in holder_groups(transfers.subset(listed)) if listed.any() else ():
            fanout, order = table[group[0], group[1]]
            rows.append(relay_group(*group, fanout, fanout, order=order))
        relayed, direct = as_sends(rows), transfers.subset(~listed)
        return RelaySends(*(np.concatenate((getattr(direct, f), getattr(relayed, f)))
                            for f in ("source", "server", "doc", "start", "end")),
                          np.concatenate((np.ones(direct.source.size, dtype=np.int64), relayed.round)))


def check_fanout(name: str, value) -> float:
    """``value`` as a fanout: an integer from 1 to ``MAX_RELAY_FANOUT``, or ``math.inf`` (direct sends);
    else ``ValueError`` naming ``name``."""
    if value == math.inf:
        return math.inf
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 1 <= value <= MAX_RELAY_FANOUT:
        raise ValueError(f"{name} must be an integer from 1 to {MAX_RELAY_FANOUT} or math.inf (direct sends), "
                         f"got {value!r}")
    return int(value)


@functools.lru_cache(maxsize=1024)
def _tree_shape(count: int, holder_fanout: float, fanout: float) -> tuple[np.ndarray, np.ndarray]:
    """``(parent, depth)`` (``[count]`` int64) of ``count`` servers in tree order: ``parent[j]`` is
    ``-1`` (the holder) or the position of the server that forwards to ``j``; ``depth[j]`` >= 1 its
    round. Cached (read-only arrays): the planner weighs the same few shapes thousands of times."""
    parent, depth = [], []
    for j in range(count):
        p = -1 if j < holder_fanout else int((j - holder_fanout) // fanout)
        parent.append(p)
        depth.append(1 if p < 0 else depth[p] + 1)
    shape = np.asarray(parent, dtype=np.int64), np.asarray(depth, dtype=np.int64)
    for a in shape:
        a.flags.writeable = False
    return shape


def relay_kv_sends(transfers: KVTransfers, *, fanout=2, holder_fanout=None) -> RelaySends:
    """The sends of ``transfers`` (``kv_transfers`` of a plan) relayed along trees (module docstring):
    every elementary K/V range a holder must deliver to ``S`` servers goes to at most ``holder_fanout``
    (default ``fanout``) of them, and each server forwards it to at most ``fanout`` more.

    Args:
        transfers: the direct K/V sends, ``[num_sends]`` arrays of holder, server, document, tokens.
        fanout: an integer >= 1 (1: a chain) or ``math.inf`` (direct: the holder sends to all).
        holder_fanout: the holder's own sends per range (``None``: ``fanout``).

    Returns:
        ``RelaySends``, in order of sender, document, round; every server receives each token it
        receives in ``transfers`` exactly once."""
    fanout = check_fanout("fanout", fanout)
    holder_fanout = fanout if holder_fanout is None else check_fanout("holder_fanout", holder_fanout)
    return as_sends([relay_group(*group, holder_fanout, fanout) for group in holder_groups(transfers)])


def holder_groups(transfers: KVTransfers) -> list[tuple[int, int, list, list, list]]:
    """``(holder, doc, servers, starts, ends)`` of every (holder, document) of ``transfers`` (lists,
    one entry per direct send), in order of holder, then document."""
    if not transfers.source.size:
        return []
    order = np.lexsort((transfers.server, transfers.doc, transfers.source))
    source, server, doc, start, end = (x[order].tolist() for x in (transfers.source, transfers.server, transfers.doc,
                                                                 transfers.start, transfers.end))
    groups, first = [], 0
    for i in range(1, len(source) + 1):
        if i == len(source) or (source[i], doc[i]) != (source[first], doc[first]):
            groups.append((source[first], doc[first], server[first:i], start[first:i], end[first:i]))
            first = i
    return groups


def as_sends(rows) -> RelaySends:
    """``[sender, receiver, doc, start, end, round]`` rows (an int64 ``[k, 6]`` array, or a list of
    them) as ``RelaySends``, contiguous ranges of one (sender, receiver, document, round) merged into
    one send."""
    rows = np.concatenate(rows) if isinstance(rows, list) and rows else np.asarray(rows, dtype=np.int64)
    rows = rows.reshape(-1, 6)
    if rows.shape[0]:
        rows = rows[np.lexsort((rows[:, 3], rows[:, 5], rows[:, 2], rows[:, 1], rows[:, 0]))]
        # a row continues the one before when it has the same (sender, receiver, doc, round) and starts
        # where that one ends (each token reaches a receiver once, so nothing lies between them)
        joins = np.all(rows[1:, [0, 1, 2, 5]] == rows[:-1, [0, 1, 2, 5]], axis=1) & (rows[1:, 3] == rows[:-1, 4])
        first = np.concatenate(([True], ~joins))
        last = np.concatenate((~joins, [True]))
        merged = rows[first]
        merged[:, 4] = rows[last, 4]
        rows = merged
    sender, receiver, d, s, e, r = rows.T
    order = np.lexsort((s, receiver, r, d, sender))
    return RelaySends(sender[order], receiver[order], d[order], s[order], e[order], r[order])


def tree_order(servers: list, ends: list, priority=None, order=None) -> list:
    """The servers of one (holder, document) in tree order (module docstring): ``order``'s first
    (the ranks it lists, in its order), then by ``priority[server]`` (lowest first, when given), then
    furthest need first (``ends``: one per entry of ``servers``), then by rank."""
    reach: dict[int, int] = {}
    for server, end in zip(servers, ends):
        reach[server] = max(reach.get(server, 0), end)
    place = {s: i for i, s in enumerate(order or [])}
    first = (lambda s: priority[s]) if priority is not None else (lambda s: 0)
    return sorted(reach, key=lambda s: (place.get(s, len(place)), first(s), -reach[s], s))


class GroupLayout(NamedTuple):
    """Where the trees of one (holder, document) go, whatever their fanout (``group_layout``): its
    servers in tree order (``members``), its elementary ranges ``[lo, hi)`` (``[num_ranges]``) and, for
    every (range, server needing it) in range-major order, the range (``ranges``), the server's place in
    ``members`` (``places``) and its 0-based place in that range's tree (``position``); ``first``
    (``[num_ranges]``) is each range's first entry in those, ``widest`` the most servers one range has."""

    members: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    ranges: np.ndarray
    places: np.ndarray
    position: np.ndarray
    first: np.ndarray
    widest: int


def group_layout(servers: list, starts: list, ends: list, priority=None, order=None) -> GroupLayout:
    """The ``GroupLayout`` of one holder's K/V of one document sent to ``servers`` (lists, one entry
    per direct send), its members in ``tree_order``."""
    members = np.asarray(tree_order(servers, ends, priority, order), dtype=np.int64)
    place = {s: i for i, s in enumerate(members.tolist())}
    server_place = np.fromiter((place[s] for s in servers), np.int64, len(servers))
    starts, ends = np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)
    points = np.unique(np.concatenate((starts, ends)))
    lo, hi = points[:-1], points[1:]
    # [ranges, tree places]: does the member at that place need the range (any of its sends covers it)
    needs = np.zeros((lo.size, members.size), dtype=bool)
    covering, send = np.nonzero((starts <= lo[:, None]) & (hi[:, None] <= ends))
    needs[covering, server_place[send]] = True
    ranges, places = np.nonzero(needs)  # range-major; within a range, members in tree order
    counts = np.bincount(ranges, minlength=lo.size)
    first = np.cumsum(counts) - counts  # each range's first entry in (ranges, places)
    position = np.arange(ranges.size) - first[ranges]
    return GroupLayout(members, lo, hi, ranges, places, position, first, int(counts.max(initial=0)))


def layout_rows(layout: GroupLayout, holder: int, doc: int, holder_fanout: float, fanout: float) -> np.ndarray:
    """The relayed sends of ``layout``'s trees at these fanouts: ``[k, 6]`` int64 rows ``[sender,
    receiver, doc, start, end, round]``, range after range, each range's members in tree order."""
    if not layout.ranges.size:
        return np.zeros((0, 6), dtype=np.int64)
    parent, depth = _tree_shape(layout.widest, holder_fanout, fanout)
    parent = parent[layout.position]
    forwarder = layout.members[layout.places[layout.first[layout.ranges] + np.maximum(parent, 0)]]
    sender = np.where(parent < 0, holder, forwarder)
    return np.stack((sender, layout.members[layout.places], np.full(layout.ranges.size, doc, dtype=np.int64),
                     layout.lo[layout.ranges], layout.hi[layout.ranges], depth[layout.position]), axis=1)


def relay_group(holder: int, doc: int, servers: list, starts: list, ends: list, holder_fanout: float,
                fanout: float, priority=None, order=None) -> np.ndarray:
    """The relayed sends of one holder's K/V of one document to the servers that need it (lists, one
    entry per direct send): one tree per elementary range between consecutive start/end points, its
    members in ``tree_order`` (``layout_rows`` of ``group_layout``)."""
    return layout_rows(group_layout(servers, starts, ends, priority, order), holder, doc, holder_fanout, fanout)


def plan_kv_sends(plan: Plan, pieces: DocumentPieces, transfers: KVTransfers | None = None) -> RangeSends:
    """The K/V sends ``plan`` makes on ``pieces``: ``kv_transfers`` (given as ``transfers``, or made
    here), along ``plan.relays``' trees when it has some (``RelaySends``), else direct."""
    transfers = transfers if transfers is not None else kv_transfers(plan, pieces)
    return plan.relays.sends(transfers) if plan.relays is not None and plan.relays.num_groups else transfers
