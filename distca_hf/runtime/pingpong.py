"""Ping-pong: two nano-batches per micro-batch, so one's dispatch hides behind the other's compute.

The micro-batch's documents are split into nano-batches A and B of equal tokens
(``planning.splits.split_nano_batches``: at most one document is cut, its prefix in A and its
suffix in B, which then holds the prefix's K/V as key-only rows). Each nano-batch gets its own plan
(two, for a model mixing sliding and full layers: one per kind of layer, ``PingPongPlan.sliding``).
Per decoder layer the schedule is

    A: norm, q/k/v  | A: send q/k/v ---------->|
                    | B: norm, q/k/v           | B: send q/k/v ----------->|
                                               | A: attention, send O back |----------->|
                                                                           | B: attention, send O back --->|
                                                                           | A: o_proj, MLP             |
                                                                                          B: o_proj, MLP

so A's dispatch overlaps B's projections, B's dispatch A's attention kernel, A's return B's kernel and
B's return A's MLP. (With relayed K/V, B's send waits for A's relay rounds and A's return for B's:
``issue_queue.IssueQueue``, one per forward, ``PingPongPlan.issue_queue``.) Each nano-batch's
attention is three autograd nodes (launch, serve, finish); in backward autograd runs nodes in reverse creation order as soon as they are ready, so the mirror
schedule follows: ``finish`` launches dO, ``serve`` waits for it, computes and launches dQ/dK/dV,
``launch`` waits for those, with the other nano-batch's backward compute in between.

The layer's stages (projections, MLP) are model specific: ``distca_hf.patches`` supplies them for
Llama-like decoder layers and installs the ping-pong decoder stack.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from ..config import current_config
from ..kernels import AttentionVariant
from ..planning import (NanoSplit, PackedDocuments, RankDocuments, TokenBytes, assign_nano_batches, check_splittable,
                        rank_documents, split_nano_batches, stitch_rank_documents)
from . import timeline
from .agree import PATH_PINGPONG, agree
from .context import ForwardContext, begin_forward, next_forward_number, plan_stats_of, planned_windows
from .dispatch import Dispatch
from .forward import plan_batch
from .issue_queue import IssueQueue
from .phases import (kept_bytes, launch_grad_inputs, launch_grad_outputs, launch_inputs, launch_outputs, merge_outputs,
                     place_grads, place_outputs, receive_all, returned_partials, serve_backward, serve_forward)
from .tables import DispatchCounters

__all__ = ["PingPongPlan", "plan_pingpong", "NanoAttention"]


@dataclass(eq=False)
class PingPongPlan:
    """One forward's ping-pong state: the split and each nano-batch's dispatch (on the device).

    Attributes:
        split: the two nano-batches (``planning.splits.NanoSplit``).
        dispatch_a, dispatch_b: their dispatches for the full layers, or every layer of a model of one
            kind (one wave each; every dispatch of the forward shares its byte counters).
        rows_a, rows_b, prefix_rows, pinned_rows: ``split``'s row indices as device tensors.
        longest_document: tokens of the longest document over every rank of the server group.
        issue_queue: the order in which both nano-batches' exchanges are issued, every layer's
            (``IssueQueue``; give it to each ``NanoAttention``).
        sliding: ``{window: (dispatch_a, dispatch_b)}``: for a model mixing sliding and full layers
            (``hf.mixed_sliding_window``), the nano-batches' dispatches of its sliding layers, planned
            under their window (``dispatches_for``); the two above are the full layers'.
    """

    split: NanoSplit
    dispatch_a: Dispatch
    dispatch_b: Dispatch
    rows_a: torch.Tensor
    rows_b: torch.Tensor
    prefix_rows: torch.Tensor
    pinned_rows: torch.Tensor
    longest_document: int
    issue_queue: IssueQueue = field(default_factory=IssueQueue)
    sliding: dict = field(default_factory=dict)

    def dispatches_for(self, window: int | None) -> tuple[Dispatch, Dispatch]:
        """Nano-batches A's and B's dispatches for a layer of sliding ``window`` (``None``: whole prefixes):
        the ones planned for that window, else the full layers' (their K/V cover every window)."""
        return self.sliding.get(window, (self.dispatch_a, self.dispatch_b)) if window is not None else \
            (self.dispatch_a, self.dispatch_b)

    def keys_b(self, k_a: torch.Tensor, k_b: torch.Tensor) -> torch.Tensor:
        """Nano-batch B's key (or value) stream from both nano-batches' rows: ``[A's cut prefix] ++
        [B's rows] ++ [A's pinned document]`` (B attends to those K/V rows of A as well)."""
        if not self.split.cut and self.pinned_rows.numel() == 0:
            return k_b
        return torch.cat([k_a.index_select(0, self.prefix_rows), k_b, k_a.index_select(0, self.pinned_rows)])


