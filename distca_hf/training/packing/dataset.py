"""The map-style dataset of packed rows (``PackedDataset``): a document source's lengths packed once
(``rows.pack_rows``) for a ``RankLayout``, item ``i`` rank ``i % world_size``'s row as the item
``PackedCollator`` reads; ``tokens_of`` reads one document's token ids.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from .layout import RankLayout
from .rows import (IGNORE_INDEX, MAX_COUNT, PADDING, PackedRow, PackingConfig, Piece, check_flag, check_positive,
                   is_integer, pack_rows)


def _document_lengths(documents) -> list[int]:
    try:
        import datasets

        if isinstance(documents, datasets.Dataset):
            _require_input_ids(documents.column_names)
            _require_token_ids_column(documents.features["input_ids"])
            _check_token_ids_column(documents)
            refuse_masks(documents, "PackedDataset: documents")
            return [len(ids) for batch in documents.iter(batch_size=1024) for ids in batch["input_ids"]]
    except ImportError:
        pass
    refuse_columns(documents)
    if isinstance(documents, (str, bytes)) or not (hasattr(documents, "__len__") and hasattr(documents, "__getitem__")):
        raise ValueError(f"documents must be a sequence of token-id documents (a datasets.Dataset with an 'input_ids' "
                         f"column, or a list of token lists / tensors), got {type(documents).__name__}")
    return [len(tokens_of(documents[i], what=f"document {i}")) for i in range(len(documents))]


def refuse_columns(documents) -> None:
    """Documents given as a mapping of columns (a dict, a tokenizer's output) are refused, naming the
    fix (``documents[0]`` raised ``KeyError: 0``; a stream read its keys as texts)."""
    if isinstance(documents, Mapping):
        raise ValueError(f"documents must be a sequence of token-id documents, got a mapping of columns "
                         f"{sorted(map(str, documents))}; pass its 'input_ids' (documents['input_ids'], a list of "
                         "token lists) or datasets.Dataset.from_dict(...)")


def _require_input_ids(columns) -> None:
    if "input_ids" not in columns:
        raise ValueError(f"the documents need an 'input_ids' column (token ids), found {list(columns)}; "
                         "tokenize them first, e.g. with distca_hf.training.load_documents(..., tokenizer=...)")


_TOKENIZE_FIRST = "tokenize text first, e.g. with distca_hf.training.load_documents(..., tokenizer=...)"


def _require_token_ids_column(feature) -> None:
    """A ``datasets`` ``input_ids`` column must hold lists of integers ('null': no token at all)."""
    inner = getattr(feature, "feature", None)
    dtype = "null" if getattr(feature, "dtype", None) == "null" else str(getattr(inner, "dtype", ""))
    if not dtype.startswith(("int", "uint", "null")):
        raise ValueError(f"the documents' 'input_ids' column must hold lists of integer token ids, got {feature}; "
                         f"{_TOKENIZE_FIRST}")


def arrow_columns(documents, column: str, batch_size: int = 65536):
    """A ``datasets.Dataset``'s ``column`` as pyarrow arrays, batch after batch, rows as the dataset
    selects them (``Dataset.data`` is the whole table, whatever ``select`` or ``shuffle`` kept)."""
    for batch in documents.select_columns([column]).with_format("arrow").iter(batch_size=batch_size):
        yield batch.column(column)


def _check_token_ids_column(documents) -> None:
    """A ``datasets`` ``input_ids`` column read by its lengths only (the fast path): no row may be
    null, and no id above ``MAX_COUNT``. (Negative ids are left to ``PackedCollator``, which refuses
    them: ``DistCASFTTrainer`` packs its labels, -100 included, as such a column.)"""
    import pyarrow.compute as pc

    start = 0
    for column in arrow_columns(documents, "input_ids"):
        if column.null_count:
            row = start + pc.index(pc.is_null(column), True).as_py()
            raise ValueError(f"document {row} has no input_ids (None); every document needs its token-id list (drop "
                             "or fill the empty rows)")
        start += len(column)
        flat = pc.list_flatten(column)
        high = pc.max(flat).as_py() if len(flat) else None
        if high is not None and high > MAX_COUNT:
            raise ValueError(f"the documents' 'input_ids' hold token id {high}; token ids are integers from 0 to "
                             f"{MAX_COUNT}; {_TOKENIZE_FIRST}")


MASKING_COLUMNS = ("labels", "attention_mask", "position_ids")
"""Columns beside ``input_ids`` that packing would drop although they say something: masked labels,
padding, positions other than ``0 .. n-1``; a row holding one is refused (``mask_problem``)."""


def mask_problem(row: Mapping) -> str | None:
    """Why packing ``row`` (a document as a mapping of columns) would lose what its other columns say
    (``labels`` other than its ``input_ids``, an ``attention_mask`` with padding, ``position_ids`` other
    than ``0 .. n-1``: packing keeps ``input_ids`` alone), as the end of a sentence; None when nothing."""
    ids, labels, mask, positions = (row.get(c) for c in ("input_ids", *MASKING_COLUMNS))
    if ids is None:  # (no document: tokens_of and the column checks name it)
        return None
    if labels is not None and _as_list(labels) != _as_list(ids):
        return ("has 'labels' that differ from its 'input_ids' (a masked prompt, -100): packing keeps input_ids alone "
                "and would train on every token. Use DistCASFTTrainer (TRL), which packs the labels with the "
                "documents, or drop the 'labels' column")
    if mask is not None and 0 in _as_list(mask):
        return ("has an 'attention_mask' with padding: packing keeps input_ids alone and would train on the padding. "
                "Give the documents unpadded (drop the padding tokens and the 'attention_mask' column)")
    if positions is not None and _as_list(positions) != list(range(len(_as_list(ids)))):
        return ("has 'position_ids' other than 0 .. n-1: packing gives every document its own positions from 0 and "
                "would drop these. Give each document whole, or drop the 'position_ids' column")
    return None


def refuse_masks(documents, where: str) -> None:
    """Refuse documents (a ``datasets.Dataset``, or a list of mappings) of which a row has a
    ``mask_problem``, naming ``where`` and the row; other sources are checked row by row as read
    (``tokens_of``). Only the masking columns are read."""
    columns = getattr(documents, "column_names", None)
    if isinstance(columns, list):  # a datasets.Dataset: read in Arrow, rows in Python only where one may mask
        wanted = [c for c in ("input_ids", *MASKING_COLUMNS) if c in columns]
        if len(wanted) > 1 and "input_ids" in wanted:
            start = 0
            for batch in documents.select_columns(wanted).with_format("arrow").iter(batch_size=65536):
                if _may_mask(batch):
                    for offset, row in enumerate(batch.to_pylist()):
                        problem = mask_problem(row)
                        if problem:
                            raise ValueError(f"{where} row {start + offset} {problem}")
                start += batch.num_rows
    elif isinstance(documents, (list, tuple)):
        for i, row in enumerate(documents):
            problem = mask_problem(row) if isinstance(row, Mapping) else None
            if problem:
                raise ValueError(f"{where} row {i} {problem}")


def _may_mask(batch) -> bool:
    """Whether a ``pyarrow.Table`` of ``input_ids`` and masking columns may hold a row with a
    ``mask_problem`` (vectorised; a row may be flagged that ``mask_problem`` then passes, never missed)."""
    import pyarrow.compute as pc

    ids = batch.column("input_ids").combine_chunks()
    if ids.null_count:
        return True
    flat_ids = ids.flatten().to_numpy(zero_copy_only=False)
    for name in MASKING_COLUMNS:
        if name not in batch.column_names:
            continue
        column = batch.column(name).combine_chunks()
        if column.null_count or not pc.all(pc.equal(pc.list_value_length(column), pc.list_value_length(ids))).as_py():
            return True
        values = column.flatten().to_numpy(zero_copy_only=False)
        if name == "labels" and not np.array_equal(values, flat_ids):
            return True
        if name == "attention_mask" and (values == 0).any():
            return True
        if name == "position_ids":
            offsets = ids.offsets.to_numpy()
            within = np.arange(offsets[-1] - offsets[0]) - np.repeat(offsets[:-1] - offsets[0], np.diff(offsets))
            if not np.array_equal(values, within):
                return True
    return False


def _as_list(values) -> list:
    return values.tolist() if hasattr(values, "tolist") else list(values)


def _read_tokens(document) -> list:
    if isinstance(document, Mapping):  # as tokens_of: a dict or a BatchEncoding
        document = document["input_ids"]
    if isinstance(document, (torch.Tensor, np.ndarray)):
        return document.tolist()
    return list(document)


def tokens_of(document, what: str = "a document") -> list[int]:
    """The token ids of one document: a list, a 1-D tensor or array, or ``{"input_ids": ...}`` (whose
    other columns may not mask anything: ``mask_problem``); anything else (text, floats, ids outside 0 to
    ``MAX_COUNT``, nested lists, 2-D tensors) is refused naming ``what``."""
    if isinstance(document, Mapping):  # a dict, or a tokenizer's BatchEncoding (a UserDict)
        _require_input_ids(document.keys())
        problem = mask_problem(document)
        if problem:
            raise ValueError(f"{what} {problem}")
        document = document["input_ids"]

    def refuse(got: str) -> ValueError:
        return ValueError(f"{what} must be a 1-D sequence of integer token ids from 0 to {MAX_COUNT} (a list, a 1-D "
                          f"tensor or array, or {{'input_ids': ...}}), got {got}; {_TOKENIZE_FIRST}")

    if isinstance(document, (str, bytes)):
        raise refuse(f"text {document[:40]!r}")
    if isinstance(document, (torch.Tensor, np.ndarray)):
        integral = (not document.dtype.is_floating_point and not document.dtype.is_complex
                    and document.dtype != torch.bool) if isinstance(document, torch.Tensor) \
            else np.issubdtype(document.dtype, np.integer)
        if document.ndim != 1 or not integral:
            raise refuse(f"a {type(document).__name__} of shape {tuple(document.shape)} and dtype {document.dtype}")
        tokens = document.tolist()
    else:
        try:
            tokens = list(document)
        except TypeError:
            raise refuse(f"{type(document).__name__} {document!r:.60}") from None
        if not all(type(t) is int for t in tokens):
            for position, t in enumerate(tokens):
                if not is_integer(t):
                    raise refuse(f"{type(t).__name__} {t!r:.40} at position {position}")
            tokens = [int(t) for t in tokens]
    if tokens and (min(tokens) < 0 or max(tokens) > MAX_COUNT):
        raise refuse(f"token id {min(tokens) if min(tokens) < 0 else max(tokens)}")
    return tokens


def row_item(row: PackedRow, tokens_of_document, pad_token_id: int, full_row_tokens: int | None = None) -> dict:
    """A row as the item ``PackedCollator`` reads (a filler for an empty row: one token, or with
    ``full_row_tokens`` that many padding tokens)."""
    if not row.pieces:  # starts a document and so carries no label
        if full_row_tokens:
            return {"input_ids": [[pad_token_id] * full_row_tokens], "first_position": 0,
                    "last_label": IGNORE_INDEX, "padding": full_row_tokens}
        return {"input_ids": [[pad_token_id]], "first_position": 0, "last_label": IGNORE_INDEX}

    def tokens(piece):
        if piece.document is PADDING:
            return [pad_token_id] * (piece.end - piece.start)
        return tokens_of_document(piece.document)[piece.start:piece.end]

    pieces = [tokens(p) for p in row.pieces]
    last = row.pieces[-1]
    last_label = (tokens_of_document(last.document)[last.end] if row.continues and last.document is not PADDING
                  else IGNORE_INDEX)
    item = {"input_ids": pieces, "first_position": row.first_position, "last_label": last_label}
    if row.padding_tokens:
        item["padding"] = row.padding_tokens
    return item


class PackedDataset(torch.utils.data.Dataset):
    """Map-style dataset of packed rows, one per rank and forward.

    Args:
        documents: token-id documents: a ``datasets.Dataset`` with an ``input_ids`` column, or any
            sequence of token lists / tensors / ``{"input_ids": ...}`` dicts.
        config: the ``PackingConfig``.
        world_size: ranks sharing the epoch; the length is a multiple of it.
        span_ranks: documents span the ranks of a server group (global batches of
            ``group size * tokens_per_rank`` tokens; see ``training.packing``); ``False``: per rank.
        server_groups: with ``span_ranks``, the attention-server groups as lists of global ranks
            (default: one group of all ``world_size`` ranks); must match the groups the attention
            runtime uses (``DistCAPlugin.attach``).
        full_rows: every row has exactly ``tokens_per_rank`` tokens: a global batch's free room is
            filled with padding documents (no labels) at the end of its token stream, and filler rows
            are ``tokens_per_rank`` padding tokens (pipeline stages exchange fixed shapes).
        step_micro_batches: micro-batches (rows per rank) of one optimizer step; with
            ``config.balance_micro_batches`` the global batches of a step (``step_micro_batches`` per
            server group) are balanced for attention together.

    Item ``i`` is rank ``i % world_size``'s row (``RankLayout``); ``rows`` lists the packed rows in
    global-batch order (``PackedRow``), ``micro_batches`` their pieces; ``report`` says what
    packing did. Read it with ``GlobalBatchSampler`` (or in order) when ``span_ranks``.
    """

    def __init__(self, documents, config: PackingConfig, world_size: int = 1, *, span_ranks: bool = False,
                 server_groups=None, full_rows: bool = False, step_micro_batches: int = 1):
        if not isinstance(config, PackingConfig):
            raise TypeError(f"config must be a PackingConfig, got {type(config).__name__}")
        self.documents = documents
        self.config = config
        self.full_rows = check_flag("full_rows", full_rows)
        self.step_micro_batches = check_positive("step_micro_batches", step_micro_batches)
        self._lengths = _document_lengths(documents)
        self._set_layout(RankLayout.for_ranks(world_size, span_ranks=span_ranks, server_groups=server_groups))

    def _set_layout(self, layout: RankLayout) -> None:
        self.layout = layout
        self.rows, report = pack_rows(self._lengths, self.config, group_size=layout.group_size,
                                      full_rows=self.full_rows,
                                      step_batches=self.step_global_batches)
        filler_batches = layout.blocks(report.global_batches) * layout.num_groups - report.global_batches
        report.filler_micro_batches += filler_batches * layout.group_size
        self.report = report

    def with_layout(self, world_size: int, *, span_ranks: bool = False, server_groups=None,
                    full_rows: bool | None = None, step_micro_batches: int | None = None) -> "PackedDataset":
        """The same documents and config, packed for another layout (see the constructor; ``full_rows``,
        ``step_micro_batches`` None: as this dataset)."""
        copy = object.__new__(PackedDataset)
        copy.__dict__.update(self.__dict__)
        if full_rows is not None:
            copy.full_rows = check_flag("full_rows", full_rows)
        if step_micro_batches is not None:
            copy.step_micro_batches = check_positive("step_micro_batches", step_micro_batches)
        copy._set_layout(RankLayout.for_ranks(world_size, span_ranks=span_ranks, server_groups=server_groups))
        return copy

    @property
    def step_global_batches(self) -> int:
        """Global batches of one optimizer step (``step_micro_batches`` per server group): what
        ``config.balance_micro_batches`` balances together (nothing when 1)."""
        return getattr(self, "step_micro_batches", 1) * self.layout.num_groups

    def with_world_size(self, world_size: int) -> "PackedDataset":
        """The same packing mode for ``world_size`` ranks (spanning: one server group of all of them)."""
        return self.with_layout(world_size, span_ranks=self.layout.span_ranks)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def micro_batches(self) -> list[list[Piece]]:
        """Every row's ``(document index, start, end)`` pieces, in global-batch order (``[]``: a filler slot)."""
        return [list(row.pieces) for row in self.rows]

    def __len__(self) -> int:
        return self.layout.blocks(self.report.global_batches) * self.layout.world_size

    def __getitem__(self, index: int) -> dict:
        if not is_integer(index):  # (a slice or a float failed deep inside, a comparison or divmod)
            raise TypeError(f"PackedDataset items are read one row at a time by an integer index, got "
                            f"{type(index).__name__} {index!r}")
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} out of range ({len(self)})")
        global_batch, position = self.layout.locate(index % len(self))
        row_index = global_batch * self.layout.group_size + position
        row = self.rows[row_index] if row_index < len(self.rows) else PackedRow()
        # documents were checked when packed (``_document_lengths``): read them as they are
        return row_item(row, lambda key: _read_tokens(self.documents[key]), self.config.pad_token_id,
                     self.config.tokens_per_rank if getattr(self, "full_rows", False) else None)

    def label_tokens(self) -> int:
        """Tokens trained to predict their successor over one epoch: ``sum(length - 1)`` over the
        documents (and chunks), whatever ranks their pieces lie on."""
        return sum(row.label_tokens for row in self.rows)
