"""Accelerate integration: ``DistCAAccelerator`` and the checks every distca training entry point runs.

``DistCAAccelerator(distca_plugin=DistCAPlugin(...), **accelerator_kwargs)`` is an
``accelerate.Accelerator`` that, before the process group exists, repairs the CPU launch traps
(``launch_checks``); after it exists, checks that as many processes run as the launch asked for, builds
the attention-server groups and applies the distca settings (``DistCAPlugin.attach``). Its
``prepare`` refuses models whose attention distca cannot dispatch and turns the KV cache off.
It composes with DDP, DeepSpeed ZeRO 1, 2 and 3 and FSDP2 like a plain ``Accelerator``: CAD changes
only where core attention runs, not how parameters, gradients or optimizer states are held. On CPU
processes, where Accelerate drops an FSDP request and runs DDP, it shards anyway (``apply_cpu_fsdp``,
which a plain ``Trainer``'s user calls on the trainer).
"""

from __future__ import annotations

import dataclasses
import os

import torch
from accelerate import Accelerator, ParallelismConfig
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType, InitProcessGroupKwargs

from ..config import current_config
from ..hf import ATTN_IMPLEMENTATION, uses_attention_interface
from ..state import warn_once
from .launch_checks import (check_world_size, has_gpu, launched_world_size, prepare_cpu_launch, uses_deepspeed,
                            uses_fsdp)
from .plugin import DistCAPlugin, model_parallel_sizes

__all__ = ["DistCAAccelerator", "apply_cpu_fsdp", "check_spanning_loader", "check_tensor_parallel_applies", "hf_model_of",
           "is_compiled_model", "parallelism_config_for_cpu", "prepare_training_arguments", "require_distca_model"]


def _is_pipeline_stage(module) -> bool:
    from .pipeline_stages import PipelineStageModule

    return isinstance(module, PipelineStageModule)


