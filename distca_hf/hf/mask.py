"""The ``"distca"`` mask function (``AttentionMaskInterface``).

Without one, transformers passes ``attention_mask=None`` even for padded batches. Ours hands the 2D
padding mask through untouched, because the document structure is found by the attention function,
not in a dense ``[seq, seq]`` mask.
"""

from __future__ import annotations

import torch

from ..errors import DocumentBoundaryError
from .attention import UnsupportedAttentionError

__all__ = ["distca_mask"]


def distca_mask(
    batch_size: int,
    q_length: int | None = None,
    kv_length: int | None = None,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    cache_position: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """Mask function for ``AttentionMaskInterface``: the 2D padding mask ``[batch, kv_length]``
    (bool) when some token is padding, else ``None``. Causality, documents and sliding windows are
    handled by the attention function itself. Transformers' early 5.x releases give the queries'
    positions (``cache_position``, ``[q_length]``) instead of ``q_length`` and ``q_offset``."""
    if q_length is None:
        if cache_position is None or kv_length is None:
            raise TypeError("distca_mask needs kv_length and either q_length (transformers' current mask interface) "
                            "or cache_position (its earlier one)")
        q_length = int(cache_position.shape[0])
        q_offset = int(cache_position[0]) if q_length else 0
    filled = int(q_offset) + q_length
    if filled < kv_length:
        _refuse_unfilled_keys(kv_length, filled, attention_mask)
    if attention_mask is None or attention_mask.dim() != 2:
        return attention_mask
    if attention_mask.shape[1] != kv_length:
        attention_mask = attention_mask[:, -kv_length:]
    if bool(attention_mask.all()):
        return None
    return attention_mask


def _refuse_unfilled_keys(kv_length: int, filled: int, attention_mask) -> None:
    """HF asks for more keys than are filled in two cases it does not tell apart here: without a cache
    it takes the key length from a 2D attention_mask, which may be wider than the input; a static
    (pre-allocated) cache reports all its slots."""
    if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[1] == kv_length:
        raise DocumentBoundaryError(
            f"attention_mask has {kv_length} columns but the call has only {filled} key tokens (its input, plus "
            "any cached ones): give a padding mask of one column per key token, [batch, cached + new tokens]. (A "
            "static, pre-allocated KV cache also gives this: distca needs the default dynamic cache)")
    raise UnsupportedAttentionError(
        f"distca does not support static (pre-allocated) KV caches: the cache holds {kv_length} slots "
        f"but only {filled} are filled; use the default dynamic cache (no cache_implementation='static')"
    )
