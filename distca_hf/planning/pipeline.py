"""The lockstep 1F1B schedule of ``pipeline_schedule="cad_1f1b"`` as a table of ticks, and the event
models that time a step of it and of torch's stock ``Schedule1F1B``. Pure Python and numpy.

Every stage runs every tick, all stages the same kind of tick (forward or backward), so the ranks of
every stage run local layer ``j`` at the same time and one plan per tick pools the CA-tasks of every
data-parallel x pipeline rank (forward with forward, backward with backward). A stage with no
micro-batch in a tick (a pipeline bubble) still runs the tick's attention exchanges: it serves
CA-tasks of the others instead of idling.

With ``P`` stages and ``M`` micro-batches there are ``M + P - 1`` forward slots and as many backward
slots. In forward slot ``f`` stage ``s`` runs micro-batch ``f - s``; in backward slot ``b`` it runs
micro-batch ``b - (P - 1 - s)`` (``None``: a bubble). The ticks are the first ``P - 1`` forward slots
(warm-up), then forward slot ``f`` followed by backward slot ``f - P + 1`` for ``f = P - 1 ..
M + P - 2`` (steady state: the last stage runs a micro-batch's backward right after its forward),
then the last ``P - 1`` backward slots (cool-down): ``2 (M + P - 1)`` ticks in all.

Activations a stage sends in one slot are received by the next stage in the next slot of the same
kind, so every tick's point-to-point receives were sent by the tick before of that kind.

What it costs against torch's ``Schedule1F1B``: the same bubbles in time (they serve attention
instead of idling), and stage ``s`` holds the activations of up to ``2 (P - s) - 1`` micro-batches
(1F1B: ``P - s``), because a micro-batch's backward reaches stage ``s`` only ``2 (P - 1 - s)`` slots
after its forward there.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from ..config import is_integer

__all__ = ["FORWARD", "BACKWARD", "Tick", "lockstep_1f1b_ticks", "forward_slot", "backward_slot",
           "in_flight_micro_batches", "stock_1f1b_order", "PipelineRun", "simulate_1f1b", "simulate_lockstep",
           "check_schedule_sizes"]

FORWARD = "forward"
BACKWARD = "backward"


@dataclass(frozen=True)
class Tick:
    """One tick of the lockstep schedule.

    Attributes:
        kind: ``"forward"`` or ``"backward"``.
        slot: the slot number within its kind (``0 .. M + P - 2``).
        micro_batches: ``[stages]`` the micro-batch each stage runs, or ``None`` for a bubble.
    """

    kind: str
    slot: int
    micro_batches: tuple

    def micro_batch_of(self, stage: int) -> int | None:
        _check_stage(stage, len(self.micro_batches))
        return self.micro_batches[stage]


def check_schedule_sizes(num_stages: int, num_micro_batches: int, *,
                         names: tuple[str, str] = ("num_stages", "num_micro_batches")) -> None:
    """``ValueError`` naming the argument (``names``: the caller's names for them) unless both are
    integers >= 1 (numpy's too) and a step's ticks, ``stages x (micro-batches + stages)`` entries, stay
    within ``MAX_SCHEDULE_ENTRIES``."""
    for name, value in zip(names, (num_stages, num_micro_batches)):
        if not is_integer(value) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if num_stages * (num_micro_batches + num_stages) > MAX_SCHEDULE_ENTRIES:  # (built them for minutes, then ran out)
        raise ValueError(f"{names[0]} x ({names[1]} + {names[0]}) = {num_stages * (num_micro_batches + num_stages)} "
                         f"is more than a schedule of {MAX_SCHEDULE_ENTRIES} (stage, tick) entries; use fewer "
                         f"{names[0]} or {names[1]} ({num_stages} and {num_micro_batches})")


MAX_SCHEDULE_ENTRIES = 2**24
"""The most ``(stage, tick)`` entries a step's schedule may hold (a lockstep step has ``2 (M + P - 1)``
ticks of ``P`` entries): far past any real pipeline, a bound on what the models build."""


def _check_stage(stage: int, num_stages: int) -> None:
    if not is_integer(stage) or not 0 <= stage < num_stages:
        raise ValueError(f"stage must lie in [0, {num_stages}), got {stage!r}")


def _check_micro_batch(micro_batch: int) -> None:
    if not is_integer(micro_batch) or micro_batch < 0:
        raise ValueError(f"micro_batch must be an integer >= 0, got {micro_batch!r}")


def forward_slot(stage: int, micro_batch: int) -> int:
    """The forward slot in which ``stage`` (an integer >= 0) runs ``micro_batch``'s forward."""
    if not is_integer(stage) or stage < 0:
        raise ValueError(f"stage must be an integer >= 0, got {stage!r}")
    _check_micro_batch(micro_batch)
    return int(micro_batch + stage)


def backward_slot(stage: int, micro_batch: int, num_stages: int) -> int:
    """The backward slot in which ``stage`` (of ``num_stages``) runs ``micro_batch``'s backward."""
    check_schedule_sizes(num_stages, 1)
    _check_stage(stage, num_stages)
    _check_micro_batch(micro_batch)
    return int(micro_batch + num_stages - 1 - stage)


def _slot(kind: str, slot: int, num_stages: int, num_micro_batches: int) -> Tick:
    def of(stage: int):
        mb = slot - stage if kind == FORWARD else slot - (num_stages - 1 - stage)
        return mb if 0 <= mb < num_micro_batches else None
    return Tick(kind, slot, tuple(of(s) for s in range(num_stages)))


def lockstep_1f1b_ticks(num_stages: int, num_micro_batches: int) -> list[Tick]:
    """The ``2 (M + P - 1)`` ticks of one step, in execution order (see the module docstring)."""
    check_schedule_sizes(num_stages, num_micro_batches)
    p, m = num_stages, num_micro_batches
    slots = m + p - 1
    ticks = [_slot(FORWARD, f, p, m) for f in range(min(p - 1, slots))]
    for f in range(p - 1, slots):
        ticks.append(_slot(FORWARD, f, p, m))
        ticks.append(_slot(BACKWARD, f - p + 1, p, m))
    ticks.extend(_slot(BACKWARD, b, p, m) for b in range(slots - p + 1, slots))
    return ticks


def in_flight_micro_batches(stage: int, num_stages: int, num_micro_batches: int) -> int:
    """The most micro-batches whose activations ``stage`` holds at once under the lockstep schedule."""
    check_schedule_sizes(num_stages, num_micro_batches)
    _check_stage(stage, num_stages)
    held = most = 0
    for tick in lockstep_1f1b_ticks(num_stages, num_micro_batches):
        if tick.micro_batch_of(stage) is not None:
            held += 1 if tick.kind == FORWARD else -1
            most = max(most, held)
    return most


# --- timing a step: torch's stock 1F1B and the lockstep ticks as event models ------------------------

def stock_1f1b_order(stage: int, num_stages: int, num_micro_batches: int) -> list[tuple[str, int]]:
    """The ``(kind, micro_batch)`` operations ``stage`` runs under torch's ``Schedule1F1B``, in order:
    ``min(M, P - stage)`` forwards (warm-up), then one backward and one forward in turn while forwards
    remain, then the remaining backwards (cool-down). With ``M < P`` the first ``P - M + 1`` stages
    run every forward before their first backward (GPipe-like; torch's ``Schedule1F1B`` itself refuses
    ``M < P``)."""
    check_schedule_sizes(num_stages, num_micro_batches)
    _check_stage(stage, num_stages)
    m = num_micro_batches
    warmup = min(m, num_stages - stage)
    order = [(FORWARD, f) for f in range(warmup)]
    forward, backward = warmup, 0
    while forward < m:
        order += [(BACKWARD, backward), (FORWARD, forward)]
        forward, backward = forward + 1, backward + 1
    order += [(BACKWARD, b) for b in range(backward, m)]
    return order


@dataclass(frozen=True)
class PipelineRun:
    """One timed step of a pipeline.

    Attributes:
        step_s: seconds from the step's start to the end of its last operation.
        busy_s: ``[stages]`` seconds each stage spends running a micro-batch (the rest of ``step_s``
            is its bubble: idle under 1F1B, serving CA-tasks of the others under the lockstep).
    """

    step_s: float
    busy_s: tuple

    @property
    def bubble_fraction(self) -> float:
        """The share of the stages' time spent without a micro-batch."""
        total = len(self.busy_s) * self.step_s
        return max(0.0, 1.0 - sum(self.busy_s) / total) if total > 0 else 0.0  # (no rounding below 0)


def _seconds(value, name: str, what: str) -> np.ndarray:
    """``value`` as a float64 array of seconds, refused naming ``name`` (``what``: its shape in words)
    unless it holds real numbers: ragged lists, strings, bools and complex numbers failed inside numpy,
    or were read as seconds."""
    if hasattr(value, "__next__"):  # a generator: its values
        value = list(value)
    try:
        given = np.asarray(value)
    except (TypeError, ValueError):
        given = np.asarray(None)
    if given.dtype.kind not in "iuf":
        raise ValueError(f"{name} must be {what} of seconds (real numbers), got {value!r}")
    return given.astype(np.float64)


def _durations(forward_s, backward_s):
    forward_s = _seconds(forward_s, "forward_s", "a [stages, micro_batches] array")
    backward_s = _seconds(backward_s, "backward_s", "a [stages, micro_batches] array")
    if forward_s.ndim != 2 or forward_s.shape != backward_s.shape or 0 in forward_s.shape:
        raise ValueError(f"forward_s and backward_s must both be [stages, micro_batches] arrays, got shapes "
                         f"{forward_s.shape} and {backward_s.shape}")
    if not (np.isfinite(forward_s).all() and np.isfinite(backward_s).all()) or (forward_s < 0).any() \
            or (backward_s < 0).any():
        raise ValueError("forward_s and backward_s must hold finite seconds >= 0")
    return forward_s, backward_s


def _check_p2p(p2p_s: float) -> None:
    if not (isinstance(p2p_s, numbers.Real) and not isinstance(p2p_s, bool) and math.isfinite(p2p_s) and p2p_s >= 0):
        raise ValueError(f"p2p_s must be finite seconds >= 0 (one micro-batch's activations between stages), "
                         f"got {p2p_s!r}")


def simulate_1f1b(forward_s, backward_s, *, p2p_s: float = 0.0) -> PipelineRun:
    """The step of one pipeline under torch's ``Schedule1F1B`` (``stock_1f1b_order``), as an event model.

    ``forward_s`` / ``backward_s``: ``[stages, micro_batches]`` seconds of each stage's forward /
    backward of each micro-batch. An operation starts when the stage's previous operation has ended
    and its input has arrived: a forward needs the previous stage's forward of that micro-batch, a
    backward the next stage's backward (the last stage's, its own forward), each arriving ``p2p_s``
    after the sender's operation ended (the transfer overlaps whatever the stages compute meanwhile).
    With equal operations and no transfer time the step is ``(M + P - 1) (F + B)``."""
    forward_s, backward_s = _durations(forward_s, backward_s)
    _check_p2p(p2p_s)
    p, m = forward_s.shape
    orders = [stock_1f1b_order(s, p, m) for s in range(p)]
    ends = {}  # (kind, stage, micro_batch) -> end time
    next_op, free = [0] * p, [0.0] * p
    remaining = 2 * p * m
    while remaining:
        progressed = False
        for s in range(p):
            while next_op[s] < len(orders[s]):
                kind, mb = orders[s][next_op[s]]
                if kind == FORWARD:  # the previous stage's activations (the first stage: the batch)
                    dep, latency = ((FORWARD, s - 1, mb), p2p_s) if s > 0 else (None, 0.0)
                    took = forward_s[s, mb]
                else:  # the next stage's gradients (the last stage: its own forward's loss)
                    dep, latency = ((BACKWARD, s + 1, mb), p2p_s) if s < p - 1 else ((FORWARD, s, mb), 0.0)
                    took = backward_s[s, mb]
                if dep is not None and dep not in ends:
                    break  # its input is not computed yet: another stage goes first
                start = max(free[s], ends[dep] + latency if dep is not None else 0.0)
                free[s] = ends[(kind, s, mb)] = start + float(took)
                next_op[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # cannot happen with stock_1f1b_order; a guard against an endless loop
            raise RuntimeError("1F1B event model made no progress (dependency cycle)")
    busy = tuple(float(forward_s[s].sum() + backward_s[s].sum()) for s in range(p))
    return PipelineRun(max(free), busy)


def simulate_lockstep(tick_s, *, num_stages: int, num_micro_batches: int, p2p_s: float = 0.0) -> PipelineRun:
    """The step of the lockstep schedule (``lockstep_1f1b_ticks``): ``tick_s[k]`` seconds of tick ``k``,
    which every stage runs together (its attention exchanges meet every rank). A tick starts when
    the previous tick has ended and, when some stage receives activations (or gradients) in it, when
    those have arrived: ``p2p_s`` after the end of the previous tick of the same kind, which sent
    them. In the steady state the tick of the other kind between them hides the transfer; in the
    warm-up and cool-down (ticks of one kind in a row) it does not. A stage's busy time is the ticks in
    which it runs a micro-batch; in the others it serves CA-tasks."""
    _check_p2p(p2p_s)
    ticks = lockstep_1f1b_ticks(num_stages, num_micro_batches)
    tick_s = _seconds(tick_s, "tick_s", "a list (one per tick)")
    if tick_s.ndim != 1 or len(tick_s) != len(ticks):
        raise ValueError(f"tick_s must hold one duration per tick ({len(ticks)} for {num_stages} stages and "
                         f"{num_micro_batches} micro-batches), got shape {tick_s.shape}")
    end, last_end = 0.0, {FORWARD: None, BACKWARD: None}
    busy = [0.0] * num_stages
    for tick, seconds in zip(ticks, tick_s):
        seconds = float(seconds)
        if not seconds >= 0 or seconds == float("inf"):
            raise ValueError(f"tick_s must hold finite seconds >= 0, got {seconds!r}")
        # a stage receives when its neighbour upstream (forward) / downstream (backward) ran this
        # micro-batch in the previous tick of this kind
        step = 1 if tick.kind == FORWARD else -1
        receives = any(mb is not None and 0 <= s - step < num_stages for s, mb in enumerate(tick.micro_batches))
        start = end
        if receives and last_end[tick.kind] is not None:
            start = max(start, last_end[tick.kind] + p2p_s)
        end = start + seconds
        last_end[tick.kind] = end
        for s, mb in enumerate(tick.micro_batches):
            if mb is not None:
                busy[s] += seconds
    return PipelineRun(end, tuple(busy))
