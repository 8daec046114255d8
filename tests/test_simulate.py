"""`distca-hf simulate` (contract JSON, errors, plot), its baselines, and `distca-hf profile`."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distca_hf.planning import (DocumentPieces, PlannerConfig, TimeModel, TokenBytes, causal_pairs, colocated_plan,
                                comm_bytes, kv_transfers, plan_tasks)
from distca_hf.planning.baselines import RankLoads
from distca_hf.planning.by_time import loads_seconds
from distca_hf.tools.simulate import (draw_batch, format_table, pack_pieces, per_doc_cp_kv_received, simulate,
                                      simulate_pipeline)

CONTRACT_KEYS = {
    "ranks", "tokens_per_rank", "batches", "colocated", "wlb", "distca", "per_doc_cp", "ulysses", "time_model",
    "hidden_comm_fraction", "planner", "best_baseline", "speedup_vs_best_baseline", "speedup_vs_colocated",
    "tuned_baseline", "speedup_vs_tuned_baseline",
}
# contract "memory in plans" and "simulate additions" (per-server received K/V): every method
MEMORY_KEYS = {"memory_imbalance", "memory_bytes_per_layer", "kv_received_tokens_per_layer"}
DISTCA_KEYS = {"attn_imbalance", "worst_attn_imbalance", "moved_query_fraction", "comm_bytes_per_layer",
               "plan_ms_median", "step_time_s", "exposed_comm_s", "tasks_per_server",
               "smallest_shard_tokens", "worst_memory_imbalance", "resend_batch_fraction",
               "servers_per_long_document", "relayed_batch_fraction", "kv_exchange_rounds"} | MEMORY_KEYS


def _console_script(*args):
    exe = Path(sys.executable).parent / "distca-hf"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "distca_hf"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True)


def _cli(*args):
    from helpers import cli_in_process

    return cli_in_process(*args)


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
    assert set(out["colocated"]) == {"attn_imbalance", "step_time_s", "exposed_comm_s"} | MEMORY_KEYS
    assert set(out["wlb"]) == {"attn_imbalance", "step_time_s", "exposed_comm_s", "threshold_tokens",
                               "tokens_left_waiting"} | MEMORY_KEYS
    assert set(out["per_doc_cp"]) == {"degree", "attn_imbalance", "comm_bytes_per_layer", "gathered_kv_tokens_per_layer", "step_time_s", "exposed_comm_s"} | MEMORY_KEYS
    gathered, degree = out["per_doc_cp"]["gathered_kv_tokens_per_layer"], out["per_doc_cp"]["degree"]
    # a full batch: each rank gathers its group's tokens but its own (head-tail chunks: about 2048)
    assert gathered["mean"] == pytest.approx((degree - 1) * 2048) and gathered["max"] >= gathered["mean"]
    assert set(out["ulysses"]) == {"degree", "attn_imbalance", "comm_bytes_per_layer", "step_time_s",
                                   "exposed_comm_s"} | MEMORY_KEYS
    for method in ("colocated", "wlb", "distca", "per_doc_cp", "ulysses"):
        memory = out[method]["memory_bytes_per_layer"]
        assert set(memory) == {"max", "mean"} and memory["mean"] <= memory["max"]
        assert out[method]["memory_imbalance"] >= 1.0
    for method in ("colocated", "wlb", "distca", "per_doc_cp", "ulysses"):
        received = out[method]["kv_received_tokens_per_layer"]
        assert set(received) == {"max", "mean"} and 0 <= received["mean"] <= received["max"]
    assert (out["ranks"], out["tokens_per_rank"], out["batches"]) == (8, 2048, 3)
    d = out["distca"]
    assert 1.0 <= d["attn_imbalance"] <= d["worst_attn_imbalance"]
    assert d["attn_imbalance"] <= out["colocated"]["attn_imbalance"] + 1e-9  # a plan never raises the busiest load
    assert 0.0 <= d["moved_query_fraction"] <= 1.0
    assert out["time_model"]["source"].startswith("built-in CUDA default") and out["hidden_comm_fraction"] == 0.0
    assert out["planner"] == {"tolerance": "auto", "block": 128, "backward": "saved", "memory_budget": 0.1,
                              "auto_planner": "descent", "kv_cap": None, "kv_relays": "auto"}
    steps = {m: out[m]["step_time_s"] for m in ("colocated", "wlb", "per_doc_cp", "ulysses")}
    assert out["best_baseline"] == min(steps, key=steps.get)
    assert out["speedup_vs_best_baseline"] == pytest.approx(min(steps.values()) / d["step_time_s"])
    assert out["speedup_vs_colocated"] == pytest.approx(steps["colocated"] / d["step_time_s"])
    tuned = out["tuned_baseline"]  # every degree that holds the longest document, the smallest among them
    assert tuned["step_time_s"] <= min(steps.values()) + 1e-12 and tuned["method"] in steps
    assert out["speedup_vs_tuned_baseline"] == pytest.approx(tuned["step_time_s"] / d["step_time_s"])
    if tuned["method"] in ("per_doc_cp", "ulysses"):
        assert 8 % tuned["degree"] == 0
    assert 0 <= d["exposed_comm_s"] < d["step_time_s"]
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
    ("[3, 0, 5]", ">= 1 token"),
    ("[3, 2.5]", ">= 1 token"),
])
def test_simulate_bad_lengths(tmp_path, content, match):
    path = tmp_path / "bad.json"
    path.write_text(content)
    result = _cli("simulate", "--lengths", str(path), "--ranks", "2", "--tokens-per-rank", "64")
    assert result.returncode == 2 and match in result.stderr


@pytest.mark.parametrize("lengths, ranks, tokens, match", [
    ([-5], 2, 64, r"lengths\[0\] is -5"),  # drew forever: the batch never filled
    ([0, 0], 2, 64, r"lengths\[0\] is 0"),
    ([], 2, 64, "non-empty list"),
    ([10.7, 3.2], 2, 64, r"lengths\[0\] is 10.7"),  # cut to integers without a word
    ([3_100_000_000], 1, 64, "at most 3037000499"),  # its pairs overflowed int64: a negative step time
    ([100], 0, 64, "ranks must be an integer >= 1"),
    ([100], 2, 0, "tokens_per_rank must be an integer >= 1"),
])
def test_simulate_refuses_what_it_cannot_draw_from(lengths, ranks, tokens, match):
    with pytest.raises(ValueError, match=match):
        simulate(lengths, ranks, tokens, batches=1)
    with pytest.raises(ValueError, match=match):
        simulate_pipeline(lengths, max(ranks, 1) * 2 if ranks else 0, tokens, stages=2, micro_batches=2, batches=1)


def test_simulate_from_python_names_a_bad_argument():
    """The Python API checks what the CLI's flags check (a ZeroDivisionError, numbers from an impossible
    head split, numpy's seed error and a dataclasses TypeError before)."""
    for kwargs, error, match in (({"heads": 0, "kv_heads": 0}, ValueError,
                                  r"heads must be an integer from 1 to \d+, got 0"),
                                 ({"heads": 32, "kv_heads": 3}, ValueError,
                                  r"heads \(32\) must be a positive multiple of kv_heads \(3\)"),
                                 ({"seed": -1}, ValueError, "seed must be an integer >= 0, got -1"),
                                 ({"config": {"tolerance": 0.1}}, TypeError, "config must be a .*PlannerConfig")):
        with pytest.raises(error, match=match):
            simulate([100], 2, 128, batches=1, **kwargs)
    with pytest.raises(ValueError, match="seed must be an integer >= 0"):
        simulate_pipeline([100], 4, 128, stages=2, micro_batches=2, batches=1, seed=-2)


