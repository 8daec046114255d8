"""Key-split tiles chosen by time (issue 21 item 2): queries travel to the K/V only where the time
model says it pays. Pure numpy.

Tiles chosen by bytes alone would put every full tile of a long document on the holder of its keys,
piling compute there (measured with such a rule, since removed: a pipeline tick at 64 ranks x 64k
with a 333k-token document, 221 ms -> 1066 ms predicted). ``apply_time_tiles`` starts from a plan of whole
CA-tasks and converts, greedily, one *unit* at a time: a (server ``s``, document, holder piece ``p``
held by rank ``h != s``) whose K/V ``s`` receives for its tasks of the document. Converting it gives
each of those tasks a full tile ``[a, b) x p`` served by ``h``, which holds those keys:

- ``s`` no longer receives ``p``'s K/V and computes ``(b - a) |p|`` fewer pairs per task;
- ``h`` no longer sends them, computes those pairs and runs one more kernel task per tile, receives
  the tasks' queries and returns a partial output with its log-sum-exp (``q`` in, ``o + lse`` out per
  query token, unless ``h`` is the queries' own rank);
- the queries' rank sends them to ``h`` as well and receives the partial.

Each unit's effect on every rank's pairs, keys, tasks and bytes is fixed (K/V are sent once per
(holder, server, document), so a unit owns its transfer); the greedy takes the slowest rank under
the time model (``rank_time.loads_seconds``, the formula ``by_time`` judges plans with, other work
such as ``base_pairs`` included, both ends of every link) and applies the unit touching it that
lowers the predicted maximum most (a unit that leaves the maximum equal while lowering that rank,
when ranks tie), and stops when no unit lowers it. A unit is eligible only when no task of ``s`` that stays
whole needs ``p``'s keys (the queries inside ``p`` or before it) and, under a sliding window, when
every earlier piece of each of its tasks lies inside all of the task's windows (``check_tiles``'
full-tile shape). The result is judged exactly (``transfers.rank_bytes`` of the tiled plan, which
also counts the log-sum-exp every partial output of a key-split plan returns with) and returned only
when its predicted slowest rank is faster than the input's; otherwise the input comes back.

``apply_memory_tiles`` converts units for memory instead of time: where a rank would hold more than
``memory_budget`` allows (``transfers.BackwardMemory.fits``), it stops receiving a holder's piece
(``kv`` bytes per key) and the holder keeps the unit's queries (``q`` per query row), as long as the
holder stays within; ``by_time`` weighs the result against ``resend`` mode.

Not done: a full tile served by a third, lightly loaded rank that holds none of the keys (it would
receive the piece's K/V once and the queries); the holder or the server only.
"""

from __future__ import annotations

import itertools

import numpy as np

from .baselines import RankLoads
from .carving import Plan, PlannerConfig
from .cost import TokenBytes, causal_pairs, key_start
from .key_split import check_tiles, task_tiles, with_key_ranges
from .pieces import DocumentPieces
from .ranges import concat_ranges
from .rank_time import loads_seconds, other_seconds, plan_loads, rank_seconds
from .transfers import BackwardMemory, backward_memory, kv_received, kv_transfers, memory_limit

__all__ = ["apply_time_tiles", "apply_memory_tiles", "memory_tiles_lower_bound", "memory_tiles_may_fit", "tile_units"]


def _rank_seconds(config: PlannerConfig, backward: str, other, pairs, tasks, keys, sent, received):
    """``rank_time.loads_seconds``' compute + exposed communication of ranks whose other work is
    ``other`` (seconds), in a plan that moves something (``collective_s`` counted), elementwise over
    rank arrays."""
    compute, exposed = loads_seconds(RankLoads(None, pairs, keys, tasks, sent, received), config.time_model,
                                     config.exposed_comm, backward, other_s=other, moves=True)
    return compute + exposed


