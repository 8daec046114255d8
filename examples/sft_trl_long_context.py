"""TRL's SFTTrainer (packing=True) on documents longer than one rank's row: ``DistCASFTTrainer``.

Prompt-completion examples (TRL's completion-only loss: the prompt tokens are no targets), packed
into global batches of ``processes x --max_length`` tokens; a document longer than one rank's row
trains whole, its pieces on later ranks attending to their whole prefix. TRL's own packing would
truncate it to ``--max_length``. Prints what packing did and the per-step losses.

Offline by design: a tiny Llama with random weights built from a config and Python's help topics
(``pydoc_data.topics``) with a BPE trained on them (a real run loads its model and tokenizer with
``from_pretrained(..., attn_implementation="distca")``).

    accelerate launch --config_file recipes/cpu-2proc.yaml examples/sft_trl_long_context.py
    python examples/sft_trl_long_context.py        # one process: rows of --max_length, longer documents cut
"""

from __future__ import annotations

import argparse

import distca_hf  # noqa: F401  registers attn_implementation="distca"
from distca_hf.tools.cli import help_description


def examples(count: int):
    """``count`` help topics as prompt-completion pairs (a ``datasets.Dataset``), completions of at
    most 6,000 characters (up to about 2,000 tokens)."""
    import datasets

    from distca_hf.training.offline_corpus import pydoc_topics

    texts = pydoc_topics()[::4][:count]
    return datasets.Dataset.from_dict({"prompt": [f"Explain, as Python's help does:\n{t[:60]}" for t in texts],
                                       "completion": [t[60:6000] for t in texts]})


def main(argv=None):
    parser = argparse.ArgumentParser(description=help_description(__doc__),
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--max_steps", "--max-steps", type=int, default=4, help="Optimizer steps to train.")
    parser.add_argument("--max_length", "--max-length", type=int, default=1024,
                        help="SFTConfig.max_length: tokens of one rank's row (a global batch is processes x this).")
    parser.add_argument("--examples", type=int, default=20, help="Help topics to train on.")
    parser.add_argument("--output_dir", "--output-dir", default="out/sft_trl_long_context",
                        help="The trainer's output directory (nothing is saved).")
    args = parser.parse_args(argv)
    for flag, value, least in (("--max_steps", args.max_steps, 1), ("--max_length", args.max_length, 2),
                               ("--examples", args.examples, 1)):
        if value < least:
            parser.error(f"{flag} must be >= {least}, got {value}")

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    from trl import SFTConfig

    from distca_hf.training import DistCASFTTrainer
    from distca_hf.training.offline_corpus import offline_tokenizer, pydoc_topics

    tokenizer = offline_tokenizer(pydoc_topics())
    gpu = torch.cuda.is_available()
    config = SFTConfig(output_dir=args.output_dir, packing=True, max_length=args.max_length,
                       per_device_train_batch_size=1, per_device_eval_batch_size=1, max_steps=args.max_steps,
                       learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no",
                       use_cpu=not gpu, bf16=gpu, disable_tqdm=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384),
        attn_implementation="distca", dtype=torch.float32)
    trainer = DistCASFTTrainer(model=model, args=config, train_dataset=examples(args.examples),
                               processing_class=tokenizer)
    if trainer.is_world_process_zero():
        print(f"packing ({trainer.args.world_size} process(es), span_ranks={trainer.span_ranks}): "
              f"{trainer.packing_reports['train']}", flush=True)
    trainer.train()
    if trainer.is_world_process_zero():
        for entry in trainer.state.log_history:
            if "loss" in entry:
                print(f"step {entry['step']}: loss {entry['loss']:.4f}, tokens so far {entry['num_tokens']:.0f}, "
                      f"token accuracy {entry['mean_token_accuracy']:.3f}")


if __name__ == "__main__":
    main()
