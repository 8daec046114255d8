"""Packing and loading: every document trained exactly once per epoch on every rank layout, nothing
cut silently, equal row counts per rank, and collated inputs equal to what
``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` emits for the same pieces.

Documents spanning ranks (``span_ranks``): every token of every document exactly once and in order,
rows of at most ``tokens_per_rank`` tokens in rank order, documents up to a global batch never
cut, a continuing piece's positions going on from the earlier ranks, every token with a successor
in its document labelled exactly once (the rank boundaries included), and the ranks of a server
group reading the slices of one global batch in the same step through Accelerate's sharding."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter, defaultdict

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DataCollatorWithFlattening

from distca_hf.training import (PackedCollator, PackedDataset, PackingConfig, StreamingPackedDataset, load_documents,
                                pack_lengths)
from distca_hf.training.packing import GlobalBatchSampler, RankLayout, pack_rows

def _documents(lengths, seed=0):
    """Token lists whose tokens say which document and position they are: ((doc + 1) * 1000 + position)."""
    return [[(doc + 1) * 1000 + t for t in range(n)] for doc, n in enumerate(lengths)]


def _expected_chunks(lengths, budget):
    return Counter((doc, start, min(n, start + budget)) for doc, n in enumerate(lengths) for start in range(0, n, budget))


lengths_st = st.lists(st.integers(0, 300), min_size=0, max_size=40)


@settings(max_examples=150, deadline=None)
@given(lengths=lengths_st, budget=st.integers(2, 128), length_aware=st.booleans(), window=st.integers(1, 8),
       shuffle=st.booleans())
def test_packing_covers_every_document_once(lengths, budget, length_aware, window, shuffle):
    config = PackingConfig(tokens_per_rank=budget, length_aware=length_aware, window=window, shuffle=shuffle, seed=3)
    batches, report = pack_lengths(lengths, config)
    pieces = Counter(p for batch in batches for p in batch)
    assert pieces == _expected_chunks(lengths, budget)  # each chunk of each document exactly once
    for batch in batches:
        assert batch and sum(end - start for _, start, end in batch) <= budget
    long_documents = [n for n in lengths if n > budget]
    assert report.cut_documents == len(long_documents)
    assert report.chunks == sum(-(-n // budget) for n in long_documents)
    assert report.empty_documents == lengths.count(0)
    assert report.documents == len(lengths) and report.tokens == sum(lengths)
    assert report.micro_batches == len(batches)
    assert report.longest_document == max(lengths, default=0)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 200), min_size=1, max_size=30), budget=st.integers(2, 64),
       world=st.integers(1, 4), span_ranks=st.booleans())
def test_every_rank_gets_the_same_number_of_micro_batches(lengths, budget, world, span_ranks):
    dataset = PackedDataset(_documents(lengths), PackingConfig(tokens_per_rank=budget), world_size=world,
                            span_ranks=span_ranks)
    assert len(dataset) % world == 0
    assert len(dataset) == dataset.report.micro_batches + dataset.report.filler_micro_batches
    if not span_ranks:
        assert 0 <= dataset.report.filler_micro_batches < world
    shares = [list(range(rank, len(dataset), world)) for rank in range(world)]
    assert len({len(s) for s in shares}) == 1
    # Fillers are one padding token, which is a document start and so carries no label.
    fillers = [i for i in range(len(dataset)) if dataset[i]["input_ids"] == [[0]]]
    assert len(fillers) == dataset.report.filler_micro_batches
    if not span_ranks:
        assert fillers == list(range(len(dataset.micro_batches), len(dataset)))  # at the end
    for index in fillers:
        inputs = PackedCollator()([dataset[index]])
        assert inputs["input_ids"].tolist() == [[0]] and (inputs["labels"] == -100).all()
        assert (inputs["shift_labels"] == -100).all()


def _pieces_seen(items):
    """Pieces as (doc, start, end), read back from the self-describing tokens."""
    seen = []
    for item in items:
        for piece in item["input_ids"]:
            if piece == [0]:
                continue  # filler
            doc, start = divmod(piece[0], 1000)
            assert piece == [doc * 1000 + start + i for i in range(len(piece))]
            seen.append((doc - 1, start, start + len(piece)))
    return Counter(seen)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("length_aware", [False, True])
def test_epoch_through_accelerate_sharding_trains_each_document_once(world, length_aware):
    """The Trainer's path: a shuffled sampler, then Accelerate gives rank r every world-th micro-batch."""
    from accelerate.data_loader import prepare_data_loader

    lengths = [1, 5, 64, 65, 200, 3, 3, 17, 130, 64, 9, 1, 40, 99, 128, 7]
    budget = 64
    dataset = PackedDataset(_documents(lengths), PackingConfig(tokens_per_rank=budget, length_aware=length_aware),
                            world_size=world)
    per_rank = []
    for rank in range(world):
        loader = torch.utils.data.DataLoader(dataset, batch_size=1, shuffle=True, collate_fn=lambda items: items,
                                             generator=torch.Generator().manual_seed(0))
        sharded = prepare_data_loader(loader, num_processes=world, process_index=rank, put_on_device=False,
                                      use_seedable_sampler=True, data_seed=42)
        sharded.set_epoch(1)
        per_rank.append([item for batch in sharded for item in batch])
    assert len({len(items) for items in per_rank}) == 1
    assert sum((_pieces_seen(items) for items in per_rank), Counter()) == _expected_chunks(lengths, budget)


@pytest.mark.parametrize("length_aware", [False, True])
def test_streaming_packs_every_document_once_per_rank_share(length_aware):
    import datasets
    from accelerate.data_loader import IterableDatasetShard

    lengths = [70, 1, 5, 64, 33, 33, 200, 2, 0, 64, 65, 19]
    budget, world = 64, 3
    source = datasets.Dataset.from_dict({"input_ids": _documents(lengths)}).to_iterable_dataset(num_shards=2)
    stream = StreamingPackedDataset(source, PackingConfig(tokens_per_rank=budget, length_aware=length_aware, window=4),
                                    world_size=world)
    everything = list(stream)
    assert len(everything) % world == 0
    report = stream.report
    assert report.cut_documents == 3 and report.chunks == 2 + 4 + 2 and report.empty_documents == 1
    assert report.micro_batches + report.filler_micro_batches == len(everything)
    shares = [list(IterableDatasetShard(stream, batch_size=1, num_processes=world, process_index=rank))
              for rank in range(world)]
    assert len({len(s) for s in shares}) == 1
    assert sum((_pieces_seen(s) for s in shares), Counter()) == _expected_chunks(lengths, budget)


