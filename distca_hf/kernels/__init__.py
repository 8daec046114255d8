"""Varlen causal attention over a fused batch of CA-tasks, behind one signature.

Shapes (flash-attn's varlen convention):
    q:   ``[total_q, num_heads, head_dim]``
    k:   ``[total_k, num_kv_heads, head_dim]`` (grouped-query: ``num_heads % num_kv_heads == 0``)
    v:   ``[total_k, num_kv_heads, value_head_dim]`` (usually ``value_head_dim == head_dim``)
    cu_seqlens_q, cu_seqlens_k: ``[num_tasks + 1]`` int32, cumulative rows per task
    out: ``[total_q, num_heads, value_head_dim]``; lse: ``[num_heads, total_q]`` fp32 (natural log)

Task ``i`` has queries ``q[cu_q[i]:cu_q[i+1]]`` and keys ``k[cu_k[i]:cu_k[i+1]]`` with
``lk >= lq``; the causal mask is aligned bottom-right: query ``j`` sees keys ``0 .. j + lk - lq``.
With a sliding ``window`` (HF's ``sliding_window``, a number of keys), query ``j`` sees only keys
``j + lk - lq - window + 1 .. j + lk - lq`` (flash-attn's ``window_size=(window - 1, 0)``): the
window counts back from the query's own position, so a task whose keys are a suffix of the
document's prefix (``[max(0, a - window + 1), b)`` for queries ``[a, b)``) is exact. With
``softcap`` (Gemma 2's attention logit softcapping) the scaled scores become ``softcap *
tanh(scores / softcap)`` before the softmax; backends that cannot apply it (``SUPPORTS_SOFTCAP``
false) hand such calls to ``math``, with a one-time warning. With ``chunk`` (Llama 4's
``attention_chunk_size``, on its ``"chunked_attention"`` layers) the query at key column ``p`` sees
only the keys ``[p // chunk * chunk, p]``: chunks count from a task's first key, so every task must
carry its document's keys from position 0 (whole prefixes, as CA-tasks do without a window cut).
A chunk is a document of its own, so chunked calls run here as plain causal sub-tasks, one per
(task, chunk) (``chunk_tasks``), on any backend. ``AttentionVariant`` carries all three.

Value head dim: ``v`` may have another head dim than ``q``/``k`` (DeepSeek's multi-head latent
attention: 192 for q/k, 128 for v); ``out`` then has v's. Backends that take only one head dim
(``SUPPORTS_VALUE_HEAD_DIM`` false: every fused kernel) get the narrower side zero-padded to the
wider here, which is exact (zero columns add nothing to a score, and give zero output columns,
which are cut off); ``math`` takes both as they are.

Full tasks: ``full`` (a bool per task, optional) marks tasks whose every query sees every key (no
mask): the key-split tiles of a CA-task whose keys end before its queries begin (queries ``[a, b)``
against keys ``[k0, k1)`` with ``k1 <= a + 1``; under a sliding window the caller cuts them so that
every query's window holds all of them, ``k0 >= b - window``, and no window is applied to them).
Such a task may have fewer keys than queries. Full tasks come after every causal task (as
``planning.fused_batch`` orders a key-split batch), so the front door runs the causal tasks and the
full tasks as two kernel calls on slices of the fused batch, no copy (backends take
``causal=False``); ``max_seqlen_q/k`` of the batch bound both calls. ``chunk`` takes whole prefixes
only. A task's partial ``(out, lse)`` merges with the row's other partials by
``merge.merge_rows``; its backward takes the merged ``out`` and ``lse``.

Backends, in the order ``auto`` tries them: ``flash_attn`` (CUDA, fp16/bf16, when flash-attn is
installed), ``torch_cuda`` (PyTorch's own flash varlen ops: CUDA, fp16/bf16, compute capability
8.0+, no extra install), ``torch_cuda_efficient`` (PyTorch's memory-efficient varlen kernel: CUDA
fp32, and fp16 before Ampere), ``torch_cpu`` (PyTorch's fused CPU flash kernel, the winner of
``distca-hf kernel-bench`` on CPU), ``math`` (plain torch, any device; the fallback, with a one-time
warning). A backend that serves a device and dtype but cannot run there (an old torch, an old GPU)
is skipped with a one-time warning naming why. ``DISTCA_KERNEL`` or the ``backend`` argument forces
one.
"""

