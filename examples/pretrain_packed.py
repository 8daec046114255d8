"""Pre-training on packed documents with a plain Accelerate loop and ``DistCAAccelerator``.

The loop a ``transformers.Trainer`` hides, written out: pack documents into one row of at most
``--tokens_per_rank`` tokens per rank (``PackedDataset``: the same number of micro-batches on every
rank), normalise the loss by the label tokens of all ranks and scale it by the world size (DDP and
DeepSpeed average gradients over ranks), and read the plan's balance with ``distca_hf.plan_stats()``.

    accelerate launch --config_file recipes/cpu-2proc.yaml examples/pretrain_packed.py
    accelerate launch --config_file recipes/deepspeed-zero2.yaml examples/pretrain_packed.py   # GPUs
    torchrun --nproc-per-node 2 examples/pretrain_packed.py --max_steps 10 --output_dir out/pretrain

Offline by default, like ``finetune_long_context.py``: Python's help topics, a BPE tokenizer trained
on the spot and a tiny random Llama. The flags follow the HF scripts' names (``--max_steps``,
``--learning_rate``, ``--seed``, ``--output_dir``) and take every distca setting (``--tolerance``,
``--mode colocated``, ``--distca_config recipes/distca.yaml``, ...); ``--help`` lists them with their
defaults.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional
from distca_hf.tools.cli import help_description


@dataclass
class LoopArguments:
    max_steps: int = field(default=10, metadata={"aliases": ["--steps"], "help": "Optimizer steps to train."})
    tokens_per_rank: int = field(default=4096, metadata={
        "help": "The token budget of one rank's packed row per forward (the micro-batch)."})
    learning_rate: float = field(default=1e-3, metadata={"help": "AdamW's learning rate."})
    seed: int = field(default=0, metadata={"help": "Seeds the model's weights and the order of the rows."})
    output_dir: Optional[str] = field(default=None, metadata={
        "help": "Where to save the trained model (save_pretrained) at the end. Left out: not saved."})


def parse_args(argv=None):
    from transformers import HfArgumentParser

    from distca_hf.training.arguments import DistCAArguments

    parser = HfArgumentParser((LoopArguments, DistCAArguments), description=help_description(__doc__))
    loop, distca = parser.parse_args_into_dataclasses(args=argv, look_for_args_file=False)
    if loop.max_steps < 1 or loop.tokens_per_rank < 2:
        parser.error(f"--max_steps must be >= 1 and --tokens_per_rank >= 2, got {loop.max_steps} and "
                     f"{loop.tokens_per_rank}")
    return loop, distca


def main(argv=None) -> int:
    args, distca_args = parse_args(argv)
    import torch
    from torch.utils.data import DataLoader

    import distca_hf
    from distca_hf import DistCAAccelerator, PackedCollator, PackedDataset, PackingConfig
    from distca_hf.planning import imbalance
    from finetune_long_context import offline_tokenizer, pydoc_topics, tiny_llama

    accelerator = DistCAAccelerator(distca_plugin=distca_args.plugin())
    texts = pydoc_topics()
    tokenizer = offline_tokenizer(texts)
    documents = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
    packed = PackedDataset(documents, PackingConfig(tokens_per_rank=args.tokens_per_rank, seed=args.seed),
                           world_size=accelerator.num_processes)
    accelerator.print(f"packing: {packed.report}")
    loader = DataLoader(packed, batch_size=1, shuffle=True, collate_fn=PackedCollator(),
                        generator=torch.Generator().manual_seed(args.seed))
    model = tiny_llama(tokenizer, max(4096, args.tokens_per_rank), args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    accelerator.print(f"{'step':>5} {'loss':>9} {'attn imbalance':>18} {'step s':>7}")
    model.train()
    step = 0
    while step < args.max_steps:
        for batch in loader:
            start = time.perf_counter()
            # every token's target (the collator's shift_labels: right also when a document goes on in the
            # next rank's row, span_ranks=True, where labels[..., 1:] would miss the row's last target)
            labels = batch["shift_labels"].ne(-100).sum()
            label_tokens = accelerator.reduce(labels, reduction="sum")  # all ranks' label tokens
            # HF's causal-LM loss with num_items_in_batch is sum / num_items_in_batch; times the world size
            # because DDP / DeepSpeed average gradients over ranks.
            loss = model(**batch, num_items_in_batch=label_tokens).loss * accelerator.num_processes
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            stats = distca_hf.plan_stats()
            reported = accelerator.reduce(loss.detach(), reduction="mean")  # = sum of token losses / label tokens
            elapsed = time.perf_counter() - start
            step += 1
            before = stats["attn_pairs_local"] if stats.get("dispatched") else None
            balance = (f"{imbalance(before):>8.2f} -> {imbalance(stats['attn_pairs_served']):<6.3f}"
                       if before else f"{'(local)':>18}")
            accelerator.print(f"{step:>5} {reported.item():>9.4f} {balance} {elapsed:>7.2f}")
            if step == args.max_steps:
                break
    if args.output_dir:
        accelerator.wait_for_everyone()
        accelerator.unwrap_model(model).save_pretrained(args.output_dir, is_main_process=accelerator.is_main_process,
                                                        save_function=accelerator.save)
        if accelerator.is_main_process:
            tokenizer.save_pretrained(args.output_dir)
        accelerator.print(f"model saved to {args.output_dir}")
    # No accelerator.end_training(): with torch 2.13, destroying a gloo process group right after a
    # collective can deadlock at exit (the group's thread needs the GIL its destructor holds).
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
