"""Dispatch: run a plan's CA-tasks on their servers, forward and backward.

Each rank is both a *source* (its tokens' q, k, v live here, and their output must come back here)
and a *server* (it computes the CA-tasks the plan gives it). Per layer, forward:

1. sources pack, per destination server, the query rows of their moved tasks and the K/V rows that
   server lacks (``num_key_value_heads`` heads, each token once per (source, server) pair) into one
   buffer, and one uneven all-to-all moves them;
2. each server builds one fused varlen batch from its own tokens and what it received, runs the
   kernel once, and keeps the outputs of its local tasks;
3. one all-to-all returns the other outputs to their sources.

Backward mirrors it. In ``saved`` mode a server keeps its fused q, out and log-sum-exp and its K/V
pool (each token once), so
only dO travels out and dQ, dK, dV travel back (K/V gradients of a token used by several tasks or
servers are summed). In ``resend`` mode servers keep nothing: sources keep their own q, k, v, out
and log-sum-exp and send them again with dO, trading bytes for flat server memory.

Shapes: local q ``[tokens, heads, head_dim]``, k/v ``[tokens, kv_heads, head_dim]`` where tokens is
the rank's flattened ``batch * seq``; padding tokens belong to no task and get zero output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .comm import all_to_all
from .documents import PackedDocuments
from .kernels import varlen_attention_backward, varlen_attention_forward
from .layout import KVTransfers, concat_ranges
from .planner import Plan, pairs_of
from .tasks import FusedBatch

__all__ = ["DispatchLayout", "build_dispatch_layout", "dispatched_attention"]


@dataclass(eq=False)
class DispatchLayout:
    """One rank's index tables for one plan (rows are tokens; tensors on the compute device).

    Source side: ``send_q_rows`` / ``send_kv_rows`` are local token rows to send, grouped by
    destination in rank order, ``send_q_counts`` / ``send_kv_counts`` the rows per destination.
    Server side: ``recv_q_counts`` / ``recv_kv_counts`` rows from each source; the *pools* are
    ``[local rows] ++ [received rows, by source]``; ``served`` is the fused batch of the CA-tasks
    this rank computes, its ``q_index`` / ``k_index`` picking query and K/V prefix rows from the pools.
    """

    world: int
    rank: int
    num_local: int
    send_q_rows: torch.Tensor
    send_q_counts: list[int]
    send_kv_rows: torch.Tensor
    send_kv_counts: list[int]
    recv_q_counts: list[int]
    recv_kv_counts: list[int]
    served: FusedBatch
    group: object = None
    timeout_s: float = 600.0
    backward_mode: str = "saved"
    step: int = 0
    bytes_sent: dict = field(default_factory=dict)  # bytes this rank sent in this step, by collective kind
    saved_bytes: int = 0  # bytes this rank kept for backward in this step, all layers
    buffers: dict = field(default_factory=dict)  # send/receive buffers shared by the step's layers

    @property
    def num_tasks(self) -> int:
        return int(self.served.cu_seqlens_q.numel()) - 1


def build_dispatch_layout(plan: Plan, kv: KVTransfers, doc_offset: np.ndarray, docs: PackedDocuments, rank: int,
                          device, **settings) -> DispatchLayout:
    """Index tables for ``rank``. Documents are numbered globally in rank order: rank ``r`` holds
    documents ``doc_offset[r] .. doc_offset[r + 1] - 1``, whole (``docs`` are its own)."""
    world = plan.num_ranks
    src, srv, doc, a, b = plan.source, plan.server, plan.doc, plan.q_start, plan.q_end
    lengths = b - a
    num_local = docs.num_query_tokens

    moved_out = (src == rank) & (srv != rank)
    local_doc = doc[moved_out] - doc_offset[rank]
    send_q_rows = concat_ranges(docs.q_starts[local_doc] + a[moved_out], lengths[moved_out])
    send_q_counts = np.bincount(srv[moved_out], weights=lengths[moved_out], minlength=world)

    kv_len = kv.end - kv.start
    kv_out = kv.source == rank
    send_kv_rows = concat_ranges(docs.k_starts[kv.doc[kv_out] - doc_offset[rank]] + kv.start[kv_out], kv_len[kv_out])
    send_kv_counts = np.bincount(kv.server[kv_out], weights=kv_len[kv_out], minlength=world)

    on_me = srv == rank
    remote = on_me & (src != rank)
    recv_q_counts = np.bincount(src[remote], weights=lengths[remote], minlength=world).astype(np.int64)
    kv_in = kv.server == rank
    recv_kv_counts = np.bincount(kv.source[kv_in], weights=kv_len[kv_in], minlength=world).astype(np.int64)

    # Tasks this rank serves, in plan order (grouped by source, as the received rows are).
    t_src, t_doc, t_a, t_b = src[on_me], doc[on_me], a[on_me], b[on_me]
    t_len = t_b - t_a
    is_local = t_src == rank
    q_first = np.zeros(t_src.size, dtype=np.int64)
    k_first = np.zeros(t_src.size, dtype=np.int64)
    own = t_doc[is_local] - doc_offset[rank]
    q_first[is_local] = docs.q_starts[own] + t_a[is_local]
    k_first[is_local] = docs.k_starts[own]

    # Received rows sit after the local ones, grouped by source in rank order (the plan is sorted by
    # server then source; documents are numbered in rank order, so transfers by document are too):
    # each task's or transfer's first row is the running total of the rows before it.
    r_src, r_len = t_src[~is_local], t_len[~is_local]
    in_src, in_doc, in_len = kv.source[kv_in], kv.doc[kv_in], kv_len[kv_in]
    if (np.diff(r_src) < 0).any() or (np.diff(in_src) < 0).any():
        raise AssertionError("distca: received rows are not grouped by source; please report this")
    if (kv.start[kv_in] != 0).any():
        raise NotImplementedError("distca dispatch expects every document whole on one rank")
    q_first[~is_local] = num_local + np.cumsum(r_len) - r_len
    in_first = num_local + np.cumsum(in_len) - in_len
    # one transfer per document (its prefix up to the longest task here): find each task's
    order = np.argsort(in_doc)
    k_first[~is_local] = in_first[order][np.searchsorted(in_doc[order], t_doc[~is_local])]

    as_tensor = lambda x: torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64)).to(device)
    cu_q = np.concatenate(([0], np.cumsum(t_len))).astype(np.int32)
    cu_k = np.concatenate(([0], np.cumsum(t_b))).astype(np.int32)
    return DispatchLayout(
        world=world,
        rank=rank,
        num_local=num_local,
        send_q_rows=as_tensor(send_q_rows),
        send_q_counts=send_q_counts.astype(np.int64).tolist(),
        send_kv_rows=as_tensor(send_kv_rows),
        send_kv_counts=send_kv_counts.astype(np.int64).tolist(),
        recv_q_counts=recv_q_counts.tolist(),
        recv_kv_counts=recv_kv_counts.tolist(),
        served=FusedBatch(
            as_tensor(concat_ranges(q_first, t_len)),
            as_tensor(concat_ranges(k_first, t_b)),
            torch.from_numpy(cu_q).to(device),
            torch.from_numpy(cu_k).to(device),
            int(t_len.max(initial=0)),
            int(t_b.max(initial=0)),
            int(pairs_of(t_a, t_b).sum()),
        ),
        **settings,
    )


def _buffer(layout: "DispatchLayout", name: str, numel: int, like: torch.Tensor) -> torch.Tensor:
    """A 1D buffer of ``numel`` elements, reused by every layer of the step (grown when needed)."""
    key = (name, like.dtype)
    pooled = layout.buffers.get(key)
    if pooled is None or pooled.numel() < numel:
        pooled = torch.empty(numel, dtype=like.dtype, device=like.device)
        layout.buffers[key] = pooled
    return pooled[:numel]


def _pack(layout: "DispatchLayout", name: str, parts_by_dest: list[list[torch.Tensor]]):
    """One 1D buffer holding, for each destination in rank order, its parts flattened."""
    flat = [p.reshape(-1) for parts in parts_by_dest for p in parts]
    splits = [sum(p.numel() for p in parts) for parts in parts_by_dest]
    buffer = _buffer(layout, name, sum(splits), flat[0])
    torch.cat(flat, out=buffer)
    return buffer, splits


def _split_rows(t: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
    return list(torch.split(t, counts, dim=0))


def _unpack(buffer: torch.Tensor, counts_by_part: list[list[int]], shapes: list[tuple[int, ...]]):
    """Inverse of ``_pack`` on the receive side: ``counts_by_part[j][r]`` rows of part ``j`` came
    from rank ``r``, each row of shape ``shapes[j]``. Returns one tensor per part, sources in order."""
    world = len(counts_by_part[0])
    pieces = [[] for _ in shapes]
    offset = 0
    for r in range(world):
        for j, shape in enumerate(shapes):
            n = counts_by_part[j][r] * int(np.prod(shape))
            pieces[j].append(buffer[offset : offset + n].view(-1, *shape))
            offset += n
    return [torch.cat(p) if p else buffer.new_empty(0, *s) for p, s in zip(pieces, shapes)]


def _exchange(layout: DispatchLayout, send_parts, recv_counts, shapes, what: str, kind: str):
    """Send ``send_parts[r]`` to rank ``r``; receive parts with ``recv_counts[j][r]`` rows of shape
    ``shapes[j]`` from each rank. Returns the received parts, concatenated over sources."""
    buffer, splits = _pack(layout, kind + ".send", send_parts)
    recv_splits = [sum(recv_counts[j][r] * int(np.prod(s)) for j, s in enumerate(shapes)) for r in range(layout.world)]
    received = all_to_all(buffer, splits, recv_splits, layout.group, layout.timeout_s,
                          f"{what} (step {layout.step})", out=_buffer(layout, kind + ".recv", sum(recv_splits), buffer))
    sent = sum(splits[r] for r in range(layout.world) if r != layout.rank) * buffer.element_size()
    layout.bytes_sent[kind] = layout.bytes_sent.get(kind, 0) + int(sent)
    return _unpack(received, recv_counts, shapes)


def _send_inputs(layout, q, k, v, what):
    """Move query rows and K/V rows to their servers; returns the received (q, k, v) rows."""
    qs = _split_rows(q.index_select(0, layout.send_q_rows), layout.send_q_counts)
    ks = _split_rows(k.index_select(0, layout.send_kv_rows), layout.send_kv_counts)
    vs = _split_rows(v.index_select(0, layout.send_kv_rows), layout.send_kv_counts)
    return _exchange(layout, [[a, b, c] for a, b, c in zip(qs, ks, vs)],
                     [layout.recv_q_counts, layout.recv_kv_counts, layout.recv_kv_counts],
                     [tuple(q.shape[1:]), tuple(k.shape[1:]), tuple(v.shape[1:])], what, "forward_inputs")


def _fused(layout, q_pool, k_pool, v_pool):
    served = layout.served
    return (q_pool.index_select(0, served.q_index), k_pool.index_select(0, served.k_index),
            v_pool.index_select(0, served.k_index))


class _DispatchedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout: DispatchLayout, scale: float):
        served = layout.served
        recv_q, recv_k, recv_v = _send_inputs(layout, q, k, v, "distca forward: sending q/k/v to servers")
        q_pool, k_pool, v_pool = torch.cat([q, recv_q]), torch.cat([k, recv_k]), torch.cat([v, recv_v])
        fq, fk, fv = _fused(layout, q_pool, k_pool, v_pool)
        heads = q.shape[1]
        if layout.num_tasks:
            f_out, f_lse = varlen_attention_forward(fq, fk, fv, served.cu_seqlens_q, served.cu_seqlens_k,
                                                    served.max_seqlen_q, served.max_seqlen_k, scale)
        else:
            f_out, f_lse = fq.new_empty(0, *q.shape[1:]), torch.empty(heads, 0, dtype=torch.float32, device=q.device)
        out_pool = q_pool.new_zeros(q_pool.shape).index_copy(0, served.q_index, f_out)
        # return the outputs (and, for resend, their log-sum-exp) of other sources' tasks
        back = [[o] for o in _split_rows(out_pool[layout.num_local :], layout.recv_q_counts)]
        (got_out,) = _exchange(layout, back, [layout.send_q_counts], [tuple(q.shape[1:])],
                               "distca forward: returning outputs", "forward_outputs")
        out = out_pool[: layout.num_local].index_copy(0, layout.send_q_rows, got_out)
        ctx.layout, ctx.scale = layout, scale
        if layout.backward_mode == "saved":
            # K/V pools hold each token once; the fused K/V repeat a prefix for every task using it
            ctx.save_for_backward(fq, k_pool, v_pool, f_out, f_lse)
            kept = (fq, k_pool, v_pool, f_out, f_lse)
        else:
            lse_pool = torch.zeros(q_pool.shape[0], heads, dtype=f_lse.dtype, device=q.device)
            lse_pool.index_copy_(0, served.q_index, f_lse.t())
            lse_back = [[x] for x in _split_rows(lse_pool[layout.num_local :], layout.recv_q_counts)]
            (got_lse,) = _exchange(layout, lse_back, [layout.send_q_counts], [(heads,)],
                                   "distca forward: returning log-sum-exp", "forward_outputs")
            lse = lse_pool[: layout.num_local].index_copy(0, layout.send_q_rows, got_lse)
            ctx.save_for_backward(q, k, v, out, lse)
            kept = (q, k, v, out, lse)
        if any(ctx.needs_input_grad[:3]):  # nothing is kept under no_grad
            layout.saved_bytes += sum(t.numel() * t.element_size() for t in kept)
        return out

    @staticmethod
    def backward(ctx, dout):
        layout, scale = ctx.layout, ctx.scale
        served = layout.served
        dout = dout.contiguous()
        qshape = tuple(dout.shape[1:])
        if layout.backward_mode == "saved":
            fq, k_pool, v_pool, f_out, f_lse = ctx.saved_tensors
            fk, fv = k_pool.index_select(0, served.k_index), v_pool.index_select(0, served.k_index)
            kshape = tuple(fk.shape[1:])
            sends = [[x] for x in _split_rows(dout.index_select(0, layout.send_q_rows), layout.send_q_counts)]
            (recv_do,) = _exchange(layout, sends, [layout.recv_q_counts], [qshape],
                                   "distca backward: sending dO to servers", "backward_inputs")
            f_do = torch.cat([dout, recv_do]).index_select(0, served.q_index)
            pool_rows = layout.num_local + sum(layout.recv_q_counts)
            kv_rows = layout.num_local + sum(layout.recv_kv_counts)
        else:
            q, k, v, out, lse = ctx.saved_tensors
            kshape = tuple(k.shape[1:])
            rows = lambda t: _split_rows(t.index_select(0, layout.send_q_rows), layout.send_q_counts)
            krows = lambda t: _split_rows(t.index_select(0, layout.send_kv_rows), layout.send_kv_counts)
            sends = [list(p) for p in zip(rows(q), krows(k), krows(v), rows(dout), rows(out))]
            rq, rk, rv, rdo, ro = _exchange(
                layout, sends,
                [layout.recv_q_counts, layout.recv_kv_counts, layout.recv_kv_counts, layout.recv_q_counts,
                 layout.recv_q_counts],
                [qshape, kshape, kshape, qshape, qshape], "distca backward: resending q/k/v/out/dO", "backward_inputs")
            (rlse,) = _exchange(layout, [[x] for x in rows(lse)], [layout.recv_q_counts], [(lse.shape[1],)],
                                "distca backward: resending log-sum-exp", "backward_inputs")
            fq, fk, fv = _fused(layout, torch.cat([q, rq]), torch.cat([k, rk]), torch.cat([v, rv]))
            f_do = torch.cat([dout, rdo]).index_select(0, served.q_index)
            f_out = torch.cat([out, ro]).index_select(0, served.q_index)
            f_lse = torch.cat([lse, rlse]).index_select(0, served.q_index).t().contiguous()
            pool_rows, kv_rows = q.shape[0] + rq.shape[0], k.shape[0] + rk.shape[0]
        if layout.num_tasks:
            fdq, fdk, fdv = varlen_attention_backward(f_do, fq, fk, fv, f_out, f_lse, served.cu_seqlens_q,
                                                      served.cu_seqlens_k, served.max_seqlen_q,
                                                      served.max_seqlen_k, scale)
        else:
            fdq, fdk, fdv = fq, fk, fv  # empty
        dq_pool = dout.new_zeros(pool_rows, *qshape).index_copy(0, served.q_index, fdq)
        dk_pool = dout.new_zeros(kv_rows, *kshape).index_add(0, served.k_index, fdk)
        dv_pool = dout.new_zeros(kv_rows, *kshape).index_add(0, served.k_index, fdv)
        n = layout.num_local
        back = [list(p) for p in zip(_split_rows(dq_pool[n:], layout.recv_q_counts),
                                     _split_rows(dk_pool[n:], layout.recv_kv_counts),
                                     _split_rows(dv_pool[n:], layout.recv_kv_counts))]
        got_dq, got_dk, got_dv = _exchange(layout, back, [layout.send_q_counts, layout.send_kv_counts,
                                                          layout.send_kv_counts], [qshape, kshape, kshape],
                                           "distca backward: returning dQ/dK/dV", "backward_outputs")
        dq = dq_pool[:n].index_copy(0, layout.send_q_rows, got_dq)
        dk = dk_pool[:n].index_add(0, layout.send_kv_rows, got_dk)  # a K/V token used on several servers
        dv = dv_pool[:n].index_add(0, layout.send_kv_rows, got_dv)
        return dq, dk, dv, None, None


def dispatched_attention(q, k, v, layout: DispatchLayout, scale: float) -> torch.Tensor:
    """Causal attention of the rank's documents, computed where the plan says. q ``[tokens, heads,
    head_dim]``, k/v ``[tokens, kv_heads, head_dim]`` -> ``[tokens, heads, head_dim]``."""
    return _DispatchedAttention.apply(q, k, v, layout, scale)
