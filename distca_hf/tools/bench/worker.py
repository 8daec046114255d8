"""One rank of ``distca-hf bench`` (one process): its model and batches, every method in turns
step by step (``turn_order``), the timings, plans and timeline events gathered for rank 0.
"""

from __future__ import annotations

import json
import time

from ...planning.cost import imbalance
from .demo_data import demo_step
from .long_worker import run_long_workload
from .measure import sync, time_kernels
from .model import bench_model
from .processes import init_process
from .workloads import workload_batches


def run_rank(rank: int, world: int, args, port: int, result_path: str | None):
    """One rank of the benchmark: set up, run every method in turns, gather, write (rank 0)."""
    import torch.distributed as dist

    from ...runtime import timeline
    from ...runtime.shutdown import close_process_groups

    device = init_process(rank, world, args, port)
    if args.workload == "long":
        results = run_long_workload(rank, world, args, device)
    else:
        # the demo's rows continue documents: positions reach world x tokens
        model = bench_model(args, device, world * args.tokens if args.workload == "demo" else args.tokens)
        kernel_seconds = time_kernels(device)
        methods = _methods(args)
        timeline.enable()
        results = {}
        for workload in args.workload.split(","):
            if workload == "demo":
                import distca_hf

                distca_hf.configure(span_ranks=True)  # every method, as the demo's trainer does
                step, rounds = demo_step(model, rank, world, args, device)
            else:
                step, rounds = _training_step(model, rank, world, args, device, workload), args
            runs = _run_in_turns(step, methods, rounds, kernel_seconds, device)
            results[workload] = _gather_results(runs, methods, rank, world, rounds)
    if rank == 0 and result_path:
        with open(result_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    close_process_groups()  # the exit hook's GIL hand-off first: gloo may still be freeing the barrier


def _training_step(model, rank: int, world: int, args, device, workload: str):
    """``step(round)``: one forward + backward of the model on this rank's batch of ``workload`` in
    that round (rounds ``0 .. warmup - 1`` warm up, then one per measured step)."""
    import torch

    rounds = workload_batches(workload, world, args.tokens, args.short_docs, args.warmup + args.steps)
    g = torch.Generator().manual_seed(rank)
    input_ids = torch.randint(0, args.vocab, (1, args.tokens), generator=g).to(device)
    positions = [torch.cat([torch.arange(n) for n in batch[rank]]).unsqueeze(0).to(device) for batch in rounds]

    def step(i: int):
        model.zero_grad(set_to_none=True)
        out = model(input_ids=input_ids[:, : positions[i].shape[1]], position_ids=positions[i]).logits
        out.float().square().mean().backward()

    return step


def _methods(args) -> list[tuple[str, str, str]]:
    """``(mode, backward, overlap)`` of every method, colocated first."""
    modes = ["saved", "resend"] if args.backward == "both" else [args.backward]
    overlaps = args.overlap.split(",")
    return [("colocated", "saved", "none")] + [("distca", b, o) for b in modes
                                               for o in (overlaps if b == modes[0] else overlaps[:1])]


def _run_in_turns(step, methods, args, kernel_seconds, device) -> dict:
    """Every method runs once per step, in turns, so a machine whose speed drifts (another job,
    thermal limits) affects all of them alike: the ratios are measured side by side. The turns
    alternate direction (``turn_order``): the method that runs a new batch first pays for growing the
    allocator's buffers and warming the caches, and the next one finds them ready. Returns
    per method a list of ``(step seconds, (this rank's seconds, its kernel seconds), plan_stats,
    timeline events)``."""
    import torch.distributed as dist

    import distca_hf
    from ...runtime import timeline

    def configure(mode, backward_mode, overlap):
        distca_hf.configure(mode=mode, backward=backward_mode, tolerance=args.tolerance, overlap=overlap)

    def timed_step(i, *method):
        configure(*method)
        kernel_seconds[0] = 0.0
        timeline.clear()
        sync(device)
        dist.barrier()
        start = time.perf_counter()
        step(i)
        sync(device)
        mine = time.perf_counter() - start
        dist.barrier()
        return time.perf_counter() - start, (mine, kernel_seconds[0]), distca_hf.plan_stats(), timeline.events()

    for method in methods:
        configure(*method)
        for i in range(args.warmup):
            step(i)
    runs = {method: [] for method in methods}
    per_round = getattr(args, "batches_per_round", 1)
    for i in range(args.warmup, args.warmup + args.steps):
        for method in turn_order(methods, i - args.warmup, per_round):
            runs[method].append(timed_step(i, *method))
    return runs


def turn_order(methods: list, step: int, per_round: int = 1) -> list:
    """The order the methods take their turns at measured ``step`` (0-based) of rounds of
    ``per_round`` batches: reversed on every other batch of a round and, for each batch, on every
    other round, so each method runs first on every batch equally often (over an even number of
    rounds; for one batch a round, on every other step)."""
    batch, round_ = step % per_round, step // per_round
    return list(reversed(methods)) if (batch + round_) % 2 else list(methods)


def _gather_results(runs: dict, methods, rank: int, world: int, args) -> dict:
    """Every rank's timings, bytes and timeline events, combined per method (rank 0 writes them)."""
    import torch.distributed as dist

    from ...runtime.timeline import chrome_trace, overlap_summary

    results = {}
    colocated = runs[methods[0]]
    results["colocated"] = {"step_s": [r[0] for r in colocated]}
    everyone = [None] * world
    dist.all_gather_object(everyone, [r[1] for r in colocated])
    # per step: slowest rank's non-attention time + mean attention time
    results["ideal_step_s"] = [max(r[i][0] - r[i][1] for r in everyone) + sum(r[i][1] for r in everyone) / world
                               for i in range(args.steps)]
    overlaps = args.overlap.split(",")
    for (_, backward_mode, overlap) in methods[1:]:
        done = runs[("distca", backward_mode, overlap)]
        stats = done[-1][2]
        sent = [None] * world
        # a step whose plan moved nothing ran locally: no byte counters ("auto" on a balanced step)
        dist.all_gather_object(sent, (sum(stats.get("rank_bytes_sent_this_step", {}).values()),
                                      stats.get("rank_saved_for_backward_bytes", 0),
                                      [r[3] for r in done]))  # each step's timeline events
        key = f"distca_{backward_mode}" if overlap == overlaps[0] else f"distca_{backward_mode}_{overlap}"
        results[key] = {
            "step_s": [r[0] for r in done], "stats": stats, "overlap": overlap,
            # each round's plan: attention imbalance before -> after, bytes, share of queries moved
            "plans": [{"before": imbalance(r[2]["attn_pairs_local"]), "after": imbalance(r[2]["attn_pairs_served"]),
                       "bytes_per_layer": r[2]["bytes_sent_per_layer"],
                       "moved_query_fraction": r[2]["moved_query_fraction"]} for r in done],
            "bytes_sent_per_step": sum(s[0] for s in sent),
            "saved_for_backward_bytes_max_rank": max(s[1] for s in sent),
            # one step's overlap over all ranks: their communication and blocked seconds summed
            "overlap_per_step": [overlap_summary([e for s in sent for e in s[2][i]]) for i in range(args.steps)],
        }
        if rank == 0 and args.trace and backward_mode == methods[1][1]:
            chrome_trace([s[2][-1] for s in sent], _trace_path(args.trace, overlap, len(overlaps)))
    return results


def _trace_path(path: str, overlap: str, modes: int) -> str:
    if modes == 1:
        return path
    stem, dot, ext = path.rpartition(".")
    return f"{stem}.{overlap}.{ext}" if dot else f"{path}.{overlap}"
