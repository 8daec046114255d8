"""DistCATrainer and DistCAAccelerator against a single-process reference.

The reference is independent of distca and of the Trainer: a plain PyTorch loop over the same
documents (recorded on every rank), each document run alone with eager attention, the loss summed
over all label tokens of the step and divided by their count, SGD. Two gloo ranks through DDP (with
gradient accumulation and checkpointing, one whole epoch), DeepSpeed ZeRO-2 and ZeRO-3 must give
its losses step by step and its final parameters (fp32, tight tolerances); a run resumed from a
checkpoint must give the losses of the uninterrupted run; every document is trained on exactly once
per epoch. The recipes launch the examples with `accelerate launch`, and bad set-ups fail with
errors that say what is wrong.

Two packings: per rank (``span_ranks=False``: a document longer than ``tokens_per_rank`` is cut
into chunks that train alone), and the trainer's default on two ranks, documents spanning ranks
(global batches of ``2 * tokens_per_rank`` tokens: documents up to that length train whole, their
pieces on both ranks; the reference runs them whole). The spanning runs need the attention runtime
to take documents that span ranks; ``stand_in`` runs replace it with an exact all-gather attention
written here, so the trainer's data path (order, positions, labels across the rank boundary, label
counts) is checked on its own."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dist_harness import run_ranks
from helpers import accelerate_launch
from distca_hf.runtime.comm import free_port

REPO = Path(__file__).resolve().parent.parent
VOCAB = 96
BUDGET = 48  # tokens per rank: documents longer than this are cut
LENGTHS = [120, 3, 17, 40, 1, 9, 30, 48, 5, 70, 11, 2, 25, 33, 7, 15, 19, 44, 6, 13]
EVAL_LENGTHS = [30, 4, 12, 60]
LR = 0.5


def _documents(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]


# -- the independent reference ---------------------------------------------------------------------


def _reference_model():
    from helpers import tiny_model

    return tiny_model("llama", attn="eager")  # same seed, same initial weights as the workers' model


def _token_loss_sum(model, piece: list[int]) -> torch.Tensor:
    """Sum over the piece's label tokens (all but its first) of the next-token cross-entropy."""
    ids = torch.tensor([piece])
    logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
    return F.cross_entropy(logits.float(), ids[0, 1:], reduction="sum")


def reference_run(steps: list[list[list[int]]], lr: float):
    """``steps[k]``: every piece trained in optimizer step k (all ranks, all micro-batches).
    Returns the per-step losses and the final parameters."""
    model = _reference_model().train()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for pieces in steps:
        label_tokens = sum(len(p) - 1 for p in pieces)
        loss = sum(_token_loss_sum(model, p) for p in pieces if len(p) > 1) / label_tokens
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}, model


def reference_eval_loss(model, documents, chunk) -> float:
    """The token-weighted loss of ``documents``, each cut into chunks of ``chunk`` tokens run alone."""
    pieces = [d[s:s + chunk] for d in documents for s in range(0, len(d), chunk)]
    with torch.no_grad():
        total = sum(_token_loss_sum(model, p) for p in pieces if len(p) > 1)
    return float(total / sum(len(p) - 1 for p in pieces))


# -- the workers (one per rank) ----------------------------------------------------------------------


def _train_worker(rank, world, case, out_dir):
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    if case.get("stand_in"):
        _use_stand_in_attention()
    return _train(case, out_dir, rank)


