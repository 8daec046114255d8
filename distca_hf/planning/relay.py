"""K/V relays placed by time, and their bytes and time (pure numpy). The trees themselves, and the
sends a plan's ``RelayTrees`` make, are in ``relay_trees``.

Without relays, every holder of a long document's K/V sends it directly to each server of a later
shard, so its links can bound the layer (issues 20 and 21). With relays (``relay_trees``), servers
that received a prefix forward it along a tree, and the holder sends each range O(1) times.

What the relay costs (all counted in the time model, nothing hidden):

- latency: a send at depth ``d`` of its tree goes out in exchange round ``d``; a layer then needs
  ``rounds`` = the deepest tree's depth K/V exchanges in its forward instead of one, and as many
  for the K/V gradients in its backward. Each extra round is one more all-to-all, which every rank of
  the group enters (``rank_time.rank_seconds`` adds ``TimeModel.collective_s`` per extra round to
  every rank: the time model's fixed cost of a layer's dispatch, so a generous price for one more
  round).
- bytes on servers: a server that forwards sends what it forwards, on top of what it receives; the
  total bytes crossing ranks are the same as direct (one send per server and range), they only move
  from the holders' links to the servers'.
- backward: in ``saved`` mode the K/V gradients flow back up the same tree, each server summing its
  children's with its own before sending one range to its parent (so the backward moves exactly the
  forward's K/V bytes, reversed, per rank: ``COMM_PASSES["saved"]`` holds); in ``resend`` mode the
  backward also relays K/V down the tree again before the gradients go up (``COMM_PASSES["resend"]``
  holds too). Queries and outputs stay point-to-point, as in ``transfers.query_sends``.

Where they go: ``relay_trees_where_they_help`` places trees on a finished plan by time (the
``kv_relays="auto"`` setting: ``planner.plan_tasks`` attaches them to ``"auto"``'s plan), never
predicted slower. ``relay_rank_seconds`` and friends time a plan with any relayed sends, and
``examples/relay_whatif.py`` measures fixed fanouts and plans made as if bytes were cheaper.

What it gives (``examples/relay_whatif.py``, H100 model): relays at a fixed fanout make today's plans
slower (the descent already balances every rank's compute against its links, so a forwarding
server becomes the slowest rank); relays placed by time gain 0-2%; plans that fan long documents out
further, re-timed with relays placed by time, gain up to 27% (prolong 64 x 128k). Rows bound by
compute (wlbllm 512 x 512k: the slowest rank is 99% compute) gain nothing.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .baselines import RankLoads
from .carving import Plan, PlannerConfig
from .cost import TokenBytes
from .pieces import DocumentPieces
from .rank_time import plan_loads, rank_seconds, relay_wait_seconds
from .relay_trees import (RelaySends, RelayTrees, check_fanout, group_layout, holder_groups, layout_rows,
                          relay_kv_sends, tree_order)
from .transfers import KVTransfers, kv_transfers

__all__ = ["RelaySends", "relay_kv_sends", "relay_rank_bytes", "relay_plan_loads", "relay_rank_seconds",
           "relay_step_seconds", "relay_where_it_helps", "relay_trees_where_they_help", "apply_relays",
           "timed_relays"]


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
    # (rank_seconds counts collective_s per round beyond the first: rank_time.rank_seconds)
    return rank_seconds(plan, pieces, config, sends), sends.rounds


def relay_step_seconds(plan: Plan, pieces: DocumentPieces, config: PlannerConfig, *, fanout=2, holder_fanout=None,
                       transfers: KVTransfers | None = None, sends: RelaySends | None = None) -> tuple[float, int]:
    """``(seconds, rounds)``: the slowest rank's predicted layer under ``relay_rank_seconds``."""
    seconds, rounds = relay_rank_seconds(plan, pieces, config, fanout=fanout, holder_fanout=holder_fanout,
                                         transfers=transfers, sends=sends)
    return float(seconds.max(initial=0.0)), rounds


HOLDER_NEAR_SLOWEST = 0.95
"""``relay_trees_where_they_help`` weighs trees only for holders predicted within this fraction of the
slowest rank: relaying a holder's K/V takes bytes off its link and puts them on its servers', which
makes the step faster only where that holder is (nearly) what the step waits for (plan time)."""


