"""Mixed precision: autocast hands the attention q/k in float32 (a float32 rotary embedding) and v
in bfloat16; distca computes in one dtype the way HF's own paths do (the autocast dtype), on the
local, dispatched and ping-pong paths. Checked against each document alone through eager attention
under the same autocast, and through the plain ``Trainer(bf16=True, use_cpu=True)`` on one and two
processes against the exact float32 run."""

from __future__ import annotations

import pytest
import torch

from dist_harness import run_ranks
from helpers import VOCAB, tiny_model

LENGTHS = [23, 9, 40, 1, 15]


def _packed(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (1, sum(lengths)), generator=g)
    return ids, torch.cat([torch.arange(n) for n in lengths])[None]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_autocast_bf16_matches_each_document_alone(family):
    """Packed documents under bf16 autocast against each document alone through eager attention
    under the same autocast (HF's SDPA is no reference here: with packed position_ids and no mask it
    lets documents attend to each other in this transformers version, 0.26 off even in fp32)."""
    ids, pos = _packed(LENGTHS)
    model = tiny_model(family)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = model(input_ids=ids, position_ids=pos).logits
    ours.float().square().mean().backward()
    our_grad = model.model.layers[0].self_attn.q_proj.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    model.set_attn_implementation("eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bounds = torch.tensor([0, *LENGTHS]).cumsum(0).tolist()
        alone = torch.cat([model(input_ids=ids[:, a:b]).logits for a, b in zip(bounds[:-1], bounds[1:])], dim=1)
    alone.float().square().mean().backward()
    assert ours.dtype == alone.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), alone.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(our_grad, model.model.layers[0].self_attn.q_proj.weight.grad, rtol=5e-2, atol=2e-3)


def test_mixed_query_key_value_dtypes_compute_in_one():
    """The attention function itself: q, k in float32 and v in bfloat16 (what a float32 rotary
    embedding leaves) compute in v's dtype; under autocast, in the autocast dtype; every result
    equals the same call with all three already in that dtype."""
    import distca_hf

    module = tiny_model("llama").model.layers[0].self_attn
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 12, 8, generator=g), torch.randn(1, 2, 12, 8, generator=g), torch.randn(1, 2, 12, 8, generator=g)
    pos = torch.cat([torch.arange(5), torch.arange(7)])[None]
    call = lambda *qkv: distca_hf.distca_attention_forward(module, *qkv, None, position_ids=pos)[0]
    bf16 = lambda t: t.to(torch.bfloat16)
    mixed = call(q, k, bf16(v))
    assert mixed.dtype == torch.bfloat16
    torch.testing.assert_close(mixed, call(bf16(q), bf16(k), bf16(v)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = call(q, k, v)
    assert autocast.dtype == torch.bfloat16
    torch.testing.assert_close(autocast, call(bf16(q), bf16(k), bf16(v)))


def _trainer_losses(bf16: bool, out_dir: str, steps: int = 3) -> list[float]:
    """A plain ``Trainer(use_cpu=True)`` on packed documents (DataCollatorWithFlattening), a distca
    model, bf16 autocast or float32."""
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    g = torch.Generator().manual_seed(3)
    documents = [{"input_ids": torch.randint(1, VOCAB, (n,), generator=g).tolist()}
                 for n in (30, 12, 50, 7, 25, 18, 40, 9) * 2]
    args = TrainingArguments(output_dir=out_dir, bf16=bf16, use_cpu=True, per_device_train_batch_size=4,
                             max_steps=steps, learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no",
                             disable_tqdm=True, seed=0, data_seed=0)
    model = tiny_model("llama")
    trainer = Trainer(model=model, args=args, train_dataset=documents,
                      data_collator=DataCollatorWithFlattening(return_position_ids=True))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_plain_trainer_bf16_on_one_process(tmp_path):
    """bf16 autocast trains (it crashed in the CPU kernel before) and its losses stay within bf16
    rounding of the exact float32 run."""
    bf16 = _trainer_losses(True, str(tmp_path / "bf16"))
    fp32 = _trainer_losses(False, str(tmp_path / "fp32"))
    assert len(bf16) == 3
    assert bf16 == pytest.approx(fp32, rel=1e-2)


def _two_process_worker(rank, world, out_dir):
    import distca_hf

    losses = {}
    for overlap in ("none", "pingpong"):  # the dispatched path, and the ping-pong stack
        distca_hf.configure(overlap=overlap)
        for bf16 in (True, False):
            losses[f"{overlap}, bf16={bf16}"] = _trainer_losses(bf16, f"{out_dir}/{overlap}-{bf16}")
    return losses


@pytest.mark.distributed
def test_plain_trainer_bf16_on_two_processes(tmp_path):
    results = run_ranks(_two_process_worker, 2, tmp_path, str(tmp_path), env={"ACCELERATE_USE_CPU": "1"})
    for r in results:
        assert r["ok"], r.get("traceback", r["error"])
        losses = r["value"]
        for overlap in ("none", "pingpong"):
            assert len(losses[f"{overlap}, bf16=True"]) == 3
            assert losses[f"{overlap}, bf16=True"] == pytest.approx(losses[f"{overlap}, bf16=False"], rel=1e-2)
