"""``DistCAPlugin``: every distca setting of a training job in one validated dataclass.

Settings come from three places; for each one the first that sets it wins:

1. code: ``DistCAPlugin(tolerance=0.05, ...)`` (a field left at ``None`` is not set);
2. the environment: ``DISTCA_TOLERANCE``, ``DISTCA_BACKWARD``, ``DISTCA_OVERLAP``, ``DISTCA_TIMEOUT_S``
   (contract; an invalid value is an error naming the variable);
3. a ``distca:`` section of a YAML file, e.g. an Accelerate config:
   ``DistCAPlugin.from_accelerate_config("my-config.yaml")``;

and otherwise the defaults of ``distca_hf.DistCAConfig``. ``attach()`` builds the attention-server
process group and applies the settings process-wide with ``distca_hf.configure``; ``DistCATrainer``
and ``DistCAAccelerator`` call it for you.

Note: ``accelerate launch`` (1.x) refuses config files with keys it does not know, so a file
given to ``accelerate launch --config_file`` cannot carry the ``distca:`` section: launch with
``distca-hf launch`` (same arguments; it strips and checks the section and every process reads it
with ``DistCAPlugin.from_environment()``), or keep the section in a second file
(``recipes/distca.yaml``), or use the environment variables on the launch line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path

from .config import _ENV, DistCAConfig, configure, reset_config, setting_problem
from .topology import SERVER_SCOPES, ParallelTopology, build_server_group

__all__ = ["DistCAPlugin", "DistCAGroups", "read_distca_section"]

# Plugin fields that map one-to-one onto distca_hf.configure(...) settings.
_CONFIG_FIELDS = ("tolerance", "block", "overlap", "backward", "timeout_s", "mode", "servers")


@dataclass(frozen=True)
class DistCAGroups:
    """What ``DistCAPlugin.attach`` built for this rank.

    Attributes:
        topology: the data x pipeline x tensor layout of the job.
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


