"""HF causal LMs split into pipeline stages, for ``torch.distributed.pipelining.PipelineStage``.

A stage is a ``PipelineStageModule`` built from a full, already loaded HF model by
``build_stage_module``: the decoder layers are split evenly (``check_layer_split``), the first
stage also holds the token embeddings, the last the final norm and the LM head, and every stage
its rotary embedding. A stage runs the model's **own** code: the decoder stack's forward (with
``inputs_embeds`` after the first stage, so ping-pong and the attention-mask functions work as in
a whole model) and, on the last stage, the causal LM's forward (so family extras such as Gemma 2's
final logit softcapping stay HF's).

Names: a stage's parameter names are the full model's (``model.embed_tokens.weight``,
``model.layers.5.mlp.up_proj.weight``, ``lm_head.weight``), because the layers keep their place in
the stack (``StageLayers``) and their ``layer_idx``; checkpoints of stages therefore use HF's key
names, and ``gather_full_state_dict`` / ``save_pipeline_model`` make one ordinary
``save_pretrained`` folder of the whole model.

Tied embeddings (``tie_word_embeddings=True``): on several processes the first stage's embedding
and the last stage's LM head are two copies of one weight; ``sync_tied_embedding_grads`` sums their
gradients between the two stages, so after the same optimizer step they stay equal.

Static shapes: ``stage_io_shapes`` gives the meta tensors that ``PipelineStage(input_args=,
output_args=)`` needs so that torch does not run its shape inference (which runs the module on meta
tensors, and distca's attention cannot).
"""

from __future__ import annotations

import contextlib
import copy
import math

import torch
from torch import nn

from ..config import is_integer

__all__ = [
    "SPLITTABLE_MODEL_TYPES",
    "PipelineStageModule",
    "StageLayers",
    "build_stage_module",
    "check_layer_split",
    "gather_full_state_dict",
    "load_stage_from_pretrained",
    "save_pipeline_model",
    "stage_io_shapes",
    "stage_layer_range",
    "stage_parameter_names",
    "stage_state_dict",
    "sync_tied_embedding_grads",
    "tied_embedding_parameter",
]

SPLITTABLE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")
"""Model types ``build_stage_module`` splits, each tested (``tests/test_pipeline_stages.py``): stages
composed give the whole model's logits and gradients. Their decoder stacks take ``inputs_embeds``
unchanged (Gemma's scaling by sqrt(hidden) happens inside its embedding module, as in transformers 5.24),
which is what lets a later stage feed the hidden states it receives to the stack's own forward."""

_SCALED_EMBEDDING_MODEL_TYPES = ("gemma", "gemma2", "gemma3_text")
"""Families that scale the token embeddings by sqrt(hidden): the scaling must live in the embedding
module (first stage only), not in the decoder stack's forward (every stage)."""


def check_layer_split(num_layers: int, num_stages: int) -> None:
    """Refuse a split of ``num_layers`` decoder layers into ``num_stages`` stages that is not even.

    Raises ``ValueError`` naming both numbers and the setting (``pipeline_parallel_size``)."""
    for name, value in (("num_layers", num_layers), ("num_stages", num_stages)):
        if not is_integer(value) or value < 1:
            raise ValueError(f"pipeline stages: {name} must be an integer >= 1, got {value!r}")
    if num_layers % num_stages:
        divisors = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
        raise ValueError(
            f"pipeline stages: the model's {num_layers} decoder layers do not split evenly into {num_stages} "
            f"stages (pipeline_parallel_size={num_stages}); every stage must hold the same number of layers. "
            f"Set pipeline_parallel_size to a divisor of {num_layers}: {', '.join(map(str, divisors))}")


def stage_layer_range(num_layers: int, num_stages: int, stage_index: int) -> range:
    """The indices of the decoder layers of stage ``stage_index`` (0-based) in an even split."""
    check_layer_split(num_layers, num_stages)
    _check_stage_index(stage_index, num_stages)
    per_stage = num_layers // num_stages
    return range(stage_index * per_stage, (stage_index + 1) * per_stage)


def _check_stage_index(stage_index: int, num_stages: int) -> None:
    if not is_integer(stage_index) or not 0 <= stage_index < num_stages:
        raise ValueError(f"pipeline stages: stage_index must be an integer in [0, {num_stages}) for "
                         f"{num_stages} stages, got {stage_index!r}")


