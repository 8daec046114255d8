"""transformers' tensor parallelism with distca on CPU gloo ranks: tensor parallelism 2 x data
parallelism 2 on 4 processes, the model sharded by transformers itself
(``from_pretrained(..., distributed_config=DistributedConfig(tp_size=2, fsdp_size=2))``: DTensor
tensor parallelism plus FSDP2). Each rank holds half of every layer's heads; the attention-server
groups are the ranks holding the same heads ([0, 2] and [1, 3]), read from the model without the
user repeating the size. Logits and the gathered gradients equal every whole document run alone with
eager attention in one process (fp32), with a document spanning the two data-parallel ranks;
``DistCAAccelerator(parallelism_config=...)`` builds the same groups on CPU processes; and
``DistCATrainer`` on that model (Accelerate's ParallelismConfig made by transformers, accepted on CPU
processes) gives the tensor-parallel peers the same rows, lays the global batches out over the
data-parallel ranks and trains to the losses and weights of one process on the same documents."""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.nn.functional as F

from dist_harness import run_ranks
from helpers import assert_trained_like_reference, tiny_model
from workers import global_stream

# one data-parallel pair's global stream: the 50-token document crosses from data index 0 to 1
DOC_LENGTHS = [30, 50, 7, 1, 12]
SLICES = [60, 40]
# the trainer's documents (the 120-token one spans both data-parallel ranks' rows) and its settings
TRAIN_LENGTHS = [120, 3, 17, 40, 1, 9, 30, 48, 5, 70, 11]
TOKENS_PER_RANK = 48
LR = 0.5
STEPS = 2


def _train_documents():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, 96, (n,), generator=g).tolist() for n in TRAIN_LENGTHS]


def _tp_worker(rank, world, model_dir, out_dir):
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import distca_hf
    from distca_hf import DistCAPlugin

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, distributed_config=DistributedConfig(tp_size=2, fsdp_size=2), attn_implementation="distca",
        dtype=torch.float32)
    report = {}
    try:  # a size that disagrees with the model's: refused on every rank before any collective
        DistCAPlugin(tensor_parallel_size=1).attach(model=model)
    except ValueError as e:
        report["conflict"] = str(e)
    groups = DistCAPlugin(tolerance=0.02, span_ranks=True).attach(model=model)  # tensor parallelism: the model's
    data_index, _, tensor_index = groups.topology.coordinates(rank)
    tokens, positions, weights = global_stream(DOC_LENGTHS)
    lo, hi = sum(SLICES[:data_index]), sum(SLICES[:data_index + 1])
    widths = []  # q_proj's local output: this rank's heads x head dim 8
    model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, out: widths.append(out.shape[-1]))
    logits = model(input_ids=tokens[lo:hi][None], position_ids=positions[lo:hi][None]).logits[0]
    (logits * weights[lo:hi]).sum().backward()
    # FSDP2 averages over the 2 data-parallel ranks: x2 is the sum of both ranks' gradients
    grads = {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad) * 2
             for name, p in model.named_parameters()}
    torch.save({"logits": logits.detach(), "grads": grads}, f"{out_dir}/rank{rank}.pt")
    stats = distca_hf.plan_stats()
    distca_hf.configure(overlap="pingpong")  # refused on FSDP2-sharded layers, on every rank before any collective
    try:
        model(input_ids=tokens[lo:hi][None], position_ids=positions[lo:hi][None])
    except ValueError as e:
        report["pingpong"] = str(e)
    distca_hf.configure(overlap="none")
    report.update(server_ranks=list(groups.server_ranks), tensor_parallel=groups.topology.tensor_parallel,
                  local_heads=widths[0] // 8,
                  tensor_index=tensor_index, dispatched=stats["dispatched"], local=stats["attn_pairs_local"],
                  kv_received=sum(stats["kv_tokens_received_per_layer"]))
    report["accelerator"] = _accelerator_groups(model)
    report["trainer"] = _train_tensor_parallel(rank, model_dir, out_dir)
    return report


