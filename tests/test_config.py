"""The settings table (``distca_hf.config``): one declaration per setting, from which
``DistCAConfig``, ``DistCAPlugin``'s fields, the environment reading and the fingerprint ranks
compare are derived; precedence code > ``DISTCA_*`` > file > default."""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import distca_hf
from distca_hf import DistCAConfig, DistCAPlugin
from distca_hf.config import SETTINGS, block_for_device, resolve, setting_problem, settings_fingerprint
from distca_hf.planning import TimeModel

TIME_MODEL_JSON = str(Path(__file__).parent / "time_model_example.json")  # a `distca-hf profile` file
VALID = {"tolerance": 0.3, "block": 64, "backward": "resend", "overlap": "wave", "timeout_s": 7.5,
         "mode": "colocated", "servers": (0, 2), "span_ranks": True, "kernel": "math", "time_model": TIME_MODEL_JSON,
         "pipeline_schedule": "cad_1f1b", "pipeline_micro_batches": 4, "memory_budget": 0.5, "kv_cap": "cp", "kv_relays": 2}
INVALID = {"tolerance": -1.0, "block": 0, "backward": "later", "overlap": "sideways", "timeout_s": 0,
           "mode": "remote", "servers": (1, 1), "span_ranks": "maybe", "kernel": "triton",
           "time_model": "/no/such/time_model.json", "pipeline_schedule": "zero_bubble", "pipeline_micro_batches": 0,
           "memory_budget": -1.0, "kv_cap": -1.0, "kv_relays": 0}
NUMPY_VALID = {"tolerance": np.float32(0.5), "block": np.int64(64), "memory_budget": np.float64(0.5),
               "kv_cap": np.int64(1 << 20), "kv_relays": np.int64(2), "timeout_s": np.int32(7),
               "servers": (np.int64(0), np.int16(2)), "pipeline_micro_batches": np.int64(4)}
"""Every numeric setting given as numpy numbers (a size computed with numpy): accepted as Python's."""
BOOL_INVALID = {"block": True, "kv_relays": True, "servers": (True,), "pipeline_micro_batches": True,
                "timeout_s": True, "tolerance": False, "memory_budget": True, "kv_cap": True}
"""The same settings given a bool: no count, refused as before."""


def test_every_setting_is_declared_once_and_everything_else_follows():
    assert set(SETTINGS) == set(VALID) == set(INVALID)  # a new setting needs a row in these tests too
    config_fields = {f.name for f in dataclasses.fields(DistCAConfig)}
    assert config_fields == set(SETTINGS) | {"group"}
    plugin_fields = {f.name: f for f in dataclasses.fields(DistCAPlugin)}
    for name, f in SETTINGS.items():
        assert f.metadata["help"] and plugin_fields[name].metadata["help"] == f.metadata["help"]
        assert plugin_fields[name].default is None  # not set in code: the environment or file decides
        assert f"{name}: " in DistCAPlugin.__doc__
        assert setting_problem(name, f.default) is None
        assert setting_problem(name, VALID[name]) is None
        assert setting_problem(name, INVALID[name]).startswith("must be")
    assert setting_problem("tolerence", 0.1).startswith("is not a distca setting")
    # past int32 token offsets: an OverflowError deep in numpy's rounding before
    assert setting_problem("block", 10**30).startswith("must be an integer from 1 to 2147483647")
    assert setting_problem("kv_relays", 10**30).startswith("must be 'auto'")  # int64 overflow in the trees before
    assert setting_problem("kv_relays", 2**20) is None
    assert setting_problem("timeout_s", 1e-4).startswith("must be a number of seconds from 0.001")  # 0 ms: no timeout
    assert setting_problem("timeout_s", 1e-3) is None


@pytest.mark.parametrize("name", [n for n, f in SETTINGS.items() if f.metadata["env"]])
def test_each_variable_is_read_and_checked(monkeypatch, name):
    variable = SETTINGS[name].metadata["env"]
    monkeypatch.setenv(variable, str(VALID[name]))
    assert getattr(distca_hf.current_config(), name) == VALID[name]
    assert getattr(DistCAPlugin().resolved(), name) == VALID[name]
    distca_hf.configure(**{name: SETTINGS[name].default})  # code beats the variable
    assert getattr(distca_hf.current_config(), name) == SETTINGS[name].default
    distca_hf.reset_config()
    monkeypatch.setenv(variable, str(INVALID[name]))
    with pytest.raises(ValueError, match=f"invalid {variable}="):
        distca_hf.current_config()


