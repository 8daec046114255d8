"""The document-length samples the commands read (``simulate --lengths``, ``bench --workload
sample:FILE.json``): a JSON list of positive integer lengths (tokens), checked with the flag named,
and how far one document may span ranks in a simulated batch."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..planning.cost import check_document_lengths

__all__ = ["load_lengths", "check_lengths", "span_problem", "MAX_SPANNED_RANKS"]

MAX_SPANNED_RANKS = 4096
"""The most ranks one document may span in ``simulate``'s batches (its K/V transfers, about the square
of them, would not fit in memory much beyond)."""


def load_lengths(path, flag: str = "--lengths") -> np.ndarray:
    """A JSON list of positive integer document lengths; errors name ``flag``, the file and the problem."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{flag}: {path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag}: {path} is not valid JSON ({e})") from None
    except RecursionError:
        raise ValueError(f"{flag}: {path} is not a list of lengths (JSON nested too deeply)") from None
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {path} ({e.strerror or e})") from None
    if not isinstance(data, list) or not data:
        raise ValueError(f"{flag}: {path} must hold a non-empty JSON list of document lengths (tokens)")
    return check_lengths(data, f"{flag}: {path}")


def check_lengths(lengths, where: str = "lengths") -> np.ndarray:
    """``lengths`` (a list or array of document lengths) as int64, else ``ValueError`` starting with
    ``where``: a non-empty list of positive integers, none past ``cost.MAX_POSITION``."""
    checked = check_document_lengths(lengths, where, minimum=1)
    if not checked.size:
        raise ValueError(f"{where} must hold a non-empty list of document lengths (tokens)")
    return checked


def span_problem(lengths: np.ndarray, batch_tokens: int, tokens_per_rank: int) -> str | None:
    """Why batches of ``batch_tokens`` cut into ranks of ``tokens_per_rank`` are too wide to simulate: a
    document over ``s`` ranks makes about ``s^2 / 2`` K/V transfers (each piece needs every earlier
    one's; 100000 ranks of one token each ran out of memory, killed without a word). None: they fit."""
    longest = int(min(int(lengths.max()), batch_tokens))
    span = min(-(-longest // tokens_per_rank) + 1, batch_tokens // tokens_per_rank)
    if span > MAX_SPANNED_RANKS:
        return (f"the longest document would span {span} ranks, at most {MAX_SPANNED_RANKS} (its K/V transfers grow "
                "with the square); raise --tokens-per-rank")
    return None
