"""Key-split tiles chosen by time (``planning.tiles.apply_time_tiles``, issue 21 item 2): the tiled
plan keeps every (query, key) pair exactly once, is never predicted slower than its input, is
deterministic, and ``tolerance="auto"`` with ``key_split`` weighs it as one more candidate."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distca_hf.planning import (DocumentPieces, Plan, PlannerConfig, TimeModel, TokenBytes, check_tiles, colocated_plan,
                                plan_tasks, rank_seconds, step_seconds)
from distca_hf.planning.cost import causal_pairs
from distca_hf.planning.transfers import backward_memory
from distca_hf.planning.tiles import (apply_memory_tiles, apply_time_tiles, memory_tiles_lower_bound,
                                     memory_tiles_may_fit, tile_units)

# a layer where K/V bytes are dear (GQA: K/V per token 4x smaller than Q + O, but the long prefix
# fans out) and attention is cheap enough that the holders can take the tiles' pairs
TOKEN_BYTES = TokenBytes(q=64, kv=32, o=64, lse=4)
CHEAP_LINKS = TimeModel(linear_s_per_token=1e-6, attn_s_per_pair=1e-9, task_s=1e-6, bytes_per_s=1e6)


def _stream(lengths, ranks):
    """A global stream of documents cut into ``ranks`` nearly equal slices (documents span ranks)."""
    total = sum(lengths)
    bounds = [round(r * total / ranks) for r in range(ranks + 1)]
    rows, offset = [[] for _ in range(ranks)], 0
    for d, n in enumerate(lengths):
        for r in range(ranks):
            lo, hi = max(bounds[r], offset), min(bounds[r + 1], offset + n)
            if hi > lo:
                rows[r].append((d, lo - offset, hi - offset))
        offset += n
    return DocumentPieces.from_rank_lists(rows)


def _config(window, tolerance, bytes_per_s, key_split=False):
    return PlannerConfig(tolerance=tolerance, window=window, token_bytes=TOKEN_BYTES, key_split=key_split,
                         time_model=dataclasses.replace(CHEAP_LINKS, bytes_per_s=bytes_per_s))


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 120), min_size=1, max_size=5), ranks=st.integers(2, 5),
       window=st.one_of(st.none(), st.integers(4, 60)), tolerance=st.sampled_from([0.0, 0.3, "auto", "colocated"]),
       bytes_per_s=st.sampled_from([1e5, 1e6, 1e8]))
def test_time_tiles_keep_every_pair_once_and_are_never_predicted_slower(lengths, ranks, window, tolerance,
                                                                        bytes_per_s):
    pieces = _stream(lengths, ranks)
    config = _config(window, 0.02 if tolerance == "colocated" else tolerance, bytes_per_s)
    plan = colocated_plan(pieces, window=window) if tolerance == "colocated" else plan_tasks(pieces, config)
    tiled = apply_time_tiles(plan, pieces, config)
    check_tiles(tiled, pieces)
    assert tiled.pairs().sum() == plan.pairs().sum()
    if tiled is not plan:
        assert tiled.splits_keys
        assert step_seconds(tiled, pieces, config) < step_seconds(plan, pieces, config)
    again = apply_time_tiles(plan, pieces, config)  # deterministic
    assert (again is plan) == (tiled is plan)
    if again is not plan:
        for name in ("source", "server", "doc", "q_start", "q_end", "k_start", "k_end"):
            assert np.array_equal(getattr(again, name), getattr(tiled, name)), name


def test_a_long_prefix_fanning_out_becomes_tiles_on_its_holder_only_while_that_pays():
    """A 4-rank stream where one long document spans every rank, its last 8 queries on rank 3:
    colocated, each later rank receives the whole prefix. Dear links: queries travel to the K/V
    (every moved tile is a full one on its keys' holder) and the slowest rank gets faster. The units
    are every (later rank, earlier piece) pair."""
    pieces = _stream([330, 100], 4)
    dear = _config(None, 0.02, 1e6)
    plan = colocated_plan(pieces)
    tiled = apply_time_tiles(plan, pieces, dear)
    assert tiled is not plan and tiled.splits_keys
    check_tiles(tiled, pieces)
    held = {(int(r), int(d)): (int(k), int(e)) for r, d, k, e in zip(pieces.rank, pieces.doc, pieces.kv_start,
                                                                        pieces.end)}
    for i in np.flatnonzero(tiled.server != tiled.source):  # every moved tile is a full one on its keys' holder
        lo, hi = held[(int(tiled.server[i]), int(tiled.doc[i]))]
        assert tiled.k_end[i] < tiled.q_end[i] and lo <= tiled.k_start[i] < tiled.k_end[i] <= hi
    before, after = rank_seconds(plan, pieces, dear), rank_seconds(tiled, pieces, dear)
    assert after.max() < before.max()
    units = tile_units(plan, pieces)
    assert {(s, x0) for s, _, x0, _, _, _ in units} == {(s, x0) for s in range(1, 4) for x0 in (0, 108, 215)[:s]}


def test_auto_with_key_split_is_one_more_candidate_never_predicted_slower():
    """``tolerance="auto"`` with ``key_split=True`` plans tiles where they pay and otherwise returns the
    plan without them: never predicted slower than ``key_split=False``."""
    pieces = _stream([330, 100], 4)
    without, with_tiles = (_config(None, "auto", 1e6, key_split=k) for k in (False, True))
    plain, tiled = plan_tasks(pieces, without), plan_tasks(pieces, with_tiles)
    assert not plain.splits_keys and tiled.splits_keys
    check_tiles(tiled, pieces)
    assert step_seconds(tiled, pieces, with_tiles) < step_seconds(plain, pieces, without)
    balanced = _stream([50, 50, 50, 50], 4)
    assert not plan_tasks(balanced, dataclasses.replace(with_tiles)).splits_keys


def test_tiles_stay_in_the_server_pool():
    """One 5-token document over ranks 0-4, one token each, servers (0, 1), bytes free: a tile of the
    last query against key 3 pays on rank 3, which holds that key, but rank 3 is outside the pool (it
    was once given it)."""
    pieces = DocumentPieces(np.arange(5), np.zeros(5, dtype=np.int64), np.arange(5), np.arange(1, 6), 9,
                            kv_start=np.arange(5))
    model = TimeModel(0.0, 1e-9, task_s=0.0, bytes_per_s=1e5, task_key_s=0.0, collective_s=0.0)
    config = PlannerConfig("auto", block=1, servers=(0, 1), token_bytes=TokenBytes(8, 4, 8), time_model=model,
                           exposed_comm=0.0, key_split=True)
    plan = plan_tasks(pieces, config)
    assert set(plan.server.tolist()) <= {0, 1}
    assert plan.server_pairs().sum() == causal_pairs(0, 5)
    whole = Plan(np.arange(5), np.array([0, 1, 0, 1, 0]), np.zeros(5, dtype=np.int64), np.arange(5), np.arange(1, 6),
                 9, (0, 1))
    units = tile_units(whole, pieces)
    assert units and {holder for *_, holder, _ in units} <= {0, 1}


def test_key_split_setting_is_checked():
    with pytest.raises(ValueError, match="key_split must be True or False"):
        PlannerConfig(key_split="yes")


def test_a_pipeline_tick_keeps_each_stage_plans_tiles():
    """A ``cad_1f1b`` tick weighs the union of each stage's own plan (``pipeline_cost``): the tiles of a
    stage plan that splits keys stay tiles in it (every pair once), as in the stage's plan."""
    import numpy as np

    from distca_hf.planning.pipeline_cost import _union_of_stage_plans, pool_pieces

    stage = _stream([330, 100], 4)
    config = _config(None, "auto", 1e6, key_split=True)
    assert plan_tasks(stage, config).splits_keys  # the stage plan alone tiles
    pooled = pool_pieces([(stage, 0), (stage, 4)], 8)
    union = _union_of_stage_plans(pooled, [np.arange(4), np.arange(4, 8)], lambda ranks: config, config)
    assert union.splits_keys
    check_tiles(union, pooled)
    assert union.pairs().sum() == 2 * plan_tasks(stage, config).pairs().sum()


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 400), min_size=1, max_size=6), ranks=st.integers(2, 5),
       window=st.one_of(st.none(), st.integers(4, 60)), planner=st.sampled_from(["colocated", 0.0, 0.3, "auto"]),
       budget=st.sampled_from([0.0, 0.05, 0.3]), bytes_per_s=st.sampled_from([1e5, 1e6, 1e8]),
       factor=st.sampled_from([0.5, 0.9, 0.99, 1.0, 1.01, 2.0]), attn=st.sampled_from([1e-9, 1e-7]))
