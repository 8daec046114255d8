"""Train a tiny Llama on packed documents with ``attn_implementation="distca"`` (one process).

Offline by design: the documents are the Python help topics shipped with the standard library
(``pydoc_data.topics``), the tokenizer is a byte-level BPE trained on them on the spot, and the model
is built from a config with random weights. Documents of very different lengths are packed into
micro-batches of ``--tokens_per_batch`` tokens with ``position_ids`` that restart at each document; documents
longer than a micro-batch are cut into chunks, and the cut is reported, never silent.

Before training, the script checks that the packed forward equals each document run alone with
eager attention, then prints the loss per step.

    python examples/train_packed_tiny.py [--max_steps 12] [--tokens_per_batch 2048]
"""

from __future__ import annotations

import argparse
import time

import torch
from pydoc_data.topics import topics
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig

import distca_hf  # noqa: F401  registers attn_implementation="distca"
from distca_hf.tools.cli import help_description


def train_tokenizer(texts, vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def pack(documents: list[list[int]], tokens_per_batch: int):
    """Greedy packing into micro-batches of exactly ``tokens_per_batch`` tokens (the tail batch may be
    shorter). A document longer than the budget is cut into chunks; returns the batches (lists of
    documents) and how many documents were cut."""
    batches, current, used, cut = [], [], 0, 0
    for doc in documents:
        if len(doc) > tokens_per_batch:
            cut += 1
        while doc:
            take = min(len(doc), tokens_per_batch - used)
            current.append(doc[:take])
            doc, used = doc[take:], used + take
            if used == tokens_per_batch:
                batches.append(current)
                current, used = [], 0
    if current:
        batches.append(current)
    return batches, cut


def to_inputs(batch):
    input_ids = torch.tensor([t for doc in batch for t in doc]).unsqueeze(0)
    position_ids = torch.cat([torch.arange(len(doc)) for doc in batch]).unsqueeze(0)
    labels = input_ids.clone()
    labels[position_ids == 0] = -100  # no document predicts its first token from the previous one
    return dict(input_ids=input_ids, position_ids=position_ids, labels=labels)


def check_exact(model, batch) -> float:
    """Max |packed distca logits - per-document eager logits|."""
    with torch.no_grad():
        packed = model(**to_inputs(batch)).logits[0]
        model.set_attn_implementation("eager")
        alone = torch.cat([model(input_ids=torch.tensor([doc])).logits[0] for doc in batch])
        model.set_attn_implementation("distca")
    return float((packed - alone).abs().max())


def main(argv=None):
    parser = argparse.ArgumentParser(description=help_description(__doc__),
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    # The HF scripts' flag names (dashes, and the names of 0.1, work too).
    parser.add_argument("--max_steps", "--max-steps", "--steps", dest="steps", type=int, default=12,
                        help="Optimizer steps to train.")
    parser.add_argument("--tokens_per_batch", "--tokens-per-batch", "--tokens", dest="tokens", type=int, default=2048,
                        help="Tokens per packed micro-batch; longer documents are cut into chunks.")
    parser.add_argument("--learning_rate", "--learning-rate", "--lr", dest="lr", type=float, default=3e-3,
                        help="AdamW's learning rate.")
    parser.add_argument("--seed", type=int, default=0, help="Seeds the weights and the order of the documents.")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.tokens < 2:
        parser.error(f"--max_steps must be >= 1 and --tokens_per_batch >= 2, got {args.steps} and {args.tokens}")

    torch.manual_seed(args.seed)
    texts = [topics[k] for k in sorted(topics)]
    tokenizer = train_tokenizer(texts, vocab_size=1024)
    eos = tokenizer.token_to_id("<eos>")
    documents = [tokenizer.encode(t).ids + [eos] for t in texts]
    order = torch.randperm(len(documents), generator=torch.Generator().manual_seed(args.seed)).tolist()
    batches, cut = pack([documents[i] for i in order], args.tokens)
    lengths = sorted(len(d) for d in documents)
    print(f"{len(documents)} documents, {sum(lengths)} tokens, lengths {lengths[0]}..{lengths[-1]} "
          f"(median {lengths[len(lengths) // 2]}); {len(batches)} micro-batches of {args.tokens} tokens; "
          f"{cut} documents longer than a micro-batch were cut into chunks")

    config = LlamaConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max(4096, args.tokens), use_cache=False)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="distca", dtype=torch.float32)
    print(f"exactness: max |distca packed - eager per document| logits = {check_exact(model, batches[0]):.2e}")

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model.train()
    print(f"{'step':>4} {'loss':>8} {'docs':>5} {'tokens/s':>9}")
    for step in range(args.steps):
        batch = batches[step % len(batches)]
        start = time.perf_counter()
        loss = model(**to_inputs(batch)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - start
        print(f"{step:>4} {loss.item():>8.4f} {len(batch):>5} {sum(map(len, batch)) / elapsed:>9.0f}")


if __name__ == "__main__":
    main()
