"""Opening a forward: the first attention call of a forward finds its documents, agrees with the
other ranks, plans, and makes the ``ForwardContext`` every later call reuses.

A new forward starts at an attention call outside a backward pass whose layer index is not above
the previous call's (layers run in increasing order, so the index falls back when the next forward
begins; this also holds for hybrid models and pipeline stages whose first attention layer is not
0). Other calls reuse the current context when they see the same ``position_ids`` /
``cu_seq_lens`` tensors and one of its attention masks (HF passes one set of positions to every
layer). The mask counts even beside positions: two forwards may share one ``position_ids`` tensor
and differ only in padding. HF makes one mask per layer type (a new tensor each), so during a
forward a mask of equal content joins the context (``_same_documents``).

A checkpointed layer recomputed in the backward must run in its own forward's context, not the last
forward's. The model's forward hook (``hf.model_inputs``) gives every attention call of one model
forward the same list, ``model_contexts``, which travels in the layers' keyword arguments, so the
recomputation brings it back: it takes the context recorded there, on every rank alike, with no
collective and whatever ran since. A call without that list (a model forward that takes no
``**kwargs``, a layer called directly) falls back on the rule above, where in a backward only a mask
the context already holds matches; HF passes no mask (``None``) for rows without padding, and
``None`` matches ``None``, so there two forwards sharing one ``position_ids`` tensor, then one
backward recomputing checkpointed layers, with padding on some ranks only, stop every rank with
``DistCATimeoutError`` (not a wrong answer): give each forward its own ``position_ids`` tensor.

Under ``torch.distributed`` with more than one rank in the server group, opening a forward is a
collective (``agree``): all raise if one rank's inputs are invalid or settings differ, and
otherwise all run the same plan. ``plan_batch`` turns every rank's documents into this rank's
``Dispatch`` and the plan's ``BatchPlan``; with its default planner it is a collective too
(``shared_planning``: the ranks plan ``tolerance="auto"``'s candidates each their own), so every rank
of the server group calls it together.

A forward that decodes is not a collective: one whose keys go beyond its queries (a KV cache holds
earlier tokens), or one opened while ``decoding()`` (``generate()``, a model forward given a cache:
``hf.decoding`` marks them) computes every document on its own rank. No other rank is needed (a
cache's keys could not be dispatched anyway), so generating on some ranks only just works.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import numpy as np
import torch
import torch.distributed as dist

from ..config import DistCAConfig, block_for_device, current_config
from ..planning import (DocumentBoundaryError, DocumentPieces, FusedBatch, PackedDocuments, PlannerConfig,
                        RankDocuments, TokenBytes, colocated_plan, find_documents, fuse_tasks, kv_transfers,
                        resolve_time_model, stitch_rank_documents, whole_document_tasks)
from ..planning.documents import check_positions_agree
from ..state import STATE, warn_once
from .agree import PATH_PLAIN, agree, attention_signature
from .context import (BatchPlan, ForwardContext, begin_forward, current_forward, next_forward_number, pinned_context,
                      plan_stats_of, planned_windows)
from .dispatch import Dispatch, build_dispatch
from .processes import refuse_accelerate_alone, warn_if_fsdp_dropped, warn_if_launched_alone
from .shared_planning import plan_across_ranks
from .tables import DispatchCounters, LocalDocuments
from .timeline import in_backward

__all__ = ["CallInputs", "context_for_call", "layer_window", "plan_batch", "distributed_group_size", "begin_decoding", "end_decoding",
           "decoding", "is_decoding"]


def distributed_group_size(config: DistCAConfig) -> int:
    """Ranks of the server group that take part in a forward's collectives (1: compute locally).
    ``mode="colocated"`` computes every rank's own queries where they are, which needs no other rank
    unless documents span ranks (their later pieces need the K/V prefix held by earlier ranks)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    if config.mode != "distca" and not config.span_ranks:
        return 1
    return dist.get_world_size(config.group)


def begin_decoding(owner) -> None:
    """``owner`` (a ``generate()`` call, a model forward given a KV cache) decodes until
    ``end_decoding(owner)``: forwards opened meanwhile compute on this rank alone."""
    STATE.decoding.append(owner)


