"""The collective that opens a forward: every rank of the server group learns what the others hold
and how they want to run, so that all of them take the same decision.

Each rank all-gathers a header ``(payload size or -1 when its inputs were invalid, path, settings
fingerprint, attention signature)`` and an int64 payload (its document lengths; for ping-pong, its
nano-batches' description). Then every rank raises the same error when one rank's inputs were
invalid, the settings differ, only some ranks run the ping-pong stack, or the ranks' attention calls
differ in dtype, heads, head sizes or whether they will run a backward (the bytes each rank sends
are read by the others as their own dtype and shapes: a float16 rank serving a bfloat16 rank's
queries returned garbage without a word, and one whose elements have another size aborted the
process); otherwise all go on with the same payloads, so they plan the same thing.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from ..config import DistCAConfig, agreed_setting_names, settings_fingerprint
from ..errors import DistCAPeerError, DistCATimeoutError
from .comm import all_gather_documents

__all__ = ["DistCAPeerError", "PATH_PLAIN", "PATH_PINGPONG", "agree", "attention_dtype", "attention_signature",
           "check_headers"]

# The header's path: how a rank runs this forward.
PATH_PLAIN = 0  # the attention function, in training or evaluation (decoding never opens a collective)
PATH_PINGPONG = 2  # the ping-pong decoder stack


_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)  # codes 1.. in a signature (0: other)
_SIGNATURE_FIELDS = ("dtype", "query heads", "key/value heads", "head dim", "value head dim", "needs gradients",
                     "window of every layer", "sliding layers' window")
_UNCHECKED = (0,) * len(_SIGNATURE_FIELDS)  # a path whose shapes are fixed elsewhere (ping-pong, pipeline ticks)


def attention_dtype(device_type: str, otherwise: torch.dtype) -> torch.dtype:
    """The dtype attention computes in on ``device_type``: autocast's while autocast is on there (HF's
    eager matmuls and SDPA run in it), else ``otherwise`` (the projections' output dtype)."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else otherwise


def attention_signature(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, value_head_dim: int,
                        needs_gradients: bool, *, kv_window: int | None = None,
                        sliding_window: int | None = None) -> tuple[int, ...]:
    """What every rank's attention calls of one forward must share (``_SIGNATURE_FIELDS``): the dtype
    attention computes in, the query and key/value heads, their head sizes, whether a backward may
    follow (``torch.is_grad_enabled()``, not whether this call's tensors need gradients: which layer opens
    the forward says nothing of the later layers, a LoRA on later layers or on ``v_proj`` only), the
    window the plan cuts K/V to when every layer slides (``hf.widest_window``; 0: whole prefixes: ranks
    planning different keys exchange buffers of different sizes) and the window of the sliding layers
    planned on their own (``hf.mixed_sliding_window``; 0: none: each rank then plans, and runs the
    collectives of, one more plan)."""
    code = 1 + _DTYPES.index(dtype) if dtype in _DTYPES else 0
    return (code, int(heads), int(kv_heads), int(head_dim), int(value_head_dim), int(needs_gradients),
            int(kv_window or 0), int(sliding_window or 0))


def agree(payload: np.ndarray, path: int, error: Exception | None, config: DistCAConfig, device, number: int,
          what: str, signature: tuple[int, ...] | None = None):
    """All-gather every rank's header and ``payload`` over ``config.group``. Raises this rank's own
    ``error``, or on every rank the same ``check_headers`` error; else returns ``(headers, payloads)``
    in rank order. ``signature``: this rank's ``attention_signature`` (``None``: not compared)."""
    header = [-1 if error else payload.size, path, settings_fingerprint(config), *(signature or _UNCHECKED)]
    gather_device = device if dist.get_backend(config.group) == "nccl" else torch.device("cpu")
    try:
        headers, payloads = all_gather_documents(header, payload, config.group, gather_device, config.timeout_s,
                                                 f"distca forward {number}: {what}")
    except DistCATimeoutError as e:
        raise DistCATimeoutError(
            f"{e}\nOr a peer is alive but not running this forward: every rank of the server group opens each distca "
            "forward together (as with DDP). To run forwards on some ranks only (say, evaluation on rank 0), call "
            "distca_hf.configure(mode='colocated', span_ranks=False) there first; generate() and forwards given a KV "
            "cache need no other rank.") from e
    if error is not None:
        raise error
    check_headers(headers, number)
    return headers, payloads


def check_headers(headers, number: int) -> None:
    """Raise the same error on every rank when a rank could not describe its documents, when the
    settings differ, or when some ranks run the ping-pong stack and others not."""
    failed = [r for r, h in enumerate(headers) if h[0] < 0]
    if failed:
        raise DistCAPeerError(f"distca forward {number}: rank(s) {failed} could not describe their documents (see "
                              "their error); every rank stops this forward")
    if len({h[2] for h in headers}) > 1:
        raise ValueError(f"distca forward {number}: ranks use different settings ({', '.join(agreed_setting_names())}"
                         "); set the same DISTCA_* variables / configure() on every rank")
    pingpong = [r for r, h in enumerate(headers) if h[1] == PATH_PINGPONG]
    if pingpong and len(pingpong) != len(headers):
        others = [r for r, h in enumerate(headers) if h[1] != PATH_PINGPONG]
        raise DistCAPeerError(
            f"distca forward {number}: rank(s) {pingpong} run the ping-pong decoder stack but rank(s) {others} do "
            "not (they pass a KV cache or ask for hidden states / attentions, which ping-pong does not produce); "
            "every rank must run the same kind of forward")
    signatures = [tuple(h[3:]) for h in headers]
    if len(set(signatures) - {_UNCHECKED}) > 1:
        fields = [f for i, f in enumerate(_SIGNATURE_FIELDS) if len({s[i] for s in signatures if s != _UNCHECKED}) > 1]
        described = "; ".join(f"rank {r}: {_described(s)}" for r, s in enumerate(signatures) if s != _UNCHECKED)
        raise ValueError(
            f"distca forward {number}: the ranks' attention calls differ in {', '.join(fields)} ({described}); every "
            "rank must run the same model in the same dtype (cast every rank's model alike, or autocast on all of "
            "them), and run this forward with gradients on all ranks or on none (torch.no_grad / eval alike)")


def _described(signature: tuple[int, ...]) -> str:
    dtype = str(_DTYPES[signature[0] - 1]).removeprefix("torch.") if signature[0] else "another dtype"
    return (f"{dtype}, {signature[1]} / {signature[2]} heads, head dim {signature[3]} / {signature[4]}, "
            f"{'with' if signature[5] else 'without'} gradients"
            + (f", every layer's window {signature[6]}" if signature[6] else "")
            + (f", sliding layers' window {signature[7]}" if signature[7] else ""))