def require_distca_model(model) -> None:
    """Raise ``ValueError`` unless ``model`` runs its attention through distca.

    ``model`` may be wrapped (DDP, DeepSpeed engine, PEFT); the HF model inside is checked. Plain
    ``torch.nn.Module`` s without a transformers config are not attention models and pass."""
    inner = hf_model_of(model)
    config = getattr(inner, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        return
    name = type(inner).__name__
    implementation = config._attn_implementation
    if implementation != ATTN_IMPLEMENTATION:
        raise ValueError(
            f"distca training needs attn_implementation='distca', but this {name} uses {implementation!r}. Load it "
            f"with from_pretrained(..., attn_implementation='distca') or call model.set_attn_implementation('distca') "
            "(`import distca_hf` registers the implementation)"
        )
    if not uses_attention_interface(type(inner)):
        raise ValueError(
            f"{name} computes attention in its own code instead of through transformers' AttentionInterface "
            "(_supports_attention_backend is False), so attn_implementation='distca' would be silently ignored and "
            "packed documents would attend to each other. Use a model family that dispatches through the interface "
            "(Llama, Mistral, Qwen2, Qwen3, ...)"
        )


def is_compiled_model(model) -> bool:
    """Whether ``model`` is ``torch.compile``'s wrapper (``OptimizedModule``: the model in ``_orig_mod``)."""
    return isinstance(getattr(model, "_orig_mod", None), torch.nn.Module)


def hf_model_of(model):
    """The HF model inside DDP / DeepSpeed (``.module``), PEFT (``get_base_model()``) and ``torch.compile``
    (``_orig_mod``) wrappers."""
    for _ in range(8):
        if is_compiled_model(model):  # before the others: it forwards their attributes
            model = model._orig_mod
        elif hasattr(model, "get_base_model"):
            model = model.get_base_model()
        elif hasattr(getattr(model, "config", None), "_attn_implementation"):
            return model
        elif getattr(model, "module", None) is not None:
            model = model.module
        else:
            return model
    return model


def _disable_kv_cache(model) -> None:
    config = getattr(hf_model_of(model), "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False  # training: no KV cache (it would also switch distca to local decoding)


class DistCAAccelerator(Accelerator):
    """An ``accelerate.Accelerator`` for Core Attention Disaggregation.

    Args:
        distca_plugin: the distca settings and process topology (default ``DistCAPlugin.from_environment()``: settings
            from ``DISTCA_*`` variables, server group = data-parallel group).
        *args, **kwargs: as for ``accelerate.Accelerator``.

    Attributes:
        distca_plugin: the plugin.
        distca: ``DistCAGroups``: topology, this rank's attention-server ranks and group, settings.
    """

    def __init__(self, *args, distca_plugin: DistCAPlugin | None = None, **kwargs):
        if distca_plugin is not None and not isinstance(distca_plugin, DistCAPlugin):
            raise TypeError(f"distca_plugin must be a distca_hf.DistCAPlugin, got {type(distca_plugin).__name__}")
        self.distca_plugin = distca_plugin if distca_plugin is not None else DistCAPlugin.from_environment()
        deepspeed = kwargs.get("deepspeed_plugin") is not None or kwargs.get("deepspeed_plugins") is not None \
            or uses_deepspeed()
        backend = prepare_cpu_launch(deepspeed=deepspeed).get("backend")
        handlers = list(kwargs.get("kwargs_handlers") or [])
        if backend and not any(isinstance(h, InitProcessGroupKwargs) for h in handlers):
            handlers.append(InitProcessGroupKwargs(backend=backend))
            kwargs["kwargs_handlers"] = handlers
        _forget_miscounted_state()
        if not has_gpu():
            config = kwargs.get("parallelism_config")
            if config is None and os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true":
                config = ParallelismConfig()  # from the PARALLELISM_CONFIG_* variables of `accelerate launch`
            if config is not None:
                kwargs["parallelism_config"] = parallelism_config_for_cpu(config)
        super().__init__(*args, **kwargs)
        check_world_size(self.num_processes)
        apply_cpu_fsdp(self, fsdp_plugin=kwargs.get("fsdp_plugin"))
        # accelerate's ParallelismConfig (given here, or from `accelerate launch`'s parallelism_config) says the
        # data- and tensor-parallel sizes; the plugin takes them unless it says otherwise (then: an error)
        self.distca_plugin = self.distca_plugin.with_parallelism(self.parallelism_config)
        self.distca = self.distca_plugin.attach()

    def prepare(self, *args, device_placement=None):
        for obj in args:
            if isinstance(obj, torch.nn.Module) and not _is_pipeline_stage(obj):  # a stage: prepare_model checks it
                require_distca_model(obj)
                _disable_kv_cache(obj)
                self._attach_sharded_model(obj)
        return super().prepare(*args, device_placement=device_placement)

    def prepare_data_loader(self, data_loader, *args, **kwargs):
        # every loader Accelerate prepares comes here (prepare() too); the trainers put their span_ranks in force
        check_spanning_loader(data_loader, span_ranks=current_config().span_ranks)
        return super().prepare_data_loader(data_loader, *args, **kwargs)

    def prepare_model(self, model, device_placement: bool | None = None, evaluation_mode: bool = False):
        if self.distca_plugin.pipeline_parallel_size > 1:
            if not _is_pipeline_stage(model):
                raise ValueError(
                    f"pipeline_parallel_size={self.distca_plugin.pipeline_parallel_size}: prepare this rank's stage, not "
                    f"the whole {type(model).__name__}: runner = distca_hf.training.pipeline.apply_pipeline_parallel("
                    "model, ...) splits it, then prepare runner.stage_module (or train with DistCATrainer)")
            implementation = model.config._attn_implementation
            if implementation != ATTN_IMPLEMENTATION:
                raise ValueError(f"pipeline stage {model.stage_index}: its model runs attn_implementation="
                                 f"{implementation!r}; load it with attn_implementation={ATTN_IMPLEMENTATION!r}")
            # no DDP around a stage: PipelineRunner.train_step sums its gradients over the data-parallel copies
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)
        require_distca_model(model)
        _disable_kv_cache(model)
        self._attach_sharded_model(model)
        return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)

    def _attach_sharded_model(self, model) -> None:
        """A model transformers sharded (``DistributedConfig(tp_size=...)``) says its tensor-parallel size: build
        the server groups again from it (a collective, as ``prepare`` is), or raise naming both sizes."""
        inner = hf_model_of(model)
        if getattr(self, "_distca_attached_model", None) is inner:
            return  # prepare() passes the model to prepare_model() again
        sizes = model_parallel_sizes(inner)
        if sizes.tensor_parallel is not None or sizes.data_parallel is not None:
            self.distca = self.distca_plugin.attach(model=inner)
            self._distca_attached_model = inner
        check_tensor_parallel_applies(self.distca.topology, inner, getattr(self, "torch_device_mesh", None))


