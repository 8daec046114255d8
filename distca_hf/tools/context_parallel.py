"""Per-document context parallelism (CP): the baseline ``distca-hf bench --workload long`` measures
distca against.

The ranks hold consecutive slices of one global token stream (as with ``span_ranks=True``). A
document with tokens on several ranks (a *spanning* document) is run the way CP implementations run
a sequence (Megatron-LM, torchtitan, Llama 3's all-gather CP): its tokens are cut into ``2n``
chunks for its ``n`` holders and holder ``i`` keeps chunks ``i`` and ``2n - 1 - i`` (head-tail), so
that every holder gets early, cheap queries and late, expensive ones; in every layer each holder
all-gathers the document's whole K/V from the other holders and computes its two chunks against
their prefixes; the backward sends each K/V gradient back to the holder of its token and sums it
there. Whole documents are computed where they are. The chunks are equal, as in CP
implementations, so a holder whose piece was shorter than ``length / n`` (a rank that also holds
whole documents) ends up with more tokens than the others; with equal pieces every rank keeps its
token count.

Layout (pure): ``stream_segments`` (each rank's slice as document runs), ``head_tail_chunks``,
``head_tail_segments`` (the CP layout), ``segment_tokens`` / ``segment_positions`` (a rank's row
as stream indices and ``position_ids``), ``segment_pairs`` / ``piece_pairs`` (attention pairs per
rank with whole prefixes / with each piece alone).
Runtime: ``cp_exchange`` (this rank's index tables, the same every layer), ``cp_attention`` (exact
forward and backward over one process group, the distca kernels), ``cp_attention_forward`` (the HF
attention function, registered as ``"distca_cp"`` by ``register``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .. import kernels
from ..config import current_config
from ..hf import distca_mask
from ..planning import baselines
from ..planning.cost import causal_pairs
from ..runtime.comm import all_to_all

__all__ = ["CP_IMPLEMENTATION", "Segment", "CPExchange", "stream_segments", "head_tail_chunks", "head_tail_segments",
           "segment_tokens", "segment_positions", "segment_pairs", "piece_pairs", "cp_exchange", "cp_attention",
           "cp_attention_forward", "register"]

CP_IMPLEMENTATION = "distca_cp"


@dataclass(frozen=True)
class Segment:
    """A run of one document's tokens in a rank's row: tokens ``[start, end)`` of document ``doc``
    (index in the global stream). ``spanning``: the document also has tokens on other ranks."""

    doc: int
    start: int
    end: int
    spanning: bool

    @property
    def length(self) -> int:
        return self.end - self.start


def stream_segments(doc_lengths: list[int], tokens_per_rank: int, world: int) -> list[list[Segment]]:
    """Rank ``r`` holds tokens ``[r T, (r + 1) T)`` of the stream of documents ``doc_lengths``;
    returns each rank's row as segments, in row order."""
    if sum(doc_lengths) != tokens_per_rank * world or min(doc_lengths, default=0) < 1:
        raise ValueError(f"{len(doc_lengths)} documents of {sum(doc_lengths)} tokens (each >= 1) must fill "
                         f"{world} ranks of {tokens_per_rank} tokens exactly")
    starts = np.cumsum([0, *doc_lengths])
    rows = []
    for r in range(world):
        lo, hi = r * tokens_per_rank, (r + 1) * tokens_per_rank
        row = []
        for d, (s, e) in enumerate(zip(starts[:-1], starts[1:])):
            if max(lo, s) < min(hi, e):
                row.append(Segment(d, int(max(lo, s) - s), int(min(hi, e) - s), bool(s < lo or e > hi)))
        rows.append(row)
    return rows


