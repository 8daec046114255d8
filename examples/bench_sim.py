"""The simulator table of docs/planner.md (``make bench-sim``): both shared length samples at 8, 64 and 512
ranks and 32k, 128k and 512k tokens per rank; every method timed with the same time model and its
communication, with none of it hidden and with half hidden (what the planner assumes ``wave`` and
``pingpong`` hide, ``runtime.forward.EXPOSED_COMM``), and distca with the fixed tolerance 0.02 beside the
default ``auto``; the K/V each server receives (distca against CP of the documents that span ranks);
and the planner's speed targets (64 x 64k and 512 x 128k). All through
``distca_hf.tools.simulate.simulate`` with its defaults (tolerance ``auto``, block 128, Llama-3-8B
bytes and heads, the planner's built-in H100 time model, 50 GB/s per rank).

    python examples/bench_sim.py [--data ../shared/data] [--batches 6] [--update-docs]
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from distca_hf.config import SETTINGS
from distca_hf.planning import PlannerConfig
from distca_hf.tools.simulate import LABELS, load_lengths, simulate

HERE = Path(__file__).resolve().parent
GRID = [(r, t) for r in (8, 64, 512) for t in (32768, 131072, 524288)]
TARGETS = [(64, 65536, 5.0), (512, 131072, 100.0)]  # (ranks, tokens per rank, plan-time target in ms)
HIDDEN = 0.5  # the share of communication the second column hides
SHORT = {"colocated": "colocated", "wlb": "WLB-LLM", "per_doc_cp": "CP", "ulysses": "Ulysses"}


def _k(tokens: int) -> str:
    return f"{tokens // 1024}k"


def _best(r: dict) -> str:
    best = r["best_baseline"]
    degree = r[best].get("degree") if best in ("per_doc_cp", "ulysses") else None
    if degree == 1:  # CP and Ulysses of one rank: data parallel, documents cut where ranks end
        return "DP"
    return SHORT[best] + (f" ({degree})" if degree else "")


def _ms(r: dict, method: str) -> str:
    m = r[method]
    return f"{1e3 * m['step_time_s']:.0f} ({1e3 * m['exposed_comm_s']:.0f})"


def run(data: Path, batches: int):
    samples = {name: load_lengths(data / f"doc_lengths_{name}.json") for name in ("prolong", "wlbllm")}
    budget = SETTINGS["memory_budget"].default
    config = PlannerConfig(tolerance=SETTINGS["tolerance"].default, block=128, memory_budget=budget)
    fixed = PlannerConfig(tolerance=0.02, block=128, memory_budget=budget)
    grid_rows, memory_rows, target_rows = [], [], []
    model = None
    for name, lengths in samples.items():
        for ranks, tokens in GRID:
            start = time.perf_counter()
            r = simulate(lengths, ranks, tokens, batches, seed=0, config=config)
            hidden = simulate(lengths, ranks, tokens, batches, seed=0, config=config, hidden_comm_fraction=HIDDEN)
            tight = simulate(lengths, ranks, tokens, batches, seed=0, config=fixed)
            model = r["time_model"]
            d = r["distca"]
            sp = r["ulysses"]["degree"]
            shard = d["smallest_shard_tokens"]
            grid_rows.append(
                f"| {name} | {ranks} x {_k(tokens)} | **{r['speedup_vs_best_baseline']:.2f}x** vs {_best(r)} | "
                f"{hidden['speedup_vs_best_baseline']:.2f}x vs {_best(hidden)} | "
                f"{tight['speedup_vs_best_baseline']:.2f}x | {r['speedup_vs_colocated']:.2f}x | "
                f"{_ms(r, 'distca')} | {_ms(r, r['best_baseline'])} | {r['per_doc_cp']['degree']} / "
                f"{sp if sp else '-'} | {r['colocated']['attn_imbalance']:.2f} | {d['worst_attn_imbalance']:.3f} | "
                f"{d['memory_imbalance']:.2f} / {d['worst_memory_imbalance']:.2f} | "
                f"{r[r['best_baseline']]['memory_imbalance']:.2f} | {100 * d['resend_batch_fraction']:.0f}% | "
                f"{100 * d['moved_query_fraction']:.1f}% | {d['comm_bytes_per_layer'] / 1e9:.1f} | "
                f"{d['tasks_per_server']['max']:.0f} | {'-' if shard is None else shard} | {d['plan_ms_median']:.1f} |"
            )
            dca_kv, cp_kv = d["kv_received_tokens_per_layer"], r["per_doc_cp"]["kv_received_tokens_per_layer"]
            memory_rows.append(
                f"| {name} | {ranks} x {_k(tokens)} | {dca_kv['max'] / 1e3:.1f}k | {dca_kv['mean'] / 1e3:.1f}k | "
                f"{cp_kv['max'] / 1e3:.1f}k | {cp_kv['mean'] / 1e3:.1f}k | {dca_kv['max'] / max(cp_kv['max'], 1):.2f} |"
            )
            print(f"{name} {ranks}x{_k(tokens)} done in {time.perf_counter() - start:.0f}s", file=sys.stderr)
        for ranks, tokens, target in TARGETS:
            d = simulate(lengths, ranks, tokens, max(batches, 8), seed=1, config=fixed)["distca"]
            auto = simulate(lengths, ranks, tokens, max(batches, 8), seed=1, config=config)["distca"]
            ok = d["plan_ms_median"] <= target and d["attn_imbalance"] <= 1.02 and d["worst_attn_imbalance"] <= 1.05
            target_rows.append(
                f"| {name} | {ranks} x {_k(tokens)} | {d['attn_imbalance']:.3f} | {d['worst_attn_imbalance']:.3f} | "
                f"{d['plan_ms_median']:.1f} | {'met' if ok else 'MISSED'} | {auto['plan_ms_median']:.1f} | "
                f"{'met' if auto['plan_ms_median'] <= target else 'MISSED'} | {target:g} |"
            )
    grid = "\n".join([
        f"Time model: {model['source']}, {model['bytes_per_s'] / 1e9:g} GB/s per rank; layer = one layer forward + "
        f"backward on the slowest rank, ms (of it: exposed communication). Baselines: "
        f"{', '.join(LABELS[m] for m in SHORT)} "
        "(degree in brackets).",
        "",
        "| sample | ranks x tokens/rank | distca vs best baseline, no comm hidden | same, "
        f"{100 * HIDDEN:.0f}% hidden | same, tolerance 0.02 | distca vs colocated | distca layer ms (comm) | "
        "best baseline layer ms (comm) | CP / Ulysses degree | imbalance colocated | distca worst imbalance | "
        "distca memory imbalance (mean / worst) | best baseline memory imbalance | batches in resend | "
        "queries moved | distca GB/layer | tasks on busiest server | smallest moved shard | plan ms |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: |",
        *grid_rows,
    ])
    memory = "\n".join([
        "| sample | ranks x tokens/rank | distca worst server | distca mean | per-doc CP worst rank | "
        "per-doc CP mean | worst vs per-doc CP |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
        *memory_rows,
    ])
    targets = "\n".join([
        "| sample | ranks x tokens/rank | tolerance 0.02: imbalance mean | worst | plan ms (median) | balance and time "
        "| auto: plan ms (median) | time | target ms |",
        "| --- | --- | ---: | ---: | ---: | --- | ---: | --- | ---: |",
        *target_rows,
    ])
    return (f"{grid}\n\nK/V tokens received per layer (worst server or rank, and mean; averaged over batches; "
            "per-document CP of the documents that span ranks: every rank holding a piece gathers the rest of "
            f"that document):\n\n{memory}\n\nPlanner targets ({max(batches, 8)} batches each, seed 1, this machine, "
            "its 2 cores shared; tolerance 0.02: imbalance <= 1.02 mean and 1.05 worst within the plan-time target; "
            f"auto: the same time target):\n\n{targets}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=HERE.parent.parent / "shared" / "data")
    parser.add_argument("--batches", type=int, default=6)
    parser.add_argument("--update-docs", action="store_true",
                        help="replace the table between the bench-sim markers of docs/planner.md")
    args = parser.parse_args(argv)
    if not (args.data / "doc_lengths_prolong.json").exists():
        parser.error(f"--data: {args.data} has no doc_lengths_*.json (the shared length samples)")
    table = run(args.data, args.batches)
    print(table)
    if args.update_docs:
        page = HERE.parent / "docs" / "planner.md"
        text = page.read_text()
        pattern = re.compile(r"(<!-- bench-sim:start -->\n).*?(<!-- bench-sim:end -->)", re.S)
        if not pattern.search(text):
            parser.error(f"{page} lacks the <!-- bench-sim:start --> / <!-- bench-sim:end --> markers")
        page.write_text(pattern.sub(lambda m: m.group(1) + table + "\n" + m.group(2), text))
        print(f"updated {page}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