def tile_units(plan: Plan, pieces: DocumentPieces):
    """The eligible units of a plan of whole CA-tasks (module docstring): a list of
    ``(server, doc, piece_start, piece_end, holder, tasks)`` sorted by server, document and piece,
    ``tasks`` the indices into ``plan`` (ascending) whose keys include the piece."""
    w = plan.window
    several = np.bincount(pieces.doc)[pieces.doc] > 1 if pieces.num_pieces else np.zeros(0, dtype=bool)
    if not several.any():
        return []
    # the pieces of spanning documents by (document, position): K/V [x0, x1) on rank h
    order = np.lexsort((pieces.kv_start[several], pieces.doc[several]))
    p_doc, p_x0, p_x1, p_rank = (x[several][order] for x in (pieces.doc, pieces.kv_start, pieces.end, pieces.rank))
    # every (task of a spanning document, piece of that document) pair
    task = np.flatnonzero(np.isin(plan.doc, p_doc))
    lo = np.searchsorted(p_doc, plan.doc[task], side="left")
    counts = np.searchsorted(p_doc, plan.doc[task], side="right") - lo
    pair_task = np.repeat(task, counts)
    piece = concat_ranges(lo, counts)
    a, b, s = plan.q_start[pair_task], plan.q_end[pair_task], plan.server[pair_task]
    k0 = key_start(a, w)
    x0, x1, h = p_x0[piece], p_x1[piece], p_rank[piece]
    # each task's own piece (holding its first query) starts at `own`; the pieces wholly before it are
    # "earlier", and a task can split when it has some and (under a window) the first lies inside
    # every query's window
    own = np.full(plan.num_tasks, np.iinfo(np.int64).max)
    holds = (x0 <= a) & (a < x1)
    own[pair_task[holds]] = x0[holds]
    earlier = (x1 > k0) & (x1 <= own[pair_task])
    splittable = np.zeros(plan.num_tasks, dtype=bool)
    splittable[pair_task[earlier]] = True
    if w is not None:
        first = np.full(plan.num_tasks, np.iinfo(np.int64).max)
        np.minimum.at(first, pair_task[earlier], np.maximum(x0, k0)[earlier])
        splittable &= first >= plan.q_end - w
    needed = (h != s) & (x1 > k0) & (x0 < b)  # the server receives some of the piece's keys for the task
    in_pool = np.zeros(plan.num_ranks, dtype=bool)  # a holder outside the server pool serves no tile
    in_pool[list(plan.servers)] = True
    ok = needed & earlier & splittable[pair_task] & in_pool[h]
    key = (s * (int(p_doc.max()) + 1) + plan.doc[pair_task]) * (int(p_x1.max()) + 1) + x0
    blocked = np.unique(key[needed & ~ok])  # a task that stays whole keeps needing them
    ok &= ~np.isin(key, blocked)
    pick = np.flatnonzero(ok)
    pick = pick[np.lexsort((pair_task[pick], key[pick]))]
    if not pick.size:
        return []
    bounds = np.flatnonzero(np.concatenate(([True], key[pick][1:] != key[pick][:-1], [True])))
    first = pick[bounds[:-1]]  # each unit's first (task, piece) pair
    tasks = pair_task[pick].tolist()  # (Python lists from here: a unit's tasks are a slice)
    heads = zip(s[first].tolist(), plan.doc[pair_task[first]].tolist(), x0[first].tolist(), x1[first].tolist(),
                h[first].tolist(), bounds[:-1].tolist(), bounds[1:].tolist())
    return [(server, doc, start, end, holder, tasks[lo:hi]) for server, doc, start, end, holder, lo, hi in heads]