def head_tail_chunks(length: int, holders: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """A document of ``length`` tokens cut into ``2 n`` chunks for ``n = holders`` ranks, as CP
    implementations cut a sequence (equal sizes, the remainder one token each to the first chunks):
    holder ``i`` gets chunk ``i`` (its head) and chunk ``2n - 1 - i`` (its tail). Returns per holder
    ``((head start, end), (tail start, end))`` in document positions."""
    head_start, head_end, tail_start, tail_end = (a.tolist() for a in baselines.head_tail_chunks(length, holders))
    return list(zip(zip(head_start, head_end), zip(tail_start, tail_end)))


def head_tail_segments(stream: list[list[Segment]]) -> list[list[Segment]]:
    """The per-document CP layout of ``stream`` (from ``stream_segments``): every spanning piece is
    replaced, in place, by its holder's head and tail chunks (empty ones left out); whole documents
    stay where they are. A holder's row grows or shrinks by the difference between its chunks and its
    piece (none when the pieces are equal): the linear layers' cost of keeping whole documents in
    place."""
    holders: dict[int, list[int]] = {}
    lengths: dict[int, int] = {}
    for r, row in enumerate(stream):
        for s in row:
            if s.spanning:
                holders.setdefault(s.doc, []).append(r)
                lengths[s.doc] = max(lengths.get(s.doc, 0), s.end)
    chunks = {d: dict(zip(ranks, head_tail_chunks(lengths[d], len(ranks)))) for d, ranks in holders.items()}
    layout = []
    for r, row in enumerate(stream):
        new = []
        for s in row:
            new += [Segment(s.doc, a, b, True) for a, b in chunks[s.doc][r] if b > a] if s.spanning else [s]
        layout.append(new)
    return layout


def segment_tokens(row: list[Segment], doc_lengths: list[int]) -> np.ndarray:
    """Indices into the global stream of the tokens of ``row``, in row order (int64 ``[tokens]``)."""
    starts = np.cumsum([0, *doc_lengths])
    return np.concatenate([np.arange(starts[s.doc] + s.start, starts[s.doc] + s.end) for s in row]).astype(np.int64)


def segment_positions(row: list[Segment]) -> np.ndarray:
    """``position_ids`` of ``row``: each token's position in its document (int64 ``[tokens]``)."""
    return np.concatenate([np.arange(s.start, s.end) for s in row]).astype(np.int64)


def segment_pairs(layout: list[list[Segment]]) -> list[int]:
    """Attention pairs each rank computes when every query sees its document's whole prefix."""
    return [int(sum(causal_pairs(s.start, s.end) for s in row)) for row in layout]


def piece_pairs(layout: list[list[Segment]]) -> list[int]:
    """Attention pairs each rank computes when each piece attends to itself only (no communication:
    for a spanning document this is *not* its attention, only a lower bound of the work)."""
    return [int(sum(causal_pairs(0, s.length) for s in row)) for row in layout]


@dataclass(frozen=True)
class CPExchange:
    """This rank's index tables for per-document CP in one step (every layer reuses them).

    own_rows:     ``[n_own]`` int64, the rows of this rank's spanning chunks (the K/V it shares)
    send_index:   ``[n_send]`` int64, indices into ``own_rows``, grouped by destination in rank order
    send_splits, recv_splits: rows to / from each rank of ``group``
    assemble:     per spanning document held here, ``[document tokens]`` int64 indices into
                  ``cat(own rows, received rows)``: the document's whole K/V in position order
    local_runs:   ``(row start, row end, cu_seqlens [n + 1] int32, longest)`` per run of whole documents
    chunks:       ``(row start, row end, j, key end, cu_q, cu_k)``: the chunk's queries attend to keys
                  ``[0, key end)`` of document ``assemble[j]``
    exchanges:    some rank of the group holds a spanning document (else no collective runs)
    group:        the process group whose ranks hold the rows (``None``: the default group)
    """

    own_rows: torch.Tensor
    send_index: torch.Tensor
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    assemble: tuple[torch.Tensor, ...]
    local_runs: tuple
    chunks: tuple
    exchanges: bool
    group: object = None


def _own_and_sent(layout: list[list[Segment]], rank: int):
    """This rank's spanning segments with their row start and offset among the shared rows; the
    shared rows; and per destination the indices (into the shared rows) it sends."""
    bounds = np.cumsum([0, *[s.length for s in layout[rank]]]).tolist()
    spans, own_rows = [], []
    for s, row_start in zip(layout[rank], bounds):
        if s.spanning:
            spans.append((s, row_start, len(own_rows)))
            own_rows.extend(range(row_start, row_start + s.length))
    sent = []
    for dest, row in enumerate(layout):
        theirs = {s.doc for s in row if s.spanning} if dest != rank else set()
        sent.append([i for s, _, o in spans if s.doc in theirs for i in range(o, o + s.length)])
    return spans, own_rows, sent


def cp_exchange(layout: list[list[Segment]], rank: int, device="cpu", group=None) -> CPExchange:
    """Rank ``rank``'s tables for ``layout`` (``head_tail_segments``; rank ``r`` of the layout is
    rank ``r`` of ``group``). Every rank sends its chunks of a spanning document to every other
    holder, in the order the holder's tables expect (both walk the sender's row in order)."""
    spans, own_rows, sent = _own_and_sent(layout, rank)
    docs = list(dict.fromkeys(s.doc for s, _, _ in spans))
    pieces = {d: [(s.start, s.end, o) for s, _, o in spans if s.doc == d] for d in docs}
    at, recv_splits = len(own_rows), []
    for src, row in enumerate(layout):
        n = 0
        for s in row if src != rank else []:
            if s.spanning and s.doc in pieces:
                pieces[s.doc].append((s.start, s.end, at + n))
                n += s.length
        at, recv_splits = at + n, recv_splits + [n]
    assemble = []
    for d in docs:
        index = np.full(max(e for _, e, _ in pieces[d]), -1, dtype=np.int64)
        for a, e, o in pieces[d]:
            index[a:e] = np.arange(o, o + e - a)
        if (index < 0).any():
            raise ValueError(f"per-document CP: the holders of document {d} do not cover all of its tokens")
        assemble.append(torch.from_numpy(index).to(device))

    def cu(*lengths):
        return torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int32, device=device)

    bounds = np.cumsum([0, *[s.length for s in layout[rank]]]).tolist()
    runs, chunks = [], []
    for s, a in zip(layout[rank], bounds):
        if s.spanning:
            chunks.append((a, a + s.length, docs.index(s.doc), s.end, cu(s.length), cu(s.end)))
        elif runs and runs[-1][1] == a:
            runs[-1] = (runs[-1][0], a + s.length, runs[-1][2] + [s.length])
        else:
            runs.append((a, a + s.length, [s.length]))
    long = torch.long
    return CPExchange(
        own_rows=torch.tensor(own_rows, dtype=long, device=device),
        send_index=torch.tensor([i for dest in sent for i in dest], dtype=long, device=device),
        send_splits=tuple(len(dest) for dest in sent), recv_splits=tuple(recv_splits), assemble=tuple(assemble),
        local_runs=tuple((a, b, cu(*lengths), max(lengths)) for a, b, lengths in runs), chunks=tuple(chunks),
        exchanges=any(s.spanning for row in layout for s in row), group=group)


