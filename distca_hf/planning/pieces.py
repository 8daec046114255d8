"""Every rank's packed documents as *pieces*: the planner's input. Pure numpy.

A document that spans ranks appears as one piece per rank; each piece holds a query range of the
document and the K/V of those positions (and possibly K/V of earlier positions, ``kv_start``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import is_integer
from ..errors import DocumentBoundaryError
from .cost import MAX_POSITION, causal_pairs

__all__ = ["DocumentPieces", "RankDocuments", "rank_documents", "stitch_rank_documents"]


SPARE_DOCUMENT_IDS = 2**20
"""How far document ids may run past the number of pieces (ids need not be dense, but planning sizes
per-document arrays by the largest: an id of 10**12 asked numpy for terabytes)."""


@dataclass(frozen=True, eq=False)
class DocumentPieces:
    """Every rank's packed documents as pieces (arrays of shape ``[num_pieces]``, int64).

    Piece ``i`` holds the tokens ``[start[i], end[i])`` of document ``doc[i]`` on rank ``rank[i]``;
    they are queries there and also the K/V of those positions. A piece may also hold K/V of earlier
    positions without their queries: its K/V are ``[kv_start[i], end[i])`` (``kv_start`` defaults to
    ``start``; ping-pong's second nano-batch holds a cut document's prefix K/V this way), and a
    key-only piece holds no query at all (``start == end``). The K/V
    ranges of a document's pieces must not overlap and must cover ``[0, max end)`` (every K/V prefix
    exists somewhere).
    """

    rank: np.ndarray
    doc: np.ndarray
    start: np.ndarray
    end: np.ndarray
    num_ranks: int
    kv_start: np.ndarray | None = None

    def __post_init__(self):
        if self.kv_start is None:
            object.__setattr__(self, "kv_start", self.start)
        names = ("rank", "doc", "start", "end", "kv_start")
        for name in names:  # integers (floats of whole values too): 10.9 would be cut, a bool read as 0 / 1
            given = np.asarray(getattr(self, name))
            whole = given.dtype.kind in "iu" or (given.dtype.kind == "f" and bool(np.isfinite(given).all())
                                                 and bool((given == np.round(given)).all()))
            if given.ndim > 1:  # (flattened without a word before)
                raise ValueError(f"{name} must be one entry per piece (1-D), got an array of shape {given.shape}")
            if given.size and not whole:
                bad = given.reshape(-1)[:4].tolist()
                raise ValueError(f"{name} must hold integers (tokens, ranks, document ids), got {given.dtype} {bad}")
        arrays = [np.asarray(getattr(self, n), dtype=np.int64).reshape(-1) for n in names]
        if len({a.size for a in arrays}) != 1:
            raise ValueError("rank, doc, start, end and kv_start must have one entry per piece")
        for name, a in zip(names, arrays):
            object.__setattr__(self, name, a)
        if (self.kv_start > self.start).any():
            raise ValueError("a piece's kv_start must not exceed its start (its queries need their own K/V)")
        if isinstance(self.num_ranks, np.integer):
            object.__setattr__(self, "num_ranks", int(self.num_ranks))
        if not isinstance(self.num_ranks, int) or isinstance(self.num_ranks, bool) or self.num_ranks < 1:
            raise ValueError(f"num_ranks must be an integer >= 1, got {self.num_ranks!r}")
        if self.rank.size:
            if self.rank.min() < 0 or self.rank.max() >= self.num_ranks:
                raise ValueError(f"piece ranks must lie in [0, {self.num_ranks}), got {self.rank.min()}..{self.rank.max()}")
            if (self.doc < 0).any():
                raise ValueError(f"document ids must be >= 0, got {int(self.doc.min())}")
            if int(self.doc.max()) >= self.doc.size + SPARE_DOCUMENT_IDS:
                raise ValueError(f"document ids must be below {self.doc.size + SPARE_DOCUMENT_IDS} (the "
                                 f"{self.doc.size} pieces + {SPARE_DOCUMENT_IDS}), got {int(self.doc.max())}: number "
                                 "documents from 0 (planning sizes its per-document arrays by the largest id)")
            if int(self.end.max()) > MAX_POSITION:
                raise ValueError(f"a document reaches position {int(self.end.max())}; at most {MAX_POSITION} tokens "
                                 "(its pair counts would overflow int64)")
            bad = (self.kv_start < 0) | (self.end < self.start) | (self.end <= self.kv_start)
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise ValueError(f"piece {i} has an empty or negative range: K/V [{self.kv_start[i]}, {self.end[i]}), "
                                 f"queries [{self.start[i]}, {self.end[i]})")
            order = np.lexsort((self.kv_start, self.doc))
            d, s, e = self.doc[order], self.kv_start[order], self.end[order]
            first = np.ones(d.size, dtype=bool)
            first[1:] = d[1:] != d[:-1]
            expected = np.where(first, 0, np.concatenate(([0], e[:-1])))
            if (s != expected).any():
                i = int(np.flatnonzero(s != expected)[0])
                raise ValueError(
                    f"document {int(d[i])}: its pieces must tile [0, length) without gaps or overlaps; a piece "
                    f"starts at {int(s[i])} where {int(expected[i])} was expected (a K/V prefix would be missing)"
                )

    @property
    def num_pieces(self) -> int:
        return int(self.rank.size)

    @classmethod
    def from_rank_lists(cls, per_rank) -> "DocumentPieces":
        """``per_rank[r]`` is a list of ``(doc, start, end)`` (a piece) or of plain lengths (whole
        documents, numbered in order across ranks)."""
        if isinstance(per_rank, (str, bytes, dict)) or not hasattr(per_rank, "__len__"):
            raise ValueError(f"per_rank must be a list with one list of pieces per rank, got {type(per_rank).__name__}")
        rank, doc, start, end = [], [], [], []
        next_doc = 0
        for r, pieces in enumerate(per_rank):
            if isinstance(pieces, (str, bytes, dict)) or not hasattr(pieces, "__iter__"):
                raise ValueError(f"per_rank[{r}] must be a list of pieces (lengths or (doc, start, end) triples), got "
                                 f"{type(pieces).__name__} {pieces!r:.40}")
            for i, p in enumerate(pieces):
                if is_integer(p):
                    rank.append(r), doc.append(next_doc), start.append(0), end.append(int(p))
                    next_doc += 1
                elif isinstance(p, (tuple, list)) and len(p) == 3 and all(is_integer(x) for x in p):
                    d, s, e = p
                    rank.append(r), doc.append(int(d)), start.append(int(s)), end.append(int(e))
                else:
                    raise ValueError(f"per_rank[{r}][{i}] must be an integer length or a (doc, start, end) triple "
                                     f"of integers, got {p!r}")
        return cls(np.array(rank), np.array(doc), np.array(start), np.array(end), len(per_rank))

    def local_pairs(self, window: int | None = None) -> np.ndarray:
        """``[num_ranks]`` pairs each rank computes colocated (its own queries, their whole prefixes or
        the sliding ``window`` of them)."""
        pairs = causal_pairs(self.start, self.end, window)
        return np.bincount(self.rank, weights=pairs, minlength=self.num_ranks).astype(np.int64)

    def spanning_holders(self) -> dict[int, list[tuple[int, int, int]]]:
        """``{doc: [(rank, kv_start, end), ...]}`` of the documents held as several pieces (those that
        span ranks), their pieces in the order they come here; any other document's one piece holds
        all of its K/V. Only these few pieces (about two per rank in packed batches) reach Python."""
        several = np.bincount(self.doc)[self.doc] > 1 if self.num_pieces else np.zeros(0, dtype=bool)
        holders: dict[int, list[tuple[int, int, int]]] = {}
        for doc, rank, kv_start, end in zip(self.doc[several].tolist(), self.rank[several].tolist(),
                                            self.kv_start[several].tolist(), self.end[several].tolist()):
            holders.setdefault(doc, []).append((rank, kv_start, end))
        return holders

    def query_spanning(self) -> np.ndarray:
        """``[max doc + 1]`` bool: whether the document's pieces with queries lie on more than one rank
        (key-only pieces aside)."""
        has_queries = self.end > self.start
        rank, doc = self.rank[has_queries], self.doc[has_queries]
        first_rank = np.full(int(self.doc.max(initial=-1)) + 1, -1, dtype=np.int64)
        first_rank[doc[::-1]] = rank[::-1]
        spans = np.zeros(first_rank.size, dtype=bool)
        spans[doc[rank != first_rank[doc]]] = True
        return spans

    def tokens(self) -> np.ndarray:
        return np.bincount(self.rank, weights=self.end - self.start, minlength=self.num_ranks).astype(np.int64)


@dataclass(frozen=True, eq=False)
class RankDocuments:
    """Every rank's documents, numbered globally: what each rank needs to find its own in a plan.

    Attributes:
        pieces: every rank's documents as pieces (global document ids, positions in the document).
        global_ids: per rank, ``[its num_docs]`` int64 global id of each of its local documents
            (documents are numbered in rank order, so a rank's ids are distinct).
        offsets: per rank, ``[its num_docs]`` int64 position, in its document, of each local
            document's first K/V token (non-zero only for a piece that continues a document from the
            previous rank).
    """

    pieces: DocumentPieces
    global_ids: list
    offsets: list

    @property
    def longest_document(self) -> int:
        """Tokens of the longest document, all of its pieces together."""
        return int(self.pieces.end.max(initial=0))


def stitch_rank_documents(per_rank_lengths, per_rank_past, first_positions, *, span_ranks: bool) -> RankDocuments:
    """Every rank's local documents as global pieces.

    ``per_rank_lengths[r]`` / ``per_rank_past[r]``: K/V length and leading key-only tokens of each
    of rank ``r``'s local documents; ``first_positions[r]``: the position (in its document) of rank
    ``r``'s first key token. With ``span_ranks``, a rank ``r > 0`` whose first position is ``p > 0``
    continues the document that ends rank ``r - 1``'s row, which must hold exactly ``p`` tokens on
    ranks before ``r``; every other document (and every one without ``span_ranks``, whatever its
    first position: a chunk attends to itself) is its own.

    Raises:
        DocumentBoundaryError: a rank claims a continuation its predecessors do not hold (the same
            error on every rank, since every rank stitches the same gathered lengths).
    """
    global_ids, offsets = [], []
    next_id, open_doc, open_end = 0, -1, 0  # the document that ends the previous rank's row
    for r, (lengths, first) in enumerate(zip(per_rank_lengths, first_positions)):
        lengths = np.asarray(lengths, dtype=np.int64)
        ids = np.arange(next_id, next_id + lengths.size, dtype=np.int64)
        offset = np.zeros(lengths.size, dtype=np.int64)
        continues = span_ranks and r > 0 and lengths.size > 0 and int(first) > 0
        if continues:
            if open_doc < 0 or open_end != int(first):
                held = "no document" if open_doc < 0 else f"{open_end} tokens of its last document"
                raise DocumentBoundaryError(
                    f"span_ranks: rank {r}'s row starts at position {int(first)}, so it continues the document "
                    f"that ends rank {r - 1}'s row, but the ranks before it hold {held}; a continuing row must "
                    "start at the position where the previous rank's row left its last document")
            ids = ids - 1
            ids[0] = open_doc
            offset[0] = int(first)
        next_id = int(ids[-1]) + 1 if ids.size else next_id
        open_doc, open_end = (int(ids[-1]), int(offset[-1] + lengths[-1])) if lengths.size else (-1, 0)
        global_ids.append(ids)
        offsets.append(offset)
    return rank_documents(global_ids, offsets, per_rank_lengths, per_rank_past)


def rank_documents(global_ids, offsets, per_rank_lengths, per_rank_past) -> RankDocuments:
    """``RankDocuments`` from each rank's documents: global ids, offsets (position of the first K/V
    token), K/V lengths and key-only leading tokens (lists of ``[its num_docs]`` arrays)."""
    per_rank = [[np.asarray(x, dtype=np.int64).reshape(-1) for x in parts]
                for parts in zip(global_ids, offsets, per_rank_lengths, per_rank_past)]
    join = lambda column: np.concatenate([p[column] for p in per_rank]) if per_rank else np.zeros(0, np.int64)
    rank = np.repeat(np.arange(len(per_rank)), [p[0].size for p in per_rank])
    ids, offset, lengths, past = join(0), join(1), join(2), join(3)
    pieces = DocumentPieces(rank, ids, offset + past, offset + lengths, len(per_rank), kv_start=offset)
    return RankDocuments(pieces, [p[0] for p in per_rank], [p[1] for p in per_rank])
