"""The one place that holds distca's process-wide mutable state.

Everything distca keeps between calls lives in ``STATE`` (one per process): the settings given in
code or by a plugin, the per-forward context that the attention layers of one forward share and
``plan_stats()`` reads, the counter that numbers forwards, the one-time warnings already given, and
the timeline's recording switch and events. Modules read and write it only through the functions
that own each part (``config.configure``, ``runtime.context``, ``runtime.timeline``,
``warn_once``); tests reset it with ``reset_state()``.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass, field

__all__ = ["DistCAState", "STATE", "reset_state", "warn_once"]


@dataclass
class DistCAState:
    """distca's state in this process.

    Attributes:
        code_settings: settings made with ``distca_hf.configure`` (they beat ``DISTCA_*`` variables).
        plugin_settings: the ``code_settings`` the last ``DistCAPlugin.attach`` made (the next attach
            tells them from settings a user made with ``configure`` since, which it names as it drops).
        file_settings: settings of a ``distca:`` YAML section applied by ``DistCAPlugin.attach``
            (below the variables).
        forward: the ``runtime.context.ForwardContext`` of the forward in progress, or of the last
            one (``plan_stats()`` reads it); ``None`` before the first distca forward.
        forwards_started: forwards numbered so far (a forward's number is its ``plan_stats()["step"]``).
        last_layer_idx: layer index of the last attention call; an index that does not grow marks
            the start of a new forward.
        calls_without_documents: attention calls so far whose document arguments (own or their
            model's) showed no boundary: no ``cu_seq_lens``, no ``position_ids`` that restart;
            ``hf.model_inputs`` refuses a packed model forward during which it grew.
        decoding: what decodes right now (a ``generate()`` call, a model forward given a KV cache),
            innermost last; forwards opened meanwhile compute on this rank alone
            (``runtime.forward.decoding``).
        warned: keys of the one-time warnings already given.
        timeline_on: whether ``runtime.timeline`` records.
        timeline_events: what it recorded (``runtime.timeline.Event``).
        lock: guards ``timeline_events``; collective completion callbacks run on backend threads.
        exit_hook_registered: whether ``runtime.shutdown`` registered its ``atexit`` hook (which
            closes the process groups before the interpreter shuts down).
        pinned_forward: a ``ForwardContext`` planned ahead (a tick of ``pipeline_schedule="cad_1f1b"``)
            that every attention call made meanwhile uses instead of opening one
            (``runtime.context.pinned_forward``).
    """

    code_settings: dict = field(default_factory=dict)
    plugin_settings: dict = field(default_factory=dict)
    file_settings: dict = field(default_factory=dict)
    forward: object = None
    forwards_started: int = 0
    last_layer_idx: int | None = None
    calls_without_documents: int = 0
    decoding: list = field(default_factory=list)
    warned: set = field(default_factory=set)
    timeline_on: bool = False
    timeline_events: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    exit_hook_registered: bool = False
    pinned_forward: object = None


STATE = DistCAState()


def reset_state() -> None:
    """Forget everything: settings, forwards, warnings, timeline (tests and notebooks)."""
    fresh = DistCAState()
    for name in fresh.__dataclass_fields__:
        setattr(STATE, name, getattr(fresh, name))


def warn_once(key: str, message: str, stacklevel: int = 3) -> None:
    """``warnings.warn(message)`` the first time ``key`` is seen in this process."""
    if key not in STATE.warned:
        STATE.warned.add(key)
        warnings.warn(message, stacklevel=stacklevel)