class _CPAttention(torch.autograd.Function):
    """Forward: the K/V all-gather travels while the whole documents compute; then each chunk runs
    against its document's prefix. Backward: the chunks' dK/dV are summed per document token and
    sent back to the token's holder while the whole documents' backward runs."""

    @staticmethod
    def forward(ctx, q, k, v, ex: CPExchange, scale: float):
        timeout, (heads_kv, dim) = current_config().timeout_s, k.shape[1:]
        kv_own = torch.stack([k.index_select(0, ex.own_rows), v.index_select(0, ex.own_rows)], 1)
        width = 2 * heads_kv * dim  # elements of one token's K and V
        if ex.exchanges:
            handle = all_to_all(kv_own.index_select(0, ex.send_index).reshape(-1), [n * width for n in ex.send_splits],
                                [n * width for n in ex.recv_splits], ex.group, timeout,
                                "per-document CP: K/V all-gather", async_op=True)
        out, lses = torch.empty_like(q), []
        for a, b, cu, longest in ex.local_runs:
            out[a:b], lse = kernels.varlen_attention_forward(q[a:b], k[a:b], v[a:b], cu, cu, longest, longest, scale)
            lses.append(lse)
        received = handle.wait().view(-1, 2, heads_kv, dim) if ex.exchanges else kv_own[:0]
        source = torch.cat([kv_own, received]).transpose(0, 1)  # [2, rows, kv_heads, dim]
        full = [source.index_select(1, index) for index in ex.assemble]  # each document's whole K/V
        del source
        for a, b, j, end, cu_q, cu_k in ex.chunks:
            out[a:b], lse = kernels.varlen_attention_forward(q[a:b], full[j][0, :end], full[j][1, :end], cu_q, cu_k,
                                                             b - a, end, scale)
            lses.append(lse)
        ctx.save_for_backward(q, k, v, out, *full, *lses)
        ctx.ex, ctx.scale, ctx.documents = ex, scale, len(full)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, *saved = ctx.saved_tensors
        ex, scale, timeout = ctx.ex, ctx.scale, current_config().timeout_s
        full, lses = saved[:ctx.documents], saved[ctx.documents:]
        dout, local = dout.contiguous(), len(ex.local_runs)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        dfull = [torch.zeros_like(f) for f in full]
        for (a, b, j, end, cu_q, cu_k), lse in zip(ex.chunks, lses[local:]):
            dq[a:b], dk_, dv_ = kernels.varlen_attention_backward(dout[a:b], q[a:b], full[j][0, :end], full[j][1, :end],
                                                                  out[a:b], lse, cu_q, cu_k, b - a, end, scale)
            dfull[j][0, :end] += dk_
            dfull[j][1, :end] += dv_
        own = len(ex.own_rows)
        dsource = k.new_zeros((2, own + sum(ex.recv_splits), *k.shape[1:]))
        for index, d in zip(ex.assemble, dfull):
            dsource.index_add_(1, index, d)
        width = 2 * k.shape[1] * k.shape[2]
        if ex.exchanges:  # each received row's gradient goes back to its holder
            handle = all_to_all(dsource[:, own:].transpose(0, 1).reshape(-1), [n * width for n in ex.recv_splits],
                                [n * width for n in ex.send_splits], ex.group, timeout,
                                "per-document CP: dK/dV return", async_op=True)
        for (a, b, cu, longest), lse in zip(ex.local_runs, lses[:local]):
            dq[a:b], dk[a:b], dv[a:b] = kernels.varlen_attention_backward(dout[a:b], q[a:b], k[a:b], v[a:b], out[a:b],
                                                                          lse, cu, cu, longest, longest, scale)
        d_own = dsource[:, :own]
        if ex.exchanges:
            d_own = d_own.index_add(1, ex.send_index, handle.wait().view(-1, 2, *k.shape[1:]).transpose(0, 1))
        dk.index_add_(0, ex.own_rows, d_own[0])
        dv.index_add_(0, ex.own_rows, d_own[1])
        return dq, dk, dv, None, None


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ex: CPExchange, scale: float) -> torch.Tensor:
    """Exact causal attention of this rank's row under per-document CP, differentiable.
    q ``[tokens, heads, head_dim]``, k/v ``[tokens, kv_heads, head_dim]`` (this rank's row, the
    layout of ``ex``) -> ``[tokens, heads, head_dim]``. Every rank of ``ex.group`` calls it together."""
    return _CPAttention.apply(q, k, v, ex, scale)


