"""Varlen CA-task kernels: exact against per-task attention computed independently, and
composable: any cut of documents into CA-tasks gives the attention of the uncut documents."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distca_hf import CATask, PackedDocuments, fuse_tasks, split_document, varlen_causal_attention, whole_document_tasks
from kernel_refs import cu_seqlens, random_qkv, reference_attention, weighted_grads
from distca_hf.kernels import available_backends, select_backend, varlen_attention_backward, varlen_attention_forward

CPU_BACKENDS = ["torch_cpu", "math"]


@pytest.fixture(params=[False, True], ids=["per_task", "stacked"])
def stacked(request, monkeypatch):
    """Run the torch_cpu backend both ways: one call per task, and same-shape tasks stacked."""
    from distca_hf.kernels import torch_cpu

    monkeypatch.setattr(torch_cpu, "GROUP_SAME_SHAPE", request.param)
    return request.param


TASK_SHAPES = [(3, 3), (2, 7), (5, 9), (2, 7), (1, 1), (4, 4), (1, 12), (6, 6)]  # (lq, lk), repeats included


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_kernel_matches_independent_attention(backend, heads, kv_heads, stacked):
    cu_q, cu_k = cu_seqlens([s[0] for s in TASK_SHAPES]), cu_seqlens([s[1] for s in TASK_SHAPES])
    q, k, v = random_qkv(int(cu_q[-1]), int(cu_k[-1]), heads, kv_heads, 16, torch.float64)
    scale = 0.3
    out = varlen_causal_attention(q, k, v, cu_q, cu_k, 6, 12, scale, backend)
    ref = reference_attention(q, k, v, cu_q, cu_k, scale)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    for got, want in zip(weighted_grads(out, (q, k, v)), weighted_grads(ref, (q, k, v))):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cpu_kernel_low_precision(dtype, tol):
    cu_q, cu_k = cu_seqlens([s[0] for s in TASK_SHAPES]), cu_seqlens([s[1] for s in TASK_SHAPES])
    q, k, v = random_qkv(int(cu_q[-1]), int(cu_k[-1]), 4, 2, 16, dtype)
    out, lse = varlen_attention_forward(q, k, v, cu_q, cu_k, 6, 12, None, "torch_cpu")
    ref = reference_attention(q.double(), k.double(), v.double(), cu_q, cu_k, 16**-0.5)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (4, q.shape[0])
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    dout = torch.randn_like(out)
    dq, dk, dv = varlen_attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, 6, 12, None, "torch_cpu")
    ref_grads = torch.autograd.grad((ref * dout.double()).sum(), (q, k, v))
    for got, want in zip((dq, dk, dv), ref_grads):
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want.double(), atol=5 * tol, rtol=5 * tol)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("window", [None, 3])
def test_inputs_whose_head_dim_is_strided_are_exact(backend, window):
    """q, k, v (and dO) sliced every other element of a wider head dim: the aten CPU kernel read them as if
    their head dim were contiguous (outputs off by about 4, silently); every backend now equals the same
    values laid out contiguously, outputs and gradients, windowed too."""
    cu_q, cu_k = cu_seqlens([s[0] for s in TASK_SHAPES]), cu_seqlens([s[1] for s in TASK_SHAPES])
    wide = random_qkv(int(cu_q[-1]), int(cu_k[-1]), 4, 2, 32, torch.float32)
    strided = [t.detach()[..., ::2].requires_grad_() for t in wide]
    dense = [t.detach().contiguous().requires_grad_() for t in strided]
    assert strided[0].stride(-1) == 2
    outs = [varlen_causal_attention(*x, cu_q, cu_k, 6, 12, None, backend, window=window) for x in (strided, dense)]
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=1e-5)
    dout = torch.randn(*outs[0].shape[:-1], 2 * outs[0].shape[-1])[..., ::2]
    for got, want in zip(torch.autograd.grad(outs[0], strided, dout), torch.autograd.grad(outs[1], dense, dout)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_kernel_inputs_of_mixed_dtypes_are_refused_by_name():
    cu = cu_seqlens([4])
    q, k, v = random_qkv(4, 4, 2, 2, 8, torch.float32)
    with pytest.raises(TypeError, match="q, k, v must share one dtype and device, got torch.float32 / torch.bfloat16"):
        varlen_causal_attention(q, k.bfloat16(), v, cu, cu, 4, 4, None, "torch_cpu")


@pytest.mark.parametrize("backend", ["torch_cpu", "math"])
def test_kernel_rejects_a_task_with_more_queries_than_keys(backend):
    q, k, v = random_qkv(5, 3, 2, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="lk >= lq"):  # math gave NaN
        varlen_causal_attention(q, k, v, cu_seqlens([5]), cu_seqlens([3]), 5, 3, None, backend)


@pytest.mark.parametrize("backend", ["torch_cpu", "math"])
@pytest.mark.parametrize("offsets", [[0, 3, 2, 4], [0, -2, 4], [1, 4]])
def test_kernel_rejects_offsets_that_go_back_or_do_not_start_at_0(backend, offsets):
    """Offsets that decrease stopped the process (SIGFPE in the CPU kernel); negative ones or a first
    offset past 0 gave wrong outputs without a word."""
    q, k, v = random_qkv(4, 4, 2, 2, 8, torch.float32)
    cu = torch.tensor(offsets, dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0 and never decrease"):
        varlen_causal_attention(q, k, v, cu, cu, 4, 4, None, backend)
    with pytest.raises(TypeError, match="cu_seqlens_q must be an integer tensor"):
        varlen_causal_attention(q, k, v, [0, 4], cu_seqlens([4]), 4, 4, None, backend)


def test_kernel_rejects_cu_seqlens_that_do_not_cover_the_rows():
    q, k, v = random_qkv(6, 6, 2, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="cu_seqlens end at"):
        varlen_causal_attention(q, k, v, cu_seqlens([5]), cu_seqlens([5]), 5, 5, None, "torch_cpu")


def test_auto_backend_on_cpu_is_the_fused_kernel():
    assert select_backend("cpu", torch.float32).NAME == "torch_cpu"
    assert available_backends("cpu", torch.float32) == ["torch_cpu", "math"]


def _run_tasks(tasks, docs, q, k, v, backend):
    """Gather a fused batch for ``tasks``, run it, scatter the outputs back to the token stream."""
    batch = fuse_tasks(tasks, docs)
    q_index = batch.q_index if batch.q_index is not None else torch.arange(q.shape[0])
    k_index = batch.k_index if batch.k_index is not None else torch.arange(k.shape[0])
    out = varlen_causal_attention(
        q.index_select(0, q_index), k.index_select(0, k_index), v.index_select(0, k_index),
        batch.cu_seqlens_q, batch.cu_seqlens_k, batch.max_seqlen_q, batch.max_seqlen_k, None, backend,
    )
    return torch.zeros_like(q).index_add(0, q_index, out)


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    data=st.data(),
    backend=st.sampled_from(["torch_cpu", "torch_cpu_stacked", "math", "math_chunked"]),
)
def test_any_cut_into_ca_tasks_equals_the_uncut_documents(lengths, data, backend):
    from distca_hf.kernels import math as math_backend
    from distca_hf.kernels import torch_cpu

    saved = torch_cpu.GROUP_SAME_SHAPE, math_backend.SCORE_ELEMENTS
    torch_cpu.GROUP_SAME_SHAPE = backend == "torch_cpu_stacked"
    math_backend.SCORE_ELEMENTS = 50 if backend == "math_chunked" else saved[1]  # a few query rows per chunk
    backend = backend.split("_")[0] if backend.startswith("math") else "torch_cpu"
    try:
        _check_cut_equals_uncut(lengths, data, backend)
    finally:
        torch_cpu.GROUP_SAME_SHAPE, math_backend.SCORE_ELEMENTS = saved


def _check_cut_equals_uncut(lengths, data, backend):
    docs = PackedDocuments.from_lengths(lengths)
    tasks = []
    for d, n in enumerate(lengths):
        cuts = data.draw(st.lists(st.integers(1, max(1, n - 1)), max_size=4).map(lambda c, n=n: [x for x in c if x < n]))
        tasks += split_document(d, 0, n, cuts)
    tasks = data.draw(st.permutations(tasks))  # a server receives tasks in any order
    total = sum(lengths)
    q, k, v = random_qkv(total, total, 4, 2, 8, torch.float64, seed=len(tasks))
    cut = _run_tasks(tasks, docs, q, k, v, backend)
    whole = _run_tasks(whole_document_tasks(docs), docs, q, k, v, backend)
    torch.testing.assert_close(cut, whole, atol=1e-12, rtol=1e-10)
    for got, want in zip(weighted_grads(cut, (q, k, v)), weighted_grads(whole, (q, k, v))):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
    # and the cut tasks cost exactly the pairs of the documents
    assert sum(t.pairs for t in tasks) == sum(n * (n + 1) // 2 for n in lengths)


def test_fused_batch_of_whole_documents_needs_no_gather():
    docs = PackedDocuments.from_lengths([3, 5])
    batch = fuse_tasks(whole_document_tasks(docs), docs)
    assert batch.q_index is None and batch.k_index is None
    assert batch.cu_seqlens_q.tolist() == [0, 3, 8] == batch.cu_seqlens_k.tolist()
    cut = fuse_tasks([CATask(1, 2, 5), CATask(0, 0, 3)], docs)
    assert cut.q_index.tolist() == [5, 6, 7, 0, 1, 2]
    assert cut.k_index.tolist() == [3, 4, 5, 6, 7, 0, 1, 2]
    assert cut.cu_seqlens_q.tolist() == [0, 3, 6] and cut.cu_seqlens_k.tolist() == [0, 5, 8]
    assert (cut.max_seqlen_q, cut.max_seqlen_k, cut.pairs) == (3, 5, 12 + 6)


def test_math_backend_in_query_chunks(monkeypatch):
    """Long tasks are processed a few query rows at a time: same numbers."""
    from distca_hf.kernels import math as math_backend

    monkeypatch.setattr(math_backend, "SCORE_ELEMENTS", 64)
    cu_q, cu_k = cu_seqlens([s[0] for s in TASK_SHAPES]), cu_seqlens([s[1] for s in TASK_SHAPES])
    q, k, v = random_qkv(int(cu_q[-1]), int(cu_k[-1]), 4, 2, 8, torch.float64)
    out = varlen_causal_attention(q, k, v, cu_q, cu_k, 6, 12, None, "math")
    ref = reference_attention(q, k, v, cu_q, cu_k, 8**-0.5)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    for got, want in zip(weighted_grads(out, (q, k, v)), weighted_grads(ref, (q, k, v))):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


class _FakeFlashAttn:
    """Stands in for ``flash_attn.flash_attn_interface`` (no CUDA here): the same keyword API, backed
    by the math backend, in the 2.6 (8 outputs, ``window_size``) or 2.7+ (4 outputs, left/right) form."""

    def __init__(self, legacy: bool):
        from distca_hf.kernels import math as math_backend

        self.math, self.legacy, self.calls = math_backend, legacy, []
        if legacy:
            def fwd(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal, window_size, softcap,
                    alibi_slopes, return_softmax, block_table=None):
                return self._forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal, window_size)

            def bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale,
                    causal, window_size, softcap, alibi_slopes, deterministic, rng_state=None):
                return self._backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_q, cu_k, softmax_scale, causal,
                                      window_size)
        else:
            def fwd(*args, **kwargs):
                names = ["q", "k", "v", "cu_q", "cu_k", "max_q", "max_k"]
                a = dict(zip(names, args), **kwargs)
                assert (a["window_size_left"], a["window_size_right"]) == (-1, -1)
                return self._forward(a["q"], a["k"], a["v"], a["cu_q"], a["cu_k"], a["max_q"], a["max_k"],
                                     a["dropout_p"], a["softmax_scale"], a["causal"], (-1, -1))

            def bwd(*args, **kwargs):
                names = ["dout", "q", "k", "v", "out", "lse", "dq", "dk", "dv", "cu_q", "cu_k", "max_q", "max_k"]
                a = dict(zip(names, args), **kwargs)
                return self._backward(a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"], a["dq"], a["dk"],
                                      a["dv"], a["cu_q"], a["cu_k"], a["softmax_scale"], a["causal"], (-1, -1))
        self._flash_attn_varlen_forward = fwd
        self._flash_attn_varlen_backward = bwd

    def _forward(self, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, window):
        assert causal and dropout_p == 0.0 and tuple(window) == (-1, -1) and q.shape[-1] % 8 == 0
        self.calls.append("fwd")
        out, lse = self.math.forward(q, k, v, cu_q, cu_k, max_q, max_k, scale)
        if self.legacy:
            return out, q, k, v, out, lse, torch.empty(0), torch.empty(2)
        return out, lse, torch.empty(0), torch.empty(2)

    def _backward(self, dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, scale, causal, window):
        assert causal and tuple(window) == (-1, -1) and lse.shape == (q.shape[1], q.shape[0])
        self.calls.append("bwd")
        gq, gk, gv = self.math.backward(dout, q, k, v, out, lse, cu_q, cu_k, 0, 0, scale)
        dq.copy_(gq), dk.copy_(gk), dv.copy_(gv)
        return torch.empty(0)


@pytest.mark.parametrize("legacy", [False, True], ids=["flash_attn_2.7+", "flash_attn_2.6"])
@pytest.mark.parametrize("head_dim", [16, 12])  # 12 exercises the pad-to-multiple-of-8 path
def test_flash_attn_backend_glue(monkeypatch, legacy, head_dim):
    from distca_hf.kernels import flash_attn

    fake = _FakeFlashAttn(legacy)
    monkeypatch.setattr(flash_attn, "_interface", lambda: fake)
    cu_q, cu_k = cu_seqlens([s[0] for s in TASK_SHAPES]), cu_seqlens([s[1] for s in TASK_SHAPES])
    q, k, v = random_qkv(int(cu_q[-1]), int(cu_k[-1]), 4, 2, head_dim, torch.float64)
    out, lse = flash_attn.forward(q, k, v, cu_q, cu_k, 6, 12, 0.25)
    ref = reference_attention(q, k, v, cu_q, cu_k, 0.25)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    dout = torch.randn_like(out)
    grads = flash_attn.backward(dout, q, k, v, out, lse, cu_q, cu_k, 6, 12, 0.25)
    ref_grads = torch.autograd.grad((ref * dout).sum(), (q, k, v))
    for got, want in zip(grads, ref_grads):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
    assert fake.calls == ["fwd", "bwd"]
