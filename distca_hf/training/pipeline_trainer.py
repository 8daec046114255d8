"""``PipelineTrainerMixin``: what ``DistCATrainer`` does in pipeline stages (``pipeline_parallel_size > 1``).

    DistCATrainer(model=model, args=args, train_dataset=documents, packing=PackingConfig(tokens_per_rank=8192),
                  distca_plugin=DistCAPlugin(pipeline_parallel_size=2, pipeline_schedule="cad_1f1b")).train()

The Trainer sees one ordinary model, this rank's stage, and one ordinary dataset per split; what
differs lives here:

- **the model**: the whole HF model given is split into this rank's stage (``training.pipeline_stages``)
  before the Trainer is set up, so the Trainer's ``model`` is the stage and its optimizer holds the
  stage's parameters only. No DDP goes around it (``_PipelineStageHandle`` is the wrapped model): the
  ``PipelineRunner`` sums the gradients over the stage's data-parallel copies itself;
- **the rows**: packed to exactly ``tokens_per_rank`` tokens (the stages exchange fixed shapes) and read
  alike by every stage of a pipeline (``_PipelineRows``: laid out for the data-parallel ranks, in blocks
  of whole optimizer steps);
- **a step**: ``pipeline_micro_batches`` rows per data-parallel rank, which are the Trainer's
  ``gradient_accumulation_steps``, are collected and run together through the schedule
  (``pipeline_schedule``) by one ``PipelineRunner.train_step``: the loss is token-weighted over the
  step, gradients are summed over the stage's copies and clipped over all stages
  (``PipelineRunner.clip_grad_norm_``); evaluation runs each row forward through the stages
  (``PipelineRunner.eval_step``, the loss only: ``compute_metrics`` is refused), a dataset given to
  ``evaluate()`` later included; ``num_input_tokens_seen`` counts each row once, not once per stage
  (``_InputTokensOncePerPipeline``), as do the rows per step and per second the Trainer reports
  (``get_total_train_batch_size``, ``num_examples``, ``log``); the caller's ``TrainingArguments`` are left as given (the Trainer
  gets a copy with the step's micro-batches as ``gradient_accumulation_steps``);
- **checkpoints**: one weights file and one optimizer file per stage (written by the stage's first
  data-parallel copy), resumed with the same pipeline size (a ``save_only_model`` checkpoint resumes
  the weights, the optimizer afresh, as the Trainer does); ``save_model()`` writes one ordinary
  ``save_pretrained`` folder of the whole model (a gather over each pipeline; a PEFT model: its adapter folder);
- **activation checkpointing** (``activation_checkpointing=True``): the Trainer enables it on the stage
  (``PipelineStageModule.activation_checkpointing_enable``: the stage's own layers, ``every_n_layers``
  counted from its first), for every schedule (``cad_1f1b``'s recomputations join its backward ticks);
- **refusals**: what the stages cannot run (DeepSpeed, FSDP, tensor parallelism, autocast, streaming
  datasets, ...) is refused by name before anything is built.

``DistCATrainer`` lists this mixin first among its bases; each override here hands over to the next
class (``super()``) while ``_pipeline`` is ``None``, so without pipeline stages nothing changes. The
host calls ``_prepare_pipeline_stage`` before ``Trainer.__init__``, packs its datasets with
``_pipeline_packing_layout()`` and calls ``_start_pipeline`` once they are packed; it provides
``distca_plugin``, ``distca`` (``DistCAPlugin.attach``'s groups), ``_packed_datasets`` (split name ->
``PackedDataset``) and ``_record_plan(inputs)`` (the step table's attention balance), and
``GlobalBatchTrainerMixin`` provides ``_add_eval_loss``.
"""

from __future__ import annotations

import copy
import dataclasses
import glob
import os

import torch
from transformers import TrainerCallback

from ..runtime.pipeline_schedules import check_micro_batches
from .accelerator import hf_model_of, is_compiled_model
from .packing import PackedDataset
from .pipeline import PipelineRunner
from .pipeline_stages import build_stage_module, save_pipeline_model, stage_state_dict

__all__ = ["PipelineTrainerMixin"]

_WITHOUT_STAGES = "pipeline_parallel_size=1 (DistCAPlugin, the distca: section or --pipeline_parallel_size)"


