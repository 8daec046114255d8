"""The per-step context: documents, plan and layouts, made once per forward and reused by every
layer and by the backward (gradient checkpointing's recomputation included).

A new step starts at the first attention call of a forward: a call outside a backward pass whose
layer index is not above the previous call's (layers run in increasing order, so the index falls
back when the next forward begins; this also holds for hybrid models and pipeline stages whose
first attention layer is not 0). Other calls reuse the current step when they see the same
``position_ids`` / ``cu_seq_lens`` tensors (HF passes one set to every layer; masks differ per
layer type, so they only count when there are no positions).

Under ``torch.distributed`` with more than one rank in the server group, making a step is a
collective: every rank all-gathers a header (the size of what it sends: its document count, or
for ping-pong its nano-batches' description; -1 if its inputs were invalid;
its path: 0 plain, 1 decoding with a KV cache, 2 ping-pong stack; a fingerprint of its settings) and
its document lengths. So every rank makes the same decision: all raise if one rank's inputs are
invalid, settings differ or only some ranks run the ping-pong stack (``pingpong.plan_pingpong``
sends the same header), all compute locally if one rank decodes with a cache, and otherwise all run
the same plan. ``plan_dispatch`` turns every rank's documents into this rank's ``Dispatch``: one
wave, or the waves of ``overlap="wave"`` (``dispatch.py``).
"""

from __future__ import annotations

import warnings
import zlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from .comm import all_gather_documents
from .config import current_config
from .dispatch import Dispatch, DispatchCounters, build_dispatch
from .documents import PackedDocuments, find_documents
from .planner import DocumentPieces, PlannerConfig, TokenBytes, pairs_of, plan_tasks
from .tasks import FusedBatch, fuse_tasks, whole_document_tasks

__all__ = ["Step", "step_for_call", "plan_stats", "DistCAPeerError"]


class DistCAPeerError(RuntimeError):
    """Another rank could not take part in this step (its own error says why)."""


@dataclass(eq=False)
class Step:
    """What one forward's attention layers share."""

    key: tuple
    inputs: tuple  # the tensors the step was derived from, kept so identity checks are sound
    local: FusedBatch | None  # set when computing locally
    dispatch: Dispatch | None  # set when dispatching to servers
    stats: dict
    number: int
    longest_document: int  # over all ranks of the server group


_current: Step | None = None
_steps_made = 0
_last_layer_idx: int | None = None
_warned_overlap: set[str] = set()


def _in_backward() -> bool:
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


def _identity(tensors: tuple) -> tuple:
    # Inference tensors keep no version counter; they cannot change outside inference mode.
    return tuple(None if t is None else (id(t), 0 if t.is_inference() else t._version) for t in tensors)


def _starts_forward(module) -> bool:
    global _last_layer_idx
    if _in_backward():
        return False
    layer_idx = getattr(module, "layer_idx", None)
    if layer_idx is None:
        return False
    starts = _last_layer_idx is None or layer_idx <= _last_layer_idx
    _last_layer_idx = layer_idx
    return starts


