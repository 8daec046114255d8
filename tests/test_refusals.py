"""Inputs and model features distca cannot compute exactly raise a clear error naming the problem."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GptOssConfig

import distca_hf
from distca_hf import DocumentBoundaryError, UnsupportedAttentionError, find_documents
from helpers import VOCAB, tiny_model


def _packed(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    return ids, pos


def test_a_layer_window_wider_than_the_planned_one_is_refused():
    """A forward's CA-tasks carry the keys of the widest window in the config; a layer asking for a
    wider one (or none) would silently miss keys, so it raises naming both windows."""
    from types import SimpleNamespace

    from distca_hf.runtime.phases import check_layer_window

    wave = SimpleNamespace(kv_window=8, forward_number=3)
    check_layer_window(wave, 8)
    check_layer_window(wave, 2)
    for wider in (9, None):
        with pytest.raises(UnsupportedAttentionError, match=rf"forward 3: a layer asks for sliding_window={wider}.*8 keys"):
            check_layer_window(wave, wider)
    check_layer_window(SimpleNamespace(kv_window=None, forward_number=1), None)


def test_attention_sinks():
    config = GptOssConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2,
                          num_experts_per_tok=1, layer_types=["full_attention"])
    model = AutoModelForCausalLM.from_config(config, attn_implementation="distca")
    with pytest.raises(UnsupportedAttentionError, match="sinks"):
        model(input_ids=torch.arange(6).unsqueeze(0))


def test_dropout_in_training_only():
    model = tiny_model("llama", attention_dropout=0.1)
    ids, pos = _packed([4, 6])
    with pytest.raises(UnsupportedAttentionError, match="dropout=0.1"):
        model.train()(input_ids=ids, position_ids=pos)
    model.eval()(input_ids=ids, position_ids=pos)  # no dropout at evaluation: accepted


def test_non_causal_module():
    model = tiny_model("llama")
    model.model.layers[0].self_attn.is_causal = False
    with pytest.raises(UnsupportedAttentionError, match="non-causal"):
        model(input_ids=torch.arange(6).unsqueeze(0))


@pytest.mark.parametrize(
    "cu_q, cu_k, match",
    [
        ([0, 4, 9], [0, 4, 9], "ends at 9 but the batch holds 10"),
        ([0, 4, 11], [0, 4, 11], "ends at 11 but the batch holds 10"),
        ([0, 4, 10], [0, 5, 10], "cu_seq_lens_q and cu_seq_lens_k differ"),
        ([0, 6, 4, 10], [0, 6, 4, 10], "never decrease"),
        ([1, 4, 10], [1, 4, 10], "start at 0"),
    ],
)
def test_cu_seq_lens_that_disagree_with_the_sequence(cu_q, cu_k, match):
    model = tiny_model("llama")
    kwargs = dict(cu_seq_lens_q=torch.tensor(cu_q, dtype=torch.int32), cu_seq_lens_k=torch.tensor(cu_k, dtype=torch.int32),
                  max_length_q=6, max_length_k=6)
    with pytest.raises(DocumentBoundaryError, match=match):
        model(input_ids=torch.arange(10).unsqueeze(0), **kwargs)


@pytest.mark.parametrize(
    "cu, match",
    [
        (torch.tensor([0.0, 2.5, 10.0]), "cu_seq_lens_q must hold integers, got torch.float32"),
        (torch.tensor([0, 3 + 1j, 10]), "cu_seq_lens_q must hold integers, got torch.complex64"),
        (torch.tensor([[0, 3], [5, 10]]), r"cu_seq_lens_q must be 1-D .* shape \(2, 2\)"),
        ([0, 3, 10], "cu_seq_lens_q must be a 1-D integer tensor .* got list"),
    ],
)
def test_cu_seq_lens_that_are_not_a_1d_integer_tensor(cu, match):
    """Floats and complex numbers were cut to integers, a 2-D tensor flattened, and a list raised
    AttributeError: each is refused naming the argument, at the model and in find_documents."""
    with pytest.raises(DocumentBoundaryError, match=match):
        tiny_model("llama")(input_ids=torch.arange(10).unsqueeze(0), cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    with pytest.raises(DocumentBoundaryError, match=match):
        find_documents(1, 10, 10, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    # the model's pre-hook, which runs before the forward's opening collective, must not raise (one rank
    # alone would leave the others waiting): it counts them as packed and leaves the refusal to the forward
    from distca_hf.hf.model_inputs import DOCUMENT_ARGUMENTS, _packed

    assert _packed(dict(zip(DOCUMENT_ARGUMENTS, (None, cu, cu))), 1)


def test_cu_seq_lens_and_position_ids_that_disagree():
    """position_ids restarting inside a cu_seq_lens document were ignored (cu_seq_lens win), so RoPE
    and attention saw different documents: refused, as the span_ranks path refuses them (one rule,
    planning.documents.check_positions_agree). Positions running on across documents stay fine."""
    from distca_hf.planning.documents import check_positions_agree

    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(DocumentBoundaryError, match="cu_seq_lens_q and position_ids disagree at flat token 4"):
        tiny_model("llama")(input_ids=torch.arange(8).unsqueeze(0), cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                            position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]))
    docs = find_documents(1, 8, 8, cu_seq_lens_q=cu, cu_seq_lens_k=cu, position_ids=torch.arange(8)[None])
    assert docs.lengths.tolist() == [3, 5]
    check_positions_agree(docs, torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]), 1, 8, exact=True)
    with pytest.raises(DocumentBoundaryError, match="span_ranks=True"):
        check_positions_agree(docs, torch.arange(8)[None], 1, 8, exact=True)
    # span_ranks: a piece's keys sit at its first position onwards, so positions must step by 1 inside a
    # document (a row continuing an earlier rank's document starts above 0)
    check_positions_agree(docs, torch.tensor([[7, 8, 9, 0, 1, 2, 3, 4]]), 1, 8, exact=True)
    with pytest.raises(DocumentBoundaryError, match="at flat token 6 .*: 5 follows 2; with span_ranks=True"):
        check_positions_agree(docs, torch.tensor([[0, 1, 2, 0, 1, 2, 5, 6]]), 1, 8, exact=True)
    check_positions_agree(docs, torch.tensor([[0, 1, 2, 0, 1, 2, 5, 6]]), 1, 8)  # without span_ranks: RoPE's own


@pytest.mark.parametrize(
    "positions, match",
    [
        ([0, 1, 2, 5, 6, 7], r"position_ids\[0, 3\] = 5 follows 2"),
        ([0, 1, 1, 2, 3, 4], r"position_ids\[0, 2\] = 1 follows 1"),
        ([0, 1, 2, 0, 2, 3], r"position_ids\[0, 4\] = 2 follows 0"),
        ([0, 1, -1, 0, 1, 2], "negative"),
    ],
)
def test_position_ids_that_do_not_describe_documents(positions, match):
    model = tiny_model("llama")
    with pytest.raises(DocumentBoundaryError, match=match):
        model(input_ids=torch.arange(6).unsqueeze(0), position_ids=torch.tensor([positions]))


def test_padding_inside_a_document():
    model = tiny_model("llama")
    mask = torch.tensor([[1, 1, 0, 1, 1, 1]])
    with pytest.raises(DocumentBoundaryError, match="padding inside the row"):
        model(input_ids=torch.arange(6).unsqueeze(0), attention_mask=mask)


def test_custom_4d_mask():
    model = tiny_model("llama")
    mask = torch.zeros(1, 1, 6, 6)
    with pytest.raises(DocumentBoundaryError, match="2D padding mask"):
        model(input_ids=torch.arange(6).unsqueeze(0), attention_mask=mask)


def test_all_padding_batch():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="no real tokens"):
        model(input_ids=torch.arange(6).unsqueeze(0), attention_mask=torch.zeros(1, 6, dtype=torch.long))


def test_unknown_kernel_backend(monkeypatch):
    monkeypatch.setenv("DISTCA_KERNEL", "triton")
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="DISTCA_KERNEL"):
        model(input_ids=torch.arange(6).unsqueeze(0))


def test_registration_names():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert AttentionInterface._global_mapping["distca"] is distca_hf.distca_attention_forward
    assert "distca" in AttentionMaskInterface._global_mapping


def test_cu_seq_lens_document_crossing_rows():
    model = tiny_model("llama")
    cu = torch.tensor([0, 4, 12], dtype=torch.int32)  # the second document runs from row 0 into row 1
    with pytest.raises(DocumentBoundaryError, match="crosses from row 0"):
        model(input_ids=torch.arange(12).view(2, 6), cu_seq_lens_q=cu, cu_seq_lens_k=cu)


def test_static_cache():
    from transformers import StaticCache

    from distca_hf.patches import cache_argument

    model = tiny_model("llama").eval()
    cache = StaticCache(config=model.config, max_cache_len=16)
    with pytest.raises(UnsupportedAttentionError, match="static"):
        model(input_ids=torch.arange(6).unsqueeze(0), **{cache_argument(model): cache})


def test_a_mask_wider_than_the_input_without_a_cache_is_blamed_not_a_static_cache():
    """Without a cache HF takes the key length from the mask: a mask wider than the input got the
    static-cache refusal, which named the wrong culprit."""
    model = tiny_model("llama")
    with pytest.raises(DocumentBoundaryError, match="attention_mask has 10 columns but the call has only 8 key"):
        model(input_ids=torch.arange(8).unsqueeze(0), attention_mask=torch.ones(1, 10, dtype=torch.long),
              use_cache=False)


def test_the_mask_function_takes_both_of_transformers_mask_signatures():
    """Transformers' mask interface passes ``q_length`` (and ``q_offset``) in later 5.x releases and the
    queries' ``cache_position`` in 5.0-5.3 (every forward of 5.0 failed on it): both give the same
    masks and the same refusals."""
    from distca_hf.hf.mask import distca_mask

    padded = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    for new, old in ((dict(q_length=4), dict(cache_position=torch.arange(4))),
                     (dict(q_length=1, q_offset=3), dict(cache_position=torch.tensor([3])))):
        assert torch.equal(distca_mask(2, kv_length=4, attention_mask=padded, **new),
                           distca_mask(2, kv_length=4, attention_mask=padded, **old))
        assert distca_mask(2, kv_length=4, attention_mask=torch.ones(2, 4, dtype=torch.bool), **old) is None
    with pytest.raises(UnsupportedAttentionError, match="holds 16 slots but only 6 are filled"):
        distca_mask(1, kv_length=16, cache_position=torch.arange(6))
    with pytest.raises(TypeError, match="either q_length .* or cache_position"):
        distca_mask(1, kv_length=4)


def test_models_that_ignore_the_attention_interface_are_refused_at_load():
    """Bloom computes attention in its own code: with "distca" its packed documents would attend to
    each other without a word, so choosing "distca" for it raises, naming the model (plain
    transformers, no Trainer); so does GIT, whose layers look the implementation up in a table."""
    from transformers import BloomConfig

    config = lambda: BloomConfig(n_layer=1, hidden_size=32, n_head=4, vocab_size=VOCAB)
    with pytest.raises(UnsupportedAttentionError, match="BloomForCausalLM computes attention in its own code"):
        AutoModelForCausalLM.from_config(config(), attn_implementation="distca")
    assert AutoModelForCausalLM.from_config(config()).config._attn_implementation == "eager"  # others unaffected
    assert tiny_model("llama").config._attn_implementation == "distca"
    # GIT passes transformers' check but picks its attention class from a table of its own ("eager" only):
    # a bare KeyError('distca') deep in its constructor before
    from transformers import GitConfig

    git = GitConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    with pytest.raises(UnsupportedAttentionError, match="GitForCausalLM computes attention in its own code"):
        AutoModelForCausalLM.from_config(git, attn_implementation="distca")


def test_dropout_hint_names_the_models_own_field():
    from transformers import GPT2Config

    config = GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=VOCAB, attn_pdrop=0.1, bos_token_id=0,
                        eos_token_id=0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="distca").train()
    with pytest.raises(UnsupportedAttentionError, match=r"set config\.attn_pdrop=0\.0"):
        model(input_ids=torch.randint(0, VOCAB, (1, 8)))


def test_a_process_launched_alone_warns(monkeypatch):
    """The CPU launch trap under a plain Trainer: `accelerate launch --cpu --num_processes 2` starts
    one process; the first distca forward says so (once)."""
    from distca_hf.runtime import processes

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(processes, "parent_command",
                        lambda: (["accelerate", "launch", "--cpu", "--num_processes", "2", "train.py"], None))
    model = tiny_model("llama")
    with pytest.warns(UserWarning, match=r"asked for 2 processes .* runs alone"):
        model(input_ids=torch.randint(0, VOCAB, (1, 8)))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(input_ids=torch.randint(0, VOCAB, (1, 8)))  # once per process


def test_a_family_whose_layers_pass_on_no_documents_is_refused(monkeypatch):
    """The guard: a model given packed documents whose attention calls get neither position_ids,
    cu_seq_lens nor the model's keyword arguments (here Llama's attention made to pass nothing on)
    raises naming the model, instead of returning rows whose documents attended to each other."""
    from transformers.models.llama import modeling_llama

    model = tiny_model("llama")
    ids, pos = _packed([4, 6])
    forward = modeling_llama.LlamaAttention.forward

    def passes_nothing_on(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        return forward(self, hidden_states, position_embeddings, attention_mask, cache)

    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", passes_nothing_on)
    with pytest.raises(UnsupportedAttentionError,
                       match="LlamaModel was given packed documents .* 2 of its attention calls got neither"):
        model(input_ids=ids, position_ids=pos)
    model(input_ids=ids)  # one document per row: nothing to keep apart
    model(input_ids=ids, position_ids=torch.arange(10)[None])


def test_model_position_ids_that_do_not_fit_the_call():
    from distca_hf.hf.model_inputs import MODEL_DOCUMENTS, ModelForward, document_arguments

    attention = torch.nn.Linear(1, 1)
    query = torch.zeros(1, 4, 10, 8)  # a call that sees 10 of the model's 16 positions
    packed = torch.cat([torch.arange(4), torch.arange(12)])[None]
    with pytest.raises(UnsupportedAttentionError, match=r"packed position_ids given to the model \(shape \(1, 16\)\)"):
        document_arguments(attention, query, {MODEL_DOCUMENTS: ModelForward(packed)})
    plain = torch.arange(16)[None]
    assert document_arguments(attention, query, {MODEL_DOCUMENTS: ModelForward(plain)}) == (None, None, None)
    mrope = torch.cat([torch.arange(4), torch.arange(6)]).expand(3, 1, 10)  # multimodal rotary positions
    assert document_arguments(attention, query, {MODEL_DOCUMENTS: ModelForward(mrope)}) == (None, None, None)


def _llama4(**overrides):
    from helpers import tiny_config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("llama4", **overrides), attn_implementation="distca",
                                            dtype=torch.float32).eval()


def test_llama4_chunked_layers_under_a_cache_that_dropped_keys():
    """HF's cache keeps a chunked layer's last chunk - 1 keys: decoding while it holds fewer is exact
    (chunk 5: a 2-token prompt and one step), from chunk - 1 cached tokens on it raises."""
    from transformers import DynamicCache

    from distca_hf.patches import cache_argument

    model = _llama4()
    name = cache_argument(model)  # "cache" from transformers 5.24, "past_key_values" before
    ids = torch.randint(0, VOCAB, (1, 6))
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :2], use_cache=True, **{name: cache})
        step = model(input_ids=ids[:, 2:3], use_cache=True, **{name: cache}).logits
        model.set_attn_implementation("eager")
        torch.testing.assert_close(step, model(input_ids=ids[:, :3]).logits[:, 2:], atol=1e-5, rtol=1e-4)
        model.set_attn_implementation("distca")
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :5], use_cache=True, **{name: cache})
        with pytest.raises(UnsupportedAttentionError, match=r"chunked attention \(attention_chunk_size=5\) with a KV "
                                                            r"cache of 4 past keys"):
            model(input_ids=ids[:, 5:6], use_cache=True, **{name: cache})


# ---- the docs' "Supported models and features" section is generated from the code that refuses ----

def test_docs_support_section_is_generated_from_the_tables():
    """docs/models.md between the supported-models markers is exactly ``support_markdown()`` (FEATURES,
    REFUSALS, patches.TESTED_MODEL_TYPES). To change it, edit distca_hf/hf/support.py or
    TESTED_MODEL_TYPES and run ``make docs`` (python -m distca_hf.tools.docs_reference)."""
    from pathlib import Path

    from distca_hf.hf.support import support_markdown

    page = (Path(__file__).resolve().parents[1] / "docs" / "models.md").read_text()
    start = page.index("<!-- supported-models:start")
    body = page[page.index("\n", start) + 1 : page.index("<!-- supported-models:end -->")]
    assert body == support_markdown()


def _trigger_refusal(what: str):
    """Run the smallest input that the refusal ``what`` (a REFUSALS row) is about."""
    from transformers import BloomConfig, DynamicCache, StaticCache
    from transformers.models.llama import modeling_llama

    from distca_hf.patches import cache_argument

    ids, pos = _packed([4, 6])
    if what.startswith("models that compute attention in their own code"):
        AutoModelForCausalLM.from_config(BloomConfig(n_layer=1, hidden_size=32, n_head=4, vocab_size=VOCAB),
                                         attn_implementation="distca")
    elif what.startswith("a family whose layers pass on no document argument"):
        forward = modeling_llama.LlamaAttention.forward
        modeling_llama.LlamaAttention.forward = (
            lambda self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kw:
            forward(self, hidden_states, position_embeddings, attention_mask, cache))
        try:
            tiny_model("llama")(input_ids=ids, position_ids=pos)
        finally:
            modeling_llama.LlamaAttention.forward = forward
    elif what.startswith("packed documents in decoders whose positions count along the row"):
        from transformers import BartConfig

        config = BartConfig(vocab_size=VOCAB, d_model=32, decoder_layers=1, encoder_layers=1, decoder_attention_heads=4,
                            encoder_attention_heads=4, decoder_ffn_dim=64, encoder_ffn_dim=64, max_position_embeddings=64)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="distca")
        model(input_ids=ids)  # one document per row: exact, accepted
        model(input_ids=ids, position_ids=pos)
    elif what.startswith("packed documents in models with Mamba"):
        from transformers import Lfm2Config

        config = Lfm2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, block_ff_dim=64,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
                            layer_types=["conv", "full_attention"])
        model = AutoModelForCausalLM.from_config(config, attn_implementation="distca")
        model(input_ids=ids)  # one document per row: exact, accepted
        model(input_ids=ids, position_ids=pos)
    elif what.startswith("sparse attention"):
        from transformers import AutoConfig

        AutoModelForCausalLM.from_config(AutoConfig.for_model("deepseek_v32", num_hidden_layers=1, hidden_size=32,
                                                              vocab_size=VOCAB), attn_implementation="distca")
    elif what.startswith("attention sinks"):
        config = GptOssConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2,
                              num_experts_per_tok=1, layer_types=["full_attention"])
        AutoModelForCausalLM.from_config(config, attn_implementation="distca")(input_ids=ids)
    elif what.startswith("attention dropout"):
        tiny_model("llama", attention_dropout=0.1).train()(input_ids=ids, position_ids=pos)
    elif what.startswith("non-causal"):
        model = tiny_model("llama")
        model.model.layers[0].self_attn.is_causal = False
        model(input_ids=ids)
    elif what.startswith("masks that let tokens attend beyond causal order"):
        model, inputs = _gemma3_with_an_image()
        model(**inputs)
    elif what.startswith("a `config.sliding_window` that the layers do not use"):
        from transformers import MistralConfig
        from transformers.masking_utils import causal_mask_function

        from distca_hf.hf.mask import distca_mask

        distca_mask(1, q_length=4, kv_length=4, mask_function=causal_mask_function,
                    config=MistralConfig(sliding_window=4))
    elif what.startswith("custom 4D masks"):
        tiny_model("llama")(input_ids=ids, attention_mask=torch.zeros(1, 1, 10, 10))
    elif what.startswith("static (pre-allocated) KV caches"):
        model = tiny_model("llama").eval()
        model(input_ids=ids, **{cache_argument(model): StaticCache(config=model.config, max_cache_len=16)})
    elif what.startswith("a `cu_seq_lens` document crossing rows"):
        cu = torch.tensor([0, 4, 12], dtype=torch.int32)
        tiny_model("llama")(input_ids=torch.arange(12).view(2, 6), cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    elif what.startswith("chunked layers decoding"):
        model = _llama4()
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=ids[:, :5], use_cache=True, **{cache_argument(model): cache})
            model(input_ids=ids[:, 5:6], use_cache=True, **{cache_argument(model): cache})
    else:
        raise AssertionError(f"no trigger for the refusal {what!r}: add one here")


def _gemma3_with_an_image():
    """A tiny Gemma 3 VLM, its text model on distca, its vision tower on eager, and one row holding an
    image of 4 tokens (``token_type_ids`` 1), which HF's mask lets attend to each other both ways."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    text = Gemma3TextConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=64,
                            max_position_embeddings=256, pad_token_id=0)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                image_size=16, patch_size=4)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                                        image_token_index=90, boi_token_index=91,
                                                        eoi_token_index=92)).eval()
    model.set_attn_implementation({"text_config": "distca", "vision_config": "eager", "": "eager"})
    ids = torch.tensor([[5, 6, 91, 90, 90, 90, 90, 92, 7, 8, 9]])
    return model, dict(input_ids=ids, pixel_values=torch.randn(1, 3, 16, 16), token_type_ids=(ids == 90).long(),
                       attention_mask=torch.ones_like(ids))


