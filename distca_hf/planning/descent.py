"""Planning by time, directly (``tolerance="auto"``'s main candidate): a greedy descent on the predicted
layer time, both ends of every link counted. Pure numpy and Python; no torch.distributed.

The predicted time of rank ``r`` is the time model's (``rank_time.loads_seconds``): its other work
(``rank_time.other_seconds``: the linear layers, or ``PlannerConfig.base_pairs``), the CA-tasks it
serves (pairs, keys, one task each), and the exposed share of the bytes it **sends** and **receives**
(queries out, outputs back, K/V from every rank holding part of a task's prefix), plus
``collective_s``. A K/V prefix held on ``k`` ranks costs each of them one send per server its
document's shards go to, so spreading a long document over more servers can make its holders, not
its servers, the slowest ranks.

How it works. Start colocated. Keep a level ``L``, first a lower bound on any plan (the mean
compute of the servers, or the busiest rank's linear layers). Repeatedly take the slowest rank ``d``
(a donor) and move tail shards ``[a, hi)`` of its own latest query interval (most pairs per query
moved) to a server, each move sized so that after it

- the server is predicted at most ``L``;
- every other rank that sends K/V for the shard stays within ``L`` once its own movable attention
  is taken away (a holder that is itself a donor will shed that later; its sends it cannot shed);
- the donor is predicted faster than before.

The server is the one that takes the largest shard under these rules (the donor's time drops most),
ties to the fewest bytes, then the lowest rank. Candidates, in this order: the ``LEAST_LOADED``
fastest of the ranks that already hold part of the document's K/V or already serve it (they receive
only what they lack: "prefer servers that already hold a prefix"), then the server predicted
fastest that is new to the document; the first that takes all the donor wants (down to ``L``, or its whole
interval) ends the search. A shard that continues one
already on that server (the next tail of the same interval) merges with it, so it costs no new task
and no new keys. When the slowest rank cannot move anything at level ``L``, ``L`` rises part way
(``RAISE``) towards it; the descent stops when the slowest rank is within ``CONVERGED`` of ``L``,
cannot move anything, or holds no own work to move; when every rank is within ``L``, ``L`` is
lowered half way to the lower bound and the descent goes on (rising again from there when stuck).
Every rank but the donors ends within ``L``.

Fan-out. A document's servers (the ranks computing some of its queries) never exceed its
``fan_out_bounds``: for each of its K/V holders, sending ``c`` seconds per server, the smaller of
the number of servers at which those sends alone would be predicted slower than the whole colocated
step, and ``FAN_OUT x sqrt(W / c)`` with ``W`` the document's attention seconds (spread over ``F``
servers, a server's share ``W / F`` plus the holder's ``F c`` is least at ``sqrt(W / c)``); never
fewer than the ranks computing it colocated. Beyond the bound a document's shards go only to
servers it already has. (The level rule above also stops a document from gaining servers while a
holder's sends are the bottleneck.)

Memory (``descend_within_memory``, ``saved`` mode under ``memory_budget``). Every rank's memory for
backward (``transfers.backward_memory``) is kept move by move: a server's grows by the queries it
keeps (q, out, log-sum-exp) and the K/V it lacks, a donor's shrinks by its queries. A move that would
take its server past ``(1 + budget)`` x the mean is cut to the queries that fit, or goes to another
candidate server; ``by_time`` runs it only when the unbounded descent is over the budget. Under the
``kv_cap`` setting every descent also keeps each rank's received K/V tokens: no move takes its server
past the cap (``baselines.kv_cap_tokens``), and a new server for a document must have room for its keys.

What the greedy guarantees, and what it does not. It guarantees every query computed exactly once,
block-aligned cuts, deterministic plans, at most the fan-out bound per document, ranks outside the
server pool emptied, and a bounded number of steps (``MAX_MOVES_PER_RANK``). It does not guarantee
the optimum, nor even a plan faster than colocated: it never undoes a move, never moves work a
server received (only ranks' own work), and the K/V bytes of a donor that gives away a whole piece
of a spanning document are counted as if it still needed its prefix (an overestimate). ``by_time``
therefore judges its plan exactly (``rank_seconds``) against colocated and the fixed-tolerance
carvings and keeps the fastest.
"""

from __future__ import annotations

import bisect
import heapq
import math

import numpy as np