def _train(case: dict, out_dir: str, rank: int = 0):
    """Train the tiny Llama with DistCATrainer as ``case`` says; record what each micro-batch trained.

    ``case["span"]``: ``DistCAPlugin(span_ranks=...)``; absent: the trainer's default."""
    import json

    from transformers import TrainingArguments

    import distca_hf
    from distca_hf import DistCAPlugin, DistCATrainer, PackingConfig
    from helpers import checkpointing_argument, shifted_target_recipe, tiny_model

    class RecordingTrainer(DistCATrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            self.parameter_types.update(type(p).__name__ for p in model.parameters())  # DTensor: sharded (FSDP2)
            self.span_ranks_in_force.add(distca_hf.current_config().span_ranks)
            cu = inputs["cu_seq_lens_q"].tolist()
            ids = inputs["input_ids"][0].tolist()
            self.recorded.append([self.state.global_step, [ids[a:b] for a, b in zip(cu, cu[1:])],
                                  int(inputs["position_ids"][0, 0]), int(inputs["shift_labels"][0, -1]),
                                  int(num_items_in_batch)])
            return super().training_step(model, inputs, num_items_in_batch)

    model = tiny_model("llama")  # before the arguments: no zero.Init, so the reference's initial weights
    if case.get("compile_model"):  # compiled by the user before the trainer sees it
        model = torch.compile(model, backend=case["compile_model"])
    deepspeed = None
    if case.get("zero"):
        deepspeed = json.loads((REPO / "recipes" / f"ds-zero{case['zero']}.json").read_text())
    args = TrainingArguments(
        output_dir=os.path.join(out_dir, case.get("run", "run")), per_device_train_batch_size=1,
        per_device_eval_batch_size=1, gradient_accumulation_steps=case.get("accumulation", 1),
        max_steps=case.get("max_steps", -1), num_train_epochs=1, learning_rate=case.get("lr", LR),
        optim=case.get("optim", "sgd"), lr_scheduler_type=case.get("scheduler", "constant"), weight_decay=0.0,
        max_grad_norm=0.0, logging_steps=1, report_to=[], disable_tqdm=True, seed=0, data_seed=0,
        save_strategy="steps" if case.get("save_steps") else "no", save_steps=case.get("save_steps") or 500,
        **checkpointing_argument(case.get("checkpointing", False)), deepspeed=deepspeed,
        eval_strategy="no", dataloader_pin_memory=False, **case.get("arguments", {}),
    )
    train_dataset = _documents(LENGTHS, 0)
    if case.get("streaming"):
        import datasets

        train_dataset = datasets.Dataset.from_dict({"input_ids": train_dataset}).to_iterable_dataset(num_shards=2)
    plugin = DistCAPlugin(tolerance=0.05) if "span" not in case else DistCAPlugin(tolerance=0.05,
                                                                                  span_ranks=case["span"])
    trainer = RecordingTrainer(
        model=model, args=args, train_dataset=train_dataset,
        eval_dataset=_documents(EVAL_LENGTHS, 1) if case.get("evaluate") else None,
        packing=PackingConfig(tokens_per_rank=BUDGET, seed=0), distca_plugin=plugin,
        **(shifted_target_recipe() if case.get("evaluate") else {}),
    )
    trainer.recorded = []
    trainer.parameter_types = set()
    trainer.span_ranks_in_force = set()
    trainer.train(resume_from_checkpoint=case.get("resume_from"))
    result = {
        "world": trainer.args.world_size,
        "span_ranks": trainer.span_ranks,
        "span_ranks_in_force": sorted(trainer.span_ranks_in_force),  # during the training steps
        "span_ranks_after_train": distca_hf.current_config().span_ranks,
        "report": vars(trainer.packing_reports["train"]),
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "steps": [h["step"] for h in trainer.state.log_history if "loss" in h],
        "before": [h["attn_imbalance_before"] for h in trainer.state.log_history if "loss" in h],
        "after": [h["attn_imbalance_after"] for h in trainer.state.log_history if "loss" in h],
        "recorded": trainer.recorded,
        "micro_batches_per_epoch": None if case.get("streaming") else len(trainer.get_train_dataloader()),
        "use_cache": trainer.model.config.use_cache,
        "parameter_types": sorted(trainer.parameter_types),
    }
    if case.get("evaluate"):
        result["eval"] = trainer.evaluate()
    parameters = list(trainer.model.parameters())
    if case.get("zero") == 3:
        import deepspeed as ds

        with ds.zero.GatheredParameters(parameters):
            state = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    else:  # FSDP2's DTensor shards gathered whole
        state = {n.removeprefix("_orig_mod."): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                 for n, p in trainer.model.named_parameters()}
    if rank == 0:
        torch.save(state, os.path.join(out_dir, f"{case.get('run', 'run')}-params.pt"))
    return result


# -- a stand-in for the runtime's spanning documents: exact, slow, written independently --------------


def _use_stand_in_attention():
    """Register ``_all_gather_attention`` as ``"distca"`` in this process."""
    from transformers import AttentionInterface

    AttentionInterface.register("distca", _all_gather_attention)


class _GatherRows(torch.autograd.Function):
    """``[n_r, ...]`` on every rank -> ``[sum n_r, ...]`` in rank order; the gradient of the rows
    of rank ``r`` is the sum of what every rank's use of them contributed."""

    @staticmethod
    def forward(ctx, rows, sizes):
        import torch.distributed as dist

        ctx.sizes = sizes
        padded = rows.new_zeros((max(sizes), *rows.shape[1:]))
        padded[:rows.shape[0]] = rows
        gathered = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(gathered, padded.contiguous())
        return torch.cat([g[:n] for g, n in zip(gathered, sizes)])

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        start = sum(ctx.sizes[:dist.get_rank()])
        return grad[start:start + ctx.sizes[dist.get_rank()]], None


def _all_gather_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal attention of every document over the whole stream of all ranks' rows (rank order): a
    token attends to the earlier tokens of its document, on any rank. Documents start where
    ``position_ids`` are 0, so a row that starts above 0 continues the previous rank's document.
    query ``[1, H, n, D]``, key/value ``[1, H_kv, n, D]`` -> ``([1, n, H, D], None)``."""
    import torch.distributed as dist

    _, heads, n, dim = query.shape
    positions = kwargs["position_ids"].reshape(-1)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([n]))
    sizes = [int(s) for s in sizes]
    everyone_positions = _GatherRows.apply(positions[:, None].to(torch.float64), sizes)[:, 0]
    document = torch.cumsum(everyone_positions == 0, 0)
    keys = _GatherRows.apply(key[0].transpose(0, 1), sizes).transpose(0, 1)  # [H_kv, N, D]
    values = _GatherRows.apply(value[0].transpose(0, 1), sizes).transpose(0, 1)
    keys = keys.repeat_interleave(heads // keys.shape[0], dim=0)
    values = values.repeat_interleave(heads // values.shape[0], dim=0)
    mine = torch.arange(n) + sum(sizes[:dist.get_rank()])
    everyone = torch.arange(sum(sizes))
    allowed = (document[mine][:, None] == document[None, :]) & (everyone[None, :] <= mine[:, None])
    scores = (query[0] @ keys.transpose(1, 2)) * (dim ** -0.5 if scaling is None else scaling)
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return (weights @ values).transpose(0, 1).unsqueeze(0), None


def _check_ranks(results):
    for rank, result in enumerate(results):
        assert result["ok"], f"rank {rank}: {result.get('traceback', result['error'])}"
    return [r["value"] for r in results]


def _sequences(rows) -> list[list[int]]:
    """The documents (or chunks) of one global batch, whole, from its rows in rank order: a row
    whose first position is above 0 continues the last document of the row before it."""
    sequences = []
    for pieces, first_position, _ in rows:
        pieces = [list(p) for p in pieces]
        if first_position > 0:
            assert sequences and len(sequences[-1]) == first_position, "a continuation without its prefix"
            sequences[-1].extend(pieces.pop(0))
        sequences.extend(pieces)
    return sequences


def _steps_of(values) -> list[list[list[int]]]:
    """Every document (or chunk) trained in each optimizer step, whole: the k-th micro-batch of
    every rank of a step holds one global batch (per rank packing: each row its own)."""
    per_step: dict[int, list] = {}
    for value in values:  # ranks in order
        micro = Counter()
        for step, pieces, first_position, last_label, _ in value["recorded"]:
            global_batches = per_step.setdefault(step, [])
            while len(global_batches) <= micro[step]:
                global_batches.append([])
            global_batches[micro[step]].append((pieces, first_position, last_label))
            micro[step] += 1
    steps = []
    for step in sorted(per_step):
        sequences = []
        for rows in per_step[step]:
            assert rows[-1][2] == -100, "the last rank's row cannot go on"
            for (_, _, last_label), (pieces, first_position, _) in zip(rows, rows[1:]):
                # labels across the boundary: a row goes on exactly when the next one continues
                assert (last_label != -100) == (first_position > 0)
                if last_label != -100:
                    assert last_label == pieces[0][0]  # the next rank's first token
            sequences.extend(_sequences(rows))
        steps.append(sequences)
    return steps


def _assert_label_counts(values):
    """num_items_in_batch: the tokens with a successor in their document, all ranks, the whole step."""
    steps = _steps_of(values)
    for value in values:
        per_step = {}
        for step, _, _, _, count in value["recorded"]:
            per_step.setdefault(step, set()).add(count)
        for k, step in enumerate(sorted(per_step)):
            assert per_step[step] == {sum(len(s) - 1 for s in steps[k])}


def _assert_matches_reference(values, out_dir, run="run"):
    steps = _steps_of(values)
    _assert_label_counts(values)
    losses, params, model = reference_run(steps, LR)
    for value in values:  # every rank logs the global loss
        torch.testing.assert_close(torch.tensor(value["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    trained = torch.load(os.path.join(out_dir, f"{run}-params.pt"))
    assert trained.keys() == params.keys()
    for name in params:
        torch.testing.assert_close(trained[name], params[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    return model


def _chunks(documents, chunk):
    return Counter(tuple(d[s:s + chunk]) for d in documents for s in range(0, len(d), chunk))


# -- two ranks against the reference -------------------------------------------------------------------

# How the two ranks pack: each its own rows, or the trainer's default (documents spanning both ranks,
# through the runtime, or through the stand-in attention above).
PACKINGS = {"per_rank": {"span": False}, "spanning": {}, "spanning_stand_in": {"stand_in": True}}
if os.environ.get("DISTCA_TEST_STAND_IN") == "1":  # every spanning run on the stand-in
    PACKINGS["spanning"] = PACKINGS["spanning_stand_in"]


def _chunk_of(packing: str) -> int:
    """The longest document trained whole: one rank's budget, or a global batch of both ranks'."""
    return BUDGET if packing == "per_rank" else 2 * BUDGET


@pytest.mark.distributed
@pytest.mark.parametrize("packing", list(PACKINGS))
def test_ddp_one_epoch_matches_single_process_and_trains_every_document_once(tmp_path, packing):
    case = {"accumulation": 2, "checkpointing": True, "evaluate": True, **PACKINGS[packing],
            "arguments": {"include_for_metrics": ["inputs"]}}
    values = _check_ranks(run_ranks(_train_worker, 2, tmp_path, case, str(tmp_path)))
    spanning = packing != "per_rank"
    assert all(v["world"] == 2 and v["use_cache"] is False for v in values)
    assert all(v["span_ranks"] is spanning and v["span_ranks_in_force"] == [spanning] for v in values)
    assert all(v["span_ranks_after_train"] is False for v in values)  # the trainer's default is put back
    model = _assert_matches_reference(values, str(tmp_path))
    # one epoch: every document (chunk) exactly once, whole; the same number of micro-batches per rank
    chunk = _chunk_of(packing)
    trained = Counter(tuple(s) for step in _steps_of(values) for s in step if s != [0])
    assert trained == _chunks(_documents(LENGTHS, 0), chunk)
    assert len({len(v["recorded"]) for v in values}) == 1
    assert len(values[0]["recorded"]) == values[0]["micro_batches_per_epoch"]
    report = values[0]["report"]
    if spanning:  # documents longer than one rank's budget trained whole, across both ranks
        assert report["spanning_documents"] > 0 and any(BUDGET < n <= chunk for n in LENGTHS)
        assert (report["cut_documents"], report["chunks"]) == (1, 2)  # 120 > 96 tokens: 96 + 24
        assert any(first_position > 0 for v in values for _, _, first_position, _, _ in v["recorded"])
    else:
        assert (report["cut_documents"], report["chunks"]) == (2, 5)
    if not case.get("stand_in"):  # the plan balances: after <= 1 + tolerance, never worse than before
        for value in values:
            assert all(a <= 1.05 + 1e-9 and a <= b + 1e-9 for a, b in zip(value["after"], value["before"]))
        assert max(values[0]["before"]) > 1.05  # the data is skewed enough for the plan to matter
    # evaluation: the exact token-weighted loss of the held-out documents under the final weights
    expected_eval = reference_eval_loss(model, _documents(EVAL_LENGTHS, 1), chunk)
    for value in values:
        assert value["eval"]["eval_loss"] == pytest.approx(expected_eval, rel=1e-5)
        assert value["eval"]["eval_label_tokens"] == sum(min(n - s, chunk) - 1 for n in EVAL_LENGTHS
                                                          for s in range(0, n, chunk))
        # compute_metrics by the usual shift (logit t, label t + 1) meets every target the loss counts, the one
        # across a rank boundary included (lost before: its label sat on the next rank's row), with the same loss
        metrics = value["eval"]
        assert metrics["eval_recipe_targets"] == metrics["eval_label_tokens"], metrics
        assert metrics["eval_recipe_inputs_shape_matches"] is True, metrics
        assert metrics["eval_recipe_loss_sum"] / metrics["eval_recipe_targets"] == pytest.approx(expected_eval, rel=1e-5)


def _compiled_worker(rank, world, out_dir):
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    # aot_eager: Dynamo and AOT autograd as inductor runs them, without its minutes of code generation (inductor
    # was checked by hand: the same losses); documents spanning both ranks (the trainer's default)
    return [_train({"run": "trainer", "max_steps": 2, "arguments": {"torch_compile": True,
                                                                    "torch_compile_backend": "aot_eager"}}, out_dir, rank),
            _train({"run": "user", "max_steps": 2, "compile_model": "aot_eager"}, out_dir, rank)]


@pytest.mark.distributed
def test_compiled_models_train_like_one_process(tmp_path):
    """``TrainingArguments(torch_compile=True)`` and a model the user compiled: the model's layers compiled, the
    attention calls run as written. (Before: Dynamo traced the planning and failed in compiled code on two ranks;
    a compiled model was an AttributeError from the model check.)"""
    results = _check_ranks(run_ranks(_compiled_worker, 2, tmp_path, str(tmp_path), deadline_s=300))
    for index, run in enumerate(("trainer", "user")):
        values = [value[index] for value in results]
        assert values[0]["report"]["spanning_documents"] > 0
        _assert_matches_reference(values, str(tmp_path), run=run)


@pytest.mark.distributed
@pytest.mark.parametrize("zero, accumulation, packing", [(2, 2, "per_rank"), (3, 1, "per_rank"), (3, 1, "spanning")])
def test_deepspeed_zero_matches_single_process(tmp_path, zero, accumulation, packing):
    case = {"zero": zero, "accumulation": accumulation, "max_steps": 3, "evaluate": True, **PACKINGS[packing]}
    values = _check_ranks(run_ranks(_train_worker, 2, tmp_path, case, str(tmp_path), deadline_s=420))
    assert all(v["world"] == 2 for v in values) and len(values[0]["losses"]) == 3
    model = _assert_matches_reference(values, str(tmp_path))
    expected_eval = reference_eval_loss(model, _documents(EVAL_LENGTHS, 1), _chunk_of(packing))
    assert all(v["eval"]["eval_loss"] == pytest.approx(expected_eval, rel=1e-5) for v in values)


@pytest.mark.distributed
@pytest.mark.parametrize("packing", ["per_rank", "spanning"])
def test_streaming_dataset_on_two_ranks_matches_single_process(tmp_path, packing):
    """Each rank reads the whole stream, packs it identically and keeps its row of every global batch."""
    case = {"streaming": True, "accumulation": 2, "max_steps": 3, **PACKINGS[packing]}
    values = _check_ranks(run_ranks(_train_worker, 2, tmp_path, case, str(tmp_path)))
    _assert_matches_reference(values, str(tmp_path))
    assert len(values[0]["recorded"]) == len(values[1]["recorded"]) == 6
    if packing == "per_rank":
        mine = [Counter(tuple(p) for _, pieces, *_ in v["recorded"] for p in pieces) for v in values]
        assert not (mine[0] & mine[1])  # the ranks train different micro-batches


def _stream_worker(rank, world, out_dir):
    """A stream given to evaluate() later, and streams the ranks read alike or not."""
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import datasets
    from transformers import TrainingArguments

    from distca_hf import DistCATrainer, PackingConfig
    from helpers import tiny_model

    def stream(documents, seed=None):
        made = datasets.Dataset.from_dict({"input_ids": documents}).to_iterable_dataset()
        return made if seed is None else made.shuffle(seed=seed, buffer_size=8)

    def trainer(train_dataset):
        args = TrainingArguments(output_dir=os.path.join(out_dir, "run"), per_device_train_batch_size=1,
                                 per_device_eval_batch_size=1, max_steps=1, report_to=[], disable_tqdm=True,
                                 dataloader_pin_memory=False)
        return DistCATrainer(model=tiny_model("llama"), args=args, train_dataset=train_dataset,
                             packing=PackingConfig(tokens_per_rank=BUDGET, seed=0))

    made = trainer(_documents(LENGTHS, 0))
    evaluation = _documents(EVAL_LENGTHS, 1)
    losses = [made.evaluate(eval_dataset=evaluation)["eval_loss"], made.evaluate(eval_dataset=stream(evaluation))["eval_loss"]]
    trainer(stream(_documents(LENGTHS, 0), seed=3))  # one seed on every rank: one stream
    try:
        trainer(stream(_documents(LENGTHS, 0), seed=rank))  # a seed per rank (as an unseeded shuffle draws)
        refused = None
    except ValueError as e:
        refused = str(e)
    return {"losses": losses, "refused": refused}


@pytest.mark.distributed
def test_streams_are_evaluated_later_and_must_be_read_alike_by_every_rank(tmp_path):
    """A stream given to ``evaluate()`` after construction gives the loss the same documents give as a
    list (accelerate dispatched its batches from rank 0, whose rows it could not concatenate); a
    stream the ranks read in different orders (shuffled with a seed per rank) is refused on every rank
    (each rank reads it whole and keeps its share: documents trained twice and never, silently)."""
    values = _check_ranks(run_ranks(_stream_worker, 2, tmp_path, str(tmp_path)))
    for value in values:
        assert value["losses"][1] == pytest.approx(value["losses"][0], rel=1e-6)
        assert value["refused"] is not None and "the ranks read different streams in train_dataset" in value["refused"]


def _layout_worker(rank, world, tensor_parallel):
    """One epoch of the trainer's train dataloader (no forward): what this rank reads, step by step."""
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    from transformers import TrainingArguments

    from distca_hf import DistCAPlugin, DistCATrainer, PackingConfig
    from helpers import tiny_model

    args = TrainingArguments(output_dir="unused", per_device_train_batch_size=1, per_device_eval_batch_size=1,
                             report_to=[], max_steps=1, seed=0, dataloader_pin_memory=False)
    trainer = DistCATrainer(model=tiny_model("llama"), args=args, train_dataset=_documents(LENGTHS, 0),
                            packing=PackingConfig(tokens_per_rank=BUDGET // 2),
                            distca_plugin=DistCAPlugin(tensor_parallel_size=tensor_parallel))
    loader = trainer.get_train_dataloader()
    loader.set_epoch(1)
    rows = [(batch["cu_seq_lens_q"].tolist(), batch["input_ids"][0].tolist(), int(batch["position_ids"][0, 0]),
             int(batch["shift_labels"][0, -1])) for batch in loader]
    torch.distributed.barrier()  # rank 0 holds the rendezvous store: no rank leaves before all are done with it
    return {"server_ranks": list(trainer.distca.server_ranks), "span_ranks": trainer.span_ranks, "rows": rows,
            "group_size": trainer.packing_reports["train"].group_size}


@pytest.mark.distributed
@pytest.mark.parametrize("tensor_parallel", [1, 2])
def test_four_ranks_read_their_server_groups_global_batches(tmp_path, tensor_parallel):
    """Through the trainer's own dataloader on 4 ranks: one server group of 4, or (tensor parallelism
    2) the groups [0, 2] and [1, 3], which are not blocks of consecutive ranks. In every step the
    ranks of each group hold the slices of one global batch, in rank order."""
    values = _check_ranks(run_ranks(_layout_worker, 4, tmp_path, tensor_parallel))
    groups = sorted({tuple(v["server_ranks"]) for v in values})
    assert groups == ([(0, 1, 2, 3)] if tensor_parallel == 1 else [(0, 2), (1, 3)])
    assert all(v["span_ranks"] and v["group_size"] == 4 // tensor_parallel for v in values)
    steps = {len(v["rows"]) for v in values}
    assert len(steps) == 1
    trained = Counter()
    for step in range(steps.pop()):
        for group in groups:
            rows = []
            for rank in group:
                cu, ids, first_position, last_label = values[rank]["rows"][step]
                rows.append(([ids[a:b] for a, b in zip(cu, cu[1:])], first_position, last_label))
            trained.update(tuple(s) for s in _sequences(rows) if s != [0])  # asserts each continuation's prefix
    chunk = len(groups[0]) * BUDGET // 2
    assert trained == _chunks(_documents(LENGTHS, 0), chunk)  # every document (chunk) once, whole


def _generate_after_training_worker(rank, world, out_dir):
    """Train two steps with DistCATrainer's defaults (documents spanning both ranks), then rank 0
    alone generates while rank 1 idles (waits for rank 0's word, as a script's other ranks would)."""
    import time

    from transformers import DynamicCache, TrainingArguments

    import distca_hf
    from distca_hf import DistCATrainer, PackingConfig
    from distca_hf.patches import cache_argument
    from helpers import tiny_model

    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    args = TrainingArguments(output_dir=os.path.join(out_dir, "run"), per_device_train_batch_size=1,
                             per_device_eval_batch_size=1, max_steps=2, learning_rate=LR, optim="sgd",
                             lr_scheduler_type="constant", report_to=[], disable_tqdm=True, save_strategy="no",
                             seed=0, data_seed=0, dataloader_pin_memory=False)
    trainer = DistCATrainer(model=tiny_model("llama"), args=args, train_dataset=_documents(LENGTHS, 0),
                            packing=PackingConfig(tokens_per_rank=BUDGET, seed=0))
    trainer.train()
    result = {"span_ranks": trainer.span_ranks, "span_ranks_after_train": distca_hf.current_config().span_ranks}
    done = Path(out_dir, "rank0-generated")
    if rank != 0:
        deadline = time.monotonic() + 120
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        return result
    try:
        model = trainer.model.eval()
        eager = tiny_model("llama", attn="eager").eval()  # an independent copy of the trained weights
        eager.load_state_dict(model.state_dict())
        g = torch.Generator().manual_seed(3)
        prompts = torch.randint(1, VOCAB, (2, 7), generator=g)
        mask = torch.ones_like(prompts)
        prompts[1, :3], mask[1, :3] = 0, 0  # left padding
        runs = {"cache": {}, "no_cache": {"use_cache": False}}
        for name, options in runs.items():
            ours, theirs = (m.generate(prompts, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
                                       return_dict_in_generate=True, output_scores=True, **options)
                            for m in (model, eager))
            result[f"{name}_tokens_equal"] = bool(torch.equal(ours.sequences, theirs.sequences))
            result[f"{name}_score_err"] = max(float((a - b).abs().max()) for a, b in zip(ours.scores, theirs.scores))
        with torch.no_grad():  # a decoding loop of the user's: a prefill given a cache, then one step
            logits = []
            for m in (model, eager):
                cache = {cache_argument(m): DynamicCache(config=m.config)}  # (5.24's name, or the older one)
                first = m(input_ids=prompts[:1], use_cache=True, **cache).logits
                step = m(input_ids=first[:, -1:].argmax(-1), use_cache=True, **cache).logits
                logits.append(torch.cat([first, step], dim=1))
        result["loop_err"] = float((logits[0] - logits[1]).abs().max())
        # span_ranks=True asked for explicitly: rows that start their documents still generate alone; a row
        # that would continue the previous rank's document cannot, and is refused
        distca_hf.configure(span_ranks=True)
        spanning = model.generate(prompts, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
        result["span_tokens_equal"] = bool(torch.equal(spanning, eager.generate(
            prompts, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)))
        try:
            with torch.no_grad():
                model(input_ids=prompts[:1], position_ids=torch.arange(5, 12)[None],
                      **{cache_argument(model): DynamicCache(config=model.config)})
            result["continuation"] = "computed"
        except ValueError as e:
            result["continuation"] = f"{type(e).__name__}: {e}"
        # a plain forward (no cache, not generate) is a forward of both ranks: rank 1 does not come, and the
        # timeout says why that may be (last: the process group is left with an unfinished collective)
        distca_hf.configure(span_ranks=False, timeout_s=2.0)
        try:
            with torch.no_grad():
                model(input_ids=prompts[:1], use_cache=False)
            result["alone"] = "computed"
        except RuntimeError as e:
            result["alone"] = f"{type(e).__name__}: {e}"
    finally:
        done.touch()
    return result


@pytest.mark.distributed
def test_rank_zero_generates_alone_after_training(tmp_path):
    """After DistCATrainer on two ranks, generation on rank 0 only (generate with and without a KV
    cache, a user's own decoding loop) computes on rank 0 and equals an eager copy of the trained
    weights; a forward that waited for rank 1 would raise DistCATimeoutError after 30 s."""
    results = run_ranks(_generate_after_training_worker, 2, tmp_path, str(tmp_path),
                        env={"DISTCA_TIMEOUT_S": "90"}, deadline_s=300)
    for r in results:
        assert r["ok"], r.get("traceback", r["error"])
    values = [r["value"] for r in results]
    assert all(v["span_ranks"] is True and v["span_ranks_after_train"] is False for v in values)
    generated = values[0]
    for name in ("cache", "no_cache"):
        assert generated[f"{name}_tokens_equal"]
        assert generated[f"{name}_score_err"] < 1e-5
    assert generated["loop_err"] < 1e-5
    assert generated["span_tokens_equal"]
    assert generated["continuation"].startswith("DocumentBoundaryError: distca forward")
    assert "row 0 starts at position_ids 5 > 0, which with span_ranks=True continues" in generated["continuation"]
    assert generated["alone"].startswith("DistCATimeoutError: distca: distca forward")
    assert "a peer is alive but not running this forward" in generated["alone"]
    assert "configure(mode='colocated', span_ranks=False)" in generated["alone"]


def test_single_process_matches_reference(tmp_path):
    value = _train({"accumulation": 2, "max_steps": 3}, str(tmp_path))
    assert value["world"] == 1 and value["span_ranks"] is False  # one rank: nothing to span
    _assert_matches_reference([value], str(tmp_path))


# Resume mid-epoch: per rank, in the first epoch; spanning (7 global batches per epoch), in the
# second, whose order GlobalBatchSampler draws from the epoch.
RESUMES = {"per_rank": {"max_steps": 6, "save_steps": 3}, "spanning": {"max_steps": 11, "save_steps": 9}}


@pytest.mark.distributed
@pytest.mark.parametrize("packing", list(RESUMES))
def test_resumed_run_gives_the_losses_of_an_uninterrupted_one(tmp_path, packing):
    results = run_ranks(_resume_worker, 2, tmp_path, str(tmp_path), packing)
    full, resumed = zip(*_check_ranks(results))
    total, saved = RESUMES[packing]["max_steps"], RESUMES[packing]["save_steps"]
    for whole, again in zip(full, resumed):
        # the resumed state carries the history of the steps up to the checkpoint; the rest are trained again
        assert whole["steps"] == again["steps"] == list(range(1, total + 1))
        assert [r[0] for r in again["recorded"]] == list(range(saved, total))
        assert again["recorded"] == whole["recorded"][saved:]  # the same micro-batches, mid-epoch
        torch.testing.assert_close(torch.tensor(again["losses"]), torch.tensor(whole["losses"]), rtol=1e-6, atol=1e-7)
    first = torch.load(tmp_path / "full-params.pt")
    second = torch.load(tmp_path / "resumed-params.pt")
    for name in first:
        torch.testing.assert_close(second[name], first[name], rtol=1e-6, atol=1e-7)


def _resume_worker(rank, world, out_dir, packing):
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    if PACKINGS[packing].get("stand_in"):
        _use_stand_in_attention()
    return _resume(out_dir, rank, PACKINGS[packing], **RESUMES[packing])


def _resume(out_dir, rank, packing_case, *, max_steps, save_steps):
    # AdamW and a decaying schedule: their states must come back too, and the data order resumes mid-epoch.
    common = {"optim": "adamw_torch", "scheduler": "linear", "lr": 3e-3, "max_steps": max_steps, "accumulation": 1,
              **packing_case}
    full = _train({**common, "run": "full", "save_steps": save_steps}, out_dir, rank)
    checkpoint = os.path.join(out_dir, "full", f"checkpoint-{save_steps}")
    resumed = _train({**common, "run": "resumed", "resume_from": checkpoint}, out_dir, rank)
    return full, resumed


def test_a_resume_that_would_read_other_rows_is_refused_naming_what_changed(tmp_path):
    """The Trainer resumes by skipping the batches a checkpoint's steps trained: under another accumulation (or
    packing, processes, seed, dataset) those are other rows, and documents trained twice or not at all this epoch,
    silently (163 of 518 tokens left out for accumulation 1 -> 2). The checkpoint records what its run read."""
    import json

    from distca_hf.training.resume_layout import LAYOUT_FILE

    out = str(tmp_path)
    _train({"run": "first", "max_steps": 2, "save_steps": 2}, out)
    checkpoint = os.path.join(out, "first", "checkpoint-2")
    saved = json.loads(open(os.path.join(checkpoint, LAYOUT_FILE)).read())
    assert saved["gradient_accumulation_steps"] == 1 and saved["packing"]["tokens_per_rank"] == BUDGET
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps: 1 then, 2 now.*some documents would train "
                                         r"twice this epoch"):
        _train({"run": "first", "max_steps": 4, "accumulation": 2, "resume_from": checkpoint}, out)
    with pytest.raises(ValueError, match=r"span_ranks: False then, True now"):  # resume_from_checkpoint=True: latest
        _train({"run": "first", "max_steps": 4, "resume_from": True, "span": True}, out)
    resumed = _train({"run": "first", "max_steps": 3, "resume_from": checkpoint}, out)  # the same reading resumes
    assert [step for step, *_ in resumed["recorded"]] == [2]


def test_single_process_spanning_mode_resumes_in_a_later_epoch(tmp_path):
    """span_ranks=True on one rank (a server group of one): GlobalBatchSampler's order, reshuffled
    in the second epoch and resumed there. (On several ranks Accelerate's set_epoch does not reach
    the sampler behind skip_first_batches; the two-rank resume test covers the trainer's fix.)"""
    full, resumed = _resume(str(tmp_path), 0, {"span": True}, max_steps=16, save_steps=15)  # 14 rows per epoch
    assert full["span_ranks"] is True and full["world"] == 1
    assert [r[0] for r in resumed["recorded"]] == [15]
    assert resumed["recorded"] == full["recorded"][15:]
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(full["losses"]), rtol=1e-6, atol=1e-7)
    second_epoch = [pieces for step, pieces, *_ in full["recorded"] if step >= 14]
    first_epoch = [pieces for step, pieces, *_ in full["recorded"] if step < 2]
    assert second_epoch != first_epoch  # the second epoch is shuffled anew


# -- DistCAAccelerator in a plain loop -------------------------------------------------------------------


def _accelerator_worker(rank, world, zero_stage):
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    from accelerate.utils import DeepSpeedPlugin
    from torch.utils.data import DataLoader

    from distca_hf import DistCAAccelerator, DistCAPlugin, PackedCollator, PackedDataset, PackingConfig
    from helpers import tiny_model

    deepspeed = None
    if zero_stage is not None:
        deepspeed = DeepSpeedPlugin(hf_ds_config={
            "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": zero_stage}, "zero_allow_untested_optimizer": True})
    accelerator = DistCAAccelerator(distca_plugin=DistCAPlugin(tolerance=0.05, backward="resend"),
                                    deepspeed_plugin=deepspeed)
    dataset = PackedDataset(_documents(LENGTHS, 0), PackingConfig(tokens_per_rank=BUDGET, shuffle=False),
                            world_size=accelerator.num_processes)
    loader = DataLoader(dataset, batch_size=1, collate_fn=PackedCollator())
    model = tiny_model("llama")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    steps, losses = [], []
    for batch, _ in zip(loader, range(3)):
        cu = batch["cu_seq_lens_q"].tolist()
        ids = batch["input_ids"][0].tolist()
        steps.append([ids[a:b] for a, b in zip(cu, cu[1:])])
        label_tokens = accelerator.reduce(batch["labels"][..., 1:].ne(-100).sum(), reduction="sum")
        loss = model(**batch, num_items_in_batch=label_tokens).loss * accelerator.num_processes
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
    unwrapped = accelerator.unwrap_model(model)
    whole = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in unwrapped.named_parameters()}  # FSDP2
    return {"world": accelerator.num_processes, "steps": steps, "losses": losses,
            "parameter_types": sorted({type(p).__name__ for p in unwrapped.parameters()}),
            "server_ranks": list(accelerator.distca.server_ranks), "backward": accelerator.distca.config.backward,
            "params": {n: p.detach().tolist() for n, p in whole.items() if n.endswith("norm.weight")}}