def test_mask_functions_are_read_for_what_distca_applies_itself_and_refused_beyond_it():
    """``mask_shape`` reads transformers' composed mask functions: causal, a sliding window, chunks,
    padding and packed documents are what distca applies itself; image blocks that attend both ways
    are refused (they were computed causally, silently), blocks of none (all -1: text) are not, a
    pattern of a model's own is refused, never dropped, and a bidirectional mask is left to the layers
    (the Bart family's ``ForCausalLM`` builds one for its cross-attention)."""
    from transformers import masking_utils as hf

    from distca_hf.hf.mask import mask_shape

    padding = hf.padding_mask_function(torch.ones(1, 8, dtype=torch.bool))
    assert mask_shape(hf.causal_mask_function) == (None, None)
    assert mask_shape(hf.and_masks(hf.sliding_window_causal_mask_function(4), padding)) == (4, None)
    assert mask_shape(hf.chunked_causal_mask_function(5, torch.zeros(1, dtype=torch.long))) == (None, 5)
    if hasattr(hf, "blockwise_overlay"):  # (transformers 5.24; 5.0 gives image tokens as a function of its own)
        text = hf.blockwise_overlay(torch.full((1, 8), -1))
        assert mask_shape(hf.or_masks(hf.causal_mask_function, text)) == (None, None)
        image = hf.blockwise_overlay(torch.tensor([[-1, -1, 0, 0, 0, -1, -1, -1]]))
        with pytest.raises(UnsupportedAttentionError, match="attend beyond causal order"):
            mask_shape(hf.and_masks(hf.or_masks(hf.causal_mask_function, image), padding))
    with pytest.raises(UnsupportedAttentionError, match="attend beyond causal order"):
        mask_shape(hf.or_masks(hf.causal_mask_function, lambda b, h, q, kv: q >= 0))
    with pytest.raises(UnsupportedAttentionError, match="a pattern distca does not know"):
        mask_shape(hf.and_masks(hf.causal_mask_function, lambda b, h, q, kv: kv > 0))
    assert mask_shape(hf.bidirectional_mask_function) is None  # an encoder's: refused where a layer runs it


