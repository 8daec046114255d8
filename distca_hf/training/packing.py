"""Documents -> packed micro-batches: one row of at most ``tokens_per_rank`` tokens per rank and forward.

Nothing is lost silently. A document longer than the budget is cut into chunks of the budget (each
trains as its own document, positions restarting at 0); the cut is counted in a ``PackingReport``.
Empty documents carry nothing to train on and are counted too. Every rank gets the same number of
micro-batches per epoch: the packed list is padded to a multiple of the world size with *filler*
micro-batches (one padding token, no label), so no rank waits alone in a collective, and every
document piece is in exactly one micro-batch, so every document is trained on exactly once per epoch.

    docs = load_documents("my_corpus.jsonl", tokenizer=tokenizer)      # training.loading: input_ids
    train = PackedDataset(docs, PackingConfig(tokens_per_rank=8192), world_size=2)
    print(train.report)

Items are ``{"input_ids": [tokens of piece 0, tokens of piece 1, ...]}``; ``PackedCollator`` turns
one into the model inputs ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` would emit.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import torch

__all__ = ["PackingConfig", "PackingReport", "PackedDataset", "StreamingPackedDataset", "PackedCollator",
           "pack_lengths", "tokens_of"]

Piece = tuple  # (document key, start, end): tokens [start, end) of one document


@dataclass(frozen=True)
class PackingConfig:
    """How documents are packed into micro-batches.

    Attributes:
        tokens_per_rank: token budget of one micro-batch (one rank, one forward).
        length_aware: ``False``: documents keep their (shuffled) order and fill micro-batches one
            after the other (next-fit). ``True``: inside each window of ``window`` documents they
            are sorted by length and packed best-fit decreasing, giving fuller micro-batches (fewer
            micro-batches per epoch) at the price of grouping documents by length.
        window: documents per sorting window for ``length_aware`` (also what streaming holds in memory).
        shuffle: shuffle the document order before packing (map-style datasets; seeded).
        seed: seed of that shuffle.
        pad_token_id: the token of filler micro-batches (never a label).
    """

    tokens_per_rank: int
    length_aware: bool = False
    window: int = 1024
    shuffle: bool = True
    seed: int = 0
    pad_token_id: int = 0

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
    """What packing did (token counts in tokens).

    Attributes:
        documents: documents read (empty ones included).
        tokens: their tokens.
        empty_documents: documents with no token (nothing to train; skipped).
        cut_documents: documents longer than ``tokens_per_rank``, cut into chunks.
        chunks: the chunks those documents became.
        micro_batches: packed micro-batches (fillers excluded).
        filler_micro_batches: fillers added so every rank gets the same number.
        longest_document: tokens of the longest document.
    """

    tokens_per_rank: int
    documents: int = 0
    tokens: int = 0
    empty_documents: int = 0
    cut_documents: int = 0
    chunks: int = 0
    micro_batches: int = 0
    filler_micro_batches: int = 0
    longest_document: int = 0

    @property
    def fill(self) -> float:
        """Fraction of the packed micro-batches' token budget holding document tokens."""
        return self.tokens / max(1, self.micro_batches * self.tokens_per_rank)

    def __str__(self) -> str:
        text = (f"{self.documents} documents, {self.tokens} tokens (longest {self.longest_document}) -> "
                f"{self.micro_batches} micro-batches of <= {self.tokens_per_rank} tokens (fill {self.fill:.1%})")
        if self.filler_micro_batches:
            text += f" + {self.filler_micro_batches} filler micro-batch(es) so every rank gets the same number"
        text += (f"; {self.cut_documents} document(s) longer than {self.tokens_per_rank} tokens cut into "
                 f"{self.chunks} chunks (each chunk trains as its own document)")
        if self.empty_documents:
            text += f"; {self.empty_documents} empty document(s) skipped"
        return text


# -- packing (pure) ---------------------------------------------------------------------------------


def _pieces_of(key, length: int, budget: int, report: PackingReport) -> Iterator[Piece]:
    """A document as pieces of at most ``budget`` tokens, counted in ``report``."""
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
        yield key, start, min(length, start + budget)


