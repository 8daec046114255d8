"""distca_hf: Core Attention Disaggregation (CAD) for the HuggingFace stack.

Importing the package registers ``attn_implementation="distca"`` with transformers::

    import distca_hf
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="distca")

The subpackages follow the data path: ``planning`` (pure: documents, cost, tasks, planner,
transfers, splits) -> ``runtime`` (torch.distributed: the per-forward context, dispatch, overlap
schedules, timeline) -> ``kernels`` -> ``hf`` (the attention and mask functions) -> ``training``
(plugin, packing, trainer) and ``tools`` (the ``distca-hf`` command). Settings live in ``config``,
process-wide state in ``state``, the exceptions in ``errors``.

Importing is cheap (no torch, no transformers): the public names below are loaded on first use, and
the registration runs the moment transformers imports its attention interface (``_after_import``),
before any model can ask for an implementation.
"""

__version__ = "0.2.0"

from importlib import import_module

from . import _after_import, _moved
from .config import DistCAConfig, configure, configured, current_config, reset_config
from .errors import (DistCAPeerError, DistCATimeoutError, DocumentBoundaryError, LaunchError,
                     UnsupportedAttentionError)

# The other public names, by the module that defines them; loaded on first use (they import torch).
_LAZY_EXPORTS = {
    "hf": ("ATTN_IMPLEMENTATION", "distca_attention_forward", "register"),
    "kernels": ("varlen_causal_attention",),
    "planning": ("CATask", "PackedDocuments", "find_documents", "fuse_tasks", "split_document",
                 "whole_document_tasks"),
    "runtime": ("plan_stats",),
    "training": ("DistCAPlugin", "PackedCollator", "PackedDataset", "PackingConfig", "ParallelTopology",
                 "StreamingPackedDataset", "load_documents", "DistCATrainer", "DistCASFTTrainer", "StepTableCallback",
                 "DistCAAccelerator", "prepare_training_arguments", "apply_cpu_fsdp", "parallelism_config_for_cpu"),
}
_HOME = {name: module for module, names in _LAZY_EXPORTS.items() for name in names}
_SUBPACKAGES = ("planning", "runtime", "kernels", "hf", "training", "tools", "patches", "state")

_moved.install()  # old module paths (distca_hf.planner, distca_hf.trainer, ...) for one release
# "distca" in transformers' attention and mask interfaces, and the ping-pong decoder stacks of the
# Llama family (active only with overlap="pingpong"), as soon as transformers imports those modules.
_after_import.install()

__all__ = sorted([
    "DistCAConfig", "DistCAPeerError", "DistCATimeoutError", "DocumentBoundaryError", "LaunchError",
    "UnsupportedAttentionError", "configure", "configured", "current_config", "reset_config", *_HOME,
])


def __getattr__(name):
    if name in _HOME:
        return getattr(import_module(f".{_HOME[name]}", __name__), name)
    if name in _SUBPACKAGES:
        return import_module(f".{name}", __name__)
    old = f"{__name__}.{name}"
    if old in _moved.MOVED:  # distca_hf.trainer etc. as attributes: import through the alias
        return import_module(old)
    raise AttributeError(f"module 'distca_hf' has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *__all__, *_SUBPACKAGES})
