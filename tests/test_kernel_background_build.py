"""The CPU kernels built in the background (worker/host/kernel_build.py, cpu_kernels.py): an
engine that finds them not built starts at once on the torch path and keeps it for its
process's life, one builder per machine builds them, and the next start loads the build.
Real builds take minutes: the coordination runs here with a fake build injected."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
from kernel_fixtures import needs_kernel

import worker.host.cpu_kernels as loader
from producer.settings import CPU_KERNELS
from worker.engine.engine import Engine
from worker.host.kernel_build import (
    BUILDING,
    FAILED_STATE,
    READY,
    STARTED,
    BuildFolder,
    start_in_background,
)

STARTERS = 4


class FakeBuilder:
    """A spawn for start_in_background: a thread that holds the lock it is handed and runs
    ``build`` under it once ``release`` is set."""

    def __init__(self, folder: BuildFolder, build) -> None:
        self.folder, self.build = folder, build
        self.release = threading.Event()
        self.threads: list[threading.Thread] = []

    def __call__(self, lock_fd: int) -> None:
        own = os.dup(lock_fd)  # the starter closes its copy on return

        def run() -> None:
            self.release.wait()
            try:
                self.folder.build_under_lock(self.build)
            except RuntimeError:
                pass  # marked failed: what the test looks at
            finally:
                os.close(own)

        thread = threading.Thread(target=run)
        thread.start()
        self.threads.append(thread)

    def finish(self) -> None:
        self.release.set()
        for thread in self.threads:
            thread.join()


def test_concurrent_starters_build_once_and_none_waits(tmp_path):
    folder = BuildFolder(tmp_path / "build")
    builds = []
    builder = FakeBuilder(folder, lambda: builds.append("built"))
    barrier = threading.Barrier(STARTERS)
    states: list[str] = []

    def starter() -> None:
        barrier.wait()
        states.append(start_in_background(folder, builder))

    threads = [threading.Thread(target=starter) for _ in range(STARTERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()  # every starter returned while the build still holds the lock
    assert folder.try_lock() is None and not folder.built()
    assert sorted(states) == sorted([STARTED] + [BUILDING] * (STARTERS - 1))
    builder.finish()
    assert builds == ["built"]
    assert folder.built()
    assert start_in_background(folder, builder) == READY
    assert len(builder.threads) == 1


def test_a_failed_build_is_not_started_again_by_starts_and_says_why(tmp_path):
    folder = BuildFolder(tmp_path / "build")

    def no_compiler() -> None:
        raise RuntimeError("no C++ compiler")

    builder = FakeBuilder(folder, no_compiler)
    assert start_in_background(folder, builder) == STARTED
    builder.finish()
    assert not folder.built()
    assert start_in_background(folder, builder) == FAILED_STATE
    assert len(builder.threads) == 1
    assert "no C++ compiler" in folder.failure()


def test_the_build_lock_ends_with_the_process_holding_it(tmp_path):
    folder = BuildFolder(tmp_path / "build")
    fd = folder.try_lock()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                              pass_fds=(fd,))
    os.close(fd)
    try:
        assert folder.try_lock() is None  # the child holds it now
    finally:
        holder.kill()
        holder.wait()
    fd = folder.try_lock()
    assert fd is not None  # a builder that died leaves no lock behind
    os.close(fd)


@pytest.fixture
def fresh_process(tmp_path, monkeypatch):
    """This process as if just started, on a machine whose kernels were never built; the
    build is fake: a sentinel module, counted."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    monkeypatch.setenv(CPU_KERNELS.name, "1")
    monkeypatch.setattr(loader, "_loaded", {})
    monkeypatch.setattr(loader, "_engines_wait", False)
    compiled: list[str] = []
    module = object()

    def fake_compile(path):
        compiled.append(path.name)
        return module

    monkeypatch.setattr(loader, "_compile", fake_compile)
    builder = FakeBuilder(loader.build_folder(), lambda: loader._compile(
        loader.build_folder().path))
    monkeypatch.setattr(loader, "_spawn_builder", builder)
    yield builder, compiled, module
    builder.finish()


def test_an_engine_start_keeps_to_torch_for_its_process_and_the_next_start_loads_the_build(
        fresh_process, monkeypatch):
    builder, compiled, module = fresh_process
    assert not loader.build_folder().built()
    assert loader.engine_kernels() is None  # at once: the build runs in the background
    assert len(builder.threads) == 1 and compiled == []
    builder.finish()
    assert loader.build_folder().built() and len(compiled) == 1
    # Built now, yet this process keeps the torch path, for the engine and every other user.
    assert loader.engine_kernels() is None
    assert loader.cpu_kernels() is None
    monkeypatch.setattr(loader, "_loaded", {})  # the next start
    assert loader.engine_kernels() is module
    assert len(builder.threads) == 1  # loaded, not built again


def test_a_direct_user_builds_the_kernels_and_waits(fresh_process):
    builder, compiled, module = fresh_process
    assert not loader.build_folder().built()
    assert loader.cpu_kernels() is module
    assert builder.threads == [] and loader.build_folder().built()


def test_in_the_tests_engines_wait_for_the_build(fresh_process, monkeypatch):
    builder, compiled, module = fresh_process
    monkeypatch.setattr(loader, "_engines_wait", True)
    assert loader.engine_kernels() is module
    assert builder.threads == []


def _greedy(model_dir) -> tuple[list[list[int]], int]:
    engine = Engine(model_dir, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=64)
    try:
        done = engine.generate(["the river", "a lighthouse at dawn", "bees"],
                               {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True})
        return [c.token_ids for c in done], engine.model.num_native_steps
    finally:
        engine.close()


@needs_kernel
def test_an_engine_whose_kernels_are_not_built_starts_on_torch_with_the_same_greedy_tokens(
        tiny_llama, request):
    kernel_tokens, native_steps = _greedy(tiny_llama)
    assert native_steps > 0  # the reference took the kernels
    builder, compiled, module = request.getfixturevalue("fresh_process")
    assert not loader.build_folder().built()
    torch_tokens, native_steps = _greedy(tiny_llama)
    assert native_steps == 0 and loader.cpu_kernels() is None  # it served on the torch path
    assert len(builder.threads) == 1 and compiled == []  # and left the build to a builder
    assert torch_tokens == kernel_tokens


def test_the_background_builder_is_a_process_of_its_own_that_takes_the_lock_along(
        tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    # Switched off in the builder it starts (the environment is inherited): it builds
    # nothing, so the test sees the lock handed over and let go, not a minutes-long build.
    monkeypatch.setenv(CPU_KERNELS.name, "0")
    folder = loader.build_folder()
    assert start_in_background(folder, loader._spawn_builder) == STARTED
    assert not loader.wait_for_build()  # waited for the builder to exit; it built nothing
    assert "cpu kernels: unavailable" in folder.log.read_text()
    fd = folder.try_lock()
    assert fd is not None
    os.close(fd)
