"""CUDA backend: flash-attn's varlen kernels, called directly.

``causal=True`` in flash-attn >= 2.1 aligns the mask bottom-right when a sequence has more keys than
queries, which is exactly a CA-task; grouped-query attention is native (K/V keep
``num_key_value_heads`` heads). HF's own flash wrapper is tied to the ``flash_attention_2`` name,
so we call ``_flash_attn_varlen_forward/backward`` ourselves to get the log-sum-exp and an explicit
backward (the dispatcher needs both).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

NAME = "flash_attn"
SUPPORTS_SOFTCAP = True
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=None)
def _interface():
    try:
        from flash_attn import flash_attn_interface
    except Exception:  # ImportError, or a wheel built against another torch (undefined symbol)
        return None
    return flash_attn_interface


def is_available(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cuda" and dtype in _SUPPORTED_DTYPES and _interface() is not None


def _pad_head_dim(*tensors):
    """The kernels want a head dim that is a multiple of 8."""
    head_dim = tensors[0].shape[-1]
    if head_dim % 8 == 0:
        return tensors
    return tuple(F.pad(t, (0, 8 - head_dim % 8)) for t in tensors)


def _window_kwargs(fn, window: int | None) -> dict:
    """flash-attn's window arguments for HF's ``sliding_window`` (``window`` keys per query, its own
    included): ``(window - 1, 0)`` keys left and right of the bottom-right diagonal, ``(-1, -1)`` for
    none. flash-attn 2.7 split ``window_size`` into left/right arguments."""
    left, right = (-1, -1) if window is None else (window - 1, 0)
    try:
        import inspect

        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    if "window_size" in params:
        return {"window_size": (left, right)}
    return {"window_size_left": left, "window_size_right": right}


def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window=None,
            softcap=None, causal=True):
    fa = _interface()
    head_dim = q.shape[-1]
    qp, kp, vp = _pad_head_dim(q, k, v)
    fn = fa._flash_attn_varlen_forward
    result = fn(
        qp, kp, vp, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        dropout_p=0.0, softmax_scale=softmax_scale, causal=bool(causal), softcap=float(softcap or 0.0), alibi_slopes=None,
        return_softmax=False, **_window_kwargs(fn, window),
    )
    # flash-attn 2.6 returns (out, q, k, v, out_padded, lse, S_dmask, rng_state); 2.7+ (out, lse, S_dmask, rng_state).
    out, lse = result[0], result[5] if len(result) == 8 else result[1]
    return out[..., :head_dim], lse


def backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
             window=None, softcap=None, causal=True):
    fa = _interface()
    head_dim = q.shape[-1]
    dout_p, qp, kp, vp, out_p = _pad_head_dim(dout.contiguous(), q, k, v, out)
    dq, dk, dv = torch.empty_like(qp), torch.empty_like(kp), torch.empty_like(vp)
    fn = fa._flash_attn_varlen_backward
    fn(
        dout_p, qp, kp, vp, out_p, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        dropout_p=0.0, softmax_scale=softmax_scale, causal=bool(causal), softcap=float(softcap or 0.0), alibi_slopes=None,
        deterministic=False, rng_state=None, **_window_kwargs(fn, window),
    )
    return dq[..., :head_dim], dk[..., :head_dim], dv[..., :head_dim]
