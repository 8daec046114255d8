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
        if case.get("layers"):  # a layer count the stages do not divide: refused before any group is made
            from distca_hf.training.pipeline_stages import build_stage_module
            from helpers import tiny_model

            try:
                build_stage_module(tiny_model("llama", num_hidden_layers=case["layers"]), stage_index=rank,
                                   num_stages=case["pp"])
                results.append({"error": None})
            except ValueError as error:
                results.append({"error": "ValueError", "message": str(error)})
            continue
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
        if case.get("layers"):
            for result in results:
                message = result["value"][index].get("message", "")
                assert f"{case['layers']}" in message and f"{case['pp']}" in message and \
                    "pipeline_parallel_size" in message, result["value"][index]
            continue
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
    cases.append(dict(pp=2, layers=3))
    cases.append(dict(pp=2, schedule="1f1b", span=False, overlap="none", fail_rank=1, timeout_s=60.0))
    _check(run_ranks(_cases_worker, 2, tmp_path, cases), cases)


@pytest.mark.distributed
def test_two_stages_by_two_data_parallel_train_like_one_process(tmp_path):
    cases = [dict(pp=2, schedule=s, span=span, overlap=overlap)
             for s in _schedules() for span, overlap in ((True, "none"), (False, "pingpong"), (True, "pingpong"))]
    cases.append(dict(pp=2, schedule="cad_1f1b", span=True, overlap="none", fail_rank=3, timeout_s=60.0))
    _check(run_ranks(_cases_worker, 4, tmp_path, cases, deadline_s=400), cases)


# -- DistCATrainer in stages ---------------------------------------------------------------------------

EVAL_LENGTHS = [13, 31, 6, 22, 9]
TRAINER_LR = 0.3  # SGD with momentum, so that resuming must bring the optimizer's state back


def _trainer_run(out_dir: str, case: dict, *, max_steps: int, save_steps: int | None = None,
                 resume_from: str | None = None, run: str = "run", evaluate: bool = False):
    """Train the tiny Llama with DistCATrainer in ``case["pp"]`` stages; record every micro-batch it
    trained and evaluated (the rows every stage of a pipeline reads alike)."""
    import os

    from transformers import TrainingArguments

    from distca_hf import DistCAPlugin, DistCATrainer, PackingConfig
    from helpers import checkpointing_argument, is_checkpointing, tiny_model

    class RecordingTrainer(DistCATrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            self.recorded.append([self.state.global_step] + [inputs[k][0].tolist() for k in
                                                             ("input_ids", "position_ids", "shift_labels")])
            return super().training_step(model, inputs, num_items_in_batch)

        def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
            self.evaluated.append([inputs[k][0].tolist() for k in ("input_ids", "position_ids", "shift_labels")])
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)

    model = tiny_model("llama", num_hidden_layers=2 * case["pp"])
    if case.get("lora"):
        model = _with_lora(model)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = TrainingArguments(
        output_dir=os.path.join(out_dir, run), per_device_train_batch_size=1, per_device_eval_batch_size=1,
        max_steps=max_steps, learning_rate=TRAINER_LR, optim="sgd", optim_args="momentum=0.9",
        lr_scheduler_type="linear",
        weight_decay=0.0,
        max_grad_norm=MAX_NORM, logging_steps=1, report_to=[], disable_tqdm=True, seed=0, data_seed=0,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500, eval_strategy="no",
        dataloader_pin_memory=False, **checkpointing_argument(case.get("checkpointing", False)))
    stages = ({"pipeline_schedule": case["schedule"], "pipeline_micro_batches": MICRO_BATCHES} if case["pp"] > 1 else
              {})  # (pp 1: DistCATrainer without stages, one row per rank a step)
    plugin = DistCAPlugin(pipeline_parallel_size=case["pp"], timeout_s=60.0, **stages)
    trainer = RecordingTrainer(model=model, args=args, train_dataset=_documents(),
                               eval_dataset=_documents(7)[:len(EVAL_LENGTHS)] if evaluate else None,
                               packing=PackingConfig(tokens_per_rank=TOKENS_PER_RANK, seed=0,
                                                     balance_micro_batches=case.get("balance", False)),
                               distca_plugin=plugin)
    trainer.recorded, trainer.evaluated = [], []
    trainer.train(resume_from_checkpoint=resume_from)
    result = {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
              "norms": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h],
              "recorded": trainer.recorded, "initial": initial, "trainer": trainer,
              "balanced_steps": trainer.packing_reports["train"].balanced_steps,
              "checkpointed": is_checkpointing(trainer.model)}
    if evaluate:
        result["eval"] = trainer.evaluate()
        result["evaluated"] = trainer.evaluated
        # the same documents given to evaluate() afterwards: packed again, read alike by both stages
        result["eval_later"] = trainer.evaluate(eval_dataset=_documents(7)[:len(EVAL_LENGTHS)])
    return result


