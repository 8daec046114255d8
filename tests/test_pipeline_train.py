"""Training in pipeline stages (``training.pipeline``, ``DistCATrainer`` with ``pipeline_parallel_size > 1``).

Every configuration is checked against one process training the same global batches with eager
attention on each document alone: after two optimizer steps (gradient clipping acting) every
parameter and every step's loss are equal (fp32). Several configurations run inside one launch of
the ranks (models and groups made anew for each) to keep the test time small.
"""

from __future__ import annotations

import copy

import pytest
import torch

from dist_harness import run_ranks

TOKENS_PER_RANK = 24
MICRO_BATCHES = 2
STEPS = 2
LR = 0.5
MAX_NORM = 0.5  # small enough that clipping acts: the norm over all stages is checked too
# documents of varied lengths: several longer than one row (they span the data-parallel ranks, or are cut)
LENGTHS = [30, 5, 17, 9, 41, 3, 12, 26, 7, 19, 2, 33, 11, 6, 23, 14, 8, 28, 4, 15]


def _documents(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 96, (n,), generator=g).tolist() for n in LENGTHS]


def _step_rows(packed, step: int, data_parallel: int, collator) -> list[list[dict]]:
    """``[micro-batch][data index]`` collated rows of optimizer step ``step`` (blocks in order)."""
    blocks = range(step * MICRO_BATCHES, (step + 1) * MICRO_BATCHES)
    return [[collator([packed[b * data_parallel + d]]) for d in range(data_parallel)] for b in blocks]


def _reference_loss(model, rows: list[list[dict]]) -> torch.Tensor:
    """The step's loss with every document alone through ``model`` (eager attention): the data-parallel
    rows of a micro-batch are one token stream (pieces continue across them), cut where positions
    restart; summed token cross-entropy over the label tokens of the step."""
    total, label_tokens = 0.0, 0
    for micro_batch in rows:
        ids = torch.cat([r["input_ids"][0] for r in micro_batch])
        positions = torch.cat([r["position_ids"][0] for r in micro_batch])
        targets = torch.cat([r["shift_labels"][0] for r in micro_batch])
        starts = torch.nonzero(positions == 0).flatten().tolist() + [len(ids)]
        for a, b in zip(starts[:-1], starts[1:]):
            if targets[a:b].ne(-100).any():
                logits = model(input_ids=ids[a:b][None], use_cache=False).logits[0]
                total = total + torch.nn.functional.cross_entropy(logits, targets[a:b], ignore_index=-100,
                                                                  reduction="sum")
        label_tokens += int(targets.ne(-100).sum())
    return total / label_tokens


def _run_case(rank: int, world: int, case: dict) -> dict:
    import distca_hf
    from distca_hf import DistCAPlugin
    from distca_hf.training.packing import PackedCollator, PackedDataset, PackingConfig
    from distca_hf.training.pipeline import PipelineRunner
    from distca_hf.training.pipeline_stages import build_stage_module, gather_full_state_dict
    from helpers import tiny_model

    pp = case["pp"]
    timeout_s = case.get("timeout_s", 60.0)
    plugin = DistCAPlugin(pipeline_parallel_size=pp, pipeline_schedule=case["schedule"], span_ranks=case["span"],
                          overlap=case["overlap"], timeout_s=timeout_s)
    groups = plugin.attach()
    topology = groups.topology
    data_parallel = topology.data_parallel
    model = tiny_model("llama", num_hidden_layers=2 * pp, tie_word_embeddings=case.get("tied", False))
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("eager")
    stage = build_stage_module(model, stage_index=topology.coordinates(rank)[1], num_stages=pp)
    runner = PipelineRunner(stage, topology=topology, rank=rank, schedule=groups.config.pipeline_schedule,
                            tokens_per_micro_batch=TOKENS_PER_RANK, device="cpu", timeout_s=timeout_s)
    if case.get("fail_rank") == rank:  # this rank's stage raises in the forward of the step's second micro-batch
        calls = []

        def fail(module, args):
            calls.append(1)
            if len(calls) == 2:
                raise ValueError(f"injected failure on rank {rank}")

        next(iter(stage.model.layers)).register_forward_pre_hook(fail)  # inside the stage's forward
    packed = PackedDataset(_documents(), PackingConfig(tokens_per_rank=TOKENS_PER_RANK, shuffle=False),
                           world_size=data_parallel, span_ranks=case["span"] and data_parallel > 1, full_rows=True)
    collator = PackedCollator()
    optimizer = torch.optim.SGD([p for p in stage.parameters() if p.requires_grad], lr=LR)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    data_index = topology.coordinates(rank)[0]
    losses, reference_losses, norms, reference_norms = [], [], [], []
    for step in range(STEPS):
        rows = _step_rows(packed, step, data_parallel, collator)
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(runner.train_step([micro_batch[data_index] for micro_batch in rows])))
        norms.append(float(runner.clip_grad_norm_(MAX_NORM)))
        optimizer.step()
        reference_optimizer.zero_grad(set_to_none=True)
        loss = _reference_loss(reference, rows)
        loss.backward()
        reference_norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)))
        reference_optimizer.step()
        reference_losses.append(loss.item())
    trained = gather_full_state_dict(stage, pipeline_group=runner.pipeline_group)
    pingpong_ran = "nano_batches" in distca_hf.plan_stats()
    worst = None
    if trained is not None:
        expected = dict(reference.named_parameters(remove_duplicate=False))
        missing = sorted(set(expected) - set(trained) - ({"lm_head.weight"} if case.get("tied") else set()))
        assert not missing, f"parameters missing from the gathered stages: {missing}"
        worst = max(float((trained[name].float() - expected[name].detach()).abs().max()) for name in trained)
    distca_hf.reset_config()
    return {"losses": losses, "reference_losses": reference_losses, "norms": norms,
            "reference_norms": reference_norms, "worst_param_error": worst, "pingpong_ran": pingpong_ran}


