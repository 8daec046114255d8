"""distca in real HF models equals each document run alone with eager attention (fp32):
logits and every parameter gradient, for every way of describing documents."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening

from distca_hf.patches import TESTED_MODEL_TYPES
from helpers import (FAMILIES, VOCAB, assert_grads_close, checkpointing_disable, checkpointing_enable, is_checkpointing,
                     objective_weights, param_grads, per_document_reference, tiny_model)

DOC_LENGTHS = [13, 1, 29, 6, 17]  # odd lengths and a one-token document


def _documents(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


def _check_packed(model, docs, call_kwargs, use_cache, *, scaled_grad_tolerance=False):
    """Run the packed call, compare with the per-document reference. ``scaled_grad_tolerance``: fp32
    rounding grows with the gradients' size (Gemma's scaled embeddings), so allow 1e-6 of the largest."""
    weights = [objective_weights((len(d), VOCAB), seed=i) for i, d in enumerate(docs)]
    ref_logits, ref_grads = per_document_reference(model, docs, weights)
    model.zero_grad(set_to_none=True)
    logits = model(use_cache=use_cache, **call_kwargs).logits[0]
    (logits * torch.cat(weights)).sum().backward()
    torch.testing.assert_close(logits, torch.cat(ref_logits), atol=1e-5, rtol=1e-4)
    scale = max(float(g.abs().max()) for g in ref_grads.values()) if scaled_grad_tolerance else 10.0
    assert_grads_close(param_grads(model), ref_grads, atol=1e-6 * max(scale, 10.0))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("use_cache", [False, True])
def test_packed_position_ids(family, use_cache):
    model = tiny_model(family)
    docs = _documents(DOC_LENGTHS)
    input_ids = torch.cat(docs).unsqueeze(0)
    position_ids = torch.cat([torch.arange(len(d)) for d in docs]).unsqueeze(0)
    _check_packed(model, docs, dict(input_ids=input_ids, position_ids=position_ids), use_cache)


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_cu_seq_lens_kwargs(family):
    """Boundaries from cu_seq_lens alone (positions run on across documents: RoPE is relative)."""
    model = tiny_model(family)
    docs = _documents(DOC_LENGTHS, seed=1)
    cu = torch.tensor([0, *torch.tensor(DOC_LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    kwargs = dict(
        input_ids=torch.cat(docs).unsqueeze(0),
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        max_length_q=max(DOC_LENGTHS),
        max_length_k=max(DOC_LENGTHS),
    )
    _check_packed(model, docs, kwargs, use_cache=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_data_collator_with_flattening(family):
    model = tiny_model(family)
    docs = _documents(DOC_LENGTHS, seed=2)
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=True)
    batch = collator([{"input_ids": d.tolist()} for d in docs])
    assert "cu_seq_lens_q" in batch
    _check_packed(model, docs, dict(batch), use_cache=False)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch(family, side):
    model = tiny_model(family)
    docs = _documents([11, 4, 23, 1], seed=3)
    width = max(len(d) for d in docs)
    input_ids = torch.zeros(len(docs), width, dtype=torch.long)
    mask = torch.zeros(len(docs), width, dtype=torch.long)
    cols = [slice(0, len(d)) if side == "right" else slice(width - len(d), width) for d in docs]
    for row, (d, col) in enumerate(zip(docs, cols)):
        input_ids[row, col] = d
        mask[row, col] = 1
    weights = [objective_weights((len(d), VOCAB), seed=i) for i, d in enumerate(docs)]
    ref_logits, ref_grads = per_document_reference(model, docs, weights)
    logits = model(input_ids=input_ids, attention_mask=mask).logits
    objective = sum((logits[row, col] * w).sum() for row, (col, w) in enumerate(zip(cols, weights)))
    objective.backward()
    for row, col in enumerate(cols):
        torch.testing.assert_close(logits[row, col], ref_logits[row], atol=1e-5, rtol=1e-4)
    assert_grads_close(param_grads(model), ref_grads)


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_rows(family):
    model = tiny_model(family)
    docs = _documents([19, 19, 19], seed=4)
    weights = [objective_weights((len(d), VOCAB), seed=i) for i, d in enumerate(docs)]
    ref_logits, ref_grads = per_document_reference(model, docs, weights)
    logits = model(input_ids=torch.stack(docs)).logits
    (logits * torch.stack(weights)).sum().backward()
    torch.testing.assert_close(logits, torch.stack(ref_logits), atol=1e-5, rtol=1e-4)
    assert_grads_close(param_grads(model), ref_grads)


def test_packed_and_padded_rows():
    """Rows that hold several documents and end in padding (a padding packer's output)."""
    model = tiny_model("llama")
    docs = _documents([7, 5, 9, 3, 8], seed=5)
    rows = [[0, 1], [2], [3, 4]]
    width = 14
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    position_ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for r, members in enumerate(rows):
        col = 0
        for i in members:
            n = len(docs[i])
            input_ids[r, col : col + n] = docs[i]
            position_ids[r, col : col + n] = torch.arange(n)
            mask[r, col : col + n] = 1
            col += n
    weights = [objective_weights((len(d), VOCAB), seed=i) for i, d in enumerate(docs)]
    ref_logits, ref_grads = per_document_reference(model, docs, weights)
    logits = model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask).logits
    objective = 0
    for r, members in enumerate(rows):
        col = 0
        for i in members:
            n = len(docs[i])
            torch.testing.assert_close(logits[r, col : col + n], ref_logits[i], atol=1e-5, rtol=1e-4)
            objective = objective + (logits[r, col : col + n] * weights[i]).sum()
            col += n
    objective.backward()
    assert_grads_close(param_grads(model), ref_grads)


