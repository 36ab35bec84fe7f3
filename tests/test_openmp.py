"""worker/host/openmp.py: a thread's OpenMP pool really is freed (its threads exit), so the engine
loop's team is the worker's only one."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from worker.host.openmp import loaded_libgomps, release_thread_pool

needs_libgomp = pytest.mark.skipif(not loaded_libgomps(),
                                   reason="torch's OpenMP runtime here is not libgomp")


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@needs_libgomp
def test_releasing_frees_the_pool_a_parallel_region_left():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    seen: dict[str, object] = {}

    def job() -> None:
        a = torch.randn(1024, 1024)
        a @ a  # a parallel region: this thread now keeps a pool of torch's threads - 1
        seen["with pool"] = _threads()
        seen["released"] = release_thread_pool()
        seen["after"] = _threads()
        a @ a  # and the next region makes one again
        seen["again"] = _threads()

    thread = threading.Thread(target=job)
    try:
        thread.start()
        thread.join()
    finally:
        torch.set_num_threads(threads)
    assert seen["released"] is True
    assert seen["after"] == seen["with pool"] - 1  # the pool's one thread besides this one
    assert seen["again"] == seen["with pool"]