def test_simulate_plot_without_matplotlib_is_refused_before_simulating(lengths_file, tmp_path, monkeypatch):
    # (a traceback after the whole simulation before, with nothing printed, not even --json's object)
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    result = _cli("simulate", "--lengths", str(lengths_file), "--ranks", "2", "--tokens-per-rank", "64", "--json",
                  "--plot", str(tmp_path / "sim.png"))
    assert result.returncode == 2 and "--plot needs matplotlib" in result.stderr and not result.stdout, result.stderr
    assert not (tmp_path / "sim.png").exists()


def test_simulate_bad_arguments(lengths_file, tmp_path):
    (tmp_path / "empty.json").write_text("{}")  # a TypeError from TimeModel's constructor before
    # a profile of another model's shape was mixed with the flags' bytes without a word
    TimeModel(1e-6, 2e-10, 3e-6, 1e10, "test").save(tmp_path / "small.json", shape={
        "hidden": 64, "intermediate": 64, "heads": 2, "kv_heads": 1})
    for flags, match in ((["--seed", "-1"], "--seed must be >= 0"), (["--layers", "0"], "--layers must be >= 1"),
                         (["--layers", "8"], "--layers is read by the pipeline model only"),
                         (["--plot", str(tmp_path)], "is a folder; name a file in it"),  # written as .png before
                         (["--plot", str(tmp_path / "x.txt")], "must end with one of .png, .pdf, .svg"),
                         (["--tokens-per-rank", str(10**12)], "--ranks x --tokens-per-rank = 2000000000000"),
                         (["--hidden", "100"], "--hidden (100) must be a multiple of --heads (32)"),
                         (["--tolerance", "nan"], "--tolerance must be a finite number >= 0"),
                         (["--ranks", "5000", "--tokens-per-rank", "1"], "the longest document would span 5000 "
                          "ranks, at most 4096"),  # (killed out of memory at 100000 before)
                         (["--backward", "resend", "--memory-budget", "0"],  # (ignored before)
                          "--backward resend keeps nothing: drop one of them"),
                         (["--block", "0"], "--block must be an integer from 1 to 2147483647 (tokens per shard block), "
                          "got 0"),
                         (["--time-model", str(tmp_path / "none.json")], "--time-model: "),
                         (["--time-model", str(lengths_file)], "a time model is a JSON object"),
                         (["--time-model", str(tmp_path / "empty.json")], "the time model lacks the keys"),
                         (["--time-model", str(tmp_path / "small.json")], "was profiled on --hidden 64 --heads 2 "
                          "--kv-heads 1, this run models --hidden 4096 --heads 32 --kv-heads 8")):
        result = _cli("simulate", "--lengths", str(lengths_file), "--ranks", "2", "--tokens-per-rank", "64", *flags)
        assert result.returncode == 2 and match in result.stderr, result.stderr
    result = _cli("simulate", "--lengths", str(tmp_path), "--ranks", "2", "--tokens-per-rank", "64")
    assert result.returncode == 2 and "--lengths: cannot read" in result.stderr, result.stderr
    result = _cli("simulate", "--lengths", str(tmp_path / "missing.json"), "--ranks", "2", "--tokens-per-rank", "64")
    assert result.returncode == 2 and "does not exist" in result.stderr
    result = _cli("simulate", "--lengths", str(lengths_file), "--ranks", "0", "--tokens-per-rank", "64")
    assert result.returncode == 2 and "--ranks must be >= 1" in result.stderr
    result = _cli("simulate", "--lengths", str(lengths_file), "--ranks", "2", "--tokens-per-rank", "64",
                  "--heads", "6", "--kv-heads", "4")
    assert result.returncode == 2 and "multiple of --kv-heads" in result.stderr
    for flag, value, match in (("--hidden-comm-fraction", "1.5", "--hidden-comm-fraction must be between 0 and 1"),
                               ("--wlb-threshold", "65", "--wlb-threshold must be between 1 and --tokens-per-rank"),
                               ("--bytes-per-s", "0", "--bytes-per-s must be a finite number >= 1 bytes per second"),
                               # an overflow to inf seconds (Infinity in the JSON) before
                               ("--bytes-per-s", "1e-300", "--bytes-per-s must be a finite number >= 1"),
                               # an OverflowError from numpy before
                               ("--hidden", str(2**62), "--hidden must be an integer from 1 to 1048576"),
                               ("--kv-heads", "0", "--kv-heads must be an integer from 1 to 1048576"),
                               # ignored before: a number plans that carving
                               ("--auto-planner", "tolerances", "--auto-planner tolerances needs --tolerance auto "
                                                                "(got 0.1)"),
                               ("--sliding-window", "0", "--sliding-window must be an integer >= 1 (keys per query), got 0"),
                               ("--sliding-fraction", "0.5", "--sliding-fraction needs --sliding-window W")):
        tolerance = ["--tolerance", "0.1"] if flag == "--auto-planner" else []
        result = _cli("simulate", "--lengths", str(lengths_file), "--ranks", "2", "--tokens-per-rank", "64", flag, value,
                      *tolerance)
        assert result.returncode == 2 and match in result.stderr, result.stderr
    for fraction in ("0", "1", "1.5", "nan"):
        result = _cli("simulate", "--lengths", str(lengths_file), "--ranks", "2", "--tokens-per-rank", "64",
                      "--sliding-window", "8", "--sliding-fraction", fraction)
        assert result.returncode == 2 and "--sliding-fraction must be in (0, 1)" in result.stderr, result.stderr
    result = _cli("simulate", "--lengths", str(lengths_file), "--ranks", "2", "--tokens-per-rank", "64",
                  "--sliding-window", "8", "--pipeline-parallel", "2")
    assert result.returncode == 2 and "--sliding-window is read by the layer model only" in result.stderr


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 1000), ranks=st.integers(1, 6), tokens=st.integers(1, 300))
def test_batches_fill_ranks_exactly(seed, ranks, tokens):
    lengths = np.array([1, 7, 40, 333, 2000])
    docs = draw_batch(lengths, ranks * tokens, np.random.default_rng(seed))
    assert docs.sum() == ranks * tokens and (docs > 0).all()
    pieces = pack_pieces(docs, ranks, tokens)
    assert pieces.tokens().tolist() == [tokens] * ranks
    assert pieces.local_pairs().sum() == sum(int(causal_pairs(0, n)) for n in docs.tolist())


