"""The ``"distca"`` attention function (``AttentionInterface``) and the refusals it applies.

HF calls it in every attention layer, after RoPE, with ``query [batch, heads, seq, head_dim]``,
``key [batch, kv_heads, kv_len, head_dim]`` and ``value [batch, kv_heads, kv_len, value_head_dim]``
(DeepSeek's multi-head latent attention: another head dim than q/k); it returns ``[batch, seq,
heads, value_head_dim]``.

Document boundaries are found from the call's own arguments (``planning.find_documents``), or,
when the family's layers drop them (Llama 4), from those its model's forward was given
(``model_inputs``), so the result does not depend on ``use_cache`` (with a cache, transformers
skips its own packed-sequence detection). Boundaries, plan and index tables are made once per
forward (``runtime.forward``) and reused by every layer; under ``torch.distributed`` the CA-tasks
run where the plan puts them (``runtime.wave_schedule``).

Llama 4: its chunked layers (``attention_chunk``) run as the kernels' ``chunk`` variant, and the
queries its NoPE layers scaled by their row position are rescaled to their position in their
document (``_per_document_temperature``).
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedAttentionError
from ..kernels import AttentionVariant, varlen_causal_attention
from ..runtime import attention_dtype, context_for_call, dispatched_attention, layer_window
from ..state import warn_once
from .model_inputs import MODEL_DOCUMENTS, document_arguments

__all__ = ["ATTN_IMPLEMENTATION", "UnsupportedAttentionError", "attention_chunk", "distca_attention_forward",
           "widest_window", "mixed_sliding_window", "refuse_unsupported", "to_compute_dtype"]

ATTN_IMPLEMENTATION = "distca"


def to_compute_dtype(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    """q, k, v in one dtype, the one HF's own attention paths compute in: under autocast on their
    device, the autocast dtype (eager's matmuls and SDPA run in it); otherwise the dtype of ``value``,
    the projection's output (``query`` and ``key`` may have been promoted to float32 by a float32
    rotary embedding). Autograd casts the gradients back."""
    dtype = attention_dtype(query.device.type, value.dtype)
    return tuple(t if t.dtype == dtype else t.to(dtype) for t in (query, key, value))


def refuse_unsupported(module: torch.nn.Module, dropout: float, kwargs: dict) -> None:
    """Raise ``UnsupportedAttentionError`` naming the feature when ``module`` asks for one distca
    cannot compute exactly (non-causal, dropout, sparse key selections, sinks). Sliding windows,
    softcapping and chunks are exact."""
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
    if kwargs.get("indices") is not None:  # DeepSeek-V3.2's top-k indexer: keys picked per query
        raise UnsupportedAttentionError(
            f"distca does not support sparse attention ({name} is given the key indices each query attends to); "
            "use attn_implementation='eager' or 'sdpa'")
    if kwargs.get("s_aux") is not None or getattr(module, "sinks", None) is not None:
        raise UnsupportedAttentionError(
            f"distca does not support attention sinks ({name} has learned sink logits, e.g. gpt-oss); "
            "use attn_implementation='eager' or 'flash_attention_2'"
        )


NO_ATTENTION_WEIGHTS = (
    "distca: output_attentions=True, but attn_implementation='distca' never materialises attention weights (each "
    "CA-task's scores are computed on the rank that serves it and dropped there): outputs.attentions has no "
    "weights, as with 'sdpa' and 'flash_attention_2'. Use attn_implementation='eager' (from_pretrained, or "
    "model.set_attn_implementation('eager')) to get attention weights")


def warn_no_attention_weights(kwargs: dict) -> None:
    """A one-time warning when a forward asks for attention weights (``output_attentions=True``). distca,
    like transformers' ``sdpa`` and flash-attention functions, computes attention without the weights; it
    answers as they do (the layers return ``None`` weights, so ``outputs.attentions`` is an empty tuple,
    after a warning naming ``output_attentions`` and ``eager``), so a job that asks for them everywhere
    runs on as under ``sdpa``, but never gets an empty tuple without a word. ``config.output_attentions
    = True`` is refused by transformers itself for any implementation but ``eager``."""
    if kwargs.get("output_attentions"):
        warn_once("output_attentions", NO_ATTENTION_WEIGHTS, stacklevel=4)


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


def mixed_sliding_window(config) -> int | None:
    """The window of a model's sliding layers when it mixes them with layers of another type (Gemma 2/3,
    Cohere2, Olmo 3, Qwen2 with ``max_window_layers``: ``config.layer_types`` holds
    ``"sliding_attention"`` and ``"full_attention"`` or ``"chunked_attention"``), else ``None``. Such a
    forward is planned twice: once for its full layers (whole prefixes, ``widest_window`` is ``None``)
    and once for its sliding layers under this window, whose work is nearly even per token and whose
    CA-tasks need only the last ``window`` keys (``runtime.forward``); one plan for both made the sliding
    layers carry whole prefixes and balance pairs they do not compute."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or ()
    if not window or "sliding_attention" not in layer_types or widest_window(config) is not None:
        return None
    return int(window)


