"""The per-rank time formula's one home (``planning/rank_time.py``) and ``PlannerConfig.base_pairs`` in
the judges: a rank's other work counts in ``rank_seconds`` (by hand), ``tolerance="auto"`` is never
predicted slower than any of its candidates once that work counts (hypothesis, against a reference
formula written out here), and a lockstep tick is judged with the LM head's share."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distca_hf.planning import (AUTO_TOLERANCES, DocumentPieces, Plan, PlannerConfig, TimeModel, TokenBytes,
                                colocated_plan, plan_loads, plan_tasks, rank_seconds, step_seconds)
from distca_hf.planning.baselines import pack_pieces
from distca_hf.planning.descent import descend
from distca_hf.planning.pipeline_cost import plan_lockstep_tick, pool_pieces
from distca_hf.planning.planner import tolerance_plans

MODEL = TimeModel(linear_s_per_token=1.0, attn_s_per_pair=0.5, task_s=3.0, bytes_per_s=4.0, task_key_s=0.25,
                  collective_s=7.0)


def _reference_seconds(plan: Plan, pieces: DocumentPieces, config: PlannerConfig) -> np.ndarray:
    """``[ranks]`` the time formula written out: other work (``base_pairs`` pairs of attention time,
    or each rank's own tokens' linear layers), the pairs, keys and tasks it serves, and the exposed
    share of the bytes it moves plus the collective when anything moves."""
    tm, loads = config.time_model, plan_loads(plan, pieces, config.token_bytes)
    other = tm.linear_s_per_token * pieces.tokens() if config.base_pairs is None else \
        tm.attn_s_per_pair * np.asarray(config.base_pairs)
    passes = {"saved": 2.0, "resend": 3.0}[plan.backward]
    moved = loads.sent + loads.received
    comm = config.exposed_comm * passes * moved / tm.bytes_per_s + (tm.collective_s if moved.sum() > 0 else 0.0)
    return (other + tm.attn_s_per_pair * loads.pairs + tm.task_key_s * loads.keys + tm.task_s * loads.tasks
            + comm)


def test_rank_seconds_count_base_pairs_by_hand():
    """``test_planner.test_rank_seconds_by_hand``'s plan with other work instead of the tokens' linear
    layers: 6 pairs' worth of it on rank 0, 40 on rank 1."""
    pieces = DocumentPieces.from_rank_lists([[10], [1, 1]])
    plan = Plan(source=np.array([0, 0, 1, 1]), server=np.array([0, 1, 1, 1]), doc=np.array([0, 0, 1, 2]),
                q_start=np.array([0, 7, 0, 0]), q_end=np.array([7, 10, 1, 1]), num_ranks=2, servers=(0, 1))
    config = PlannerConfig("auto", token_bytes=TokenBytes(2, 4, 2), time_model=MODEL, exposed_comm=0.5,
                           base_pairs=(6.0, 40.0))
    rank0 = 6 / 2 + 28 / 2 + 3 + 7 / 4 + 0.5 * 2 * 52 / 4 + 7
    rank1 = 40 / 2 + (27 + 1 + 1) / 2 + 3 * 3 + (10 + 1 + 1) / 4 + 0.5 * 2 * 52 / 4 + 7
    assert rank_seconds(plan, pieces, config).tolist() == pytest.approx([rank0, rank1])
    assert step_seconds(plan, pieces, config) == pytest.approx(max(rank0, rank1))
    with pytest.raises(ValueError, match="base_pairs gives 3 ranks"):
        rank_seconds(plan, pieces, dataclasses.replace(config, base_pairs=(1.0, 2.0, 3.0)))


@settings(max_examples=100, deadline=None)
@given(docs=st.lists(st.integers(1, 400), min_size=2, max_size=24), ranks=st.integers(2, 6),
       budget=st.sampled_from([64, 128, 256]), data=st.data())
def test_auto_with_base_pairs_is_never_slower_than_its_candidates(docs, ranks, budget, data):
    """With other work per rank (``base_pairs``, a pipeline tick's), the ``"auto"`` plan is predicted
    no slower than colocated, the descent's plan and every fixed-tolerance carving, all timed by the
    reference formula with that work: the judges, the bound that skips the carvings and the one that
    gives them up count it as the descent and the carving plan with it."""
    tokens = np.asarray(docs, dtype=np.int64)
    tokens = tokens[np.cumsum(tokens) <= ranks * budget] if tokens.sum() > ranks * budget else tokens
    if tokens.size == 0:
        return
    pieces = pack_pieces(tokens, ranks, budget)
    base = data.draw(st.lists(st.sampled_from([0.0, 500.0, 4000.0, 30000.0]), min_size=ranks, max_size=ranks))
    model = TimeModel(linear_s_per_token=2e-6, attn_s_per_pair=1e-8, task_s=1e-5, bytes_per_s=1e9,
                      task_key_s=5e-8, collective_s=5e-5)
    config = PlannerConfig("auto", block=8, time_model=model, token_bytes=TokenBytes(64, 32, 64),
                           base_pairs=tuple(base))
    chosen = _reference_seconds(plan_tasks(pieces, config), pieces, config).max()
    candidates = [colocated_plan(pieces), descend(pieces, config),
                  *tolerance_plans(pieces, config, AUTO_TOLERANCES)]
    for candidate in candidates:
        assert chosen <= _reference_seconds(candidate, pieces, config).max() * (1 + 1e-9)


def test_lockstep_tick_is_judged_on_attention_alone():
    """A tick of two stages of two ranks, one stage's rows shorter (less linear work). The tick's
    exchanges synchronise its ranks around the attention, so its plan is judged with no rank's other
    work (``base_pairs`` all 0): it is predicted faster there than the pooled plans balanced together
    with each rank's linear layers (as ``base_pairs`` or as the planner's default other work: both give
    the short row's rank more attention, which it cannot run while the others run their linear layers),
    and no slower than colocated."""
    model = TimeModel(linear_s_per_token=2e-6, attn_s_per_pair=1e-8, task_s=1e-5, bytes_per_s=1e9,
                      collective_s=5e-5)
    config = PlannerConfig("auto", block=8, time_model=model, token_bytes=TokenBytes(64, 32, 64))
    stage0 = pack_pieces(np.array([900, 60, 40, 24]), 2, 512)
    stage1 = pack_pieces(np.array([30] * 20 + [124]), 2, 512)
    pooled = pool_pieces([(stage0, 0), (stage1, 2)], 4)
    tick = plan_lockstep_tick(pooled, config, rank_groups=[range(0, 2), range(2, 4)])
    judge = dataclasses.replace(config, base_pairs=(0.0,) * 4)
    tokens = pooled.tokens()
    linear = dataclasses.replace(config, base_pairs=tuple(
        ((tokens - tokens.min()) * model.linear_s_per_token / model.attn_s_per_pair).tolist()))
    tick_s = _reference_seconds(tick, pooled, judge).max()
    for other in (plan_tasks(pooled, config), plan_tasks(pooled, linear)):
        assert tick_s < _reference_seconds(other, pooled, judge).max()
    assert tick_s <= _reference_seconds(colocated_plan(pooled), pooled, judge).max() * (1 + 1e-9)