def _earlier_segments(plan: Plan, pieces: DocumentPieces, tasks) -> dict:
    """``{task: [(k0, k1, holder, piece_start), ...]}``: the pieces wholly before each task's own
    piece, clipped to its keys, by position."""
    w, holders, out = plan.window, {}, {}
    tasks = np.asarray(tasks, dtype=np.int64)
    docs, starts = plan.doc[tasks].tolist(), plan.q_start[tasks].tolist()
    mine = np.flatnonzero(np.isin(pieces.doc, docs))  # the pieces of these documents, in one pass
    for d, x0, x1, h in zip(pieces.doc[mine].tolist(), pieces.kv_start[mine].tolist(), pieces.end[mine].tolist(),
                            pieces.rank[mine].tolist()):
        holders.setdefault(d, []).append((x0, x1, h))
    for held in holders.values():
        held.sort()
    for i, d, a in zip(tasks.tolist(), docs, starts):
        k0 = key_start(a, w)
        own = next(x0 for x0, x1, h in holders[d] if x0 <= a < x1)
        out[i] = [(max(x0, k0), x1, h, x0) for x0, x1, h in holders[d] if k0 < x1 <= own]
    return out


def apply_time_tiles(plan: Plan, pieces: DocumentPieces, config: PlannerConfig, *, judge: bool = True) -> Plan:
    """``plan`` with key-split tiles where the time model predicts they pay (module docstring), or
    ``plan`` itself when none does (and for a plan that already splits keys). Deterministic; never
    predicted slower than ``plan`` (``rank_time.step_seconds``, in ``plan.backward``'s mode).
    ``judge=False`` skips that final exact comparison (``by_time`` judges every candidate itself)."""
    if plan.splits_keys or plan.num_tasks == 0:
        return plan
    base = with_key_ranges(plan)
    tb, backward = config.token_bytes, plan.backward
    returned = tb.o + tb.lse
    transfers = kv_transfers(base, pieces)
    if not transfers.source.size:
        return plan
    own = plan_loads(base, pieces, tb, transfers)
    loads = np.stack([other_seconds(own.tokens, config), own.pairs, own.tasks, own.keys, own.sent,
                      own.received]).astype(np.float64)  # [6, ranks]: other work (s), pairs, tasks, keys, sent, received
    seconds = _rank_seconds(config, backward, *loads)
    slowest = int(np.argmax(seconds))
    if not ((transfers.source == slowest).any() or (transfers.server == slowest).any()):
        return plan  # no unit touches the slowest rank: none can make it faster (most balanced plans)
    units = tile_units(plan, pieces)
    if not units:
        return plan
    sent_kv: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
    for src, srv, d, start, end in zip(*(x.tolist() for x in (transfers.source, transfers.server, transfers.doc,
                                                             transfers.start, transfers.end))):
        sent_kv.setdefault((src, srv, d), []).append((start, end))

    effects: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def effect(u: int) -> tuple[np.ndarray, np.ndarray]:
        """Unit ``u``'s fixed effect (ranks ``[k]``, deltas ``[6, k]``), made when first asked for."""
        if u in effects:
            return effects[u]
        s, d, x0, x1, h, tasks = units[u]
        delta: dict[int, np.ndarray] = {}

        def at(rank):
            if rank not in delta:
                delta[rank] = np.zeros(6)
            return delta[rank]

        kv = sum(max(0, min(e, x1) - max(st, x0)) for st, e in sent_kv.get((h, s, d), ())) * tb.kv
        at(s)[5] -= kv
        at(h)[4] -= kv
        for i in tasks:
            a, b, src = int(plan.q_start[i]), int(plan.q_end[i]), int(plan.source[i])
            width = x1 - max(x0, key_start(a, plan.window))
            queries = b - a
            at(s)[1] -= queries * width
            at(s)[3] -= width
            at(h)[1] += queries * width
            at(h)[3] += width
            at(h)[2] += 1
            if src != h:
                at(src)[4] += queries * tb.q
                at(h)[5] += queries * tb.q
                at(h)[4] += queries * returned
                at(src)[5] += queries * returned
        ranks = np.fromiter(sorted(delta), dtype=np.int64)
        effects[u] = (ranks, np.stack([delta[r] for r in ranks.tolist()], axis=1))
        return effects[u]

    touching: dict[int, list[int]] = {}
    for u, (s, d, x0, x1, h, tasks) in enumerate(units):
        touching.setdefault(s, []).append(u)
        touching.setdefault(h, []).append(u)
    applied = np.zeros(len(units), dtype=bool)
    while True:
        r = int(np.argmax(seconds))
        worst = float(seconds[r])
        candidates = [u for u in touching.get(r, ()) if not applied[u]]
        if not candidates:
            break
        made = [effect(u) for u in candidates]
        sizes = np.fromiter((m[0].size for m in made), dtype=np.int64, count=len(made))
        ranks = np.concatenate([m[0] for m in made])
        new = _rank_seconds(config, backward, *(loads[:, ranks] + np.concatenate([m[1] for m in made], axis=1)))
        starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        mine = new[ranks == r]  # every candidate touches r once
        highest = np.maximum.reduceat(new, starts)
        top = np.argsort(-seconds, kind="stable")[:int(sizes.max()) + 1].tolist()
        best, best_key = None, (worst, worst)
        for c in np.flatnonzero(mine < worst).tolist():
            inside = set(ranks[starts[c]:starts[c] + sizes[c]].tolist())
            others = next((float(seconds[t]) for t in top if t not in inside), 0.0)
            key = (max(others, float(highest[c])), float(mine[c]))
            if key < best_key:
                best, best_key = candidates[c], key
        if best is None:
            break
        ranks, change = effect(best)
        loads[:, ranks] += change
        seconds[ranks] = _rank_seconds(config, backward, *loads[:, ranks])
        applied[best] = True
    if not applied.any():
        return plan
    tiled = _with_units(base, plan, pieces, units, applied)
    if not judge or rank_seconds(tiled, pieces, config).max() < rank_seconds(plan, pieces, config).max():
        return tiled
    return plan


