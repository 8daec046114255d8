"""The per-forward context: what the attention layers of one forward share, and ``plan_stats()``.

A forward's first attention call makes a ``ForwardContext`` (``runtime.forward``, or
``runtime.pingpong`` for the ping-pong decoder stack); every later layer, the backward and
gradient checkpointing's recomputation reuse it. It lives in ``distca_hf.state.STATE.forward``,
read and written only through ``current_forward`` / ``begin_forward`` here. A context planned ahead
(a tick of ``pipeline_schedule="cad_1f1b"``) is *pinned* with ``pinned_forward``: the attention calls
made inside the ``with`` block use it instead of opening a forward. ``PlanStats`` describes
its plan, built by ``plan_stats_of`` on every path (local, dispatched, ping-pong).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np

from ..planning import DocumentPieces, FusedBatch, Plan, TokenBytes, backward_memory, imbalance, query_sends
from ..state import STATE
from .dispatch import Dispatch
from .tables import DispatchCounters

__all__ = ["ForwardContext", "PlanStats", "BatchPlan", "plan_stats_of", "planned_windows", "plan_stats", "current_forward",
           "begin_forward", "next_forward_number", "pinned_forward", "pinned_context"]


@dataclass(frozen=True)
class PlanStats:
    """About the plan of one forward (``plan_stats()`` returns it as a dict; contract keys first).

    Attributes:
        attn_pairs_local: ``[ranks]`` query-key pairs each rank would compute colocated.
        attn_pairs_served: ``[ranks]`` pairs each rank computes as a server under the plan (both
            under the plan's sliding window, when every layer of the model slides).
        bytes_sent_per_layer: bytes all ranks send in one layer's forward (Q out, O back, K/V as the
            waves send them; the log-sum-exp too in ``resend`` mode).
        step: the forward's number in this process (forwards, not optimizer steps).
        dispatched: whether CA-tasks ran on servers (``False``: each rank computed its own).
        backward, overlap: the modes in force (``None`` when not dispatched). The backward mode is
            the plan's (``Plan.backward``): the ``backward`` setting, or ``"resend"`` for a step
            whose ``saved`` plan would exceed ``memory_budget``; ``"saved+resend"`` when ping-pong's
            nano-batches differ.
        waves: exchanges per layer and direction (``wave``: up to 4; ping-pong: one per nano-batch).
        tasks: CA-tasks in the plan, all ranks.
        moved_query_fraction: query tokens sent away from their rank (each row once per server) / all query tokens.
        kv_tokens_received_per_layer: ``[ranks]`` K/V tokens each server receives in one layer, all
            waves (``wave`` brings a prefix in every wave that needs it); ``kv_tokens_received_max`` /
            ``_mean``: over the servers.
        kv_tokens_kept_per_layer: ``[ranks]`` distinct K/V tokens each server keeps for backward in
            ``saved`` mode, each once however many waves brought it (``planning.kv_kept``; the memory
            a plan adds on a server besides the queries); 0 for a plan in ``resend`` mode.
        memory_bytes_per_layer: ``[ranks]`` bytes the plan makes each rank hold for attention's
            backward in one layer beyond its own tokens' activations (``planning.backward_memory``;
            signed: in ``saved`` mode a rank whose queries are served elsewhere keeps less). Own
            activations: the rank's query tokens x the bytes attention's backward keeps per token and
            layer colocated (q, k, v, out and the fp32 log-sum-exp, ``TokenBytes.held``).
        memory_imbalance: max / mean over ranks of own activations + ``memory_bytes_per_layer``
            (1.0 when ranks hold equal tokens and the plan adds nothing).
        kv_exchange_rounds: K/V exchanges per layer's forward, over the waves and nano-batches: 1
            when holders send K/V to servers directly, more when the plan relays K/V along trees
            (``Plan.relays``, the ``kv_relays`` setting: one more round per tree level).
        plan_seconds: wall seconds this rank spent planning the forward (the planner; under
            ``tolerance="auto"`` and ``kv_relays="auto"`` on 3 ranks or more, its candidates planned
            across ranks with their all-reduce and broadcast, ``runtime.shared_planning``), summed over
            ping-pong's nano-batches and over a mixed model's two plans (``sliding_layers``); the
            documents' all-gather and building the dispatch are not counted.
        nano_batches: with ping-pong, the stats of each nano-batch (the lists above are their sums).
        sliding_layers: for a model that mixes sliding and full layers (``hf.mixed_sliding_window``),
            ``(window, PlanStats)`` of the plan its sliding layers run (``plan_stats()["sliding_layers"]``:
            ``{str(window): stats}``); the fields above describe the full layers' plan.
    """

    attn_pairs_local: list
    attn_pairs_served: list
    bytes_sent_per_layer: int
    step: int
    dispatched: bool
    backward: str | None = None
    overlap: str | None = None
    waves: int = 0
    tasks: int = 0
    moved_query_fraction: float = 0.0
    kv_tokens_received_per_layer: list = field(default_factory=list)
    kv_tokens_received_max: int = 0
    kv_tokens_received_mean: float = 0.0
    kv_tokens_kept_per_layer: list = field(default_factory=list)
    memory_bytes_per_layer: list = field(default_factory=list)
    memory_imbalance: float = 1.0
    kv_exchange_rounds: int = 1
    plan_seconds: float = 0.0
    nano_batches: tuple = ()
    sliding_layers: tuple = ()

    def with_sliding_layers(self, window: int, sliding: "PlanStats") -> "PlanStats":
        """These stats (the full layers' plan) with a mixed model's sliding layers' plan added, and the
        time spent planning both."""
        return dataclasses.replace(self, sliding_layers=((window, sliding),),
                                   plan_seconds=self.plan_seconds + sliding.plan_seconds)

    def as_dict(self) -> dict:
        out = asdict(self)
        out["nano_batches"] = [s.as_dict() for s in self.nano_batches]
        out["sliding_layers"] = {str(window): s.as_dict() for window, s in self.sliding_layers}  # (JSON's keys)
        for name in ("nano_batches", "sliding_layers"):
            if not out[name]:
                del out[name]
        return out


@dataclass(frozen=True, eq=False)
class BatchPlan:
    """One micro- or nano-batch as planned, what ``plan_stats_of`` reads.

    Attributes:
        pieces: every rank's document pieces (query ranges ``[start, end)``).
        plan: the CA-task assignment, or ``None`` when each rank computes its own documents.
        kv_received: ``[ranks]`` K/V tokens each server receives per layer (all the dispatch's waves).
        waves: exchanges per layer and direction.
        window: the sliding window pairs are counted under (the plan's, when there is one).
        queries_sent: query tokens crossing ranks per layer as the dispatch's waves send them (a
            key-split row whose tiles fall in two waves goes in each); ``None``: ``query_sends`` of
            the plan.
        kv_kept: ``[ranks]`` distinct K/V tokens each server keeps for backward (``Dispatch.kv_kept``:
            a prefix several waves bring is kept once); ``None``: ``kv_received`` (one wave).
        kv_rounds: K/V exchange rounds of a layer's forward (``Dispatch.kv_rounds``; 1: no relays).
        plan_seconds: wall seconds spent planning it on this rank (``PlanStats.plan_seconds``).
    """

    pieces: DocumentPieces
    plan: Plan | None = None
    kv_received: np.ndarray | None = None
    waves: int = 0
    window: int | None = None
    queries_sent: int | None = None
    kv_kept: np.ndarray | None = None
    kv_rounds: int = 1
    plan_seconds: float = 0.0

    @property
    def kv_tokens_kept(self) -> np.ndarray | None:
        """``[ranks]`` K/V tokens each server keeps for backward: ``kv_kept``, else ``kv_received``."""
        return self.kv_kept if self.kv_kept is not None else self.kv_received

    @property
    def pair_window(self) -> int | None:
        return self.plan.window if self.plan is not None else self.window


def planned_windows(kv_window: int | None, sliding_window: int | None) -> list:
    """The windows one forward plans for, in the order every rank plans them: ``kv_window`` (the full
    layers', or every layer's), then a mixed model's ``sliding_window`` when there is one."""
    return [kv_window] + ([sliding_window] if sliding_window is not None else [])


def plan_stats_of(number: int, batches: Sequence[BatchPlan], *, token_bytes: TokenBytes | None = None,
                  num_heads: int = 0, overlap: str | None = None) -> PlanStats:
    """The one builder of ``PlanStats``: per-rank lists and totals summed over ``batches`` (one
    micro-batch, or ping-pong's two nano-batches, each also reported alone)."""
    local = sum(b.pieces.local_pairs(b.pair_window) for b in batches)
    served = sum(b.plan.server_pairs() if b.plan is not None else b.pieces.local_pairs(b.pair_window)
                 for b in batches)
    planned = [b for b in batches if b.plan is not None]
    sent_queries = [b.queries_sent if b.queries_sent is not None else query_sends(b.plan).tokens() for b in planned]
    moved = sum(sent_queries)
    queries = sum(int(b.pieces.tokens().sum()) for b in batches)
    ranks = batches[0].pieces.num_ranks
    received = sum((b.kv_received for b in planned if b.kv_received is not None), np.zeros(ranks, dtype=np.int64))
    # (a plan in resend mode keeps nothing on its servers: what it receives is dropped after the forward)
    kept_kv = sum((b.kv_tokens_kept for b in planned if b.kv_received is not None and b.plan.backward == "saved"),
                  np.zeros(ranks, dtype=np.int64))
    sent = 0
    if planned:
        # queries out and outputs back, K/V, as the waves really send them; in resend mode and with
        # key-split tasks (partials merge at the source) the forward also returns each moved query
        # row's log-sum-exp (fp32, one per head)
        sent = moved * (token_bytes.q + token_bytes.o) + int(received.sum()) * token_bytes.kv
        sent += sum(n for n, b in zip(sent_queries, planned)
                    if b.plan.backward == "resend" or b.plan.splits_keys) * num_heads * 4
    modes = sorted({b.plan.backward for b in planned})
    # memory held for backward: own activations (query tokens x bytes per token) + what each plan adds
    tokens = sum(b.pieces.tokens() for b in batches)
    added = np.zeros(ranks, dtype=np.int64)
    if planned:
        token_bytes = token_bytes if token_bytes.lse else dataclasses.replace(token_bytes, lse=4 * num_heads)
        for b in planned:
            added += backward_memory(b.plan, b.pieces, token_bytes, received=b.kv_tokens_kept).added
        held = tokens * token_bytes.held + added
    else:  # each rank keeps its own tokens' activations: the imbalance is the tokens'
        held = tokens
    servers = list(planned[0].plan.servers) if planned else list(range(ranks))
    per_batch = ()
    if len(batches) > 1:
        per_batch = tuple(plan_stats_of(number, [b], token_bytes=token_bytes, num_heads=num_heads,
                                        overlap=overlap) for b in batches)
    return PlanStats(
        attn_pairs_local=np.asarray(local, dtype=np.int64).tolist(),
        attn_pairs_served=np.asarray(served, dtype=np.int64).tolist(),
        bytes_sent_per_layer=int(sent), step=number, dispatched=bool(planned),
        backward="+".join(modes) if planned else None, overlap=overlap if planned else None,
        waves=sum(b.waves for b in planned), tasks=sum(b.plan.num_tasks for b in planned),
        moved_query_fraction=moved / max(1, queries), kv_tokens_received_per_layer=received.tolist(),
        kv_tokens_received_max=int(received[servers].max(initial=0)),
        kv_tokens_received_mean=float(received[servers].mean()) if servers else 0.0,
        kv_tokens_kept_per_layer=np.asarray(kept_kv, dtype=np.int64).tolist(),
        memory_bytes_per_layer=added.tolist(), memory_imbalance=imbalance(held),
        kv_exchange_rounds=max((b.kv_rounds for b in planned), default=1),
        plan_seconds=float(sum(b.plan_seconds for b in batches)), nano_batches=per_batch)


@dataclass(eq=False)
class ForwardContext:
    """What one forward's attention layers share.

    Attributes:
        number: the forward's number (``plan_stats()["step"]``).
        key: shapes, dtype, device and identity of the ``position_ids`` / ``cu_seq_lens`` that describe
            the documents; a later call with the same key (the same tensors, ``inputs``, and one of
            ``masks``) belongs to this forward.
        inputs: those tensors, kept so the identity check is sound.
        masks: ``(attention_mask, version)`` of each mask this forward's calls were given (the
            tensors kept alive like ``inputs``); a later call must bring one of them
            (``runtime.forward._same_documents``).
        longest_document: tokens of the longest document over every rank of the server group.
        stats: the plan's ``PlanStats``.
        local: the fused batch of this rank's own documents, when it computes them itself.
        dispatch: this rank's dispatch, when CA-tasks run on servers.
        counters: bytes this rank sent and kept so far in this forward (shared by ping-pong's two
            dispatches, and by the full and sliding layers' dispatches).
        sliding: ``{window: ForwardContext}``: for a model that mixes sliding and full layers
            (``hf.mixed_sliding_window``), the context its sliding layers run, planned under their window
            (``for_window``); this context is the full layers'.
    """

    number: int
    key: tuple
    inputs: tuple
    longest_document: int
    stats: PlanStats
    local: FusedBatch | None = None
    dispatch: Dispatch | None = None
    counters: DispatchCounters | None = field(default=None)
    masks: list = field(default_factory=list)
    sliding: dict = field(default_factory=dict)

    def for_window(self, window: int | None) -> "ForwardContext":
        """The context a layer of sliding ``window`` (``None``: whole prefixes) runs in: the one planned
        for that window, else this one (its K/V cover every window)."""
        return self.sliding.get(window, self) if window is not None else self


def current_forward() -> ForwardContext | None:
    """The context of the forward in progress (or of the last one)."""
    return STATE.forward


def begin_forward(context: ForwardContext) -> ForwardContext:
    """Make ``context`` the current forward's."""
    STATE.forward = context
    return context


@contextlib.contextmanager
def pinned_forward(context: ForwardContext, *, current: bool = True):
    """Every attention call inside the block belongs to ``context`` (planned ahead). ``current``: it
    becomes the current forward, so ``plan_stats()`` describes it; ``False`` for a context pinned only
    for recomputations in a backward (``cad_1f1b``'s backward ticks under activation checkpointing),
    which leaves ``plan_stats()`` describing the last forward. Blocks do not nest."""
    if STATE.pinned_forward is not None:
        raise RuntimeError("distca: a pinned forward is already in force (pinned_forward blocks do not nest)")
    STATE.pinned_forward = begin_forward(context) if current else context
    try:
        yield context
    finally:
        STATE.pinned_forward = None


def pinned_context() -> ForwardContext | None:
    """The context pinned by ``pinned_forward``, or ``None``."""
    return STATE.pinned_forward


def next_forward_number() -> int:
    STATE.forwards_started += 1
    return STATE.forwards_started


def plan_stats() -> dict:
    """About the last plan on this rank (contract): ``attn_pairs_local`` (per rank, colocated),
    ``attn_pairs_served`` (per rank, under the plan), ``bytes_sent_per_layer`` (all ranks, one
    layer's forward), ``memory_bytes_per_layer`` and ``memory_imbalance`` (contract "memory in plans");
    plus the rest of ``PlanStats`` and, for dispatched plans, this rank's running
    totals for the forward so far (``rank_bytes_sent_this_step`` by collective kind,
    ``rank_saved_for_backward_bytes``)."""
    context = current_forward()
    if context is None:
        raise RuntimeError("distca_hf.plan_stats(): no forward has run with attn_implementation='distca' yet")
    stats = context.stats.as_dict()
    if context.counters is not None:
        stats["rank_bytes_sent_this_step"] = dict(context.counters.bytes_sent)
        stats["rank_saved_for_backward_bytes"] = context.counters.saved_bytes
    return stats
