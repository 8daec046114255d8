"""A per-rank timeline of distca's compute and communication, and how much communication it hides.

Off by default (recording costs a clock read per event). When on, distca records (in
``distca_hf.state.STATE``):

- ``comm`` intervals: from the moment an all-to-all is launched to the moment the backend reports
  it complete (a completion callback, so an all-to-all that finished while the rank computed is
  stamped when it finished, not when someone waited on it);
- ``wait`` intervals: the rank blocked waiting for an all-to-all (communication *not* hidden);
- ``compute`` intervals: attention kernels and, under ping-pong, each nano-batch's layer stages.

The stamps are CPU clock readings. With gloo (CPU) the backend runs the transfer and the
completion callback fires when it is done. With NCCL the transfer runs on a CUDA stream: the
future completes when the backend marks the work done and ``wait()`` only orders streams, so on
GPUs read these intervals as host-side launch/wait times and use ``torch.profiler`` for the device
timeline.

``overlap_summary`` turns them into ``overlap_fraction`` = communication time hidden under compute
/ total communication time = ``1 - blocked time / communication time``, forward and backward apart.
``chrome_trace`` writes the events of every rank as a Chrome trace (open it in ``chrome://tracing``
or https://ui.perfetto.dev): one process per rank, a compute track and a communication track.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass

from ..state import STATE

__all__ = ["Event", "enable", "disable", "enabled", "events", "clear", "span", "record",
           "overlap_summary", "chrome_trace", "current_phase", "in_backward"]


@dataclass(frozen=True)
class Event:
    """One interval on this rank, in seconds of ``time.perf_counter``.

    ``kind`` is ``"compute"``, ``"comm"`` or ``"wait"``; ``phase`` is ``"backward"`` for what runs
    inside autograd's backward pass (recomputation under gradient checkpointing included), else
    ``"forward"``.
    """

    name: str
    kind: str
    phase: str
    start: float
    end: float


def enable() -> None:
    STATE.timeline_on = True


def disable() -> None:
    STATE.timeline_on = False


def enabled() -> bool:
    return STATE.timeline_on


def clear() -> None:
    with STATE.lock:
        STATE.timeline_events = []


def events() -> list[Event]:
    with STATE.lock:
        return list(STATE.timeline_events)


def record(name: str, kind: str, phase: str, start: float, end: float) -> None:
    if STATE.timeline_on:
        with STATE.lock:
            STATE.timeline_events.append(Event(name, kind, phase, start, end))


@contextmanager
def span(name: str, kind: str = "compute"):
    """Record the enclosed block as one interval (nothing when the timeline is off)."""
    if not STATE.timeline_on:
        yield
        return
    phase = current_phase()
    start = time.perf_counter()
    try:
        yield
    finally:
        record(name, kind, phase, start, time.perf_counter())


def in_backward() -> bool:
    """True inside autograd's backward pass (gradient checkpointing's recomputation included)."""
    import torch

    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


def current_phase() -> str:
    """``"backward"`` inside autograd's backward pass, else ``"forward"``."""
    return "backward" if in_backward() else "forward"


def overlap_summary(evs: list[Event]) -> dict:
    """Communication seconds, blocked seconds and ``overlap_fraction``, overall and per phase.

    A ``wait`` interval is communication the rank could not hide; everything else of a ``comm``
    interval ran while the rank did other work.
    """

    def summarize(phase):
        comm = sum(e.end - e.start for e in evs if e.kind == "comm" and phase in (None, e.phase))
        blocked = sum(e.end - e.start for e in evs if e.kind == "wait" and phase in (None, e.phase))
        blocked = min(blocked, comm)  # a wait also covers the few microseconds before the launch returned
        return {"comm_s": comm, "exposed_s": blocked,
                "overlap_fraction": (1.0 - blocked / comm) if comm > 0 else 0.0}

    out = summarize(None)
    out["forward"] = summarize("forward")
    out["backward"] = summarize("backward")
    return out


def chrome_trace(events_by_rank: list[list[Event]], path: str) -> None:
    """Write the Chrome trace JSON of every rank's events (microseconds from the earliest event)."""
    starts = [e.start for evs in events_by_rank for e in evs]
    origin = min(starts) if starts else 0.0
    tracks = {"compute": 0, "wait": 0, "comm": 1}
    trace = []
    for rank, evs in enumerate(events_by_rank):
        trace.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        trace.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": "compute"}})
        trace.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": 1, "args": {"name": "communication"}})
        for e in evs:
            trace.append({"name": e.name, "cat": f"{e.kind},{e.phase}", "ph": "X", "pid": rank,
                          "tid": tracks[e.kind], "ts": (e.start - origin) * 1e6,
                          "dur": max(e.end - e.start, 0.0) * 1e6})
    with open(path, "w") as f:
        json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)
