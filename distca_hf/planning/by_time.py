"""Planning by time (``tolerance="auto"``): the plan the time model predicts fastest, colocated
included, so work moves only while the move pays.

A plan's predicted layer time (forward + backward) on rank ``r`` is

    linear_s_per_token * (query tokens r holds)
    + sum over the CA-tasks r serves of task_seconds(pairs, keys)     (TimeModel.task_seconds)
    + exposed_comm * 2 * (bytes r sends + bytes r receives) / bytes_per_s
    + collective_s, when anything crosses ranks

and the step is the slowest rank's. Bytes are one layer's forward (``transfers.rank_bytes``: Q out,
O back, K/V from its holder); the backward moves as many again (``saved`` mode: dO out, dQ and
dK/dV back), hence the 2. ``exposed_comm`` is the fraction the overlap mode does not hide.

The candidates are the colocated plan (when every rank holding work serves) and the fixed-tolerance
plans of ``AUTO_TOLERANCES``, tightest first; looser ones are tried only while each beats the one
before (the predicted time falls as bytes drop and rises as imbalance grows). The first candidate
is the planner's fixed default (0.02), so the chosen plan is never predicted slower than the
fixed-tolerance plan nor than colocated. A lower bound on every plan that moves anything (the
mean attention time of the servers plus ``collective_s``) skips the carving altogether when it
cannot beat colocated: nearly balanced steps cost one colocated plan.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .baselines import RankLoads
from .cost import TimeModel, TokenBytes, causal_pairs
from .pieces import DocumentPieces
from .planner import Plan, PlannerConfig, colocated_plan, plan_tasks
from .transfers import KVTransfers, rank_bytes

__all__ = ["AUTO_TOLERANCES", "plan_by_time", "plan_loads", "loads_seconds", "rank_seconds", "step_seconds"]

AUTO_TOLERANCES = (0.02, 0.1, 0.3)
"""Fixed tolerances ``"auto"`` tries, tightest first; the first is the planner's default."""


def plan_loads(plan: Plan, pieces: DocumentPieces, token_bytes: TokenBytes,
               transfers: KVTransfers | None = None) -> RankLoads:
    """Per-rank work of ``plan`` on ``pieces``: every rank's own query tokens through the linear
    layers, the pairs, keys and tasks it serves, the bytes it sends and receives in a layer's forward."""
    sent, received = rank_bytes(plan, pieces, token_bytes, transfers)
    n = pieces.num_ranks
    return RankLoads(pieces.tokens(), plan.server_pairs().astype(np.float64),
                     np.bincount(plan.server, weights=plan.keys(), minlength=n),
                     np.bincount(plan.server, minlength=n), sent, received)


def loads_seconds(loads: RankLoads, time_model: TimeModel, exposed_comm: float):
    """``(compute, exposed communication)``, each ``[ranks]`` seconds of one layer, forward +
    backward, of any method's ``loads`` (the planner's and the simulator's one time formula):
    compute = linear per token + the kernel's pairs, keys and tasks; communication = the fraction
    ``exposed_comm`` of ``2 x (sent + received) / bytes_per_s`` plus ``collective_s`` when anything
    crosses ranks. The step is the slowest rank's ``compute + exposed``."""
    compute = time_model.rank_seconds(loads.tokens, loads.pairs, loads.tasks, loads.keys)
    moves = bool(loads.sent.sum() + loads.received.sum() > 0)
    return compute, time_model.comm_seconds(loads.sent, loads.received, exposed_comm, moves)


def rank_seconds(plan: Plan, pieces: DocumentPieces, config: PlannerConfig) -> np.ndarray:
    """``[num_ranks]`` predicted seconds of one layer, forward + backward, on every rank under
    ``plan`` (see the module docstring); ``config`` gives the time model, token bytes and
    ``exposed_comm``."""
    compute, exposed = loads_seconds(plan_loads(plan, pieces, config.token_bytes), config.time_model,
                                     config.exposed_comm)
    return compute + exposed


def step_seconds(plan: Plan, pieces: DocumentPieces, config: PlannerConfig) -> float:
    """The predicted layer time of the slowest rank under ``plan``."""
    return float(rank_seconds(plan, pieces, config).max(initial=0.0))


def plan_by_time(pieces: DocumentPieces, config: PlannerConfig) -> Plan:
    """The candidate plan with the smallest predicted ``step_seconds`` (ties: the one moving less)."""
    servers = config.servers if config.servers is not None else tuple(range(pieces.num_ranks))
    holders = np.unique(pieces.rank[pieces.end > pieces.start])
    if not np.isin(holders, servers).all():  # ranks outside the pool must give their work away
        best, best_s = None, np.inf
    else:
        best = colocated_plan(pieces, servers, window=config.window)
        best_s = step_seconds(best, pieces, config)
        tm = config.time_model
        pairs = causal_pairs(pieces.start, pieces.end, config.window)
        linear = tm.linear_s_per_token * np.bincount(pieces.rank, weights=pieces.end - pieces.start,
                                                     minlength=pieces.num_ranks)
        # any plan that moves work: its busiest server computes at least the mean attention
        bound = max(linear.max(initial=0.0), linear[list(servers)].min()
                    + tm.attn_s_per_pair * pairs.sum() / len(servers)) + tm.collective_s
        if bound >= best_s:
            return best
    for i, tolerance in enumerate(AUTO_TOLERANCES):
        plan = plan_tasks(pieces, dataclasses.replace(config, tolerance=tolerance))
        seconds = step_seconds(plan, pieces, config)
        if seconds < best_s:
            best, best_s = plan, seconds
        elif i > 0:
            break  # looser than a plan already worse: stop
    return best
