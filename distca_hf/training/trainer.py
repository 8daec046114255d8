"""``DistCATrainer``: a ``transformers.Trainer`` for packed long-context training with CAD.

    trainer = DistCATrainer(model=model, args=TrainingArguments(...), train_dataset=documents,
                            packing=PackingConfig(tokens_per_rank=8192), distca_plugin=DistCAPlugin())
    trainer.train()

What it adds to the stock Trainer:

- the model must use ``attn_implementation="distca"`` (anything else is refused, naming it), and
  its KV cache is turned off;
- documents (``input_ids``) are packed into one row of at most ``tokens_per_rank`` tokens per rank
  and forward (``training.packing``: ``PackedDataset``, or ``StreamingPackedDataset`` for iterable
  datasets), the same number of rows on every rank, every document once per epoch. When the
  attention-server group has more than one rank, documents **span ranks**: the group's ranks share
  a global batch of ``group size * tokens_per_rank`` tokens, each holding one consecutive slice, so
  documents up to that length train whole (the setting ``span_ranks``, see below); the collator
  emits ``position_ids`` (a continuing piece goes on where the previous rank stopped),
  ``cu_seq_lens_q/k`` + ``max_length_q/k`` and ``labels`` + ``shift_labels`` (the last token of a
  piece predicts the first token of the next rank's piece);
- the loss is normalised by the global count of label tokens (``shift_labels``) across ranks and
  gradient accumulation steps (the Trainer's ``num_items_in_batch`` with
  ``average_tokens_across_devices``), so it equals the single-process loss on the whole documents,
  and so do the gradients (each rank's loss is scaled by the world size because DDP / DeepSpeed
  average gradients over ranks);
- the evaluation loss is the exact token-weighted mean over the whole evaluation set;
- each logged step carries ``attn_imbalance_before`` / ``attn_imbalance_after`` (max/mean of
  per-rank attention pairs without and with the plan, averaged over the micro-batches since the
  last log), ``tokens_per_s`` (all ranks) and ``step_time_s`` (wall seconds per optimizer step),
  added in ``Trainer.log``, so the progress bar, ``report_to`` (TensorBoard, W&B, ...) and
  ``state.log_history`` all get them; ``StepTableCallback`` shows them as a table above the bar;
- the launch checks of ``DistCAAccelerator`` (CPU traps, process count) and the plugin's process
  groups and settings.

``span_ranks``, in order of precedence: ``DistCAPlugin(span_ranks=...)``, else ``DISTCA_SPAN_RANKS``,
else ``span_ranks:`` in the plugin's ``distca:`` section, else the trainer's default: on when the
attention-server group has more than one rank (the trainer then puts ``span_ranks=True`` in force
while its ``train()``, ``evaluate()`` and ``predict()`` run, as ``distca_hf.configure`` would, and
puts back what was set before when they return: generating on rank 0 after training just works).
With ``span_ranks=False`` every rank packs its own rows and a document longer than
``tokens_per_rank`` is cut into chunks. ``mode="colocated"`` does not change the packing and stays
exact: no query moves, only the K/V prefixes of spanning documents travel (the baseline of ``examples/finetune_long_context.py --compare-colocated``).

Gradient accumulation, gradient checkpointing (``activation_checkpointing=True``), checkpoint save
and resume (mid-epoch too: global batches are shuffled whole, by ``GlobalBatchSampler``, from the
seed and the epoch alone), evaluation, DDP, DeepSpeed ZeRO 1/2/3, FSDP2 and transformers' tensor
parallelism (a model loaded with ``distributed_config=DistributedConfig(tp_size=...)``: the plugin takes
its size, the tensor-parallel peers read the same rows, the rows are laid out over the data-parallel
ranks; on CPU processes too, ``accelerator.parallelism_config_for_cpu``) are the Trainer's own
(FSDP2 on CPU processes too, where Accelerate alone would run DDP: ``accelerator.apply_cpu_fsdp``).

Pipeline stages (``DistCAPlugin(pipeline_parallel_size=P)``): the model given is split into this rank's
stage (``training.pipeline_stages``), which becomes the Trainer's ``model`` (its optimizer holds the
stage's parameters; no DDP around it). Rows are packed to exactly ``tokens_per_rank`` tokens (fixed
shapes between stages), the stages of a pipeline read the same rows, and ``pipeline_micro_batches``
rows per data-parallel rank (the Trainer's ``gradient_accumulation_steps``) run through the schedule
(``pipeline_schedule``) in one ``training.pipeline.PipelineRunner.train_step``: the loss is token-weighted
over the step, gradients are summed over the stage's copies and clipped over all stages. Checkpoints
hold one weights and one optimizer file per stage; ``save_model()`` writes one ``save_pretrained``
folder of the whole model. DeepSpeed, FSDP, tensor parallelism, autocast, activation checkpointing
and streaming datasets are refused with pipeline stages, each by name.
"""

from __future__ import annotations