def relay_trees_where_they_help(plan: Plan, pieces: DocumentPieces, config: PlannerConfig, *, fanouts=(2, 4, 8),
                                transfers: KVTransfers | None = None, passes: int = 2) -> RelayTrees:
    """Relays placed by time on ``plan`` as it is (``Plan.relays``; ``relay_trees``): each (holder,
    document)'s K/V goes direct or along a tree of one of ``fanouts``, whose members are ordered by
    their predicted seconds (the least loaded nearest the root, so they forward the most). Greedy,
    holders in order of their predicted seconds (slowest first), ``passes`` times: a group's tree
    replaces its current sends where the holder gets faster and no rank gets slower than the slowest
    before, under ``rank_time.rank_seconds``' model of relays (every rank's own bytes, the wait for
    relayed K/V along the trees' rounds, ``collective_s`` per extra round on every rank). A plan whose
    slowest rank is not a holder of a K/V range several servers need keeps its direct sends (no group
    listed).

    What it can guarantee: the relayed plan is never predicted slower than direct, under the time
    model (each accepted tree keeps every rank at or below the slowest before). What it cannot: it
    places trees on the plan as it is (``planner.RELAY_BYTE_DISCOUNTS`` plans wider ones), and a
    greedy over groups may miss a better set of trees."""
    return _placed_trees(plan, pieces, config, fanouts=fanouts, transfers=transfers, passes=passes)[0]


def _relayable(transfers: KVTransfers) -> list:
    """``holder_groups(transfers)`` whose K/V two or more servers need (one server: nothing to relay)."""
    return [g for g in holder_groups(transfers) if len(set(g[2])) > 1]


def _placed_trees(plan: Plan, pieces: DocumentPieces, config: PlannerConfig, *, fanouts=(2, 4, 8),
                  transfers: KVTransfers | None = None, passes: int = 2, groups=None):
    """``(trees, direct, relayed)``: ``relay_trees_where_they_help``'s trees and every rank's predicted
    seconds (``[num_ranks]``) with direct sends and with the trees. ``groups``: ``_relayable(transfers)``,
    when in hand."""
    transfers = transfers if transfers is not None else kv_transfers(plan, pieces)
    fanouts = [check_fanout("fanouts", f) for f in fanouts]
    n, kv, tm = plan.num_ranks, config.token_bytes.kv, config.time_model
    byte_s = tm.byte_seconds(config.exposed_comm, plan.backward)
    groups = _relayable(transfers) if groups is None else groups
    trees = [None] * len(groups)  # (fanout, members in tree order) of each relayed group

    def link_seconds(rows: np.ndarray, first_only=False) -> np.ndarray:
        """``[ranks]`` seconds of the K/V ``rows`` (``[sender, receiver, doc, start, end, round]``) on
        their senders' and receivers' links (``first_only``: round 1's)."""
        if first_only:
            rows = rows[rows[:, 5] == 1]
        moved = ((rows[:, 4] - rows[:, 3]) * kv).astype(np.float64)
        return (np.bincount(rows[:, 0], moved, n) + np.bincount(rows[:, 1], moved, n)) * byte_s

    every_send = np.stack([transfers.source, transfers.server, transfers.doc, transfers.start, transfers.end,
                           np.ones_like(transfers.source)], axis=1)
    link_sum = link_seconds(every_send)
    first_sum = link_sum.copy()  # direct: every send in round 1
    direct = rank_seconds(plan, pieces, config, transfers).astype(np.float64)
    base = direct - link_sum
    link, first = {}, {}  # [ranks] K/V link seconds of each group weighed so far, all rounds and round 1's

    def refused(times: np.ndarray, holder: int) -> bool:
        """The greedy's rule: a tree is taken only where no rank ends slower than the slowest rank now
        and its holder gets faster."""
        return times.max() > slowest * (1 + 1e-12) or times[holder] >= now[holder] * (1 - 1e-9)

    def seconds(link_total, first_total, others, mine, holder) -> np.ndarray | None:
        """Every rank's predicted seconds with these K/V link seconds and the later rounds' rows
        (``[sender, receiver, doc, start, end, round]`` arrays: ``others``, the other relayed groups'
        concatenated or None, and ``mine``, the group weighed); None when ``refused`` whatever the wait
        for relayed K/V (the same sums without the wait: a lower bound, as rounding is monotone)."""
        rows = mine if others is None else others if not mine.size else np.concatenate((others, mine))
        if not rows.size:
            return base + link_total
        rounds = int(rows[:, 5].max())
        sure = base + link_total
        if refused(sure + (rounds - 1) * tm.collective_s, holder):
            return None
        sends = RelaySends(rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3], rows[:, 4], rows[:, 5])
        wait = relay_wait_seconds(sends, kv, byte_s, n, first_round=first_total)
        return sure + wait + (rounds - 1) * tm.collective_s

    later = {}  # relayed groups' rows of rounds 2 and later
    now = direct.copy()
    slowest = now.max()
    holders = np.fromiter((g[0] for g in groups), np.int64, len(groups))
    for _ in range(passes):
        accepted = False
        for i in np.argsort(-now[holders], kind="stable").tolist():  # holders slowest first, ties in group order
            holder, doc, servers, starts, ends = groups[i]
            # a holder well below the slowest rank: relaying it cannot make the step faster (its
            # servers only get more bytes)
            if now[holder] < HOLDER_NEAR_SLOWEST * slowest:
                continue
            if i not in link:  # its direct sends, as transfers holds them (all in round 1)
                link[i] = first[i] = link_seconds(np.asarray(
                    [(holder, s, doc, a, b, 1) for s, a, b in zip(servers, starts, ends)], dtype=np.int64))
            others = [rows for j, rows in later.items() if j != i]
            others = np.concatenate(others) if others else None
            best, order = None, tree_order(servers, ends, priority=now)
            layout = group_layout(servers, starts, ends, order=order)
            # direct is a candidate only for a group relayed in an earlier pass (else it is what it has)
            for fanout in ([math.inf] if trees[i] is not None else []) + fanouts:
                rows = layout_rows(layout, holder, doc, fanout, fanout)
                new_link, new_first, new_later = link_seconds(rows), link_seconds(rows, True), rows[rows[:, 5] > 1]
                new = seconds(link_sum - link[i] + new_link, first_sum - first[i] + new_first, others, new_later,
                              holder)
                if new is not None and not refused(new, holder):
                    if best is None or (new.max(), new[holder]) < (best[0].max(), best[0][holder]):
                        best = (new, new_link, new_first, new_later, None if fanout == math.inf else (fanout, order))
            if best is not None:
                now, new_link, new_first, new_later, trees[i] = best
                slowest, accepted = now.max(), True
                if new_later.size:
                    later[i] = new_later
                else:
                    later.pop(i, None)
                link_sum, first_sum = link_sum - link[i] + new_link, first_sum - first[i] + new_first
                link[i], first[i] = new_link, new_first
        if not accepted:  # the next pass would weigh the same groups in the same state
            break
    return RelayTrees.of((g[0], g[1], *tree) for g, tree in zip(groups, trees) if tree is not None), direct, now