def end_decoding(owner) -> None:
    """End ``owner``'s decoding, when it is the innermost one (else nothing: it never began)."""
    if STATE.decoding and STATE.decoding[-1] is owner:
        STATE.decoding.pop()


@contextlib.contextmanager
def decoding(owner):
    """``begin_decoding(owner)`` ... ``end_decoding(owner)``, an exception included."""
    begin_decoding(owner)
    try:
        yield
    finally:
        end_decoding(owner)


def is_decoding() -> bool:
    """Whether something decodes in this process now (see ``begin_decoding``)."""
    return bool(STATE.decoding)


def _identity(tensors: tuple) -> tuple:
    # Inference tensors keep no version counter; they cannot change outside inference mode. A
    # non-tensor (a list) is refused when the forward opens (planning.find_documents).
    return tuple(None if t is None else (id(t), 0 if not torch.is_tensor(t) or t.is_inference() else t._version)
                 for t in tensors)


def _starts_forward(module) -> bool:
    if in_backward():
        return False
    layer_idx = getattr(module, "layer_idx", None)
    if layer_idx is None:
        return False
    starts = STATE.last_layer_idx is None or layer_idx <= STATE.last_layer_idx
    STATE.last_layer_idx = layer_idx
    return starts


def context_for_call(module, query: torch.Tensor, key: torch.Tensor, attention_mask, position_ids, cu_seq_lens_q,
                     cu_seq_lens_k, *, kv_window: int | None = None, value_head_dim: int | None = None,
                     model_contexts: list | None = None, sliding_window: int | None = None) -> ForwardContext:
    """The context of the forward this attention call belongs to (made now if the call opens one).
    query ``[batch, heads, seq, head_dim]``, key ``[batch, kv_heads, kv_len, head_dim]``;
    ``kv_window``: the widest sliding window of the model's layers (``None`` when a layer attends to
    whole prefixes), which a dispatch's CA-tasks cut their K/V to; ``value_head_dim``: the values'
    head dim when it is not ``head_dim`` (DeepSeek's MLA), for the bytes a plan moves;
    ``model_contexts``: the contexts of the model forward this call is part of
    (``hf.model_inputs.ModelForward.contexts``, the same list when a checkpointed layer is
    recomputed): filled in a forward, and in a backward the recomputation runs in the one it holds;
    ``sliding_window``: the window of the sliding layers of a model that mixes them with full ones
    (``hf.mixed_sliding_window``), planned on their own (``ForwardContext.for_window``)."""
    batch_size, num_heads, query_len, head_dim = query.shape
    kv_len, num_kv_heads = key.shape[2], key.shape[1]
    pinned = pinned_context()
    if pinned is not None:
        return _check_pinned(pinned, module, batch_size * query_len, batch_size * kv_len)
    identifying = (position_ids, cu_seq_lens_q, cu_seq_lens_k)
    call_key = ((batch_size, query_len, kv_len, num_heads, num_kv_heads, head_dim, query.dtype, query.device),
                _identity(identifying))
    if model_contexts is not None and in_backward():
        for context in model_contexts:  # recomputed: its own forward's context, whatever ran since
            if _same_inputs(context, call_key, identifying):
                return context
    new_forward = _starts_forward(module)
    current = current_forward()
    if not new_forward and _same_documents(current, call_key, identifying, attention_mask):
        return _joined(current, model_contexts)

    call = CallInputs(batch_size, query_len, kv_len, attention_mask, position_ids, cu_seq_lens_q, cu_seq_lens_k)
    context = _open_forward(module, query, key, call, call_key, identifying, kv_window, value_head_dim or head_dim,
                            sliding_window)
    context.masks.append(_mask_entry(attention_mask))
    return _joined(begin_forward(context), model_contexts)


def _joined(context: ForwardContext, model_contexts: list | None) -> ForwardContext:
    """``context``, recorded among its model forward's (outside a backward: a recomputation reuses)."""
    if model_contexts is not None and not in_backward() and not any(c is context for c in model_contexts):
        model_contexts.append(context)
    return context


def _mask_entry(mask) -> tuple:
    """A mask as a context keeps it: the tensor (kept alive, so its ``id`` is not reused) and its version."""
    return mask, _identity((mask,))[0]


