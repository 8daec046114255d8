"""What a plan moves: the Q, K/V and O token ranges that cross ranks, and their bytes.

Pure numpy. A server needs, for each document it serves, the K/V prefix ``[0, max q_end)`` of its
tasks of that document (under a sliding window, ``[min key_start(q_start), max q_end)``: the keys
before the window of its earliest query are never seen); each K/V token is sent once per (source rank, server) pair, from the rank
that holds it, however many of the server's tasks use it. Queries go from their rank to the server
when the two differ, each query row once per (source, server) however many of the server's key-split
tiles use it (``query_sends``), and outputs come back the same way (a row's partials merged on the
server first).

It also holds the memory formula (``backward_memory``): what a plan makes each rank keep for
attention's backward in one layer, beside its own tokens' activations.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from .carving import Plan
from .cost import TokenBytes, imbalance, key_start
from .pieces import DocumentPieces
from .ranges import concat_ranges

__all__ = ["memory_limit", "RangeSends", "KVTransfers", "kv_transfers", "kv_received", "kv_kept", "QuerySends", "query_sends", "CommBytes", "comm_bytes",
           "rank_bytes", "RunningBytes",
           "BackwardMemory", "backward_memory", "fit_memory_budget", "document_servers", "long_document_servers"]


@dataclass(frozen=True, eq=False)
class RangeSends:
    """Token ranges to send (arrays ``[num_sends]``, int64): tokens ``[start, end)`` of document
    ``doc`` go from ``source`` (where they live) to ``server``."""

    source: np.ndarray
    server: np.ndarray
    doc: np.ndarray
    start: np.ndarray
    end: np.ndarray

    def tokens(self) -> int:
        return int((self.end - self.start).sum())

    def subset(self, mask: np.ndarray):
        """The sends selected by the boolean ``mask`` ``[num_sends]``, in order (the same class)."""
        return type(self)(*(getattr(self, f.name)[mask] for f in dataclasses.fields(self)))


@dataclass(frozen=True, eq=False)
class KVTransfers(RangeSends):
    """K/V ranges to send (``RangeSends``: K and V of the tokens ``[start, end)``)."""


def kv_transfers(plan: Plan, pieces: DocumentPieces) -> KVTransfers:
    """The K/V ranges every server must receive to run its tasks of ``plan`` (cut to ``plan.window``),
    grouped by server, then document, then the holding pieces in their order in ``pieces``. Key-split
    tasks (``Plan.k_start``) need only their own keys: a server gets the union of its tasks' key ranges
    of a document (without: ``[min key_start, max q_end)``)."""
    # A task of a document held as one piece, computed where that piece lives, needs no K/V from
    # anyone: drop those first (nearly every task of a packed batch), so what is sorted stays small.
    pieces_of = np.bincount(pieces.doc, minlength=int(plan.doc.max(initial=-1)) + 1)
    holder = np.zeros(pieces_of.size, dtype=np.int64)
    holder[pieces.doc] = pieces.rank  # the holder of every document held as one piece
    keep = (pieces_of[plan.doc] != 1) | (holder[plan.doc] != plan.server)
    k_first, k_end = plan.key_ranges()  # key-split tasks carry their own key ranges
    server, doc, k_first, k_end = plan.server[keep], plan.doc[keep], k_first[keep], k_end[keep]

    # The keys each server needs per document: [min key_start, max q_end) over its tasks of it.
    key = server * pieces_of.size + doc
    order = np.argsort(key, kind="stable") if not plan.splits_keys else np.lexsort((k_first, key))
    key = key[order]
    first = np.flatnonzero(np.concatenate(([True], key[1:] != key[:-1]))) if key.size else np.zeros(0, np.int64)
    if plan.splits_keys and key.size:  # key-split tasks: the union of their key ranges, not its hull
        group = np.cumsum(np.isin(np.arange(key.size), first)) - 1
        span = int(k_end.max()) + 1  # running max of k_end within a group (offset so groups never mix)
        reach = np.maximum.accumulate(k_end[order] + group * span) - group * span
        gap = np.concatenate(([True], k_first[order][1:] > reach[:-1])) | np.isin(np.arange(key.size), first)
        first = np.flatnonzero(gap)
    need_server, need_doc = server[order][first], doc[order][first]
    need_end = np.maximum.reduceat(k_end[order], first) if key.size else np.zeros(0, np.int64)
    need_start = np.minimum.reduceat(k_first[order], first) if key.size else need_end

    # Join each need with every piece of its document (pieces grouped by document, as they come
    # when already in document order, which packing gives).
    sorted_docs = pieces.doc.size < 2 or bool((pieces.doc[1:] >= pieces.doc[:-1]).all())
    by_doc = None if sorted_docs else np.argsort(pieces.doc, kind="stable")
    piece_docs = pieces.doc if by_doc is None else pieces.doc[by_doc]
    lo = np.searchsorted(piece_docs, need_doc, side="left")
    counts = np.searchsorted(piece_docs, need_doc, side="right") - lo
    need_idx = np.repeat(np.arange(need_doc.size), counts)
    piece_idx = concat_ranges(lo, counts)
    if by_doc is not None:
        piece_idx = by_doc[piece_idx]

    source = pieces.rank[piece_idx]
    server = need_server[need_idx]
    start = np.maximum(pieces.kv_start[piece_idx], need_start[need_idx])
    end = np.minimum(pieces.end[piece_idx], need_end[need_idx])
    send = (source != server) & (end > start)
    return KVTransfers(source[send], server[send], need_doc[need_idx][send], start[send], end[send])


@dataclass(frozen=True, eq=False)
class QuerySends(RangeSends):
    """Query ranges to send (``RangeSends``: the queries ``[start, end)``); ``of_task``
    (``[num_tasks]``) is the send that holds each task's queries (``-1``: a task computed on its
    queries' own rank)."""

    of_task: np.ndarray


