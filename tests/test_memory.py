"""Memory as a plan output and a bound (``planning.backward_memory``, the ``memory_budget`` setting):
the formula against an independent count of what a rank keeps (sets of key positions) and against
the tensors the dispatch really saves on gloo ranks (``rank_saved_for_backward_bytes``), the bounds
of ``memory_imbalance``, the budget honoured by every way of planning, and the simulator's keys."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_harness import run_ranks
from test_planner import batches_with_key_only_prefixes, packed_batches

from distca_hf.planning import (DocumentPieces, PlannerConfig, TimeModel, TokenBytes, backward_memory, check_tiles,
                                colocated_plan, imbalance, key_start, kv_received, kv_transfers, plan_tasks, step_seconds,
                                with_key_ranges)
from distca_hf.planning.descent import descend, descend_within_memory
from distca_hf.planning.tiles import apply_memory_tiles
from distca_hf.runtime.context import BatchPlan, plan_stats_of
from distca_hf.tools.simulate import METHODS, simulate

TB = TokenBytes(q=8, kv=4, o=8, lse=2)


def _reference_held(plan, pieces, tb: TokenBytes, backward: str) -> np.ndarray:
    """Bytes each rank keeps for one layer's backward, counted from scratch: its own query rows' q,
    out and log-sum-exp in ``resend`` mode, the served ones' in ``saved`` mode, and a K/V row for every
    key position it holds, plus (``saved``) every key position of a document, from the first its tasks
    there see to the last, that it does not hold."""
    n = pieces.num_ranks
    own_q, held_keys = np.zeros(n, dtype=np.int64), [set() for _ in range(n)]
    for r, d, s, e, k in zip(pieces.rank, pieces.doc, pieces.start, pieces.end, pieces.kv_start):
        own_q[r] += e - s
        held_keys[r] |= {(int(d), p) for p in range(int(k), int(e))}
    per_query = tb.q + tb.o + tb.lse
    kv_rows = np.array([len(keys) for keys in held_keys], dtype=np.int64)
    if backward == "resend":
        return own_q * per_query + kv_rows * tb.kv
    served, hull = np.zeros(n, dtype=np.int64), {}
    for server, d, a, b in zip(plan.server.tolist(), plan.doc.tolist(), plan.q_start.tolist(), plan.q_end.tolist()):
        served[server] += b - a
        lo, hi = hull.get((server, d), (key_start(a, plan.window), b))
        hull[(server, d)] = (min(lo, key_start(a, plan.window)), max(hi, b))
    # a server is sent, per document, the keys from the first its tasks see to the last (one range)
    needed = [set() for _ in range(n)]
    for (server, d), (lo, hi) in hull.items():
        needed[server] |= {(d, p) for p in range(lo, hi)}
    received = np.array([len(needed[r] - held_keys[r]) for r in range(n)], dtype=np.int64)
    return served * per_query + (kv_rows + received) * tb.kv


@settings(max_examples=80, deadline=None)
@given(pieces=st.one_of(packed_batches(), batches_with_key_only_prefixes()),
       tolerance=st.sampled_from([0.0, 0.05, 0.3]), window=st.sampled_from([None, 3, 17]),
       backward=st.sampled_from(["saved", "resend"]))
def test_formula_counts_what_a_rank_keeps(pieces, tolerance, window, backward):
    plan = plan_tasks(pieces, PlannerConfig(tolerance=tolerance, token_bytes=TB, window=window))
    memory = backward_memory(plan, pieces, TB, backward=backward)
    assert np.array_equal(memory.held, _reference_held(plan, pieces, TB, backward))
    assert np.array_equal(memory.own, pieces.tokens() * (TB.q + TB.kv + TB.o + TB.lse))


@settings(max_examples=80, deadline=None)
@given(pieces=packed_batches(), tolerance=st.sampled_from([0.0, 0.05, 0.3, "auto"]))
def test_memory_imbalance_bounds(pieces, tolerance):
    """Every query is served once, so in saved mode what servers gain in queries donors lose: the
    bytes added sum to the K/V received. memory_imbalance lies in [1, ranks]; in resend mode (nothing
    kept on servers) it is the own tokens' imbalance."""
    plan = plan_tasks(pieces, PlannerConfig(tolerance=tolerance, token_bytes=TB))
    received = kv_received(kv_transfers(plan, pieces), pieces.num_ranks)
    saved = backward_memory(plan, pieces, TB, backward="saved")
    assert saved.added.sum() == received.sum() * TB.kv
    resend = backward_memory(plan, pieces, TB, backward="resend")
    assert not resend.added.any()
    assert resend.imbalance() == pytest.approx(imbalance(pieces.tokens()))
    for memory in (saved, resend):
        assert 1.0 - 1e-12 <= memory.imbalance() <= pieces.num_ranks + 1e-9
    if not received.any():  # nothing travels: a server keeps only what its own queries need
        assert saved.imbalance() == pytest.approx(imbalance(pieces.tokens()))


