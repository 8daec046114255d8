"""The pipeline step model of `distca-hf simulate --pipeline-parallel` (issue 20): the 1F1B and lockstep
event models against hand-computed steps, `balance_micro_batches`, the four methods, the JSON keys
and the CLI's refusals."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distca_hf.planning import (PlannerConfig, TimeModel, TokenBytes, causal_pairs, plan_loads, plan_tasks,
                                step_seconds)
from distca_hf.planning.baselines import pack_pieces
from distca_hf.planning.micro_batches import balance_micro_batches
from distca_hf.planning.pipeline import (lockstep_1f1b_ticks, simulate_1f1b, simulate_lockstep, stock_1f1b_order)
from distca_hf.planning.pipeline_cost import (PIPELINE_METHODS, forward_backward_models, pipeline_step, rank_subset)
from distca_hf.tools.simulate import draw_batch, simulate_pipeline

SHARED_DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
TOKEN_BYTES = TokenBytes(8, 4, 8)


def _cli(*args):
    from helpers import cli_in_process

    return cli_in_process(*args)


# --- the event models --------------------------------------------------------------------------------

def test_stock_1f1b_order_is_torchs():
    # torch's Schedule1F1B: min(M, P - s) forwards, then backward / forward in turn, then backwards
    assert stock_1f1b_order(0, 3, 4) == [("forward", 0), ("forward", 1), ("forward", 2), ("backward", 0),
                                         ("forward", 3), ("backward", 1), ("backward", 2), ("backward", 3)]
    assert stock_1f1b_order(2, 3, 2) == [("forward", 0), ("backward", 0), ("forward", 1), ("backward", 1)]
    assert stock_1f1b_order(0, 4, 2) == [("forward", 0), ("forward", 1), ("backward", 0), ("backward", 1)]
    with pytest.raises(ValueError, match="stage must lie in"):
        stock_1f1b_order(3, 3, 2)


@pytest.mark.parametrize("stages, micro_batches", [(1, 1), (1, 5), (2, 1), (2, 4), (3, 2), (4, 8), (5, 3)])
def test_equal_operations_take_m_plus_p_minus_1_cycles(stages, micro_batches):
    forward, backward = 1.5, 2.75
    run = simulate_1f1b(np.full((stages, micro_batches), forward), np.full((stages, micro_batches), backward))
    expected = (micro_batches + stages - 1) * (forward + backward)
    assert run.step_s == pytest.approx(expected)
    assert run.bubble_fraction == pytest.approx((stages - 1) / (micro_batches + stages - 1))
    ticks = lockstep_1f1b_ticks(stages, micro_batches)
    lockstep = simulate_lockstep([forward if t.kind == "forward" else backward for t in ticks],
                                 num_stages=stages, num_micro_batches=micro_batches)
    assert lockstep.step_s == pytest.approx(expected)


def test_1f1b_with_transfers_hand_computed():
    # P = 2, M = 2, forwards 1 s, backwards 2 s, 0.5 s between stages. Stage 0: F0 [0, 1], F1 [1, 2];
    # stage 1: F0 [1.5, 2.5], B0 [2.5, 4.5], F1 [4.5, 5.5], B1 [5.5, 7.5]; stage 0: B0 [5, 7], B1 [8, 10].
    run = simulate_1f1b(np.ones((2, 2)), np.full((2, 2), 2.0), p2p_s=0.5)
    assert run.step_s == pytest.approx(10.0) and run.busy_s == (6.0, 6.0)
    # a slow micro-batch 0 on stage 1 (forward 3 s): stage 1 F0 [1.5, 4.5], B0 [4.5, 6.5], F1 [6.5, 7.5],
    # B1 [7.5, 9.5]; stage 0 B0 [7, 9], B1 [10, 12]
    forward = np.array([[1.0, 1.0], [3.0, 1.0]])
    assert simulate_1f1b(forward, np.full((2, 2), 2.0), p2p_s=0.5).step_s == pytest.approx(12.0)
    with pytest.raises(ValueError, match="stages, micro_batches"):
        simulate_1f1b(np.ones((2, 2)), np.ones((2, 3)))
    with pytest.raises(ValueError, match="p2p_s"):
        simulate_1f1b(np.ones((2, 2)), np.ones((2, 2)), p2p_s=-1.0)


def test_lockstep_with_transfers_hand_computed():
    # P = 2, M = 2: ticks F0 (0, -), F1 (1, 0), B0 (-, 0), F2 (-, 1), B1 (0, 1), B2 (1, -), lasting 1..6 s.
    # F1 waits for F0's activations (1 + 0.5), B0 receives nothing (the last stage's own forward), F2's
    # activations came in F1 (hidden by B0), B1's gradients in B0 (hidden by F2), B2's in B1: 15.5 + 0.5.
    ticks = lockstep_1f1b_ticks(2, 2)
    assert [(t.kind[0], t.micro_batches) for t in ticks] == [("f", (0, None)), ("f", (1, 0)), ("b", (None, 0)),
                                                              ("f", (None, 1)), ("b", (0, 1)), ("b", (1, None))]
    run = simulate_lockstep([1, 2, 3, 4, 5, 6], num_stages=2, num_micro_batches=2, p2p_s=0.5)
    assert run.step_s == pytest.approx(22.0)
    assert run.busy_s == (1 + 2 + 5 + 6, 2 + 3 + 4 + 5)
    with pytest.raises(ValueError, match="one duration per tick"):
        simulate_lockstep([1, 2], num_stages=2, num_micro_batches=2)
    # ragged lists, strings and complex numbers failed inside numpy; bools and text read as seconds
    for bad in (["1"] * 6, [True] * 6, [1j] * 6):
        with pytest.raises(ValueError, match=r"tick_s must be a list \(one per tick\) of seconds"):
            simulate_lockstep(bad, num_stages=2, num_micro_batches=2)
    for bad in ([[1.0], [1.0, 2.0]], [["a"]], [[True]]):
        with pytest.raises(ValueError, match=r"forward_s must be a \[stages, micro_batches\] array of seconds"):
            simulate_1f1b(bad, bad)


# --- balance_micro_batches -----------------------------------------------------------------------------

def _row_contents(pieces):
    return [sorted((int(d), int(s), int(e)) for d, s, e in zip(pieces.doc[pieces.rank == r], pieces.start[pieces.rank == r],
                                                             pieces.end[pieces.rank == r]))
            for r in range(pieces.num_ranks)]


def test_balance_micro_batches_hand_checked():
    # in order, rows of 10 hold [6, 4 of the second 6] and [its last 2, 2, 2, 2, 2]: 21 + 10 and 11 + 12 pairs;
    # balanced, each row holds a 6 and two 2s: 27 pairs each
    lengths = [6, 6, 2, 2, 2, 2]
    naive = pack_pieces(np.array(lengths), 2, 10)
    assert naive.local_pairs().tolist() == [31, 23]
    balanced = balance_micro_batches(lengths, micro_batches=2, tokens=10)
    assert balanced.local_pairs().tolist() == [27, 27] and balanced.tokens().tolist() == [10, 10]
    assert sorted(len(row) for row in _row_contents(balanced)) == [3, 3]
    # a document longer than a row is cut into consecutive row-sized pieces that keep their prefix
    long_doc = balance_micro_batches([25, 5], micro_batches=3, tokens=10)
    assert long_doc.local_pairs().sum() == causal_pairs(0, 25) + causal_pairs(0, 5)
    assert sorted(long_doc.tokens().tolist()) == [10, 10, 10]
    with pytest.raises(ValueError, match="31 tokens, more than 3 micro-batch rows x 10 tokens = 30"):
        balance_micro_batches([25, 6], micro_batches=3, tokens=10)
    with pytest.raises(ValueError, match="micro_batches must be an integer >= 1"):
        balance_micro_batches([3], micro_batches=0, tokens=10)
    with pytest.raises(ValueError, match=">= 1 token"):
        balance_micro_batches([3, 0], micro_batches=1, tokens=10)
    with pytest.raises(ValueError, match=r"micro_batches must be at most 1048576 rows .* got 1000000000000"):
        balance_micro_batches([3], micro_batches=10**12, tokens=10)  # a numpy MemoryError before


def test_balance_micro_batches_refuses_a_window_that_is_not_none_or_an_integer_of_at_least_one():
    # 0 divided by zero, -1 counted negative pairs, 0.5 / nan / True passed silently, "8" failed in numpy
    for window in (0, -1, 0.5, float("nan"), True, "8"):
        with pytest.raises(ValueError, match=r"window must be None or an integer >= 1 .*got"):
            balance_micro_batches([10, 2], micro_batches=3, tokens=4, window=window)
    expected = _row_contents(balance_micro_batches([10, 2], micro_batches=3, tokens=4, window=2))
    assert _row_contents(balance_micro_batches([10, 2], micro_batches=3, tokens=4, window=np.int64(2))) == expected


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=30), rows=st.integers(1, 6),
       tokens=st.integers(1, 200), fill=st.booleans(), window=st.sampled_from([None, 16]))
def test_balance_micro_batches_keeps_every_document_once_and_never_loses_to_packing_in_order(lengths, rows, tokens,
                                                                                                fill, window):
    lengths = np.array(lengths)
    if fill:  # the documents of a full step, the last one cut where the rows are full
        lengths = draw_batch(lengths, rows * tokens, np.random.default_rng(int(lengths.sum())))
    elif lengths.sum() > rows * tokens:
        return
    pieces = balance_micro_batches(lengths, micro_batches=rows, tokens=tokens, window=window)
    assert pieces.num_ranks == rows
    # every token of every document exactly once (DocumentPieces checks the pieces tile [0, length))
    per_doc = np.bincount(pieces.doc, weights=pieces.end - pieces.start, minlength=lengths.size)
    assert per_doc.tolist() == lengths.tolist() and (pieces.start == pieces.kv_start).all()
    assert (pieces.tokens() <= tokens).all()
    if fill:
        assert pieces.tokens().tolist() == [tokens] * rows
    in_order = pack_pieces(lengths, rows, tokens)
    assert pieces.local_pairs(window).max() <= in_order.local_pairs(window).max()
    # the attention computed is the documents' own: cutting never changes it
    assert pieces.local_pairs(window).sum() == sum(int(causal_pairs(0, int(n), window)) for n in lengths)


# --- the four methods ----------------------------------------------------------------------------------

NO_COMM = TimeModel(linear_s_per_token=1e-6, attn_s_per_pair=1e-8, task_s=1e-6, bytes_per_s=1e18, task_key_s=1e-9)
WITH_COMM = dataclasses.replace(NO_COMM, bytes_per_s=1e8, collective_s=1e-4)


def _micro_batches(seed, count, data_parallel, tokens):
    rng = np.random.default_rng(seed)
    return [draw_batch(np.array([3, 30, 100, 400, 900]), data_parallel * tokens, rng) for _ in range(count)]


@pytest.mark.parametrize("mode, backward_passes", [("saved", 1), ("resend", 2)])
def test_forward_and_backward_models_add_up_to_the_time_model(mode, backward_passes):
    """Compute splits 1 : 2; the forward moves one pass of the bytes, the backward one more in saved
    mode (dO out, dQ and dK/dV back) and two in resend mode (q, k/v, out and dO again)."""
    forward, backward = forward_backward_models(WITH_COMM, mode)
    assert backward.linear_s_per_token == pytest.approx(2 * forward.linear_s_per_token)
    for name in ("linear_s_per_token", "attn_s_per_pair", "task_s", "task_key_s"):
        assert getattr(forward, name) + getattr(backward, name) == pytest.approx(getattr(WITH_COMM, name))
    sent, received = 3e6, 1e6
    one_pass = (sent + received) / WITH_COMM.bytes_per_s
    assert forward.comm_seconds(sent, received, 1.0, True, mode) == pytest.approx(one_pass + 5e-5)
    assert backward.comm_seconds(sent, received, 1.0, True, mode) == pytest.approx(backward_passes * one_pass + 5e-5)
    assert forward.comm_seconds(sent, received, 0.5, True, mode) + backward.comm_seconds(
        sent, received, 0.5, True, mode) == pytest.approx(WITH_COMM.comm_seconds(sent, received, 0.5, True, mode))


@pytest.mark.parametrize("tolerance", [0.02, "auto"])
def test_cad_across_stages_with_one_stage_is_the_distca_step(tolerance):
    """P = 1: the lockstep is each micro-batch's forward tick then its backward tick over the D ranks,
    planned as distca plans one batch: with nothing on the wire (the forward and backward shares of
    every rank are then proportional) the step is the sum of the distca layer times
    (``by_time.step_seconds``, what ``distca-hf simulate`` reports per batch)."""
    data_parallel, tokens, layers = 4, 512, 3
    config = PlannerConfig(tolerance=tolerance, block=4, token_bytes=TOKEN_BYTES, time_model=NO_COMM)
    docs = _micro_batches(1, 3, data_parallel, tokens)
    steps = pipeline_step(docs, stages=1, data_parallel=data_parallel, tokens=tokens, layers=layers, config=config,
                          activation_bytes_per_token=64)
    assert set(steps) == set(PIPELINE_METHODS)
    expected = across = 0.0
    for batch in docs:
        pieces = pack_pieces(batch, data_parallel, tokens)
        expected += layers * step_seconds(plan_tasks(pieces, config), pieces, config)
        # a tick's exchanges synchronise its ranks around the attention: it is balanced on its own, and a
        # tick's layer lasts the slowest rank's linear layers plus the slowest rank's attention
        ticked = plan_tasks(pieces, dataclasses.replace(config, base_pairs=(0.0,) * data_parallel))
        loads = plan_loads(ticked, pieces, TOKEN_BYTES)
        attention = NO_COMM.rank_seconds(np.zeros(data_parallel), loads.pairs, loads.tasks, loads.keys)
        across += layers * (NO_COMM.linear_s_per_token * pieces.tokens().max() + attention.max())
    assert steps["cad_across_stages"].step_s == pytest.approx(across, rel=1e-12)
    assert steps["cad_per_stage"].step_s == pytest.approx(expected, rel=1e-12)
    assert steps["cad_across_stages"].bubble_fraction == pytest.approx(0.0)


def test_colocated_1f1b_is_the_slowest_pipeline_of_its_own_rows():
    """Colocated: pipeline d runs row d of every micro-batch; with one stage and no wire the step is
    the largest over d of the rows' layer times summed, each row its tokens and its pieces' pairs,
    keys and tasks counted here."""
    data_parallel, tokens = 3, 256
    config = PlannerConfig(tolerance=0.02, block=4, token_bytes=TOKEN_BYTES, time_model=NO_COMM)
    docs = _micro_batches(2, 2, data_parallel, tokens)
    steps = pipeline_step(docs, stages=1, data_parallel=data_parallel, tokens=tokens, layers=2, config=config,
                          activation_bytes_per_token=64)
    per_pipeline = np.zeros(data_parallel)
    for batch in docs:
        pieces = pack_pieces(batch, data_parallel, tokens)
        for r, s, e in zip(pieces.rank, pieces.start, pieces.end):
            per_pipeline[r] += NO_COMM.rank_seconds(e - s, causal_pairs(s, e), 1, e)
    assert steps["colocated_1f1b"].step_s == pytest.approx(2 * per_pipeline.max(), rel=1e-12)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 1000), bytes_per_s=st.sampled_from([1e7, 1e18]))
def test_lockstep_tick_plan_is_never_predicted_slower_than_its_stages_alone(seed, bytes_per_s):
    """A tick's plan (``plan_lockstep_tick``) computes every query of every stage's micro-batch once
    and is never predicted slower than each stage planned over its own ranks (on a slow network
    pooling spreads a long document's K/V to more servers than it saves)."""
    from distca_hf.planning import by_time
    from distca_hf.planning.pipeline_cost import plan_lockstep_tick, pool_pieces

    data_parallel, tokens = 4, 256  # at 1e7 bytes/s pooling these batches alone is predicted 3-4% slower
    model = dataclasses.replace(NO_COMM, bytes_per_s=bytes_per_s)
    config = PlannerConfig(tolerance="auto", block=4, token_bytes=TOKEN_BYTES, time_model=model)
    parts = [(pack_pieces(docs, data_parallel, tokens), stage * data_parallel)
             for stage, docs in enumerate(_micro_batches(seed, 3, data_parallel, tokens))]
    pooled = pool_pieces(parts, 4 * data_parallel)  # one stage in a bubble
    plan = plan_lockstep_tick(pooled, config, rank_groups=[range(o, o + data_parallel) for _, o in parts])
    queries = np.bincount(pooled.doc, weights=pooled.end - pooled.start)
    assert np.bincount(plan.doc, weights=plan.q_end - plan.q_start, minlength=queries.size).tolist() == \
        queries.tolist()
    alone = max(by_time.step_seconds(plan_tasks(pieces, config), pieces, config) for pieces, _ in parts)
    assert by_time.step_seconds(plan, pooled, config) <= alone * (1 + 1e-12)


def test_lockstep_tick_balances_attention_alone_around_its_synchronising_exchanges():
    """Every layer's exchanges synchronise a tick's ranks before and after its attention, so a bubble,
    which runs no linear layers, cannot spend that idle time on attention: the bench's first tick (CPU
    time model, fp32: stage 0 one 6144-token document, stage 1 a bubble holding the runtime's dummy
    token) gets its attention split evenly, and its layer (``tick_layer_seconds``: the slowest linear
    layers plus the slowest attention) is predicted faster than the plan balanced together with each
    rank's linear layers (which gave the bubble about twice the busy rank's pairs) and than colocated.
    The layer time is checked against the formula written out here with communication off."""
    from distca_hf.planning import colocated_plan
    from distca_hf.planning.cost import default_time_model
    from distca_hf.planning.pipeline_cost import plan_lockstep_tick, pool_pieces, tick_layer_seconds

    tokens, token_bytes = 6144, TokenBytes.for_model(128, 4, 2, 4, None)
    config = PlannerConfig(tolerance="auto", block=1, token_bytes=token_bytes, backward="resend",
                           time_model=default_time_model("cpu", token_bytes, 4))
    pooled = pool_pieces([(pack_pieces(np.array([tokens]), 1, tokens), 0), (pack_pieces(np.array([1]), 1, 1), 1)], 2)
    plan = plan_lockstep_tick(pooled, config, rank_groups=[[0], [1]])
    queries = np.bincount(pooled.doc, weights=pooled.end - pooled.start)
    assert np.bincount(plan.doc, weights=plan.q_end - plan.q_start, minlength=queries.size).tolist() == \
        queries.tolist()
    served = plan.server_pairs()
    assert abs(served[0] - served[1]) <= 0.05 * served.max(), served
    model = config.time_model
    linear = pooled.tokens() * model.linear_s_per_token / model.attn_s_per_pair
    with_linear = plan_tasks(pooled, dataclasses.replace(config, base_pairs=tuple(linear - linear.min())))
    chosen = tick_layer_seconds(plan, pooled, config)
    assert chosen < tick_layer_seconds(with_linear, pooled, config)
    assert chosen < tick_layer_seconds(colocated_plan(pooled), pooled, config)
    quiet = dataclasses.replace(config, time_model=NO_COMM)
    loads = plan_loads(plan, pooled, token_bytes)
    attention = NO_COMM.rank_seconds(np.zeros(2), loads.pairs, loads.tasks, loads.keys)
    assert tick_layer_seconds(plan, pooled, quiet) == pytest.approx(
        NO_COMM.linear_s_per_token * tokens + attention.max(), rel=1e-9)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 1000), stages=st.integers(1, 4), micro_batches=st.integers(1, 6),
       data_parallel=st.integers(1, 3))