def attention_chunk(module: torch.nn.Module) -> int | None:
    """The chunk size (tokens) of ``module``'s chunked attention, or ``None``: Llama 4's layers whose
    ``config.layer_types[layer_idx]`` is ``"chunked_attention"`` let a query at document position
    ``p`` see only keys ``[p // C * C, p]``, ``C = config.attention_chunk_size`` (HF's
    ``create_chunked_causal_mask``)."""
    config = getattr(module, "config", None)
    layer_types = getattr(config, "layer_types", None)
    layer_idx = getattr(module, "layer_idx", None)
    if not layer_types or layer_idx is None or layer_idx >= len(layer_types):
        return None
    if layer_types[layer_idx] != "chunked_attention":
        return None
    chunk = getattr(config, "attention_chunk_size", None)
    if not chunk:
        raise UnsupportedAttentionError(
            f"{type(module).__name__} layer {layer_idx} is a 'chunked_attention' layer but config.attention_chunk_size "
            f"is {chunk!r}; set it to the chunk size in tokens")
    return int(chunk)


def _refuse_chunks_under_a_dropping_cache(module, query_len: int, kv_len: int, chunk: int | None) -> None:
    """HF's cache keeps only the last ``chunk - 1`` keys of a chunked layer: a task's first key is then
    no longer its document's position 0, which chunk boundaries are counted from."""
    if chunk is not None and kv_len - query_len >= chunk - 1:
        raise UnsupportedAttentionError(
            f"distca: {type(module).__name__} layer {module.layer_idx} runs chunked attention (attention_chunk_size="
            f"{chunk}) with a KV cache of {kv_len - query_len} past keys; once a sequence reaches chunk - 1 = "
            f"{chunk - 1} cached tokens the cache drops older keys and chunk boundaries cannot be placed. Generate with "
            "attn_implementation='sdpa' or 'eager' (training and cache-free forwards are exact)")


def _document_positions(batch_size: int, query_len: int, kv_len: int, attention_mask, position_ids,
                        cu_seq_lens_q) -> torch.Tensor:
    """``[batch, seq]`` position of each query in its document (padding: 0), from the same arguments
    the documents are found from (``planning.find_documents``' order)."""
    past = kv_len - query_len
    if cu_seq_lens_q is not None:
        flat = torch.arange(batch_size * query_len, device=cu_seq_lens_q.device)
        cu = cu_seq_lens_q.to(torch.long)
        starts = cu[torch.searchsorted(cu, flat, right=True) - 1]
        return (flat - starts).view(batch_size, query_len) + past
    if position_ids is not None:
        return position_ids.expand(batch_size, query_len)
    if attention_mask is not None:
        seen = attention_mask[:, -kv_len:].to(torch.long).cumsum(-1) - 1
        return seen[:, -query_len:].clamp(min=0)
    return torch.arange(past, kv_len).expand(batch_size, query_len)