def _with_lora(model):
    """``model`` in a PEFT LoRA wrapper whose A and B both start random (so both get gradients at once)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(100)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj"],
                                            lora_dropout=0.0, init_lora_weights=False, modules_to_save=["lm_head"],
                                            task_type="CAUSAL_LM"))


def _rows_of(records) -> list[dict]:
    return [{"input_ids": torch.tensor([ids]), "position_ids": torch.tensor([pos]),
             "shift_labels": torch.tensor([targets])} for ids, pos, targets in records]


def _trainer_worker(rank, world, schedules, out_dir, resume_and_save=True):
    """Per schedule: 4 steps (checkpoint at 2) against one process; for the first, evaluation equals
    the reference and (``resume_and_save``) resuming from the checkpoint equals the uninterrupted run
    and the saved folder loads with from_pretrained as the trained stages."""
    import os

    from transformers import AutoModelForCausalLM

    from distca_hf.training.pipeline_stages import gather_full_state_dict
    from helpers import tiny_model

    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    out = []
    for index, schedule in enumerate(schedules):
        # one run packs balanced steps; activation checkpointing in cad_1f1b's and in the 4-process run
        case = {"pp": 2, "schedule": schedule, "balance": schedule == "gpipe",
                "checkpointing": schedule == "cad_1f1b" or world == 4}
        first = index == 0
        full = _trainer_run(out_dir, case, max_steps=4, save_steps=2 if first and resume_and_save else None,
                            run=schedule, evaluate=first)
        # every data-parallel index's rows, as the first stage (ranks 0 .. data_parallel - 1) read them
        data_parallel = world // case["pp"]
        everyone = [None] * world
        torch.distributed.all_gather_object(everyone, [full["recorded"], full.get("evaluated")])
        trainer = full["trainer"]
        # the reference: one process, the same rows, eager attention per document
        reference = tiny_model("llama", num_hidden_layers=2 * case["pp"])
        reference.set_attn_implementation("eager")
        reference.load_state_dict(full["initial"])
        # optim_args="momentum=0.9" as the Trainer honours it (transformers 5.0's "sgd" drops optim_args: 0)
        momentum = trainer.optimizer.param_groups[0]["momentum"]
        assert momentum in (0.0, 0.9), momentum
        optimizer = torch.optim.SGD(reference.parameters(), lr=TRAINER_LR, momentum=momentum)
        decay = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: (4 - step) / 4)  # HF linear decay
        reference_losses, reference_norms = [], []
        for step in range(4):
            per_rank = [_rows_of([r[1:] for r in everyone[d][0] if r[0] == step]) for d in range(data_parallel)]
            rows = [list(micro_batch) for micro_batch in zip(*per_rank)]
            assert len(rows) == MICRO_BATCHES, (step, len(rows))
            optimizer.zero_grad(set_to_none=True)
            loss = _reference_loss(reference, rows)
            loss.backward()
            reference_norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)))
            optimizer.step()
            decay.step()
            reference_losses.append(loss.item())
        trained = gather_full_state_dict(trainer.model, pipeline_group=trainer._pipeline.pipeline_group)
        result = {"losses": full["losses"], "reference_losses": reference_losses, "norms": full["norms"],
                  "reference_norms": reference_norms, "worst_param_error": None,
                  "balanced": (case["balance"], full["balanced_steps"]),
                  "checkpointed": (case["checkpointing"], full["checkpointed"])}
        if trained is not None:
            expected = dict(reference.named_parameters())
            result["worst_param_error"] = max(float((trained[n] - expected[n].detach()).abs().max()) for n in expected)
        if first:
            with torch.no_grad():  # evaluation: the exact token-weighted loss of the set
                per_rank = [_rows_of(everyone[d][1]) for d in range(data_parallel)]
                eval_loss = _reference_loss(reference, [list(micro_batch) for micro_batch in zip(*per_rank)])
            result["eval_loss"], result["reference_eval_loss"] = full["eval"]["eval_loss"], eval_loss.item()
            result["eval_later_loss"] = full["eval_later"]["eval_loss"]
        if first and resume_and_save:
            checkpoint = os.path.join(out_dir, schedule, "checkpoint-2")
            resumed = _trainer_run(out_dir, case, max_steps=4, resume_from=checkpoint, run=schedule + "-resumed")
            # the resumed run's history holds the checkpoint's first two steps, then its own
            result["resumed_losses"], result["full_losses_after_2"] = resumed["losses"][2:], full["losses"][2:]
            again = gather_full_state_dict(resumed["trainer"].model,
                                           pipeline_group=resumed["trainer"]._pipeline.pipeline_group)
            if again is not None:
                result["resume_param_error"] = max(float((again[n] - trained[n]).abs().max()) for n in trained)
            saved = os.path.join(out_dir, "saved")
            trainer.save_model(saved)
            torch.distributed.barrier()
            loaded = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).state_dict()
            if trained is not None:
                result["saved_param_error"] = max(float((loaded[n] - trained[n]).abs().max()) for n in trained)
        out.append(result)
    return out


@pytest.mark.distributed
def test_trainer_in_two_stages_trains_resumes_evaluates_and_saves_like_one_process(tmp_path):
    schedules = list(_schedules())
    results = run_ranks(_trainer_worker, 2, tmp_path, schedules, str(tmp_path), deadline_s=400)
    for result in results:
        assert result["ok"], result.get("traceback", result.get("error"))
    for index, schedule in enumerate(schedules):
        for rank, result in enumerate(results):
            got = result["value"][index]
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(got["reference_losses"]),
                                       rtol=1e-5, atol=1e-6, msg=lambda m: f"{schedule}: losses: {m}")
            torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(got["reference_norms"]),
                                       rtol=1e-5, atol=1e-6, msg=lambda m: f"{schedule}: grad norms: {m}")
            if rank == 0:  # the first stage gathered the whole model
                assert got["worst_param_error"] < 1e-5, (schedule, got["worst_param_error"])
            balance, balanced_steps = got["balanced"]
            assert (balanced_steps > 0) == balance, got["balanced"]
            asked, checkpointed = got["checkpointed"]
            assert asked == checkpointed == (schedule == "cad_1f1b"), (schedule, got["checkpointed"])
            if index == 0:
                assert abs(got["eval_loss"] - got["reference_eval_loss"]) < 1e-5, got
                assert abs(got["eval_later_loss"] - got["reference_eval_loss"]) < 1e-5, got
                torch.testing.assert_close(torch.tensor(got["resumed_losses"]), torch.tensor(got["full_losses_after_2"]),
                                           rtol=1e-6, atol=1e-7)
                if rank == 0:
                    assert got["resume_param_error"] < 1e-6 and got["saved_param_error"] == 0.0, got


@pytest.mark.distributed
def test_trainer_in_two_stages_by_two_data_parallel_trains_like_one_process(tmp_path):
    """Four processes: two pipelines whose stages balance attention with their data-parallel copy,
    documents spanning the copies (the trainer's default with a server group of two), activation
    checkpointing on (each recomputation plans its attention again with the stage's copies)."""
    results = run_ranks(_trainer_worker, 4, tmp_path, ["1f1b"], str(tmp_path), False, deadline_s=400)
    for result in results:
        assert result["ok"], result.get("traceback", result.get("error"))
    for rank, result in enumerate(results):
        got = result["value"][0]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(got["reference_losses"]), rtol=1e-5,
                                   atol=1e-6)
        torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(got["reference_norms"]), rtol=1e-5,
                                   atol=1e-6)
        assert abs(got["eval_loss"] - got["reference_eval_loss"]) < 1e-5, got
        assert got["checkpointed"] == [True, True], got["checkpointed"]
        assert (got["worst_param_error"] is not None) == (rank in (0, 1))  # each pipeline's first stage
        if got["worst_param_error"] is not None:
            assert got["worst_param_error"] < 1e-5, got