def _accelerator_groups(model):
    """DistCAAccelerator given accelerate's ParallelismConfig on CPU processes (which plain Accelerate refuses):
    the server groups before and after preparing the tensor-parallel model."""
    from accelerate import ParallelismConfig
    from accelerate.state import AcceleratorState

    from distca_hf import DistCAAccelerator, DistCAPlugin

    accelerator = DistCAAccelerator(parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2),
                                    distca_plugin=DistCAPlugin(tolerance=0.05))
    before = list(accelerator.distca.server_ranks)
    accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
    report = {"before": before, "after": list(accelerator.distca.server_ranks),
              "tensor_parallel": accelerator.distca.topology.tensor_parallel,
              "plugin_config": type(accelerator.distca_plugin.parallelism_config).__name__}
    AcceleratorState._reset_state(reset_partial_state=True)
    # what `accelerate launch` with a parallelism_config section sets
    variables = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_TP_SIZE": "2",
                 "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2"}
    os.environ.update(variables)
    try:
        report["from_launch"] = list(DistCAAccelerator(distca_plugin=DistCAPlugin()).distca.server_ranks)
    finally:
        for name in variables:
            del os.environ[name]
    AcceleratorState._reset_state(reset_partial_state=True)  # the trainer below sets Accelerate up afresh
    return report