def _is_peft_model(model) -> bool:
    """Whether ``model`` is a PEFT wrapper (``peft.PeftModel``; peft itself is not a dependency)."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


class PipelineTrainerMixin:
    """Mixed in before ``GlobalBatchTrainerMixin`` and ``transformers.Trainer`` (see the module docstring).

    Attributes:
        _pipeline: this rank's ``PipelineRunner``, ``None`` without pipeline stages (a class default,
            so every override can test it, even while ``Trainer.__init__`` runs).
        _pipeline_peft_model: the PEFT wrapper the model came in (``save_model`` writes its adapter), or ``None``.
    """

    _pipeline: PipelineRunner | None = None
    _pipeline_peft_model = None

    # -- set-up: before the Trainer (the stage), after packing (the runner) ---------------------------

    def _prepare_pipeline_stage(self, model, args, *, trainer_kwargs: dict, streaming: list[str]):
        """``(this rank's stage of model, the arguments the Trainer gets)``, ``model`` the whole HF model
        (before ``Trainer.__init__``).

        Refuses what pipeline stages cannot run, naming it; ``streaming``: the trainer arguments that
        hold streaming datasets (``train_dataset``, ``eval_dataset['x']``, ...); ``trainer_kwargs``: the other
        keyword arguments given to the Trainer (``compute_loss_func``, ``compute_metrics``, ...). The
        arguments returned are a copy of ``args`` whose ``gradient_accumulation_steps`` is the micro-batches
        of one optimizer step (the Trainer then hands over that many rows per step); ``args`` is unchanged."""
        plugin = self.distca_plugin
        stages = plugin.pipeline_parallel_size
        where = f"DistCATrainer with pipeline_parallel_size={stages}"
        if model is None or args is None:
            raise ValueError(f"{where} needs model= (the whole HF model, split here into stages) and args=; "
                             "model_init is not supported")
        for setting, used in _refused_settings(model, args, trainer_kwargs).items():
            if used:
                raise ValueError(f"{where}: {setting} is not supported with pipeline stages; set {_WITHOUT_STAGES} "
                                 "to use it")
        if streaming:
            raise ValueError(f"{where}: {_streaming_refused(streaming[0])}")
        topology = plugin.topology(args.world_size, model=hf_model_of(model))
        if topology.tensor_parallel != 1:
            raise ValueError(f"{where}: tensor_parallel_size={topology.tensor_parallel} with pipeline stages is not "
                             "supported (a stage runs whole layers on one rank); set tensor_parallel_size=1 (give "
                             "those ranks to data parallelism) or pipeline_parallel_size=1")
        config = plugin.resolved()
        self._pipeline_micro_batches = _micro_batches_per_step(
            config.pipeline_micro_batches, args.gradient_accumulation_steps, stages=stages,
            schedule=config.pipeline_schedule, where=where)
        # on a copy: the caller's arguments keep what they said (a second trainer built from them, with or
        # without stages, sees the user's gradient_accumulation_steps)
        args = copy.copy(args)
        args.gradient_accumulation_steps = self._pipeline_micro_batches
        # a PEFT model: its stage is split from the model inside; save_model() writes the wrapper's adapter
        self._pipeline_peft_model = model if _is_peft_model(model) else None
        return build_stage_module(hf_model_of(model), stage_index=topology.coordinates(args.process_index)[1],
                                  num_stages=stages), args

    def _pipeline_packing_layout(self) -> dict:
        """What ``PackedDataset.with_layout`` gets besides the ranks: every row exactly ``tokens_per_rank``
        tokens (the stages exchange fixed shapes), and a step's rows packed (and balanced, if asked)
        together."""
        return {"full_rows": True, "step_micro_batches": self._pipeline_micro_batches}

    def _start_pipeline(self) -> None:
        """The ``PipelineRunner`` of this rank's stage (a collective over the job: it makes the pipeline
        and data-parallel groups), and the packed datasets as every stage of a pipeline reads them."""
        where = f"DistCATrainer with pipeline_parallel_size={self.distca_plugin.pipeline_parallel_size}"
        tokens = {name: dataset.config.tokens_per_rank for name, dataset in self._packed_datasets.items()}
        if not tokens:
            raise ValueError(f"{where} needs train_dataset= or eval_dataset=: the shapes the stages exchange come "
                             "from their packing (PackingConfig.tokens_per_rank)")
        if len(set(tokens.values())) > 1:
            raise ValueError(f"{where}: the datasets are packed with different tokens_per_rank ({tokens}); the stages "
                             "exchange fixed shapes, so pack them all with one")
        config = self.distca.config
        topology = self.distca.topology
        self._pipeline = PipelineRunner(self.model, topology=topology, rank=self.args.process_index,
                                        schedule=config.pipeline_schedule,
                                        tokens_per_micro_batch=next(iter(tokens.values())),
                                        device=self.args.device, timeout_s=config.timeout_s)
        self._pipeline_pending = []  # the rows of the optimizer step being collected
        self.add_callback(_InputTokensOncePerPipeline(topology.pipeline_parallel))
        self._pipeline_handle = _PipelineStageHandle(self.model)
        self.train_dataset = _PipelineRows.of(self.train_dataset, topology, self._pipeline_micro_batches)
        if isinstance(self.eval_dataset, dict):
            self.eval_dataset = {name: _PipelineRows.of(d, topology, 1) for name, d in self.eval_dataset.items()}
        else:
            self.eval_dataset = _PipelineRows.of(self.eval_dataset, topology, 1)
        # packing_reports reads the rows as the stages do (their filler rows completing the last step counted)
        rows = {"train": self.train_dataset}
        if isinstance(self.eval_dataset, dict):
            rows.update({f"eval_{name}": d for name, d in self.eval_dataset.items()})
        else:
            rows["eval"] = self.eval_dataset
        self._packed_datasets.update({name: d for name, d in rows.items() if d is not None and name in self._packed_datasets})

    def _pipeline_rows_later(self, packed: PackedDataset, name: str):
        """A dataset given to ``evaluate()`` / ``predict()`` after construction (``packed`` for the
        data-parallel ranks), as every stage of a pipeline reads it; its rows must have the shape the
        stages exchange."""
        tokens = self._pipeline.tokens_per_micro_batch
        if not isinstance(packed, PackedDataset):
            raise ValueError(_streaming_refused(f"the {name} dataset"))
        if packed.config.tokens_per_rank != tokens:
            raise ValueError(f"the {name} dataset is packed with tokens_per_rank={packed.config.tokens_per_rank}, but "
                             f"the pipeline stages exchange rows of {tokens} tokens (the constructor's datasets' "
                             f"packing); pack it with PackingConfig(tokens_per_rank={tokens}) or pass the documents")
        rows = _PipelineRows.of(packed, self.distca.topology, 1)
        self._packed_datasets[name] = rows
        return rows

    def _lays_out_global_batches(self, dataset) -> bool:
        # a pipeline's stages read the same rows in the same step: global-batch blocks, even without span_ranks
        return isinstance(dataset, _PipelineRows) or super()._lays_out_global_batches(dataset)

    # -- counts: every stage of a pipeline reads the same rows, so the Trainer's per-rank sums count each P times

    def get_total_train_batch_size(self, args) -> int:
        """Rows one optimizer step trains (``train_samples_per_second``, the "Total train batch size" log):
        the Trainer's micro-batch x accumulation x ranks, counted once per pipeline, not once per stage."""
        total = super().get_total_train_batch_size(args)
        return total if self._pipeline is None else total // self.distca.topology.pipeline_parallel

    def num_examples(self, dataloader) -> int:
        """Rows in ``dataloader``'s dataset, once per pipeline (``_PipelineRows`` holds one copy per stage)."""
        rows = super().num_examples(dataloader)
        if self._pipeline is None or not isinstance(getattr(dataloader, "dataset", None), _PipelineRows):
            return rows
        return rows // self.distca.topology.pipeline_parallel

    def log(self, logs: dict, *args, **kwargs) -> None:
        """``evaluate()`` / ``predict()`` time rows from ``len(eval_dataset)``, which holds one copy per
        stage: their ``*_samples_per_second`` are divided by the stages here, in place, before any callback
        reads them (their steps per second are right: each rank ran its copy's batches). Training's are
        counted right at the source (``get_total_train_batch_size``)."""
        if self._pipeline is not None:
            stages = self.distca.topology.pipeline_parallel
            for key in [k for k in logs if k.endswith("_samples_per_second") and k != "train_samples_per_second"]:
                logs[key] = round(logs[key] / stages, 3)  # (speed_metrics rounds to 3 decimals too)
        return super().log(logs, *args, **kwargs)

    # -- a step: its micro-batches through the stages ---------------------------------------------------

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Collects the step's micro-batches; with the last, runs them through the stages (forward and
        backward). Returns the step's loss then and 0 before, so that the Trainer's sum over the
        accumulation steps is the step's loss."""
        if self._pipeline is None:
            return super().training_step(model, inputs, num_items_in_batch)
        self._pipeline_pending.append(self._prepare_inputs(inputs))
        if len(self._pipeline_pending) < self.current_gradient_accumulation_steps:
            return torch.zeros((), device=self.args.device)
        micro_batches, self._pipeline_pending = self._pipeline_pending, []
        loss = self._pipeline.train_step(micro_batches)
        plans = self._pipeline.step_plans  # each micro-batch's plan on this stage, in order
        for index, micro_batch in enumerate(micro_batches):
            self._record_plan(micro_batch, plans[index] if len(plans) == len(micro_batches) else None)
        return loss.to(self.args.device, torch.float32)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """The stages' forward of one row: the loss only (the logits stay on the last stage)."""
        if self._pipeline is None:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        loss_sum, count = self._pipeline.eval_step(self._prepare_inputs(inputs))
        self._add_eval_loss(loss_sum, count)
        return (loss_sum / count.clamp(min=1)).float(), None, None

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        if self._pipeline is None:
            return super()._wrap_model(model, training, dataloader)
        return self._pipeline_handle  # no DDP: the runner sums the gradients over the stage's data-parallel copies

    def create_accelerator_and_postprocess(self):
        # Every transformers release clips (and, with max_grad_norm=0, measures) through
        # accelerator.clip_grad_norm_(model.parameters(), ...): from 5.3 inside Trainer._clip_grad_norm /
        # _get_grad_norm, before that inline in the training loop. On a stage that would be the norm of its own
        # parameters (each stage clipped by its own norm: a silent wrong update), so a stage's goes to the
        # runner's norm over every stage.
        result = super().create_accelerator_and_postprocess()
        plain = self.accelerator.clip_grad_norm_

        def clip_grad_norm_(parameters, max_norm, norm_type=2):
            if self._pipeline is None:
                return plain(parameters, max_norm, norm_type)
            if norm_type != 2:
                raise ValueError(f"pipeline stages clip by the 2-norm over every stage, got norm_type={norm_type}")
            return self._pipeline.clip_grad_norm_(max_norm)  # (max_norm inf: the norm alone)

        self.accelerator.clip_grad_norm_ = clip_grad_norm_
        return result

    # -- checkpoints: one weights and one optimizer file per stage; save_model: one whole-model folder -

    def _writes_stage_files(self) -> bool:
        """The stage's first data-parallel copy writes (its copies hold the same weights and state)."""
        return self.distca.topology.coordinates(self.args.process_index)[0] == 0

    def _stage_file(self, kind: str) -> str:
        return _stage_checkpoint_file(kind, stage_index=self._pipeline.stage_index,
                                      num_stages=self._pipeline.num_stages)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if self._pipeline is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if _internal_call:  # a checkpoint: this stage's weights, for resuming
            if self._writes_stage_files():
                os.makedirs(output_dir, exist_ok=True)
                torch.save(stage_state_dict(self.model), os.path.join(output_dir, self._stage_file("model")))
            return
        # every stage of every pipeline takes part (a gather over the pipeline); the first pipeline writes
        save_pipeline_model(self.model, output_dir, pipeline_group=self._pipeline.pipeline_group,
                            peft_model=self._pipeline_peft_model, is_main_process=self._writes_stage_files())
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self._pipeline is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        os.makedirs(output_dir, exist_ok=True)
        if self._writes_stage_files():
            torch.save(self.optimizer.state_dict(), os.path.join(output_dir, self._stage_file("optimizer")))
        if self.args.should_save:  # one schedule for the whole job
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        if self._pipeline is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        path = self._checkpoint_file(resume_from_checkpoint, "model")
        self.model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True), strict=True)

    def _load_optimizer_and_scheduler(self, checkpoint):
        if self._pipeline is None or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        # saved with save_only_model=True (no optimizer file, no scheduler): the weights resumed (this stage's file,
        # _load_from_checkpoint), the optimizer starts afresh, as the Trainer's does
        if not any(os.path.isfile(os.path.join(checkpoint, name)) for name in (self._stage_file("optimizer"),
                                                                               "scheduler.pt")):
            return
        path = self._checkpoint_file(checkpoint, "optimizer")
        # the plain "cpu": torch.load cannot restore to an indexed CPU device ("cpu:0"), which a process's may be
        device = self.args.device if self.args.device.type != "cpu" else "cpu"
        self.optimizer.load_state_dict(torch.load(path, map_location=device, weights_only=True))
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, "scheduler.pt"), weights_only=True))

    def _checkpoint_file(self, checkpoint: str, kind: str) -> str:
        """This stage's ``kind`` file in ``checkpoint``; a clear error (with the pipeline size the
        checkpoint was saved with, when it holds stage files) where it has none."""
        path = os.path.join(checkpoint, self._stage_file(kind))
        if os.path.isfile(path):
            return path
        any_stage = _stage_checkpoint_file(kind, stage_index="*", num_stages="*")
        found = sorted(os.path.basename(p) for p in glob.glob(os.path.join(glob.escape(checkpoint), any_stage)))
        holds = f"it holds {found}" if found else "it holds no pipeline stage files"
        raise FileNotFoundError(
            f"resume_from_checkpoint={checkpoint!r} has no {self._stage_file(kind)} ({holds}): it was not saved by "
            f"DistCATrainer with pipeline_parallel_size={self._pipeline.num_stages} (a checkpoint holds one file per "
            "stage); resume with the pipeline size it was saved with")


