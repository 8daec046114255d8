"""What K/V relays would give: a plan's bytes and time if servers forwarded K/V (a what-if, pure numpy).

Today (``transfers.kv_transfers``) every rank holding a piece of a document sends the K/V a server
needs **directly** to each server of a later shard, so a long document's holders send their K/V
once per server and their links bound the layer (issues 20 and 21). With relays, the ``S`` servers
that need one K/V range of one holder form a tree: the holder sends the range to at most
``holder_fanout`` of them, and every server that has it forwards it to at most ``fanout`` more.
Each server still receives each K/V token it needs exactly once; the holder sends each range at
most ``holder_fanout`` times instead of ``S``.

What the relay costs (all counted here, nothing hidden):

- latency: a send at depth ``d`` of its tree goes out in exchange round ``d``; a layer then needs
  ``rounds`` = the deepest tree's depth K/V exchanges in its forward instead of one, and as many
  for the K/V gradients in its backward. Each extra round is one more all-to-all, which every rank of
  the group enters (``relay_rank_seconds`` adds ``TimeModel.collective_s`` per extra round to every
  rank: the time model's fixed cost of a layer's dispatch, so a generous price for one more round).
- bytes on servers: a server that forwards sends what it forwards, on top of what it receives; the
  total bytes crossing ranks are the same as direct (one send per server and range), they only move
  from the holders' links to the servers'.
- backward: in ``saved`` mode the K/V gradients flow back up the same tree, each server summing its
  children's with its own before sending one range to its parent (so the backward moves exactly the
  forward's K/V bytes, reversed, per rank: ``COMM_PASSES["saved"]`` holds); in ``resend`` mode the
  backward also relays K/V down the tree again before the gradients go up (``COMM_PASSES["resend"]``
  holds too). Queries and outputs stay point-to-point, as in ``transfers.query_sends``.

Trees: the servers of one (holder, document) are ordered by how far into the document they need
keys (furthest first, then by rank), and every elementary K/V range takes them in that order, so a
server that needs a prefix sits near the root of every tree of that prefix and a parent forwards one
contiguous range per child (sends merged per (sender, receiver, document, round)). The root holder
has children ``0 .. holder_fanout - 1``; server ``j`` (0-based in that order) has children
``holder_fanout + j * fanout ..``, a complete tree whose depth grows as ``log_fanout S``.
``fanout=math.inf`` is the direct dispatch.

A real implementation would need (not done here): in the runtime, one more K/V exchange per tree
level in the forward and one more dK/dV exchange per level in the backward (``runtime/tables.py``:
per-round send/receive tables, a server's receive buffer becoming the next round's send buffer;
``runtime/phases.py`` and ``dispatch.py``: the rounds in order, gradients summed at each hop before
going up); in the planner, the descent (``descent.py``) and the byte counters (``transfers.RunningBytes``)
would price a new server of a prefix at its parent server's link, not the holder's, and count the
rounds' latency (``runtime/exchange.py`` too, if a round's sends leave before the previous round's
all arrive).

What it gives (``examples/relay_whatif.py``, H100 model): relays at a fixed fanout make today's plans
slower (the descent already balances every rank's compute against its links, so a forwarding
server becomes the slowest rank); relays placed by time (``relay_where_it_helps``) gain 0-2%; plans
that fan long documents out further, re-timed with relays placed by time, gain up to 27% (prolong
64 x 128k). Rows bound by compute (wlbllm 512 x 512k: the slowest rank is 99% compute) gain nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .baselines import RankLoads
from .carving import Plan, PlannerConfig
from .cost import TokenBytes
from .pieces import DocumentPieces
from .rank_time import plan_loads, rank_seconds
from .transfers import KVTransfers, RangeSends, kv_transfers

__all__ = ["RelaySends", "relay_kv_sends", "relay_rank_bytes", "relay_plan_loads", "relay_rank_seconds",
           "relay_step_seconds", "relay_where_it_helps"]


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


def _check_fanout(name: str, value) -> float:
    if value == math.inf:
        return math.inf
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1 or math.inf (direct sends), got {value!r}")
    return int(value)


def _tree_depths(count: int, holder_fanout: float, fanout: float) -> tuple[list[int], list[int]]:
    """``(parent, depth)`` of ``count`` servers in tree order: ``parent[j]`` is ``-1`` (the holder)
    or the position of the server that forwards to ``j``; ``depth[j]`` >= 1 its round."""
    parent, depth = [], []
    for j in range(count):
        p = -1 if j < holder_fanout else int((j - holder_fanout) // fanout)
        parent.append(p)
        depth.append(1 if p < 0 else depth[p] + 1)
    return parent, depth


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
    fanout = _check_fanout("fanout", fanout)
    holder_fanout = fanout if holder_fanout is None else _check_fanout("holder_fanout", holder_fanout)
    rows = []
    for group in _holder_groups(transfers):
        rows.extend(_relay_group(*group, holder_fanout, fanout))
    return _as_sends(rows)


def _holder_groups(transfers: KVTransfers) -> list[tuple[int, int, list, list, list]]:
    """``(holder, doc, servers, starts, ends)`` of every (holder, document) of ``transfers`` (lists,
    one entry per direct send)."""
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


def _as_sends(rows) -> RelaySends:
    """``(sender, receiver, doc, start, end, round)`` rows as ``RelaySends``, contiguous ranges of one
    (sender, receiver, document, round) merged into one send."""
    merged: list[list[int]] = []
    for sender, receiver, d, s, e, r in sorted(rows):
        last = merged[-1] if merged else None
        if last is not None and (last[0], last[1], last[2], last[5]) == (sender, receiver, d, r) and last[4] == s:
            last[4] = e
        else:
            merged.append([sender, receiver, d, s, e, r])
    sender, receiver, d, s, e, r = np.array(merged, dtype=np.int64).reshape(-1, 6).T
    order = np.lexsort((s, receiver, r, d, sender))
    return RelaySends(sender[order], receiver[order], d[order], s[order], e[order], r[order])


def _relay_group(holder: int, doc: int, servers: list, starts: list, ends: list, holder_fanout: float,
                 fanout: float, priority=None) -> list[tuple[int, int, int, int, int, int]]:
    """The relayed sends of one holder's K/V of one document to the servers that need it (lists, one
    entry per direct send): one tree per elementary range between consecutive start/end points, its
    members in one order (``priority[server]`` lowest first when given, then furthest need first,
    then by rank)."""
    reach: dict[int, int] = {}
    for server, end in zip(servers, ends):
        reach[server] = max(reach.get(server, 0), end)
    first = (lambda s: priority[s]) if priority is not None else (lambda s: 0)
    tree_order = sorted(reach, key=lambda s: (first(s), -reach[s], s))
    points = sorted(set(starts) | set(ends))
    out = []
    for a, b in zip(points[:-1], points[1:]):
        covered = {s for s, lo, hi in zip(servers, starts, ends) if lo <= a and b <= hi}
        if not covered:
            continue
        members = [s for s in tree_order if s in covered]
        parent, depth = _tree_depths(len(members), holder_fanout, fanout)
        for j, receiver in enumerate(members):
            out.append((holder if parent[j] < 0 else members[parent[j]], receiver, doc, a, b, depth[j]))
    return out


def relay_plan_loads(plan: Plan, pieces: DocumentPieces, token_bytes: TokenBytes, *, fanout=2, holder_fanout=None,
                     transfers: KVTransfers | None = None, sends: RelaySends | None = None) -> tuple[RankLoads, int]:
    """``(loads, rounds)``: ``rank_time.plan_loads`` of ``plan`` with its K/V relayed (``sends``, by
    default ``relay_kv_sends`` at ``fanout`` / ``holder_fanout``) instead of sent directly, and the
    K/V exchange rounds of a layer's forward."""
    if sends is None:
        transfers = transfers if transfers is not None else kv_transfers(plan, pieces)
        sends = relay_kv_sends(transfers, fanout=fanout, holder_fanout=holder_fanout)
    # (plan_loads counts K/V per sender and receiver of any RangeSends; queries and outputs as direct)
    return plan_loads(plan, pieces, token_bytes, sends), sends.rounds


