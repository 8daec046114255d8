"""HF glue: the ``"distca"`` attention and mask functions, their registration with transformers, the
refusal of models that would ignore them (``model_check``), the document arguments a model's
forward hands its attention calls (``model_inputs``: families whose layers drop ``position_ids``),
and the table of what is supported and refused (``support``, the documentation's page docs/models.md).

``import distca_hf`` arranges for ``register()`` to run as soon as transformers has imported the
interfaces (``distca_hf._after_import``); then ``attn_implementation="distca"`` works in
``from_pretrained``, ``from_config`` and ``set_attn_implementation`` for every decoder model that
dispatches through transformers' attention interface.
"""

from .attention import (ATTN_IMPLEMENTATION, UnsupportedAttentionError, attention_chunk, distca_attention_forward,
                        mixed_sliding_window, widest_window, refuse_unsupported, to_compute_dtype)
from .mask import distca_mask
from .model_check import refuse_models_that_ignore_the_interface, uses_attention_interface

__all__ = ["ATTN_IMPLEMENTATION", "UnsupportedAttentionError", "attention_chunk", "distca_attention_forward", "distca_mask",
           "mixed_sliding_window", "widest_window", "refuse_unsupported", "register", "register_attention", "register_mask",
           "to_compute_dtype", "uses_attention_interface"]


def register() -> None:
    """Register ``"distca"`` with transformers' attention and mask interfaces, and refuse it for
    models that would ignore it (idempotent)."""
    register_attention()
    register_mask()


def register_attention() -> None:
    """``"distca"`` in ``transformers.AttentionInterface`` (``transformers.modeling_utils``), and
    the refusal of models that would ignore it (idempotent)."""
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, distca_attention_forward)
    refuse_models_that_ignore_the_interface(ATTN_IMPLEMENTATION)


def register_mask() -> None:
    """``"distca"`` in ``transformers.masking_utils.AttentionMaskInterface`` (idempotent)."""
    from transformers.masking_utils import AttentionMaskInterface

    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, distca_mask)
