"""The bench's processes: one per rank, started here or by ``torchrun`` (``launch``), each joining the
process group (``init_process``); rank 0's results come back as JSON."""

from __future__ import annotations

import datetime
import json
import os
import sys


def launch(worker, args):
    """Run ``worker(rank, world, args, port, result_path)`` on every rank (``args.world`` spawned
    processes, or this one under torchrun) and return what rank 0 wrote to ``result_path`` (JSON);
    ``None`` on the other ranks under torchrun."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.json")
        if "WORLD_SIZE" in os.environ and "RANK" in os.environ:  # under torchrun
            args.world = int(os.environ["WORLD_SIZE"])
            rank = int(os.environ["RANK"])
            worker(rank, args.world, args, int(os.environ.get("MASTER_PORT", 29500)), path if rank == 0 else None)
            if rank != 0:
                return None
        else:
            from ...runtime.comm import free_port

            mp.start_processes(worker, args=(args.world, args, free_port(), path), nprocs=args.world,
                               start_method="spawn")
        with open(path) as f:
            return json.load(f)


def init_process(rank: int, world: int, args, port: int):
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    use_cuda = args.device == "cuda"
    torch.set_num_threads(args.threads)
    # NCCL refuses two ranks on one GPU ("Duplicate GPU detected"); gloo moves CUDA tensors too, slower
    backend = "nccl" if use_cuda and world <= torch.cuda.device_count() else "gloo"
    if use_cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
        if backend == "gloo" and rank == 0:
            print(f"distca-hf bench: {world} ranks on {torch.cuda.device_count()} GPU(s): NCCL needs one GPU per rank, "
                  "so the ranks talk over gloo (communication times are gloo's)", file=sys.stderr)
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=args.timeout))
    return torch.device("cuda" if use_cuda else "cpu")