class _InputTokensOncePerPipeline(TrainerCallback):
    """``include_num_input_tokens_seen``: the Trainer sums every rank's input tokens, but all ``stages``
    of a pipeline read the same rows, so it counts each row ``stages`` times. At every step's end the
    step's increment is divided by ``stages`` (exact: every stage added the same count), before the
    step's logs read it."""

    def __init__(self, stages: int):
        self.stages = stages
        self.counted = 0  # num_input_tokens_seen once corrected

    def on_train_begin(self, args, state, control, **kwargs):
        self.counted = state.num_input_tokens_seen  # a resumed run's is the checkpoint's, corrected then
        return control

    def on_step_end(self, args, state, control, **kwargs):
        state.num_input_tokens_seen = self.counted + (state.num_input_tokens_seen - self.counted) // self.stages
        self.counted = state.num_input_tokens_seen
        return control


def _streaming_refused(what: str) -> str:
    """Why ``what`` (a dataset, named as the user gave it), a streaming one, cannot run in stages."""
    return (f"{what} is a streaming dataset; pipeline stages read map-style datasets (every stage of a pipeline "
            "reads the same rows); load it whole")


def _stage_checkpoint_file(kind: str, *, stage_index: int | str, num_stages: int | str) -> str:
    """The file name of one stage's ``kind`` (``model`` or ``optimizer``) in a checkpoint folder
    (``"*"`` for both numbers: the glob pattern of every stage's)."""
    return f"{kind}-pipeline-stage-{stage_index}-of-{num_stages}.pt"


