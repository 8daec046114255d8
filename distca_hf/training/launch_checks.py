"""What the launcher asked for against what actually runs, and the two CPU launch traps.

Two facts about Accelerate (1.x) on machines without a GPU, handled here so users never meet them:

- Under a multi-process launcher (``torchrun``, or ``accelerate launch`` with
  ``distributed_type: MULTI_GPU``) each process without CUDA sets itself up *alone*
  (``num_processes == 1``) unless ``ACCELERATE_USE_CPU`` is set. ``prepare_cpu_launch`` sets it.
- With DeepSpeed, the CPU processes must create their process group with the ``gloo`` backend
  (``InitProcessGroupKwargs(backend="gloo")`` or ``TrainingArguments(ddp_backend="gloo")``), or
  Accelerate again counts one process; ``ACCELERATE_USE_CPU`` would switch DeepSpeed off instead.
- With FSDP (``uses_fsdp``), the CPU processes (``MULTI_CPU``) drop the request without a word and
  wrap the model in DDP: Accelerate turns on FSDP only for GPU-like devices.
  ``accelerator.apply_cpu_fsdp`` puts it back (torch's ``fully_shard`` runs on gloo).

And one that cannot be repaired from inside the process: ``accelerate launch --cpu
--num_processes 2`` (or a config with ``use_cpu: true`` / ``distributed_type: MULTI_CPU``) starts
ONE process. ``runtime.processes.launched_world_size`` finds out how many processes the launch asked
for, so ``check_world_size`` can stop with an explanation instead of training on one process (and the
attention function warns when a plain ``Trainer`` meets the trap).
"""

from __future__ import annotations

import os

from ..errors import LaunchError
from ..runtime.processes import FIX, find_flag, launched_world_size

__all__ = ["LaunchError", "launched_world_size", "prepare_cpu_launch", "check_world_size", "uses_deepspeed",
           "uses_fsdp", "has_gpu", "find_flag"]

def has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def uses_deepspeed(training_args=None) -> bool:
    """DeepSpeed is requested by the launcher (``accelerate launch`` with a DeepSpeed config) or by
    ``TrainingArguments(deepspeed=...)``."""
    if training_args is not None and getattr(training_args, "deepspeed", None):
        return True
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def uses_fsdp(training_args=None) -> bool:
    """FSDP is requested by the launcher (``accelerate launch`` with ``distributed_type: FSDP``, or an
    ``Accelerator`` given a ``FullyShardedDataParallelPlugin``: both set ``ACCELERATE_USE_FSDP``) or by
    ``TrainingArguments(fsdp=...)``."""
    if training_args is not None and getattr(training_args, "fsdp", None):
        return True
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def prepare_cpu_launch(deepspeed: bool | None = None) -> dict:
    """Make a multi-process launch on a machine without GPU really run multi-process.

    Without DeepSpeed, sets ``ACCELERATE_USE_CPU=1`` (unless already set); with DeepSpeed, returns
    ``{"backend": "gloo"}``: the process-group backend the caller must pass to Accelerate. Returns
    ``{}`` when nothing is needed (one process, or GPUs)."""
    world = os.environ.get("WORLD_SIZE")
    if not world or not world.isdigit() or int(world) <= 1 or has_gpu():
        return {}
    if uses_deepspeed() if deepspeed is None else deepspeed:
        return {"backend": "gloo"}
    os.environ.setdefault("ACCELERATE_USE_CPU", "1")
    return {}


def check_world_size(actual: int) -> None:
    """Raise ``LaunchError`` when fewer processes run than the launch asked for."""
    asked, source = launched_world_size()
    if asked is None or asked == actual:
        return
    if asked > 1 and actual == 1:
        raise LaunchError(
            f"the launch asked for {asked} processes ({source}) but this process runs alone (world size 1). "
            "`accelerate launch --cpu`, or a config with use_cpu: true or distributed_type: MULTI_CPU/NO, starts a "
            f"single process whatever num_processes says. {FIX}"
        )
    raise LaunchError(f"the launch asked for {asked} processes ({source}) but the process group has {actual}; "
                      f"check the launcher's --num_processes / --nnodes and the script's process-group set-up. {FIX}")
