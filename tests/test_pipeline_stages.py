"""HF causal LMs split into pipeline stages (``distca_hf.training.pipeline_stages``).

Reference: each document of a packed row run alone through the whole model with eager attention
(``helpers.per_document_reference``). Stages 0..P-1 composed in one process on the packed row must
give its logits and every parameter's gradient (fp32, 1e-5), for every family we split, with eager
attention (HF's per-document masks, chosen per layer type) and with distca's. Layer types are mixed
unevenly (sliding, full, full, sliding) with windows shorter than the documents, so a stage that
picked its layers' masks or rotary embeddings by position in the stage, not in the model, fails.
On 2 gloo processes: torch's own ``PipelineStage`` + GPipe with our static shapes, the tied
embedding's gradients summed between the stages, an optimizer step, the saved folder loaded back
by ``from_pretrained`` equal to the single-process run.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dist_harness import run_ranks
from distca_hf.training import pipeline_stages as ps
from helpers import VOCAB, assert_grads_close, objective_weights, param_grads, per_document_reference, tiny_config

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")
MIXED_LAYER_TYPES = ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]
LENGTHS = [7, 12, 5]  # one packed row; windows of 4 tokens are shorter than two of its documents


def stage_config(family: str, **overrides):
    """A 4-layer tiny config of ``family``; the families with per-layer types get them mixed unevenly."""
    overrides = {"num_hidden_layers": 4, **overrides}
    if family in ("llama", "mistral", "qwen3"):
        return tiny_config(family, **overrides)
    if family == "qwen2":
        return tiny_config(family, use_sliding_window=True, sliding_window=4, layer_types=MIXED_LAYER_TYPES,
                           **overrides)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=False)
    common.update(overrides)
    if family == "gemma":
        return AutoConfig.for_model("gemma", **common)
    # gemma2: attention and final logit softcapping on by default; gemma3_text: local and global rotary
    return AutoConfig.for_model(family, sliding_window=4, layer_types=MIXED_LAYER_TYPES, **common)


def stage_model(family: str, attn: str = "eager", seed: int = 0, **overrides):
    torch.manual_seed(seed)
    config = stage_config(family, **overrides)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32).train()


def packed_row(lengths=LENGTHS, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    return docs, torch.cat(docs).unsqueeze(0), position_ids


def run_stages(stages, input_ids, position_ids):
    """Stages 0..P-1 in turn, checking each one's input and output against ``stage_io_shapes``."""
    out = input_ids
    for stage in stages:
        expected_in, expected_out = ps.stage_io_shapes(
            stage.config, stage_index=stage.stage_index, num_stages=stage.num_stages,
            micro_batch_size=input_ids.shape[0], seq_len=input_ids.shape[1], dtype=torch.float32)
        assert (out.shape, out.dtype) == (expected_in.shape, expected_in.dtype)
        out = stage(out, position_ids=position_ids)
        assert (out.shape, out.dtype) == (expected_out.shape, expected_out.dtype)
        assert expected_in.device.type == expected_out.device.type == "meta"
    return out


def skip_unsplittable_release(family: str) -> None:
    """Gemma splits only where its embedding scales by sqrt(hidden_size) itself (transformers 5.24 does,
    5.0 does not): there the split is refused, naming the release (checked), and the test skips."""
    model = stage_model(family, "eager")
    if family.startswith("gemma") and not hasattr(model.model.embed_tokens, "embed_scale"):
        with pytest.raises(ValueError, match="with this transformers version: its embedding"):
            ps.build_stage_module(model, stage_index=0, num_stages=2)
        pytest.skip(f"{family}'s embedding does not scale itself in this transformers release (refused, checked)")


