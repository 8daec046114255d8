"""Per-model-family knowledge and patches, installed as ``distca_hf.patches``.

The attention function itself is model-agnostic: any decoder that dispatches through
transformers' attention interface runs with ``attn_implementation="distca"``. What is family
specific lives here: (with ping-pong) how a family's decoder layer splits into stages so two
nano-batches can overlap; ``TESTED_MODEL_TYPES``, the families tested end to end, is re-exported
from its home in ``distca_hf.hf.support``.
"""

from .llama_family import CACHE_ARGUMENTS, DECODER_STACK_MODULES, cache_argument, LLAMA_FAMILY_MODEL_TYPES, install, is_llama_family

# model_type -> what the tests check for it (tests/test_models.py runs every one of these); its home is
# distca_hf.hf.support, whose table the README's "Supported models and features" section is.
from distca_hf.hf.support import TESTED_MODEL_TYPES

__all__ = ["CACHE_ARGUMENTS", "DECODER_STACK_MODULES", "cache_argument", "LLAMA_FAMILY_MODEL_TYPES", "TESTED_MODEL_TYPES", "install", "is_llama_family"]
