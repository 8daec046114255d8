"""Planning by time (``tolerance="auto"``): the plan the time model predicts fastest, colocated
included, so work moves only while the move pays.

A plan's predicted layer time (forward + backward) on rank ``r`` is ``rank_time.rank_seconds``' (the
formula's one home, shared with the descent, the tiles and ``distca-hf simulate``):

    other work: linear_s_per_token * (query tokens r holds), or PlannerConfig.base_pairs' work
    + sum over the CA-tasks r serves of task_seconds(pairs, keys)     (TimeModel.task_seconds)
    + exposed_comm * passes * (bytes r sends + bytes r receives) / bytes_per_s
    + collective_s, when anything crosses ranks

and the step is the slowest rank's. Bytes are one layer's forward (``transfers.rank_bytes``: Q out,
O back, K/V from its holder); ``passes`` (``cost.COMM_PASSES``) is 2 in ``saved`` mode (the
backward moves as many again: dO out, dQ and dK/dV back) and 3 in ``resend`` mode (q, k/v and out
travel again with dO). ``exposed_comm`` is the fraction the overlap mode does not hide. The
judges, the bounds below and the descent count ``base_pairs`` alike, so a pipeline tick's
candidates are judged with the work its ranks do besides attention.

Memory. ``memory_budget`` bounds ``memory_imbalance``: the worst rank may hold ``(1 + budget)`` x the
mean over ranks of ``transfers.backward_memory`` (``BackwardMemory.fits``). A candidate over it in
``saved`` mode is judged in ``resend`` mode instead (``transfers.fit_memory_budget``: servers keep
nothing, which always fits; more bytes, timed so) or, for colocated and the descents with
``key_split``, with the key-split tiles that bring it within (``tiles.apply_memory_tiles``: a rank
holding a late piece of a long document stops receiving an earlier piece's K/V, whose holder takes
its queries), whichever is predicted faster. When the descent's plan is over the budget, the
descent is also run within it (``descent.descend_within_memory``: no move takes a server past the
limit; counted against the unbounded plan's mean, then once more against its own when that was
too high; given up once its level passes the best candidate's step) where it can fit and win: the
colocated plan within the limit (a long document's late pieces keep their prefix's K/V whatever
the descent does) and the unbounded plan faster than the best so far; and in ``resend`` mode; and
the unbounded plan with its over-full servers' groups of tasks moved to servers with room in memory
and time (``rehome.rehome_within_memory``, up to the best step so far), which keeps ``saved`` mode
where a few servers were over (wlbllm 512 x 512k).
Under the ``kv_cap`` setting (``PlannerConfig.kv_cap``, ``baselines.kv_cap_tokens``) a candidate whose
worst server receives more K/V tokens per layer than the cap is never chosen, and the descents plan
within it; the colocated plan always fits ``"cp"`` (when ranks outside the server pool hold work and
no candidate fits, the cap is dropped for the batch: their work must move).

The candidates are the colocated plan (when every rank holding work serves), the descent's plan
(``descent.descend``: a greedy that minimises this predicted time directly, both ends of every link
counted, a long document's fan-out bounded; over the memory budget, also the descent within it and
the descent planned with ``resend``'s bytes, above) and the fixed-tolerance plans of ``AUTO_TOLERANCES``, each
exactly ``plan_tasks``' at that tolerance, and the CP-shaped plan (``zigzag.zigzag_plan``: every
document spanning ranks zigzagged over its holders as per-document CP would, the others colocated;
built only when ``zigzag.zigzag_lower_bound`` says it could win, which on the shared and untuned
samples it never does), and with ``config.key_split`` the tile grid (``tile_grid.tile_grid_plan``:
a long document that holds most of the batch's pairs cut into key-split tiles placed by time, so a
server of its late queries no longer receives its whole prefix; built only for such batches, the
1M-token one of ``examples/bench_sim.py --untuned``); the chosen one is the candidate with the smallest
predicted step (ties: colocated, the descent, the tightest tolerance, the CP-shaped plan, then the
tile grid), so
it is never predicted slower than colocated, than the fixed-tolerance plan (0.02), than CP of the
documents as packed, nor than ``auto`` before the descent (``plan_by_tolerances``, kept to measure
the change), under the same model. The descent wins
on nearly every batch of the shared samples (``make bench-sim`` prints both); the carvings stay as a
floor, and are given up early when the descent is clearly faster (below).

Key-split tiles (``config.key_split``; the runtime sets it where every layer runs the plan's window
and no chunks, ``distca-hf simulate`` always): the chosen plan is weighed once more with tiles
(``tiles.apply_time_tiles``: a prefix transfer becomes full tiles on the keys' holder only where the
predicted slowest rank gets faster), judged as every candidate (memory budget included) and kept only
when predicted faster; ties keep the plan without tiles.

Plan time. A lower bound on every plan that moves anything (the mean attention time of the servers
plus ``collective_s``) skips the carving altogether when it cannot beat colocated: nearly balanced
steps cost one colocated plan. Otherwise the tolerances are carved (``planner.tolerance_plans``,
sharing what does not depend on the tolerance) in ``CARVING_ORDER``, loosest first, and a carving
is given up as soon as a sound lower bound on its finished plan's predicted step reaches the best
candidate's so far (it could at best tie, and would lose the tie): every rank's other work, plus
the pairs it is sure to serve (``CarvingProgress.served_at_least``: a server ends with at least
the smaller of what it serves now and the cap, less one block of pairs), plus the
exposed communication of the bytes that the tasks moved so far already cost it (exact, kept task by
task by ``transfers.RunningBytes``; a task once moved stays, and the finished plan only adds bytes).
Without the descent (``plan_by_tolerances``) the first carving is only checked before its first
donor (against colocated, which a carving that got past the ``bound`` above rarely loses to):
watching it would cost more than it saves.
Giving up therefore never changes the choice; it only saves the rest of a losing carving, which is
most of it when one candidate is clearly faster (the loosest on prolong-like batches, whose long
documents' K/V dominate). Candidates within a few percent of each other (wlbllm-like batches) are
all carved: the bound stays a few percent below the finished step (the kernel's per-key and
per-task time, a block of pairs, the K/V of what stays local) until the carving ends.

Over the memory budget, the descents (unbounded, timing ``resend``'s bytes, within the budget) start
from one ``descent.DescentStart`` (colocated loads, K/V holders, intervals, colocated memory: prepared
once), and the unbounded plan's K/V transfers serve its judgement, its fit and the checks after it.
Colocated's memory tiles are weighed only once some decision could depend on them: until the best
so far reaches ``tiles.memory_tiles_lower_bound`` of colocated (every task keeps its causal tile
on its server), they cannot be the best nor change a decision, so skipping them changes no plan
(at 64 x 64k on the shared samples the unbounded descent's judged step is already below it, and
one of a batch's two ``apply_memory_tiles`` goes). The others are not built where a sound bound says
they would lose (``apply_memory_tiles``' and ``tile_grid_plan``'s ``give_up_at``: the bound counted
from the units chosen, and the grid's ranks' base time), and no plan's memory tiles are built where
``tiles.memory_tiles_may_fit`` says none could fit the budget (``apply_memory_tiles`` asks it: the
unbounded descent's at 64 x 64k on 7 of 8 batches of either shared sample). None of these changes a
plan.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .baselines import kv_cap_tokens
from .carving import CarvingProgress, Plan, PlannerConfig, colocated_plan, server_pool, tolerance_plans
from .cost import causal_pairs
from .descent import DescentStart, descend, descend_within_memory
from .tile_grid import tile_grid_plan
from .tiles import apply_memory_tiles, apply_time_tiles, memory_tiles_lower_bound
from .zigzag import zigzag_lower_bound, zigzag_plan
from .pieces import DocumentPieces
from .rehome import rehome_within_memory
from .rank_time import loads_seconds, other_seconds, plan_loads, rank_seconds, step_seconds
from .transfers import RunningBytes, backward_memory, fit_memory_budget, kv_received, kv_transfers, memory_limit

__all__ = ["AUTO_TOLERANCES", "CARVING_ORDER", "plan_by_time", "plan_and_start", "plan_by_tolerances", "judged", "plan_loads", "loads_seconds", "rank_seconds", "step_seconds"]

AUTO_TOLERANCES = (0.02, 0.1, 0.3)
"""Fixed tolerances ``"auto"`` weighs, tightest first (the order ties are broken in); the first is
the planner's default."""

