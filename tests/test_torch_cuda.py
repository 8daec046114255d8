"""The torch-native CUDA backends, checked on CPU: the ops they call are replaced by fakes that
implement each op's documented semantics (flash: ``is_causal`` + ``window_size_left/right`` from the
bottom-right diagonal, lse ``[heads, total_q]``; efficient: ``custom_mask_type=2``, equal head counts,
per-task padded lse) and check the arguments the real op checks (head dim a multiple of 8, contiguous
last dim, int32 cu_seqlens, dropout 0). Outputs and gradients are compared with per-task attention
under an explicit band mask; selection with faked availability; the fallback warnings' text. The
real kernels run in ``test_gpu.py``."""

from __future__ import annotations

import warnings

import pytest
import torch

from distca_hf.kernels import select_backend, torch_cuda, torch_cuda_efficient, unavailable_reasons
from distca_hf.kernels import math as math_backend
from distca_hf.kernels.varlen_layout import packed_lse, pad_head_dim, padded_lse, task_coordinates

# (lq, lk): prefixes, a one-query task, repeats, and a task with no query (it owns keys only)
TASK_SHAPES = [(3, 3), (2, 7), (5, 9), (0, 4), (1, 1), (4, 4), (1, 12), (6, 6)]


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _qkv(heads, kv_heads, dim, shapes=TASK_SHAPES, seed=0):
    g = torch.Generator().manual_seed(seed)
    cu_q, cu_k = _cu([s[0] for s in shapes]), _cu([s[1] for s in shapes])
    make = lambda n, h: torch.randn(n, h, dim, generator=g, dtype=torch.float64)
    return make(int(cu_q[-1]), heads), make(int(cu_k[-1]), kv_heads), make(int(cu_k[-1]), kv_heads), cu_q, cu_k


def _banded(q, k, v, cu_q, cu_k, scale, left, right):
    """Per task, explicit scores: query i sees key c when ``i + d - left <= c <= i + d + right``
    (``d = lk - lq``, a negative side unbounded): flash-attn's varlen mask. Returns (out, lse [H, total_q])."""
    groups = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    lse = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float64)
    for i in range(len(cu_q) - 1):
        qs, qe, ks, ke = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        if qe == qs:
            continue
        d = (ke - ks) - (qe - qs)
        row = torch.arange(qe - qs)[:, None] + d
        col = torch.arange(ke - ks)[None, :]
        visible = torch.ones_like(row - col, dtype=torch.bool)
        if right >= 0:
            visible &= col <= row + right
        if left >= 0:
            visible &= col >= row - left
        kt = k[ks:ke].repeat_interleave(groups, dim=1)
        vt = v[ks:ke].repeat_interleave(groups, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[qs:qe], kt) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        lse[:, qs:qe] = torch.logsumexp(scores, -1)
        out[qs:qe] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), vt)
    return out, lse


def _reference(q, k, v, cu_q, cu_k, scale, window):
    """HF's sliding window (``window`` keys back from the query, itself included), bottom-right causal."""
    return _banded(q, k, v, cu_q, cu_k, scale, -1 if window is None else window - 1, 0)


