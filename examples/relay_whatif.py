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

With ``--pipeline`` it also re-times ``simulate --pipeline-parallel`` (64 x 64k, P = 4, M = 8) with
every plan's loads relayed: ``planning.pipeline_cost`` looks ``plan_loads`` and ``loads_seconds`` up
in its own namespace, and this script (only) substitutes relayed ones there, adding ``collective_s``
(each part's share) per extra round to the loads of the last plan timed; ``replanned`` also
substitutes its ``plan_tasks`` (per plan, the fastest under relays placed by time of the planner's
plan and plans made with bytes ``CHEAPER`` times cheaper).

    python examples/relay_whatif.py [--data ../shared/data] [--batches 3] [--pipeline]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

import numpy as np

from distca_hf.planning import kv_transfers, step_seconds
from distca_hf.planning import pipeline_cost
from distca_hf.planning.cost import H100_MEASURED
from distca_hf.planning.relay import relay_plan_loads, relay_step_seconds, relay_where_it_helps
from distca_hf.tools.simulate import default_planner_config, distca_plan, draw_batch, load_lengths, pack_pieces, simulate, simulate_pipeline

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


def pipeline_rows(data: Path, batches: int) -> None:
    original = (pipeline_cost.plan_loads, pipeline_cost.loads_seconds, pipeline_cost.plan_tasks)
    last_rounds = [1]
    stages, ranks = 4, 64
    judge = dataclasses.replace(default_planner_config(), time_model=H100_MEASURED, exposed_comm=1.0)

    def relayed_plan_loads(plan, pieces, token_bytes, transfers=None, *, fanout):
        transfers = transfers if transfers is not None else kv_transfers(plan, pieces)
        sends = None
        if fanout == "placed":  # relays placed by the whole layer's model; a tick (all ranks) by attention only
            config = judge if pieces.num_ranks != ranks else pipeline_cost.attention_only(judge, ranks)
            sends = relay_where_it_helps(plan, pieces, dataclasses.replace(config, token_bytes=token_bytes),
                                         transfers=transfers)
        loads, rounds = relay_plan_loads(plan, pieces, token_bytes, fanout=fanout, transfers=transfers, sends=sends)
        last_rounds[0] = max(rounds, 1)
        return loads

    def replanned_plan_tasks(pieces, config):
        """The plan of ``config`` or of it with bytes ``CHEAPER`` times cheaper, whichever relays placed by
        time make fastest under ``config`` (a planner that prices a new server at the relay's cost, crudely)."""
        best = None
        for factor in (1.0, *CHEAPER):
            model = dataclasses.replace(config.time_model, bytes_per_s=config.time_model.bytes_per_s * factor)
            plan = original[2](pieces, dataclasses.replace(config, time_model=model))
            sends = relay_where_it_helps(plan, pieces, config)
            seconds = relay_step_seconds(plan, pieces, config, sends=sends)[0]
            if best is None or seconds < best[0]:
                best = (seconds, plan)
        return best[1]

    def relayed_loads_seconds(loads, time_model, exposed_comm, backward="saved", **kw):
        compute, exposed = original[1](loads, time_model, exposed_comm, backward, **kw)
        return compute, exposed + (last_rounds[0] - 1) * time_model.collective_s

    print("| sample | K/V sends | colocated_1f1b s | cad_per_stage s | cad_across_stages s | per stage / across | "
          "floor's bound |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for sample in ("prolong", "wlbllm"):
        lengths = load_lengths(data / f"doc_lengths_{sample}.json")
        for fanout in (math.inf, 2, "placed", "replanned"):
            if fanout != math.inf:
                relay = "placed" if fanout == "replanned" else fanout
                pipeline_cost.plan_loads = lambda *a, **k: relayed_plan_loads(*a, fanout=relay, **k)
                pipeline_cost.loads_seconds = relayed_loads_seconds
            if fanout == "replanned":
                pipeline_cost.plan_tasks = replanned_plan_tasks
            try:
                result = simulate_pipeline(lengths, ranks, 65536, stages=stages, micro_batches=8, batches=batches,
                                           seed=0, config=default_planner_config())
            finally:
                pipeline_cost.plan_loads, pipeline_cost.loads_seconds, pipeline_cost.plan_tasks = original
            step = result["step_time_s"]
            label = fanout if isinstance(fanout, str) else _label(fanout, None)
            # the floor counts bytes on the holders' own links (no relays): a bound for direct sends only
            bound = f"{result['speedup_bound_vs_cad_per_stage']:.2f}x" if fanout == math.inf else "-"
            print(f"| {sample} | {label} | {step['colocated_1f1b']:.3f} | {step['cad_per_stage']:.3f} | "
                  f"{step['cad_across_stages']:.3f} | {result['speedup_vs_cad_per_stage']:.2f}x | "
                  f"{bound} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=HERE.parent.parent / "shared" / "data")
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--pipeline", action="store_true", help="also the pipeline at 64 x 64k, P = 4, M = 8")
    parser.add_argument("--rows", default=None, help="comma-separated row indexes of ROWS (default: all)")
    args = parser.parse_args()
    global ROWS
    if args.rows:
        ROWS = [ROWS[int(i)] for i in args.rows.split(",")]
    bench_rows(args.data, args.batches)
    if args.pipeline:
        pipeline_rows(args.data, args.batches)


if __name__ == "__main__":
    main()
