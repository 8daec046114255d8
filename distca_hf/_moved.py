"""Old module paths of distca_hf 0.1, kept importable for one release.

0.2 sorted the flat modules into subpackages that follow the data path. ``import distca_hf.planner``
(and every other path below) still works: it returns the module's new home and warns once with a
``DeprecationWarning`` naming it. These aliases go away in 0.3.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

__all__ = ["MOVED", "install"]

MOVED = {
    "distca_hf.documents": "distca_hf.planning.documents",
    "distca_hf.cost": "distca_hf.planning.cost",
    "distca_hf.tasks": "distca_hf.planning.tasks",
    "distca_hf.planner": "distca_hf.planning",
    "distca_hf.layout": "distca_hf.planning",
    "distca_hf.comm": "distca_hf.runtime.comm",
    "distca_hf.timeline": "distca_hf.runtime.timeline",
    "distca_hf.step": "distca_hf.runtime",
    "distca_hf.dispatch": "distca_hf.runtime",
    "distca_hf.pingpong": "distca_hf.runtime.pingpong",
    "distca_hf.attention": "distca_hf.hf",
    "distca_hf.plugin": "distca_hf.training.plugin",
    "distca_hf.topology": "distca_hf.training.topology",
    "distca_hf.data": "distca_hf.training",
    "distca_hf.accelerate": "distca_hf.training.accelerator",
    "distca_hf.trainer": "distca_hf.training.trainer",
    "distca_hf.launch": "distca_hf.training.launch_checks",
    "distca_hf.launcher": "distca_hf.tools.launch",
    "distca_hf.cli": "distca_hf.tools.cli",
    "distca_hf.bench": "distca_hf.tools.bench",
    "distca_hf.simulate": "distca_hf.tools.simulate",
    "distca_hf.profile": "distca_hf.tools.profiling",
    "distca_hf.kernels.benchmark": "distca_hf.tools.kernel_bench",
}


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        warnings.warn(f"{spec.name} moved to {self.new}; the old path goes away in distca_hf 0.3",
                      DeprecationWarning, stacklevel=3)
        return importlib.import_module(self.new)

    def exec_module(self, module):
        pass  # the new module is already executed


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED:
            return importlib.util.spec_from_loader(fullname, _Alias(MOVED[fullname]))
        return None


def install() -> None:
    """Put the finder of old paths on ``sys.meta_path`` (idempotent)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
