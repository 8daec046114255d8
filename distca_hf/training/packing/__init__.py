"""Documents -> packed rows: one row of at most ``tokens_per_rank`` tokens per rank and forward.

Two layouts (``RankLayout``):

* **Spanning** (``span_ranks=True``; ``DistCATrainer``'s default when the attention-server group has
  more than one rank). The ``G`` ranks of a server group share one *global batch* of at most
  ``G * tokens_per_rank`` tokens: its documents are laid end to end as one token stream, the stream
  is cut into ``G`` consecutive slices of equal size (they differ by at most one token, so every rank
  holds the same linear work), and the group's ``j``-th rank in rank order gets slice ``j``. A
  document of up to ``G * tokens_per_rank`` tokens is never cut: where it crosses a slice boundary,
  the next rank's row starts with its continuation (``position_ids`` go on at the number of tokens
  the earlier ranks hold; contract "documents spanning ranks") and the last token of the earlier
  piece is trained to predict the first token of the next (``shift_labels``).
* **Per rank** (``span_ranks=False``, one process): every rank's row is its own micro-batch of at
  most ``tokens_per_rank`` tokens. This is the spanning layout with groups of one rank.

Nothing is lost silently. A document longer than the whole global batch (per rank: longer than
``tokens_per_rank``) is cut into chunks of that size, each trained as its own document (positions
restarting at 0); the cut is counted in a ``PackingReport``, and so are the documents that span
ranks and the empty documents (nothing to train on). Every rank gets the same number of rows per
epoch: an empty slot (a slice of a global batch too small to reach every rank, or a whole global
batch added so that every server group gets the same number) is a *filler* row of one padding token
without a label, so no rank waits alone in a collective, and every document token is in exactly one
row, so every document is trained on exactly once per epoch.

    docs = load_documents("my_corpus.jsonl", tokenizer=tokenizer)       # training.loading: input_ids
    train = PackedDataset(docs, PackingConfig(tokens_per_rank=8192), world_size=8, span_ranks=True)
    print(train.report)

Dataset index ``i`` belongs to rank ``i % world_size`` (the order in which Accelerate shards a
dataset: with batch size 1, rank ``r`` reads items ``r, r + W, r + 2W, ...``): the ``W`` items of a
block are the slices of one global batch per server group, each at its rank's index. Shuffle whole
blocks, never single items (``GlobalBatchSampler``), so that the ranks of a group run the slices of
the same global batch in the same step.

Items are ``{"input_ids": [tokens of piece 0, tokens of piece 1, ...], "first_position": p,
"last_label": t}``; ``PackedCollator`` turns one into the model inputs
``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` would emit, plus ``shift_labels``.

The files (each imports only files above it):

    rows          documents' lengths -> packed rows, pure: PackingConfig, PackedRow, PackingReport, pack_rows
    layout        RankLayout: which rank trains which row of which global batch
    dataset       PackedDataset (map-style, packed once), tokens_of, refuse_masks (columns packing would drop)
    streaming     StreamingPackedDataset (packed as the stream is read), is_streaming, stream_head_crc (what
                  ranks compare to learn that they read one stream)
    sampler       GlobalBatchSampler: whole global batches shuffled, never the rows inside them
    collator      PackedCollator: a row's items -> the model inputs
"""

from .collator import PackedCollator
from .dataset import MASKING_COLUMNS, PackedDataset, arrow_columns, refuse_masks, tokens_of
from .layout import RankLayout
from .rows import (IGNORE_INDEX, PADDING, PADDING_DOCUMENT_TOKENS, PackedRow, PackingConfig, PackingReport, Piece,
                   pack_lengths, pack_rows)
from .sampler import GlobalBatchSampler
from .streaming import STREAM_HEAD_DOCUMENTS, StreamingPackedDataset, is_streaming, stream_head_crc

__all__ = ["PackingConfig", "PackingReport", "Piece", "PackedRow", "RankLayout", "PackedDataset", "StreamingPackedDataset",
           "GlobalBatchSampler", "PackedCollator", "pack_rows", "pack_lengths", "tokens_of", "refuse_masks", "arrow_columns",
           "MASKING_COLUMNS", "is_streaming", "stream_head_crc", "STREAM_HEAD_DOCUMENTS", "IGNORE_INDEX", "PADDING",
           "PADDING_DOCUMENT_TOKENS"]
