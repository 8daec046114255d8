"""Planning by time, directly (``tolerance="auto"``'s main candidate): a greedy descent on the predicted
layer time, both ends of every link counted. Pure numpy and Python; no torch.distributed.

The predicted time of rank ``r`` is the time model's (``by_time.loads_seconds``): its linear layers
(plus ``PlannerConfig.base_pairs``' other work), the CA-tasks it serves (pairs, keys, one task each),
and the exposed share of the bytes it **sends** and **receives** (queries out, outputs back, K/V
from every rank holding part of a task's prefix), plus ``collective_s``. A K/V prefix held on ``k``
ranks costs each of them one send per server its document's shards go to, so spreading a long
document over more servers can make its holders, not its servers, the slowest ranks.

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

from .carving import Plan, PlannerConfig, colocated_plan
from .cost import COMM_PASSES, causal_pairs, key_start, start_with_pairs
from .pieces import DocumentPieces
from .transfers import rank_bytes

__all__ = ["descend", "linear_seconds", "fan_out_bounds", "document_servers", "long_document_servers", "LEAST_LOADED", "RAISE", "CONVERGED",
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


def linear_seconds(tokens, config: PlannerConfig) -> np.ndarray:
    """``[ranks]`` seconds of each rank's work besides attention in one layer (forward + backward):
    its ``tokens`` (``[ranks]``) through the linear layers, or, when ``config.base_pairs`` is given,
    that work as it says (relative to the least loaded rank, in pairs of attention time: its linear
    layers and any other work, e.g. a pipeline stage's LM head) plus the least loaded rank's linear
    layers. The descent and ``by_time.rank_seconds`` (the judge of ``tolerance="auto"``) both time it
    here, so a candidate is judged with the other work it was balanced with."""
    tm = config.time_model
    tokens_s = tm.linear_s_per_token * np.asarray(tokens, dtype=np.float64)
    if config.base_pairs is None:
        return tokens_s
    # base_pairs already hold each rank's linear layers relative to the least loaded rank's: the tokens'
    # linear layers are not counted again, only that common level
    return tm.attn_s_per_pair * np.asarray(config.base_pairs, dtype=np.float64) + tokens_s.min(initial=0.0)


def _holder_time_floor(time: float, own: float, level: float) -> float:
    """What a rank's time can come down to by moving its own attention away (``own``: that attention
    less the exposed time of sending its queries out and taking their outputs back), as the level
    rule sees it: all of it if the rank is above the level (a donor), none otherwise."""
    return time - own if time > level else time


class _Descent:
    def __init__(self, pieces: DocumentPieces, config: PlannerConfig, backward: str):
        n = pieces.num_ranks
        self.pieces, self.n, self.window, self.block = pieces, n, config.window, config.block
        self.servers = config.servers if config.servers is not None else tuple(range(n))
        if self.servers[-1] >= n:
            raise ValueError(f"server rank {self.servers[-1]} does not exist in a world of {n} ranks")
        self.is_server = [False] * n
        for s in self.servers:
            self.is_server[s] = True
        tm, tb = config.time_model, config.token_bytes
        self.attn, self.key_s, self.task_s = tm.attn_s_per_pair, tm.task_key_s, tm.task_s
        self.q, self.o, self.kv = tb.q, tb.o, tb.kv
        self.byte_s = config.exposed_comm * COMM_PASSES[backward] / tm.bytes_per_s
        base = np.zeros(n) if config.base_pairs is None else np.asarray(config.base_pairs, dtype=np.float64)
        if base.size != n:
            raise ValueError(f"base_pairs gives {base.size} ranks, the pieces {n}")
        colocated = colocated_plan(pieces, self.servers, window=self.window)
        pairs = np.bincount(colocated.server, weights=colocated.pairs(), minlength=n)
        keys = np.bincount(colocated.server, weights=colocated.keys(), minlength=n)
        tasks = np.bincount(colocated.server, minlength=n)
        sent, received = rank_bytes(colocated, pieces, tb)
        linear = linear_seconds(pieces.tokens(), config)
        own = self.attn * pairs + self.key_s * keys + self.task_s * tasks
        # seconds each rank saves by moving all of its own attention still computed at home away:
        # that attention, less the exposed time of its queries out and outputs back
        self.own = np.maximum(own - self.byte_s * (self.q + self.o) * pieces.tokens(), 0.0).tolist()
        self.time = (linear + own + self.byte_s * (sent + received) + tm.collective_s).tolist()
        self.colocated_step = max(self.time, default=0.0)
        self.floor0 = (linear + self.byte_s * (sent + received) + tm.collective_s).tolist()
        servers = list(self.servers)
        self.lower_bound = max(float((linear + tm.collective_s).max(initial=0.0)),
                               float(linear[servers].sum() + own.sum()) / len(servers) + tm.collective_s)
        self.holders = pieces.spanning_holders()
        # (server, doc) -> keys [start, end) it needs; the colocated plan's needs of spanning documents
        self.needs: dict[tuple[int, int], list[int]] = {}
        self.doc_servers: dict[int, set[int]] = {}
        window = self.window
        for doc, holders in self.holders.items():
            self.doc_servers[doc] = set()
        several = np.isin(pieces.doc, list(self.holders)) & (pieces.end > pieces.start)
        for rank, doc, start, end in zip(pieces.rank[several].tolist(), pieces.doc[several].tolist(),
                                         pieces.start[several].tolist(), pieces.end[several].tolist()):
            first = key_start(start, window)
            need = self.needs.get((rank, doc))
            self.needs[(rank, doc)] = [first, end] if need is None else [min(need[0], first), max(need[1], end)]
            self.doc_servers[doc].add(rank)
        # each rank's own query intervals [doc, piece start, end], latest end first (tails move first),
        # made into Python lists only for the ranks the descent looks at
        longest = int(pieces.end.max(initial=0))
        order = _sort_order((pieces.doc, longest - pieces.end, pieces.rank))
        self.by_rank = order[pieces.end[order] > pieces.start[order]]
        self.rank_start = np.searchsorted(pieces.rank[self.by_rank], np.arange(n + 1)).tolist()
        self.listed: dict[int, list[list[int]]] = {}
        self.rows: list[list[int]] = []  # moved tasks [source, server, doc, q_start, q_end]
        self.opened: set[int] = set()  # ranks whose own intervals changed
        self.kv_key, self.kv_version, self.kv_value = None, -1, None  # kv_sends' last answer
        self.commits = 0
        self.merge_at: dict[tuple[int, int, int, int], int] = {}  # (server, source, doc, start) -> row
        self.bounds: dict[int, float] = {}

    def intervals(self, rank: int) -> list[list[int]]:
        """The rank's own intervals still at home, ``[doc, piece start, end]``, latest end first."""
        listed = self.listed.get(rank)
        if listed is None:
            p, mine = self.pieces, self.by_rank[self.rank_start[rank]:self.rank_start[rank + 1]]
            listed = self.listed[rank] = [list(iv) for iv in zip(p.doc[mine].tolist(), p.start[mine].tolist(),
                                                                   p.end[mine].tolist())]
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

    def effect(self, donor: int, server: int, doc: int, piece_start: int, a: int, b: int):
        """``(changes, bytes, merged)`` of moving queries ``[a, b)`` (a tail of the donor's interval
        ``[piece_start, b)``) to ``server``: ``changes`` maps a rank to its added seconds."""
        window, attn, key_s, task_s, byte_s = self.window, self.attn, self.key_s, self.task_s, self.byte_s
        pairs = causal_pairs(a, b, window)
        m = b - a
        first = key_start(a, window)
        # the donor: its local task [piece_start, b) becomes [piece_start, a), or goes
        if a > piece_start:
            donor_s = -attn * pairs - key_s * m
        else:
            donor_s = -attn * pairs - key_s * (b - key_start(piece_start, window)) - task_s
        moved_bytes = m * (self.q + self.o)
        donor_s += byte_s * moved_bytes
        merged = self.merge_at.get((server, donor, doc, b))
        if merged is not None:
            server_s = attn * pairs + key_s * (key_start(b, window) - first)
        else:
            server_s = attn * pairs + key_s * (b - first) + task_s
        server_s += byte_s * moved_bytes
        changes = {donor: donor_s, server: server_s}
        kv_sends, kv_bytes = self.kv_sends(donor, server, doc, first, b)
        for rank, cost in kv_sends:
            changes[rank] = changes.get(rank, 0.0) + cost
            changes[server] += cost
        return changes, 2 * moved_bytes + kv_bytes, merged

    def kv_sends(self, donor: int, server: int, doc: int, first: int, b: int):
        """``([(sender, seconds)], bytes)`` of the K/V ``server`` lacks to run keys ``[first, b)`` of
        ``doc`` (what its need grows by), remembered until the next move: a shard's sizing asks for
        the same keys several times."""
        key = (server, doc, first, b)
        if self.kv_key == key and self.kv_version == self.commits:
            return self.kv_value
        byte_s, sends, total = self.byte_s, [], 0
        old = self.needs.get((server, doc))
        new = (first, b) if old is None else (min(old[0], first), max(old[1], b))
        if old is None or new[0] != old[0] or new[1] != old[1]:
            for rank, kv_start, kv_end in self.senders(doc, donor, b):
                if rank == server:
                    continue
                more = max(min(new[1], kv_end) - max(new[0], kv_start), 0)
                if old is not None:
                    more -= max(min(old[1], kv_end) - max(old[0], kv_start), 0)
                if more > 0:
                    sends.append((rank, byte_s * more * self.kv))
                    total += 2 * more * self.kv
        self.kv_key, self.kv_version, self.kv_value = key, self.commits, (sends, total)
        return sends, total

    def acceptable(self, changes, donor: int, server: int, level: float, must_empty: bool) -> bool:
        time, own = self.time, self.own
        for rank, add in changes.items():
            new = time[rank] + add
            if rank == server:
                if new > level * (1 + 1e-12):
                    return False
            elif rank == donor:
                if not must_empty and new >= time[donor] * (1 - 1e-12):
                    return False
            elif _holder_time_floor(new, own[rank], level) > level * (1 + 1e-12):
                return False
        return True

    def best_shard(self, donor: int, server: int, doc: int, piece_start: int, end: int, level: float,
                   want_pairs: float, must_empty: bool):
        """The largest tail ``[a, end)`` (cut a multiple of ``block`` from ``piece_start``) that
        ``server`` may take at ``level``: ``(a, changes, bytes, merged)`` or None."""
        room = level - self.time[server]
        if room <= 0:
            return None
        window, block, attn = self.window, self.block, self.attn
        whole = causal_pairs(piece_start, end, window)
        pairs = min(want_pairs, whole)
        if attn > 0:
            # the first guess counts what the shard costs the server besides its pairs: the K/V it
            # lacks (as for a one-query tail), a task and its keys unless it merges, queries and
            # outputs at about one query per `end` (or `window`) pairs
            first = key_start(end - 1, window)
            kv_cost = sum(cost for rank, cost in self.kv_sends(donor, server, doc, first, end)[0])
            fixed = kv_cost + (0.0 if (server, donor, doc, end) in self.merge_at else
                               self.task_s + self.key_s * (end - first))
            per_pair = attn + self.byte_s * (self.q + self.o) / max(min(end, window or end), 1)
            pairs = min(pairs, max(room - fixed, 0.0) / per_pair)
        for _ in range(4):
            if pairs >= whole:
                a = piece_start
            else:
                a = piece_start + math.ceil((start_with_pairs(end, pairs, window) - piece_start) / block) * block
                if a >= end:  # less than a block fits: one block (the last one may be shorter)
                    a = max(piece_start, piece_start + ((end - piece_start - 1) // block) * block)
            changes, moved, merged = self.effect(donor, server, doc, piece_start, a, end)
            if self.acceptable(changes, donor, server, level, must_empty):
                return a, changes, moved, merged
            over = self.time[server] + changes[server] - level
            got = causal_pairs(a, end, window)
            if over <= 0 or got <= 0 or a + block >= end:
                return None  # another rank's limit, or already the smallest shard
            # shrink by the share of the server's added time that is over the level
            pairs = got * max(1.0 - over / changes[server], 0.0) * 0.98
            if pairs <= 0:
                return None
        return None

    def commit(self, donor: int, server: int, doc: int, index: int, a: int, changes, merged) -> None:
        self.commits += 1
        interval = self.intervals(donor)[index]
        piece_start, b = interval[1], interval[2]
        for rank, add in changes.items():
            self.time[rank] += add
        pairs_s = self.attn * causal_pairs(a, b, self.window)
        # approximately (block rounding, the task it may drop): what moving the rest would save
        self.own[donor] = max(self.own[donor] - pairs_s - self.key_s * (b - a) + self.byte_s * (self.q + self.o) * (b - a),
                              0.0)
        first = key_start(a, self.window)
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
        intervals = self.intervals(donor)
        self.opened.add(donor)
        intervals.pop(index)
        if a > piece_start:
            bisect.insort(intervals, [doc, piece_start, a], key=lambda iv: -iv[2])

    # -- the descent --------------------------------------------------------------------------------

    def least_loaded(self, heap, exclude: int, count: int) -> list[int]:
        """The ``count`` servers predicted fastest, ``exclude`` left out (lazy heap)."""
        time, found, popped = self.time, [], []
        while heap and len(found) < count:
            t, r = heapq.heappop(heap)
            if t != time[r]:
                continue
            popped.append((t, r))
            if r != exclude:
                found.append(r)
        for item in popped:
            heapq.heappush(heap, item)
        return found

    def shed(self, donor: int, level: float, heap, must_empty: bool) -> int:
        """Moves from ``donor`` at ``level``; returns how many."""
        moves = 0
        time, intervals = self.time, self.intervals(donor)
        while intervals and (must_empty or time[donor] > level):
            move = None
            for index in range(min(_INTERVALS_TRIED, len(intervals))):
                doc, piece_start, end = intervals[index]
                want = math.inf if must_empty or self.attn <= 0 else (time[donor] - level) / self.attn
                servers = self.doc_servers.get(doc)
                # the document's servers and holders (they lack the least K/V) with the most room...
                known = set(servers or ())
                known.update(rank for rank, _, _ in self.holders.get(doc, ()))
                known = {r for r in known if self.is_server[r] and r != donor}
                candidates = heapq.nsmallest(LEAST_LOADED, known, key=lambda r: (time[r], r))
                # ...then, within the fan-out bound, the servers predicted fastest
                bound = self.fan_out_bound(doc, donor, end)
                if must_empty or servers is None or len(servers) < bound:
                    # (one is enough: every server new to the document costs its holders the same sends,
                    # so the one with the most room takes the largest shard)
                    candidates += [r for r in self.least_loaded(heap, donor, LEAST_LOADED) if r not in known][:1]
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
                        best_pairs = causal_pairs(a, end, self.window)
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
        opened = np.zeros(self.n, dtype=bool)
        opened[list(self.opened)] = True
        keep = ~opened[p.rank] & (p.end > p.start)  # the pieces of ranks that moved nothing, as they are
        rows = [[r, r, d, s, e] for r in sorted(self.opened) for d, s, e in self.listed[r]] + self.rows
        table = np.asarray(rows, dtype=np.int64).reshape(-1, 5)
        source, server, doc, q_start, q_end = (np.concatenate((column, extra)) for column, extra in zip(
            (p.rank[keep], p.rank[keep], p.doc[keep], p.start[keep], p.end[keep]), table.T))
        order = _sort_order((q_start, doc, source, server))
        return Plan(source[order], server[order], doc[order], q_start[order], q_end[order], self.n,
                    self.servers, self.window)


def _sort_order(keys) -> np.ndarray:
    """``np.lexsort(keys)`` (the last key sorts first) of non-negative int64 arrays whose rows are
    distinct, as one argsort of their mixed-radix combination when it fits in int64 (several times
    faster on the ~70k pieces of a 512-rank batch)."""
    spans = [int(k.max(initial=0)) + 1 for k in keys]
    if math.prod(spans) >= 2**62:
        return np.lexsort(keys)
    combined = np.zeros(keys[0].size, dtype=np.int64)
    for key, span in zip(reversed(keys), reversed(spans)):
        combined = combined * span + key
    return np.argsort(combined)


def descend(pieces: DocumentPieces, config: PlannerConfig, *, backward: str | None = None) -> Plan:
    """The descent's plan of ``pieces`` (module docstring), its bytes timed in ``backward`` mode
    (default ``config.backward``); the plan says ``"saved"``, ``by_time`` fits it to the memory budget."""
    state = _Descent(pieces, config, backward or config.backward)
    state.run()
    return state.plan()


def document_servers(plan: Plan) -> dict[int, int]:
    """``{doc: number of ranks computing some of its queries}`` under ``plan``."""
    pairs = np.unique(plan.doc * plan.num_ranks + plan.server)
    docs, counts = np.unique(pairs // plan.num_ranks, return_counts=True)
    return dict(zip(docs.tolist(), counts.tolist()))


def long_document_servers(plan: Plan, pieces: DocumentPieces, longer_than: int) -> tuple[float, float]:
    """``(mean, max)`` over the documents longer than ``longer_than`` tokens of the ranks computing
    some of their queries under ``plan`` (``(0, 0)`` without such documents)."""
    length = np.zeros(int(pieces.doc.max(initial=-1)) + 1, dtype=np.int64)
    np.maximum.at(length, pieces.doc, pieces.end)
    servers = document_servers(plan)
    counts = [servers[d] for d in np.flatnonzero(length > longer_than).tolist() if d in servers]
    return (float(np.mean(counts)), float(max(counts))) if counts else (0.0, 0.0)


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
