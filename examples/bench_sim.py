"""The simulator table of docs/planner.md (``make bench-sim``): both shared length samples at 8, 64 and 512
ranks and 32k, 128k and 512k tokens per rank; every method timed with the same time model and its
communication, with none of it hidden and with half hidden (what the planner assumes ``wave`` and
``pingpong`` hide, ``runtime.forward.EXPOSED_COMM``), against the baselines at the smallest degree that
holds the longest document and tuned for speed (every such degree), and distca with the fixed tolerance 0.02 beside the
default ``auto``; every distca cell twice, new / old: ``auto`` as it plans now (the descent, K/V relays
placed by time) and as it planned before it (``auto_planner="tolerances"``: colocated and the carvings
of 0.02, 0.1, 0.3), the new one also with ``kv_relays="off"``,
on the same batches, with the worst attention imbalance, the memory imbalance, the batches planned
in ``resend`` mode and the servers per long document (one longer than a rank's tokens); the K/V each
server receives (distca against CP of the documents that span ranks); and the planner's speed
targets (64 x 64k, 512 x 128k and 512 x 512k). ``--untuned`` prints the grid at 64 and 512 ranks on
length samples the planner was not tuned on (``untuned_samples``). All through
``distca_hf.tools.simulate.simulate`` with its defaults (tolerance ``auto``, block 128, Llama-3-8B
bytes and heads, the planner's built-in H100 time model, 50 GB/s per rank).

    python examples/bench_sim.py [--data ../shared/data] [--batches 6] [--update-docs] [--untuned]

``--untuned`` generates its samples (seeded) and needs no ``--data``.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import time
from pathlib import Path

from distca_hf.planning import PlannerConfig
from distca_hf.tools.cli import help_description
from distca_hf.tools.simulate import LABELS, default_planner_config, load_lengths, simulate

import numpy as np

HERE = Path(__file__).resolve().parent
GRID = [(r, t) for r in (8, 64, 512) for t in (32768, 131072, 524288)]
TARGETS = [(64, 65536, 5.0), (512, 131072, 100.0), (512, 524288, 400.0)]  # (ranks, tokens per rank, plan-time target in ms)
HIDDEN = 0.5  # the share of communication the second column hides
SHORT = {"colocated": "colocated", "wlb": "WLB-LLM", "per_doc_cp": "CP", "ulysses": "Ulysses"}


def _k(tokens: int) -> str:
    return f"{tokens // 1024}k"


def _name(method: str, degree: int | None) -> str:
    if degree == 1:  # CP and Ulysses of one rank: data parallel, whole documents per rank
        return "DP"
    return SHORT[method] + (f" ({degree})" if degree else "")


def _best(r: dict) -> str:
    best = r["best_baseline"]
    return _name(best, r[best].get("degree") if best in ("per_doc_cp", "ulysses") else None)


def _tuned(r: dict, hidden: dict) -> str:
    """distca against the baselines tuned for speed (every degree), nothing and half hidden, each
    named (hiding communication may make another method or degree the fastest)."""
    name = lambda x: _name(x["tuned_baseline"]["method"], x["tuned_baseline"]["degree"])
    return (f"{r['speedup_vs_tuned_baseline']:.2f}x vs {name(r)} / "
            f"{hidden['speedup_vs_tuned_baseline']:.2f}x vs {name(hidden)}")


def _ms(r: dict, method: str) -> str:
    m = r[method]
    return f"{1e3 * m['step_time_s']:.0f} ({1e3 * m['exposed_comm_s']:.0f})"


def untuned_samples(seed: int = 7) -> dict:
    """Length samples the planner was not tuned on (seeded): lognormal (median 2k tokens), a Pareto
    tail (alpha 1.1 from 512 tokens, capped at 1M), and one 1M-token document among 4096 short ones."""
    rng = np.random.default_rng(seed)
    lognormal = np.clip(rng.lognormal(np.log(2048), 1.4, 20000), 16, 1 << 20).astype(np.int64)
    pareto = np.clip(512 * (1 + rng.pareto(1.1, 20000)), 16, 1 << 20).astype(np.int64)
    short = np.clip(rng.lognormal(np.log(1024), 0.8, 4096), 16, 65536).astype(np.int64)
    return {"lognormal": lognormal, "pareto": pareto, "1M+short": np.concatenate(([1 << 20], short))}


def run(data: Path | None, batches: int, untuned: bool = False):
    """The tables (``data``: the folder of the shared length samples; not read with ``untuned``,
    whose samples are generated)."""
    samples = untuned_samples() if untuned else {name: load_lengths(data / f"doc_lengths_{name}.json")
                                                 for name in ("prolong", "wlbllm")}
    config = default_planner_config()
    fixed = PlannerConfig(tolerance=0.02, block=128, memory_budget=config.memory_budget)
    no_relays = dataclasses.replace(config, kv_relays="off")
    grid_rows, memory_rows, target_rows = [], [], []
    model = None
    grid = GRID
    if untuned:
        grid = [(r, t) for r in (64, 512) for t in (32768, 131072)]
    for name, lengths in samples.items():
        for ranks, tokens in grid:
            start = time.perf_counter()
            r = simulate(lengths, ranks, tokens, batches, seed=0, config=config)
            hidden = simulate(lengths, ranks, tokens, batches, seed=0, config=config, hidden_comm_fraction=HIDDEN)
            old = simulate(lengths, ranks, tokens, batches, seed=0, config=config, auto_planner="tolerances")
            old_hidden = simulate(lengths, ranks, tokens, batches, seed=0, config=config, hidden_comm_fraction=HIDDEN,
                                  auto_planner="tolerances")
            tight = simulate(lengths, ranks, tokens, batches, seed=0, config=fixed)
            direct = simulate(lengths, ranks, tokens, batches, seed=0, config=no_relays)
            direct_hidden = simulate(lengths, ranks, tokens, batches, seed=0, config=no_relays,
                                     hidden_comm_fraction=HIDDEN)
            model = r["time_model"]
            d, o = r["distca"], old["distca"]
            sp = r["ulysses"]["degree"]
            fan, old_fan = d["servers_per_long_document"], o["servers_per_long_document"]
            grid_rows.append(
                f"| {name} | {ranks} x {_k(tokens)} | **{r['speedup_vs_best_baseline']:.2f}x** / "
                f"{old['speedup_vs_best_baseline']:.2f}x vs {_best(r)} | "
                f"{hidden['speedup_vs_best_baseline']:.2f}x / {old_hidden['speedup_vs_best_baseline']:.2f}x vs "
                f"{_best(hidden)} | {direct['speedup_vs_best_baseline']:.2f}x / "
                f"{direct_hidden['speedup_vs_best_baseline']:.2f}x | "
                f"{100 * d['relayed_batch_fraction']:.0f}% ({d['kv_exchange_rounds']['max']}) | "
                f"{_tuned(r, hidden)} | {tight['speedup_vs_best_baseline']:.2f}x | "
                f"{_ms(r, 'distca')} / {_ms(old, 'distca')} | {_ms(r, r['best_baseline'])} | "
                f"{r['per_doc_cp']['degree']} / {sp if sp else '-'} | {r['colocated']['attn_imbalance']:.2f} | "
                f"{d['worst_attn_imbalance']:.2f} / {o['worst_attn_imbalance']:.2f} | "
                f"{d['memory_imbalance']:.2f} / {o['memory_imbalance']:.2f} | "
                f"{100 * d['resend_batch_fraction']:.0f}% / {100 * o['resend_batch_fraction']:.0f}% | "
                f"{fan['mean']:.1f} ({fan['max']:.0f}) / {old_fan['mean']:.1f} ({old_fan['max']:.0f}) | "
                f"{d['comm_bytes_per_layer'] / 1e9:.1f} / {o['comm_bytes_per_layer'] / 1e9:.1f} | "
                f"{d['plan_ms_median']:.1f} / {o['plan_ms_median']:.1f} |"
            )
            dca_kv, cp_kv = d["kv_received_tokens_per_layer"], r["per_doc_cp"]["kv_received_tokens_per_layer"]
            gathered = r["per_doc_cp"]["gathered_kv_tokens_per_layer"]["max"]
            memory_rows.append(
                f"| {name} | {ranks} x {_k(tokens)} | {dca_kv['max'] / 1e3:.1f}k | {dca_kv['mean'] / 1e3:.1f}k | "
                f"{cp_kv['max'] / 1e3:.1f}k | {cp_kv['mean'] / 1e3:.1f}k | {dca_kv['max'] / max(cp_kv['max'], 1):.2f} | "
                f"{r['per_doc_cp']['degree']} | {gathered / 1e3:.1f}k | "
                f"{dca_kv['max'] / gathered if gathered else float('nan'):.2f} |"
            )
            print(f"{name} {ranks}x{_k(tokens)} done in {time.perf_counter() - start:.0f}s", file=sys.stderr)
        for ranks, tokens, target in ([] if untuned else TARGETS):
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
        "Each distca cell: **new** (tolerance auto, the descent, K/V relays by time) / old (auto before the "
        "descent: colocated and the carvings of 0.02, 0.1, 0.3, no relays), same batches; the third and fourth "
        "columns: the new planner with kv_relays off, and how many batches the new one relays.",
        "",
        "| sample | ranks x tokens/rank | distca vs best baseline, no comm hidden (new / old) | same, "
        f"{100 * HIDDEN:.0f}% hidden | new without K/V relays (kv_relays off), no comm / {100 * HIDDEN:.0f}% hidden | "
        "batches relayed (most K/V rounds) | "
        f"vs the baselines tuned for speed, no comm / {100 * HIDDEN:.0f}% hidden | "
        "tolerance 0.02, no comm hidden | distca layer ms (exposed comm) | "
        "best baseline layer ms (comm) | CP / Ulysses degree | imbalance colocated | distca worst attention "
        "imbalance | distca memory imbalance | batches in resend | servers per long document, mean (max) | "
        "distca GB/layer | plan ms |",
        "| --- | --- | --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: |",
        *grid_rows,
    ])
    memory = "\n".join([
        "| sample | ranks x tokens/rank | distca worst server | distca mean | per-doc CP worst rank | "
        "per-doc CP mean | worst vs per-doc CP | CP baseline degree | CP baseline worst rank (its group gathered) | "
        "worst vs CP baseline |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
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
            "that document; the CP baseline timed above: every rank gathers its group's K/V, nan at degree 1, "
            f"where no document spans ranks):\n\n{memory}\n\nPlanner targets ({max(batches, 8)} batches each, seed 1, this machine, "
            "its 2 cores shared; tolerance 0.02: imbalance <= 1.02 mean and 1.05 worst within the plan-time target; "
            f"auto: the same time target):\n\n{targets}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=help_description(__doc__))
    parser.add_argument("--data", type=Path, default=HERE.parent.parent / "shared" / "data")
    parser.add_argument("--batches", type=int, default=6)
    parser.add_argument("--update-docs", action="store_true",
                        help="replace the table between the bench-sim markers of docs/planner.md")
    parser.add_argument("--untuned", action="store_true", help="print the grid on length samples the planner was "
                        "not tuned on (lognormal, Pareto, one 1M-token document among short ones), 64 and 512 ranks")
    args = parser.parse_args(argv)
    if not args.untuned and not (args.data / "doc_lengths_prolong.json").exists():  # --untuned generates its own
        parser.error(f"--data: {args.data} has no doc_lengths_*.json (the shared length samples)")
    table = run(None if args.untuned else args.data, args.batches, untuned=args.untuned)
    print(table)
    if args.untuned:
        return 0
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
