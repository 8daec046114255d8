"""``distca-hf bench``: a real multi-process step-time comparison, colocated against distca.

Every rank builds the same small Llama-like model and its own packed batch of ``--workload``:

- ``skewed`` (default): even ranks hold one long document, odd ranks many short ones (the straggler
  pattern CAD removes);
- ``balanced``: two documents per rank whose split differs between even and odd ranks, so every
  rank's attention is within a few percent of the mean (about 1.03 max/mean): a step distca cannot
  speed up, where it must not be slower;
- ``mixed``: every round a new batch drawn from a length sample (the demo's documents: the Python
  help topics at about 3 characters a token, 67 to 20k tokens) packed rank after rank;
- ``sample:FILE.json``: the same with the lengths (a JSON list of token counts) in FILE;
- ``demo``: below;
- ``long``: below.

A comma list (``--workload skewed,balanced,mixed``) runs several, one after the other in the same
processes, each measured side by side. Both methods run the same data with the same exact
per-document kernel; *colocated* computes each rank's documents where they are, *distca* plans
(``--tolerance``, default ``auto``: by time) and dispatches. Step time is forward + backward, timed
between barriers (so it is the slowest rank's), median over ``--steps`` after ``--warmup``. The
methods take turns step by step (colocated, then each distca setting, then again, each round on its
own batch), so the ratios are measured side by side even on a machine whose speed drifts; the JSON
and the table give the per-step speedup of each distca setting over colocated (min / median / max
over rounds). ``--quick``: small sizes for a check in about a minute (``--tokens 2048 --steps 3
--warmup 1 --layers 2`` unless given).

``--overlap none,wave,pingpong`` also runs the overlap modes; for each it reports the step time and
``overlap_fraction``: communication time hidden under compute / total communication time, from the
timeline (``distca_hf.runtime.timeline``: an all-to-all lasts from launch to completion, and the time a rank
blocks waiting for it is the part not hidden), over all ranks, forward and backward apart.
``--trace OUT.json`` writes the last step of each mode as a Chrome trace.

The *ideal* is measured from the colocated run: each rank's time outside the attention kernel plus
the mean over ranks of the kernel time, i.e. the step if attention were perfectly balanced and
communication were free.

``--workload long`` (``long_documents``): one document spans every rank beside short ones: short
documents, then the long one starting in rank 0's row and ending in the last rank's, then short ones
(the ranks hold consecutive slices of that stream). It compares distca (``span_ranks=True``) with
per-document context parallelism (``context_parallel``: the spanning document head-tail balanced
over its holders, its K/V all-gathered in every layer, whole documents where they are), DeepSpeed
Ulysses (``ulysses``: ALST's ``UlyssesSPAttentionHF`` with the same kernel as its core) and
*colocated-where-possible*: each rank computes its own pieces with no communication, which for the
spanning document is **not** its attention (a piece sees only itself): the no-communication lower
bound, not a method. Every method runs the same tokens with the same kernel; all but colocated are
exact. Per method: the median step time (methods taking turns), the bytes sent in one layer's
forward (all ranks, counted at the ``torch.distributed`` calls), and memory: the peak of tensor
bytes allocated during one forward + backward and alive at once, and those still alive when the
forward ends (kept for backward), from ``TensorMemory``, max over ranks; also the per-step speedup
of distca over each baseline (min / median / max over steps).

``--workload demo`` (``demo_document_lengths``, ``demo_dataset``): the global batches ``make demo``
trains, exactly: its documents (the pydoc topics tokenized by its offline byte-level BPE, the first
8 held out for evaluation, ``training.offline_corpus``) packed as ``DistCATrainer`` packs them
(``PackedDataset(..., span_ranks=True)``, ``PackingConfig(tokens_per_rank=--tokens, seed=0)``: global
batches of ``world x --tokens`` tokens whose documents span ranks; a rank's row that continues a
document starts at its ``position_ids`` p > 0) and collated by ``PackedCollator``; random token ids
stand in for the text (the step time does not depend on them). The loss is the demo's: transformers'
causal-LM loss over ``labels`` / ``shift_labels``, normalised by the global batch's label tokens.
Every method runs with ``span_ranks=True`` (colocated too: its continuing pieces still receive their
document's K/V prefix). The model is the demo's (hidden 64, intermediate 128, 2 layers, 2 heads, 1
K/V head) unless those flags are given. A *round* runs every global batch once, in packing order,
every method in turns on each batch; ``--warmup`` rounds (default 1) come first, then ``--steps``
measured rounds (default 3; ``--global-batches N`` keeps the first N batches). Each batch (one
step of the demo) is timed per method by its fastest measured round (a shared machine's noise only
ever adds time); the table and the JSON give per batch the colocated and distca times and their
ratio, the per-step ratios (min / median / max over batches), the batches more than 3% slower than
colocated, and the whole-run speedup (sum of colocated times / sum of distca times) against the
demo's targets (whole run >= 1.25x, no batch below 0.97x; reported for the demo's own sizes only).
No measured ideal here: colocated itself sends the prefix K/V of the documents that span ranks.

CPU: ``distca-hf bench`` (gloo, one thread per process). GPUs: ``distca-hf bench --world N`` on a
machine with N GPUs (NCCL, bf16, flash-attn when installed), or under ``torchrun --nproc-per-node N
-m distca_hf bench``.

The files, in data-path order (each imports only files above it; ``tests/test_structure.py`` checks
it, and that no file grows past 300 lines):

    workloads         every ``--workload``'s document lengths per round and rank, the names' check (pure)
    demo_data         ``--workload demo``: the demo's documents, packing, inputs, model sizes and targets
    measure           the kernel's seconds, tensor memory (``TensorMemory``), bytes sent (``CommBytes``)
    model             the small Llama-like model every rank builds, its default shape
    processes         one process per rank (``launch``, or ``torchrun``) joining the process group
    long_worker       ``--workload long`` on one rank: distca against per-document CP, Ulysses, colocated
    worker            one rank (``run_rank``): every method in turns, timings, plans, timeline events gathered
    summaries         the JSON: each workload's summary, per-step speedups, targets
    tables            the tables printed without ``--json``
    pipeline          ``--pipeline-parallel P``: what it compares (below), its methods, sizes and rows
    pipeline_worker   one pipeline rank: its stage, a ``PipelineRunner`` per schedule, the methods in turns
    pipeline_reports  ``--pipeline-parallel``'s JSON and table, the check that the methods agree
    pipeline_cli      ``--pipeline-parallel``'s defaults, checks and run
    cli               the flags, their checks and ``run_cli`` (check, launch, summarise, print)

This front door re-exports every name the callers use (``from distca_hf.tools import bench;
bench.summarize(...)``) and holds ``main``; ``python -m distca_hf.tools.bench`` runs it
(``__main__``).
"""