def test_memory_tiles_bounds_never_exceed_the_tiled_plans_step(lengths, ranks, window, planner, budget, bytes_per_s,
                                                               factor, attn):
    # the bound by_time skips colocated's memory tiles with must hold whatever units apply_memory_tiles converts
    pieces = _stream(lengths, ranks)
    config = _config(window, 0.02 if planner == "colocated" else planner, bytes_per_s)
    config = dataclasses.replace(config, time_model=dataclasses.replace(config.time_model, attn_s_per_pair=attn))
    plan = colocated_plan(pieces, window=window) if planner == "colocated" else plan_tasks(pieces, config)
    if plan.splits_keys:
        return
    tiled = apply_memory_tiles(plan, pieces, TOKEN_BYTES, budget)
    assert tiled.backward == "saved"
    tiled_seconds = step_seconds(tiled, pieces, config)
    assert memory_tiles_lower_bound(plan, pieces, config) <= tiled_seconds * (1 + 1e-9)
    # ...and the one it skips them with where they cannot fit
    assert memory_tiles_may_fit(plan, pieces, TOKEN_BYTES, budget) or not backward_memory(
        tiled, pieces, TOKEN_BYTES).fits(budget)
    # give_up_at: the tiles not built only where by_time could keep neither them nor the key ranges
    # alone (over the budget whatever the units, or predicted no faster than give_up_at); else the very
    # same plan
    give_up_at = factor * tiled_seconds
    again = apply_memory_tiles(plan, pieces, TOKEN_BYTES, budget, config=config, give_up_at=give_up_at)
    tiled_fits = backward_memory(tiled, pieces, TOKEN_BYTES).fits(budget)
    if again is plan and tiled is not plan:
        assert not (tiled_fits and tiled_seconds < give_up_at)
        if tiled.num_tasks != plan.num_tasks and tiled_fits:  # units applied, within the budget: no faster
            assert tiled_seconds >= give_up_at * (1 - 1e-9)
    if tiled.num_tasks != plan.num_tasks:
        if tiled_fits:  # a hair above their step: never given up
            assert apply_memory_tiles(plan, pieces, TOKEN_BYTES, budget, config=config,
                                      give_up_at=tiled_seconds * (1 + 1e-6)) is not plan
    elif again is plan:  # given up with no units applied: the key ranges alone were over the budget
        assert tiled is plan or not tiled_fits
    else:
        for name in ("source", "server", "doc", "q_start", "q_end", "k_start", "k_end"):
            assert np.array_equal(getattr(again, name), getattr(tiled, name)), name