@pytest.mark.parametrize("name", sorted(NUMPY_VALID))
def test_numpy_numbers_are_accepted_as_the_python_numbers_they_stand_for(name):
    """``np.int64(64)`` was refused wherever an int is accepted ("must be an integer ..."). It is an
    integer: accepted, and kept as the plain Python number, so configs compare and fingerprint alike on
    every rank; a bool is still refused."""
    value = NUMPY_VALID[name]
    plain = tuple(int(r) for r in value) if isinstance(value, tuple) else value.item()
    config = DistCAConfig(**{name: value})
    assert getattr(config, name) == plain and type(getattr(config, name)) is type(plain)
    assert config == DistCAConfig(**{name: plain})
    assert settings_fingerprint(config) == settings_fingerprint(DistCAConfig(**{name: plain}))
    assert getattr(DistCAPlugin(**{name: value}).resolved(), name) == plain
    assert setting_problem(name, value) is None
    with pytest.raises(ValueError, match=f"distca {name} must be"):
        distca_hf.configure(**{name: BOOL_INVALID[name]})
    with pytest.raises(ValueError, match=f"DistCAPlugin.{name} must be"):
        DistCAPlugin(**{name: BOOL_INVALID[name]})


def test_plugin_sizes_take_numpy_integers_and_refuse_bools():
    plugin = DistCAPlugin(data_parallel_size=np.int64(2), pipeline_parallel_size=np.int32(1),
                          tensor_parallel_size=np.int64(1))
    sizes = (plugin.data_parallel_size, plugin.pipeline_parallel_size, plugin.tensor_parallel_size)
    assert sizes == (2, 1, 1) and all(type(size) is int for size in sizes)
    accelerate_like = SimpleNamespace(dp_replicate_size=np.int64(1), dp_shard_size=np.int64(2), tp_size=np.int64(2),
                                      cp_size=np.int64(1), sp_size=1)
    said = DistCAPlugin(parallelism_config=accelerate_like).parallel_sizes()
    assert (said.data_parallel, said.tensor_parallel) == (2, 2) and type(said.data_parallel) is int
    for name in ("data_parallel_size", "pipeline_parallel_size", "tensor_parallel_size"):
        with pytest.raises(ValueError, match=f"DistCAPlugin.{name} must be an integer >= 1, got True"):
            DistCAPlugin(**{name: True})


FLAG_SPELLINGS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False,
                  "off": False}
KEYWORDS = {"tolerance": {"auto": "auto"}, "memory_budget": {"none": None}, "kv_cap": {"cp": "cp", "none": None},
            "kv_relays": {"auto": "auto", "off": "off"}, "pipeline_micro_batches": {"none": None}}
"""The words of the variables that take a number or a word."""


def _variable_words(name: str) -> dict:
    """The words ``DISTCA_<name>`` accepts -> the value each stands for: a choice setting's choices, a
    true/false setting's spellings, another setting's keywords."""
    f = SETTINGS[name]
    choices = getattr(f.metadata["check"], "choices", None)
    if choices:
        return {choice: choice for choice in choices}
    return FLAG_SPELLINGS if f.type == "bool" else KEYWORDS.get(name, {})


WORDED = [name for name, f in SETTINGS.items() if f.metadata["env"] and _variable_words(name)]


def test_every_choice_or_true_false_variable_is_covered():
    choice_or_flag = {name for name, f in SETTINGS.items() if f.metadata["env"] and (
        getattr(f.metadata["check"], "choices", None) or f.type == "bool")}
    assert choice_or_flag == {"backward", "overlap", "span_ranks", "kernel", "pipeline_schedule"}
    assert choice_or_flag < set(WORDED)