GIVE_UP_MARGIN = 1.2
"""The descent within the memory budget gives up once its level passes this times the best
candidate's step: the ranks left above the level end about there (a level rises past the finished
step and comes back down, hence the margin). On wlbllm 64 x 64k its plans were 1.4-2.9x slower than
``resend``'s; giving them up saves most of their plan time."""

CARVING_ORDER = (AUTO_TOLERANCES[-1], AUTO_TOLERANCES[0], *AUTO_TOLERANCES[1:-1])
"""The order ``"auto"`` carves them in, which only decides how early the losers are given up: the
loosest first (the cheapest carving, and the winner when K/V bytes dominate), then the planner's
default (never skipped unless proven slower), then the ones between."""


ZIGZAG_PLACE = len(AUTO_TOLERANCES) + 2
"""The CP-shaped candidate's place in the tie order (``zigzag.zigzag_plan``): after the carvings."""

GRID_PLACE = ZIGZAG_PLACE + 1
"""The tile grid's place in the tie order (``tile_grid.tile_grid_plan``): last."""


def _judged(plan: Plan, pieces: DocumentPieces, config: PlannerConfig, *,
            memory_tiles: bool = False, transfers=None, cap: int | None) -> tuple[float, Plan]:
    """``(predicted step seconds, plan)``, the plan in the backward mode that fits the memory budget:
    a ``saved`` plan over it runs in ``resend`` mode, or (``memory_tiles`` and ``config.key_split``)
    with the key-split tiles that bring it within (``tiles.apply_memory_tiles``) when that is
    predicted faster (not without a budget: then only ``backward="resend"`` runs the step in ``resend``
    mode). ``transfers``: the plan's ``kv_transfers``, when in hand; ``cap``: ``kv_cap_tokens(pieces,
    config)`` (one batch's candidates share it)."""
    transfers = kv_transfers(plan, pieces) if transfers is None else transfers
    received = kv_received(transfers, pieces.num_ranks)
    fitting = fit_memory_budget(plan, pieces, config, received)
    if cap is not None and int(received.max(initial=0)) > cap:  # past the kv_cap setting: never chosen
        return np.inf, fitting
    seconds = step_seconds(fitting, pieces, config, transfers)
    if memory_tiles and _may_tile(plan, fitting, config):
        tiled = _memory_tiled(plan, pieces, config, seconds, cap, transfers)
        if tiled is not None:
            return tiled
    return seconds, fitting