@pytest.mark.distributed
@pytest.mark.parametrize("zero_stage", [None, 1])
def test_distca_accelerator_loop_matches_single_process(tmp_path, zero_stage):
    """DDP, and DeepSpeed ZeRO-1 (CPU: the accelerator creates the gloo group DeepSpeed needs)."""
    values = _check_ranks(run_ranks(_accelerator_worker, 2, tmp_path, zero_stage))
    assert all(v["world"] == 2 and v["server_ranks"] == [0, 1] and v["backward"] == "resend" for v in values)
    steps = [values[0]["steps"][k] + values[1]["steps"][k] for k in range(3)]
    losses, params, _ = reference_run(steps, LR)
    for value in values:
        torch.testing.assert_close(torch.tensor(value["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-6)
        for name, trained in value["params"].items():
            torch.testing.assert_close(torch.tensor(trained), params[name], rtol=1e-4, atol=1e-5)


# -- refusals -----------------------------------------------------------------------------------------


def _arguments(tmp_path, **overrides):
    from transformers import TrainingArguments

    defaults = dict(output_dir=str(tmp_path), per_device_train_batch_size=1, per_device_eval_batch_size=1,
                    report_to=[], max_steps=1)
    return TrainingArguments(**{**defaults, **overrides})


def test_models_distca_cannot_dispatch_are_refused(tmp_path):
    from transformers import AutoModelForCausalLM, BloomConfig

    from distca_hf import DistCAAccelerator, DistCATrainer, PackingConfig
    from helpers import tiny_model

    packing = PackingConfig(tokens_per_rank=BUDGET)
    with pytest.raises(ValueError, match=r"needs attn_implementation='distca', but this LlamaForCausalLM uses 'eager'"):
        DistCATrainer(model=tiny_model("llama", attn="eager"), args=_arguments(tmp_path), train_dataset=[[1, 2]],
                      packing=packing)
    def bloom_config():
        return BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=1, n_head=4)

    # transformers would accept "distca" for Bloom and ignore it: choosing it is refused at once ...
    with pytest.raises(ValueError, match=r"BloomForCausalLM computes attention in its own code.*silently ignored"):
        AutoModelForCausalLM.from_config(bloom_config(), attn_implementation="distca")
    # ... and a model that got the name some other way is refused by the trainer
    bloom = AutoModelForCausalLM.from_config(bloom_config())
    bloom.config._attn_implementation = "distca"
    with pytest.raises(ValueError, match=r"BloomForCausalLM computes attention in its own code.*silently ignored"):
        DistCATrainer(model=bloom, args=_arguments(tmp_path), train_dataset=[[1, 2]], packing=packing)
    accelerator = DistCAAccelerator()
    with pytest.raises(ValueError, match="uses 'sdpa'"):
        accelerator.prepare(tiny_model("llama", attn="sdpa"))


def test_own_loops_that_would_read_spanning_rows_wrong_are_refused():
    """DistCAAccelerator.prepare_data_loader: a span_ranks PackedDataset under distca's span_ranks off (its continuing pieces
    attended only to themselves, silently), or shuffled row by row (the ranks read different global batches)."""
    from torch.utils.data import DataLoader

    import distca_hf
    from distca_hf.training.accelerator import check_spanning_loader
    from distca_hf.training.packing import GlobalBatchSampler, PackedDataset, PackingConfig

    spanning = PackedDataset(_documents(LENGTHS, 0), PackingConfig(tokens_per_rank=BUDGET), world_size=2, span_ranks=True)
    per_rank = PackedDataset(_documents(LENGTHS, 0), PackingConfig(tokens_per_rank=BUDGET), world_size=2)
    in_blocks = GlobalBatchSampler(len(spanning), 2, shuffle=True)
    with pytest.raises(ValueError, match=r"packed with span_ranks=True .* set DistCAPlugin\(span_ranks=True\)"):
        check_spanning_loader(DataLoader(spanning, sampler=in_blocks), span_ranks=False)
    with pytest.raises(ValueError, match=r"DataLoader\(shuffle=True\) shuffles single rows .*GlobalBatchSampler"):
        check_spanning_loader(DataLoader(spanning, shuffle=True), span_ranks=True)
    check_spanning_loader(DataLoader(spanning, sampler=in_blocks), span_ranks=True)
    check_spanning_loader(DataLoader(per_rank, shuffle=True), span_ranks=False)
    assert distca_hf.DistCAAccelerator.prepare_data_loader.__code__.co_names.count("check_spanning_loader") == 1


def test_bad_trainer_setups_say_what_is_wrong(tmp_path):
    from distca_hf import DistCATrainer, PackingConfig
    from helpers import tiny_model

    model = tiny_model("llama")
    packing = PackingConfig(tokens_per_rank=BUDGET)
    with pytest.raises(ValueError, match=r"per_device_train_batch_size=1 \(got 4\).*tokens_per_rank"):
        DistCATrainer(model=model, args=_arguments(tmp_path, per_device_train_batch_size=4), train_dataset=[[1, 2]],
                      packing=packing)
    with pytest.raises(ValueError, match="raw documents: pass packing=PackingConfig"):
        DistCATrainer(model=model, args=_arguments(tmp_path), train_dataset=[[1, 2]])
    with pytest.raises(ValueError, match="average_tokens_across_devices=False"):
        DistCATrainer(model=model, args=_arguments(tmp_path, average_tokens_across_devices=False),
                      train_dataset=[[1, 2]], packing=packing)
    with pytest.raises(TypeError, match="distca_plugin must be a distca_hf.DistCAPlugin"):
        DistCATrainer(model=model, args=_arguments(tmp_path), train_dataset=[[1, 2]], packing=packing,
                      distca_plugin={"tolerance": 0.1})


def test_eval_batch_size_is_checked_only_when_evaluating(tmp_path):
    """TrainingArguments' default per_device_eval_batch_size=8 is refused when it would be used (an
    eval set given, or evaluate()), not when there is nothing to evaluate."""
    from distca_hf import DistCATrainer, PackingConfig
    from helpers import tiny_model

    packing = PackingConfig(tokens_per_rank=BUDGET)
    refusal = r"per_device_eval_batch_size=1 only \(got 8; TrainingArguments' default is 8\)"
    args = _arguments(tmp_path, per_device_eval_batch_size=8, disable_tqdm=True)
    trainer = DistCATrainer(model=tiny_model("llama"), args=args, train_dataset=[[1, 2, 3]], packing=packing)
    trainer.train()
    with pytest.raises(ValueError, match=refusal):
        trainer.evaluate(eval_dataset=trainer.train_dataset)
    with pytest.raises(ValueError, match=refusal):
        DistCATrainer(model=tiny_model("llama"), args=args, train_dataset=[[1, 2, 3]], eval_dataset=[[4, 5]],
                      packing=packing)


def test_datasets_without_documents_are_refused_naming_the_argument(tmp_path):
    """An empty dataset (or one of empty documents) is refused at once, naming the argument, instead of
    torch's num_samples=0 at train() (or an evaluation of nothing)."""
    import datasets

    from distca_hf import DistCATrainer, PackedDataset, PackingConfig
    from helpers import tiny_model

    packing = PackingConfig(tokens_per_rank=BUDGET)
    no_rows = "train_dataset has no documents to train on: it holds no documents"
    cases = [
        ({"train_dataset": datasets.Dataset.from_dict({"input_ids": []})}, no_rows),
        ({"train_dataset": datasets.Dataset.from_list([])}, no_rows),  # not even an input_ids column
        ({"train_dataset": []}, no_rows),
        ({"train_dataset": datasets.Dataset.from_dict({"input_ids": [[], []]})},
         "train_dataset has no documents to train on: all 2 of its documents are empty"),
        ({"train_dataset": PackedDataset([[]], packing)}, "all 1 of its documents are empty"),
        ({"train_dataset": [[5], [7]]}, "train_dataset has nothing to learn: none of its 2 documents has two tokens"),
        ({"train_dataset": [[1, 2]], "eval_dataset": datasets.Dataset.from_dict({"input_ids": [[]]})},
         "eval_dataset has no documents to evaluate: all 1 of its documents are empty"),
        ({"train_dataset": [[1, 2]], "eval_dataset": {"held_out": []}},
         r"eval_dataset\['held_out'\] has no documents to evaluate"),
    ]
    for datasets_given, match in cases:
        given = {k: v for k, v in datasets_given.items() if not isinstance(v, PackedDataset)}
        with pytest.raises(ValueError, match=match):
            DistCATrainer(model=tiny_model("llama"), args=_arguments(tmp_path), **datasets_given,
                          packing=None if len(given) < len(datasets_given) else packing)


def test_masked_labels_and_padding_are_refused_not_trained_on(tmp_path):
    """Packing keeps input_ids alone: a 'labels' column masking a prompt (-100) or an 'attention_mask'
    marking padding was trained on without a word (a helper's probe: 20 label tokens a step where the
    labels allowed 10). Refused, naming the row and the way out; columns that mask nothing pass."""
    import datasets

    from distca_hf import DistCATrainer, PackingConfig
    from helpers import tiny_model

    make = lambda data: DistCATrainer(model=tiny_model("llama"), args=_arguments(tmp_path), train_dataset=data,
                                      packing=PackingConfig(tokens_per_rank=BUDGET))
    ids = [[1, 2, 3, 4], [5, 6, 7]]
    for data, match in (
            (datasets.Dataset.from_dict({"input_ids": ids, "labels": [[-100, -100, 3, 4], [5, 6, 7]]}),
             "train_dataset row 0 has 'labels' that differ from its 'input_ids'.*DistCASFTTrainer"),
            ([{"input_ids": ids[0]}, {"input_ids": ids[1], "labels": [-100, 6, 7]}], "row 1 has 'labels'"),
            (datasets.Dataset.from_dict({"input_ids": ids, "attention_mask": [[1, 1, 1, 1], [1, 1, 0]]}),
             "train_dataset row 1 has an 'attention_mask' with padding")):
        with pytest.raises(ValueError, match=match):
            make(data)
    make(datasets.Dataset.from_dict({"input_ids": ids, "labels": ids, "attention_mask": [[1] * 4, [1] * 3]}))


def test_documents_cut_by_packing_are_said(tmp_path):
    """A document longer than a global batch is cut into chunks that train as their own documents
    (documented, PackingReport.cut_documents); the trainer now says so once, with the count."""
    from distca_hf import DistCATrainer, PackingConfig
    from helpers import tiny_model

    with pytest.warns(UserWarning, match=r"1 of the 2 documents of train_dataset .* were cut into 3 chunks"):
        DistCATrainer(model=tiny_model("llama"), args=_arguments(tmp_path), train_dataset=[[1] * 40, [2, 3]],
                      packing=PackingConfig(tokens_per_rank=16))


def test_balancing_micro_batches_without_pipeline_stages_is_said(tmp_path):
    """balance_micro_batches balances the micro-batches of a step, which only pipeline stages have: it
    was ignored without a word."""
    from distca_hf import DistCATrainer, PackingConfig
    from helpers import tiny_model

    with pytest.warns(UserWarning, match=r"balance_micro_batches=True\) has nothing to balance in train_dataset"):
        DistCATrainer(model=tiny_model("llama"), args=_arguments(tmp_path), train_dataset=[[1] * 10, [2, 3]],
                      packing=PackingConfig(tokens_per_rank=16, balance_micro_batches=True))


def test_token_ids_beyond_the_vocabulary_are_named(tmp_path):
    """A token id >= vocab_size failed inside the embedding (IndexError here, a device-side assert on
    CUDA), and a pad_token_id beyond it was accepted (used by filler rows on several ranks)."""
    from distca_hf import DistCATrainer, PackingConfig
    from helpers import tiny_model

    model = tiny_model("llama")
    vocab = model.config.vocab_size
    with pytest.raises(ValueError, match=f"pad_token_id={vocab} is not below the model's vocab_size {vocab}"):
        DistCATrainer(model=model, args=_arguments(tmp_path), train_dataset=[[1, 2, 3]],
                      packing=PackingConfig(tokens_per_rank=BUDGET, pad_token_id=vocab))
    trainer = DistCATrainer(model=model, args=_arguments(tmp_path), train_dataset=[[1, 2, vocab + 3]],
                            packing=PackingConfig(tokens_per_rank=BUDGET))
    with pytest.raises(ValueError, match=f"token id {vocab + 3} is not below the model's vocab_size {vocab}"):
        trainer.train()


def test_an_evaluation_without_label_tokens_reports_no_loss(tmp_path):
    """1-token documents only: no token is predicted. eval_loss was 0.0 (the Trainer's mean of zeros),
    which reads as perfect and would win metric_for_best_model="eval_loss"; now NaN, with 0 label tokens."""
    import math

    from distca_hf import DistCATrainer, PackingConfig
    from helpers import tiny_model

    trainer = DistCATrainer(model=tiny_model("llama"), args=_arguments(tmp_path),
                            train_dataset=[[1, 2, 3, 4]], eval_dataset=[[5], [6], [7, 8]],
                            packing=PackingConfig(tokens_per_rank=BUDGET))
    metrics = trainer.evaluate(eval_dataset=None)
    assert metrics["eval_label_tokens"] == 1 and math.isfinite(metrics["eval_loss"])
    trainer = DistCATrainer(model=tiny_model("llama"), args=_arguments(tmp_path),
                            train_dataset=[[1, 2, 3, 4]], eval_dataset=[[5], [6], [7]],
                            packing=PackingConfig(tokens_per_rank=BUDGET))
    metrics = trainer.evaluate()
    assert metrics["eval_label_tokens"] == 0 and math.isnan(metrics["eval_loss"])


def test_datasets_given_to_evaluate_and_predict_are_packed_as_the_constructor_packs(tmp_path):
    """evaluate(eval_dataset=<raw documents>) / predict(<raw documents>) failed in the collator ("expects
    items from a PackedDataset"), and a PackedDataset given there was not laid out for the job's ranks
    (on 2 ranks a spanning document was cut: another loss over 39 tokens instead of 40)."""
    from distca_hf import DistCATrainer, PackingConfig
    from helpers import tiny_model

    documents = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14, 15]]
    trainer = DistCATrainer(model=tiny_model("llama"), args=_arguments(tmp_path), train_dataset=[[1, 2, 3, 4]],
                            eval_dataset=documents, packing=PackingConfig(tokens_per_rank=BUDGET))
    built_in = trainer.evaluate()
    given = trainer.evaluate(eval_dataset=documents)
    assert given["eval_loss"] == pytest.approx(built_in["eval_loss"], rel=1e-6)
    assert given["eval_label_tokens"] == built_in["eval_label_tokens"] == 12
    assert trainer.predict(documents).metrics["test_label_tokens"] == 12