def _cases_worker(rank, world, cases):
    results = []
    for case in cases:
        if "fail_rank" not in case:
            results.append(_run_case(rank, world, case))
            continue
        try:  # the last case: its failure leaves the groups unusable
            _run_case(rank, world, case)
            results.append({"error": None})
        except Exception as error:
            results.append({"error": type(error).__name__, "message": str(error)})
    return results


def _check(results, cases):
    for result in results:
        assert result["ok"], result.get("traceback", result.get("error"))
    for index, case in enumerate(cases):
        if "fail_rank" in case:  # every rank stops with a named error: its own, or its peers' as distca's
            for rank, result in enumerate(results):
                got = result["value"][index]
                if rank == case["fail_rank"]:
                    assert got["error"] == "ValueError" and "injected failure" in got["message"], got
                else:
                    assert got["error"] in ("DistCAPeerError", "DistCATimeoutError"), (rank, got)
                    assert "stage" in got["message"] or "distca forward" in got["message"], (rank, got)
            continue
        for result in results:
            got = result["value"][index]
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(got["reference_losses"]),
                                       rtol=1e-5, atol=1e-6, msg=lambda m: f"{case}: losses: {m}")
            torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(got["reference_norms"]),
                                       rtol=1e-5, atol=1e-6, msg=lambda m: f"{case}: grad norms: {m}")
            assert got["norms"][0] > MAX_NORM, "clipping must act for the test to check it"
            if got["worst_param_error"] is not None:
                assert got["worst_param_error"] < 1e-5, (case, got["worst_param_error"])
            # ping-pong acts where a stage's server group has > 1 rank (cad_1f1b runs it as 'wave')
            expected_pingpong = case["overlap"] == "pingpong" and len(results) > case["pp"] and \
                case["schedule"] != "cad_1f1b"
            assert got["pingpong_ran"] == expected_pingpong, (case, got["pingpong_ran"])
        assert sum(r["value"][index]["worst_param_error"] is not None for r in results) == \
            len(results) // case["pp"]  # every pipeline's first stage compared its whole model


def _schedules():
    from distca_hf.config import PIPELINE_SCHEDULES

    return PIPELINE_SCHEDULES


@pytest.mark.distributed
def test_two_stages_train_like_one_process_for_every_schedule(tmp_path):
    cases = [dict(pp=2, schedule=s, span=False, overlap="none", tied=s == "1f1b") for s in _schedules()]
    cases.append(dict(pp=2, schedule="1f1b", span=False, overlap="none", fail_rank=1, timeout_s=10.0))
    _check(run_ranks(_cases_worker, 2, tmp_path, cases), cases)


@pytest.mark.distributed
def test_two_stages_by_two_data_parallel_train_like_one_process(tmp_path):
    cases = [dict(pp=2, schedule=s, span=span, overlap=overlap)
             for s in _schedules() for span, overlap in ((True, "none"), (False, "pingpong"), (True, "pingpong"))]
    cases.append(dict(pp=2, schedule="cad_1f1b", span=True, overlap="none", fail_rank=3, timeout_s=10.0))
    _check(run_ranks(_cases_worker, 4, tmp_path, cases, deadline_s=400), cases)