def _fits(plan, pieces, budget) -> bool:
    return backward_memory(plan, pieces, TB).fits(budget)


@settings(max_examples=80, deadline=None)
@given(pieces=packed_batches(), tolerance=st.sampled_from([0.02, 0.3, "auto"]),
       budget=st.sampled_from([0.0, 0.05, 0.3, 1.0]), backward=st.sampled_from(["saved", "resend"]))
def test_budget_is_honoured(pieces, tolerance, budget, backward):
    """The plan fits the budget in the mode it names: the worst rank within (1 + budget) x the mean
    over ranks of what they hold (memory_imbalance <= 1 + budget), or no more than the worst rank
    keeps in resend mode (its own, what no plan changes). A fixed tolerance keeps its carving and runs
    in resend mode only when the saved one does not fit. Without a budget: the mode set."""
    config = PlannerConfig(tolerance=tolerance, token_bytes=TB, backward=backward)
    free = plan_tasks(pieces, config)
    assert free.backward == backward
    plan = plan_tasks(pieces, dataclasses.replace(config, memory_budget=budget))
    memory = backward_memory(plan, pieces, TB)
    resend = backward_memory(plan, pieces, TB, backward="resend").held
    assert memory.held.max() <= max((1 + budget) * memory.held.mean(), resend.max()) * (1 + 1e-12)
    if tolerance != "auto":
        assert np.array_equal(plan.server, free.server) and np.array_equal(plan.q_start, free.q_start)
        assert plan.backward == ("resend" if backward == "resend" or not _fits(free, pieces, budget) else "saved")


