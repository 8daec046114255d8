"""One rank of ``distca-hf bench --pipeline-parallel P`` (one process): its stage, a ``PipelineRunner``
per schedule, every method in turns on the same rows; rank 0 writes the step times, losses and
gradient norms.
"""

from __future__ import annotations

import json
import statistics
import time

from .measure import sync
from .model import bench_model
from .pipeline import METHODS, micro_batch_lengths, pipeline_row
from .processes import init_process
from .worker import turn_order


def run_pipeline_rank(rank: int, world: int, args, port: int, result_path: str | None):
    """One rank: its stage, a ``PipelineRunner`` per schedule, every method in turns; rank 0 writes
    every method's step times, losses and gradient norms."""
    import torch.distributed as dist

    from ...config import configured
    from ...runtime.shutdown import close_process_groups
    from ...training.pipeline import PipelineRunner
    from ...training.pipeline_stages import build_stage_module
    from ...training.plugin import DistCAPlugin

    device = init_process(rank, world, args, port)
    plugin = DistCAPlugin(pipeline_parallel_size=args.pipeline_parallel, tolerance=args.tolerance,
                          backward=args.backward, overlap=args.overlap, timeout_s=args.timeout)
    groups = plugin.attach()  # the attention-server group: this stage's data-parallel copies
    topology = groups.topology
    data_index, stage_index, _ = topology.coordinates(rank)
    stage = build_stage_module(bench_model(args, device, args.tokens), stage_index=stage_index,
                               num_stages=args.pipeline_parallel)
    runners = {schedule: PipelineRunner(stage, topology=topology, rank=rank, schedule=schedule,
                                        tokens_per_micro_batch=args.tokens, device=device, timeout_s=args.timeout)
               for schedule in sorted({s for _, s, _ in METHODS})}
    rounds = micro_batch_lengths(args.workload, micro_batches=args.micro_batches, data_parallel=topology.data_parallel,
                                 tokens=args.tokens, short_docs=args.short_docs, rounds=args.warmup + args.steps)
    rows = [[{k: v.to(device) for k, v in pipeline_row(mb[data_index], vocab=args.vocab,
                                                       seed=(r * args.micro_batches + i) * 1000 + data_index).items()}
             for i, mb in enumerate(micro_batches)] for r, micro_batches in enumerate(rounds)]

    def step(method, r: int):
        name, schedule, mode = method
        stage.zero_grad(set_to_none=True)
        with configured(mode=mode):
            sync(device)
            dist.barrier()
            start, cpu = time.perf_counter(), time.process_time()
            loss = runners[schedule].train_step(rows[r])
            sync(device)
            mine, cpu = time.perf_counter() - start, time.process_time() - cpu
            dist.barrier()
            took = time.perf_counter() - start
        plans = runners[schedule].step_plans  # each micro-batch's plan on this rank
        moved = statistics.mean(p["moved_query_fraction"] for p in plans) if plans else 0.0
        return took, (mine, cpu), float(loss), float(runners[schedule].grad_norm()), moved

    for method in METHODS:
        for r in range(args.warmup):
            step(method, r)
    runs = {name: [] for name, _, _ in METHODS}
    for i in range(args.steps):
        for method in turn_order(list(METHODS), i):
            runs[method[0]].append(step(method, args.warmup + i))
    everyone = [None] * world
    dist.all_gather_object(everyone, {name: [r[1] for r in done] for name, done in runs.items()})  # (own, cpu) s
    if rank == 0 and result_path:
        results = {"data_parallel": topology.data_parallel, "lengths": rounds[args.warmup:],
                   "methods": {name: {"step_s": [r[0] for r in done], "loss": [r[2] for r in done],
                                      "grad_norm": [r[3] for r in done],
                                      "moved_query_fraction": [r[4] for r in done],
                                      "rank_own_s": [[t[0] for t in e[name]] for e in everyone],
                                      "rank_cpu_s": [[t[1] for t in e[name]] for e in everyone]}
                               for name, done in runs.items()}}
        with open(result_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    close_process_groups()
