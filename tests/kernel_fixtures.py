"""The CPU kernels (worker/host/cpu_kernels.py) in the tests: a test that needs them skips on a
developer's machine that cannot build them (no C++ compiler) and fails under CI=true, where
they must build, so a skip would hide untested kernels. The session builds them, or waits for
the background build scripts/setup.sh starts: its engines too (conftest.py), never quietly
serving on the torch path meanwhile."""

from __future__ import annotations

import os

import pytest

from worker.host.cpu_kernels import cpu_kernels

MISSING = "no C++ toolchain to build the CPU kernels"


def kernels_missing() -> None:
    """Skip the calling test, or fail it under CI=true."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{MISSING} (CI=true: scripts/setup.sh should have built them)")
    pytest.skip(MISSING)


@pytest.fixture
def kernels_built() -> None:
    if cpu_kernels() is None:
        kernels_missing()


# Marks a test that needs the kernels (see kernels_missing).
needs_kernel = pytest.mark.usefixtures("kernels_built")
