"""Key-split CA-tasks (2D tiles, issue 21 item 2): the log-sum-exp merge against whole attention, the
tile pair count, tiles through the CPU kernels (partials merged, backward with the merged out and
lse) against whole documents, the tile checks, and on
spawned gloo ranks the dispatch of key-split plans in every overlap and backward mode against each
document alone."""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distca_hf.kernels import merge_partials, merge_rows, varlen_attention_backward, varlen_attention_forward
from distca_hf.planning import (DocumentPieces, KVTransfers, Plan, TokenBytes, check_tiles, comm_bytes, fused_batch,
                                key_start, kv_transfers, query_sends, tile_pairs)
from distca_hf.planning.transfers import rank_bytes
from distca_hf.planning.ranges import concat_ranges
from kernel_refs import weighted_grads


# ---- the merge ----

@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 6), keys=st.integers(1, 24), parts=st.integers(1, 4), data=st.data(),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_merge_partials_equals_attention_over_all_keys(rows, keys, parts, data, dtype):
    """Softmax attention over disjoint key subsets, merged, is attention over all keys (any split)."""
    g = torch.Generator().manual_seed(rows * 100 + keys)
    scores = (torch.randn(rows, 2, keys, generator=g, dtype=torch.float64) * 4).to(dtype)  # [rows, heads, keys]
    values = torch.randn(keys, 2, 3, generator=g, dtype=torch.float64).to(dtype)
    owner = torch.tensor(data.draw(st.lists(st.integers(0, parts - 1), min_size=keys, max_size=keys)))
    outs, lses = [], []
    for p in range(parts):
        masked = scores.masked_fill(owner != p, float("-inf"))
        lse = torch.logsumexp(masked, -1)  # -inf for a part with no key: weight 0
        probs = torch.exp(masked - torch.where(torch.isfinite(lse), lse, 0).unsqueeze(-1))
        outs.append(torch.einsum("rhk,khd->rhd", probs, values))
        lses.append(lse)
    out, lse = merge_partials(outs, lses)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse.to(dtype), torch.logsumexp(scores, -1), **tol)
    torch.testing.assert_close(out, torch.einsum("rhk,khd->rhd", torch.softmax(scores, -1), values), **tol)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)


def test_merge_rows_keeps_a_single_partial_and_empties_rows_without_one():
    g = torch.Generator().manual_seed(0)
    out, lse = torch.randn(3, 2, 4, generator=g), torch.randn(3, 2, generator=g)
    merged_out, merged_lse = merge_rows(torch.tensor([4, 0, 2]), out, lse, 5)
    assert torch.equal(merged_out[[4, 0, 2]], out) and torch.equal(merged_lse[[4, 0, 2]], lse)  # bit for bit
    assert not merged_out[[1, 3]].any() and torch.isneginf(merged_lse[[1, 3]]).all()
    with pytest.raises(ValueError, match="out parts as lse parts"):
        merge_partials([out], [])


@settings(max_examples=200, deadline=None)
@given(a=st.integers(0, 30), n=st.integers(1, 20), k0=st.integers(0, 50), width=st.integers(0, 50),
       window=st.one_of(st.none(), st.integers(1, 25)))
def test_tile_pairs_counts_the_visible_pairs(a, n, k0, width, window):
    b, k1 = a + n, k0 + width
    brute = sum(1 for t in range(a, b) for k in range(k0, k1) if k <= t and (window is None or k > t - window))
    assert int(tile_pairs(a, b, k0, k1, window)) == brute


# ---- tiles through the kernels ----

def _random_tiles(lengths, window, data):
    """Tiles covering every document: query shards, each with its keys cut into a causal tile and full
    tiles before it (where the window allows). Returns ``(doc, q_start, q_end, k_start, k_end)`` rows."""
    tiles = []
    for d, n in enumerate(lengths):
        cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, n - 1)), max_size=3))) - {n})
        for a, b in zip([0, *cuts], [*cuts, n]):
            first = int(key_start(a, window))
            c = data.draw(st.integers(first, a))  # the causal tile's first key
            tiles.append((d, a, b, c, b))
            if c > first and (window is None or first >= b - window):
                inner = sorted(set(data.draw(st.lists(st.integers(first + 1, c - 1), max_size=2))) if c - first > 1
                               else [])
                for x0, x1 in zip([first, *inner], [*inner, c]):
                    tiles.append((d, a, b, x0, x1))
            elif c > first:
                tiles[-1] = (d, a, b, first, b)  # the window cuts a full tile: keep the whole prefix
    return tiles


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 30), min_size=1, max_size=4), window=st.one_of(st.none(), st.integers(2, 40)),
       backend=st.sampled_from(["torch_cpu", "math"]), data=st.data())