def test_collator_matches_data_collator_with_flattening():
    pieces = [[5, 6, 7], [8], [9, 10, 11, 12, 13], [14, 15]]
    ours = PackedCollator()([{"input_ids": pieces[:2]}, {"input_ids": pieces[2:]}])
    reference = DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": p} for p in pieces])
    assert ours.keys() == reference.keys() | {"shift_labels"}
    for key in reference:
        if isinstance(reference[key], torch.Tensor):
            assert ours[key].dtype == reference[key].dtype, key
            assert torch.equal(ours[key], reference[key]), key
        else:
            assert ours[key] == reference[key], key
    # whole documents: shift_labels are the labels moved one to the left (what the loss would shift itself)
    shifted = torch.nn.functional.pad(reference["labels"][:, 1:], (0, 1), value=-100)
    assert torch.equal(ours["shift_labels"], shifted)


def test_collator_continues_a_document_across_ranks():
    """A row whose first piece continues the previous rank's document (first_position 5) and whose
    last piece goes on in the next rank's row (last_label 77)."""
    item = {"input_ids": [[50, 51, 52], [60, 61], [70, 71, 72, 73]], "first_position": 5, "last_label": 74}
    inputs = PackedCollator()([item])
    assert inputs["position_ids"].tolist() == [[5, 6, 7, 0, 1, 0, 1, 2, 3]]
    assert inputs["labels"].tolist() == [[50, 51, 52, -100, 61, -100, 71, 72, 73]]
    assert inputs["shift_labels"].tolist() == [[51, 52, -100, 61, -100, 71, 72, 73, 74]]
    assert inputs["cu_seq_lens_q"].tolist() == inputs["cu_seq_lens_k"].tolist() == [0, 3, 5, 9]
    assert inputs["cu_seq_lens_q"].dtype == torch.int32
    assert inputs["max_length_q"] == inputs["max_length_k"] == 4
    # one piece that both continues and goes on: a middle rank of a document over three ranks
    middle = PackedCollator()([{"input_ids": [[7, 8]], "first_position": 9, "last_label": 9}])
    assert middle["position_ids"].tolist() == [[9, 10]] and middle["shift_labels"].tolist() == [[8, 9]]
    # several items in one row: the first may continue, the last may go on
    row = PackedCollator()([{"input_ids": [[1, 2]], "first_position": 3}, {"input_ids": [[4]], "last_label": 5}])
    assert row["position_ids"].tolist() == [[3, 4, 0]] and row["shift_labels"].tolist() == [[2, -100, 5]]
    with pytest.raises(ValueError, match="only the row's first piece can continue"):
        PackedCollator()([{"input_ids": [[1, 2]]}, {"input_ids": [[4]], "first_position": 3}])
    with pytest.raises(ValueError, match="only the row's last piece can continue"):
        PackedCollator()([{"input_ids": [[1, 2]], "last_label": 3}, {"input_ids": [[4]]}])


def test_collator_and_config_refuse_bad_input():
    with pytest.raises(ValueError, match="at least one piece"):
        PackedCollator()([{"input_ids": []}])
    with pytest.raises(ValueError, match="PackedDataset"):
        PackedCollator()([[1, 2, 3]])
    # a flat token list read as pieces of one token each ("got int 1; tokenize text first"), labels dropped, before
    with pytest.raises(ValueError, match="item 0's input_ids is one flat list of token ids; .*pack the documents"):
        PackedCollator()([{"input_ids": [1, 2, 3]}])
    with pytest.raises(ValueError, match="item 0 has labels, which it does not read"):
        PackedCollator()([{"input_ids": [[1, 2, 3]], "labels": [[-100, 2, 3]]}])
    with pytest.raises(ValueError, match=r"item 0 has \['attention_mask', 'position_ids'\], which it does not read"):
        PackedCollator()([{"input_ids": [[5, 6]], "attention_mask": [[1, 1]], "position_ids": [[5, 6]]}])  # (dropped)
    packed = PackedDataset([[1, 2, 3], [4, 5]], PackingConfig(tokens_per_rank=4))
    for index in (slice(0, 2), 1.0, "0"):  # (failed inside a comparison or divmod)
        with pytest.raises(TypeError, match="read one row at a time by an integer index"):
            packed[index]
    assert packed[np.int64(0)] == packed[0]
    for vocab in ("100", 0, -1, 3.5):  # a TypeError comparing, or an error that blamed the documents, before
        with pytest.raises(ValueError, match=r"PackedCollator.vocab_size must be an integer from 1 to"):
            PackedCollator(vocab_size=vocab)
    for columns in ({"input_ids": [[1, 2]]}, {"input_ids": [[1, 2]], "attention_mask": [[1, 1]]}):  # KeyError: 0 before
        with pytest.raises(ValueError, match=r"got a mapping of columns \[.*'input_ids'.*\]; pass its 'input_ids'"):
            PackedDataset(columns, PackingConfig(tokens_per_rank=8))
        with pytest.raises(ValueError, match="got a mapping of columns"):
            StreamingPackedDataset(columns, PackingConfig(tokens_per_rank=8))
    with pytest.raises(ValueError, match="tokens_per_rank"):
        PackingConfig(tokens_per_rank=1)
    with pytest.raises(ValueError, match="window"):
        PackingConfig(tokens_per_rank=8, window=0)
    with pytest.raises(ValueError, match="world_size"):
        PackedDataset([[1, 2]], PackingConfig(tokens_per_rank=8), world_size=0)
    with pytest.raises(ValueError, match="input_ids"):
        import datasets

        PackedDataset(datasets.Dataset.from_dict({"text": ["a"]}), PackingConfig(tokens_per_rank=8))


def test_packing_config_refuses_a_seed_that_is_not_an_integer_and_flags_that_are_not_bools():
    """``seed=None`` seeded each process from the OS: ranks read slices of different packings (documents
    lost and duplicated). Flags given as text ("no" is truthy) are refused too, naming the field."""
    for seed in (None, 1.5, "a", True):
        with pytest.raises(ValueError, match="seed must be an integer"):
            PackingConfig(tokens_per_rank=8, seed=seed)
    for name in ("shuffle", "length_aware", "balance_micro_batches"):
        with pytest.raises(ValueError, match=f"{name} must be True or False, got 'no'"):
            PackingConfig(tokens_per_rank=8, **{name: "no"})
    config = PackingConfig(tokens_per_rank=8, seed=np.int64(3), shuffle=np.bool_(True), length_aware=np.bool_(False))
    assert config.seed == 3 and config.shuffle is True and config.length_aware is False
    lengths = [3, 5, 7, 2, 6, 4, 8, 1, 5, 3]
    assert pack_rows(lengths, config)[0] == pack_rows(lengths, PackingConfig(tokens_per_rank=8, seed=3))[0]


