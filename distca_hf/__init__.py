"""distca_hf: Core Attention Disaggregation (CAD) for the HuggingFace stack.

Importing the package registers ``attn_implementation="distca"`` with transformers::

    import distca_hf
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="distca")
"""

__version__ = "0.1.0"

from .attention import ATTN_IMPLEMENTATION, UnsupportedAttentionError, distca_attention_forward, register
from .comm import DistCATimeoutError
from .config import DistCAConfig, configure, current_config, reset_config
from .documents import DocumentBoundaryError, PackedDocuments, find_documents
from .kernels import varlen_causal_attention
from .step import DistCAPeerError, plan_stats
from .tasks import CATask, fuse_tasks, split_document, whole_document_tasks

register()

from . import patches  # noqa: E402  (after registration: the patches check the implementation name)

patches.install()  # ping-pong decoder stacks for the Llama family (active only with overlap="pingpong")

__all__ = [
    "ATTN_IMPLEMENTATION",
    "CATask",
    "DistCAConfig",
    "DistCAPeerError",
    "DistCATimeoutError",
    "DocumentBoundaryError",
    "PackedDocuments",
    "UnsupportedAttentionError",
    "configure",
    "current_config",
    "distca_attention_forward",
    "find_documents",
    "fuse_tasks",
    "plan_stats",
    "register",
    "reset_config",
    "split_document",
    "varlen_causal_attention",
    "whole_document_tasks",
]

# Training integration: the plugin, packing and topology are light; the Trainer and the Accelerator
# subclass import their libraries' heavier modules on first use.
from .data import PackedCollator, PackedDataset, PackingConfig, StreamingPackedDataset, load_documents  # noqa: E402
from .plugin import DistCAPlugin  # noqa: E402
from .topology import ParallelTopology  # noqa: E402

_LAZY_EXPORTS = {"DistCATrainer": "trainer", "StepTableCallback": "trainer", "DistCAAccelerator": "accelerate",
                 "prepare_training_arguments": "accelerate", "LaunchError": "launch"}


def __getattr__(name):
    if name in _LAZY_EXPORTS:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'distca_hf' has no attribute {name!r}")


__all__ += ["DistCAAccelerator", "DistCAPlugin", "DistCATrainer", "LaunchError", "PackedCollator", "PackedDataset",
            "PackingConfig", "ParallelTopology", "StepTableCallback", "StreamingPackedDataset", "load_documents",
            "prepare_training_arguments"]