@pytest.mark.distributed
def test_pipeline_recipe_runs_the_fine_tuning_example_in_two_stages(tmp_path):
    """``distca-hf launch --config_file recipes/pipeline-2stage.yaml examples/finetune_long_context.py``:
    the recipe's distca: section reaches every process, the example trains in two stages (the flag
    picks the schedule), evaluates and saves one folder that from_pretrained loads."""
    import subprocess
    import sys
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from distca_hf.runtime.comm import free_port

    root = Path(__file__).resolve().parent.parent
    result = subprocess.run(
        [str(Path(sys.executable).parent / "distca-hf"), "launch", "--config_file", "recipes/pipeline-2stage.yaml",
         "--main_process_port", str(free_port()), "examples/finetune_long_context.py", "--max_steps", "2",
         "--tokens-per-rank", "512", "--eval_documents", "4", "--pipeline_schedule", "cad_1f1b",
         "--output_dir", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "pipeline: 2 stages x 1 data-parallel, schedule cad_1f1b, 4 micro-batches per step" in out, out[-2000:]
    assert "eval loss" in out and f"model saved to {tmp_path}" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit() and "->" in line]
    assert [r[0] for r in rows] == ["1", "2"], out[-2000:]  # the step table
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config.num_hidden_layers == 2


def test_pipeline_setups_it_cannot_run_are_refused_naming_them(tmp_path):
    import datasets
    from transformers import TrainingArguments

    from distca_hf import DistCAPlugin, DistCATrainer, PackingConfig
    from helpers import tiny_model

    plugin = DistCAPlugin(pipeline_parallel_size=2)
    documents = _documents()
    refused = [({"label_smoothing_factor": 0.1}, {}, "label_smoothing_factor"),
               ({"neftune_noise_alpha": 5.0}, {}, "neftune_noise_alpha"),
               ({}, {"compute_metrics": lambda prediction: {}}, "compute_metrics"),
               ({}, {"preprocess_logits_for_metrics": lambda logits, labels: logits}, "preprocess_logits_for_metrics"),
               ({}, {"train_dataset": datasets.Dataset.from_dict({"input_ids": documents}).to_iterable_dataset()},
                "streaming dataset"),
               # (both ran the stages uncompiled without a word before)
               ({"torch_compile": True, "torch_compile_backend": "eager"}, {}, r"torch_compile \(TrainingArguments"),
               ({}, {"model": torch.compile(tiny_model("llama"), backend="eager")}, "a torch.compile'd model"),
               ({}, {}, r"world size 1 is not divisible by pipeline_parallel x tensor_parallel = 2 x 1")]
    for arguments, trainer_arguments, message in refused:
        args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=1, report_to=[],
                                 **arguments)
        with pytest.raises(ValueError, match=message):
            DistCATrainer(args=args, distca_plugin=plugin, packing=PackingConfig(tokens_per_rank=TOKENS_PER_RANK),
                          **{"model": tiny_model("llama"), "train_dataset": documents, **trainer_arguments})
    with pytest.raises(ValueError, match="pipeline_schedule must be one of"):
        DistCAPlugin(pipeline_parallel_size=2, pipeline_schedule="zero_bubble")
    from distca_hf.training.pipeline import PipelineRunner

    # a timeout datetime.timedelta cannot hold is refused (the setting's own check), before any group is made
    with pytest.raises(ValueError, match=r"timeout_s must be a number of seconds from 0.001 .* to 1e9"):
        PipelineRunner(None, topology=None, rank=0, schedule="1f1b", tokens_per_micro_batch=8, device="cpu",
                       timeout_s=1e15)