def test_distca_beats_colocated_on_skewed_batches():
    lengths = np.array([64] * 50 + [4096])
    fast_network = TimeModel(linear_s_per_token=1e-9, attn_s_per_pair=1e-9, bytes_per_s=1e15)
    fixed = PlannerConfig(tolerance=0.02, block=1)
    result = simulate(lengths, ranks=8, tokens_per_rank=1024, batches=4, seed=0, config=fixed, time_model=fast_network)
    assert result["colocated"]["attn_imbalance"] > 2
    assert result["distca"]["worst_attn_imbalance"] <= 1.02 + 1e-9
    assert result["speedup_vs_colocated"] > 1.5
    assert result["per_doc_cp"]["comm_bytes_per_layer"] > result["distca"]["comm_bytes_per_layer"]
    # a slow network: the fixed tolerance pays more for the bytes than it gains; planning by time
    # under the same model is never predicted slower than colocated, and hiding the bytes helps
    slow_network = dataclasses.replace(fast_network, bytes_per_s=1e9)
    slow = simulate(lengths, ranks=8, tokens_per_rank=1024, batches=4, seed=0, config=fixed, time_model=slow_network)
    assert slow["speedup_vs_colocated"] < 1
    auto = simulate(lengths, ranks=8, tokens_per_rank=1024, batches=4, seed=0,
                    config=dataclasses.replace(fixed, tolerance="auto"), time_model=slow_network)
    assert auto["speedup_vs_colocated"] >= 1 - 1e-12
    hidden = simulate(lengths, ranks=8, tokens_per_rank=1024, batches=4, seed=0, config=fixed,
                      time_model=slow_network, hidden_comm_fraction=0.9)
    assert hidden["distca"]["exposed_comm_s"] < slow["distca"]["exposed_comm_s"]
    assert hidden["speedup_vs_colocated"] > slow["speedup_vs_colocated"]