def plan_pingpong(docs: PackedDocuments | None, error: Exception | None, token_bytes: TokenBytes, device,
                  num_heads: int, first_position: int = 0, *, kv_window: int | None = None,
                  dtype_bytes: int | None = None, key_split: bool = False,
                  signature: tuple[int, ...] | None = None, sliding_window: int | None = None) -> PingPongPlan:
    """Split this rank's micro-batch and plan both nano-batches with every rank of the server group
    (a collective: each rank sends its first position and document lengths, as the attention
    function's forward does; a rank whose inputs were invalid, ``error``, still joins so that every
    rank stops). Every rank then splits every rank's documents alike (``assign_nano_batches``: with
    ``span_ranks``, a row's last document that continues on the next rank stays whole in A). Opens
    the forward whose ``distca_hf.plan_stats()`` sums both nano-batches. ``kv_window``: the widest
    sliding window of the model's layers (see ``runtime.forward.context_for_call``); ``dtype_bytes``:
    bytes of an attention element (see ``plan_batch``); ``key_split``: ``tolerance="auto"`` may weigh
    key-split tiles for both nano-batches (``runtime.forward.tiles_hold_for`` of the model's attention
    layers decides, as for a forward without ping-pong); ``signature``: the layers' ``agree.attention_signature``
    (every rank's must be the same); ``sliding_window``: the window of a mixed model's sliding layers
    (``hf.mixed_sliding_window``), whose nano-batches are planned again under it (``PingPongPlan.sliding``)."""
    config = current_config()
    number = next_forward_number()
    if error is None:
        try:
            check_splittable(docs)
        except ValueError as e:  # joins the collective first, so every rank stops
            error = e
    lengths = docs.lengths if docs is not None else np.zeros(0, dtype=np.int64)
    _, gathered = agree(np.concatenate(([first_position], lengths)), PATH_PINGPONG, error, config, device, number,
                        "ping-pong planning", signature=signature)
    per_rank, first_positions = [x[1:] for x in gathered], [int(x[0]) for x in gathered]
    rows = stitch_rank_documents(per_rank, [np.zeros_like(x) for x in per_rank], first_positions,
                                 span_ranks=config.span_ranks)
    assignments = [assign_nano_batches(per_rank[r], pin_last=_continues_on_next_rank(rows, r))
                   for r in range(len(per_rank))]
    split = split_nano_batches(docs, assignments[dist.get_rank(config.group)])
    counters = DispatchCounters()
    worlds = (("A", split.docs_a, _nano_world(rows, per_rank, assignments, 0)),
              ("B", split.docs_b, _nano_world(rows, per_rank, assignments, 1)))
    by_window = {}  # window -> (both nano-batches' dispatches, their BatchPlans), in the order every rank plans
    for window in planned_windows(kv_window, sliding_window):
        dispatches, planned = [], []
        for name, nano_docs, world_docs in worlds:
            # each nano-batch's dispatch runs without waves; the other nano-batch's compute hides its
            # communication, which "auto" counts as ping-pong's exposure
            dispatch, batch = plan_batch(nano_docs, world_docs, config, token_bytes, device, number, "none",
                                         counters, kv_window=window, dtype_bytes=dtype_bytes,
                                         planning_overlap="pingpong", key_split=key_split)
            for w in dispatch.waves:
                w.name = "nano-batch " + name + (", sliding layers" if window != kv_window else "")
            dispatches.append(dispatch)
            planned.append(batch)
        by_window[window] = (tuple(dispatches), planned)
    (dispatches, planned), sliding = by_window.pop(kv_window), by_window
    stats = plan_stats_of(number, planned, token_bytes=token_bytes, num_heads=num_heads, overlap="pingpong")
    for window, (_, sliding_planned) in sliding.items():  # (at most one)
        stats = stats.with_sliding_layers(window, plan_stats_of(number, sliding_planned, token_bytes=token_bytes,
                                                                num_heads=num_heads, overlap="pingpong"))
    begin_forward(ForwardContext(number, ("pingpong", number), (), rows.longest_document, stats, counters=counters))
    as_tensor = lambda x: torch.from_numpy(x).to(device)
    return PingPongPlan(split, *dispatches, as_tensor(split.rows_a), as_tensor(split.rows_b),
                        as_tensor(split.prefix_rows), as_tensor(split.pinned_rows), rows.longest_document,
                        sliding={w: d for w, (d, _) in sliding.items()})


