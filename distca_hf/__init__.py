"""distca_hf: Core Attention Disaggregation (CAD) for the HuggingFace stack.

Importing the package registers ``attn_implementation="distca"`` with transformers::

    import distca_hf
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="distca")

The subpackages follow the data path: ``planning`` (pure: documents, cost, tasks, planner,
transfers, splits) -> ``runtime`` (torch.distributed: the per-forward context, dispatch, overlap
schedules, timeline) -> ``kernels`` -> ``hf`` (the attention and mask functions) -> ``training``
(plugin, packing, trainer) and ``tools`` (the ``distca-hf`` command). Settings live in ``config``,
process-wide state in ``state``, the exceptions in ``errors``.
"""

__version__ = "0.2.0"

from .config import DistCAConfig, configure, current_config, reset_config
from .errors import (DistCAPeerError, DistCATimeoutError, DocumentBoundaryError, LaunchError,
                     UnsupportedAttentionError)
from .hf import ATTN_IMPLEMENTATION, distca_attention_forward, register
from .kernels import varlen_causal_attention
from .planning import CATask, PackedDocuments, find_documents, fuse_tasks, split_document, whole_document_tasks
from .runtime import plan_stats
from .training import (DistCAPlugin, PackedCollator, PackedDataset, PackingConfig, ParallelTopology,
                       StreamingPackedDataset, load_documents)

register()

from . import _moved  # noqa: E402
from . import patches  # noqa: E402  (after registration: the patches check the implementation name)

_moved.install()  # old module paths (distca_hf.planner, distca_hf.trainer, ...) for one release
patches.install()  # ping-pong decoder stacks for the Llama family (active only with overlap="pingpong")

# The Trainer and the Accelerator subclass import their libraries' heavier modules on first use.
_LAZY_EXPORTS = ("DistCATrainer", "StepTableCallback", "DistCAAccelerator", "prepare_training_arguments")

__all__ = [
    "ATTN_IMPLEMENTATION", "CATask", "DistCAConfig", "DistCAPeerError", "DistCAPlugin", "DistCATimeoutError",
    "DocumentBoundaryError", "LaunchError", "PackedCollator", "PackedDataset", "PackedDocuments", "PackingConfig",
    "ParallelTopology", "StreamingPackedDataset", "UnsupportedAttentionError", "configure", "current_config",
    "distca_attention_forward", "find_documents", "fuse_tasks", "load_documents", "plan_stats", "register",
    "reset_config", "split_document", "varlen_causal_attention", "whole_document_tasks", *_LAZY_EXPORTS,
]


def __getattr__(name):
    if name in _LAZY_EXPORTS:
        from . import training

        return getattr(training, name)
    old = f"{__name__}.{name}"
    if old in _moved.MOVED:  # distca_hf.trainer etc. as attributes: import through the alias
        import importlib

        return importlib.import_module(old)
    raise AttributeError(f"module 'distca_hf' has no attribute {name!r}")
