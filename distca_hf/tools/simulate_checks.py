"""The simulator's sizes, checked before anything is drawn (``simulate``, ``simulate_pipeline`` and the
``distca-hf simulate`` flags), and its ``--time-model`` file: errors name the argument or the flag."""

from __future__ import annotations

from ..config import is_integer
from ..planning.cost import TimeModel, batch_tokens_problem

__all__ = ["MAX_DRAWS", "check_sizes", "draws_problem", "pipeline_flags", "time_model_flag"]

MAX_DRAWS = 10_000
"""The most batches (``batches``, times ``micro_batches`` under a pipeline) one simulation draws and
plans: each takes 0.01-1 s here, so more would run for hours (a huge count read as a hang)."""


def check_sizes(**sizes) -> None:
    """``simulate``'s and ``simulate_pipeline``'s sizes: integers >= 1, naming the argument; a batch
    of ``ranks x tokens_per_rank`` tokens within ``cost.MAX_POSITION``; at most ``MAX_DRAWS`` draws."""
    for name, value in sizes.items():
        if not is_integer(value) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    problem = batch_tokens_problem(sizes["ranks"], sizes["tokens_per_rank"]) or \
        draws_problem(sizes["batches"], sizes.get("micro_batches"))
    if problem:
        raise ValueError(problem)


def draws_problem(batches: int, micro_batches: int | None, names=("batches", "micro_batches")) -> str | None:
    """Why ``batches`` (times ``micro_batches`` under a pipeline) is more than ``MAX_DRAWS`` draws, in
    ``names`` (the arguments' or the flags'); None when it is not."""
    draws = batches * (micro_batches or 1)
    if draws <= MAX_DRAWS:
        return None
    named = f"{names[0]} x {names[1]}" if micro_batches else names[0]
    return f"{named} = {draws}: a simulation draws and plans at most {MAX_DRAWS} batches (each takes up to a second)"


def time_model_flag(path, parser, args) -> TimeModel:
    """``--time-model``'s file as a ``TimeModel``, its problems reported naming the flag; a profile of
    another shape than ``--hidden`` / ``--heads`` / ``--kv-heads`` is refused (its costs would be
    mixed with this shape's bytes)."""
    try:
        model, shape = TimeModel.load_profile(path)
    except ValueError as e:
        parser.error(f"--time-model: {e}")
    flags = {"hidden": args.hidden, "heads": args.heads, "kv_heads": args.kv_heads}
    differ = {k: v for k, v in flags.items() if shape and k in shape and shape[k] != v}
    if differ:
        measured = " ".join(f"--{k.replace('_', '-')} {shape[k]}" for k in flags if k in shape)
        given = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in flags.items())
        parser.error(f"--time-model {path} was profiled on {measured}, this run models {given}: pass the profile's "
                     "shape, or profile this one (distca-hf profile --hidden ... --heads ... --kv-heads ...)")
    return model


def pipeline_flags(args, parser, default_layers: int) -> tuple[bool, int | None, int | None, int]:
    """``(pipelined, stages, micro_batches, layers)`` from ``--pipeline-parallel``, ``--micro-batches``
    and ``--layers`` (``default_layers`` when not given), refused through ``parser`` naming the flag;
    ``stages`` and ``micro_batches`` are ``None`` without the pipeline model."""
    pipelined = args.pipeline_parallel is not None or args.micro_batches is not None
    if args.layers is not None and not pipelined:
        parser.error("--layers is read by the pipeline model only (the layer model times one layer); give "
                     "--pipeline-parallel P too, or leave --layers out")
    layers = args.layers if args.layers is not None else default_layers
    if not pipelined:
        return False, None, None, layers
    stages = args.pipeline_parallel if args.pipeline_parallel is not None else 1
    if stages < 1:
        parser.error(f"--pipeline-parallel must be >= 1, got {stages}")
    if args.ranks % stages:
        parser.error(f"--ranks ({args.ranks}) must be divisible by --pipeline-parallel ({stages}): --ranks is "
                     f"the total, {stages} stages x --ranks / {stages} data-parallel pipelines")
    micro_batches = args.micro_batches if args.micro_batches is not None else 2 * stages
    if micro_batches < 1:
        parser.error(f"--micro-batches must be >= 1, got {micro_batches}")
    if layers % stages:
        parser.error(f"--layers ({layers}) must be a positive multiple of --pipeline-parallel ({stages}): "
                     "every stage holds the same number of layers")
    return True, stages, micro_batches, layers
