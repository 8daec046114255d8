"""The ``"distca"`` mask function (``AttentionMaskInterface``).

Without one, transformers passes ``attention_mask=None`` even for padded batches. Ours hands the 2D
padding mask through untouched, because the document structure is found by the attention function,
not in a dense ``[seq, seq]`` mask.

What transformers asks for is read from the ``mask_function`` it composes (``masking_utils``'
``and_masks`` / ``or_masks`` of causal, sliding-window, chunked, padding and packed-sequence
functions), because distca applies causality, windows and chunks itself and must not drop anything
else: ``mask_shape`` refuses a mask that lets some tokens attend beyond causal order (Gemma 3's
bidirectional image tokens, a prefix-LM's prefix) or restricts attention in a way distca does not
know, and a plain causal mask built for a model whose ``config.sliding_window`` distca would apply to
every layer (Moshi keeps a ``sliding_window`` its layers do not use).
"""

from __future__ import annotations

import torch

from ..errors import DocumentBoundaryError
from .attention import UnsupportedAttentionError, widest_window

__all__ = ["distca_mask", "mask_shape"]


@torch.compiler.disable  # run as written under torch.compile, as the attention function (attention.py)
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
    if mask_function is not None:
        _check_mask_function(mask_function, kwargs.get("config"))
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


# masking_utils' composers and leaves, by the name of the function that made them (``<name>.<locals>``)
_WRAPPERS = ("remap_positions_for_packed_sequence", "add_offsets_to_mask_function")  # q/kv index changes only
_DOCUMENTS_AND_PADDING = ("padding_mask_function", "packed_sequence_mask_function")  # distca finds both itself


def _maker(function) -> str:
    name = getattr(function, "__qualname__", "") or ""
    return name.split(".<locals>", 1)[0]


def _cell(function, name: str):
    """The value of the free variable ``name`` of a closure (what its factory was given)."""
    names = function.__code__.co_freevars
    return function.__closure__[names.index(name)].cell_contents


def mask_shape(mask_function) -> tuple[int | None, int | None] | None:
    """``(sliding window, chunk size)`` (``None``: none) of a transformers ``mask_function`` that is
    causal attention, restricted only by a sliding window, attention chunks, padding and packed
    documents (what distca applies itself); ``None`` for a mask that is not causal at all (a
    bidirectional one, built for an encoder or a cross-attention: distca refuses non-causal layers
    where they run, ``is_causal=False``); an ``UnsupportedAttentionError`` naming what else it
    holds: attention beyond causal order (an ``or_masks`` that adds pairs: image tokens attending to
    each other both ways, a bidirectional prefix) or an unknown restriction."""
    shape = _read(mask_function)
    if shape["adds"]:
        raise UnsupportedAttentionError(
            f"distca computes causal attention only, but this model's mask lets some tokens attend beyond causal order "
            f"({shape['adds']}: bidirectional attention among image tokens or a prefix, token_type_ids / "
            "block_sequence_ids); train with attn_implementation='sdpa' or 'eager', or without those tokens")
    if not shape["causal"]:  # (an encoder's or a cross-attention's: distca refuses the layers that would use it)
        return None
    return shape["window"], shape["chunk"]


def _pattern(*, causal: bool, window=None, chunk=None, adds=None, neutral: bool = False) -> dict:
    """What a mask function allows: at most ``causal`` pairs, restricted by a ``window`` / ``chunk``;
    ``adds``: a description of the pairs it allows beyond causal order; ``neutral``: a union's part that
    adds no pair (image blocks of a row without images)."""
    return {"causal": causal, "window": window, "chunk": chunk, "adds": adds, "neutral": neutral}


def _read(function) -> dict:
    """``_pattern`` of ``function``, read through ``masking_utils``' closures; an unknown one is refused."""
    import transformers.masking_utils as hf

    maker = _maker(function)
    if function is hf.causal_mask_function:
        return _pattern(causal=True)
    if function is hf.bidirectional_mask_function:  # every pair: restricted by nothing causal, it is not causal
        return _pattern(causal=False)
    if maker == "or_masks":  # a union: parts that add no pair (no image block) drop out
        parts = [p for p in map(_read_in_union, _cell(function, "mask_functions")) if not p["neutral"]]
        if len(parts) > 1:
            return _pattern(causal=True, adds=next((p["adds"] for p in parts if p["adds"]), "or_masks of patterns"))
        return parts[0] if parts else _pattern(causal=True)
    if maker == "and_masks":  # an intersection with plain causal attention adds nothing
        parts = [_read(f) for f in _cell(function, "mask_functions")]
        causal = [p for p in parts if p["causal"]]
        plain = any(not p["adds"] for p in causal)
        return _pattern(causal=bool(causal), window=_narrowest(p["window"] for p in parts),
                        chunk=next((p["chunk"] for p in parts if p["chunk"]), None),
                        adds=None if plain else next((p["adds"] for p in parts if p["adds"]), None))
    if maker in _WRAPPERS:
        return _read(_cell(function, "mask_function"))
    if maker == "sliding_window_overlay":
        return _pattern(causal=False, window=int(_cell(function, "sliding_window")))
    if maker == "chunked_overlay":
        return _pattern(causal=False, chunk=int(_cell(function, "chunk_size")))
    if maker in _DOCUMENTS_AND_PADDING:
        return _pattern(causal=False)
    if maker == "blockwise_overlay":  # image blocks attend to themselves both ways; -1: text, causal
        if not bool((_cell(function, "block_sequence_ids") >= 0).any()):
            return _pattern(causal=True, neutral=True)
        return _pattern(causal=True, adds="blockwise_overlay of image blocks")
    raise UnsupportedAttentionError(
        f"this model's attention mask holds a pattern distca does not know ({maker or function!r}); distca applies "
        "causality, sliding windows and chunks itself and would drop it: use attn_implementation='sdpa' or 'eager'")


def _read_in_union(function) -> dict:
    """``_read``, where a pattern of the model's own (transformers 5.0's token types) adds pairs."""
    try:
        return _read(function)
    except UnsupportedAttentionError:
        return _pattern(causal=True, adds=_maker(function) or repr(function))


def _narrowest(windows) -> int | None:
    windows = [w for w in windows if w]
    return min(windows) if windows else None


def _check_mask_function(mask_function, config) -> None:
    """``mask_shape``'s refusals, and a plain causal mask for a model whose ``config.sliding_window``
    distca would apply to every layer (``widest_window``: no ``layer_types``), which its layers then
    do not use."""
    shape = mask_shape(mask_function)
    if shape is None or shape != (None, None) or config is None or getattr(config, "layer_types", None):
        return
    if widest_window(config) is not None:
        raise UnsupportedAttentionError(
            f"{type(config).__name__} sets sliding_window={config.sliding_window}, "
            "but the model builds full causal masks for its layers: distca would slide every layer. Set "
            "config.sliding_window=None (or config.layer_types to what each layer uses)")