def test_pipeline_methods_are_consistent(seed, stages, micro_batches, data_parallel):
    """Properties any step has: no method is faster than its work spread perfectly over all ranks, and
    bubbles and imbalances are in range."""
    tokens = 128
    config = PlannerConfig(tolerance="auto", block=4, token_bytes=TOKEN_BYTES, time_model=NO_COMM)
    docs = _micro_batches(seed, micro_batches, data_parallel, tokens)
    steps = pipeline_step(docs, stages=stages, data_parallel=data_parallel, tokens=tokens, layers=stages,
                          config=config, activation_bytes_per_token=0)
    # one layer per stage: every document's layer once, spread perfectly over the P x D ranks
    total_work = sum(NO_COMM.rank_seconds(n, causal_pairs(0, n)) for batch in docs for n in batch.tolist())
    floor = stages * total_work / (stages * data_parallel)
    for method in PIPELINE_METHODS:
        assert steps[method].step_s >= floor * (1 - 1e-9)
        assert 0.0 <= steps[method].bubble_fraction < 1.0 and steps[method].attn_imbalance >= 1.0


# --- the CLI -------------------------------------------------------------------------------------------

@pytest.fixture
def lengths_file(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps(np.maximum(1, rng.lognormal(5.0, 1.2, size=300).astype(int)).tolist()))
    return path


