"""Llama-like decoder layers: ``input_layernorm -> self_attn -> residual -> post_attention_layernorm
-> mlp -> residual``, with attention dispatched through ``ALL_ATTENTION_FUNCTIONS``.

These families share the layer structure that the ping-pong schedule splits into stages:

- ``attention_inputs``: input norm, q/k/v projections (Qwen3's q/k norms), rotary embedding;
- ``layer_output``: o_proj, residual, post-attention norm, MLP, residual.

``install()`` (run when transformers imports each family's module, after ``import distca_hf``) wraps the decoder stacks' ``forward`` (``LlamaModel``,
``MistralModel``, ``Qwen2Model``, ``Qwen3Model``): when the model uses ``attn_implementation="distca"``,
``DISTCA_OVERLAP=pingpong`` (or ``configure(overlap="pingpong")``) is set, the server group has more
than one rank and no KV cache is passed nor ``generate()`` runs (training, evaluation), the stack runs
the ping-pong schedule of ``distca_hf.runtime.pingpong``; otherwise HF's own forward runs unchanged.
The ping-pong stack returns no KV cache, hidden states or attentions: ask for those and HF's forward
runs (with ``overlap="wave"``).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys

import torch

from distca_hf.hf.decoding import CACHE_ARGUMENTS
from distca_hf.runtime import timeline

LLAMA_FAMILY_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_DECODER_STACKS = {t: (f"transformers.models.{t}.modeling_{t}", f"{n}Model")
                   for t, n in zip(LLAMA_FAMILY_MODEL_TYPES, ("Llama", "Mistral", "Qwen2", "Qwen3"))}
DECODER_STACK_MODULES = tuple(module_name for module_name, _ in _DECODER_STACKS.values())
"""The transformers modules whose decoder stacks ``install`` wraps (``import distca_hf`` wraps each
when transformers imports it)."""


def cache_argument(model) -> str:
    """The name under which ``model.forward`` takes its KV cache in the installed transformers:
    ``"cache"`` (5.24 and later) or ``"past_key_values"`` (before)."""
    forward = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in forward else "past_key_values"


def is_llama_family(config) -> bool:
    """True when ``config.model_type`` has the Llama decoder-layer structure."""
    return getattr(config, "model_type", None) in LLAMA_FAMILY_MODEL_TYPES


def attention_inputs(layer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Stage 1 of a layer. hidden ``[1, tokens, hidden]``, cos/sin ``[1, tokens, head_dim]`` ->
    q ``[tokens, heads, head_dim]``, k/v ``[tokens, kv_heads, head_dim]`` (as HF would pass them to the
    attention function, flattened)."""
    attn = layer.self_attn
    x = layer.input_layernorm(hidden)
    # explicit head counts: a nano-batch may hold no token on this rank (``view(..., -1, d)`` can't size 0 rows)
    heads = lambda proj: proj.out_features // attn.head_dim
    q = attn.q_proj(x).view(*x.shape[:-1], heads(attn.q_proj), attn.head_dim)
    k = attn.k_proj(x).view(*x.shape[:-1], heads(attn.k_proj), attn.head_dim)
    v = attn.v_proj(x).view(*x.shape[:-1], heads(attn.v_proj), attn.head_dim)
    if hasattr(attn, "q_norm"):  # Qwen3 normalises q and k per head before the rotary embedding
        q, k = attn.q_norm(q), attn.k_norm(k)
    rotate = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    q, k = rotate(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    flat = lambda t: t.transpose(1, 2).reshape(-1, t.shape[1], attn.head_dim)
    return flat(q), flat(k), flat(v.transpose(1, 2))


def layer_output(layer, residual: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
    """Stage 2 of a layer. residual ``[1, tokens, hidden]`` (the layer's input), attn_out ``[tokens,
    heads, head_dim]`` -> the layer's output ``[1, tokens, hidden]``."""
    o_proj = layer.self_attn.o_proj
    h = residual + o_proj(attn_out.reshape(1, attn_out.shape[0], o_proj.in_features))
    return h + layer.mlp(layer.post_attention_layernorm(h))


def sliding_window(attn):
    """The layer's sliding window (tokens) or ``None``."""
    if hasattr(attn, "sliding_window"):  # Qwen2/Qwen3: per layer type
        return attn.sliding_window
    return getattr(attn.config, "sliding_window", None)  # Mistral: model-wide; Llama: none


def runs_pingpong(model, cache, kwargs) -> bool:
    """Whether this forward of a decoder stack takes the ping-pong path (see the module docstring)."""
    from distca_hf.config import current_config
    from distca_hf.hf import ATTN_IMPLEMENTATION
    from distca_hf.runtime.context import pinned_context
    from distca_hf.runtime.forward import distributed_group_size, is_decoding

    if getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        return False
    if pinned_context() is not None:  # a cad_1f1b tick: its plan is made ahead, for the whole micro-batch
        return False
    config = current_config()
    if config.overlap != "pingpong" or config.mode != "distca" or distributed_group_size(config) == 1:
        return False
    wants = lambda name: kwargs.get(name) or (kwargs.get(name) is None and getattr(model.config, name, False))
    return (cache is None and not is_decoding() and not wants("output_hidden_states")
            and not wants("output_attentions"))


def pingpong_forward(model, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, **kwargs):
    """The decoder stack's forward with the ping-pong schedule; returns ``BaseModelOutputWithPast``
    with ``last_hidden_state [batch, seq, hidden]`` equal to HF's forward."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    if inputs_embeds is None:
        inputs_embeds = model.embed_tokens(input_ids)
    batch, seq, hidden_size = inputs_embeds.shape
    if position_ids is None:
        position_ids = torch.arange(seq, device=inputs_embeds.device).unsqueeze(0).expand(batch, -1)
    layers = list(model.layers[: model.config.num_hidden_layers])
    _refuse_fsdp_layers(layers)
    plan = _plan(model, layers, inputs_embeds, attention_mask, position_ids, kwargs)

    cos, sin = model.rotary_emb(inputs_embeds, position_ids=position_ids)
    cos, sin = cos.expand(batch, -1, -1).reshape(batch * seq, -1), sin.expand(batch, -1, -1).reshape(batch * seq, -1)
    flat = inputs_embeds.reshape(batch * seq, hidden_size)
    nano = lambda t, rows: t.index_select(0, rows).unsqueeze(0)
    rope = {"a": (nano(cos, plan.rows_a), nano(sin, plan.rows_a)), "b": (nano(cos, plan.rows_b), nano(sin, plan.rows_b))}
    h_a, h_b = nano(flat, plan.rows_a), nano(flat, plan.rows_b)
    for layer in layers:
        run = functools.partial(_run_layer, layer, plan, rope)
        if layer.gradient_checkpointing and layer.training and torch.is_grad_enabled():
            # Non-reentrant, and no early stop: the recomputation must run every collective of the
            # layer on every rank, not stop once the tensors it needs are back.
            with torch.utils.checkpoint.set_checkpoint_early_stop(False):
                h_a, h_b = torch.utils.checkpoint.checkpoint(run, h_a, h_b, use_reentrant=False)
        else:
            h_a, h_b = run(h_a, h_b)
    out = flat.new_zeros(flat.shape).index_copy(0, plan.rows_a, h_a[0]).index_copy(0, plan.rows_b, h_b[0])
    out = model.norm(out.view(batch, seq, hidden_size))
    return BaseModelOutputWithPast(last_hidden_state=out)


def _refuse_fsdp_layers(layers) -> None:
    """Every rank raises alike, before any collective, when FSDP2 shards the decoder layers: it gathers a layer's
    parameters in hooks around the layer's own forward, which ping-pong does not call (it runs the layer's parts
    for two nano-batches), so they would stay sharded ("aten.mul.Tensor got mixed torch.Tensor and DTensor")."""
    from torch.distributed.fsdp import FSDPModule

    if any(isinstance(layer, FSDPModule) for layer in layers):
        raise ValueError(
            f"overlap='pingpong' cannot run {type(layers[0]).__name__.removeprefix('FSDP')} layers sharded by FSDP2 "
            "(fully_shard: "
            "Accelerate's FSDP2, or from_pretrained(distributed_config=DistributedConfig(fsdp_size=...)) as under "
            "transformers' tensor x data parallelism): ping-pong runs each layer's parts itself and FSDP2 gathers "
            "the parameters only around the layer's own forward. Use overlap='wave' or 'none' (DistCAPlugin(overlap="
            "...), DISTCA_OVERLAP) with FSDP2")


def _plan(model, layers, inputs_embeds, attention_mask, position_ids, kwargs):
    """Refuse what distca cannot do, find the documents, and plan both nano-batches with every rank
    (a rank whose inputs are invalid still joins, so every rank stops)."""
    from distca_hf.config import current_config
    from distca_hf.hf import mixed_sliding_window, refuse_unsupported, widest_window
    from distca_hf.planning import TokenBytes
    from distca_hf.runtime.agree import attention_dtype, attention_signature
    from distca_hf.runtime.forward import CallInputs, tiles_hold_for
    from distca_hf.runtime.pingpong import plan_pingpong

    for layer in layers:
        refuse_unsupported(layer.self_attn, layer.self_attn.attention_dropout if model.training else 0.0, {})
    batch, seq, _ = inputs_embeds.shape
    call = CallInputs(batch, seq, seq, attention_mask, position_ids, kwargs.get("cu_seq_lens_q"),
                      kwargs.get("cu_seq_lens_k"))
    docs, first_position, error = call.describe(span_ranks=current_config().span_ranks)
    config, head_dim = model.config, layers[0].self_attn.head_dim
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    device = inputs_embeds.device
    # the dtype the exchanges carry (autocast's, else the hidden states'); its size prices the plan's bytes, as the
    # attention function's forward prices them
    dtype = attention_dtype(device.type, inputs_embeds.dtype)
    token_bytes = TokenBytes.for_model(heads * head_dim, heads, kv_heads, dtype.itemsize, head_dim)
    window, sliding = widest_window(config), mixed_sliding_window(config)
    signature = attention_signature(dtype, heads, kv_heads, head_dim, head_dim, torch.is_grad_enabled(),
                                    kv_window=window, sliding_window=sliding)
    return plan_pingpong(docs, error, token_bytes, device, heads, first_position,
                         kv_window=window, dtype_bytes=dtype.itemsize,
                         key_split=tiles_hold_for(layers[0].self_attn), signature=signature, sliding_window=sliding)


def _run_layer(layer, plan, rope, h_a, h_b):
    """One decoder layer on both nano-batches, interleaved (see ``distca_hf.runtime.pingpong``)."""
    from distca_hf.hf import to_compute_dtype
    from distca_hf.kernels import AttentionVariant
    from distca_hf.runtime.pingpong import NanoAttention

    scale, index = layer.self_attn.scaling, layer.self_attn.layer_idx
    variant = AttentionVariant(window=sliding_window(layer.self_attn))  # no Llama-family model softcaps
    dispatch_a, dispatch_b = plan.dispatches_for(variant.window)  # (a mixed model's sliding layers: their own)
    a = NanoAttention(dispatch_a, scale, f"A layer {index}", variant=variant, queue=plan.issue_queue)
    b = NanoAttention(dispatch_b, scale, f"B layer {index}", variant=variant, queue=plan.issue_queue)
    with timeline.span(f"{a.name}: norm, q/k/v"):
        q_a, k_a, v_a = to_compute_dtype(*attention_inputs(layer, h_a, *rope["a"]))
    a.launch(q_a, k_a, v_a)
    with timeline.span(f"{b.name}: norm, q/k/v"):
        q_b, k_b, v_b = to_compute_dtype(*attention_inputs(layer, h_b, *rope["b"]))
        # B also reads K/V rows of A: a cut document's prefix, a document continuing on the next rank
        k_b, v_b = plan.keys_b(k_a, k_b), plan.keys_b(v_a, v_b)
    b.launch(q_b, k_b, v_b)
    a.serve()
    b.serve()
    out_a = a.finish()
    with timeline.span(f"{a.name}: o_proj, MLP"):
        h_a = layer_output(layer, h_a, out_a)
    out_b = b.finish()
    with timeline.span(f"{b.name}: o_proj, MLP"):
        h_b = layer_output(layer, h_b, out_b)
    return h_a, h_b


def install(*, modules: tuple[str, ...] = DECODER_STACK_MODULES) -> list[str]:
    """Wrap the Llama-family decoder stacks' ``forward`` with the ping-pong switch (idempotent).
    ``modules``: which of ``DECODER_STACK_MODULES`` to import and wrap (default: all). Returns the
    class names wrapped; families missing from the installed transformers are skipped."""
    wrapped = []
    for module_name, class_name in _DECODER_STACKS.values():
        if module_name not in modules:
            continue
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue
        if not getattr(cls.forward, "_distca_pingpong", False):
            cls.forward = _with_pingpong(cls.forward)
        wrapped.append(class_name)
    return wrapped


def _with_pingpong(hf_forward):
    """Wrap a decoder stack's ``forward``: the ping-pong path when ``runs_pingpong`` says so, else HF's
    own forward called with exactly the arguments it was given (so nothing is added that transformers
    would warn about, such as ``past_key_values`` beside the ``cache`` of transformers >= 5.24)."""
    parameters = [name for name in inspect.signature(hf_forward).parameters if name != "self"]
    positional = [name for name in parameters if name not in ("args", "kwargs")]

    @functools.wraps(hf_forward)
    def forward(self, *args, **kwargs):
        named = {**dict(zip(positional, args)), **kwargs}
        cache = next((named[name] for name in CACHE_ARGUMENTS if named.get(name) is not None), None)
        if runs_pingpong(self, cache, named):
            inputs = {name: named.pop(name, None) for name in
                      ("input_ids", "attention_mask", "position_ids", "inputs_embeds")}
            for name in (*CACHE_ARGUMENTS, "use_cache"):
                named.pop(name, None)
            return pingpong_forward(self, **inputs, **named)
        return hf_forward(self, *args, **kwargs)

    forward._distca_pingpong = True
    return forward