def judged(plan: Plan, pieces: DocumentPieces, config: PlannerConfig, *, transfers=None) -> tuple[float, Plan]:
    """How ``tolerance="auto"`` weighs a candidate ``plan``: ``(predicted step seconds, plan)`` in the
    backward mode that fits ``config.memory_budget`` (``inf`` past the ``kv_cap`` setting).
    ``transfers``: the plan's ``kv_transfers``, when in hand (the judged plan's too: same tasks)."""
    return _judged(plan, pieces, config, transfers=transfers, cap=kv_cap_tokens(pieces, config))


def _may_tile(plan: Plan, fitting: Plan, config: PlannerConfig) -> bool:
    """Whether ``_judged`` weighs ``plan``'s memory tiles: ``fitting`` (its judged mode) is not the
    mode asked for, and that mode may keep saved state (``backward="saved"``: a tiled plan runs saved)."""
    return (fitting.backward != plan.backward and config.backward == "saved" and config.key_split
            and config.memory_budget is not None)


def _memory_tiled(plan: Plan, pieces: DocumentPieces, config: PlannerConfig, seconds: float, cap: int | None,
                  transfers):
    """``(predicted step seconds, plan with memory tiles)`` (``tiles.apply_memory_tiles``) when those
    bring it within the memory budget (and no server past ``cap`` K/V tokens, the kv_cap setting) and
    are predicted faster than ``seconds``, else None. ``transfers``: ``plan``'s ``kv_transfers``."""
    tiled = apply_memory_tiles(plan, pieces, config.token_bytes, config.memory_budget, config=config,
                               give_up_at=seconds, transfers=transfers)
    if tiled is not plan:
        tiled_transfers = kv_transfers(tiled, pieces)
        received = kv_received(tiled_transfers, pieces.num_ranks)
        if backward_memory(tiled, pieces, config.token_bytes, received=received).fits(config.memory_budget) \
                and (cap is None or int(received.max(initial=0)) <= cap):
            tiled_seconds = step_seconds(tiled, pieces, config, tiled_transfers)
            if tiled_seconds < seconds:
                return tiled_seconds, tiled
    return None


