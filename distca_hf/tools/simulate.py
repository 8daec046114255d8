"""Cluster-scale simulator (``distca-hf simulate``): what CAD would gain on N ranks, before renting them.

Each batch draws documents from a length sample (seeded) and packs them, in draw order, into N
ranks of T tokens; a document longer than what is left on a rank continues on the next ones (the
batch's last document is cut where the batch is full). Four ways to run the batch are compared:

- ``colocated``: packed data parallelism; every rank computes attention for its own tokens.
- ``wlb``: WLB-LLM-style length-aware packing of the same documents: pieces (documents cut to at
  most T tokens) sorted by attention cost, each to the least-loaded rank that still has room.
- ``per_doc_cp``: per-document context parallelism: every document split over all ranks, K/V
  all-gathered (balanced by construction; we count its bytes). For memory we also count the
  lighter variant that runs CP only where the packing already cut a document: every rank holding a
  piece of a document that spans ranks gathers the rest of that document's K/V.
- ``distca``: the planner's CA-task assignment on top of the colocated packing.

Attention cost is in query-key pairs; bytes assume bf16 and the model given by ``--hidden``,
``--heads``, ``--kv-heads`` (default: Llama-3-8B) and count one layer's forward; times come from a
``TimeModel`` (a FLOP model of an H100 by default, or ``distca-hf profile``'s JSON). K/V received is
in tokens per layer (the memory a method adds on a rank besides its own tokens; multiply by the K/V
bytes per token for bytes).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from ..planning import (LLAMA3_8B_H100, DocumentPieces, PlannerConfig, TimeModel, TokenBytes, causal_pairs,
                        comm_bytes, concat_ranges, imbalance, kv_received, kv_transfers, plan_tasks)

__all__ = ["draw_batch", "cut_to", "pack_pieces", "wlb_loads", "per_doc_cp_kv_received", "simulate", "main"]


def draw_batch(lengths: np.ndarray, total_tokens: int, rng: np.random.Generator) -> np.ndarray:
    """Document lengths drawn with replacement until ``total_tokens`` are filled; the last one is
    cut to fit exactly."""
    mean = float(lengths.mean())
    drawn = np.zeros(0, dtype=np.int64)
    while drawn.sum() < total_tokens:
        more = rng.choice(lengths, size=max(16, int(1.2 * (total_tokens - drawn.sum()) / mean) + 1))
        drawn = np.concatenate((drawn, more))
    return cut_to(drawn, total_tokens)


def cut_to(docs: np.ndarray, total_tokens: int) -> np.ndarray:
    """The documents that fill ``total_tokens`` in order, the last one cut where the batch is full
    (all of them when they hold no more than that)."""
    ends = np.cumsum(docs)
    if ends[-1] <= total_tokens:
        return docs.copy()
    count = int(np.searchsorted(ends, total_tokens)) + 1
    kept = docs[:count].copy()
    kept[-1] -= int(ends[count - 1]) - total_tokens
    return kept


def pack_pieces(docs: np.ndarray, ranks: int, tokens_per_rank: int) -> DocumentPieces:
    """Pack documents in order into ``ranks`` x ``tokens_per_rank``; a document crossing a rank
    boundary becomes one piece per rank."""
    ends = np.cumsum(docs)
    starts = ends - docs
    first, last = starts // tokens_per_rank, (ends - 1) // tokens_per_rank
    counts = last - first + 1
    doc = np.repeat(np.arange(docs.size), counts)
    rank = concat_ranges(first, counts)
    lo = np.maximum(starts[doc], rank * tokens_per_rank)
    hi = np.minimum(ends[doc], (rank + 1) * tokens_per_rank)
    return DocumentPieces(rank, doc, lo - starts[doc], hi - starts[doc], ranks)


def wlb_loads(docs: np.ndarray, ranks: int, tokens_per_rank: int):
    """WLB-LLM-style packing; returns per-rank (tokens, pairs, pieces)."""
    chunk_doc, chunk_start = [], []
    for d, n in enumerate(docs.tolist()):
        for s in range(0, n, tokens_per_rank):
            chunk_doc.append(d), chunk_start.append(s)
    chunk_start = np.asarray(chunk_start, dtype=np.int64)
    chunk_end = np.minimum(chunk_start + tokens_per_rank, docs[np.asarray(chunk_doc, dtype=np.int64)])
    order = np.argsort(-causal_pairs(chunk_start, chunk_end), kind="stable")
    free = np.full(ranks, tokens_per_rank, dtype=np.int64)
    pairs = np.zeros(ranks, dtype=np.float64)
    pieces = np.zeros(ranks, dtype=np.int64)
    for i in order.tolist():
        lo, hi = int(chunk_start[i]), int(chunk_end[i])
        fits = free >= hi - lo
        while lo < hi:
            if fits.any():
                r = int(np.argmin(np.where(fits, pairs, np.inf)))
                take = hi - lo
            else:  # nothing has room for the whole piece: fill the least-loaded ranks that have some
                r = int(np.argmin(np.where(free > 0, pairs, np.inf)))
                take = min(hi - lo, int(free[r]))
            pairs[r] += float(causal_pairs(lo, lo + take))
            free[r] -= take
            pieces[r] += 1
            lo += take
            fits = free >= hi - lo
    return tokens_per_rank - free, pairs, pieces


def _per_doc_cp_bytes(total_tokens: int, ranks: int, token_bytes: TokenBytes) -> int:
    # every rank all-gathers the K/V of every document: (ranks - 1) / ranks of each token, to each rank
    return (ranks - 1) * total_tokens * token_bytes.kv


def per_doc_cp_kv_received(pieces: DocumentPieces) -> np.ndarray:
    """``[num_ranks]`` K/V tokens each rank receives per layer under per-document CP of the documents
    that span ranks: a rank holding a piece of such a document gathers all of that document's K/V
    it does not hold (document length - its own K/V tokens of it), once per document."""
    if not pieces.num_pieces:
        return np.zeros(pieces.num_ranks, dtype=np.int64)
    length = np.zeros(int(pieces.doc.max()) + 1, dtype=np.int64)
    np.maximum.at(length, pieces.doc, pieces.end)  # a document's pieces tile [0, length)
    # one entry per (document, rank) that holds some of it, with the K/V tokens it holds
    holding, which = np.unique(pieces.doc * pieces.num_ranks + pieces.rank, return_inverse=True)
    held = np.bincount(which, weights=pieces.end - pieces.kv_start).astype(np.int64)
    doc, rank = holding // pieces.num_ranks, holding % pieces.num_ranks
    spans = np.bincount(doc, minlength=length.size)[doc] > 1  # held by more than one rank
    missing = np.where(spans, length[doc] - held, 0)
    return np.bincount(rank, weights=missing, minlength=pieces.num_ranks).astype(np.int64)


def simulate(lengths, ranks: int, tokens_per_rank: int, batches: int = 8, seed: int = 0,
             config: PlannerConfig | None = None, time_model: TimeModel = LLAMA3_8B_H100, keep_first: bool = False):
    """Run the comparison; returns the contract's JSON object (and the first batch's details as
    ``_first`` when ``keep_first``)."""
    config = config or PlannerConfig()
    lengths = np.asarray(lengths, dtype=np.int64)
    rng = np.random.default_rng(seed)
    measured = [_measure_batch(draw_batch(lengths, ranks * tokens_per_rank, rng), ranks, tokens_per_rank, config,
                               time_model) for _ in range(batches)]
    acc = {k: [m[k] for m in measured] for k in measured[0] if not k.startswith("_")}
    mean = lambda k: float(np.mean(acc[k]))
    result = {
        "ranks": ranks,
        "tokens_per_rank": tokens_per_rank,
        "batches": batches,
        "colocated": {"attn_imbalance": mean("colo_imb")},
        "wlb": {"attn_imbalance": mean("wlb_imb")},
        "distca": {
            "attn_imbalance": mean("dca_imb"),
            "worst_attn_imbalance": float(max(acc["dca_imb"])),
            "moved_query_fraction": mean("moved"),
            "comm_bytes_per_layer": mean("bytes"),
            "plan_ms_median": float(statistics.median(acc["plan_ms"])),
            "kv_received_tokens_per_layer": {"max": mean("dca_kv_max"), "mean": mean("dca_kv_mean")},
        },
        "per_doc_cp": {
            "comm_bytes_per_layer": mean("cp_bytes"),
            "kv_received_tokens_per_layer": {"max": mean("cp_kv_max"), "mean": mean("cp_kv_mean")},
        },
        "speedup_vs_colocated": float(sum(acc["colo_t"]) / sum(acc["dca_t"])),
    }
    if keep_first:
        result["_first"] = measured[0]["_first"]
        result["_times"] = {"colocated": mean("colo_t"), "wlb": mean("wlb_t"), "distca": mean("dca_t")}
    return result


def _measure_batch(docs: np.ndarray, ranks: int, tokens_per_rank: int, config: PlannerConfig,
                   time_model: TimeModel) -> dict:
    """One batch's numbers for every method (imbalances, bytes, K/V received, modelled times)."""
    total = ranks * tokens_per_rank
    pieces = pack_pieces(docs, ranks, tokens_per_rank)
    start = time.perf_counter()
    plan = plan_tasks(pieces, config)
    plan_ms = (time.perf_counter() - start) * 1e3
    local, served = pieces.local_pairs(), plan.server_pairs()
    wlb_tokens, wlb_pairs, wlb_pieces = wlb_loads(docs, ranks, tokens_per_rank)
    transfers = kv_transfers(plan, pieces)
    received = kv_received(transfers, ranks)[list(plan.servers)]  # only servers receive K/V
    cp_received = per_doc_cp_kv_received(pieces)
    tokens = pieces.tokens()
    return {
        "plan_ms": plan_ms,
        "colo_imb": imbalance(local), "wlb_imb": imbalance(wlb_pairs), "dca_imb": imbalance(served, plan.servers),
        "moved": plan.moved_queries() / total,
        "bytes": comm_bytes(plan, pieces, config.token_bytes, transfers).total,
        "cp_bytes": _per_doc_cp_bytes(total, ranks, config.token_bytes),
        "dca_kv_max": received.max(), "dca_kv_mean": received.mean(),
        "cp_kv_max": cp_received.max(), "cp_kv_mean": cp_received.mean(),
        "colo_t": time_model.rank_seconds(tokens, local, np.bincount(pieces.rank, minlength=ranks)).max(),
        "wlb_t": time_model.rank_seconds(wlb_tokens, wlb_pairs, wlb_pieces).max(),
        "dca_t": time_model.rank_seconds(tokens, served, np.bincount(plan.server, minlength=ranks)).max(),
        "_first": {"local": local, "served": served, "wlb": wlb_pairs},
    }


