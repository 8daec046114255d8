"""DeepSpeed Ulysses sequence parallelism (ALST's ``UlyssesSPAttentionHF``) on distca's kernel: a
baseline of ``distca-hf bench --workload long``.

Ulysses keeps the stream layout (rank ``r`` holds tokens ``[r T, (r + 1) T)`` of the global
stream, as with ``span_ranks``). In every layer one all-to-all turns q, k, v from *this rank's
tokens, all heads* into *every rank's tokens, heads / world* (K/V heads repeated when there are
fewer than ranks) and all-gathers ``position_ids``; the core attention runs over the whole global
stream for those heads; a second all-to-all returns the output to its tokens. Its communication is
the same whatever the documents, and every rank's attention work is the same.

ALST requires the model's ``attn_implementation`` to be its core implementation and replaces that
entry of transformers' attention registry with its wrapper. The core here is registered as
``"distca_ulysses"``: distca's attention function computing locally (``mode="colocated"``), which
finds the documents in the gathered ``position_ids`` and runs the same varlen kernel as the
other methods.
"""

from __future__ import annotations

import torch

from ..config import current_config
from ..hf import distca_attention_forward, distca_mask

__all__ = ["ULYSSES_IMPLEMENTATION", "ulysses_unavailable", "register_ulysses"]

ULYSSES_IMPLEMENTATION = "distca_ulysses"


def ulysses_unavailable(world: int, heads: int, kv_heads: int) -> str | None:
    """Why Ulysses cannot run ``world`` ranks of a model with ``heads`` / ``kv_heads`` here, or None."""
    try:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF  # noqa: F401
    except ImportError as e:
        return f"DeepSpeed's UlyssesSPAttentionHF cannot be imported ({e}); pip install deepspeed (the 'deepspeed' extra)"
    if heads % world:
        return (f"Ulysses splits the {heads} attention heads over the ranks: --heads must be a multiple of "
                f"--world {world}")
    if kv_heads % world and world % kv_heads:
        return f"Ulysses needs --kv-heads ({kv_heads}) and --world ({world}) to divide one another"
    return None


def _local_core(module, query, key, value, attention_mask, *args, **kwargs):
    """Ulysses' core attention: distca computing locally over the gathered sequence."""
    if current_config().mode != "colocated":
        raise ValueError("the Ulysses core attention computes each rank's heads locally: call "
                         "distca_hf.configure(mode='colocated') before a Ulysses forward")
    return distca_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)


def register_ulysses(model: torch.nn.Module, world: int) -> None:
    """Register ALST's Ulysses wrapper as ``attn_implementation="distca_ulysses"`` over the default
    process group of ``world`` ranks; every rank calls it once per process (it creates the sequence
    parallel groups). ``model`` keeps its attention implementation; switch with
    ``model.set_attn_implementation("distca_ulysses")``, and forward with ``position_ids``."""
    import deepspeed.comm as ds_dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    ds_dist.init_distributed(dist_backend=torch.distributed.get_backend())  # adopts the existing group
    AttentionInterface.register(ULYSSES_IMPLEMENTATION, _local_core)
    AttentionMaskInterface.register(ULYSSES_IMPLEMENTATION, distca_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(ULYSSES_IMPLEMENTATION)  # ALST checks the model uses its core
    try:
        UlyssesSPAttentionHF.register_with_transformers(model, ULYSSES_IMPLEMENTATION, world, 1)
    finally:
        model.set_attn_implementation(previous)
