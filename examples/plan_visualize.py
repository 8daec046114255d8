"""Draw one distca plan: per-rank attention before and after, and the CA-tasks it moves.

Pure planning, no processes: documents are packed into ``--ranks`` micro-batches of
``--tokens-per-rank`` tokens (``distca_hf.training.pack_lengths``, the packing ``DistCATrainer`` uses),
their pieces go to ``distca_hf.planning.plan_tasks``, and the figure shows

- left: attention pairs per rank, colocated (each rank its own documents) and as served under the
  plan, with the mean and the tolerance band;
- right: the CA-tasks moved, as a source -> server matrix of query-key pairs (the diagonal is
  what stays local).

    python examples/plan_visualize.py --out plan.png
    python examples/plan_visualize.py --lengths doc_lengths.json --ranks 8 --tokens-per-rank 65536

``--lengths`` is a JSON list of document lengths (tokens); by default the lengths of Python's help
topics under the BPE tokenizer of ``finetune_long_context.py``.
"""

from __future__ import annotations

import argparse
import random

import numpy as np

from distca_hf.training import PackingConfig, pack_lengths
from distca_hf.planning import DocumentPieces, PlannerConfig, imbalance, plan_tasks
from distca_hf.tools.length_samples import load_lengths
from distca_hf.tools.output_paths import output_path_problem
from distca_hf.tools.cli import help_description


def rank_pieces(lengths: list[int], ranks: int, tokens_per_rank: int, seed: int) -> DocumentPieces:
    """Pack ``lengths`` and keep ``ranks`` micro-batches, one training step's worth (drawing
    documents again while there are too few)."""
    rng = random.Random(seed)
    pool = list(lengths)
    while sum(pool) < ranks * tokens_per_rank:
        pool.append(rng.choice(lengths))
    batches, _ = pack_lengths(pool, PackingConfig(tokens_per_rank=tokens_per_rank, seed=seed))
    rng.shuffle(batches)  # the sampler's order
    batches = batches[:ranks]
    # Every piece is its own document here (a cut document's chunks train separately).
    per_rank = [[end - start for _, start, end in batch] for batch in batches]
    return DocumentPieces.from_rank_lists(per_rank)


def moved_matrix(plan, num_ranks: int) -> np.ndarray:
    """``[source, server]`` query-key pairs of the plan's tasks."""
    matrix = np.zeros((num_ranks, num_ranks))
    np.add.at(matrix, (plan.source, plan.server), plan.pairs())
    return matrix


def draw(pieces: DocumentPieces, plan, tolerance: float, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = pieces.num_ranks
    before, after = pieces.local_pairs(), plan.server_pairs()
    mean = before.mean()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [1.4, 1]})
    x = np.arange(ranks)
    left.bar(x - 0.2, before / 1e6, width=0.4, label=f"colocated (max/mean {imbalance(before):.2f})", color="#c44e52")
    left.bar(x + 0.2, after / 1e6, width=0.4, label=f"distca plan (max/mean {imbalance(after):.3f})", color="#4c72b0")
    left.axhline(mean / 1e6, color="black", lw=1, label="mean")
    left.axhspan(mean / 1e6, mean * (1 + tolerance) / 1e6, color="grey", alpha=0.25,
                 label=f"tolerance {tolerance:g}")
    left.set_xticks(x)
    left.set_xlabel("rank")
    left.set_ylabel("attention work (million query-key pairs)")
    left.set_title("attention per rank")
    left.legend(fontsize=8)

    matrix = moved_matrix(plan, ranks)
    image = right.imshow(matrix / 1e6, cmap="Blues")
    for (i, j), value in np.ndenumerate(matrix):
        if value:
            right.text(j, i, f"{value / 1e6:.1f}", ha="center", va="center", fontsize=7,
                       color="white" if value > matrix.max() / 2 else "black")
    right.set_xticks(range(ranks))
    right.set_yticks(range(ranks))
    right.set_xlabel("server")
    right.set_ylabel("source (where the queries live)")
    moved = plan.source != plan.server
    right.set_title(f"{int(moved.sum())} of {plan.num_tasks} CA-tasks moved, "
                    f"{plan.moved_queries() / max(1, int(pieces.tokens().sum())):.1%} of queries")
    fig.colorbar(image, ax=right, label="million pairs")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def default_lengths() -> list[int]:
    from finetune_long_context import offline_tokenizer, pydoc_topics

    texts = pydoc_topics()
    tokenizer = offline_tokenizer(texts)
    return [len(ids) + 1 for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=help_description(__doc__),
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--lengths", help="A JSON list of document lengths in tokens. Left out: the lengths of "
                                          "Python's help topics under the demo's tokenizer.")
    parser.add_argument("--ranks", type=int, default=4, help="Ranks (attention servers) to plan for.")
    parser.add_argument("--tokens-per-rank", "--tokens_per_rank", type=int, default=8192,
                        help="Each rank's token budget; the ranks share one global batch of documents.")
    parser.add_argument("--tolerance", type=float, default=0.02,
                        help="The planner's allowed max/mean - 1 of attention load over the servers.")
    parser.add_argument("--block", type=int, default=1, help="Shard granularity in tokens.")
    parser.add_argument("--seed", type=int, default=0, help="Seeds the order the documents are packed in.")
    parser.add_argument("--out", default="plan.png", help="Where to write the figure (PNG).")
    args = parser.parse_args(argv)
    if args.ranks < 1 or args.tokens_per_rank < 2 or args.block < 1:
        parser.error("--ranks, --block must be >= 1 and --tokens-per-rank >= 2")
    problem = output_path_problem("--out", args.out, suffixes=(".png",))  # before planning, not after it
    if problem:
        parser.error(problem)
    try:
        planner = PlannerConfig(tolerance=args.tolerance, block=args.block)
    except ValueError as e:
        parser.error(f"--{e}")  # (PlannerConfig names its field: the flag's name)
    if args.lengths:
        try:
            lengths = load_lengths(args.lengths).tolist()
        except ValueError as e:
            parser.error(str(e))
    else:
        lengths = default_lengths()
    pieces = rank_pieces(lengths, args.ranks, args.tokens_per_rank, args.seed)
    plan = plan_tasks(pieces, planner)
    before, after = pieces.local_pairs(), plan.server_pairs()
    print(f"{args.ranks} ranks x {args.tokens_per_rank} tokens; documents per rank: "
          f"{np.bincount(pieces.rank, minlength=args.ranks).tolist()}")
    print(f"attention imbalance (max/mean): colocated {imbalance(before):.3f} -> distca {imbalance(after):.3f}")
    print(f"CA-tasks: {plan.num_tasks}, moved {int((plan.source != plan.server).sum())}; queries moved "
          f"{plan.moved_queries()} of {int(pieces.tokens().sum())}")
    draw(pieces, plan, args.tolerance, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