from __future__ import annotations

from .cli import DEFAULTS, QUICK, add_arguments, build_parser, run_cli
from .demo_data import (DEMO_EVAL_DOCUMENTS, DEMO_MODEL, DEMO_ROUNDS, DEMO_TARGET, DEMO_TOKENS_PER_RANK, demo_dataset,
                        demo_document_lengths, demo_inputs, demo_packing_config, demo_run_matches, demo_step)
from .long_worker import run_long_workload
from .measure import CommBytes, TensorMemory, sync, time_kernels
from .model import MODEL_DEFAULTS, bench_model
from .pipeline import (AGREEMENT_RTOL, METHODS, PIPELINE_DEFAULTS, PIPELINE_TARGET, UNSUPPORTED, micro_batch_imbalance,
                       micro_batch_lengths, pipeline_row)
from .pipeline_cli import check_pipeline_arguments, run_pipeline_cli
from .pipeline_reports import check_agreement, format_pipeline_table, summarize_pipeline
from .pipeline_worker import run_pipeline_rank
from .processes import init_process, launch
from .summaries import TARGETS, per_batch_minimum, per_step_ratios, summarize, summarize_demo, summarize_long
from .tables import format_long_table, format_table
from .worker import run_rank, turn_order
from .workloads import (ALONE, BALANCED_SHIFT, WORKLOADS, balanced_batch, check_workload_names, default_long_tokens,
                        demo_lengths, drawn_batches, long_documents, sample_lengths, skewed_batch, workload_batches)

__all__ = [
    "AGREEMENT_RTOL", "ALONE", "BALANCED_SHIFT", "CommBytes", "DEFAULTS", "DEMO_EVAL_DOCUMENTS", "DEMO_MODEL",
    "DEMO_ROUNDS", "DEMO_TARGET", "DEMO_TOKENS_PER_RANK", "METHODS", "MODEL_DEFAULTS", "PIPELINE_DEFAULTS",
    "PIPELINE_TARGET", "QUICK", "TARGETS", "TensorMemory", "UNSUPPORTED", "WORKLOADS", "add_arguments",
    "balanced_batch", "bench_model", "build_parser", "check_agreement", "check_pipeline_arguments",
    "check_workload_names", "default_long_tokens", "demo_dataset", "demo_document_lengths", "demo_inputs",
    "demo_lengths", "demo_packing_config", "demo_run_matches", "demo_step", "drawn_batches", "format_long_table",
    "format_pipeline_table", "format_table", "init_process", "launch", "long_documents", "main",
    "micro_batch_imbalance", "micro_batch_lengths", "per_batch_minimum", "per_step_ratios", "pipeline_row",
    "run_cli", "run_long_workload", "run_pipeline_cli", "run_pipeline_rank", "run_rank", "sample_lengths",
    "skewed_batch", "summarize", "summarize_demo", "summarize_long", "summarize_pipeline", "sync", "time_kernels",
    "turn_order", "workload_batches",
]


def main(argv=None) -> int:
    """``distca-hf bench`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    parser = build_parser()
    return run_cli(parser.parse_args(argv), parser)