def test_packing_config_takes_numpy_integers_as_ints_and_still_refuses_bools():
    """``PackingConfig(tokens_per_rank=np.int64(4096))`` (a size computed with numpy) was refused as "must
    be an integer": numpy integers are integers wherever an int is (kept as Python ints); bools stay refused."""
    config = PackingConfig(tokens_per_rank=np.int64(8), window=np.int32(4), pad_token_id=np.uint16(3), seed=np.int8(2))
    assert all(type(getattr(config, name)) is int for name in ("tokens_per_rank", "window", "pad_token_id", "seed"))
    assert config == PackingConfig(tokens_per_rank=8, window=4, pad_token_id=3, seed=2)
    assert PackingConfig(tokens_per_rank=np.int64(4096)).tokens_per_rank == 4096
    lengths = [3, 5, 7, 2, 6, 4, 8, 1, 5, 3]
    assert pack_rows(lengths, config)[0] == pack_rows(lengths, PackingConfig(8, window=4, seed=2))[0]
    for name, bad in (("tokens_per_rank", True), ("tokens_per_rank", np.bool_(True)), ("window", True),
                      ("pad_token_id", False), ("tokens_per_rank", np.int64(1)), ("tokens_per_rank", 8.0)):
        with pytest.raises(ValueError, match=f"{name} must be an integer from "):
            PackingConfig(**{"tokens_per_rank": 8, name: bad})
    # a pad id that overflowed in the collator, a row of 2**40 tokens that packed for ever: before
    for name, bad in (("pad_token_id", 10**30), ("tokens_per_rank", 2**40)):
        with pytest.raises(ValueError, match=f"{name} must be an integer from .* to 2147483647"):
            PackingConfig(**{"tokens_per_rank": 8, name: bad})
    with pytest.raises(ValueError, match=r"seed must be an integer from -2\*\*63 to 2\*\*64 - 1"):
        PackingConfig(tokens_per_rank=8, seed=2**64)


def test_pack_rows_refuses_negative_and_fractional_lengths_naming_the_document():
    # a negative document was dropped silently, 4.9 tokens packed as 4
    config = PackingConfig(tokens_per_rank=8, shuffle=False)
    with pytest.raises(ValueError, match=r"lengths\[1\] must be a document length, an integer >= 0 .*got -4"):
        pack_rows([3, -4, 5], config)
    with pytest.raises(ValueError, match=r"lengths\[1\] .*got 4.9"):
        pack_lengths([3, 4.9, 5], config)
    with pytest.raises(ValueError, match=r"lengths\[0\]"):
        pack_rows([True, 2], config)
    rows, report = pack_rows(np.array([3, 0, 5]), config)  # numpy integers and empty documents are fine
    assert report.tokens == 8 and report.empty_documents == 1
    # its other arguments (a dict config was an AttributeError; step_batches=0 or 2.5 and full_rows="no" were
    # taken as given, full_rows="no" padding every row)
    with pytest.raises(TypeError, match="config must be a PackingConfig, got dict"):
        pack_rows([3], {"tokens_per_rank": 8})
    for bad in (0, 2.5, 10**40):
        with pytest.raises(ValueError, match=r"step_batches must be an integer from 1 to"):
            pack_rows([3], config, step_batches=bad)
    with pytest.raises(ValueError, match="full_rows must be True or False, got 'no'"):
        pack_rows([3], config, full_rows="no")


def test_collator_refuses_padding_outside_the_item_and_non_integer_keys():
    # padding -1 or past the item's tokens silently masked every label
    for padding in (-1, 3, 1.5):
        with pytest.raises(ValueError, match=rf"item 0 has padding={padding}"):
            PackedCollator()([{"input_ids": [[1, 2]], "padding": padding}])
    with pytest.raises(ValueError, match=r"item 0 has first_position='x'; expected an integer"):
        PackedCollator()([{"input_ids": [[1, 2]], "first_position": "x"}])
    with pytest.raises(ValueError, match=r"item 0 has last_label=None"):
        PackedCollator()([{"input_ids": [[1, 2]], "last_label": None}])
    with pytest.raises(ValueError, match="item 0's input_ids is one flat list of token ids"):  # (blamed a piece)
        PackedCollator()([{"input_ids": np.array([1, 2, 3])}])
    for key in ("first_position", "last_label"):  # 10**30 was torch's bare OverflowError
        with pytest.raises(ValueError, match=r"item 0 has first_position=.*a position or a token id is at most 2147483647"):
            PackedCollator()([{"input_ids": [[1, 2]], key: 10**30}])
    with pytest.raises(ValueError, match=r"item 0's input_ids\[1\] \(a piece\) must be a 1-D sequence"):
        PackedCollator()([{"input_ids": [[1, 2], 3]}])
    whole = PackedCollator()([{"input_ids": [[1, 2]], "padding": 2}])  # a filler row: all padding
    assert whole["shift_labels"].tolist() == [[-100, -100]]
    assert PackedCollator()([{"input_ids": [[5, 6, 7]], "padding": 1}])["labels"].tolist() == [[-100, 6, -100]]


def test_documents_must_be_one_dimensional_integer_token_ids_refused_at_construction():
    """Text counted characters as tokens (failing late in the collator), float ids were truncated, 2-D
    tensors / nested lists / None failed deep: all refused when the dataset is made, naming the document."""
    config = PackingConfig(tokens_per_rank=4, shuffle=False)
    bad = {"text": ["hello world"], "float": [[1, 2], [1.5, 2.7]], "negative": [[-100, 5]], "none": [None],
           "int": [5], "nested": [[[1, 2], [3, 4]]], "2-D tensor": [torch.tensor([[1, 2, 3]])],
           "float tensor": [torch.tensor([1.0, 2.0])], "float array": [np.array([1.0, 2.0])]}
    for label, documents in bad.items():
        index = len(documents) - 1
        with pytest.raises(ValueError, match=rf"document {index} must be a 1-D sequence of integer token ids.*"
                                             "tokenize text first"):
            PackedDataset(documents, config)
        with pytest.raises(ValueError, match=rf"document {index} of the stream must be a 1-D sequence"):
            list(StreamingPackedDataset(documents, config))
    with pytest.raises(ValueError, match="documents must be a sequence of token-id documents"):
        PackedDataset("hello", config)
    import datasets

    with pytest.raises(ValueError, match="'input_ids' column must hold lists of integer token ids"):
        PackedDataset(datasets.Dataset.from_dict({"input_ids": [[1.5, 2.0]]}), config)
    assert PackedDataset(datasets.Dataset.from_dict({"input_ids": [[], []]}), config).report.empty_documents == 2
    from transformers import BatchEncoding  # a tokenizer's output: a UserDict, not a dict

    good = [[1, 2, 3], np.array([4, 5]), torch.tensor([6, 7]), [np.int64(8), np.int64(9)], {"input_ids": [10]},
            BatchEncoding({"input_ids": [11, 12], "attention_mask": [1, 1]})]
    dataset = PackedDataset(good, config)
    tokens = [t for i in range(len(dataset)) for t in PackedCollator()([dataset[i]])["input_ids"][0].tolist()]
    assert sorted(tokens) == list(range(1, 13))