class FakeFlash:
    """``aten::_flash_attention_forward/backward`` on CPU: the real op's argument checks, then
    flash-attn's mask semantics in fp64. ``lse_layout``: ``packed`` ([heads, total_q], CUDA torch
    >= 2.5) or ``padded`` ([tasks, heads, max_q], ROCm and older)."""

    def __init__(self, lse_layout="packed", window_args=True):
        self.lse_layout, self.window_args, self.calls, self.causal = lse_layout, window_args, [], []

    def _check(self, q, k, v, cu_q, cu_k, max_q, dropout_p, is_causal, kwargs):
        assert q.dim() == 3 and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256
        assert all(t.stride(-1) == 1 for t in (q, k, v))
        assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.is_contiguous() and cu_k.is_contiguous()
        assert dropout_p == 0.0 and isinstance(is_causal, bool) and isinstance(kwargs["scale"], float)
        self.causal.append(is_causal)  # False: full tasks of key-split plans (test_key_split)
        assert max_q >= 2  # the decode shortcut (max_q == 1 with GQA) is avoided
        lengths = (cu_q[1:] - cu_q[:-1]).max()
        assert max_q >= int(lengths)
        if self.window_args:
            left, right = kwargs["window_size_left"], kwargs["window_size_right"]
        else:
            assert "window_size_left" not in kwargs and "window_size_right" not in kwargs
            left, right = -1, -1
        return left, 0 if is_causal else right  # the op: `if (is_causal) window_size_right = 0`

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, **kwargs):
        assert return_debug_mask is False
        left, right = self._check(q, k, v, cu_q, cu_k, max_q, dropout_p, is_causal, kwargs)
        self.calls.append(("fwd", left, right))
        out, lse = _banded(q, k, v, cu_q, cu_k, kwargs["scale"], left, right)
        if self.lse_layout == "padded":
            lse = padded_lse(lse, cu_q, max_q)
        return out, lse.float(), torch.zeros(2), torch.empty(0), torch.empty(0)

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, rng_state, unused,
                 **kwargs):
        left, right = self._check(q, k, v, cu_q, cu_k, max_q, dropout_p, is_causal, kwargs)
        assert lse.dtype == torch.float32 and lse.shape == (q.shape[1], q.shape[0]) and lse.is_contiguous()
        assert dout.shape == out.shape == q.shape and dout.stride(-1) == 1
        self.calls.append(("bwd", left, right))
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        ref, _ = _banded(qq, kk, vv, cu_q, cu_k, kwargs["scale"], left, right)
        return torch.autograd.grad((ref * dout).sum(), (qq, kk, vv))

    def op(self, name):
        return {"_flash_attention_forward": self.forward, "_flash_attention_backward": self.backward}.get(name)


class FakeEfficient:
    """``aten::_efficient_attention_forward/backward`` on CPU: ``[1, total, heads, dim]``, equal head
    counts, ``custom_mask_type=2`` (bottom-right causal; 0: no mask, full tasks of key-split plans),
    per-task lse padded to 32."""

    def __init__(self, check_lse=True):
        self.calls, self.check_lse = [], check_lse

    def forward(self, q, k, v, bias, cu_q, cu_k, max_q, max_k, dropout_p, custom_mask_type, compute_lse, **kwargs):
        assert q.dim() == 4 and q.shape[0] == 1 and q.shape[2] == k.shape[2] == v.shape[2] and bias is None
        assert custom_mask_type in (0, 2) and compute_lse is True and dropout_p == 0.0 and "window_size" not in kwargs
        assert cu_q.dtype == torch.int32 and max_q <= q.shape[1] and max_k <= k.shape[1]
        self.calls.append("fwd")
        out, lse = _banded(q[0], k[0], v[0], cu_q, cu_k, kwargs["scale"], -1, 0 if custom_mask_type else -1)
        width = -(-max_q // 32) * 32
        return out[None], padded_lse(lse, cu_q, width), torch.empty(()), torch.empty(()), max_q, max_k

    def backward(self, dout, q, k, v, bias, out, cu_q, cu_k, max_q, max_k, lse, dropout_p, seed, offset,
                 custom_mask_type, bias_requires_grad, **kwargs):
        assert custom_mask_type in (0, 2) and not bias_requires_grad and dropout_p == 0.0
        assert q.shape[2] == k.shape[2] and dout.shape == out.shape == q.shape
        assert lse.shape[0] == len(cu_q) - 1 and lse.shape[2] % 32 == 0 and lse.shape[2] >= max_q
        right = 0 if custom_mask_type else -1
        if self.check_lse:  # the rows the kernel uses hold the forward's lse
            _, want = _banded(q[0], k[0], v[0], cu_q, cu_k, kwargs["scale"], -1, right)
            torch.testing.assert_close(packed_lse(lse, cu_q, q.shape[1]).double(), want, atol=1e-5, rtol=1e-6)
        self.calls.append("bwd")
        qq, kk, vv = (t[0].detach().requires_grad_() for t in (q, k, v))
        ref, _ = _banded(qq, kk, vv, cu_q, cu_k, kwargs["scale"], -1, right)
        grads = torch.autograd.grad((ref * dout[0]).sum(), (qq, kk, vv))
        return (*(g[None] for g in grads), torch.empty(()))

    def op(self, name):
        return {"_efficient_attention_forward": self.forward, "_efficient_attention_backward": self.backward}.get(name)


def _check_backend(module, q, k, v, cu_q, cu_k, window, scale=0.3):
    max_q = int((cu_q[1:] - cu_q[:-1]).max())
    max_k = int((cu_k[1:] - cu_k[:-1]).max())
    out, lse = module.forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, window=window)
    ref_out, ref_lse = _reference(q, k, v, cu_q, cu_k, scale, window)
    torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=1e-10)
    assert lse.shape == (q.shape[1], q.shape[0])
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-6)  # the kernels' lse is fp32
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=out.dtype)
    grads = module.backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, window=window)
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad((_reference(qq, kk, vv, cu_q, cu_k, scale, window)[0] * dout).sum(), (qq, kk, vv))
    for got, w, t in zip(grads, want, (q, k, v)):
        assert got.shape == t.shape
        torch.testing.assert_close(got, w, atol=1e-5, rtol=1e-5)  # fp32 lse into the backward


