"""Ping-pong: two nano-batches per micro-batch, so one's dispatch hides behind the other's compute.

The micro-batch's documents are split into nano-batches A and B of equal tokens (``split_nano_batches``:
documents go whole to the lighter nano-batch by attention pairs; whole documents then move from the
larger to the smaller while one fits in the token difference, and at most one document is cut for
the rest: its prefix stays in A and its suffix goes to B, which then holds the prefix's K/V as
key-only rows). Each nano-batch gets its own plan. Per decoder layer the schedule is

    A: norm, q/k/v  | A: send q/k/v ---------->|
                    | B: norm, q/k/v           | B: send q/k/v ----------->|
                                               | A: attention, send O back |----------->|
                                                                           | B: attention, send O back --->|
                                                                           | A: o_proj, MLP             |
                                                                                          B: o_proj, MLP

so A's dispatch overlaps B's projections, B's dispatch A's attention kernel, A's return B's kernel and
B's return A's MLP. Each nano-batch's attention is three autograd nodes (launch, serve, finish); in
backward autograd runs nodes in reverse creation order as soon as they are ready, so the mirror
schedule follows: ``finish`` launches dO, ``serve`` waits for it, computes and launches dQ/dK/dV,
``launch`` waits for those, with the other nano-batch's backward compute in between.

The layer's stages (projections, MLP) are model specific: ``distca_hf.patches`` supplies them for
Llama-like decoder layers and installs the ping-pong decoder stack.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import step as step_module
from . import timeline
from .config import current_config
from .dispatch import (Dispatch, DispatchCounters, launch_grad_inputs, launch_grad_outputs, launch_inputs,
                       launch_outputs, place_grads, place_outputs, receive_all, serve_backward, serve_forward)
from .documents import PackedDocuments
from .planner import TokenBytes, pairs_of

__all__ = ["NanoSplit", "split_nano_batches", "PingPongStep", "plan_pingpong", "NanoAttention", "PINGPONG_HEADER"]

PINGPONG_HEADER = 2  # header flag: this rank runs the ping-pong stack (see step.py's header)


@dataclass(frozen=True, eq=False)
class NanoSplit:
    """Two nano-batches of one micro-batch's flat token stream ``[batch * seq]``.

    Attributes:
        rows_a, rows_b: ``[tokens_a]`` / ``[tokens_b]`` int64 rows of the micro-batch each nano-batch
            holds, in its order (padding rows, in no document, go to B).
        docs_a, docs_b: their documents, numbered in their own streams. B's key stream is
            ``[prefix rows of the cut document, taken from A] ++ [B's rows]``.
        prefix_rows: ``[prefix]`` int64 rows of A's stream whose K/V B needs (empty when no
            document was cut).
    """

    rows_a: np.ndarray
    rows_b: np.ndarray
    docs_a: PackedDocuments
    docs_b: PackedDocuments
    prefix_rows: np.ndarray

    @property
    def cut(self) -> bool:
        return self.prefix_rows.size > 0


def split_nano_batches(docs: PackedDocuments) -> NanoSplit:
    """Split a micro-batch's documents (no cache: ``past == 0``) into two nano-batches of equal
    tokens (A gets the odd one), balancing attention pairs as far as whole documents allow."""
    if docs.past.any() or docs.num_query_tokens != docs.num_key_tokens:
        raise ValueError("ping-pong splits training micro-batches; it cannot split a batch decoding with a KV cache")
    lengths = docs.lengths
    total = int(lengths.sum())
    want_a = (total + 1) // 2
    # Whole documents, heaviest first, to the nano-batch with fewer pairs so far.
    order = np.argsort(-lengths, kind="stable")
    in_a = np.zeros(docs.num_docs, dtype=bool)
    pairs = [0, 0]
    for d in order:
        side = 0 if pairs[0] <= pairs[1] else 1
        in_a[d] = side == 0
        pairs[side] += int(pairs_of(0, lengths[d]))
    # Then equal tokens: move whole documents from the larger nano-batch while one fits in the
    # difference, and cut one document for the rest (prefix in A, suffix in B).
    cut_doc, cut_at = -1, 0
    while True:
        excess = int(lengths[in_a].sum()) - want_a  # tokens A must give to B (negative: take from B)
        if excess == 0:
            break
        donor = in_a if excess > 0 else ~in_a
        candidates = np.flatnonzero(donor)
        fits = candidates[lengths[candidates] <= abs(excess)]
        if fits.size:
            move = fits[np.argmax(lengths[fits])]
            in_a[move] = not in_a[move]
            continue
        cut_doc = int(candidates[np.argmin(lengths[candidates])])  # every candidate is longer than |excess|
        cut_at = int(lengths[cut_doc]) - excess if excess > 0 else -excess
        break

    def rows_of(d, lo, hi):
        return np.arange(docs.q_starts[d] + lo, docs.q_starts[d] + hi, dtype=np.int64)

    # A: its whole documents, then the cut document's prefix (whose rows B's keys reuse).
    a_parts, a_lengths = [], []
    for d in np.flatnonzero(in_a):
        if d != cut_doc:
            a_parts.append(rows_of(d, 0, lengths[d]))
            a_lengths.append(int(lengths[d]))
    prefix_start = sum(a_lengths)
    if cut_doc >= 0:
        a_parts.append(rows_of(cut_doc, 0, cut_at))
        a_lengths.append(cut_at)
    # B: the cut document's suffix first (its keys continue the prefix rows), then whole documents.
    b_parts, b_lengths, b_past = [], [], []
    if cut_doc >= 0:
        b_parts.append(rows_of(cut_doc, cut_at, lengths[cut_doc]))
        b_lengths.append(int(lengths[cut_doc]))
        b_past.append(cut_at)
    for d in np.flatnonzero(~in_a):
        if d != cut_doc:
            b_parts.append(rows_of(d, 0, lengths[d]))
            b_lengths.append(int(lengths[d]))
            b_past.append(0)
    covered = np.zeros(docs.num_query_tokens, dtype=bool)
    for part in a_parts + b_parts:
        covered[part] = True
    padding = np.flatnonzero(~covered)
    rows_a = np.concatenate(a_parts) if a_parts else np.zeros(0, np.int64)
    rows_b = np.concatenate(b_parts + [padding]).astype(np.int64)

    a_len = np.asarray(a_lengths, dtype=np.int64)
    a_starts = np.concatenate(([0], np.cumsum(a_len)[:-1])).astype(np.int64)
    docs_a = PackedDocuments(a_len, np.zeros_like(a_len), a_starts, a_starts.copy(), rows_a.size, rows_a.size)
    prefix = cut_at if cut_doc >= 0 else 0
    b_len, b_past = np.asarray(b_lengths, dtype=np.int64), np.asarray(b_past, dtype=np.int64)
    b_queries = b_len - b_past
    b_q_starts = np.concatenate(([0], np.cumsum(b_queries)[:-1])).astype(np.int64)
    # key rows: the prefix occupies [0, prefix), then B's own rows; the cut document starts at key 0
    b_k_starts = b_q_starts + prefix - b_past
    docs_b = PackedDocuments(b_len, b_past, b_q_starts, b_k_starts, rows_b.size, rows_b.size + prefix)
    prefix_rows = np.arange(prefix_start, prefix_start + prefix, dtype=np.int64)
    return NanoSplit(rows_a, rows_b, docs_a, docs_b, prefix_rows)


@dataclass(eq=False)
class PingPongStep:
    """One forward's ping-pong state: the split and each nano-batch's dispatch (on the device)."""

    split: NanoSplit
    dispatch_a: Dispatch
    dispatch_b: Dispatch
    rows_a: torch.Tensor
    rows_b: torch.Tensor
    prefix_rows: torch.Tensor
    longest_document: int
    stats: dict


def plan_pingpong(docs: PackedDocuments | None, error: Exception | None, token_bytes: TokenBytes, device,
                  num_heads: int) -> PingPongStep:
    """Split this rank's micro-batch and plan both nano-batches with every rank of the server group
    (a collective: each rank sends its two nano-batches' document lengths; a rank whose inputs were
    invalid, ``error``, still joins so that every rank stops). Makes the step
    ``distca_hf.plan_stats()`` reports (its per-rank lists sum both nano-batches)."""
    config = current_config()
    group = config.group
    number = step_module.next_step_number()
    split = None
    if error is None:
        try:
            split = split_nano_batches(docs)
        except ValueError as e:
            error = e
    if split is not None:
        a, b = split.docs_a, split.docs_b
        mine = np.concatenate(([a.num_docs, b.num_docs], a.lengths, b.lengths, b.past)).astype(np.int64)
    else:
        mine = np.zeros(0, dtype=np.int64)
    _, per_rank = step_module.agree(mine, PINGPONG_HEADER, error, config, device, number, "ping-pong planning")
    nano = {"a": ([], []), "b": ([], [])}
    for x in per_rank:
        na, nb = int(x[0]), int(x[1])
        la, lb, pb = x[2 : 2 + na], x[2 + na : 2 + na + nb], x[2 + na + nb :]
        nano["a"][0].append(la), nano["a"][1].append(np.zeros_like(la))
        nano["b"][0].append(lb), nano["b"][1].append(pb)
    counters = DispatchCounters()
    dispatch_a, stats_a = step_module.plan_dispatch(a, *nano["a"], config, group, token_bytes, device, number,
                                                    num_heads, "none", counters)
    dispatch_b, stats_b = step_module.plan_dispatch(b, *nano["b"], config, group, token_bytes, device, number,
                                                    num_heads, "none", counters)
    for d in (dispatch_a, dispatch_b):
        for w in d.waves:
            w.name = "nano-batch " + ("A" if d is dispatch_a else "B")
    add = lambda key: [x + y for x, y in zip(stats_a[key], stats_b[key])]
    queries_a = int(sum(x.sum() for x in nano["a"][0]))  # all ranks' queries in each nano-batch
    queries_b = int(sum((n - past).sum() for n, past in zip(*nano["b"])))
    stats = {
        "attn_pairs_local": add("attn_pairs_local"),
        "attn_pairs_served": add("attn_pairs_served"),
        "bytes_sent_per_layer": stats_a["bytes_sent_per_layer"] + stats_b["bytes_sent_per_layer"],
        "step": number, "dispatched": True, "backward": config.backward, "overlap": "pingpong",
        "tasks": stats_a["tasks"] + stats_b["tasks"], "waves": 2,
        "moved_query_fraction": (stats_a["moved_query_fraction"] * queries_a
                                 + stats_b["moved_query_fraction"] * queries_b) / max(1, queries_a + queries_b),
        "nano_batches": [stats_a, stats_b],
    }
    longest = int(max((x[2:].max(initial=0) for x in per_rank), default=0))
    as_tensor = lambda x: torch.from_numpy(x).to(device)
    result = PingPongStep(split, dispatch_a, dispatch_b, as_tensor(split.rows_a), as_tensor(split.rows_b),
                          as_tensor(split.prefix_rows), longest, stats)
    step_module.set_current(step_module.Step(("pingpong", number), (), None, dispatch_a, stats, number, longest))
    return result


# ---- one nano-batch's attention as three autograd nodes ----

class _Flight:
    """What the three nodes of one nano-batch's attention in one layer hand to each other."""

    def __init__(self, dispatch: Dispatch, scale: float):
        self.layout = dispatch.waves[0]
        self.counters = dispatch.counters
        self.scale = scale
        self.resend = self.layout.backward_mode == "resend"
        self.inputs = self.outputs = self.grad_inputs = self.grads = None
        self.lse_local = None
        self.shapes = None


