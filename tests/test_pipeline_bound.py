"""The floors of a pipeline step (``planning.pipeline_bound``, issue 20): hand-computed on a step small
enough to write out, and never above what ``pipeline_step`` predicts for any plan it makes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distca_hf.planning import PlannerConfig, TimeModel, TokenBytes
from distca_hf.planning.pipeline_bound import attention_floor_seconds, pipeline_floors
from distca_hf.planning.pipeline_cost import pipeline_step
from distca_hf.tools.simulate import draw_batch

TOKEN_BYTES = TokenBytes(8, 4, 8)


def test_attention_floor_counts_pairs_one_key_per_token_and_one_task_per_document():
    model = TimeModel(linear_s_per_token=1.0, attn_s_per_pair=2.0, task_s=5.0, bytes_per_s=1.0, task_key_s=3.0)
    assert attention_floor_seconds([4, 6, 0], model) == pytest.approx(2.0 * (10 + 21) + 3.0 * 10 + 5.0 * 2)
    # window 3: the 6-token document's queries see 1, 2, 3, 3, 3, 3 keys
    assert attention_floor_seconds([6], model, window=3) == pytest.approx(2.0 * 15 + 3.0 * 6 + 5.0)


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


def test_floors_refuse_bad_input_naming_it():
    model = TimeModel(linear_s_per_token=1.0, attn_s_per_pair=1.0, task_s=0.0, bytes_per_s=1.0)
    args = dict(stages=2, data_parallel=1, tokens=10, layers=2, time_model=model, activation_bytes_per_token=0)
    with pytest.raises(ValueError, match=r"micro-batch 0 holds 11 tokens"):
        pipeline_floors([np.array([11])], **args)
    with pytest.raises(ValueError, match=r"layers \(3\) must be divisible by the pipeline stages \(2\)"):
        pipeline_floors([np.array([4])], **{**args, "layers": 3})
    with pytest.raises(ValueError, match="at least one micro-batch"):
        pipeline_floors([], **args)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 1000), stages=st.integers(1, 4), micro_batches=st.integers(1, 5),
       data_parallel=st.integers(1, 3), bytes_per_s=st.sampled_from([1e6, 1e18]), window=st.sampled_from([None, 50]))
def test_no_plan_beats_the_floors(seed, stages, micro_batches, data_parallel, bytes_per_s, window):
    """Whatever ``pipeline_step`` plans (by time, on a slow or a free network, with activations between
    stages), its CAD methods are never predicted faster than their floors."""
    model = TimeModel(linear_s_per_token=1e-6, attn_s_per_pair=1e-8, task_s=1e-6, bytes_per_s=bytes_per_s,
                      task_key_s=1e-9, collective_s=1e-5)
    config = PlannerConfig(tolerance="auto", block=4, token_bytes=TOKEN_BYTES, time_model=model, window=window)
    tokens, rng = 128, np.random.default_rng(seed)
    docs = [draw_batch(np.array([3, 30, 100, 400, 900]), data_parallel * tokens, rng) for _ in range(micro_batches)]
    args = dict(stages=stages, data_parallel=data_parallel, tokens=tokens, layers=2 * stages,
                activation_bytes_per_token=64)
    steps = pipeline_step(docs, config=config, **args)
    floors = pipeline_floors(docs, time_model=model, window=window, **args)
    for method in ("cad_per_stage", "cad_across_stages"):
        assert getattr(floors, method).step_s <= steps[method].step_s * (1 + 1e-9), method
    # with one stage both methods are the same plan of one micro-batch at a time, and so are the floors
    if stages == 1:
        assert floors.cad_across_stages.step_s == pytest.approx(floors.cad_per_stage.step_s, rel=1e-12)