def _tiled_plan(base: Plan, segments: dict, converted: set, touched) -> Plan:
    """``base`` (explicit key ranges) with every task's converted pieces as full tiles on their
    holders: kept pieces next to the causal tile join it, other kept ones are full tiles on the server,
    adjacent tiles on one rank one tile (``key_split.task_tiles``). ``touched``: the
    tasks of the converted units (the others stay as they are)."""
    columns = (base.source, base.server, base.doc, base.q_start, base.q_end, base.k_start, base.k_end)
    touched = np.unique(np.asarray(touched, dtype=np.int64))
    keep = np.ones(base.num_tasks, dtype=bool)
    keep[touched] = False
    rows = []
    for i, task in zip(touched.tolist(), zip(*(c[touched].tolist() for c in columns))):
        server, doc = task[1], task[2]
        earlier = segments[i]
        where = [(x0, x1, h if (server, doc, piece) in converted else server) for x0, x1, h, piece in earlier]
        rows.extend(task_tiles(task, earlier[-1][1], where))
    new = np.asarray(rows, dtype=np.int64).reshape(-1, 7).T
    arr = [np.concatenate((c[keep], extra)) for c, extra in zip(columns, new)]
    order = np.lexsort((arr[5], arr[3], arr[2], arr[0], arr[1]))
    source, server, doc, q_start, q_end, ks, ke = (c[order] for c in arr)
    tiled = Plan(source, server, doc, q_start, q_end, base.num_ranks, base.servers, base.window, base.backward, ks, ke)
    check_tiles(tiled)
    return tiled


