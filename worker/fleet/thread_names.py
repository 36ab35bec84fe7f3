"""The worker's threads under their own names in the OS (``top -H``, ``ps -L``, ``perf``).

Python names its threads only for itself: to the OS every thread of a worker is "python",
so nothing outside the process can tell the engine loop from the publisher. A worker
thread gives the OS its name (Linux keeps 15 bytes of it) when it starts; threads it starts
itself (the engine loop's OpenMP team) inherit it. ``conveyor bench`` reads the names back
to say how many CPU seconds each of the worker's threads used (worker/bench/run/cpu.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

PR_SET_NAME = 15  # linux/prctl.h
# The longest name Linux keeps, without its terminating NUL.
MAX_NAME_BYTES = 15


@functools.cache
def _prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    return getattr(libc, "prctl", None)


def name_this_thread(name: str) -> bool:
    """Give the calling thread ``name`` in the OS (cut to 15 bytes); False where the OS has
    no such call or refuses it (the thread is then named as before)."""
    prctl = _prctl()
    if prctl is None:
        return False
    # Cut on a character's boundary: half a character would make the name unreadable.
    raw = name.encode("utf-8", "replace")[:MAX_NAME_BYTES]
    raw = raw.decode("utf-8", "ignore").encode("utf-8")
    return prctl(PR_SET_NAME, ctypes.c_char_p(raw), 0, 0, 0) == 0
