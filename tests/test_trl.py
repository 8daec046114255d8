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

``DistCASFTTrainer`` (``SFTTrainer(packing=True)`` whose global batches span the ranks, so documents
longer than one rank's row train whole) is checked against a reference that shares nothing with
TRL or distca: each step's documents, looked up whole in the dataset, run alone with eager attention,
the loss over the targets the dataset's labels allow, a plain SGD step; losses and parameters agree.
"""

from __future__ import annotations

import copy
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


# -- DistCASFTTrainer: SFTTrainer(packing=True) with documents longer than one rank's row ------------

ROW = 112  # SFTConfig.max_length under DistCASFTTrainer: the tokens of one rank's row
# LENGTHS above 112 (120, 140, 150, 170, 180, 185, 190) cannot fit one rank's row: on two ranks they
# train whole, spanning both (global batches of 2 x 112 tokens).


def _sft_documents(tokenizer):
    """``_documents`` with a ``labels`` column as TRL's completion-only loss builds it: the first third
    of every document is prompt (-100), the rest completion."""
    documents = _documents(tokenizer)
    labels = [[-100] * (len(ids) // 3) + ids[len(ids) // 3:] for ids in documents["input_ids"]]
    return documents.add_column("labels", labels)


def distca_sft_run(output_dir: str, max_length: int) -> dict:
    """``DistCASFTTrainer`` on the tiny Llama (fp32, SGD, no clipping): the logged losses, the rows of
    the first ``STEPS`` steps on this rank, the trained parameters and what packing did."""
    import itertools

    from trl import SFTConfig

    from distca_hf.training import DistCASFTTrainer
    from helpers import shifted_target_recipe

    tokenizer = _tokenizer(_texts())
    arguments = {**_common_arguments(output_dir), "per_device_train_batch_size": 1, "per_device_eval_batch_size": 1,
                 "max_grad_norm": 0.0}
    config = SFTConfig(**arguments, packing=True, max_length=max_length)
    trainer = DistCASFTTrainer(model=_model("distca", len(tokenizer)), args=config,
                               train_dataset=_sft_documents(tokenizer), processing_class=tokenizer,
                               **shifted_target_recipe())
    rows = [{key: batch[key][0].tolist() for key in ("input_ids", "position_ids")}
            for batch in itertools.islice(trainer.get_train_dataloader(), STEPS)]
    recorder = _PlanRecorder()
    trainer.add_callback(recorder)
    trainer.train()
    evaluation = trainer.evaluate(eval_dataset=_sft_documents(tokenizer))
    return {"losses": _losses(trainer), "rows": rows, "span_ranks": trainer.span_ranks, "eval": evaluation,
            "plans": recorder.plans,
            "spanning_documents": trainer.packing_reports["train"].spanning_documents,
            "parameters": {n: p.detach().tolist() for n, p in trainer.model.named_parameters()}}


def _whole_document_reference(steps: list[list[dict]], tokenizer) -> tuple[list[float], dict]:
    """An independent single-process run: each step's global batch (its ranks' rows in rank order)
    split into whole documents, every document looked up in the dataset (its tokens must be one whole
    document), run alone with eager attention; the loss is the mean next-token NLL over the targets
    the dataset's labels allow, followed by a plain SGD step. Returns the losses and parameters."""
    documents = _sft_documents(tokenizer)
    by_tokens = {tuple(ids): labels for ids, labels in zip(documents["input_ids"], documents["labels"])}
    model = _model("eager", len(tokenizer))
    losses = []
    for rows in steps:
        tokens = [t for row in rows for t in row["input_ids"]]
        starts = [i for i, p in enumerate(p for row in rows for p in row["position_ids"]) if p == 0]
        total, count = 0.0, 0
        for start, end in zip(starts, starts[1:] + [len(tokens)]):
            ids = tokens[start:end]
            labels = by_tokens.get(tuple(ids))
            assert labels is not None, f"tokens {start}..{end} of the global batch are not one whole document"
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, :-1]
            targets = torch.tensor(labels[1:])
            nll = torch.nn.functional.cross_entropy(logits, targets.clamp(min=0), reduction="none")
            total = total + (nll * targets.ne(-100)).sum()
            count += int(targets.ne(-100).sum())
        loss = total / count
        model.zero_grad(set_to_none=True)
        loss.backward()
        with torch.no_grad():
            for parameter in model.parameters():
                parameter -= 0.5 * parameter.grad  # _common_arguments: SGD, learning rate 0.5, constant
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}, _mean_nll(model, documents)


