"""Index tables of one wave of a dispatch: which local rows each rank sends where, and how a server
finds each CA-task's query and K/V rows among its own and the received ones.

Pure index arithmetic over a plan (numpy), turned into device tensors once per forward and reused
by every layer. Rows are tokens of this rank's flattened ``batch * seq`` streams.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..planning import FusedBatch, KVTransfers, PackedDocuments, Plan, concat_ranges, fused_batch

__all__ = ["DispatchCounters", "Wave", "build_wave"]


@dataclass(eq=False)
class DispatchCounters:
    """What this rank moved and kept in one forward, over all layers and waves (bytes)."""

    bytes_sent: dict = field(default_factory=dict)  # by collective kind
    saved_bytes: int = 0


@dataclass(eq=False)
class Wave:
    """One rank's index tables for one plan, or one wave of it (tensors on the compute device).

    Source side: ``send_q_rows`` / ``send_kv_rows`` are local token rows to send, grouped by
    destination in rank order, ``send_q_counts`` / ``send_kv_counts`` the rows per destination.
    Server side: ``recv_q_counts`` / ``recv_kv_counts`` rows from each source; the *pools* are
    ``[local rows] ++ [received rows, by source]``; ``served`` is the fused batch of the CA-tasks
    this rank computes, its ``q_index`` / ``k_index`` picking query and K/V prefix rows from the pools.
    ``local_only``: no rank sends anything in this wave (the same on every rank), so no collective
    runs. ``num_local`` / ``num_local_kv``: rows of the local query / key streams (they differ when a
    nano-batch holds a cut document's prefix K/V without its queries).
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
    group: object = None
    timeout_s: float = 600.0
    backward_mode: str = "saved"
    forward_number: int = 0
    name: str = "all"
    counters: DispatchCounters = field(default_factory=DispatchCounters)
    buffers: dict = field(default_factory=dict)  # send/receive buffers shared by the forward's layers

    @property
    def num_tasks(self) -> int:
        return int(self.served.cu_seqlens_q.numel()) - 1


def build_wave(plan: Plan, kv: KVTransfers, doc_offset: np.ndarray, docs: PackedDocuments, rank: int, device,
               **settings) -> Wave:
    """Index tables of ``plan`` for ``rank``. Documents are numbered globally in rank order: rank
    ``r`` holds documents ``doc_offset[r] .. doc_offset[r + 1] - 1`` (``docs`` are its own), with
    their K/V from position 0 (queries may start later, ``docs.past``). ``settings`` are ``Wave``'s
    optional fields."""
    as_tensor = lambda x: torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64)).to(device)
    send_q_rows, send_q_counts, send_kv_rows, send_kv_counts = _source_tables(plan, kv, doc_offset, docs, rank)
    recv_q_counts, recv_kv_counts, served = _server_tables(plan, kv, doc_offset, docs, rank, device)
    return Wave(world=plan.num_ranks, rank=rank, num_local=docs.num_query_tokens, num_local_kv=docs.num_key_tokens,
                send_q_rows=as_tensor(send_q_rows), send_q_counts=send_q_counts,
                send_kv_rows=as_tensor(send_kv_rows), send_kv_counts=send_kv_counts,
                recv_q_counts=recv_q_counts, recv_kv_counts=recv_kv_counts, served=served, **settings)


def _source_tables(plan: Plan, kv: KVTransfers, doc_offset, docs: PackedDocuments, rank: int):
    """Local query rows of this rank's moved tasks and K/V rows of its transfers, by destination."""
    src, srv, a, b = plan.source, plan.server, plan.q_start, plan.q_end
    moved_out = (src == rank) & (srv != rank)
    local_doc = plan.doc[moved_out] - doc_offset[rank]
    lengths = (b - a)[moved_out]
    send_q_rows = concat_ranges(docs.q_starts[local_doc] + a[moved_out] - docs.past[local_doc], lengths)
    send_q_counts = np.bincount(srv[moved_out], weights=lengths, minlength=plan.num_ranks)

    kv_len = kv.end - kv.start
    kv_out = kv.source == rank
    send_kv_rows = concat_ranges(docs.k_starts[kv.doc[kv_out] - doc_offset[rank]] + kv.start[kv_out], kv_len[kv_out])
    send_kv_counts = np.bincount(kv.server[kv_out], weights=kv_len[kv_out], minlength=plan.num_ranks)
    return send_q_rows, send_q_counts.astype(np.int64).tolist(), send_kv_rows, send_kv_counts.astype(np.int64).tolist()


def _server_tables(plan: Plan, kv: KVTransfers, doc_offset, docs: PackedDocuments, rank: int, device):
    """Rows this server receives from each source, and its fused batch over ``[local] ++ [received]``."""
    world = plan.num_ranks
    src, srv, doc, a, b = plan.source, plan.server, plan.doc, plan.q_start, plan.q_end
    on_me = srv == rank
    remote = on_me & (src != rank)
    recv_q_counts = np.bincount(src[remote], weights=(b - a)[remote], minlength=world).astype(np.int64)
    kv_in = kv.server == rank
    kv_len = kv.end - kv.start
    recv_kv_counts = np.bincount(kv.source[kv_in], weights=kv_len[kv_in], minlength=world).astype(np.int64)

    # Tasks this rank serves, in plan order (grouped by source, as the received rows are).
    t_src, t_doc, t_a, t_b = src[on_me], doc[on_me], a[on_me], b[on_me]
    t_len = t_b - t_a
    is_local = t_src == rank
    q_first = np.zeros(t_src.size, dtype=np.int64)
    k_first = np.zeros(t_src.size, dtype=np.int64)
    own = t_doc[is_local] - doc_offset[rank]
    q_first[is_local] = docs.q_starts[own] + t_a[is_local] - docs.past[own]
    k_first[is_local] = docs.k_starts[own]

    # Received rows sit after the local ones, grouped by source in rank order (the plan is sorted by
    # server then source; documents are numbered in rank order, so transfers by document are too):
    # each task's or transfer's first row is the running total of the rows before it.
    r_src, r_len = t_src[~is_local], t_len[~is_local]
    in_src, in_doc, in_len = kv.source[kv_in], kv.doc[kv_in], kv_len[kv_in]
    if (np.diff(r_src) < 0).any() or (np.diff(in_src) < 0).any():
        raise AssertionError("distca: received rows are not grouped by source; please report this")
    if (kv.start[kv_in] != 0).any():
        raise NotImplementedError("distca dispatch expects every document's K/V whole on one rank")
    q_first[~is_local] = docs.num_query_tokens + np.cumsum(r_len) - r_len
    in_first = docs.num_key_tokens + np.cumsum(in_len) - in_len
    # one transfer per document (its prefix up to the longest task here): find each task's
    order = np.argsort(in_doc)
    k_first[~is_local] = in_first[order][np.searchsorted(in_doc[order], t_doc[~is_local])]
    return recv_q_counts.tolist(), recv_kv_counts.tolist(), fused_batch(q_first, k_first, t_a, t_b, device)
