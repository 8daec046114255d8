"""Process topology: data x pipeline x tensor parallel ranks, and which ranks serve attention together.

Ranks are laid out Megatron-style, tensor-parallel fastest, then data-parallel, then pipeline::

    rank = pipeline_index * (data * tensor) + data_index * tensor + tensor_index

so the ranks of a tensor-parallel group are neighbours (one node, fastest links) and a pipeline
stage is a contiguous block of ``data * tensor`` ranks.

The **attention-server group** of a rank is the set of ranks that exchange CA-tasks with it. They
must run the same attention layer at the same time on the same heads, so they share the pipeline
stage and the tensor-parallel index: the server group is the data-parallel group (with tensor
parallelism, the ranks sharing a tensor-parallel index). With ``scope="node"`` it is further cut
to the data-parallel ranks on one node, which keeps CA-task traffic off the inter-node network.

Everything here is pure Python except ``build_server_group``, which makes the
``torch.distributed`` groups (a collective: every rank must call it).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import is_integer, plain_number

__all__ = ["SERVER_SCOPES", "ParallelTopology", "build_server_group", "group_ranks"]

SERVER_SCOPES = ("data_parallel", "node")


@dataclass(frozen=True)
class ParallelTopology:
    """Sizes of the parallel dimensions of a job.

    Attributes:
        world_size: number of processes in the job.
        data_parallel: data-parallel size; ``None``: ``world_size / (pipeline * tensor)``.
        pipeline_parallel: pipeline stages (``training.pipeline`` runs them; here only their groups).
        tensor_parallel: tensor-parallel size.
        ranks_per_node: processes per node (``LOCAL_WORLD_SIZE``); needed for ``scope="node"``.
    """

    world_size: int
    data_parallel: int | None = None
    pipeline_parallel: int = 1
    tensor_parallel: int = 1
    ranks_per_node: int | None = None

    def __post_init__(self):
        for name in ("world_size", "data_parallel", "pipeline_parallel", "tensor_parallel", "ranks_per_node"):
            object.__setattr__(self, name, plain_number(getattr(self, name)))  # np.int64(4) is 4
        for name in ("world_size", "pipeline_parallel", "tensor_parallel"):
            value = getattr(self, name)
            if not is_integer(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        model_parallel = self.pipeline_parallel * self.tensor_parallel
        if self.data_parallel is None:
            if self.world_size % model_parallel:
                raise ValueError(
                    f"world size {self.world_size} is not divisible by pipeline_parallel x tensor_parallel = "
                    f"{self.pipeline_parallel} x {self.tensor_parallel} = {model_parallel}; launch a multiple of "
                    f"{model_parallel} processes or change the parallel sizes"
                )
            object.__setattr__(self, "data_parallel", self.world_size // model_parallel)
        dp = self.data_parallel
        if not is_integer(dp) or dp < 1:
            raise ValueError(f"data_parallel must be an integer >= 1, got {dp!r}")
        if dp * model_parallel != self.world_size:
            raise ValueError(
                f"data_parallel x pipeline_parallel x tensor_parallel = {dp} x {self.pipeline_parallel} x "
                f"{self.tensor_parallel} = {dp * model_parallel}, but the world size is {self.world_size}; the "
                "product must equal the number of processes"
            )
        if self.ranks_per_node is not None:
            if not is_integer(self.ranks_per_node) or self.ranks_per_node < 1:
                raise ValueError(f"ranks_per_node must be an integer >= 1, got {self.ranks_per_node!r}")
            if self.world_size % self.ranks_per_node:
                raise ValueError(f"world size {self.world_size} is not a multiple of ranks_per_node "
                                 f"{self.ranks_per_node} (every node must run the same number of processes)")

    # -- coordinates ---------------------------------------------------------------------------

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """``(data_index, pipeline_index, tensor_index)`` of ``rank``."""
        self._check_rank(rank)
        tp, dp = self.tensor_parallel, self.data_parallel
        return (rank // tp) % dp, rank // (dp * tp), rank % tp

    def rank_of(self, data_index: int, pipeline_index: int, tensor_index: int) -> int:
        return pipeline_index * self.data_parallel * self.tensor_parallel + data_index * self.tensor_parallel \
            + tensor_index

    # -- groups (each a sorted list of ranks; together they partition the world) -----------------

    def data_parallel_groups(self) -> list[list[int]]:
        """Ranks that hold the same model shard and different data: same pipeline and tensor index."""
        return [[self.rank_of(d, p, t) for d in range(self.data_parallel)]
                for p in range(self.pipeline_parallel) for t in range(self.tensor_parallel)]

    def tensor_parallel_groups(self) -> list[list[int]]:
        return [[self.rank_of(d, p, t) for t in range(self.tensor_parallel)]
                for p in range(self.pipeline_parallel) for d in range(self.data_parallel)]

    def pipeline_parallel_groups(self) -> list[list[int]]:
        """The stages one micro-batch flows through, first stage first."""
        return [[self.rank_of(d, p, t) for p in range(self.pipeline_parallel)]
                for d in range(self.data_parallel) for t in range(self.tensor_parallel)]

    def server_groups(self, scope: str = "data_parallel") -> list[list[int]]:
        """Attention-server groups: the data-parallel groups, or with ``scope="node"`` their parts
        that share a node."""
        if scope not in SERVER_SCOPES:
            raise ValueError(f"server group scope must be one of {SERVER_SCOPES}, got {scope!r}")
        groups = self.data_parallel_groups()
        if scope == "data_parallel":
            return groups
        if self.ranks_per_node is None:
            raise ValueError("server group scope 'node' needs ranks_per_node (LOCAL_WORLD_SIZE of the launcher)")
        split = []
        for group in groups:
            by_node: dict[int, list[int]] = {}
            for rank in group:
                by_node.setdefault(rank // self.ranks_per_node, []).append(rank)
            split.extend(by_node[node] for node in sorted(by_node))
        return split

    def group_of(self, rank: int, groups: list[list[int]]) -> list[int]:
        self._check_rank(rank)
        return next(g for g in groups if rank in g)

    def _check_rank(self, rank: int) -> None:
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an integer in [0, {self.world_size}), got {rank!r}")


def group_ranks(world_size: int, rank: int, data_parallel: int | None = None, pipeline_parallel: int = 1,
                tensor_parallel: int = 1, scope: str = "data_parallel", ranks_per_node: int | None = None) -> dict:
    """The groups ``rank`` belongs to, as lists of global ranks (a pure function, for a pipeline or
    tensor-parallel engine to build its communicators from): ``{"data": ..., "pipeline": ...,
    "tensor": ..., "server": ...}``; ``pipeline`` lists the stages first to last."""
    topology = ParallelTopology(world_size, data_parallel, pipeline_parallel, tensor_parallel, ranks_per_node)
    return {
        "data": topology.group_of(rank, topology.data_parallel_groups()),
        "pipeline": topology.group_of(rank, topology.pipeline_parallel_groups()),
        "tensor": topology.group_of(rank, topology.tensor_parallel_groups()),
        "server": topology.group_of(rank, topology.server_groups(scope)),
    }


def build_server_group(topology: ParallelTopology, rank: int, scope: str = "data_parallel"):
    """Create the attention-server process groups; returns ``(group, ranks)`` for ``rank``.

    ``torch.distributed.new_group`` is a collective over the whole world: every rank creates every
    group, in the same order, even those it is not in. When the server group is the whole world the
    default group is returned as ``None`` (no extra communicator).
    """
    import torch.distributed as dist

    from ..runtime.shutdown import close_at_exit

    groups = topology.server_groups(scope)
    mine = topology.group_of(rank, groups)
    if len(groups) == 1:
        return None, mine
    close_at_exit()  # the groups made here are destroyed before the interpreter shuts down
    handle = None
    for ranks in groups:
        group = dist.new_group(ranks=ranks)
        if rank in ranks:
            handle = group
    return handle, mine
