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

from .carving import Plan
from .cost import causal_pairs, start_with_pairs
from .documents import PackedDocuments

__all__ = ["WAVE_NAMES", "wave_plans", "cut_local_work_in_halves", "first_half_by_pairs", "NanoAssignment",
           "NanoSplit", "assign_nano_batches", "check_splittable", "split_nano_batches"]

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
    if plan.splits_keys:
        return plan  # key-split tiles are not cut again (start_with_pairs counts whole prefixes)
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
        c = start_with_pairs(b, float(running[i] - half), plan.window)
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
                plan.servers, plan.window, plan.backward, relays=plan.relays)


# ---- ping-pong's nano-batches ----

@dataclass(frozen=True, eq=False)
class NanoAssignment:
    """Which of a rank's documents go to nano-batch A and which to B (a pure function of the rank's
    document lengths, so every rank can compute every rank's).

    A document goes whole to A or to B, except at most one ``cut`` document (its prefix ``[0,
    cut_at)`` in A, the rest in B), and a ``pinned`` document: the row's last one when it continues
    on the next rank (``span_ranks``), held whole in A. Across ranks, a document's part in A is then
    always a prefix of it, so A's attention never waits for B's K/V. B reads the K/V of the cut
    prefix and of the pinned document as key-only rows (the pinned one's suffix may be in B on a
    later rank).

    Attributes:
        in_a: ``[num_docs]`` bool, True for the documents in A (the cut one's prefix counts as A).
        cut: the cut document, or -1.
        cut_at: tokens of it in A.
        pinned: the pinned document, or -1.
    """

    in_a: np.ndarray
    cut: int
    cut_at: int
    pinned: int

    def documents(self, lengths: np.ndarray) -> tuple[list, list]:
        """Each nano-batch's documents as ``(origin, length, past)``: the rank's document index,
        its K/V tokens in the nano-batch and how many of those are key-only. In row order: A's whole
        documents then the cut prefix; B's cut suffix (with its prefix), B's whole documents, then the
        pinned document's key-only copy."""
        whole_a = [(int(d), int(lengths[d]), 0) for d in np.flatnonzero(self.in_a) if d != self.cut]
        whole_b = [(int(d), int(lengths[d]), 0) for d in np.flatnonzero(~self.in_a) if d != self.cut]
        a, b = whole_a, whole_b
        if self.cut >= 0:
            a = a + [(self.cut, self.cut_at, 0)]
            b = [(self.cut, int(lengths[self.cut]), self.cut_at)] + b
        if self.pinned >= 0:
            b = b + [(self.pinned, int(lengths[self.pinned]), int(lengths[self.pinned]))]
        return a, b


@dataclass(frozen=True, eq=False)
class NanoSplit:
    """Two nano-batches of one micro-batch's flat token stream ``[batch * seq]``.

    Attributes:
        assignment: which documents went where.
        rows_a, rows_b: ``[tokens_a]`` / ``[tokens_b]`` int64 rows of the micro-batch each nano-batch
            holds, in its order (padding rows, in no document, go to B).
        docs_a, docs_b: their documents, numbered in their own streams (``assignment.documents``
            order). B's key stream is ``[A's prefix_rows] ++ [B's rows] ++ [A's pinned_rows]``.
        prefix_rows: ``[cut_at]`` int64 rows of A's stream holding the cut document's prefix, whose
            K/V B's suffix attends to (empty when no document was cut).
        pinned_rows: ``[pinned length]`` int64 rows of A's stream holding the pinned document, whose
            K/V B reads for a later rank (empty when none).
        origin_a, origin_b: ``[docs]`` the micro-batch's index of each nano-batch document.
    """

    assignment: NanoAssignment
    rows_a: np.ndarray
    rows_b: np.ndarray
    docs_a: PackedDocuments
    docs_b: PackedDocuments
    prefix_rows: np.ndarray
    pinned_rows: np.ndarray
    origin_a: np.ndarray
    origin_b: np.ndarray

    @property
    def cut(self) -> bool:
        """A document was cut (``prefix_rows`` is not empty)."""
        return self.prefix_rows.size > 0


def assign_nano_batches(lengths, *, pin_last: bool = False) -> NanoAssignment:
    """Split documents of ``lengths`` tokens into two nano-batches of equal tokens (A gets the odd
    one), balancing attention pairs as far as whole documents allow: whole documents go to the
    nano-batch with fewer pairs, then whole documents move to equalise tokens, and at most one
    document is cut for the rest (its prefix in A, its suffix in B). ``pin_last``: the last document
    continues on the next rank and stays whole in A."""
    lengths = np.asarray(lengths, dtype=np.int64)
    pinned = lengths.size - 1 if pin_last and lengths.size else -1
    in_a = _documents_by_pairs(lengths, pinned)
    cut, cut_at = _equalise_tokens(lengths, in_a, pinned)
    return NanoAssignment(in_a, cut, cut_at, pinned)


def split_nano_batches(docs: PackedDocuments, assignment: NanoAssignment | None = None) -> NanoSplit:
    """A micro-batch's documents (no cache: ``past == 0``) as two nano-batches, by ``assignment``
    (default: ``assign_nano_batches`` of its lengths)."""
    check_splittable(docs)
    return _lay_out(docs, assignment if assignment is not None else assign_nano_batches(docs.lengths))