@pytest.mark.parametrize("lse_layout", ["packed", "padded"])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("head_dim", [16, 12])  # 12: padded to 16
@pytest.mark.parametrize("window", [None, 1, 3, 100])
def test_torch_cuda_glue_against_band_reference(monkeypatch, lse_layout, heads, kv_heads, head_dim, window):
    fake = FakeFlash(lse_layout)
    monkeypatch.setattr(torch_cuda, "_op", fake.op)
    monkeypatch.setattr(torch_cuda, "accepts_window", lambda: True)
    monkeypatch.setattr(torch_cuda, "lse_is_packed", lambda: lse_layout == "packed")
    if lse_layout == "padded":  # the backward takes the padded layout back
        fake_backward = fake.backward

        def backward(dout, q, k, v, out, lse, cu_q, *rest, **kwargs):
            assert lse.dim() == 3
            return fake_backward(dout, q, k, v, out, packed_lse(lse, cu_q, q.shape[0]), cu_q, *rest, **kwargs)

        fake.backward = backward
    q, k, v, cu_q, cu_k = _qkv(heads, kv_heads, head_dim)
    _check_backend(torch_cuda, q, k, v, cu_q, cu_k, window)
    left = -1 if window is None else window - 1
    assert fake.calls == [("fwd", left, 0), ("bwd", left, 0)]


def test_this_torch_keeps_the_varlen_lse_packed():
    """torch 2.13's flash op (read from its meta kernel): ``[heads, total_q]``."""
    torch_cuda.lse_is_packed.cache_clear()
    assert torch_cuda.lse_is_packed() is (not torch.version.hip)


def test_window_sizes_follow_hf_sliding_window():
    assert torch_cuda.window_sizes(None) == (-1, -1)
    assert torch_cuda.window_sizes(1) == (0, 0)  # the query's own key only
    assert torch_cuda.window_sizes(4096) == (4095, 0)


def test_one_query_tasks_with_gqa_and_a_task_without_queries(monkeypatch):
    """max_seqlen_q == 1 with GQA would take the op's decode shortcut, which assumes one query per task."""
    fake = FakeFlash()
    monkeypatch.setattr(torch_cuda, "_op", fake.op)
    monkeypatch.setattr(torch_cuda, "accepts_window", lambda: True)
    q, k, v, cu_q, cu_k = _qkv(8, 2, 16, shapes=[(1, 5), (0, 3), (1, 1), (1, 9)])
    _check_backend(torch_cuda, q, k, v, cu_q, cu_k, None)


def test_torch_without_window_arguments(monkeypatch):
    """An op without window_size_left/right: plain causal calls still use it (without those
    arguments), windowed ones run on math with a one-time warning that says why."""
    fake = FakeFlash(window_args=False)
    monkeypatch.setattr(torch_cuda, "_op", fake.op)
    monkeypatch.setattr(torch_cuda, "accepts_window", lambda: False)
    q, k, v, cu_q, cu_k = _qkv(4, 2, 16)
    _check_backend(torch_cuda, q, k, v, cu_q, cu_k, None)
    assert [c[0] for c in fake.calls] == ["fwd", "bwd"]
    with pytest.warns(UserWarning, match=r"flash op takes no window_size_left/right; using the math backend"):
        _check_backend(torch_cuda, q, k, v, cu_q, cu_k, 5)
    assert len(fake.calls) == 2  # the windowed call did not reach the op


