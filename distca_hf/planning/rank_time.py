"""A plan's predicted time per rank: the one home of the formula that the planner's judges
(``by_time``), the descent, the time-chosen tiles and ``distca-hf simulate`` all use. Pure numpy.

A rank's time in one layer (forward + backward) is

    other work                                              (``other_seconds``)
    + the kernel's pairs, keys and tasks it serves          (``TimeModel.rank_seconds``)
    + exposed * passes * (bytes sent + received) / bytes_per_s + collective_s, when anything moves
                                                            (``TimeModel.comm_seconds``)
    + with relayed K/V (``relay_trees``): collective_s per exchange round beyond the first, and the
      time the rank waits for relayed K/V beyond its own link time (``relay_wait_seconds``)

Other work is the rank's tokens through the linear layers, ``linear_s_per_token * tokens``, or,
with ``PlannerConfig.base_pairs``, ``attn_s_per_pair * base_pairs``: the base is that work itself, in
pairs of attention time. A pipeline tick plans with a base of 0 on every rank
(``pipeline_cost.attention_only``): its exchanges synchronise the ranks around every layer's
attention, so a rank with less linear work (a bubble) cannot spend the difference on attention.
"""

from __future__ import annotations

import numpy as np

from .baselines import RankLoads
from .carving import Plan, PlannerConfig
from .cost import TimeModel, TokenBytes
from .pieces import DocumentPieces
from .relay_trees import plan_kv_sends, sends_rounds
from .transfers import RangeSends, rank_bytes

__all__ = ["other_seconds", "plan_loads", "loads_seconds", "rank_seconds", "step_seconds", "relay_wait_seconds",
           "sends_timing"]


def other_seconds(tokens, config: PlannerConfig) -> np.ndarray:
    """``[ranks]`` seconds of every rank's work besides attention in one layer, forward + backward
    (module docstring): ``tokens`` (``[ranks]``, the queries each rank holds) through the linear
    layers, or ``config.base_pairs`` pairs of attention time when given."""
    tm = config.time_model
    tokens = np.asarray(tokens, dtype=np.float64)
    if config.base_pairs is None:
        return tm.linear_s_per_token * tokens
    base = np.asarray(config.base_pairs, dtype=np.float64)
    if base.shape != tokens.shape:
        raise ValueError(f"base_pairs gives {base.size} ranks, the pieces {tokens.size}")
    return tm.attn_s_per_pair * base


def plan_loads(plan: Plan, pieces: DocumentPieces, token_bytes: TokenBytes,
               transfers: RangeSends | None = None) -> RankLoads:
    """Per-rank work of ``plan`` on ``pieces``: every rank's own query tokens through the linear
    layers, the pairs, keys and tasks it serves, the bytes it sends and receives in a layer's forward
    (K/V per ``transfers``, default ``relay_trees.plan_kv_sends``: along the plan's relay trees, if any)."""
    sent, received = rank_bytes(plan, pieces, token_bytes, transfers if transfers is not None
                                else plan_kv_sends(plan, pieces))
    n = pieces.num_ranks
    return RankLoads(pieces.tokens(), plan.server_pairs().astype(np.float64),
                     np.bincount(plan.server, weights=plan.keys(), minlength=n),
                     np.bincount(plan.server, minlength=n), sent, received)


def relay_wait_seconds(sends: RangeSends, kv_bytes: int, byte_seconds: float, num_ranks: int, *,
                       first_round=None) -> np.ndarray:
    """``[num_ranks]`` seconds each rank waits for relayed K/V beyond its own link time (0 without
    relays): a server can forward a range only once it has it, so the rounds chain. Round 1 ends on a
    rank after its own round-1 K/V bytes (sent + received); a later round starts on a rank when it and
    every rank sending to it in that round have finished the round before, and lasts its own bytes of
    the round; the wait is the rank's finish of its last round less its link time over all rounds
    (store and forward, a range sent whole: no pipelining within a range). ``byte_seconds``: seconds
    per byte (``TimeModel.byte_seconds``: the exposed fraction and the backward's passes included, as
    the gradients go back up the same trees). ``first_round``: ``[num_ranks]`` seconds of each rank's
    round-1 K/V, when ``sends`` hold only the later rounds' (the relay greedy keeps it by group)."""
    rounds = sends_rounds(sends)
    deepest = int(rounds.max(initial=1))
    if deepest <= 1:
        return np.zeros(num_ranks)
    moved = ((sends.end - sends.start) * kv_bytes).astype(np.float64)
    # every send's bytes on its sender's and its receiver's link in its round (one bincount: the same
    # sums in the same order as adding senders' then receivers')
    slots = np.concatenate((rounds * num_ranks + sends.source, rounds * num_ranks + sends.server))
    per_round = np.bincount(slots, np.concatenate((moved, moved)), (deepest + 1) * num_ranks)
    per_round = per_round.reshape(deepest + 1, num_ranks) * byte_seconds
    if first_round is not None:
        per_round[1] = first_round
    ready = per_round[1].copy()
    for d in range(2, deepest + 1):
        now = rounds == d
        start = ready.copy()
        np.maximum.at(start, sends.server[now], ready[sends.source[now]])
        ready = np.where(per_round[d] > 0, start + per_round[d], ready)
    return np.maximum(ready - per_round[1:].sum(axis=0), 0.0)