class _Launch(torch.autograd.Function):
    """Forward: send q/k/v rows to their servers. Backward: receive their dQ/dK/dV."""

    @staticmethod
    def forward(ctx, q, k, v, flight: _Flight):
        flight.shapes = (q.shape, k.shape)
        flight.inputs = launch_inputs(flight.layout, q, k, v)
        ctx.flight = flight
        return q.new_empty(0)

    @staticmethod
    def backward(ctx, _):
        flight = ctx.flight
        q_shape, k_shape = flight.shapes
        dq = torch.zeros(q_shape, dtype=flight.dtype, device=flight.device)
        dk = torch.zeros(k_shape, dtype=flight.dtype, device=flight.device)
        dv = torch.zeros_like(dk)
        place_grads(flight.layout, flight.grads, dq, dk, dv)
        flight.grads = None
        return dq, dk, dv, None


class _Serve(torch.autograd.Function):
    """Forward: receive, run this server's CA-tasks, send other sources' outputs back; returns the
    local rows' outputs. Backward: receive dO (and in resend mode the inputs), compute, send the
    other sources' gradients back; returns the local rows' gradients."""

    @staticmethod
    def forward(ctx, ticket, q, k, v, flight: _Flight):
        w = flight.layout
        served = serve_forward(w, q, k, v, flight.inputs.wait(), flight.scale, want_lse=flight.resend)
        flight.inputs = None
        flight.outputs = launch_outputs(w, served)
        out_local = served.out_pool[: w.num_local]
        flight.dtype, flight.device = q.dtype, q.device
        if flight.resend:
            flight.lse_local = served.lse_pool[: w.num_local]
            kept = (q, k, v, out_local, flight.lse_local)
        else:
            kept = (served.fq, served.k_pool, served.v_pool, served.f_out, served.f_lse)
        ctx.save_for_backward(*kept)
        if any(ctx.needs_input_grad[1:4]):
            flight.counters.saved_bytes += sum(t.numel() * t.element_size() for t in kept)
        ctx.flight = flight
        return ticket.new_empty(0), out_local

    @staticmethod
    def backward(ctx, _, dout):
        flight = ctx.flight
        w = flight.layout
        dout = dout.contiguous()
        pools = serve_backward(w, dout, receive_all(flight.grad_inputs), ctx.saved_tensors, flight.scale)
        flight.grad_inputs = None
        flight.grads = launch_grad_outputs(w, pools)
        n, nk = w.num_local, w.num_local_kv
        return dout.new_empty(0), pools[0][:n], pools[1][:nk], pools[2][:nk], None


