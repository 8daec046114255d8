"""Long-context fine-tuning with DistCATrainer: packed documents, balanced core attention.

Launch it on as many processes as you like (each is one rank; attention is balanced across them):

    accelerate launch --config_file recipes/cpu-2proc.yaml examples/finetune_long_context.py \
        --max_steps 4 --output_dir out/finetune
    accelerate launch --config_file recipes/single-node.yaml examples/finetune_long_context.py \
        --model_name_or_path meta-llama/Llama-3.2-1B --dataset my_corpus.jsonl --tokens_per_rank 32768 \
        --bf16 --learning_rate 2e-5 --lr_scheduler_type cosine --warmup_steps 100 --report_to tensorboard
    torchrun --nproc-per-node 2 examples/finetune_long_context.py --max_steps 10
    accelerate launch --config_file recipes/cpu-2proc.yaml examples/finetune_long_context.py \
        --pipeline_parallel_size 2 --pipeline_schedule cad_1f1b --max_steps 4    # two pipeline stages

The command line is ``transformers.HfArgumentParser`` over ``TrainingArguments`` and this script's
own groups (model, data, packing, the distca settings, the comparison), so every Trainer flag works
as in any HF script (``--output_dir``, ``--learning_rate``, ``--report_to``, ``--save_steps``,
``--resume_from_checkpoint``, ``--bf16``, ``--use_cpu``, ...; dashes work as well as underscores).
The defaults suit this demo and differ from TrainingArguments' in: ``--max_steps 30``,
``--learning_rate 1e-3``, ``--lr_scheduler_type constant``, ``--logging_steps 1``, ``--seed 0``,
``--output_dir out/finetune_long_context`` and one packed row per device (the token budget is
``--tokens_per_rank``). The model is saved to ``--output_dir`` at the end. On a machine without GPU,
mixed precision needs ``--use_cpu`` as well (``--bf16 --use_cpu``), as transformers requires.

By default it is offline: the documents are the Python help topics shipped with the standard
library (``pydoc_data.topics``: 79 documents from 78 to 20k tokens), the tokenizer is a byte-level
BPE trained on them on the spot, and the model is a tiny Llama with random weights.

The ranks share global batches of ``ranks x --tokens_per_rank`` tokens, one slice per rank, so a
document longer than one rank's budget trains whole across ranks (``span_ranks``, the default of
``DistCATrainer`` on several ranks; ``--span_ranks false`` packs every rank alone); the packing line
says how many documents span ranks and how many, longer than a whole global batch, were still cut.
``--model_name_or_path`` takes a local path or Hub name (its tokenizer comes with it), ``--dataset`` a
local file (.jsonl, .json, .txt, .csv, .parquet), a ``save_to_disk`` folder or a Hub dataset name.

``--compare_colocated`` trains the same run twice, with distca and colocated (the same kernel, each
rank computing the attention of its own tokens), into ``--output_dir``/distca and /colocated, and
prints both loss tables, the largest loss difference and the speedup; this is what ``make demo``
runs. Colocated (``--mode colocated``) moves no query: a piece that continues a document begun on
another rank still receives that document's K/V prefix, as any exact method must, so both runs give
the same losses.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
from dataclasses import dataclass, field
from typing import Literal, Optional

from distca_hf.training.offline_corpus import offline_tokenizer, pydoc_topics
from distca_hf.tools.cli import help_description

# Only what --help needs is imported here; torch, transformers' models and the trainer load in main().


@dataclass
class ModelArguments:
    model_name_or_path: Optional[str] = field(default=None, metadata={
        "aliases": ["--model"],
        "help": "A local model folder or a Hub name; its tokenizer comes with it. Left out: a tiny Llama with "
                "random weights and a tokenizer trained on the offline documents."})
    dtype: Literal["float32", "bfloat16", "float16"] = field(default="float32", metadata={
        "help": "The dtype of the model's weights. Mixed precision (weights in float32, compute in bfloat16) is "
                "--bf16, as in any Trainer script."})
    pipeline_parallel_size: Optional[int] = field(default=None, metadata={
        "help": "Split the model's decoder layers evenly into this many pipeline stages (torch.distributed.pipelining; "
                "the processes are stages x data-parallel copies). Left out: the distca: section's "
                "pipeline_parallel_size, else 1. With stages, --pipeline_schedule picks gpipe, 1f1b or cad_1f1b and "
                "--pipeline_micro_batches the packed rows per optimizer step."})


@dataclass
class DataArguments:
    dataset: Optional[str] = field(default=None, metadata={
        "aliases": ["--dataset_name"],
        "help": "The documents: a local file (.jsonl, .json, .txt, .csv, .parquet), a save_to_disk folder or a "
                "Hub dataset name (owner/name). Left out: Python's help topics (pydoc_data.topics), offline. "
                "Needs --model_name_or_path (its tokenizer)."})
    dataset_split: str = field(default="train", metadata={"help": "The split of --dataset to train on."})
    text_column: str = field(default="text", metadata={
        "help": "The column of --dataset holding the text (data with input_ids already is read as it is, and "
                "another --text_column is refused)."})
    streaming: bool = field(default=False, metadata={
        "help": "Read --dataset lazily and pack it on the fly (no held-out evaluation documents)."})
    eval_documents: int = field(default=8, metadata={
        "help": "How many documents to hold out for evaluation after training (at most a quarter of them; "
                "0: none)."})


@dataclass
class PackingArguments:
    tokens_per_rank: int = field(default=8192, metadata={
        "help": "The token budget of one rank's packed row per forward (the micro-batch)."})
    length_aware: bool = field(default=False, metadata={
        "help": "Pack best-fit by length inside windows of documents, for fuller rows."})
    balance_micro_batches: bool = field(default=False, metadata={
        "help": "With --pipeline_parallel_size > 1: pack each optimizer step's micro-batches again so that none "
                "holds much more attention than the others (documents stay whole)."})


@dataclass
class ComparisonArguments:
    compare_colocated: bool = field(default=False, metadata={
        "help": "Train with distca, then the same run colocated (each rank its own attention); print both "
                "tables, the largest loss difference and the speedup."})
    loss_tolerance: float = field(default=1e-3, metadata={
        "help": "With --compare_colocated: the largest allowed loss difference between the runs; the exit status "
                "is 1 above it."})
    timing_repeats: int = field(default=1, metadata={
        "help": "With --compare_colocated: train each mode this many times, in turns that alternate direction "
                "(distca, colocated, colocated, distca, ...), and time every step by its fastest run. The runs are deterministic, so they differ "
                "only by the machine's noise, which only ever slows a step down; the repeats are neither "
                "evaluated nor saved. make demo uses 2."})


# The example's defaults where they differ from TrainingArguments' (shown by --help).
EXAMPLE_DEFAULTS = dict(
    output_dir=os.path.join("out", "finetune_long_context"), max_steps=30, learning_rate=1e-3,
    lr_scheduler_type="constant", logging_steps=1, seed=0, per_device_train_batch_size=1,
    per_device_eval_batch_size=1, ddp_find_unused_parameters=False,
)


def parse_args(argv=None):
    """``(model, data, packing, distca, comparison, training)`` arguments from ``argv`` (default:
    ``sys.argv``); a bad combination exits with a message naming the flags."""
    from transformers import HfArgumentParser, TrainingArguments

    from distca_hf.training.arguments import DistCAArguments
    from distca_hf.training.launch_checks import has_gpu, prepare_cpu_launch

    # Under a multi-process launcher without GPU, Accelerate needs ACCELERATE_USE_CPU=1 (DDP) or the
    # gloo backend (DeepSpeed) to count the processes: set before TrainingArguments sets them up.
    backend = prepare_cpu_launch().get("backend")
    parser = HfArgumentParser((ModelArguments, DataArguments, PackingArguments, DistCAArguments, ComparisonArguments,
                               TrainingArguments), description=help_description(__doc__))
    parser.set_defaults(**EXAMPLE_DEFAULTS, dataloader_pin_memory=has_gpu(), **({"ddp_backend": backend} if backend
                                                                                else {}))
    model, data, packing, distca, comparison, training = parser.parse_args_into_dataclasses(
        args=argv, look_for_args_file=False)
    if model.pipeline_parallel_size is not None and model.pipeline_parallel_size < 1:
        parser.error(f"--pipeline_parallel_size must be at least 1, got {model.pipeline_parallel_size}")
    if packing.tokens_per_rank < 2:
        parser.error(f"--tokens_per_rank must be at least 2, got {packing.tokens_per_rank}")
    if data.eval_documents < 0:
        parser.error(f"--eval_documents must be >= 0, got {data.eval_documents}")
    if training.per_device_train_batch_size != 1 or training.per_device_eval_batch_size != 1:
        parser.error("--per_device_train_batch_size and --per_device_eval_batch_size must be 1: each rank runs one "
                     "packed row per forward; set its size with --tokens_per_rank")
    if comparison.timing_repeats < 1:
        parser.error(f"--timing_repeats must be at least 1, got {comparison.timing_repeats}")
    if comparison.timing_repeats > 1 and not comparison.compare_colocated:
        parser.error("--timing_repeats times the runs of --compare_colocated; add --compare_colocated or drop it")
    if comparison.compare_colocated and training.resume_from_checkpoint:
        parser.error("--compare_colocated trains from scratch; drop --resume_from_checkpoint")
    if not math.isfinite(comparison.loss_tolerance) or comparison.loss_tolerance < 0:
        parser.error(f"--loss_tolerance must be a finite number >= 0, got {comparison.loss_tolerance}")
    if comparison.loss_tolerance != ComparisonArguments.loss_tolerance and not comparison.compare_colocated:
        parser.error("--loss_tolerance bounds the loss difference of --compare_colocated's two runs; add "
                     "--compare_colocated or drop it")
    if comparison.compare_colocated and distca.mode is not None:
        parser.error(f"--mode {distca.mode}: --compare_colocated trains both modes, distca then colocated; drop --mode")
    if not data.dataset:  # (they were ignored: the offline documents trained)
        given = [f"--{name}" for name in ("dataset_split", "text_column")
                 if getattr(data, name) != getattr(DataArguments, name)]
        if given:
            several = len(given) > 1
            parser.error(f"{' and '.join(given)} {'read' if several else 'reads'} --dataset; add --dataset or drop "
                         f"{'them' if several else 'it'} (without it the offline documents train)")
    if data.dataset and not model.model_name_or_path:
        parser.error("--dataset needs --model_name_or_path (its tokenizer); the offline tokenizer only knows the "
                     "pydoc topics")
    return model, data, packing, distca, comparison, training


# -- the offline defaults ---------------------------------------------------------------------------
# pydoc_topics() and offline_tokenizer(texts) live in distca_hf.training.offline_corpus (imported above):
# `distca-hf bench --workload demo` packs the same documents.


def tiny_llama(tokenizer, max_positions: int, seed: int):
    """A 2-layer Llama with random weights. Narrow on purpose (hidden 64, two heads of 32): on a CPU
    the attention of long documents then dominates a step, as it does for long contexts on GPUs."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    import distca_hf  # noqa: F401  (registers "distca")

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=max_positions,
                         tie_word_embeddings=False, use_cache=False, bos_token_id=None,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="distca", dtype=torch.float32)