def check_splittable(docs: PackedDocuments) -> None:
    """Raise ``ValueError`` unless ``docs`` is a training micro-batch (no KV cache)."""
    if docs.past.any() or docs.num_query_tokens != docs.num_key_tokens:
        raise ValueError("ping-pong splits training micro-batches; it cannot split a batch decoding with a KV cache")


def _documents_by_pairs(lengths: np.ndarray, pinned: int) -> np.ndarray:
    """``[num_docs]`` bool, True for A: the pinned document, then whole documents, heaviest first, to
    the lighter side by pairs."""
    in_a = np.zeros(lengths.size, dtype=bool)
    pairs = [0, 0]
    if pinned >= 0:
        in_a[pinned] = True
        pairs[0] += int(causal_pairs(0, int(lengths[pinned])))
    for d in np.argsort(-lengths, kind="stable"):
        if d == pinned:
            continue
        side = 0 if pairs[0] <= pairs[1] else 1
        in_a[d] = side == 0
        pairs[side] += int(causal_pairs(0, int(lengths[d])))
    return in_a


def _equalise_tokens(lengths: np.ndarray, in_a: np.ndarray, pinned: int) -> tuple[int, int]:
    """Move whole documents (updating ``in_a`` in place; never the pinned one) from the larger
    nano-batch while one fits in the token difference; returns ``(document, position)`` of the one
    cut that settles the rest, or ``(-1, 0)`` when none is needed or possible. A gets the odd token."""
    want_a = (int(lengths.sum()) + 1) // 2
    movable = np.ones(lengths.size, dtype=bool)
    if pinned >= 0:
        movable[pinned] = False
    while True:
        excess = int(lengths[in_a].sum()) - want_a  # tokens A must give to B (negative: take from B)
        if excess == 0:
            return -1, 0
        candidates = np.flatnonzero((in_a if excess > 0 else ~in_a) & movable)
        if candidates.size == 0:  # only the pinned document is left to give: A keeps the surplus
            return -1, 0
        fits = candidates[lengths[candidates] <= abs(excess)]
        if fits.size:
            move = fits[np.argmax(lengths[fits])]
            in_a[move] = not in_a[move]
            continue
        cut = int(candidates[np.argmin(lengths[candidates])])  # every candidate is longer than |excess|
        return cut, (int(lengths[cut]) - excess if excess > 0 else -excess)


def _lay_out(docs: PackedDocuments, assignment: NanoAssignment) -> NanoSplit:
    """The two nano-batches' rows and documents, in ``assignment.documents`` order; padding rows go
    to B after its documents."""
    rows_of = lambda d, lo, hi: np.arange(docs.q_starts[d] + lo, docs.q_starts[d] + hi, dtype=np.int64)
    a_docs, b_docs = assignment.documents(docs.lengths)
    a_parts = [rows_of(d, 0, n) for d, n, _ in a_docs]
    b_parts = [rows_of(d, past, n) for d, n, past in b_docs if n > past]
    covered = np.zeros(docs.num_query_tokens, dtype=bool)
    for part in a_parts + b_parts:
        covered[part] = True
    rows_a = np.concatenate(a_parts) if a_parts else np.zeros(0, np.int64)
    rows_b = np.concatenate(b_parts + [np.flatnonzero(~covered)]).astype(np.int64)

    # Where A holds the parts B also reads: the cut prefix and the pinned document.
    a_start = dict(zip([d for d, _, _ in a_docs], (np.cumsum([n for _, n, _ in a_docs]) -
                                                   np.asarray([n for _, n, _ in a_docs], dtype=np.int64)).tolist()))
    a_rows = lambda d, n: np.arange(a_start[d], a_start[d] + n, dtype=np.int64) if d >= 0 else np.zeros(0, np.int64)
    prefix_rows = a_rows(assignment.cut, assignment.cut_at)
    pinned = assignment.pinned
    pinned_rows = a_rows(pinned, int(docs.lengths[pinned]) if pinned >= 0 else 0)
    docs_a = PackedDocuments.from_lengths([n for _, n, _ in a_docs])
    b_len = np.asarray([n for _, n, _ in b_docs], dtype=np.int64)
    b_past = np.asarray([past for _, _, past in b_docs], dtype=np.int64)
    b_queries = b_len - b_past
    b_q_starts = np.cumsum(b_queries) - b_queries
    # key rows: [cut prefix] ++ [B's rows] ++ [pinned copy]; the cut document starts at key 0, its
    # suffix right after its prefix
    b_k_starts = b_q_starts + prefix_rows.size - b_past
    if pinned >= 0:
        b_k_starts[-1] = prefix_rows.size + rows_b.size
    docs_b = PackedDocuments(b_len, b_past, b_q_starts, b_k_starts, rows_b.size,
                             rows_b.size + prefix_rows.size + pinned_rows.size)
    origin = lambda listed: np.asarray([d for d, _, _ in listed], dtype=np.int64)
    return NanoSplit(assignment, rows_a, rows_b, docs_a, docs_b, prefix_rows, pinned_rows, origin(a_docs),
                     origin(b_docs))