def _mean_nll(model, documents) -> tuple[float, int]:
    """The mean next-token NLL over every allowed target of ``documents``, each run alone, and the
    number of targets."""
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, labels in zip(documents["input_ids"], documents["labels"]):
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, :-1]
            targets = torch.tensor(labels[1:])
            nll = torch.nn.functional.cross_entropy(logits, targets.clamp(min=0), reduction="none")
            total += float((nll * targets.ne(-100)).sum())
            count += int(targets.ne(-100).sum())
    return total / count, count


def _assert_equals_reference(run: dict, steps: list[list[dict]]) -> None:
    from helpers import assert_grads_close

    losses, parameters, (eval_loss, targets) = _whole_document_reference(steps, _tokenizer(_texts()))
    assert len(run["losses"]) == STEPS
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-5)
    assert_grads_close({n: torch.tensor(v) for n, v in run["parameters"].items()}, parameters)
    # the evaluation after training: every target of the whole documents, once
    assert run["eval"]["eval_label_tokens"] == targets
    assert run["eval"]["eval_loss"] == pytest.approx(eval_loss, rel=1e-5)
    # compute_metrics by the usual shift meets the same targets (the completions' only), across rank boundaries too
    assert run["eval"]["eval_recipe_targets"] == targets, run["eval"]
    assert run["eval"]["eval_recipe_loss_sum"] / targets == pytest.approx(eval_loss, rel=1e-5)


def test_distca_sft_trainer_on_one_process_trains_whole_documents(tmp_path):
    """One process, rows of 2 x ROW tokens: the global batches the two-process test splits over two
    ranks, here on one, equal the independent whole-document reference."""
    run = distca_sft_run(str(tmp_path), max_length=2 * ROW)
    assert not run["span_ranks"] and max(len(r["input_ids"]) for r in run["rows"]) > ROW
    _assert_equals_reference(run, [[row] for row in run["rows"]])


def _spanning_worker(rank, world, out_dir):
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), DISTCA_TOLERANCE="0.02")
    run = distca_sft_run(os.path.join(out_dir, "sft"), max_length=ROW)
    if rank:
        run["parameters"] = {n: sum(map(sum, v)) if isinstance(v[0], list) else sum(v)
                             for n, v in run["parameters"].items()}  # rank 0's are compared whole
    return run


def _spanning_length(rows: list[dict]) -> int:
    """Tokens of the document that rank 0's row ends and rank 1's row continues (0: none)."""
    positions = rows[1]["position_ids"]
    if positions[0] == 0:
        return 0
    return positions[0] + (positions.index(0) if 0 in positions else len(positions))


