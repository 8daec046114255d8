"""Rehoming a plan into the memory budget (``planning.rehome``): whole groups of served tasks move to
servers with room, checked against the exact memory formula and time model recomputed from scratch
on the result (not the module's running bookkeeping), and ``tolerance="auto"`` keeping the descent's
``saved``-mode plan where it used to fall back to ``resend``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distca_hf.planning import (PlannerConfig, TimeModel, TokenBytes, backward_memory, by_time, plan_tasks, rank_seconds,
                                step_seconds)
from distca_hf.planning.baselines import pack_pieces
from distca_hf.planning.cost import H100_MEASURED
from distca_hf.planning.descent import descend
from distca_hf.planning.rehome import rehome_within_memory

TB = TokenBytes(q=8, kv=4, o=8, lse=2)
MOVING_PAYS = TimeModel(1e-8, 1e-9, task_s=1e-6, bytes_per_s=1e10, collective_s=1e-6)
DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "doc_lengths_wlbllm.json"


def _check_rehomed(plan, rehomed, pieces, config, ceiling=None):
    """What rehoming may change, recomputed from scratch: only servers (every query still computed
    once, from its own rank); only tasks of servers over the limit, whole groups (server, document),
    each to a server that neither held nor served its document; the budget fits and the total memory
    stays; the servers that took groups end within ``ceiling`` (default: the plan's step in ``saved``
    mode), those that only gave them are faster, every other rank's predicted time is unchanged."""
    saved = dataclasses.replace(plan, backward="saved")
    assert rehomed.backward == "saved"
    for name in ("source", "doc", "q_start", "q_end"):
        np.testing.assert_array_equal(getattr(rehomed, name), getattr(saved, name))
    before = backward_memory(saved, pieces, config.token_bytes)
    after = backward_memory(rehomed, pieces, config.token_bytes)
    assert after.fits(config.memory_budget)
    assert after.held.sum() == before.held.sum()
    moved = rehomed.server != saved.server
    over = before.held > before.limit(config.memory_budget) * (1 + 1e-12)
    assert over[saved.server[moved]].all()
    holds = set(zip(pieces.rank.tolist(), pieces.doc.tolist()))
    served = set(zip(saved.server.tolist(), saved.doc.tolist()))
    for server, doc in zip(rehomed.server[moved].tolist(), rehomed.doc[moved].tolist()):
        assert (server, doc) not in holds and (server, doc) not in served
    for old_server, doc in zip(saved.server[moved].tolist(), saved.doc[moved].tolist()):
        assert not ((saved.server == old_server) & (saved.doc == doc) & ~moved).any()  # whole groups move
    times_before = rank_seconds(saved, pieces, config)
    times_after = rank_seconds(rehomed, pieces, config)
    ceiling = times_before.max() if ceiling is None else ceiling
    gave, took = np.unique(saved.server[moved]), np.unique(rehomed.server[moved])
    assert (times_after[took] <= ceiling * (1 + 1e-9)).all()
    # (a server brought within the limit may take another's group afterwards: the ceiling above bounds it)
    only_gave = np.setdiff1d(gave, took)
    assert (times_after[only_gave] < times_before[only_gave]).all()
    untouched = np.ones(pieces.num_ranks, dtype=bool)
    untouched[gave] = untouched[took] = False
    np.testing.assert_allclose(times_after[untouched], times_before[untouched], rtol=1e-12)
    return bool(moved.any())


def _batch(seed: int, ranks: int, tokens: int, median: int):
    """Lognormal documents (seeded) packed into ``ranks`` of ``tokens``: many servers, each with room
    in memory for the groups of a few others."""
    rng = np.random.default_rng(seed)
    docs = np.clip(rng.lognormal(np.log(median), 1.0, 4000), 1, tokens // 2).astype(np.int64)
    return pack_pieces(docs[np.cumsum(docs) <= ranks * tokens], ranks, tokens)


SHAPES = [(24, 4096, 300), (32, 1024, 60)]


def _rehome_case(pieces, budget, resend_ceiling):
    config = PlannerConfig(tolerance="auto", block=8, token_bytes=TB, time_model=MOVING_PAYS, memory_budget=budget)
    plan = descend(pieces, config, backward="saved")
    ceiling = (step_seconds(dataclasses.replace(plan, backward="resend"), pieces, config) if resend_ceiling
               else None)
    rehomed = rehome_within_memory(plan, pieces, config, ceiling=ceiling)
    if rehomed is None:
        return None
    if backward_memory(plan, pieces, TB).fits(budget):
        np.testing.assert_array_equal(rehomed.server, plan.server)
    return _check_rehomed(plan, rehomed, pieces, config, ceiling)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), shape=st.sampled_from(SHAPES), budget=st.sampled_from([0.0, 0.1, 0.2]),
       resend_ceiling=st.booleans())
