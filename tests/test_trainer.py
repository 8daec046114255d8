"""DistCATrainer and DistCAAccelerator against a single-process reference.

The reference is independent of distca and of the Trainer: a plain PyTorch loop over the same
micro-batches (recorded on every rank), each document piece run alone with eager attention, the
loss summed over all label tokens of the step and divided by their count, SGD. Two gloo ranks
through DDP (with gradient accumulation and checkpointing, one whole epoch), DeepSpeed ZeRO-2 and
ZeRO-3 must give its losses step by step and its final parameters (fp32, tight tolerances); a run
resumed from a checkpoint must give the losses of the uninterrupted run; every document is trained
on exactly once per epoch. The recipes launch the examples with `accelerate launch`, and bad set-ups
fail with errors that say what is wrong."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dist_harness import run_ranks
from distca_hf.runtime.comm import free_port

REPO = Path(__file__).resolve().parent.parent
VOCAB = 96
BUDGET = 48  # tokens per rank: documents longer than this are cut
LENGTHS = [120, 3, 17, 40, 1, 9, 30, 48, 5, 70, 11, 2, 25, 33, 7, 15, 19, 44, 6, 13]
EVAL_LENGTHS = [30, 4, 12, 60]
LR = 0.5


def _documents(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]


# -- the independent reference ---------------------------------------------------------------------


def _reference_model():
    from helpers import tiny_model

    return tiny_model("llama", attn="eager")  # same seed, same initial weights as the workers' model


def _token_loss_sum(model, piece: list[int]) -> torch.Tensor:
    """Sum over the piece's label tokens (all but its first) of the next-token cross-entropy."""
    ids = torch.tensor([piece])
    logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
    return F.cross_entropy(logits.float(), ids[0, 1:], reduction="sum")


def reference_run(steps: list[list[list[int]]], lr: float):
    """``steps[k]``: every piece trained in optimizer step k (all ranks, all micro-batches).
    Returns the per-step losses and the final parameters."""
    model = _reference_model().train()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for pieces in steps:
        label_tokens = sum(len(p) - 1 for p in pieces)
        loss = sum(_token_loss_sum(model, p) for p in pieces if len(p) > 1) / label_tokens
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}, model


def reference_eval_loss(model, documents, budget) -> float:
    pieces = [d[s:s + budget] for d in documents for s in range(0, len(d), budget)]
    with torch.no_grad():
        total = sum(_token_loss_sum(model, p) for p in pieces if len(p) > 1)
    return float(total / sum(len(p) - 1 for p in pieces))


# -- the workers (one per rank) ----------------------------------------------------------------------


def _train_worker(rank, world, case, out_dir):
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    return _train(case, out_dir, rank)