def test_time_model_roundtrip_and_validation(tmp_path):
    model = TimeModel(1e-6, 2e-10, 3e-6, 1e10, "test")
    path = tmp_path / "tm.json"
    model.save(path, shape={"hidden": 8})
    assert TimeModel.load(path) == model and TimeModel.load_profile(path) == (model, {"hidden": 8})
    for shape in ({"hidden": 0}, {"hidden": 8.5}, {"layers": 2}, [8]):
        model.save(path, shape=shape)
        with pytest.raises(ValueError, match="'shape' must map"):
            TimeModel.load(path)
    path.write_text(json.dumps({"linear_s_per_token": 1.0, "attn_s_per_pair": 1.0, "typo": 3}))
    with pytest.raises(ValueError, match="unknown time-model keys"):
        TimeModel.load(path)
    with pytest.raises(ValueError, match="attn_s_per_pair"):
        TimeModel(1e-6, -1.0)
    for bad, match in (({"heads": 0}, "heads must be an integer >= 1, got 0"),  # (a ZeroDivisionError before)
                       ({"hidden": "64"}, "hidden must be an integer >= 1, got '64'"),
                       ({"attn_flops_per_s": 0.0}, "attn_flops_per_s must be a positive number")):
        with pytest.raises(ValueError, match=f"TimeModel.from_flops: {bad and match}"):
            TimeModel.from_flops(**{"hidden": 64, "intermediate": 128, "heads": 4, "kv_heads": 2, **bad})
    path.write_text("[" * 100000 + "]" * 100000)  # (a RecursionError before)
    with pytest.raises(ValueError, match="cannot read a time model \\(JSON nested too deeply\\)"):
        TimeModel.load(path)


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
    # packed as they are, rank 1's piece of doc 0 receives rank 0's 100 tokens of K/V, rank 0 nothing
    assert result["colocated"]["kv_received_tokens_per_layer"] == {"max": 100.0, "mean": 50.0}
    # Ulysses (2): each rank gets the other's 100 tokens for its half of the K/V heads (8 of them): 50
    assert result["ulysses"]["degree"] == 2
    assert result["ulysses"]["kv_received_tokens_per_layer"] == {"max": 50.0, "mean": 50.0}
    table = format_table(result)
    assert "K/V tokens received per layer, distca" in table
    assert "K/V tokens received per layer, CP of spanning documents" in table
    assert "100 / 75" in table
    assert result["time_model"]["source"] in table and "exposed comm" in table and "step time" not in table
    assert "WLB-LLM packing" in table and "wlb" not in table and "per_doc_cp" not in table


# --- the baselines' layouts and bytes (distca_hf.planning.baselines), against hand counts -----------

def test_step_time_is_the_slowest_rank_with_its_exposed_communication():
    loads = RankLoads(tokens=np.array([10, 0]), pairs=np.array([0.0, 100.0]), keys=np.array([0, 20]),
                      tasks=np.array([1, 1]), sent=np.array([0, 1000]), received=np.array([500, 0]))
    model = TimeModel(linear_s_per_token=1.0, attn_s_per_pair=0.1, task_s=0.5, bytes_per_s=1000.0,
                      task_key_s=0.05, collective_s=0.25)
    compute, exposed = loads_seconds(loads, model, exposed_comm=0.5)
    # compute: 10 tokens + one task; 100 pairs + 20 keys + one task
    assert compute.tolist() == pytest.approx([10 + 0.5, 10 + 1 + 0.5])
    # wire, forward + backward: 2 x (sent + received) / 1000 = 1 and 2; half hidden; + the collectives' 0.25
    assert exposed.tolist() == pytest.approx([0.5 + 0.25, 1.0 + 0.25])
    quiet = dataclasses.replace(loads, sent=np.zeros(2), received=np.zeros(2))
    assert loads_seconds(quiet, model, exposed_comm=1.0)[1].tolist() == [0.0, 0.0]  # nothing moves


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 1000), ranks=st.integers(1, 5), tokens=st.integers(16, 300),
       window=st.sampled_from([None, 5, 64]))
def test_plan_loads_count_what_the_plan_does(seed, ranks, tokens, window):
    """``planning.plan_loads`` (what the planner's and the simulator's times are made of) against
    counts made task by task: own query tokens, pairs, K/V keys and tasks per server, and bytes that
    add up to ``comm_bytes`` on both the sending and the receiving side."""
    from distca_hf.planning import plan_loads

    token_bytes = TokenBytes(8, 4, 8)
    config = PlannerConfig(tolerance=0.02, block=4, token_bytes=token_bytes, window=window)
    pieces = pack_pieces(draw_batch(np.array([1, 7, 40, 333, 2000]), ranks * tokens, np.random.default_rng(seed)),
                         ranks, tokens)
    for plan in (colocated_plan(pieces, window=window), plan_tasks(pieces, config)):
        loads = plan_loads(plan, pieces, token_bytes)
        tokens_of, pairs, keys, tasks = (np.zeros(ranks) for _ in range(4))
        for r, a, b in zip(pieces.rank, pieces.start, pieces.end):
            tokens_of[r] += b - a
        for server, a, b in zip(plan.server, plan.q_start, plan.q_end):
            seen = [t + 1 if window is None else min(t + 1, window) for t in range(int(a), int(b))]
            pairs[server] += sum(seen)
            keys[server] += b - (0 if window is None else max(0, int(a) - window + 1))
            tasks[server] += 1
        assert loads.tokens.tolist() == tokens_of.tolist() and loads.pairs.tolist() == pairs.tolist()
        assert loads.keys.tolist() == keys.tolist() and loads.tasks.tolist() == tasks.tolist()
        total = comm_bytes(plan, pieces, token_bytes).total
        assert loads.sent.sum() == total and loads.received.sum() == total


def test_rank_bytes_hand_checked():
    # rank 0 holds a 10-token document; the plan sends its queries [6, 10) to rank 1, which needs the
    # K/V prefix [0, 10) from rank 0 and returns the output.
    from distca_hf.planning import Plan
    from distca_hf.planning.transfers import rank_bytes

    pieces = DocumentPieces.from_rank_lists([[10], []])
    plan = Plan(np.array([0, 0]), np.array([0, 1]), np.array([0, 0]), np.array([0, 6]), np.array([6, 10]), 2, (0, 1))
    tb = TokenBytes(q=8, kv=4, o=8)
    sent, received = rank_bytes(plan, pieces, tb)
    assert sent.tolist() == [4 * 8 + 10 * 4, 4 * 8] and received.tolist() == [4 * 8, 4 * 8 + 10 * 4]
    assert sent.sum() == received.sum() == comm_bytes(plan, pieces, tb).total