def test_balanced_micro_batches_keep_every_document_and_lower_the_busiest_micro_batch():
    """``PackingConfig(balance_micro_batches=True)``: each step's global batches are packed again for
    attention; every document trains once, whole, and no step's busiest micro-batch gets busier."""
    from distca_hf.planning import causal_pairs
    from distca_hf.training.packing import PackedDataset, PackingConfig

    lengths = [40, 3, 5, 38, 2, 7, 36, 4, 6, 1, 33, 8, 2, 5, 30, 9, 3, 2, 6, 28, 4, 1, 7, 3]
    documents = [[1 + (i % 90)] * n for i, n in enumerate(lengths)]

    def step_costs(packed, micro_batches):
        costs = [sum(int(causal_pairs(p.start, p.end)) for p in row.pieces if not isinstance(p.document, str))
                 for row in packed.rows]
        return [max(costs[i:i + micro_batches]) for i in range(0, len(costs), micro_batches)]

    config = dict(tokens_per_rank=48, shuffle=False)
    plain = PackedDataset(documents, PackingConfig(**config), step_micro_batches=4, full_rows=True)
    balanced = PackedDataset(documents, PackingConfig(**config, balance_micro_batches=True), step_micro_batches=4,
                             full_rows=True)
    assert balanced.report.balanced_steps > 0 and "balanced for attention" in str(balanced.report)
    assert balanced.label_tokens() == plain.label_tokens() == sum(n - 1 for n in lengths)
    whole = sorted((p.document, p.start, p.end) for row in balanced.rows for p in row.pieces
                   if not isinstance(p.document, str))
    assert whole == sorted((i, 0, n) for i, n in enumerate(lengths))  # every document once, never cut
    plain_costs, balanced_costs = step_costs(plain, 4), step_costs(balanced, 4)
    assert all(b <= p for b, p in zip(balanced_costs, plain_costs)) and sum(balanced_costs) < sum(plain_costs)