def test_report_names_the_cut_documents():
    dataset = PackedDataset(_documents([10, 300, 5]), PackingConfig(tokens_per_rank=64), world_size=2)
    text = str(dataset.report)
    assert "1 document(s) longer than 64 tokens cut into 5 chunks" in text
    assert dataset.label_tokens() == sum(end - start - 1 for b in dataset.micro_batches for _, start, end in b)


def test_report_names_the_documents_that_span_ranks():
    # Global batches of 2 x 64 = 128 tokens, next-fit in order: [10] | [128-token chunk] | [128-token
    # chunk] | [44-token chunk, 5] | [100]; each is cut into two equal slices, so every one of them
    # has a document that spans both ranks.
    dataset = PackedDataset(_documents([10, 300, 5, 100]), PackingConfig(tokens_per_rank=64, shuffle=False),
                            world_size=2, span_ranks=True)
    report = dataset.report
    assert [row.tokens for row in dataset.rows] == [5, 5, 64, 64, 64, 64, 25, 24, 50, 50]
    assert (report.group_size, report.cut_documents, report.chunks, report.global_batches) == (2, 1, 3, 5)
    assert (report.spanning_documents, report.micro_batches, report.filler_micro_batches) == (5, 10, 0)
    text = str(report)
    assert "5 global batches of 2 x 64 tokens" in text
    assert "5 document(s) span ranks (trained whole, up to 128 tokens)" in text
    assert "1 document(s) longer than 128 tokens cut into 3 chunks" in text
    assert dataset.label_tokens() == (10 - 1) + (128 - 1) * 2 + (44 - 1) + (5 - 1) + (100 - 1)
    # a global batch too small for every rank: the empty slot is a filler row
    tiny = PackedDataset(_documents([2]), PackingConfig(tokens_per_rank=8), world_size=3, span_ranks=True)
    assert [tiny[i]["input_ids"] for i in range(3)] == [[[1000]], [[1001]], [[0]]]
    assert tiny.report.filler_micro_batches == 1 and tiny.report.spanning_documents == 1


def test_length_aware_packing_fills_micro_batches_better():
    lengths = [60, 5, 58, 7, 50, 12, 45, 20, 40, 24, 33, 30] * 4
    random_order, _ = pack_lengths(lengths, PackingConfig(tokens_per_rank=64, seed=1))
    length_aware, report = pack_lengths(lengths, PackingConfig(tokens_per_rank=64, length_aware=True, window=48))
    assert len(length_aware) < len(random_order)
    assert report.fill > 0.9


def test_load_documents_from_files_and_streams(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    texts = ["alpha beta gamma", "delta", "epsilon zeta eta theta iota"]
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(json.dumps({"text": t, "source": "x"}) for t in texts))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                                             show_progress=False))
    eos = tokenizer.token_to_id("<eos>")
    documents = load_documents(str(path), tokenizer, eos_token_id=eos)
    assert documents.column_names == ["input_ids"]
    assert [d["input_ids"] for d in documents] == [tokenizer.encode(t).ids + [eos] for t in texts]
    streamed = load_documents(str(path), tokenizer, eos_token_id=eos, streaming=True)
    assert [d["input_ids"] for d in streamed] == [d["input_ids"] for d in documents]
    packed = list(StreamingPackedDataset(streamed, PackingConfig(tokens_per_rank=4)))
    assert sum(len(p) for item in packed for p in item["input_ids"]) == sum(len(d["input_ids"]) for d in documents)

    text_file = tmp_path / "corpus.txt"
    text_file.write_text("\n".join(texts))
    assert len(load_documents(str(text_file), tokenizer, add_eos=False)) == 3
    assert load_documents(documents).column_names == ["input_ids"]  # already tokenized: kept as is
    with pytest.raises(ValueError, match="tokenizer="):
        load_documents(str(path))
    with pytest.raises(ValueError, match="text_column= body: no such column"):
        load_documents(str(path), tokenizer, text_column="body", eos_token_id=eos)
    with pytest.raises(ValueError, match="eos_token_id"):
        load_documents(str(path), tokenizer)
    bad = tmp_path / "corpus.xml"
    bad.write_text("<x/>")
    with pytest.raises(ValueError, match="unknown file type"):
        load_documents(str(bad), tokenizer)


