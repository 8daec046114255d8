"""Sliding-window attention (Mistral, Qwen2 with windows, Gemma 2/3 local layers), exact everywhere.

HF's ``sliding_window = w``: the query at document position ``p`` sees the keys ``[p - w + 1, p]``.
Kernels are checked against SDPA with an explicit band mask per task; CA-tasks whose K/V are cut
to the window (``[max(0, a - w + 1), b)`` for queries ``[a, b)``) against the uncut document; pair
counts and K/V bytes against brute-force counts.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distca_hf.kernels import varlen_attention_forward, varlen_causal_attention
from distca_hf.planning import causal_pairs, key_start, start_with_pairs

CPU_BACKENDS = ["torch_cpu", "math"]


def _band_reference(q, k, v, cu_q, cu_k, scale, window):
    """Per task: SDPA with an explicit boolean band mask (bottom-right causal, ``window`` keys back)
    and K/V repeated per head."""
    groups = q.shape[1] // k.shape[1]
    outs = []
    for i in range(len(cu_q) - 1):
        qs, qe, ks, ke = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        lq, lk = qe - qs, ke - ks
        mask = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
        if window is not None:
            mask &= torch.ones(lq, lk, dtype=torch.bool).triu(diagonal=lk - lq - window + 1)
        kt, vt = (t[ks:ke].repeat_interleave(groups, dim=1).transpose(0, 1) for t in (k, v))
        o = F.scaled_dot_product_attention(q[qs:qe].transpose(0, 1), kt, vt, attn_mask=mask, scale=scale)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


def _qkv(total_q, total_k, heads, kv_heads, dim, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda n, h: torch.randn(n, h, dim, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    return make(total_q, heads), make(total_k, kv_heads), make(total_k, kv_heads)


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _weighted_grads(out, inputs, seed=7):
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.autograd.grad((out * weight.to(out.dtype)).sum(), inputs)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shapes=st.lists(st.tuples(st.integers(1, 12), st.integers(0, 20)), min_size=1, max_size=5),
       window=st.integers(1, 24), heads=st.sampled_from([(4, 4), (4, 2), (6, 1)]))
def test_windowed_kernel_matches_band_mask(backend, shapes, window, heads, monkeypatch):
    """Forward and gradients of every CPU backend under a window, tasks with and without prefixes,
    windows shorter and longer than the tasks; small chunks so the torch_cpu band path is cut."""
    from distca_hf.kernels import torch_cpu

    monkeypatch.setattr(torch_cpu, "WINDOW_ROWS", 3)
    lq = [s[0] for s in shapes]
    lk = [s[0] + s[1] for s in shapes]
    cu_q, cu_k = _cu(lq), _cu(lk)
    q, k, v = _qkv(int(cu_q[-1]), int(cu_k[-1]), heads[0], heads[1], 8)
    out = varlen_causal_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), 0.4, backend, window=window)
    ref = _band_reference(q, k, v, cu_q, cu_k, 0.4, window)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    for got, want in zip(_weighted_grads(out, (q, k, v)), _weighted_grads(ref, (q, k, v))):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_windowed_cpu_kernel_low_precision(dtype, tol):
    cu_q, cu_k = _cu([40, 7, 30]), _cu([40, 50, 30])
    q, k, v = _qkv(77, 120, 4, 2, 16, dtype)
    out, lse = varlen_attention_forward(q, k, v, cu_q, cu_k, 40, 50, None, "torch_cpu", window=9)
    ref = _band_reference(q.double(), k.double(), v.double(), cu_q, cu_k, 16**-0.5, 9)
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    assert lse.dtype == torch.float32 and lse.shape == (4, 77)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@settings(max_examples=20, deadline=None)
@given(length=st.integers(1, 40), window=st.integers(1, 45), cuts=st.lists(st.integers(1, 39), max_size=4))
def test_window_trimmed_tasks_compose(backend, length, window, cuts):
    """A document cut into CA-tasks ``[a, b)`` whose keys are only ``[key_start(a, w), b)`` gives the
    whole document's windowed attention, values and gradients."""
    bounds = sorted({0, length, *(c for c in cuts if c < length)})
    q, k, v = _qkv(length, length, 4, 2, 8)
    whole = varlen_causal_attention(q, k, v, _cu([length]), _cu([length]), length, length, 0.5, backend,
                                    window=window)
    starts, ends = bounds[:-1], bounds[1:]
    k_rows = torch.cat([torch.arange(key_start(a, window), b) for a, b in zip(starts, ends)])
    cu_k = _cu([b - key_start(a, window) for a, b in zip(starts, ends)])
    cut = varlen_causal_attention(q, k[k_rows], v[k_rows], _cu([b - a for a, b in zip(starts, ends)]), cu_k,
                                  length, length, 0.5, backend, window=window)
    torch.testing.assert_close(cut, whole, atol=1e-12, rtol=1e-10)
    for got, want in zip(_weighted_grads(cut, (q, k, v)), _weighted_grads(whole, (q, k, v))):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("window", [0, -3, 2.5, True, "8"])
def test_bad_window_is_refused(window):
    q, k, v = _qkv(4, 4, 2, 2, 8)
    with pytest.raises(ValueError, match="window must be None or a positive number of keys"):
        varlen_causal_attention(q, k, v, _cu([4]), _cu([4]), 4, 4, window=window)


@settings(max_examples=200, deadline=None)
@given(start=st.integers(0, 300), width=st.integers(0, 300), window=st.one_of(st.none(), st.integers(1, 400)))
def test_windowed_pairs_count_visible_keys(start, width, window):
    """``causal_pairs`` under a window is the brute-force count of visible keys, ``key_start`` the
    first key any of the queries sees, and ``start_with_pairs`` inverts ``causal_pairs``."""
    end = start + width
    seen = [(t + 1) if window is None else min(t + 1, window) for t in range(start, end)]
    assert causal_pairs(start, end, window) == sum(seen)
    if width:
        assert key_start(start, window) == (0 if window is None else max(0, start - window + 1))
        assert start_with_pairs(end, sum(seen), window) == pytest.approx(start, abs=1e-6)
