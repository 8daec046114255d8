"""Collectives distca uses, over ``torch.distributed`` (NCCL on GPU, gloo on CPU).

Every call is asynchronous underneath and waited on with distca's timeout, so a dead or stuck peer
raises ``DistCATimeoutError`` naming the operation and the forward instead of hanging. Every rank calls
the same collectives in the same order. The first one registers the exit hook that closes the process
groups before the interpreter shuts down (``shutdown``).
"""

from __future__ import annotations

import datetime
import time

import numpy as np
import torch
import torch.distributed as dist

from ..errors import DistCATimeoutError
from . import timeline
from .shutdown import close_at_exit

__all__ = ["DistCATimeoutError", "CommHandle", "all_to_all", "all_gather_documents", "free_port"]


class CommHandle:
    """A started collective; ``wait()`` returns its output or raises ``DistCATimeoutError``.

    With the timeline on (``distca_hf.timeline``), the collective's life from launch to completion
    is recorded as a ``comm`` interval and the time ``wait()`` blocks as a ``wait`` interval.
    """

    def __init__(self, work, output, timeout_s: float, what: str):
        self._work, self._output, self._timeout_s, self._what = work, output, timeout_s, what
        if work is not None and timeline.enabled():
            launched, phase = time.perf_counter(), timeline.current_phase()
            work.get_future().add_done_callback(
                lambda _: timeline.record(what, "comm", phase, launched, time.perf_counter()))

    def wait(self):
        if self._work is not None:
            started = time.perf_counter()
            try:
                self._work.wait(timeout=datetime.timedelta(seconds=self._timeout_s))
            except Exception as e:  # gloo and NCCL raise RuntimeError (or DistBackendError) subclasses
                alive = (" Or a peer is alive but did not run this backward: every rank must call backward() on each "
                         "distca forward that has gradients (not skip a step on some ranks)."
                         if self._what.startswith("distca backward") else "")
                raise DistCATimeoutError(
                    f"distca: {self._what} did not complete within {self._timeout_s:g}s (DISTCA_TIMEOUT_S); a peer "
                    f"rank probably died or hung.{alive} Backend said: {str(e).splitlines()[0][:300]}"
                ) from e
            self._work = None
            if timeline.enabled():
                timeline.record("wait: " + self._what, "wait", timeline.current_phase(), started, time.perf_counter())
        return self._output


def all_to_all(send: torch.Tensor, send_splits: list[int], recv_splits: list[int], group, timeout_s: float,
               what: str, out: torch.Tensor | None = None, async_op: bool = False):
    """Uneven all-to-all of a 1D buffer. ``send_splits[r]`` elements go to rank ``r``;
    ``recv_splits[r]`` come from it. Returns the received buffer, or a ``CommHandle`` when ``async_op``."""
    close_at_exit()
    total = int(sum(recv_splits))
    recv = out if out is not None and out.numel() == total else torch.empty(total, dtype=send.dtype, device=send.device)
    work = dist.all_to_all_single(recv, send, list(map(int, recv_splits)), list(map(int, send_splits)), group=group,
                                  async_op=True)
    handle = CommHandle(work, recv, timeout_s, what)
    return handle if async_op else handle.wait()


def all_gather_documents(header: list[int], lengths: np.ndarray, group, device, timeout_s: float, what: str):
    """Every rank's small int header and its document lengths (any count), in rank order.
    Returns ``(headers, lengths)``: lists of tuples and int64 arrays."""
    close_at_exit()
    world = dist.get_world_size(group)
    mine = torch.tensor([lengths.size, *header], dtype=torch.int64, device=device)
    heads = [torch.empty_like(mine) for _ in range(world)]
    CommHandle(dist.all_gather(heads, mine, group=group, async_op=True), None, timeout_s,
               f"{what} (all-gather of document counts)").wait()
    heads = [h.cpu().tolist() for h in heads]
    width = max(1, max(h[0] for h in heads))
    padded = torch.zeros(width, dtype=torch.int64, device=device)
    padded[: lengths.size] = torch.from_numpy(lengths.astype(np.int64)).to(device)
    gathered = [torch.empty_like(padded) for _ in range(world)]
    CommHandle(dist.all_gather(gathered, padded, group=group, async_op=True), None, timeout_s,
               f"{what} (all-gather of document lengths)").wait()
    return [tuple(h[1:]) for h in heads], [g[: h[0]].cpu().numpy() for g, h in zip(gathered, heads)]


def free_port() -> int:
    """A free TCP port on this machine, for a local rendezvous."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