import inspect
import os
import time

import torch
from transformers import PrinterCallback, ProgressCallback, Trainer

from ..hf import widest_window
from ..planning import causal_pairs, find_documents, imbalance
from ..runtime import plan_stats
from .accelerator import (apply_cpu_fsdp, hf_model_of, parallelism_config_for_cpu, prepare_training_arguments,
                          require_distca_model)
from .launch_checks import check_world_size, has_gpu
from .global_batches import GlobalBatchTrainerMixin
from .packing import PackedCollator, PackedDataset, PackingConfig, StreamingPackedDataset
from .plugin import DistCAPlugin, model_parallel_sizes

__all__ = ["DistCATrainer", "StepTableCallback"]


class DistCATrainer(GlobalBatchTrainerMixin, Trainer):
    """A ``transformers.Trainer`` that trains packed documents with Core Attention Disaggregation.

    Args:
        model: a causal LM with ``attn_implementation="distca"``.
        args: ``TrainingArguments``; ``per_device_train_batch_size`` must be 1, and
            ``per_device_eval_batch_size`` too when evaluating (one packed row per rank; the token
            budget is ``packing.tokens_per_rank``).
        train_dataset, eval_dataset: documents with an ``input_ids`` column (``datasets``
            dataset, streaming or not, or a sequence of token lists), packed with ``packing``; or
            already packed ``PackedDataset`` / ``StreamingPackedDataset`` (then no ``packing``;
            they are packed again for this job's ranks and ``span_ranks``). ``eval_dataset`` may be
            a dict of them.
        distca_plugin: distca settings and process topology (default ``DistCAPlugin.from_environment()``).
        packing: ``PackingConfig`` for raw documents.
        **kwargs: the rest of ``transformers.Trainer``'s arguments.

    Attributes:
        distca: ``DistCAGroups`` built by the plugin (topology, server group, settings in force).
        span_ranks: whether documents span the ranks of the attention-server group (see the module
            docstring for how it is chosen).
        packing_reports: ``{"train": PackingReport, "eval": ...}`` (a property).
    """

    packed_dataset_types = (PackedDataset,)  # a stream's rows are read in order by every rank (no sampler)

    def __init__(self, model=None, args=None, data_collator=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, *, distca_plugin: DistCAPlugin | None = None,
                 packing: PackingConfig | None = None, **kwargs):
        if distca_plugin is not None and not isinstance(distca_plugin, DistCAPlugin):
            raise TypeError(f"distca_plugin must be a distca_hf.DistCAPlugin, got {type(distca_plugin).__name__}")
        if packing is not None and not isinstance(packing, PackingConfig):
            raise TypeError(f"packing must be a distca_hf.PackingConfig, got {type(packing).__name__}")
        self.distca_plugin = distca_plugin if distca_plugin is not None else DistCAPlugin.from_environment()
        self._pipeline = None  # the PipelineRunner with pipeline_parallel_size > 1 (made once the groups exist)
        pipelined = self.distca_plugin.pipeline_parallel_size > 1
        if model is not None:
            _prepare_model(model)
        if args is not None:
            _check_arguments(args, evaluating=eval_dataset is not None)
            prepare_training_arguments(args)
            world = args.world_size
        else:
            world = 1
        named = _named_datasets(train_dataset, eval_dataset)
        for name, dataset in named.items():
            _check_packable(dataset, packing, name)
        if pipelined:  # the Trainer's model is this rank's stage, its optimizer holds the stage's parameters
            model = self._pipeline_stage_of(model, args, named, kwargs)
        if any(_is_streaming(d) for d in named.values()) and args is not None:
            # Every rank reads the stream itself and keeps its share; dispatching batches from rank 0
            # would concatenate rows of different lengths.
            args.accelerator_config.dispatch_batches = False
        # The datasets are packed once the server groups exist (below): how many ranks share a
        # global batch decides the packing.
        super().__init__(model=model, args=args, data_collator=data_collator or PackedCollator(),
                         train_dataset=train_dataset, eval_dataset=eval_dataset, processing_class=processing_class,
                         **kwargs)
        _check_arguments(self.args, evaluating=eval_dataset is not None)
        check_world_size(self.accelerator.num_processes)
        if self.args.world_size != world:
            raise RuntimeError(f"the world size changed from {world} to {self.args.world_size} while the Trainer was "
                               "set up; create TrainingArguments before the DistCATrainer and do not reset the "
                               "Accelerate state in between")
        if not pipelined and not (self.model_accepts_loss_kwargs or self.compute_loss_func is not None):
            raise ValueError(
                f"{type(self.model).__name__}.forward does not accept loss kwargs (num_items_in_batch), so the loss "
                "could not be normalised by the global label-token count; pass compute_loss_func="
            )
        # The Trainer's Accelerator holds a ParallelismConfig when TrainingArguments(parallelism_config=...) gives one
        # or the model is tensor-parallel (transformers makes one from the model): its sizes are the topology's.
        self.distca_plugin = self.distca_plugin.with_parallelism(
            getattr(self.accelerator, "parallelism_config", None),
            source="the Trainer's Accelerator (TrainingArguments.parallelism_config or the model's tensor parallelism)")
        self.distca = self.distca_plugin.attach(model=hf_model_of(self.model) if self.model is not None else None)
        server_groups = self.distca.topology.server_groups(self.distca_plugin.server_group)
        self.span_ranks = self._choose_span_ranks(group_size=len(server_groups[0]))
        if self.span_ranks:
            self._check_span_setup()
        self._packed_datasets = {}
        # With tensor parallelism Accelerate gives the ranks of a tensor-parallel group the same batches (its
        # dataloader shards over the data-parallel index): the rows are laid out for the data-parallel ranks.
        # The stages of a pipeline read the same rows too (_PipelineRows).
        self._ranks_per_batch = (self.distca.topology.pipeline_parallel if pipelined
                                 else _ranks_sharing_batches(self.accelerator, self.distca.topology))
        data_world, server_groups = _data_layout(self.distca.topology, server_groups, self._ranks_per_batch)
        layout = {"world_size": data_world, "span_ranks": self.span_ranks,
                  "server_groups": server_groups if self.span_ranks else None}
        if pipelined:
            layout["full_rows"] = True  # the stages exchange fixed shapes: every row has tokens_per_rank tokens
            layout["step_micro_batches"] = self._pipeline_micro_batches  # a step's rows balanced together (if asked)
        self.train_dataset = self._packed(train_dataset, packing, layout, "train")
        if isinstance(eval_dataset, dict):
            self.eval_dataset = {name: self._packed(d, packing, layout, f"eval_{name}")
                                 for name, d in eval_dataset.items()}
        else:
            self.eval_dataset = self._packed(eval_dataset, packing, layout, "eval")
        if pipelined:
            self._start_pipeline()
        self._reset_window()
        self._table_replaces_progress()

    def _table_replaces_progress(self) -> None:
        """A ``StepTableCallback`` draws the bar and writes the logs itself: drop the Trainer's own
        ``ProgressCallback`` / ``PrinterCallback`` (exactly those classes) so nothing is written twice."""
        callbacks = self.callback_handler.callbacks
        if any(isinstance(c, StepTableCallback) for c in callbacks):
            for callback in [c for c in callbacks if type(c) in (ProgressCallback, PrinterCallback)]:
                self.remove_callback(callback)

    # -- pipeline stages (pipeline_parallel_size > 1) -----------------------------------------------

    def _pipeline_stage_of(self, model, args, named: dict, kwargs: dict):
        """This rank's stage of ``model`` (before the Trainer is set up), after refusing what pipeline
        stages cannot do; sets the micro-batches per step as the arguments' gradient accumulation."""
        plugin = self.distca_plugin
        size = plugin.pipeline_parallel_size
        where = f"DistCATrainer with pipeline_parallel_size={size}"
        if model is None or args is None:
            raise ValueError(f"{where} needs model= (the whole HF model, split here into stages) and args=; "
                             "model_init is not supported")
        refused = {
            "DeepSpeed (TrainingArguments.deepspeed)": bool(args.deepspeed),
            "FSDP (TrainingArguments.fsdp)": bool(args.fsdp),
            "mixed precision (--bf16 / --fp16 autocast; load the model in that dtype instead)": args.bf16 or args.fp16,
            "load_best_model_at_end": args.load_best_model_at_end,
            "label_smoothing_factor": bool(args.label_smoothing_factor),
            "compute_loss_func (the stages' loss is distca's token-weighted cross-entropy)":
                kwargs.get("compute_loss_func") is not None,
            "activation checkpointing (TrainingArguments.activation_checkpointing)":
                bool(getattr(args, "activation_checkpointing", None) or getattr(args, "gradient_checkpointing", None)),
        }
        for what, on in refused.items():
            if on:
                raise ValueError(f"{where}: {what} is not supported with pipeline stages; set "
                                 "pipeline_parallel_size=1 (DistCAPlugin, the distca: section or --pipeline_parallel_size) "
                                 "to use it")
        for name, dataset in named.items():
            if _is_streaming(dataset):
                raise ValueError(f"{where}: {_argument_name(name)} is a streaming dataset; pipeline stages read "
                                 "map-style datasets (every stage of a pipeline reads the same rows); load it whole")
        topology = plugin.topology(args.world_size, model=hf_model_of(model))
        if topology.tensor_parallel != 1:
            raise ValueError(f"{where}: tensor_parallel_size={topology.tensor_parallel} with pipeline stages is not "
                             "supported; set tensor_parallel_size=1 or pipeline_parallel_size=1")
        config = plugin.resolved()
        micro_batches = config.pipeline_micro_batches
        accumulation = args.gradient_accumulation_steps
        if micro_batches is None:
            micro_batches = max(accumulation, size)
        elif accumulation not in (1, micro_batches):
            raise ValueError(f"{where}: pipeline_micro_batches={micro_batches} and gradient_accumulation_steps="
                             f"{accumulation} disagree: a pipeline runs one step's micro-batches together, so they "
                             "are one number; set one of them")
        if config.pipeline_schedule == "1f1b" and micro_batches < size:
            raise ValueError(f"{where}: pipeline_schedule='1f1b' needs at least {size} micro-batches per step, "
                             f"pipeline_micro_batches is {micro_batches}; raise it or use 'gpipe' / 'cad_1f1b'")
        args.gradient_accumulation_steps = micro_batches
        self._pipeline_micro_batches = micro_batches
        from .pipeline_stages import build_stage_module

        stage = build_stage_module(hf_model_of(model), stage_index=topology.coordinates(args.process_index)[1],
                                   num_stages=size)
        return stage

    def _start_pipeline(self) -> None:
        """The ``PipelineRunner`` of this rank's stage (a collective: its groups), and the datasets as
        every stage of a pipeline reads them."""
        from .pipeline import PipelineRunner

        packed = [d for d in self._packed_datasets.values()]
        tokens = {d.config.tokens_per_rank for d in packed}
        if len(tokens) > 1:
            raise ValueError(f"DistCATrainer with pipeline stages: the datasets are packed with different "
                             f"tokens_per_rank {sorted(tokens)}; the stages exchange fixed shapes, so use one")
        config = self.distca.config
        self._pipeline = PipelineRunner(self.model, topology=self.distca.topology, rank=self.args.process_index,
                                        schedule=config.pipeline_schedule, tokens_per_micro_batch=tokens.pop(),
                                        device=self.args.device, timeout_s=config.timeout_s)
        self._pipeline_pending = []
        self._pipeline_handle = _PipelineStageHandle(self.model)
        self.train_dataset = _PipelineRows.of(self.train_dataset, self.distca.topology, self._pipeline_micro_batches)
        if isinstance(self.eval_dataset, dict):
            self.eval_dataset = {n: _PipelineRows.of(d, self.distca.topology, 1) for n, d in self.eval_dataset.items()}
        else:
            self.eval_dataset = _PipelineRows.of(self.eval_dataset, self.distca.topology, 1)

    def _lays_out_global_batches(self, dataset) -> bool:
        # a pipeline's stages read the same rows in the same step: global-batch blocks, even without span_ranks
        return isinstance(dataset, _PipelineRows) or super()._lays_out_global_batches(dataset)

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        if self._pipeline is None:
            return super()._wrap_model(model, training, dataloader)
        # no DDP: the runner sums the gradients over the stage's data-parallel copies itself
        return self._pipeline_handle

    def _clip_grad_norm(self, model):
        if self._pipeline is None:
            return super()._clip_grad_norm(model)
        return self._pipeline.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if self._pipeline is None:
            return super()._get_grad_norm(model, grad_norm)
        norm = grad_norm if grad_norm is not None else self._pipeline.grad_norm()
        return float(norm)

    # checkpoints: each stage saves and loads its own weights and optimizer state (its data-parallel index 0
    # writes); the final save_model() is one ordinary save_pretrained folder of the whole model

    def _stage_file(self, kind: str) -> str:
        runner = self._pipeline
        return f"{kind}-pipeline-stage-{runner.stage_index}-of-{runner.num_stages}.pt"

    def _writes_stage_files(self) -> bool:
        return self.distca.topology.coordinates(self.args.process_index)[0] == 0

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if self._pipeline is None:
            return super().save_model(output_dir, _internal_call)
        from .pipeline_stages import save_pipeline_model, stage_state_dict

        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if _internal_call:  # a checkpoint: this stage's weights, for resuming
            if self._writes_stage_files():
                os.makedirs(output_dir, exist_ok=True)
                torch.save(stage_state_dict(self.model), os.path.join(output_dir, self._stage_file("model")))
            return
        # every stage of every pipeline takes part (a gather over the pipeline); the first pipeline writes
        save_pipeline_model(self.model, output_dir, pipeline_group=self._pipeline.pipeline_group,
                            is_main_process=self._writes_stage_files())
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
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        if self._pipeline is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        path = self._checkpoint_file(resume_from_checkpoint, "model")
        self.model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True), strict=True)

    def _load_optimizer_and_scheduler(self, checkpoint):
        if self._pipeline is None or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        path = self._checkpoint_file(checkpoint, "optimizer")
        device = self.args.device if self.args.device.type != "cpu" else "cpu"
        self.optimizer.load_state_dict(torch.load(path, map_location=device, weights_only=True))
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, "scheduler.pt"), weights_only=True))

    def _checkpoint_file(self, checkpoint: str, kind: str) -> str:
        path = os.path.join(checkpoint, self._stage_file(kind))
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"resume_from_checkpoint={checkpoint!r} has no {self._stage_file(kind)}: it was not saved by "
                f"DistCATrainer with pipeline_parallel_size={self._pipeline.num_stages} (a checkpoint holds one file "
                "per stage); resume with the pipeline size it was saved with")
        return path

    # -- set-up helpers ---------------------------------------------------------------------------

    def create_accelerator_and_postprocess(self) -> None:
        sizes = model_parallel_sizes(hf_model_of(self.model)) if self.model is not None else None
        tensor_parallel_model = sizes is not None and (sizes.tensor_parallel or 1) > 1
        if (tensor_parallel_model or self.args.parallelism_config is not None) and not has_gpu() \
                and self.args.world_size > 1:
            # Accelerate refuses a ParallelismConfig on CPU processes (the arguments' own, or the one transformers
            # makes from a tensor-parallel model): give it one it accepts there, with the model's sizes
            model_sizes = ({"tp_size": sizes.tensor_parallel, "dp_shard_size": sizes.data_parallel or 1}
                           if tensor_parallel_model else {})
            self.args.parallelism_config = parallelism_config_for_cpu(self.args.parallelism_config, **model_sizes)
        super().create_accelerator_and_postprocess()
        apply_cpu_fsdp(self)  # on CPU processes Accelerate drops an FSDP request: shard as asked

    def _check_span_setup(self) -> None:
        """With documents spanning ranks the loss must take ``shift_labels`` (the boundary labels)."""
        if not isinstance(self.data_collator, PackedCollator):
            raise ValueError(
                "with span_ranks=True the rows must come from distca_hf.PackedCollator (it emits the continuing "
                "positions and the labels across rank boundaries), got "
                f"data_collator={type(self.data_collator).__name__}; "
                "drop data_collator= or set DistCAPlugin(span_ranks=False)")
        if self.compute_loss_func is not None or self.args.label_smoothing_factor:
            raise ValueError(
                "with span_ranks=True the loss must read shift_labels (the last token of a rank's piece predicts the "
                "first token of the next rank's); compute_loss_func and label_smoothing_factor receive labels only. "
                "Remove them or set DistCAPlugin(span_ranks=False)")
        if self.model is None or getattr(self, "_pipeline", None) is not None \
                or self.distca_plugin.pipeline_parallel_size > 1:
            return  # no model yet (model_init): checked again by train(); pipeline stages: distca's own loss
        model = hf_model_of(self.model)
        loss_function = getattr(model, "loss_function", None)
        if loss_function is None or "shift_labels" not in inspect.signature(loss_function).parameters:
            raise ValueError(
                f"with span_ranks=True the model's loss must take shift_labels (transformers' ForCausalLMLoss does); "
                f"{type(model).__name__}.loss_function does not. Set DistCAPlugin(span_ranks=False)")

    def _packed(self, dataset, packing: PackingConfig | None, layout: dict, name: str):
        if dataset is None:
            return None
        if isinstance(dataset, (PackedDataset, StreamingPackedDataset)):
            packed = dataset.with_layout(**layout)
        elif _is_streaming(dataset):
            packed = StreamingPackedDataset(dataset, packing, **layout)
        else:
            packed = PackedDataset(dataset, packing, **layout)
        if isinstance(packed, PackedDataset):
            _check_has_documents(packed, name)
        self._packed_datasets[name] = packed
        return packed

    @property
    def packing_reports(self) -> dict:
        """``{"train": PackingReport, "eval": ...}``: what packing did (a streaming dataset's report
        fills as the stream is read)."""
        return {name: dataset.report for name, dataset in self._packed_datasets.items()}

    def train(self, *args, **kwargs):
        if self.model is not None and self._pipeline is None:  # a stage: its whole model was checked when split
            _prepare_model(self.model)  # a model_init model is only known now
            if self.span_ranks:
                self._check_span_setup()
        return super().train(*args, **kwargs)  # GlobalBatchTrainerMixin: the trainer's settings in force

    # -- training ---------------------------------------------------------------------------------

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self._window_start is None:
            self._window_start = time.perf_counter()
            self._window["first_step"] = self.state.global_step
        if self._pipeline is not None:
            return self._pipeline_training_step(inputs)
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._record_plan(inputs)
        return loss

    def _pipeline_training_step(self, inputs):
        """Collect the step's micro-batches; with the last, run them through the stages (forward and
        backward). The step's loss is returned then (0 before), so the Trainer's sum is the step's loss."""
        self._pipeline_pending.append(self._prepare_inputs(inputs))
        if len(self._pipeline_pending) < self.current_gradient_accumulation_steps:
            return torch.zeros((), device=self.args.device)
        micro_batches, self._pipeline_pending = self._pipeline_pending, []
        loss = self._pipeline.train_step(micro_batches)
        for micro_batch in micro_batches:
            self._record_plan(micro_batch)
        return loss.to(self.args.device, torch.float32)

    def _record_plan(self, inputs) -> None:
        """Attention balance of the micro-batch just run, and the tokens of all ranks."""
        lengths, first_positions = _local_documents(inputs)
        # counted as the plan counts them: under the model's window when every layer slides
        window = widest_window(getattr(self.model, "config", None))
        colocated_pairs = causal_pairs(first_positions, first_positions + lengths, window).sum()
        mine = torch.tensor([int(lengths.sum()), int(colocated_pairs)], dtype=torch.int64, device=self.args.device)
        everyone = self.accelerator.gather(mine).view(-1, 2).cpu()
        try:
            stats = plan_stats()
        except RuntimeError:  # no distca forward ran (another attention function registered under its name)
            stats = {}
        if stats.get("dispatched"):
            before, after = stats["attn_pairs_local"], stats["attn_pairs_served"]
        else:  # colocated (or one rank): every rank computes its own documents
            before = after = everyone[:, 1].tolist()
        self._window["before"].append(imbalance(before))
        self._window["after"].append(imbalance(after))
        self._window["tokens"] += int(everyone[:, 0].sum()) // self._ranks_per_batch  # tensor-parallel peers: once

    def _reset_window(self) -> None:
        self._window = {"before": [], "after": [], "tokens": 0, "first_step": 0}
        self._window_start = None

    def log(self, logs: dict, start_time: float | None = None) -> None:
        if "loss" in logs and self._window["before"]:
            elapsed = time.perf_counter() - self._window_start
            logs["attn_imbalance_before"] = sum(self._window["before"]) / len(self._window["before"])
            logs["attn_imbalance_after"] = sum(self._window["after"]) / len(self._window["after"])
            logs["tokens_per_s"] = self._window["tokens"] / elapsed if elapsed > 0 else 0.0
            logs["step_time_s"] = elapsed / max(1, self.state.global_step - self._window["first_step"])
            self._reset_window()
        super().log(logs, start_time)

    # -- evaluation: the exact token-weighted loss -------------------------------------------------

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        if self._pipeline is not None:  # the stages' forward: the loss only (the logits stay on the last stage)
            loss_sum, count = self._pipeline.eval_step(self._prepare_inputs(inputs))
            self._add_eval_loss(loss_sum, count)
            return (loss_sum / count.clamp(min=1)).float(), None, None
        if "labels" not in inputs:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        inputs = self._prepare_inputs(inputs)
        labels = inputs["labels"]
        count = _label_tokens(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            # num_items_in_batch=1 makes HF's causal-LM loss the sum over label tokens
            outputs = model(**inputs, num_items_in_batch=1)
        loss_sum = outputs.loss.detach().float()
        self._add_eval_loss(loss_sum, count)
        loss = loss_sum / count.clamp(min=1)
        if prediction_loss_only:
            return loss, None, None
        return loss, outputs.logits.detach(), labels

    def evaluation_loop(self, *args, **kwargs):
        _check_eval_batch_size(self.args)  # evaluate() and predict() both come here, before any forward
        return super().evaluation_loop(*args, **kwargs)  # GlobalBatchTrainerMixin: the exact loss of the set


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
    """A ``PackedDataset`` laid out for the data-parallel ranks, as the stages of each pipeline read it:
    item ``i`` belongs to rank ``i % world_size`` (Accelerate's sharding) and is the row its data-parallel
    index holds in block ``i // world_size``, so every stage of a pipeline reads the same row in the same
    step. The blocks are padded with filler rows (``tokens_per_rank`` padding tokens, no labels) to a
    multiple of ``micro_batches``: every optimizer step runs the same number of micro-batches."""

    def __init__(self, packed: PackedDataset, topology, micro_batches: int):
        self.packed = packed
        self.data_parallel = topology.data_parallel
        self._world_size = topology.world_size
        self._data_index = [topology.coordinates(rank)[0] for rank in range(topology.world_size)]
        blocks = len(packed) // self.data_parallel
        self.blocks = -(-blocks // micro_batches) * micro_batches
        # the blocks of one step stay together when shuffled: packed (and balanced) as one step
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
        return self.packed.report

    def __len__(self) -> int:
        return self.blocks * self._world_size

    def __getitem__(self, index: int) -> dict:
        block, rank = divmod(index, self._world_size)
        row = block * self.data_parallel + self._data_index[rank]
        if row < len(self.packed):
            return self.packed[row]
        tokens = self.packed.config.tokens_per_rank
        return {"input_ids": [[self.packed.config.pad_token_id] * tokens], "first_position": 0, "last_label": -100,
                "padding": tokens}


def _ranks_sharing_batches(accelerator, topology) -> int:
    """How many ranks read the same batches: the tensor-parallel size when the Accelerator's device mesh has a
    ``tp`` dimension (its dataloader then shards over the data-parallel index only), else 1."""
    mesh = getattr(accelerator, "torch_device_mesh", None)
    if mesh is None or "tp" not in (getattr(mesh, "mesh_dim_names", None) or ()):
        return 1
    shared = mesh["tp"].size()
    if shared != topology.tensor_parallel:
        raise ValueError(f"the Accelerator's device mesh has tp={shared}, but distca's topology has tensor_parallel="
                         f"{topology.tensor_parallel}; give the tensor-parallel size once (ParallelismConfig.tp_size)")
    if topology.pipeline_parallel != 1:
        raise ValueError("tensor parallelism through Accelerate's device mesh with pipeline_parallel_size > 1 is not "
                         "supported by DistCATrainer")
    return shared


def _data_layout(topology, server_groups: list[list[int]], ranks_per_batch: int):
    """``(ranks, server groups)`` the packed rows are laid out for: the ranks themselves, or with batches shared by
    tensor-parallel peers the data-parallel indices (Accelerate's ``rank // tp``) and the groups in them."""
    if ranks_per_batch == 1:
        return topology.world_size, server_groups
    groups = sorted({tuple(topology.coordinates(rank)[0] for rank in group) for group in server_groups})
    return topology.data_parallel, [list(group) for group in groups]


def _label_tokens(inputs) -> torch.Tensor:
    """Tokens the causal-LM loss trains in ``inputs`` (a 0-d tensor): ``shift_labels`` when given
    (they include the label across a rank boundary), else ``labels`` shifted by one."""
    targets = inputs["shift_labels"] if "shift_labels" in inputs else inputs["labels"][..., 1:]
    return targets.ne(-100).sum()


def _local_documents(inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lengths, first positions)`` of the row's local documents (int64 ``[documents]``, CPU); a
    piece continuing a document from the previous rank starts at its position ``p > 0``."""
    ids = inputs["input_ids"]
    if "cu_seq_lens_q" in inputs:
        offsets = inputs["cu_seq_lens_q"].to(torch.int64).cpu()
        lengths, token_starts = torch.diff(offsets), offsets[:-1]
    else:  # a collator of the user's that gives position_ids (or a mask) only
        docs = find_documents(ids.shape[0], ids.shape[1], ids.shape[1], attention_mask=inputs.get("attention_mask"),
                              position_ids=inputs.get("position_ids"))
        lengths, token_starts = torch.from_numpy(docs.lengths), torch.from_numpy(docs.q_starts)
    positions = inputs.get("position_ids")
    if positions is None:
        return lengths, torch.zeros_like(lengths)
    return lengths, positions.reshape(-1).cpu().to(torch.int64)[token_starts]


def _named_datasets(train_dataset, eval_dataset) -> dict:
    named = {"train": train_dataset}
    if isinstance(eval_dataset, dict):
        named.update({f"eval_{name}": d for name, d in eval_dataset.items()})
    else:
        named["eval"] = eval_dataset
    return {name: d for name, d in named.items() if d is not None}


def _argument_name(name: str) -> str:
    """The trainer argument a dataset came in: ``train_dataset``, ``eval_dataset`` or ``eval_dataset['x']``."""
    if name.startswith("eval_"):
        return f"eval_dataset[{name.removeprefix('eval_')!r}]"
    return f"{name}_dataset"


def _check_has_documents(packed: PackedDataset, name: str) -> None:
    """A dataset that packs into no row would end in torch's ``num_samples=0`` (train) or evaluate
    nothing: say which argument and why. A training set must also hold a label token (a document of
    two tokens or more), or the loss would be 0 / 0."""
    report = packed.report
    if len(packed) == 0:
        why = ("it holds no documents" if report.documents == 0 else
               f"all {report.documents} of its documents are empty (input_ids of no token)")
        raise ValueError(f"DistCATrainer: {_argument_name(name)} has no documents to "
                         f"{'train on' if name == 'train' else 'evaluate'}: {why}; give it tokenized documents "
                         "(an 'input_ids' column of token-id lists)")
    if name == "train" and packed.label_tokens() == 0:
        raise ValueError(f"DistCATrainer: train_dataset has nothing to learn: none of its {report.documents} documents "
                         "has two tokens or more, so no token has a next token to predict")


def _check_packable(dataset, packing: PackingConfig | None, name: str) -> None:
    raw = not (_is_streaming(dataset) or isinstance(dataset, PackedDataset))
    if raw and hasattr(dataset, "__len__") and len(dataset) == 0:
        # before packing: a datasets.Dataset of no rows may not even have an input_ids column
        raise ValueError(f"DistCATrainer: {_argument_name(name)} has no documents to "
                         f"{'train on' if name == 'train' else 'evaluate'}: it holds no documents (0 rows); give it "
                         "tokenized documents (an 'input_ids' column of token-id lists)")
    if isinstance(dataset, (PackedDataset, StreamingPackedDataset)):
        if packing is not None and dataset.config != packing:
            raise ValueError(f"the {name} dataset is already packed with {dataset.config}; do not pass a different "
                             "packing= as well")
    elif packing is None:
        raise ValueError(f"the {name} dataset holds raw documents: pass packing=PackingConfig(tokens_per_rank=...) "
                         "or an already packed distca_hf.PackedDataset")


def _is_streaming(dataset) -> bool:
    if isinstance(dataset, (torch.utils.data.IterableDataset, StreamingPackedDataset)):
        return True
    try:
        import datasets

        return isinstance(dataset, datasets.IterableDataset)
    except ImportError:
        return False


def _prepare_model(model) -> None:
    require_distca_model(model)
    if getattr(model, "config", None) is not None and hasattr(model.config, "use_cache"):
        model.config.use_cache = False  # training: no KV cache


def _check_arguments(args, *, evaluating: bool) -> None:
    """The TrainingArguments DistCATrainer needs; ``per_device_eval_batch_size`` only when
    ``evaluating`` (an eval dataset is given; ``evaluate()`` checks it again)."""
    if args.per_device_train_batch_size != 1:
        raise ValueError(
            f"DistCATrainer needs per_device_train_batch_size=1 (got {args.per_device_train_batch_size}): each rank "
            "runs one packed row per forward, and the number of tokens in it is PackingConfig.tokens_per_rank"
        )
    if evaluating:
        _check_eval_batch_size(args)
    if not args.average_tokens_across_devices:
        raise ValueError("DistCATrainer normalises the loss by the label tokens of all ranks; "
                         "average_tokens_across_devices=False would weight each rank's tokens differently")


def _check_eval_batch_size(args) -> None:
    if args.per_device_eval_batch_size != 1:
        raise ValueError(
            f"DistCATrainer evaluates with per_device_eval_batch_size=1 only (got {args.per_device_eval_batch_size}; "
            "TrainingArguments' default is 8): each rank runs one packed row per forward, and the number of tokens in "
            "it is PackingConfig.tokens_per_rank. Set TrainingArguments(per_device_eval_batch_size=1)"
        )


class StepTableCallback(ProgressCallback):
    """The progress bar of ``ProgressCallback``, with one table row per logged training step in place
    of the raw log dict: step, loss, attention imbalance before -> after the plan, tokens/s (all
    ranks), seconds per step. Other logs (evaluation, the training summary) are written as the
    Trainer writes them. With ``disable_tqdm`` there is no bar and the rows are printed.

    Given in ``DistCATrainer(callbacks=[...])``, it takes the place of the Trainer's own
    ``ProgressCallback`` / ``PrinterCallback``. The metrics themselves are logged by
    ``DistCATrainer.log``, so every ``report_to`` integration (TensorBoard, W&B, ...) receives them
    with or without this table.

    Args:
        title: printed above the table (before its first row).
        out: a file to print the table to instead of through the progress bar (tests).

    Attributes:
        rows: every logged training step, on every rank: ``step``, ``loss``, ``before``, ``after``,
            ``tokens_per_s``, ``step_time_s``.
    """

    def __init__(self, title: str | None = None, out=None):
        super().__init__()
        self.title = title
        self.out = out
        self.rows: list[dict] = []
        self._header_printed = False

    # -- the bar, unless the arguments turn it off ------------------------------------------------

    def on_train_begin(self, args, state, control, **kwargs):
        self.current_step = 0
        if not args.disable_tqdm:
            super().on_train_begin(args, state, control, **kwargs)

    def on_step_end(self, args, state, control, **kwargs):
        if self.training_bar is not None:
            super().on_step_end(args, state, control, **kwargs)

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        if not args.disable_tqdm:
            super().on_prediction_step(args, state, control, eval_dataloader=eval_dataloader, **kwargs)

    def on_train_end(self, args, state, control, **kwargs):
        if self.training_bar is not None:
            super().on_train_end(args, state, control, **kwargs)

    # -- the table --------------------------------------------------------------------------------

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "loss" not in logs or "attn_imbalance_before" not in logs:
            if self.training_bar is not None:
                super().on_log(args, state, control, logs=logs, **kwargs)
            elif logs and state.is_world_process_zero:
                self._write({k: v for k, v in logs.items() if k != "total_flos"})
            return
        row = {"step": state.global_step, "loss": logs["loss"], "before": logs["attn_imbalance_before"],
               "after": logs["attn_imbalance_after"], "tokens_per_s": logs["tokens_per_s"],
               "step_time_s": logs["step_time_s"]}
        self.rows.append(row)
        if not state.is_world_process_zero:
            return
        if not self._header_printed:
            if self.title:
                self._write(self.title)
            self._write(f"{'step':>5} {'loss':>9} {'attn imbalance':>18} {'tokens/s':>9} {'step s':>7}")
            self._header_printed = True
        self._write(f"{row['step']:>5} {row['loss']:>9.4f} {row['before']:>8.2f} -> {row['after']:<6.3f} "
                    f"{row['tokens_per_s']:>9.0f} {row['step_time_s']:>7.2f}")

    def _write(self, line) -> None:
        if self.out is None and self.training_bar is not None:
            self.training_bar.write(str(line))  # above the bar, which redraws below it
        else:
            print(line, file=self.out, flush=True)
