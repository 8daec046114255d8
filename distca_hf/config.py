"""distca settings: one table, from which everything else is derived.

``DistCAConfig``'s fields *are* the table: each setting is declared once, with its default, its
``DISTCA_*`` environment variable (contract), its check, its help and whether every rank of a
server group must use the same value. From it come ``DistCAConfig`` itself, the fields of
``DistCAPlugin``, the reading of the environment and the fingerprint that ranks compare when a
forward opens.

Precedence, for each setting: code (``distca_hf.configure(...)``, or a ``DistCAPlugin`` field) >
its environment variable > a ``distca:`` YAML section (``DistCAPlugin.from_accelerate_config``) >
the default. Variables are read when a plan is made, so a job can change them between runs; an
invalid value is an error naming the variable.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import json
import math
import numbers
import os
import warnings
import zlib
from dataclasses import dataclass, field, fields

from .state import STATE

__all__ = ["DistCAConfig", "SETTINGS", "configure", "configured", "current_config", "reset_config", "resolve",
           "setting_problem", "none_is_a_value", "stands_for_none", "read_setting_text", "is_integer", "is_number", "file_version",
           "plain_number", "FLAG_WORDS", "settings_fingerprint", "block_for_device", "DEVICE_BLOCKS",
           "apply_file_settings", "agreed_setting_names", "BACKWARD_MODES", "OVERLAP_MODES", "MODES", "KERNELS",
           "PIPELINE_SCHEDULES", "INT32_MAX", "PINGPONG_AS_WAVE",
           "cad_1f1b_servers_problem"]

BACKWARD_MODES = ("saved", "resend")
OVERLAP_MODES = ("none", "wave", "pingpong")
MODES = ("distca", "colocated")
KERNELS = ("auto", "flash_attn", "torch_cuda", "torch_cuda_efficient", "torch_cpu", "math")
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "cad_1f1b")
"""The ``pipeline_schedule`` names (contract "pipeline parallelism"); ``runtime.pipeline_schedules`` builds them."""

def cad_1f1b_servers_problem(servers) -> str | None:
    """Why a ``servers`` setting cannot apply under ``pipeline_schedule="cad_1f1b"`` (the plugin refuses it
    where it is made, the runtime for settings made by ``configure``), or ``None``."""
    if servers is None:
        return None
    return (f"pipeline_schedule='cad_1f1b' pools CA-tasks over every data-parallel x pipeline rank; the servers "
            f"setting ({servers}, indices into one stage's server group) does not apply: unset it, or use "
            "pipeline_schedule='1f1b'")


PINGPONG_AS_WAVE = ("distca: pipeline_schedule='cad_1f1b' plans each tick for whole micro-batches; overlap='pingpong' "
                    "runs as overlap='wave' there")
"""What the plugin (at construction) and the ``cad_1f1b`` runtime (for settings made by ``configure``)
say, once per process, of ``overlap="pingpong"`` under ``cad_1f1b``."""


# ---- numbers: Python's and numpy's alike ----

def is_integer(value) -> bool:
    """Whether ``value`` is an integer: a Python ``int`` or any other ``numbers.Integral`` (numpy's
    ``np.int64``, as sizes computed with numpy come), bools excluded (``True`` is no count). The one
    integer test of the settings, the plugin's sizes and the packing checks."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def plain_number(value):
    """``value`` with a numpy number as the Python ``int`` / ``float`` it stands for (anything else
    as is), so that settings compare, print and fingerprint alike on every rank however they were made."""
    if is_integer(value) and type(value) is not int:
        return int(value)
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, numbers.Integral)) \
            and type(value) is not float:
        return float(value)
    return value


# ---- text: the one spelling rule of the DISTCA_* variables (and the examples' text flags) ----

FLAG_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
"""The spellings of a true/false variable (``DISTCA_SPAN_RANKS``), matched in any case."""