def _long_beside_short(ranks=8, tokens=256) -> DocumentPieces:
    """Rank 0 holds one long document; every other rank many short ones (equal tokens)."""
    return DocumentPieces.from_rank_lists([[tokens]] + [[8] * (tokens // 8)] * (ranks - 1))


def test_a_plan_over_budget_runs_in_resend_mode_or_yields_to_a_looser_one():
    pieces = _long_beside_short()
    tight = PlannerConfig(tolerance=0.02, token_bytes=TB)
    saved = plan_tasks(pieces, tight)
    over = backward_memory(saved, pieces, TB)
    assert saved.backward == "saved" and over.imbalance() > 1.05  # the servers of the long document's shards
    budget = 0.02
    assert not over.fits(budget)
    fixed = plan_tasks(pieces, dataclasses.replace(tight, memory_budget=budget))
    assert fixed.backward == "resend" and np.array_equal(fixed.server, saved.server)  # same carving, kept nothing
    assert _fits(fixed, pieces, budget)
    auto = plan_tasks(pieces, dataclasses.replace(tight, tolerance="auto", memory_budget=budget))
    assert _fits(auto, pieces, budget)
    # a budget the saved plan meets changes nothing
    roomy = plan_tasks(pieces, dataclasses.replace(tight, memory_budget=over.imbalance()))
    assert roomy.backward == "saved" and np.array_equal(roomy.server, saved.server)
    # under "resend" as the setting, no plan adds anything: any budget holds for equal tokens
    assert plan_tasks(pieces, dataclasses.replace(tight, backward="resend", memory_budget=0.0)).backward == "resend"


def test_own_tokens_over_the_budget_do_not_stop_the_plan():
    """Rank 0 holds twice the others' tokens: its own activations alone are over a budget of 0.1.
    No plan changes that, so the budget asks no more than resend mode's (rank 0's own); the work
    still moves."""
    pieces = DocumentPieces.from_rank_lists([[128], [8] * 8, [8] * 8])
    for tolerance in (0.02, "auto"):
        config = PlannerConfig(tolerance=tolerance, token_bytes=TB)
        plan = plan_tasks(pieces, dataclasses.replace(config, memory_budget=0.1))
        memory = backward_memory(plan, pieces, TB)
        assert memory.own.max() > 1.1 * memory.own.mean() and memory.fits(0.1)
        unbounded = plan_tasks(pieces, config)
        assert np.array_equal(plan.server, unbounded.server) and np.array_equal(plan.q_end, unbounded.q_end)
    assert plan_tasks(pieces, dataclasses.replace(config, tolerance=0.02, memory_budget=0.1)).moved_queries() > 0


def test_plan_stats_memory_keys_sum_the_nano_batches():
    pieces = _long_beside_short()
    plans = [plan_tasks(p, PlannerConfig(tolerance=0.02, token_bytes=TB, backward=b))
             for p, b in ((pieces, "saved"), (_long_beside_short(tokens=128), "resend"))]
    batches = [BatchPlan(p, plan, kv_received(kv_transfers(plan, p), p.num_ranks), 1)
               for p, plan in zip((pieces, _long_beside_short(tokens=128)), plans)]
    stats = plan_stats_of(1, batches, token_bytes=dataclasses.replace(TB, lse=0), num_heads=1, overlap="pingpong")
    tb4 = dataclasses.replace(TB, lse=4)  # TokenBytes without lse: plan_stats_of counts 4 bytes per head
    added = [backward_memory(b.plan, b.pieces, tb4).added for b in batches]
    assert stats.memory_bytes_per_layer == (added[0] + added[1]).tolist()
    own = sum(b.pieces.tokens() for b in batches) * tb4.held
    assert stats.memory_imbalance == pytest.approx(imbalance(own + added[0] + added[1]))
    assert stats.backward == "resend+saved" and stats.nano_batches[1].memory_bytes_per_layer == [0] * 8
    local = plan_stats_of(2, [BatchPlan(DocumentPieces.from_rank_lists([[10], [5, 5], [4]]))])
    assert local.memory_bytes_per_layer == [0, 0, 0] and local.memory_imbalance == pytest.approx(10 / 8)


def test_simulate_reports_memory_for_every_method():
    lengths = [40_000, 3_000, 700, 12_000, 90_000, 250]
    r = simulate(lengths, 8, 32_768, batches=2, config=PlannerConfig(tolerance="auto", block=128, memory_budget=None))
    for method in METHODS:
        m = r[method]
        assert m["memory_imbalance"] >= 1.0 and set(m["memory_bytes_per_layer"]) == {"max", "mean"}
        assert m["memory_bytes_per_layer"]["max"] >= m["memory_bytes_per_layer"]["mean"]
    assert r["per_doc_cp"]["memory_bytes_per_layer"]["mean"] > 0  # the K/V it all-gathers
    assert r["ulysses"]["memory_bytes_per_layer"]["max"] == 0  # degree <= 8 K/V heads: nothing repeated
    bounded = simulate(lengths, 8, 32_768, batches=2,
                       config=PlannerConfig(tolerance="auto", block=128, memory_budget=0.05))
    held = bounded["distca"]
    # the worst rank within 1.05 x the mean own activations (ranks hold equal tokens): the imbalance over
    # own + added, whose mean is at least own's, is within that too
    assert held["worst_memory_imbalance"] <= 1.05 + 1e-9


# ---- overlap="wave": a prefix several waves bring is kept once, what the plan budgets ----

@settings(max_examples=60, deadline=None)
@given(pieces=packed_batches(), tolerance=st.sampled_from([0.0, 0.05, 0.3]), window=st.sampled_from([None, 5]),
       block=st.sampled_from([1, 4]))
def test_waves_keep_the_k_v_the_plan_budgets(pieces, tolerance, window, block):
    from distca_hf.planning import kv_kept, wave_plans
    from distca_hf.runtime.tables import kv_store_tables

    n = pieces.num_ranks
    plan = plan_tasks(pieces, PlannerConfig(tolerance=tolerance, window=window, block=block))
    waves = [kv_transfers(sub, pieces) for _, sub in wave_plans(plan, block)]
    planned, kept = kv_received(kv_transfers(plan, pieces), n), kv_kept(waves, n)
    # without a window every wave's keys of a document on a server start at 0: the union is the plan's
    assert (kept == planned).all() if window is None else (kept <= planned).all()
    assert (kept <= sum(kv_received(t, n) for t in waves)).all()
    for rank in range(n):  # the runtime's tables keep exactly those rows, and every pool row finds its row
        local_kv = 7
        tables = kv_store_tables(waves, rank, local_kv)
        rows = 0
        for t, (keep, store) in zip(waves, tables):
            received = int(kv_received(t, n)[rank])
            assert (store is None) == (received == 0)
            if store is not None:
                assert store.size == local_kv + received and (store[:local_kv] == np.arange(local_kv)).all()
                rows += received if keep is None else keep.size
                assert store.max() < local_kv + rows
        assert rows == kept[rank]


def test_a_prefix_two_waves_bring_is_counted_once():
    from distca_hf.planning import kv_kept, wave_plans

    # one document spanning both ranks: rank 1's own tasks of it fall in both local waves, each
    # bringing rank 0's piece
    pieces = DocumentPieces.from_rank_lists([[(0, 0, 48)], [(0, 48, 80), (1, 0, 16)]])
    plan = plan_tasks(pieces, PlannerConfig(tolerance=0.02))
    waves = [kv_transfers(sub, pieces) for _, sub in wave_plans(plan)]
    per_wave = sum(kv_received(t, 2) for t in waves)
    assert per_wave[1] > kv_kept(waves, 2)[1] == kv_received(kv_transfers(plan, pieces), 2)[1] == 48


# ---- on gloo ranks: the formula is what the dispatch really keeps ----

def _memory_worker(rank, world):
    import distca_hf
    from helpers import objective_weights, param_grads, per_document_reference, tiny_model
    from workers import global_stream

    model = tiny_model("llama")
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    lengths = [64] if rank == 0 else [8] * 8  # rank 0 one long document: the plan moves its late queries
    g = torch.Generator().manual_seed(rank)
    docs = [torch.randint(0, 96, (n,), generator=g) for n in lengths]
    weights = [objective_weights((n, 96), seed=i) for i, n in enumerate(lengths)]
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    report = []
    for backward, overlap, budget in (("saved", "none", None), ("resend", "none", None), ("saved", "pingpong", None),
                                      ("resend", "pingpong", None), ("saved", "wave", None), ("saved", "none", 0.0)):
        distca_hf.configure(backward=backward, overlap=overlap, tolerance=0.02, memory_budget=budget)
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, position_ids=pos).logits[0]
        (logits * torch.cat(weights)).sum().backward()
        grads = param_grads(model)
        entry = {"backward": backward, "overlap": overlap, "budget": budget, "stats": distca_hf.plan_stats()}
        if budget is not None:  # the mode the planner chose still computes every document exactly
            ref_logits, ref_grads = per_document_reference(model, docs, weights)
            entry["logit_err"] = float((logits.detach() - torch.cat(ref_logits)).abs().max())
            entry["grad_excess"] = max(float(((grads[n] - ref_grads[n]).abs() - 1e-4 * ref_grads[n].abs()).max())
                                       for n in ref_grads)
        entry["tokens"] = sum(lengths)
        report.append(entry)
    # wave over a document spanning both ranks (80 tokens, rank 0 holding its first 48): rank 1's own
    # tasks of it fall in both local waves, each bringing its prefix from rank 0, and every wave
    # exchanges; backward keeps the local K/V and each received row once
    tokens, positions, _ = global_stream([80, 16])
    lo, hi = (0, 48) if rank == 0 else (48, 96)
    distca_hf.configure(backward="saved", overlap="wave", tolerance=0.02, memory_budget=None, span_ranks=True)
    model.zero_grad(set_to_none=True)
    model(input_ids=tokens[lo:hi][None], position_ids=positions[lo:hi][None]).logits.sum().backward()
    report.append({"backward": "saved", "overlap": "wave", "budget": None, "stats": distca_hf.plan_stats(),
                   "tokens": hi - lo})
    per_token = {"q": config.num_attention_heads * head_dim * 4, "kv": 2 * config.num_key_value_heads * head_dim * 4,
                 "lse": 4 * config.num_attention_heads}
    return {"report": report, "per_token": per_token, "layers": config.num_hidden_layers}


@pytest.mark.distributed
def test_formula_is_what_the_dispatch_keeps(tmp_path):
    results = run_ranks(_memory_worker, 2, tmp_path, deadline_s=240)
    assert all(r["ok"] for r in results), [r.get("traceback", r.get("error")) for r in results]
    for rank, result in enumerate(results):
        value = result["value"]
        t = value["per_token"]
        for run in value["report"]:
            own = run["tokens"] * (2 * t["q"] + t["kv"] + t["lse"])  # q, k, v, out, log-sum-exp (fp32)
            stats = run["stats"]
            assert stats["dispatched"] and stats["overlap"] == run["overlap"], run
            kept = stats["rank_saved_for_backward_bytes"]
            added = stats["memory_bytes_per_layer"][rank]
            assert kept == value["layers"] * (own + added), (rank, run["backward"], run["overlap"], kept, own, added)
            if run["budget"] is None and run["backward"] == "saved":
                assert stats["backward"] == "saved" and any(stats["memory_bytes_per_layer"])
                assert stats["memory_imbalance"] > 1.0
            if stats["backward"] == "resend":  # servers keep nothing of what they received
                assert not any(stats["kv_tokens_kept_per_layer"]), run
            if run["budget"] == 0.0:  # the saved plan adds memory on the server: this step ran in resend mode
                assert stats["backward"] == "resend" and added == 0 and stats["memory_imbalance"] == 1.0
                assert run["logit_err"] < 1e-5 and run["grad_excess"] < 1e-5
        spanning = value["report"][-1]["stats"]  # a prefix came in two waves, kept once: what the plan budgets
        assert spanning["waves"] >= 3 and spanning["backward"] == "saved"
        assert spanning["kv_tokens_received_per_layer"][1] > spanning["kv_tokens_kept_per_layer"][1] > 0


# ---- the budget by construction: the descent within it, memory tiles, resend only where nothing fits ----

ATTENTION_BOUND = TimeModel(1e-8, 1e-9, task_s=1e-6, bytes_per_s=1e10, collective_s=1e-6)  # moving work pays


@settings(max_examples=40, deadline=None)
@given(pieces=packed_batches(), budget=st.sampled_from([0.0, 0.1, 0.3]), key_split=st.booleans(),
       model=st.sampled_from([ATTENTION_BOUND, TimeModel(0.0, 1e-9)]))
def test_auto_plans_honour_the_budget_and_stay_exact(pieces, budget, key_split, model):
    """Every rank's backward_memory within (1 + budget) x the mean held (or the resend floor), or the
    plan runs in resend mode; every (query, key) pair computed exactly once. The descent within the
    budget is the unbounded descent whenever the budget refused it nothing, and memory tiles never
    raise the worst rank and stay exact."""
    config = PlannerConfig(tolerance="auto", block=2, token_bytes=TB, time_model=model, memory_budget=budget,
                           key_split=key_split)
    plan = plan_tasks(pieces, config)
    memory = backward_memory(plan, pieces, TB)
    if plan.backward == "saved":
        floor = backward_memory(plan, pieces, TB, backward="resend").held.max(initial=0)
        assert memory.held.max(initial=0) <= max((1 + budget) * memory.held.mean(), floor) * (1 + 1e-12)
    check_tiles(with_key_ranges(plan), pieces)
    free = descend(pieces, config)
    bounded, refused = descend_within_memory(pieces, config, held_mean=float(backward_memory(free, pieces, TB).held.mean()))
    check_tiles(with_key_ranges(bounded), pieces)
    if not refused:
        assert all(np.array_equal(getattr(bounded, k), getattr(free, k)) for k in ("server", "q_start", "q_end"))
    tiled = apply_memory_tiles(free, pieces, TB, budget)
    check_tiles(tiled, pieces)
    assert backward_memory(tiled, pieces, TB).held.max(initial=0) <= \
        backward_memory(with_key_ranges(free), pieces, TB).held.max(initial=0)


def test_the_descent_stays_within_the_budget_where_the_unbounded_plan_needed_resend():
    """Rank 0 holds one long document, three ranks short ones. The unbounded descent's servers hold
    1.15x the mean; under a budget of 0.14 the descent moves less to each server and the step stays in
    saved mode (before: resend mode, the bytes of q, k/v and out again), predicted faster than resend."""
    pieces = _long_beside_short(ranks=4, tokens=1024)
    config = PlannerConfig(tolerance="auto", block=8, token_bytes=TB, time_model=ATTENTION_BOUND)
    free = plan_tasks(pieces, config)
    assert free.backward == "saved" and not backward_memory(free, pieces, TB).fits(0.14)
    plan = plan_tasks(pieces, dataclasses.replace(config, memory_budget=0.14))
    assert plan.backward == "saved" and _fits(plan, pieces, 0.14) and plan.moved_queries() > 0
    resend = dataclasses.replace(free, backward="resend")
    assert step_seconds(plan, pieces, config) < step_seconds(resend, pieces, config)
    assert step_seconds(plan, pieces, config) < 0.5 * step_seconds(colocated_plan(pieces), pieces, config)


def test_memory_tiles_keep_a_spanning_prefix_on_its_holder():
    """Document 0 fills rank 0 and ends with 16 tokens on rank 1: colocated in saved mode, rank 1
    receives its 200-token prefix (over 1.05x the mean held). With tiles, rank 1's 16 queries go to rank 0
    (which holds those keys) instead: every rank within a budget of 0.05, exactly the same pairs."""
    short = iter(range(1, 100))
    pieces = DocumentPieces.from_rank_lists([[(0, 0, 200)], [(0, 200, 216)] + [(next(short), 0, 8) for _ in range(23)],
                                             *[[(next(short), 0, 8) for _ in range(27)] for _ in range(2)]])
    colocated = colocated_plan(pieces)
    assert not _fits(colocated, pieces, 0.05)
    tiled = apply_memory_tiles(colocated, pieces, TB, 0.05)
    check_tiles(tiled, pieces)
    assert _fits(tiled, pieces, 0.05)
    assert kv_received(kv_transfers(tiled, pieces), 4)[1] == 0
    slow_network = TimeModel(1e-8, 1e-9, bytes_per_s=1e6)  # bytes decide: resend's would cost the most
    auto = plan_tasks(pieces, PlannerConfig(tolerance="auto", token_bytes=TB, time_model=slow_network, memory_budget=0.05,
                                            key_split=True))
    assert auto.backward == "saved" and auto.splits_keys and _fits(auto, pieces, 0.05)


def test_resend_without_a_budget_plans_with_key_split():
    """``backward="resend"`` with no memory budget and key-split tiles: ``auto`` plans (before: a
    TypeError from the memory tiles, asked for a budget of None) and keeps the mode set."""
    pieces = DocumentPieces.from_rank_lists([[4096], [1024] * 4])
    config = PlannerConfig(tolerance="auto", block=128, key_split=True, backward="resend", memory_budget=None)
    plan = plan_tasks(pieces, config)
    assert plan.backward == "resend"
    check_tiles(with_key_ranges(plan), pieces)


def test_resend_with_a_budget_keeps_resend_when_memory_tiles_would_fit():
    """``backward="resend"`` under a memory budget: ``auto`` never returns a ``saved`` plan, even where
    the memory tiles would bring a saved plan within the budget (before: it did on batches whose
    spanning documents' late pieces piled K/V on one rank)."""
    rng = np.random.default_rng(3)
    modes = set()
    for _ in range(12):
        lengths = np.concatenate([[int(rng.integers(80_000, 200_000))], rng.integers(500, 8_000, 120)])
        rng.shuffle(lengths)
        pieces = DocumentPieces.from_rank_lists(_pack(lengths.tolist(), ranks=16, tokens_per_rank=65536))
        for backward in ("saved", "resend"):
            config = PlannerConfig(tolerance="auto", block=128, key_split=True, backward=backward, memory_budget=0.1)
            plan = plan_tasks(pieces, config)
            modes.add((backward, plan.backward))
            if backward == "resend":
                assert plan.backward == "resend"
    assert ("saved", "saved") in modes  # the memory tiles (or the descent within the budget) kept some saved


def _pack(lengths, *, ranks, tokens_per_rank):
    """``lengths`` packed in order onto ``ranks`` rows of ``tokens_per_rank``, a document continuing on
    the next row; what does not fit is dropped. Per rank, its pieces' lengths."""
    rows, room = [[] for _ in range(ranks)], tokens_per_rank
    rank = 0
    for length in lengths:
        while length > 0 and rank < ranks:
            piece = min(length, room)
            rows[rank].append(piece)
            length, room = length - piece, room - piece
            if room == 0:
                rank, room = rank + 1, tokens_per_rank
    return rows
