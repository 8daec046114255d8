"""Documents -> packed rows: one row of at most ``tokens_per_rank`` tokens per rank and forward.

Two layouts (``RankLayout``):

* **Spanning** (``span_ranks=True``; ``DistCATrainer``'s default when the attention-server group has
  more than one rank). The ``G`` ranks of a server group share one *global batch* of at most
  ``G * tokens_per_rank`` tokens: its documents are laid end to end as one token stream, the stream
  is cut into ``G`` consecutive slices of equal size (they differ by at most one token, so every rank
  holds the same linear work), and the group's ``j``-th rank in rank order gets slice ``j``. A
  document of up to ``G * tokens_per_rank`` tokens is never cut: where it crosses a slice boundary,
  the next rank's row starts with its continuation (``position_ids`` go on at the number of tokens
  the earlier ranks hold; contract "documents spanning ranks") and the last token of the earlier
  piece is trained to predict the first token of the next (``shift_labels``).
* **Per rank** (``span_ranks=False``, one process): every rank's row is its own micro-batch of at
  most ``tokens_per_rank`` tokens. This is the spanning layout with groups of one rank.

Nothing is lost silently. A document longer than the whole global batch (per rank: longer than
``tokens_per_rank``) is cut into chunks of that size, each trained as its own document (positions
restarting at 0); the cut is counted in a ``PackingReport``, and so are the documents that span
ranks and the empty documents (nothing to train on). Every rank gets the same number of rows per
epoch: an empty slot (a slice of a global batch too small to reach every rank, or a whole global
batch added so that every server group gets the same number) is a *filler* row of one padding token
without a label, so no rank waits alone in a collective, and every document token is in exactly one
row, so every document is trained on exactly once per epoch.

    docs = load_documents("my_corpus.jsonl", tokenizer=tokenizer)       # training.loading: input_ids
    train = PackedDataset(docs, PackingConfig(tokens_per_rank=8192), world_size=8, span_ranks=True)
    print(train.report)

Dataset index ``i`` belongs to rank ``i % world_size`` (the order in which Accelerate shards a
dataset: with batch size 1, rank ``r`` reads items ``r, r + W, r + 2W, ...``): the ``W`` items of a
block are the slices of one global batch per server group, each at its rank's index. Shuffle whole
blocks, never single items (``GlobalBatchSampler``), so that the ranks of a group run the slices of
the same global batch in the same step.

Items are ``{"input_ids": [tokens of piece 0, tokens of piece 1, ...], "first_position": p,
"last_label": t}``; ``PackedCollator`` turns one into the model inputs
``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` would emit, plus ``shift_labels``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Iterable, Iterator, NamedTuple, Sequence

import torch

__all__ = ["PackingConfig", "PackingReport", "Piece", "PackedRow", "RankLayout", "PackedDataset", "StreamingPackedDataset",
           "GlobalBatchSampler", "PackedCollator", "pack_rows", "pack_lengths", "tokens_of", "is_streaming", "IGNORE_INDEX"]

IGNORE_INDEX = -100
"""The label of a token that is not trained (``transformers``' ``ignore_index``)."""

PADDING = "<padding>"
"""The document key of the padding that fills a global batch to ``group size * tokens_per_rank`` tokens when
rows must all have ``tokens_per_rank`` tokens (``full_rows``: pipeline stages receive fixed shapes)."""

PADDING_DOCUMENT_TOKENS = 128
"""Padding is laid out as documents of at most this many tokens: its attention cost stays small (a few
quadratic 128-token blocks) and it never forms one long document the planner would have to spread."""


class Piece(NamedTuple):
    """Tokens ``[start, end)`` of a document (offsets in tokens from the document's start)."""

    document: object  # the document's key: its index, or (streaming) its token list
    start: int
    end: int


@dataclass(frozen=True)
class PackedRow:
    """One rank's row of a global batch.

    Attributes:
        pieces: ``Piece`` s in row order; empty for a filler slot.
        first_position: position (tokens from the start of its document, or of its chunk when the
            document was cut) of the row's first token; ``> 0``: the row continues the document
            that ends the previous rank's row. Every later piece starts a document (position 0).
        continues: the row's last document goes on in the next rank's row, so its last token is
            trained to predict that row's first token.
    """

    pieces: tuple = ()
    first_position: int = 0
    continues: bool = False

    @property
    def tokens(self) -> int:
        return sum(p.end - p.start for p in self.pieces)

    @property
    def padding_tokens(self) -> int:
        """Trailing padding tokens (``full_rows``): no label, never a document's token."""
        return sum(p.end - p.start for p in self.pieces if p.document is PADDING)

    @property
    def label_tokens(self) -> int:
        """Tokens of the row that predict a successor in their document (each piece's last token has
        none, unless the document continues on the next rank); padding has none."""
        real = [p for p in self.pieces if p.document is not PADDING]
        continues = self.continues and bool(self.pieces) and self.pieces[-1].document is not PADDING
        return sum(p.end - p.start for p in real) - len(real) + int(continues)


@dataclass(frozen=True)
class PackingConfig:
    """How documents are packed into rows.

    Attributes:
        tokens_per_rank: token budget of one row (one rank, one forward).
        length_aware: ``False``: documents keep their (shuffled) order and fill global batches one
            after the other (next-fit). ``True``: inside each window of ``window`` documents they
            are sorted by length and packed best-fit decreasing into global batches, giving fuller
            rows (fewer per epoch) at the price of grouping documents by length.
        window: documents per sorting window for ``length_aware`` (also what streaming holds in memory).
        shuffle: shuffle the document order before packing (map-style datasets; seeded).
        seed: seed of that shuffle.
        pad_token_id: the token of filler rows (never a label).
        balance_micro_batches: the global batches of one optimizer step (``micro_batches`` per server
            group, ``PackedDataset(step_micro_batches=...)``: ``DistCATrainer`` in pipeline stages passes its
            micro-batches per step) are packed
            again so that none holds much more attention than the others
            (``planning.balance_micro_batches``, at equal tokens): the cheap balance of a step's
            micro-batches any user can do, before CAD balances the ranks inside each. A document is
            never cut for it (a step whose balance would cut one keeps its in-order packing, counted
            in ``PackingReport.unbalanced_steps``).
    """

    tokens_per_rank: int
    length_aware: bool = False
    window: int = 1024
    shuffle: bool = True
    seed: int = 0
    pad_token_id: int = 0
    balance_micro_batches: bool = False

    def __post_init__(self):
        if isinstance(self.tokens_per_rank, bool) or not isinstance(self.tokens_per_rank, int) \
                or self.tokens_per_rank < 2:
            raise ValueError(f"tokens_per_rank must be an integer >= 2, got {self.tokens_per_rank!r}")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window must be an integer >= 1 (documents), got {self.window!r}")
        if isinstance(self.pad_token_id, bool) or not isinstance(self.pad_token_id, int) or self.pad_token_id < 0:
            raise ValueError(f"pad_token_id must be a token id >= 0, got {self.pad_token_id!r}")


@dataclass
class PackingReport:
    """What packing did (counts of documents, rows and tokens).

    Attributes:
        tokens_per_rank: the row budget (tokens).
        group_size: ranks sharing one global batch (1: every rank packs its own row).
        documents: documents read (empty ones included).
        tokens: their tokens.
        empty_documents: documents with no token (nothing to train; skipped).
        cut_documents: documents longer than a global batch (``group_size * tokens_per_rank``
            tokens), cut into chunks that train as their own documents.
        chunks: the chunks those documents became.
        spanning_documents: documents whose tokens lie on more than one rank (a chunk of a cut
            document counts as one document); each trains whole, its pieces attending to their prefix.
        global_batches: packed global batches of ``group_size`` rows (fillers excluded).
        micro_batches: rows holding document tokens.
        filler_micro_batches: filler rows (one padding token, no label): slots of a global batch too
            small to reach every rank, and the rows of global batches added so every rank gets the
            same number.
        longest_document: tokens of the longest document.
        balanced_steps: optimizer steps whose global batches were packed balanced for attention
            (``PackingConfig.balance_micro_batches``).
        unbalanced_steps: steps kept in order because balancing them would have cut a document.
    """

    tokens_per_rank: int
    group_size: int = 1
    documents: int = 0
    tokens: int = 0
    empty_documents: int = 0
    cut_documents: int = 0
    chunks: int = 0
    spanning_documents: int = 0
    global_batches: int = 0
    micro_batches: int = 0
    filler_micro_batches: int = 0
    longest_document: int = 0
    balanced_steps: int = 0
    unbalanced_steps: int = 0

    @property
    def global_batch_tokens(self) -> int:
        """Token budget of one global batch: the longest document trained whole."""
        return self.group_size * self.tokens_per_rank

    @property
    def fill(self) -> float:
        """Fraction of the packed global batches' token budget holding document tokens."""
        return self.tokens / max(1, self.global_batches * self.global_batch_tokens)

    def __str__(self) -> str:
        head = f"{self.documents} documents, {self.tokens} tokens (longest {self.longest_document}) -> "
        if self.group_size == 1:
            text = head + (f"{self.micro_batches} micro-batches of <= {self.tokens_per_rank} tokens "
                           f"(fill {self.fill:.1%})")
        else:
            text = head + (f"{self.global_batches} global batches of {self.group_size} x {self.tokens_per_rank} "
                           f"tokens (fill {self.fill:.1%})")
        if self.filler_micro_batches:
            text += f" + {self.filler_micro_batches} filler micro-batch(es) so every rank gets the same number"
        if self.group_size > 1:
            text += (f"; {self.spanning_documents} document(s) span ranks (trained whole, up to "
                     f"{self.global_batch_tokens} tokens)")
        text += (f"; {self.cut_documents} document(s) longer than {self.global_batch_tokens} tokens cut into "
                 f"{self.chunks} chunks (each chunk trains as its own document)")
        if self.empty_documents:
            text += f"; {self.empty_documents} empty document(s) skipped"
        if self.balanced_steps or self.unbalanced_steps:
            text += (f"; {self.balanced_steps} of {self.balanced_steps + self.unbalanced_steps} steps' micro-batches "
                     "balanced for attention")
        return text


# -- packing (pure) ---------------------------------------------------------------------------------


class _Sequence(NamedTuple):
    """What trains as one document: a whole document, or a chunk of one cut to fit a global batch."""

    document: object
    start: int
    end: int


def _sequences_of(key, length: int, budget: int, report: PackingReport) -> Iterator[_Sequence]:
    """A document as sequences of at most ``budget`` tokens (chunks when longer), counted in ``report``."""
    report.documents += 1
    report.tokens += length
    report.longest_document = max(report.longest_document, length)
    if length == 0:
        report.empty_documents += 1
        return
    if length > budget:
        report.cut_documents += 1
        report.chunks += -(-length // budget)
    for start in range(0, length, budget):
        yield _Sequence(key, start, min(length, start + budget))


def _global_batches(documents: Iterable[tuple], config: PackingConfig, budget: int,
                    report: PackingReport) -> Iterator[list[_Sequence]]:
    """Global batches (lists of sequences, at most ``budget`` tokens each) from ``(key, length)``
    pairs, in order; see ``PackingConfig``."""
    if not config.length_aware:
        current, used = [], 0
        for key, length in documents:
            for sequence in _sequences_of(key, length, budget, report):
                size = sequence.end - sequence.start
                if used + size > budget:
                    yield current
                    current, used = [], 0
                current.append(sequence)
                used += size
        if current:
            yield current
        return
    window: list[_Sequence] = []
    documents_in_window = 0
    for key, length in documents:
        window.extend(_sequences_of(key, length, budget, report))
        documents_in_window += 1
        if documents_in_window == config.window:
            yield from _best_fit_decreasing(window, budget)
            window, documents_in_window = [], 0
    yield from _best_fit_decreasing(window, budget)


def _best_fit_decreasing(sequences: list[_Sequence], budget: int) -> Iterator[list[_Sequence]]:
    """Longest sequence first, each into the open global batch it fills best (or a new one)."""
    bins: list[list[_Sequence]] = []
    room: list[int] = []
    for sequence in sorted(sequences, key=lambda s: s.end - s.start, reverse=True):
        size = sequence.end - sequence.start
        best = min((i for i, r in enumerate(room) if r >= size), key=lambda i: room[i], default=None)
        if best is None:
            bins.append([sequence])
            room.append(budget - size)
        else:
            bins[best].append(sequence)
            room[best] -= size
    yield from bins


def _balanced_steps(global_batches: Iterator[list[_Sequence]], step_batches: int, budget: int,
                    report: PackingReport) -> Iterator[list[_Sequence]]:
    """``global_batches`` in groups of ``step_batches`` (one optimizer step), each group's sequences
    packed again into as many global batches balanced for attention pairs
    (``planning.balance_micro_batches``); a group whose balanced packing would cut a sequence stays
    as it was."""
    from ..planning import balance_micro_batches

    def balanced(step: list[list[_Sequence]]) -> list[list[_Sequence]]:
        sequences = [s for batch in step for s in batch]
        pieces = balance_micro_batches([s.end - s.start for s in sequences], micro_batches=len(step),
                                       tokens=budget)
        if len(pieces.doc) != len(sequences):  # a sequence was cut over two global batches
            report.unbalanced_steps += 1
            return step
        report.balanced_steps += 1
        rows: list[list[_Sequence]] = [[] for _ in step]
        for row, index in sorted(zip(pieces.rank.tolist(), pieces.doc.tolist())):
            rows[row].append(sequences[index])
        return rows

    step: list[list[_Sequence]] = []
    for batch in global_batches:
        step.append(batch)
        if len(step) == step_batches:
            yield from balanced(step)
            step = []
    if step:
        yield from balanced(step)


def _slice(global_batch: list[_Sequence], group_size: int, report: PackingReport) -> list[PackedRow]:
    """The ``group_size`` rows of one global batch: its token stream cut into consecutive slices whose
    sizes differ by at most one token (earlier ranks take the extra ones; a slice is empty only when
    the batch holds fewer tokens than ranks)."""
    total = sum(s.end - s.start for s in global_batch)
    sizes = [total // group_size + (rank < total % group_size) for rank in range(group_size)]
    rows = []
    current, head = 0, 0  # the sequence being placed, and how many of its tokens earlier rows took
    for size in sizes:
        pieces, first_position = [], head
        while size > 0:
            sequence = global_batch[current]
            start = sequence.start + head
            take = min(size, sequence.end - start)
            pieces.append(Piece(sequence.document, start, start + take))
            size -= take
            head += take
            if start + take == sequence.end:
                if head > take and sequence.document is not PADDING:  # earlier rows hold some of it: it spans ranks
                    report.spanning_documents += 1
                current, head = current + 1, 0
        rows.append(PackedRow(tuple(pieces), first_position if pieces else 0, continues=head > 0))
    return rows


def _rows(documents: Iterable[tuple], config: PackingConfig, group_size: int,
          report: PackingReport, full_rows: bool = False, step_batches: int = 1) -> Iterator[list[PackedRow]]:
    """Every global batch's ``group_size`` rows, in order, counted in ``report``; with ``full_rows`` each
    global batch is filled up with padding documents so that every row has ``tokens_per_rank`` tokens;
    with ``config.balance_micro_batches`` every ``step_batches`` global batches are balanced together."""
    budget = group_size * config.tokens_per_rank
    global_batches = _global_batches(documents, config, budget, report)
    if config.balance_micro_batches and step_batches > 1:
        global_batches = _balanced_steps(global_batches, step_batches, budget, report)
    for global_batch in global_batches:
        if full_rows:
            free = budget - sum(s.end - s.start for s in global_batch)
            global_batch = global_batch + [_Sequence(PADDING, start, min(free, start + PADDING_DOCUMENT_TOKENS))
                                           for start in range(0, free, PADDING_DOCUMENT_TOKENS)]
        rows = _slice(global_batch, group_size, report)
        report.global_batches += 1
        report.micro_batches += sum(1 for row in rows if row.pieces)
        report.filler_micro_batches += sum(1 for row in rows if not row.pieces)
        yield rows


def pack_rows(lengths: Sequence[int], config: PackingConfig, *, group_size: int = 1, full_rows: bool = False,
              step_batches: int = 1) -> tuple[list[PackedRow], PackingReport]:
    """Pack documents given by their lengths (tokens) into global batches of ``group_size`` rows.

    Returns the rows, global batch ``g``'s slice ``j`` at index ``g * group_size + j`` (an empty row
    is a filler slot), and the report. The documents' order is shuffled first when
    ``config.shuffle``; pieces name documents by their index in ``lengths``. ``full_rows``: every row
    has exactly ``tokens_per_rank`` tokens, the free room of a global batch filled with padding
    documents (key ``PADDING``, no labels) at the end of its token stream. ``step_batches``: global
    batches per optimizer step, balanced together when ``config.balance_micro_batches``."""
    group_size = _check_positive("group_size", group_size)
    order = list(range(len(lengths)))
    if config.shuffle:
        random.Random(config.seed).shuffle(order)
    report = PackingReport(config.tokens_per_rank, group_size)
    rows = [row for batch in _rows(((i, int(lengths[i])) for i in order), config, group_size, report, full_rows,
                                   step_batches) for row in batch]
    return rows, report


def pack_lengths(lengths: Sequence[int], config: PackingConfig) -> tuple[list[list[Piece]], PackingReport]:
    """Per-rank packing (each row its own micro-batch): the micro-batches, each a list of
    ``(document index, start, end)``, and the report (no fillers: see ``PackedDataset``)."""
    rows, report = pack_rows(lengths, config, group_size=1)
    return [list(row.pieces) for row in rows], report


def _check_positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


# -- which rank gets which row ----------------------------------------------------------------------


@dataclass(frozen=True)
class RankLayout:
    """Which rank trains which row of which global batch.

    Attributes:
        server_groups: the attention-server groups, a partition of ranks ``0 .. world_size - 1``
            into groups of equal size, each in rank order. The ranks of a group hold consecutive
            slices of one global batch; per-rank packing is groups of one rank.
        span_ranks: whether documents span the ranks of a group (``False``: groups of one rank).

    Dataset index ``i`` is rank ``i % world_size``'s; block ``b = i // world_size`` holds global
    batches ``b * num_groups + k``, the ``k``-th server group's.
    """

    server_groups: tuple
    span_ranks: bool
    _slots: dict = field(init=False, repr=False, compare=False)

    @classmethod
    def for_ranks(cls, world_size: int, *, span_ranks: bool = False, server_groups=None) -> "RankLayout":
        """The layout of ``world_size`` ranks. With ``span_ranks``, ``server_groups`` (lists of global
        ranks) default to one group of every rank; without it each rank is its own group (and
        ``server_groups`` is ignored)."""
        world_size = _check_positive("world_size", world_size)
        if not isinstance(span_ranks, bool):
            raise ValueError(f"span_ranks must be True or False, got {span_ranks!r}")
        if not span_ranks:
            return cls(tuple((rank,) for rank in range(world_size)), False)
        if server_groups is None:
            return cls((tuple(range(world_size)),), True)
        try:
            groups = tuple(tuple(sorted(int(rank) for rank in group)) for group in server_groups)
        except (TypeError, ValueError):
            raise ValueError(f"server_groups must be lists of ranks, got {server_groups!r}") from None
        ranks = sorted(rank for group in groups for rank in group)
        if ranks != list(range(world_size)):
            raise ValueError(f"server_groups must hold every rank 0 .. {world_size - 1} exactly once (world_size "
                             f"{world_size}), got {server_groups!r}")
        if len({len(group) for group in groups}) != 1:
            raise ValueError(f"server_groups must all have the same number of ranks (each shares a global batch of "
                             f"that many rows), got sizes {[len(g) for g in groups]}")
        return cls(groups, True)

    def __post_init__(self):
        slots = {rank: (k, j) for k, group in enumerate(self.server_groups) for j, rank in enumerate(group)}
        object.__setattr__(self, "_slots", slots)

    @property
    def world_size(self) -> int:
        return len(self._slots)

    @property
    def group_size(self) -> int:
        return len(self.server_groups[0])

    @property
    def num_groups(self) -> int:
        return len(self.server_groups)

    def slot(self, rank: int) -> tuple[int, int]:
        """``(group index, position in the group)`` of ``rank``."""
        return self._slots[rank]

    def locate(self, index: int) -> tuple[int, int]:
        """``(global batch, slice)`` of dataset index ``index``."""
        block, rank = divmod(index, self.world_size)
        group, position = self._slots[rank]
        return block * self.num_groups + group, position

    def blocks(self, global_batches: int) -> int:
        """Blocks of ``world_size`` items holding ``global_batches`` (the last padded with fillers)."""
        return -(-global_batches // self.num_groups)


# -- datasets --------------------------------------------------------------------------------------


def _document_lengths(documents) -> list[int]:
    try:
        import datasets

        if isinstance(documents, datasets.Dataset):
            _require_input_ids(documents.column_names)
            return [len(ids) for batch in documents.iter(batch_size=1024) for ids in batch["input_ids"]]
    except ImportError:
        pass
    return [len(tokens_of(documents[i])) for i in range(len(documents))]


def _require_input_ids(columns) -> None:
    if "input_ids" not in columns:
        raise ValueError(f"the documents need an 'input_ids' column (token ids), found {list(columns)}; "
                         "tokenize them first, e.g. with distca_hf.training.load_documents(..., tokenizer=...)")


def tokens_of(document) -> list[int]:
    """The token ids of one document: a list, a tensor or ``{"input_ids": ...}``."""
    if isinstance(document, dict):
        _require_input_ids(document.keys())
        document = document["input_ids"]
    if isinstance(document, torch.Tensor):
        document = document.tolist()
    return list(document)


def _item(row: PackedRow, tokens_of_document, pad_token_id: int, full_row_tokens: int | None = None) -> dict:
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
            ``group size * tokens_per_rank`` tokens; see the module docstring); ``False``: per rank.
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
        self.full_rows = bool(full_rows)
        self.step_micro_batches = _check_positive("step_micro_batches", step_micro_batches)
        self._lengths = _document_lengths(documents)
        self._set_layout(RankLayout.for_ranks(world_size, span_ranks=span_ranks, server_groups=server_groups))

    def _set_layout(self, layout: RankLayout) -> None:
        self.layout = layout
        self.rows, report = pack_rows(self._lengths, self.config, group_size=layout.group_size,
                                      full_rows=self.full_rows,
                                      step_batches=getattr(self, "step_micro_batches", 1) * layout.num_groups)
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
            copy.full_rows = bool(full_rows)
        if step_micro_batches is not None:
            copy.step_micro_batches = _check_positive("step_micro_batches", step_micro_batches)
        copy._set_layout(RankLayout.for_ranks(world_size, span_ranks=span_ranks, server_groups=server_groups))
        return copy

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
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} out of range ({len(self)})")
        global_batch, position = self.layout.locate(index % len(self))
        row_index = global_batch * self.layout.group_size + position
        row = self.rows[row_index] if row_index < len(self.rows) else PackedRow()
        return _item(row, lambda key: tokens_of(self.documents[key]), self.config.pad_token_id,
                     self.config.tokens_per_rank if getattr(self, "full_rows", False) else None)

    def label_tokens(self) -> int:
        """Tokens trained to predict their successor over one epoch: ``sum(length - 1)`` over the
        documents (and chunks), whatever ranks their pieces lie on."""
        return sum(row.label_tokens for row in self.rows)


class StreamingPackedDataset(torch.utils.data.IterableDataset):
    """Iterable dataset that packs a stream of documents on the fly (``datasets`` streaming).

    Every rank reads the whole stream and packs it the same way, then yields the items of every
    rank in blocks of ``world_size`` (``RankLayout``); the launcher's sharding then gives rank ``r``
    items ``r, r + W, ...``, its own row of each block. At the end of the stream fillers complete
    the last block. ``report`` is filled as the stream is read (in the process that iterates: keep
    ``dataloader_num_workers=0`` to read it). ``config.shuffle`` does not apply: a stream is read in
    order (shuffle the source, e.g. ``IterableDataset.shuffle(buffer_size=...)``). Arguments as
    ``PackedDataset``.
    """

    def __init__(self, documents: Iterable, config: PackingConfig, world_size: int = 1, *,
                 span_ranks: bool = False, server_groups=None):
        if not isinstance(config, PackingConfig):
            raise TypeError(f"config must be a PackingConfig, got {type(config).__name__}")
        self.documents = documents
        self.config = config
        self.layout = RankLayout.for_ranks(world_size, span_ranks=span_ranks, server_groups=server_groups)
        self.report = PackingReport(config.tokens_per_rank, self.layout.group_size)

    def with_layout(self, world_size: int, *, span_ranks: bool = False, server_groups=None):
        return StreamingPackedDataset(self.documents, self.config, world_size, span_ranks=span_ranks,
                                      server_groups=server_groups)

    def with_world_size(self, world_size: int) -> "StreamingPackedDataset":
        return self.with_layout(world_size, span_ranks=self.layout.span_ranks)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.documents, "set_epoch"):
            self.documents.set_epoch(epoch)

    def __iter__(self) -> Iterator[dict]:
        import torch.utils.data

        worker = torch.utils.data.get_worker_info()
        if worker is not None and worker.num_workers > 1:
            # every worker would read (and yield) the whole stream: each row num_workers times
            raise ValueError(
                f"a streaming packed dataset must be read by one DataLoader worker, got {worker.num_workers} "
                "(dataloader_num_workers); set dataloader_num_workers to 0 or 1")
        layout = self.layout
        report = PackingReport(self.config.tokens_per_rank, layout.group_size)
        self.report = report
        # The token lists themselves are the document keys: pieces slice them directly.
        stream = ((tokens, len(tokens)) for tokens in map(tokens_of, self.documents))
        block: list[list[PackedRow]] = []
        for rows in _rows(stream, self.config, layout.group_size, report):
            block.append(rows)
            if len(block) == layout.num_groups:
                yield from self._block_items(block)
                block = []
        if block:
            report.filler_micro_batches += (layout.num_groups - len(block)) * layout.group_size
            yield from self._block_items(block)

    def _block_items(self, block: list[list[PackedRow]]) -> Iterator[dict]:
        """One block's items in rank order (global batches missing at the end of the stream: fillers)."""
        for rank in range(self.layout.world_size):
            group, position = self.layout.slot(rank)
            row = block[group][position] if group < len(block) else PackedRow()
            yield _item(row, lambda tokens: tokens, self.config.pad_token_id)


class GlobalBatchSampler(torch.utils.data.Sampler):
    """Indices of a ``PackedDataset`` in whole blocks of ``world_size`` items (one global batch per
    server group), the blocks shuffled per epoch, never the items inside them.

    Under Accelerate's sharding (batch size 1: rank ``r`` takes every ``world_size``-th index from
    ``r``) the ranks of a server group then read the slices of the same global batch in the same
    step, each its own. The order is a pure function of ``seed`` and the epoch (``set_epoch``), so a
    run resumed mid-epoch reads what the uninterrupted run read.

    Args:
        num_items: the dataset's length (a multiple of ``world_size``).
        world_size: ranks of the job.
        shuffle: shuffle the blocks (``False``: in order).
        seed: seed of the shuffle; epoch ``e`` uses ``seed + e``.
        step_blocks: consecutive blocks shuffled as one unit, in order (the micro-batches of one
            optimizer step packed together, ``PackingConfig.balance_micro_batches``).
    """

    def __init__(self, num_items: int, world_size: int, *, shuffle: bool = True, seed: int = 0,
                 step_blocks: int = 1):
        world_size = _check_positive("world_size", world_size)
        step_blocks = _check_positive("step_blocks", step_blocks)
        if num_items % (world_size * step_blocks):
            raise ValueError(f"num_items ({num_items}) must be a multiple of world_size x step_blocks ({world_size} x "
                             f"{step_blocks}): a PackedDataset packed for this world size is")
        self.num_items, self.world_size, self.shuffle, self.seed = num_items, world_size, shuffle, seed
        self.step_blocks = step_blocks
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def block_order(self) -> list[int]:
        blocks = self.num_items // self.world_size
        if not self.shuffle:
            return list(range(blocks))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        if self.step_blocks == 1:
            return torch.randperm(blocks, generator=generator).tolist()
        units = torch.randperm(blocks // self.step_blocks, generator=generator).tolist()
        return [unit * self.step_blocks + b for unit in units for b in range(self.step_blocks)]

    def __iter__(self) -> Iterator[int]:
        for block in self.block_order():
            yield from range(block * self.world_size, (block + 1) * self.world_size)

    def __len__(self) -> int:
        return self.num_items


# -- collator --------------------------------------------------------------------------------------


@dataclass
class PackedCollator:
    """Packed row items -> model inputs, one row.

    The pieces of all items are concatenated into one row (the trainer uses one item per rank and
    forward). Returns what ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` emits, plus
    ``shift_labels``, for a row of ``N`` tokens:

    * ``input_ids``, ``position_ids``, ``labels``, ``shift_labels``: ``[1, N]`` int64. Positions
      restart at 0 per piece, except that the row's first piece starts at the item's
      ``first_position`` (it continues a document from the previous rank). ``labels`` are the
      tokens, -100 where a document starts (nothing precedes the token in its document).
      ``shift_labels[i]`` is the target of token ``i``: token ``i + 1`` when it belongs to the same
      document, else -100; for the row's last token, the item's ``last_label`` (the first token of
      the next rank's row when the document continues there). This is what transformers' causal-LM
      loss uses when given (every token with a successor in its document is trained once, the rank
      boundaries included).
    * ``cu_seq_lens_q`` / ``cu_seq_lens_k``: ``[pieces + 1]`` int32 offsets of the row's local pieces
      (a continuing piece is the row's first "document", with its local length);
      ``max_length_q`` / ``max_length_k``: the longest piece (int).

    Items without ``first_position`` / ``last_label`` are whole documents. An item's ``padding``
    (``PackedDataset(full_rows=True)``) counts its trailing padding tokens: their ``labels`` and
    ``shift_labels`` are -100.
    """

    def __call__(self, items: list[dict]) -> dict:
        pieces: list[list[int]] = []
        first_position, last_label, padding = 0, IGNORE_INDEX, 0
        for index, item in enumerate(items):
            if not isinstance(item, dict) or "input_ids" not in item:
                raise ValueError("PackedCollator expects items {'input_ids': [piece tokens, ...]} from a "
                                 f"PackedDataset, got {type(item).__name__}")
            position, label = int(item.get("first_position", 0)), int(item.get("last_label", IGNORE_INDEX))
            if position < 0 or (position > 0 and (index > 0 or not item["input_ids"])):
                raise ValueError(f"PackedCollator: item {index} has first_position={position}; only the row's first "
                                 "piece can continue a document (first_position > 0), and positions are >= 0")
            if label != IGNORE_INDEX and (label < 0 or index < len(items) - 1 or not item["input_ids"]):
                raise ValueError(f"PackedCollator: item {index} has last_label={label}; only the row's last piece can "
                                 "continue on the next rank, and its label is a token id >= 0")
            if index == 0:
                first_position = position
            last_label = label
            pieces.extend(tokens_of(p) for p in item["input_ids"])
            padding = int(item.get("padding", 0))
            if padding and (index < len(items) - 1 or label != IGNORE_INDEX):
                raise ValueError(f"PackedCollator: item {index} has padding={padding}; only the row's last item can "
                                 "end in padding, and padding has no label (last_label -100)")
        if not pieces or any(len(p) == 0 for p in pieces):
            raise ValueError("PackedCollator: a row needs at least one piece and no empty piece")
        lengths = [len(p) for p in pieces]
        input_ids = torch.tensor([t for p in pieces for t in p], dtype=torch.int64).unsqueeze(0)
        starts = [first_position] + [0] * (len(pieces) - 1)
        position_ids = torch.cat([torch.arange(s, s + n, dtype=torch.int64)
                                  for s, n in zip(starts, lengths)]).unsqueeze(0)
        labels = input_ids.clone()
        labels[position_ids == 0] = IGNORE_INDEX
        if padding:
            labels[:, -padding:] = IGNORE_INDEX
        shift_labels = torch.cat([labels[:, 1:], torch.tensor([[last_label]], dtype=torch.int64)], dim=1)
        cu_seq_lens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        longest = max(lengths)
        return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids,
                "cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens,
                "max_length_q": longest, "max_length_k": longest, "shift_labels": shift_labels}


def is_streaming(dataset) -> bool:
    """Whether ``dataset`` is read as a stream (a torch ``IterableDataset``, ``StreamingPackedDataset``
    included, or a ``datasets`` streaming dataset) rather than by index."""
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return True
    try:
        import datasets

        return isinstance(dataset, datasets.IterableDataset)
    except ImportError:
        return False
