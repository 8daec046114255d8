"""The examples speak HF: ``HfArgumentParser`` over ``TrainingArguments`` and our own groups (the
distca flags derived from the settings table), defaults and whole sentences in ``--help``, data
errors that name the flag in one line, and the per-step metrics reaching ``report_to`` (TensorBoard
event files) while the progress bar stays on. The two-process launch of the example (with a saved
model) is in ``tests/test_trainer.py``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))

import finetune_long_context as example  # noqa: E402
from distca_hf.config import SETTINGS  # noqa: E402
from distca_hf.training.arguments import DistCAArguments  # noqa: E402


def test_transformers_flags_and_ours_parse_together(tmp_path):
    model, data, packing, distca, comparison, training = example.parse_args([
        "--max_steps", "5", "--output_dir", str(tmp_path), "--learning_rate", "1e-4", "--warmup_steps", "2",
        "--lr_scheduler_type", "cosine", "--weight_decay", "0.1", "--report_to", "tensorboard", "--use_cpu",
        "--tokens-per-rank", "512", "--dataset", "docs.jsonl", "--model_name_or_path", "some/model",
        "--text_column", "body", "--tolerance", "0.05", "--overlap", "wave",
        "--servers", "0", "1", "--span_ranks", "false", "--compare-colocated"])
    assert (training.max_steps, training.output_dir, training.learning_rate, training.warmup_steps) == \
        (5, str(tmp_path), 1e-4, 2)
    assert training.lr_scheduler_type == "cosine" and training.weight_decay == 0.1 and training.use_cpu
    assert training.report_to == ["tensorboard"]
    assert packing.tokens_per_rank == 512 and data.text_column == "body" and comparison.compare_colocated
    plugin = distca.plugin(mode="colocated")
    assert (plugin.tolerance, plugin.overlap, plugin.servers, plugin.span_ranks, plugin.mode) == \
        (0.05, "wave", (0, 1), False, "colocated")
    assert plugin.block is None  # left out: DISTCA_* / the distca: section / the default decide
    # the example's own defaults (shown by --help), where they differ from TrainingArguments'
    *_, defaults = example.parse_args(["--output_dir", str(tmp_path)])
    assert (defaults.max_steps, defaults.learning_rate, defaults.lr_scheduler_type, defaults.logging_steps) == \
        (30, 1e-3, "constant", 1)
    assert defaults.per_device_train_batch_size == defaults.per_device_eval_batch_size == 1


def test_every_distca_setting_is_a_flag_with_the_tables_help():
    fields = DistCAArguments.__dataclass_fields__
    assert set(SETTINGS) | {"distca_config"} == set(fields)
    for name, setting in SETTINGS.items():
        help_text = fields[name].metadata["help"]
        assert (help_text[0].isupper() or help_text[0] == "'") and help_text.endswith(".")  # a sentence
        assert setting.metadata["help"][1:] in help_text and repr(setting.default) in help_text
        if setting.metadata["env"]:
            assert setting.metadata["env"] in help_text
    from transformers import HfArgumentParser

    parser = HfArgumentParser(DistCAArguments)
    with pytest.raises(SystemExit):  # the table's choices are the flag's choices
        parser.parse_args_into_dataclasses(["--overlap", "sideways"])
    (bad,) = parser.parse_args_into_dataclasses(["--tolerance", "-1"])
    with pytest.raises(ValueError, match="tolerance"):  # the table's check, naming the setting
        bad.plugin()


@pytest.mark.distributed  # spawns an interpreter
def test_help_shows_defaults_and_whole_sentences():
    result = subprocess.run([sys.executable, "examples/finetune_long_context.py", "--help"], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    text = " ".join(result.stdout.split())
    for flag in ("--report_to", "--warmup_steps", "--lr_scheduler_type", "--weight_decay", "--use_cpu",
                 "--resume_from_checkpoint", "--tolerance", "--distca_config", "--compare_colocated"):
        assert flag in text
    assert "The token budget of one rank's packed row per forward (the micro-batch). (default: 8192)" in text
    assert "(default: out/finetune_long_context)" in text and "(default: constant)" in text
    assert "else on when the server group has more than one rank (DistCATrainer's" in text  # not the setting's False
    import dataclasses

    from transformers import TrainingArguments

    for field in dataclasses.fields(TrainingArguments):  # (transformers 5.0's own help has ``markup``: not ours)
        text = text.replace(" ".join(str(field.metadata.get("help", "")).split()), "")
    assert "``" not in text


def test_data_errors_are_one_line_naming_the_flag(tmp_path, monkeypatch, capsys):
    import datasets

    from helpers import tiny_model

    tiny_model("llama").save_pretrained(tmp_path / "model")
    example.offline_tokenizer(["some text to train on", "more text"]).save_pretrained(tmp_path / "model")
    capsys.readouterr()  # the saving's progress bars

    def no_hub(*args, **kwargs):
        raise AssertionError(f"the Hub was asked for {args}")

    monkeypatch.setattr(datasets, "load_dataset", no_hub)
    common = ["--model_name_or_path", str(tmp_path / "model"), "--output_dir", str(tmp_path / "out")]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    column = tmp_path / "corpus.jsonl"
    column.write_text('{"body": "hello"}\n')
    cases = {
        str(tmp_path / "my_corpus.jsonl"): "--dataset {}: no such file or folder",
        str(empty): "--dataset {} holds no documents",
    }
    for dataset, expected in cases.items():
        assert example.main([*common, "--dataset", dataset]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and expected.format(dataset) in err
    monkeypatch.undo()  # the json builder of datasets reads local files through load_dataset
    assert example.main([*common, "--dataset", str(column)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--text_column text: no such column" in err and "body" in err


def test_step_table_keeps_the_progress_bar_and_tensorboard_gets_the_imbalance(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import ProgressCallback, TrainingArguments

    from distca_hf import DistCAPlugin, DistCATrainer, PackingConfig, StepTableCallback
    from helpers import tiny_model

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=1, per_device_eval_batch_size=1,
                             max_steps=3, logging_steps=1, report_to=["tensorboard"], save_strategy="no",
                             use_cpu=True, dataloader_pin_memory=False)
    documents = [[(7 * i + j) % 90 + 1 for j in range(n)] for i, n in enumerate([40, 3, 17, 25, 9, 30, 12, 5])]
    table = StepTableCallback(title="== table ==")
    trainer = DistCATrainer(model=tiny_model("llama"), args=args, train_dataset=documents,
                            packing=PackingConfig(tokens_per_rank=48), distca_plugin=DistCAPlugin(), callbacks=[table])
    callbacks = trainer.callback_handler.callbacks
    assert table in callbacks and not any(type(c) is ProgressCallback for c in callbacks)  # the table draws the bar
    trainer.train()
    logged = [h for h in trainer.state.log_history if "attn_imbalance_before" in h]
    assert [r["step"] for r in table.rows] == [h["step"] for h in logged] == [1, 2, 3]
    (run,) = [p.parent for p in (tmp_path / "runs").rglob("events.out.tfevents.*")]  # output_dir/runs/...
    events = EventAccumulator(str(run))
    events.Reload()
    for key in ("attn_imbalance_before", "attn_imbalance_after", "tokens_per_s", "step_time_s", "plan_time_s", "loss"):
        scalars = events.Scalars(f"train/{key}")
        assert [s.step for s in scalars] == [1, 2, 3]
        assert [s.value for s in scalars] == pytest.approx([h[key] for h in logged], rel=1e-6)


def test_without_the_table_the_trainers_own_progress_bar_stays(tmp_path):
    from transformers import ProgressCallback, TrainingArguments

    from distca_hf import DistCAPlugin, DistCATrainer, PackingConfig
    from helpers import tiny_model

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=1, per_device_eval_batch_size=1,
                             max_steps=1, report_to=[], use_cpu=True)
    trainer = DistCATrainer(model=tiny_model("llama"), args=args, train_dataset=[[1, 2, 3]],
                            packing=PackingConfig(tokens_per_rank=8), distca_plugin=DistCAPlugin())
    assert any(type(c) is ProgressCallback for c in trainer.callback_handler.callbacks)


class _Table:  # what compare() reads of a StepTableCallback
    def __init__(self, times, losses=None, after=None):
        losses = losses or [1.0] * len(times)
        after = after or [1.02] * len(times)
        self.rows = [{"step": i + 1, "loss": l, "before": 1.5, "after": a, "step_time_s": t}
                     for i, (t, l, a) in enumerate(zip(times, losses, after))]


def test_timing_repeats_time_every_step_by_its_fastest_run(capsys):
    distca = [_Table([9.0, 1.0, 3.0, 2.0]), _Table([9.0, 2.0, 2.0, 2.2])]
    colocated = [_Table([9.0, 2.0, 3.0, 2.0]), _Table([9.0, 1.5, 4.0, 2.0])]
    assert [r["step_time_s"] for r in example.fastest_steps(distca)] == [9.0, 1.0, 2.0, 2.0]
    assert example.repeat_noise(distca) == pytest.approx([0.0, 1.0, 0.5, 0.1])
    assert example.repeat_noise(distca[:1]) == []
    assert example.compare(distca, colocated, 1e-3)
    out = capsys.readouterr().out
    # steps 2..4: colocated 1.5 + 3.0 + 2.0 against distca 1.0 + 2.0 + 2.0
    assert "colocated 6.5 s, distca 5.0 s" in out and "speedup: 1.30x" in out
    assert "fastest of 2 runs per mode" in out and "up to 100%" in out
    assert "0 of 3 steps more than 3% slower" in out


def test_compare_counts_slower_steps_and_those_that_kept_the_colocated_plan(capsys):
    # step 3 kept the colocated plan (imbalance unchanged: 1.5 -> 1.5), step 4 moved work and lost
    distca = [_Table([1.0, 1.0, 2.2, 2.3], after=[1.02, 1.02, 1.5, 1.02])]
    colocated = [_Table([1.0, 1.2, 2.0, 2.0], losses=[1.0, 1.0, 1.0, 1.01])]
    assert not example.compare(distca, colocated, 1e-3)  # a loss 0.01 apart fails the check
    out = capsys.readouterr().out
    assert "2 of 3 steps more than 3% slower than colocated (1 of them kept the colocated plan" in out
    assert "fastest of" not in out  # one run per mode: no repeats to speak of


@pytest.mark.parametrize("argv, message", [
    (["--compare_colocated", "--timing_repeats", "0"], "--timing_repeats must be at least 1"),
    (["--timing_repeats", "2"], "add --compare_colocated"),
    # flags that were ignored, or read wrongly (nan never passes, inf always does, -1 always fails)
    (["--compare_colocated", "--loss_tolerance", "nan"], "--loss_tolerance must be a finite number >= 0, got nan"),
    (["--compare_colocated", "--loss_tolerance", "-1"], "--loss_tolerance must be a finite number >= 0, got -1.0"),
    (["--loss_tolerance", "0.5"], "--loss_tolerance bounds the loss difference of --compare_colocated's"),
    (["--compare_colocated", "--mode", "colocated"], "--mode colocated: --compare_colocated trains both modes"),
    (["--text_column", "body"], "--text_column reads --dataset; add --dataset or drop it"),
    (["--dataset_split", "test", "--text_column", "body"], "--dataset_split and --text_column read --dataset"),
])
def test_comparison_and_data_flags_are_checked(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit):
        example.parse_args(["--output_dir", str(tmp_path), *argv])
    assert message in capsys.readouterr().err


def test_bench_sim_untuned_runs_without_the_shared_samples(tmp_path, monkeypatch, capsys):
    """``bench_sim.py --untuned`` generates its length samples: a missing ``--data`` is no error there
    (it is for the shared grid)."""
    import bench_sim

    calls = []
    monkeypatch.setattr(bench_sim, "run", lambda data, batches, untuned=False: calls.append((data, untuned)) or "table")
    assert bench_sim.main(["--untuned", "--data", str(tmp_path / "missing")]) == 0
    assert calls == [(None, True)] and "table" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench_sim.main(["--data", str(tmp_path / "missing")])
    assert "doc_lengths" in capsys.readouterr().err


def test_pipeline_stages_need_a_multiple_of_the_stages_in_processes(tmp_path, capsys, monkeypatch):
    """``--pipeline_parallel_size 2`` on one process failed with a traceback after the documents were read
    and the model built: refused first, in one line."""
    monkeypatch.setattr(example, "load_data", lambda *args: pytest.fail("read documents before the process check"))
    assert example.main(["--output_dir", str(tmp_path), "--pipeline_parallel_size", "2"]) == 2
    err = capsys.readouterr().err
    assert "error: world size 1 is not divisible by pipeline_parallel x tensor_parallel = 2 x 1" in err


def test_a_distca_section_mode_is_the_runs_unless_the_flag_says_otherwise(tmp_path, capsys):
    """``mode:`` in the ``--distca_config`` file applies (the example passed ``mode="distca"`` in code
    whenever ``--mode`` was left out, which beat the file without a word)."""
    settings = tmp_path / "distca.yaml"
    settings.write_text("distca:\n  mode: colocated\n")
    common = ["--output_dir", str(tmp_path / "out"), "--max_steps", "1", "--tokens_per_rank", "256",
              "--eval_documents", "0", "--save_strategy", "no", "--report_to", "none", "--distca_config", str(settings)]
    assert example.main(common) == 0
    out = capsys.readouterr().out
    assert "== colocated: 1 steps on 1 rank ==" in out and "distca: colocated (no query moves)" in out
    assert example.main([*common, "--mode", "distca"]) == 0  # the flag beats the file
    assert "== distca: 1 steps on 1 rank ==" in capsys.readouterr().out