from __future__ import annotations

import itertools
import math as _pymath
from dataclasses import dataclass
from types import ModuleType

import torch

from ..config import current_config
from ..state import warn_once
from . import flash_attn as _flash_attn
from . import math as _math
from .math import accumulation_dtype, check_causal_task
from . import torch_cpu as _torch_cpu
from . import torch_cuda as _torch_cuda
from . import torch_cuda_efficient as _torch_cuda_efficient
from .merge import merge_partials, merge_rows

__all__ = [
    "AttentionVariant",
    "BACKENDS",
    "chunk_tasks",
    "available_backends",
    "unavailable_reasons",
    "select_backend",
    "varlen_attention_forward",
    "varlen_attention_backward",
    "varlen_causal_attention",
    "merge_partials",
    "merge_rows",
    "accumulation_dtype",
]

BACKENDS: dict[str, ModuleType] = {
    m.NAME: m for m in (_flash_attn, _torch_cuda, _torch_cuda_efficient, _torch_cpu, _math)
}
_AUTO_ORDER = (_flash_attn, _torch_cuda, _torch_cuda_efficient, _torch_cpu)


def available_backends(device: torch.device | str, dtype: torch.dtype) -> list[str]:
    """Names of the backends that can run on ``device`` with ``dtype``, fastest first."""
    device = torch.device(device)
    return [name for name, m in BACKENDS.items() if m.is_available(device, dtype)]


def unavailable_reasons(device: torch.device | str, dtype: torch.dtype) -> dict[str, str]:
    """``{backend: why}`` for the backends meant for ``device`` and ``dtype`` (their ``serves``) that
    cannot run there (their ``unavailable_reason``): a torch without the op, a GPU too old."""
    device = torch.device(device)
    reasons = {}
    for name, m in BACKENDS.items():
        if hasattr(m, "serves") and m.serves(device, dtype):
            reason = m.unavailable_reason(device, dtype)
            if reason:
                reasons[name] = reason
    return reasons


def select_backend(device: torch.device | str, dtype: torch.dtype, name: str | None = None) -> ModuleType:
    """The backend to use: ``name``, else the ``kernel`` setting (``DISTCA_KERNEL`` /
    ``configure(kernel=...)``), else the fastest available."""
    device = torch.device(device)
    name = name or current_config().kernel
    if name != "auto":
        if name not in BACKENDS:
            raise ValueError(
                f"unknown distca kernel backend {name!r} (from the backend argument or DISTCA_KERNEL); "
                f"expected one of {['auto', *BACKENDS]}"
            )
        backend = BACKENDS[name]
        if not backend.is_available(device, dtype):
            raise ValueError(f"distca kernel backend {name!r} cannot run on {device} with {dtype}")
        return backend
    skipped = unavailable_reasons(device, dtype)
    why = "; ".join(f"{n}: {r}" for n, r in skipped.items())
    where = f"{device.type}/{str(dtype).removeprefix('torch.')}"
    for backend in _AUTO_ORDER:
        if backend.is_available(device, dtype):
            if any(_AUTO_ORDER.index(BACKENDS[n]) < _AUTO_ORDER.index(backend) for n in skipped):
                warn_once(f"kernel-skipped:{where}", f"distca: using kernel backend {backend.NAME} on {where} ({why})")
            return backend
    hint = f" ({why})" if why else ""
    if device.type == "cuda" and not why:
        hint = " (the fused CUDA kernels take float32, float16 and bfloat16)"
    warn_once(f"kernel-fallback:{where}", f"distca: no fused varlen kernel for {where}; using the slow math backend{hint}")
    return _math