def _pack(documents: Iterable[tuple], config: PackingConfig, report: PackingReport) -> Iterator[list[Piece]]:
    """Micro-batches (lists of pieces) from ``(key, length)`` pairs, in order; see ``PackingConfig``."""
    budget = config.tokens_per_rank
    if not config.length_aware:
        current, used = [], 0
        for key, length in documents:
            for piece in _pieces_of(key, length, budget, report):
                size = piece[2] - piece[1]
                if used + size > budget:
                    yield current
                    current, used = [], 0
                current.append(piece)
                used += size
        if current:
            yield current
        return
    window: list[Piece] = []
    documents_in_window = 0
    for key, length in documents:
        window.extend(_pieces_of(key, length, budget, report))
        documents_in_window += 1
        if documents_in_window == config.window:
            yield from _best_fit_decreasing(window, budget)
            window, documents_in_window = [], 0
    yield from _best_fit_decreasing(window, budget)


def _best_fit_decreasing(pieces: list[Piece], budget: int) -> Iterator[list[Piece]]:
    """Longest piece first, each into the open micro-batch it fills best (or a new one)."""
    bins: list[list[Piece]] = []
    room: list[int] = []
    for piece in sorted(pieces, key=lambda p: p[2] - p[1], reverse=True):
        size = piece[2] - piece[1]
        best = min((i for i, r in enumerate(room) if r >= size), key=lambda i: room[i], default=None)
        if best is None:
            bins.append([piece])
            room.append(budget - size)
        else:
            bins[best].append(piece)
            room[best] -= size
    yield from bins


def pack_lengths(lengths: Sequence[int], config: PackingConfig) -> tuple[list[list[Piece]], PackingReport]:
    """Pack documents given by their lengths. Returns the micro-batches, each a list of
    ``(document index, start, end)``, and the report (no fillers: see ``PackedDataset``)."""
    order = list(range(len(lengths)))
    if config.shuffle:
        random.Random(config.seed).shuffle(order)
    report = PackingReport(config.tokens_per_rank)
    micro_batches = list(_pack(((i, int(lengths[i])) for i in order), config, report))
    report.micro_batches = len(micro_batches)
    return micro_batches, report


def fillers_for(count: int, world_size: int) -> int:
    """Filler micro-batches that make ``count`` a multiple of ``world_size``."""
    return (-count) % world_size


def _check_world(world_size) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    return world_size


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
                         "tokenize them first, e.g. with distca_hf.data.load_documents(..., tokenizer=...)")


def tokens_of(document) -> list[int]:
    """The token ids of one document: a list, a tensor or ``{"input_ids": ...}``."""
    if isinstance(document, dict):
        _require_input_ids(document.keys())
        document = document["input_ids"]
    if isinstance(document, torch.Tensor):
        document = document.tolist()
    return list(document)


class PackedDataset(torch.utils.data.Dataset):
    """Map-style dataset of packed micro-batches.

    Args:
        documents: token-id documents: a ``datasets.Dataset`` with an ``input_ids`` column, or any
            sequence of token lists / tensors / ``{"input_ids": ...}`` dicts.
        config: the ``PackingConfig``.
        world_size: ranks sharing the epoch; the length is padded to a multiple of it with fillers.

    ``len(self)`` is a multiple of ``world_size``; item ``i`` is ``{"input_ids": [piece tokens,
    ...]}``; fillers come last. ``micro_batches[i]`` lists the ``(document index, start, end)``
    pieces of item ``i``; ``report`` says what packing did.
    """

    def __init__(self, documents, config: PackingConfig, world_size: int = 1):
        if not isinstance(config, PackingConfig):
            raise TypeError(f"config must be a PackingConfig, got {type(config).__name__}")
        self.documents = documents
        self.config = config
        self.micro_batches, report = pack_lengths(_document_lengths(documents), config)
        self._base_report = report
        self.world_size = _check_world(world_size)
        self.report = self._report_for(self.world_size)

    def _report_for(self, world_size: int) -> PackingReport:
        report = PackingReport(**{k: v for k, v in vars(self._base_report).items()})
        report.filler_micro_batches = fillers_for(len(self.micro_batches), world_size)
        return report

    def with_world_size(self, world_size: int) -> "PackedDataset":
        """The same packing, padded for ``world_size`` ranks."""
        copy = object.__new__(PackedDataset)
        copy.__dict__.update(self.__dict__)
        copy.world_size = _check_world(world_size)
        copy.report = copy._report_for(copy.world_size)
        return copy

    def __len__(self) -> int:
        return len(self.micro_batches) + self.report.filler_micro_batches

    def __getitem__(self, index: int) -> dict:
        if not -len(self) <= index < len(self):
            raise IndexError(f"micro-batch {index} out of range ({len(self)})")
        index %= len(self)
        if index >= len(self.micro_batches):
            return {"input_ids": [[self.config.pad_token_id]]}  # filler: one token, and a document start has no label
        return {"input_ids": [tokens_of(self.documents[doc])[start:end]
                              for doc, start, end in self.micro_batches[index]]}

    def label_tokens(self) -> int:
        """Tokens that carry a label over one epoch (every piece's first token has none)."""
        return sum(end - start - 1 for batch in self.micro_batches for _, start, end in batch)


