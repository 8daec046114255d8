"""FSDP2 with distca on two CPU processes, really sharded, against the single-process reference.

Accelerate (1.x) drops an FSDP request on CPU processes and trains with DDP without a word;
``distca_hf.apply_cpu_fsdp`` (which ``DistCATrainer`` and ``DistCAAccelerator`` call themselves) puts
it back, so ``fully_shard`` runs on gloo. Each run asserts that the parameters are DTensors while
training (they are not without the fix), and that the losses of every step and the final
parameters equal ``test_trainer.reference_run``: the same documents, each run alone with eager
attention, one process, SGD (fp32). ``DistCATrainer`` (documents spanning both ranks) and
``DistCAAccelerator`` in a plain loop run under the environment that ``accelerate launch
--config_file recipes/fsdp2.yaml --num_processes 2`` gives its processes (Accelerate's own launcher
code computes it); the plain ``Trainer`` (``DataCollatorWithFlattening``) and TRL's ``SFTTrainer``
(bfd packing) run with ``TrainingArguments(fsdp=...)`` / ``SFTConfig(fsdp=...)``, and are first seen
to warn while their request is still dropped. A sharded checkpoint resumes to the uninterrupted run.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

from dist_harness import run_ranks
from helpers import assert_trained_like_reference
from distca_hf.runtime.comm import free_port
from test_trainer import (LENGTHS, LR, _accelerator_worker, _assert_matches_reference, _check_ranks, _documents,
                          _resume, _train_worker, reference_run)

REPO = Path(__file__).resolve().parent.parent
DROPPED = "asked for FSDP"  # in the warning of a forward whose FSDP request was dropped


def recipe_environment(recipe: str = "fsdp2", processes: int = 2) -> dict:
    """The ``ACCELERATE_*`` / ``FSDP_*`` variables ``accelerate launch --config_file recipes/RECIPE.yaml
    --num_processes N`` sets in each process, computed by Accelerate's launcher (nothing is started)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    arguments = launch_command_parser().parse_args([
        "--config_file", str(REPO / "recipes" / f"{recipe}.yaml"), "--num_processes", str(processes),
        "--main_process_port", str(free_port()), "script.py"])
    arguments, _, _ = _validate_launch_command(arguments)
    assert arguments.use_fsdp  # the recipe takes the launcher's FSDP branch (multi-process, FSDP variables)
    environment = prepare_multi_gpu_env(arguments)
    return {k: v for k, v in environment.items() if k.startswith(("ACCELERATE_", "FSDP_")) and os.environ.get(k) != v}


def test_the_recipe_asks_for_fsdp2_with_layer_units():
    environment = recipe_environment()
    assert environment["ACCELERATE_USE_FSDP"] == "true" and environment["FSDP_VERSION"] == "2"
    assert environment["FSDP_AUTO_WRAP_POLICY"] == "TRANSFORMER_BASED_WRAP"
    assert environment["FSDP_STATE_DICT_TYPE"] == "FULL_STATE_DICT"  # save_model writes one ordinary folder


@pytest.mark.distributed
def test_distca_trainer_on_the_fsdp2_recipe_shards_and_matches_single_process(tmp_path):
    """Two optimizer steps of two micro-batches (gradient accumulation: FSDP2's deferred reduce-scatter),
    documents spanning both ranks."""
    case = {"max_steps": 2, "accumulation": 2}
    values = _check_ranks(run_ranks(_train_worker, 2, tmp_path, case, str(tmp_path), env=recipe_environment()))
    assert all(v["world"] == 2 and v["span_ranks"] for v in values)
    assert all(v["parameter_types"] == ["DTensor"] for v in values)  # sharded: every parameter a DTensor shard
    assert any(p > 0 for v in values for _, _, p, _, _ in v["recorded"])  # a document went on across ranks
    _assert_matches_reference(values, str(tmp_path))


def _resume_worker(rank, world, out_dir):
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    return _resume(out_dir, rank, {}, max_steps=4, save_steps=2)


