"""Overlap modes: the nano-batch split and the wave cut are exact re-arrangements (pure tests against
per-document attention), and on spawned gloo ranks both ``wave`` and ``pingpong`` give every rank's
logits and parameter gradients of its own per-document eager reference, with and without gradient
checkpointing, in both backward modes; ranks that would run different stacks stop together; the
timeline's overlap fraction and Chrome trace are what they claim."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_harness import run_ranks
from workers import check_forward_bytes, exact_runs, exactness_worker

from distca_hf.planning import PackedDocuments
from distca_hf.kernels import varlen_causal_attention
from distca_hf.planning import assign_nano_batches, split_nano_batches
from distca_hf.planning import fuse_tasks, whole_document_tasks


def _docs_with_padding(lengths, pad_after):
    """Documents end to end, ``pad_after[i]`` padding rows after document ``i``."""
    starts, row = [], 0
    for n, pad in zip(lengths, pad_after):
        starts.append(row)
        row += n + pad
    starts = np.array(starts, dtype=np.int64)
    lengths = np.array(lengths, dtype=np.int64)
    return PackedDocuments(lengths, np.zeros_like(lengths), starts, starts.copy(), row, row)


def _attention(docs, q, k, v):
    if not (docs.lengths > docs.past).any():  # a nano-batch may hold no query (a one-token micro-batch)
        return q.new_zeros(docs.num_query_tokens, *q.shape[1:])
    batch = fuse_tasks(whole_document_tasks(docs), docs)
    if batch.q_index is not None:
        q, k, v = q.index_select(0, batch.q_index), k.index_select(0, batch.k_index), v.index_select(0, batch.k_index)
    out = varlen_causal_attention(q, k, v, batch.cu_seqlens_q, batch.cu_seqlens_k, batch.max_seqlen_q,
                                  batch.max_seqlen_k, None)
    return out if batch.q_index is None else out.new_zeros(docs.num_query_tokens, *out.shape[1:]).index_copy(
        0, batch.q_index, out)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 3)), min_size=1, max_size=8), st.booleans())
def test_nano_split_is_an_exact_rearrangement(docs_and_padding, pin_last):
    lengths, pads = zip(*docs_and_padding)
    docs = _docs_with_padding(lengths, pads)
    split = split_nano_batches(docs, assign_nano_batches(lengths, pin_last=pin_last))
    rows = np.concatenate([split.rows_a, split.rows_b])
    assert np.array_equal(np.sort(rows), np.arange(docs.num_query_tokens))  # every row once
    real_a = int(split.docs_a.lengths.sum())
    real_b = int((split.docs_b.lengths - split.docs_b.past).sum())
    assert real_a + real_b == sum(lengths)
    pinned = lengths[-1] if pin_last else 0
    if pinned > (sum(lengths) + 1) // 2:  # the pinned last document alone is more than half: A holds only it
        assert real_a == pinned and split.origin_a.tolist() == [len(lengths) - 1]
    else:
        assert real_a - real_b in (0, 1)  # equal tokens (A takes the odd one)
    assert split.cut == (split.assignment.cut >= 0)
    assert int((split.docs_b.past > 0).sum()) <= 1 + pin_last  # at most one document cut, and the pinned copy
    if pin_last:  # the last document stays whole in A, and B holds a key-only copy of it
        assert len(lengths) - 1 in split.origin_a.tolist() and split.origin_b[-1] == len(lengths) - 1
        assert split.docs_b.past[-1] == split.docs_b.lengths[-1] == lengths[-1]
    # attention through the split equals each document's attention computed whole
    g = torch.Generator().manual_seed(len(lengths))
    n = docs.num_query_tokens
    q, k, v = (torch.randn(n, 4, 8, generator=g) for _ in range(3))
    whole = _attention(docs, q, k, v)
    ra, rb = torch.from_numpy(split.rows_a), torch.from_numpy(split.rows_b)
    out_a = _attention(split.docs_a, q[ra], k[ra], v[ra])
    before, after = torch.from_numpy(split.rows_a[split.prefix_rows]), torch.from_numpy(split.rows_a[split.pinned_rows])
    k_b, v_b = torch.cat([k[before], k[rb], k[after]]), torch.cat([v[before], v[rb], v[after]])
    out_b = _attention(split.docs_b, q[rb], k_b, v_b)
    rebuilt = torch.zeros_like(whole).index_copy(0, ra, out_a).index_copy(0, rb, out_b)
    torch.testing.assert_close(rebuilt, whole, rtol=1e-5, atol=1e-6)


def test_one_long_document_is_cut_in_half():
    split = split_nano_batches(PackedDocuments.from_lengths([1000]))
    assert split.docs_a.lengths.tolist() == [500]
    assert split.docs_b.lengths.tolist() == [1000] and split.docs_b.past.tolist() == [500]
    assert split.cut and split.prefix_rows.size == 500


def test_nano_split_refuses_a_cache():
    docs = PackedDocuments(np.array([5]), np.array([3]), np.array([0]), np.array([0]), 2, 5)
    with pytest.raises(ValueError, match="KV cache"):
        split_nano_batches(docs)


@settings(max_examples=300, deadline=None)
@given(events=st.lists(st.sampled_from(["issue", "issue opening", "relays issued", "take"]), max_size=30))
def test_issue_queue_holds_only_behind_pending_relays(events):
    """``IssueQueue`` (both schedules'): exchanges are issued in the order asked; once a relayed first
    round (an "opening") is issued, nothing more is until its relay rounds are ("relays issued": the
    oldest pending one's), unless one is taken (then everything asked is); otherwise nothing waits.
    ``take`` gives what the exchange's launch returned, and refuses one never asked for."""
    from distca_hf.runtime.issue_queue import IssueQueue

    class Owner:  # a wave or a nano-batch
        pass

    queue, issued, asked, owners, pending, untaken = IssueQueue(), [], [], {}, [], []
    for number, event in enumerate(events):
        before = len(issued)
        if event.startswith("issue"):
            asked.append(number)
            untaken.append(number)
            owner = owners.setdefault(number, Owner()) if event == "issue opening" else None
            queue.issue(number, lambda n=number: issued.append(n) or f"exchange {n}", opens_relays_of=owner)
        elif event == "relays issued":
            queue.relays_issued(owners[pending.pop(0)] if pending else Owner())
        elif untaken:
            key = untaken.pop(0)
            was_issued = key in issued
            assert queue.take(key) == f"exchange {key}"
            assert not (was_issued and issued[before:])  # taking an issued one releases nothing
        new = issued[before:]
        assert issued == asked[: len(issued)]  # in order, each once
        if pending and event != "take":
            assert not new  # held behind the pending relay rounds (another's, after a "relays issued")
        if event != "take":
            assert not any(n in owners for n in new[:-1])  # an opening holds what follows it
        pending += [n for n in new if n in owners]
        if (event == "take" and new) or not pending:
            assert issued == asked  # nothing waits without a reason; a take of a held one issues all
        assert bool(queue.pending) == bool(pending)
    with pytest.raises(RuntimeError, match="never asked for"):
        queue.take("unknown")


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(1, 300), min_size=1, max_size=6), min_size=2, max_size=4),
       st.sampled_from([1, 16]))
