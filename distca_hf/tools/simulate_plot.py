"""``distca-hf simulate --plot``: the figure of one simulation (matplotlib, imported only here)."""

from __future__ import annotations

import textwrap

import numpy as np

from .simulate import LABELS, METHODS, simulate

__all__ = ["plot_simulation"]


def plot_simulation(path, lengths, args, config, time_model, result: dict, options: dict) -> None:
    """Write ``--plot``'s figure to ``path``: per-rank attention of the first batch before and after the
    plan (``result["_first"]``, from ``simulate(keep_first=True)``), and every method's layer time
    against tokens per rank (``simulate`` rerun at T / 4 .. 2 T with ``options``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = result["_first"]
    d = result["distca"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12.5, 4.4))
    mean = first["local"].mean()
    xs = np.arange(args.ranks)
    left.bar(xs, first["local"] / mean, width=1.0, alpha=0.55, label="colocated (before)", color="#fc8d62")
    left.bar(xs, first["served"] / mean, width=0.5, alpha=0.9, label=f"distca (after, tolerance {config.tolerance})",
             color="#66c2a5")
    if config.tolerance != "auto":  # a fixed tolerance is a bound on the after bars
        left.axhline(1 + config.tolerance, color="gray", ls="--", lw=0.8, label=f"1 + tolerance ({config.tolerance})")
    left.set_xlabel("rank")
    left.set_ylabel("attention pairs / mean")
    shard = d["smallest_shard_tokens"]
    left.set_title(f"Per-rank attention, first batch ({args.ranks} ranks x {args.tokens_per_rank} tokens)\n"
                   f"distca: {d['tasks_per_server']['max']:.0f} tasks on the busiest server, smallest moved shard "
                   f"{'-' if shard is None else shard} tokens (block {config.block})", fontsize=8.5)
    left.legend(fontsize=8)

    contexts = sorted({max(1, args.tokens_per_rank // 4), max(1, args.tokens_per_rank // 2), args.tokens_per_rank,
                       args.tokens_per_rank * 2})
    lines = {m: [] for m in METHODS}
    for t in contexts:
        r = simulate(lengths, args.ranks, t, min(args.batches, 4), args.seed, config, time_model, **options)
        for m in METHODS:
            lines[m].append(r[m]["step_time_s"])
    for m, ys in lines.items():
        if any(y is None for y in ys):
            continue
        right.plot(contexts, np.array(ys) * 1e3, marker="o", label=LABELS[m])  # CP/Ulysses degrees vary with T
    right.set_xscale("log", base=2)
    right.set_xlabel("tokens per rank")
    right.set_ylabel("layer time, fwd+bwd (ms)")
    right.set_title("Layer time vs tokens per rank (slowest rank, communication included)", fontsize=9)
    right.legend(fontsize=8)
    fig.text(0.5, 0.01, textwrap.fill(f"time model: {time_model.source}; {time_model.bytes_per_s / 1e9:g} GB/s per "
                                      f"rank, {100 * result['hidden_comm_fraction']:.0f}% of communication hidden; "
                                      "CP and Ulysses at the smallest degree that holds the longest document", 150),
             ha="center", va="bottom", fontsize=7.5, color="#444444")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
