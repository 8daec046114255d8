"""The layer-time lower bound (``planning.layer_bound``): never above any plan's predicted step (the
planner's own plans and random plans, key-split tiles and both backward modes included), and exact
where the answer is known by hand."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distca_hf.planning import (DocumentPieces, Plan, PlannerConfig, TimeModel, TokenBytes, colocated_plan, plan_tasks,
                                step_seconds)
from distca_hf.planning.cost import causal_pairs
from distca_hf.planning.layer_bound import bound_terms, layer_time_lower_bound, least_bytes
from test_planner import batches_with_key_only_prefixes, packed_batches

time_models = st.sampled_from([
    TimeModel(1e-6, 1e-9, task_s=1e-5, bytes_per_s=1e9, task_key_s=1e-8, collective_s=1e-4),  # compute-bound
    TimeModel(1e-6, 1e-9, task_s=1e-5, bytes_per_s=1e6, task_key_s=1e-8, collective_s=1e-4),  # slow network
    TimeModel(1e-6, 1e-9, task_s=1e-3, bytes_per_s=1e7, collective_s=5e-2),  # dear collectives and tasks
    TimeModel(0.0, 1e-9, bytes_per_s=1e5),  # attention and bytes alone
])


@st.composite
def random_plans(draw, pieces: DocumentPieces, servers: tuple[int, ...], window):
    """Any plan of ``pieces``: every piece's queries cut at random, each shard on a random server and,
    without a window, its keys cut into tiles (a causal tile and full tiles before it) on random servers."""
    rows = []  # (source, server, doc, q_start, q_end, k_start, k_end)
    for i in np.flatnonzero(pieces.end > pieces.start):
        a, b = int(pieces.start[i]), int(pieces.end[i])
        cuts = sorted(set(draw(st.lists(st.integers(a + 1, b - 1), max_size=2)) if b - a > 1 else []))
        for q0, q1 in zip([a, *cuts], [*cuts, b]):
            if window is None and draw(st.booleans()):
                key_cuts = sorted(set(draw(st.lists(st.integers(1, q0), max_size=2)) if q0 > 0 else []))
                for k0, k1 in zip([0, *key_cuts], [*key_cuts, q1]):
                    rows.append((int(pieces.rank[i]), draw(st.sampled_from(servers)), int(pieces.doc[i]), q0, q1, k0, k1))
            else:
                first = 0 if window is None else max(q0 - window + 1, 0)
                rows.append((int(pieces.rank[i]), draw(st.sampled_from(servers)), int(pieces.doc[i]), q0, q1, first, q1))
    source, server, doc, q0, q1, k0, k1 = (np.asarray(c, dtype=np.int64) for c in zip(*rows))
    return Plan(source, server, doc, q0, q1, pieces.num_ranks, servers, window, draw(st.sampled_from(["saved", "resend"])),
                k0, k1)


@settings(max_examples=25, deadline=None)
@given(pieces=st.one_of(packed_batches(), batches_with_key_only_prefixes()), model=time_models,
       exposed=st.sampled_from([0.0, 0.5, 1.0]), window=st.sampled_from([None, None, 3, 16]),
       token_bytes=st.sampled_from([TokenBytes(8, 4, 8), TokenBytes(1, 10, 1), TokenBytes(4, 0, 4)]),
       pool=st.booleans(), data=st.data())
def test_the_bound_is_never_above_a_plans_predicted_step(pieces, model, exposed, window, token_bytes, pool, data):
    if not (pieces.end > pieces.start).any():
        return
    servers = tuple(range(pieces.num_ranks))
    if pool and pieces.num_ranks > 1:
        servers = tuple(sorted(data.draw(st.sets(st.sampled_from(servers), min_size=1, max_size=pieces.num_ranks - 1))))
    config = PlannerConfig("auto", block=data.draw(st.sampled_from([1, 4])), servers=servers, token_bytes=token_bytes,
                           window=window, time_model=model, exposed_comm=exposed, key_split=window is None)
    bound = layer_time_lower_bound(pieces, config)
    plans = [data.draw(random_plans(pieces, servers, window)) for _ in range(3)]
    plans += [plan_tasks(pieces, config), plan_tasks(pieces, dataclasses.replace(config, tolerance=0.02))]
    if set(pieces.rank[pieces.end > pieces.start].tolist()) <= set(servers):
        plans.append(colocated_plan(pieces, servers, window=window))
    for plan in plans:
        seconds = step_seconds(plan, pieces, config)
        assert bound <= seconds * (1 + 1e-9), (bound, seconds, plan)
    # it keeps at least every rank's other work and the mean attention over the pool
    tm = model
    assert bound >= max(tm.linear_s_per_token * pieces.tokens().max(),
                        tm.attn_s_per_pair * causal_pairs(pieces.start, pieces.end, window).sum() / len(servers)) * (1 - 1e-4)


def _one_document_per_rank(lengths) -> DocumentPieces:
    n = len(lengths)
    return DocumentPieces(np.arange(n), np.arange(n), np.zeros(n, dtype=np.int64), np.asarray(lengths), n)


@pytest.mark.parametrize("lengths", [[64, 64], [100, 10, 10], [512, 1, 1, 1]])
def test_with_free_bytes_the_bound_is_the_water_level_of_the_pairs(lengths):
    """Bytes, keys and the collective free: no plan beats every rank at its own linear work plus the
    mean attention, and the bound finds exactly that level (equal tokens: it is the mean), or a
    rank's linear work when that is higher."""
    model = TimeModel(2e-6, 1e-9, task_s=0.0, bytes_per_s=1e30, task_key_s=0.0, collective_s=0.0)
    pieces = _one_document_per_rank(lengths)
    config = PlannerConfig("auto", time_model=model)
    pairs = causal_pairs(0, np.asarray(lengths)).astype(float)
    tokens = np.asarray(lengths, dtype=float)
    other = model.linear_s_per_token * tokens
    # the water level: sum over ranks of max(0, level - other) = the pairs' attention time
    levels = np.sort(other)
    level = None
    for k in range(len(levels), 0, -1):
        candidate = (model.attn_s_per_pair * pairs.sum() + levels[:k].sum()) / k
        if candidate >= levels[k - 1]:
            level = candidate
            break
    level = max(level, other.max())
    assert layer_time_lower_bound(pieces, config) == pytest.approx(level, rel=1e-5)


