"""Document boundaries from every input form, and CA-task cost accounting."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distca_hf import CATask, DocumentBoundaryError, find_documents, split_document
from distca_hf.planning import DocumentPieces, attention_flops, causal_pairs


@settings(max_examples=80, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.lists(st.integers(1, 12), min_size=1, max_size=4), st.integers(0, 5)),
        min_size=1,
        max_size=4,
    ),
    use_mask=st.booleans(),
)
def test_documents_from_position_ids_and_padding(rows, use_mask):
    """Rows of packed documents followed by padding: every document is found, in order."""
    width = max(sum(lengths) + pad for lengths, pad in rows)
    positions = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    expected_lengths, expected_starts = [], []
    for r, (lengths, _) in enumerate(rows):
        col = 0
        for n in lengths:
            positions[r, col : col + n] = torch.arange(n)
            mask[r, col : col + n] = 1
            expected_lengths.append(n)
            expected_starts.append(r * width + col)
            col += n
        if not use_mask:  # without a mask the tail is one more document (positions restart at 0)
            if col < width:
                positions[r, col:] = torch.arange(width - col)
                expected_lengths.append(width - col)
                expected_starts.append(r * width + col)
    docs = find_documents(len(rows), width, width, attention_mask=mask if use_mask else None, position_ids=positions)
    assert docs.lengths.tolist() == expected_lengths
    assert docs.q_starts.tolist() == expected_starts == docs.k_starts.tolist()
    assert not docs.past.any()


def test_plain_rows_and_shared_position_ids():
    docs = find_documents(3, 5, 5)
    assert docs.lengths.tolist() == [5, 5, 5] and docs.q_starts.tolist() == [0, 5, 10]
    docs = find_documents(2, 6, 6, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]))  # [1, S] broadcast
    assert docs.lengths.tolist() == [3, 3, 3, 3]


def test_left_padding_and_chunks_that_start_mid_document():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    docs = find_documents(2, 5, 5, attention_mask=mask, position_ids=torch.arange(5).expand(2, 5))
    assert docs.lengths.tolist() == [3, 5] and docs.q_starts.tolist() == [2, 5]
    # a row that begins inside a document (a chunk of a longer text) is one document
    docs = find_documents(1, 6, 6, position_ids=torch.tensor([[7, 8, 9, 0, 1, 2]]))
    assert docs.lengths.tolist() == [3, 3]


def test_cu_seq_lens_take_precedence_and_skip_empty_documents():
    cu = torch.tensor([0, 4, 4, 10, 10], dtype=torch.int32)
    docs = find_documents(1, 10, 10, position_ids=torch.arange(10)[None], cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    assert docs.lengths.tolist() == [4, 6] and docs.q_starts.tolist() == [0, 4]
    with pytest.raises(DocumentBoundaryError, match="given together"):
        find_documents(1, 10, 10, cu_seq_lens_q=cu)
    with pytest.raises(DocumentBoundaryError, match="padding attention_mask"):
        find_documents(1, 10, 10, attention_mask=torch.tensor([[1] * 9 + [0]]), cu_seq_lens_q=cu, cu_seq_lens_k=cu)


def test_decoding_with_a_cache_is_one_bottom_right_task_per_row():
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    docs = find_documents(2, 2, 6, attention_mask=mask)
    assert docs.lengths.tolist() == [4, 6]
    assert docs.past.tolist() == [2, 4]
    assert docs.q_starts.tolist() == [0, 2] and docs.k_starts.tolist() == [2, 6]
    with pytest.raises(DocumentBoundaryError, match="newest tokens must be real"):
        find_documents(1, 1, 4, attention_mask=torch.tensor([[1, 1, 1, 0]]))
    with pytest.raises(DocumentBoundaryError, match="fewer than queries"):
        find_documents(1, 4, 2)
    cu = torch.tensor([0, 2], dtype=torch.int32)
    with pytest.raises(DocumentBoundaryError, match="KV cache"):
        find_documents(1, 2, 6, cu_seq_lens_q=cu, cu_seq_lens_k=cu)


def test_decoding_refuses_a_cached_row_of_several_documents():
    """Queries whose position_ids fall below the row's cached tokens (a packed prefill's later
    document), or restart among themselves, would attend to other documents' cached keys: refused as
    cu_seq_lens with a cache are. Positions that continue the cache, or run above it (left padding
    counted, a chunk of a longer text), are one document per row."""
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    docs = find_documents(2, 2, 6, attention_mask=mask, position_ids=torch.tensor([[2, 3], [4, 5]]))
    assert docs.lengths.tolist() == [4, 6] and docs.past.tolist() == [2, 4]
    assert find_documents(1, 1, 9, position_ids=torch.tensor([[20]])).past.tolist() == [8]
    assert find_documents(1, 2, 9, position_ids=torch.tensor([[7, 8]])).past.tolist() == [7]
    for positions in ([[5]], [[8, 0]], [[6, 7]]):
        with pytest.raises(DocumentBoundaryError, match="several documents"):
            find_documents(1, len(positions[0]), 9, position_ids=torch.tensor(positions))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(position_ids=torch.zeros(1, 4)), "must be integers"),
        (dict(position_ids=torch.zeros(1, 3, dtype=torch.long)), "shape"),
        (dict(attention_mask=torch.tensor([[1, 2, 1, 1]])), "only 0/1"),
        (dict(attention_mask=torch.ones(2, 4)), "does not match the batch"),
    ],
)
def test_malformed_inputs(kwargs, match):
    with pytest.raises(DocumentBoundaryError, match=match):
        find_documents(1, 4, 4, **kwargs)


@given(st.integers(0, 300), st.integers(1, 300))
def test_causal_pairs_counts_every_visible_key(start, n):
    end = start + n
    assert causal_pairs(start, end) == sum(t + 1 for t in range(start, end))
    assert CATask(0, start, end).pairs == causal_pairs(start, end)


def test_split_document_and_flops():
    tasks = split_document(3, 0, 10, [4, 4, 7])
    assert [(t.q_start, t.q_end, t.kv_len) for t in tasks] == [(0, 4, 4), (4, 7, 7), (7, 10, 10)]
    assert all(t.doc == 3 for t in tasks)
    with pytest.raises(ValueError, match="outside"):
        split_document(0, 0, 10, [11])
    with pytest.raises(ValueError, match="q_start < q_end"):
        CATask(0, 5, 5)
    with pytest.raises(TypeError, match="CATask.q_end must be an integer, got 2.5"):  # (kept as given before)
        split_document(0, 0, 8, [2.5])
    with pytest.raises(TypeError, match="CATask.doc must be an integer, got True"):
        CATask(True, 0, 3)
    assert type(CATask(np.int64(1), np.int32(0), 3).q_start) is int
    assert attention_flops(10, 2, 4) == 4 * 10 * 2 * 4
    assert attention_flops(10, 2, 4, backward=True) == 3.5 * 4 * 10 * 2 * 4


def test_from_lengths_validates():
    from distca_hf import PackedDocuments

    # [2.5, 3.7] became [2, 3]; "3" and True were read as lengths: before
    for lengths, index in (([3, 0], 1), ([2.5, 3.7], 0), (["3"], 0), ([True, True], 0), ([2**63], 0)):
        with pytest.raises(DocumentBoundaryError, match=rf"document lengths\[{index}\] is .*integer >= 1 token"):
            PackedDocuments.from_lengths(lengths)
    assert PackedDocuments.from_lengths(np.array([3, 4])).lengths.tolist() == [3, 4]
    assert np.array_equal(find_documents(1, 7, 7, position_ids=torch.tensor([[0, 1, 2, 0, 1, 0, 1]])).lengths, [3, 2, 2])


@pytest.mark.parametrize("kwargs, match", [
    (dict(batch_size=0, query_len=4, kv_len=4), "batch_size must be an integer >= 1"),
    (dict(batch_size=2.0, query_len=4, kv_len=4), "batch_size must be an integer >= 1"),
    (dict(batch_size=1, query_len=4, kv_len=4, position_ids=[0, 1, 0, 1]), "position_ids must be an integer tensor"),
    # a list beside a KV cache or cu_seq_lens was ignored without a word
    (dict(batch_size=1, query_len=2, kv_len=5, position_ids=[3, 4]), "position_ids must be an integer tensor"),
    (dict(batch_size=1, query_len=2, kv_len=2, position_ids=[[0, 1]], cu_seq_lens_q=torch.tensor([0, 2]),
          cu_seq_lens_k=torch.tensor([0, 2])), "position_ids must be an integer tensor"),
    (dict(batch_size=1, query_len=3, kv_len=3, position_ids=torch.tensor([[True, False, True]])),
     "position_ids must be integers"),
])
def test_find_documents_refuses_bad_shapes_and_positions_as_document_errors(kwargs, match):
    """These raised IndexError, AttributeError or numpy's errors (or read bools as 0 / 1): not
    DocumentBoundaryError (a ValueError), which the opening collective hands to every rank."""
    batch_size, query_len, kv_len = (kwargs.pop(k) for k in ("batch_size", "query_len", "kv_len"))
    with pytest.raises(DocumentBoundaryError, match=match):
        find_documents(batch_size, query_len, kv_len, **kwargs)


@pytest.mark.parametrize("build, match", [
    (lambda: DocumentPieces([0], [0], [0], [10.9], 1), "end must hold integers"),
    (lambda: DocumentPieces(["0"], [0], [0], [5], 1), "rank must hold integers"),
    (lambda: DocumentPieces([[0, 1]], [[0, 1]], [[0, 0]], [[5, 5]], 2),  # (flattened before)
     r"rank must be one entry per piece \(1-D\), got an array of shape \(1, 2\)"),
    (lambda: DocumentPieces([0], [0], [0], [3_100_000_000], 1), "at most 3037000499 tokens"),
    (lambda: DocumentPieces.from_rank_lists([[10.7]]), r"per_rank\[0\]\[0\] must be an integer length"),
    (lambda: DocumentPieces.from_rank_lists([[5, (0, 5)]]), r"per_rank\[0\]\[1\] must be .* triple"),
    (lambda: DocumentPieces.from_rank_lists([[True]]), "must be an integer length"),
    # numpy asked for 7 TiB (a MemoryError), a TypeError from iteration: before
    (lambda: DocumentPieces.from_rank_lists([[(10**12, 0, 5)], [3]]), "document ids must be below 1048578"),
    (lambda: DocumentPieces.from_rank_lists(5), "per_rank must be a list with one list of pieces per rank"),
    (lambda: DocumentPieces.from_rank_lists([5]), r"per_rank\[0\] must be a list of pieces"),
])
def test_pieces_refuse_non_integers_and_lengths_whose_pairs_overflow(build, match):
    """Floats were cut (10.9 -> 10), strings and bools read as numbers, and a 3.1e9-token document's
    pairs overflowed int64 into a negative step time."""
    with pytest.raises(ValueError, match=match):
        build()