def load_lengths(path) -> np.ndarray:
    """A JSON list of positive integer document lengths; errors name the file and the problem."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"--lengths: {path} does not exist") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--lengths: {path} is not valid JSON ({e})") from None
    if not isinstance(data, list) or not data:
        raise ValueError(f"--lengths: {path} must hold a non-empty JSON list of document lengths (tokens)")
    bad = next((x for x in data if not (isinstance(x, int) and not isinstance(x, bool) and x > 0)), None)
    if bad is not None:
        raise ValueError(f"--lengths: {path} holds {bad!r}; every document length must be a positive integer")
    return np.asarray(data, dtype=np.int64)


def _plot(path, lengths, args, config, time_model, result):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = result["_first"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    mean = first["local"].mean()
    xs = np.arange(args.ranks)
    left.bar(xs, first["local"] / mean, width=1.0, alpha=0.55, label="colocated (before)", color="#fc8d62")
    left.bar(xs, first["served"] / mean, width=0.5, alpha=0.9, label="distca (after)", color="#66c2a5")
    left.axhline(1 + config.tolerance, color="gray", ls="--", lw=0.8, label=f"1 + tolerance ({config.tolerance})")
    left.set_xlabel("rank")
    left.set_ylabel("attention pairs / mean")
    left.set_title(f"Per-rank attention, first batch ({args.ranks} ranks x {args.tokens_per_rank} tokens)", fontsize=10)
    left.legend(fontsize=8)

    contexts = sorted({max(1, args.tokens_per_rank // 4), max(1, args.tokens_per_rank // 2), args.tokens_per_rank,
                       args.tokens_per_rank * 2})
    lines = {"colocated": [], "wlb": [], "per_doc_cp": [], "distca": []}
    for t in contexts:
        r = simulate(lengths, args.ranks, t, min(args.batches, 4), args.seed, config, time_model, keep_first=True)
        ideal = time_model.rank_seconds(t, r["_first"]["local"].mean())
        cp_comm = r["per_doc_cp"]["comm_bytes_per_layer"] / args.ranks / time_model.bytes_per_s
        lines["colocated"].append(r["_times"]["colocated"])
        lines["wlb"].append(r["_times"]["wlb"])
        lines["per_doc_cp"].append(ideal + cp_comm)
        lines["distca"].append(r["_times"]["distca"])
    for name, ys in lines.items():
        right.plot(contexts, np.array(ys) * 1e3, marker="o", label=name)
    right.set_xscale("log", base=2)
    right.set_xlabel("tokens per rank")
    right.set_ylabel("layer time, fwd+bwd (ms, time model)")
    right.set_title("Step time vs context (per_doc_cp includes its un-hidden K/V all-gather)", fontsize=10)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _max_mean(stat: dict) -> str:
    return f"{stat['max']:,.0f} / {stat['mean']:,.0f}"


def format_table(result: dict) -> str:
    d = result["distca"]
    rows = [
        ("ranks x tokens per rank", f"{result['ranks']} x {result['tokens_per_rank']} ({result['batches']} batches)"),
        ("attention imbalance, colocated", f"{result['colocated']['attn_imbalance']:.3f}"),
        ("attention imbalance, WLB-LLM packing", f"{result['wlb']['attn_imbalance']:.3f}"),
        ("attention imbalance, distca (mean / worst)", f"{d['attn_imbalance']:.4f} / {d['worst_attn_imbalance']:.4f}"),
        ("queries moved", f"{100 * d['moved_query_fraction']:.1f}%"),
        ("bytes per layer, distca", f"{d['comm_bytes_per_layer'] / 1e9:.3f} GB"),
        ("bytes per layer, per-document CP", f"{result['per_doc_cp']['comm_bytes_per_layer'] / 1e9:.3f} GB"),
        ("K/V tokens received per layer, distca (max / mean server)", _max_mean(d["kv_received_tokens_per_layer"])),
        ("K/V tokens received per layer, per-doc CP (max / mean rank)",
         _max_mean(result["per_doc_cp"]["kv_received_tokens_per_layer"])),
        ("plan time (median)", f"{d['plan_ms_median']:.2f} ms"),
        ("estimated speedup vs colocated", f"{result['speedup_vs_colocated']:.2f}x"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lengths", required=True, help="JSON list of document lengths (tokens)")
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--tokens-per-rank", type=int, required=True)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the contract's JSON object on stdout")
    parser.add_argument("--plot", metavar="OUT.png", help="per-rank load before/after and time vs context")
    parser.add_argument("--hidden", type=int, default=4096, help="model hidden size (bytes; default Llama-3-8B)")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--tolerance", type=float, default=PlannerConfig.tolerance)
    parser.add_argument("--block", type=int, default=128, help="shard block in tokens (GPU kernels like 128)")
    parser.add_argument("--time-model", metavar="FILE.json", help="constants from `distca-hf profile`")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="distca-hf simulate", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_cli(parser.parse_args(argv), parser)


def run_cli(args, parser) -> int:
    for name in ("ranks", "tokens_per_rank", "batches"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    try:
        lengths = load_lengths(args.lengths)
        token_bytes = TokenBytes.for_model(args.hidden, args.heads, args.kv_heads)
        config = PlannerConfig(tolerance=args.tolerance, block=args.block, token_bytes=token_bytes)
        time_model = TimeModel.load(args.time_model) if args.time_model else TimeModel.from_flops(
            args.hidden, int(math.ceil(args.hidden * 3.5 / 256) * 256), args.heads, args.kv_heads)
    except ValueError as e:
        parser.error(str(e))
    result = simulate(lengths, args.ranks, args.tokens_per_rank, args.batches, args.seed, config, time_model,
                      keep_first=bool(args.plot))
    if args.plot:
        _plot(args.plot, lengths, args, config, time_model, result)
    public = {k: v for k, v in result.items() if not k.startswith("_")}
    print(json.dumps(public) if args.json else format_table(public))
    if args.plot and not args.json:
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0
