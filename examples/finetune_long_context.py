"""Long-context fine-tuning with DistCATrainer: packed documents, balanced core attention.

Launch it on as many processes as you like (each is one rank; attention is balanced across them):

    accelerate launch --config_file recipes/cpu-2proc.yaml examples/finetune_long_context.py
    accelerate launch --config_file recipes/single-node.yaml examples/finetune_long_context.py \\
        --model meta-llama/Llama-3.2-1B --dataset my_corpus.jsonl --tokens-per-rank 32768 --bf16
    torchrun --nproc-per-node 2 examples/finetune_long_context.py

By default it is offline: the documents are the Python help topics shipped with the standard
library (``pydoc_data.topics``: 79 documents from 78 to 20k tokens), the tokenizer is a byte-level
BPE trained on them on the spot, and the model is a tiny Llama with random weights.

The ranks share global batches of ``ranks x --tokens-per-rank`` tokens, one slice per rank, so a
document longer than one rank's budget trains whole across ranks (``span_ranks``, the default of
``DistCATrainer`` on several ranks; ``DISTCA_SPAN_RANKS=0`` packs every rank alone); the packing line
says how many documents span ranks and how many, longer than a whole global batch, were still cut. ``--model``
takes a local path or Hub name (its tokenizer comes with it), ``--dataset`` a local file (.jsonl,
.json, .txt, .csv, .parquet), a ``save_to_disk`` folder or a Hub dataset name.

``--compare-colocated`` trains the same run twice, with distca and colocated (the same kernel, each
rank computing the attention of its own tokens), and prints both loss tables, the largest loss
difference and the speedup; this is what ``make demo`` runs. Colocated (``mode="colocated"``) moves
no query: a piece that continues a document begun on another rank still receives that document's
K/V prefix, as any exact method must, so both runs give the same losses.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PrinterCallback, ProgressCallback, \
    TrainingArguments

from distca_hf import (DistCAPlugin, DistCATrainer, PackingConfig, StepTableCallback, load_documents,
                       prepare_training_arguments)
from distca_hf.training.launch_checks import prepare_cpu_launch


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    data = parser.add_argument_group("model and data")
    data.add_argument("--model", help="model path or Hub name (default: a tiny random Llama)")
    data.add_argument("--dataset", help="documents: file, save_to_disk folder or Hub name (default: pydoc topics)")
    data.add_argument("--dataset-split", default="train")
    data.add_argument("--text-column", default="text")
    data.add_argument("--streaming", action="store_true", help="read the dataset lazily (packs on the fly)")
    data.add_argument("--eval-documents", type=int, default=8, help="documents held out for evaluation (0: none)")
    pack = parser.add_argument_group("packing")
    pack.add_argument("--tokens-per-rank", type=int, default=8192, help="token budget of one rank's micro-batch")
    pack.add_argument("--length-aware", action="store_true", help="pack best-fit by length (fuller micro-batches)")
    train = parser.add_argument_group("training")
    train.add_argument("--max-steps", type=int, default=30)
    train.add_argument("--lr", type=float, default=1e-3)
    train.add_argument("--optim", default="adamw_torch")
    train.add_argument("--grad-accum", type=int, default=1)
    train.add_argument("--gradient-checkpointing", action="store_true")
    train.add_argument("--bf16", action="store_true")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--output-dir", help="checkpoints and logs (default: a temporary folder)")
    train.add_argument("--save-steps", type=int, default=0, help="save a checkpoint every N steps (0: never)")
    train.add_argument("--resume", help="checkpoint folder to resume from")
    train.add_argument("--logging-steps", type=int, default=1)
    cad = parser.add_argument_group("distca")
    cad.add_argument("--mode", choices=["distca", "colocated"], default="distca",
                     help="colocated: every rank computes the attention of its own tokens (no query moves)")
    cad.add_argument("--distca-config", help="YAML file with a distca: section (settings for DistCAPlugin)")
    cad.add_argument("--compare-colocated", action="store_true",
                     help="train distca, then the same run colocated; print both and the speedup")
    cad.add_argument("--loss-tolerance", type=float, default=1e-3,
                     help="with --compare-colocated: largest allowed |loss difference| (exit status 1 above)")
    args = parser.parse_args(argv)
    for name in ("max_steps", "tokens_per_rank", "grad_accum", "logging_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.eval_documents < 0 or args.save_steps < 0:
        parser.error("--eval-documents and --save-steps must be >= 0")
    if args.compare_colocated and args.resume:
        parser.error("--compare-colocated trains from scratch; drop --resume")
    if args.dataset and not args.model:
        parser.error("--dataset needs --model (its tokenizer); the offline tokenizer only knows the pydoc topics")
    return args


# -- the offline defaults ---------------------------------------------------------------------------


def pydoc_topics() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def offline_tokenizer(texts: list[str]):
    """A byte-level BPE trained on ``texts`` (deterministic: every rank trains the same one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<eos>")


def tiny_llama(tokenizer, max_positions: int, seed: int):
    """A 2-layer Llama with random weights. Narrow on purpose (hidden 64, two heads of 32): on a CPU
    the attention of long documents then dominates a step, as it does for long contexts on GPUs."""
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=max_positions,
                         tie_word_embeddings=False, use_cache=False, bos_token_id=None,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="distca", dtype=torch.float32)


