"""Training: everything between a dataset and ``trainer.train()``.

    plugin         DistCAPlugin: the job's distca settings (code > DISTCA_* > YAML) and process groups
    topology       data x pipeline x tensor topology, attention-server groups (pure)
    packing        documents -> one packed row per rank and forward; the collator
    loading        files, folders, Hub names -> token-id documents
    launch_checks  launched vs running processes, the CPU launch traps
    accelerator    DistCAAccelerator and the model checks every entry point runs
    trainer        DistCATrainer and its step table

The trainer and the accelerator import transformers' and accelerate's heavier modules, so they are
loaded on first use.
"""

from importlib import import_module

from .loading import load_documents
from .packing import PackedCollator, PackedDataset, PackingConfig, PackingReport, StreamingPackedDataset, pack_lengths
from .plugin import DistCAGroups, DistCAPlugin, read_distca_section
from .topology import ParallelTopology, group_ranks

_LAZY = {"DistCATrainer": "trainer", "StepTableCallback": "trainer", "DistCAAccelerator": "accelerator",
         "prepare_training_arguments": "accelerator", "require_distca_model": "accelerator",
         "prepare_cpu_launch": "launch_checks"}

__all__ = ["DistCAGroups", "DistCAPlugin", "PackedCollator", "PackedDataset", "PackingConfig", "PackingReport",
           "ParallelTopology", "StreamingPackedDataset", "group_ranks", "load_documents", "pack_lengths",
           "read_distca_section", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
