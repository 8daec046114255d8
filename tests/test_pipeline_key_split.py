"""``pipeline_schedule="cad_1f1b"`` running tick plans with key-split tiles (``planning.tiles``, the
tile grid, both weighing a tick's ``base_pairs``) or with K/V relay trees (``Plan.relays``): the runtime
passes ``key_split`` and ``kv_relays`` to ``planning.plan_lockstep_tick`` as ``distca-hf simulate`` plans
its ticks, and the tiled or relayed ticks (forward in ``resend`` mode, the backward tick's own plan)
train exactly like one process.

Tiles need a document whose pieces lie on several ranks of a tick, so the stages have two data-parallel
copies with documents spanning them (2 stages x 2: four gloo ranks; with one copy per stage every
document of a tick lies on one rank and no tile can form).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_harness import run_ranks
from distca_hf.planning import PlannerConfig, plan_tasks, step_seconds, tile_grid
from distca_hf.planning.baselines import pack_pieces
from distca_hf.planning.by_time import judged
from distca_hf.planning.cost import H100_MEASURED, LLAMA3_8B_BYTES, causal_pairs
from distca_hf.planning.key_split import check_tiles
from test_planner import packed_batches, time_models


def test_tile_grid_weighs_a_ticks_base_pairs():
    """A 40k-token document dominating 16 ranks of 4k (a pipeline tick's shape), every odd rank busy
    with other work worth twice the mean attention (``base_pairs``): the grid placed with that work
    counted is predicted faster, judged with it, than the grid placed blind to it (rank_time's formula
    for both), its busy ranks serve less, and ``"auto"``, which weighs the grid in ticks too, is never
    predicted slower than it."""
    rng = np.random.default_rng(5)
    docs = np.concatenate(([40960], rng.integers(64, 2048, 200)))
    pieces = pack_pieces(docs[np.cumsum(docs) <= 16 * 4096], 16, 4096)
    busy = np.arange(16) % 2 == 1
    base = np.where(busy, 2.0 * causal_pairs(pieces.start, pieces.end).sum() / 16, 0.0)
    blind = PlannerConfig("auto", 128, None, LLAMA3_8B_BYTES, time_model=H100_MEASURED, backward="resend",
                          key_split=True)
    config = dataclasses.replace(blind, base_pairs=tuple(base.tolist()))
    weighed, unweighed = tile_grid.tile_grid_plan(pieces, config), tile_grid.tile_grid_plan(pieces, blind)
    check_tiles(weighed, pieces)
    assert weighed.splits_keys and weighed.backward == "resend"
    assert step_seconds(weighed, pieces, config) < 0.9 * step_seconds(unweighed, pieces, config)
    assert weighed.server_pairs()[busy].sum() < unweighed.server_pairs()[busy].sum()
    grid_seconds, _ = judged(weighed, pieces, config)
    assert step_seconds(plan_tasks(pieces, config), pieces, config) <= grid_seconds * (1 + 1e-12)


@settings(max_examples=60, deadline=None)
@given(pieces=packed_batches(), model=time_models, budget=st.sampled_from([0.0, 0.1, 0.5]))
def test_resend_plans_stay_resend_with_key_split(pieces, model, budget):
    """A tick plans in ``resend`` mode (its backward meets other servers): ``"auto"`` with ``key_split``
    returns a ``resend`` plan whatever the memory budget (memory tiles are a ``saved``-mode plan's way
    within it; a ``saved`` plan would be refused by the dispatch whose backward is planned apart)."""
    config = PlannerConfig("auto", 2, None, LLAMA3_8B_BYTES, time_model=model, backward="resend",
                           memory_budget=budget, key_split=True)
    assert plan_tasks(pieces, config).backward == "resend"


def _tick_counting_worker(rank, world, cases):
    """``test_pipeline_train``'s cases, the ticks planned by the runtime's own ``plan_lockstep_tick``,
    counting per case the tick plans, those planned with ``key_split``, those holding tiles and those
    relaying K/V along trees."""
    from distca_hf.planning import plan_lockstep_tick
    from distca_hf.runtime import pipeline_schedules
    from test_pipeline_train import _cases_worker

    made = []  # per case: [tick plans, planned with key_split, holding tiles, relaying K/V]

    def counting(pieces, config, **kwargs):
        plan = plan_lockstep_tick(pieces, config, **kwargs)
        made[-1][0] += 1
        made[-1][1] += int(config.key_split)
        made[-1][2] += int(plan.splits_keys)
        made[-1][3] += int(plan.relays is not None and plan.relays.num_groups > 0)
        return plan

    pipeline_schedules.plan_lockstep_tick = counting
    results = []
    for case in cases:
        made.append([0, 0, 0, 0])
        results.extend(_cases_worker(rank, world, [case]))
    return {"results": results, "made": made}


@pytest.mark.distributed
def test_cad_1f1b_tick_plans_with_tiles_train_like_one_process(tmp_path):
    """A time model with dear links (tiles pay) under ``tolerance="auto"``: overlap none and wave (both
    run ``resend``); the ticks hold tiles, and after two optimizer steps every loss, gradient norm and
    parameter equals one process running each document alone with eager attention (fp32, 1e-5)."""
    from test_pipeline_train import _check

    model_path = tmp_path / "dear_links.json"
    model_path.write_text(json.dumps({"linear_s_per_token": 1e-6, "attn_s_per_pair": 1e-9, "task_s": 1e-6,
                                      "bytes_per_s": 1e6}))
    cases = [dict(pp=2, schedule="cad_1f1b", span=True, overlap=overlap) for overlap in ("none", "wave")]
    results = run_ranks(_tick_counting_worker, 4, tmp_path, cases, deadline_s=300,
                        env={"DISTCA_TOLERANCE": "auto", "DISTCA_TIME_MODEL": str(model_path)})
    for rank, result in enumerate(results):
        assert result["ok"], f"rank {rank}: {result.get('traceback', result.get('error'))}"
    _check([{"ok": True, "value": r["value"]["results"]} for r in results], cases)
    for rank, result in enumerate(results):
        for case, (plans, with_key_split, tiled, _) in zip(cases, result["value"]["made"]):
            assert plans and with_key_split == plans, (rank, case, result["value"]["made"])
            assert tiled >= 2, (rank, case, result["value"]["made"])  # tiles ran (forward and backward ticks)


@pytest.mark.distributed
def test_cad_1f1b_ticks_relay_kv_and_train_like_one_process(tmp_path):
    """Ticks whose K/V goes along chains (``kv_relays=1``, a tight carving so documents spanning the
    copies have several servers): overlap none and wave; some ticks relay, and after two optimizer
    steps every loss, gradient norm and parameter equals one process running each document alone with
    eager attention (fp32, 1e-5)."""
    from test_pipeline_train import _check

    cases = [dict(pp=2, schedule="cad_1f1b", span=True, overlap=overlap) for overlap in ("none", "wave")]
    results = run_ranks(_tick_counting_worker, 4, tmp_path, cases, deadline_s=300,
                        env={"DISTCA_TOLERANCE": "0", "DISTCA_KV_RELAYS": "1"})
    for rank, result in enumerate(results):
        assert result["ok"], f"rank {rank}: {result.get('traceback', result.get('error'))}"
    _check([{"ok": True, "value": r["value"]["results"]} for r in results], cases)
    for rank, result in enumerate(results):
        for case, (plans, _, _, relayed) in zip(cases, result["value"]["made"]):
            assert plans and relayed >= 2, (rank, case, result["value"]["made"])
