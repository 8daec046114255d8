"""Pipeline schedules on ``torch.distributed.pipelining``: torch's stock ones and ``cad_1f1b``.

``build_pipeline_schedule`` returns one of

- ``gpipe`` / ``1f1b``: torch's ``ScheduleGPipe`` / ``Schedule1F1B``. Attention inside each stage is
  distca's as usual: its CA-tasks are balanced over the stage's data-parallel copies (the plugin's
  server group), which run each micro-batch together.
- ``cad_1f1b``: ``LockstepCAD1F1B``, the lockstep 1F1B of ``planning.pipeline``. All stages run the
  same kind of tick at once, so local layer ``j`` of every stage runs together, and each tick's
  CA-tasks are pooled over every data-parallel x pipeline rank (``pooled_group``): a rank in a
  pipeline bubble serves the others' attention instead of idling. The plans of every tick are made
  once per step, from all ranks' micro-batch lengths (one all-gather), by ``planning.plan_lockstep_tick``
  (as ``distca-hf simulate`` models them: under ``tolerance="auto"`` the pooled plan or each stage's
  own, whichever the time model predicts faster, with the key-split tiles it predicts pay, where every
  layer runs them exactly: ``_tiles_hold``). Forward ticks pool forwards;
  a backward tick pools the backwards that run together, which ran their forwards in different
  ticks, so its plan is a separate one (``Dispatch.backward``) and the forward runs in ``resend``
  mode: the backward re-sends q, k, v, out and dO to the backward tick's servers and needs nothing
  a forward server kept.

  A bubble runs its stage on one dummy token (position 0): its forward joins the forward tick's
  exchanges; in a backward tick it runs a forward that computes locally (no exchange) and a
  backward of zeros that joins the backward tick's exchanges. The dummy token is one more
  one-token document in the plans; its output and its zero gradients change nothing.

  Activation checkpointing: a backward tick runs under that tick's plan pinned, so a checkpointed
  layer's recomputation computes its attention in the backward tick's pooled exchange, which every
  rank of the tick (bubbles included) joins in the same layer order; the backward that follows
  resends as without checkpointing (torch's reentrant and non-reentrant checkpoints both: either the
  forward's autograd node runs with the recomputed tensors, or the recomputation's own node, and
  both run the backward tick's plan). It costs the recomputation's exchange (one forward's bytes)
  on top of the resend, and needs the same layers checkpointed on every stage (local layer ``j``).

  What it requires: the same number of attention layers on every stage, local layer ``j`` of every
  stage the same attention (scale, window, softcap) and the same checkpointing, one stage per rank
  (no interleaving), no ``servers`` subset. What it costs: stage ``s`` holds up to ``2 (P - s) - 1``
  micro-batches' activations (1F1B: ``P - s``; activation checkpointing keeps only each layer's
  input of them), the backward's ``resend`` bytes, and ``overlap="pingpong"`` runs as ``"wave"``.

Loss convention of all three: ``scale_grads=False``; the loss function returns each micro-batch's
summed token loss divided by the label tokens of the whole step (token-weighted, as one process
would), so gradients need no further scaling.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import zlib

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from ..config import (PINGPONG_AS_WAVE, PIPELINE_SCHEDULES, DistCAConfig, cad_1f1b_servers_problem,
                      current_config)
from ..planning import (BACKWARD, FORWARD, TokenBytes, backward_slot, lockstep_1f1b_ticks, plan_lockstep_tick,
                        stitch_rank_documents)
from ..state import warn_once
from .agree import PATH_PLAIN, agree, attention_dtype
from .context import ForwardContext, next_forward_number, pinned_forward, plan_stats_of
from .forward import CallInputs, layer_window, plan_batch, tiles_hold_for

__all__ = ["PIPELINE_SCHEDULES", "LockstepCAD1F1B", "build_pipeline_schedule", "check_micro_batches"]


def _start(ops: list) -> list:
    """Start a stage's point-to-point ops (``PipelineStage.get_*_ops``) as one batch; their works."""
    return dist.batch_isend_irecv(ops) if ops else []


def _finish(works: list) -> None:
    for work in works:
        work.wait()


