"""CA-tasks: a query shard of one document plus the K/V prefix it attends to.

A document of ``n`` tokens may be cut into query shards ``[start, end)``. Because the causal mask is
aligned bottom-right (query ``start + j`` sees keys ``0 .. start + j``), the task only needs the
K/V prefix ``[0, end)``, and any set of tasks covering a document's queries reproduces the attention
of the whole document exactly. That composability is what lets the planner move tasks anywhere.

This module also lays a list of tasks out as one fused varlen batch (``cu_seqlens_q/k`` plus the
flat token indices to gather) for the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import torch

from ..config import is_integer
from .cost import causal_pairs, key_start, tile_pairs
from .documents import PackedDocuments
from .ranges import concat_ranges

__all__ = ["CATask", "FusedBatch", "whole_document_tasks", "split_document", "fused_batch", "fuse_tasks"]


@dataclass(frozen=True)
class CATask:
    """Queries ``[q_start, q_end)`` of document ``doc``, attending to its keys ``[0, q_end)``."""

    doc: int
    q_start: int
    q_end: int

    def __post_init__(self):
        for name in ("doc", "q_start", "q_end"):  # (a float was kept as given, 2.5 tokens included)
            value = getattr(self, name)
            if not is_integer(value):
                raise TypeError(f"CATask.{name} must be an integer, got {value!r}")
            object.__setattr__(self, name, int(value))  # numpy integers as ints
        if not 0 <= self.q_start < self.q_end:
            raise ValueError(f"a CA-task needs 0 <= q_start < q_end, got [{self.q_start}, {self.q_end})")

    @property
    def num_queries(self) -> int:
        return self.q_end - self.q_start

    @property
    def kv_len(self) -> int:
        """Length of the K/V prefix the shard attends to (tokens)."""
        return self.q_end

    @property
    def pairs(self) -> int:
        """Query-key pairs computed by this task (the causal cost)."""
        return causal_pairs(self.q_start, self.q_end)


def whole_document_tasks(docs: PackedDocuments) -> list[CATask]:
    """One task per document that has queries, covering all of them (``[past, length)``); a
    key-only document (``past == length``) has none."""
    return [CATask(d, int(p), int(n)) for d, (p, n) in enumerate(zip(docs.past, docs.lengths)) if p < n]


def split_document(doc: int, first_query: int, length: int, cuts: Iterable[int]) -> list[CATask]:
    """Cut the queries ``[first_query, length)`` of a document at the given positions.

    ``cuts`` are query indices strictly inside ``(first_query, length)``; duplicates are ignored.
    """
    bounds = sorted({first_query, length, *cuts})
    if bounds[0] < first_query or bounds[-1] > length:
        raise ValueError(f"cuts {sorted(cuts)} fall outside the document's queries [{first_query}, {length})")
    return [CATask(doc, s, e) for s, e in zip(bounds[:-1], bounds[1:])]


@dataclass(frozen=True, eq=False)
class FusedBatch:
    """A list of CA-tasks laid out as one varlen batch.

    Attributes:
        q_index: ``[total_q]`` int64, flat query token (in ``PackedDocuments`` numbering) of each
            fused query row, or ``None`` when the fused rows are the query stream itself.
        k_index: ``[total_k]`` int64, flat key token of each fused K/V row, or ``None`` likewise.
        cu_seqlens_q, cu_seqlens_k: ``[num_tasks + 1]`` int32 cumulative row counts.
        max_seqlen_q, max_seqlen_k: longest query shard and K/V prefix (tokens).
        pairs: query-key pairs the batch computes.
        full: ``[num_tasks]`` bool (CPU) marking full tiles of key-split tasks (every query sees every
            key: the kernels' ``full``), which come after every causal task, or ``None`` when every
            task is bottom-right causal.
        causal_rows: ``(query rows, key rows)`` of the causal tasks when ``full`` is given (the
            kernels' ``causal_rows``: where the fused tensors' full half starts), else ``None``.
    """

    q_index: torch.Tensor | None
    k_index: torch.Tensor | None
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    pairs: int
    full: torch.Tensor | None = None
    causal_rows: tuple[int, int] | None = None

    def to(self, device) -> "FusedBatch":
        move = lambda t: None if t is None else t.to(device, non_blocking=True)
        return FusedBatch(
            move(self.q_index), move(self.k_index), move(self.cu_seqlens_q), move(self.cu_seqlens_k),
            self.max_seqlen_q, self.max_seqlen_k, self.pairs, self.full, self.causal_rows,
        )


def fused_batch(q_index, k_index, q_start, q_end, device=None, *, window: int | None = None, k_start=None,
                k_end=None) -> FusedBatch:
    """The one way a list of CA-tasks becomes a varlen batch.

    Task ``i`` has queries ``[q_start[i], q_end[i])`` of its document (``[num_tasks]`` int64 arrays)
    and the K/V prefix ``[0, q_end[i])``, or under a sliding ``window`` only the keys its queries see,
    ``[key_start(q_start[i], window), q_end[i])``. ``q_index`` / ``k_index`` are the flat rows of the
    query / key pools holding them, task after task (``[sum of shard lengths]`` / ``[sum of K/V
    lengths]`` int64), or ``None`` when the tasks already are the pools, row for row. Tensors go to
    ``device``. ``k_start`` / ``k_end``: key-split tasks' own keys (``planning.key_split``; a task whose
    keys end before its queries' end is a full tile), else whole prefixes; the batch then holds the
    causal tasks first and the full tiles after them (``FusedBatch.full``), with ``q_index`` /
    ``k_index`` reordered alike (the given order otherwise).
    """
    q_start, q_end = np.asarray(q_start, dtype=np.int64), np.asarray(q_end, dtype=np.int64)
    q_lens = q_end - q_start
    as_tensor = lambda x, dtype: None if x is None else torch.from_numpy(np.ascontiguousarray(x, dtype=dtype)).to(device)
    if k_start is not None:
        k_start, k_end = np.asarray(k_start, dtype=np.int64), np.asarray(k_end, dtype=np.int64)
        k_lens = k_end - k_start
        full = k_end < q_end
        causal_rows = None
        if full.any():
            # causal tasks first, then full ones (each in the given order), so that the kernels run
            # each kind on a slice of the fused tensors
            order = np.argsort(full, kind="stable")
            q_index = _reordered_rows(q_index, q_lens, order)
            k_index = _reordered_rows(k_index, k_lens, order)
            q_start, q_end, k_start, k_end, q_lens, k_lens, full = (x[order] for x in (q_start, q_end, k_start, k_end,
                                                                                        q_lens, k_lens, full))
            causal = ~full
            causal_rows = (int(q_lens[causal].sum()), int(k_lens[causal].sum()))
        return FusedBatch(
            as_tensor(q_index, np.int64), as_tensor(k_index, np.int64),
            as_tensor(np.concatenate(([0], np.cumsum(q_lens))), np.int32),
            as_tensor(np.concatenate(([0], np.cumsum(k_lens))), np.int32),
            int(q_lens.max(initial=0)), int(k_lens.max(initial=0)),
            int(tile_pairs(q_start, q_end, k_start, k_end, window).sum()),
            torch.from_numpy(full) if full.any() else None, causal_rows)
    k_lens = q_end - key_start(q_start, window)
    return FusedBatch(
        as_tensor(q_index, np.int64),
        as_tensor(k_index, np.int64),
        as_tensor(np.concatenate(([0], np.cumsum(q_lens))), np.int32),
        as_tensor(np.concatenate(([0], np.cumsum(k_lens))), np.int32),
        int(q_lens.max(initial=0)),
        int(k_lens.max(initial=0)),
        int(causal_pairs(q_start, q_end, window).sum()),
    )


def _reordered_rows(index, lengths: np.ndarray, order: np.ndarray) -> np.ndarray:
    """The rows of ``index`` (``[sum of lengths]``, task after task; ``None``: the rows themselves)
    with its tasks' segments in ``order``."""
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    positions = concat_ranges(starts[order], lengths[order])
    return positions if index is None else np.asarray(index, dtype=np.int64)[positions]


def fuse_tasks(tasks: Sequence[CATask], docs: PackedDocuments, device=None) -> FusedBatch:
    """Lay ``tasks`` (of the documents ``docs``) out as one varlen batch, in the given order."""
    if not tasks:
        raise ValueError("fuse_tasks needs at least one CA-task")
    doc_ids = np.fromiter((t.doc for t in tasks), dtype=np.int64, count=len(tasks))
    q_start = np.fromiter((t.q_start for t in tasks), dtype=np.int64, count=len(tasks))
    q_end = np.fromiter((t.q_end for t in tasks), dtype=np.int64, count=len(tasks))
    if doc_ids.min() < 0 or doc_ids.max() >= docs.num_docs:
        raise ValueError(f"task refers to a document outside 0..{docs.num_docs - 1}")
    past, lengths = docs.past[doc_ids], docs.lengths[doc_ids]
    if (q_start < past).any() or (q_end > lengths).any():
        bad = int(np.flatnonzero((q_start < past) | (q_end > lengths))[0])
        raise ValueError(
            f"task {tasks[bad]} asks for queries outside its document's queries "
            f"[{int(past[bad])}, {int(lengths[bad])})"
        )
    covers_in_order = (
        docs.tiles_stream
        and len(tasks) == docs.num_docs
        and np.array_equal(doc_ids, np.arange(docs.num_docs))
        and not q_start.any()
        and np.array_equal(q_end, docs.lengths)
    )
    if covers_in_order:
        return fused_batch(None, None, q_start, q_end, device)
    # Query row of task t, position j: docs.q_starts[doc] + (q_start - past) + j.
    q_index = concat_ranges(docs.q_starts[doc_ids] + (q_start - past), q_end - q_start)
    return fused_batch(q_index, concat_ranges(docs.k_starts[doc_ids], q_end), q_start, q_end, device)
