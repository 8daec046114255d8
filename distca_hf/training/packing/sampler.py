"""The order a ``PackedDataset`` is read in (``GlobalBatchSampler``): whole blocks of ``world_size``
items shuffled per epoch, so that the ranks of a server group read the same global batch in the same step.
"""

from __future__ import annotations

from typing import Iterator

import torch

from .rows import check_flag, check_integer, check_positive, check_seed


class GlobalBatchSampler(torch.utils.data.Sampler):
    """Indices of a ``PackedDataset`` in whole blocks of ``world_size`` items (one global batch per
    server group), the blocks shuffled per epoch, never the items inside them.

    Under Accelerate's sharding (batch size 1: rank ``r`` takes every ``world_size``-th index from
    ``r``) the ranks of a server group then read the slices of the same global batch in the same
    step, each its own. The order is a pure function of ``seed`` and the epoch (``set_epoch``), so a
    run resumed mid-epoch reads what the uninterrupted run read.

    Args:
        num_items: the dataset's length (a multiple of ``world_size``).
        world_size: ranks of the job.
        shuffle: shuffle the blocks (``False``: in order).
        seed: seed of the shuffle; epoch ``e`` uses ``seed + e``.
        step_blocks: consecutive blocks shuffled as one unit, in order (the micro-batches of one
            optimizer step packed together, ``PackingConfig.balance_micro_batches``).
    """

    def __init__(self, num_items: int, world_size: int, *, shuffle: bool = True, seed: int = 0,
                 step_blocks: int = 1):
        num_items = check_integer("num_items", num_items, 0)
        world_size = check_positive("world_size", world_size)
        step_blocks = check_positive("step_blocks", step_blocks)
        shuffle = check_flag("shuffle", shuffle)
        seed = check_seed(seed)
        if num_items % (world_size * step_blocks):
            raise ValueError(f"num_items ({num_items}) must be a multiple of world_size x step_blocks ({world_size} x "
                             f"{step_blocks}): a PackedDataset packed for this world size is")
        self.num_items, self.world_size, self.shuffle, self.seed = num_items, world_size, shuffle, seed
        self.step_blocks = step_blocks
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = check_integer("epoch", epoch, 0)  # (a raw TypeError for None before)

    def block_order(self) -> list[int]:
        blocks = self.num_items // self.world_size
        if not self.shuffle:
            return list(range(blocks))
        # (torch reads a seed modulo 2**64, negative ones too: seed + epoch past 2**64 - 1 overflowed)
        generator = torch.Generator().manual_seed((self.seed + self.epoch) % 2**64)
        if self.step_blocks == 1:
            return torch.randperm(blocks, generator=generator).tolist()
        units = torch.randperm(blocks // self.step_blocks, generator=generator).tolist()
        return [unit * self.step_blocks + b for unit in units for b in range(self.step_blocks)]

    def __iter__(self) -> Iterator[int]:
        for block in self.block_order():
            yield from range(block * self.world_size, (block + 1) * self.world_size)

    def __len__(self) -> int:
        return self.num_items