def test_head_tail_chunks_hand_checked():
    from distca_hf.planning.baselines import head_tail_chunks

    # 12 tokens, 3 holders: chunks of 2; holder i gets chunks i and 5 - i
    hs, he, ts, te = head_tail_chunks(12, 3)
    assert list(zip(hs, he, ts, te)) == [(0, 2, 10, 12), (2, 4, 8, 10), (4, 6, 6, 8)]
    # 9 tokens, 2 holders: chunk sizes 3, 2, 2, 2 (the remainder to the first chunks)
    hs, he, ts, te = head_tail_chunks(np.array([9, 3]), 2)
    assert hs.tolist() == [[0, 3], [0, 1]] and he.tolist() == [[3, 5], [1, 2]]
    assert ts.tolist() == [[7, 5], [3, 2]] and te.tolist() == [[9, 7], [3, 3]]


@settings(max_examples=60, deadline=None)
@given(length=st.integers(1, 500), holders=st.integers(1, 9))
def test_head_tail_chunks_partition_the_document(length, holders):
    from distca_hf.planning.baselines import head_tail_chunks

    hs, he, ts, te = (a.tolist() for a in head_tail_chunks(length, holders))
    chunks = sorted([*zip(hs, he), *zip(ts, te)])
    assert chunks[0][0] == 0 and chunks[-1][1] == length
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))  # consecutive, no gap, no overlap
    sizes = [e - s for s, e in chunks]
    assert max(sizes) - min(sizes) <= 1


def test_smallest_degree_and_deepspeeds_ulysses_rule():
    from distca_hf.planning.baselines import smallest_degree, ulysses_degree_ok

    assert smallest_degree(100, 30, 8) == 4  # 4 x 30 >= 100, 3 does not divide 8
    assert smallest_degree(100, 30, 6) == 6  # divisors 1, 2, 3 hold 90 at most
    assert smallest_degree(30, 30, 6) == 1
    assert smallest_degree(300, 30, 8) is None
    assert smallest_degree(100, 30, 8, allowed=lambda d: d != 4) == 8
    assert ulysses_degree_ok(4, 32, 8) and ulysses_degree_ok(16, 32, 8) and ulysses_degree_ok(32, 32, 8)
    assert not ulysses_degree_ok(64, 32, 8)  # heads do not split
    assert not ulysses_degree_ok(6, 12, 4)  # 4 KV heads neither split over 6 nor repeat evenly


def test_cp_loads_hand_checked():
    from distca_hf.planning.baselines import cp_loads

    tb = TokenBytes(q=8, kv=4, o=8)
    # one group of 2 ranks x 6 tokens holding documents of 8 and 4 tokens: the 8 in chunks of 2 (rank 0:
    # [0, 2) and [6, 8); rank 1: [2, 4) and [4, 6)), the 4 in chunks of 1 (rank 0: [0, 1), [3, 4); rank 1:
    # [1, 2), [2, 3))
    loads = cp_loads(np.array([8, 4]), ranks=2, tokens_per_rank=6, degree=2, token_bytes=tb)
    assert loads.tokens.tolist() == [6, 6] and loads.tasks.tolist() == [4, 2]  # rank 1's chunks touch: one task
    assert loads.pairs.tolist() == [(1 + 2) + (7 + 8) + 1 + 4, (3 + 4) + (5 + 6) + 2 + 3]
    assert loads.keys.tolist() == [2 + 8 + 1 + 4, 6 + 3]  # each task runs against its prefix
    assert loads.received.tolist() == [6 * 4, 6 * 4] and loads.sent.tolist() == [6 * 4, 6 * 4]
    # two groups of 2 ranks x 3 tokens, packed best fit decreasing: the 8-token document fits no group
    # whole, the 4-token one goes to group 0 whole; the 8 then fills the rooms left in order, cut into
    # independent documents of 2 (group 0) and 6 (group 1). Group 0: the 4 in chunks of 1 as above,
    # the 2 in chunks [0, 1) [1, 2) and two empty ones; group 1: the 6 in chunks [0, 2) [2, 4) [4, 5)
    # [5, 6). Degree 1 is plain data parallelism: no bytes.
    loads = cp_loads(np.array([8, 4]), ranks=4, tokens_per_rank=3, degree=2, token_bytes=tb)
    assert loads.tokens.tolist() == [3, 3, 3, 3] and loads.tasks.tolist() == [3, 2, 2, 1]
    assert loads.pairs.tolist() == [1 + 4 + 1, 2 + 3 + 2, 1 + 2 + 6, 3 + 4 + 5]
    one = cp_loads(np.array([5, 7]), ranks=3, tokens_per_rank=4, degree=1, token_bytes=tb)
    assert one.tokens.tolist() == [4, 4, 4] and one.sent.tolist() == [0, 0, 0] and one.received.tolist() == [0, 0, 0]
    assert one.pairs.tolist() == [10, 1 + 6, 10]  # neither fits a rank whole: [5 | 7] cut at ranks: 4 | 1 + 3 | 4
    assert one.tasks.tolist() == [1, 2, 1] and one.keys.tolist() == [4, 1 + 3, 4]  # no CP: whole pieces


def _best_fit_decreasing_token_by_token(docs, groups, group_tokens, whole_above):
    """``group_documents`` written naively: best fit decreasing of the documents longer than
    ``whole_above`` by a scan of every group, then the others laid token by token into the rooms
    left; sorted ``(group, length)`` pairs."""
    room, owner = [group_tokens] * groups, [None] * len(docs)
    for i in sorted((i for i in range(len(docs)) if docs[i] > whole_above), key=lambda i: (-docs[i], i)):
        fits = [g for g in range(groups) if room[g] >= docs[i]]
        if fits:
            owner[i] = min(fits, key=lambda g: (room[g], g))
            room[owner[i]] -= docs[i]
    pieces, g = {}, 0
    for i, length in enumerate(docs):
        for _ in range(length if owner[i] is None else 0):
            while room[g] == 0:
                g += 1
            room[g] -= 1
            pieces[i, g] = pieces.get((i, g), 0) + 1
    placed = [(owner[i], length) for i, length in enumerate(docs) if owner[i] is not None]
    return sorted(placed + [(g, n) for (_, g), n in pieces.items()])


