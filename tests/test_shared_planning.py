"""``tolerance="auto"``'s candidates: ``chosen_candidate`` replays ``plan_tasks``' search exactly,
every candidate is the same planned alone, and ``runtime.shared_planning`` gives every rank
``plan_tasks``' own plan when its ranks plan different candidates (a candidate that raises stops
every rank only where ``plan_tasks`` would have planned it)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from distca_hf.planning import auto_candidates, chosen_candidate, plan_candidate, plan_tasks
from distca_hf.planning.baselines import pack_pieces
from distca_hf.planning.planner import RELAY_BYTE_DISCOUNTS, RELAY_DISCOUNT_PATIENCE
from distca_hf.tools.simulate import default_planner_config
from dist_harness import run_ranks

AUTO = dataclasses.replace(default_planner_config(), tolerance="auto")


def one_long_document(seed: int, ranks: int = 8, tokens: int = 16384):
    """``ranks x tokens`` of short documents (200 to 4000 tokens) and one of 20k to 100k, shuffled: the
    long one spans ranks, so the relay candidates compete (the seeds below keep 0, 1 and 3)."""
    rng = np.random.default_rng(seed)
    docs = np.concatenate([[int(rng.integers(20000, 100000))], rng.integers(200, 4000, size=200)])
    rng.shuffle(docs)
    docs = docs[np.cumsum(docs) <= ranks * tokens]
    return pack_pieces(np.append(docs, ranks * tokens - docs.sum()), ranks, tokens)


KEEPS = {0: 1, 1: 0, 28: 3}  # seed -> the candidate plan_tasks keeps (1: stops before the last one)


def _sequential_search(seconds):
    """The search as ``plan_tasks`` ran it before it had candidates (stop 37's ``_with_relays``), over
    given seconds: ``(kept, whether it would weigh one more)``."""
    best, best_seconds, misses = 0, seconds[0], 0
    for index in range(1, len(seconds)):
        if not np.isfinite(seconds[index]):
            return best, False
        if seconds[index] >= best_seconds:
            misses += 1
            if misses >= RELAY_DISCOUNT_PATIENCE:
                return best, False
            continue
        best, best_seconds, misses = index, seconds[index], 0
    return best, True


@given(st.lists(st.one_of(st.floats(0.5, 2.0), st.sampled_from([1.0, math.inf])), min_size=1, max_size=8))
def test_chosen_candidate_is_the_sequential_search(seconds):
    assert chosen_candidate(seconds) == _sequential_search(seconds)
    kept, _ = chosen_candidate(seconds)
    assert all(earlier > seconds[kept] for earlier in seconds[:kept])  # strictly faster than every one before


def test_chosen_candidate_refuses_no_seconds():
    with pytest.raises(ValueError, match="candidate 0 at least"):
        chosen_candidate([])


def _digest(plan) -> str:
    """A digest of every field of ``plan`` (its class, arrays by dtype, shape and bytes): equal plans, equal
    digests."""
    import hashlib

    def parts(value):
        if isinstance(value, np.ndarray):
            yield f"{value.dtype}{value.shape}".encode()
            yield np.ascontiguousarray(value).tobytes()
        elif dataclasses.is_dataclass(value):
            yield type(value).__name__.encode()
            for f in dataclasses.fields(value):
                yield f.name.encode()
                yield from parts(getattr(value, f.name))
        elif isinstance(value, (list, tuple)):
            for item in value:
                yield from parts(item)
        else:
            yield repr(value).encode()

    digest = hashlib.sha256()
    for part in parts(plan):
        digest.update(part)
    return digest.hexdigest()


@pytest.mark.parametrize("seed", sorted(KEEPS))
def test_each_candidate_planned_alone_gives_plan_tasks_plan(seed):
    pieces = one_long_document(seed)
    count = auto_candidates(pieces, AUTO)
    assert count == 1 + len(RELAY_BYTE_DISCOUNTS)
    alone = [plan_candidate(pieces, AUTO, index) for index in range(count)]  # each with its own DescentStart
    kept, _ = chosen_candidate([seconds for seconds, _, _ in alone])
    assert kept == KEEPS[seed]
    assert _digest(plan_tasks(pieces, AUTO)) == _digest(alone[kept][1])
    start = alone[0][2]  # a later candidate with the start the planned one shared: the same plan
    assert start is not None and all(_digest(plan_candidate(pieces, AUTO, i, start=start)[1]) == _digest(alone[i][1])
                                     for i in range(1, count))


def test_candidates_are_counted_and_bounded():
    pieces = one_long_document(0)
    assert auto_candidates(pieces, dataclasses.replace(AUTO, kv_relays="off")) == 1
    assert auto_candidates(pieces, dataclasses.replace(AUTO, tolerance=0.1)) == 1
    assert auto_candidates(pack_pieces(np.array([300, 200]), 2, 250), AUTO) == 1  # a tree needs 3 ranks
    for index in (-1, auto_candidates(pieces, AUTO), 1.0, True):
        with pytest.raises(ValueError, match="index must be a candidate from 0 to 3"):
            plan_candidate(pieces, AUTO, index)
    assert plan_candidate(pieces, AUTO, np.int64(0))[0] == plan_candidate(pieces, AUTO, 0)[0]


def test_every_candidate_has_one_owner_and_the_planned_plan_is_alone_on_rank_0():
    from distca_hf.runtime.shared_planning import candidate_owner

    for world in range(1, 9):
        owners = [candidate_owner(i, world) for i in range(4)]
        assert owners[0] == 0 and all(0 <= o < world for o in owners)
        if world > 1:
            assert 0 not in owners[1:]  # candidate 0 alone
        if world >= 4:
            assert len(set(owners)) == 4  # one candidate per rank


def _shared_worker(rank, world, seeds, failing):
    """``plan_across_ranks`` over the gloo group for each seed's batch (rank 0 also plans ``plan_tasks``
    alone, the reference); candidate ``failing`` (if any) raises on its rank."""
    import torch.distributed as dist

    from distca_hf.runtime import shared_planning

    if failing is not None and shared_planning.candidate_owner(failing, world) == rank:
        planned = shared_planning.plan_candidate

        def plan_candidate(pieces, config, index, *, start=None):
            if index == failing:
                raise RuntimeError(f"candidate {index} failed here")
            return planned(pieces, config, index, start=start)

        shared_planning.plan_candidate = plan_candidate
    reports = []
    for seed in seeds:
        pieces = one_long_document(seed)
        try:
            # (group None: the default group, as the group setting's default passes it)
            plan = shared_planning.plan_across_ranks(pieces, AUTO, group=None if world == 2 else dist.group.WORLD,
                                                     device="cpu", timeout_s=60, what="test forward")
        except Exception as e:
            reports.append({"error": type(e).__name__, "message": str(e)})
            continue
        reports.append({"error": None, "plan": _digest(plan),
                        "reference": _digest(plan_tasks(pieces, AUTO)) if rank == 0 else None})
    return reports


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_planning_different_candidates_keep_plan_tasks_plan(tmp_path, world):
    seeds = sorted(KEEPS)  # kept candidates 1, 0 and 3: planned on ranks 1, 0 and 1 (2 or 3 ranks)
    results = run_ranks(_shared_worker, world, tmp_path, seeds, None, deadline_s=240)
    assert all(r["ok"] for r in results), results
    for i, seed in enumerate(seeds):
        reports = [r["value"][i] for r in results]
        assert all(report["error"] is None for report in reports), (seed, reports)
        assert {report["plan"] for report in reports} == {reports[0]["reference"]}, (seed, reports)


@pytest.mark.distributed
def test_a_failing_candidate_stops_every_rank_only_where_plan_tasks_plans_it(tmp_path):
    # seed 1 stops after two candidates that lose: the last one is never planned by plan_tasks; seed 28
    # weighs every candidate: the last one failing on rank 1 stops both ranks, no hang
    results = run_ranks(_shared_worker, 2, tmp_path, [1, 28], 3, deadline_s=240)
    assert all(r["ok"] for r in results), results
    unreached, reached = zip(*(r["value"] for r in results))
    assert all(report["error"] is None for report in unreached) and unreached[0]["plan"] == unreached[0]["reference"]
    assert unreached[1]["plan"] == unreached[0]["plan"]
    assert reached[1] == {"error": "RuntimeError", "message": "candidate 3 failed here"}, reached
    assert reached[0]["error"] == "DistCAPeerError" and "candidate 3 failed on rank 1" in reached[0]["message"]
    # the planned plan (candidate 0, rank 0) is always planned: its failure stops every rank, on 3 ranks
    (tmp_path / "first").mkdir()
    results = run_ranks(_shared_worker, 3, tmp_path / "first", [0], 0, deadline_s=240)
    first = [r["value"][0] for r in results]
    assert first[0] == {"error": "RuntimeError", "message": "candidate 0 failed here"}, first
    assert all(f["error"] == "DistCAPeerError" and "candidate 0 failed on rank 0" in f["message"] for f in first[1:])


@pytest.mark.distributed
def test_a_model_planned_on_three_ranks_is_exact(tmp_path):
    """Every ``"auto"`` forward on 3 ranks under ``kv_relays="auto"`` plans its candidates on different
    ranks (the group setting's default, ``None``: the default group): logits and gradients still match each
    document alone, and every rank runs the same plan."""
    from workers import exact_runs, exactness_worker

    results = run_ranks(exactness_worker, 3, tmp_path, "llama", env={"DISTCA_TOLERANCE": "auto"})
    for _, runs in exact_runs(results, 8):
        assert all(run["stats"]["plan_seconds"] > 0 for run in runs)  # what the trainers log as plan_time_s
    for i in range(len(results[0]["value"]) - 1):
        assert len({str(r["value"][i]["stats"]["attn_pairs_served"]) for r in results}) == 1


def test_plan_seconds_add_up_over_nano_batches():
    from distca_hf.planning import TokenBytes, colocated_plan
    from distca_hf.runtime.context import BatchPlan, plan_stats_of

    pieces = one_long_document(0)
    halves = [BatchPlan(pieces, colocated_plan(pieces), plan_seconds=seconds) for seconds in (0.25, 0.5)]
    stats = plan_stats_of(3, halves, token_bytes=TokenBytes(q=64, kv=32, o=64), num_heads=2)
    assert stats.plan_seconds == 0.75 and [n.plan_seconds for n in stats.nano_batches] == [0.25, 0.5]
    assert stats.as_dict()["plan_seconds"] == 0.75
