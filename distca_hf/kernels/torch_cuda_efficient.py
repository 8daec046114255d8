"""CUDA backend for fp32 (and GPUs older than Ampere): PyTorch's memory-efficient varlen kernel.

``torch.ops.aten._efficient_attention_forward`` / ``_efficient_attention_backward`` (the CUTLASS
kernels from xFormers that SDPA's "efficient" backend runs) take ``cu_seqlens_q/k`` over one packed
row and ``custom_mask_type=2``: causal aligned bottom-right per task, exactly a CA-task. Why this
is the fp32 path: it is exact fp32 (on compute capability 8.0+ its matmuls are 3xTF32,
``OpMultiplyAddFastF32``, which keeps fp32 accuracy; SIMT fp32 before that), fused (no ``[lq, lk]``
score matrix in memory), varlen (one launch for every task, no per-task loop), and the only fused
CUDA kernel in torch that takes fp32: flash and cuDNN take fp16/bf16 only. The ``math`` backend it
replaces materialises scores chunk by chunk.

What the op needs, and what this module does about it:

- the same number of query and K/V heads: grouped K/V are repeated per query head here, and dK/dV
  summed back over each group (fp32 sums);
- ``[1, total, heads, head_dim]`` with a contiguous last dim: views of the packed tensors;
- its log-sum-exp is per task, padded (``[tasks, heads, ceil32(max_seqlen_q)]``): converted to and
  from distca's ``[heads, total_q]`` (``varlen_layout``);
- sliding windows: the kernel's ``window_size`` is not used. Its forward counts the window from the
  bottom-right diagonal but its backward (as vendored from xFormers) from the top-left one, which
  differ for a CA-task with a prefix; windowed calls run on ``math`` with a one-time warning.
"""

from __future__ import annotations

import torch

from ..state import warn_once
from . import math as _math
from .varlen_layout import aten_op as _op
from .varlen_layout import cuda_capability as _capability
from .varlen_layout import packed_lse, pad_head_dim, padded_lse

NAME = "torch_cuda_efficient"
CAUSAL_FROM_BOTTOM_RIGHT = 2  # sdp::CustomMaskType::CausalFromBottomRight
NO_MASK = 0  # sdp::CustomMaskType::NoCustomMask: a full task (every query sees every key)
LSE_ALIGN = 32
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def serves(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cuda" and dtype in _DTYPES


def unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the kernel cannot run on ``device`` although it serves it, or ``None`` when it can."""
    if _op("_efficient_attention_forward") is None or _op("_efficient_attention_backward") is None:
        return f"torch {torch.__version__} has no aten::_efficient_attention_forward/backward"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    if dtype == torch.bfloat16:
        major, minor = _capability(device.index if device.index is not None else torch.cuda.current_device())
        if major < 8:
            return f"bfloat16 needs compute capability 8.0 or newer, this GPU has {major}.{minor}"
    return None


def is_available(device: torch.device, dtype: torch.dtype) -> bool:
    return serves(device, dtype) and unavailable_reason(device, dtype) is None


def _windowed_on_math(window) -> bool:
    if window is None:
        return False
    warn_once("torch_cuda_efficient-window",
              "distca: torch_cuda_efficient's kernel does not apply a sliding window bottom-right in its backward; "
              "using the math backend for sliding-window layers")
    return True


def _as_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[total, kv_heads, d]`` -> ``[1, total, heads, d]`` contiguous, K/V heads repeated per group."""
    if t.shape[1] != heads:
        t = t.repeat_interleave(heads // t.shape[1], dim=1)
    return t.contiguous().unsqueeze(0)


def _sum_groups(g: torch.Tensor, kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """``[total, heads, d]`` gradient of repeated K/V -> ``[total, kv_heads, d]``."""
    total, heads, d = g.shape
    if heads == kv_heads:
        return g
    return g.reshape(total, kv_heads, heads // kv_heads, d).sum(2, dtype=torch.float32).to(dtype)


def lse_width(max_seqlen_q: int) -> int:
    """Row width of the kernel's per-task log-sum-exp: the backward loads it in aligned groups of
    ``LSE_ALIGN`` (``kAlignLSE``), so a row must reach past the longest task to the next multiple."""
    return -(-max_seqlen_q // LSE_ALIGN) * LSE_ALIGN


def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window=None,
            causal=True):
    if _windowed_on_math(window):
        return _math.forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                             window=window, causal=causal)
    total_q, heads, head_dim = q.shape
    if total_q == 0:
        return torch.empty_like(q), torch.empty(heads, 0, dtype=torch.float32, device=q.device)
    qp, kp, vp = pad_head_dim(q, k, v)
    cu_q = cu_seqlens_q.to(device=q.device, dtype=torch.int32).contiguous()
    cu_k = cu_seqlens_k.to(device=q.device, dtype=torch.int32).contiguous()
    out, lse, *_ = _op("_efficient_attention_forward")(
        _as_rows(qp, heads), _as_rows(kp, heads), _as_rows(vp, heads), None, cu_q, cu_k,
        min(int(max_seqlen_q), total_q), min(int(max_seqlen_k), k.shape[0]), 0.0,
        CAUSAL_FROM_BOTTOM_RIGHT if causal else NO_MASK, True,
        scale=float(softmax_scale),
    )
    out = out[0]
    if out.shape[-1] != head_dim:
        out = out[..., :head_dim].contiguous()
    return out, packed_lse(lse, cu_q, total_q)


def backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
             window=None, causal=True):
    if _windowed_on_math(window):
        return _math.backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              softmax_scale, window=window, causal=causal)
    total_q, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if total_q == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dout_p, qp, kp, vp, out_p = pad_head_dim(dout, q, k, v, out)
    cu_q = cu_seqlens_q.to(device=q.device, dtype=torch.int32).contiguous()
    cu_k = cu_seqlens_k.to(device=q.device, dtype=torch.int32).contiguous()
    max_q, max_k = min(int(max_seqlen_q), total_q), min(int(max_seqlen_k), k.shape[0])
    seed = torch.empty((), dtype=torch.int64)  # dropout is 0: the philox seed/offset are never read
    dq, dk, dv, _ = _op("_efficient_attention_backward")(
        _as_rows(dout_p, heads), _as_rows(qp, heads), _as_rows(kp, heads), _as_rows(vp, heads), None,
        _as_rows(out_p, heads), cu_q, cu_k, max_q, max_k, padded_lse(lse, cu_q, lse_width(max_q)), 0.0, seed, seed,
        CAUSAL_FROM_BOTTOM_RIGHT if causal else NO_MASK, False, scale=float(softmax_scale),
    )
    dq, dk, dv = dq[0], dk[0], dv[0]
    if dq.shape[-1] != head_dim:
        dq, dk, dv = (t[..., :head_dim] for t in (dq, dk, dv))
    return dq.contiguous(), _sum_groups(dk, kv_heads, k.dtype).contiguous(), _sum_groups(dv, kv_heads, v.dtype).contiguous()
