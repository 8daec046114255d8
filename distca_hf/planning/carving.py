"""Carving: CA-tasks onto attention servers at a fixed tolerance, so every server does about the
same attention work while moving as few bytes as possible. Pure numpy; no torch, no torch.distributed.
``planning.planner.plan_tasks`` is the entry point (it chooses among carvings by time and memory).

Input: every rank's packed document pieces (a document that spans ranks appears as one piece per
rank, each with its query range inside the document). Output: a ``Plan``, a list of CA-tasks with
source rank (where the queries live), document, query range ``[q_start, q_end)`` (the K/V prefix is
``[0, q_end)``) and server rank.

How it works. The cost of a piece is its causal pair count. With ``S`` servers the mean load is
``total / S``; the guarantee is ``max server load <= (1 + tolerance) * mean``, and the planner aims at
the tighter ``cap = (1 + 0.85 tolerance) * mean`` to keep a margin for block rounding. Ranks above
their target (``cap`` for servers, 0 for ranks outside the server pool) are donors; servers below
``cap`` are receivers. Donors, largest excess first, give to the receiver with the most room (a heap),
so few (source, server) pairs need K/V. When another server ties with it (it can take everything the
roomiest would take in that step) and already holds part of the shard's K/V prefix (a piece of a
document that spans ranks), that server takes the shard instead: it is sent fewer K/V tokens. Each
transfer carves shards out of the donor's pieces, latest document positions first (a query late in a
long document carries the most pairs per byte), at the position that minimises bytes for the pairs
moved: for a shard ``[a, b)`` moving ``P`` pairs the bytes are ``(b - a) * (q + o) + b * kv`` (query
out, output back, K/V prefix), minimised by a width near ``sqrt(P * kv / (q + o + kv / 2))``. Under a
sliding window (``PlannerConfig.window``) pairs are counted under the window and the K/V a shard needs
start at ``key_start(a, window)``: ``(b - key_start(a, window)) * kv``. Shards never exceed the
receiver's room, except when no room can take a single block: then the rank with the most room that
still holds all its own work takes it, and a second pass trims every server above the cap with its own
finest work (short documents). What cannot be trimmed is under one block (a granule): the bound is
exact up to that granule, which only matters when a block of the longest document is a sizeable
fraction of the mean. Everything a donor keeps stays local, in place.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from ..config import is_number, plain_number, setting_problem
from .cost import (H100_MEASURED, LLAMA3_8B_BYTES, TimeModel, TokenBytes, causal_pairs, check_window, end_with_pairs,
                   key_start, start_with_pairs, tile_pairs)
from .pieces import DocumentPieces
from .ranges import lexsort_ints

__all__ = ["PlannerConfig", "Plan", "tolerance_plans", "CarvingProgress", "colocated_plan", "PLANNING_MARGIN", "server_pool"]


PLANNING_MARGIN = 0.85  # the planner aims at (1 + 0.85 tolerance) x mean


@dataclass(frozen=True)
class PlannerConfig:
    """How the planner balances.

    Attributes:
        tolerance: ``"auto"``: plan by time (``planning.by_time``: the plan the time model predicts
            fastest, colocated included); a number: a hard bound, max/mean - 1 of server attention
            load (pairs) (smaller balances more tightly and moves more bytes; >= 0). The pure
            planner's default stays 0.02; the ``tolerance`` setting's default is ``"auto"``.
        block: shard granularity in tokens: every cut inside a piece is a multiple of ``block``
            tokens from the piece start (flash kernels like 128; 1 is fine on CPU; the ``block``
            setting's None is resolved by ``config.block_for_device`` before it gets here).
        servers: ranks that serve attention (``None``: every rank).
        token_bytes: wire size of a token, used to choose what moves.
        window: the model's sliding attention window when every layer uses the same one (``None``:
            full causal). Pairs are counted under it and a shard ``[a, b)`` needs K/V only from
            ``key_start(a, window)``.
        time_model: what ``"auto"`` predicts step times with (default: the built-in CUDA model at
            Llama-3-8B's shape, matching ``token_bytes``' default).
        exposed_comm: the fraction of communication time the overlap mode does not hide (1: none
            hidden, ``overlap="none"``), for ``"auto"``.
        backward: the backward mode in force, ``"saved"`` (servers keep what their backward needs)
            or ``"resend"`` (sources resend it; servers keep nothing): what a plan's memory and
            backward bytes are judged in. ``planner.plan_tasks`` may plan a step in ``"resend"`` when
            only that fits ``memory_budget`` (``Plan.backward`` says which).
        memory_budget: a bound on the memory a plan makes the worst rank hold for attention's
            backward in one layer (``transfers.backward_memory``): ``(1 + memory_budget)`` x the mean
            over ranks of what they hold (``memory_imbalance``), or what it keeps in ``resend`` mode if
            more (``BackwardMemory.fits``); ``None``: unbounded (the setting's default is 0.1).
        base_pairs: ``[num_ranks]`` the work each rank does in the layer besides attention, in pairs
            of attention time (``None``: none counted). The carving then balances pairs + base: a
            rank with less other work (a pipeline bubble in a ``cad_1f1b`` tick runs no linear layers)
            serves more attention, and the tolerance bounds max/mean of pairs + base. Set by
            ``pipeline_cost.plan_lockstep_tick``; plain plans balance pairs alone.
        key_split: ``"auto"`` also weighs its best plan with key-split tiles (``tiles.apply_time_tiles``).
        kv_cap, kv_relays: those settings (``baselines.kv_cap_tokens``; ``relay.apply_relays``).
    """

    tolerance: float | str = 0.02
    block: int = 1
    servers: tuple[int, ...] | None = None
    token_bytes: TokenBytes = field(default=LLAMA3_8B_BYTES)
    window: int | None = None
    time_model: TimeModel = field(default=H100_MEASURED)
    exposed_comm: float = 1.0
    backward: str = "saved"
    memory_budget: float | None = None
    base_pairs: tuple[float, ...] | None = None
    key_split: bool = False
    kv_cap: float | str | None = None
    kv_relays: str | int = "off"  # np.integer accepted, as block

    def __post_init__(self):
        for name in ("tolerance", "block", "kv_relays", "memory_budget", "kv_cap", "exposed_comm"):  # np numbers ok
            object.__setattr__(self, name, plain_number(getattr(self, name)))
        if self.servers is not None and hasattr(self.servers, "__iter__"):
            object.__setattr__(self, "servers", tuple(plain_number(s) for s in self.servers))
        for name in ("tolerance", "block", "servers", "backward", "memory_budget", "kv_cap", "kv_relays"):
            problem = setting_problem(name, getattr(self, name))
            if problem:
                raise ValueError(f"{name} {problem}")
        if self.block is None:
            raise ValueError("block must be an integer >= 1 here; resolve the setting's None with "
                             "distca_hf.config.block_for_device")
        if not isinstance(self.time_model, TimeModel) or not isinstance(self.token_bytes, TokenBytes):
            raise ValueError(f"time_model must be a TimeModel and token_bytes a TokenBytes, got {self.time_model!r} "
                             f"and {self.token_bytes!r}")
        if type(self.exposed_comm) not in (int, float) or not 0.0 <= self.exposed_comm <= 1.0:  # (no bool)
            raise ValueError(f"exposed_comm must be a fraction in [0, 1], got {self.exposed_comm!r}")
        if self.base_pairs is not None:  # (a string is no list of numbers: "12" is not (1.0, 2.0))
            listed = isinstance(self.base_pairs, (list, tuple, np.ndarray)) and np.ndim(self.base_pairs) == 1  # no dict
            base = tuple(float(b) if is_number(b) else -1.0 for b in self.base_pairs) if listed else (-1.0,)
            if not all(np.isfinite(b) and b >= 0 for b in base):
                raise ValueError(f"base_pairs must be finite numbers >= 0 (one per rank), got {self.base_pairs!r}")
            object.__setattr__(self, "base_pairs", base)
        if self.servers is not None:
            object.__setattr__(self, "servers", tuple(sorted(self.servers)))
        if not isinstance(self.key_split, (bool, np.bool_)):
            raise ValueError(f"key_split must be True or False, got {self.key_split!r}")
        object.__setattr__(self, "key_split", bool(self.key_split))  # (np.True_ as True)
        object.__setattr__(self, "window", check_window(self.window))


@dataclass(frozen=True, eq=False)
class Plan:
    """CA-tasks and where they run (arrays of shape ``[num_tasks]``, int64).

    Task ``i``: queries ``[q_start[i], q_end[i])`` of document ``doc[i]`` live on rank ``source[i]``
    and are computed on ``server[i]`` with K/V ``[key_start(q_start[i], window), q_end[i])`` (the whole
    prefix ``[0, q_end[i])`` without a sliding ``window``). ``backward``: the backward mode the plan
    runs in (``"saved"`` or ``"resend"``), part of the agreed plan like the tasks (every rank
    computes the same).

    ``k_start`` / ``k_end`` (both or neither): key-split tasks (``planning.key_split``), task ``i`` with
    only its keys ``[k_start[i], k_end[i])``; ``None`` (every carving's plan): whole prefixes.
    ``relays``: K/V forwarded by servers along trees (``relay_trees``; ``None``: sent direct).
    """

    source: np.ndarray
    server: np.ndarray
    doc: np.ndarray
    q_start: np.ndarray
    q_end: np.ndarray
    num_ranks: int
    servers: tuple[int, ...]
    window: int | None = None
    backward: str = "saved"
    k_start: np.ndarray | None = None
    k_end: np.ndarray | None = None
    relays: "RelayTrees | None" = None  # noqa: F821

    def __post_init__(self):
        if (self.k_start is None) != (self.k_end is None):
            raise ValueError("a Plan takes both k_start and k_end (key-split tasks) or neither")

    @property
    def num_tasks(self) -> int:
        return int(self.source.size)

    splits_keys = property(lambda self: self.k_start is not None, doc="Whether tasks carry key ranges.")

    def key_ranges(self) -> tuple[np.ndarray, np.ndarray]:
        """Each task's keys ``([num_tasks] k_start, [num_tasks] k_end)``, whole prefixes when none are split."""
        return (self.k_start, self.k_end) if self.splits_keys else (key_start(self.q_start, self.window), self.q_end)

    def pairs(self) -> np.ndarray:
        if self.splits_keys:
            return tile_pairs(self.q_start, self.q_end, self.k_start, self.k_end, self.window)
        return causal_pairs(self.q_start, self.q_end, self.window)

    def keys(self) -> np.ndarray:
        """``[num_tasks]`` K/V tokens each task's kernel pass covers: ``q_end - key_start(q_start, window)``."""
        first, end = self.key_ranges()
        return end - first

    def server_pairs(self) -> np.ndarray:
        """``[num_ranks]`` pairs each rank computes as a server under the plan."""
        return np.bincount(self.server, weights=self.pairs(), minlength=self.num_ranks).astype(np.int64)

    def moved_queries(self) -> int:
        """Query tokens computed on a server other than their own rank."""
        moved = self.source != self.server
        return int((self.q_end[moved] - self.q_start[moved]).sum())

    def subset(self, mask: np.ndarray) -> "Plan":
        """The tasks selected by the boolean ``mask`` ``[num_tasks]``, in plan order."""
        keys = (None, None) if self.k_start is None else (self.k_start[mask], self.k_end[mask])
        return Plan(self.source[mask], self.server[mask], self.doc[mask], self.q_start[mask], self.q_end[mask],
                    self.num_ranks, self.servers, self.window, self.backward, *keys, relays=self.relays)


class CarvingProgress:
    """A fixed-tolerance carving part way through, as ``tolerance_plans`` shows it to ``give_up``.

    Attributes:
        tolerance: the tolerance being carved.
        moved: the tasks moved since the previous question, ``(source, server, doc, q_start,
            q_end)`` rows (none at the first question, before any donor). A task once moved stays
            in the finished plan, which only adds tasks: the bytes of the tasks moved so far are a
            lower bound on the plan's bytes.
    """

    def __init__(self, shedder: "_Shedder", tolerance: float):
        self._shedder, self.tolerance = shedder, tolerance
        self.moved: list[tuple[int, int, int, int, int]] = []
        # one block of pairs, and one pair more for start_with_pairs' float rounding at a cut
        self._granule = shedder.carver.block_pairs(shedder.layout.longest) + 1

    def served_at_least(self, rank: int | None = None):
        """Pairs ``rank`` serves in the finished plan, at least (``[num_ranks]`` float64 for every
        rank when ``rank`` is None): ``min(served now, cap) - granule`` on a server, never below 0;
        0 outside the server pool. A server's load falls only when it sheds (at most once as a donor
        in the first pass, once more in the second if over the cap), and a shed of ``need`` pairs
        moves at most ``need`` plus one block of pairs (``block`` queries of the longest document or
        of the window; ``_Carver.move``), so it never ends more than that ``granule`` (and a pair
        for rounding) below the cap."""
        shedder = self._shedder
        base = shedder.layout.base  # served counts it too; the bound is on pairs
        if rank is None:
            at_least = np.minimum(np.asarray(shedder.served), shedder.cap) - self._granule - base
            return np.where(shedder.layout.is_server, np.maximum(at_least, 0.0), 0.0)
        if not shedder.is_server[rank]:
            return 0.0
        return max(min(shedder.served[rank], shedder.cap) - self._granule - base[rank], 0.0)


def tolerance_plans(pieces: DocumentPieces, config: PlannerConfig, tolerances, *, give_up=None):
    """``plan_tasks`` at each numeric tolerance of ``tolerances`` in turn (``config.tolerance`` is not
    used), made lazily, sharing what does not depend on the tolerance (the loads, the pieces grouped
    by rank, the prefix holders). Yields one ``Plan`` per tolerance, each exactly ``plan_tasks``'.

    ``give_up(progress: CarvingProgress) -> bool``, when given, is asked during every carving that
    moves work: before its first donor, then after every transfer to a receiver, with the tasks it
    moved. A true answer abandons that tolerance: its plan is ``None``. ``planning.by_time`` gives
    up on a carving whose plan is already sure to be predicted slower than a plan it holds."""
    layout = _Layout(pieces, config)
    for tolerance in tolerances:
        problem = setting_problem("tolerance", tolerance)
        if problem or tolerance == "auto":
            raise ValueError(f"tolerance_plans needs numeric tolerances; tolerance {problem or 'auto'}")
        yield layout.plan(tolerance, give_up)


def server_pool(config: PlannerConfig, num_ranks: int) -> tuple[int, ...]:
    """The ranks that serve attention in a batch of ``num_ranks`` ranks: ``config.servers`` (sorted;
    ``None``: every rank), refused naming it when it names a rank the batch does not have."""
    servers = config.servers if config.servers is not None else tuple(range(num_ranks))
    if servers[-1] >= num_ranks:
        raise ValueError(f"PlannerConfig.servers={servers} names server rank {servers[-1]}, which does not exist "
                         f"in a world of {num_ranks} ranks")
    return servers


class _Layout:
    """What every carving of one batch shares, whatever its tolerance."""

    def __init__(self, pieces: DocumentPieces, config: PlannerConfig):
        num_ranks = pieces.num_ranks
        self.servers = server_pool(config, num_ranks)
        self.is_server = np.zeros(num_ranks, dtype=bool)
        self.is_server[list(self.servers)] = True
        self.pieces, self.config, self.window = pieces, config, config.window
        self.load = np.bincount(pieces.rank, weights=causal_pairs(pieces.start, pieces.end, self.window),
                                minlength=num_ranks)
        # work besides attention, in pairs (PlannerConfig.base_pairs): balanced together with the pairs
        self.base = np.zeros(num_ranks)
        if config.base_pairs is not None:
            if len(config.base_pairs) != num_ranks:
                raise ValueError(f"base_pairs gives {len(config.base_pairs)} ranks, the pieces {num_ranks}")
            self.base = np.asarray(config.base_pairs, dtype=np.float64)
        self.longest = int(pieces.end.max(initial=0))
        self._by_rank = None
        self._opened: dict[int, list[tuple[int, int, int]]] = {}

    def grouped(self):
        """``(by_rank, rank_start, prefix_holders)``, built on the first carving that moves work:
        piece indices grouped by rank (latest document positions first inside each rank), where each
        rank's group starts, and who holds the documents that span ranks."""
        if self._by_rank is None:
            p = self.pieces
            by_rank = lexsort_ints((p.doc, int(p.end.max(initial=0)) - p.end, p.rank))
            by_rank = by_rank[p.end[by_rank] > p.start[by_rank]]  # a key-only piece holds no work
            rank_start = np.searchsorted(p.rank[by_rank], np.arange(p.num_ranks + 1)).tolist()
            self._by_rank = (by_rank, rank_start, _PrefixHolders(p, self.window))
        return self._by_rank

    def intervals(self, rank: int) -> list[list[int]]:
        """A fresh copy of the rank's own pieces as ``[doc, start, end]`` intervals, latest document
        positions first (most pairs per byte)."""
        if rank not in self._opened:
            by_rank, rank_start, _ = self.grouped()
            p = self.pieces
            mine = by_rank[rank_start[rank] : rank_start[rank + 1]]
            self._opened[rank] = list(zip(p.doc[mine].tolist(), p.start[mine].tolist(), p.end[mine].tolist()))
        return [list(interval) for interval in self._opened[rank]]

    def plan(self, tolerance: float, give_up=None) -> Plan | None:
        num_ranks, servers, window = self.pieces.num_ranks, self.servers, self.window
        load = self.load + self.base  # pairs, plus the other work when base_pairs is given
        total, tb, margin = load.sum(), self.config.token_bytes, PLANNING_MARGIN * tolerance
        # What a server donor may keep above the cap, and the room not worth filling: a tenth of the
        # margin between the planning cap and the guarantee (so the guarantee still holds).
        carver = _Carver(self.config.block, tb.q + tb.o, tb.kv, 0.1 * max(tolerance - margin, 0.0) * total / len(servers),
                         window)
        # Plan to a cap a little inside the tolerance, so that the rare block that cannot be placed
        # exactly still lands within it. Tolerance 0 asks for the tightest balance the blocks allow: 0.1%
        # above the mean, at most half the one block of the longest document the guarantee allows.
        if tolerance == 0 and total > 0:
            margin = min(1e-3, 0.5 * carver.block_pairs(self.longest) * len(servers) / total)
        cap = (1.0 + margin) * total / len(servers)
        excess = load - np.where(self.is_server, cap, 0.0)
        donors = [int(r) for r in np.lexsort((np.arange(num_ranks), -excess)) if excess[r] > 0]
        if not donors:
            return colocated_plan(self.pieces, servers, window=window)
        shedder = _Shedder(self, cap, carver, (1.0 + tolerance) * total / len(servers))  # the guarantee: its bound
        if give_up is not None:
            shedder.watch(CarvingProgress(shedder, tolerance), give_up)
            if give_up(shedder.progress):
                return None
        # Pass 1: donors, largest excess first, fill the servers with the most room. A room smaller than
        # the donor's smallest shard is overfilled by less than one block rather than wasted...
        for donor in donors:
            shedder.shed(donor, float(excess[donor]), overfill=True)
            if shedder.given_up:
                return None
        # ...and pass 2 trims every overfilled server with its own finest local work.
        over = np.asarray(shedder.served) - cap
        for server in [int(r) for r in np.lexsort((np.arange(num_ranks), -over)) if over[r] > 1e-9 * cap]:
            shedder.shed(server, float(shedder.served[server] - cap), overfill=False)
            if shedder.given_up:
                return None
        return shedder.plan()


class _Shedder:
    """State of one planning: server loads, each opened rank's carvable intervals, the tasks."""

    def __init__(self, layout: _Layout, cap: float, carver: "_Carver", bound: float):
        self.layout, self.cap, self.carver, self.bound = layout, cap, carver, bound
        self.is_server = layout.is_server.tolist()
        # pairs each rank computes so far, plus its base (Python floats: scalar math is hot)
        self.served = (layout.load + layout.base).tolist()
        self.was_donor = np.zeros(len(self.served), dtype=bool)
        self.prefix_holders = layout.grouped()[2]
        self.intervals: dict[int, list[list[int]]] = {}
        self.out = _TaskList()
        self.progress, self.give_up, self.given_up = None, None, False
        self.heap = [(-(cap - self.served[r]), r) for r in layout.servers if cap - self.served[r] > 0]
        heapq.heapify(self.heap)

    def _room(self, rank: int) -> float:
        return self.cap - self.served[rank] if self.is_server[rank] else 0.0

    def _open(self, rank: int) -> list[list[int]]:
        """The rank's own pieces as intervals, latest document positions first (most pairs per byte)."""
        if rank not in self.intervals:
            self.intervals[rank] = self.layout.intervals(rank)
        return self.intervals[rank]

    def watch(self, progress: CarvingProgress, give_up) -> None:
        """Ask ``give_up(progress)`` after every transfer (``tolerance_plans``)."""
        self.progress, self.give_up = progress, give_up

    def _roomiest(self, exclude: int):
        """The server with the most room (lazy heap: stale entries are dropped as they surface)."""
        heap, served, cap = self.heap, self.served, self.cap
        skipped, found = [], None
        while heap:
            neg_room, r = heap[0]
            room = cap - served[r]  # only servers enter the heap
            if -neg_room != room or room <= 0:
                heapq.heappop(heap)
                continue
            if r == exclude:
                skipped.append(heapq.heappop(heap))
                continue
            found = r
            break
        for item in skipped:
            heapq.heappush(heap, item)
        return found

    def _prefer_prefix_holder(self, donor: int, intervals, want: float, roomiest: int) -> int:
        """The receiver of the donor's next shard: ``roomiest``, unless a server that ties with it
        already holds part of the shard's K/V prefix; then the one holding the most of it.

        The next shard ``[a, b)`` is cut from the interval ``[lo, hi)`` of document ``d`` that the
        carver takes first, and needs the K/V prefix ``[0, b)``. Another rank's piece of ``d`` that
        starts before ``lo`` lies wholly inside that prefix (a document's pieces tile it), so its
        holder is sent ``end - kv_start`` fewer K/V tokens per piece than a server holding nothing.

        *Equal balance*: a server ties with ``roomiest`` when its room (pairs) is at least what the
        roomiest would take in this step, ``min(want, room(roomiest))``, less the carver's
        ``slack`` (the room it already treats as full). Either choice then moves the same pairs out
        of the donor, up to that slack, and keeps every server within the cap. Among tying holders
        the most K/V held wins, then the most room, then the lowest rank (deterministic)."""
        best_room = self._room(roomiest)
        d, lo = intervals[self.carver.next_interval(intervals, want, best_room)][:2]
        held = self.prefix_holders.held_before(d, lo, donor)
        if not held:  # nobody else holds any of this prefix (most documents live on one rank)
            return roomiest
        tie_room = min(want, best_room) - self.carver.slack
        best, best_key = roomiest, (0, best_room, -roomiest)
        for rank, tokens in held.items():
            room = self._room(rank)
            if room > 0 and room >= tie_room and (tokens, room, -rank) > best_key:
                best, best_key = rank, (tokens, room, -rank)
        return best

    def _overfill_target(self, donor: int) -> int:
        """The server within the cap whose load after trimming would be lowest: a rank that was
        never a donor can still give away all of its own work in the second pass; a former donor
        cannot."""
        trimmable = np.where(self.was_donor, 0.0, self.layout.load)
        served, is_server = np.asarray(self.served), self.layout.is_server
        # Only servers still within both the cap and the guarantee (at tolerance 0 the cap lies above
        # it), so none ends more than one block past the guarantee, however often it is overfilled.
        # One always is: the servers other than the donor hold less than the total, so one is below
        # the mean, which both bounds exceed.
        eligible = is_server & (served <= min(self.cap, self.bound))
        eligible[donor] = False
        return int(np.argmin(np.where(eligible, served - trimmable, np.inf)))

    def shed(self, donor: int, need: float, overfill: bool) -> None:
        """Move about ``need`` pairs of ``donor``'s own work to servers with room: at most ``need``
        plus one block of pairs (``_Carver.move``), less ``slack`` on a server."""
        self.was_donor[donor] = True
        intervals = self._open(donor)
        must_empty = not self.is_server[donor]
        keep = 0.0 if must_empty else self.carver.slack
        served, heap = self.served, self.heap
        while need > keep and intervals:
            receiver = self._roomiest(exclude=donor)
            if receiver is None:
                if not must_empty:
                    return  # pass 2: what no room can take (under one block) stays
                receiver = min(self.layout.servers, key=served.__getitem__)  # the least loaded (lowest rank on ties)
            else:
                receiver = self._prefer_prefix_holder(donor, intervals, need - keep, receiver)
            budget = max(self._room(receiver), 0.0)
            first_row = len(self.out.rows)
            moved = self.carver.move(intervals, need - keep, budget, donor, receiver, self.out)
            if moved == 0:
                if not (overfill or must_empty):
                    return
                # No room fits one block: overfill the rank that can best trim itself in the
                # second pass. One block of the latest interval holds at most block * end pairs.
                receiver = self._overfill_target(donor)
                # ...by at most one block beyond the guarantee (not the planning cap, which tolerance 0 puts above it)
                room = min(self._room(receiver), self.bound - served[receiver])
                budget = max(room, 0.0) + self.carver.block_pairs(intervals[0][2])
                moved = self.carver.move(intervals, need - keep, budget, donor, receiver, self.out)
                if moved == 0:
                    return  # not one pair left to move (what remains of need is float rounding)
            need -= moved
            served[receiver] += moved
            served[donor] -= moved
            for r in (receiver, donor):  # a donor that shed below the cap can receive later
                room = self._room(r)
                if room > 0:
                    heapq.heappush(heap, (-room, r))
            if self.give_up is not None and len(self.out.rows) > first_row:
                self.progress.moved = self.out.rows[first_row:]
                if self.give_up(self.progress):
                    self.given_up = True
                    return

    def plan(self) -> Plan:
        layout = self.layout
        p = layout.pieces
        opened = np.zeros(p.num_ranks, dtype=bool)
        opened[list(self.intervals)] = True
        keep = ~opened[p.rank] & (p.end > p.start)
        self.out.extend_local(p.rank[keep], p.doc[keep], p.start[keep], p.end[keep])
        rows = self.out.rows
        for rank, intervals in self.intervals.items():
            rows.extend([(rank, rank, d, s, e) for d, s, e in intervals])
        return self.out.to_plan(p.num_ranks, layout.servers, layout.window)


class _PrefixHolders:
    """Who holds which K/V tokens of the documents that span ranks (``DocumentPieces.spanning_holders``);
    any other document has no holder but its donor."""

    def __init__(self, pieces: DocumentPieces, window=None):
        self.window = window
        self.holders = pieces.spanning_holders()

    def held_before(self, doc: int, position: int, donor: int) -> dict[int, int]:
        """``{rank: K/V tokens}`` that ranks other than ``donor`` hold of ``doc`` in pieces ending at
        or before ``position`` (empty for a document on one rank); under a sliding window only those
        from ``key_start(position)`` on, the most a shard starting at ``position`` or later needs."""
        held: dict[int, int] = {}
        first = key_start(position, self.window)
        for rank, kv_start, end in self.holders.get(doc, ()):
            if end <= position and rank != donor and end > max(kv_start, first):
                held[rank] = held.get(rank, 0) + end - max(kv_start, first)
        return held


def colocated_plan(pieces: DocumentPieces, servers=None, *, window=None) -> Plan:
    """Every piece's queries computed on the rank that holds them (no query moves; the K/V of a
    document spanning ranks still has to reach its later pieces). ``window``: as ``PlannerConfig``'s."""
    servers = tuple(range(pieces.num_ranks)) if servers is None else servers
    order = lexsort_ints((pieces.start, pieces.doc, pieces.rank))
    order = order[pieces.end[order] > pieces.start[order]]  # a key-only piece holds no work
    r = pieces.rank[order]
    return Plan(r, r.copy(), pieces.doc[order], pieces.start[order], pieces.end[order], pieces.num_ranks, servers,
                window)


class _TaskList:
    """Accumulates tasks: numpy blocks for the untouched pieces, Python ``(source, server, doc,
    start, end)`` rows (``rows``, appended to directly) for carved ones."""

    def __init__(self):
        self.blocks: list[tuple[np.ndarray, ...]] = []
        self.rows: list[tuple[int, int, int, int, int]] = []

    def extend_local(self, rank, doc, start, end):
        self.blocks.append((rank, rank, doc, start, end))

    def to_plan(self, num_ranks, servers, window=None) -> Plan:
        """The tasks as a ``Plan``, sorted by server, source, document and start."""
        cols = [np.concatenate([b[i] for b in self.blocks]) if self.blocks else np.zeros(0, np.int64) for i in range(5)]
        if self.rows:
            extra = np.asarray(self.rows, dtype=np.int64).T
            cols = [np.concatenate((c, x)) for c, x in zip(cols, extra)]
        source, server, doc, q_start, q_end = cols
        order = lexsort_ints((q_start, doc, source, server))
        return Plan(*(c[order] for c in cols), num_ranks, servers, window)


class _Carver:
    """Cuts shards out of a donor's intervals ``[doc, lo, hi]`` (latest positions first).

    Cut points lie a multiple of ``block`` tokens from the start of the interval's original piece,
    so every shard is a multiple of ``block`` long except one that ends at a piece's end. ``q_o``
    and ``kv`` are wire bytes per token (query out + output back; K and V); ``window``: the sliding
    window pairs and K/V ranges are counted under (``None``: full causal)."""

    def __init__(self, block: int, q_o: int, kv: int, slack: float = 0.0, window: int | None = None):
        self.block, self.q_o, self.kv, self.slack, self.window = block, q_o, kv, slack, window

    def block_pairs(self, end: int) -> int:
        """The most pairs one block of queries ending at ``end`` holds."""
        return self.block * (end if self.window is None else min(end, self.window))

    def shard_bytes(self, a: int, b: int) -> int:
        """Wire bytes of moving the shard ``[a, b)``: queries out, outputs back, its K/V range."""
        return (b - a) * self.q_o + (b - key_start(a, self.window)) * self.kv

    def next_interval(self, intervals, want: float, allowed: float) -> int:
        """Index of the interval the next shard is cut from: the latest (most pairs per byte), or the
        one that ends earliest when less than a block of the latest is wanted or fits (a block
        there holds the fewest pairs)."""
        return len(intervals) - 1 if min(want, allowed) < self.block_pairs(intervals[0][2]) else 0

    def move(self, intervals, need: float, budget: float, donor: int, receiver: int, out: _TaskList) -> float:
        """Move about ``need`` pairs, never more than ``budget``, from ``intervals`` (kept sorted by
        end, latest first) to ``receiver``; returns the pairs moved (at most ``need`` plus one block
        of pairs, ``block_pairs``, and never more than ``budget``)."""
        moved = 0.0
        window, slack, add = self.window, self.slack, out.rows.append  # the planner's hottest loop
        while intervals and moved < need:
            want, allowed = need - moved, budget - moved
            if moved and allowed <= slack:
                break  # the receiver is as good as full: the next one has more room
            i = self.next_interval(intervals, want, allowed)
            d, lo, hi = intervals[i]
            whole = causal_pairs(lo, hi, window)
            if whole <= allowed and whole <= want + self.block_pairs(hi):
                add((donor, receiver, d, lo, hi))
                intervals.pop(i)
                moved += whole
                continue
            shard = self._shard(lo, hi, want, allowed)
            if shard is None:
                break
            a, b = shard
            add((donor, receiver, d, a, b))
            moved += causal_pairs(a, b, window)
            if b < hi:
                intervals[i] = [d, b, hi]  # same end: the order by end is kept
            else:
                intervals.pop(i)
            if a > lo:
                bisect.insort(intervals, [d, lo, a], key=_neg_end)
        return moved

    def _aligned_up(self, lo: int, x: float, hi: int) -> int:
        """Smallest cut point >= x: lo + k * block, or hi."""
        return min(hi, lo + max(0, math.ceil((x - lo) / self.block)) * self.block)

    def _shard(self, lo: int, hi: int, want: float, budget: float):
        """A shard ``[a, b)`` inside ``[lo, hi)`` with about ``want`` pairs (never more than
        ``budget``), at the cut points that move the fewest bytes per pair."""
        want = min(want, budget)
        # Candidate ends: the interval's end (a tail shard), the byte-optimal end, and the end of a
        # head shard starting at lo. Full causal: for P pairs and width w the bytes are
        # w (q + o) + b kv with b = P / w + w / 2, smallest at w = sqrt(P kv / (q + o + kv / 2)).
        # Under a window a shard past the window's reach holds `window` pairs per query and needs
        # w + window - 1 K/V tokens: the widest (the tail) moves the fewest bytes per pair; the
        # candidates are compared on their exact bytes (shard_bytes) either way.
        width = math.sqrt(want * self.kv / (self.q_o + self.kv / 2)) if self.kv else float(hi - lo)
        ideal_end = want / max(width, 1.0) + width / 2
        if ideal_end >= hi:  # the byte-optimal shard would end past the interval: take its tail
            a = self._start_for(lo, hi, want, budget)
            return None if a is None else (a, hi)
        head_end = end_with_pairs(lo, want, self.window)
        best, best_key = None, None
        ends = (hi, self._aligned_up(lo, ideal_end, hi), self._aligned_up(lo, head_end, hi))
        for k, b in enumerate(ends):
            if b <= lo or b in ends[:k]:  # an end seen before gives the same shard again
                continue
            a = self._start_for(lo, b, want, budget)
            if a is None:
                continue
            got = causal_pairs(a, b, self.window)
            key = (got < want - self.block_pairs(b), self.shard_bytes(a, b) / got)
            if best_key is None or key < best_key:
                best, best_key = (a, b), key
        return best

    def _start_for(self, lo: int, b: int, want: float, budget: float):
        """The cut point ``a`` in ``[lo, b)`` whose shard ``[a, b)`` is the smallest holding at least
        ``want`` pairs, moved up while it exceeds ``budget``; ``None`` if no shard fits."""
        block = self.block
        w = self.window
        a = lo + max(0, math.ceil((start_with_pairs(b, budget, w) - lo) / block)) * block  # pairs <= budget
        if want < budget:
            a = max(a, lo + max(0, math.floor((start_with_pairs(b, want, w) - lo) / block)) * block)
        while a < b and causal_pairs(a, b, w) > budget:  # float rounding: at most a step or two
            a += block
        return a if a < b else None


def _neg_end(interval) -> int:
    return -interval[2]
