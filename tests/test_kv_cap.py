"""The ``kv_cap`` setting (issue 21's memory target): under ``tolerance="auto"`` no server receives
more K/V per layer than the cap, ``"cp"`` being per-document CP's worst rank of the batch
(``baselines.per_doc_cp_kv_received``, the column ``examples/bench_sim.py`` compares with)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distca_hf.config import SETTINGS, setting_problem
from distca_hf.planning import (PlannerConfig, colocated_plan, kv_received, kv_transfers, plan_tasks, step_seconds)
from distca_hf.planning.baselines import kv_cap_tokens, pack_pieces, per_doc_cp_kv_received
from distca_hf.planning.cost import LLAMA3_8B_BYTES
from distca_hf.planning.descent import descend
from distca_hf.planning.transfers import fit_memory_budget
from test_descent import _auto, _check_queries
from test_planner import _same_plan, batches_with_key_only_prefixes, packed_batches, time_models, windowed_configs


def _most_received(plan, pieces) -> int:
    return int(kv_received(kv_transfers(plan, pieces), pieces.num_ranks).max(initial=0))


@settings(max_examples=60, deadline=None)
@given(pieces=st.one_of(packed_batches(), batches_with_key_only_prefixes()), config=windowed_configs,
       model=time_models, exposed=st.sampled_from([0.5, 1.0]), budget=st.sampled_from([None, 0.1]),
       cap_kind=st.sampled_from(["cp", "bytes"]), data=st.data())
def test_auto_and_the_descent_keep_every_server_within_the_cap(pieces, config, model, exposed, budget, cap_kind, data):
    """Plans stay valid plans (every query once, from its rank, block-aligned), no server receives
    more K/V tokens than the cap (exactly: K/V ranges are whole tokens), the plan is deterministic and
    never predicted slower than colocated (which always fits 'cp'); without a cap, the same plan as
    without the setting."""
    kv = config.token_bytes.kv
    if cap_kind == "cp":
        kv_cap = "cp"
        cap = int(per_doc_cp_kv_received(pieces).max(initial=0)) or None  # None: nothing spans ranks, no cap
    else:
        least = max(_most_received(colocated_plan(pieces, window=config.window), pieces), 1)
        cap = data.draw(st.integers(least, 400))
        kv_cap = cap * kv + data.draw(st.integers(0, kv - 1)) if kv else float(cap)  # bytes, rounded down
        cap = cap if kv else None  # K/V of no bytes: no byte cap binds
    capped = _auto(config, model, exposed, memory_budget=budget, kv_cap=kv_cap)
    assert kv_cap_tokens(pieces, capped) == cap
    # (the descent alone counts K/V in bytes: with K/V of no bytes only plan_tasks' judge keeps the cap)
    for plan in (plan_tasks(pieces, capped), *([descend(pieces, capped)] if kv else [])):
        _check_queries(pieces, plan, capped)
        if cap is not None:
            assert _most_received(plan, pieces) <= cap
    plan = plan_tasks(pieces, capped)
    assert _same_plan(plan, plan_tasks(pieces, capped))
    colocated = fit_memory_budget(colocated_plan(pieces, window=config.window), pieces, capped)
    assert step_seconds(plan, pieces, capped) <= step_seconds(colocated, pieces, capped) * (1 + 1e-9)
    if cap is None:
        assert _same_plan(plan, plan_tasks(pieces, dataclasses.replace(capped, kv_cap=None)))


def test_the_cap_binds_where_auto_would_pass_it():
    """Rank 0 holds 8 documents of 8k tokens, the others 1k ones and a 16k document spans ranks 2-3
    (per-document CP's worst rank gathers 8k K/V): ``auto`` balances rank 0 by sending shards with
    their prefixes, several documents to one server (32k K/V); capped at 'cp', no server receives more
    than 8k, and the plan still moves work (slower than ``auto``, faster than colocated)."""
    tokens = 65536
    pieces = pack_pieces(np.array([8192] * 8 + [1024] * 120 + [16384] + [1024] * 56), 4, tokens)
    config = PlannerConfig("auto", block=128, memory_budget=None)
    cp_worst = int(per_doc_cp_kv_received(pieces).max())
    free, capped = plan_tasks(pieces, config), plan_tasks(pieces, dataclasses.replace(config, kv_cap="cp"))
    assert cp_worst == 8192
    assert _most_received(free, pieces) > cp_worst >= _most_received(capped, pieces)
    assert capped.moved_queries() > 0
    colocated = colocated_plan(pieces)
    assert step_seconds(free, pieces, config) <= step_seconds(capped, pieces, config) \
        < step_seconds(colocated, pieces, config)


@pytest.mark.parametrize("cap", ["cp", 1.0])
def test_a_rank_outside_the_server_pool_gives_its_work_away_under_a_cap(cap):
    """Found in review: rank 2 lies outside the pool and its document's servers and holders too, so
    its shards must go to a server new to the document; the cap refused every one and the descent
    raised. A move that must be made is exempt from the cap (as for the carvings: by_time drops it)."""
    pieces = pack_pieces(np.array([190, 20, 190, 200]), 3, 200)
    config = PlannerConfig(tolerance="auto", servers=(0, 1), kv_cap=cap, block=1)
    plan = plan_tasks(pieces, config)
    _check_queries(pieces, plan, config)
    assert set(plan.server.tolist()) <= {0, 1} and plan.server_pairs().sum() == pieces.local_pairs().sum()


def test_kv_cap_tokens_hand_checked():
    # ranks of 8 tokens: doc 0 [0, 5) on rank 0; doc 1 (12 tokens) [0, 3) on 0, [3, 11) on 1, [11, 12) on 2
    pieces = pack_pieces(np.array([5, 12, 4]), 3, 8)
    assert per_doc_cp_kv_received(pieces).tolist() == [9, 4, 11]  # CP of doc 1: the rest of it
    cap = lambda kv_cap, p=pieces: kv_cap_tokens(p, PlannerConfig("auto", kv_cap=kv_cap))
    assert (cap("cp"), cap(None)) == (11, None)
    kv = LLAMA3_8B_BYTES.kv
    # bytes, as whole tokens, but never below what colocated receives (rank 2 needs doc 1's [0, 11))
    assert (cap(3.5 * kv), cap(12.5 * kv)) == (11, 12)
    # under a window of 4 rank 1 needs [0, 3), rank 2 [8, 11)
    assert kv_cap_tokens(pieces, PlannerConfig("auto", kv_cap=3.5 * kv, window=4)) == 3
    alone = pack_pieces(np.array([5, 3, 7]), 2, 8)  # no document spans ranks
    assert (cap("cp", alone), cap(3.5 * kv, alone)) == (None, 3)


def test_kv_cap_refusals():
    pieces = pack_pieces(np.array([100, 20]), 2, 64)
    with pytest.raises(ValueError, match="kv_cap 'cp' needs tolerance 'auto'"):
        plan_tasks(pieces, PlannerConfig(0.02, kv_cap="cp"))
    from distca_hf.config import DistCAConfig

    with pytest.raises(ValueError, match="distca kv_cap 'cp' needs tolerance 'auto'"):  # at set-up, not the first step
        DistCAConfig(tolerance=0.02, kv_cap="cp")
    assert DistCAConfig(kv_cap="cp").kv_cap == "cp"
    for bad in (0, -1.0, "CP", "auto", True):
        assert setting_problem("kv_cap", bad) is not None
        with pytest.raises(ValueError, match="kv_cap must be 'cp'"):
            PlannerConfig("auto", kv_cap=bad)
    parse = SETTINGS["kv_cap"].metadata["parse"]
    assert (parse("none"), parse("CP"), parse("2e6")) == (None, "cp", 2e6)


def test_simulate_flag(tmp_path):
    """``distca-hf simulate --kv-cap``: refused beside a fixed tolerance; with 'auto', no server past CP's."""
    from helpers import cli_in_process

    lengths = tmp_path / "lengths.json"
    lengths.write_text("[9000, 3000, 500, 20000, 700]")
    common = ("simulate", "--lengths", lengths, "--ranks", 4, "--tokens-per-rank", 8192, "--batches", 1, "--json")
    refused = cli_in_process(*common, "--kv-cap", "cp", "--tolerance", "0.02")
    assert refused.returncode == 2 and "--kv-cap cp needs --tolerance auto" in refused.stderr
    out = json.loads(cli_in_process(*common, "--kv-cap", "cp").stdout)
    assert out["planner"]["kv_cap"] == "cp"
    received = out["distca"]["kv_received_tokens_per_layer"]["max"]
    assert received <= out["per_doc_cp"]["kv_received_tokens_per_layer"]["max"]