def _same_inputs(context: ForwardContext, call_key, identifying: tuple) -> bool:
    """Whether a call has ``context``'s shapes and its very ``position_ids`` / ``cu_seq_lens`` tensors, unchanged."""
    return context.key == call_key and all(a is b for a, b in zip(context.inputs, identifying))


def _same_documents(current: ForwardContext | None, call_key, identifying: tuple, mask) -> bool:
    """Whether a call that does not start a forward belongs to ``current``: same shapes, the same
    ``position_ids`` / ``cu_seq_lens`` tensors, unchanged, and a mask the context holds. During a
    forward a mask of equal content is adopted (HF's mask per layer type; it describes the same
    documents). In a backward it is not: the recomputation of an earlier forward that shares the
    positions would otherwise run on this forward's documents when the masks happen to agree on this
    rank only (``None`` masks aside: module docstring)."""
    if current is None or not _same_inputs(current, call_key, identifying):
        return False
    entry = _mask_entry(mask)
    if any(m is mask and version == entry[1] for m, version in current.masks):
        return True
    if in_backward() or not current.masks or not _equal_masks(current.masks[0][0], mask):
        return False
    current.masks.append(entry)
    return True


def _equal_masks(known, mask) -> bool:
    if known is None or mask is None:
        return known is mask
    return (torch.is_tensor(known) and torch.is_tensor(mask) and known.shape == mask.shape
            and known.dtype == mask.dtype and known.device == mask.device and torch.equal(known, mask))


def _check_pinned(context: ForwardContext, module, query_rows: int, key_rows: int) -> ForwardContext:
    """A call inside ``pinned_forward``: its rows must be the ones the pinned plan was made for."""
    planned = context.dispatch.waves[0] if context.dispatch is not None else None
    if planned is not None and (planned.num_local, planned.num_local_kv) != (query_rows, key_rows):
        raise ValueError(
            f"distca forward {context.number}: {type(module).__name__} layer {getattr(module, 'layer_idx', '?')} "
            f"attends {query_rows} query / {key_rows} key tokens, but the plan pinned for this pipeline tick was made "
            f"for {planned.num_local} / {planned.num_local_kv}; a stage must run the micro-batch it was planned for")
    return context


def _open_forward(module, query, key, call: "CallInputs", call_key, inputs, kv_window: int | None,
                  value_head_dim: int, sliding_window: int | None = None) -> ForwardContext:
    """Find the documents, agree with the other ranks of the server group (a collective when there
    are any) and plan: once, or for a model mixing sliding and full layers (``sliding_window``) once
    for each kind, in that order on every rank (each plan may be a collective)."""
    config = current_config()
    number = next_forward_number()
    group_size = distributed_group_size(config)
    # Decoding needs no other rank (see the module docstring); they may not be running this forward.
    decodes = key.shape[2] != query.shape[2] or is_decoding()
    if group_size == 1 or decodes:
        if not (dist.is_available() and dist.is_initialized()):
            warn_if_launched_alone()
        docs = call.documents()
        if group_size > 1 and config.span_ranks:
            _refuse_continuations(call, docs, number)
        return _local_context(number, call_key, inputs, docs, query.device, int(docs.lengths.max(initial=0)))
    warn_if_fsdp_dropped(module)
    refuse_accelerate_alone(dist.get_world_size())
    docs, first_position, error = call.describe(span_ranks=config.span_ranks)
    lengths = docs.lengths if docs is not None else np.zeros(0, dtype=np.int64)
    signature = attention_signature(query.dtype, query.shape[1], key.shape[1], query.shape[3], value_head_dim,
                                    torch.is_grad_enabled(), kv_window=kv_window, sliding_window=sliding_window)
    _, gathered = agree(np.concatenate(([first_position], lengths)), PATH_PLAIN, error, config, query.device,
                        number, "planning", signature=signature)
    per_rank, first_positions = [x[1:] for x in gathered], [int(x[0]) for x in gathered]
    ranks = stitch_rank_documents(per_rank, [np.zeros_like(x) for x in per_rank], first_positions,
                                  span_ranks=config.span_ranks)
    _, num_heads, _, head_dim = query.shape
    element = query.element_size()  # q and k carry head_dim per head, v and the output value_head_dim
    token_bytes = TokenBytes(q=num_heads * head_dim * element, kv=key.shape[1] * (head_dim + value_head_dim) * element,
                             o=num_heads * value_head_dim * element, lse=4 * num_heads)
    overlap = _overlap_of(module, config) if config.mode == "distca" else "none"
    counters = DispatchCounters()  # (one forward's bytes, whichever of its plans sent them)
    contexts = []
    for window in planned_windows(kv_window, sliding_window):
        dispatch, planned = plan_batch(docs, ranks, config, token_bytes, query.device, number, overlap,
                                       counters=counters, kv_window=window, dtype_bytes=query.element_size(),
                                       local_when_colocated=True, key_split=tiles_hold_for(module))
        if dispatch is None:  # the plan moves nothing: every rank computes its own documents, as colocated does
            context = _local_context(number, call_key, inputs, docs, query.device, ranks.longest_document, planned,
                                     local=contexts[0].local if contexts else None)
        else:
            stats = plan_stats_of(number, [planned], token_bytes=token_bytes, num_heads=num_heads, overlap=overlap)
            context = ForwardContext(number, call_key, inputs, ranks.longest_document, stats, dispatch=dispatch,
                                     counters=counters)
        contexts.append(context)
    main = contexts[0]
    if len(contexts) > 1:
        main.sliding = {sliding_window: contexts[1]}
        main.stats = main.stats.with_sliding_layers(sliding_window, contexts[1].stats)
        if contexts[1].dispatch is not None:  # (plan_stats() reports the bytes of a forward that dispatched)
            main.counters = counters
    return main