def _train(case: dict, out_dir: str, rank: int = 0):
    """Train the tiny Llama with DistCATrainer as ``case`` says; record what each step trained."""
    import json

    from transformers import TrainingArguments

    from distca_hf import DistCAPlugin, DistCATrainer, PackingConfig
    from helpers import tiny_model

    class RecordingTrainer(DistCATrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            cu = inputs["cu_seq_lens_q"].tolist()
            ids = inputs["input_ids"][0].tolist()
            self.recorded.append([self.state.global_step, [ids[a:b] for a, b in zip(cu, cu[1:])]])
            return super().training_step(model, inputs, num_items_in_batch)

    model = tiny_model("llama")  # before the arguments: no zero.Init, so the reference's initial weights
    deepspeed = None
    if case.get("zero"):
        deepspeed = json.loads((REPO / "recipes" / f"ds-zero{case['zero']}.json").read_text())
    args = TrainingArguments(
        output_dir=os.path.join(out_dir, case.get("run", "run")), per_device_train_batch_size=1,
        per_device_eval_batch_size=1, gradient_accumulation_steps=case.get("accumulation", 1),
        max_steps=case.get("max_steps", -1), num_train_epochs=1, learning_rate=case.get("lr", LR),
        optim=case.get("optim", "sgd"), lr_scheduler_type=case.get("scheduler", "constant"), weight_decay=0.0,
        max_grad_norm=0.0, logging_steps=1, report_to=[], disable_tqdm=True, seed=0, data_seed=0,
        save_strategy="steps" if case.get("save_steps") else "no", save_steps=case.get("save_steps") or 500,
        activation_checkpointing=case.get("checkpointing", False), deepspeed=deepspeed,
        eval_strategy="no", dataloader_pin_memory=False,
    )
    train_dataset = _documents(LENGTHS, 0)
    if case.get("streaming"):
        import datasets

        train_dataset = datasets.Dataset.from_dict({"input_ids": train_dataset}).to_iterable_dataset(num_shards=2)
    trainer = RecordingTrainer(
        model=model, args=args, train_dataset=train_dataset,
        eval_dataset=_documents(EVAL_LENGTHS, 1) if case.get("evaluate") else None,
        packing=PackingConfig(tokens_per_rank=BUDGET, seed=0), distca_plugin=DistCAPlugin(tolerance=0.05),
    )
    trainer.recorded = []
    trainer.train(resume_from_checkpoint=case.get("resume_from"))
    result = {
        "world": trainer.args.world_size,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "steps": [h["step"] for h in trainer.state.log_history if "loss" in h],
        "before": [h["attn_imbalance_before"] for h in trainer.state.log_history if "loss" in h],
        "after": [h["attn_imbalance_after"] for h in trainer.state.log_history if "loss" in h],
        "recorded": trainer.recorded,
        "micro_batches_per_epoch": None if case.get("streaming") else len(trainer.get_train_dataloader()),
        "use_cache": trainer.model.config.use_cache,
    }
    if case.get("evaluate"):
        result["eval"] = trainer.evaluate()
    parameters = list(trainer.model.parameters())
    if case.get("zero") == 3:
        import deepspeed as ds

        with ds.zero.GatheredParameters(parameters):
            state = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    else:
        state = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    if rank == 0:
        torch.save(state, os.path.join(out_dir, f"{case.get('run', 'run')}-params.pt"))
    return result


def _check_ranks(results):
    for rank, result in enumerate(results):
        assert result["ok"], f"rank {rank}: {result.get('traceback', result['error'])}"
    return [r["value"] for r in results]


def _steps_of(values) -> list[list[list[int]]]:
    """Every rank's recorded pieces, grouped by optimizer step."""
    steps: dict[int, list] = {}
    for value in values:
        for step, pieces in value["recorded"]:
            steps.setdefault(step, []).extend(pieces)
    return [steps[k] for k in sorted(steps)]


def _assert_matches_reference(values, out_dir, run="run"):
    steps = _steps_of(values)
    losses, params, model = reference_run(steps, LR)
    for value in values:  # every rank logs the global loss
        torch.testing.assert_close(torch.tensor(value["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    trained = torch.load(os.path.join(out_dir, f"{run}-params.pt"))
    assert trained.keys() == params.keys()
    for name in params:
        torch.testing.assert_close(trained[name], params[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    return model


# -- two ranks against the reference -------------------------------------------------------------------


@pytest.mark.distributed
def test_ddp_one_epoch_matches_single_process_and_trains_every_document_once(tmp_path):
    case = {"accumulation": 2, "checkpointing": True, "evaluate": True}
    values = _check_ranks(run_ranks(_train_worker, 2, tmp_path, case, str(tmp_path)))
    assert all(v["world"] == 2 and v["use_cache"] is False for v in values)
    model = _assert_matches_reference(values, str(tmp_path))
    # one epoch: every chunk of every document exactly once, the same number of micro-batches per rank
    trained = Counter(tuple(p) for v in values for _, pieces in v["recorded"] for p in pieces if p != [0])
    expected = Counter(tuple(d[s:s + BUDGET]) for d in _documents(LENGTHS, 0) for s in range(0, len(d), BUDGET))
    assert trained == expected
    assert len({len(v["recorded"]) for v in values}) == 1
    assert len(values[0]["recorded"]) == values[0]["micro_batches_per_epoch"]
    # the plan balances: after <= 1 + tolerance, never worse than before
    for value in values:
        assert all(a <= 1.05 + 1e-9 and a <= b + 1e-9 for a, b in zip(value["after"], value["before"]))
    assert max(values[0]["before"]) > 1.05  # the data is skewed enough for the plan to matter
    # evaluation: the exact token-weighted loss of the held-out documents under the final weights
    expected_eval = reference_eval_loss(model, _documents(EVAL_LENGTHS, 1), BUDGET)
    for value in values:
        assert value["eval"]["eval_loss"] == pytest.approx(expected_eval, rel=1e-5)
        assert value["eval"]["eval_label_tokens"] == sum(min(n - s, BUDGET) - 1 for n in EVAL_LENGTHS
                                                          for s in range(0, n, BUDGET))


@pytest.mark.distributed
@pytest.mark.parametrize("zero, accumulation", [(2, 2), (3, 1)])
def test_deepspeed_zero_matches_single_process(tmp_path, zero, accumulation):
    case = {"zero": zero, "accumulation": accumulation, "max_steps": 3, "evaluate": True}
    values = _check_ranks(run_ranks(_train_worker, 2, tmp_path, case, str(tmp_path), deadline_s=420))
    assert all(v["world"] == 2 for v in values) and len(values[0]["losses"]) == 3
    model = _assert_matches_reference(values, str(tmp_path))
    expected_eval = reference_eval_loss(model, _documents(EVAL_LENGTHS, 1), BUDGET)
    assert all(v["eval"]["eval_loss"] == pytest.approx(expected_eval, rel=1e-5) for v in values)


@pytest.mark.distributed
def test_streaming_dataset_on_two_ranks_matches_single_process(tmp_path):
    """Each rank reads the whole stream, packs it identically and keeps every second micro-batch."""
    case = {"streaming": True, "accumulation": 2, "max_steps": 3}
    values = _check_ranks(run_ranks(_train_worker, 2, tmp_path, case, str(tmp_path)))
    _assert_matches_reference(values, str(tmp_path))
    mine = [Counter(tuple(p) for _, pieces in v["recorded"] for p in pieces) for v in values]
    assert len(values[0]["recorded"]) == len(values[1]["recorded"]) == 6
    assert not (mine[0] & mine[1])  # the ranks train different micro-batches


def test_single_process_matches_reference(tmp_path):
    value = _train({"accumulation": 2, "max_steps": 3}, str(tmp_path))
    assert value["world"] == 1
    _assert_matches_reference([value], str(tmp_path))


@pytest.mark.distributed
def test_resumed_run_gives_the_losses_of_an_uninterrupted_one(tmp_path):
    results = run_ranks(_resume_worker, 2, tmp_path, str(tmp_path))
    full, resumed = zip(*_check_ranks(results))
    for whole, again in zip(full, resumed):
        # the resumed state carries the history of steps 1-3 from the checkpoint; 4-6 are trained again
        assert whole["steps"] == again["steps"] == [1, 2, 3, 4, 5, 6]
        assert len(again["recorded"]) == 3 and {step for step, _ in again["recorded"]} == {3, 4, 5}
        assert again["recorded"] == whole["recorded"][3:]  # the same micro-batches, mid-epoch
        torch.testing.assert_close(torch.tensor(again["losses"]), torch.tensor(whole["losses"]), rtol=1e-6, atol=1e-7)
    first = torch.load(tmp_path / "full-params.pt")
    second = torch.load(tmp_path / "resumed-params.pt")
    for name in first:
        torch.testing.assert_close(second[name], first[name], rtol=1e-6, atol=1e-7)


def _resume_worker(rank, world, out_dir):
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    # AdamW and a decaying schedule: their states must come back too, and the data order resumes mid-epoch.
    common = {"optim": "adamw_torch", "scheduler": "linear", "lr": 3e-3, "max_steps": 6, "accumulation": 1}
    full = _train({**common, "run": "full", "save_steps": 3}, out_dir, rank)
    checkpoint = os.path.join(out_dir, "full", "checkpoint-3")
    resumed = _train({**common, "run": "resumed", "resume_from": checkpoint}, out_dir, rank)
    return full, resumed


# -- DistCAAccelerator in a plain loop -------------------------------------------------------------------


def _accelerator_worker(rank, world, zero_stage):
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    from accelerate.utils import DeepSpeedPlugin
    from torch.utils.data import DataLoader

    from distca_hf import DistCAAccelerator, DistCAPlugin, PackedCollator, PackedDataset, PackingConfig
    from helpers import tiny_model

    deepspeed = None
    if zero_stage is not None:
        deepspeed = DeepSpeedPlugin(hf_ds_config={
            "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": zero_stage}, "zero_allow_untested_optimizer": True})
    accelerator = DistCAAccelerator(distca_plugin=DistCAPlugin(tolerance=0.05, backward="resend"),
                                    deepspeed_plugin=deepspeed)
    dataset = PackedDataset(_documents(LENGTHS, 0), PackingConfig(tokens_per_rank=BUDGET, shuffle=False),
                            world_size=accelerator.num_processes)
    loader = DataLoader(dataset, batch_size=1, collate_fn=PackedCollator())
    model = tiny_model("llama")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    steps, losses = [], []
    for batch, _ in zip(loader, range(3)):
        cu = batch["cu_seq_lens_q"].tolist()
        ids = batch["input_ids"][0].tolist()
        steps.append([ids[a:b] for a, b in zip(cu, cu[1:])])
        label_tokens = accelerator.reduce(batch["labels"][..., 1:].ne(-100).sum(), reduction="sum")
        loss = model(**batch, num_items_in_batch=label_tokens).loss * accelerator.num_processes
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
    unwrapped = accelerator.unwrap_model(model)
    return {"world": accelerator.num_processes, "steps": steps, "losses": losses,
            "server_ranks": list(accelerator.distca.server_ranks), "backward": accelerator.distca.config.backward,
            "params": {n: p.detach().tolist() for n, p in unwrapped.named_parameters() if n.endswith("norm.weight")}}


@pytest.mark.distributed
@pytest.mark.parametrize("zero_stage", [None, 1])
def test_distca_accelerator_loop_matches_single_process(tmp_path, zero_stage):
    """DDP, and DeepSpeed ZeRO-1 (CPU: the accelerator creates the gloo group DeepSpeed needs)."""
    values = _check_ranks(run_ranks(_accelerator_worker, 2, tmp_path, zero_stage))
    assert all(v["world"] == 2 and v["server_ranks"] == [0, 1] and v["backward"] == "resend" for v in values)
    steps = [values[0]["steps"][k] + values[1]["steps"][k] for k in range(3)]
    losses, params, _ = reference_run(steps, LR)
    for value in values:
        torch.testing.assert_close(torch.tensor(value["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-6)
        for name, trained in value["params"].items():
            torch.testing.assert_close(torch.tensor(trained), params[name], rtol=1e-4, atol=1e-5)


# -- refusals -----------------------------------------------------------------------------------------


def _arguments(tmp_path, **overrides):
    from transformers import TrainingArguments

    defaults = dict(output_dir=str(tmp_path), per_device_train_batch_size=1, per_device_eval_batch_size=1,
                    report_to=[], max_steps=1)
    return TrainingArguments(**{**defaults, **overrides})


def test_models_distca_cannot_dispatch_are_refused(tmp_path):
    from transformers import AutoModelForCausalLM, BloomConfig

    from distca_hf import DistCAAccelerator, DistCATrainer, PackingConfig
    from helpers import tiny_model

    packing = PackingConfig(tokens_per_rank=BUDGET)
    with pytest.raises(ValueError, match=r"needs attn_implementation='distca', but this LlamaForCausalLM uses 'eager'"):
        DistCATrainer(model=tiny_model("llama", attn="eager"), args=_arguments(tmp_path), train_dataset=[[1, 2]],
                      packing=packing)
    bloom = AutoModelForCausalLM.from_config(BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=1, n_head=4),
                                             attn_implementation="distca")
    assert bloom.config._attn_implementation == "distca"  # transformers accepts it, and would ignore it
    with pytest.raises(ValueError, match=r"BloomForCausalLM computes attention in its own code.*silently ignored"):
        DistCATrainer(model=bloom, args=_arguments(tmp_path), train_dataset=[[1, 2]], packing=packing)
    accelerator = DistCAAccelerator()
    with pytest.raises(ValueError, match="uses 'sdpa'"):
        accelerator.prepare(tiny_model("llama", attn="sdpa"))


def test_bad_trainer_setups_say_what_is_wrong(tmp_path):
    from distca_hf import DistCATrainer, PackingConfig
    from helpers import tiny_model

    model = tiny_model("llama")
    packing = PackingConfig(tokens_per_rank=BUDGET)
    with pytest.raises(ValueError, match=r"per_device_train_batch_size=1 \(got 4\).*tokens_per_rank"):
        DistCATrainer(model=model, args=_arguments(tmp_path, per_device_train_batch_size=4), train_dataset=[[1, 2]],
                      packing=packing)
    with pytest.raises(ValueError, match="raw documents: pass packing=PackingConfig"):
        DistCATrainer(model=model, args=_arguments(tmp_path), train_dataset=[[1, 2]])
    with pytest.raises(ValueError, match="average_tokens_across_devices=False"):
        DistCATrainer(model=model, args=_arguments(tmp_path, average_tokens_across_devices=False),
                      train_dataset=[[1, 2]], packing=packing)
    with pytest.raises(TypeError, match="distca_plugin must be a distca_hf.DistCAPlugin"):
        DistCATrainer(model=model, args=_arguments(tmp_path), train_dataset=[[1, 2]], packing=packing,
                      distca_plugin={"tolerance": 0.1})


# -- the recipes launch the examples ------------------------------------------------------------------------


def _launch(*arguments, timeout=300):
    """``accelerate launch ...`` in its own process group, killed whole (launcher and ranks) on timeout."""
    import signal

    accelerate = Path(sys.executable).parent / "accelerate"
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT")}
    process = subprocess.Popen([str(accelerate), "launch", *arguments], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"accelerate launch {' '.join(arguments)} did not finish in {timeout}s:\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@pytest.mark.distributed
def test_cpu_recipe_runs_the_fine_tuning_demo_on_two_processes():
    result = _launch("--config_file", "recipes/cpu-2proc.yaml", "--main_process_port", str(free_port()),
                     "examples/finetune_long_context.py", "--max-steps", "3", "--tokens-per-rank", "1024",
                     "--compare-colocated", "--distca-config", "recipes/distca.yaml")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "== distca: 3 steps on 2 ranks ==" in out and "== colocated: 3 steps on 2 ranks ==" in out
    assert "largest |loss difference| over 3 steps" in out and "speedup:" in out
    assert "cut into" in out  # the packing report names what was cut


@pytest.mark.distributed
def test_deepspeed_recipe_and_plain_accelerate_loop_launch():
    # ZeRO-3 with zero3_init_flag: the model is partitioned while it is built
    result = _launch("--config_file", "recipes/deepspeed-zero3.yaml", "--num_processes", "2", "--main_process_port",
                     str(free_port()), "examples/finetune_long_context.py", "--max-steps", "2", "--tokens-per-rank",
                     "1024", "--eval-documents", "0")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "== distca: 2 steps on 2 ranks ==" in result.stdout
    result = _launch("--config_file", "recipes/cpu-2proc.yaml", "--main_process_port", str(free_port()),
                     "examples/pretrain_packed.py", "--steps", "2", "--tokens-per-rank", "1024")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split() for line in result.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1", "2"] and all(float(r[1]) > 0 for r in rows)


@pytest.mark.distributed
def test_plan_visualize_draws_a_plan(tmp_path):
    out = tmp_path / "plan.png"
    result = subprocess.run([sys.executable, "examples/plan_visualize.py", "--out", str(out), "--ranks", "3",
                             "--tokens-per-rank", "4096"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert out.stat().st_size > 10_000 and "colocated" in result.stdout and "-> distca" in result.stdout
