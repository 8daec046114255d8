"""Work that waits until transformers imports a module: what keeps ``import distca_hf`` cheap.

``import distca_hf`` promises that ``attn_implementation="distca"`` works (contract: attention
registration), but the modules it registers with (``transformers.modeling_utils``,
``transformers.masking_utils``) import torch and take seconds, which every ``--help`` of a script
would pay. Nothing can ask for an attention implementation before ``transformers.modeling_utils``
exists, so the registration runs the moment transformers finishes importing it (now, if it already
has); likewise the ping-pong decoder stacks are wrapped when their family's modeling module is
imported. ``install`` puts a finder on ``sys.meta_path`` that lets the usual finders find these
modules and runs the waiting work right after the module's own code.
"""

from __future__ import annotations

import importlib.abc
import sys

__all__ = ["install"]


def _register_attention(name: str) -> None:
    from .hf import register_attention

    register_attention()


def _register_mask(name: str) -> None:
    from .hf import register_mask

    register_mask()


def _watch_generation(name: str) -> None:
    from .hf.decoding import watch_generation

    watch_generation()


def _wrap_decoder_stack(name: str) -> None:
    from . import patches

    if name in patches.DECODER_STACK_MODULES:
        patches.install(modules=(name,))


def _action(name: str):
    """What to run once the module ``name`` has been executed, or ``None``."""
    if name == "transformers.modeling_utils":
        return _register_attention
    if name == "transformers.masking_utils":
        return _register_mask
    if name == "transformers.generation.utils":
        return _watch_generation
    if name.startswith("transformers.models.") and name.rpartition(".")[2].startswith("modeling_"):
        return _wrap_decoder_stack
    return None


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: asks the finders after it, and makes the loader of a watched module
    run its action after the module's code (once; the loader is left as it was)."""

    def find_spec(self, fullname, path=None, target=None):
        action = _action(fullname)
        if action is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        own_exec = getattr(loader, "exec_module", None)
        if own_exec is None or "exec_module" in getattr(loader, "__dict__", {"exec_module": None}):
            return spec  # a loader we cannot wrap (no instance attributes), or already wrapped

        def exec_module(module):
            try:
                own_exec(module)
            finally:
                del loader.exec_module  # back to the loader's own method
            action(fullname)

        loader.exec_module = exec_module
        return spec


def install() -> None:
    """Run the actions for watched modules already imported, and watch for the others (idempotent)."""
    if not any(isinstance(f, _AfterImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImportFinder())
    for name in list(sys.modules):
        action = _action(name)
        module = sys.modules.get(name)
        if action is not None and module is not None and not _initialising(module):
            action(name)


def _initialising(module) -> bool:
    """Whether ``module`` is still executing its own code (``spec._initializing``, set by importlib)."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))
