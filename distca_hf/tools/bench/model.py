"""The bench's model: a small Llama-like model with the same weights on every rank, its default shape."""

from __future__ import annotations


MODEL_DEFAULTS = {"hidden": 256, "intermediate": 688, "heads": 8, "kv_heads": 2}
"""The bench model's shape (with ``DEFAULTS``' layers) unless given; ``--workload demo``: ``DEMO_MODEL``."""


def bench_model_bytes(args, *, stages: int = 1) -> int:
    """A lower bound on the bytes one process needs for the bench model of ``args`` (``--hidden``,
    ``--intermediate``, ``--layers``, ``--heads``, ``--kv-heads``, ``--vocab``, ``--tokens``,
    ``--dtype``), ``stages`` pipeline stages holding ``--layers / stages`` decoder layers each: its
    parameters and their gradients, one vocabulary matrix (the embedding or the LM head), and the
    residual stream every layer keeps for backward (``[tokens, hidden]`` a layer)."""
    import torch

    h, kv = args.hidden, args.hidden // args.heads * args.kv_heads
    layer = 2 * h * h + 2 * h * kv + 3 * h * args.intermediate + 2 * h  # q, o; k, v; the MLP; two norms
    parameters = args.layers // stages * layer + args.vocab * h
    itemsize = torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    return (2 * parameters + args.layers // stages * args.tokens * h) * itemsize


def bench_model(args, device, max_positions: int):
    """The small Llama-like model, the same weights on every rank."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    import distca_hf  # noqa: F401  (registers "distca")

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=max_positions, use_cache=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="distca").to(device, getattr(torch, args.dtype))