@pytest.mark.parametrize("name, word", [(name, word) for name in WORDED for word in _variable_words(name)])
def test_a_variable_word_matches_in_any_case_and_surrounded_by_spaces(monkeypatch, name, word):
    """One spelling rule for every ``DISTCA_*`` variable: ``DISTCA_TOLERANCE=AUTO`` and ``DISTCA_KV_RELAYS=Off``
    were read, but ``DISTCA_BACKWARD=Saved`` or ``DISTCA_KERNEL=MATH`` refused, and ``DISTCA_SPAN_RANKS`` took
    ``TRUE`` but not ``yes`` / ``on``."""
    variable, expected = SETTINGS[name].metadata["env"], _variable_words(name)[word]
    for spelling in (word, word.upper(), word.title(), f"  {word}\t", f" {word.upper()} "):
        monkeypatch.setenv(variable, spelling)
        value = getattr(distca_hf.current_config(), name)
        assert value == expected and type(value) is type(expected), spelling


@pytest.mark.parametrize("name", WORDED)
def test_a_bad_variable_names_itself_its_value_and_what_is_accepted(monkeypatch, name):
    variable = SETTINGS[name].metadata["env"]
    for bad in ("Sideways", " maybe ", ""):
        monkeypatch.setenv(variable, bad)
        with pytest.raises(ValueError) as error:
            distca_hf.current_config()
        message = str(error.value)
        assert message.startswith(f"invalid {variable}={bad!r}: distca {name} must be "), message
        assert all(word in message.lower() for word in _variable_words(name)), message


@pytest.mark.parametrize("variable, says", [
    ("DISTCA_TOLERENCE", "did you mean DISTCA_TOLERANCE?"),
    ("DISTCA_KVRELAYS", "did you mean DISTCA_KV_RELAYS?"),
    ("DISTCA_BLOCK", "the block setting has no environment variable"),
    ("distca_tolerance", "read by their exact name, DISTCA_TOLERANCE"),
])
def test_a_misspelt_variable_is_not_ignored_silently(monkeypatch, variable, says):
    """A variable no setting reads left the job on defaults without a word; one that looks meant for a
    setting now warns (a tool's or a test's own DISTCA_* variable passes)."""
    monkeypatch.setenv(variable, "0.1")
    with pytest.warns(UserWarning, match=re.escape(says)):
        assert distca_hf.current_config().tolerance == "auto"
    monkeypatch.delenv(variable)
    monkeypatch.setenv("DISTCA_TEST_STAND_IN", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        distca_hf.current_config()


def test_text_flags_of_the_examples_follow_the_variables_rule():
    from distca_hf.training import DistCAArguments

    assert DistCAArguments(tolerance=" AUTO ", kv_relays="Off", kv_cap="CP").plugin().resolved().kv_relays == "off"
    with pytest.raises(ValueError, match=r"invalid --tolerance 'sometimes': distca tolerance must be .*'auto'"):
        DistCAArguments(tolerance="sometimes").plugin()

    # "unbounded" could not be said from a flag (a float flag refused "none") nor in code (the plugin's None
    # means "not set": the default 0.1 applied); the word now stands for the setting's own None in both
    from transformers import HfArgumentParser

    parsed, = HfArgumentParser((DistCAArguments,)).parse_args_into_dataclasses(["--memory_budget", " None "])
    assert parsed.plugin().resolved().memory_budget is None
    assert DistCAPlugin(memory_budget="none").resolved().memory_budget is None
    assert DistCAPlugin().resolved().memory_budget == SETTINGS["memory_budget"].default
    assert DistCAArguments(memory_budget="0.3").plugin().resolved().memory_budget == 0.3
    with pytest.raises(ValueError, match=r"invalid --memory_budget 'lots': distca memory_budget must be a number"):
        DistCAArguments(memory_budget="lots").plugin()


def test_timeout_is_bounded_where_datetime_timedelta_still_holds_it(monkeypatch):
    """A timeout of ~8.7e13 s or more overflows ``datetime.timedelta`` (a false DistCATimeoutError in
    the runtime's waits, an OverflowError making the pipeline's groups): refused, at most 1e9 s."""
    import datetime

    assert setting_problem("timeout_s", 1e9) is None
    datetime.timedelta(seconds=1e9)  # the bound itself is held
    for value in (1e9 + 1, 8.7e13, 1e15, 1e300):
        assert "to 1e9 (about 31 years)" in setting_problem("timeout_s", value)
    monkeypatch.setenv("DISTCA_TIMEOUT_S", "1e15")
    with pytest.raises(ValueError, match=r"invalid DISTCA_TIMEOUT_S='1e15'.*to 1e9"):
        distca_hf.current_config()
    monkeypatch.delenv("DISTCA_TIMEOUT_S")
    with pytest.raises(ValueError, match="distca timeout_s .*to 1e9"):
        distca_hf.configure(timeout_s=1e14)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_each_setting_is_checked_in_code_plugin_and_file(name, tmp_path):
    with pytest.raises(ValueError, match=f"distca {name} must be"):
        distca_hf.configure(**{name: INVALID[name]})
    with pytest.raises(ValueError, match=f"DistCAPlugin.{name} must be"):
        DistCAPlugin(**{name: INVALID[name]})
    value = list(INVALID[name]) if isinstance(INVALID[name], tuple) else INVALID[name]
    path = tmp_path / "job.yaml"
    path.write_text(f"distca:\n  {name}: {value!r}\n".replace("'", '"'))
    with pytest.raises(ValueError, match=f"job.yaml: distca.{name} must be"):
        DistCAPlugin.from_accelerate_config(path)


def test_file_settings_sit_below_the_environment(monkeypatch):
    monkeypatch.setenv("DISTCA_OVERLAP", "wave")
    resolved = resolve(code={"tolerance": 0.4}, file={"tolerance": 0.1, "overlap": "pingpong", "block": 8})
    assert (resolved.tolerance, resolved.overlap, resolved.block) == (0.4, "wave", 8)


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(SETTINGS)))
def test_fingerprint_changes_exactly_with_the_settings_ranks_must_share(name):
    base = DistCAConfig()
    changed = dataclasses.replace(base, **{name: VALID[name]})
    differs = settings_fingerprint(base) != settings_fingerprint(changed)
    assert differs == SETTINGS[name].metadata["agree"]
    group_only = dataclasses.replace(base, group=object())
    assert settings_fingerprint(group_only) == settings_fingerprint(base)


