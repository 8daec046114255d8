"""Documents that span ranks (``span_ranks=True``): the ranks hold consecutive pieces of one global
token stream; a continuing piece's queries attend to its whole prefix wherever it lives. Every
rank's logits and the sum over ranks of every parameter's gradient equal the whole documents run
alone (fp32), in every overlap and backward mode, with and without checkpointing, colocated (no
query moves, the prefix K/V still travels), and in evaluation; a continuation the previous rank does
not hold stops every rank."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_harness import run_ranks
from streams import draw_slices, keys_on_server
from distca_hf.planning import PlannerConfig, kv_transfers, plan_tasks, rank_documents, stitch_rank_documents
from workers import exact_runs, span_refusal_worker, span_worker

CASES = {
    # world: (family, document lengths, slice lengths per rank)
    "crossing one boundary": (2, "llama", [30, 50, 7, 1, 12], [60, 40]),
    "one document over every rank": (3, "qwen3", [9, 100, 5], [40, 40, 34]),
    "one-token pieces at the boundaries": (4, "llama", [20, 13, 6, 30, 21], [21, 12, 26, 31]),
    "whole documents and a long one": (4, "qwen3", [3, 70, 11, 2, 40, 9, 1, 24], [30, 40, 30, 60]),
}


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(CASES))
def test_spanning_documents_are_exact(tmp_path, case):
    world, family, doc_lengths, slice_lengths = CASES[case]
    assert sum(doc_lengths) == sum(slice_lengths)
    results = run_ranks(span_worker, world, tmp_path, family, doc_lengths, slice_lengths,
                        env={"DISTCA_TOLERANCE": "0.02"})
    for rank, runs in exact_runs(results, 13):
        for run in runs:
            stats = run["stats"]
            assert stats["dispatched"] and stats["overlap"] == run["overlap"]
            if run["mode"] == "colocated":
                assert stats["moved_query_fraction"] == 0
            local, served = np.array(stats["attn_pairs_local"]), np.array(stats["attn_pairs_served"])
            assert local.sum() == served.sum() and len(local) == world
            # a continuing piece's pairs include its whole prefix (as chunks they would be fewer)
            assert local.sum() == sum(n * (n + 1) // 2 for n in doc_lengths)
            assert sum(stats["kv_tokens_received_per_layer"]) > 0  # some prefix crossed ranks
    plans = {str(r["value"][0]["stats"]["attn_pairs_served"]) for r in results}
    assert len(plans) == 1


@pytest.mark.distributed
@pytest.mark.parametrize("claimed", [15, 3])
def test_a_continuation_the_previous_rank_does_not_hold_stops_every_rank(tmp_path, claimed):
    """Rank 0's last document holds 6 tokens: rank 1 may only continue at position 6."""
    results = run_ranks(span_refusal_worker, 2, tmp_path, claimed, env={"DISTCA_TIMEOUT_S": "90"}, deadline_s=300)
    for rank, result in enumerate(results):
        assert result["ok"], result.get("traceback")
        assert result["value"]["raised"] == "DocumentBoundaryError", (rank, result["value"])
        assert f"rank 1's row starts at position {claimed}" in result["value"]["message"]
        assert "6 tokens" in result["value"]["message"]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 60), min_size=1, max_size=10), st.integers(1, 5), st.data())
def test_stitched_pieces_and_key_only_pieces_plan_exactly(doc_lengths, world, data):
    """Pure: a global stream cut into ``world`` slices is stitched into pieces (continuations keep
    their document); pieces made key-only carry K/V but no work; the plan covers every query once
    and each server gets every task's whole K/V prefix from its own pieces and the transfers."""
    per_rank, firsts = draw_slices(data, doc_lengths, world)
    rows = stitch_rank_documents(per_rank, [np.zeros_like(x) for x in per_rank], firsts, span_ranks=True)
    pieces = rows.pieces
    assert rows.longest_document == max(doc_lengths)
    assert np.array_equal(np.bincount(pieces.doc, weights=pieces.end - pieces.kv_start).astype(int), doc_lengths)
    key_only = np.array(data.draw(st.lists(st.booleans(), min_size=pieces.num_pieces, max_size=pieces.num_pieces)),
                        dtype=bool)
    past = [np.where(key_only[pieces.rank == r], x, 0) for r, x in enumerate(per_rank)]
    pieces = rank_documents(rows.global_ids, rows.offsets, per_rank, past).pieces
    plan = plan_tasks(pieces, PlannerConfig(tolerance=data.draw(st.sampled_from([0.0, 0.05]))))
    assert (plan.q_end > plan.q_start).all()
    covered = {}
    for d, a, b in zip(plan.doc, plan.q_start, plan.q_end):
        covered.setdefault(int(d), []).extend(range(int(a), int(b)))
    wanted = {}
    for d, a, b in zip(pieces.doc, pieces.start, pieces.end):
        wanted.setdefault(int(d), []).extend(range(int(a), int(b)))
    assert {d: sorted(v) for d, v in covered.items()} == {d: sorted(v) for d, v in wanted.items() if v}
    transfers = kv_transfers(plan, pieces)
    for server, d, b in zip(plan.server, plan.doc, plan.q_end):
        assert set(range(int(b))) <= keys_on_server(pieces, transfers, server, d)
