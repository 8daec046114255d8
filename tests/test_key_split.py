"""Key-split CA-tasks (2D tiles, issue 21 item 2): the log-sum-exp merge against whole attention, the
tile pair count, tiles through the CPU kernels (partials merged, backward with the merged out and
lse) against whole documents, the tile checks, the planner rule ``split_long_prefixes``, and on
spawned gloo ranks the dispatch of key-split plans in every overlap and backward mode against each
document alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distca_hf.kernels import merge_partials, merge_rows, varlen_attention_backward, varlen_attention_forward
from distca_hf.planning import (DocumentPieces, Plan, TokenBytes, check_tiles, colocated_plan, fused_batch, key_start,
                                kv_transfers, split_long_prefixes, tile_pairs)
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


# ---- the tile checks and the planner rule ----

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


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 60), min_size=1, max_size=5), ranks=st.integers(2, 4),
       bound=st.integers(0, 40), with_bytes=st.booleans())
def test_split_long_prefixes_keeps_every_pair_once_and_never_adds_key_bytes(lengths, ranks, bound, with_bytes):
    """On a global stream of documents cut into equal rank slices (documents span ranks): the split
    plan covers every pair exactly once, holders serve their own keys, and no server receives more
    K/V than before (the shards' queries travel instead)."""
    total = sum(lengths)
    per = -(-total // ranks)
    rows, pos, doc = [[] for _ in range(ranks)], 0, 0
    for d, n in enumerate(lengths):
        for start in range(0, n):
            r = min((pos + start) // per, ranks - 1)
            if rows[r] and rows[r][-1][0] == d:
                rows[r][-1] = (d, rows[r][-1][1], start + 1)
            else:
                rows[r].append((d, start, start + 1))
        pos += n
    pieces = DocumentPieces.from_rank_lists(rows)
    plan = colocated_plan(pieces)
    split = split_long_prefixes(plan, pieces, max_prefix_tokens=bound,
                                token_bytes=TokenBytes(q=8, kv=4, o=8, lse=1) if with_bytes else None)
    check_tiles(split, pieces)
    assert split.pairs().sum() == plan.pairs().sum()
    received = lambda t: np.bincount(t.server, weights=t.end - t.start, minlength=ranks)
    after_t = kv_transfers(split, pieces)
    assert (received(after_t) <= received(kv_transfers(plan, pieces))).all()
    if not with_bytes and bound == 0:
        assert after_t.tokens() == 0  # every task's earlier keys are served where they live
