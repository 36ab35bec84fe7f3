"""Ask Linux to back a large CPU buffer with 2 MiB pages (transparent huge pages).

A CPU decode step reads every running sequence's KV blocks, which the block pool places
anywhere in a pool of gigabytes: with 4 KiB pages each 16 KiB block spans four pages, and
the step's ~20 MiB a layer (batch 64, ~160 tokens) is far past what the TLB maps, so a good
part of the reads wait on page walks; 2 MiB pages take most of those walks away
(docs/cpu-kernels.md, "Memory").

Most Linux machines run THP in ``madvise`` mode: only ranges marked with
``madvise(MADV_HUGEPAGE)`` get huge pages, and only where the mark comes before the memory
is first touched. A pool therefore gets memory of its own, straight from ``mmap`` (malloc
might hand back heap memory that an earlier tensor already touched), marked before
anything writes to it; the kernel zero-fills it. Where the mark cannot be made (another OS,
THP off) nothing changes but the page size.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import sys

HUGE_PAGE = 2 * 1024 * 1024
MADV_HUGEPAGE = 14  # linux/mman.h


def zeroed_buffer(nbytes: int) -> memoryview:
    """``nbytes`` of zeroed memory, writable, starting on a 2 MiB boundary, whose whole
    huge pages are marked for THP before first touch. The memory is returned to the OS when
    the last reference to the view (a tensor made over it, say) is gone."""
    # Private: an anonymous mmap is shared by default, and shared memory follows shmem's THP
    # setting, not the process's.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    offset = -address % HUGE_PAGE
    advise_huge_pages(address + offset, nbytes)
    return memoryview(region)[offset:offset + nbytes]


@functools.cache
def _madvise():  # noqa: ANN202 - a ctypes function, or None
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError, TypeError):
        return None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise


def advise_huge_pages(address: int, nbytes: int) -> int:
    """Mark the whole 2 MiB pages inside ``[address, address + nbytes)`` for huge pages;
    the bytes marked (0 where the buffer holds no whole huge page or the mark failed)."""
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    madvise = _madvise()
    if madvise is None or end <= start:
        return 0
    return end - start if madvise(start, end - start, MADV_HUGEPAGE) == 0 else 0
