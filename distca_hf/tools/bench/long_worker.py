"""``--workload long`` on one rank: distca (documents spanning ranks) against per-document CP,
DeepSpeed Ulysses and colocated-where-possible on the same tokens, each method's step time, bytes
and memory; rank 0 gets every rank's measurements.
"""

from __future__ import annotations

import time

from .measure import CommBytes, TensorMemory, sync
from .model import bench_model
from .workloads import long_documents


def _long_methods(rank: int, world: int, args, device) -> dict:
    """Per method: the distca settings, the attention implementation and this rank's inputs.
    colocated and distca hold the stream's slice ``[r T, (r + 1) T)``, as does Ulysses; per-document
    CP holds its head-tail layout of the same tokens."""
    import numpy as np
    import torch

    from .. import context_parallel as cp

    lengths = long_documents(world, args.tokens, args.long_tokens, args.tokens // args.short_docs)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (sum(lengths),), generator=g)
    positions = torch.from_numpy(np.concatenate([np.arange(n) for n in lengths]))
    stream = cp.stream_segments(lengths, args.tokens, world)
    layout = cp.head_tail_segments(stream)
    sl = slice(rank * args.tokens, (rank + 1) * args.tokens)
    own = {"input_ids": ids[sl][None].to(device), "position_ids": positions[sl][None].to(device)}
    index = torch.from_numpy(cp.segment_tokens(layout[rank], lengths))
    local = {"mode": "colocated", "span_ranks": False}
    distca = {"mode": "distca", "span_ranks": True, "backward": "resend" if args.backward == "resend" else "saved",
              "overlap": args.overlap}
    methods = {
        "colocated": (local, "distca", own, cp.piece_pairs(stream), False),
        "distca": (distca, "distca", own, None, True),
        "cp": (local, cp.CP_IMPLEMENTATION, {"input_ids": ids[index][None].to(device),
                                             "position_ids": torch.from_numpy(cp.segment_positions(layout[rank]))[None]
                                             .to(device), "cp_plan": cp.cp_exchange(layout, rank, device)},
               cp.segment_pairs(layout), True),
    }
    if args.ulysses_skipped is None:
        total = sum(cp.segment_pairs(stream))  # every rank: all documents, heads / world of them
        methods["ulysses"] = (local, "distca_ulysses", own, [total / world] * world, True)
    return {name: dict(zip(("settings", "attn", "inputs", "pairs", "exact"), m)) for name, m in methods.items()}


def _long_step(model, method: dict, sent: CommBytes | None = None, memory: TensorMemory | None = None):
    """One forward + backward of ``method`` (already prepared). ``sent`` counts the forward's bytes;
    returns the live bytes of ``memory`` when the forward ends (what it keeps for backward)."""
    import contextlib

    model.zero_grad(set_to_none=True)
    with sent or contextlib.nullcontext():
        loss = model(**method["inputs"]).logits.float().square().mean()
    kept = memory.live if memory is not None else None
    loss.backward()
    return kept


def _prepare(model, method: dict, args) -> None:
    import distca_hf

    distca_hf.configure(tolerance=args.tolerance, **{"backward": "saved", "overlap": "none", **method["settings"]})
    if model.config._attn_implementation != method["attn"]:
        model.set_attn_implementation(method["attn"])


def run_long_workload(rank: int, world: int, args, device) -> dict:
    """Every method in turns (``args.steps`` rounds after ``args.warmup``), then one measured step
    per method (bytes, memory); rank 0 gets every rank's measurements."""
    import torch
    import torch.distributed as dist

    import distca_hf

    from .. import context_parallel as cp
    from ..ulysses import register_ulysses

    model = bench_model(args, device, args.world * args.tokens)
    cp.register()
    if args.ulysses_skipped is None:
        register_ulysses(model, world)
        torch.set_num_threads(args.threads)
    methods = _long_methods(rank, world, args, device)
    for method in methods.values():
        _prepare(model, method, args)
        for _ in range(args.warmup):
            _long_step(model, method)
    steps = {name: [] for name in methods}
    for _ in range(args.steps):
        for name, method in methods.items():
            _prepare(model, method, args)
            sync(device)
            dist.barrier()
            start = time.perf_counter()
            _long_step(model, method)
            sync(device)
            dist.barrier()
            steps[name].append(time.perf_counter() - start)
    measured = {}
    for name, method in methods.items():
        _prepare(model, method, args)
        sent = CommBytes()
        with TensorMemory() as memory:
            kept = _long_step(model, method, sent, memory)
        measured[name] = {"sent": sent.sent, "peak": memory.peak, "kept": kept,
                          "stats": distca_hf.plan_stats() if name == "distca" else None}
    everyone = [None] * world
    dist.all_gather_object(everyone, measured)
    return {"workload": "long", "documents": long_documents(world, args.tokens, args.long_tokens,
                                                            args.tokens // args.short_docs),
            "methods": {name: _combine(name, methods[name], steps[name], [m[name] for m in everyone], args)
                        for name in methods}}


def _combine(name: str, method: dict, steps: list[float], ranks: list[dict], args) -> dict:
    """One method's result over all ranks: rank 0's step times (between barriers: the slowest
    rank's), bytes of one layer's forward summed over ranks, memory of the worst rank."""
    stats = ranks[0]["stats"]
    pairs = stats["attn_pairs_served"] if name == "distca" else method["pairs"]
    return {"step_s": steps, "exact": method["exact"], "attn_pairs": pairs, "stats": stats,
            "bytes_per_layer_forward": sum(r["sent"] for r in ranks) / args.layers,
            "peak_bytes_max_rank": max(r["peak"] for r in ranks),
            "kept_for_backward_bytes_max_rank": max(r["kept"] for r in ranks)}
