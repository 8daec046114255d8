"""Packed row items -> model inputs (``PackedCollator``): what ``DataCollatorWithFlattening(
return_flash_attn_kwargs=True)`` emits, plus ``shift_labels`` for documents that go on in the next rank's row."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from .dataset import tokens_of
from .rows import IGNORE_INDEX, MAX_COUNT, check_integer, is_integer


@dataclass
class PackedCollator:
    """Packed row items -> model inputs, one row.

    The pieces of all items are concatenated into one row (the trainer uses one item per rank and
    forward). Returns what ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` emits, plus
    ``shift_labels``, for a row of ``N`` tokens:

    * ``input_ids``, ``position_ids``, ``labels``, ``shift_labels``: ``[1, N]`` int64. Positions
      restart at 0 per piece, except that the row's first piece starts at the item's
      ``first_position`` (it continues a document from the previous rank). ``labels`` are the
      tokens, -100 where a document starts (nothing precedes the token in its document).
      ``shift_labels[i]`` is the target of token ``i``: token ``i + 1`` when it belongs to the same
      document, else -100; for the row's last token, the item's ``last_label`` (the first token of
      the next rank's row when the document continues there). This is what transformers' causal-LM
      loss uses when given (every token with a successor in its document is trained once, the rank
      boundaries included).
    * ``cu_seq_lens_q`` / ``cu_seq_lens_k``: ``[pieces + 1]`` int32 offsets of the row's local pieces
      (a continuing piece is the row's first "document", with its local length);
      ``max_length_q`` / ``max_length_k``: the longest piece (int).

    Items without ``first_position`` / ``last_label`` are whole documents. An item's ``padding``
    (``PackedDataset(full_rows=True)``) counts its trailing padding tokens: their ``labels`` and
    ``shift_labels`` are -100.
    """

    item_keys: ClassVar[frozenset] = frozenset({"input_ids", "first_position", "last_label", "padding"})
    """The keys of a packed row's item (``dataset.row_item``), all that the collator reads (a subclass
    reading more adds them); an item with another key is refused rather than the key dropped."""

    vocab_size: int | None = None
    """The model's; a token id at or above it is refused here, naming the id, rather than failing
    inside the embedding (an IndexError on CPU, a device-side assert on CUDA)."""

    def __post_init__(self):
        if self.vocab_size is not None:  # ("100" failed comparing, -1 blamed the documents)
            self.vocab_size = check_integer("PackedCollator.vocab_size", self.vocab_size, 1,
                                            " (the model's vocabulary)")

    def __call__(self, items: list[dict]) -> dict:
        pieces: list[list[int]] = []
        first_position, last_label, padding = 0, IGNORE_INDEX, 0
        for index, item in enumerate(items):
            if not isinstance(item, dict) or "input_ids" not in item:
                raise ValueError("PackedCollator expects items {'input_ids': [piece tokens, ...]} from a "
                                 f"PackedDataset, got {type(item).__name__}")
            position = _integer_key(item, index, "first_position", 0)
            label = _integer_key(item, index, "last_label", IGNORE_INDEX)
            if position > MAX_COUNT or label > MAX_COUNT:  # (10**30 overflowed int64 in torch, unnamed)
                raise ValueError(f"PackedCollator: item {index} has first_position={position} and last_label={label}; "
                                 f"a position or a token id is at most {MAX_COUNT}")
            if position < 0 or (position > 0 and (index > 0 or not item["input_ids"])):
                raise ValueError(f"PackedCollator: item {index} has first_position={position}; only the row's first "
                                 "piece can continue a document (first_position > 0), and positions are >= 0")
            if label != IGNORE_INDEX and (label < 0 or index < len(items) - 1 or not item["input_ids"]):
                raise ValueError(f"PackedCollator: item {index} has last_label={label}; only the row's last piece can "
                                 "continue on the next rank, and its label is a token id >= 0")
            if index == 0:
                first_position = position
            last_label = label
            if isinstance(item["input_ids"], (str, bytes)) or not hasattr(item["input_ids"], "__iter__"):
                raise ValueError(f"PackedCollator: item {index}'s input_ids must be a list of pieces (token-id lists), "
                                 f"got {type(item['input_ids']).__name__}")
            flat = item["input_ids"]
            if (isinstance(flat, (list, tuple)) and flat and is_integer(flat[0])) or \
                    (isinstance(flat, (torch.Tensor, np.ndarray)) and flat.ndim == 1 and flat.dtype != object):
                raise ValueError(f"PackedCollator: item {index}'s input_ids is one flat list of token ids; the "
                                 "collator reads the rows of PackedDataset / StreamingPackedDataset (input_ids: a list "
                                 "of pieces, each a token-id list): pack the documents with one of them first")
            if "labels" in item:  # dropped without a word before (its -100 masks lost)
                raise ValueError(f"PackedCollator: item {index} has labels, which it does not read: its labels are the "
                                 "pieces' next tokens; to mask tokens (a prompt), use distca_hf.training.trl's "
                                 "SFTPackedDataset / SFTPackedCollator, whose rows carry their labels")
            unread = sorted(set(item) - self.item_keys)
            if unread:  # (dropped without a word before)
                raise ValueError(f"PackedCollator: item {index} has {unread}, which it does not read: it makes the "
                                 "positions and the attention layout from the pieces (items hold "
                                 f"{sorted(self.item_keys)}); drop them")
            own = [tokens_of(p, what=f"PackedCollator: item {index}'s input_ids[{j}] (a piece)")
                   for j, p in enumerate(item["input_ids"])]
            pieces.extend(own)
            padding, tokens = _integer_key(item, index, "padding", 0), sum(len(p) for p in own)
            if not 0 <= padding <= tokens:
                raise ValueError(f"PackedCollator: item {index} has padding={padding}; it counts the item's trailing "
                                 f"padding tokens: an integer from 0 to its {tokens} tokens")
            if padding and (index < len(items) - 1 or label != IGNORE_INDEX):
                raise ValueError(f"PackedCollator: item {index} has padding={padding}; only the row's last item can "
                                 "end in padding, and padding has no label (last_label -100)")
        if not pieces or any(len(p) == 0 for p in pieces):
            raise ValueError("PackedCollator: a row needs at least one piece and no empty piece")
        lengths = [len(p) for p in pieces]
        input_ids = torch.tensor([t for p in pieces for t in p], dtype=torch.int64).unsqueeze(0)
        if self.vocab_size is not None and int(input_ids.max()) >= self.vocab_size:
            raise ValueError(f"PackedCollator: token id {int(input_ids.max())} is not below the model's vocab_size "
                             f"{self.vocab_size}; the documents were tokenized for another vocabulary (or "
                             "PackingConfig.pad_token_id is too large)")
        starts = [first_position] + [0] * (len(pieces) - 1)
        position_ids = torch.cat([torch.arange(s, s + n, dtype=torch.int64)
                                  for s, n in zip(starts, lengths)]).unsqueeze(0)
        labels = input_ids.clone()
        labels[position_ids == 0] = IGNORE_INDEX
        if padding:
            labels[:, -padding:] = IGNORE_INDEX
        shift_labels = torch.cat([labels[:, 1:], torch.tensor([[last_label]], dtype=torch.int64)], dim=1)
        cu_seq_lens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        longest = max(lengths)
        return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids,
                "cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens,
                "max_length_q": longest, "max_length_k": longest, "shift_labels": shift_labels}


def _integer_key(item: dict, index: int, key: str, default: int) -> int:
    """``item[key]`` (``default`` when absent) as an int; anything but an integer is refused, naming the key."""
    value = item.get(key, default)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = value.item()
    if not is_integer(value):
        raise ValueError(f"PackedCollator: item {index} has {key}={value!r}; expected an integer")
    return int(value)