def cp_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask, scaling: float | None = None, dropout: float = 0.0, cp_plan=None, **kwargs):
    """HF attention function ``"distca_cp"``: query ``[1, H, S, D]``, key/value ``[1, H_kv, S, D]``
    -> ``([1, S, H, D], None)``. The model's forward must get ``cp_plan=`` (a ``CPExchange`` for the
    row it is given), which transformers hands to every attention layer."""
    if cp_plan is None:
        raise ValueError("attn_implementation='distca_cp' needs cp_plan=cp_exchange(...) in the model's forward "
                         "(distca-hf bench --workload long builds it)")
    if query.shape[0] != 1:
        raise ValueError(f"per-document CP takes one row per rank, got a batch of {query.shape[0]}")
    if dropout and module.training:
        raise ValueError("per-document CP: attention dropout > 0 in training is not supported")
    _, heads, tokens, dim = query.shape
    q = query[0].transpose(0, 1).contiguous()
    k, v = key[0].transpose(0, 1).contiguous(), value[0].transpose(0, 1).contiguous()
    out = cp_attention(q, k, v, cp_plan, dim**-0.5 if scaling is None else float(scaling))
    return out.view(1, tokens, heads, dim), None


def register() -> None:
    """Register ``"distca_cp"`` with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(CP_IMPLEMENTATION, cp_attention_forward)
    AttentionMaskInterface.register(CP_IMPLEMENTATION, distca_mask)
