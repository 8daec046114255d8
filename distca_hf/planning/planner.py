"""The planner's entry point: ``plan_tasks`` assigns every query of a batch to an attention server.
Pure numpy; no torch, no torch.distributed.

- ``tolerance="auto"``: the candidate the time model predicts fastest (``by_time.plan_by_time``:
  colocated, the descent on the predicted time (``descent.descend``) and the carvings of
  ``AUTO_TOLERANCES``), each in the backward mode that fits ``memory_budget``.
- a numeric tolerance: that carving (``carving.tolerance_plans``, a hard bound on max/mean - 1 of
  server attention load), in the backward mode in force when it fits ``memory_budget``, else in
  ``resend`` mode (servers keep nothing; ``transfers.fit_memory_budget``).

The plan says which backward mode it runs in (``Plan.backward``); every rank computes the same plan,
mode included, from the same lengths and settings. This module sits at the top of the planning
room: it imports the carving, the transfers (bytes and memory) and planning by time, and none of
them imports it. ``Plan``, ``PlannerConfig``, ``colocated_plan`` and the carving's names are
re-exported here, where they lived before the carving had its own module.
"""

from __future__ import annotations

from ..config import kv_cap_pairing_problem
from .by_time import plan_by_time
from .carving import PLANNING_MARGIN, CarvingProgress, Plan, PlannerConfig, colocated_plan, tolerance_plans
from .pieces import DocumentPieces
from .relay import apply_relays
from .transfers import fit_memory_budget

__all__ = ["plan_tasks", "PlannerConfig", "Plan", "colocated_plan", "tolerance_plans", "CarvingProgress",
           "PLANNING_MARGIN", "DocumentPieces"]


def plan_tasks(pieces: DocumentPieces, config: PlannerConfig = PlannerConfig()) -> Plan:
    """Assign every query of ``pieces`` to a server (see the module docstring): by time under
    ``tolerance="auto"``, else the carving at ``config.tolerance``; either way within
    ``config.memory_budget``. ``config.kv_cap`` (K/V one server receives per layer) needs ``"auto"``.
    The plan's K/V then goes along the relay trees ``config.kv_relays`` asks for (``relay.apply_relays``:
    they change how K/V travels, not where tasks run nor what servers receive)."""
    if config.tolerance == "auto":
        return apply_relays(plan_by_time(pieces, config), pieces, config)
    problem = kv_cap_pairing_problem(config.kv_cap, config.tolerance)  # the carving ignores K/V it moves
    if problem:
        raise ValueError(problem)
    plan = fit_memory_budget(next(tolerance_plans(pieces, config, (config.tolerance,))), pieces, config)
    return apply_relays(plan, pieces, config)