def _refused_settings(model, args, trainer_kwargs: dict) -> dict[str, bool]:
    """The settings pipeline stages refuse, each named as the user gives it, with whether it is on
    (``model``: the model given; ``args``: the ``TrainingArguments``; ``trainer_kwargs``: the Trainer's
    other keyword arguments)."""
    return {
        # PipelineRunner runs the stages as built: compiled, the Trainer's model would be left unused, silently
        "torch_compile (TrainingArguments.torch_compile)": bool(args.torch_compile),
        "a torch.compile'd model (the stages are split from the model inside, and would run uncompiled)":
            is_compiled_model(model),
        "DeepSpeed (TrainingArguments.deepspeed)": bool(args.deepspeed),
        "FSDP (TrainingArguments.fsdp)": bool(args.fsdp),
        # PipelineRunner runs the stages without the Trainer's autocast, and the activations they exchange are
        # declared in the parameters' dtype
        "mixed precision (--bf16 / --fp16 autocast; load the model in that dtype instead)":
            bool(args.bf16 or args.fp16),
        # the Trainer would load the best checkpoint as a whole model; a checkpoint here holds stage files
        "load_best_model_at_end": bool(args.load_best_model_at_end),
        # the stages' loss is PipelineRunner's plain token-weighted cross-entropy: it would be ignored
        "label_smoothing_factor": bool(args.label_smoothing_factor),
        "compute_loss_func (the stages' loss is distca's token-weighted cross-entropy)":
            trainer_kwargs.get("compute_loss_func") is not None,
        # NEFTune hooks the input embeddings of a whole model; a stage holds them on the first stage only
        "neftune_noise_alpha (TrainingArguments.neftune_noise_alpha)": args.neftune_noise_alpha is not None,
        # evaluation in stages returns the loss only (the logits stay on the last stage): metrics would never run
        "compute_metrics (evaluation in stages gives the loss only)": trainer_kwargs.get("compute_metrics") is not None,
        "preprocess_logits_for_metrics (evaluation in stages gives the loss only)":
            trainer_kwargs.get("preprocess_logits_for_metrics") is not None,
    }


