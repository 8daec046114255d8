"""Processes: how many the launcher asked for, against how many run.

``accelerate launch --cpu --num_processes 2`` (or a config with ``use_cpu: true`` /
``distributed_type: MULTI_CPU``) starts ONE process whatever it says. ``launched_world_size`` reads
what the launch asked for (``WORLD_SIZE``, or the parent ``accelerate launch`` command line and its
config file), so ``DistCATrainer`` / ``DistCAAccelerator`` can stop (``training.launch_checks``) and
the attention function can warn a plain ``Trainer``'s user (``warn_if_launched_alone``), as it does
when the job's FSDP request was dropped on CPU processes (``warn_if_fsdp_dropped``), and stop one
whose processes run torch.distributed but each set Accelerate up alone (``refuse_accelerate_alone``:
``use_cpu=True`` missing on CPU).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import LaunchError
from ..state import STATE, warn_once

__all__ = ["FIX", "launched_world_size", "parent_command", "find_flag", "warn_if_launched_alone",
           "warn_if_fsdp_dropped", "refuse_accelerate_alone"]

FIX = ("To start N CPU processes use `accelerate launch --config_file recipes/cpu-2proc.yaml SCRIPT` (a "
       "multi-process config, distributed_type: MULTI_GPU, num_processes: N; distca_hf switches the processes to "
       "CPU and gloo when there is no GPU) or `torchrun --nproc-per-node N SCRIPT`.")


def launched_world_size() -> tuple[int | None, str]:
    """How many processes the launch asked for, and where that came from.

    ``WORLD_SIZE`` (set by ``torchrun`` and Accelerate's multi-process launchers) when present;
    otherwise, if the parent process is ``accelerate launch`` (its single-process launcher sets no
    ``WORLD_SIZE``), its ``--num_processes`` or the ``num_processes`` of its config file (read from
    ``/proc`` on Linux). ``(None, reason)`` when unknown."""
    world = os.environ.get("WORLD_SIZE")
    if world and world.isdigit():
        return int(world), "WORLD_SIZE"
    argv, cwd = parent_command()
    if argv is None or not _is_accelerate_launch(argv):
        return None, "no launcher information"
    value = _flag(argv, "num_processes")
    if value is not None:
        try:
            return int(value), f"accelerate launch --num_processes {value}"
        except ValueError:
            return None, f"unreadable --num_processes {value!r}"
    config_file = _flag(argv, "config_file")
    if config_file is None:
        try:
            from accelerate.commands.config import default_config_file
        except ImportError:
            return None, "no accelerate config"
        config_file = default_config_file
    path = Path(config_file)
    if not path.is_absolute() and cwd is not None:
        path = Path(cwd) / path
    try:
        import yaml

        with open(path, encoding="utf-8") as f:
            document = yaml.safe_load(f) or {}
        return int(document["num_processes"]), f"num_processes in {config_file}"
    except (OSError, KeyError, TypeError, ValueError):
        return None, f"no num_processes in {config_file}"


def warn_if_launched_alone() -> None:
    """Warn (once per process) when this process runs alone but its launch asked for several: the
    CPU launch trap, met by a plain ``Trainer``, which has no launch check of its own."""
    if "launch-checked" in STATE.warned:
        return
    STATE.warned.add("launch-checked")  # the parent's command line is read once per process
    asked, source = launched_world_size()
    if asked is not None and asked > 1:
        warn_once("launched-alone", f"distca: the launch asked for {asked} processes ({source}) but this process runs "
                  f"alone (torch.distributed is not initialised), so nothing is balanced across ranks. {FIX}",
                  stacklevel=5)


def refuse_accelerate_alone(world: int) -> None:
    """Raise ``LaunchError`` (checked once per process) when torch.distributed runs ``world`` > 1
    processes but Accelerate set itself up for one: the CPU launch trap of a plain ``Trainer`` (or
    TRL's) without ``use_cpu=True``. Each process then trains alone on the same examples (every one
    is rank 0 to the Trainer, nothing averages the gradients, each saves the same checkpoint files)
    while the attention still pools the ranks' documents, so nothing fails on its own. Every rank
    meets it in the same forward, before the first collective of the step."""
    if "accelerate-checked" in STATE.warned:
        return
    import sys

    accelerate_state = sys.modules.get("accelerate.state")
    shared = getattr(getattr(accelerate_state, "PartialState", None), "_shared_state", None) or {}
    if not shared:  # Accelerate not set up (yet: a forward before the Trainer is made): look again next time
        return
    STATE.warned.add("accelerate-checked")
    if world > 1 and shared.get("num_processes") == 1:
        raise LaunchError(
            f"distca: torch.distributed runs {world} processes but Accelerate (and so the Trainer) set itself up "
            "for one process: on a machine without GPU a multi-process launch needs TrainingArguments(use_cpu=True) "
            "(SFTConfig(use_cpu=True) with TRL) or ACCELERATE_USE_CPU=1 in the environment; without it every process "
            "trains alone on the same examples, no gradient is averaged and each saves as rank 0. DistCATrainer and "
            "DistCASFTTrainer set it themselves.")


def warn_if_fsdp_dropped(module) -> None:
    """Warn (once per process) when the job asked for FSDP but ``module`` (an attention layer) holds
    whole parameters: Accelerate drops an FSDP request on CPU processes and wraps the model in DDP,
    which a plain ``Trainer`` does not say (``DistCATrainer`` / ``DistCAAccelerator`` shard instead)."""
    if "fsdp-checked" in STATE.warned:
        return
    STATE.warned.add("fsdp-checked")
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return
    parameter = next(module.parameters(), None)
    if parameter is None or type(parameter).__name__ == "DTensor":
        return  # sharded (FSDP2), or nothing to shard here
    import sys

    accelerate_state = sys.modules.get("accelerate.state")  # FSDP1 on GPUs keeps plain parameters (views)
    if accelerate_state is not None and str(accelerate_state.AcceleratorState._shared_state.get(
            "distributed_type", "")).endswith("FSDP"):
        return
    warn_once("fsdp-dropped", "distca: this job asked for FSDP (ACCELERATE_USE_FSDP=true: distributed_type: FSDP in "
              "the accelerate config, an Accelerator given a FullyShardedDataParallelPlugin, or TrainingArguments("
              "fsdp=...)) but the model's parameters are not sharded: on CPU processes Accelerate drops FSDP and "
              "trains with DDP, every rank holding the whole model. Call distca_hf.apply_cpu_fsdp(trainer) after "
              "creating the Trainer and before trainer.train() (DistCATrainer and DistCAAccelerator do it themselves), "
              "with fsdp_version: 2 (FSDP1 cannot shard on CPU).", stacklevel=5)


def parent_command() -> tuple[list[str] | None, str | None]:
    """The parent process's command line and working directory (Linux ``/proc``), or ``(None, None)``."""
    ppid = os.getppid()
    try:
        raw = Path(f"/proc/{ppid}/cmdline").read_bytes()
    except OSError:
        return None, None
    argv = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
    try:
        cwd = os.readlink(f"/proc/{ppid}/cwd")
    except OSError:
        cwd = None
    return argv, cwd


def _is_accelerate_launch(argv: list[str]) -> bool:
    for i, arg in enumerate(argv[:-1]):
        name = os.path.basename(arg)
        if name in ("accelerate", "accelerate-launch") and argv[i + 1] == "launch":
            return True
        if name == "accelerate-launch" or arg in ("accelerate.commands.launch",):
            return True
    return False


def _flag(argv: list[str], name: str) -> str | None:
    """Value of ``--name X`` / ``--name=X`` among a launcher's arguments (``argv[0]`` is the program)."""
    found = find_flag(argv, name, first=1)
    return None if found is None else found[1]


def find_flag(argv: list[str], name: str, first: int = 0) -> tuple[int, str] | None:
    """``(index, value)`` of ``--name X`` / ``--name=X`` (underscores or hyphens) among a launcher's
    own arguments, which end at the script (the first ``*.py`` from ``argv[first]`` on); ``None`` when
    absent. ``index`` is that of the flag."""
    spellings = {f"--{name}", f"--{name.replace('_', '-')}"}
    for i, arg in enumerate(argv):
        if arg.endswith(".py") and i >= first:
            break  # the script's own arguments follow
        if arg in spellings and i + 1 < len(argv):
            return i, argv[i + 1]
        key, sep, value = arg.partition("=")
        if sep and key in spellings:
            return i, value
    return None