def sends_timing(sends: RangeSends, token_bytes: TokenBytes, time_model: TimeModel, exposed_comm: float,
                 backward: str, num_ranks: int) -> tuple[int, np.ndarray]:
    """``(rounds, wait_s)`` of K/V ``sends`` for ``loads_seconds``: the exchange rounds of a layer's
    forward and ``relay_wait_seconds`` (both trivial for direct sends)."""
    rounds = int(sends_rounds(sends).max(initial=1))
    if rounds <= 1:
        return 1, np.zeros(num_ranks)
    return rounds, relay_wait_seconds(sends, token_bytes.kv, time_model.byte_seconds(exposed_comm, backward),
                                      num_ranks)


def loads_seconds(loads: RankLoads, time_model: TimeModel, exposed_comm: float, backward: str = "saved", *,
                  other_s=None, moves: bool | None = None, rounds: int = 1, wait_s=None):
    """``(compute, exposed communication)``, each ``[ranks]`` seconds of one layer, forward +
    backward, of any method's ``loads`` (the planner's and the simulator's one time formula):
    compute = other work (``other_s``, ``[ranks]`` seconds; default the linear layers of
    ``loads.tokens``) + the kernel's pairs, keys and tasks; communication = the fraction
    ``exposed_comm`` of ``COMM_PASSES[backward] x (sent + received) / bytes_per_s`` plus
    ``collective_s`` when anything crosses ranks (``moves``; default: whether ``loads`` move any
    byte, pass it for a subset of a plan's ranks), and ``collective_s`` per K/V exchange round beyond
    the first (``rounds``: a relayed plan's, ``relay_trees.sends_rounds``; every rank enters each
    round) plus ``wait_s`` (``[ranks]`` seconds waiting for relayed K/V, ``relay_wait_seconds``; both
    from ``sends_timing``). The step is the slowest rank's ``compute + exposed``."""
    compute = time_model.rank_seconds(loads.tokens, loads.pairs, loads.tasks, loads.keys, other_s=other_s)
    if moves is None:
        moves = bool(loads.sent.sum() + loads.received.sum() > 0)
    extra_rounds = max(int(rounds) - 1, 0) * time_model.collective_s
    exposed = time_model.comm_seconds(loads.sent, loads.received, exposed_comm, moves, backward) + extra_rounds
    return compute, exposed if wait_s is None else exposed + wait_s


def rank_seconds(plan: Plan, pieces: DocumentPieces, config: PlannerConfig,
                 transfers: RangeSends | None = None) -> np.ndarray:
    """``[num_ranks]`` predicted seconds of one layer, forward + backward, on every rank under
    ``plan`` in its backward mode (module docstring, ``config.base_pairs`` included); ``config``
    gives the time model, token bytes and ``exposed_comm``; ``transfers``: the K/V sends, direct
    (``kv_transfers``) or relayed (``relay_trees.RelaySends``, their rounds counted), by default
    ``relay_trees.plan_kv_sends(plan, pieces)``."""
    sends = transfers if transfers is not None else plan_kv_sends(plan, pieces)
    loads = plan_loads(plan, pieces, config.token_bytes, sends)
    other = None if config.base_pairs is None else other_seconds(loads.tokens, config)
    rounds, wait = sends_timing(sends, config.token_bytes, config.time_model, config.exposed_comm, plan.backward,
                                plan.num_ranks)
    compute, exposed = loads_seconds(loads, config.time_model, config.exposed_comm, plan.backward, other_s=other,
                                     rounds=rounds, wait_s=wait)
    return compute + exposed


def step_seconds(plan: Plan, pieces: DocumentPieces, config: PlannerConfig,
                 transfers: RangeSends | None = None) -> float:
    """The predicted layer time of the slowest rank under ``plan``."""
    return float(rank_seconds(plan, pieces, config, transfers).max(initial=0.0))