def test_kernel_setting_names_the_backends():
    from distca_hf.config import KERNELS
    from distca_hf.kernels import BACKENDS, select_backend

    assert set(KERNELS) == {"auto", *BACKENDS}
    distca_hf.configure(kernel="math")
    assert select_backend("cpu", torch.float32).NAME == "math"


def test_configure_and_environment(monkeypatch):
    distca_hf.reset_config()
    monkeypatch.setenv("DISTCA_TOLERANCE", "0.1")
    monkeypatch.setenv("DISTCA_BACKWARD", "resend")
    assert distca_hf.current_config().tolerance == 0.1
    assert distca_hf.current_config().backward == "resend"
    distca_hf.configure(tolerance=0.05)  # code beats the environment
    try:
        assert distca_hf.current_config().tolerance == 0.05
        monkeypatch.setenv("DISTCA_BACKWARD", "sometimes")
        with pytest.raises(ValueError, match="DISTCA_BACKWARD"):
            distca_hf.current_config()
        monkeypatch.setenv("DISTCA_BACKWARD", "saved")
        monkeypatch.setenv("DISTCA_TIMEOUT_S", "-3")
        with pytest.raises(ValueError, match="DISTCA_TIMEOUT_S"):
            distca_hf.current_config()
        monkeypatch.setenv("DISTCA_TIMEOUT_S", "5")
        monkeypatch.setenv("DISTCA_OVERLAP", "maybe")
        with pytest.raises(ValueError, match="DISTCA_OVERLAP"):
            distca_hf.current_config()
        monkeypatch.delenv("DISTCA_OVERLAP")
        with pytest.raises(TypeError, match="unknown distca settings"):
            distca_hf.configure(tolerence=0.1)
        with pytest.raises(ValueError, match="distca backward must be one of"):
            distca_hf.configure(backward="later")
        for group in (123, "world", torch.distributed):  # a rank, a name, the module: not a group
            with pytest.raises(TypeError, match="group must be a torch.distributed ProcessGroup"):
                distca_hf.configure(group=group)
        assert distca_hf.current_config().group is None  # nothing refused was kept
    finally:
        distca_hf.reset_config()


