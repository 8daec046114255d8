"""``training.pipeline_trainer``'s pieces without processes: the micro-batches of a step, the rows every
stage of a pipeline reads, and the set-up and resume errors. The training itself (trains, resumes,
evaluates and saves like one process) is tested in ``test_pipeline_train.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from distca_hf.training.packing import PackedCollator, PackedDataset, PackingConfig
from distca_hf.training.pipeline_trainer import (PipelineTrainerMixin, _micro_batches_per_step, _PipelineRows,
                                                 _stage_checkpoint_file)
from distca_hf.training.topology import ParallelTopology

WHERE = "DistCATrainer with pipeline_parallel_size=2"


def test_micro_batches_per_step_default_and_refusals():
    # default: the gradient accumulation steps, at least one micro-batch per stage
    assert _micro_batches_per_step(None, 1, stages=2, schedule="1f1b", where=WHERE) == 2
    assert _micro_batches_per_step(None, 5, stages=2, schedule="1f1b", where=WHERE) == 5
    # pipeline_micro_batches given: gradient accumulation 1 (the default) or the same number
    assert _micro_batches_per_step(3, 1, stages=2, schedule="1f1b", where=WHERE) == 3
    assert _micro_batches_per_step(3, 3, stages=2, schedule="gpipe", where=WHERE) == 3
    with pytest.raises(ValueError, match=r"pipeline_micro_batches=3 and gradient_accumulation_steps=4 disagree"):
        _micro_batches_per_step(3, 4, stages=2, schedule="gpipe", where=WHERE)
    with pytest.raises(ValueError, match=r"pipeline_schedule='1f1b' needs at least 4 micro-batches per step"):
        _micro_batches_per_step(3, 1, stages=4, schedule="1f1b", where=WHERE)
    assert _micro_batches_per_step(1, 1, stages=4, schedule="gpipe", where=WHERE) == 1  # GPipe runs with fewer


def test_pipeline_rows_give_a_pipelines_stages_the_same_row_and_whole_steps():
    """2 data-parallel x 2 stages: item ``i`` is rank ``i % 4``'s; both stages of a pipeline read the
    rows of their data-parallel index in the same step, every row of the packing once, then fillers
    (no labels) up to whole steps; an index past the end raises ``IndexError``."""
    tokens, micro_batches = 16, 3
    documents = [[1 + i] * n for i, n in enumerate([20, 5, 9, 30, 3, 12, 7])]
    topology = ParallelTopology(world_size=4, pipeline_parallel=2)
    packed = PackedDataset(documents, PackingConfig(tokens_per_rank=tokens, shuffle=False), world_size=2,
                           full_rows=True)
    rows = _PipelineRows(packed, topology, micro_batches)
    assert len(packed) % 2 == 0 and len(packed) // 2 % micro_batches != 0  # fillers are needed
    assert len(rows) % (topology.world_size * micro_batches) == 0 and rows.step_blocks == micro_batches
    seen = []
    for block in range(len(rows) // topology.world_size):
        items = [rows[block * topology.world_size + rank] for rank in range(topology.world_size)]
        for rank, item in enumerate(items):
            data_index, stage, _ = topology.coordinates(rank)
            assert item == items[topology.rank_of(data_index, 0, 0)]  # every stage: its pipeline's first stage's row
            if stage == 0:
                seen.append(item)
    real = [packed[i] for i in range(len(packed))]
    assert seen[:len(real)] == real  # the packing's rows, in order, each once
    # the report counts the filler rows added to complete the last step, besides the packing's own
    assert rows.report.filler_micro_batches == packed.report.filler_micro_batches + len(seen) - len(real) > 0
    assert rows.report.micro_batches == packed.report.micro_batches
    collator = PackedCollator()
    for filler in seen[len(real):]:
        batch = collator([filler])
        assert batch["input_ids"].shape == (1, tokens) and batch["shift_labels"].eq(-100).all()
    with pytest.raises(IndexError, match="out of range"):
        rows[len(rows)]
    with pytest.raises(IndexError):
        rows[-1]
    assert len(list(rows)) == len(rows)  # iteration by index ends
    for wrong in (packed.with_layout(4, full_rows=True), packed.with_layout(2, full_rows=False)):
        with pytest.raises(ValueError, match="packed for the 2 data-parallel ranks with full_rows=True"):
            _PipelineRows(wrong, topology, micro_batches)


class _Host(PipelineTrainerMixin):
    """Just enough of a DistCATrainer for the mixin's set-up and checkpoint checks."""

    def __init__(self, packed: dict | None = None, pipeline=None):
        self.distca_plugin = SimpleNamespace(pipeline_parallel_size=2)
        self._packed_datasets = packed or {}
        self._pipeline = pipeline


def test_start_pipeline_refuses_datasets_it_cannot_shape():
    with pytest.raises(ValueError, match=r"needs train_dataset= or eval_dataset=.*tokens_per_rank"):
        _Host()._start_pipeline()
    packed = {name: SimpleNamespace(config=PackingConfig(tokens_per_rank=n)) for name, n in (("train", 24),
                                                                                            ("eval", 32))}
    with pytest.raises(ValueError, match=r"different tokens_per_rank \({'train': 24, 'eval': 32}\)"):
        _Host(packed)._start_pipeline()


def test_resuming_from_another_pipeline_size_names_what_the_checkpoint_holds(tmp_path):
    for stage in range(4):
        torch.save({}, tmp_path / _stage_checkpoint_file("model", stage_index=stage, num_stages=4))
    host = _Host(pipeline=SimpleNamespace(stage_index=1, num_stages=2))
    with pytest.raises(FileNotFoundError, match=r"has no model-pipeline-stage-1-of-2.pt \(it holds "
                                                r"\['model-pipeline-stage-0-of-4.pt', .*pipeline_parallel_size=2"):
        host._checkpoint_file(str(tmp_path), "model")
    with pytest.raises(FileNotFoundError, match="it holds no pipeline stage files"):
        host._checkpoint_file(str(tmp_path), "optimizer")
    host = _Host(pipeline=SimpleNamespace(stage_index=1, num_stages=4))
    assert host._checkpoint_file(str(tmp_path), "model") == str(tmp_path / "model-pipeline-stage-1-of-4.pt")


def test_stages_clip_by_the_norm_over_every_stage_whatever_calls_the_accelerator():
    """transformers clips through ``accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)``: from
    5.3 inside ``Trainer._clip_grad_norm`` / ``_get_grad_norm``, before that in the training loop itself,
    where a stage clipped by its own norm (on 5.0 the two stages logged 1.40 and 1.39 for a norm of 1.97,
    and trained otherwise than one process). A stage's call goes to the runner's norm over every stage;
    without stages the accelerator's own runs."""
    class Base:
        def create_accelerator_and_postprocess(self):
            self.accelerator = SimpleNamespace(clip_grad_norm_=lambda parameters, max_norm, norm_type=2: "plain")

    trainer = type("Trainer", (PipelineTrainerMixin, Base), {})()
    trainer.create_accelerator_and_postprocess()
    assert trainer.accelerator.clip_grad_norm_([], 1.0) == "plain"  # no stages: the accelerator's own
    trainer._pipeline = SimpleNamespace(clip_grad_norm_=lambda max_norm: ("every stage", max_norm))
    assert trainer.accelerator.clip_grad_norm_([], 0.5) == ("every stage", 0.5)
    assert trainer.accelerator.clip_grad_norm_([], float("inf")) == ("every stage", float("inf"))  # the norm alone
    with pytest.raises(ValueError, match="norm_type=1"):
        trainer.accelerator.clip_grad_norm_([], 0.5, norm_type=1)