class StageLayers(nn.ModuleList):
    """The decoder layers of one stage, registered under their indices in the whole model (so a
    parameter is named ``model.layers.5...`` on the stage that holds layer 5, as in the full model).

    Iteration, ``len``, integer indexing and slicing see this stage's layers in order (HF's stack
    runs ``self.layers[: config.num_hidden_layers]``, ping-pong does the same); ``layer_indices``
    gives their indices in the whole model."""

    def __init__(self, layers: dict[int, nn.Module]):
        super().__init__()
        for index, layer in layers.items():
            self.add_module(str(index), layer)

    @property
    def layer_indices(self) -> list[int]:
        return [int(name) for name in self._modules]

    def _name(self, position: int) -> str:
        names = list(self._modules)
        if not -len(names) <= position < len(names):
            raise IndexError(f"index {position} is out of range for this stage's {len(names)} layers")
        return names[position]

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return nn.ModuleList(list(self._modules.values())[idx])
        return self._modules[self._name(idx)]

    def __setitem__(self, idx: int, module: nn.Module) -> None:
        setattr(self, self._name(idx), module)

    def __delitem__(self, idx):
        raise TypeError("the layers of a pipeline stage are fixed by the split; build another stage instead")

    def insert(self, index, module):
        raise TypeError("the layers of a pipeline stage are fixed by the split; build another stage instead")

    def append(self, module):
        raise TypeError("the layers of a pipeline stage are fixed by the split; build another stage instead")


def _shallow_module_copy(module: nn.Module) -> nn.Module:
    """A new module object sharing ``module``'s parameters, buffers and submodules, with its own
    registries (replacing a child of the copy leaves ``module`` whole)."""
    new = copy.copy(module)
    for key, value in vars(module).items():
        if key.startswith("_") and isinstance(value, (dict, set)):  # _modules, _parameters, hook tables, ...
            new.__dict__[key] = copy.copy(value)
    return new


def _decoder_stack(model) -> nn.Module:
    """The decoder stack (``model.model``) of a supported causal LM, or a ``ValueError`` naming the
    model type and what can be split."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    stack = getattr(model, "model", None)
    parts = ("embed_tokens", "layers", "norm", "rotary_emb")
    if model_type not in SPLITTABLE_MODEL_TYPES or stack is None or not all(hasattr(stack, p) for p in parts) \
            or not isinstance(getattr(model, "lm_head", None), nn.Module):
        raise ValueError(
            f"pipeline stages: cannot split {type(model).__name__} (model_type {model_type!r}) into stages: "
            f"distca_hf splits the causal LMs of the model types {', '.join(SPLITTABLE_MODEL_TYPES)} (a decoder "
            "stack model.model with embed_tokens, layers, norm and rotary_emb, and an lm_head), each tested to give "
            "the whole model's logits and gradients. Use pipeline_parallel_size=1 for this model")
    if model_type in _SCALED_EMBEDDING_MODEL_TYPES and not hasattr(stack.embed_tokens, "embed_scale"):
        raise ValueError(
            f"pipeline stages: cannot split {type(model).__name__} (model_type {model_type!r}) with this "
            f"transformers version: its embedding {type(stack.embed_tokens).__name__} does not scale by "
            "sqrt(hidden_size) itself, so the decoder stack's forward does, and a later stage would scale the "
            "hidden states it receives again. Use a transformers release whose Gemma embeddings scale themselves "
            "(5.24 does) or pipeline_parallel_size=1")
    return stack


@contextlib.contextmanager
def _hf_warnings_off():
    """transformers' logging at error level inside the block (its verbosity restored after)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


