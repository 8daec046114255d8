"""Test tiers and shared fixtures.

Tiers (markers registered in setup.cfg):
- fast: everything unmarked; in-process, no spawned processes (``pytest -m "not distributed"``);
- ``distributed``: spawns processes (gloo ranks through ``dist_harness.run_ranks``, ``accelerate
  launch``, the ``distca-hf`` command);
- ``gpu``: needs CUDA; skipped on machines without it.

Every test starts from a fresh distca state (no setting, forward or warning left by another test).
"""

from __future__ import annotations

import os

# One OpenMP thread, set before torch loads: dist_harness's fork server inherits it, so importing
# torch there starts no thread pool that its forked ranks would find broken (dist_harness.start_method).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

# No per-example deadline: hypothesis's default (200 ms) fails a test whose example met a stall of a
# loaded machine, not a bug (all but one @given here said deadline=None themselves).
settings.register_profile("distca", deadline=None)
# CI (.ci/run) draws the same examples on every run: a merge lands or not on its own change, not on a new
# draw that finds an old weakness (a clean clone once met one: tests/test_rehome.py, seed 89). Everywhere
# else, `make test` draws afresh each run, which is how such weaknesses are found.
settings.register_profile("ci", parent=settings.get_profile("distca"), derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("DISTCA_HYPOTHESIS_PROFILE", "distca"))

from distca_hf.state import reset_state


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def fresh_distca_state():
    reset_state()
    yield
    reset_state()
