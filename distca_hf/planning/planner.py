"""The planner's entry point: ``plan_tasks`` assigns every query of a batch to an attention server.
Pure numpy; no torch, no torch.distributed.

- ``tolerance="auto"``: the candidate the time model predicts fastest (``by_time.plan_by_time``:
  colocated and the carvings of ``AUTO_TOLERANCES``) among those that fit ``memory_budget``.
- a numeric tolerance: that carving (``carving.tolerance_plans``, a hard bound on max/mean - 1 of
  server attention load), kept when it fits ``memory_budget`` in the backward mode in force, else in
  ``resend`` mode (servers keep nothing), else the colocated plan in the mode that holds less.

The plan says which backward mode it runs in (``Plan.backward``); every rank computes the same plan,
mode included, from the same lengths and settings. This module sits at the top of the planning
room: it imports the carving, the transfers (bytes and memory) and planning by time, and none of
them imports it. ``Plan``, ``PlannerConfig``, ``colocated_plan`` and the carving's names are
re-exported here, where they lived before the carving had its own module.
"""

from __future__ import annotations

import numpy as np

from .by_time import plan_by_time
from .carving import PLANNING_MARGIN, CarvingProgress, Plan, PlannerConfig, colocated_plan, tolerance_plans
from .pieces import DocumentPieces
from .transfers import fit_memory_budget, least_memory

__all__ = ["plan_tasks", "PlannerConfig", "Plan", "colocated_plan", "tolerance_plans", "CarvingProgress",
           "PLANNING_MARGIN", "DocumentPieces"]


def plan_tasks(pieces: DocumentPieces, config: PlannerConfig = PlannerConfig()) -> Plan:
    """Assign every query of ``pieces`` to a server (see the module docstring): by time under
    ``tolerance="auto"``, else the carving at ``config.tolerance``; either way within
    ``config.memory_budget`` when any candidate fits it."""
    if config.tolerance == "auto":
        return plan_by_time(pieces, config)
    plan = next(tolerance_plans(pieces, config, (config.tolerance,)))
    fitting = fit_memory_budget(plan, pieces, config)
    if fitting is not None:
        return fitting
    servers = config.servers if config.servers is not None else tuple(range(pieces.num_ranks))
    is_server = np.zeros(pieces.num_ranks, dtype=bool)
    is_server[list(servers)] = True
    if not is_server[pieces.rank[pieces.end > pieces.start]].all():  # no colocated plan: ranks must give work away
        return least_memory(plan, pieces, config)
    colocated = colocated_plan(pieces, servers, window=config.window)
    return fit_memory_budget(colocated, pieces, config) or least_memory(colocated, pieces, config)