def test_gemma3_text_rows_are_exact_and_rows_with_an_image_refused():
    """The text model of a Gemma 3 VLM on distca: a row without an image equals eager; a row with one
    is refused (its image tokens attend to each other both ways in HF's mask)."""
    model, inputs = _gemma3_with_an_image()
    with pytest.raises(UnsupportedAttentionError, match="attend beyond causal order"):
        model(**inputs)
    text = dict(input_ids=torch.tensor([[5, 6, 7, 8, 9, 10]]))
    with torch.no_grad():
        ours = model(**text).logits
        model.set_attn_implementation("eager")
        torch.testing.assert_close(ours, model(**text).logits, rtol=1e-5, atol=1e-5)


def test_recurrent_families_and_layers_that_drop_cu_seq_lens_are_refused_packed():
    """xLSTM (recurrent blocks, no layer_types) packed, and StableLM given its documents by cu_seq_lens
    alone (its layers pass on only position_ids, which run along the row), were silent wrong answers;
    StableLM with restarting position_ids still runs."""
    from transformers import AutoConfig

    ids, pos = _packed([4, 6])
    xlstm = AutoModelForCausalLM.from_config(AutoConfig.for_model("xlstm", vocab_size=VOCAB, hidden_size=64,
                                                                  num_blocks=2, num_heads=8),
                                             attn_implementation="distca")
    with pytest.raises(UnsupportedAttentionError, match="carry state along a packed row"):
        xlstm(input_ids=ids, position_ids=pos)
    stablelm = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "stablelm", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, partial_rotary_factor=0.25, pad_token_id=0), attn_implementation="distca")
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    try:
        stablelm(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=6, max_length_k=6)
    except DocumentBoundaryError as e:  # transformers 5.0's StableLM builds its own 4D mask: refused, as any such mask
        assert "a model family builds in its own code" in str(e)
        return
    with pytest.raises(UnsupportedAttentionError, match="by cu_seq_lens alone.*could not keep the documents apart"):
        stablelm(input_ids=ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=6, max_length_k=6)


