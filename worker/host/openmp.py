"""One team of OpenMP threads in a worker process: the engine loop's.

libgomp, the OpenMP runtime of torch's CPU builds on Linux, keeps a pool of threads for
every thread that has run a parallel region, and once a process holds more of them than it
has CPUs it stops spinning between regions: its threads sleep, and every parallel region
of a step (a few per layer) first waits for a wake-up. A worker builds its engine on the
main thread, whose pool then stays, and steps it on the engine loop's thread, which makes
a second pool: on 2 CPUs, 4 OpenMP threads whose every region waits for a wake-up
(``python -m worker.bench.openmp_threads`` measures it; docs/cpu-kernels.md).
Releasing the main thread's pool once the engine is built leaves the loop's team alone.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

# omp_pause_resource_kind (OpenMP 5.0): a hard pause frees the calling thread's pool.
OMP_PAUSE_HARD = 2


def loaded_libgomps() -> list[str]:
    """The libgomp files this process has loaded (torch's own, and any other: a wheel may
    bring its own copy beside the system's)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    found: list[str] = []
    for line in maps.splitlines():
        fields = line.split()
        path = fields[-1] if len(fields) >= 6 else ""
        if "/libgomp" in path and ".so" in path and path not in found:
            found.append(path)
    return found


def release_thread_pool() -> bool:
    """Free the OpenMP threads this thread's parallel regions have kept, in every libgomp
    loaded (they are made again if it runs another region); False where none could."""
    released = False
    for path in loaded_libgomps():
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes = (ctypes.c_int,)
        pause.restype = ctypes.c_int
        # Each call frees this thread's pool in that runtime only; -1 inside a region.
        released = pause(OMP_PAUSE_HARD) == 0 or released
    if not released:
        log.debug("openmp threads kept: no libgomp, or called inside a parallel region")
    return released