def check_micro_batches(schedule: str, micro_batches: int, num_stages: int, *, setting: str = "micro_batches") -> None:
    """Refuse fewer micro-batches per step than stages under ``1f1b`` (torch's ``Schedule1F1B`` warms
    up one per stage), naming ``setting``; ``gpipe`` and ``cad_1f1b`` run with any number."""
    if schedule == "1f1b" and micro_batches < num_stages:
        raise ValueError(f"pipeline_schedule='1f1b' needs at least {num_stages} micro-batches per step (one per "
                         f"stage), got {setting}={micro_batches}; raise it or use pipeline_schedule='gpipe' or "
                         "'cad_1f1b'")


def build_pipeline_schedule(stage: PipelineStage, *, schedule: str, micro_batches: int, loss_fn,
                            pooled_group=None) -> PipelineScheduleSingle:
    """The schedule named ``schedule`` (one of ``PIPELINE_SCHEDULES``) over ``stage``, running
    ``micro_batches`` micro-batches per ``step``; ``loss_fn(logits, targets)`` runs on the last
    stage (see the module docstring for its scaling); ``pooled_group``: the ranks ``cad_1f1b``
    pools CA-tasks over, every stage of every data-parallel pipeline (``None``: the default group).

    Build ``stage`` with static shapes (``input_args``, ``output_args``, and ``output_grads`` on all
    but the last stage, ``input_grads`` on all but the first, inputs of later stages with
    ``requires_grad=True``): torch's shape inference would run the stage on meta tensors, which
    distca's attention cannot, and without the gradients' shapes torch treats them as ``None``."""
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"pipeline_schedule must be one of {PIPELINE_SCHEDULES}, got {schedule!r}")
    if not isinstance(micro_batches, int) or isinstance(micro_batches, bool) or micro_batches < 1:
        raise ValueError(f"pipeline micro-batches must be an integer >= 1, got {micro_batches!r}")
    if schedule == "gpipe":
        return ScheduleGPipe(stage, micro_batches, loss_fn=loss_fn, scale_grads=False)
    if schedule == "1f1b":
        check_micro_batches(schedule, micro_batches, stage.num_stages)
        return Schedule1F1B(stage, micro_batches, loss_fn=loss_fn, scale_grads=False)
    return LockstepCAD1F1B(stage, micro_batches, loss_fn=loss_fn, pooled_group=pooled_group)


@dataclasses.dataclass(eq=False)
class _StepPlans:
    """This rank's plans for every tick of one step (``ForwardContext`` per slot).

    Attributes:
        forward: per forward slot, the context of that tick's forward on this rank (its micro-batch,
            or the bubble's dummy token); a micro-batch's dispatch carries its backward tick's.
        backward: per backward slot, this rank's context of that tick's pooled plan (its micro-batch,
            or the bubble's dummy token), pinned while the tick's backward runs: activation
            checkpointing's recomputation computes its attention with it.
        backward_bubbles: per backward slot in which this rank is a bubble, a context that computes
            the dummy token locally and runs its backward in the tick's pooled plan.
    """

    forward: dict
    backward: dict
    backward_bubbles: dict