def apply_memory_tiles(plan: Plan, pieces: DocumentPieces, token_bytes: TokenBytes, budget: float, *,
                       config: PlannerConfig | None = None, give_up_at: float = np.inf, transfers=None) -> Plan:
    """``plan`` (whole CA-tasks, ``saved`` mode) with key-split tiles that bring the ranks over the
    memory ``budget`` (``BackwardMemory.fits``) within it, where tiles can: a rank over the limit
    stops receiving a holder's piece of a document (a unit, module docstring) and the holder keeps
    the unit's queries instead (``q`` bytes per query row of a tile, ``transfers.backward_memory``),
    so K/V that would pile on one server stay spread over the ranks that hold them.

    Greedy: the rank furthest over the limit takes the unit that drops the most of its received
    K/V among those whose holder stays within the limit (a server's units of a document in key
    order, so the pieces it keeps stay one run with its causal tile) (the limit is
    ``transfers.memory_limit`` of the mean held, which every unit changes: recomputed each time); a rank no
    unit helps is left as it is.
    The plan comes back with explicit key ranges whether or not a unit was applied (a key-split
    plan's servers keep only the queries, no outputs: ``transfers.backward_memory``; without the
    units when they would leave the worst rank holding more, counted exactly), or unchanged
    for a plan that already splits keys or runs in ``resend`` mode. It may still exceed the budget
    (``by_time`` then runs the step in ``resend`` mode); it is not timed here (``by_time`` judges it
    against the ``resend`` plan), except that with ``config`` (its time model) ``plan`` comes back
    unchanged, the tiles not built, when the units chosen are sure to be predicted no faster than
    ``give_up_at`` seconds (a lower bound on their plan's step reaches it, ``memory_tiles_lower_bound``
    counted with those units: ``by_time`` passes the step the tiles must beat) and the plan with key
    ranges alone (what comes back when the units would leave the worst rank holding more) is over the
    budget: neither could be kept; so too, with ``config``, where no units could bring it within the
    budget (``memory_tiles_may_fit``; ``by_time`` keeps only tiles within it). ``transfers``:
    ``plan``'s ``kv_transfers``, when in hand."""
    if plan.splits_keys or plan.num_tasks == 0 or plan.backward != "saved":
        return plan
    base = with_key_ranges(plan)
    # (without a window every task's key range is its whole prefix: the union is the hull, the same transfers)
    if transfers is None or plan.window is not None:
        transfers = kv_transfers(base, pieces)
    received = kv_received(transfers, plan.num_ranks)
    memory = backward_memory(base, pieces, token_bytes, backward="saved", received=received)
    held = memory.held.astype(np.float64)
    total, n = float(held.sum()), held.size

    def limit(total_held: float) -> float:
        return memory_limit(budget, total_held / n, float(memory.floor)) * (1 + 1e-12)

    if held.max(initial=0.0) <= limit(total):
        return base
    base_over = held.max(initial=0.0) > limit(total) * (1 + 1e-9)  # base sure not to fit either (give_up_at)
    units = tile_units(plan, pieces)
    if config is not None and base_over and not _units_may_fit(plan, pieces, token_bytes, budget, memory, received,
                                                               units):
        return plan  # no tiles bring it within the budget, nor does base: by_time could keep neither
    sent_kv: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
    for src, srv, d, start, end in zip(*(x.tolist() for x in (transfers.source, transfers.server, transfers.doc,
                                                             transfers.start, transfers.end))):
        sent_kv.setdefault((src, srv, d), []).append((start, end))
    by_server: dict[int, list[int]] = {}
    earlier_unit: dict[int, int] = {}  # unit -> the unit of the same (server, document) just before it
    for u, unit in enumerate(units):
        by_server.setdefault(unit[0], []).append(u)
        if u and units[u - 1][:2] == unit[:2]:
            earlier_unit[u] = u - 1

    changes: dict[int, tuple[float, float]] = {}
    rows = (plan.q_end - plan.q_start).tolist()

    def change(u: int) -> tuple[float, float]:
        """``(K/V bytes the unit's server stops receiving, query bytes its holder keeps)`` (a unit's
        are fixed: counted once)."""
        known = changes.get(u)
        if known is None:
            s, d, x0, x1, h, tasks = units[u]
            drop = sum(max(0, min(e, x1) - max(st, x0)) for st, e in sent_kv.get((h, s, d), ())) * token_bytes.kv
            known = changes[u] = (float(drop), float(sum(rows[i] for i in tasks) * token_bytes.q))
        return known

    applied = np.zeros(len(units), dtype=bool)
    stuck = np.zeros(n, dtype=bool)
    while True:
        # the rank furthest over the limit, ties to the lowest (argmax: the first of the maxima)
        over = np.where((held > limit(total)) & ~stuck, held, -np.inf)
        r = int(np.argmax(over)) if n else 0
        if not n or over[r] == -np.inf:
            break
        best, best_key = None, None
        for u in by_server.get(r, ()):
            # in key order: the pieces a server keeps then stay one run joined to its causal tile (a
            # kept piece before a converted one would be one more tile, its queries kept again)
            if applied[u] or (u in earlier_unit and not applied[earlier_unit[u]]):
                continue
            drop, add = change(u)
            h = units[u][4]
            if drop <= 0 or held[h] + add > limit(total - drop + add):
                continue
            key = (-drop, add, u)
            if best_key is None or key < best_key:
                best, best_key = u, key
        if best is None:
            stuck[r] = True
            continue
        drop, add = change(best)
        held[r] -= drop
        held[units[best][4]] += add
        total += add - drop
        applied[best] = True
    if not applied.any():
        return base
    if (config is not None and base_over
            and _tiles_lower_bound(plan, pieces, config, units, applied) >= give_up_at * (1 + 1e-9)):
        return plan  # the tiled plan sure to lose (a hair above: sums in another order), and base not to fit
    tiled = _with_units(base, plan, pieces, units, applied)
    # the counts above are per unit; a task's tiles are what the memory formula counts, exactly: the
    # worst rank never ends worse off (a server's own earlier piece kept apart from its causal tile
    # would be one more tile)
    exact = backward_memory(tiled, pieces, token_bytes, backward="saved")
    return tiled if exact.held.max(initial=0) <= memory.held.max(initial=0) else base