@settings(max_examples=80, deadline=None)
@given(groups=st.integers(1, 5), group_tokens=st.integers(1, 12), data=st.data())
def test_group_documents_packs_whole_documents_best_fit_decreasing(groups, group_tokens, data):
    from distca_hf.planning.baselines import group_documents

    total = data.draw(st.integers(1, groups * group_tokens))
    cuts = sorted(data.draw(st.sets(st.integers(1, total - 1), max_size=total - 1))) if total > 1 else []
    docs = np.diff([0, *cuts, total])  # any split of a batch that fits the groups
    whole_above = data.draw(st.integers(0, group_tokens))
    group, length = group_documents(docs, groups, group_tokens, whole_above=whole_above)
    assert sorted(zip(group.tolist(), length.tolist())) == _best_fit_decreasing_token_by_token(
        docs.tolist(), groups, group_tokens, whole_above)
    assert (np.bincount(group, weights=length, minlength=groups) <= group_tokens).all() and length.sum() == total
    with pytest.raises(ValueError, match="more than"):
        group_documents(np.array([groups * group_tokens + 1]), groups, group_tokens)
    with pytest.raises(ValueError, match=">= 1 token"):
        group_documents(np.array([1, 0]), groups, group_tokens)


def test_baselines_keep_a_document_whole_when_a_group_holds_it():
    from distca_hf.planning.baselines import cp_loads

    # packed in order, the 6-token document would cross the boundary of two 6-token groups (2 | 4);
    # best fit decreasing gives it group 0 of its own (longest first, ties to the lowest group): all its
    # 21 pairs, and the three 2-token documents go to group 1
    loads = cp_loads(np.array([2, 2, 6, 2]), ranks=2, tokens_per_rank=6, degree=1, token_bytes=TokenBytes(8, 4, 8))
    assert loads.pairs.tolist() == [21, 3 * 3]


def _ulysses_bytes_brute_force(degree, heads, kv_heads, q_head, kv_head, o_head):
    """Bytes rank 0 sends per token it holds: to each other rank j, the query and output heads j
    computes and every K/V head those query heads use (GQA: query head h uses KV head h // group),
    counted head by head."""
    group = heads // kv_heads
    mine = heads // degree
    total = 0
    for j in range(1, degree):
        q_heads = range(j * mine, (j + 1) * mine)
        total += len(q_heads) * (q_head + o_head) + len({h // group for h in q_heads}) * kv_head
    return total


@settings(max_examples=60, deadline=None)
@given(degree=st.sampled_from([1, 2, 4, 8, 16, 32]), kv_heads=st.sampled_from([1, 2, 4, 8, 32]),
       head_bytes=st.integers(1, 64))
def test_ulysses_bytes_equal_a_head_by_head_count(degree, kv_heads, head_bytes):
    from distca_hf.planning.baselines import ulysses_degree_ok, ulysses_token_bytes

    heads = 32
    if not ulysses_degree_ok(degree, heads, kv_heads):
        return
    tb = TokenBytes(q=heads * head_bytes, kv=2 * kv_heads * head_bytes, o=heads * head_bytes)
    expected = _ulysses_bytes_brute_force(degree, heads, kv_heads, head_bytes, 2 * head_bytes, head_bytes)
    assert ulysses_token_bytes(degree, tb, kv_heads) == pytest.approx(expected)


def test_ulysses_loads_balance_inside_groups_only():
    from distca_hf.planning.baselines import ulysses_loads

    tb = TokenBytes(q=8, kv=4, o=8)
    # two groups of 2 ranks x 4 tokens: group 0 holds one 8-token document, group 1 eight 1-token ones
    loads = ulysses_loads(np.array([8] + [1] * 8), ranks=4, tokens_per_rank=4, degree=2, token_bytes=tb, kv_heads=2)
    assert loads.pairs.tolist() == [18.0, 18.0, 4.0, 4.0]  # 36 / 2 and 8 / 2
    assert loads.tasks.tolist() == [1, 1, 8, 8] and loads.tokens.tolist() == [4, 4, 4, 4]
    assert loads.keys.tolist() == [4.0, 4.0, 4.0, 4.0]  # 8 keys over 2 ranks' heads, 8 x 1 likewise
    per_token = (8 + 8) / 2 + 4 * 0.5  # half the heads of q and o, one of the two KV heads
    assert loads.sent.tolist() == [4 * per_token] * 4 == loads.received.tolist()


def test_wlb_queue_releases_one_long_document_per_micro_batch():
    from distca_hf.planning.baselines import wlb_steps

    # 2 ranks x 10 tokens, documents over 5 tokens queued. Step 1: 6 and 7 each start a rank, 8 waits;
    # the shorts (4 then 3, most pairs first) go to the least-loaded rank with room: 4 only fits rank 0,
    # 3 then only rank 1. Step 2: the queued 8 comes first, then 9 on the other rank; the 2 fits rank 0.
    steps, left = wlb_steps([np.array([6, 7, 8, 3, 4]), np.array([9, 2])], ranks=2, tokens_per_rank=10, threshold=5)

    def contents(pieces, lengths):
        return [sorted(int(lengths[d]) for d in pieces.doc[pieces.rank == r]) for r in range(pieces.num_ranks)]

    assert contents(*steps[0]) == [[4, 6], [3, 7]]
    assert contents(*steps[1]) == [[2, 8], [9]]
    assert left.tolist() == []
    # a queued document longer than a rank starts on a fresh rank and continues on the next ones
    steps, left = wlb_steps([np.array([9, 1, 1, 1])], ranks=3, tokens_per_rank=4, threshold=2)
    pieces, lengths = steps[0]
    long_doc = pieces.doc == int(np.flatnonzero(lengths == 9)[0])
    assert pieces.rank[long_doc].tolist() == [0, 1, 2] and pieces.start[long_doc].tolist() == [0, 4, 8]
    assert pieces.tokens().tolist() == [4, 4, 4] and left.tolist() == []
    # what does not fit waits: 3 + 3 + 3 on 2 ranks of 4
    steps, left = wlb_steps([np.array([3, 3, 3])], ranks=2, tokens_per_rank=4, threshold=4)
    assert sorted(left.tolist()) == [3] and steps[0][0].tokens().tolist() == [3, 3]
    with pytest.raises(ValueError, match="threshold"):
        wlb_steps([np.array([3])], ranks=2, tokens_per_rank=4, threshold=5)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 1000), ranks=st.integers(1, 6), tokens=st.integers(4, 200), frac=st.floats(0.1, 1.0))
