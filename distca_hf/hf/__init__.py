"""HF glue: the ``"distca"`` attention and mask functions, their registration with transformers, and
the refusal of models that would ignore them (``model_check``).

``import distca_hf`` calls ``register()``; then ``attn_implementation="distca"`` works in
``from_pretrained``, ``from_config`` and ``set_attn_implementation`` for every decoder model that
dispatches through transformers' attention interface.
"""

from .attention import (ATTN_IMPLEMENTATION, UnsupportedAttentionError, distca_attention_forward, refuse_short_window,
                        refuse_unsupported, to_compute_dtype)
from .mask import distca_mask
from .model_check import refuse_models_that_ignore_the_interface, uses_attention_interface

__all__ = ["ATTN_IMPLEMENTATION", "UnsupportedAttentionError", "distca_attention_forward", "distca_mask",
           "refuse_short_window", "refuse_unsupported", "register", "to_compute_dtype", "uses_attention_interface"]


def register() -> None:
    """Register ``"distca"`` with transformers' attention and mask interfaces, and refuse it for
    models that would ignore it (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, distca_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, distca_mask)
    refuse_models_that_ignore_the_interface(ATTN_IMPLEMENTATION)