def _with_units(base: Plan, plan: Plan, pieces: DocumentPieces, units, applied: np.ndarray) -> Plan:
    """``base`` with the tile units ``applied`` (a bool per unit of ``tile_units(plan, pieces)``) cut
    into key-split tiles: the tasks they touch re-made from their earlier prefix pieces."""
    done = np.flatnonzero(applied).tolist()
    touched = sorted({i for u in done for i in units[u][5]})
    return _tiled_plan(base, _earlier_segments(plan, pieces, touched), {units[u][:3] for u in done}, touched)


def memory_tiles_lower_bound(plan: Plan, pieces: DocumentPieces, config: PlannerConfig) -> float:
    """A lower bound (seconds) on the predicted step (``rank_time.step_seconds``, ``saved`` mode) of
    ``apply_memory_tiles(plan, ...)``, whatever units it converts: ``by_time`` skips the tiles where
    this cannot beat what it has in hand. ``plan``: whole CA-tasks.

    A unit only moves the keys of a piece wholly before a task's own piece (the one holding its first
    query: ``tile_units``' ``earlier``), so every task keeps on its server its pairs, keys and task
    against the keys from its own piece's start on (its causal tile), and a task away from its source
    still receives those queries and K/V from the source and sends its output back. Counted per
    rank: other work (``rank_time.other_seconds``), those pairs, keys and tasks, ``q + o`` bytes per
    moved query at both ends and, per (server, document, source), the most such keys one task needs;
    ``collective_s`` when a task is away from its source. ``-inf`` for pieces whose K/V start before
    their queries (``kv_start``: not bounded here)."""
    return _tiles_lower_bound(plan, pieces, config)


