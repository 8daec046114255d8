"""One training step of a pipeline, timed for the four ways of running its attention. Pure numpy.

A step of ``P`` stages x ``D`` data-parallel pipelines (``P x D`` ranks; rank ``s D + d`` is stage ``s``
of pipeline ``d``, as ``training.topology`` numbers them) runs ``M`` micro-batches; micro-batch ``m``
is one row of ``T`` tokens on each of the ``D`` pipelines, i.e. ``D x T`` tokens packed in order
(``baselines.pack_pieces``; a document crossing a row continues on the next pipeline's row and
attends to its whole prefix, as inside a stage's data-parallel group with ``span_ranks``). A stage
holds ``layers / P`` layers. Every method is timed with the same ``TimeModel`` and the same
communication rules as ``distca-hf simulate``'s other methods (``rank_time.loads_seconds``: compute
plus the exposed share of the bytes a rank sends and receives, plus ``collective_s`` when anything
moves); forward and backward are split by ``forward_backward_models``.

- ``colocated_1f1b``: torch's ``Schedule1F1B``; every rank computes its own row's attention (a piece
  that continues a document receives its prefix K/V). The ``D`` pipelines run independently (the
  wait of a prefix exchange for its peer is not modelled: in the baseline's favour) and the step
  ends with the slowest.
- ``balanced_micro_batches``: the same, with the step's documents spread over its ``D x M`` rows by
  ``micro_batches.balance_micro_batches`` (a piece placed away from its prefix receives it like
  above; in the baseline's favour too, since a real run would have to keep an earlier micro-batch's
  K/V).
- ``cad_per_stage``: torch's ``Schedule1F1B``; the ``D`` copies of a stage run each micro-batch
  together with the distca planner balancing its attention over them (one plan per micro-batch,
  forward and backward, in the backward mode the planner chooses within ``memory_budget``); an
  operation lasts as long as the slowest copy, layer by layer.
- ``cad_across_stages``: the lockstep schedule (``pipeline.lockstep_1f1b_ticks``): in every tick
  each rank runs its stage's linear layers of its micro-batch (none in a bubble) and one plan per
  tick pools the tick's attention over all ``P x D`` ranks, forward with forward (planned with the
  forward model) and backward with backward (re-planned with the backward model). Every layer's
  exchanges (inputs out, outputs back) synchronise the tick's ranks before and after its attention,
  so a rank's linear work and its attention cannot make up for each other: a tick's layer lasts the
  slowest rank's linear layers plus the slowest rank's attention with its exposed communication
  (``tick_layer_seconds``), and its plan balances the attention alone. A micro-batch's backward
  meets other micro-batches than its forward did, on other servers, so it runs in ``resend`` mode:
  servers keep nothing between ticks (no memory added) and the backward tick sends q, k/v, out and
  dO again (``cost.COMM_PASSES``).
  It holds up to ``2 (P - s) - 1`` micro-batches' activations on stage ``s`` (1F1B: ``P - s``).

Activations (forward) and their gradients (backward) between stages take ``p2p_s = T x
activation_bytes_per_token / bytes_per_s`` per micro-batch, overlapping the stages' compute
(``pipeline.simulate_1f1b`` / ``simulate_lockstep``). Not modelled, for any method: the embedding on
the first stage and the final norm, LM head and loss on the last (equal for all four methods except
that in the lockstep they lengthen every tick of those stages: the ranks of the other stage wait for
them at the next exchange), and bandwidth shared between the stages' transfers and the attention
exchanges.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ..config import is_integer
from .baselines import RankLoads, pack_pieces
from .cost import COMM_PASSES, TimeModel, check_document_lengths, check_time_model, imbalance
from .micro_batches import balance_micro_batches
from .pieces import DocumentPieces
from .pipeline import (FORWARD, PipelineRun, check_schedule_sizes, in_flight_micro_batches, lockstep_1f1b_ticks,
                       simulate_1f1b, simulate_lockstep)
from .planner import Plan, PlannerConfig, colocated_plan, plan_tasks
from .rank_time import loads_seconds, other_seconds, plan_loads, rank_seconds, step_seconds
from .relay_trees import RelayTrees

__all__ = ["BACKWARD_TO_FORWARD", "PIPELINE_METHODS", "forward_backward_models", "check_layers", "check_step",
           "PipelineMethodStep", "pipeline_step", "plan_lockstep_tick", "pool_pieces", "rank_subset", "attention_only",
           "tick_layer_seconds", "held_micro_batches"]

BACKWARD_TO_FORWARD = 2.0
"""A layer's backward compute over its forward's: 2 (the linear layers' backward computes the
gradients of the inputs and of the weights, two matmuls per forward matmul; core attention's is 2.5,
``cost.attention_flops``, and a model that counts it apart would split it the same way). The time
model's constants are forward + backward, so the forward takes ``1 / (1 + 2)`` of a layer's compute
and the backward ``2 / 3``; the backward moves as many bytes as the forward (dO out, dQ / dK / dV
back) in ``saved`` mode, so each takes one pass of the communication; in ``resend`` mode the
backward takes two (``cost.COMM_PASSES``)."""

PIPELINE_METHODS = ("colocated_1f1b", "balanced_micro_batches", "cad_per_stage", "cad_across_stages")


def forward_backward_models(time_model: TimeModel, backward: str = "saved") -> tuple[TimeModel, TimeModel]:
    """``(forward, backward)``: ``time_model`` (a layer's forward + backward) split into the forward's
    and the backward's share (``BACKWARD_TO_FORWARD``) for loads timed in ``backward`` mode
    (``rank_time.loads_seconds(..., backward)``): compute constants times ``1 / 3`` and ``2 / 3``; of the
    ``COMM_PASSES[backward]`` passes of bytes the forward moves one and the backward the rest
    (``bytes_per_s`` scaled to match); ``collective_s`` halved for each. The two add up to
    ``time_model`` for any loads in that mode."""
    check_time_model(time_model)
    if backward not in COMM_PASSES:
        raise ValueError(f"backward must be one of {sorted(COMM_PASSES)}, got {backward!r}")
    passes = COMM_PASSES[backward]

    def share(fraction: float, comm_passes: float, label: str) -> TimeModel:
        return dataclasses.replace(
            time_model, linear_s_per_token=time_model.linear_s_per_token * fraction,
            attn_s_per_pair=time_model.attn_s_per_pair * fraction, task_s=time_model.task_s * fraction,
            task_key_s=time_model.task_key_s * fraction, bytes_per_s=time_model.bytes_per_s * passes / comm_passes,
            collective_s=time_model.collective_s / 2.0, source=f"{time_model.source} ({label})")

    forward = 1.0 / (1.0 + BACKWARD_TO_FORWARD)
    return share(forward, 1.0, "forward share"), share(1.0 - forward, passes - 1.0, "backward share")


def check_layers(layers: int, stages: int, *, setting: str = "layers") -> int:
    """``layers / stages``, the layers of one stage; a ``ValueError`` naming both numbers when they do
    not divide (stages must hold equal layers for the lockstep, and the stage split refuses it too)."""
    for name, value in ((setting, layers), ("stages", stages)):
        if not is_integer(value) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if layers % stages:
        raise ValueError(f"{setting} ({layers}) must be divisible by the pipeline stages ({stages}): every stage "
                         "holds the same number of layers")
    return layers // stages


def held_micro_batches(stages: int, micro_batches: int) -> dict[str, list[int]]:
    """Per stage, the most micro-batches whose activations it holds at once: torch's 1F1B
    (``min(M, P - s)``) and the lockstep (``in_flight_micro_batches``)."""
    check_schedule_sizes(stages, micro_batches, names=("stages", "micro_batches"))
    return {"1f1b": [min(micro_batches, stages - s) for s in range(stages)],
            "cad_across_stages": [in_flight_micro_batches(s, stages, micro_batches) for s in range(stages)]}


@dataclass(frozen=True)
class PipelineMethodStep:
    """One method's step.

    Attributes:
        step_s: seconds of the whole step (``M`` micro-batches through all layers, forward +
            backward): the slowest pipeline's.
        bubble_fraction: share of its stages' time without a micro-batch (idle under 1F1B; serving
            CA-tasks under ``cad_across_stages``), in the run that sets ``step_s``.
        attn_imbalance: max / mean attention pairs over the ranks that run together, averaged: the
            step's ``D x M`` rows (the 1F1B methods), a micro-batch's ``D`` servers (``cad_per_stage``)
            or a tick's ``P x D`` servers (``cad_across_stages``).
    """

    step_s: float
    bubble_fraction: float
    attn_imbalance: float


def pool_pieces(parts, num_ranks: int) -> DocumentPieces:
    """``parts``: ``(pieces, rank_offset)``; one ``DocumentPieces`` over ``num_ranks`` with every part's
    documents numbered apart, in part order."""
    rank, doc, start, end, kv_start, next_doc = [], [], [], [], [], 0
    for pieces, offset in parts:
        rank.append(pieces.rank + offset), doc.append(pieces.doc + next_doc)
        start.append(pieces.start), end.append(pieces.end), kv_start.append(pieces.kv_start)
        next_doc += int(pieces.doc.max(initial=-1)) + 1
    join = lambda a: np.concatenate(a) if a else np.zeros(0, dtype=np.int64)
    return DocumentPieces(join(rank), join(doc), join(start), join(end), num_ranks, kv_start=join(kv_start))


def rank_subset(pieces: DocumentPieces, ranks) -> tuple[DocumentPieces, np.ndarray]:
    """The pieces held by ``ranks`` (a sequence of rank numbers), renumbered: rank ``ranks[i]`` becomes
    ``i`` and their documents ``0 .. k-1``; also ``[k]`` the original id of each new document."""
    values = np.asarray(ranks)
    if (values.ndim != 1 or not (values.size == 0 or np.issubdtype(values.dtype, np.integer))
            or ((values < 0) | (values >= pieces.num_ranks)).any() or np.unique(values).size != values.size):
        raise ValueError(f"ranks must be distinct rank numbers in [0, {pieces.num_ranks}), got {ranks!r}")
    ranks = values.astype(np.int64)
    local = np.full(pieces.num_ranks, -1, dtype=np.int64)
    local[ranks] = np.arange(ranks.size)
    keep = local[pieces.rank] >= 0
    doc_ids, doc = np.unique(pieces.doc[keep], return_inverse=True)
    return DocumentPieces(local[pieces.rank[keep]], doc, pieces.start[keep], pieces.end[keep], int(ranks.size),
                          kv_start=pieces.kv_start[keep]), doc_ids


def attention_only(config: PlannerConfig, num_ranks: int) -> PlannerConfig:
    """``config`` with no rank's work besides attention counted (``base_pairs`` all 0): how a lockstep
    tick is balanced and judged, since its exchanges synchronise the ranks around every layer's
    attention (module docstring)."""
    return dataclasses.replace(config, base_pairs=(0.0,) * num_ranks)


def tick_layer_seconds(plan: Plan, pooled: DocumentPieces, config: PlannerConfig) -> float:
    """Seconds of one layer of a lockstep tick under ``plan`` (module docstring): the slowest rank's
    linear layers (its tokens of ``pooled``; none on a bubble) plus the slowest rank's attention and
    exposed communication (K/V relays' rounds and waits included), each measured between the layer's
    synchronising exchanges."""
    linear = other_seconds(pooled.tokens(), dataclasses.replace(config, base_pairs=None))
    attention = rank_seconds(plan, pooled, attention_only(config, pooled.num_ranks))
    return float(linear.max(initial=0.0) + attention.max(initial=0.0))


def plan_lockstep_tick(pooled: DocumentPieces, config: PlannerConfig, *, rank_groups) -> Plan:
    """One lockstep tick's plan over ``pooled``, every stage's pieces (all ``P x D`` ranks; a rank in a
    bubble holds nothing, or the runtime's one dummy token). ``rank_groups``: the ranks of each stage
    (its ``D`` data-parallel copies), which hold no document in common.

    Every layer's exchanges synchronise the tick's ranks before and after its attention, so a rank
    that runs less linear work (a bubble runs none; the other stages run no LM head) only waits at the
    exchange for the others' and cannot use that time for attention: the tick's attention is balanced
    on its own (``attention_only``; balancing it against the linear work, as the ticks did before,
    gave a bubble twice the attention of a busy rank and made that rank wait, measured on the bench's
    2-process pipeline). With a numeric tolerance that pooled plan is the tick's. Under
    ``tolerance="auto"`` (plan by time) the candidates are the pooled plan and the union of each
    stage's own plan over its ranks, and the one ``config.time_model`` predicts fastest is the tick's
    (ties: the earlier), so a tick is never predicted slower than its stages balanced alone: pooling
    spreads attention over more servers but also spreads a long document's K/V to more of them, and
    every holder sends its K/V to each server of its document's shards. The runtime
    (``runtime.pipeline_schedules``) and ``distca-hf simulate`` both plan ticks here."""
    config = attention_only(config, pooled.num_ranks)
    plan = plan_tasks(pooled, config)
    if config.tolerance != "auto" or config.servers is not None:  # (a pool names pooled ranks)
        return plan
    groups = [np.asarray(g, dtype=np.int64) for g in rank_groups]
    groups = [g for g in groups if np.isin(pooled.rank, g).any()]
    # a stage of one rank plans colocated on its own, which the pooled plan already weighed (plan_by_time)
    if len(groups) < 2 or all(g.size == 1 for g in groups):
        return plan
    own = lambda ranks: attention_only(config, len(ranks))  # each stage's plan over its ranks, also balanced alone
    candidates = [plan, _union_of_stage_plans(pooled, groups, own, config)]
    seconds = [step_seconds(candidate, pooled, config) for candidate in candidates]
    return candidates[int(np.argmin(seconds))]


def _union_of_stage_plans(pooled: DocumentPieces, groups, config_of, config: PlannerConfig) -> Plan:
    """Each stage's own plan over its ranks (``config_of(ranks)`` plans it), as one plan over ``pooled``."""
    local, modes, splits, trees = [], set(), False, []
    for group in groups:
        pieces, doc_ids = rank_subset(pooled, group)
        own = plan_tasks(pieces, config_of(group))
        # key ranges are positions in a document: they carry over as they are (whole prefixes where unsplit)
        local.append((group[own.source], group[own.server], doc_ids[own.doc], own.q_start, own.q_end,
                      *(np.asarray(k, dtype=np.int64) for k in own.key_ranges())))
        modes.add(own.backward)
        splits = splits or own.splits_keys
        if own.relays is not None and own.relays.num_groups:  # its relay trees, in pooled ranks and documents
            trees.append(own.relays.renamed(group, doc_ids))
    source, server, doc, q_start, q_end, k_start, k_end = (np.concatenate(column) for column in zip(*local))
    # one mode for the union: resend (servers keep nothing) if any stage's plan needs it
    return Plan(source, server, doc, q_start, q_end, pooled.num_ranks, tuple(range(pooled.num_ranks)), config.window,
                "resend" if "resend" in modes else config.backward,
                k_start=k_start if splits else None, k_end=k_end if splits else None,
                relays=RelayTrees.joined(trees) if trees else None)


def _seconds(loads: RankLoads, model: TimeModel, exposed_comm: float, backward: str) -> np.ndarray:
    compute, exposed = loads_seconds(loads, model, exposed_comm, backward)
    return compute + exposed


def _rows(loads: RankLoads, rows) -> RankLoads:
    return RankLoads(*(getattr(loads, f.name)[rows] for f in dataclasses.fields(RankLoads)))


def _independent_pipelines(row_forward, row_backward, stages: int, per_stage: int, p2p_s: float):
    """``row_*``: ``[M, D]`` seconds of one layer of each row; the slowest of the ``D`` pipelines."""
    runs = [simulate_1f1b(np.tile(per_stage * row_forward[:, d], (stages, 1)),
                          np.tile(per_stage * row_backward[:, d], (stages, 1)), p2p_s=p2p_s)
            for d in range(row_forward.shape[1])]
    return max(runs, key=lambda run: run.step_s)


def _step(run: PipelineRun, attn_imbalance: float) -> PipelineMethodStep:
    return PipelineMethodStep(float(run.step_s), float(run.bubble_fraction), float(attn_imbalance))


def check_step(micro_batch_docs, *, stages: int, data_parallel: int, tokens: int, layers: int,
               activation_bytes_per_token: int) -> tuple[int, list[np.ndarray]]:
    """``(layers per stage, micro-batches as int64 arrays)`` of one step's arguments
    (``pipeline_step``'s), refused with the argument named where they cannot be a step. Documents of
    length 0 hold nothing to time and are dropped; a micro-batch must keep at least one token."""
    per_stage = check_layers(layers, stages)
    for name, value in (("data_parallel", data_parallel), ("tokens", tokens)):
        if not is_integer(value) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if not is_integer(activation_bytes_per_token) or activation_bytes_per_token < 0:
        raise ValueError(f"activation_bytes_per_token must be an integer >= 0 (hidden size x dtype bytes), got "
                         f"{activation_bytes_per_token!r}")
    if isinstance(micro_batch_docs, np.ndarray) and micro_batch_docs.ndim == 2:
        micro_batch_docs = list(micro_batch_docs)
    if not isinstance(micro_batch_docs, (list, tuple)):
        raise ValueError(f"micro_batch_docs must be a list of micro-batches (lists of document lengths), got "
                         f"{micro_batch_docs!r}")
    micro_batch_docs = [check_document_lengths(docs, f"micro_batch_docs[{i}]") for i, docs in enumerate(micro_batch_docs)]
    if not micro_batch_docs:
        raise ValueError("micro_batch_docs must hold at least one micro-batch")
    for i, docs in enumerate(micro_batch_docs):
        if not docs.sum():
            raise ValueError(f"micro_batch_docs[{i}] holds no tokens: every micro-batch needs at least one")
        if int(docs.sum()) > data_parallel * tokens:
            raise ValueError(f"micro-batch {i} holds {int(docs.sum())} tokens, more than data_parallel "
                             f"({data_parallel}) x tokens ({tokens})")
    return per_stage, [docs[docs > 0] for docs in micro_batch_docs]


def pipeline_step(micro_batch_docs, *, stages: int, data_parallel: int, tokens: int, layers: int,
                  config: PlannerConfig, activation_bytes_per_token: int) -> dict[str, PipelineMethodStep]:
    """Time one step for each of ``PIPELINE_METHODS`` (module docstring).

    Args:
        micro_batch_docs: ``M`` arrays of document lengths, micro-batch ``m``'s documents in order
            (at most ``data_parallel * tokens`` tokens each).
        stages: ``P``. data_parallel: ``D``, the pipelines. tokens: ``T``, tokens of a row.
        layers: the model's decoder layers, a multiple of ``stages``.
        config: the planner's settings; its ``time_model`` and ``exposed_comm`` time every method
            (and ``tolerance="auto"`` plans with them).
        activation_bytes_per_token: bytes of one token's hidden state sent between stages (hidden
            size x dtype bytes).

    Returns:
        ``{method: PipelineMethodStep}``.
    """
    if not isinstance(config, PlannerConfig):
        raise TypeError(f"config must be a PlannerConfig, got {type(config).__name__}")
    per_stage, micro_batch_docs = check_step(micro_batch_docs, stages=stages, data_parallel=data_parallel,
                                             tokens=tokens, layers=layers,
                                             activation_bytes_per_token=activation_bytes_per_token)
    m, d = len(micro_batch_docs), data_parallel
    model, exposed, token_bytes = config.time_model, config.exposed_comm, config.token_bytes
    saved_models = forward_backward_models(model, "saved")
    p2p_s = tokens * activation_bytes_per_token / model.bytes_per_s
    packed = [pack_pieces(docs, d, tokens) for docs in micro_batch_docs]
    results = {}

    # colocated_1f1b: every row its own attention, D pipelines on their own
    row_f, row_b, row_pairs = np.zeros((m, d)), np.zeros((m, d)), []
    for i, pieces in enumerate(packed):
        loads = plan_loads(colocated_plan(pieces, window=config.window), pieces, token_bytes)
        row_f[i], row_b[i] = (_seconds(loads, part, exposed, "saved") for part in saved_models)
        row_pairs.append(loads.pairs)
    results["colocated_1f1b"] = _step(_independent_pipelines(row_f, row_b, stages, per_stage, p2p_s),
                                      imbalance(np.concatenate(row_pairs)))

    # balanced_micro_batches: the step's documents over its D x M rows (row i * D + j: micro-batch i of
    # pipeline j), each row its own attention
    balanced = balance_micro_batches(np.concatenate(micro_batch_docs), micro_batches=m * d, tokens=tokens,
                                     window=config.window)
    loads = plan_loads(colocated_plan(balanced, window=config.window), balanced, token_bytes)
    for i in range(m):  # a micro-batch's rows meet in its collectives (collective_s) only among themselves
        rows = np.arange(i * d, (i + 1) * d)
        row_f[i], row_b[i] = (_seconds(_rows(loads, rows), part, exposed, "saved") for part in saved_models)
    results["balanced_micro_batches"] = _step(_independent_pipelines(row_f, row_b, stages, per_stage, p2p_s),
                                              imbalance(loads.pairs))

    # cad_per_stage: one plan per micro-batch over the stage's D copies; an op lasts as its slowest copy
    op_f, op_b, imbalances = np.zeros(m), np.zeros(m), []
    for i, pieces in enumerate(packed):
        plan = plan_tasks(pieces, config)  # in the mode it chose within the memory budget
        op_f[i], op_b[i] = (step_seconds(plan, pieces, dataclasses.replace(config, time_model=part, base_pairs=None))
                            for part in forward_backward_models(model, plan.backward))
        imbalances.append(imbalance(plan.server_pairs()))
    run = simulate_1f1b(np.tile(per_stage * op_f, (stages, 1)), np.tile(per_stage * op_b, (stages, 1)), p2p_s=p2p_s)
    results["cad_per_stage"] = _step(run, np.mean(imbalances))

    # cad_across_stages: one plan per tick over all P x D ranks, bubbles serving; a backward tick
    # re-plans, so every tick runs in resend mode (module docstring)
    tick_s, imbalances = [], []
    resend_models = forward_backward_models(model, "resend")
    for tick in lockstep_1f1b_ticks(stages, m):
        tick_model = resend_models[0] if tick.kind == FORWARD else resend_models[1]
        parts = [(packed[mb], s * d) for s, mb in enumerate(tick.micro_batches) if mb is not None]
        pooled = pool_pieces(parts, stages * d)
        plan = plan_lockstep_tick(pooled, dataclasses.replace(config, time_model=tick_model, backward="resend"),
                                  rank_groups=[range(offset, offset + d) for _, offset in parts])
        tick_s.append(per_stage * tick_layer_seconds(plan, pooled, dataclasses.replace(config,
                                                                                        time_model=tick_model)))
        imbalances.append(imbalance(plan.server_pairs()))
    run = simulate_lockstep(tick_s, num_stages=stages, num_micro_batches=m, p2p_s=p2p_s)
    results["cad_across_stages"] = _step(run, np.mean(imbalances))
    return results
