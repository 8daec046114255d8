"""The lockstep 1F1B tick table of pipeline_schedule="cad_1f1b" (pure): every micro-batch runs forward then
backward on every stage exactly once, in an order the data dependencies allow, with activations received from
the tick before."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distca_hf.planning import (BACKWARD, FORWARD, backward_slot, forward_slot, in_flight_micro_batches,
                                lockstep_1f1b_ticks)

shapes = st.tuples(st.integers(1, 6), st.integers(1, 12))


@settings(max_examples=60, deadline=None)
@given(shapes)
def test_every_stage_runs_each_micro_batch_forward_then_backward_once(shape):
    stages, micro_batches = shape
    ticks = lockstep_1f1b_ticks(stages, micro_batches)
    assert len(ticks) == 2 * (micro_batches + stages - 1)
    when = {}
    for t, tick in enumerate(ticks):
        for stage, mb in enumerate(tick.micro_batches):
            if mb is not None:
                key = (tick.kind, stage, mb)
                assert key not in when, f"{key} runs twice"
                when[key] = t
    for stage in range(stages):
        for mb in range(micro_batches):
            f, b = when[(FORWARD, stage, mb)], when[(BACKWARD, stage, mb)]
            assert f < b
            assert ticks[f].slot == forward_slot(stage, mb)
            assert ticks[b].slot == backward_slot(stage, mb, stages)
            if stage > 0:  # input activations come from the previous stage's forward, one forward slot earlier
                prev = when[(FORWARD, stage - 1, mb)]
                assert ticks[prev].slot == ticks[f].slot - 1
            if stage < stages - 1:  # the output gradient comes from the next stage's backward, one slot earlier
                nxt = when[(BACKWARD, stage + 1, mb)]
                assert ticks[nxt].slot == ticks[b].slot - 1
    # the last stage runs each micro-batch's backward in the tick right after its forward (steady state)
    for mb in range(micro_batches):
        assert when[(BACKWARD, stages - 1, mb)] == when[(FORWARD, stages - 1, mb)] + 1


@settings(max_examples=60, deadline=None)
@given(shapes)
def test_slots_alternate_kinds_in_steady_state_and_bubbles_are_the_rest(shape):
    stages, micro_batches = shape
    ticks = lockstep_1f1b_ticks(stages, micro_batches)
    kinds = [t.kind for t in ticks]
    assert kinds[: stages - 1] == [FORWARD] * (stages - 1)
    assert kinds[len(kinds) - (stages - 1):] == [BACKWARD] * (stages - 1)
    steady = kinds[stages - 1: len(kinds) - (stages - 1)]
    assert steady == [FORWARD, BACKWARD] * micro_batches
    bubbles = sum(mb is None for t in ticks for mb in t.micro_batches)
    assert bubbles == 2 * stages * (stages - 1)  # each stage idles P - 1 forward and P - 1 backward slots


@pytest.mark.parametrize("stages,micro_batches", [(1, 1), (2, 4), (4, 8), (4, 2), (3, 20)])
def test_activations_held_follow_the_formula(stages, micro_batches):
    for stage in range(stages):
        expected = min(2 * (stages - stage) - 1, micro_batches)
        assert in_flight_micro_batches(stage, stages, micro_batches) == expected


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None])
def test_bad_shapes_are_refused_with_the_argument_named(bad):
    with pytest.raises(ValueError, match="num_stages"):
        lockstep_1f1b_ticks(bad, 4)
    with pytest.raises(ValueError, match="num_micro_batches"):
        lockstep_1f1b_ticks(2, bad)
    if bad is not None and bad != 1.5:  # both a stage and a micro-batch of 0 exist
        return
    with pytest.raises(ValueError, match="micro_batch must be an integer >= 0"):
        forward_slot(0, bad)
    with pytest.raises(ValueError, match=r"stage must lie in \[0, 2\)"):
        backward_slot(bad, 0, 2)
