"""Plain-torch reference backend: one CA-task at a time, explicit softmax, fp32 (fp64 for fp64) accumulation.

Runs on any device and is exact, but materialises each task's ``[heads, q, k]`` score matrix: it
is the fallback when no fused kernel fits (e.g. fp32 on CUDA) and an independent cross-check of the
fast backends in tests. Shapes follow flash-attn's varlen convention, see ``kernels/__init__.py``.
"""

from __future__ import annotations

import torch

NAME = "math"


def is_available(device: torch.device, dtype: torch.dtype) -> bool:
    return True


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _task_slices(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor):
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cu_q) - 1):
        yield slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])


def _probabilities(q, k, scale):
    """Scores and bottom-right causal softmax of one task, grouped-query layout.

    q: [lq, Hkv, G, D], k: [lk, Hkv, D], both in the accumulation dtype -> (probs [Hkv, G, lq, lk], lse [Hkv, G, lq]).
    """
    lq, lk = q.shape[0], k.shape[0]
    scores = torch.einsum("qhgd,khd->hgqk", q, k) * scale
    visible = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(diagonal=lk - lq)
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)), lse


def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale):
    num_heads, num_kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    groups = num_heads // num_kv_heads
    acc = _accumulation_dtype(q.dtype)
    out = torch.empty_like(q)
    lse = torch.empty(num_heads, q.shape[0], dtype=acc, device=q.device)
    for qs, ks in _task_slices(cu_seqlens_q, cu_seqlens_k):
        qt = q[qs].to(acc).view(-1, num_kv_heads, groups, head_dim)
        probs, task_lse = _probabilities(qt, k[ks].to(acc), softmax_scale)
        out[qs] = torch.einsum("hgqk,khd->qhgd", probs, v[ks].to(acc)).reshape(-1, num_heads, head_dim).to(q.dtype)
        lse[:, qs] = task_lse.reshape(num_heads, -1)
    return out, lse


def backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale):
    num_heads, num_kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    groups = num_heads // num_kv_heads
    acc = _accumulation_dtype(q.dtype)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for qs, ks in _task_slices(cu_seqlens_q, cu_seqlens_k):
        grouped = lambda t: t[qs].to(acc).view(-1, num_kv_heads, groups, head_dim)
        qt, do, ot = grouped(q), grouped(dout), grouped(out)
        kt, vt = k[ks].to(acc), v[ks].to(acc)
        probs, _ = _probabilities(qt, kt, softmax_scale)
        dp = torch.einsum("qhgd,khd->hgqk", do, vt)
        delta = (do * ot).sum(-1).permute(1, 2, 0).unsqueeze(-1)  # [Hkv, G, lq, 1]
        ds = probs * (dp - delta) * softmax_scale
        dq[qs] = torch.einsum("hgqk,khd->qhgd", ds, kt).reshape(-1, num_heads, head_dim).to(q.dtype)
        dk[ks] = torch.einsum("hgqk,qhgd->khd", ds, qt).to(k.dtype)
        dv[ks] = torch.einsum("hgqk,qhgd->khd", probs, do).to(v.dtype)
    return dq, dk, dv
