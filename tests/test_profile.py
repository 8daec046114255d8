"""`distca-hf profile`: the communication terms (`--world N`): the synthetic plans, the fit, the
argument checks, and one real run on two gloo processes."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from distca_hf.planning import TimeModel, TokenBytes, default_time_model, kv_transfers
from distca_hf.tools.profiling import (COMM_TINY_TOKENS, comm_backend, communication_plans, fit_comm_terms,
                                       world_warning)


def _profile_cli(*args):
    """``(returncode, stdout, stderr)`` of ``distca-hf profile ARGS`` run in this process."""
    from helpers import cli_in_process

    result = cli_in_process("profile", *args)
    return result.returncode, result.stdout, result.stderr


def _least_squares_line(x, t):
    """Intercept and slope of the ordinary least-squares line, from the closed form (covariance over
    variance), independent of the lstsq call under test."""
    x, t = np.asarray(x, dtype=np.float64), np.asarray(t, dtype=np.float64)
    slope = ((x - x.mean()) * (t - t.mean())).sum() / ((x - x.mean()) ** 2).sum()
    return t.mean() - slope * x.mean(), slope


@settings(max_examples=200, deadline=None)
@given(collective_s=st.floats(1e-6, 1.0), bytes_per_s=st.floats(1e6, 1e12),
       layer_bytes=st.lists(st.integers(0, 10**10), min_size=2, max_size=8, unique=True))
def test_fit_recovers_known_constants(collective_s, bytes_per_s, layer_bytes):
    extra = [collective_s + 2.0 * b / bytes_per_s for b in layer_bytes]
    # the slope is recoverable to 1e-6 only when the bytes' share of the times is well above float precision
    assume(2.0 * (max(layer_bytes) - min(layer_bytes)) / bytes_per_s >= 1e-6 * max(extra))
    fit = fit_comm_terms(layer_bytes, extra, fallback_bytes_per_s=1.0)
    assert fit.warnings == ()
    assert math.isclose(fit.bytes_per_s, bytes_per_s, rel_tol=1e-6)
    # the intercept is known to the float precision of the largest time
    assert abs(fit.collective_s - collective_s) <= 1e-6 * collective_s + 1e-12 * max(extra)


def test_fit_on_noisy_timings_is_the_least_squares_line():
    rng = np.random.default_rng(0)
    layer_bytes = np.array([3e3, 7e5, 1.3e6, 2.6e6, 3.2e6, 5.3e6, 1.05e7])
    extra = 0.02 + 2 * layer_bytes / 1e8 + rng.normal(0, 0.004, layer_bytes.size)
    fit = fit_comm_terms(layer_bytes, extra, fallback_bytes_per_s=1.0)
    intercept, slope = _least_squares_line(2 * layer_bytes, extra)
    assert fit.warnings == ()
    assert math.isclose(fit.collective_s, intercept, rel_tol=1e-9)
    assert math.isclose(fit.bytes_per_s, 1 / slope, rel_tol=1e-9)


def test_fit_with_a_negative_intercept_goes_through_the_origin():
    layer_bytes = np.array([1e3, 1e6, 2e6, 4e6])
    extra = np.array([0.0, 0.015, 0.035, 0.075])  # a line with intercept -5 ms
    assert _least_squares_line(2 * layer_bytes, extra)[0] < 0
    fit = fit_comm_terms(layer_bytes, extra, fallback_bytes_per_s=1.0)
    x = 2 * layer_bytes
    assert fit.collective_s == 0.0
    assert math.isclose(fit.bytes_per_s, (x @ x) / (x @ extra), rel_tol=1e-9)
    assert len(fit.warnings) == 1 and "collective_s" in fit.warnings[0]


def test_fit_whose_time_does_not_grow_with_bytes_keeps_the_fallback_rate():
    layer_bytes = np.array([1e3, 1e6, 2e6, 4e6])
    extra = np.array([0.030, 0.028, 0.026, 0.020])  # falling: no rate to fit
    fit = fit_comm_terms(layer_bytes, extra, fallback_bytes_per_s=1e9)
    assert fit.bytes_per_s == 1e9
    # the least-squares intercept given the fallback rate
    assert math.isclose(fit.collective_s, float(np.mean(extra - 2 * layer_bytes / 1e9)), rel_tol=1e-9)
    assert len(fit.warnings) == 1 and "bytes_per_s" in fit.warnings[0]
    # and never a negative fixed cost
    assert fit_comm_terms(layer_bytes, extra, fallback_bytes_per_s=1e8).collective_s == 0.0


def test_fit_refuses_what_it_cannot_fit():
    with pytest.raises(ValueError, match="two different amounts"):
        fit_comm_terms([5, 5, 5], [0.1, 0.2, 0.3], fallback_bytes_per_s=1.0)
    with pytest.raises(ValueError, match="one entry per plan"):
        fit_comm_terms([1, 2], [0.1], fallback_bytes_per_s=1.0)
    with pytest.raises(ValueError, match="finite"):
        fit_comm_terms([1, 2], [0.1, float("nan")], fallback_bytes_per_s=1.0)


@pytest.mark.parametrize("world", [2, 3, 5])
@pytest.mark.parametrize("tokens", [64, 2048])
def test_communication_plans_give_every_server_the_colocated_kernel_work(world, tokens):
    plans = communication_plans(world, tokens)
    colocated = plans.plans[0]
    assert plans.names[0] == "colocated" and colocated.moved_queries() == 0
    assert kv_transfers(colocated, plans.pieces).tokens() == 0

    def task_shapes(plan, server):  # what the server's kernel computes: (queries, keys) per task
        on = plan.server == server
        return Counter(zip((plan.q_end - plan.q_start)[on].tolist(), plan.keys()[on].tolist()))

    moved = []
    for plan in plans.plans[1:]:
        # every query of every rank once, in the task it has in the colocated plan
        assert sorted(zip(plan.source, plan.doc, plan.q_start, plan.q_end)) == \
            sorted(zip(colocated.source, colocated.doc, colocated.q_start, colocated.q_end))
        assert all(task_shapes(plan, s) == task_shapes(colocated, s) for s in range(world))
        moved.append((plan.moved_queries(), kv_transfers(plan, plans.pieces).tokens()))
    assert moved[0] == (world * COMM_TINY_TOKENS, world * COMM_TINY_TOKENS)  # the tiny document alone
    assert min(moved) == moved[0] and all(q > 0 for q, _ in moved)
    assert len(set(moved)) == len(moved)  # different amounts ...
    assert len({kv / q for q, kv in moved}) > 1  # ... of queries and K/V


def test_communication_plans_refuse_too_few_ranks_or_tokens():
    with pytest.raises(ValueError, match="at least 2 ranks"):
        communication_plans(1, 2048)
    with pytest.raises(ValueError, match="tokens per rank"):
        communication_plans(2, 16)


def test_backend_and_warning_per_machine():
    assert comm_backend("cpu", 4, 0)[0] == "gloo"
    assert comm_backend("cuda", 4, 8) == ("nccl", "4 NCCL processes, one GPU each")
    backend, description = comm_backend("cuda", 4, 1)
    assert backend == "gloo" and "CUDA tensors" in description and "not NCCL" in description
    assert world_warning(2, "cpu", 2) is None
    assert "--world 8" in world_warning(8, "cpu", 2)
    assert world_warning(8, "cuda", 2) is None  # the backend's description says it instead


@pytest.mark.parametrize("world", ["1", "0", "-2"])
def test_world_below_two_is_refused(world, tmp_path):
    code, _, err = _profile_cli("--world", world, "--out", str(tmp_path / "tm.json"))
    assert code == 2
    assert "--world must be >= 2" in err and f"got {world}" in err
    assert not (tmp_path / "tm.json").exists()


def test_without_world_the_json_says_the_communication_terms_are_built_in(tmp_path):
    out = tmp_path / "tm.json"
    code, _, err = _profile_cli("--out", str(out), "--hidden", "64", "--intermediate", "128", "--heads", "2",
                                "--kv-heads", "1", "--max-tokens", "128", "--repeats", "1", "--device", "cpu")
    assert code == 0, err
    model = TimeModel.load(out)
    builtin = default_time_model("cpu", TokenBytes.for_model(64, 2, 1, 4), 4)
    assert (model.bytes_per_s, model.collective_s) == (builtin.bytes_per_s, builtin.collective_s)
    assert "not measured" in model.source and "--world N" in model.source


@pytest.mark.distributed
def test_world_two_measures_the_communication_terms(tmp_path):
    """The plumbing of ``--world 2``: the processes run, the JSON is a valid time model whose source
    says what was measured. Whether the timings resolve both terms depends on the machine's load (a
    busy machine's fit may keep the built-in bytes_per_s, which the source then says): the fit itself
    is tested above on made-up timings."""
    out = tmp_path / "tm.json"
    code, stdout, err = _profile_cli("--world", "2", "--out", str(out), "--hidden", "64", "--intermediate", "128",
                                     "--heads", "2", "--kv-heads", "1", "--max-tokens", "128", "--repeats", "1",
                                     "--device", "cpu")
    assert code == 0, err
    model = TimeModel.load(out)
    assert 0 < model.bytes_per_s < math.inf and 0 <= model.collective_s < math.inf
    assert "measured through the dispatch on 2 gloo processes" in model.source
    builtin = default_time_model("cpu", TokenBytes.for_model(64, 2, 1, 4), 4)
    if model.bytes_per_s == builtin.bytes_per_s:  # not resolved under load: said, not hidden
        assert "kept the built-in" in model.source + stdout + err
    line = stdout.strip().splitlines()[-1]
    assert line.startswith("communication on 2 processes: bytes_per_s") and "collective_s" in line