def test_wlb_steps_conserve_tokens_and_release_at_most_one_long_document_per_rank(seed, ranks, tokens, frac):
    from distca_hf.planning.baselines import wlb_steps

    lengths = np.array([1, 7, 40, 333, 2000])
    rng = np.random.default_rng(seed)
    batches = [draw_batch(lengths, ranks * tokens, rng) for _ in range(3)]
    threshold = max(1, int(frac * tokens))
    steps, left = wlb_steps(batches, ranks, tokens, threshold)
    placed = []
    for pieces, step_lengths in steps:
        assert (pieces.tokens() <= tokens).all()
        long_starts = pieces.rank[(pieces.start == 0) & (step_lengths[pieces.doc] > threshold)]
        assert len(set(long_starts.tolist())) == long_starts.size  # one released document per micro-batch
        np.testing.assert_array_equal(np.bincount(pieces.doc, weights=pieces.end - pieces.start,
                                                  minlength=step_lengths.size), step_lengths)
        placed += step_lengths.tolist()
    assert sorted(placed + left.tolist()) == sorted(np.concatenate(batches).tolist())


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 1000), ranks=st.integers(1, 5), tokens=st.integers(16, 300),
       hidden=st.sampled_from([0.0, 0.5, 1.0]))
def test_simulated_colocated_and_distca_steps_equal_an_independent_recount(seed, ranks, tokens, hidden):
    """Colocated and distca step times recomputed from the same batches: per rank, its tokens, the
    pairs of its pieces (or served tasks) counted query by query, its tasks, and its bytes from the
    K/V transfers and moved queries; the step is the slowest rank."""
    lengths = np.array([1, 7, 40, 333, 2000])
    tb = TokenBytes(8, 4, 8)
    config = PlannerConfig(tolerance=0.02, block=4, token_bytes=tb)
    model = TimeModel(linear_s_per_token=1e-6, attn_s_per_pair=1e-8, task_s=1e-6, bytes_per_s=1e7)
    result = simulate(lengths, ranks, tokens, batches=2, seed=seed, config=config, time_model=model,
                      hidden_comm_fraction=hidden)
    rng = np.random.default_rng(seed)
    step = lambda plan, pieces: _recounted_step(plan, pieces, tb, hidden, tokens)
    colocated, distca = [], []
    for _ in range(2):
        pieces = pack_pieces(draw_batch(lengths, ranks * tokens, rng), ranks, tokens)
        colocated.append(step(colocated_plan(pieces), pieces))
        distca.append(step(plan_tasks(pieces, config), pieces))
    assert result["colocated"]["step_time_s"] == pytest.approx(np.mean(colocated))
    assert result["distca"]["step_time_s"] == pytest.approx(np.mean(distca))


def _recounted_step(plan, pieces, tb: TokenBytes, hidden: float, tokens: int, *, window: int | None = None,
                    transfers=None) -> float:
    """A layer's time recounted by hand under the time model of the tests above (linear 1e-6 s a token,
    1e-8 s a pair, 1e-6 s a task, 1e7 bytes/s): per rank its tokens, the pairs of the tasks it serves
    counted query by query (at most ``window`` keys each), its tasks, and its bytes from the moved
    queries and ``transfers`` (default: the plan's K/V transfers); the slowest rank."""
    ranks = pieces.num_ranks
    sent, received = np.zeros(ranks), np.zeros(ranks)
    for src, srv, a, b in zip(plan.source, plan.server, plan.q_start, plan.q_end):
        if src != srv:
            sent[src] += (b - a) * tb.q
            received[srv] += (b - a) * tb.q
            sent[srv] += (b - a) * tb.o
            received[src] += (b - a) * tb.o
    t = transfers if transfers is not None else kv_transfers(plan, pieces)
    for src, srv, a, b in zip(t.source, t.server, t.start, t.end):
        sent[src] += (b - a) * tb.kv
        received[srv] += (b - a) * tb.kv
    times = []
    for r in range(ranks):
        pairs = sum(min(q + 1, window or q + 1) for a, b in zip(plan.q_start[plan.server == r],
                                                               plan.q_end[plan.server == r]) for q in range(a, b))
        compute = 1e-6 * tokens + 1e-8 * pairs + 1e-6 * int((plan.server == r).sum())
        wire = 2 * (sent[r] + received[r]) / 1e7  # forward + backward, sent and received
        times.append(compute + (1 - hidden) * wire)
    return max(times)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 1000), ranks=st.integers(2, 4), tokens=st.integers(16, 200), window=st.integers(1, 64),
       fraction=st.sampled_from([0.5, 5 / 6, 0.99]))