def step_for_call(module, query: torch.Tensor, key: torch.Tensor, attention_mask, position_ids, cu_seq_lens_q,
                  cu_seq_lens_k) -> Step:
    """The step this attention call belongs to (made now if the call starts a forward)."""
    global _current
    batch_size, num_heads, query_len, head_dim = query.shape
    kv_len, num_kv_heads = key.shape[2], key.shape[1]
    # The mask identifies the documents only when nothing else does (it is a new view per layer type).
    identifying = (position_ids, cu_seq_lens_q, cu_seq_lens_k)
    if all(t is None for t in identifying):
        identifying = (attention_mask,)
    call_key = ((batch_size, query_len, kv_len, num_heads, num_kv_heads, head_dim, query.dtype, query.device),
                _identity(identifying))
    new_forward = _starts_forward(module)
    current = _current
    if (not new_forward and current is not None and current.key == call_key
            and all(a is b for a, b in zip(current.inputs, identifying))):
        return current

    config = current_config()
    group = config.group
    number = next_step_number()
    distributed = config.mode == "distca" and dist.is_available() and dist.is_initialized() \
        and dist.get_world_size(group) > 1
    if not distributed:
        docs = find_documents(batch_size, query_len, kv_len, attention_mask=attention_mask,
                              position_ids=position_ids, cu_seq_lens_q=cu_seq_lens_q, cu_seq_lens_k=cu_seq_lens_k)
        _current = _local_step(call_key, identifying, docs, query.device, number, int(docs.lengths.max(initial=0)))
        return _current

    error, docs = None, None
    try:
        docs = find_documents(batch_size, query_len, kv_len, attention_mask=attention_mask,
                              position_ids=position_ids, cu_seq_lens_q=cu_seq_lens_q, cu_seq_lens_k=cu_seq_lens_k)
    except ValueError as e:  # still join the collective, so the other ranks learn of it
        error = e
    lengths = docs.lengths if docs is not None else np.zeros(0, dtype=np.int64)
    headers, per_rank = agree(lengths, int(kv_len != query_len), error, config, query.device, number, "planning")
    longest = int(max((x.max(initial=0) for x in per_rank), default=0))
    if any(h[1] == 1 for h in headers):  # someone decodes with a KV cache: everyone computes locally
        _current = _local_step(call_key, identifying, docs, query.device, number, longest)
        return _current
    overlap = config.overlap
    if overlap == "pingpong":  # reached only when the model's decoder stack is not ping-pong patched
        overlap = "wave"
        if type(module).__name__ not in _warned_overlap:
            _warned_overlap.add(type(module).__name__)
            warnings.warn(f"distca: DISTCA_OVERLAP=pingpong needs a ping-pong patched decoder stack (Llama, Mistral, "
                          f"Qwen2, Qwen3 in training, see distca_hf.patches); {type(module).__name__} runs with "
                          "overlap='wave' instead")
    token_bytes = TokenBytes.for_model(num_heads * head_dim, num_heads, num_kv_heads, query.element_size(), head_dim)
    dispatch, stats = plan_dispatch(docs, per_rank, [np.zeros_like(x) for x in per_rank], config, group, token_bytes,
                                    query.device, number, num_heads, overlap)
    _current = Step(call_key, identifying, None, dispatch, stats, number, longest)
    return _current


def next_step_number() -> int:
    global _steps_made
    _steps_made += 1
    return _steps_made


def agree(payload: np.ndarray, path: int, error: Exception | None, config, device, number: int, what: str):
    """The collective that starts a step: every rank of the server group all-gathers its header
    (payload size or -1 when ``error``, its path, its settings fingerprint) and its int64
    ``payload``. Raises this rank's own ``error``, or on every rank the same ``check_headers``
    error; else returns ``(headers, payloads)`` in rank order."""
    header = [-1 if error else payload.size, path, settings_fingerprint(config)]
    gather_device = device if dist.get_backend(config.group) == "nccl" else torch.device("cpu")
    headers, payloads = all_gather_documents(header, payload, config.group, gather_device, config.timeout_s,
                                             f"distca step {number}: {what}")
    if error is not None:
        raise error
    check_headers(headers, number)
    return headers, payloads


def settings_fingerprint(config) -> int:
    """Ranks must plan with the same settings; they compare this number."""
    return zlib.crc32(repr((config.tolerance, config.block, config.servers, config.backward, config.overlap)).encode())


def check_headers(headers, number: int) -> None:
    """Raise the same error on every rank when a rank could not describe its documents, when the
    settings differ, or when some ranks run the ping-pong stack (header path 2) and others not.
    Header: ``(payload size or -1, path: 0 plain / 1 KV cache / 2 ping-pong, settings fingerprint)``."""
    failed = [r for r, h in enumerate(headers) if h[0] < 0]
    if failed:
        raise DistCAPeerError(f"distca step {number}: rank(s) {failed} could not describe their documents (see "
                              "their error); every rank stops this step")
    if len({h[2] for h in headers}) > 1:
        raise ValueError(f"distca step {number}: ranks use different settings (tolerance, block, servers, backward "
                         "or overlap); set the same DISTCA_* variables / configure() on every rank")
    pingpong = [r for r, h in enumerate(headers) if h[1] == 2]
    if pingpong and len(pingpong) != len(headers):
        others = [r for r, h in enumerate(headers) if h[1] != 2]
        raise DistCAPeerError(
            f"distca step {number}: rank(s) {pingpong} run the ping-pong decoder stack but rank(s) {others} do not "
            "(they pass a KV cache or ask for hidden states / attentions, which ping-pong does not produce); every "
            "rank must run the same kind of forward")


