"""Draw a distca Chrome trace (``distca-hf bench --trace OUT.json``) as a picture: per rank, a compute
lane (nano-batch A blue, B orange, attention kernels darker, time blocked on communication red, work
that is not instrumented grey: the loss, autograd's backward of projections and MLP) and a
communication lane (each all-to-all from launch to completion).

    python examples/plot_timeline.py TRACE.json OUT.png [--title T] [--start-ms A --end-ms B]
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from distca_hf.tools.cli import help_description


def colour(name: str, kind: str) -> str:
    if kind == "wait":
        return "#d62728"
    if kind == "comm":
        return "#2ca02c" if "backward" in name else "#98df8a"
    if "kernel" in name:
        return "#1f3b73" if "nano-batch A" in name else "#8c4a00" if "nano-batch B" in name else "#444444"
    if name.startswith("A "):
        return "#6baed6"
    if name.startswith("B "):
        return "#fdae6b"
    return "#bbbbbb"


def main(argv=None):
    parser = argparse.ArgumentParser(description=help_description(__doc__))
    parser.add_argument("trace")
    parser.add_argument("out")
    parser.add_argument("--title", default="distca timeline")
    parser.add_argument("--start-ms", type=float, default=None)
    parser.add_argument("--end-ms", type=float, default=None)
    args = parser.parse_args(argv)

    with open(args.trace) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    ranks = sorted({e["pid"] for e in events})
    fig, ax = plt.subplots(figsize=(14, 1.2 + 1.1 * len(ranks)))
    labels, ticks = [], []
    for i, rank in enumerate(ranks):
        for lane, tid in ((0, 0), (1, 1)):
            y = (len(ranks) - 1 - i) * 2.6 + (1 - lane) * 1.2
            ticks.append(y + 0.5)
            labels.append(f"rank {rank} {'compute' if tid == 0 else 'comm'}")
            # nested spans (a stage holding a kernel or a wait) draw after their parents
            mine = sorted((e for e in events if e["pid"] == rank and e["tid"] == tid), key=lambda e: -e["dur"])
            if tid == 0 and mine:  # what is not instrumented: loss, and autograd's backward of projections/MLP
                first = min(e["ts"] for e in mine)
                last = max(e["ts"] + e["dur"] for e in mine)
                ax.broken_barh([(first / 1e3, (last - first) / 1e3)], (y, 1.0), color="#e8e8e8")
            for e in mine:
                kind = e["cat"].split(",")[0]
                ax.broken_barh([(e["ts"] / 1e3, e["dur"] / 1e3)], (y, 1.0), color=colour(e["name"], kind),
                               edgecolor="white" if kind != "wait" else None, linewidth=0.2)
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels)
    ax.set_xlabel("time (ms)")
    if args.start_ms is not None or args.end_ms is not None:
        ax.set_xlim(args.start_ms, args.end_ms)
    ax.set_title(args.title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in
               ("#6baed6", "#1f3b73", "#fdae6b", "#8c4a00", "#98df8a", "#2ca02c", "#d62728", "#e8e8e8")]
    ax.legend(handles, ["A: projections/MLP", "A: attention kernel", "B: projections/MLP", "B: attention kernel",
                        "all-to-all (forward)", "all-to-all (backward)", "blocked on communication",
                        "other compute (loss; backward of projections, MLP)"],
              loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=4, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