def _check(q, k, v, cu_seqlens_q, cu_seqlens_k):
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"q, k, v must be [tokens, heads, head_dim], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape[:2] != v.shape[:2] or q.shape[2] != k.shape[2]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same rows and heads, and k q's "
                         f"head_dim ({q.shape[2]}); v may have its own head_dim")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    if not q.dtype == k.dtype == v.dtype or not q.device == k.device == v.device:  # (torch's bare error, or a cast)
        raise TypeError(f"q, k, v must share one dtype and device, got {q.dtype} / {k.dtype} / {v.dtype} on "
                        f"{q.device} / {k.device} / {v.device}; cast them first (HF's attention: to_compute_dtype)")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not torch.is_tensor(cu) or cu.is_floating_point() or cu.is_complex() or cu.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor (int32 offsets: 0, then each task's end), got "
                            f"{type(cu).__name__ if not torch.is_tensor(cu) else cu.dtype}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.dim() != 1 or cu_seqlens_q.numel() < 1:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be 1D with one entry per task plus one")
    if cu_seqlens_q.device.type == "cpu" and cu_seqlens_k.device.type == "cpu":
        # (on the host only: never at the cost of a device synchronisation; a kernel given offsets that
        # go back reads out of bounds: the CPU one stopped the process with SIGFPE)
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if int(cu[0]) != 0 or bool((cu.diff() < 0).any()):
                raise ValueError(f"{name} must start at 0 and never decrease (task i holds rows cu[i]:cu[i + 1]), "
                                 f"got {cu.tolist()}")
        if int(cu_seqlens_q[-1]) != q.shape[0] or int(cu_seqlens_k[-1]) != k.shape[0]:
            raise ValueError(
                f"cu_seqlens end at ({int(cu_seqlens_q[-1])}, {int(cu_seqlens_k[-1])}) but q has {q.shape[0]} "
                f"rows and k has {k.shape[0]}"
            )


@dataclass(frozen=True)
class AttentionVariant:
    """What a layer adds to plain causal attention (see the module docstring).

    Attributes:
        window: keys a query sees, its own included (HF's ``sliding_window``); ``None``: all before it.
        softcap: attention logit softcapping (HF's ``softcap``, Gemma 2); ``None`` or 0: none.
        chunk: chunked attention (Llama 4's ``attention_chunk_size``, in tokens): a query at document
            position ``p`` sees keys ``[p // chunk * chunk, p]``; ``None``: no chunks.
    """

    window: int | None = None
    softcap: float | None = None
    chunk: int | None = None

    def __post_init__(self):
        window, softcap, chunk = self.window, self.softcap, self.chunk
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"window must be None or a positive number of keys (HF's sliding_window), got {window!r}")
        if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                    or not _pymath.isfinite(softcap) or softcap < 0):
            raise ValueError(f"softcap must be None or a finite number >= 0 (HF's softcap), got {softcap!r}")
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"chunk must be None or a positive number of tokens (HF's attention_chunk_size), "
                             f"got {chunk!r}")
        object.__setattr__(self, "softcap", float(softcap) if softcap else None)


def _kernel_for(q, backend, variant: AttentionVariant) -> ModuleType:
    """The backend that runs this call: softcapping needs one that supports it. A backend named in the
    call's ``backend`` argument that cannot cap raises; one chosen by the ``kernel`` setting (or
    ``auto``) hands capped calls to ``math`` with a one-time warning, so a job-wide setting never
    breaks a softcapped model."""
    kernel = select_backend(q.device, q.dtype, backend)
    if variant.softcap and not getattr(kernel, "SUPPORTS_SOFTCAP", False):
        if backend is not None:
            raise ValueError(f"distca kernel backend {backend!r} cannot apply softcap; use 'math' or 'flash_attn'")
        warn_once(f"softcap:{kernel.NAME}", f"distca: the {kernel.NAME} kernel cannot apply attention logit "
                  "softcapping; those layers run on the exact but slower math backend")
        return _math
    return kernel


def _variant_keywords(variant: AttentionVariant) -> dict:
    # Backends that know no softcap are never handed one (``_kernel_for``), so it is passed only when set.
    return {"window": variant.window, **({"softcap": variant.softcap} if variant.softcap else {})}


