"""The README's simulator table (``make bench-sim``): both shared length samples at 8, 64 and 512
ranks and 32k, 128k and 512k tokens per rank, the K/V each server receives (distca against
per-document CP), plus the planner's speed targets (64 x 64k and 512 x 128k), all through
``distca_hf.tools.simulate.simulate`` with its defaults (tolerance 0.02, block 128, Llama-3-8B bytes,
H100 FLOP time model).

    python examples/bench_sim.py [--data ../shared/data] [--batches 6] [--update-readme]
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from distca_hf.planning import PlannerConfig
from distca_hf.tools.simulate import load_lengths, simulate

HERE = Path(__file__).resolve().parent
GRID = [(r, t) for r in (8, 64, 512) for t in (32768, 131072, 524288)]
TARGETS = [(64, 65536, 5.0), (512, 131072, 100.0)]  # (ranks, tokens per rank, plan-time target in ms)


def _k(tokens: int) -> str:
    return f"{tokens // 1024}k"


def run(data: Path, batches: int):
    samples = {name: load_lengths(data / f"doc_lengths_{name}.json") for name in ("prolong", "wlbllm")}
    config = PlannerConfig(block=128)
    grid_rows, memory_rows, target_rows = [], [], []
    for name, lengths in samples.items():
        for ranks, tokens in GRID:
            start = time.perf_counter()
            r = simulate(lengths, ranks, tokens, batches, seed=0, config=config)
            d = r["distca"]
            grid_rows.append(
                f"| {name} | {ranks} x {_k(tokens)} | {r['colocated']['attn_imbalance']:.2f} | "
                f"{r['wlb']['attn_imbalance']:.2f} | {d['attn_imbalance']:.3f} | {d['worst_attn_imbalance']:.3f} | "
                f"{100 * d['moved_query_fraction']:.1f}% | {d['comm_bytes_per_layer'] / 1e9:.2f} | "
                f"{d['comm_bytes_per_layer'] / r['per_doc_cp']['comm_bytes_per_layer']:.4f} | "
                f"{d['plan_ms_median']:.1f} | {r['speedup_vs_colocated']:.2f}x |"
            )
            dca_kv, cp_kv = d["kv_received_tokens_per_layer"], r["per_doc_cp"]["kv_received_tokens_per_layer"]
            memory_rows.append(
                f"| {name} | {ranks} x {_k(tokens)} | {dca_kv['max'] / 1e3:.1f}k | {dca_kv['mean'] / 1e3:.1f}k | "
                f"{cp_kv['max'] / 1e3:.1f}k | {cp_kv['mean'] / 1e3:.1f}k | {dca_kv['max'] / max(cp_kv['max'], 1):.2f} |"
            )
            print(f"{name} {ranks}x{_k(tokens)} done in {time.perf_counter() - start:.0f}s", file=sys.stderr)
        for ranks, tokens, target in TARGETS:
            r = simulate(lengths, ranks, tokens, max(batches, 8), seed=1, config=config)
            d = r["distca"]
            ok = d["plan_ms_median"] <= target and d["attn_imbalance"] <= 1.02 and d["worst_attn_imbalance"] <= 1.05
            target_rows.append(
                f"| {name} | {ranks} x {_k(tokens)} | {d['attn_imbalance']:.3f} | {d['worst_attn_imbalance']:.3f} | "
                f"{d['plan_ms_median']:.1f} (target {target:g}) | {'met' if ok else 'MISSED'} |"
            )
    grid = "\n".join([
        "| sample | ranks x tokens/rank | imbalance colocated | imbalance WLB | distca mean | distca worst | "
        "queries moved | distca GB/layer | bytes vs per-doc CP | plan ms | est. speedup |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *grid_rows,
    ])
    memory = "\n".join([
        "| sample | ranks x tokens/rank | distca worst server | distca mean | per-doc CP worst rank | "
        "per-doc CP mean | worst vs per-doc CP |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
        *memory_rows,
    ])
    targets = "\n".join([
        "| sample | ranks x tokens/rank | distca mean | distca worst | plan ms (median) | targets |",
        "| --- | --- | ---: | ---: | ---: | --- |",
        *target_rows,
    ])
    return (f"{grid}\n\nK/V tokens received per layer (worst server or rank, and mean; averaged over batches; "
            "per-document CP: every rank holding a piece of a document that spans ranks gathers the rest of "
            f"that document):\n\n{memory}\n\nPlanner targets ({max(batches, 8)} batches each, this machine):\n\n{targets}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=HERE.parent.parent / "shared" / "data")
    parser.add_argument("--batches", type=int, default=6)
    parser.add_argument("--update-readme", action="store_true", help="replace the table between the README markers")
    args = parser.parse_args(argv)
    if not (args.data / "doc_lengths_prolong.json").exists():
        parser.error(f"--data: {args.data} has no doc_lengths_*.json (the shared length samples)")
    table = run(args.data, args.batches)
    print(table)
    if args.update_readme:
        readme = HERE.parent / "README.md"
        text = readme.read_text()
        pattern = re.compile(r"(<!-- bench-sim:start -->\n).*?(<!-- bench-sim:end -->)", re.S)
        if not pattern.search(text):
            parser.error("README.md lacks the <!-- bench-sim:start --> / <!-- bench-sim:end --> markers")
        readme.write_text(pattern.sub(lambda m: m.group(1) + table + "\n" + m.group(2), text))
        print(f"updated {readme}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
