"""Draw the README's overview picture: why core attention straggles, and what a CA-task is.

Left: documents drawn from a length sample are packed into ranks of equal token counts; the
linear-layer work (tokens) is equal, the core-attention work (query-key pairs, quadratic in each
document's length) is not. Right: one document's causal attention cut into query shards; each
CA-task is a shard plus the K/V prefix it needs, and can run on any attention server.

    python examples/plot_cad_overview.py [--lengths ../shared/data/doc_lengths_prolong.json] [--out PNG]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Polygon  # noqa: E402

from distca_hf.planning import causal_pairs, document_pairs  # noqa: E402
from distca_hf.tools.length_samples import load_lengths  # noqa: E402
from distca_hf.tools.cli import help_description

HERE = Path(__file__).resolve().parent


def pack_ranks(lengths, ranks: int, tokens_per_rank: int, seed: int):
    """Per-rank lists of document pieces; a document that overflows a rank continues on the next."""
    rng = random.Random(seed)
    pieces, rank, used = [[] for _ in range(ranks)], 0, 0
    while rank < ranks:
        remaining = rng.choice(lengths)
        offset = 0
        while remaining and rank < ranks:
            take = min(remaining, tokens_per_rank - used)
            pieces[rank].append((offset, offset + take))  # query range inside its document
            offset, remaining, used = offset + take, remaining - take, used + take
            if used == tokens_per_rank:
                rank, used = rank + 1, 0
    return pieces


def main(argv=None):
    parser = argparse.ArgumentParser(description=help_description(__doc__))
    parser.add_argument("--lengths", type=Path, default=None,
                        help="JSON list of document lengths (default: ../shared/data/doc_lengths_prolong.json, else a "
                             "synthetic lognormal sample)")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--tokens-per-rank", type=int, default=65536)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--out", type=Path, default=HERE / "figures/cad_overview.png")
    args = parser.parse_args(argv)
    for flag, value in (("--ranks", args.ranks), ("--tokens-per-rank", args.tokens_per_rank)):
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    default = HERE.parent.parent / "shared/data/doc_lengths_prolong.json"
    path = args.lengths or (default if default.exists() else None)  # a path given must exist: no silent fallback
    if path is not None:
        try:
            lengths, source = load_lengths(path).tolist(), path.name
        except ValueError as e:
            parser.error(str(e))
    else:  # offline fallback: a long-tailed synthetic sample
        rng = random.Random(0)
        lengths, source = [max(1, int(rng.lognormvariate(7.5, 1.2))) for _ in range(5000)], "synthetic lognormal"

    pieces = pack_ranks(lengths, args.ranks, args.tokens_per_rank, args.seed)
    pairs = [sum(causal_pairs(s, e) for s, e in rank) for rank in pieces]
    tokens = [sum(e - s for s, e in rank) for rank in pieces]
    mean_pairs, mean_tokens = sum(pairs) / len(pairs), sum(tokens) / len(tokens)

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.4), gridspec_kw={"width_ratios": [1.35, 1]})
    xs = range(args.ranks)
    left.bar([x - 0.2 for x in xs], [t / mean_tokens for t in tokens], 0.4, label="tokens (linear layers)", color="#8da0cb")
    left.bar([x + 0.2 for x in xs], [p / mean_pairs for p in pairs], 0.4, label="query-key pairs (core attention)",
             color="#fc8d62")
    left.axhline(1.0, color="gray", lw=0.8, ls="--")
    left.set_xticks(list(xs), [f"rank {r}" for r in xs], fontsize=8)
    left.set_ylabel("work / mean over ranks")
    left.set_title(f"Packed micro-batches: equal tokens, unequal attention\n{args.ranks} ranks x "
                   f"{args.tokens_per_rank // 1024}k tokens from {source}; attention max/mean = "
                   f"{max(pairs) / mean_pairs:.2f}", fontsize=10)
    left.legend(fontsize=8, loc="upper left")

    n, cuts = 16, [0, 7, 11, 14, 16]
    colors = ["#66c2a5", "#fc8d62", "#8da0cb", "#e78ac3"]
    for i, (s, e) in enumerate(zip(cuts[:-1], cuts[1:])):
        # rows = queries [s, e), columns = keys [0, t] for query t: the causal trapezoid of the shard
        trapezoid = [(0, s), (s + 1, s), (e, e), (0, e)]
        right.add_patch(Polygon(trapezoid, closed=True, facecolor=colors[i], edgecolor="black", lw=0.8))
        right.text(-0.6, (s + e) / 2, f"task {i}: q[{s}:{e}]  kv[0:{e}]\n{causal_pairs(s, e)} pairs -> server {i}",
                   ha="right", va="center", fontsize=8)
    right.set_xlim(-9.5, n + 0.5)
    right.set_ylim(n + 0.5, -0.5)
    right.set_xlabel("key position")
    right.set_ylabel("query position")
    right.set_xticks(range(0, n + 1, 4))
    right.set_yticks(range(0, n + 1, 4))
    right.set_title(f"One document ({n} tokens, {document_pairs(n)} pairs) as 4 CA-tasks:\n"
                    "query shard + K/V prefix, exact in any order, on any server", fontsize=10)
    right.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out} (attention imbalance max/mean {max(pairs) / mean_pairs:.2f}, tokens per rank {tokens})")


if __name__ == "__main__":
    main()