def test_bytes_raise_the_bound_by_what_shedding_a_long_document_must_move():
    """Rank 0 holds one 1000-token document, rank 1 a thousand 1-token ones (equal linear work):
    balancing sends at least (pairs shed) / 1000 query tokens out and back, so with slow links the
    bound rises above the free-bytes level by at least that; and it is never above colocated."""
    pieces = DocumentPieces(np.r_[0, np.ones(1000, dtype=np.int64)], np.arange(1001), np.zeros(1001, dtype=np.int64),
                            np.r_[1000, np.ones(1000, dtype=np.int64)], 2)
    free = TimeModel(0.0, 1e-9, task_s=0.0, bytes_per_s=1e30, task_key_s=0.0, collective_s=0.0)
    slow = dataclasses.replace(free, bytes_per_s=1e6)
    tb = TokenBytes(q=8, kv=4, o=8)
    pairs = causal_pairs(0, 1000) + 1000
    level_free = layer_time_lower_bound(pieces, PlannerConfig("auto", time_model=free, token_bytes=tb))
    assert level_free == pytest.approx(1e-9 * pairs / 2, rel=1e-5)
    slow_config = PlannerConfig("auto", time_model=slow, token_bytes=tb)
    level = layer_time_lower_bound(pieces, slow_config)
    # rank 0 at the level keeps S pairs and sheds P0 - S, at least (P0 - S) / 1000 query tokens of 16 bytes
    # out and back, twice (saved): level >= 1e-9 S + 2 * 16 (P0 - S) / 1000 / 1e6, with S <= level / 1e-9
    p0 = causal_pairs(0, 1000)
    rank0 = lambda s: 1e-9 * s + 2 * 16 * (p0 - s) / 1000 / 1e6
    assert level > level_free * 1.01
    assert level >= min(rank0(s) for s in np.linspace(0, p0, 2001) if 1e-9 * (pairs - s) <= level + 1e-12) * (1 - 1e-6)
    assert level <= step_seconds(colocated_plan(pieces), pieces, slow_config)
    terms = bound_terms(pieces, slow_config)
    assert terms.per_query[0] == 1000 and terms.foreign.sum() == 0


def test_servers_outside_the_batch_are_refused_naming_them():
    pieces = DocumentPieces.from_rank_lists([[4], [2]])
    with pytest.raises(ValueError, match=r"PlannerConfig.servers=\(5,\) names server rank 5, which does not exist in a world of 2 ranks"):
        layer_time_lower_bound(pieces, PlannerConfig("auto", servers=(5,)))


_positive = st.floats(1.0, 100.0)


@settings(max_examples=60, deadline=None)
@given(own=st.floats(0.0, 1000.0), foreign_share=st.floats(0.0, 1.0), held=st.floats(0.0, 1000.0),
       divisors=st.tuples(*(_positive,) * 5), served=st.floats(0.0, 2000.0),
       query_bytes=st.floats(1.0, 10.0), kv_bytes=st.floats(1.0, 10.0))