def _train_tensor_parallel(rank, model_dir, out_dir):
    """DistCATrainer on the tensor-parallel model, SGD, ``STEPS`` steps: the rows each rank trained, the losses,
    and (rank 0) the final weights gathered whole."""
    from transformers import AutoModelForCausalLM, TrainingArguments
    from transformers.distributed import DistributedConfig

    from distca_hf import DistCAPlugin, DistCATrainer, PackingConfig

    class RecordingTrainer(DistCATrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            cu, ids = inputs["cu_seq_lens_q"].tolist(), inputs["input_ids"][0].tolist()
            self.recorded.append([[ids[a:b] for a, b in zip(cu, cu[1:])], int(inputs["position_ids"][0, 0]),
                                  int(num_items_in_batch)])
            return super().training_step(model, inputs, num_items_in_batch)

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, distributed_config=DistributedConfig(tp_size=2, fsdp_size=2), attn_implementation="distca",
        dtype=torch.float32)
    args = TrainingArguments(
        output_dir=os.path.join(out_dir, "run"), per_device_train_batch_size=1, max_steps=STEPS, learning_rate=LR,
        optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, logging_steps=1, report_to=[],
        disable_tqdm=True, seed=0, data_seed=0, save_strategy="no", dataloader_pin_memory=False)
    trainer = RecordingTrainer(model=model, args=args, train_dataset=_train_documents(),
                               packing=PackingConfig(tokens_per_rank=TOKENS_PER_RANK, seed=0),
                               distca_plugin=DistCAPlugin(tolerance=0.05))
    trainer.recorded = []
    trainer.train()
    params = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
              for name, p in trainer.model.named_parameters()}
    if rank == 0:
        torch.save(params, os.path.join(out_dir, "trained.pt"))
    return {"recorded": trainer.recorded, "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "server_ranks": list(trainer.distca.server_ranks), "span_ranks": trainer.span_ranks}


def _reference_training(steps):
    """SGD in one process on every step's whole documents, eager; the loss is the mean next-token
    cross-entropy over the step's label tokens. Returns the losses and the final weights."""
    model = tiny_model("llama", attn="eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for documents in steps:
        total = sum(F.cross_entropy(model(input_ids=torch.tensor([d])).logits[0, :-1], torch.tensor(d[1:]),
                                    reduction="sum") for d in documents if len(d) > 1)
        loss = total / sum(len(d) - 1 for d in documents)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach() for name, p in model.named_parameters()}


@pytest.mark.distributed
def test_tensor_parallel_2_by_data_parallel_2_is_exact(tmp_path):
    import inspect

    from transformers.distributed import DistributedConfig

    if "tp_size" not in inspect.signature(DistributedConfig).parameters:
        pytest.skip("this transformers release's DistributedConfig has no tp_size (5.0)")
    import accelerate
    from packaging.version import Version

    if Version(accelerate.__version__) < Version("1.12"):  # (transformers' Trainer raises ImportError saying so)
        pytest.skip("transformers' Trainer takes a ParallelismConfig from accelerate 1.12")
    model = tiny_model("llama", attn="eager")
    model.save_pretrained(tmp_path / "model")
    results = run_ranks(_tp_worker, 4, tmp_path, str(tmp_path / "model"), str(tmp_path))
    for rank, result in enumerate(results):
        assert result["ok"], f"rank {rank}: {result.get('traceback', result['error'])}"

    # the reference: every whole document alone, eager, one process
    tokens, _, weights = global_stream(DOC_LENGTHS)
    bounds = torch.tensor([0, *DOC_LENGTHS]).cumsum(0).tolist()
    logits = torch.cat([model(input_ids=tokens[a:b][None]).logits[0] for a, b in zip(bounds, bounds[1:])])
    (logits * weights).sum().backward()
    expected = {name: p.grad for name, p in model.named_parameters()}

    for rank, result in enumerate(results):
        value = result["value"]
        assert value["server_ranks"] == ([0, 2] if rank % 2 == 0 else [1, 3])  # the ranks holding the same heads
        assert value["tensor_parallel"] == 2 and value["local_heads"] == 2  # of 4
        assert "DistCAPlugin.tensor_parallel_size = 1" in value["conflict"]
        assert re.search(r"the model's tensor-parallel size \(\w*LlamaForCausalLM.tp_size\) = 2", value["conflict"])
        assert "overlap='pingpong' cannot run LlamaDecoderLayer layers sharded by FSDP2" in value["pingpong"]
        assert value["dispatched"] and sum(value["local"]) == sum(n * (n + 1) // 2 for n in DOC_LENGTHS)
        assert value["kv_received"] > 0  # the spanning document's prefix crossed data-parallel ranks
        got = torch.load(tmp_path / f"rank{rank}.pt")
        lo = sum(SLICES[:rank // 2])
        torch.testing.assert_close(got["logits"], logits.detach()[lo:lo + SLICES[rank // 2]], atol=1e-5, rtol=1e-5)
        assert got["grads"].keys() == expected.keys()
        for name in expected:
            torch.testing.assert_close(got["grads"][name], expected[name], atol=1e-5, rtol=1e-4,
                                       msg=lambda m: f"rank {rank} {name}: {m}")

    for rank, result in enumerate(results):
        groups = [0, 2] if rank % 2 == 0 else [1, 3]
        assert result["value"]["accelerator"] == {"before": groups, "after": groups, "tensor_parallel": 2,
                                                  "plugin_config": "CPUParallelismConfig", "from_launch": groups}

    # DistCATrainer: the tensor-parallel peers (0, 1) and (2, 3) read the same rows; the data-parallel ranks 0 and 2
    # hold the two slices of each global batch (a row starting at position p > 0 continues the other's document)
    trained = [result["value"]["trainer"] for result in results]
    assert all(t["span_ranks"] and t["server_ranks"] == ([0, 2] if r % 2 == 0 else [1, 3])
               for r, t in enumerate(trained))
    assert trained[0]["recorded"] == trained[1]["recorded"] and trained[2]["recorded"] == trained[3]["recorded"]
    assert len(trained[0]["recorded"]) == STEPS
    steps = []
    for first, second in zip(trained[0]["recorded"], trained[2]["recorded"]):
        documents = [list(d) for d in first[0]]
        pieces, position = [list(d) for d in second[0]], second[1]
        if position > 0:
            assert len(documents[-1]) == position  # the continuation's prefix is the first row's last piece
            documents[-1] += pieces.pop(0)
        steps.append(documents + pieces)
        assert first[2] == second[2] == sum(len(d) - 1 for d in steps[-1])  # label tokens counted once
    assert any(second[1] > 0 for second in trained[2]["recorded"])  # a document spanned the ranks
    losses, params = _reference_training(steps)
    assert_trained_like_reference([t["losses"] for t in trained], torch.load(tmp_path / "trained.pt"), losses, params)
