"""Shared pytest configuration: Hypothesis profiles and the ``gpu`` marker.

Hypothesis profile, chosen with the environment variable ``HYPOTHESIS_PROFILE``:

- ``dev`` (default): 15 examples per test, for a quick local loop;
- ``ci``: 40 examples, no deadline, the failing example's reproduction blob printed;
- ``thorough``: 300 examples, for a long run before a release or after touching a kernel.

Tests marked ``@pytest.mark.gpu`` are skipped with the reason "no usable CUDA GPU"
unless ``flashcupy.interop.gpu_usable()`` (CuPy imports and sees a device).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=False,
    print_blob=True,
)
settings.register_profile("dev", max_examples=15, deadline=None)
settings.register_profile("thorough", max_examples=300, deadline=None)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "dev")
settings.load_profile(PROFILE)


def pytest_report_header(config):
    return f"hypothesis profile: {PROFILE} (set HYPOTHESIS_PROFILE to dev, ci or thorough)"


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    from flashcupy.interop import gpu_usable

    if gpu_usable():
        return
    skip = pytest.mark.skip(reason="no usable CUDA GPU")
    for item in gpu_items:
        item.add_marker(skip)