def _accelerator_worker(rank, world):
    import os

    from distca_hf import DistCAPlugin
    from distca_hf.training.accelerator import DistCAAccelerator
    from distca_hf.training.pipeline import apply_pipeline_parallel
    from helpers import tiny_model

    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    accelerator = DistCAAccelerator(distca_plugin=DistCAPlugin(pipeline_parallel_size=2))
    model = tiny_model("llama")
    try:
        accelerator.prepare(model)
        refused = None
    except ValueError as error:
        refused = str(error)
    runner = apply_pipeline_parallel(model, topology=accelerator.distca.topology, rank=rank, schedule="1f1b",
                                     tokens_per_micro_batch=TOKENS_PER_RANK, device="cpu", timeout_s=60.0)
    prepared = accelerator.prepare(runner.stage_module)
    return [refused, prepared is runner.stage_module]


@pytest.mark.distributed
def test_accelerator_prepares_a_stage_without_ddp_and_refuses_the_whole_model(tmp_path):
    for result in run_ranks(_accelerator_worker, 2, tmp_path):
        assert result["ok"], result.get("traceback", result.get("error"))
        refused, unwrapped = result["value"]
        assert "prepare this rank's stage" in refused and "apply_pipeline_parallel" in refused
        assert unwrapped  # no DDP: the runner sums the gradients over the data-parallel copies itself


def _bookkeeping_worker(rank, world, out_dir):
    import os

    from transformers import TrainingArguments

    from distca_hf import DistCAPlugin, DistCATrainer, PackingConfig
    from helpers import tiny_model

    def trainer(max_steps: int, **arguments):
        args = TrainingArguments(output_dir=os.path.join(out_dir, "run"), per_device_train_batch_size=1,
                                 per_device_eval_batch_size=1, max_steps=max_steps, report_to=[], disable_tqdm=True, dataloader_pin_memory=False,
                                 logging_steps=1, include_num_input_tokens_seen=True, **arguments)
        made = DistCATrainer(model=tiny_model("llama", num_hidden_layers=2), args=args, train_dataset=_documents(),
                             packing=PackingConfig(tokens_per_rank=TOKENS_PER_RANK, seed=0),
                             distca_plugin=DistCAPlugin(pipeline_parallel_size=2, pipeline_micro_batches=2,
                                                        timeout_s=60.0))
        return made, args

    first, args = trainer(1, save_strategy="steps", save_steps=1, save_only_model=True)
    trained = first.train().metrics
    evaluated = first.evaluate(eval_dataset=_documents())
    resumed, _ = trainer(2, save_strategy="no")
    resumed.train(resume_from_checkpoint=os.path.join(out_dir, "run", "checkpoint-1"))
    return {"accumulation_left": args.gradient_accumulation_steps, "seen": [first.state.num_input_tokens_seen,
                                                                           resumed.state.num_input_tokens_seen],
            "rows_per_step": first.get_total_train_batch_size(first.args),
            # samples / steps per second: rows per step as timed (both from one runtime, rounded to 3 decimals)
            "timed_rows_per_step": [round(trained["train_samples_per_second"] / trained["train_steps_per_second"], 1),
                                    round(evaluated["eval_samples_per_second"] / evaluated["eval_steps_per_second"], 1)]}


