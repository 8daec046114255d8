"""The ``distca-hf`` command.

    distca-hf env            versions, device and usable kernel backends (paste it into bug reports)
    distca-hf kernel-bench   exact CPU attention paths side by side (see kernel_bench.py)
    distca-hf simulate       distca against colocated, WLB-LLM, per-document CP and Ulysses on N ranks,
                             one time model with communication (see simulate.py)
    distca-hf profile        measure the time model's constants on this device (see profiling.py)
    distca-hf bench          multi-process step time, colocated against distca (see bench/); with
                             --pipeline-parallel P, pipeline stages (see bench/pipeline.py)
    distca-hf launch         accelerate launch with a distca: section in the config (see launch.py)

``python -m distca_hf ...`` runs the same command (e.g. under ``torchrun``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import sys

PACKAGES = ("torch", "transformers", "accelerate", "deepspeed", "flash-attn", "datasets", "numpy")


def help_description(doc: str) -> str:
    """A script's ``--help`` description: the first paragraph of its docstring ``doc``, as one line (its
    first line alone stopped mid-sentence)."""
    return " ".join((doc or "").strip().split("\n\n")[0].split())


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment() -> dict:
    """What ``distca-hf env`` reports, as a dict."""
    import torch
    import torch.distributed as dist

    from .. import __version__
    from ..kernels import available_backends, select_backend, unavailable_reasons

    info = {
        "distca_hf": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        **{p: _version(p) for p in PACKAGES},
        # the build too (2.13.0+cpu, 2.15.0+cu132): a wheel's metadata may leave the local label out
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "cuda_available": torch.cuda.is_available(),
        "distributed_backends": [b for b in ("gloo", "nccl", "mpi") if getattr(dist, f"is_{b}_available")()],
    }
    devices = ["cpu"]
    if torch.cuda.is_available():
        info["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["cuda_version"] = torch.version.cuda
        devices.append("cuda")
    info["kernel_backends"] = {
        f"{device}/{str(dtype).removeprefix('torch.')}": {
            "usable": available_backends(device, dtype),
            "auto": select_backend(device, dtype).NAME,
            # backends meant for this device and dtype that cannot run here, and why
            "unavailable": unavailable_reasons(device, dtype),
        }
        for device in devices
        for dtype in (torch.float32, torch.bfloat16, torch.float16)
    }
    return info


def _print_env(args) -> int:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the math-fallback warning is reported in the table instead
        info = environment()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print("distca_hf environment (paste this into bug reports)\n")
    for key, value in info.items():
        if key == "kernel_backends":
            print("- kernel backends (auto choice first):")
            for where, choice in value.items():
                print(f"    {where}: {choice['auto']}  (usable: {', '.join(choice['usable'])})")
                for name, why in choice["unavailable"].items():
                    print(f"      {name} unavailable: {why}")
        else:
            print(f"- {key}: {value}")
    return 0


# Subcommands with their own parser: name -> (module, one-line help). Imported only when used.
SUBCOMMANDS = {
    "kernel-bench": ("distca_hf.tools.kernel_bench", "time the attention kernels: CPU paths side by side, or CA-task "
                     "efficiency on CUDA"),
    "simulate": ("distca_hf.tools.simulate", "what CAD gains on N ranks against the best baseline "
                 "(colocated, WLB-LLM, per-document CP, Ulysses), communication included"),
    "profile": ("distca_hf.tools.profiling", "measure time-model constants on this device"),
    "bench": ("distca_hf.tools.bench", "multi-process step time: colocated against distca (--pipeline-parallel P: "
              "stock 1F1B against CAD per stage and across stages)"),
    "launch": ("distca_hf.tools.launch", "accelerate launch with a config file that has a distca: section"),
}


PASS_THROUGH = ("launch",)
"""Subcommands without a parser of their own: ``launch`` hands its arguments to ``accelerate launch``
and prints its module docstring for ``--help``."""


def _build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """``(distca-hf's parser, the env subcommand's)``; the other subcommands parse their own arguments."""
    parser = argparse.ArgumentParser(prog="distca-hf", description="Core Attention Disaggregation for HF transformers")
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="versions, device and usable kernel backends",
                         description="versions, device and usable kernel backends (paste it into bug reports)")
    env.add_argument("--json", action="store_true", help="print as JSON")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser, env


def parsers() -> dict[str, argparse.ArgumentParser]:
    """Every argument parser of the command, by name (``distca-hf``, ``env`` and each subcommand with
    its own, from its module's ``build_parser()``; not ``PASS_THROUGH``). Imports every subcommand."""
    import importlib

    parser, env = _build_parser()
    found = {"distca-hf": parser, "env": env}
    for name, (module, _) in SUBCOMMANDS.items():
        if name not in PASS_THROUGH:
            found[name] = importlib.import_module(module).build_parser()
    return found


SETTINGS_FREE = ("simulate",)
"""Subcommands that read no distca setting from the environment (``simulate`` takes its own flags), so
a bad ``DISTCA_*`` variable does not stop them."""


def main(argv=None) -> int:
    parser, _ = _build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command not in SETTINGS_FREE and not {"-h", "--help"} & set(rest):
        from ..config import current_config

        try:  # a bad DISTCA_* variable, named in one line before any process starts (a traceback before)
            current_config()
        except ValueError as e:
            parser.error(str(e))
    if args.command in SUBCOMMANDS:
        import importlib

        return importlib.import_module(SUBCOMMANDS[args.command][0]).main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return _print_env(args)


if __name__ == "__main__":
    sys.exit(main())