@dataclass(frozen=True)
class ChunkedTasks:
    """A fused batch's tasks cut at chunk boundaries (``chunk_tasks``): plain causal sub-tasks over
    the same query rows, in the same order, and the key rows ``key_rows`` (``[total_k']``, long) they
    take from the batch's ``k``/``v``."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    key_rows: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def chunk_tasks(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, chunk: int) -> ChunkedTasks | None:
    """Chunked attention as plain causal attention: task ``i`` (queries at key columns ``[lk - lq,
    lk)``, key column = document position) becomes one sub-task per chunk ``c`` its queries reach,
    with queries ``[max(lk - lq, c * chunk), min(lk, (c + 1) * chunk))`` and keys ``[c * chunk,
    min(lk, (c + 1) * chunk))``: bottom-right causal inside the chunk is exactly the chunked mask.
    ``None`` when no task has a key past the first chunk (nothing to cut)."""
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if max((b - a for a, b in zip(cu_k, cu_k[1:])), default=0) <= chunk:
        return None
    q_lengths, k_lengths, key_starts = [], [], []
    for i in range(len(cu_q) - 1):
        lq, lk, k0 = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i], cu_k[i]
        check_causal_task(i, lq, lk)
        for c in range((lk - lq) // chunk, (lk - 1) // chunk + 1) if lq else ():
            first, end = c * chunk, min(lk, (c + 1) * chunk)
            q_lengths.append(end - max(lk - lq, first))
            k_lengths.append(end - first)
            key_starts.append(k0 + first)
    device = cu_seqlens_q.device
    cumulative = lambda lengths: torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    key_rows = torch.cat([torch.arange(s, s + n) for s, n in zip(key_starts, k_lengths)]) if k_lengths else \
        torch.zeros(0, dtype=torch.long)
    return ChunkedTasks(cumulative(q_lengths), cumulative(k_lengths), key_rows.to(device),
                        max(q_lengths, default=0), max(k_lengths, default=0))


def _pad_last(t: torch.Tensor, width: int) -> torch.Tensor:
    return t if t.shape[-1] == width else torch.nn.functional.pad(t, (0, width - t.shape[-1]))


def _run_forward(kernel, q, k, v, cu_q, cu_k, max_q, max_k, scale, variant, causal=True):
    """One backend's forward, with v's head dim padded to q's (or q/k's to v's) where the backend
    takes only one head dim; returns ``out`` with v's head dim. ``causal=False``: full tasks."""
    value_dim = v.shape[-1]
    keywords = {**_variant_keywords(variant), **({} if causal else {"causal": False})}
    if value_dim != q.shape[-1] and not getattr(kernel, "SUPPORTS_VALUE_HEAD_DIM", False):
        width = max(value_dim, q.shape[-1])
        out, lse = kernel.forward(_pad_last(q, width), _pad_last(k, width), _pad_last(v, width), cu_q, cu_k, max_q,
                                  max_k, scale, **keywords)
        return out[..., :value_dim].contiguous(), lse
    return kernel.forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, **keywords)


def _run_backward(kernel, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, variant, causal=True):
    """One backend's backward, padded as ``_run_forward`` (zero columns of out and dO add nothing to
    the softmax gradient's row sums); returns gradients shaped like q, k, v."""
    head_dim, value_dim = q.shape[-1], v.shape[-1]
    keywords = {**_variant_keywords(variant), **({} if causal else {"causal": False})}
    if value_dim != head_dim and not getattr(kernel, "SUPPORTS_VALUE_HEAD_DIM", False):
        width = max(value_dim, head_dim)
        dq, dk, dv = kernel.backward(*(_pad_last(t, width) for t in (dout, q, k, v, out)), lse, cu_q, cu_k, max_q,
                                     max_k, scale, **keywords)
        return dq[..., :head_dim].contiguous(), dk[..., :head_dim].contiguous(), dv[..., :value_dim].contiguous()
    return kernel.backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, **keywords)


def _full_flags(full, num_tasks: int) -> list[bool] | None:
    """``full`` as a list of ``num_tasks`` bools, or ``None`` when no task is full."""
    if full is None:
        return None
    flags = [bool(f) for f in (full.tolist() if isinstance(full, torch.Tensor) else full)]
    if len(flags) != num_tasks:
        raise ValueError(f"full must hold one flag per task ({num_tasks}), got {len(flags)}")
    return flags if any(flags) else None


@dataclass(frozen=True)
class _Halves:
    """A fused batch whose causal tasks (the first ``num_causal``) come before its full ones, as two
    batches of their own: ``causal_rows`` / ``causal_keys`` rows of q / k belong to the causal tasks,
    the rest to the full ones, so each half is a slice of the batch's tensors (no copy). ``cu_*``
    (int32, on the batch's device) describe each half; the batch's maxima bound both."""

    num_causal: int
    causal_rows: int
    causal_keys: int
    cu_q_causal: torch.Tensor
    cu_k_causal: torch.Tensor
    cu_q_full: torch.Tensor
    cu_k_full: torch.Tensor


