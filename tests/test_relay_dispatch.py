"""K/V relays in the plan and in the dispatch (``planning.relay_trees``, ``Wave.relays``): a plan's
relay trees deliver every K/V token a server needs exactly once, in every wave of it, forwarding only
what a rank holds or received in an earlier round; ``kv_relays="auto"`` never predicts a slower step
than direct sends; the runtime's relayed dispatch is exact (fp32 against fp64 per document: output
and q/k/v gradients) in every overlap and backward mode, with key-split tiles, sliding windows and
documents spanning ranks, and a model trained through it matches each document run alone."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_harness import run_ranks
from distca_hf.planning import (DocumentPieces, PlannerConfig, TimeModel, kv_kept, kv_received, kv_transfers,
                                plan_tasks, rank_seconds, wave_plans)
from distca_hf.planning.relay import apply_relays
from distca_hf.planning.relay_trees import RelaySends, RelayTrees, plan_kv_sends
from distca_hf.runtime.tables import kv_store_tables
from test_planner import packed_batches
from workers import check_forward_bytes, exact_runs, exactness_worker


def _received(sends) -> Counter:
    """``{(receiver, doc, token): times received}``."""
    return Counter((r, d, t) for r, d, s, e in zip(sends.server.tolist(), sends.doc.tolist(), sends.start.tolist(),
                                                    sends.end.tolist()) for t in range(s, e))


def _check_relayed(sends, direct, pieces):
    """``sends`` deliver exactly ``direct``'s tokens, each once; a rank sends in round 1 only K/V it
    holds, later only what it received in an earlier round."""
    assert _received(sends) == _received(direct) and max(_received(sends).values(), default=1) == 1
    held = {(r, d, t) for r, d, s, e in zip(pieces.rank.tolist(), pieces.doc.tolist(), pieces.kv_start.tolist(),
                                            pieces.end.tolist()) for t in range(s, e)}
    arrived = {}
    rounds = sends.round.tolist() if isinstance(sends, RelaySends) else [1] * sends.source.size
    for r, d, s, e, k in zip(sends.server.tolist(), sends.doc.tolist(), sends.start.tolist(), sends.end.tolist(),
                             rounds):
        arrived.update({(r, d, t): k for t in range(s, e)})
    for snd, d, s, e, k in zip(sends.source.tolist(), sends.doc.tolist(), sends.start.tolist(), sends.end.tolist(),
                               rounds):
        for t in range(s, e):
            assert ((snd, d, t) in held) if k == 1 else arrived.get((snd, d, t), k) < k


@settings(max_examples=60, deadline=None)
@given(pieces=packed_batches(), tolerance=st.sampled_from([0.0, 0.05]), window=st.sampled_from([None, 5]),
       fanout=st.sampled_from([1, 2]))
def test_forced_trees_deliver_what_direct_sends_do_in_every_wave(pieces, tolerance, window, fanout):
    plan = plan_tasks(pieces, PlannerConfig(tolerance=tolerance, window=window, kv_relays=fanout))
    direct = kv_transfers(plan, pieces)
    servers_per_group = Counter(zip(direct.source.tolist(), direct.doc.tolist(), direct.server.tolist()))
    shared = Counter((h, d) for h, d, _ in servers_per_group)
    assert (plan.relays is not None) == any(n > 1 for n in shared.values())
    relayed = plan_kv_sends(plan, pieces)
    _check_relayed(relayed, direct, pieces)
    # a token of one holder that more servers need than the fanout goes along a tree deeper than one
    needing = Counter((h, d, t) for h, d, s, e in zip(direct.source.tolist(), direct.doc.tolist(),
                                                      direct.start.tolist(), direct.end.tolist()) for t in range(s, e))
    assert (plan.relays is not None and relayed.rounds >= 2) == (max(needing.values(), default=0) > fanout)
    if plan.relays is not None:  # a holder sends at most what it sent directly
        sent = lambda sends, first: Counter(
            h for h, s, e, k in zip(sends.source.tolist(), sends.start.tolist(), sends.end.tolist(),
                                    sends.round.tolist() if first else [1] * sends.source.size)
            if k == 1 for _ in range(s, e))
        holders, direct_sent = sent(relayed, True), sent(direct, False)
        assert all(holders[h] <= direct_sent[h] for h in holders)
    n = pieces.num_ranks
    waves = [(kv_transfers(sub, pieces), plan_kv_sends(sub, pieces)) for _, sub in wave_plans(plan)]
    for wave_direct, wave_relayed in waves:
        _check_relayed(wave_relayed, wave_direct, pieces)
    # a token kept once however many waves brought it, whoever sent it
    assert (kv_kept([w for _, w in waves], n) == kv_kept([d for d, _ in waves], n)).all()
    for rank in range(n):
        direct_tables = kv_store_tables([d for d, _ in waves], rank, 3)
        relayed_tables = kv_store_tables([w for _, w in waves], rank, 3)
        kept = lambda tables: sum(0 if keep is None and store is None else (store.size - 3 if keep is None
                                                                             else keep.size)
                                  for keep, store in tables)
        assert kept(direct_tables) == kept(relayed_tables)


@settings(max_examples=40, deadline=None)
@given(pieces=packed_batches(), exposed=st.sampled_from([1.0, 0.5]))
def test_auto_trees_are_never_predicted_slower(pieces, exposed):
    model = TimeModel(linear_s_per_token=1e-6, attn_s_per_pair=1e-9, task_s=1e-6, bytes_per_s=1e6, collective_s=1e-5)
    config = PlannerConfig(tolerance=0.0, time_model=model, exposed_comm=exposed)
    plan = plan_tasks(pieces, config)
    relayed = apply_relays(plan, pieces, PlannerConfig(tolerance=0.0, time_model=model, exposed_comm=exposed,
                                                       kv_relays="auto"))
    direct_s = rank_seconds(plan, pieces, config).max()
    if relayed.relays is None:
        return
    assert rank_seconds(relayed, pieces, config).max() < direct_s
    # the time model counts the relayed bytes and one collective per round beyond the first
    sends = plan_kv_sends(relayed, pieces)
    assert rank_seconds(relayed, pieces, config) == pytest.approx(rank_seconds(plan, pieces, config, sends))


def test_one_holder_and_three_servers_make_a_chain():
    # rank 0 holds one long document, the others short ones: at tolerance 0 three servers take its
    # late shards, each needing a prefix of it; a chain (fanout 1) makes rank 0 send it once
    pieces = DocumentPieces.from_rank_lists([[(0, 0, 200)], [(1, 0, 10)], [(2, 0, 10)], [(3, 0, 10)]])
    plan = plan_tasks(pieces, PlannerConfig(tolerance=0.0, kv_relays=1))
    sends = plan_kv_sends(plan, pieces)
    first = (sends.doc == 0) & (sends.round == 1)
    assert sends.rounds == 3 and (sends.source[first] == 0).all() and np.unique(sends.server[first]).size == 1
    direct = kv_transfers(plan, pieces)
    assert (kv_received(sends, 4) == kv_received(direct, 4)).all()
    assert plan_tasks(pieces, PlannerConfig(tolerance=0.0, kv_relays="off")).relays is None


def test_bad_trees_and_fanouts_are_refused():
    with pytest.raises(ValueError, match="one entry per group"):
        RelayTrees.of([(0, 0, 1, [1, 2])]).__class__(np.array([0]), np.array([0, 1]), np.array([1]), np.array([1]),
                                                     np.array([1]))
    with pytest.raises(ValueError, match="fanout must be >= 1"):
        RelayTrees.of([(0, 0, 0, [1, 2])])
    with pytest.raises(ValueError, match="kv_relays must be 'auto'"):
        PlannerConfig(kv_relays=0)
    with pytest.raises(ValueError, match="kv_relays must be 'auto'"):
        PlannerConfig(kv_relays="sometimes")
    assert PlannerConfig(kv_relays=np.int64(2)).kv_relays == 2


# ---- on gloo ranks ----

RELAY_CASES = {
    # (document lengths, sliding window, plan kind, relay fanout): whole prefixes carved at tolerance 0 (a
    # window too), key-split tiles on random servers, the auto planner's own plan, along chains or fanout 2
    3: [([50, 7, 30, 13], None, "carved", 1), ([50, 7, 30, 13], 16, "carved", 1), ([50, 7, 30, 13], None, "hand", 1),
        ([100], None, "carved", 1)],
    4: [([90, 3, 5, 7, 11, 4], None, "carved", 1), ([90, 3, 5, 7, 11, 4], 20, "hand", 1), ([150, 10], None, "auto", 1),
        ([150, 10], None, "carved", 2)],
}


@pytest.mark.distributed
@pytest.mark.parametrize("world", [3, 4])
def test_relayed_dispatch_is_exact(tmp_path, world):
    """Relayed plans (``RELAY_CASES``) through ``test_key_split.key_split_worker``: overlap ``none`` /
    ``wave`` / ping-pong's nodes x ``saved`` / ``resend``, every rank's output and q/k/v gradients
    against each document alone (1e-5), the forward's bytes what the plan counts (relays move the
    same bytes as direct sends, from other ranks), and some layer relayed (2 rounds or more)."""
    from test_key_split import TOKEN_BYTES, key_split_worker

    results = run_ranks(key_split_worker, world, tmp_path, RELAY_CASES[world], deadline_s=240)
    for rank, result in enumerate(results):
        assert result["ok"], f"rank {rank}: {result.get('traceback', result['error'])}"
        runs = [r for r in result["value"] if "overlap" in r]
        assert len(runs) == 6 * len(RELAY_CASES[world])
        for run in runs:
            assert run["out_err"] < 1e-5 and run["grad_err"] < 1e-5, (rank, run)
        facts = [r for r in result["value"] if "splits" in r]
        assert all(f["relayed_groups"] > 0 for f in facts), facts
        for case in range(len(RELAY_CASES[world])):
            assert max(r["kv_rounds"] for r in runs if r["case"] == case) >= 2, (case, runs)
        for run in runs:
            if run["issued"] is not None:
                _check_relays_queue_behind_nothing(run["issued"])
            if run["issued"] is not None and run["backward"] == "saved":  # no relay round before its kernels:
                backward = [what for what in run["issued"] if what.startswith("distca backward")]
                sends = [what for what in backward if "sending dO" in what or "merged log-sum-exp" in what]
                assert backward[: len(sends)] == sends, backward  # every wave's dO goes out first
        assert any(run["waves"] > 2 and run["kv_rounds"] >= 2 for run in runs)  # several remote waves relaying
    per_token = TOKEN_BYTES.q + TOKEN_BYTES.o + TOKEN_BYTES.lse
    facts = {f["case"]: f for f in results[0]["value"] if "splits" in f}
    for per_rank in zip(*([r for r in result["value"] if "overlap" in r] for result in results)):
        run = per_rank[0]
        sent = sum(r["forward_bytes"] for r in per_rank)
        queries_bytes = run["queries_sent"] * (per_token if facts[run["case"]]["splits"] or run["backward"] == "resend"
                                               else TOKEN_BYTES.q + TOKEN_BYTES.o)
        assert sent == queries_bytes + run["kv_sent"] * TOKEN_BYTES.kv, run


def _check_relays_queue_behind_nothing(issued: list[str]):
    """In the order a dispatch issued its all-to-alls (collectives of one group complete in that
    order), each relay round (forward, and ``resend`` mode's backward) follows its own wave's (or
    nano-batch's) exchanges, never another's still in flight: it waits for its first round only,
    while the other waves' inputs and returns are held (``issue_queue.IssueQueue``). Relay rounds
    and their gradients' rounds are waited on as soon as issued, so they delay nothing after."""
    wave = lambda what: what[what.rindex("("):]  # "(wave name, forward n)"
    waited_at_once = ("relaying K/V", "returning relayed K/V gradients")
    in_flight = None  # the last exchange issued that may still be travelling
    for what in issued:
        if "relaying K/V" in what:
            assert wave(in_flight) == wave(what), (in_flight, what, issued)
        if not any(kind in what for kind in waited_at_once):
            in_flight = what


def _model_worker(rank, world):
    """``exactness_worker`` (a tiny Llama trained on skewed batches against each document alone, both
    backward modes, checkpointing on and off) in every overlap mode, K/V forced along chains, and the
    order the all-to-alls were issued in."""
    from test_key_split import _issued_exchanges

    report = {}
    for overlap in ("none", "wave", "pingpong"):
        with _issued_exchanges() as issued:
            report[overlap] = exactness_worker(rank, world, "llama", overlap)
        report[overlap + " issued"] = issued
    return report


@pytest.mark.distributed
def test_a_model_trains_exactly_through_relays(tmp_path):
    results = run_ranks(_model_worker, 4, tmp_path, env={"DISTCA_TOLERANCE": "0.02", "DISTCA_KV_RELAYS": "1"},
                        deadline_s=300)
    assert all(r["ok"] for r in results), [r.get("traceback", r.get("error")) for r in results]
    for overlap in ("none", "wave", "pingpong"):
        per_overlap = [{"ok": True, "value": r["value"][overlap]} for r in results]
        for rank, runs in exact_runs(per_overlap, 8):
            assert max(run["stats"]["kv_exchange_rounds"] for run in runs) >= 2, (overlap, rank)
        check_forward_bytes(per_overlap)
        for result in results:  # ping-pong: a nano-batch's relay rounds wait for none of the other's exchanges
            _check_relays_queue_behind_nothing(result["value"][overlap + " issued"])


def test_the_simulator_times_relays_and_never_predicts_them_slower():
    """``distca-hf simulate`` with relays (the default) against ``kv_relays="off"`` on batches where
    one long document spans ranks beside short ones: never a slower predicted layer, and the JSON says
    which batches relayed and how many K/V rounds they ran."""
    import dataclasses

    from distca_hf.tools.simulate import default_planner_config, simulate

    lengths = np.array([60000] * 3 + [500] * 400)
    auto = simulate(lengths, 16, 16384, 3, seed=0)
    off = simulate(lengths, 16, 16384, 3, seed=0, config=dataclasses.replace(default_planner_config(),
                                                                             kv_relays="off"))
    assert auto["planner"]["kv_relays"] == "auto" and off["planner"]["kv_relays"] == "off"
    assert auto["distca"]["step_time_s"] <= off["distca"]["step_time_s"] * (1 + 1e-12)
    assert off["distca"]["relayed_batch_fraction"] == 0 and off["distca"]["kv_exchange_rounds"]["max"] == 1
    rounds = auto["distca"]["kv_exchange_rounds"]
    assert auto["distca"]["relayed_batch_fraction"] > 0 and rounds["max"] > 1  # this batch's holders gain from trees
    assert auto["distca"]["step_time_s"] < off["distca"]["step_time_s"]