def test_key_split_tiles_through_the_kernels_equal_whole_documents(lengths, window, backend, data):
    """Any tiling: each tile a kernel task (causal or full), partials merged by row, backward run per
    tile with the merged out and lse, dQ partials summed: outputs and every gradient of the whole
    documents (fp64, and the order of the tiles does not matter)."""
    tiles = data.draw(st.permutations(_random_tiles(lengths, window, data)))
    doc, a, b, k0, k1 = (np.array(c, dtype=np.int64) for c in zip(*tiles))
    plan = Plan(doc * 0, doc * 0, doc, a, b, 1, (0,), window, "saved", k0, k1)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    check_tiles(plan, DocumentPieces(np.zeros(len(lengths), np.int64), np.arange(len(lengths)), np.zeros(len(lengths)),
                                     np.array(lengths), 1))
    assert plan.pairs().sum() == sum(int(tile_pairs(0, n, 0, n, window)) for n in lengths)
    q_rows = concat_ranges(starts[doc] + a, b - a)
    batch = fused_batch(q_rows, concat_ranges(starts[doc] + k0, k1 - k0), a, b, window=window, k_start=k0, k_end=k1)
    total = sum(lengths)
    g = torch.Generator().manual_seed(total)
    q, k, v = (torch.randn(total, h, 8, generator=g, dtype=torch.float64).requires_grad_() for h in (4, 2, 2))
    fq, fk, fv = q[batch.q_index], k[batch.k_index], v[batch.k_index]
    args = (batch.cu_seqlens_q, batch.cu_seqlens_k, batch.max_seqlen_q, batch.max_seqlen_k, None, backend)
    f_out, f_lse = varlen_attention_forward(fq, fk, fv, *args, window=window, full=batch.full)
    out, lse = merge_rows(batch.q_index, f_out, f_lse.t(), total)
    # the reference: each document alone, explicit scores (autograd)
    ref = []
    for s, n in zip(starts, lengths):
        rows = slice(int(s), int(s) + n)
        scores = torch.einsum("qhd,khd->hqk", q[rows], k[rows].repeat_interleave(2, 1)) * 8 ** -0.5
        pos = torch.arange(n)
        mask = pos[None, :] <= pos[:, None]
        if window is not None:
            mask &= pos[None, :] > pos[:, None] - window
        ref.append(torch.einsum("hqk,khd->qhd", torch.softmax(scores.masked_fill(~mask, float("-inf")), -1),
                                v[rows].repeat_interleave(2, 1)))
    ref = torch.cat(ref)
    torch.testing.assert_close(out, ref.detach(), atol=1e-12, rtol=1e-10)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    fdq, fdk, fdv = varlen_attention_backward(dout[batch.q_index], fq.detach(), fk.detach(), fv.detach(),
                                              out[batch.q_index], lse[batch.q_index].t().contiguous(), *args,
                                              window=window, full=batch.full)
    dq = torch.zeros_like(q).index_add_(0, batch.q_index, fdq)
    dk = torch.zeros_like(k).index_add_(0, batch.k_index, fdk)
    dv = torch.zeros_like(v).index_add_(0, batch.k_index, fdv)
    for got, want in zip((dq, dk, dv), torch.autograd.grad((ref * dout).sum(), (q, k, v))):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("name", ["torch_cuda", "torch_cuda_efficient"])
def test_full_tiles_reach_the_cuda_ops_unmasked(monkeypatch, name):
    """No GPU here: the CUDA backends' ops replaced by test_torch_cuda's fakes (the ops' argument
    checks and mask semantics): a full tile goes to the op with ``is_causal=False`` /
    ``custom_mask_type=0`` and its partial merges into the whole document's attention. (The fakes
    recompute their backward from their own forward, so the merged-lse backward is checked on CPU
    kernels only.)"""
    import distca_hf.kernels as kernels
    from test_torch_cuda import FakeEfficient, FakeFlash

    module = getattr(kernels, name)
    fake = FakeFlash() if name == "torch_cuda" else FakeEfficient(check_lse=False)
    monkeypatch.setattr(module, "_op", fake.op)
    monkeypatch.setattr(kernels, "select_backend", lambda device, dtype, backend=None: module)
    if name == "torch_cuda":
        monkeypatch.setattr(module, "accepts_window", lambda: True)
    # one document of 20: queries [0, 12) whole, [12, 20) as keys [6, 20) causal + [0, 6) full (two tiles)
    a, b = np.array([0, 12, 12]), np.array([12, 20, 20])
    k0, k1 = np.array([0, 6, 0]), np.array([12, 20, 6])
    batch = fused_batch(concat_ranges(a, b - a), concat_ranges(k0, k1 - k0), a, b, k_start=k0, k_end=k1)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(20, h, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    f_out, f_lse = varlen_attention_forward(q[batch.q_index], k[batch.k_index], v[batch.k_index], batch.cu_seqlens_q,
                                            batch.cu_seqlens_k, batch.max_seqlen_q, batch.max_seqlen_k, 0.25,
                                            full=batch.full)
    out, _ = merge_rows(batch.q_index, f_out, f_lse.t(), 20)
    scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(2, 1)) * 0.25
    mask = torch.ones(20, 20, dtype=torch.bool).tril()
    want = torch.einsum("hqk,khd->qhd", torch.softmax(scores.masked_fill(~mask, float("-inf")), -1),
                        v.repeat_interleave(2, 1))
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)  # the ops' lse is fp32
    if name == "torch_cuda":
        assert fake.causal == [True, False]


