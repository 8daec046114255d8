"""What the commands may ask of this machine, checked before they start anything: processes spawned
here (``--world``) and torch threads per process (``--threads``)."""

from __future__ import annotations

import os

__all__ = ["MAX_WORLD_PER_CPU", "world_problem", "threads_problem"]

MAX_WORLD_PER_CPU = 8
"""``--world`` beyond this many processes per CPU core is refused (each process holds a model and a
torch runtime; the machine would stall before measuring anything)."""


def world_problem(world: int, flag: str = "--world") -> str | None:
    """What is wrong with spawning ``world`` processes on this machine (more than ``MAX_WORLD_PER_CPU``
    a core), naming ``flag``, or ``None``."""
    most = MAX_WORLD_PER_CPU * (os.cpu_count() or 1)
    if world > most:
        return (f"{flag} {world} is more than {MAX_WORLD_PER_CPU} processes per CPU core of this machine "
                f"({os.cpu_count()}); use at most {most}")
    return None


def threads_problem(threads: int, flag: str = "--threads") -> str | None:
    """What is wrong with ``threads`` torch threads per process (more than this machine's cores: torch
    oversubscribes, or overflows past a C long), naming ``flag``, or ``None``."""
    if threads > (os.cpu_count() or 1):
        return f"{flag} must be at most this machine's {os.cpu_count()} CPU cores, got {threads}"
    return None