def test_gradient_checkpointing():
    model = tiny_model("llama")
    checkpointing_enable(model, use_reentrant=False)
    assert is_checkpointing(model)
    docs = _documents(DOC_LENGTHS, seed=6)
    position_ids = torch.cat([torch.arange(len(d)) for d in docs]).unsqueeze(0)
    _check_packed(model, docs, dict(input_ids=torch.cat(docs).unsqueeze(0), position_ids=position_ids), False)


def test_checkpointed_forwards_sharing_position_ids_recompute_with_their_own_padding():
    """Two forwards given one position_ids tensor but different padding, then one backward: the
    checkpointed layers of the first forward are recomputed after the second forward ran, and must
    find the first forward's documents (its mask), not the second's."""
    model = tiny_model("llama")
    checkpointing_enable(model, use_reentrant=False)
    first, second = _documents([12, 12], seed=21)
    docs = [first[3:], second[:9]]
    weights = [objective_weights((len(d), VOCAB), seed=i) for i, d in enumerate(docs)]
    ref_logits, ref_grads = per_document_reference(model, docs, weights)
    positions = torch.arange(12).unsqueeze(0)  # one tensor, both forwards
    masks = torch.ones(2, 1, 12, dtype=torch.long)
    masks[0, 0, :3] = 0  # left padding
    masks[1, 0, 9:] = 0  # right padding
    logits_a = model(input_ids=first[None], attention_mask=masks[0], position_ids=positions, use_cache=False).logits
    logits_b = model(input_ids=second[None], attention_mask=masks[1], position_ids=positions, use_cache=False).logits
    ((logits_a[0, 3:] * weights[0]).sum() + (logits_b[0, :9] * weights[1]).sum()).backward()
    checkpointing_disable(model)
    torch.testing.assert_close(logits_b[0, :9], ref_logits[1], atol=1e-5, rtol=1e-4)
    assert_grads_close(param_grads(model), ref_grads)


def test_a_forward_whose_layer_types_get_masks_of_their_own_opens_once():
    """HF makes one padding mask per layer type (a new tensor each): the forward's later layers adopt
    an equal mask instead of opening (and planning) the forward again."""
    from distca_hf import plan_stats
    from distca_hf.runtime.context import current_forward

    model = tiny_model("qwen2", layer_types=["full_attention", "sliding_attention"], sliding_window=64,
                       use_sliding_window=True)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :3] = 0
    before = plan_stats()["step"] if current_forward() is not None else 0
    model(input_ids=torch.randint(0, VOCAB, (2, 8)), attention_mask=mask, use_cache=False)
    assert plan_stats()["step"] == before + 1


