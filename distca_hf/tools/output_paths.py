"""Output files named by the tools' flags (``--out``, ``--plot``, ``--trace``), checked before any work
runs: a run of minutes should not end in a traceback because its result cannot be written."""

from __future__ import annotations

import os
import tempfile

__all__ = ["output_path_problem"]


def output_path_problem(flag: str, path: str, *, suffixes: tuple[str, ...] | None = None) -> str | None:
    """What is wrong with writing the file ``path`` given to ``flag``, as a ``parser.error`` message, or
    ``None``: it must not be a folder, its folder must exist, when ``suffixes`` are given (lower case,
    with the dot) it must end with one of them, and it must be writable (a file of its own created and
    removed in the folder; an existing file must be writable)."""
    if not path:
        return f"{flag} must name a file, got an empty path"
    if os.path.isdir(path):
        return f"{flag} {path} is a folder; name a file in it"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"{flag}: the folder of {path} does not exist"
    if suffixes and os.path.splitext(path)[1].lower() not in suffixes:
        return f"{flag} {path} must end with one of {', '.join(suffixes)}"
    try:  # (a read-only folder, /proc or /sys: the run ended in a traceback when it wrote)
        # a file of its own in the folder: the path itself (a link, a pipe, another rank's) is left alone
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".distca-write-check-"):
            pass
    except OSError as e:
        return f"{flag}: cannot write {path} ({e.strerror or e})"
    if os.path.isfile(path) and not os.access(path, os.W_OK):
        return f"{flag}: cannot write {path} (the file is read-only)"
    return None