def query_sends(plan: Plan) -> QuerySends:
    """The query rows ``plan`` moves, each row once per (source, server) pair (the one home of the
    rule): a server's key-split tiles of one query row (``Plan.k_start``) share the row it received,
    and return one output for it (their partials merged there). Whole-prefix tasks never share a query,
    so each moved one is a send of its own, in plan order; a key-split plan's sends are the union of
    the moved tiles' query ranges per (server, source, document), in that order, then by position."""
    moved = np.flatnonzero(plan.source != plan.server)
    of_task = np.full(plan.num_tasks, -1, dtype=np.int64)
    source, server, doc, start, end = (x[moved] for x in (plan.source, plan.server, plan.doc, plan.q_start,
                                                          plan.q_end))
    if not plan.splits_keys or not moved.size:
        of_task[moved] = np.arange(moved.size)
        return QuerySends(source, server, doc, start, end, of_task)
    order, new = _range_runs(server, source, doc, start, end)  # a run of overlapping ranges is one send
    source, server, doc, start, end, moved = (x[order] for x in (source, server, doc, start, end, moved))
    first = np.flatnonzero(new)
    of_task[moved] = np.cumsum(new) - 1
    return QuerySends(source[first], server[first], doc[first], start[first], np.maximum.reduceat(end, first),
                      of_task)


def _range_runs(server, source, doc, start, end) -> tuple[np.ndarray, np.ndarray]:
    """``(order, new)``: the ranges ``[start, end)`` sorted by (server, source, document, start), and
    for each in that order whether it opens a run (it overlaps no range before it in its (server,
    source, document) group); a run ends at the largest end of its ranges."""
    order = np.lexsort((start, doc, source, server))
    server, source, doc, start, end = (x[order] for x in (server, source, doc, start, end))
    new = np.ones(server.size, dtype=bool)
    new[1:] = (server[1:] != server[:-1]) | (source[1:] != source[:-1]) | (doc[1:] != doc[:-1])
    group = np.cumsum(new) - 1
    span = int(end.max(initial=0)) + 1  # running max of the ends within a group (offset so groups never mix)
    reach = np.maximum.accumulate(end + group * span) - group * span
    new[1:] |= start[1:] >= reach[:-1]
    return order, new


def kv_kept(transfers: list[RangeSends], num_ranks: int) -> np.ndarray:
    """``[num_ranks]`` distinct K/V tokens each server keeps for backward when it receives
    ``transfers`` (the K/V sends of each wave of a dispatch, direct or relayed): a token that several
    waves bring counts once, whoever sent it (the runtime keeps one copy,
    ``runtime.tables.kv_store_tables``).
    One wave: ``kv_received``. Waves of one plan (``splits.wave_plans``) keep at most the plan's
    ``kv_received``, exactly it without a sliding window (each wave's keys of a document on a server
    lie in the plan's, and without a window they all start at 0)."""
    parts = [t for t in transfers if t.source.size]
    if not parts:
        return np.zeros(num_ranks, dtype=np.int64)
    server, source, doc, start, end = (np.concatenate([getattr(t, f) for t in parts])
                                       for f in ("server", "source", "doc", "start", "end"))
    # the union of the ranges of each (server, document): its runs of overlapping ranges (a (document,
    # position) is one token, whichever rank sent it: a holder, or a server relaying it)
    order, run = _range_runs(server, np.zeros_like(source), doc, start, end)
    server, start, end = server[order], start[order], end[order]
    first = np.flatnonzero(run)
    run_end = np.maximum.reduceat(end, first)
    return np.bincount(server[first], weights=run_end - start[first], minlength=num_ranks).astype(np.int64)