def test_simulate_pipeline_json_keys(lengths_file):
    base = ("simulate", "--lengths", lengths_file, "--ranks", "4", "--tokens-per-rank", "256", "--batches", "1",
            "--json")
    plain = _cli(*base)
    assert plain.returncode == 0, plain.stderr
    assert "pipeline" not in json.loads(plain.stdout)  # P = 1 by default: nothing changes
    result = _cli(*base, "--pipeline-parallel", "2", "--micro-batches", "3", "--layers", "4")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    before = json.loads(plain.stdout)
    assert set(out) - {"pipeline"} == set(before) and out["colocated"] == before["colocated"]  # the rest unchanged
    pipeline = out["pipeline"]
    assert {"stages", "micro_batches", "step_time_s", "speedup_vs_colocated_1f1b"} <= set(pipeline)
    assert (pipeline["stages"], pipeline["micro_batches"], pipeline["data_parallel"]) == (2, 3, 2)
    assert set(pipeline["step_time_s"]) == {"colocated_1f1b", "balanced_micro_batches", "cad_per_stage",
                                            "cad_across_stages"}
    steps = pipeline["step_time_s"]
    assert pipeline["speedup_vs_colocated_1f1b"] == pytest.approx(steps["colocated_1f1b"] / steps["cad_across_stages"])
    assert pipeline["held_micro_batches"] == {"1f1b": [2, 1], "cad_across_stages": [3, 1]}
    assert "note" not in pipeline
    table = _cli(*base[:-1], "--pipeline-parallel", "2", "--micro-batches", "1", "--layers", "2")
    assert table.returncode == 0, table.stderr
    assert "CAD across stages (lockstep 1F1B, bubbles serve)" in table.stdout and "GPipe-like" in table.stdout