@dataclass
class DistCAPlugin:
    """Core Attention Disaggregation settings for a training job.

    Attributes:
        tolerance: allowed max/mean - 1 of attention load over servers (``DISTCA_TOLERANCE``;
            default 0.02). Smaller balances more tightly and moves more bytes.
        block: shard block in tokens: CA-task cuts are multiples of it (128 suits flash-attn; default 1).
        overlap: communication overlap, ``"none"``, ``"wave"`` or ``"pingpong"`` (``DISTCA_OVERLAP``).
        backward: ``"saved"`` (servers keep what backward needs) or ``"resend"`` (servers keep
            nothing; sources resend q, k, v, out in backward) (``DISTCA_BACKWARD``).
        timeout_s: seconds a distca collective may wait for a peer before raising
            ``DistCATimeoutError`` (``DISTCA_TIMEOUT_S``; default 600).
        mode: ``"distca"`` redistributes attention; ``"colocated"`` computes each rank's own
            documents with the same kernel and no communication (a baseline).
        server_group: which ranks exchange CA-tasks: ``"data_parallel"`` (the data-parallel group;
            with tensor parallelism, the ranks sharing a tensor-parallel index) or ``"node"`` (its
            ranks on one node, keeping attention traffic on intra-node links).
        servers: indices, within the server group, of the ranks that serve attention (``None``: all).
        data_parallel_size: ``None``: world size / (pipeline x tensor).
        pipeline_parallel_size: pipeline stages (groups are modelled; pipeline execution is later).
        tensor_parallel_size: tensor-parallel size.
        file_settings: settings read from a YAML ``distca:`` section (below the environment in
            precedence); filled by ``from_accelerate_config``.
    """

    tolerance: float | None = None
    block: int | None = None
    overlap: str | None = None
    backward: str | None = None
    timeout_s: float | None = None
    mode: str | None = None
    server_group: str = "data_parallel"
    servers: tuple[int, ...] | None = None
    data_parallel_size: int | None = None
    pipeline_parallel_size: int = 1
    tensor_parallel_size: int = 1
    file_settings: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.servers is not None:
            if isinstance(self.servers, (str, bytes)) or not hasattr(self.servers, "__iter__"):
                raise ValueError(f"DistCAPlugin.servers must be a list of ranks, got {self.servers!r}")
            self.servers = tuple(self.servers)
        _validate(self._code_settings(), source="DistCAPlugin")
        _validate_layout(self.server_group, self.data_parallel_size, self.pipeline_parallel_size,
                         self.tensor_parallel_size, source="DistCAPlugin")
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
        layout = {k: section.pop(k) for k in list(section) if k not in _CONFIG_FIELDS}
        return cls(**{**layout, **overrides}, file_settings=section)

    @classmethod
    def from_environment(cls, **overrides) -> "DistCAPlugin":
        """The plugin of this job: the ``distca:`` section of the file named by ``DISTCA_CONFIG_FILE``
        (set by ``distca-hf launch``) when there is one, else the defaults; ``DISTCA_*`` variables
        and ``overrides`` apply on top as usual."""
        path = os.environ.get("DISTCA_CONFIG_FILE")
        return cls.from_accelerate_config(path, **overrides) if path else cls(**overrides)

    # -- resolution -------------------------------------------------------------------------------

    def _code_settings(self) -> dict:
        return {name: getattr(self, name) for name in _CONFIG_FIELDS if getattr(self, name) is not None}

    def configure_settings(self) -> dict:
        """What ``attach`` passes to ``distca_hf.configure``: settings made in code, and settings
        from the file that no environment variable overrides (``configure`` beats the environment,
        so file values the environment sets are left out)."""
        from_file = {name: value for name, value in self.file_settings.items()
                     if name not in _ENV or _ENV[name][0] not in os.environ}
        return {**from_file, **self._code_settings()}

    def resolved(self) -> DistCAConfig:
        """The settings this plugin puts in force (code > environment > file > defaults)."""
        from .config import _resolve

        return _resolve(self.configure_settings())

    def topology(self, world_size: int, ranks_per_node: int | None = None) -> ParallelTopology:
        return ParallelTopology(world_size, self.data_parallel_size, self.pipeline_parallel_size,
                                self.tensor_parallel_size, ranks_per_node)

    # -- applying ---------------------------------------------------------------------------------

    def attach(self) -> DistCAGroups:
        """Build this rank's attention-server group and apply the settings with
        ``distca_hf.configure``. Under ``torch.distributed`` this is a collective (every rank must
        call it); without it, the world is this one process."""
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
        config = configure(**self.configure_settings(), group=group)
        return DistCAGroups(topology, rank, tuple(ranks), group, config)


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
    try:
        _validate({k: v for k, v in section.items() if k in _CONFIG_FIELDS}, source=f"{path}: distca")
    except ValueError as e:
        raise ValueError(str(e)) from None
    return section


def _validate(settings: dict, source: str) -> None:
    """Check each setting with a message naming it (``source.name``)."""
    for name, value in settings.items():
        if name in ("server_group", "data_parallel_size", "pipeline_parallel_size", "tensor_parallel_size"):
            continue  # checked with the layout
        if name not in _CONFIG_FIELDS:
            raise ValueError(f"{source}.{name}: unknown setting")
        problem = setting_problem(name, value)
        if problem:
            raise ValueError(f"{source}.{name} {problem}")


def _validate_layout(server_group, dp, pp, tp, source: str) -> None:
    if server_group not in SERVER_SCOPES:
        raise ValueError(f"{source}.server_group must be one of {list(SERVER_SCOPES)}, got {server_group!r}")
    for name, value, optional in (("data_parallel_size", dp, True), ("pipeline_parallel_size", pp, False),
                                  ("tensor_parallel_size", tp, False)):
        if value is None and optional:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{source}.{name} must be an integer >= 1, got {value!r}")