def relay_rank_bytes(plan: Plan, pieces: DocumentPieces, token_bytes: TokenBytes, *, fanout=2, holder_fanout=None,
                     transfers: KVTransfers | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(sent, received)``, each ``[num_ranks]`` int64 bytes of one layer's forward, as
    ``transfers.rank_bytes`` but with every K/V range relayed along a tree (module docstring): Q out
    and O back point-to-point, K/V from the holder to at most ``holder_fanout`` servers (default
    ``fanout``), each forwarding to at most ``fanout`` more. Both sum to ``comm_bytes(...).total`` as
    direct's do; a holder sends at most as many K/V bytes as direct, a forwarding server more. The
    backward moves the same bytes per rank (gradients up the tree, summed at each hop)."""
    loads, _ = relay_plan_loads(plan, pieces, token_bytes, fanout=fanout, holder_fanout=holder_fanout,
                                transfers=transfers)
    return loads.sent, loads.received


def relay_rank_seconds(plan: Plan, pieces: DocumentPieces, config: PlannerConfig, *, fanout=2, holder_fanout=None,
                       transfers: KVTransfers | None = None, sends: RelaySends | None = None) -> tuple[np.ndarray, int]:
    """``([num_ranks] seconds, rounds)``: ``rank_time.rank_seconds`` of the same ``plan`` with relayed
    K/V bytes (``relay_plan_loads``: ``sends``, or trees at ``fanout`` / ``holder_fanout``), plus
    ``config.time_model.collective_s`` per exchange round beyond the first on every rank (each round
    is one more all-to-all the whole group enters)."""
    if sends is None:
        transfers = transfers if transfers is not None else kv_transfers(plan, pieces)
        sends = relay_kv_sends(transfers, fanout=fanout, holder_fanout=holder_fanout)
    extra = max(sends.rounds - 1, 0) * config.time_model.collective_s
    return rank_seconds(plan, pieces, config, sends) + extra, sends.rounds


def relay_step_seconds(plan: Plan, pieces: DocumentPieces, config: PlannerConfig, *, fanout=2, holder_fanout=None,
                       transfers: KVTransfers | None = None, sends: RelaySends | None = None) -> tuple[float, int]:
    """``(seconds, rounds)``: the slowest rank's predicted layer under ``relay_rank_seconds``."""
    seconds, rounds = relay_rank_seconds(plan, pieces, config, fanout=fanout, holder_fanout=holder_fanout,
                                         transfers=transfers, sends=sends)
    return float(seconds.max(initial=0.0)), rounds


def relay_where_it_helps(plan: Plan, pieces: DocumentPieces, config: PlannerConfig, *, fanouts=(1, 2, 4),
                         transfers: KVTransfers | None = None, passes: int = 2) -> RelaySends:
    """Relays placed by time on ``plan`` as it is: each (holder, document)'s K/V goes direct or along
    a tree of one of ``fanouts``, whose members are ordered by their predicted seconds (the least
    loaded nearest the root, so they forward the most). Greedy, holders in order of their predicted
    seconds (slowest first), ``passes`` times: a group's tree replaces its current sends where the
    holder gets faster and no rank gets slower than the slowest before (``rank_seconds`` plus
    ``collective_s`` per extra round, counted on every rank when a tree deepens the layer). A plan
    whose slowest rank is not a holder of a K/V range several servers need keeps its direct sends.

    Returns ``RelaySends`` delivering what ``transfers`` do (``relay_rank_seconds(..., sends=)``
    times it; never slower than direct under the model)."""
    transfers = transfers if transfers is not None else kv_transfers(plan, pieces)
    fanouts = [_check_fanout("fanouts", f) for f in fanouts]
    now = rank_seconds(plan, pieces, config, transfers).astype(np.float64)
    byte_s = config.time_model.byte_seconds(config.exposed_comm, plan.backward)
    kv, n = config.token_bytes.kv, plan.num_ranks
    groups = _holder_groups(transfers)
    chosen = [_relay_group(*g, math.inf, math.inf) for g in groups]
    rounds = 1 if groups else 0

    def seconds_of(rows) -> np.ndarray:
        moved = np.zeros(n)
        for sender, receiver, _, a, b, _ in rows:
            moved[sender] += (b - a) * kv
            moved[receiver] += (b - a) * kv
        return moved * byte_s

    for _ in range(passes):
        for i in sorted(range(len(groups)), key=lambda g: -now[groups[g][0]]):
            holder, current = groups[i][0], seconds_of(chosen[i])
            best = None
            for fanout in [math.inf, *fanouts]:
                rows = _relay_group(*groups[i], fanout, fanout, priority=now)
                depth = max(r[5] for r in rows)
                new = now - current + seconds_of(rows) + max(depth - rounds, 0) * config.time_model.collective_s
                if new.max() <= now.max() * (1 + 1e-12) and new[holder] < now[holder] * (1 - 1e-9):
                    if best is None or (new.max(), new[holder]) < (best[0].max(), best[0][holder]):
                        best = (new, rows, depth)
            if best is not None:
                now, chosen[i], rounds = best[0], best[1], max(rounds, best[2])
    return _as_sends([row for rows in chosen for row in rows])