def test_span_ranks_precedence(tmp_path, monkeypatch):
    """Plugin field > DISTCA_SPAN_RANKS > distca: section > the trainer's default (on when the server
    group has more than one rank: off here, on one process; the two-rank tests see it on)."""
    import distca_hf
    from distca_hf import DistCAPlugin, DistCATrainer, PackingConfig
    from helpers import tiny_model

    def chosen(plugin):
        trainer = DistCATrainer(model=tiny_model("llama"), args=_arguments(tmp_path), train_dataset=[[1, 2, 3]],
                                packing=PackingConfig(tokens_per_rank=BUDGET), distca_plugin=plugin)
        assert distca_hf.current_config().span_ranks is trainer.span_ranks  # in force process-wide
        assert trainer.distca.config.span_ranks is trainer.span_ranks
        assert trainer.train_dataset.layout.span_ranks is trainer.span_ranks
        return trainer.span_ranks

    section = tmp_path / "distca.yaml"
    section.write_text("distca:\n  span_ranks: true\n")
    assert chosen(DistCAPlugin()) is False  # one rank: nothing to span
    assert chosen(DistCAPlugin(span_ranks=True)) is True
    assert chosen(DistCAPlugin.from_accelerate_config(section)) is True
    monkeypatch.setenv("DISTCA_SPAN_RANKS", "0")
    assert chosen(DistCAPlugin.from_accelerate_config(section)) is False  # the variable beats the file
    assert chosen(DistCAPlugin(span_ranks=True)) is True  # code beats the variable
    monkeypatch.setenv("DISTCA_SPAN_RANKS", "1")
    assert chosen(DistCAPlugin()) is True


