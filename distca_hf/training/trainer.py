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
  last log), ``tokens_per_s`` (all ranks), ``step_time_s`` (wall seconds per optimizer step) and
  ``plan_time_s`` (of it, this rank's planning: ``plan_stats()["plan_seconds"]`` of each micro-batch),
  added in ``Trainer.log``, so the progress bar, ``report_to`` (TensorBoard, W&B, ...) and
  ``state.log_history`` all get them; ``StepTableCallback`` shows the balance and step time as a table
  above the bar;
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
stage, which becomes the Trainer's ``model``; rows of exactly ``tokens_per_rank`` tokens, read alike by
a pipeline's stages, run ``pipeline_micro_batches`` per optimizer step through the schedule. All of it
lives in ``training.pipeline_trainer`` (``PipelineTrainerMixin``, first among ``DistCATrainer``'s
bases); this file only calls it where the set-up needs the stage, the packing layout or the runner.
"""

from __future__ import annotations

import inspect
import time
import warnings

import torch
from transformers import PrinterCallback, ProgressCallback, Trainer, TrainingArguments

from ..hf import widest_window
from ..planning import causal_pairs, find_documents, imbalance
from ..runtime import plan_stats
from .accelerator import (apply_cpu_fsdp, check_tensor_parallel_applies, hf_model_of, parallelism_config_for_cpu,
                          prepare_training_arguments, require_distca_model)
from .launch_checks import check_world_size, has_gpu
from .global_batches import (GlobalBatchTrainerMixin, check_has_documents, check_pad_token_id, check_positions_fit,
                             model_vocab_size)
from .packing import (PackedCollator, PackedDataset, PackingConfig, StreamingPackedDataset, is_streaming, refuse_masks,
                      STREAM_HEAD_DOCUMENTS, stream_head_crc)
from .pipeline import pipeline_targets
from .pipeline_trainer import PipelineTrainerMixin
from .plugin import DistCAPlugin, model_parallel_sizes

__all__ = ["DistCATrainer", "StepTableCallback"]


class DistCATrainer(PipelineTrainerMixin, GlobalBatchTrainerMixin, Trainer):
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
        _check_collator(data_collator)
        if args is not None and not isinstance(args, TrainingArguments):  # (an AttributeError deep in the checks)
            raise TypeError(f"args must be transformers.TrainingArguments, got {type(args).__name__}")
        if model is not None and not isinstance(model, torch.nn.Module):  # a name: the Trainer does not load one
            raise TypeError(f"model must be a model, got {type(model).__name__} {model!r:.60}; load it first: "
                            "AutoModelForCausalLM.from_pretrained(name, attn_implementation='distca')")
        self.distca_plugin = distca_plugin if distca_plugin is not None else DistCAPlugin.from_environment()
        pipelined = self.distca_plugin.pipeline_parallel_size > 1  # PipelineTrainerMixin's set-up hooks below
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
            streaming = [_argument_name(name) for name, dataset in named.items() if is_streaming(dataset)]
            model, args = self._prepare_pipeline_stage(model, args, trainer_kwargs=kwargs, streaming=streaming)
        # The datasets are packed once the server groups exist (below): how many ranks share a
        # global batch decides the packing.
        vocab = model_vocab_size(model)
        self._own_collator = data_collator is None  # (its vocab_size is filled when a model_init model is made)
        super().__init__(model=model, args=args, data_collator=data_collator or PackedCollator(vocab),
                         train_dataset=train_dataset, eval_dataset=eval_dataset, processing_class=processing_class,
                         **kwargs)
        _check_arguments(self.args, evaluating=eval_dataset is not None)
        # Every rank reads its own rows (a stream: reads it whole and keeps its share); batches dispatched
        # from rank 0 would concatenate rows of different lengths. Accelerate dispatches by default for a
        # stream, and one given to evaluate() later meets the Accelerator built here: off for every dataset.
        self.accelerator.dataloader_config.dispatch_batches = False
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
        if self.model is not None and not pipelined:
            check_tensor_parallel_applies(self.distca.topology, hf_model_of(self.model),
                                          getattr(self.accelerator, "torch_device_mesh", None))
        server_groups = self.distca.topology.server_groups(self.distca_plugin.server_group)
        self.span_ranks = self._choose_span_ranks(group_size=len(server_groups[0]))
        if self.span_ranks:
            self._check_span_setup()
        self._packed_datasets = {}
        # With tensor parallelism Accelerate gives the ranks of a tensor-parallel group the same batches (its
        # dataloader shards over the data-parallel index): the rows are laid out for the data-parallel ranks.
        # The stages of a pipeline read the same rows too (PipelineTrainerMixin).
        self._ranks_per_batch = (self.distca.topology.pipeline_parallel if pipelined
                                 else _ranks_sharing_batches(self.accelerator, self.distca.topology))
        data_world, server_groups = _data_layout(self.distca.topology, server_groups, self._ranks_per_batch)
        layout = {"world_size": data_world, "span_ranks": self.span_ranks,
                  "server_groups": server_groups if self.span_ranks else None}
        if pipelined:
            layout.update(self._pipeline_packing_layout())
        self._packing, self._layout = packing, layout  # (for datasets given to evaluate() / predict() later)
        if packing is not None:
            check_pad_token_id(packing.pad_token_id, vocab, source="PackingConfig.pad_token_id")
        self.train_dataset = self._packed(train_dataset, packing, layout, "train")
        if isinstance(eval_dataset, dict):
            self.eval_dataset = {name: self._packed(d, packing, layout, f"eval_{name}")
                                 for name, d in eval_dataset.items()}
        else:
            self.eval_dataset = self._packed(eval_dataset, packing, layout, "eval")
        self._check_vocabulary(vocab)
        if pipelined:
            self._start_pipeline()
        self._reset_window()
        self._table_replaces_progress()

    def _check_vocabulary(self, vocab: int | None) -> None:
        """Token ids at or past the model's ``vocab`` fail deep in the embedding (an ``IndexError``): the
        collator refuses them by name when it knows the vocabulary, and the pad id of every packing (the
        trainer's, or that of a dataset given packed) must be below it. ``None``: no model yet."""
        if vocab is None:
            return
        collator = self.data_collator
        if self._own_collator:
            collator.vocab_size = vocab
        elif collator.vocab_size is not None and collator.vocab_size > vocab:  # (a smaller one is only stricter)
            raise ValueError(f"DistCATrainer: data_collator={type(collator).__name__}(vocab_size={collator.vocab_size}) "
                             f"is past the model's vocab_size {vocab}; give the collator the model's (or no data_collator)")
        for name, packed in self._packed_datasets.items():
            check_pad_token_id(packed.config.pad_token_id, vocab,
                               source=f"DistCATrainer: {_argument_name(name)}'s PackingConfig.pad_token_id")

    def _table_replaces_progress(self) -> None:
        """A ``StepTableCallback`` draws the bar and writes the logs itself: drop the Trainer's own
        ``ProgressCallback`` / ``PrinterCallback`` (exactly those classes) so nothing is written twice."""
        callbacks = self.callback_handler.callbacks
        if any(isinstance(c, StepTableCallback) for c in callbacks):
            for callback in [c for c in callbacks if type(c) in (ProgressCallback, PrinterCallback)]:
                self.remove_callback(callback)

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
        if self.compute_loss_func is not None or self.args.label_smoothing_factor:
            raise ValueError(
                "with span_ranks=True the loss must read shift_labels (the last token of a rank's piece predicts the "
                "first token of the next rank's); compute_loss_func and label_smoothing_factor receive labels only. "
                "Remove them or set DistCAPlugin(span_ranks=False)")
        if self.model is None or self.distca_plugin.pipeline_parallel_size > 1:
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
        elif is_streaming(dataset):
            packed = StreamingPackedDataset(dataset, packing, **layout)
        else:
            packed = PackedDataset(dataset, packing, **layout)
        if isinstance(packed, StreamingPackedDataset):
            self._check_ranks_read_one_stream(packed.documents, name)
        if isinstance(packed, PackedDataset):
            check_has_documents(packed, _argument_name(name), trainer="DistCATrainer", training=name == "train")
            check_positions_fit(self.model, packed.report, _argument_name(name), trainer="DistCATrainer",
                                shrink="PackingConfig.tokens_per_rank")
            report = packed.report
            if name == "train" and packed.config.balance_micro_batches and packed.step_global_batches == 1:
                warnings.warn(f"DistCATrainer: PackingConfig(balance_micro_batches=True) has nothing to balance in "
                              f"{_argument_name(name)}: a step holds one global batch (no pipeline stages, one server "
                              "group); it balances the micro-batches of a step in pipeline stages "
                              "(DistCAPlugin(pipeline_parallel_size > 1)). Set it False", stacklevel=3)
            if report.cut_documents:  # (documented, but it changes what trains: said once, with the count)
                warnings.warn(f"DistCATrainer: {report.cut_documents} of the {report.documents} documents of "
                              f"{_argument_name(name)} are longer than a global batch ({report.group_size} x "
                              f"{report.tokens_per_rank} tokens) and were cut into {report.chunks} chunks that train as "
                              "their own documents; raise PackingConfig.tokens_per_rank (or span more ranks) to keep "
                              "them whole", stacklevel=3)
        self._packed_datasets[name] = packed
        return packed

    def _check_ranks_read_one_stream(self, documents, name: str) -> None:
        """Every rank reads a stream whole and keeps its share of each block: refused on every rank (a
        collective, so none trains on) when the ranks' first documents differ (``stream_head_crc``)."""
        if self.accelerator.num_processes == 1:
            return
        from accelerate.utils import gather_object

        heads = gather_object([stream_head_crc(documents)])
        if len(set(heads)) > 1:
            raise ValueError(
                f"DistCATrainer: the ranks read different streams in {_argument_name(name)} (their first "
                f"{STREAM_HEAD_DOCUMENTS} documents differ); every rank reads the whole stream and keeps its own rows "
                "of each block, so all must see the same documents in the same order. Shuffle it with the same seed "
                "on every rank (IterableDataset.shuffle(seed=..., buffer_size=...): without one, datasets draws an "
                "order per process) and do not split it per rank")

    def _packed_later(self, dataset, name: str):
        """A dataset given to ``evaluate()`` / ``predict()`` after construction, packed as the constructor
        packs: raw documents with the trainer's ``packing=``, a ``PackedDataset`` laid out for this job's
        ranks (a 1-rank packing would cut documents that span ranks). Names of ``eval_dataset`` and the
        constructor's own datasets pass as they are."""
        if dataset is None or isinstance(dataset, str) or any(dataset is d for d in self._packed_datasets.values()):
            return dataset
        packed = isinstance(dataset, (PackedDataset, StreamingPackedDataset))  # (its own packing config holds)
        _check_packable(dataset, None if packed else self._packing, name)
        packed = self._packed(dataset, self._packing, self._layout, name)
        if self._pipeline is not None:  # every stage of a pipeline reads the same rows (PipelineTrainerMixin)
            return self._pipeline_rows_later(packed, name)
        if self.model is not None:
            self._check_vocabulary(model_vocab_size(hf_model_of(self.model)))
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
            self._check_vocabulary(model_vocab_size(hf_model_of(self.model)))
        return super().train(*args, **kwargs)  # GlobalBatchTrainerMixin: the trainer's settings in force

    # -- training ---------------------------------------------------------------------------------

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self._window_start is None:
            self._window_start = time.perf_counter()
            self._window["first_step"] = self.state.global_step
        loss = super().training_step(model, inputs, num_items_in_batch)  # PipelineTrainerMixin: a whole step
        if self._pipeline is None:  # (in stages, each micro-batch is recorded when its step has run)
            self._record_plan(inputs)
        return loss

    def _record_plan(self, inputs, stats: dict | None = None) -> None:
        """Attention balance of the micro-batch just run, and the tokens of all ranks; ``stats``: its
        ``plan_stats()`` when it is not the last plan made (pipeline stages run a step's micro-batches
        before any is recorded)."""
        lengths, first_positions = _local_documents(inputs)
        # counted as the plan counts them: under the model's window when every layer slides
        window = widest_window(getattr(self.model, "config", None))
        colocated_pairs = causal_pairs(first_positions, first_positions + lengths, window).sum()
        mine = torch.tensor([int(lengths.sum()), int(colocated_pairs)], dtype=torch.int64, device=self.args.device)
        everyone = self.accelerator.gather(mine).view(-1, 2).cpu()
        if stats is None:
            try:
                stats = plan_stats()
            except RuntimeError:  # no distca forward ran (another attention function registered under its name)
                stats = {}
        if stats.get("dispatched"):
            before, after = stats["attn_pairs_local"], stats["attn_pairs_served"]
        else:  # colocated (or one rank): every rank computes its own documents
            before = after = everyone[:, 1].tolist()
        self._window["before"] += imbalance(before)  # sums and a count: a run that never logs keeps no list
        self._window["after"] += imbalance(after)
        self._window["plans"] += 1
        self._window["tokens"] += int(everyone[:, 0].sum()) // self._ranks_per_batch  # tensor-parallel peers: once
        self._window["plan_s"] += float(stats.get("plan_seconds", 0.0))

    def _reset_window(self) -> None:
        self._window = {"before": 0.0, "after": 0.0, "plans": 0, "tokens": 0, "plan_s": 0.0, "first_step": 0}
        self._window_start = None

    def log(self, logs: dict, start_time: float | None = None) -> None:
        if "loss" in logs and self._window["plans"]:
            elapsed = time.perf_counter() - self._window_start
            logs["attn_imbalance_before"] = self._window["before"] / self._window["plans"]
            logs["attn_imbalance_after"] = self._window["after"] / self._window["plans"]
            logs["tokens_per_s"] = self._window["tokens"] / elapsed if elapsed > 0 else 0.0
            steps = max(1, self.state.global_step - self._window["first_step"])
            logs["step_time_s"] = elapsed / steps
            logs["plan_time_s"] = self._window["plan_s"] / steps  # this rank's, summed over a step's micro-batches
            self._reset_window()
        super().log(logs, start_time)

    # -- evaluation: the exact token-weighted loss -------------------------------------------------

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        if self._pipeline is not None or "labels" not in inputs:  # PipelineTrainerMixin: the stages' loss
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        loop_inputs, inputs = inputs, self._prepare_inputs(inputs)
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
        return (loss, *self._metrics_outputs(loop_inputs, outputs.logits.detach(), labels, inputs.get("shift_labels")))

    def evaluation_loop(self, *args, **kwargs):
        _check_eval_batch_size(self.args)  # evaluate() and predict() both come here, before any forward
        return super().evaluation_loop(*args, **kwargs)  # GlobalBatchTrainerMixin: the exact loss of the set


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
    return shared  # (pipeline stages refuse tensor parallelism before this is asked: PipelineTrainerMixin)


def _data_layout(topology, server_groups: list[list[int]], ranks_per_batch: int):
    """``(ranks, server groups)`` the packed rows are laid out for: the ranks themselves, or with batches shared by
    tensor-parallel peers the data-parallel indices (Accelerate's ``rank // tp``) and the groups in them."""
    if ranks_per_batch == 1:
        return topology.world_size, server_groups
    groups = sorted({tuple(topology.coordinates(rank)[0] for rank in group) for group in server_groups})
    return topology.data_parallel, [list(group) for group in groups]


def _label_tokens(inputs) -> torch.Tensor:
    """Tokens the causal-LM loss trains in ``inputs`` (a 0-d tensor): the targets the pipeline stages
    train too (``shift_labels`` when given, they include the label across a rank boundary, else
    ``labels`` shifted by one)."""
    return pipeline_targets(inputs).ne(-100).sum()


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


def _check_packable(dataset, packing: PackingConfig | None, name: str) -> None:
    raw = not (is_streaming(dataset) or isinstance(dataset, PackedDataset))
    if raw:  # (before packing, naming the argument; PackedDataset checks a dataset given packed)
        refuse_masks(dataset, f"DistCATrainer: {_argument_name(name)}")
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


def _check_collator(data_collator) -> None:
    """Every dataset reaches the collator as packed rows (``PackedDataset`` items: ``input_ids`` a list of
    pieces), which only ``PackedCollator`` and its subclasses read (another collator failed deep inside)."""
    if isinstance(data_collator, type):
        raise TypeError(f"data_collator={data_collator.__name__} is a class; pass an instance, e.g. PackedCollator()")
    if data_collator is not None and not isinstance(data_collator, PackedCollator):
        raise ValueError(
            "DistCATrainer: the rows must come from distca_hf.PackedCollator (the datasets are packed rows, items "
            "{'input_ids': [piece tokens, ...], 'first_position', 'last_label'}, and it emits their positions and the "
            f"labels across rank boundaries), got data_collator={type(data_collator).__name__}; drop data_collator= "
            "(or pass a PackedCollator subclass)")


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
    if args.accelerator_config.dispatch_batches:
        raise ValueError("DistCATrainer: every rank reads its own packed rows; accelerator_config.dispatch_batches=True "
                         "would send rank 0's batches to every rank. Leave it unset (or False)")
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
        if out is not None and not callable(getattr(out, "write", None)):  # (an AttributeError after a step)
            raise TypeError(f"StepTableCallback(out=...) must be a writable file object (open(path, 'w'), "
                            f"sys.stdout, io.StringIO()), got {type(out).__name__} {out!r:.60}")
        if title is not None and not isinstance(title, str):
            raise TypeError(f"StepTableCallback(title=...) must be a string, got {type(title).__name__}")
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
