"""Physical KV block ids: a free list and reference counts. Knows nothing of tokens or torch."""

from __future__ import annotations

import random
from collections import deque


class OutOfBlocksError(RuntimeError):
    """Raised when more blocks are asked for than are free (callers check first)."""


class BlockPool:
    """Hands out block ids ``0 .. num_blocks - 1`` and takes them back.

    A block is free when its reference count is zero. ``shuffle_seed`` hands
    blocks out in a scrambled order, which tests use to prove that nothing
    depends on blocks being contiguous.
    """

    def __init__(self, num_blocks: int, shuffle_seed: int | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        order = list(range(num_blocks))
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(order)
        self._free: deque[int] = deque(order)
        self._ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def free_block_ids(self) -> list[int]:
        return list(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks, each with a reference count of one."""
        if n > len(self._free):
            raise OutOfBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        ids = [self._free.popleft() for _ in range(n)]
        for b in ids:
            self._ref_counts[b] = 1
        return ids

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; blocks that reach zero become free."""
        for b in block_ids:
            if self._ref_counts[b] <= 0:
                raise ValueError(f"block {b} freed more often than allocated")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free.append(b)
