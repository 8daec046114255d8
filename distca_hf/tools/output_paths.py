"""Output files named by the tools' flags (``--out``, ``--plot``, ``--trace``), checked before any work
runs: a run of minutes should not end in a traceback because its result cannot be written."""

from __future__ import annotations

import os

__all__ = ["output_path_problem"]


def output_path_problem(flag: str, path: str, *, suffixes: tuple[str, ...] | None = None) -> str | None:
    """What is wrong with writing the file ``path`` given to ``flag``, as a ``parser.error`` message, or
    ``None``: it must not be a folder, its folder must exist, when ``suffixes`` are given (lower case,
    with the dot) it must end with one of them, and it must be writable (tried by opening it to append,
    a file it creates removed again)."""
    if not path:
        return f"{flag} must name a file, got an empty path"
    if os.path.isdir(path):
        return f"{flag} {path} is a folder; name a file in it"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"{flag}: the folder of {path} does not exist"
    if suffixes and os.path.splitext(path)[1].lower() not in suffixes:
        return f"{flag} {path} must end with one of {', '.join(suffixes)}"
    existed = os.path.exists(path)
    try:  # (a read-only folder, /proc or /sys: the run ended in a traceback when it wrote)
        with open(path, "a"):  # appending nothing: an existing file is left as it is
            pass
    except OSError as e:
        return f"{flag}: cannot write {path} ({e.strerror or e})"
    if not existed:
        os.remove(path)
    return None
