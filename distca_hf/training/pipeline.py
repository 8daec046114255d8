"""Training an HF causal LM in pipeline stages: the glue between the stage modules, torch's
``PipelineStage``, the schedules and the optimizer step.

    runner = apply_pipeline_parallel(model, topology=topology, rank=rank, schedule="1f1b",
                                     tokens_per_micro_batch=8192, device=device, timeout_s=600)
    loss = runner.train_step(rows)           # one optimizer step's micro-batches (packed rows)
    norm = runner.clip_grad_norm_(1.0)       # over every stage's parameters
    optimizer.step()                         # over runner.stage_module.parameters()

What one ``train_step`` does, on every rank of the job:

1. the micro-batches (one packed row of ``tokens_per_micro_batch`` tokens per data-parallel rank each;
   every stage of a pipeline holds the same rows) are stacked into ``[M, T]`` input ids (first stage),
   positions (every stage: the attention finds the documents in them) and targets (last stage):
   ``shift_labels``, so the last token of a piece predicts the first token of the next rank's piece
   (contract "documents spanning ranks");
2. the label tokens of the whole step are counted over the stage's data-parallel group: the loss of a
   micro-batch is its summed token cross-entropy divided by that count, so the step's loss and
   gradients are token-weighted exactly like one process running every document;
3. the schedule (``runtime.pipeline_schedules``: ``gpipe``, ``1f1b`` or ``cad_1f1b``) runs the
   forwards and backwards, sending activations and their gradients between stages over the
   pipeline's group (made with distca's ``timeout_s``: a dead peer gives an error, not a hang);
4. gradients are summed over the stage's data-parallel copies (not averaged: the loss is already
   normalised by the global token count) and the tied embedding's between the first and last stage;
5. the step's loss is summed over the last stages and handed to every rank.

A stage whose own code raises re-raises its error; its peers, waiting for it, raise
``DistCAPeerError`` naming their stage and the stages they lost (after at most ``timeout_s``).
"""

from __future__ import annotations

import datetime
import inspect
import math
from typing import Sequence

import torch
import torch.distributed as dist

from ..config import PIPELINE_SCHEDULES, setting_problem
from ..errors import DistCAPeerError, DistCATimeoutError
from .topology import ParallelTopology

__all__ = ["PipelineRunner", "apply_pipeline_parallel", "pipeline_targets"]


def pipeline_targets(inputs: dict) -> torch.Tensor:
    """The already-shifted targets of a packed row (``[1, T]`` int64, -100 not trained): its
    ``shift_labels`` (they carry the label across a rank boundary), else ``labels`` shifted by one."""
    if "shift_labels" in inputs:
        return inputs["shift_labels"]
    labels = inputs["labels"]
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)


def apply_pipeline_parallel(model, *, topology: ParallelTopology, rank: int, schedule: str,
                            tokens_per_micro_batch: int, device, timeout_s: float) -> "PipelineRunner":
    """Split ``model`` (a full HF causal LM) into this rank's stage and return its ``PipelineRunner``.

    Args:
        model: the HF model, already loaded (the other stages' parameters are dropped here).
        topology: the job's topology; ``topology.pipeline_parallel`` stages, ranks laid out as
            ``training.topology`` says (a stage is a block of ``data * tensor`` ranks).
        rank: this process's global rank.
        schedule: one of ``PIPELINE_SCHEDULES``.
        tokens_per_micro_batch: tokens of one packed row (``PackingConfig.tokens_per_rank``); every
            micro-batch has exactly this many (``PackedDataset(full_rows=True)``).
        device: the device the stage runs on.
        timeout_s: seconds a pipeline peer may be silent before the wait raises.
    """
    from .pipeline_stages import build_stage_module

    pipeline = topology.pipeline_parallel
    stage_index = topology.coordinates(rank)[1]
    stage_module = build_stage_module(model, stage_index=stage_index, num_stages=pipeline)
    return PipelineRunner(stage_module.to(device), topology=topology, rank=rank, schedule=schedule,
                          tokens_per_micro_batch=tokens_per_micro_batch, device=device, timeout_s=timeout_s)