class PipelineStageModule(nn.Module):
    """One stage of an HF causal LM (build it with ``build_stage_module``).

    ``forward(inputs, *, position_ids=None, **kwargs)``:

    - first stage: ``inputs`` = ``input_ids`` ``[micro_batch, seq]`` (int64); other stages: the
      hidden states ``[micro_batch, seq, hidden]`` the previous stage returned;
    - last stage returns the logits ``[micro_batch, seq, vocab]``, other stages the hidden states
      ``[micro_batch, seq, hidden]`` (before the final norm);
    - ``position_ids`` ``[micro_batch, seq]``: restarting at 0 marks packed documents (distca's
      attention takes them from there; eager / sdpa get HF's per-document causal masks); ``None``:
      one document per row. Further keyword arguments go to the decoder stack (as HF's own).

    Attributes: ``stage_index``, ``num_stages``, ``config`` (the whole model's HF config),
    ``layer_range`` (indices of this stage's decoder layers in the whole model), ``model`` (the
    decoder stack holding this stage's parts: ``embed_tokens`` only on the first stage, ``norm`` an
    ``nn.Identity`` except on the last, ``layers`` a ``StageLayers``), ``lm_head`` (last stage, else
    ``None``). Parameter names are the whole model's."""

    def __init__(self, model, *, stage_index: int, num_stages: int):
        super().__init__()
        stack = _decoder_stack(model)
        config = model.config
        num_layers = len(stack.layers)
        if num_layers != config.num_hidden_layers:
            raise ValueError(f"pipeline stages: {type(model).__name__} has {num_layers} decoder layers but its "
                             f"config says num_hidden_layers={config.num_hidden_layers}; pass a whole model")
        self.layer_range = stage_layer_range(num_layers, num_stages, stage_index)
        self.stage_index, self.num_stages, self.config = stage_index, num_stages, config
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1

        stage_stack = _shallow_module_copy(stack)
        stage_stack.layers = StageLayers({i: stack.layers[i] for i in self.layer_range})
        if not self.is_first:
            stage_stack.embed_tokens = None
        if not self.is_last:
            stage_stack.norm = nn.Identity()
        self.model = stage_stack
        self.lm_head = model.lm_head if self.is_last else None
        # The causal LM's own forward runs the last stage (lm_head plus the family's extras, e.g. softcapping).
        # Kept out of the module tree: its children are this stage's `model` and `lm_head`, registered above.
        causal_lm = _shallow_module_copy(model)
        causal_lm.model = stage_stack
        causal_lm.lm_head = self.lm_head
        self.__dict__["_causal_lm"] = causal_lm

    def train(self, mode: bool = True):
        super().train(mode)
        self._causal_lm.training = mode
        return self

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None, every_n_layers: int = 1,
                                        offload: bool = False) -> None:
        """Activation checkpointing on this stage's decoder layers, as the HF model's own method does it
        (``transformers.Trainer`` calls it for ``activation_checkpointing=True``). ``every_n_layers``
        counts this stage's layers from its first, so every stage checkpoints the same local layers (the
        ``cad_1f1b`` lockstep needs that). ``activation_checkpointing_kwargs`` go to
        ``torch.utils.checkpoint.checkpoint`` (``use_reentrant``; HF's default is ``False``)."""
        causal_lm = self._causal_lm
        enable = getattr(causal_lm, "activation_checkpointing_enable", None)
        quiet = contextlib.nullcontext() if self.is_first else _hf_warnings_off()
        with quiet:  # a later stage has no input embeddings to hook: its inputs already require grad
            if enable is not None:
                enable(activation_checkpointing_kwargs=activation_checkpointing_kwargs, every_n_layers=every_n_layers,
                       offload=offload)
            else:  # transformers releases before the rename
                causal_lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=activation_checkpointing_kwargs)

    def activation_checkpointing_disable(self) -> None:
        disable = getattr(self._causal_lm, "activation_checkpointing_disable", None)
        (disable or self._causal_lm.gradient_checkpointing_disable)()

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, **kwargs) -> None:
        """The older name of ``activation_checkpointing_enable``, as on HF models."""
        self.activation_checkpointing_enable(gradient_checkpointing_kwargs, **kwargs)

    def gradient_checkpointing_disable(self) -> None:
        self.activation_checkpointing_disable()

    @property
    def is_activation_checkpointing(self) -> bool:
        return any(getattr(m, "gradient_checkpointing", False) is True for m in self.model.layers)

    def _stack_config(self):
        """The config the decoder stack's forward reads: the model's, with ``layer_types`` cut to this
        stage's layers where the config has them (HF's stacks pick each layer's mask, and Gemma 3 its
        rotary embedding, by ``config.layer_types[i]`` with ``i`` the layer's position in the loop).
        Made afresh each forward so that it follows the model's config (attention implementation, ...);
        the layers themselves keep the model's config."""
        layer_types = getattr(self.config, "layer_types", None)
        if not layer_types or len(self.layer_range) == len(layer_types):
            return self.config
        view = copy.copy(self.config)
        view.layer_types = [layer_types[i] for i in self.layer_range]
        return view

    def forward(self, inputs: torch.Tensor, *, position_ids: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        self._check_inputs(inputs, position_ids)
        self.model.config = self._stack_config()
        call = {"position_ids": position_ids, "use_cache": False, **kwargs}
        call["input_ids" if self.is_first else "inputs_embeds"] = inputs
        if self.is_last:
            return self._causal_lm(**call).logits
        return self.model(**call).last_hidden_state

    def _check_inputs(self, inputs, position_ids) -> None:
        where = f"pipeline stage {self.stage_index} of {self.num_stages}"
        if not isinstance(inputs, torch.Tensor):
            raise TypeError(f"{where} takes a tensor, got {type(inputs).__name__}")
        if self.is_first and (inputs.dim() != 2 or inputs.is_floating_point()):
            raise ValueError(f"{where} (the first) takes input_ids [micro_batch, seq] of integers, got "
                             f"{inputs.dtype} {list(inputs.shape)}")
        if not self.is_first and (inputs.dim() != 3 or not inputs.is_floating_point()
                                  or inputs.shape[-1] != self.config.hidden_size):
            raise ValueError(f"{where} takes the previous stage's hidden states [micro_batch, seq, "
                             f"{self.config.hidden_size}] (floating point), got {inputs.dtype} {list(inputs.shape)}")
        if position_ids is not None and (position_ids.dim() != 2 or position_ids.shape[-1] != inputs.shape[1]
                                         or position_ids.shape[0] not in (1, inputs.shape[0])):
            raise ValueError(f"{where}: position_ids must be [micro_batch, seq] = [{inputs.shape[0]}, "
                             f"{inputs.shape[1]}] like its inputs, got {list(position_ids.shape)}")

    def extra_repr(self) -> str:
        first, last = self.layer_range.start, self.layer_range.stop - 1
        return f"stage {self.stage_index} of {self.num_stages}, layers {first}..{last}"


def build_stage_module(model, *, stage_index: int, num_stages: int) -> PipelineStageModule:
    """Stage ``stage_index`` of ``num_stages`` of ``model``, a whole HF causal LM (already loaded, any
    ``attn_implementation``, of a type in ``SPLITTABLE_MODEL_TYPES``).

    The stage shares the parameters it keeps with ``model`` (no copy) and leaves ``model`` whole;
    drop your references to ``model`` to free the other stages' parameters. Raises ``ValueError``
    for an uneven split (both numbers named), a stage index out of range, or a model it cannot
    split (its model type named)."""
    return PipelineStageModule(model, stage_index=stage_index, num_stages=num_stages)


def load_stage_from_pretrained(pretrained_model_name_or_path, *, stage_index: int, num_stages: int,
                               **from_pretrained_kwargs) -> PipelineStageModule:
    """``AutoModelForCausalLM.from_pretrained(...)`` then ``build_stage_module``: a stage from a saved
    whole model (e.g. what ``save_pipeline_model`` wrote). Loads the whole model on this process
    first, then keeps this stage's part."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, **from_pretrained_kwargs)
    return build_stage_module(model, stage_index=stage_index, num_stages=num_stages)


def stage_io_shapes(config, *, stage_index: int, num_stages: int, micro_batch_size: int, seq_len: int,
                    dtype: torch.dtype, logits_dtype: torch.dtype | None = None, requires_grad: bool = True):
    """``(input_meta, output_meta)``: meta tensors of one micro-batch's input and output of a stage,
    for ``PipelineStage(input_args=input_meta, output_args=output_meta)``.

    Input: ``input_ids`` ``[micro_batch_size, seq_len]`` int64 on the first stage, else hidden states
    ``[micro_batch_size, seq_len, hidden_size]`` in ``dtype``; output: logits ``[micro_batch_size,
    seq_len, vocab_size]`` in ``logits_dtype`` (default ``dtype``; under autocast, the autocast dtype)
    on the last stage, else hidden states in ``dtype``. The floating-point ones carry
    ``requires_grad`` (default ``True``, for training): torch >= 2.13 gives received activations
    and sent gradients only to tensors whose static metadata requires grad."""
    check_layer_split(config.num_hidden_layers, num_stages)
    _check_stage_index(stage_index, num_stages)
    for name, value in (("micro_batch_size", micro_batch_size), ("seq_len", seq_len)):
        if not is_integer(value) or value < 1:
            raise ValueError(f"stage_io_shapes: {name} must be an integer >= 1, got {value!r}")
    def meta(*shape, dt):
        return torch.empty(shape, dtype=dt, device="meta", requires_grad=requires_grad and dt.is_floating_point)

    hidden = lambda: meta(micro_batch_size, seq_len, config.hidden_size, dt=dtype)
    inputs = meta(micro_batch_size, seq_len, dt=torch.long) if stage_index == 0 else hidden()
    last = stage_index == num_stages - 1
    outputs = meta(micro_batch_size, seq_len, config.vocab_size, dt=logits_dtype or dtype) if last else hidden()
    return inputs, outputs


def _unwrap(stage) -> PipelineStageModule:
    """The ``PipelineStageModule`` in ``stage`` (itself, or the ``.module`` of a DDP-like wrapper)."""
    inner = stage
    while not isinstance(inner, PipelineStageModule) and isinstance(getattr(inner, "module", None), nn.Module):
        inner = inner.module
    if not isinstance(inner, PipelineStageModule):
        raise TypeError(f"expected a PipelineStageModule (from build_stage_module), got {type(stage).__name__}")
    return inner


def tied_embedding_parameter(stage) -> nn.Parameter | None:
    """The copy of the tied embedding weight this stage holds: the token embedding on the first stage,
    the LM head on the last (one parameter on a single stage); ``None`` when the model does not tie its
    embeddings or the stage is in the middle."""
    stage = _unwrap(stage)
    if not getattr(stage.config, "tie_word_embeddings", False):
        return None
    if stage.is_first:
        return stage.model.embed_tokens.weight
    if stage.is_last:
        return stage.lm_head.weight
    return None


def _group_rank(group) -> tuple[int, int]:
    import torch.distributed as dist

    return dist.get_rank(group), dist.get_world_size(group)


def _check_pipeline_group(stage: PipelineStageModule, group, what: str) -> None:
    rank, size = _group_rank(group)
    if size != stage.num_stages or rank != stage.stage_index:
        raise ValueError(
            f"{what}: the pipeline group must hold the {stage.num_stages} stages of one pipeline, stage i at group "
            f"rank i; this process is group rank {rank} of {size} but holds stage {stage.stage_index} of "
            f"{stage.num_stages}")


def sync_tied_embedding_grads(stage, *, group) -> None:
    """Sum the gradient of the tied embedding weight between the first and the last stage of a
    pipeline (both end with ``first + last``, bitwise equal), so the same optimizer step keeps the
    two copies equal. ``group``: the pipeline's process group (stage i at group rank i); every stage
    may call it, the middle ones return at once, as do untied models and a single stage. A missing
    gradient counts as zeros. Call it after backward, before clipping and the optimizer step."""
    import torch.distributed as dist

    inner = _unwrap(stage)
    weight = tied_embedding_parameter(inner)
    if weight is None or inner.num_stages == 1:
        return
    _check_pipeline_group(inner, group, "sync_tied_embedding_grads")
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    grad = weight.grad
    local = grad.to_local() if hasattr(grad, "to_local") else grad  # FSDP2: the peers hold matching shards
    peer = dist.get_global_rank(group, inner.num_stages - 1 if inner.is_first else 0)
    received = torch.empty_like(local)
    sent = local.detach().contiguous()
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, sent, peer, group),
                                    dist.P2POp(dist.irecv, received, peer, group)])
    for work in works:
        work.wait()
    local.add_(received)


def _full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    if hasattr(tensor, "full_tensor"):  # DTensor (FSDP2): a collective over its mesh
        tensor = tensor.full_tensor()
    return tensor.detach().to("cpu", copy=True)


def stage_parameter_names(stage) -> list[str]:
    """The names of this stage's parameters in the whole model: they are ``named_parameters()``'s names
    of the stage itself (``model.layers.5.mlp.up_proj.weight``, ``lm_head.weight``)."""
    return [name for name, _ in _unwrap(stage).named_parameters()]


def stage_state_dict(stage) -> dict[str, torch.Tensor]:
    """This stage's ``state_dict`` with the whole model's key names, whole tensors (FSDP2's gathered:
    then every rank of the stage's data-parallel group must call it together) copied to the CPU."""
    return {name: _full_tensor(tensor) for name, tensor in _unwrap(stage).state_dict().items()}


def _tie_error(full: dict, config) -> str | None:
    """The tied weights' copies in ``full``, checked equal (then shared as in HF's ``state_dict``)."""
    if not getattr(config, "tie_word_embeddings", False):
        return None
    embed, head = "model.embed_tokens.weight", "lm_head.weight"
    if embed not in full or head not in full:
        return None
    if full[embed].shape != full[head].shape or not torch.equal(full[embed], full[head]):
        diff = (full[embed].float() - full[head].float()).abs().max().item() \
            if full[embed].shape == full[head].shape else math.inf
        return (f"the tied embedding's copies differ (first stage's {embed} vs last stage's {head}, max abs diff "
                f"{diff:.3g}): call sync_tied_embedding_grads(stage, group=pipeline_group) after every backward, "
                "before the optimizer step, so both copies get the same update")
    full[head] = full[embed]
    return None


def gather_full_state_dict(stage, *, pipeline_group) -> dict[str, torch.Tensor] | None:
    """The whole model's state dict (HF key names, CPU tensors) on the pipeline's first stage (group
    rank 0), ``None`` on the others; every stage of the pipeline calls it. ``pipeline_group``: stage i
    at group rank i; ``None`` with a single stage (no process group needed). Tied weights: both keys,
    one tensor (as HF's ``state_dict``); every rank raises the same ``ValueError`` when the two copies
    differ (tied gradients not synchronised) or the group does not hold stages 0..P-1 in order."""
    import torch.distributed as dist

    inner = _unwrap(stage)
    own = stage_state_dict(inner)
    if inner.num_stages == 1 and (pipeline_group is None or not dist.is_initialized()
                                  or dist.get_world_size(pipeline_group) == 1):
        error = _tie_error(own, inner.config)
        if error:
            raise ValueError(f"gather_full_state_dict: {error}")
        return own
    rank, size = _group_rank(pipeline_group)
    first = dist.get_global_rank(pipeline_group, 0)
    parts = [None] * size if rank == 0 else None
    dist.gather_object((inner.stage_index, inner.num_stages, own), parts, dst=first, group=pipeline_group)
    del own
    outcome = [None]
    if rank == 0:
        stages = [(s, n) for s, n, _ in parts]
        if stages != [(i, size) for i in range(size)]:
            outcome[0] = (f"the pipeline group must hold stages 0..{size - 1} in order, one per group rank; it holds "
                          f"(stage, num_stages) {stages}")
        else:
            full = {}
            for _, _, part in parts:
                full.update(part)
            outcome[0] = _tie_error(full, inner.config)
    dist.broadcast_object_list(outcome, src=first, group=pipeline_group)
    if outcome[0]:
        raise ValueError(f"gather_full_state_dict: {outcome[0]}")
    return full if rank == 0 else None


def save_pipeline_model(stage, output_dir, *, pipeline_group, peft_model=None, **save_pretrained_kwargs) -> None:
    """Save the whole model of a pipeline as one ordinary ``save_pretrained`` folder (HF key names,
    tied weights saved as HF does) that ``AutoModelForCausalLM.from_pretrained`` loads. Every stage of
    the pipeline calls it (``gather_full_state_dict``); the first stage writes, unless
    ``is_main_process=False`` is passed (with several data-parallel pipelines, pass
    ``is_main_process=(data_index == 0)``, or call it on one pipeline only). Other keyword arguments
    go to ``save_pretrained`` (``safe_serialization``, ``max_shard_size``, ...).

    ``peft_model``: the PEFT wrapper (``peft.PeftModel``) whose model the stages were split from, on
    the writing rank; then its adapter folder is written instead, as the Trainer saves a PEFT model
    (``PeftModel.save_pretrained``: adapter weights and ``modules_to_save``, loadable with
    ``PeftModel.from_pretrained``), after every stage's weights are loaded into it: a stage shares its
    parameters with its own rank's copy of the model only, so before this the wrapper on the first
    stage holds the later stages' weights as they were before training."""
    inner = _unwrap(stage)
    full = gather_full_state_dict(inner, pipeline_group=pipeline_group)
    if full is None or not save_pretrained_kwargs.get("is_main_process", True):
        return
    if peft_model is not None:
        peft_model.get_base_model().load_state_dict(full, strict=True)
        peft_model.save_pretrained(output_dir, **save_pretrained_kwargs)
        return
    causal_lm = inner._causal_lm
    with torch.device("meta"):
        whole = type(causal_lm)(inner.config)
    expected = set(whole.state_dict())
    if set(full) != expected:
        raise ValueError(f"save_pipeline_model: the stages' keys differ from {type(causal_lm).__name__}'s: missing "
                         f"{sorted(expected - set(full))[:5]}, unexpected {sorted(set(full) - expected)[:5]}")
    whole.load_state_dict(full, strict=True, assign=True)
    whole.tie_weights()
    whole.generation_config = copy.deepcopy(causal_lm.generation_config)
    whole.save_pretrained(output_dir, **save_pretrained_kwargs)