def _continues_on_next_rank(rows: RankDocuments, rank: int) -> bool:
    """Whether ``rank``'s last document goes on on the next rank (``span_ranks``)."""
    ids = rows.global_ids
    return rank + 1 < len(ids) and ids[rank].size > 0 and ids[rank + 1].size > 0 and ids[rank + 1][0] == ids[rank][-1]


def _nano_world(rows: RankDocuments, per_rank, assignments, which: int) -> RankDocuments:
    """Every rank's documents of nano-batch A (``which`` 0) or B (1), with their global ids and
    positions from the micro-batch's stitching."""
    parts = [assignment.documents(lengths)[which] for assignment, lengths in zip(assignments, per_rank)]
    origin = [np.asarray([d for d, _, _ in p], dtype=np.int64) for p in parts]
    return rank_documents([ids[o] for ids, o in zip(rows.global_ids, origin)],
                          [offsets[o] for offsets, o in zip(rows.offsets, origin)],
                          [np.asarray([n for _, n, _ in p], dtype=np.int64) for p in parts],
                          [np.asarray([past for _, _, past in p], dtype=np.int64) for p in parts])


# ---- one nano-batch's attention as three autograd nodes ----

class _Flight:
    """What the three nodes of one nano-batch's attention in one layer hand to each other."""

    def __init__(self, dispatch: Dispatch, scale: float, variant: AttentionVariant, queue: IssueQueue):
        self.wave = dispatch.waves[0]
        self.queue = queue
        self.relayed = bool(self.wave.relays)
        self.counters = dispatch.counters
        self.scale, self.variant = scale, variant
        self.resend = self.wave.backward_mode == "resend"
        self.merges = self.wave.merges  # a key-split plan: a row's partials merged in _Finish
        self.lse_local = self.merged = None
        self.shapes = self.dtype = self.device = None  # of q, k and v, set by the forward

    def issue(self, name: str, launch, *, opens_relays: bool = False) -> None:
        """Launch an exchange (``inputs``, ``outputs``, ``grad_inputs``, ``grads``) through the forward's
        ``IssueQueue``."""
        self.queue.issue((self, name), launch, opens_relays_of=self if opens_relays else None)

    def take(self, name: str):
        """The pending exchange ``name`` (issued now if it was held)."""
        return self.queue.take((self, name))

    def pools_ready(self):
        """The serve functions' hook: this nano-batch's relay rounds are issued (None without relays)."""
        return (lambda: self.queue.relays_issued(self)) if self.relayed else None


class _Launch(torch.autograd.Function):
    """Forward: send q/k/v rows to their servers. Backward: receive their dQ/dK/dV."""

    @staticmethod
    def forward(ctx, q, k, v, flight: _Flight):
        flight.shapes = (q.shape, k.shape, v.shape)
        flight.issue("inputs", lambda: launch_inputs(flight.wave, q, k, v), opens_relays=flight.relayed)
        ctx.flight = flight
        return q.new_empty(0)

    @staticmethod
    def backward(ctx, _):
        flight = ctx.flight
        q_shape, k_shape, v_shape = flight.shapes
        dq = torch.zeros(q_shape, dtype=flight.dtype, device=flight.device)
        dk = torch.zeros(k_shape, dtype=flight.dtype, device=flight.device)
        dv = torch.zeros(v_shape, dtype=flight.dtype, device=flight.device)
        place_grads(flight.wave, flight.take("grads"), dq, dk, dv)
        return dq, dk, dv, None


class _Serve(torch.autograd.Function):
    """Forward: receive, run this server's CA-tasks, send other sources' outputs back; returns the
    local rows' outputs. Backward: receive dO (and in resend mode the inputs), compute, send the
    other sources' gradients back; returns the local rows' gradients."""

    @staticmethod
    def forward(ctx, ticket, q, k, v, flight: _Flight):
        w = flight.wave
        served = serve_forward(w, q, k, v, flight.take("inputs").wait(), flight.scale, want_lse=flight.resend,
                               variant=flight.variant, pools_ready=flight.pools_ready())
        flight.issue("outputs", lambda: launch_outputs(w, served))
        out_local = served.out_pool[: w.num_local]
        flight.dtype, flight.device = q.dtype, q.device
        if flight.resend or flight.merges:
            flight.lse_local = served.lse_pool[: w.num_local]
        # resend: q, k, v only, and backward takes the rows' out and lse from _Finish (flight.merged),
        # which keeps them anyway; out_local and lse_local are views of the whole pool, rows served for
        # other sources included, so keeping them would keep that pool alive until backward
        if flight.resend:
            kept = (q, k, v)
        elif flight.merges:  # backward takes the merged out and lse from _Finish (flight.merged)
            kept = (served.fq, served.k_pool, served.v_pool)
        else:
            kept = (served.fq, served.k_pool, served.v_pool, served.f_out, served.f_lse)
        ctx.save_for_backward(*kept)
        if any(ctx.needs_input_grad[1:4]):
            flight.counters.saved_bytes += kept_bytes(kept)
        ctx.flight = flight
        return ticket.new_empty(0), out_local

    @staticmethod
    def backward(ctx, _, dout):
        flight = ctx.flight
        w = flight.wave
        dout = dout.contiguous()
        saved, merged = ctx.saved_tensors, flight.merged
        if flight.resend:  # _Serve kept q, k, v: _Finish's out and lse complete them
            saved, merged = (*saved, *merged), None
        pools = serve_backward(w, dout, receive_all(flight.take("grad_inputs")), saved, flight.scale, flight.variant,
                               merged, pools_ready=flight.pools_ready() if flight.resend else None)
        flight.merged = None
        flight.issue("grads", lambda: launch_grad_outputs(w, pools))
        n, nk = w.num_local, w.num_local_kv
        return dout.new_empty(0), pools[0][:n], pools[1][:nk], pools[2][:nk], None


