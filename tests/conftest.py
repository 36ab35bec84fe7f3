"""Shared fixtures: locally made checkpoints and transformers references."""

from __future__ import annotations

import os

import pytest


def pytest_configure(config):
    # Tests share two cores with worker subprocesses and each other: with more threads than
    # free cores, OpenMP's spinning threads stall each other. Benchmarks ask for their own
    # count. Without torch (the scheduler's tests run so, see test_layering) there is none.
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)
    # Without a GPU, Triton kernels run under Triton's interpreter (numpy on CPU tensors): it
    # is read when triton is first imported, so before any test imports it.
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    # The suite's engines build (or wait for) the CPU kernels rather than serve on torch.
    from worker.host.cpu_kernels import engines_wait_for_build

    engines_wait_for_build()


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """make_model(name, **kwargs) -> folder, made once per session and name."""
    from worker.modelgen import make_model

    made: dict[str, object] = {}
    root = tmp_path_factory.mktemp("models")

    def factory(name: str, **kwargs):
        if name not in made:
            made[name] = make_model(root / name, **kwargs)
        return made[name]

    return factory


@pytest.fixture(scope="session")
def tiny_llama(model_factory):
    return model_factory("llama", preset="tiny", arch="llama")


# Real Redis fixtures (a private redis-server per session, flushed before each test).
from fleet_fixtures import start_worker  # noqa: E402, F401
from gateway_fixtures import gateway  # noqa: E402, F401
from kernel_fixtures import kernels_built  # noqa: E402, F401
from redis_fixtures import each_redis, redis_client, redis_server, redis_url  # noqa: E402, F401