@pytest.mark.distributed
def test_stages_count_input_tokens_once_keep_the_callers_arguments_and_resume_weights_only(tmp_path):
    """Two stages, one pipeline of 2 micro-batches a step: ``num_input_tokens_seen`` and the rows timed
    per second (training's and evaluation's) count each row once (both stages read it); the caller's ``gradient_accumulation_steps`` stays 1; a ``save_only_model``
    checkpoint resumes (the weights; the optimizer starts afresh, as the Trainer's does)."""
    results = run_ranks(_bookkeeping_worker, 2, tmp_path, str(tmp_path), deadline_s=300)
    for result in results:
        assert result["ok"], result.get("traceback", result.get("error"))
        assert result["value"] == {"accumulation_left": 1, "seen": [2 * TOKENS_PER_RANK, 4 * TOKENS_PER_RANK],
                                   "rows_per_step": 2, "timed_rows_per_step": [2.0, 1.0]}, result


def _lora_worker(rank, world, out_dir):
    """LoRA, in two stages (1f1b) and without stages (two data-parallel ranks, documents spanning them), 2
    steps each: the losses and the adapter's weights equal one process's; ``save_model`` writes one adapter
    folder that ``PeftModel.from_pretrained`` loads as trained."""
    import os

    from peft import PeftModel

    from helpers import tiny_model

    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    out = []
    for stages in (2, 1):
        run = _trainer_run(out_dir, {"pp": stages, "schedule": "1f1b", "lora": True}, max_steps=2, run=f"lora{stages}")
        everyone = [None] * world
        torch.distributed.all_gather_object(everyone, run["recorded"])
        layers = 2 * stages
        reference = _with_lora(tiny_model("llama", attn="eager", num_hidden_layers=layers))
        reference.load_state_dict(run["initial"])
        trainable = [p for p in reference.parameters() if p.requires_grad]
        momentum = run["trainer"].optimizer.param_groups[0]["momentum"]
        optimizer = torch.optim.SGD(trainable, lr=TRAINER_LR, momentum=momentum)
        decay = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: (2 - step) / 2)
        losses = []
        for step in range(2):  # a micro-batch: the data-parallel ranks' rows (the first stage's, in stages)
            per_rank = [_rows_of([r[1:] for r in everyone[d] if r[0] == step]) for d in range(world // stages)]
            optimizer.zero_grad(set_to_none=True)
            loss = _reference_loss(reference, [list(micro_batch) for micro_batch in zip(*per_rank)])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, MAX_NORM)
            optimizer.step()
            decay.step()
            losses.append(loss.item())
        saved = os.path.join(out_dir, f"adapter{stages}")
        run["trainer"].save_model(saved)
        torch.distributed.barrier()
        result = {"stages": stages, "losses": run["losses"], "reference_losses": losses}
        if rank == 0:
            expected = {n: p.detach() for n, p in reference.named_parameters() if p.requires_grad}
            loaded = PeftModel.from_pretrained(tiny_model("llama", attn="eager", num_hidden_layers=layers), saved)
            got = dict(loaded.named_parameters())
            result["files"] = sorted(os.listdir(saved))
            result["adapter_error"] = max(float((got[n] - e).abs().max()) for n, e in expected.items())
            result["untrained"] = sum(int(torch.equal(got[n], run["initial"][n])) for n in expected)
        out.append(result)
    return out


@pytest.mark.distributed
def test_lora_trains_like_one_process_and_saves_one_adapter_in_stages_and_without(tmp_path):
    pytest.importorskip("peft")
    results = run_ranks(_lora_worker, 2, tmp_path, str(tmp_path), deadline_s=300)
    for result in results:
        assert result["ok"], result.get("traceback", result.get("error"))
        for got in result["value"]:
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(got["reference_losses"]), rtol=1e-5,
                                       atol=1e-6, msg=lambda m: f"{got['stages']} stages: {m}")
    for first in results[0]["value"]:
        assert {"adapter_config.json", "adapter_model.safetensors"} <= set(first["files"]), first["files"]
        # (in stages before: save_model raised on the first stage only; the wrapper there held stage 1's adapter
        # untrained)
        assert first["adapter_error"] < 1e-5 and first["untrained"] == 0, first