def test_full_tiles_refuse_chunked_attention_and_keyless_tasks():
    q, k = torch.randn(3, 2, 4), torch.randn(2, 2, 4)
    cu_q, cu_k = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="chunked attention"):
        varlen_attention_forward(q, k, k, cu_q, cu_k, 3, 2, None, "math", chunk=4, full=[True])
    with pytest.raises(ValueError, match="no keys"):
        varlen_attention_forward(q, k[:0], k[:0], cu_q, torch.tensor([0, 0], dtype=torch.int32), 3, 0, None, "math",
                                 full=[True])
    with pytest.raises(ValueError, match="one flag per task"):
        varlen_attention_forward(q, k, k, cu_q, cu_k, 3, 2, None, "math", full=[True, False])


def test_a_key_split_plan_refuses_layers_with_another_window_or_chunks():
    """Full tiles were cut for the plan's window exactly: a layer with a narrower window (which a
    whole-prefix plan accepts) or attention chunks would be wrong, so it raises naming both."""
    from types import SimpleNamespace

    from distca_hf.errors import UnsupportedAttentionError
    from distca_hf.runtime.phases import check_layer_window

    wave = SimpleNamespace(kv_window=8, forward_number=3, merges=True)
    check_layer_window(wave, 8)
    with pytest.raises(UnsupportedAttentionError, match="splits CA-tasks along keys for sliding_window=8.*runs "
                                                        "sliding_window=2"):
        check_layer_window(wave, 2)
    with pytest.raises(UnsupportedAttentionError, match="attention_chunk_size=4"):
        check_layer_window(SimpleNamespace(kv_window=None, forward_number=1, merges=True), None, 4)


# ---- the tile checks ----

def test_check_tiles_names_bad_shapes_gaps_and_overlaps():
    pieces = DocumentPieces.from_rank_lists([[10]])
    tile = lambda *rows: Plan(*(np.array(c, dtype=np.int64) for c in zip(*[(0, 0, 0, a, b) for a, b, _, _ in rows])),
                              1, (0,), None, "saved", np.array([r[2] for r in rows]), np.array([r[3] for r in rows]))
    check_tiles(tile((0, 5, 0, 5), (5, 10, 3, 10), (5, 10, 0, 3)), pieces)  # exact
    with pytest.raises(ValueError, match="neither a causal tile"):
        check_tiles(tile((0, 5, 0, 5), (5, 10, 0, 7), (5, 10, 7, 10)))  # [5,10) x [0,7) is neither shape
    with pytest.raises(ValueError, match="exactly once"):
        check_tiles(tile((0, 5, 0, 5), (5, 10, 3, 10), (5, 10, 0, 4)), pieces)  # key 3 twice
    with pytest.raises(ValueError, match="exactly once"):
        check_tiles(tile((0, 5, 0, 5), (5, 10, 3, 10), (5, 10, 0, 2)), pieces)  # key 2 missing
    with pytest.raises(ValueError, match="query tokens"):
        check_tiles(tile((0, 5, 0, 5)), pieces)  # queries 5..9 lost
    with pytest.raises(ValueError, match="both k_start and k_end"):
        Plan(*(np.zeros(1, np.int64) for _ in range(5)), 1, (0,), k_start=np.zeros(1, np.int64))


def test_a_server_receives_the_union_of_its_tiles_keys_not_their_hull():
    """Queries [20, 30) of a document held as [0, 10) [10, 20) [20, 30) on ranks 0, 1, 2: rank 2 keeps
    keys [0, 10) and [20, 30), rank 1 serves [10, 20); rank 2 receives only [0, 10)."""
    pieces = DocumentPieces.from_rank_lists([[(0, 0, 10)], [(0, 10, 20)], [(0, 20, 30)]])
    rows = [(0, 0, 0, 0, 10, 0, 10), (1, 1, 0, 10, 20, 0, 20), (2, 1, 0, 20, 30, 10, 20), (2, 2, 0, 20, 30, 20, 30),
            (2, 2, 0, 20, 30, 0, 10)]
    source, server, doc, a, b, k0, k1 = (np.array(c, dtype=np.int64) for c in zip(*rows))
    plan = Plan(source, server, doc, a, b, 3, (0, 1, 2), None, "saved", k0, k1)
    check_tiles(plan, pieces)
    t = kv_transfers(plan, pieces)
    assert sorted(zip(t.source.tolist(), t.server.tolist(), t.start.tolist(), t.end.tolist())) == [(0, 1, 0, 10),
                                                                                                  (0, 2, 0, 10)]


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 30), min_size=1, max_size=4), window=st.one_of(st.none(), st.integers(2, 40)),
       ranks=st.integers(2, 4), data=st.data())
