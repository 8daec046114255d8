"""Llama-like decoder layers: ``input_layernorm -> self_attn -> residual -> post_attention_layernorm
-> mlp -> residual``, with attention dispatched through ``ALL_ATTENTION_FUNCTIONS``.

These families share the layer structure that the ping-pong schedule splits into stages
(pre-attention projections, core attention, post-attention and MLP).
"""

from __future__ import annotations

LLAMA_FAMILY_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def is_llama_family(config) -> bool:
    """True when ``config.model_type`` has the Llama decoder-layer structure."""
    return getattr(config, "model_type", None) in LLAMA_FAMILY_MODEL_TYPES