@pytest.mark.parametrize("flags, message", [
    (("--ranks", "6", "--pipeline-parallel", "4"), "--ranks (6) must be divisible by --pipeline-parallel (4)"),
    (("--ranks", "4", "--pipeline-parallel", "0"), "--pipeline-parallel must be >= 1, got 0"),
    (("--ranks", "4", "--pipeline-parallel", "2", "--micro-batches", "0"), "--micro-batches must be >= 1, got 0"),
    (("--ranks", "4", "--pipeline-parallel", "4", "--layers", "30"),
     "--layers (30) must be a positive multiple of --pipeline-parallel (4)"),
    # drew micro-batches for ever (memory growing, no output)
    (("--ranks", "4", "--pipeline-parallel", "2", "--micro-batches", str(10**21)),
     f"--batches x --micro-batches = {8 * 10**21}: a simulation draws and plans at most 10000 batches"),
    # ignored before: the pipeline model planned with the descent anyway
    (("--ranks", "4", "--pipeline-parallel", "2", "--auto-planner", "tolerances"),
     "--auto-planner tolerances is read by the layer model only"),
    # the planner's setting names, not the flags, before
    (("--ranks", "4", "--block", "0"), "--block must be an integer from 1"),
    (("--ranks", "4", "--kv-relays", "0"), "--kv-relays must be 'auto'"),
    (("--ranks", "4", "--kv-heads", "3"), "--heads (32) must be a positive multiple of --kv-heads (3)"),
])
def test_simulate_pipeline_refusals(lengths_file, flags, message):
    result = _cli("simulate", "--lengths", lengths_file, "--tokens-per-rank", "64", *flags)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_simulate_says_documents_longer_than_a_batch_are_cut(tmp_path):
    path = tmp_path / "long.json"
    path.write_text("[100000, 200, 20]")
    for flags, says in (((), "longer than a batch (512 tokens = --ranks x --tokens-per-rank)"),
                        (("--pipeline-parallel", "2"), "longer than a micro-batch (256 tokens = --ranks / "
                                                       "--pipeline-parallel x --tokens-per-rank)")):
        result = _cli("simulate", "--lengths", path, "--ranks", "4", "--tokens-per-rank", "128", "--batches", "1",
                      "--json", *flags)
        assert result.returncode == 0 and f"1 of the 3 lengths are {says}" in result.stderr, result.stderr
    fits = _cli("simulate", "--lengths", path, "--ranks", "8", "--tokens-per-rank", "16384", "--batches", "1")
    assert fits.returncode == 0 and "longer than" not in fits.stderr


