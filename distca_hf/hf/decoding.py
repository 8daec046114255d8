"""Decoding computes on its own rank: ``generate()`` and model forwards given a KV cache.

A forward that reads or fills a KV cache belongs to one process's generation: distca could not
send the cache's keys to other ranks anyway, and the other ranks may not be running it at all
(``generate`` on rank 0 only, after training). Such forwards compute every document on their own
rank, with no collective (``runtime.forward``), and are recognised by

- keys beyond the queries (``kv_len > query_len``: the cache holds earlier tokens), seen by the
  attention call itself;
- a model forward given a cache (``cache``, or ``past_key_values`` before transformers 5.24): the
  prefill of a decoding loop, whose keys are still only its queries (``watch_decoding``, a hook on
  every model that chooses ``"distca"``);
- any forward inside ``generate()`` (``GenerationMixin.generate``, wrapped by
  ``watch_generation``), with or without a cache.

A forward whose model builds a cache itself (``use_cache=True`` and none given, the default of most
configs) is not decoding: it stays a forward of every rank of the server group, planned and
dispatched as in training and evaluation.
"""

from __future__ import annotations

import functools
import inspect

import torch

from ..runtime import begin_decoding, decoding, end_decoding

__all__ = ["CACHE_ARGUMENTS", "watch_decoding", "watch_generation"]

CACHE_ARGUMENTS = ("cache", "past_key_values")
"""The KV cache's argument names on a model's ``forward``: transformers 5.24 renamed
``past_key_values`` to ``cache`` (the old name is accepted, with a FutureWarning, until 5.40)."""


def watch_decoding(model: torch.nn.Module, implementation: str) -> None:
    """Around each forward of ``model`` given a KV cache while it uses ``implementation``, mark
    this process as decoding (idempotent per model)."""
    if getattr(model, "_distca_watches_decoding", False):
        return
    parameters = [p for p in inspect.signature(type(model).forward).parameters if p != "self"]
    positions = [i for i, name in enumerate(parameters) if name in CACHE_ARGUMENTS]
    began = []  # per forward in progress: whether it decodes

    def before(module, args, kwargs):
        given = [kwargs.get(name) for name in CACHE_ARGUMENTS] + [args[i] for i in positions if i < len(args)]
        decodes = (getattr(module.config, "_attn_implementation", None) == implementation
                   and any(cache is not None for cache in given))
        began.append(decodes)
        if decodes:
            begin_decoding(module)

    def after(module, args, kwargs, output=None):
        if began and began.pop():
            end_decoding(module)

    # run as written under torch.compile (they mark this process as decoding), as the attention function
    model.register_forward_pre_hook(torch.compiler.disable(before), with_kwargs=True)
    model.register_forward_hook(torch.compiler.disable(after), with_kwargs=True, always_call=True)
    model._distca_watches_decoding = True


def watch_generation() -> None:
    """Wrap ``transformers.GenerationMixin.generate`` so that every forward it runs decodes (any
    attention implementation may call it; only distca forwards read the mark); idempotent."""
    from transformers.generation.utils import GenerationMixin

    generate = GenerationMixin.generate
    if getattr(generate, "_distca_decodes", False):
        return

    @functools.wraps(generate)
    def generate_on_this_rank(self, *args, **kwargs):
        with decoding(object()):  # an owner of its own: the model's forward hook ends only what it began
            return generate(self, *args, **kwargs)

    generate_on_this_rank._distca_decodes = True
    GenerationMixin.generate = generate_on_this_rank
