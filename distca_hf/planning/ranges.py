"""Flat index ranges: the one vectorised helper every stage uses to turn ``(start, length)`` runs
into token indices (fused batches, K/V transfers, dispatch tables, the simulator's packing)."""

from __future__ import annotations

import numpy as np

__all__ = ["concat_ranges"]


def concat_ranges(starts, lengths) -> np.ndarray:
    """Concatenation of ``arange(s, s + n)`` for each ``(s, n)``, vectorised: ``[sum(lengths)]`` int64."""
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    offsets = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    return np.arange(int(lengths.sum()), dtype=np.int64) + offsets