def memory_tiles_may_fit(plan: Plan, pieces: DocumentPieces, token_bytes: TokenBytes, budget: float, *,
                         transfers=None) -> bool:
    """False when no plan ``apply_memory_tiles(plan, ...)`` can return fits ``budget``
    (``BackwardMemory.fits``), whatever units it converts (the plan with key ranges alone included):
    ``by_time`` then skips the tiles, which it would refuse (plan time). ``plan``: whole CA-tasks;
    ``transfers``: its ``kv_transfers``, when in hand. True where it cannot tell.

    Sound, from the memory formula (``transfers.backward_memory``, key-split): against the plan with
    key ranges, a converted unit (``tile_units``) gives its tasks a tile (their rows) on its holder
    and drops K/V its server received. A task keeps its causal tile (keys from its own piece on) on
    its server, so no rank serves fewer rows, no rank receives K/V it did not (a holder's tiles read
    its own piece), and a server stops receiving at most its units' pieces. Every rank therefore
    holds at least its key-ranged hold less those, and the mean grows at most by the rows of one more
    tile per earlier piece of every task of a unit (``_earlier_segments``, ``key_split.task_tiles``);
    the tiled plan cannot fit when some rank's least hold passes the limit at that most mean."""
    if budget is None or plan.splits_keys or plan.num_tasks == 0:
        return True
    base = with_key_ranges(plan)
    if transfers is None or plan.window is not None:  # (as apply_memory_tiles: the same without a window)
        transfers = kv_transfers(base, pieces)
    received = kv_received(transfers, plan.num_ranks)
    memory = backward_memory(base, pieces, token_bytes, backward="saved", received=received)
    return _units_may_fit(plan, pieces, token_bytes, budget, memory, received, tile_units(plan, pieces))


def _units_may_fit(plan: Plan, pieces: DocumentPieces, token_bytes: TokenBytes, budget: float,
                   memory: BackwardMemory, received: np.ndarray, units) -> bool:
    """``memory_tiles_may_fit`` from what ``apply_memory_tiles`` has in hand: ``memory`` and
    ``received`` ([ranks] K/V tokens) of the plan with key ranges, ``units`` its ``tile_units``."""
    if not np.array_equal(pieces.kv_start, pieces.start):
        return True
    n = plan.num_ranks
    held = memory.held.astype(np.float64)
    if not units:
        return memory.fits(budget)
    # the tasks of the units, each after `earlier` pieces (its own piece's index in its document's)
    tasks = np.unique(np.fromiter(itertools.chain.from_iterable(unit[5] for unit in units), dtype=np.int64))
    first = plan.q_start[tasks]
    _, earlier = _own_pieces(pieces, plan.doc[tasks], first)
    most_mean = (held.sum() + float(((plan.q_end[tasks] - first) * earlier).sum()) * token_bytes.q) / n
    server, start, end = (np.fromiter((unit[i] for unit in units), dtype=np.int64, count=len(units)) for i in (0, 2, 3))
    dropped = np.minimum(np.bincount(server, weights=end - start, minlength=n), received) * token_bytes.kv
    least = float((held - dropped).max(initial=0.0))
    return least <= memory_limit(budget, most_mean, float(memory.floor)) * (1 + 1e-12) * (1 + 1e-9)


