"""``distca-hf bench --pipeline-parallel P``: its flags' defaults and checks, and the run (check,
launch, summarise, print; exit status 1 when the methods disagree).
"""

from __future__ import annotations

import json
import os

from ...planning.cost import batch_tokens_problem
from ..machine_limits import memory_problem, threads_problem, world_problem
from . import processes
from .model import MODEL_DEFAULTS, bench_model_bytes
from .pipeline import PIPELINE_DEFAULTS, UNSUPPORTED
from .pipeline_reports import format_pipeline_table, summarize_pipeline
from .pipeline_worker import run_pipeline_rank
from .workloads import check_workload_names


MAX_ROUNDS = 10_000
"""The most ``--steps`` (and ``--warmup``) rounds a benchmark takes, as ``simulate`` caps its draws."""


def check_sizes(args, parser, *, extra: tuple[str, ...] = ()) -> None:
    """The benchmark's sizes (and ``extra`` flags) are integers >= 1, and ``--world x --tokens``
    positions fit the pair counts; ``parser.error`` names the flag."""
    for name in ("world", "tokens", "short_docs", "layers", "steps", "threads", "hidden", "intermediate", "heads",
                 "kv_heads", "vocab", *extra):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("steps", "warmup"):  # (each round is a real step of every method: a typo would run for days)
        if getattr(args, name) > MAX_ROUNDS:
            parser.error(f"--{name} must be at most {MAX_ROUNDS} rounds, got {getattr(args, name)}")
    problem = batch_tokens_problem(args.world, args.tokens, ("--world", "--tokens")) or threads_problem(args.threads)
    under_torchrun = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    if not problem and not under_torchrun:  # spawned here, not by torchrun
        problem = world_problem(args.world)
    if not problem and args.heads <= args.hidden:
        here = int(os.environ.get("LOCAL_WORLD_SIZE", args.world)) if under_torchrun else args.world
        problem = memory_problem(bench_model_bytes(args, stages=args.pipeline_parallel or 1), here,
                                 "--hidden, --intermediate, --layers, --vocab and --tokens", args.device)
    if problem:
        parser.error(problem)


def check_pipeline_arguments(args, parser) -> None:
    """Fill the defaults of a ``--pipeline-parallel`` run and refuse what it cannot run, naming the flag."""
    p = args.pipeline_parallel
    if p < 2:
        parser.error(f"--pipeline-parallel must be >= 2 (stages), got {p}")
    for name, value in {**MODEL_DEFAULTS, **PIPELINE_DEFAULTS}.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.quick:  # (it was ignored: the pipeline run kept its own sizes)
        parser.error("--quick is not for --pipeline-parallel; size the run with --tokens, --steps and --micro-batches")
    if args.short_docs is not None and args.workload != "skewed":  # (ignored: only skewed rows have short documents)
        parser.error(f"--short-docs is for --workload skewed (got --workload {args.workload})")
    if args.short_docs is None:
        args.short_docs = max(1, args.tokens // 256)
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:  # under torchrun
        args.world = int(os.environ["WORLD_SIZE"])
    check_sizes(args, parser, extra=("micro_batches",))
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if args.world % p:
        parser.error(f"--world {args.world} must be a multiple of --pipeline-parallel {p} (data-parallel copies x "
                     "stages)")
    if args.layers % p:
        parser.error(f"--layers {args.layers} must be a multiple of --pipeline-parallel {p}: every stage holds the "
                     "same number of decoder layers")
    from ...runtime.pipeline_schedules import check_micro_batches

    try:  # the baseline runs torch's 1F1B (the rule's one home; its fix names settings, so said in the flags')
        check_micro_batches("1f1b", args.micro_batches, p, setting="--micro-batches")
    except ValueError:
        parser.error(f"--micro-batches {args.micro_batches}: the baseline runs torch's 1F1B, which needs at least one "
                     f"micro-batch per stage (--pipeline-parallel {p})")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        parser.error("--hidden must be a multiple of --heads, and --heads a multiple of --kv-heads")
    if args.short_docs > args.tokens:
        parser.error("--short-docs cannot exceed --tokens")
    if "," in args.workload:
        parser.error("--pipeline-parallel runs one workload at a time")
    if args.workload in UNSUPPORTED:
        parser.error(f"--pipeline-parallel does not run --workload {args.workload} ({UNSUPPORTED[args.workload]}); "
                     "use skewed, balanced, mixed or sample:FILE.json")
    if args.overlap not in ("none", "wave") or args.backward == "both" or args.trace:
        parser.error("--pipeline-parallel runs one distca setting: --overlap none|wave, --backward saved|resend "
                     "(cad_1f1b always runs resend), no --trace")
    for flag, value in (("--global-batches", args.global_batches), ("--long-tokens", args.long_tokens)):
        if value is not None:
            parser.error(f"{flag} is not for --pipeline-parallel")
    if args.no_ulysses:
        parser.error("--no-ulysses is not for --pipeline-parallel")


def run_pipeline_cli(args, parser) -> int:
    """``distca-hf bench --pipeline-parallel P ...`` (``cli.run_cli`` routes here): check, launch,
    summarise, print; exit status 1 when the methods' losses or gradient norms disagree. The ranks run
    by ``processes.launch``, read from its module when called (a test's seam)."""
    import sys

    check_workload_names(args, parser)
    check_pipeline_arguments(args, parser)
    load_before = os.getloadavg()[0]
    results = processes.launch(run_pipeline_rank, args)
    if results is None:  # a rank other than 0 under torchrun
        return 0
    results["load_average"] = [load_before, os.getloadavg()[0]]
    summary = summarize_pipeline(results, args)
    print(json.dumps(summary) if args.json else format_pipeline_table(summary))
    check = summary["check"]
    if not check["agree"]:
        print(f"distca-hf bench --pipeline-parallel: the methods disagree on the same model and rows: step losses "
              f"differ by up to {check['max_loss_rel_diff']:.3g} and gradient norms by up to "
              f"{check['max_grad_norm_rel_diff']:.3g} (relative; allowed {check['rtol']:g}); the timings are not "
              "comparable. Please report this with the command line", file=sys.stderr)
        return 1
    return 0