@pytest.mark.parametrize("num_stages", [2, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_stages_compose_to_the_whole_model(family, num_stages):
    skip_unsplittable_release(family)
    docs, input_ids, position_ids = packed_row()
    weights = objective_weights((1, sum(LENGTHS), VOCAB))
    for attn in ("eager", "distca"):
        model = stage_model(family, attn)
        ref_logits, ref_grads = per_document_reference(model, docs, list(weights[0].split(LENGTHS)))
        stages = [ps.build_stage_module(model, stage_index=i, num_stages=num_stages) for i in range(num_stages)]

        logits = run_stages(stages, input_ids, position_ids)
        (logits * weights).sum().backward()
        torch.testing.assert_close(logits[0], torch.cat(ref_logits), atol=1e-5, rtol=1e-4)
        assert_grads_close(param_grads(model), ref_grads)  # the stages share the model's parameters

        # the stages partition the model's parameters, under the model's own names
        names = [ps.stage_parameter_names(stage) for stage in stages]
        assert sorted(n for per_stage in names for n in per_stage) == sorted(n for n, _ in model.named_parameters())
        per_stage = 4 // num_stages
        for i, stage in enumerate(stages):
            layers = list(stage.model.layers)
            assert [layer.self_attn.layer_idx for layer in layers] == list(range(i * per_stage, (i + 1) * per_stage))
            assert all(layer is model.model.layers[j] for j, layer in zip(stage.layer_range, layers))
            assert (stage.model.embed_tokens is not None) == (i == 0)
            assert isinstance(stage.model.norm, torch.nn.Identity) == (i < num_stages - 1)
            assert (stage.lm_head is not None) == (i == num_stages - 1)
            assert stage.model.rotary_emb is model.model.rotary_emb
        # the whole model is left whole
        assert len(model.model.layers) == 4 and model.model.embed_tokens is not None


def test_uneven_split_is_refused_with_both_numbers():
    with pytest.raises(ValueError, match=r"6 decoder layers do not split evenly into 4 stages "
                                         r"\(pipeline_parallel_size=4\).*divisor of 6: 1, 2, 3, 6"):
        ps.check_layer_split(6, 4)
    model = stage_model("llama")
    with pytest.raises(ValueError, match=r"4 decoder layers do not split evenly into 3 stages"):
        ps.build_stage_module(model, stage_index=0, num_stages=3)
    with pytest.raises(ValueError, match=r"stage_index must be an integer in \[0, 2\)"):
        ps.build_stage_module(model, stage_index=2, num_stages=2)
    assert ps.stage_layer_range(8, 4, 3) == range(6, 8)
    assert ps.stage_layer_range(np.int64(8), np.int64(4), np.int64(3)) == range(6, 8)  # sizes computed with numpy


def test_unsupported_model_type_is_refused_by_name():
    torch.manual_seed(0)
    config = AutoConfig.for_model("gpt2", vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"cannot split GPT2LMHeadModel \(model_type 'gpt2'\).*llama, mistral"):
        ps.build_stage_module(model, stage_index=0, num_stages=2)
    # a Gemma whose embedding does not scale itself (its stack's forward would, on every stage)
    gemma = stage_model("gemma")
    gemma.model.embed_tokens = torch.nn.Embedding(VOCAB, 32)
    with pytest.raises(ValueError, match=r"model_type 'gemma'.*a later stage would scale the hidden states it "
                                         r"receives again"):
        ps.build_stage_module(gemma, stage_index=1, num_stages=2)


def test_stage_inputs_are_checked():
    model = stage_model("llama")
    first, last = (ps.build_stage_module(model, stage_index=i, num_stages=2) for i in range(2))
    with pytest.raises(ValueError, match=r"stage 0 of 2 \(the first\) takes input_ids"):
        first(torch.zeros(1, 5, 32))
    with pytest.raises(ValueError, match=r"stage 1 of 2 takes the previous stage's hidden states \[micro_batch, "
                                         r"seq, 32\]"):
        last(torch.zeros(1, 5, 16))
    with pytest.raises(ValueError, match=r"position_ids must be \[micro_batch, seq\] = \[1, 5\]"):
        first(torch.zeros(1, 5, dtype=torch.long), position_ids=torch.zeros(1, 6, dtype=torch.long))


def test_tied_embedding_copies_sum_to_the_whole_models_gradient():
    """On several processes the first stage's embedding and the last stage's LM head are two copies
    of one weight: their gradients summed are the whole (tied) model's gradient."""
    docs, input_ids, position_ids = packed_row()
    weights = objective_weights((1, sum(LENGTHS), VOCAB))
    model = stage_model("llama", tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    _, ref_grads = per_document_reference(model, docs, list(weights[0].split(LENGTHS)))
    # one copy of the model per stage, as on separate processes
    stages = [ps.build_stage_module(copy.deepcopy(model), stage_index=i, num_stages=4) for i in range(4)]
    logits = run_stages(stages, input_ids, position_ids)
    (logits * weights).sum().backward()

    embed, head = ps.tied_embedding_parameter(stages[0]), ps.tied_embedding_parameter(stages[-1])
    assert embed is stages[0].model.embed_tokens.weight and head is stages[-1].lm_head.weight
    assert ps.tied_embedding_parameter(stages[1]) is None and ps.tied_embedding_parameter(stages[2]) is None
    tied = ref_grads["model.embed_tokens.weight"]
    assert (embed.grad - tied).abs().max() > 1e-3 and (head.grad - tied).abs().max() > 1e-3  # each one is partial
    torch.testing.assert_close(embed.grad + head.grad, tied, atol=1e-5, rtol=1e-4)
    untied = ps.build_stage_module(stage_model("llama"), stage_index=0, num_stages=2)
    assert ps.tied_embedding_parameter(untied) is None


@pytest.mark.parametrize("family, tied", [("gemma", True), ("qwen3", False)])
def test_single_stage_saves_an_ordinary_folder(tmp_path, family, tied):
    skip_unsplittable_release(family)
    model = stage_model(family, tie_word_embeddings=tied)
    stage = ps.build_stage_module(model, stage_index=0, num_stages=1)
    ps.save_pipeline_model(stage, tmp_path, pipeline_group=None)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(loaded) is type(model)
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tied
    expected = model.state_dict()
    assert loaded.state_dict().keys() == expected.keys()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def _pipeline_worker(rank, world, out_dir):
    """Stage ``rank`` of a tied 4-layer Llama on torch's PipelineStage + GPipe (2 micro-batches), then
    the tied gradients summed, an SGD step, the model saved, and a refusal of unsynchronised copies."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    model = stage_model("llama", tie_word_embeddings=True)
    rows = [packed_row([7, 9], seed=1), packed_row([3, 10, 3], seed=2)]
    input_ids = torch.cat([row[1] for row in rows])
    position_ids = torch.cat([row[2] for row in rows])
    weights = objective_weights((2, 16, VOCAB))

    reference = copy.deepcopy(model)  # the single-process run: whole model, one batch, one SGD step
    ref_logits = reference(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
    (ref_logits * weights).sum().backward()
    ref_grads = {name: p.grad.clone() for name, p in reference.named_parameters(remove_duplicate=False)}
    torch.optim.SGD(reference.parameters(), lr=0.5).step()

    stage = ps.build_stage_module(model, stage_index=rank, num_stages=world)
    del model
    inputs, outputs = ps.stage_io_shapes(stage.config, stage_index=rank, num_stages=world, micro_batch_size=1,
                                         seq_len=16, dtype=torch.float32)
    pipe = PipelineStage(stage, rank, world, torch.device("cpu"), input_args=inputs, output_args=outputs,
                         group=dist.group.WORLD)
    schedule = ScheduleGPipe(pipe, n_microbatches=2, loss_fn=lambda logits, w: (logits * w).sum(), scale_grads=False)
    losses = []
    if rank == 0:
        schedule.step(input_ids, position_ids=position_ids)
    else:
        schedule.step(position_ids=position_ids, target=weights, losses=losses)
        torch.testing.assert_close(sum(losses), (ref_logits * weights).sum(), atol=1e-4, rtol=1e-5)

    ps.sync_tied_embedding_grads(stage, group=dist.group.WORLD)
    grads = {name: p.grad for name, p in stage.named_parameters()}
    assert_grads_close(grads, {name: ref_grads[name] for name in grads})
    torch.optim.SGD(stage.parameters(), lr=0.5).step()
    ps.save_pipeline_model(stage, out_dir + "/saved", pipeline_group=dist.group.WORLD)
    dist.barrier()
    if rank == 0:
        from safetensors import safe_open

        with safe_open(out_dir + "/saved/model.safetensors", "pt") as saved:
            assert "lm_head.weight" not in saved.keys()  # tied: saved once, as HF does
        loaded = AutoModelForCausalLM.from_pretrained(out_dir + "/saved", dtype=torch.float32)
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
        expected = reference.state_dict()
        assert loaded.state_dict().keys() == expected.keys()
        for name, tensor in loaded.state_dict().items():
            torch.testing.assert_close(tensor, expected[name], atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")

    if rank == world - 1:  # copies that drifted apart (tied gradients not summed) are refused on every rank
        with torch.no_grad():
            stage.lm_head.weight.add_(0.25)
    try:
        ps.gather_full_state_dict(stage, pipeline_group=dist.group.WORLD)
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.distributed
def test_two_process_pipeline_syncs_tied_grads_and_saves_one_folder(tmp_path):
    results = run_ranks(_pipeline_worker, 2, tmp_path, str(tmp_path), deadline_s=180)
    failed = [f"rank {rank}: {r.get('traceback', r['error'])}" for rank, r in enumerate(results) if not r["ok"]]
    assert not failed, "\n".join(failed)
    for result in results:
        assert "the tied embedding's copies differ" in result["value"], result["value"]
        assert "max abs diff 0.25" in result["value"] and "sync_tied_embedding_grads" in result["value"]


def _pingpong_stages_worker(rank, world):
    """Both ranks run stages 0 and 1 of one model in turn with distca's ping-pong across the two ranks
    (CAD inside a stage's data-parallel group): each stage's decoder stack is HF's, so ping-pong runs."""
    import distca_hf

    distca_hf.configure(overlap="pingpong")
    lengths = [40] if rank == 0 else [6, 9, 5, 12, 8]  # skewed, so attention moves between the ranks
    docs, input_ids, position_ids = packed_row(lengths, seed=rank)
    weights = objective_weights((1, sum(lengths), VOCAB), seed=rank)
    model = stage_model("qwen2", attn="distca")
    ref_logits, ref_grads = per_document_reference(model, docs, list(weights[0].split(lengths)))
    stages = [ps.build_stage_module(model, stage_index=i, num_stages=2) for i in range(2)]
    hidden = stages[0](input_ids, position_ids=position_ids)
    overlap_first = distca_hf.plan_stats()["overlap"]
    logits = stages[1](hidden, position_ids=position_ids)
    (logits * weights).sum().backward()
    torch.testing.assert_close(logits[0], torch.cat(ref_logits), atol=1e-5, rtol=1e-4)
    assert_grads_close(param_grads(model), ref_grads)
    return [overlap_first, distca_hf.plan_stats()["overlap"]]


@pytest.mark.distributed
def test_stages_run_pingpong_across_a_stages_data_parallel_ranks(tmp_path):
    results = run_ranks(_pingpong_stages_worker, 2, tmp_path, env={"DISTCA_TOLERANCE": "0.02",
                                                                   "DISTCA_TIMEOUT_S": "60"}, deadline_s=180)
    failed = [f"rank {rank}: {r.get('traceback', r['error'])}" for rank, r in enumerate(results) if not r["ok"]]
    assert not failed, "\n".join(failed)
    assert all(r["value"] == ["pingpong", "pingpong"] for r in results), results