@dataclass(frozen=True)
class CommBytes:
    """Bytes crossing ranks in one layer's forward under a plan."""

    q: int
    kv: int
    o: int

    @property
    def total(self) -> int:
        return self.q + self.kv + self.o


def kv_received(transfers: KVTransfers, num_ranks: int) -> np.ndarray:
    """``[num_ranks]`` K/V tokens each rank receives as a server in one layer (the memory a plan adds
    on a server, besides the queries it receives)."""
    return np.bincount(transfers.server, weights=transfers.end - transfers.start, minlength=num_ranks).astype(np.int64)


def comm_bytes(plan: Plan, pieces: DocumentPieces, token_bytes: TokenBytes,
               transfers: KVTransfers | None = None) -> CommBytes:
    """Bytes of one layer's forward; pass ``transfers`` when ``kv_transfers`` already ran. Queries and
    outputs per ``query_sends``; key-split plans return each row's partial output with its log-sum-exp
    (counted in ``o``)."""
    moved_q = query_sends(plan).tokens()
    kv_tokens = (transfers if transfers is not None else kv_transfers(plan, pieces)).tokens()
    return CommBytes(q=moved_q * token_bytes.q, kv=kv_tokens * token_bytes.kv, o=moved_q * _returned(plan, token_bytes))


def _returned(plan: Plan, token_bytes: TokenBytes) -> int:
    """Bytes a moved query token's forward result takes back: its output (and log-sum-exp, which a
    key-split plan's partials need to merge)."""
    return token_bytes.o + (token_bytes.lse if plan.splits_keys else 0)


