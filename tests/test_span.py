"""Documents that span ranks (``span_ranks=True``): the ranks hold consecutive pieces of one global
token stream; a continuing piece's queries attend to its whole prefix wherever it lives. Every
rank's logits and the sum over ranks of every parameter's gradient equal the whole documents run
alone (fp32), in every overlap and backward mode, with and without checkpointing, and in evaluation;
a continuation the previous rank does not hold stops every rank."""

from __future__ import annotations

import numpy as np
import pytest

from dist_harness import run_ranks
from workers import span_refusal_worker, span_worker

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
    for rank, result in enumerate(results):
        assert result["ok"], f"rank {rank}: {result.get('traceback', result['error'])}"
        *runs, evaluation = result["value"]
        assert evaluation["eval_err"] < 1e-5
        assert len(runs) == 12
        for run in runs:
            assert run["same_grad_keys"]
            assert run["logit_err"] < 1e-5, (rank, run)
            assert run["grad_excess"] < 1e-5, (rank, run)
            stats = run["stats"]
            assert stats["dispatched"] and stats["overlap"] == run["overlap"]
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
    results = run_ranks(span_refusal_worker, 2, tmp_path, claimed, env={"DISTCA_TIMEOUT_S": "20"})
    for rank, result in enumerate(results):
        assert result["ok"], result.get("traceback")
        assert result["value"]["raised"] == "DocumentBoundaryError", (rank, result["value"])
        assert f"rank 1's row starts at position {claimed}" in result["value"]["message"]
        assert "6 tokens" in result["value"]["message"]