def test_pipeline_api_takes_numpy_integers_and_refuses_what_is_no_step():
    """numpy integers are integers here as everywhere (they were refused deep inside, naming an
    internal argument); lengths that are not integer tokens, a flat list, a stage out of range and a
    bad window are refused naming the argument (they were truncated, reread, wrapped or ignored)."""
    from distca_hf.planning.pipeline import in_flight_micro_batches
    from distca_hf.planning.pipeline_bound import (attention_floor_seconds, bubble_gain, holder_link_floor_seconds,
                                                   pipeline_floors)
    from distca_hf.planning.pipeline_cost import check_step, held_micro_batches

    step = dict(data_parallel=2, tokens=2048, layers=4, activation_bytes_per_token=64)
    config = PlannerConfig(tolerance=0.1)
    with pytest.raises(ValueError, match=r"num_stages x \(num_micro_batches \+ num_stages\) = 2000000000000 is more"):
        lockstep_1f1b_ticks(10**6, 10**6)  # (built ticks until killed)
    assert simulate_pipeline([1000, 2000, 500], 4, 2048, batches=1, stages=np.int64(2), micro_batches=np.int64(2))
    docs = [[1000, 500], [2000]]
    assert pipeline_step(docs, stages=np.int64(2), config=config, **step).keys() == \
        pipeline_step(docs, stages=2, config=config, **step).keys()
    assert held_micro_batches(np.int64(2), 4) == held_micro_batches(2, 4)
    assert bubble_gain(stages=np.int64(4), micro_batches=8, attention_share=0.5) == \
        bubble_gain(stages=4, micro_batches=8, attention_share=0.5)
    assert simulate_1f1b(np.ones((2, 3)), np.ones((2, 3)), p2p_s=np.float32(0.5)).step_s == \
        simulate_1f1b(np.ones((2, 3)), np.ones((2, 3)), p2p_s=0.5).step_s
    for bad, where in (([[100.7, 200]], r"micro_batch_docs\[0\]\[0\] is 100.7"),
                       ([["100", 200]], r"micro_batch_docs\[0\]\[0\] is '100'"),
                       ([1000, 2000], r"micro_batch_docs\[0\] must be a list of document lengths"),
                       (None, "micro_batch_docs must be a list of micro-batches")):
        with pytest.raises(ValueError, match=where):
            check_step(bad, stages=2, **step)
    with pytest.raises(ValueError, match="activation_bytes_per_token must be an integer >= 0"):
        check_step(docs, stages=2, **{**step, "activation_bytes_per_token": 1.5})
    for stage in (-1, 2, True):
        with pytest.raises(ValueError, match=r"stage must lie in \[0, 2\)"):
            in_flight_micro_batches(stage, 2, 3)
    with pytest.raises(ValueError, match="stages must be an integer >= 1, got 0"):
        held_micro_batches(0, 4)
    pieces = pack_pieces(np.array([5, 1, 6, 3]), 3, 6)  # rows [5, 1], [6], [3]
    assert rank_subset(pieces, np.array([2, 0]))[0].num_ranks == 2
    for ranks in ([-1], [3], [0, 0], [0.5], [[0, 1]]):  # -1 wrapped to the last rank before
        with pytest.raises(ValueError, match=r"ranks must be distinct rank numbers in \[0, 3\)"):
            rank_subset(pieces, ranks)
    with pytest.raises(ValueError, match="window must be None or an integer >= 1"):
        attention_floor_seconds([100], config.time_model, window=0)
    with pytest.raises(ValueError, match="window must be None or an integer >= 1"):
        pipeline_floors(docs, stages=2, time_model=config.time_model, window=-5, **step)
    with pytest.raises(ValueError, match=r"docs\[0\] is -1000"):
        attention_floor_seconds([-1000, 100], config.time_model)
    # a deep KeyError / AttributeError / numpy broadcast error before
    with pytest.raises(ValueError, match=r"backward must be one of \['resend', 'saved'\], got 'bogus'"):
        forward_backward_models(config.time_model, "bogus")
    with pytest.raises(TypeError, match="config must be a PlannerConfig, got NoneType"):
        pipeline_step(docs, stages=2, config=None, **step)
    for call in (lambda: attention_floor_seconds([100], None),
                 lambda: pipeline_floors(docs, stages=2, time_model=None, **step)):
        with pytest.raises(TypeError, match="time_model must be a TimeModel, got NoneType"):
            call()
    with pytest.raises(ValueError, match="one entry per document"):
        holder_link_floor_seconds([1.0, 2.0, 3.0], [1, 2], attn_s_per_pair=1.0, byte_s=1.0,
                                  token_bytes=config.token_bytes)