@pytest.mark.distributed
def test_distca_sft_trainer_documents_longer_than_a_rank_span_two_processes(tmp_path):
    """``DistCASFTTrainer`` on two processes, ``max_length`` = ROW tokens per rank: documents up to
    2 x ROW train whole, spanning both ranks, with TRL's completion-only labels; per-step losses and
    the trained parameters equal the single-process eager run over the whole documents."""
    results = run_ranks(_spanning_worker, 2, tmp_path, str(tmp_path), deadline_s=300)
    for rank, result in enumerate(results):
        assert result["ok"], f"rank {rank}: {result.get('traceback', result['error'])}"
    first, second = (r["value"] for r in results)
    assert first["span_ranks"] and first["spanning_documents"] > 0
    for name, total in second["parameters"].items():  # the ranks hold the same parameters
        assert torch.tensor(first["parameters"][name]).sum().item() == pytest.approx(total, rel=1e-5, abs=1e-5)
    assert first["losses"] == second["losses"]  # the Trainer logs the global loss
    steps = [list(rows) for rows in zip(first["rows"], second["rows"])]
    # a document longer than a rank's row, its pieces on both ranks, is in the steps compared
    assert any(_spanning_length(rows) > ROW for rows in steps)
    # distca balanced the ranks' attention (a continuing piece attends to its whole prefix: it costs more)
    assert first["plans"] == second["plans"] and len(first["plans"]) == STEPS
    for plan in first["plans"]:
        local, served = plan["attn_pairs_local"], plan["attn_pairs_served"]
        assert plan["dispatched"] and sum(served) == sum(local)
        assert max(served) <= 1.02 * sum(served) / len(served) + 1
    assert any(max(p["attn_pairs_local"]) > 1.1 * sum(p["attn_pairs_local"]) / 2 for p in first["plans"])
    _assert_equals_reference(first, steps)


def test_distca_sft_trainer_refuses_what_it_cannot_train_exactly(tmp_path):
    """Each bad combination is refused before anything trains, naming the setting and its fix."""
    import datasets
    from transformers import DataCollatorWithFlattening
    from trl import SFTConfig

    from distca_hf import DistCAPlugin
    from distca_hf.training import DistCASFTTrainer

    tokenizer = _tokenizer(_texts())
    documents = _sft_documents(tokenizer)
    good = {**_common_arguments(str(tmp_path)), "per_device_train_batch_size": 1, "per_device_eval_batch_size": 1,
            "packing": True, "max_length": ROW}
    cases = [
        ({"per_device_train_batch_size": 2}, {}, "per_device_train_batch_size=1"),
        ({"packing": False}, {}, "packing=True"),
        ({"packing_strategy": "wrapped"}, {}, "not padding-free"),
        ({"eval_packing": False}, {}, "eval_packing"),
        ({"pad_to_multiple_of": 8}, {}, "pad_to_multiple_of=8 is not applied"),  # (ignored before)
        ({}, {"model": _model("eager", len(tokenizer))}, "attn_implementation='distca'"),
        ({}, {"data_collator": DataCollatorWithFlattening()}, "drop data_collator"),
        ({}, {"train_dataset": datasets.Dataset.from_dict(documents.to_dict()).to_iterable_dataset()}, "streaming"),
        ({}, {"distca_plugin": DistCAPlugin(pipeline_parallel_size=2)}, "pipeline stages"),
    ]
    for settings, arguments, message in cases:
        arguments = {"model": _model("distca", len(tokenizer)), "train_dataset": documents, **arguments}
        with pytest.raises(ValueError, match=message):
            DistCASFTTrainer(args=SFTConfig(**{**good, **settings}), processing_class=tokenizer, **arguments)
    with pytest.raises(TypeError, match="SFTConfig"):
        DistCASFTTrainer(model=_model("distca", len(tokenizer)), args=None, train_dataset=documents,
                         processing_class=tokenizer)

    # what DistCATrainer refused and this trainer took (an IndexError in the embedding, TRL's StopIteration, a
    # loss of 0 trained on, labels read as "trained" whatever they said), refused by name
    def trainer(dataset, vocab=len(tokenizer), processing_class=tokenizer):
        return DistCASFTTrainer(model=_model("distca", vocab), args=SFTConfig(**good), train_dataset=dataset,
                                processing_class=processing_class)

    with pytest.raises(ValueError, match="DistCASFTTrainer: train_dataset holds no documents"):
        trainer(datasets.Dataset.from_dict({"input_ids": []}))
    with pytest.raises(ValueError, match="train_dataset has nothing to learn"):
        trainer(datasets.Dataset.from_dict({"input_ids": [[5], [6]]}))
    masked = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7]] * 2, "labels": [[5, -100, -100]] * 2})
    with pytest.raises(ValueError, match="train_dataset has nothing to learn: every label after a document's first"):
        trainer(masked)  # every target masked (it trained at loss 0)
    from distca_hf.training.trl import SFTPackedDataset
    from distca_hf import PackedDataset, PackingConfig

    config = PackingConfig(tokens_per_rank=ROW)
    rows = PackedDataset([[5, 6, 7]], config)
    with pytest.raises(TypeError, match=r"SFTPackedDataset\(labels=...\) must be a distca_hf.PackedDataset or None, "
                                        "got list"):
        SFTPackedDataset(rows, [[5, 6, 7]])
    with pytest.raises(TypeError, match=r"SFTPackedDataset\(rows=...\) must be a distca_hf.PackedDataset, got list"):
        SFTPackedDataset([[5, 6, 7]])
    from distca_hf.training.trl import SFTPackedCollator

    item = {"input_ids": [[5, 6, 7]], "label_pieces": [[5, -100, 7]], "next_label": "x"}
    with pytest.raises(ValueError, match="the last item's next_label must be a token id or -100, got 'x'"):
        SFTPackedCollator()([item])
    with pytest.raises(ValueError, match="label_pieces must be lists of integer labels"):
        SFTPackedCollator()([{**item, "label_pieces": [[5, [6], 7]], "next_label": -100}])
    for labels, trains in (([5, -100, -100], False), ([5, -100, 7], True)):  # (labels travel as a datasets column)
        packed = PackedDataset(datasets.Dataset.from_dict({"input_ids": [labels]}), config)
        assert SFTPackedDataset(rows, packed).has_targets() is trains
    padded = copy.deepcopy(tokenizer)  # a pad token added, the embeddings not resized
    padded.add_special_tokens({"pad_token": "<pad>"})
    with pytest.raises(ValueError, match=rf"the tokenizer's pad_token_id={len(tokenizer)} is not below the model's "
                                         rf"vocab_size {len(tokenizer)}"):
        trainer(documents, processing_class=padded)
    small = trainer(documents, vocab=len(tokenizer))
    small.data_collator.vocab_size = 3
    with pytest.raises(ValueError, match="is not below the model's vocab_size 3"):
        small.data_collator([small.train_dataset[0]])
    wrong = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7, 8]], "labels": [[5, 500, 7, 8]]})
    mislabelled = trainer(wrong)
    with pytest.raises(ValueError, match="a label is neither -100 nor its token's id"):
        mislabelled.data_collator([mislabelled.train_dataset[0]])