def rank_bytes(plan: Plan, pieces: DocumentPieces, token_bytes: TokenBytes,
               transfers: KVTransfers | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(sent, received)``, each ``[num_ranks]`` int64: the bytes every rank sends and receives in
    one layer's forward under ``plan`` (Q out and O back per ``query_sends``, K/V from the holder to
    the server). Both sum to ``comm_bytes(...).total``."""
    transfers = transfers if transfers is not None else kv_transfers(plan, pieces)
    sends = query_sends(plan)
    queries, source, server = sends.end - sends.start, sends.source, sends.server
    kv = (transfers.end - transfers.start) * token_bytes.kv
    n = plan.num_ranks

    def per_rank(ranks, weights):
        return np.bincount(ranks, weights=weights, minlength=n).astype(np.int64)

    sent = per_rank(source, queries * token_bytes.q) + per_rank(server, queries * _returned(plan, token_bytes)) \
        + per_rank(transfers.source, kv)
    received = per_rank(server, queries * token_bytes.q) + per_rank(source, queries * _returned(plan, token_bytes)) \
        + per_rank(transfers.server, kv)
    return sent, received


class RunningBytes:
    """``rank_bytes`` of a set of tasks that only grows, kept up to date task by task (plain Python:
    a few tasks at a time, where rebuilding the arrays would cost more than the tasks).

    The same rule as ``kv_transfers``: a server needs, per document, the keys ``[min key_start,
    max q_end)`` of its tasks of it, sent once by every other rank holding some of them; queries
    out and outputs back for a task away from its source. ``sent`` and ``received`` (lists
    ``[num_ranks]`` of int bytes) equal ``rank_bytes`` of the tasks added since ``clear``."""

    def __init__(self, pieces: DocumentPieces, token_bytes: TokenBytes, window: int | None = None):
        self.num_ranks, self.token_bytes, self.window = pieces.num_ranks, token_bytes, window
        # any other document's one piece holds all of its K/V, on the rank of its queries
        self.holders = pieces.spanning_holders()
        self.clear()

    def clear(self) -> None:
        """Forget every task added."""
        self.sent, self.received = [0] * self.num_ranks, [0] * self.num_ranks
        self.needs: dict[tuple[int, int], tuple[int, int]] = {}  # (server, doc) -> keys [start, end) it needs

    def add(self, tasks) -> set[int]:
        """Add ``(source, server, doc, q_start, q_end)`` tasks; returns the ranks whose bytes changed."""
        q, o, kv = self.token_bytes.q, self.token_bytes.o, self.token_bytes.kv
        sent, received, needs, window = self.sent, self.received, self.needs, self.window
        changed = set()
        for source, server, doc, q_start, q_end in tasks:
            if source != server:
                queries = q_end - q_start
                sent[source] += queries * q
                received[server] += queries * q
                sent[server] += queries * o
                received[source] += queries * o
                changed.add(source)
                changed.add(server)
            first = key_start(q_start, window)
            old = needs.get((server, doc))
            new = (first, q_end) if old is None else (min(old[0], first), max(old[1], q_end))
            if new == old:
                continue
            needs[(server, doc)] = new
            holders = self.holders.get(doc)
            if holders is None:  # a document held as one piece: all of its keys, on the rank of its queries
                if source != server:
                    more = (new[1] - new[0]) - (0 if old is None else old[1] - old[0])
                    sent[source] += more * kv
                    received[server] += more * kv
                continue
            for rank, kv_start, end in holders:
                if rank == server:
                    continue
                more = max(min(new[1], end) - max(new[0], kv_start), 0)
                if old is not None:
                    more -= max(min(old[1], end) - max(old[0], kv_start), 0)
                if more:
                    sent[rank] += more * kv
                    received[server] += more * kv
                    changed.add(rank)
                    changed.add(server)
        return changed


def memory_limit(budget: float, mean_held: float, floor: float) -> float:
    """The most bytes a rank may hold for attention's backward in one layer under ``memory_budget``
    ``budget`` (the one home of the rule): ``(1 + budget)`` x ``mean_held`` (the mean over ranks of what
    they hold), or ``floor`` (what the worst rank keeps in ``resend`` mode) when that is more."""
    return max((1.0 + budget) * mean_held, floor)


@dataclass(frozen=True, eq=False)
class BackwardMemory:
    """What ranks keep for attention's backward in one layer under a plan (arrays ``[num_ranks]``,
    int64 bytes).

    Attributes:
        own: the rank's own activations: its query tokens x ``TokenBytes.held`` (q, k, v, out and
            log-sum-exp per token: what colocated attention keeps).
        added: what the plan makes it keep beyond that (signed: a rank whose queries are served
            elsewhere keeps less in ``saved`` mode). ``plan_stats()["memory_bytes_per_layer"]``.
        floor: what the worst rank keeps in ``resend`` mode (its own activations and key-only rows),
            which any plan reaches: the least a budget asks for.
    """

    own: np.ndarray
    added: np.ndarray
    floor: int = 0

    @property
    def held(self) -> np.ndarray:
        return self.own + self.added

    def imbalance(self) -> float:
        """``memory_imbalance``: max / mean over ranks of ``own + added``."""
        return imbalance(self.held)

    def fits(self, budget: float | None) -> bool:
        """Whether the worst rank holds at most ``(1 + budget)`` x the mean over ranks of what they
        hold (``own + added``: ``memory_imbalance <= 1 + budget``; the ``memory_budget`` setting;
        ``None``: always), or no more than ``floor`` when that is more: ranks holding more tokens
        than others keep their own activations whatever the plan, so a budget is never refused for
        what no plan changes."""
        if budget is None or not self.own.size:
            return True
        return float(self.held.max()) <= self.limit(budget) * (1 + 1e-12)

    def limit(self, budget: float) -> float:
        """The most bytes a rank may hold under ``budget`` (a fraction, ``fits``): ``memory_limit`` of
        the mean of ``held``."""
        return memory_limit(budget, float(self.held.mean()), float(self.floor)) if self.own.size else 0.0


def backward_memory(plan: Plan, pieces: DocumentPieces, token_bytes: TokenBytes, *, backward: str | None = None,
                    received: np.ndarray | None = None) -> BackwardMemory:
    """The bytes every rank keeps for attention's backward in one layer under ``plan`` (the one home
    of the formula), in ``backward`` mode (default ``plan.backward``). With ``n`` own query tokens,
    ``k`` own K/V rows (``n`` plus key-only rows, e.g. ping-pong's second nano-batch holding a cut
    document's prefix), ``s`` query tokens served and ``r`` K/V tokens received (``received``,
    ``[num_ranks]``; default: ``kv_received`` of the plan's ``kv_transfers``):

    - own activations: ``n x (q + kv + o + lse)`` (``TokenBytes.held``);
    - ``saved``: a rank keeps, per layer, the queries, outputs and log-sum-exp of the tasks it serves
      and a K/V pool of its own rows and those it received: ``s (q + o + lse) + (k + r) kv``, so it
      adds ``(s - n)(q + o + lse) + (k - n + r) kv``; under a key-split plan servers keep only the
      queries (``s`` counts a row once per tile) and sources their rows' merged out and lse (their
      own): it adds ``(s - n) q + (k - n + r) kv``;
    - ``resend``: a rank keeps its own q, k, v, out and log-sum-exp, servers nothing: it adds
      ``(k - n) kv``.

    Exact for what the dispatch keeps (``plan_stats()["rank_saved_for_backward_bytes"]``) with
    ``overlap="none"``, each ping-pong nano-batch in either mode, and ``overlap="wave"``, which
    keeps the local K/V once and each received K/V row once however many waves brought it
    (``kv_kept``: without a sliding window exactly the plan's ``kv_received``, under one at most
    it).
    Transient buffers of one layer's backward (what ``resend`` receives, the pools ``wave``
    rebuilds) are not held across layers and not counted either."""
    backward = backward or plan.backward
    n = pieces.tokens()
    k = np.bincount(pieces.rank, weights=pieces.end - pieces.kv_start, minlength=pieces.num_ranks).astype(np.int64)
    own = n * token_bytes.held
    key_only = (k - n) * token_bytes.kv
    floor = int((own + key_only).max(initial=0))
    if backward == "resend":
        return BackwardMemory(own, key_only, floor)
    if backward != "saved":
        raise ValueError(f"backward must be 'saved' or 'resend', got {backward!r}")
    if received is None:
        received = kv_received(kv_transfers(plan, pieces), plan.num_ranks)
    served = np.bincount(plan.server, weights=plan.q_end - plan.q_start, minlength=plan.num_ranks).astype(np.int64)
    # a key-split plan's servers keep only the queries (backward takes the merged out and lse, which
    # the sources keep as their own activations)
    per_query = token_bytes.q + (0 if plan.splits_keys else token_bytes.o + token_bytes.lse)
    return BackwardMemory(own, (served - n) * per_query + (k - n + np.asarray(received, dtype=np.int64)) * token_bytes.kv,
                          floor)


def fit_memory_budget(plan: Plan, pieces: DocumentPieces, config, received: np.ndarray | None = None) -> Plan:
    """``plan`` in ``config.backward`` mode when its ``backward_memory`` fits ``config.memory_budget``
    (a ``PlannerConfig``), else in ``"resend"`` mode, which always fits: it keeps every rank's own
    activations and nothing more, the budget's floor. ``received``: as ``backward_memory``'s."""
    mode = config.backward
    if mode == "saved" and config.memory_budget is not None:
        if received is None:
            received = kv_received(kv_transfers(plan, pieces), plan.num_ranks)
        if not backward_memory(plan, pieces, config.token_bytes, backward="saved", received=received).fits(
                config.memory_budget):
            mode = "resend"
    return plan if plan.backward == mode else dataclasses.replace(plan, backward=mode)


def document_servers(plan: Plan) -> dict[int, int]:
    """``{doc: number of ranks computing some of its queries}`` under ``plan``."""
    pairs = np.unique(plan.doc * plan.num_ranks + plan.server)
    docs, counts = np.unique(pairs // plan.num_ranks, return_counts=True)
    return dict(zip(docs.tolist(), counts.tolist()))


def long_document_servers(plan: Plan, pieces: DocumentPieces, longer_than: int) -> tuple[float, float]:
    """``(mean, max)`` over the documents longer than ``longer_than`` tokens of the ranks computing
    some of their queries under ``plan`` (``(0, 0)`` without such documents)."""
    length = np.zeros(int(pieces.doc.max(initial=-1)) + 1, dtype=np.int64)
    np.maximum.at(length, pieces.doc, pieces.end)
    servers = document_servers(plan)
    counts = [servers[d] for d in np.flatnonzero(length > longer_than).tolist() if d in servers]
    return (float(np.mean(counts)), float(max(counts))) if counts else (0.0, 0.0)