def test_least_bytes_is_the_least_over_a_grid_of_its_two_choices(own, foreign_share, held, divisors, served,
                                                                 query_bytes, kv_bytes):
    """``least_bytes`` minimises the module docstring's bytes over how many own pairs go away and how
    many served pairs have their key here: a fine grid over both (the same formula written out) never
    finds fewer bytes (the vertex where the incoming queries' two counts cross was once placed at
    ``here = received / (h M)`` instead of ``received h / M``: up to 1.3x too many), and a node lies
    within one grid step of the least point, so the grid's least is above it by at most the bytes'
    slope times those steps."""
    per_query, foreign_queries, held_keys, held_away, most = divisors
    foreign = own * foreign_share
    terms = SimpleNamespace(pairs=np.array([own]), foreign=np.array([foreign]), held=np.array([held]),
                            inverses=tuple(np.array([1.0 / x]) for x in divisors))
    got = float(least_bytes(terms, np.array([served]), query_bytes, kv_bytes)[0])
    away = np.linspace(max(own - served, 0.0), own, 401)[:, None]
    received = np.maximum(served - own + away, 0.0)
    here = np.minimum(held, received) * np.linspace(0.0, 1.0, 401)[None, :]
    grid = (query_bytes * away / per_query + kv_bytes * np.maximum(foreign - away, 0.0) / foreign_queries
            + query_bytes * np.maximum(received / most, here / held_keys) + kv_bytes * (held - here) / held_away)
    assert got <= grid.min() * (1 + 1e-9) + 1e-9
    # the bytes' slopes: per own pair sent away (queries out, foreign keys in, queries received) and per
    # served pair whose key is here; `here` moves by at most one of its own steps plus one of `away`'s
    # (its top follows `received`)
    step_away, step_here = (own - max(own - served, 0.0)) / 400, held / 400
    slope_away = query_bytes / per_query + kv_bytes / foreign_queries + query_bytes / most
    slope_here = query_bytes / held_keys + kv_bytes / held_away
    slack = slope_away * step_away + slope_here * (step_here + step_away)
    assert got >= grid.min() - slack - 1e-9


def _every_plan(pieces: DocumentPieces, cut: int):
    """Every plan of ``pieces`` whose queries are cut every ``cut`` tokens and whose tasks' keys are cut at
    the same multiples (each tile on either rank of two): brute force for a tiny batch."""
    tiles = []  # per tile: (source, doc, q0, q1, k0, k1)
    for i in np.flatnonzero(pieces.end > pieces.start):
        a, b = int(pieces.start[i]), int(pieces.end[i])
        bounds = sorted({a, b, *range(a - a % cut + cut, b, cut)})
        for q0, q1 in zip(bounds, bounds[1:]):
            options = [[(0, q1)]] + [[(0, k), (k, q1)] for k in range(cut, q0 + 1, cut)]
            tiles.append([(int(pieces.rank[i]), int(pieces.doc[i]), q0, q1, k0, k1) for k0, k1 in max(options, key=len)]
                         if q0 >= cut else [(int(pieces.rank[i]), int(pieces.doc[i]), q0, q1, 0, q1)])
    rows = [t for group in tiles for t in group]
    for servers in np.ndindex(*(2,) * len(rows)):
        source, doc, q0, q1, k0, k1 = (np.asarray(c, dtype=np.int64) for c in zip(*rows))
        for backward in ("saved", "resend"):
            yield Plan(source, np.asarray(servers, dtype=np.int64), doc, q0, q1, 2, (0, 1), None, backward, k0, k1)


@pytest.mark.parametrize("bytes_per_s", [3e6, 3e7, 1e9])
def test_the_bound_is_below_and_near_the_best_of_every_plan(bytes_per_s):
    """Brute force on two ranks (a 12-token document beside three 4-token ones, cut every 4 tokens,
    keys too): the bound never exceeds the best plan, and stays within a factor of it."""
    pieces = DocumentPieces([0, 1, 1, 1], np.arange(4), np.zeros(4, dtype=np.int64), [12, 4, 4, 4], 2)
    model = TimeModel(1e-9, 1e-6, task_s=0.0, bytes_per_s=bytes_per_s, task_key_s=0.0, collective_s=1e-6)
    config = PlannerConfig("auto", time_model=model, token_bytes=TokenBytes(q=8, kv=4, o=8), key_split=True)
    best = min(step_seconds(plan, pieces, config) for plan in _every_plan(pieces, 4))
    bound = layer_time_lower_bound(pieces, config)
    assert bound <= best * (1 + 1e-9)
    assert bound >= 0.8 * best, (bound, best)
