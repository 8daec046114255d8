"""What a ``transformers.Trainer`` subclass does when the ranks of a server group share global batches.

``DistCATrainer`` and TRL's ``DistCASFTTrainer`` both pack documents into global batches of
``group size * tokens_per_rank`` tokens, one consecutive slice per rank (contract "documents spanning
ranks"). ``GlobalBatchTrainerMixin`` holds, once, what follows from that for the Trainer:

- ``span_ranks``: the user's choice (``DistCAPlugin(span_ranks=...)`` > ``DISTCA_SPAN_RANKS`` >
  ``span_ranks:`` in the ``distca:`` section), else on when the server group has more than one rank;
  that default is in force only while ``train()``, ``evaluate()`` and ``predict()`` run, so a forward
  of the user's after them (generation on one rank, say) sees the settings they had given;
- the data order: ``GlobalBatchSampler`` hands the slices of one global batch to the ranks of a group
  in the same step (training shuffles whole global batches from the seed and the epoch alone, so a
  run resumed mid-epoch reads what the uninterrupted one read; evaluation keeps the order);
- packed items reach ``PackedCollator`` whole (their keys are not model arguments);
- a dataset given to ``evaluate()`` / ``predict()`` after construction is packed as the constructor's
  (the subclass's ``_packed_later`` says how);
- the evaluation loss is the exact mean over every target token of the set, whatever rank holds it.

Both trainers also check their model and packed data alike (``model_vocab_size``,
``check_pad_token_id``, ``check_has_documents``, ``check_positions_fit``: one wording for both).

A subclass lists its packed dataset classes in ``packed_dataset_types`` and sets ``distca_plugin``
and ``distca`` (``DistCAPlugin.attach``'s groups) before calling ``_choose_span_ranks``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from ..config import SETTINGS, configured
from .accelerator import hf_model_of
from .packing import GlobalBatchSampler, PackedCollator
from .resume_layout import check_resume_layout, reading_layout, save_reading_layout

__all__ = ["GlobalBatchTrainerMixin", "with_boundary_targets", "model_vocab_size", "check_pad_token_id",
           "check_has_documents", "learned_positions", "check_positions_fit"]


# -- what both trainers check of the model and the packed data (one home, one wording) -------------

def model_vocab_size(model) -> int | None:
    """The model's ``config.vocab_size`` (None when it has none: a ``model_init`` trainer's model)."""
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return size if isinstance(size, int) and size > 0 else None


def check_pad_token_id(pad_token_id: int, vocab: int | None, *, source: str) -> None:
    """Refuse a pad id (``source`` names where it came from) at or past the model's vocabulary: filler
    rows would fail inside the embedding."""
    if vocab is not None and pad_token_id >= vocab:
        raise ValueError(f"{source}={pad_token_id} is not below the model's vocab_size {vocab}: filler rows would "
                         "fail in the embedding; use the tokenizer's pad token id")


def check_has_documents(packed, argument: str, *, trainer: str, training: bool) -> None:
    """A ``PackedDataset`` that packs into no row would end in torch's ``num_samples=0`` (train) or
    evaluate nothing: say which ``argument`` of ``trainer`` and why. A training set must also hold a
    label token (a document of two tokens or more), or the loss would be 0 / 0."""
    report = packed.report
    if len(packed) == 0:
        why = ("it holds no documents" if report.documents == 0 else
               f"all {report.documents} of its documents are empty (input_ids of no token)")
        raise ValueError(f"{trainer}: {argument} has no documents to {'train on' if training else 'evaluate'}: "
                         f"{why}; give it tokenized documents (an 'input_ids' column of token-id lists)")
    if training and packed.label_tokens() == 0:
        raise ValueError(f"{trainer}: {argument} has nothing to learn: none of its {report.documents} documents "
                         "has two tokens or more, so no token has a next token to predict")


LEARNED_POSITION_TABLES = ("wpe", "embed_positions", "position_embeddings")
"""Names of a learned absolute position table beside a model's token embedding (GPT-2, GPT-Neo: ``wpe``;
OPT, BioGPT: ``embed_positions``)."""


def learned_positions(model) -> int | None:
    """Positions the model's learned absolute position table holds (an ``nn.Embedding`` named as in
    ``LEARNED_POSITION_TABLES`` beside its token embedding, less OPT's ``offset``), ``None`` for a model
    without one (rotary, ALiBi, NoPE): a position past it fails inside the embedding."""
    inputs = getattr(model, "get_input_embeddings", lambda: None)()
    if inputs is None:
        return None
    for parent in model.modules():
        if any(child is inputs for child in parent.children()):
            for name in LEARNED_POSITION_TABLES:
                table = getattr(parent, name, None)
                if isinstance(table, torch.nn.Embedding):
                    return table.num_embeddings - int(getattr(table, "offset", 0) or 0)
            return None
    return None


def check_positions_fit(model, report, argument: str, *, trainer: str, shrink: str) -> None:
    """Refuse a packed ``argument`` whose longest trained document (or chunk: at most ``group_size x
    tokens_per_rank`` tokens, a document spanning the ranks of a group) has more positions than the
    model learned (``learned_positions``): an ``IndexError`` deep in the embedding on the rank holding its
    end otherwise, a timeout on the others. ``model``: the trainer's (wrapped or not; ``None``: no model
    yet); ``shrink``: the setting that sizes a row."""
    model = hf_model_of(model) if model is not None else None
    table = learned_positions(model) if model is not None else None
    longest = min(report.longest_document, report.group_size * report.tokens_per_rank)
    if table is not None and longest > table:
        spanning = (f", spanning up to {report.group_size} ranks of {report.tokens_per_rank} tokens"
                    if report.group_size > 1 else "")
        raise ValueError(
            f"{trainer}: {argument} trains a document of {longest} tokens{spanning}, but {type(model).__name__} learned "
            f"positions for {table} tokens (its position table, config.max_position_embeddings): positions past it "
            f"would fail in the embedding. Lower {shrink} to at most {table // report.group_size}"
            + (" (or span no ranks: span_ranks=False cuts documents at it)" if report.group_size > 1 else ""))


def with_boundary_targets(logits: torch.Tensor | None, labels: torch.Tensor | None, shift_labels: torch.Tensor | None):
    """``(logits, labels)`` as ``prediction_step`` hands them to ``compute_metrics``: a row that continues on
    the next rank (``shift_labels[..., -1]`` a target) gets one more column, its logits padding (-100, as the
    Trainer pads) and its label that target, so the usual ``preds[:, :-1]`` against ``labels[:, 1:]`` counts
    every target the loss counts. (Without it, the row's last logit, which predicts the next rank's first
    token, met no label: one target lost per rank boundary, silently.) logits ``[rows, tokens, vocab]``
    (``preprocess_logits_for_metrics`` runs after, on these: it sees the padding column), labels and
    shift_labels ``[rows, tokens]``."""
    if logits is None or labels is None or shift_labels is None or not bool((shift_labels[..., -1] != -100).any()):
        return logits, labels
    labels = torch.cat([labels, shift_labels[..., -1:].to(labels)], dim=-1)
    column = logits.new_full((*logits.shape[:1], 1, *logits.shape[2:]), -100)
    return torch.cat([logits, column], dim=1), labels


class _SamplerEpoch(TrainerCallback):
    """Gives the ``GlobalBatchSampler`` the epoch at each epoch's start (every transformers release calls
    ``on_epoch_begin`` right before the epoch's batches are drawn; 5.0-5.2 have no ``Trainer._run_epoch``
    to hook): Accelerate's ``set_epoch`` does not reach a sampler behind ``skip_first_batches``, so a run
    resumed mid-epoch in a later epoch read the first epoch's order. ``state.epoch`` is the whole epochs
    done at an epoch's start (the checkpoint's, within the epoch, when resumed)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_epoch_begin(self, args, state, control, **kwargs):
        sampler = getattr(self.trainer, "_global_batch_sampler", None)
        if sampler is not None:
            sampler.set_epoch(int(state.epoch or 0))
        return control


