"""Packing and loading: every document trained exactly once per epoch on every rank layout, nothing
cut silently, equal micro-batch counts per rank, and collated inputs equal to what
``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` emits for the same pieces."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DataCollatorWithFlattening

from distca_hf.training import (PackedCollator, PackedDataset, PackingConfig, StreamingPackedDataset, load_documents,
                            pack_lengths)


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
       world=st.integers(1, 4))
def test_every_rank_gets_the_same_number_of_micro_batches(lengths, budget, world):
    dataset = PackedDataset(_documents(lengths), PackingConfig(tokens_per_rank=budget), world_size=world)
    assert len(dataset) % world == 0
    assert 0 <= dataset.report.filler_micro_batches < world
    shares = [list(range(rank, len(dataset), world)) for rank in range(world)]
    assert len({len(s) for s in shares}) == 1
    # Fillers are one padding token, which is a document start and so carries no label.
    for index in range(len(dataset.micro_batches), len(dataset)):
        inputs = PackedCollator()([dataset[index]])
        assert inputs["input_ids"].tolist() == [[0]] and (inputs["labels"] == -100).all()


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
    assert ours.keys() == reference.keys()
    for key in reference:
        if isinstance(reference[key], torch.Tensor):
            assert ours[key].dtype == reference[key].dtype, key
            assert torch.equal(ours[key], reference[key]), key
        else:
            assert ours[key] == reference[key], key


def test_collator_and_config_refuse_bad_input():
    with pytest.raises(ValueError, match="at least one piece"):
        PackedCollator()([{"input_ids": []}])
    with pytest.raises(ValueError, match="PackedDataset"):
        PackedCollator()([[1, 2, 3]])
    with pytest.raises(ValueError, match="tokens_per_rank"):
        PackingConfig(tokens_per_rank=1)
    with pytest.raises(ValueError, match="window"):
        PackingConfig(tokens_per_rank=8, window=0)
    with pytest.raises(ValueError, match="world_size"):
        PackedDataset([[1, 2]], PackingConfig(tokens_per_rank=8), world_size=0)
    with pytest.raises(ValueError, match="input_ids"):
        import datasets

        PackedDataset(datasets.Dataset.from_dict({"text": ["a"]}), PackingConfig(tokens_per_rank=8))


def test_report_names_the_cut_documents():
    dataset = PackedDataset(_documents([10, 300, 5]), PackingConfig(tokens_per_rank=64), world_size=2)
    text = str(dataset.report)
    assert "1 document(s) longer than 64 tokens cut into 5 chunks" in text
    assert dataset.label_tokens() == sum(end - start - 1 for b in dataset.micro_batches for _, start, end in b)


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
    with pytest.raises(ValueError, match="text column 'body'"):
        load_documents(str(path), tokenizer, text_column="body", eos_token_id=eos)
    with pytest.raises(ValueError, match="eos_token_id"):
        load_documents(str(path), tokenizer)
    bad = tmp_path / "corpus.xml"
    bad.write_text("<x/>")
    with pytest.raises(ValueError, match="unknown file type"):
        load_documents(str(bad), tokenizer)


class _Documents(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter([[1, 2, 3], [4, 5], [6, 7, 8, 9]] * 3)


def test_streaming_refuses_several_dataloader_workers():
    """Each worker would read the whole stream: every micro-batch would train num_workers times."""
    stream = StreamingPackedDataset(_Documents(), PackingConfig(tokens_per_rank=8))
    assert len(list(torch.utils.data.DataLoader(stream, batch_size=None, num_workers=1))) == len(list(stream))
    with pytest.raises(ValueError, match="one DataLoader worker"):
        list(torch.utils.data.DataLoader(stream, batch_size=None, num_workers=2))