@pytest.mark.skipif(not (SHARED_DATA / "doc_lengths_prolong.json").exists(), reason="needs ../shared/data")
@pytest.mark.parametrize("sample", ["prolong", "wlbllm"])
def test_pipeline_targets_at_the_issue_configuration(sample):
    """Issue 20's simulator targets at its configuration, 64 ranks x 64k tokens, P = 4, M = 8 (3 steps,
    the built-in H100 model, Llama-3-8B): CAD across stages >= 1.3x stock 1F1B with colocated packing
    and faster than balanced micro-batches, nothing hidden. Against CAD inside each stage (target
    1.15x) it gains little with the communication counted (0.99x / 1.07x over 8 steps, docs/pipeline.md:
    pooling a long document over more servers spreads its K/V to more of them, its holders' links are
    the bottleneck, and the lockstep's re-planned backward resends q, k/v and out); with all of it
    hidden it gains >= 1.15x, the schedule's own gain."""
    from distca_hf.planning.cost import default_time_model

    lengths = json.loads((SHARED_DATA / f"doc_lengths_{sample}.json").read_text())
    token_bytes = TokenBytes.for_model(4096, 32, 8)
    config = PlannerConfig(tolerance="auto", block=128, token_bytes=token_bytes)
    model = default_time_model("cuda", token_bytes, 2)
    options = dict(stages=4, micro_batches=8, batches=3, seed=0, config=config, layers=32)
    counted = simulate_pipeline(lengths, 64, 65536, time_model=model, **options)
    assert counted["speedup_vs_colocated_1f1b"] >= 1.3
    assert counted["speedup_vs_balanced_micro_batches"] > 1.0
    hidden = simulate_pipeline(lengths, 64, 65536, time_model=model, hidden_comm_fraction=1.0, **options)
    assert hidden["speedup_vs_cad_per_stage"] >= 1.15
