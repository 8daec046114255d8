"""`distca-hf simulate` (contract JSON, errors, plot), its baselines, and `distca-hf profile`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distca_hf.planning import DocumentPieces, PlannerConfig, TimeModel, TokenBytes, causal_pairs, kv_transfers, plan_tasks
from distca_hf.tools.simulate import draw_batch, format_table, pack_pieces, per_doc_cp_kv_received, simulate, wlb_loads

CONTRACT_KEYS = {
    "ranks", "tokens_per_rank", "batches", "colocated", "wlb", "distca", "per_doc_cp", "speedup_vs_colocated",
}
DISTCA_KEYS = {"attn_imbalance", "worst_attn_imbalance", "moved_query_fraction", "comm_bytes_per_layer",
               "plan_ms_median", "kv_received_tokens_per_layer"}


def _console_script(*args):
    exe = Path(sys.executable).parent / "distca-hf"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "distca_hf"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True)


def _cli(*args):
    """Run the CLI in this process (a console-script start costs seconds); returns a
    CompletedProcess-like (returncode, stdout, stderr)."""
    import contextlib
    import io

    from distca_hf.tools.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:
            code = e.code
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


@pytest.fixture
def lengths_file(tmp_path):
    rng = np.random.default_rng(0)
    lengths = np.maximum(1, rng.lognormal(6.0, 1.3, size=400).astype(int)).tolist()
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps(lengths))
    return path


@pytest.mark.distributed
def test_simulate_json_contract(lengths_file, tmp_path):
    plot = tmp_path / "sim.png"
    result = _console_script("simulate", "--lengths", str(lengths_file), "--ranks", "8", "--tokens-per-rank", "2048",
                             "--batches", "3", "--seed", "1", "--json", "--plot", str(plot))
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert set(out) == CONTRACT_KEYS
    assert set(out["distca"]) == DISTCA_KEYS
    assert set(out["colocated"]) == {"attn_imbalance"} == set(out["wlb"])
    assert set(out["per_doc_cp"]) == {"comm_bytes_per_layer", "kv_received_tokens_per_layer"}
    for method in ("distca", "per_doc_cp"):
        received = out[method]["kv_received_tokens_per_layer"]
        assert set(received) == {"max", "mean"} and 0 <= received["mean"] <= received["max"]
    assert (out["ranks"], out["tokens_per_rank"], out["batches"]) == (8, 2048, 3)
    d = out["distca"]
    assert 1.0 <= d["attn_imbalance"] <= d["worst_attn_imbalance"] <= out["colocated"]["attn_imbalance"] + 1e-9
    assert 0.0 <= d["moved_query_fraction"] <= 1.0
    assert out["speedup_vs_colocated"] >= 1.0
    assert plot.stat().st_size > 10_000
    again = json.loads(_cli("simulate", "--lengths", str(lengths_file), "--ranks", "8", "--tokens-per-rank", "2048",
                            "--batches", "3", "--seed", "1", "--json").stdout)
    for key in ("colocated", "wlb"):  # everything but timings is a pure function of the seed
        assert again[key] == out[key]
    assert {k: v for k, v in again["distca"].items() if k != "plan_ms_median"} == \
        {k: v for k, v in d.items() if k != "plan_ms_median"}


@pytest.mark.parametrize("content, match", [
    ("[1, 2", "not valid JSON"),
    ("{}", "non-empty JSON list"),
    ("[]", "non-empty JSON list"),
    ("[3, 0, 5]", "positive integer"),
    ("[3, 2.5]", "positive integer"),
])
def test_simulate_bad_lengths(tmp_path, content, match):
    path = tmp_path / "bad.json"
    path.write_text(content)
    result = _cli("simulate", "--lengths", str(path), "--ranks", "2", "--tokens-per-rank", "64")
    assert result.returncode == 2 and match in result.stderr


def test_simulate_bad_arguments(lengths_file, tmp_path):
    result = _cli("simulate", "--lengths", str(tmp_path / "missing.json"), "--ranks", "2", "--tokens-per-rank", "64")
    assert result.returncode == 2 and "does not exist" in result.stderr
    result = _cli("simulate", "--lengths", str(lengths_file), "--ranks", "0", "--tokens-per-rank", "64")
    assert result.returncode == 2 and "--ranks must be >= 1" in result.stderr
    result = _cli("simulate", "--lengths", str(lengths_file), "--ranks", "2", "--tokens-per-rank", "64",
                  "--heads", "6", "--kv-heads", "4")
    assert result.returncode == 2 and "multiple of kv_heads" in result.stderr


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 1000), ranks=st.integers(1, 6), tokens=st.integers(1, 300))
def test_batches_fill_ranks_exactly_and_baselines_conserve_work(seed, ranks, tokens):
    lengths = np.array([1, 7, 40, 333, 2000])
    docs = draw_batch(lengths, ranks * tokens, np.random.default_rng(seed))
    assert docs.sum() == ranks * tokens and (docs > 0).all()
    pieces = pack_pieces(docs, ranks, tokens)
    assert pieces.tokens().tolist() == [tokens] * ranks
    wlb_tokens, wlb_pairs, _ = wlb_loads(docs, ranks, tokens)
    assert wlb_tokens.sum() == ranks * tokens and (wlb_tokens <= tokens).all()
    # WLB splits documents into pieces at multiples of the budget, then places (and maybe splits) them
    assert wlb_pairs.sum() == pytest.approx(sum(int(causal_pairs(0, n)) for n in docs.tolist()))
    assert pieces.local_pairs().sum() == sum(int(causal_pairs(0, n)) for n in docs.tolist())


def test_distca_beats_colocated_on_skewed_batches():
    lengths = np.array([64] * 50 + [4096])
    attention_bound = TimeModel(linear_s_per_token=1e-9, attn_s_per_pair=1e-9)
    result = simulate(lengths, ranks=8, tokens_per_rank=1024, batches=4, seed=0, time_model=attention_bound)
    assert result["colocated"]["attn_imbalance"] > 2
    assert result["distca"]["worst_attn_imbalance"] <= 1.02 + 1e-9
    assert result["speedup_vs_colocated"] > 1.5
    assert result["per_doc_cp"]["comm_bytes_per_layer"] > result["distca"]["comm_bytes_per_layer"]


def test_time_model_roundtrip_and_validation(tmp_path):
    model = TimeModel(1e-6, 2e-10, 3e-6, 1e10, "test")
    path = tmp_path / "tm.json"
    model.save(path, shape={"hidden": 8})
    assert TimeModel.load(path) == model
    path.write_text(json.dumps({"linear_s_per_token": 1.0, "attn_s_per_pair": 1.0, "typo": 3}))
    with pytest.raises(ValueError, match="unknown time-model keys"):
        TimeModel.load(path)
    with pytest.raises(ValueError, match="attn_s_per_pair"):
        TimeModel(1e-6, -1.0)


def test_profile_writes_a_loadable_time_model(tmp_path):
    out = tmp_path / "tm.json"
    result = _cli("profile", "--out", str(out), "--hidden", "64", "--intermediate", "128", "--heads", "4",
                  "--kv-heads", "2", "--max-tokens", "1024", "--repeats", "2")
    assert result.returncode == 0, result.stderr
    model = TimeModel.load(out)
    assert model.linear_s_per_token > 0 and model.attn_s_per_pair > 0
    assert "cpu" in model.source
    sim = _cli("simulate", "--lengths", str(out.parent / "l.json"), "--ranks", "2", "--tokens-per-rank", "8")
    assert sim.returncode == 2  # (no lengths file there)


def _per_doc_cp_brute_force(pieces: DocumentPieces) -> list[int]:
    """Per rank: for every document held by more than one rank, the tokens of ``[0, length)`` whose
    K/V this rank does not hold, counted token by token."""
    received = [0] * pieces.num_ranks
    for d in set(pieces.doc.tolist()):
        mine = pieces.doc == d
        length = int(pieces.end[mine].max())
        holders = set(pieces.rank[mine].tolist())
        if len(holders) < 2:
            continue
        for r in holders:
            held = set()
            for s, e in zip(pieces.kv_start[mine & (pieces.rank == r)], pieces.end[mine & (pieces.rank == r)]):
                held.update(range(int(s), int(e)))
            received[r] += len(set(range(length)) - held)
    return received


def test_per_doc_cp_kv_received_hand_checked():
    # doc 0: [0, 6) on rank 0, [6, 8) on rank 1 (length 8); doc 1: [0, 2) on 1, [2, 5) on 2, [5, 9) on 3
    # (length 9); doc 2: 5 tokens on rank 0 alone (no CP, nothing to gather).
    pieces = DocumentPieces.from_rank_lists([[(0, 0, 6), (2, 0, 5)], [(0, 6, 8), (1, 0, 2)], [(1, 2, 5)], [(1, 5, 9)]])
    # rank 0: 8 - 6; rank 1: (8 - 2) + (9 - 2); rank 2: 9 - 3; rank 3: 9 - 4
    assert per_doc_cp_kv_received(pieces).tolist() == [2, 13, 6, 5]
    # a piece holding K/V before its first query (kv_start < start) gathers less: rank 1 holds [4, 8)
    with_prefix = DocumentPieces(np.array([0, 1]), np.array([0, 0]), np.array([0, 6]), np.array([4, 8]), 3,
                                 kv_start=np.array([0, 4]))
    assert per_doc_cp_kv_received(with_prefix).tolist() == [4, 4, 0]
    assert per_doc_cp_kv_received(DocumentPieces.from_rank_lists([[], [4, 2]])).tolist() == [0, 0]
    assert per_doc_cp_kv_received(DocumentPieces.from_rank_lists([[], []])).tolist() == [0, 0]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 1000), ranks=st.integers(1, 7), tokens=st.integers(1, 300))
def test_per_doc_cp_kv_received_equals_brute_force(seed, ranks, tokens):
    lengths = np.array([1, 7, 40, 333, 2000])
    pieces = pack_pieces(draw_batch(lengths, ranks * tokens, np.random.default_rng(seed)), ranks, tokens)
    assert per_doc_cp_kv_received(pieces).tolist() == _per_doc_cp_brute_force(pieces)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 1000), ranks=st.integers(1, 6), tokens=st.integers(8, 400),
       tolerance=st.sampled_from([0.0, 0.02, 0.2]), block=st.sampled_from([1, 16]))
def test_simulate_kv_received_against_independent_counts(seed, ranks, tokens, tolerance, block):
    """The report's K/V received, max and mean over servers and averaged over batches, recomputed from
    the same batches: distca's from ``kv_transfers`` summed token by token per server (the servers'
    sum is the transfers' tokens), per-document CP's by brute force."""
    lengths = np.array([1, 7, 40, 333, 2000])
    config = PlannerConfig(tolerance=tolerance, block=block, token_bytes=TokenBytes(8, 4, 8))
    batches = 2
    result = simulate(lengths, ranks, tokens, batches=batches, seed=seed, config=config)
    rng = np.random.default_rng(seed)  # the simulator draws every batch from this generator, in order
    dca_max, dca_mean, cp_max, cp_mean = [], [], [], []
    for _ in range(batches):
        pieces = pack_pieces(draw_batch(lengths, ranks * tokens, rng), ranks, tokens)
        plan = plan_tasks(pieces, config)
        transfers = kv_transfers(plan, pieces)
        per_server = [sum(int(e - s) for s, e, v in zip(transfers.start, transfers.end, transfers.server) if v == r)
                      for r in range(ranks)]
        assert sum(per_server) == transfers.tokens()
        dca_max.append(max(per_server))
        dca_mean.append(transfers.tokens() / ranks)
        cp = _per_doc_cp_brute_force(pieces)
        cp_max.append(max(cp))
        cp_mean.append(sum(cp) / ranks)
    distca, cp = result["distca"]["kv_received_tokens_per_layer"], result["per_doc_cp"]["kv_received_tokens_per_layer"]
    assert distca["max"] == pytest.approx(np.mean(dca_max)) and distca["mean"] == pytest.approx(np.mean(dca_mean))
    assert cp["max"] == pytest.approx(np.mean(cp_max)) and cp["mean"] == pytest.approx(np.mean(cp_mean))


def test_simulate_kv_received_hand_checked():
    # One 300-token document cut to 200 fills 2 ranks of 100: per-document CP has each rank gather the
    # other's 100 tokens. Under distca rank 1 still needs rank 0's 100 tokens for its own queries,
    # and rank 0 receives K/V only for a shard of rank 1's: the worst server receives at least 100.
    result = simulate(np.array([300]), ranks=2, tokens_per_rank=100, batches=3, seed=0)
    assert result["per_doc_cp"]["kv_received_tokens_per_layer"] == {"max": 100.0, "mean": 100.0}
    assert result["distca"]["kv_received_tokens_per_layer"]["max"] >= 100
    # 150-token documents: doc 0 is [0, 100) on rank 0 and [100, 150) on rank 1, doc 1 (cut to 50)
    # on rank 1 alone: rank 0 gathers 50, rank 1 gathers 100.
    result = simulate(np.array([150]), ranks=2, tokens_per_rank=100, batches=2, seed=0)
    assert result["per_doc_cp"]["kv_received_tokens_per_layer"] == {"max": 100.0, "mean": 75.0}
    table = format_table(result)
    assert "K/V tokens received per layer, distca" in table and "K/V tokens received per layer, per-doc CP" in table
    assert "100 / 75" in table