def test_rehomed_plans_fit_move_whole_groups_and_never_slow_the_step(seed, shape, budget, resend_ceiling):
    _rehome_case(_batch(seed, *shape), budget, resend_ceiling)


def test_rehoming_moves_groups_on_many_batches():
    """The property above is not vacuous: on these seeds groups do move (6 of 20 batches when measured)."""
    moved = [_rehome_case(_batch(seed, *SHAPES[0]), 0.2, True) for seed in range(20)]
    assert sum(1 for m in moved if m) >= 3


def test_rehoming_brings_an_over_full_server_within_the_budget():
    """Three ranks, each holding a 96-token document and nothing else but rank 2's short ones; a plan
    that puts rank 0's and rank 1's late queries on rank 2 piles both prefixes there. Moving one group
    to rank 3 (empty of work) brings rank 2 within 0.3: exactly that group moves."""
    from distca_hf.planning import DocumentPieces, Plan
    pieces = DocumentPieces.from_rank_lists([[(0, 0, 96)], [(1, 0, 96)], [(2, 0, 8), (3, 0, 8)], [(4, 0, 8)]])
    # rank 0's queries [64, 96) and rank 1's [64, 96) computed on rank 2, everything else at home
    plan = Plan(source=np.array([0, 0, 1, 1, 2, 2, 3]), server=np.array([0, 2, 1, 2, 2, 2, 3]),
                doc=np.array([0, 0, 1, 1, 2, 3, 4]), q_start=np.array([0, 64, 0, 64, 0, 0, 0]),
                q_end=np.array([64, 96, 64, 96, 8, 8, 8]), num_ranks=4, servers=(0, 1, 2, 3))
    config = PlannerConfig(tolerance="auto", token_bytes=TB, time_model=MOVING_PAYS, memory_budget=0.3)
    assert not backward_memory(plan, pieces, TB).fits(0.3)
    rehomed = rehome_within_memory(plan, pieces, config)
    _check_rehomed(plan, rehomed, pieces, config)
    assert (rehomed.server != plan.server).sum() == 1 and rehomed.server[rehomed.server != plan.server][0] == 3


def test_auto_keeps_the_saved_descent_within_the_budget(monkeypatch):
    """A wlbllm-like batch (32 ranks x 128k, seeded): the descent planned without the budget is over it
    (a few servers hold the prefixes of the shards they took); before rehoming, ``auto`` ran the step
    in ``resend`` mode (618.8 ms predicted); now the same descent, groups moved, runs ``saved`` within
    the budget, faster."""
    if not DATA.exists():
        pytest.skip(f"{DATA} (the shared length samples) is not here")
    from distca_hf.tools.simulate import draw_batch
    lengths = np.asarray(json.loads(DATA.read_text()), dtype=np.int64)
    rng = np.random.default_rng(17)
    rng.choice([16, 32]), rng.choice([32768, 65536, 131072])  # the draws the batch was found with
    pieces = pack_pieces(draw_batch(lengths, 32 * 131072, rng), 32, 131072)
    config = PlannerConfig(tolerance="auto", block=128, memory_budget=0.1, time_model=H100_MEASURED)
    plan = plan_tasks(pieces, config)
    assert plan.backward == "saved" and backward_memory(plan, pieces, config.token_bytes).fits(0.1)
    monkeypatch.setattr(by_time, "rehome_within_memory", lambda *args, **kwargs: None)
    before = plan_tasks(pieces, config)
    assert before.backward == "resend"
    assert step_seconds(plan, pieces, config) < 0.97 * step_seconds(before, pieces, config)