def _micro_batches_per_step(micro_batches: int | None, accumulation: int, *, stages: int, schedule: str,
                            where: str) -> int:
    """Rows per data-parallel rank in one optimizer step: ``pipeline_micro_batches`` when set (the
    Trainer's ``gradient_accumulation_steps`` then 1 or the same number), else the accumulation steps,
    at least the stage count (fewer micro-batches than stages leave a stage idle the whole step)."""
    if micro_batches is None:
        return max(accumulation, stages)
    if accumulation not in (1, micro_batches):
        raise ValueError(f"{where}: pipeline_micro_batches={micro_batches} and gradient_accumulation_steps="
                         f"{accumulation} disagree: a pipeline runs one step's micro-batches together, so they are one "
                         "number; set one of them")
    try:
        check_micro_batches(schedule, micro_batches, stages, setting="pipeline_micro_batches")
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return micro_batches


class _PipelineStageHandle(torch.nn.Module):
    """The stage as the Trainer's wrapped model: no DDP around it (``PipelineRunner`` sums the gradients
    over the stage's data-parallel copies), and no forward of its own (the stages run in the runner)."""

    def __init__(self, stage):
        super().__init__()
        self.module = stage

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipeline stage runs through DistCATrainer's PipelineRunner (train_step / eval_step), "
                           "not by calling the wrapped model")