def test_a_query_row_goes_once_to_each_server_of_its_tiles(lengths, window, ranks, data):
    """``query_sends``: every (source, server, query row) of the moved tiles exactly once (brute
    force), each moved tile inside its send; ``comm_bytes`` and ``rank_bytes`` count those rows, once
    out (q) and once back (o + lse), however many tiles of a row a server runs."""
    tiles = _random_tiles(lengths, window, data)
    source_of = {}
    rows = []
    for d, a, b, k0, k1 in tiles:
        source = source_of.setdefault((d, a), data.draw(st.integers(0, ranks - 1)))
        rows.append((source, data.draw(st.integers(0, ranks - 1)), d, a, b, k0, k1))
    cols = np.asarray(rows, dtype=np.int64).T
    order = np.lexsort((cols[5], cols[3], cols[2], cols[0], cols[1]))
    source, server, doc, a, b, k0, k1 = (c[order] for c in cols)
    plan = Plan(source, server, doc, a, b, ranks, tuple(range(ranks)), window, "saved", k0, k1)
    sends = query_sends(plan)
    want = {(s, v, d, t) for s, v, d, x, y in zip(source, server, doc, a, b) if s != v for t in range(x, y)}
    got = [(s, v, d, t) for s, v, d, x, y in zip(sends.source, sends.server, sends.doc, sends.start, sends.end)
           for t in range(x, y)]
    assert sorted(got) == sorted(want) and sends.tokens() == len(want)
    for i in range(plan.num_tasks):
        j = sends.of_task[i]
        if source[i] == server[i]:
            assert j == -1
        else:
            assert (sends.source[j], sends.server[j], sends.doc[j]) == (source[i], server[i], doc[i])
            assert sends.start[j] <= a[i] and b[i] <= sends.end[j]
    tb = TokenBytes(q=8, kv=4, o=6, lse=1)
    none = KVTransfers(*(np.zeros(0, dtype=np.int64) for _ in range(5)))
    pieces = DocumentPieces.from_rank_lists([lengths])
    counted = comm_bytes(plan, pieces, tb, none)
    assert (counted.q, counted.o) == (len(want) * 8, len(want) * 7)
    sent, received = rank_bytes(plan, pieces, tb, none)
    for r in range(ranks):
        out = sum(1 for s, v, _, _ in want if s == r)
        back = sum(1 for s, v, _, _ in want if v == r)
        assert (sent[r], received[r]) == (out * 8 + back * 7, back * 8 + out * 7)


# ---- key-split plans dispatched on gloo ranks ----

def _slices(doc_lengths, world):
    """A global stream of documents cut into ``world`` equal slices (documents span ranks): each
    rank's local piece lengths and first position, and the stream's document of each token."""
    total = sum(doc_lengths)
    bounds = [round(r * total / world) for r in range(world + 1)]
    doc_of = np.repeat(np.arange(len(doc_lengths)), doc_lengths)
    pos_of = concat_ranges(np.zeros(len(doc_lengths), np.int64), doc_lengths)
    per_rank, first = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        _, counts = np.unique(doc_of[lo:hi], return_counts=True)
        per_rank.append(counts.astype(np.int64))
        first.append(int(pos_of[lo]))
    return bounds, per_rank, first


def _hand_tiles(pieces, window, world, seed):
    """Random key-split tiles on random servers: every piece's queries cut into shards, each shard's
    keys into a causal tile and full tiles before it (where the window allows); several tiles of one
    row may land on one server, in one wave or several."""
    rng = np.random.default_rng(seed)
    rows = []
    for rank, doc, s, e in zip(pieces.rank, pieces.doc, pieces.start, pieces.end):
        cuts = sorted(set(rng.integers(s + 1, e, size=2).tolist())) if e - s > 2 else []
        for a, b in zip([int(s), *cuts], [*cuts, int(e)]):
            first = int(key_start(a, window))
            c = int(rng.integers(first, a + 1))
            if window is not None and first < b - window:
                c = first  # a full tile would be cut by the window: the whole prefix
            rows.append((rank, int(rng.integers(world)), doc, a, b, c, b))
            inner = sorted(set(rng.integers(first + 1, c, size=2).tolist())) if c - first > 2 else []
            for x0, x1 in zip([first, *inner], [*inner, c]) if c > first else ():
                rows.append((rank, int(rng.integers(world)), doc, a, b, x0, x1))
    cols = np.asarray(rows, dtype=np.int64).T
    order = np.lexsort((cols[5], cols[3], cols[2], cols[0], cols[1]))
    return [c[order] for c in cols]


