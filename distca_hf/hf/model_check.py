"""Refuse ``attn_implementation="distca"`` on models that would silently ignore it.

transformers accepts any registered implementation name for any model, but some families (Bloom,
and other older ones) compute attention in their own code and never call the attention interface:
with ``"distca"`` they would run their own dense attention, and packed documents would attend to
each other without a word. ``register()`` wraps ``PreTrainedModel.get_correct_attn_implementation``
(which transformers calls whenever an implementation is chosen: ``from_pretrained``,
``from_config``, ``set_attn_implementation``, sub-models included) so that choosing ``"distca"``
for such a model raises at once, and has every model that chooses it record the document arguments
of its forwards (``model_inputs``: for families whose layers drop ``position_ids``) and whether they
are given a KV cache (``decoding``).
"""

from __future__ import annotations

import functools

from ..errors import UnsupportedAttentionError
from .decoding import watch_decoding
from .model_inputs import watch_model_inputs

__all__ = ["SPARSE_ATTENTION_LAYER_TYPES", "uses_attention_interface", "refuse_models_that_ignore_the_interface",
           "refuse_sparse_attention"]


def uses_attention_interface(model_class) -> bool:
    """Whether ``model_class`` (a ``PreTrainedModel`` subclass) computes attention through
    transformers' ``AttentionInterface``: it says so (``is_backend_compatible()``, i.e.
    ``_supports_attention_backend``), or transformers' own check of its source finds that its
    attention modules call the interface (classes that predate the flag)."""
    if model_class.is_backend_compatible():
        return True
    from_source = getattr(model_class, "_can_set_attn_implementation", None)
    return bool(from_source()) if from_source is not None else False


SPARSE_ATTENTION_LAYER_TYPES = ("indexed_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                                "minimax_m3_sparse", "deepseek_sparse_attention", "qwen_sparse_attention")
"""``config.layer_types`` of attention that attends to a selection of the keys (DeepSeek-V3.2's top-k
indexer, DeepSeek-V4's compressed attention, ...): distca computes every key of the causal prefix.
Before transformers 5.24 the indexer's layers were ``"deepseek_sparse_attention"`` (DeepSeek-V3.2,
GLM-MoE-DSA, ...) and ``"qwen_sparse_attention"``; 5.24 calls both ``"indexed_attention"``."""


def refuse_sparse_attention(model) -> None:
    """Raise ``UnsupportedAttentionError`` when ``model``'s layers attend to a selection of their keys
    (``SPARSE_ATTENTION_LAYER_TYPES``): with "distca" they would silently attend to all of them."""
    config = model.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = set(getattr(config, "layer_types", None) or []) | set(getattr(text_config, "layer_types", None) or [])
    sparse = sorted(layer_types & set(SPARSE_ATTENTION_LAYER_TYPES))
    if sparse:
        raise UnsupportedAttentionError(
            f"{type(model).__name__} has sparse attention layers ({', '.join(repr(t) for t in sparse)}: each query "
            "attends to keys a selection picks), which distca does not support: it computes every key of the causal "
            f"prefix. Use another attn_implementation for {type(model).__name__}")


def _attention_classes_by_name(model_class, implementation: str) -> bool:
    """Whether ``model_class``'s modeling module picks its attention class from a table keyed by
    implementation names (``GIT_SELF_ATTENTION_CLASSES = {"eager": ...}``) that lacks
    ``implementation``: the model passes transformers' check, then fails building its layers with a
    bare ``KeyError``."""
    import sys

    module = sys.modules.get(model_class.__module__)
    return any(name.endswith("ATTENTION_CLASSES") and isinstance(table, dict) and "eager" in table
               and implementation not in table for name, table in vars(module or object).items())


def refuse_models_that_ignore_the_interface(implementation: str) -> None:
    """Wrap ``PreTrainedModel.get_correct_attn_implementation`` so that choosing ``implementation``
    for a model that does not use the attention interface raises ``UnsupportedAttentionError``
    (idempotent)."""
    from transformers import PreTrainedModel

    choose = PreTrainedModel.get_correct_attn_implementation
    if getattr(choose, "_distca_checked", False):
        return

    @functools.wraps(choose)
    def get_correct_attn_implementation(self, requested_attention=None, *args, **kwargs):
        chosen = choose(self, requested_attention, *args, **kwargs)
        if chosen == implementation and uses_attention_interface(type(self)):
            watch_model_inputs(self, implementation)  # families whose layers drop position_ids (Llama 4)
            watch_decoding(self, implementation)  # a forward given a KV cache computes on its own rank
        if chosen == implementation:
            refuse_sparse_attention(self)
        if chosen == implementation and (not uses_attention_interface(type(self))
                                         or _attention_classes_by_name(type(self), implementation)):
            name = type(self).__name__
            raise UnsupportedAttentionError(
                f"{name} computes attention in its own code instead of through transformers' AttentionInterface, so "
                f"attn_implementation={implementation!r} would be silently ignored and packed documents would attend "
                "to each other. Use a model family that dispatches through the interface (Llama, Mistral, Qwen2, "
                f"Qwen3, Gemma, Phi3, GPT-2, ...), or another attn_implementation for {name}")
        return chosen

    get_correct_attn_implementation._distca_checked = True
    PreTrainedModel.get_correct_attn_implementation = get_correct_attn_implementation
