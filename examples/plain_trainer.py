"""distca under the plain ``transformers.Trainer``: ``DataCollatorWithFlattening`` packs each
device's examples into one padding-free row, ``attn_implementation="distca"`` balances the rows'
attention across the ranks. No trainer of ours, no plugin.

Offline by design: a tiny Llama with random weights built from a config, documents from the Python
help topics shipped with the standard library (``pydoc_data.topics``) as UTF-8 bytes (token id =
byte value; a real run loads its tokenizer and model with ``from_pretrained``).

    torchrun --nproc-per-node 2 examples/plain_trainer.py [--max_steps 2]
    accelerate launch --config_file recipes/cpu-2proc.yaml examples/plain_trainer.py
    python examples/plain_trainer.py        # one process: exact, nothing to balance
"""

from __future__ import annotations

import argparse
import time

import distca_hf  # noqa: F401  registers attn_implementation="distca"
from distca_hf.tools.cli import help_description

BYTES = 256  # the vocabulary: one token per byte value


def documents(count: int, max_tokens: int):
    """``count`` help topics of very different lengths, each cut to at most ``max_tokens`` bytes,
    as a ``datasets.Dataset`` with an ``input_ids`` column."""
    import datasets

    from distca_hf.training.offline_corpus import pydoc_topics

    texts = pydoc_topics()[::5][:count]
    ids = [list(text.encode("utf-8")[: max(8, max_tokens * (i % 7 + 1) // 7)]) for i, text in enumerate(texts)]
    return datasets.Dataset.from_dict({"input_ids": ids})


def main(argv=None):
    parser = argparse.ArgumentParser(description=help_description(__doc__),
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--max_steps", "--max-steps", type=int, default=4, help="Optimizer steps to train.")
    parser.add_argument("--per_device_train_batch_size", "--per-device-train-batch-size", type=int, default=4,
                        help="Documents flattened into each device's row.")
    parser.add_argument("--max_tokens", "--max-tokens", type=int, default=256,
                        help="Longest document, in tokens (bytes); the others are 1/7 .. 7/7 of it.")
    parser.add_argument("--attn_implementation", "--attn-implementation", default="distca",
                        help="The model's attention: distca, or eager / sdpa to compare (the same losses).")
    parser.add_argument("--output_dir", "--output-dir", default="out/plain_trainer",
                        help="The Trainer's output directory (nothing is saved).")
    args = parser.parse_args(argv)
    for flag, value in (("--max_steps", args.max_steps), ("--per_device_train_batch_size",
                                                          args.per_device_train_batch_size), ("--max_tokens", args.max_tokens)):
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")

    import torch
    from transformers import (AutoModelForCausalLM, DataCollatorWithFlattening, LlamaConfig, Trainer,
                              TrainingArguments)

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=BYTES, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4 * args.max_tokens,
                         use_cache=False)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=args.attn_implementation, dtype=torch.float32)
    training_args = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.per_device_train_batch_size,
        learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
        dataloader_pin_memory=False, use_cpu=not torch.cuda.is_available(), seed=0)
    dataset = documents(count=args.max_steps * args.per_device_train_batch_size * 8, max_tokens=args.max_tokens)
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset,
                      data_collator=DataCollatorWithFlattening(return_flash_attn_kwargs=True))
    started = time.perf_counter()
    trainer.train()
    seconds = [time.perf_counter() - started]
    if torch.distributed.is_initialized():  # every rank's time in train(): balanced ranks finish together
        seconds = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(seconds, time.perf_counter() - started)
    if not trainer.is_world_process_zero():
        return
    print(f"losses: {[round(h['loss'], 4) for h in trainer.state.log_history if 'loss' in h]}")
    print(f"seconds in train() per rank: {[round(s, 2) for s in seconds]}")
    if args.attn_implementation == "distca":
        stats = distca_hf.plan_stats()
        print(f"last step's attention pairs per rank: colocated {stats['attn_pairs_local']}, "
              f"served {stats['attn_pairs_served']} (dispatched: {stats['dispatched']})")


if __name__ == "__main__":
    main()
