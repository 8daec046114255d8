"""TRL's ``SFTTrainer`` with documents longer than one rank's row: ``DistCASFTTrainer``.

TRL refuses ``packing=True`` together with context parallelism (its CP drops the block-diagonal mask,
so packed documents would attend to each other), and its own packing truncates (``bfd``) or splits
(``bfd_split``) every document longer than ``max_length``. With distca the ranks of an attention-server
group share one global batch of ``group size * max_length`` tokens, each rank holding one consecutive
slice (contract "documents spanning ranks"): a document up to that length trains whole, its pieces on
later ranks attending to their whole prefix, exactly as if it ran alone::

    import distca_hf
    from distca_hf.training import DistCASFTTrainer
    from trl import SFTConfig

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="distca")
    config = SFTConfig(output_dir="out", packing=True, max_length=8192,   # tokens per rank and step
                       per_device_train_batch_size=1, ...)
    trainer = DistCASFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()        # accelerate launch --config_file recipes/NAME.yaml script.py

What stays TRL's: dataset preparation (formatting function, chat template, EOS, tokenization, the
``labels`` column with prompt / non-assistant tokens at -100 for ``completion_only_loss`` and
``assistant_only_loss``), its loss (the fused LM head, ``loss_type`` ``nll`` or ``dft``, normalised by
the label tokens of all ranks), its metrics (``entropy``, ``mean_token_accuracy``, ``num_tokens``) and
``transformers.Trainer``'s own paths (gradient accumulation, checkpoints, DDP, DeepSpeed, FSDP2). What
changes: the packing. TRL's ``pack_dataset`` is replaced by distca's (``training.packing``:
``PackedDataset`` with ``tokens_per_rank = max_length``, best-fit decreasing for ``packing_strategy``
``bfd`` and ``bfd_split`` alike), the rows come from ``SFTPackedCollator`` (``PackedCollator``'s rows
with TRL's label masks applied, ``shift_labels`` carrying the label across a rank boundary) and they
are read in whole global batches (``GlobalBatchSampler``). Nothing is truncated: a document longer
than a whole global batch (``group size * max_length`` tokens) is cut into chunks of that size, each
trained as its own document, and ``trainer.packing_reports`` counts them.

Evaluation rows are packed the same way; ``eval_loss`` is the mean over every target token of the
evaluation set, whatever rank holds it (TRL's per-row means weighted by their targets, summed over
ranks), and ``eval_label_tokens`` their count.
Map-style datasets only (``datasets.Dataset``): a streaming dataset is refused (``DistCATrainer``
streams).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import ClassVar

import torch
from trl import SFTConfig, SFTTrainer

from ..config import is_integer
from .accelerator import apply_cpu_fsdp, hf_model_of, prepare_training_arguments, require_distca_model
from .launch_checks import check_world_size
from .global_batches import (GlobalBatchTrainerMixin, check_has_documents, check_pad_token_id, check_positions_fit,
                             model_vocab_size)
from .packing import IGNORE_INDEX, PackedCollator, PackedDataset, PackingConfig, arrow_columns, is_streaming
from .plugin import DistCAPlugin

__all__ = ["DistCASFTTrainer", "SFTPackedCollator", "SFTPackedDataset"]


class SFTPackedDataset(torch.utils.data.Dataset):
    """Packed rows of a TRL-prepared dataset (``input_ids`` and, when TRL built it, ``labels``).

    Args:
        rows: the ``PackedDataset`` of the ``input_ids``.
        labels: a ``PackedDataset`` of the ``labels`` packed with the same config and layout (so row
            ``i`` holds the same pieces: packing is a function of the lengths and the config), or
            ``None`` when every token is a target.

    Item ``i`` is ``rows[i]`` plus ``label_pieces`` (the labels of its pieces) and ``next_label``
    (the label of the token after its last piece, on the next rank; -100 when there is none).
    """

    def __init__(self, rows: PackedDataset, labels: PackedDataset | None = None):
        for name, value in (("rows", rows), ("labels", labels)):  # (a list failed at the first item, or at once)
            if not isinstance(value, PackedDataset) and not (name == "labels" and value is None):
                raise TypeError(f"SFTPackedDataset({name}=...) must be a distca_hf.PackedDataset"
                                f"{' or None' if name == 'labels' else ''}, got {type(value).__name__}")
        if labels is not None and (labels.rows != rows.rows or len(labels) != len(rows)):
            raise ValueError("the labels were packed into other rows than the input_ids: every document's labels "
                             "must have as many entries as its input_ids")
        self.rows, self.labels = rows, labels

    @property
    def report(self):
        """The ``PackingReport`` of the rows."""
        return self.rows.report

    @property
    def world_size(self) -> int:
        return self.rows.world_size

    def __len__(self) -> int:
        return len(self.rows)

    def has_targets(self) -> bool:
        """Whether some token trains (a label other than -100 after a document's first token)."""
        if self.labels is None:
            return self.rows.label_tokens() > 0
        # labels hold -100, which only a datasets column carries through packing (tokens_of refuses it)
        import pyarrow.compute as pc

        for labels in arrow_columns(self.labels.documents, "input_ids"):
            later = pc.list_flatten(pc.list_slice(labels, 1))
            if len(later) and pc.any(pc.not_equal(later, IGNORE_INDEX)).as_py():
                return True
        return False

    def __getitem__(self, index: int) -> dict:
        item = self.rows[index]
        if self.labels is not None:
            labelled = self.labels[index]
            item = {**item, "label_pieces": labelled["input_ids"], "next_label": labelled["last_label"]}
        return item


@dataclass
class SFTPackedCollator(PackedCollator):
    """``PackedCollator`` for ``SFTPackedDataset`` items: the same row, with TRL's label masks.

    A token whose label is -100 in the dataset (a prompt token under ``completion_only_loss``, a
    non-assistant token under ``assistant_only_loss``) is no target: ``labels`` is -100 there, and so
    is ``shift_labels`` at the token before it, including the last token of a rank's piece when the
    first token of the next rank's piece is masked (``next_label``). Shapes as ``PackedCollator``.
    """

    item_keys: ClassVar[frozenset] = PackedCollator.item_keys | {"label_pieces", "next_label"}

    def __call__(self, items: list[dict]) -> dict:
        batch = super().__call__(items)
        if not any("label_pieces" in item for item in items):
            return batch
        if not all("label_pieces" in item for item in items):
            raise ValueError("SFTPackedCollator: some items have label_pieces and some do not; pack every "
                             "dataset with SFTPackedDataset(rows, labels)")
        try:
            targets = torch.tensor([label for item in items for piece in item["label_pieces"] for label in piece],
                                   dtype=torch.int64).unsqueeze(0)
        except (TypeError, ValueError, RuntimeError):  # (ragged or non-integer label pieces failed inside torch)
            raise ValueError("SFTPackedCollator: label_pieces must be lists of integer labels, one per token of the "
                             "item's pieces (-100: no target)") from None
        if targets.shape != batch["input_ids"].shape:
            raise ValueError(f"SFTPackedCollator: the items' label_pieces hold {targets.shape[1]} labels for "
                             f"{batch['input_ids'].shape[1]} tokens; each document needs one label per token")
        trained = targets.ne(IGNORE_INDEX)
        if not torch.equal(targets[trained], batch["input_ids"][trained]):  # (read as "trained" before)
            raise ValueError("SFTPackedCollator: a label is neither -100 nor its token's id; the labels of TRL's "
                             "datasets mask tokens (-100: no target), each token is trained on the next one")
        next_label = items[-1].get("next_label", IGNORE_INDEX)
        if not is_integer(next_label):  # (int()'s bare ValueError before)
            raise ValueError(f"SFTPackedCollator: the last item's next_label must be a token id or -100, got "
                             f"{next_label!r}")
        next_trained = torch.tensor([[int(next_label) != IGNORE_INDEX]])
        batch["labels"] = batch["labels"].masked_fill(~trained, IGNORE_INDEX)
        batch["shift_labels"] = batch["shift_labels"].masked_fill(
            ~torch.cat([trained[:, 1:], next_trained], dim=1), IGNORE_INDEX)
        return batch


class DistCASFTTrainer(GlobalBatchTrainerMixin, SFTTrainer):
    """TRL's ``SFTTrainer`` packing global batches over the attention-server group (documents span ranks).

    Args:
        model: a causal LM with ``attn_implementation="distca"`` (or a name TRL loads: then pass
            ``SFTConfig(model_init_kwargs={"attn_implementation": "distca"})``).
        args: ``trl.SFTConfig`` with ``packing=True``, ``max_length`` = tokens per rank and step,
            ``per_device_train_batch_size=1`` and ``per_device_eval_batch_size=1`` (one packed row per
            rank), ``packing_strategy`` ``bfd`` or ``bfd_split`` (both: best-fit decreasing, nothing
            truncated), ``eval_packing`` not ``False``.
        train_dataset, eval_dataset: what ``SFTTrainer`` takes (text, conversational,
            prompt-completion or tokenized ``datasets.Dataset``); ``eval_dataset`` may be a dict.
        distca_plugin: distca settings and process topology (default ``DistCAPlugin.from_environment()``).
        **kwargs: the rest of ``SFTTrainer``'s arguments (no ``data_collator``: the rows are distca's).

    ``span_ranks`` is chosen as ``DistCATrainer`` chooses it: the plugin field, ``DISTCA_SPAN_RANKS`` or
    the ``distca:`` section when one is set, else on when the server group has more than one rank.

    Attributes:
        distca: ``DistCAGroups`` built by the plugin.
        span_ranks: whether documents span the ranks of the server group.
        packing_reports: ``{"train": PackingReport, "eval": ...}``.
    """

    packed_dataset_types = (SFTPackedDataset,)

    def __init__(self, model, args: SFTConfig | None = None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, *, distca_plugin: DistCAPlugin | None = None, **kwargs):
        if distca_plugin is not None and not isinstance(distca_plugin, DistCAPlugin):
            raise TypeError(f"distca_plugin must be a distca_hf.DistCAPlugin, got {type(distca_plugin).__name__}")
        _check_config(args)
        if data_collator is not None:
            raise ValueError("DistCASFTTrainer builds its rows itself (distca_hf.training.SFTPackedCollator: "
                             "documents spanning ranks); drop data_collator=")
        for name, dataset in {"train_dataset": train_dataset, **_named(eval_dataset)}.items():
            if hasattr(dataset, "__len__") and not isinstance(dataset, SFTPackedDataset) and len(dataset) == 0:
                raise ValueError(f"DistCASFTTrainer: {name} holds no documents")  # (TRL's StopIteration before)
            if is_streaming(dataset):
                raise ValueError(f"DistCASFTTrainer packs map-style datasets; {name} is a streaming "
                                 f"{type(dataset).__name__}. Load it without streaming, or train with "
                                 "distca_hf.DistCATrainer, which packs streams")
        if not isinstance(model, str):
            _prepare_model(model)
        self.distca_plugin = distca_plugin if distca_plugin is not None else DistCAPlugin.from_environment()
        if self.distca_plugin.pipeline_parallel_size > 1:
            raise ValueError(
                f"DistCASFTTrainer does not train in pipeline stages (pipeline_parallel_size="
                f"{self.distca_plugin.pipeline_parallel_size}); use distca_hf.DistCATrainer with the SFT rows (it splits "
                "the model into stages), or set pipeline_parallel_size=1")
        prepare_training_arguments(args)
        world = args.world_size
        self._layout = None  # known once the server groups exist: until then _prepare_dataset only tokenizes
        self._packed_datasets = {}
        super().__init__(model=model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, **kwargs)
        _prepare_model(self.model)  # a model TRL loaded by name is only known now
        check_world_size(self.accelerator.num_processes)
        if self.args.world_size != world:
            raise RuntimeError(f"the world size changed from {world} to {self.args.world_size} while the trainer was "
                               "set up; create the SFTConfig before the DistCASFTTrainer")
        if not self.model_accepts_loss_kwargs:
            raise ValueError(f"{type(hf_model_of(self.model)).__name__}.forward does not accept loss kwargs "
                             "(num_items_in_batch), so the loss could not be normalised by the label tokens of all "
                             "ranks")
        self.distca = self.distca_plugin.attach(model=hf_model_of(self.model))  # a tensor-parallel model's sizes
        server_groups = self.distca.topology.server_groups(self.distca_plugin.server_group)
        self.span_ranks = self._choose_span_ranks(group_size=len(server_groups[0]))
        if self.span_ranks and (self.compute_loss_func is not None or self.args.label_smoothing_factor):
            raise ValueError(
                "with span_ranks=True the loss must read shift_labels (the last token of a rank's piece predicts the "
                "first token of the next rank's); compute_loss_func and label_smoothing_factor receive labels only. "
                "Remove them or set DistCAPlugin(span_ranks=False)")
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        self._packing = PackingConfig(tokens_per_rank=self.args.max_length, length_aware=True,
                                      seed=self.args.data_seed if self.args.data_seed is not None else self.args.seed,
                                      pad_token_id=tokenizer.pad_token_id)
        vocab = model_vocab_size(hf_model_of(self.model))
        check_pad_token_id(self._packing.pad_token_id, vocab, source="DistCASFTTrainer: the tokenizer's pad_token_id")
        self._layout = {"world_size": world, "span_ranks": self.span_ranks,
                        "server_groups": server_groups if self.span_ranks else None}
        # token ids at or past the vocabulary refused by name (an IndexError in the embedding before)
        self.data_collator = SFTPackedCollator(vocab_size=vocab)
        self.train_dataset = self._pack(self.train_dataset, "train")
        # (trained silently at loss 0 before)
        check_has_documents(self.train_dataset.rows, "train_dataset", trainer="DistCASFTTrainer", training=True)
        if not self.train_dataset.has_targets():  # (trained at loss 0 before: TRL's masks hid every token)
            raise ValueError("DistCASFTTrainer: train_dataset has nothing to learn: every label after a document's "
                             "first token is -100 (TRL's completion_only_loss / assistant_only_loss masked them all); "
                             "check the dataset's prompt / completion fields or the chat template's assistant marks")
        if isinstance(self.eval_dataset, dict):
            self.eval_dataset = {name: self._pack(d, f"eval_{name}") for name, d in self.eval_dataset.items()}
        elif self.eval_dataset is not None:
            self.eval_dataset = self._pack(self.eval_dataset, "eval")

    # -- set-up -----------------------------------------------------------------------------------

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        apply_cpu_fsdp(self)  # on CPU processes Accelerate drops an FSDP request: shard as asked

    def _prepare_dataset(self, dataset, processing_class, args, packing, formatting_func, dataset_name):
        """TRL's preparation without its packing and truncation (``max_length`` is the row budget, not a
        document's limit); packed here for this job's ranks once the server groups exist."""
        if isinstance(dataset, SFTPackedDataset):
            return dataset
        whole = copy.copy(args)
        whole.max_length = None  # TRL truncates unpacked documents to max_length: keep them whole
        prepared = super()._prepare_dataset(dataset, processing_class, whole, False, formatting_func, dataset_name)
        return prepared if self._layout is None else self._pack(prepared, dataset_name)

    def _packed_later(self, dataset, name: str):
        """A dataset given to ``evaluate()`` / ``predict()`` after construction, prepared (unless
        ``dataset_kwargs={"skip_prepare_dataset": True}``) and packed as the constructor's: TRL prepares one
        given to ``evaluate()`` only, and with ``skip_prepare_dataset`` not even that, so its raw rows met the
        packed collator. Names and datasets packed already pass as they are."""
        if dataset is None or isinstance(dataset, (str, SFTPackedDataset)) \
                or any(dataset is d for d in self._packed_datasets.values()):
            return dataset
        if not getattr(self, "_skip_prepare_dataset", False):
            return self._prepare_dataset(dataset, self.processing_class, self.args, False, None, name)
        return self._pack(dataset, name)

    def _pack(self, prepared, name: str) -> SFTPackedDataset:
        if isinstance(prepared, SFTPackedDataset):
            return prepared
        columns = getattr(prepared, "column_names", None)
        if columns is None or "input_ids" not in columns:
            raise ValueError(f"the {name} dataset has no input_ids after TRL's preparation (columns {columns}); with "
                             "dataset_kwargs={'skip_prepare_dataset': True} pass tokenized documents")
        rows = PackedDataset(prepared.select_columns(["input_ids"]), self._packing, **self._layout)
        labels = None
        if "labels" in columns:
            labels = PackedDataset(prepared.select_columns(["labels"]).rename_column("labels", "input_ids"),
                                   self._packing, **self._layout)
        check_positions_fit(self.model, rows.report, f"the {name} dataset", trainer="DistCASFTTrainer",
                            shrink="SFTConfig.max_length")
        packed = SFTPackedDataset(rows, labels)
        self._packed_datasets[name] = packed
        return packed

    @property
    def packing_reports(self) -> dict:
        """``{"train": PackingReport, "eval": ...}``: what packing did."""
        return {name: dataset.report for name, dataset in self._packed_datasets.items()}

    # -- evaluation: the exact token-weighted loss -------------------------------------------------

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        # TRL's loss of one row is its mean over the row's targets (0 for a row without any); its
        # sum and count go to GlobalBatchTrainerMixin.evaluation_loop, which reports the mean over all targets.
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        if loss is not None and "shift_labels" in inputs:
            count = inputs["shift_labels"].ne(IGNORE_INDEX).sum()
            self._add_eval_loss(loss.detach().double() * count, count)
        return (loss, *self._metrics_outputs(inputs, logits, labels, inputs.get("shift_labels")))


def _check_config(args) -> None:
    """What ``DistCASFTTrainer`` needs of the ``SFTConfig`` (every problem named with its fix)."""
    if not isinstance(args, SFTConfig):
        raise TypeError("DistCASFTTrainer needs args=trl.SFTConfig(packing=True, max_length=TOKENS_PER_RANK, "
                        f"per_device_train_batch_size=1, ...), got {type(args).__name__}")
    if not args.packing:
        raise ValueError("DistCASFTTrainer packs documents into global batches over the ranks: set "
                         "SFTConfig(packing=True) (max_length is then the tokens of one rank's row)")
    if args.packing_strategy not in ("bfd", "bfd_split"):
        raise ValueError(
            f"packing_strategy={args.packing_strategy!r} is not padding-free: it concatenates documents so that they "
            "attend to each other. DistCASFTTrainer trains every document alone (padding-free rows, position_ids "
            "restarting per document): use packing_strategy='bfd' (the default)")
    if args.pad_to_multiple_of is not None:  # (ignored: rows were packed to max_length, unpadded)
        raise ValueError(f"SFTConfig.pad_to_multiple_of={args.pad_to_multiple_of} is not applied: DistCASFTTrainer's "
                         "rows are padding-free (max_length tokens of documents per rank); leave it unset")
    if args.eval_packing is False:
        raise ValueError("DistCASFTTrainer packs evaluation rows too (one row per rank, documents spanning ranks); "
                         "leave eval_packing unset or True")
    if isinstance(args.max_length, bool) or not isinstance(args.max_length, int) or args.max_length < 2:
        raise ValueError(f"SFTConfig.max_length must be the tokens of one rank's row (an integer >= 2), got "
                         f"{args.max_length!r}")
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size"):
        if getattr(args, name) != 1:
            raise ValueError(
                f"DistCASFTTrainer needs {name}=1 (got {getattr(args, name)}): each rank runs one packed row per "
                "forward, and the number of tokens in it is SFTConfig.max_length")
    if not args.average_tokens_across_devices:
        raise ValueError("DistCASFTTrainer normalises the loss by the label tokens of all ranks; "
                         "average_tokens_across_devices=False would weight each rank's tokens differently")


def _prepare_model(model) -> None:
    require_distca_model(model)
    config = getattr(hf_model_of(model), "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False  # training: no KV cache


def _named(eval_dataset) -> dict:
    if isinstance(eval_dataset, dict):
        return {f"eval_dataset[{name!r}]": d for name, d in eval_dataset.items()}
    return {} if eval_dataset is None else {"eval_dataset": eval_dataset}


