"""``tolerance="auto"``'s candidates planned on different ranks at once, the same plan kept on all.

Every rank of the server group holds the same documents after the forward's first collective
(``agree``) and used to plan the same thing. Under ``kv_relays="auto"`` that plan weighs up to
``planning.auto_candidates`` candidates one after the other (the planned plan, then descents as if
bytes were cheaper), each depending only on the documents and the settings. Here rank 0 plans the
planned plan and the others the rest in turn (``candidate_owner``); one all-reduce of
``[2, candidates]`` float64 (each candidate's predicted seconds, and whether it raised) lets every
rank replay ``planning.chosen_candidate``, the rule ``plan_tasks`` follows, and the rank that planned the chosen candidate broadcasts it (pickled,
size first). The plan is ``plan_tasks``' own, on every rank, and the plan time is the slowest rank's
candidates instead of their sum (``examples/plan_time.py`` measures both).

A candidate that raises is an error only where ``plan_tasks`` would have planned it (the rule still
weighed it): then a rank whose own candidate raised raises that error and the others
``DistCAPeerError`` naming the rank, with no hang; every collective waits with distca's timeout
(``comm.CommHandle``), which also covers the wait for the slowest rank's candidates (rank 0's planned
plan, usually).
"""

from __future__ import annotations

import pickle

import numpy as np
import torch
import torch.distributed as dist

from ..errors import DistCAPeerError
from ..planning import DocumentPieces, Plan, PlannerConfig, auto_candidates, chosen_candidate, plan_candidate, plan_tasks
from .comm import CommHandle

__all__ = ["plan_across_ranks", "candidate_owner"]


def candidate_owner(index: int, world: int) -> int:
    """The rank of a ``world``-rank group that plans candidate ``index``: the planned plan (0, usually
    the longest) alone on rank 0, the others in turn on ranks 1 .. world - 1 (on 4 ranks or more, one
    candidate per rank)."""
    if index == 0 or world == 1:
        return 0
    return 1 + (index - 1) % (world - 1)


def plan_across_ranks(pieces: DocumentPieces, config: PlannerConfig, *, group, device, timeout_s: float,
                      what: str) -> Plan:
    """``planning.plan_tasks(pieces, config)``, its candidates planned on different ranks of ``group``
    (module docstring). Every rank of ``group`` calls it with the same ``pieces`` and ``config``.
    ``device``: where NCCL's tensors live (gloo's stay on the CPU); ``what``: the forward, for errors."""
    count = auto_candidates(pieces, config)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if count == 1 or world == 1:
        return plan_tasks(pieces, config)
    plans, errors, start = {}, {}, None
    table = np.zeros((2, count))  # [seconds; 1 where the candidate raised], this rank's candidates only
    for index in (i for i in range(count) if candidate_owner(i, world) == rank):
        try:
            table[0, index], plans[index], start = plan_candidate(pieces, config, index, start=start)
        except Exception as e:  # raised below only where plan_tasks would have met it, on every rank
            errors[index], table[1, index] = e, 1.0
    gather_device = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    summed = torch.from_numpy(table).to(gather_device)
    CommHandle(dist.all_reduce(summed, group=group, async_op=True), None, timeout_s,
               f"{what} (all-reduce of the planning candidates' seconds)").wait()
    seconds, failed = summed.cpu().numpy()
    first_failed = next((i for i in range(count) if failed[i]), count)
    planned = seconds[:first_failed].tolist()  # the candidates before the first that raised
    # plan_tasks would have planned the failed candidate (the rule still weighs one more): every rank stops
    if first_failed < count and (not planned or chosen_candidate(planned)[1]):
        if errors:  # this rank's own error (the same one, when every candidate meets it): the most telling
            raise errors[min(errors)]
        raise DistCAPeerError(f"{what}: planning candidate {first_failed} failed on rank "
                              f"{candidate_owner(first_failed, world)} of the server group (see its error); every "
                              "rank stops this forward")
    chosen = chosen_candidate(planned)[0]
    return _broadcast_plan(plans.get(chosen), candidate_owner(chosen, world), group, gather_device, timeout_s,
                           f"{what} (broadcast of planning candidate {chosen})")


def _broadcast_plan(plan: Plan | None, owner: int, group, device, timeout_s: float, what: str) -> Plan:
    """``plan`` as ``owner`` (a rank of ``group``) holds it, on every rank: its pickle's size (-1 when
    the owner could not pickle it: every rank raises), then its bytes (``uint8``), each broadcast waited
    on with the timeout."""
    source = dist.get_global_rank(group if group is not None else dist.group.WORLD, owner)
    mine = dist.get_rank(group) == owner
    payload, failure = b"", None
    if mine:
        try:
            payload = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # said to the others through the size, so that none waits for bytes
            failure = e
    size = torch.tensor([-1 if failure else len(payload)], dtype=torch.int64, device=device)
    CommHandle(dist.broadcast(size, src=source, group=group, async_op=True), None, timeout_s, what).wait()
    if failure is not None:
        raise failure
    if int(size.item()) < 0:
        raise DistCAPeerError(f"{what}: rank {owner} of the server group could not send its plan (see its error); "
                              "every rank stops this forward")
    data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device) if mine
            else torch.empty(int(size.item()), dtype=torch.uint8, device=device))
    CommHandle(dist.broadcast(data, src=source, group=group, async_op=True), None, timeout_s, what).wait()
    return plan if mine else pickle.loads(data.cpu().numpy().tobytes())
