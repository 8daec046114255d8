"""``DistCAPlugin``: every distca setting of a training job in one validated dataclass.

Settings come from three places; for each one the first that sets it wins:

1. code: ``DistCAPlugin(tolerance=0.05, ...)`` (a field left at ``None`` is not set);
2. the environment: each setting's ``DISTCA_*`` variable, e.g. ``DISTCA_TOLERANCE`` (contract; an
   invalid value is an error naming the variable);
3. a ``distca:`` section of a YAML file, e.g. an Accelerate config:
   ``DistCAPlugin.from_accelerate_config("my-config.yaml")``;

and otherwise the defaults. The setting fields, their checks and help come from the settings table
(``distca_hf.config``). ``attach()`` builds the attention-server process group and puts the settings
in force process-wide; ``DistCATrainer`` and ``DistCAAccelerator`` call it for you.

The topology can be said the HF way instead of with the plugin's own sizes: accelerate's
``ParallelismConfig`` (``DistCAPlugin.from_parallelism_config(pc)``, the ``parallelism_config`` field,
or automatically the one of the ``Accelerator`` / ``TrainingArguments``) and a model that transformers
sharded with tensor parallelism (``from_pretrained(..., distributed_config=DistributedConfig(tp_size=..))``:
``attach(model=...)``, which ``DistCATrainer`` and ``DistCAAccelerator.prepare`` do). Sizes given
several ways must agree (the error names both).

Note: ``accelerate launch`` (1.x) refuses config files with keys it does not know, so a file
given to ``accelerate launch --config_file`` cannot carry the ``distca:`` section: launch with
``distca-hf launch`` (same arguments; it strips and checks the section and every process reads it
with ``DistCAPlugin.from_environment()``), or keep the section in a second file
(``recipes/distca.yaml``), or use the environment variables on the launch line.
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, make_dataclass
from pathlib import Path
from typing import Any

from ..config import (PINGPONG_AS_WAVE, SETTINGS, DistCAConfig, apply_file_settings, cad_1f1b_servers_problem,
                      configure, is_integer, plain_number, read_setting_text, reset_config, resolve, setting_problem,
                      stands_for_none)
from ..state import STATE, warn_once
from .topology import SERVER_SCOPES, ParallelTopology, build_server_group

__all__ = ["DistCAPlugin", "DistCAGroups", "ParallelSizes", "model_parallel_sizes", "read_distca_section",
           "load_config_yaml"]


@dataclass(frozen=True)
class DistCAGroups:
    """What ``DistCAPlugin.attach`` built for this rank.

    Attributes:
        topology: the data x pipeline x tensor topology of the job.
        rank: this process's global rank.
        server_ranks: global ranks of this rank's attention-server group (this rank included).
        group: the ``torch.distributed`` group of those ranks (``None``: the default group, or no
            distributed run).
        config: the distca settings now in force on this rank.
    """

    topology: ParallelTopology
    rank: int
    server_ranks: tuple[int, ...]
    group: object
    config: DistCAConfig


def _positive_int_problem(optional: bool):
    def problem(value):
        if value is None and optional:
            return None
        if not (is_integer(value) and value >= 1):
            return f"must be an integer >= 1, got {value!r}"
    return problem


def _scope_problem(value):
    if value not in SERVER_SCOPES:
        return f"must be one of {list(SERVER_SCOPES)}, got {value!r}"


def _topology_field(default, *, check, help: str):
    return field(default=default, metadata={"check": check, "help": help})


# The settings of the table as plugin fields: same names, checks and help; ``None`` means "not set
# here" (the environment, the file or the default decides).
_SettingFields = make_dataclass("_SettingFields", [
    (name, f"{f.type} | None", field(default=None, metadata={**f.metadata, "setting": True}))
    for name, f in SETTINGS.items()
])


@dataclass
class DistCAPlugin(_SettingFields):
    """Core Attention Disaggregation settings and process topology of a training job.

    Every field is listed below with its help (generated from the settings table). A setting left
    at ``None`` is not set in code: its ``DISTCA_*`` variable, the ``distca:`` section or the
    default decides (see ``distca_hf.config``).
    """

    server_group: str = _topology_field(
        "data_parallel", check=_scope_problem,
        help="which ranks exchange CA-tasks: 'data_parallel' (the data-parallel group; with tensor parallelism, the "
             "ranks sharing a tensor-parallel index) or 'node' (its ranks on one node, keeping attention traffic on "
             "intra-node links)")
    data_parallel_size: int | None = _topology_field(
        None, check=_positive_int_problem(optional=True),
        help="ranks that hold different data (accelerate's dp_replicate_size x dp_shard_size: both serve attention "
             "alike); None: from parallelism_config or the model's DistributedConfig, else world size / "
             "(pipeline x tensor)")
    pipeline_parallel_size: int = _topology_field(
        1, check=_positive_int_problem(optional=False),
        help="pipeline stages: > 1 splits the model's decoder layers evenly over that many stages (embeddings on the "
             "first, final norm + LM head on the last), run on torch.distributed.pipelining with pipeline_schedule; "
             "DistCATrainer trains in stages, CA-tasks are exchanged among each stage's data-parallel copies. Not "
             "with tensor_parallel_size > 1, DeepSpeed or FSDP")
    tensor_parallel_size: int | None = _topology_field(
        None, check=_positive_int_problem(optional=True),
        help="ranks that split each layer's attention heads (transformers' tensor parallelism; CA-tasks are "
             "exchanged only among ranks holding the same heads); None: accelerate's ParallelismConfig.tp_size or "
             "the model's tensor-parallel size (attach(model=...)), else 1")
    parallelism_config: Any = field(default=None, repr=False, metadata={
        "help": "an accelerate ParallelismConfig (dp_replicate_size x dp_shard_size -> data_parallel_size, tp_size -> "
                "tensor_parallel_size; cp_size / sp_size > 1 refused: span_ranks replaces them for packed documents); "
                "DistCAAccelerator and DistCATrainer fill it from the Accelerator / TrainingArguments when unset"})
    file_settings: dict = field(default_factory=dict, repr=False, metadata={
        "help": "settings read from a distca: YAML section (below the environment in precedence); filled by "
                "from_accelerate_config"})

    def __post_init__(self):
        if self.servers is not None:
            if isinstance(self.servers, (str, bytes, Mapping)) or not hasattr(self.servers, "__iter__"):
                raise ValueError(f"DistCAPlugin.servers must be a list of ranks, got {self.servers!r}")
            self.servers = tuple(plain_number(r) for r in self.servers)
        for f in _checked_fields():  # numpy numbers (np.int64(2) from a computed size) as Python's
            setattr(self, f.name, plain_number(getattr(self, f.name)))
        _validate({f.name: getattr(self, f.name) for f in _checked_fields()}, source="DistCAPlugin")
        if not isinstance(self.file_settings, Mapping):
            raise ValueError(f"DistCAPlugin.file_settings must be a dict of settings (the distca: section), got "
                             f"{self.file_settings!r}")
        self.file_settings = dict(self.file_settings)
        _validate(self.file_settings, source="DistCAPlugin.file_settings", names=SETTINGS)  # (settings only)
        config = self.resolved()  # an invalid DISTCA_* variable fails here, naming the variable
        if isinstance(config.time_model, (str, os.PathLike)):  # the planner's checks now, not at the first plan
            from ..planning import TimeModel

            try:
                TimeModel.load(config.time_model)
            except ValueError as e:
                raise ValueError(f"DistCAPlugin: the time_model setting's file is not a valid time model: {e}") from None
        self.parallel_sizes()  # a refused or conflicting ParallelismConfig fails here, naming both sides
        self._check_pipeline_settings(config)
        self._check_ignored_settings(config)

    def _said(self, name: str) -> str | None:
        """Where the setting ``name`` is said, as a warning names it: ``name`` in code (this plugin's field)
        or in its file section, its ``DISTCA_*`` variable in the environment (a variable left set in a
        shell); ``None`` when nowhere."""
        if getattr(self, name) is not None or name in self.file_settings:
            return name
        variable = SETTINGS[name].metadata["env"]
        return variable if variable in os.environ else None

    def _check_ignored_settings(self, config: DistCAConfig) -> None:
        """Settings said in code or the file that the other settings make do nothing are warned about, as
        pipeline settings without stages: planner settings said with ``mode="colocated"`` (in code, or in
        the file), which plans nothing (every rank computes its own documents), and ``memory_budget``
        under ``backward="resend"``, which keeps nothing on servers for backward."""
        # (the mode and the planner settings said in one place: a file's settings may serve both modes,
        # as a comparison's colocated half reads the recipe the distca half plans with)
        in_code = [name for name in PLANNER_ONLY_SETTINGS if getattr(self, name) is not None]
        in_file = [name for name in PLANNER_ONLY_SETTINGS if name in self.file_settings]
        said = in_code if self.mode == "colocated" else in_file if self.file_settings.get("mode") == "colocated" else []
        if config.mode == "colocated" and said:
            warnings.warn(f"DistCAPlugin: {', '.join(said)} set but mode='colocated' plans nothing (every rank "
                          f"computes its own documents), so {'they are' if len(said) > 1 else 'it is'} ignored; "
                          "set mode='distca' to balance attention", stacklevel=4)
        elif config.backward == "resend" and self._said("memory_budget") and config.memory_budget is not None:
            warnings.warn(f"DistCAPlugin: memory_budget={config.memory_budget} set but backward='resend' keeps nothing "
                          "on servers for backward, so it is ignored; it bounds backward='saved'", stacklevel=4)

    def _check_pipeline_settings(self, config: DistCAConfig) -> None:
        """Pipeline settings said in code, the file or the environment (``DISTCA_PIPELINE_*``) without
        stages do nothing (a warning: one file may serve runs with and without stages); with stages, too
        few micro-batches for the schedule are refused here rather than at the first step."""
        said = [where for where in map(self._said, ("pipeline_schedule", "pipeline_micro_batches")) if where]
        if self.pipeline_parallel_size == 1 and said:
            warnings.warn(f"DistCAPlugin: {' and '.join(said)} set but pipeline_parallel_size is 1, so no pipeline "
                          f"runs and {'they are' if len(said) > 1 else 'it is'} ignored; set pipeline_parallel_size > 1 "
                          "to train in stages", stacklevel=4)
        if self.pipeline_parallel_size > 1 and config.pipeline_schedule == "cad_1f1b":
            self._check_cad_1f1b_settings(config)
        if self.pipeline_parallel_size > 1 and config.pipeline_micro_batches is not None:
            from ..runtime.pipeline_schedules import check_micro_batches  # torch's pipelining: only with stages

            try:
                check_micro_batches(config.pipeline_schedule, config.pipeline_micro_batches,
                                    self.pipeline_parallel_size, setting="pipeline_micro_batches")
            except ValueError as e:
                raise ValueError(f"DistCAPlugin(pipeline_parallel_size={self.pipeline_parallel_size}): {e}") from None

    def _check_cad_1f1b_settings(self, config: DistCAConfig) -> None:
        """``cad_1f1b`` pools every tick's CA-tasks over all data-parallel x pipeline ranks: settings that
        choose servers inside one stage's group cannot apply (refused here, not at the first step, after
        the model is split and the data packed), and ping-pong runs as ``wave`` (said here)."""
        where = f"DistCAPlugin(pipeline_parallel_size={self.pipeline_parallel_size}, pipeline_schedule='cad_1f1b')"
        problem = cad_1f1b_servers_problem(config.servers)
        if problem:
            raise ValueError(f"{where}: {problem}")
        if self.server_group != "data_parallel":
            raise ValueError(f"{where}: cad_1f1b pools CA-tasks over every data-parallel x pipeline rank, so "
                             f"server_group={self.server_group!r} does not apply: leave server_group at "
                             "'data_parallel', or use pipeline_schedule='1f1b'")
        if config.overlap == "pingpong":
            warn_once("cad_1f1b-pingpong", PINGPONG_AS_WAVE, stacklevel=6)

    # -- construction from HF's ways of saying the topology ---------------------------------------

    @classmethod
    def from_parallelism_config(cls, parallelism_config, **overrides) -> "DistCAPlugin":
        """The plugin of a job laid out by accelerate's ``ParallelismConfig``: ``dp_replicate_size x
        dp_shard_size`` ranks of data parallelism (replicated or sharded, they serve attention alike) and
        ``tp_size`` of tensor parallelism; ``cp_size > 1`` / ``sp_size > 1`` are refused (distca's
        ``span_ranks`` replaces context and sequence parallelism for packed documents). Keyword arguments
        set the other fields; a topology size given here too must agree with the config."""
        return cls(parallelism_config=parallelism_config, **overrides)

    def with_parallelism(self, parallelism_config=None, *, source: str = "the Accelerator") -> "DistCAPlugin":
        """This plugin with ``parallelism_config`` when it has none of its own (what ``DistCAAccelerator``
        and ``DistCATrainer`` do with the Accelerator's); a config of its own must agree with it."""
        if parallelism_config is None or parallelism_config is self.parallelism_config:
            return self
        theirs = _sizes_of_parallelism_config(parallelism_config, f"the ParallelismConfig of {source}")
        _check_agree(self._own_sizes(), theirs)
        if self.parallelism_config is not None:
            _check_agree(_sizes_of_parallelism_config(self.parallelism_config, "DistCAPlugin.parallelism_config"),
                         theirs)
            return self
        # this plugin with the config, checked as __post_init__ checks it; the rest was checked (and its
        # warnings said) when this plugin was made, and a ParallelismConfig changes none of it
        joined = copy.copy(self)
        joined.parallelism_config, joined.file_settings = parallelism_config, dict(self.file_settings)
        joined.parallel_sizes()
        return joined

    # -- construction from files ------------------------------------------------------------------

    @classmethod
    def from_accelerate_config(cls, path: str | os.PathLike, **overrides) -> "DistCAPlugin":
        """The plugin described by the ``distca:`` section of the YAML file at ``path`` (an
        Accelerate config or any YAML file). Keyword arguments override the file, like code
        always does; environment variables override the file too. A file without the section gives
        the defaults."""
        section = read_distca_section(path)
        topology = {k: section.pop(k) for k in list(section) if k not in SETTINGS}
        return cls(**{**topology, **overrides}, file_settings=section)

    @classmethod
    def from_environment(cls, **overrides) -> "DistCAPlugin":
        """The plugin of this job: the ``distca:`` section of the file named by ``DISTCA_CONFIG_FILE``
        (set by ``distca-hf launch``) when there is one, else the defaults; ``DISTCA_*`` variables
        and ``overrides`` apply on top as usual."""
        path = os.environ.get("DISTCA_CONFIG_FILE")
        return cls.from_accelerate_config(path, **overrides) if path else cls(**overrides)

    # -- resolution -------------------------------------------------------------------------------

    def code_settings(self) -> dict:
        """The settings this plugin sets in code (its fields that are not ``None``; ``"none"`` stands for a
        setting's own ``None``, ``config.stands_for_none``: ``memory_budget="none"`` is unbounded)."""
        return {name: None if stands_for_none(name, value) else value for name in SETTINGS
                if (value := getattr(self, name)) is not None}

    def resolved(self) -> DistCAConfig:
        """The settings this plugin puts in force (code > environment > file > defaults)."""
        return resolve(self.code_settings(), self.file_settings)

    def parallel_sizes(self, model=None) -> "ParallelSizes":
        """The data- and tensor-parallel sizes this plugin's sources say (``None``: not said), checked to
        agree: the plugin's own fields, its ``parallelism_config`` and, given a transformers ``model``,
        the tensor-parallel (and data-parallel) size transformers sharded it with."""
        said = [self._own_sizes()]
        if self.parallelism_config is not None:
            said.append(_sizes_of_parallelism_config(self.parallelism_config, "DistCAPlugin.parallelism_config"))
        if model is not None:
            sizes = model_parallel_sizes(model)
            name = type(model).__name__
            said.append(_Said(sizes.data_parallel, sizes.tensor_parallel,
                              f"the model's DistributedConfig dp_replicate_size x fsdp_size ({name})",
                              f"the model's tensor-parallel size ({name}.tp_size)"))
        for other in said[1:]:
            _check_agree(said[0], other)
            said[0] = _Said(_first(said[0].data, other.data), _first(said[0].tensor, other.tensor),
                            said[0].data_source if said[0].data is not None else other.data_source,
                            said[0].tensor_source if said[0].tensor is not None else other.tensor_source)
        if self.pipeline_parallel_size > 1 and (said[0].tensor or 1) > 1:  # (the runner refuses it too)
            raise ValueError(
                f"pipeline_parallel_size={self.pipeline_parallel_size} with tensor_parallel_size={said[0].tensor} "
                f"(from {said[0].tensor_source}) is not supported: a pipeline stage runs whole layers on one rank. "
                "Use tensor_parallel_size=1 (give those ranks to data parallelism) or pipeline_parallel_size=1")
        return ParallelSizes(said[0].data, said[0].tensor)

    def _own_sizes(self) -> "_Said":
        return _Said(self.data_parallel_size, self.tensor_parallel_size, "DistCAPlugin.data_parallel_size",
                     "DistCAPlugin.tensor_parallel_size")

    def topology(self, world_size: int, ranks_per_node: int | None = None, *, model=None) -> ParallelTopology:
        """The job's topology on ``world_size`` ranks (see ``parallel_sizes`` for where the sizes come from)."""
        sizes = self.parallel_sizes(model)
        return ParallelTopology(world_size, sizes.data_parallel, self.pipeline_parallel_size,
                                sizes.tensor_parallel if sizes.tensor_parallel is not None else 1, ranks_per_node)

    # -- applying ---------------------------------------------------------------------------------

    def attach(self, *, model=None) -> DistCAGroups:
        """Build this rank's attention-server group and put the settings in force process-wide
        (``distca_hf.current_config()``). Under ``torch.distributed`` this is a collective (every
        rank must call it); without it, the world is this one process.

        Args:
            model: the HF model (unwrapped), when transformers sharded it with tensor parallelism
                (``distributed_config=DistributedConfig(tp_size=...)``): its tensor-parallel size sets
                ``tensor_parallel_size`` (a different size given elsewhere is an error naming both),
                and its tensor-parallel groups must be the topology's (tensor index fastest), or every
                rank raises.
        """
        import torch.distributed as dist

        distributed = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if distributed else 1
        rank = dist.get_rank() if distributed else 0
        local = os.environ.get("LOCAL_WORLD_SIZE")
        ranks_per_node = int(local) if local and local.isdigit() and int(local) > 0 and world % int(local) == 0 \
            else None
        if self.server_group == "node" and ranks_per_node is None:
            if local:  # (read as one node of the whole world before)
                raise ValueError(f"server_group='node' needs LOCAL_WORLD_SIZE to be the processes per node, a divisor "
                                 f"of the world size {world}; got LOCAL_WORLD_SIZE={local!r}")
            if world > 1:
                warn_once("node_without_local_world_size",
                          f"server_group='node': LOCAL_WORLD_SIZE is not set (torchrun and accelerate launch set it; "
                          f"under SLURM's srun export LOCAL_WORLD_SIZE=$SLURM_NTASKS_PER_NODE), so the {world} ranks "
                          "are taken for one node")
            ranks_per_node = world  # no launcher information: one node
        topology = self.topology(world, ranks_per_node, model=model)
        if distributed and model is not None:
            _check_model_tensor_groups(model, topology, rank)
        groups = topology.server_groups(self.server_group)
        ranks = topology.group_of(rank, groups)
        config = self.resolved()
        # checked against the smallest group, which every rank computes alike: all ranks raise together
        smallest = min(groups, key=len)
        if config.servers is not None and max(config.servers) >= len(smallest):
            raise ValueError(
                f"DistCAPlugin.servers={config.servers} names server indices up to {max(config.servers)}, but the "
                f"attention-server group {smallest} has {len(smallest)} rank(s) (world size {world}, "
                f"server_group={self.server_group!r}); servers are indices into every group, so each must be < "
                f"{len(smallest)}"
            )
        group, ranks = build_server_group(topology, rank, self.server_group) if distributed else (None, ranks)
        self._warn_dropped_settings()
        reset_config()  # the plugin describes the whole job: no setting of an earlier configure() lingers
        apply_file_settings(self.file_settings)
        config = configure(**self.code_settings(), group=group)
        STATE.plugin_settings = dict(STATE.code_settings)
        return DistCAGroups(topology, rank, tuple(ranks), group, config)

    def _warn_dropped_settings(self) -> None:
        """Warn about settings made with ``distca_hf.configure`` (not by an earlier attach) that
        attaching drops because this plugin does not set them itself (silently before)."""
        mine = self.code_settings()
        missing = object()
        dropped = {name: value for name, value in STATE.code_settings.items()
                   if name != "group" and name not in mine and STATE.plugin_settings.get(name, missing) != value}
        if dropped:
            said = ", ".join(f"{name}={value!r}" for name, value in sorted(dropped.items()))
            warnings.warn(f"DistCAPlugin: the settings made earlier with distca_hf.configure() ({said}) are dropped: "
                          "the plugin describes the whole job; give them to the plugin (DistCAPlugin("
                          f"{', '.join(sorted(dropped))}=...), DistCAArguments' flags or the distca: section), or "
                          "call configure() after the trainer or accelerator is made", stacklevel=3)


@dataclass(frozen=True)
class ParallelSizes:
    """Parallel sizes a job's sources state (``None``: none of them says).

    Attributes:
        data_parallel: ranks holding different data (``None``: world / (pipeline x tensor)).
        tensor_parallel: ranks splitting each layer's heads (``None``: 1).
    """

    data_parallel: int | None
    tensor_parallel: int | None


@dataclass(frozen=True)
class _Said:
    """What one source says about the sizes, and how to name it in an error."""

    data: int | None
    tensor: int | None
    data_source: str
    tensor_source: str


def _first(a, b):
    return a if a is not None else b


def _check_agree(a: _Said, b: _Said) -> None:
    for kind, size_a, size_b, source_a, source_b in (("data", a.data, b.data, a.data_source, b.data_source),
                                                    ("tensor", a.tensor, b.tensor, a.tensor_source, b.tensor_source)):
        if size_a is not None and size_b is not None and size_a != size_b:
            raise ValueError(
                f"the {kind}-parallel size is given two ways that disagree: {source_a} = {size_a}, but "
                f"{source_b} = {size_b}. Give it once (leave DistCAPlugin's field at None to take it from "
                "accelerate's ParallelismConfig or the model) or make them equal")


def _sizes_of_parallelism_config(config, name: str) -> _Said:
    """The sizes an accelerate ``ParallelismConfig`` states; context / sequence parallelism refused."""
    sizes, attributes = {}, ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size")
    if not any(hasattr(config, attribute) for attribute in attributes):  # (5 or object() read as all sizes 1)
        raise ValueError(f"{name} must be an accelerate ParallelismConfig (with {', '.join(attributes[:3])}, ...), "
                         f"got {config!r}")
    for attribute in attributes:
        value = getattr(config, attribute, 1)
        value = 1 if value is None else value
        if not (is_integer(value) and value >= 1):
            raise ValueError(f"{name}.{attribute} must be an integer >= 1 (an accelerate ParallelismConfig), got "
                             f"{value!r} from {type(config).__name__}")
        sizes[attribute] = int(value)
    for attribute, what in (("cp_size", "context parallelism (ring attention over a sequence cut into pieces)"),
                            ("sp_size", "sequence parallelism (DeepSpeed ALST/Ulysses)")):
        if sizes[attribute] > 1:
            raise ValueError(
                f"{name} has {attribute}={sizes[attribute]}: {what} is not combined with distca. For packed "
                "documents distca's span_ranks replaces it, exactly and balanced: the ranks of an attention-server "
                "group hold consecutive pieces of one token stream, a long document's pieces attend to their whole "
                "prefix wherever it lives, and the planner balances the attention over the ranks. Set "
                f"{attribute}=1 (give those ranks to data parallelism: dp_shard_size x {sizes[attribute]}) and turn "
                "span_ranks on: DistCAPlugin(span_ranks=True), DISTCA_SPAN_RANKS=1 or span_ranks: true in the "
                "distca: section (DistCATrainer turns it on itself when the server group has more than one rank)")
    if sizes["dp_replicate_size"] * sizes["dp_shard_size"] * sizes["tp_size"] == 1:
        # accelerate's default config: it fills dp_replicate_size with the world size when validated
        return _Said(None, None, name, name)
    return _Said(sizes["dp_replicate_size"] * sizes["dp_shard_size"], sizes["tp_size"],
                 f"{name} dp_replicate_size x dp_shard_size ({sizes['dp_replicate_size']} x {sizes['dp_shard_size']})",
                 f"{name}.tp_size")


def model_parallel_sizes(model) -> ParallelSizes:
    """The tensor- (and data-) parallel sizes transformers sharded ``model`` with (an unwrapped HF model):
    ``model.tp_size`` (transformers 5: ``_tp_size``, set by ``from_pretrained(distributed_config=...)``),
    else ``config.distributed_config``; ``None`` where the model was not sharded that way."""
    distributed_config = getattr(getattr(model, "config", None), "distributed_config", None)

    def read(attribute):
        if isinstance(distributed_config, dict):
            return distributed_config.get(attribute)
        return getattr(distributed_config, attribute, None)

    tensor = getattr(model, "tp_size", None)
    if not isinstance(tensor, int) or isinstance(tensor, bool):
        tensor = getattr(model, "_tp_size", None)
    if not isinstance(tensor, int) or isinstance(tensor, bool):
        tensor = read("tp_size")
    data = None
    if distributed_config is not None and getattr(model, "_device_mesh", None) is not None:
        # sharded at load time: the mesh is pp x dp_replicate x fsdp x tp and must cover the world
        replicate, shard = read("dp_replicate_size") or 1, read("fsdp_size") or 1
        data = replicate * shard
    tensor = tensor if isinstance(tensor, int) and not isinstance(tensor, bool) else None
    return ParallelSizes(data, tensor)


def _check_model_tensor_groups(model, topology: ParallelTopology, rank: int) -> None:
    """Every rank raises together when the model's tensor-parallel mesh groups other ranks than the
    topology (a rank would exchange CA-tasks with ranks holding other heads)."""
    import torch
    import torch.distributed as dist

    mesh = getattr(model, "_device_mesh", None)
    names = getattr(mesh, "mesh_dim_names", None) or ()
    if "tp" not in names:
        return
    theirs = sorted(int(r) for r in mesh["tp"].mesh.flatten().tolist())
    mine = topology.group_of(rank, topology.tensor_parallel_groups())
    wrong = torch.tensor([int(theirs != mine)])
    dist.all_reduce(wrong, op=dist.ReduceOp.MAX)
    if wrong.item():
        raise ValueError(
            f"the model's tensor-parallel groups are not distca's: on rank {rank} the model's device mesh groups "
            f"ranks {theirs}, the topology (tensor index fastest, then data, then pipeline) groups {mine}"
            + ("" if theirs != mine else " (another rank differs)")
            + ". Build the mesh with tp as its last (fastest) dimension, as transformers' DistributedConfig and "
              "accelerate's ParallelismConfig do")


def _checked_fields():
    """The plugin's fields that carry a check: every setting and the topology fields."""
    return [f for f in fields(DistCAPlugin) if "check" in f.metadata]


def _document(cls) -> str:
    lines = [cls.__doc__.rstrip(), "", "    Attributes:"]
    for f in fields(cls):
        env = f.metadata.get("env")
        lines.append(f"        {f.name}: {f.metadata['help']}" + (f" (``{env}``)" if env else "") + ".")
    return "\n".join(lines) + "\n"


DistCAPlugin.__doc__ = _document(DistCAPlugin)


PLANNER_ONLY_SETTINGS = ("tolerance", "servers", "memory_budget", "kv_cap", "kv_relays", "time_model")
"""The settings only the planner reads: ``mode="colocated"`` ignores them (``DistCAPlugin`` warns)."""


def load_config_yaml(path: str | os.PathLike):
    """The YAML document of a config file (``yaml.safe_load``'s), refusing a key given twice in one
    mapping: YAML keeps the last one, so a setting written twice would silently lose the first."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # (a merge key "<<" may be overridden; safe_load refuses unhashable keys itself)
                key = self.construct_object(key_node)
                line = key_node.start_mark.line + 1
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} is given twice (lines {seen[key]} and {line}); keep one",
                        key_node.start_mark)
                seen[key] = line
            return super().construct_mapping(node, deep)

    with open(path, encoding="utf-8") as f:
        try:
            return yaml.load(f, Loader=UniqueKeyLoader)
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: not valid YAML: {e}") from None
        except RecursionError:
            raise ValueError(f"{path}: not a config file (YAML nested too deeply)") from None


def read_distca_section(path: str | os.PathLike) -> dict:
    """The ``distca:`` mapping of a YAML file (empty when absent), with its keys checked."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"distca config file {str(path)!r} is a folder; name the YAML file in it")
    if not path.is_file():
        raise FileNotFoundError(f"distca config file {str(path)!r} does not exist")
    document = load_config_yaml(path)
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise ValueError(f"{path}: expected a YAML mapping at the top level, got {type(document).__name__}")
    section = document.get("distca")
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise ValueError(f"{path}: the distca: section must be a mapping of settings, got {section!r}")
    allowed = {f.name for f in fields(DistCAPlugin)} - {"file_settings", "parallelism_config"}
    unknown = sorted(set(section) - allowed)
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {unknown} in the distca: section; expected some of {sorted(allowed)}")
    section = dict(section)
    if section.get("servers") is not None:
        if not isinstance(section["servers"], list):
            raise ValueError(f"{path}: distca.servers must be a list of ranks, got {section['servers']!r}")
        section["servers"] = tuple(section["servers"])
    for name, value in section.items():
        if name not in SETTINGS:
            continue
        if isinstance(value, bool) and setting_problem(name, value):  # YAML 1.1 reads unquoted off / on as bools
            value = "on" if value else "off"
        if isinstance(value, str):  # words as their DISTCA_* variable spells them (AUTO, None, off, 1e-1)
            try:
                section[name] = read_setting_text(name, value)
            except ValueError as e:
                raise ValueError(f"{path}: distca.{name} {e}") from None
    _validate(section, source=f"{path}: distca")
    return section


def _validate(values: dict, source: str, *, names=None) -> None:
    """Check each value with its field's check; the message names it (``source.name``). ``None``
    means "not set" for a setting. ``names``: the fields ``values`` may hold (default: every checked
    field); others are refused together, a plugin field given where only settings go named as such
    (a ``TypeError`` later, before)."""
    checks = {f.name: f for f in _checked_fields() if names is None or f.name in names}
    unknown = sorted((name for name in values if name not in checks), key=str)
    if unknown:
        fields_given = [name for name in unknown if name in {f.name for f in _checked_fields()}]
        hint = (f"; {fields_given} are DistCAPlugin fields: pass them as keyword arguments (from_accelerate_config "
                "does so for a file's)") if fields_given else ""
        raise ValueError(f"{source}: unknown setting(s) {unknown}; expected some of {sorted(checks)}{hint}")
    for name, value in values.items():
        if (value is None or stands_for_none(name, value)) and checks[name].metadata.get("setting"):
            continue
        problem = checks[name].metadata["check"](value)
        if problem:
            raise ValueError(f"{source}.{name} {problem}")