def key_split_worker(rank, world, cases):
    """Every case ``(doc_lengths, window, plan_kind[, relay_fanout])`` (``hand``, ``auto`` or
    ``carved``: the carving at tolerance 0, whole prefixes) in every overlap (``none``, ``wave``, the
    ping-pong nodes) and backward mode: this rank's attention output and q/k/v gradients against the
    global stream's documents each computed alone (explicit fp64 softmax, autograd). With a
    ``relay_fanout``, the plan's K/V goes along relay trees of it (``relay.apply_relays``). Returns the
    worst errors per run and the plan's key-split facts."""
    import torch.distributed as dist

    from distca_hf.kernels import AttentionVariant
    from distca_hf.planning import Plan, PlannerConfig, TimeModel, comm_bytes, plan_tasks, stitch_rank_documents
    from distca_hf.runtime.dispatch import build_dispatch
    from distca_hf.runtime.pingpong import NanoAttention
    from distca_hf.runtime.tables import LocalDocuments
    from distca_hf.runtime.wave_schedule import dispatched_attention
    from distca_hf.planning.documents import PackedDocuments
    from distca_hf.planning.relay import apply_relays

    report = []
    for case, (doc_lengths, window, kind, *relay) in enumerate(cases):
        bounds, per_rank, first = _slices(doc_lengths, world)
        ranks = stitch_rank_documents(per_rank, [np.zeros_like(x) for x in per_rank], first, span_ranks=True)
        pieces = ranks.pieces
        if kind == "hand":
            cols = _hand_tiles(pieces, window, world, seed=case)
            plan = Plan(*cols[:5], world, tuple(range(world)), window, "saved", cols[5], cols[6])
        elif kind == "carved":
            plan = plan_tasks(pieces, PlannerConfig(tolerance=0.0, window=window))
        else:  # the auto planner's own tiles (planning.tiles), links dear enough that they pay
            plan = plan_tasks(pieces, PlannerConfig(
                tolerance="auto", window=window, key_split=True, token_bytes=TOKEN_BYTES,
                time_model=TimeModel(linear_s_per_token=1e-6, attn_s_per_pair=1e-9, task_s=1e-6, bytes_per_s=1e6)))
        if relay:
            plan = apply_relays(plan, pieces, PlannerConfig(kv_relays=relay[0]))
        check_tiles(plan, pieces)
        docs = PackedDocuments.from_lengths(per_rank[rank])
        local = LocalDocuments(docs, ranks.global_ids[rank], ranks.offsets[rank])
        total, lo, hi = sum(doc_lengths), bounds[rank], bounds[rank + 1]
        g = torch.Generator().manual_seed(case)
        gq, gk, gv = (torch.randn(total, h, 8, generator=g, dtype=torch.float64).requires_grad_() for h in (4, 2, 2))
        weight = torch.randn(total, 4, 8, generator=g, dtype=torch.float64)
        ref = []
        for s, n in zip(np.cumsum([0, *doc_lengths[:-1]]), doc_lengths):
            r = slice(int(s), int(s) + n)
            scores = torch.einsum("qhd,khd->hqk", gq[r], gk[r].repeat_interleave(2, 1)) * 8 ** -0.5
            p = torch.arange(n)
            mask = (p[None, :] <= p[:, None]) & ((p[None, :] > p[:, None] - window) if window else True)
            ref.append(torch.einsum("hqk,khd->qhd", torch.softmax(scores.masked_fill(~mask, float("-inf")), -1),
                                    gv[r].repeat_interleave(2, 1)))
        ref = torch.cat(ref)
        ref_grads = [x[lo:hi] for x in torch.autograd.grad((ref * weight).sum(), (gq, gk, gv))]
        for overlap in ("none", "wave", "pingpong"):
            for backward in ("saved", "resend"):
                q, k, v = (x.detach()[lo:hi].float().requires_grad_() for x in (gq, gk, gv))
                dispatch = build_dispatch(dataclasses.replace(plan, backward=backward), pieces, local, rank, "cpu",
                                          overlap="wave" if overlap == "wave" else "none", backward_mode=backward,
                                          timeout_s=60.0, forward_number=case)
                variant = AttentionVariant(window)
                issued = None  # the all-to-alls' order, recorded for overlap none and wave
                if overlap == "pingpong":
                    nano = NanoAttention(dispatch, 8 ** -0.5, "A", variant=variant)
                    nano.launch(q, k, v)
                    nano.serve()
                    out = nano.finish()
                    (out * weight[lo:hi].float()).sum().backward()
                else:
                    with _issued_exchanges() as issued:
                        out = dispatched_attention(q, k, v, dispatch, 8 ** -0.5, variant=variant)
                        (out * weight[lo:hi].float()).sum().backward()
                forward_bytes = sum(n for kind, n in dispatch.counters.bytes_sent.items() if kind.startswith("forward"))
                report.append({
                    "case": case, "overlap": overlap, "backward": backward, "waves": len(dispatch.waves),
                    "issued": issued,
                    "kv_rounds": dispatch.kv_rounds,
                    "forward_bytes": forward_bytes, "queries_sent": dispatch.queries_sent,
                    "kv_sent": int(dispatch.kv_received.sum()),
                    "out_err": float((out.detach().double() - ref[lo:hi].detach()).abs().max()),
                    "grad_err": max(float((x.grad.double() - want).abs().max())
                                    for x, want in zip((q, k, v), ref_grads)),
                })
        dist.barrier()
        moved_rows = plan.source != plan.server
        report.append({"case": case, "splits": plan.splits_keys, "full_tiles": int((plan.key_ranges()[1] < plan.q_end).sum()),
                       "moved_tiles": int(moved_rows.sum()), "moved_tile_rows": plan.moved_queries(),
                       "planned_bytes": comm_bytes(plan, pieces, TOKEN_BYTES).total,
                       "relayed_groups": plan.relays.num_groups if plan.relays is not None else 0})
    return report


@contextlib.contextmanager
def _issued_exchanges():
    """The descriptions of the all-to-alls issued inside, in issue order (``exchange.start_exchange``'s
    ``what (wave name, forward n)``)."""
    from distca_hf.runtime import exchange

    issued, real = [], exchange.all_to_all

    def recording(send, send_splits, recv_splits, group, timeout_s, what, **kwargs):
        issued.append(what)
        return real(send, send_splits, recv_splits, group, timeout_s, what, **kwargs)

    exchange.all_to_all = recording
    try:
        yield issued
    finally:
        exchange.all_to_all = real