class PipelineRunner:
    """One rank's stage of a pipeline-parallel job: its torch ``PipelineStage`` s, schedules and groups.

    Creating it is a collective over the whole job (``torch.distributed.new_group``): every rank
    creates one, in the same order relative to its other groups.

    Args:
        stage_module: this rank's ``PipelineStageModule`` (``training.pipeline_stages``).
        topology, rank, schedule, tokens_per_micro_batch, device, timeout_s: as ``apply_pipeline_parallel``.

    Attributes:
        stage_module: the stage (the optimizer holds its parameters).
        stage_index, num_stages: this rank's stage and the pipeline's length.
        pipeline_ranks: the global ranks of this rank's pipeline, first stage first.
        data_ranks: the global ranks holding this stage for other data (the stage's data-parallel group).
    """

    def __init__(self, stage_module, *, topology: ParallelTopology, rank: int, schedule: str,
                 tokens_per_micro_batch: int, device, timeout_s: float):
        if schedule not in PIPELINE_SCHEDULES:
            raise ValueError(f"pipeline_schedule must be one of {list(PIPELINE_SCHEDULES)}, got {schedule!r}")
        problem = setting_problem("timeout_s", timeout_s)
        if problem:
            raise ValueError(f"timeout_s {problem}")
        if topology.tensor_parallel != 1:
            raise ValueError(
                f"pipeline_parallel_size={topology.pipeline_parallel} with tensor_parallel_size="
                f"{topology.tensor_parallel} is not supported: a pipeline stage runs whole layers on one rank. Use "
                "tensor_parallel_size=1 (give those ranks to data parallelism) or pipeline_parallel_size=1")
        if topology.pipeline_parallel < 2:
            raise ValueError(f"a PipelineRunner needs pipeline_parallel_size >= 2, got {topology.pipeline_parallel}")
        self.stage_module = stage_module
        self.topology = topology
        self.rank = rank
        self.schedule = schedule
        self.tokens_per_micro_batch = int(tokens_per_micro_batch)
        self.device = torch.device(device)
        self.timeout_s = float(timeout_s)
        self.stage_index = topology.coordinates(rank)[1]
        self.num_stages = topology.pipeline_parallel
        if getattr(stage_module, "stage_index", self.stage_index) != self.stage_index:
            raise ValueError(f"rank {rank} runs pipeline stage {self.stage_index}, but the stage module given is stage "
                             f"{stage_module.stage_index}")
        self.is_first = self.stage_index == 0
        self.is_last = self.stage_index == self.num_stages - 1
        timeout = datetime.timedelta(seconds=self.timeout_s)
        # every rank creates every group, in the same order (new_group is a collective over the job)
        self.pipeline_ranks = topology.group_of(rank, topology.pipeline_parallel_groups())
        self.pipeline_group = None
        for ranks in topology.pipeline_parallel_groups():
            group = dist.new_group(ranks=ranks, timeout=timeout)
            if rank in ranks:
                self.pipeline_group = group
        self.data_ranks = topology.group_of(rank, topology.data_parallel_groups())
        self.data_group = None
        if topology.data_parallel > 1:
            for ranks in topology.data_parallel_groups():
                group = dist.new_group(ranks=ranks, timeout=timeout)
                if rank in ranks:
                    self.data_group = group
        from ..runtime.shutdown import close_at_exit

        close_at_exit()  # the groups made here are destroyed before the interpreter shuts down
        self._pipelines: dict = {}  # (micro-batches, evaluating) -> (PipelineStage, schedule, step keywords)
        self._step_label_tokens = torch.ones((), dtype=torch.float64)
        # the plan of each micro-batch's forward in the last train_step, as plan_stats() gave it (the step table;
        # recorded by a forward hook that lives as long as train_step runs: not in evaluation, nor for another
        # runner of the same stage)
        self.step_plans: list[dict] = []

    def _record_plan(self, module, inputs, output) -> None:
        from ..runtime import plan_stats

        try:
            self.step_plans.append(plan_stats())
        except RuntimeError:  # no distca forward ran (another attention implementation)
            pass

    # -- torch's stages and schedules, one per micro-batch count ------------------------------------

    def _pipeline(self, micro_batches: int, *, evaluating: bool = False):
        key = (micro_batches, evaluating)
        if key not in self._pipelines:
            from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

            from ..runtime.pipeline_schedules import build_pipeline_schedule
            from .pipeline_stages import stage_io_shapes

            dtype = next(self.stage_module.parameters()).dtype
            inputs, outputs = stage_io_shapes(self.stage_module.config, stage_index=self.stage_index,
                                              num_stages=self.num_stages, micro_batch_size=1,
                                              seq_len=self.tokens_per_micro_batch, dtype=dtype,
                                              requires_grad=not evaluating)
            # static shapes: torch does not run its shape inference (the module on meta tensors)
            stage = PipelineStage(self.stage_module, self.stage_index, self.num_stages, self.device,
                                  input_args=inputs, output_args=outputs, group=self.pipeline_group)
            if evaluating:  # forward only, every schedule alike: torch's GPipe in eval mode
                schedule = ScheduleGPipe(stage, micro_batches, loss_fn=self._loss, scale_grads=False)
            else:
                schedule = build_pipeline_schedule(stage, schedule=self.schedule, micro_batches=micro_batches,
                                                   loss_fn=self._loss)
            # a training step needs the losses only: with torch's default return_outputs=True the last stage
            # would keep every micro-batch's logits ([tokens, vocab] each) until the step ends and concatenate
            # them (torch releases without the argument keep none)
            takes = not evaluating and "return_outputs" in inspect.signature(schedule.step).parameters
            self._pipelines[key] = (stage, schedule, {"return_outputs": False} if takes else {})
        return self._pipelines[key]

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One micro-batch's summed token cross-entropy over the step's label tokens (all data-parallel
        ranks, all micro-batches): the token weighting of one process running every document."""
        summed = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                   targets.reshape(-1).to(logits.device), ignore_index=-100,
                                                   reduction="sum")
        return summed / self._step_label_tokens.to(summed.device, summed.dtype)

    # -- one step -----------------------------------------------------------------------------------

    def _stack(self, micro_batches: Sequence[dict]):
        """``(input_ids, position_ids, targets)``, each ``[M, T]`` int64 on the stage's device."""
        if not micro_batches:
            raise ValueError("a pipeline step needs at least one micro-batch")
        ids, positions, targets = [], [], []
        for index, inputs in enumerate(micro_batches):
            row = inputs["input_ids"]
            if row.dim() != 2 or row.shape[0] != 1 or row.shape[1] != self.tokens_per_micro_batch:
                raise ValueError(
                    f"pipeline micro-batch {index} has input_ids of shape {tuple(row.shape)}, expected "
                    f"(1, {self.tokens_per_micro_batch}): pipeline stages exchange fixed shapes, so every micro-batch "
                    "is one packed row of exactly tokens_per_rank tokens (PackedDataset(..., full_rows=True); "
                    "DistCATrainer packs that way with pipeline_parallel_size > 1)")
            if "position_ids" not in inputs:
                raise ValueError(f"pipeline micro-batch {index} has no position_ids: the stages find the packed "
                                 "documents in them (use distca_hf.PackedCollator)")
            ids.append(row)
            positions.append(inputs["position_ids"])
            targets.append(pipeline_targets(inputs))
        return tuple(torch.cat(parts).to(self.device, torch.int64) for parts in (ids, positions, targets))

    def train_step(self, micro_batches: Sequence[dict]) -> torch.Tensor:
        """Forward and backward of one optimizer step's micro-batches (see the module docstring);
        leaves the gradients, summed over the data-parallel copies, in the stage's parameters.
        Returns the step's token-weighted loss (a 0-d float64 tensor on the device), the same on
        every rank."""
        input_ids, position_ids, targets = self._stack(micro_batches)
        label_tokens = targets.ne(-100).sum().to(torch.float64)
        if self.data_group is not None:
            dist.all_reduce(label_tokens, group=self.data_group)
        self._step_label_tokens = label_tokens.clamp(min=1)
        self.step_plans = []
        self.stage_module.train()
        recording = self.stage_module.register_forward_hook(self._record_plan)
        try:
            losses = self._run(len(micro_batches), input_ids, position_ids, targets, evaluating=False)
        finally:
            recording.remove()
        self._reduce_gradients()
        local = torch.stack([loss.detach().to(torch.float64) for loss in losses]).sum() if losses else \
            torch.zeros((), dtype=torch.float64, device=self.device)
        return self._sum_over_job(local.to(self.device))

    def eval_step(self, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward only of one packed row: ``(summed token loss, label tokens)`` of this data-parallel
        index's row (0-d float64 tensors on the device), the same on every stage of the pipeline."""
        input_ids, position_ids, targets = self._stack([inputs])
        label_tokens = targets.ne(-100).sum().to(torch.float64)
        self._step_label_tokens = torch.ones((), dtype=torch.float64)
        was_training = self.stage_module.training
        self.stage_module.eval()
        try:
            with torch.no_grad():
                losses = self._run(1, input_ids, position_ids, targets, evaluating=True)
        finally:
            self.stage_module.train(was_training)
        local = losses[0].detach().to(torch.float64) if losses else torch.zeros((), dtype=torch.float64)
        summed = local.to(self.device).clone()
        dist.all_reduce(summed, group=self.pipeline_group)  # from the last stage to the whole pipeline
        return summed, label_tokens.to(self.device)

    def _run(self, micro_batches: int, input_ids, position_ids, targets, *, evaluating: bool) -> list:
        stage, schedule, keywords = self._pipeline(micro_batches, evaluating=evaluating)
        losses: list = []
        run = schedule.eval if evaluating else schedule.step
        args = (input_ids,) if self.is_first else ()
        try:
            run(*args, position_ids=position_ids, target=targets if self.is_last else None,
                losses=losses if self.is_last else None, **keywords)
        except Exception as error:
            if isinstance(error, (DistCAPeerError, DistCATimeoutError)):
                raise
            own = self._own_error(error)
            if own is not None:
                raise own  # torch wraps a stage's error in its own RuntimeError: the stage's error, by its name
            raise self._peer_error(error) from error
        return losses

    def _own_error(self, error: BaseException) -> BaseException | None:
        """The error of this stage's own computation (its module's forward or the loss) in ``error``'s
        chain of causes, or ``None`` when ``error`` came from waiting on a peer."""
        own = {type(self.stage_module).forward.__code__, PipelineRunner._loss.__code__}
        seen = set()
        while error is not None and id(error) not in seen:
            seen.add(id(error))
            traceback = error.__traceback__
            while traceback is not None:
                if traceback.tb_frame.f_code in own:
                    return error
                traceback = traceback.tb_next
            error = error.__cause__ or error.__context__
        return None

    def _peer_error(self, error: BaseException) -> DistCAPeerError:
        neighbours = [s for s in (self.stage_index - 1, self.stage_index + 1) if 0 <= s < self.num_stages]
        lost = ", ".join(f"stage {s} (rank {self.pipeline_ranks[s]})" for s in neighbours)
        return DistCAPeerError(
            f"pipeline stage {self.stage_index} (rank {self.rank}) stopped: its pipeline peer {lost} did not send or "
            f"receive within timeout_s={self.timeout_s:g} s or went away while the '{self.schedule}' schedule ran "
            f"(that stage raised or died: see its own error). Underlying error: {type(error).__name__}: {error}")

    # -- gradients ----------------------------------------------------------------------------------

    def _parameters_with_grads(self) -> list:
        parameters = [p for p in self.stage_module.parameters() if p.requires_grad]
        for p in parameters:  # the same collectives on every copy, even where a parameter got no gradient
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return parameters

    def _reduce_gradients(self) -> None:
        """Sum the gradients over the stage's data-parallel copies (one flat all-reduce) and the tied
        embedding's between the first and the last stage."""
        parameters = self._parameters_with_grads()
        if self.data_group is not None and parameters:
            grads = [p.grad for p in parameters]
            for dtype in sorted({g.dtype for g in grads}, key=str):  # one flat all-reduce per dtype
                same = [g for g in grads if g.dtype == dtype]
                flat = torch.cat([g.reshape(-1) for g in same])
                dist.all_reduce(flat, group=self.data_group)
                for grad, summed in zip(same, flat.split([g.numel() for g in same])):
                    grad.copy_(summed.view_as(grad))
        from .pipeline_stages import sync_tied_embedding_grads

        sync_tied_embedding_grads(self.stage_module, group=self.pipeline_group)

    def grad_norm(self) -> torch.Tensor:
        """The 2-norm of the gradients of every stage's parameters (the tied embedding counted once),
        the same on every rank (0-d float64)."""
        from .pipeline_stages import tied_embedding_parameter

        tied = tied_embedding_parameter(self.stage_module) if self.is_last and not self.is_first else None
        squares = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self._parameters_with_grads():
            if p is not tied:
                squares += p.grad.detach().to(torch.float64).pow(2).sum()
        dist.all_reduce(squares, group=self.pipeline_group)  # the data-parallel copies hold equal gradients
        return squares.sqrt()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients so that their norm over all stages is at most ``max_norm`` (as
        ``torch.nn.utils.clip_grad_norm_`` would on the whole model); returns the norm before."""
        norm = self.grad_norm()
        if math.isfinite(max_norm):
            scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            for p in self._parameters_with_grads():
                p.grad.mul_(scale.to(p.grad.dtype))
        return norm

    # -- job-wide -----------------------------------------------------------------------------------

    def _sum_over_job(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed over the job's ranks (the last stages contribute, the others hold 0)."""
        value = value.clone()
        dist.all_reduce(value)
        return value

