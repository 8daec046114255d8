"""Merging partial attentions over disjoint key sets by their log-sum-exp: the one home of the formula.

A query row whose keys are split into disjoint sets ``K_1 .. K_n`` (a key-split CA-task, or two
blocks of one kernel call) gets from each set a partial output ``o_i`` (softmax over ``K_i`` only)
and its log-sum-exp ``l_i = log sum_{k in K_i} exp(score_k)``. The attention over all keys is

    l = log sum_i exp(l_i)            o = sum_i exp(l_i - l) o_i

exactly (a set with no visible key has ``l_i = -inf`` and weight 0). Backward of the whole needs no
merge of its own: each partial's kernel backward run with the *merged* ``o`` and ``l`` (and the
row's dO) gives that key set's exact share: dK, dV of its keys, and a dQ partial; the dQ partials
of a row sum to its dQ (ring attention's rule).

Layout: rows first. ``out`` ``[rows, *heads, value_dim]``, ``lse`` ``[rows, *heads]`` (natural log,
fp32 or fp64); the kernels' ``[heads, total_q]`` log-sum-exp is its transpose.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .math import accumulation_dtype

__all__ = ["merge_partials", "merge_rows"]


def merge_rows(rows: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, num_rows: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partials that name their row: partial ``p`` (``out[p]`` ``[*heads, value_dim]``,
    ``lse[p]`` ``[*heads]``) belongs to row ``rows[p]`` (``[partials]`` int64, repeats allowed, in
    any order). Returns ``(out [num_rows, *heads, value_dim]`` in ``out``'s dtype, ``lse [num_rows,
    *heads]`` in fp32, fp64 for fp64 input): a row with one partial gets it unchanged (bit for bit), a
    row with none gets zeros and ``-inf``."""
    if rows.dim() != 1 or rows.shape[0] != out.shape[0] or lse.shape != out.shape[:-1]:
        raise ValueError(f"merge_rows takes rows [partials], out [partials, *heads, dim] and lse [partials, *heads], "
                         f"got {tuple(rows.shape)}, {tuple(out.shape)}, {tuple(lse.shape)}")
    acc = accumulation_dtype(lse.dtype)
    lse = lse.to(acc)
    shape = (num_rows, *lse.shape[1:])
    index = rows.view(-1, *([1] * (lse.dim() - 1))).expand_as(lse)
    top = torch.full(shape, float("-inf"), dtype=acc, device=lse.device).scatter_reduce(
        0, index, lse, "amax", include_self=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # rows whose partials all saw no key
    weight = torch.exp(lse - top[rows])
    total = torch.zeros(shape, dtype=acc, device=lse.device).index_add_(0, rows, weight)
    merged_lse = top + torch.log(total)  # log 0 = -inf: a row with no visible key
    share = weight / torch.where(total > 0, total, torch.ones_like(total))[rows]
    merged_out = torch.zeros((num_rows, *out.shape[1:]), dtype=accumulation_dtype(out.dtype), device=out.device)
    merged_out.index_add_(0, rows, out.to(merged_out.dtype) * share.unsqueeze(-1))
    return merged_out.to(out.dtype), merged_lse


def merge_partials(out_parts: Sequence[torch.Tensor], lse_parts: Sequence[torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge aligned partials: ``out_parts[i]`` ``[*rows, value_dim]`` and ``lse_parts[i]`` ``[*rows]``
    (every part the same shape) are attentions of the same query rows over disjoint key sets.
    Returns ``(out, lse)`` of the same shapes (``lse`` fp32, fp64 for fp64)."""
    if not out_parts or len(out_parts) != len(lse_parts):
        raise ValueError(f"merge_partials takes as many out parts as lse parts, at least one; got {len(out_parts)} "
                         f"and {len(lse_parts)}")
    shape = lse_parts[0].shape
    if any(l.shape != shape or o.shape[:-1] != shape for o, l in zip(out_parts, lse_parts)):
        raise ValueError(f"merge_partials: every part must have out [*rows, dim] and lse [*rows] of one shape, got "
                         f"{[tuple(o.shape) for o in out_parts]} and {[tuple(l.shape) for l in lse_parts]}")
    n = shape.numel()
    rows = torch.arange(n, device=lse_parts[0].device).repeat(len(out_parts))
    out, lse = merge_rows(rows, torch.cat([o.reshape(n, o.shape[-1]) for o in out_parts]),
                          torch.cat([l.reshape(n) for l in lse_parts]), n)
    return out.view(*shape, out.shape[-1]), lse.view(shape)
