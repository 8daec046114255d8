"""The floors of a pipeline step (``planning.pipeline_bound``, issue 20): hand-computed on a step small
enough to write out, and never above what ``pipeline_step`` predicts for any plan it makes."""

from __future__ import annotations


import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distca_hf.planning import PlannerConfig, TimeModel, TokenBytes
from distca_hf.planning.pipeline_bound import (attention_floor_seconds, bubble_gain, holder_link_floor_seconds,
                                               pipeline_floors)
from distca_hf.planning.pipeline_cost import pipeline_step
from distca_hf.tools.simulate import draw_batch

TOKEN_BYTES = TokenBytes(8, 4, 8)


def test_attention_floor_counts_pairs_one_key_per_token_and_one_task_per_document():
    model = TimeModel(linear_s_per_token=1.0, attn_s_per_pair=2.0, task_s=5.0, bytes_per_s=1.0, task_key_s=3.0)
    assert attention_floor_seconds([4, 6, 0], model) == pytest.approx(2.0 * (10 + 21) + 3.0 * 10 + 5.0 * 2)
    # window 3: the 6-token document's queries see 1, 2, 3, 3, 3, 3 keys
    assert attention_floor_seconds([6], model, window=3) == pytest.approx(2.0 * 15 + 3.0 * 6 + 5.0)


def test_holder_link_floor_hand_computed():
    """q + o = 16 bytes, kv = 4, 1 s a pair, 1/8 s a byte: offloading costs the holders at least
    2 / 8 sqrt(16 * 4 * 1 / tau) = 2 / sqrt(tau) s a pair. 100 pairs on 2 holders:
    min(100 / 2, (2 * 100 / 2) ^ (2/3)) = 100 ^ (2/3); 4 pairs on 1 holder: min(4, 8 ^ (2/3) = 4) = 4;
    with free bytes nothing is left but 0."""
    tb = TokenBytes(q=10, kv=4, o=6)
    got = holder_link_floor_seconds([100, 4, 3], [2, 1, 1], attn_s_per_pair=1.0, byte_s=1 / 8, token_bytes=tb)
    assert got == pytest.approx([100 ** (2 / 3), 4.0, 3.0])
    # the last: min(3, 6 ^ (2/3) = 3.30) = 3, all on its holder
    # tau = 100 ^ (2/3): offloading all 100 pairs costs 100 * 2 / sqrt(tau) = 2 tau, two holders' tau each
    tau = got[0]
    assert 100 * 2 / np.sqrt(tau) == pytest.approx(2 * tau)
    assert holder_link_floor_seconds([100], [2], attn_s_per_pair=1.0, byte_s=0.0, token_bytes=tb).tolist() == [0.0]
    # K/V may be relayed: only queries out and outputs back surely cross the holders' links, a query
    # carrying at most `reach` pairs: min(100 / 2, 16 / 8 * 100 / (10 * 2)) = 10; min(4, 2 * 4 / 4) = 2
    relayed = holder_link_floor_seconds([100, 4], [2, 1], attn_s_per_pair=1.0, byte_s=1 / 8, token_bytes=tb,
                                        relayed_reach=[10, 4])
    assert relayed == pytest.approx([10.0, 2.0])
    with pytest.raises(ValueError, match="holders must be >= 1"):
        holder_link_floor_seconds([1], [0], attn_s_per_pair=1.0, byte_s=1.0, token_bytes=tb)
    for name, bad in (("attn_s_per_pair", -1.0), ("byte_s", float("nan"))):
        with pytest.raises(ValueError, match=name):
            holder_link_floor_seconds([1], [1], **{"attn_s_per_pair": 1.0, "byte_s": 1.0, name: bad}, token_bytes=tb)


def test_floors_hand_computed():
    """P = 2 stages, D = 1, M = 2 micro-batches of 10 tokens: [10] (55 pairs) and [4, 6] (31 pairs);
    1 layer per stage; forward 1 s per token and per pair, backward 2 (the model's 3 split 1 : 2); no
    key or task cost, activations free.
    Lockstep ticks F0 (0, -), F1 (1, 0), B0 (-, 0), F2 (-, 1), B1 (0, 1), B2 (1, -): a tick is the
    busy rows' linear layers (10) plus its micro-batches' pairs over the 2 ranks:
    37.5 + 53 + 75 + 25.5 + 106 + 51 = 348. 1F1B: forwards 65 and 41, backwards 130 and 82;
    stage 0 F0 [0, 65], F1 [65, 106]; stage 1 F0 [65, 130], B0 [130, 260], F1 [260, 301], B1 [301, 383];
    stage 0 B0 [260, 390], B1 [390, 472]."""
    model = TimeModel(linear_s_per_token=3.0, attn_s_per_pair=3.0, task_s=0.0, bytes_per_s=1.0, task_key_s=0.0)
    floors = pipeline_floors([np.array([10]), np.array([4, 6])], stages=2, data_parallel=1, tokens=10, layers=2,
                             time_model=model, activation_bytes_per_token=0)
    assert floors.tick_s == pytest.approx((37.5, 53.0, 75.0, 25.5, 106.0, 51.0))
    assert floors.cad_across_stages.step_s == pytest.approx(348.0)
    assert floors.cad_per_stage.step_s == pytest.approx(472.0)
    assert floors.attention_share == pytest.approx(86 / (86 + 20))


