"""``distca-hf bench``: a real multi-process step-time comparison, colocated against distca.

This file: the command line. Its flags and their defaults, the checks that refuse a bad
combination by name, and ``run_cli``: check, start the processes, summarise, print (``--pipeline-parallel``
goes to ``pipeline_cli``). What the command measures: the package's docstring.
"""

from __future__ import annotations

import argparse
import json
import os

from ..output_paths import output_path_problem
from . import demo_data, processes
from .demo_data import DEMO_MODEL, DEMO_ROUNDS, demo_packing_config
from .model import MODEL_DEFAULTS
from .pipeline_cli import check_sizes, run_pipeline_cli
from .summaries import summarize, summarize_demo, summarize_long
from .tables import format_long_table, format_table
from .worker import run_rank
from .workloads import check_workload_names, default_long_tokens, long_documents


QUICK = {"tokens": 2048, "steps": 3, "warmup": 1, "layers": 2}
"""What ``--quick`` changes (unless given): a check in about a minute on 2 CPU processes."""


DEFAULTS = {"tokens": 8192, "steps": 5, "warmup": 1, "layers": 4}


def _setting_flag(name: str):
    """An argparse type reading a flag's text as setting ``name``'s variable is read
    (``config.read_setting_text``: one spelling rule, the setting's check)."""
    from ...config import read_setting_text

    def read(text: str):
        try:
            return read_setting_text(name, text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    read.__name__ = name  # (argparse names the type in its messages)
    return read


_tolerance = _setting_flag("tolerance")  # auto or a number >= 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world", type=int, default=2, help="processes, one rank each (GPUs on a CUDA machine; "
                        "default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per rank (default 8192; --quick 2048)")
    parser.add_argument("--short-docs", type=int, default=None, help="documents on the odd (short) ranks of skewed "
                        "(default: tokens / 256); --workload long: short documents are tokens / short-docs tokens long")
    parser.add_argument("--hidden", type=int, default=None, help="the model's hidden size, elements per token "
                        "(default 256; --workload demo: 64)")
    parser.add_argument("--intermediate", type=int, default=None, help="the MLP's intermediate size, elements per "
                        "token (default 688; --workload demo: 128)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 4; --quick and --workload "
                        "demo: 2)")
    parser.add_argument("--heads", type=int, default=None, help="query heads (default 8; --workload demo: 2)")
    parser.add_argument("--kv-heads", type=int, default=None, help="key/value heads, a divisor of --heads (default "
                        "2; --workload demo: 1)")
    parser.add_argument("--vocab", type=int, default=1024, help="vocabulary size, token ids (default: %(default)s)")
    parser.add_argument("--steps", "--rounds", dest="steps", type=int, default=None, help="measured rounds (default "
                        "5; --quick and --workload demo: 3, a demo round running every global batch once)")
    parser.add_argument("--warmup", type=int, default=None, help="rounds before measuring (default 1)")
    parser.add_argument("--quick", action="store_true",
                        help=f"small sizes for a check in about a minute: {QUICK} unless given")
    parser.add_argument("--backward", choices=["saved", "resend", "both"], default="saved",
                        help="distca's backward mode (the setting DISTCA_BACKWARD), or both to time each "
                        "(default: %(default)s)")
    parser.add_argument("--tolerance", type=_tolerance, default="auto",
                        help="distca's tolerance: 'auto' plans by time (the default setting), a number bounds "
                        "max/mean - 1 of attention load")
    parser.add_argument("--overlap", default="none",
                        help="none|wave|pingpong, or several separated by commas (the first gives distca_step_s)")
    parser.add_argument("--trace", metavar="OUT.json", help="write the last step's Chrome trace (one file per mode "
                        "when several: OUT.<mode>.json)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default: %(default)s)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto: CUDA (NCCL, one GPU per process) when there is one, else CPU (gloo) "
                        "(default: %(default)s)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--timeout", type=_setting_flag("timeout_s"), default=600.0, help="process-group timeout in seconds (default: "
                        "%(default)s)")
    parser.add_argument("--json", action="store_true", help="print a JSON object")
    parser.add_argument("--workload", default="skewed",
                        help="skewed: even ranks one long document, odd ranks many short; balanced: every rank's "
                        "attention within a few percent; mixed: each round a batch drawn from the demo's document "
                        "lengths; sample:FILE.json: drawn from a JSON list of lengths; several separated by commas run "
                        "one after the other; long (alone): one document over every rank beside short ones, against "
                        "per-document CP, Ulysses and colocated-where-possible; demo (alone): make demo's own global "
                        "batches (its documents and packing, documents spanning ranks, its model), each batch timed by "
                        "its fastest round, the whole run's speedup and the batches more than 3%% slower")
    parser.add_argument("--global-batches", type=int, default=None,
                        help="--workload demo: run only the first N of the demo's global batches (default: all)")
    parser.add_argument("--long-tokens", type=int, default=None,
                        help="--workload long: the long document's tokens (default: world x tokens - tokens / 2)")
    parser.add_argument("--no-ulysses", action="store_true", help="--workload long: leave DeepSpeed Ulysses out")
    parser.add_argument("--pipeline-parallel", type=int, default=None, metavar="P",
                        help="pipeline stages (world / P data-parallel copies each): torch's stock 1F1B with colocated "
                        "attention against 1F1B with CAD per stage and cad_1f1b (CAD across stages), side by side; "
                        "see distca_hf/tools/bench/pipeline.py (its defaults: --tokens 6144 --micro-batches 4 --layers 2 "
                        "--hidden 128 --intermediate 344 --heads 4)")
    parser.add_argument("--micro-batches", type=int, default=None, metavar="M",
                        help="--pipeline-parallel: micro-batches per step, one packed row of --tokens each per copy "
                        "(default 4)")