def test_spanning_setups_that_would_lose_the_boundary_labels_are_refused(tmp_path):
    from transformers import DataCollatorWithFlattening

    from distca_hf import DistCAPlugin, DistCATrainer, PackingConfig
    from helpers import tiny_model

    model = tiny_model("llama")
    common = dict(train_dataset=[[1, 2, 3]], packing=PackingConfig(tokens_per_rank=BUDGET),
                  distca_plugin=DistCAPlugin(span_ranks=True))
    with pytest.raises(ValueError, match="span_ranks=True the loss must read shift_labels.*label_smoothing_factor"):
        DistCATrainer(model=model, args=_arguments(tmp_path, label_smoothing_factor=0.1), **common)
    with pytest.raises(ValueError, match="span_ranks=True the loss must read shift_labels.*compute_loss_func"):
        DistCATrainer(model=model, args=_arguments(tmp_path), compute_loss_func=lambda *a, **k: 0, **common)
    with pytest.raises(ValueError, match="must come from distca_hf.PackedCollator.*DataCollatorWithFlattening"):
        DistCATrainer(model=model, args=_arguments(tmp_path), data_collator=DataCollatorWithFlattening(), **common)
    import dataclasses

    from transformers import TrainingArguments

    strategies = () if "train_sampling_strategy" not in {f.name for f in dataclasses.fields(TrainingArguments)} else (
        ("group_by_length", True, "would group the packed rows by their number of pieces"),
                                 ("group_by_length", False, "would group the packed rows"),  # (silently before)
                                 ("no_such", True, "would reorder the rows of a global batch"))
    for strategy, span, says in strategies:  # (a setting of later transformers releases: 5.0 has none)
        trainer = DistCATrainer(model=model, args=_arguments(tmp_path, train_sampling_strategy=strategy),
                                **{**common, "distca_plugin": DistCAPlugin(span_ranks=span)})
        with pytest.raises(ValueError, match=f"train_sampling_strategy='{strategy}' {says}"):
            trainer.get_train_dataloader()