@pytest.mark.parametrize("stages, micro_batches, data_parallel", [(2, 2, 1), (4, 8, 2), (3, 5, 3)])
def test_equal_micro_batches_gain_only_the_bubbles(stages, micro_batches, data_parallel):
    """Every micro-batch the same documents (no key or task cost, activations free): the floors' ratio
    is ``bubble_gain`` of their attention share, ``1 / (1 - b s)``, written out here for P = 2, M = 2."""
    model = TimeModel(linear_s_per_token=3.0, attn_s_per_pair=3.0, task_s=0.0, bytes_per_s=1.0, task_key_s=0.0)
    docs = [np.array([10, 7, 3] * data_parallel)] * micro_batches
    floors = pipeline_floors(docs, stages=stages, data_parallel=data_parallel, tokens=20, layers=stages,
                             time_model=model, activation_bytes_per_token=0)
    gain = bubble_gain(stages=stages, micro_batches=micro_batches, attention_share=floors.attention_share)
    assert floors.cad_per_stage.step_s / floors.cad_across_stages.step_s == pytest.approx(gain, rel=1e-12)
    assert floors.attention_share == pytest.approx((55 + 28 + 6) / (55 + 28 + 6 + 20))
    if (stages, micro_batches) == (2, 2):  # b = 1/3: 3 (L + A) / (3 L + 2 A) with L = 20, A = 89
        assert gain == pytest.approx(3 * 109 / (3 * 20 + 2 * 89))
    for share in (1.5, None, "0.5", float("nan")):  # None / '0.5': a TypeError deep in the formula before
        with pytest.raises(ValueError, match="attention_share must be between 0 and 1"):
            bubble_gain(stages=stages, micro_batches=micro_batches, attention_share=share)


def test_floors_refuse_bad_input_naming_it():
    model = TimeModel(linear_s_per_token=1.0, attn_s_per_pair=1.0, task_s=0.0, bytes_per_s=1.0)
    args = dict(stages=2, data_parallel=1, tokens=10, layers=2, time_model=model, activation_bytes_per_token=0)
    with pytest.raises(ValueError, match=r"micro-batch 0 holds 11 tokens"):
        pipeline_floors([np.array([11])], **args)
    with pytest.raises(ValueError, match=r"layers \(3\) must be divisible by the pipeline stages \(2\)"):
        pipeline_floors([np.array([4])], **{**args, "layers": 3})
    with pytest.raises(ValueError, match="at least one micro-batch"):
        pipeline_floors([], **args)
    with pytest.raises(ValueError, match=r"micro_batch_docs\[1\]\[1\] is -2; every document length must be an "
                                         r"integer >= 0 tokens"):
        pipeline_floors([np.array([4]), np.array([8, -2])], **args)
    with pytest.raises(ValueError, match=r"micro_batch_docs\[0\] holds no tokens"):
        pipeline_floors([np.array([0, 0]), np.array([4])], **args)
    # an empty document holds nothing: the same floors as without it
    assert pipeline_floors([np.array([4, 0, 3])], **args) == pipeline_floors([np.array([4, 3])], **args)
    with pytest.raises(ValueError, match="exposed_comm > 0 needs token_bytes"):
        pipeline_floors([np.array([4])], exposed_comm=0.5, **args)
    for exposed in (2.0, None):
        with pytest.raises(ValueError, match="exposed_comm must be between 0 and 1"):
            pipeline_floors([np.array([4])], exposed_comm=exposed, token_bytes=TOKEN_BYTES, **args)
    for name, value in (("attn_s_per_pair", None), ("attn_s_per_pair", float("inf")), ("byte_s", -1.0)):
        with pytest.raises(ValueError, match=f"{name} must be a finite number >= 0 \\(seconds\\)"):
            holder_link_floor_seconds([1.0], [1], **{"attn_s_per_pair": 1.0, "byte_s": 1.0, name: value},
                                      token_bytes=TOKEN_BYTES)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 1000), stages=st.integers(1, 4), micro_batches=st.integers(1, 5),
       data_parallel=st.integers(1, 3), bytes_per_s=st.sampled_from([1e6, 1e18]), window=st.sampled_from([None, 50]),
       kv_relays=st.sampled_from(["off", "auto", 1]))
