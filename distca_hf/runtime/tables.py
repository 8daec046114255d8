"""Index tables of one wave of a dispatch: which local rows each rank sends where, and how a server
finds each CA-task's query and K/V rows among its own and the received ones.

Pure index arithmetic over a plan (numpy), turned into device tensors once per forward and reused
by every layer. Rows are tokens of this rank's flattened ``batch * seq`` streams.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..planning import (FusedBatch, PackedDocuments, Plan, QuerySends, concat_ranges, fused_batch, key_start,
                        query_sends)
from ..planning.relay_trees import sends_rounds
from ..planning.transfers import RangeSends

__all__ = ["DispatchCounters", "LocalDocuments", "RelayRound", "Wave", "build_wave", "kv_store_tables"]


@dataclass(eq=False)
class DispatchCounters:
    """What this rank moved and kept in one forward, over all layers and waves (bytes)."""

    bytes_sent: dict = field(default_factory=dict)  # by collective kind
    saved_bytes: int = 0


@dataclass(eq=False)
class RelayRound:
    """One K/V exchange round beyond the first of a wave whose plan relays K/V (``planning.relay_trees``),
    on this rank: ``send_rows`` (``[rows]`` int64 tensor) the rows of this rank's K/V pool it forwards,
    grouped by destination in rank order, ``send_counts`` / ``recv_counts`` the rows to / from each rank.
    What arrives is appended to the pool, so a later round may forward it."""

    send_rows: torch.Tensor
    send_counts: list[int]
    recv_counts: list[int]


@dataclass(eq=False)
class Wave:
    """One rank's index tables for one plan, or one wave of it (tensors on the compute device).

    Source side: ``send_q_rows`` / ``send_kv_rows`` are local token rows to send, grouped by
    destination in rank order, ``send_q_counts`` / ``send_kv_counts`` the rows per destination.
    Server side: ``recv_q_counts`` / ``recv_kv_counts`` rows from each source; the *pools* are
    ``[local rows] ++ [received rows, by source]`` (then, with relays, each later round's rows,
    ``relays``); ``served`` is the fused batch of the CA-tasks
    this rank computes, its ``q_index`` / ``k_index`` picking query and K/V prefix rows from the pools.
    ``local_only``: no rank sends anything in this wave (the same on every rank), so no collective
    runs. ``kv_window``: the sliding window the tasks' K/V were cut to (``None``: whole prefixes);
    a layer may run a window up to it, never a wider one. ``num_local`` / ``num_local_kv``: rows of the local query / key streams (they differ when a
    nano-batch holds a cut document's prefix K/V without its queries). ``q_identity`` / ``k_identity``:
    ``served.q_index`` / ``k_index`` pick every row of the query / K/V pool once, in order (a server
    computing whole pools, as a pipeline tick's often does), so the server uses the pools as they are
    and its outputs and gradients are the pools, with no gather and no scatter (never with ``merges``). ``merges``: the plan splits keys
    (``planning.key_split``), so a query row may get several partial outputs, from this wave's tasks
    and from other waves and servers: they are merged by log-sum-exp at the source, and backward
    runs every task with the merged output and log-sum-exp (the same on every rank: the plan is).
    """

    world: int
    rank: int
    num_local: int
    num_local_kv: int
    send_q_rows: torch.Tensor
    send_q_counts: list[int]
    send_kv_rows: torch.Tensor
    send_kv_counts: list[int]
    recv_q_counts: list[int]
    recv_kv_counts: list[int]
    served: FusedBatch
    local_only: bool = False
    kv_window: int | None = None
    merges: bool = False
    q_identity: bool = False
    k_identity: bool = False
    group: object = None
    timeout_s: float = 600.0
    backward_mode: str = "saved"
    forward_number: int = 0
    name: str = "all"
    counters: DispatchCounters = field(default_factory=DispatchCounters)
    keep_kv_rows: torch.Tensor | None = None
    """``saved`` mode with several waves (``kv_store_tables``): the rows of this wave's received K/V
    kept for backward (those no earlier wave brought; ``None``: all of them)."""
    relays: list[RelayRound] = field(default_factory=list)
    """The K/V exchange rounds after the first (``RelayRound``), the same number on every rank: empty
    unless the plan relays K/V (``Plan.relays``). The first round's K/V are ``send_kv_rows`` /
    ``recv_kv_counts``; the K/V pool is ``[local rows] ++ [round 1's rows, by source] ++ [round 2's,
    by source] ++ ...``."""
    kv_store_rows: torch.Tensor | None = None
    """``[num_local_kv + received]`` row of each K/V pool row in the dispatch's K/V store (``[local
    rows] ++ [every wave's kept rows, in wave order]``), from which backward rebuilds the pool;
    ``None``: the wave keeps its own pool (one wave), or its pool is the local rows (no exchange)."""
    buffers: dict = field(default_factory=dict)  # send/receive buffers shared by the forward's layers

    @property
    def num_tasks(self) -> int:
        return int(self.served.cu_seqlens_q.numel()) - 1


@dataclass(frozen=True, eq=False)
class LocalDocuments:
    """This rank's documents as the plan numbers them.

    Attributes:
        docs: the rank's ``PackedDocuments`` (rows of its local query and key streams).
        global_ids: ``[num_docs]`` int64 global id of each local document (distinct).
        offsets: ``[num_docs]`` int64 position, in its document, of each local document's first key
            token (non-zero for a piece that continues a document from the previous rank).
    """

    docs: PackedDocuments
    global_ids: np.ndarray
    offsets: np.ndarray

    def local_index(self, global_ids: np.ndarray) -> np.ndarray:
        """Local document index of each of ``global_ids`` (which this rank must hold)."""
        order = np.argsort(self.global_ids, kind="stable")
        return order[np.searchsorted(self.global_ids[order], global_ids)]

    def query_rows(self, local: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Local query row of the first of ``positions`` (in the document) of local documents ``local``."""
        d = self.docs
        return d.q_starts[local] + positions - self.offsets[local] - d.past[local]

    def key_rows(self, local: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Local key row of ``positions`` (in the document) of local documents ``local``."""
        return self.docs.k_starts[local] + positions - self.offsets[local]


def build_wave(plan: Plan, kv: RangeSends, local: LocalDocuments, rank: int, device, *,
               sends: QuerySends | None = None, **settings) -> Wave:
    """Index tables of ``plan`` for ``rank``, whose documents are ``local``; ``kv`` is
    ``relay_trees.plan_kv_sends(plan, pieces)`` (direct ``KVTransfers``, or ``RelaySends`` along the
    plan's relay trees), ``sends`` ``query_sends(plan)`` (made here when not given). ``settings`` are
    ``Wave``'s optional fields."""
    as_tensor = lambda x: torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64)).to(device)
    sends = sends if sends is not None else query_sends(plan)
    send_q_rows, send_q_counts, send_kv_rows, send_kv_counts = _source_tables(plan, sends, kv, local, rank)
    recv_q_counts, recv_kv_counts, served, q_identity, k_identity, segments = _server_tables(plan, sends, kv, local,
                                                                                            rank, device)
    relays = [RelayRound(as_tensor(rows), send_counts, recv_counts)
              for rows, send_counts, recv_counts in _relay_tables(kv, segments, rank, plan.num_ranks)]
    docs = local.docs
    return Wave(world=plan.num_ranks, rank=rank, num_local=docs.num_query_tokens, num_local_kv=docs.num_key_tokens,
                send_q_rows=as_tensor(send_q_rows), send_q_counts=send_q_counts,
                send_kv_rows=as_tensor(send_kv_rows), send_kv_counts=send_kv_counts,
                recv_q_counts=recv_q_counts, recv_kv_counts=recv_kv_counts, served=served, kv_window=plan.window,
                merges=plan.splits_keys, q_identity=q_identity, k_identity=k_identity, relays=relays, **settings)


def kv_store_tables(transfers: list[RangeSends], rank: int, num_local_kv: int) -> list[tuple]:
    """How a dispatch of several waves keeps each K/V row once for backward on ``rank``: per wave (its
    K/V sends, ``relay_trees.plan_kv_sends``), ``(keep, store)`` (``Wave.keep_kv_rows`` /
    ``kv_store_rows`` as arrays): ``keep`` the rows of its received K/V (every round's) that no earlier
    wave brought (a (document, position) is one token, whoever sent it: a relay may bring it from
    another rank than the holder) (``None``: all), ``store`` the store row of every pool row; ``(None, None)`` for a wave that
    receives nothing. Waves of one plan bring a document's prefix to a server once each (a server's
    tasks of it in several waves), and each pool also holds the local rows: kept per wave, the local
    K/V would be kept once per exchanging wave and a prefix once per wave that needs it.
    ``planning.kv_kept`` counts the rows kept."""
    ids = [_received_rows(kv, rank) for kv in transfers]  # (doc, position) of each received row
    top = [max((int(x.max(initial=0)) for x in (doc, pos)), default=0) for doc, pos in ids]
    width = max(top, default=0) + 1
    codes = [doc * width + pos for doc, pos in ids]
    every = np.concatenate(codes) if codes else np.zeros(0, np.int64)
    _, first, inverse = np.unique(every, return_index=True, return_inverse=True)
    first_of_row = first[inverse.reshape(-1)]  # where each row's token was first received
    new = first_of_row == np.arange(every.size)
    store_row = num_local_kv + np.cumsum(new)[first_of_row] - 1  # the kept rows, in wave then buffer order
    tables, offset = [], 0
    for c in codes:
        rows = slice(offset, offset + c.size)
        offset += c.size
        if not c.size:
            tables.append((None, None))
            continue
        keep = None if new[rows].all() else np.flatnonzero(new[rows])
        tables.append((keep, np.concatenate((np.arange(num_local_kv), store_row[rows]))))
    return tables


def _received_transfers(kv: RangeSends, rank: int) -> np.ndarray:
    """Indices of the K/V sends ``rank`` receives, in its pool's order: by exchange round (relays:
    ``relay_trees.sends_rounds``; direct sends are all round 1), within a round grouped by source in
    rank order, within a source in send order (the one home of that order: the buffer's tables, the
    relay rounds' and ``kv_store_tables`` read it)."""
    kv_in = np.flatnonzero(kv.server == rank)
    return kv_in[np.lexsort((kv.source[kv_in], sends_rounds(kv)[kv_in]))]


def _sent_in_round(kv: RangeSends, rank: int, exchange_round: int) -> np.ndarray:
    """Indices of the K/V sends ``rank`` sends in ``exchange_round``, grouped by destination in rank
    order, within a destination in send order (what the destination's ``_received_transfers`` expects)."""
    out = np.flatnonzero((kv.source == rank) & (sends_rounds(kv) == exchange_round))
    return out[np.argsort(kv.server[out], kind="stable")]


def _received_rows(kv: RangeSends, rank: int):
    """``(doc, position)`` of every K/V row ``rank`` receives, in its pool's order."""
    kv_in = _received_transfers(kv, rank)
    lengths = kv.end[kv_in] - kv.start[kv_in]
    return np.repeat(kv.doc[kv_in], lengths), concat_ranges(kv.start[kv_in], lengths)


def _source_tables(plan: Plan, sends: QuerySends, kv: RangeSends, local: LocalDocuments, rank: int):
    """Local query rows of this rank's query sends and K/V rows of its first-round K/V sends, by
    destination (in send order, which is by destination)."""
    out = sends.source == rank
    lengths = (sends.end - sends.start)[out]
    first = local.query_rows(local.local_index(sends.doc[out]), sends.start[out])
    send_q_rows = concat_ranges(first, lengths)
    send_q_counts = np.bincount(sends.server[out], weights=lengths, minlength=plan.num_ranks)

    kv_out = _sent_in_round(kv, rank, 1)  # a holder's own K/V (relayed rounds: _relay_tables)
    kv_len = (kv.end - kv.start)[kv_out]
    send_kv_rows = concat_ranges(local.key_rows(local.local_index(kv.doc[kv_out]), kv.start[kv_out]), kv_len)
    send_kv_counts = np.bincount(kv.server[kv_out], weights=kv_len, minlength=plan.num_ranks)
    return send_q_rows, send_q_counts.astype(np.int64).tolist(), send_kv_rows, send_kv_counts.astype(np.int64).tolist()


def _server_tables(plan: Plan, sends: QuerySends, kv: RangeSends, local: LocalDocuments, rank: int, device):
    """Rows this server receives from each source (K/V: in the first round), and its fused batch over
    the pools ``[local rows] ++ [received rows, by source]`` (K/V: then each relay round's). A task's
    K/V prefix (cut to ``plan.window``) may come in several segments: its document's piece on this
    rank and the ranges received from every other holder (or a server relaying them). A received
    task's queries are rows of its send (several key-split tiles of a row share them). Also whether
    the batch's query / key rows are the whole pool in order (``Wave.q_identity`` / ``k_identity``),
    decided here on the host arrays: no device sync per wave; and the K/V segments ``(doc, start,
    end, pool row)`` the relay rounds forward from (``_relay_tables``)."""
    window = plan.window
    world, docs = plan.num_ranks, local.docs
    on_me = plan.server == rank
    q_in = np.flatnonzero(sends.server == rank)
    # the received buffer is grouped by source in rank order; within a source, in send order
    q_in = q_in[np.argsort(sends.source[q_in], kind="stable")]
    q_in_len = sends.end[q_in] - sends.start[q_in]
    recv_q_counts = np.bincount(sends.source[q_in], weights=q_in_len, minlength=world).astype(np.int64)
    send_row = np.zeros(sends.source.size, dtype=np.int64)  # first pool row of each send received here
    send_row[q_in] = docs.num_query_tokens + np.cumsum(q_in_len) - q_in_len
    kv_in = _received_transfers(kv, rank)
    kv_len = kv.end[kv_in] - kv.start[kv_in]
    first_round = sends_rounds(kv)[kv_in] == 1
    recv_kv_counts = np.bincount(kv.source[kv_in][first_round], weights=kv_len[first_round],
                                 minlength=world).astype(np.int64)

    # Query rows of the tasks this rank serves, in plan order (local tasks index the local stream;
    # received ones the rows of their send, which follow it).
    t_src, t_doc, t_a, t_b = plan.source[on_me], plan.doc[on_me], plan.q_start[on_me], plan.q_end[on_me]
    is_local = t_src == rank
    q_first = np.zeros(t_src.size, dtype=np.int64)
    q_first[is_local] = local.query_rows(local.local_index(t_doc[is_local]), t_a[is_local])
    t_send = sends.of_task[on_me][~is_local]
    q_first[~is_local] = send_row[t_send] + t_a[~is_local] - sends.start[t_send]
    q_index = concat_ranges(q_first, t_b - t_a)

    # K/V segments a server can read: the local pieces, then each received range (pool rows after
    # the local key stream, in buffer order).
    seg_doc = np.concatenate((local.global_ids, kv.doc[kv_in]))
    seg_start = np.concatenate((local.offsets, kv.start[kv_in]))
    seg_end = np.concatenate((local.offsets + docs.lengths, kv.end[kv_in]))
    seg_row = np.concatenate((docs.k_starts, docs.num_key_tokens + np.cumsum(kv_len) - kv_len))
    if plan.splits_keys:  # key-split tasks: each its own keys
        t_k0, t_k1 = plan.k_start[on_me], plan.k_end[on_me]
        k_rows = _prefix_rows(t_doc, t_k0, t_k1, seg_doc, seg_start, seg_end, seg_row)
        batch = fused_batch(q_index, k_rows, t_a, t_b, device, window=window, k_start=t_k0, k_end=t_k1)
    else:
        k_rows = _prefix_rows(t_doc, key_start(t_a, window), t_b, seg_doc, seg_start, seg_end, seg_row)
        batch = fused_batch(q_index, k_rows, t_a, t_b, device, window=window)
    # (fused_batch reorders rows only for key-split tasks, which never cover a pool in order)
    identity = lambda rows, pool: not plan.splits_keys and np.array_equal(rows, np.arange(pool))
    return (recv_q_counts.tolist(), recv_kv_counts.tolist(), batch,
            identity(q_index, docs.num_query_tokens + int(recv_q_counts.sum())),
            identity(k_rows, docs.num_key_tokens + int(kv_len.sum())), (seg_doc, seg_start, seg_end, seg_row))


def _relay_tables(kv: RangeSends, segments, rank: int, world: int) -> list[tuple]:
    """``(send_rows, send_counts, recv_counts)`` of every K/V exchange round after the first
    (``RelayRound``), as many on every rank (the plan's deepest tree): the pool rows of what this rank
    forwards in the round, found among its K/V ``segments`` (``_server_tables``': its own pieces and
    everything it received, which a relay forwards in a later round than it arrived), and the rows it
    sends to / receives from each rank."""
    rounds, lengths = sends_rounds(kv), kv.end - kv.start
    tables = []
    for exchange_round in range(2, int(rounds.max(initial=1)) + 1):
        out = _sent_in_round(kv, rank, exchange_round)
        send_rows = _prefix_rows(kv.doc[out], kv.start[out], kv.end[out], *segments)
        send_counts = np.bincount(kv.server[out], weights=lengths[out], minlength=world).astype(np.int64)
        got = (kv.server == rank) & (rounds == exchange_round)
        recv_counts = np.bincount(kv.source[got], weights=lengths[got], minlength=world).astype(np.int64)
        tables.append((send_rows, send_counts.tolist(), recv_counts.tolist()))
    return tables


def _prefix_rows(task_doc, task_start, task_end, seg_doc, seg_start, seg_end, seg_row) -> np.ndarray:
    """Pool rows of every task's keys ``[task_start, task_end)`` (its K/V prefix, or the part of it
    a window sees; or a range a relay round forwards), task after task, in position order, from
    segments (``[start, end)`` of a document at pool rows ``row ..``) that tile each document's
    positions on this server."""
    order = np.lexsort((seg_start, seg_doc))
    seg_doc, seg_start, seg_end, seg_row = seg_doc[order], seg_start[order], seg_end[order], seg_row[order]
    lo = np.searchsorted(seg_doc, task_doc, side="left")
    hi = np.searchsorted(seg_doc, task_doc, side="right")
    task = np.repeat(np.arange(task_doc.size), hi - lo)
    seg = concat_ranges(lo, hi - lo)
    first = np.maximum(seg_start[seg], task_start[task])
    lengths = np.minimum(seg_end[seg], task_end[task]) - first
    used = lengths > 0
    task, seg, first, lengths = task[used], seg[used], first[used], lengths[used]
    covered = np.bincount(task, weights=lengths, minlength=task_doc.size)
    if not np.array_equal(covered, task_end - task_start):
        raise AssertionError("distca: a task's K/V prefix is not fully on its server; please report this")
    return concat_ranges(seg_row[seg] + first - seg_start[seg], lengths)