def check_spanning_loader(loader, *, span_ranks: bool) -> None:
    """Refuse, naming the fix, a DataLoader over a ``PackedDataset`` packed with ``span_ranks=True`` that the
    runtime would read wrong: distca's ``span_ranks`` off (``span_ranks``: the setting in force), where a piece
    continuing the previous rank's document would attend only to itself, silently; or a shuffling sampler
    (``shuffle=True``), which breaks the global batches a group's ranks must read in the same step."""
    from .packing import PackedDataset

    dataset = getattr(loader, "dataset", None)
    if not isinstance(dataset, PackedDataset) or not dataset.layout.span_ranks:
        return
    if not span_ranks:
        raise ValueError(
            "the DataLoader's PackedDataset was packed with span_ranks=True (documents continue on the next rank), but "
            "distca's span_ranks is off, so a continuing piece would attend only to itself; set "
            "DistCAPlugin(span_ranks=True) (or DISTCA_SPAN_RANKS=1, or span_ranks: true in the distca: section), or pack "
            "with span_ranks=False")
    if isinstance(getattr(loader, "sampler", None), torch.utils.data.RandomSampler):
        raise ValueError(
            "DataLoader(shuffle=True) shuffles single rows of a span_ranks PackedDataset, but a server group's ranks "
            "must read the slices of one global batch in the same step; pass sampler=distca_hf.training.packing."
            "GlobalBatchSampler(len(dataset), dataset.world_size, shuffle=True, seed=...) instead of shuffle=True")


def check_tensor_parallel_applies(topology, model, mesh) -> None:
    """Warn when a tensor-parallel size in distca's topology shards nothing: neither transformers (the model
    says its size, ``model_parallel_sizes``) nor the Accelerator (a ``tp`` dimension in its device mesh)
    sharded ``model``. Given to distca alone (``DistCAPlugin(tensor_parallel_size=...)``,
    ``from_parallelism_config``, the ``distca:`` section), Accelerate runs plain data parallelism: training
    stays exact, but distca's server groups hold only the ranks of one tensor index (on 2 ranks with size 2,
    one rank each: nothing is balanced)."""
    if topology.tensor_parallel <= 1 or model_parallel_sizes(model).tensor_parallel is not None:
        return
    if "tp" in (getattr(mesh, "mesh_dim_names", None) or ()):
        return
    warn_once("tensor_parallel_unapplied",
              f"distca's topology has tensor_parallel={topology.tensor_parallel}, but neither the model nor the "
              f"Accelerator is sharded so ({type(model).__name__} was loaded without tp_plan / distributed_config, and the "
              "Accelerator has no parallelism_config with tp_size): every rank holds the whole model, and distca's "
              f"server groups hold 1 / {topology.tensor_parallel} of the ranks they could. Give the same "
              "ParallelismConfig(tp_size=...) to the Accelerator (or TrainingArguments(parallelism_config=...)), load "
              "the model with tp_plan='auto', or drop tensor_parallel_size")


