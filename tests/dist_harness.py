"""Run a function on N gloo ranks in child processes, with a deadline; collect what each returns.

The children are forked where that is safe (see ``start_method``): a spawned child imports torch,
transformers and the test module again, about 10 s of CPU per rank on the CI machine, which was most
of the suite's time. A forked child starts from this process's modules and state: the fresh distca
state the ``conftest`` fixture gives every test, accelerate's reset (``_entry``), and whatever the
test set before calling ``run_ranks`` (which a spawned child would not see).
"""

from __future__ import annotations

import gc
import json
import multiprocessing as mp
import os
import sys
import time
import traceback
from pathlib import Path

from distca_hf.runtime.comm import free_port

PEER_WAIT_S = 30.0  # how long rank 0 keeps the rendezvous store up for peers still running


def _forget_the_parents_accelerate_state() -> None:
    """A forked rank starts as a spawned one would: accelerate keeps its process state in class-level
    singletons, and a test that ran a Trainer in the test process left them saying "one process"."""
    if "accelerate.state" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def _entry(fn, rank, world, port, out_dir, env, args, backend="gloo", peer_wait_s=PEER_WAIT_S):
    _forget_the_parents_accelerate_state()
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    result = {}
    try:
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
        result = {"ok": True, "value": fn(rank, world, *args)}
    except BaseException as e:  # report everything, including the errors the tests expect
        result = {"ok": False, "error": f"{type(e).__name__}: {e}", "type": type(e).__name__,
                  "traceback": traceback.format_exc()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    if rank == 0:
        # Rank 0 hosts the rendezvous store: leaving while a peer still creates a process group
        # (a server group of other ranks) resets that peer's connection. Wait for the others' results,
        # but not for a peer that died on purpose.
        deadline = time.monotonic() + peer_wait_s
        while time.monotonic() < deadline and not all(Path(out_dir, f"rank{r}.json").exists() for r in range(world)):
            time.sleep(0.05)
    os._exit(0)  # skip process-group teardown: a peer may be dead on purpose


FORK_SAFE_THREADS = {"jemalloc_bg_thd"}
"""Threads a fork may leave behind: jemalloc's purging thread (pyarrow's allocator, loaded with
``datasets``) takes its locks around a fork and restarts in the child."""


def start_method() -> str:
    """``"fork"`` when it is safe, else ``"spawn"``; ``DISTCA_TEST_START_METHOD`` (fork or spawn)
    overrides it. Safe: a Linux process with no CUDA (a child cannot use CUDA its parent initialised,
    so GPU machines spawn) and a single thread. A fork copies only the calling thread, so a lock or a
    thread pool of another is left broken in the child: an OpenMP pool of the parent hung MKL's first
    threaded op in a forked rank. ``conftest`` keeps the test process on one OpenMP thread
    (``OMP_NUM_THREADS=1``) so that it has no pool; a test that starts threads (gloo, TensorBoard)
    makes the later ones spawn, only slower."""
    import torch

    asked = os.environ.get("DISTCA_TEST_START_METHOD")
    if asked is not None:
        if asked not in ("fork", "spawn"):
            raise ValueError(f"DISTCA_TEST_START_METHOD must be fork or spawn, got {asked!r}")
        return asked
    tasks = Path("/proc/self/task")
    if not tasks.is_dir() or torch.cuda.is_available():
        return "spawn"
    others = [(task / "comm").read_text().strip() for task in tasks.iterdir() if task.name != str(os.getpid())]
    return "fork" if all(name in FORK_SAFE_THREADS for name in others) else "spawn"


def run_ranks(fn, world: int, tmp_path, *args, env=None, deadline_s: float = 300.0, backend: str = "gloo",
              peer_wait_s: float = PEER_WAIT_S) -> list[dict]:
    """``fn(rank, world, *args)`` on every rank; ``peer_wait_s``: how long rank 0 waits for the others'
    results before leaving (0 when a peer dies or hangs on purpose and only rank 0's result counts)."""
    ctx = mp.get_context(start_method())
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, str(tmp_path), env or {}, args, backend, peer_wait_s))
             for r in range(world)]
    # A forked child's garbage collector would walk (and so copy, page by page) every object this
    # process holds; frozen, they are out of its reach. This process unfreezes at once.
    gc.freeze()
    try:
        for p in procs:
            p.start()
    finally:
        gc.unfreeze()
    for p in procs:
        p.join(deadline_s)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    results = []
    for r in range(world):
        path = Path(tmp_path, f"rank{r}.json")
        results.append(json.loads(path.read_text()) if path.exists() else {"ok": False, "error": "no result (killed)"})
    return results
