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

The guard: a model forward given packed documents (``position_ids`` that fall back, or
``cu_seq_lens``) during which some distca attention call got no document argument at all (a family
whose layers pass on neither ``position_ids`` nor their ``**kwargs``) raises
``UnsupportedAttentionError`` naming the model when it returns, instead of returning rows whose
documents attended to each other.
"""

from __future__ import annotations

import inspect

import torch

from ..errors import UnsupportedAttentionError
from ..state import STATE

__all__ = ["DOCUMENT_ARGUMENTS", "MODEL_DOCUMENTS", "document_arguments", "watch_model_inputs"]

DOCUMENT_ARGUMENTS = ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k")
"""The attention-call arguments that describe documents (after ``cu_seq_lens``, ``position_ids``)."""

MODEL_DOCUMENTS = "distca_model_documents"
"""The keyword argument that carries a model forward's document arguments down to its attention."""


def _packed(found: dict) -> bool:
    """Whether a model call's document arguments describe more than one document in some row."""
    positions, cu_q, cu_k = (found[name] for name in DOCUMENT_ARGUMENTS)
    if cu_q is not None or cu_k is not None:
        return True
    return torch.is_tensor(positions) and positions.shape[-1] > 1 and bool((positions.diff(dim=-1) <= 0).any())


def watch_model_inputs(model: torch.nn.Module, implementation: str) -> None:
    """Before each forward of ``model`` while it uses ``implementation``, add ``MODEL_DOCUMENTS`` to
    its keyword arguments when it was given any document argument (a nested model given its own
    overrides its outer model's), and after it apply the guard (see the module docstring); idempotent
    per model."""
    if getattr(model, "_distca_watches_inputs", False):
        return
    signature = inspect.signature(type(model).forward).parameters
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.values())
    parameters = [p for p in signature if p != "self"]
    open_calls = []  # per forward in progress: (calls without documents before it, packed)

    def before(module, args, kwargs):
        if getattr(module.config, "_attn_implementation", None) != implementation:
            open_calls.append(None)
            return None
        found = {name: kwargs.get(name) for name in DOCUMENT_ARGUMENTS}
        for name, value in zip(parameters, args):  # passed positionally
            if name in found and found[name] is None:
                found[name] = value
        open_calls.append((STATE.calls_without_documents, _packed(found)))
        if not takes_kwargs or all(t is None for t in found.values()):
            return None
        return args, {**kwargs, MODEL_DOCUMENTS: tuple(found[name] for name in DOCUMENT_ARGUMENTS)}

    def after(module, args, kwargs, output=None):
        opened = open_calls.pop() if open_calls else None
        if opened is None or output is None:  # not distca, or the forward raised
            return
        before_count, packed = opened
        if packed and STATE.calls_without_documents > before_count:
            raise UnsupportedAttentionError(
                f"{type(module).__name__} was given packed documents (position_ids that restart, or cu_seq_lens), but "
                f"{STATE.calls_without_documents - before_count} of its attention calls got neither position_ids, "
                "cu_seq_lens nor the model's keyword arguments, so distca could not keep the documents apart; this "
                "model family's layers do not pass them on. Use another attn_implementation for it, or give each "
                "row one document")

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after, with_kwargs=True, always_call=True)
    model._distca_watches_inputs = True


def document_arguments(module: torch.nn.Module, query: torch.Tensor, kwargs: dict):
    """``(position_ids, cu_seq_lens_q, cu_seq_lens_k)`` for one attention call: its own when it got
    any, else those its model's forward was given (``MODEL_DOCUMENTS``, see the module docstring).
    query ``[batch, heads, seq, head_dim]``. A model given packed position_ids (a position that falls)
    that this call cannot use (another shape) raises ``UnsupportedAttentionError`` naming the layer,
    rather than merging its documents."""
    own = tuple(kwargs.get(name) for name in DOCUMENT_ARGUMENTS)
    given = kwargs.get(MODEL_DOCUMENTS)
    if any(t is not None for t in own):
        return own
    if given is None:
        STATE.calls_without_documents += 1
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