from .carving import Plan, PlannerConfig, colocated_plan, server_pool
from .cost import causal_pairs, key_start, start_with_pairs
from .pieces import DocumentPieces
from .rank_time import other_seconds, plan_loads
from .ranges import lexsort_ints
from .transfers import BackwardMemory, backward_memory, kv_received, kv_transfers, memory_limit
from .baselines import kv_cap_tokens

__all__ = ["descend", "descend_within_memory", "DescentStart", "fan_out_bounds", "LEAST_LOADED", "RAISE", "CONVERGED",
           "MAX_MOVES_PER_RANK"]

LEAST_LOADED = 3
"""Each move tries this many of the document's holders and servers predicted fastest, and the fastest
server new to the document among this many fastest servers."""

RAISE = (0.5, 0.03)
"""When the slowest rank can move nothing at level ``L``, ``L`` rises by the smaller of
``RAISE[0] * (slowest - L)`` and ``RAISE[1] * L``: gradually, so that every level's moves (and the
servers a document gains) are decided before the level that needs them."""

CONVERGED = 2e-3
"""The descent stops when the slowest rank is within this fraction of the level."""

MAX_MOVES_PER_RANK = 64
"""A cap on the moves (``ranks x`` this, plus 256) and level raises (400): plan time stays bounded."""

FAN_OUT = 2.0
"""A document of ``W`` seconds of attention spread to ``F`` servers costs each of them about ``W / F``
and a holder of its K/V that sends ``c`` seconds per server ``F c``: their sum is least at
``F = sqrt(W / c)``; the fan-out bound allows ``FAN_OUT`` times that."""

_INTERVALS_TRIED = 3  # a donor whose latest interval cannot move tries its next ones


class DescentStart:
    """What every descent of one batch starts from, whatever its backward mode or memory budget:
    ``by_time`` plans up to three descents of the same ``pieces`` and ``config``
    (unbounded, timing ``resend``'s bytes, within the memory budget) and prepares this once. Read only:
    each descent copies what it changes. Pass it as ``start=`` with the same ``pieces`` and ``config``."""

    def __init__(self, pieces: DocumentPieces, config: PlannerConfig):
        n = pieces.num_ranks
        self.pieces, self.config = pieces, config
        self.servers = server_pool(config, n)
        tm, tb, window = config.time_model, config.token_bytes, config.window
        self.colocated = colocated_plan(pieces, self.servers, window=window)
        transfers = kv_transfers(self.colocated, pieces)
        self.loads = plan_loads(self.colocated, pieces, tb, transfers)
        # rank_time's formula: other work (the linear layers, or base_pairs'), the attention each rank
        # computes at home ([ranks] seconds)
        self.linear = other_seconds(self.loads.tokens, config)
        self.own = tm.rank_seconds(0, self.loads.pairs, self.loads.tasks, self.loads.keys, other_s=0.0)
        self._received = kv_received(transfers, n)
        self._memory = None
        self.kv_cap = kv_cap_tokens(pieces, config)  # K/V tokens a server may receive (None: any)
        self.holders = pieces.spanning_holders()
        self.holder_ranks = {doc: tuple(rank for rank, _, _ in holders) for doc, holders in self.holders.items()}
        # (server, doc) -> keys [start, end) it needs; the colocated plan's needs of spanning documents
        self.needs: dict[tuple[int, int], list[int]] = {}
        self.doc_servers: dict[int, set[int]] = {doc: set() for doc in self.holders}
        several = np.isin(pieces.doc, list(self.holders)) & (pieces.end > pieces.start)
        for rank, doc, start, end in zip(pieces.rank[several].tolist(), pieces.doc[several].tolist(),
                                         pieces.start[several].tolist(), pieces.end[several].tolist()):
            first = key_start(start, window)
            need = self.needs.get((rank, doc))
            self.needs[(rank, doc)] = [first, end] if need is None else [min(need[0], first), max(need[1], end)]
            self.doc_servers[doc].add(rank)
        # each rank's own query intervals (pieces), latest end first (tails move first)
        longest = int(pieces.end.max(initial=0))
        order = lexsort_ints((pieces.doc, longest - pieces.end, pieces.rank))
        by_rank = order[pieces.end[order] > pieces.start[order]]
        self.rank_start = np.searchsorted(pieces.rank[by_rank], np.arange(n + 1)).tolist()
        # ... as (doc, piece start, end, piece) tuples, made once for all the batch's descents
        self.intervals = list(zip(pieces.doc[by_rank].tolist(), pieces.start[by_rank].tolist(),
                                  pieces.end[by_rank].tolist(), by_rank.tolist()))

    def colocated_memory(self) -> BackwardMemory:
        """``transfers.backward_memory`` of the colocated plan in ``saved`` mode (computed once)."""
        if self._memory is None:
            self._memory = backward_memory(self.colocated, self.pieces, self.config.token_bytes, backward="saved",
                                           received=self._received)
        return self._memory


