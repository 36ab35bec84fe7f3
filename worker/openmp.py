"""One team of OpenMP threads in a worker process: the engine loop's.

libgomp, the OpenMP runtime of torch's CPU builds on Linux, keeps a pool of threads for
every thread that has run a parallel region, and once a process holds more of them than it
has CPUs it stops spinning between regions: its threads sleep, and every parallel region
of a step (a few per layer) first waits for a wake-up. A worker builds its engine on the
main thread, whose pool then stays, and steps it on the engine loop's thread, which makes
a second pool: on 2 CPUs, 4 OpenMP threads, and decode steps 25-40% slower than the same
steps of the offline engine (``python -m worker.bench.openmp_threads`` shows it).
Releasing the main thread's pool once the engine is built leaves the loop's team alone.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

# omp_pause_resource_kind (OpenMP 5.0): a hard pause frees the calling thread's pool.
OMP_PAUSE_HARD = 2


def loaded_libgomp() -> str | None:
    """The path of the libgomp this process has loaded (torch's own), or None."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split()[-1] if line.split() else ""
        if "/libgomp" in path and ".so" in path:
            return path
    return None


def release_thread_pool() -> bool:
    """Free the OpenMP threads this thread's parallel regions have kept (they are made again
    if it runs another); False where the runtime is not libgomp or cannot."""
    path = loaded_libgomp()
    if path is None:
        return False
    try:
        pause = ctypes.CDLL(path).omp_pause_resource_all
    except (OSError, AttributeError):
        return False
    pause.argtypes = (ctypes.c_int,)
    pause.restype = ctypes.c_int
    released = pause(OMP_PAUSE_HARD) == 0
    if not released:
        log.debug("openmp threads kept: called inside a parallel region")
    return released
