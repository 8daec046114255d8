"""What each rank does under the methods distca is compared with: tokens, attention pairs, kernel
tasks and bytes per rank for one batch. Pure numpy; ``distca-hf simulate`` times these with one
``TimeModel``.

A batch is ``docs`` (document lengths in draw order) over ``ranks`` ranks of ``tokens_per_rank``
tokens each. The layouts:

- packed (``pack_pieces``): documents in order, a document crossing a rank boundary continues on the
  next rank (one piece per rank; a piece's queries attend to the whole prefix, so the prefix K/V
  travels). Colocated runs this; distca plans on it.
- WLB-LLM-style packing (``wlb_steps``): documents longer than a threshold wait in a queue and are
  released one per micro-batch (a rank's slice; first in, first out); the others go, most pairs
  first, to the least attention-loaded rank with room. What does not fit waits for the next step.
- per-document context parallelism (``cp_loads``): data parallel over groups of ``degree`` ranks;
  each group packs ``degree x tokens_per_rank`` tokens, cuts every document into ``2 degree`` chunks
  and gives rank ``i`` chunks ``i`` and ``2 degree - 1 - i`` (``head_tail_chunks``); K/V are
  all-gathered inside the group.
- Ulysses / ALST sequence parallelism (``ulysses_loads``): data parallel over groups of ``degree``
  ranks; an all-to-all turns q, k, v from *own tokens, all heads* into *the group's tokens, heads /
  degree* (K/V heads repeated when fewer than ``degree``), and a second returns the output.
  Balanced inside the group, not across groups.

Data parallel groups (CP, Ulysses; degree 1 is plain data parallelism) pack their documents whole,
best fit decreasing (``group_documents``), as TRL's default packing (``packing_strategy="bfd"``) packs
sequences: a data-parallel loader cannot share a document between replicas, and cutting a document
at a group boundary drops its cross-boundary attention, so a baseline packed in order would compute
less than distca (up to 19% fewer pairs on average on the wlbllm sample, 48% on a batch holding a 1M
-token document). Only what fits no room whole, and at most one short document per room, is cut (about
0.1% of the pairs on the shared samples), so the baselines compute the same attention as distca
wherever they can, and never more.

Bytes are one layer's forward, per rank, sent and received (``RankLoads``).
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

import numpy as np

from .carving import colocated_plan
from .cost import TokenBytes, causal_pairs, document_pairs
from .pieces import DocumentPieces
from .ranges import concat_ranges
from .transfers import kv_received, kv_transfers

__all__ = ["RankLoads", "pack_pieces", "head_tail_chunks", "fitting_degrees", "smallest_degree", "ulysses_degree_ok",
           "cp_loads", "ulysses_loads", "ulysses_kv_share", "ulysses_token_bytes", "wlb_steps", "per_doc_cp_kv_received", "group_documents",
           "kv_cap_tokens"]


@dataclass(frozen=True, eq=False)
class RankLoads:
    """One step of one method, per rank (arrays ``[ranks]``).

    Attributes:
        tokens: tokens whose linear layers the rank runs.
        pairs: attention pairs the rank computes (float: Ulysses splits a group's pairs over heads).
        keys: K/V tokens summed over the rank's kernel tasks (each task's pass over its keys; Ulysses
            splits them over heads like the pairs).
        tasks: varlen sequences (kernel tasks) the rank runs.
        sent, received: bytes the rank sends / receives in one layer's forward.
    """

    tokens: np.ndarray
    pairs: np.ndarray
    keys: np.ndarray
    tasks: np.ndarray
    sent: np.ndarray
    received: np.ndarray


def pack_pieces(docs: np.ndarray, ranks: int, tokens_per_rank: int) -> DocumentPieces:
    """Pack documents in order into ``ranks`` x ``tokens_per_rank``; a document crossing a rank
    boundary becomes one piece per rank."""
    docs = np.asarray(docs, dtype=np.int64)
    ends = np.cumsum(docs)
    starts = ends - docs
    first, last = starts // tokens_per_rank, (ends - 1) // tokens_per_rank
    counts = last - first + 1
    doc = np.repeat(np.arange(docs.size), counts)
    rank = concat_ranges(first, counts)
    lo = np.maximum(starts[doc], rank * tokens_per_rank)
    hi = np.minimum(ends[doc], (rank + 1) * tokens_per_rank)
    return DocumentPieces(rank, doc, lo - starts[doc], hi - starts[doc], ranks)


def head_tail_chunks(lengths, holders: int):
    """Documents of ``lengths`` tokens cut into ``2 n`` chunks for ``n = holders`` ranks, as CP
    implementations cut a sequence (equal sizes, the remainder one token each to the first chunks);
    holder ``i`` gets chunk ``i`` (its head) and chunk ``2n - 1 - i`` (its tail).

    Returns ``(head_start, head_end, tail_start, tail_end)``, each int64 ``[*lengths.shape, holders]``
    in document positions (empty chunks have start == end)."""
    lengths = np.asarray(lengths, dtype=np.int64)[..., None]
    count = 2 * holders
    j = np.arange(count + 1, dtype=np.int64)
    bounds = j * (lengths // count) + np.minimum(j, lengths % count)  # [..., 2n + 1]
    i = np.arange(holders)
    return bounds[..., i], bounds[..., i + 1], bounds[..., count - 1 - i], bounds[..., count - i]


def fitting_degrees(longest: int, tokens_per_rank: int, ranks: int, allowed=lambda d: True) -> list[int]:
    """Every degree a user could pick, ascending: the divisors ``d`` of ``ranks`` (data parallel
    over ``ranks / d`` groups) with ``d x tokens_per_rank >= longest`` and ``allowed(d)``."""
    return [d for d in range(1, ranks + 1) if ranks % d == 0 and d * tokens_per_rank >= longest and allowed(d)]


def smallest_degree(longest: int, tokens_per_rank: int, ranks: int, allowed=lambda d: True) -> int | None:
    """The degree a user would pick without tuning: the smallest of ``fitting_degrees``; ``None``
    when no degree holds ``longest`` tokens."""
    return next(iter(fitting_degrees(longest, tokens_per_rank, ranks, allowed)), None)


def ulysses_degree_ok(degree: int, heads: int, kv_heads: int) -> bool:
    """DeepSpeed's rule for a Ulysses group: the query heads split evenly, and the K/V heads either
    split evenly or are repeated evenly."""
    return heads % degree == 0 and (kv_heads % degree == 0 or degree % kv_heads == 0)


def group_documents(docs, groups: int, group_tokens: int, *, whole_above: int | None = None):
    """``(group, length)`` int64 arrays: the batch's documents packed whole into ``groups``
    data-parallel groups of ``group_tokens`` tokens, best fit decreasing (module docstring).

    Documents longer than ``whole_above`` tokens (default ``group_tokens // 64``) go longest first,
    each to the group with the least room that holds it whole (ties: the lowest group). The others,
    and those no room holds whole (longer than a group, or late ones once the rooms are fragmented),
    then fill the rooms left in draw order, cut where a room ends; each piece is an independent
    document (``length`` lists pieces). Short documents skip the best fit to keep a 512-group batch
    of 10^5 documents in milliseconds: at most one per group is cut, which drops under
    ``whole_above ** 2 / 4`` of its pairs."""
    docs = np.asarray(docs, dtype=np.int64)
    if docs.size and docs.min() < 1:
        raise ValueError(f"docs must be document lengths >= 1 token, got {int(docs.min())}")
    if docs.sum() > groups * group_tokens:
        raise ValueError(f"docs hold {int(docs.sum())} tokens, more than {groups} groups x {group_tokens}")
    whole_above = group_tokens // 64 if whole_above is None else whole_above
    rooms = [(group_tokens, g) for g in range(groups)]  # kept sorted by (room, group)
    group = np.full(docs.size, -1, dtype=np.int64)
    lengths = docs.tolist()
    long_first = np.argsort(-docs, kind="stable")
    for i in long_first[: int((docs > whole_above).sum())].tolist():
        k = bisect.bisect_left(rooms, (lengths[i], -1))
        if k == len(rooms):
            continue  # no room holds it whole
        room, g = rooms.pop(k)
        group[i] = g
        if room > lengths[i]:
            bisect.insort(rooms, (room - lengths[i], g))
    left = np.flatnonzero(group < 0)
    room_size = np.zeros(groups, dtype=np.int64)
    for room, g in rooms:
        room_size[g] = room
    room_end = np.cumsum(room_size)  # the rooms end to end, in group order
    end = np.cumsum(docs[left])
    start = end - docs[left]
    first = np.searchsorted(room_end, start, side="right")
    count = np.searchsorted(room_end, end - 1, side="right") - first + 1
    piece_group = concat_ranges(first, count)
    piece = np.repeat(np.arange(left.size), count)
    piece_length = (np.minimum(end[piece], room_end[piece_group])
                    - np.maximum(start[piece], room_end[piece_group] - room_size[piece_group]))
    keep = piece_length > 0  # a room of size 0 inside a cut document's span holds nothing
    placed = group >= 0
    return (np.concatenate((group[placed], piece_group[keep])),
            np.concatenate((docs[placed], piece_length[keep])))


def cp_loads(docs: np.ndarray, ranks: int, tokens_per_rank: int, degree: int, token_bytes: TokenBytes) -> RankLoads:
    """Per-document CP of ``degree`` ranks per group (module docstring). Rank ``g degree + i`` holds
    chunks ``i`` and ``2 degree - 1 - i`` of every document of group ``g``, computes them against
    their prefixes (one kernel task per chunk, or one for both when they touch), and all-gathers
    the group's K/V: it receives the K/V of every token of its group it does not hold and sends its
    own to the ``degree - 1`` others."""
    if ranks % degree:
        raise ValueError(f"CP degree {degree} must divide ranks ({ranks})")
    group, length = group_documents(docs, ranks // degree, degree * tokens_per_rank)
    head_start, head_end, tail_start, tail_end = head_tail_chunks(length, degree)  # [documents, degree]
    rank = group[:, None] * degree + np.arange(degree)

    def per_rank(values):
        return np.bincount(rank.ravel(), weights=values.ravel(), minlength=ranks)

    tokens = per_rank((head_end - head_start) + (tail_end - tail_start)).astype(np.int64)
    pairs = per_rank(causal_pairs(head_start, head_end) + causal_pairs(tail_start, tail_end)).astype(np.float64)
    # a rank's two chunks run as one task when they touch (the middle rank; every rank at degree 1)
    joined = (head_end == tail_start) & (head_end > head_start) & (tail_end > tail_start)
    keys = per_rank(np.where((head_end > head_start) & ~joined, head_end, 0)
                    + np.where(tail_end > tail_start, tail_end, 0))
    tasks = per_rank((head_end > head_start).astype(np.int64) + (tail_end > tail_start) - joined).astype(np.int64)
    group_tokens = np.bincount(group, weights=length, minlength=ranks // degree).astype(np.int64)
    received = (np.repeat(group_tokens, degree) - tokens) * token_bytes.kv
    sent = tokens * (degree - 1) * token_bytes.kv
    return RankLoads(tokens, pairs, keys, tasks, sent, received)


def ulysses_token_bytes(degree: int, token_bytes: TokenBytes, kv_heads: int) -> float:
    """Bytes a rank sends (and receives) per token it holds, per layer forward, in a Ulysses group of
    ``degree``: of each token's q and output all but ``1 / degree`` of the heads cross ranks, and of
    its K/V each of the other ``degree - 1`` ranks gets the K/V heads its query heads use
    (``kv_heads / degree`` of them, at least one, as DeepSpeed repeats K/V heads)."""
    return (degree - 1) * ((token_bytes.q + token_bytes.o) / degree + token_bytes.kv * ulysses_kv_share(degree, kv_heads))


def ulysses_kv_share(degree: int, kv_heads: int) -> float:
    """The fraction of a token's K/V (all K/V heads) one rank of a Ulysses group of ``degree`` holds after
    the all-to-all: ``kv_heads / degree`` of the heads, at least one (DeepSpeed repeats K/V heads)."""
    return max(1.0 / degree, 1.0 / kv_heads)


def ulysses_loads(docs: np.ndarray, ranks: int, tokens_per_rank: int, degree: int, token_bytes: TokenBytes,
                  kv_heads: int) -> RankLoads:
    """Ulysses of ``degree`` ranks per group (module docstring): every rank of group ``g`` runs its
    own ``tokens_per_rank`` tokens through the linear layers and ``1 / degree`` of the heads of every
    document of the group (its pairs and keys: the group's / degree; its tasks: the group's documents)."""
    if ranks % degree:
        raise ValueError(f"Ulysses degree {degree} must divide ranks ({ranks})")
    groups = ranks // degree
    group, length = group_documents(docs, groups, degree * tokens_per_rank)
    group_pairs = np.bincount(group, weights=document_pairs(length).astype(np.float64), minlength=groups)
    group_keys = np.bincount(group, weights=length, minlength=groups)
    group_docs = np.bincount(group, minlength=groups)
    wire = np.full(ranks, tokens_per_rank * ulysses_token_bytes(degree, token_bytes, kv_heads))
    return RankLoads(np.full(ranks, tokens_per_rank, dtype=np.int64), np.repeat(group_pairs / degree, degree),
                     np.repeat(group_keys / degree, degree), np.repeat(group_docs, degree).astype(np.int64), wire,
                     wire.copy())


def wlb_steps(batches, ranks: int, tokens_per_rank: int, threshold: int):
    """WLB-LLM-style packing of successive batches (module docstring), one step per batch.

    Returns ``(steps, left)``: per step ``(pieces, lengths)``, the pieces on the ranks (document ids
    index ``lengths``, that step's documents), and the lengths of the documents still waiting after
    the last step (their tokens are missing from the steps: compare time per token).

    A released (long) document starts on a rank holding nothing yet and, when longer than a rank,
    continues on the next ones (its pieces attend to their whole prefix, like packed ranks). Short
    documents (``<= threshold``), those left over first, then the batch's, go longest (most pairs)
    first each to the least attention-loaded rank with room for all of it; what fits nowhere waits
    for the next step."""
    if not 1 <= threshold <= tokens_per_rank:
        raise ValueError(f"WLB threshold must be between 1 and tokens_per_rank ({tokens_per_rank}), got {threshold}")
    queue, waiting, steps = deque(), [], []
    for docs in batches:
        docs = np.asarray(docs, dtype=np.int64)
        if docs.size and docs.max() > ranks * tokens_per_rank:
            raise ValueError(f"a document of {docs.max()} tokens does not fit {ranks} ranks of {tokens_per_rank}")
        queue.extend(int(n) for n in docs[docs > threshold])
        free = np.full(ranks, tokens_per_rank, dtype=np.int64)
        pairs = np.zeros(ranks, dtype=np.float64)
        rank, doc, start, end, lengths = [], [], [], [], []
        fresh = 0  # ranks [fresh, ranks) hold nothing yet
        while queue and fresh + -(-queue[0] // tokens_per_rank) <= ranks:
            n = queue.popleft()
            for s in range(0, n, tokens_per_rank):
                e = min(n, s + tokens_per_rank)
                rank.append(fresh), doc.append(len(lengths)), start.append(s), end.append(e)
                free[fresh] -= e - s
                pairs[fresh] += causal_pairs(s, e)
                fresh += 1
            lengths.append(n)
        shorts = sorted(waiting, reverse=True) + sorted((int(n) for n in docs[docs <= threshold]), reverse=True)
        waiting = []
        for n in shorts:
            fits = free >= n
            if not fits.any():
                waiting.append(n)
                continue
            r = int(np.argmin(np.where(fits, pairs, np.inf)))
            rank.append(r), doc.append(len(lengths)), start.append(0), end.append(n)
            free[r] -= n
            pairs[r] += causal_pairs(0, n)
            lengths.append(n)
        steps.append((DocumentPieces(np.array(rank, dtype=np.int64), np.array(doc, dtype=np.int64),
                                     np.array(start, dtype=np.int64), np.array(end, dtype=np.int64), ranks),
                      np.array(lengths, dtype=np.int64)))
    return steps, np.array([*queue, *waiting], dtype=np.int64)


def per_doc_cp_kv_received(pieces: DocumentPieces) -> np.ndarray:
    """``[num_ranks]`` K/V tokens each rank receives per layer under per-document CP of the documents
    that span ranks: a rank holding a piece of such a document gathers all of that document's K/V
    it does not hold (document length - its own K/V tokens of it), once per document."""
    if not pieces.num_pieces:
        return np.zeros(pieces.num_ranks, dtype=np.int64)
    length = np.zeros(int(pieces.doc.max()) + 1, dtype=np.int64)
    np.maximum.at(length, pieces.doc, pieces.end)  # a document's pieces tile [0, length)
    # one entry per (document, rank) that holds some of it, with the K/V tokens it holds
    holding, which = np.unique(pieces.doc * pieces.num_ranks + pieces.rank, return_inverse=True)
    held = np.bincount(which, weights=pieces.end - pieces.kv_start).astype(np.int64)
    doc, rank = holding // pieces.num_ranks, holding % pieces.num_ranks
    spans = np.bincount(doc, minlength=length.size)[doc] > 1  # held by more than one rank
    missing = np.where(spans, length[doc] - held, 0)
    return np.bincount(rank, weights=missing, minlength=pieces.num_ranks).astype(np.int64)


def kv_cap_tokens(pieces: DocumentPieces, config) -> int | None:
    """``config.kv_cap`` (a ``PlannerConfig``'s, the ``kv_cap`` setting) for this batch as K/V tokens one
    server may receive per layer (the unit of ``transfers.kv_received``), or ``None`` (no cap): ``"cp"``,
    per-document CP's worst rank (``per_doc_cp_kv_received``; ``None`` when no document spans ranks,
    where CP gathers nothing and the cap's target does not apply); a number, bytes, as whole tokens of
    ``config.token_bytes.kv`` (``None`` when K/V weigh no bytes), or what the colocated plan's worst
    rank receives when that is more (a spanning document's later pieces need their prefix: no cap
    refuses the colocated plan, as no ``memory_budget`` refuses what ``resend`` mode keeps).

    Both sides count the same thing: K/V tokens a rank receives in one layer's forward, which ``saved``
    mode keeps for backward (distca's servers and an all-gather CP that saves what it gathered) and
    ``resend`` mode receives again. The colocated plan always fits ``"cp"``: a rank holding piece
    ``[s, e)`` of a spanning document receives its prefix ``[0, s)`` (under a window, less), CP's rank
    the whole document but ``[s, e)``."""
    kv_cap, kv = config.kv_cap, config.token_bytes.kv
    if kv_cap is None:
        return None
    if kv_cap == "cp":
        worst = int(per_doc_cp_kv_received(pieces).max(initial=0))
        return worst if worst > 0 else None
    if isinstance(kv_cap, bool) or not isinstance(kv_cap, (int, float, np.integer, np.floating)) or not kv_cap > 0:
        raise ValueError(f"kv_cap must be 'cp', a number of bytes > 0 or None, got {kv_cap!r}")
    if kv <= 0:
        return None  # K/V of no bytes: never past it
    colocated = kv_transfers(colocated_plan(pieces, window=config.window), pieces)
    return max(int(kv_cap // kv), int(kv_received(colocated, pieces.num_ranks).max(initial=0)))
