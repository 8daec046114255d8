"""distca's exceptions, in one place so that every stage can raise any of them.

Each names what went wrong and what to do; the stage that raises it is in parentheses.
"""

from __future__ import annotations

__all__ = ["DocumentBoundaryError", "UnsupportedAttentionError", "DistCAPeerError", "DistCATimeoutError",
           "LaunchError"]


class DocumentBoundaryError(ValueError):
    """The inputs do not describe a set of causal documents distca can compute exactly (planning)."""


class UnsupportedAttentionError(ValueError):
    """The model asks for an attention feature that distca cannot compute exactly (hf, runtime)."""


class DistCAPeerError(RuntimeError):
    """Another rank could not take part in this forward; its own error says why (runtime)."""


class DistCATimeoutError(RuntimeError):
    """A distca collective did not complete: a peer died, hung or diverged (runtime)."""


class LaunchError(RuntimeError):
    """The processes that run are not the processes the launch asked for (training)."""
