"""The plumbing of one exchange: pack row tensors per destination into one buffer, launch one uneven
all-to-all, and on ``wait()`` unpack what arrived. Buffers are reused by every layer of a forward.
"""

from __future__ import annotations

import numpy as np
import torch

from .comm import all_to_all
from .tables import Wave

__all__ = ["Pending", "start_exchange", "split_rows"]


def _buffer(wave: Wave, name: str, numel: int, like: torch.Tensor) -> torch.Tensor:
    """A 1D buffer of ``numel`` elements, reused by every layer of the forward (grown when needed)."""
    key = (name, like.dtype)
    pooled = wave.buffers.get(key)
    if pooled is None or pooled.numel() < numel:
        pooled = torch.empty(numel, dtype=like.dtype, device=like.device)
        wave.buffers[key] = pooled
    return pooled[:numel]


def split_rows(t: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
    return list(torch.split(t, counts, dim=0))


class Pending:
    """An exchange in flight; ``wait()`` returns the received parts, each concatenated over sources."""

    def __init__(self, handle, recv_counts, shapes, world: int):
        self.handle, self.recv_counts, self.shapes, self.world = handle, recv_counts, shapes, world

    def wait(self) -> list[torch.Tensor]:
        buffer = self.handle.wait()
        pieces = [[] for _ in self.shapes]
        offset = 0
        for r in range(self.world):
            for j, shape in enumerate(self.shapes):
                n = self.recv_counts[j][r] * int(np.prod(shape))
                pieces[j].append(buffer[offset : offset + n].view(-1, *shape))
                offset += n
        # concatenating copies out of the receive buffer, which the next layer reuses
        return [torch.cat(p) if p else buffer.new_empty(0, *s) for p, s in zip(pieces, self.shapes)]


def start_exchange(wave: Wave, send_parts, recv_counts, shapes, what: str, kind: str) -> Pending:
    """Launch the all-to-all that sends ``send_parts[r]`` (a list of row tensors) to rank ``r`` and
    receives ``recv_counts[j][r]`` rows of shape ``shapes[j]`` of part ``j`` from each rank."""
    flat = [p.reshape(-1) for parts in send_parts for p in parts]
    splits = [sum(p.numel() for p in parts) for parts in send_parts]
    send = _buffer(wave, kind + ".send", sum(splits), flat[0])
    torch.cat(flat, out=send)
    recv_splits = [sum(recv_counts[j][r] * int(np.prod(s)) for j, s in enumerate(shapes)) for r in range(wave.world)]
    handle = all_to_all(send, splits, recv_splits, wave.group, wave.timeout_s,
                        f"{what} ({wave.name}, forward {wave.forward_number})",
                        out=_buffer(wave, kind + ".recv", sum(recv_splits), send), async_op=True)
    sent = sum(splits[r] for r in range(wave.world) if r != wave.rank) * send.element_size()
    counts = wave.counters.bytes_sent
    counts[kind] = counts.get(kind, 0) + int(sent)
    return Pending(handle, recv_counts, shapes, wave.world)
