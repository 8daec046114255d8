"""What would K/V relays give? The same plans re-timed with relayed K/V bytes (``planning/relay.py``).

For each bench-sim row below, ``distca-hf simulate``'s batches are drawn (same seed) and planned as
the simulator plans them (tolerance ``auto``, block 128, the ``memory_budget`` default, key-split
tiles, the built-in H100 model); each plan's predicted layer (slowest rank, forward + backward) is
then computed with direct K/V sends (``rank_time.step_seconds``) and with relays at several fanouts
(``relay.relay_step_seconds``: relayed bytes, plus ``collective_s`` per extra exchange round; ``fF``:
fanout F, ``/h1``: the holder sends each range once) and with relays placed by time
(``relay.relay_where_it_helps``: per holder and document, direct or a tree of fanout 1, 2 or 4 whose
least-loaded members forward, where the predicted layer does not get slower). ``replanned``: the
best of today's plan and plans made as if bytes were ``CHEAPER`` times cheaper (so they fan long
documents out further), each with relays placed by time and timed with the true model: a crude
stand-in for a planner that prices a new server at the relay's cost (what ``kv_relays="auto"`` now
plans: ``planner.RELAY_BYTE_DISCOUNTS``; the plans here are made with ``kv_relays="off"``). The
speedups divide the simulator's best baseline (``speedup_vs_best_baseline``'s, same batches) by the
mean layer. Plans are chosen under direct bytes: a planner that priced relays would fan a long
document out further, so the relay column is what relays give today's plans, not a bound.

Pipelines: ``simulate --pipeline-parallel`` plans ticks with relays itself (``--kv-relays off`` beside
``auto`` compares them; the what-if that re-timed them here is gone).

    python examples/relay_whatif.py [--data ../shared/data] [--batches 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

import numpy as np

from distca_hf.planning import kv_transfers, step_seconds
from distca_hf.planning.cost import H100_MEASURED
from distca_hf.planning.relay import relay_step_seconds, relay_where_it_helps
from distca_hf.tools.simulate import (default_planner_config, distca_plan, draw_batch, load_lengths, pack_pieces,
                                      simulate)
from distca_hf.tools.cli import help_description

HERE = Path(__file__).resolve().parent
# (sample, ranks, tokens per rank, hidden communication fraction)
ROWS = [("wlbllm", 512, 524288, 0.0), ("prolong", 8, 32768, 0.5), ("prolong", 64, 32768, 0.0),
        ("prolong", 64, 131072, 0.0), ("wlbllm", 64, 32768, 0.0), ("wlbllm", 64, 524288, 0.0)]
CHEAPER = (2.0, 4.0, 8.0)  # "replanned": bytes_per_s multiplied by these when planning
FANOUTS = [(math.inf, None), (4, None), (2, None), (1, None), (2, 1)]  # (fanout, holder_fanout)


def _label(fanout, holder_fanout) -> str:
    if fanout == math.inf:
        return "direct"
    return f"f{fanout}" + ("" if holder_fanout is None else f"/h{holder_fanout}")


def bench_rows(data: Path, batches: int) -> None:
    heads = [_label(*f) for f in FANOUTS] + ["placed", "replanned direct", "replanned"]
    print("| row | hidden | best baseline ms | " + " | ".join(f"{h} layer ms (rounds)" for h in heads) + " | "
          + " | ".join(f"speedup {h}" for h in heads) + " |")
    print("| --- " * (3 + 2 * len(heads)) + "|")
    for sample, ranks, tokens, hidden in ROWS:
        lengths = load_lengths(data / f"doc_lengths_{sample}.json")
        config = dataclasses.replace(default_planner_config(), kv_relays="off")  # direct plans, re-timed here
        result = simulate(lengths, ranks, tokens, batches, seed=0, config=config, hidden_comm_fraction=hidden)
        best = result[result["best_baseline"]]["step_time_s"]
        planning = dataclasses.replace(config, time_model=H100_MEASURED, exposed_comm=1.0 - hidden)
        rng = np.random.default_rng(0)
        drawn = [draw_batch(lengths, ranks * tokens, rng) for _ in range(batches)]
        layer = {h: [] for h in heads}
        rounds = {h: [] for h in heads}
        for docs in drawn:
            pieces = pack_pieces(docs, ranks, tokens)
            plan = distca_plan(pieces, config, H100_MEASURED, hidden)
            transfers = kv_transfers(plan, pieces)
            for (fanout, holder_fanout), h in zip(FANOUTS, heads):
                seconds, r = relay_step_seconds(plan, pieces, planning, fanout=fanout, holder_fanout=holder_fanout,
                                                transfers=transfers)
                layer[h].append(seconds)
                rounds[h].append(r)
            placed = relay_where_it_helps(plan, pieces, planning, transfers=transfers)
            seconds, r = relay_step_seconds(plan, pieces, planning, sends=placed)
            layer["placed"].append(seconds)
            rounds["placed"].append(r)
            # plans that fan out further (planned as if bytes were CHEAPER times cheaper), relays placed by time,
            # timed with the true model: the best of them (today's plan included)
            best_s, best_r = seconds, r
            best_direct = layer["direct"][-1]  # the same plans with direct sends: what re-planning alone gives
            for factor in CHEAPER:
                cheap = dataclasses.replace(H100_MEASURED, bytes_per_s=H100_MEASURED.bytes_per_s * factor)
                other = distca_plan(pieces, config, cheap, hidden)
                other_transfers = kv_transfers(other, pieces)
                sends = relay_where_it_helps(other, pieces, planning, transfers=other_transfers)
                seconds, r = relay_step_seconds(other, pieces, planning, sends=sends)
                if seconds < best_s:
                    best_s, best_r = seconds, r
                best_direct = min(best_direct, step_seconds(other, pieces, planning, other_transfers))
            layer["replanned direct"].append(best_direct)
            rounds["replanned direct"].append(1)
            layer["replanned"].append(best_s)
            rounds["replanned"].append(best_r)
            assert math.isclose(layer["direct"][-1], step_seconds(plan, pieces, planning, transfers), rel_tol=1e-12)
        mean = {h: float(np.mean(v)) for h, v in layer.items()}
        assert math.isclose(mean["direct"], result["distca"]["step_time_s"], rel_tol=1e-9), \
            (mean["direct"], result["distca"]["step_time_s"])
        print(f"| {sample} {ranks} x {tokens // 1024}k | {100 * hidden:.0f}% | {1e3 * best:.0f} ({result['best_baseline']}) | "
              + " | ".join(f"{1e3 * mean[h]:.0f} ({max(rounds[h])})" for h in heads) + " | "
              + " | ".join(f"{best / mean[h]:.2f}x" for h in heads) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=help_description(__doc__))
    parser.add_argument("--data", type=Path, default=HERE.parent.parent / "shared" / "data")
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--rows", default=None, help="comma-separated row indexes of ROWS (default: all)")
    args = parser.parse_args()
    global ROWS
    if args.rows:
        ROWS = [ROWS[int(i)] for i in args.rows.split(",")]
    bench_rows(args.data, args.batches)


if __name__ == "__main__":
    main()
