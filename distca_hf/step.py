"""The per-step context: documents, plan and layouts, made once per forward and reused by every
layer and by the backward (gradient checkpointing's recomputation included).

A new step starts when the first attention layer (``layer_idx == 0``) is called outside a backward
pass; otherwise a call whose inputs are the very same tensors (same objects, unchanged) reuses the
current step. Under ``torch.distributed`` with more than one rank in the server group, making a
step all-gathers every rank's document lengths, runs the planner (identical on every rank) and
builds this rank's dispatch layout; with one rank, a KV cache or ``mode="colocated"``, each rank
computes its own documents locally.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from .comm import all_gather_lengths
from .config import current_config
from .dispatch import DispatchLayout, build_dispatch_layout
from .documents import PackedDocuments, find_documents
from .layout import comm_bytes, kv_transfers
from .planner import DocumentPieces, PlannerConfig, TokenBytes, pairs_of, plan_tasks
from .tasks import FusedBatch, fuse_tasks, whole_document_tasks

__all__ = ["Step", "step_for_call", "plan_stats"]


@dataclass(eq=False)
class Step:
    """What one forward's attention layers share."""

    key: tuple
    inputs: tuple  # the tensors the step was derived from, kept so identity checks are sound
    docs: PackedDocuments
    local: FusedBatch | None  # set when computing locally
    dispatch: DispatchLayout | None  # set when dispatching to servers
    stats: dict
    number: int


_current: Step | None = None
_steps_made = 0


def _in_backward() -> bool:
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


def _key(shape: tuple, tensors: tuple) -> tuple:
    # Inference tensors keep no version counter; they cannot change outside inference mode.
    return (shape, tuple(None if t is None else (id(t), 0 if t.is_inference() else t._version) for t in tensors))


def step_for_call(module, query: torch.Tensor, key: torch.Tensor, attention_mask, position_ids, cu_seq_lens_q,
                  cu_seq_lens_k) -> Step:
    """The step this attention call belongs to (made now if it is the first layer of a forward)."""
    global _current, _steps_made
    batch_size, num_heads, query_len, head_dim = query.shape
    kv_len, num_kv_heads = key.shape[2], key.shape[1]
    inputs = (attention_mask, position_ids, cu_seq_lens_q, cu_seq_lens_k)
    call_key = _key((batch_size, query_len, kv_len, num_heads, num_kv_heads, head_dim, query.dtype, query.device),
                    inputs)
    new_forward = getattr(module, "layer_idx", None) == 0 and not _in_backward()
    current = _current
    if (not new_forward and current is not None and current.key == call_key
            and all(a is b for a, b in zip(current.inputs, inputs))):
        return current
    docs = find_documents(batch_size, query_len, kv_len, attention_mask=attention_mask, position_ids=position_ids,
                          cu_seq_lens_q=cu_seq_lens_q, cu_seq_lens_k=cu_seq_lens_k)
    config = current_config()
    group = config.group
    distributed = (
        config.mode == "distca" and kv_len == query_len and dist.is_available() and dist.is_initialized()
        and dist.get_world_size(group) > 1
    )
    _steps_made += 1
    if distributed:
        token_bytes = TokenBytes(q=num_heads * head_dim * query.element_size(),
                                 kv=2 * num_kv_heads * head_dim * query.element_size(),
                                 o=num_heads * head_dim * query.element_size())
        dispatch, stats = _plan(docs, config, group, token_bytes, query.device, _steps_made, num_heads)
        _current = Step(call_key, inputs, docs, None, dispatch, stats, _steps_made)
    else:
        if docs.num_docs == 0:
            raise ValueError("distca: the batch holds no real tokens (the attention_mask is all padding)")
        pairs = int(pairs_of(docs.past, docs.lengths).sum())
        stats = {"attn_pairs_local": [pairs], "attn_pairs_served": [pairs], "bytes_sent_per_layer": 0,
                 "step": _steps_made, "dispatched": False}
        _current = Step(call_key, inputs, docs, fuse_tasks(whole_document_tasks(docs), docs).to(query.device), None,
                        stats, _steps_made)
    return _current


def _plan(docs: PackedDocuments, config, group, token_bytes: TokenBytes, device, number: int, num_heads: int):
    if docs.past.any():
        raise ValueError("distca: cannot dispatch a call with a KV cache")
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    # NCCL all-gathers need device tensors; gloo takes CPU ones.
    gather_device = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    per_rank = all_gather_lengths(docs.lengths, group, gather_device, config.timeout_s,
                                  f"distca step {number}: planning")
    counts = np.array([len(x) for x in per_rank], dtype=np.int64)
    doc_offset = np.concatenate(([0], np.cumsum(counts)))
    lengths = np.concatenate(per_rank) if counts.sum() else np.zeros(0, dtype=np.int64)
    pieces = DocumentPieces(np.repeat(np.arange(world), counts), np.arange(lengths.size), np.zeros_like(lengths),
                            lengths, world)
    servers = config.servers
    if servers is not None and max(servers) >= world:
        raise ValueError(f"distca servers {servers} name ranks outside the server group of {world} ranks")
    plan = plan_tasks(pieces, PlannerConfig(config.tolerance, config.block, servers, token_bytes))
    transfers = kv_transfers(plan, pieces)
    layout = build_dispatch_layout(plan, transfers, doc_offset, docs, rank, device, group=group,
                                   timeout_s=config.timeout_s, backward_mode=config.backward, step=number)
    sent = comm_bytes(plan, pieces, token_bytes)
    # in resend mode the forward also returns each moved query's log-sum-exp (fp32, one per head)
    lse_bytes = plan.moved_queries() * num_heads * 4 if config.backward == "resend" else 0
    stats = {
        "attn_pairs_local": pieces.local_pairs().tolist(),
        "attn_pairs_served": plan.server_pairs().tolist(),
        "bytes_sent_per_layer": int(sent.total + lse_bytes),
        "step": number,
        "dispatched": True,
        "backward": config.backward,
        "tasks": plan.num_tasks,
        "moved_query_fraction": plan.moved_queries() / max(1, int(lengths.sum())),
    }
    return layout, stats


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
        stats["rank_bytes_sent_this_step"] = dict(_current.dispatch.bytes_sent)
        stats["rank_saved_for_backward_bytes"] = _current.dispatch.saved_bytes
    return stats