def _halves(cu_seqlens_q, cu_seqlens_k, flags: list[bool], causal_rows) -> _Halves:
    """The batch's causal and full halves. ``causal_rows``: ``(query rows, key rows)`` of the causal
    tasks, as ``FusedBatch.causal_rows`` carries them, or ``None`` to read them from ``cu_seqlens``
    (a device synchronisation when those live on a GPU)."""
    num_causal = flags.index(True)
    if not all(flags[num_causal:]):
        raise ValueError("full tasks must follow the causal ones (planning.fused_batch orders a key-split batch "
                         f"so); got full={flags}")
    if causal_rows is None:
        causal_rows = (int(cu_seqlens_q[num_causal]), int(cu_seqlens_k[num_causal]))
    rows, keys = (int(x) for x in causal_rows)
    if cu_seqlens_q.device.type == "cpu" and (rows, keys) != (int(cu_seqlens_q[num_causal]),
                                                             int(cu_seqlens_k[num_causal])):
        raise ValueError(f"causal_rows {(rows, keys)} disagree with cu_seqlens, whose first {num_causal} (causal) "
                         f"tasks hold {int(cu_seqlens_q[num_causal])} query and {int(cu_seqlens_k[num_causal])} "
                         "key rows")
    cu_q, cu_k = cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32)
    return _Halves(num_causal, rows, keys, cu_q[:num_causal + 1], cu_k[:num_causal + 1], cu_q[num_causal:] - rows,
                   cu_k[num_causal:] - keys)


def _check_full_keys(halves: _Halves, cu_seqlens_q, cu_seqlens_k) -> None:
    if cu_seqlens_q.device.type != "cpu":
        return  # checked on the host only (as _check), never at the cost of a device synchronisation
    q_len, k_len = (torch.diff(c[halves.num_causal:]) for c in (cu_seqlens_q, cu_seqlens_k))
    if bool(((q_len > 0) & (k_len == 0)).any()):
        raise ValueError("a full task has queries but no keys; every query of a CA-task must see a key")


def _forward_with_full(kernel, q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, flags, causal_rows, scale,
                       variant):
    """Forward of a batch holding full tasks after its causal ones: the causal half under
    ``variant``, the full half unmasked (no window), each in one kernel call on slices of q, k, v."""
    if variant.chunk:
        raise ValueError("chunked attention (attention_chunk_size) takes whole-prefix CA-tasks only, not full "
                         "(key-split) tasks")
    h = _halves(cu_seqlens_q, cu_seqlens_k, flags, causal_rows)
    _check_full_keys(h, cu_seqlens_q, cu_seqlens_k)
    r, n = h.causal_rows, h.causal_keys
    parts = []
    if h.num_causal:
        parts.append(_run_forward(kernel, q[:r], k[:n], v[:n], h.cu_q_causal, h.cu_k_causal, max_q, max_k, scale,
                                  variant))
    parts.append(_run_forward(kernel, q[r:], k[n:], v[n:], h.cu_q_full, h.cu_k_full, max_q, max_k, scale,
                              AttentionVariant(softcap=variant.softcap), causal=False))
    if len(parts) == 1:
        return parts[0]
    (out, lse), (full_out, full_lse) = parts
    return torch.cat([out, full_out]), torch.cat([lse, full_lse.to(lse.dtype)], dim=1)


def _backward_with_full(kernel, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_q, max_k, flags,
                        causal_rows, scale, variant):
    h = _halves(cu_seqlens_q, cu_seqlens_k, flags, causal_rows)
    r, n = h.causal_rows, h.causal_keys
    parts = []
    if h.num_causal:
        parts.append(_run_backward(kernel, dout[:r], q[:r], k[:n], v[:n], out[:r], lse[:, :r].contiguous(),
                                   h.cu_q_causal, h.cu_k_causal, max_q, max_k, scale, variant))
    parts.append(_run_backward(kernel, dout[r:], q[r:], k[n:], v[n:], out[r:], lse[:, r:].contiguous(), h.cu_q_full,
                               h.cu_k_full, max_q, max_k, scale, AttentionVariant(softcap=variant.softcap),
                               causal=False))
    if len(parts) == 1:
        return parts[0]
    return tuple(torch.cat([c, f.to(c.dtype)]) for c, f in zip(*parts))