def test_causal_lm_loss_over_rank_pieces_equals_the_whole_documents():
    """The labels across a rank boundary, with transformers' own loss: the model forwards
    shift_labels to ForCausalLMLoss, and the pieces' losses, each normalised by the label tokens of
    all ranks, add up to the loss of the whole documents."""
    from distca_hf.training import PackedCollator, PackedDataset, PackingConfig
    from helpers import tiny_model

    model = tiny_model("llama", attn="eager").eval()
    ids = torch.tensor([_documents([20], 3)[0]])
    # the model forwards shift_labels to its loss: only the marked targets count
    shift = torch.full_like(ids, -100)
    shift[0, 4] = 7
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        loss = model(input_ids=ids, labels=ids, shift_labels=shift).loss
    torch.testing.assert_close(loss, F.cross_entropy(logits[0, 4:5], torch.tensor([7])))

    documents = _documents([30, 5, 50, 9], 4)
    dataset = PackedDataset(documents, PackingConfig(tokens_per_rank=24, shuffle=False), world_size=3,
                            span_ranks=True)
    assert len(dataset) == len(dataset.rows) == 6  # rank i holds row i (one server group)
    inputs = [PackedCollator()([dataset[i]]) for i in range(len(dataset))]
    assert any(row.first_position > 0 for row in dataset.rows)
    label_tokens = sum(int(r["shift_labels"].ne(-100).sum()) for r in inputs)
    assert label_tokens == sum(len(d) - 1 for d in documents)
    with torch.no_grad():
        whole = [model(input_ids=torch.tensor([d])).logits[0] for d in documents]
        total = 0.0
        for row, r in zip(dataset.rows, inputs):  # each row's logits: its tokens' in their whole document
            row_logits = torch.cat([whole[doc][start:end] for doc, start, end in row.pieces])[None]
            total += model.loss_function(row_logits, r["labels"], VOCAB, num_items_in_batch=torch.tensor(label_tokens),
                                         shift_labels=r["shift_labels"])
        reference = sum(_token_loss_sum(model, d) for d in documents) / label_tokens
    torch.testing.assert_close(total, reference)


