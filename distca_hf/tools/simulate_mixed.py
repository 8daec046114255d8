"""Models that mix sliding-window and full layers (``distca-hf simulate --sliding-window W``): what a
plan per kind of layer gains over one plan for every layer. Pure numpy over the planner.

Gemma 2 (one layer in two slides), Gemma 3 (five in six), Cohere2 and Olmo 3 (three in four) and Qwen2
with ``max_window_layers`` attend to whole prefixes in some layers and to the last ``W`` keys in the
others. A sliding layer's attention is nearly the same per token on every rank (a query sees at most
``W`` keys), and its CA-tasks need only the ``W`` keys before their queries. distca plans such a forward
twice (``runtime.forward``: ``ForwardContext.for_window``): its full layers as any model's, its sliding
layers under their window. Three ways to run the same batches, each a layer time averaged over the
layers (``sliding_fraction`` of them slide):

- ``colocated``: every rank computes its own queries in every layer (a piece of a spanning document
  receives the keys before it: its whole prefix in a full layer, ``W`` keys in a sliding one);
- ``one_plan``: every layer runs the full layers' plan (how distca ran these models before): a sliding
  layer computes its windowed pairs on the plan's servers but the plan moved whole prefixes, and its
  balance was made for pairs the sliding layers do not compute;
- ``plan_per_kind``: the sliding layers run a plan of their own (``PlannerConfig.window = W``).

Each is the time model's layer (``rank_time``: compute and the exposed share of the bytes, the slowest
rank), forward + backward. Both plans are made without key-split tiles, as the runtime makes them for
such models (``runtime.forward.tiles_hold_for``: a tile holds exactly only for one window), so the full
layers' plan may differ from the one ``simulate`` times for distca (a model of one kind of layer).
``sliding_fraction`` is below 1: a model whose every layer slides is planned under its window already.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time

import numpy as np

from ..config import is_integer
from ..planning import DocumentPieces, Plan, PlannerConfig, colocated_plan
from ..planning.rank_time import rank_seconds
from ..planning.relay_trees import plan_kv_sends

__all__ = ["MIXED_METHODS", "DEFAULT_SLIDING_FRACTION", "add_mixed_arguments", "check_mixed", "mixed_flags_problem",
           "mixed_layer_times", "simulate_mixed_layers", "format_mixed_table"]

MIXED_METHODS = ("colocated", "one_plan", "plan_per_kind")

DEFAULT_SLIDING_FRACTION = 0.5
"""The share of the layers that slide when none is given: Gemma 2's (one layer in two)."""


def add_mixed_arguments(parser: argparse.ArgumentParser) -> None:
    """``distca-hf simulate``'s ``--sliding-window`` and ``--sliding-fraction``."""
    mixed = parser.add_argument_group(
        "models mixing sliding-window and full layers", "also model a model some of whose layers slide (Gemma 2/3, "
        "Cohere2, Olmo 3; JSON key 'mixed_layers'): colocated, one plan for every layer, and a plan per kind of "
        "layer (what distca runs)")
    mixed.add_argument("--sliding-window", type=int, metavar="W",
                       help="keys per query of the sliding layers (Gemma 3: 1024, Gemma 2: 4096)")
    mixed.add_argument("--sliding-fraction", type=float, metavar="F",
                       help=f"share of the layers that slide, in (0, 1) (default {DEFAULT_SLIDING_FRACTION}, Gemma 2; "
                            "Gemma 3: 0.833, Cohere2 and Olmo 3: 0.75); only with --sliding-window")


def _problems(window, fraction, names) -> str | None:
    if window is not None and not (is_integer(window) and window >= 1):
        return f"{names[0]} must be an integer >= 1 (keys per query), got {window!r}"
    if not (isinstance(fraction, (int, float)) and math.isfinite(fraction) and 0.0 < fraction < 1.0):
        return (f"{names[1]} must be in (0, 1) (the share of the layers that slide; a model whose every layer "
                f"slides is planned under its window already), got {fraction!r}")
    return None


def check_mixed(sliding_window: int | None, sliding_fraction: float) -> None:
    """``simulate``'s ``sliding_window`` (``None``: no mixed model) and ``sliding_fraction``, naming the argument."""
    problem = _problems(sliding_window, sliding_fraction, ("sliding_window", "sliding_fraction"))
    if problem:
        raise ValueError(problem)


def mixed_flags_problem(sliding_window: int | None, sliding_fraction: float | None, pipelined: bool) -> str | None:
    """What is wrong with ``--sliding-window`` / ``--sliding-fraction`` (None: nothing); ``pipelined``:
    the pipeline model is asked for too (it times full layers only)."""
    if sliding_fraction is not None and sliding_window is None:
        return "--sliding-fraction needs --sliding-window W (the window of the layers that slide)"
    if sliding_window is not None and pipelined:
        return ("--sliding-window is read by the layer model only; the pipeline model (--pipeline-parallel, "
                "--micro-batches) times full layers: run them apart")
    return _problems(sliding_window, DEFAULT_SLIDING_FRACTION if sliding_fraction is None else sliding_fraction,
                     ("--sliding-window", "--sliding-fraction"))


