"""`distca-hf launch`: one config file holds both the launch and the distca: section; the section is
checked before any process starts, and every launched process reads it through
DistCAPlugin.from_environment()."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from distca_hf.tools.launch import split_config

ROOT = Path(__file__).resolve().parent.parent


def _job(tmp_path, distca) -> Path:
    document = yaml.safe_load((ROOT / "recipes" / "cpu-2proc.yaml").read_text())
    document["distca"] = distca
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def test_split_config_separates_and_checks_the_section(tmp_path):
    accelerate, section = split_config(_job(tmp_path, {"overlap": "pingpong", "tolerance": 0.07}))
    assert "distca" not in accelerate and accelerate["num_processes"] == 2
    assert section == {"overlap": "pingpong", "tolerance": 0.07}
    with pytest.raises(ValueError, match="overlap"):
        split_config(_job(tmp_path, {"overlap": "sometimes"}))
    with pytest.raises(ValueError, match="toleranse"):
        split_config(_job(tmp_path, {"toleranse": 0.1}))


def _cli():
    exe = Path(sys.executable).parent / "distca-hf"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "distca_hf"]


@pytest.mark.distributed
def test_bad_section_stops_before_launching(tmp_path):
    result = subprocess.run([*_cli(), "launch", "--config_file", str(_job(tmp_path, {"backward": "later"})),
                             "nothing.py"], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "backward" in result.stderr and "later" in result.stderr


def test_a_missing_or_folder_config_file_is_named_before_launching(tmp_path, monkeypatch):
    from distca_hf.tools.launch import main

    for path, words in ((tmp_path, "is a folder; name the YAML file in it"), (tmp_path / "none.yaml", "does not exist")):
        with pytest.raises(SystemExit, match=f"distca-hf launch: error: --config_file: distca config file .*{words}"):
            main(["--config_file", str(path), "nothing.py"])
    twice = tmp_path / "twice.yaml"  # accelerate's own keys too: accelerate would keep the last one
    twice.write_text("num_processes: 2\nmixed_precision: 'no'\nnum_processes: 4\n")
    with pytest.raises(SystemExit, match=r"--config_file: .*twice.yaml: not valid YAML: key 'num_processes' is given "
                                         r"twice \(lines 1 and 3\)"):
        main(["--config_file", str(twice), "nothing.py"])
    # the flag twice (distca read the first file, accelerate the last) or empty (read as the current folder)
    good = tmp_path / "good.yaml"
    good.write_text("num_processes: 2\n")
    for argv in (["--config_file", str(good), f"--config-file={good}", "x.py"], ["--config_file=", "x.py"]):
        with pytest.raises(SystemExit, match=r"--config_file is (given twice; give it once|empty; name the accelerate)"):
            main(argv)
    # a module's own --config_file is its own (not accelerate's): not refused as given twice
    import subprocess

    seen = []
    monkeypatch.setattr(subprocess, "call", lambda argv, env: seen.append((argv, env)) or 0)
    assert main(["--config_file", str(good), "-m", "mypkg.train", "--config_file", "model.yaml"]) == 0 and seen
    # ... nor taken for accelerate's when accelerate is given none: the module gets its file untouched and
    # distca reads no settings from it (it was rewritten and read as the job's config file)
    monkeypatch.delenv("DISTCA_CONFIG_FILE", raising=False)
    seen.clear()
    assert main(["--num_processes", "1", "-m", "mypkg.train", "--config_file", "model.yaml"]) == 0
    (argv, env), = seen
    assert argv[-4:] == ["-m", "mypkg.train", "--config_file", "model.yaml"] and "DISTCA_CONFIG_FILE" not in env


@pytest.mark.distributed
def test_launched_processes_read_the_section(tmp_path):
    script = tmp_path / "report.py"
    script.write_text(
        "import os, sys\n"
        "from distca_hf import DistCAPlugin\n"
        "config = DistCAPlugin.from_environment().resolved()\n"
        "open(os.path.join(sys.argv[1], 'rank' + os.environ['RANK']), 'w').write(\n"
        "    f'{config.overlap} {config.tolerance} {config.backward}')\n"
    )
    env = {**os.environ, "DISTCA_BACKWARD": "resend"}  # the environment beats the file
    env.pop("DISTCA_CONFIG_FILE", None)
    job = _job(tmp_path, {"overlap": "pingpong", "tolerance": 0.07, "backward": "saved"})
    result = subprocess.run([*_cli(), "launch", "--config_file", str(job), "--main_process_port", "0", str(script),
                             str(tmp_path)], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}").read_text() == "pingpong 0.07 resend"