def test_generate_after_a_packed_prefill_is_refused():
    """A prefill whose position_ids restart (several documents in its row) leaves them all in the
    row's cache; the decoding steps cannot keep them apart, so they raise as cu_seq_lens do."""
    from distca_hf import DocumentBoundaryError

    model = tiny_model("llama").eval()
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    with torch.no_grad(), pytest.raises(DocumentBoundaryError, match="several documents"):
        model.generate(input_ids=torch.randint(0, VOCAB, (1, 8)), position_ids=positions, max_new_tokens=2,
                       do_sample=False)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_generation_matches_eager(family):
    """Decoding with a KV cache and left padding: each new query is a CA-task at the end of its row."""
    model = tiny_model(family).eval()
    prompts = _documents([5, 9], seed=7)
    width = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        input_ids[row, width - len(p) :] = p
        mask[row, width - len(p) :] = 1
    kwargs = dict(input_ids=input_ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ours = model.generate(**kwargs)
        model.set_attn_implementation("eager")
        theirs = model.generate(**kwargs)
    assert torch.equal(ours, theirs)


def test_inference_mode_and_buffers_rewritten_in_place():
    """Inference tensors carry no version counter; a collator that rewrites its position_ids buffer
    in place between steps must still get the new documents (layouts are rebuilt per forward)."""
    model = tiny_model("llama").eval()
    docs = _documents([6, 4], seed=8)
    ids = torch.cat(docs).unsqueeze(0)
    buffer = torch.cat([torch.arange(6), torch.arange(4)]).unsqueeze(0)
    with torch.inference_mode():
        packed = model(input_ids=ids, position_ids=buffer).logits
    buffer.data.copy_(torch.arange(10))  # the same tensor object now says: one document
    with torch.no_grad():
        one_doc = model(input_ids=ids, position_ids=buffer).logits
        model.set_attn_implementation("eager")
        alone = torch.cat([model(input_ids=d[None]).logits for d in docs], 1)
        whole = model(input_ids=ids).logits
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(one_doc, whole, atol=1e-5, rtol=1e-4)


def test_cu_seq_lens_with_several_rows():
    """batch > 1 with cu_seq_lens over the flattened rows (every row starts a document)."""
    model = tiny_model("qwen2")
    docs = _documents([5, 7, 12], seed=9)
    ids = torch.stack([torch.cat(docs[:2]), docs[2]])
    cu = torch.tensor([0, 5, 12, 24], dtype=torch.int32)
    weights = [objective_weights((len(d), VOCAB), seed=i) for i, d in enumerate(docs)]
    ref_logits, ref_grads = per_document_reference(model, docs, weights)
    logits = model(input_ids=ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=12, max_length_k=12).logits
    flat = logits.reshape(-1, VOCAB)
    (flat * torch.cat(weights)).sum().backward()
    torch.testing.assert_close(flat, torch.cat(ref_logits), atol=1e-5, rtol=1e-4)
    assert_grads_close(param_grads(model), ref_grads)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_bf16_matches_per_document_eager_within_kernel_tolerance(family):
    model = tiny_model(family).to(torch.bfloat16)
    docs = _documents(DOC_LENGTHS, seed=10)
    ids = torch.cat(docs).unsqueeze(0)
    pos = torch.cat([torch.arange(len(d)) for d in docs]).unsqueeze(0)
    with torch.no_grad():
        ours = model(input_ids=ids, position_ids=pos).logits[0].float()
        model.set_attn_implementation("eager")
        alone = torch.cat([model(input_ids=d[None]).logits[0] for d in docs]).float()
    assert ours.dtype == alone.dtype
    torch.testing.assert_close(ours, alone, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attn", ["eager", "sdpa", "distca"])
def test_no_warning_from_a_forward_after_import(family, attn):
    """``import distca_hf`` wraps the Llama-family decoder stacks; a forward through them (training,
    with a cache, generation) must warn about nothing, whatever attention the model chose
    (transformers 5.24 warned on every forward when the wrapper passed ``past_key_values`` beside
    its new ``cache``)."""
    import warnings

    model = tiny_model(family, attn=attn)
    ids = torch.randint(0, VOCAB, (1, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(input_ids=ids).logits.sum().backward()
        model.eval()
        model(input_ids=ids, use_cache=True)
        model.generate(ids[:, :4], max_new_tokens=3, do_sample=False, pad_token_id=0)


def test_output_attentions_warns_as_sdpa_does_instead_of_returning_nothing_silently():
    """distca cannot return attention weights (each CA-task's scores live on the rank serving it).
    ``output_attentions=True`` gave ``outputs.attentions == ()`` without a word; transformers' ``sdpa``
    and flash attention, which cannot return them either, warn once naming ``output_attentions`` and
    ``eager`` and return no weights: distca does the same (and ``eager`` still returns them)."""
    import warnings

    from transformers import LlamaConfig

    def llama(attn):  # a config each: from_config writes the attention implementation into it
        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=128)
        return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)

    model, sdpa = llama("distca"), llama("sdpa")
    assert model.config._attn_implementation == "distca"
    docs = _documents([5, 7])
    packed = dict(input_ids=torch.cat(docs)[None], position_ids=torch.cat([torch.arange(len(d)) for d in docs])[None])
    with pytest.warns(UserWarning, match=r"output_attentions=True.*attn_implementation='eager'") as caught:
        ours = model(**packed, output_attentions=True)
    assert len(caught) == 1  # once, not per layer
    no_weights = sdpa(**packed, output_attentions=True).attentions  # () (transformers 5.0: None)
    assert not no_weights and ours.attentions == no_weights
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(**packed, output_attentions=True)  # said once per process
        model(**packed)  # not asked: nothing to say
    model.set_attn_implementation("eager")
    weights = model(input_ids=docs[0][None], output_attentions=True).attentions
    assert len(weights) == 2 and weights[0].shape == (1, 4, 5, 5)


# ---- more families: each model type's tiny config, packed documents against each alone ----

def _spread_config(model_type: str):
    """A tiny random config of ``model_type``: the common sizes, the fields its family names
    differently (``SPREAD_FIELDS``), no dropout of any kind, a pad token inside the vocabulary."""
    from transformers import AutoConfig

    from helpers import tiny_config

    if model_type in ("llama", "mistral", "qwen2", "qwen3", "deepseek_v3", "deepseek_v2"):
        return tiny_config(model_type)
    if model_type == "llama4_text":
        return tiny_config("llama4")
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=0)
    config = AutoConfig.for_model(model_type, **{**common, **SPREAD_FIELDS.get(model_type, {})})
    for field in [f for f in config.to_dict() if "dropout" in f or f.endswith("_pdrop")]:
        setattr(config, field, 0.0)
    return config


SPREAD_FIELDS = {  # model_type -> config fields beyond the common tiny ones
    "gemma": dict(head_dim=8),
    "gemma3_text": dict(head_dim=8, sliding_window=4),
    "gpt_neox": dict(rotary_pct=0.5),
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4, n_positions=256, bos_token_id=0, eos_token_id=0),
    "mixtral": dict(num_local_experts=2),
    # its layers hand the attention no sliding_window=: the window (layer 0's) is read from the module
    "qwen2_moe": dict(num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                      use_sliding_window=True, sliding_window=4, max_window_layers=1),
    # nor do PhiMoE's: every layer slides (no layer_types), as its mask says
    "phimoe": dict(num_local_experts=2, sliding_window=4, router_jitter_noise=0.0, input_jitter_noise=0.0),
    "exaone4": dict(sliding_window=4),
    "olmo3": dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
    "cohere2": dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
    "glm": dict(head_dim=8),
}


