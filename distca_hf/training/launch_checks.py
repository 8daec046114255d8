"""What the launcher asked for against what actually runs, and the two CPU launch traps.

Two facts about Accelerate (1.x) on machines without a GPU, handled here so users never meet them:

- Under a multi-process launcher (``torchrun``, or ``accelerate launch`` with
  ``distributed_type: MULTI_GPU``) each process without CUDA sets itself up *alone*
  (``num_processes == 1``) unless ``ACCELERATE_USE_CPU`` is set. ``prepare_cpu_launch`` sets it.
- With DeepSpeed, the CPU processes must create their process group with the ``gloo`` backend
  (``InitProcessGroupKwargs(backend="gloo")`` or ``TrainingArguments(ddp_backend="gloo")``), or
  Accelerate again counts one process; ``ACCELERATE_USE_CPU`` would switch DeepSpeed off instead.

And one that cannot be repaired from inside the process: ``accelerate launch --cpu
--num_processes 2`` (or a config with ``use_cpu: true`` / ``distributed_type: MULTI_CPU``) starts
ONE process. ``launched_world_size`` finds out how many processes the launch asked for, so
``check_world_size`` can stop with an explanation instead of training on one process.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import LaunchError

__all__ = ["LaunchError", "launched_world_size", "prepare_cpu_launch", "check_world_size", "uses_deepspeed",
           "has_gpu", "find_flag"]

FIX = ("To start N CPU processes use `accelerate launch --config_file recipes/cpu-2proc.yaml SCRIPT` (a "
       "multi-process config, distributed_type: MULTI_GPU, num_processes: N; distca_hf switches the processes to "
       "CPU and gloo when there is no GPU) or `torchrun --nproc-per-node N SCRIPT`.")


def has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def uses_deepspeed(training_args=None) -> bool:
    """DeepSpeed is requested by the launcher (``accelerate launch`` with a DeepSpeed config) or by
    ``TrainingArguments(deepspeed=...)``."""
    if training_args is not None and getattr(training_args, "deepspeed", None):
        return True
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


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


def launched_world_size() -> tuple[int | None, str]:
    """How many processes the launch asked for, and where that came from.

    ``WORLD_SIZE`` (set by ``torchrun`` and Accelerate's multi-process launchers) when present;
    otherwise, if the parent process is ``accelerate launch`` (its single-process launcher sets no
    ``WORLD_SIZE``), its ``--num_processes`` or the ``num_processes`` of its config file (read from
    ``/proc`` on Linux). ``(None, reason)`` when unknown."""
    world = os.environ.get("WORLD_SIZE")
    if world and world.isdigit():
        return int(world), "WORLD_SIZE"
    argv, cwd = _parent_command()
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


def _parent_command() -> tuple[list[str] | None, str | None]:
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