def varlen_attention_forward(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, backend=None, *, window=None,
    softcap=None, chunk=None, full=None, causal_rows=None
):
    """Forward of a fused CA-task batch. Returns ``(out, lse)``; no autograd graph is recorded.
    ``full``: ``[num_tasks]`` bools, the tasks whose every query sees every key, after every causal
    task (see the module docstring), or ``None``. ``causal_rows``: ``(query rows, key rows)`` of the
    causal tasks (``FusedBatch.causal_rows``), so that the halves are found without reading a GPU's
    ``cu_seqlens``; ``None``: read from them."""
    _check(q, k, v, cu_seqlens_q, cu_seqlens_k)
    variant = AttentionVariant(window, softcap, chunk)
    kernel = _kernel_for(q, backend, variant)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    flags = _full_flags(full, cu_seqlens_q.numel() - 1)
    if flags is not None:
        with torch.no_grad():
            return _forward_with_full(kernel, q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                      int(max_seqlen_k), flags, causal_rows, scale, variant)
    cut = chunk_tasks(cu_seqlens_q, cu_seqlens_k, chunk) if chunk else None
    with torch.no_grad():
        if cut is None:
            return _run_forward(kernel, q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                                scale, variant)
        return _run_forward(kernel, q, k.index_select(0, cut.key_rows), v.index_select(0, cut.key_rows),
                            cut.cu_seqlens_q, cut.cu_seqlens_k, cut.max_seqlen_q, cut.max_seqlen_k, scale, variant)


def varlen_attention_backward(
    dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, backend=None,
    *, window=None, softcap=None, chunk=None, full=None, causal_rows=None
):
    """Backward of ``varlen_attention_forward``: returns ``(dq, dk, dv)`` shaped like q, k, v
    (gradients of grouped K/V heads summed over their query heads). ``out`` and ``lse`` may be a
    row's merged ones (``kernels.merge``): each task then gets its share of the gradient. ``full``
    and ``causal_rows``: as the forward's."""
    variant = AttentionVariant(window, softcap, chunk)
    kernel = _kernel_for(q, backend, variant)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    flags = _full_flags(full, cu_seqlens_q.numel() - 1)
    if flags is not None:
        if chunk:
            raise ValueError("chunked attention (attention_chunk_size) takes whole-prefix CA-tasks only, not full "
                             "(key-split) tasks")
        with torch.no_grad():
            return _backward_with_full(kernel, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                       int(max_seqlen_q), int(max_seqlen_k), flags, causal_rows, scale, variant)
    cut = chunk_tasks(cu_seqlens_q, cu_seqlens_k, chunk) if chunk else None
    with torch.no_grad():
        if cut is None:
            return _run_backward(kernel, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                 int(max_seqlen_k), scale, variant)
        dq, dk_cut, dv_cut = _run_backward(kernel, dout, q, k.index_select(0, cut.key_rows),
                                           v.index_select(0, cut.key_rows), out, lse, cut.cu_seqlens_q,
                                           cut.cu_seqlens_k, cut.max_seqlen_q, cut.max_seqlen_k, scale, variant)
        dk = torch.zeros_like(k).index_add_(0, cut.key_rows, dk_cut)
        dv = torch.zeros_like(v).index_add_(0, cut.key_rows, dv_cut)
        return dq, dk, dv


class _VarlenCausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, backend,
                variant: AttentionVariant):
        out, lse = varlen_attention_forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, backend,
            window=variant.window, softcap=variant.softcap, chunk=variant.chunk
        )
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.args = (max_seqlen_q, max_seqlen_k, softmax_scale, backend, variant)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        max_q, max_k, scale, backend, variant = ctx.args
        dq, dk, dv = varlen_attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, backend,
                                               window=variant.window, softcap=variant.softcap, chunk=variant.chunk)
        return dq, dk, dv, None, None, None, None, None, None, None


def varlen_causal_attention(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, backend=None, *, window=None,
    softcap=None, chunk=None
) -> torch.Tensor:
    """Differentiable bottom-right causal attention over a fused batch of CA-tasks, optionally under
    a sliding ``window`` (keys per query), logit ``softcap`` and attention ``chunk`` (see the module
    docstring).

    Returns ``out [total_q, num_heads, value_head_dim]``; see the module docstring for the layout.
    """
    return _VarlenCausalAttention.apply(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, backend,
        AttentionVariant(window, softcap, chunk)
    )
