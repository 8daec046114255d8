"""Planning by time, directly (``planning.descent``, what ``tolerance="auto"`` plans with): every query
computed exactly once, never predicted slower than colocated or than the ``auto`` before it (colocated
and the fixed-tolerance carvings), deterministic, the fan-out bound, and the issue-21 case where a long
document's K/V holders are the bottleneck."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distca_hf.planning import (AUTO_TOLERANCES, DocumentPieces, PlannerConfig, TimeModel, TokenBytes, colocated_plan,
                                plan_tasks, step_seconds)
from distca_hf.planning.by_time import plan_by_tolerances
from distca_hf.planning.cost import LLAMA3_8B_BYTES, H100_MEASURED
from distca_hf.planning.descent import DescentStart, descend, descend_within_memory, fan_out_bounds
from distca_hf.planning.transfers import document_servers
from distca_hf.planning.transfers import backward_memory, fit_memory_budget
from distca_hf.tools.simulate import pack_pieces
from test_planner import (_check_plan, _same_plan, batches_with_key_only_prefixes, packed_batches, time_models,
                          windowed_configs)


def _check_queries(pieces: DocumentPieces, plan, config: PlannerConfig) -> None:
    """``test_planner._check_plan`` (every query once, block-aligned, only pool ranks serve); with
    key-only rows (queries that belong to no piece), every piece's queries exactly once, from the
    rank holding them, on pool ranks."""
    if (pieces.kv_start == pieces.start).all():
        _check_plan(pieces, plan, config, guarantee=False)
        return
    tasks = sorted(zip(plan.doc.tolist(), plan.q_start.tolist(), plan.q_end.tolist(), plan.source.tolist()))
    done = [(d, q, r) for d, a, b, r in tasks for q in range(a, b)]
    wanted = sorted((d, q, r) for d, a, b, r in zip(pieces.doc.tolist(), pieces.start.tolist(), pieces.end.tolist(),
                                                     pieces.rank.tolist()) for q in range(a, b))
    assert done == wanted
    assert set(plan.server.tolist()) <= set(config.servers if config.servers is not None else range(pieces.num_ranks))


def _auto(config: PlannerConfig, model: TimeModel, exposed: float, pool=None, **more) -> PlannerConfig:
    return PlannerConfig("auto", config.block, pool, config.token_bytes, window=config.window, time_model=model,
                         exposed_comm=exposed, **more)


@settings(max_examples=60, deadline=None)
@given(pieces=st.one_of(packed_batches(), batches_with_key_only_prefixes()), config=windowed_configs,
       model=time_models, exposed=st.sampled_from([0.0, 0.5, 1.0]), data=st.data())
def test_descent_plan_is_valid_deterministic_and_within_the_fan_out_bound(pieces, config, model, exposed, data):
    pool = tuple(data.draw(st.lists(st.integers(0, pieces.num_ranks - 1), min_size=1, unique=True))) \
        if data.draw(st.booleans()) else None
    auto = _auto(config, model, exposed, pool)
    plan = descend(pieces, auto)
    _check_queries(pieces, plan, auto)
    assert _same_plan(plan, descend(pieces, auto))
    if pool is None:  # (ranks outside a pool must give everything away, whatever the bound)
        bounds, servers = fan_out_bounds(pieces, auto), document_servers(plan)
        assert all(servers[doc] <= bounds[doc] for doc in servers)


@settings(max_examples=60, deadline=None)
@given(pieces=st.one_of(packed_batches(), batches_with_key_only_prefixes()), config=windowed_configs,
       model=time_models, exposed=st.sampled_from([0.0, 0.5, 1.0]), data=st.data())
def test_auto_is_never_predicted_slower_than_colocated_or_the_auto_before_the_descent(pieces, config, model, exposed,
                                                                                      data):
    pool = tuple(data.draw(st.lists(st.integers(0, pieces.num_ranks - 1), min_size=1, unique=True))) \
        if data.draw(st.booleans()) else None
    auto = _auto(config, model, exposed, pool, memory_budget=data.draw(st.sampled_from([None, 0.5, 2.0])))
    plan = plan_tasks(pieces, auto)
    _check_queries(pieces, plan, auto)
    seconds = step_seconds(plan, pieces, auto)
    servers = pool if pool is not None else tuple(range(pieces.num_ranks))
    old = [plan_by_tolerances(pieces, auto)] + [
        plan_tasks(pieces, dataclasses.replace(auto, tolerance=t)) for t in AUTO_TOLERANCES]
    if np.isin(pieces.rank[pieces.end > pieces.start], servers).all():
        old.append(fit_memory_budget(colocated_plan(pieces, servers, window=config.window), pieces, auto))
    assert all(seconds <= step_seconds(o, pieces, auto) * (1 + 1e-12) for o in old)
    assert _same_plan(plan, plan_tasks(pieces, auto))


def _long_document_batch(ranks: int = 64, tokens: int = 32768) -> DocumentPieces:
    """Issue 21's shape: a document of 10 ranks' tokens beside short ones (2k tokens each)."""
    long = 10 * tokens
    docs = np.array([2048] * (3 * tokens // 2048) + [long] + [2048] * ((ranks - 13) * tokens // 2048), dtype=np.int64)
    return pack_pieces(docs, ranks, tokens)


def test_a_long_documents_holders_bound_its_fan_out_and_the_descent_beats_the_carvings():
    """A 320k-token document spans 10 of 64 ranks (H100 model, Llama-3-8B bytes, nothing hidden): its
    last pieces hold ~20x the mean attention, and every server of its shards needs K/V from all of its
    holders. The descent spreads it to fewer servers than the carvings (the ``auto`` before it) do,
    within its fan-out bound, and predicts a step clearly faster than theirs and than colocated."""
    pieces = _long_document_batch()
    config = PlannerConfig("auto", block=128, token_bytes=LLAMA3_8B_BYTES, time_model=H100_MEASURED)
    plan = plan_tasks(pieces, config)
    old = plan_by_tolerances(pieces, config)
    colocated = colocated_plan(pieces)
    new_s, old_s, colocated_s = (step_seconds(p, pieces, config) for p in (plan, old, colocated))
    assert new_s < 0.85 * old_s and new_s < 0.3 * colocated_s
    long_doc = int(np.bincount(pieces.doc).argmax())  # the one document held as several pieces
    servers, bounds = document_servers(plan), fan_out_bounds(pieces, config)
    assert 10 < servers[long_doc] < document_servers(old)[long_doc]
    assert servers[long_doc] <= bounds[long_doc]


def test_a_key_only_holder_is_a_new_server_within_the_fan_out_bound():
    """Found by hypothesis: rank 6 holds only keys of the document (an empty query piece), so the
    document is computed on 7 ranks and its bound is 7; the descent gave rank 6 a shard as a holder,
    outside the bound, spreading the document to 8 servers."""
    start = np.array([0, 9, 18, 27, 36, 45, 54, 63])
    pieces = DocumentPieces(np.arange(8), np.zeros(8, dtype=np.int64), start, np.array([9, 18, 27, 36, 45, 53, 54, 64]),
                            8, kv_start=np.array([0, 9, 18, 27, 36, 45, 53, 54]))
    model = TimeModel(1e-6, 1e-9, task_s=1e-5, bytes_per_s=1e9, task_key_s=1e-8, collective_s=1e-4)
    auto = _auto(PlannerConfig(0.0, 1, token_bytes=TokenBytes(1, 10, 1, 0)), model, 1.0)
    plan = descend(pieces, auto)
    _check_queries(pieces, plan, auto)
    assert document_servers(plan)[0] <= fan_out_bounds(pieces, auto)[0] == 7


def test_descent_counts_base_pairs_as_other_work():
    """Two equal ranks, rank 1 with other work (``base_pairs``) worth its attention: the descent moves
    attention to rank 0 and the other work alone decides how much."""
    pieces = DocumentPieces.from_rank_lists([[4096], [4096]])
    model = TimeModel(0.0, 1e-9, bytes_per_s=1e15)
    config = PlannerConfig("auto", block=64, time_model=model)
    assert descend(pieces, config).moved_queries() == 0
    pairs = 4096 * 4097 // 2
    plan = descend(pieces, dataclasses.replace(config, base_pairs=(0.0, float(pairs))))
    served = plan.server_pairs()
    assert served[0] > served[1] and abs(served[0] - (served[1] + pairs)) <= 64 * 4096 + 1


@settings(max_examples=25, deadline=None)
@given(pieces=st.one_of(packed_batches(), batches_with_key_only_prefixes()), config=windowed_configs,
       model=time_models, budget=st.sampled_from([0.0, 0.1]))
def test_descents_sharing_a_start_plan_as_each_alone(pieces, config, model, budget):
    """``by_time`` plans the unbounded descent, the one timing ``resend``'s bytes and the one within
    the memory budget from one ``DescentStart``: each plans exactly as when planned alone (none
    changes what the next starts from), and a start prepared for other pieces or config is refused."""
    auto = _auto(config, model, 1.0, memory_budget=budget)
    held_mean = float(backward_memory(descend(pieces, auto), pieces, auto.token_bytes, backward="saved").held.mean())

    def plans(start):
        return [descend(pieces, auto, start=start), descend(pieces, auto, backward="resend", start=start),
                descend_within_memory(pieces, auto, held_mean=held_mean, start=start)[0],
                descend(pieces, auto, start=start)]

    start = DescentStart(pieces, auto)
    assert all(_same_plan(shared, alone) for shared, alone in zip(plans(start), plans(None)))
    with pytest.raises(ValueError, match="start"):
        descend(pieces, dataclasses.replace(auto), start=start)
