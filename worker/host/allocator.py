"""Keep large host allocations in the heap, so a CPU step does not pay page faults.

glibc serves every allocation above its mmap threshold (128 KiB, rising only as such
blocks are freed) with a fresh mmap, and returns it to the kernel on free. A CPU step
makes many tensors of megabytes (logits are 64 x 32,000 floats: 8 MiB), so each one costs
a page fault per 4 KiB on first touch: at a 32,000-token vocabulary that was a fifth of a
sampled step. With the threshold at its maximum (32 MiB) and freed memory kept in the heap,
the same blocks are reused step after step. Measured in docs/benchmarks.md ("Sampling").

Linux with glibc only; elsewhere nothing happens. The process keeps up to
``TRIM_THRESHOLD`` of freed memory instead of returning it at once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import structlog

log = structlog.get_logger(__name__)

# mallopt parameters (malloc.h) and the values set.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's largest allowed value on 64-bit
TRIM_THRESHOLD = 1024 * 1024 * 1024


@functools.cache
def keep_large_allocations_in_heap() -> bool:
    """Tune glibc's malloc once per process; whether it was done."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    log.debug("host allocator tuned", done=done)
    return done
