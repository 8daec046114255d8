"""The bench's model: a small Llama-like model with the same weights on every rank, its default shape."""

from __future__ import annotations


MODEL_DEFAULTS = {"hidden": 256, "intermediate": 688, "heads": 8, "kv_heads": 2}
"""The bench model's shape (with ``DEFAULTS``' layers) unless given; ``--workload demo``: ``DEMO_MODEL``."""


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
