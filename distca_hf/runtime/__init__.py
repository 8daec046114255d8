"""Runtime: what runs under ``torch.distributed``, once per forward and in every attention layer.

    comm           collectives with distca's timeout (uneven all-to-all, all-gathers)
    agree          the collective that opens a forward: every rank takes the same decision
    shared_planning  ``tolerance="auto"``'s candidates planned on different ranks, one plan kept on all
    forward        opening a forward: documents -> agreement -> plan -> dispatch (decoding: local)
    context        the per-forward context every layer reuses, ``PlanStats``, ``plan_stats()``
    tables         one wave's index tables (which rows go where)
    exchange       packing rows into one buffer per all-to-all, and unpacking them
    phases         the forward and backward phases of a wave (launch, serve, return, place)
    dispatch       a plan as this rank's list of waves
    issue_queue    when a dispatch's exchanges are issued, so that relay rounds queue behind nothing
    wave_schedule  overlap ``none`` / ``wave``: all waves in one autograd node
    pingpong       overlap ``pingpong``: two nano-batches, three autograd nodes each
    pipeline_schedules  pipeline schedules on torch.distributed.pipelining: torch's gpipe / 1f1b, and the
                   lockstep cad_1f1b whose ticks pool CA-tasks over every data-parallel x pipeline rank
    timeline       per-rank compute / communication intervals and the overlap fraction
    processes      how many processes the launch asked for, against how many run
    shutdown       the exit hook that closes the process groups before the interpreter shuts down
"""

from .agree import DistCAPeerError, attention_dtype
from .comm import DistCATimeoutError
from .context import ForwardContext, PlanStats, pinned_forward, plan_stats
from .forward import begin_decoding, context_for_call, decoding, end_decoding, is_decoding, layer_window
from .wave_schedule import dispatched_attention

__all__ = ["DistCAPeerError", "DistCATimeoutError", "ForwardContext", "PlanStats", "attention_dtype", "begin_decoding",
           "context_for_call", "decoding", "dispatched_attention", "end_decoding", "is_decoding", "layer_window",
           "pinned_forward", "plan_stats"]