class LockstepCAD1F1B(PipelineScheduleSingle):
    """``pipeline_schedule="cad_1f1b"`` (see the module docstring): torch's single-stage schedule
    interface; the stage's ``forward_one_chunk`` / ``backward_one_chunk`` and send/receive ops run in
    the order of ``planning.lockstep_1f1b_ticks``, each tick under its pinned plan."""

    def __init__(self, stage: PipelineStage, n_microbatches: int, *, loss_fn=None, pooled_group=None):
        super().__init__(stage, n_microbatches, loss_fn=loss_fn, scale_grads=False)
        self._pooled_group = pooled_group

    # -- the step -------------------------------------------------------------------------------

    def _step_microbatches(self, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None, return_outputs=True,
                           loss_kwargs=None):
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        stage = self._stage
        self._initialize_stage(arg_mbs[0], kwarg_mbs[0], target_mbs[0] if target_mbs is not None else None,
                               loss_kwargs)
        training = bool(stage.has_backward)
        plans = self._plan_step(kwarg_mbs, training)
        sends = []
        for tick in lockstep_1f1b_ticks(self._num_stages, self._n_microbatches):
            if tick.kind == BACKWARD and not training:
                continue
            mb = tick.micro_batch_of(stage.stage_index)
            if tick.kind == FORWARD:
                if mb is None:
                    self._bubble(plans.forward[tick.slot], backward=False)
                    continue
                _finish(_start(stage.get_fwd_recv_ops(mb)))
                with pinned_forward(plans.forward[tick.slot]):
                    output = stage.forward_one_chunk(mb, arg_mbs[mb], kwarg_mbs[mb],
                                                     save_forward_output=return_outputs)
                sends.append(_start(stage.get_fwd_send_ops(mb)))
                self._maybe_compute_loss(stage, output, target_mbs, mb, loss_kwargs)
            else:
                if mb is None:
                    self._bubble(plans.backward_bubbles[tick.slot], backward=True,
                                 recompute=plans.backward[tick.slot])
                    continue
                _finish(_start(stage.get_bwd_recv_ops(mb)))
                # a recomputation's attention (activation checkpointing) joins the tick's exchange
                with pinned_forward(plans.backward[tick.slot], current=False):
                    stage.backward_one_chunk(mb, loss=self._maybe_get_loss(stage, mb),
                                             last_backward=mb == self._n_microbatches - 1)
                sends.append(_start(stage.get_bwd_send_ops(mb)))
        for works in sends:
            _finish(works)
        self._update_losses(stage, losses)
        if training:
            stage.perform_reduce_grad(1)

    def _bubble(self, context: ForwardContext, *, backward: bool, recompute: ForwardContext | None = None) -> None:
        """Serve the tick's CA-tasks with the stage run on one dummy token (see the module docstring);
        ``recompute``: the backward tick's pooled context, pinned for the backward (a checkpointed
        layer recomputes its attention in the tick's exchange, like the ranks running micro-batches)."""
        dummy, kwargs = self._dummy_inputs()
        run = self._stage.submod.forward  # not __call__: the dummy is no micro-batch for the module's hooks
        if not backward:
            with torch.no_grad(), pinned_forward(context):
                run(dummy, **kwargs)
            return
        with torch.enable_grad(), pinned_forward(context):
            out = run(dummy, **kwargs)
        outputs = [t for t in (out if isinstance(out, (tuple, list)) else (out,))
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        with pinned_forward(recompute, current=False):
            torch.autograd.backward(outputs, [torch.zeros_like(t) for t in outputs])

    def _dummy_inputs(self):
        """One token at position 0: token id 0 on the first stage, a zero hidden state elsewhere."""
        device = self._stage.device
        kwargs = {"position_ids": torch.zeros(1, 1, dtype=torch.long, device=device)}
        if self._stage.is_first:
            return torch.zeros(1, 1, dtype=torch.long, device=device), kwargs
        config = self._model_config()
        dtype = next((p.dtype for p in self._stage.submod.parameters() if p.is_floating_point()), torch.float32)
        # requires grad like a received hidden state: a reentrant checkpoint recomputes (and joins the tick's
        # exchange) only when an input requires grad
        return torch.zeros(1, 1, config.hidden_size, dtype=dtype, device=device, requires_grad=True), kwargs

    def _attention_layout(self) -> int:
        """A checksum of what this stage's attention layers compute, in order: their kind (``layer_types``),
        scale, window, softcap and head shapes, and which decoder layers activation checkpointing recomputes.
        A server computes every rank's CA-tasks of local layer ``j`` with its own layer ``j``, and a recomputed
        layer joins one more exchange in the backward, so the stages must agree on it (``_read_payloads``
        checks)."""
        training = self._stage.submod.training
        layout = [("checkpointed", [bool(training and getattr(m, "gradient_checkpointing", False) is True)
                                    for m in self._stage.submod.modules() if type(m).__name__.endswith("DecoderLayer")])]
        for module in self._stage.submod.modules():
            index = getattr(module, "layer_idx", None)
            if index is None or not type(module).__name__.endswith("Attention"):
                continue
            config = getattr(module, "config", None) or self._model_config()  # the whole model's (layer_idx is global)
            layer_types = getattr(config, "layer_types", None) or ()
            kind = layer_types[index] if index < len(layer_types) else "full_attention"
            layout.append((kind, getattr(module, "scaling", None), layer_window(module),
                           getattr(config, "attn_logit_softcapping", None), getattr(module, "head_dim", None),
                           getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)))
        return zlib.crc32(repr(layout).encode()) if len(layout) > 1 else -1

    def _model_config(self):
        config = getattr(self._stage.submod, "config", None)
        if config is None:
            config = next((m.config for m in self._stage.submod.modules() if hasattr(m, "config")), None)
        if config is None:
            raise ValueError("pipeline_schedule='cad_1f1b' needs a stage module with an HF `config` (hidden size, "
                             "heads); build stages with distca_hf.training.pipeline_stages.build_stage_module")
        return config

    def _tiles_hold(self) -> bool:
        """Whether the tick plans may hold key-split tiles (``PlannerConfig.key_split``): the model's
        layers are all of one type and none chunked (``forward.tiles_hold_for``), and none of this stage's
        attention layers has a sliding window, because a tick is planned with whole prefixes (no
        ``kv_window``) and a key-split plan runs only at its own window (``phases.check_layer_window``).
        The same on every rank: the config is the whole model's, and the stages' windows are part of
        ``_attention_layout``, which ``_read_payloads`` requires equal."""
        windows = [layer_window(m) for m in self._stage.submod.modules()
                   if getattr(m, "layer_idx", None) is not None and type(m).__name__.endswith("Attention")]
        return tiles_hold_for(types.SimpleNamespace(config=self._model_config())) and \
            all(w is None for w in windows)

    # -- planning every tick of a step -----------------------------------------------------------

    def _pooled_config(self) -> DistCAConfig:
        config = current_config()
        problem = cad_1f1b_servers_problem(config.servers)
        if problem:
            raise ValueError(problem)
        overlap = config.overlap
        if overlap == "pingpong":
            warn_once("cad_1f1b-pingpong", PINGPONG_AS_WAVE)
            overlap = "wave"
        return dataclasses.replace(config, group=self._pooled_group, backward="resend", overlap=overlap)

    def _describe(self, kwarg_mbs, config: DistCAConfig):
        """This rank's micro-batches as ``(documents, first_position)`` each, and the payload the
        step's all-gather carries: ``[stage, M, attention layout, then per micro-batch: first_position,
        count, lengths]``."""
        described, error = [], None
        try:
            layout = self._attention_layout()
        except Exception as problem:  # e.g. no HF config: agree() below stops every rank with it, none waits
            layout, error = -1, problem
        payload = [self._stage.stage_index, self._n_microbatches, layout]
        for i, kwargs in enumerate(kwarg_mbs if error is None else ()):
            position_ids = (kwargs or {}).get("position_ids")
            if position_ids is None:
                error = ValueError(f"pipeline_schedule='cad_1f1b': micro-batch {i} has no position_ids; pass "
                                   "position_ids=... to schedule.step on every stage (they describe the documents)")
                break
            rows, seq = position_ids.reshape(-1, position_ids.shape[-1]).shape
            docs, first, error = CallInputs(rows, seq, seq, None, position_ids, None, None).describe(
                span_ranks=config.span_ranks)
            if error is not None:
                break
            described.append((docs, first))
            payload += [first, docs.num_docs, *docs.lengths.tolist()]
        return described, np.asarray(payload, dtype=np.int64), error

    def _plan_step(self, kwarg_mbs, training: bool) -> _StepPlans:
        config = self._pooled_config()
        number = next_forward_number()
        described, payload, error = self._describe(kwarg_mbs, config)
        _, gathered = agree(payload, PATH_PLAIN, error, config, self._stage.device, number,
                            "planning a cad_1f1b pipeline step")
        stages, per_rank = _read_payloads(gathered, self._num_stages, self._n_microbatches, number)
        me = dist.get_rank(config.group)
        dummy = CallInputs(1, 1, 1, None, torch.zeros(1, 1, dtype=torch.long), None, None).documents()
        token_bytes, heads = self._token_bytes()
        p, m = self._num_stages, self._n_microbatches

        ticks = {(t.kind, t.slot): t for t in lockstep_1f1b_ticks(p, m)}
        stage_ranks = [[r for r, stage in enumerate(stages) if stage == s] for s in range(p)]
        key_split = self._tiles_hold()  # tiles chosen by time, when exact for every layer (agreed by all ranks)

        def plan(kind: str, slot: int, *, local: bool = False):
            mb_of = ticks[(kind, slot)].micro_batch_of
            lengths, firsts = [], []
            for r, stage in enumerate(stages):
                mb = mb_of(stage)
                if local and r != me:
                    lengths.append(np.zeros(0, dtype=np.int64)), firsts.append(0)
                elif mb is None:
                    lengths.append(np.ones(1, dtype=np.int64)), firsts.append(0)
                else:
                    lengths.append(per_rank[r][mb][1]), firsts.append(per_rank[r][mb][0])
            mine = mb_of(stages[me])
            docs = dummy if mine is None else described[mine][0]
            ranks = stitch_rank_documents(lengths, [np.zeros_like(x) for x in lengths], firsts,
                                          span_ranks=config.span_ranks)
            tick_number = next_forward_number()
            planning = dataclasses.replace(config, mode="colocated") if local else config
            planner = functools.partial(plan_lockstep_tick, rank_groups=stage_ranks)
            dispatch, planned = plan_batch(docs, ranks, planning, token_bytes, self._stage.device, tick_number,
                                           "none" if local else config.overlap, planner=planner,
                                           key_split=key_split)
            stats = plan_stats_of(tick_number, [planned], token_bytes=token_bytes, num_heads=heads, overlap=config.overlap)
            return ForwardContext(tick_number, (), (), ranks.longest_document, stats, dispatch=dispatch,
                                  counters=dispatch.counters), mine

        slots = m + p - 1
        backward = {}
        if training:
            backward = {b: plan(BACKWARD, b) for b in range(slots)}
        forward, bubbles = {}, {}
        for f in range(slots):
            context, mb = plan(FORWARD, f)
            if mb is not None and training:
                context.dispatch.backward = backward[backward_slot(stages[me], mb, p)][0].dispatch
            forward[f] = context
        for b, (context, mb) in backward.items():
            if mb is None:
                local, _ = plan(BACKWARD, b, local=True)
                local.dispatch.backward = context.dispatch
                bubbles[b] = local
        return _StepPlans(forward, {b: context for b, (context, _) in backward.items()}, bubbles)

    def _token_bytes(self) -> tuple[TokenBytes, int]:
        """Bytes of one token's q, k + v and output in the attention layers (for the time model and
        the stats), and the query heads."""
        config = self._model_config()
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        parameters = next((p.dtype for p in self._stage.submod.parameters() if p.is_floating_point()), torch.float32)
        element = attention_dtype(self._stage.device.type, parameters).itemsize
        return TokenBytes.for_model(config.hidden_size, heads, kv_heads, element, getattr(config, "head_dim", None)), heads


