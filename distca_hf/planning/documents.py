"""Document boundaries of a packed micro-batch.

HF hands attention a batch of rows ``[batch, seq]``. Inside a row there may be several documents
(packing), padding, or, when decoding with a KV cache, only the newest query tokens of each row.
Every later stage (tasks, plan, transfers, kernel) works on documents in the *flattened* token stream,
so this module turns whatever the caller gave into one description, in the order fixed by the
design contract: ``cu_seq_lens_q/k`` kwargs, else ``position_ids`` that restart at 0, else a 2D
padding ``attention_mask``, else one document per row.

Indices are flat: query token ``(row, i)`` is ``row * query_len + i`` and key token ``(row, j)`` is
``row * kv_len + j``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..config import is_integer
from ..errors import DocumentBoundaryError
from .cost import check_document_lengths

__all__ = ["PackedDocuments", "DocumentBoundaryError", "check_cu_seq_lens", "check_positions_agree", "find_documents"]


@dataclass(frozen=True, eq=False)
class PackedDocuments:
    """Documents of one micro-batch, as flat token offsets (all arrays int64, shape ``[num_docs]``).

    Attributes:
        lengths: tokens of each document that are keys in this call (its K/V length).
        past: leading tokens of each document that are keys but not queries (non-zero only when
            decoding with a cache); the queries of document ``d`` are its tokens ``[past, length)``.
        q_starts: flat index of each document's first query token in ``[batch * query_len]``.
        k_starts: flat index of each document's first key token in ``[batch * kv_len]``.
        num_query_tokens: ``batch * query_len``, the size of the flat query stream.
        num_key_tokens: ``batch * kv_len``, the size of the flat key stream.
    """

    lengths: np.ndarray
    past: np.ndarray
    q_starts: np.ndarray
    k_starts: np.ndarray
    num_query_tokens: int
    num_key_tokens: int

    @property
    def num_docs(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def tiles_stream(self) -> bool:
        """True when the documents cover the query and key streams exactly, in order, with no
        padding and no cache: the kernel can then read q/k/v in place, without a gather."""
        if self.num_query_tokens != self.num_key_tokens or self.past.any():
            return False
        expected_starts = np.concatenate(([0], np.cumsum(self.lengths)[:-1]))
        return (
            int(self.lengths.sum()) == self.num_query_tokens
            and np.array_equal(self.q_starts, expected_starts)
            and np.array_equal(self.k_starts, expected_starts)
        )

    @classmethod
    def from_lengths(cls, lengths) -> "PackedDocuments":
        """Documents laid end to end in one stream, with no padding and no cache."""
        try:  # integers only: [2.5, 3.7] became [2, 3], "3" and True were read as numbers, before
            lengths = check_document_lengths(lengths, "document lengths", minimum=1)
        except ValueError as e:
            raise DocumentBoundaryError(str(e)) from None
        starts = np.cumsum(lengths) - lengths
        total = int(lengths.sum())
        return cls(lengths, np.zeros_like(lengths), starts, starts.copy(), total, total)


def find_documents(
    batch_size: int,
    query_len: int,
    kv_len: int,
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
) -> PackedDocuments:
    """Find the documents of one attention call.

    Args:
        batch_size, query_len, kv_len: shape of the call; ``kv_len > query_len`` only when decoding
            with a cache (then each row is one document whose last ``query_len`` tokens are queries).
        attention_mask: optional 2D padding mask ``[batch, kv_len]`` (1/True = real token).
        position_ids: optional ``[batch or 1, query_len]`` positions; a document starts where they
            restart at 0.
        cu_seq_lens_q, cu_seq_lens_k: optional cumulative document lengths over the flattened
            ``[batch * query_len]`` stream, as ``DataCollatorWithFlattening`` emits them.

    Raises:
        DocumentBoundaryError: naming the argument that does not describe documents.
    """
    for name, value in (("batch_size", batch_size), ("query_len", query_len), ("kv_len", kv_len)):
        if not is_integer(value) or value < 1:
            raise DocumentBoundaryError(f"{name} must be an integer >= 1 (the attention call's shape), got {value!r}")
    mask = _check_mask(attention_mask, batch_size, kv_len)
    if position_ids is not None and not torch.is_tensor(position_ids):  # (ignored on the two paths below before)
        raise DocumentBoundaryError(f"position_ids must be an integer tensor [batch or 1, {query_len}], got "
                                    f"{type(position_ids).__name__}")
    if kv_len != query_len:
        if kv_len < query_len:
            raise DocumentBoundaryError(
                f"keys ({kv_len}) are fewer than queries ({query_len}); causal self-attention needs "
                "at least one key per query"
            )
        if cu_seq_lens_q is not None or cu_seq_lens_k is not None:
            raise DocumentBoundaryError(
                "cu_seq_lens_q/cu_seq_lens_k (packed documents) cannot be combined with a KV cache that "
                f"already holds tokens (kv_len={kv_len} > query_len={query_len}); decode one document per row"
            )
        docs = _documents_with_cache(batch_size, query_len, kv_len, mask)
        if torch.is_tensor(position_ids) and position_ids.dim() <= 2:  # [3, batch, seq] (multimodal) tell nothing
            _refuse_several_documents_in_cache(docs, _check_position_ids(position_ids, batch_size, query_len))
        return docs
    if cu_seq_lens_q is not None or cu_seq_lens_k is not None:
        if mask is not None and not mask.all():
            raise DocumentBoundaryError(
                "both cu_seq_lens_q/k and a padding attention_mask were given; packed inputs from "
                "DataCollatorWithFlattening carry no padding: pass one or the other"
            )
        docs = _documents_from_cu_seq_lens(cu_seq_lens_q, cu_seq_lens_k, batch_size, query_len)
        if torch.is_tensor(position_ids) and position_ids.dim() <= 2:  # [3, batch, seq] (multimodal) tell nothing
            check_positions_agree(docs, position_ids, batch_size, query_len)
        return docs
    if position_ids is not None:
        positions = _check_position_ids(position_ids, batch_size, query_len)
    else:
        positions = np.broadcast_to(np.arange(query_len, dtype=np.int64), (batch_size, query_len))
    return _documents_from_positions(positions, mask)


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu").numpy()


def _check_mask(attention_mask, batch_size: int, kv_len: int) -> np.ndarray | None:
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise DocumentBoundaryError(
            f"attention_mask must be a 2D tensor [batch, seq], got {type(attention_mask).__name__} "
            "(distca takes padding masks, position_ids or cu_seq_lens, not custom 4D or block masks)"
        )
    if attention_mask.dim() != 2:
        raise DocumentBoundaryError(
            f"attention_mask must be a 2D padding mask [batch, seq], got shape {tuple(attention_mask.shape)}: a "
            "custom 4D mask given to the model, or one a model family builds in its own code (Doge's) instead of "
            "through transformers' mask functions; distca builds the causal document mask itself (custom 4D "
            "masks are not supported)"
        )
    if attention_mask.shape[0] != batch_size or attention_mask.shape[1] < kv_len:
        raise DocumentBoundaryError(
            f"attention_mask shape {tuple(attention_mask.shape)} does not match the batch "
            f"({batch_size} rows of {kv_len} key tokens)"
        )
    mask = _to_numpy(attention_mask[:, -kv_len:])
    if mask.dtype != np.bool_:
        if not np.isin(mask, (0, 1)).all():
            raise DocumentBoundaryError("attention_mask must hold only 0/1 (or booleans): it is a padding mask")
        mask = mask.astype(bool)
    return mask


def _check_position_ids(position_ids: torch.Tensor, batch_size: int, query_len: int) -> np.ndarray:
    if not torch.is_tensor(position_ids):
        raise DocumentBoundaryError(f"position_ids must be an integer tensor [batch or 1, {query_len}], got "
                                    f"{type(position_ids).__name__}")
    if position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
    if (
        position_ids.dim() != 2
        or position_ids.shape[1] != query_len
        or position_ids.shape[0] not in (1, batch_size)
    ):
        raise DocumentBoundaryError(
            f"position_ids shape {tuple(position_ids.shape)} does not match the batch: expected "
            f"[{batch_size} or 1, {query_len}]"
        )
    if position_ids.is_floating_point() or position_ids.is_complex() or position_ids.dtype == torch.bool:
        raise DocumentBoundaryError(f"position_ids must be integers, got {position_ids.dtype}")
    return np.broadcast_to(_to_numpy(position_ids).astype(np.int64), (batch_size, query_len))


def check_cu_seq_lens(cu, name: str) -> torch.Tensor:
    """One ``cu_seq_lens`` argument as ``DataCollatorWithFlattening`` emits it: a 1-D integer tensor.
    Float or complex entries would be cut to integers and a 2-D tensor flattened without a word."""
    if not torch.is_tensor(cu):
        raise DocumentBoundaryError(
            f"{name} must be a 1-D integer tensor (torch.int32, as DataCollatorWithFlattening emits), got "
            f"{type(cu).__name__}")
    if cu.dim() != 1:
        raise DocumentBoundaryError(
            f"{name} must be 1-D (cumulative document lengths over the flattened batch), got shape {tuple(cu.shape)}")
    if cu.is_floating_point() or cu.is_complex() or cu.dtype == torch.bool:
        raise DocumentBoundaryError(f"{name} must hold integers, got {cu.dtype}")
    return cu


def check_positions_agree(docs: PackedDocuments, position_ids: torch.Tensor, batch_size: int, query_len: int, *,
                          exact: bool = False) -> None:
    """``cu_seq_lens`` (``docs``) given beside ``position_ids`` must not contradict them: a position 0
    inside a cu_seq_lens document would have RoPE start a new document where attention does not.
    Positions that run on across documents are fine (HF makes ``arange`` positions when given only
    cu_seq_lens; RoPE is relative). ``exact`` (span_ranks, where positions also say where a piece
    continues): every document must also restart at 0 (or start its row), and step by 1 inside
    (the plan places a piece's keys at its first position onwards, so a jump would give RoPE and the
    continuing document's prefix different positions)."""
    positions = _check_position_ids(position_ids, batch_size, query_len).reshape(-1)
    by_position = np.union1d(np.flatnonzero(positions == 0), np.arange(0, positions.size, query_len))
    inside = np.setdiff1d(by_position, docs.q_starts)
    running_on = np.setdiff1d(docs.q_starts, by_position) if exact else inside[:0]
    if exact and not (inside.size or running_on.size):
        continuing = np.ones(positions.size, dtype=bool)
        continuing[docs.q_starts] = False
        continuing[0] = False
        jumps = np.flatnonzero(continuing[1:] & (positions[1:] != positions[:-1] + 1)) + 1
        if jumps.size:
            token = int(jumps[0])
            raise DocumentBoundaryError(
                f"position_ids jump inside a cu_seq_lens document at flat token {token} (row {token // query_len}): "
                f"{int(positions[token])} follows {int(positions[token - 1])}; with span_ranks=True positions must "
                "increase by 1 within a document. Pass the position_ids DataCollatorWithFlattening emits with them")
    if inside.size or running_on.size:
        token = int(inside[0]) if inside.size else int(running_on[0])
        rule = (" with span_ranks=True they must describe the same documents" if exact else
                " a position 0 inside a cu_seq_lens document would split it")
        raise DocumentBoundaryError(
            f"cu_seq_lens_q and position_ids disagree at flat token {token} (row {token // query_len}): cu_seq_lens_q "
            f"start documents at {docs.q_starts.tolist()[:8]}, position_ids restart at 0 at "
            f"{by_position.tolist()[:8]};{rule}. Pass the position_ids DataCollatorWithFlattening emits with them")


def _documents_from_cu_seq_lens(cu_q, cu_k, batch_size: int, query_len: int) -> PackedDocuments:
    total_tokens = batch_size * query_len
    if cu_q is None or cu_k is None:
        raise DocumentBoundaryError("cu_seq_lens_q and cu_seq_lens_k must be given together")
    cu_q_np = _to_numpy(check_cu_seq_lens(cu_q, "cu_seq_lens_q")).astype(np.int64)
    cu_k_np = _to_numpy(check_cu_seq_lens(cu_k, "cu_seq_lens_k")).astype(np.int64)
    if not np.array_equal(cu_q_np, cu_k_np):
        raise DocumentBoundaryError(
            "cu_seq_lens_q and cu_seq_lens_k differ; causal self-attention over packed documents needs "
            f"the same boundaries for queries and keys (got {cu_q_np.tolist()[:8]}... vs {cu_k_np.tolist()[:8]}...)"
        )
    if cu_q_np.size < 2 or cu_q_np[0] != 0 or (np.diff(cu_q_np) < 0).any():
        raise DocumentBoundaryError(
            f"cu_seq_lens_q must start at 0 and never decrease, got {cu_q_np.tolist()[:16]}"
        )
    if cu_q_np[-1] != total_tokens:
        raise DocumentBoundaryError(
            f"cu_seq_lens_q ends at {int(cu_q_np[-1])} but the batch holds {total_tokens} tokens "
            "(batch * seq_len); the cumulative lengths must cover the flattened sequence exactly"
        )
    crossing = np.setdiff1d(np.arange(query_len, total_tokens, query_len), cu_q_np)
    if crossing.size:
        raise DocumentBoundaryError(
            f"cu_seq_lens_q has a document that crosses from row {int(crossing[0]) // query_len - 1} into the next "
            f"(no boundary at token {int(crossing[0])}); with batch > 1 every row must start a document"
        )
    lengths = np.diff(cu_q_np)
    keep = lengths > 0  # zero-length entries (e.g. trailing padding documents) hold no tokens
    starts = cu_q_np[:-1][keep]
    lengths = lengths[keep]
    return PackedDocuments(lengths, np.zeros_like(lengths), starts, starts.copy(), total_tokens, total_tokens)


def _documents_from_positions(positions: np.ndarray, mask: np.ndarray | None) -> PackedDocuments:
    batch_size, seq_len = positions.shape
    valid = np.ones((batch_size, seq_len), dtype=bool) if mask is None else mask
    flat_pos = positions.reshape(-1)
    flat_valid = valid.reshape(-1)
    row_start = np.zeros(batch_size * seq_len, dtype=bool)
    row_start[::seq_len] = True

    prev_valid = np.empty_like(flat_valid)
    prev_valid[0] = False
    prev_valid[1:] = flat_valid[:-1]
    prev_valid &= ~row_start
    prev_pos = np.empty_like(flat_pos)
    prev_pos[0] = -1
    prev_pos[1:] = flat_pos[:-1]

    negative = flat_valid & (flat_pos < 0)
    if negative.any():
        i = int(np.flatnonzero(negative)[0])
        raise DocumentBoundaryError(
            f"position_ids[{i // seq_len}, {i % seq_len}] = {int(flat_pos[i])} is negative"
        )
    # Only the first real token of a row may begin mid-document (left padding, or a chunk cut from a
    # longer text): rotary embeddings are relative, so the attention is the same as from position 0.
    first_valid_of_row = flat_valid & _first_true_per_row(valid).reshape(-1)
    starts_doc = flat_valid & (first_valid_of_row | (flat_pos == 0))
    continues = flat_valid & ~starts_doc
    broken = continues & (~prev_valid | (flat_pos != prev_pos + 1))
    if broken.any():
        i = int(np.flatnonzero(broken)[0])
        row, col = divmod(i, seq_len)
        if not prev_valid[i]:
            raise DocumentBoundaryError(
                f"attention_mask row {row} has padding inside the row before token {col} (position "
                f"{int(flat_pos[i])}); padding must sit at the ends of a row, or the document after it "
                "must restart position_ids at 0"
            )
        raise DocumentBoundaryError(
            f"position_ids do not describe documents: position_ids[{row}, {col}] = {int(flat_pos[i])} follows "
            f"{int(prev_pos[i])}; within a document positions must increase by 1, and a new document "
            "must restart at 0"
        )
    starts = np.flatnonzero(starts_doc)
    next_continues = np.zeros_like(continues)
    next_continues[:-1] = continues[1:]
    ends = np.flatnonzero(flat_valid & ~next_continues) + 1
    lengths = (ends - starts).astype(np.int64)
    starts = starts.astype(np.int64)
    total = batch_size * seq_len
    return PackedDocuments(lengths, np.zeros_like(lengths), starts, starts.copy(), total, total)


def _first_true_per_row(valid: np.ndarray) -> np.ndarray:
    first = np.zeros_like(valid)
    has_any = valid.any(axis=1)
    first[np.flatnonzero(has_any), valid.argmax(axis=1)[has_any]] = True
    return first


def _refuse_several_documents_in_cache(docs: PackedDocuments, positions: np.ndarray) -> None:
    """Decoding treats each cached row as one document. Queries at a position below the row's cached
    tokens (or restarting among themselves) say the row holds several documents (a packed prefill):
    its cached keys of earlier documents would be attended to, so refuse, as ``cu_seq_lens`` with a
    cache are refused. A position above the cached tokens is a chunk cut from a longer text (or
    positions counted over left padding): the row is still one document."""
    query_len = positions.shape[1]
    restarts = (np.diff(positions, axis=1) != 1).any(axis=1)
    before = positions[:, 0] < docs.past
    bad = np.flatnonzero(restarts | before)
    if bad.size:
        row = int(bad[0])
        raise DocumentBoundaryError(
            f"position_ids row {row} ({positions[row, :8].tolist()}) do not continue the {int(docs.past[row])} tokens "
            f"the KV cache holds for that row (the next position would be {int(docs.past[row])}, and the {query_len} "
            "queries must count up from it): the cached row holds several documents (a packed prefill), which a "
            "decoding step cannot keep apart; decode one document per row"
        )


def _documents_with_cache(batch_size: int, query_len: int, kv_len: int, mask: np.ndarray | None) -> PackedDocuments:
    """Decoding: row ``b`` is one document made of its real key tokens; its last ``query_len``
    tokens are the queries, aligned bottom-right like every CA-task."""
    if mask is None:
        mask = np.ones((batch_size, kv_len), dtype=bool)
    lengths, k_starts = [], []
    for row in range(batch_size):
        real = np.flatnonzero(mask[row])
        if real.size == 0 or real[-1] - real[0] + 1 != real.size:
            raise DocumentBoundaryError(
                f"attention_mask row {row} must be one run of real tokens (left or right padding) when "
                "decoding with a cache"
            )
        if real[-1] != kv_len - 1 or real.size < query_len:
            raise DocumentBoundaryError(
                f"attention_mask row {row}: the {query_len} newest tokens must be real (use left padding "
                "when generating)"
            )
        lengths.append(real.size)
        k_starts.append(row * kv_len + int(real[0]))
    lengths_np = np.asarray(lengths, dtype=np.int64)
    q_starts = np.arange(batch_size, dtype=np.int64) * query_len
    return PackedDocuments(
        lengths_np,
        lengths_np - query_len,
        q_starts,
        np.asarray(k_starts, dtype=np.int64),
        batch_size * query_len,
        batch_size * kv_len,
    )
