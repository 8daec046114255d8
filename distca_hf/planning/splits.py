"""Splitting work in time, for the overlap schedules. Pure numpy.

- ``wave_plans``: a plan's CA-tasks as the waves of ``overlap="wave"``: ``[local, first half]
  [remote 1] [remote 2] [local, second half]``, each server's local and remote work halved by pairs
  (a local task straddling the half is cut there, so both local waves carry work even when a rank
  keeps one long document).
- ``split_nano_batches``: a micro-batch's documents as ping-pong's two nano-batches of equal tokens.

Both are exact re-arrangements: every query is in exactly one wave / nano-batch, and CA-tasks are
composable, so any cut gives the attention of the whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .cost import causal_pairs, start_with_pairs
from .documents import PackedDocuments
from .planner import Plan

__all__ = ["WAVE_NAMES", "wave_plans", "cut_local_work_in_halves", "first_half_by_pairs", "NanoSplit",
           "split_nano_batches"]

# The waves of overlap="wave", in execution order; the local ones run no collective.
WAVE_NAMES = ("local, first half", "remote 1", "remote 2", "local, second half")


def wave_plans(plan: Plan, block: int = 1) -> list[tuple[str, Plan]]:
    """``(name, sub-plan)`` of each non-empty wave, in ``WAVE_NAMES`` order. The plan is the same on
    every rank, so every rank gets the same waves."""
    plan = cut_local_work_in_halves(plan, block)
    local = plan.source == plan.server
    early = first_half_by_pairs(plan, local)
    first_remote = first_half_by_pairs(plan, ~local)
    masks = (local & early, ~local & first_remote, ~local & ~first_remote, local & ~early)
    return [(name, plan.subset(mask)) for name, mask in zip(WAVE_NAMES, masks) if mask.any()]


def first_half_by_pairs(plan: Plan, chosen: np.ndarray) -> np.ndarray:
    """Mask of the ``chosen`` tasks that fall in the first half of their server's chosen pairs (in
    plan order; a task belongs to the half that holds its midpoint)."""
    pairs = np.where(chosen, plan.pairs(), 0).astype(np.float64)
    first = np.zeros(plan.num_tasks, dtype=bool)
    for server in np.unique(plan.server[chosen]):
        on = np.flatnonzero(plan.server == server)
        running = np.cumsum(pairs[on])
        first[on] = (running - pairs[on] / 2) < running[-1] / 2
    return first & chosen


def cut_local_work_in_halves(plan: Plan, block: int = 1) -> Plan:
    """Cut the local task that straddles the half of each server's local pairs at that half, so the
    two local waves carry equal work. The cut is ``block`` aligned from the task's start (kernels
    such as flash-attn prefer whole blocks)."""
    local = plan.source == plan.server
    pairs = np.where(local, plan.pairs(), 0)
    cut_at = np.full(plan.num_tasks, -1, dtype=np.int64)
    for server in np.unique(plan.server[local]):
        on = np.flatnonzero((plan.server == server) & local)
        running = np.cumsum(pairs[on])
        half = running[-1] / 2
        i = int(np.searchsorted(running, half))  # the task whose range holds the half
        a, b = int(plan.q_start[on[i]]), int(plan.q_end[on[i]])
        before = running[i] - pairs[on[i]]
        c = start_with_pairs(b, float(running[i] - half))
        c = a + int(round((c - a) / block)) * block
        if a < c < b and before < half:
            cut_at[on[i]] = c
    cut = np.flatnonzero(cut_at >= 0)
    if cut.size == 0:
        return plan
    # task i becomes [q_start, c) and [c, q_end), adjacent in plan order
    repeat = np.where(cut_at >= 0, 2, 1)
    index = np.repeat(np.arange(plan.num_tasks), repeat)
    ends = np.cumsum(repeat)[cut]
    q_start, q_end = plan.q_start[index].copy(), plan.q_end[index].copy()
    q_start[ends - 1] = cut_at[cut]
    q_end[ends - 2] = cut_at[cut]
    return Plan(plan.source[index], plan.server[index], plan.doc[index], q_start, q_end, plan.num_ranks,
                plan.servers)


# ---- ping-pong's nano-batches ----

@dataclass(frozen=True, eq=False)
class NanoSplit:
    """Two nano-batches of one micro-batch's flat token stream ``[batch * seq]``.

    Attributes:
        rows_a, rows_b: ``[tokens_a]`` / ``[tokens_b]`` int64 rows of the micro-batch each nano-batch
            holds, in its order (padding rows, in no document, go to B).
        docs_a, docs_b: their documents, numbered in their own streams. B's key stream is
            ``[prefix rows of the cut document, taken from A] ++ [B's rows]``.
        prefix_rows: ``[prefix]`` int64 rows of A's stream whose K/V B needs (empty when no
            document was cut).
    """

    rows_a: np.ndarray
    rows_b: np.ndarray
    docs_a: PackedDocuments
    docs_b: PackedDocuments
    prefix_rows: np.ndarray

    @property
    def cut(self) -> bool:
        return self.prefix_rows.size > 0


def split_nano_batches(docs: PackedDocuments) -> NanoSplit:
    """Split a micro-batch's documents (no cache: ``past == 0``) into two nano-batches of equal
    tokens (A gets the odd one), balancing attention pairs as far as whole documents allow: whole
    documents go to the nano-batch with fewer pairs, then whole documents move to equalise tokens,
    and at most one document is cut for the rest (its prefix in A, its suffix in B)."""
    if docs.past.any() or docs.num_query_tokens != docs.num_key_tokens:
        raise ValueError("ping-pong splits training micro-batches; it cannot split a batch decoding with a KV cache")
    in_a = _documents_by_pairs(docs.lengths)
    cut_doc, cut_at = _equalise_tokens(docs.lengths, in_a)
    return _lay_out(docs, in_a, cut_doc, cut_at)


def _documents_by_pairs(lengths: np.ndarray) -> np.ndarray:
    """``[num_docs]`` bool, True for A: whole documents, heaviest first, to the lighter side by pairs."""
    in_a = np.zeros(lengths.size, dtype=bool)
    pairs = [0, 0]
    for d in np.argsort(-lengths, kind="stable"):
        side = 0 if pairs[0] <= pairs[1] else 1
        in_a[d] = side == 0
        pairs[side] += int(causal_pairs(0, int(lengths[d])))
    return in_a


def _equalise_tokens(lengths: np.ndarray, in_a: np.ndarray) -> tuple[int, int]:
    """Move whole documents (updating ``in_a`` in place) from the larger nano-batch while one fits in
    the token difference; returns ``(document, position)`` of the one cut that settles the rest, or
    ``(-1, 0)`` when none is needed. A gets the odd token."""
    want_a = (int(lengths.sum()) + 1) // 2
    while True:
        excess = int(lengths[in_a].sum()) - want_a  # tokens A must give to B (negative: take from B)
        if excess == 0:
            return -1, 0
        candidates = np.flatnonzero(in_a if excess > 0 else ~in_a)
        fits = candidates[lengths[candidates] <= abs(excess)]
        if fits.size:
            move = fits[np.argmax(lengths[fits])]
            in_a[move] = not in_a[move]
            continue
        cut_doc = int(candidates[np.argmin(lengths[candidates])])  # every candidate is longer than |excess|
        return cut_doc, (int(lengths[cut_doc]) - excess if excess > 0 else -excess)


def _lay_out(docs: PackedDocuments, in_a: np.ndarray, cut_doc: int, cut_at: int) -> NanoSplit:
    """The two nano-batches' rows and documents. A: its whole documents, then the cut document's
    prefix (whose rows B's keys reuse). B: the cut document's suffix first (its keys continue the
    prefix rows), then its whole documents, then the padding rows."""
    lengths = docs.lengths
    rows_of = lambda d, lo, hi: np.arange(docs.q_starts[d] + lo, docs.q_starts[d] + hi, dtype=np.int64)
    whole_a = [int(d) for d in np.flatnonzero(in_a) if d != cut_doc]
    whole_b = [int(d) for d in np.flatnonzero(~in_a) if d != cut_doc]
    a_parts = [rows_of(d, 0, lengths[d]) for d in whole_a]
    a_lengths = [int(lengths[d]) for d in whole_a]
    b_parts, b_lengths, b_past = [], [], []
    prefix_start, prefix = sum(a_lengths), 0
    if cut_doc >= 0:
        prefix = cut_at
        a_parts.append(rows_of(cut_doc, 0, cut_at))
        a_lengths.append(cut_at)
        b_parts.append(rows_of(cut_doc, cut_at, lengths[cut_doc]))
        b_lengths.append(int(lengths[cut_doc]))
        b_past.append(cut_at)
    b_parts += [rows_of(d, 0, lengths[d]) for d in whole_b]
    b_lengths += [int(lengths[d]) for d in whole_b]
    b_past += [0] * len(whole_b)
    covered = np.zeros(docs.num_query_tokens, dtype=bool)
    for part in a_parts + b_parts:
        covered[part] = True
    rows_a = np.concatenate(a_parts) if a_parts else np.zeros(0, np.int64)
    rows_b = np.concatenate(b_parts + [np.flatnonzero(~covered)]).astype(np.int64)

    docs_a = PackedDocuments.from_lengths(a_lengths)
    b_len, b_past = np.asarray(b_lengths, dtype=np.int64), np.asarray(b_past, dtype=np.int64)
    b_queries = b_len - b_past
    b_q_starts = np.concatenate(([0], np.cumsum(b_queries)[:-1])).astype(np.int64)
    # key rows: the prefix occupies [0, prefix), then B's own rows; the cut document starts at key 0
    b_k_starts = b_q_starts + prefix - b_past
    docs_b = PackedDocuments(b_len, b_past, b_q_starts, b_k_starts, rows_b.size, rows_b.size + prefix)
    prefix_rows = np.arange(prefix_start, prefix_start + prefix, dtype=np.int64)
    return NanoSplit(rows_a, rows_b, docs_a, docs_b, prefix_rows)