def test_load_documents_keeps_what_masks_and_adds_one_eos(tmp_path):
    """Token ids whose labels mask a prompt (or whose attention_mask pads) are refused, not stripped to
    input_ids and trained whole; a stream keeps those columns for packing to refuse as it reads. A
    text that already ends with the end token gets no second one, and a tokenizers.Tokenizer adds no
    special tokens of its post-processor, as a transformers tokenizer (add_special_tokens=False)."""
    import datasets
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    masked = {"input_ids": [[5, 6, 7, 8]], "labels": [[-100, -100, 7, 8]]}
    with pytest.raises(ValueError, match="row 0 has 'labels' that differ from its 'input_ids'"):
        load_documents(datasets.Dataset.from_dict(masked))
    with pytest.raises(ValueError, match="has an 'attention_mask' with padding"):
        load_documents(datasets.Dataset.from_dict({"input_ids": [[5, 6, 0]], "attention_mask": [[1, 1, 0]]}))
    assert load_documents(datasets.Dataset.from_dict({"input_ids": [[5, 6]], "labels": [[5, 6]]})).column_names == \
        ["input_ids"]  # labels equal to the ids mask nothing
    path = tmp_path / "masked.jsonl"
    path.write_text(json.dumps({"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]}))
    streamed = load_documents(str(path), streaming=True)
    with pytest.raises(ValueError, match="has 'labels' that differ"):
        list(StreamingPackedDataset(streamed, PackingConfig(tokens_per_rank=8)))

    texts = ["alpha beta gamma", "delta<eos>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                                             show_progress=False))
    eos = tokenizer.token_to_id("<eos>")
    tokenizer.post_processor = processors.TemplateProcessing(single="$A <eos>", special_tokens=[("<eos>", eos)])
    plain = [tokenizer.encode(t, add_special_tokens=False).ids for t in texts]
    assert plain[1][-1] == eos  # the second text ends with the token already
    documents = load_documents(datasets.Dataset.from_dict({"text": texts}), tokenizer, eos_token_id=eos)
    assert [d["input_ids"] for d in documents] == [plain[0] + [eos], plain[1]]


def test_document_errors_are_one_line_that_names_the_flag(tmp_path, monkeypatch):
    import datasets

    from distca_hf.training.loading import DocumentSourceError, MissingDocumentsError, looks_like_hub_name

    asked = []

    def fake_hub(name, **kwargs):  # records what would have gone to the Hub
        asked.append(name)
        return datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]]})

    monkeypatch.setattr(datasets, "load_dataset", fake_hub)
    flags = {"source": "--dataset", "text_column": "--text_column", "split": "--dataset_split",
             "tokenizer": "--model_name_or_path"}
    errors = []
    for missing in (tmp_path / "my_corpus.jsonl", "corpus", "data/corpus.jsonl", "./owner/name"):
        with pytest.raises(MissingDocumentsError, match="no such file or folder") as caught:
            load_documents(str(missing), flags=flags)
        assert str(caught.value).startswith(f"--dataset {missing}:") and isinstance(caught.value, FileNotFoundError)
        errors.append(caught.value)
    assert asked == []  # a path that is not there never reaches the Hub ...
    assert len(load_documents("owner/corpus")) == 1 and asked == ["owner/corpus"]  # ... an owner/name does
    assert [looks_like_hub_name(n) for n in ("owner/name", "a/b/c", "owner/name.jsonl", "~/x", "name")] == \
        [True, False, False, False, False]

    for i, text in enumerate(("", "\n  \n")):
        blank = tmp_path / f"blank{i}.jsonl"
        blank.write_text(text)
        with pytest.raises(DocumentSourceError, match=f"--dataset {blank} holds no documents") as caught:
            load_documents(str(blank), flags=flags)
        errors.append(caught.value)
    with pytest.raises(DocumentSourceError, match="the dataset holds no documents") as caught:
        load_documents(datasets.Dataset.from_dict({"text": []}))
    errors.append(caught.value)

    texts = datasets.Dataset.from_dict({"body": ["alpha", "beta"]})
    with pytest.raises(DocumentSourceError, match=r"--text_column text: no such column .*'body'") as caught:
        load_documents(texts, object(), flags=flags)
    errors.append(caught.value)
    with pytest.raises(DocumentSourceError, match="no tokenizer was given; set --model_name_or_path") as caught:
        load_documents(texts, text_column="body", flags=flags)
    errors.append(caught.value)
    datasets.DatasetDict({"train": texts}).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(DocumentSourceError, match=r"--dataset_split validation: no such split .*\['train'\]") as caught:
        load_documents(str(tmp_path / "saved"), split="validation", flags=flags)
    errors.append(caught.value)
    # a DatasetDict in hand ("must be a datasets dataset" before) and a split of one file (read whole before)
    assert load_documents(datasets.DatasetDict({"train": texts, "test": texts}), lambda t, **_: {
        "input_ids": [[1] for _ in t]}, split="test", text_column="body", add_eos=False)["input_ids"] == [[1], [1]]
    with pytest.raises(DocumentSourceError, match=r"--dataset_split validation: no such split .*\['train'\]") as caught:
        load_documents(datasets.DatasetDict({"train": texts}), split="validation", flags=flags)
    errors.append(caught.value)
    one_file = tmp_path / "docs.jsonl"
    one_file.write_text('{"text": "alpha"}\n')
    with pytest.raises(DocumentSourceError, match=r"--dataset_split validation: a single file \(docs.jsonl\) holds "
                                                  r"one split, 'train'") as caught:
        load_documents(str(one_file), split="validation", flags=flags)
    errors.append(caught.value)
    # a model name as the tokenizer ('str' object is not callable inside datasets.map before), eos ids that
    # are no token id (appended as given before), add_eos that is no bool, texts that are not text
    with pytest.raises(TypeError, match="tokenizer must be a transformers tokenizer .*got str 'gpt2'"):
        load_documents(texts, "gpt2", text_column="body", add_eos=False)
    encode = lambda t, **_: {"input_ids": [[1] for _ in t]}
    for bad in (-1, "2", 2.0, True, 2**40):
        with pytest.raises(ValueError, match="eos_token_id must be a token id"):
            load_documents(texts, encode, text_column="body", eos_token_id=bad)
    with pytest.raises(ValueError, match="eos_token_id=-1 is appended only with add_eos=True"):  # (ignored before)
        load_documents(texts, encode, text_column="body", add_eos=False, eos_token_id=-1)
    with pytest.raises(TypeError, match=r"add_eos must be True, False or None \(True for text\), got 'no'"):
        load_documents(texts, encode, text_column="body", add_eos="no", eos_token_id=2)
    with pytest.raises(DocumentSourceError, match="--text_column body: every document must be text, got NoneType None"):
        load_documents(datasets.Dataset.from_dict({"body": ["alpha", None]}), encode, text_column="body", eos_token_id=2,
                       flags=flags)
    assert all(len(str(e).splitlines()) == 1 for e in errors)


class _Documents(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter([[1, 2, 3], [4, 5], [6, 7, 8, 9]] * 3)


def test_streaming_refuses_several_dataloader_workers():
    """Each worker would read the whole stream: every micro-batch would train num_workers times."""
    stream = StreamingPackedDataset(_Documents(), PackingConfig(tokens_per_rank=8))
    assert len(list(torch.utils.data.DataLoader(stream, batch_size=None, num_workers=1))) == len(list(stream))
    with pytest.raises(ValueError, match="one DataLoader worker"):
        list(torch.utils.data.DataLoader(stream, batch_size=None, num_workers=2))


def test_streaming_refuses_what_it_would_ignore_or_lose():
    config = PackingConfig(tokens_per_rank=8)
    for bad in (None, 5, "text"):  # (accepted, then a TypeError deep in iteration)
        with pytest.raises(TypeError, match="documents must be an iterable of token-id documents"):
            StreamingPackedDataset(bad, config)
    with pytest.raises(ValueError, match=r"balance_micro_batches=True\) needs the step's documents"):  # (ignored)
        StreamingPackedDataset(_Documents(), PackingConfig(tokens_per_rank=8, balance_micro_batches=True))
    # a generator is read once: its second epoch packed nothing, silently
    stream = StreamingPackedDataset((d for d in [[1, 2, 3], [4, 5], [6, 7, 8, 9]]), config)
    assert len(list(stream)) == 2
    with pytest.raises(ValueError, match="one-shot iterator .* this epoch would train nothing"):
        list(stream)
    again = StreamingPackedDataset(_Documents(), config)  # a source that starts over reads the same every epoch
    assert [item["input_ids"] for item in again] == [item["input_ids"] for item in again] != []


def test_streams_split_per_rank_are_refused_and_ranks_compare_their_first_documents():
    """Every rank reads a stream whole and keeps its share: a stream split per rank
    (``split_dataset_by_node``) would train 1 / world of it, silently; ``stream_head_crc`` (what the
    trainer's ranks compare) tells streams read in another order apart, and leaves a generator unread."""
    datasets = pytest.importorskip("datasets")
    from datasets.distributed import split_dataset_by_node

    from distca_hf.training.packing import stream_head_crc

    documents = [[d + 1] * (3 + d % 5) for d in range(40)]
    stream = datasets.Dataset.from_dict({"input_ids": documents}).to_iterable_dataset(num_shards=2)
    with pytest.raises(ValueError, match="already split per rank .* Pass the stream before split_dataset_by_node"):
        StreamingPackedDataset(split_dataset_by_node(stream, rank=1, world_size=2), PackingConfig(tokens_per_rank=16))
    assert stream_head_crc(stream) == stream_head_crc(stream) == stream_head_crc(documents)
    assert stream_head_crc(stream.shuffle(seed=1, buffer_size=8)) == stream_head_crc(stream.shuffle(seed=1, buffer_size=8))
    assert stream_head_crc(stream.shuffle(seed=1, buffer_size=8)) != stream_head_crc(stream.shuffle(seed=2, buffer_size=8))
    assert stream_head_crc(documents[1:]) != stream_head_crc(documents)
    generator = (d for d in documents)
    assert stream_head_crc(generator) is None and len(list(generator)) == 40  # nothing read from it


# -- documents spanning ranks ------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(0, 120), max_size=30), budget=st.integers(2, 24), group=st.integers(1, 4),
       length_aware=st.booleans(), window=st.integers(1, 8), shuffle=st.booleans())