TOKEN_BYTES = TokenBytes(q=128, kv=128, o=128, lse=16)  # the workers' fp32 q/k/v: 4 heads (2 K/V heads) of 8


KEY_SPLIT_CASES = {
    2: [([41, 6, 23], None, "hand"), ([41, 6, 23], 12, "hand"), ([70], None, "hand"), ([41, 6, 23], None, "auto")],
    3: [([50, 7, 30, 13], None, "hand"), ([50, 7, 30, 13], 16, "hand"), ([60, 10, 30], None, "auto")],
}


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_key_split_plans_dispatch_exactly(tmp_path, world):
    """Plans with key-split tiles (random ones on random servers, spanning documents, sliding
    windows, and the tiles ``tolerance="auto"`` itself chose with ``key_split``) on gloo ranks, overlap
    ``none`` / ``wave`` / ping-pong's nodes x ``saved`` / ``resend``: every rank's output and q/k/v
    gradients equal its rows of each document computed alone (fp32 against fp64: 1e-5), and the
    forward's bytes are what the planner and plan_stats count, a query row going once to a server
    however many of its tiles that server runs."""
    from dist_harness import run_ranks

    results = run_ranks(key_split_worker, world, tmp_path, KEY_SPLIT_CASES[world], deadline_s=240)
    for rank, result in enumerate(results):
        assert result["ok"], f"rank {rank}: {result.get('traceback', result['error'])}"
        runs = [r for r in result["value"] if "overlap" in r]
        facts = [r for r in result["value"] if "splits" in r]
        assert len(runs) == 6 * len(KEY_SPLIT_CASES[world])
        for run in runs:
            assert run["out_err"] < 1e-5 and run["grad_err"] < 1e-5, (rank, run)
        assert all(f["splits"] and f["full_tiles"] > 0 and f["moved_tiles"] > 0 for f in facts), facts
        assert any(r["waves"] > 1 for r in runs if r["overlap"] == "wave")
    # bytes: what the ranks sent in forward is the planner's count (comm_bytes, one wave) and plan_stats'
    # formula (the waves' query sends and K/V); some row had two tiles on one server, and went once
    runs = list(zip(*([r for r in result["value"] if "overlap" in r] for result in results)))
    facts = {f["case"]: f for f in results[0]["value"] if "splits" in f}
    for per_rank in runs:
        run = per_rank[0]
        sent = sum(r["forward_bytes"] for r in per_rank)
        assert sent == run["queries_sent"] * (128 + 128 + 16) + run["kv_sent"] * 128, run
        if run["overlap"] != "wave":
            assert sent == facts[run["case"]]["planned_bytes"], run
    assert any(run[0]["overlap"] == "none" and run[0]["queries_sent"] < facts[run[0]["case"]]["moved_tile_rows"]
               for run in runs)


def key_split_model_worker(rank, world, cases):
    """``workers.span_workers`` with the runtime's own planner (``tolerance="auto"``, which turns
    ``key_split`` on for these models, ping-pong's nano-batches included), counting per overlap the
    plans made and those that came back with key-split tiles."""
    from distca_hf.config import current_config
    from distca_hf.planning import plan_tasks
    from distca_hf.runtime import shared_planning
    from workers import span_workers

    made = {}  # overlap -> [plans, key-split plans]

    def planner(pieces, config):
        plan = plan_tasks(pieces, config)
        count = made.setdefault(current_config().overlap, [0, 0])
        count[0] += 1
        count[1] += int(plan.splits_keys)
        return plan

    # plan_batch's default planner: plan_tasks through shared_planning, which on 2 ranks calls it alone (one
    # candidate without a third rank for trees); this counting one stands in for it there
    shared_planning.plan_tasks = planner
    return {"reports": span_workers(rank, world, cases), "made": made}


