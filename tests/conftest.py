"""Test configuration: Hypothesis profiles and the ``gpu`` marker.

Hypothesis profile, chosen by the environment variable ``HYPOTHESIS_PROFILE``:

- ``ci`` (default): derandomized, 50 examples per property, so CI is reproducible and fast;
- ``gpu``: 300 examples, for the GPU test machine;
- ``thorough``: 3000 examples, for hunting bugs before a release.

The profiles live here only: no test file picks its own number of examples (the planted-bug
tests of tests/test_testing.py excepted: they assert that a bug is found within a fixed number,
so that number is the test).

Tests marked ``gpu`` are skipped, with the reason, when CuPy cannot be imported or sees no
CUDA device; ``pytest -m gpu`` selects them.
"""

from __future__ import annotations

import functools
import os

import pytest
from hypothesis import settings

# JAX (the interop tests) takes 75% of the GPU's memory at its first array unless told not to:
# with several test processes on one GPU (pytest -n), the second would find none left.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

settings.register_profile("ci", derandomize=True, max_examples=50, deadline=None,
                          print_blob=True)
settings.register_profile("gpu", max_examples=300, deadline=None, print_blob=True)
settings.register_profile("thorough", max_examples=3000, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped when none is usable)")


@functools.cache
def cuda_unavailable_reason() -> str | None:
    """Why no CUDA device can be used here, in the words the command line uses ("no CUDA GPU
    found", an old driver with both versions, CuPy missing), or None when one can."""
    from cuflash._cli_common import usable_gpu
    return usable_gpu()[1]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    reason = cuda_unavailable_reason() if gpu_items else None
    if reason is not None:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def _fresh_plans_after_overrides():
    """CUFLASH_* overrides are read when a plan is built, and plans are cached: forget the
    plans after each test, so that one a test built under an override (monkeypatched
    environment) never serves the next test."""
    yield
    import sys
    api = sys.modules.get("cuflash._api")
    if api is not None:
        api.clear_plans()
