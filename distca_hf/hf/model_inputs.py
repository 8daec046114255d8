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
adds, before each forward of the model, one more keyword argument, ``MODEL_DOCUMENTS``: a
``ModelForward`` holding the ``position_ids``, ``cu_seq_lens_q``, ``cu_seq_lens_k`` the model was
called with. It travels the way ``cu_seq_lens`` do (model -> decoder layers -> attention module ->
attention function, through their ``**kwargs``), so it also reaches the recomputation of gradient
checkpointing, which calls a layer's ``forward`` again with the keyword arguments it got.
``document_arguments`` gives an attention call that got none of its own these. The same object
also records the forward contexts its attention calls ran in (``ModelForward.contexts``): a
checkpointed layer recomputed in the backward brings it back and runs in its own forward's context,
whatever forwards ran since (``runtime.forward.context_for_call``). A model forward that takes no
``**kwargs`` gets nothing added.

The guard: a model forward given packed documents (``position_ids`` that fall back, or
``cu_seq_lens``) during which some distca attention call saw no document boundary (neither
``cu_seq_lens`` nor ``position_ids`` that restart, its own or its model's: a family whose layers
pass on neither ``position_ids`` nor their ``**kwargs``, or StableLM and Nemotron given
``cu_seq_lens`` alone, whose layers drop their ``**kwargs`` and pass on only the model's running
``position_ids``) raises ``UnsupportedAttentionError`` naming the model when it returns, instead of
returning rows whose documents attended to each other. Packed forwards of decoders
whose positions count along the row whatever ``position_ids`` say (``ROW_POSITION_MODEL_TYPES``: the
Bart family's ``ForCausalLM``) and of recurrent families without ``layer_types``
(``ROW_STATE_MODEL_TYPES``: xLSTM) are refused before they run. Models with Mamba,
linear-attention or convolution layers (``STATEFUL_LAYER_TYPES`` in ``config.layer_types``: Bamba,
Jamba, LFM2, Granite hybrids, ...) are refused before a packed forward: those layers carry state
from one packed document into the next
(HF's own eager merges them too), which no attention function can undo; families whose
linear-attention layers take ``cu_seq_lens`` (``CU_SEQ_LENS_STATEFUL_MODEL_TYPES``: Qwen3-Next,
Qwen3.5, OLMo hybrid) are allowed packed forwards given them.
"""

from __future__ import annotations

import inspect

import torch

from ..errors import UnsupportedAttentionError
from ..state import STATE

__all__ = ["CU_SEQ_LENS_STATEFUL_MODEL_TYPES", "DOCUMENT_ARGUMENTS", "MODEL_DOCUMENTS", "STATEFUL_LAYER_TYPES",
           "ROW_STATE_MODEL_TYPES", "ROW_POSITION_MODEL_TYPES",
           "ModelForward", "document_arguments", "watch_model_inputs"]

DOCUMENT_ARGUMENTS = ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k")
"""The attention-call arguments that describe documents (after ``cu_seq_lens``, ``position_ids``)."""

MODEL_DOCUMENTS = "distca_model_documents"
"""The keyword argument that carries a model forward's ``ModelForward`` down to its attention."""


class ModelForward:
    """One forward of a model, as its attention calls see it (the value of ``MODEL_DOCUMENTS``).

    Attributes:
        position_ids, cu_seq_lens_q, cu_seq_lens_k: the document arguments the model was called with
            (``None`` when not given).
        contexts: the ``runtime.context.ForwardContext`` of each forward its attention calls ran in
            (usually one), filled by ``runtime.forward.context_for_call``; kept alive as long as a
            checkpointed layer's saved keyword arguments hold this object.
    """

    __slots__ = ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "contexts")

    def __init__(self, position_ids=None, cu_seq_lens_q=None, cu_seq_lens_k=None):
        self.position_ids, self.cu_seq_lens_q, self.cu_seq_lens_k = position_ids, cu_seq_lens_q, cu_seq_lens_k
        self.contexts = []

    @property
    def documents(self) -> tuple:
        """``(position_ids, cu_seq_lens_q, cu_seq_lens_k)``, in ``DOCUMENT_ARGUMENTS``' order."""
        return self.position_ids, self.cu_seq_lens_q, self.cu_seq_lens_k


STATEFUL_LAYER_TYPES = ("linear_attention", "conv", "hybrid", "hybrid_sliding")
"""``config.layer_types`` of token mixers that are not attention (Mamba, linear attention, short
convolutions, and layers combining one with attention: transformers' names): they carry state
along a row, across the documents packed in it, whatever the attention implementation."""


def _restarts(positions) -> bool:
    """Whether 2D ``position_ids [batch, seq]`` restart inside a row (a position not one above the one
    before it). Other shapes (multimodal rotary positions ``[3, batch, seq]``, whose image tokens
    repeat and fall back by design) tell nothing about documents."""
    return (torch.is_tensor(positions) and positions.dim() == 2 and positions.shape[-1] > 1
            and bool((positions.diff(dim=-1) <= 0).any()))


def _packed(found: dict, rows: int | None) -> bool:
    """Whether a model call's document arguments put more than one document in some row (``rows``:
    the batch size, when known)."""
    positions, cu_q, cu_k = (found[name] for name in DOCUMENT_ARGUMENTS)
    for cu in (cu_q, cu_k):
        if cu is not None:
            # Malformed cu_seq_lens count as packed, never raise here: this hook runs before the forward's
            # opening collective, where find_documents refuses them on every rank together (one rank
            # raising alone would leave the others waiting for it).
            return (rows is None or not torch.is_tensor(cu) or cu.dim() != 1 or cu.is_floating_point()
                    or cu.is_complex() or cu.numel() - 1 > rows)
    return _restarts(positions)


def _rows(args: tuple, kwargs: dict) -> int | None:
    """The batch size of a model call, from its ``input_ids`` or ``inputs_embeds``."""
    for t in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), *args[:1]):
        if torch.is_tensor(t) and t.dim() >= 2:
            return t.shape[0]
    return None