def test_configured_puts_back_what_code_had_set():
    """``configured`` (DistCATrainer's span_ranks default while it runs): in force inside the block,
    the earlier code setting (or none) after it, also after an exception; a value the block set itself
    stays."""
    from distca_hf.config import configured

    distca_hf.configure(tolerance=0.05)
    with configured(span_ranks=True, tolerance=0.2) as config:
        assert config.span_ranks is True and distca_hf.current_config().tolerance == 0.2
    assert distca_hf.current_config().span_ranks is False and distca_hf.current_config().tolerance == 0.05
    with pytest.raises(RuntimeError, match="inside"):
        with configured(span_ranks=True):
            raise RuntimeError("inside")
    assert distca_hf.current_config().span_ranks is False
    with configured(tolerance=0.2):
        distca_hf.configure(tolerance=0.3)  # the block's own choice
    assert distca_hf.current_config().tolerance == 0.3


def test_tolerance_auto_and_block_by_device(monkeypatch):
    assert DistCAConfig().tolerance == "auto" and DistCAConfig().block is None
    monkeypatch.setenv("DISTCA_TOLERANCE", "auto")
    assert distca_hf.current_config().tolerance == "auto"
    monkeypatch.setenv("DISTCA_TOLERANCE", "0.05")
    assert distca_hf.current_config().tolerance == 0.05
    monkeypatch.setenv("DISTCA_TOLERANCE", "sometimes")
    with pytest.raises(ValueError, match="invalid DISTCA_TOLERANCE='sometimes'"):
        distca_hf.current_config()
    assert (block_for_device(None, "cuda"), block_for_device(None, "cpu"), block_for_device(8, "cuda")) == (128, 1, 8)


@pytest.mark.parametrize("content, why", [(None, "No such file"), ("{not json", "not JSON"),
                                          ('{"linear_s_per_token": 1}', "no object with numbers")])
def test_a_bad_time_model_file_is_one_line_naming_the_variable(monkeypatch, tmp_path, content, why):
    path = tmp_path / "model.json"
    if content is not None:
        path.write_text(content)
    monkeypatch.setenv("DISTCA_TIME_MODEL", str(path))
    with pytest.raises(ValueError) as error:
        distca_hf.current_config()
    message = str(error.value)
    assert message.startswith(f"invalid DISTCA_TIME_MODEL='{path}': distca time_model must be") and why in message
    assert "\n" not in message


def test_ranks_agree_on_the_time_model_contents_not_its_path(tmp_path):
    path = tmp_path / "model.json"
    TimeModel(1e-6, 2e-10).save(path)
    config = DistCAConfig(time_model=str(path))
    before = settings_fingerprint(config)
    assert settings_fingerprint(DistCAConfig(time_model=str(path))) == before
    TimeModel(1e-6, 3e-10).save(path)  # same path, other constants: ranks must not agree
    assert settings_fingerprint(config) != before
    in_code = DistCAConfig(time_model=TimeModel(1e-6, 2e-10))
    assert settings_fingerprint(in_code) == settings_fingerprint(DistCAConfig(time_model=TimeModel(1e-6, 2e-10)))
    assert settings_fingerprint(in_code) != settings_fingerprint(DistCAConfig(time_model=TimeModel(1e-6, 4e-10)))


def test_a_time_model_file_is_read_once_per_version(tmp_path, monkeypatch):
    from distca_hf.planning import TokenBytes, resolve_time_model

    path, reads = tmp_path / "model.json", []
    load = TimeModel.load.__func__
    monkeypatch.setattr(TimeModel, "load", classmethod(lambda cls, p: reads.append(p) or load(cls, p)))
    TimeModel(1e-6, 2e-10).save(path)
    resolve = lambda: resolve_time_model(str(path), "cpu", TokenBytes(q=64, kv=64, o=64), 4)  # noqa: E731
    first = resolve()
    assert resolve() is first and len(reads) == 1  # every planned forward resolves it: one read
    TimeModel(1e-6, 3e-10).save(path)  # rewritten (same size): read again
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert resolve().attn_s_per_pair == 3e-10 and len(reads) == 2
    with pytest.raises(ValueError, match="model.json: cannot read"):  # gone: the file's error, not a stale model
        path.unlink() or resolve()
