"""The planner's entry point: ``plan_tasks`` assigns every query of a batch to an attention server.
Pure numpy; no torch, no torch.distributed.

- ``tolerance="auto"``: the candidate the time model predicts fastest (``by_time.plan_by_time``:
  colocated, the descent on the predicted time (``descent.descend``) and the carvings of
  ``AUTO_TOLERANCES``), each in the backward mode that fits ``memory_budget``.
- a numeric tolerance: that carving (``carving.tolerance_plans``, a hard bound on max/mean - 1 of
  server attention load), in the backward mode in force when it fits ``memory_budget``, else in
  ``resend`` mode (servers keep nothing; ``transfers.fit_memory_budget``).
- then K/V relays (the ``kv_relays`` setting, ``relay.apply_relays``): servers forward a holder's
  K/V along trees where that is predicted faster; under ``"auto"`` the descent is also planned as if
  bytes were cheaper (``RELAY_BYTE_DISCOUNTS``), spreading long documents over more servers whose
  K/V the trees then carry, and the fastest predicted is kept.

The plan says which backward mode it runs in (``Plan.backward``); any rank computes the same plan,
mode included, from the same lengths and settings (in training the ranks plan ``"auto"``'s
candidates each their own and share the kept plan: ``runtime.shared_planning``). This module sits at
the top of the planning room: it imports the carving, the transfers (bytes and memory), the descent, the relays and planning
by time, and none of them imports it. ``Plan``, ``PlannerConfig``, ``colocated_plan`` and the carving's names are
re-exported here, where they lived before the carving had its own module.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from ..config import is_integer, kv_cap_pairing_problem
from .by_time import judged, plan_and_start
from .carving import PLANNING_MARGIN, CarvingProgress, Plan, PlannerConfig, colocated_plan, tolerance_plans
from .descent import DescentStart, descend
from .pieces import DocumentPieces
from .rank_time import rank_seconds
from .relay import timed_relays
from .transfers import fit_memory_budget, kv_transfers

__all__ = ["plan_tasks", "auto_candidates", "plan_candidate", "chosen_candidate", "PlannerConfig", "Plan",
           "colocated_plan", "tolerance_plans", "CarvingProgress", "PLANNING_MARGIN", "DocumentPieces",
           "RELAY_BYTE_DISCOUNTS", "RELAY_DISCOUNT_PATIENCE"]

RELAY_BYTE_DISCOUNTS = (4.0, 8.0, 16.0)
"""Under ``tolerance="auto"`` and ``kv_relays="auto"``, the descent is also run as if bytes cost these
times less (``bytes_per_s`` multiplied), which spreads long documents over more servers; each such plan,
fitted to the memory budget and given relay trees by time, competes with the planned one under the
true time model (``plan_candidate``). A descent that prices direct sends fans a document out only as
far as its holders' links allow; with relays a new server costs its parent's link instead, which
these discounts stand in for. Which discount wins is not monotone (the descent is greedy: on prolong
512 x 32k one batch's plan is 0.89x the planned one's speed at 4, 1.10x at 8 and 1.22x at 16), so the
search goes on past a discount that loses and stops after ``RELAY_DISCOUNT_PATIENCE`` in a row.
Measured (``make bench-sim``, H100 model, nothing hidden; ``docs/planner.md``), the layer with relays /
with ``kv_relays="off"``: prolong 512 x 128k 713 / 960 ms, 512 x 32k 257 / 317 ms, 64 x 512k 1813 /
2252 ms, at 3-4.5x the plan time (stopping at the first loss gave 736, 301 and 1814 ms; starting at 8
and stopping at the first loss 713, 259 and 1841 ms, but prolong 512 x 512k 2202 ms against 2050)."""

RELAY_DISCOUNT_PATIENCE = 2
"""``chosen_candidate`` stops after this many discounts in a row whose plan is not faster than the best so
far (each costs a descent: about a third of the plan time at 512 ranks)."""


def plan_tasks(pieces: DocumentPieces, config: PlannerConfig = PlannerConfig()) -> Plan:
    """Assign every query of ``pieces`` to a server (see the module docstring): by time under
    ``tolerance="auto"``, else the carving at ``config.tolerance``; either way within
    ``config.memory_budget``. ``config.kv_cap`` (K/V one server receives per layer) needs ``"auto"``.
    The plan's K/V then goes along the relay trees ``config.kv_relays`` asks for (``relay.apply_relays``:
    they change how K/V travels, not where tasks run nor what servers receive).

    Under ``"auto"`` the candidates (``auto_candidates``) are planned one after the other here, each only
    when ``chosen_candidate`` still weighs it; ``runtime.shared_planning`` plans them on different
    ranks at once and keeps the same one."""
    if not isinstance(pieces, DocumentPieces) or not isinstance(config, PlannerConfig):
        raise TypeError(f"plan_tasks takes DocumentPieces (e.g. DocumentPieces.from_rank_lists) and a PlannerConfig, "
                        f"got {type(pieces).__name__} and {type(config).__name__}")
    if config.tolerance == "auto":
        count = auto_candidates(pieces, config)
        if count == 1:
            return _planned(pieces, config)[0]
        seconds, plans, start = [], [], None
        for index in range(count):
            candidate_seconds, plan, start = plan_candidate(pieces, config, index, start=start)
            seconds.append(candidate_seconds)
            plans.append(plan)
            chosen, weigh_more = chosen_candidate(seconds)
            if not weigh_more:
                break
        return plans[chosen]
    problem = kv_cap_pairing_problem(config.kv_cap, config.tolerance)  # the carving ignores K/V it moves
    if problem:
        raise ValueError(problem)
    plan = fit_memory_budget(next(tolerance_plans(pieces, config, (config.tolerance,))), pieces, config)
    return timed_relays(plan, pieces, config)[0]


def auto_candidates(pieces: DocumentPieces, config: PlannerConfig) -> int:
    """How many candidates ``plan_tasks`` weighs under ``tolerance="auto"``: the planned plan, and under
    ``kv_relays="auto"`` on 3 ranks or more (a tree needs two servers besides the holder) one descent per
    ``RELAY_BYTE_DISCOUNTS``; 1 under a numeric tolerance."""
    if config.tolerance != "auto" or config.kv_relays != "auto" or pieces.num_ranks < 3:
        return 1
    return 1 + len(RELAY_BYTE_DISCOUNTS)


def plan_candidate(pieces: DocumentPieces, config: PlannerConfig, index: int, *,
                   start: DescentStart | None = None) -> tuple[float, Plan, DescentStart | None]:
    """Candidate ``index`` (``0 <= index < auto_candidates``) of ``"auto"``'s plan: ``(its predicted step
    seconds, the plan, the DescentStart its descents used)``. Each candidate depends only on
    ``pieces`` and ``config``, so any rank may plan any of them.

    - 0: the planned plan (``by_time.plan_and_start``) with relay trees placed by time.
    - ``i >= 1``: the descent planned as if bytes cost ``RELAY_BYTE_DISCOUNTS[i - 1]`` times less,
      judged as ``"auto"`` judges a candidate (``by_time.judged``: the memory budget, ``kv_cap``) and
      given relays by time; ``inf`` seconds past the ``kv_cap`` setting.

    ``start``: a ``DescentStart`` an earlier candidate returned for the same pieces and config (a start
    does not read ``bytes_per_s``: the candidates share one; the plans are the same without it)."""
    count = auto_candidates(pieces, config)
    if not (is_integer(index) and 0 <= index < count):  # (np.int64 from numpy; no bool)
        raise ValueError(f"index must be a candidate from 0 to {count - 1} (auto_candidates), got {index!r}")
    index = int(index)
    if index == 0:
        plan, seconds, start = _planned(pieces, config)
        if seconds is None:
            seconds = float(rank_seconds(plan, pieces, config).max(initial=0.0))
        return seconds, plan, start
    model = config.time_model
    cheaper = dataclasses.replace(config, kv_relays="off", time_model=dataclasses.replace(
        model, bytes_per_s=model.bytes_per_s * RELAY_BYTE_DISCOUNTS[index - 1]))
    start = DescentStart(pieces, cheaper) if start is None else _rebased(start, cheaper)
    wider = descend(pieces, cheaper, backward=config.backward, start=start)
    transfers = kv_transfers(wider, pieces)  # (judging keeps the tasks: the judged plan's too)
    seconds, wider = judged(wider, pieces, config, transfers=transfers)
    if not np.isfinite(seconds):  # past the kv_cap setting
        return math.inf, wider, start
    wider, relayed = timed_relays(wider, pieces, config, transfers=transfers)
    return (relayed if relayed is not None else seconds), wider, start


def chosen_candidate(seconds: Sequence[float]) -> tuple[int, bool]:
    """``(the candidate kept, whether the next one is still weighed)`` from the predicted step seconds of
    candidates ``0 .. len(seconds) - 1``: a candidate replaces the kept one only when strictly faster
    (ties keep the earlier); the search stops at an infinite one (past ``kv_cap``: wider ones need
    more K/V) and after ``RELAY_DISCOUNT_PATIENCE`` in a row that do not win. The one home of the rule
    for ``plan_tasks`` and ``runtime.shared_planning``, which replays it on every candidate's seconds."""
    if not seconds:
        raise ValueError("chosen_candidate needs the seconds of candidate 0 at least")
    kept, misses = 0, 0
    for index in range(1, len(seconds)):
        if not math.isfinite(seconds[index]):
            return kept, False
        if seconds[index] >= seconds[kept]:
            misses += 1
            if misses >= RELAY_DISCOUNT_PATIENCE:
                return kept, False
        else:
            kept, misses = index, 0
    return kept, True


def _planned(pieces: DocumentPieces, config: PlannerConfig) -> tuple[Plan, float | None, DescentStart | None]:
    """``(by_time's plan with the relay trees config.kv_relays asks for, its predicted seconds where the
    relays weighed them, the DescentStart its descents shared)``."""
    plan, start = plan_and_start(pieces, config)
    plan, seconds = timed_relays(plan, pieces, config)
    return plan, seconds, start


def _rebased(start: DescentStart, config: PlannerConfig) -> DescentStart:
    """``start`` for ``config``, which differs from ``start.config`` only in the time model's
    ``bytes_per_s`` and in ``kv_relays`` (nothing a ``DescentStart`` reads: its loads, linear and own
    attention times): the descents of one batch share one (a start is read only)."""
    mine = start.config
    same = dataclasses.replace(config, kv_relays=mine.kv_relays, time_model=dataclasses.replace(
        config.time_model, bytes_per_s=mine.time_model.bytes_per_s))
    if same != mine:
        raise ValueError("a DescentStart is shared only by configs that differ in bytes_per_s and kv_relays")
    shared = copy.copy(start)
    shared.config = config
    return shared