ROW_STATE_MODEL_TYPES = ("xlstm",)
"""Families whose token mixers carry state along the row but whose configs list no ``layer_types``
(xLSTM: recurrent blocks, no attention at all): refused packed, as ``STATEFUL_LAYER_TYPES``."""

ROW_POSITION_MODEL_TYPES = ("bart", "mbart", "marian", "pegasus", "blenderbot", "blenderbot-small", "plbart")
"""Decoders (their ``...ForCausalLM``) whose learned absolute positions count along the row and
ignore ``position_ids``: every packed document after the first would get the wrong positions,
whatever the attention implementation; refused packed."""

CU_SEQ_LENS_STATEFUL_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen4_exp", "olmo_hybrid")
"""Families whose linear-attention layers (Gated DeltaNet) keep packed documents apart when given
``cu_seq_lens_q`` (transformers 5.24 hands them to flash-linear-attention, and raises without it);
packed forwards of other stateful families are refused whatever they are given."""


def _refuse_what_merges_packed_documents(model: torch.nn.Module, found: dict) -> None:
    """Mamba, linear-attention, convolution and recurrent layers run along the whole row, and some
    decoders' positions count along it: packed documents would reach each other through them, or get
    the wrong positions, which no attention implementation can undo."""
    config = model.config
    model_type = str(getattr(config, "model_type", "")).removesuffix("_text")
    if model_type in ROW_POSITION_MODEL_TYPES:
        raise UnsupportedAttentionError(
            f"{type(model).__name__} takes its positions from the row (learned absolute positions that ignore "
            "position_ids), so every packed document after the first would get the wrong positions, whatever the "
            f"attention; for {type(model).__name__}, give each row one document (pad instead of packing)")
    stateful = sorted({t for t in getattr(config, "layer_types", None) or [] if t in STATEFUL_LAYER_TYPES})
    if not stateful and model_type in ROW_STATE_MODEL_TYPES:
        stateful = ["recurrent"]
    if not stateful:
        return
    if model_type in CU_SEQ_LENS_STATEFUL_MODEL_TYPES:
        if found["cu_seq_lens_q"] is not None:
            return
        hint = ("pass cu_seq_lens_q/cu_seq_lens_k (DataCollatorWithFlattening(return_flash_attn_kwargs=True)), which "
                "its linear-attention layers keep documents apart with (flash-linear-attention installed)")
    else:
        hint = "give each row one document (pad instead of packing)"
    raise UnsupportedAttentionError(
        f"{type(model).__name__} has {'/'.join(repr(t) for t in stateful)} layers (Mamba, linear attention, "
        "convolutions or recurrent blocks: not attention), which carry state along a packed row from one document "
        "into the next; "
        "distca keeps documents apart only in attention layers, so packed documents would not equal each document "
        f"alone. For {type(model).__name__}, {hint}")


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
        packed = _packed(found, _rows(args, kwargs))
        if packed:
            _refuse_what_merges_packed_documents(module, found)
        cu_only = packed and not _restarts(found["position_ids"])  # (packed, so by cu_seq_lens alone)
        open_calls.append((STATE.calls_without_documents, packed, cu_only))
        if not takes_kwargs:
            return None
        return args, {**kwargs, MODEL_DOCUMENTS: ModelForward(*(found[name] for name in DOCUMENT_ARGUMENTS))}

    def after(module, args, kwargs, output=None):
        opened = open_calls.pop() if open_calls else None
        if opened is None or output is None:  # not distca, or the forward raised
            return
        before_count, packed, cu_only = opened
        if packed and STATE.calls_without_documents > before_count:
            fix = ("pass position_ids that restart at 0 at each document (DataCollatorWithFlattening's default) as well"
                   if cu_only else "use another attn_implementation for it, or give each row one document")
            raise UnsupportedAttentionError(
                f"{type(module).__name__} was given packed documents "
                f"({'by cu_seq_lens alone' if cu_only else 'position_ids that restart, or cu_seq_lens'}), but "
                f"{STATE.calls_without_documents - before_count} of its attention calls got neither cu_seq_lens nor "
                "position_ids that restart, their own or in the model's keyword arguments (this model family's "
                f"layers do not pass them on), so distca could not keep the documents apart; {fix}")

    # run as written under torch.compile (they count calls in STATE), as the attention function (attention.py)
    model.register_forward_pre_hook(torch.compiler.disable(before), with_kwargs=True)
    model.register_forward_hook(torch.compiler.disable(after), with_kwargs=True, always_call=True)
    model._distca_watches_inputs = True