def apply_cpu_fsdp(target, *, fsdp_plugin=None) -> bool:
    """Shard the model as the job's FSDP request says on CPU processes, where Accelerate runs DDP instead.

    Accelerate (1.x) turns an FSDP request (``distributed_type: FSDP`` in an ``accelerate launch`` config,
    ``Accelerator(fsdp_plugin=...)``, ``TrainingArguments(fsdp=...)``) into FSDP only on GPU-like devices: CPU
    processes (``MULTI_CPU``, gloo) drop it without a word and wrap the model in DDP. torch's ``fully_shard`` runs
    on gloo, so this puts the request back into the Accelerate state; ``prepare(model, optimizer)`` then shards
    the model with Accelerate's own FSDP2 path (DTensor parameters, reduce-scattered gradients, sharded optimizer
    states), as on GPUs. ``DistCAAccelerator`` and ``DistCATrainer`` call it themselves; with a plain ``Trainer``
    (or TRL's ``SFTTrainer``) call it on the trainer before ``train()``.

    Args:
        target: an ``accelerate.Accelerator``, or a ``transformers.Trainer`` (its accelerator, and the Trainer's
            own FSDP switch ``is_fsdp_enabled``).
        fsdp_plugin: the ``FullyShardedDataParallelPlugin`` given in code to the ``Accelerator``, if any. Default:
            the Trainer's ``TrainingArguments(fsdp=..., fsdp_config=...)``, else the ``FSDP_*`` variables that
            ``accelerate launch`` sets from the config's ``fsdp_config``.

    Returns:
        Whether FSDP was put back: ``False`` when nothing was dropped (no FSDP request, GPUs, one process).

    Raises:
        ValueError: ``fsdp_version: 1`` on CPU processes (torch's FSDP1 wrapper refuses Accelerate's CPU device),
            or FSDP's and the Trainer's activation checkpointing both on.
        RuntimeError: the model was already prepared (wrapped in DDP): call this first.
    """
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    trainer = target if hasattr(target, "accelerator") and hasattr(target, "args") else None
    accelerator = trainer.accelerator if trainer is not None else target
    state = accelerator.state
    training_args = trainer.args if trainer is not None else None
    if state.distributed_type != DistributedType.MULTI_CPU or not uses_fsdp(training_args) or has_gpu():
        return False
    if fsdp_plugin is None:
        plugin_args = getattr(training_args, "fsdp_plugin_args", None)
        fsdp_plugin = FullyShardedDataParallelPlugin(**plugin_args) if plugin_args else FullyShardedDataParallelPlugin()
    if fsdp_plugin.fsdp_version != 2:
        raise ValueError(
            f"FSDP fsdp_version: {fsdp_plugin.fsdp_version} cannot shard on CPU processes: torch's FSDP1 wrapper "
            "refuses Accelerate's CPU device (and Accelerate would silently run DDP instead). Use FSDP2: "
            "fsdp_version: 2 under fsdp_config: in the accelerate config (recipes/fsdp2.yaml), "
            "FullyShardedDataParallelPlugin(fsdp_version=2), or TrainingArguments(fsdp_config={'version': 2})")
    if accelerator._models:
        raise RuntimeError("apply_cpu_fsdp must run before the model is prepared (it is already wrapped in "
                           f"{type(accelerator._models[0]).__name__}); call it right after creating the trainer")
    if state.mixed_precision != "no":
        fsdp_plugin.set_mixed_precision(state.mixed_precision)  # as AcceleratorState does for FSDP on GPUs
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = fsdp_plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # as AcceleratorState keeps them equal
    if trainer is not None:
        if fsdp_plugin.activation_checkpointing and trainer.args.activation_checkpointing:
            raise ValueError(  # the Trainer's own check, which it skipped while FSDP was dropped
                "fsdp_config's activation_checkpointing (FSDP's own) and TrainingArguments(activation_checkpointing="
                "True) cannot both be on; keep FSDP's")
        trainer.is_fsdp_enabled = True
    return True


class CPUParallelismConfig(ParallelismConfig):
    """A ``ParallelismConfig`` Accelerate accepts on CPU processes (see ``parallelism_config_for_cpu``)."""

    def _validate_accelerator(self, accelerator):
        if accelerator.distributed_type != DistributedType.MULTI_CPU:
            return super()._validate_accelerator(accelerator)
        if self.total_size == 1:
            self._set_size("dp_replicate", accelerator.num_processes)  # as Accelerate does: plain DDP
        if self.total_size != accelerator.num_processes:
            raise ValueError(f"ParallelismConfig total_size ({self.total_size}) does not match num_processes "
                             f"({accelerator.num_processes}); adjust dp_replicate_size / dp_shard_size / tp_size")