def _refuse_continuations(call: "CallInputs", docs: PackedDocuments, number: int) -> None:
    """A decoding forward under ``span_ranks=True``: a row whose first document starts at position
    ``p > 0`` with no cached keys would continue a document of the previous rank, whose prefix this
    rank alone cannot reach; refuse it rather than compute it as a chunk."""
    batch_size, query_len, kv_len = call.shape
    if kv_len != query_len or call.position_ids is None or docs.num_docs == 0:
        return  # with cached keys each row is one document whose earlier tokens are in the cache
    positions = call.position_ids.expand(batch_size, query_len).reshape(-1).detach().cpu().numpy()
    starts = np.sort(docs.q_starts)
    rows, first = np.unique(starts // query_len, return_index=True)
    continuing = [(int(r), int(p)) for r, p in zip(rows, positions[starts[first]]) if p > 0]
    if continuing:
        row, position = continuing[0]
        raise DocumentBoundaryError(
            f"distca forward {number}: row {row} starts at position_ids {position} > 0, which with span_ranks=True "
            "continues a document of the previous rank; this forward decodes (generate(), or a KV cache), so it runs "
            "on this rank alone and cannot reach that prefix. Give the row its whole document, or set "
            "span_ranks=False (DISTCA_SPAN_RANKS=0) to run it as a chunk that attends to itself")


def _overlap_of(module, config: DistCAConfig) -> str:
    """The overlap this attention function runs: ``pingpong`` reaches it only when the model's
    decoder stack is not ping-pong patched, and then runs ``wave``."""
    if config.overlap != "pingpong":
        return config.overlap
    name = type(module).__name__
    warn_once(f"pingpong-fallback:{name}",
              f"distca: DISTCA_OVERLAP=pingpong needs a ping-pong patched decoder stack (Llama, Mistral, Qwen2, Qwen3 "
              f"in training, see distca_hf.patches); {name} runs with overlap='wave' instead", stacklevel=6)
    return "wave"


class CallInputs:
    """The arguments of one attention call that describe its documents."""

    def __init__(self, batch_size, query_len, kv_len, attention_mask, position_ids, cu_seq_lens_q, cu_seq_lens_k):
        self.shape = (batch_size, query_len, kv_len)
        self.attention_mask, self.position_ids = attention_mask, position_ids
        self.cu_seq_lens = (cu_seq_lens_q, cu_seq_lens_k)

    def documents(self) -> PackedDocuments:
        return find_documents(*self.shape, attention_mask=self.attention_mask, position_ids=self.position_ids,
                              cu_seq_lens_q=self.cu_seq_lens[0], cu_seq_lens_k=self.cu_seq_lens[1])

    def describe(self, *, span_ranks: bool):
        """``(docs, first_position, error)`` for the opening collective: an invalid input is returned
        as ``error`` (not raised) so that this rank still joins and every rank stops together."""
        try:
            docs = self.documents()
            return docs, (self.first_position(docs) if span_ranks else 0), None
        except Exception as e:  # (any: a TypeError raised here alone would leave the others waiting)
            return None, 0, e

    def first_position(self, docs: PackedDocuments) -> int:
        """With span_ranks: the position of the row's first real token (> 0: the row continues the
        previous rank's last document). Checks the one-row rule and that cu_seq_lens agree with
        position_ids."""
        batch_size, query_len, kv_len = self.shape
        if batch_size != 1:
            raise DocumentBoundaryError(
                f"span_ranks=True takes one packed row per rank (a rank's piece of the global token stream), got a "
                f"batch of {batch_size} rows; pack the rows into one, or set span_ranks=False (DISTCA_SPAN_RANKS=0)")
        if self.position_ids is None or docs.num_docs == 0:
            return 0
        if any(c is not None for c in self.cu_seq_lens):
            check_positions_agree(docs, self.position_ids, batch_size, query_len, exact=True)
        positions = self.position_ids.reshape(-1)
        return int(positions[int(docs.q_starts[0])])


def _local_context(number: int, call_key, inputs, docs: PackedDocuments, device, longest: int,
                   planned: BatchPlan | None = None, local: FusedBatch | None = None) -> ForwardContext:
    """This rank computes its own documents (one process, colocated mode, decoding, or a plan that
    moves nothing: ``planned``, every rank's batch as planned, for the stats); ``local``: their fused
    batch when already made (another plan of the same forward)."""
    if docs.num_docs == 0:
        raise ValueError("distca: the batch holds no real tokens (the attention_mask is all padding)")
    if planned is None:
        pieces = DocumentPieces(np.zeros(docs.num_docs, dtype=np.int64), np.arange(docs.num_docs), docs.past,
                                docs.lengths, 1, kv_start=np.zeros(docs.num_docs, dtype=np.int64))
        planned = BatchPlan(pieces)
    stats = plan_stats_of(number, [planned])
    return ForwardContext(number, call_key, inputs, longest, stats,
                          local=local if local is not None else fuse_tasks(whole_document_tasks(docs), docs).to(device))


EXPOSED_COMM = {"none": 1.0, "wave": 0.5, "pingpong": 0.5}
"""Fraction of the dispatch's communication time ``tolerance="auto"`` counts as not hidden, per
overlap mode: all of it without overlap; half with ``wave`` or ``pingpong`` (a conservative guess
below the overlap fractions ``distca-hf bench --overlap`` measures)."""


def layer_window(module) -> int | None:
    """The sliding window (keys per query, HF's ``sliding_window``) of an HF attention ``module``'s layer,
    ``None`` for whole prefixes: ``module.sliding_window`` where the module has one (Mistral, Qwen2,
    Gemma 2/3; Qwen2-MoE on its sliding layers only), else ``config.sliding_window`` when
    ``config.layer_types`` calls the layer ``"sliding_attention"`` or lists no types (PhiMoE: its mask
    windows every layer), as ``hf.widest_window`` reads the config. Families such as PhiMoE and
    Qwen2-MoE never hand ``sliding_window=`` to the attention interface: their eager windows through the
    mask (``create_sliding_window_causal_mask``), which distca replaces, so the window is read here."""
    window = getattr(module, "sliding_window", None)
    if window is not None or hasattr(module, "sliding_window"):
        return int(window) if window else None
    config = getattr(module, "config", None)
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    index = getattr(module, "layer_idx", None)
    if layer_types and (index is None or index >= len(layer_types) or layer_types[index] != "sliding_attention"):
        return None
    return int(window)


def tiles_hold_for(module) -> bool:
    """Whether key-split tiles are exact for every attention layer of ``module``'s model: all layers of
    one type (one window: the plan's ``kv_window``) and none chunked (``phases.check_layer_window``
    refuses a key-split plan for a layer with another window or chunks; this keeps the planner from
    making one)."""
    layer_types = getattr(getattr(module, "config", None), "layer_types", None) or ()
    return len(set(layer_types)) <= 1 and "chunked_attention" not in layer_types


def plan_batch(docs: PackedDocuments, ranks: RankDocuments, config: DistCAConfig, token_bytes: TokenBytes, device,
               number: int, overlap: str, counters: DispatchCounters | None = None, *,
               kv_window: int | None = None, dtype_bytes: int | None = None,
               local_when_colocated: bool = False, planning_overlap: str | None = None, planner=None,
               key_split: bool = False) -> tuple[Dispatch | None, BatchPlan]:
    """Plan one micro- (or nano-) batch from every rank's documents (``ranks``, stitched across
    ranks) and build this rank's dispatch; ``docs`` are this rank's own; ``kv_window``: see
    ``context_for_call``; ``dtype_bytes``: bytes of an attention element (default: 2 on CUDA, 4
    elsewhere), to carry the built-in time model to the model's widths. ``local_when_colocated``: when
    the plan moves no query and no K/V (``tolerance="auto"`` on a step it cannot speed up), return no
    dispatch and a ``BatchPlan`` without plan: the caller computes this rank's documents itself (no
    dispatch to build, no per-layer exchange), as ``mode="colocated"`` does; ``docs`` must then hold a
    real token. ``planning_overlap``: the overlap whose exposure ``"auto"`` plans with, when it is not
    the dispatch's own ``overlap`` (ping-pong's nano-batches dispatch without waves). ``planner``:
    ``None``: ``planning.plan_tasks``, planned across the ranks (``shared_planning.plan_across_ranks``:
    collectives under ``tolerance="auto"`` and ``kv_relays="auto"`` on 3 ranks or more, so every rank
    of ``config.group`` calls it together); else ``(pieces, PlannerConfig) -> Plan``, run by each rank
    (a ``cad_1f1b`` tick: ``planning.plan_lockstep_tick``).
    ``key_split``: ``tolerance="auto"`` may weigh key-split tiles (``PlannerConfig.key_split``), for
    models whose every layer runs ``kv_window`` and no attention chunks (``tiles_hold_for``; a
    ``cad_1f1b`` tick: ``LockstepCAD1F1B._tiles_hold``)."""
    group = config.group
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    servers = config.servers
    if servers is not None and max(servers) >= world:
        raise ValueError(f"distca servers {servers} name ranks outside the server group of {world} ranks")
    pieces = ranks.pieces
    device = torch.device(device)
    block = block_for_device(config.block, device.type)
    planning_started = time.perf_counter()
    if config.mode == "colocated":  # every rank computes its own queries; only spanning prefixes travel
        plan = dataclasses.replace(colocated_plan(pieces, window=kv_window), backward=config.backward)
    else:
        dtype_bytes = dtype_bytes or (2 if device.type == "cuda" else 4)
        time_model = resolve_time_model(config.time_model, device.type, token_bytes, dtype_bytes)
        planning = PlannerConfig(config.tolerance, block, servers, token_bytes, window=kv_window,
                                 time_model=time_model, exposed_comm=EXPOSED_COMM[planning_overlap or overlap],
                                 backward=config.backward, memory_budget=config.memory_budget,
                                 key_split=key_split, kv_cap=config.kv_cap, kv_relays=config.kv_relays)
        if planner is None:  # plan_tasks, its candidates planned on different ranks at once
            plan = plan_across_ranks(pieces, planning, group=group, device=device, timeout_s=config.timeout_s,
                                     what=f"distca forward {number}")
        else:
            plan = planner(pieces, planning)
    plan_seconds = time.perf_counter() - planning_started
    if (local_when_colocated and docs.num_docs and plan.moved_queries() == 0
            and kv_transfers(plan, pieces).tokens() == 0):
        return None, BatchPlan(pieces, window=plan.window, plan_seconds=plan_seconds)
    local = LocalDocuments(docs, ranks.global_ids[rank], ranks.offsets[rank])
    dispatch = build_dispatch(plan, pieces, local, rank, device, overlap=overlap, counters=counters,
                              block=block, group=group, timeout_s=config.timeout_s,
                              backward_mode=plan.backward, forward_number=number)
    return dispatch, BatchPlan(pieces, plan, dispatch.kv_received, len(dispatch.waves),
                               queries_sent=dispatch.queries_sent, kv_kept=dispatch.kv_kept,
                               kv_rounds=dispatch.kv_rounds, plan_seconds=plan_seconds)
