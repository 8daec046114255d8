"""Plan time of ``tolerance="auto"`` beside the fixed tolerance 0.02, ``auto`` without a memory
budget, ``auto`` without K/V relays (``kv_relays="off"``) and ``auto`` with its candidates planned on
different ranks (``runtime.shared_planning``: the slowest candidate, each planned alone, as a group of
at least ``auto_candidates`` ranks plans them), side by side in one process.

Batches are drawn and packed the way ``distca-hf simulate`` does (``draw_batch``, ``pack_pieces``)
from the shared length samples; every batch is planned with both configs, alternating, ``--repeats``
times, and the table gives the median wall time of each (ms), their ratio, and how often ``auto``
chose each candidate. Planner: the simulator's defaults (block 128, the ``memory_budget`` setting's
default, key-split tiles, the built-in H100 time model, nothing hidden). Timings depend on the machine and on what else runs on it; the
interpreter's objects are frozen out of the garbage collector first (``gc.freeze``).

    python examples/plan_time.py [--data ../shared/data] [--batches 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

from distca_hf.planning import AUTO_TOLERANCES, PlannerConfig, auto_candidates, colocated_plan, plan_candidate, plan_tasks
from distca_hf.tools.simulate import default_planner_config, draw_batch, load_lengths, pack_pieces
from distca_hf.tools.cli import help_description

HERE = Path(__file__).resolve().parent
SHAPES = [(64, 65536, 5.0), (512, 131072, 100.0)]  # (ranks, tokens per rank, plan-time budget in ms)


def _same(a, b) -> bool:
    return all(np.array_equal(getattr(a, n), getattr(b, n)) for n in ("source", "server", "doc", "q_start", "q_end"))


def _chosen(plan, pieces, config: PlannerConfig) -> str:
    """Which candidate ``auto``'s plan is (a label for the table)."""
    if _same(plan, colocated_plan(pieces, config.servers, window=config.window)):
        return "colocated"
    for tolerance in AUTO_TOLERANCES:
        if _same(plan, plan_tasks(pieces, dataclasses.replace(config, tolerance=tolerance))):
            return f"{tolerance:g}"
    return "other"


def measure(lengths: np.ndarray, ranks: int, tokens: int, batches: int, repeats: int, seed: int = 1):
    """``(auto ms, fixed ms, auto without a memory budget ms, auto without relays ms, auto with its candidates
    on different ranks ms, chosen)``: medians over every batch and repeat, and a count of the candidates
    ``auto`` chose."""
    rng = np.random.default_rng(seed)
    auto = dataclasses.replace(default_planner_config(), tolerance="auto")
    configs = {"auto": auto, "fixed": dataclasses.replace(auto, tolerance=AUTO_TOLERANCES[0]),
               "unbounded": dataclasses.replace(auto, memory_budget=None),
               "no relays": dataclasses.replace(auto, kv_relays="off"), "shared": auto}
    times = {name: [] for name in configs}
    chosen = Counter()
    for _ in range(batches):
        pieces = pack_pieces(draw_batch(lengths, ranks * tokens, rng), ranks, tokens)
        for i in range(repeats):
            # rotate which goes first, so none always meets a warm (or a cold) cache
            order = list(configs.items())
            for name, config in order[i % len(order):] + order[: i % len(order)]:
                if name == "shared":
                    times[name].append(_slowest_candidate_ms(pieces, config))
                    continue
                start = time.perf_counter()
                plan = plan_tasks(pieces, config)
                times[name].append((time.perf_counter() - start) * 1e3)
                if name == "auto" and i == 0:
                    chosen[_chosen(plan, pieces, auto)] += 1
    return *(statistics.median(times[name]) for name in configs), chosen


def _slowest_candidate_ms(pieces, config: PlannerConfig) -> float:
    """The plan time of ``auto`` with its candidates on different ranks (``runtime.shared_planning``, a
    group of at least ``auto_candidates`` ranks): each candidate planned alone, as its rank plans it
    (its own ``DescentStart``), and the slowest one's ms; the all-reduce of their seconds and the
    broadcast of the chosen plan are not counted."""
    slowest = 0.0
    for index in range(auto_candidates(pieces, config)):
        start = time.perf_counter()
        plan_candidate(pieces, config, index)
        slowest = max(slowest, (time.perf_counter() - start) * 1e3)
    return slowest


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=help_description(__doc__))
    parser.add_argument("--data", type=Path, default=HERE.parent.parent / "shared" / "data")
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="times each batch is planned with each config")
    args = parser.parse_args(argv)
    if not (args.data / "doc_lengths_prolong.json").exists():
        parser.error(f"--data: {args.data} has no doc_lengths_*.json (the shared length samples)")
    # The simulator's module imports torch: a full collection of those objects (tens of ms) would
    # land in whichever plan happens to trigger it. Freeze them so plan times are the planner's own.
    gc.collect()
    gc.freeze()
    print("| sample | ranks x tokens/rank | auto ms (median) | fixed 0.02 ms (median) | auto / fixed | auto without "
          "a memory budget ms | auto without K/V relays ms | auto, candidates on different ranks ms | budget ms | "
          "auto chose |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for name in ("prolong", "wlbllm"):
        lengths = load_lengths(args.data / f"doc_lengths_{name}.json")
        for ranks, tokens, budget in SHAPES:
            auto_ms, fixed_ms, unbounded_ms, direct_ms, shared_ms, chosen = measure(lengths, ranks, tokens,
                                                                                    args.batches, args.repeats)
            picks = ", ".join(f"{k} x{v}" for k, v in sorted(chosen.items()))
            print(f"| {name} | {ranks} x {tokens // 1024}k | {auto_ms:.1f} | {fixed_ms:.1f} | {auto_ms / fixed_ms:.2f} "
                  f"| {unbounded_ms:.1f} | {direct_ms:.1f} | {shared_ms:.1f} | {budget:g} | {picks} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