def test_wave_halves_cover_the_plan(per_rank, block):
    from distca_hf.planning.splits import cut_local_work_in_halves, first_half_by_pairs
    from distca_hf.planning import DocumentPieces, plan_tasks

    plan = plan_tasks(DocumentPieces.from_rank_lists(per_rank))
    cut = cut_local_work_in_halves(plan, block)
    starts = {(int(d), int(s), int(a)) for d, s, a in zip(plan.doc, plan.server, plan.q_start)}
    for d, s, a in zip(cut.doc, cut.server, cut.q_start):  # a new cut lies a whole number of blocks in
        if (int(d), int(s), int(a)) not in starts:
            first = max(int(x) for x, dd, ss in zip(plan.q_start, plan.doc, plan.server)
                        if dd == d and ss == s and x < a)
            assert (int(a) - first) % block == 0

    def queries(p):  # per (document, server): the set of query positions
        cover = {}
        for d, s, a, b in zip(p.doc, p.server, p.q_start, p.q_end):
            cover.setdefault((int(d), int(s)), []).extend(range(int(a), int(b)))
        return {key: sorted(v) for key, v in cover.items()}

    assert queries(cut) == queries(plan)
    local = cut.source == cut.server
    early = first_half_by_pairs(cut, local)
    pairs = cut.pairs()
    for server in np.unique(cut.server[local]):
        mine = local & (cut.server == server)
        total, first = pairs[mine].sum(), pairs[mine & early].sum()
        biggest_row = int(cut.q_end[mine].max())  # a cut is exact up to one block of query rows
        assert abs(2 * first - total) <= 2 * block * biggest_row + 2


@pytest.mark.distributed
@pytest.mark.parametrize("world, family, overlap", [
    (2, "llama", "wave"), (4, "qwen3", "wave"), (2, "qwen3", "pingpong"), (4, "llama", "pingpong"),
])
def test_overlap_modes_are_exact(tmp_path, world, family, overlap):
    results = run_ranks(exactness_worker, world, tmp_path, family, overlap, env={"DISTCA_TOLERANCE": "0.02"})
    for rank, runs in exact_runs(results, 8):
        assert {(r["backward"], r["checkpointing"]) for r in runs} == {
            (b, c) for b in ("saved", "resend") for c in (False, True)}
        for run in runs:
            stats = run["stats"]
            assert stats["overlap"] == overlap and 0.0 < stats["moved_query_fraction"] < 1.0
            if overlap == "wave":
                assert stats["waves"] >= 2
            else:
                assert len(stats["nano_batches"]) == 2
            local, served = np.array(stats["attn_pairs_local"]), np.array(stats["attn_pairs_served"])
            assert local.sum() == served.sum()
            if local.max() / local.mean() >= 1.5:
                assert served.max() / served.mean() <= 1.1, (rank, run)
    check_forward_bytes(results)


