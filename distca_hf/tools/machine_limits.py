"""What the commands may ask of this machine, checked before they start anything: processes spawned
here (``--world``), torch threads per process (``--threads``) and the memory a model needs."""

from __future__ import annotations

import os

__all__ = ["MAX_WORLD_PER_CPU", "world_problem", "threads_problem", "memory_problem", "machine_memory_bytes",
           "out_of_memory"]

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


GIB = 2**30


def machine_memory_bytes(device: str = "cpu") -> int | None:
    """Bytes one process may use at most: the machine's physical memory (``cpu``), or the first GPU's
    (``cuda``); ``None`` where it cannot be read."""
    if device == "cuda":
        import torch

        return int(torch.cuda.get_device_properties(0).total_memory) if torch.cuda.is_available() else None
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError):  # (not POSIX)
        return None


def memory_problem(needs: int, processes: int, flags: str, device: str = "cpu") -> str | None:
    """What is wrong with ``processes`` processes on this machine each needing at least ``needs``
    bytes (one GPU each on ``cuda``), naming the ``flags`` that size it, or ``None`` (also when the
    machine's memory cannot be read). Only a sure failure is refused: ``needs`` is a lower bound, so a
    run refused here would have run out of memory (killed, on CPU, often without a word)."""
    shared = processes if device == "cpu" else 1
    have = machine_memory_bytes(device)
    if have is None or needs * shared <= have:
        return None
    where = f"{processes} processes: {needs * shared / GIB:.1f} GiB, " if shared > 1 else ""
    return (f"{flags}: the model needs at least {needs / GIB:.1f} GiB per process ({where}this machine's "
            f"{'GPU has' if device == 'cuda' else 'memory is'} {have / GIB:.1f} GiB); use smaller sizes")


def out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocation that failed (Python's ``MemoryError``, torch's CPU allocator or
    CUDA out of memory), which a command reports naming the flags that sized it."""
    if isinstance(error, MemoryError):
        return True
    text = str(error)
    return "can't allocate memory" in text or "out of memory" in text.lower()