class _Finish(torch.autograd.Function):
    """Forward: place the returned outputs. Backward: send dO of the moved queries (resend mode: with
    their q, k, v, out and log-sum-exp)."""

    @staticmethod
    def forward(ctx, ticket, out_local, q, k, v, flight: _Flight):
        w = flight.wave
        returned = flight.take("outputs")
        if flight.merges:
            rows = torch.arange(w.num_local, device=out_local.device)
            out, lse = merge_outputs([(rows, out_local, flight.lse_local), returned_partials(w, returned)],
                                     w.num_local)
        else:
            out = out_local.clone()
            lse = flight.lse_local.clone() if flight.resend else None
            place_outputs(w, returned, out, lse)
        flight.lse_local = None
        if flight.merges and not flight.resend:
            ctx.save_for_backward(out, lse)
            if ctx.needs_input_grad[1]:  # what _Serve does not keep: the rows' merged out and lse
                flight.counters.saved_bytes += kept_bytes((out, lse))
        elif flight.resend:
            ctx.save_for_backward(q, k, v, out, lse)
            if ctx.needs_input_grad[1]:  # _Serve kept q, k, v only: the rows' out and lse
                flight.counters.saved_bytes += kept_bytes((out, lse))
        ctx.flight = flight
        return out

    @staticmethod
    def backward(ctx, dout):
        flight = ctx.flight
        dout = dout.contiguous()
        saved = ctx.saved_tensors
        if flight.merges or flight.resend:  # _Serve's backward runs every task with the rows' out and lse
            flight.merged = tuple(saved[-2:])
        resent, merged = (saved, None) if flight.resend else (None, flight.merged)  # (read now: the issue may wait)
        flight.issue("grad_inputs", lambda: launch_grad_inputs(flight.wave, dout, resent, merged),
                     opens_relays=flight.relayed and flight.resend)  # resend mode relays before its kernel
        # Only the rows of this server's own tasks matter to _Serve's backward: the moved queries'
        # rows of out_local are zeros that _Finish overwrote.
        return dout.new_empty(0), dout, None, None, None, None


class NanoAttention:
    """One nano-batch's dispatched attention in one layer, in three steps the schedule interleaves.
    q ``[tokens, heads, head_dim]``, k/v ``[key tokens, kv_heads, head_dim]``; ``variant``: the layer's
    sliding window and softcap; ``queue``: the ``IssueQueue`` both nano-batches share
    (``PingPongPlan.issue_queue``; a nano-batch alone gets its own)."""

    def __init__(self, dispatch: Dispatch, scale: float, name: str, *,
                 variant: AttentionVariant = AttentionVariant(), queue: IssueQueue | None = None):
        self.flight = _Flight(dispatch, scale, variant, queue if queue is not None else IssueQueue())
        self.name = name

    def launch(self, q, k, v):
        self.q, self.k, self.v = q, k, v
        with timeline.span(f"{self.name}: pack q/k/v"):
            self.ticket = _Launch.apply(q, k, v, self.flight)

    def serve(self):
        with timeline.span(f"{self.name}: attention"):
            self.ticket, self.out_local = _Serve.apply(self.ticket, self.q, self.k, self.v, self.flight)

    def finish(self) -> torch.Tensor:
        with timeline.span(f"{self.name}: place outputs"):
            out = _Finish.apply(self.ticket, self.out_local, self.q, self.k, self.v, self.flight)
        self.q = self.k = self.v = self.ticket = self.out_local = None
        return out