def test_every_refusal_in_the_table_is_raised_by_the_code_it_names():
    """Each REFUSALS row: its phrase is in the source of the module it names, and its smallest input
    raises an error (the one distca raises for it) whose message holds that phrase."""
    import importlib
    import inspect

    from transformers import CONFIG_MAPPING

    from distca_hf.hf.support import REFUSALS

    for refusal in REFUSALS:
        assert refusal.says in inspect.getsource(importlib.import_module(refusal.raised_in)), refusal.what
        if refusal.what.startswith("sparse attention") and "deepseek_v32" not in CONFIG_MAPPING:
            continue  # (transformers 5.0 has no DeepSeek-V3.2: test_sparse_layer_types_... covers the refusal)
        try:
            _trigger_refusal(refusal.what)
        except (UnsupportedAttentionError, DocumentBoundaryError) as e:
            assert refusal.says in str(e), (refusal.what, str(e))
        else:
            raise AssertionError(f"nothing raised for the refusal {refusal.what!r}")


def test_sparse_key_indices_given_to_the_attention_call():
    """DeepSeek-V3.2 hands non-eager attention the key indices each query may see (``indices``):
    ignoring them would attend to every key, so the call raises."""
    from distca_hf.hf import distca_attention_forward

    model = tiny_model("llama")
    attention = model.model.layers[0].self_attn
    q = torch.zeros(1, 4, 6, 8)
    with pytest.raises(UnsupportedAttentionError, match="does not support sparse attention"):
        distca_attention_forward(attention, q, q[:, :2], q[:, :2], None, indices=torch.zeros(1, 6, 2, dtype=torch.int32))