def _temperature_scale(positions: torch.Tensor, floor_scale: int, attn_scale: float) -> torch.Tensor:
    """Llama 4's attention temperature tuning of NoPE layers' queries (HF's ``Llama4TextAttention``):
    ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1`` at position ``p``."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0


def _per_document_temperature(module, query: torch.Tensor, kv_len: int, documents) -> torch.Tensor:
    """Llama 4 scales its NoPE layers' queries by their position in the row (``arange(seq) + past``)
    before calling attention, so a packed document past ``floor_scale`` tokens into its row (or a
    padded row, or a piece of a document spanning ranks) gets another temperature than alone. Its
    queries are rescaled here to their position in their document: exact, and differentiable. Other
    modules, and rows shorter than ``floor_scale`` (every scale 1), pass unchanged. query ``[B, H, S, D]``."""
    floor_scale = getattr(module, "floor_scale", None)
    if not (getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True)
            and floor_scale and kv_len >= floor_scale):
        return query
    batch_size, _, query_len, _ = query.shape
    in_row = torch.arange(kv_len - query_len, kv_len, device=query.device).expand(batch_size, query_len)
    in_document = documents().to(query.device)
    ratio = (_temperature_scale(in_document, floor_scale, module.attn_scale)
             / _temperature_scale(in_row, floor_scale, module.attn_scale))
    return query * ratio[:, None, :, None].to(query.dtype)


# Under torch.compile (TrainingArguments(torch_compile=True), torch.compile(model)) the model's own layers are
# compiled and each attention call runs as written: Dynamo stops at it (a graph break per layer). Traced, its
# planning (numpy, Python objects, data-dependent shapes) and collectives broke the graph hundreds of times and
# then failed in compiled code on two ranks.
@torch.compiler.disable
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
    """HF attention function. query ``[B, H, S, D]``, key ``[B, H_kv, S_kv, D]``, value ``[B, H_kv,
    S_kv, D_v]`` -> ``([B, S, H, D_v], None)``; attention weights are never materialised."""
    refuse_unsupported(module, dropout, kwargs)
    warn_no_attention_weights(kwargs)
    query, key, value = to_compute_dtype(query, key, value)
    batch_size, num_heads, query_len, head_dim = query.shape
    kv_len, num_kv_heads, value_dim = key.shape[2], key.shape[1], value.shape[-1]
    chunk = attention_chunk(module)
    _refuse_chunks_under_a_dropping_cache(module, query_len, kv_len, chunk)
    position_ids, cu_seq_lens_q, cu_seq_lens_k = document_arguments(module, query, kwargs)
    query = _per_document_temperature(module, query, kv_len, lambda: _document_positions(
        batch_size, query_len, kv_len, attention_mask, position_ids, cu_seq_lens_q))
    model_forward = kwargs.get(MODEL_DOCUMENTS)
    config = getattr(module, "config", None)
    context = context_for_call(module, query, key, attention_mask, position_ids, cu_seq_lens_q, cu_seq_lens_k,
                               kv_window=widest_window(config), value_head_dim=value_dim,
                               model_contexts=model_forward.contexts if model_forward is not None else None,
                               sliding_window=mixed_sliding_window(config))
    # the window the model hands the interface, else the one its mask applies (PhiMoE, Qwen2-MoE hand none)
    variant = AttentionVariant(kwargs.get("sliding_window") or layer_window(module), kwargs.get("softcap"), chunk)
    context = context.for_window(variant.window)  # a mixed model's sliding layers run their own plan
    q = query.transpose(1, 2).reshape(batch_size * query_len, num_heads, head_dim)
    k = key.transpose(1, 2).reshape(batch_size * kv_len, num_kv_heads, head_dim)
    v = value.transpose(1, 2).reshape(batch_size * kv_len, num_kv_heads, value_dim)
    if context.dispatch is not None:
        scale = head_dim**-0.5 if scaling is None else float(scaling)
        out = dispatched_attention(q, k, v, context.dispatch, scale, variant=variant)
        return out.view(batch_size, query_len, num_heads, value_dim), None
    batch = context.local
    if batch.q_index is not None:
        q = q.index_select(0, batch.q_index)
        k = k.index_select(0, batch.k_index)
        v = v.index_select(0, batch.k_index)
    out = varlen_causal_attention(
        q, k, v, batch.cu_seqlens_q, batch.cu_seqlens_k, batch.max_seqlen_q, batch.max_seqlen_k, scaling,
        window=variant.window, softcap=variant.softcap, chunk=variant.chunk,
    )
    if batch.q_index is not None:
        # Padding queries get zeros, as HF's flash-attention path gives them.
        out = out.new_zeros(batch_size * query_len, num_heads, value_dim).index_copy(0, batch.q_index, out)
    return out.view(batch_size, query_len, num_heads, value_dim), None