class StreamingPackedDataset(torch.utils.data.IterableDataset):
    """Iterable dataset that packs a stream of documents on the fly (``datasets`` streaming).

    Every rank reads the whole stream and packs it the same way (the launcher's sharding then gives
    rank ``r`` micro-batches ``r, r + W, ...``); at the end of the stream fillers make the count a
    multiple of ``world_size``. ``report`` is filled as the stream is read (in the process that
    iterates: keep ``dataloader_num_workers=0`` to read it). ``config.shuffle`` does not apply: a
    stream is read in order (shuffle the source, e.g. ``IterableDataset.shuffle(buffer_size=...)``).
    """

    def __init__(self, documents: Iterable, config: PackingConfig, world_size: int = 1):
        if not isinstance(config, PackingConfig):
            raise TypeError(f"config must be a PackingConfig, got {type(config).__name__}")
        self.documents = documents
        self.config = config
        self.world_size = _check_world(world_size)
        self.report = PackingReport(config.tokens_per_rank)

    def with_world_size(self, world_size: int) -> "StreamingPackedDataset":
        return StreamingPackedDataset(self.documents, self.config, world_size)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.documents, "set_epoch"):
            self.documents.set_epoch(epoch)

    def __iter__(self) -> Iterator[dict]:
        import torch.utils.data

        worker = torch.utils.data.get_worker_info()
        if worker is not None and worker.num_workers > 1:
            # every worker would read (and yield) the whole stream: each micro-batch num_workers times
            raise ValueError(
                f"a streaming packed dataset must be read by one DataLoader worker, got {worker.num_workers} "
                "(dataloader_num_workers); set dataloader_num_workers to 0 or 1")
        report = PackingReport(self.config.tokens_per_rank)
        self.report = report
        # The token lists themselves are the document keys: pieces slice them directly.
        stream = ((tokens, len(tokens)) for tokens in map(tokens_of, self.documents))
        count = 0
        for micro_batch in _pack(stream, self.config, report):
            count += 1
            report.micro_batches = count
            yield {"input_ids": [tokens[start:end] for tokens, start, end in micro_batch]}
        report.filler_micro_batches = fillers_for(count, self.world_size)
        for _ in range(report.filler_micro_batches):
            yield {"input_ids": [[self.config.pad_token_id]]}


# -- collator --------------------------------------------------------------------------------------


@dataclass
class PackedCollator:
    """Packed micro-batch items -> model inputs, one row.

    The pieces of all items are concatenated into one row (the trainer uses one item per rank and
    forward). Returns what ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` emits:
    ``input_ids``, ``labels``, ``position_ids`` (``[1, tokens]`` int64; positions restart at 0 per
    piece, labels are -100 at each piece start, where nothing precedes the token in its document),
    ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (``[pieces + 1]`` int32 offsets) and ``max_length_q`` /
    ``max_length_k`` (int).
    """

    def __call__(self, items: list[dict]) -> dict:
        pieces = []
        for item in items:
            if not isinstance(item, dict) or "input_ids" not in item:
                raise ValueError("PackedCollator expects items {'input_ids': [piece tokens, ...]} from a "
                                 f"PackedDataset, got {type(item).__name__}")
            pieces.extend(tokens_of(p) for p in item["input_ids"])
        if not pieces or any(len(p) == 0 for p in pieces):
            raise ValueError("PackedCollator: a micro-batch needs at least one piece and no empty piece")
        lengths = [len(p) for p in pieces]
        input_ids = torch.tensor([t for p in pieces for t in p], dtype=torch.int64).unsqueeze(0)
        position_ids = torch.cat([torch.arange(n, dtype=torch.int64) for n in lengths]).unsqueeze(0)
        labels = input_ids.clone()
        labels[position_ids == 0] = -100
        cu_seq_lens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        longest = max(lengths)
        return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids,
                "cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens,
                "max_length_q": longest, "max_length_k": longest}
