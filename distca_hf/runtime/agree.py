"""The collective that opens a forward: every rank of the server group learns what the others hold
and how they want to run, so that all of them take the same decision.

Each rank all-gathers a header ``(payload size or -1 when its inputs were invalid, path, settings
fingerprint)`` and an int64 payload (its document lengths; for ping-pong, its nano-batches'
description). Then every rank raises the same error when one rank's inputs were invalid, the
settings differ or only some ranks run the ping-pong stack; otherwise all go on with the same
payloads, so they plan the same thing.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from ..config import DistCAConfig, agreed_setting_names, settings_fingerprint
from ..errors import DistCAPeerError, DistCATimeoutError
from .comm import all_gather_documents

__all__ = ["DistCAPeerError", "PATH_PLAIN", "PATH_PINGPONG", "agree", "check_headers"]

# The header's path: how a rank runs this forward.
PATH_PLAIN = 0  # the attention function, in training or evaluation (decoding never opens a collective)
PATH_PINGPONG = 2  # the ping-pong decoder stack


def agree(payload: np.ndarray, path: int, error: Exception | None, config: DistCAConfig, device, number: int,
          what: str):
    """All-gather every rank's header and ``payload`` over ``config.group``. Raises this rank's own
    ``error``, or on every rank the same ``check_headers`` error; else returns ``(headers, payloads)``
    in rank order."""
    header = [-1 if error else payload.size, path, settings_fingerprint(config)]
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
