"""Independent references for the kernel tests: attention of CA-task batches from explicit scores,
random inputs and cumulative lengths (shared by test_kernels and test_variants)."""

from __future__ import annotations

import torch


def reference_attention(q, k, v, cu_q, cu_k, scale, window=None, softcap=None, chunk=None):
    """Per task: explicit scores, capped as HF's eager Gemma 2 does (``softcap * tanh(s / softcap)``),
    a boolean mask (bottom-right causal, ``window`` keys back when given, only keys of the query's own
    ``chunk`` when given: key column // chunk == query column // chunk, as HF's chunked_overlay) and
    K/V repeated per head. q ``[total_q, heads, dim]``, k ``[total_k, kv_heads, dim]``, v ``[total_k,
    kv_heads, value_dim]`` -> ``[total_q, heads, value_dim]``."""
    groups = q.shape[1] // k.shape[1]
    outs = []
    for i in range(len(cu_q) - 1):
        qs, qe, ks, ke = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        lq, lk = qe - qs, ke - ks
        mask = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
        if window is not None:
            mask &= torch.ones(lq, lk, dtype=torch.bool).triu(diagonal=lk - lq - window + 1)
        if chunk is not None:
            columns = torch.arange(lk - lq, lk)[:, None] // chunk
            mask &= columns == torch.arange(lk)[None, :] // chunk
        kt, vt = (t[ks:ke].repeat_interleave(groups, dim=1).transpose(0, 1) for t in (k, v))
        scores = q[qs:qe].transpose(0, 1) @ kt.transpose(1, 2) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        o = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ vt
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


def random_qkv(total_q, total_k, heads, kv_heads, dim, dtype=torch.float64, seed=0, value_dim=None):
    """q ``[total_q, heads, dim]``, k ``[total_k, kv_heads, dim]`` and v ``[total_k, kv_heads,
    value_dim or dim]``, leaves that need grad."""
    g = torch.Generator().manual_seed(seed)
    make = lambda n, h, d=dim: torch.randn(n, h, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    return make(total_q, heads), make(total_k, kv_heads), make(total_k, kv_heads, value_dim or dim)


def cu_seqlens(lengths):
    """``[len(lengths) + 1]`` int32 cumulative lengths, from 0."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def weighted_grads(out, inputs, seed=99):
    """Gradients of ``inputs`` under a fixed random projection of ``out`` (touches every output)."""
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.autograd.grad((out * weight.to(out.dtype)).sum(), inputs)
