"""``--workload demo``: ``make demo``'s own global batches, its model's sizes and its targets.

The demo's documents (the pydoc topics through its offline BPE, the evaluation documents held out)
packed as ``DistCATrainer`` packs them and collated by ``PackedCollator``, and one rank's step over
them (``demo_step``); the front door's docstring says what the workload measures.
"""

from __future__ import annotations

import argparse


DEMO_EVAL_DOCUMENTS = 8
"""Documents the demo holds out for evaluation (its ``--eval_documents`` default): the first ones."""


DEMO_MODEL = {"hidden": 64, "intermediate": 128, "layers": 2, "heads": 2, "kv_heads": 1}
"""The demo's tiny Llama (``examples/finetune_long_context.py``, ``tiny_llama``): ``--workload demo``'s
model unless these flags are given."""


DEMO_ROUNDS = 3
"""``--workload demo``: measured rounds unless ``--steps`` is given (each runs every global batch)."""


DEMO_TARGET = {"whole_run_speedup_at_least": 1.25, "per_step_speedup_at_least": 0.97}
"""The demo's targets: the whole run >= 1.25x colocated and no step (global batch) more than 3%
slower than its colocated twin."""


DEMO_TOKENS_PER_RANK = 8192
"""The demo's ``--tokens_per_rank`` (and this command's default ``--tokens``)."""


def demo_document_lengths(*, eval_documents: int = DEMO_EVAL_DOCUMENTS) -> tuple[list[int], int]:
    """``(token counts of the documents the demo trains on, its padding token id)``: the pydoc topics
    tokenized by the demo's offline BPE with an end-of-sequence token each (``load_documents``),
    without the first ``min(eval_documents, documents // 4)`` (held out for evaluation, as the demo's
    ``load_data`` does). Trains the tokenizer: a few seconds.

    Raises:
        ImportError: ``tokenizers`` (or ``datasets``) is missing, named in the message.
    """
    try:
        import datasets
    except ImportError:
        raise ImportError("the demo's documents need the 'datasets' package: pip install datasets") from None

    from ...training.loading import load_documents
    from ...training.offline_corpus import offline_tokenizer, pydoc_topics

    texts = pydoc_topics()
    tokenizer = offline_tokenizer(texts)
    datasets.disable_progress_bars()
    documents = load_documents(datasets.Dataset.from_dict({"text": texts}), tokenizer)
    held_out = min(eval_documents, len(documents) // 4)
    lengths = [len(ids) for ids in documents["input_ids"][held_out:]]
    return lengths, tokenizer.pad_token_id or 0


def demo_packing_config(tokens: int, pad_token_id: int):
    """The ``PackingConfig`` the demo's trainer packs with (``--seed 0``: a shuffled document order)."""
    from ...training.packing import PackingConfig

    return PackingConfig(tokens_per_rank=tokens, seed=0, pad_token_id=pad_token_id)


def demo_dataset(lengths: list[int], *, world: int, tokens: int, pad_token_id: int, vocab: int):
    """The demo's packed rows of documents of ``lengths`` tokens for ``world`` ranks of ``tokens``
    each, as its trainer builds them: a ``PackedDataset`` with ``span_ranks=True``, item
    ``g * world + r`` rank ``r``'s row of global batch ``g``. Random token ids below ``vocab``
    (seeded, the same on every rank) stand in for the text."""
    import torch

    from ...training.packing import PackedDataset

    g = torch.Generator().manual_seed(0)
    documents = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    return PackedDataset(documents, demo_packing_config(tokens, pad_token_id), world_size=world, span_ranks=True)


def demo_inputs(dataset, batch: int, rank: int) -> dict:
    """Rank ``rank``'s model inputs for global batch ``batch`` of ``demo_dataset`` (``[1, N]``
    tensors from ``PackedCollator``: ``input_ids``, ``position_ids``, ``labels``, ``shift_labels``,
    ``cu_seq_lens_q/k``, ``max_length_q/k``) and ``num_items_in_batch``: the label tokens of the
    whole global batch, as the trainer normalises the loss."""
    from ...training.packing import PackedCollator

    world = dataset.world_size
    inputs = PackedCollator()([dataset[batch * world + rank]])
    inputs["num_items_in_batch"] = sum(row.label_tokens for row in dataset.rows[batch * world:(batch + 1) * world])
    return inputs


def demo_run_matches(args) -> bool:
    """Whether a ``--workload demo`` run has the demo's sizes (its targets apply only then)."""
    return (not getattr(args, "quick", False) and args.world == 2 and args.tokens == DEMO_TOKENS_PER_RANK
            and args.global_batches is None and all(getattr(args, k) == v for k, v in DEMO_MODEL.items()))


def demo_step(model, rank: int, world: int, args, device):
    """``(step(i), rounds)``: ``step(i)`` runs global batch ``i % batches`` of the demo (forward +
    backward of the causal-LM loss); ``rounds`` is ``args`` with ``warmup`` and ``steps`` counted
    in batches (``_run_in_turns`` then runs every batch of a round, every method in turns on it)."""
    dataset = demo_dataset(args.demo_lengths, world=world, tokens=args.tokens, pad_token_id=args.demo_pad_token_id,
                           vocab=args.vocab)
    batches = args.demo_global_batches
    inputs = []
    for batch in range(batches):
        one = demo_inputs(dataset, batch, rank)
        inputs.append({k: v.to(device) if hasattr(v, "to") else v for k, v in one.items()})

    def step(i: int):
        model.zero_grad(set_to_none=True)
        model(**inputs[i % batches]).loss.backward()

    rounds = argparse.Namespace(**{**vars(args), "warmup": args.warmup * batches, "steps": args.steps * batches,
                                   "batches_per_round": batches})
    return step, rounds
