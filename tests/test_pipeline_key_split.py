"""``pipeline_schedule="cad_1f1b"`` running tick plans with key-split tiles (``planning.tiles``, the
tile grid): the runtime passes ``key_split`` to ``planning.plan_lockstep_tick`` as ``distca-hf simulate``
plans its ticks, and the tiled ticks (forward in ``resend`` mode, the backward tick's own plan) train
exactly like one process.

Tiles need a document whose pieces lie on several ranks of a tick, so the stages have two data-parallel
copies with documents spanning them (2 stages x 2: four gloo ranks; with one copy per stage every
document of a tick lies on one rank and no tile can form).
"""

from __future__ import annotations

import json

import pytest

from dist_harness import run_ranks


def _tick_counting_worker(rank, world, cases):
    """``test_pipeline_train``'s cases, the ticks planned by the runtime's own ``plan_lockstep_tick``,
    counting per case the tick plans, those planned with ``key_split`` and those holding tiles."""
    from distca_hf.planning import plan_lockstep_tick
    from distca_hf.runtime import pipeline_schedules
    from test_pipeline_train import _cases_worker

    made = []  # per case: [tick plans, planned with key_split, holding tiles]

    def counting(pieces, config, **kwargs):
        plan = plan_lockstep_tick(pieces, config, **kwargs)
        made[-1][0] += 1
        made[-1][1] += int(config.key_split)
        made[-1][2] += int(plan.splits_keys)
        return plan

    pipeline_schedules.plan_lockstep_tick = counting
    results = []
    for case in cases:
        made.append([0, 0, 0])
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
        for case, (plans, with_key_split, tiled) in zip(cases, result["value"]["made"]):
            assert plans and with_key_split == plans, (rank, case, result["value"]["made"])
            assert tiled >= 2, (rank, case, result["value"]["made"])  # tiles ran (forward and backward ticks)
