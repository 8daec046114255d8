"""Closing ``torch.distributed`` before the interpreter shuts down, so that a run that succeeded
exits 0.

Why: a gloo worker thread drops each collective it ran itself, once the collective is complete, and
dropping it releases the collective's tensors, which needs the GIL (torch hands the tensors' Python
objects back). The caller's ``wait()`` returns as soon as the collective completes, so after a run's
last collective (``Trainer.store_flos``'s all-gather at the end of ``train()``, for example) the
worker may still be waiting for the GIL when the script ends. If it gets the GIL only after the
interpreter has begun finalizing, Python ends the thread inside that C++ destructor: ``terminate
called without an active exception``, SIGABRT, and the launcher exits 1 (pytorch/pytorch#190489).
On this 2-core machine it hit between 1 run in 4 and 1 in 15 of a 2-process ``Trainer`` under
``accelerate launch``, eager attention included: the busier the machine, the later the worker runs.

The hook first sleeps briefly, which hands the GIL to such a worker (the fix for DDP runs, whose
reducer keeps the default group alive past any destroy), then destroys the groups; a group nothing
else holds is then freed with the GIL released, which joins its worker threads.

``close_at_exit()``, called by every distca collective and group creation, registers
``close_process_groups`` with ``atexit`` once per process. Hooks run after the script has finished
and before finalization, so nothing of the user's still needs the groups (except ``atexit`` hooks
registered before distca's first collective: they run after this one).
"""

from __future__ import annotations

import atexit
import sys
import time

from ..state import STATE

__all__ = ["GIL_HANDOFF_S", "close_at_exit", "close_process_groups"]

# How long the exit hook leaves the GIL to the backends' threads. One slice is enough for a worker
# that is already waiting (releasing the GIL wakes it); the rest is for one that the operating system
# has not scheduled yet on a loaded machine. Paid once per process, at exit.
GIL_HANDOFF_S = 0.05


def close_at_exit() -> None:
    """Register ``close_process_groups`` to run at interpreter exit (once per process; cheap to call
    before every collective)."""
    if not STATE.exit_hook_registered:
        STATE.exit_hook_registered = True
        atexit.register(close_process_groups)  # a second one (after ``reset_state``) finds nothing to close


def close_process_groups(*, handoff_s: float = GIL_HANDOFF_S) -> None:
    """Let the backends' threads finish, then destroy every process group (the default one and all
    sub-groups, distca's server groups included), as torch asks programs to do before they exit.

    Does nothing when ``torch.distributed`` is not initialised (never used, or the script destroyed
    its groups itself). When the interpreter exits because of an uncaught exception, the groups are
    left alone: a collective of this rank may still be in flight (a peer stopped mid-step), and
    destroying its group would wait for it until the backend's timeout.

    Args:
        handoff_s: seconds (at most) during which this thread leaves the GIL to the backends' threads
            before the groups are destroyed.
    """
    dist = sys.modules.get("torch.distributed")  # imported by whoever created a group
    if dist is None or not (dist.is_available() and dist.is_initialized()):
        return
    _leave_gil_to_backend_threads(handoff_s)
    if getattr(sys, "last_value", None) is not None:  # set by the interpreter for an uncaught exception
        return
    # Our own reference to the default group makes its last release ours, from Python: torch then
    # destroys the group with the GIL released, and that joins its worker threads, which can now take
    # the GIL to finish. (A group that something else still holds, such as DDP's reducer, is left
    # to the interpreter, its workers idle.)
    world = dist.group.WORLD
    try:
        dist.destroy_process_group()
    except Exception as error:  # noqa: BLE001 (at exit a warning is all that is left to give)
        print(f"distca: destroying the process groups at exit failed: {error}", file=sys.stderr)
    del world


def _leave_gil_to_backend_threads(seconds: float) -> None:
    """Sleep ``seconds`` in short slices: each sleep releases the GIL, and a backend thread waiting
    for it takes it, finishes and returns to its queue."""
    deadline = time.monotonic() + seconds
    while True:
        time.sleep(min(0.005, seconds))
        if time.monotonic() >= deadline:
            return