def _words(words: dict, otherwise=None, expected: str | None = None):
    """A setting's ``parse`` (the text of its variable -> its value) under the one rule every variable
    follows: surrounding whitespace is ignored and a word of ``words`` (``auto``, ``none``, ``off``, a
    choice, a flag's ``true``) matches in any case (``AUTO``, `` Off ``). Other text goes to
    ``otherwise`` (``float``, ``int``) or, without one, is refused as ``"must be <expected>, got ..."``."""
    def parse(text: str):
        text = text.strip()
        if text.lower() in words:
            return words[text.lower()]
        if otherwise is None:
            raise ValueError(f"must be {expected or f'one of {list(words)}'} (in any case), got {text!r}")
        return otherwise(text)
    parse.__name__ = "/".join([*words, *([otherwise.__name__.strip("_")] if otherwise else [])])  # argparse's errors
    return parse


def _stripped(text: str) -> str:
    """A variable's text, surrounding whitespace removed, its case kept (a path, a choice for its check)."""
    return text.strip()


# ---- checks: each returns what is wrong, as "must be ..., got ...", or None ----

def is_number(value) -> bool:
    """Whether ``value`` is a finite real number (numpy's too), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _tolerance_problem(value):
    if value != "auto" and not (is_number(value) and value >= 0):
        return (f"must be a finite number >= 0 (allowed max/mean - 1 of attention load) or 'auto' (plan by time), "
                f"got {value!r}")


def _memory_budget_problem(value):
    if value is not None and not (is_number(value) and value >= 0):
        return (f"must be a number >= 0 (the worst rank may hold (1 + memory_budget) x the mean over ranks of what "
                f"they hold for attention's backward per layer) or None (unbounded), got {value!r}")


def _kv_cap_problem(value):
    if value is not None and value != "cp" and not (is_number(value) and value > 0):
        return (f"must be 'cp' (per-document CP's worst rank of the batch), a number of bytes > 0 (K/V one server may "
                f"receive per layer) or None (no cap), got {value!r}")


def kv_cap_pairing_problem(kv_cap, tolerance) -> str | None:
    """What is wrong with ``kv_cap`` beside ``tolerance`` (only planning by time plans within a cap),
    as ``"kv_cap ... needs ..."``, or ``None``; the one home of the rule (settings and planner)."""
    if kv_cap is not None and tolerance != "auto":
        return (f"kv_cap {kv_cap!r} needs tolerance 'auto' (got tolerance {tolerance!r}): only planning by time "
                "plans within it; set kv_cap None or tolerance 'auto'")
    return None


MAX_RELAY_FANOUT = 2**20
"""The largest relay fanout (``kv_relays``, ``planning.relay_trees``): one past any server count, where a
tree is a holder sending to every server directly."""


def _kv_relays_problem(value):
    if value not in ("auto", "off") and not (is_integer(value) and 1 <= value <= MAX_RELAY_FANOUT):
        return (f"must be 'auto' (relay trees placed by time where they make the step faster), 'off' (every holder "
                f"sends to every server) or an integer fanout from 1 to {MAX_RELAY_FANOUT} (every K/V range several "
                f"servers need goes along trees of that fanout), got {value!r}")


INT32_MAX = 2**31 - 1
"""The largest token count, offset or id the package takes (``block``, packing's sizes): token offsets
are int32 in the kernels' ``cu_seqlens``, token ids in the embedding."""


def _block_problem(value):
    if value is not None and not (is_integer(value) and 1 <= value <= INT32_MAX):
        return (f"must be an integer from 1 to {INT32_MAX} (tokens per shard block) or None (by device), "
                f"got {value!r}")


DEVICE_BLOCKS = {"cuda": 128}
"""``block`` when the setting is None, by device type (any other: 1): flash kernels work in
128-query tiles, so shards cut at multiples of 128 run whole tiles; a CPU kernel has no tiles."""


def block_for_device(block, device_type: str) -> int:
    """The shard block in force: the ``block`` setting, or ``DEVICE_BLOCKS``' entry for the device
    type (1 when it has none) when the setting is None."""
    return block if block is not None else DEVICE_BLOCKS.get(device_type, 1)


def file_version(path) -> tuple:
    """``(real path, inode, size, modification and change times)`` of the file at ``path``: what a cache
    of what the file holds is keyed by (a file rewritten or replaced gets another); ``OSError`` when it
    cannot be read."""
    stat = os.stat(path)
    return os.path.realpath(path), stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns


def _time_model_file_problem(path) -> str | None:
    """What is wrong with a time-model file, before ``TimeModel.load`` reads it in full. Settings are
    checked whenever they are resolved (every kernel call asks for the ``kernel`` setting), so the file
    is read again only when it changed (``file_version``)."""
    try:
        version = file_version(path)
    except OSError as e:
        return f"must be a readable `distca-hf profile` JSON file, got {str(path)!r} ({e.strerror or e})"
    return _time_model_contents_problem(str(path), version)


@functools.lru_cache(maxsize=8)
def _time_model_contents_problem(path: str, version: tuple) -> str | None:
    """``_time_model_file_problem`` of the file as it is at ``version`` (``file_version``)."""
    try:
        data = json.loads(open(path).read())
    except OSError as e:
        return f"must be a readable `distca-hf profile` JSON file, got {str(path)!r} ({e.strerror or e})"
    except ValueError as e:
        return f"must be a `distca-hf profile` JSON file, got {str(path)!r} (not JSON: {e})"
    if not isinstance(data, dict) or not all(
            is_number(data.get(k)) for k in ("linear_s_per_token", "attn_s_per_pair")):
        return (f"must be a `distca-hf profile` JSON file, got {str(path)!r} (no object with numbers "
                "linear_s_per_token and attn_s_per_pair)")
    return None


def _time_model_problem(value):
    if value is None or hasattr(value, "attn_s_per_pair"):  # None: built-in by device; a TimeModel
        return None
    if isinstance(value, (str, os.PathLike)) and str(value):
        return _time_model_file_problem(value)
    return f"must be None (built-in by device), a TimeModel or the path of a `distca-hf profile` JSON, got {value!r}"


def _time_model_fingerprint(value):
    """What ranks compare for the time model: its constants (a file's bytes), not just its path."""
    if isinstance(value, (str, os.PathLike)):
        try:
            return (str(value), zlib.crc32(open(value, "rb").read()))
        except OSError:
            return (str(value), None)
    return value


MAX_TIMEOUT_S = 1e9
"""The longest ``timeout_s`` (about 31 years): far longer ones overflow ``datetime.timedelta``, which
torch's waits and process groups take."""


MIN_TIMEOUT_S = 1e-3
"""The shortest ``timeout_s``: torch counts waits in whole milliseconds, and a wait of 0 ms is no
timeout at all (c10d's ``kNoTimeout``): a shorter one would wait forever."""


def _timeout_problem(value):
    if not (is_number(value) and MIN_TIMEOUT_S <= value <= MAX_TIMEOUT_S):
        return (f"must be a number of seconds from 0.001 (torch waits in whole milliseconds; 0 ms would mean no "
                f"timeout) to 1e9 (about 31 years), got {value!r}")


def _servers_problem(value):
    if value is None:
        return None
    ranks = list(value) if isinstance(value, (list, tuple)) else None
    if (not ranks or any(not is_integer(r) or r < 0 for r in ranks)
            or len(set(ranks)) != len(ranks)):
        return (f"must be a non-empty list of distinct ranks >= 0 (indices into the attention-server group), "
                f"got {value!r}")


def _flag_problem(value):
    if not isinstance(value, bool):
        return f"must be True or False, got {value!r}"


def _micro_batches_problem(value):
    if value is not None and not (is_integer(value) and value >= 1):
        return (f"must be an integer >= 1 (micro-batches per optimizer step and pipeline) or None (DistCATrainer: "
                f"its gradient_accumulation_steps, at least pipeline_parallel_size), got {value!r}")


def _one_of(choices):
    def problem(value):
        if value not in choices:
            return f"must be one of {list(choices)}, got {value!r}"
    problem.choices = tuple(choices)  # read by the command-line flags (training.arguments)
    return problem


def _choice(choices):
    """The ``parse`` of a choice setting: its choices in any case, other text left for the check to refuse."""
    return _words({c: c for c in choices}, _stripped)


_flag = _words(FLAG_WORDS, expected="1, true, yes or on (True), or 0, false, no or off (False)")


def setting(default, *, check, help: str, env: str | None = None, parse=_stripped, agree: bool = True, fingerprint=None):
    """A field of the settings table. ``env``: its ``DISTCA_*`` variable (``None``: code and files
    only); ``parse``: text of the variable -> value (``_words``: one spelling rule for all; a choice
    setting's words are its choices); ``agree``: every rank of a server group must
    use the same value (it enters ``settings_fingerprint``, through ``fingerprint(value)`` when
    given: what must be equal, e.g. a file's contents)."""
    return field(default=default, metadata={"env": env, "parse": parse, "check": check, "help": help,
                                            "agree": agree, "fingerprint": fingerprint})


@dataclass(frozen=True)
class DistCAConfig:
    """How distca plans and dispatches (the settings table; see the module docstring).

    Every field but ``group`` is a setting: ``distca_hf.configure(name=value)``,
    ``DistCAPlugin(name=value)`` or ``name: value`` in a ``distca:`` YAML section sets it.
    """

    tolerance: float | str = setting(
        "auto", env="DISTCA_TOLERANCE", parse=_words({"auto": "auto"}, float), check=_tolerance_problem,
        help="'auto': plan by time (the time model's fastest step; work moves only while the move pays); a number: "
             "a hard bound on max/mean - 1 of attention load (query-key pairs) over servers, smaller balances more "
             "tightly and moves more bytes")
    block: int | None = setting(
        None, parse=_words({"none": None}, int), check=_block_problem,
        help="shard granularity in tokens: every CA-task cut is a multiple of it; None: by device (128 on CUDA, the "
             "flash kernels' tile; 1 on CPU)")
    backward: str = setting(
        "saved", env="DISTCA_BACKWARD", parse=_choice(BACKWARD_MODES), check=_one_of(BACKWARD_MODES),
        help="'saved': servers keep what their backward needs (fewer bytes); 'resend': servers keep nothing and "
             "sources send q, k, v, out again in backward (flat server memory, more bytes)")
    memory_budget: float | None = setting(
        0.1, env="DISTCA_MEMORY_BUDGET", parse=_words({"none": None}, float), check=_memory_budget_problem,
        help="bound on what a plan makes ranks hold for attention's backward in one layer, as a fraction over the "
             "mean: the worst rank holds at most (1 + memory_budget) x the mean over ranks of what they hold (their "
             "own tokens' q, k, v, out and log-sum-exp plus what the plan adds: memory_imbalance <= 1 + "
             "memory_budget), or what it keeps in 'resend' mode when that is more. 'auto' plans within it by "
             "construction in 'saved' mode (no server takes queries or K/V past it; K/V that would pile on a "
             "server become key-split tiles on their holders), and runs a step in 'resend' mode (servers keep "
             "nothing) when that is faster or the only way to fit; a fixed tolerance keeps its carving and "
             "falls back to 'resend'. The default 0.1 holds memory_imbalance within 1.10 on every batch of the "
             "shared samples at 8-512 ranks, at about a tenth of the speedup on the rows with documents spanning "
             "many ranks (they need resend mode); None: unbounded ('none' in DistCAPlugin and the flags, whose "
             "None means not set)")
    kv_cap: float | str | None = setting(
        None, env="DISTCA_KV_CAP", parse=_words({"none": None, "cp": "cp"}, float), check=_kv_cap_problem,
        help="a cap on the K/V one attention server receives per layer (forward; what 'saved' mode keeps for "
             "backward and 'resend' mode receives again; per plan: each ping-pong nano-batch, each wave's copy "
             "apart): 'cp' caps every server at per-document context parallelism's worst rank for the batch (every "
             "rank holding a piece of a document that spans ranks gathers the rest of it; no cap when no document "
             "spans ranks), a number caps it at that many bytes (or at what the colocated plan's worst rank "
             "receives, when more), None: no cap. Needs tolerance 'auto', which plans within it; a rank outside "
             "the server pool still gives all its work away. Off by default: on the bench-sim rows "
             "(docs/planner.md) 'cp' makes the predicted layer 1.03-3.2x slower (median 1.3x) and distca slower "
             "than the best baseline on 5 of 18, as long documents' prefixes may no longer travel")
    kv_relays: str | int = setting(
        "auto", env="DISTCA_KV_RELAYS", parse=_words({"auto": "auto", "off": "off"}, int), check=_kv_relays_problem,
        help="K/V relays: servers that received a K/V prefix forward it to the next servers that need it, along "
             "trees, so the rank holding a long document sends each range a few times instead of once per server "
             "(one more K/V exchange per tree level in the forward, and the K/V gradients summed back up the trees "
             "in the backward). 'auto': trees placed on the plan by time, only where the time model predicts a "
             "faster step; 'off': every holder sends to every server directly; an integer fanout >= 1: every K/V "
             "range that two or more servers need goes along trees of that fanout (1: a chain; for tests and "
             "measurements)")
    overlap: str = setting(
        "none", env="DISTCA_OVERLAP", parse=_choice(OVERLAP_MODES), check=_one_of(OVERLAP_MODES),
        help="how the dispatch's communication overlaps compute: 'none', 'wave' (any model) or 'pingpong' "
             "(Llama-family decoder stacks)")
    timeout_s: float = setting(
        600.0, env="DISTCA_TIMEOUT_S", parse=_words({}, float), check=_timeout_problem, agree=False,
        help="seconds a distca collective may wait for a peer before raising DistCATimeoutError (from 0.001, torch's "
             "millisecond, to 1e9, about 31 years: longer waits overflow datetime.timedelta)")
    mode: str = setting(
        "distca", parse=_choice(MODES), check=_one_of(MODES),
        help="'distca' redistributes attention; 'colocated' runs each rank's own documents with the same kernel "
             "and no communication (the baseline of distca-hf bench)")
    servers: tuple[int, ...] | None = setting(
        None, check=_servers_problem,
        help="indices, within the attention-server group, of the ranks that serve attention (None: all of them)")
    span_ranks: bool = setting(
        False, env="DISTCA_SPAN_RANKS", parse=_flag, check=_flag_problem,
        help="the server group's ranks hold consecutive pieces of one global token stream, one row per rank: a "
             "row whose first document starts at position p > 0 continues the last document of the previous rank")
    time_model: object = setting(
        None, env="DISTCA_TIME_MODEL", check=_time_model_problem, fingerprint=_time_model_fingerprint,
        help="the time model 'auto' plans with: None for the built-in one of the device kind (CUDA: H100 measured, "
             "CPU: 2 gloo processes measured; scaled to the model's heads), a `distca-hf profile` JSON path, or a "
             "TimeModel")
    kernel: str = setting(
        "auto", env="DISTCA_KERNEL", parse=_choice(KERNELS), check=_one_of(KERNELS), agree=False,
        help="the varlen attention kernel backend: 'auto' picks the fastest usable one")
    pipeline_schedule: str = setting(
        "1f1b", env="DISTCA_PIPELINE_SCHEDULE", parse=_choice(PIPELINE_SCHEDULES),
        check=_one_of(PIPELINE_SCHEDULES),
        help="how the stages run the micro-batches of a step when pipeline_parallel_size > 1: 'gpipe' (torch's "
             "ScheduleGPipe: every forward, then every backward; holds all micro-batches' activations), '1f1b' "
             "(torch's Schedule1F1B: one forward, one backward in steady state; CAD inside each stage's data-parallel "
             "group) or 'cad_1f1b' (lockstep 1F1B: every stage runs every tick, a stage in a bubble serves CA-tasks, "
             "one plan per tick pooled over all data x pipeline ranks; needs equal layers per stage, holds up to "
             "2(P-s)-1 micro-batches on stage s)")
    pipeline_micro_batches: int | None = setting(
        None, env="DISTCA_PIPELINE_MICRO_BATCHES", parse=_words({"none": None}, int), check=_micro_batches_problem,
        help="micro-batches (packed rows per data-parallel rank) each pipeline runs per optimizer step when "
             "pipeline_parallel_size > 1; DistCATrainer makes it its gradient_accumulation_steps (None: "
             "TrainingArguments.gradient_accumulation_steps, at least pipeline_parallel_size). More micro-batches "
             "shrink the pipeline bubble, (P-1)/(M+P-1) of a step")
    group: object = field(default=None, compare=False, metadata={
        "help": "the attention-server process group (None: the default group); set by DistCAPlugin.attach"})

    def __post_init__(self):
        if isinstance(self.servers, (list, tuple)):  # a tuple of Python ints, however given
            object.__setattr__(self, "servers", tuple(plain_number(r) for r in self.servers))
        for name in SETTINGS:  # np.int64(4) is 4: accepted, and equal (and fingerprinted) as 4
            object.__setattr__(self, name, plain_number(getattr(self, name)))
        for name in SETTINGS:
            problem = setting_problem(name, getattr(self, name))
            if problem:
                raise ValueError(f"distca {name} {problem}")
        problem = kv_cap_pairing_problem(self.kv_cap, self.tolerance)  # refused here, not at the first planned step
        if problem:
            raise ValueError(f"distca {problem}")


SETTINGS = {f.name: f for f in fields(DistCAConfig) if "check" in f.metadata}
"""name -> dataclass field of every setting; ``field.metadata`` holds env, parse, check, help, agree."""


def none_is_a_value(name: str) -> bool:
    """Whether setting ``name`` takes ``None`` as a value of its own rather than as its default
    (``memory_budget``: unbounded). ``DistCAPlugin`` fields and ``DistCAArguments`` flags, whose ``None``
    means "not set", spell that value ``"none"`` (``stands_for_none``)."""
    setting = SETTINGS.get(name)
    return setting is not None and setting.default is not None and setting.metadata["check"](None) is None


def stands_for_none(name: str, value) -> bool:
    """Whether ``value`` is the word ``"none"`` (any case) given to a setting of ``none_is_a_value``."""
    return isinstance(value, str) and value.strip().lower() == "none" and none_is_a_value(name)


def setting_problem(name: str, value) -> str | None:
    """What is wrong with ``value`` for the setting ``name``, as ``"must be ..., got ..."``, or ``None``."""
    if name not in SETTINGS:
        return f"is not a distca setting; expected one of {sorted(SETTINGS)}"
    return SETTINGS[name].metadata["check"](value)


def _check_names(settings: dict, source: str) -> None:
    unknown = set(settings) - set(SETTINGS) - {"group"}
    if unknown:
        raise TypeError(f"unknown distca settings {sorted(unknown)} ({source}); expected some of {sorted(SETTINGS)}")


def read_setting_text(name: str, text: str):
    """The value of setting ``name`` that ``text`` (its ``DISTCA_*`` variable, or a text flag of the
    examples) stands for, checked; every variable is read here, under one spelling rule (``_words``).
    Refused as ``ValueError("must be ..., got ...")``: what is accepted, in the words of the setting's
    parse or check."""
    f = SETTINGS[name]
    try:
        value = f.metadata["parse"](text)
    except ValueError as e:  # float('x'): the check says what is accepted
        problem = str(e) if str(e).startswith("must be ") else f.metadata["check"](text.strip()) or str(e)
        raise ValueError(problem) from None
    problem = setting_problem(name, value)
    if problem:
        raise ValueError(problem)
    return value


def _misspelt_variables() -> list[str]:
    """Why the ``DISTCA_*`` variables set that no setting reads are ignored, for those that look meant
    for one: a setting without a variable (``DISTCA_BLOCK``), or a near miss of a variable
    (``DISTCA_TOLERENCE``). Others (a tool's own ``DISTCA_CONFIG_FILE``, a test's) pass silently."""
    known = {f.metadata["env"] for f in SETTINGS.values() if f.metadata["env"]}
    problems = []
    for var in sorted(v for v in os.environ if v.upper().startswith("DISTCA_") and v not in known):
        name = var[len("DISTCA_"):].strip().lower()
        if name in SETTINGS and SETTINGS[name].metadata["env"]:  # another spelling of a variable
            problems.append(f"{var!r} is ignored: variables are read by their exact name, {SETTINGS[name].metadata['env']}")
        elif name in SETTINGS:
            problems.append(f"{var} is ignored: the {name} setting has no environment variable (set it with "
                            f"distca_hf.configure({name}=...) or in the distca: section of the accelerate config)")
        else:
            near = difflib.get_close_matches(var.strip().upper(), sorted(known), n=1, cutoff=0.8)
            if near:
                problems.append(f"{var} is ignored: no distca setting reads it; did you mean {near[0]}?")
    return problems


def _from_environment(skip=()) -> dict:
    for problem in _misspelt_variables():
        warnings.warn(problem, stacklevel=3)
    values = {}
    for name, f in SETTINGS.items():
        var = f.metadata["env"]
        if var is None or name in skip or var not in os.environ:
            continue
        raw = os.environ[var]
        try:
            values[name] = read_setting_text(name, raw)
        except ValueError as e:
            raise ValueError(f"invalid {var}={raw!r}: distca {name} {e}") from None
    return values


def resolve(code: dict | None = None, file: dict | None = None) -> DistCAConfig:
    """The settings in force given ``code`` and ``file`` settings: code > ``DISTCA_*`` > file > default."""
    code, file = dict(code or {}), dict(file or {})
    _check_names(code, "code")
    _check_names(file, "file")
    return DistCAConfig(**{**file, **_from_environment(skip=code), **code})


def configure(**settings) -> DistCAConfig:
    """Set distca options in code (they override ``DISTCA_*`` variables); returns the result.
    ``configure()`` with no arguments just validates the current settings."""
    if settings.get("group") is not None:
        _check_group(settings["group"])
    merged = {**STATE.code_settings, **settings}
    config = resolve(merged, STATE.file_settings)  # validate before storing
    STATE.code_settings = merged
    return config


def _check_group(group) -> None:
    import torch.distributed as dist  # here: reading settings needs no torch

    if not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise TypeError(f"distca group must be a torch.distributed ProcessGroup (dist.new_group(...)) or None for the "
                        f"default group, got {group!r}")


@contextlib.contextmanager
def configured(**settings):
    """``configure(**settings)`` for the ``with`` block only; yields the config in force. On exit
    each of these settings goes back to what code had set before (or to unset), unless the block
    set it to another value itself (then that stays)."""
    before = dict(STATE.code_settings)
    config = configure(**settings)
    try:
        yield config
    finally:
        for name, value in settings.items():
            if name not in STATE.code_settings or STATE.code_settings[name] is not value:
                continue  # changed (or reset) inside the block: the newer choice stays
            if name in before:
                STATE.code_settings[name] = before[name]
            else:
                del STATE.code_settings[name]


def apply_file_settings(settings: dict) -> None:
    """Put the settings of a ``distca:`` YAML section in force, below the environment (used by
    ``DistCAPlugin.attach``)."""
    resolve(STATE.code_settings, settings)  # validate before storing
    STATE.file_settings = dict(settings)


def reset_config() -> None:
    """Forget settings made with ``configure`` or a plugin (environment variables and defaults apply)."""
    STATE.code_settings = {}
    STATE.plugin_settings = {}
    STATE.file_settings = {}


def current_config() -> DistCAConfig:
    """The settings a plan made now would use."""
    return resolve(STATE.code_settings, STATE.file_settings)


def settings_fingerprint(config: DistCAConfig) -> int:
    """A number every rank of a server group computes alike when their ``agree`` settings are equal."""
    return zlib.crc32(repr(tuple((name, (f.metadata["fingerprint"] or (lambda v: v))(getattr(config, name)))
                                 for name, f in SETTINGS.items() if f.metadata["agree"])).encode())


def agreed_setting_names() -> list[str]:
    """The settings every rank of a server group must share (named in the mismatch error)."""
    return [name for name, f in SETTINGS.items() if f.metadata["agree"]]
