"""Planning by time (``tolerance="auto"``): the plan the time model predicts fastest, colocated
included, so work moves only while the move pays.

A plan's predicted layer time (forward + backward) on rank ``r`` is

    linear_s_per_token * (query tokens r holds)
    + sum over the CA-tasks r serves of task_seconds(pairs, keys)     (TimeModel.task_seconds)
    + exposed_comm * passes * (bytes r sends + bytes r receives) / bytes_per_s
    + collective_s, when anything crosses ranks

and the step is the slowest rank's. Bytes are one layer's forward (``transfers.rank_bytes``: Q out,
O back, K/V from its holder); ``passes`` (``cost.COMM_PASSES``) is 2 in ``saved`` mode (the
backward moves as many again: dO out, dQ and dK/dV back) and 3 in ``resend`` mode (q, k/v and out
travel again with dO). ``exposed_comm`` is the fraction the overlap mode does not hide.

Memory. A candidate whose ``transfers.backward_memory`` exceeds ``memory_budget`` in ``saved`` mode
is judged in ``resend`` mode instead (``transfers.fit_memory_budget``: servers keep nothing, which
always fits; more bytes, timed so), so ``auto`` weighs a looser carving that fits in ``saved`` mode
against the tighter ones in ``resend`` mode, colocated included.

The candidates are the colocated plan (when every rank holding work serves), the descent's plan
(``descent.descend``: a greedy that minimises this predicted time directly, both ends of every link
counted, a long document's fan-out bounded; when its plan only fits the budget in ``resend`` mode it
is planned again with ``resend``'s bytes) and the fixed-tolerance plans of ``AUTO_TOLERANCES``, each
exactly ``plan_tasks``' at that tolerance; the chosen one is the candidate with the smallest
predicted step (ties: colocated, the descent, then the tightest tolerance), so it is never
predicted slower than colocated, than the fixed-tolerance plan (0.02), nor than ``auto`` before the
descent (``plan_by_tolerances``, kept to measure the change), under the same model. The descent wins
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
candidate's so far (it could at best tie, and would lose the tie): every rank's linear time, plus
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
"""

from __future__ import annotations

import numpy as np

from .baselines import RankLoads
from .carving import CarvingProgress, Plan, PlannerConfig, colocated_plan, tolerance_plans
from .cost import TimeModel, TokenBytes, causal_pairs
from .descent import descend, linear_seconds
from .tiles import apply_time_tiles
from .pieces import DocumentPieces
from .transfers import KVTransfers, RunningBytes, fit_memory_budget, kv_received, kv_transfers, rank_bytes

__all__ = ["AUTO_TOLERANCES", "CARVING_ORDER", "plan_by_time", "plan_by_tolerances", "plan_loads", "loads_seconds", "rank_seconds", "step_seconds"]

AUTO_TOLERANCES = (0.02, 0.1, 0.3)
"""Fixed tolerances ``"auto"`` weighs, tightest first (the order ties are broken in); the first is
the planner's default."""

CARVING_ORDER = (AUTO_TOLERANCES[-1], AUTO_TOLERANCES[0], *AUTO_TOLERANCES[1:-1])
"""The order ``"auto"`` carves them in, which only decides how early the losers are given up: the
loosest first (the cheapest carving, and the winner when K/V bytes dominate), then the planner's
default (never skipped unless proven slower), then the ones between."""


def plan_loads(plan: Plan, pieces: DocumentPieces, token_bytes: TokenBytes,
               transfers: KVTransfers | None = None) -> RankLoads:
    """Per-rank work of ``plan`` on ``pieces``: every rank's own query tokens through the linear
    layers, the pairs, keys and tasks it serves, the bytes it sends and receives in a layer's forward."""
    sent, received = rank_bytes(plan, pieces, token_bytes, transfers)
    n = pieces.num_ranks
    return RankLoads(pieces.tokens(), plan.server_pairs().astype(np.float64),
                     np.bincount(plan.server, weights=plan.keys(), minlength=n),
                     np.bincount(plan.server, minlength=n), sent, received)


def loads_seconds(loads: RankLoads, time_model: TimeModel, exposed_comm: float, backward: str = "saved"):
    """``(compute, exposed communication)``, each ``[ranks]`` seconds of one layer, forward +
    backward, of any method's ``loads`` (the planner's and the simulator's one time formula):
    compute = linear per token + the kernel's pairs, keys and tasks; communication = the fraction
    ``exposed_comm`` of ``COMM_PASSES[backward] x (sent + received) / bytes_per_s`` plus
    ``collective_s`` when anything crosses ranks. The step is the slowest rank's ``compute + exposed``."""
    compute = time_model.rank_seconds(loads.tokens, loads.pairs, loads.tasks, loads.keys)
    moves = bool(loads.sent.sum() + loads.received.sum() > 0)
    return compute, time_model.comm_seconds(loads.sent, loads.received, exposed_comm, moves, backward)


def rank_seconds(plan: Plan, pieces: DocumentPieces, config: PlannerConfig,
                 transfers: KVTransfers | None = None) -> np.ndarray:
    """``[num_ranks]`` predicted seconds of one layer, forward + backward, on every rank under
    ``plan`` in its backward mode (see the module docstring); ``config`` gives the time model, token
    bytes and ``exposed_comm``; with ``config.base_pairs``, each rank's work besides attention is
    theirs (``descent.linear_seconds``), not only its tokens' linear layers."""
    loads = plan_loads(plan, pieces, config.token_bytes, transfers)
    compute, exposed = loads_seconds(loads, config.time_model, config.exposed_comm, plan.backward)
    if config.base_pairs is not None:
        compute = compute - config.time_model.linear_s_per_token * loads.tokens + linear_seconds(loads.tokens, config)
    return compute + exposed


