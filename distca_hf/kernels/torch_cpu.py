"""CPU backend: PyTorch's fused flash-attention CPU kernel, made bottom-right and varlen.

The CPU kernel (``aten::_scaled_dot_product_flash_attention_for_cpu``) is blocked, multithreaded,
skips masked blocks when ``is_causal``, handles grouped-query attention without repeating K/V, and
returns the log-sum-exp that a split computation needs. Its causal mask is aligned top-left, so a
CA-task with ``lq`` queries and a ``lk``-token prefix is run as two blocks and merged:

- the diagonal block, queries against the last ``lq`` keys, causal (top-left = bottom-right there);
- the prefix block, queries against the first ``lk - lq`` keys, no mask.

Backward runs the kernel's own backward on each block with the *merged* output and log-sum-exp,
which gives each block its exact share of the gradient.

A sliding window shorter than the task's keys is a band, not a triangle: the queries are taken
``WINDOW_ROWS`` at a time against the keys their windows cover (at most ``WINDOW_ROWS + window - 1``)
with an additive band mask in the query dtype (the kernel's ``attn_mask``); backward runs the same
chunks and sums the key gradients of overlapping chunks. Tasks of identical shape are stacked into
one call when ``GROUP_SAME_SHAPE``; ``distca-hf kernel-bench`` measures that within noise of one call
per task, so it is off and the copies it needs are saved.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from .math import accumulation_dtype, check_causal_task
from .merge import merge_partials

NAME = "torch_cpu"
GROUP_SAME_SHAPE = False
WINDOW_ROWS = 256  # queries per windowed chunk: the band mask is WINDOW_ROWS x (WINDOW_ROWS + window - 1)

_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def is_available(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _shape_groups(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, group: bool, causal: bool = True):
    """Yield lists of (q_start, k_start) of tasks sharing (lq, lk), with that (lq, lk)."""
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    groups: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for i in range(len(cu_q) - 1):
        lq, lk = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
        if causal:
            check_causal_task(i, lq, lk)
        if lq == 0:
            continue
        groups[(lq, lk)].append((cu_q[i], cu_k[i]))
    for (lq, lk), starts in groups.items():
        if group:
            yield lq, lk, starts
        else:
            for s in starts:
                yield lq, lk, [s]


def _gather(t: torch.Tensor, starts, length: int) -> torch.Tensor:
    """Rows ``[s, s + length)`` for each start, as ``[n, heads, length, dim]`` (a view when n == 1)."""
    if len(starts) == 1:
        s = starts[0]
        return t[s : s + length].transpose(0, 1).unsqueeze(0)
    return torch.stack([t[s : s + length] for s in starts]).transpose(1, 2)


def _gather_lse(lse: torch.Tensor, starts, length: int) -> torch.Tensor:
    return torch.stack([lse[:, s : s + length] for s in starts]).contiguous()


def _scatter(dst: torch.Tensor, src: torch.Tensor, starts, length: int) -> None:
    """Inverse of ``_gather``: src ``[n, heads, length, dim]`` into rows of dst."""
    for i, s in enumerate(starts):
        dst[s : s + length] = src[i].transpose(0, 1)


def _window_chunks(lq: int, lk: int, window: int):
    """``(first, last, k_lo, k_hi)``: query rows ``[first, last)`` of a task and the key columns
    ``[k_lo, k_hi)`` their windows cover (bottom-right: query row i sits at key column i + lk - lq)."""
    for first in range(0, lq, WINDOW_ROWS):
        last = min(lq, first + WINDOW_ROWS)
        yield first, last, max(0, first + lk - lq - window + 1), last + lk - lq


def _band_mask(first: int, last: int, k_lo: int, k_hi: int, lq: int, lk: int, window: int, dtype, device):
    """Additive mask ``[1, 1, last - first, k_hi - k_lo]``: 0 where query row sees the key column, -inf
    elsewhere."""
    column = torch.arange(first, last, device=device)[:, None] + (lk - lq)
    key = torch.arange(k_lo, k_hi, device=device)[None, :]
    visible = (key <= column) & (key > column - window)
    return torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill(~visible, float("-inf"))[None, None]


def _windowed_forward(q, k, v, out, lse, lq, lk, q0, k0, window, scale):
    for first, last, k_lo, k_hi in _window_chunks(lq, lk, window):
        mask = _band_mask(first, last, k_lo, k_hi, lq, lk, window, q.dtype, q.device)
        o, l = _flash_cpu(_gather(q, [q0 + first], last - first), _gather(k, [k0 + k_lo], k_hi - k_lo),
                          _gather(v, [k0 + k_lo], k_hi - k_lo), 0.0, False, attn_mask=mask, scale=scale)
        _scatter(out, o, [q0 + first], last - first)
        lse[:, q0 + first : q0 + last] = l[0]


def _windowed_backward(dout, q, k, v, out, lse, dq, dk, dv, lq, lk, q0, k0, window, scale):
    for first, last, k_lo, k_hi in _window_chunks(lq, lk, window):
        mask = _band_mask(first, last, k_lo, k_hi, lq, lk, window, q.dtype, q.device)
        rows, keys = [q0 + first], [k0 + k_lo]
        dqb, dkb, dvb = _flash_cpu_backward(
            _gather(dout, rows, last - first), _gather(q, rows, last - first), _gather(k, keys, k_hi - k_lo),
            _gather(v, keys, k_hi - k_lo), _gather(out, rows, last - first),
            _gather_lse(lse, rows, last - first).to(accumulation_dtype(q.dtype)), 0.0, False, attn_mask=mask, scale=scale)
        _scatter(dq, dqb, rows, last - first)
        dk[k0 + k_lo : k0 + k_hi] += dkb[0].transpose(0, 1)
        dv[k0 + k_lo : k0 + k_hi] += dvb[0].transpose(0, 1)


def _full_forward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, scale):
    """Tasks whose every query sees every key (``causal=False``): one unmasked call each."""
    for lq, lk, starts in _shape_groups(cu_seqlens_q, cu_seqlens_k, False, causal=False):
        (q0, k0), = starts
        o, l = _flash_cpu(_gather(q, [q0], lq), _gather(k, [k0], lk), _gather(v, [k0], lk), 0.0, False, scale=scale)
        _scatter(out, o, [q0], lq)
        lse[:, q0 : q0 + lq] = l[0]
    return out, lse


def _full_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, scale):
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for lq, lk, starts in _shape_groups(cu_seqlens_q, cu_seqlens_k, False, causal=False):
        (q0, k0), = starts
        rows = [q0]
        dqb, dkb, dvb = _flash_cpu_backward(
            _gather(dout, rows, lq), _gather(q, rows, lq), _gather(k, [k0], lk), _gather(v, [k0], lk),
            _gather(out, rows, lq), _gather_lse(lse, rows, lq).to(accumulation_dtype(q.dtype)), 0.0, False, scale=scale)
        _scatter(dq, dqb, rows, lq)
        _scatter(dk, dkb, [k0], lk)
        _scatter(dv, dvb, [k0], lk)
    return dq, dk, dv


def _unit_stride(*tensors):
    """``tensors`` with stride 1 along their last dimension: the aten CPU kernel reads a row's head_dim
    as if it had (a ``[..., ::2]`` slice gave wrong outputs and gradients, silently);
    ``F.scaled_dot_product_attention`` copies such inputs before calling it too."""
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in tensors)


def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window=None,
            causal=True):
    q, k, v = _unit_stride(q, k, v)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=accumulation_dtype(q.dtype), device=q.device)
    if not causal:  # the front door passes no window with full tasks: their keys are inside every window
        return _full_forward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale)
    for lq, lk, starts in _shape_groups(cu_seqlens_q, cu_seqlens_k, GROUP_SAME_SHAPE and window is None):
        if window is not None and window < lk:  # the window cuts some query's keys
            (q0, k0), = starts
            _windowed_forward(q, k, v, out, lse, lq, lk, q0, k0, window, softmax_scale)
            continue
        q_starts = [s for s, _ in starts]
        diag_starts = [s + lk - lq for _, s in starts]
        qb = _gather(q, q_starts, lq)
        o, l = _flash_cpu(qb, _gather(k, diag_starts, lq), _gather(v, diag_starts, lq), 0.0, True, scale=softmax_scale)
        if lk > lq:
            prefix_starts = [s for _, s in starts]
            o2, l2 = _flash_cpu(
                qb, _gather(k, prefix_starts, lk - lq), _gather(v, prefix_starts, lk - lq), 0.0, False, scale=softmax_scale
            )
            o, l = merge_partials([o, o2], [l, l2])
        _scatter(out, o, q_starts, lq)
        for i, s in enumerate(q_starts):
            lse[:, s : s + lq] = l[i]
    return out, lse


def backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
             window=None, causal=True):
    dout, q, k, v, out = _unit_stride(dout, q, k, v, out)
    if not causal:
        return _full_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale)
    dq = torch.empty_like(q)
    # windowed chunks overlap in keys: their dK/dV partials are summed in fp32 (fp64 for fp64)
    acc = accumulation_dtype(q.dtype) if window is not None else k.dtype
    dk, dv = torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=v.device)
    for lq, lk, starts in _shape_groups(cu_seqlens_q, cu_seqlens_k, GROUP_SAME_SHAPE and window is None):
        if window is not None and window < lk:
            (q0, k0), = starts
            _windowed_backward(dout, q, k, v, out, lse, dq, dk, dv, lq, lk, q0, k0, window, softmax_scale)
            continue
        q_starts = [s for s, _ in starts]
        diag_starts = [s + lk - lq for _, s in starts]
        qb, ob, dob = (_gather(t, q_starts, lq) for t in (q, out, dout))
        lb = _gather_lse(lse, q_starts, lq).to(accumulation_dtype(q.dtype))
        dqb, dkb, dvb = _flash_cpu_backward(
            dob, qb, _gather(k, diag_starts, lq), _gather(v, diag_starts, lq), ob, lb, 0.0, True, scale=softmax_scale
        )
        _scatter(dk, dkb, diag_starts, lq)
        _scatter(dv, dvb, diag_starts, lq)
        if lk > lq:
            prefix_starts = [s for _, s in starts]
            dq2, dk2, dv2 = _flash_cpu_backward(
                dob, qb, _gather(k, prefix_starts, lk - lq), _gather(v, prefix_starts, lk - lq), ob, lb, 0.0, False,
                scale=softmax_scale,
            )
            dqb = dqb + dq2
            _scatter(dk, dk2, prefix_starts, lk - lq)
            _scatter(dv, dv2, prefix_starts, lk - lq)
        _scatter(dq, dqb, q_starts, lq)
    return dq, dk.to(k.dtype), dv.to(v.dtype)
