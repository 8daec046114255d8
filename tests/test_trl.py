"""distca where most HF fine-tuning happens: TRL's ``SFTTrainer`` with packing (``bfd``, padding-free)
and the plain ``transformers.Trainer`` with ``DataCollatorWithFlattening``.

Both emit padding-free rows (one flattened row per device, ``position_ids`` restarting at 0 where a
document starts, ``cu_seq_lens_q/k``). The reference is the same run, same seed, data and order,
with ``attn_implementation="eager"``: with no KV cache (``use_cache=False``, as in training)
transformers builds the block-diagonal causal mask from the packed ``position_ids``
(``masking_utils.find_packed_sequence_indices``), so every document attends only to itself, computed
densely in fp32 by code that shares nothing with distca's. The logged losses must agree step by step, on one
process and on two, where distca balances the attention of the ranks' rows (``plan_stats()`` after
every step: within the 2% tolerance of the mean, from worse). Tiny random-weight models, text from ``pydoc_data.topics``, nothing downloaded.
"""

from __future__ import annotations

import os

import pytest
import torch

from dist_harness import run_ranks

trl = pytest.importorskip("trl", reason="TRL is in the test extra: pip install 'distca-hf[test]'")

MAX_LENGTH = 192  # TRL's packed sequence length (bfd: documents longer than this are truncated)
STEPS = 3