def set_current(step: Step) -> None:
    global _current
    _current = step


def _local_step(call_key, inputs, docs: PackedDocuments, device, number: int, longest: int) -> Step:
    if docs.num_docs == 0:
        raise ValueError("distca: the batch holds no real tokens (the attention_mask is all padding)")
    pairs = int(pairs_of(docs.past, docs.lengths).sum())
    stats = {"attn_pairs_local": [pairs], "attn_pairs_served": [pairs], "bytes_sent_per_layer": 0,
             "step": number, "dispatched": False}
    return Step(call_key, inputs, fuse_tasks(whole_document_tasks(docs), docs).to(device), None, stats, number, longest)


def plan_dispatch(docs: PackedDocuments, per_rank_lengths, per_rank_past, config, group, token_bytes: TokenBytes,
                  device, number: int, num_heads: int, overlap: str, counters: DispatchCounters | None = None):
    """Plan one micro- (or nano-) batch from every rank's documents and build this rank's dispatch.

    ``per_rank_lengths[r]`` / ``per_rank_past[r]``: K/V length and leading key-only tokens of each of
    rank ``r``'s documents (``past`` is non-zero only for a ping-pong nano-batch's cut document).
    Returns ``(dispatch, stats)``.
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    counts = np.array([len(x) for x in per_rank_lengths], dtype=np.int64)
    doc_offset = np.concatenate(([0], np.cumsum(counts)))
    empty = np.zeros(0, dtype=np.int64)
    lengths = np.concatenate(per_rank_lengths) if counts.sum() else empty
    past = np.concatenate(per_rank_past) if counts.sum() else empty
    pieces = DocumentPieces(np.repeat(np.arange(world), counts), np.arange(lengths.size), past, lengths, world,
                            kv_start=np.zeros_like(lengths))
    servers = config.servers
    if servers is not None and max(servers) >= world:
        raise ValueError(f"distca servers {servers} name ranks outside the server group of {world} ranks")
    plan = plan_tasks(pieces, PlannerConfig(config.tolerance, config.block, servers, token_bytes))
    dispatch = build_dispatch(plan, pieces, doc_offset, docs, rank, device, overlap=overlap, counters=counters,
                              block=config.block, group=group, timeout_s=config.timeout_s, backward_mode=config.backward, step=number)
    # queries out and outputs back per the plan; K/V as the waves really send them
    moved = plan.moved_queries()
    sent = moved * (token_bytes.q + token_bytes.o) + dispatch.kv_tokens_moved * token_bytes.kv
    # in resend mode the forward also returns each moved query's log-sum-exp (fp32, one per head)
    lse_bytes = moved * num_heads * 4 if config.backward == "resend" else 0
    stats = {
        "attn_pairs_local": pieces.local_pairs().tolist(),
        "attn_pairs_served": plan.server_pairs().tolist(),
        "bytes_sent_per_layer": int(sent + lse_bytes),
        "step": number,
        "dispatched": True,
        "backward": config.backward,
        "overlap": overlap,
        "waves": len(dispatch.waves),
        "tasks": plan.num_tasks,
        "moved_query_fraction": plan.moved_queries() / max(1, int((lengths - past).sum())),
    }
    return dispatch, stats


def plan_stats() -> dict:
    """About the last plan on this rank (contract): ``attn_pairs_local`` (per rank, colocated),
    ``attn_pairs_served`` (per rank, under the plan), ``bytes_sent_per_layer`` (all ranks, one
    layer's forward); plus ``step``, ``dispatched``, and for dispatched plans ``backward``, ``tasks``,
    ``moved_query_fraction`` and this rank's running totals for the step so far
    (``rank_bytes_sent_this_step`` by collective kind, ``rank_saved_for_backward_bytes``)."""
    if _current is None:
        raise RuntimeError("distca_hf.plan_stats(): no forward has run with attn_implementation='distca' yet")
    stats = dict(_current.stats)
    if _current.dispatch is not None:  # running totals of this step on this rank
        stats["rank_bytes_sent_this_step"] = dict(_current.dispatch.counters.bytes_sent)
        stats["rank_saved_for_backward_bytes"] = _current.dispatch.counters.saved_bytes
    return stats
