"""One build of the CPU kernels per machine, coordinated through files in its build folder, so
that an engine can start at once on the torch path while the build runs in the background.

Beside torch's own files, the folder (worker/host/cpu_kernels.py names it) holds:

- ``conveyor-build.lock``: locked (``flock``) by the one process that builds; a start that finds
  it locked does not wait, it serves on the torch path.
- ``conveyor-built``: written once a build has loaded: the next start loads it at once.
- ``conveyor-build-failed``: why the last build failed (no C++ compiler, no ninja): starts keep
  to the torch path and say why instead of trying again; a foreground build tries again.
- ``conveyor-build.log``: what the background builder printed.

The lock is on an open file, not a process, so whoever takes it can hand it to the builder
(a child process inherits it) and the lock ends when the builder exits, however it ends.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

LOCK = "conveyor-build.lock"
BUILT = "conveyor-built"
FAILED = "conveyor-build-failed"
LOG = "conveyor-build.log"

# Where a build stands for a start (start_in_background's answer).
READY = "ready"        # built: load it
FAILED_STATE = "failed"  # it cannot be built here: keep to torch
BUILDING = "building"  # another process builds it now
STARTED = "started"    # this start handed the build to a background builder


class BuildFolder:
    """The build folder of one build key and the markers above."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def log(self) -> Path:
        return self.path / LOG

    def built(self) -> bool:
        return (self.path / BUILT).exists()

    def failure(self) -> str | None:
        """Why the last build failed, or None where none has."""
        try:
            return (self.path / FAILED).read_text()
        except FileNotFoundError:
            return None

    def try_lock(self) -> int | None:
        """A file descriptor holding the build lock, or None where another holds it."""
        fd = self._open_lock()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

    def lock(self) -> int:
        """A file descriptor holding the build lock, once whoever holds it lets go."""
        fd = self._open_lock()
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd

    def build_under_lock(self, build: Callable[[], T]) -> T:
        """``build()`` (the caller holds the lock), marking the folder built or failed."""
        try:
            result = build()
        except Exception as exc:
            (self.path / FAILED).write_text(f"{type(exc).__name__}: {exc}")
            (self.path / BUILT).unlink(missing_ok=True)
            raise
        (self.path / FAILED).unlink(missing_ok=True)
        (self.path / BUILT).touch()
        return result

    def _open_lock(self) -> int:
        self.path.mkdir(parents=True, exist_ok=True)
        return os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)


def start_in_background(folder: BuildFolder, spawn: Callable[[int], None]) -> str:
    """Where the build stands (READY, FAILED_STATE, BUILDING), or STARTED: nobody was building
    it, and ``spawn(fd)`` was handed the lock to build it in the background. ``spawn`` must keep
    its own copy of ``fd`` (a child process inherits one, a thread takes ``os.dup(fd)``): this
    one is closed on return. Never waits for a build."""
    if folder.built():
        return READY
    if folder.failure() is not None:
        return FAILED_STATE
    fd = folder.try_lock()
    if fd is None:
        return BUILDING
    try:
        # It may have ended between the checks above and the lock.
        if folder.built():
            return READY
        if folder.failure() is not None:
            return FAILED_STATE
        spawn(fd)
        return STARTED
    finally:
        os.close(fd)
