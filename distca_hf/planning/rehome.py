"""A plan over the memory budget brought within it by moving whole groups of served tasks (issue 21):
``tolerance="auto"``'s way to keep the descent's ``saved``-mode plan where only a few servers hold too
much. Pure numpy; no torch.distributed.

Why. The descent planned without the budget (``descent.descend``) is the fastest candidate on batches
of many mid-length documents (wlbllm 512 x 512k: 2107 ms predicted on the first batch against 2185 ms
for the best plan within the budget), but a few of its servers keep the K/V prefixes and queries of
the shards they took for backward, past ``(1 + memory_budget)`` x the mean (65 of 512 ranks there,
while their predicted time is below the step's). Run in ``resend`` mode it is slower than the descent
planned for ``resend``'s bytes. Those servers have room in time, and most ranks have room in memory.

How. A *group* is every task one server ``s`` computes for one document that ``s`` holds no piece
of: all its queries come from other ranks and its K/V arrives from the document's holders. Moving a
group to a server ``t`` that neither holds nor serves that document moves exactly its bytes and memory:
``t`` receives the same queries and K/V (``transfers.kv_transfers``: the same ranges, from the same
holders), returns the same outputs and keeps the same ``queries x (q + out + lse) + K/V x kv`` bytes
(``transfers.backward_memory``) that ``s`` no longer does; the sources and holders send as much as
before, to ``t`` instead of ``s``. So the mean memory, hence the limit (``BackwardMemory.limit``), stays;
every other rank's time and memory stay. For each server over the limit, most excess first, groups
move (the quickest that brings it within, else the most memory per second first) to the server
predicted least loaded among those with room for the group in memory and in time (at most
``ceiling``: by default the plan's predicted step in ``saved`` mode, which then does not grow;
``by_time`` passes the best other candidate's). Exact under the memory formula and the time model
(``rank_time.rank_seconds``) but for ``collective_s``, which a target that moved no bytes before
starts paying and the room test leaves out; ``by_time`` judges the result exactly, as every candidate.

Not done: moving part of a group, or to a server that already holds or serves the document (its K/V
then overlaps what it has); a server over the limit by its own pieces' prefixes (a long document's
late piece) has no group to move and the plan stays over (``None``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .carving import Plan, PlannerConfig
from .pieces import DocumentPieces
from .rank_time import rank_seconds
from .transfers import KVTransfers, backward_memory, kv_received, kv_transfers

__all__ = ["rehome_within_memory"]


def rehome_within_memory(plan: Plan, pieces: DocumentPieces, config: PlannerConfig, *,
                         transfers: KVTransfers | None = None, ceiling: float | None = None) -> Plan | None:
    """``plan`` in ``saved`` mode with groups of tasks moved so that its ``backward_memory`` fits
    ``config.memory_budget`` without its predicted step growing (module docstring); ``plan`` itself
    when it fits already, ``None`` when it cannot be brought within this way (or under no budget, or
    for key-split plans, whose servers keep other bytes). ``transfers``: ``plan``'s ``kv_transfers``,
    when in hand. ``ceiling``: the most predicted seconds a server that takes a group may end with
    (default: ``plan``'s step in ``saved`` mode, which then does not grow; ``by_time`` passes the best
    other candidate's step, which the result must beat)."""
    budget = config.memory_budget
    if budget is None or plan.splits_keys:
        return None
    saved = plan if plan.backward == "saved" else dataclasses.replace(plan, backward="saved")
    n, tb = plan.num_ranks, config.token_bytes
    transfers = kv_transfers(plan, pieces) if transfers is None else transfers
    memory = backward_memory(saved, pieces, tb, received=kv_received(transfers, n))
    if memory.fits(budget):
        return saved
    limit = memory.limit(budget) * (1 + 1e-12)  # moving groups keeps the total, hence the mean
    held = memory.held.astype(np.float64)
    tm = config.time_model
    byte_s = tm.byte_seconds(config.exposed_comm, "saved")

    # the groups (server, doc) of the servers over the limit whose server holds no piece of doc: the
    # memory and seconds each moves
    is_over = held > limit
    over = np.flatnonzero(is_over)
    span = int(max(plan.doc.max(initial=0), pieces.doc.max(initial=0))) + 1
    on_over = np.flatnonzero(is_over[plan.server])
    group_of = plan.server[on_over] * span + plan.doc[on_over]
    keys, index = np.unique(group_of, return_inverse=True)
    held_there = is_over[pieces.rank]
    movable = ~np.isin(keys, pieces.rank[held_there] * span + pieces.doc[held_there])
    tasks = plan.subset(is_over[plan.server])  # in plan order, as on_over
    group_queries = np.bincount(index, weights=tasks.q_end - tasks.q_start, minlength=keys.size)
    group_seconds = np.bincount(index, weights=tm.task_seconds(tasks.pairs().astype(np.float64), tasks.keys()),
                                minlength=keys.size)
    here = is_over[transfers.server]  # every transfer to these servers belongs to one of their groups
    group_kv = np.bincount(np.searchsorted(keys, transfers.server[here] * span + transfers.doc[here]),
                           weights=(transfers.end - transfers.start)[here], minlength=keys.size)
    groups: dict[int, list] = {}  # server -> [(memory bytes, seconds, doc, group index)]
    for g in np.flatnonzero(movable).tolist():
        server, doc, q, kv = int(keys[g] // span), int(keys[g] % span), float(group_queries[g]), float(group_kv[g])
        groups.setdefault(server, []).append(
            (q * (tb.q + tb.o + tb.lse) + kv * tb.kv,
             float(group_seconds[g]) + byte_s * (q * (tb.q + tb.o) + kv * tb.kv), doc, g))
    if not all(int(server) in groups for server in over):
        return None  # a server over the limit by what it holds, not by groups it could give away
    times = rank_seconds(saved, pieces, config, transfers)
    ceiling = float(times.max(initial=0.0)) if ceiling is None else ceiling
    # the ranks holding or serving each document a group may move: never a group's new server
    docs = np.unique(keys[movable] % span)
    doc_ranks: dict[int, set] = {int(doc): set() for doc in docs}
    in_docs = np.zeros(span, dtype=bool)
    in_docs[docs] = True
    for ranks, of_doc in ((pieces.rank, pieces.doc), (plan.server, plan.doc)):
        mask = in_docs[of_doc]
        for rank, doc in zip(ranks[mask].tolist(), of_doc[mask].tolist()):
            doc_ranks[doc].add(rank)

    is_server = np.zeros(n, dtype=bool)
    is_server[list(plan.servers)] = True
    new_server = np.full(keys.size, -1, dtype=np.int64)  # per group: its server after the moves (-1: unchanged)
    for server in over[np.argsort(-(held[over] - limit), kind="stable")].tolist():
        options = list(groups.get(server, ()))
        while held[server] > limit and options:
            # the quickest group that brings the server within, else the most memory per second first
            excess = held[server] - limit
            ordered = sorted(options, key=lambda item: (item[0] < excess, item[1] if item[0] >= excess
                                                        else -item[0] / max(item[1], 1e-12), item[3]))
            for item in ordered:
                memory_bytes, seconds, doc, g = item
                room = is_server & (held + memory_bytes <= limit) & (times + seconds <= ceiling)
                room[list(doc_ranks[doc])] = False
                if room.any():
                    target = int(np.flatnonzero(room)[np.argmin(times[room])])
                    held[server] -= memory_bytes
                    held[target] += memory_bytes
                    times[server] -= seconds
                    times[target] += seconds
                    doc_ranks[doc].discard(server)
                    doc_ranks[doc].add(target)
                    new_server[g] = target
                    options.remove(item)
                    break
            else:
                return None  # no group of this server fits anywhere
    if (held > limit).any():
        return None
    target = new_server[index]
    server = plan.server.copy()
    server[on_over[target >= 0]] = target[target >= 0]
    return dataclasses.replace(saved, server=server)