def _check_long(args, parser) -> None:
    """``--workload long``: the long document's length, one distca setting, whether Ulysses runs."""
    args.ulysses_skipped = "--no-ulysses" if args.no_ulysses else None
    if args.workload != "long":
        for flag, given in (("--long-tokens", args.long_tokens is not None), ("--no-ulysses", args.no_ulysses)):
            if given:
                parser.error(f"{flag} is for --workload long (got --workload {args.workload})")
        return
    if args.long_tokens is None:
        args.long_tokens = default_long_tokens(args.world, args.tokens)
    try:
        long_documents(args.world, args.tokens, args.long_tokens, args.tokens // args.short_docs)
    except ValueError as e:
        parser.error(str(e))
    if args.backward == "both" or "," in args.overlap or args.trace:
        parser.error("--workload long runs one distca setting: --backward saved|resend, one --overlap, no --trace")
    if args.ulysses_skipped is None:
        from ..ulysses import ulysses_unavailable

        args.ulysses_skipped = ulysses_unavailable(args.world, args.heads, args.kv_heads)


def _check_demo(args, parser) -> None:
    """``--workload demo``: the demo's documents (tokenized here, once: the ranks get the lengths, from
    ``demo_data.demo_document_lengths()``), their packing for ``--world`` ranks of ``--tokens``, and
    ``--global-batches``."""
    if args.workload != "demo":
        if args.global_batches is not None:
            parser.error("--global-batches is for --workload demo")
        return
    try:
        args.demo_lengths, args.demo_pad_token_id = demo_data.demo_document_lengths()
    except ImportError as e:
        parser.error(f"--workload demo: {e}")
    from ...training.packing import pack_rows

    if args.tokens < 2:  # (PackingConfig's own error, a traceback, before)
        parser.error(f"--tokens must be at least 2 for --workload demo (a packed row of the demo), got {args.tokens}")
    _, report = pack_rows(args.demo_lengths, demo_packing_config(args.tokens, args.demo_pad_token_id),
                          group_size=args.world)
    args.demo_packing = str(report)
    args.demo_global_batches = report.global_batches
    if args.global_batches is not None:
        if not 1 <= args.global_batches <= report.global_batches:
            parser.error(f"--global-batches must be between 1 and {report.global_batches} (the demo's global batches "
                         f"of {args.world} x {args.tokens} tokens), got {args.global_batches}")
        args.demo_global_batches = args.global_batches


def run_cli(args, parser) -> int:
    """Fill the defaults of ``args`` and check them (``parser.error`` names a bad flag), run every rank
    (``processes.launch`` of ``worker.run_rank``), print the table or the JSON; the exit status.
    ``processes.launch`` and ``demo_data.demo_document_lengths`` are read from their modules when
    called, so a test replaces them there (``monkeypatch.setattr(bench.processes, "launch", ...)``)."""
    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.pipeline_parallel is not None:  # pipeline stages: their own methods and sizes
        if args.device == "cuda" and args.world > torch.cuda.device_count() and "WORLD_SIZE" not in os.environ:
            # (seen on one H200: gloo aborts sending a stage's CUDA activations, "writev ... Bad address")
            parser.error(f"--pipeline-parallel on CUDA needs one GPU per rank (NCCL; gloo cannot send CUDA "
                         f"activations between stages): --world {args.world} on {torch.cuda.device_count()} GPU(s); "
                         "use --device cpu, or as many GPUs as ranks")
        return run_pipeline_cli(args, parser)
    if args.micro_batches is not None:
        parser.error("--micro-batches is for --pipeline-parallel")
    if args.workload == "demo":  # the demo's model and rounds, unless given
        for name, value in {**DEMO_MODEL, "steps": DEMO_ROUNDS}.items():
            if getattr(args, name) is None:
                setattr(args, name, value)
    for name, value in MODEL_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name, value in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, QUICK[name] if args.quick else value)
    if args.short_docs is not None and not {"skewed", "long"} & set(str(args.workload).split(",")):
        parser.error(f"--short-docs is for --workload skewed or long (got --workload {args.workload}): the others "
                     "draw their documents")  # (ignored before)
    if args.short_docs is None:
        args.short_docs = max(1, args.tokens // 256)  # short documents of 256 tokens
    check_workload_names(args, parser)
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    check_sizes(args, parser)
    if args.trace is not None:
        problem = output_path_problem("--trace", args.trace)
        if problem:
            parser.error(problem)
    if args.world < 2 and "WORLD_SIZE" not in os.environ:
        parser.error("--world must be >= 2: the benchmark compares ranks")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        parser.error("--hidden must be a multiple of --heads, and --heads a multiple of --kv-heads")
    if args.short_docs > args.tokens:
        parser.error("--short-docs cannot exceed --tokens")
    overlaps = args.overlap.split(",")
    bad = [o for o in overlaps if o not in ("none", "wave", "pingpong")]
    if bad or len(set(overlaps)) != len(overlaps):
        parser.error(f"--overlap takes distinct values among none, wave, pingpong separated by commas; got {args.overlap!r}")
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:  # under torchrun
        args.world = int(os.environ["WORLD_SIZE"])
    _check_long(args, parser)
    _check_demo(args, parser)
    results = processes.launch(run_rank, args)
    if results is None:  # a rank other than 0 under torchrun
        return 0
    if args.workload == "long":
        summary = summarize_long(results, args)
        print(json.dumps(summary) if args.json else format_long_table(summary))
        return 0
    summaries = {name: summarize_demo(r, args) if name == "demo" else summarize(r, args, name)
                 for name, r in results.items()}
    if len(summaries) == 1:  # the contract's flat object
        summary = next(iter(summaries.values()))
        print(json.dumps(summary) if args.json else format_table(summary))
    else:
        print(json.dumps({"workloads": summaries}) if args.json
              else "\n\n".join(format_table(s) for s in summaries.values()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``distca-hf bench`` argument parser."""
    parser = argparse.ArgumentParser(prog="distca-hf bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return parser