def test_no_plan_beats_the_floors(seed, stages, micro_batches, data_parallel, bytes_per_s, window, kv_relays):
    """Whatever ``pipeline_step`` plans (by time, on a slow or a free network, with activations between
    stages, with K/V relayed or not), its CAD methods are never predicted faster than their floors."""
    model = TimeModel(linear_s_per_token=1e-6, attn_s_per_pair=1e-8, task_s=1e-6, bytes_per_s=bytes_per_s,
                      task_key_s=1e-9, collective_s=1e-5)
    config = PlannerConfig(tolerance="auto", block=4, token_bytes=TOKEN_BYTES, time_model=model, window=window,
                           kv_relays=kv_relays)
    tokens, rng = 128, np.random.default_rng(seed)
    docs = [draw_batch(np.array([3, 30, 100, 400, 900]), data_parallel * tokens, rng) for _ in range(micro_batches)]
    args = dict(stages=stages, data_parallel=data_parallel, tokens=tokens, layers=2 * stages,
                activation_bytes_per_token=64)
    steps = pipeline_step(docs, config=config, **args)
    floors = pipeline_floors(docs, time_model=model, window=window, exposed_comm=config.exposed_comm,
                             token_bytes=TOKEN_BYTES, relays=kv_relays != "off", **args)
    for method in ("cad_per_stage", "cad_across_stages"):
        assert getattr(floors, method).step_s <= steps[method].step_s * (1 + 1e-9), method
    # with one stage both methods are the same plan of one micro-batch at a time, and so are the floors
    if stages == 1:
        assert floors.cad_across_stages.step_s == pytest.approx(floors.cad_per_stage.step_s, rel=1e-12)


def test_holders_links_bind_a_long_document_and_no_plan_beats_them():
    """The built-in H100 model at Llama-3-8B's shape, 2 stages x 2 copies of 8192-token rows: micro-batch 0
    is one 16384-token document (2 holders), the others short documents. With the communication counted,
    the lockstep's floor rises above the floor of free communication (the holders' links bind in the ticks
    that hold the long document) and stays below what the planner achieves."""
    from distca_hf.planning.cost import default_time_model

    token_bytes = TokenBytes.for_model(4096, 32, 8)
    model = default_time_model("cuda", token_bytes, 2)
    docs = [np.array([16384]), np.full(32, 512), np.full(16, 1024)]
    config = PlannerConfig(tolerance="auto", block=128, token_bytes=token_bytes, time_model=model, key_split=True)
    args = dict(stages=2, data_parallel=2, tokens=8192, layers=2, activation_bytes_per_token=8192)
    steps = pipeline_step(docs, config=config, **args)
    free = pipeline_floors(docs, time_model=model, **args)
    counted = pipeline_floors(docs, time_model=model, exposed_comm=1.0, token_bytes=token_bytes, **args)
    assert counted.cad_across_stages.step_s > 1.05 * free.cad_across_stages.step_s
    assert counted.cad_across_stages.step_s <= steps["cad_across_stages"].step_s
    assert counted.cad_per_stage.step_s <= steps["cad_per_stage"].step_s


def test_simulate_reports_the_floors_and_the_bound(tmp_path):
    """``distca-hf simulate --pipeline-parallel --json`` adds the floors of both CAD methods (none above
    its step time) and the bound they put on CAD across stages over CAD inside each stage; the table
    prints it."""
    import json

    from helpers import cli_in_process

    path = tmp_path / "lengths.json"
    path.write_text(json.dumps([40, 300, 900, 2000, 64, 700]))
    base = ("simulate", "--lengths", path, "--ranks", "4", "--tokens-per-rank", "512", "--batches", "1",
            "--pipeline-parallel", "2", "--micro-batches", "3", "--layers", "4", "--bytes-per-s", "1e9")
    result = cli_in_process(*base, "--json")
    assert result.returncode == 0, result.stderr
    pipeline = json.loads(result.stdout)["pipeline"]
    floors, steps = pipeline["floor_step_time_s"], pipeline["step_time_s"]
    assert set(floors) == {"cad_per_stage", "cad_across_stages"}
    for method, floor in floors.items():
        assert 0 < floor <= steps[method]
    assert pipeline["speedup_bound_vs_cad_per_stage"] == pytest.approx(
        steps["cad_per_stage"] / floors["cad_across_stages"])
    assert pipeline["speedup_bound_vs_cad_per_stage"] >= pipeline["speedup_vs_cad_per_stage"]
    assert 0 < pipeline["attention_share"] < 1
    table = cli_in_process(*base)
    assert table.returncode == 0 and "bound on it (attention spread evenly" in table.stdout, table.stderr
