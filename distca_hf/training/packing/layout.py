"""Which rank trains which row of which global batch (``RankLayout``): server groups, dataset
indices, blocks."""

from __future__ import annotations

from dataclasses import dataclass, field

from .rows import MAX_RANKS, check_integer


@dataclass(frozen=True)
class RankLayout:
    """Which rank trains which row of which global batch.

    Attributes:
        server_groups: the attention-server groups, a partition of ranks ``0 .. world_size - 1``
            into groups of equal size, each in rank order. The ranks of a group hold consecutive
            slices of one global batch; per-rank packing is groups of one rank.
        span_ranks: whether documents span the ranks of a group (``False``: groups of one rank).

    Dataset index ``i`` is rank ``i % world_size``'s; block ``b = i // world_size`` holds global
    batches ``b * num_groups + k``, the ``k``-th server group's.
    """

    server_groups: tuple
    span_ranks: bool
    _slots: dict = field(init=False, repr=False, compare=False)

    @classmethod
    def for_ranks(cls, world_size: int, *, span_ranks: bool = False, server_groups=None) -> "RankLayout":
        """The layout of ``world_size`` ranks. With ``span_ranks``, ``server_groups`` (lists of global
        ranks) default to one group of every rank; without it each rank is its own group (and
        ``server_groups`` is refused: it was ignored)."""
        world_size = check_integer("world_size", world_size, 1, " (ranks)", maximum=MAX_RANKS)
        if not isinstance(span_ranks, bool):
            raise ValueError(f"span_ranks must be True or False, got {span_ranks!r}")
        if not span_ranks and server_groups is not None:
            raise ValueError(f"server_groups={server_groups!r} needs span_ranks=True: without it every rank packs its "
                             "own rows and no group shares a global batch; drop server_groups or set span_ranks=True")
        if not span_ranks:
            return cls(tuple((rank,) for rank in range(world_size)), False)
        if server_groups is None:
            return cls((tuple(range(world_size)),), True)
        try:
            if isinstance(server_groups, (str, bytes)) or any(isinstance(g, (str, bytes)) for g in server_groups):
                raise TypeError  # "01" would read as groups [0] and [1]
            groups = tuple(tuple(sorted(check_integer("rank", rank, 0) for rank in group)) for group in server_groups)
        except (TypeError, ValueError):
            raise ValueError(f"server_groups must be lists of ranks (integers >= 0), got {server_groups!r}") from None
        ranks = sorted(rank for group in groups for rank in group)
        if ranks != list(range(world_size)):
            raise ValueError(f"server_groups must hold every rank 0 .. {world_size - 1} exactly once (world_size "
                             f"{world_size}), got {server_groups!r}")
        if len({len(group) for group in groups}) != 1:
            raise ValueError(f"server_groups must all have the same number of ranks (each shares a global batch of "
                             f"that many rows), got sizes {[len(g) for g in groups]}")
        return cls(groups, True)

    def __post_init__(self):
        slots = {rank: (k, j) for k, group in enumerate(self.server_groups) for j, rank in enumerate(group)}
        object.__setattr__(self, "_slots", slots)

    @property
    def world_size(self) -> int:
        return len(self._slots)

    @property
    def group_size(self) -> int:
        return len(self.server_groups[0])

    @property
    def num_groups(self) -> int:
        return len(self.server_groups)

    def slot(self, rank: int) -> tuple[int, int]:
        """``(group index, position in the group)`` of ``rank``."""
        return self._slots[rank]

    def locate(self, index: int) -> tuple[int, int]:
        """``(global batch, slice)`` of dataset index ``index``."""
        block, rank = divmod(index, self.world_size)
        group, position = self._slots[rank]
        return block * self.num_groups + group, position

    def blocks(self, global_batches: int) -> int:
        """Blocks of ``world_size`` items holding ``global_batches`` (the last padded with fillers)."""
        return -(-global_batches // self.num_groups)