def plan_by_time(pieces: DocumentPieces, config: PlannerConfig) -> Plan:
    """The plan ``tolerance="auto"`` runs: the fastest predicted of colocated, the descent's plan
    (``descent.descend``, judged in the backward mode that fits ``config.memory_budget``; over it, the
    descent within it and the one timing ``resend``'s bytes too) and the fixed-tolerance
    carvings of ``AUTO_TOLERANCES`` (given up as soon as they are sure to lose), the CP-shaped plan and the
    tile grid. Ties go to the earlier of colocated, the descent, ``AUTO_TOLERANCES`` in order, the
    CP-shaped plan, then the tile grid. See the module docstring."""
    return plan_and_start(pieces, config)[0]


def plan_and_start(pieces: DocumentPieces, config: PlannerConfig) -> tuple[Plan, DescentStart | None]:
    """``(plan_by_time(pieces, config), the DescentStart its descents shared)``; the start is ``None``
    where no descent ran (``planner`` reuses it for the descents it plans with cheaper bytes)."""
    return _plan_by_candidates(pieces, config, descent=True)


def plan_by_tolerances(pieces: DocumentPieces, config: PlannerConfig) -> Plan:
    """The ``"auto"`` plan before the descent (kept to measure the change, ``distca-hf simulate
    --auto-planner tolerances``): the fastest predicted of colocated and the carvings of
    ``AUTO_TOLERANCES``, ties to the earlier."""
    return _plan_by_candidates(pieces, config, descent=False)[0]