def _read_payloads(gathered, num_stages: int, micro_batches: int, number: int):
    """Every pooled rank's stage and, per micro-batch, ``(first_position, lengths)``; the same error on
    every rank when the ranks do not run one pipeline shape."""
    stages, per_rank, layouts = [], [], {}
    for r, payload in enumerate(gathered):
        payload = np.asarray(payload, dtype=np.int64)
        stage, count = int(payload[0]), int(payload[1])
        layouts.setdefault(int(payload[2]), []).append(stage)
        if count != micro_batches:
            raise ValueError(f"distca forward {number}: pipeline_schedule='cad_1f1b' needs the same micro-batches per "
                             f"step on every rank; rank {r} runs {count}, others {micro_batches}")
        i, batches = 3, []
        for _ in range(count):
            first, n = int(payload[i]), int(payload[i + 1])
            batches.append((first, payload[i + 2: i + 2 + n]))
            i += 2 + n
        stages.append(stage)
        per_rank.append(batches)
    if len(layouts) > 1 or -1 in layouts:
        groups = "; ".join(f"stages {sorted(set(v))}" for v in layouts.values())
        raise ValueError(
            f"distca forward {number}: pipeline_schedule='cad_1f1b' runs local attention layer j of every stage "
            f"together, so every stage must hold the same attention layers in the same order (kind, window, scale, "
            f"heads) and checkpoint the same of them, but they differ between {groups} (e.g. alternating sliding and "
            "full layers with a layer count per stage that breaks the pattern, a stage without attention layers, or "
            "activation checkpointing on some stages' layers only); choose pipeline_parallel_size so that each stage "
            "gets the same layer pattern, enable activation checkpointing on every stage alike, or use "
            "pipeline_schedule='1f1b'")
    missing = sorted(set(range(num_stages)) - set(stages))
    if missing:
        raise ValueError(f"distca forward {number}: pipeline_schedule='cad_1f1b' pools every stage's ranks, but no "
                         f"rank of the pooled group runs stage(s) {missing}; pass pooled_group=None (all ranks) or a "
                         "group holding whole pipelines")
    return stages, per_rank