@pytest.mark.parametrize("window, expected", [(None, "torch_cuda_efficient"), (7, "math")])
def test_head_dims_past_256_fall_back_with_a_warning(monkeypatch, window, expected):
    calls = []
    for module in (torch_cuda_efficient, math_backend):
        monkeypatch.setattr(module, "forward", lambda *a, m=module, **kw: calls.append(m.NAME) or "ran")
    monkeypatch.setattr(torch_cuda, "_op", lambda name: pytest.fail("the flash op must not be called"))
    q = torch.zeros(4, 2, 264)
    cu = _cu([4])
    with pytest.warns(UserWarning, match=rf"head dims up to 256, got 264; using {expected}"):
        assert torch_cuda.forward(q, q, q, cu, cu, 4, 4, 0.1, window=window) == "ran"
    assert calls == [expected]


def test_efficient_glue_gqa_and_padding(monkeypatch):
    fake = FakeEfficient()
    monkeypatch.setattr(torch_cuda_efficient, "_op", fake.op)
    for heads, kv_heads, dim in [(4, 4, 16), (6, 2, 12), (4, 1, 40)]:
        q, k, v, cu_q, cu_k = _qkv(heads, kv_heads, dim)
        _check_backend(torch_cuda_efficient, q, k, v, cu_q, cu_k, None)
    assert fake.calls == ["fwd", "bwd"] * 3


def test_efficient_runs_windows_on_math_with_a_warning(monkeypatch):
    monkeypatch.setattr(torch_cuda_efficient, "_op", lambda name: pytest.fail("the efficient op must not be called"))
    q, k, v, cu_q, cu_k = _qkv(4, 2, 8)
    with pytest.warns(UserWarning, match="does not apply a sliding window bottom-right in its backward; using the math"):
        _check_backend(torch_cuda_efficient, q, k, v, cu_q, cu_k, 3)


def test_pad_head_dim_is_exact():
    q, k, v, cu_q, cu_k = _qkv(4, 2, 12)
    qp, kp, vp = pad_head_dim(q, k, v)
    assert qp.shape[-1] == 16 and torch.equal(qp[..., :12], q) and not qp[..., 12:].any()
    assert pad_head_dim(qp)[0] is qp
    out, lse = math_backend.forward(q, k, v, cu_q, cu_k, 6, 12, 0.25)
    out_p, lse_p = math_backend.forward(qp, kp, vp, cu_q, cu_k, 6, 12, 0.25)
    torch.testing.assert_close(out_p[..., :12], out, atol=1e-13, rtol=0)
    assert not out_p[..., 12:].any()
    torch.testing.assert_close(lse_p, lse, atol=1e-13, rtol=0)


def test_lse_layouts_round_trip():
    lengths = [3, 0, 5, 1, 0, 2]
    cu = _cu(lengths)
    total = sum(lengths)
    lse = torch.randn(4, total)
    task, row = task_coordinates(cu, total)
    assert task.tolist() == [0, 0, 0, 2, 2, 2, 2, 2, 3, 5, 5]
    assert row.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 0, 1]
    padded = padded_lse(lse, cu, 32)
    assert padded.shape == (6, 4, 32) and padded.dtype == torch.float32
    for i, n in enumerate(lengths):
        torch.testing.assert_close(padded[i, :, :n], lse[:, int(cu[i]) : int(cu[i]) + n])
        assert torch.isinf(padded[i, :, n:]).all()
    torch.testing.assert_close(packed_lse(padded, cu, total), lse)
    assert packed_lse(lse, cu, total) is lse  # already packed


# --- selection with faked availability ---------------------------------------------------------------

def _fake_cuda(monkeypatch, flash_attn=False, torch_cuda_reason=None, efficient_reason=None):
    from distca_hf.kernels import flash_attn as flash_attn_backend

    monkeypatch.setattr(flash_attn_backend, "is_available", lambda d, t: flash_attn and d.type == "cuda"
                        and t in (torch.float16, torch.bfloat16))
    monkeypatch.setattr(torch_cuda, "unavailable_reason", lambda d, t: torch_cuda_reason)
    monkeypatch.setattr(torch_cuda_efficient, "unavailable_reason", lambda d, t: efficient_reason)


@pytest.mark.parametrize("dtype, expected", [(torch.bfloat16, "torch_cuda"), (torch.float16, "torch_cuda"),
                                             (torch.float32, "torch_cuda_efficient"), (torch.float64, "math")])
