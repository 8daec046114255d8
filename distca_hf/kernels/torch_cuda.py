"""CUDA backend: PyTorch's own flash-attention varlen kernels, in every CUDA build of torch.

``torch.ops.aten._flash_attention_forward`` / ``_flash_attention_backward`` (the ops behind
``torch.nn.attention.varlen.varlen_attn``) take packed ``[total, heads, head_dim]`` tensors with
``cum_seq_q`` / ``cum_seq_k``, grouped-query K/V natively (dK/dV keep the KV heads), ``is_causal``
aligned bottom-right when a task has more keys than queries (exactly a CA-task), a sliding window as
``window_size_left/right``, and return the log-sum-exp ``[heads, total_q]`` that distca's split
forward/backward needs. No flash-attn wheel or compile is needed.

What the op checks, and what this module does about it:

- fp16/bf16 only, compute capability 8.0+ (Ampere, Hopper, Blackwell): ``is_available`` says no
  otherwise, and the selection moves on (fp32 goes to ``torch_cuda_efficient``);
- head dim a multiple of 8: zero-padded here (exact, see ``varlen_layout.pad_head_dim``); at most
  256: larger head dims run on ``torch_cuda_efficient`` (or ``math`` under a window) with a one-time
  warning naming why;
- last dim contiguous, ``cu_seqlens`` int32 contiguous on the device: made so here;
- torch versions whose op has no ``window_size_left/right`` (read from its schema): windowed calls
  run on ``math`` with a one-time warning; plain causal calls still use the kernel;
- no logit softcapping in the op (``SUPPORTS_SOFTCAP`` is not set): the front door runs softcapped
  layers (Gemma 2) on ``math``;
- ``max_seqlen_q == 1`` with GQA takes a decode shortcut in the op that assumes one query per task;
  a task without queries would break it, so ``max_seqlen_q`` is passed as at least 2 (an upper bound
  is all the op needs).

Windows: HF's ``sliding_window = w`` (a query at position p sees keys ``[p - w + 1, p]``) is
``window_size_left = w - 1, window_size_right = 0``, counted from the bottom-right diagonal, which is
what a CA-task with a prefix needs.

Hopper and Blackwell: ``torch.nn.attention.activate_flash_attention_impl("FA3")`` (recent torch,
e.g. 2.13, with FlashAttention-3's ``flash_attn_interface`` installed; compute capability 9.0) or ``"FA4"``
(``flash_attn.cute``; 9.x and 10.x) re-registers these same aten ops for CUDA, so after that call
this backend runs FA3/FA4 without any change here; the op keeps its schema and the varlen
log-sum-exp layout. Call it once, before the first forward.
"""

from __future__ import annotations

import functools

import torch

from ..state import warn_once
from . import math as _math
from . import torch_cuda_efficient as _efficient
from .varlen_layout import aten_op as _op
from .varlen_layout import cuda_capability as _capability
from .varlen_layout import pad_head_dim, packed_lse, padded_lse

NAME = "torch_cuda"
MAX_HEAD_DIM = 256
_DTYPES = (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=None)
def accepts_window() -> bool:
    """Whether this torch's forward and backward ops take ``window_size_left/right``."""
    ops = (_op("_flash_attention_forward"), _op("_flash_attention_backward"))
    return all(op is not None and {"window_size_left", "window_size_right"} <= {a.name for a in op.default._schema.arguments}
               for op in ops)


@functools.lru_cache(maxsize=None)
def lse_is_packed() -> bool:
    """Whether this torch's flash op keeps the varlen log-sum-exp packed (``[heads, total_q]``, what
    its backward then takes too) rather than per task (``[tasks, heads, max_q]``: ROCm, and builds
    whose vendored flash-attn predates the unpadded lse). Read from the op's meta kernel on CUDA."""
    if torch.version.hip:
        return False
    q = torch.empty(4, 2, 8, device="meta", dtype=torch.float16)
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    try:
        lse = _op("_flash_attention_forward")(q, q, q, cu, cu, 2, 2, 0.0, True, False, scale=1.0)[1]
    except Exception:  # no meta kernel: the layout of every CUDA build that has one
        return True
    return lse.dim() == 2


def serves(device: torch.device, dtype: torch.dtype) -> bool:
    """The device and dtypes this backend is for (whether it can run is ``unavailable_reason``)."""
    return device.type == "cuda" and dtype in _DTYPES


def unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the kernel cannot run on ``device`` although it serves it, or ``None`` when it can."""
    if _op("_flash_attention_forward") is None or _op("_flash_attention_backward") is None:
        return f"torch {torch.__version__} has no aten::_flash_attention_forward/backward"
    flash_built = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    if not flash_built():
        return f"this torch build ({torch.__version__}) was compiled without flash attention"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    major, minor = _capability(device.index if device.index is not None else torch.cuda.current_device())
    if major < 8:
        return f"flash attention needs compute capability 8.0 or newer, this GPU has {major}.{minor}"
    return None


def is_available(device: torch.device, dtype: torch.dtype) -> bool:
    return serves(device, dtype) and unavailable_reason(device, dtype) is None


def window_sizes(window: int | None) -> tuple[int, int]:
    """HF's ``sliding_window`` -> the op's ``(window_size_left, window_size_right)`` for a causal
    mask: ``(-1, -1)`` for none (``is_causal`` sets the right side to 0 in the op)."""
    return (-1, -1) if window is None else (int(window) - 1, 0)


def fallback(head_dim: int, window: int | None):
    """The backend module to run instead of the flash op for this call, or ``None`` to use it; the
    first fallback of each kind warns once, naming why."""
    if head_dim > MAX_HEAD_DIM:
        other = _math if window is not None else _efficient
        warn_once(f"torch_cuda-head-dim:{head_dim}",
                  f"distca: torch_cuda's flash kernel takes head dims up to {MAX_HEAD_DIM}, got {head_dim}; "
                  f"using {other.NAME}")
        return other
    if window is not None and not accepts_window():
        warn_once("torch_cuda-window",
                  f"distca: torch {torch.__version__}'s flash op takes no window_size_left/right; "
                  "using the math backend for sliding-window layers")
        return _math
    return None


def _cu(cu: torch.Tensor, device: torch.device) -> torch.Tensor:
    return cu.to(device=device, dtype=torch.int32).contiguous()


def _window_kwargs(window: int | None) -> dict:
    if not accepts_window():
        return {}
    left, right = window_sizes(window)
    return {"window_size_left": left, "window_size_right": right}


def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window=None,
            causal=True):
    other = fallback(q.shape[-1], window)
    if other is not None:
        return other.forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                             window=window, causal=causal)
    head_dim, total_q = q.shape[-1], q.shape[0]
    lse_shape = (q.shape[1], total_q)
    if total_q == 0:
        return torch.empty_like(q), torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    qp, kp, vp = (t.contiguous() for t in pad_head_dim(q, k, v))
    cu_q, cu_k = _cu(cu_seqlens_q, q.device), _cu(cu_seqlens_k, q.device)
    out, lse, *_ = _op("_flash_attention_forward")(
        qp, kp, vp, cu_q, cu_k, max(int(max_seqlen_q), 2), int(max_seqlen_k), 0.0, bool(causal), False,
        scale=float(softmax_scale), **_window_kwargs(window),
    )
    out = out if out.shape[-1] == head_dim else out[..., :head_dim].contiguous()
    return out, packed_lse(lse, cu_q, total_q)


def backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
             window=None, causal=True):
    other = fallback(q.shape[-1], window)
    if other is not None:
        return other.backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              softmax_scale, window=window, causal=causal)
    head_dim = q.shape[-1]
    if q.shape[0] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dout_p, qp, kp, vp, out_p = (t.contiguous() for t in pad_head_dim(dout, q, k, v, out))
    cu_q, cu_k = _cu(cu_seqlens_q, q.device), _cu(cu_seqlens_k, q.device)
    max_q = max(int(max_seqlen_q), 2)
    lse = lse.to(torch.float32).contiguous()
    if not lse_is_packed():  # the op takes back the per-task layout its forward gave (see varlen_layout)
        lse = padded_lse(lse, cu_q, max_q)
    # dropout is 0, so the RNG state is never read; the same placeholders varlen_attn passes
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty(0, device=q.device)
    dq, dk, dv = _op("_flash_attention_backward")(
        dout_p, qp, kp, vp, out_p, lse, cu_q, cu_k, max_q, int(max_seqlen_k), 0.0, bool(causal), rng_state, unused,
        scale=float(softmax_scale), **_window_kwargs(window),
    )
    if dq.shape[-1] != head_dim:
        dq, dk, dv = (t[..., :head_dim].contiguous() for t in (dq, dk, dv))
    return dq, dk, dv
