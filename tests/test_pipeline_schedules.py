"""``pipeline_schedule="cad_1f1b"`` at the runtime level: a rank in a pipeline bubble serves the others'
CA-tasks, the backward runs on its own pooled plan, activation checkpointing's recomputations (reentrant
or not) join the backward ticks' exchanges, and what the lockstep cannot run is refused on every rank
with the same named error (no hang). Training equal to one process, for every schedule, is in
``test_pipeline_train.py``; the tick table in ``test_pipeline_ticks.py``."""

from __future__ import annotations

import pytest
import torch

from dist_harness import run_ranks

TOKENS = 24
LENGTHS = [[20, 4], [3, 5, 7, 9], [24], [6, 6, 6, 6]]  # micro-batches of different attention cost


def _rows():
    g = torch.Generator().manual_seed(0)
    rows = []
    for lengths in LENGTHS:
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        ids = torch.randint(1, 96, (1, TOKENS), generator=g)
        labels = ids.clone()
        labels[positions == 0] = -100
        rows.append({"input_ids": ids, "position_ids": positions, "labels": labels})
    return rows


def _reference_grads(model, rows, label_tokens):
    """Every document alone, eager attention: gradients of the step's token-weighted loss."""
    model.zero_grad(set_to_none=True)
    for row in rows:
        positions = row["position_ids"][0]
        starts = torch.nonzero(positions == 0).flatten().tolist() + [TOKENS]
        for a, b in zip(starts[:-1], starts[1:]):
            logits = model(input_ids=row["input_ids"][:, a:b], use_cache=False).logits[0]
            targets = row["labels"][0, a:b]
            loss = torch.nn.functional.cross_entropy(logits[:-1], targets[1:], ignore_index=-100, reduction="sum")
            (loss / label_tokens).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _case(rank, world, case):
    import copy

    import distca_hf
    from distca_hf.training.pipeline import PipelineRunner
    from distca_hf.training.pipeline_stages import build_stage_module
    from distca_hf.training.topology import ParallelTopology
    from helpers import tiny_model

    distca_hf.configure(tolerance=0.0, overlap=case.get("overlap", "none"))  # move work whenever it balances
    topology = ParallelTopology(world, pipeline_parallel=2)
    stage_index = topology.coordinates(rank)[1]
    model = tiny_model(case.get("family", "llama"), num_hidden_layers=2, **case.get("config", {}))
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("eager")
    stage = build_stage_module(model, stage_index=stage_index, num_stages=2)
    checkpointing, recomputed = case.get("checkpointing"), []
    if checkpointing == "one stage" and stage_index == 1:  # the refusal must still reach both stages
        stage.activation_checkpointing_enable()
    elif checkpointing in ("reentrant", "non-reentrant"):
        stage.activation_checkpointing_enable({"use_reentrant": checkpointing == "reentrant"})
        for layer in stage.model.layers:  # count the attention calls made while autograd runs: recomputations
            layer.self_attn.register_forward_pre_hook(
                lambda *_: recomputed.append(1) if torch._C._current_graph_task_id() != -1 else None)
    runner = PipelineRunner(stage, topology=topology, rank=rank, schedule="cad_1f1b", tokens_per_micro_batch=TOKENS,
                            device="cpu", timeout_s=60.0)
    rows = _rows()
    try:
        runner.train_step(rows)
    except Exception as error:
        distca_hf.reset_config()
        return {"error": type(error).__name__, "message": str(error)}
    stats = distca_hf.plan_stats()  # the last tick this rank planned: stage 0 is a bubble in the last forward slot
    # each micro-batch's plan, in order (the step table reads them): its own documents' pairs on this rank
    own_pairs = [plan["attn_pairs_local"][rank] for plan in runner.step_plans]
    label_tokens = sum(int(r["labels"][0, 1:].ne(-100).sum()) for r in rows)
    expected = _reference_grads(reference, rows, label_tokens)
    worst = max(float((p.grad - expected[n]).abs().max()) for n, p in stage.named_parameters())
    distca_hf.reset_config()
    return {"stage": stage_index, "stats": {k: stats[k] for k in ("attn_pairs_local", "attn_pairs_served",
                                                                   "moved_query_fraction", "backward")},
            "worst_grad_error": worst, "own_pairs": own_pairs, "recomputed": len(recomputed)}


def _worker(rank, world, cases):
    return [_case(rank, world, case) for case in cases]


@pytest.mark.distributed
def test_cad_1f1b_bubbles_serve_and_refusals_reach_every_rank(tmp_path):
    cases = [
        {},  # overlap none
        {"overlap": "wave"},
        # stage 0 holds a sliding layer, stage 1 a full one: local layer 0 differs between the stages
        {"family": "qwen2", "config": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4,
                                       "use_sliding_window": True}},
        {"checkpointing": "one stage"},
        # activation checkpointing: a backward tick's recomputations join its pooled exchange, bubbles included
        {"checkpointing": "non-reentrant"},
        {"checkpointing": "reentrant", "overlap": "wave"},
    ]
    results = run_ranks(_worker, 2, tmp_path, cases, deadline_s=240)
    for r in results:
        assert r["ok"], r.get("traceback", r.get("error"))
    for index in (0, 1, 4, 5):
        for rank, result in enumerate(results):
            got = result["value"][index]
            assert "error" not in got, got
            assert got["worst_grad_error"] < 1e-5, (index, rank, got)
        expected_pairs = [sum(n * (n + 1) // 2 for n in lengths) for lengths in LENGTHS]
        assert [r["value"][index]["own_pairs"] for r in results] == [expected_pairs] * 2
        bubble = results[0]["value"][index]["stats"]  # rank 0 = stage 0, idle in the last forward slot
        assert bubble["attn_pairs_local"][0] == 1  # its dummy token
        assert bubble["attn_pairs_served"][0] > 1  # ... and it computed others' CA-tasks
        assert bubble["moved_query_fraction"] > 0 and bubble["backward"] == "resend"
        # each stage's one layer recomputed once per micro-batch and once for its backward bubble's dummy token
        # (one per stage with 2 stages), never without checkpointing
        assert [r["value"][index]["recomputed"] for r in results] == [len(LENGTHS) + 1 if index > 3 else 0] * 2
    for index, message in ((2, "same attention layers"), (3, "checkpoint the same")):
        errors = [result["value"][index] for result in results]
        assert all("error" in e for e in errors), errors
        assert any(message in e["message"] for e in errors), errors
        assert all(e["error"] in ("ValueError", "DistCAPeerError") for e in errors), errors