# -- the recipes launch the examples ------------------------------------------------------------------------


@pytest.mark.distributed
def test_cpu_recipe_runs_the_fine_tuning_demo_on_two_processes(tmp_path):
    result = accelerate_launch("--config_file", "recipes/cpu-2proc.yaml", "--main_process_port", str(free_port()),
                     "examples/finetune_long_context.py", "--max_steps", "3", "--tokens-per-rank", "1024",
                     "--compare-colocated", "--distca-config", "recipes/distca.yaml", "--output_dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    from transformers import AutoModelForCausalLM

    for run in ("distca", "colocated"):  # each run's model is saved where --output_dir says
        assert f"model saved to {tmp_path / run}" in result.stdout
        assert AutoModelForCausalLM.from_pretrained(tmp_path / run).config.vocab_size == 1024
    out = result.stdout
    assert "== distca: 3 steps on 2 ranks ==" in out and "== colocated: 3 steps on 2 ranks ==" in out
    assert "largest |loss difference| over 3 steps" in out and "speedup:" in out
    assert "cut into" in out  # the packing report names what was cut ...
    assert "document(s) span ranks (trained whole, up to 2048 tokens)" in out  # ... and what spans ranks
    assert "colocated (no query moves)" in out


@pytest.mark.distributed
def test_deepspeed_recipe_and_plain_accelerate_loop_launch():
    # ZeRO-3 with zero3_init_flag: the model is partitioned while it is built
    result = accelerate_launch("--config_file", "recipes/deepspeed-zero3.yaml", "--num_processes", "2", "--main_process_port",
                     str(free_port()), "examples/finetune_long_context.py", "--max-steps", "2", "--tokens-per-rank",
                     "1024", "--eval-documents", "0")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "== distca: 2 steps on 2 ranks ==" in result.stdout
    result = accelerate_launch("--config_file", "recipes/cpu-2proc.yaml", "--main_process_port", str(free_port()),
                     "examples/pretrain_packed.py", "--steps", "2", "--tokens-per-rank", "1024")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split() for line in result.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1", "2"] and all(float(r[1]) > 0 for r in rows)


@pytest.mark.distributed
def test_plan_visualize_draws_a_plan(tmp_path):
    out = tmp_path / "plan.png"
    result = subprocess.run([sys.executable, "examples/plan_visualize.py", "--out", str(out), "--ranks", "3",
                             "--tokens-per-rank", "4096"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert out.stat().st_size > 10_000 and "colocated" in result.stdout and "-> distca" in result.stdout


def test_collators_and_token_ids_are_checked_against_the_model(tmp_path):
    """Another collator failed deep inside transformers on packed rows; a model made by model_init, a collator's
    own vocab_size and a packed dataset's pad id were never compared with the model's vocabulary (an IndexError
    in the embedding at a step)."""
    from transformers import DataCollatorWithFlattening

    from distca_hf import DistCATrainer, PackedCollator, PackedDataset, PackingConfig
    from helpers import tiny_model

    packing = PackingConfig(tokens_per_rank=BUDGET)
    documents = [[1, 2, 3]] * 4
    with pytest.raises(ValueError, match="the rows must come from distca_hf.PackedCollator.*DataCollatorWithFlattening"):
        DistCATrainer(model=tiny_model("llama"), args=_arguments(tmp_path), train_dataset=documents, packing=packing,
                      data_collator=DataCollatorWithFlattening())
    with pytest.raises(TypeError, match="data_collator=PackedCollator is a class; pass an instance"):
        DistCATrainer(model=tiny_model("llama"), args=_arguments(tmp_path), train_dataset=documents, packing=packing,
                      data_collator=PackedCollator)
    with pytest.raises(ValueError, match=r"data_collator=PackedCollator\(vocab_size=1000\) is past the model's "
                                         "vocab_size 96"):
        DistCATrainer(model=tiny_model("llama"), args=_arguments(tmp_path), train_dataset=documents, packing=packing,
                      data_collator=PackedCollator(vocab_size=1000))
    DistCATrainer(model=tiny_model("llama"), args=_arguments(tmp_path), train_dataset=documents, packing=packing,
                  data_collator=PackedCollator(vocab_size=90))  # a tokenizer's vocabulary below a padded embedding
    with pytest.raises(ValueError, match="train_dataset's PackingConfig.pad_token_id=500 is not below the model's "
                                         "vocab_size 96"):
        DistCATrainer(model=tiny_model("llama"), args=_arguments(tmp_path),
                      train_dataset=PackedDataset(documents, PackingConfig(tokens_per_rank=BUDGET, pad_token_id=500)))
    # wrong types that failed deep (an AttributeError in the checks, or after the first step)
    from distca_hf import StepTableCallback

    with pytest.raises(TypeError, match="args must be transformers.TrainingArguments, got dict"):
        DistCATrainer(model=tiny_model("llama"), args={"output_dir": str(tmp_path)}, train_dataset=documents,
                      packing=packing)
    with pytest.raises(TypeError, match="model must be a model, got str 'gpt2'; load it first"):
        DistCATrainer(model="gpt2", args=_arguments(tmp_path), train_dataset=documents, packing=packing)
    with pytest.raises(TypeError, match=r"StepTableCallback\(out=...\) must be a writable file object"):
        StepTableCallback(out="table.txt")
    late = DistCATrainer(model_init=lambda: tiny_model("llama"), args=_arguments(tmp_path),
                         train_dataset=[[1, 2, 200]] * 4, packing=packing)
    with pytest.raises(ValueError, match="token id 200 is not below the model's vocab_size 96"):
        late.train()


def test_resuming_works_around_what_transformers_before_5_3_and_5_24_lack(tmp_path):
    """Two things the resume tests met on older transformers, checked here on any release: before 5.24 the
    Trainer restores a multi-process CPU run's optimizer to "cpu:0", which torch.load refuses (the
    optimizer's load runs with plain "cpu" instead); the GlobalBatchSampler's epoch is given by a callback
    at each epoch's start, on every release (5.0-5.2 have no Trainer._run_epoch to hook: a run resumed in a
    later epoch read the first epoch's order, and 5.0's two-rank spanning resume failed)."""
    from types import SimpleNamespace

    from distca_hf.training.global_batches import GlobalBatchTrainerMixin, _SamplerEpoch, _torch_load_to_plain_cpu
    from distca_hf.training.packing import GlobalBatchSampler

    path = tmp_path / "state.pt"
    torch.save({"momentum": torch.ones(3)}, path)
    with pytest.raises(RuntimeError, match="cpu:0"):
        torch.load(path, map_location=torch.device("cpu", 0), weights_only=True)
    load = torch.load
    with _torch_load_to_plain_cpu():
        assert torch.equal(torch.load(path, map_location=torch.device("cpu", 0), weights_only=True)["momentum"],
                           torch.ones(3))
    assert torch.load is load

    sampler = GlobalBatchSampler(8, 2, shuffle=True, seed=0)
    orders = {}
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        orders[epoch] = list(sampler)
    assert orders[0] != orders[1]
    trainer = SimpleNamespace(_global_batch_sampler=sampler)
    for state_epoch, epoch in ((0.0, 0), (1.0, 1), (1.0714, 1), (None, 0)):  # (a resumed run: mid-epoch 1)
        sampler.set_epoch(5)
        _SamplerEpoch(trainer).on_epoch_begin(None, SimpleNamespace(epoch=state_epoch), None)
        assert list(sampler) == orders[epoch]

    class Base:  # a Trainer's callback list, as CallbackHandler keeps it
        def __init__(self):
            self.callback_handler = SimpleNamespace(callbacks=[])

        def add_callback(self, callback):
            self.callback_handler.callbacks.append(callback)

        def train(self):
            return "trained"

    host = type("Trainer", (GlobalBatchTrainerMixin, Base), {})()
    assert host.train() == host.train() == "trained"
    assert [type(c) for c in host.callback_handler.callbacks] == [_SamplerEpoch]  # once, on every release


def test_documents_longer_than_learned_positions_are_refused_by_name(tmp_path):
    """GPT-2 learns a table of positions: a packed document past it failed with an IndexError inside the
    embedding (on the rank holding its end; a timeout on the others). Refused with the numbers and the
    setting to lower; rotary models have no table and are not limited."""
    from transformers import AutoModelForCausalLM, GPT2Config, TrainingArguments

    from distca_hf import DistCATrainer, PackingConfig
    from distca_hf.training.global_batches import check_positions_fit, learned_positions
    from distca_hf.training.packing import PackingReport
    from helpers import tiny_model

    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=32),
                                            attn_implementation="distca")
    assert learned_positions(gpt2) == 32 and learned_positions(tiny_model("llama")) is None
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=1, max_steps=1, report_to=[],
                             use_cpu=True, dataloader_pin_memory=False)
    with pytest.raises(ValueError, match=r"a document of 40 tokens, but GPT2LMHeadModel learned positions for 32 tokens"
                                         r".*Lower PackingConfig.tokens_per_rank to at most 32"):
        DistCATrainer(model=gpt2, args=args, train_dataset=_documents([40, 5], 0), packing=PackingConfig(tokens_per_rank=48))
    DistCATrainer(model=gpt2, args=args, train_dataset=_documents([40, 5], 0), packing=PackingConfig(tokens_per_rank=32))
    spanning = PackingReport(tokens_per_rank=24, group_size=2, longest_document=40)  # 40 tokens over two ranks
    with pytest.raises(ValueError, match="spanning up to 2 ranks of 24 tokens.*at most 16 .*span_ranks=False"):
        check_positions_fit(gpt2, spanning, "train_dataset", trainer="DistCATrainer", shrink="PackingConfig.tokens_per_rank")
