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

from . import timeline
from .comm import all_to_all
from .documents import PackedDocuments
from .kernels import varlen_attention_backward, varlen_attention_forward
from .layout import KVTransfers, concat_ranges, kv_transfers
from .planner import DocumentPieces, Plan, start_with_pairs, pairs_of
from .tasks import FusedBatch

__all__ = ["Dispatch", "DispatchCounters", "DispatchLayout", "build_dispatch", "build_dispatch_layout",
           "dispatched_attention"]


@dataclass(eq=False)
class DispatchCounters:
    """What this rank moved and kept in one step, over all layers and waves (bytes)."""

    bytes_sent: dict = field(default_factory=dict)  # by collective kind
    saved_bytes: int = 0


@dataclass(eq=False)
class DispatchLayout:
    """One rank's index tables for one plan, or one wave of it (rows are tokens; tensors on the
    compute device).

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
    step: int = 0
    name: str = "all"
    counters: DispatchCounters = field(default_factory=DispatchCounters)
    buffers: dict = field(default_factory=dict)  # send/receive buffers shared by the step's layers

    @property
    def num_tasks(self) -> int:
        return int(self.served.cu_seqlens_q.numel()) - 1


@dataclass(eq=False)
class Dispatch:
    """A step's dispatch on this rank: its waves, in execution order (one wave without overlap).

    ``overlap="wave"`` runs ``[local tasks, first half] [remote tasks, 1] [remote tasks, 2] [local
    tasks, second half]``: both remote waves' inputs are launched first, so they travel while the
    first local half computes, the second remote wave's inputs arrive while the first computes, and
    the outputs of the remote waves travel back while the later waves compute. Backward runs the
    waves in reverse with the same overlap.
    """

    waves: list[DispatchLayout]
    counters: DispatchCounters
    overlap: str = "none"
    kv_tokens_moved: int = 0  # K/V tokens crossing ranks per layer, all ranks (waves may resend a prefix)


def build_dispatch(plan: Plan, pieces: DocumentPieces, doc_offset: np.ndarray, docs: PackedDocuments, rank: int,
                   device, overlap: str = "none", counters: DispatchCounters | None = None, block: int = 1,
                   **settings) -> Dispatch:
    """The waves of ``plan`` on ``rank`` (see ``Dispatch``); ``settings`` go to every wave's layout.
    ``counters`` may be shared with another dispatch (ping-pong's two nano-batches); ``block``: the
    wave cut of a local task lands on a multiple of it from the task's start."""
    counters = counters if counters is not None else DispatchCounters()
    if overlap != "wave":
        transfers = kv_transfers(plan, pieces)
        layout = build_dispatch_layout(plan, transfers, doc_offset, docs, rank, device, counters=counters, **settings)
        return Dispatch([layout], counters, overlap, transfers.tokens())
    plan = _cut_local_work_in_halves(plan, block)
    local = plan.source == plan.server
    early = _first_half_by_pairs(plan, local)
    first_remote = _first_half_by_pairs(plan, ~local)
    waves, kv_tokens = [], 0
    for name, mask in (("local, first half", local & early), ("remote 1", ~local & first_remote),
                       ("remote 2", ~local & ~first_remote), ("local, second half", local & ~early)):
        if not mask.any():  # the plan is the same on every rank, so every rank skips the same waves
            continue
        sub = _subplan(plan, mask)
        transfers = kv_transfers(sub, pieces)
        kv_tokens += transfers.tokens()
        layout = build_dispatch_layout(sub, transfers, doc_offset, docs, rank, device, counters=counters, name=name,
                                       **settings)
        layout.local_only = name.startswith("local")
        waves.append(layout)
    return Dispatch(waves, counters, overlap, kv_tokens)


def _subplan(plan: Plan, mask: np.ndarray) -> Plan:
    return Plan(plan.source[mask], plan.server[mask], plan.doc[mask], plan.q_start[mask], plan.q_end[mask],
                plan.num_ranks, plan.servers)


def _first_half_by_pairs(plan: Plan, chosen: np.ndarray) -> np.ndarray:
    """Mask of the ``chosen`` tasks that fall in the first half of their server's chosen pairs (in
    plan order; a task belongs to the half that holds its midpoint)."""
    pairs = np.where(chosen, plan.pairs(), 0).astype(np.float64)
    first = np.zeros(plan.num_tasks, dtype=bool)
    for server in np.unique(plan.server[chosen]):
        on = np.flatnonzero(plan.server == server)
        running = np.cumsum(pairs[on])
        first[on] = (running - pairs[on] / 2) < running[-1] / 2
    return first & chosen


def _cut_local_work_in_halves(plan: Plan, block: int = 1) -> Plan:
    """Cut the local task that straddles the half of each server's local pairs at that half, so the
    two local waves carry equal work even when a rank keeps a single long document (CA-tasks are
    composable: the two pieces give exactly the attention of the whole). The cut is ``block``
    aligned from the task's start (kernels such as flash-attn prefer whole blocks)."""
    local = plan.source == plan.server
    pairs = np.where(local, plan.pairs(), 0)
    cut_at = np.full(plan.num_tasks, -1, dtype=np.int64)
    for server in np.unique(plan.server[local]):
        on = np.flatnonzero((plan.server == server) & local)
        running = np.cumsum(pairs[on])
        half = running[-1] / 2
        i = int(np.searchsorted(running, half))  # the task whose range holds the half
        a, b = int(plan.q_start[on[i]]), int(plan.q_end[on[i]])
        before = running[i] - pairs[on[i]]
        c = start_with_pairs(b, float(running[i] - half))
        c = a + int(round((c - a) / block)) * block
        if a < c < b and before < half:
            cut_at[on[i]] = c
    cut = np.flatnonzero(cut_at >= 0)
    if cut.size == 0:
        return plan
    # task i becomes [q_start, c) and [c, q_end), adjacent in plan order
    repeat = np.where(cut_at >= 0, 2, 1)
    index = np.repeat(np.arange(plan.num_tasks), repeat)
    second = np.zeros(index.size, dtype=bool)
    second[np.cumsum(repeat)[cut] - 1] = True
    q_start, q_end = plan.q_start[index].copy(), plan.q_end[index].copy()
    q_start[second] = cut_at[index[second]]
    first_of_cut = np.zeros(index.size, dtype=bool)
    first_of_cut[np.cumsum(repeat)[cut] - 2] = True
    q_end[first_of_cut] = cut_at[index[first_of_cut]]
    return Plan(plan.source[index], plan.server[index], plan.doc[index], q_start, q_end, plan.num_ranks,
                plan.servers)


def build_dispatch_layout(plan: Plan, kv: KVTransfers, doc_offset: np.ndarray, docs: PackedDocuments, rank: int,
                          device, **settings) -> DispatchLayout:
    """Index tables for ``rank``. Documents are numbered globally in rank order: rank ``r`` holds
    documents ``doc_offset[r] .. doc_offset[r + 1] - 1`` (``docs`` are its own), with their K/V from
    position 0 (queries may start later, ``docs.past``)."""
    world = plan.num_ranks
    src, srv, doc, a, b = plan.source, plan.server, plan.doc, plan.q_start, plan.q_end
    lengths = b - a
    num_local = docs.num_query_tokens

    moved_out = (src == rank) & (srv != rank)
    local_doc = doc[moved_out] - doc_offset[rank]
    send_q_rows = concat_ranges(docs.q_starts[local_doc] + a[moved_out] - docs.past[local_doc], lengths[moved_out])
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
    q_first[~is_local] = num_local + np.cumsum(r_len) - r_len
    in_first = docs.num_key_tokens + np.cumsum(in_len) - in_len
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
        num_local_kv=docs.num_key_tokens,
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


def _buffer(layout: DispatchLayout, name: str, numel: int, like: torch.Tensor) -> torch.Tensor:
    """A 1D buffer of ``numel`` elements, reused by every layer of the step (grown when needed)."""
    key = (name, like.dtype)
    pooled = layout.buffers.get(key)
    if pooled is None or pooled.numel() < numel:
        pooled = torch.empty(numel, dtype=like.dtype, device=like.device)
        layout.buffers[key] = pooled
    return pooled[:numel]


def _split_rows(t: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
    return list(torch.split(t, counts, dim=0))


class _Pending:
    """An exchange in flight; ``wait()`` returns the received parts, each concatenated over sources."""

    def __init__(self, handle, recv_counts, shapes, world: int):
        self.handle, self.recv_counts, self.shapes, self.world = handle, recv_counts, shapes, world

    def wait(self) -> list[torch.Tensor]:
        buffer = self.handle.wait()
        pieces = [[] for _ in self.shapes]
        offset = 0
        for r in range(self.world):
            for j, shape in enumerate(self.shapes):
                n = self.recv_counts[j][r] * int(np.prod(shape))
                pieces[j].append(buffer[offset : offset + n].view(-1, *shape))
                offset += n
        # concatenating copies out of the receive buffer, which the next layer reuses
        return [torch.cat(p) if p else buffer.new_empty(0, *s) for p, s in zip(pieces, self.shapes)]


def _start_exchange(layout: DispatchLayout, send_parts, recv_counts, shapes, what: str, kind: str) -> _Pending:
    """Launch the all-to-all that sends ``send_parts[r]`` (a list of row tensors) to rank ``r`` and
    receives ``recv_counts[j][r]`` rows of shape ``shapes[j]`` of part ``j`` from each rank."""
    flat = [p.reshape(-1) for parts in send_parts for p in parts]
    splits = [sum(p.numel() for p in parts) for parts in send_parts]
    send = _buffer(layout, kind + ".send", sum(splits), flat[0])
    torch.cat(flat, out=send)
    recv_splits = [sum(recv_counts[j][r] * int(np.prod(s)) for j, s in enumerate(shapes)) for r in range(layout.world)]
    handle = all_to_all(send, splits, recv_splits, layout.group, layout.timeout_s,
                        f"{what} ({layout.name}, step {layout.step})",
                        out=_buffer(layout, kind + ".recv", sum(recv_splits), send), async_op=True)
    sent = sum(splits[r] for r in range(layout.world) if r != layout.rank) * send.element_size()
    counts = layout.counters.bytes_sent
    counts[kind] = counts.get(kind, 0) + int(sent)
    return _Pending(handle, recv_counts, shapes, layout.world)


# ---- the phases of one wave; a schedule (below, or ping-pong's) decides what overlaps what ----

def launch_inputs(w: DispatchLayout, q, k, v) -> _Pending:
    """Forward, source side: send the query rows and K/V rows of moved tasks to their servers."""
    qs = _split_rows(q.index_select(0, w.send_q_rows), w.send_q_counts)
    ks = _split_rows(k.index_select(0, w.send_kv_rows), w.send_kv_counts)
    vs = _split_rows(v.index_select(0, w.send_kv_rows), w.send_kv_counts)
    return _start_exchange(w, [[a, b, c] for a, b, c in zip(qs, ks, vs)],
                           [w.recv_q_counts, w.recv_kv_counts, w.recv_kv_counts],
                           [tuple(q.shape[1:]), tuple(k.shape[1:]), tuple(v.shape[1:])],
                           "distca forward: sending q/k/v to servers", "forward_inputs")


@dataclass(eq=False)
class Served:
    """A wave's forward on its server: ``out_pool`` / ``lse_pool`` rows follow the query pool
    (``[local rows] ++ [received rows]``; rows of no task of this wave are zero), and the fused
    tensors its backward needs in ``saved`` mode."""

    out_pool: torch.Tensor
    lse_pool: torch.Tensor | None
    fq: torch.Tensor
    k_pool: torch.Tensor
    v_pool: torch.Tensor
    f_out: torch.Tensor
    f_lse: torch.Tensor


def serve_forward(w: DispatchLayout, q, k, v, received, scale: float, want_lse: bool) -> Served:
    """Forward, server side: run the wave's CA-tasks as one fused varlen batch."""
    served = w.served
    if received is None:
        q_pool, k_pool, v_pool = q, k, v
    else:
        q_pool, k_pool, v_pool = (torch.cat([a, b]) for a, b in zip((q, k, v), received))
    fq = q_pool.index_select(0, served.q_index)
    fk, fv = k_pool.index_select(0, served.k_index), v_pool.index_select(0, served.k_index)
    heads = q.shape[1]
    if w.num_tasks:
        with timeline.span(f"attention kernel ({w.name})"):
            f_out, f_lse = varlen_attention_forward(fq, fk, fv, served.cu_seqlens_q, served.cu_seqlens_k,
                                                    served.max_seqlen_q, served.max_seqlen_k, scale)
    else:
        f_out, f_lse = fq.new_empty(0, *q.shape[1:]), torch.empty(heads, 0, dtype=torch.float32, device=q.device)
    out_pool = q_pool.new_zeros(q_pool.shape).index_copy(0, served.q_index, f_out)
    lse_pool = None
    if want_lse:
        lse_pool = torch.zeros(q_pool.shape[0], heads, dtype=f_lse.dtype, device=q.device)
        lse_pool.index_copy_(0, served.q_index, f_lse.t())
    return Served(out_pool, lse_pool, fq, k_pool, v_pool, f_out, f_lse)


def launch_outputs(w: DispatchLayout, served: Served) -> list[_Pending]:
    """Forward, server side: return the outputs (and in ``resend`` mode, in a second exchange
    because it stays fp32, the log-sum-exp) of other sources' tasks."""
    n = w.num_local
    pending = [_start_exchange(w, [[o] for o in _split_rows(served.out_pool[n:], w.recv_q_counts)], [w.send_q_counts],
                               [tuple(served.out_pool.shape[1:])], "distca forward: returning outputs",
                               "forward_outputs")]
    if served.lse_pool is not None:
        pending.append(_start_exchange(w, [[x] for x in _split_rows(served.lse_pool[n:], w.recv_q_counts)],
                                       [w.send_q_counts], [tuple(served.lse_pool.shape[1:])],
                                       "distca forward: returning log-sum-exp", "forward_lse"))
    return pending


def place_outputs(w: DispatchLayout, pending: list[_Pending], out: torch.Tensor, lse: torch.Tensor | None):
    """Forward, source side: put the returned outputs (and log-sum-exp) in their rows, in place."""
    out.index_copy_(0, w.send_q_rows, pending[0].wait()[0])
    if lse is not None:
        lse.index_copy_(0, w.send_q_rows, pending[1].wait()[0])


def launch_grad_inputs(w: DispatchLayout, dout, resend: tuple | None) -> list[_Pending]:
    """Backward, source side: send dO of moved queries (``resend``: also q, k, v, out, and the fp32
    log-sum-exp in a second exchange, from the tuple ``(q, k, v, out, lse)`` of local rows)."""
    rows = lambda t: _split_rows(t.index_select(0, w.send_q_rows), w.send_q_counts)
    qshape = tuple(dout.shape[1:])
    if resend is None:
        return [_start_exchange(w, [[x] for x in rows(dout)], [w.recv_q_counts], [qshape],
                                "distca backward: sending dO to servers", "backward_inputs")]
    q, k, v, out, lse = resend
    krows = lambda t: _split_rows(t.index_select(0, w.send_kv_rows), w.send_kv_counts)
    kshape = tuple(k.shape[1:])
    sends = [list(p) for p in zip(rows(q), krows(k), krows(v), rows(out), rows(dout))]
    return [
        _start_exchange(w, sends, [w.recv_q_counts, w.recv_kv_counts, w.recv_kv_counts, w.recv_q_counts,
                                   w.recv_q_counts], [qshape, kshape, kshape, qshape, qshape],
                        "distca backward: resending q/k/v/out/dO", "backward_inputs"),
        _start_exchange(w, [[x] for x in rows(lse)], [w.recv_q_counts], [(lse.shape[1],)],
                        "distca backward: resending log-sum-exp", "backward_lse"),
    ]


def receive_all(pending: list[_Pending]) -> list[torch.Tensor]:
    return [t for p in pending for t in p.wait()]


def serve_backward(w: DispatchLayout, dout, received, saved, scale: float):
    """Backward, server side: the wave's fused backward. ``saved`` is ``(fq, k_pool, v_pool, f_out,
    f_lse)`` (``saved`` mode) or the source's ``(q, k, v, out, lse)`` (``resend`` mode, whose
    ``received`` then holds the other sources' q, k, v, out, dO, lse rows). ``received`` is empty for
    a local wave. Returns the gradient pools ``(dq_pool, dk_pool, dv_pool)``, local rows first."""
    served = w.served
    qshape = tuple(dout.shape[1:])
    if w.backward_mode == "saved":
        fq, k_pool, v_pool, f_out, f_lse = saved
        f_do = (torch.cat([dout, received[0]]) if received else dout).index_select(0, served.q_index)
        pool_rows = w.num_local + sum(w.recv_q_counts)
    else:
        q, k, v, out, lse = saved
        if received:
            rq, rk, rv, ro, rdo, rlse = received
            q, k, v, out, dout, lse = (torch.cat(p) for p in ((q, rq), (k, rk), (v, rv), (out, ro), (dout, rdo),
                                                             (lse, rlse)))
        fq, k_pool, v_pool = q.index_select(0, served.q_index), k, v
        f_out, f_do = out.index_select(0, served.q_index), dout.index_select(0, served.q_index)
        f_lse = lse.index_select(0, served.q_index).t().contiguous()
        pool_rows = q.shape[0]
    fk, fv = k_pool.index_select(0, served.k_index), v_pool.index_select(0, served.k_index)
    if w.num_tasks:
        with timeline.span(f"attention kernel backward ({w.name})"):
            fdq, fdk, fdv = varlen_attention_backward(f_do, fq, fk, fv, f_out, f_lse, served.cu_seqlens_q,
                                                      served.cu_seqlens_k, served.max_seqlen_q,
                                                      served.max_seqlen_k, scale)
    else:
        fdq, fdk, fdv = fq, fk, fv  # empty
    dq_pool = fq.new_zeros(pool_rows, *qshape).index_copy(0, served.q_index, fdq)
    dk_pool = fk.new_zeros(k_pool.shape).index_add(0, served.k_index, fdk)
    dv_pool = fv.new_zeros(v_pool.shape).index_add(0, served.k_index, fdv)
    return dq_pool, dk_pool, dv_pool


def launch_grad_outputs(w: DispatchLayout, pools) -> _Pending:
    """Backward, server side: return dQ, dK, dV of other sources' rows."""
    dq_pool, dk_pool, dv_pool = pools
    n, nk = w.num_local, w.num_local_kv
    back = [list(p) for p in zip(_split_rows(dq_pool[n:], w.recv_q_counts), _split_rows(dk_pool[nk:], w.recv_kv_counts),
                                 _split_rows(dv_pool[nk:], w.recv_kv_counts))]
    shapes = [tuple(dq_pool.shape[1:]), tuple(dk_pool.shape[1:]), tuple(dv_pool.shape[1:])]
    return _start_exchange(w, back, [w.send_q_counts, w.send_kv_counts, w.send_kv_counts], shapes,
                           "distca backward: returning dQ/dK/dV", "backward_outputs")


def place_grads(w: DispatchLayout, pending: _Pending, dq, dk, dv) -> None:
    """Backward, source side: add the returned gradients to their rows, in place (a K/V token used
    on several servers gets the sum)."""
    got_dq, got_dk, got_dv = pending.wait()
    dq.index_add_(0, w.send_q_rows, got_dq)
    dk.index_add_(0, w.send_kv_rows, got_dk)
    dv.index_add_(0, w.send_kv_rows, got_dv)


def kept_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class _DispatchedAttention(torch.autograd.Function):
    """Every wave of a dispatch inside one autograd node: remote waves' inputs are launched first,
    then the waves run in order (their outputs launched back as soon as computed) and the returns
    are placed at the end. Backward does the mirror image, waves in reverse order."""

    @staticmethod
    def forward(ctx, q, k, v, dispatch: Dispatch, scale: float):
        waves = dispatch.waves
        resend = waves[0].backward_mode == "resend"
        in_flight = {i: launch_inputs(w, q, k, v) for i, w in enumerate(waves) if not w.local_only}
        out = q.new_zeros(q.shape)
        lse = torch.zeros(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device) if resend else None
        returning, kept = [], []
        for i, w in enumerate(waves):
            received = in_flight[i].wait() if i in in_flight else None
            served = serve_forward(w, q, k, v, received, scale, want_lse=resend)
            out += served.out_pool[: w.num_local]  # rows of other waves' tasks are zero here
            if resend:
                lse += served.lse_pool[: w.num_local]
            if not w.local_only:
                returning.append((w, launch_outputs(w, served)))
            if not resend:
                kept.append((served.fq, served.k_pool, served.v_pool, served.f_out, served.f_lse))
        for w, pending in returning:
            place_outputs(w, pending, out, lse)
        ctx.dispatch, ctx.scale = dispatch, scale
        flat = [t for group in kept for t in group] if not resend else [q, k, v, out, lse]
        ctx.save_for_backward(*flat)
        if any(ctx.needs_input_grad[:3]):  # nothing is kept under no_grad
            # the local K/V pools of saved mode are the inputs themselves: count them once
            dispatch.counters.saved_bytes += kept_bytes({id(t): t for t in flat}.values())
        return out

    @staticmethod
    def backward(ctx, dout):
        dispatch, scale = ctx.dispatch, ctx.scale
        waves = dispatch.waves
        dout = dout.contiguous()
        saved = ctx.saved_tensors
        resend = waves[0].backward_mode == "resend"
        per_wave = (lambda i: saved) if resend else (lambda i: saved[5 * i : 5 * i + 5])
        order = list(reversed(range(len(waves))))
        in_flight = {i: launch_grad_inputs(waves[i], dout, saved if resend else None)
                     for i in order if not waves[i].local_only}
        dq = dout.new_zeros(dout.shape)
        dk = saved[1].new_zeros(waves[0].num_local_kv, *saved[1].shape[1:])  # saved[1]: k or a K/V pool
        dv = torch.zeros_like(dk)
        returning = []
        for i in order:
            w = waves[i]
            received = receive_all(in_flight[i]) if i in in_flight else []
            pools = serve_backward(w, dout, received, per_wave(i), scale)
            dq += pools[0][: w.num_local]
            dk += pools[1][: w.num_local_kv]
            dv += pools[2][: w.num_local_kv]
            if not w.local_only:
                returning.append((w, launch_grad_outputs(w, pools)))
        for w, pending in returning:
            place_grads(w, pending, dq, dk, dv)
        return dq, dk, dv, None, None


def dispatched_attention(q, k, v, dispatch: Dispatch, scale: float) -> torch.Tensor:
    """Causal attention of the rank's documents, computed where the plan says. q ``[tokens, heads,
    head_dim]``, k/v ``[tokens, kv_heads, head_dim]`` -> ``[tokens, heads, head_dim]``."""
    return _DispatchedAttention.apply(q, k, v, dispatch, scale)
