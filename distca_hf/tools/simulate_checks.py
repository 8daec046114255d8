"""The simulator's sizes, checked before anything is drawn (``simulate``, ``simulate_pipeline`` and the
``distca-hf simulate`` flags): errors name the argument or the flag."""

from __future__ import annotations

from ..config import is_integer
from ..planning.cost import batch_tokens_problem

__all__ = ["MAX_DRAWS", "check_sizes", "draws_problem"]

MAX_DRAWS = 10_000
"""The most batches (``batches``, times ``micro_batches`` under a pipeline) one simulation draws and
plans: each takes 0.01-1 s here, so more would run for hours (a huge count read as a hang)."""


def check_sizes(**sizes) -> None:
    """``simulate``'s and ``simulate_pipeline``'s sizes: integers >= 1, naming the argument; a batch
    of ``ranks x tokens_per_rank`` tokens within ``cost.MAX_POSITION``; at most ``MAX_DRAWS`` draws."""
    for name, value in sizes.items():
        if not is_integer(value) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    problem = batch_tokens_problem(sizes["ranks"], sizes["tokens_per_rank"]) or \
        draws_problem(sizes["batches"], sizes.get("micro_batches"))
    if problem:
        raise ValueError(problem)


def draws_problem(batches: int, micro_batches: int | None, names=("batches", "micro_batches")) -> str | None:
    """Why ``batches`` (times ``micro_batches`` under a pipeline) is more than ``MAX_DRAWS`` draws, in
    ``names`` (the arguments' or the flags'); None when it is not."""
    draws = batches * (micro_batches or 1)
    if draws <= MAX_DRAWS:
        return None
    named = f"{names[0]} x {names[1]}" if micro_batches else names[0]
    return f"{named} = {draws}: a simulation draws and plans at most {MAX_DRAWS} batches (each takes up to a second)"
