"""Floors under the time model of ``pipeline_cost``: how fast CAD across stages (the lockstep of
``pipeline_schedule="cad_1f1b"``) and CAD inside each stage could run one step if attention were
balanced perfectly and moved only the bytes no plan avoids. Pure numpy.

Why a floor: ``cad_across_stages / cad_per_stage`` is what issue 20 sets a target for (1.15x), and
``step_s(cad_per_stage) / floor(cad_across_stages)`` is an upper bound on that ratio for any tick
planner: if it is below the target, no plan reaches it under the model.

The floors keep everything of ``pipeline_cost``'s model that no plan can change and drop the rest:

- a lockstep tick's layer lasts the slowest rank's linear layers plus the slowest rank's attention
  (``pipeline_cost.tick_layer_seconds``): the floor takes the slowest linear layers as they are (a
  busy row) and the attention as the tick's total over all ``P x D`` ranks, spread evenly;
- an operation of CAD inside each stage lasts its slowest copy's linear layers plus attention: the
  floor takes its ``D`` copies' work spread evenly (and at least the slowest copy's linear layers);
- attention's total is its pairs plus the least key and task cost any plan pays: every key of a
  document is read by at least one task (the query at that position sees it) and every document is
  at least one task (``TimeModel.rank_seconds``);
- with ``exposed_comm=0`` communication between the servers is free; with a share exposed, only the
  links of a document's holders are counted (``holder_link_floor_seconds``), never ``collective_s``;
  the activations between stages (``p2p_s``) are kept, as the event models
  (``pipeline.simulate_lockstep``, ``simulate_1f1b``) time them for both methods whatever is hidden.

The holders' links. Under the model a server gets a document's queries and K/V from the ranks that hold
its pieces (no relays: ``transfers.rank_bytes``) and returns the outputs to them. A server that computes
``p`` pairs of the document and holds none of it receives queries ``Q`` and keys ``K`` with
``|Q| |K| >= p``, so its traffic with the holders is at least ``|Q| (q + o) + |K| kv >= 2 sqrt(p (q + o)
kv)`` bytes, and it computes at most ``tau / a`` pairs in a layer of ``tau`` seconds (``a``: seconds per
pair). Spreading the ``X`` pairs the holders do not compute themselves over servers costs their links at
least ``2 X sqrt((q + o) kv a / tau)`` bytes (fewest, fullest servers: the square root is concave).
The ``H`` holders each spend at most ``tau`` on their compute and exposed bytes (``c`` seconds a byte),
so ``a (P - X) + 2 c X sqrt((q + o) kv a / tau) <= H tau`` for some ``X`` in ``[0, P]``: linear in ``X``,
it holds at ``X = 0`` or ``X = P``, hence ``tau >= min(a P / H, (2 c P sqrt((q + o) kv a) / H) ^ (2/3))``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .baselines import pack_pieces
from .cost import (TimeModel, TokenBytes, check_document_lengths, check_number, check_time_model, check_window,
                   document_pairs)
from .pipeline import (FORWARD, PipelineRun, check_schedule_sizes, lockstep_1f1b_ticks, simulate_1f1b,
                       simulate_lockstep)
from .pipeline_cost import check_step, forward_backward_models

__all__ = ["PipelineFloors", "attention_floor_seconds", "holder_link_floor_seconds", "pipeline_floors",
           "bubble_gain"]


def attention_floor_seconds(docs, time_model: TimeModel, *, window: int | None = None) -> float:
    """The least total attention seconds (summed over servers, one layer, in ``time_model``'s share)
    any plan pays for documents of lengths ``docs`` (``[documents]`` tokens): their pairs, one key
    read per token and one task per document."""
    check_time_model(time_model)
    window = check_window(window)
    docs = check_document_lengths(docs, "docs")
    docs = docs[docs > 0]
    pairs = float(np.sum(document_pairs(docs, window), dtype=np.float64))
    return float(time_model.rank_seconds(0.0, pairs, tasks=docs.size, keys=float(docs.sum())))


def holder_link_floor_seconds(pairs, holders, *, attn_s_per_pair: float, byte_s: float,
                              token_bytes: TokenBytes, relayed_reach=None) -> np.ndarray:
    """``[documents]`` the least seconds of one layer's attention part (compute + exposed bytes) on
    the busiest holder of each document (module docstring): ``pairs`` (``[documents]``) its pairs,
    ``holders`` (``[documents]``, >= 1) the ranks holding its pieces, ``attn_s_per_pair`` seconds a pair,
    ``byte_s`` exposed seconds a byte (``TimeModel.byte_seconds``).

    ``relayed_reach``: for plans that may relay K/V (``kv_relays``), ``[documents]`` the most keys one
    query of each attends (its length, or the window). Servers may then get K/V from each other, so
    only the queries out and outputs back are sure to cross a holder's link: a query carries at most
    ``reach`` pairs, so moving ``X`` pairs costs the holders at least ``X (q + o) / reach`` bytes, and
    ``tau >= min(a P / H, c P (q + o) / (reach H))`` (linear in ``X`` again)."""
    pairs, holders = np.asarray(pairs, dtype=np.float64), np.asarray(holders, dtype=np.float64)
    shapes = {"pairs": pairs.shape, "holders": holders.shape}
    if relayed_reach is not None:
        shapes["relayed_reach"] = np.shape(relayed_reach)
    if len(set(shapes.values())) > 1 or pairs.ndim != 1:
        raise ValueError(f"pairs, holders (and relayed_reach) must hold one entry per document, got shapes {shapes}")
    if not (np.isfinite(holders).all() and (holders >= 1).all()):
        raise ValueError(f"holders must be >= 1 per document, got {holders.min(initial=1.0)}")
    attn_s_per_pair = check_number(attn_s_per_pair, "attn_s_per_pair", unit=" (seconds)")
    byte_s = check_number(byte_s, "byte_s", unit=" (seconds)")
    if not (np.isfinite(pairs).all() and (pairs >= 0).all()):
        raise ValueError("pairs must be finite counts >= 0 per document")
    compute_all = attn_s_per_pair * pairs / holders
    if relayed_reach is not None:
        reach = np.maximum(np.asarray(relayed_reach, dtype=np.float64), 1.0)
        return np.minimum(compute_all, byte_s * (token_bytes.q + token_bytes.o) * pairs / (reach * holders))
    per_pair = 2.0 * byte_s * np.sqrt((token_bytes.q + token_bytes.o) * token_bytes.kv * attn_s_per_pair)
    return np.minimum(compute_all, (per_pair * pairs / holders) ** (2.0 / 3.0))


@dataclass(frozen=True)
class PipelineFloors:
    """One step's floors (module docstring).

    Attributes:
        cad_across_stages: the lockstep with every tick's attention spread evenly over all ranks,
            bytes only on the holders' links.
        cad_per_stage: torch's 1F1B with every micro-batch's attention spread evenly over its stage's
            copies, bytes only on the holders' links (``saved`` mode's).
        tick_s: ``[ticks]`` seconds of each lockstep tick in ``cad_across_stages`` (all its layers).
        attention_share: the step's attention over its attention plus linear work (compute only).
    """

    cad_across_stages: PipelineRun
    cad_per_stage: PipelineRun
    tick_s: tuple
    attention_share: float


def pipeline_floors(micro_batch_docs, *, stages: int, data_parallel: int, tokens: int, layers: int,
                    time_model: TimeModel, activation_bytes_per_token: int, window: int | None = None,
                    exposed_comm: float = 0.0, token_bytes: TokenBytes | None = None,
                    relays: bool = False) -> PipelineFloors:
    """The floors of one step of ``pipeline_cost.pipeline_step`` with the same arguments
    (``micro_batch_docs``: ``M`` arrays of document lengths, each packed in order into ``data_parallel``
    rows of ``tokens``; ``layers`` a multiple of ``stages``; ``time_model`` the layer's forward +
    backward, split as ``pipeline_cost.forward_backward_models`` splits it). No plan of the
    lockstep ticks (``cad_across_stages``) or of the stages (``cad_per_stage``) is predicted faster
    by ``pipeline_step`` at ``exposed_comm`` (the share of communication not hidden, as
    ``PlannerConfig.exposed_comm``; above 0 it needs ``token_bytes``, the wire size of a token) or
    any larger share. ``relays``: whether the plans may relay K/V (``kv_relays`` not ``"off"``); the
    holders' links then carry only queries and outputs for sure (``holder_link_floor_seconds``'
    ``relayed_reach``), a lower floor."""
    check_time_model(time_model)
    window = check_window(window)
    layers_per_stage, micro_batch_docs = check_step(micro_batch_docs, stages=stages, data_parallel=data_parallel,
                                                    tokens=tokens, layers=layers,
                                                    activation_bytes_per_token=activation_bytes_per_token)
    exposed_comm = check_number(exposed_comm, "exposed_comm", high=1.0)
    if exposed_comm > 0 and token_bytes is None:
        raise ValueError("exposed_comm > 0 needs token_bytes (the bytes a token's q, k/v and out move)")
    m, ranks = len(micro_batch_docs), stages * data_parallel
    p2p_s = tokens * activation_bytes_per_token / time_model.bytes_per_s
    parts = forward_backward_models(time_model)  # compute shares 1/3 and 2/3 whatever the mode
    packed = [pack_pieces(docs, data_parallel, tokens) for docs in micro_batch_docs]
    row_tokens = [pieces.tokens() for pieces in packed]
    # [kind, micro-batch] seconds of one layer: the slowest, mean and fastest row's linear layers, the
    # total attention
    linear, mean_linear, min_linear = (np.array([[part.linear_s_per_token * float(stat(rows)) for rows in row_tokens]
                                                 for part in parts]) for stat in (np.max, np.mean, np.min))
    attention = np.array([[attention_floor_seconds(docs, part, window=window) for docs in micro_batch_docs]
                          for part in parts])

    def holders_floor(mode: str) -> np.ndarray:
        """[kind, micro-batch] seconds: the busiest holder's attention part, bytes in ``mode``"""
        if exposed_comm == 0:
            return np.zeros((2, m))
        out = np.zeros((2, m))
        for kind, part in enumerate(forward_backward_models(time_model, mode)):
            for i, (docs, pieces) in enumerate(zip(micro_batch_docs, packed)):
                holders = np.bincount(pieces.doc, minlength=docs.size)  # (check_step dropped empty documents)
                reach = (docs if window is None else np.minimum(docs, window)) if relays else None
                out[kind, i] = holder_link_floor_seconds(
                    document_pairs(docs, window), holders, attn_s_per_pair=part.attn_s_per_pair,
                    byte_s=part.byte_seconds(exposed_comm, mode), token_bytes=token_bytes,
                    relayed_reach=reach).max(initial=0.0)
        return out

    # CAD inside each stage may run its backward in saved mode (fewer bytes): the floor takes it
    operation = np.maximum.reduce([linear, mean_linear + attention / data_parallel,
                                   min_linear + holders_floor("saved")])
    every_stage = layers_per_stage * np.ones((stages, 1))  # [stages, micro-batches] seconds: equal stages
    cad_per_stage = simulate_1f1b(every_stage * operation[0], every_stage * operation[1], p2p_s=p2p_s)

    tick_holders = holders_floor("resend")  # the lockstep's ticks re-plan: resend mode
    tick_s = []
    for tick in lockstep_1f1b_ticks(stages, m):
        kind = 0 if tick.kind == FORWARD else 1
        busy = [mb for mb in tick.micro_batches if mb is not None]
        spread = max(attention[kind, busy].sum() / ranks, tick_holders[kind, busy].max(initial=0.0))
        tick_s.append(layers_per_stage * (linear[kind, busy].max(initial=0.0) + spread))
    across = simulate_lockstep(tick_s, num_stages=stages, num_micro_batches=m, p2p_s=p2p_s)
    share = float(attention.sum() / (attention.sum() + data_parallel * mean_linear.sum()))
    return PipelineFloors(across, cad_per_stage, tuple(float(s) for s in tick_s), share)


def bubble_gain(*, stages: int, micro_batches: int, attention_share: float) -> float:
    """What the lockstep's bubbles alone give over CAD inside each stage when every micro-batch holds the
    same attention, each at its floor with free communication: ``1 / (1 - b s)``, ``b = (P - 1) / (M + P -
    1)`` the bubble fraction of 1F1B and ``s`` the attention share of a layer's compute. CAD inside each
    stage takes ``(M + P - 1) (L + A)`` per kind (``L``, ``A``: a micro-batch's linear and attention
    seconds on one stage); the lockstep's slots hold every micro-batch's attention once over all stages'
    ranks, ``(M + P - 1) L + M A``. More than this comes only from micro-batches that differ (a long
    document's micro-batch holds up every stage it passes under 1F1B)."""
    attention_share = check_number(attention_share, "attention_share", high=1.0)
    check_schedule_sizes(stages, micro_batches, names=("stages", "micro_batches"))
    bubble = (stages - 1) / (micro_batches + stages - 1)
    return 1.0 / (1.0 - bubble * attention_share)
