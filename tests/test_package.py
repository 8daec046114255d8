"""Packaging and CLI: the installed package carries `patches/`, the console script reports the
environment, and the registration works through every HF entry point."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import distca_hf
from helpers import tiny_config

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.distributed
def test_distca_hf_env_json():
    beside_python = Path(sys.executable).parent / "distca-hf"
    exe = str(beside_python) if beside_python.exists() else shutil.which("distca-hf")
    assert exe, "the distca-hf console script is not installed (install the package: `make test` does)"
    result = subprocess.run([exe, "env", "--json"], capture_output=True, text=True, check=True)
    info = json.loads(result.stdout)
    for key in ("torch", "transformers", "accelerate", "deepspeed", "flash-attn", "kernel_backends"):
        assert key in info
    assert info["torch"] == torch.__version__
    assert info["kernel_backends"]["cpu/float32"]["auto"] == "torch_cpu"


def test_distca_hf_env_table_and_bad_command():
    from distca_hf.tools.cli import main

    assert main(["env"]) == 0
    with pytest.raises(SystemExit):
        main(["bogus"])


def test_kernel_bench_cli_runs_small(capsys):
    from distca_hf.tools.cli import main

    assert main(["kernel-bench", "--workload", "short_documents", "--repeats", "1", "--heads", "2",
                 "--kv-heads", "1", "--head-dim", "8", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["short_documents"]
    assert {"torch_cpu", "torch_cpu_stacked", "sdpa_mask", "math", "dense_packed_sdpa"} <= row.keys()


@pytest.mark.distributed
def test_patches_ship_in_the_wheel(tmp_path):
    """A non-editable build must contain `patches/` as `distca_hf.patches`."""
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(REPO)],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    (wheel,) = tmp_path.glob("distca_hf-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "distca_hf/patches/__init__.py" in names
    assert "distca_hf/patches/llama_family.py" in names
    assert "distca_hf/kernels/torch_cpu.py" in names
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "distca-hf = distca_hf.tools.cli:main" in entry_points


@pytest.mark.distributed  # spawns make
@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_gpu_check_offline_installs_only_the_package(tmp_path):
    """``make gpu-check TORCH= OFFLINE=1`` (a lent GPU machine has no package index) installs only
    this package, without its dependencies and with no pip upgrade; OFFLINE=1 with a torch to install
    is refused naming TORCH=. (A dry run: ``make -n`` prints the recipe.)"""
    venv = f"VENV={tmp_path / 'venv'}"
    dry = subprocess.run(["make", "-n", "-C", str(REPO), "gpu-check", "TORCH=", "OFFLINE=1", venv],
                         capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr
    installs = [line for line in dry.stdout.splitlines() if "pip install" in line]
    assert installs and all("--no-index" in line and "--no-deps" in line for line in installs), installs
    assert "-m gpu" in dry.stdout and "--system-site-packages" in dry.stdout
    online = subprocess.run(["make", "-n", "-C", str(REPO), "gpu-check", "TORCH=", venv], capture_output=True, text=True)
    assert "--upgrade pip" in online.stdout and "--no-index" not in online.stdout
    refused = subprocess.run(["make", "-n", "-C", str(REPO), "gpu-check", "OFFLINE=1", venv], capture_output=True, text=True)
    assert refused.returncode != 0 and "pass TORCH= (empty) too" in refused.stderr


def test_make_test_oldest_pins_the_lower_bounds_setup_cfg_states():
    """``make test-oldest`` installs the oldest transformers and accelerate that ``setup.cfg`` allows: when a
    lower bound moves, the target's pins must move with it (else the stated range goes unchecked)."""
    import configparser
    import re

    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    bounds = dict(re.match(r"\s*([A-Za-z_.-]+)>=([0-9.]+)", line).groups()
                  for line in config["options"]["install_requires"].strip().splitlines() if ">=" in line)
    makefile = (REPO / "Makefile").read_text()
    pins = dict(re.findall(r"([a-z_-]+)==([0-9.]+)", re.search(r"^OLDEST \?= (.*)$", makefile, re.M).group(1)))
    assert set(pins) == {"transformers", "accelerate"}
    for name, pinned in pins.items():
        lower = tuple(int(x) for x in bounds[name].split("."))
        version = tuple(int(x) for x in pinned.split("."))
        assert version[:len(lower)] == lower, (name, bounds[name], pinned)  # 5.0 -> 5.0.x, 1.10 -> 1.10.x


def test_patches_importable_from_the_package():
    from distca_hf.patches import TESTED_MODEL_TYPES, is_llama_family

    assert {"llama", "mistral", "qwen2", "qwen3"} <= set(TESTED_MODEL_TYPES)
    assert is_llama_family(tiny_config("qwen3")) and not is_llama_family(object())


def test_from_pretrained_and_set_attn_implementation(tmp_path):
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="distca")
    assert model.config._attn_implementation == "distca"
    ids = torch.arange(10).unsqueeze(0)
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]])
    ours = model(input_ids=ids, position_ids=pos).logits
    model.set_attn_implementation("eager")
    alone = torch.cat([model(input_ids=ids[:, :4]).logits, model(input_ids=ids[:, 4:]).logits], 1)
    torch.testing.assert_close(ours, alone, atol=1e-5, rtol=1e-4)
    model.set_attn_implementation("distca")
    assert model.config._attn_implementation == "distca"
    torch.testing.assert_close(model(input_ids=ids, position_ids=pos).logits, ours)
    assert distca_hf.__version__


@pytest.mark.distributed  # spawns interpreters
def test_import_is_cheap_and_registers_when_transformers_loads():
    """``import distca_hf`` imports neither torch nor transformers; "distca" is registered (and the
    Llama stack wrapped, Bloom refused) once transformers imports its modules, whichever comes first."""
    script = """
import sys
import distca_hf
print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
from transformers import AutoModelForCausalLM, BloomConfig, LlamaConfig, LlamaModel
model = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1), attn_implementation="distca")
print(model.config._attn_implementation, getattr(LlamaModel.forward, "_distca_pingpong", False))
try:
    AutoModelForCausalLM.from_config(BloomConfig(vocab_size=32, hidden_size=16, n_layer=1, n_head=2),
                                     attn_implementation="distca")
except distca_hf.UnsupportedAttentionError:
    print("bloom refused")
"""
    for first in ("", "import transformers.modeling_utils, transformers.models.llama.modeling_llama\n"):
        result = subprocess.run([sys.executable, "-c", first + script], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        lines = result.stdout.split("\n")
        assert lines[0] == ("[]" if not first else "['torch', 'transformers']")
        assert lines[1:3] == ["distca True", "bloom refused"]