class _Descent:
    def __init__(self, pieces: DocumentPieces, config: PlannerConfig, backward: str, budget: float | None = None,
                 held_mean: float = 0.0, give_up_above: float = math.inf, start: DescentStart | None = None):
        if start is None:
            start = DescentStart(pieces, config)
        elif start.pieces is not pieces or start.config is not config:
            raise ValueError("start: a DescentStart prepared for other pieces or another config "
                             "(DescentStart(pieces, config) with the same objects)")
        n = pieces.num_ranks
        self.pieces, self.n, self.window, self.block = pieces, n, config.window, config.block
        self.servers = start.servers
        self.is_server = np.isin(np.arange(n), self.servers).tolist()  # (Python bools: read in hot loops)
        self.every_rank_serves = all(self.is_server)
        tm, tb = config.time_model, config.token_bytes
        self.attn, self.key_s, self.task_s = tm.attn_s_per_pair, tm.task_key_s, tm.task_s
        self.q, self.o, self.kv = tb.q, tb.o, tb.kv
        self.byte_s = tm.byte_seconds(config.exposed_comm, backward)
        self.qo = self.q + self.o  # bytes of a moved query: in, and its output back
        self.qo_s = self.byte_s * self.qo
        loads, linear, own = start.loads, start.linear, start.own
        # rank_time's formula: other work, the attention each rank computes at home, the exposed bytes
        # of the pieces' prefixes and collective_s, summed in the descent's own order (its moves add
        # byte_s-timed bytes: the same sums, the same roundings)
        moved = self.byte_s * (loads.sent + loads.received)
        # seconds each rank saves by moving all of its own attention still computed at home away:
        # that attention, less the exposed time of its queries out and outputs back
        self.own = np.maximum(own - self.byte_s * (self.q + self.o) * loads.tokens, 0.0).tolist()
        self.time = (linear + own + moved + tm.collective_s).tolist()
        self.colocated_step = max(self.time, default=0.0)
        self.floor0 = (linear + moved + tm.collective_s).tolist()
        servers = list(self.servers)
        self.lower_bound = max(float((linear + tm.collective_s).max(initial=0.0)),
                               float(linear[servers].sum() + own.sum()) / len(servers) + tm.collective_s)
        self.holders, self.holder_ranks = start.holders, start.holder_ranks
        # (server, doc) -> keys [start, end) it needs (lists replaced, never changed in place)
        self.needs: dict[tuple[int, int], list[int]] = dict(start.needs)
        self.doc_servers: dict[int, set[int]] = {doc: set(ranks) for doc, ranks in start.doc_servers.items()}
        # each rank's own query intervals (doc, piece start, end, piece), latest end first (tails move
        # first), copied from the start's only for the ranks the descent looks at
        self.all_intervals, self.rank_start = start.intervals, start.rank_start
        self.listed: dict[int, list[tuple[int, int, int, int]]] = {}
        self.cut: dict[int, int] = {}  # piece -> the end of what stays at home (its start: nothing)
        self.rows: list[list[int]] = []  # moved tasks [source, server, doc, q_start, q_end]
        self.merge_at: dict[tuple[int, int, int, int], int] = {}  # (server, source, doc, start) -> row
        self.bounds: dict[int, float] = {}
        # Memory (saved mode under a budget): what every rank holds for backward in one layer
        # (``transfers.backward_memory``), kept move by move; a move may not take a server past the
        # budget's limit (``memory_cut``). None: unbounded (resend mode keeps nothing on servers).
        self.held = None
        self.memory_refused = False  # whether the limit cut or refused a move the time alone allowed
        self.give_up_above, self.gave_up = give_up_above, False
        if backward == "saved" and budget is not None:
            memory = start.colocated_memory()
            self.held = memory.held.astype(np.float64).tolist()
            self.held_total, self.memory_budget, self.memory_floor = sum(self.held), budget, memory.floor
            self.held_mean = held_mean
            self.query_bytes = tb.q + tb.o + tb.lse  # what a server keeps per query it serves (a source, less)
        # The kv_cap setting: K/V tokens every rank receives, kept move by move (an upper bound: needs
        # only grow); a move may not take its server past the cap (best_shard). None: no cap.
        # (K/V of no bytes: tokens cannot be told from bytes; by_time's judge keeps the cap alone then)
        self.kv_cap = start.kv_cap
        self.received = start._received.tolist() if self.kv_cap is not None and self.kv > 0 else None

    def intervals(self, rank: int) -> list[tuple[int, int, int, int]]:
        """The rank's own intervals still at home, ``(doc, piece start, end, piece)``, latest end first."""
        listed = self.listed.get(rank)
        if listed is None:
            listed = self.listed[rank] = self.all_intervals[self.rank_start[rank]:self.rank_start[rank + 1]]
        return listed

    def has_work(self, rank: int) -> bool:
        listed = self.listed.get(rank)
        return bool(listed) if listed is not None else self.rank_start[rank + 1] > self.rank_start[rank]

    # -- the documents' senders and fan-out -----------------------------------------------------

    def senders(self, doc: int, donor: int, end: int):
        """``[(rank, kv_start, kv_end)]`` holding the document's K/V: its pieces, or the donor's one
        piece (which holds all of it, ``[0, end)`` at least)."""
        return self.holders.get(doc) or ((donor, 0, end),)

    def fan_out_bound(self, doc: int, donor: int, end: int) -> float:
        """The most servers ``doc`` may spread to (module docstring, ``fan_out_bounds``)."""
        bound = self.bounds.get(doc)
        if bound is None:
            senders = self.senders(doc, donor, end)
            work = self.attn * sum(causal_pairs(kv_start, kv_end, self.window) for _, kv_start, kv_end in senders)
            bound = math.inf
            for rank, kv_start, kv_end in senders:
                send = self.byte_s * self.kv * (kv_end - kv_start)  # one more server costs this sender this
                if send > 0:
                    budget = self.colocated_step - self.floor0[rank]
                    bound = min(bound, max(math.floor(budget / send), 1), math.ceil(FAN_OUT * math.sqrt(work / send)))
            bound = max(bound, len(self.doc_servers.get(doc, ())), 1)
            self.bounds[doc] = bound
        return bound

    # -- one move ---------------------------------------------------------------------------------

    def kv_sends(self, donor: int, server: int, doc: int, first: int, b: int):
        """``([(sender, seconds)], bytes)`` of the K/V ``server`` lacks to run keys ``[first, b)`` of
        ``doc`` (what its need grows by)."""
        byte_s, kv, sends, total = self.byte_s, self.kv, [], 0
        old = self.needs.get((server, doc))
        if old is None:
            lo, hi = first, b
        else:
            lo, hi = (old[0] if old[0] < first else first), (old[1] if old[1] > b else b)
        if old is None or lo != old[0] or hi != old[1]:
            for rank, kv_start, kv_end in self.senders(doc, donor, b):
                if rank == server:
                    continue
                more = (hi if hi < kv_end else kv_end) - (lo if lo > kv_start else kv_start)
                if old is not None:
                    had = (old[1] if old[1] < kv_end else kv_end) - (old[0] if old[0] > kv_start else kv_start)
                    more = (more if more > 0 else 0) - (had if had > 0 else 0)
                if more > 0:
                    sends.append((rank, byte_s * more * kv))
                    total += 2 * more * kv
        return sends, total

    def best_shard(self, donor: int, server: int, doc: int, piece_start: int, end: int, level: float,
                   want_pairs: float, must_empty: bool):
        """The largest tail ``[a, end)`` (cut a multiple of ``block`` from ``piece_start``) that
        ``server`` may take at ``level``: ``(a, changes, bytes, merged)`` or None. ``changes`` maps a
        rank to the seconds the move adds to it, ``bytes`` is what the move puts on the wire and
        ``merged`` the row of the server's task it continues (None: a new task).

        A move is acceptable when ``server`` stays within ``level``, the donor gets faster (unless
        ``must_empty``) and every other rank that sends K/V for it stays within ``level`` once its own
        movable attention is taken away: what its time can come down to by moving its own attention
        away (``self.own``: that attention less the exposed time of its queries out and outputs back),
        as the level rule sees it, all of it if the rank is above the level (a donor), none otherwise.
        (One function on purpose: the descent's hot path, called a few times per move.)"""
        time, sqrt = self.time, math.sqrt
        room = level - time[server]
        if room <= 0:
            return None
        window, block, attn, key_s, task_s, byte_s = self.window, self.block, self.attn, self.key_s, self.task_s, \
            self.byte_s
        whole = (end * (end + 1) - piece_start * (piece_start + 1)) // 2 if window is None else \
            causal_pairs(piece_start, end, window)
        pairs = whole if whole < want_pairs else want_pairs  # min(want_pairs, whole)
        merged = self.merge_at.get((server, donor, doc, end))  # the server's task this shard would continue
        sends = None
        if attn > 0:
            # the first guess counts what the shard costs the server besides its pairs: the K/V it
            # lacks (as for a one-query tail), a task and its keys unless it merges, queries and
            # outputs at about one query per `end` (or `window`) pairs
            first = key_start(end - 1, window) if window is not None else 0
            sends = self.kv_sends(donor, server, doc, first, end)
            kv_cost = 0
            for _, cost in sends[0]:
                kv_cost += cost
            fixed = kv_cost + (0.0 if merged is not None else task_s + key_s * (end - first))
            span = end if not window or end <= window else window  # min(end, window or end): keys of the last query
            per_pair = attn + self.qo_s / (span if span > 1 else 1)
            fits = room - fixed
            fits = (fits if fits > 0.0 else 0.0) / per_pair
            if fits < pairs:
                pairs = fits
        if window is not None:
            piece_first, last_first = key_start(piece_start, window), key_start(end, window)
        elif sends is None:
            sends = self.kv_sends(donor, server, doc, 0, end)
        top = level * (1 + 1e-12)
        for _ in range(4):
            if pairs >= whole:
                a = piece_start
            else:
                if window is None:  # start_with_pairs(end, pairs), inlined
                    real = 1.0 + 4.0 * (end * (end + 1) - 2.0 * pairs)
                    real = (-1.0 + sqrt(real if real > 0.0 else 0.0)) / 2.0
                else:
                    real = start_with_pairs(end, pairs, window)
                a = piece_start + math.ceil((real - piece_start) / block) * block
                if a >= end:  # less than a block fits: one block (the last one may be shorter)
                    a = max(piece_start, piece_start + ((end - piece_start - 1) // block) * block)
            if self.held is not None and not must_empty:  # (a rank outside the pool must empty, come what may)
                a = self.memory_cut(donor, server, doc, piece_start, a, end, sends[1] if window is None else None)
                if a is None:
                    return None
            # what the move adds to the donor and the server, before K/V
            m = end - a
            if window is None:  # causal_pairs and key_start, inlined: the descent's hottest lines
                got, first = (end * (end + 1) - a * (a + 1)) // 2, 0
                kv_sends, kv_bytes = sends  # the same keys [0, end) whatever the cut
            else:
                got, first = causal_pairs(a, end, window), key_start(a, window)
                kv_sends, kv_bytes = self.kv_sends(donor, server, doc, first, end)
            if self.received is not None and not must_empty \
                    and self.received[server] + kv_bytes // (2 * self.kv) > self.kv_cap:
                return None  # past the kv_cap (a smaller shard needs as many keys, but under a window)
            # the donor: its local task [piece_start, end) becomes [piece_start, a), or goes
            if a > piece_start:
                donor_s = -attn * got - key_s * m
            else:
                donor_s = -attn * got - key_s * (end - (piece_first if window is not None else 0)) - task_s
            moved_bytes = m * self.qo
            donor_s += byte_s * moved_bytes
            if merged is not None:
                server_s = attn * got + key_s * ((last_first if window is not None else 0) - first)
            else:
                server_s = attn * got + key_s * (end - first) + task_s
            server_s += byte_s * moved_bytes
            others = None  # the other senders of K/V: {rank: seconds}
            for rank, cost in kv_sends:
                if rank == donor:
                    donor_s += cost
                else:
                    if others is None:
                        others = {}
                    others[rank] = others.get(rank, 0.0) + cost
                server_s += cost
            # acceptable?
            over = time[server] + server_s - level
            if time[server] + server_s > top:
                ok = False
            elif not must_empty and time[donor] + donor_s >= time[donor] * (1 - 1e-12):
                ok = False
            else:
                ok = True
                if others is not None:
                    own = self.own
                    for rank, add in others.items():
                        new = time[rank] + add
                        if (new - own[rank] if new > level else new) > top:  # its floor (docstring)
                            ok = False
                            break
            if ok:
                changes = {donor: donor_s, server: server_s}
                if others is not None:
                    changes.update(others)
                return a, changes, 2 * moved_bytes + kv_bytes, merged
            if over <= 0 or got <= 0 or a + block >= end:
                return None  # another rank's limit, or already the smallest shard
            # shrink by the share of the server's added time that is over the level
            pairs = got * max(1.0 - over / server_s, 0.0) * 0.98
            if pairs <= 0:
                return None
        return None

    def memory_cut(self, donor: int, server: int, doc: int, piece_start: int, a: int, end: int, lacked):
        """The cut ``a`` of a tail ``[a, end)`` moved up by whole blocks until ``server`` holds at most
        the memory limit after taking it (the queries it keeps, ``query_bytes`` each, and the K/V it
        lacks: half ``lacked``, kv_sends' bytes, when in hand); ``None`` when not one block fits (the K/V alone may not)."""
        kv_bytes = (self.kv_sends(donor, server, doc, key_start(a, self.window), end)[1] if lacked is None else lacked) / 2
        # the limit after the move: (1 + budget) x the mean held, which the received K/V raise (the
        # queries only change hands; at least ``held_mean``, the mean the finished plan is expected
        # to reach: the first moves would otherwise be judged against colocated's), or the floor
        mean = max((self.held_total + kv_bytes) / self.n, self.held_mean)
        limit = memory_limit(self.memory_budget, mean, self.memory_floor)
        room = limit * (1 + 1e-12) - self.held[server] - kv_bytes
        fits = math.floor(room / self.query_bytes) if room >= 0 else -1  # queries the server may keep
        if end - a <= fits:
            return a
        self.memory_refused = True
        if fits < 1:
            return None
        cut = piece_start + math.ceil((end - fits - piece_start) / self.block) * self.block
        return cut if cut < end else None

    def commit(self, donor: int, server: int, doc: int, index: int, a: int, changes, merged) -> None:
        intervals, window = self.intervals(donor), self.window
        _, piece_start, b, piece = intervals[index]
        if window is None:  # causal_pairs and key_start, inlined
            pairs, first = (b * (b + 1) - a * (a + 1)) // 2, 0
        else:
            pairs, first = causal_pairs(a, b, window), key_start(a, window)
        if self.held is not None or self.received is not None:  # before the needs grow: K/V bytes it lacks (fwd + bwd)
            lacked = self.kv_sends(donor, server, doc, first, b)[1]
            if self.held is not None:
                kept = (b - a) * self.query_bytes
                self.held[donor] -= kept
                self.held[server] += kept + lacked / 2
                self.held_total += lacked / 2
            if self.received is not None:
                self.received[server] += lacked // (2 * self.kv)
        for rank, add in changes.items():
            self.time[rank] += add
        pairs_s = self.attn * pairs
        # approximately (block rounding, the task it may drop): what moving the rest would save
        self.own[donor] = max(self.own[donor] - pairs_s - self.key_s * (b - a) + self.byte_s * (self.q + self.o) * (b - a),
                              0.0)
        old = self.needs.get((server, doc))
        self.needs[(server, doc)] = [first, b] if old is None else [min(old[0], first), max(old[1], b)]
        self.doc_servers.setdefault(doc, {donor}).add(server)
        if merged is not None:
            self.rows[merged][3] = a
            del self.merge_at[(server, donor, doc, b)]
        else:
            merged = len(self.rows)
            self.rows.append([donor, server, doc, a, b])
        self.merge_at[(server, donor, doc, a)] = merged
        self.cut[piece] = a
        intervals.pop(index)
        if a > piece_start:
            bisect.insort(intervals, (doc, piece_start, a, piece), key=lambda iv: -iv[2])

    # -- the descent --------------------------------------------------------------------------------

    def new_server(self, heap, exclude: int, count: int, known, lacks: int | None) -> int | None:
        """The first of the ``count`` servers predicted fastest (``exclude`` left out, and under kv_cap
        those that cannot receive ``lacks`` more K/V tokens; ``None``: a move that must be made, exempt
        as in ``best_shard``) that is not in ``known``, or None (lazy heap: stale entries are dropped)."""
        time, popped, seen, found = self.time, [], 0, None
        received = self.received if lacks is not None else None
        room = self.kv_cap - lacks if received is not None else 0
        while heap and seen < count:
            t, r = heap[0]
            if t != time[r]:
                heapq.heappop(heap)
                continue
            if r != exclude and (received is None or received[r] <= room):
                seen += 1
                if r not in known:
                    found = r
                    break
            popped.append(heapq.heappop(heap))
        for item in popped:
            heapq.heappush(heap, item)
        return found

    def shed(self, donor: int, level: float, heap, must_empty: bool) -> int:
        """Moves from ``donor`` at ``level``; returns how many."""
        moves = 0
        time, intervals, is_server = self.time, self.intervals(donor), self.is_server
        while intervals and (must_empty or time[donor] > level):
            move = None
            for index in range(min(_INTERVALS_TRIED, len(intervals))):
                doc, piece_start, end, _ = intervals[index]
                want = math.inf if must_empty or self.attn <= 0 else (time[donor] - level) / self.attn
                servers, holders = self.doc_servers.get(doc), self.holder_ranks.get(doc)
                # (the bound is fixed when first asked for: ask every time, as the order it is first asked in matters)
                bound = self.fan_out_bound(doc, donor, end)
                room = must_empty or servers is None or len(servers) < bound  # for a server new to the document
                # the document's servers and holders (they lack the least K/V) with the most room; a holder
                # serving none of it yet is new to it (a key-only prefix), so only within the bound...
                if servers or holders:
                    known = set(servers) if servers else set()
                    if holders and room:
                        known.update(holders)
                    known.discard(donor)
                    pool = sorted(known) if self.every_rank_serves else [r for r in sorted(known) if is_server[r]]
                    # (the LEAST_LOADED fastest, ties to the lowest rank: a stable sort of ranks in order)
                    candidates = sorted(pool, key=time.__getitem__)[:LEAST_LOADED]
                else:
                    known, candidates = (), []
                # ...then, within the fan-out bound, the servers predicted fastest
                if room:
                    # (one is enough: every server new to the document costs its holders the same sends,
                    # so the one with the most room takes the largest shard)
                    new = self.new_server(heap, donor, LEAST_LOADED, known,
                                          None if must_empty else end - key_start(end - 1, self.window))
                    if new is not None:
                        candidates.append(new)
                best, best_key, best_pairs = None, None, 0.0
                for server in candidates:
                    if self.attn > 0 and (level - time[server]) / self.attn <= best_pairs:
                        continue  # its room holds fewer pairs than the best shard so far moves
                    shard = self.best_shard(donor, server, doc, piece_start, end, level, want, must_empty)
                    if shard is None:
                        continue
                    a, changes, moved, merged = shard
                    key = (time[donor] + changes[donor], moved, server)
                    if best_key is None or key < best_key:
                        best, best_key = (server, a, changes, merged), key
                        best_pairs = (end * (end + 1) - a * (a + 1)) // 2 if self.window is None else \
                            causal_pairs(a, end, self.window)
                    if a == piece_start or key[0] <= level:  # all it wants: the next ones can only tie
                        break
                if best is not None:
                    move = (index, doc, *best)
                    break
            if move is None:
                return moves
            index, doc, server, a, changes, merged = move
            self.commit(donor, server, doc, index, a, changes, merged)
            moves += 1
            for rank in changes:
                if self.is_server[rank]:
                    heapq.heappush(heap, (time[rank], rank))
        return moves

    def run(self) -> None:
        n, time = self.n, self.time
        heap = [(time[r], r) for r in self.servers]  # the least loaded servers
        heapq.heapify(heap)
        level = self.lower_bound
        budget = MAX_MOVES_PER_RANK * n + 256
        # ranks outside the server pool give all their work away first, at a rising level
        for rank in range(n):
            if self.is_server[rank] or not self.has_work(rank):
                continue
            raises = 0
            while self.has_work(rank):
                moved = self.shed(rank, level, heap, must_empty=True)
                budget -= moved
                if self.has_work(rank):
                    if not moved and level == math.inf:  # (cannot happen: any server takes anything at inf)
                        raise AssertionError(f"descent: rank {rank} outside the server pool kept work")
                    raises += 1
                    top = max(time[s] for s in self.servers)
                    level = max(level + RAISE[0] * (top - level), level * (1 + RAISE[1])) if raises < 60 else math.inf
        raises = 0
        while budget > 0 and raises < 400:
            if level > self.give_up_above:  # every rank left above the level ends about there or above it
                self.gave_up = True
                return
            slowest = max(time)
            donor = time.index(slowest)  # ties: the lowest rank
            if not self.has_work(donor) or not self.is_server[donor]:
                return  # nothing the descent may move can make the slowest rank faster
            if slowest <= level * (1 + 1e-12):
                # every rank within the level: try a lower one, half way down to the lower bound
                if slowest - self.lower_bound <= CONVERGED * slowest:
                    return
                level = self.lower_bound + 0.5 * (slowest - self.lower_bound)
                raises += 1
                continue
            moved = self.shed(donor, level, heap, must_empty=False)
            budget -= moved
            if not moved:
                if slowest - level <= CONVERGED * slowest:
                    return  # converged
                level += min(RAISE[0] * (slowest - level), RAISE[1] * level)
                raises += 1

    def plan(self) -> Plan:
        p = self.pieces
        q_end = p.end
        if self.cut:  # what stays at home of the pieces moves cut (nothing when cut at their start)
            q_end = q_end.copy()
            q_end[np.fromiter(self.cut, dtype=np.int64, count=len(self.cut))] = np.fromiter(
                self.cut.values(), dtype=np.int64, count=len(self.cut))
        keep = q_end > p.start
        table = np.asarray(self.rows, dtype=np.int64).reshape(-1, 5)
        source, server, doc, q_start, q_end = (np.concatenate((column, extra)) for column, extra in zip(
            (p.rank[keep], p.rank[keep], p.doc[keep], p.start[keep], q_end[keep]), table.T))
        order = lexsort_ints((q_start, doc, source, server))
        return Plan(source[order], server[order], doc[order], q_start[order], q_end[order], self.n,
                    self.servers, self.window)


def descend(pieces: DocumentPieces, config: PlannerConfig, *, backward: str | None = None,
            start: DescentStart | None = None) -> Plan:
    """The descent's plan of ``pieces`` (module docstring), its bytes timed in ``backward`` mode
    (default ``config.backward``), unbounded by memory; the plan says ``"saved"``, ``by_time`` fits it
    to the memory budget. ``start``: ``DescentStart(pieces, config)``, shared by the descents of one
    batch (default: prepared here)."""
    state = _Descent(pieces, config, backward or config.backward, start=start)
    state.run()
    return state.plan()


def descend_within_memory(pieces: DocumentPieces, config: PlannerConfig, *, backward: str | None = None,
                          held_mean: float = 0.0, give_up_above: float = math.inf,
                          start: DescentStart | None = None) -> tuple[Plan | None, bool]:
    """``(descend's plan, refused)`` with ``config.memory_budget`` as a constraint (``saved`` mode; the
    budget does not bound ``resend`` mode): a move may not take a server past ``(1 + budget)`` x the
    mean that ranks hold (``transfers.backward_memory``), or past the floor; the mean counted is at
    least ``held_mean`` bytes (an estimate of the finished plan's: ``by_time`` passes the unbounded
    descent's). A move over it is cut (fewer queries) or goes to another server. ``refused`` says
    whether the budget cut or refused a move that the time alone allowed. The descent's memory is
    an upper bound per rank (a donor's K/V needs are never taken back), so the plan is judged again
    exactly (``by_time``). The plan is ``None`` when the level rose past ``give_up_above`` seconds
    (the step of a plan in hand): the ranks left above it would end about there, or slower. ``start``:
    as ``descend``'s."""
    state = _Descent(pieces, config, backward or config.backward, config.memory_budget, held_mean, give_up_above,
                     start)
    state.run()
    return (None if state.gave_up else state.plan()), state.memory_refused

def fan_out_bounds(pieces: DocumentPieces, config: PlannerConfig, *, backward: str | None = None) -> dict[int, float]:
    """``{doc: the most servers the descent spreads it to}`` (module docstring: the fan-out at which
    one of its K/V holders' sends alone would be predicted slower than the colocated step; never
    below the ranks computing it colocated, nor 1); ``math.inf`` when K/V cost no exposed time."""
    state = _Descent(pieces, config, backward or config.backward)
    ends = np.zeros(int(pieces.doc.max(initial=-1)) + 1, dtype=np.int64)
    np.maximum.at(ends, pieces.doc, pieces.end)
    bounds = {}
    for doc, rank in zip(pieces.doc.tolist(), pieces.rank.tolist()):
        if doc not in bounds:
            bounds[doc] = state.fan_out_bound(doc, rank, int(ends[doc]))
    return bounds