def document_arguments(module: torch.nn.Module, query: torch.Tensor, kwargs: dict):
    """``(position_ids, cu_seq_lens_q, cu_seq_lens_k)`` for one attention call: its own when it got
    any, else those its model's forward was given (``MODEL_DOCUMENTS``, see the module docstring).
    query ``[batch, heads, seq, head_dim]``. A model given packed position_ids (2D, restarting) that
    this call cannot use (another row length: the call sees part of the row) raises
    ``UnsupportedAttentionError`` naming the layer, rather than merging its documents. A call whose
    arguments show no document boundary (no ``cu_seq_lens``, no ``position_ids`` that restart) counts
    in ``STATE.calls_without_documents``, which the guard reads (module docstring)."""
    found = _call_documents(module, query, kwargs)
    if found[1] is None and found[2] is None and not _restarts(found[0]):
        STATE.calls_without_documents += 1
    return found


def _call_documents(module: torch.nn.Module, query: torch.Tensor, kwargs: dict):
    """``document_arguments``' choice, before it is counted."""
    own = tuple(kwargs.get(name) for name in DOCUMENT_ARGUMENTS)
    given = kwargs.get(MODEL_DOCUMENTS)
    if any(t is not None for t in own):
        return own
    if given is None or all(t is None for t in given.documents):
        return own
    positions, cu_seq_lens_q, cu_seq_lens_k = given.documents
    if cu_seq_lens_q is not None or cu_seq_lens_k is not None:
        return None, cu_seq_lens_q, cu_seq_lens_k
    batch_size, query_len = query.shape[0], query.shape[2]
    if (torch.is_tensor(positions) and positions.dim() == 2 and positions.shape[1] == query_len
            and positions.shape[0] in (1, batch_size)):
        return positions, None, None
    if _restarts(positions):
        raise UnsupportedAttentionError(
            f"{type(module).__name__} is called without position_ids or cu_seq_lens, so distca cannot find the "
            f"documents of a packed row, and the packed position_ids given to the model (shape "
            f"{tuple(positions.shape)}) do not fit its queries ({batch_size} rows of {query_len}); pass "
            "cu_seq_lens_q/cu_seq_lens_k (DataCollatorWithFlattening(return_flash_attn_kwargs=True)), or use another "
            "attn_implementation")
    return own