@pytest.mark.parametrize("model_type", sorted(TESTED_MODEL_TYPES.keys() - set(FAMILIES)))
def test_more_families_packed_exact(model_type):
    """Every tested model type beyond the four above (patches.TESTED_MODEL_TYPES, the list in docs/models.md):
    packed ``position_ids``, logits and every parameter gradient against each document alone (eager).
    Llama 4's layers drop position_ids (documents come from its model's forward) and its chunked
    layers' chunk (5) is shorter than most documents; DeepSeek's value head dim (12) is not q/k's (24)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_spread_config(model_type), attn_implementation="distca",
                                             dtype=torch.float32).train()
    docs = _documents([13, 1, 7, 12], seed=11)
    position_ids = torch.cat([torch.arange(len(d)) for d in docs]).unsqueeze(0)
    _check_packed(model, docs, dict(input_ids=torch.cat(docs).unsqueeze(0), position_ids=position_ids), False,
                  scaled_grad_tolerance=True)


def test_llama4_chunks_and_recorded_documents_matter(monkeypatch):
    """The two things that made Llama 4 silently wrong, each shown to matter: without the chunk
    variant (one document longer than the chunk) and without the model's recorded position_ids (its
    layers get none), logits move far from eager per document."""
    from distca_hf.hf import attention

    model = tiny_model_of("llama4_text")
    docs = _documents([13, 1, 7, 12], seed=12)
    ids = torch.cat(docs).unsqueeze(0)
    pos = torch.cat([torch.arange(len(d)) for d in docs]).unsqueeze(0)
    with torch.no_grad():
        exact = model(input_ids=ids, position_ids=pos).logits
        one_document = model(input_ids=docs[0][None]).logits
        model.set_attn_implementation("eager")
        alone = torch.cat([model(input_ids=d[None]).logits for d in docs], 1)
        model.set_attn_implementation("distca")
        torch.testing.assert_close(exact, alone, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(one_document, alone[:, :13], atol=1e-5, rtol=1e-4)
        with monkeypatch.context() as m:
            m.setattr(attention, "attention_chunk", lambda module: None)
            assert (model(input_ids=docs[0][None]).logits - one_document).abs().max() > 1e-3
        with monkeypatch.context() as m:
            m.setattr(attention, "document_arguments", lambda module, query, kwargs: (None, None, None))
            assert (model(input_ids=ids, position_ids=pos).logits - alone).abs().max() > 1e-3


def tiny_model_of(model_type: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_spread_config(model_type), attn_implementation="distca",
                                            dtype=torch.float32).train()


def test_llama4_gradient_checkpointing_and_cu_seq_lens():
    """Gradient checkpointing recomputes Llama 4's layers after the model's forward, here after another
    forward of other documents: they must find their own documents again (from the arguments their
    decoder layer is called with); cu_seq_lens alone describe documents too."""
    model = tiny_model_of("llama4_text")
    checkpointing_enable(model, use_reentrant=False)
    docs = _documents([13, 1, 7, 12], seed=13)
    weights = [objective_weights((len(d), VOCAB), seed=i) for i, d in enumerate(docs)]
    ref_logits, ref_grads = per_document_reference(model, docs, weights)
    pos = torch.cat([torch.arange(len(d)) for d in docs]).unsqueeze(0)
    logits = model(input_ids=torch.cat(docs).unsqueeze(0), position_ids=pos).logits[0]
    other = torch.cat([torch.arange(3), torch.arange(30)]).unsqueeze(0)  # another packing in between
    model(input_ids=torch.randint(0, VOCAB, (1, 33)), position_ids=other)
    (logits * torch.cat(weights)).sum().backward()
    torch.testing.assert_close(logits, torch.cat(ref_logits), atol=1e-5, rtol=1e-4)
    assert_grads_close(param_grads(model), ref_grads)
    checkpointing_disable(model)
    cu = torch.tensor([0, 13, 14, 21, 33], dtype=torch.int32)
    _check_packed(model, docs, dict(input_ids=torch.cat(docs).unsqueeze(0), cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                    max_length_q=13, max_length_k=13), True)


def test_llama4_temperature_tuning_is_per_document():
    """Llama 4 scales its NoPE layers' queries by their row position from floor_scale on (here 8):
    packed documents past it, and a left-padded row, equal each document alone, gradients included."""
    from transformers import AutoModelForCausalLM

    from helpers import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama4", floor_scale=8), attn_implementation="distca",
                                             dtype=torch.float32).train()
    docs = _documents([13, 1, 7, 12], seed=14)
    pos = torch.cat([torch.arange(len(d)) for d in docs]).unsqueeze(0)
    _check_packed(model, docs, dict(input_ids=torch.cat(docs).unsqueeze(0), position_ids=pos), False)
    padded = torch.cat([torch.zeros(5, dtype=torch.long), docs[3]])[None]
    mask = (torch.arange(17) >= 5).long()[None]
    with torch.no_grad():
        ours = model(input_ids=padded, attention_mask=mask).logits[0, 5:]
        model.set_attn_implementation("eager")
        torch.testing.assert_close(ours, model(input_ids=docs[3][None]).logits[0], atol=1e-5, rtol=1e-4)


@pytest.mark.distributed
def test_llama4_and_deepseek_v3_on_two_ranks(tmp_path):
    """2 gloo ranks, documents spanning both (span_ranks), overlap none and wave, both backward modes,
    colocated and evaluation: Llama 4 (chunked layers, documents from the model's forward) and
    DeepSeek-V3 (value head dim 12 beside q/k's 24, through the all-to-alls both ways) exact against
    each whole document alone; the bytes plan_stats reports are the bytes sent."""
    from dist_harness import run_ranks
    from workers import check_forward_bytes, exact_runs, span_workers

    cases = [("llama4", [9, 30, 4, 1, 16], [36, 24], ("none", "wave"), {}),
             ("deepseek_v3", [30, 50, 7, 1, 12], [60, 40], ("none", "wave"), {})]
    results = run_ranks(span_workers, 2, tmp_path, cases, env={"DISTCA_TOLERANCE": "0.02"})
    for rank, result in enumerate(results):
        assert result["ok"], f"rank {rank}: {result.get('traceback', result['error'])}"
    for family, layers in (("llama4", 4), ("deepseek_v3", 2)):
        per_family = [{"ok": True, "value": r["value"][family]} for r in results]
        for rank, runs in exact_runs(per_family, 5):
            assert all(run["stats"]["dispatched"] for run in runs[:4]), (family, rank)
        check_forward_bytes(per_family, layers=layers)


def _shared_positions_worker(rank, world):
    """Two checkpointed forwards given one ``position_ids`` tensor, padded on rank 0 and unpadded
    (no mask) on rank 1, then one backward; logits, gradients and how many forwards were planned."""
    import distca_hf
    from helpers import param_grads, per_document_reference

    distca_hf.configure(timeout_s=90.0)  # ranks that disagree on a recomputation's forward stop here
    model = tiny_model("llama")
    checkpointing_enable(model, use_reentrant=False)
    first, second = _documents([32, 32], seed=30 + rank)
    positions = torch.arange(32).unsqueeze(0)  # one tensor, both forwards, both ranks
    if rank == 0:
        masks = torch.ones(2, 1, 32, dtype=torch.long)
        masks[0, 0, :12] = 0  # left padding
        masks[1, 0, 20:] = 0  # right padding
        kept, masks = [slice(12, 32), slice(0, 20)], list(masks)
    else:  # no padding: HF passes the attention no mask at all
        kept, masks = [slice(0, 32), slice(0, 32)], [None, None]
    docs = [first[kept[0]], second[kept[1]]]
    weights = [objective_weights((len(d), VOCAB), seed=i) for i, d in enumerate(docs)]
    ref_logits, ref_grads = per_document_reference(model, docs, weights)
    steps_before = distca_hf.plan_stats()["step"] if distca_hf.runtime.context.current_forward() else 0
    logits = [model(input_ids=ids[None], attention_mask=mask, position_ids=positions, use_cache=False).logits[0, rows]
              for ids, mask, rows in zip((first, second), masks, kept)]
    sum((lg * w).sum() for lg, w in zip(logits, weights)).backward()
    grads = param_grads(model)
    return {"logit_err": max(float((lg.detach() - ref).abs().max()) for lg, ref in zip(logits, ref_logits)),
            "grad_excess": max(float(((grads[n] - ref_grads[n]).abs() - 1e-4 * ref_grads[n].abs()).max())
                               for n in ref_grads),
            "forwards_planned": distca_hf.plan_stats()["step"] - steps_before,
            "dispatched": distca_hf.plan_stats()["dispatched"]}


@pytest.mark.distributed
def test_checkpointed_forwards_sharing_position_ids_with_padding_on_one_rank_only(tmp_path):
    """The recomputation of the first forward's layers runs after the second forward, and on rank 1
    (no mask) nothing in the call tells the two forwards apart: the model forward's own contexts,
    carried in the layers' keyword arguments, do, on every rank alike. Before, rank 0 opened a forward
    again there while rank 1 reused the second's, and both stopped with DistCATimeoutError."""
    from dist_harness import run_ranks

    results = run_ranks(_shared_positions_worker, 2, tmp_path, env={"DISTCA_TOLERANCE": "0.02"}, deadline_s=240)
    for rank, result in enumerate(results):
        assert result["ok"], f"rank {rank}: {result.get('traceback', result['error'])}"
        value = result["value"]
        assert value["logit_err"] < 1e-4 and value["grad_excess"] <= 1e-5, (rank, value)
        assert value["forwards_planned"] == 2, (rank, value)  # the recomputations planned nothing again
    assert any(r["value"]["dispatched"] for r in results)