class _PipelineRows(torch.utils.data.Dataset):
    """A ``PackedDataset`` laid out for the data-parallel ranks, as the stages of each pipeline read it.

    Item ``i`` belongs to rank ``i % world_size`` (Accelerate's sharding) and is the row its
    data-parallel index holds in block ``i // world_size``, so every stage of a pipeline reads the same
    row in the same step. The blocks are padded with filler rows (``tokens_per_rank`` padding tokens,
    no labels) to a multiple of ``micro_batches``: every optimizer step runs the same number of
    micro-batches (the schedules are built for one count).

    Args:
        packed: the rows, packed for ``topology.data_parallel`` ranks with ``full_rows=True``.
        topology: the job's ``ParallelTopology``.
        micro_batches: rows per data-parallel rank and optimizer step (1 for evaluation).
    """

    def __init__(self, packed: PackedDataset, topology, micro_batches: int):
        if packed.world_size != topology.data_parallel or not packed.full_rows:  # the index arithmetic below
            raise ValueError(f"pipeline rows must be packed for the {topology.data_parallel} data-parallel ranks with "
                             f"full_rows=True, got world_size={packed.world_size}, full_rows={packed.full_rows}")
        self.packed = packed
        self.data_parallel = topology.data_parallel
        self._world_size = topology.world_size
        self._data_index = [topology.coordinates(rank)[0] for rank in range(topology.world_size)]
        blocks = len(packed) // self.data_parallel
        self.blocks = -(-blocks // micro_batches) * micro_batches
        self.filler_rows = (self.blocks - blocks) * self.data_parallel  # completing the last step
        # GlobalBatchSampler shuffles a step's blocks as one unit: they were packed (and balanced) as one step
        self.step_blocks = micro_batches

    @classmethod
    def of(cls, dataset, topology, micro_batches: int):
        return None if dataset is None else cls(dataset, topology, micro_batches)

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def config(self):
        return self.packed.config

    @property
    def report(self):
        """The packing's report, its filler rows counting those added here to complete the last step."""
        report = self.packed.report
        return dataclasses.replace(report, filler_micro_batches=report.filler_micro_batches + self.filler_rows)

    def __len__(self) -> int:
        return self.blocks * self._world_size

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < len(self):  # IndexError ends iteration by index (``list(rows)``) instead of looping
            raise IndexError(f"row {index} out of range ({len(self)})")
        block, rank = divmod(index, self._world_size)
        row = block * self.data_parallel + self._data_index[rank]
        if row < len(self.packed):
            return self.packed[row]
        tokens = self.packed.config.tokens_per_rank
        return {"input_ids": [[self.packed.config.pad_token_id] * tokens], "first_position": 0, "last_label": -100,
                "padding": tokens}