class _Finish(torch.autograd.Function):
    """Forward: place the returned outputs. Backward: send dO of the moved queries (resend mode: with
    their q, k, v, out and log-sum-exp)."""

    @staticmethod
    def forward(ctx, ticket, out_local, q, k, v, flight: _Flight):
        out = out_local.clone()
        lse = flight.lse_local.clone() if flight.resend else None
        place_outputs(flight.layout, flight.outputs, out, lse)
        flight.outputs = flight.lse_local = None
        if flight.resend:
            ctx.save_for_backward(q, k, v, out, lse)
        ctx.flight = flight
        return out

    @staticmethod
    def backward(ctx, dout):
        flight = ctx.flight
        dout = dout.contiguous()
        flight.grad_inputs = launch_grad_inputs(flight.layout, dout, ctx.saved_tensors if flight.resend else None)
        # Only the rows of this server's own tasks matter to _Serve's backward: the moved queries'
        # rows of out_local are zeros that _Finish overwrote.
        return dout.new_empty(0), dout, None, None, None, None


class NanoAttention:
    """One nano-batch's dispatched attention in one layer, in three steps the schedule interleaves.
    q ``[tokens, heads, head_dim]``, k/v ``[key tokens, kv_heads, head_dim]``."""

    def __init__(self, dispatch: Dispatch, scale: float, name: str):
        self.flight = _Flight(dispatch, scale)
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
