"""Per-model-family knowledge and patches, installed as ``distca_hf.patches``.

The attention function itself is model-agnostic: any decoder that dispatches through
transformers' attention interface runs with ``attn_implementation="distca"``. What is family
specific lives here: which families are tested end to end, and (with ping-pong) how a family's
decoder layer splits into stages so two nano-batches can overlap.
"""

from .llama_family import CACHE_ARGUMENTS, DECODER_STACK_MODULES, cache_argument, LLAMA_FAMILY_MODEL_TYPES, install, is_llama_family

# model_type -> what the tests check for it (tests/test_models.py runs every one of these).
TESTED_MODEL_TYPES = {
    "llama": "exact logits and gradients; packed, padded, plain rows; generation",
    "mistral": "exact, sliding windows shorter than documents included (tests/test_variants.py)",
    "qwen2": "exact; full and sliding-window layers mixed (tests/test_variants.py)",
    "qwen3": "exact (q/k norms); generation",
    # beyond the Llama family: packed position_ids, exact logits and gradients (tests/test_models.py)
    "llama4_text": "exact; chunked attention (attention_chunk_size) and NoPE layers; its layers get no position_ids, "
                   "documents come from the model's forward; gradient checkpointing, cu_seq_lens; 2 processes",
    "deepseek_v3": "exact; multi-head latent attention (value head dim != query/key head dim), MoE; 2 processes",
    "deepseek_v2": "exact; multi-head latent attention (value head dim != query/key head dim), MoE",
    "gemma": "exact (scaled embeddings)",
    "gemma3_text": "exact; sliding and full layers mixed",
    "gpt2": "exact (learned absolute positions)",
    "gpt_neox": "exact (partial rotary, parallel residual)",
    "olmo2": "exact (q/k norms over all heads)",
    "granite": "exact (attention and residual multipliers)",
    "starcoder2": "exact (biases, LayerNorm)",
    "cohere": "exact (parallel block, logit scale)",
    "phi3": "exact (fused qkv projection)",
    "glm": "exact (partial rotary)",
    "mixtral": "exact (MoE)",
    "qwen2_moe": "exact (MoE with shared expert)",
    "exaone4": "exact (sliding and full layers)",
}

__all__ = ["CACHE_ARGUMENTS", "DECODER_STACK_MODULES", "cache_argument", "LLAMA_FAMILY_MODEL_TYPES", "TESTED_MODEL_TYPES", "install", "is_llama_family"]