def _plan_by_candidates(pieces: DocumentPieces, config: PlannerConfig, *,
                        descent: bool) -> tuple[Plan, DescentStart | None]:
    servers = server_pool(config, pieces.num_ranks)
    tm = config.time_model
    tokens = pieces.tokens()
    other = other_seconds(tokens, config)  # every rank's linear layers (or base_pairs' other work)
    is_server = np.zeros(pieces.num_ranks, dtype=bool)
    is_server[list(servers)] = True
    best, best_key = None, (np.inf, 0)  # (predicted seconds, place in the tie order)
    cap = kv_cap_tokens(pieces, config)  # (the kv_cap setting's, shared by every candidate judged)
    # colocated with memory tiles (place 0 as well), weighed only once some decision could depend on it:
    # while the best so far is below tiles.memory_tiles_lower_bound of colocated, it cannot be the best
    colocated, tiles_bound = None, np.inf
    start = None  # the descents' DescentStart, once they run

    def weigh_colocated_tiles():
        nonlocal best, best_key, tiles_bound
        if tiles_bound < np.inf:
            tiles_bound = np.inf
            tiled = _memory_tiled(colocated, pieces, config, colocated_seconds, cap, colocated_transfers)
            if tiled is not None and (tiled[0], 0) < best_key:
                best, best_key = tiled[1], (tiled[0], 0)

    if is_server[pieces.rank[pieces.end > pieces.start]].all():  # else ranks outside the pool must give work away
        colocated = colocated_plan(pieces, servers, window=config.window)
        colocated_transfers = kv_transfers(colocated, pieces)
        colocated_seconds, best = _judged(colocated, pieces, config, transfers=colocated_transfers, cap=cap)
        best_key = (colocated_seconds, 0)
        if descent and _may_tile(colocated, best, config):  # (a hair lower: sums in another order)
            tiles_bound = memory_tiles_lower_bound(colocated, pieces, config) * (1 - 1e-9)
        pairs = causal_pairs(pieces.start, pieces.end, config.window)
        # any plan that moves work: its busiest server computes at least the mean attention
        bound = max(other.max(initial=0.0), other[is_server].min()
                    + tm.attn_s_per_pair * pairs.sum() / len(servers)) + tm.collective_s
        if bound >= min(best_key[0], tiles_bound):
            weigh_colocated_tiles()
        if bound >= best_key[0]:
            return (_with_tiles(best, best_key[0], pieces, config, cap) if descent else best), None
    if descent:
        start = DescentStart(pieces, config)  # what the descents below share
        free = descend(pieces, config, backward=config.backward, start=start)
        free_transfers = kv_transfers(free, pieces)
        seconds, plan = _judged(free, pieces, config, memory_tiles=True, transfers=free_transfers, cap=cap)
        if (seconds, 1) < best_key:
            best, best_key = plan, (seconds, 1)
        if best_key[0] >= tiles_bound:
            weigh_colocated_tiles()
        free_received = kv_received(free_transfers, pieces.num_ranks)
        if fit_memory_budget(free, pieces, config, free_received).backward != config.backward:
            # over the memory budget: the descent timing resend's bytes, and within the budget by
            # construction where that can fit and win (bounded, it is rarely faster than unbounded)
            seconds, plan = _judged(descend(pieces, config, backward="resend", start=start), pieces, config, cap=cap)
            if (seconds, 1) < best_key:
                best, best_key = plan, (seconds, 1)
            # its over-full servers' groups of tasks moved where memory and time have room (rehome)
            rehomed = rehome_within_memory(free, pieces, config, transfers=free_transfers, ceiling=best_key[0])
            if rehomed is not None:
                seconds, plan = _judged(rehomed, pieces, config, cap=cap)
                if (seconds, 1) < best_key:
                    best, best_key = plan, (seconds, 1)
            held_mean = float(backward_memory(free, pieces, config.token_bytes, backward="saved",
                                              received=free_received).held.mean())
            if step_seconds(free, pieces, config, free_transfers) < best_key[0] \
                    and _saved_may_fit(pieces, config, held_mean, start):
                bounded = _bounded_descent(pieces, config, held_mean, best_key[0], start)
                seconds, plan = _judged(bounded, pieces, config, memory_tiles=True, cap=cap) if bounded \
                    else (np.inf, None)
                if (seconds, 1) < best_key:
                    best, best_key = plan, (seconds, 1)
        # the CP-shaped candidate, built and judged only when a sound bound on it could win (not in
        # pipeline ticks, whose base_pairs it does not weigh)
        zigzag = (zigzag_plan(pieces, servers, window=config.window, block=config.block)
                  if config.base_pairs is None
                  and (zigzag_lower_bound(pieces, tm, config.window), ZIGZAG_PLACE) < best_key else None)
        if zigzag is not None:
            seconds, plan = _judged(zigzag, pieces, config, cap=cap)
            if (seconds, ZIGZAG_PLACE) < best_key:
                best, best_key = plan, (seconds, ZIGZAG_PLACE)
        # None unless a long document dominates (a pipeline tick's base_pairs weighed as other work), and
        # when its ranks' base time alone reaches the best step so far (it would lose: plan time)
        grid = tile_grid_plan(pieces, config, give_up_at=best_key[0]) if config.key_split else None
        if grid is not None:
            seconds, plan = _judged(grid, pieces, config, cap=cap)
            if (seconds, GRID_PLACE) < best_key:
                best, best_key = plan, (seconds, GRID_PLACE)
    tie_order = {tolerance: i for i, tolerance in enumerate(AUTO_TOLERANCES, start=2)}
    finished = [] if not descent else [None]  # the carvings finished so far (the descent's plan counts)
    running = RunningBytes(pieces, config.token_bytes, config.window)
    other_list = other.tolist()

    def give_up(progress: CarvingProgress) -> bool:
        """Whether the carving's finished plan is sure to lose to ``best``: some rank's time is at
        least its other work (``rank_time.other_seconds``), the pairs it is sure to serve and the
        exposed communication of the bytes that the tasks moved so far already cost it."""
        place = tie_order[progress.tolerance]
        if not progress.moved:  # before the first donor: no bytes yet
            running.clear()
            lower = tm.rank_seconds(tokens, progress.served_at_least(), other_s=other)
            return (float(lower.max(initial=0.0)), place) > best_key
        if not finished:  # the first carving after colocated alone: rarely close enough to be worth the bookkeeping
            return False
        sent, received, exposed, served_at_least = running.sent, running.received, config.exposed_comm, \
            progress.served_at_least
        for rank in running.add(progress.moved):  # only these ranks' bounds grew
            lower = tm.rank_seconds(0, served_at_least(rank), other_s=other_list[rank]) + tm.comm_seconds(
                sent[rank], received[rank], exposed)
            if (lower, place) > best_key:
                return True
        return False

    for tolerance, plan in zip(CARVING_ORDER, tolerance_plans(pieces, config, CARVING_ORDER, give_up=give_up)):
        if plan is None:  # given up: sure to be predicted slower than the best so far
            continue
        finished.append(tolerance)
        seconds, plan = _judged(plan, pieces, config, cap=cap)
        key = (seconds, tie_order[tolerance])
        if key < best_key:
            best, best_key = plan, key
    if best is None:  # nothing within kv_cap: ranks outside the server pool give their work away, whatever it moves
        return _plan_by_candidates(pieces, dataclasses.replace(config, kv_cap=None), descent=descent)[0], None
    return (_with_tiles(best, best_key[0], pieces, config, cap) if descent else best), start


