"""Packing a stream of documents on the fly (``StreamingPackedDataset``, for ``datasets`` streaming),
and ``is_streaming``: whether a dataset is read as a stream rather than by index.
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Iterable
from typing import Iterator

import numpy as np
import torch

from .dataset import refuse_columns, row_item, tokens_of
from .layout import RankLayout
from .rows import PackedRow, PackingConfig, PackingReport, global_batch_rows


class StreamingPackedDataset(torch.utils.data.IterableDataset):
    """Iterable dataset that packs a stream of documents on the fly (``datasets`` streaming).

    Every rank reads the whole stream and packs it the same way, then yields the items of every
    rank in blocks of ``world_size`` (``RankLayout``); the launcher's sharding then gives rank ``r``
    items ``r, r + W, ...``, its own row of each block. At the end of the stream fillers complete
    the last block. ``report`` is filled as the stream is read (in the process that iterates: keep
    ``dataloader_num_workers=0`` to read it). ``config.shuffle`` does not apply: a stream is read in
    order (shuffle the source with a seed, the same on every rank: ``IterableDataset.shuffle(seed=...,
    buffer_size=...)``; without one, ``datasets`` draws a different order in each process). Every rank
    must read the same stream, whole: a stream split per rank (``split_dataset_by_node``) is refused,
    and ``DistCATrainer`` compares the ranks' first documents (``stream_head_crc``) before training.
    Arguments as ``PackedDataset``.
    """

    def __init__(self, documents: Iterable, config: PackingConfig, world_size: int = 1, *,
                 span_ranks: bool = False, server_groups=None):
        if not isinstance(config, PackingConfig):
            raise TypeError(f"config must be a PackingConfig, got {type(config).__name__}")
        if not isinstance(documents, Iterable) or isinstance(documents, (str, bytes)):
            raise TypeError(f"documents must be an iterable of token-id documents (a datasets.IterableDataset, a list, "
                            f"a generator), got {type(documents).__name__}")
        refuse_columns(documents)
        split = getattr(documents, "_distributed", None)  # what datasets.distributed.split_dataset_by_node sets
        if split is not None:
            raise ValueError(f"the stream is already split per rank ({split}: split_dataset_by_node); every rank reads "
                             "the whole stream and keeps its own rows of each block, so a split one would train 1 / "
                             "world of it. Pass the stream before split_dataset_by_node")
        if config.balance_micro_batches:  # (it was ignored)
            raise ValueError("PackingConfig(balance_micro_batches=True) needs the step's documents before packing "
                             "them; a stream is packed as it is read. Use PackedDataset, or leave it False")
        self.documents = documents
        self.config = config
        self._read_once = False  # a one-shot iterator (a generator) read in an earlier epoch
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
        if iter(self.documents) is self.documents:  # an iterator: a second epoch would read nothing
            if self._read_once:
                raise ValueError("the documents are a one-shot iterator (a generator) that an earlier epoch read to "
                                 "its end, so this epoch would train nothing; pass a source that can be read again "
                                 "(a list, a datasets.IterableDataset, an object whose __iter__ starts over)")
            self._read_once = True
        layout = self.layout
        report = PackingReport(self.config.tokens_per_rank, layout.group_size)
        self.report = report
        # The token lists themselves are the document keys: pieces slice them directly.
        stream = ((tokens, len(tokens)) for tokens in (tokens_of(document, what=f"document {index} of the stream")
                                                       for index, document in enumerate(self.documents)))
        block: list[list[PackedRow]] = []
        for rows in global_batch_rows(stream, self.config, layout.group_size, report):
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
            yield row_item(row, lambda tokens: tokens, self.config.pad_token_id)


STREAM_HEAD_DOCUMENTS = 8
"""Documents at a stream's start that ``stream_head_crc`` reads."""


def stream_head_crc(documents, *, count: int = STREAM_HEAD_DOCUMENTS) -> int | None:
    """A CRC32 of the first ``count`` documents of the stream ``documents`` (their token ids and lengths, in
    order), read from a fresh iterator: what ranks compare to learn that they read one stream
    (``StreamingPackedDataset``: each reads it whole and keeps its share, so all must read the same
    documents in the same order). ``None`` for a one-shot iterator (a generator), which reading would
    consume. A shuffled ``datasets`` stream fills its shuffle buffer to give its first document."""
    if iter(documents) is documents:
        return None
    crc = 0
    for index, document in enumerate(itertools.islice(documents, count)):
        tokens = np.asarray(tokens_of(document, what=f"document {index} of the stream"), dtype=np.int64)
        crc = zlib.crc32(tokens.tobytes(), zlib.crc32(np.int64(tokens.size).tobytes(), crc))
    return crc


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
