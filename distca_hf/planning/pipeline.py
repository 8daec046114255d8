"""The lockstep 1F1B schedule of ``pipeline_schedule="cad_1f1b"`` as a table of ticks. Pure Python.

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

from dataclasses import dataclass

__all__ = ["FORWARD", "BACKWARD", "Tick", "lockstep_1f1b_ticks", "forward_slot", "backward_slot",
           "in_flight_micro_batches"]

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
        return self.micro_batches[stage]


def _check(num_stages: int, num_micro_batches: int) -> None:
    for name, value in (("num_stages", num_stages), ("num_micro_batches", num_micro_batches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def forward_slot(stage: int, micro_batch: int) -> int:
    """The forward slot in which ``stage`` runs ``micro_batch``'s forward."""
    return micro_batch + stage


def backward_slot(stage: int, micro_batch: int, num_stages: int) -> int:
    """The backward slot in which ``stage`` runs ``micro_batch``'s backward."""
    return micro_batch + num_stages - 1 - stage


def _slot(kind: str, slot: int, num_stages: int, num_micro_batches: int) -> Tick:
    def of(stage: int):
        mb = slot - stage if kind == FORWARD else slot - (num_stages - 1 - stage)
        return mb if 0 <= mb < num_micro_batches else None
    return Tick(kind, slot, tuple(of(s) for s in range(num_stages)))


def lockstep_1f1b_ticks(num_stages: int, num_micro_batches: int) -> list[Tick]:
    """The ``2 (M + P - 1)`` ticks of one step, in execution order (see the module docstring)."""
    _check(num_stages, num_micro_batches)
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
    _check(num_stages, num_micro_batches)
    held = most = 0
    for tick in lockstep_1f1b_ticks(num_stages, num_micro_batches):
        if tick.micro_batch_of(stage) is not None:
            held += 1 if tick.kind == FORWARD else -1
            most = max(most, held)
    return most
