"""The document arguments a model's forward was given, for families whose layers do not hand them
to the attention function.

distca finds a call's documents from the attention call's own arguments (``position_ids``,
``cu_seq_lens_q/k``, the padding mask; ``planning.find_documents``). Most families pass the model's
``position_ids`` down to every attention call, but some decoder layers take ``position_ids`` as a
named argument and drop it: Llama 4 (``Llama4TextDecoderLayer``) builds its masks from them in the
model's forward and calls attention without them, so a packed row looked like one document and its
documents attended to each other without a word (HF's own eager is exact there: its mask carries
the documents). ``cu_seq_lens`` travel in ``**kwargs`` and reach the attention in every family
that passes its kwargs on.

``watch_model_inputs(model)`` (run by ``register()`` for every model that chooses ``"distca"``)
records, around each forward of the model, the ``position_ids`` and ``cu_seq_lens_q/k`` it was
called with; ``document_arguments`` gives an attention call that got none of them the innermost
model's. Calls made outside a model's forward (a pipeline stage calling its layers) see only their
own arguments, as before.
"""

from __future__ import annotations

import inspect

import torch

from ..errors import UnsupportedAttentionError
from ..runtime.timeline import in_backward
from ..state import STATE

__all__ = ["DOCUMENT_ARGUMENTS", "document_arguments", "watch_model_inputs"]

DOCUMENT_ARGUMENTS = ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k")
"""The attention-call arguments that describe documents (after ``cu_seq_lens``, ``position_ids``)."""


def _bound(forward_parameters: list[str], args: tuple, kwargs: dict) -> dict:
    """The document arguments of one model call (by name, or by position when passed positionally)."""
    found = {name: kwargs.get(name) for name in DOCUMENT_ARGUMENTS}
    for name, value in zip(forward_parameters, args):
        if name in found and found[name] is None:
            found[name] = value
    return found


def watch_model_inputs(model: torch.nn.Module, implementation: str) -> None:
    """Record ``model``'s document arguments around each of its forwards while it uses
    ``implementation`` (idempotent per model; forwards of other implementations record nothing)."""
    if getattr(model, "_distca_watches_inputs", False):
        return
    parameters = [p for p in inspect.signature(type(model).forward).parameters if p != "self"]

    def before(module, args, kwargs):
        if getattr(module.config, "_attn_implementation", None) == implementation:
            STATE.model_inputs.append((module, _bound(parameters, args, kwargs)))

    def after(module, args, kwargs, output=None):
        if STATE.model_inputs and STATE.model_inputs[-1][0] is module:
            STATE.model_inputs.pop()

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after, with_kwargs=True, always_call=True)
    model._distca_watches_inputs = True


def document_arguments(module: torch.nn.Module, query: torch.Tensor, kwargs: dict):
    """``(position_ids, cu_seq_lens_q, cu_seq_lens_k)`` for one attention call: its own when it got
    any, else those its model's forward was given (see the module docstring); gradient
    checkpointing's recomputation, which runs after the model's forward, gets what the layer's
    forward got. query ``[batch, heads, seq, head_dim]``. A model given position_ids that describe
    packed documents (a position that falls) which this call cannot use (another shape) raises
    ``UnsupportedAttentionError`` naming the layer, rather than merging its documents."""
    own = tuple(kwargs.get(name) for name in DOCUMENT_ARGUMENTS)
    if any(t is not None for t in own):
        return own
    if not STATE.model_inputs:
        if in_backward():  # recomputation: the layer's forward had the model's arguments
            return getattr(module, "_distca_model_documents", own)
        return own
    model, given = STATE.model_inputs[-1]
    found = _usable(module, model, query, given)
    module._distca_model_documents = found
    return found


def _usable(module, model, query: torch.Tensor, given: dict):
    if given["cu_seq_lens_q"] is not None or given["cu_seq_lens_k"] is not None:
        return None, given["cu_seq_lens_q"], given["cu_seq_lens_k"]
    positions = given["position_ids"]
    if positions is None:
        return None, None, None
    batch_size, query_len = query.shape[0], query.shape[2]
    if (torch.is_tensor(positions) and positions.dim() == 2 and positions.shape[1] == query_len
            and positions.shape[0] in (1, batch_size)):
        return positions, None, None
    if torch.is_tensor(positions) and positions.shape[-1] > 1 and bool((positions.diff(dim=-1) < 0).any()):
        raise UnsupportedAttentionError(
            f"{type(module).__name__} (in {type(model).__name__}) is called without position_ids or cu_seq_lens, so "
            f"distca cannot find the documents of a packed row, and the packed position_ids given to the model "
            f"(shape {tuple(positions.shape)}) do not fit its queries ({batch_size} rows of {query_len}); pass "
            "cu_seq_lens_q/cu_seq_lens_k (DataCollatorWithFlattening(return_flash_attn_kwargs=True)), or use another "
            "attn_implementation")
    return None, None, None