def parallelism_config_for_cpu(parallelism_config, **sizes) -> CPUParallelismConfig | None:
    """``parallelism_config`` (with ``sizes`` replaced) as one Accelerate accepts on CPU processes (``MULTI_CPU``).

    Accelerate (1.x) validates a ``ParallelismConfig`` only for GPU-like devices, FSDP2 and DeepSpeed and refuses it
    on CPU processes ("ParallelismConfig is only compatible DistributedType.FSDP (version 2) or
    DistributedType.Multi{Device} or DistributedType.DEEPSPEED, but got DistributedType.MULTI_CPU"), although its
    device mesh and DTensor tensor parallelism run on gloo. The copy checks what Accelerate checks for a
    multi-device run (the sizes cover the processes) and is otherwise the same config; elsewhere it defers to
    Accelerate. ``DistCAAccelerator`` and ``DistCATrainer`` (for a model transformers sharded with tensor
    parallelism) use it on CPU processes themselves."""
    if parallelism_config is None and not sizes:
        return None
    if parallelism_config is not None and not isinstance(parallelism_config, ParallelismConfig):
        raise TypeError(f"parallelism_config must be an accelerate.ParallelismConfig, got "
                        f"{type(parallelism_config).__name__}")
    # every field the installed Accelerate has (1.10 has no cp_backend nor sp_*: a fixed list failed there)
    values = ({f.name: getattr(parallelism_config, f.name) for f in dataclasses.fields(parallelism_config) if f.init}
              if parallelism_config is not None else {})
    return CPUParallelismConfig(**{**values, **sizes})


def _forget_miscounted_state() -> None:
    """If Accelerate's process state was already set up with fewer processes than were launched
    (the CPU traps above), drop it so the next set-up counts again. The torch process group, if
    any, is kept and reused."""
    asked, _ = launched_world_size()
    if not PartialState._shared_state or asked is None:
        return
    if PartialState().num_processes != asked:
        AcceleratorState._reset_state(reset_partial_state=True)


def prepare_training_arguments(args) -> None:
    """Make ``transformers.TrainingArguments`` count the launched processes on a machine without GPU.

    ``TrainingArguments`` sets up Accelerate's process state when it is created, so a script that
    builds it before anything of distca runs meets the CPU traps. ``DistCATrainer`` calls this
    itself; call it right after creating the arguments when something uses them before the trainer
    exists (on CPU: DeepSpeed ZeRO-3's ``zero.Init`` while the model loads). It redoes the set-up: with
    ``ACCELERATE_USE_CPU=1`` (DDP), or with the ``gloo`` backend (DeepSpeed, whose branch of the
    set-up ignores ``ddp_backend``). The torch process group, if one was made, is reused. Raises
    ``LaunchError`` when it cannot (e.g. ``accelerate launch --cpu`` started a single process)."""
    asked, _ = launched_world_size()
    if asked is not None and asked > 1 and args.world_size != asked and "WORLD_SIZE" in os.environ:
        backend = prepare_cpu_launch(deepspeed=uses_deepspeed(args)).get("backend")
        if backend is None:  # DDP: ACCELERATE_USE_CPU is now set; let the arguments set up again
            args.__dict__.pop("_setup_devices", None)  # a cached_property
            _ = args.device
        else:
            AcceleratorState._reset_state(reset_partial_state=True)
            previous = os.environ.get("ACCELERATE_USE_DEEPSPEED")
            os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # as TrainingArguments does for its own set-up
            try:
                state = PartialState(backend=backend, timeout=args.ddp_timeout_delta)
            finally:
                if previous is None:
                    del os.environ["ACCELERATE_USE_DEEPSPEED"]
                else:
                    os.environ["ACCELERATE_USE_DEEPSPEED"] = previous
            args.distributed_state = state
            args.__dict__["_setup_devices"] = state.device
            if getattr(args, "deepspeed", None):
                # The "auto" batch sizes of the DeepSpeed config were filled for one process: fill them again
                # (as TrainingArguments.__post_init__ does).
                from accelerate.utils import DeepSpeedPlugin
                from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

                args.hf_deepspeed_config = HfTrainerDeepSpeedConfig(args.deepspeed)
                args.hf_deepspeed_config.trainer_config_process(args)
                args.deepspeed_plugin = DeepSpeedPlugin(hf_ds_config=args.hf_deepspeed_config)
    check_world_size(args.world_size)