@contextlib.contextmanager
def _torch_load_to_plain_cpu():
    """``torch.load`` with an indexed CPU ``map_location`` (``"cpu:0"``) restoring to plain ``"cpu"``, for
    the ``with`` block only."""
    load = torch.load

    def plain_cpu_load(*args, map_location=None, **kwargs):
        if isinstance(map_location, (str, torch.device)) and torch.device(map_location).type == "cpu":
            map_location = "cpu"
        return load(*args, map_location=map_location, **kwargs)

    torch.load = plain_cpu_load
    try:
        yield
    finally:
        torch.load = load


class GlobalBatchTrainerMixin:
    """Mixed in before ``transformers.Trainer`` (or a subclass such as TRL's ``SFTTrainer``).

    Attributes:
        packed_dataset_types: the dataset classes whose rows are laid out in global batches.
        span_ranks: whether documents span the ranks of the server group (set by ``_choose_span_ranks``).
    """

    packed_dataset_types: tuple[type, ...] = ()
    _eval_totals = None  # [sum of target losses, targets] while evaluation_loop runs
    _ranks_per_batch = 1  # ranks reading the same rows (tensor-parallel peers under Accelerate's device mesh)

    def _choose_span_ranks(self, *, group_size: int) -> bool:
        """``span_ranks`` as the user set it, else on when the server group (``group_size`` ranks) has
        more than one rank: then put in force only while the trainer runs (``_forced_settings``)."""
        self._forced_settings = {}
        plugin = self.distca_plugin
        variable = SETTINGS["span_ranks"].metadata["env"]
        if plugin.span_ranks is not None or variable in os.environ or "span_ranks" in plugin.file_settings:
            return self.distca.config.span_ranks  # attach() resolved it with the usual precedence
        if group_size == 1:
            return False
        self._forced_settings = {"span_ranks": True}
        with configured(**self._forced_settings) as config:
            self.distca = dataclasses.replace(self.distca, config=config)
        return True

    def _lays_out_global_batches(self, dataset) -> bool:
        return bool(getattr(self, "span_ranks", False)) and isinstance(dataset, self.packed_dataset_types)

    # -- the settings in force while the trainer runs -------------------------------------------------

    def train(self, *args, **kwargs):
        if not any(isinstance(callback, _SamplerEpoch) for callback in self.callback_handler.callbacks):
            self.add_callback(_SamplerEpoch(self))
        checkpoint = kwargs.get("resume_from_checkpoint", args[0] if args else None)
        if checkpoint is True:
            checkpoint = get_last_checkpoint(self.args.output_dir)
        if isinstance(checkpoint, (str, os.PathLike)) and os.path.isdir(checkpoint):
            check_resume_layout(str(checkpoint), reading_layout(self))  # (before any step: every rank alike)
        with configured(**getattr(self, "_forced_settings", {})):
            return super().train(*args, **kwargs)

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.args.should_save:  # what this run reads, for a resume to compare (resume_layout)
            folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            if os.path.isdir(folder):
                save_reading_layout(folder, reading_layout(self))

    def evaluate(self, *args, **kwargs):
        with configured(**getattr(self, "_forced_settings", {})):
            return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        with configured(**getattr(self, "_forced_settings", {})):
            return super().predict(*args, **kwargs)

    # -- datasets given to evaluate() / predict() after construction: packed as the constructor's -------

    def get_eval_dataloader(self, eval_dataset=None):
        return super().get_eval_dataloader(self._packed_later(eval_dataset, "eval"))

    def get_test_dataloader(self, test_dataset):
        return super().get_test_dataloader(self._packed_later(test_dataset, "test"))

    def _packed_later(self, dataset, name: str):
        """``dataset`` (given to ``evaluate()`` / ``predict()``) as the trainer packs it; each trainer says how."""
        raise NotImplementedError

    # -- data order: the ranks of a server group read the slices of one global batch together --------

    def _get_train_sampler(self, train_dataset=None):
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        strategy = getattr(self.args, "train_sampling_strategy", "random")
        if strategy == "group_by_length" and isinstance(dataset, self.packed_dataset_types):
            # (it grouped rows by their count of pieces, the length of their input_ids, without a word)
            raise ValueError("train_sampling_strategy='group_by_length' would group the packed rows by their number "
                             "of pieces: rows are packed already, every one of tokens_per_rank tokens at most "
                             "(PackingConfig.length_aware groups documents by length); use 'random' or 'sequential'")
        if not self._lays_out_global_batches(dataset):
            return super()._get_train_sampler(train_dataset)
        if strategy not in ("random", "sequential"):
            raise ValueError(
                f"train_sampling_strategy={strategy!r} would reorder the rows of a global batch, which with "
                "span_ranks=True must reach the ranks of a server group together; use 'random' (global batches "
                "shuffled whole) or 'sequential'")
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        self._global_batch_sampler = GlobalBatchSampler(len(dataset), dataset.world_size,
                                                        shuffle=strategy == "random", seed=seed,
                                                        step_blocks=getattr(dataset, "step_blocks", 1))
        return self._global_batch_sampler

    def _get_eval_sampler(self, eval_dataset):
        if self._lays_out_global_batches(eval_dataset):
            return GlobalBatchSampler(len(eval_dataset), eval_dataset.world_size, shuffle=False)
        return super()._get_eval_sampler(eval_dataset)

    def _load_optimizer_and_scheduler(self, checkpoint):
        device = self.args.device
        try:
            if checkpoint is None or device.type != "cpu" or device.index is None:
                return super()._load_optimizer_and_scheduler(checkpoint)
            # transformers before 5.24 restores the optimizer of a multi-process run to args.device, here an indexed
            # CPU device ("cpu:0"), which torch.load cannot restore to: every resume of a CPU job failed there
            with _torch_load_to_plain_cpu():
                return super()._load_optimizer_and_scheduler(checkpoint)
        except AssertionError as e:
            # torch.distributed.checkpoint finds the device of a full optimizer state in its tensors: an optimizer
            # that keeps none (SGD without momentum) cannot be loaded there (a bare assertion, torch 2.13)
            if not (getattr(self, "is_fsdp_enabled", False) and "Expected device to be set" in str(e)):
                raise
            raise RuntimeError(
                f"resuming {checkpoint}: FSDP cannot load a FULL_STATE_DICT optimizer checkpoint of an optimizer that "
                "keeps no state (optim='sgd' without momentum; torch asserts 'Expected device to be set'). Save with "
                "fsdp_state_dict_type: SHARDED_STATE_DICT (accelerate config; FSDP_STATE_DICT_TYPE), or train with an "
                "optimizer that keeps state (momentum, AdamW)") from e

    def _get_collator_with_removed_columns(self, data_collator, description=None):
        # Packed items are PackedCollator's own format: its keys (first_position, last_label, label_pieces)
        # are not model arguments and must not be removed.
        if isinstance(data_collator, PackedCollator):
            return data_collator
        return super()._get_collator_with_removed_columns(data_collator, description)

    # -- evaluation: the exact token-weighted loss of the whole set -----------------------------------

    def _metrics_outputs(self, loop_inputs: dict, logits, labels, shift_labels):
        """``prediction_step``'s ``(logits, labels)`` by ``with_boundary_targets``. With
        ``include_for_metrics=["inputs"]`` the evaluation loop reads the inputs from ``loop_inputs`` (the
        dict it gave ``prediction_step``) after the step: they get the same extra column (-100, as the
        Trainer pads), so inputs, logits and labels keep one width."""
        widened_logits, widened_labels = with_boundary_targets(logits, labels, shift_labels)
        name = getattr(self.model, "main_input_name", "input_ids")
        if widened_labels is not labels and "inputs" in (self.args.include_for_metrics or ()) and name in loop_inputs:
            ids = loop_inputs[name]
            loop_inputs[name] = torch.cat([ids, ids.new_full((*ids.shape[:-1], 1), -100)], dim=-1)
        return widened_logits, widened_labels

    def _add_eval_loss(self, loss_sum, count) -> None:
        """Add one row's summed target loss and its target count to the evaluation's totals (during
        ``evaluation_loop``; the subclass's ``prediction_step`` calls it)."""
        if self._eval_totals is not None:
            self._eval_totals += torch.stack([loss_sum.detach().to(self._eval_totals), count.to(self._eval_totals)])

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        """The Trainer's loop; then ``{prefix}_loss`` is the mean over every target token of the set,
        whatever rank held it, and ``{prefix}_label_tokens`` their count."""
        self._eval_totals = torch.zeros(2, dtype=torch.float64, device=self.args.device)
        try:
            output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                             metric_key_prefix)
            # tensor-parallel peers evaluated the same rows: count them once
            totals = self.accelerator.reduce(self._eval_totals, reduction="sum").cpu() / self._ranks_per_batch
        finally:
            self._eval_totals = None
        # no label token (1-token documents only): no loss to report; NaN, not the Trainer's mean of zeros,
        # which would read as a perfect loss (and win metric_for_best_model="eval_loss")
        output.metrics[f"{metric_key_prefix}_loss"] = float(totals[0] / totals[1]) if totals[1] > 0 else float("nan")
        output.metrics[f"{metric_key_prefix}_label_tokens"] = int(totals[1])
        return output