@pytest.mark.distributed
def test_fsdp2_checkpoint_resumes_to_the_uninterrupted_run(tmp_path):
    """A sharded checkpoint (model, AdamW states, schedule) saved at step 2 and resumed: steps 3 and 4
    give the losses and weights of the run that went on."""
    full, resumed = zip(*_check_ranks(run_ranks(_resume_worker, 2, tmp_path, str(tmp_path),
                                                env=recipe_environment())))
    for whole, again in zip(full, resumed):
        assert whole["parameter_types"] == again["parameter_types"] == ["DTensor"]
        assert [r[0] for r in again["recorded"]] == [2, 3] and again["recorded"] == whole["recorded"][2:]
        torch.testing.assert_close(torch.tensor(again["losses"]), torch.tensor(whole["losses"]), rtol=1e-6, atol=1e-7)
    first, second = torch.load(tmp_path / "full-params.pt"), torch.load(tmp_path / "resumed-params.pt")
    for name in first:
        torch.testing.assert_close(second[name], first[name], rtol=1e-6, atol=1e-7)


@pytest.mark.distributed
def test_distca_accelerator_loop_on_the_fsdp2_recipe_shards_and_matches_single_process(tmp_path):
    """``DistCAAccelerator`` in a plain loop (``prepare(model, optimizer, loader)``), three steps."""
    values = _check_ranks(run_ranks(_accelerator_worker, 2, tmp_path, None, env=recipe_environment()))
    assert all(v["world"] == 2 and v["parameter_types"] == ["DTensor"] for v in values)
    losses, params, _ = reference_run([values[0]["steps"][k] + values[1]["steps"][k] for k in range(3)], LR)
    for value in values:
        torch.testing.assert_close(torch.tensor(value["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-6)
        for name, trained in value["params"].items():
            torch.testing.assert_close(torch.tensor(trained), params[name], rtol=1e-4, atol=1e-5)


# -- the plain Trainer ------------------------------------------------------------------------------


def _hf_trainer_worker(rank, world, out_dir, kind):
    """``kind``: ``"trainer"`` (the plain Trainer, ``DataCollatorWithFlattening``, ``TrainingArguments(fsdp=...)``)
    or ``"sft"`` (TRL's ``SFTTrainer``, bfd packing: padding-free rows, ``SFTConfig(fsdp=...)``)."""
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import datasets
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    import distca_hf
    from distca_hf.state import STATE
    from helpers import tiny_model

    if kind == "sft":
        from trl import SFTConfig, SFTTrainer

        from test_trl import _texts, _tokenizer

        base, arguments_class = SFTTrainer, SFTConfig
        extra_arguments = dict(packing=True, packing_strategy="bfd", max_length=128, bf16=False)
        extra_trainer = dict(processing_class=_tokenizer(_texts()))  # ids of the documents below are < 96
    else:
        base, arguments_class = Trainer, TrainingArguments
        extra_arguments, extra_trainer = {}, {}

    class RecordingTrainer(base):
        def training_step(self, model, inputs, num_items_in_batch=None):
            self.parameter_types.update(type(p).__name__ for p in model.parameters())
            cu = inputs["cu_seq_lens_q"].tolist()
            ids = inputs["input_ids"][0].tolist()
            self.recorded.append([self.state.global_step, [ids[a:b] for a, b in zip(cu, cu[1:])]])
            return super().training_step(model, inputs, num_items_in_batch)

    args = arguments_class(
        output_dir=out_dir, per_device_train_batch_size=2, max_steps=2, learning_rate=LR, optim="sgd",
        lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, logging_steps=1, report_to=[],
        disable_tqdm=True, seed=0, data_seed=0, save_strategy="no", dataloader_pin_memory=False, use_cpu=True,
        fsdp=True, fsdp_config={"version": 2, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}, **extra_arguments)
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    trainer = RecordingTrainer(model=tiny_model("llama"), args=args,
                               train_dataset=datasets.Dataset.from_dict({"input_ids": _documents(LENGTHS, 0)}),
                               **(extra_trainer if kind == "sft" else {"data_collator": collator}))
    trainer.recorded, trainer.parameter_types = [], set()
    # Before apply_cpu_fsdp: Accelerate has dropped the request, and distca's first forward says so.
    with warnings.catch_warnings(record=True) as dropped, torch.no_grad():
        warnings.simplefilter("always")
        trainer.model(**collator([{"input_ids": d} for d in _documents([20, 7], rank)]))
    STATE.warned.discard("fsdp-checked")
    assert distca_hf.apply_cpu_fsdp(trainer) is True
    with warnings.catch_warnings(record=True) as sharded:
        warnings.simplefilter("always")
        trainer.train()
    state = {n: p.full_tensor().detach().clone() for n, p in trainer.model.named_parameters()}
    if rank == 0:
        torch.save(state, os.path.join(out_dir, "run-params.pt"))
    return {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h], "recorded": trainer.recorded,
            "parameter_types": sorted(trainer.parameter_types), "fsdp_enabled": trainer.is_fsdp_enabled,
            "warned_before": [str(w.message) for w in dropped if DROPPED in str(w.message)],
            "warned_after": [str(w.message) for w in sharded if DROPPED in str(w.message)]}


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["trainer", "sft"])
def test_hf_trainers_with_fsdp_arguments_shard_after_apply_cpu_fsdp(tmp_path, kind):
    if kind == "sft":
        pytest.importorskip("trl", reason="TRL is in the test extra: pip install 'distca-hf[test]'")
    values = _check_ranks(run_ranks(_hf_trainer_worker, 2, tmp_path, str(tmp_path), kind))
    for value in values:
        assert value["warned_before"] and "distca_hf.apply_cpu_fsdp(trainer)" in value["warned_before"][0]
        assert not value["warned_after"]
        assert value["fsdp_enabled"] and value["parameter_types"] == ["DTensor"]
    # each optimizer step trains both ranks' rows: the global batch of the single-process reference
    steps = [[d for value in values for step, documents in value["recorded"] if step == k for d in documents]
             for k in range(2)]
    assert all(len(documents) >= 4 for documents in steps)  # (bfd packs several documents per row)
    losses, params, _ = reference_run(steps, LR)
    assert_trained_like_reference([value["losses"] for value in values], torch.load(tmp_path / "run-params.pt"),
                                  losses, params)


# -- what cannot shard is refused ---------------------------------------------------------------------


def test_fsdp1_on_cpu_processes_is_refused_naming_fsdp_version_2(monkeypatch):
    """torch's FSDP1 wrapper refuses Accelerate's CPU device, so fsdp_version: 1 stops with the fix
    instead of running DDP (an Accelerate state of CPU processes, as two gloo ranks have it)."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from distca_hf import apply_cpu_fsdp

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    accelerator = SimpleNamespace(state=SimpleNamespace(distributed_type=DistributedType.MULTI_CPU,
                                                        mixed_precision="no"), _models=[])
    with pytest.raises(ValueError, match=r"fsdp_version: 1 cannot shard on CPU.*fsdp_version: 2"):
        apply_cpu_fsdp(accelerator)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")  # no request: nothing to put back
    assert apply_cpu_fsdp(accelerator) is False
    assert accelerator.state.distributed_type == DistributedType.MULTI_CPU


def test_an_fsdp_resume_torch_cannot_load_names_the_way_out():
    """torch's bare assertion when FSDP loads a FULL_STATE_DICT checkpoint of an optimizer without state (SGD
    without momentum) becomes an error naming the two ways out; other assertions stay what they are."""
    from types import SimpleNamespace

    from distca_hf.training.global_batches import GlobalBatchTrainerMixin

    class Failing:
        def _load_optimizer_and_scheduler(self, checkpoint):
            raise AssertionError(self.message)

    class Trainer(GlobalBatchTrainerMixin, Failing):
        pass

    trainer = Trainer.__new__(Trainer)
    trainer.args = SimpleNamespace(device=torch.device("cpu"))
    trainer.message, trainer.is_fsdp_enabled = "Expected device to be set", True
    with pytest.raises(RuntimeError, match=r"keeps no state .* SHARDED_STATE_DICT .* \(momentum, AdamW\)"):
        trainer._load_optimizer_and_scheduler("checkpoint-1")
    trainer.is_fsdp_enabled = False
    with pytest.raises(AssertionError, match="Expected device"):
        trainer._load_optimizer_and_scheduler("checkpoint-1")