def _mixed_stacks_worker(rank, world):
    import warnings

    import distca_hf
    from helpers import tiny_model

    distca_hf.configure(overlap="pingpong")
    model = tiny_model("llama")
    ids = torch.randint(1, 96, (1, 40 if rank == 0 else 12), generator=torch.Generator().manual_seed(rank))
    report = {}
    # padded rows through the ping-pong stack: the real tokens match each row run alone
    g = torch.Generator().manual_seed(10 + rank)
    rows, mask = torch.randint(1, 96, (2, 24), generator=g), torch.ones(2, 24, dtype=torch.long)
    mask[1, 17 - 5 * rank:] = 0
    with torch.no_grad():
        padded = model(input_ids=rows, attention_mask=mask).logits
        report["padded_overlap"] = distca_hf.plan_stats()["overlap"]
        model.set_attn_implementation("eager")
        alone = [model(input_ids=rows[i : i + 1, : int(mask[i].sum())]).logits[0] for i in range(2)]
        model.set_attn_implementation("distca")
    report["padded_err"] = max(float((padded[i, : len(a)] - a).abs().max()) for i, a in enumerate(alone))
    with warnings.catch_warnings(record=True) as caught:  # hidden states: HF's stack, overlap="wave"
        warnings.simplefilter("always")
        out = model(input_ids=ids, output_hidden_states=True)
    report["fallback_overlap"] = distca_hf.plan_stats()["overlap"]
    report["warned"] = any("pingpong" in str(w.message) for w in caught)
    report["hidden_states"] = len(out.hidden_states)
    try:  # only rank 1 asks for hidden states: the ranks would run different collectives
        model(input_ids=ids, output_hidden_states=rank == 1)
        report["mixed"] = "ok"
    except distca_hf.DistCAPeerError as e:
        report["mixed"] = str(e)
    try:  # one rank autocasts, the other not: their exchanges would read each other's bytes as their own dtype
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=rank == 0):
            model(input_ids=ids)
        report["dtypes"] = "ok"
    except ValueError as e:
        report["dtypes"] = str(e)
    return report


@pytest.mark.distributed
def test_ranks_running_different_stacks_stop_together(tmp_path):
    # tolerance 0.02: every forward dispatches (under "auto" a forward that moves nothing runs locally
    # and reports no overlap)
    results = run_ranks(_mixed_stacks_worker, 2, tmp_path, env={"DISTCA_TIMEOUT_S": "90", "DISTCA_TOLERANCE": "0.02"},
                        deadline_s=200)
    for r in results:
        assert r["ok"], r.get("traceback", r["error"])
        report = r["value"]
        assert report["padded_overlap"] == "pingpong" and report["padded_err"] < 1e-5
        assert report["fallback_overlap"] == "wave" and report["warned"] and report["hidden_states"] == 3
        assert "ping-pong" in report["mixed"] and "rank(s) [0]" in report["mixed"]
        assert "differ in dtype (rank 0: bfloat16" in report["dtypes"] and "rank 1: float32" in report["dtypes"]


def test_overlap_summary_and_chrome_trace(tmp_path):
    from distca_hf.runtime.timeline import Event, chrome_trace, overlap_summary

    events = [
        Event("send", "comm", "forward", 0.0, 1.0),
        Event("kernel", "compute", "forward", 0.0, 0.8),
        Event("wait: send", "wait", "forward", 0.8, 1.0),
        Event("grads", "comm", "backward", 2.0, 4.0),  # fully hidden
        Event("kernel bwd", "compute", "backward", 2.0, 4.5),
    ]
    summary = overlap_summary(events)
    assert summary["comm_s"] == pytest.approx(3.0) and summary["exposed_s"] == pytest.approx(0.2)
    assert summary["overlap_fraction"] == pytest.approx(1 - 0.2 / 3.0)
    assert summary["forward"]["overlap_fraction"] == pytest.approx(0.8)
    assert summary["backward"]["overlap_fraction"] == pytest.approx(1.0)
    assert overlap_summary([])["overlap_fraction"] == 0.0
    path = tmp_path / "trace.json"
    chrome_trace([events, events[:2]], str(path))
    trace = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in trace if e["ph"] == "X"]
    assert len(spans) == 7 and {e["pid"] for e in spans} == {0, 1}
    send = next(e for e in spans if e["name"] == "send" and e["pid"] == 0)
    assert send["tid"] == 1 and send["ts"] == 0 and send["dur"] == pytest.approx(1e6)