def test_spanning_packing_trains_every_token_once_in_order(lengths, budget, group, length_aware, window, shuffle):
    config = PackingConfig(tokens_per_rank=budget, length_aware=length_aware, window=window, shuffle=shuffle, seed=5)
    rows, report = pack_rows(lengths, config, group_size=group)
    whole = group * budget  # a global batch: the longest document trained whole
    assert len(rows) % group == 0 and report.global_batches == len(rows) // group

    def sequence_of(piece):  # (document, chunk): chunks are cut at multiples of a global batch
        return piece.document, piece.start // whole

    def end_of(sequence):
        return min(lengths[sequence[0]], (sequence[1] + 1) * whole)

    next_start = {}  # sequence -> the token its next piece must start at (in stream order)
    batches_of, rows_of = defaultdict(set), defaultdict(set)
    for g in range(report.global_batches):
        batch = rows[g * group:(g + 1) * group]
        sizes = [row.tokens for row in batch]
        # at most tokens_per_rank per rank, equal shares (earlier ranks take the extra tokens)
        assert max(sizes) <= budget and max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
        held = Counter()  # tokens of each sequence on the earlier ranks of this global batch
        previous = None
        for j, row in enumerate(batch):
            for k, piece in enumerate(row.pieces):
                sequence = sequence_of(piece)
                assert piece.start == next_start.get(sequence, sequence[1] * whole)  # in order, nothing skipped
                assert piece.end > piece.start
                next_start[sequence] = piece.end
                position = piece.start - sequence[1] * whole
                assert position == held[sequence]  # the tokens of this sequence on earlier ranks
                if k == 0:
                    assert row.first_position == position
                    if position > 0:  # continues the document that ends the previous rank's row
                        assert previous is not None and previous.continues
                        assert sequence_of(previous.pieces[-1]) == sequence
                else:
                    assert position == 0  # every later piece starts its document
                held[sequence] += piece.end - piece.start
                batches_of[sequence].add(g)
                rows_of[sequence].add(j)
            if row.pieces:
                last = sequence_of(row.pieces[-1])
                assert row.continues == (row.pieces[-1].end < end_of(last))
            else:
                assert not row.continues and row.first_position == 0
            previous = row
        assert not batch[-1].continues
    # every token of every document exactly once; a sequence never leaves its global batch
    for doc, n in enumerate(lengths):
        for chunk in range(-(-n // whole)):
            assert next_start[(doc, chunk)] == end_of((doc, chunk))
            assert len(batches_of[(doc, chunk)]) == 1
    assert {s for s in next_start if s[1] > 0} <= {(d, c) for d, n in enumerate(lengths) if n > whole
                                                   for c in range(1, -(-n // whole))}  # only long ones cut
    long_documents = [n for n in lengths if n > whole]
    assert report.cut_documents == len(long_documents)
    assert report.chunks == sum(-(-n // whole) for n in long_documents)
    assert report.spanning_documents == sum(1 for ranks in rows_of.values() if len(ranks) > 1)
    assert report.micro_batches == sum(1 for row in rows if row.pieces)
    assert report.filler_micro_batches == sum(1 for row in rows if not row.pieces)
    assert report.empty_documents == lengths.count(0) and report.tokens == sum(lengths)
    if group == 1:  # per rank: the same packing as pack_lengths
        assert [list(row.pieces) for row in rows] == pack_lengths(lengths, config)[0]


GROUPINGS = [[[0]], [[0, 1]], [[0, 1, 2]], [[0, 1, 2, 3]], [[0, 1], [2, 3]], [[0, 2], [1, 3]], [[3, 0], [1, 2]],
             [[0], [1], [2]]]


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(1, 90), min_size=1, max_size=20), budget=st.integers(2, 16),
       groups=st.sampled_from(GROUPINGS), length_aware=st.booleans())
def test_rows_label_every_token_with_a_successor_exactly_once(lengths, budget, groups, length_aware):
    """Through the dataset and the collator, rank by rank: the labels across rank boundaries included."""
    world = sum(len(g) for g in groups)
    dataset = PackedDataset(_documents(lengths), PackingConfig(tokens_per_rank=budget, length_aware=length_aware),
                            world_size=world, span_ranks=True, server_groups=groups)
    whole = len(groups[0]) * budget
    assert len(dataset) % world == 0
    collate = PackedCollator()
    targets = Counter()
    for block in range(len(dataset) // world):
        for group in groups:
            previous_last = None  # (token, continues) of the previous rank's row in this global batch
            for rank in sorted(group):
                inputs = collate([dataset[block * world + rank]])
                ids, positions = inputs["input_ids"][0].tolist(), inputs["position_ids"][0].tolist()
                labels, shift = inputs["labels"][0].tolist(), inputs["shift_labels"][0].tolist()
                cu = inputs["cu_seq_lens_q"].tolist()
                assert len(ids) <= budget
                # cu_seq_lens describe the local pieces and agree with position_ids
                assert cu[0] == 0 and cu[-1] == len(ids)
                assert all(positions[a] == 0 for a in cu[1:-1])
                assert all(positions[i] == positions[i - 1] + 1 for i in range(1, len(ids)) if i not in cu)
                assert inputs["max_length_q"] == inputs["max_length_k"] == max(b - a for a, b in zip(cu, cu[1:]))
                assert [label == -100 for label in labels] == [p == 0 for p in positions]
                if ids == [0]:  # filler: one padding token, nothing to learn
                    assert shift == [-100] and positions == [0]
                    previous_last = None
                    continue
                if positions[0] > 0:  # continues: right after the previous rank's last token
                    assert previous_last is not None and previous_last[1] and ids[0] == previous_last[0] + 1
                for i, token in enumerate(ids):
                    doc, t = divmod(token, 1000)
                    assert positions[i] == t % whole  # the tokens of its document (chunk) before it
                    if shift[i] != -100:
                        assert shift[i] == token + 1  # the next token of the same document
                        targets[(doc - 1, t)] += 1
                previous_last = (ids[-1], shift[-1] != -100)
            assert previous_last is None or not previous_last[1]  # a global batch ends its documents
    expected = Counter((doc, t) for doc, n in enumerate(lengths) for t in range(n - 1) if (t + 1) % whole)
    assert targets == expected
    assert dataset.label_tokens() == sum(expected.values())


def _global_batches(dataset: PackedDataset) -> dict:
    """Global batch -> its rows' items, as JSON, in rank order."""
    layout = dataset.layout
    batches = defaultdict(dict)
    for index in range(len(dataset)):
        global_batch, position = layout.locate(index)
        batches[global_batch][position] = json.dumps(dataset[index])
    return {g: tuple(rows[j] for j in range(layout.group_size)) for g, rows in batches.items()}


def _check_steps_are_global_batches(per_rank, dataset: PackedDataset) -> Counter:
    """In every step, each server group's ranks hold the slices of one global batch, in rank order.
    Returns how often each global batch was trained."""
    by_rows = {rows: g for g, rows in _global_batches(dataset).items()}
    trained = Counter()
    for step in range(len(per_rank[0])):
        for group in dataset.layout.server_groups:
            rows = tuple(json.dumps(per_rank[rank][step]) for rank in group)
            assert rows in by_rows, f"step {step}: ranks {group} hold slices of different global batches"
            trained[by_rows[rows]] += 1
    return trained


@pytest.mark.parametrize("groups", [[[0, 1]], [[0, 1, 2]], [[0, 2], [1, 3]]])
@pytest.mark.parametrize("length_aware", [False, True])
def test_accelerate_sharding_gives_a_group_the_slices_of_one_global_batch(groups, length_aware):
    """The Trainer's path for a map-style dataset: GlobalBatchSampler, then Accelerate gives rank r
    every world-th index; a resumed epoch (skip_first_batches) reads what the uninterrupted one read."""
    from accelerate.data_loader import prepare_data_loader, skip_first_batches

    world = sum(len(g) for g in groups)
    lengths = [1, 5, 64, 65, 200, 3, 3, 17, 130, 64, 9, 1, 40, 99, 128, 7, 250, 33]
    dataset = PackedDataset(_documents(lengths), PackingConfig(tokens_per_rank=40, length_aware=length_aware),
                            world_size=world, span_ranks=True, server_groups=groups)

    def epoch(rank, number, skip=0):
        sampler = GlobalBatchSampler(len(dataset), world, seed=7)
        loader = torch.utils.data.DataLoader(dataset, batch_size=1, sampler=sampler, collate_fn=lambda items: items)
        sharded = prepare_data_loader(loader, num_processes=world, process_index=rank, put_on_device=False)
        if skip:
            sharded = skip_first_batches(sharded, skip)
        sampler.set_epoch(number)  # DistCATrainer, at the start of every epoch, resumed or not
        sharded.set_epoch(number)  # then the Trainer (it does not reach the sampler behind a skip)
        return [item for batch in sharded for item in batch]

    first = [epoch(rank, 0) for rank in range(world)]
    assert len({len(items) for items in first}) == 1
    trained = _check_steps_are_global_batches(first, dataset)
    assert set(trained.values()) == {1} and len(trained) == len(dataset) // len(groups[0])  # each once
    tokens = Counter(t for items in first for item in items for p in item["input_ids"] for t in p if p != [0])
    assert tokens == Counter(t for d in _documents(lengths) for t in d)  # every token once per epoch
    second = [epoch(rank, 1) for rank in range(world)]
    _check_steps_are_global_batches(second, dataset)
    assert second != first  # shuffled again, whole global batches only
    resumed = [epoch(rank, 1, skip=3) for rank in range(world)]
    assert resumed == [items[3:] for items in second]


@pytest.mark.parametrize("groups", [[[0, 1, 2]], [[0, 2], [1, 3]]])
def test_streaming_spanning_gives_a_group_the_slices_of_one_global_batch(groups):
    import datasets
    from accelerate.data_loader import IterableDatasetShard

    world = sum(len(g) for g in groups)
    lengths = [70, 1, 5, 64, 33, 33, 200, 2, 0, 64, 65, 19, 140, 3]
    config = PackingConfig(tokens_per_rank=32)
    source = datasets.Dataset.from_dict({"input_ids": _documents(lengths)}).to_iterable_dataset(num_shards=2)
    stream = StreamingPackedDataset(source, config, world_size=world, span_ranks=True, server_groups=groups)
    shares = [list(IterableDatasetShard(stream, batch_size=1, num_processes=world, process_index=rank))
              for rank in range(world)]
    assert len({len(s) for s in shares}) == 1
    # the same rows as the map-style dataset packs from the same documents in the same order
    packed = PackedDataset(_documents(lengths), dataclasses.replace(config, shuffle=False), world_size=world,
                           span_ranks=True, server_groups=groups)
    assert shares == [[packed[i] for i in range(rank, len(packed), world)] for rank in range(world)]
    assert stream.report == packed.report
    _check_steps_are_global_batches(shares, packed)
    whole = len(groups[0]) * config.tokens_per_rank
    assert stream.report.cut_documents == sum(n > whole for n in lengths) and stream.report.spanning_documents > 0


def test_rank_layout_and_sampler_refuse_bad_input():
    with pytest.raises(ValueError, match=r"server_groups must hold every rank 0 \.\. 3 exactly once"):
        RankLayout.for_ranks(4, span_ranks=True, server_groups=[[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="server_groups must all have the same number of ranks"):
        RankLayout.for_ranks(4, span_ranks=True, server_groups=[[0], [1, 2, 3]])
    with pytest.raises(ValueError, match="world_size"):
        RankLayout.for_ranks(0)
    with pytest.raises(ValueError, match="multiple of world_size"):
        GlobalBatchSampler(7, 2)
    for num_items in (4.0, -4):  # 4.0 raised TypeError in randperm, -4 in len()
        with pytest.raises(ValueError, match=rf"num_items must be an integer from 0 to 2147483647, got {num_items}"):
            GlobalBatchSampler(num_items, 4)
    for seed in (None, 2**64):  # 2**64 overflowed when iterated
        with pytest.raises(ValueError, match="seed must be an integer"):
            GlobalBatchSampler(4, 4, seed=seed)
    with pytest.raises(ValueError, match="epoch must be an integer from 0"):  # a raw TypeError before
        GlobalBatchSampler(4, 4).set_epoch(None)
    with pytest.raises(ValueError, match=r"world_size must be an integer from 1 to 1048576 \(ranks\)"):
        RankLayout.for_ranks(10**12)  # ran for ever
    for groups in ("01", ["0", "1"], [[0.5], [1]]):  # "01" was read as [[0], [1]]
        with pytest.raises(ValueError, match="server_groups must be lists of ranks"):
            RankLayout.for_ranks(2, span_ranks=True, server_groups=groups)
    assert RankLayout.for_ranks(np.int64(2), span_ranks=True, server_groups=[[np.int64(1), 0]]).group_size == 2
    with pytest.raises(ValueError, match=r"server_groups=\[\[0, 1\], \[2, 3\]\] needs span_ranks=True"):  # (ignored)
        PackedDataset([[1, 2]], PackingConfig(tokens_per_rank=8), 4, server_groups=[[0, 1], [2, 3]])
    layout = RankLayout.for_ranks(4, span_ranks=True, server_groups=[[2, 0], [3, 1]])
    assert layout.server_groups == ((0, 2), (1, 3)) and layout.group_size == 2 and layout.num_groups == 2
    assert [layout.locate(i) for i in range(8)] == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    assert RankLayout.for_ranks(3).server_groups == ((0,), (1,), (2,))  # per rank: groups of one


def test_global_batch_sampler_shuffles_whole_blocks_from_seed_and_epoch():
    sampler = GlobalBatchSampler(12, 3, seed=4)
    order = list(sampler)
    assert sorted(order) == list(range(12)) and len(sampler) == 12
    blocks = [order[i:i + 3] for i in range(0, 12, 3)]
    assert all(b == list(range(b[0], b[0] + 3)) and b[0] % 3 == 0 for b in blocks)
    assert list(GlobalBatchSampler(12, 3, seed=4)) == order  # a pure function of seed and epoch
    sampler.set_epoch(1)
    assert list(sampler) != order
    assert list(GlobalBatchSampler(12, 3, shuffle=False)) == list(range(12))


def test_packing_refuses_columns_it_would_drop_and_token_ids_out_of_range():
    """A packed dataset (or a stream) given 'labels' masking a prompt, an 'attention_mask' with padding or
    'position_ids' of its own trained as if they were not there (only DistCATrainer's raw-dataset check
    caught them); a None row or an id past 2**31 - 1 failed deep or in the collator."""
    import datasets

    config = PackingConfig(tokens_per_rank=16)
    masked = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3, 4]] * 3, "labels": [[-100, -100, 3, 4]] * 3})
    with pytest.raises(ValueError, match=r"PackedDataset: documents row 0 has 'labels' that differ .*DistCASFTTrainer"):
        PackedDataset(masked, config)
    with pytest.raises(ValueError, match=r"document 0 of the stream has 'labels' that differ"):
        list(StreamingPackedDataset(masked.to_iterable_dataset(), config))
    with pytest.raises(ValueError, match=r"document 1 has an 'attention_mask' with padding"):
        PackedDataset([{"input_ids": [1, 2]}, {"input_ids": [1, 2, 3], "attention_mask": [1, 1, 0]}], config)
    with pytest.raises(ValueError, match=r"document 0 has 'position_ids' other than 0 \.\. n-1"):
        PackedDataset([{"input_ids": [1, 2, 3], "position_ids": [5, 6, 7]}], config)
    # columns that say nothing packing drops are fine
    plain = {"input_ids": [1, 2, 3], "labels": [1, 2, 3], "attention_mask": [1, 1, 1], "position_ids": [0, 1, 2]}
    assert PackedDataset([plain], config).report.tokens == 3
    with pytest.raises(ValueError, match=r"document 1 has no input_ids \(None\)"):
        PackedDataset(datasets.Dataset.from_dict({"input_ids": [[1, 2], None]}), config)
    with pytest.raises(ValueError, match=r"'input_ids' hold token id 1099511627776; token ids are integers from 0 to"):
        PackedDataset(datasets.Dataset.from_dict({"input_ids": [[1, 2**40]]}), config)
    with pytest.raises(ValueError, match=r"document 0 must be a 1-D sequence .* got token id 2147483648"):
        PackedDataset([[2**31, 1]], config)


def test_load_documents_refuses_arguments_it_would_ignore(tmp_path):
    """A split asked of one dataset, load_dataset's arguments for a dataset in hand or a saved folder, and the
    text arguments for documents already tokenized were all ignored; streaming=True of a dataset in hand too."""
    import datasets

    from distca_hf.training.loading import DocumentSourceError

    tokenized = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]] * 3})
    tokenized.save_to_disk(str(tmp_path / "one"))
    for source in (tokenized, str(tmp_path / "one")):
        with pytest.raises(DocumentSourceError, match=r"split= validation: .* is a single dataset \(no splits\)"):
            load_documents(source, split="validation")
        with pytest.raises(TypeError, match=r"\['data_files'\] go to datasets.load_dataset"):
            load_documents(source, data_files="elsewhere.jsonl")
    made_as = datasets.Dataset.from_dict({"input_ids": [[1, 2]]}, split="validation")  # it says which split it is
    assert len(load_documents(made_as, split="validation")) == 1
    assert len(load_documents(made_as, split="test")) == 1  # (train_test_split's parts keep their parent's name)
    with pytest.raises(DocumentSourceError, match=r"split= validation\[:5\]: .* does not slice"):  # (ignored)
        load_documents(made_as, split="validation[:5]")
    with pytest.raises(DocumentSourceError, match=r"text_column= body and eos_token_id=5: the documents already hold "
                                                  "token ids"):
        load_documents(tokenized, text_column="body", eos_token_id=5)
    with pytest.raises(DocumentSourceError, match=r"add_eos=True: the documents already hold token ids"):  # (ignored)
        load_documents(tokenized, add_eos=True)
    with pytest.raises(TypeError, match=r"add_eos must be True, False or None \(True for text\), got 'yes'"):
        load_documents(tokenized, add_eos="yes")
    assert load_documents(tokenized, add_eos=False)["input_ids"] == load_documents(tokenized)["input_ids"] == [[1, 2, 3]] * 3
    assert isinstance(load_documents(tokenized, streaming=True), datasets.IterableDataset)
    assert isinstance(load_documents(datasets.DatasetDict({"train": tokenized}), streaming=True),
                      datasets.IterableDataset)


def test_rank_counts_and_seeds_at_their_bounds():
    """2**31 - 1 ranks (inside the old bound) ran for ever; a seed near 2**64 overflowed once an epoch was added."""
    config = PackingConfig(tokens_per_rank=4)
    with pytest.raises(ValueError, match=r"world_size must be an integer from 1 to 1048576 \(ranks\), got 2147483647"):
        PackedDataset([[1, 2]], config, world_size=2**31 - 1)
    top = GlobalBatchSampler(4, 2, seed=2**64 - 1)
    top.set_epoch(5)
    same = GlobalBatchSampler(4, 2, seed=4)  # torch reads seeds modulo 2**64: 2**64 - 1 + 5 is 4
    assert sorted(top) == [0, 1, 2, 3] and list(top) == list(same)
