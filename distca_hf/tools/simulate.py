"""Cluster-scale simulator (``distca-hf simulate``): what CAD would gain on N ranks, before renting them.

Each batch draws documents from a length sample (seeded) and packs them, in draw order, into N
ranks of T tokens; a document longer than what is left on a rank continues on the next ones (the
batch's last document is cut where the batch is full). Five ways to run the same documents, each
timed with one ``TimeModel`` *and* its communication:

- ``colocated``: packed data parallelism; every rank computes attention for its own tokens (a piece
  of a document that spans ranks receives its prefix K/V).
- ``wlb``: WLB-LLM-style packing: documents longer than a threshold wait in a queue and are released
  one per micro-batch, the rest go to the least attention-loaded rank with room; what does not fit
  waits for the next step (its step time is per ``N x T`` tokens it ran: documents still waiting
  after the last batch do not count against it).
- ``per_doc_cp``: per-document context parallelism (head-tail chunks, K/V all-gathered in the group)
  at the degree a user would pick (the smallest that holds the longest document), data parallel
  across the CP groups, which pack whole documents (``baselines.group_documents``).
- ``ulysses``: DeepSpeed Ulysses / ALST (all-to-all of q, k, v and the output over heads) at the
  smallest degree that holds the longest document and that DeepSpeed accepts for the heads; data
  parallel across groups, packed likewise. ``tuned_baseline``: the fastest method at any degree that
  holds the longest document (tuned for speed, as the paper tunes its baselines).
- ``distca``: the planner's CA-task assignment on the colocated packing (``distca_plan``).

A rank's layer time (forward + backward) is the planner's time model (``planning.by_time``): its
compute (linear per token, the kernel's pairs, keys and tasks) plus its exposed communication, the
fraction ``1 - hidden_comm_fraction`` of ``2 x (sent + received) / bytes_per_s`` (the backward moves
as many bytes as the forward) plus ``collective_s`` when anything crosses ranks. The step takes as
long as its slowest rank. ``hidden_comm_fraction`` is an input, the same for every method; it is
what the overlap mode hides, and distca plans with it. Layouts and bytes live in
``distca_hf.planning.baselines``; bytes assume bf16 and the model given by ``--hidden``, ``--heads``,
``--kv-heads`` (default: Llama-3-8B); times come from the planner's built-in CUDA model (an H100 measured,
carried to that shape) or ``distca-hf profile``'s JSON (``--time-model``). K/V received: tokens per layer.

Memory (``memory_imbalance``, ``memory_bytes_per_layer``: every method): what a rank keeps for
attention's backward in one layer. Own activations are its tokens x (q + k/v + out + log-sum-exp)
bytes; beyond them (``memory_bytes_per_layer``, max and mean over ranks, averaged over batches)
distca keeps what ``planning.backward_memory`` says for its plan and backward mode (``saved``: the
queries, K/V, outputs and log-sum-exp of the tasks a server serves; ``resend``: nothing); colocated
packing and WLB-LLM packing the prefix K/V a piece of a document spanning ranks receives (0 for
documents on one rank); per-document CP the K/V it all-gathers in its group; Ulysses the K/V heads it
repeats when its degree exceeds the K/V heads (its all-to-all buffers otherwise hold as many bytes as
the rank's own q, k, v). ``memory_imbalance`` is max / mean over ranks of own + that, averaged over
batches. distca plans within ``--memory-budget`` (the ``memory_budget`` setting).

With ``--pipeline-parallel P`` (and ``--micro-batches M``) it also models one training step of a
non-interleaved 1F1B pipeline of ``P`` stages x ``N / P`` data-parallel pipelines
(``simulate_pipeline``, ``planning.pipeline_cost``): stock 1F1B with colocated packing, with
micro-batches balanced for attention, with CAD inside each stage and with CAD across stages (the
lockstep schedule whose bubbles serve CA-tasks); ``--tokens-per-rank`` is then one micro-batch row.
It adds the floors of the two CAD methods (``planning.pipeline_bound``: attention spread evenly, bytes
counted only on the links of a document's holders: their queries and outputs alone when K/V may be
relayed) and the bound they put on CAD across stages over CAD inside each stage.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import statistics
import sys
import time

import numpy as np

from ..config import SETTINGS, is_integer, kv_cap_pairing_problem
from ..planning import (DocumentPieces, Plan, PlannerConfig, TimeModel, TokenBytes, backward_memory, colocated_plan,
                        comm_bytes, imbalance, kv_received, kv_transfers, plan_tasks)
from ..planning.baselines import (RankLoads, cp_loads, fitting_degrees, pack_pieces, per_doc_cp_kv_received,
                                  smallest_degree, ulysses_degree_ok, ulysses_kv_share, ulysses_loads, wlb_steps)
from ..planning.by_time import loads_seconds, plan_by_tolerances, plan_loads
from ..planning.rank_time import sends_timing
from ..planning.relay_trees import plan_kv_sends
from ..planning.transfers import long_document_servers
from ..planning.cost import H100_MEASURED, batch_tokens_problem, default_time_model, head_split_problem
from ..planning.pipeline_bound import pipeline_floors
from ..planning.pipeline_cost import PIPELINE_METHODS, check_layers, held_micro_batches, pipeline_step
from .length_samples import check_lengths, load_lengths, span_problem
from .output_paths import output_path_problem
from .simulate_checks import check_sizes, draws_problem, pipeline_flags, time_model_flag
from .simulate_mixed import (DEFAULT_SLIDING_FRACTION, add_mixed_arguments, check_mixed, format_mixed_table, mixed_flags_problem,
                             mixed_layer_times, simulate_mixed_layers)
from .simulate_tables import LABELS, METHODS, PIPELINE_LABELS, format_pipeline_table, format_table

__all__ = ["METHODS", "LABELS", "PIPELINE_LABELS", "draw_batch", "cut_to", "pack_pieces", "per_doc_cp_kv_received",
           "distca_plan", "default_planner_config", "simulate", "simulate_pipeline", "format_table", "format_pipeline_table",
           "format_mixed_table", "build_parser", "main"]


def draw_batch(lengths: np.ndarray, total_tokens: int, rng: np.random.Generator) -> np.ndarray:
    """Document lengths drawn with replacement until ``total_tokens`` are filled; the last one is
    cut to fit exactly."""
    mean = float(lengths.mean())
    drawn = np.zeros(0, dtype=np.int64)
    while drawn.sum() < total_tokens:
        more = rng.choice(lengths, size=max(16, int(1.2 * (total_tokens - drawn.sum()) / mean) + 1))
        drawn = np.concatenate((drawn, more))
    return cut_to(drawn, total_tokens)


def cut_to(docs: np.ndarray, total_tokens: int) -> np.ndarray:
    """The documents that fill ``total_tokens`` in order, the last one cut where the batch is full
    (all of them when they hold no more than that)."""
    ends = np.cumsum(docs)
    if ends[-1] <= total_tokens:
        return docs.copy()
    count = int(np.searchsorted(ends, total_tokens)) + 1
    kept = docs[:count].copy()
    kept[-1] -= int(ends[count - 1]) - total_tokens
    return kept


PLOT_SUFFIXES = (".png", ".pdf", ".svg")
"""The ``--plot`` files matplotlib writes here (a path without one would be written as ``.png``)."""

DEFAULT_LAYERS = 32
"""Decoder layers the pipeline model splits into stages when none are given (Llama-3-8B)."""

AUTO_PLANNERS = {"descent": plan_tasks, "tolerances": plan_by_tolerances}  # tolerance="auto": now / before the descent


def distca_plan(pieces: DocumentPieces, config: PlannerConfig, time_model: TimeModel,
                hidden_comm_fraction: float, auto_planner: str = "descent") -> Plan:
    """distca's plan of one batch: the one place the simulator asks the planner. It plans with
    ``config`` under the simulator's own time model and hidden fraction (what ``tolerance="auto"``
    weighs), so the plan and its timing use one model. ``auto_planner``: what ``"auto"`` plans with,
    ``descent`` (the planner's) or ``tolerances`` (``by_time.plan_by_tolerances``, the one before it)."""
    planning = _planning_config(config, time_model, hidden_comm_fraction)
    return (AUTO_PLANNERS[auto_planner] if planning.tolerance == "auto" else plan_tasks)(pieces, planning)


def _planning_config(config: PlannerConfig, time_model: TimeModel, hidden_comm_fraction: float) -> PlannerConfig:
    """``config`` planning with the simulator's time model and hidden fraction."""
    return dataclasses.replace(config, time_model=time_model, exposed_comm=1.0 - hidden_comm_fraction)


def _timed(loads: RankLoads, time_model: TimeModel, hidden: float, backward: str = "saved", rounds: int = 1,
           wait_s=None) -> dict:
    compute, exposed = loads_seconds(loads, time_model, 1.0 - hidden, backward, rounds=rounds, wait_s=wait_s)
    return {"t": float((compute + exposed).max()), "comm": float(exposed.max()), "imb": imbalance(loads.pairs),
            "bytes": float(loads.received.sum())}


def _memory(tokens: np.ndarray, added: np.ndarray, token_bytes: TokenBytes, prefix: str) -> dict:
    """A method's memory for backward in one layer (module docstring): ``[ranks]`` own ``tokens`` and
    the bytes it ``added``; keys ``{prefix}_mem_imb``, ``_mem_max``, ``_mem_mean``."""
    added = np.asarray(added, dtype=np.float64)
    held = np.asarray(tokens, dtype=np.float64) * token_bytes.held + added
    return {f"{prefix}_mem_imb": imbalance(held), f"{prefix}_mem_max": float(added.max()),
            f"{prefix}_mem_mean": float(added.mean())}


def _kv_keys(received_tokens: np.ndarray, prefix: str) -> dict:
    """``{prefix}_kv_max``, ``_kv_mean``: the most and the mean K/V tokens a server receives per layer."""
    received_tokens = np.asarray(received_tokens, dtype=np.float64)
    return {f"{prefix}_kv_max": float(received_tokens.max()), f"{prefix}_kv_mean": float(received_tokens.mean())}


def _memory_keys(mean, prefix: str) -> dict:
    """Every method's received K/V (tokens per layer) and memory keys (``_kv_keys``, ``_memory``)."""
    return {"kv_received_tokens_per_layer": {"max": mean(f"{prefix}_kv_max"), "mean": mean(f"{prefix}_kv_mean")},
            "memory_imbalance": mean(f"{prefix}_mem_imb"),
            "memory_bytes_per_layer": {"max": mean(f"{prefix}_mem_max"), "mean": mean(f"{prefix}_mem_mean")}}


def _colocated_memory(pieces: DocumentPieces, token_bytes: TokenBytes, prefix: str) -> dict:
    """Packed ranks computing their own pieces keep, beyond their own activations, the prefix K/V a
    piece of a spanning document receives (``saved``-mode dispatch of the colocated plan)."""
    added = backward_memory(colocated_plan(pieces), pieces, token_bytes, backward="saved").added
    return _memory(pieces.tokens(), added, token_bytes, prefix)


def default_planner_config() -> PlannerConfig:
    """The planner the simulator runs unless given one: the settings' defaults (``tolerance``,
    ``memory_budget``, ``kv_relays``), block 128, key-split tiles (the one home of it for ``simulate``,
    ``simulate_pipeline`` and the examples that measure what it plans)."""
    return PlannerConfig(tolerance=SETTINGS["tolerance"].default, block=128,
                         memory_budget=SETTINGS["memory_budget"].default, key_split=True,
                         kv_relays=SETTINGS["kv_relays"].default)


def simulate(lengths, ranks: int, tokens_per_rank: int, batches: int = 8, seed: int = 0,
             config: PlannerConfig | None = None, time_model: TimeModel = H100_MEASURED, keep_first: bool = False,
             *, hidden_comm_fraction: float = 0.0, heads: int = 32, kv_heads: int = 8,
             wlb_threshold: int | None = None, auto_planner: str = "descent", sliding_window: int | None = None,
             sliding_fraction: float = DEFAULT_SLIDING_FRACTION):
    """Run the comparison; returns the contract's JSON object (and the first batch's details as
    ``_first`` when ``keep_first``).

    ``heads`` / ``kv_heads`` decide which Ulysses degrees DeepSpeed accepts and its K/V bytes;
    ``wlb_threshold`` (tokens, default ``tokens_per_rank // 2``) is the length above which WLB-LLM
    packing queues a document; ``auto_planner``: a key of ``AUTO_PLANNERS`` (``distca_plan``).
    ``sliding_window``: also model a model whose ``sliding_fraction`` of the layers slide with this
    window (key ``"mixed_layers"``, ``simulate_mixed``); the rest of the object is its full layers'."""
    config = _checked_run(config, seed)
    problem = head_split_problem(heads, kv_heads)
    if problem:
        raise ValueError(problem)
    if not 0.0 <= hidden_comm_fraction <= 1.0:
        raise ValueError(f"hidden_comm_fraction must be between 0 and 1, got {hidden_comm_fraction!r}")
    if auto_planner not in AUTO_PLANNERS:
        raise ValueError(f"auto_planner must be one of {sorted(AUTO_PLANNERS)}, got {auto_planner!r}")
    check_sizes(ranks=ranks, tokens_per_rank=tokens_per_rank, batches=batches)
    check_mixed(sliding_window, sliding_fraction)
    lengths = check_lengths(lengths)
    threshold = wlb_threshold if wlb_threshold is not None else max(1, tokens_per_rank // 2)
    longest = int(min(lengths.max(), ranks * tokens_per_rank))  # a batch cuts what it cannot hold
    cp_degree = smallest_degree(longest, tokens_per_rank, ranks)
    sp_degree = smallest_degree(longest, tokens_per_rank, ranks, lambda d: ulysses_degree_ok(d, heads, kv_heads))
    rng = np.random.default_rng(seed)
    drawn = [draw_batch(lengths, ranks * tokens_per_rank, rng) for _ in range(batches)]
    measured = [_measure_batch(docs, ranks, tokens_per_rank, config, time_model, hidden_comm_fraction, cp_degree,
                               sp_degree, kv_heads, auto_planner, sliding_window) for docs in drawn]
    wlb_packed, _ = wlb_steps(drawn, ranks, tokens_per_rank, threshold)
    wlb = []
    for pieces, _ in wlb_packed:
        loads = _pieces_loads(pieces, config.token_bytes)
        wlb.append({**_timed(loads, time_model, hidden_comm_fraction), **_colocated_memory(pieces, config.token_bytes, "wlb"),
                    **_kv_keys(loads.received / config.token_bytes.kv, "wlb")})
    # documents still queued at the end are missing from WLB's steps: its time per token, per batch
    wlb_tokens = sum(int(pieces.tokens().sum()) for pieces, _ in wlb_packed)
    acc = {k: [m[k] for m in measured] for k in measured[0] if not k.startswith("_")}
    mean = lambda k: float(np.mean(acc[k]))
    wlb_mean = lambda k: float(np.mean([w[k] for w in wlb]))
    step = {"colocated": mean("colo_t"), "wlb": sum(w["t"] for w in wlb) * ranks * tokens_per_rank / max(wlb_tokens, 1),
            "per_doc_cp": mean("cp_t"), "ulysses": mean("sp_t") if sp_degree else None, "distca": mean("dca_t")}
    baselines = {k: v for k, v in step.items() if k != "distca" and v is not None}
    best = min(baselines, key=baselines.get)
    # the baselines tuned for speed, as the paper tunes its own: CP and Ulysses at every degree that holds the
    # longest document (the smallest one, timed above, not again)
    tb = config.token_bytes
    tuned = {(m, None): baselines[m] for m in ("colocated", "wlb")}
    tuned.update({(m, d): step[m] for m, d in (("per_doc_cp", cp_degree), ("ulysses", sp_degree)) if d})
    loads_at = {"per_doc_cp": lambda docs, d: cp_loads(docs, ranks, tokens_per_rank, d, tb),
                "ulysses": lambda docs, d: ulysses_loads(docs, ranks, tokens_per_rank, d, tb, kv_heads)}
    for method, ok in (("per_doc_cp", lambda d: True), ("ulysses", lambda d: ulysses_degree_ok(d, heads, kv_heads))):
        for d in fitting_degrees(longest, tokens_per_rank, ranks, ok):
            if (method, d) not in tuned:
                tuned[method, d] = float(np.mean([_timed(loads_at[method](docs, d), time_model,
                                                         hidden_comm_fraction)["t"] for docs in drawn]))
    tuned_best = min(tuned, key=tuned.get)
    result = {
        "ranks": ranks,
        "tokens_per_rank": tokens_per_rank,
        "batches": batches,
        "time_model": {"source": time_model.source, "linear_s_per_token": time_model.linear_s_per_token,
                       "attn_s_per_pair": time_model.attn_s_per_pair, "task_s": time_model.task_s,
                       "bytes_per_s": time_model.bytes_per_s},
        "hidden_comm_fraction": hidden_comm_fraction,
        "planner": {"tolerance": config.tolerance, "block": config.block, "backward": config.backward,
                    "memory_budget": config.memory_budget, "auto_planner": auto_planner,
                    "kv_cap": config.kv_cap, "kv_relays": config.kv_relays},
        "colocated": {"attn_imbalance": mean("colo_imb"), "step_time_s": step["colocated"],
                      "exposed_comm_s": mean("colo_comm"), **_memory_keys(mean, "colo")},
        "wlb": {"attn_imbalance": float(np.mean([w["imb"] for w in wlb])), "step_time_s": step["wlb"],
                "exposed_comm_s": float(np.mean([w["comm"] for w in wlb])), "threshold_tokens": threshold,
                "tokens_left_waiting": batches * ranks * tokens_per_rank - wlb_tokens,
                **_memory_keys(wlb_mean, "wlb")},
        "distca": {
            "attn_imbalance": mean("dca_imb"),
            "worst_attn_imbalance": float(max(acc["dca_imb"])),
            "moved_query_fraction": mean("moved"),
            "comm_bytes_per_layer": mean("bytes"),
            "plan_ms_median": float(statistics.median(acc["plan_ms"])),
            "step_time_s": step["distca"],
            "exposed_comm_s": mean("dca_comm"),
            "tasks_per_server": {"max": mean("tasks_max"), "mean": mean("tasks_mean")},
            "smallest_shard_tokens": min((x for x in acc["shard_min"] if x is not None), default=None),
            **_memory_keys(mean, "dca"),
            "worst_memory_imbalance": float(max(acc["dca_mem_imb"])),
            "resend_batch_fraction": mean("dca_resend"),
            "relayed_batch_fraction": float(np.mean(np.asarray(acc["dca_rounds"]) > 1)),
            "kv_exchange_rounds": {"mean": mean("dca_rounds"), "max": int(max(acc["dca_rounds"]))},
            "servers_per_long_document": {"mean": mean("dca_fan_mean"), "max": float(max(acc["dca_fan_max"]))},
        },
        "per_doc_cp": {
            "degree": cp_degree,
            "attn_imbalance": mean("cp_imb"),
            "comm_bytes_per_layer": mean("cp_bytes"),
            # what the baseline timed here receives: its group's K/V all-gathered (the key above: CP of only
            # the documents that span ranks in the packed layout, a stricter yardstick)
            "gathered_kv_tokens_per_layer": {"max": mean("cp_gather_max"), "mean": mean("cp_gather_mean")},
            "step_time_s": step["per_doc_cp"],
            "exposed_comm_s": mean("cp_comm"),
            **_memory_keys(mean, "cp"),
        },
        "ulysses": ({"degree": sp_degree, "attn_imbalance": mean("sp_imb"), "comm_bytes_per_layer": mean("sp_bytes"),
                     "step_time_s": step["ulysses"], "exposed_comm_s": mean("sp_comm"), **_memory_keys(mean, "sp")}
                    if sp_degree else
                    {"degree": None, "step_time_s": None,
                     "unavailable": f"no degree dividing {ranks} ranks holds a {longest}-token document with "
                                    f"{heads} heads / {kv_heads} KV heads (DeepSpeed's rule)"}),
        "best_baseline": best,
        "speedup_vs_best_baseline": baselines[best] / step["distca"],
        "speedup_vs_colocated": step["colocated"] / step["distca"],
        "tuned_baseline": {"method": tuned_best[0], "degree": tuned_best[1], "step_time_s": tuned[tuned_best]},
        "speedup_vs_tuned_baseline": tuned[tuned_best] / step["distca"],
    }
    if sliding_window is not None:
        result["mixed_layers"] = simulate_mixed_layers([m["_mixed"] for m in measured], sliding_window=sliding_window,
                                                       sliding_fraction=sliding_fraction)
    if keep_first:
        result["_first"] = measured[0]["_first"]
    return result


def simulate_pipeline(lengths, ranks: int, tokens_per_rank: int, *, stages: int, micro_batches: int, batches: int = 8,
                      seed: int = 0, config: PlannerConfig | None = None, time_model: TimeModel = H100_MEASURED,
                      hidden_comm_fraction: float = 0.0, layers: int = DEFAULT_LAYERS, hidden: int = 4096,
                      dtype_bytes: int = 2) -> dict:
    """The ``"pipeline"`` object of ``--pipeline-parallel``: ``batches`` steps of ``stages`` x
    ``ranks / stages`` data-parallel pipelines, each step ``micro_batches`` micro-batches drawn from
    ``lengths`` (seeded; micro-batch ``m`` is ``ranks / stages`` rows of ``tokens_per_rank`` tokens,
    packed in order), timed for every method of ``planning.pipeline_cost.PIPELINE_METHODS``;
    ``step_time_s`` is the mean over steps of one whole step (all ``layers`` layers, forward +
    backward), the speedups are ratios of those means. Activations between stages are ``hidden x
    dtype_bytes`` bytes per token. Both CAD methods plan with ``config.kv_relays`` (a lockstep tick's
    plan and each stage's carry relay trees where they help; their rounds and waits are timed)."""
    config = _checked_run(config, seed)
    if not 0.0 <= hidden_comm_fraction <= 1.0:
        raise ValueError(f"hidden_comm_fraction must be between 0 and 1, got {hidden_comm_fraction!r}")
    check_sizes(ranks=ranks, tokens_per_rank=tokens_per_rank, batches=batches, stages=stages,
                 micro_batches=micro_batches)
    if ranks % stages:
        raise ValueError(f"ranks ({ranks}) must be divisible by the pipeline stages ({stages}): every stage has "
                         "the same number of data-parallel ranks")
    per_stage = check_layers(layers, stages)
    data_parallel = ranks // stages
    lengths = check_lengths(lengths)
    planning = _planning_config(config, time_model, hidden_comm_fraction)
    rng = np.random.default_rng(seed)
    steps, floors = [], []
    for _ in range(batches):
        drawn = [draw_batch(lengths, data_parallel * tokens_per_rank, rng) for _ in range(micro_batches)]
        steps.append(pipeline_step(drawn, stages=stages, data_parallel=data_parallel, tokens=tokens_per_rank,
                                   layers=layers, config=planning, activation_bytes_per_token=hidden * dtype_bytes))
        floors.append(pipeline_floors(drawn, stages=stages, data_parallel=data_parallel, tokens=tokens_per_rank,
                                      layers=layers, time_model=time_model, window=config.window,
                                      activation_bytes_per_token=hidden * dtype_bytes,
                                      exposed_comm=planning.exposed_comm, token_bytes=config.token_bytes,
                                      relays=config.kv_relays != "off"))
    mean = lambda method, key: float(np.mean([getattr(step[method], key) for step in steps]))
    step_time = {m: mean(m, "step_s") for m in PIPELINE_METHODS}
    floor_time = {m: float(np.mean([getattr(floor, m).step_s for floor in floors]))
                  for m in ("cad_per_stage", "cad_across_stages")}
    result = {
        "stages": stages,
        "micro_batches": micro_batches,
        "step_time_s": step_time,
        "speedup_vs_colocated_1f1b": step_time["colocated_1f1b"] / step_time["cad_across_stages"],
        "speedup_vs_cad_per_stage": step_time["cad_per_stage"] / step_time["cad_across_stages"],
        "speedup_vs_balanced_micro_batches": step_time["balanced_micro_batches"] / step_time["cad_across_stages"],
        "data_parallel": data_parallel,
        "layers": layers,
        "layers_per_stage": per_stage,
        "tokens_per_micro_batch_row": tokens_per_rank,
        "steps": batches,
        "bubble_fraction": {m: mean(m, "bubble_fraction") for m in PIPELINE_METHODS},
        "attn_imbalance": {m: mean(m, "attn_imbalance") for m in PIPELINE_METHODS},
        "held_micro_batches": held_micro_batches(stages, micro_batches),
        # what no plan beats: attention spread evenly, only holders' links counted (planning.pipeline_bound)
        "floor_step_time_s": floor_time,
        "speedup_bound_vs_cad_per_stage": step_time["cad_per_stage"] / floor_time["cad_across_stages"],
        "attention_share": float(np.mean([floor.attention_share for floor in floors])),
        "p2p_s_per_micro_batch": tokens_per_rank * hidden * dtype_bytes / time_model.bytes_per_s,
    }
    if micro_batches < stages:
        result["note"] = (f"{micro_batches} micro-batches < {stages} stages: stages 0..{stages - micro_batches} run "
                          "every forward before their first backward (GPipe-like fill) and most of the step is "
                          "bubble; torch's Schedule1F1B refuses this (use pipeline_schedule='gpipe'), the lockstep "
                          f"schedule still runs its {2 * (micro_batches + stages - 1)} ticks")
    return result


def _pieces_loads(pieces: DocumentPieces, token_bytes: TokenBytes) -> RankLoads:
    """Packed ranks computing their own pieces (a spanning piece receives its prefix K/V)."""
    return plan_loads(colocated_plan(pieces), pieces, token_bytes)


def _measure_batch(docs: np.ndarray, ranks: int, tokens_per_rank: int, config: PlannerConfig,
                   time_model: TimeModel, hidden: float, cp_degree: int, sp_degree: int | None,
                   kv_heads: int, auto_planner: str = "descent", sliding_window: int | None = None) -> dict:
    """One batch's numbers for every method but WLB (which carries a queue across batches); with
    ``sliding_window``, ``_mixed``: ``simulate_mixed.mixed_layer_times``."""
    total = ranks * tokens_per_rank
    pieces = pack_pieces(docs, ranks, tokens_per_rank)
    start = time.perf_counter()
    plan = distca_plan(pieces, config, time_model, hidden, auto_planner)
    plan_ms = (time.perf_counter() - start) * 1e3
    transfers = kv_transfers(plan, pieces)
    received = kv_received(transfers, ranks)[list(plan.servers)]  # only servers receive K/V
    cp_received = per_doc_cp_kv_received(pieces)
    colo_loads = _pieces_loads(pieces, config.token_bytes)
    colo = _timed(colo_loads, time_model, hidden)
    sends = plan_kv_sends(plan, pieces, transfers)  # along the plan's relay trees, if any
    rounds, wait = sends_timing(sends, config.token_bytes, time_model, 1.0 - hidden, plan.backward, ranks)
    dca_loads = plan_loads(plan, pieces, config.token_bytes, sends)
    dca = _timed(dca_loads, time_model, hidden, plan.backward, rounds, wait)
    tb = config.token_bytes
    cp_rank_loads = cp_loads(docs, ranks, tokens_per_rank, cp_degree, tb)
    cp = _timed(cp_rank_loads, time_model, hidden)
    memory = {**_colocated_memory(pieces, tb, "colo"),
              **_memory(pieces.tokens(), backward_memory(plan, pieces, tb, received=kv_received(transfers, ranks)).added,
                        tb, "dca"),
              **_memory(cp_rank_loads.tokens, cp_rank_loads.received, tb, "cp")}  # received: the K/V all-gathered
    if sp_degree:
        sp_rank_loads = ulysses_loads(docs, ranks, tokens_per_rank, sp_degree, tb, kv_heads)
        sp = _timed(sp_rank_loads, time_model, hidden)
        # after the all-to-all a rank holds the group's tokens for 1 / degree of the heads: as many q, out and
        # log-sum-exp bytes as its own tokens', and K/V of max(1, degree / kv_heads) times its own (heads repeated)
        repeated = sp_degree * ulysses_kv_share(sp_degree, kv_heads) - 1.0
        memory.update(_memory(sp_rank_loads.tokens, sp_rank_loads.tokens * tb.kv * repeated, tb, "sp"))
        # K/V of the other ranks' tokens for this rank's heads, in whole-token units (all K/V heads)
        sp_kv = _kv_keys(np.full(ranks, (sp_degree - 1) * tokens_per_rank * ulysses_kv_share(sp_degree, kv_heads)),
                         "sp")
    else:
        sp = {"t": 0.0, "comm": 0.0, "imb": 1.0, "bytes": 0.0}
        sp_kv = {}  # (no Ulysses degree: the method reports none of its keys)
    tasks = dca_loads.tasks[list(plan.servers)]
    shard = plan.source != plan.server  # the shards the planner sent away
    return {
        "plan_ms": plan_ms,
        "colo_imb": colo["imb"], "dca_imb": imbalance(plan.server_pairs(), plan.servers),
        "cp_imb": cp["imb"], "sp_imb": sp["imb"],
        "moved": plan.moved_queries() / total,
        "bytes": comm_bytes(plan, pieces, config.token_bytes, transfers).total,
        "cp_bytes": cp["bytes"], "sp_bytes": sp["bytes"],
        **_kv_keys(received, "dca"), **_kv_keys(cp_received, "cp"),
        **_kv_keys(colo_loads.received / tb.kv, "colo"), **sp_kv,  # packed pieces receive only K/V
        **{f"cp_gather_{k}": (f(cp_rank_loads.received) / tb.kv if tb.kv else 0.0) for k, f in (("max", np.max),
                                                                                                 ("mean", np.mean))},
        "colo_t": colo["t"], "dca_t": dca["t"], "cp_t": cp["t"], "sp_t": sp["t"],
        "colo_comm": colo["comm"], "dca_comm": dca["comm"], "cp_comm": cp["comm"], "sp_comm": sp["comm"],
        "tasks_max": float(tasks.max()), "tasks_mean": float(tasks.mean()),
        "shard_min": int((plan.q_end - plan.q_start)[shard].min()) if shard.any() else None,
        **dict(zip(("dca_fan_mean", "dca_fan_max"), long_document_servers(plan, pieces, tokens_per_rank))),
        **memory, "dca_resend": float(plan.backward == "resend"), "dca_rounds": rounds,
        "_first": {"local": pieces.local_pairs(), "served": plan.server_pairs()},
        **({"_mixed": mixed_layer_times(pieces, _planning_config(config, time_model, hidden),
                                        sliding_window=sliding_window,
                                        planner=lambda p, c: distca_plan(p, c, time_model, hidden, auto_planner))}
           if sliding_window is not None else {}),
    }


def _checked_run(config, seed) -> PlannerConfig:
    """``config`` (``None``: the defaults) of ``simulate`` / ``simulate_pipeline``, it and ``seed`` checked."""
    if config is not None and not isinstance(config, PlannerConfig):
        raise TypeError(f"config must be a distca_hf.planning.PlannerConfig or None, got {type(config).__name__}")
    if not is_integer(seed) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    return config or default_planner_config()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lengths", required=True, help="JSON list of document lengths (tokens)")
    parser.add_argument("--ranks", type=int, required=True,
                        help="ranks (GPUs) each batch is packed onto; every rank is an attention server")
    parser.add_argument("--tokens-per-rank", type=int, required=True,
                        help="tokens each rank holds per batch (the packing budget; longer documents span ranks)")
    parser.add_argument("--batches", type=int, default=8,
                        help="batches drawn and planned; imbalances are averaged over them (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the document draws (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the contract's JSON object on stdout")
    parser.add_argument("--plot", metavar="OUT.png", help="per-rank load before/after and layer time vs context")
    parser.add_argument("--hidden", type=int, default=4096,
                        help="model hidden size in elements per token (not bytes; head dim = hidden / heads); with "
                             "--heads and --kv-heads it sets the bf16 bytes each token's q, k, v, out move "
                             "(default: %(default)s, Llama-3-8B)")
    parser.add_argument("--heads", type=int, default=32, help="query heads (default: %(default)s, Llama-3-8B)")
    parser.add_argument("--kv-heads", type=int, default=8,
                        help="key/value heads, a divisor of --heads (default: %(default)s, Llama-3-8B)")
    tolerance = SETTINGS["tolerance"]
    parser.add_argument("--tolerance", type=tolerance.metadata["parse"], default=tolerance.default,
                        help="planner tolerance (max/mean - 1 of attention), or 'auto' to plan by time "
                             "(default: %(default)s)")
    budget = SETTINGS["memory_budget"]
    parser.add_argument("--memory-budget", type=budget.metadata["parse"], default=argparse.SUPPRESS,
                        help="distca's memory bound: the worst rank may hold (1 + this) x the mean over ranks of what "
                             "they hold for attention's backward per layer (memory_imbalance <= 1 + this), or 'none' "
                             f"(the memory_budget setting; default: {budget.default}; not with --backward resend, "
                             "which keeps nothing)")
    cap = SETTINGS["kv_cap"]
    parser.add_argument("--kv-cap", type=cap.metadata["parse"], default=cap.default,
                        help="distca's cap on the K/V one server receives per layer: 'cp' (per-document CP's worst "
                             "rank of each batch), bytes, or 'none' (the kv_cap setting; needs --tolerance auto; "
                             "default: %(default)s)")
    relays = SETTINGS["kv_relays"]
    parser.add_argument("--kv-relays", type=relays.metadata["parse"], default=relays.default,
                        help="distca's K/V relays: 'auto' (trees placed by time where they make the step faster), "
                             "'off' (every holder sends to every server) or a fanout (the kv_relays setting; "
                             "default: %(default)s)")
    parser.add_argument("--backward", choices=["saved", "resend"], default=SETTINGS["backward"].default,
                        help="distca's backward mode (the backward setting); under 'saved' a step whose plan would "
                             "exceed --memory-budget runs in 'resend' (default: %(default)s)")
    parser.add_argument("--block", type=int, default=128, help="shard block in tokens: CA-task cuts are multiples "
                        "of it (default: %(default)s, the GPU flash kernels' tile)")
    parser.add_argument("--time-model", metavar="FILE.json", help="constants from `distca-hf profile` (default: the "
                        "planner's built-in CUDA model, an H100 measured, carried to --hidden/--heads/--kv-heads)")
    parser.add_argument("--bytes-per-s", type=float, help="network bandwidth per rank in bytes per second "
                        "(default: the time model's)")
    parser.add_argument("--hidden-comm-fraction", type=float, default=0.0,
                        help="share of every method's communication the overlap hides, 0..1 (default 0: none)")
    parser.add_argument("--auto-planner", choices=list(AUTO_PLANNERS), help="what --tolerance auto plans with: "
                        "'descent' (the planner's; the default) or 'tolerances' (the one before it, to compare); "
                        "only with --tolerance auto")
    parser.add_argument("--wlb-threshold", type=int, help="WLB-LLM packing queues documents longer than this "
                        "(tokens; default tokens-per-rank / 2)")
    add_mixed_arguments(parser)
    pipeline = parser.add_argument_group(
        "pipeline parallelism", "model one training step of a non-interleaved 1F1B pipeline (JSON key 'pipeline'): "
        "stock 1F1B with colocated packing, with micro-batches balanced for attention, with CAD inside each "
        "stage (pipeline_schedule '1f1b'), and CAD across stages (pipeline_schedule 'cad_1f1b': lockstep 1F1B "
        "whose bubbles serve CA-tasks). --tokens-per-rank is then the tokens of one micro-batch row")
    pipeline.add_argument("--pipeline-parallel", type=int, metavar="P",
                          help="pipeline stages; --ranks is the total and must be divisible by P (N / P "
                               "data-parallel pipelines). Given alone (or P = 1) it still adds the model")
    pipeline.add_argument("--micro-batches", type=int, metavar="M",
                          help="micro-batches per step, one row of --tokens-per-rank tokens per data-parallel "
                               "pipeline each (default: 2 P). M < P is modelled as a GPipe-like fill (every "
                               "forward before the first backward on the first stages); torch's Schedule1F1B "
                               "refuses it. Given without --pipeline-parallel it adds the model with P = 1")
    pipeline.add_argument("--layers", type=int,
                          help=f"decoder layers, a multiple of P (default: {DEFAULT_LAYERS}, Llama-3-8B); only with "
                               "the pipeline model")


def build_parser() -> argparse.ArgumentParser:
    """The ``distca-hf simulate`` argument parser."""
    parser = argparse.ArgumentParser(prog="distca-hf simulate", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    return run_cli(parser.parse_args(argv), parser)


def run_cli(args, parser) -> int:
    if not hasattr(args, "memory_budget"):  # (absent unless given: --backward resend refuses a given one)
        args.memory_budget = SETTINGS["memory_budget"].default
    elif args.backward == "resend":  # (it was ignored: resend mode keeps nothing on servers to bound)
        parser.error(f"--memory-budget {args.memory_budget} bounds what servers keep for backward in saved mode; "
                     "--backward resend keeps nothing: drop one of them")
    if args.seed < 0:
        parser.error(f"--seed must be >= 0, got {args.seed}")
    if args.layers is not None and args.layers < 1:
        parser.error(f"--layers must be >= 1, got {args.layers}")
    if args.heads >= 1 and args.kv_heads >= 1 and not args.heads % args.kv_heads and args.hidden % args.heads:
        parser.error(f"--hidden ({args.hidden}) must be a multiple of --heads ({args.heads}): head dim = hidden / heads")
    for name in ("ranks", "tokens_per_rank", "batches"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0.0 <= args.hidden_comm_fraction <= 1.0:
        parser.error(f"--hidden-comm-fraction must be between 0 and 1, got {args.hidden_comm_fraction}")
    if args.wlb_threshold is not None and not 1 <= args.wlb_threshold <= args.tokens_per_rank:
        parser.error(f"--wlb-threshold must be between 1 and --tokens-per-rank ({args.tokens_per_rank}), "
                     f"got {args.wlb_threshold}")
    problem = batch_tokens_problem(args.ranks, args.tokens_per_rank, ("--ranks", "--tokens-per-rank"))
    if problem:
        parser.error(problem)
    if args.plot is not None:
        problem = output_path_problem("--plot", args.plot, suffixes=PLOT_SUFFIXES)
        if problem:
            parser.error(problem)
        if importlib.util.find_spec("matplotlib") is None:  # checked before the simulation, not after it
            parser.error("--plot needs matplotlib, which is not installed: pip install matplotlib (the 'plot' extra)")
    pipelined, stages, micro_batches, layers = pipeline_flags(args, parser, DEFAULT_LAYERS)
    problem = mixed_flags_problem(args.sliding_window, args.sliding_fraction, pipelined)
    if problem:
        parser.error(problem)
    problem = draws_problem(args.batches, micro_batches if pipelined else None, ("--batches", "--micro-batches"))
    if problem:
        parser.error(problem)
    if args.auto_planner is not None and args.tolerance != "auto":
        parser.error(f"--auto-planner {args.auto_planner} needs --tolerance auto (got {args.tolerance}): a number "
                     "plans that carving, whatever the auto planner")
    if args.auto_planner == "tolerances" and pipelined:  # (the pipeline model kept planning with the descent)
        parser.error("--auto-planner tolerances is read by the layer model only; the pipeline model's CAD methods "
                     "plan with the descent: leave --auto-planner out with --pipeline-parallel")
    args.auto_planner = args.auto_planner or "descent"
    if kv_cap_pairing_problem(args.kv_cap, args.tolerance):  # the settings' rule, in the flags' names
        parser.error(f"--kv-cap {args.kv_cap} needs --tolerance auto (got {args.tolerance}): only planning by "
                     "time caps K/V")
    try:
        lengths = load_lengths(args.lengths)
        token_bytes = TokenBytes.for_model(args.hidden, args.heads, args.kv_heads)
        config = PlannerConfig(tolerance=args.tolerance, block=args.block, token_bytes=token_bytes,
                               backward=args.backward, memory_budget=args.memory_budget, key_split=True,
                               kv_cap=args.kv_cap, kv_relays=args.kv_relays)
        # the planner's built-in CUDA model, carried to this shape (bf16), unless a profile is given
        time_model = time_model_flag(args.time_model, parser, args) if args.time_model else \
            default_time_model("cuda", token_bytes, 2)
        if args.bytes_per_s is not None:
            time_model = dataclasses.replace(time_model, bytes_per_s=args.bytes_per_s)
    except ValueError as e:
        message = str(e).replace("TimeModel.bytes_per_s", "--bytes-per-s")
        for name in ("hidden", "heads", "kv_heads", "block", "backward", "memory_budget", "kv_cap", "kv_relays",
                     "tolerance"):
            if message.startswith(f"{name} "):  # TokenBytes.for_model's and PlannerConfig's names: the flags'
                message = "--" + name.replace("_", "-") + message[len(name):]
        message = message.replace(" or None (by device)", "")  # (the setting's None; --block takes a number)
        parser.error(message.replace("multiple of kv_heads", "multiple of --kv-heads"))
    batch = args.ranks // (stages if pipelined else 1) * args.tokens_per_rank
    problem = span_problem(lengths, batch, args.tokens_per_rank)
    if problem:
        parser.error(f"--ranks {args.ranks} x --tokens-per-rank {args.tokens_per_rank}: {problem}")
    longer = int((lengths > batch).sum())
    if longer:  # (said nowhere before)
        what = ("micro-batch", "--ranks / --pipeline-parallel x") if pipelined else ("batch", "--ranks x")
        print(f"distca-hf simulate: {longer} of the {lengths.size} lengths are longer than a {what[0]} ({batch} tokens "
              f"= {what[1]} --tokens-per-rank): drawn, such a document is cut where the batch is full", file=sys.stderr)
    options = {"hidden_comm_fraction": args.hidden_comm_fraction, "heads": args.heads, "kv_heads": args.kv_heads,
               "wlb_threshold": args.wlb_threshold, "auto_planner": args.auto_planner,
               "sliding_window": args.sliding_window,
               "sliding_fraction": args.sliding_fraction or DEFAULT_SLIDING_FRACTION}  # (0 was refused)
    result = simulate(lengths, args.ranks, args.tokens_per_rank, args.batches, args.seed, config, time_model,
                      keep_first=bool(args.plot), **options)
    if args.plot:
        from .simulate_plot import plot_simulation  # matplotlib, only when asked for

        plot_simulation(args.plot, lengths, args, config, time_model, result,
                        {k: v for k, v in options.items() if not k.startswith("sliding_")})  # (the full layers')
    public = {k: v for k, v in result.items() if not k.startswith("_")}
    table = format_table(public)
    if "mixed_layers" in public:
        table += "\n\n" + format_mixed_table(public["mixed_layers"])
    if pipelined:
        public["pipeline"] = simulate_pipeline(
            lengths, args.ranks, args.tokens_per_rank, stages=stages, micro_batches=micro_batches,
            batches=args.batches, seed=args.seed, config=config, time_model=time_model,
            hidden_comm_fraction=args.hidden_comm_fraction, layers=layers, hidden=args.hidden)
        table += "\n\n" + format_pipeline_table(public["pipeline"])
    print(json.dumps(public) if args.json else table)
    if args.plot and not args.json:
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0