# -- one run ----------------------------------------------------------------------------------------


def load_data(model_args, data_args, packing_args, seed: int):
    """(tokenizer, train documents, eval documents or None, model factory)."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from distca_hf import load_documents

    datasets.disable_progress_bars()
    if model_args.model_name_or_path:
        tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    if data_args.dataset:
        documents = load_documents(data_args.dataset, tokenizer, split=data_args.dataset_split,
                                   text_column=data_args.text_column, streaming=data_args.streaming,
                                   flags={"source": "--dataset", "split": "--dataset_split",
                                          "text_column": "--text_column", "tokenizer": "--model_name_or_path"})
    else:
        texts = pydoc_topics()
        if not model_args.model_name_or_path:
            tokenizer = offline_tokenizer(texts)
        documents = load_documents(datasets.Dataset.from_dict({"text": texts}), tokenizer)
        if data_args.streaming:
            documents = documents.to_iterable_dataset()
    eval_documents = None
    if data_args.eval_documents and not data_args.streaming:
        held_out = min(data_args.eval_documents, len(documents) // 4)
        eval_documents = documents.select(range(held_out)) if held_out else None
        documents = documents.select(range(held_out, len(documents)))

    def make_model(world_size: int):
        if model_args.model_name_or_path:
            torch.manual_seed(seed)
            return AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, attn_implementation="distca",
                                                        dtype=getattr(torch, model_args.dtype))
        # documents span the ranks: the longest trained whole fills every rank's row
        return tiny_llama(tokenizer, max(4096, world_size * packing_args.tokens_per_rank), seed).to(
            getattr(torch, model_args.dtype))

    return tokenizer, documents, eval_documents, make_model


def _ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def train_once(mode: str | None, data, packing_args, distca_args, training_args, *, repeat: int = 0,
               pipeline_parallel_size: int | None = None):
    """Train one run with ``mode`` (``None``: as the distca settings say, ``--mode`` or a ``distca:``
    section's ``mode:``, else ``distca``), then evaluate it and save it to ``training_args.output_dir``;
    ``repeat > 0``: a timing repeat of a run already made (its header names the repeat, its table
    and packing line are not printed, nothing is evaluated or saved). Returns ``(step table, eval
    metrics, trainer)``."""
    import io

    from distca_hf import DistCATrainer, PackingConfig, StepTableCallback, prepare_training_arguments
    from distca_hf.training.plugin import PLANNER_ONLY_SETTINGS

    tokenizer, documents, eval_documents, make_model = data
    # the colocated run of a comparison plans nothing: the planner's flags are the distca run's
    unplanned = dict.fromkeys(PLANNER_ONLY_SETTINGS) if mode == "colocated" else {}
    given = {"mode": mode} if mode else {}
    given.update({"pipeline_parallel_size": pipeline_parallel_size} if pipeline_parallel_size else {})
    plugin = distca_args.plugin(**given, **unplanned)
    # Check (and on CPU with DeepSpeed given in code, repair) the process count before the model is
    # built: ZeRO-3's zero.Init partitions it using the arguments. DistCATrainer checks again.
    prepare_training_arguments(training_args)
    world = training_args.world_size
    table = StepTableCallback(out=io.StringIO() if repeat else None)
    main_process = training_args.process_index == 0
    if main_process:  # the run's header first, then what it is about to do
        again = f" (timing repeat {repeat + 1})" if repeat else ""
        print(f"\n== {plugin.resolved().mode}{again}: {training_args.max_steps} steps on {_ranks(world)} ==", flush=True)
    trainer = DistCATrainer(
        model=make_model(world), args=training_args, train_dataset=documents, eval_dataset=eval_documents,
        processing_class=tokenizer, distca_plugin=plugin, callbacks=[table],
        packing=PackingConfig(tokens_per_rank=packing_args.tokens_per_rank, length_aware=packing_args.length_aware,
                              seed=training_args.seed, pad_token_id=tokenizer.pad_token_id or 0,
                              balance_micro_batches=packing_args.balance_micro_batches),
    )
    streaming = not hasattr(documents, "__len__")  # a datasets.IterableDataset
    if trainer.is_world_process_zero() and not repeat:
        if not streaming:  # a stream's report fills as it is read: printed after training
            print(f"packing: {trainer.packing_reports['train']}", flush=True)
        config = trainer.distca.config
        balance = ("colocated (no query moves)" if config.mode == "colocated"
                   else f"{config.mode}, tolerance {config.tolerance}")
        print(f"distca: {balance}, overlap {config.overlap}, server group {list(trainer.distca.server_ranks)} of "
              f"{_ranks(trainer.distca.topology.world_size)}", flush=True)
        if plugin.pipeline_parallel_size > 1:
            print(f"pipeline: {plugin.pipeline_parallel_size} stages x {trainer.distca.topology.data_parallel} "
                  f"data-parallel, schedule {config.pipeline_schedule}, {trainer.args.gradient_accumulation_steps} "
                  "micro-batches per step", flush=True)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    if repeat:
        return table, {}, trainer
    if streaming and trainer.is_world_process_zero():
        print(f"packing (the stream read so far): {trainer.packing_reports['train']}", flush=True)
    metrics = trainer.evaluate() if eval_documents is not None else {}
    if trainer.is_world_process_zero() and metrics:
        print(f"eval loss {metrics['eval_loss']:.4f} over {metrics['eval_label_tokens']} label tokens", flush=True)
    trainer.save_model()  # the model, its config and the tokenizer, in --output_dir
    if trainer.is_world_process_zero():
        print(f"model saved to {training_args.output_dir}", flush=True)
    return table, metrics, trainer


def fastest_steps(tables) -> list[dict]:
    """Per step, the row of the fastest of ``tables`` (repeats of one deterministic run: the same
    steps, losses and plans; only the machine's noise differs, and it only adds time)."""
    return [min(rows, key=lambda r: r["step_time_s"]) for rows in zip(*(t.rows for t in tables))]


def repeat_noise(tables) -> list[float]:
    """Per step, how much slower the slowest repeat of a run was than its fastest (0.1: 10%);
    empty for a single run."""
    if len(tables) < 2:
        return []
    return [max(r["step_time_s"] for r in rows) / min(r["step_time_s"] for r in rows) - 1
            for rows in zip(*(t.rows for t in tables))]


def compare(distca_tables, colocated_tables, tolerance: float) -> bool:
    """Print the comparison of the two modes' step tables (one per run: the first, then its timing
    repeats); whether the first runs' losses agree within ``tolerance``."""
    pairs = list(zip(distca_tables[0].rows, colocated_tables[0].rows))
    if not pairs:
        print("no logged steps to compare (--logging_steps larger than --max_steps?)")
        return False
    worst = max(abs(a["loss"] - b["loss"]) for a, b in pairs)
    runs = len(distca_tables)
    # Each step timed by its fastest run per mode; the first step carries one-off costs (allocation,
    # caches): time the rest. Both modes train the same tokens in every step, so the ratio of total
    # times is the ratio of throughputs.
    timed = list(zip(fastest_steps(distca_tables), fastest_steps(colocated_tables)))
    timed = timed[1:] if len(timed) > 1 else timed
    distca_time = sum(a["step_time_s"] for a, _ in timed)
    colocated_time = sum(b["step_time_s"] for _, b in timed)
    before = statistics.mean(a["before"] for a, _ in pairs)
    after = statistics.mean(a["after"] for a, _ in pairs)
    print("\n== distca vs colocated ==")
    print(f"largest |loss difference| over {len(pairs)} steps: {worst:.2e} (tolerance {tolerance:g})")
    if runs > 1:
        again = max(abs(a["loss"] - b["loss"]) for tables in (distca_tables, colocated_tables)
                    for repeat in tables[1:] for a, b in zip(repeat.rows, tables[0].rows))
        noise = sorted(repeat_noise(distca_tables)[1:] + repeat_noise(colocated_tables)[1:])
        print(f"timing: every step's fastest of {runs} runs per mode, the modes alternating; the repeats reproduce "
              f"the losses within {again:.1e}; one step's runs differ by median {100 * statistics.median(noise):.0f}%, "
              f"up to {100 * noise[-1]:.0f}% (the machine's noise)")
    print(f"attention imbalance (mean over steps): {before:.2f} colocated -> {after:.3f} distca")
    first = 2 if len(pairs) > 1 else 1
    print(f"training time of steps {first}..{len(pairs)}: colocated {colocated_time:.1f} s, "
          f"distca {distca_time:.1f} s")
    print(f"speedup: {colocated_time / distca_time:.2f}x", flush=True)
    # Each step against its colocated twin (the same tokens): how uneven the gain is, and how many
    # steps distca lost. A step where "auto" kept the colocated plan runs the same work in both modes
    # (its imbalance is unchanged), so any difference there is the machine's.
    from distca_hf.tools.bench import DEMO_TARGET, per_step_ratios

    spread = per_step_ratios([b["step_time_s"] for _, b in timed], [a["step_time_s"] for a, _ in timed])
    least = DEMO_TARGET["per_step_speedup_at_least"]
    slower = [a["after"] >= a["before"] - 5e-3 for a, b in timed if b["step_time_s"] / a["step_time_s"] < least]
    print(f"per-step speedup: min {spread['min']:.2f}x, median {spread['median']:.2f}x, max {spread['max']:.2f}x; "
          f"{len(slower)} of {len(timed)} steps more than {100 * (1 - least):.0f}% slower than colocated"
          + (f" ({sum(slower)} of them kept the colocated plan: the same work in both modes)" if slower else ""),
          flush=True)
    return worst <= tolerance


def main(argv=None) -> int:
    model_args, data_args, packing_args, distca_args, comparison, training_args = parse_args(argv)
    from distca_hf.training.loading import DocumentSourceError

    try:
        if model_args.pipeline_parallel_size:  # the process count, before documents and model are made
            distca_args.plugin(pipeline_parallel_size=model_args.pipeline_parallel_size).topology(
                training_args.world_size)
        data = load_data(model_args, data_args, packing_args, training_args.seed)
    except (DocumentSourceError, ValueError) as error:  # one line that names the flag, not a traceback per rank
        print(f"{os.path.basename(sys.argv[0])}: error: {error}", file=sys.stderr, flush=True)
        return 2
    if not comparison.compare_colocated:
        # (the flag only when given: a distca: section's mode applies otherwise, as every setting's)
        train_once(distca_args.mode, data, packing_args, distca_args, training_args,
                   pipeline_parallel_size=model_args.pipeline_parallel_size)
        return 0
    base = training_args.output_dir
    tables = {"distca": [], "colocated": []}
    for repeat in range(comparison.timing_repeats):
        # turns alternate direction (distca, colocated, colocated, distca, ...): a slow stretch of the
        # machine, or the first run's cold caches, hit both modes alike
        for mode in (tables if repeat % 2 == 0 else reversed(tables)):
            training_args.output_dir = os.path.join(base, mode)
            table, _, trainer = train_once(mode, data, packing_args, distca_args, training_args, repeat=repeat,
                                           pipeline_parallel_size=model_args.pipeline_parallel_size)
            tables[mode].append(table)
    training_args.output_dir = base
    ok = True
    if trainer.is_world_process_zero():
        ok = compare(tables["distca"], tables["colocated"], comparison.loss_tolerance)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
