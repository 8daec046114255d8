"""What the torch-native CUDA backends share: layout conversions between distca's varlen
convention and what PyTorch's CUDA kernels take, and how they find those kernels.

distca's kernels exchange the log-sum-exp packed like the queries: ``[heads, total_q]`` fp32 (see
``kernels/__init__.py``). PyTorch's memory-efficient kernel (and its flash kernel on ROCm, and torch
builds whose vendored flash-attn predates the "unpadded" varlen lse) keep it per task, padded:
``[tasks, heads, width]`` with task ``i``'s query ``j`` at ``[i, :, j]`` (``width >= max_seqlen_q``;
the efficient kernel rounds it up to a multiple of 32), the rest unused. Flash kernels also want a
head dim that is a multiple of 8.
The layout functions are pure tensor code, exact, and run on any device.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

__all__ = ["aten_op", "cuda_capability", "pad_head_dim", "task_coordinates", "packed_lse", "padded_lse"]


def aten_op(name: str):
    """``torch.ops.aten.<name>``, or ``None`` when this torch does not have it."""
    try:
        return getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return None


@functools.lru_cache(maxsize=None)
def cuda_capability(index: int) -> tuple[int, int]:
    """``(major, minor)`` compute capability of CUDA device ``index`` (asked once per device)."""
    return torch.cuda.get_device_capability(index)


def pad_head_dim(*tensors: torch.Tensor, multiple: int = 8) -> tuple[torch.Tensor, ...]:
    """Zero-pad the last dim of each tensor up to a multiple of ``multiple`` (unchanged if it is one).

    Zero columns change no dot product, so attention with an explicit ``softmax_scale`` of the padded
    tensors equals the original in the leading columns and is zero in the padding, forward and
    backward.
    """
    head_dim = tensors[0].shape[-1]
    if head_dim % multiple == 0:
        return tensors
    return tuple(F.pad(t, (0, multiple - head_dim % multiple)) for t in tensors)


def task_coordinates(cu_seqlens_q: torch.Tensor, total_q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each packed query row: ``(task index, row within its task)``, both ``[total_q]`` int64
    on ``cu_seqlens_q``'s device. Tasks with no query own no row."""
    cu = cu_seqlens_q.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    task = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths, output_size=total_q)
    return task, torch.arange(total_q, device=cu.device) - cu[:-1][task]


def packed_lse(lse: torch.Tensor, cu_seqlens_q: torch.Tensor, total_q: int) -> torch.Tensor:
    """``[tasks, heads, width]`` per-task (padded) log-sum-exp -> ``[heads, total_q]`` contiguous.

    A ``[heads, total_q]`` input is returned as it is (contiguous): the kernel already packed it.
    """
    if lse.dim() == 2:
        return lse.contiguous()
    task, row = task_coordinates(cu_seqlens_q.to(lse.device), total_q)
    return lse[task, :, row].transpose(0, 1).contiguous()


def padded_lse(lse: torch.Tensor, cu_seqlens_q: torch.Tensor, width: int) -> torch.Tensor:
    """Inverse of ``packed_lse``: ``[heads, total_q]`` -> ``[tasks, heads, width]`` fp32 contiguous
    (``width`` at least the longest task's queries); the unused tail of each row is ``+inf``, as
    PyTorch fills the rows of a task without keys."""
    heads, total_q = lse.shape
    tasks = cu_seqlens_q.numel() - 1
    out = torch.full((tasks, heads, width), float("inf"), dtype=torch.float32, device=lse.device)
    task, row = task_coordinates(cu_seqlens_q.to(lse.device), total_q)
    out[task, :, row] = lse.transpose(0, 1).to(torch.float32)
    return out