# -- one run ----------------------------------------------------------------------------------------


def load_data(args):
    """(tokenizer, train documents, eval documents or None, model factory)."""
    if args.model:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    if args.dataset:
        documents = load_documents(args.dataset, tokenizer if args.model else None, split=args.dataset_split,
                                   text_column=args.text_column, streaming=args.streaming)
    else:
        import datasets

        texts = pydoc_topics()
        if not args.model:
            tokenizer = offline_tokenizer(texts)
        documents = load_documents(datasets.Dataset.from_dict({"text": texts}), tokenizer)
        if args.streaming:
            documents = documents.to_iterable_dataset()
    eval_documents = None
    if args.eval_documents and not args.streaming:
        held_out = min(args.eval_documents, len(documents) // 4)
        eval_documents = documents.select(range(held_out))
        documents = documents.select(range(held_out, len(documents)))

    def make_model(world_size: int):
        if args.model:
            torch.manual_seed(args.seed)
            return AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="distca",
                                                        dtype=torch.bfloat16 if args.bf16 else torch.float32)
        # documents span the ranks: the longest trained whole fills every rank's row
        return tiny_llama(tokenizer, max(4096, world_size * args.tokens_per_rank), args.seed)

    return tokenizer, documents, eval_documents, make_model


def train_once(args, mode: str, data, output_dir: str) -> tuple[StepTableCallback, dict, DistCATrainer]:
    tokenizer, documents, eval_documents, make_model = data
    settings = {"mode": mode}
    if args.distca_config:
        plugin = DistCAPlugin.from_accelerate_config(args.distca_config, **settings)
    else:  # the distca: section of a `distca-hf launch` config, if any, else the defaults
        plugin = DistCAPlugin.from_environment(**settings)
    # Under a multi-process launcher without GPU, Accelerate needs ACCELERATE_USE_CPU=1 (DDP) or the
    # gloo backend (DeepSpeed) to count the processes; set them before TrainingArguments sets up.
    ddp_backend = prepare_cpu_launch().get("backend")
    training_args = TrainingArguments(
        output_dir=output_dir, ddp_backend=ddp_backend, dataloader_pin_memory=torch.cuda.is_available(),
        ddp_find_unused_parameters=False, per_device_train_batch_size=1, per_device_eval_batch_size=1,
        gradient_accumulation_steps=args.grad_accum, max_steps=args.max_steps, learning_rate=args.lr,
        optim=args.optim, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, seed=args.seed,
        logging_steps=args.logging_steps, save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500, eval_strategy="no", report_to=[], bf16=args.bf16,
        activation_checkpointing=args.gradient_checkpointing, disable_tqdm=True,
    )
    # Check (and on CPU with DeepSpeed given in code, repair) the process count before the model is
    # built: ZeRO-3's zero.Init partitions it using the arguments. DistCATrainer checks again.
    prepare_training_arguments(training_args)
    table = StepTableCallback()
    trainer = DistCATrainer(
        model=make_model(training_args.world_size), args=training_args, train_dataset=documents,
        eval_dataset=eval_documents, processing_class=tokenizer, distca_plugin=plugin, callbacks=[table],
        packing=PackingConfig(tokens_per_rank=args.tokens_per_rank, length_aware=args.length_aware, seed=args.seed,
                              pad_token_id=tokenizer.pad_token_id or 0),
    )
    table.title = f"\n== {mode}: {args.max_steps} steps on {trainer.args.world_size} ranks =="
    trainer.remove_callback(PrinterCallback)  # the table replaces the raw log dicts
    trainer.remove_callback(ProgressCallback)
    if trainer.is_world_process_zero():
        if not args.streaming:  # a stream's report fills as it is read: printed after training
            print(f"packing: {trainer.packing_reports['train']}", flush=True)
        config = trainer.distca.config
        balance = ("colocated (no query moves)" if mode == "colocated"
                   else f"{config.mode}, tolerance {config.tolerance}")
        print(f"distca: {balance}, overlap {config.overlap}, server group {list(trainer.distca.server_ranks)} of "
              f"{trainer.distca.topology.world_size} ranks", flush=True)
    trainer.train(resume_from_checkpoint=args.resume)
    if args.streaming and trainer.is_world_process_zero():
        print(f"packing (the stream read so far): {trainer.packing_reports['train']}", flush=True)
    metrics = trainer.evaluate() if eval_documents is not None else {}
    if trainer.is_world_process_zero() and metrics:
        print(f"eval loss {metrics['eval_loss']:.4f} over {metrics['eval_label_tokens']} label tokens", flush=True)
    return table, metrics, trainer