def test_auto_choice_on_cuda_without_flash_attn(monkeypatch, dtype, expected):
    _fake_cuda(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert select_backend("cuda", dtype).NAME == expected
    assert bool(caught) == (expected == "math")
    assert select_backend("cpu", dtype).NAME == "torch_cpu"


def test_flash_attn_stays_first_when_installed(monkeypatch):
    _fake_cuda(monkeypatch, flash_attn=True)
    assert select_backend("cuda", torch.bfloat16).NAME == "flash_attn"
    assert select_backend("cuda", torch.float32).NAME == "torch_cuda_efficient"


def test_a_torch_without_the_flash_op_falls_back_with_a_warning_naming_why(monkeypatch):
    monkeypatch.setattr(torch_cuda, "_op", lambda name: None)
    reason = torch_cuda.unavailable_reason(torch.device("cuda"), torch.bfloat16)
    assert reason == f"torch {torch.__version__} has no aten::_flash_attention_forward/backward"
    _fake_cuda(monkeypatch, torch_cuda_reason=reason)
    assert unavailable_reasons("cuda", torch.bfloat16) == {"torch_cuda": reason}
    with pytest.warns(UserWarning) as caught:
        assert select_backend("cuda", torch.bfloat16).NAME == "torch_cuda_efficient"
    assert str(caught[0].message) == f"distca: using kernel backend torch_cuda_efficient on cuda/bfloat16 (torch_cuda: {reason})"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per device/dtype
        select_backend("cuda", torch.bfloat16)


def test_an_old_gpu_falls_back_to_math_naming_both_reasons(monkeypatch):
    _fake_cuda(monkeypatch, torch_cuda_reason="flash attention needs compute capability 8.0 or newer, this GPU has 7.0",
               efficient_reason="bfloat16 needs compute capability 8.0 or newer, this GPU has 7.0")
    with pytest.warns(UserWarning, match=r"no fused varlen kernel for cuda/bfloat16; using the slow math backend "
                                         r"\(torch_cuda: flash attention needs .*; torch_cuda_efficient: bfloat16 needs"):
        assert select_backend("cuda", torch.bfloat16).NAME == "math"


def test_forced_backends_and_the_setting():
    import distca_hf

    _ = distca_hf.configure(kernel="torch_cuda")  # a valid setting even where it cannot run
    with pytest.raises(ValueError, match="'torch_cuda' cannot run on cpu"):
        select_backend("cpu", torch.bfloat16)
    distca_hf.configure(kernel="torch_cuda_efficient")
    with pytest.raises(ValueError, match="'torch_cuda_efficient' cannot run on cpu"):
        select_backend("cpu", torch.float32)


def test_kernel_bench_cuda_mode_on_a_small_workload(monkeypatch):
    """The CUDA mode's bookkeeping (task shapes, FLOPs, efficiency against whole documents), run on CPU
    with the CPU kernel standing in for the CUDA ones."""
    from distca_hf.planning import attention_flops
    from distca_hf.tools import kernel_bench

    assert kernel_bench.cuda_task_shapes([300, 1000], None) == [(300, 300), (1000, 1000)]
    assert kernel_bench.cuda_task_shapes([1000], 3) == [(384, 384), (384, 768), (232, 1000)]
    tail = kernel_bench.cuda_task_shapes([4096], "tail")
    assert tail == [(128, 4096 - 128 * i) for i in range(16)][::-1]
    monkeypatch.setattr(kernel_bench, "CUDA_WORKLOADS", {"whole_documents": ([300, 200], None),
                                                         "at_most_3_shards": ([300, 200], 3)})
    results = kernel_bench.run_cuda(4, 2, 16, torch.float32, repeats=1, device="cpu")
    whole, cut = results["whole_documents"]["torch_cpu"], results["at_most_3_shards"]["torch_cpu"]
    assert whole["pairs"] == cut["pairs"] == 300 * 301 // 2 + 200 * 201 // 2
    assert (whole["tasks"], cut["tasks"]) == (2, 5)
    assert whole["tflops"] == pytest.approx(attention_flops(whole["pairs"], 4, 16, backward=True) / whole["ms"] / 1e9)
    assert whole["efficiency"] == 1.0 and cut["efficiency"] == pytest.approx(cut["tflops"] / whole["tflops"])
    assert "| at_most_3_shards | torch_cpu | 5 |" in kernel_bench.format_cuda_table(results)


def test_kernel_bench_refuses_cuda_options_on_cpu(capsys):
    from distca_hf.tools import kernel_bench

    with pytest.raises(SystemExit):
        kernel_bench.main(["--device", "cpu", "--workload", "at_most_3_shards"])
    assert "not a cpu workload" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            kernel_bench.main(["--device", "cuda"])
        assert "torch sees no CUDA device" in capsys.readouterr().err
