"""distca settings: code first, then ``DISTCA_*`` environment variables, then defaults.

Environment variables (contract) are read when a plan is made, so a job can change them between
runs without touching code; a value set with ``distca_hf.configure(...)`` (or by the Accelerate
plugin) overrides the variable. An invalid value is an error naming the variable.

    DISTCA_TOLERANCE  float >= 0     allowed max/mean - 1 of server attention load
    DISTCA_BACKWARD   saved|resend   what the servers keep for backward
    DISTCA_OVERLAP    none|wave|pingpong
    DISTCA_TIMEOUT_S  seconds > 0    how long a distca collective may wait for a peer
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields, replace

__all__ = ["DistCAConfig", "configure", "current_config", "reset_config", "setting_problem"]

BACKWARD_MODES = ("saved", "resend")
OVERLAP_MODES = ("none", "wave", "pingpong")
MODES = ("distca", "colocated")


@dataclass(frozen=True)
class DistCAConfig:
    """How distca plans and dispatches.

    Attributes:
        tolerance: allowed max/mean - 1 of attention load over servers (``DISTCA_TOLERANCE``).
        block: shard granularity in tokens (128 suits flash-attn; 1 is fine on CPU).
        backward: ``"saved"``: servers keep what their backward needs (fewer bytes); ``"resend"``:
            servers keep nothing and sources send q, k, v, out again in backward (flat server
            memory, more bytes) (``DISTCA_BACKWARD``).
        overlap: communication overlap mode (``DISTCA_OVERLAP``).
        timeout_s: seconds a distca collective may wait before raising (``DISTCA_TIMEOUT_S``).
        mode: ``"distca"`` redistributes attention; ``"colocated"`` runs each rank's own documents
            with the same kernel and no communication (the baseline of ``distca-hf bench``).
        group: the server process group (``None``: the default group).
        servers: ranks of ``group`` that serve attention (``None``: all of them).
    """

    tolerance: float = 0.02
    block: int = 1
    backward: str = "saved"
    overlap: str = "none"
    timeout_s: float = 600.0
    mode: str = "distca"
    group: object = field(default=None, compare=False)
    servers: tuple[int, ...] | None = None

    def __post_init__(self):
        for name in ("tolerance", "block", "backward", "overlap", "timeout_s", "mode", "servers"):
            problem = setting_problem(name, getattr(self, name))
            if problem:
                raise ValueError(f"distca {name} {problem}")


def setting_problem(name: str, value) -> str | None:
    """What is wrong with the value of one distca setting, as ``"must be ..., got ..."``, or ``None``.
    ``DistCAConfig`` and ``DistCAPlugin`` both check their settings with it."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if name == "tolerance" and not (number and math.isfinite(value) and value >= 0):
        return f"must be a finite number >= 0 (allowed max/mean - 1 of attention load), got {value!r}"
    if name == "block" and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return f"must be an integer >= 1 (tokens per shard block), got {value!r}"
    if name == "timeout_s" and not (number and math.isfinite(value) and value > 0):
        return f"must be a positive number of seconds, got {value!r}"
    choices = {"backward": BACKWARD_MODES, "overlap": OVERLAP_MODES, "mode": MODES}.get(name)
    if choices is not None and value not in choices:
        return f"must be one of {list(choices)}, got {value!r}"
    if name == "servers" and value is not None:
        ranks = list(value) if isinstance(value, (list, tuple)) else None
        if (not ranks or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in ranks)
                or len(set(ranks)) != len(ranks)):
            return (f"must be a non-empty list of distinct ranks >= 0 (indices into the attention-server group), "
                    f"got {value!r}")
    return None

_ENV = {
    "tolerance": ("DISTCA_TOLERANCE", float),
    "backward": ("DISTCA_BACKWARD", str),
    "overlap": ("DISTCA_OVERLAP", str),
    "timeout_s": ("DISTCA_TIMEOUT_S", float),
}
_code_settings: dict = {}


def configure(**settings) -> DistCAConfig:
    """Set distca options in code (they override ``DISTCA_*`` variables); returns the result.
    ``configure()`` with no arguments just validates the current settings."""
    names = {f.name for f in fields(DistCAConfig)}
    unknown = set(settings) - names
    if unknown:
        raise TypeError(f"unknown distca settings {sorted(unknown)}; expected some of {sorted(names)}")
    merged = {**_code_settings, **settings}
    config = _resolve(merged)  # validate before storing
    _code_settings.clear()
    _code_settings.update(merged)
    return config


def reset_config() -> None:
    """Forget settings made with ``configure`` (environment variables apply again)."""
    _code_settings.clear()


def current_config() -> DistCAConfig:
    """The settings a plan made now would use."""
    return _resolve(_code_settings)


def _resolve(code: dict) -> DistCAConfig:
    values = {}
    for name, (var, cast) in _ENV.items():
        if name in code or var not in os.environ:
            continue
        raw = os.environ[var]
        try:
            values[name] = cast(raw.strip())
            replace(DistCAConfig(), **{name: values[name]})
        except (ValueError, TypeError) as e:
            raise ValueError(f"invalid {var}={raw!r}: {e}") from None
    values.update(code)
    return DistCAConfig(**values)
