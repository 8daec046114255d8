"""Plain-torch reference backend: explicit softmax, fp32 (fp64 for fp64) accumulation.

Runs on any device and is exact. It materialises scores for a chunk of query rows at a time
(``[kv_heads, groups, chunk, lk]``, at most ``SCORE_ELEMENTS`` elements), so memory stays bounded
for long documents. It is the fallback when no fused kernel fits (e.g. fp32 on CUDA) and an
independent cross-check of the fast backends in tests. Shapes follow flash-attn's varlen
convention, see ``kernels/__init__.py``.
"""

from __future__ import annotations

import torch

NAME = "math"
SUPPORTS_SOFTCAP = True
SUPPORTS_VALUE_HEAD_DIM = True  # v may have its own head dim (DeepSeek's MLA): out takes it
SCORE_ELEMENTS = 1 << 26  # 256 MiB of fp32 scores per chunk


def is_available(device: torch.device, dtype: torch.dtype) -> bool:
    return True


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """What attention accumulates ``dtype`` inputs in: fp64 for fp64, else fp32 (also the merge's)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_causal_task(i: int, lq: int, lk: int) -> None:
    """Refuse causal CA-task ``i`` with fewer keys (``lk``) than queries (``lq``): its first queries
    would see no key (NaN rows)."""
    if lk < lq:
        raise ValueError(f"CA-task {i} has {lq} queries but only {lk} keys; a causal task needs lk >= lq")


def _chunks(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, num_heads: int, window: int | None,
            causal: bool = True):
    """Yield (query rows, key rows, position of the first query row among the task's keys, i.e.
    its own key column, minus the first key row's column). A chunk's key rows end at its last query's
    column; under a window they start where its first query's window does. ``causal=False`` (a full
    task: every query sees every key, no window): the first query's column is the task's last key."""
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cu_q) - 1):
        lq, lk = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
        if causal:
            check_causal_task(i, lq, lk)
        span = lk if window is None else min(lk, window)
        rows = max(1, SCORE_ELEMENTS // max(1, num_heads * span))
        offset = lk - lq if causal else lk - 1  # the key column of the task's first query (bottom-right)
        for first in range(0, lq, rows):
            last = min(lq, first + rows)
            column = first + offset  # the key column of the chunk's first query
            k_lo = 0 if window is None else max(0, column - window + 1)
            k_hi = min(lk, last + offset)  # keys after the chunk's last query are masked for all its rows
            yield slice(cu_q[i] + first, cu_q[i] + last), slice(cu_k[i] + k_lo, cu_k[i] + k_hi), column - k_lo


def _probabilities(q, k, scale, column: int, window: int | None, softcap: float | None = None):
    """Causal (optionally windowed) softmax of query rows whose first sees key columns up to
    ``column`` of ``k`` (the next row one more). ``softcap``: scores become ``softcap * tanh(scores /
    softcap)`` before the softmax (Gemma 2's attention logit softcapping).

    q: ``[rows, Hkv, G, D]``, k: ``[keys, Hkv, D]`` (accumulation dtype) -> (probs ``[Hkv, G, rows,
    keys]``, lse ``[Hkv, G, rows]``, the derivative of the capped scores by the scaled scores,
    ``1 - tanh^2``, or ``None`` without a cap).
    """
    rows, keys = q.shape[0], k.shape[0]
    scores = torch.einsum("qhgd,khd->hgqk", q, k) * scale
    slope = None
    if softcap:
        capped = torch.tanh(scores / softcap)
        scores, slope = capped * softcap, 1.0 - capped * capped
    query_pos = torch.arange(column, column + rows, device=q.device)
    key_pos = torch.arange(keys, device=q.device)[None, :]
    visible = key_pos <= query_pos[:, None]
    if window is not None:
        visible &= key_pos > query_pos[:, None] - window
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)), lse, slope


def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window=None,
            softcap=None, causal=True):
    num_heads, num_kv_heads, head_dim, value_dim = q.shape[1], k.shape[1], q.shape[2], v.shape[2]
    groups = num_heads // num_kv_heads
    acc = accumulation_dtype(q.dtype)
    out = q.new_empty(q.shape[0], num_heads, value_dim)
    lse = torch.empty(num_heads, q.shape[0], dtype=acc, device=q.device)
    for qs, ks, column in _chunks(cu_seqlens_q, cu_seqlens_k, num_heads, window, causal):
        qt = q[qs].to(acc).view(-1, num_kv_heads, groups, head_dim)
        probs, chunk_lse, _ = _probabilities(qt, k[ks].to(acc), softmax_scale, column, window, softcap)
        out[qs] = torch.einsum("hgqk,khd->qhgd", probs, v[ks].to(acc)).reshape(-1, num_heads, value_dim).to(q.dtype)
        lse[:, qs] = chunk_lse.reshape(num_heads, -1)
    return out, lse


def backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
             window=None, softcap=None, causal=True):
    """Gradients from the given ``out`` and ``lse`` (not recomputed ones): a key-split task's partial
    run with the row's merged output and log-sum-exp gets its exact share (see ``kernels.merge``)."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    groups = num_heads // num_kv_heads
    acc = accumulation_dtype(q.dtype)
    dq = torch.zeros_like(q)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    for qs, ks, column in _chunks(cu_seqlens_q, cu_seqlens_k, num_heads, window, causal):
        grouped = lambda t: t[qs].to(acc).view(-1, num_kv_heads, groups, t.shape[2])
        qt, do, ot = grouped(q), grouped(dout), grouped(out)
        kt, vt = k[ks].to(acc), v[ks].to(acc)
        probs, own_lse, slope = _probabilities(qt, kt, softmax_scale, column, window, softcap)
        # renormalise by the given log-sum-exp: exp(s - own) exp(own - given) = exp(s - given)
        given = lse[:, qs].to(acc).view(num_kv_heads, groups, -1)
        probs = probs * torch.exp(own_lse - given).unsqueeze(-1)
        dp = torch.einsum("qhgd,khd->hgqk", do, vt)
        delta = (do * ot).sum(-1).permute(1, 2, 0).unsqueeze(-1)  # [Hkv, G, rows, 1]
        ds = probs * (dp - delta) * softmax_scale
        if slope is not None:
            ds = ds * slope
        dq[qs] = torch.einsum("hgqk,khd->qhgd", ds, kt).reshape(-1, num_heads, q.shape[2]).to(q.dtype)
        dk[ks] += torch.einsum("hgqk,qhgd->khd", ds, qt)
        dv[ks] += torch.einsum("hgqk,qhgd->khd", probs, do)
    return dq, dk.to(k.dtype), dv.to(v.dtype)