def test_mixed_layers_equal_an_independent_recount(seed, ranks, tokens, window, fraction):
    """``--sliding-window``: a sliding layer on the full layers' plan computes windowed pairs but moves
    whole prefixes; on its own plan (planned with the window) windowed pairs and windowed K/V; both plans
    without key-split tiles (the runtime makes none for mixed models); every layer time recounted by
    hand, averaged over the layers as ``fraction`` of them slide."""
    import dataclasses as dc

    lengths = np.array([1, 7, 40, 333, 2000])
    tb = TokenBytes(8, 4, 8)
    # (planning by time, which may split keys where allowed; direct sends and no budget: the recount's model)
    config = PlannerConfig(tolerance="auto", block=4, token_bytes=tb, key_split=True, kv_relays="off",
                           memory_budget=None)
    model = TimeModel(linear_s_per_token=1e-6, attn_s_per_pair=1e-8, task_s=1e-6, bytes_per_s=1e7)
    result = simulate(lengths, ranks, tokens, batches=2, seed=seed, config=config, time_model=model,
                      sliding_window=window, sliding_fraction=fraction)
    config = dc.replace(config, key_split=False, time_model=model)
    mixed = result["mixed_layers"]
    rng = np.random.default_rng(seed)
    expected = {"colocated": [], "one_plan": [], "plan_per_kind": []}
    for _ in range(2):
        pieces = pack_pieces(draw_batch(lengths, ranks * tokens, rng), ranks, tokens)
        step = lambda plan, **kw: _recounted_step(plan, pieces, tb, 0.0, tokens, **kw)
        full_plan = plan_tasks(pieces, config)
        full = step(full_plan)
        windowed = dc.replace(config, window=window)
        layers = {"colocated": (step(colocated_plan(pieces)), step(colocated_plan(pieces, window=window),
                                                                    window=window)),
                  "one_plan": (full, step(full_plan, window=window)),  # the full plan's whole prefixes move
                  "plan_per_kind": (full, step(plan_tasks(pieces, windowed), window=window))}
        for method, (full_s, sliding_s) in layers.items():
            expected[method].append(fraction * sliding_s + (1 - fraction) * full_s)
    for method, times in expected.items():
        assert mixed["layer_time_s"][method] == pytest.approx(np.mean(times), rel=1e-9), method
    assert mixed["speedup_vs_one_plan"] == pytest.approx(np.mean(expected["one_plan"]) /
                                                         np.mean(expected["plan_per_kind"]), rel=1e-9)
    # a window as long as every document slides nothing: one plan is the plan of its kind
    whole = simulate(lengths, ranks, tokens, batches=2, seed=seed, config=config, time_model=model,
                     sliding_window=ranks * tokens, sliding_fraction=fraction)["mixed_layers"]
    assert whole["layer_time_s"]["one_plan"] == pytest.approx(whole["layer_time_s"]["plan_per_kind"], rel=1e-9)


def test_mixed_layers_plan_both_kinds_without_key_splits():
    """The runtime makes no key-split plan for a model mixing windows (a tile holds exactly for one
    window only), so neither do the simulator's plans of such a model, whatever the config says."""
    from distca_hf.tools.simulate_mixed import mixed_layer_times

    asked = []

    def planner(pieces, config):
        asked.append((config.window, config.key_split))
        return plan_tasks(pieces, config)

    pieces = pack_pieces(np.array([300, 20, 7, 60]), 2, 200)
    mixed_layer_times(pieces, PlannerConfig(tolerance="auto", block=4, key_split=True), sliding_window=16,
                      planner=planner)
    assert asked == [(None, False), (16, False)]


def test_ulysses_unavailable_when_no_degree_deepspeed_accepts_holds_the_longest_document():
    # a 400-token document needs 8 ranks of 64 tokens; with 4 heads DeepSpeed accepts at most 4
    result = simulate(np.array([400, 10]), ranks=8, tokens_per_rank=64, batches=2, seed=0, heads=4, kv_heads=2)
    assert result["ulysses"]["step_time_s"] is None and result["ulysses"]["degree"] is None
    assert "4 heads" in result["ulysses"]["unavailable"]
    assert result["per_doc_cp"]["degree"] == 8 and result["best_baseline"] != "ulysses"
    assert "n/a" in format_table(result)
    with_heads = simulate(np.array([400, 10]), ranks=8, tokens_per_rank=64, batches=2, seed=0, heads=8, kv_heads=2)
    assert with_heads["ulysses"]["degree"] == 8  # 8 heads split over 8 ranks, 2 K/V heads repeated 4 times


def test_simulate_measures_the_auto_planner_before_the_descent_beside_it():
    """``auto_planner="tolerances"`` plans ``tolerance="auto"`` as before the descent (colocated and the
    fixed-tolerance carvings), on the same batches: the descent is never predicted slower, batch by batch
    (so on average), and the long documents' servers are counted; a bad name is refused."""
    lengths = [320 * 1024] + [2048] * 600  # one long document among short ones: it spans ranks
    kwargs = dict(ranks=32, tokens_per_rank=32768, batches=2, seed=0)
    new, old = (simulate(lengths, auto_planner=name, **kwargs) for name in ("descent", "tolerances"))
    assert new["planner"]["auto_planner"] == "descent" and old["planner"]["auto_planner"] == "tolerances"
    assert new["distca"]["step_time_s"] <= old["distca"]["step_time_s"] * (1 + 1e-12)
    assert new["distca"]["step_time_s"] < 0.95 * old["distca"]["step_time_s"]  # and here clearly faster
    fan = new["distca"]["servers_per_long_document"]
    assert 1 < fan["mean"] <= fan["max"] <= 32
    with pytest.raises(ValueError, match="auto_planner must be one of"):
        simulate(lengths, auto_planner="fastest", **kwargs)