def apply_relays(plan: Plan, pieces: DocumentPieces, config: PlannerConfig) -> Plan:
    """``plan`` with the relay trees ``config.kv_relays`` asks for (``Plan.relays``): ``"off"`` none;
    a fanout: every (holder, document) group whose K/V two or more servers need, along trees of it;
    ``"auto"``: ``relay_trees_where_they_help``, kept only when the step it predicts is faster than
    direct's (a tree that only speeds up a rank that is not the slowest would add rounds for nothing)."""
    return timed_relays(plan, pieces, config)[0]


def timed_relays(plan: Plan, pieces: DocumentPieces, config: PlannerConfig, *,
                 transfers: KVTransfers | None = None) -> tuple[Plan, float | None]:
    """``(apply_relays(plan, ...), its predicted step seconds)``; the seconds are ``None`` where no
    relay was weighed (``kv_relays`` off, or no K/V range two servers need of one holder) or a fanout
    was forced: then ``rank_time.step_seconds`` of the plan, not computed here. ``transfers``: the
    plan's ``kv_transfers``, when in hand."""
    if config.kv_relays == "off" or plan.relays is not None:
        return plan, None
    transfers = transfers if transfers is not None else kv_transfers(plan, pieces)
    groups = _relayable(transfers)
    if not groups:
        return plan, None
    if config.kv_relays == "auto":
        trees, direct, relayed = _placed_trees(plan, pieces, config, transfers=transfers, groups=groups)
        if not trees.num_groups or relayed.max() >= direct.max():
            return plan, float(direct.max(initial=0.0))
        return dataclasses.replace(plan, relays=trees), float(relayed.max(initial=0.0))
    fanout = check_fanout("kv_relays", config.kv_relays)
    trees = RelayTrees.of((g[0], g[1], fanout, tree_order(g[2], g[4])) for g in groups)
    return dataclasses.replace(plan, relays=trees), None


def relay_where_it_helps(plan: Plan, pieces: DocumentPieces, config: PlannerConfig, *, fanouts=(2, 4, 8),
                         transfers: KVTransfers | None = None, passes: int = 2) -> RelaySends:
    """The sends of ``relay_trees_where_they_help``: ``RelaySends`` delivering what ``transfers`` do
    (``relay_rank_seconds(..., sends=)`` times it; never slower than direct under the model)."""
    transfers = transfers if transfers is not None else kv_transfers(plan, pieces)
    trees = relay_trees_where_they_help(plan, pieces, config, fanouts=fanouts, transfers=transfers, passes=passes)
    return trees.sends(transfers)