def step_seconds(plan: Plan, pieces: DocumentPieces, config: PlannerConfig,
                 transfers: KVTransfers | None = None) -> float:
    """The predicted layer time of the slowest rank under ``plan``."""
    return float(rank_seconds(plan, pieces, config, transfers).max(initial=0.0))


def _judged(plan: Plan, pieces: DocumentPieces, config: PlannerConfig) -> tuple[float, Plan]:
    """``(predicted step seconds, plan)``, the plan in the backward mode that fits the memory budget."""
    transfers = kv_transfers(plan, pieces)
    fitting = fit_memory_budget(plan, pieces, config, kv_received(transfers, pieces.num_ranks))
    return step_seconds(fitting, pieces, config, transfers), fitting


def plan_by_time(pieces: DocumentPieces, config: PlannerConfig) -> Plan:
    """The plan ``tolerance="auto"`` runs: the fastest predicted of colocated, the descent's plan
    (``descent.descend``, judged in the backward mode that fits ``config.memory_budget``; when only
    ``resend`` fits, the descent is run again timing ``resend``'s bytes) and the fixed-tolerance
    carvings of ``AUTO_TOLERANCES`` (given up as soon as they are sure to lose). Ties go to the
    earlier of colocated, the descent, then ``AUTO_TOLERANCES`` in order. See the module docstring."""
    return _plan_by_candidates(pieces, config, descent=True)


def plan_by_tolerances(pieces: DocumentPieces, config: PlannerConfig) -> Plan:
    """The ``"auto"`` plan before the descent (kept to measure the change, ``distca-hf simulate
    --auto-planner tolerances``): the fastest predicted of colocated and the carvings of
    ``AUTO_TOLERANCES``, ties to the earlier."""
    return _plan_by_candidates(pieces, config, descent=False)


def _plan_by_candidates(pieces: DocumentPieces, config: PlannerConfig, *, descent: bool) -> Plan:
    servers = config.servers if config.servers is not None else tuple(range(pieces.num_ranks))
    tm = config.time_model
    tokens = pieces.tokens()
    is_server = np.zeros(pieces.num_ranks, dtype=bool)
    is_server[list(servers)] = True
    best, best_key = None, (np.inf, 0)  # (predicted seconds, place in the tie order)
    if is_server[pieces.rank[pieces.end > pieces.start]].all():  # else ranks outside the pool must give work away
        seconds, best = _judged(colocated_plan(pieces, servers, window=config.window), pieces, config)
        best_key = (seconds, 0)
        pairs = causal_pairs(pieces.start, pieces.end, config.window)
        linear = tm.linear_s_per_token * tokens
        # any plan that moves work: its busiest server computes at least the mean attention
        bound = max(linear.max(initial=0.0), linear[is_server].min()
                    + tm.attn_s_per_pair * pairs.sum() / len(servers)) + tm.collective_s
        if bound >= best_key[0]:
            return _with_tiles(best, best_key[0], pieces, config) if descent else best
    if descent:
        for mode in dict.fromkeys((config.backward, "resend")):
            seconds, plan = _judged(descend(pieces, config, backward=mode), pieces, config)
            if (seconds, 1) < best_key:
                best, best_key = plan, (seconds, 1)
            if plan.backward == mode:  # it fits the memory budget in the mode its bytes were timed in
                break
    tie_order = {tolerance: i for i, tolerance in enumerate(AUTO_TOLERANCES, start=2)}
    finished = [] if not descent else [None]  # the carvings finished so far (the descent's plan counts)
    running = RunningBytes(pieces, config.token_bytes, config.window)
    token_counts = tokens.tolist()

    def give_up(progress: CarvingProgress) -> bool:
        """Whether the carving's finished plan is sure to lose to ``best``: some rank's time is at
        least its linear layers, the pairs it is sure to serve and the exposed communication of the
        bytes that the tasks moved so far already cost it."""
        place = tie_order[progress.tolerance]
        if not progress.moved:  # before the first donor: no bytes yet
            running.clear()
            lower = tm.rank_seconds(tokens, progress.served_at_least())
            return (float(lower.max(initial=0.0)), place) > best_key
        if not finished:  # the first carving after colocated alone: rarely close enough to be worth the bookkeeping
            return False
        sent, received, exposed, served_at_least = running.sent, running.received, config.exposed_comm, \
            progress.served_at_least
        for rank in running.add(progress.moved):  # only these ranks' bounds grew
            lower = tm.rank_seconds(token_counts[rank], served_at_least(rank)) + tm.comm_seconds(
                sent[rank], received[rank], exposed)
            if (lower, place) > best_key:
                return True
        return False

    for tolerance, plan in zip(CARVING_ORDER, tolerance_plans(pieces, config, CARVING_ORDER, give_up=give_up)):
        if plan is None:  # given up: sure to be predicted slower than the best so far
            continue
        finished.append(tolerance)
        seconds, plan = _judged(plan, pieces, config)
        key = (seconds, tie_order[tolerance])
        if key < best_key:
            best, best_key = plan, key
    return _with_tiles(best, best_key[0], pieces, config) if descent else best


def _with_tiles(best: Plan, seconds: float, pieces: DocumentPieces, config: PlannerConfig) -> Plan:
    """With ``config.key_split``, ``best`` (predicted ``seconds``) with key-split tiles chosen by time
    (``tiles.apply_time_tiles``) when that is predicted faster, judged as every candidate is (memory
    budget included); ties keep ``best``."""
    if not config.key_split:
        return best
    tiled = apply_time_tiles(best, pieces, config, judge=False)  # judged below, as every candidate
    if tiled is best:
        return best
    tiled_seconds, tiled = _judged(tiled, pieces, config)
    return tiled if tiled_seconds < seconds else best
