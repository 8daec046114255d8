"""HF glue: the ``"distca"`` attention and mask functions and their registration with transformers.

``import distca_hf`` calls ``register()``; then ``attn_implementation="distca"`` works in
``from_pretrained``, ``from_config`` and ``set_attn_implementation`` for every decoder model that
dispatches through transformers' attention interface.
"""

from .attention import (ATTN_IMPLEMENTATION, UnsupportedAttentionError, distca_attention_forward, refuse_short_window,
                        refuse_unsupported)
from .mask import distca_mask

__all__ = ["ATTN_IMPLEMENTATION", "UnsupportedAttentionError", "distca_attention_forward", "distca_mask",
           "refuse_short_window", "refuse_unsupported", "register"]


def register() -> None:
    """Register ``"distca"`` with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, distca_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, distca_mask)