@pytest.mark.distributed
def test_key_split_plans_train_whole_models_exactly(tmp_path):
    """The runtime's ``tolerance="auto"`` choosing key-split tiles by time (``planning.tiles``) under a
    time model with dear links, so that they pay: Llama (full attention) and Mistral (sliding window)
    on 2 gloo ranks, documents spanning them, overlap none / wave / pingpong (both nano-batches tiled)
    x saved / resend: the plans split keys (without ping-pong), and logits and every parameter gradient equal each whole
    document run alone with eager attention; plan_stats' bytes are what the ranks sent."""
    import json

    from dist_harness import run_ranks
    from workers import check_forward_bytes, exact_runs

    model_path = tmp_path / "dear_links.json"
    model_path.write_text(json.dumps({"linear_s_per_token": 1e-6, "attn_s_per_pair": 1e-9, "task_s": 1e-6,
                                      "bytes_per_s": 1e6}))
    cases = [("llama", [56, 20, 18], [47, 47], ("none", "wave", "pingpong"), {}),
             ("mistral", [52, 15, 21], [44, 44], ("none", "wave", "pingpong"), {})]
    results = run_ranks(key_split_model_worker, 2, tmp_path, cases,
                        env={"DISTCA_TOLERANCE": "auto", "DISTCA_TIME_MODEL": str(model_path)})
    for rank, result in enumerate(results):
        assert result["ok"], f"rank {rank}: {result.get('traceback', result['error'])}"
        made = result["value"]["made"]
        for overlap in ("none", "wave"):  # both families x both backward modes held tiles
            assert made[overlap][1] >= 4, (overlap, made)
        # ping-pong plans its nano-batches with key_split too, but halves of these short rows never pay for
        # tiles (its merge path runs with hand tiles in test_key_split_plans_dispatch_exactly): planned, exact
        assert made["pingpong"][0] == 8, made
    for family, (_, _, slices, _, _) in zip(("llama", "mistral"), cases):
        per_family = [{"ok": True, "value": r["value"]["reports"][family]} for r in results]
        exact_runs(per_family, 7)
        check_forward_bytes(per_family)  # plan_stats counts the log-sum-exp key-split partials return
        for rank, result in enumerate(per_family):  # the memory formula is what the dispatch keeps
            for run in result["value"][:-1]:
                if run["backward"] == "saved" and run["overlap"] in ("none", "pingpong") and run["mode"] == "distca":
                    own = slices[rank] * (128 + 128 + 128 + 16)  # q, k and v, out, lse per token (fp32, 4 heads)
                    added = run["stats"]["memory_bytes_per_layer"][rank]
                    assert run["stats"]["rank_saved_for_backward_bytes"] == 2 * (own + added), (family, rank, run)


def test_the_kernels_run_causal_and_full_tiles_on_slices_of_the_fused_batch(monkeypatch):
    """``fused_batch`` puts the causal tasks first and the full tiles after them (rows reordered
    alike), so the front door hands each backend call slices of the fused q / k / v (and dO / out in
    backward), never copies; full flags out of that order are refused by name."""
    import distca_hf.kernels as kernels

    # one document of 20: queries [12, 20) as a full tile [0, 6) given before its causal tile [6, 20)
    a, b, k0, k1 = np.array([12, 0, 12]), np.array([20, 12, 20]), np.array([0, 0, 6]), np.array([6, 12, 20])
    batch = fused_batch(concat_ranges(a, b - a), concat_ranges(k0, k1 - k0), a, b, k_start=k0, k_end=k1)
    assert batch.full.tolist() == [False, False, True] and batch.causal_rows == (20, 26)
    assert batch.q_index.tolist() == [*range(12), *range(12, 20), *range(12, 20)]
    assert batch.k_index.tolist() == [*range(12), *range(6, 20), *range(6)]
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(20, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    fq, fk, fv = q[batch.q_index], k[batch.k_index], v[batch.k_index]
    backend = kernels.BACKENDS["torch_cpu"]
    seen = []

    def storages(*tensors):
        seen.append([t.untyped_storage().data_ptr() for t in tensors])

    forward, backward = backend.forward, backend.backward
    monkeypatch.setattr(backend, "forward", lambda q, k, v, *rest, **kw: storages(q, k, v) or forward(q, k, v, *rest,
                                                                                                      **kw))
    monkeypatch.setattr(backend, "backward", lambda do, q, k, v, out, *rest, **kw: storages(do, q, k, v, out) or
                        backward(do, q, k, v, out, *rest, **kw))
    args = (batch.cu_seqlens_q, batch.cu_seqlens_k, batch.max_seqlen_q, batch.max_seqlen_k, None, "torch_cpu")
    f_out, f_lse = varlen_attention_forward(fq, fk, fv, *args, full=batch.full, causal_rows=batch.causal_rows)
    dout = torch.randn(f_out.shape, generator=g, dtype=torch.float64)
    varlen_attention_backward(dout, fq, fk, fv, f_out, f_lse, *args, full=batch.full)  # rows read from cu_seqlens
    fused = [t.untyped_storage().data_ptr() for t in (fq, fk, fv)]
    assert seen[:2] == [fused, fused]  # forward: causal half, full half
    grads = [t.untyped_storage().data_ptr() for t in (dout, fq, fk, fv, f_out)]
    assert seen[2:] == [grads, grads]
    out, _ = merge_rows(batch.q_index, f_out, f_lse.t(), 20)
    scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(2, 1)) * 8 ** -0.5
    want = torch.einsum("hqk,khd->qhd", torch.softmax(scores.masked_fill(~torch.ones(20, 20, dtype=torch.bool).tril(),
                                                                         float("-inf")), -1), v.repeat_interleave(2, 1))
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-10)
    with pytest.raises(ValueError, match="full tasks must follow the causal ones"):
        varlen_attention_forward(fq, fk, fv, *args, full=[False, True, False])
    with pytest.raises(ValueError, match="causal_rows .* disagree"):
        varlen_attention_forward(fq, fk, fv, *args, full=batch.full, causal_rows=(12, 12))