def _own_pieces(pieces: DocumentPieces, doc: np.ndarray, first: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(start, earlier)`` of each task's own piece, for tasks of documents ``doc`` whose first query
    is ``first`` ([tasks] each): the last nonempty piece of the document starting at or before
    ``first``, its first token and how many of the document's nonempty pieces come before it."""
    nonempty = pieces.end > pieces.start
    span = int(pieces.end.max(initial=0)) + 1
    starts = np.sort(pieces.doc[nonempty] * span + pieces.start[nonempty])
    at = np.searchsorted(starts, doc * span + first, side="right") - 1
    return starts[at] % span, at - np.searchsorted(starts, doc * span)


def _tiles_lower_bound(plan: Plan, pieces: DocumentPieces, config: PlannerConfig, units=None, applied=None) -> float:
    """``memory_tiles_lower_bound``; with the ``units`` (``tile_units(plan, pieces)``) and which are
    ``applied``, of that plan exactly: every tasks' pairs, those of the converted units on their
    holders (a full tile of the task's rows and the piece's keys), which also run a task and its keys
    per (task, holder) and receive its queries and send a partial output (``q + o + lse``) unless they
    are its source."""
    if plan.num_tasks == 0 or not np.array_equal(pieces.kv_start, pieces.start):
        return -np.inf
    tm, tb, n, window = config.time_model, config.token_bytes, plan.num_ranks, plan.window
    own, _ = _own_pieces(pieces, plan.doc, plan.q_start)
    k0 = key_start(plan.q_start, window)
    first = np.maximum(own, k0)
    keys = plan.q_end - first  # its causal tile's keys, from `first` on
    tasks, moved = np.bincount(plan.server, minlength=n).astype(np.float64), np.zeros(n)
    key_count = np.bincount(plan.server, weights=keys, minlength=n)
    if units is None:  # any units: the pairs against keys from `first` on stay
        pairs = np.bincount(plan.server, weights=causal_pairs(plan.q_start - first, plan.q_end - first, window),
                            minlength=n)
    else:
        pairs = np.bincount(plan.server, weights=causal_pairs(plan.q_start, plan.q_end, window), minlength=n)
        done = [units[u] for u in np.flatnonzero(applied).tolist()]
        # one row per (converted unit, task of it): the full tile it moves from the server to the holder
        task = np.fromiter(itertools.chain.from_iterable(unit[5] for unit in done), dtype=np.int64)
        count = [len(unit[5]) for unit in done]
        server, x0, x1, holder = (np.repeat(np.asarray([unit[i] for unit in done], dtype=np.int64), count)
                                  for i in (0, 2, 3, 4))
        width = x1 - np.maximum(x0, k0[task])
        rows = plan.q_end[task] - plan.q_start[task]
        pairs += np.bincount(holder, weights=rows * width, minlength=n) - np.bincount(server, weights=rows * width,
                                                                                     minlength=n)
        key_count += np.bincount(holder, weights=width, minlength=n)
        # a task per (task, holder), which receives its queries and sends a partial back unless its source
        tile = np.unique(task * n + holder)
        task, holder = tile // n, tile % n
        tasks += np.bincount(holder, minlength=n)
        away_tile = holder != plan.source[task]
        query_bytes = (plan.q_end - plan.q_start)[task[away_tile]] * (tb.q + tb.o + tb.lse)
        moved += np.bincount(holder[away_tile], weights=query_bytes, minlength=n) + np.bincount(
            plan.source[task[away_tile]], weights=query_bytes, minlength=n)
    compute = tm.rank_seconds(0, pairs, tasks, key_count, other_s=other_seconds(pieces.tokens(), config))
    away = np.flatnonzero(plan.source != plan.server)
    if not away.size and not moved.any():
        return float(compute.max(initial=0.0))
    source, server = plan.source[away], plan.server[away]
    queries = (plan.q_end - plan.q_start)[away] * (tb.q + tb.o)
    moved += np.bincount(source, weights=queries, minlength=n) + np.bincount(server, weights=queries, minlength=n)
    # the K/V of the own piece: its holder, the source, sends them once per (server, document)
    docs = int(plan.doc.max()) + 1
    group, at = np.unique((server * docs + plan.doc[away]) * n + source, return_inverse=True)
    most = np.zeros(group.size)
    np.maximum.at(most, at, keys[away] * tb.kv)
    moved += np.bincount(group % n, weights=most, minlength=n) + np.bincount(group // n // docs, weights=most, minlength=n)
    return float((compute + tm.comm_seconds(0, moved, config.exposed_comm, True, "saved")).max(initial=0.0))
