"""The document arguments a model's forward was given, for families whose layers do not hand them
to the attention function.

distca finds a call's documents from the attention call's own arguments (``position_ids``,
``cu_seq_lens_q/k``, the padding mask; ``planning.find_documents``). Most families pass the model's
``position_ids`` down to every attention call, but some decoder layers take ``position_ids`` as a
named argument and drop it: Llama 4 (``Llama4TextDecoderLayer``; also ``bailing_hybrid``,
``glm5_next``, ``kimi_linear`` in transformers 5.24) builds its masks from them in the model's
forward and calls attention without them, so a packed row looked like one document and its
documents attended to each other without a word (HF's own eager is exact there: its mask carries
the documents). ``cu_seq_lens`` travel in ``**kwargs`` and reach the attention in every family
that passes its kwargs on.

``watch_model_inputs(model)`` (run by ``register()`` for every model that chooses ``"distca"``)
adds, before each forward of the model, one more keyword argument, ``MODEL_DOCUMENTS``: the
``(position_ids, cu_seq_lens_q, cu_seq_lens_k)`` the model was called with. It travels the way
``cu_seq_lens`` do (model -> decoder layers -> attention module -> attention function, through
their ``**kwargs``), so it also reaches the recomputation of gradient checkpointing, which calls a
layer's ``forward`` again with the keyword arguments it got. ``document_arguments`` gives an
attention call that got none of its own these. A model forward that takes no ``**kwargs`` gets
nothing added.
"""

from __future__ import annotations

import inspect

import torch

from ..errors import UnsupportedAttentionError

__all__ = ["DOCUMENT_ARGUMENTS", "MODEL_DOCUMENTS", "document_arguments", "watch_model_inputs"]

DOCUMENT_ARGUMENTS = ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k")
"""The attention-call arguments that describe documents (after ``cu_seq_lens``, ``position_ids``)."""

MODEL_DOCUMENTS = "distca_model_documents"
"""The keyword argument that carries a model forward's document arguments down to its attention."""


def watch_model_inputs(model: torch.nn.Module, implementation: str) -> None:
    """Before each forward of ``model`` while it uses ``implementation``, add ``MODEL_DOCUMENTS`` to
    its keyword arguments when it was given any document argument (idempotent per model; a nested
    model given its own overrides its outer model's)."""
    if getattr(model, "_distca_watches_inputs", False):
        return
    signature = inspect.signature(type(model).forward).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.values()):
        return
    parameters = [p for p in signature if p != "self"]

    def add_documents(module, args, kwargs):
        if getattr(module.config, "_attn_implementation", None) != implementation:
            return None
        found = {name: kwargs.get(name) for name in DOCUMENT_ARGUMENTS}
        for name, value in zip(parameters, args):  # passed positionally
            if name in found and found[name] is None:
                found[name] = value
        if all(t is None for t in found.values()):
            return None
        return args, {**kwargs, MODEL_DOCUMENTS: tuple(found[name] for name in DOCUMENT_ARGUMENTS)}

    model.register_forward_pre_hook(add_documents, with_kwargs=True)
    model._distca_watches_inputs = True


def document_arguments(module: torch.nn.Module, query: torch.Tensor, kwargs: dict):
    """``(position_ids, cu_seq_lens_q, cu_seq_lens_k)`` for one attention call: its own when it got
    any, else those its model's forward was given (``MODEL_DOCUMENTS``, see the module docstring).
    query ``[batch, heads, seq, head_dim]``. A model given packed position_ids (a position that falls)
    that this call cannot use (another shape) raises ``UnsupportedAttentionError`` naming the layer,
    rather than merging its documents."""
    own = tuple(kwargs.get(name) for name in DOCUMENT_ARGUMENTS)
    given = kwargs.get(MODEL_DOCUMENTS)
    if any(t is not None for t in own) or given is None:
        return own
    positions, cu_seq_lens_q, cu_seq_lens_k = given
    if cu_seq_lens_q is not None or cu_seq_lens_k is not None:
        return None, cu_seq_lens_q, cu_seq_lens_k
    batch_size, query_len = query.shape[0], query.shape[2]
    if (torch.is_tensor(positions) and positions.dim() == 2 and positions.shape[1] == query_len
            and positions.shape[0] in (1, batch_size)):
        return positions, None, None
    if torch.is_tensor(positions) and positions.shape[-1] > 1 and bool((positions.diff(dim=-1) < 0).any()):
        raise UnsupportedAttentionError(
            f"{type(module).__name__} is called without position_ids or cu_seq_lens, so distca cannot find the "
            f"documents of a packed row, and the packed position_ids given to the model (shape "
            f"{tuple(positions.shape)}) do not fit its queries ({batch_size} rows of {query_len}); pass "
            "cu_seq_lens_q/cu_seq_lens_k (DataCollatorWithFlattening(return_flash_attn_kwargs=True)), or use another "
            "attn_implementation")
    return own