def test_memory_tiles_may_fit_tells_plans_no_tiles_bring_within_the_budget():
    """A carving at tolerance 0 moves tails of single-piece documents: their servers receive K/V that
    no tile gives back (a task's causal tile stays), and one stays over a budget of 5%, tiles or not:
    ``memory_tiles_may_fit`` says so (``by_time`` skips the tiles). Where tiles fit, it never does."""
    pieces = _stream([208, 320, 383, 186, 48, 371], 3)
    plan = plan_tasks(pieces, _config(None, 0.0, 1e6))
    tiled = apply_memory_tiles(plan, pieces, TOKEN_BYTES, 0.05)
    assert not memory_tiles_may_fit(plan, pieces, TOKEN_BYTES, 0.05)
    assert not backward_memory(tiled, pieces, TOKEN_BYTES).fits(0.05)
    assert memory_tiles_may_fit(plan, pieces, TOKEN_BYTES, 0.5)  # a looser budget: it cannot tell
    # tiles that fit only as their holders' extra rows raise the mean (the limit) with them
    pieces = _stream([259, 232, 254, 390], 3)
    plan = plan_tasks(pieces, _config(None, 0.3, 1e6))
    assert backward_memory(apply_memory_tiles(plan, pieces, TOKEN_BYTES, 0.05), pieces, TOKEN_BYTES).fits(0.05)
    assert memory_tiles_may_fit(plan, pieces, TOKEN_BYTES, 0.05)
    short = iter(range(1, 100))  # the tiles below fit (test_memory_tiles_give_up_only_below_the_tiled_plans_step)
    pieces = DocumentPieces.from_rank_lists([[(0, 0, 200)], [(0, 200, 216)] + [(next(short), 0, 150) for _ in range(3)],
                                             *[[(next(short), 0, 8) for _ in range(27)] for _ in range(2)]])
    tb = TokenBytes(q=8, kv=4, o=8, lse=2)
    plan = colocated_plan(pieces)
    assert backward_memory(apply_memory_tiles(plan, pieces, tb, 0.05), pieces, tb).fits(0.05)
    assert memory_tiles_may_fit(plan, pieces, tb, 0.05)


def test_memory_tiles_give_up_only_below_the_tiled_plans_step():
    """Document 0 fills rank 0 and ends with 16 tokens on rank 1, whose queries the memory tiles give
    to rank 0 (as in ``test_memory``); rank 1, with three more documents, stays the slowest. Asked to
    beat a step just above the tiled plan's, the same tiles come back; just below it (the key ranges
    alone over the budget), none are built."""
    short = iter(range(1, 100))
    pieces = DocumentPieces.from_rank_lists([[(0, 0, 200)], [(0, 200, 216)] + [(next(short), 0, 150) for _ in range(3)],
                                             *[[(next(short), 0, 8) for _ in range(27)] for _ in range(2)]])
    tb = TokenBytes(q=8, kv=4, o=8, lse=2)
    config = PlannerConfig(token_bytes=tb, time_model=TimeModel(1e-8, 1e-6, bytes_per_s=1e6))
    plan = colocated_plan(pieces)
    tiled = apply_memory_tiles(plan, pieces, tb, 0.05)
    assert tiled.splits_keys and tiled.num_tasks > plan.num_tasks and backward_memory(tiled, pieces, tb).fits(0.05)
    seconds = step_seconds(tiled, pieces, config)
    assert int(np.argmax(rank_seconds(tiled, pieces, config))) == 1
    kept = apply_memory_tiles(plan, pieces, tb, 0.05, config=config, give_up_at=seconds * 1.001)
    assert np.array_equal(kept.k_start, tiled.k_start) and np.array_equal(kept.server, tiled.server)
    assert apply_memory_tiles(plan, pieces, tb, 0.05, config=config, give_up_at=seconds * 0.999) is plan