def _saved_may_fit(pieces: DocumentPieces, config: PlannerConfig, held_mean: float, start: DescentStart) -> bool:
    """Whether the descent within ``config.memory_budget`` can fit: the colocated plan fits against a
    mean of at least ``held_mean`` (the unbounded descent's). The descent never takes memory away from
    a rank, it only declines to add, so when colocated is over (a rank holding a late piece of a long
    document keeps its prefix's K/V) only the memory tiles of the candidates, or ``resend``, can fit,
    and the bounded descent is skipped (plan time). ``start``: the descents' (its colocated memory)."""
    memory = start.colocated_memory()
    limit = memory_limit(config.memory_budget, max(float(memory.held.mean()), held_mean), float(memory.floor))
    return float(memory.held.max(initial=0.0)) <= limit * (1 + 1e-12)


def _bounded_descent(pieces: DocumentPieces, config: PlannerConfig, held_mean: float, best_seconds: float,
                     start: DescentStart):
    """The descent within ``config.memory_budget`` (``descent.descend_within_memory``) when the
    unbounded one is over it: the limit counts at least the mean ``held_mean`` that the unbounded one
    makes ranks hold (the first moves would otherwise be judged against colocated's mean, before the
    K/V that later moves bring). Moving less K/V, the bounded plan may end with a lower mean, hence a
    lower limit: then it is planned once more against its own mean. ``None`` when it gives up, its
    level past ``GIVE_UP_MARGIN`` x ``best_seconds`` (the best candidate's step: it would lose)."""
    give_up_above = GIVE_UP_MARGIN * best_seconds
    bounded, refused = descend_within_memory(pieces, config, backward="saved", held_mean=held_mean,
                                             give_up_above=give_up_above, start=start)
    if bounded is None:
        return None
    memory = backward_memory(bounded, pieces, config.token_bytes, backward="saved")
    if refused and not memory.fits(config.memory_budget):
        bounded, _ = descend_within_memory(pieces, config, backward="saved", held_mean=float(memory.held.mean()),
                                           give_up_above=give_up_above, start=start)
    return bounded


def _with_tiles(best: Plan, seconds: float, pieces: DocumentPieces, config: PlannerConfig, cap) -> Plan:
    """With ``config.key_split``, ``best`` (predicted ``seconds``) with key-split tiles chosen by time
    (``tiles.apply_time_tiles``) when that is predicted faster, judged as every candidate is (memory
    budget included; ``cap``: ``kv_cap_tokens``'); ties keep ``best``."""
    if not config.key_split:
        return best
    tiled = apply_time_tiles(best, pieces, config, judge=False)  # judged below, as every candidate
    if tiled is best:
        return best
    tiled_seconds, tiled = _judged(tiled, pieces, config, cap=cap)
    return tiled if tiled_seconds < seconds else best