@pytest.mark.parametrize("layer_type", ["indexed_attention", "deepseek_sparse_attention", "qwen_sparse_attention",
                                        "compressed_sparse_attention"])
def test_sparse_layer_types_of_every_transformers_release_are_refused(layer_type):
    """A model whose layers attend to a selection of their keys is refused under the layer type names of
    transformers 5.24 and of the releases before it (5.17 named DeepSeek-V3.2's and GLM-MoE-DSA's
    indexer layers "deepseek_sparse_attention"); a dense model beside them is not."""
    from distca_hf.hf.model_check import refuse_sparse_attention

    model = tiny_model("llama")
    model.config.layer_types = ["full_attention", layer_type]
    with pytest.raises(UnsupportedAttentionError, match=f"has sparse attention layers \\('{layer_type}'"):
        refuse_sparse_attention(model)
    model.config.layer_types = ["full_attention", "sliding_attention"]
    refuse_sparse_attention(model)


def test_linear_attention_families_may_pack_with_cu_seq_lens_only():
    """Qwen3-Next's linear attention keeps packed documents apart given cu_seq_lens (with
    flash-linear-attention; transformers raises without it): packed position_ids alone are refused
    with that hint, cu_seq_lens reach transformers' own check."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        "qwen3_next", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_value_heads=2, linear_num_key_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, layer_types=["linear_attention", "full_attention"], pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="distca")
    ids, pos = _packed([4, 6])
    with pytest.raises(UnsupportedAttentionError, match=r"Qwen3NextForCausalLM, pass cu_seq_lens_q/cu_seq_lens_k"):
        model(input_ids=ids, position_ids=pos)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    try:
        model(input_ids=ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=6, max_length_k=6)
    except ValueError as e:  # no flash-linear-attention here: transformers' own refusal, not distca's
        assert "flash-linear-attention" in str(e)
