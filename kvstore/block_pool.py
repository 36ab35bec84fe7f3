"""Physical KV block ids: ref counts, a free list in LRU order, and the prefix cache index.

Knows nothing of tokens or torch. A free block may still hold a cached prefix block: it
stays findable by its hash until it is handed out again (evicted), least recently used first.
"""

from __future__ import annotations

import random
from collections import OrderedDict

from kvstore.prefix_hash import BlockHash


class OutOfBlocksError(RuntimeError):
    """Raised when more blocks are asked for than are free (callers check first)."""


class BlockPool:
    """Hands out block ids ``0 .. num_blocks - 1`` and takes them back.

    A block is free when its reference count is zero; free blocks are handed out
    least recently freed first. ``shuffle_seed`` hands blocks out in a scrambled
    order, which tests use to prove that nothing depends on blocks being contiguous.
    """

    def __init__(self, num_blocks: int, shuffle_seed: int | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        order = list(range(num_blocks))
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(order)
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(order)
        self._ref_counts = [0] * num_blocks
        self._hash_of: dict[int, BlockHash] = {}
        self._block_of: dict[BlockHash, int] = {}
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks with no reference, cached ones included."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks, free or not, that hold a findable prefix block."""
        return len(self._hash_of)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def free_block_ids(self) -> list[int]:
        return list(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks, each with one reference; cached ones lose their hash."""
        if n > len(self._free):
            raise OutOfBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        ids = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            if b in self._hash_of:
                del self._block_of[self._hash_of.pop(b)]
                self.num_evictions += 1
            self._ref_counts[b] = 1
            ids.append(b)
        return ids

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; blocks that reach zero become free (most recent)."""
        for b in block_ids:
            if self._ref_counts[b] <= 0:
                raise ValueError(f"block {b} freed more often than allocated")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free[b] = None

    # ----- prefix cache -----

    def lookup(self, h: BlockHash) -> int | None:
        """The block holding the prefix block with this hash, if it is still cached."""
        return self._block_of.get(h)

    def share(self, block_id: int) -> None:
        """Take one more reference to a cached block (reviving it if it was free)."""
        if self._ref_counts[block_id] == 0:
            del self._free[block_id]
        self._ref_counts[block_id] += 1

    def register(self, block_id: int, h: BlockHash) -> None:
        """Record that a live block now holds the full prefix block ``h``."""
        if self._ref_counts[block_id] <= 0:
            raise ValueError(f"block {block_id} is not in use")
        if h in self._block_of or block_id in self._hash_of:
            return  # an identical block is already cached, or this one already is
        self._block_of[h] = block_id
        self._hash_of[block_id] = h

    def check_invariants(self) -> None:
        """Assert the pool's internal consistency (tests call this after every step)."""
        free = set(self._free)
        assert len(free) == len(self._free)
        for b in range(self.num_blocks):
            assert (self._ref_counts[b] == 0) == (b in free), f"block {b} free-list mismatch"
            assert self._ref_counts[b] >= 0
        for h, b in self._block_of.items():
            assert self._hash_of[b] == h
        assert len(self._block_of) == len(self._hash_of)