def _windowed_layer_seconds(plan: Plan, pieces: DocumentPieces, config: PlannerConfig, window: int) -> float:
    """A sliding layer of ``window`` run on ``plan``, a plan made for whole prefixes: its servers
    compute the windowed pairs and keys of the plan's tasks (the plan under the window), while the
    plan's K/V sends move (whole prefixes, along its relay trees)."""
    windowed = dataclasses.replace(plan, window=window)
    return float(rank_seconds(windowed, pieces, config, plan_kv_sends(plan, pieces)).max(initial=0.0))


def mixed_layer_times(pieces: DocumentPieces, config: PlannerConfig, *, sliding_window: int, planner) -> dict:
    """One batch: ``{"full": {method: s}, "sliding": {method: s}, "sliding_plan_ms": ms, ...}``, the layer
    times of a full and of a sliding layer for every ``MIXED_METHODS`` method. ``planner``: ``(pieces,
    PlannerConfig) -> Plan``; it plans the full layers under ``config`` and the sliding ones with
    ``window=sliding_window``, both without key-split tiles (module docstring)."""
    config = dataclasses.replace(config, key_split=False, window=None)
    windowed = dataclasses.replace(config, window=sliding_window)
    full_plan = planner(pieces, config)
    start = time.perf_counter()
    sliding_plan = planner(pieces, windowed)
    sliding_ms = (time.perf_counter() - start) * 1e3
    layer = lambda plan, cfg: float(rank_seconds(plan, pieces, cfg).max(initial=0.0))
    full = layer(full_plan, config)
    return {
        "full": {"colocated": layer(colocated_plan(pieces, config.servers), config), "one_plan": full,
                 "plan_per_kind": full},
        "sliding": {"colocated": layer(colocated_plan(pieces, config.servers, window=sliding_window), windowed),
                    "one_plan": _windowed_layer_seconds(full_plan, pieces, windowed, sliding_window),
                    "plan_per_kind": layer(sliding_plan, windowed)},
        "sliding_plan_ms": sliding_ms,
        "sliding_plan_moves": bool(sliding_plan.moved_queries()),
    }


def simulate_mixed_layers(measured: list[dict], *, sliding_window: int, sliding_fraction: float) -> dict:
    """The JSON object ``"mixed_layers"`` from every batch's ``mixed_layer_times``: per method the layer
    time averaged over the layers (``sliding_fraction`` x the sliding layer's + the rest x the full
    layer's) and over the batches, and the speedups of a plan per kind."""
    check_mixed(sliding_window, sliding_fraction)
    step = {m: float(np.mean([sliding_fraction * b["sliding"][m] + (1 - sliding_fraction) * b["full"][m]
                              for b in measured])) for m in MIXED_METHODS}
    return {
        "sliding_window": int(sliding_window), "sliding_fraction": float(sliding_fraction),
        "layer_time_s": step,
        "sliding_layer_time_s": {m: float(np.mean([b["sliding"][m] for b in measured])) for m in MIXED_METHODS},
        "full_layer_time_s": {m: float(np.mean([b["full"][m] for b in measured])) for m in MIXED_METHODS},
        "speedup_vs_one_plan": step["one_plan"] / step["plan_per_kind"],
        "speedup_vs_colocated": step["colocated"] / step["plan_per_kind"],
        "sliding_plan_ms_median": float(statistics.median(b["sliding_plan_ms"] for b in measured)),
        "sliding_plan_moved_batch_fraction": float(np.mean([b["sliding_plan_moves"] for b in measured])),
    }


def format_mixed_table(mixed: dict) -> str:
    """The ``--sliding-window`` section of ``distca-hf simulate``'s table."""
    t, s, f = mixed["layer_time_s"], mixed["sliding_layer_time_s"], mixed["full_layer_time_s"]
    rows = [("mixed layers: sliding window, share of the layers that slide",
             f"{mixed['sliding_window']} keys, {mixed['sliding_fraction']:.2f}")]
    for method, label in (("colocated", "colocated packing"), ("one_plan", "distca, one plan for every layer"),
                          ("plan_per_kind", "distca, a plan per kind of layer")):
        rows.append((f"layer time (mean over layers), {label} (sliding / full layer)",
                     f"{1e3 * t[method]:.1f} ms ({1e3 * s[method]:.1f} / {1e3 * f[method]:.1f})"))
    rows += [("speedup of a plan per kind vs one plan", f"{mixed['speedup_vs_one_plan']:.2f}x"),
             ("speedup of a plan per kind vs colocated", f"{mixed['speedup_vs_colocated']:.2f}x"),
             ("sliding layers' plan: time (median), batches where it moves work",
              f"{mixed['sliding_plan_ms_median']:.1f} ms, {100 * mixed['sliding_plan_moved_batch_fraction']:.0f}%")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
