"""Documents' lengths -> packed rows (pure): ``PackingConfig`` in, ``PackedRow`` s and a
``PackingReport`` out.

Documents are laid end to end into global batches (next-fit in order, or best-fit decreasing inside
windows with ``length_aware``), a document longer than a global batch cut into chunks, a step's
global batches optionally balanced for attention, and each global batch cut into its ranks'
consecutive slices (``pack_rows``). No torch here: the datasets (``dataset``, ``streaming``) read
the rows.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterable, Iterator, NamedTuple, Sequence

import numpy as np

from ...config import INT32_MAX, is_integer


IGNORE_INDEX = -100
"""The label of a token that is not trained (``transformers``' ``ignore_index``)."""


PADDING = "<padding>"
"""The document key of the padding that fills a global batch to ``group size * tokens_per_rank`` tokens when
rows must all have ``tokens_per_rank`` tokens (``full_rows``: pipeline stages receive fixed shapes)."""


PADDING_DOCUMENT_TOKENS = 128
"""Padding is laid out as documents of at most this many tokens: its attention cost stays small (a few
quadratic 128-token blocks) and it never forms one long document the planner would have to spread."""


class Piece(NamedTuple):
    """Tokens ``[start, end)`` of a document (offsets in tokens from the document's start)."""

    document: object  # the document's key: its index, or (streaming) its token list
    start: int
    end: int


@dataclass(frozen=True)
class PackedRow:
    """One rank's row of a global batch.

    Attributes:
        pieces: ``Piece`` s in row order; empty for a filler slot.
        first_position: position (tokens from the start of its document, or of its chunk when the
            document was cut) of the row's first token; ``> 0``: the row continues the document
            that ends the previous rank's row. Every later piece starts a document (position 0).
        continues: the row's last document goes on in the next rank's row, so its last token is
            trained to predict that row's first token.
    """

    pieces: tuple = ()
    first_position: int = 0
    continues: bool = False

    @property
    def tokens(self) -> int:
        return sum(p.end - p.start for p in self.pieces)

    @property
    def padding_tokens(self) -> int:
        """Trailing padding tokens (``full_rows``): no label, never a document's token."""
        return sum(p.end - p.start for p in self.pieces if p.document is PADDING)

    @property
    def label_tokens(self) -> int:
        """Tokens of the row that predict a successor in their document (each piece's last token has
        none, unless the document continues on the next rank); padding has none."""
        real = [p for p in self.pieces if p.document is not PADDING]
        continues = self.continues and bool(self.pieces) and self.pieces[-1].document is not PADDING
        return sum(p.end - p.start for p in real) - len(real) + int(continues)


@dataclass(frozen=True)
class PackingConfig:
    """How documents are packed into rows.

    Attributes:
        tokens_per_rank: token budget of one row (one rank, one forward).
        length_aware: ``False``: documents keep their (shuffled) order and fill global batches one
            after the other (next-fit). ``True``: inside each window of ``window`` documents they
            are sorted by length and packed best-fit decreasing into global batches, giving fuller
            rows (fewer per epoch) at the price of grouping documents by length.
        window: documents per sorting window for ``length_aware`` (also what streaming holds in memory).
        shuffle: shuffle the document order before packing (map-style datasets; seeded).
        seed: seed of that shuffle, an integer: every process packs the same rows from it (ranks
            read slices of one packing).
        pad_token_id: the token of filler rows (never a label).
        balance_micro_batches: the global batches of one optimizer step (``micro_batches`` per server
            group, ``PackedDataset(step_micro_batches=...)``: ``DistCATrainer`` in pipeline stages passes its
            micro-batches per step) are packed
            again so that none holds much more attention than the others
            (``planning.balance_micro_batches``, at equal tokens): the cheap balance of a step's
            micro-batches any user can do, before CAD balances the ranks inside each. A document is
            never cut for it (a step whose balance would cut one keeps its in-order packing, counted
            in ``PackingReport.unbalanced_steps``).
    """

    tokens_per_rank: int
    length_aware: bool = False
    window: int = 1024
    shuffle: bool = True
    seed: int = 0
    pad_token_id: int = 0
    balance_micro_batches: bool = False

    def __post_init__(self):
        # numpy integers (np.int64(4096), a size computed with numpy) are integers: checked and kept as int
        for name, minimum, what in (("tokens_per_rank", 2, " (tokens)"), ("window", 1, " (documents)"),
                                    ("pad_token_id", 0, " (a token id)")):
            object.__setattr__(self, name, check_integer(name, getattr(self, name), minimum, what))
        object.__setattr__(self, "seed", check_seed(self.seed))
        for name in ("length_aware", "shuffle", "balance_micro_batches"):
            object.__setattr__(self, name, check_flag(name, getattr(self, name)))


@dataclass
class PackingReport:
    """What packing did (counts of documents, rows and tokens).

    Attributes:
        tokens_per_rank: the row budget (tokens).
        group_size: ranks sharing one global batch (1: every rank packs its own row).
        documents: documents read (empty ones included).
        tokens: their tokens.
        empty_documents: documents with no token (nothing to train; skipped).
        cut_documents: documents longer than a global batch (``group_size * tokens_per_rank``
            tokens), cut into chunks that train as their own documents.
        chunks: the chunks those documents became.
        spanning_documents: documents whose tokens lie on more than one rank (a chunk of a cut
            document counts as one document); each trains whole, its pieces attending to their prefix.
        global_batches: packed global batches of ``group_size`` rows (fillers excluded).
        micro_batches: rows holding document tokens.
        filler_micro_batches: filler rows (one padding token, no label): slots of a global batch too
            small to reach every rank, and the rows of global batches added so every rank gets the
            same number.
        longest_document: tokens of the longest document.
        balanced_steps: optimizer steps whose global batches were packed balanced for attention
            (``PackingConfig.balance_micro_batches``).
        unbalanced_steps: steps kept in order because balancing them would have cut a document.
    """

    tokens_per_rank: int
    group_size: int = 1
    documents: int = 0
    tokens: int = 0
    empty_documents: int = 0
    cut_documents: int = 0
    chunks: int = 0
    spanning_documents: int = 0
    global_batches: int = 0
    micro_batches: int = 0
    filler_micro_batches: int = 0
    longest_document: int = 0
    balanced_steps: int = 0
    unbalanced_steps: int = 0

    @property
    def global_batch_tokens(self) -> int:
        """Token budget of one global batch: the longest document trained whole."""
        return self.group_size * self.tokens_per_rank

    @property
    def fill(self) -> float:
        """Fraction of the packed global batches' token budget holding document tokens."""
        return self.tokens / max(1, self.global_batches * self.global_batch_tokens)

    def __str__(self) -> str:
        head = f"{self.documents} documents, {self.tokens} tokens (longest {self.longest_document}) -> "
        if self.group_size == 1:
            text = head + (f"{self.micro_batches} micro-batches of <= {self.tokens_per_rank} tokens "
                           f"(fill {self.fill:.1%})")
        else:
            text = head + (f"{self.global_batches} global batches of {self.group_size} x {self.tokens_per_rank} "
                           f"tokens (fill {self.fill:.1%})")
        if self.filler_micro_batches:
            text += f" + {self.filler_micro_batches} filler micro-batch(es) so every rank gets the same number"
        if self.group_size > 1:
            text += (f"; {self.spanning_documents} document(s) span ranks (trained whole, up to "
                     f"{self.global_batch_tokens} tokens)")
        text += (f"; {self.cut_documents} document(s) longer than {self.global_batch_tokens} tokens cut into "
                 f"{self.chunks} chunks (each chunk trains as its own document)")
        if self.empty_documents:
            text += f"; {self.empty_documents} empty document(s) skipped"
        if self.balanced_steps or self.unbalanced_steps:
            text += (f"; {self.balanced_steps} of {self.balanced_steps + self.unbalanced_steps} steps' micro-batches "
                     "balanced for attention")
        return text


class _Sequence(NamedTuple):
    """What trains as one document: a whole document, or a chunk of one cut to fit a global batch."""

    document: object
    start: int
    end: int


def _sequences_of(key, length: int, budget: int, report: PackingReport) -> Iterator[_Sequence]:
    """A document as sequences of at most ``budget`` tokens (chunks when longer), counted in ``report``."""
    report.documents += 1
    report.tokens += length
    report.longest_document = max(report.longest_document, length)
    if length == 0:
        report.empty_documents += 1
        return
    if length > budget:
        report.cut_documents += 1
        report.chunks += -(-length // budget)
    for start in range(0, length, budget):
        yield _Sequence(key, start, min(length, start + budget))


def _global_batches(documents: Iterable[tuple], config: PackingConfig, budget: int,
                    report: PackingReport) -> Iterator[list[_Sequence]]:
    """Global batches (lists of sequences, at most ``budget`` tokens each) from ``(key, length)``
    pairs, in order; see ``PackingConfig``."""
    if not config.length_aware:
        current, used = [], 0
        for key, length in documents:
            for sequence in _sequences_of(key, length, budget, report):
                size = sequence.end - sequence.start
                if used + size > budget:
                    yield current
                    current, used = [], 0
                current.append(sequence)
                used += size
        if current:
            yield current
        return
    window: list[_Sequence] = []
    documents_in_window = 0
    for key, length in documents:
        window.extend(_sequences_of(key, length, budget, report))
        documents_in_window += 1
        if documents_in_window == config.window:
            yield from _best_fit_decreasing(window, budget)
            window, documents_in_window = [], 0
    yield from _best_fit_decreasing(window, budget)


def _best_fit_decreasing(sequences: list[_Sequence], budget: int) -> Iterator[list[_Sequence]]:
    """Longest sequence first, each into the open global batch it fills best (or a new one)."""
    bins: list[list[_Sequence]] = []
    room: list[int] = []
    for sequence in sorted(sequences, key=lambda s: s.end - s.start, reverse=True):
        size = sequence.end - sequence.start
        best = min((i for i, r in enumerate(room) if r >= size), key=lambda i: room[i], default=None)
        if best is None:
            bins.append([sequence])
            room.append(budget - size)
        else:
            bins[best].append(sequence)
            room[best] -= size
    yield from bins


def _balanced_steps(global_batches: Iterator[list[_Sequence]], step_batches: int, budget: int,
                    report: PackingReport) -> Iterator[list[_Sequence]]:
    """``global_batches`` in groups of ``step_batches`` (one optimizer step), each group's sequences
    packed again into as many global batches balanced for attention pairs
    (``planning.balance_micro_batches``); a group whose balanced packing would cut a sequence stays
    as it was."""
    from ...planning import balance_micro_batches

    def balanced(step: list[list[_Sequence]]) -> list[list[_Sequence]]:
        sequences = [s for batch in step for s in batch]
        pieces = balance_micro_batches([s.end - s.start for s in sequences], micro_batches=len(step),
                                       tokens=budget)
        if len(pieces.doc) != len(sequences):  # a sequence was cut over two global batches
            report.unbalanced_steps += 1
            return step
        report.balanced_steps += 1
        rows: list[list[_Sequence]] = [[] for _ in step]
        for row, index in sorted(zip(pieces.rank.tolist(), pieces.doc.tolist())):
            rows[row].append(sequences[index])
        return rows

    step: list[list[_Sequence]] = []
    for batch in global_batches:
        step.append(batch)
        if len(step) == step_batches:
            yield from balanced(step)
            step = []
    if step:
        yield from balanced(step)


def _slice(global_batch: list[_Sequence], group_size: int, report: PackingReport) -> list[PackedRow]:
    """The ``group_size`` rows of one global batch: its token stream cut into consecutive slices whose
    sizes differ by at most one token (earlier ranks take the extra ones; a slice is empty only when
    the batch holds fewer tokens than ranks)."""
    total = sum(s.end - s.start for s in global_batch)
    sizes = [total // group_size + (rank < total % group_size) for rank in range(group_size)]
    rows = []
    current, head = 0, 0  # the sequence being placed, and how many of its tokens earlier rows took
    for size in sizes:
        pieces, first_position = [], head
        while size > 0:
            sequence = global_batch[current]
            start = sequence.start + head
            take = min(size, sequence.end - start)
            pieces.append(Piece(sequence.document, start, start + take))
            size -= take
            head += take
            if start + take == sequence.end:
                if head > take and sequence.document is not PADDING:  # earlier rows hold some of it: it spans ranks
                    report.spanning_documents += 1
                current, head = current + 1, 0
        rows.append(PackedRow(tuple(pieces), first_position if pieces else 0, continues=head > 0))
    return rows


def global_batch_rows(documents: Iterable[tuple], config: PackingConfig, group_size: int,
          report: PackingReport, full_rows: bool = False, step_batches: int = 1) -> Iterator[list[PackedRow]]:
    """Every global batch's ``group_size`` rows, in order, counted in ``report``; with ``full_rows`` each
    global batch is filled up with padding documents so that every row has ``tokens_per_rank`` tokens;
    with ``config.balance_micro_batches`` every ``step_batches`` global batches are balanced together."""
    budget = group_size * config.tokens_per_rank
    global_batches = _global_batches(documents, config, budget, report)
    if config.balance_micro_batches and step_batches > 1:
        global_batches = _balanced_steps(global_batches, step_batches, budget, report)
    for global_batch in global_batches:
        if full_rows:
            free = budget - sum(s.end - s.start for s in global_batch)
            global_batch = global_batch + [_Sequence(PADDING, start, min(free, start + PADDING_DOCUMENT_TOKENS))
                                           for start in range(0, free, PADDING_DOCUMENT_TOKENS)]
        rows = _slice(global_batch, group_size, report)
        report.global_batches += 1
        report.micro_batches += sum(1 for row in rows if row.pieces)
        report.filler_micro_batches += sum(1 for row in rows if not row.pieces)
        yield rows


def pack_rows(lengths: Sequence[int], config: PackingConfig, *, group_size: int = 1, full_rows: bool = False,
              step_batches: int = 1) -> tuple[list[PackedRow], PackingReport]:
    """Pack documents given by their lengths (tokens) into global batches of ``group_size`` rows.

    Returns the rows, global batch ``g``'s slice ``j`` at index ``g * group_size + j`` (an empty row
    is a filler slot), and the report. The documents' order is shuffled first when
    ``config.shuffle``; pieces name documents by their index in ``lengths``. ``full_rows``: every row
    has exactly ``tokens_per_rank`` tokens, the free room of a global batch filled with padding
    documents (key ``PADDING``, no labels) at the end of its token stream. ``step_batches``: global
    batches per optimizer step, balanced together when ``config.balance_micro_batches``."""
    if not isinstance(config, PackingConfig):
        raise TypeError(f"config must be a PackingConfig, got {type(config).__name__}")
    group_size = check_positive("group_size", group_size)
    full_rows, step_batches = check_flag("full_rows", full_rows), check_positive("step_batches", step_batches)
    lengths = _check_lengths(lengths)
    order = list(range(len(lengths)))
    if config.shuffle:
        random.Random(config.seed).shuffle(order)
    report = PackingReport(config.tokens_per_rank, group_size)
    rows = [row for batch in global_batch_rows(((i, lengths[i]) for i in order), config, group_size, report, full_rows,
                                   step_batches) for row in batch]
    return rows, report


def pack_lengths(lengths: Sequence[int], config: PackingConfig) -> tuple[list[list[Piece]], PackingReport]:
    """Per-rank packing (each row its own micro-batch): the micro-batches, each a list of
    ``(document index, start, end)``, and the report (no fillers: see ``PackedDataset``)."""
    rows, report = pack_rows(lengths, config, group_size=1)
    return [list(row.pieces) for row in rows], report


def _check_lengths(lengths) -> list[int]:
    """``lengths`` as ints, each an integer >= 0 (a negative or fractional length is refused, naming
    its document)."""
    checked = []
    for index, length in enumerate(lengths):
        if not is_integer(length) or length < 0:
            raise ValueError(f"lengths[{index}] must be a document length, an integer >= 0 (tokens), got {length!r}")
        checked.append(int(length))
    return checked


MAX_COUNT = INT32_MAX
"""The largest token count, token id, rank count or step size packing takes (``config.INT32_MAX``:
10**30 overflowed in the collator, 2**40 tokens a row or 10**12 ranks ran for ever)."""


MAX_RANKS = 2**20
"""The most ranks packing lays rows out for (``RankLayout`` holds an entry per rank: 2**31 - 1 ranks
ran for ever)."""


def check_positive(name: str, value) -> int:
    """``value`` as an int, refused (naming ``name``) unless an integer from 1 to ``MAX_COUNT``."""
    return check_integer(name, value, 1)


def check_integer(name: str, value, minimum: int, what: str = "", maximum: int = MAX_COUNT) -> int:
    """``value`` as an int (numpy integers too), refused (naming ``name``, and ``what`` it counts) unless
    an integer from ``minimum`` to ``maximum``."""
    if not is_integer(value) or not minimum <= value <= maximum:
        raise ValueError(f"{name} must be an integer from {minimum} to {maximum}{what}, got {value!r}")
    return int(value)


SEED_RANGE = (-(2**63), 2**64 - 1)
"""The seeds torch's generators take (``torch.Generator.manual_seed``)."""


def check_seed(value) -> int:
    """``value`` as an int, refused (naming ``seed``) unless an integer in ``SEED_RANGE``: every process
    must draw the same order from it (None would seed each one from the OS)."""
    if not is_integer(value) or not SEED_RANGE[0] <= value <= SEED_RANGE[1]:
        raise ValueError(f"seed must be an integer from -2**63 to 2**64 - 1 (every process must draw the same order "
                         f"from it; None would seed each process from the OS), got {value!r}")
    return int(value)


def check_flag(name: str, value) -> bool:
    """``value`` as a bool (numpy bools too), refused (naming ``name``) unless True or False."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return bool(value)
