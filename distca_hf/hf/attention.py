"""The ``"distca"`` attention function (``AttentionInterface``) and the refusals it applies.

HF calls it in every attention layer, after RoPE, with ``query [batch, heads, seq, head_dim]`` and
``key/value [batch, kv_heads, kv_len, head_dim]``; it returns ``[batch, seq, heads, head_dim]``.

Document boundaries are found from the call's own arguments (``planning.find_documents``), so the
result does not depend on ``use_cache`` (with a cache, transformers skips its own packed-sequence
detection). Boundaries, plan and index tables are made once per forward (``runtime.forward``) and
reused by every layer; under ``torch.distributed`` the CA-tasks run where the plan puts them
(``runtime.wave_schedule``).
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedAttentionError
from ..kernels import AttentionVariant, varlen_causal_attention
from ..runtime import context_for_call, dispatched_attention

__all__ = ["ATTN_IMPLEMENTATION", "UnsupportedAttentionError", "distca_attention_forward", "widest_window",
           "refuse_unsupported", "to_compute_dtype"]

ATTN_IMPLEMENTATION = "distca"


def to_compute_dtype(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    """q, k, v in one dtype, the one HF's own attention paths compute in: under autocast on their
    device, the autocast dtype (eager's matmuls and SDPA run in it); otherwise the dtype of ``value``,
    the projection's output (``query`` and ``key`` may have been promoted to float32 by a float32
    rotary embedding). Autograd casts the gradients back."""
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    else:
        dtype = value.dtype
    return tuple(t if t.dtype == dtype else t.to(dtype) for t in (query, key, value))


def refuse_unsupported(module: torch.nn.Module, dropout: float, kwargs: dict) -> None:
    """Raise ``UnsupportedAttentionError`` naming the feature when ``module`` asks for one distca
    cannot compute exactly (non-causal, dropout, sinks). Sliding windows and softcapping are exact."""
    name = type(module).__name__
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    if not is_causal:
        raise UnsupportedAttentionError(
            f"distca computes causal attention only, but {name} is non-causal (is_causal=False); "
            "use attn_implementation='sdpa' for encoders and bidirectional layers"
        )
    if dropout and dropout > 0:
        raise UnsupportedAttentionError(
            f"distca does not support attention dropout (got dropout={dropout} in {name} while training); "
            f"set config.{_dropout_field(module, dropout)}=0.0"
        )
    if kwargs.get("s_aux") is not None or getattr(module, "sinks", None) is not None:
        raise UnsupportedAttentionError(
            f"distca does not support attention sinks ({name} has learned sink logits, e.g. gpt-oss); "
            "use attn_implementation='eager' or 'flash_attention_2'"
        )


# Where model families keep their attention dropout probability (GPT-2 and friends: attn_pdrop).
_DROPOUT_FIELDS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "attn_dropout")


def _dropout_field(module: torch.nn.Module, dropout: float) -> str:
    """The name of the config field that holds ``module``'s attention dropout, for the refusal's hint."""
    config = getattr(module, "config", None)
    present = [f for f in _DROPOUT_FIELDS if hasattr(config, f)]
    matching = [f for f in present if getattr(config, f) == dropout]
    return (matching or present or ["attention_dropout"])[0]


def widest_window(config) -> int | None:
    """The widest sliding window (keys per query) over a model's attention layers, from its config:
    ``config.sliding_window`` when every layer slides (Mistral; ``layer_types`` all
    ``"sliding_attention"``), ``None`` when any layer attends to whole prefixes (Gemma 2/3, Qwen2
    with ``max_window_layers``, plain Llama). A forward's CA-tasks carry only the K/V this window
    sees; each layer then applies its own window in the kernel, so mixed models stay exact and
    uniformly windowed ones move fewer K/V bytes."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types and any(t != "sliding_attention" for t in layer_types):
        return None
    return int(window)


def distca_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF attention function. query ``[B, H, S, D]``, key/value ``[B, H_kv, S_kv, D]`` ->
    ``([B, S, H, D], None)``; attention weights are never materialised."""
    refuse_unsupported(module, dropout, kwargs)
    query, key, value = to_compute_dtype(query, key, value)
    batch_size, num_heads, query_len, head_dim = query.shape
    kv_len, num_kv_heads = key.shape[2], key.shape[1]
    context = context_for_call(module, query, key, attention_mask, kwargs.get("position_ids"),
                               kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k"),
                               kv_window=widest_window(getattr(module, "config", None)))
    variant = AttentionVariant(kwargs.get("sliding_window"), kwargs.get("softcap"))
    q = query.transpose(1, 2).reshape(batch_size * query_len, num_heads, head_dim)
    k = key.transpose(1, 2).reshape(batch_size * kv_len, num_kv_heads, head_dim)
    v = value.transpose(1, 2).reshape(batch_size * kv_len, num_kv_heads, head_dim)
    if context.dispatch is not None:
        scale = head_dim**-0.5 if scaling is None else float(scaling)
        out = dispatched_attention(q, k, v, context.dispatch, scale, variant=variant)
        return out.view(batch_size, query_len, num_heads, head_dim), None
    batch = context.local
    if batch.q_index is not None:
        q = q.index_select(0, batch.q_index)
        k = k.index_select(0, batch.k_index)
        v = v.index_select(0, batch.k_index)
    out = varlen_causal_attention(
        q, k, v, batch.cu_seqlens_q, batch.cu_seqlens_k, batch.max_seqlen_q, batch.max_seqlen_k, scaling,
        window=variant.window, softcap=variant.softcap,
    )
    if batch.q_index is not None:
        # Padding queries get zeros, as HF's flash-attention path gives them.
        out = out.new_zeros(batch_size * query_len, num_heads, head_dim).index_copy(0, batch.q_index, out)
    return out.view(batch_size, query_len, num_heads, head_dim), None
