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

The plan says which backward mode it runs in (``Plan.backward``); every rank computes the same plan,
mode included, from the same lengths and settings. This module sits at the top of the planning
room: it imports the carving, the transfers (bytes and memory), the descent, the relays and planning
by time, and none of them imports it. ``Plan``, ``PlannerConfig``, ``colocated_plan`` and the carving's names are
re-exported here, where they lived before the carving had its own module.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np

from ..config import kv_cap_pairing_problem
from .by_time import judged, plan_and_start
from .carving import PLANNING_MARGIN, CarvingProgress, Plan, PlannerConfig, colocated_plan, tolerance_plans
from .descent import DescentStart, descend
from .pieces import DocumentPieces
from .rank_time import rank_seconds
from .relay import timed_relays
from .transfers import fit_memory_budget, kv_transfers

__all__ = ["plan_tasks", "PlannerConfig", "Plan", "colocated_plan", "tolerance_plans", "CarvingProgress",
           "PLANNING_MARGIN", "DocumentPieces", "RELAY_BYTE_DISCOUNTS", "RELAY_DISCOUNT_PATIENCE"]

RELAY_BYTE_DISCOUNTS = (4.0, 8.0, 16.0)
"""Under ``tolerance="auto"`` and ``kv_relays="auto"``, the descent is also run as if bytes cost these
times less (``bytes_per_s`` multiplied), which spreads long documents over more servers; each such plan,
fitted to the memory budget and given relay trees by time, competes with the planned one under the
true time model (``_with_relays``). A descent that prices direct sends fans a document out only as
far as its holders' links allow; with relays a new server costs its parent's link instead, which
these discounts stand in for. Which discount wins is not monotone (the descent is greedy: on prolong
512 x 32k one batch's plan is 0.89x the planned one's speed at 4, 1.10x at 8 and 1.22x at 16), so the
search goes on past a discount that loses and stops after ``RELAY_DISCOUNT_PATIENCE`` in a row.
Measured (``make bench-sim``, H100 model, nothing hidden; ``docs/planner.md``), the layer with relays /
with ``kv_relays="off"``: prolong 512 x 128k 713 / 960 ms, 512 x 32k 257 / 317 ms, 64 x 512k 1813 /
2252 ms, at 3-4.5x the plan time (stopping at the first loss gave 736, 301 and 1814 ms; starting at 8
and stopping at the first loss 713, 259 and 1841 ms, but prolong 512 x 512k 2202 ms against 2050)."""

RELAY_DISCOUNT_PATIENCE = 2
"""``_with_relays`` stops after this many discounts in a row whose plan is not faster than the best so
far (each costs a descent: about a third of the plan time at 512 ranks)."""


def plan_tasks(pieces: DocumentPieces, config: PlannerConfig = PlannerConfig()) -> Plan:
    """Assign every query of ``pieces`` to a server (see the module docstring): by time under
    ``tolerance="auto"``, else the carving at ``config.tolerance``; either way within
    ``config.memory_budget``. ``config.kv_cap`` (K/V one server receives per layer) needs ``"auto"``.
    The plan's K/V then goes along the relay trees ``config.kv_relays`` asks for (``relay.apply_relays``:
    they change how K/V travels, not where tasks run nor what servers receive)."""
    if not isinstance(pieces, DocumentPieces) or not isinstance(config, PlannerConfig):
        raise TypeError(f"plan_tasks takes DocumentPieces (e.g. DocumentPieces.from_rank_lists) and a PlannerConfig, "
                        f"got {type(pieces).__name__} and {type(config).__name__}")
    if config.tolerance == "auto":
        return _with_relays(*plan_and_start(pieces, config), pieces, config)
    problem = kv_cap_pairing_problem(config.kv_cap, config.tolerance)  # the carving ignores K/V it moves
    if problem:
        raise ValueError(problem)
    plan = fit_memory_budget(next(tolerance_plans(pieces, config, (config.tolerance,))), pieces, config)
    return timed_relays(plan, pieces, config)[0]


def _with_relays(plan: Plan, start: DescentStart | None, pieces: DocumentPieces, config: PlannerConfig) -> Plan:
    """``"auto"``'s plan with the relay trees ``config.kv_relays`` asks for (``relay.apply_relays``), and
    under ``kv_relays="auto"`` the fastest predicted of it and the descents planned with cheaper bytes
    (``RELAY_BYTE_DISCOUNTS``, in order, until ``RELAY_DISCOUNT_PATIENCE`` in a row do not win), each judged as
    ``"auto"`` judges a candidate (``by_time.judged``: the memory budget, ``kv_cap``) and given relays by
    time; ties keep the planned one. ``start``: the ``DescentStart`` of ``plan``'s descents, when they ran
    (shared by these: a start does not read ``bytes_per_s``)."""
    best, best_seconds = timed_relays(plan, pieces, config)
    if config.kv_relays != "auto" or pieces.num_ranks < 3:  # a tree needs two servers besides the holder
        return best
    if best_seconds is None:
        best_seconds = float(rank_seconds(best, pieces, config).max(initial=0.0))
    model, misses = config.time_model, 0
    for discount in RELAY_BYTE_DISCOUNTS:
        cheaper = dataclasses.replace(config, kv_relays="off",
                                      time_model=dataclasses.replace(model, bytes_per_s=model.bytes_per_s * discount))
        start = DescentStart(pieces, cheaper) if start is None else _rebased(start, cheaper)
        wider = descend(pieces, cheaper, backward=config.backward, start=start)
        transfers = kv_transfers(wider, pieces)  # (judging keeps the tasks: the judged plan's too)
        seconds, wider = judged(wider, pieces, config, transfers=transfers)
        if not np.isfinite(seconds):  # past the kv_cap setting
            break
        wider, relayed = timed_relays(wider, pieces, config, transfers=transfers)
        seconds = relayed if relayed is not None else seconds
        if seconds >= best_seconds:
            misses += 1
            if misses >= RELAY_DISCOUNT_PATIENCE:
                break
            continue
        best, best_seconds, misses = wider, seconds, 0
    return best


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
