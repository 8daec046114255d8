"""Training: everything between a dataset and ``trainer.train()``.

    plugin         DistCAPlugin: the job's distca settings (code > DISTCA_* > YAML) and process groups
    topology       data x pipeline x tensor topology, attention-server groups (pure)
    packing        documents -> one packed row per rank and forward (global batches shared by a server
                   group's ranks when documents span ranks), the sampler that keeps them together,
                   the collator
    loading        files, folders, Hub names -> token-id documents
    launch_checks  launched vs running processes, the CPU launch traps
    accelerator    DistCAAccelerator and the model checks every entry point runs
    trainer        DistCATrainer and its step table

The trainer and the accelerator import transformers' and accelerate's heavier modules, so they are
loaded on first use.
"""

from importlib import import_module

from .loading import load_documents
from .packing import (GlobalBatchSampler, PackedCollator, PackedDataset, PackedRow, PackingConfig, PackingReport,
                      RankLayout, StreamingPackedDataset, pack_lengths, pack_rows)
from .plugin import DistCAGroups, DistCAPlugin, read_distca_section
from .topology import ParallelTopology, group_ranks

_LAZY = {"DistCATrainer": "trainer", "StepTableCallback": "trainer", "DistCAAccelerator": "accelerator",
         "prepare_training_arguments": "accelerator", "require_distca_model": "accelerator",
         "prepare_cpu_launch": "launch_checks"}

__all__ = ["DistCAGroups", "DistCAPlugin", "GlobalBatchSampler", "PackedCollator", "PackedDataset", "PackedRow",
           "PackingConfig", "PackingReport", "ParallelTopology", "RankLayout", "StreamingPackedDataset", "group_ranks",
           "load_documents", "pack_lengths", "pack_rows", "read_distca_section", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