def compare(distca: StepTableCallback, colocated: StepTableCallback, tolerance: float) -> bool:
    pairs = list(zip(distca.rows, colocated.rows))
    if not pairs:
        print("no logged steps to compare (--logging-steps larger than --max-steps?)")
        return False
    worst = max(abs(a["loss"] - b["loss"]) for a, b in pairs)
    # The first step carries one-off costs (allocation, caches): time the rest. Both runs train the
    # same tokens in every step, so the ratio of total times is the ratio of throughputs.
    timed = pairs[1:] if len(pairs) > 1 else pairs
    distca_time = sum(a["step_time_s"] for a, _ in timed)
    colocated_time = sum(b["step_time_s"] for _, b in timed)
    before = statistics.mean(a["before"] for a, _ in pairs)
    after = statistics.mean(a["after"] for a, _ in pairs)
    print("\n== distca vs colocated ==")
    print(f"largest |loss difference| over {len(pairs)} steps: {worst:.2e} (tolerance {tolerance:g})")
    print(f"attention imbalance (mean over steps): {before:.2f} colocated -> {after:.3f} distca")
    print(f"training time of steps 2..{len(pairs)}: colocated {colocated_time:.1f} s, distca {distca_time:.1f} s")
    print(f"speedup: {colocated_time / distca_time:.2f}x", flush=True)
    return worst <= tolerance


def main(argv=None) -> int:
    args = parse_args(argv)
    import datasets

    datasets.disable_progress_bars()
    data = load_data(args)
    with tempfile.TemporaryDirectory(prefix="distca-finetune-") as scratch:
        output_dir = args.output_dir or scratch
        if not args.compare_colocated:
            train_once(args, args.mode, data, output_dir)
            return 0
        distca, _, trainer = train_once(args, "distca", data, os.path.join(output_dir, "distca"))
        colocated, _, _ = train_once(args, "colocated", data, os.path.join(output_dir, "colocated"))
        ok = compare(distca, colocated, args.loss_tolerance) if trainer.is_world_process_zero() else True
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
