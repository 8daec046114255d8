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

Note: ``accelerate launch`` (1.x) refuses config files with keys it does not know, so a file
given to ``accelerate launch --config_file`` cannot carry the ``distca:`` section: launch with
``distca-hf launch`` (same arguments; it strips and checks the section and every process reads it
with ``DistCAPlugin.from_environment()``), or keep the section in a second file
(``recipes/distca.yaml``), or use the environment variables on the launch line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, make_dataclass
from pathlib import Path

from ..config import SETTINGS, DistCAConfig, apply_file_settings, configure, reset_config, resolve
from .topology import SERVER_SCOPES, ParallelTopology, build_server_group

__all__ = ["DistCAPlugin", "DistCAGroups", "read_distca_section"]


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
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
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
        None, check=_positive_int_problem(optional=True), help="None: world size / (pipeline x tensor)")
    pipeline_parallel_size: int = _topology_field(
        1, check=_positive_int_problem(optional=False),
        help="pipeline stages (the groups are modelled; pipeline execution is not implemented)")
    tensor_parallel_size: int = _topology_field(1, check=_positive_int_problem(optional=False),
                                              help="tensor-parallel size")
    file_settings: dict = field(default_factory=dict, repr=False, metadata={
        "help": "settings read from a distca: YAML section (below the environment in precedence); filled by "
                "from_accelerate_config"})

    def __post_init__(self):
        if self.servers is not None:
            if isinstance(self.servers, (str, bytes)) or not hasattr(self.servers, "__iter__"):
                raise ValueError(f"DistCAPlugin.servers must be a list of ranks, got {self.servers!r}")
            self.servers = tuple(self.servers)
        _validate({f.name: getattr(self, f.name) for f in _checked_fields()}, source="DistCAPlugin")
        self.file_settings = dict(self.file_settings)
        _validate(self.file_settings, source="the distca: section")
        self.resolved()  # an invalid DISTCA_* variable fails here, naming the variable

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
        """The settings this plugin sets in code (its fields that are not ``None``)."""
        return {name: getattr(self, name) for name in SETTINGS if getattr(self, name) is not None}

    def resolved(self) -> DistCAConfig:
        """The settings this plugin puts in force (code > environment > file > defaults)."""
        return resolve(self.code_settings(), self.file_settings)

    def topology(self, world_size: int, ranks_per_node: int | None = None) -> ParallelTopology:
        return ParallelTopology(world_size, self.data_parallel_size, self.pipeline_parallel_size,
                                self.tensor_parallel_size, ranks_per_node)

    # -- applying ---------------------------------------------------------------------------------

    def attach(self) -> DistCAGroups:
        """Build this rank's attention-server group and put the settings in force process-wide
        (``distca_hf.current_config()``). Under ``torch.distributed`` this is a collective (every
        rank must call it); without it, the world is this one process."""
        import torch.distributed as dist

        distributed = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if distributed else 1
        rank = dist.get_rank() if distributed else 0
        local = os.environ.get("LOCAL_WORLD_SIZE")
        ranks_per_node = int(local) if local and local.isdigit() and world % int(local) == 0 else None
        if self.server_group == "node" and ranks_per_node is None:
            ranks_per_node = world  # no launcher information: one node
        topology = self.topology(world, ranks_per_node)
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
        reset_config()  # the plugin describes the whole job: no setting of an earlier configure() lingers
        apply_file_settings(self.file_settings)
        config = configure(**self.code_settings(), group=group)
        return DistCAGroups(topology, rank, tuple(ranks), group, config)


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


def read_distca_section(path: str | os.PathLike) -> dict:
    """The ``distca:`` mapping of a YAML file (empty when absent), with its keys checked."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"distca config file {str(path)!r} does not exist")
    with open(path, encoding="utf-8") as f:
        try:
            document = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: not valid YAML: {e}") from None
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise ValueError(f"{path}: expected a YAML mapping at the top level, got {type(document).__name__}")
    section = document.get("distca")
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise ValueError(f"{path}: the distca: section must be a mapping of settings, got {section!r}")
    allowed = {f.name for f in fields(DistCAPlugin)} - {"file_settings"}
    unknown = sorted(set(section) - allowed)
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {unknown} in the distca: section; expected some of {sorted(allowed)}")
    section = dict(section)
    if section.get("servers") is not None:
        if not isinstance(section["servers"], list):
            raise ValueError(f"{path}: distca.servers must be a list of ranks, got {section['servers']!r}")
        section["servers"] = tuple(section["servers"])
    _validate(section, source=f"{path}: distca")
    return section


def _validate(values: dict, source: str) -> None:
    """Check each value with its field's check; the message names it (``source.name``). ``None``
    means "not set" for a setting."""
    checks = {f.name: f for f in _checked_fields()}
    for name, value in values.items():
        if name not in checks:
            raise ValueError(f"{source}.{name}: unknown setting")
        if value is None and checks[name].metadata.get("setting"):
            continue
        problem = checks[name].metadata["check"](value)
        if problem:
            raise ValueError(f"{source}.{name} {problem}")
