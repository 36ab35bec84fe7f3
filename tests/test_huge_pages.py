"""The KV pools on the CPU ask for 2 MiB pages (kvstore/huge_pages.py), and get them where
the kernel's transparent huge pages are on."""

from __future__ import annotations

import gc
import re
import weakref
from pathlib import Path

import pytest
import torch

from kvstore.huge_pages import HUGE_PAGE, advise_huge_pages, zeroed_buffer
from kvstore.kv_tensors import PagedKVCache

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The bracketed mode of /sys/.../enabled ("always", "madvise", "never"), or None."""
    try:
        found = re.search(r"\[(\w+)\]", THP_MODE.read_text())
    except OSError:
        return None
    return found.group(1) if found else None


def huge_kib_of_mapping(address: int) -> int:
    """AnonHugePages (KiB) of the mapping of this process that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_range_without_a_whole_huge_page_is_not_marked():
    assert advise_huge_pages(HUGE_PAGE + 4096, HUGE_PAGE - 8192) == 0
    assert advise_huge_pages(HUGE_PAGE + 1, HUGE_PAGE) == 0  # straddles, holds none whole


@pytest.mark.skipif(thp_mode() not in ("always", "madvise"),
                    reason="needs Linux transparent huge pages in always or madvise mode")
def test_the_cpu_kv_pools_sit_on_huge_pages():
    # 8 MiB a layer's K (256 blocks x 16 slots x 4 heads x 128 floats): whole huge pages inside.
    cache = PagedKVCache(2, 256, 16, 4, 128, torch.float32)
    for pool in (*cache.k, *cache.v):
        assert pool.count_nonzero() == 0
        pool.fill_(1.0)  # written through, where the zeros were
        assert pool.data_ptr() % HUGE_PAGE == 0
        # The kernel may fall back to small pages where memory is fragmented; it granted
        # most of the pool on every machine seen, at least one page anywhere THP is on.
        assert huge_kib_of_mapping(pool.data_ptr()) * 1024 >= HUGE_PAGE


def test_a_zeroed_buffer_is_zeros_and_writable_and_aligned():
    buffer = zeroed_buffer(3 * HUGE_PAGE + 100)
    assert len(buffer) == 3 * HUGE_PAGE + 100 and not buffer.readonly
    assert bytes(buffer[:4096]) == bytes(4096) and buffer[-1] == 0
    pool = torch.frombuffer(buffer, dtype=torch.uint8)
    pool[-1] = 7
    assert buffer[-1] == 7 and pool.data_ptr() % HUGE_PAGE == 0


def test_a_pool_outlives_the_names_of_its_buffer():
    # torch.frombuffer keeps the buffer alive: the tensor is all that holds the memory.
    pool = torch.frombuffer(zeroed_buffer(HUGE_PAGE), dtype=torch.float32)
    gc.collect()
    pool.fill_(2.0)
    assert float(pool.sum()) == 2.0 * HUGE_PAGE / 4
    buffer = zeroed_buffer(HUGE_PAGE)
    held = weakref.ref(buffer.obj)  # the mmap behind the view
    pool = torch.frombuffer(buffer, dtype=torch.float32)
    del buffer
    gc.collect()
    assert held() is not None
    del pool
    gc.collect()
    assert held() is None  # the last tensor gone, the memory goes back to the OS