def _texts() -> list[str]:
    """24 of Python's help topics, of very different lengths."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    return [topics[name][:2000] for name in names[::3][:24]]


def _tokenizer(texts):
    """A byte-level BPE trained on ``texts`` (deterministic, so every rank trains the same one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<eos>")


# Document lengths in tokens, 3 to 190 (below MAX_LENGTH, so nothing is truncated): rows of very
# different attention cost, which distca balances across ranks.
LENGTHS = [5, 190, 12, 33, 150, 7, 64, 120, 9, 180, 20, 45, 100, 3, 170, 28, 80, 140, 15, 60, 110, 6, 185, 40]


def _documents(tokenizer):
    """A ``datasets.Dataset`` of token ids (an ``input_ids`` column): the texts' first ``LENGTHS``
    tokens."""
    import datasets

    ids = [tokenizer(t, add_special_tokens=False)["input_ids"][:n] for t, n in zip(_texts(), LENGTHS)]
    assert [len(d) for d in ids] == LENGTHS
    return datasets.Dataset.from_dict({"input_ids": ids})


def _model(attn: str, vocab: int):
    import distca_hf  # noqa: F401  (registers "distca")
    from helpers import tiny_model

    return tiny_model("llama", attn=attn, vocab_size=vocab, max_position_embeddings=1024, use_cache=False)


def _common_arguments(output_dir: str, bf16: bool = False) -> dict:
    return dict(output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=2, learning_rate=0.5,
                optim="sgd", lr_scheduler_type="constant", logging_steps=1, report_to="none", seed=0, data_seed=0,
                save_strategy="no", disable_tqdm=True, dataloader_pin_memory=False, use_cpu=True, bf16=bf16)


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _documents_per_row(trainer) -> int:
    """How many documents the first training row holds (from the collator's ``cu_seq_lens_q``)."""
    batch = next(iter(trainer.get_train_dataloader()))
    return int(batch["cu_seq_lens_q"].numel()) - 1


class _PlanRecorder:
    """A ``TrainerCallback`` (built lazily: transformers loads in the workers) recording each step's
    plan: per-rank attention pairs colocated and as served."""

    def __new__(cls):
        from transformers import TrainerCallback

        class PlanRecorder(TrainerCallback):
            def __init__(self):
                self.plans = []

            def on_step_end(self, args, state, control, **kwargs):
                import distca_hf

                stats = distca_hf.plan_stats()
                self.plans.append({key: stats[key] for key in ("dispatched", "attn_pairs_local", "attn_pairs_served")})

        return PlanRecorder()


def _train(trainer, attn: str) -> dict:
    recorder = _PlanRecorder() if attn == "distca" else None
    if recorder is not None:
        trainer.add_callback(recorder)
    documents_per_row = _documents_per_row(trainer)
    trainer.train()
    return {"losses": _losses(trainer), "documents_per_row": documents_per_row,
            "plans": recorder.plans if recorder is not None else None}


def sft_run(attn: str, output_dir: str, bf16: bool = False) -> dict:
    """``SFTTrainer`` with ``packing=True`` (``bfd``, so padding-free) on the tiny Llama; ``bf16``:
    TRL's default mixed precision (autocast; on CPU it needs ``use_cpu=True``)."""
    from trl import SFTConfig, SFTTrainer

    tokenizer = _tokenizer(_texts())
    config = SFTConfig(**_common_arguments(output_dir, bf16), packing=True, packing_strategy="bfd",
                       max_length=MAX_LENGTH)
    trainer = SFTTrainer(model=_model(attn, len(tokenizer)), args=config, train_dataset=_documents(tokenizer),
                         processing_class=tokenizer)
    assert trainer.padding_free  # bfd packing turns padding-free on
    return _train(trainer, attn)


def flattening_run(attn: str, output_dir: str) -> dict:
    """The plain ``Trainer`` with ``DataCollatorWithFlattening`` (its flash-attention kwargs included)."""
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    tokenizer = _tokenizer(_texts())
    trainer = Trainer(model=_model(attn, len(tokenizer)), args=TrainingArguments(**_common_arguments(output_dir)),
                      train_dataset=_documents(tokenizer),
                      data_collator=DataCollatorWithFlattening(return_flash_attn_kwargs=True))
    return _train(trainer, attn)


def _assert_same_losses(distca: dict, eager: dict) -> None:
    assert len(distca["losses"]) == STEPS and distca["documents_per_row"] >= 2  # packed rows, several documents
    torch.testing.assert_close(torch.tensor(distca["losses"]), torch.tensor(eager["losses"]), rtol=1e-5, atol=1e-5)


def test_sft_trainer_with_bfd_packing_on_one_process(tmp_path):
    distca = sft_run("distca", str(tmp_path / "distca"))
    eager = sft_run("eager", str(tmp_path / "eager"))
    _assert_same_losses(distca, eager)


def test_sft_trainers_default_bf16_runs_and_stays_near_fp32(tmp_path):
    """SFTConfig's default ``bf16=True`` (autocast): the run works and its losses stay within bf16's
    precision of the fp32 reference."""
    mixed = sft_run("distca", str(tmp_path / "bf16"), bf16=True)
    eager = sft_run("eager", str(tmp_path / "eager"))
    torch.testing.assert_close(torch.tensor(mixed["losses"]), torch.tensor(eager["losses"]), rtol=2e-2, atol=0)


def _two_rank_worker(rank, world, out_dir):
    # A fixed tolerance: these tiny steps are balanced whatever a time model would say they cost.
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), DISTCA_TOLERANCE="0.02")
    results = {}
    for name, run in (("sft", sft_run), ("flattening", flattening_run)):
        results[name] = {attn: run(attn, os.path.join(out_dir, name, attn)) for attn in ("distca", "eager")}
    return results


@pytest.mark.distributed
def test_sft_trainer_and_plain_trainer_on_two_processes(tmp_path):
    results = run_ranks(_two_rank_worker, 2, tmp_path, str(tmp_path), deadline_s=400)
    for rank, result in enumerate(results):
        assert result["ok"], f"rank {rank}: {result.get('traceback', result['error'])}"
    for name in ("sft", "flattening"):
        runs = [r["value"][name] for r in results]
        for run in runs:
            _assert_same_losses(run["distca"], run["eager"])
        plans = runs[0]["distca"]["plans"]
        assert plans == runs[1]["distca"]["plans"] and len(plans) == STEPS  # every rank makes the same plan
        for plan in plans:
            local, served = plan["attn_pairs_local"], plan["attn_pairs_served"]
            assert plan["dispatched"] and sum(served) == sum(local)  # every query-key pair computed once
            assert max(served) <= 1.02 * sum(served) / len(served) + 1  # within the tolerance of the mean ...
        assert any(max(p["attn_pairs_local"]) > 1.1 * sum(p["attn_pairs_local"]) / 2 for p in plans)  # ... from worse
        assert runs[0]["distca"]["losses"] == runs[1]["distca"]["losses"]  # the Trainer logs the global loss