def test_datasets_given_to_evaluate_and_predict_later_are_packed_as_the_constructors(tmp_path):
    """TRL prepares a dataset given to ``evaluate()`` but not to ``predict()``, and with
    ``skip_prepare_dataset`` neither: their raw rows met the packed collator (a ValueError). Both now
    give the loss of the same documents given to the constructor."""
    from trl import SFTConfig

    from distca_hf.training import DistCASFTTrainer

    tokenizer = _tokenizer(_texts())
    documents = _sft_documents(tokenizer)
    for skip in (False, True):
        arguments = {**_common_arguments(str(tmp_path)), "per_device_train_batch_size": 1,
                     "per_device_eval_batch_size": 1, "packing": True, "max_length": ROW,
                     **({"dataset_kwargs": {"skip_prepare_dataset": True}} if skip else {})}
        trainer = DistCASFTTrainer(model=_model("distca", len(tokenizer)), args=SFTConfig(**arguments),
                                   train_dataset=documents, eval_dataset=documents, processing_class=tokenizer)
        expected = trainer.evaluate()["eval_loss"]
        assert trainer.evaluate(eval_dataset=documents)["eval_loss"] == pytest.approx(expected, rel=1e-6)
        assert trainer.predict(documents).metrics["test_loss"] == pytest.approx(expected, rel=1e-6)
