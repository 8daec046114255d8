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

from distca_hf.planning import TimeModel
from distca_hf.planning import causal_pairs
from distca_hf.tools.simulate import draw_batch, pack_pieces, simulate, wlb_loads

CONTRACT_KEYS = {
    "ranks", "tokens_per_rank", "batches", "colocated", "wlb", "distca", "per_doc_cp", "speedup_vs_colocated",
}
DISTCA_KEYS = {"attn_imbalance", "worst_attn_imbalance", "moved_query_fraction", "comm_bytes_per_layer",
               "plan_ms_median"}


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
    assert set(out["per_doc_cp"]) == {"comm_bytes_per_layer"}
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
