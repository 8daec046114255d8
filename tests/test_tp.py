"""transformers' tensor parallelism with distca on CPU gloo ranks: tensor parallelism 2 x data
parallelism 2 on 4 processes, the model sharded by transformers itself
(``from_pretrained(..., distributed_config=DistributedConfig(tp_size=2, fsdp_size=2))``: DTensor
tensor parallelism plus FSDP2). Each rank holds half of every layer's heads; the attention-server
groups are the ranks holding the same heads ([0, 2] and [1, 3]), read from the model without the
user repeating the size. Logits and the gathered gradients equal every whole document run alone with
eager attention in one process (fp32), with a document spanning the two data-parallel ranks."""

from __future__ import annotations

import re

import pytest
import torch

from dist_harness import run_ranks
from helpers import tiny_model
from workers import global_stream

# one data-parallel pair's global stream: the 50-token document crosses from data index 0 to 1
DOC_LENGTHS = [30, 50, 7, 1, 12]
SLICES = [60, 40]


def _tp_worker(rank, world, model_dir, out_dir):
    import os

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
    report.update(server_ranks=list(groups.server_ranks), tensor_parallel=groups.topology.tensor_parallel,
                  local_heads=widths[0] // 8,
                  tensor_index=tensor_index, dispatched=stats["dispatched"], local=stats["attn_pairs_local"],
                  kv_received=sum(stats["kv_tokens_received_per_layer"]))
    return report


@pytest.mark.distributed
def test_tensor_parallel_2_by_data_parallel_2_is_exact(tmp_path):
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
        assert value["dispatched"] and sum(value["local"]) == sum(n * (n + 1) // 2 for n in DOC_LENGTHS)
        assert value["kv_received"] > 0  # the spanning document's prefix crossed data-parallel ranks
        got = torch.load(tmp_path / f"rank{rank}.pt")
        lo = sum(SLICES[:rank // 2])
        torch.testing.assert_close(got["logits"], logits.detach()[lo:lo + SLICES[rank // 2]], atol=1e-5, rtol=1e-5)
        assert got["grads"].keys() == expected.keys()
        for name in expected:
            torch.testing.assert_close(got["grads"][name], expected[name], atol=1e-5, rtol=1e-4,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
