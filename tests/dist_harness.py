"""Run a function on N gloo ranks in child processes, with a deadline; collect what each returns.

The children come from a fork server where there is no CUDA (``start_method``): one clean process,
started at the first ``run_ranks``, imports torch, transformers and distca once (``PRELOAD``) and
forks every rank from itself. A spawned rank imported them again, about 10 s of CPU each on the CI
machine, which was most of the suite's time. A rank still starts as a spawned one would: from the
server's fresh modules (no state of this test process), with this process's environment at the call.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
import traceback
from pathlib import Path

from distca_hf.runtime.comm import free_port

PEER_WAIT_S = 60.0  # how long rank 0 keeps the rendezvous store up for peers still running
FAILED_PEERS_S = 180.0  # after a rank failed, how long the others may still take (the suite's timeouts are <= 90 s)


def _entry(fn, rank, world, port, out_dir, env, args, backend="gloo", peer_wait_s=PEER_WAIT_S):
    os.environ.clear()  # the caller's environment, as a spawned child inherits it (not the server's, older)
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


PRELOAD = ("torch", "torch.distributed", "transformers", "transformers.models.llama.modeling_llama",
           "transformers.models.qwen3.modeling_qwen3", "transformers.trainer", "accelerate", "distca_hf",
           "distca_hf.runtime.dispatch", "distca_hf.training.trainer", "helpers")
"""What the fork server imports once for every rank it forks (a module that fails to import is skipped)."""


def _failed(path: Path) -> bool:
    """Whether the result at ``path`` is a failure (no result yet, or one still being written: no)."""
    try:
        return json.loads(path.read_text()).get("ok") is False
    except (OSError, ValueError):
        return False


def start_method() -> str:
    """``"forkserver"`` where there is no CUDA, else ``"spawn"`` (GPU machines keep the start every
    GPU test was written for); ``DISTCA_TEST_START_METHOD`` (forkserver or spawn) overrides it. The
    server must fork from one thread (a fork copies only the calling thread; an OpenMP pool left
    behind hung MKL in a forked rank): ``conftest`` sets ``OMP_NUM_THREADS=1``, which the server
    inherits, so importing torch there starts no pool."""
    import torch

    asked = os.environ.get("DISTCA_TEST_START_METHOD")
    if asked is not None:
        if asked not in ("forkserver", "spawn"):
            raise ValueError(f"DISTCA_TEST_START_METHOD must be forkserver or spawn, got {asked!r}")
        return asked
    if "forkserver" not in mp.get_all_start_methods() or torch.cuda.is_available():
        return "spawn"
    if os.environ.get("OMP_NUM_THREADS") != "1":  # (set otherwise by the caller: the server would start a pool)
        return "spawn"
    return "forkserver"


def _context():
    method = start_method()
    context = mp.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(list(PRELOAD))  # (read when the server starts: the first call)
    return context


def run_ranks(fn, world: int, tmp_path, *args, env=None, deadline_s: float = 300.0, backend: str = "gloo",
              peer_wait_s: float = PEER_WAIT_S) -> list[dict]:
    """``fn(rank, world, *args)`` on every rank; ``peer_wait_s``: how long rank 0 waits for the others'
    results before leaving (0 when a peer dies or hangs on purpose and only rank 0's result counts)."""
    ctx = _context()
    port = free_port()
    environment = {**os.environ, **(env or {})}
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, str(tmp_path), environment, args, backend,
                                              peer_wait_s)) for r in range(world)]
    for p in procs:
        p.start()
    # one deadline for all ranks (joined one after the other, each had its own: up to world x deadline_s), and
    # once a rank has failed, FAILED_PEERS_S more for the others to report (their timeouts, DistCAPeerError)
    # rather than the whole deadline: a rank that died before a collective leaves its peers waiting in it
    deadline, failed_since = time.monotonic() + deadline_s, None
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if failed_since is None and any(_failed(Path(tmp_path, f"rank{r}.json")) for r in range(world)):
            failed_since = time.monotonic()
        if failed_since is not None and time.monotonic() > failed_since + FAILED_PEERS_S:
            break
        time.sleep(0.1)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    results = []
    for r in range(world):
        path = Path(tmp_path, f"rank{r}.json")
        results.append(json.loads(path.read_text()) if path.exists() else {"ok": False, "error": "no result (killed)"})
    return results