@pytest.mark.parametrize("kind", ["colocated", "moved", "tiles"])
def test_a_waves_identity_flags_equal_its_fused_rows_covering_the_pool_in_order(kind):
    """``Wave.q_identity`` / ``k_identity`` (the gathers the phases skip) are decided on the host
    arrays; they must say exactly whether the fused batch's rows are the whole pool in order."""
    from distca_hf.planning import PlannerConfig, kv_transfers, plan_tasks, stitch_rank_documents
    from distca_hf.planning.carving import colocated_plan
    from distca_hf.planning.documents import PackedDocuments
    from distca_hf.runtime.tables import LocalDocuments, build_wave

    world, doc_lengths, window = 2, [40, 3, 5, 2, 6], None
    bounds, per_rank, first = _slices(doc_lengths, world)
    ranks = stitch_rank_documents(per_rank, [np.zeros_like(x) for x in per_rank], first, span_ranks=True)
    pieces = ranks.pieces
    if kind == "colocated":
        plan = colocated_plan(pieces)
    elif kind == "moved":
        plan = plan_tasks(pieces, PlannerConfig(tolerance=0.0, block=1, token_bytes=TOKEN_BYTES))
    else:
        cols = _hand_tiles(pieces, window, world, seed=0)
        plan = Plan(*cols[:5], world, tuple(range(world)), window, "saved", cols[5], cols[6])
    kv = kv_transfers(plan, pieces)
    q_flags = []
    for rank in range(world):
        local = LocalDocuments(PackedDocuments.from_lengths(per_rank[rank]), ranks.global_ids[rank], ranks.offsets[rank])
        wave = build_wave(plan, kv, local, rank, "cpu")
        for flag, index, pool in ((wave.q_identity, wave.served.q_index, wave.num_local + sum(wave.recv_q_counts)),
                                  (wave.k_identity, wave.served.k_index, wave.num_local_kv + sum(wave.recv_kv_counts))):
            assert flag == (index.numel() == pool and torch.equal(index, torch.arange(pool)))
        q_flags.append(wave.q_identity)
    if kind == "colocated":  # every rank serves its own queries, in order: no gather of them
        assert all(q_flags)


def float64_worker(rank, world):
    """A float64 dispatch (rank 0: one document of 40 tokens, rank 1: one of 4) in ``saved`` / ``resend``
    mode, whole prefixes and a key-split plan on which rank 1 serves no task: this rank's output and
    q/k/v gradients against its document computed alone in float64. Returns the worst error per run."""
    from distca_hf.planning import PlannerConfig, plan_tasks
    from distca_hf.planning.documents import PackedDocuments
    from distca_hf.runtime.dispatch import build_dispatch
    from distca_hf.runtime.tables import LocalDocuments
    from distca_hf.runtime.wave_schedule import dispatched_attention

    lengths = [[40], [4]]
    pieces = DocumentPieces.from_rank_lists(lengths)
    i = lambda *x: np.array(x, dtype=np.int64)
    n, errors = lengths[rank][0], {}
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(n, h, 8, generator=g, dtype=torch.float64) for h in (2, 1, 1))
    p = torch.arange(n)
    ref_inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    scores = torch.einsum("qhd,khd->hqk", ref_inputs[0], ref_inputs[1].repeat_interleave(2, 1)) * 8 ** -0.5
    ref = torch.einsum("hqk,khd->qhd", torch.softmax(scores.masked_fill(p[None, :] > p[:, None], float("-inf")), -1),
                       ref_inputs[2].repeat_interleave(2, 1))
    ref_grads = weighted_grads(ref, ref_inputs)
    for backward in ("saved", "resend"):
        for tiles in (False, True):
            if tiles:  # document 0's late queries as two key tiles on rank 0; rank 1's document served there too
                plan = Plan(i(0, 0, 0, 1), i(0, 0, 0, 0), i(0, 0, 0, 1), i(0, 20, 20, 0), i(20, 40, 40, 4), 2, (0, 1),
                            None, backward, i(0, 0, 10, 0), i(20, 10, 40, 4))
            else:
                plan = dataclasses.replace(plan_tasks(pieces, PlannerConfig(tolerance=0.0)), backward=backward)
            local = LocalDocuments(PackedDocuments.from_lengths(np.array(lengths[rank])), np.array([rank]),
                                   np.array([0]))
            dispatch = build_dispatch(plan, pieces, local, rank, "cpu", backward_mode=backward, timeout_s=60.0)
            inputs = [x.clone().requires_grad_() for x in (q, k, v)]
            out = dispatched_attention(*inputs, dispatch, 8 ** -0.5)
            grads = weighted_grads(out, inputs)
            errors[f"{backward} {'tiles' if tiles else 'whole'}"] = max(
                float((a - b).abs().max()) for a, b in zip((out, *grads), (ref, *ref_grads)))
    return errors


@pytest.mark.distributed
def test_a_float64_dispatch_returns_its_log_sum_exp_in_float64(tmp_path):
    """The log-sum-exp a ``resend`` backward or a key-split merge moves was made float32 where the
    kernels return float64 (float64 inputs): a float64 ``resend`` dispatch failed in ``index_copy_``, and a
    key-split one on which a rank serves no task sent 32-bit rows against others' 64-bit (gloo's size
    check, then a timeout). Now every run equals the documents computed alone."""
    from dist_harness import run_ranks

    for result in run_ranks(float64_worker, 2, tmp_path, deadline_s=120):
        assert "error" not in result, result.get("error")
        assert max(result["value"].values()) < 1e-12, result["value"]
