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
}

__all__ = ["CACHE_ARGUMENTS", "DECODER_STACK_MODULES", "cache_argument", "LLAMA_FAMILY_MODEL_TYPES", "TESTED_MODEL_TYPES", "install", "is_llama_family"]
