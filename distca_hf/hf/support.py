"""What distca supports and what it refuses, in one place: the documentation's "Supported models and
features" section is ``support_markdown()`` (``tests/test_refusals.py`` checks that they are equal).

- ``TESTED_MODEL_TYPES`` (also ``distca_hf.patches.TESTED_MODEL_TYPES``) are the model types
  ``tests/test_models.py`` runs, each one exact against eager attention per document;
- ``FEATURES`` are what works, and how exactly;
- ``REFUSALS`` are what raises: each names the module whose code raises it and a phrase of its
  error message; ``tests/test_refusals.py`` checks that the phrase is in that module's source and
  triggers every refusal, so a row cannot outlive its refusal nor a refusal hide from this table.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Feature", "Refusal", "FEATURES", "REFUSALS", "TESTED_MODEL_TYPES", "support_markdown"]

# model_type -> what the tests check for it (tests/test_models.py runs every one of these; also
# distca_hf.patches.TESTED_MODEL_TYPES).
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
    "qwen2_moe": "exact (MoE with shared expert; sliding and full layers, its window given by its mask)",
    "phimoe": "exact (MoE; a sliding window on every layer, given by its mask)",
    "exaone4": "exact (sliding and full layers)",
    "olmo3": "exact (sliding and full layers, q/k norms)",
    "cohere2": "exact (sliding and full layers, parallel block; NoPE full layers)",
}



@dataclass(frozen=True)
class Feature:
    """A row of the table: ``what`` (model, input or feature) and its ``status``."""

    what: str
    status: str


@dataclass(frozen=True)
class Refusal:
    """Something distca refuses with an error, rather than compute it wrong.

    Attributes:
        what: the model, input or feature refused.
        why: why it cannot be computed exactly (the documentation's text, docs/models.md).
        raised_in: the module whose code raises the error.
        says: a phrase of the error message (in ``raised_in``'s source and in the raised message).
    """

    what: str
    why: str
    raised_in: str
    says: str


FEATURES = (
    Feature("model types in the table below", "tested: exact logits and parameter gradients against each document run "
            "alone with eager attention (fp32), packed `position_ids`; Llama, Mistral, Qwen2, Qwen3 also for "
            "`cu_seq_lens` kwargs, `DataCollatorWithFlattening`, left/right padding, plain rows, gradient "
            "checkpointing, greedy generation equal to eager"),
    Feature("other decoders using the attention interface", "expected to work (same code path), not tested here; a "
            "family whose layers pass on neither `position_ids`, `cu_seq_lens` nor their keyword arguments is refused "
            "(below) rather than merging packed documents"),
    Feature("families whose layers drop `position_ids` (Llama 4)", "exact: the model's forward hands its "
            "`position_ids` / `cu_seq_lens` to every attention call as one more keyword argument "
            "(`distca_model_documents`), which gradient checkpointing's recomputation gets too"),
    Feature("gradient checkpointing after several forwards", "exact: the model forward's keyword argument "
            "(`distca_model_documents`) also carries the contexts its attention calls ran in, so a recomputed "
            "layer runs in its own forward's plan (no collective, no new plan), even when later forwards shared its "
            "`position_ids` and only some ranks pad"),
    Feature("grouped-query attention", "native: K/V keep `num_key_value_heads` heads, never repeated in memory"),
    Feature("fp32, bf16, fp16", "all. On CUDA without any extra install: fp16/bf16 run PyTorch's own flash varlen kernel "
            "(`torch_cuda`, compute capability 8.0+), fp32 PyTorch's memory-efficient varlen kernel "
            "(`torch_cuda_efficient`, exact fp32); flash-attn is used first when installed; fp64 on CUDA falls back to "
            "the slow `math` backend with a warning. The CUDA paths are unit-tested on CPU against fakes of the ops and "
            "have GPU tests (`make gpu-check`), which pass on one H200 (torch 2.11+cu130; flash-attn not installed "
            "there)"),
    Feature("head dims", "any: padded to a multiple of 8 for the flash kernels (exact); past 256 (flash's limit) "
            "`torch_cuda` runs on `torch_cuda_efficient`, with a one-time warning"),
    Feature("value head dim other than query/key's (DeepSeek-V2/V3 multi-head latent attention)", "exact on 1 and "
            "2 processes (local, and the dispatch's all-to-alls forward and backward, both backward modes): `math` "
            "takes it as it is, the fused kernels get the narrower side zero-padded to the wider (exact); plan bytes "
            "count each width"),
    Feature("mixed precision (autocast, `Trainer(bf16=True)`)", "q, k, v are brought to one compute dtype as HF's own "
            "paths compute: the autocast dtype when autocast is on for their device, else the dtype of `value` (a "
            "float32 rotary embedding can promote q and k); tested with `Trainer(bf16=True, use_cpu=True)` on 1 and 2 "
            "processes"),
    Feature("sliding window (Mistral, Qwen2 with windows, Gemma 2/3 local layers)", "exact on every backend, windows "
            "shorter than a shard and documents spanning ranks included (tested against eager per document on CPU, "
            "1 to 3 processes, every overlap and backward mode). A task with queries `[a, b)` needs only the keys "
            "`[max(0, a - w + 1), b)`: when every layer slides (Mistral) the planner counts windowed pairs and the "
            "dispatch moves only those keys; when some layers are full (Gemma 2/3, Cohere2, Olmo 3, Qwen2's "
            "`max_window_layers`) each forward is planned twice, the full layers with whole prefixes and the sliding "
            "layers under their window (`plan_stats()['sliding_layers']`; `distca-hf simulate --sliding-window`: "
            "1.06-1.69x per layer over one plan for both). Ping-pong plans its nano-batches per kind too; `cad_1f1b` "
            "ticks still run one plan for both kinds (whole prefixes, each layer's window in the kernel)"),
    Feature("chunked attention (Llama 4's `attention_chunk_size`)", "exact on every backend and path: a chunk is a "
            "document of its own, so each CA-task is cut at chunk boundaries into plain causal sub-tasks (a query at "
            "document position `p` sees keys `[p // C * C, p]`); tested with chunks shorter than documents on 1 and 2 "
            "processes"),
    Feature("Llama 4 attention temperature tuning (NoPE layers)", "exact: HF scales the queries by their position "
            "in the row; from `floor_scale` tokens on, distca rescales them to their position in their document "
            "(packed, padded and spanning rows)"),
    Feature("attention logit softcapping (Gemma 2)", "exact (tested: Gemma 2 with softcap and sliding/full layers "
            "against eager per document). `flash_attn` and `math` cap the scores; the fused CPU and torch-native CUDA "
            "kernels cannot, so capped layers run on `math` (slower; a one-time warning says so)"),
    Feature("`cu_seq_lens` with batch > 1", "allowed when every row starts a document; a document crossing rows is "
            "refused (below)"),
    Feature("`output_attentions`", "attention weights are never materialised: as with `sdpa`, `outputs.attentions` "
            "holds no weights (an empty tuple) and a one-time warning names `output_attentions` and "
            "`attn_implementation=\"eager\"`, which returns them; `config.output_attentions=True` is refused by "
            "transformers"),
    Feature("documents longer than a rank", "with `span_ranks=True` (see Documents longer than a rank): pieces on several ranks, "
            "exact"),
)

REFUSALS = (
    Refusal("models that compute attention in their own code (Bloom, Falcon, ...)", "transformers would accept the "
            "name and ignore it, letting packed documents attend to each other; refused when `\"distca\"` is chosen "
            "(`from_pretrained`, `from_config`, `set_attn_implementation`)",
            "distca_hf.hf.model_check", "computes attention in its own code"),
    Refusal("a family whose layers pass on no document argument", "its attention calls could not keep packed "
            "documents apart; refused when the model's forward returns, naming the model (so are StableLM and "
            "Nemotron given documents by `cu_seq_lens` alone: their layers pass on only `position_ids`, which "
            "then run along the row; with `position_ids` that restart they are exact)",
            "distca_hf.hf.model_inputs", "could not keep the documents apart"),
    Refusal("packed documents in decoders whose positions count along the row (the Bart family's `ForCausalLM`: "
            "Bart, mBART, Marian, Pegasus, Blenderbot)", "their learned absolute positions ignore `position_ids`, so "
            "every document after the first would get the wrong positions whatever the attention; one document per "
            "row is fine", "distca_hf.hf.model_inputs", "takes its positions from the row"),
    Refusal("packed documents in models with Mamba, linear-attention, convolution or recurrent layers (Bamba, "
            "Jamba, LFM2, Granite hybrids, xLSTM, Qwen3-Next without `cu_seq_lens`, ...)", "those layers carry state from one packed "
            "document into the next (HF's own eager merges them too), which no attention function can undo; one "
            "document per row is fine, and Qwen3-Next, Qwen3.5 and OLMo hybrid may pack given `cu_seq_lens` (their "
            "linear attention keeps documents apart with flash-linear-attention)", "distca_hf.hf.model_inputs",
            "carry state along a packed row"),
    Refusal("sparse attention (DeepSeek-V3.2's indexer, DeepSeek-V4's compressed attention)", "each query attends "
            "to keys a selection picks, while distca computes every key of the causal prefix; refused when "
            "`\"distca\"` is chosen", "distca_hf.hf.model_check", "has sparse attention layers"),
    Refusal("attention sinks (gpt-oss)", "the sink logit changes the softmax denominator of every shard",
            "distca_hf.hf.attention", "does not support attention sinks"),
    Refusal("attention dropout > 0 in training", "the dropout mask could not be reproduced across shards and "
            "servers; fine at evaluation", "distca_hf.hf.attention", "does not support attention dropout"),
    Refusal("non-causal attention (encoders, `is_causal=False`)", "CA-tasks are defined by the causal prefix",
            "distca_hf.hf.attention", "computes causal attention only"),
    Refusal("masks that let tokens attend beyond causal order (Gemma 3's image tokens, which attend to each "
            "other both ways; bidirectional prefixes)", "distca computes the causal prefix of every query; "
            "text-only rows of those models are exact", "distca_hf.hf.mask", "attend beyond causal order"),
    Refusal("a `config.sliding_window` that the layers do not use (Moshi)", "distca would slide every layer of a "
            "config without `layer_types`, while the model builds full causal masks; set `sliding_window=None`",
            "distca_hf.hf.mask", "but the model builds full causal masks"),
    Refusal("custom 4D masks, block masks", "pass `position_ids`, `cu_seq_lens` or a 2D padding mask",
            "distca_hf.planning.documents", "custom 4D"),
    Refusal("static (pre-allocated) KV caches", "unfilled slots cannot be told from keys; the default dynamic cache "
            "works", "distca_hf.hf.mask", "does not support static (pre-allocated) KV caches"),
    Refusal("a `cu_seq_lens` document crossing rows (batch > 1)", "a CA-task's keys must be one row's tokens",
            "distca_hf.planning.documents", "crosses from row"),
    Refusal("chunked layers decoding with a cache that dropped keys", "HF's cache keeps a chunked layer's last "
            "`chunk - 1` keys, so chunk boundaries can no longer be placed; decoding before that, training and "
            "cache-free forwards are exact", "distca_hf.hf.attention", "runs chunked attention"),
)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def support_markdown() -> str:
    """The "Supported models and features" tables of docs/models.md, from ``FEATURES``, ``REFUSALS`` and
    ``TESTED_MODEL_TYPES`` (markdown, ending in a newline)."""
    lines = ["| | status |", "| --- | --- |"]
    lines += [f"| {_cell(f.what)} | {_cell(f.status)} |" for f in FEATURES]
    lines += [f"| {_cell(r.what)} | **refused**: {_cell(r.why)} |" for r in REFUSALS]
    lines += ["", "Tested model types (`model_type`, what the tests check):", "", "| model type | tested |",
              "| --- | --- |"]
    lines += [f"| `{name}` | {_cell(checked)} |" for name, checked in TESTED_MODEL_TYPES.items()]
    return "\n".join(lines) + "\n"
